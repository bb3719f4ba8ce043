/*
 * spec_optim — the optimizer table (see spec_optim.h). Defaults and ranges
 * are torch 1.13's, read off each class's constructor; Lion has no torch
 * class, so its are the paper's (Chen et al. 2023, "Symbolic Discovery of
 * Optimization Algorithms": betas 0.9 and 0.99, no weight decay).
 */
#include "common/model/spec_optim.h"

#include <string.h>

#include "common/base/status.h"

static int check_betas(const spec_group *g, uint32_t i, char *err, size_t errlen) {
  if (!(g->beta1 >= 0 && g->beta1 < 1))
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: beta1 %g is outside [0, 1)", i,
                       g->beta1);
  if (!(g->beta2 >= 0 && g->beta2 < 1))
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: beta2 %g is outside [0, 1)", i,
                       g->beta2);
  return 0;
}

/* ---------------------------------------------------------------- Adam, AdamW */

static void adamw_defaults(spec_group *g) {
  /* torch.optim.AdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) */
  g->beta1 = 0.9;
  g->beta2 = 0.999;
  g->eps = 1e-8;
  g->weight_decay = 1e-2;
}

static void adam_defaults(spec_group *g) {
  /* torch.optim.Adam: AdamW's but weight_decay=0 */
  adamw_defaults(g);
  g->weight_decay = 0;
}

static int adam_check(const spec_group *g, uint32_t i, char *err, size_t errlen) {
  int rc = check_betas(g, i, err, errlen);
  if (rc == 0 && !(g->eps > 0))
    rc = status_fail(err, errlen, ZS_EINVAL, "param group %u: eps %g is not positive", i, g->eps);
  return rc;
}

static unsigned adam_state(const spec_group *g) {
  (void)g;
  return SPEC_STATE_M | SPEC_STATE_V;
}

/* ------------------------------------------------------------------------ SGD */

static void sgd_defaults(spec_group *g) {
  /* torch.optim.SGD: momentum, dampening, weight_decay 0, nesterov off */
  (void)g;
}

static int sgd_check(const spec_group *g, uint32_t i, char *err, size_t errlen) {
  if (g->momentum < 0)
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: momentum %g is negative", i,
                       g->momentum);
  if (!(g->dampening >= 0 && g->dampening <= 1))
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: dampening %g is outside [0, 1]", i,
                       g->dampening);
  /* torch.optim.SGD: "Nesterov momentum requires a momentum and zero
   * dampening". */
  if (g->nesterov && !(g->momentum > 0 && g->dampening == 0))
    return status_fail(err, errlen, ZS_EINVAL,
                       "param group %u: nesterov requires momentum > 0 and dampening 0 "
                       "(momentum %g, dampening %g)",
                       i, g->momentum, g->dampening);
  return 0;
}

static unsigned sgd_state(const spec_group *g) {
  /* torch keeps no momentum buffer when momentum is 0. */
  return g->momentum != 0 ? SPEC_STATE_M : 0u;
}

/* ----------------------------------------------------------------------- Lion */

static void lion_defaults(spec_group *g) {
  g->beta1 = 0.9;
  g->beta2 = 0.99;
}

static unsigned lion_state(const spec_group *g) {
  (void)g;
  return SPEC_STATE_M;
}

/* ---------------------------------------------------------------------- table */

static const spec_optim k_optims[] = {
    {ZS_OPTIM_ADAMW, "adamw", "AdamW", adamw_defaults, adam_check, adam_state, ".exp_avg",
     ".exp_avg_sq", 1},
    {ZS_OPTIM_ADAM, "adam", "Adam", adam_defaults, adam_check, adam_state, ".exp_avg",
     ".exp_avg_sq", 1},
    {ZS_OPTIM_SGD, "sgd", "SGD", sgd_defaults, sgd_check, sgd_state, ".momentum_buffer", NULL, 0},
    {ZS_OPTIM_LION, "lion", "Lion", lion_defaults, check_betas, lion_state, ".exp_avg", NULL, 0},
};

const spec_optim *spec_optim_at(size_t i) {
  return i < sizeof k_optims / sizeof k_optims[0] ? &k_optims[i] : NULL;
}

const spec_optim *spec_optim_of(zs_optimizer id) {
  for (size_t i = 0; i < sizeof k_optims / sizeof k_optims[0]; i++)
    if (k_optims[i].id == id)
      return &k_optims[i];
  return NULL;
}

const spec_optim *spec_optim_named(const char *name) {
  for (size_t i = 0; name && i < sizeof k_optims / sizeof k_optims[0]; i++)
    if (strcmp(k_optims[i].name, name) == 0)
      return &k_optims[i];
  return NULL;
}
