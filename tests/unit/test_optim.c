/*
 * test_optim — the fused optimizer pass reproduces torch 1.13 bit for bit, on
 * every instruction set, and optim_sum_squares is ISA-independent.
 *
 * The golden trajectories come from tests/golden/gen_optim.py (torch's own
 * AdamW, Adam and SGD, 60 steps, 13 configurations); see that script for the
 * file layout and for the gradient generator reimplemented below.
 *
 * Run with -v (or ZS_TEST_VERBOSE=1) to also print the pass's throughput per
 * ISA; the figures are informational, nothing is asserted about them.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "common/base/cpu.h"
#include "common/base/dtype.h"
#include "server/optim/optim.h"

/* Defined in optim.c but not (yet) declared in optim.h. */

static const cpu_isa k_isas[] = {CPU_ISA_SCALAR, CPU_ISA_AVX2, CPU_ISA_AVX512};
#define N_ISAS 3

static int g_verbose;

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* gen_optim.py's hash_f32: a position-dependent sum of splitmix64 over the
 * 32-bit patterns. */
static uint64_t hash_f32(const float *a, size_t n) {
  uint64_t h = 0;
  for (size_t i = 0; i < n; i++)
    h += splitmix64((uint64_t)f2u(a[i]) ^ ((uint64_t)i << 32));
  return h;
}

/* gen_optim.py's gradients(): exact floats from a counter-based generator. */
static void golden_gradients(uint64_t seed, uint32_t step, float *g, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint64_t z = splitmix64(seed ^ ((uint64_t)step << 32) ^ (uint64_t)i);
    double mant = (double)(z & 0xFFFFFFu);
    int e = (int)((z >> 25) & 15u);
    double x = ldexp(mant, -(24 + e));
    if ((z >> 24) & 1u)
      x = -x;
    if (((z >> 29) & 63u) == 0)
      x = 0.0;
    g[i] = (float)x;
  }
}

/* A small deterministic generator for the randomised tests. */
typedef struct rng {
  uint64_t s;
} rng;

static uint64_t rng_next(rng *r) {
  r->s += 0x9E3779B97F4A7C15ull;
  return splitmix64(r->s);
}

static float rng_normalish(rng *r, float scale) {
  /* A float in [-scale, scale) with a wide spread of exponents. */
  uint64_t z = rng_next(r);
  double x = ldexp((double)(z & 0xFFFFFFu), -24 - (int)((z >> 24) & 15u));
  return (float)((z >> 40) & 1u ? -x : x) * scale;
}

/* Mostly ordinary values, sprinkled with the ones that break kernels: signed
 * zeros, subnormals, Inf, NaNs with payloads, the largest floats. */
static float rng_special(rng *r, float scale) {
  uint64_t z = rng_next(r);
  switch (z % 29) {
  case 0:
    return 0.0f;
  case 1:
    return -0.0f;
  case 2:
    return u2f((uint32_t)((z >> 8) & 0x007fffffu) | 1u); /* subnormal */
  case 3:
    return (z >> 8) & 1u ? INFINITY : -INFINITY;
  case 4:
    return u2f(0x7f800000u | (uint32_t)((z >> 9) & 0x007fffffu) | 1u |
               ((z >> 8) & 1u ? 0x80000000u : 0u)); /* NaN, quiet or not */
  case 5:
    return (z >> 8) & 1u ? 3.0e38f : -3.0e38f;
  default:
    return rng_normalish(r, scale);
  }
}

static int bits_equal(const float *a, const float *b, size_t n, size_t *where) {
  for (size_t i = 0; i < n; i++)
    if (f2u(a[i]) != f2u(b[i])) {
      if (where)
        *where = i;
      return 0;
    }
  return 1;
}

static uint16_t to_low(zs_dtype d, float x) {
  return d == ZS_DTYPE_FP16 ? dtype_f32_to_f16(x) : dtype_f32_to_bf16(x);
}

static int verbose_from_args(int argc, char **argv) {
  const char *env = getenv("ZS_TEST_VERBOSE");
  if (env && *env && strcmp(env, "0") != 0)
    return 1;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0)
      return 1;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Golden file                                                               */
/* ------------------------------------------------------------------------ */

typedef struct golden_config {
  char name[33];
  uint32_t optimizer, bias_correction, nesterov;
  double beta1, beta2, eps, weight_decay, momentum, dampening;
  const unsigned char *lr;   /* f64[n_steps], little-endian, unaligned */
  const unsigned char *hash; /* u64[n_steps] */
  uint64_t m_hash, v_hash;
  float *final_master;
} golden_config;

typedef struct golden {
  unsigned char *buf;
  size_t len, pos;
  uint32_t n_tensors, n_steps, n_configs;
  uint64_t grad_seed, grad_hash_step1;
  uint32_t lengths[16];
  size_t offsets[16];
  size_t total;
  float *init;
  golden_config cfg[32];
} golden;

static golden g_golden;

static const unsigned char *take(golden *G, size_t n) {
  if (G->len - G->pos < n)
    fail_msg("golden file truncated at byte %zu (wanted %zu more)", G->pos, n);
  const unsigned char *p = G->buf + G->pos;
  G->pos += n;
  return p;
}

static uint32_t take_u32(golden *G) {
  uint32_t v;
  memcpy(&v, take(G, 4), 4);
  return v;
}

static uint64_t take_u64(golden *G) {
  uint64_t v;
  memcpy(&v, take(G, 8), 8);
  return v;
}

static double take_f64(golden *G) {
  double v;
  memcpy(&v, take(G, 8), 8);
  return v;
}

static float *take_f32_array(golden *G, size_t n) {
  float *a = malloc(n * sizeof *a + 1);
  assert_non_null(a);
  memcpy(a, take(G, n * sizeof *a), n * sizeof *a);
  return a;
}

static double lr_at(const golden_config *c, uint32_t s) {
  double v;
  memcpy(&v, c->lr + 8 * (size_t)s, 8);
  return v;
}

static uint64_t hash_at(const golden_config *c, uint32_t s) {
  uint64_t v;
  memcpy(&v, c->hash + 8 * (size_t)s, 8);
  return v;
}

static int golden_setup(void **state) {
  (void)state;
  golden *G = &g_golden;
  const char *path = ZS_SOURCE_DIR "/tests/golden/optim.bin";
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s (run tests/golden/gen_optim.py)\n", path);
    return -1;
  }
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  G->buf = malloc(len > 0 ? (size_t)len : 1);
  if (!G->buf || len <= 0 || fread(G->buf, 1, (size_t)len, f) != (size_t)len) {
    fclose(f);
    return -1;
  }
  fclose(f);
  G->len = (size_t)len;

  if (memcmp(take(G, 8), "ZSOPTIM1", 8) != 0)
    fail_msg("%s: bad magic", path);
  G->n_tensors = take_u32(G);
  G->n_steps = take_u32(G);
  G->grad_seed = take_u64(G);
  G->grad_hash_step1 = take_u64(G);
  assert_in_range(G->n_tensors, 1, 16);
  assert_in_range(G->n_steps, 1, 1000);
  for (uint32_t t = 0; t < G->n_tensors; t++) {
    G->lengths[t] = take_u32(G);
    assert_in_range(G->lengths[t], 1, 1u << 20);
    G->offsets[t] = G->total;
    G->total += G->lengths[t];
  }
  G->init = take_f32_array(G, G->total);
  G->n_configs = take_u32(G);
  assert_in_range(G->n_configs, 1, 32);
  for (uint32_t k = 0; k < G->n_configs; k++) {
    golden_config *c = &G->cfg[k];
    memcpy(c->name, take(G, 32), 32);
    c->name[32] = '\0';
    c->optimizer = take_u32(G);
    c->bias_correction = take_u32(G);
    c->nesterov = take_u32(G);
    (void)take_u32(G);
    c->beta1 = take_f64(G);
    c->beta2 = take_f64(G);
    c->eps = take_f64(G);
    c->weight_decay = take_f64(G);
    c->momentum = take_f64(G);
    c->dampening = take_f64(G);
    c->lr = take(G, 8 * (size_t)G->n_steps);
    c->hash = take(G, 8 * (size_t)G->n_steps);
    c->m_hash = take_u64(G);
    c->v_hash = take_u64(G);
    c->final_master = take_f32_array(G, G->total);
    assert_in_range(c->optimizer, ZS_OPTIM_ADAMW, ZS_OPTIM_SGD);
  }
  if (G->pos != G->len)
    fail_msg("%s: %zu trailing bytes", path, G->len - G->pos);
  return 0;
}

static int golden_teardown(void **state) {
  (void)state;
  golden *G = &g_golden;
  for (uint32_t k = 0; k < G->n_configs; k++)
    free(G->cfg[k].final_master);
  free(G->init);
  free(G->buf);
  memset(G, 0, sizeof *G);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Replaying the golden trajectories                                         */
/* ------------------------------------------------------------------------ */

/* How a replay hands the arena to the kernel. */
typedef enum replay_mode {
  REPLAY_PER_TENSOR, /* one call per tensor: unaligned heads and short tails */
  REPLAY_WHOLE,      /* one call over the concatenated arena */
  REPLAY_CHUNKS_37,  /* calls of 37 elements, as an odd split over threads */
  REPLAY_SCALED,     /* per tensor, acc = grad * 4096 and grad_scale = 1/4096 */
} replay_mode;

static const char *mode_name(replay_mode m) {
  switch (m) {
  case REPLAY_PER_TENSOR:
    return "per-tensor";
  case REPLAY_WHOLE:
    return "whole-arena";
  case REPLAY_CHUNKS_37:
    return "37-element chunks";
  default:
    return "grad_scale 2^-12";
  }
}

static optim_params golden_params(const golden_config *c, double lr, uint32_t step, zs_dtype low) {
  optim_params p;
  memset(&p, 0, sizeof p);
  p.optimizer = (zs_optimizer)c->optimizer;
  p.lr = lr;
  p.beta1 = c->beta1;
  p.beta2 = c->beta2;
  p.eps = c->eps;
  p.weight_decay = c->weight_decay;
  p.momentum = c->momentum;
  p.dampening = c->dampening;
  p.nesterov = (int)c->nesterov;
  p.bias_correction = (int)c->bias_correction;
  p.step = step;
  p.grad_scale = 1.0f;
  p.low_dtype = low;
  return p;
}

static void replay(const golden *G, const golden_config *c, cpu_isa isa, replay_mode mode,
                   zs_dtype low_dtype) {
  const size_t n = G->total;
  float *master = malloc(n * sizeof *master);
  float *m = calloc(n, sizeof *m);
  float *v = calloc(n, sizeof *v);
  float *acc = malloc(n * sizeof *acc);
  float *grad = malloc(n * sizeof *grad);
  uint16_t *low = malloc(n * sizeof *low);
  assert_true(master && m && v && acc && grad && low);
  memcpy(master, G->init, n * sizeof *master);

  optim_params probe = golden_params(c, 0, 1, low_dtype);
  float *mp = optim_uses_m(&probe) ? m : NULL;
  float *vp = optim_uses_v(&probe) ? v : NULL;

  for (uint32_t s = 1; s <= G->n_steps; s++) {
    golden_gradients(G->grad_seed, s, grad, n);
    optim_params p = golden_params(c, lr_at(c, s - 1), s, low_dtype);
    for (size_t i = 0; i < n; i++)
      acc[i] = mode == REPLAY_SCALED ? grad[i] * 4096.0f : grad[i];
    if (mode == REPLAY_SCALED)
      p.grad_scale = 1.0f / 4096.0f;
    optim_plan plan;
    optim_plan_init(&plan, &p);

    size_t chunk = 37;
    switch (mode) {
    case REPLAY_WHOLE:
      optim_apply_isa(isa, &plan, master, mp, vp, acc, low, n);
      break;
    case REPLAY_CHUNKS_37:
      for (size_t o = 0; o < n; o += chunk) {
        size_t k = n - o < chunk ? n - o : chunk;
        optim_apply_isa(isa, &plan, master + o, mp ? mp + o : NULL, vp ? vp + o : NULL, acc + o,
                        low + o, k);
      }
      break;
    default:
      for (uint32_t t = 0; t < G->n_tensors; t++) {
        size_t o = G->offsets[t];
        optim_apply_isa(isa, &plan, master + o, mp ? mp + o : NULL, vp ? vp + o : NULL, acc + o,
                        low + o, G->lengths[t]);
      }
      break;
    }

    for (size_t i = 0; i < n; i++) {
      if (f2u(acc[i]) != 0)
        fail_msg("%s/%s/%s step %u: acc[%zu] not zeroed", c->name, cpu_isa_name(isa),
                 mode_name(mode), s, i);
      if (low[i] != to_low(low_dtype, master[i]))
        fail_msg("%s/%s/%s step %u: low[%zu] = 0x%04x, master %a converts to 0x%04x", c->name,
                 cpu_isa_name(isa), mode_name(mode), s, i, low[i], (double)master[i],
                 to_low(low_dtype, master[i]));
    }
    if (hash_f32(master, n) != hash_at(c, s - 1))
      fail_msg("%s/%s/%s: master weights differ from torch's from step %u on", c->name,
               cpu_isa_name(isa), mode_name(mode), s);
  }
  size_t where = 0;
  if (!bits_equal(master, c->final_master, n, &where))
    fail_msg("%s/%s/%s: final master[%zu] = %a, torch %a", c->name, cpu_isa_name(isa),
             mode_name(mode), where, (double)master[where], (double)c->final_master[where]);
  if (mp && hash_f32(m, n) != c->m_hash)
    fail_msg("%s/%s/%s: final exp_avg / momentum buffer differs from torch's", c->name,
             cpu_isa_name(isa), mode_name(mode));
  if (vp && hash_f32(v, n) != c->v_hash)
    fail_msg("%s/%s/%s: final exp_avg_sq differs from torch's", c->name, cpu_isa_name(isa),
             mode_name(mode));
  free(master);
  free(m);
  free(v);
  free(acc);
  free(grad);
  free(low);
}

static void replay_all(replay_mode mode, zs_dtype low_dtype) {
  const golden *G = &g_golden;
  for (int k = 0; k < N_ISAS; k++) {
    if (!cpu_supports(k_isas[k])) {
      print_message("  (%s not supported by this CPU: not tested)\n", cpu_isa_name(k_isas[k]));
      continue;
    }
    for (uint32_t c = 0; c < G->n_configs; c++)
      replay(G, &G->cfg[c], k_isas[k], mode, low_dtype);
  }
}

static void golden_gradient_generator_matches_the_python_one(void **state) {
  (void)state;
  const golden *G = &g_golden;
  float *g = malloc(G->total * sizeof *g);
  assert_non_null(g);
  golden_gradients(G->grad_seed, 1, g, G->total);
  assert_true(hash_f32(g, G->total) == G->grad_hash_step1);
  free(g);
}

static void torch_trajectories_are_reproduced_with_one_call_per_tensor(void **state) {
  (void)state;
  replay_all(REPLAY_PER_TENSOR, ZS_DTYPE_BF16);
}

static void torch_trajectories_are_reproduced_with_one_call_over_the_arena(void **state) {
  (void)state;
  replay_all(REPLAY_WHOLE, ZS_DTYPE_FP16);
}

static void torch_trajectories_are_reproduced_when_split_at_arbitrary_points(void **state) {
  (void)state;
  replay_all(REPLAY_CHUNKS_37, ZS_DTYPE_BF16);
}

static void power_of_two_grad_scale_reproduces_torch_exactly(void **state) {
  (void)state;
  replay_all(REPLAY_SCALED, ZS_DTYPE_FP16);
}

/* ------------------------------------------------------------------------ */
/* Reference formula (for grad_scale != 1 and special values)                */
/* ------------------------------------------------------------------------ */

/* The per-element formulas written out from the comment at the top of
 * optim.c, independently of its code: scalars rounded from double once,
 * fmaf exactly where torch fuses. */
static void reference_apply(const optim_params *p, float *master, float *m, float *v, float *acc,
                            uint16_t *low, size_t n) {
  uint64_t step = p->step ? p->step : 1;
  for (size_t i = 0; i < n; i++) {
    float g = acc[i] * p->grad_scale;
    float w = master[i];
    if (p->optimizer == ZS_OPTIM_LION) {
      /* The paper's update (Chen et al. 2023, Algorithm 2) with decoupled
       * weight decay and torch's sign (NaN and -0 give +0): c interpolates
       * the momentum and the gradient, the weight moves by lr * sign(c), the
       * momentum then follows beta2. */
      w = w * (float)(1.0 - p->lr * p->weight_decay);
      float c = fmaf(g, (float)(1.0 - p->beta1), m[i] * (float)p->beta1);
      float sign = (float)((c > 0) - (c < 0));
      w = fmaf(sign, (float)(-p->lr), w);
      m[i] = fmaf(g, (float)(1.0 - p->beta2), m[i] * (float)p->beta2);
    } else if (p->optimizer == ZS_OPTIM_SGD) {
      if (p->weight_decay != 0)
        g = fmaf(w, (float)p->weight_decay, g);
      if (p->momentum != 0) {
        if (step == 1)
          m[i] = g;
        else
          m[i] = fmaf(g, (float)(1.0 - p->dampening), m[i] * (float)p->momentum);
        g = p->nesterov ? fmaf(m[i], (float)p->momentum, g) : m[i];
      }
      w = fmaf(g, (float)(-p->lr), w);
    } else {
      double bc1 = p->bias_correction ? 1.0 - pow(p->beta1, (double)step) : 1.0;
      double bc2 = p->bias_correction ? 1.0 - pow(p->beta2, (double)step) : 1.0;
      if (p->optimizer == ZS_OPTIM_ADAMW)
        w = w * (float)(1.0 - p->lr * p->weight_decay);
      else if (p->weight_decay != 0)
        g = fmaf(w, (float)p->weight_decay, g);
      m[i] = fmaf(g, (float)(1.0 - p->beta1), m[i] * (float)p->beta1);
      v[i] = fmaf((float)(1.0 - p->beta2) * g, g, v[i] * (float)p->beta2);
      float denom = sqrtf(v[i]) / (float)sqrt(bc2) + (float)p->eps;
      w = w + ((float)(-(p->lr / bc1)) * m[i]) / denom;
    }
    master[i] = w;
    acc[i] = 0.0f;
    low[i] = to_low(p->low_dtype, w);
  }
}

/* Every optimizer variant the kernels specialise for: Adam(W) 0-3, SGD 4-15,
 * Lion the last two. */
#define N_VARIANTS 18
static optim_params variant_params(int k, uint64_t step, float grad_scale, zs_dtype low) {
  optim_params p;
  memset(&p, 0, sizeof p);
  p.beta1 = 0.9;
  p.beta2 = 0.999;
  p.eps = 1e-8;
  p.lr = 1e-3;
  p.bias_correction = 1;
  p.step = step;
  p.grad_scale = grad_scale;
  p.low_dtype = low;
  switch (k) {
  case 0:
    p.optimizer = ZS_OPTIM_ADAMW;
    p.weight_decay = 0.01;
    break;
  case 1:
    p.optimizer = ZS_OPTIM_ADAMW;
    p.bias_correction = 0;
    p.lr = 3e-2;
    break;
  case 2:
    p.optimizer = ZS_OPTIM_ADAM;
    break;
  case 3:
    p.optimizer = ZS_OPTIM_ADAM;
    p.weight_decay = 0.1;
    p.beta2 = 0.95;
    break;
  case N_VARIANTS - 2:
    p.optimizer = ZS_OPTIM_LION;
    p.lr = 1e-4;
    p.beta2 = 0.99;
    break;
  case N_VARIANTS - 1:
    p.optimizer = ZS_OPTIM_LION;
    p.lr = 3e-4;
    p.beta1 = 0.95;
    p.beta2 = 0.98;
    p.weight_decay = 0.1;
    break;
  default: {
    /* SGD: k - 4 enumerates weight decay x momentum (none, plain, nesterov)
     * x dampening. */
    int s = k - 4;
    p.optimizer = ZS_OPTIM_SGD;
    p.lr = 0.05;
    p.weight_decay = (s & 1) ? 1e-3 : 0.0;
    int mom = (s >> 1) % 3;
    p.momentum = mom ? 0.9 : 0.0;
    p.nesterov = mom == 2;
    p.dampening = (s >= 6 && mom == 1) ? 0.25 : 0.0;
    break;
  }
  }
  return p;
}

typedef struct state_arrays {
  float *master, *m, *v, *acc;
  uint16_t *low;
} state_arrays;

static void fill_state(rng *r, state_arrays *a, size_t n, int special) {
  for (size_t i = 0; i < n; i++) {
    a->master[i] = special ? rng_special(r, 1.0f) : rng_normalish(r, 1.0f);
    a->m[i] = special ? rng_special(r, 0.01f) : rng_normalish(r, 0.01f);
    a->v[i] = fabsf(special ? rng_special(r, 1e-4f) : rng_normalish(r, 1e-4f));
    a->acc[i] = special ? rng_special(r, 4.0f) : rng_normalish(r, 4.0f);
    a->low[i] = 0xABCD;
  }
}

static void copy_state(state_arrays *dst, const state_arrays *src, size_t n) {
  memcpy(dst->master, src->master, n * sizeof(float));
  memcpy(dst->m, src->m, n * sizeof(float));
  memcpy(dst->v, src->v, n * sizeof(float));
  memcpy(dst->acc, src->acc, n * sizeof(float));
  memcpy(dst->low, src->low, n * sizeof(uint16_t));
}

/* Guard elements around every array catch a kernel that writes outside
 * [0, n). */
#define GUARD 20
#define GUARD_BITS 0x7fa5a5a5u

static void alloc_state(state_arrays *a, size_t n) {
  a->master = malloc((n + 2 * GUARD) * sizeof(float));
  a->m = malloc((n + 2 * GUARD) * sizeof(float));
  a->v = malloc((n + 2 * GUARD) * sizeof(float));
  a->acc = malloc((n + 2 * GUARD) * sizeof(float));
  a->low = malloc((n + 2 * GUARD) * sizeof(uint16_t));
  assert_true(a->master && a->m && a->v && a->acc && a->low);
  float *arrs[4] = {a->master, a->m, a->v, a->acc};
  for (int k = 0; k < 4; k++)
    for (size_t i = 0; i < n + 2 * GUARD; i++)
      arrs[k][i] = u2f(GUARD_BITS);
  for (size_t i = 0; i < n + 2 * GUARD; i++)
    a->low[i] = 0x5a5a;
  a->master += GUARD;
  a->m += GUARD;
  a->v += GUARD;
  a->acc += GUARD;
  a->low += GUARD;
}

static void check_guards_and_free(state_arrays *a, size_t n) {
  float *arrs[4] = {a->master, a->m, a->v, a->acc};
  for (int k = 0; k < 4; k++) {
    for (size_t i = 0; i < GUARD; i++) {
      assert_int_equal(f2u(arrs[k][-(ptrdiff_t)GUARD + (ptrdiff_t)i]), GUARD_BITS);
      assert_int_equal(f2u(arrs[k][n + i]), GUARD_BITS);
    }
    free(arrs[k] - GUARD);
  }
  for (size_t i = 0; i < GUARD; i++) {
    assert_int_equal(a->low[-(ptrdiff_t)GUARD + (ptrdiff_t)i], 0x5a5a);
    assert_int_equal(a->low[n + i], 0x5a5a);
  }
  free(a->low - GUARD);
}

/* Two arrays agree if their bits do, except that any two NaNs agree: when two
 * different NaNs meet in one operation, which payload survives depends on the
 * operand order the compiler chose, which IEEE 754 leaves open. */
static int same_float(float a, float b) {
  return f2u(a) == f2u(b) || (isnan(a) && isnan(b));
}

static void expect_same_state(const state_arrays *want, const state_arrays *got, size_t n,
                              int uses_m, int uses_v, const char *what, int nan_lenient) {
  for (size_t i = 0; i < n; i++) {
    int ok = nan_lenient ? same_float(want->master[i], got->master[i])
                         : f2u(want->master[i]) == f2u(got->master[i]);
    if (!ok)
      fail_msg("%s: master[%zu] = %a, expected %a", what, i, (double)got->master[i],
               (double)want->master[i]);
    if (uses_m &&
        !(nan_lenient ? same_float(want->m[i], got->m[i]) : f2u(want->m[i]) == f2u(got->m[i])))
      fail_msg("%s: m[%zu] = %a, expected %a", what, i, (double)got->m[i], (double)want->m[i]);
    if (uses_v &&
        !(nan_lenient ? same_float(want->v[i], got->v[i]) : f2u(want->v[i]) == f2u(got->v[i])))
      fail_msg("%s: v[%zu] = %a, expected %a", what, i, (double)got->v[i], (double)want->v[i]);
    if (f2u(got->acc[i]) != 0)
      fail_msg("%s: acc[%zu] not zeroed", what, i);
  }
}

/* For every variant, ISA, length 0..100 and misalignment 0..3: with a
 * grad_scale that is not a power of two, the kernels match the reference
 * formula bit for bit, write the low copy of the new master and stay inside
 * [0, n). */
static void every_isa_matches_the_reference_formula_with_any_grad_scale(void **state) {
  (void)state;
  rng r = {42};
  const size_t max_n = 100 + 3;
  state_arrays init, want, got;
  alloc_state(&init, max_n);
  alloc_state(&want, max_n);
  alloc_state(&got, max_n);
  const float scales[] = {1.0f / 3.0f, 0.37f, 65536.0f * 1.7f};
  const zs_dtype lows[] = {ZS_DTYPE_BF16, ZS_DTYPE_FP16};
  char what[160];

  for (int var = 0; var < N_VARIANTS; var++)
    for (uint64_t step = 1; step <= 3; step += 2)
      for (size_t n = 0; n <= 100; n++) {
        size_t off = n % 4;
        float sc = scales[(n + (size_t)var) % 3];
        zs_dtype lowd = lows[n & 1];
        optim_params p = variant_params(var, step, sc, lowd);
        optim_plan plan;
        optim_plan_init(&plan, &p);
        int um = optim_uses_m(&p), uv = optim_uses_v(&p);
        fill_state(&r, &init, max_n, 0);
        copy_state(&want, &init, max_n);
        reference_apply(&p, want.master + off, want.m + off, want.v + off, want.acc + off,
                        want.low + off, n);
        for (int k = 0; k < N_ISAS; k++) {
          if (!cpu_supports(k_isas[k]))
            continue;
          copy_state(&got, &init, max_n);
          optim_apply_isa(k_isas[k], &plan, got.master + off, um ? got.m + off : NULL,
                          uv ? got.v + off : NULL, got.acc + off, got.low + off, n);
          snprintf(what, sizeof what, "variant %d step %u n %zu offset %zu isa %s", var,
                   (unsigned)step, n, off, cpu_isa_name(k_isas[k]));
          /* Outside [off, off + n) nothing may change. */
          state_arrays gw = {got.master + off, got.m + off, got.v + off, got.acc + off,
                             got.low + off};
          state_arrays ww = {want.master + off, want.m + off, want.v + off, want.acc + off,
                             want.low + off};
          expect_same_state(&ww, &gw, n, um, uv, what, 0);
          for (size_t i = 0; i < max_n; i++) {
            if (i >= off && i < off + n)
              continue;
            if (f2u(got.master[i]) != f2u(init.master[i]) || f2u(got.m[i]) != f2u(init.m[i]) ||
                f2u(got.v[i]) != f2u(init.v[i]) || f2u(got.acc[i]) != f2u(init.acc[i]) ||
                got.low[i] != init.low[i])
              fail_msg("%s: element %zu outside the range was changed", what, i);
          }
          for (size_t i = 0; i < n; i++)
            if (got.low[off + i] != to_low(lowd, got.master[off + i]))
              fail_msg("%s: low[%zu] is not the %s of the new master", what, i,
                       lowd == ZS_DTYPE_FP16 ? "fp16" : "bf16");
        }
      }
  check_guards_and_free(&init, max_n);
  check_guards_and_free(&want, max_n);
  check_guards_and_free(&got, max_n);
}

/* Zeros, subnormals, Inf, NaN and huge values in every array: the vector
 * paths agree with the scalar one (NaN payloads aside, see same_float). */
static void every_isa_agrees_with_scalar_on_special_values(void **state) {
  (void)state;
  rng r = {7};
  const size_t n = 1000 + 13;
  state_arrays init, want, got;
  alloc_state(&init, n);
  alloc_state(&want, n);
  alloc_state(&got, n);
  char what[160];
  for (int var = 0; var < N_VARIANTS; var++)
    for (uint64_t step = 1; step <= 2; step++) {
      optim_params p = variant_params(var, step, 0.5f, var & 1 ? ZS_DTYPE_FP16 : ZS_DTYPE_BF16);
      optim_plan plan;
      optim_plan_init(&plan, &p);
      int um = optim_uses_m(&p), uv = optim_uses_v(&p);
      fill_state(&r, &init, n, 1);
      copy_state(&want, &init, n);
      optim_apply_isa(CPU_ISA_SCALAR, &plan, want.master, um ? want.m : NULL, uv ? want.v : NULL,
                      want.acc, want.low, n);
      for (int k = 1; k < N_ISAS; k++) {
        if (!cpu_supports(k_isas[k]))
          continue;
        copy_state(&got, &init, n);
        optim_apply_isa(k_isas[k], &plan, got.master, um ? got.m : NULL, uv ? got.v : NULL, got.acc,
                        got.low, n);
        snprintf(what, sizeof what, "special values, variant %d step %u isa %s", var,
                 (unsigned)step, cpu_isa_name(k_isas[k]));
        expect_same_state(&want, &got, n, um, uv, what, 1);
        for (size_t i = 0; i < n; i++)
          if (got.low[i] != to_low(p.low_dtype, got.master[i]))
            fail_msg("%s: low[%zu] = 0x%04x is not the conversion of %a", what, i, got.low[i],
                     (double)got.master[i]);
      }
    }
  check_guards_and_free(&init, n);
  check_guards_and_free(&want, n);
  check_guards_and_free(&got, n);
}

/* With a zero gradient and plain SGD the master is unchanged, so arbitrary
 * bit patterns (NaN payloads, fp16 overflow and rounding ties, subnormals)
 * reach the low-copy conversion, which must equal common/dtype's. */
static void low_copy_of_any_master_equals_dtype_conversion(void **state) {
  (void)state;
  const size_t n = 4096 + 7;
  float *master = malloc(n * sizeof *master);
  float *acc = malloc(n * sizeof *acc);
  uint16_t *low = malloc(n * sizeof *low);
  assert_true(master && acc && low);
  rng r = {99};
  const zs_dtype lows[] = {ZS_DTYPE_BF16, ZS_DTYPE_FP16};
  for (int k = 0; k < N_ISAS; k++) {
    if (!cpu_supports(k_isas[k]))
      continue;
    for (int d = 0; d < 2; d++) {
      for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)rng_next(&r);
        /* Half the patterns are random, half sit near fp16/bf16 edges:
         * exponents around fp16's range limits and low bits at ties. */
        if (i & 1)
          u = (u & 0x80000000u) | ((uint32_t)(100 + (u >> 8) % 50) << 23) |
              ((u & 1u) ? 0x1000u : 0x8000u) | (u & 0x00700000u);
        master[i] = u2f(u);
        acc[i] = 0.0f;
      }
      master[0] = u2f(0x7f800001u); /* signalling NaN, smallest payload */
      master[1] = u2f(0xffbfffffu); /* negative signalling NaN, full payload */
      master[2] = 65520.0f;         /* fp16 tie between 65504 and Inf */
      optim_params p = variant_params(4, 1, 1.0f, lows[d]);
      optim_plan plan;
      optim_plan_init(&plan, &p);
      float *before = malloc(n * sizeof *before);
      assert_non_null(before);
      memcpy(before, master, n * sizeof *before);
      optim_apply_isa(k_isas[k], &plan, master, NULL, NULL, acc, low, n);
      for (size_t i = 0; i < n; i++) {
        if (!isnan(before[i]) && f2u(master[i]) != f2u(before[i]))
          fail_msg("master[%zu] changed by a zero gradient", i);
        if (low[i] != to_low(lows[d], master[i]))
          fail_msg("%s %s: low[%zu] = 0x%04x, dtype gives 0x%04x for %08x", cpu_isa_name(k_isas[k]),
                   d ? "fp16" : "bf16", i, low[i], to_low(lows[d], master[i]), f2u(master[i]));
      }
      free(before);
    }
  }
  free(master);
  free(acc);
  free(low);
}

static void sgd_first_step_sets_the_buffer_to_the_gradient_whatever_it_held(void **state) {
  (void)state;
  enum { N = 21 };
  for (int k = 0; k < N_ISAS; k++) {
    if (!cpu_supports(k_isas[k]))
      continue;
    float master[N], buf[N], acc[N];
    uint16_t low[N];
    for (int i = 0; i < N; i++) {
      master[i] = 1.0f + (float)i;
      buf[i] = NAN; /* stale memory must not leak into step 1 */
      acc[i] = 0.25f * (float)(i - 10);
    }
    optim_params p = variant_params(6, 1, 2.0f, ZS_DTYPE_BF16); /* momentum 0.9, no wd */
    assert_true(p.momentum == 0.9 && p.weight_decay == 0);
    optim_plan plan;
    optim_plan_init(&plan, &p);
    optim_apply_isa(k_isas[k], &plan, master, buf, NULL, acc, low, N);
    for (int i = 0; i < N; i++) {
      float g = 0.25f * (float)(i - 10) * 2.0f;
      assert_true(f2u(buf[i]) == f2u(g));
      assert_true(f2u(master[i]) == f2u(fmaf(g, (float)-0.05, 1.0f + (float)i)));
    }
  }
}

static void unknown_optimizer_changes_nothing(void **state) {
  (void)state;
  optim_params p = variant_params(0, 1, 1.0f, ZS_DTYPE_BF16);
  p.optimizer = (zs_optimizer)77;
  assert_int_equal(optim_uses_m(&p), 0);
  assert_int_equal(optim_uses_v(&p), 0);
  optim_plan plan;
  optim_plan_init(&plan, &p);
  float master[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, acc[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  uint16_t low[9] = {0};
  for (int k = 0; k < N_ISAS; k++) {
    optim_apply_isa(k_isas[k], &plan, master, NULL, NULL, acc, low, 9);
    for (int i = 0; i < 9; i++) {
      assert_true(master[i] == (float)(i + 1));
      assert_true(acc[i] == 1.0f);
      assert_int_equal(low[i], 0);
    }
  }
}

static void uses_m_and_v_follow_the_optimizer(void **state) {
  (void)state;
  optim_params p;
  memset(&p, 0, sizeof p);
  p.optimizer = ZS_OPTIM_ADAMW;
  assert_true(optim_uses_m(&p) && optim_uses_v(&p));
  p.optimizer = ZS_OPTIM_ADAM;
  assert_true(optim_uses_m(&p) && optim_uses_v(&p));
  p.optimizer = ZS_OPTIM_SGD;
  assert_false(optim_uses_m(&p) || optim_uses_v(&p));
  p.momentum = 0.9;
  assert_true(optim_uses_m(&p) && !optim_uses_v(&p));
}

/* The one rule the core's arenas, checkpoint sections and exports follow:
 * Adam(W) keeps exp_avg and exp_avg_sq; SGD a momentum buffer only with
 * momentum (torch keeps none at 0), whatever its other hyper-parameters;
 * an unknown optimizer nothing. optim_params_of_group carries every field. */
static void state_needs_follow_the_group(void **state) {
  (void)state;
  spec_group g;
  spec_group_defaults(&g, ZS_OPTIM_ADAMW);
  assert_int_equal(optim_state_needs(&g), OPTIM_STATE_M | OPTIM_STATE_V);
  spec_group_defaults(&g, ZS_OPTIM_ADAM);
  g.bias_correction = 0;
  assert_int_equal(optim_state_needs(&g), OPTIM_STATE_M | OPTIM_STATE_V);
  spec_group_defaults(&g, ZS_OPTIM_SGD);
  g.weight_decay = 0.1;
  g.dampening = 0.5;
  assert_int_equal(optim_state_needs(&g), 0);
  g.momentum = 0.9;
  assert_int_equal(optim_state_needs(&g), OPTIM_STATE_M);
  g.optimizer = (zs_optimizer)77;
  assert_int_equal(optim_state_needs(&g), 0);

  spec_group_defaults(&g, ZS_OPTIM_SGD);
  g.lr_scale = 0.5;
  g.momentum = 0.9;
  g.nesterov = 1;
  g.weight_decay = 1e-4;
  optim_params p = optim_params_of_group(&g, ZS_DTYPE_FP16);
  assert_int_equal(p.optimizer, ZS_OPTIM_SGD);
  assert_true(p.lr == 0.5 && p.momentum == 0.9 && p.weight_decay == 1e-4);
  assert_int_equal(p.nesterov, 1);
  assert_int_equal(p.bias_correction, 1);
  assert_int_equal(p.step, 1);
  assert_true(p.grad_scale == 1.0f);
  assert_int_equal(p.low_dtype, ZS_DTYPE_FP16);
  assert_int_equal(optim_uses_m(&p), 1);
  assert_int_equal(optim_uses_v(&p), 0);
}

/* ------------------------------------------------------------------------ */
/* Sum of squares                                                            */
/* ------------------------------------------------------------------------ */

/* The order documented in optim.c, written out plainly: 16 lanes by index,
 * folded in halves, then the tail in index order. */
static double reference_sum_squares(const float *a, size_t n) {
  double lane[16] = {0};
  size_t full = n / 16 * 16;
  for (size_t i = 0; i < full; i++)
    lane[i % 16] += (double)a[i] * (double)a[i];
  for (int h = 8; h >= 1; h /= 2)
    for (int k = 0; k < h; k++)
      lane[k] = lane[k] + lane[k + h];
  double s = lane[0];
  for (size_t i = full; i < n; i++)
    s += (double)a[i] * (double)a[i];
  return s;
}

static uint64_t d2u(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

static void sum_squares_is_identical_on_every_isa_for_every_length(void **state) {
  (void)state;
  const size_t max_n = 5000;
  float *buf = malloc((max_n + 4) * sizeof *buf);
  assert_non_null(buf);
  rng r = {3};
  for (size_t i = 0; i < max_n + 4; i++)
    buf[i] = rng_normalish(&r, (i % 7 == 0) ? 1e6f : 1e-3f);
  size_t lengths[110];
  size_t nl = 0;
  for (size_t n = 0; n <= 100; n++)
    lengths[nl++] = n;
  const size_t big[] = {255, 256, 257, 1000, 4099, 4999};
  for (size_t j = 0; j < sizeof big / sizeof big[0]; j++)
    lengths[nl++] = big[j];
  for (size_t j = 0; j < nl; j++) {
    size_t n = lengths[j];
    const float *a = buf + (n % 4); /* misaligned starts too */
    double want = reference_sum_squares(a, n);
    for (int k = 0; k < N_ISAS; k++) {
      if (!cpu_supports(k_isas[k]))
        continue;
      int nonfinite = -1;
      double got = optim_sum_squares_isa(k_isas[k], a, n, &nonfinite);
      if (d2u(got) != d2u(want))
        fail_msg("n %zu isa %s: %a, expected %a", n, cpu_isa_name(k_isas[k]), got, want);
      assert_int_equal(nonfinite, 0);
    }
    int nf = -1;
    assert_true(d2u(optim_sum_squares(a, n, &nf)) == d2u(want));
    assert_int_equal(nf, 0);
  }
  /* NULL nonfinite is allowed. */
  (void)optim_sum_squares(buf, 10, NULL);
  free(buf);
}

static void sum_squares_flags_inf_and_nan_anywhere_but_not_huge_finite_values(void **state) {
  (void)state;
  enum { N = 67 };
  float a[N];
  const float bad[] = {INFINITY, -INFINITY, NAN, u2f(0xff800001u)};
  for (int k = 0; k < N_ISAS; k++) {
    if (!cpu_supports(k_isas[k]))
      continue;
    for (size_t n = 1; n <= N; n += 11) {
      for (size_t pos = 0; pos < n; pos++)
        for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
          for (size_t i = 0; i < n; i++)
            a[i] = 0.5f;
          a[pos] = bad[b];
          int nonfinite = 0;
          (void)optim_sum_squares_isa(k_isas[k], a, n, &nonfinite);
          if (nonfinite != 1)
            fail_msg("isa %s n %zu: %a at %zu not flagged", cpu_isa_name(k_isas[k]), n,
                     (double)bad[b], pos);
        }
      /* The largest finite floats square to about 1.2e77: still finite. */
      for (size_t i = 0; i < n; i++)
        a[i] = (i & 1) ? -3.4028235e38f : 3.4028235e38f;
      int nonfinite = 1;
      double s = optim_sum_squares_isa(k_isas[k], a, n, &nonfinite);
      assert_int_equal(nonfinite, 0);
      assert_true(isfinite(s) && s > 1e77);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Throughput (printed with -v only; never asserted)                         */
/* ------------------------------------------------------------------------ */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Fills the state with ordinary values (outside the timed region). */
static void bench_fill(float *master, float *m, float *v, float *acc, size_t n) {
  rng r = {5};
  for (size_t i = 0; i < n; i++) {
    master[i] = rng_normalish(&r, 1.0f);
    m[i] = rng_normalish(&r, 1e-3f);
    v[i] = rng_normalish(&r, 1e-6f) * rng_normalish(&r, 1e-6f);
    acc[i] = rng_normalish(&r, 1.0f);
  }
}

/* Passes per timed round are capped at 100: the gradient is zero after the
 * first pass, and many more passes would decay the moments into subnormals,
 * whose slow arithmetic no training run sees. */
static void print_throughput(void) {
  const size_t sizes[] = {(size_t)1 << 15, (size_t)1 << 22};
  for (size_t si = 0; si < 2; si++) {
    size_t n = sizes[si];
    float *master = aligned_alloc(64, n * sizeof(float));
    float *m = aligned_alloc(64, n * sizeof(float));
    float *v = aligned_alloc(64, n * sizeof(float));
    float *acc = aligned_alloc(64, n * sizeof(float));
    uint16_t *low = aligned_alloc(64, n * sizeof(uint16_t));
    if (!master || !m || !v || !acc || !low) {
      free(master), free(m), free(v), free(acc), free(low);
      return;
    }
    size_t reps = ((size_t)1 << 24) / n;
    if (reps > 100)
      reps = 100;
    for (int var = 0; var < 2; var++) {
      optim_params p = variant_params(var == 0 ? 0 : 7, 5, 1.0f, ZS_DTYPE_BF16);
      optim_plan plan;
      optim_plan_init(&plan, &p);
      for (int k = 0; k < N_ISAS; k++) {
        if (!cpu_supports(k_isas[k]))
          continue;
        double best = 1e30;
        for (int round = 0; round < 3; round++) {
          bench_fill(master, m, v, acc, n);
          double t0 = now_s();
          for (size_t rep = 0; rep < reps; rep++)
            optim_apply_isa(k_isas[k], &plan, master, m, var == 0 ? v : NULL, acc, low, n);
          double dt = now_s() - t0;
          if (dt < best)
            best = dt;
        }
        print_message("  %-6s %-16s n = %8zu: %.2f Gparams/s\n", cpu_isa_name(k_isas[k]),
                      var == 0 ? "adamw" : "sgd momentum wd", n, (double)(reps * n) / best / 1e9);
      }
    }
    free(master);
    free(m);
    free(v);
    free(acc);
    free(low);
  }
}

int main(int argc, char **argv) {
  g_verbose = verbose_from_args(argc, argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(golden_gradient_generator_matches_the_python_one),
      cmocka_unit_test(torch_trajectories_are_reproduced_with_one_call_per_tensor),
      cmocka_unit_test(torch_trajectories_are_reproduced_with_one_call_over_the_arena),
      cmocka_unit_test(torch_trajectories_are_reproduced_when_split_at_arbitrary_points),
      cmocka_unit_test(power_of_two_grad_scale_reproduces_torch_exactly),
      cmocka_unit_test(every_isa_matches_the_reference_formula_with_any_grad_scale),
      cmocka_unit_test(every_isa_agrees_with_scalar_on_special_values),
      cmocka_unit_test(low_copy_of_any_master_equals_dtype_conversion),
      cmocka_unit_test(sgd_first_step_sets_the_buffer_to_the_gradient_whatever_it_held),
      cmocka_unit_test(unknown_optimizer_changes_nothing),
      cmocka_unit_test(uses_m_and_v_follow_the_optimizer),
      cmocka_unit_test(state_needs_follow_the_group),
      cmocka_unit_test(sum_squares_is_identical_on_every_isa_for_every_length),
      cmocka_unit_test(sum_squares_flags_inf_and_nan_anywhere_but_not_huge_finite_values),
  };
  int failed = cmocka_run_group_tests(tests, golden_setup, golden_teardown);
  if (g_verbose && failed == 0)
    print_throughput();
  return failed;
}
