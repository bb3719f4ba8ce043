/*
 * The optimizer's state: a tensor's arrays read and written whole, the
 * job's step count and each tensor's own.
 */
#include "internal.h"

#include <string.h>

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
  zs_client *c = zspy__client_get(self);
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
    return zspy__raise_status(rc);
  Py_RETURN_NONE;
}

PyObject *zspy__client_state_read(client_object *self, PyObject *args, PyObject *kw) {
  return state_call(self, args, kw, 0);
}

PyObject *zspy__client_state_write(client_object *self, PyObject *args, PyObject *kw) {
  return state_call(self, args, kw, 1);
}

PyObject *zspy__client_optimizer_steps(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  uint64_t steps = 0;
  int rc;
  GIL_RELEASE();
  rc = zs_optimizer_steps(c, &steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLongLong(steps);
}

PyObject *zspy__client_set_optimizer_steps(client_object *self, PyObject *arg) {
  zs_client *c = zspy__client_get(self);
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
    return zspy__raise_status(rc);
  Py_RETURN_NONE;
}

/* ---- per-tensor step counts (zs_tensor_steps, zs_set_tensor_steps) ---- */

PyObject *zspy__client_tensor_steps(client_object *self, PyObject *arg) {
  zs_client *c = zspy__client_get(self);
  uint32_t t;
  if (!c || zspy__tensor_id_of(arg, "tensor_steps", &t) != 0)
    return NULL;
  uint64_t steps = 0;
  int rc;
  GIL_RELEASE();
  rc = zs_tensor_steps(c, t, &steps);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLongLong(steps);
}

PyObject *zspy__client_set_tensor_steps(client_object *self, PyObject *args) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  PyObject *id, *count;
  uint32_t t;
  if (!PyArg_ParseTuple(args, "OO:set_tensor_steps", &id, &count) ||
      zspy__tensor_id_of(id, "set_tensor_steps", &t) != 0)
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
    return zspy__raise_status(rc);
  Py_RETURN_NONE;
}
