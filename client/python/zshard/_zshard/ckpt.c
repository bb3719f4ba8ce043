/*
 * Checkpoints: taking one, restoring one, and the steps the shards and this
 * client have checkpoints of.
 */
#include "internal.h"

/* The blocking calls that take an optional step and return nothing. */
static PyObject *blocking_step_call(client_object *self, PyObject *args, PyObject *kw,
                                    int (*fn)(zs_client *, uint64_t), const char *fmt) {
  static char *kwlist[] = {"step", NULL};
  unsigned long long step = 0;
  zs_client *c = zspy__client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &step))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = fn(c, step);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLongLong(zs_current_step(c));
}

PyObject *zspy__client_checkpoint(client_object *self, PyObject *args, PyObject *kw) {
  return blocking_step_call(self, args, kw, zs_checkpoint, "|K:checkpoint");
}

PyObject *zspy__client_restore(client_object *self, PyObject *args, PyObject *kw) {
  return blocking_step_call(self, args, kw, zs_restore, "|K:restore");
}

PyObject *zspy__client_latest_checkpoint(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = zspy__client_get(self);
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
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLongLong(step);
}

PyObject *zspy__client_last_checkpoint(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  uint64_t step = 0;
  int rc = zs_last_checkpoint(c, &step);
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLongLong(step);
}
