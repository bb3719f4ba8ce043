/*
 * push, pull, push_many and pull_many: a caller's buffers submitted as
 * transfers without a copy, each returned as a Request that holds its buffer
 * until waited (request.c).
 */
#include "internal.h"

#include <limits.h>
#include <string.h>

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
  request_object *r = PyObject_New(request_object, &zspy__request_type);
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
  zs_client *c = zspy__client_get(self);
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
    zspy__raise_status(rc);
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

PyObject *zspy__client_push(client_object *self, PyObject *args, PyObject *kw) {
  return transfer(self, args, kw, 1);
}

PyObject *zspy__client_pull(client_object *self, PyObject *args, PyObject *kw) {
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
  zs_client *c = zspy__client_get(self);
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
    zspy__raise_status(rc);
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

PyObject *zspy__client_push_many(client_object *self, PyObject *args, PyObject *kw) {
  return transfer_many(self, args, kw, 1);
}

PyObject *zspy__client_pull_many(client_object *self, PyObject *args, PyObject *kw) {
  return transfer_many(self, args, kw, 0);
}
