/*
 * stream — see stream.h. The ISA variants are the same loop compiled with -O3
 * for each instruction set (stream_body.h); this file picks the one the
 * optimizer would use on this CPU (common/base/cpu.h), so that both sides of the
 * roofline ratio use the same vector width.
 */
#include "stream.h"

#include "common/base/cpu.h"

#define STREAM_NAME stream_mix_scalar
#include "stream_body.h"

void stream_mix_avx2(float *restrict master, float *restrict m, float *restrict v,
                     float *restrict acc, uint16_t *restrict low, size_t n);
void stream_mix_avx512(float *restrict master, float *restrict m, float *restrict v,
                       float *restrict acc, uint16_t *restrict low, size_t n);

void stream_mix(float *master, float *m, float *v, float *acc, uint16_t *low, size_t n) {
  switch (cpu_best_isa()) {
  case CPU_ISA_AVX512:
    stream_mix_avx512(master, m, v, acc, low, n);
    break;
  case CPU_ISA_AVX2:
    stream_mix_avx2(master, m, v, acc, low, n);
    break;
  default:
    stream_mix_scalar(master, m, v, acc, low, n);
    break;
  }
}
