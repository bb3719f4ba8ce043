/*
 * optim_avx512 — the fused optimizer pass and the sum of squares, 16 floats at
 * a time with AVX-512 F/BW/VL (and F16C's rounding rules for fp16). Compiled
 * with -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c and called only
 * after cpu_clamp_isa() found those extensions.
 *
 * The per-element operations, their order and which of them are fused are
 * those documented at the top of optim.c; each vector line below is one line
 * of the scalar reference there. The n mod 16 trailing elements go through
 * the same step function with masked loads and stores: masked-off lanes are
 * neither read (no fault past the end) nor written, and compute on zeros.
 */
#include <immintrin.h>

#include "server/optim/optim_isa.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* fp32 -> bf16 of 16 lanes, the integer rounding of dtype_f32_to_bf16: add
 * 0x7fff plus the lowest kept bit (ties to even), except that a NaN keeps its
 * top bits and gets the quiet bit. Returns the 16-bit results in the low
 * halves of the 32-bit lanes. */
static ALWAYS_INLINE __m512i to_bf16(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_srli_epi32(r, 16);
}

/* Writes the lanes of `k` of the low copy. F16C's conversion, told to round
 * to nearest even, turns a NaN into the quiet NaN with the same sign and top
 * payload bits, which is exactly dtype_f32_to_f16. */
static ALWAYS_INLINE void store_low(void *low, __m512 p, int fp16, __mmask16 k) {
  if (fp16)
    _mm256_mask_storeu_epi16(low, k, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
  else
    _mm512_mask_cvtepi32_storeu_epi16(low, k, to_bf16(p));
}

/* All loads and stores go through these two, masked by `k` (all ones in the
 * body, where the compiler drops the mask). */
static ALWAYS_INLINE __m512 ld(const float *p, __mmask16 k) {
  return _mm512_maskz_loadu_ps(k, p);
}

static ALWAYS_INLINE void st(float *p, __m512 x, __mmask16 k) {
  _mm512_mask_storeu_ps(p, k, x);
}

/* One vector of Adam / AdamW; `variant` is a compile-time constant. */
static ALWAYS_INLINE void adam_step(const optim_plan *pl, enum optim_variant variant, float *master,
                                    float *m, float *v, float *acc, void *low, __mmask16 k) {
  __m512 g = _mm512_mul_ps(ld(acc, k), _mm512_set1_ps(pl->grad_scale));
  __m512 p = ld(master, k);
  if (variant == OPTIM_V_ADAM_L2)
    g = _mm512_fmadd_ps(p, _mm512_set1_ps(pl->weight_decay), g);
  if (variant == OPTIM_V_ADAMW)
    p = _mm512_mul_ps(p, _mm512_set1_ps(pl->decay));
  __m512 mi = _mm512_fmadd_ps(g, _mm512_set1_ps(pl->one_minus_beta1),
                              _mm512_mul_ps(ld(m, k), _mm512_set1_ps(pl->beta1)));
  __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(pl->one_minus_beta2), g), g,
                              _mm512_mul_ps(ld(v, k), _mm512_set1_ps(pl->beta2)));
  __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(pl->bias_correction2_sqrt)),
                    _mm512_set1_ps(pl->eps));
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(pl->neg_step_size), mi), denom));
  st(m, mi, k);
  st(v, vi, k);
  st(master, p, k);
  st(acc, _mm512_setzero_ps(), k);
  store_low(low, p, pl->low_fp16, k);
}

/* One vector of SGD; `flags` (OPTIM_V_SGD_*) is a compile-time constant. */
static ALWAYS_INLINE void sgd_step(const optim_plan *pl, unsigned flags, float *master, float *buf,
                                   float *acc, void *low, __mmask16 k) {
  __m512 p = ld(master, k);
  __m512 d = _mm512_mul_ps(ld(acc, k), _mm512_set1_ps(pl->grad_scale));
  if (flags & OPTIM_V_SGD_L2)
    d = _mm512_fmadd_ps(p, _mm512_set1_ps(pl->weight_decay), d);
  if (flags & OPTIM_V_SGD_MOMENTUM) {
    __m512 b;
    if (flags & OPTIM_V_SGD_FIRST)
      b = d;
    else
      b = _mm512_fmadd_ps(d, _mm512_set1_ps(pl->one_minus_dampening),
                          _mm512_mul_ps(ld(buf, k), _mm512_set1_ps(pl->momentum)));
    st(buf, b, k);
    if (flags & OPTIM_V_SGD_NESTEROV)
      d = _mm512_fmadd_ps(b, _mm512_set1_ps(pl->momentum), d);
    else
      d = b;
  }
  p = _mm512_fmadd_ps(d, _mm512_set1_ps(pl->neg_lr), p);
  st(master, p, k);
  st(acc, _mm512_setzero_ps(), k);
  store_low(low, p, pl->low_fp16, k);
}

static ALWAYS_INLINE void step(const optim_plan *pl, unsigned variant, float *master, float *m,
                               float *v, float *acc, unsigned char *low, size_t i, __mmask16 k) {
  if (variant & OPTIM_V_SGD)
    sgd_step(pl, variant & 15u, master + i, (variant & OPTIM_V_SGD_MOMENTUM) ? m + i : NULL,
             acc + i, low + 2 * i, k);
  else
    adam_step(pl, (enum optim_variant)variant, master + i, m + i, v + i, acc + i, low + 2 * i, k);
}

static ALWAYS_INLINE void run(const optim_plan *pl, unsigned variant, float *master, float *m,
                              float *v, float *acc, void *low, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    step(pl, variant, master, m, v, acc, low, i, (__mmask16)0xffff);
  if (i < n)
    step(pl, variant, master, m, v, acc, low, i, (__mmask16)((1u << (n - i)) - 1u));
}

void optim_avx512_apply(const optim_plan *pl, float *master, float *m, float *v, float *acc,
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
 * optim.c: lanes 0-7 live in s0, lanes 8-15 in s1. */
double optim_avx512_sum_squares(const float *acc, size_t n) {
  __m512d s0 = _mm512_setzero_pd(), s1 = s0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512d x0 = _mm512_cvtps_pd(_mm256_loadu_ps(acc + i));
    __m512d x1 = _mm512_cvtps_pd(_mm256_loadu_ps(acc + i + 8));
    s0 = _mm512_add_pd(s0, _mm512_mul_pd(x0, x0));
    s1 = _mm512_add_pd(s1, _mm512_mul_pd(x1, x1));
  }
  __m512d h8 = _mm512_add_pd(s0, s1); /* lane k += lane k + 8 */
  __m256d h4 = _mm256_add_pd(_mm512_castpd512_pd256(h8), _mm512_extractf64x4_pd(h8, 1));
  __m128d h2 = _mm_add_pd(_mm256_castpd256_pd128(h4), _mm256_extractf128_pd(h4, 1));
  double s = _mm_cvtsd_f64(_mm_add_sd(h2, _mm_unpackhi_pd(h2, h2)));
  for (; i < n; i++)
    s += (double)acc[i] * (double)acc[i];
  return s;
}
