/*
 * zshard.Error and the status codes: a libzshard status raised as the
 * exception, and the codes as the module's ints (ZS_STATUS_MAP).
 */
#include "internal.h"

PyObject *zspy__error_type; /* zshard.Error */

PyObject *zspy__raise_status(int rc) {
  const char *msg = zs_last_error();
  if (!msg || !*msg)
    msg = zs_strerror(rc);
  PyObject *exc = PyObject_CallFunction(zspy__error_type, "s", msg);
  if (!exc)
    return NULL;
  PyObject *status = PyLong_FromLong(rc);
  PyObject *name = PyUnicode_FromString(zs_err_name(rc));
  if (status && name && PyObject_SetAttrString(exc, "status", status) == 0 &&
      PyObject_SetAttrString(exc, "name", name) == 0)
    PyErr_SetObject(zspy__error_type, exc);
  Py_XDECREF(status);
  Py_XDECREF(name);
  Py_DECREF(exc);
  return NULL;
}

int zspy__error_add(PyObject *m) {
  zspy__error_type = PyErr_NewExceptionWithDoc(
      "zshard.Error", "A libzshard call failed: .status (negative int), .name ('ZS_EINVAL').", NULL,
      NULL);
  if (!zspy__error_type || PyModule_AddObjectRef(m, "Error", zspy__error_type) < 0)
    return -1;
  return 0;
}

int zspy__status_add(PyObject *m) {
#define ZS__ADD_STATUS(name, value, grpc, msg)                                                     \
  if (PyModule_AddIntConstant(m, #name, value) < 0)                                                \
    return -1;
  ZS_STATUS_MAP(ZS__ADD_STATUS)
#undef ZS__ADD_STATUS
  return 0;
}
