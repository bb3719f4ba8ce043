/*
 * service — request checks and the observer between the transports and the
 * core (see service.h).
 *
 * Threads: none of its own. Every function runs on its caller's thread;
 * on_applied runs on the core's worker thread (core_set_applied_hook). The
 * service's fields are written once by service_create, before any transport
 * can call in, and only read afterwards, so it needs no lock.
 */
#include "server/service.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

struct service {
  core *core;
  service_observer obs;
  int hooked; /* this service installed the core's applied hook */
};

static void on_applied(void *arg, const core_apply_result *r) {
  service *s = arg;
  s->obs.applied(s->obs.arg, r);
}

int service_create(core *c, const service_observer *obs, service **out) {
  if (!c || !out)
    return ZS_EINVAL;
  service *s = calloc(1, sizeof *s);
  if (!s)
    return ZS_ENOMEM;
  s->core = c;
  if (obs)
    s->obs = *obs;
  if (s->obs.applied) {
    core_set_applied_hook(c, on_applied, s);
    s->hooked = 1;
  }
  *out = s;
  return 0;
}

void service_destroy(service *s) {
  if (!s)
    return;
  if (s->hooked)
    core_set_applied_hook(s->core, NULL, NULL);
  free(s);
}

core *service_core(const service *s) {
  return s->core;
}

/* ------------------------------------------------------------ job requests */

int service_open(service *s, const spec *sp, uint32_t rank, core_open_result *out, char *err,
                 size_t errlen) {
  return service_open_mode(s, sp, rank, CORE_OPEN_EITHER, out, err, errlen);
}

int service_open_mode(service *s, const spec *sp, uint32_t rank, int mode, core_open_result *out,
                      char *err, size_t errlen) {
  if (mode != CORE_OPEN_EITHER && mode != CORE_OPEN_CREATE && mode != CORE_OPEN_RESUME)
    return status_fail(err, errlen, ZS_EINVAL,
                       "open mode %d is none of either (0), create (1) and resume (2)", mode);
  if (!sp)
    return status_fail(err, errlen, ZS_EINVAL, "no spec given");
  /* The spec says how many trainers there are; a rank beyond them would push
   * contributions the core refuses one by one later, so it is refused now. */
  if (rank >= sp->world_size)
    return status_fail(err, errlen, ZS_EINVAL,
                       "rank %" PRIu32 " is not below the world size %" PRIu32, rank,
                       sp->world_size);
  return core_open_ex(s->core, sp, mode, out, err, errlen);
}

int service_close(service *s, uint64_t hash, const char *job, core_close_result *out, char *err,
                  size_t errlen) {
  if (job && strlen(job) > SPEC_MAX_NAME)
    return status_fail(err, errlen, ZS_EINVAL,
                       "CloseJob names a job of %zu bytes; job names have at most %u", strlen(job),
                       SPEC_MAX_NAME);
  return core_close(s->core, hash, job, out, err, errlen);
}

int service_init_params(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                        const void *data, size_t nbytes, int *written, uint64_t *version, char *err,
                        size_t errlen) {
  if (nbytes % sizeof(float) != 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "InitParams data of %zu bytes is not a whole number of float32", nbytes);
  return core_init_params_range(s->core, hash, tensor, slice, offset, (const float *)data, nbytes,
                                written, version, err, errlen);
}

int service_push(service *s, const core_push_args *a, int *duplicate, char *err, size_t errlen) {
  int dup = 0;
  int rc = core_push(s->core, a, &dup, err, errlen);
  if (duplicate)
    *duplicate = dup;
  if (rc == 0 && !dup && s->obs.contribution)
    s->obs.contribution(s->obs.arg, a);
  return rc;
}

int service_push_check(service *s, const core_push_args *a, char *err, size_t errlen) {
  int64_t nb = core_piece_bytes(s->core, a->hash, a->tensor, a->slice, a->dtype);
  if (nb >= 0 && (uint64_t)nb == (uint64_t)a->nbytes)
    return 0;
  /* The core refuses this push whatever the payload holds, and its verdict is
   * the answer: core_push checks in its order (job, step, ranges, piece,
   * dtype, size) and fails before it would look at the missing data. */
  core_push_args q = *a;
  q.data = NULL;
  int rc = core_push(s->core, &q, NULL, err, errlen);
  return rc ? rc : status_fail(err, errlen, ZS_EINTERNAL, "the core took a push with no payload");
}

int64_t service_piece_bytes(service *s, uint64_t hash, uint32_t tensor, uint32_t slice,
                            zs_dtype dtype, char *err, size_t errlen) {
  return core_piece_bytes_err(s->core, hash, tensor, slice, dtype, err, errlen);
}

int64_t service_batch_piece_bytes(service *s, uint64_t hash, uint32_t index, uint32_t tensor,
                                  uint32_t slice, zs_dtype dtype, uint64_t length, char *err,
                                  size_t errlen) {
  char why[256] = "";
  int64_t nb = core_piece_bytes_err(s->core, hash, tensor, slice, dtype, why, sizeof why);
  if (nb < 0)
    return status_fail(err, errlen, (int)nb, "piece %" PRIu32 " of the batch: %s", index,
                       why[0] ? why : zs_strerror((int)nb));
  if ((uint64_t)nb != length)
    return status_fail(err, errlen, ZS_EINVAL,
                       "piece %" PRIu32 " of the batch (tensor %" PRIu32 ", slice %" PRIu32
                       ") has %" PRId64 " bytes in dtype %d, not the %" PRIu64 " asked for",
                       index, tensor, slice, nb, (int)dtype, length);
  return nb;
}

int service_grad_stats(service *s, uint64_t hash, uint64_t step, uint32_t acked_rank,
                       uint64_t deadline_ms, core_stats_cb cb, void *arg, core_stats_result *out,
                       char *err, size_t errlen) {
  if (acked_rank > 0) {
    int lost = core_check_acked(s->core, hash, step, acked_rank - 1, err, errlen);
    if (lost != 0)
      return lost;
  }
  return core_grad_stats(s->core, hash, step, deadline_ms, cb, arg, out, err, errlen);
}

int service_apply(service *s, uint64_t hash, uint64_t step, double lr, float coef, int skip,
                  const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                  core_apply_result *out, char *err, size_t errlen) {
  return service_apply_groups(s, hash, step, lr, NULL, 0, coef, skip, cs, cs_len, cb, arg, out, err,
                              errlen);
}

int service_apply_groups(service *s, uint64_t hash, uint64_t step, double lr,
                         const double *group_lr, uint32_t ngroup_lr, float coef, int skip,
                         const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                         core_apply_result *out, char *err, size_t errlen) {
  /* The core refuses these too; checked first so that the client state of a
   * refused apply is never recorded. */
  if (!isfinite(lr) || lr < 0 || !isfinite(coef))
    return status_fail(err, errlen, ZS_EINVAL,
                       "Apply needs a finite lr >= 0 and a finite coef (lr=%g coef=%g)", lr,
                       (double)coef);
  if (ngroup_lr > 0 && !group_lr)
    return status_fail(err, errlen, ZS_EINVAL, "no group learning rates given");
  for (uint32_t g = 0; g < ngroup_lr; g++)
    if (!isfinite(group_lr[g]) || group_lr[g] < 0)
      return status_fail(err, errlen, ZS_EINVAL,
                         "Apply's group_lr[%" PRIu32 "] is %g: each must be finite and >= 0", g,
                         group_lr[g]);
  /* Recorded before the apply is queued, so that the apply commits it; an
   * oversized one is refused here and the apply never starts. */
  int rc = core_set_apply_client_state(s->core, hash, step, cs, cs_len, err, errlen);
  if (rc != 0)
    return rc;
  return core_apply_groups(s->core, hash, step, lr, group_lr, ngroup_lr, coef, skip, cb, arg, out,
                           err, errlen);
}

/* ------------------------------------------------------------ optimizer state */

static int state_array_check(int which, const char *what, char *err, size_t errlen) {
  if (which == ZS_STATE_MASTER || which == ZS_STATE_EXP_AVG || which == ZS_STATE_EXP_AVG_SQ)
    return 0;
  return status_fail(err, errlen, ZS_EINVAL,
                     "%s needs array MASTER (1), EXP_AVG (2) or EXP_AVG_SQ (3), not %d", what,
                     which);
}

int service_state_read(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                       uint64_t offset, uint64_t count, uint64_t max_bytes, float *dst,
                       uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen) {
  int rc = state_array_check(which, "ReadState", err, errlen);
  if (rc != 0)
    return rc;
  /* Checked before count * 4 is formed, so that it cannot wrap. */
  if (count > max_bytes / sizeof(float))
    return service_too_large("ReadState answer", count > UINT64_MAX / 4 ? UINT64_MAX : count * 4,
                             max_bytes, "gRPC message", err, errlen);
  return core_state_read(s->core, hash, tensor, slice, (zs_state_array)which, offset, dst,
                         (size_t)count * sizeof(float), version, optimizer_steps, err, errlen);
}

int service_state_write(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                        uint64_t offset, const void *data, size_t nbytes, const uint64_t *set_steps,
                        uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen) {
  if (nbytes % sizeof(float) != 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "WriteState data of %zu bytes is not a whole number of float32", nbytes);
  if (nbytes == 0 && !set_steps)
    return status_fail(err, errlen, ZS_ESIZE, "WriteState carries neither data nor a step count");
  int rc = nbytes == 0 ? 0 : state_array_check(which, "WriteState", err, errlen);
  if (rc != 0)
    return rc;
  /* The bytes come from a message buffer with no alignment promise: the core
   * copies with memcpy, but its pointer type asks for float alignment. */
  float *aligned = NULL;
  const float *src = data;
  if (nbytes > 0 && ((uintptr_t)data % _Alignof(float)) != 0) {
    if (!(aligned = malloc(nbytes)))
      return status_fail(err, errlen, ZS_ENOMEM, "out of memory copying WriteState data");
    memcpy(aligned, data, nbytes);
    src = aligned;
  }
  rc = core_state_write(s->core, hash, tensor, slice, (zs_state_array)which, offset, src, nbytes,
                        set_steps, version, optimizer_steps, err, errlen);
  free(aligned);
  return rc;
}

/* ------------------------------------------------ sentences of the transports */

int service_too_large(const char *what, uint64_t nbytes, uint64_t limit, const char *limit_name,
                      char *err, size_t errlen) {
  return status_fail(err, errlen, ZS_ERANGE,
                     "%s of %" PRIu64 " bytes exceeds the %" PRIu64 "-byte %s limit", what, nbytes,
                     limit, limit_name);
}

int service_pull_wait_failed(int status, uint64_t min_version, uint32_t tensor, uint32_t slice,
                             char *err, size_t errlen) {
  if (status == ZS_ETIMEDOUT)
    return status_fail(err, errlen, status,
                       "timed out waiting for version %" PRIu64 " of tensor %" PRIu32
                       " slice %" PRIu32,
                       min_version, tensor, slice);
  if (status == ZS_ENOTOPEN)
    return status_fail(err, errlen, status,
                       "the job was closed while this pull of tensor %" PRIu32 " slice %" PRIu32
                       " waited for version %" PRIu64 " (no job is open on this shard now)",
                       tensor, slice, min_version);
  return status_fail(err, errlen, status, "%s", zs_strerror(status));
}
