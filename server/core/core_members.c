/*
 * core_members — the elastic membership of a job on one shard (DESIGN.md
 * "Membership"): which ranks contribute to the pending step, the trainer
 * timeout that leaves a silent rank out, and the sum over the members.
 *
 * Why every contribution is kept: a step's membership is decided after its
 * contributions arrived (a rank that dies half-way through its pushes is
 * left out on every shard alike, including those that hold all of its
 * contributions), and floating-point addition cannot take a term back out
 * of a sum. So an elastic job keeps each contribution as it came (the wire
 * dtype's bytes, W * M of them per piece at most: 2 * W * M bytes per
 * parameter for bf16) until its step is applied, and the worker sums them
 * once the set is known, in the fixed (micro, rank) order, skipping the
 * ranks left out: with every rank a member that is the streaming sum of a
 * fixed membership, bit for bit.
 *
 * Locks: as in core.c. The push side runs with state_rw shared and the
 * piece's mu (taking mu inside it); the worker's side takes state_rw shared
 * and each piece's mu to read the kept contributions.
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/log.h"

void core_members_add(core_members *m, uint32_t rank) {
  if (rank >= CORE_ELASTIC_MAX_W || core_members_has(m, rank))
    return;
  m->bits[rank / 64] |= UINT64_C(1) << (rank % 64);
  m->n++;
}

int core_members_equal(const core_members *a, const core_members *b) {
  return a->n == b->n && memcmp(a->bits, b->bits, sizeof a->bits) == 0;
}

/* A malloc'd copy of the n elements of `size` bytes at `from`; NULL when
 * from is NULL or out of memory. */
static void *copy_array(const void *from, size_t n, size_t size) {
  void *p = from ? malloc(n * size + 1) : NULL;
  if (p && n)
    memcpy(p, from, n * size);
  return p;
}

int core_member_state_copy(core_member_state **out, const core_member_state *from) {
  *out = NULL;
  core_member_state *ms = malloc(sizeof *ms);
  if (!ms)
    return ZS_ENOMEM;
  *ms = *from;
  ms->log = copy_array(from->log, from->log_n, sizeof *from->log);
  ms->join_at = copy_array(from->join_at, from->nplan, sizeof *from->join_at);
  ms->leave_at = copy_array(from->leave_at, from->nplan, sizeof *from->leave_at);
  if ((from->log && !ms->log) || (from->join_at && !ms->join_at) ||
      (from->leave_at && !ms->leave_at)) {
    core_member_state_free(ms);
    return ZS_ENOMEM;
  }
  *out = ms;
  return 0;
}

void core_member_state_free(core_member_state *ms) {
  if (!ms)
    return;
  free((void *)ms->log);
  free((void *)ms->join_at);
  free((void *)ms->leave_at);
  free(ms);
}

static void members_remove(core_members *m, uint32_t rank) {
  if (!core_members_has(m, rank))
    return;
  m->bits[rank / 64] &= ~(UINT64_C(1) << (rank % 64));
  m->n--;
}

void core__members_reset(core *c) {
  memset(&c->members, 0, sizeof c->members);
  if (c->W <= CORE_ELASTIC_MAX_W)
    for (uint32_t r = 0; r < c->W; r++)
      core_members_add(&c->members, r);
  else
    c->members.n = c->W; /* a fixed membership: the bits are never read */
  c->stat_members = c->members;
  c->last_members = c->members;
  c->apply_members = c->members;
  c->frozen = 0;
  c->stall_since = 0;
  c->mlog_n = 0; /* the buffer is kept for the next job, freed by core_destroy */
  memset(c->join_at, 0, sizeof c->join_at);
  memset(c->leave_at, 0, sizeof c->leave_at);
}

uint32_t core_timeout_in_effect(uint32_t open_ms, uint32_t server_flag_ms,
                                uint32_t recorded_flag_ms) {
  if (open_ms)
    return open_ms;
  return server_flag_ms ? server_flag_ms : recorded_flag_ms;
}

void core__members_restore(core *c, const core_member_state *ms) {
  int changed = c->elastic && c->members.n != c->W;
  if (ms)
    c->open_timeout_ms = ms->trainer_timeout_ms;
  /* The flag timeout the job ran under before, kept where this server has
   * no flag of its own (a job elastic only through the flag stays elastic
   * after a restart without it). */
  uint32_t recorded = ms ? ms->flag_timeout_ms : 0;
  /* The same rule with no job option: the flag part of it. */
  c->flag_timeout_ms = core_timeout_in_effect(0, c->default_timeout_ms, recorded);
  c->trainer_timeout_ms =
      core_timeout_in_effect(c->open_timeout_ms, c->default_timeout_ms, recorded);
  c->elastic =
      c->trainer_timeout_ms > 0 && !c->spec.pipelined && c->W <= CORE_ELASTIC_MAX_W ? 1 : 0;
  core__members_reset(c);
  if (!ms || !c->elastic) {
    if (changed)
      c->member_epoch++;
    return;
  }
  c->members = ms->members;
  c->stat_members = c->last_members = c->apply_members = c->members;
  c->member_epoch = ms->epoch;
  c->member_leaves = ms->leaves;
  c->member_timeouts = ms->timeouts;
  c->member_joins = ms->joins;
  for (uint32_t r = 0; r < ms->nplan && r < c->W && r < CORE_ELASTIC_MAX_W; r++) {
    c->join_at[r] = ms->join_at ? ms->join_at[r] : 0;
    c->leave_at[r] = ms->leave_at ? ms->leave_at[r] : 0;
  }
  uint32_t n = ms->log_n < CORE_MEMBER_LOG_MAX ? ms->log_n : CORE_MEMBER_LOG_MAX;
  const core_member_log_entry *from = ms->log + (ms->log_n - n);
  if (n > c->mlog_cap) {
    core_member_log_entry *p = realloc(c->mlog, n * sizeof *p);
    if (!p) {
      LOG_WARN("membership_log",
               "shard=%u detail=\"out of memory restoring the membership log; it starts "
               "afresh\"",
               c->shard_id);
      return;
    }
    c->mlog = p;
    c->mlog_cap = n;
  }
  if (n > 0)
    memcpy(c->mlog, from, n * sizeof *c->mlog);
  c->mlog_n = n;
}

void core_get_membership(core *c, core_membership *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->mu);
  out->trainer_timeout_ms = c->trainer_timeout_ms;
  if (c->open) {
    out->elastic = c->elastic;
    out->world_size = c->W;
    out->epoch = c->member_epoch;
    out->leaves = c->member_leaves;
    out->timeouts = c->member_timeouts;
    out->joins = c->member_joins;
    out->members = c->members;
  }
  pthread_mutex_unlock(&c->mu);
}

int core__push_left(core *c, uint32_t rank, uint64_t step, char *err, size_t errlen) {
  if (!c->elastic || core_members_has(&c->members, rank))
    return 0;
  return status_fail(err, errlen, ZS_ELEFT,
                     "rank %u was left out of job '%s' after the trainer timeout (%u ms): its "
                     "push for step %" PRIu64 " is refused (the shard is at version %" PRIu64
                     "); open the job again in join mode to rejoin",
                     rank, c->spec.job, c->trainer_timeout_ms, step, c->version);
}

int core__push_keep(core *c, piece_state *ps, uint32_t k, uint32_t rank, zs_dtype dtype,
                    const void *data, size_t nbytes, char *err, size_t errlen) {
  if (!core_members_has(&c->members, rank))
    return status_fail(err, errlen, ZS_ELEFT,
                       "rank %u is not a member of step %" PRIu64 " of job '%s' (it left, or was "
                       "left out at a trainer timeout); nothing of this push was kept: open the "
                       "job again in join mode to rejoin",
                       rank, c->version + 1, c->spec.job);
  pthread_mutex_lock(&c->mu);
  int out = c->frozen && !core_members_has(&c->stat_members, rank);
  pthread_mutex_unlock(&c->mu);
  if (out)
    return status_fail(err, errlen, ZS_ELEFT,
                       "rank %u was left out of step %" PRIu64 " of job '%s' after the trainer "
                       "timeout (%u ms): its contributions to the step are discarded on every "
                       "shard; open the job again in join mode to rejoin",
                       rank, c->version + 1, c->spec.job, c->trainer_timeout_ms);
  if (!ps->held && !(ps->held = calloc(c->WM, sizeof *ps->held)))
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory keeping a contribution");
  held_contrib *h = core__held_get(c, nbytes);
  if (!h)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory keeping a contribution");
  h->dtype = dtype;
  h->nbytes = nbytes;
  if (nbytes > 0)
    memcpy(h->data, data, nbytes);
  ps->held[k] = h;
  ps->nheld++;
  atomic_fetch_add_explicit(&c->held_bytes, nbytes, memory_order_relaxed);
  ps->received[k / 64] |= UINT64_C(1) << (k % 64);
  atomic_fetch_add_explicit(&c->contributions, 1, memory_order_relaxed);
  pthread_mutex_lock(&c->mu);
  /* Only members' contributions are kept, so the piece is complete once it
   * holds M of each; the step once every piece is, unless it was decided. */
  if (++ps->nrecv == c->members.n * c->M && ++c->complete_pieces == c->npieces && !c->frozen &&
      c->stats_phase == STATS_WAITING) {
    c->stat_members = c->members;
    c->stats_phase = STATS_COMPUTING;
    pthread_cond_signal(&c->worker_cv);
  }
  pthread_mutex_unlock(&c->mu);
  return 0;
}

/* Sums piece i's kept contributions of stat_members into its range of acc. */
static void members_sum_piece(void *arg, size_t i) {
  core *c = arg;
  piece_state *ps = &c->pieces[i];
  float *acc = c->acc + ps->lp->arena_off;
  size_t n = (size_t)ps->lp->numel;
  pthread_mutex_lock(&ps->mu);
  memset(acc, 0, n * sizeof *acc);
  ps->has_grad = 0;
  for (uint32_t k = 0; ps->held && k < c->WM; k++) {
    const held_contrib *h = ps->held[k];
    if (!h || !core_members_has(&c->stat_members, k % c->W))
      continue;
    if (h->nbytes > 0) {
      dtype_accumulate(h->dtype, h->data, acc, n);
      ps->has_grad = 1;
    }
  }
  pthread_mutex_unlock(&ps->mu);
}

void core__members_sum(core *c) {
  pool_run(c->pool, c->npieces, members_sum_piece, c);
}

void core__members_complete(core *c, core_members *out) {
  pthread_rwlock_rdlock(&c->state_rw);
  *out = c->members;
  for (uint32_t i = 0; i < c->npieces && out->n > 0; i++) {
    piece_state *ps = &c->pieces[i];
    pthread_mutex_lock(&ps->mu);
    for (uint32_t r = 0; r < c->W; r++) {
      for (uint32_t m = 0; core_members_has(out, r) && m < c->M; m++) {
        uint32_t k = m * c->W + r;
        if (!((ps->received[k / 64] >> (k % 64)) & 1u))
          members_remove(out, r);
      }
    }
    pthread_mutex_unlock(&ps->mu);
  }
  pthread_rwlock_unlock(&c->state_rw);
}

uint64_t core__members_deadline(const core *c) {
  if (!c->elastic || c->frozen || c->stats_phase != STATS_WAITING || c->stall_since == 0)
    return UINT64_MAX;
  return c->stall_since + c->trainer_timeout_ms;
}

void core__members_timeout(core *c) {
  core_members done;
  core__members_complete(c, &done);
  pthread_mutex_lock(&c->mu);
  uint64_t now = clock_now_ms();
  if (core__members_deadline(c) > now) {
    /* The step completed (or was decided) meanwhile. */
  } else if (done.n == 0) {
    /* Nobody gave the whole step here: there is no one to go on with, so
     * the job waits (for the missing ranks, or for a restore). */
    c->stall_since = now;
  } else {
    char left[128] = "";
    size_t len = 0;
    for (uint32_t r = 0; r < c->W && len < sizeof left - 12; r++)
      if (core_members_has(&c->members, r) && !core_members_has(&done, r))
        len += (size_t)snprintf(left + len, sizeof left - len, "%s%u", len ? "," : "", r);
    LOG_WARN("trainer_timeout",
             "shard=%u step=%" PRIu64 " timeout_ms=%u members=%u complete=%u left_out=%s",
             c->shard_id, c->version + 1, c->trainer_timeout_ms, c->members.n, done.n, left);
    c->frozen = 1;
    c->stat_members = done;
    c->member_timeouts++;
    c->stats_phase = STATS_COMPUTING;
  }
  pthread_mutex_unlock(&c->mu);
}

void core__members_release(core *c) {
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    core__piece_drop_held(c, ps);
    ps->nheld = 0;
    ps->nrecv = 0;
  }
  atomic_store_explicit(&c->held_bytes, 0, memory_order_relaxed);
}

int core__members_complete_for(core *c, const core_members *want) {
  /* Only a shard still waiting for the step's contributions needs the walk
   * over its pieces; checked under mu first so that no other Apply (which
   * may come while an apply holds state_rw) waits on state_rw here. */
  pthread_mutex_lock(&c->mu);
  int waiting = c->open && c->elastic && want->n < c->members.n &&
                c->stats_phase == STATS_WAITING && !c->frozen && c->apply_state == APPLY_NONE;
  pthread_mutex_unlock(&c->mu);
  if (!waiting)
    return 0;
  core_members done;
  core__members_complete(c, &done);
  return core__members_subset(want, &done);
}

int core__members_subset(const core_members *a, const core_members *b) {
  for (uint32_t i = 0; i < CORE_MEMBER_WORDS; i++)
    if (a->bits[i] & ~b->bits[i])
      return 0;
  return a->n > 0;
}

void core__members_narrow(core *c, const core_members *want) {
  c->stat_members = *want;
  c->frozen = 1;
  c->stats_phase = STATS_COMPUTING;
  pthread_cond_signal(&c->worker_cv);
}

/* Makes the changes planned for `step`, about to become the pending one
 * (nothing of it was pushed yet: a push for a step beyond version + 1 is
 * refused). state_rw exclusive and mu held. */
static void members_plan(core *c, uint64_t step) {
  uint32_t joins = 0, leaves = 0;
  for (uint32_t r = 0; r < c->W && r < CORE_ELASTIC_MAX_W; r++) {
    if (c->leave_at[r] != 0 && c->leave_at[r] <= step) {
      c->leave_at[r] = 0;
      if (core_members_has(&c->members, r)) {
        members_remove(&c->members, r);
        leaves++;
      }
    }
    if (c->join_at[r] == step) {
      c->join_at[r] = 0;
      if (!core_members_has(&c->members, r)) {
        core_members_add(&c->members, r);
        joins++;
      }
    }
  }
  if (joins + leaves == 0)
    return;
  c->member_joins += joins;
  c->member_leaves += leaves;
  c->member_epoch++;
  LOG_INFO("membership", "shard=%u step=%" PRIu64 " members=%u joined=%u left=%u epoch=%" PRIu64,
           c->shard_id, step, c->members.n, joins, leaves, c->member_epoch);
}

/* Appends (step, the set it was applied with) to the log when the set
 * differs from the last entry's. mu held. */
static void members_log(core *c, uint64_t step, const core_members *set) {
  if (c->mlog_n > 0 && core_members_equal(&c->mlog[c->mlog_n - 1].members, set))
    return;
  if (c->mlog_n == CORE_MEMBER_LOG_MAX) {
    memmove(c->mlog, c->mlog + 1, (c->mlog_n - 1) * sizeof *c->mlog);
    c->mlog_n--;
  }
  if (c->mlog_n == c->mlog_cap) {
    uint32_t cap = c->mlog_cap ? 2 * c->mlog_cap : 16;
    core_member_log_entry *p = realloc(c->mlog, cap * sizeof *p);
    if (!p) {
      LOG_WARN("membership_log", "shard=%u step=%" PRIu64 " detail=\"out of memory\"", c->shard_id,
               step);
      return;
    }
    c->mlog = p;
    c->mlog_cap = cap;
  }
  c->mlog[c->mlog_n++] = (core_member_log_entry){.from_step = step, .members = *set};
}

size_t core_member_log_format(core *c, char *buf, size_t cap) {
  if (cap == 0)
    return 0;
  buf[0] = '\0';
  pthread_mutex_lock(&c->mu);
  /* The newest entries that fit, found from the end, then written in order. */
  uint32_t first = c->open && c->elastic ? c->mlog_n : 0, last = first;
  size_t need = 0;
  char one[16 + 6 * CORE_ELASTIC_MAX_W];
  while (first > 0) {
    const core_member_log_entry *e = &c->mlog[first - 1];
    size_t len = (size_t)snprintf(one, sizeof one, "%s%" PRIu64 ":", need ? ";" : "", e->from_step);
    for (uint32_t r = 0, k = 0; r < c->W && r < CORE_ELASTIC_MAX_W; r++)
      if (core_members_has(&e->members, r))
        len += (size_t)snprintf(one + len, sizeof one - len, "%s%u", k++ ? "," : "", r);
    if (need + len + 1 > cap)
      break;
    need += len;
    first--;
  }
  size_t at = 0, n = 0;
  for (uint32_t i = first; i < last; i++, n++) {
    const core_member_log_entry *e = &c->mlog[i];
    at += (size_t)snprintf(buf + at, cap - at, "%s%" PRIu64 ":", at ? ";" : "", e->from_step);
    for (uint32_t r = 0, k = 0; r < c->W && r < CORE_ELASTIC_MAX_W; r++)
      if (core_members_has(&e->members, r))
        at += (size_t)snprintf(buf + at, cap - at, "%s%u", k++ ? "," : "", r);
  }
  pthread_mutex_unlock(&c->mu);
  return n;
}

void core__members_next_step(core *c) {
  members_log(c, c->version + 1, &c->stat_members);
  core__members_release(c);
  if (!core_members_equal(&c->members, &c->stat_members)) {
    c->member_leaves += c->members.n - c->stat_members.n;
    c->member_epoch++;
    LOG_INFO("membership", "shard=%u step=%" PRIu64 " members=%u epoch=%" PRIu64, c->shard_id,
             c->version + 1, c->stat_members.n, c->member_epoch);
  }
  c->last_members = c->stat_members;
  c->members = c->stat_members;
  members_plan(c, c->version + 2);
  c->stat_members = c->members;
  c->apply_members = c->members;
  c->frozen = 0;
  c->stall_since = 0;
}

int core_members_decode(core *c, uint32_t num, const uint32_t *ranks, size_t nranks,
                        core_members *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->mu);
  uint32_t W = c->open ? c->W : 0;
  pthread_mutex_unlock(&c->mu);
  if (W == 0)
    return status_fail(err, errlen, ZS_ENOTOPEN, "no job is open on this shard");
  if (num == W && nranks == 0) {
    if (W > CORE_ELASTIC_MAX_W) {
      out->n = W;
      return 0;
    }
    for (uint32_t r = 0; r < W; r++)
      core_members_add(out, r);
    return 0;
  }
  if (num > W || num > CORE_ELASTIC_MAX_W || nranks != num)
    return status_fail(err, errlen, ZS_EINVAL,
                       "a membership of %u rank(s) must list them (%zu listed), and a job of "
                       "world size %u has at most %u",
                       num, nranks, W, W < CORE_ELASTIC_MAX_W ? W : CORE_ELASTIC_MAX_W);
  for (size_t i = 0; i < nranks; i++) {
    if (ranks[i] >= W || core_members_has(out, ranks[i]))
      return status_fail(err, errlen, ZS_EINVAL, "membership rank %u is %s (world size %u)",
                         ranks[i], ranks[i] >= W ? "out of range" : "listed twice", W);
    core_members_add(out, ranks[i]);
  }
  return 0;
}

size_t core_members_list(core *c, const core_members *m, uint32_t *ranks, size_t cap) {
  pthread_mutex_lock(&c->mu);
  uint32_t W = c->open ? c->W : 0;
  pthread_mutex_unlock(&c->mu);
  if (m->n >= W || W > CORE_ELASTIC_MAX_W)
    return 0;
  size_t n = 0;
  for (uint32_t r = 0; r < W && n < cap; r++)
    if (core_members_has(m, r))
      ranks[n++] = r;
  return n;
}

/* ------------------------------------------------------------------ joins and clean leaves */

/* Discards what rank pushed to the pending step on every piece, so that it
 * neither counts nor blocks a retry's pushes as duplicates. state_rw
 * exclusive held (no push or sum runs). */
static void members_drop_rank(core *c, uint32_t rank) {
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    for (uint32_t m = 0; m < c->M; m++) {
      uint32_t k = m * c->W + rank;
      if (!((ps->received[k / 64] >> (k % 64)) & 1u))
        continue;
      ps->received[k / 64] &= ~(UINT64_C(1) << (k % 64));
      ps->nrecv--;
      atomic_fetch_sub_explicit(&c->contributions, 1, memory_order_relaxed);
      if (ps->held && ps->held[k]) {
        atomic_fetch_sub_explicit(&c->held_bytes, ps->held[k]->nbytes, memory_order_relaxed);
        core__held_put(c, ps->held[k]);
        ps->held[k] = NULL;
        ps->nheld--;
      }
    }
  }
}

/* After the pending step's members changed (not decided yet): counts the
 * pieces that hold every member's contributions again, and starts the
 * statistics when all do. state_rw exclusive and mu held. */
static void members_recount(core *c) {
  c->complete_pieces = 0;
  for (uint32_t i = 0; i < c->npieces; i++)
    if (c->members.n > 0 && c->pieces[i].nrecv == c->members.n * c->M)
      c->complete_pieces++;
  if (c->members.n > 0 && c->npieces > 0 && c->complete_pieces == c->npieces) {
    c->stat_members = c->members;
    c->stats_phase = STATS_COMPUTING;
    pthread_cond_signal(&c->worker_cv);
  }
}

/* 1 while the pending step's members are still open to a change here. */
static int members_undecided(const core *c) {
  return !c->frozen && c->stats_phase == STATS_WAITING && c->apply_state == APPLY_NONE;
}

static int member_join(core *c, uint32_t rank, uint64_t step, char *err, size_t errlen) {
  uint64_t pending = c->version + 1;
  if (step < pending || (step == pending && !members_undecided(c)))
    return status_fail(err, errlen, ZS_ESTEP,
                       "rank %u cannot join job '%s' at step %" PRIu64
                       ": shard %u %s (version %" PRIu64 "); join at a later step",
                       rank, c->spec.job, step, c->shard_id,
                       step < pending ? "applied it already" : "decided its members already",
                       c->version);
  c->leave_at[rank] = 0;
  c->join_at[rank] = 0;
  if (step > pending) {
    /* A member still (a restarted trainer, before its timeout): what its
     * previous life pushed to the pending step is dropped and the step goes
     * on without it; it comes back at `step`. */
    if (core_members_has(&c->members, rank) && members_undecided(c)) {
      members_drop_rank(c, rank);
      members_remove(&c->members, rank);
      c->member_leaves++;
      members_recount(c);
    }
    c->join_at[rank] = step;
    return 0;
  }
  members_drop_rank(c, rank);
  if (!core_members_has(&c->members, rank)) {
    core_members_add(&c->members, rank);
    c->member_joins++;
    c->member_epoch++;
  }
  c->stat_members = c->members;
  /* A newcomer gets the whole timeout for its pushes: the clock restarts
   * now if trainers already wait (their GradStats will not come again). */
  if (c->stall_since != 0) {
    c->stall_since = clock_now_ms();
    pthread_cond_signal(&c->worker_cv);
  }
  members_recount(c);
  LOG_INFO("membership", "shard=%u step=%" PRIu64 " members=%u joined=%u epoch=%" PRIu64,
           c->shard_id, step, c->members.n, rank, c->member_epoch);
  return 0;
}

static void member_leave(core *c, uint32_t rank, uint64_t step) {
  uint64_t pending = c->version + 1;
  /* A leave for a step already applied comes from a client that missed
   * steps since (a stalled trainer's stale handle): whatever rank is now (a
   * newer life of the trainer may have joined), that client is not it. */
  if (step < pending)
    return;
  c->join_at[rank] = 0;
  if (step > pending || (step == pending && !members_undecided(c))) {
    /* The pending step is decided (it counts the rank or not, alike on
     * every shard): the rank leaves at the next boundary. */
    c->leave_at[rank] = step > pending ? step : pending + 1;
    return;
  }
  if (!core_members_has(&c->members, rank))
    return;
  members_drop_rank(c, rank);
  members_remove(&c->members, rank);
  c->member_leaves++;
  c->member_epoch++;
  LOG_INFO("membership", "shard=%u step=%" PRIu64 " members=%u left=%u epoch=%" PRIu64, c->shard_id,
           pending, c->members.n, rank, c->member_epoch);
  members_recount(c);
}

int core_member_change(core *c, uint64_t hash, uint32_t rank, int kind, uint64_t step,
                       uint64_t *version, char *err, size_t errlen) {
  if (kind != CORE_MEMBER_JOIN && kind != CORE_MEMBER_LEAVE)
    return status_fail(err, errlen, ZS_EINVAL,
                       "membership change %d is neither join (1) nor leave (2)", kind);
  pthread_rwlock_wrlock(&c->state_rw);
  pthread_mutex_lock(&c->mu);
  int rc = core__check_job(c, hash, err, errlen);
  if (rc == 0 && !c->elastic)
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "job '%s' has a fixed membership: joins and leaves need the trainer timeout "
                     "(zshard-server --trainer-timeout-ms, or the job's trainer_timeout_ms) and a "
                     "gated job",
                     c->spec.job);
  else if (rc == 0 && rank >= c->W)
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "rank %u is not below the job's world size %u (a job cannot grow past the "
                     "world size it was created with)",
                     rank, c->W);
  else if (rc == 0 && step == 0)
    rc = status_fail(err, errlen, ZS_EINVAL, "a membership change names a step from 1 on");
  if (rc == 0 && kind == CORE_MEMBER_JOIN)
    rc = member_join(c, rank, step, err, errlen);
  else if (rc == 0)
    member_leave(c, rank, step);
  if (version)
    *version = c->version;
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}
