/*
 * internal — what the files of libzshard share and nothing outside the library
 * sees. Internal non-static symbols start with zc_ (the public ones with zs_);
 * the shared library exports only zs_* (client/lib/zshard.map).
 *
 * The pieces:
 *   client.c    the client handle: options, registry, open and close
 *   addresses.c the shard addresses: patterns, lists, host and port
 *   model.c     the model description (groups, tensors) and its accessors
 *   job.c       zs_open_job (initial weights, deferred ones) and zs_close_job
 *   pool.c      worker threads and per-shard task queues
 *   request.c   a request's life: the cache, submission, finishing, waiting,
 *               the generic "call every shard"
 *   call.c      a gRPC call to a shard, retried with backoff
 *   task.c      one task of a request, run on a pool worker
 *   transfer.c  one tensor's push or pull: zs_push, zs_pull, their _cb forms
 *   batch.c     zs_push_many, zs_pull_many
 *   check.c     the arguments of a push or pull
 *   prefetch.c  the prefetch slots
 *   ef.c        error feedback
 *   convert.c   dtype conversion
 *               (transfer.h: what these share among themselves)
 *   step.c      zs_step: gradient statistics, norm, clipping, apply, timing
 *   state.c     optimizer state: zs_state_read/write, the optimizer step count
 *   dataplane.c pushes and pulls over the data plane (data port discovery,
 *               per-shard data clients, retries)
 *   replica.c   replicated shards: each shard's members, the current one,
 *               the failover search
 *   scaler.c    the dynamic loss scaler
 *   estimate.c  the memory and traffic model behind `zshard estimate`
 *   error.c     the per-thread last-error sentence
 *   abi.c       struct_size: reading and writing the caller's structs
 *
 * Threads and locks (one place for the whole library):
 *   - The caller's threads run the zs_ functions; the pool's worker threads run
 *     tasks (one blocking rpc_call each, or one data-plane submission, plus
 *     data conversion) and completion callbacks; each shard's data client has
 *     a loop thread that finishes data-plane tasks and may run completion
 *     callbacks too (dataplane.c).
 *   - Lock order: zc_registry_mu -> zs_client.mu -> zc_pool.mu -> zs_request.mu.
 *     A thread holding a later lock never takes an earlier one, and no lock is
 *     held across an rpc_call or a user callback. zc_dp.mu (dataplane.c) is a
 *     leaf: nothing is locked, and nothing blocks, while it is held.
 *     zc_rset.mu (replica.c, one per shard) is a leaf too: a failover search
 *     marks itself under it and runs its calls without it. So is op_cache_mu
 *     (request.c, the process's cache of released requests), taken under
 *     zs_client.mu when a pull starts prefetches.
 *   - After zs_open_job succeeds the spec, the layout and the channels are
 *     immutable and read without locks.
 */
#ifndef ZSHARD_CLIENT_INTERNAL_H
#define ZSHARD_CLIENT_INTERNAL_H

/* The CLI sees the library through cli_support.h (which says why). */
#ifdef ZSHARD_CLI
#error "client/cli must not include client/lib/internal.h: use cli_support.h"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cli_support.h"
#include "common/base/dtype.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "common/net/hostport.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"
#include "zshard/zshard.h"

#define ZC_ERR_LEN 512

/* The most worker threads a client starts. */
#define ZC_MAX_THREADS 64u

/* gRPC's UNAVAILABLE and CANCELLED: the statuses on which calls are retried
 * (the client never cancels its own calls, so CANCELLED comes from a server
 * that is shutting down); RESOURCE_EXHAUSTED too for Push and Pull (zc_call). */
#define ZC_GRPC_UNAVAILABLE 14
#define ZC_GRPC_CANCELLED 1
#define ZC_GRPC_RESOURCE_EXHAUSTED 8
#define ZC_GRPC_DEADLINE_EXCEEDED 4

/* ---- error.c -------------------------------------------------------------- */

/* Formats a sentence into the calling thread's last-error buffer and returns
 * `err`, so that a failure path reads `return zc_fail(ZS_EINVAL, "...")`. */
int zc_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Copies `msg` into the calling thread's last-error buffer and returns err. */
int zc_fail_msg(int err, const char *msg);

/* ---- abi.c: the caller's struct sizes (the rules atop zshard.h) ------------ */

/* The largest struct_size accepted: far above any struct of ours, low enough
 * that a garbage size is refused before the library reads that far. */
#define ZC_STRUCT_SIZE_MAX 4096u

/* ZS_OK if `size` can be a caller's struct_size, else ZS_EINVAL with a
 * sentence naming fn and the init macro that sets it. */
int zc_struct_check(size_t size, const char *fn, const char *init);

/* Reads the caller's struct `src` (its struct_size bytes, checked first)
 * into the library's `dst` of `own` bytes, which holds the defaults: the
 * first min(struct_size, own) bytes are copied and dst->struct_size becomes
 * own. ZS_EUNIMPL (nothing copied) if src sets a byte beyond own. */
int zc_struct_read(void *dst, size_t own, const void *src, const char *fn, const char *init);

/* Writes the library's struct `src` of `own` bytes to the caller's `dst` of
 * `size` bytes (checked by the caller): min(size, own) bytes copied, the rest
 * zeroed, dst->struct_size = size. Nothing past dst + size is touched. */
void zc_struct_write(void *dst, size_t size, const void *src, size_t own);

/* ---- pool.c --------------------------------------------------------------- */

typedef struct zc_task zc_task;
typedef struct zc_pool zc_pool;

/* Runs a task on a worker thread, or the tasks the pool coalesced with it
 * (linked through next, all of one shard and direction); each is finished,
 * or handed on to finish later, by the time it returns. */
typedef void (*zc_task_run_fn)(void *ctx, zc_task *t);
/* Finishes a task that will never run (the pool is stopping). */
typedef void (*zc_task_cancel_fn)(void *ctx, zc_task *t);

/* The queues of a pool: one FIFO per shard in each class. Everything goes
 * to ZC_Q_ANY, except under the rotated schedule the pushes and the pulls
 * not yet admitted, which wait in their own class (see pool.c). */
enum { ZC_Q_ANY = 0, ZC_Q_PUSH = 1, ZC_Q_PULL = 2, ZC_Q_CLASSES = 3 };

struct zc_pool {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t nqueues;              /* one FIFO per shard and class */
  zc_task **head;                /* (mu) [class * nqueues + shard] */
  zc_task **tail;                /* (mu) */
  uint32_t cursor[ZC_Q_CLASSES]; /* (mu) the next queue of each class: round robin */
  /* The rotated schedule (zc_pool_set_schedule): 0 off; else the most
   * pushes, and the most pulls, admitted and not yet released. */
  uint32_t window;
  uint32_t admitted[ZC_Q_CLASSES]; /* (mu) */
  int stopped;                     /* zc_pool_stop ran; zc_pool_free frees */
  size_t queued;                   /* (mu) */
  int stop;                        /* (mu) */
  pthread_t *threads;
  uint32_t nthreads;
  size_t push_bucket; /* bytes; 0: no coalescing */
  size_t pull_bucket;
  int held; /* (mu) zc_pool_hold: workers take nothing */
  /* zc_pool_order_pushes: a shard's first-attempt pushes run one list at a
   * time, in their queue's order; busy[shard] is set while a worker runs one. */
  int ordered;
  uint8_t *busy; /* (mu) [shard] */
  uint32_t idle; /* (mu) workers waiting for a task */
  zc_task_run_fn run;
  zc_task_cancel_fn cancel;
  void *ctx;
};

/* Keeps each shard's pushes in the order they were queued until they are
 * handed on (on): a worker takes a shard's next first-attempt push only
 * after the run of the shard's last one returned. For the data plane, whose
 * runs only hand pieces to a shard's connection: without it, the workers
 * race between taking a piece and handing it on, and a preempted one puts
 * its piece behind later ones, which a pipelined step then waits for on
 * every trainer (docs/PERFORMANCE.md). Call before any submission. */
void zc_pool_order_pushes(zc_pool *p, int on);

/* Starts nthreads workers over nqueues queues. Returns 0, ZS_ENOMEM or
 * ZS_EINTERNAL (thread creation failed); on error the caller still calls
 * zc_pool_stop, which joins the workers that did start. */
int zc_pool_start(zc_pool *p, uint32_t nqueues, uint32_t nthreads, size_t push_bucket,
                  size_t pull_bucket, zc_task_run_fn run, zc_task_cancel_fn cancel, void *ctx);

/* Queues the n tasks of an array (each on the queue of its shard) in one
 * critical section; after stop they are cancelled at once instead. */
void zc_pool_submit(zc_pool *p, zc_task *tasks, uint32_t n);

/* The tasks of one request, for zc_pool_enqueue_spans. */
typedef struct zc_task_span {
  zc_task *tasks;
  uint32_t n;
} zc_task_span;

/* Queues the tasks of n requests in one critical section (a batch's,
 * zs_push_many and zs_pull_many: one pool lock round trip for all of them,
 * not one per request) and, with wake, wakes one idle worker if anything is
 * queued; after stop the tasks are cancelled at once instead. A batch wakes
 * once, at its end: on two cores a wake-up per request costs a context
 * switch each (the woken worker preempts the submitting thread), and one
 * wake-up for the whole batch also lets the pool coalesce the batch's pieces
 * into buckets. */
void zc_pool_enqueue_spans(zc_pool *p, const zc_task_span *spans, uint32_t n, int wake);

/* For tests: while held, workers take no task, so that everything submitted
 * meanwhile is queued (and coalesced) as if it had all arrived at once. */
void zc_pool_hold(zc_pool *p, int hold);
/* 1 while zc_pool_hold holds the pool: what is submitted then must wait in
 * it (the transfer fast path, zc_dp_submit_inline, is not taken). */
int zc_pool_held(zc_pool *p);

/* The rotated schedule (zs_client_options.schedule, ZS_SCHEDULE_ROTATED):
 * pushes and pulls (not prefetches, nor control calls) are admitted in
 * round-robin order over the shards starting at shard `start` (the rank),
 * at most `window` of each direction at a time, so that W trainers starting
 * at W different shards each send to one shard at a time (pairwise
 * exchange). A task admitted holds its place until zc_pool_release. Called
 * once, before anything is submitted; window 0 leaves the FIFO schedule. */
void zc_pool_set_schedule(zc_pool *p, uint32_t start, uint32_t window);

/* The task has finished (or is about to): its place in the rotated
 * schedule's window goes to the next. Safe from any thread, and for a task
 * that never held one; must precede the op's completion (t may be freed
 * then). */
void zc_pool_release(zc_pool *p, zc_task *t);

/* Cancels every queued task (with the cancel function), waits for the running
 * ones, joins the workers. Idempotent; tolerates a pool that never started.
 * Tasks admitted by the rotated schedule may still be in flight on the data
 * plane: then the lock and the queues stay until zc_pool_free. */
void zc_pool_stop(zc_pool *p);

/* After zc_pool_stop and once no task can be in flight (the data plane
 * closed): frees what zc_pool_stop left. Idempotent. */
void zc_pool_free(zc_pool *p);

/* ---- requests and tasks: request.c, task.c ---------------------------------- */

typedef enum zc_op_kind {
  ZC_OP_PUSH = 1,
  ZC_OP_PULL = 2,
  ZC_OP_PREFETCH = 3, /* a pull into a prefetch slot */
  ZC_OP_CALL = 4,     /* one control call per task: open, init, stats, apply */
} zc_op_kind;

struct zc_task {
  zc_task *next; /* (pool.mu) queue link */
  struct zs_request *op;
  uint32_t shard;
  uint32_t piece; /* push, pull: index into layout.pieces */
  size_t bytes;   /* wire bytes, for coalescing */
  /* ZC_OP_CALL: the request message (the op's owner keeps it alive until the
   * op completes) and, after completion, the response (owned by the op's owner,
   * freed with protobuf_c_message_free_unpacked) and the status. */
  const char *method;
  const ProtobufCMessage *msg;
  const ProtobufCMessageDescriptor *resp_desc;
  uint64_t timeout_ms;
  ProtobufCMessage *resp;
  int status;
  /* Push and pull over the data plane (dataplane.c): what the next run of
   * the task does (a zc_dp_phase), the piece in the wire dtype when that
   * differs from the caller's buffer (owned by the task until it finishes),
   * the retries made, and the generation of the shard's data client that the
   * last attempt went to. */
  int dp_phase;
  void *dp_buf;
  uint32_t dp_attempt;
  uint64_t dp_gen;
  /* Replicated shards: the replica set's generation (zc_rset.gen) of the
   * member the last attempt went to, and the status it failed with. */
  uint64_t dp_rgen;
  int dp_failed;
  int dp_looked; /* a missing job or version made it search once */
  /* (pool.mu) The rotated schedule's class whose window this task holds a
   * place in (ZC_Q_PUSH, ZC_Q_PULL), 0 for none. */
  int sched;
};

struct zs_request {
  /* Kept as they are while a released request waits in request.c's cache
   * for its next use: the lock and condition variable (initialised once),
   * the tasks it has room for, and the sentence (only err[0] is reset). */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t cap;         /* tasks allocated, >= ntasks */
  char err[ZC_ERR_LEN]; /* (mu) the first failure's sentence */
  /* Zeroed for every use from here on (ZC_OP_RESET_FROM). The client,
   * valid until the op is finished: zs_client_close waits for every op
   * (inflight count) before freeing it. */
  struct zs_client *c;
  struct zs_request *cache_next; /* in the cache: the next cached request */
  zc_op_kind kind;
  atomic_int refs;  /* the caller's handle (if any) + the in-flight op */
  uint32_t pending; /* (mu) tasks not finished */
  int done;         /* (mu) */
  int status;       /* (mu) first failure */
  uint64_t bytes;   /* (mu) wire bytes moved */
  zs_request_cb cb;
  void *cb_arg;
  uint32_t tensor, micro;
  uint64_t step;   /* push: the step; pull, prefetch: min_version */
  const void *src; /* push: the caller's gradient, or owned_src */
  /* push with error feedback: gradient + residual, fp32, freed when the op
   * finishes. */
  float *owned_src;
  void *dst;          /* pull: the caller's buffer; prefetch: the slot's */
  zs_dtype buf_dtype; /* the caller's buffer (prefetch: = wire_dtype) */
  zs_dtype wire_dtype;
  /* push: no gradient this step (zs_push with grad NULL and nbytes 0):
   * every piece goes as an empty payload, src is NULL and nothing is
   * converted (buf_dtype = wire_dtype). */
  int nograd;
  uint32_t ntasks;
  zc_task tasks[];
};

/* The bytes of piece pc of op on the wire: none for a push without a
 * gradient, else numel elements of the wire dtype. */
static inline size_t zc_op_piece_bytes(const struct zs_request *op, const layout_piece *pc) {
  return op->nograd ? 0 : (size_t)dtype_bytes(op->wire_dtype, pc->numel);
}
/* The piece's bytes in the caller's buffer (NULL for a push without a
 * gradient). */
static inline const unsigned char *zc_op_piece_src(const struct zs_request *op,
                                                   const layout_piece *pc) {
  return op->src ? (const unsigned char *)op->src + dtype_bytes(op->buf_dtype, pc->offset) : NULL;
}

/* A prefetch slot: one per tensor, created lazily. */
typedef enum zc_slot_state {
  ZC_SLOT_EMPTY = 0,
  ZC_SLOT_INFLIGHT = 1, /* a prefetch op is filling buf */
  ZC_SLOT_READY = 2,    /* buf holds `version` in `wire` */
  ZC_SLOT_BUSY = 3,     /* a pull is copying out of buf */
} zc_slot_state;

typedef struct zc_slot {
  zc_slot_state state;
  uint64_t version; /* the min_version it was pulled for */
  zs_dtype wire;
  void *buf; /* owned, cap bytes */
  size_t cap;
  struct zs_request *waiter; /* a pull waiting for this slot's op */
} zc_slot;

/* The pool's run and cancel functions. */
void zc_task_run(void *ctx, zc_task *t);
void zc_task_cancel(void *ctx, zc_task *t);

/* Allocates an op with ntasks zeroed tasks (pending = ntasks) and refs = 1
 * (the in-flight op), or takes a released one of the same size from the
 * process's cache of requests (request.c). Returns NULL on ENOMEM (with
 * the last error set). */
struct zs_request *zc_op_new(struct zs_client *c, zc_op_kind kind, uint32_t ntasks);

/* Submits the op's tasks to the pool, or, for an isolated one-task push or
 * pull in its wire dtype, straight to its data client on the calling thread
 * (request.c, submit_inline). Either way no task finishes inside the call,
 * unless the pool is stopping (the tasks are then cancelled). Called without
 * c->mu. */
void zc_op_submit(struct zs_request *op);

/* Finishes one part (task, or the prefetch a pull waits on) of an op with
 * `status` (and sentence `msg` when failing) and `bytes` moved; the last part
 * finishes the op. */
void zc_op_part_done(struct zs_request *op, int status, const char *msg, uint64_t bytes);

/* Waits until the op is done, returns its status and copies its sentence to
 * the last error on failure. Does not drop a reference. */
int zc_op_wait_done(struct zs_request *op);

/* Drops one reference; the last one frees the op or keeps it in the
 * cache for the next zc_op_new. */
void zc_op_release(struct zs_request *op);

/* Registers and submits a ZC_OP_CALL op (whose tasks the caller filled) and
 * waits for it; per-task status and response are left in op->tasks for the
 * caller, who then frees the responses and releases the op. Returns the first
 * failure. */
int zc_call_all(struct zs_request *op);

/* A ZC_OP_CALL op of GetInfo on every shard with `req`, which its tasks share
 * (the caller keeps it alive until the op is released), for zc_call_all; NULL
 * on ENOMEM, with the last error set. */
struct zs_request *zc_op_get_info(struct zs_client *c, const Zshard__V1__GetInfoRequest *req);

/* convert.c: converts n elements from src (dtype sd) to dst (dtype dd); src may be
 * unaligned, dst must be aligned to its element size. */
void zc_convert(void *dst, zs_dtype dd, const void *src, zs_dtype sd, size_t n);

/* prefetch.c: starts prefetches of tensors [first, first + count) for min_version in wire
 * dtype `wire`, skipping those already in a slot. Called with c->mu held;
 * the ops are returned in *ops (up to count) for the caller to submit after
 * unlocking. Returns how many. */
uint32_t zc_prefetch_locked(struct zs_client *c, uint32_t first, uint32_t count,
                            uint64_t min_version, zs_dtype wire, struct zs_request **ops);

/* Frees the prefetch slots (client teardown). */
void zc_slots_free(struct zs_client *c);
/* Frees the error-feedback residuals (ef.c). */
void zc_ef_free(struct zs_client *c);
/* After a step: a skipped step's residuals are dropped with its gradient
 * (skipped 1); otherwise they are multiplied by `rescale`, the next loss
 * scale over this step's, since pushes carry loss-scaled gradients. */
void zc_ef_after_step(struct zs_client *c, int skipped, double rescale);

/* call.c: waits ms milliseconds, or less if the client starts closing;
 * returns 1 if it is closing. The retries' backoff. */
int zc_backoff_wait(struct zs_client *c, uint64_t ms);

/* zc_call, the retried call: cli_support.h. */

/* ---- step.c: the job's membership ------------------------------------------ */

/* After every shard answered Open (op's tasks hold OpenResponses): takes the
 * job's world size, which is not part of the spec hash (issue 26) and so may
 * differ from the one this trainer named; the shards must agree on it and
 * the rank must be below it (ZS_EINVAL otherwise, nothing changed). A shard
 * that does not say (0, an older server) leaves the trainer's own. */
int zc_adopt_world_size(struct zs_client *c, const struct zs_request *op);

/* After the Open (issue 26): asks every shard to count this rank from step
 * *step on (ChangeMembership JOIN), and from the next step when a shard
 * decided that one's members already, until every shard agrees; *step gets
 * the step it contributes from, once every shard applied the one before (at
 * most step_timeout_ms, else ZS_ETIMEDOUT). A job with a fixed membership, or a server
 * without the call, leaves *step as it was and returns ZS_OK, unless the
 * client opened in ZS_OPEN_JOIN mode (then the error). No lock held. */
int zc_member_join(struct zs_client *c, uint64_t *step);

/* At zs_client_close (issue 26): tells every shard that this rank
 * contributes nothing from its current step on (ChangeMembership LEAVE), so
 * that the others go on at once instead of after the trainer timeout. One
 * attempt per shard; errors are ignored (a fixed membership, an older
 * server, a shard down: the timeout still covers it). */
void zc_member_leave(struct zs_client *c);

/* ---- scaler.c: the loss scaler's state, carried by the shards ---------------- */

/* The largest client state a shard keeps (ApplyRequest.client_state); the
 * server's CORE_MAX_CLIENT_STATE. */
#define ZC_MAX_CLIENT_STATE 1024u

/* The scaler's state as zs_step sends it in ApplyRequest.client_state: the
 * little-endian blob "ZSLS", u32 version 1, f64 scale, u32 cur_hysteresis,
 * i64 iter, i64 last_overflow_iter (docs/CHECKPOINTS.md), so that it comes
 * back with the job's version after a restart or a restore. */
#define ZC_SCALER_BLOB_BYTES 36u

/* Encodes s's state into out (ZC_SCALER_BLOB_BYTES bytes, the caller's). */
void zc_scaler_encode(const zs_loss_scaler *s, uint8_t *out);

/* Sets s's state (scale, cur_hysteresis, iter, last_overflow_iter; not its
 * configuration) from a blob of len bytes and returns 1, or returns 0 and
 * leaves s alone when the blob is empty or not one zc_scaler_encode wrote
 * (another client's state, a later version, values out of range). */
int zc_scaler_decode(zs_loss_scaler *s, const uint8_t *blob, size_t len);

/* ---- security.c: the token and TLS files --------------------------------- */

/* What a client presents and checks on every connection; every string owned
 * (NULL: not set). Immutable once zs_client_open resolved it. */
typedef struct zc_security {
  char *token;
  char *tls_ca_file;
  char *tls_cert_file;
  char *tls_key_file;
  char *tls_server_name;
  /* The data plane's TLS client context made from the files above (NULL:
   * plaintext); shared by every data-plane client of this client. */
  struct tls_ctx *dp_tls;
} zc_security;

/* Each argument (the caller's option, may be NULL or "") or else its
 * environment variable (ZSHARD_TOKEN then ZSHARD_TOKEN_FILE, ZSHARD_TLS_CA,
 * _CERT, _KEY, _SERVER_NAME) into *out, copied; with a CA, also the data
 * plane's TLS context. Returns ZS_OK, or an error with the last error set (a
 * token file or a TLS file that cannot be read); *out is then empty. `fn` names the caller in
 * messages. */
int zc_security_resolve(const char *token, const char *tls_ca_file, const char *tls_cert_file,
                        const char *tls_key_file, const char *tls_server_name, zc_security *out,
                        const char *fn);
void zc_security_free(zc_security *s);
/* A view of `s` for rpc_channel_open_secure (pointers into `s`). */
rpc_security zc_security_rpc(const zc_security *s);
/* rpc_channel_open_secure with `s`, the last error set on failure. */
int zc_channel_open(const zc_security *s, const char *addr, rpc_channel **out, const char *fn);

/* ---- replica.c: a shard's replica set ------------------------------------------ */

/* The most members of one shard's replica set. */
#define ZC_MAX_REPLICAS 8u
/* Deadline of one member's GetInfo in a failover search, ms (at most
 * rpc_timeout_ms). */
#define ZC_PROBE_MS 500u
/* After a refused Promote, the longest a caller backs off before the next
 * search, ms: the member may only lag behind what the client saw. */
#define ZC_PROMOTE_RETRY_MS 100u
/* gRPC metadata key of the highest term the client has seen for a shard. */
#define ZC_TERM_KEY "zshard-term"

/* One shard's members (docs/CLIENT.md, "Replica sets and failover"). A
 * shard that is not replicated has n = 1 and is used exactly as before:
 * member 0's channel, no term, no search. Channels and member addresses are
 * immutable once zs_client_open returned; the rest is guarded by mu, a leaf
 * held only for bookkeeping (never across a call). */
typedef struct zc_rset {
  uint32_t n;
  char *member[ZC_MAX_REPLICAS];      /* owned: "host:port" as listed */
  rpc_channel *chan[ZC_MAX_REPLICAS]; /* owned, one per member */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* (mu) a search ended */
  uint32_t cur;      /* (mu) the member calls go to; 0 at first */
  /* Changes whenever cur does; read without mu by the data plane's check
   * for a moved member, hence atomic (written under mu). */
  atomic_uint_least64_t gen;
  uint64_t term;     /* (mu) the highest term seen */
  int searching;     /* (mu) a failover search runs */
  int found;         /* (mu) the last search left a primary current */
  uint64_t retry_at; /* (mu) clock_now_ms() when the last search's wait ends */
  /* (mu) clock_now_ms() of each member's first failure to answer since it
   * last answered; 0: it answers. */
  uint64_t down_since[ZC_MAX_REPLICAS];
  uint32_t failover_ms; /* the client's, copied */
} zc_rset;

/* Opens every shard's replica set from c->addr (already validated by
 * zc_parse_addresses) into c->rs. Returns 0 or an error with the last error
 * set; zc_rsets_free frees a partly built array. */
int zc_rsets_open(struct zs_client *c, const char *fn);
void zc_rsets_free(struct zs_client *c);

/* Checks one shard's text of a list (already trimmed): its '|'-separated
 * members, each a host:port zc_address_hostport reads, none empty, at most
 * ZC_MAX_REPLICAS, no member twice. On success *norm is the text to keep
 * (members trimmed, rejoined with '|'; the caller frees it). Returns 0 or
 * ZS_EINVAL / ZS_ENOMEM with the last error set; `shard` names the shard in
 * the sentence. */
int zc_shard_text_check(uint32_t shard, const char *text, char **norm);

/* The replicated zc_call (call.c calls it for a shard with n > 1). */
int zc_replica_call(struct zs_client *c, uint32_t shard, const char *method,
                    const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                    ProtobufCMessage **resp, uint64_t timeout_ms, rpc_status *st);

/* The member calls to `shard` go to now: its index, channel and the set's
 * generation, and the term metadata to send (md->value points into
 * term_buf, 24 bytes; *nmd is 0 when no term is known yet). */
uint32_t zc_replica_current(struct zs_client *c, uint32_t shard, uint64_t *gen, rpc_md *md,
                            size_t *nmd, char *term_buf);

/* After a failure of the member of generation `gen` of `shard` (unreachable:
 * the failure says it did not answer): makes sure a failover search has run
 * for it, one at a time per shard (callers arriving during a search wait for
 * its result). Returns 1 when a primary is current now (another member, or
 * the same one confirmed): retry at once. Returns 0 otherwise, with
 * *wait_ms the time until the next search can decide more (UINT64_MAX:
 * back off as usual). Runs calls: no lock may be held. */
int zc_replica_failed(struct zs_client *c, uint32_t shard, uint64_t gen, int unreachable,
                      uint64_t *wait_ms);

/* ---- the client (client.c) ------------------------------------------------- */

struct zs_client {
  pthread_mutex_t mu;
  pthread_cond_t cv;     /* inflight reaches 0, a push op finishes, closing */
  zs_client_options opt; /* a copy; its string pointers are not used */
  char *job;             /* owned */
  /* The data plane's TCP congestion control (stream.h's
   * STREAM_CC_NAME_MAX), "" for the host's default. */
  char tcp_congestion[16];
  /* Link pacing of the data plane ($ZSHARD_TCP_LINK_MBIT; stream.h, "Link
   * pacing"): owned, shared by every shard's data client, freed after
   * them; NULL: none. */
  struct stream_pacer *pacer;
  uint32_t nshards;
  char **addr;     /* owned, nshards strings: a shard's text ("h:p|h:p") */
  zc_rset *rs;     /* owned, nshards replica sets (n = 1: not replicated) */
  zc_security sec; /* token and TLS files of every connection */

  /* The model description, built under mu until zs_open_job; immutable after. */
  spec sp;
  uint32_t group_cap, tensor_cap;
  int opened;     /* (mu) */
  int opening;    /* (mu) a zs_open_job is running */
  int job_closed; /* (mu) zs_close_job succeeded: no job can be opened again */
  layout lay;
  uint64_t hash;

  /* Step state (mu). */
  uint64_t step;     /* the step being accumulated: version + 1 */
  int stepping;      /* a zs_step is running */
  uint8_t *pushed;   /* num_tensors * M flags: pushed in this step */
  uint32_t inflight; /* ops not yet finished (all kinds) */
  /* Ops not yet finished, counted down as their last part is done, before
   * their callback and waiters (inflight is counted down after them): what
   * the transfer fast path reads to tell an isolated transfer (request.c,
   * submit_inline). No lock. */
  atomic_uint_least32_t unfinished;
  uint32_t inflight_push;
  int step_error; /* first push failure of this step */
  char step_err[ZC_ERR_LEN];
  zs_loss_scaler scaler;

  /* Timing of the step in progress (mu). */
  uint64_t mark_ns; /* end of the previous step */
  uint64_t push_ns, pull_ns;
  uint64_t bytes_pushed, bytes_pulled;
  atomic_uint retries;
  zs_timing last_timing;

  zc_slot *slots; /* (mu) num_tensors slots once opened with prefetch */
  /* Error feedback (ef.c): per tensor, the residual of its last push,
   * numel floats, allocated at the tensor's first lossy push. ef_mu guards
   * both; it is taken alone, never with mu. */
  pthread_mutex_t ef_mu;
  /* Per param group: its wire dtypes (zs_group_options), 0 for the
   * client's. Written by zs_add_group before the job opens. */
  zs_dtype group_push[SPEC_MAX_GROUPS], group_pull[SPEC_MAX_GROUPS];
  float **ef_resid;
  zs_dtype last_pull_wire; /* (mu) wire dtype of the last pull, for prefetch */

  /* The last checkpoint attempt of this client (checkpoint.c; mu). */
  uint64_t ckpt_step; /* last committed */
  int ckpt_status;
  char ckpt_err[ZC_ERR_LEN];

  zc_pool pool;
  int closing;     /* (mu) */
  uint32_t active; /* (zc_registry_mu) public calls running on this client */

  /* The data plane: set by zs_open_job (NULL with ZS_TRANSPORT_GRPC), freed
   * by zs_client_close after the pool stopped (dataplane.c). */
  struct zc_dp *dp;
};

/* Registry of live clients: zc_client_enter checks that `c` is a live, not
 * closing client and counts the caller as active in it; it returns
 * ZS_ECLOSED (ZS_EINVAL for NULL, with the last error set) otherwise. Every
 * public function taking a client starts with it and ends with
 * zc_client_leave; zs_client_close waits until no call is active. */
int zc_client_enter(const zs_client *c);
void zc_client_leave(const zs_client *c);

/* Adds ns to the client's push or pull wait time if `c` is still live (the
 * request may outlive its client). */
void zc_account_wait(zs_client *c, zc_op_kind kind, uint64_t ns);

/* model.c: adds param group g (copied) to the model and its index to *id
 * (may be NULL). Called with c->mu held, before the job is opened. Returns
 * 0, or ZS_ERANGE (past SPEC_MAX_GROUPS) or ZS_ENOMEM with the last error
 * set. */
int zc_add_group_locked(zs_client *c, const spec_group *g, uint32_t *id);

/* addresses.c: zc_parse_addresses, zc_free_addresses: cli_support.h. */

/* The host and port of one shard address: hostport_parse after an optional
 * gRPC scheme ("dns:", "ipv4:", "ipv6:") and a dns authority
 * ("dns://8.8.8.8/") are skipped; the host must not be empty. Returns 0, or
 * ZS_EINVAL with a sentence in err (may be NULL). `addr` is only read. */
int zc_address_hostport(const char *addr, hostport *out, char *err, size_t errlen);

/* The wire dtype of a transfer whose caller buffer is `buf`. */
zs_dtype zc_wire_dtype(zs_dtype configured, zs_dtype buf);

/* ---- dataplane.c ------------------------------------------------------------ */

/* Phases of a data-plane task (zc_task.dp_phase). */
typedef enum zc_dp_phase {
  ZC_DP_SEND = 0,   /* prepare the piece and submit it */
  ZC_DP_RETRY = 1,  /* back off, find the shard's data port again, resubmit */
  ZC_DP_FINISH = 2, /* the answer is in: convert a pulled piece, finish */
} zc_dp_phase;

/* Resolves options.transport against ZSHARD_TRANSPORT into ZS_TRANSPORT_DATA
 * or ZS_TRANSPORT_GRPC in *out. Returns 0, or ZS_EINVAL (last error set) for
 * a value that is not one of ours. */
int zc_transport_resolve(zs_transport requested, zs_transport *out);

/* With the data transport: asks every shard for its data port (GetInfo) and
 * opens a data client to each one that has one, into c->dp. Called by
 * zs_open_job once the shards know the job; does nothing if c->dp exists.
 * Returns 0, or ZS_ECONN / ZS_EPROTO / ZS_ENOMEM / the GetInfo failure with
 * the last error set (nothing is left open then). */
int zc_dp_open(struct zs_client *c);

/* Closes every data client (their transfers in flight complete with
 * ZS_ECANCELED) and frees c->dp. Called with no lock held, after the pool
 * stopped; idempotent. */
void zc_dp_close(struct zs_client *c);

/* Runs task t if it goes over the data plane: returns 1 when the task was
 * taken (it finishes later, on its own), 0 when its shard has no data client
 * and the caller runs it over gRPC. Called by zc_task_run. */
int zc_dp_run(struct zs_client *c, zc_task *t);

/* Sends the tasks of a list the pool coalesced (one shard, linked through
 * next) that go over the data plane as PUSH_BATCH / PULL_BATCH requests, in
 * runs of one direction and one (step, micro) or min_version, at most
 * WIRE_MAX_BATCH each; every task taken finishes later, on its own. Returns
 * the tasks not taken (a run of one, a retry or finish phase, a shard served
 * over gRPC), still linked through next, for zc_task_run to run one by one.
 * Called by zc_task_run. */
zc_task *zc_dp_run_batch(struct zs_client *c, zc_task *list);

/* Submits the task of a one-task op on the calling thread (the one that
 * started the transfer), sparing the pool's hand-off: a push or pull in its
 * wire dtype, on a shard that is not a replica set and has a data client,
 * off the data clients' loop threads. Returns 1 when the data client took
 * it (its answer finishes it later, on the loop thread), 0 when it is still
 * the caller's for the pool (nothing of it has run: a refused submission is
 * left to the pool's worker to fail, so that no completion runs inside the
 * caller's call). */
int zc_dp_submit_inline(struct zs_client *c, zc_task *t);

/* Batch requests this client has submitted, and tasks it submitted inline
 * (zc_dp_submit_inline). For tests. */
uint64_t zc_dp_batches(const struct zs_client *c);
uint64_t zc_dp_inline_submits(const struct zs_client *c);

/* 1 on a thread that is running a data-plane completion (where
 * zs_client_close must be refused), else 0. */
int zc_dp_in_callback(void);

/* ZS_TRANSPORT_DATA if pushes and pulls to `shard` go over the data plane
 * right now, else ZS_TRANSPORT_GRPC. For tests. */
zs_transport zc_shard_transport(const struct zs_client *c, uint32_t shard);

/* The schedule zs_client_open uses: `requested`, or for ZS_SCHEDULE_DEFAULT
 * $ZSHARD_SCHEDULE ("fifo", "rotated"; unset: fifo); and its window (*window:
 * the option in, 0 meaning $ZSHARD_SCHEDULE_WINDOW or 2; the value out).
 * Returns ZS_OK or ZS_EINVAL (zc_fail'ed). */
int zc_schedule_resolve(zs_schedule requested, zs_schedule *out, uint32_t *window);

/* The data plane's TCP congestion control: `requested`, else
 * $ZSHARD_TCP_CONGESTION, else "" (the host's default), checked with
 * stream_cc_check into out (len bytes). Returns ZS_OK or ZS_EINVAL
 * (zc_fail'ed with the kernel's lists). */
int zc_congestion_resolve(const char *requested, char *out, size_t len);

/* The data plane's per-socket pacing, Mbit/s: `requested`, else (0)
 * $ZSHARD_TCP_PACING_MBIT, else 0 (none), into *out. Returns ZS_OK or
 * ZS_EINVAL (zc_fail'ed) above STREAM_PACING_MBIT_MAX or for a variable that
 * is no such number. */
int zc_pacing_resolve(uint32_t requested, uint32_t *out);

/* The data plane's link pacing: with $ZSHARD_TCP_LINK_MBIT set (the host's
 * link, Mbit/s), a pacer in *out (the caller's, stream_pacer_free) that
 * every data-plane socket joins; else NULL. $ZSHARD_TCP_LINK_NOTSENT_LOWAT
 * (bytes, default STREAM_PACER_NOTSENT_LOWAT, 0 the kernel's) bounds what the
 * kernel holds unsent. `pacing_mbit` is the fixed per-socket pacing: both
 * at once are refused. Returns ZS_OK, ZS_EINVAL (zc_fail'ed) or ZS_ENOMEM. */
int zc_link_resolve(uint32_t pacing_mbit, struct stream_pacer **out);

#endif
