/*
 * core — one job's state on one shard (see core.h for the contract).
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
 *      shared by core_push, core_read, core_missing, core_piece_bytes and the
 *      statistics pass; exclusively by core_open, core_init_params and the
 *      apply. Holding it shared is what makes a read consistent with one
 *      version: the version and the master only change under the exclusive
 *      lock.
 *   2. piece_state.mu: one per piece; guards that piece's received bitmap,
 *      next_k, held contributions and its range of acc, so that pushes to
 *      different pieces run in parallel.
 *   3. mu: guards the step state (initialized and complete piece counts,
 *      statistics phase and results, apply state and record), the waiter
 *      lists, and the counters that are not atomic. Writes of `open` and
 *      `version` happen under both state_rw (exclusive) and mu, so either lock
 *      is enough to read them.
 * Callbacks are collected into a list under mu and invoked after every lock is
 * released.
 */
#include "server/core.h"
#include "common/status.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/log.h"
#include "server/histogram.h"
#include "server/optim.h"
#include "server/pool.h"

#define CORE_DEFAULT_WAIT_MS 60000u
/* Elements per chunk of the optimizer pass: a multiple of LAYOUT_ALIGN_ELEMS so
 * that every chunk starts 64-byte aligned, and large enough that handing out a
 * chunk costs nothing next to running it. */
#define CORE_APPLY_CHUNK 65536u
#define CORE_ARENA_ALIGN 64u

/* A contribution that arrived before its turn: a raw copy of the payload. */
typedef struct held_contrib {
  zs_dtype dtype;
  size_t nbytes;
  unsigned char data[];
} held_contrib;

typedef struct piece_state {
  pthread_mutex_t mu;
  const layout_piece *lp; /* points into core.layout */
  uint64_t *received;     /* bitmap of contribution indices k, into core.bitmaps */
  uint32_t next_k;        /* every k < next_k has been added into acc */
  /* Contribution 1 is in acc and contribution 0 is not (next_k == 0): the
   * first two terms of the sum commute (below), so 1 need not wait for 0. */
  int one_before_zero;
  uint32_t nheld;
  /* W*M slots indexed by k, allocated while nheld > 0 and NULL otherwise, so
   * that the table costs memory only while contributions are out of order. */
  held_contrib **held;
  int initialized;
  /* While the initial weights arrive in parts: one bit per chunk of
   * LAYOUT_INIT_CHUNK_ELEMS elements written, NULL before the first part and
   * once the piece is initialized. Guarded by state_rw (exclusive). */
  uint64_t *init_chunks;
  uint32_t init_have;
} piece_state;

typedef enum stats_phase {
  STATS_WAITING = 0, /* contributions of the pending step are missing */
  STATS_COMPUTING,   /* all in; the worker is (about to be) computing */
  STATS_READY,       /* core.stats holds the pending step's statistics */
} stats_phase;

typedef enum apply_state {
  APPLY_NONE = 0,
  APPLY_QUEUED,
  APPLY_RUNNING,
} apply_state;

typedef enum waiter_kind {
  WAITER_VERSION,
  WAITER_STATS,
  WAITER_APPLY,
  WAITER_SNAPSHOT, /* a blocked core_snapshot; arg is its ckpt_call */
} waiter_kind;

/* One pending callback. Lives on one of the core's lists until it fires, then
 * on a local fire list until it has been invoked and freed. */
typedef struct waiter {
  struct waiter *next;
  waiter_kind kind;
  uint64_t key;      /* min_version (version), step (stats, apply) */
  uint64_t deadline; /* absolute clock_now_ms(); apply waiters have none */
  union {
    core_version_cb version;
    core_stats_cb stats;
    core_apply_cb apply;
  } cb; /* WAITER_SNAPSHOT: none, see ckpt_call */
  void *arg;
  /* The outcome, filled in when the waiter fires. */
  int status;
  uint64_t version;
  core_stats_result stats;
  core_apply_result apply;
} waiter;

/* A core_snapshot or core_restore call, on its caller's stack: the worker does
 * the work and sets done under mu; the caller waits on cv and owns the struct
 * again once done is set. */
typedef struct ckpt_call {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  int status;
  core_view_fn fn; /* snapshot */
  void *fn_arg;
  double seconds;
  core_state *st; /* restore */
  uint64_t ckpt_step;
} ckpt_call;

/* One chunk of the optimizer pass: n elements from `begin` within range. */
typedef struct apply_task {
  uint32_t range;
  uint64_t begin, n;
} apply_task;

struct core {
  uint32_t shard_id, num_shards;
  int nthreads;

  pthread_mutex_t mu;
  pthread_cond_t worker_cv;
  pthread_rwlock_t state_rw;
  int mu_inited, cv_inited, rw_inited;
  pthread_t worker;
  int worker_started;
  pool *pool;

  /* The job: written once by core_open under state_rw (exclusive) and mu. */
  int open;
  spec spec;
  layout layout;
  uint64_t hash;
  uint32_t W, M, WM;
  uint32_t npieces;       /* pieces owned by this shard */
  piece_state *pieces;    /* npieces, in (tensor, slice) order */
  uint32_t *local_of;     /* per layout piece: index into pieces, or UINT32_MAX */
  uint64_t *bitmaps;      /* npieces * bitmap_words */
  uint32_t bitmap_words;  /* ceil(W*M / 64) */
  uint32_t pieces_inited; /* piece mutexes initialised, for unwinding */
  uint64_t nelems;        /* arena length in elements */
  float *master, *acc, *m, *v;
  uint16_t *low;
  /* Per piece: CRC32C of its low copy (numel * 2 bytes), kept with the low
   * copy (initialisation, every apply, restore) so that a pull of the stored
   * dtype is sent straight from the arena with no copy and no CRC pass. */
  uint32_t *low_crc;
  uint64_t state_bytes;
  const layout_range *ranges; /* this shard's ranges, into layout */
  uint32_t nranges;
  optim_plan *plans; /* per range, rebuilt by every apply */
  float **range_m;   /* per range: m arena base or NULL when the group has no use */
  float **range_v;
  apply_task *tasks;
  size_t ntasks;
  double *block_sums; /* per statistics block, written by the pool */
  int *block_nonfinite;
  size_t nblocks;

  /* Step state, under mu (version also under state_rw, see the top). */
  uint64_t version;
  uint32_t initialized_pieces;
  uint32_t complete_pieces;
  stats_phase stats_phase;
  core_stats_result stats; /* of step version + 1 when STATS_READY */
  int last_stats_valid;
  core_stats_result last_stats; /* of step version, once applied */
  apply_state apply_state;
  double apply_lr;
  float apply_coef;
  int apply_skip;
  int last_apply_valid;
  double last_lr;
  float last_coef;
  int last_skip;
  core_apply_result last_apply;
  uint64_t optimizer_steps;
  /* Per-group learning rates of the queued apply and of the last applied
   * step (core_apply_groups), num_groups entries each, allocated with the
   * job; a count of 0 means lr * lr_scale. Under mu. */
  double *apply_glr, *last_glr;
  uint32_t apply_nglr, last_nglr;
  /* The core_close call the worker is to run (under mu), and whether spec
   * and layout still hold a closed job's, kept so that a pointer core_spec
   * handed out before the close stays readable until the next core_open. */
  ckpt_call *close_call;
  int stale_job;
  /* The client state of `version`, written (by an apply or a restore) under
   * state_rw exclusive and mu like the version, so either lock reads it; and
   * the one the apply of pending_cs_step is to commit, under mu (0: none; a
   * step is never 0). */
  unsigned char client_state[CORE_MAX_CLIENT_STATE];
  size_t client_state_len;
  unsigned char pending_cs[CORE_MAX_CLIENT_STATE];
  size_t pending_cs_len;
  uint64_t pending_cs_step;
  waiter *version_waiters, *stats_waiters, *apply_waiters;
  waiter *snapshot_waiters; /* core_snapshot calls, keyed by step */
  ckpt_call *restore_call;  /* the core_restore call the worker is to run */
  /* Where the state came from: core_restore sets these (under state_rw
   * exclusive and mu), an apply clears ckpt_untouched. */
  int ckpt_loaded;
  uint64_t ckpt_step;
  int ckpt_untouched;
  uint64_t next_deadline; /* the worker's next wake-up; UINT64_MAX when none */
  int version_event;      /* initialisation finished: version waiters may fire */
  int stop;

  /* Counters: the atomic ones are bumped on the push and read paths without
   * taking mu; the others change only with an apply, under mu. */
  atomic_uint_fast64_t pushes, duplicate_pushes, rejected, pulls, bytes_in, bytes_out;
  atomic_uint_fast64_t held_bytes;
  atomic_uint_fast64_t contributions; /* added or held in the pending step */
  /* Pull answers being sent from the low arena (core_pin_low), and whether
   * the worker waits for them to drain before it writes the arena. */
  atomic_uint_fast64_t low_pins;
  atomic_int pin_waiting;
  atomic_int low_dtype; /* the job's param_dtype once open, else 0 */
  uint32_t pin_wait_ms;
  atomic_uint_fast64_t pin_wait_timeouts;
  uint64_t applies, skipped_steps;
  double apply_seconds_total;
  histogram *apply_hist;      /* borrowed, may be NULL; recorded lock-free */
  core_applied_fn applied_fn; /* under mu; see core_set_applied_hook */
  void *applied_arg;
};

/* ---------------------------------------------------------------- helpers */

static uint64_t core_deadline(uint64_t deadline_ms) {
  return deadline_ms ? deadline_ms : clock_now_ms() + CORE_DEFAULT_WAIT_MS;
}

static void *core_arena_alloc(uint64_t bytes) {
  if (bytes == 0)
    return NULL;
  void *p = NULL;
  size_t len = (size_t)((bytes + CORE_ARENA_ALIGN - 1) / CORE_ARENA_ALIGN * CORE_ARENA_ALIGN);
  if (posix_memalign(&p, CORE_ARENA_ALIGN, len) != 0)
    return NULL;
  memset(p, 0, len);
  return p;
}

static int bit_test(const uint64_t *bits, uint32_t k) {
  return (int)((bits[k / 64] >> (k % 64)) & 1u);
}

static void bit_set(uint64_t *bits, uint32_t k) {
  bits[k / 64] |= UINT64_C(1) << (k % 64);
}

/* Invokes and frees every waiter of a fire list. Called with no lock held. */
static void core_fire(waiter *w) {
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

static void waiter_push(waiter **list, waiter *w) {
  w->next = *list;
  *list = w;
}

/* Registers a waiter with a deadline and wakes the worker if the deadline is
 * earlier than the one it sleeps towards. Called with mu held. */
static void core_add_timed(core *c, waiter **list, waiter *w) {
  waiter_push(list, w);
  if (w->deadline < c->next_deadline) {
    c->next_deadline = w->deadline;
    pthread_cond_signal(&c->worker_cv);
  }
}

/* ---------------------------------------------------------------- job */

static void core_job_free(core *c) {
  for (uint32_t i = 0; i < c->pieces_inited; i++) {
    piece_state *ps = &c->pieces[i];
    free(ps->init_chunks);
    if (ps->held) {
      for (uint32_t k = 0; k < c->WM; k++)
        free(ps->held[k]);
      free(ps->held);
    }
    pthread_mutex_destroy(&ps->mu);
  }
  free(c->pieces);
  free(c->local_of);
  free(c->bitmaps);
  free(c->master);
  free(c->acc);
  free(c->m);
  free(c->v);
  free(c->low);
  free(c->low_crc);
  c->low_crc = NULL;
  free(c->plans);
  free(c->range_m);
  free(c->range_v);
  free(c->tasks);
  free(c->block_sums);
  free(c->block_nonfinite);
  free(c->apply_glr);
  free(c->last_glr);
  c->apply_glr = c->last_glr = NULL;
  c->apply_nglr = c->last_nglr = 0;
  layout_free(&c->layout);
  spec_free(&c->spec);
  c->pieces = NULL;
  c->local_of = NULL;
  c->bitmaps = NULL;
  c->master = c->acc = c->m = c->v = NULL;
  c->low = NULL;
  c->plans = NULL;
  c->range_m = c->range_v = NULL;
  c->tasks = NULL;
  c->block_sums = NULL;
  c->block_nonfinite = NULL;
  c->pieces_inited = 0;
  c->npieces = 0;
  c->nelems = 0;
  c->nranges = 0;
  c->ntasks = 0;
  c->nblocks = 0;
}

/* The optimizer parameters of group g with everything that does not depend on
 * the step filled in. */
static optim_params core_group_params(const core *c, uint32_t g) {
  return optim_params_of_group(&c->spec.groups[g], c->spec.param_dtype);
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

  c->local_of = malloc(((size_t)l->num_pieces + 1) * sizeof *c->local_of);
  c->pieces = calloc((size_t)c->npieces + 1, sizeof *c->pieces);
  c->bitmaps = calloc((size_t)c->npieces * c->bitmap_words + 1, sizeof *c->bitmaps);
  c->low_crc = calloc((size_t)c->npieces + 1, sizeof *c->low_crc);
  if (!c->local_of || !c->pieces || !c->bitmaps || !c->low_crc)
    return ZS_ENOMEM;
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
  c->master = core_arena_alloc(b32);
  c->acc = core_arena_alloc(b32);
  c->low = core_arena_alloc(c->nelems * sizeof(uint16_t));
  if (need_m)
    c->m = core_arena_alloc(b32);
  if (need_v)
    c->v = core_arena_alloc(b32);
  if (c->nelems > 0 && (!c->master || !c->acc || !c->low || (need_m && !c->m) || (need_v && !c->v)))
    return ZS_ENOMEM;
  c->state_bytes = b32 * (2u + (uint64_t)need_m + (uint64_t)need_v) + c->nelems * 2u;

  c->plans = calloc((size_t)c->nranges + 1, sizeof *c->plans);
  c->range_m = calloc((size_t)c->nranges + 1, sizeof *c->range_m);
  c->range_v = calloc((size_t)c->nranges + 1, sizeof *c->range_v);
  if (!c->plans || !c->range_m || !c->range_v)
    return ZS_ENOMEM;
  size_t ntasks = 0;
  for (uint32_t r = 0; r < c->nranges; r++) {
    unsigned uses = optim_state_needs(&c->spec.groups[c->ranges[r].group]);
    c->range_m[r] = (uses & OPTIM_STATE_M) ? c->m : NULL;
    c->range_v[r] = (uses & OPTIM_STATE_V) ? c->v : NULL;
    uint64_t len = c->ranges[r].end - c->ranges[r].begin;
    ntasks += (size_t)((len + CORE_APPLY_CHUNK - 1) / CORE_APPLY_CHUNK);
  }
  c->tasks = calloc(ntasks + 1, sizeof *c->tasks);
  if (!c->tasks)
    return ZS_ENOMEM;
  for (uint32_t r = 0; r < c->nranges; r++) {
    for (uint64_t b = c->ranges[r].begin; b < c->ranges[r].end; b += CORE_APPLY_CHUNK) {
      uint64_t e =
          c->ranges[r].end - b < CORE_APPLY_CHUNK ? c->ranges[r].end : b + CORE_APPLY_CHUNK;
      c->tasks[c->ntasks++] = (apply_task){.range = r, .begin = b, .n = e - b};
    }
  }

  c->nblocks = (size_t)((c->nelems + CORE_STATS_BLOCK - 1) / CORE_STATS_BLOCK);
  c->block_sums = calloc(c->nblocks + 1, sizeof *c->block_sums);
  c->block_nonfinite = calloc(c->nblocks + 1, sizeof *c->block_nonfinite);
  if (!c->block_sums || !c->block_nonfinite)
    return ZS_ENOMEM;
  c->apply_glr = calloc((size_t)c->spec.num_groups + 1, sizeof *c->apply_glr);
  c->last_glr = calloc((size_t)c->spec.num_groups + 1, sizeof *c->last_glr);
  if (!c->apply_glr || !c->last_glr)
    return ZS_ENOMEM;
  return 0;
}

/* Sets the statistics state of a fresh pending step (version + 1). A shard
 * that owns no piece never receives a contribution, so its statistics are
 * complete (and zero) from the start. Called with mu held. */
static void core_begin_step(core *c) {
  c->complete_pieces = 0;
  memset(&c->stats, 0, sizeof c->stats);
  c->stats.step = c->version + 1;
  c->stats_phase = c->npieces == 0 ? STATS_READY : STATS_WAITING;
}

/* ---------------------------------------------------------------- lookups */

/* The checks every job request starts with. Called with state_rw or mu held. */
static int core_check_job(const core *c, uint64_t hash, char *err, size_t errlen) {
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
 * checkpoint before going on. Called with state_rw or mu held. */
static int core_behind(const core *c, const char *what, uint64_t step, char *err, size_t errlen) {
  return status_fail(err, errlen, ZS_EBEHIND,
                     "%s for step %" PRIu64 " but shard %u holds checkpoint step %" PRIu64
                     " (version %" PRIu64
                     "): it restarted or was restored behind the cluster; restore the job to a "
                     "checkpoint (zs_restore, zshard restore) to resume",
                     what, step, c->shard_id, c->ckpt_step, c->version);
}

/* The state of piece (tensor, slice) if this shard owns it. Called with
 * state_rw held. */
static int core_find_piece(core *c, uint32_t tensor, uint32_t slice, piece_state **out, char *err,
                           size_t errlen) {
  const layout *l = &c->layout;
  /* Every sentence starts the same way, so that a caller can tell "not
   * here" apart from why without parsing. */
  if (tensor >= l->num_tensors)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: the job has %u tensors",
                       tensor, slice, l->num_tensors);
  const layout_piece *lp = layout_find(l, tensor, slice);
  if (!lp)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: tensor %u has no slice %u",
                       tensor, slice, tensor, slice);
  if (lp->shard != c->shard_id)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: it is owned by shard %u, "
                       "not by shard %u",
                       tensor, slice, lp->shard, c->shard_id);
  *out = &c->pieces[c->local_of[lp - l->pieces]];
  return 0;
}

static int core_check_payload(const piece_state *ps, int dtype, size_t nbytes, const void *data,
                              char *err, size_t errlen) {
  int rc = dtype_check(dtype, err, errlen);
  if (rc != 0)
    return rc;
  uint64_t want = dtype_bytes(dtype, ps->lp->numel);
  if ((uint64_t)nbytes != want)
    return status_fail(err, errlen, ZS_ESIZE,
                       "payload of slice %u of tensor %u has %zu bytes, expected %" PRIu64,
                       ps->lp->slice, ps->lp->tensor, nbytes, want);
  if (!data)
    return status_fail(err, errlen, ZS_EINVAL, "payload pointer is NULL");
  return 0;
}

/* ---------------------------------------------------------------- worker */

/* Moves every version waiter whose condition holds to the fire list. Called
 * with mu held. */
static void core_collect_versions(core *c, waiter **fire) {
  if (!c->open || c->initialized_pieces < c->npieces)
    return;
  for (waiter **pw = &c->version_waiters; *pw;) {
    waiter *w = *pw;
    if (w->key <= c->version) {
      *pw = w->next;
      w->status = ZS_OK;
      w->version = c->version;
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
        *pw = w->next;
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
  c->stats_phase = STATS_READY;
  while (c->stats_waiters) {
    waiter *w = c->stats_waiters;
    c->stats_waiters = w->next;
    w->status = ZS_OK;
    w->stats = c->stats;
    waiter_push(&fire, w);
  }
  pthread_mutex_unlock(&c->mu);
  core_fire(fire);
}

/* The checks of a read of piece (tensor, slice) into nbytes of dtype at dst:
 * the job, the piece's owner, the size. With state_rw held. */
static int core_find_readable(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                              zs_dtype dtype, size_t nbytes, const void *dst, piece_state **ps,
                              char *err, size_t errlen) {
  int rc = core_check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, ps, err, errlen);
  if (rc == 0)
    rc = core_check_payload(*ps, (int)dtype, nbytes, dst, err, errlen);
  return rc;
}

/* ------------------------------------------------------- the low copy's pins */

/* How long the worker waits for pull answers still being sent from the low
 * arena before it writes it anyway. Steady training never waits: every
 * trainer has received the pulls of a version before it can push the step
 * that ends it. A peer that stalls mid-answer for longer receives an answer
 * torn between two versions, which its CRC32C check refuses (the client
 * then asks again), rather than holding every other trainer's step. */
#define CORE_PIN_WAIT_MS 2000u /* the default of core_config.pin_wait_ms */

static void piece_low_crc(core *c, uint32_t i) {
  const layout_piece *lp = c->pieces[i].lp;
  c->low_crc[i] = crc32c(0, c->low + lp->arena_off, (size_t)lp->numel * sizeof(uint16_t));
}

static void core_low_crc_task(void *arg, size_t i) {
  piece_low_crc(arg, (uint32_t)i);
}

/* With state_rw held exclusively (so no new pin can start): waits until no
 * answer is being sent from the low arena, or CORE_PIN_WAIT_MS. */
static void core_wait_pins(core *c, const char *what) {
  if (atomic_load(&c->low_pins) == 0)
    return;
  uint64_t deadline = clock_now_ms() + c->pin_wait_ms;
  pthread_mutex_lock(&c->mu);
  atomic_store(&c->pin_waiting, 1);
  while (atomic_load(&c->low_pins) > 0) {
    uint64_t now = clock_now_ms();
    if (now >= deadline)
      break;
    struct timespec ts = {.tv_sec = (time_t)(deadline / 1000u),
                          .tv_nsec = (long)(deadline % 1000u) * 1000000L};
    pthread_cond_timedwait(&c->worker_cv, &c->mu, &ts);
  }
  atomic_store(&c->pin_waiting, 0);
  uint64_t left = atomic_load(&c->low_pins);
  pthread_mutex_unlock(&c->mu);
  if (left > 0) {
    atomic_fetch_add_explicit(&c->pin_wait_timeouts, 1, memory_order_relaxed);
    LOG_WARN("pull_answers_overtaken",
             "shard=%u what=%s answers=%" PRIu64 " waited_ms=%u detail=\"answers still being "
             "sent from the low copy; their readers will refuse them by CRC and ask again\"",
             c->shard_id, what, left, c->pin_wait_ms);
  }
}

int core_pin_low(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                 size_t nbytes, const void **data, uint64_t *version, uint32_t *crc, char *err,
                 size_t errlen) {
  piece_state *ps = NULL;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_find_readable(c, hash, tensor, slice, dtype, nbytes, data, &ps, err, errlen);
  if (rc == 0 && (dtype != c->spec.param_dtype || !ps->initialized))
    rc = CORE_NOT_PINNED;
  if (rc == 0) {
    uint32_t i = (uint32_t)(ps - c->pieces);
    *data = c->low + ps->lp->arena_off;
    *crc = c->low_crc[i];
    if (version)
      *version = c->version;
    atomic_fetch_add(&c->low_pins, 1);
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

zs_dtype core_low_dtype(core *c) {
  return (zs_dtype)atomic_load(&c->low_dtype);
}

void core_unpin_low(core *c) {
  if (atomic_fetch_sub(&c->low_pins, 1) == 1 && atomic_load(&c->pin_waiting)) {
    pthread_mutex_lock(&c->mu);
    pthread_cond_broadcast(&c->worker_cv);
    pthread_mutex_unlock(&c->mu);
  }
}

static void core_apply_chunk(void *arg, size_t i) {
  core *c = arg;
  const apply_task *t = &c->tasks[i];
  float *m = c->range_m[t->range] ? c->range_m[t->range] + t->begin : NULL;
  float *v = c->range_v[t->range] ? c->range_v[t->range] + t->begin : NULL;
  optim_apply(&c->plans[t->range], c->master + t->begin, m, v, c->acc + t->begin, c->low + t->begin,
              (size_t)t->n);
}

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
    float grad_scale =
        c->spec.reduce == SPEC_REDUCE_MEAN ? (float)((double)coef / (double)c->W) : coef;
    for (uint32_t r = 0; r < c->nranges; r++) {
      optim_params p = core_group_params(c, c->ranges[r].group);
      p.lr = glr ? glr[c->ranges[r].group] : lr * c->spec.groups[c->ranges[r].group].lr_scale;
      p.step = opt_steps;
      p.grad_scale = grad_scale;
      optim_plan_init(&c->plans[r], &p);
    }
    core_wait_pins(c, "apply");
    pool_run(c->pool, c->ntasks, core_apply_chunk, c);
    pool_run(c->pool, c->npieces, core_low_crc_task, c);
  }
  double seconds = (double)(clock_now_ns() - t0) / 1e9;
  histogram_observe_seconds(c->apply_hist, seconds);
  /* Every piece completed the step, so nothing is held: only the bitmaps and
   * next_k need resetting. No push runs while state_rw is held exclusively. */
  for (uint32_t i = 0; i < c->npieces; i++) {
    c->pieces[i].next_k = 0;
    c->pieces[i].one_before_zero = 0;
  }
  if (c->npieces > 0)
    memset(c->bitmaps, 0, (size_t)c->npieces * c->bitmap_words * sizeof *c->bitmaps);
  atomic_store_explicit(&c->contributions, 0, memory_order_relaxed);

  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
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
  c->last_stats_valid = 1;
  c->last_apply_valid = 1;
  c->last_lr = lr;
  c->last_coef = coef;
  c->last_skip = skip;
  c->last_nglr = c->apply_nglr;
  if (c->apply_nglr)
    memcpy(c->last_glr, c->apply_glr, c->apply_nglr * sizeof *c->last_glr);
  c->last_apply = (core_apply_result){
      .step = step, .version = step, .skipped = skip, .optimizer_steps = opt_steps};
  c->apply_state = APPLY_NONE;
  core_begin_step(c);
  while (c->apply_waiters) {
    waiter *w = c->apply_waiters;
    c->apply_waiters = w->next;
    w->status = ZS_OK;
    w->apply = c->last_apply;
    waiter_push(&fire, w);
  }
  core_collect_versions(c, &fire);
  core_applied_fn applied = c->applied_fn;
  void *applied_arg = c->applied_arg;
  core_apply_result done = c->last_apply;
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);

  LOG_DEBUG("apply", "shard=%u step=%" PRIu64 " skipped=%d seconds=%.6f", c->shard_id, step, skip,
            seconds);
  /* Before the callbacks: whoever hangs on the hook hears of the step no
   * later than the trainers whose Apply it answers. */
  if (applied)
    applied(applied_arg, &done);
  core_fire(fire);
}

static waiter *core_take_snapshot(core *c, waiter **fire);
static void core_run_snapshot(core *c, waiter *w);
static void core_run_restore(core *c, ckpt_call *call);
static void core_run_close(core *c, ckpt_call *call);

static void *core_worker(void *arg) {
  core *c = arg;
  pthread_mutex_lock(&c->mu);
  while (!c->stop) {
    waiter *fire = NULL;
    uint64_t next = core_collect_expired(c, clock_now_ms(), &fire);
    if (c->version_event) {
      c->version_event = 0;
      core_collect_versions(c, &fire);
    }
    int do_stats = c->stats_phase == STATS_COMPUTING;
    /* A restore, then snapshots of the current version, go before the next
     * apply: a snapshot asked for version v must see v, not v + 1. */
    /* A close goes first: it refuses while a restore or snapshot is pending. */
    ckpt_call *close = do_stats ? NULL : c->close_call;
    if (close) {
      c->close_call = NULL;
      pthread_mutex_unlock(&c->mu);
      core_fire(fire);
      core_run_close(c, close);
      pthread_mutex_lock(&c->mu);
      continue;
    }
    ckpt_call *restore = do_stats ? NULL : c->restore_call;
    if (restore)
      c->restore_call = NULL;
    waiter *snap = do_stats || restore ? NULL : core_take_snapshot(c, &fire);
    int do_apply = !do_stats && !restore && !snap && c->apply_state == APPLY_QUEUED;
    if (fire || do_stats || restore || snap || do_apply) {
      pthread_mutex_unlock(&c->mu);
      core_fire(fire);
      if (do_stats)
        core_compute_stats(c);
      else if (restore)
        core_run_restore(c, restore);
      else if (snap)
        core_run_snapshot(c, snap);
      else if (do_apply)
        core_run_apply(c);
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
  c->pin_wait_ms = cfg->pin_wait_ms ? cfg->pin_wait_ms : CORE_PIN_WAIT_MS;
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
  atomic_init(&c->low_pins, 0);
  atomic_init(&c->pin_waiting, 0);
  atomic_init(&c->low_dtype, 0);
  atomic_init(&c->pin_wait_timeouts, 0);

  int rc = ZS_ENOMEM;
  if (pthread_mutex_init(&c->mu, NULL) != 0)
    goto fail;
  c->mu_inited = 1;
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
  if (pthread_create(&c->worker, NULL, core_worker, c) != 0)
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
      *lists[i] = w->next;
      w->status = ZS_ECLOSED;
      w->version = c->version;
      w->stats.step = w->key;
      w->apply.step = w->key;
      w->apply.version = c->version;
      w->apply.optimizer_steps = c->optimizer_steps;
      waiter_push(&fire, w);
    }
  }
  core_fire(fire);
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
  core_begin_step(c);
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
    pthread_mutex_unlock(&c->mu);
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

/* ---------------------------------------------------------------- data */

static uint64_t chunks_of(uint64_t numel) {
  return (numel + LAYOUT_INIT_CHUNK_ELEMS - 1) / LAYOUT_INIT_CHUNK_ELEMS;
}

static int chunk_have(const piece_state *ps, uint64_t k) {
  if (ps->initialized)
    return 1;
  return ps->init_chunks && (ps->init_chunks[k / 64] >> (k % 64) & 1u);
}

/* Checks a part of the initial weights against the piece and against what
 * was written before; with state_rw held exclusively. */
static int init_range_check(core *c, const piece_state *ps, uint64_t offset, const float *data,
                            size_t nbytes, char *err, size_t errlen) {
  const layout_piece *lp = ps->lp;
  if (!data)
    return status_fail(err, errlen, ZS_EINVAL, "payload pointer is NULL");
  if (nbytes % sizeof(float) != 0 || nbytes == 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights of %zu bytes are not a positive number of float32", nbytes);
  uint64_t n = nbytes / sizeof(float);
  if (offset % LAYOUT_INIT_CHUNK_ELEMS != 0)
    return status_fail(err, errlen, ZS_ERANGE,
                       "initial weights at element %" PRIu64 " of slice %u of tensor %u: a part "
                       "must start at a multiple of %u elements",
                       offset, lp->slice, lp->tensor, LAYOUT_INIT_CHUNK_ELEMS);
  if (offset > lp->numel || n > lp->numel - offset)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights for elements [%" PRIu64 ", %" PRIu64 ") of slice %u of "
                       "tensor %u, which has %" PRIu64 " elements",
                       offset, offset + n, lp->slice, lp->tensor, lp->numel);
  if ((offset + n) % LAYOUT_INIT_CHUNK_ELEMS != 0 && offset + n != lp->numel)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights for elements [%" PRIu64 ", %" PRIu64 ") of slice %u of "
                       "tensor %u: a part must end at a multiple of %u elements or at the "
                       "piece's end (%" PRIu64 ")",
                       offset, offset + n, lp->slice, lp->tensor, LAYOUT_INIT_CHUNK_ELEMS,
                       lp->numel);
  if (c->version > 0)
    return 0; /* training has moved on: the initial weights are history */
  const float *dst = c->master + lp->arena_off;
  for (uint64_t e = offset; e < offset + n; e += LAYOUT_INIT_CHUNK_ELEMS) {
    uint64_t k = e / LAYOUT_INIT_CHUNK_ELEMS;
    uint64_t len =
        offset + n - e < LAYOUT_INIT_CHUNK_ELEMS ? offset + n - e : LAYOUT_INIT_CHUNK_ELEMS;
    if (chunk_have(ps, k) && memcmp(dst + e, data + (e - offset), len * sizeof(float)) != 0)
      return status_fail(err, errlen, ZS_EEXIST,
                         "slice %u of tensor %u already holds different initial weights (elements "
                         "from %" PRIu64 ")",
                         lp->slice, lp->tensor, e);
  }
  return 0;
}

int core_init_params_range(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                           const float *data, size_t nbytes, int *written, uint64_t *version,
                           char *err, size_t errlen) {
  piece_state *ps = NULL;
  int w = 0;
  pthread_rwlock_wrlock(&c->state_rw);
  int rc = core_check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc == 0)
    rc = init_range_check(c, ps, offset, data, nbytes, err, errlen);
  if (rc != 0 || c->version > 0 || ps->initialized)
    goto done;
  uint64_t total = chunks_of(ps->lp->numel);
  if (!ps->init_chunks && !(ps->init_chunks = calloc((total + 63) / 64, sizeof(uint64_t)))) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory for the initial weights' bitmap");
    goto done;
  }
  float *dst = c->master + ps->lp->arena_off;
  uint64_t end = offset + nbytes / sizeof(float);
  for (uint64_t e = offset; e < end; e += LAYOUT_INIT_CHUNK_ELEMS) {
    uint64_t k = e / LAYOUT_INIT_CHUNK_ELEMS;
    if (chunk_have(ps, k))
      continue;
    size_t len = (size_t)(end - e < LAYOUT_INIT_CHUNK_ELEMS ? end - e : LAYOUT_INIT_CHUNK_ELEMS);
    memcpy(dst + e, data + (e - offset), len * sizeof(float));
    dtype_from_f32(c->spec.param_dtype, dst + e, c->low + ps->lp->arena_off + e, len);
    ps->init_chunks[k / 64] |= (uint64_t)1 << (k % 64);
    ps->init_have++;
    w = 1;
  }
  if (ps->init_have == total) {
    free(ps->init_chunks);
    ps->init_chunks = NULL;
    piece_low_crc(c, (uint32_t)(ps - c->pieces));
    ps->initialized = 1;
    pthread_mutex_lock(&c->mu);
    if (++c->initialized_pieces == c->npieces) {
      c->version_event = 1;
      pthread_cond_signal(&c->worker_cv);
    }
    pthread_mutex_unlock(&c->mu);
  }
done:
  if (rc == 0) {
    if (written)
      *written = w;
    if (version)
      *version = c->version;
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

int core_init_params(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, const float *data,
                     size_t nbytes, int *written, uint64_t *version, char *err, size_t errlen) {
  return core_init_params_range(c, hash, tensor, slice, 0, data, nbytes, written, version, err,
                                errlen);
}

/* Adds contribution data into the piece's accumulator range. */
static void piece_add(core *c, piece_state *ps, zs_dtype dtype, const void *data) {
  dtype_accumulate(dtype, data, c->acc + ps->lp->arena_off, (size_t)ps->lp->numel);
}

/* The push proper, with state_rw held shared. */
static int core_push_locked(core *c, const core_push_args *a, int *duplicate, char *err,
                            size_t errlen) {
  int rc = core_check_job(c, a->hash, err, errlen);
  if (rc != 0)
    return rc;
  if (a->step > c->version + 1 && c->ckpt_loaded)
    return core_behind(c, "push", a->step, err, errlen);
  if (a->step == 0 || a->step > c->version + 1)
    return status_fail(err, errlen, ZS_ESTEP,
                       "push for step %" PRIu64 " but shard %u expects step %" PRIu64, a->step,
                       c->shard_id, c->version + 1);
  if (a->rank >= c->W || a->micro >= c->M)
    return status_fail(err, errlen, ZS_ERANGE,
                       "rank %u / micro-batch %u out of range (world size %u, accumulation %u)",
                       a->rank, a->micro, c->W, c->M);
  piece_state *ps = NULL;
  if ((rc = core_find_piece(c, a->tensor, a->slice, &ps, err, errlen)) != 0)
    return rc;
  if ((rc = core_check_payload(ps, (int)a->dtype, a->nbytes, a->data, err, errlen)) != 0)
    return rc;
  if (a->step <= c->version) {
    /* A step is applied only after every contribution arrived, so a push for
     * an applied step is a retry whose first copy got through (its answer was
     * lost): acknowledge it as a duplicate, as the design's idempotent push
     * promises, and add nothing. */
    atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->duplicate_pushes, 1, memory_order_relaxed);
    if (duplicate)
      *duplicate = 1;
    return 0;
  }

  /* Contribution order is (micro, rank), so the sum never depends on which
   * push arrives first: acc = (((0 + g0) + g1) + g2) + ... with each addition
   * rounded. Floating-point addition is not associative but it is
   * commutative, and 0 + x is x except that -0 becomes +0, so
   * (0 + g1) + g0 has the bits of (0 + g0) + g1 (NaN payloads aside, and a
   * non-finite step is skipped whatever its bits): contribution 1 is added
   * at once when it comes before 0, which spares every out-of-order arrival
   * a held copy when W * M = 2 and the first one otherwise. */
  uint32_t k = a->micro * c->W + a->rank;
  int completed = 0;
  pthread_mutex_lock(&ps->mu);
  if (bit_test(ps->received, k)) {
    pthread_mutex_unlock(&ps->mu);
    atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->duplicate_pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->bytes_in, a->nbytes, memory_order_relaxed);
    if (duplicate)
      *duplicate = 1;
    return 0;
  }
  if (k == 1 && ps->next_k == 0) {
    /* Before 0, which it commutes with: added now, next_k stays. */
    piece_add(c, ps, a->dtype, a->data);
    ps->one_before_zero = 1;
  } else if (k == ps->next_k) {
    /* In turn: added straight from the caller's buffer, no copy. */
    piece_add(c, ps, a->dtype, a->data);
    ps->next_k++;
    if (ps->one_before_zero) {
      ps->one_before_zero = 0;
      ps->next_k++;
    }
    while (ps->nheld > 0 && ps->next_k < c->WM && ps->held[ps->next_k]) {
      held_contrib *h = ps->held[ps->next_k];
      piece_add(c, ps, h->dtype, h->data);
      ps->held[ps->next_k] = NULL;
      atomic_fetch_sub_explicit(&c->held_bytes, h->nbytes, memory_order_relaxed);
      free(h);
      ps->nheld--;
      ps->next_k++;
    }
    if (ps->nheld == 0) {
      free(ps->held);
      ps->held = NULL;
    }
  } else {
    /* Early (k > next_k, since every k < next_k is marked received): one copy
     * of the payload, kept until its turn. */
    if (!ps->held) {
      ps->held = calloc(c->WM, sizeof *ps->held);
      if (!ps->held) {
        pthread_mutex_unlock(&ps->mu);
        return status_fail(err, errlen, ZS_ENOMEM, "out of memory holding an early push");
      }
    }
    held_contrib *h = malloc(sizeof *h + a->nbytes);
    if (!h) {
      if (ps->nheld == 0) {
        free(ps->held);
        ps->held = NULL;
      }
      pthread_mutex_unlock(&ps->mu);
      return status_fail(err, errlen, ZS_ENOMEM, "out of memory holding an early push");
    }
    h->dtype = a->dtype;
    h->nbytes = a->nbytes;
    memcpy(h->data, a->data, a->nbytes);
    ps->held[k] = h;
    ps->nheld++;
    atomic_fetch_add_explicit(&c->held_bytes, a->nbytes, memory_order_relaxed);
  }
  bit_set(ps->received, k);
  atomic_fetch_add_explicit(&c->contributions, 1, memory_order_relaxed);
  completed = ps->next_k == c->WM;
  if (completed) {
    pthread_mutex_lock(&c->mu);
    if (++c->complete_pieces == c->npieces) {
      c->stats_phase = STATS_COMPUTING;
      pthread_cond_signal(&c->worker_cv);
    }
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&ps->mu);
  atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&c->bytes_in, a->nbytes, memory_order_relaxed);
  return 0;
}

int core_push(core *c, const core_push_args *a, int *duplicate, char *err, size_t errlen) {
  if (duplicate)
    *duplicate = 0;
  if (!a) {
    atomic_fetch_add_explicit(&c->rejected, 1, memory_order_relaxed);
    return status_fail(err, errlen, ZS_EINVAL, "no push arguments given");
  }
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_push_locked(c, a, duplicate, err, errlen);
  pthread_rwlock_unlock(&c->state_rw);
  if (rc != 0)
    atomic_fetch_add_explicit(&c->rejected, 1, memory_order_relaxed);
  return rc;
}

/* Bytes per chunk of a read with a CRC: small enough that the chunk just
 * written is still in L1/L2 when the CRC reads it. */
#define CORE_READ_CHUNK (64u << 10)

int core_read_crc(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                  void *dst, size_t nbytes, uint64_t *version, uint32_t *crc, char *err,
                  size_t errlen) {
  piece_state *ps = NULL;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_find_readable(c, hash, tensor, slice, dtype, nbytes, dst, &ps, err, errlen);
  if (rc == 0) {
    uint64_t off = ps->lp->arena_off, numel = ps->lp->numel;
    const dtype_codec *k = dtype_codec_of(dtype);
    /* fp32 and the stored low-precision copy are copies; another dtype is
     * converted from the master. */
    const unsigned char *copy_from =
        dtype == ZS_DTYPE_FP32         ? (const unsigned char *)(c->master + off)
        : dtype == c->spec.param_dtype ? (const unsigned char *)(c->low + off)
                                       : NULL;
    /* Chunks of whole blocks of about CORE_READ_CHUNK bytes: each is an
     * array of its own, starting at byte dtype_bytes(e) (dtype.h). */
    uint64_t step = numel;
    if (crc) {
      step = CORE_READ_CHUNK / (k->block * k->elem_bytes + k->scale_bytes) * k->block;
      step = step ? step : k->block;
    }
    unsigned char *out = dst;
    for (uint64_t e = 0; e < numel; e += step) {
      uint64_t cnt = numel - e < step ? numel - e : step;
      size_t b = (size_t)dtype_bytes(dtype, e), len = (size_t)dtype_bytes(dtype, cnt);
      if (copy_from)
        memcpy(out + b, copy_from + b, len);
      else
        dtype_from_f32(dtype, c->master + off + e, out + b, (size_t)cnt);
      if (crc)
        *crc = crc32c(*crc, out + b, len);
    }
    if (version)
      *version = c->version;
  }
  pthread_rwlock_unlock(&c->state_rw);
  /* Pulls are counted by the transport (core_count_pull), which knows the
   * bytes it really put on the wire. */
  return rc;
}

int core_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype, void *dst,
              size_t nbytes, uint64_t *version, char *err, size_t errlen) {
  return core_read_crc(c, hash, tensor, slice, dtype, dst, nbytes, version, NULL, err, errlen);
}

int64_t core_piece_bytes_err(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                             zs_dtype dtype, char *err, size_t errlen) {
  piece_state *ps = NULL;
  int64_t r;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc == 0 && !dtype_valid((int)dtype))
    rc = dtype_check((int)dtype, err, errlen);
  r = rc != 0 ? rc : (int64_t)dtype_bytes((int)dtype, ps->lp->numel);
  pthread_rwlock_unlock(&c->state_rw);
  return r;
}

int64_t core_piece_bytes(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype) {
  return core_piece_bytes_err(c, hash, tensor, slice, dtype, NULL, 0);
}

/* ---------------------------------------------------------------- waits */

int core_wait_version(core *c, uint64_t hash, uint64_t min_version, uint64_t deadline_ms,
                      core_version_cb cb, void *arg, uint64_t *version, char *err, size_t errlen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core_check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  if (c->initialized_pieces == c->npieces && c->version >= min_version) {
    if (version)
      *version = c->version;
    goto done;
  }
  if (c->ckpt_loaded && min_version > c->version + 1) {
    rc = core_behind(c, "wait", min_version, err, errlen);
    goto done;
  }
  uint64_t deadline = core_deadline(deadline_ms);
  if (deadline <= clock_now_ms()) {
    rc = status_fail(err, errlen, ZS_ETIMEDOUT,
                     "deadline passed waiting for version %" PRIu64 " (shard %u is at %" PRIu64
                     ", %u of %u pieces initialised)",
                     min_version, c->shard_id, c->version, c->initialized_pieces, c->npieces);
    goto done;
  }
  waiter *w = calloc(1, sizeof *w);
  if (!w) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering a wait");
    goto done;
  }
  w->kind = WAITER_VERSION;
  w->key = min_version;
  w->deadline = deadline;
  w->cb.version = cb;
  w->arg = arg;
  core_add_timed(c, &c->version_waiters, w);
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int core_grad_stats(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_stats_cb cb,
                    void *arg, core_stats_result *out, char *err, size_t errlen) {
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core_check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  if (c->last_stats_valid && step == c->version) {
    if (out)
      *out = c->last_stats;
    goto done;
  }
  if (c->ckpt_loaded && step > c->version + 1) {
    rc = core_behind(c, "statistics", step, err, errlen);
    goto done;
  }
  if (step != c->version + 1) {
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "statistics asked for step %" PRIu64 " but shard %u is at version %" PRIu64
                     " (pending step %" PRIu64 ")",
                     step, c->shard_id, c->version, c->version + 1);
    goto done;
  }
  if (c->stats_phase == STATS_READY) {
    if (out)
      *out = c->stats;
    goto done;
  }
  uint64_t deadline = core_deadline(deadline_ms);
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
  core_add_timed(c, &c->stats_waiters, w);
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int core_check_acked(core *c, uint64_t hash, uint64_t step, uint32_t rank, char *err,
                     size_t errlen) {
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_check_job(c, hash, err, errlen);
  if (rc != 0 || step != c->version + 1 || rank >= c->W) {
    pthread_rwlock_unlock(&c->state_rw);
    return rc == 0 ? 0 : rc;
  }
  uint32_t lost_tensor = 0, lost_slice = 0, lost_micro = 0, lost = 0;
  for (uint32_t i = 0; i < c->npieces && !lost; i++) {
    piece_state *ps = &c->pieces[i];
    pthread_mutex_lock(&ps->mu);
    for (uint32_t m = 0; m < c->M; m++) {
      if (!bit_test(ps->received, m * c->W + rank)) {
        lost = 1;
        lost_tensor = ps->lp->tensor;
        lost_slice = ps->lp->slice;
        lost_micro = m;
        break;
      }
    }
    pthread_mutex_unlock(&ps->mu);
  }
  if (lost) {
    pthread_mutex_lock(&c->mu);
    int ready = c->stats_phase == STATS_READY;
    pthread_mutex_unlock(&c->mu);
    if (ready)
      lost = 0;
  }
  if (lost && c->ckpt_loaded)
    rc = status_fail(err, errlen, ZS_EBEHIND,
                     "rank %u's acknowledged contribution to step %" PRIu64
                     " (tensor %u slice %u micro %u) is gone: shard %u restarted or was restored "
                     "at checkpoint step %" PRIu64 " (version %" PRIu64
                     "); restore the job to a checkpoint (zs_restore, "
                     "zshard restore) to resume",
                     rank, step, lost_tensor, lost_slice, lost_micro, c->shard_id, c->ckpt_step,
                     c->version);
  else if (lost)
    rc = status_fail(err, errlen, ZS_EINTERNAL,
                     "rank %u's acknowledged contribution to step %" PRIu64
                     " (tensor %u slice %u micro %u) is missing on shard %u",
                     rank, step, lost_tensor, lost_slice, lost_micro, c->shard_id);
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

uint32_t core_missing(core *c, uint64_t step, core_missing_entry *out, uint32_t max) {
  uint64_t total = 0;
  pthread_rwlock_rdlock(&c->state_rw);
  if (!c->open || step != c->version + 1)
    goto done;
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    pthread_mutex_lock(&ps->mu);
    /* Every k below next_k has been received; the rest is read off the
     * bitmap. k ascending is (micro, rank) ascending. */
    for (uint32_t k = ps->next_k; k < c->WM; k++) {
      if (bit_test(ps->received, k))
        continue;
      if (out && total < max)
        out[total] = (core_missing_entry){
            .rank = k % c->W, .micro = k / c->W, .tensor = ps->lp->tensor, .slice = ps->lp->slice};
      total++;
    }
    pthread_mutex_unlock(&ps->mu);
  }
done:
  pthread_rwlock_unlock(&c->state_rw);
  return total > UINT32_MAX ? UINT32_MAX : (uint32_t)total;
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

int core_apply(core *c, uint64_t hash, uint64_t step, double lr, float coef, int skip,
               core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen) {
  return core_apply_groups(c, hash, step, lr, NULL, 0, coef, skip, cb, arg, out, err, errlen);
}

int core_apply_groups(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                      uint32_t ngroup_lr, float coef, int skip, core_apply_cb cb, void *arg,
                      core_apply_result *out, char *err, size_t errlen) {
  waiter *w = NULL;
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core_check_job(c, hash, err, errlen);
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
  if (c->last_apply_valid && step == c->version) {
    if (core_same_apply(lr, coef, skip, c->last_lr, c->last_coef, c->last_skip) &&
        core_same_glr(group_lr, ngroup_lr, c->last_glr, c->last_nglr)) {
      if (out)
        *out = c->last_apply;
    } else {
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " was applied with lr=%g coef=%g skip=%d%s, not lr=%g "
                       "coef=%g skip=%d",
                       step, c->last_lr, (double)c->last_coef, c->last_skip,
                       core_same_glr(group_lr, ngroup_lr, c->last_glr, c->last_nglr)
                           ? ""
                           : " and other group learning rates",
                       lr, (double)coef, !!skip);
    }
    goto done;
  }
  if (c->ckpt_loaded && step > c->version + 1) {
    rc = core_behind(c, "apply", step, err, errlen);
    goto done;
  }
  if (step != c->version + 1) {
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "apply for step %" PRIu64 " but shard %u expects step %" PRIu64, step,
                     c->shard_id, c->version + 1);
    goto done;
  }
  if (c->apply_state != APPLY_NONE) {
    if (!core_same_apply(lr, coef, skip, c->apply_lr, c->apply_coef, c->apply_skip) ||
        !core_same_glr(group_lr, ngroup_lr, c->apply_glr, c->apply_nglr)) {
      rc = status_fail(err, errlen, ZS_EEXIST,
                       "step %" PRIu64 " is being applied with lr=%g coef=%g skip=%d%s, not "
                       "lr=%g coef=%g skip=%d",
                       step, c->apply_lr, (double)c->apply_coef, c->apply_skip,
                       core_same_glr(group_lr, ngroup_lr, c->apply_glr, c->apply_nglr)
                           ? ""
                           : " and other group learning rates",
                       lr, (double)coef, !!skip);
      goto done;
    }
  } else {
    if (c->stats_phase != STATS_READY) {
      uint64_t want = (uint64_t)c->npieces * c->WM;
      uint64_t have = atomic_load_explicit(&c->contributions, memory_order_relaxed);
      rc = status_fail(err, errlen, ZS_ENOTREADY,
                       "step %" PRIu64 " still misses %" PRIu64 " of %" PRIu64
                       " contributions on shard %u",
                       step, want - (have < want ? have : want), want, c->shard_id);
      goto done;
    }
    if (c->initialized_pieces < c->npieces) {
      rc = status_fail(err, errlen, ZS_ENOTREADY,
                       "%u of %u pieces of shard %u have no initial weights",
                       c->npieces - c->initialized_pieces, c->npieces, c->shard_id);
      goto done;
    }
    if (c->stats.nonfinite && !skip) {
      rc = status_fail(err, errlen, ZS_ENONFINITE,
                       "step %" PRIu64 " has non-finite gradients on shard %u: it must be skipped",
                       step, c->shard_id);
      goto done;
    }
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
  if (c->apply_state == APPLY_NONE) {
    c->apply_state = APPLY_QUEUED;
    c->apply_lr = lr;
    c->apply_coef = coef;
    c->apply_skip = !!skip;
    c->apply_nglr = ngroup_lr;
    if (ngroup_lr)
      memcpy(c->apply_glr, group_lr, ngroup_lr * sizeof *c->apply_glr);
    pthread_cond_signal(&c->worker_cv);
  }
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
  int rc = core_check_job(c, hash, err, errlen);
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

const layout *core_layout(core *c) {
  pthread_mutex_lock(&c->mu);
  const layout *l = c->open ? &c->layout : NULL;
  pthread_mutex_unlock(&c->mu);
  return l;
}

/* ---------------------------------------------------------------- checkpoints */

static void ckpt_call_init(ckpt_call *call) {
  memset(call, 0, sizeof *call);
  pthread_mutex_init(&call->mu, NULL);
  pthread_cond_init(&call->cv, NULL);
}

static void ckpt_call_destroy(ckpt_call *call) {
  pthread_cond_destroy(&call->cv);
  pthread_mutex_destroy(&call->mu);
}

/* Waits until the worker (or core_destroy) finished the call. */
static int ckpt_call_wait(ckpt_call *call) {
  pthread_mutex_lock(&call->mu);
  while (!call->done)
    pthread_cond_wait(&call->cv, &call->mu);
  int status = call->status;
  pthread_mutex_unlock(&call->mu);
  return status;
}

static void ckpt_call_finish(ckpt_call *call, int status) {
  pthread_mutex_lock(&call->mu);
  call->status = status;
  call->done = 1;
  pthread_cond_signal(&call->cv);
  pthread_mutex_unlock(&call->mu);
}

/* Takes the first snapshot waiter whose version is the current one (and whose
 * pieces are all initialised) off the list, and moves those whose version is
 * gone to the fire list with ZS_ESTEP. Called on the worker with mu held. */
static waiter *core_take_snapshot(core *c, waiter **fire) {
  waiter *ready = NULL;
  for (waiter **pw = &c->snapshot_waiters; *pw;) {
    waiter *w = *pw;
    if (w->key < c->version) {
      *pw = w->next;
      w->status = ZS_ESTEP;
      waiter_push(fire, w);
    } else if (!ready && w->key == c->version && c->open && c->initialized_pieces == c->npieces) {
      *pw = w->next;
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
static void core_run_snapshot(core *c, waiter *w) {
  ckpt_call *call = w->arg;
  pthread_rwlock_rdlock(&c->state_rw);
  core_view view = {
      .spec = &c->spec,
      .shard_id = c->shard_id,
      .num_shards = c->num_shards,
      .hash = c->hash,
      .version = c->version,
      .optimizer_steps = c->optimizer_steps,
      .nelems = c->nelems,
      .master = c->master,
      .m = c->m,
      .v = c->v,
      .client_state = c->client_state_len ? c->client_state : NULL,
      .client_state_len = c->client_state_len,
  };
  uint64_t t0 = clock_now_ns();
  int rc = call->fn(call->fn_arg, &view);
  call->seconds = (double)(clock_now_ns() - t0) / 1e9;
  pthread_rwlock_unlock(&c->state_rw);
  LOG_DEBUG("snapshot", "shard=%u version=%" PRIu64 " seconds=%.6f status=%d", c->shard_id,
            view.version, call->seconds, rc);
  w->status = rc;
  w->next = NULL;
  core_fire(w);
}

/* Exchanges the arenas with the call's state and resets everything the
 * pending step had gathered. Called on the worker, no lock held. */
static void core_run_restore(core *c, ckpt_call *call) {
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
    core_wait_pins(c, "restore");
    dtype_from_f32(c->spec.param_dtype, c->master, c->low, (size_t)c->nelems);
    memset(c->acc, 0, (size_t)c->nelems * sizeof(float));
    pool_run(c->pool, c->npieces, core_low_crc_task, c);
  }
  /* No push runs while state_rw is held exclusively, so the pieces' own
   * locks are not needed. */
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    if (ps->held) {
      for (uint32_t k = 0; k < c->WM; k++)
        free(ps->held[k]);
      free(ps->held);
      ps->held = NULL;
    }
    ps->nheld = 0;
    ps->next_k = 0;
    ps->one_before_zero = 0;
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
  /* core_restore checked the length. */
  if (st->client_state_len > 0)
    memcpy(c->client_state, st->client_state, st->client_state_len);
  c->client_state_len = st->client_state_len;
  c->pending_cs_step = 0;
  c->pending_cs_len = 0;
  c->initialized_pieces = c->npieces;
  c->apply_state = APPLY_NONE;
  c->last_apply_valid = 0;
  c->last_stats_valid = 0;
  c->ckpt_loaded = 1;
  c->ckpt_step = call->ckpt_step;
  c->ckpt_untouched = 1;
  core_begin_step(c);
  /* Statistics and applies in progress belong to a step that no longer
   * exists here, and so do waits for a version beyond the restored one:
   * their trainers must restore too. */
  waiter **lists[2] = {&c->stats_waiters, &c->apply_waiters};
  for (int i = 0; i < 2; i++) {
    while (*lists[i]) {
      waiter *w = *lists[i];
      *lists[i] = w->next;
      w->status = ZS_EBEHIND;
      w->stats.step = w->key;
      w->apply = (core_apply_result){.step = w->key, .version = c->version};
      waiter_push(&fire, w);
    }
  }
  for (waiter **pw = &c->version_waiters; *pw;) {
    waiter *w = *pw;
    if (w->key > c->version) {
      *pw = w->next;
      w->status = ZS_EBEHIND;
      w->version = c->version;
      waiter_push(&fire, w);
    } else {
      pw = &w->next;
    }
  }
  core_collect_versions(c, &fire);
  uint64_t version = c->version;
  pthread_mutex_unlock(&c->mu);
  pthread_rwlock_unlock(&c->state_rw);
  LOG_DEBUG("restore", "shard=%u checkpoint_step=%" PRIu64 " version=%" PRIu64, c->shard_id,
            call->ckpt_step, version);
  core_fire(fire);
  ckpt_call_finish(call, ZS_OK);
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
  ckpt_call_init(&call);
  call.fn = fn;
  call.fn_arg = arg;
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core_check_job(c, hash, err, errlen);
  if (rc == 0 && step < c->version)
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "version %" PRIu64 " cannot be checkpointed: shard %u is at version %" PRIu64,
                     step, c->shard_id, c->version);
  if (rc == 0) {
    w->kind = WAITER_SNAPSHOT;
    w->key = step;
    w->deadline = core_deadline(deadline_ms);
    w->arg = &call;
    core_add_timed(c, &c->snapshot_waiters, w);
    w = NULL;
    pthread_cond_signal(&c->worker_cv);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc == 0) {
    rc = ckpt_call_wait(&call);
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
  ckpt_call_destroy(&call);
  return rc;
}

void core_cancel_snapshots(core *c) {
  waiter *fire = NULL;
  pthread_mutex_lock(&c->mu);
  while (c->snapshot_waiters) {
    waiter *w = c->snapshot_waiters;
    c->snapshot_waiters = w->next;
    w->status = ZS_ECANCELED;
    waiter_push(&fire, w);
  }
  pthread_mutex_unlock(&c->mu);
  core_fire(fire);
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
  st->master = core_arena_alloc(b32);
  if (need_m)
    st->m = core_arena_alloc(b32);
  if (need_v)
    st->v = core_arena_alloc(b32);
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
  free(st->client_state);
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
  /* Creates the job when there is none, and refuses another job's state. */
  int rc = core_open(c, &st->spec, NULL, err, errlen);
  if (rc != 0)
    return rc;
  ckpt_call call;
  ckpt_call_init(&call);
  call.st = st;
  call.ckpt_step = ckpt_step;
  pthread_mutex_lock(&c->mu);
  if (c->stop)
    rc = status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down");
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
    rc = ckpt_call_wait(&call);
    if (rc != 0)
      status_fail(err, errlen, rc, "restore on shard %u: %s", c->shard_id, zs_strerror(rc));
  }
  ckpt_call_destroy(&call);
  return rc;
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
 * gone, and a status that no client retries says so. Called with mu held. */
static void core_fail_job_waiters(core *c, waiter **fire) {
  waiter **lists[3] = {&c->version_waiters, &c->stats_waiters, &c->apply_waiters};
  for (int i = 0; i < 3; i++) {
    while (*lists[i]) {
      waiter *w = *lists[i];
      *lists[i] = w->next;
      w->status = ZS_ENOTOPEN;
      w->version = c->version;
      w->stats.step = w->key;
      w->apply = (core_apply_result){.step = w->key, .version = c->version};
      waiter_push(fire, w);
    }
  }
}

/* With state_rw held exclusively: waits up to pin_wait_ms for the answers
 * pinned in the low arena to be released; 1 once none is left. */
static int core_pins_drained(core *c) {
  uint64_t deadline = clock_now_ms() + c->pin_wait_ms;
  pthread_mutex_lock(&c->mu);
  atomic_store(&c->pin_waiting, 1);
  while (atomic_load(&c->low_pins) > 0 && clock_now_ms() < deadline) {
    struct timespec ts = {.tv_sec = (time_t)(deadline / 1000u),
                          .tv_nsec = (long)(deadline % 1000u) * 1000000L};
    pthread_cond_timedwait(&c->worker_cv, &c->mu, &ts);
  }
  atomic_store(&c->pin_waiting, 0);
  int drained = atomic_load(&c->low_pins) == 0;
  pthread_mutex_unlock(&c->mu);
  return drained;
}

/* Frees the job's state and empties the shard. Runs on the worker, so no
 * statistics pass, apply, snapshot or restore is in progress; no lock held. */
static void core_run_close(core *c, ckpt_call *call) {
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
  else if (c->restore_call || c->snapshot_waiters)
    rc = status_fail(q->err, q->errlen, ZS_ENOTREADY,
                     "a %s of job '%s' is in progress on shard %u; close it once that is done",
                     c->restore_call ? "restore" : "checkpoint", c->spec.job, c->shard_id);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    goto done;
  /* Pull answers still being sent from the low arena are waited for (with
   * state_rw held exclusively no new one starts); freeing the arena under
   * them would send freed memory, so unlike an apply the close gives up. */
  if (!core_pins_drained(c)) {
    rc = status_fail(q->err, q->errlen, ZS_ENOTREADY,
                     "pull answers of job '%s' are still being sent by shard %u; retry the close",
                     c->spec.job, c->shard_id);
    goto done;
  }

  pthread_mutex_lock(&c->mu);
  q->out->closed = 1;
  snprintf(q->out->job, sizeof q->out->job, "%s", c->spec.job ? c->spec.job : "");
  q->out->spec_hash = c->hash;
  q->out->version = c->version;
  q->out->state_bytes = c->state_bytes;
  core_fail_job_waiters(c, &fire);
  c->open = 0;
  atomic_store(&c->low_dtype, 0);
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
  core_fire(fire);
  ckpt_call_finish(call, rc);
}

int core_close(core *c, uint64_t hash, const char *job, core_close_result *out, char *err,
               size_t errlen) {
  core_close_result own;
  close_req q = {.hash = hash, .job = job, .out = out ? out : &own, .err = err, .errlen = errlen};
  ckpt_call call;
  ckpt_call_init(&call);
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
    rc = ckpt_call_wait(&call);
    if (rc == ZS_ECLOSED)
      status_fail(err, errlen, rc, "close on shard %u: the shard is shutting down", c->shard_id);
  }
  ckpt_call_destroy(&call);
  return rc;
}
