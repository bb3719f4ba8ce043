/*
 * zshard.Timing and zshard.StepResult: the struct sequences a step returns
 * (zs_timing, zs_step_result).
 */
#include "internal.h"

#ifdef Py_LIMITED_API
PyTypeObject *zspy__timing_type_p, *zspy__step_result_type_p;
#else
PyTypeObject zspy__timing_type, zspy__step_result_type;
#endif

static PyStructSequence_Field timing_fields[] = {
    {"total_ms", "wall time of the step"},
    {"compute_ms", "the trainer's own work between calls"},
    {"push_ms", "time in pushes and waiting for them"},
    {"pull_wait_ms", "time waiting for pulls"},
    {"step_ms", "zs_step's statistics and apply"},
    {"bytes_pushed", "wire bytes of gradients sent"},
    {"bytes_pulled", "wire bytes of parameters received"},
    {"retries", "calls retried"},
    {NULL, NULL},
};
PyStructSequence_Desc zspy__timing_desc = {
    "zshard.Timing", "Where one step's time went (zs_timing).", timing_fields, 8};

static PyStructSequence_Field step_result_fields[] = {
    {"step", "the step this call completed"},
    {"version", "parameter version after it"},
    {"applied", "the optimizer ran"},
    {"overflow", "an inf/NaN was in the gradient"},
    {"grad_norm", "global gradient norm before clipping"},
    {"clip_coef", "min(1, max_norm / (norm + 1e-6)), or 1"},
    {"coef", "sent to the shards: clip_coef / loss_scale"},
    {"loss_scale", "used for this step"},
    {"next_loss_scale", "to use for the next step"},
    {"timing", "a zshard.Timing"},
    /* By name only (the tuple keeps its 10 items): the step's membership. */
    {"num_members", "ranks that contributed to the step (docs/CLIENT.md, elastic trainers)"},
    {"member_rank", "this rank's place among them, from 0"},
    {NULL, NULL},
};
PyStructSequence_Desc zspy__step_result_desc = {
    "zshard.StepResult", "What zs_step did (zs_step_result).", step_result_fields, 10};
#define STEP_RESULT_FIELDS 12

PyObject *zspy__timing_new(const zs_timing *t) {
  PyObject *o = PyStructSequence_New(&zspy__timing_type);
  if (!o)
    return NULL;
  PyStructSequence_SET_ITEM(o, 0, PyFloat_FromDouble(t->total_ms));
  PyStructSequence_SET_ITEM(o, 1, PyFloat_FromDouble(t->compute_ms));
  PyStructSequence_SET_ITEM(o, 2, PyFloat_FromDouble(t->push_ms));
  PyStructSequence_SET_ITEM(o, 3, PyFloat_FromDouble(t->pull_wait_ms));
  PyStructSequence_SET_ITEM(o, 4, PyFloat_FromDouble(t->step_ms));
  PyStructSequence_SET_ITEM(o, 5, PyLong_FromUnsignedLongLong(t->bytes_pushed));
  PyStructSequence_SET_ITEM(o, 6, PyLong_FromUnsignedLongLong(t->bytes_pulled));
  PyStructSequence_SET_ITEM(o, 7, PyLong_FromUnsignedLong(t->retries));
  for (Py_ssize_t i = 0; i < 8; i++)
    if (!PyStructSequence_GET_ITEM(o, i)) {
      Py_DECREF(o);
      return NULL;
    }
  return o;
}

PyObject *zspy__step_result_new(const zs_step_result *r, const zs_timing *t) {
  PyObject *o = PyStructSequence_New(&zspy__step_result_type);
  if (!o)
    return NULL;
  PyStructSequence_SET_ITEM(o, 0, PyLong_FromUnsignedLongLong(r->step));
  PyStructSequence_SET_ITEM(o, 1, PyLong_FromUnsignedLongLong(r->version));
  PyStructSequence_SET_ITEM(o, 2, PyBool_FromLong(r->applied));
  PyStructSequence_SET_ITEM(o, 3, PyBool_FromLong(r->overflow));
  PyStructSequence_SET_ITEM(o, 4, PyFloat_FromDouble(r->grad_norm));
  PyStructSequence_SET_ITEM(o, 5, PyFloat_FromDouble(r->clip_coef));
  PyStructSequence_SET_ITEM(o, 6, PyFloat_FromDouble(r->coef));
  PyStructSequence_SET_ITEM(o, 7, PyFloat_FromDouble(r->loss_scale));
  PyStructSequence_SET_ITEM(o, 8, PyFloat_FromDouble(r->next_loss_scale));
  PyStructSequence_SET_ITEM(o, 9, zspy__timing_new(t));
  PyStructSequence_SET_ITEM(o, 10, PyLong_FromUnsignedLong(r->num_members));
  PyStructSequence_SET_ITEM(o, 11, PyLong_FromUnsignedLong(r->member_rank));
  for (Py_ssize_t i = 0; i < STEP_RESULT_FIELDS; i++)
    if (!PyStructSequence_GET_ITEM(o, i)) {
      Py_DECREF(o);
      return NULL;
    }
  return o;
}
