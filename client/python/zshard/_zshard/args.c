/*
 * Python arguments onto C: keyword options onto the header's option
 * structs, whose fields are reached with offsetof() at compile time (so no
 * layout is mirrored), and tensor ids.
 */
#include "internal.h"

#include <string.h>

/* Every enum of the header is int-sized with GCC and Clang; KW_ENUM writes an
 * int, so make sure. */
_Static_assert(sizeof(zs_dtype) == sizeof(int), "zs_dtype is int-sized");
_Static_assert(sizeof(zs_grad_reduce) == sizeof(int), "zs_grad_reduce is int-sized");
_Static_assert(sizeof(zs_loss_scaling) == sizeof(int), "zs_loss_scaling is int-sized");
_Static_assert(sizeof(zs_transport) == sizeof(int), "zs_transport is int-sized");
_Static_assert(sizeof(zs_open_mode) == sizeof(int), "zs_open_mode is int-sized");
_Static_assert(sizeof(zs_schedule) == sizeof(int), "zs_schedule is int-sized");

#define CO(field, kind)                                                                            \
  { #field, kind, offsetof(zs_client_options, field) }
const kw_field zspy__client_fields[] = {
    CO(num_shards, KW_U32),
    CO(rank, KW_U32),
    CO(world_size, KW_U32),
    CO(grad_accum, KW_U32),
    CO(grad_reduce, KW_ENUM),
    CO(param_dtype, KW_ENUM),
    CO(split_threshold, KW_U64),
    CO(push_dtype, KW_ENUM),
    CO(pull_dtype, KW_ENUM),
    CO(threads, KW_U32),
    CO(reduce_bucket_size, KW_SIZE),
    CO(allgather_bucket_size, KW_SIZE),
    CO(prefetch_depth, KW_U32),
    CO(rpc_timeout_ms, KW_U32),
    CO(step_timeout_ms, KW_U32),
    CO(max_retries, KW_U32),
    CO(retry_initial_ms, KW_U32),
    CO(retry_max_ms, KW_U32),
    CO(loss_scaling, KW_ENUM),
    CO(static_loss_scale, KW_DOUBLE),
    CO(transport, KW_ENUM),
    CO(data_connections, KW_U32),
    CO(checkpoint_every, KW_U32),
    CO(checkpoint_timeout_ms, KW_U32),
    CO(open_mode, KW_ENUM),
    CO(error_feedback, KW_U32),
    CO(pipelined, KW_U32),
    CO(failover_ms, KW_U32),
    CO(schedule, KW_ENUM),
    CO(schedule_window, KW_U32),
    CO(tcp_congestion, KW_STR),
    CO(trainer_timeout_ms, KW_U32),
    CO(tcp_pacing_mbit, KW_U32),
    /* Security: the Python names drop the C names' "_file". */
    {"token", KW_STR, offsetof(zs_client_options, token)},
    {"tls_ca", KW_STR, offsetof(zs_client_options, tls_ca_file)},
    {"tls_cert", KW_STR, offsetof(zs_client_options, tls_cert_file)},
    {"tls_key", KW_STR, offsetof(zs_client_options, tls_key_file)},
    {"tls_server_name", KW_STR, offsetof(zs_client_options, tls_server_name)},
    {NULL, 0, 0},
};
#undef CO

/* The dynamic loss scaler's configuration: its own struct, which
 * zs_client_options points to when one of these is given. */
const kw_field zspy__scaler_fields[] = {
    {"initial_loss_scale", KW_DOUBLE, offsetof(zs_loss_scaler, scale)},
    {"min_loss_scale", KW_DOUBLE, offsetof(zs_loss_scaler, min_scale)},
    {"loss_scale_factor", KW_DOUBLE, offsetof(zs_loss_scaler, factor)},
    {"loss_scale_window", KW_U32, offsetof(zs_loss_scaler, window)},
    {"hysteresis", KW_U32, offsetof(zs_loss_scaler, hysteresis)},
    {NULL, 0, 0},
};

#define GO(field, kind)                                                                            \
  { #field, kind, offsetof(zs_group_options, field) }
const kw_field zspy__group_fields[] = {
    GO(lr_scale, KW_DOUBLE),  GO(beta1, KW_DOUBLE),        GO(beta2, KW_DOUBLE),
    GO(eps, KW_DOUBLE),       GO(weight_decay, KW_DOUBLE), GO(momentum, KW_DOUBLE),
    GO(dampening, KW_DOUBLE), GO(nesterov, KW_INT),        GO(bias_correction, KW_INT),
    GO(push_dtype, KW_ENUM),  GO(pull_dtype, KW_ENUM),     {NULL, 0, 0},
};
#undef GO

static int set_field(void *base, const kw_field *f, PyObject *v) {
  char *p = (char *)base + f->off;
  if (f->kind == KW_STR) {
    if (!PyUnicode_Check(v)) {
      PyErr_Format(PyExc_TypeError, "%s must be a str", f->name);
      return -1;
    }
    const char *str = PyUnicode_AsUTF8(v);
    if (!str)
      return -1;
    memcpy(p, &str, sizeof str);
    return 0;
  }
  if (f->kind == KW_DOUBLE) {
    double d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred())
      return -1;
    memcpy(p, &d, sizeof d);
    return 0;
  }
  if (f->kind == KW_INT || f->kind == KW_ENUM) {
    long l = PyLong_AsLong(v);
    if (l == -1 && PyErr_Occurred())
      return -1;
    if (l < INT32_MIN || l > INT32_MAX) {
      PyErr_Format(PyExc_OverflowError, "%s out of range", f->name);
      return -1;
    }
    int i = (int)l;
    memcpy(p, &i, sizeof i);
    return 0;
  }
  unsigned long long u = PyLong_AsUnsignedLongLong(v);
  if (u == (unsigned long long)-1 && PyErr_Occurred())
    return -1;
  if (f->kind == KW_U32) {
    if (u > UINT32_MAX) {
      PyErr_Format(PyExc_OverflowError, "%s out of range", f->name);
      return -1;
    }
    uint32_t x = (uint32_t)u;
    memcpy(p, &x, sizeof x);
  } else if (f->kind == KW_U64) {
    uint64_t x = (uint64_t)u;
    memcpy(p, &x, sizeof x);
  } else {
    size_t x = (size_t)u;
    memcpy(p, &x, sizeof x);
  }
  return 0;
}

int zspy__apply_known_kwargs(void *base, const kw_field *fields, PyObject *kw) {
  int n = 0;
  for (const kw_field *f = fields; kw && f->name; f++) {
    PyObject *v = PyDict_GetItemString(kw, f->name);
    if (!v || v == Py_None)
      continue;
    if (set_field(base, f, v) < 0)
      return -1;
    n++;
  }
  return n;
}

int zspy__apply_kwargs(void *base, const kw_field *fields, PyObject *kw, const char *const *skip,
                       const char *what) {
  if (!kw)
    return 0;
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kw, &pos, &key, &val)) {
    const char *k = PyUnicode_AsUTF8(key);
    if (!k)
      return -1;
    int skipped = 0;
    for (const char *const *s = skip; s && *s; s++)
      skipped |= strcmp(*s, k) == 0;
    if (skipped || val == Py_None)
      continue;
    const kw_field *f = fields;
    while (f->name && strcmp(f->name, k) != 0)
      f++;
    if (!f->name) {
      PyErr_Format(PyExc_TypeError, "%s: unknown option '%s'", what, k);
      return -1;
    }
    if (set_field(base, f, val) < 0)
      return -1;
  }
  return 0;
}

int zspy__tensor_id_of(PyObject *o, const char *fn, uint32_t *out) {
  unsigned long long t = PyLong_AsUnsignedLongLong(o);
  if (t == (unsigned long long)-1 && PyErr_Occurred())
    return -1;
  if (t > UINT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "%s: tensor id %llu out of range", fn, t);
    return -1;
  }
  *out = (uint32_t)t;
  return 0;
}
