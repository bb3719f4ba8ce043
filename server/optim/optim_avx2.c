/*
 * optim_avx2 — the fused optimizer pass and the sum of squares, 8 floats at a
 * time with AVX2 + FMA + F16C. Compiled with -mavx2 -mfma -mf16c and called
 * only after cpu_clamp_isa() found those extensions.
 *
 * The per-element operations, their order and which of them are fused are
 * those documented at the top of optim.c; each vector line below is one line
 * of the scalar reference there. Loads and stores are unaligned (free on
 * aligned data). The n mod 8 trailing elements are copied into zero-padded
 * stack vectors, run through the very same step function and copied back, so
 * the tail cannot differ from the body.
 */
#include <immintrin.h>
#include <string.h>

#include "server/optim/optim_isa.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* fp32 -> bf16 of 8 lanes, the integer rounding of dtype_f32_to_bf16: add
 * 0x7fff plus the lowest kept bit (ties to even), except that a NaN keeps its
 * top bits and gets the quiet bit. */
static ALWAYS_INLINE __m128i to_bf16(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256i r = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* F16C's conversion rounds to nearest even when told to, and turns a NaN into
 * the quiet NaN with the same sign and top payload bits, which is exactly
 * dtype_f32_to_f16. */
static ALWAYS_INLINE void store_low(void *low, __m256 p, int fp16) {
  __m128i h = fp16 ? _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT) : to_bf16(p);
  _mm_storeu_si128((__m128i *)low, h);
}

/* One vector of Adam / AdamW. `variant` is a compile-time constant at every
 * call site. */
static ALWAYS_INLINE void adam_step(const optim_plan *pl, enum optim_variant variant, float *master,
                                    float *m, float *v, float *acc, void *low) {
  __m256 g = _mm256_mul_ps(_mm256_loadu_ps(acc), _mm256_set1_ps(pl->grad_scale));
  __m256 p = _mm256_loadu_ps(master);
  if (variant == OPTIM_V_ADAM_L2)
    g = _mm256_fmadd_ps(p, _mm256_set1_ps(pl->weight_decay), g);
  if (variant == OPTIM_V_ADAMW)
    p = _mm256_mul_ps(p, _mm256_set1_ps(pl->decay));
  __m256 mi = _mm256_fmadd_ps(g, _mm256_set1_ps(pl->one_minus_beta1),
                              _mm256_mul_ps(_mm256_loadu_ps(m), _mm256_set1_ps(pl->beta1)));
  __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(pl->one_minus_beta2), g), g,
                              _mm256_mul_ps(_mm256_loadu_ps(v), _mm256_set1_ps(pl->beta2)));
  __m256 denom =
      _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(pl->bias_correction2_sqrt)),
                    _mm256_set1_ps(pl->eps));
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(pl->neg_step_size), mi), denom));
  _mm256_storeu_ps(m, mi);
  _mm256_storeu_ps(v, vi);
  _mm256_storeu_ps(master, p);
  _mm256_storeu_ps(acc, _mm256_setzero_ps());
  store_low(low, p, pl->low_fp16);
}

/* One vector of SGD; `flags` (OPTIM_V_SGD_*) is a compile-time constant. */
static ALWAYS_INLINE void sgd_step(const optim_plan *pl, unsigned flags, float *master, float *buf,
                                   float *acc, void *low) {
  __m256 p = _mm256_loadu_ps(master);
  __m256 d = _mm256_mul_ps(_mm256_loadu_ps(acc), _mm256_set1_ps(pl->grad_scale));
  if (flags & OPTIM_V_SGD_L2)
    d = _mm256_fmadd_ps(p, _mm256_set1_ps(pl->weight_decay), d);
  if (flags & OPTIM_V_SGD_MOMENTUM) {
    __m256 b;
    if (flags & OPTIM_V_SGD_FIRST)
      b = d;
    else
      b = _mm256_fmadd_ps(d, _mm256_set1_ps(pl->one_minus_dampening),
                          _mm256_mul_ps(_mm256_loadu_ps(buf), _mm256_set1_ps(pl->momentum)));
    _mm256_storeu_ps(buf, b);
    if (flags & OPTIM_V_SGD_NESTEROV)
      d = _mm256_fmadd_ps(b, _mm256_set1_ps(pl->momentum), d);
    else
      d = b;
  }
  p = _mm256_fmadd_ps(d, _mm256_set1_ps(pl->neg_lr), p);
  _mm256_storeu_ps(master, p);
  _mm256_storeu_ps(acc, _mm256_setzero_ps());
  store_low(low, p, pl->low_fp16);
}

/* Runs the step over whole vectors, then over the tail through stack copies.
 * `uses_m` / `uses_v` say which of m and v the step touches (they may be NULL
 * otherwise). */
static ALWAYS_INLINE void run(const optim_plan *pl, unsigned variant, float *master, float *m,
                              float *v, float *acc, void *low, size_t n) {
  const int sgd = (variant & OPTIM_V_SGD) != 0;
  const int uses_m = !sgd || (variant & OPTIM_V_SGD_MOMENTUM);
  const int uses_v = !sgd;
  unsigned char *lowb = low;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (sgd)
      sgd_step(pl, variant & 15u, master + i, uses_m ? m + i : NULL, acc + i, lowb + 2 * i);
    else
      adam_step(pl, (enum optim_variant)variant, master + i, m + i, v + i, acc + i, lowb + 2 * i);
  }
  size_t r = n - i;
  if (r == 0)
    return;
  float tp[8] = {0}, tm[8] = {0}, tv[8] = {0}, ta[8] = {0};
  uint16_t tl[8];
  memcpy(tp, master + i, r * sizeof(float));
  memcpy(ta, acc + i, r * sizeof(float));
  if (uses_m)
    memcpy(tm, m + i, r * sizeof(float));
  if (uses_v)
    memcpy(tv, v + i, r * sizeof(float));
  if (sgd)
    sgd_step(pl, variant & 15u, tp, tm, ta, tl);
  else
    adam_step(pl, (enum optim_variant)variant, tp, tm, tv, ta, tl);
  memcpy(master + i, tp, r * sizeof(float));
  memcpy(acc + i, ta, r * sizeof(float));
  if (uses_m)
    memcpy(m + i, tm, r * sizeof(float));
  if (uses_v)
    memcpy(v + i, tv, r * sizeof(float));
  memcpy(lowb + 2 * i, tl, r * sizeof(uint16_t));
}

void optim_avx2_apply(const optim_plan *pl, float *master, float *m, float *v, float *acc,
                      void *low, size_t n) {
  /* One case per variant: each expands `run` with constant flags, so no loop
   * branches on the optimizer. The default case (not produced by
   * optim_plan_init) still computes the right thing, just more slowly. */
#define CASE(var)                                                                                  \
  case (var):                                                                                      \
    run(pl, (var), master, m, v, acc, low, n);                                                     \
    break
  switch ((unsigned)pl->variant) {
  case OPTIM_V_NONE:
    break;
    CASE(OPTIM_V_ADAMW);
    CASE(OPTIM_V_ADAM);
    CASE(OPTIM_V_ADAM_L2);
    CASE(OPTIM_V_SGD);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_L2);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_L2);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_L2);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_NESTEROV);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_NESTEROV | OPTIM_V_SGD_L2);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_NESTEROV);
    CASE(OPTIM_V_SGD | OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_NESTEROV |
         OPTIM_V_SGD_L2);
  default:
    run(pl, (unsigned)pl->variant, master, m, v, acc, low, n);
    break;
  }
#undef CASE
}

/* The lane layout and folding order are those of scalar_sum_squares in
 * optim.c: lanes 0-3, 4-7, 8-11, 12-15 live in s0, s1, s2, s3. */
double optim_avx2_sum_squares(const float *acc, size_t n) {
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(acc + i));
    __m256d x1 = _mm256_cvtps_pd(_mm_loadu_ps(acc + i + 4));
    __m256d x2 = _mm256_cvtps_pd(_mm_loadu_ps(acc + i + 8));
    __m256d x3 = _mm256_cvtps_pd(_mm_loadu_ps(acc + i + 12));
    s0 = _mm256_add_pd(s0, _mm256_mul_pd(x0, x0));
    s1 = _mm256_add_pd(s1, _mm256_mul_pd(x1, x1));
    s2 = _mm256_add_pd(s2, _mm256_mul_pd(x2, x2));
    s3 = _mm256_add_pd(s3, _mm256_mul_pd(x3, x3));
  }
  __m256d h8a = _mm256_add_pd(s0, s2); /* lanes 0-3 += lanes 8-11 */
  __m256d h8b = _mm256_add_pd(s1, s3); /* lanes 4-7 += lanes 12-15 */
  __m256d h4 = _mm256_add_pd(h8a, h8b);
  __m128d h2 = _mm_add_pd(_mm256_castpd256_pd128(h4), _mm256_extractf128_pd(h4, 1));
  double s = _mm_cvtsd_f64(_mm_add_sd(h2, _mm_unpackhi_pd(h2, h2)));
  for (; i < n; i++)
    s += (double)acc[i] * (double)acc[i];
  return s;
}
