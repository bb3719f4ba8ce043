/*
 * spec_proto — conversion between the spec and the protobuf-c message
 * zshard.v1.ModelSpec.
 *
 * The message is untrusted input: counts are checked against the SPEC_MAX_*
 * limits before anything is allocated for them, and the resulting spec goes
 * through spec_validate() before it is handed back. The two differences
 * between the forms are mapped here: the proto says disable_bias_correction
 * where the spec says bias_correction (a FLAG_NEGATED field of
 * SPEC_GROUP_FIELDS), and param_dtype 0 (unspecified) means
 * bf16.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "common/model/spec.h"
#include "zshard/v1/zshard.pb-c.h"

/* Each kind's proto form (spec.h): a FLAG is a bool, a FLAG_NEGATED a bool
 * that says the opposite, and a bool from the message becomes exactly 0 or 1. */
#define TO_PROTO_F64(v) (v)
#define TO_PROTO_FLAG(v) ((v) != 0)
#define TO_PROTO_FLAG_NEGATED(v) ((v) == 0)
#define FROM_PROTO_F64(v) (v)
#define FROM_PROTO_FLAG(v) ((v) ? 1 : 0)
#define FROM_PROTO_FLAG_NEGATED(v) ((v) ? 0 : 1)

int spec_from_proto(spec *out, const Zshard__V1__ModelSpec *msg, char *err, size_t errlen) {
  int rc;
  memset(out, 0, sizeof *out);
  if (err && errlen > 0)
    err[0] = '\0';
  if (!msg)
    return status_fail(err, errlen, ZS_EINVAL, "no model spec given");
  if (msg->n_groups < 1 || msg->n_groups > SPEC_MAX_GROUPS)
    return status_fail(err, errlen, ZS_EINVAL, "%zu param groups, expected 1..%u", msg->n_groups,
                       SPEC_MAX_GROUPS);
  if (msg->n_tensors < 1 || msg->n_tensors > SPEC_MAX_TENSORS)
    return status_fail(err, errlen, ZS_EINVAL, "%zu tensors, expected 1..%u", msg->n_tensors,
                       SPEC_MAX_TENSORS);
  for (size_t i = 0; i < msg->n_groups; i++)
    if (!msg->groups || !msg->groups[i])
      return status_fail(err, errlen, ZS_EINVAL, "param group %zu is missing", i);
  for (size_t i = 0; i < msg->n_tensors; i++) {
    if (!msg->tensors || !msg->tensors[i])
      return status_fail(err, errlen, ZS_EINVAL, "tensor %zu is missing", i);
    if (msg->tensors[i]->n_shape > SPEC_MAX_DIMS)
      return status_fail(err, errlen, ZS_EINVAL, "tensor %zu: %zu dimensions, at most %u allowed",
                         i, msg->tensors[i]->n_shape, SPEC_MAX_DIMS);
  }

  out->world_size = msg->world_size;
  out->grad_accum = msg->grad_accum;
  out->num_shards = msg->num_shards;
  out->split_threshold = msg->split_threshold;
  out->reduce = (spec_reduce)msg->grad_reduce;
  out->param_dtype = msg->param_dtype == ZSHARD__V1__DTYPE__DTYPE_UNSPECIFIED
                         ? ZS_DTYPE_BF16
                         : (zs_dtype)msg->param_dtype;
  out->pipelined = msg->pipelined != 0;

  if (!(out->job = strdup(msg->job ? msg->job : "")))
    goto fail_nomem;

  out->groups = calloc(msg->n_groups, sizeof *out->groups);
  if (!out->groups)
    goto fail_nomem;
  out->num_groups = (uint32_t)msg->n_groups;
  for (size_t i = 0; i < msg->n_groups; i++) {
    const Zshard__V1__ParamGroup *pg = msg->groups[i];
    spec_group *g = &out->groups[i];
    g->optimizer = (zs_optimizer)pg->optimizer;
#define FROM_PROTO(kind, name, proto) g->name = FROM_PROTO_##kind(pg->proto);
    SPEC_GROUP_FIELDS(FROM_PROTO)
#undef FROM_PROTO
  }

  out->tensors = calloc(msg->n_tensors, sizeof *out->tensors);
  if (!out->tensors)
    goto fail_nomem;
  out->num_tensors = (uint32_t)msg->n_tensors;
  for (size_t i = 0; i < msg->n_tensors; i++) {
    const Zshard__V1__TensorSpec *pt = msg->tensors[i];
    spec_tensor *t = &out->tensors[i];
    if (!(t->name = strdup(pt->name ? pt->name : "")))
      goto fail_nomem;
    t->numel = pt->numel;
    t->group = pt->group;
    t->ndim = (uint32_t)pt->n_shape;
    for (size_t d = 0; d < pt->n_shape; d++)
      t->shape[d] = pt->shape[d];
  }

  rc = spec_validate(out, err, errlen);
  if (rc)
    goto fail;
  return 0;

fail_nomem:
  rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory while reading the model spec");
fail:
  spec_free(out);
  return rc;
}

int spec_to_proto(const spec *s, Zshard__V1__ModelSpec *msg) {
  /* Each repeated field is one allocation: the pointer array followed by the
   * messages it points to (a multiple of 8 bytes, so the messages stay
   * aligned). Strings and shapes point into `s`. */
  Zshard__V1__ParamGroup **groups = NULL;
  Zshard__V1__TensorSpec **tensors = NULL;

  /* One byte more, so that an empty spec's arrays are still real allocations
   * and a NULL means out of memory. */
  groups = malloc((size_t)s->num_groups * (sizeof *groups + sizeof **groups) + 1);
  tensors = malloc((size_t)s->num_tensors * (sizeof *tensors + sizeof **tensors) + 1);
  if (!groups || !tensors)
    goto fail;

  Zshard__V1__ParamGroup *pgs = (Zshard__V1__ParamGroup *)(void *)(groups + s->num_groups);
  for (uint32_t i = 0; i < s->num_groups; i++) {
    const spec_group *g = &s->groups[i];
    Zshard__V1__ParamGroup *pg = &pgs[i];
    zshard__v1__param_group__init(pg);
    pg->optimizer = (Zshard__V1__Optimizer)g->optimizer;
#define TO_PROTO(kind, name, proto) pg->proto = TO_PROTO_##kind(g->name);
    SPEC_GROUP_FIELDS(TO_PROTO)
#undef TO_PROTO
    groups[i] = pg;
  }

  Zshard__V1__TensorSpec *pts = (Zshard__V1__TensorSpec *)(void *)(tensors + s->num_tensors);
  for (uint32_t i = 0; i < s->num_tensors; i++) {
    const spec_tensor *t = &s->tensors[i];
    Zshard__V1__TensorSpec *pt = &pts[i];
    zshard__v1__tensor_spec__init(pt);
    pt->name = t->name ? t->name : (char *)protobuf_c_empty_string;
    pt->numel = t->numel;
    pt->group = t->group;
    pt->n_shape = t->ndim <= SPEC_MAX_DIMS ? t->ndim : SPEC_MAX_DIMS;
    /* The message's field is not const, but packing only reads it. */
    pt->shape = pt->n_shape ? (uint64_t *)t->shape : NULL;
    tensors[i] = pt;
  }

  msg->job = s->job ? s->job : (char *)protobuf_c_empty_string;
  msg->n_groups = s->num_groups;
  msg->groups = groups;
  msg->n_tensors = s->num_tensors;
  msg->tensors = tensors;
  msg->world_size = s->world_size;
  msg->grad_accum = s->grad_accum;
  msg->num_shards = s->num_shards;
  msg->split_threshold = s->split_threshold;
  msg->grad_reduce = (Zshard__V1__GradReduce)s->reduce;
  msg->param_dtype = (Zshard__V1__DType)s->param_dtype;
  msg->pipelined = s->pipelined != 0;
  return 0;

fail:
  free(groups);
  free(tensors);
  return ZS_ENOMEM;
}

void spec_proto_release(Zshard__V1__ModelSpec *msg) {
  if (!msg)
    return;
  free(msg->groups);
  free(msg->tensors);
  msg->groups = NULL;
  msg->n_groups = 0;
  msg->tensors = NULL;
  msg->n_tensors = 0;
  msg->job = (char *)protobuf_c_empty_string;
}
