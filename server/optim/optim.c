/*
 * optim — plan, scalar reference kernels, run-time dispatch and the gradient
 * sum of squares. The vector kernels live in optim_avx2.c and optim_avx512.c.
 *
 * What torch 1.13 computes, element by element
 * ---------------------------------------------
 * Determined empirically against Debian's python3-torch 1.13.1 (built with
 * GCC 12, CPU capability AVX2) by comparing the bits of each in-place op with
 * candidate formulas evaluated in C, for lengths 1..4099 including ones that
 * are not multiples of 8 or 16 (so both the vectorised body and the scalar
 * tail lambda of ATen's loops were exercised; they agree everywhere):
 *
 *  - A Python float scalar reaches the kernel rounded once from double to
 *    float (round to nearest even). Any arithmetic on scalars before that
 *    (1 - lr * wd, 1 - beta1, lr / bias_correction1, math.sqrt(...)) happens
 *    in double, in Python's order, with glibc's pow() for beta ** step.
 *  - t.mul_(s) is t * s, one rounding.
 *  - t.add_(x, alpha=a) and t.add(x, alpha=a) FUSE: fmaf(x, a, t). The vector
 *    kernel is vec::fmadd(x, alpha, t); the scalar tail `t + alpha * x` was
 *    contracted by GCC into the same FMA. Even alpha == 1 (add_(eps)) is an
 *    FMA, which equals t + x since x * 1 is exact.
 *  - t.addcmul_(a, b, value=c) FUSES the last step: fmaf(c * a, b, t), with
 *    c * a rounded first (not c * (a * b), not t + (c * a) * b).
 *  - t.addcdiv_(a, b, value=c) does NOT fuse: t + (c * a) / b, three roundings.
 *  - x / s with a Python scalar s is a true division by (float)s, not a
 *    multiplication by a reciprocal. sqrt is the correctly rounded one.
 *
 * Hence, with g = acc * grad_scale:
 *
 *   AdamW  p = p * (float)(1 - lr*wd)
 *          m = fmaf(g, (float)(1 - b1), m * (float)b1)
 *          v = fmaf((float)(1 - b2) * g, g, v * (float)b2)
 *          p = p + ((float)(-lr/bc1) * m) / (sqrtf(v) / (float)sqrt(bc2) + (float)eps)
 *   Adam   as AdamW without the first line, and, only when wd != 0,
 *          g = fmaf(p, (float)wd, g) first
 *   SGD    d = wd != 0 ? fmaf(p, (float)wd, g) : g
 *          momentum != 0: buf = step 1 ? d : fmaf(d, (float)(1 - dampening), buf * (float)mom)
 *                         d = nesterov ? fmaf(buf, (float)mom, d) : buf
 *          p = fmaf(d, (float)(-lr), p)
 *   Lion   p = p * (float)(1 - lr*wd)
 *          c = fmaf(g, (float)(1 - b1), m * (float)b1)
 *          p = fmaf(sign(c), (float)(-lr), p)
 *          m = fmaf(g, (float)(1 - b2), m * (float)b2)
 *
 * where bc1 = 1 - b1**step, bc2 = 1 - b2**step (both 1 when bias_correction
 * is off, as in DeepSpeedCPUAdam). The "only when wd != 0" matters: adding
 * 0 * p is not an identity for g == -0 or a non-finite p. AdamW's multiply
 * by 1 - 0 is exact, so AdamW needs no such case.
 *
 * Every path below (scalar here, AVX2, AVX-512) evaluates exactly these
 * operations in this order, with an explicit fmaf / _mm*_fmadd_ps where torch
 * fuses and separate operations where it does not (the build's
 * -ffp-contract=off keeps the compiler from fusing on its own), so they give
 * the same bits as each other and as torch. tests/golden/gen_optim.py
 * records torch's trajectories; tests/unit/test_optim.c replays them.
 *
 * Lion is its paper's update (Chen et al. 2023, Algorithm 2) written with
 * the torch ops above: p.mul_(1 - lr*wd); c = m.mul(b1).add_(g, alpha=1 - b1);
 * p.add_(c.sign(), alpha=-lr); m.mul_(b2).add_(g, alpha=1 - b2), where
 * torch.sign() gives 1, -1, or +0 for a zero of either sign and for NaN.
 * zshard.torch.Lion runs exactly that in torch. It has a scalar kernel only
 * (the vector ISAs fall back to it; the bits are the same by construction).
 *
 * Each optimizer is one entry of k_kernels below: its plan (the scalars of a
 * step) and its kernel per ISA; what it shares with the client is in
 * common/model/spec_optim.c's table.
 */
#include "server/optim/optim.h"

#include <math.h>
#include <string.h>

#include "common/base/dtype.h"

#include "server/optim/optim_isa.h"

/* ------------------------------------------------------------------------ */
/* Plan                                                                      */
/* ------------------------------------------------------------------------ */

static void adam_plan(optim_plan *plan, const optim_params *p, uint64_t step) {
  double bc1 = 1.0, bc2 = 1.0;
  if (p->bias_correction) {
    bc1 = 1.0 - pow(p->beta1, (double)step);
    bc2 = 1.0 - pow(p->beta2, (double)step);
  }
  double step_size = p->lr / bc1;
  if (p->optimizer == ZS_OPTIM_ADAMW)
    plan->variant = OPTIM_V_ADAMW;
  else
    plan->variant = p->weight_decay != 0 ? OPTIM_V_ADAM_L2 : OPTIM_V_ADAM;
  plan->decay = (float)(1.0 - p->lr * p->weight_decay);
  plan->weight_decay = (float)p->weight_decay;
  plan->beta1 = (float)p->beta1;
  plan->one_minus_beta1 = (float)(1.0 - p->beta1);
  plan->beta2 = (float)p->beta2;
  plan->one_minus_beta2 = (float)(1.0 - p->beta2);
  plan->bias_correction2_sqrt = (float)sqrt(bc2);
  plan->eps = (float)p->eps;
  plan->neg_step_size = (float)(-step_size);
}

static void sgd_plan(optim_plan *plan, const optim_params *p, uint64_t step) {
  unsigned v = OPTIM_V_SGD;
  if (p->weight_decay != 0)
    v |= OPTIM_V_SGD_L2;
  if (p->momentum != 0) {
    v |= OPTIM_V_SGD_MOMENTUM;
    if (step == 1)
      v |= OPTIM_V_SGD_FIRST;
    if (p->nesterov)
      v |= OPTIM_V_SGD_NESTEROV;
  }
  plan->variant = (enum optim_variant)v;
  plan->weight_decay = (float)p->weight_decay;
  plan->momentum = (float)p->momentum;
  plan->one_minus_dampening = (float)(1.0 - p->dampening);
  plan->neg_lr = (float)(-p->lr);
}

static void lion_plan(optim_plan *plan, const optim_params *p, uint64_t step) {
  (void)step; /* Lion has no bias correction */
  plan->variant = OPTIM_V_LION;
  plan->decay = (float)(1.0 - p->lr * p->weight_decay);
  plan->beta1 = (float)p->beta1;
  plan->one_minus_beta1 = (float)(1.0 - p->beta1);
  plan->beta2 = (float)p->beta2;
  plan->one_minus_beta2 = (float)(1.0 - p->beta2);
  plan->neg_lr = (float)(-p->lr);
}

/* An optimizer's part on the shards: its plan and its kernel per ISA (NULL:
 * none for that ISA, the scalar one runs; every kernel gives the same bits). */
typedef void (*optim_kernel)(const optim_plan *plan, float *master, float *m, float *v, float *acc,
                             void *low, size_t n);
typedef struct optim_kind {
  zs_optimizer id;
  void (*plan)(optim_plan *plan, const optim_params *p, uint64_t step);
  optim_kernel scalar, avx2, avx512;
} optim_kind;

static void scalar_apply(const optim_plan *pl, float *master, float *m, float *v, float *acc,
                         void *low, size_t n);
static void scalar_lion(const optim_plan *pl, float *master, float *m, float *v, float *acc,
                        void *low, size_t n);

static const optim_kind k_kernels[] = {
    {ZS_OPTIM_ADAMW, adam_plan, scalar_apply, optim_avx2_apply, optim_avx512_apply},
    {ZS_OPTIM_ADAM, adam_plan, scalar_apply, optim_avx2_apply, optim_avx512_apply},
    {ZS_OPTIM_SGD, sgd_plan, scalar_apply, optim_avx2_apply, optim_avx512_apply},
    {ZS_OPTIM_LION, lion_plan, scalar_lion, NULL, NULL},
};

static const optim_kind *kind_of(zs_optimizer id) {
  for (size_t i = 0; i < sizeof k_kernels / sizeof k_kernels[0]; i++)
    if (k_kernels[i].id == id)
      return &k_kernels[i];
  return NULL;
}

void optim_plan_init(optim_plan *plan, const optim_params *p) {
  memset(plan, 0, sizeof *plan);
  plan->p = *p;
  plan->low_fp16 = p->low_dtype == ZS_DTYPE_FP16;
  plan->grad_scale = p->grad_scale;
  /* torch counts steps from 1; a step of 0 would divide by a zero bias
   * correction and poison every master weight with NaN, so it is treated as
   * the first step (callers are expected never to pass it). */
  uint64_t step = p->step ? p->step : 1;
  const optim_kind *k = kind_of(p->optimizer);
  /* An optimizer this build does not know: spec validation rejects it
   * before a plan is made; should one slip through, the pass leaves every
   * array, the accumulator included, untouched (OPTIM_V_NONE) rather than
   * guess. */
  if (k)
    k->plan(plan, p, step);
}

const char *optim_plan_bad_scalar(const optim_plan *plan) {
  const struct {
    const char *name;
    float value;
  } scalars[] = {
      {"grad_scale", plan->grad_scale},
      {"1 - lr * weight_decay", plan->decay},
      {"weight_decay", plan->weight_decay},
      {"beta1", plan->beta1},
      {"1 - beta1", plan->one_minus_beta1},
      {"beta2", plan->beta2},
      {"1 - beta2", plan->one_minus_beta2},
      {"sqrt(bias_correction2)", plan->bias_correction2_sqrt},
      {"eps", plan->eps},
      {"lr / bias_correction1", plan->neg_step_size},
      {"momentum", plan->momentum},
      {"1 - dampening", plan->one_minus_dampening},
      {"lr", plan->neg_lr},
  };
  for (size_t i = 0; i < sizeof scalars / sizeof scalars[0]; i++)
    if (!isfinite(scalars[i].value))
      return scalars[i].name;
  /* eps is what keeps m / (sqrt(v) + eps) from 0 / 0 where m and v are 0. */
  int adam = plan->variant == OPTIM_V_ADAMW || plan->variant == OPTIM_V_ADAM ||
             plan->variant == OPTIM_V_ADAM_L2;
  if (adam && !(plan->eps > 0.0f))
    return "eps";
  return NULL;
}

unsigned optim_state_needs(const spec_group *g) {
  const spec_optim *o = spec_optim_of(g->optimizer);
  return o ? o->state(g) : 0u;
}

optim_params optim_params_of_group(const spec_group *g, zs_dtype low) {
  optim_params p;
  memset(&p, 0, sizeof p);
  p.optimizer = g->optimizer;
  p.lr = g->lr_scale;
#define COPY_FIELD(kind, name, proto) p.name = g->name;
  SPEC_OPTIM_FIELDS(COPY_FIELD)
#undef COPY_FIELD
  p.step = 1;
  p.grad_scale = 1.0f;
  p.low_dtype = low;
  return p;
}

/* The configuration part of p as a spec_group, for optim_state_needs. */
static spec_group group_of_params(const optim_params *p) {
  spec_group g;
  memset(&g, 0, sizeof g);
  g.optimizer = p->optimizer;
#define COPY_FIELD(kind, name, proto) g.name = p->name;
  SPEC_OPTIM_FIELDS(COPY_FIELD)
#undef COPY_FIELD
  return g;
}

int optim_uses_m(const optim_params *p) {
  spec_group g = group_of_params(p);
  return (optim_state_needs(&g) & OPTIM_STATE_M) != 0;
}

int optim_uses_v(const optim_params *p) {
  spec_group g = group_of_params(p);
  return (optim_state_needs(&g) & OPTIM_STATE_V) != 0;
}

/* ------------------------------------------------------------------------ */
/* Scalar reference kernels                                                  */
/* ------------------------------------------------------------------------ */

/* The low copy is written with memcpy: `low` is a void pointer into a 16-bit
 * arena and this keeps the reference free of alignment assumptions. */
static inline void store_low(void *low, size_t i, float x, int fp16) {
  uint16_t h = fp16 ? dtype_f32_to_f16(x) : dtype_f32_to_bf16(x);
  memcpy((unsigned char *)low + 2 * i, &h, sizeof h);
}

/* One loop for Adam and AdamW. `variant` is a constant at every call site, so
 * the compiler emits one loop per variant without a branch on it inside. */
static inline __attribute__((always_inline)) void scalar_adam(const optim_plan *pl,
                                                              enum optim_variant variant,
                                                              float *master, float *m, float *v,
                                                              float *acc, void *low, size_t n) {
  const int fp16 = pl->low_fp16;
  for (size_t i = 0; i < n; i++) {
    float g = acc[i] * pl->grad_scale;
    float p = master[i];
    if (variant == OPTIM_V_ADAM_L2)
      g = fmaf(p, pl->weight_decay, g);
    if (variant == OPTIM_V_ADAMW)
      p = p * pl->decay;
    float mi = fmaf(g, pl->one_minus_beta1, m[i] * pl->beta1);
    float vi = fmaf(pl->one_minus_beta2 * g, g, v[i] * pl->beta2);
    float denom = sqrtf(vi) / pl->bias_correction2_sqrt + pl->eps;
    p = p + (pl->neg_step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    acc[i] = 0.0f;
    store_low(low, i, p, fp16);
  }
}

static inline __attribute__((always_inline)) void scalar_sgd(const optim_plan *pl, unsigned flags,
                                                             float *master, float *buf, float *acc,
                                                             void *low, size_t n) {
  const int fp16 = pl->low_fp16;
  for (size_t i = 0; i < n; i++) {
    float p = master[i];
    float d = acc[i] * pl->grad_scale;
    if (flags & OPTIM_V_SGD_L2)
      d = fmaf(p, pl->weight_decay, d);
    if (flags & OPTIM_V_SGD_MOMENTUM) {
      float b;
      if (flags & OPTIM_V_SGD_FIRST)
        b = d;
      else
        b = fmaf(d, pl->one_minus_dampening, buf[i] * pl->momentum);
      buf[i] = b;
      if (flags & OPTIM_V_SGD_NESTEROV)
        d = fmaf(b, pl->momentum, d);
      else
        d = b;
    }
    p = fmaf(d, pl->neg_lr, p);
    master[i] = p;
    acc[i] = 0.0f;
    store_low(low, i, p, fp16);
  }
}

static void scalar_apply(const optim_plan *pl, float *master, float *m, float *v, float *acc,
                         void *low, size_t n) {
  /* One case per variant so that each loop is compiled for its own constant
   * flags; the default case is never reached with a plan from
   * optim_plan_init but still computes the right thing. */
#define SGD_CASE(f)                                                                                \
  case OPTIM_V_SGD | (f):                                                                          \
    scalar_sgd(pl, (f), master, m, acc, low, n);                                                   \
    break
  switch ((unsigned)pl->variant) {
  case OPTIM_V_NONE:
    break;
  case OPTIM_V_ADAMW:
    scalar_adam(pl, OPTIM_V_ADAMW, master, m, v, acc, low, n);
    break;
  case OPTIM_V_ADAM:
    scalar_adam(pl, OPTIM_V_ADAM, master, m, v, acc, low, n);
    break;
  case OPTIM_V_ADAM_L2:
    scalar_adam(pl, OPTIM_V_ADAM_L2, master, m, v, acc, low, n);
    break;
    SGD_CASE(0);
    SGD_CASE(OPTIM_V_SGD_L2);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_L2);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_L2);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_NESTEROV);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_NESTEROV | OPTIM_V_SGD_L2);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_NESTEROV);
    SGD_CASE(OPTIM_V_SGD_MOMENTUM | OPTIM_V_SGD_FIRST | OPTIM_V_SGD_NESTEROV | OPTIM_V_SGD_L2);
  default:
    scalar_sgd(pl, (unsigned)pl->variant & 15u, master, m, acc, low, n);
    break;
  }
#undef SGD_CASE
}

/* torch.sign as torch 1.13 computes it, (0 < c) - (c < 0): +0 for either
 * zero and for NaN (checked against Debian's build, vector and scalar). */
static inline float sign_of(float c) {
  return c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
}

static void scalar_lion(const optim_plan *pl, float *master, float *m, float *v, float *acc,
                        void *low, size_t n) {
  (void)v;
  const int fp16 = pl->low_fp16;
  for (size_t i = 0; i < n; i++) {
    float g = acc[i] * pl->grad_scale;
    float p = master[i] * pl->decay;
    float mi = m[i];
    float c = fmaf(g, pl->one_minus_beta1, mi * pl->beta1);
    p = fmaf(sign_of(c), pl->neg_lr, p);
    m[i] = fmaf(g, pl->one_minus_beta2, mi * pl->beta2);
    master[i] = p;
    acc[i] = 0.0f;
    store_low(low, i, p, fp16);
  }
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------ */

void optim_apply_isa(cpu_isa isa, const optim_plan *plan, float *master, float *m, float *v,
                     float *acc, void *low, size_t n) {
  const optim_kind *k = kind_of(plan->p.optimizer);
  if (n == 0 || plan->variant == OPTIM_V_NONE || !k)
    return;
  optim_kernel fn = k->scalar;
  switch (cpu_clamp_isa(isa)) {
  case CPU_ISA_AVX512:
    fn = k->avx512 ? k->avx512 : k->avx2 ? k->avx2 : fn;
    break;
  case CPU_ISA_AVX2:
    fn = k->avx2 ? k->avx2 : fn;
    break;
  default:
    break;
  }
  fn(plan, master, m, v, acc, low, n);
}

void optim_apply(const optim_plan *plan, float *master, float *m, float *v, float *acc, void *low,
                 size_t n) {
  optim_apply_isa(cpu_best_isa(), plan, master, m, v, acc, low, n);
}

/* ------------------------------------------------------------------------ */
/* Sum of squares                                                            */
/* ------------------------------------------------------------------------ */

/*
 * The order of the double additions is fixed by the index alone, so every ISA
 * gives the same bits:
 *
 *  1. Element i of each full block of 16 is added to lane i mod 16
 *     (lane += (double)x * x; the product of two floats is exact in double).
 *  2. The lanes are folded in halves: lane[k] += lane[k + 8], then k + 4,
 *     k + 2, k + 1 (k below the half), leaving the total in lane 0.
 *  3. The n mod 16 trailing elements are added to that total in index order.
 *
 * Sixteen lanes let AVX2 keep four and AVX-512 two independent accumulator
 * chains, enough to hide the adder's latency.
 *
 * No finite float squared exceeds 1.2e77 and no realistic count of them sums
 * past double's 1.8e308, so the total is non-finite exactly when an element
 * is Inf or NaN; that is how `nonfinite` is found, with no extra test per
 * element.
 */
static double scalar_sum_squares(const float *acc, size_t n) {
  double lane[16] = {0};
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; k++)
      lane[k] += (double)acc[i + k] * (double)acc[i + k];
  for (int half = 8; half >= 1; half /= 2)
    for (int k = 0; k < half; k++)
      lane[k] += lane[k + half];
  double s = lane[0];
  for (; i < n; i++)
    s += (double)acc[i] * (double)acc[i];
  return s;
}

double optim_sum_squares_isa(cpu_isa isa, const float *acc, size_t n, int *nonfinite) {
  double s;
  switch (n ? cpu_clamp_isa(isa) : CPU_ISA_SCALAR) {
  case CPU_ISA_AVX512:
    s = optim_avx512_sum_squares(acc, n);
    break;
  case CPU_ISA_AVX2:
    s = optim_avx2_sum_squares(acc, n);
    break;
  default:
    s = scalar_sum_squares(acc, n);
    break;
  }
  if (nonfinite)
    *nonfinite = !isfinite(s);
  return s;
}

double optim_sum_squares(const float *acc, size_t n, int *nonfinite) {
  return optim_sum_squares_isa(cpu_best_isa(), acc, n, nonfinite);
}
