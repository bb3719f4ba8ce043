/*
 * The Request type: a pending push or pull, which holds its Py_buffer (and
 * with it the exporting object) and a reference to its client until it is
 * waited, so the memory libzshard reads or writes stays valid for the whole
 * transfer.
 */
#include "internal.h"

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
    return zspy__raise_status(rc);
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
  zspy__free_instance((PyObject *)self);
}

static PyObject *request_repr(request_object *self) {
  return PyUnicode_FromFormat("<zshard.Request %s tensor %u %s>", self->push ? "push" : "pull",
                              (unsigned)self->tensor,
                              self->req ? "pending" : (self->status ? "failed" : "done"));
}

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
PyTypeObject *zspy__request_type_p;

static PyType_Slot request_slots[] = {
    {Py_tp_doc, "A pending push or pull; holds its buffer until wait()."},
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_repr, request_repr},
    {Py_tp_methods, request_methods},
    {Py_tp_getset, request_getset},
    {0, NULL},
};
PyType_Spec zspy__request_spec = {"zshard._zshard.Request", sizeof(request_object), 0,
                                  Py_TPFLAGS_DEFAULT, request_slots};
#else
PyTypeObject zspy__request_type = {
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
