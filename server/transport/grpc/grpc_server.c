/*
 * grpc_server — the gRPC transport (see grpc_server.h).
 *
 * Threads and what they own:
 *  - `threads` polling threads run grpc_completion_queue_next on the one server
 *    completion queue and run every handler: they parse, call the service
 *    (service.h: the checks, then the core) and start the answering batch.
 *    They never wait for the core: a core call that returns CORE_PENDING
 *    leaves the call parked in the core.
 *  - Core threads call our callbacks (on_core_*). A callback only records the
 *    outcome, claims the call and starts an empty batch on it, whose
 *    completion (on_hop) carries the rest of the work (core_read into the
 *    response, core_missing, packing) back onto a polling thread. So no core
 *    callback blocks, and none calls into the core.
 *  - The thread calling gsrv_destroy runs the shutdown sequence.
 *
 * Lock order: gsrv.lock is the only lock here and a leaf: it is never held
 * while calling into the core (so a core lock is never taken inside it), and
 * a core callback takes it only on an error path, holding no lock of ours. It
 * guards the list of calls in flight, the Watch streams, the serving status,
 * the shutdown flags and the limits' counts (parked calls and answer bytes per
 * connection, the queue of answers waiting for room). gRPC functions called
 * with it held never call back into this file (completions go through the
 * queue). push_asm has a leaf lock of its own, never taken with gsrv.lock.
 *
 * Limits (docs/OPERATIONS.md, "Limits"; gsrv_limits in the header): the
 * channel arguments bound request sizes, gRPC's memory, streams, idle and
 * handshake time; a parked call counts against the parked budgets until its
 * RECV_CLOSE_ON_SERVER completes; a Pull answer counts against the answer
 * budgets from being built until its final batch completes.
 *
 * A call is answered exactly once: whoever flips gcall.claimed from 0 to 1 (a
 * handler, a core callback, or the shutdown sweep) sends the final batch; the
 * others drop what they prepared. A gcall is reference counted: the handler
 * running it, each batch started on it and each core callback outstanding hold
 * one reference. The grpc_call itself is released as soon as the final batch
 * completes, so that server shutdown never waits for a core callback; a gcall
 * kept alive only by the core afterwards touches nothing but itself.
 *
 * Copies of tensor bytes, beyond the kernel's socket copies:
 *  - Push: gRPC hands over the message in slices; a message in one slice is
 *    used in place, one in several is gathered into one buffer (1 copy). The
 *    request is then decoded in place (data points into that buffer) and the
 *    core adds it into its accumulator (or copies an early one to hold it).
 *    A payload larger than a message comes in chunks, each copied once more
 *    into the payload's buffer (push_asm), which the core then reads.
 *  - Pull: the response is one slice of exactly the message's size and
 *    core_read converts the piece from the master arena straight into it
 *    (1 copy, which is also the dtype conversion); gRPC sends that slice.
 *  - InitParams (once per job): gather (0-1 copy) + protobuf-c unpack (1).
 */
#include "server/transport/grpc/grpc_server.h"
#include "server/transport/grpc/pb_inplace.h"
#include "server/transport/grpc/push_asm.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "common/net/rpc_client.h"
#include "grpc/health/v1/health.pb-c.h"
#include "server/replica/replica.h"
#include "server/transport/grpc/grpc_tls.h"
#include "zshard/v1/zshard.pb-c.h"

/* Outstanding grpc_server_request_*_call per method: calls that arrive while
 * all are taken wait in gRPC's queue until a handler re-posts its slot. */
#define GSRV_SLOTS_PER_METHOD 4
#define GSRV_GENERIC_SLOTS 2
#define GSRV_ERRLEN 256

/* Parked calls per connection are counted in a table of this many chains. */
#define GSRV_PEER_BUCKETS 256

/* The largest request the listener receives: a Push chunk and its header. */
#define GSRV_MAX_REQUEST_BYTES (RPC_PUSH_CHUNK_BYTES + RPC_HEADROOM_BYTES)
/* The largest request of a method that carries no bulk data. */
#define GSRV_SMALL_REQUEST_BYTES (64 * 1024)
/* CommitCheckpoint lists up to SPEC_MAX_SHARDS files by name. */
#define GSRV_COMMIT_REQUEST_BYTES (4 * 1024 * 1024)

#define ZS_STATUS_KEY "zs-status"
#define SERVICE_NAME "zshard.v1.ZShard"

/* ------------------------------------------------------------------------ */
/* Types                                                                    */
/* ------------------------------------------------------------------------ */

/* Every completion-queue tag is a gtag; the polling loop calls done(). */
typedef struct gtag gtag;
struct gtag {
  void (*done)(gtag *t, int ok);
};

enum {
  M_OPEN,
  M_INIT_PARAMS,
  M_PUSH,
  M_PULL,
  M_GRAD_STATS,
  M_APPLY,
  M_GET_INFO,
  M_STATS,
  M_CHECKPOINT,
  M_COMMIT_CHECKPOINT,
  M_RESTORE,
  M_LIST_CHECKPOINTS,
  M_CLOSE_JOB,
  M_READ_STATE,
  M_WRITE_STATE,
  M_PROMOTE,
  M_REPLICA_JOIN,
  M_REPLICA_FETCH,
  M_CHANGE_MEMBERSHIP,
  M_HEALTH_CHECK,
  M_HEALTH_WATCH,
  M_COUNT,
  M_GENERIC = M_COUNT, /* any method not registered */
};

typedef struct gcall gcall;

/* Parked calls of one connection (grpc_call_get_peer names it: address and
 * port), under gsrv.lock; freed when its count drops to 0. */
typedef struct peer_count peer_count;
struct peer_count {
  peer_count *next;
  uint32_t n;            /* parked calls */
  uint64_t answer_bytes; /* Pull answers built and not yet taken */
  char peer[];           /* NUL-terminated */
};

struct gsrv {
  grpc_server *server;
  grpc_completion_queue *cq;
  void *reg[M_COUNT];
  core *core;
  service *svc;   /* request checks and the observer (service.h) */
  int own_svc;    /* svc was made here (no gsrv_config.service) */
  ckpt_svc *ckpt; /* NULL without a state directory */
  int port;
  uint32_t data_port;
  uint32_t grace_ms;
  uint64_t start_ns;
  int started; /* grpc_server_start was called */
  /* Per method, where answered calls are recorded (NULL: not recorded). */
  metrics_rpc *rpc_metric[M_COUNT];
  auth_keys *auth;         /* borrowed; NULL: authentication off */
  replica *rep;            /* borrowed; NULL: not replicated */
  gtls *tls;               /* owned; NULL: plaintext */
  atomic_ullong refuse_ns; /* when a refusal was last logged */
  atomic_uint refused;     /* refusals not logged since */

  pthread_t *threads;
  int nthreads;

  pthread_mutex_t lock;
  pthread_cond_t cond;   /* CLOCK_MONOTONIC; signalled when a call leaves the
                            in-flight list and when shutdown completes */
  gcall *inflight;       /* calls not yet answered and sent, except Watch */
  gcall *watchers;       /* Watch streams */
  gsrv_limits lim;       /* fixed at start (docs/OPERATIONS.md, "Limits") */
  uint32_t nparked;      /* calls parked in the core, counted in peers[] */
  uint32_t nwatchers;    /* entries of watchers */
  uint64_t answer_bytes; /* Pull answers built and not yet taken, all peers */
  gcall *answer_wait;    /* Pulls waiting for room for their answer (aw_next) */
  gcall **answer_wait_tail;
  peer_count *peers[GSRV_PEER_BUCKETS];
  int serving;
  int stopping;      /* no more request slots are posted */
  int closing;       /* every call not yet answered is answered ECLOSED */
  int shutdown_done; /* the grpc_server_shutdown_and_notify tag arrived */
  push_asm *chunks;  /* Push payloads arriving in chunks */
  gtag shutdown_tag;
};

struct gcall {
  gtag req_tag;   /* the request slot was filled */
  gtag io_tag;    /* the hop, the final batch, a Watch message */
  gtag close_tag; /* Watch, parked calls: RECV_CLOSE_ON_SERVER */
  gsrv *s;        /* only used while the call is open */
  int method;
  int admin; /* the caller's token grants the admin role (or tokens are off) */
  /* The role its token granted and, for a rank token, the (job, rank) its
   * pushes are bound to: set by authorize, per call (no cache per channel). */
  auth_role role;
  auth_binding bind;
  /* A replicated primary's copy of a trainer's write, forwarded to the
   * backups once it succeeded here, before the answer (finish). */
  uint8_t *fwd;
  size_t fwd_len;
  uint64_t fwd_step; /* the write's step (an Apply's), 0: none */
  atomic_int refs;
  atomic_int claimed;
  uint64_t start_ns; /* clock_now_ns() when the request arrived */

  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details; /* M_GENERIC only */

  gcall *prev, *next; /* in gsrv.inflight or gsrv.watchers, under gsrv.lock */
  int listed;
  int grpc_released;        /* release_grpc() ran */
  int waiting;              /* parked in the core waiting for data (not counted as work) */
  int parked;               /* counted in gsrv.nparked and its peer's count, under gsrv.lock */
  int close_started;        /* RECV_CLOSE_ON_SERVER has its own batch (close_tag) */
  char *peer;               /* grpc_call_get_peer's, for a parked call; gpr_free */
  uint64_t answer_held;     /* bytes counted in the answer budgets, under gsrv.lock */
  uint64_t answer_since_ms; /* clock_now_ms() when they were counted */
  gcall *aw_next;           /* in gsrv.answer_wait */
  int aw_claimed;           /* the claim pull_finish had when the call queued */
  int stall_cancelled;      /* cancelled for an answer its peer did not take */

  /* The final batch's resources, released when it completes. */
  grpc_byte_buffer *reply;
  grpc_slice status_details;
  grpc_metadata trailer;
  char zs_buf[16];
  int cancelled;

  /* Request fields used after the hop. */
  uint64_t hash, step;
  uint32_t tensor, slice;
  zs_dtype dtype;
  size_t nbytes;

  /* Written by the core callback before the hop, read after it. */
  int async_status;
  core_stats_result stats;
  core_apply_result apply;
  /* GradStats: the membership asked for (has_want), second round. */
  int has_want;
  core_members want;
  ckpt_svc_result *ckpt; /* owned; checkpoint methods only */

  /* Watch state, under gsrv.lock. */
  int w_known;   /* the service is one we report on */
  int w_sent;    /* last status sent, -1 before the first */
  int w_sending; /* a message batch is in flight */
  int w_ending;  /* the server shuts down: end the stream */
  int w_final;   /* the status batch was started */
  int w_closed;  /* RECV_CLOSE_ON_SERVER completed */
};

typedef void (*handler_fn)(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

static void h_open(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_init_params(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_push(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_pull(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_grad_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_apply(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_get_info(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_commit_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_restore(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_list_checkpoints(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_close_job(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_read_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_write_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_promote(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_replica_join(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_replica_fetch(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_change_membership(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_health_check(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
static void h_health_watch(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

/* Per method: its path, its handler and the largest request it takes (a
 * larger one is refused before it is parsed; docs/OPERATIONS.md, "Limits").
 * Bulk requests (an Open's spec, a chunk of weights, state or gradient) may
 * use the whole listener limit; the clients send initial weights and state in
 * chunks of 1 MiB and gradients in chunks of RPC_PUSH_CHUNK_BYTES. */
static const struct {
  const char *path;
  handler_fn fn;
  size_t max_request;
} methods[M_COUNT] = {
    [M_OPEN] = {"/zshard.v1.ZShard/Open", h_open, GSRV_MAX_REQUEST_BYTES},
    [M_INIT_PARAMS] = {"/zshard.v1.ZShard/InitParams", h_init_params, GSRV_MAX_REQUEST_BYTES},
    [M_PUSH] = {"/zshard.v1.ZShard/Push", h_push, GSRV_MAX_REQUEST_BYTES},
    [M_PULL] = {"/zshard.v1.ZShard/Pull", h_pull, GSRV_SMALL_REQUEST_BYTES},
    [M_GRAD_STATS] = {"/zshard.v1.ZShard/GradStats", h_grad_stats, GSRV_SMALL_REQUEST_BYTES},
    [M_APPLY] = {"/zshard.v1.ZShard/Apply", h_apply, GSRV_SMALL_REQUEST_BYTES},
    [M_GET_INFO] = {"/zshard.v1.ZShard/GetInfo", h_get_info, GSRV_SMALL_REQUEST_BYTES},
    [M_STATS] = {"/zshard.v1.ZShard/Stats", h_stats, GSRV_SMALL_REQUEST_BYTES},
    [M_CHECKPOINT] = {"/zshard.v1.ZShard/Checkpoint", h_checkpoint, GSRV_SMALL_REQUEST_BYTES},
    [M_COMMIT_CHECKPOINT] = {"/zshard.v1.ZShard/CommitCheckpoint", h_commit_checkpoint,
                             GSRV_COMMIT_REQUEST_BYTES},
    [M_RESTORE] = {"/zshard.v1.ZShard/Restore", h_restore, GSRV_SMALL_REQUEST_BYTES},
    [M_LIST_CHECKPOINTS] = {"/zshard.v1.ZShard/ListCheckpoints", h_list_checkpoints,
                            GSRV_SMALL_REQUEST_BYTES},
    [M_CLOSE_JOB] = {"/zshard.v1.ZShard/CloseJob", h_close_job, GSRV_SMALL_REQUEST_BYTES},
    [M_READ_STATE] = {"/zshard.v1.ZShard/ReadState", h_read_state, GSRV_SMALL_REQUEST_BYTES},
    [M_WRITE_STATE] = {"/zshard.v1.ZShard/WriteState", h_write_state, GSRV_MAX_REQUEST_BYTES},
    [M_PROMOTE] = {"/zshard.v1.ZShard/Promote", h_promote, GSRV_SMALL_REQUEST_BYTES},
    [M_REPLICA_JOIN] = {"/zshard.v1.ZShard/ReplicaJoin", h_replica_join, GSRV_SMALL_REQUEST_BYTES},
    [M_REPLICA_FETCH] = {"/zshard.v1.ZShard/ReplicaFetch", h_replica_fetch,
                         GSRV_SMALL_REQUEST_BYTES},
    [M_CHANGE_MEMBERSHIP] = {"/zshard.v1.ZShard/ChangeMembership", h_change_membership,
                             GSRV_SMALL_REQUEST_BYTES},
    [M_HEALTH_CHECK] = {"/grpc.health.v1.Health/Check", h_health_check, GSRV_SMALL_REQUEST_BYTES},
    [M_HEALTH_WATCH] = {"/grpc.health.v1.Health/Watch", h_health_watch, GSRV_SMALL_REQUEST_BYTES},
};

/* ------------------------------------------------------------------------ */
/* Call lifetime                                                            */
/* ------------------------------------------------------------------------ */

static gcall *gcall_new(gsrv *s, int method) {
  gcall *c = calloc(1, sizeof *c);
  if (!c)
    return NULL;
  c->s = s;
  c->method = method;
  atomic_init(&c->refs, 1);
  atomic_init(&c->claimed, 0);
  grpc_metadata_array_init(&c->md);
  if (method == M_GENERIC)
    grpc_call_details_init(&c->details);
  c->status_details = grpc_empty_slice();
  c->w_sent = -1;
  return c;
}

static void gcall_ref(gcall *c) {
  atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

/* grpc_call_start_batch, telling ThreadSanitizer that whatever the caller did
 * to the call so far happens before the tag comes out of the queue (see
 * common/base/tsan.h). The arguments are read before the release, in the caller. */
static grpc_call_error start_batch(grpc_call *call, const grpc_op *ops, size_t n, gtag *tag) {
  tsan_release(tag);
  return grpc_call_start_batch(call, ops, n, tag, NULL);
}

/* Releases everything of gRPC's that the call holds, the grpc_call last. Runs
 * when the final batch completes, so that a gcall kept alive afterwards only by
 * a core callback (possibly past grpc_shutdown) holds plain memory only. */
static void release_grpc(gcall *c) {
  if (c->grpc_released)
    return;
  c->grpc_released = 1;
  if (c->payload)
    grpc_byte_buffer_destroy(c->payload);
  if (c->reply)
    grpc_byte_buffer_destroy(c->reply);
  c->payload = c->reply = NULL;
  grpc_slice_unref(c->status_details);
  grpc_slice_unref(c->trailer.value);
  grpc_metadata_array_destroy(&c->md);
  if (c->method == M_GENERIC)
    grpc_call_details_destroy(&c->details);
  if (c->call)
    grpc_call_unref(c->call);
  c->call = NULL;
}

static void gcall_unref(gcall *c) {
  if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1)
    return;
  release_grpc(c);
  gpr_free(c->peer);
  free(c->ckpt);
  free(c->fwd);
  free(c);
}

static void list_add_locked(gcall **head, gcall *c) {
  c->prev = NULL;
  c->next = *head;
  if (*head)
    (*head)->prev = c;
  *head = c;
  c->listed = 1;
}

static void list_remove_locked(gcall **head, gcall *c) {
  if (!c->listed)
    return;
  if (c->prev)
    c->prev->next = c->next;
  else
    *head = c->next;
  if (c->next)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
  c->listed = 0;
}

static void watch_remove_locked(gsrv *s, gcall *c) {
  if (c->listed)
    s->nwatchers--;
  list_remove_locked(&s->watchers, c);
}

/* ------------------------------------------------------------------------ */
/* Answering                                                                */
/* ------------------------------------------------------------------------ */

static void on_final(gtag *t, int ok);
static void answer_release(gcall *c);

/* Everything after the final batch: the call leaves the in-flight list, its
 * grpc_call is released and so is the room its answer took. */
static void final_done(gcall *c) {
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  if (c->method == M_HEALTH_WATCH)
    watch_remove_locked(s, c);
  else
    list_remove_locked(&s->inflight, c);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  release_grpc(c);
  answer_release(c);
}

static void on_final(gtag *t, int ok) {
  (void)ok; /* a failed batch means the peer is gone; nothing more to do */
  gcall *c = container_of(t, gcall, io_tag);
  final_done(c);
  gcall_unref(c);
}

/* Fills the status operation of a final batch: the gRPC code of `zs`, the
 * detail sentence (zs_strerror's when none is given) and the zs-status
 * trailer. The slices live in the call until the batch completes. */
static void status_op(gcall *c, grpc_op *op, int zs, const char *detail) {
  snprintf(c->zs_buf, sizeof c->zs_buf, "%d", zs);
  grpc_slice_unref(c->trailer.value);
  memset(&c->trailer, 0, sizeof c->trailer);
  c->trailer.key = grpc_slice_from_static_string(ZS_STATUS_KEY);
  c->trailer.value = grpc_slice_from_copied_string(c->zs_buf);
  grpc_slice_unref(c->status_details);
  c->status_details = grpc_slice_from_copied_string(
      detail && detail[0] ? detail : (zs != ZS_OK ? zs_strerror(zs) : ""));
  if (zs != ZS_OK)
    LOG_DEBUG("rpc_error", "method=%s status=%s detail=\"%s\"",
              c->method < M_COUNT ? methods[c->method].path : "unknown", zs_err_name(zs),
              detail ? detail : "");
  op->op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  op->data.send_status_from_server.status = (grpc_status_code)status_to_grpc(zs);
  op->data.send_status_from_server.trailing_metadata_count = 1;
  op->data.send_status_from_server.trailing_metadata = &c->trailer;
  op->data.send_status_from_server.status_details = zs != ZS_OK ? &c->status_details : NULL;
}

/* Sends the answer: `reply` (owned from here on; NULL for an error) and the
 * status of `zs`. The caller must have claimed the call. */
static void send_final(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail) {
  c->reply = reply;
  if (c->method < M_COUNT && c->start_ns)
    metrics_rpc_observe(c->s->rpc_metric[c->method], clock_now_ns() - c->start_ns, zs != ZS_OK);
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (reply) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = reply;
  }
  status_op(c, &ops[n++], zs, detail);
  if (!c->close_started) { /* a parked call has it in a batch of its own */
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  }
  c->io_tag.done = on_final;
  gcall_ref(c);
  grpc_call_error e = start_batch(c->call, ops, n, &c->io_tag);
  if (e != GRPC_CALL_OK) {
    LOG_ERROR("grpc_batch_failed", "method=%s error=%s",
              c->method < M_COUNT ? methods[c->method].path : "unknown",
              grpc_call_error_to_string(e));
    final_done(c);
    gcall_unref(c);
  }
}

/* Claims the call and answers it; if someone else answered first (the
 * shutdown sweep), drops `reply`. */
static void answer(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail) {
  if (atomic_exchange(&c->claimed, 1)) {
    if (reply)
      grpc_byte_buffer_destroy(reply);
    /* The one who answered released the call's room, possibly before this
     * answer counted it. */
    answer_release(c);
    return;
  }
  send_final(c, reply, zs, detail);
}

/* Answers through answer() or, when the caller already holds the claim (after
 * a hop), through send_final(). */
static void finish(gcall *c, int claimed, grpc_byte_buffer *reply, int zs, const char *detail) {
  char ferr[GSRV_ERRLEN];
  if (c->fwd && zs == ZS_OK) {
    /* The write succeeded here: the backups get it before the trainer hears
     * of it (server/replica/replica.h). This blocks the polling thread. */
    int rc = replica_forward_raw(c->s->rep, methods[c->method].path, c->fwd_step, c->fwd,
                                 c->fwd_len, ferr, sizeof ferr);
    if (rc) {
      if (reply)
        grpc_byte_buffer_destroy(reply);
      reply = NULL;
      zs = rc;
      detail = ferr;
    }
  }
  free(c->fwd);
  c->fwd = NULL;
  if (claimed)
    send_final(c, reply, zs, detail);
  else
    answer(c, reply, zs, detail);
}

static grpc_byte_buffer *pack_message(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  grpc_slice sl = grpc_slice_malloc(n);
  protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(sl));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  return bb;
}

static void finish_msg(gcall *c, int claimed, const ProtobufCMessage *m) {
  finish(c, claimed, pack_message(m), ZS_OK, NULL);
}

static void finish_err(gcall *c, int claimed, int zs, const char *detail) {
  finish(c, claimed, NULL, zs, detail);
}

/* ------------------------------------------------------------------------ */
/* Core callbacks and the hop back to a polling thread                      */
/* ------------------------------------------------------------------------ */

static void pull_finish(gcall *c, int claimed);
static void stats_finish(gcall *c, int claimed);
static void apply_finish(gcall *c, int claimed);
static void ckpt_finish(gcall *c, int claimed);

static void on_hop(gtag *t, int ok) {
  (void)ok; /* an empty batch always completes; a dead peer shows later */
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  c->waiting = 0;
  pthread_mutex_unlock(&s->lock);
  switch (c->method) {
  case M_PULL:
    pull_finish(c, 1);
    break;
  case M_GRAD_STATS:
    stats_finish(c, 1);
    break;
  case M_CHECKPOINT:
  case M_COMMIT_CHECKPOINT:
  case M_RESTORE:
    ckpt_finish(c, 1);
    break;
  default:
    apply_finish(c, 1);
    break;
  }
  gcall_unref(c);
}

/* Runs on a core thread: claims the call and moves on to a polling thread by
 * an empty batch, which gRPC completes at once on the call's queue. If the
 * shutdown sweep answered the call already, only the core's reference is
 * dropped. */
static void resume_from_core(gcall *c) {
  if (atomic_exchange(&c->claimed, 1) == 0) {
    c->io_tag.done = on_hop;
    gcall_ref(c);
    grpc_call_error e = start_batch(c->call, NULL, 0, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      gcall_unref(c);
      send_final(c, NULL, ZS_EINTERNAL, "cannot resume the call after the core answered");
    }
  }
  gcall_unref(c);
}

static void on_core_version(void *arg, int status, uint64_t version) {
  gcall *c = arg;
  (void)version; /* core_read reports the version it reads */
  c->async_status = status;
  resume_from_core(c);
}

static void on_core_stats(void *arg, int status, const core_stats_result *r) {
  gcall *c = arg;
  c->async_status = status;
  if (r)
    c->stats = *r;
  resume_from_core(c);
}

static void on_core_apply(void *arg, int status, const core_apply_result *r) {
  gcall *c = arg;
  c->async_status = status;
  if (r)
    c->apply = *r;
  resume_from_core(c);
}

/* Marks the call as parked in the core (or not), for the shutdown grace. */
static void set_waiting(gcall *c, int waiting) {
  pthread_mutex_lock(&c->s->lock);
  c->waiting = waiting;
  pthread_mutex_unlock(&c->s->lock);
}

/* The absolute clock_now_ms() deadline of a wait: the request's timeout, else
 * the call's deadline (the earlier of both when both are set), never more
 * than GSRV_MAX_WAIT_MS. */
static uint64_t wait_deadline(const gcall *c, uint32_t timeout_ms) {
  uint64_t rel = GSRV_MAX_WAIT_MS;
  if (timeout_ms > 0 && timeout_ms < rel)
    rel = timeout_ms;
  gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) < 0) {
    gpr_timespec left = gpr_time_sub(dl, gpr_now(GPR_CLOCK_MONOTONIC));
    if (left.tv_sec < 0) {
      rel = 0;
    } else if ((uint64_t)left.tv_sec < rel / 1000 + 1) {
      uint64_t ms = (uint64_t)left.tv_sec * 1000 + (uint64_t)left.tv_nsec / 1000000;
      if (ms < rel)
        rel = ms;
    }
  }
  return clock_now_ms() + rel;
}

/* ------------------------------------------------------------------------ */
/* Parked calls                                                             */
/* ------------------------------------------------------------------------ */

/* A parked call costs the server its gRPC call and stream (about 14 KiB) for
 * as long as it waits, up to GSRV_MAX_WAIT_MS. So each one is counted against
 * a whole-server and a per-connection budget, and each has its
 * RECV_CLOSE_ON_SERVER pending from the start: a cancel or a disconnect
 * completes it at once, which answers the call, releases the gRPC call and
 * ends the core's wait (core_cancel_waits) then, not when the wait ends. */

static uint32_t peer_bucket(const char *peer) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const unsigned char *p = (const unsigned char *)peer; *p; p++)
    h = (h ^ *p) * 16777619u;
  return h % GSRV_PEER_BUCKETS;
}

static peer_count **peer_find_locked(gsrv *s, const char *peer) {
  peer_count **pp = &s->peers[peer_bucket(peer)];
  while (*pp && strcmp((*pp)->peer, peer) != 0)
    pp = &(*pp)->next;
  return pp;
}

/* The entry of `peer`, made if there is none; NULL when out of memory. */
static peer_count *peer_get_locked(gsrv *s, const char *peer) {
  peer_count **pp = peer_find_locked(s, peer);
  if (*pp)
    return *pp;
  size_t n = strlen(peer) + 1;
  peer_count *e = calloc(1, sizeof *e + n);
  if (!e)
    return NULL;
  memcpy(e->peer, peer, n);
  *pp = e;
  return e;
}

/* Frees the entry of `peer` once nothing is counted in it. */
static void peer_put_locked(gsrv *s, const char *peer) {
  peer_count **pp = peer_find_locked(s, peer);
  if (*pp && (*pp)->n == 0 && (*pp)->answer_bytes == 0) {
    peer_count *e = *pp;
    *pp = e->next;
    free(e);
  }
}

/* The key of a connection's address in s->peers: "@" and grpc's peer name
 * without its port ("@ipv4:10.0.0.7"), so that one host's connections share
 * one count. */
static void peer_addr_key(const char *peer, char *buf, size_t len) {
  snprintf(buf, len, "@%s", peer);
  char *colon = strrchr(buf, ':');
  if ((strncmp(peer, "ipv4:", 5) == 0 || strncmp(peer, "ipv6:", 5) == 0) && colon &&
      colon > buf + 5)
    *colon = '\0';
}

/* One address may park a quarter of the server's budget (at least one
 * connection's), so that a single host opening many connections cannot take
 * every slot from the others. */
static uint32_t park_addr_cap(const gsrv *s) {
  uint32_t q = s->lim.max_parked / 4u;
  return q > s->lim.max_parked_per_conn ? q : s->lim.max_parked_per_conn;
}

/* Counts the call against the budgets; returns 0, or ZS_ELIMIT with the
 * sentence in err when one is full. A call whose version is there already
 * (`now`) does not park: it is never refused and never counted. s->lock
 * held. */
static int park_count_locked(gsrv *s, gcall *c, int now, char *err, size_t errlen) {
  if (now)
    return 0;
  const char *peer = c->peer ? c->peer : "unknown";
  char addr[160];
  peer_addr_key(peer, addr, sizeof addr);
  if (s->nparked >= s->lim.max_parked)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "the server already holds %" PRIu32
                       " waiting calls (Pull, GradStats), its limit; retry later",
                       s->lim.max_parked);
  peer_count **pp = peer_find_locked(s, peer);
  if (*pp && (*pp)->n >= s->lim.max_parked_per_conn)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "this connection already has %" PRIu32
                       " waiting calls (Pull, GradStats), the server's limit per connection",
                       s->lim.max_parked_per_conn);
  pp = peer_find_locked(s, addr);
  if (*pp && (*pp)->n >= park_addr_cap(s))
    return status_fail(err, errlen, ZS_ELIMIT,
                       "this address already has %" PRIu32
                       " waiting calls (Pull, GradStats), the server's limit per address",
                       park_addr_cap(s));
  peer_count *e = peer_get_locked(s, peer), *a = e ? peer_get_locked(s, addr) : NULL;
  if (!a) {
    if (e)
      peer_put_locked(s, peer);
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory counting a waiting call");
  }
  e->n++;
  a->n++;
  s->nparked++;
  c->parked = 1;
  return 0;
}

/* Takes the call off the budgets (once; later calls do nothing). */
static void park_uncount(gcall *c) {
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  if (c->parked) {
    c->parked = 0;
    s->nparked--;
    const char *peer = c->peer ? c->peer : "unknown";
    char addr[160];
    peer_addr_key(peer, addr, sizeof addr);
    peer_count **pp = peer_find_locked(s, peer);
    if (*pp)
      (*pp)->n--;
    peer_put_locked(s, peer);
    pp = peer_find_locked(s, addr);
    if (*pp)
      (*pp)->n--;
    peer_put_locked(s, addr);
  }
  pthread_mutex_unlock(&s->lock);
}

static void on_park_close(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, close_tag);
  park_uncount(c);
  /* Not cancelled: the final batch went out, nothing is left to do. Else the
   * peer cancelled or went away: the call is answered now (a core callback
   * that comes later finds it claimed), which releases the gRPC call. */
  if (c->cancelled) {
    answer(c, NULL, ZS_ECANCELED, "the client cancelled the call or went away");
    /* The core's callback then finds the call answered and drops it. */
    core_cancel_waits(c->s->core, c);
  }
  gcall_unref(c);
}

/* Before a call may wait in the core for version `want` (a Pull's
 * min_version, a GradStats' step): counts one that may wait against the
 * budgets (service_wait_admission: one whose version is there is neither
 * counted nor refused) and starts its RECV_CLOSE_ON_SERVER. Returns 0, or a
 * status with the sentence in err (the caller answers it). The count ends
 * when the call closes (on_park_close), or earlier by park_uncount when it
 * does not wait. */
static int park_begin(gsrv *s, gcall *c, uint64_t want, char *err, size_t errlen) {
  int now = service_wait_admission(s->svc, c->hash, want);
  if (!c->peer)
    c->peer = grpc_call_get_peer(c->call);
  pthread_mutex_lock(&s->lock);
  int rc = park_count_locked(s, c, now, err, errlen);
  if (rc == 0)
    c->waiting = 1;
  pthread_mutex_unlock(&s->lock);
  if (rc)
    return rc;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  c->close_tag.done = on_park_close;
  c->close_started = 1;
  gcall_ref(c);
  grpc_call_error e = start_batch(c->call, &op, 1, &c->close_tag);
  if (e != GRPC_CALL_OK) {
    c->close_started = 0;
    gcall_unref(c);
    set_waiting(c, 0);
    park_uncount(c);
    return status_fail(err, errlen, ZS_EINTERNAL, "cannot watch the call for a cancel: %s",
                       grpc_call_error_to_string(e));
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Pull answers                                                             */
/* ------------------------------------------------------------------------ */

/* A Pull's answer (the piece, up to 1 GiB) is built once its version is there
 * and held until gRPC has handed it to the socket, which a peer that does not
 * read delays as long as it likes. So answers count against a whole-server
 * and a per-connection budget while they are held. One that does not fit
 * waits in gsrv.answer_wait and is built when room is made, rather than
 * refused: an honest trainer's pulls all come due at once after an apply. */

static void pull_build(gcall *c, int claimed);

static int answer_fits_locked(const gsrv *s, const peer_count *e, uint64_t n) {
  return (s->answer_bytes == 0 || s->answer_bytes + n <= s->lim.max_answer_bytes) &&
         (e->answer_bytes == 0 || e->answer_bytes + n <= s->lim.max_answer_bytes_per_conn);
}

static void answer_count_locked(gsrv *s, peer_count *e, gcall *c, uint64_t n) {
  s->answer_bytes += n;
  e->answer_bytes += n;
  c->answer_held = n;
  c->answer_since_ms = clock_now_ms();
}

/* Cancels the calls whose answers were held past answer_stall_ms (their peers
 * stopped reading): their final batches fail, which gives the room back.
 * s->lock held; a call still in s->inflight has its grpc_call. */
static void answer_cancel_stalled_locked(gsrv *s) {
  uint64_t now = clock_now_ms();
  for (gcall *i = s->inflight; i; i = i->next) {
    if (!i->answer_held || i->stall_cancelled || !i->call ||
        now - i->answer_since_ms < s->lim.answer_stall_ms)
      continue;
    i->stall_cancelled = 1;
    LOG_WARN("grpc_answer_stalled", "bytes=%" PRIu64 " held_ms=%" PRIu64, i->answer_held,
             now - i->answer_since_ms);
    grpc_call_cancel(i->call, NULL);
  }
}

/* Room for c's answer (c->nbytes bytes): 1 when counted, 0 when c waits in
 * the queue (with a reference) for answer_release to build it, -1 when out
 * of memory. */
static int answer_reserve(gsrv *s, gcall *c, int claimed) {
  int rc = -1;
  pthread_mutex_lock(&s->lock);
  peer_count *e = peer_get_locked(s, c->peer ? c->peer : "unknown");
  if (e && (s->closing || answer_fits_locked(s, e, c->nbytes))) {
    answer_count_locked(s, e, c, c->nbytes);
    rc = 1;
  } else if (e) {
    c->aw_claimed = claimed;
    c->aw_next = NULL;
    gcall_ref(c);
    if (!s->answer_wait)
      s->answer_wait_tail = &s->answer_wait;
    *s->answer_wait_tail = c;
    s->answer_wait_tail = &c->aw_next;
    answer_cancel_stalled_locked(s);
    rc = 0;
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* Room for an answer of n bytes that cannot wait: 0 when counted, else
 * ZS_ELIMIT (or ZS_ENOMEM) with the sentence in err. */
static int answer_try_reserve(gsrv *s, gcall *c, uint64_t n, char *err, size_t errlen) {
  if (!c->peer)
    c->peer = grpc_call_get_peer(c->call);
  pthread_mutex_lock(&s->lock);
  peer_count *e = peer_get_locked(s, c->peer ? c->peer : "unknown");
  int rc = 0;
  if (!e) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory counting an answer");
  } else if (!answer_fits_locked(s, e, n)) {
    rc = status_fail(err, errlen, ZS_ELIMIT,
                     "answers not yet taken hold %" PRIu64 " bytes on this connection and %" PRIu64
                     " on the server, the limits; read them, or retry later",
                     e->answer_bytes, s->answer_bytes);
    peer_put_locked(s, c->peer ? c->peer : "unknown");
  } else {
    answer_count_locked(s, e, c, n);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* Gives back the room of c's answer, if it has any, and builds the waiting
 * answers that fit now (once each, in queue order per connection). */
static void answer_release(gcall *c) {
  gsrv *s = c->s;
  gcall *run = NULL, **run_tail = &run;
  pthread_mutex_lock(&s->lock);
  if (!c->answer_held) {
    pthread_mutex_unlock(&s->lock);
    return;
  }
  const char *peer = c->peer ? c->peer : "unknown";
  peer_count *e = *peer_find_locked(s, peer);
  s->answer_bytes -= c->answer_held;
  if (e)
    e->answer_bytes -= c->answer_held;
  c->answer_held = 0;
  peer_put_locked(s, peer);
  gcall **pp = &s->answer_wait;
  while (*pp) {
    gcall *w = *pp;
    peer_count *we = peer_get_locked(s, w->peer ? w->peer : "unknown");
    if (we && answer_fits_locked(s, we, w->nbytes)) {
      *pp = w->aw_next;
      answer_count_locked(s, we, w, w->nbytes);
      w->aw_next = NULL;
      *run_tail = w;
      run_tail = &w->aw_next;
    } else {
      pp = &w->aw_next;
    }
  }
  s->answer_wait_tail = pp;
  pthread_mutex_unlock(&s->lock);
  while (run) {
    gcall *w = run;
    run = w->aw_next;
    pull_build(w, w->aw_claimed);
    gcall_unref(w);
  }
}

/* ------------------------------------------------------------------------ */
/* Request decoding                                                         */
/* ------------------------------------------------------------------------ */

#define UNPACK(type, desc, msg, len) ((type *)protobuf_c_message_unpack(&(desc), NULL, len, msg))

static void bad_message(gcall *c, const char *type) {
  char err[GSRV_ERRLEN];
  snprintf(err, sizeof err, "the request is not a valid %s message", type);
  answer(c, NULL, ZS_EPROTO, err);
}

/* ------------------------------------------------------------------------ */
/* ZShard methods                                                           */
/* ------------------------------------------------------------------------ */

/* A job name as it may appear in a log line: printable, no spaces or quotes
 * (a name comes from the network). */
static void log_safe(char *dst, size_t cap, const char *src) {
  size_t i = 0;
  for (; src && src[i] && i + 1 < cap; i++) {
    unsigned char ch = (unsigned char)src[i];
    dst[i] = ch > 0x20 && ch < 0x7f && ch != '"' && ch != '=' ? (char)ch : '_';
  }
  dst[i] = '\0';
}

static void h_open(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__OpenRequest *r =
      UNPACK(Zshard__V1__OpenRequest, zshard__v1__open_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.OpenRequest");
    return;
  }
  spec sp;
  memset(&sp, 0, sizeof sp);
  int rc;
  if (!r->spec) {
    rc = ZS_EINVAL;
    snprintf(err, sizeof err, "OpenRequest carries no spec");
    goto fail;
  }
  rc = spec_from_proto(&sp, r->spec, err, sizeof err);
  if (rc)
    goto fail;
  core_open_result res;
  rc = service_open_job(s->svc, &sp, r->rank, (int)r->mode, r->trainer_timeout_ms, &res, err,
                        sizeof err);
  if (rc)
    goto fail;
  if (res.created) {
    char job[65];
    log_safe(job, sizeof job, sp.job);
    LOG_INFO("job_opened",
             "job=%s spec_hash=%016" PRIx64 " tensors=%" PRIu32 " world_size=%" PRIu32
             " grad_accum=%" PRIu32 " shards=%" PRIu32 " rank=%" PRIu32,
             job, res.spec_hash, sp.num_tensors, sp.world_size, sp.grad_accum, sp.num_shards,
             r->rank);
  }
  core_info info;
  service_info(s->svc, &info);
  /* The version is read again with the client state, so that the trainer
   * gets the state of the version it resumes at even if an apply ran since
   * core_open looked. */
  uint8_t cs[CORE_MAX_CLIENT_STATE];
  uint64_t cs_version = 0;
  size_t cs_len = service_client_state(s->svc, cs, sizeof cs, &cs_version);
  Zshard__V1__OpenResponse resp = ZSHARD__V1__OPEN_RESPONSE__INIT;
  resp.spec_hash = res.spec_hash;
  resp.version = cs_version;
  resp.client_state.data = cs;
  resp.client_state.len = cs_len;
  resp.shard_id = info.shard_id;
  resp.num_shards = info.num_shards;
  resp.created = res.created != 0;
  resp.initialized = res.initialized != 0;
  resp.world_size = res.world_size;
  finish_msg(c, 0, &resp.base);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return;
fail:
  finish_err(c, 0, rc, err);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

static void h_init_params(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__InitParamsRequest *r =
      UNPACK(Zshard__V1__InitParamsRequest, zshard__v1__init_params_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.InitParamsRequest");
    return;
  }
  int written = 0;
  uint64_t version = 0;
  /* protobuf-c allocates the bytes with malloc, so they are float-aligned. */
  int rc = service_init_params(s->svc, r->spec_hash, r->tensor, r->slice, r->offset, r->data.data,
                               r->data.len, &written, &version, err, sizeof err);
  if (rc) {
    finish_err(c, 0, rc, err);
  } else {
    Zshard__V1__InitParamsResponse resp = ZSHARD__V1__INIT_PARAMS_RESPONSE__INIT;
    resp.written = written != 0;
    resp.version = version;
    finish_msg(c, 0, &resp.base);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

/* A chunk of a Push payload (PushRequest.total set): checked against the
 * piece before any byte is held, then kept until the payload is whole, which
 * comes back in *whole (malloc'ed) with the last chunk. */
static int push_chunk(gsrv *s, const core_push_args *a, uint64_t offset, uint64_t total,
                      void **whole, char *err, size_t errlen) {
  *whole = NULL;
  core_push_args q = *a;
  q.nbytes = (size_t)total;
  int rc = total > SIZE_MAX ? ZS_ESIZE : service_push_check(s->svc, &q, err, errlen);
  if (rc)
    return rc;
  push_asm_key k = {.hash = a->hash,
                    .step = a->step,
                    .rank = a->rank,
                    .micro = a->micro,
                    .tensor = a->tensor,
                    .slice = a->slice,
                    .dtype = a->dtype};
  return push_asm_add(s->chunks, &k, total, offset, a->data, a->nbytes, whole, err, errlen);
}

static void h_push(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  pb_push r;
  if (pb_push_decode(msg, len, &r) != PB_OK) {
    bad_message(c, "zshard.v1.PushRequest");
    return;
  }
  if (!r.dtype) {
    snprintf(err, sizeof err, "Push needs dtype %s", dtype_names());
    finish_err(c, 0, ZS_EDTYPE, err);
    return;
  }
  core_push_args a = {
      .hash = r.hash,
      .step = r.step,
      .rank = r.rank,
      .micro = r.micro,
      .tensor = r.tensor,
      .slice = r.slice,
      .dtype = (zs_dtype)r.dtype,
      .data = r.data,
      .nbytes = r.len,
  };
  void *whole = NULL;
  int job_ok = !c->bind.bound || core_job_named(service_core(s->svc), r.hash, c->bind.job);
  /* Before any chunk is kept: a refused push changes nothing. */
  int rc = auth_push_admit(s->auth, c->role, &c->bind, job_ok, r.rank, err, sizeof err);
  if (rc == 0 && r.total) {
    rc = push_chunk(s, &a, r.offset, r.total, &whole, err, sizeof err);
    if (rc == 0 && !whole) { /* more chunks to come: this one is kept */
      Zshard__V1__PushResponse resp = ZSHARD__V1__PUSH_RESPONSE__INIT;
      finish_msg(c, 0, &resp.base);
      return;
    }
    a.data = whole;
    a.nbytes = (size_t)r.total;
  }
  int duplicate = 0;
  if (rc == 0)
    rc = service_push(s->svc, &a, &duplicate, err, sizeof err);
  free(whole);
  if (rc) {
    finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__PushResponse resp = ZSHARD__V1__PUSH_RESPONSE__INIT;
  resp.duplicate = duplicate != 0;
  finish_msg(c, 0, &resp.base);
}

/* Builds the PullResponse by hand (pb_inplace.h) in one slice so that
 * core_read writes the piece straight into the message, the one copy of the
 * piece on this path before gRPC sends it. */
static void pull_finish(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  if (c->async_status != ZS_OK) {
    finish_err(
        c, claimed,
        service_pull_wait_failed(c->async_status, c->step, c->tensor, c->slice, err, sizeof err),
        err);
    return;
  }
  int room = answer_reserve(s, c, claimed);
  if (room < 0)
    finish_err(c, claimed, ZS_ENOMEM, "out of memory counting a Pull answer");
  else if (room > 0)
    pull_build(c, claimed);
}

/* pull_finish's answer, once it has room. */
static void pull_build(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  grpc_slice sl = grpc_slice_malloc(pb_pull_cap((int)c->dtype, c->nbytes));
  uint8_t *p = GRPC_SLICE_START_PTR(sl);
  size_t off = pb_pull_head(p, (int)c->dtype, c->nbytes);
  uint64_t version = 0;
  int rc = core_read(s->core, c->hash, c->tensor, c->slice, c->dtype, p + off, c->nbytes, &version,
                     err, sizeof err);
  if (rc) {
    grpc_slice_unref(sl);
    finish_err(c, claimed, rc, err);
    return;
  }
  off = pb_pull_tail(p, off + c->nbytes, version);
  GRPC_SLICE_SET_LENGTH(sl, off);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  core_count_pull(s->core, off);
  finish(c, claimed, bb, ZS_OK, NULL);
}

static void h_pull(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__PullRequest *r =
      UNPACK(Zshard__V1__PullRequest, zshard__v1__pull_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.PullRequest");
    return;
  }
  c->hash = r->spec_hash;
  c->tensor = r->tensor;
  c->slice = r->slice;
  c->step = r->min_version; /* reported in a timeout's detail */
  int dtype = (int)r->dtype;
  uint64_t min_version = r->min_version;
  uint32_t timeout_ms = r->timeout_ms;
  protobuf_c_message_free_unpacked(&r->base, NULL);

  if (!dtype_valid(dtype)) {
    snprintf(err, sizeof err, "Pull needs dtype %s", dtype_names());
    finish_err(c, 0, ZS_EDTYPE, err);
    return;
  }
  c->dtype = (zs_dtype)dtype;
  /* Size (and so tensor, slice and hash) are checked before waiting, so a bad
   * request fails at once rather than at the end of its wait. */
  int64_t nb = service_piece_bytes(s->svc, c->hash, c->tensor, c->slice, c->dtype, err, sizeof err);
  if (nb < 0) {
    finish_err(c, 0, (int)nb, err);
    return;
  }
  /* The message's own fields take a few bytes besides the piece's. */
  if ((uint64_t)nb > RPC_MAX_MESSAGE_BYTES - 64) {
    finish_err(c, 0,
               service_too_large("piece", (uint64_t)nb, RPC_MAX_MESSAGE_BYTES, "gRPC message", err,
                                 sizeof err),
               err);
    return;
  }
  c->nbytes = (size_t)nb;

  uint64_t version = 0;
  int rc = park_begin(s, c, min_version, err, sizeof err);
  if (rc) {
    finish_err(c, 0, rc, err);
    return;
  }
  gcall_ref(c);                                /* the core's, released by resume_from_core */
  core_piece_id piece = {c->tensor, c->slice}; /* a pipelined job answers it once applied */
  rc = core_wait_pieces(s->core, c->hash, &piece, 1, min_version, wait_deadline(c, timeout_ms),
                        on_core_version, c, &version, err, sizeof err);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  set_waiting(c, 0);
  park_uncount(c);
  if (rc < 0) {
    finish_err(c, 0, rc, err);
    return;
  }
  c->async_status = ZS_OK;
  pull_finish(c, 0);
}

static void stats_finish(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  Zshard__V1__GradStatsResponse resp = ZSHARD__V1__GRAD_STATS_RESPONSE__INIT;
  Zshard__V1__MissingContribution miss[CORE_MAX_MISSING];
  Zshard__V1__MissingContribution *missp[CORE_MAX_MISSING];
  core_missing_entry ent[CORE_MAX_MISSING];
  spec sp; /* a copy, for the missing tensors' names: see h_get_info */
  int have = 0;
  uint32_t ranks[CORE_ELASTIC_MAX_W];
  if (c->async_status == ZS_OK) {
    resp.step = c->stats.step;
    resp.complete = 1;
    resp.sum_squares = c->stats.sum_squares;
    resp.nonfinite = c->stats.nonfinite != 0;
    resp.num_members = c->stats.members.n;
    resp.n_members = core_members_list(s->core, &c->stats.members, ranks, CORE_ELASTIC_MAX_W);
    resp.members = ranks;
  } else if (c->async_status == ZS_ETIMEDOUT) {
    /* A timeout is an answer, not an error: the caller learns who is late. */
    resp.step = c->step;
    resp.complete = 0;
    uint32_t total = core_missing(s->core, c->step, ent, CORE_MAX_MISSING);
    uint32_t n = total < CORE_MAX_MISSING ? total : CORE_MAX_MISSING;
    have = n > 0 && core_spec_copy(s->core, &sp, NULL) == 0;
    for (uint32_t i = 0; i < n; i++) {
      zshard__v1__missing_contribution__init(&miss[i]);
      miss[i].rank = ent[i].rank;
      miss[i].micro = ent[i].micro;
      miss[i].tensor = ent[i].tensor;
      miss[i].slice = ent[i].slice;
      miss[i].tensor_name = have && ent[i].tensor < sp.num_tensors
                                ? sp.tensors[ent[i].tensor].name
                                : (char *)protobuf_c_empty_string;
      missp[i] = &miss[i];
    }
    resp.n_missing = n;
    resp.missing = missp;
    resp.missing_total = total;
  } else {
    snprintf(err, sizeof err, "GradStats of step %" PRIu64 ": %s", c->step,
             zs_strerror(c->async_status));
    finish_err(c, claimed, c->async_status, err);
    return;
  }
  finish_msg(c, claimed, &resp.base);
  if (have)
    spec_free(&sp);
}

static void h_grad_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__GradStatsRequest *r =
      UNPACK(Zshard__V1__GradStatsRequest, zshard__v1__grad_stats_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.GradStatsRequest");
    return;
  }
  c->hash = r->spec_hash;
  c->step = r->step;
  uint32_t timeout_ms = r->timeout_ms;
  uint32_t acked_rank = r->acked_rank;
  /* The membership asked for (second round of the agreement), checked
   * against the job before anything waits. */
  c->has_want = r->num_members > 0;
  int rc = c->has_want ? core_members_decode(s->core, r->num_members, r->members, r->n_members,
                                             &c->want, err, sizeof err)
                       : 0;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    finish_err(c, 0, rc, err);
    return;
  }
  const core_members *want = c->has_want ? &c->want : NULL;

  rc = park_begin(s, c, c->step, err, sizeof err);
  if (rc == ZS_ELIMIT) {
    /* No room to wait, but statistics that are ready need none: asked with
     * a deadline already passed, the core answers them or says
     * ZS_ETIMEDOUT at once, never parking the call. */
    char now_err[GSRV_ERRLEN] = "";
    int now = service_grad_stats_members(s->svc, c->hash, c->step, acked_rank, want, clock_now_ms(),
                                         on_core_stats, c, &c->stats, now_err, sizeof now_err);
    if (now == ZS_OK) {
      c->async_status = ZS_OK;
      stats_finish(c, 0);
      return;
    }
    if (now != ZS_ETIMEDOUT && now != CORE_PENDING) {
      finish_err(c, 0, now, now_err);
      return;
    }
  }
  if (rc) {
    finish_err(c, 0, rc, err);
    return;
  }
  gcall_ref(c);
  rc = service_grad_stats_members(s->svc, c->hash, c->step, acked_rank, want,
                                  wait_deadline(c, timeout_ms), on_core_stats, c, &c->stats, err,
                                  sizeof err);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  set_waiting(c, 0);
  park_uncount(c);
  if (rc < 0 && rc != ZS_ETIMEDOUT) {
    finish_err(c, 0, rc, err);
    return;
  }
  c->async_status = rc;
  stats_finish(c, 0);
}

static void apply_finish(gcall *c, int claimed) {
  if (c->async_status != ZS_OK) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "Apply of step %" PRIu64 ": %s", c->step,
             zs_strerror(c->async_status));
    finish_err(c, claimed, c->async_status, err);
    return;
  }
  Zshard__V1__ApplyResponse resp = ZSHARD__V1__APPLY_RESPONSE__INIT;
  resp.step = c->apply.step;
  resp.version = c->apply.version;
  resp.skipped = c->apply.skipped != 0;
  resp.optimizer_steps = c->apply.optimizer_steps;
  finish_msg(c, claimed, &resp.base);
}

static void h_apply(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ApplyRequest *r =
      UNPACK(Zshard__V1__ApplyRequest, zshard__v1__apply_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ApplyRequest");
    return;
  }
  c->step = r->step;
  c->fwd_step = r->step;
  /* The apply runs on a core thread; this call is work in progress, not a
   * wait, so shutdown gives it the grace period. */
  gcall_ref(c);
  /* protobuf-c bounds n_group_lr by the message's length; the core checks
   * it against the job's group count. */
  uint32_t nglr = r->n_group_lr > UINT32_MAX ? UINT32_MAX : (uint32_t)r->n_group_lr;
  core_step_hparams hp;
#define HP_FROM_REQUEST(up, name)                                                                  \
  hp.v[CORE_HP_##up] = r->group_##name;                                                            \
  hp.n[CORE_HP_##up] = r->n_group_##name > UINT32_MAX ? UINT32_MAX : (uint32_t)r->n_group_##name;
  CORE_STEP_HPARAMS(HP_FROM_REQUEST)
#undef HP_FROM_REQUEST
  core_members members;
  int rc = r->num_members > 0 ? core_members_decode(s->core, r->num_members, r->members,
                                                    r->n_members, &members, err, sizeof err)
                              : 0;
  if (rc == 0)
    rc = service_apply_members(s->svc, r->spec_hash, r->step, r->lr, r->group_lr, nglr, &hp,
                               r->num_members > 0 ? &members : NULL, r->coef, r->skip,
                               r->client_state.data, r->client_state.len, on_core_apply, c,
                               &c->apply, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  if (rc < 0) {
    finish_err(c, 0, rc, err);
    return;
  }
  /* Answered at once: a repeat of the step just applied, maybe before the
   * replica's applied hook ran (replica.h). */
  replica_wait_applied(s->rep, c->apply.version);
  c->async_status = ZS_OK;
  apply_finish(c, 0);
}

static void h_get_info(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__GetInfoRequest *r =
      UNPACK(Zshard__V1__GetInfoRequest, zshard__v1__get_info_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.GetInfoRequest");
    return;
  }
  int with_spec = r->with_spec;
  /* A peer's probe carries its member list: the replica compares it. */
  replica_check_caller(s->rep, r->replica_members, r->replica_index, r->replica_term, c->admin);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  core_info info;
  service_info(s->svc, &info);
  pthread_mutex_lock(&s->lock);
  int serving = s->serving;
  pthread_mutex_unlock(&s->lock);
  Zshard__V1__GetInfoResponse resp = ZSHARD__V1__GET_INFO_RESPONSE__INIT;
  resp.shard_id = info.shard_id;
  resp.num_shards = info.num_shards;
  resp.job = info.has_job ? info.job : (char *)protobuf_c_empty_string;
  resp.spec_hash = info.spec_hash;
  resp.version = info.version;
  resp.state_bytes = info.state_bytes;
  resp.pieces = info.pieces;
  resp.elements = info.elements;
  resp.initialized = info.initialized != 0;
  resp.uptime_s = (double)(clock_now_ns() - s->start_ns) / 1e9;
  resp.serving = serving != 0;
  resp.data_port = s->data_port;
  resp.optimizer_steps = info.optimizer_steps;
  Zshard__V1__ReplicaInfo ri = ZSHARD__V1__REPLICA_INFO__INIT;
  Zshard__V1__ReplicaMember members[REPLICA_MAX_MEMBERS];
  void *mptr[REPLICA_MAX_MEMBERS];
  char config_error[256];
  if (s->rep) {
    replica_info(s->rep, &ri, members, mptr, config_error, sizeof config_error);
    resp.replica = &ri;
  }
  /* A copy of the spec (the core's own may be freed by a close and an open
   * on another thread meanwhile); sent only when it is the job the info
   * describes, so that a job closed and replaced in between is not answered
   * with the new one's. The message borrows the copy's strings. */
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  spec sp;
  uint64_t hash = 0;
  int have = with_spec && info.has_job && service_spec_copy(s->svc, &sp, &hash) == 0;
  if (have && hash == info.spec_hash && spec_to_proto(&sp, &ms) == 0)
    resp.spec = &ms;
  finish_msg(c, 0, &resp.base);
  if (resp.spec)
    spec_proto_release(&ms);
  if (have)
    spec_free(&sp);
}

/* ReadState and WriteState are rare (a state_dict, a load_state_dict), so
 * they take the plain protobuf-c path: a read copies the range into a buffer
 * and packing copies it once more; a write is unpacked (1 copy) and copied
 * into the arena. Both answer on the polling thread: the core holds the state
 * lock for a copy of at most one message. */
static void h_read_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReadStateRequest *r =
      UNPACK(Zshard__V1__ReadStateRequest, zshard__v1__read_state_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ReadStateRequest");
    return;
  }
  uint64_t count = r->count, version = 0, steps = 0;
  float *buf = NULL;
  /* The message's own fields take a few bytes besides the data. */
  uint64_t max_bytes = RPC_PUSH_CHUNK_BYTES;
  int rc = 0;
  /* A count too large for a message is the service's to refuse (no buffer
   * is needed for that). The answer counts against the answer budgets, but
   * does not wait for room: a client reads state in 1 MiB chunks. */
  if (count <= max_bytes / sizeof(float)) {
    rc = answer_try_reserve(s, c, count * sizeof(float), err, sizeof err);
    if (rc == 0 && !(buf = malloc(count ? count * sizeof(float) : 1))) {
      rc = ZS_ENOMEM;
      snprintf(err, sizeof err, "out of memory for a ReadState answer");
    }
  }
  if (rc == 0)
    rc = service_state_read(s->svc, r->spec_hash, r->tensor, r->slice, (int)r->array, r->offset,
                            count, max_bytes, buf, &version, &steps, err, sizeof err);
  /* The piece was found, so the shard holds a slice of the tensor. */
  uint64_t tsteps = 0;
  if (rc == 0)
    rc = service_tensor_steps(s->svc, r->spec_hash, r->tensor, &tsteps, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    free(buf);
    finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__ReadStateResponse resp = ZSHARD__V1__READ_STATE_RESPONSE__INIT;
  resp.version = version;
  resp.optimizer_steps = steps;
  resp.tensor_steps = tsteps;
  /* Little-endian float32 is the wire format, and the host's. */
  resp.data.data = (uint8_t *)buf;
  resp.data.len = (size_t)count * sizeof(float);
  finish_msg(c, 0, &resp.base);
  free(buf);
}

static void h_write_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__WriteStateRequest *r =
      UNPACK(Zshard__V1__WriteStateRequest, zshard__v1__write_state_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.WriteStateRequest");
    return;
  }
  uint64_t version = 0, steps = 0, set = r->optimizer_steps, tsteps = 0;
  int rc = 0;
  /* A tensor's count alone, or after the data and the job's count. */
  if (!r->set_tensor_steps || r->data.len > 0 || r->set_optimizer_steps)
    rc = service_state_write(s->svc, r->spec_hash, r->tensor, r->slice, (int)r->array, r->offset,
                             r->data.data, r->data.len, r->set_optimizer_steps ? &set : NULL,
                             &version, &steps, err, sizeof err);
  if (rc == 0 && r->set_tensor_steps)
    rc =
        service_set_tensor_steps(s->svc, r->spec_hash, r->tensor, r->tensor_steps, err, sizeof err);
  if (rc == 0) /* stays 0 when the shard holds no slice of the tensor */
    (void)service_tensor_steps(s->svc, r->spec_hash, r->tensor, &tsteps, NULL, 0);
  if (rc == 0 && r->set_tensor_steps && !r->set_optimizer_steps && r->data.len == 0) {
    /* The version and job count of an answer that wrote only the tensor's. */
    core_info info;
    service_info(s->svc, &info);
    version = info.version;
    steps = info.optimizer_steps;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__WriteStateResponse resp = ZSHARD__V1__WRITE_STATE_RESPONSE__INIT;
  resp.version = version;
  resp.optimizer_steps = steps;
  resp.tensor_steps = tsteps;
  finish_msg(c, 0, &resp.base);
}

/* Answered on the polling thread: the close waits for the worker (at most
 * the apply in progress), as an Open waits for the state lock. Calls of the
 * job parked in the core are answered ENOTOPEN from the worker meanwhile. */
/* Promote, ReplicaJoin, ReplicaFetch: the replica set's own methods
 * (server/replica/replica.h). A server that is not replicated answers EUNIMPL. */
static int no_replica(gsrv *s, gcall *c, const char *what) {
  if (s->rep)
    return 0;
  char err[GSRV_ERRLEN];
  snprintf(err, sizeof err, "%s: this server is not a member of a replica set (--replicas)", what);
  finish_err(c, 0, ZS_EUNIMPL, err);
  return 1;
}

static void h_promote(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__PromoteRequest *r =
      UNPACK(Zshard__V1__PromoteRequest, zshard__v1__promote_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.PromoteRequest");
    return;
  }
  uint64_t term = r->term;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (no_replica(s, c, "Promote"))
    return;
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__PromoteResponse resp = ZSHARD__V1__PROMOTE_RESPONSE__INIT;
  int role = 0;
  /* Blocks this polling thread for the peers' GetInfo (a short deadline):
   * promotions are rare. A trainer may call it (the client's failover), but
   * only the admin token moves a live primary's term. */
  int rc =
      replica_promote(s->rep, term, c->admin, &resp.term, &role, &resp.version, err, sizeof err);
  resp.role = (Zshard__V1__ReplicaRole)role;
  if (rc)
    finish_err(c, 0, rc, err);
  else
    finish_msg(c, 0, &resp.base);
}

static void h_replica_join(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__ReplicaJoinRequest *r = UNPACK(
      Zshard__V1__ReplicaJoinRequest, zshard__v1__replica_join_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ReplicaJoinRequest");
    return;
  }
  uint64_t term = r->term;
  uint32_t index = r->index;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (no_replica(s, c, "ReplicaJoin"))
    return;
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReplicaJoinResponse resp = ZSHARD__V1__REPLICA_JOIN_RESPONSE__INIT;
  resp.term = term;
  int rc = replica_join(s->rep, term, index, &resp.join_id, err, sizeof err);
  if (rc)
    finish_err(c, 0, rc, err);
  else
    finish_msg(c, 0, &resp.base);
}

static void h_replica_fetch(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__ReplicaFetchRequest *r = UNPACK(
      Zshard__V1__ReplicaFetchRequest, zshard__v1__replica_fetch_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ReplicaFetchRequest");
    return;
  }
  if (no_replica(s, c, "ReplicaFetch")) {
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return;
  }
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReplicaFetchResponse resp = ZSHARD__V1__REPLICA_FETCH_RESPONSE__INIT;
  /* Up to REPLICA_FETCH_ELEMS elements, packed (copied once) here. */
  int rc = replica_fetch(s->rep, r, &resp, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc)
    finish_err(c, 0, rc, err);
  else
    finish_msg(c, 0, &resp.base);
  replica_fetch_release(s->rep, &resp, rc == 0);
}

static void h_close_job(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CloseJobRequest *r =
      UNPACK(Zshard__V1__CloseJobRequest, zshard__v1__close_job_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.CloseJobRequest");
    return;
  }
  core_close_result res;
  int rc = service_close(s->svc, r->spec_hash, r->job, &res, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    finish_err(c, 0, rc, err);
    return;
  }
  core_info info;
  service_info(s->svc, &info);
  if (res.closed) {
    char job[65];
    log_safe(job, sizeof job, res.job);
    LOG_INFO("job_closed_by_request", "job=%s spec_hash=%016" PRIx64 " version=%" PRIu64, job,
             res.spec_hash, res.version);
  }
  Zshard__V1__CloseJobResponse resp = ZSHARD__V1__CLOSE_JOB_RESPONSE__INIT;
  resp.closed = res.closed != 0;
  resp.job = res.closed ? res.job : (char *)protobuf_c_empty_string;
  resp.spec_hash = res.spec_hash;
  resp.version = res.version;
  resp.shard_id = info.shard_id;
  resp.state_bytes = res.state_bytes;
  finish_msg(c, 0, &resp.base);
}

static void h_change_membership(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ChangeMembershipRequest *r =
      UNPACK(Zshard__V1__ChangeMembershipRequest, zshard__v1__change_membership_request__descriptor,
             msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ChangeMembershipRequest");
    return;
  }
  Zshard__V1__ChangeMembershipResponse resp = ZSHARD__V1__CHANGE_MEMBERSHIP_RESPONSE__INIT;
  /* A rank token changes only its own rank's membership, as it pushes. */
  int job_ok = !c->bind.bound || core_job_named(service_core(s->svc), r->spec_hash, c->bind.job);
  int rc = auth_push_admit(s->auth, c->role, &c->bind, job_ok, r->rank, err, sizeof err);
  if (rc == 0)
    rc = service_member_change(s->svc, r->spec_hash, r->rank, (int)r->change, r->step,
                               &resp.version, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0)
    finish_err(c, 0, rc, err);
  else
    finish_msg(c, 0, &resp.base);
}

static void h_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__StatsRequest *r =
      UNPACK(Zshard__V1__StatsRequest, zshard__v1__stats_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.StatsRequest");
    return;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  core_counters k;
  service_counters(s->svc, &k);
  Zshard__V1__StatsResponse resp = ZSHARD__V1__STATS_RESPONSE__INIT;
  resp.pushes = k.pushes;
  resp.duplicate_pushes = k.duplicate_pushes;
  resp.rejected = k.rejected;
  resp.pulls = k.pulls;
  resp.bytes_in = k.bytes_in;
  resp.bytes_out = k.bytes_out;
  resp.applies = k.applies;
  resp.skipped_steps = k.skipped_steps;
  resp.version = k.version;
  resp.apply_seconds_total = k.apply_seconds_total;
  resp.held_bytes = k.held_bytes;
  resp.waiting_pulls = k.waiting_pulls;
  resp.waiting_stats = k.waiting_stats;
  resp.rss_bytes = metrics_process_rss();
  core_membership mb;
  service_membership(s->svc, &mb);
  resp.members = mb.members.n;
  resp.world_size = mb.world_size;
  resp.membership_epoch = mb.epoch;
  resp.member_leaves = mb.leaves;
  resp.trainer_timeouts = mb.timeouts;
  resp.member_joins = mb.joins;
  char mlog[4096];
  service_member_log(s->svc, mlog, sizeof mlog);
  resp.member_log = mlog;
  resp.trainer_timeout_ms = mb.trainer_timeout_ms;
  finish_msg(c, 0, &resp.base);
}

/* ------------------------------------------------------------------------ */
/* Checkpoints                                                              */
/* ------------------------------------------------------------------------ */

/* Runs on the checkpoint service's thread: keeps the outcome and hops back to
 * a polling thread like a core callback. */
static void on_ckpt_done(void *arg, const ckpt_svc_result *r) {
  gcall *c = arg;
  *c->ckpt = *r;
  c->async_status = r->status;
  resume_from_core(c);
}

/* What every checkpoint method checks first; answers the call and returns -1
 * when it cannot go on. */
static int ckpt_prepare(gsrv *s, gcall *c) {
  if (!s->ckpt) {
    finish_err(c, 0, ZS_EUNIMPL,
               "checkpoints are off on this shard: start zshard-server with --state-dir DIR");
    return -1;
  }
  c->ckpt = calloc(1, sizeof *c->ckpt);
  if (!c->ckpt) {
    finish_err(c, 0, ZS_ENOMEM, "out of memory");
    return -1;
  }
  return 0;
}

/* Queues the work started by `rc` (the service's answer): a pending job
 * answers from on_ckpt_done, anything else at once. */
static void ckpt_started(gcall *c, int rc, const char *err) {
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c); /* the reference meant for the callback */
  finish_err(c, 0, rc, err);
}

static void ckpt_finish(gcall *c, int claimed) {
  const ckpt_svc_result *r = c->ckpt;
  if (r->status != ZS_OK) {
    finish_err(c, claimed, r->status, r->err);
    return;
  }
  core_info info;
  service_info(c->s->svc, &info);
  if (c->method == M_CHECKPOINT) {
    Zshard__V1__CheckpointFile file = ZSHARD__V1__CHECKPOINT_FILE__INIT;
    file.shard_id = r->file.shard_id;
    file.name = (char *)r->file.name;
    file.bytes = r->file.bytes;
    file.crc32c = r->file.crc32c;
    Zshard__V1__CheckpointResponse resp = ZSHARD__V1__CHECKPOINT_RESPONSE__INIT;
    resp.step = r->step;
    resp.shard_id = info.shard_id;
    resp.num_shards = info.num_shards;
    resp.file = &file;
    resp.optimizer_steps = r->optimizer_steps;
    resp.snapshot_seconds = r->snapshot_seconds;
    resp.write_seconds = r->write_seconds;
    finish_msg(c, claimed, &resp.base);
  } else if (c->method == M_COMMIT_CHECKPOINT) {
    Zshard__V1__CommitCheckpointResponse resp = ZSHARD__V1__COMMIT_CHECKPOINT_RESPONSE__INIT;
    resp.step = r->step;
    finish_msg(c, claimed, &resp.base);
  } else {
    uint8_t cs[CORE_MAX_CLIENT_STATE];
    uint64_t cs_version = 0;
    size_t cs_len = service_client_state(c->s->svc, cs, sizeof cs, &cs_version);
    Zshard__V1__RestoreResponse resp = ZSHARD__V1__RESTORE_RESPONSE__INIT;
    resp.step = r->step;
    resp.version = cs_version; /* read with the client state */
    resp.client_state.data = cs;
    resp.client_state.len = cs_len;
    resp.changed = r->changed != 0;
    resp.source_shards = r->source_shards;
    resp.spec_hash = info.spec_hash;
    finish_msg(c, claimed, &resp.base);
  }
}

static void h_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CheckpointRequest *r =
      UNPACK(Zshard__V1__CheckpointRequest, zshard__v1__checkpoint_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.CheckpointRequest");
    return;
  }
  if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c); /* the callback's */
    int rc = ckpt_svc_checkpoint(s->ckpt, r->spec_hash, r->step, r->dir,
                                 wait_deadline(c, r->timeout_ms), on_ckpt_done, c, err, sizeof err);
    ckpt_started(c, rc, err);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

static void h_commit_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CommitCheckpointRequest *r =
      UNPACK(Zshard__V1__CommitCheckpointRequest, zshard__v1__commit_checkpoint_request__descriptor,
             msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.CommitCheckpointRequest");
    return;
  }
  ckpt_manifest m = {.step = r->step,
                     .version = r->step,
                     .optimizer_steps = r->optimizer_steps,
                     .spec_hash = r->spec_hash,
                     .num_shards = (uint32_t)r->n_files};
  int rc = 0;
  if (r->n_files == 0 || r->n_files > SPEC_MAX_SHARDS) {
    rc = ZS_EINVAL;
    snprintf(err, sizeof err, "a commit lists 1..%u shard files, not %zu", SPEC_MAX_SHARDS,
             r->n_files);
  } else if (!(m.files = calloc(r->n_files, sizeof *m.files))) {
    rc = ZS_ENOMEM;
    snprintf(err, sizeof err, "out of memory");
  }
  for (size_t i = 0; rc == 0 && i < r->n_files; i++) {
    const Zshard__V1__CheckpointFile *f = r->files[i];
    /* Names come from the network: bounded here, checked to be the
     * canonical "shard-<i>-of-<N>.zsc" by the manifest writer. */
    if (f->shard_id != i || strlen(f->name) >= CKPT_NAME_MAX) {
      rc = ZS_EINVAL;
      snprintf(err, sizeof err, "commit entry %zu is not shard %zu's file", i, i);
      break;
    }
    m.files[i].shard_id = f->shard_id;
    snprintf(m.files[i].name, sizeof m.files[i].name, "%s", f->name);
    m.files[i].bytes = f->bytes;
    m.files[i].crc32c = f->crc32c;
  }
  if (rc != 0) {
    finish_err(c, 0, rc, err);
  } else if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c);
    rc = ckpt_svc_commit(s->ckpt, r->spec_hash, &m, r->dir, on_ckpt_done, c, err, sizeof err);
    ckpt_started(c, rc, err);
  }
  ckpt_manifest_free(&m);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

static void h_restore(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__RestoreRequest *r =
      UNPACK(Zshard__V1__RestoreRequest, zshard__v1__restore_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.RestoreRequest");
    return;
  }
  if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c);
    int rc =
        ckpt_svc_restore(s->ckpt, r->spec_hash, r->step, r->dir, on_ckpt_done, c, err, sizeof err);
    ckpt_started(c, rc, err);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

/* Answered on the polling thread: it reads directory entries and manifests
 * only, no shard file. */
static void h_list_checkpoints(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ListCheckpointsRequest *r =
      UNPACK(Zshard__V1__ListCheckpointsRequest, zshard__v1__list_checkpoints_request__descriptor,
             msg, len);
  if (!r) {
    bad_message(c, "zshard.v1.ListCheckpointsRequest");
    return;
  }
  if (!s->ckpt) {
    protobuf_c_message_free_unpacked(&r->base, NULL);
    finish_err(c, 0, ZS_EUNIMPL,
               "checkpoints are off on this shard: start zshard-server with --state-dir DIR");
    return;
  }
  ckpt_svc_entry *e = NULL;
  size_t n = 0;
  int rc = ckpt_svc_list(s->ckpt, r->dir, &e, &n, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  Zshard__V1__CheckpointInfo *infos = rc == 0 ? calloc(n + 1, sizeof *infos) : NULL;
  Zshard__V1__CheckpointInfo **ptrs = rc == 0 ? calloc(n + 1, sizeof *ptrs) : NULL;
  if (rc == 0 && (!infos || !ptrs)) {
    rc = ZS_ENOMEM;
    snprintf(err, sizeof err, "out of memory");
  }
  if (rc != 0) {
    finish_err(c, 0, rc, err);
  } else {
    for (size_t i = 0; i < n; i++) {
      zshard__v1__checkpoint_info__init(&infos[i]);
      infos[i].step = e[i].step;
      infos[i].complete = e[i].complete != 0;
      infos[i].num_shards = e[i].num_shards;
      infos[i].spec_hash = e[i].spec_hash;
      infos[i].loadable = e[i].loadable != 0;
      ptrs[i] = &infos[i];
    }
    Zshard__V1__ListCheckpointsResponse resp = ZSHARD__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
    resp.n_checkpoints = n;
    resp.checkpoints = ptrs;
    uint64_t step = 0;
    resp.from_checkpoint = service_checkpoint_origin(s->svc, &step, NULL) != 0;
    resp.checkpoint_step = step;
    core_info info;
    service_info(s->svc, &info);
    resp.version = info.version;
    resp.state_dir = (char *)ckpt_svc_state_dir(s->ckpt);
    finish_msg(c, 0, &resp.base);
  }
  free(e);
  free(infos);
  free(ptrs);
}

/* ------------------------------------------------------------------------ */
/* grpc.health.v1.Health                                                    */
/* ------------------------------------------------------------------------ */

/* The health protocol names the whole server "" and each service by its full
 * name; this server has one service. */
static int service_known(const char *name) {
  return name[0] == '\0' || strcmp(name, SERVICE_NAME) == 0;
}

static int health_status_locked(const gsrv *s) {
  return s->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                    : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void h_health_check(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Grpc__Health__V1__HealthCheckRequest *r =
      UNPACK(Grpc__Health__V1__HealthCheckRequest,
             grpc__health__v1__health_check_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "grpc.health.v1.HealthCheckRequest");
    return;
  }
  if (!service_known(r->service)) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "unknown service \"%.100s\"", r->service);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    finish_err(c, 0, ZS_ENOTFOUND, err);
    return;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  pthread_mutex_lock(&s->lock);
  resp.status = health_status_locked(s);
  pthread_mutex_unlock(&s->lock);
  finish_msg(c, 0, &resp.base);
}

static void on_watch_sent(gtag *t, int ok);
static void on_watch_final(gtag *t, int ok);
static void on_watch_close(gtag *t, int ok);

/* Sends what a Watch stream owes: the status if it differs from the last one
 * sent, else the end of the stream when the server shuts down. One batch at a
 * time, so messages leave in order. */
static void watch_kick_locked(gsrv *s, gcall *c) {
  if (c->w_sending || c->w_final || c->w_closed)
    return;
  int st = c->w_known ? health_status_locked(s)
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (st != c->w_sent) {
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = st;
    if (c->w_sent < 0)
      ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    c->reply = pack_message(&resp.base);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = c->reply;
    c->w_sending = 1;
    c->w_sent = st;
    c->io_tag.done = on_watch_sent;
    gcall_ref(c);
    grpc_call_error e = start_batch(c->call, ops, n, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
      grpc_byte_buffer_destroy(c->reply);
      c->reply = NULL;
      c->w_sending = 0;
      c->w_closed = 1; /* give up on this stream */
      gcall_unref(c);
    }
  } else if (c->w_ending) {
    /* The stream ends with a status alone: its initial metadata went with
     * the first message and its RECV_CLOSE_ON_SERVER has its own batch. */
    c->w_final = 1;
    status_op(c, &ops[0], ZS_ECLOSED, "the server is shutting down");
    c->io_tag.done = on_watch_final;
    gcall_ref(c);
    grpc_call_error e = start_batch(c->call, ops, 1, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
      watch_remove_locked(s, c);
      pthread_cond_broadcast(&s->cond);
      gcall_unref(c); /* cannot be the last: the caller holds one */
    }
  }
}

static void on_watch_sent(gtag *t, int ok) {
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  grpc_byte_buffer_destroy(c->reply);
  c->reply = NULL;
  c->w_sending = 0;
  if (!ok)
    c->w_closed = 1; /* the peer is gone; RECV_CLOSE_ON_SERVER will say so */
  else
    watch_kick_locked(s, c);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

static void on_watch_final(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  grpc_slice_unref(c->trailer.value);
  c->trailer.value = grpc_empty_slice();
  pthread_mutex_lock(&s->lock);
  watch_remove_locked(s, c);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

static void on_watch_close(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, close_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  c->w_closed = 1;
  watch_remove_locked(s, c);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

static void h_health_watch(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Grpc__Health__V1__HealthCheckRequest *r =
      UNPACK(Grpc__Health__V1__HealthCheckRequest,
             grpc__health__v1__health_check_request__descriptor, msg, len);
  if (!r) {
    bad_message(c, "grpc.health.v1.HealthCheckRequest");
    return;
  }
  /* An unknown service is not an error for Watch: the health protocol says
   * to stream SERVICE_UNKNOWN, since the service may appear later. */
  c->w_known = service_known(r->service);
  protobuf_c_message_free_unpacked(&r->base, NULL);

  pthread_mutex_lock(&s->lock);
  if (s->closing) {
    pthread_mutex_unlock(&s->lock);
    answer(c, NULL, ZS_ECLOSED, "the server is shutting down");
    return;
  }
  if (s->nwatchers >= s->lim.max_watchers) {
    uint32_t max = s->lim.max_watchers;
    pthread_mutex_unlock(&s->lock);
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err,
             "the server already streams %" PRIu32
             " health Watch calls, its limit; use Check, or retry later",
             max);
    answer(c, NULL, ZS_ELIMIT, err);
    return;
  }
  /* The stream is ours from here on: nobody else answers it. */
  atomic_store(&c->claimed, 1);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  c->close_tag.done = on_watch_close;
  gcall_ref(c);
  grpc_call_error e = start_batch(c->call, &op, 1, &c->close_tag);
  if (e != GRPC_CALL_OK) {
    pthread_mutex_unlock(&s->lock);
    gcall_unref(c);
    LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
    return;
  }
  list_add_locked(&s->watchers, c);
  s->nwatchers++;
  watch_kick_locked(s, c);
  pthread_mutex_unlock(&s->lock);
}

static void set_serving(gsrv *s, int serving) {
  pthread_mutex_lock(&s->lock);
  s->serving = serving;
  for (gcall *w = s->watchers; w; w = w->next)
    watch_kick_locked(s, w);
  pthread_mutex_unlock(&s->lock);
}

/* ------------------------------------------------------------------------ */
/* Request slots and dispatch                                               */
/* ------------------------------------------------------------------------ */

static void on_request(gtag *t, int ok);

/* Offers gRPC one more slot for `method`. Called with s->lock held, checking
 * s->stopping under it, so that no slot is posted once shutdown began (a slot
 * posted later would complete on a queue that is already shut down). */
static int post_slot_locked(gsrv *s, int method) {
  gcall *c = gcall_new(s, method);
  if (!c)
    return ZS_ENOMEM;
  c->req_tag.done = on_request;
  grpc_call_error e;
  tsan_release(&c->req_tag);
  if (method == M_GENERIC)
    e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq,
                                 &c->req_tag);
  else
    e = grpc_server_request_registered_call(s->server, s->reg[method], &c->call, &c->deadline,
                                            &c->md, &c->payload, s->cq, s->cq, &c->req_tag);
  if (e != GRPC_CALL_OK) {
    LOG_ERROR("grpc_request_failed", "error=%s", grpc_call_error_to_string(e));
    gcall_unref(c);
    return ZS_EINTERNAL;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Authentication                                                           */
/* ------------------------------------------------------------------------ */

/* The role each method needs (docs/SECURITY.md, "Roles", which
 * python.test_security_doc holds to this table). Admin: the methods that
 * write checkpoints, roll the state back, overwrite it or end the job,
 * outside of a training step. Trainer: a step's work and what only reads.
 * None: the health service, which load balancers and probes call without a
 * secret. A method added later needs a row here: the default, 0, is
 * AUTH_NONE only by value, hence the check in gsrv_start. */
static const auth_role method_role[M_COUNT + 1] = {
    [M_OPEN] = AUTH_TRAINER,
    [M_INIT_PARAMS] = AUTH_TRAINER,
    [M_PUSH] = AUTH_TRAINER,
    [M_PULL] = AUTH_TRAINER,
    [M_GRAD_STATS] = AUTH_TRAINER,
    [M_APPLY] = AUTH_TRAINER,
    [M_GET_INFO] = AUTH_TRAINER,
    [M_STATS] = AUTH_TRAINER,
    [M_LIST_CHECKPOINTS] = AUTH_TRAINER,
    [M_READ_STATE] = AUTH_TRAINER,
    [M_CHECKPOINT] = AUTH_ADMIN,
    [M_COMMIT_CHECKPOINT] = AUTH_ADMIN,
    [M_RESTORE] = AUTH_ADMIN,
    [M_CLOSE_JOB] = AUTH_ADMIN,
    [M_WRITE_STATE] = AUTH_ADMIN,
    /* The client's failover promotes a member, so a trainer may ask; the
     * member takes over only when it sees no live primary itself and moves
     * the term by one (replica_promote). */
    [M_PROMOTE] = AUTH_TRAINER,
    /* Between members, which call each other with the admin token. */
    [M_REPLICA_JOIN] = AUTH_ADMIN,
    [M_REPLICA_FETCH] = AUTH_ADMIN,
    /* A trainer joins or leaves an elastic job between steps (issue 26). */
    [M_CHANGE_MEMBERSHIP] = AUTH_TRAINER,
    [M_HEALTH_CHECK] = AUTH_NONE,
    [M_HEALTH_WATCH] = AUTH_NONE,
    /* An unknown method is answered UNIMPLEMENTED only to a caller with a
     * token, so that a stranger learns nothing about the server. */
    [M_GENERIC] = AUTH_TRAINER,
};

/* The token of the call's "authorization: Bearer <token>" metadata, or NULL
 * (no such metadata, another scheme). */
static const char *call_token(const gcall *c, size_t *len) {
  const size_t scheme = strlen(RPC_AUTH_SCHEME);
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, RPC_AUTH_KEY) != 0)
      continue;
    const char *v = (const char *)GRPC_SLICE_START_PTR(c->md.metadata[i].value);
    size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
    /* The scheme's name is case-insensitive (RFC 7235). */
    if (n <= scheme || strncasecmp(v, RPC_AUTH_SCHEME, scheme) != 0)
      return NULL;
    *len = n - scheme;
    return v + scheme;
  }
  return NULL;
}

/* Logs a refusal with the peer's address, at most one a second: a scan or a
 * misconfigured trainer in a loop must not flood the log. */
static void log_refusal(gsrv *s, gcall *c, int zs) {
  uint64_t now = clock_now_ns();
  uint64_t last = atomic_load(&s->refuse_ns);
  if (now - last < 1000000000ull || !atomic_compare_exchange_strong(&s->refuse_ns, &last, now)) {
    atomic_fetch_add(&s->refused, 1);
    return;
  }
  unsigned suppressed = atomic_exchange(&s->refused, 0);
  char *peer = grpc_call_get_peer(c->call);
  const char *path = c->method < M_COUNT ? methods[c->method].path : "unknown";
  LOG_WARN("auth_refused", "method=%s peer=%s error=%s suppressed=%u", path, peer ? peer : "?",
           zs_err_name(zs), suppressed);
  gpr_free(peer);
}

/* Answers the call UNAUTHENTICATED or PERMISSION_DENIED and returns -1 when
 * its token does not allow its method; returns 0 otherwise. */
static int authorize(gsrv *s, gcall *c) {
  auth_role need = method_role[c->method];
  memset(&c->bind, 0, sizeof c->bind);
  c->admin = !auth_keys_enabled(s->auth);
  c->role = AUTH_ADMIN;
  if (c->admin)
    return 0;
  size_t len = 0;
  const char *token = call_token(c, &len);
  auth_role role = auth_keys_check_bound(s->auth, token, token ? len : 0, &c->bind);
  c->admin = auth_allows(role, AUTH_ADMIN);
  c->role = role;
  if (need == AUTH_NONE || auth_allows(role, need))
    return 0;
  int zs = role == AUTH_NONE ? ZS_EUNAUTHENTICATED : ZS_EPERM;
  log_refusal(s, c, zs);
  answer(c, NULL, zs,
         zs == ZS_EPERM ? "this method needs the admin token (--admin-token-file); the call "
                          "carried a trainer's"
         : token        ? "the call's token is not valid on this server"
                        : "the call carries no \"authorization: Bearer <token>\" metadata and "
                          "this server requires a token");
  return -1;
}

/* What each method is to a replica set (server/replica/replica.h). */
static const replica_kind method_kind[M_COUNT] = {
    [M_OPEN] = REPLICA_WRITE,
    [M_INIT_PARAMS] = REPLICA_WRITE,
    [M_PUSH] = REPLICA_WRITE,
    [M_PULL] = REPLICA_READ,
    [M_GRAD_STATS] = REPLICA_READ,
    [M_APPLY] = REPLICA_WRITE,
    [M_GET_INFO] = REPLICA_ANY,
    [M_STATS] = REPLICA_READ,
    [M_CHECKPOINT] = REPLICA_PRIMARY_ONLY,
    [M_COMMIT_CHECKPOINT] = REPLICA_PRIMARY_ONLY,
    [M_RESTORE] = REPLICA_WRITE,
    [M_LIST_CHECKPOINTS] = REPLICA_READ,
    [M_CLOSE_JOB] = REPLICA_WRITE,
    [M_READ_STATE] = REPLICA_READ,
    [M_WRITE_STATE] = REPLICA_WRITE,
    [M_PROMOTE] = REPLICA_ANY,
    [M_REPLICA_JOIN] = REPLICA_ANY,
    [M_REPLICA_FETCH] = REPLICA_ANY,
    /* Not forwarded: a backup learns a step's set from its Apply (DESIGN.md
     * "Membership", replica sets). */
    [M_CHANGE_MEMBERSHIP] = REPLICA_PRIMARY_ONLY,
    [M_HEALTH_CHECK] = REPLICA_ANY,
    [M_HEALTH_WATCH] = REPLICA_ANY,
};

/* A decimal metadata value of the call, or 0 (absent, malformed). */
static uint64_t md_u64(const gcall *c, const char *key) {
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, key) != 0)
      continue;
    char buf[24];
    size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
    if (n == 0 || n >= sizeof buf)
      return 0;
    memcpy(buf, GRPC_SLICE_START_PTR(c->md.metadata[i].value), n);
    buf[n] = '\0';
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    return *end == '\0' && buf[0] >= '0' && buf[0] <= '9' ? (uint64_t)v : 0;
  }
  return 0;
}

/* The replica set's verdict on the call (replica_admit); a primary keeps a
 * copy of a trainer's write for its backups (forwarded by finish once it
 * succeeded here). Returns 0 to serve it, or -1 when answered. */
static int replica_gate(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  int forward = 0;
  int rc = replica_admit(s->rep, method_kind[c->method], md_u64(c, "zshard-replica-term"), c->admin,
                         md_u64(c, "zshard-term"), &forward, err, sizeof err);
  if (rc == 0 && forward) {
    c->fwd = malloc(len ? len : 1);
    c->fwd_len = len;
    if (c->fwd)
      memcpy(c->fwd, msg, len);
    else
      rc = status_fail(err, sizeof err, ZS_ENOMEM, "out of memory for the backups' copy");
  }
  if (rc == 0)
    return 0;
  answer(c, NULL, rc, err);
  return -1;
}

static void dispatch(gsrv *s, gcall *c) {
  if (authorize(s, c) != 0)
    return;
  if (c->method == M_GENERIC) {
    char err[GSRV_ERRLEN];
    size_t n = GRPC_SLICE_LENGTH(c->details.method);
    snprintf(err, sizeof err, "unknown method %.*s", (int)(n > 200 ? 200 : n),
             (const char *)GRPC_SLICE_START_PTR(c->details.method));
    answer(c, NULL, ZS_EUNIMPL, err);
    return;
  }
  if (!c->payload) {
    answer(c, NULL, ZS_EPROTO, "the call carries no request message");
    return;
  }
  size_t n = grpc_byte_buffer_length(c->payload);
  if (n > methods[c->method].max_request) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "a %s request has at most %zu bytes, not %zu",
             strrchr(methods[c->method].path, '/') + 1, methods[c->method].max_request, n);
    answer(c, NULL, ZS_ELIMIT, err);
    return;
  }
  grpc_slice msg;
  if (rpc_message_slice(c->payload, &msg) != 0) {
    answer(c, NULL, ZS_EPROTO, "the request message cannot be read");
    return;
  }
  /* The message is in msg now; the byte buffer is not needed any more. */
  grpc_byte_buffer_destroy(c->payload);
  c->payload = NULL;
  if (!s->rep || replica_gate(s, c, GRPC_SLICE_START_PTR(msg), GRPC_SLICE_LENGTH(msg)) == 0)
    methods[c->method].fn(s, c, GRPC_SLICE_START_PTR(msg), GRPC_SLICE_LENGTH(msg));
  /* The message may share its memory with other calls' messages (slices of
   * one read buffer), and the last unreference frees it on whichever polling
   * thread drops it, ordered by gRPC's own atomic reference count: invisible
   * to ThreadSanitizer, hence not recorded (common/base/tsan.h). */
  tsan_ignore_begin();
  grpc_slice_unref(msg);
  tsan_ignore_end();
}

static void on_request(gtag *t, int ok) {
  gcall *c = container_of(t, gcall, req_tag);
  gsrv *s = c->s;
  if (!ok) { /* the server shuts down: the slot is returned unfilled */
    gcall_unref(c);
    return;
  }
  c->start_ns = clock_now_ns();
  pthread_mutex_lock(&s->lock);
  if (!s->stopping)
    post_slot_locked(s, c->method);
  int closing = s->closing;
  if (c->method != M_HEALTH_WATCH)
    list_add_locked(&s->inflight, c);
  pthread_mutex_unlock(&s->lock);
  if (closing)
    answer(c, NULL, ZS_ECLOSED, "the server is shutting down");
  else
    dispatch(s, c);
  gcall_unref(c); /* the handler's reference */
}

static void on_shutdown(gtag *t, int ok) {
  (void)ok;
  gsrv *s = container_of(t, gsrv, shutdown_tag);
  pthread_mutex_lock(&s->lock);
  s->shutdown_done = 1;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

static void *poll_main(void *arg) {
  gsrv *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type == GRPC_OP_COMPLETE) {
      gtag *t = ev.tag;
      tsan_acquire(t);
      t->done(t, ev.success);
    }
  }
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Start and shutdown                                                       */
/* ------------------------------------------------------------------------ */

static void timespec_after_ms(struct timespec *ts, uint64_t ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(ms / 1000);
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Waits on s->cond until *flag is set or `until` passes; s->lock held. */
static void wait_flag_locked(gsrv *s, const int *flag, const struct timespec *until) {
  while (!*flag) {
    if (until) {
      if (pthread_cond_timedwait(&s->cond, &s->lock, until) != 0)
        break;
    } else {
      pthread_cond_wait(&s->cond, &s->lock);
    }
  }
}

/* Shuts the grpc_server down and releases everything; works on a server that
 * never started (a failed gsrv_start) and with no polling thread. */
static void teardown(gsrv *s) {
  if (s->server) {
    if (!s->started)
      grpc_server_start(s->server);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    if (s->nthreads == 0) {
      grpc_event ev;
      do {
        ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_OP_COMPLETE)
          tsan_acquire(ev.tag);
        if (ev.type == GRPC_OP_COMPLETE && ev.tag != &s->shutdown_tag)
          ((gtag *)ev.tag)->done(ev.tag, ev.success);
      } while (ev.type != GRPC_OP_COMPLETE || ev.tag != &s->shutdown_tag);
    } else {
      pthread_mutex_lock(&s->lock);
      struct timespec until;
      timespec_after_ms(&until, s->grace_ms);
      wait_flag_locked(s, &s->shutdown_done, &until);
      if (!s->shutdown_done) {
        /* A peer that does not read its answer keeps its call (and the
         * server) alive; cancelling ends it. */
        pthread_mutex_unlock(&s->lock);
        LOG_WARN("shutdown_cancel", "reason=calls_still_open_after_grace");
        grpc_server_cancel_all_calls(s->server);
        pthread_mutex_lock(&s->lock);
        wait_flag_locked(s, &s->shutdown_done, NULL);
      }
      pthread_mutex_unlock(&s->lock);
    }
  }
  if (s->cq) {
    grpc_completion_queue_shutdown(s->cq);
    if (s->nthreads == 0) {
      while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
             GRPC_QUEUE_SHUTDOWN) {
      }
    }
  }
  for (int i = 0; i < s->nthreads; i++)
    pthread_join(s->threads[i], NULL);
  if (s->server)
    grpc_server_destroy(s->server);
  if (s->cq)
    grpc_completion_queue_destroy(s->cq);
  grpc_shutdown();
  gtls_free(s->tls);
  free(s->threads);
  push_asm_free(s->chunks);
  for (int i = 0; i < GSRV_PEER_BUCKETS; i++) {
    while (s->peers[i]) {
      peer_count *e = s->peers[i];
      s->peers[i] = e->next;
      free(e);
    }
  }
  if (s->own_svc)
    service_destroy(s->svc);
  pthread_cond_destroy(&s->cond);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

/* A positive integer from the environment, else `def`. */
static uint32_t env_u32(const char *name, uint32_t def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end;
  unsigned long long x = strtoull(v, &end, 10);
  if (*end || x == 0 || x > INT32_MAX) {
    LOG_WARN("bad_env", "name=%s reason=not_a_positive_int32 using=%" PRIu32, name, def);
    return def;
  }
  return (uint32_t)x;
}

void gsrv_limits_init(gsrv_limits *l) {
  l->max_parked = env_u32("ZSHARD_GRPC_MAX_PARKED", GSRV_DEFAULT_MAX_PARKED);
  l->max_parked_per_conn =
      env_u32("ZSHARD_GRPC_MAX_PARKED_PER_CONN", GSRV_DEFAULT_MAX_PARKED_PER_CONN);
  l->max_watchers = env_u32("ZSHARD_GRPC_MAX_WATCHERS", GSRV_DEFAULT_MAX_WATCHERS);
  l->idle_ms = env_u32("ZSHARD_GRPC_IDLE_MS", GSRV_DEFAULT_IDLE_MS);
  l->handshake_ms = env_u32("ZSHARD_GRPC_HANDSHAKE_MS", GSRV_DEFAULT_HANDSHAKE_MS);
  l->keepalive_ms = env_u32("ZSHARD_GRPC_KEEPALIVE_MS", GSRV_DEFAULT_KEEPALIVE_MS);
  l->keepalive_timeout_ms = GSRV_DEFAULT_KEEPALIVE_TIMEOUT_MS;
  l->max_chunked_bytes = (uint64_t)env_u32("ZSHARD_GRPC_MAX_CHUNKED_MB",
                                           (uint32_t)(GSRV_DEFAULT_MAX_CHUNKED_BYTES >> 20))
                         << 20;
  l->chunked_ttl_ms = GSRV_DEFAULT_CHUNKED_TTL_MS;
  l->memory_bytes =
      (uint64_t)env_u32("ZSHARD_GRPC_MEMORY_MB", (uint32_t)(GSRV_DEFAULT_MEMORY_BYTES >> 20)) << 20;
  l->max_answer_bytes = (uint64_t)env_u32("ZSHARD_GRPC_MAX_ANSWER_MB",
                                          (uint32_t)(GSRV_DEFAULT_MAX_ANSWER_BYTES >> 20))
                        << 20;
  l->max_answer_bytes_per_conn =
      (uint64_t)env_u32("ZSHARD_GRPC_MAX_ANSWER_MB_PER_CONN",
                        (uint32_t)(GSRV_DEFAULT_MAX_ANSWER_BYTES_PER_CONN >> 20))
      << 20;
  l->answer_stall_ms = env_u32("ZSHARD_GRPC_ANSWER_STALL_MS", GSRV_DEFAULT_ANSWER_STALL_MS);
}

static void int_arg(grpc_arg *a, const char *key, int value) {
  a->type = GRPC_ARG_INTEGER;
  a->key = (char *)key;
  a->value.integer = value;
}

/* The listener's channel arguments (GSRV_NARGS of them) from its limits. */
#define GSRV_NARGS 11
static void listener_args(const gsrv_limits *l, grpc_resource_quota *quota, grpc_arg *args) {
  int n = 0;
  args[n].type = GRPC_ARG_POINTER;
  args[n].key = (char *)GRPC_ARG_RESOURCE_QUOTA;
  args[n].value.pointer.p = quota;
  args[n++].value.pointer.vtable = grpc_resource_quota_arg_vtable();
  /* No request needs more than a Push chunk and its header (GSRV_MAX_REQUEST
   * says per method); gRPC refuses a larger message RESOURCE_EXHAUSTED. */
  int_arg(&args[n++], GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, GSRV_MAX_REQUEST_BYTES);
  int_arg(&args[n++], GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, RPC_MAX_MESSAGE_BYTES);
  /* gRPC sets SO_REUSEPORT by default, which would let a second server bind
   * a port already in use and silently share its connections. */
  int_arg(&args[n++], GRPC_ARG_ALLOW_REUSEPORT, 0);
  /* An idle connection costs a descriptor and its buffers: gRPC's default
   * keeps it forever, and enough of them starve the checkpoint writer of
   * descriptors (EMFILE). */
  int_arg(&args[n++], GRPC_ARG_MAX_CONNECTION_IDLE_MS, (int)l->idle_ms);
  int_arg(&args[n++], GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, (int)l->handshake_ms);
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_TIME_MS, (int)l->keepalive_ms);
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_TIMEOUT_MS, (int)l->keepalive_timeout_ms);
  /* Clients may ping (to keep NATs open) once a minute, even between calls;
   * more often is gRPC's "too many pings" and ends the connection. */
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  int_arg(&args[n++], GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 60000);
  /* Streams open at once on one connection: its parked calls and room for
   * the calls in progress beside them. */
  int_arg(
      &args[n++], GRPC_ARG_MAX_CONCURRENT_STREAMS,
      (int)(l->max_parked_per_conn > INT32_MAX - 256 ? INT32_MAX : l->max_parked_per_conn + 256));
}

/* Listens on cfg->listen, with TLS when a certificate is configured.
 * Returns 0 or an error with err set. */
static int add_port(gsrv *s, const gsrv_config *cfg, char *err, size_t errlen) {
  grpc_server_credentials *creds;
  if (cfg->tls_cert_file || cfg->tls_key_file) {
    int rc = gtls_new(cfg->tls_cert_file, cfg->tls_key_file, cfg->tls_client_ca_file, &s->tls, err,
                      errlen);
    if (rc)
      return rc;
    creds = gtls_credentials(s->tls);
  } else if (cfg->tls_client_ca_file) {
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "--tls-client-ca needs --tls-cert and --tls-key");
  } else {
    creds = grpc_insecure_server_credentials_create();
  }
  if (!creds)
    return status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot make the gRPC credentials");
  s->port = grpc_server_add_http2_port(s->server, cfg->listen, creds);
  grpc_server_credentials_release(creds);
  if (s->port <= 0)
    return status_fail(err, errlen, ZS_EINVAL,
                       s->tls ? "cannot listen on %s (address invalid or in use, or gRPC refused "
                                "the certificate and key: see its message above)"
                              : "cannot listen on %s (address invalid or in use)",
                       cfg->listen);
  return 0;
}

int gsrv_reload_tls(gsrv *s, char *err, size_t errlen) {
  return s->tls ? gtls_reload(s->tls, err, errlen) : 0;
}

static int default_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 2 ? 2 : n > 4 ? 4 : (int)n;
}

int gsrv_start(const gsrv_config *cfg, gsrv **out, char *err, size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->core || !cfg->listen || !cfg->listen[0])
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "gsrv_start needs a core and a listen address");
  for (int m = 0; m < M_COUNT; m++)
    if (method_role[m] == AUTH_NONE && m != M_HEALTH_CHECK && m != M_HEALTH_WATCH)
      return status_fail(err, errlen, ZS_EINTERNAL, "method %s has no role (method_role)",
                         methods[m].path);
  gsrv *s = calloc(1, sizeof *s);
  if (!s)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  s->core = cfg->core;
  s->ckpt = cfg->ckpt;
  s->svc = cfg->service;
  if (s->svc && service_core(s->svc) != s->core) {
    free(s);
    return status_fail(err, errlen, ZS_EINVAL, "%s", "gsrv_start: the service drives another core");
  }
  if (!s->svc) {
    if (service_create(s->core, NULL, &s->svc) != 0) {
      free(s);
      return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
    }
    s->own_svc = 1;
  }
  s->data_port = cfg->data_port;
  if (cfg->limits)
    s->lim = *cfg->limits;
  else
    gsrv_limits_init(&s->lim);
  if (push_asm_new(s->lim.max_chunked_bytes, s->lim.chunked_ttl_ms, RPC_PUSH_CHUNK_BYTES,
                   &s->chunks) != 0) {
    if (s->own_svc)
      service_destroy(s->svc);
    free(s);
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  }
  s->auth = cfg->auth;
  s->rep = cfg->replica;
  /* A Watch stream lives as long as its client wants: its duration is no
   * latency, so it is not recorded. */
  for (int m = 0; m < M_COUNT; m++)
    if (m != M_HEALTH_WATCH)
      s->rpc_metric[m] =
          metrics_rpc_register(cfg->metrics, "grpc", strrchr(methods[m].path, '/') + 1);
  s->grace_ms = cfg->grace_ms ? cfg->grace_ms : GSRV_DEFAULT_GRACE_MS;
  s->start_ns = clock_now_ns();
  s->shutdown_tag.done = on_shutdown;
  pthread_mutex_init(&s->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cond, &ca);
  pthread_condattr_destroy(&ca);
  grpc_init();

  int rc = ZS_EINTERNAL;
  grpc_arg args[GSRV_NARGS];
  /* gRPC reads a request whole before it checks it against the receive
   * limit, so the limit alone bounds nothing: its memory quota does. Past
   * it, gRPC resets streams (RESOURCE_EXHAUSTED) instead of reading more. */
  grpc_resource_quota *quota = grpc_resource_quota_create("zshard-grpc");
  grpc_resource_quota_resize(quota, (size_t)s->lim.memory_bytes);
  listener_args(&s->lim, quota, args);
  grpc_channel_args chargs = {.num_args = GSRV_NARGS, .args = args};
  s->server = grpc_server_create(&chargs, NULL);
  grpc_resource_quota_unref(quota);
  s->cq = grpc_completion_queue_create_for_next(NULL);
  if (!s->server || !s->cq) {
    status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot create the gRPC server");
    goto fail;
  }
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  for (int m = 0; m < M_COUNT; m++) {
    s->reg[m] = grpc_server_register_method(s->server, methods[m].path, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!s->reg[m]) {
      status_fail(err, errlen, ZS_EINTERNAL, "cannot register method %s", methods[m].path);
      goto fail;
    }
  }
  if ((rc = add_port(s, cfg, err, errlen)) != 0)
    goto fail;

  int want = cfg->threads > 0 ? cfg->threads : default_threads();
  s->threads = calloc((size_t)want, sizeof *s->threads);
  if (!s->threads) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
    goto fail;
  }
  for (int i = 0; i < want; i++) {
    if (pthread_create(&s->threads[i], NULL, poll_main, s) != 0)
      break;
    s->nthreads++;
  }
  if (s->nthreads == 0) {
    status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot start the polling threads");
    goto fail;
  }

  grpc_server_start(s->server);
  s->started = 1;
  pthread_mutex_lock(&s->lock);
  rc = 0;
  for (int m = 0; m <= M_COUNT && rc == 0; m++)
    for (int k = 0; k < (m == M_GENERIC ? GSRV_GENERIC_SLOTS : GSRV_SLOTS_PER_METHOD) && rc == 0;
         k++)
      rc = post_slot_locked(s, m);
  s->serving = rc == 0;
  pthread_mutex_unlock(&s->lock);
  if (rc) {
    status_fail(err, errlen, rc, "%s", "cannot post request slots to gRPC");
    gsrv_destroy(s);
    return rc;
  }
  *out = s;
  return 0;

fail:
  teardown(s);
  return rc;
}

int gsrv_port(const gsrv *s) {
  return s->port;
}

/* 1 while a call is being worked on (parsed, computed, answered), as opposed
 * to parked in the core waiting for data that may never come. */
static int has_work_locked(const gsrv *s) {
  for (const gcall *c = s->inflight; c; c = c->next)
    if (!c->waiting)
      return 1;
  return 0;
}

void gsrv_destroy(gsrv *s) {
  if (!s)
    return;
  /* 1. Health first, so load balancers and Watch streams stop sending work. */
  set_serving(s, 0);

  /* 2. No new calls: gRPC refuses new streams, and no slot is re-posted. */
  pthread_mutex_lock(&s->lock);
  s->stopping = 1;
  pthread_mutex_unlock(&s->lock);
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);

  /* 3. Calls being worked on (a Push being added, an Apply running) get the
   * grace period. Calls waiting for data do not hold shutdown up: with no new
   * Push admitted, what they wait for can only come from work already in
   * progress, which this loop waits for. */
  struct timespec until;
  timespec_after_ms(&until, s->grace_ms);
  pthread_mutex_lock(&s->lock);
  while (has_work_locked(s))
    if (pthread_cond_timedwait(&s->cond, &s->lock, &until) != 0)
      break;
  s->closing = 1;
  for (gcall *w = s->watchers; w; w = w->next) {
    w->w_ending = 1;
    watch_kick_locked(s, w);
  }
  gcall *queued = s->answer_wait;
  s->answer_wait = NULL;
  pthread_mutex_unlock(&s->lock);
  /* Answers still waiting for room are not built any more. */
  while (queued) {
    gcall *w = queued;
    queued = w->aw_next;
    finish_err(w, w->aw_claimed, ZS_ECLOSED, "the server is shutting down");
    gcall_unref(w);
  }

  /* 4. Every call still open is answered ECLOSED; a core callback that comes
   * later finds it claimed. The list is walked afresh after each answer since
   * the lock is dropped to answer. */
  for (;;) {
    gcall *c = NULL;
    pthread_mutex_lock(&s->lock);
    for (gcall *i = s->inflight; i; i = i->next) {
      if (atomic_exchange(&i->claimed, 1) == 0) {
        c = i;
        gcall_ref(c);
        break;
      }
    }
    pthread_mutex_unlock(&s->lock);
    if (!c)
      break;
    send_final(c, NULL, ZS_ECLOSED, "the server is shutting down");
    gcall_unref(c);
  }

  /* 5. gRPC reports shutdown once every call is released; then the queue is
   * drained and the threads end. */
  teardown(s);
}
