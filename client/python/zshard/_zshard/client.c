/*
 * The Client type: one trainer's connection to a job's shards. Opening and
 * closing it, its attributes, and its method table, which names the calls
 * that the other files hold (internal.h lists them by file).
 */
#include "internal.h"

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
  if (zspy__apply_kwargs(&o, zspy__client_fields, kw, skip, "Client") < 0)
    return -1;
  zs_loss_scaler sc;
  zs_loss_scaler_init(&sc);
  int nsc = zspy__apply_known_kwargs(&sc, zspy__scaler_fields, kw);
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
    zspy__raise_status(rc);
    return -1;
  }
  self->c = c;
  return 0;
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
  zspy__free_instance((PyObject *)self);
}

static PyObject *client_close(client_object *self, PyObject *Py_UNUSED(ignored)) {
  client_close_now(self);
  Py_RETURN_NONE;
}

PyObject *zspy__call_blocking(client_object *self, int (*fn)(zs_client *)) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = fn(c);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  Py_RETURN_NONE;
}

static PyObject *client_get_num_tensors(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = zspy__client_get(self);
  return c ? PyLong_FromUnsignedLong(zs_num_tensors(c)) : NULL;
}

static PyObject *client_get_current_step(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = zspy__client_get(self);
  return c ? PyLong_FromUnsignedLongLong(zs_current_step(c)) : NULL;
}

static PyObject *client_get_loss_scale(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = zspy__client_get(self);
  return c ? PyFloat_FromDouble(zs_loss_scale(c)) : NULL;
}

static PyObject *client_get_spec_hash(client_object *self, void *Py_UNUSED(closure)) {
  zs_client *c = zspy__client_get(self);
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
  { #name, (PyCFunction)(void (*)(void))zspy__client_##name, METH_VARARGS | METH_KEYWORDS, doc }
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
    {"close_job", (PyCFunction)zspy__client_close_job, METH_NOARGS,
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
    {"optimizer_steps", (PyCFunction)zspy__client_optimizer_steps, METH_NOARGS,
     "the job's optimizer step count: applied steps, torch's state 'step' (zs_optimizer_steps)"},
    {"set_optimizer_steps", (PyCFunction)zspy__client_set_optimizer_steps, METH_O,
     "set_optimizer_steps(n): sets the count on every shard (zs_set_optimizer_steps; the rules "
     "of state_write)"},
    KWM(init_tensor,
        "init_tensor(tensor, buffer): the tensor's initial weights (fp32, whole) to the shards "
        "after open_job(deferred=True) (zs_init_tensor; GIL released). Returns once the shards "
        "hold them: the buffer may be freed then"),
    KWM(wait_initialized,
        "wait_initialized(timeout_ms=0): waits until every shard holds the job's initial "
        "weights (zs_wait_initialized; 0: no limit)"),
    {"tensor_steps", (PyCFunction)zspy__client_tensor_steps, METH_O,
     "tensor_steps(t) -> tensor t's own step count: the applied steps that gave it a gradient, "
     "torch's per-parameter state 'step' (zs_tensor_steps)"},
    {"set_tensor_steps", (PyCFunction)zspy__client_set_tensor_steps, METH_VARARGS,
     "set_tensor_steps(t, n): sets tensor t's step count on its shards (zs_set_tensor_steps; the "
     "rules of state_write)"},
    {"tensor_slices", (PyCFunction)zspy__client_tensor_slices, METH_O,
     "tensor_slices(t) -> [(shard, offset, numel)]: where tensor t lives (after open_job)"},
    KWM(checkpoint, "checkpoint(step=0) -> current step"),
    KWM(restore, "restore(step=0) -> the step the client continues at"),
    {"latest_checkpoint", (PyCFunction)zspy__client_latest_checkpoint, METH_NOARGS,
     "newest step every shard has a checkpoint of, or None"},
    {"last_checkpoint", (PyCFunction)zspy__client_last_checkpoint, METH_NOARGS,
     "step of this client's last committed checkpoint (raises if the last attempt failed)"},
    {"last_timing", (PyCFunction)zspy__client_last_timing, METH_NOARGS, "Timing of the last step"},
    {"wait_pushes", (PyCFunction)zspy__client_wait_pushes, METH_NOARGS, "zs_wait_pushes"},
    {"tensor_numel", (PyCFunction)zspy__client_tensor_numel, METH_O, "numel of tensor t"},
    {"find_tensor", (PyCFunction)zspy__client_find_tensor, METH_O, "id of the tensor called name"},
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
PyTypeObject *zspy__client_type_p;

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
PyType_Spec zspy__client_spec = {"zshard._zshard.Client", sizeof(client_object), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, client_slots};
#else
PyTypeObject zspy__client_type = {
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
