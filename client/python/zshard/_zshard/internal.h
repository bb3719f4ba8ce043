/*
 * The private header of zshard._zshard, the extension module: the object
 * structs of its types, the keyword-option tables, and the functions its
 * files share, prefixed zspy__; everything else in those files is static.
 * Every file of the extension includes this header before anything else: it
 * includes Python.h, which must precede the system headers, and, in the abi3
 * build (Py_LIMITED_API), limited.h. Buffers, threads and the GIL: module.c's
 * top comment.
 *
 * The files, one job each: module.c the module (PyInit__zshard, its
 * functions and constants); status.c zshard.Error and the status codes;
 * args.c keyword options onto the header's option structs, and tensor ids;
 * results.c zshard.Timing and zshard.StepResult; client.c the Client type
 * (open, close, attributes, its method table); job.c describing, opening,
 * initialising and closing the job, and tensor lookups; request.c the
 * Request type; transfer.c push, pull, push_many, pull_many; step.c step,
 * grad_norm and the step's timing; ckpt.c checkpoints; state.c the
 * optimizer's state and step counts.
 */
#ifndef ZSHARD_PY_INTERNAL_H
#define ZSHARD_PY_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include <zshard/zshard.h>

#ifdef Py_LIMITED_API
#include "limited.h" /* the abi3 build (tests/gpu/bundle) */
#endif

/* Py_BEGIN/END_ALLOW_THREADS as statements (one pair per function). */
#define GIL_RELEASE() PyThreadState *gil_state_ = PyEval_SaveThread()
#define GIL_ACQUIRE() PyEval_RestoreThread(gil_state_)

/* ---- the types (client.c, request.c, results.c) ---------------------------- */

/* A zshard._zshard.Client (client.c): owns its zs_client, which it closes
 * when closed or freed. */
typedef struct client_object {
  PyObject_HEAD zs_client *c; /* NULL once closed */
  uint32_t ngroups;           /* groups added so far: step's per-group arrays hold as many */
} client_object;

/* A zshard._zshard.Request (request.c): one push or pull until waited. */
typedef struct request_object {
  PyObject_HEAD client_object *client; /* keeps the client open while pending */
  zs_request *req;                     /* NULL once waited */
  Py_buffer view;                      /* held until waited */
  int waiting;                         /* a thread is in zs_wait */
  int status;                          /* after the wait */
  int push;
  uint32_t tensor;
} request_object;

/* The module's four types, readied by PyInit__zshard. In the abi3 build each
 * name stands for the type object that PyInit__zshard makes at import from
 * the spec or the description below (limited.h); the module holds a
 * reference to each from then on. */
extern PyTypeObject zspy__client_type, zspy__request_type, zspy__timing_type,
    zspy__step_result_type;
extern PyStructSequence_Desc zspy__timing_desc, zspy__step_result_desc;
#ifdef Py_LIMITED_API
extern PyType_Spec zspy__client_spec, zspy__request_spec;
#endif

/* Frees an instance of one of this module's types (tp_free). A type of the
 * abi3 build is a heap type, which each of its instances holds a reference to. */
static inline void zspy__free_instance(PyObject *o) {
#ifdef Py_LIMITED_API
  PyTypeObject *t = Py_TYPE(o);
  ((freefunc)PyType_GetSlot(t, Py_tp_free))(o);
  Py_DECREF(t);
#else
  Py_TYPE(o)->tp_free(o);
#endif
}

/* New references to a zshard.Timing / zshard.StepResult built from the
 * library's structs (read, not kept), or NULL with an exception set. */
PyObject *zspy__timing_new(const zs_timing *t);
PyObject *zspy__step_result_new(const zs_step_result *r, const zs_timing *t);

/* ---- errors (status.c) ------------------------------------------------------ */

/* zshard.Error, created and owned by the module (zspy__error_add). */
extern PyObject *zspy__error_type;

/* Raises zshard.Error(zs_last_error()) with .status and .name, and returns
 * NULL. Must be called on the thread that made the failing call, before
 * anything else calls into libzshard on it. */
PyObject *zspy__raise_status(int rc);

/* Creates zshard.Error and adds it to `m` (borrowed) / adds the status codes to
 * `m` as ints: 0, or -1 with an exception set. */
int zspy__error_add(PyObject *m);
int zspy__status_add(PyObject *m);

/* ---- arguments (args.c) -------------------------------------------------------- */

/* KW_STR stores the str's UTF-8 buffer, which lives as long as the str:
 * only for options read while the keyword dict is held (zs_client_open). */
typedef enum { KW_U32, KW_U64, KW_SIZE, KW_DOUBLE, KW_INT, KW_ENUM, KW_STR } kw_kind;

typedef struct kw_field {
  const char *name;
  kw_kind kind;
  size_t off;
} kw_field;

/* The keywords of Client() (zs_client_options), of its dynamic loss scaler
 * (zs_loss_scaler, which zs_client_options points to) and of add_group()
 * (zs_group_options). Each ends with an entry whose name is NULL. */
extern const kw_field zspy__client_fields[], zspy__scaler_fields[], zspy__group_fields[];

/* Applies every keyword of `kw` (may be NULL) except those in `skip` to the
 * struct at `base`; an unknown keyword is a TypeError naming it. */
int zspy__apply_kwargs(void *base, const kw_field *fields, PyObject *kw, const char *const *skip,
                       const char *what);

/* Applies the keywords of `kw` that `fields` names (others are left alone);
 * returns the number applied or -1. */
int zspy__apply_known_kwargs(void *base, const kw_field *fields, PyObject *kw);

/* A tensor id from Python: a non-negative int below 2^32 (OverflowError
 * naming fn otherwise; whether the job has that tensor is libzshard's to
 * say). 0 or -1 with the exception set. */
int zspy__tensor_id_of(PyObject *o, const char *fn, uint32_t *out);

/* ---- the Client's methods (client.c and the files of its calls) ---------------- */

/* The client's zs_client, or NULL with zshard.Error set once it is closed.
 * Inline: every call of the Client starts with it, submissions included. */
static inline zs_client *zspy__client_get(client_object *self) {
  if (!self->c)
    PyErr_SetString(zspy__error_type, "the client is closed");
  return self->c;
}

/* A blocking call that takes only the client: the GIL released around it,
 * None or the raised zshard.Error. */
PyObject *zspy__call_blocking(client_object *self, int (*fn)(zs_client *));

/* The methods client.c's method table names from the other files; each
 * borrows self and its arguments and returns a new reference, or NULL with
 * an exception set. */
/* job.c */
PyObject *zspy__client_add_group(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_add_tensor(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_open_job(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_close_job(client_object *self, PyObject *arg);
PyObject *zspy__client_init_tensor(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_wait_initialized(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_tensor_numel(client_object *self, PyObject *arg);
PyObject *zspy__client_find_tensor(client_object *self, PyObject *arg);
PyObject *zspy__client_tensor_slices(client_object *self, PyObject *arg);
/* transfer.c */
PyObject *zspy__client_push(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_pull(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_push_many(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_pull_many(client_object *self, PyObject *args, PyObject *kw);
/* step.c */
PyObject *zspy__client_step(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_grad_norm(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_last_timing(client_object *self, PyObject *arg);
PyObject *zspy__client_wait_pushes(client_object *self, PyObject *arg);
/* ckpt.c */
PyObject *zspy__client_checkpoint(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_restore(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_latest_checkpoint(client_object *self, PyObject *arg);
PyObject *zspy__client_last_checkpoint(client_object *self, PyObject *arg);
/* state.c */
PyObject *zspy__client_state_read(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_state_write(client_object *self, PyObject *args, PyObject *kw);
PyObject *zspy__client_optimizer_steps(client_object *self, PyObject *arg);
PyObject *zspy__client_set_optimizer_steps(client_object *self, PyObject *arg);
PyObject *zspy__client_tensor_steps(client_object *self, PyObject *arg);
PyObject *zspy__client_set_tensor_steps(client_object *self, PyObject *arg);

#endif
