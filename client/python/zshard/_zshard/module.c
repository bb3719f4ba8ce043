/*
 * zshard._zshard: the C API of libzshard as a CPython extension module.
 *
 * Everything here goes through <zshard/zshard.h>: option structs are filled by
 * the header's zs_*_init() and their fields are reached with offsetof() at
 * compile time, so no layout is mirrored and nothing can drift from the header.
 *
 * Buffers: push and pull take any object with the buffer protocol (numpy
 * arrays, bytes, bytearray, memoryview, and so torch CPU tensors through
 * t.numpy()) without copying. A Request holds the Py_buffer (and with it the
 * exporting object) until it is waited, so the memory libzshard reads or
 * writes stays valid for the whole transfer.
 *
 * Threads: the GIL is released around every call that can block (open, wait,
 * step, checkpoint, close...). The library's own threads never call into
 * Python: only request handles are used, never completion callbacks. The
 * error text of zs_last_error() is thread-local in the library, and is read
 * right after the failing call on the same OS thread, before any other
 * Python code can run on it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

#include <zshard/zshard.h>

#ifdef Py_LIMITED_API
#include "limited.h" /* the abi3 build (tests/gpu/bundle) */
#endif

static PyObject *zs_error_type; /* zshard.Error */

/* Py_BEGIN/END_ALLOW_THREADS as statements (one pair per function). */
#define GIL_RELEASE() PyThreadState *gil_state_ = PyEval_SaveThread()
#define GIL_ACQUIRE() PyEval_RestoreThread(gil_state_)

/* Frees an instance of one of this module's types (tp_free). A type of the
 * abi3 build is a heap type, which each of its instances holds a reference to. */
static void free_instance(PyObject *o) {
#ifdef Py_LIMITED_API
  PyTypeObject *t = Py_TYPE(o);
  ((freefunc)PyType_GetSlot(t, Py_tp_free))(o);
  Py_DECREF(t);
#else
  Py_TYPE(o)->tp_free(o);
#endif
}

/* Raises zshard.Error(zs_last_error()) with .status and .name. Must be
 * called on the thread that made the failing call, before anything else
 * calls into libzshard on it. */
static PyObject *raise_status(int rc) {
  const char *msg = zs_last_error();
  if (!msg || !*msg)
    msg = zs_strerror(rc);
  PyObject *exc = PyObject_CallFunction(zs_error_type, "s", msg);
  if (!exc)
    return NULL;
  PyObject *status = PyLong_FromLong(rc);
  PyObject *name = PyUnicode_FromString(zs_err_name(rc));
  if (status && name && PyObject_SetAttrString(exc, "status", status) == 0 &&
      PyObject_SetAttrString(exc, "name", name) == 0)
    PyErr_SetObject(zs_error_type, exc);
  Py_XDECREF(status);
  Py_XDECREF(name);
  Py_DECREF(exc);
  return NULL;
}

/* ---- keyword options onto C structs ------------------------------------- */

/* KW_STR stores the str's UTF-8 buffer, which lives as long as the str:
 * only for options read while the keyword dict is held (zs_client_open). */
typedef enum { KW_U32, KW_U64, KW_SIZE, KW_DOUBLE, KW_INT, KW_ENUM, KW_STR } kw_kind;

typedef struct kw_field {
  const char *name;
  kw_kind kind;
  size_t off;
} kw_field;

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
static const kw_field client_fields[] = {
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
    /* Security: the Python names drop the C names' "_file". */
    {"token", KW_STR, offsetof(zs_client_options, token)},
    {"tls_ca", KW_STR, offsetof(zs_client_options, tls_ca_file)},
    {"tls_cert", KW_STR, offsetof(zs_client_options, tls_cert_file)},
    {"tls_key", KW_STR, offsetof(zs_client_options, tls_key_file)},
    {"tls_server_name", KW_STR, offsetof(zs_client_options, tls_server_name)},
    {NULL, 0, 0},
};
#undef CO

static int set_field(void *base, const kw_field *f, PyObject *v);

/* The dynamic loss scaler's configuration: its own struct, which
 * zs_client_options points to when one of these is given. */
static const kw_field scaler_fields[] = {
    {"initial_loss_scale", KW_DOUBLE, offsetof(zs_loss_scaler, scale)},
    {"min_loss_scale", KW_DOUBLE, offsetof(zs_loss_scaler, min_scale)},
    {"loss_scale_factor", KW_DOUBLE, offsetof(zs_loss_scaler, factor)},
    {"loss_scale_window", KW_U32, offsetof(zs_loss_scaler, window)},
    {"hysteresis", KW_U32, offsetof(zs_loss_scaler, hysteresis)},
    {NULL, 0, 0},
};

/* Applies the keywords of `kw` that `fields` names (others are left alone);
 * returns the number applied or -1. */
static int apply_known_kwargs(void *base, const kw_field *fields, PyObject *kw) {
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

#define GO(field, kind)                                                                            \
  { #field, kind, offsetof(zs_group_options, field) }
static const kw_field group_fields[] = {
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

/* Applies every keyword of `kw` (may be NULL) except those in `skip` to the
 * struct at `base`; an unknown keyword is a TypeError naming it. */
static int apply_kwargs(void *base, const kw_field *fields, PyObject *kw, const char *const *skip,
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

/* ---- result types ---------------------------------------------------------- */

static PyTypeObject timing_type, step_result_type;

static PyStructSequence_Field timing_fields[] = {
    {"total_ms", "wall time of the step"},
    {"compute_ms", "the trainer's own work between calls"},
    {"push_ms", "time in pushes and waiting for them"},
    {"pull_wait_ms", "time waiting for pulls"},
    {"step_ms", "zs_step's statistics and apply"},
    {"bytes_pushed", "wire bytes of gradients sent"},
    {"bytes_pulled", "wire bytes of parameters received"},
    {"retries", "calls retried"},
    {NULL, NULL},
};
static PyStructSequence_Desc timing_desc = {
    "zshard.Timing", "Where one step's time went (zs_timing).", timing_fields, 8};

static PyStructSequence_Field step_result_fields[] = {
    {"step", "the step this call completed"},
    {"version", "parameter version after it"},
    {"applied", "the optimizer ran"},
    {"overflow", "an inf/NaN was in the gradient"},
    {"grad_norm", "global gradient norm before clipping"},
    {"clip_coef", "min(1, max_norm / (norm + 1e-6)), or 1"},
    {"coef", "sent to the shards: clip_coef / loss_scale"},
    {"loss_scale", "used for this step"},
    {"next_loss_scale", "to use for the next step"},
    {"timing", "a zshard.Timing"},
    /* By name only (the tuple keeps its 10 items): the step's membership. */
    {"num_members", "ranks that contributed to the step (docs/CLIENT.md, elastic trainers)"},
    {"member_rank", "this rank's place among them, from 0"},
    {NULL, NULL},
};
static PyStructSequence_Desc step_result_desc = {
    "zshard.StepResult", "What zs_step did (zs_step_result).", step_result_fields, 10};
#define STEP_RESULT_FIELDS 12

static PyObject *timing_new(const zs_timing *t) {
  PyObject *o = PyStructSequence_New(&timing_type);
  if (!o)
    return NULL;
  PyStructSequence_SET_ITEM(o, 0, PyFloat_FromDouble(t->total_ms));
  PyStructSequence_SET_ITEM(o, 1, PyFloat_FromDouble(t->compute_ms));
  PyStructSequence_SET_ITEM(o, 2, PyFloat_FromDouble(t->push_ms));
  PyStructSequence_SET_ITEM(o, 3, PyFloat_FromDouble(t->pull_wait_ms));
  PyStructSequence_SET_ITEM(o, 4, PyFloat_FromDouble(t->step_ms));
  PyStructSequence_SET_ITEM(o, 5, PyLong_FromUnsignedLongLong(t->bytes_pushed));
  PyStructSequence_SET_ITEM(o, 6, PyLong_FromUnsignedLongLong(t->bytes_pulled));
  PyStructSequence_SET_ITEM(o, 7, PyLong_FromUnsignedLong(t->retries));
  for (Py_ssize_t i = 0; i < 8; i++)
    if (!PyStructSequence_GET_ITEM(o, i)) {
      Py_DECREF(o);
      return NULL;
    }
  return o;
}

static PyObject *step_result_new(const zs_step_result *r, const zs_timing *t) {
  PyObject *o = PyStructSequence_New(&step_result_type);
  if (!o)
    return NULL;
  PyStructSequence_SET_ITEM(o, 0, PyLong_FromUnsignedLongLong(r->step));
  PyStructSequence_SET_ITEM(o, 1, PyLong_FromUnsignedLongLong(r->version));
  PyStructSequence_SET_ITEM(o, 2, PyBool_FromLong(r->applied));
  PyStructSequence_SET_ITEM(o, 3, PyBool_FromLong(r->overflow));
  PyStructSequence_SET_ITEM(o, 4, PyFloat_FromDouble(r->grad_norm));
  PyStructSequence_SET_ITEM(o, 5, PyFloat_FromDouble(r->clip_coef));
  PyStructSequence_SET_ITEM(o, 6, PyFloat_FromDouble(r->coef));
  PyStructSequence_SET_ITEM(o, 7, PyFloat_FromDouble(r->loss_scale));
  PyStructSequence_SET_ITEM(o, 8, PyFloat_FromDouble(r->next_loss_scale));
  PyStructSequence_SET_ITEM(o, 9, timing_new(t));
  PyStructSequence_SET_ITEM(o, 10, PyLong_FromUnsignedLong(r->num_members));
  PyStructSequence_SET_ITEM(o, 11, PyLong_FromUnsignedLong(r->member_rank));
  for (Py_ssize_t i = 0; i < STEP_RESULT_FIELDS; i++)
    if (!PyStructSequence_GET_ITEM(o, i)) {
      Py_DECREF(o);
      return NULL;
    }
  return o;
}

/* ---- Client ----------------------------------------------------------------- */

typedef struct client_object {
  PyObject_HEAD zs_client *c; /* NULL once closed */
  uint32_t ngroups;           /* groups added so far: step's per-group arrays hold as many */
} client_object;

static PyTypeObject client_type;

static int client_init(client_object *self, PyObject *args, PyObject *kw) {
  static const char *const skip[] = {"addresses",          "job",
                                     "initial_loss_scale", "min_loss_scale",
                                     "loss_scale_factor",  "loss_scale_window",
                                     "hysteresis",         NULL};
  PyObject *addresses = NULL, *job = NULL;
  if (PyTuple_GET_SIZE(args) > 1) {
    PyErr_SetString(PyExc_TypeError, "Client(addresses, **options): options are keywords");
    return -1;
  }
  if (PyTuple_GET_SIZE(args) == 1)
    addresses = PyTuple_GET_ITEM(args, 0);
  if (kw) {
    PyObject *a = PyDict_GetItemString(kw, "addresses");
    if (a && addresses) {
      PyErr_SetString(PyExc_TypeError, "Client: addresses given twice");
      return -1;
    }
    if (a)
      addresses = a;
    job = PyDict_GetItemString(kw, "job");
  }
  if (!addresses || !PyUnicode_Check(addresses)) {
    PyErr_SetString(PyExc_TypeError, "Client: addresses must be a str like \"h0:7070,h1:7070\"");
    return -1;
  }
  if (self->c) {
    PyErr_SetString(PyExc_RuntimeError, "Client: already initialised");
    return -1;
  }
  zs_client_options o;
  zs_client_options_init(&o);
  if (!(o.addresses = PyUnicode_AsUTF8(addresses)))
    return -1;
  if (job && job != Py_None) {
    if (!PyUnicode_Check(job)) {
      PyErr_SetString(PyExc_TypeError, "Client: job must be a str");
      return -1;
    }
    if (!(o.job = PyUnicode_AsUTF8(job)))
      return -1;
  }
  /* The scaler's keywords (skipped above) go to a zs_loss_scaler of our
   * own, which the options point to for zs_client_open (which copies it). */
  if (apply_kwargs(&o, client_fields, kw, skip, "Client") < 0)
    return -1;
  zs_loss_scaler sc;
  zs_loss_scaler_init(&sc);
  int nsc = apply_known_kwargs(&sc, scaler_fields, kw);
  if (nsc < 0)
    return -1;
  if (nsc > 0)
    o.dynamic_loss_scaler = &sc;
  zs_client *c = NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_client_open(&o, &c);
  GIL_ACQUIRE();
  if (rc != ZS_OK) {
    raise_status(rc);
    return -1;
  }
  self->c = c;
  return 0;
}

static zs_client *client_get(client_object *self) {
  if (!self->c)
    PyErr_SetString(zs_error_type, "the client is closed");
  return self->c;
}

static void client_close_now(client_object *self) {
  zs_client *c = self->c;
  self->c = NULL;
  if (c) {
    GIL_RELEASE();
    zs_client_close(c);
    GIL_ACQUIRE();
  }
}

static void client_dealloc(client_object *self) {
  client_close_now(self);
  free_instance((PyObject *)self);
}

static PyObject *client_close(client_object *self, PyObject *Py_UNUSED(ignored)) {
  client_close_now(self);
  Py_RETURN_NONE;
}

static PyObject *client_add_group(client_object *self, PyObject *args, PyObject *kw) {
  static const char *const skip[] = {"optimizer", NULL};
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  int optimizer = ZS_OPTIM_ADAMW;
  PyObject *o = kw ? PyDict_GetItemString(kw, "optimizer") : NULL;
  if (PyTuple_GET_SIZE(args) > 1 || (o && PyTuple_GET_SIZE(args) == 1)) {
    PyErr_SetString(PyExc_TypeError, "add_group(optimizer=ADAMW, **options)");
    return NULL;
  }
  if (PyTuple_GET_SIZE(args) == 1)
    o = PyTuple_GET_ITEM(args, 0);
  if (o) {
    long l = PyLong_AsLong(o);
    if (l == -1 && PyErr_Occurred())
      return NULL;
    optimizer = (int)l;
  }
  zs_group_options g;
  zs_group_options_init(&g, (zs_optimizer)optimizer);
  g.optimizer = (zs_optimizer)optimizer;
  if (apply_kwargs(&g, group_fields, kw, skip, "add_group") < 0)
    return NULL;
  uint32_t id = 0;
  int rc = zs_add_group(c, &g, &id);
  if (rc != ZS_OK)
    return raise_status(rc);
  if (id >= self->ngroups)
    self->ngroups = id + 1;
  return PyLong_FromUnsignedLong(id);
}

static PyObject *client_add_tensor(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "numel", "group", "shape", NULL};
  const char *name;
  unsigned long long numel;
  unsigned int group = 0;
  PyObject *shape = Py_None;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "sK|IO:add_tensor", kwlist, &name, &numel,
                                         &group, &shape))
    return NULL;
  uint64_t dims[16];
  uint32_t ndim = 0;
  if (shape != Py_None) {
    PyObject *seq = PySequence_Fast(shape, "add_tensor: shape must be a sequence of ints");
    if (!seq)
      return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 16) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "add_tensor: at most 16 dimensions");
      return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      dims[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
      if (dims[i] == (uint64_t)-1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return NULL;
      }
    }
    ndim = (uint32_t)n;
    Py_DECREF(seq);
  }
  uint32_t id = 0;
  int rc = zs_add_tensor(c, name, numel, group, ndim ? dims : NULL, ndim, &id);
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLong(id);
}

static PyObject *client_open_job(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"init_weights", "deferred", NULL};
  PyObject *init = Py_None;
  int deferred = 0;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "|Op:open_job", kwlist, &init, &deferred))
    return NULL;
  if (deferred && init != Py_None) {
    PyErr_SetString(PyExc_ValueError, "open_job: deferred=True takes no init_weights "
                                      "(send them with init_tensor)");
    return NULL;
  }
  PyObject *seq = NULL, *ret = NULL;
  Py_buffer *views = NULL;
  const float **ptrs = NULL;
  Py_ssize_t n = 0, got = 0;
  if (init != Py_None) {
    if (!(seq = PySequence_Fast(init, "open_job: init_weights must be a sequence of buffers")))
      return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n != (Py_ssize_t)zs_num_tensors(c)) {
      PyErr_Format(PyExc_ValueError, "open_job: %zd init buffers for %u tensors", n,
                   zs_num_tensors(c));
      goto fail;
    }
    views = PyMem_Calloc((size_t)n + 1, sizeof *views);
    ptrs = PyMem_Calloc((size_t)n + 1, sizeof *ptrs);
    if (!views || !ptrs) {
      PyErr_NoMemory();
      goto fail;
    }
    for (; got < n; got++) {
      if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_C_CONTIGUOUS) <
          0)
        goto fail;
      uint64_t want = zs_tensor_numel(c, (uint32_t)got) * sizeof(float);
      if ((uint64_t)views[got].len != want) {
        PyErr_Format(PyExc_ValueError,
                     "open_job: init buffer %zd has %zd bytes, tensor %zd needs %llu (fp32)", got,
                     views[got].len, got, (unsigned long long)want);
        got++;
        goto fail;
      }
      ptrs[got] = views[got].buf;
    }
  }
  int rc;
  GIL_RELEASE();
  rc = deferred ? zs_open_job_deferred(c) : zs_open_job(c, ptrs);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    raise_status(rc);
  else {
    Py_INCREF(Py_None);
    ret = Py_None;
  }
fail:
  for (Py_ssize_t i = 0; i < got; i++)
    PyBuffer_Release(&views[i]);
  PyMem_Free(views);
  PyMem_Free(ptrs);
  Py_XDECREF(seq);
  return ret;
}

/* ---- Request ----------------------------------------------------------------- */

typedef struct request_object {
  PyObject_HEAD client_object *client; /* keeps the client open while pending */
  zs_request *req;                     /* NULL once waited */
  Py_buffer view;                      /* held until waited */
  int waiting;                         /* a thread is in zs_wait */
  int status;                          /* after the wait */
  int push;
  uint32_t tensor;
} request_object;

static PyTypeObject request_type;

/* Waits for the transfer, then lets go of the buffer. The GIL is released
 * while waiting; `waiting` keeps a second Python thread from waiting on the
 * same handle (zs_wait frees it). Returns the transfer's status. */
static int request_finish(request_object *self) {
  zs_request *r = self->req;
  int rc;
  self->waiting = 1;
  GIL_RELEASE();
  rc = zs_wait(r);
  GIL_ACQUIRE();
  self->waiting = 0;
  self->req = NULL;
  self->status = rc;
  PyBuffer_Release(&self->view);
  Py_CLEAR(self->client);
  return rc;
}

static PyObject *request_wait(request_object *self, PyObject *Py_UNUSED(ignored)) {
  if (self->waiting) {
    PyErr_SetString(PyExc_RuntimeError, "Request.wait: another thread is waiting on it");
    return NULL;
  }
  if (!self->req) {
    PyErr_SetString(PyExc_RuntimeError, "Request.wait: already waited");
    return NULL;
  }
  int rc = request_finish(self);
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

static PyObject *request_test(request_object *self, PyObject *Py_UNUSED(ignored)) {
  if (!self->req)
    Py_RETURN_TRUE;
  return PyBool_FromLong(zs_test(self->req) == 1);
}

static PyObject *request_get_pending(request_object *self, void *Py_UNUSED(closure)) {
  return PyBool_FromLong(self->req != NULL);
}

static void request_dealloc(request_object *self) {
  /* A request dropped unwaited still owns a transfer that reads or writes
   * its buffer: wait for it here, so the buffer is never released early. A
   * failure cannot be raised from a destructor: it becomes a RuntimeWarning
   * with a hint (a traceback-less "Exception ignored" at exit told users
   * nothing they could act on), or, when the warning filters turn warnings
   * into errors, an unraisable error as before. */
  if (self->req && !self->waiting) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    int rc = request_finish(self);
    if (rc != ZS_OK &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "zshard: a %s of tensor %u dropped without wait() failed: %s: %s "
                         "(wait() every Request, or close() the client or the sharded "
                         "optimizer, before letting go of it)",
                         self->push ? "push" : "pull", (unsigned)self->tensor, zs_err_name(rc),
                         zs_last_error()) < 0) {
      /* Not `self` as the context: the unraisable hook may keep its object
       * (pytest's does, to report it after the test), and self is being
       * freed; a sentence naming the transfer instead. */
      PyObject *where = PyUnicode_FromFormat("an unwaited zshard.Request (%s of tensor %u)",
                                             self->push ? "push" : "pull", (unsigned)self->tensor);
      PyErr_WriteUnraisable(where);
      Py_XDECREF(where);
    }
    PyErr_Restore(et, ev, tb);
  }
  /* A batch entry whose submission failed holds a buffer and no transfer. */
  if (!self->req && self->view.obj)
    PyBuffer_Release(&self->view);
  Py_CLEAR(self->client);
  free_instance((PyObject *)self);
}

static PyObject *request_repr(request_object *self) {
  return PyUnicode_FromFormat("<zshard.Request %s tensor %u %s>", self->push ? "push" : "pull",
                              (unsigned)self->tensor,
                              self->req ? "pending" : (self->status ? "failed" : "done"));
}

/* The zs_dtype of a buffer: explicit, or from its struct format ('f': fp32,
 * 'e': fp16). bf16 has no buffer format and must be given. */
static int buffer_dtype(const Py_buffer *v, int dtype, const char *what) {
  if (dtype)
    return dtype;
  const char *f = v->format ? v->format : "B";
  if (*f == '<' || *f == '=' || *f == '@')
    f++;
  if (strcmp(f, "f") == 0)
    return ZS_DTYPE_FP32;
  if (strcmp(f, "e") == 0)
    return ZS_DTYPE_FP16;
  PyErr_Format(PyExc_TypeError,
               "%s: cannot tell the dtype of a buffer of format '%s': pass dtype=FP32/FP16/BF16",
               what, f);
  return 0;
}

/* A Request with no transfer yet: the caller fills view, then req and client. */
static request_object *request_new(client_object *self, int push, uint32_t tensor) {
  (void)self;
  request_object *r = PyObject_New(request_object, &request_type);
  if (!r)
    return NULL;
  r->client = NULL;
  r->req = NULL;
  r->view.obj = NULL;
  r->waiting = 0;
  r->status = 0;
  r->push = push;
  r->tensor = tensor;
  return r;
}

/* The positional arguments of push / push_many (tensor(s), buffer(s)[,
 * micro[, dtype]]) or pull / pull_many (tensor(s), buffer(s)[, dtype]) when
 * micro and dtype are plain ints, as zshard.torch passes them: what
 * PyArg_ParseTupleAndKeywords would give ("I" keeps the low bits, "i" must
 * fit an int), without parsing the format string on every call (a tenth of
 * a batch call's instructions). The first two are returned as they are.
 * Returns 0 when the call must take the general path (keywords, other
 * types, an int out of range), which then reports any error. */
static int transfer_args_fast(PyObject *args, PyObject *kw, int push, PyObject **tensors,
                              PyObject **buffers, unsigned int *micro, int *dtype) {
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  if ((kw && PyDict_GET_SIZE(kw) > 0) || nargs < 2 || nargs > (push ? 4 : 3))
    return 0;
  for (Py_ssize_t k = 2; k < nargs; k++)
    if (!PyLong_CheckExact(PyTuple_GET_ITEM(args, k)))
      return 0;
  Py_ssize_t at = 2;
  if (push && nargs > at)
    *micro = (unsigned int)PyLong_AsUnsignedLongMask(PyTuple_GET_ITEM(args, at++));
  if (nargs > at) {
    int overflow = 0;
    long d = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(args, at), &overflow);
    if (overflow || d < INT_MIN || d > INT_MAX)
      return 0;
    *dtype = (int)d;
  }
  *tensors = PyTuple_GET_ITEM(args, 0);
  *buffers = PyTuple_GET_ITEM(args, 1);
  return 1;
}

static PyObject *transfer(client_object *self, PyObject *args, PyObject *kw, int push) {
  static char *push_kw[] = {"tensor", "buffer", "micro", "dtype", NULL};
  static char *pull_kw[] = {"tensor", "buffer", "dtype", NULL};
  unsigned int tensor, micro = 0;
  int dtype = 0;
  PyObject *buf;
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  PyObject *tobj;
  if (transfer_args_fast(args, kw, push, &tobj, &buf, &micro, &dtype) && PyLong_CheckExact(tobj))
    tensor = (unsigned int)PyLong_AsUnsignedLongMask(tobj);
  else if (push ? !PyArg_ParseTupleAndKeywords(args, kw, "IO|Ii:push", push_kw, &tensor, &buf,
                                               &micro, &dtype)
                : !PyArg_ParseTupleAndKeywords(args, kw, "IO|i:pull", pull_kw, &tensor, &buf,
                                               &dtype))
    return NULL;
  request_object *r = request_new(self, push, tensor);
  if (!r)
    return NULL;
  int rc = 0;
  if (push && buf == Py_None) {
    /* No gradient this step: zs_push with no buffer. */
    memset(&r->view, 0, sizeof r->view);
    dtype = ZS_DTYPE_FP32;
  } else if (PyObject_GetBuffer(buf, &r->view,
                                PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (push ? 0 : PyBUF_WRITABLE)) <
             0) {
    r->view.obj = NULL;
    Py_DECREF(r);
    return NULL;
  } else if (!(dtype = buffer_dtype(&r->view, dtype, push ? "push" : "pull"))) {
    goto fail;
  }
  zs_request *req = NULL;
  /* Submission does not wait for the network, but may wait for a lock the
   * library's threads hold: release the GIL anyway. */
  GIL_RELEASE();
  if (push)
    rc = zs_push(c, tensor, micro, r->view.buf, (zs_dtype)dtype, (size_t)r->view.len, &req);
  else
    rc = zs_pull(c, tensor, r->view.buf, (zs_dtype)dtype, (size_t)r->view.len, &req);
  GIL_ACQUIRE();
  if (rc != ZS_OK) {
    raise_status(rc);
    goto fail;
  }
  r->req = req;
  Py_INCREF(self);
  r->client = self;
  return (PyObject *)r;
fail:
  PyBuffer_Release(&r->view);
  Py_DECREF(r);
  return NULL;
}

static PyObject *client_push(client_object *self, PyObject *args, PyObject *kw) {
  return transfer(self, args, kw, 1);
}

static PyObject *client_pull(client_object *self, PyObject *args, PyObject *kw) {
  return transfer(self, args, kw, 0);
}

/* push_many / pull_many: n transfers in one zs_push_many / zs_pull_many
 * call, so the library wakes its workers once for the batch. Each entry gets
 * a Request of its own that holds its buffer until waited, exactly as push()
 * and pull() do; the batch is all-or-nothing from Python's view: when the
 * call fails, the entries the library did submit (the half-way case of
 * zs_push_many) are waited here before the error is raised, so no buffer is
 * released under a transfer. */
/* Frees transfer_many's arrays unless they are its stack arrays (ids is
 * ids_s then; the four are allocated together). */
static void many_free(uint32_t *ids, const uint32_t *ids_s, void **ptrs, size_t *nbytes,
                      zs_request **reqs) {
  if (ids == ids_s)
    return;
  PyMem_Free(ids);
  PyMem_Free(ptrs);
  PyMem_Free(nbytes);
  PyMem_Free(reqs);
}

/* Entries of a batch whose arrays live on the stack: a module's tensors
 * (zshard.torch submits one module at a time); larger batches allocate. */
#define MANY_ON_STACK 16

static PyObject *transfer_many(client_object *self, PyObject *args, PyObject *kw, int push) {
  static char *push_kw[] = {"tensors", "buffers", "micro", "dtype", NULL};
  static char *pull_kw[] = {"tensors", "buffers", "dtype", NULL};
  const char *what = push ? "push_many" : "pull_many";
  unsigned int micro = 0;
  int dtype = 0;
  PyObject *tensors, *buffers;
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  if (!transfer_args_fast(args, kw, push, &tensors, &buffers, &micro, &dtype) &&
      (push ? !PyArg_ParseTupleAndKeywords(args, kw, "OO|Ii:push_many", push_kw, &tensors, &buffers,
                                           &micro, &dtype)
            : !PyArg_ParseTupleAndKeywords(args, kw, "OO|i:pull_many", pull_kw, &tensors, &buffers,
                                           &dtype)))
    return NULL;
  PyObject *tseq = NULL, *bseq = NULL, *list = NULL;
  uint32_t ids_s[MANY_ON_STACK], *ids = NULL;
  void *ptrs_s[MANY_ON_STACK], **ptrs = NULL;
  size_t nbytes_s[MANY_ON_STACK], *nbytes = NULL;
  zs_request *reqs_s[MANY_ON_STACK], **reqs = NULL;
  Py_ssize_t n = 0, i;
  const int given = dtype;
  if (!(tseq = PySequence_Fast(tensors, "tensors must be a sequence of tensor ids")) ||
      !(bseq = PySequence_Fast(buffers, "buffers must be a sequence of buffers")))
    goto fail;
  n = PySequence_Fast_GET_SIZE(tseq);
  if (PySequence_Fast_GET_SIZE(bseq) != n) {
    PyErr_Format(PyExc_ValueError, "%s: %zd tensors but %zd buffers", what, n,
                 PySequence_Fast_GET_SIZE(bseq));
    goto fail;
  }
  if ((uint64_t)n > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: too many entries", what);
    goto fail;
  }
  if (!(list = PyList_New(n)))
    goto fail;
  if (n == 0) {
    Py_DECREF(tseq);
    Py_DECREF(bseq);
    return list;
  }
  if (n <= MANY_ON_STACK) {
    ids = ids_s;
    ptrs = ptrs_s;
    nbytes = nbytes_s;
    reqs = reqs_s;
    memset(reqs_s, 0, sizeof reqs_s);
  } else {
    /* One allocation per array and batch, not per entry. */
    ids = PyMem_Malloc((size_t)n * sizeof *ids);
    ptrs = PyMem_Malloc((size_t)n * sizeof *ptrs);
    nbytes = PyMem_Malloc((size_t)n * sizeof *nbytes);
    reqs = PyMem_Calloc((size_t)n, sizeof *reqs);
    if (!ids || !ptrs || !nbytes || !reqs) {
      PyErr_NoMemory();
      goto fail;
    }
  }
  for (i = 0; i < n; i++) {
    unsigned long t = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(tseq, i));
    if (t == (unsigned long)-1 && PyErr_Occurred())
      goto fail;
    if (t > UINT32_MAX) {
      PyErr_Format(PyExc_OverflowError, "%s: tensor id %lu out of range", what, t);
      goto fail;
    }
    request_object *r = request_new(self, push, (uint32_t)t);
    if (!r)
      goto fail;
    PyList_SET_ITEM(list, i, (PyObject *)r); /* the list owns it from here */
    if (push && PySequence_Fast_GET_ITEM(bseq, i) == Py_None) {
      /* No gradient this step: an entry with no buffer (zs_push_many). */
      memset(&r->view, 0, sizeof r->view);
      ids[i] = (uint32_t)t;
      ptrs[i] = NULL;
      nbytes[i] = 0;
      continue;
    }
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bseq, i), &r->view,
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (push ? 0 : PyBUF_WRITABLE)) < 0) {
      r->view.obj = NULL;
      goto fail;
    }
    /* An explicit dtype applies to every buffer; otherwise each buffer's
     * format says, and they must agree. */
    int d = buffer_dtype(&r->view, given, what);
    if (!d)
      goto fail;
    if (!dtype)
      dtype = d;
    else if (d != dtype) {
      PyErr_Format(PyExc_TypeError, "%s: buffer %zd's dtype differs from buffer 0's", what, i);
      goto fail;
    }
    ids[i] = (uint32_t)t;
    ptrs[i] = r->view.buf;
    nbytes[i] = (size_t)r->view.len;
  }
  if (!dtype)
    dtype = ZS_DTYPE_FP32; /* every entry without a gradient */
  int rc;
  GIL_RELEASE();
  if (push)
    rc = zs_push_many(c, (uint32_t)n, ids, micro, (const void *const *)ptrs, (zs_dtype)dtype,
                      nbytes, reqs);
  else
    rc = zs_pull_many(c, (uint32_t)n, ids, (void *const *)ptrs, (zs_dtype)dtype, nbytes, reqs);
  GIL_ACQUIRE();
  if (rc != ZS_OK) {
    /* The sentence first: the waits below may overwrite zs_last_error(). */
    raise_status(rc);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    int any = 0;
    for (i = 0; i < n; i++)
      any |= reqs[i] != NULL;
    if (any) {
      GIL_RELEASE();
      for (i = 0; i < n; i++)
        if (reqs[i])
          (void)zs_wait(reqs[i]);
      GIL_ACQUIRE();
    }
    PyErr_Restore(et, ev, tb);
    goto fail;
  }
  for (i = 0; i < n; i++) {
    request_object *r = (request_object *)PyList_GET_ITEM(list, i);
    r->req = reqs[i];
    Py_INCREF(self);
    r->client = self;
  }
  many_free(ids, ids_s, ptrs, nbytes, reqs);
  Py_DECREF(tseq);
  Py_DECREF(bseq);
  return list;
fail:
  /* Requests without a zs_request release their buffer when freed. */
  Py_XDECREF(list);
  many_free(ids, ids_s, ptrs, nbytes, reqs);
  Py_XDECREF(tseq);
  Py_XDECREF(bseq);
  return NULL;
}

static PyObject *client_push_many(client_object *self, PyObject *args, PyObject *kw) {
  return transfer_many(self, args, kw, 1);
}

static PyObject *client_pull_many(client_object *self, PyObject *args, PyObject *kw) {
  return transfer_many(self, args, kw, 0);
}

/* ---- step, checkpoints, inspection ---------------------------------------------------- */

/* The step's per-group hyper-parameters (zs_step_options.group_beta1 ...
 * group_dampening): step()'s keywords of the same names, each None or one
 * float per param group. */
enum { STEP_NHP = 6 };
static const char *const step_hp_names[STEP_NHP] = {"group_beta1",    "group_beta2",
                                                    "group_eps",      "group_weight_decay",
                                                    "group_momentum", "group_dampening"};

/* Points o's per-group arrays at copies of the sequences in seqs (None
 * leaves the array NULL), held in *vals (PyMem, STEP_NHP * ngroups doubles,
 * the caller frees it). zs_step_ex cannot see the arrays' lengths, so each
 * must hold exactly ngroups floats (ValueError otherwise). -1 with an
 * exception set on failure. */
static int step_hparams_read(PyObject *const seqs[STEP_NHP], uint32_t ngroups, zs_step_options *o,
                             double **vals) {
  const double **dst[STEP_NHP] = {&o->group_beta1,        &o->group_beta2,    &o->group_eps,
                                  &o->group_weight_decay, &o->group_momentum, &o->group_dampening};
  *vals = PyMem_Malloc(((size_t)STEP_NHP * ngroups + 1) * sizeof **vals);
  if (!*vals) {
    PyErr_NoMemory();
    return -1;
  }
  for (int k = 0; k < STEP_NHP; k++) {
    if (seqs[k] == Py_None)
      continue;
    PyObject *seq = PySequence_Fast(seqs[k], "step: group hyper-parameters must be sequences");
    if (!seq)
      return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n != (Py_ssize_t)ngroups) {
      PyErr_Format(PyExc_ValueError, "step: %s has %zd values but the job has %u param groups",
                   step_hp_names[k], n, (unsigned)ngroups);
      Py_DECREF(seq);
      return -1;
    }
    double *v = *vals + (size_t)k * ngroups;
    for (Py_ssize_t i = 0; i < n; i++) {
      v[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
      if (v[i] == -1.0 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return -1;
      }
    }
    Py_DECREF(seq);
    *dst[k] = v;
  }
  return 0;
}

static PyObject *client_step(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"lr",
                           "max_grad_norm",
                           "loss_scale",
                           "group_lr",
                           "clip_coef",
                           "group_beta1",
                           "group_beta2",
                           "group_eps",
                           "group_weight_decay",
                           "group_momentum",
                           "group_dampening",
                           NULL};
  zs_step_options o;
  zs_step_options_init(&o);
  PyObject *group_lr = Py_None, *ret = NULL;
  PyObject *hps[STEP_NHP] = {Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  double *hp_vals = NULL;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "d|ddOdOOOOOO:step", kwlist, &o.lr,
                                         &o.max_grad_norm, &o.loss_scale, &group_lr, &o.clip_coef,
                                         &hps[0], &hps[1], &hps[2], &hps[3], &hps[4], &hps[5]))
    return NULL;
  /* group_lr: one lr per group, used as given (zs_step_ex checks the count
   * and the values, and names the offender). */
  double *lrs = NULL;
  if (group_lr != Py_None) {
    PyObject *seq = PySequence_Fast(group_lr, "step: group_lr must be a sequence of floats");
    if (!seq)
      return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > UINT32_MAX || !(lrs = PyMem_Malloc(((size_t)n + 1) * sizeof *lrs))) {
      Py_DECREF(seq);
      return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      lrs[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
      if (lrs[i] == -1.0 && PyErr_Occurred()) {
        Py_DECREF(seq);
        goto out;
      }
    }
    Py_DECREF(seq);
    o.group_lr = lrs;
    o.num_group_lr = (uint32_t)n;
  }
  if (step_hparams_read(hps, self->ngroups, &o, &hp_vals) < 0)
    goto out;
  zs_step_result r;
  zs_step_result_init(&r);
  zs_timing t;
  int rc;
  GIL_RELEASE();
  rc = zs_step_ex(c, &o, &r);
  GIL_ACQUIRE();
  if (rc != ZS_OK) {
    raise_status(rc);
    goto out;
  }
  /* The step's timing is the client's last (zs_step_result does not carry
   * it): read right after the step, on the thread that stepped. */
  rc = zs_last_timing(c, &t);
  if (rc != ZS_OK) {
    raise_status(rc);
    goto out;
  }
  ret = step_result_new(&r, &t);
out:
  PyMem_Free(lrs);
  PyMem_Free(hp_vals);
  return ret;
}

static PyObject *client_grad_norm(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"loss_scale", NULL};
  double loss_scale = 0, norm = 0;
  int overflow = 0;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "|d:grad_norm", kwlist, &loss_scale))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_grad_norm(c, loss_scale, &norm, &overflow);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  return Py_BuildValue("(dO)", norm, overflow ? Py_True : Py_False);
}

/* ---- optimizer state -------------------------------------------------------------- */

/* state_read / state_write: one tensor's array `which` (MASTER, EXP_AVG,
 * EXP_AVG_SQ), whole, in fp32, straight from or into the caller's buffer (no
 * copy here: the library unpacks into it or packs from it). The buffer must
 * be C-contiguous; its length is checked by the library against the tensor's
 * numel, which names the tensor when it differs. Both block on the network
 * with the GIL released; the Py_buffer keeps the exporter alive meanwhile. */
static PyObject *state_call(client_object *self, PyObject *args, PyObject *kw, int write) {
  static char *kwlist[] = {"tensor", "array", "buffer", NULL};
  unsigned int tensor;
  int which;
  PyObject *buf;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, write ? "IiO:state_write" : "IiO:state_read",
                                         kwlist, &tensor, &which, &buf))
    return NULL;
  Py_buffer v;
  if (PyObject_GetBuffer(buf, &v,
                         PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (write ? 0 : PyBUF_WRITABLE)) < 0)
    return NULL;
  /* The library reads and writes float32: a buffer that says otherwise is
   * a mistake (bytes-like buffers without a float format are taken as is). */
  const char *f = v.format ? v.format : "B";
  if (*f == '<' || *f == '=' || *f == '@')
    f++;
  if (strcmp(f, "f") != 0 && strcmp(f, "B") != 0 && strcmp(f, "b") != 0 && strcmp(f, "c") != 0) {
    PyErr_Format(PyExc_TypeError, "%s: the buffer's format is '%s'; float32 ('f') only",
                 write ? "state_write" : "state_read", f);
    PyBuffer_Release(&v);
    return NULL;
  }
  int rc;
  GIL_RELEASE();
  if (write)
    rc = zs_state_write(c, tensor, (zs_state_array)which, (const float *)v.buf, (size_t)v.len);
  else
    rc = zs_state_read(c, tensor, (zs_state_array)which, (float *)v.buf, (size_t)v.len);
  GIL_ACQUIRE();
  PyBuffer_Release(&v);
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

static PyObject *client_state_read(client_object *self, PyObject *args, PyObject *kw) {
  return state_call(self, args, kw, 0);
}

static PyObject *client_state_write(client_object *self, PyObject *args, PyObject *kw) {
  return state_call(self, args, kw, 1);
}

static PyObject *client_optimizer_steps(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  uint64_t steps = 0;
  int rc;
  GIL_RELEASE();
  rc = zs_optimizer_steps(c, &steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLongLong(steps);
}

static PyObject *client_set_optimizer_steps(client_object *self, PyObject *arg) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  unsigned long long steps = PyLong_AsUnsignedLongLong(arg);
  if (steps == (unsigned long long)-1 && PyErr_Occurred())
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_set_optimizer_steps(c, (uint64_t)steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

/* ---- per-tensor step counts (zs_tensor_steps, zs_set_tensor_steps) ---- */

/* A tensor id from Python: a non-negative int below 2^32 (OverflowError
 * naming fn otherwise; whether the job has that tensor is libzshard's to
 * say). 0 or -1 with the exception set. */
static int tensor_id_of(PyObject *o, const char *fn, uint32_t *out) {
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

static PyObject *client_tensor_steps(client_object *self, PyObject *arg) {
  zs_client *c = client_get(self);
  uint32_t t;
  if (!c || tensor_id_of(arg, "tensor_steps", &t) != 0)
    return NULL;
  uint64_t steps = 0;
  int rc;
  GIL_RELEASE();
  rc = zs_tensor_steps(c, t, &steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLongLong(steps);
}

static PyObject *client_set_tensor_steps(client_object *self, PyObject *args) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  PyObject *id, *count;
  uint32_t t;
  if (!PyArg_ParseTuple(args, "OO:set_tensor_steps", &id, &count) ||
      tensor_id_of(id, "set_tensor_steps", &t) != 0)
    return NULL;
  /* Unlike the "K" format, this refuses negative and too large counts. */
  unsigned long long steps = PyLong_AsUnsignedLongLong(count);
  if (steps == (unsigned long long)-1 && PyErr_Occurred())
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_set_tensor_steps(c, t, (uint64_t)steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

/* A blocking call that takes only the client: the GIL released around it,
 * None or the raised zshard.Error. */
static PyObject *call_blocking(client_object *self, int (*fn)(zs_client *)) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = fn(c);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

static PyObject *client_close_job(client_object *self, PyObject *Py_UNUSED(ignored)) {
  return call_blocking(self, zs_close_job);
}

/* ---- deferred initialisation -------------------------------------------------- */

static PyObject *client_init_tensor(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tensor", "buffer", NULL};
  unsigned int t = 0;
  Py_buffer view;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "Iy*:init_tensor", kwlist, &t, &view))
    return NULL;
  PyObject *ret = NULL;
  uint64_t want = zs_tensor_numel(c, t) * sizeof(float);
  if (t >= zs_num_tensors(c))
    PyErr_Format(PyExc_ValueError, "init_tensor: no tensor %u (the job has %u)", t,
                 zs_num_tensors(c));
  else if ((uint64_t)view.len != want || !PyBuffer_IsContiguous(&view, 'C'))
    PyErr_Format(PyExc_ValueError,
                 "init_tensor: the buffer has %zd bytes, tensor %u needs %llu contiguous (fp32)",
                 view.len, t, (unsigned long long)want);
  else {
    int rc;
    GIL_RELEASE();
    rc = zs_init_tensor(c, t, view.buf);
    GIL_ACQUIRE();
    if (rc != ZS_OK)
      raise_status(rc);
    else {
      Py_INCREF(Py_None);
      ret = Py_None;
    }
  }
  PyBuffer_Release(&view);
  return ret;
}

static PyObject *client_wait_initialized(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"timeout_ms", NULL};
  unsigned long long timeout_ms = 0;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "|K:wait_initialized", kwlist, &timeout_ms))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_wait_initialized(c, (uint64_t)timeout_ms);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  Py_RETURN_NONE;
}

static PyObject *client_tensor_slices(client_object *self, PyObject *arg) {
  zs_client *c = client_get(self);
  uint32_t t;
  if (!c || tensor_id_of(arg, "tensor_slices", &t) != 0)
    return NULL;
  uint32_t n = 0;
  int rc = zs_tensor_slices(c, t, &n);
  if (rc != ZS_OK)
    return raise_status(rc);
  PyObject *list = PyList_New(n);
  if (!list)
    return NULL;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t shard = 0;
    uint64_t off = 0, numel = 0;
    if ((rc = zs_tensor_slice(c, t, i, &shard, &off, &numel)) != ZS_OK) {
      Py_DECREF(list);
      return raise_status(rc);
    }
    PyObject *e = Py_BuildValue("(IKK)", shard, (unsigned long long)off, (unsigned long long)numel);
    if (!e) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, i, e);
  }
  return list;
}

static PyObject *client_last_timing(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  zs_timing t;
  memset(&t, 0, sizeof t);
  int rc = zs_last_timing(c, &t);
  if (rc != ZS_OK)
    return raise_status(rc);
  return timing_new(&t);
}

/* The blocking calls that take an optional step and return nothing. */
static PyObject *blocking_step_call(client_object *self, PyObject *args, PyObject *kw,
                                    int (*fn)(zs_client *, uint64_t), const char *fmt) {
  static char *kwlist[] = {"step", NULL};
  unsigned long long step = 0;
  zs_client *c = client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &step))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = fn(c, step);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLongLong(zs_current_step(c));
}

static PyObject *client_checkpoint(client_object *self, PyObject *args, PyObject *kw) {
  return blocking_step_call(self, args, kw, zs_checkpoint, "|K:checkpoint");
}

static PyObject *client_restore(client_object *self, PyObject *args, PyObject *kw) {
  return blocking_step_call(self, args, kw, zs_restore, "|K:restore");
}

static PyObject *client_latest_checkpoint(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  uint64_t step = 0;
  int rc;
  GIL_RELEASE();
  rc = zs_latest_checkpoint(c, &step);
  GIL_ACQUIRE();
  if (rc == ZS_ENOTFOUND)
    Py_RETURN_NONE;
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLongLong(step);
}

static PyObject *client_last_checkpoint(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  uint64_t step = 0;
  int rc = zs_last_checkpoint(c, &step);
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLongLong(step);
}

static PyObject *client_wait_pushes(client_object *self, PyObject *Py_UNUSED(ignored)) {
  return call_blocking(self, zs_wait_pushes);
}

static PyObject *client_tensor_numel(client_object *self, PyObject *arg) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  unsigned long t = PyLong_AsUnsignedLong(arg);
  if (t == (unsigned long)-1 && PyErr_Occurred())
    return NULL;
  if (t >= zs_num_tensors(c)) {
    PyErr_Format(PyExc_IndexError, "no tensor %lu", t);
    return NULL;
  }
  return PyLong_FromUnsignedLongLong(zs_tensor_numel(c, (uint32_t)t));
}

static PyObject *client_find_tensor(client_object *self, PyObject *arg) {
  zs_client *c = client_get(self);
  if (!c)
    return NULL;
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name)
    return NULL;
  uint32_t id;
  int rc = zs_find_tensor(c, name, &id);
  if (rc != ZS_OK)
    return raise_status(rc);
  return PyLong_FromUnsignedLong(id);
}

static PyObject *client_get_num_tensors(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = client_get(self);
  return c ? PyLong_FromUnsignedLong(zs_num_tensors(c)) : NULL;
}

static PyObject *client_get_current_step(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = client_get(self);
  return c ? PyLong_FromUnsignedLongLong(zs_current_step(c)) : NULL;
}

static PyObject *client_get_loss_scale(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = client_get(self);
  return c ? PyFloat_FromDouble(zs_loss_scale(c)) : NULL;
}

static PyObject *client_get_spec_hash(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = client_get(self);
  return c ? PyLong_FromUnsignedLongLong(zs_spec_hash(c)) : NULL;
}

static PyObject *client_get_closed(client_object *self, void *Py_UNUSED(closure)) {
  return PyBool_FromLong(self->c == NULL);
}

static PyObject *client_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  Py_INCREF(self);
  return self;
}

static PyObject *client_exit(client_object *self, PyObject *Py_UNUSED(args)) {
  client_close_now(self);
  Py_RETURN_FALSE;
}

#define KWM(name, doc)                                                                             \
  { #name, (PyCFunction)(void (*)(void))client_##name, METH_VARARGS | METH_KEYWORDS, doc }
static PyMethodDef client_methods[] = {
    KWM(add_group, "add_group(optimizer=ADAMW, lr_scale=, beta1=, beta2=, eps=, weight_decay=, "
                   "momentum=, dampening=, nesterov=, bias_correction=, push_dtype=, pull_dtype=) "
                   "-> group id"),
    KWM(add_tensor, "add_tensor(name, numel, group=0, shape=None) -> tensor id"),
    KWM(open_job, "open_job(init_weights=None): one fp32 buffer per tensor (rank 0)"),
    KWM(push, "push(tensor, buffer, micro=0, dtype=0) -> Request; buffer held until waited. "
              "buffer None: no gradient this step (zs_push with no buffer; skipped by the "
              "shards when no trainer has one)"),
    KWM(pull, "pull(tensor, buffer, dtype=0) -> Request; buffer written until waited"),
    KWM(push_many,
        "push_many(tensors, buffers, micro=0, dtype=0) -> [Request]: one push per entry, "
        "submitted in one call (zs_push_many: one wake-up of the workers for the batch); every "
        "buffer is held by its Request until waited; all buffers of one dtype (None: no "
        "gradient, as in push). A refused batch submits nothing"),
    KWM(pull_many, "pull_many(tensors, buffers, dtype=0) -> [Request]: zs_pull_many, as "
                   "push_many; each buffer is written until its Request is waited"),
    KWM(step, "step(lr, max_grad_norm=0, loss_scale=0, group_lr=None, clip_coef=0, "
              "group_beta1=None, ...) -> "
              "StepResult (zs_step_ex). group_lr: one learning rate per group, used as given "
              "for this step instead of lr x lr_scale (what a scheduler sets in torch's "
              "param_groups); clip_coef > 0: the clipping coefficient computed elsewhere, "
              "instead of max_grad_norm's. group_beta1, group_beta2, group_eps, "
              "group_weight_decay, group_momentum, group_dampening: None or one value per group "
              "for this step only (zs_step_options' arrays)"),
    KWM(grad_norm, "grad_norm(loss_scale=0) -> (norm, overflow): the current step's global "
                   "gradient norm (zs_grad_norm) without applying it; waits for every trainer's "
                   "contributions. The client stays at its step"),
    {"close_job", (PyCFunction)client_close_job, METH_NOARGS,
     "close the job on every shard (zs_close_job): the shards free it and take the next job "
     "without a restart. One trainer (rank 0) calls it after every other is done; this client "
     "cannot open a job again (close it)"},
    KWM(state_read,
        "state_read(tensor, array, buffer): array MASTER, EXP_AVG or EXP_AVG_SQ of the tensor, "
        "whole, fp32, into the writable buffer (no copy; GIL released; zs_state_read). A read "
        "while another trainer steps may fail with ESTEP: read between steps"),
    KWM(state_write,
        "state_write(tensor, array, buffer): overwrites the array on the shards from the buffer "
        "(zs_state_write). Between steps only (ENOTREADY once any trainer pushed for the "
        "current step): every trainer holds the job idle while one writes; idempotent"),
    {"optimizer_steps", (PyCFunction)client_optimizer_steps, METH_NOARGS,
     "the job's optimizer step count: applied steps, torch's state 'step' (zs_optimizer_steps)"},
    {"set_optimizer_steps", (PyCFunction)client_set_optimizer_steps, METH_O,
     "set_optimizer_steps(n): sets the count on every shard (zs_set_optimizer_steps; the rules "
     "of state_write)"},
    KWM(init_tensor,
        "init_tensor(tensor, buffer): the tensor's initial weights (fp32, whole) to the shards "
        "after open_job(deferred=True) (zs_init_tensor; GIL released). Returns once the shards "
        "hold them: the buffer may be freed then"),
    KWM(wait_initialized,
        "wait_initialized(timeout_ms=0): waits until every shard holds the job's initial "
        "weights (zs_wait_initialized; 0: no limit)"),
    {"tensor_steps", (PyCFunction)client_tensor_steps, METH_O,
     "tensor_steps(t) -> tensor t's own step count: the applied steps that gave it a gradient, "
     "torch's per-parameter state 'step' (zs_tensor_steps)"},
    {"set_tensor_steps", (PyCFunction)client_set_tensor_steps, METH_VARARGS,
     "set_tensor_steps(t, n): sets tensor t's step count on its shards (zs_set_tensor_steps; the "
     "rules of state_write)"},
    {"tensor_slices", (PyCFunction)client_tensor_slices, METH_O,
     "tensor_slices(t) -> [(shard, offset, numel)]: where tensor t lives (after open_job)"},
    KWM(checkpoint, "checkpoint(step=0) -> current step"),
    KWM(restore, "restore(step=0) -> the step the client continues at"),
    {"latest_checkpoint", (PyCFunction)client_latest_checkpoint, METH_NOARGS,
     "newest step every shard has a checkpoint of, or None"},
    {"last_checkpoint", (PyCFunction)client_last_checkpoint, METH_NOARGS,
     "step of this client's last committed checkpoint (raises if the last attempt failed)"},
    {"last_timing", (PyCFunction)client_last_timing, METH_NOARGS, "Timing of the last step"},
    {"wait_pushes", (PyCFunction)client_wait_pushes, METH_NOARGS, "zs_wait_pushes"},
    {"tensor_numel", (PyCFunction)client_tensor_numel, METH_O, "numel of tensor t"},
    {"find_tensor", (PyCFunction)client_find_tensor, METH_O, "id of the tensor called name"},
    {"close", (PyCFunction)client_close, METH_NOARGS, "close the client (idempotent)"},
    {"__enter__", (PyCFunction)client_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)client_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};
#undef KWM

static PyGetSetDef client_getset[] = {
    {"num_tensors", (getter)client_get_num_tensors, NULL, "tensors added so far", NULL},
    {"current_step", (getter)client_get_current_step, NULL, "the step the next step() completes",
     NULL},
    {"loss_scale", (getter)client_get_loss_scale, NULL, "loss scale for the current step", NULL},
    {"spec_hash", (getter)client_get_spec_hash, NULL, "the open job's spec hash", NULL},
    {"closed", (getter)client_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#ifdef Py_LIMITED_API
static PyType_Slot client_slots[] = {
    {Py_tp_doc, "Client(addresses, **options): one trainer's connection to a job's shards "
                "(zs_client_options fields as keywords)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, client_init},
    {Py_tp_dealloc, client_dealloc},
    {Py_tp_methods, client_methods},
    {Py_tp_getset, client_getset},
    {0, NULL},
};
static PyType_Spec client_spec = {"zshard._zshard.Client", sizeof(client_object), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, client_slots};
#else
static PyTypeObject client_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zshard._zshard.Client",
    .tp_basicsize = sizeof(client_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Client(addresses, **options): one trainer's connection to a job's shards "
              "(zs_client_options fields as keywords).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)client_init,
    .tp_dealloc = (destructor)client_dealloc,
    .tp_methods = client_methods,
    .tp_getset = client_getset,
};
#endif

static PyMethodDef request_methods[] = {
    {"wait", (PyCFunction)request_wait, METH_NOARGS,
     "wait for the transfer (GIL released), release the buffer; raises zshard.Error on failure"},
    {"test", (PyCFunction)request_test, METH_NOARGS, "True if the transfer has completed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef request_getset[] = {
    {"pending", (getter)request_get_pending, NULL, "not waited yet", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#ifdef Py_LIMITED_API
static PyType_Slot request_slots[] = {
    {Py_tp_doc, "A pending push or pull; holds its buffer until wait()."},
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_repr, request_repr},
    {Py_tp_methods, request_methods},
    {Py_tp_getset, request_getset},
    {0, NULL},
};
static PyType_Spec request_spec = {"zshard._zshard.Request", sizeof(request_object), 0,
                                   Py_TPFLAGS_DEFAULT, request_slots};
#else
static PyTypeObject request_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zshard._zshard.Request",
    .tp_basicsize = sizeof(request_object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pending push or pull; holds its buffer until wait().",
    .tp_dealloc = (destructor)request_dealloc,
    .tp_repr = (reprfunc)request_repr,
    .tp_methods = request_methods,
    .tp_getset = request_getset,
};
#endif

/* ---- module ----------------------------------------------------------------------- */

static PyObject *mod_version(PyObject *m, PyObject *Py_UNUSED(ignored)) {
  (void)m;
  return PyUnicode_FromString(zs_version());
}

static PyObject *mod_strerror(PyObject *m, PyObject *arg) {
  (void)m;
  long rc = PyLong_AsLong(arg);
  if (rc == -1 && PyErr_Occurred())
    return NULL;
  return PyUnicode_FromString(zs_strerror((int)rc));
}

static PyObject *mod_err_name(PyObject *m, PyObject *arg) {
  (void)m;
  long rc = PyLong_AsLong(arg);
  if (rc == -1 && PyErr_Occurred())
    return NULL;
  return PyUnicode_FromString(zs_err_name((int)rc));
}

static PyObject *mod_dtype_size(PyObject *m, PyObject *arg) {
  (void)m;
  long d = PyLong_AsLong(arg);
  if (d == -1 && PyErr_Occurred())
    return NULL;
  return PyLong_FromSize_t(zs_dtype_size((int)d));
}

static PyMethodDef module_methods[] = {
    {"version", mod_version, METH_NOARGS, "libzshard's version"},
    {"strerror", mod_strerror, METH_O, "sentence for a status"},
    {"err_name", mod_err_name, METH_O, "symbolic name of a status"},
    {"dtype_size", mod_dtype_size, METH_O, "bytes per element of a dtype"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "zshard._zshard",
    "libzshard's C API (see zshard/__init__.py).",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__zshard(void) {
#ifdef Py_LIMITED_API
  if (!(zs_timing_type = PyStructSequence_NewType(&timing_desc)) ||
      !(zs_step_result_type = PyStructSequence_NewType(&step_result_desc)) ||
      !(zs_client_type = (PyTypeObject *)PyType_FromSpec(&client_spec)) ||
      !(zs_request_type = (PyTypeObject *)PyType_FromSpec(&request_spec)))
    return NULL;
#else
  if (PyStructSequence_InitType2(&timing_type, &timing_desc) < 0 ||
      PyStructSequence_InitType2(&step_result_type, &step_result_desc) < 0 ||
      PyType_Ready(&client_type) < 0 || PyType_Ready(&request_type) < 0)
    return NULL;
#endif
  PyObject *m = PyModule_Create(&module_def);
  if (!m)
    return NULL;
  zs_error_type = PyErr_NewExceptionWithDoc(
      "zshard.Error", "A libzshard call failed: .status (negative int), .name ('ZS_EINVAL').", NULL,
      NULL);
  if (!zs_error_type || PyModule_AddObjectRef(m, "Error", zs_error_type) < 0 ||
      PyModule_AddObjectRef(m, "Client", (PyObject *)&client_type) < 0 ||
      PyModule_AddObjectRef(m, "Request", (PyObject *)&request_type) < 0 ||
      PyModule_AddObjectRef(m, "Timing", (PyObject *)&timing_type) < 0 ||
      PyModule_AddObjectRef(m, "StepResult", (PyObject *)&step_result_type) < 0)
    goto fail;
#define ZS__ADD_STATUS(name, value, grpc, msg)                                                     \
  if (PyModule_AddIntConstant(m, #name, value) < 0)                                                \
    goto fail;
  ZS_STATUS_MAP(ZS__ADD_STATUS)
#undef ZS__ADD_STATUS
  if (PyModule_AddIntConstant(m, "FP32", ZS_DTYPE_FP32) < 0 ||
      PyModule_AddIntConstant(m, "FP16", ZS_DTYPE_FP16) < 0 ||
      PyModule_AddIntConstant(m, "BF16", ZS_DTYPE_BF16) < 0 ||
      PyModule_AddIntConstant(m, "INT8_BLOCK", ZS_DTYPE_INT8_BLOCK) < 0 ||
      PyModule_AddIntConstant(m, "ADAMW", ZS_OPTIM_ADAMW) < 0 ||
      PyModule_AddIntConstant(m, "ADAM", ZS_OPTIM_ADAM) < 0 ||
      PyModule_AddIntConstant(m, "SGD", ZS_OPTIM_SGD) < 0 ||
      PyModule_AddIntConstant(m, "LION", ZS_OPTIM_LION) < 0 ||
      PyModule_AddIntConstant(m, "REDUCE_MEAN", ZS_REDUCE_MEAN) < 0 ||
      PyModule_AddIntConstant(m, "REDUCE_SUM", ZS_REDUCE_SUM) < 0 ||
      PyModule_AddIntConstant(m, "LOSS_SCALE_NONE", ZS_LOSS_SCALE_NONE) < 0 ||
      PyModule_AddIntConstant(m, "LOSS_SCALE_STATIC", ZS_LOSS_SCALE_STATIC) < 0 ||
      PyModule_AddIntConstant(m, "LOSS_SCALE_DYNAMIC", ZS_LOSS_SCALE_DYNAMIC) < 0 ||
      PyModule_AddIntConstant(m, "TRANSPORT_DEFAULT", ZS_TRANSPORT_DEFAULT) < 0 ||
      PyModule_AddIntConstant(m, "TRANSPORT_DATA", ZS_TRANSPORT_DATA) < 0 ||
      PyModule_AddIntConstant(m, "TRANSPORT_GRPC", ZS_TRANSPORT_GRPC) < 0 ||
      PyModule_AddIntConstant(m, "SCHEDULE_DEFAULT", ZS_SCHEDULE_DEFAULT) < 0 ||
      PyModule_AddIntConstant(m, "SCHEDULE_FIFO", ZS_SCHEDULE_FIFO) < 0 ||
      PyModule_AddIntConstant(m, "SCHEDULE_ROTATED", ZS_SCHEDULE_ROTATED) < 0 ||
      PyModule_AddIntConstant(m, "OPEN_EITHER", ZS_OPEN_EITHER) < 0 ||
      PyModule_AddIntConstant(m, "OPEN_CREATE", ZS_OPEN_CREATE) < 0 ||
      PyModule_AddIntConstant(m, "OPEN_RESUME", ZS_OPEN_RESUME) < 0 ||
      PyModule_AddIntConstant(m, "OPEN_JOIN", ZS_OPEN_JOIN) < 0 ||
      PyModule_AddIntConstant(m, "MASTER", ZS_STATE_MASTER) < 0 ||
      PyModule_AddIntConstant(m, "EXP_AVG", ZS_STATE_EXP_AVG) < 0 ||
      PyModule_AddIntConstant(m, "EXP_AVG_SQ", ZS_STATE_EXP_AVG_SQ) < 0)
    goto fail;
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
