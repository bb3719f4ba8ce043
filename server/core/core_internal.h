/*
 * core_internal — the shard core's private types (struct core, its pieces,
 * waiters and checkpoint calls) and the few helpers that several core*.c
 * files share, prefixed core__; everything else in those files is static.
 * Which thread owns what and the lock order are at the top of core.c.
 */
#ifndef ZSHARD_SERVER_CORE_INTERNAL_H
#define ZSHARD_SERVER_CORE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "server/core/core.h"
#include "server/core/histogram.h"
#include "server/core/pool.h"
#include "server/optim/optim.h"

/* A contribution that arrived before its turn: a raw copy of the payload
 * (nbytes of the cap bytes of data; 0 for a contribution without a
 * gradient, which adds nothing). Once added, the buffer goes to the
 * core's cache of such buffers (core__held_put), linked by next. */
typedef struct held_contrib {
  struct held_contrib *next;
  zs_dtype dtype;
  size_t nbytes, cap;
  unsigned char data[];
} held_contrib;

/* Bytes of freed early-contribution buffers kept for the next ones. Several
 * trainers hold about a third of a step's contributions early (W = 4), and
 * a fresh buffer for each costs a page fault per 4 KiB (13 us on the
 * benchmark VM: the shard's largest remaining cost at W = 4 once its pull
 * answers were zero-copy, docs/PERFORMANCE.md). */
#define CORE_HELD_CACHE_BYTES (UINT64_C(32) << 20)

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
  /* The piece's INT8_BLOCK copy: its byte offset in core.q8, and whether it
   * holds the current weights (written with the low copy once int8 pulls
   * have been asked for). Guarded by state_rw like the low copy. */
  uint64_t q8_off;
  int q8_fresh;
  /* Pipelined jobs: 1 once the piece is applied for the pending step
   * (version + 1) while others are not yet, so that its version is
   * version + 1. Written under state_rw exclusive and mu, like the version,
   * so either lock reads it; 0 again when the step completes. */
  int ahead;
  /* 1 once a contribution of the pending step carried a gradient (an empty
   * one says the trainer has none). A piece whose W*M contributions all
   * came without one is skipped by the apply: torch skips a parameter
   * whose .grad is None. Written under mu by the push, read by the worker
   * once the piece is complete; 0 again when the step completes. */
  int has_grad;
  /* Elastic jobs: contributions received for the pending step (each kept in
   * held[k] until the step is applied, so that the sum can be taken again
   * over fewer ranks). Under mu. */
  uint32_t nrecv;
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
 * on a local fire list until it has been invoked and freed. pprev points at
 * whatever points at it (the list head or the previous waiter's next), so
 * that taking it off its list is O(1) wherever it sits. */
typedef struct waiter {
  struct waiter *next, **pprev;
  /* Version and statistics waiters are also in core.by_arg, so that
   * core_cancel_waits finds them without walking the lists. */
  struct waiter *hnext;
  int hashed;
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
  /* A statistics waiter asking for the statistics over `want`
   * (core_grad_stats_members); has_want 0: over whatever set is decided. */
  int has_want;
  core_members want;
  /* A version waiter for some pieces (core_wait_pieces): their local
   * indices; nwait 0 waits for the whole shard's version. */
  uint32_t nwait;
  uint32_t wait[];
} waiter;

/* One low-precision copy of the master weights (the arena core_pin_low
 * hands out). Pull answers are sent straight from it, so a buffer with pins
 * is never written: a writer that finds pins on the current one writes a
 * fresh copy and retires the old one, freed by the unpin that drops its last
 * pin (core_data.c). Guarded by core.low_mu. */
typedef struct low_buf {
  struct low_buf *next; /* on core.low_retired */
  uint16_t *data;       /* nelems elements, 64-byte aligned; NULL when 0 */
  uint64_t nelems;
  uint64_t pins;
} low_buf;

/* A buffer for an early contribution of nbytes, from the cache when one
 * there is large enough (and not more than twice that), else malloc'ed;
 * NULL when out of memory. */
held_contrib *core__held_get(core *c, size_t nbytes);
/* Gives h (may be NULL) back: kept in the cache while it has room, else
 * freed. */
void core__held_put(core *c, held_contrib *h);
/* Gives every early contribution ps holds back (core__held_put) and frees
 * its table; ps->held is NULL after. */
void core__piece_drop_held(core *c, piece_state *ps);
/* Frees every cached buffer (core_destroy). */
void core__held_drain(core *c);

/* Retired buffers at most (each still pinned by an answer being sent): a
 * reader that never finishes keeps one copy of the 16-bit weights alive,
 * not one per step. Beyond it a writer overwrites the current buffer under
 * its readers, whose CRC32C check refuses the torn answers. */
#define CORE_LOW_RETIRED_MAX 1u

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
  /* core_snapshot_async: the call is on the heap, owned by its waiter, and
   * on_done replaces the condition variable (mu and cv are not used). */
  core_snapshot_done on_done;
  void *on_done_arg;
} ckpt_call;

/* Elements per chunk of the optimizer pass: a multiple of LAYOUT_ALIGN_ELEMS so
 * that every chunk starts 64-byte aligned, and large enough that handing out a
 * chunk costs nothing next to running it. */
#define CORE_APPLY_CHUNK 65536u

/* One chunk of the optimizer pass: n elements from `begin` within range, all
 * of one piece: the plan-th piece of batch, whose plan is pplans[plan]. The
 * task that runs the chunk leaves the CRC32C of the chunk's low copy in crc,
 * computed while those bytes are still in the core's cache; the pieces'
 * CRCs are joined from them (core_worker.c, core_join_crcs). */
typedef struct apply_task {
  uint32_t range, plan;
  uint64_t begin, n;
  uint32_t crc;
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
  /* The current low copy: low_cur->data, kept here for the readers and
   * writers of its elements. Both change together, under state_rw
   * exclusive and low_mu. */
  uint16_t *low;
  low_buf *low_cur;
  /* Per piece: CRC32C of its low copy (numel * 2 bytes), kept with the low
   * copy (initialisation, every apply, restore) so that a pull of the stored
   * dtype is sent straight from the arena with no copy and no CRC pass. */
  uint32_t *low_crc;
  /* The INT8_BLOCK copy of the weights, one array per piece at its q8_off,
   * and its CRCs: made with the low copy, once per version, after the first
   * int8 pull of the job set q8_wanted (a job that never pulls int8 pays
   * neither the pass nor the memory: malloc'ed, its pages are touched only
   * when written). */
  unsigned char *q8;
  uint32_t *q8_crc;
  atomic_int q8_wanted;
  uint64_t state_bytes;
  const layout_range *ranges; /* this shard's ranges, into layout */
  uint32_t nranges;
  optim_plan *pplans; /* per piece of batch, rebuilt by every pass */
  /* Per tensor of the spec (num_tensors): the applied steps that gave the
   * tensor a gradient, torch's per-parameter state['step']; Adam's bias
   * corrections and SGD's first momentum step use it. Every slice of a
   * tensor receives the same contributions, so the shards agree. Written
   * under state_rw exclusive and mu, so either lock reads it. */
  uint64_t *tensor_steps;
  float **range_m; /* per range: m arena base or NULL when the group has no use */
  float **range_v;
  /* Pipelined jobs (spec.pipelined, DESIGN.md "A step"): the pieces whose
   * W*M contributions are in but which are not yet applied (ready, nready,
   * under mu), how many are applied for the pending step (nahead, under
   * state_rw exclusive and mu), and the worker's own copies for the pass
   * over a batch of them: the batch, its optimizer tasks (room for every
   * piece's chunks) and the time its passes took so far in the step. */
  int pipelined;
  /* Per piece (local index), the answers pinned in low_cur (under low_mu),
   * so that a piece's apply copies the low arena only when that piece is
   * being sent from it; and the pieces by arena offset, for core_unpin_low
   * to find a pinned pointer's piece. Both live while low_cur does:
   * core_job_free releases low_cur first. */
  uint32_t *piece_pins;
  struct core_piece_at {
    uint64_t off;
    uint32_t index;
  } * by_off;
  uint32_t *ready, nready;
  uint32_t nahead;
  uint32_t *batch, nbatch;
  uint32_t nwork; /* the first nwork of batch have a gradient; the rest are skipped */
  apply_task *ptasks;
  size_t npass_tasks; /* the tasks of the current pass, in ptasks */
  double pipe_seconds;
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
  /* The step hyper-parameters (core_step_hparams) of the queued apply and of
   * the last applied step: CORE_NHP arrays of num_groups values each,
   * allocated with the job, and a mask of the given ones (bit k: array k;
   * a clear bit means the spec's values). Under mu, like apply_glr. */
  double *apply_hp, *last_hp;
  unsigned apply_hp_mask, last_hp_mask;
  /* Elastic membership (DESIGN.md "Membership"). elastic: the timeout is
   * set, the job not pipelined and W <= CORE_ELASTIC_MAX_W; every
   * contribution is then kept (held) until its step is applied, and the
   * worker sums them in (micro, rank) order over stat_members. members: the
   * pending step's ranks, written under state_rw exclusive and mu (either
   * lock reads it). stat_members: the set core.stats is (being) computed
   * over; frozen: the step's set was decided on this shard (timeout or a
   * narrowing), so pushes of other ranks are refused; stall_since: when the
   * first GradStats of the pending step came (0: none yet). All under mu. */
  int elastic;
  /* The job's timeout (core_timeout_in_effect): its creating Open's
   * (open_timeout_ms) if any, else the server's (default_timeout_ms,
   * core_config), else the flag timeout recorded with a restored job.
   * flag_timeout_ms: the server-flag timeout in effect for the job (this
   * server's flag, or the recorded one where it has none), which its
   * checkpoints and replica copies record. */
  uint32_t trainer_timeout_ms, default_timeout_ms, open_timeout_ms, flag_timeout_ms;
  core_members members, stat_members, last_members;
  int frozen;
  uint64_t stall_since;
  uint64_t member_epoch, member_leaves, member_timeouts;
  /* The members the queued Apply named, checked against stat_members. */
  core_members apply_members;
  /* Planned changes (core_member_change): rank r joins at step join_at[r]
   * and leaves from step leave_at[r] (0: none), applied when that step
   * becomes the pending one (core__members_next_step). Under state_rw
   * exclusive and mu, like members. */
  uint64_t join_at[CORE_ELASTIC_MAX_W], leave_at[CORE_ELASTIC_MAX_W];
  uint64_t member_joins;
  /* The membership log: mlog[k] says that the steps from mlog[k].from_step
   * on were applied with mlog[k].members, until the next entry's; one entry
   * per change (the oldest dropped beyond CORE_MEMBER_LOG_MAX). Under mu;
   * written by core__members_next_step, freed with the job. */
  core_member_log_entry *mlog;
  uint32_t mlog_n, mlog_cap;
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
  /* The version and statistics waiters again, chained by hnext in buckets by
   * their arg (nbuckets a power of two or 0, grown to keep nhashed below
   * it), so that a mass cancel costs O(1) per call, not a walk each. */
  waiter **by_arg;
  size_t nbuckets, nhashed;
  ckpt_call *restore_call; /* the core_restore call the worker is to run */
  /* Where the state came from: core_restore sets these (under state_rw
   * exclusive and mu), an apply clears ckpt_untouched. */
  int ckpt_loaded;
  uint64_t ckpt_step;
  int ckpt_untouched;
  int ckpt_taken_over;    /* core_mark_behind, not a checkpoint, set ckpt_loaded */
  uint64_t next_deadline; /* the worker's next wake-up; UINT64_MAX when none */
  int version_event;      /* initialisation finished: version waiters may fire */
  int stop;

  /* Counters: the atomic ones are bumped on the push and read paths without
   * taking mu; the others change only with an apply, under mu. */
  atomic_uint_fast64_t pushes, duplicate_pushes, rejected, pulls, bytes_in, bytes_out;
  atomic_uint_fast64_t held_bytes;
  /* Freed early-contribution buffers (core__held_get / put), at most
   * CORE_HELD_CACHE_BYTES of them. held_mu is a leaf lock, taken under a
   * piece's mu. */
  pthread_mutex_t held_mu;
  int held_mu_inited;
  held_contrib *held_cache;
  uint64_t held_cache_bytes;
  uint64_t held_reused;
  atomic_uint_fast64_t contributions; /* added or held in the pending step */
  /* The pins of the low copies: low_cur's and the retired ones' counts and
   * the retired list. A leaf lock: nothing else is taken while it is held,
   * so core_unpin_low may run on any thread at any time. */
  pthread_mutex_t low_mu;
  int low_mu_inited;
  low_buf *low_retired;
  uint32_t nretired;
  atomic_int low_dtype; /* the job's param_dtype once open, else 0 */
  /* Writes that overtook a pinned answer (CORE_LOW_RETIRED_MAX reached). */
  atomic_uint_fast64_t low_overtaken;
  uint64_t applies, skipped_steps;
  double apply_seconds_total;
  histogram *apply_hist;      /* borrowed, may be NULL; recorded lock-free */
  core_applied_fn applied_fn; /* under mu; see core_set_applied_hook */
  void *applied_arg;
};

static inline void waiter_push(waiter **list, waiter *w) {
  w->next = *list;
  if (w->next)
    w->next->pprev = &w->next;
  w->pprev = list;
  *list = w;
}

/* core.c: the job and the checks every request starts with. */
void *core__arena_alloc(uint64_t bytes);
void core__begin_step(core *c);
int core__check_job(const core *c, uint64_t hash, char *err, size_t errlen);
int core__behind(const core *c, const char *what, uint64_t step, char *err, size_t errlen);

/* core_data.c: the low copy's CRCs and pins, for the writers of the arena. */
void core__low_crc_task(void *arg, size_t i);
/* Piece i's low copy was rewritten and crc is its CRC32C: records it, and
 * remakes the piece's INT8_BLOCK copy once int8 pulls are wanted, as
 * core__low_crc_task does. With state_rw exclusive. */
void core__low_crc_set(core *c, uint32_t i, uint32_t crc);
/* The local index of piece (tensor, slice), or a status with a sentence
 * (ZS_ENOTFOUND when this shard does not own it). Called with state_rw or
 * mu held and the job open. */
int core__piece_index(core *c, uint32_t tensor, uint32_t slice, uint32_t *index, char *err,
                      size_t errlen);
/* With state_rw held exclusively, before a writer (apply, restore, state
 * write) changes c->low: when answers are pinned in the current buffer,
 * makes a copy of it current and retires the pinned one, so that nobody
 * waits and every pinned answer keeps the bytes of its version. Past
 * CORE_LOW_RETIRED_MAX (or out of memory) the writer overwrites the pinned
 * buffer instead; that is counted and logged. Never blocks on a reader. */
void core__low_writable(core *c, const char *what);
/* Allocates the job's first low buffer (core_job_build); ZS_ENOMEM. */
int core__low_create(core *c);
/* With state_rw exclusive, before a pipelined pass writes the low copy of
 * the c->nbatch pieces of c->batch: core__low_writable when one of them has
 * an answer pinned, else nothing (answers of other pieces keep reading the
 * bytes they pinned, which the pass does not write). */
void core__low_batch_writable(core *c);
/* Lets go of the job's low buffer (core_job_free): freed at once without
 * pins, else retired until its last answer is sent. */
void core__low_release(core *c);

/* core_wait.c: waiters. */
uint64_t core__deadline(uint64_t deadline_ms);
void core__fire(waiter *w);
int core__add_timed(core *c, waiter **list, waiter *w);
/* Takes w off the core's list it is on (and out of by_arg), in O(1); the
 * caller then pushes it on a fire list or keeps it. Called with mu held. */
void core__unlink(core *c, waiter *w);
void core__collect_versions(core *c, waiter **fire);

/* core_worker.c: the worker thread. */
void *core__worker(void *arg);

/* core_apply.c: what the worker takes from the queued Apply. */
/* gradient = acc * this: coef, or coef / W rounded once under
 * GRAD_REDUCE_MEAN. */
float core__grad_scale(const core *c, float coef);
/* The optimizer parameters of group g for a step of the queued apply (see
 * core_apply.c). */
optim_params core__step_params(const core *c, uint32_t g, double lr, const double *glr,
                               uint64_t step, float grad_scale);

/* core_members.c: the elastic membership's helpers. */
/* The members of a fresh job: all W ranks. Called with mu held. */
/* A restore's membership (core__run_restore, state_rw exclusive and mu
 * held): with ms, the job's own timeout, members, counters and log become
 * ms's (the job elastic again when the timeout makes it so); without, every
 * rank of W is a member, as at the job's creation. */
void core__members_restore(core *c, const core_member_state *ms);
void core__members_reset(core *c);
/* A push of an applied step (step <= version) by a rank that is no longer
 * a member: ZS_ELEFT with a sentence (it would otherwise be acknowledged as
 * a duplicate, though it was never summed); 0 otherwise. state_rw held. */
int core__push_left(core *c, uint32_t rank, uint64_t step, char *err, size_t errlen);
/* Elastic push of contribution k of piece ps (mu of ps held, k not yet
 * received): keeps a copy in held[k], marks it received and completes the
 * piece (and the step) when it holds every member's; or refuses a rank that
 * is not a member (ZS_ELEFT), changing nothing. */
int core__push_keep(core *c, piece_state *ps, uint32_t k, uint32_t rank, zs_dtype dtype,
                    const void *data, size_t nbytes, char *err, size_t errlen);
/* Sums every piece's kept contributions of stat_members into acc, in
 * (micro, rank) order (the bits of the streaming sum of a fixed
 * membership), and sets each piece's has_grad. On the worker, state_rw
 * held shared, stat_members stable (phase COMPUTING). */
void core__members_sum(core *c);
/* The ranks with every contribution on every piece of this shard. On the
 * worker, no lock held. */
void core__members_complete(core *c, core_members *out);
/* At the trainer timeout: decides the step's set on this shard (the ranks
 * complete here) and starts the statistics over it. On the worker, no
 * lock held. */
void core__members_timeout(core *c);
/* The deadline (clock_now_ms) of the pending step's trainer timeout, or
 * UINT64_MAX. Called with mu held. */
uint64_t core__members_deadline(const core *c);
/* Frees the kept contributions of every piece (after an apply or a
 * restore); state_rw held exclusively. */
void core__members_release(core *c);
/* 1 when c is elastic, still waits for the pending step's contributions
 * (nothing decided, no apply queued), want holds fewer ranks than the
 * step's members and each of them gave every contribution to this shard.
 * Takes mu, then (only in that case) state_rw shared and the pieces' locks:
 * call it with no lock held. */
int core__members_complete_for(core *c, const core_members *want);
/* 1 when a is a non-empty subset of b. */
int core__members_subset(const core_members *a, const core_members *b);
/* Sums the pending step again over `want` (a subset of stat_members) and
 * refuses other ranks' pushes from now on. Called with mu held. */
void core__members_narrow(core *c, const core_members *want);
/* After an elastic step is applied: frees its kept contributions and makes
 * the ranks it was applied with the next step's members. state_rw
 * exclusive and mu held. */
void core__members_next_step(core *c);

/* core_snapshot.c: the worker's halves of core_snapshot and core_restore. */
waiter *core__take_snapshot(core *c, waiter **fire);
void core__run_snapshot(core *c, waiter *w);
void core__run_restore(core *c, ckpt_call *call);
/* A call some other thread makes and the worker finishes (restore, close):
 * init, wait for done, finish with a status, destroy (core_snapshot.c). */
void core__ckpt_call_init(ckpt_call *call);
void core__ckpt_call_destroy(ckpt_call *call);
int core__ckpt_call_wait(ckpt_call *call);
void core__ckpt_call_finish(ckpt_call *call, int status);
/* Runs a queued core_close on the worker (core.c). */
void core__run_close(core *c, ckpt_call *call);

#endif
