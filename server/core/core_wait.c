/*
 * core_wait — the waiters and the waits: a waiter's deadline and its place
 * in the lists and in the by-argument table, the fire list, the waits for a
 * version (of the shard or of some pieces) and for a step's gradient
 * statistics, and their cancellation (see core.h for the contract; threads
 * and locks: the top of core.c). The worker that fires them is
 * core_worker.c; the apply is core_apply.c.
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdlib.h>

#include "common/base/clock.h"

#define CORE_DEFAULT_WAIT_MS 60000u

/* ---------------------------------------------------------------- waiters */

uint64_t core__deadline(uint64_t deadline_ms) {
  return deadline_ms ? deadline_ms : clock_now_ms() + CORE_DEFAULT_WAIT_MS;
}

/* Invokes and frees every waiter of a fire list. Called with no lock held. */
void core__fire(waiter *w) {
  while (w) {
    waiter *next = w->next;
    switch (w->kind) {
    case WAITER_VERSION:
      if (w->cb.version)
        w->cb.version(w->arg, w->status, w->version);
      break;
    case WAITER_STATS:
      if (w->cb.stats)
        w->cb.stats(w->arg, w->status, &w->stats);
      break;
    case WAITER_APPLY:
      if (w->cb.apply)
        w->cb.apply(w->arg, w->status, &w->apply);
      break;
    case WAITER_SNAPSHOT: {
      ckpt_call *call = w->arg;
      if (call->on_done) {
        call->on_done(call->on_done_arg, w->status, call->seconds);
        free(call);
        break;
      }
      pthread_mutex_lock(&call->mu);
      call->status = w->status;
      call->done = 1;
      pthread_cond_signal(&call->cv);
      pthread_mutex_unlock(&call->mu);
      break;
    }
    }
    free(w);
    w = next;
  }
}

/* The bucket of by_arg that holds the waiters of `arg` (nbuckets > 0). */
static size_t core_arg_bucket(const core *c, const void *arg) {
  uint64_t h = (uint64_t)(uintptr_t)arg * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing */
  return (size_t)(h >> 32) & (c->nbuckets - 1);
}

/* Doubles by_arg (from 64 buckets) once it holds as many waiters as buckets,
 * so a chain stays about one waiter long and the rehash is amortized O(1)
 * per wait. Out of memory it keeps the table it has: chains get longer, the
 * answers stay right. Called with mu held. */
static void core_arg_grow(core *c) {
  size_t n = c->nbuckets ? c->nbuckets * 2 : 64;
  waiter **t = calloc(n, sizeof *t);
  if (!t)
    return;
  size_t old = c->nbuckets;
  waiter **from = c->by_arg;
  c->by_arg = t;
  c->nbuckets = n;
  for (size_t b = 0; b < old; b++) {
    while (from[b]) {
      waiter *w = from[b];
      from[b] = w->hnext;
      size_t i = core_arg_bucket(c, w->arg);
      w->hnext = t[i];
      t[i] = w;
    }
  }
  free(from);
}

void core__unlink(core *c, waiter *w) {
  *w->pprev = w->next;
  if (w->next)
    w->next->pprev = w->pprev;
  w->next = NULL;
  if (!w->hashed)
    return;
  /* The chain is about one waiter long (core_arg_grow). */
  waiter **ph = &c->by_arg[core_arg_bucket(c, w->arg)];
  while (*ph != w)
    ph = &(*ph)->hnext;
  *ph = w->hnext;
  w->hashed = 0;
  c->nhashed--;
}

/* Registers a waiter with a deadline and wakes the worker if the deadline is
 * earlier than the one it sleeps towards. Version and statistics waiters go
 * into by_arg too, for core_cancel_waits: ZS_ENOMEM (nothing registered)
 * when by_arg cannot be made at all; snapshots never fail. Called with mu
 * held. */
int core__add_timed(core *c, waiter **list, waiter *w) {
  if (w->kind == WAITER_VERSION || w->kind == WAITER_STATS) {
    if (c->nhashed >= c->nbuckets)
      core_arg_grow(c);
    if (c->nbuckets == 0)
      return ZS_ENOMEM;
    size_t i = core_arg_bucket(c, w->arg);
    w->hnext = c->by_arg[i];
    c->by_arg[i] = w;
    w->hashed = 1;
    c->nhashed++;
  }
  waiter_push(list, w);
  if (w->deadline < c->next_deadline) {
    c->next_deadline = w->deadline;
    pthread_cond_signal(&c->worker_cv);
  }
  return 0;
}

/* ------------------------------------------------- versions reached */

/* The version a version waiter sees: the shard's, or the lowest of its
 * pieces' (a piece a pipelined step applied ahead is at version + 1).
 * Called with mu held. */
static uint64_t core_waiter_version(const core *c, const waiter *w) {
  uint64_t v = c->version;
  int all_ahead = w->nwait > 0;
  for (uint32_t i = 0; i < w->nwait && all_ahead; i++)
    all_ahead = c->pieces[w->wait[i]].ahead;
  return v + (uint64_t)all_ahead;
}

/* Moves every version waiter whose condition holds to the fire list. Called
 * with mu held. */
void core__collect_versions(core *c, waiter **fire) {
  if (!c->open || c->initialized_pieces < c->npieces)
    return;
  for (waiter **pw = &c->version_waiters; *pw;) {
    waiter *w = *pw;
    uint64_t v = core_waiter_version(c, w);
    if (w->key <= v) {
      core__unlink(c, w);
      w->status = ZS_OK;
      w->version = v;
      waiter_push(fire, w);
    } else {
      pw = &w->next;
    }
  }
}

/* ---------------------------------------------------------------- waits */

int core_wait_version(core *c, uint64_t hash, uint64_t min_version, uint64_t deadline_ms,
                      core_version_cb cb, void *arg, uint64_t *version, char *err, size_t errlen) {
  return core_wait_pieces(c, hash, NULL, 0, min_version, deadline_ms, cb, arg, version, err,
                          errlen);
}

/* A version waiter for n pieces (their local indices, or the whole shard
 * when n is 0), or a status with a sentence. Called with mu held and the
 * job open. */
static int core_version_waiter(core *c, const core_piece_id *pieces, uint32_t n, waiter **out,
                               char *err, size_t errlen) {
  waiter *w = calloc(1, sizeof *w + (size_t)n * sizeof w->wait[0]);
  if (!w)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a wait");
  for (uint32_t i = 0; i < n; i++) {
    int rc = core__piece_index(c, pieces[i].tensor, pieces[i].slice, &w->wait[i], err, errlen);
    if (rc != 0) {
      free(w);
      return rc;
    }
  }
  w->nwait = n;
  *out = w;
  return 0;
}

int core_wait_pieces(core *c, uint64_t hash, const core_piece_id *pieces, uint32_t n,
                     uint64_t min_version, uint64_t deadline_ms, core_version_cb cb, void *arg,
                     uint64_t *version, char *err, size_t errlen) {
  waiter *w = NULL;
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core__check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  /* Only a pipelined job's pieces can be ahead of the shard's version. */
  if ((rc = core_version_waiter(c, pieces, c->pipelined ? n : 0, &w, err, errlen)) != 0)
    goto done;
  uint64_t have = core_waiter_version(c, w);
  if (c->initialized_pieces == c->npieces && have >= min_version) {
    if (version)
      *version = have;
    goto done;
  }
  if (c->ckpt_loaded && min_version > c->version + 1) {
    rc = core__behind(c, "wait", min_version, err, errlen);
    goto done;
  }
  /* A trainer waits for the version it is about to reach, one more when it
   * prefetches; a wait further ahead would only hold a parking slot of the
   * transports for minutes (issue 24). */
  if (min_version > c->version && min_version - c->version > CORE_MAX_WAIT_AHEAD) {
    rc = status_fail(err, errlen, ZS_ERANGE,
                     "wait for version %" PRIu64 " refused: shard %u is at version %" PRIu64
                     ", and a call may wait for at most %u versions past it",
                     min_version, c->shard_id, c->version, CORE_MAX_WAIT_AHEAD);
    goto done;
  }
  uint64_t deadline = core__deadline(deadline_ms);
  if (deadline <= clock_now_ms()) {
    rc = status_fail(err, errlen, ZS_ETIMEDOUT,
                     "deadline passed waiting for version %" PRIu64 " (shard %u is at %" PRIu64
                     ", %u of %u pieces initialised)",
                     min_version, c->shard_id, c->version, c->initialized_pieces, c->npieces);
    goto done;
  }
  w->kind = WAITER_VERSION;
  w->key = min_version;
  w->deadline = deadline;
  w->cb.version = cb;
  w->arg = arg;
  if (core__add_timed(c, &c->version_waiters, w) != 0) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a wait");
    goto done;
  }
  w = NULL;
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  free(w);
  return rc;
}

void core_cancel_waits(core *c, void *arg) {
  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
  /* Only by_arg's bucket of arg is walked (about one waiter), never the
   * lists: a mass cancel of n parked calls costs O(n), not O(n^2). A waiter
   * that already fired is on no list and in no bucket, so it is not found,
   * and its callback ran or runs on the worker instead. Every waiter on
   * those lists is in by_arg (core__add_timed). */
  if (c->nbuckets > 0) {
    waiter **ph = &c->by_arg[core_arg_bucket(c, arg)];
    while (*ph) {
      waiter *w = *ph;
      if (w->arg != arg) {
        ph = &w->hnext;
        continue;
      }
      core__unlink(c, w); /* takes it out of *ph too */
      w->status = ZS_ECANCELED;
      w->version = c->version;
      w->stats.step = w->key;
      waiter_push(&fire, w);
    }
  }
  pthread_mutex_unlock(&c->mu);
  core__fire(fire);
}

int core_grad_stats(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_stats_cb cb,
                    void *arg, core_stats_result *out, char *err, size_t errlen) {
  return core_grad_stats_members(c, hash, step, NULL, deadline_ms, cb, arg, out, err, errlen);
}

/* A sentence naming the first rank of want that `have` lacks. */
static int core_members_refuse(const core *c, const core_members *want, const core_members *have,
                               uint64_t step, char *err, size_t errlen) {
  uint32_t r = 0;
  while (r < c->W && !(core_members_has(want, r) && !core_members_has(have, r)))
    r++;
  return status_fail(err, errlen, ZS_EINVAL,
                     "statistics of step %" PRIu64 " asked over %u ranks, but shard %u does not "
                     "hold every contribution of rank %u (it sums %u ranks)",
                     step, want->n, c->shard_id, r, have->n);
}

/* core_grad_stats_members' answers that need no wait: 0 with *out filled,
 * CORE_PENDING to park, or a refusal. Called with mu held, the job open,
 * step the pending one and the job gated. */
static int core_stats_now(core *c, const core_members *want, core_stats_result *out, char *err,
                          size_t errlen) {
  if (want && (!c->elastic || want->n == 0) && !core_members_equal(want, &c->stat_members))
    return core_members_refuse(c, want, &c->stat_members, c->version + 1, err, errlen);
  if (c->stats_phase != STATS_READY)
    return CORE_PENDING;
  if (!want || core_members_equal(want, &c->stat_members)) {
    if (out)
      *out = c->stats;
    return 0;
  }
  if (!core__members_subset(want, &c->stat_members))
    return core_members_refuse(c, want, &c->stat_members, c->version + 1, err, errlen);
  if (c->apply_state != APPLY_NONE)
    return status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " is being applied over %u ranks; statistics over %u "
                       "ranks cannot be taken any more",
                       c->version + 1, c->stat_members.n, want->n);
  core__members_narrow(c, want);
  return CORE_PENDING;
}

int core_grad_stats_members(core *c, uint64_t hash, uint64_t step, const core_members *want,
                            uint64_t deadline_ms, core_stats_cb cb, void *arg,
                            core_stats_result *out, char *err, size_t errlen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core__check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  if (c->pipelined) {
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "job '%s' is pipelined: each piece is applied as soon as its contributions "
                     "are in, so there are no gradient statistics (no clipping, no overflow "
                     "check); open the job without pipelined for those",
                     c->spec.job);
    goto done;
  }
  if (c->last_stats_valid && step == c->version) {
    if (want && !core_members_equal(want, &c->last_members))
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " was applied over %u ranks, not the %u asked for", step,
                       c->last_members.n, want->n);
    else if (out)
      *out = c->last_stats;
    goto done;
  }
  if (c->ckpt_loaded && (step > c->version + 1 || step == c->version)) {
    rc = core__behind(c, "statistics", step, err, errlen);
    goto done;
  }
  if (step != c->version + 1) {
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "statistics asked for step %" PRIu64 " but shard %u is at version %" PRIu64
                     " (pending step %" PRIu64 ")",
                     step, c->shard_id, c->version, c->version + 1);
    goto done;
  }
  if ((rc = core_stats_now(c, want, out, err, errlen)) != CORE_PENDING)
    goto done;
  rc = 0;
  uint64_t deadline = core__deadline(deadline_ms);
  if (deadline <= clock_now_ms()) {
    rc = status_fail(err, errlen, ZS_ETIMEDOUT,
                     "deadline passed waiting for the contributions of step %" PRIu64, step);
    goto done;
  }
  waiter *w = calloc(1, sizeof *w);
  if (!w) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a wait");
    goto done;
  }
  w->kind = WAITER_STATS;
  w->key = step;
  w->deadline = deadline;
  w->cb.stats = cb;
  w->arg = arg;
  w->has_want = want != NULL;
  if (want)
    w->want = *want;
  if (core__add_timed(c, &c->stats_waiters, w) != 0) {
    free(w);
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a wait");
    goto done;
  }
  /* A trainer is done with the step and waits: the trainer timeout of the
   * members still pushing starts now. */
  if (c->elastic && c->stall_since == 0 && c->stats_phase == STATS_WAITING) {
    c->stall_since = clock_now_ms();
    pthread_cond_signal(&c->worker_cv);
  }
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  return rc;
}
