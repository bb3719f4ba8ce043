/*
 * core — one job's state on one shard (see core.h for the contract). This
 * file holds the lifecycle and the job (its layout and arenas), the checks
 * every request starts with, client state and counters; core_data.c the
 * weights, pushes and reads, core_wait.c the waits, core_worker.c the
 * worker thread, core_apply.c the apply, core_snapshot.c checkpoints,
 * core_internal.h the private types.
 *
 * Threads and what they own:
 *  - Caller threads (the transports' threads) run core_push, core_read,
 *    core_init_params and the registering halves of the waits and of
 *    core_apply. They never run long work and never invoke callbacks, except
 *    core_destroy, which fires the callbacks still pending with ZS_ECLOSED
 *    after the worker has been joined.
 *  - The worker thread (one per core) computes the gradient statistics, runs
 *    the apply, fires every callback and every timeout: it sleeps on worker_cv
 *    until the nearest waiter deadline. It is the only caller of pool_run.
 *    It also runs the copy of a core_snapshot (state_rw shared) and the swap
 *    of a core_restore (state_rw exclusive, then mu), so that both are ordered
 *    with the applies; their callers block on their own ckpt_call.
 *  - The pool's threads run chunks of the statistics and of the optimizer pass
 *    for the worker, which takes part itself.
 *
 * Locks, always taken in this order (a lock may be skipped, never reversed):
 *   1. state_rw (rwlock, writer-preferring): guards the contents of the arenas
 *      (master, m, v, acc, low) as a whole, the job description set by
 *      core_open, the version and the per-piece step state as a whole. Held
 *      shared by core_push, core_read, core_state_read, core_missing,
 *      core_piece_bytes and the statistics pass; exclusively by core_open,
 *      core_init_params, core_state_write and the apply (so a state write is
 *      ordered with the applies without going through the worker). Holding it shared is what makes
 * a read consistent with one version: the version and the master only change under the exclusive
 *      lock.
 *   2. piece_state.mu: one per piece; guards that piece's received bitmap,
 *      next_k, held contributions and its range of acc, so that pushes to
 *      different pieces run in parallel.
 *   3. mu: guards the step state (initialized and complete piece counts,
 *      statistics phase and results, apply state and record), the waiter
 *      lists, and the counters that are not atomic. Writes of `open` and
 *      `version` happen under both state_rw (exclusive) and mu, so either lock
 *      is enough to read them.
 *   4. low_mu: a leaf, held for a few instructions: the pins of the low
 *      copies and the list of retired ones (core_data.c), so that
 *      core_unpin_low runs on any thread without the other locks.
 * Callbacks are collected into a list under mu and invoked after every lock is
 * released.
 */
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/base/status.h"

#define CORE_ARENA_ALIGN 64u

/* ---------------------------------------------------------------- helpers */

void *core__arena_alloc(uint64_t bytes) {
  if (bytes == 0)
    return NULL;
  void *p = NULL;
  size_t len = (size_t)((bytes + CORE_ARENA_ALIGN - 1) / CORE_ARENA_ALIGN * CORE_ARENA_ALIGN);
  if (posix_memalign(&p, CORE_ARENA_ALIGN, len) != 0)
    return NULL;
  memset(p, 0, len);
  return p;
}

/* ---------------------------------------------------------------- job */

static void core_job_free(core *c) {
  /* First, so that core_unpin_low, which may run on any thread, no longer
   * finds low_cur and so never looks at by_off and piece_pins below. */
  core__low_release(c);
  for (uint32_t i = 0; i < c->pieces_inited; i++) {
    piece_state *ps = &c->pieces[i];
    free(ps->init_chunks);
    core__piece_drop_held(c, ps);
    pthread_mutex_destroy(&ps->mu);
  }
  free(c->pieces);
  free(c->local_of);
  free(c->bitmaps);
  free(c->master);
  free(c->acc);
  free(c->m);
  free(c->v);
  free(c->low_crc);
  c->low_crc = NULL;
  free(c->q8);
  free(c->q8_crc);
  c->q8 = NULL;
  c->q8_crc = NULL;
  free(c->pplans);
  free(c->tensor_steps);
  c->pplans = NULL;
  c->tensor_steps = NULL;
  free(c->range_m);
  free(c->range_v);
  free(c->block_sums);
  free(c->block_nonfinite);
  free(c->ready);
  free(c->batch);
  free(c->ptasks);
  free(c->piece_pins);
  free(c->by_off);
  c->piece_pins = NULL;
  c->by_off = NULL;
  c->ready = c->batch = NULL;
  c->ptasks = NULL;
  c->nready = c->nbatch = c->nahead = 0;
  c->pipelined = 0;
  free(c->apply_glr);
  free(c->last_glr);
  c->apply_glr = c->last_glr = NULL;
  c->apply_nglr = c->last_nglr = 0;
  free(c->apply_hp);
  free(c->last_hp);
  c->apply_hp = c->last_hp = NULL;
  c->apply_hp_mask = c->last_hp_mask = 0;
  layout_free(&c->layout);
  spec_free(&c->spec);
  c->pieces = NULL;
  c->local_of = NULL;
  c->bitmaps = NULL;
  c->master = c->acc = c->m = c->v = NULL;
  c->range_m = c->range_v = NULL;
  c->block_sums = NULL;
  c->block_nonfinite = NULL;
  c->pieces_inited = 0;
  c->npieces = 0;
  c->nelems = 0;
  c->nranges = 0;
  c->nblocks = 0;
}

static int core_piece_at_cmp(const void *a, const void *b) {
  uint64_t x = ((const struct core_piece_at *)a)->off, y = ((const struct core_piece_at *)b)->off;
  return x < y ? -1 : x > y;
}

/* Builds everything the job needs on this shard from c->spec. Called under
 * state_rw (exclusive) before `open` is published. */
static int core_job_build(core *c) {
  const layout *l = &c->layout;
  if (layout_build(&c->spec, &c->layout) != 0)
    return ZS_ENOMEM;
  c->W = c->spec.world_size;
  c->M = c->spec.grad_accum;
  c->WM = c->W * c->M; /* spec_validate bounds it by SPEC_MAX_CONTRIB */
  c->npieces = l->shard_pieces[c->shard_id];
  c->nelems = l->shard_elems[c->shard_id];
  c->bitmap_words = (c->WM + 63) / 64;
  /* A pipelined step applies each piece as it completes, before anyone
   * could decide to leave a rank out, so its membership stays fixed. */
  /* Under mu: the worker reads the membership state (core__members_deadline)
   * without state_rw. */
  pthread_mutex_lock(&c->mu);
  /* The job's own timeout (its creating Open's), else the server's flag;
   * a restore may then bring a recorded flag timeout (core__members_restore). */
  c->flag_timeout_ms = c->default_timeout_ms;
  c->trainer_timeout_ms = core_timeout_in_effect(c->open_timeout_ms, c->default_timeout_ms, 0);
  c->elastic =
      c->trainer_timeout_ms > 0 && !c->spec.pipelined && c->W <= CORE_ELASTIC_MAX_W ? 1 : 0;
  core__members_reset(c);
  c->member_epoch = c->member_leaves = c->member_timeouts = c->member_joins = 0;
  pthread_mutex_unlock(&c->mu);

  c->local_of = malloc(((size_t)l->num_pieces + 1) * sizeof *c->local_of);
  c->pieces = calloc((size_t)c->npieces + 1, sizeof *c->pieces);
  c->bitmaps = calloc((size_t)c->npieces * c->bitmap_words + 1, sizeof *c->bitmaps);
  c->low_crc = calloc((size_t)c->npieces + 1, sizeof *c->low_crc);
  c->q8_crc = calloc((size_t)c->npieces + 1, sizeof *c->q8_crc);
  if (!c->local_of || !c->pieces || !c->bitmaps || !c->low_crc || !c->q8_crc)
    return ZS_ENOMEM;
  uint64_t q8_bytes = 0;
  uint32_t n = 0;
  for (uint32_t i = 0; i < l->num_pieces; i++) {
    c->local_of[i] = UINT32_MAX;
    if (l->pieces[i].shard != c->shard_id)
      continue;
    if (n == c->npieces)
      return ZS_EINTERNAL; /* the layout contradicts its own counts */
    piece_state *ps = &c->pieces[n];
    if (pthread_mutex_init(&ps->mu, NULL) != 0)
      return ZS_ENOMEM;
    c->pieces_inited++;
    ps->lp = &l->pieces[i];
    ps->received = c->bitmaps + (size_t)n * c->bitmap_words;
    ps->q8_off = q8_bytes;
    q8_bytes += dtype_bytes(ZS_DTYPE_INT8_BLOCK, ps->lp->numel);
    c->local_of[i] = n++;
  }
  if (n != c->npieces)
    return ZS_EINTERNAL;

  c->ranges = l->ranges + l->range_first[c->shard_id];
  c->nranges = l->range_first[c->shard_id + 1] - l->range_first[c->shard_id];
  unsigned needs = 0;
  for (uint32_t r = 0; r < c->nranges; r++)
    needs |= optim_state_needs(&c->spec.groups[c->ranges[r].group]);
  int need_m = (needs & OPTIM_STATE_M) != 0, need_v = (needs & OPTIM_STATE_V) != 0;

  uint64_t b32 = c->nelems * sizeof(float);
  /* The spec comes from the network: refuse state that cannot fit in this
   * machine's memory instead of letting the kernel kill us while the arenas
   * are zeroed. */
  uint64_t need = b32 * (2u + (uint64_t)need_m + (uint64_t)need_v) + c->nelems * 2u;
  long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0 && need > (uint64_t)pages * (uint64_t)page_size) {
    LOG_ERROR("job_too_large", "shard=%u state_bytes=%" PRIu64 " memory_bytes=%" PRIu64,
              c->shard_id, need, (uint64_t)pages * (uint64_t)page_size);
    return ZS_ENOMEM;
  }
  c->master = core__arena_alloc(b32);
  c->acc = core__arena_alloc(b32);
  c->piece_pins = calloc((size_t)c->npieces + 1, sizeof *c->piece_pins);
  c->by_off = calloc((size_t)c->npieces + 1, sizeof *c->by_off);
  if (!c->piece_pins || !c->by_off)
    return ZS_ENOMEM;
  for (uint32_t i = 0; i < c->npieces; i++)
    c->by_off[i] = (struct core_piece_at){.off = c->pieces[i].lp->arena_off, .index = i};
  qsort(c->by_off, c->npieces, sizeof *c->by_off, core_piece_at_cmp);
  int low_rc = core__low_create(c);
  if (need_m)
    c->m = core__arena_alloc(b32);
  if (need_v)
    c->v = core__arena_alloc(b32);
  /* Not zeroed: read only where written (core_data.c, core__low_crc_set). */
  c->q8 = malloc((size_t)q8_bytes + 1);
  if (low_rc != 0 || !c->q8 ||
      (c->nelems > 0 && (!c->master || !c->acc || (need_m && !c->m) || (need_v && !c->v))))
    return ZS_ENOMEM;
  c->state_bytes = b32 * (2u + (uint64_t)need_m + (uint64_t)need_v) + c->nelems * 2u;

  c->range_m = calloc((size_t)c->nranges + 1, sizeof *c->range_m);
  c->range_v = calloc((size_t)c->nranges + 1, sizeof *c->range_v);
  if (!c->range_m || !c->range_v)
    return ZS_ENOMEM;
  for (uint32_t r = 0; r < c->nranges; r++) {
    unsigned uses = optim_state_needs(&c->spec.groups[c->ranges[r].group]);
    c->range_m[r] = (uses & OPTIM_STATE_M) ? c->m : NULL;
    c->range_v[r] = (uses & OPTIM_STATE_V) ? c->v : NULL;
  }

  c->nblocks = (size_t)((c->nelems + CORE_STATS_BLOCK - 1) / CORE_STATS_BLOCK);
  c->block_sums = calloc(c->nblocks + 1, sizeof *c->block_sums);
  c->block_nonfinite = calloc(c->nblocks + 1, sizeof *c->block_nonfinite);
  if (!c->block_sums || !c->block_nonfinite)
    return ZS_ENOMEM;
  /* The apply's lists (every pass, gated or pipelined, chunks each piece on
   * its own): at most one chunk more per piece than whole ranges would
   * take. */
  c->pipelined = c->spec.pipelined;
  c->ready = calloc((size_t)c->npieces + 1, sizeof *c->ready);
  c->batch = calloc((size_t)c->npieces + 1, sizeof *c->batch);
  c->ptasks = calloc((size_t)(c->nelems / CORE_APPLY_CHUNK) + c->npieces + 1, sizeof *c->ptasks);
  c->pplans = calloc((size_t)c->npieces + 1, sizeof *c->pplans);
  c->tensor_steps = calloc((size_t)c->spec.num_tensors + 1, sizeof *c->tensor_steps);
  if (!c->ready || !c->batch || !c->ptasks || !c->pplans || !c->tensor_steps)
    return ZS_ENOMEM;
  c->apply_glr = calloc((size_t)c->spec.num_groups + 1, sizeof *c->apply_glr);
  c->last_glr = calloc((size_t)c->spec.num_groups + 1, sizeof *c->last_glr);
  if (!c->apply_glr || !c->last_glr)
    return ZS_ENOMEM;
  c->apply_hp = calloc((size_t)CORE_NHP * c->spec.num_groups + 1, sizeof *c->apply_hp);
  c->last_hp = calloc((size_t)CORE_NHP * c->spec.num_groups + 1, sizeof *c->last_hp);
  if (!c->apply_hp || !c->last_hp)
    return ZS_ENOMEM;
  return 0;
}

/* Sets the statistics state of a fresh pending step (version + 1). A shard
 * that owns no piece never receives a contribution, so its statistics are
 * complete (and zero) from the start. Called with mu held. */
void core__begin_step(core *c) {
  c->complete_pieces = 0;
  memset(&c->stats, 0, sizeof c->stats);
  c->stats.step = c->version + 1;
  c->stats.members = c->stat_members; /* a shard without pieces answers at once */
  c->stats_phase = c->npieces == 0 ? STATS_READY : STATS_WAITING;
}

/* ---------------------------------------------------------------- lookups */

/* The checks every job request starts with. Called with state_rw or mu held. */
int core__check_job(const core *c, uint64_t hash, char *err, size_t errlen) {
  if (!c->open)
    return status_fail(err, errlen, ZS_ENOTOPEN, "no job is open on shard %u", c->shard_id);
  if (hash != c->hash)
    return status_fail(err, errlen, ZS_EHASH,
                       "spec_hash %016" PRIx64 " is not the hash of this shard's job (%016" PRIx64
                       ")",
                       hash, c->hash);
  return 0;
}

/* The answer to a request for `step` when the shard's state came from a
 * checkpoint and step is beyond version + 1: the requester trained past the
 * checkpoint this shard was restored to, and must restore the job to a common
 * checkpoint before going on. Also when step is the version itself and the
 * shard keeps no record of its statistics or apply (they are not part of a
 * loaded state): the requester missed that step's answers, which no member
 * can give it now. Called with state_rw or mu held. */
int core__behind(const core *c, const char *what, uint64_t step, char *err, size_t errlen) {
  if (step == c->version)
    return status_fail(err, errlen, ZS_EBEHIND,
                       "%s for step %" PRIu64 ", which shard %u holds applied but has no record of "
                       "(its state was loaded at that version: a replica's copy, a checkpoint, or "
                       "a backup that took over): a trainer that missed the step's answers cannot "
                       "finish it here; restore the job to a checkpoint (zs_restore, zshard "
                       "restore) to resume",
                       what, step, c->shard_id);
  if (c->ckpt_taken_over)
    return status_fail(err, errlen, ZS_EBEHIND,
                       "%s for step %" PRIu64 " but shard %u is at version %" PRIu64
                       ": this replica took over as primary without the steps after it (the "
                       "primary it replaced had acknowledged them); restore the job to a "
                       "checkpoint (zs_restore, zshard restore) to resume",
                       what, step, c->shard_id, c->version);
  return status_fail(err, errlen, ZS_EBEHIND,
                     "%s for step %" PRIu64 " but shard %u holds checkpoint step %" PRIu64
                     " (version %" PRIu64
                     "): it restarted or was restored behind the cluster; restore the job to a "
                     "checkpoint (zs_restore, zshard restore) to resume",
                     what, step, c->shard_id, c->ckpt_step, c->version);
}

/* ---------------------------------------------------------------- lifecycle */

int core_create(const core_config *cfg, core **out) {
  if (!cfg || !out || cfg->num_shards == 0 || cfg->num_shards > SPEC_MAX_SHARDS ||
      cfg->shard_id >= cfg->num_shards)
    return ZS_EINVAL;
  core *c = calloc(1, sizeof *c);
  if (!c)
    return ZS_ENOMEM;
  c->shard_id = cfg->shard_id;
  c->num_shards = cfg->num_shards;
  c->nthreads = cfg->threads;
  c->apply_hist = cfg->apply_hist;
  c->trainer_timeout_ms = c->default_timeout_ms = cfg->trainer_timeout_ms;
  if (c->nthreads <= 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    c->nthreads = n > 0 ? (int)(n < 256 ? n : 256) : 1;
  }
  c->next_deadline = UINT64_MAX;
  atomic_init(&c->pushes, 0);
  atomic_init(&c->duplicate_pushes, 0);
  atomic_init(&c->rejected, 0);
  atomic_init(&c->pulls, 0);
  atomic_init(&c->bytes_in, 0);
  atomic_init(&c->bytes_out, 0);
  atomic_init(&c->held_bytes, 0);
  atomic_init(&c->contributions, 0);
  atomic_init(&c->low_dtype, 0);
  atomic_init(&c->low_overtaken, 0);
  atomic_init(&c->q8_wanted, 0);

  int rc = ZS_ENOMEM;
  if (pthread_mutex_init(&c->mu, NULL) != 0)
    goto fail;
  c->mu_inited = 1;
  if (pthread_mutex_init(&c->low_mu, NULL) != 0)
    goto fail;
  c->low_mu_inited = 1;
  if (pthread_mutex_init(&c->held_mu, NULL) != 0)
    goto fail;
  c->held_mu_inited = 1;
  /* Deadlines are CLOCK_MONOTONIC milliseconds, so the worker's timed wait
   * must measure the same clock. */
  pthread_condattr_t ca;
  if (pthread_condattr_init(&ca) != 0)
    goto fail;
  int cerr = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  if (cerr == 0)
    cerr = pthread_cond_init(&c->worker_cv, &ca);
  pthread_condattr_destroy(&ca);
  if (cerr != 0)
    goto fail;
  c->cv_inited = 1;
  /* Writer preference: a steady stream of pulls must not starve the apply. */
  pthread_rwlockattr_t ra;
  if (pthread_rwlockattr_init(&ra) != 0)
    goto fail;
  int rerr = pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  if (rerr == 0)
    rerr = pthread_rwlock_init(&c->state_rw, &ra);
  pthread_rwlockattr_destroy(&ra);
  if (rerr != 0)
    goto fail;
  c->rw_inited = 1;
  if ((rc = pool_create(c->nthreads, &c->pool)) != 0)
    goto fail;
  rc = ZS_ENOMEM;
  if (pthread_create(&c->worker, NULL, core__worker, c) != 0)
    goto fail;
  c->worker_started = 1;
  *out = c;
  return 0;

fail:
  core_destroy(c);
  return rc;
}

void core_destroy(core *c) {
  if (!c)
    return;
  if (c->worker_started) {
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_signal(&c->worker_cv);
    pthread_mutex_unlock(&c->mu);
    /* The worker finishes the statistics or apply it is running (firing their
     * callbacks) and starts nothing new. */
    pthread_join(c->worker, NULL);
  }
  /* No core thread is left: whatever still waits fails with ZS_ECLOSED. */
  waiter *fire = NULL;
  waiter **lists[4] = {&c->version_waiters, &c->stats_waiters, &c->apply_waiters,
                       &c->snapshot_waiters};
  for (int i = 0; i < 4; i++) {
    while (*lists[i]) {
      waiter *w = *lists[i];
      core__unlink(c, w);
      w->status = ZS_ECLOSED;
      w->version = c->version;
      w->stats.step = w->key;
      w->apply.step = w->key;
      w->apply.version = c->version;
      w->apply.optimizer_steps = c->optimizer_steps;
      waiter_push(&fire, w);
    }
  }
  core__fire(fire);
  if (c->close_call) {
    ckpt_call *call = c->close_call;
    c->close_call = NULL;
    pthread_mutex_lock(&call->mu);
    call->status = ZS_ECLOSED;
    call->done = 1;
    pthread_cond_signal(&call->cv);
    pthread_mutex_unlock(&call->mu);
  }
  if (c->restore_call) {
    ckpt_call *call = c->restore_call;
    c->restore_call = NULL;
    pthread_mutex_lock(&call->mu);
    call->status = ZS_ECLOSED;
    call->done = 1;
    pthread_cond_signal(&call->cv);
    pthread_mutex_unlock(&call->mu);
  }
  pool_destroy(c->pool);
  core_job_free(c);
  /* The transports stopped before the core, so no answer is still pinned;
   * whatever a close or a writer retired goes now. */
  while (c->low_retired) {
    low_buf *b = c->low_retired;
    c->low_retired = b->next;
    free(b->data);
    free(b);
  }
  free(c->by_arg);
  free(c->mlog);
  core__held_drain(c);
  if (c->held_mu_inited)
    pthread_mutex_destroy(&c->held_mu);
  if (c->low_mu_inited)
    pthread_mutex_destroy(&c->low_mu);
  if (c->rw_inited)
    pthread_rwlock_destroy(&c->state_rw);
  if (c->cv_inited)
    pthread_cond_destroy(&c->worker_cv);
  if (c->mu_inited)
    pthread_mutex_destroy(&c->mu);
  free(c);
}

int core_open(core *c, const spec *s, core_open_result *out, char *err, size_t errlen) {
  return core_open_ex(c, s, CORE_OPEN_EITHER, out, err, errlen);
}

int core_open_ex(core *c, const spec *s, int mode, core_open_result *out, char *err,
                 size_t errlen) {
  return core_open_job(c, s, mode, 0, out, err, errlen);
}

int core_open_job(core *c, const spec *s, int mode, uint32_t trainer_timeout_ms,
                  core_open_result *out, char *err, size_t errlen) {
  if (!s)
    return status_fail(err, errlen, ZS_EINVAL, "no spec given");
  if (s->num_shards != c->num_shards)
    return status_fail(err, errlen, ZS_EINVAL,
                       "the spec is for %u shards but this is shard %u of %u", s->num_shards,
                       c->shard_id, c->num_shards);
  uint64_t hash = spec_hash(s);
  int rc = 0, created = 0;
  pthread_rwlock_wrlock(&c->state_rw);
  if (c->open) {
    if (hash != c->hash && mode == CORE_OPEN_CREATE)
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "cannot create the job: shard %u already has job '%s' (spec hash %016" PRIx64
                       ", version %" PRIu64 "); close it first (zshard close-job, zs_close_job)",
                       c->shard_id, c->spec.job, c->hash, c->version);
    else if (hash != c->hash)
      rc = status_fail(err, errlen, ZS_EHASH,
                       "shard %u already has job '%s' with spec hash %016" PRIx64
                       "; the request's spec hash is %016" PRIx64,
                       c->shard_id, c->spec.job, c->hash, hash);
    else if (mode == CORE_OPEN_CREATE && c->version > 0)
      /* A new run of the same model: without this it would resume the old
       * run's weights and ignore its own initial ones. */
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "cannot create the job: shard %u already trained job '%s' (spec hash "
                       "%016" PRIx64 ") to version %" PRIu64
                       "; resume it (open mode resume) or close it first (zshard close-job, "
                       "zs_close_job)",
                       c->shard_id, c->spec.job, c->hash, c->version);
    goto done;
  }
  if (mode == CORE_OPEN_RESUME) {
    rc = status_fail(err, errlen, ZS_ENOTOPEN,
                     "cannot resume: shard %u has no job (it was closed, or never opened, or the "
                     "shard restarted without a checkpoint)",
                     c->shard_id);
    goto done;
  }
  if (c->stale_job) {
    /* A closed job's description, kept for the readers of core_spec until
     * now. */
    layout_free(&c->layout);
    spec_free(&c->spec);
    c->stale_job = 0;
  }
  if (spec_copy(&c->spec, s) != 0) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory copying the spec");
    goto done;
  }
  c->open_timeout_ms = trainer_timeout_ms;
  if ((rc = core_job_build(c)) != 0) {
    core_job_free(c);
    rc = status_fail(err, errlen, rc, "cannot build the job's state on shard %u: %s", c->shard_id,
                     zs_strerror(rc));
    goto done;
  }
  created = 1;
  pthread_mutex_lock(&c->mu);
  c->hash = hash;
  c->version = 0;
  c->open = 1;
  atomic_store(&c->low_dtype, (int)c->spec.param_dtype);
  core__begin_step(c);
  if (c->npieces == 0)
    c->version_event = 1; /* nothing to initialise: pulls may proceed */
  pthread_cond_signal(&c->worker_cv);
  pthread_mutex_unlock(&c->mu);
  /* The transport logs the job's (sanitised) name; this line says what the
   * job costs this shard. */
  LOG_INFO("job_state",
           "shard=%u hash=%016" PRIx64 " pieces=%u elements=%" PRIu64 " state_bytes=%" PRIu64,
           c->shard_id, hash, c->npieces, c->layout.shard_load[c->shard_id], c->state_bytes);
done:
  if (rc == 0 && out) {
    pthread_mutex_lock(&c->mu);
    out->spec_hash = c->hash;
    out->version = c->version;
    out->created = created;
    out->initialized = c->initialized_pieces == c->npieces;
    out->world_size = c->W;
    pthread_mutex_unlock(&c->mu);
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

/* ---------------------------------------------------------------- client state */

int core_set_apply_client_state(core *c, uint64_t hash, uint64_t step, const void *data, size_t len,
                                char *err, size_t errlen) {
  if (len > CORE_MAX_CLIENT_STATE)
    return status_fail(err, errlen, ZS_ESIZE,
                       "client_state of step %" PRIu64
                       " has %zu bytes, more than the %u a shard keeps; nothing changed",
                       step, len, CORE_MAX_CLIENT_STATE);
  if (len > 0 && !data)
    return status_fail(err, errlen, ZS_EINVAL, "no client state given");
  pthread_mutex_lock(&c->mu);
  int rc = core__check_job(c, hash, err, errlen);
  /* Once the step's apply is queued, its blob is the one recorded; what a
   * repeat carries is not looked at (every trainer sends the same). */
  if (rc == 0 && step == c->version + 1 && c->apply_state == APPLY_NONE) {
    if (len > 0)
      memcpy(c->pending_cs, data, len);
    c->pending_cs_len = len;
    c->pending_cs_step = step;
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

size_t core_get_client_state(core *c, void *buf, size_t cap, uint64_t *version) {
  pthread_mutex_lock(&c->mu);
  size_t len = c->client_state_len < cap ? c->client_state_len : cap;
  if (len > 0)
    memcpy(buf, c->client_state, len);
  if (version)
    *version = c->version;
  pthread_mutex_unlock(&c->mu);
  return len;
}

/* ---------------------------------------------------------------- info */

void core_get_info(core *c, core_info *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->mu);
  out->shard_id = c->shard_id;
  out->num_shards = c->num_shards;
  out->has_job = c->open;
  if (c->open) {
    snprintf(out->job, sizeof out->job, "%s", c->spec.job ? c->spec.job : "");
    out->spec_hash = c->hash;
    out->version = c->version;
    out->state_bytes = c->state_bytes;
    out->pieces = c->npieces;
    out->elements = c->layout.shard_load[c->shard_id];
    out->initialized = c->initialized_pieces == c->npieces;
    out->optimizer_steps = c->optimizer_steps;
  }
  pthread_mutex_unlock(&c->mu);
}

void core_get_counters(core *c, core_counters *out) {
  memset(out, 0, sizeof *out);
  out->pushes = atomic_load_explicit(&c->pushes, memory_order_relaxed);
  out->duplicate_pushes = atomic_load_explicit(&c->duplicate_pushes, memory_order_relaxed);
  out->rejected = atomic_load_explicit(&c->rejected, memory_order_relaxed);
  out->pulls = atomic_load_explicit(&c->pulls, memory_order_relaxed);
  out->bytes_in = atomic_load_explicit(&c->bytes_in, memory_order_relaxed);
  out->bytes_out = atomic_load_explicit(&c->bytes_out, memory_order_relaxed);
  out->held_bytes = atomic_load_explicit(&c->held_bytes, memory_order_relaxed);
  pthread_mutex_lock(&c->held_mu);
  out->held_cached_bytes = c->held_cache_bytes;
  out->held_reused = c->held_reused;
  pthread_mutex_unlock(&c->held_mu);
  pthread_mutex_lock(&c->mu);
  out->applies = c->applies;
  out->skipped_steps = c->skipped_steps;
  out->version = c->version;
  out->apply_seconds_total = c->apply_seconds_total;
  /* The lists are short (one entry per waiting call), so counting them on
   * demand is cheaper than keeping counts in step on every path. */
  for (const waiter *w = c->version_waiters; w; w = w->next)
    out->waiting_pulls++;
  for (const waiter *w = c->stats_waiters; w; w = w->next)
    out->waiting_stats++;
  pthread_mutex_unlock(&c->mu);
}

void core_count_pull(core *c, uint64_t bytes_out) {
  atomic_fetch_add_explicit(&c->pulls, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&c->bytes_out, bytes_out, memory_order_relaxed);
}

const spec *core_spec(core *c) {
  pthread_mutex_lock(&c->mu);
  const spec *s = c->open ? &c->spec : NULL;
  pthread_mutex_unlock(&c->mu);
  return s;
}

int core_spec_copy(core *c, spec *out, uint64_t *hash) {
  /* open is cleared under mu before a close touches the spec, and set under
   * mu only after an open has built the new one: under mu with open set, the
   * spec is whole and stays so until we let go. */
  int rc = 0;
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->mu);
  if (!c->open)
    rc = ZS_ENOTOPEN;
  else if (spec_copy(out, &c->spec) != 0)
    rc = ZS_ENOMEM;
  else if (hash)
    *hash = c->hash;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int core_job_named(core *c, uint64_t hash, const char *name) {
  pthread_mutex_lock(&c->mu);
  int yes = c->open && c->hash == hash && c->spec.job && name && strcmp(c->spec.job, name) == 0;
  pthread_mutex_unlock(&c->mu);
  return yes;
}

const layout *core_layout(core *c) {
  pthread_mutex_lock(&c->mu);
  const layout *l = c->open ? &c->layout : NULL;
  pthread_mutex_unlock(&c->mu);
  return l;
}

/* ---------------------------------------------------------------- closing a job */

/* What a core_close call asks, on its caller's stack (ckpt_call.fn_arg). */
typedef struct close_req {
  uint64_t hash;   /* 0: any */
  const char *job; /* NULL or "": any */
  core_close_result *out;
  char *err;
  size_t errlen;
} close_req;

/* Fails every waiter of the job with ZS_ENOTOPEN: the job they wait on is
 * gone, and a status that no client retries says so. A snapshot waiting for
 * its version is one of them: none runs while the worker runs the close, so
 * a checkpoint still waiting (for a step that may never come) does not hold
 * the close back. Called with mu held. */
static void core_fail_job_waiters(core *c, waiter **fire) {
  waiter **lists[4] = {&c->version_waiters, &c->stats_waiters, &c->apply_waiters,
                       &c->snapshot_waiters};
  for (int i = 0; i < 4; i++) {
    while (*lists[i]) {
      waiter *w = *lists[i];
      core__unlink(c, w);
      w->status = ZS_ENOTOPEN;
      w->version = c->version;
      w->stats.step = w->key;
      w->apply = (core_apply_result){.step = w->key, .version = c->version};
      waiter_push(fire, w);
    }
  }
}

/* Frees the job's state and empties the shard. Runs on the worker, so no
 * statistics pass, apply, snapshot or restore is in progress; no lock held. */
void core__run_close(core *c, ckpt_call *call) {
  close_req *q = call->fn_arg;
  waiter *fire = NULL;
  int rc = 0;
  pthread_rwlock_wrlock(&c->state_rw);
  pthread_mutex_lock(&c->mu);
  memset(q->out, 0, sizeof *q->out);
  if (!c->open) {
    pthread_mutex_unlock(&c->mu);
    goto done; /* nothing to close: closed = 0 */
  }
  if (q->hash != 0 && q->hash != c->hash)
    rc = status_fail(q->err, q->errlen, ZS_EHASH,
                     "shard %u holds job '%s' with spec hash %016" PRIx64 ", not %016" PRIx64
                     "; nothing was closed",
                     c->shard_id, c->spec.job, c->hash, q->hash);
  else if (q->job && q->job[0] && strcmp(q->job, c->spec.job) != 0)
    rc = status_fail(q->err, q->errlen, ZS_ENOTFOUND,
                     "shard %u holds job '%s', not '%s'; nothing was closed", c->shard_id,
                     c->spec.job, q->job);
  else if (c->restore_call)
    rc = status_fail(q->err, q->errlen, ZS_ENOTREADY,
                     "a restore of job '%s' is in progress on shard %u; close it once that is done",
                     c->spec.job, c->shard_id);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    goto done;
  /* Pull answers still being sent from the low arena keep their buffer:
   * core_job_free retires it until the last one is released. */

  pthread_mutex_lock(&c->mu);
  q->out->closed = 1;
  snprintf(q->out->job, sizeof q->out->job, "%s", c->spec.job ? c->spec.job : "");
  q->out->spec_hash = c->hash;
  q->out->version = c->version;
  q->out->state_bytes = c->state_bytes;
  core_fail_job_waiters(c, &fire);
  c->open = 0;
  atomic_store(&c->low_dtype, 0);
  atomic_store(&c->q8_wanted, 0);
  c->hash = 0;
  c->version = 0;
  c->optimizer_steps = 0;
  c->initialized_pieces = 0;
  c->complete_pieces = 0;
  c->stats_phase = STATS_WAITING;
  memset(&c->stats, 0, sizeof c->stats);
  c->last_stats_valid = 0;
  c->last_apply_valid = 0;
  c->apply_state = APPLY_NONE;
  c->client_state_len = 0;
  c->pending_cs_len = 0;
  c->pending_cs_step = 0;
  c->ckpt_loaded = 0;
  c->ckpt_step = 0;
  c->ckpt_untouched = 0;
  c->ckpt_taken_over = 0;
  c->version_event = 0;
  c->state_bytes = 0;
  pthread_mutex_unlock(&c->mu);
  /* Everything but the description is freed now; the description stays
   * (stale_job) so that a core_spec pointer or a tensor name a reader took
   * before the close remains readable until the next job is opened. */
  spec sp = c->spec;
  layout l = c->layout;
  memset(&c->spec, 0, sizeof c->spec);
  memset(&c->layout, 0, sizeof c->layout);
  core_job_free(c);
  c->spec = sp;
  c->layout = l;
  c->stale_job = 1;
  atomic_store_explicit(&c->contributions, 0, memory_order_relaxed);
  atomic_store_explicit(&c->held_bytes, 0, memory_order_relaxed);
done:
  pthread_rwlock_unlock(&c->state_rw);
  if (q->out->closed)
    LOG_INFO("job_closed", "shard=%u hash=%016" PRIx64 " version=%" PRIu64 " freed_bytes=%" PRIu64,
             c->shard_id, q->out->spec_hash, q->out->version, q->out->state_bytes);
  core__fire(fire);
  core__ckpt_call_finish(call, rc);
}

int core_close(core *c, uint64_t hash, const char *job, core_close_result *out, char *err,
               size_t errlen) {
  core_close_result own;
  close_req q = {.hash = hash, .job = job, .out = out ? out : &own, .err = err, .errlen = errlen};
  ckpt_call call;
  core__ckpt_call_init(&call);
  call.fn_arg = &q;
  int rc = 0;
  pthread_mutex_lock(&c->mu);
  if (c->stop)
    rc = status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down");
  else if (c->close_call)
    rc = status_fail(err, errlen, ZS_ENOTREADY, "another close is in progress on shard %u",
                     c->shard_id);
  if (rc == 0) {
    c->close_call = &call;
    pthread_cond_signal(&c->worker_cv);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc == 0) {
    rc = core__ckpt_call_wait(&call);
    if (rc == ZS_ECLOSED)
      status_fail(err, errlen, rc, "close on shard %u: the shard is shutting down", c->shard_id);
  }
  core__ckpt_call_destroy(&call);
  return rc;
}
