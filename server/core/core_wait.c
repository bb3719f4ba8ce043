/*
 * core_wait — the worker thread and what it serves: waiters and their
 * deadlines, the waits for a version and for the gradient statistics, and the
 * apply (see core.h for the contract; threads and locks: the top of core.c).
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/log.h"
#include "common/model/spec_optim.h"

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

/* ---------------------------------------------------------------- worker */

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

/* The optimizer parameters of group g with everything that does not depend on
 * the step filled in. */
static optim_params core_group_params(const core *c, uint32_t g) {
  return optim_params_of_group(&c->spec.groups[g], c->spec.param_dtype);
}

/* ------------------------------------------------- a step's hyper-parameters */

/* p with group g's values of this step's hyper-parameters (hp may be NULL:
 * the spec's; its counts are checked, core_check_hparams). */
static void core_step_override(optim_params *p, const core_step_hparams *hp, uint32_t g) {
  if (!hp)
    return;
#define CORE_HP_SET(up, name)                                                                      \
  if (hp->n[CORE_HP_##up])                                                                         \
    p->name = hp->v[CORE_HP_##up][g];
  CORE_STEP_HPARAMS(CORE_HP_SET)
#undef CORE_HP_SET
}

/* The queued apply's hyper-parameters as a view of apply_hp. Called with mu
 * held or on the worker while the apply is queued or running (apply_hp does
 * not change then). */
static core_step_hparams core_queued_hparams(const core *c) {
  core_step_hparams hp;
  memset(&hp, 0, sizeof hp);
  for (unsigned k = 0; k < CORE_NHP; k++)
    if (c->apply_hp_mask & (1u << k)) {
      hp.v[k] = c->apply_hp + (size_t)k * c->spec.num_groups;
      hp.n[k] = c->spec.num_groups;
    }
  return hp;
}

/* Copies hp into dst (CORE_NHP arrays of num_groups) and returns the mask of
 * the given arrays. hp is checked (core_check_hparams). */
static unsigned core_store_hparams(const core *c, double *dst, const core_step_hparams *hp) {
  unsigned mask = 0;
  for (unsigned k = 0; hp && k < CORE_NHP; k++)
    if (hp->n[k]) {
      memcpy(dst + (size_t)k * c->spec.num_groups, hp->v[k], hp->n[k] * sizeof *dst);
      mask |= 1u << k;
    }
  return mask;
}

/* 1 if hp carries the values stored in `stored` under `mask`. */
static int core_same_hparams(const core *c, const core_step_hparams *hp, const double *stored,
                             unsigned mask) {
  for (unsigned k = 0; k < CORE_NHP; k++) {
    uint32_t n = hp ? hp->n[k] : 0;
    if (!n != !(mask & (1u << k)))
      return 0;
    for (uint32_t g = 0; g < n; g++)
      if (hp->v[k][g] != stored[(size_t)k * c->spec.num_groups + g])
        return 0;
  }
  return 1;
}

static const char *const core_hparam_names[CORE_NHP] = {
#define CORE_HP_NAME(up, name) #name,
    CORE_STEP_HPARAMS(CORE_HP_NAME)
#undef CORE_HP_NAME
};

/* Refuses (ZS_EINVAL) a count other than 0 or the group count, and values
 * that torch's state rules forbid: the spec decided whether an SGD group has
 * a momentum buffer, so its momentum stays 0 or above 0 with it, and
 * nesterov keeps torch's "momentum > 0 and dampening 0". The ranges are the
 * service's. Called with mu held and the job open. */
static int core_check_hparams(const core *c, const core_step_hparams *hp, char *err,
                              size_t errlen) {
  for (unsigned k = 0; hp && k < CORE_NHP; k++)
    if (hp->n[k] != 0 && (hp->n[k] != c->spec.num_groups || !hp->v[k]))
      return status_fail(err, errlen, ZS_EINVAL,
                         "apply carries %u values of group_%s but job '%s' has %u param groups",
                         hp->n[k], core_hparam_names[k], c->spec.job, c->spec.num_groups);
  for (uint32_t g = 0; hp && g < c->spec.num_groups; g++) {
    const spec_group *sg = &c->spec.groups[g];
    optim_params p = core_group_params(c, g);
    core_step_override(&p, hp, g);
    /* The step's values as a group: the spec's checks apply to them too,
     * and they may not change which state arrays the group keeps (the
     * arenas were sized from the spec). */
    spec_group now = *sg;
#define COPY_FIELD(kind, name, proto) now.name = p.name;
    SPEC_OPTIM_FIELDS(COPY_FIELD)
#undef COPY_FIELD
    const spec_optim *o = spec_optim_of(sg->optimizer);
    /* Only SGD's arrays depend on a hyper-parameter (its momentum). */
    if (o && o->state(&now) != o->state(sg))
      return status_fail(err, errlen, ZS_EINVAL,
                         "param group %u was created with momentum %g, so it %s momentum "
                         "buffer: its momentum cannot become %g (it may change only between "
                         "values above 0); nothing was applied",
                         g, sg->momentum, sg->momentum != 0 ? "has a" : "has no", p.momentum);
    char why[256];
    if (o && o->check(&now, g, why, sizeof why) != 0)
      return status_fail(err, errlen, ZS_EINVAL, "%s; nothing was applied", why);
  }
  return 0;
}

/* gradient = acc * this: coef, or coef / W rounded once under
 * GRAD_REDUCE_MEAN. */
static float core_grad_scale(const core *c, float coef) {
  /* The mean is over the ranks whose contributions were summed: W for a
   * fixed membership, so its bits are the same as before elastic jobs. */
  return c->spec.reduce == SPEC_REDUCE_MEAN ? (float)((double)coef / (double)c->stat_members.n)
                                            : coef;
}

/* The optimizer parameters of group g for this step: the step's
 * hyper-parameters where the queued apply carries them (core_step_override),
 * its lr (glr[g], or lr times the group's lr_scale), the step count and the
 * gradient scale. Every plan of a step, whole-range or per piece, is built
 * here. */
static optim_params core_step_params(const core *c, uint32_t g, double lr, const double *glr,
                                     uint64_t step, float grad_scale) {
  optim_params p = core_group_params(c, g);
  const core_step_hparams hp = core_queued_hparams(c);
  core_step_override(&p, &hp, g);
  p.lr = glr ? glr[g] : lr * c->spec.groups[g].lr_scale;
  p.step = step;
  p.grad_scale = grad_scale;
  return p;
}

/* Reorders c->batch so that its pieces with a gradient come first and sets
 * c->nwork to their count (the order of the pieces changes no bit: the
 * kernel is elementwise and they are disjoint). With state_rw exclusive,
 * every piece of the batch complete. */
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
  c->last_apply = (core_apply_result){
      .step = step, .version = step, .skipped = skip, .optimizer_steps = opt_steps};
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
  float grad_scale = core_grad_scale(c, coef);
  for (uint32_t b = 0; b < c->nbatch; b++) {
    uint32_t t = c->pieces[c->batch[b]].lp->tensor, g = c->spec.tensors[t].group;
    if (b > 0) {
      uint32_t pt = c->pieces[c->batch[b - 1]].lp->tensor;
      if (c->spec.tensors[pt].group == g && c->tensor_steps[pt] == c->tensor_steps[t]) {
        c->pplans[b] = c->pplans[b - 1];
        continue;
      }
    }
    optim_params p = core_step_params(c, g, lr, glr, c->tensor_steps[t] + 1, grad_scale);
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
  for (uint32_t b = 0; b < c->nbatch; b++)
    c->pieces[c->batch[b]].ahead = 1;
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

/* ---------------------------------------------------------------- apply */

static int core_same_apply(double lr, float coef, int skip, double lr2, float coef2, int skip2) {
  return lr == lr2 && coef == coef2 && !skip == !skip2;
}

static int core_same_glr(const double *a, uint32_t na, const double *b, uint32_t nb) {
  if (na != nb)
    return 0;
  for (uint32_t i = 0; i < na; i++)
    if (a[i] != b[i])
      return 0;
  return 1;
}

/* Builds the plan every param group would run with these arguments and
 * refuses them when a scalar the kernels see is not a finite float: a lr of
 * 1e300 is a finite double, but (float)-lr is -inf and so would every weight
 * be. Checked for a skip too, so that a refusal does not depend on it. Called
 * with mu held, the job open and group_lr already checked. */
static int core_apply_check_plans(core *c, double lr, const double *group_lr, uint32_t ngroup_lr,
                                  const core_step_hparams *hp, float coef, char *err,
                                  size_t errlen) {
  float grad_scale = core_grad_scale(c, coef);
  for (uint32_t g = 0; g < c->spec.num_groups; g++) {
    optim_params p = core_group_params(c, g);
    core_step_override(&p, hp, g);
    p.lr = ngroup_lr ? group_lr[g] : lr * c->spec.groups[g].lr_scale;
    p.step = c->optimizer_steps + 1;
    p.grad_scale = grad_scale;
    optim_plan plan;
    optim_plan_init(&plan, &p);
    const char *bad = optim_plan_bad_scalar(&plan);
    if (bad)
      return status_fail(err, errlen, ZS_EINVAL,
                         "apply with lr=%g coef=%g would give param group %u a %s that is not a "
                         "finite float32 (group lr %g, step %" PRIu64 "); nothing was applied",
                         lr, (double)coef, g, bad, p.lr, p.step);
  }
  return 0;
}

/* Queues the apply of the pending step with these arguments and wakes the
 * worker. Called with mu held. */
static void core_apply_record(core *c, double lr, const double *group_lr, uint32_t ngroup_lr,
                              const core_step_hparams *hp, float coef, int skip) {
  c->apply_state = APPLY_QUEUED;
  c->apply_lr = lr;
  c->apply_coef = coef;
  c->apply_skip = !!skip;
  c->apply_nglr = ngroup_lr;
  if (ngroup_lr)
    memcpy(c->apply_glr, group_lr, ngroup_lr * sizeof *c->apply_glr);
  c->apply_hp_mask = core_store_hparams(c, c->apply_hp, hp);
  pthread_cond_signal(&c->worker_cv);
}

int core_apply(core *c, uint64_t hash, uint64_t step, double lr, float coef, int skip,
               core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen) {
  return core_apply_groups(c, hash, step, lr, NULL, 0, coef, skip, cb, arg, out, err, errlen);
}

int core_apply_groups(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                      uint32_t ngroup_lr, float coef, int skip, core_apply_cb cb, void *arg,
                      core_apply_result *out, char *err, size_t errlen) {
  return core_apply_step(c, hash, step, lr, group_lr, ngroup_lr, NULL, coef, skip, cb, arg, out,
                         err, errlen);
}

int core_apply_step(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                    uint32_t ngroup_lr, const core_step_hparams *hp, float coef, int skip,
                    core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen) {
  return core_apply_members(c, hash, step, lr, group_lr, ngroup_lr, hp, NULL, coef, skip, cb, arg,
                            out, err, errlen);
}

/* Refuses an Apply whose membership is not `have` (NULL stands for every
 * rank the step expected, as an older client's Apply). Called with mu held. */
static int core_apply_check_members(const core *c, uint64_t step, const core_members *members,
                                    const core_members *have, char *err, size_t errlen) {
  if (members ? core_members_equal(members, have) : have->n == c->members.n)
    return 0;
  return status_fail(err, errlen, ZS_EINVAL,
                     "Apply of step %" PRIu64 " names %u member rank(s) but shard %u sums %u "
                     "(the trainers must agree on the membership through GradStats first); "
                     "nothing was applied",
                     step, members ? members->n : c->members.n, c->shard_id, have->n);
}

/* The membership side of an Apply of the pending step (gated job, mu
 * held): a backup of a replica set is never asked for statistics, so the
 * Apply makes it sum the agreed set (a subset of what it summed, or of the
 * ranks complete here while it still waits for others: `decided`), setting
 * *narrowed; otherwise, once the set cannot change any more, `members` must
 * be it. Before the statistics are ready the set may still change: the
 * Apply then waits (ENOTREADY, in the caller) rather than be compared. */
static int core_apply_narrow(core *c, uint64_t step, const core_members *members, int decided,
                             int *narrowed, char *err, size_t errlen) {
  if (c->elastic && members && c->apply_state == APPLY_NONE &&
      ((c->stats_phase == STATS_READY && !core_members_equal(members, &c->stat_members) &&
        core__members_subset(members, &c->stat_members)) ||
       (c->stats_phase == STATS_WAITING && !c->frozen && decided))) {
    core__members_narrow(c, members);
    *narrowed = 1;
    return 0;
  }
  if (c->apply_state != APPLY_NONE || c->stats_phase == STATS_READY)
    return core_apply_check_members(c, step, members, &c->stat_members, err, errlen);
  return 0;
}

int core_apply_members(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                       uint32_t ngroup_lr, const core_step_hparams *hp, const core_members *members,
                       float coef, int skip, core_apply_cb cb, void *arg, core_apply_result *out,
                       char *err, size_t errlen) {
  waiter *w = NULL;
  /* Every named rank complete here (core_apply_narrow), read before mu. */
  int decided = members && core__members_complete_for(c, members);
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core__check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  /* A learning rate or coefficient that is not finite would poison every
   * weight of the shard. */
  if (!isfinite(lr) || lr < 0.0 || !isfinite(coef)) {
    rc = status_fail(err, errlen, ZS_EINVAL, "apply needs a finite lr >= 0 and a finite coef");
    goto done;
  }
  if (ngroup_lr != 0 && (ngroup_lr != c->spec.num_groups || !group_lr)) {
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "apply carries %u group learning rates but job '%s' has %u param groups",
                     ngroup_lr, c->spec.job, c->spec.num_groups);
    goto done;
  }
  for (uint32_t g = 0; g < ngroup_lr; g++) {
    if (!isfinite(group_lr[g]) || group_lr[g] < 0.0) {
      rc = status_fail(err, errlen, ZS_EINVAL,
                       "apply's learning rate of group %u is %g: it must be finite and >= 0", g,
                       group_lr[g]);
      goto done;
    }
  }
  if (c->pipelined && skip) {
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "job '%s' is pipelined: a step cannot be skipped, its pieces are applied as "
                     "their contributions arrive",
                     c->spec.job);
    goto done;
  }
  if ((rc = core_check_hparams(c, hp, err, errlen)) != 0 ||
      (rc = core_apply_check_plans(c, lr, group_lr, ngroup_lr, hp, coef, err, errlen)) != 0)
    goto done;
  if (c->last_apply_valid && step == c->version) {
    if ((rc = core_apply_check_members(c, step, members, &c->last_members, err, errlen)) != 0)
      goto done;
    if (core_same_apply(lr, coef, skip, c->last_lr, c->last_coef, c->last_skip) &&
        core_same_glr(group_lr, ngroup_lr, c->last_glr, c->last_nglr) &&
        core_same_hparams(c, hp, c->last_hp, c->last_hp_mask)) {
      if (out)
        *out = c->last_apply;
    } else {
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " was applied with lr=%g coef=%g skip=%d%s, not lr=%g "
                       "coef=%g skip=%d",
                       step, c->last_lr, (double)c->last_coef, c->last_skip,
                       core_same_glr(group_lr, ngroup_lr, c->last_glr, c->last_nglr)
                           ? (core_same_hparams(c, hp, c->last_hp, c->last_hp_mask)
                                  ? ""
                                  : " and other group hyper-parameters")
                           : " and other group learning rates",
                       lr, (double)coef, !!skip);
    }
    goto done;
  }
  if (c->ckpt_loaded && (step > c->version + 1 || step == c->version)) {
    rc = core__behind(c, "apply", step, err, errlen);
    goto done;
  }
  if (step != c->version + 1) {
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "apply for step %" PRIu64 " but shard %u expects step %" PRIu64, step,
                     c->shard_id, c->version + 1);
    goto done;
  }
  int narrowed = 0;
  if (!c->pipelined &&
      (rc = core_apply_narrow(c, step, members, decided, &narrowed, err, errlen)) != 0)
    goto done;
  if (c->apply_state != APPLY_NONE) {
    if (!core_same_apply(lr, coef, skip, c->apply_lr, c->apply_coef, c->apply_skip) ||
        !core_same_glr(group_lr, ngroup_lr, c->apply_glr, c->apply_nglr) ||
        !core_same_hparams(c, hp, c->apply_hp, c->apply_hp_mask)) {
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " is being applied with lr=%g coef=%g skip=%d%s, not "
                       "lr=%g coef=%g skip=%d",
                       step, c->apply_lr, (double)c->apply_coef, c->apply_skip,
                       core_same_glr(group_lr, ngroup_lr, c->apply_glr, c->apply_nglr)
                           ? (core_same_hparams(c, hp, c->apply_hp, c->apply_hp_mask)
                                  ? ""
                                  : " and other group hyper-parameters")
                           : " and other group learning rates",
                       lr, (double)coef, !!skip);
      goto done;
    }
  } else if (!c->pipelined) {
    /* Narrowed: the statistics over `members` run first, then this apply
     * (the worker's order); the trainers checked their overflow already. */
    if (!narrowed && c->stats_phase != STATS_READY) {
      uint64_t want = (uint64_t)c->npieces * c->WM;
      uint64_t have = atomic_load_explicit(&c->contributions, memory_order_relaxed);
      rc = status_fail(err, errlen, ZS_ENOTREADY,
                       "step %" PRIu64 " still misses %" PRIu64 " of %" PRIu64
                       " contributions on shard %u",
                       step, want - (have < want ? have : want), want, c->shard_id);
      goto done;
    }
    if (!narrowed && c->stats.nonfinite && !skip) {
      rc = status_fail(err, errlen, ZS_ENONFINITE,
                       "step %" PRIu64 " has non-finite gradients on shard %u: it must be skipped",
                       step, c->shard_id);
      goto done;
    }
  }
  if (c->apply_state == APPLY_NONE && !c->pipelined && c->initialized_pieces < c->npieces) {
    rc = status_fail(err, errlen, ZS_ENOTREADY,
                     "%u of %u pieces of shard %u have no initial weights",
                     c->npieces - c->initialized_pieces, c->npieces, c->shard_id);
    goto done;
  }
  if (c->pipelined) {
    /* Apply ahead: the arguments are recorded (or a repeat matched them) and
     * the worker applies each piece once its contributions are in. Nobody
     * waits for that here: the pulls of each piece do (core_wait_pieces).
     * version < step tells the caller the step is not applied yet. */
    if (c->apply_state == APPLY_NONE)
      core_apply_record(c, lr, group_lr, ngroup_lr, hp, coef, 0);
    if (out)
      *out = (core_apply_result){
          .step = step, .version = c->version, .optimizer_steps = c->optimizer_steps};
    goto done;
  }
  if (cb) {
    w = calloc(1, sizeof *w);
    if (!w) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering an apply");
      goto done;
    }
    w->kind = WAITER_APPLY;
    w->key = step;
    w->cb.apply = cb;
    w->arg = arg;
    waiter_push(&c->apply_waiters, w);
  }
  if (c->apply_state == APPLY_NONE)
    core_apply_record(c, lr, group_lr, ngroup_lr, hp, coef, skip);
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  return rc;
}

void core_set_applied_hook(core *c, core_applied_fn fn, void *arg) {
  pthread_mutex_lock(&c->mu);
  c->applied_fn = fn;
  c->applied_arg = fn ? arg : NULL;
  pthread_mutex_unlock(&c->mu);
}
