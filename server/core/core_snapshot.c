/*
 * core_snapshot — checkpoints of the core: snapshots of one version, the
 * state a restore loads and the restore itself, both run on the worker
 * (see core.h for the contract; threads and locks: the top of core.c).
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/log.h"

void core__ckpt_call_init(ckpt_call *call) {
  memset(call, 0, sizeof *call);
  pthread_mutex_init(&call->mu, NULL);
  pthread_cond_init(&call->cv, NULL);
}

void core__ckpt_call_destroy(ckpt_call *call) {
  pthread_cond_destroy(&call->cv);
  pthread_mutex_destroy(&call->mu);
}

/* Waits until the worker (or core_destroy) finished the call. */
int core__ckpt_call_wait(ckpt_call *call) {
  pthread_mutex_lock(&call->mu);
  while (!call->done)
    pthread_cond_wait(&call->cv, &call->mu);
  int status = call->status;
  pthread_mutex_unlock(&call->mu);
  return status;
}

void core__ckpt_call_finish(ckpt_call *call, int status) {
  pthread_mutex_lock(&call->mu);
  call->status = status;
  call->done = 1;
  pthread_cond_signal(&call->cv);
  pthread_mutex_unlock(&call->mu);
}

/* Takes the first snapshot waiter whose version is the current one (and whose
 * pieces are all initialised) off the list, and moves those whose version is
 * gone to the fire list with ZS_ESTEP. A pipelined step that applied a piece
 * ahead has left the current version behind too: the arenas no longer hold
 * it whole. The worker takes snapshots before it applies pieces, so a
 * snapshot registered before the step's first piece completed is taken at
 * its version. Called on the worker with mu held. */
waiter *core__take_snapshot(core *c, waiter **fire) {
  waiter *ready = NULL;
  for (waiter **pw = &c->snapshot_waiters; *pw;) {
    waiter *w = *pw;
    if (w->key < c->version || (w->key == c->version && c->nahead > 0)) {
      core__unlink(c, w);
      w->status = ZS_ESTEP;
      waiter_push(fire, w);
    } else if (!ready && w->key == c->version && c->open && c->initialized_pieces == c->npieces) {
      core__unlink(c, w);
      w->next = NULL;
      ready = w;
    } else {
      pw = &w->next;
    }
  }
  return ready;
}

/* Shows the state to the snapshot's function with state_rw shared: the
 * version and the arenas only change under the exclusive lock, so the view is
 * one version; pushes (which only touch acc) and pulls go on. Called on the
 * worker, no lock held. */
void core__run_snapshot(core *c, waiter *w) {
  ckpt_call *call = w->arg;
  pthread_rwlock_rdlock(&c->state_rw);
  /* The members and the log change only under state_rw exclusive; the
   * counters and the timeout are read under mu. */
  core_member_state ms = {.members = c->members,
                          .log = c->mlog,
                          .log_n = c->mlog_n,
                          .join_at = c->join_at,
                          .leave_at = c->leave_at,
                          .nplan = c->W < CORE_ELASTIC_MAX_W ? c->W : CORE_ELASTIC_MAX_W};
  pthread_mutex_lock(&c->mu);
  int elastic = c->elastic;
  ms.trainer_timeout_ms = c->open_timeout_ms;
  ms.flag_timeout_ms = c->flag_timeout_ms;
  ms.epoch = c->member_epoch;
  ms.leaves = c->member_leaves;
  ms.timeouts = c->member_timeouts;
  ms.joins = c->member_joins;
  pthread_mutex_unlock(&c->mu);
  core_view view = {
      .spec = &c->spec,
      .shard_id = c->shard_id,
      .num_shards = c->num_shards,
      .hash = c->hash,
      .version = c->version,
      .optimizer_steps = c->optimizer_steps,
      .tensor_steps = c->tensor_steps,
      .nelems = c->nelems,
      .master = c->master,
      .m = c->m,
      .v = c->v,
      .client_state = c->client_state_len ? c->client_state : NULL,
      .client_state_len = c->client_state_len,
      .members = elastic ? &ms : NULL,
  };
  uint64_t t0 = clock_now_ns();
  int rc = call->fn(call->fn_arg, &view);
  call->seconds = (double)(clock_now_ns() - t0) / 1e9;
  pthread_rwlock_unlock(&c->state_rw);
  LOG_DEBUG("snapshot", "shard=%u version=%" PRIu64 " seconds=%.6f status=%d", c->shard_id,
            view.version, call->seconds, rc);
  w->status = rc;
  w->next = NULL;
  core__fire(w);
}

/* Exchanges the arenas with the call's state and resets everything the
 * pending step had gathered. Called on the worker, no lock held. */
void core__run_restore(core *c, ckpt_call *call) {
  core_state *st = call->st;
  pthread_rwlock_wrlock(&c->state_rw);
  float *t = c->master;
  c->master = st->master;
  st->master = t;
  t = c->m;
  c->m = st->m;
  st->m = t;
  t = c->v;
  c->v = st->v;
  st->v = t;
  /* The range plans point at the arenas through range_m / range_v. */
  for (uint32_t r = 0; r < c->nranges; r++) {
    c->range_m[r] = c->range_m[r] ? c->m : NULL;
    c->range_v[r] = c->range_v[r] ? c->v : NULL;
  }
  if (c->nelems > 0) {
    core__low_writable(c, "restore");
    dtype_from_f32(c->spec.param_dtype, c->master, c->low, (size_t)c->nelems);
    memset(c->acc, 0, (size_t)c->nelems * sizeof(float));
    pool_run(c->pool, c->npieces, core__low_crc_task, c);
  }
  /* No push runs while state_rw is held exclusively, so the pieces' own
   * locks are not needed. */
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    core__piece_drop_held(c, ps);
    ps->nheld = 0;
    ps->nrecv = 0;
    ps->next_k = 0;
    ps->one_before_zero = 0;
    ps->ahead = 0;
    ps->has_grad = 0;
    ps->initialized = 1;
    free(ps->init_chunks);
    ps->init_chunks = NULL;
    ps->init_have = 0;
  }
  if (c->npieces > 0)
    memset(c->bitmaps, 0, (size_t)c->npieces * c->bitmap_words * sizeof *c->bitmaps);
  atomic_store_explicit(&c->contributions, 0, memory_order_relaxed);
  atomic_store_explicit(&c->held_bytes, 0, memory_order_relaxed);

  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
  c->version = st->version;
  c->optimizer_steps = st->optimizer_steps;
  for (uint32_t t = 0; t < c->spec.num_tensors; t++)
    c->tensor_steps[t] = st->tensor_steps ? st->tensor_steps[t] : st->optimizer_steps;
  /* core_restore checked the length. */
  if (st->client_state_len > 0)
    memcpy(c->client_state, st->client_state, st->client_state_len);
  c->client_state_len = st->client_state_len;
  c->pending_cs_step = 0;
  c->pending_cs_len = 0;
  c->initialized_pieces = c->npieces;
  c->apply_state = APPLY_NONE;
  c->nready = 0;
  c->nahead = 0;
  c->pipe_seconds = 0;
  c->last_apply_valid = 0;
  c->last_stats_valid = 0;
  c->ckpt_loaded = 1;
  c->ckpt_step = call->ckpt_step;
  c->ckpt_untouched = 1;
  c->ckpt_taken_over = 0;
  /* The checkpoint's membership (format 2), or every rank of the job for
   * a checkpoint without one (DESIGN.md "Membership"). */
  core__members_restore(c, st->members);
  core__begin_step(c);
  /* Statistics and applies in progress belong to a step that no longer
   * exists here, and so do waits for a version beyond the restored one:
   * their trainers must restore too. */
  waiter **lists[2] = {&c->stats_waiters, &c->apply_waiters};
  for (int i = 0; i < 2; i++) {
    while (*lists[i]) {
      waiter *w = *lists[i];
      core__unlink(c, w);
      w->status = ZS_EBEHIND;
      w->stats.step = w->key;
      w->apply = (core_apply_result){.step = w->key, .version = c->version};
      waiter_push(&fire, w);
    }
  }
  for (waiter **pw = &c->version_waiters; *pw;) {
    waiter *w = *pw;
    if (w->key > c->version) {
      core__unlink(c, w);
      w->status = ZS_EBEHIND;
      w->version = c->version;
      waiter_push(&fire, w);
    } else {
      pw = &w->next;
    }
  }
  core__collect_versions(c, &fire);
  uint64_t version = c->version;
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
  LOG_DEBUG("restore", "shard=%u checkpoint_step=%" PRIu64 " version=%" PRIu64, c->shard_id,
            call->ckpt_step, version);
  core__fire(fire);
  core__ckpt_call_finish(call, ZS_OK);
}

/* Registers `w` as the snapshot waiter of `call` for version `step`, which
 * the worker runs once the shard reaches it. Returns 0 (w is the core's
 * now) or the refusal (w still the caller's). */
static int snapshot_register(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, waiter *w,
                             ckpt_call *call, char *err, size_t errlen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core__check_job(c, hash, err, errlen);
  if (rc == 0 && step < c->version)
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "version %" PRIu64 " cannot be checkpointed: shard %u is at version %" PRIu64,
                     step, c->shard_id, c->version);
  if (rc == 0) {
    w->kind = WAITER_SNAPSHOT;
    w->key = step;
    w->deadline = core__deadline(deadline_ms);
    w->arg = call;
    (void)core__add_timed(c, &c->snapshot_waiters, w);
    pthread_cond_signal(&c->worker_cv);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int core_snapshot(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_view_fn fn,
                  void *arg, double *fn_seconds, char *err, size_t errlen) {
  if (fn_seconds)
    *fn_seconds = 0;
  if (!fn)
    return status_fail(err, errlen, ZS_EINVAL, "no snapshot function given");
  waiter *w = calloc(1, sizeof *w);
  if (!w)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a snapshot");
  ckpt_call call;
  core__ckpt_call_init(&call);
  call.fn = fn;
  call.fn_arg = arg;
  int rc = snapshot_register(c, hash, step, deadline_ms, w, &call, err, errlen);
  if (rc == 0) {
    w = NULL; /* the core's now */
    rc = core__ckpt_call_wait(&call);
    if (rc == 0 && fn_seconds)
      *fn_seconds = call.seconds;
    if (rc == ZS_ETIMEDOUT || rc == ZS_ESTEP || rc == ZS_ECANCELED || rc == ZS_ECLOSED) {
      pthread_mutex_lock(&c->mu);
      uint64_t version = c->version;
      pthread_mutex_unlock(&c->mu);
      status_fail(err, errlen, rc,
                  "snapshot of version %" PRIu64
                  " on shard %u: %s (the shard is at version %" PRIu64 ")",
                  step, c->shard_id,
                  rc == ZS_ETIMEDOUT ? "deadline passed before the version was reached"
                  : rc == ZS_ESTEP   ? "the shard moved past that version"
                  : rc == ZS_ECLOSED ? "the shard is shutting down"
                                     : "cancelled",
                  version);
    }
  }
  free(w);
  core__ckpt_call_destroy(&call);
  return rc;
}

int core_snapshot_async(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms,
                        core_view_fn fn, void *fn_arg, core_snapshot_done done, void *done_arg,
                        char *err, size_t errlen) {
  if (!fn || !done)
    return status_fail(err, errlen, ZS_EINVAL, "no snapshot function given");
  waiter *w = calloc(1, sizeof *w);
  ckpt_call *call = calloc(1, sizeof *call);
  if (!w || !call) {
    free(w);
    free(call);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a snapshot");
  }
  call->fn = fn;
  call->fn_arg = fn_arg;
  call->on_done = done;
  call->on_done_arg = done_arg;
  int rc = snapshot_register(c, hash, step, deadline_ms, w, call, err, errlen);
  if (rc == 0)
    rc = CORE_PENDING;
  if (rc != CORE_PENDING) {
    free(w);
    free(call);
  }
  return rc;
}

void core_cancel_snapshots(core *c) {
  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
  while (c->snapshot_waiters) {
    waiter *w = c->snapshot_waiters;
    core__unlink(c, w);
    w->status = ZS_ECANCELED;
    waiter_push(&fire, w);
  }
  pthread_mutex_unlock(&c->mu);
  core__fire(fire);
}

int core_state_init(core_state *st, const spec *s, uint32_t shard_id, char *err, size_t errlen) {
  layout l;
  memset(&l, 0, sizeof l);
  memset(st, 0, sizeof *st);
  int rc;
  if (!s)
    return status_fail(err, errlen, ZS_EINVAL, "no spec given");
  if (shard_id >= s->num_shards)
    return status_fail(err, errlen, ZS_EINVAL, "shard %u is not below the spec's shard count %u",
                       shard_id, s->num_shards);
  if (spec_copy(&st->spec, s) != 0) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory copying the spec");
    goto fail;
  }
  if ((rc = spec_validate(&st->spec, err, errlen)) != 0)
    goto fail;
  if (layout_build(&st->spec, &l) != 0) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory computing the layout");
    goto fail;
  }
  st->shard_id = shard_id;
  st->nelems = l.shard_elems[shard_id];
  /* The same rule as core_job_build: an arena exists when a param group with
   * a range on this shard uses it. */
  unsigned needs = 0;
  for (uint32_t r = l.range_first[shard_id]; r < l.range_first[shard_id + 1]; r++)
    needs |= optim_state_needs(&st->spec.groups[l.ranges[r].group]);
  int need_m = (needs & OPTIM_STATE_M) != 0, need_v = (needs & OPTIM_STATE_V) != 0;
  uint64_t b32 = st->nelems * sizeof(float);
  st->master = core__arena_alloc(b32);
  if (need_m)
    st->m = core__arena_alloc(b32);
  if (need_v)
    st->v = core__arena_alloc(b32);
  if (st->nelems > 0 && (!st->master || (need_m && !st->m) || (need_v && !st->v))) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory allocating %" PRIu64 " bytes of state",
                     b32 * (1u + (uint64_t)need_m + (uint64_t)need_v));
    goto fail;
  }
  layout_free(&l);
  return 0;
fail:
  layout_free(&l);
  core_state_free(st);
  return rc;
}

void core_state_free(core_state *st) {
  if (!st)
    return;
  spec_free(&st->spec);
  free(st->master);
  free(st->m);
  free(st->v);
  free(st->tensor_steps);
  free(st->client_state);
  core_member_state_free(st->members);
  memset(st, 0, sizeof *st);
}

int core_restore(core *c, core_state *st, uint64_t ckpt_step, char *err, size_t errlen) {
  if (!st || (st->nelems > 0 && !st->master))
    return status_fail(err, errlen, ZS_EINVAL, "no state given");
  if (st->shard_id != c->shard_id || st->spec.num_shards != c->num_shards)
    return status_fail(err, errlen, ZS_EINVAL,
                       "the state is laid out for shard %u of %u, this is shard %u of %u",
                       st->shard_id, st->spec.num_shards, c->shard_id, c->num_shards);
  if (st->client_state_len > CORE_MAX_CLIENT_STATE || (st->client_state_len && !st->client_state))
    return status_fail(err, errlen, ZS_EINVAL,
                       "the state's client state of %zu bytes is not one of at most %u",
                       st->client_state_len, CORE_MAX_CLIENT_STATE);
  if (st->members) {
    const core_member_state *ms = st->members;
    if (ms->log_n > 0 && !ms->log)
      return status_fail(err, errlen, ZS_EINVAL, "the state's membership log is missing");
    if (ms->trainer_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS ||
        ms->flag_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS)
      return status_fail(err, errlen, ZS_EINVAL,
                         "the state's trainer timeout (%u ms) or flag timeout (%u ms) is above "
                         "%u",
                         ms->trainer_timeout_ms, ms->flag_timeout_ms, CORE_MAX_TRAINER_TIMEOUT_MS);
    for (uint32_t k = 0; k <= ms->log_n; k++) {
      const core_members *m = k < ms->log_n ? &ms->log[k].members : &ms->members;
      for (uint32_t r = st->spec.world_size; r < CORE_ELASTIC_MAX_W; r++)
        if (core_members_has(m, r))
          return status_fail(err, errlen, ZS_EINVAL,
                             "the state's membership names rank %u, beyond the job's world "
                             "size %u",
                             r, st->spec.world_size);
    }
  }
  /* Creates the job when there is none (with the checkpoint's own trainer
   * timeout), and refuses another job's state. */
  int rc = core_open_job(c, &st->spec, CORE_OPEN_EITHER,
                         st->members ? st->members->trainer_timeout_ms : 0, NULL, err, errlen);
  if (rc != 0)
    return rc;
  ckpt_call call;
  core__ckpt_call_init(&call);
  call.st = st;
  call.ckpt_step = ckpt_step;
  pthread_mutex_lock(&c->mu);
  if (c->stop)
    rc = status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down");
  else if (st->members && c->W != st->spec.world_size)
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "the state's membership is for a world size of %u, job '%s' on shard %u has "
                     "%u",
                     st->spec.world_size, c->spec.job, c->shard_id, c->W);
  else if (c->nelems != st->nelems || !c->m != !st->m || !c->v != !st->v)
    rc = status_fail(err, errlen, ZS_EINTERNAL,
                     "the state's arenas do not match the job's layout on shard %u", c->shard_id);
  else if (c->restore_call)
    rc = status_fail(err, errlen, ZS_ENOTREADY, "another restore is in progress on shard %u",
                     c->shard_id);
  if (rc == 0) {
    c->restore_call = &call;
    pthread_cond_signal(&c->worker_cv);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc == 0) {
    rc = core__ckpt_call_wait(&call);
    if (rc != 0)
      status_fail(err, errlen, rc, "restore on shard %u: %s", c->shard_id, zs_strerror(rc));
  }
  core__ckpt_call_destroy(&call);
  return rc;
}

void core_mark_behind(core *c) {
  pthread_rwlock_wrlock(&c->state_rw);
  pthread_mutex_lock(&c->mu);
  if (c->open && !c->ckpt_loaded) {
    c->ckpt_loaded = 1;
    c->ckpt_step = c->version;
    c->ckpt_untouched = 0; /* not a checkpoint: a Restore must not be skipped */
    c->ckpt_taken_over = 1;
  }
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
}

int core_checkpoint_origin(core *c, uint64_t *step, int *untouched) {
  pthread_mutex_lock(&c->mu);
  int loaded = c->ckpt_loaded;
  if (step)
    *step = c->ckpt_step;
  if (untouched)
    *untouched = c->ckpt_untouched;
  pthread_mutex_unlock(&c->mu);
  return loaded;
}
