/*
 * The job: describing it (groups, tensors), opening it with or without its
 * initial weights, the deferred initialisation, closing it, and where its
 * tensors are.
 */
#include "internal.h"

PyObject *zspy__client_add_group(client_object *self, PyObject *args, PyObject *kw) {
  static const char *const skip[] = {"optimizer", NULL};
  zs_client *c = zspy__client_get(self);
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
  if (zspy__apply_kwargs(&g, zspy__group_fields, kw, skip, "add_group") < 0)
    return NULL;
  uint32_t id = 0;
  int rc = zs_add_group(c, &g, &id);
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  if (id >= self->ngroups)
    self->ngroups = id + 1;
  return PyLong_FromUnsignedLong(id);
}

PyObject *zspy__client_add_tensor(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "numel", "group", "shape", NULL};
  const char *name;
  unsigned long long numel;
  unsigned int group = 0;
  PyObject *shape = Py_None;
  zs_client *c = zspy__client_get(self);
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
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLong(id);
}

PyObject *zspy__client_open_job(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"init_weights", "deferred", NULL};
  PyObject *init = Py_None;
  int deferred = 0;
  zs_client *c = zspy__client_get(self);
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
    zspy__raise_status(rc);
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

PyObject *zspy__client_close_job(client_object *self, PyObject *Py_UNUSED(ignored)) {
  return zspy__call_blocking(self, zs_close_job);
}

/* ---- deferred initialisation -------------------------------------------------- */

PyObject *zspy__client_init_tensor(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tensor", "buffer", NULL};
  unsigned int t = 0;
  Py_buffer view;
  zs_client *c = zspy__client_get(self);
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
      zspy__raise_status(rc);
    else {
      Py_INCREF(Py_None);
      ret = Py_None;
    }
  }
  PyBuffer_Release(&view);
  return ret;
}

PyObject *zspy__client_wait_initialized(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"timeout_ms", NULL};
  unsigned long long timeout_ms = 0;
  zs_client *c = zspy__client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "|K:wait_initialized", kwlist, &timeout_ms))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_wait_initialized(c, (uint64_t)timeout_ms);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  Py_RETURN_NONE;
}

/* ---- tensors ---------------------------------------------------------------- */

PyObject *zspy__client_tensor_numel(client_object *self, PyObject *arg) {
  zs_client *c = zspy__client_get(self);
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

PyObject *zspy__client_find_tensor(client_object *self, PyObject *arg) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name)
    return NULL;
  uint32_t id;
  int rc = zs_find_tensor(c, name, &id);
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return PyLong_FromUnsignedLong(id);
}

PyObject *zspy__client_tensor_slices(client_object *self, PyObject *arg) {
  zs_client *c = zspy__client_get(self);
  uint32_t t;
  if (!c || zspy__tensor_id_of(arg, "tensor_slices", &t) != 0)
    return NULL;
  uint32_t n = 0;
  int rc = zs_tensor_slices(c, t, &n);
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  PyObject *list = PyList_New(n);
  if (!list)
    return NULL;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t shard = 0;
    uint64_t off = 0, numel = 0;
    if ((rc = zs_tensor_slice(c, t, i, &shard, &off, &numel)) != ZS_OK) {
      Py_DECREF(list);
      return zspy__raise_status(rc);
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
