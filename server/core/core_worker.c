/*
 * core_worker — the core's worker thread and the work it runs: the expiry of
 * waiters, a step's gradient statistics, the optimizer pass of a gated step
 * (whole ranges) and of a pipelined one (piece by piece, with the CRCs of
 * the low copy joined from their chunks), and the end of a step: the
 * counters, the hook and the waiters it releases (see core.h for the
 * contract; threads and locks: the top of core.c). The Apply that queues a
 * step is core_apply.c.
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/log.h"
#include "common/base/trace.h"

/* ---------------------------------------------------------------- worker */

/* Moves every expired waiter to the fire list with ZS_ETIMEDOUT and returns
 * the earliest deadline still pending. Called with mu held. */
static uint64_t core_collect_expired(core *c, uint64_t now, waiter **fire) {
  uint64_t next = UINT64_MAX;
  waiter **lists[3] = {&c->version_waiters, &c->stats_waiters, &c->snapshot_waiters};
  for (int i = 0; i < 3; i++) {
    for (waiter **pw = lists[i]; *pw;) {
      waiter *w = *pw;
      if (w->deadline <= now) {
        core__unlink(c, w);
        w->status = ZS_ETIMEDOUT;
        w->version = c->version;
        w->stats.step = w->key;
        waiter_push(fire, w);
      } else {
        if (w->deadline < next)
          next = w->deadline;
        pw = &w->next;
      }
    }
  }
  return next;
}

static void core_stats_block(void *arg, size_t b) {
  core *c = arg;
  uint64_t begin = (uint64_t)b * CORE_STATS_BLOCK;
  uint64_t n = c->nelems - begin < CORE_STATS_BLOCK ? c->nelems - begin : CORE_STATS_BLOCK;
  int nf = 0;
  c->block_sums[b] = optim_sum_squares(c->acc + begin, (size_t)n, &nf);
  c->block_nonfinite[b] = nf;
}

/* Computes the pending step's statistics and fires its stats waiters. The
 * blocks may run on any thread; they are added in block order, so the sum
 * does not depend on the thread count. Called on the worker, no lock held. */
static void core_compute_stats(core *c) {
  pthread_rwlock_rdlock(&c->state_rw);
  /* stat_members does not change while the phase is COMPUTING. */
  if (c->elastic)
    core__members_sum(c);
  pool_run(c->pool, c->nblocks, core_stats_block, c);
  double sum = 0.0;
  int nonfinite = 0;
  for (size_t b = 0; b < c->nblocks; b++) {
    sum += c->block_sums[b];
    nonfinite |= c->block_nonfinite[b];
  }
  pthread_rwlock_unlock(&c->state_rw);

  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
  c->stats.step = c->version + 1;
  c->stats.sum_squares = sum;
  c->stats.nonfinite = nonfinite;
  c->stats.members = c->stat_members;
  c->stats_phase = STATS_READY;
  core_members narrow;
  int narrowing = 0;
  for (waiter **pw = &c->stats_waiters; *pw;) {
    waiter *w = *pw;
    if (w->has_want && !core_members_equal(&w->want, &c->stat_members)) {
      /* The second round of the agreement asks for fewer ranks: the first
       * such set is summed next (every honest trainer asks for the same);
       * a set with a rank this shard lacks is refused. */
      if (core__members_subset(&w->want, &c->stat_members)) {
        if (!narrowing)
          narrow = w->want;
        narrowing = 1;
        pw = &w->next;
        continue;
      }
      core__unlink(c, w);
      w->status = ZS_EINVAL;
      w->stats = c->stats;
      waiter_push(&fire, w);
      continue;
    }
    core__unlink(c, w);
    w->status = ZS_OK;
    w->stats = c->stats;
    waiter_push(&fire, w);
  }
  if (narrowing)
    core__members_narrow(c, &narrow);
  pthread_mutex_unlock(&c->mu);
  core__fire(fire);
}

static void core_batch_partition(core *c) {
  uint32_t w = 0;
  for (uint32_t b = 0; b < c->nbatch; b++) {
    if (c->pieces[c->batch[b]].has_grad) {
      uint32_t t = c->batch[w];
      c->batch[w++] = c->batch[b];
      c->batch[b] = t;
    }
  }
  c->nwork = w;
}

/* What finishing a step leaves for after the locks: the hook to tell. */
typedef struct step_done {
  core_applied_fn applied;
  void *applied_arg;
  core_apply_result result;
} step_done;

/* The step `step` is applied on every piece (or skipped): resets the pieces'
 * step state, advances the version, records the outcome and collects the
 * apply and version waiters. Called on the worker with state_rw exclusive
 * and mu held. */
static void core_finish_step(core *c, uint64_t step, int skip, uint64_t opt_steps, double seconds,
                             waiter **fire, step_done *done) {
  /* An elastic job kept every contribution and goes on with the ranks the
   * step was applied with. */
  if (c->elastic)
    core__members_next_step(c);
  /* Every piece completed the step, so nothing else is held: only the
   * bitmaps and next_k need resetting. No push runs while state_rw is held
   * exclusively. */
  for (uint32_t i = 0; i < c->npieces; i++) {
    c->pieces[i].next_k = 0;
    c->pieces[i].one_before_zero = 0;
    c->pieces[i].ahead = 0;
  }
  c->nahead = 0;
  if (c->npieces > 0)
    memset(c->bitmaps, 0, (size_t)c->npieces * c->bitmap_words * sizeof *c->bitmaps);
  atomic_store_explicit(&c->contributions, 0, memory_order_relaxed);
  /* A tensor's count advances with the steps that gave it a gradient; its
   * pieces on this shard are next to each other ((tensor, slice) order). */
  uint32_t counted = UINT32_MAX;
  for (uint32_t i = 0; i < c->npieces; i++) {
    uint32_t t = c->pieces[i].lp->tensor;
    if (!skip && c->pieces[i].has_grad && t != counted) {
      c->tensor_steps[t]++;
      counted = t;
    }
    c->pieces[i].has_grad = 0;
  }
  histogram_observe_seconds(c->apply_hist, seconds);
  c->version = step;
  c->optimizer_steps = opt_steps;
  /* The pending client state cannot change once the apply is queued, so the
   * one read here is the one recorded for this step, if any. */
  if (c->pending_cs_step == step && c->pending_cs_len > 0) {
    memcpy(c->client_state, c->pending_cs, c->pending_cs_len);
    c->client_state_len = c->pending_cs_len;
  }
  c->pending_cs_step = 0;
  c->pending_cs_len = 0;
  c->ckpt_untouched = 0;
  c->applies++;
  if (skip)
    c->skipped_steps++;
  c->apply_seconds_total += seconds;
  c->last_stats = c->stats;
  c->last_stats_valid = !c->pipelined; /* a pipelined step has no statistics */
  c->last_apply_valid = 1;
  c->last_lr = c->apply_lr;
  c->last_coef = c->apply_coef;
  c->last_skip = skip;
  c->last_nglr = c->apply_nglr;
  if (c->apply_nglr)
    memcpy(c->last_glr, c->apply_glr, c->apply_nglr * sizeof *c->last_glr);
  c->last_hp_mask = c->apply_hp_mask;
  memcpy(c->last_hp, c->apply_hp, (size_t)CORE_NHP * c->spec.num_groups * sizeof *c->last_hp);
  c->last_apply = (core_apply_result){.step = step,
                                      .version = step,
                                      .skipped = skip,
                                      .optimizer_steps = opt_steps,
                                      .apply_ns = (uint64_t)(seconds * 1e9)};
  c->apply_state = APPLY_NONE;
  core__begin_step(c);
  while (c->apply_waiters) {
    waiter *w = c->apply_waiters;
    core__unlink(c, w);
    w->status = ZS_OK;
    w->apply = c->last_apply;
    waiter_push(fire, w);
  }
  core__collect_versions(c, fire);
  done->applied = c->applied_fn;
  done->applied_arg = c->applied_arg;
  done->result = c->last_apply;
}

/* After the locks: the hook, then the callbacks. Called on the worker. */
static void core_step_tell(core *c, const step_done *done, waiter *fire) {
  LOG_DEBUG("apply", "shard=%u step=%" PRIu64 " skipped=%d", c->shard_id, done->result.step,
            done->result.skipped);
  /* Before the callbacks: whoever hangs on the hook hears of the step no
   * later than the trainers whose Apply it answers. */
  if (done->applied)
    done->applied(done->applied_arg, &done->result);
  core__fire(fire);
}

static void core_pass_pieces(core *c, double lr, float coef, const double *glr);

/* Runs the queued apply, advances the version and fires the apply and version
 * waiters. Called on the worker, no lock held. */
static void core_run_apply(core *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t step = c->version + 1;
  double lr = c->apply_lr;
  float coef = c->apply_coef;
  int skip = c->apply_skip;
  /* apply_glr does not change while the apply is queued or running. */
  const double *glr = c->apply_nglr ? c->apply_glr : NULL;
  uint64_t opt_steps = c->optimizer_steps + (skip ? 0u : 1u);
  c->apply_state = APPLY_RUNNING;
  pthread_mutex_unlock(&c->mu);

  pthread_rwlock_wrlock(&c->state_rw);
  uint64_t t0 = clock_now_ns();
  if (skip) {
    /* The weights, moments and low copy stay as they are; only this step's
     * gradient is dropped. */
    if (c->nelems > 0)
      memset(c->acc, 0, (size_t)c->nelems * sizeof(float));
  } else {
    /* The pass over pieces, each with its tensor's plan (its group's, at
     * its step count), skipping the pieces without a gradient. */
    for (uint32_t i = 0; i < c->npieces; i++)
      c->batch[i] = i;
    c->nbatch = c->npieces;
    core_batch_partition(c);
    core_pass_pieces(c, lr, coef, glr);
    c->nbatch = 0;
  }
  double seconds = (double)(clock_now_ns() - t0) / 1e9;

  waiter *fire = NULL;
  step_done done;
  pthread_mutex_lock(&c->mu);
  core_finish_step(c, step, skip, opt_steps, seconds, &fire, &done);
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
  core_step_tell(c, &done, fire);
}

/* ------------------------------------------------------- the pipelined step */

/* One chunk: the optimizer, then the CRC32C of the low copy it just wrote
 * (2 bytes per element, still in this core's cache: a separate pass over
 * the pieces read them back from memory, 13 % of the kernel's CPU time on
 * the benchmark VM, docs/PERFORMANCE.md "Small calls"). */
static void core_apply_piece_chunk(void *arg, size_t i) {
  core *c = arg;
  apply_task *t = &c->ptasks[i];
  float *m = c->range_m[t->range] ? c->range_m[t->range] + t->begin : NULL;
  float *v = c->range_v[t->range] ? c->range_v[t->range] + t->begin : NULL;
  optim_apply(&c->pplans[t->plan], c->master + t->begin, m, v, c->acc + t->begin, c->low + t->begin,
              (size_t)t->n);
  t->crc = crc32c(0, c->low + t->begin, (size_t)t->n * sizeof(uint16_t));
}

/* The CRC of the b-th piece of the batch from its chunks' (core_batch_tasks
 * lists them in batch order, each piece's from its start), then its int8
 * copy if wanted (core__low_crc_set). Called by the pool, one piece each. */
static void core_join_crcs(void *arg, size_t b) {
  core *c = arg;
  size_t lo = 0, hi = c->npass_tasks; /* the first task of plan >= b */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (c->ptasks[mid].plan < b)
      lo = mid + 1;
    else
      hi = mid;
  }
  uint32_t crc = crc32c(0, NULL, 0); /* a piece of no element has no task */
  for (size_t k = lo; k < c->npass_tasks && c->ptasks[k].plan == b; k++)
    crc = k == lo
              ? c->ptasks[k].crc
              : crc32c_combine(crc, c->ptasks[k].crc, (size_t)c->ptasks[k].n * sizeof(uint16_t));
  core__low_crc_set(c, c->batch[b], crc);
}

/* The range (of this shard's, one per param group) that holds piece i. */
static uint32_t core_piece_range(const core *c, uint32_t i) {
  const layout_piece *lp = c->pieces[i].lp;
  uint32_t r = 0;
  while (r + 1 < c->nranges &&
         !(lp->arena_off >= c->ranges[r].begin && lp->arena_off < c->ranges[r].end))
    r++;
  return r;
}

/* Splits the batch's pieces into chunks of at most CORE_APPLY_CHUNK
 * elements, each from its piece's start (a multiple of 16 elements, so
 * 64-byte aligned). The kernel is elementwise, so the chunking changes no
 * bit (the test of the pipelined step compares). Returns the task count. */
static size_t core_batch_tasks(core *c) {
  size_t n = 0;
  for (uint32_t b = 0; b < c->nbatch; b++) {
    const layout_piece *lp = c->pieces[c->batch[b]].lp;
    uint32_t r = core_piece_range(c, c->batch[b]);
    for (uint64_t e = 0; e < lp->numel; e += CORE_APPLY_CHUNK) {
      uint64_t len = lp->numel - e < CORE_APPLY_CHUNK ? lp->numel - e : CORE_APPLY_CHUNK;
      c->ptasks[n++] = (apply_task){.range = r, .plan = b, .begin = lp->arena_off + e, .n = len};
    }
  }
  return n;
}

/* The plan of every piece of the batch: its group's, at its tensor's next
 * step. Consecutive pieces of one group at one count share the values, so
 * the plan is copied rather than computed again. */
static void core_build_piece_plans(core *c, double lr, float coef, const double *glr) {
  float grad_scale = core__grad_scale(c, coef);
  for (uint32_t b = 0; b < c->nbatch; b++) {
    uint32_t t = c->pieces[c->batch[b]].lp->tensor, g = c->spec.tensors[t].group;
    if (b > 0) {
      uint32_t pt = c->pieces[c->batch[b - 1]].lp->tensor;
      if (c->spec.tensors[pt].group == g && c->tensor_steps[pt] == c->tensor_steps[t]) {
        c->pplans[b] = c->pplans[b - 1];
        continue;
      }
    }
    optim_params p = core__step_params(c, g, lr, glr, c->tensor_steps[t] + 1, grad_scale);
    optim_plan_init(&c->pplans[b], &p);
  }
}

/* The optimizer over the first c->nwork pieces of c->batch, each with its
 * tensor's plan; the rest of the batch (no gradient) is left as it is:
 * weights, moments and low copy. Called on the worker with state_rw
 * exclusive. */
static void core_pass_pieces(core *c, double lr, float coef, const double *glr) {
  if (c->nwork == 0)
    return;
  uint32_t all = c->nbatch;
  c->nbatch = c->nwork;
  core_build_piece_plans(c, lr, coef, glr);
  core__low_batch_writable(c);
  c->npass_tasks = core_batch_tasks(c);
  pool_run(c->pool, c->npass_tasks, core_apply_piece_chunk, c);
  pool_run(c->pool, c->nbatch, core_join_crcs, c);
  c->nbatch = all;
}

/* A pipelined job's apply, piece by piece: runs the optimizer over the pieces
 * that completed since the last pass (with the lr of the step's Apply), makes
 * them readable at version + 1 at once, and finishes the step once every
 * piece is applied. The same kernel and plans as core_run_apply, over the
 * same accumulator, so the bits are the gated step's with coef 1. Called on
 * the worker, no lock held. */
static void core_run_pieces(core *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t step = c->version + 1;
  double lr = c->apply_lr;
  float coef = c->apply_coef;
  const double *glr = c->apply_nglr ? c->apply_glr : NULL;
  uint64_t opt_steps = c->optimizer_steps + 1u;
  memcpy(c->batch, c->ready, (size_t)c->nready * sizeof *c->batch);
  c->nbatch = c->nready;
  c->nready = 0;
  pthread_mutex_unlock(&c->mu);

  pthread_rwlock_wrlock(&c->state_rw);
  uint64_t t0 = clock_now_ns();
  core_batch_partition(c);
  core_pass_pieces(c, lr, coef, glr);
  c->pipe_seconds += (double)(clock_now_ns() - t0) / 1e9;

  waiter *fire = NULL;
  step_done done = {0};
  pthread_mutex_lock(&c->mu);
  for (uint32_t b = 0; b < c->nbatch; b++) {
    piece_state *ps = &c->pieces[c->batch[b]];
    ps->ahead = 1;
    trace_ev(TRACE_APPLIED, step, ps->lp->tensor, ps->lp->slice, 0);
  }
  c->nahead += c->nbatch;
  int finished = c->nahead == c->npieces;
  if (finished) {
    core_finish_step(c, step, 0, opt_steps, c->pipe_seconds, &fire, &done);
    c->pipe_seconds = 0;
  } else {
    core__collect_versions(c, &fire); /* the pulls of the pieces just applied */
  }
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
  if (finished)
    core_step_tell(c, &done, fire);
  else
    core__fire(fire);
}

void *core__worker(void *arg) {
  core *c = arg;
  pthread_mutex_lock(&c->mu);
  while (!c->stop) {
    waiter *fire = NULL;
    uint64_t now = clock_now_ms();
    uint64_t next = core_collect_expired(c, now, &fire);
    uint64_t member_deadline = core__members_deadline(c);
    if (member_deadline <= now) {
      pthread_mutex_unlock(&c->mu);
      core__fire(fire);
      core__members_timeout(c);
      pthread_mutex_lock(&c->mu);
      continue;
    }
    if (member_deadline < next)
      next = member_deadline;
    if (c->version_event) {
      c->version_event = 0;
      core__collect_versions(c, &fire);
    }
    int do_stats = c->stats_phase == STATS_COMPUTING;
    /* A restore, then snapshots of the current version, go before the next
     * apply: a snapshot asked for version v must see v, not v + 1. */
    /* A close goes first: it refuses while a restore or snapshot is pending. */
    ckpt_call *close = do_stats ? NULL : c->close_call;
    if (close) {
      c->close_call = NULL;
      pthread_mutex_unlock(&c->mu);
      core__fire(fire);
      core__run_close(c, close);
      pthread_mutex_lock(&c->mu);
      continue;
    }
    ckpt_call *restore = do_stats ? NULL : c->restore_call;
    if (restore)
      c->restore_call = NULL;
    waiter *snap = do_stats || restore ? NULL : core__take_snapshot(c, &fire);
    int do_apply = !do_stats && !restore && !snap && c->apply_state == APPLY_QUEUED;
    /* A pipelined step's passes: whenever pieces are ready (and every
     * piece has its initial weights, which a trainer's Apply may precede),
     * and once with none when the shard owns no piece. */
    int do_pieces = do_apply && c->pipelined && c->initialized_pieces == c->npieces &&
                    (c->nready > 0 || c->nahead == c->npieces);
    if (c->pipelined)
      do_apply = 0;
    if (fire || do_stats || restore || snap || do_apply || do_pieces) {
      pthread_mutex_unlock(&c->mu);
      core__fire(fire);
      if (do_stats)
        core_compute_stats(c);
      else if (restore)
        core__run_restore(c, restore);
      else if (snap)
        core__run_snapshot(c, snap);
      else if (do_apply)
        core_run_apply(c);
      else if (do_pieces)
        core_run_pieces(c);
      pthread_mutex_lock(&c->mu);
      continue;
    }
    c->next_deadline = next;
    if (next == UINT64_MAX) {
      pthread_cond_wait(&c->worker_cv, &c->mu);
    } else {
      struct timespec ts = {.tv_sec = (time_t)(next / 1000u),
                            .tv_nsec = (long)(next % 1000u) * 1000000L};
      pthread_cond_timedwait(&c->worker_cv, &c->mu, &ts);
    }
    /* Whatever woke us, the next pass recomputes the deadline. */
    c->next_deadline = 0;
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}
