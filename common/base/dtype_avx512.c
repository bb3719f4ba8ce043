/*
 * dtype_avx512 — the conversion kernels for AVX-512 F/BW/VL (+ F16C), 16 floats
 * per vector. Compiled with -mavx512f -mavx512bw -mavx512vl and called only
 * after cpu_clamp_isa() has seen those features. Every result is
 * bit-identical to the scalar reference in dtype.c (whose comment states the
 * rounding and NaN rules).
 *
 * The tail that does not fill a vector is done with masked loads and stores,
 * which never touch the masked-off bytes, so no element is read or written
 * outside the caller's arrays. All accesses are unaligned ones.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/base/dtype_isa.h"

#define LANES 16

/* The mask of the first k < 16 lanes. */
static inline __mmask16 tail_mask(size_t k) {
  return (__mmask16)((1u << k) - 1u);
}

static inline __m512 cvt_f16(__m256i h) {
  return _mm512_cvtph_ps(h);
}

static inline __m512 cvt_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16 for 16 lanes: the integer rounding bias of the scalar rule,
 * with NaN lanes replaced by (bits >> 16) | quiet bit. */
static inline __m256i f32x16_to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                             _mm512_set1_epi32(0x7f800000));
  __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  __m512i nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x0040));
  /* Each lane is below 2^16, so VPMOVDW's truncation is exact narrowing. */
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}

static inline __m256i f32x16_to_f16(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* acc + x, keeping acc's NaN (quieted) where acc is NaN: the accumulation's
 * NaN rule in dtype.c. */
static inline __m512 add_keep_nan(__m512 acc, __m512 x) {
  __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
  __m512i sum = _mm512_castps_si512(_mm512_add_ps(acc, x));
  return _mm512_castsi512_ps(
      _mm512_mask_or_epi32(sum, nan, _mm512_castps_si512(acc), _mm512_set1_epi32(0x00400000)));
}

/* Each kernel runs whole vectors, then the last n % 16 elements as one
 * masked vector. */

void dtype_avx512_f32_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES) {
    __m512 x = _mm512_loadu_ps(p + 4 * i);
    _mm512_storeu_ps(acc + i, add_keep_nan(_mm512_loadu_ps(acc + i), x));
  }
  if (m) {
    __m512 x = _mm512_maskz_loadu_ps(m, p + 4 * i);
    _mm512_mask_storeu_ps(acc + i, m, add_keep_nan(_mm512_maskz_loadu_ps(m, acc + i), x));
  }
}

void dtype_avx512_f16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES)
    _mm512_storeu_ps(out + i, cvt_f16(_mm256_loadu_si256((const void *)(p + 2 * i))));
  if (m)
    _mm512_mask_storeu_ps(out + i, m, cvt_f16(_mm256_maskz_loadu_epi16(m, p + 2 * i)));
}

void dtype_avx512_f16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES)
    _mm256_storeu_si256((void *)(p + 2 * i), f32x16_to_f16(_mm512_loadu_ps(in + i)));
  if (m)
    _mm256_mask_storeu_epi16(p + 2 * i, m, f32x16_to_f16(_mm512_maskz_loadu_ps(m, in + i)));
}

void dtype_avx512_f16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES) {
    __m512 x = cvt_f16(_mm256_loadu_si256((const void *)(p + 2 * i)));
    _mm512_storeu_ps(acc + i, add_keep_nan(_mm512_loadu_ps(acc + i), x));
  }
  if (m) {
    __m512 x = cvt_f16(_mm256_maskz_loadu_epi16(m, p + 2 * i));
    _mm512_mask_storeu_ps(acc + i, m, add_keep_nan(_mm512_maskz_loadu_ps(m, acc + i), x));
  }
}

void dtype_avx512_bf16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES)
    _mm512_storeu_ps(out + i, cvt_bf16(_mm256_loadu_si256((const void *)(p + 2 * i))));
  if (m)
    _mm512_mask_storeu_ps(out + i, m, cvt_bf16(_mm256_maskz_loadu_epi16(m, p + 2 * i)));
}

void dtype_avx512_bf16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES)
    _mm256_storeu_si256((void *)(p + 2 * i), f32x16_to_bf16(_mm512_loadu_ps(in + i)));
  if (m)
    _mm256_mask_storeu_epi16(p + 2 * i, m, f32x16_to_bf16(_mm512_maskz_loadu_ps(m, in + i)));
}

void dtype_avx512_bf16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0, full = n - n % LANES;
  __mmask16 m = tail_mask(n % LANES);
  for (; i < full; i += LANES) {
    __m512 x = cvt_bf16(_mm256_loadu_si256((const void *)(p + 2 * i)));
    _mm512_storeu_ps(acc + i, add_keep_nan(_mm512_loadu_ps(acc + i), x));
  }
  if (m) {
    __m512 x = cvt_bf16(_mm256_maskz_loadu_epi16(m, p + 2 * i));
    _mm512_mask_storeu_ps(acc + i, m, add_keep_nan(_mm512_maskz_loadu_ps(m, acc + i), x));
  }
}
