/*
 * dtype_avx2 — the conversion kernels for AVX2 + F16C, 8 floats per vector.
 * Compiled with -mavx2 -mfma -mf16c and called only after cpu_clamp_isa() has
 * seen those features. Every result is bit-identical to the scalar reference
 * in dtype.c (whose comment states the rounding and NaN rules); the tail of an
 * array that does not fill a vector goes through that reference.
 *
 * All loads and stores are unaligned ones: payloads sit at any byte offset of
 * a network frame, and on current CPUs an unaligned access to aligned memory
 * costs nothing extra.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/base/dtype.h"
#include "common/base/dtype_isa.h"

#define LANES 8

static inline __m256 load_f16x8(const unsigned char *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

static inline __m256 load_bf16x8(const unsigned char *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* fp32 -> bf16 for 8 lanes, the scalar rule vectorised: the rounding bias for
 * numbers and Inf, (bits >> 16) | quiet bit for NaN, chosen per lane. */
static inline __m128i f32x8_to_bf16(__m256 v) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  __m256i u = _mm256_castps_si256(v);
  /* A signed compare is right here: both sides are below 2^31 once the sign
   * bit is cleared. */
  __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
  __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
  __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
  /* Every lane now holds a value below 2^16, so the unsigned saturating pack
   * is a plain narrowing. It works per 128-bit half, giving 64-bit chunks
   * [r0-3, r0-3, r4-7, r4-7]; the permute gathers chunks 0 and 2. */
  __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* acc + x, keeping acc's NaN (quieted) where acc is NaN: the accumulation's
 * NaN rule in dtype.c. The blend costs nothing measurable in a loop that is
 * bound by memory bandwidth. */
static inline __m256 add_keep_nan(__m256 acc, __m256 x) {
  __m256 nan = _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q);
  __m256 quieted = _mm256_or_ps(acc, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
  return _mm256_blendv_ps(_mm256_add_ps(acc, x), quieted, nan);
}

/* Each kernel runs whole vectors and leaves the last n % 8 elements to the
 * scalar kernel of its dtype. */

void dtype_avx2_f32_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256 x = _mm256_loadu_ps((const float *)(const void *)(p + 4 * i));
    _mm256_storeu_ps(acc + i, add_keep_nan(_mm256_loadu_ps(acc + i), x));
  }
  dtype_scalar_f32_accumulate(p + 4 * i, acc + i, n - i);
}

void dtype_avx2_f16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    _mm256_storeu_ps(out + i, load_f16x8(p + 2 * i));
  dtype_scalar_f16_decode(p + 2 * i, out + i, n - i);
}

void dtype_avx2_f16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(void *)(p + 2 * i), h);
  }
  dtype_scalar_f16_encode(in + i, p + 2 * i, n - i);
}

void dtype_avx2_f16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    _mm256_storeu_ps(acc + i, add_keep_nan(_mm256_loadu_ps(acc + i), load_f16x8(p + 2 * i)));
  dtype_scalar_f16_accumulate(p + 2 * i, acc + i, n - i);
}

void dtype_avx2_bf16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    _mm256_storeu_ps(out + i, load_bf16x8(p + 2 * i));
  dtype_scalar_bf16_decode(p + 2 * i, out + i, n - i);
}

void dtype_avx2_bf16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    _mm_storeu_si128((__m128i *)(void *)(p + 2 * i), f32x8_to_bf16(_mm256_loadu_ps(in + i)));
  dtype_scalar_bf16_encode(in + i, p + 2 * i, n - i);
}

void dtype_avx2_bf16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    _mm256_storeu_ps(acc + i, add_keep_nan(_mm256_loadu_ps(acc + i), load_bf16x8(p + 2 * i)));
  dtype_scalar_bf16_accumulate(p + 2 * i, acc + i, n - i);
}

/* ------------------------------------------------------------------------ */
/* INT8_BLOCK                                                                */
/* ------------------------------------------------------------------------ */
/*
 * Whole blocks run here, a short last block through the scalar kernel. The
 * operations are the scalar ones lane by lane: an integer max of the
 * magnitudes' bits, the shared scale rule, one multiplication by the
 * block's multiplier, a conversion that rounds to nearest-even (the scalar
 * magic-number rounding gives the same integer) and a narrowing that cannot
 * saturate. Decoding is one conversion and one multiplication.
 */

#define I8B DTYPE_INT8_BLOCK

/* The largest of the magnitudes' bit patterns over one block. */
static inline uint32_t block_amax_bits(const float *in) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  for (size_t i = 0; i < I8B; i += LANES)
    m = _mm256_max_epu32(
        m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(in + i)), abs_mask));
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
  return (uint32_t)_mm_cvtsi128_si32(h);
}

/* q = x * inv rounded to nearest-even by VCVTPS2DQ, which rounds by MXCSR's
 * mode: the default one, as every fp32 operation of the codec assumes (the
 * multiplication before it does too). No clamp: |x * inv| < 127.5 (see
 * dtype.c), so the result is within [-127, 127] and the packs below never
 * saturate. */
static inline __m256i quantize8(const float *in, __m256 inv) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(in), inv));
}

void dtype_avx2_int8_block_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  /* Lane order after the two packs, per 32-bit group: a0-3 b0-3 c0-3 d0-3 |
   * a4-7 b4-7 c4-7 d4-7; this permutation puts a, b, c, d back in order. */
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t b = 0;
  for (; b + I8B <= n; b += I8B) {
    float scale, inv;
    dtype_int8_block_scale(block_amax_bits(in + b), &scale, &inv);
    memcpy(p, &scale, sizeof scale);
    p += sizeof scale;
    /* inv is 0 for tiny and non-finite blocks, whose q are all 0 (Inf * 0
     * would be NaN, which the clamp would not turn into 0). */
    if (inv == 0.0f) {
      memset(p, 0, I8B);
      p += I8B;
      continue;
    }
    __m256 vinv = _mm256_set1_ps(inv);
    for (size_t i = 0; i < I8B; i += 4 * LANES) {
      const float *x = in + b + i;
      __m256i ab = _mm256_packs_epi32(quantize8(x, vinv), quantize8(x + 8, vinv));
      __m256i cd = _mm256_packs_epi32(quantize8(x + 16, vinv), quantize8(x + 24, vinv));
      __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
      _mm256_storeu_si256((__m256i *)(void *)(p + i), q);
    }
    p += I8B;
  }
  dtype_scalar_int8_block_encode(in + b, p, n - b);
}

static inline __m256 dequant8(const unsigned char *q, __m256 scale) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)q);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), scale);
}

void dtype_avx2_int8_block_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  size_t b = 0;
  for (; b + I8B <= n; b += I8B) {
    float scale;
    memcpy(&scale, p, sizeof scale);
    p += sizeof scale;
    __m256 vs = _mm256_set1_ps(scale);
    for (size_t i = 0; i < I8B; i += LANES)
      _mm256_storeu_ps(out + b + i, dequant8(p + i, vs));
    p += I8B;
  }
  dtype_scalar_int8_block_decode(p, out + b, n - b);
}

void dtype_avx2_int8_block_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  size_t b = 0;
  for (; b + I8B <= n; b += I8B) {
    float scale;
    memcpy(&scale, p, sizeof scale);
    p += sizeof scale;
    __m256 vs = _mm256_set1_ps(scale);
    for (size_t i = 0; i < I8B; i += LANES) {
      float *a = acc + b + i;
      _mm256_storeu_ps(a, add_keep_nan(_mm256_loadu_ps(a), dequant8(p + i, vs)));
    }
    p += I8B;
  }
  dtype_scalar_int8_block_accumulate(p, acc + b, n - b);
}
