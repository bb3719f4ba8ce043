/*
 * optim — the fused optimizer pass over one contiguous range of a shard's
 * arenas. One pass per element: scale the accumulated gradient, (weight decay),
 * update the moments, update the fp32 master, write the low-precision copy and
 * zero the accumulator.
 *
 * Numerics follow torch 1.13's single-tensor (foreach=False) implementations of
 * torch.optim.AdamW, Adam and SGD on this machine's CPU build, operation for
 * operation, so that with a grad_scale of 1 the result is bit-identical to torch;
 * Lion, which torch 1.13 lacks, follows the same rules for its update written
 * with torch's ops (optim.c).
 * Scalars that torch computes in double (1 - lr*wd, bias corrections, step size)
 * are computed in double here and rounded to float where torch rounds them.
 * The scalar, AVX2 and AVX-512 paths give identical bits.
 */
#ifndef ZSHARD_SERVER_OPTIM_H
#define ZSHARD_SERVER_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/cpu.h"
#include "common/model/spec.h"
#include "common/model/spec_optim.h"
#include "zshard/types.h"

typedef struct optim_params {
  zs_optimizer optimizer;
  double lr; /* this group's learning rate for this step */
  /* beta1, beta2, eps, weight_decay, momentum, dampening, nesterov,
   * bias_correction: the group's hyper-parameters (common/model/spec.h). */
  SPEC_OPTIM_FIELDS(SPEC_FIELD_MEMBER)
  uint64_t step;      /* 1-based count of applied steps, this one included */
  float grad_scale;   /* gradient = acc * grad_scale (one rounding) */
  zs_dtype low_dtype; /* ZS_DTYPE_BF16 or ZS_DTYPE_FP16 */
} optim_params;

/* Per-call constants derived once from optim_params (step size, bias
 * corrections...), so that a range split over threads computes them once.
 * Opaque to callers: fill it with optim_plan_init only. The float fields are
 * the scalars exactly as torch's kernels see them (Python doubles rounded to
 * float), see the comment at the top of optim.c. */
typedef struct optim_plan {
  optim_params p;
  /* The specialised loop the kernels run, chosen once per call so that no
   * loop branches on the optimizer's kind. SGD's value is OPTIM_V_SGD or'ed
   * with the OPTIM_V_SGD_* flags (FIRST and NESTEROV only with MOMENTUM). */
  enum optim_variant {
    OPTIM_V_NONE = 0, /* unknown optimizer: the pass changes nothing */
    OPTIM_V_ADAMW = 1,
    OPTIM_V_ADAM = 2,
    OPTIM_V_ADAM_L2 = 3, /* Adam with weight_decay != 0 */
    OPTIM_V_SGD = 16,
    OPTIM_V_SGD_L2 = 1,       /* weight_decay != 0 */
    OPTIM_V_SGD_MOMENTUM = 2, /* momentum != 0 */
    OPTIM_V_SGD_FIRST = 4,    /* step 1: the buffer becomes the gradient */
    OPTIM_V_SGD_NESTEROV = 8,
    OPTIM_V_LION = 32,
  } variant;
  int low_fp16; /* 1: the low copy is fp16, 0: bf16 */
  float grad_scale;
  float decay;        /* AdamW, Lion: 1 - lr * weight_decay */
  float weight_decay; /* Adam, SGD: the L2 coefficient */
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt, eps;
  float neg_step_size; /* Adam(W): -lr / bias_correction1 */
  float momentum, one_minus_dampening;
  float neg_lr; /* SGD, Lion */
} optim_plan;

void optim_plan_init(optim_plan *plan, const optim_params *p);

/* NULL when every scalar of the plan is a finite float (and Adam's eps, as
 * the kernel sees it, above 0), else the name of the first that is not. The
 * hyper-parameters and the step's lr arrive as finite doubles, but the
 * kernels see them rounded to float, or combined first (lr / (1 - beta1^t),
 * 1 - lr * wd): a finite double can still make every weight -inf or NaN. */
const char *optim_plan_bad_scalar(const optim_plan *plan);

/* Runs the pass over n elements. master, acc, low and (when the optimizer uses
 * them) m and v point at the same element index of their arenas; m is Adam's
 * exp_avg or SGD's momentum buffer, v Adam's exp_avg_sq; unused ones may be
 * NULL. For SGD with momentum, step == 1 initialises the buffer as torch does.
 * acc is zeroed. Any alignment works; 64-byte alignment is fastest. */
void optim_apply(const optim_plan *plan, float *master, float *m, float *v, float *acc, void *low,
                 size_t n);
void optim_apply_isa(cpu_isa isa, const optim_plan *plan, float *master, float *m, float *v,
                     float *acc, void *low, size_t n);

/* The moment arrays an optimizer configuration updates: OPTIM_STATE_M
 * (Adam's and Lion's exp_avg, SGD's momentum buffer) and OPTIM_STATE_V
 * (Adam's exp_avg_sq), as common/model/spec_optim.h's table says. The one
 * rule by which the core allocates its arenas, checkpoints write and expect
 * their moment sections and exports name their tensors; `g` is only read. */
enum { OPTIM_STATE_M = SPEC_STATE_M, OPTIM_STATE_V = SPEC_STATE_V };
unsigned optim_state_needs(const spec_group *g);

/* 1 if the optimizer needs the m (resp. v) arena: optim_state_needs for the
 * configuration in p. */
int optim_uses_m(const optim_params *p);
int optim_uses_v(const optim_params *p);

/* The hyper-parameters of group g with everything that depends on the step
 * left for the caller: lr is the group's lr_scale (the step's lr times it is
 * the caller's), step 1, grad_scale 1, low_dtype `low`. */
optim_params optim_params_of_group(const spec_group *g, zs_dtype low);

/* Sum of squares (in double, a fixed order independent of thread count and
 * ISA) and non-finite flag of n accumulated gradient elements. */
double optim_sum_squares(const float *acc, size_t n, int *nonfinite);
double optim_sum_squares_isa(cpu_isa isa, const float *acc, size_t n, int *nonfinite);

#endif
