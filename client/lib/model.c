/*
 * model — the model a client describes before zs_open_job (param groups and
 * tensors, zs_add_group and zs_add_tensor) and what a caller reads of it
 * afterwards: tensors, their slices and shards, the step, the loss scale
 * and the spec hash.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/model/spec_optim.h"
#include "internal.h"

/* ---- model description -------------------------------------------------------- */

/* Called with c->mu held. */
static int check_describable_locked(const zs_client *c, const char *fn) {
  if (c->opened || c->opening)
    return zc_fail(ZS_EINVAL, "%s: the model cannot change once zs_open_job has been called", fn);
  return ZS_OK;
}

int zc_add_group_locked(zs_client *c, const spec_group *g, uint32_t *id) {
  if (c->sp.num_groups >= SPEC_MAX_GROUPS)
    return zc_fail(ZS_ERANGE, "zs_add_group: at most %u param groups", SPEC_MAX_GROUPS);
  if (c->sp.num_groups == c->group_cap) {
    uint32_t cap = c->group_cap ? 2 * c->group_cap : 4;
    spec_group *ng = realloc(c->sp.groups, cap * sizeof *ng);
    if (!ng)
      return zc_fail(ZS_ENOMEM, "zs_add_group: out of memory");
    c->sp.groups = ng;
    c->group_cap = cap;
  }
  c->sp.groups[c->sp.num_groups] = *g;
  if (id)
    *id = c->sp.num_groups;
  c->sp.num_groups++;
  return ZS_OK;
}

/* Reads the caller's group options into *g: a shorter (older) struct gets
 * torch's defaults for its optimizer in the fields it lacks. */
static int read_group_options(const zs_group_options *in, zs_group_options *g) {
  if (!in)
    return zc_fail(ZS_EINVAL, "zs_add_group: options NULL");
  int rc = zc_struct_check(in->struct_size, "zs_add_group", "zs_group_options_init");
  if (rc != ZS_OK)
    return rc;
  zs_optimizer optimizer = ZS_OPTIM_ADAMW;
  if (in->struct_size >= offsetof(zs_group_options, optimizer) + sizeof in->optimizer)
    optimizer = in->optimizer;
  zs_group_options_init(g, optimizer);
  return zc_struct_read(g, sizeof *g, in, "zs_add_group", "zs_group_options_init");
}

int zs_add_group(zs_client *c, const zs_group_options *caller_g, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  zs_group_options own;
  const zs_group_options *g = &own;
  rc = read_group_options(caller_g, &own);
  if (rc != ZS_OK) {
    zc_client_leave(c);
    return rc;
  }
  if (!spec_optim_of(g->optimizer)) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_add_group: optimizer %d is not a zs_optimizer",
                   (int)g->optimizer);
  }
  /* Ranges are checked by spec_validate at zs_open_job, with the same rules
   * the shards apply. */
  spec_group sg = {.optimizer = g->optimizer};
  /* Flags are normalised to 0 or 1, as a C truth value means. */
#define NORM_F64(v) (v)
#define NORM_FLAG(v) ((v) != 0)
#define NORM_FLAG_NEGATED(v) ((v) != 0)
#define TO_SPEC(kind, name, proto) sg.name = NORM_##kind(g->name);
  SPEC_GROUP_FIELDS(TO_SPEC)
#undef TO_SPEC
#undef NORM_F64
#undef NORM_FLAG
#undef NORM_FLAG_NEGATED
  if ((g->push_dtype != 0 && !dtype_valid(g->push_dtype)) ||
      (g->pull_dtype != 0 && !dtype_valid(g->pull_dtype))) {
    zc_client_leave(c);
    return zc_fail(ZS_EDTYPE, "zs_add_group: push_dtype and pull_dtype must be 0 or a zs_dtype");
  }
  pthread_mutex_lock(&c->mu);
  rc = check_describable_locked(c, "zs_add_group");
  if (rc == ZS_OK) {
    uint32_t gid = c->sp.num_groups;
    rc = zc_add_group_locked(c, &sg, id);
    if (rc == ZS_OK) {
      c->group_push[gid] = g->push_dtype;
      c->group_pull[gid] = g->pull_dtype;
    }
  }
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

static int add_tensor_locked(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                             const uint64_t *shape, uint32_t ndim, uint32_t *id) {
  int rc = check_describable_locked(c, "zs_add_tensor");
  if (rc != ZS_OK)
    return rc;
  if (c->sp.num_tensors >= SPEC_MAX_TENSORS)
    return zc_fail(ZS_ERANGE, "zs_add_tensor: at most %u tensors", SPEC_MAX_TENSORS);
  for (uint32_t i = 0; i < c->sp.num_tensors; i++)
    if (strcmp(c->sp.tensors[i].name, name) == 0)
      return zc_fail(ZS_EEXIST, "zs_add_tensor: a tensor named '%s' exists already", name);
  if (c->sp.num_tensors == c->tensor_cap) {
    uint32_t cap = c->tensor_cap ? 2 * c->tensor_cap : 16;
    spec_tensor *nt = realloc(c->sp.tensors, cap * sizeof *nt);
    if (!nt)
      return zc_fail(ZS_ENOMEM, "zs_add_tensor: out of memory");
    c->sp.tensors = nt;
    c->tensor_cap = cap;
  }
  spec_tensor *t = &c->sp.tensors[c->sp.num_tensors];
  memset(t, 0, sizeof *t);
  t->name = strdup(name);
  if (!t->name)
    return zc_fail(ZS_ENOMEM, "zs_add_tensor: out of memory");
  t->numel = numel;
  t->group = group;
  t->ndim = ndim;
  for (uint32_t d = 0; d < ndim; d++)
    t->shape[d] = shape[d];
  if (id)
    *id = c->sp.num_tensors;
  c->sp.num_tensors++;
  return ZS_OK;
}

int zs_add_tensor(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                  const uint64_t *shape, uint32_t ndim, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!name || !*name || strlen(name) > SPEC_MAX_NAME)
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: the name must have 1..%d bytes", SPEC_MAX_NAME);
  else if (numel == 0 || numel > SPEC_MAX_NUMEL)
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: tensor '%s' has %" PRIu64 " elements (1..2^40)", name,
                 numel);
  else if (ndim > SPEC_MAX_DIMS || (ndim > 0 && !shape))
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: tensor '%s': ndim must be at most %u, with a shape",
                 name, SPEC_MAX_DIMS);
  if (rc == ZS_OK && ndim > 0) {
    /* The product is checked here, with overflow in mind, for a clear message. */
    uint64_t prod = 1;
    for (uint32_t d = 0; d < ndim && rc == ZS_OK; d++) {
      if (shape[d] == 0 || prod > SPEC_MAX_NUMEL / shape[d])
        rc = ZS_EINVAL;
      else
        prod *= shape[d];
    }
    if (rc != ZS_OK || prod != numel)
      rc = zc_fail(ZS_EINVAL,
                   "zs_add_tensor: the shape of tensor '%s' does not multiply to %" PRIu64, name,
                   numel);
  }
  if (rc == ZS_OK) {
    pthread_mutex_lock(&c->mu);
    rc = add_tensor_locked(c, name, numel, group, shape, ndim, id);
    pthread_mutex_unlock(&c->mu);
  }
  zc_client_leave(c);
  return rc;
}

/* ---- accessors -------------------------------------------------------------------- */

uint32_t zs_num_tensors(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint32_t n = c->sp.num_tensors;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return n;
}

uint64_t zs_tensor_numel(const zs_client *c, uint32_t t) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t n = t < c->sp.num_tensors ? c->sp.tensors[t].numel : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return n;
}

int zs_tensor_slices(const zs_client *c, uint32_t t, uint32_t *n) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&m->mu);
  /* Once opened, the layout never changes: read without the lock. */
  if (!opened)
    rc = zc_fail(ZS_ENOTOPEN, "zs_tensor_slices: the job is not open (the layout is computed by "
                              "zs_open_job)");
  else if (!n)
    rc = zc_fail(ZS_EINVAL, "zs_tensor_slices: n is NULL");
  else if (t >= c->sp.num_tensors)
    rc =
        zc_fail(ZS_ENOTFOUND, "zs_tensor_slices: no tensor %" PRIu32 " (the model has %" PRIu32 ")",
                t, c->sp.num_tensors);
  else
    *n = layout_tensor_pieces(&c->lay, t);
  zc_client_leave(c);
  return rc;
}

int zs_tensor_slice(const zs_client *c, uint32_t t, uint32_t i, uint32_t *shard, uint64_t *offset,
                    uint64_t *numel) {
  uint32_t n = 0;
  int rc = zs_tensor_slices(c, t, &n);
  if (rc != ZS_OK)
    return rc;
  if (i >= n)
    return zc_fail(ZS_ENOTFOUND,
                   "zs_tensor_slice: tensor %" PRIu32 " has %" PRIu32 " slice(s), not %" PRIu32, t,
                   n, i + 1);
  const layout_piece *pc = &c->lay.pieces[c->lay.tensor_first[t] + i];
  if (shard)
    *shard = pc->shard;
  if (offset)
    *offset = pc->offset;
  if (numel)
    *numel = pc->numel;
  return ZS_OK;
}

int zs_find_tensor(const zs_client *c, const char *name, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!name || !id) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_find_tensor: name and id must not be NULL");
  }
  zs_client *m = (zs_client *)(uintptr_t)c;
  rc = zc_fail(ZS_ENOTFOUND, "zs_find_tensor: no tensor named '%s'", name);
  pthread_mutex_lock(&m->mu);
  for (uint32_t i = 0; i < c->sp.num_tensors; i++) {
    if (strcmp(c->sp.tensors[i].name, name) == 0) {
      *id = i;
      rc = ZS_OK;
      break;
    }
  }
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return rc;
}

uint64_t zs_current_step(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t s = c->opened ? c->step : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return s;
}

double zs_loss_scale(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 1.0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  double s = 1.0;
  if (c->opt.loss_scaling == ZS_LOSS_SCALE_STATIC)
    s = c->opt.static_loss_scale;
  else if (c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    s = c->scaler.scale;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return s;
}

uint64_t zs_spec_hash(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t h = c->opened ? c->hash : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return h;
}
