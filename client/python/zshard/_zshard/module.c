/*
 * zshard._zshard: the C API of libzshard as a CPython extension module.
 *
 * Everything in it goes through <zshard/zshard.h>: option structs are filled by
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
 *
 * This file is the module itself: PyInit__zshard, the module's functions and
 * its constants. The types and the Client's calls live in the files beside it,
 * one job each, which internal.h lists.
 */
#include "internal.h"

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
  if (!(zspy__timing_type_p = PyStructSequence_NewType(&zspy__timing_desc)) ||
      !(zspy__step_result_type_p = PyStructSequence_NewType(&zspy__step_result_desc)) ||
      !(zspy__client_type_p = (PyTypeObject *)PyType_FromSpec(&zspy__client_spec)) ||
      !(zspy__request_type_p = (PyTypeObject *)PyType_FromSpec(&zspy__request_spec)))
    return NULL;
#else
  if (PyStructSequence_InitType2(&zspy__timing_type, &zspy__timing_desc) < 0 ||
      PyStructSequence_InitType2(&zspy__step_result_type, &zspy__step_result_desc) < 0 ||
      PyType_Ready(&zspy__client_type) < 0 || PyType_Ready(&zspy__request_type) < 0)
    return NULL;
#endif
  PyObject *m = PyModule_Create(&module_def);
  if (!m)
    return NULL;
  if (zspy__error_add(m) < 0 ||
      PyModule_AddObjectRef(m, "Client", (PyObject *)&zspy__client_type) < 0 ||
      PyModule_AddObjectRef(m, "Request", (PyObject *)&zspy__request_type) < 0 ||
      PyModule_AddObjectRef(m, "Timing", (PyObject *)&zspy__timing_type) < 0 ||
      PyModule_AddObjectRef(m, "StepResult", (PyObject *)&zspy__step_result_type) < 0)
    goto fail;
  if (zspy__status_add(m) < 0)
    goto fail;
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
