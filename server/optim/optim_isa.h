/*
 * optim_isa — private: the per-ISA kernels behind optim.h, compiled for their
 * ISA (optim_avx2.c, optim_avx512.c) and called only after cpu_clamp_isa() said
 * the CPU has it.
 */
#ifndef ZSHARD_SERVER_OPTIM_ISA_H
#define ZSHARD_SERVER_OPTIM_ISA_H

#include "server/optim/optim.h"

void optim_avx2_apply(const optim_plan *plan, float *master, float *m, float *v, float *acc,
                      void *low, size_t n);
void optim_avx512_apply(const optim_plan *plan, float *master, float *m, float *v, float *acc,
                        void *low, size_t n);
double optim_avx2_sum_squares(const float *acc, size_t n);
double optim_avx512_sum_squares(const float *acc, size_t n);

#endif
