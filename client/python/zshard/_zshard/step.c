/*
 * step() and what goes with it: the per-group hyper-parameters, grad_norm,
 * the last step's timing, and waiting for the step's pushes.
 */
#include "internal.h"

#include <string.h>

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

PyObject *zspy__client_step(client_object *self, PyObject *args, PyObject *kw) {
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
  zs_client *c = zspy__client_get(self);
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
    zspy__raise_status(rc);
    goto out;
  }
  /* The step's timing is the client's last (zs_step_result does not carry
   * it): read right after the step, on the thread that stepped. */
  rc = zs_last_timing(c, &t);
  if (rc != ZS_OK) {
    zspy__raise_status(rc);
    goto out;
  }
  ret = zspy__step_result_new(&r, &t);
out:
  PyMem_Free(lrs);
  PyMem_Free(hp_vals);
  return ret;
}

PyObject *zspy__client_grad_norm(client_object *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"loss_scale", NULL};
  double loss_scale = 0, norm = 0;
  int overflow = 0;
  zs_client *c = zspy__client_get(self);
  if (!c || !PyArg_ParseTupleAndKeywords(args, kw, "|d:grad_norm", kwlist, &loss_scale))
    return NULL;
  int rc;
  GIL_RELEASE();
  rc = zs_grad_norm(c, loss_scale, &norm, &overflow);
  GIL_ACQUIRE();
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return Py_BuildValue("(dO)", norm, overflow ? Py_True : Py_False);
}

PyObject *zspy__client_last_timing(client_object *self, PyObject *Py_UNUSED(ignored)) {
  zs_client *c = zspy__client_get(self);
  if (!c)
    return NULL;
  zs_timing t;
  memset(&t, 0, sizeof t);
  int rc = zs_last_timing(c, &t);
  if (rc != ZS_OK)
    return zspy__raise_status(rc);
  return zspy__timing_new(&t);
}

PyObject *zspy__client_wait_pushes(client_object *self, PyObject *Py_UNUSED(ignored)) {
  return zspy__call_blocking(self, zs_wait_pushes);
}
