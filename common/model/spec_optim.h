/*
 * spec_optim — the optimizers a param group can name, one table entry each:
 * the facts about an optimizer that the model spec, the client and the shards
 * share (its name, torch's defaults, the ranges torch accepts, the state
 * arrays it keeps, what exports call them). Its kernels are the shards'
 * business and live in server/optim's table beside them.
 *
 * Adding an optimizer: a value in zs_optimizer (include/zshard/types.h) and in
 * zshard.proto's Optimizer, an entry here, its plan and kernel in
 * server/optim/optim.c's table, and for Python its constant
 * (client/python/zshard/_zshard/module.c) and name (zshard/__init__.py's
 * _ENUMS); zshard.torch maps torch optimizer classes to names.
 */
#ifndef ZSHARD_COMMON_SPEC_OPTIM_H
#define ZSHARD_COMMON_SPEC_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/model/spec.h"

/* The moment arrays an optimizer configuration keeps: M (Adam's exp_avg,
 * SGD's momentum buffer, Lion's exp_avg) and V (Adam's exp_avg_sq). */
enum { SPEC_STATE_M = 1u, SPEC_STATE_V = 2u };

typedef struct spec_optim {
  zs_optimizer id;
  const char *name;  /* lower case, as the Python package and the docs spell it */
  const char *title; /* as torch spells its class, for messages */
  /* Sets the optimizer's own hyper-parameters in g (already zeroed, with
   * lr_scale and bias_correction set) to torch's defaults. */
  void (*defaults)(spec_group *g);
  /* ZS_EINVAL with a message naming param group i when g's values are ones
   * torch's constructor refuses (the generic checks, finite and 0-or-1, ran
   * before). */
  int (*check)(const spec_group *g, uint32_t i, char *err, size_t errlen);
  /* The arrays (SPEC_STATE_*) a group with these hyper-parameters keeps. */
  unsigned (*state)(const spec_group *g);
  /* The suffixes exports and messages give the M and V arrays. */
  const char *m_name, *v_name;
  /* 1 when eps divides: it must stay above 0 even rounded to float32. */
  int eps_divides;
} spec_optim;

/* The entry for id, NULL for a value this build does not know. */
const spec_optim *spec_optim_of(zs_optimizer id);
/* The entry named `name` (lower case), NULL if none. */
const spec_optim *spec_optim_named(const char *name);
/* The i-th entry, NULL past the last: for listing them. */
const spec_optim *spec_optim_at(size_t i);

#endif
