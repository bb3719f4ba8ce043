/*
 * dtype_isa — private: the per-ISA array kernels behind dtype.h. The scalar
 * ones live in dtype.c, the others in dtype_avx2.c and dtype_avx512.c, which
 * are compiled for their ISA and called only after cpu_clamp_isa() said the
 * CPU has it. Each takes the arguments of the public function of the same verb,
 * with `src` / `dst` already checked by dtype_valid().
 */
#ifndef ZSHARD_COMMON_DTYPE_ISA_H
#define ZSHARD_COMMON_DTYPE_ISA_H

#include <stddef.h>

#include "zshard/zshard.h"

void dtype_scalar_to_f32(zs_dtype src, const void *in, float *out, size_t n);
void dtype_scalar_from_f32(zs_dtype dst, const float *in, void *out, size_t n);
void dtype_scalar_accumulate(zs_dtype src, const void *in, float *acc, size_t n);
void dtype_avx2_to_f32(zs_dtype src, const void *in, float *out, size_t n);
void dtype_avx2_from_f32(zs_dtype dst, const float *in, void *out, size_t n);
void dtype_avx2_accumulate(zs_dtype src, const void *in, float *acc, size_t n);
void dtype_avx512_to_f32(zs_dtype src, const void *in, float *out, size_t n);
void dtype_avx512_from_f32(zs_dtype dst, const float *in, void *out, size_t n);
void dtype_avx512_accumulate(zs_dtype src, const void *in, float *acc, size_t n);

#endif
