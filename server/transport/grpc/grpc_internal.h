/*
 * grpc_internal — what the files of the gRPC transport share, and nothing
 * outside server/transport/grpc/ includes: the server and call structures,
 * the method enum, the one table of the methods' facts (grpc_methods.c) and
 * the functions one file calls in another. Locking, threads and the life of a
 * call are described at the top of grpc_server.c.
 */
#ifndef ZSHARD_SERVER_TRANSPORT_GRPC_INTERNAL_H
#define ZSHARD_SERVER_TRANSPORT_GRPC_INTERNAL_H

#include "server/transport/grpc/grpc_server.h"
#include "server/transport/grpc/push_asm.h"

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <protobuf-c/protobuf-c.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/list.h"
#include "common/net/rpc_client.h"
#include "server/replica/replica.h"
#include "server/transport/grpc/grpc_tls.h"

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

/* The forwarding pool of a replicated primary (grpc_forward.c). */
typedef struct gfwd {
  pthread_t *threads;
  int nthreads;
  int inited;           /* lock, cond and queue are initialised */
  pthread_mutex_t lock; /* a leaf; guards queue and stopping */
  pthread_cond_t cond;  /* signalled when a call is queued and at the stop */
  list_node queue;      /* gcall.fwd_node, calls waiting for a pool thread, in order */
  int stopping;         /* no more calls are queued; the threads end */
} gfwd;

/* Parked calls of one connection (grpc_call_get_peer names it: address and
 * port), under gsrv.lock; freed when its count drops to 0. */
typedef struct peer_count peer_count;
struct peer_count {
  list_node node;        /* in its bucket of gsrv.peers */
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
  gfwd fwd; /* only when rep is set */

  pthread_mutex_t lock;
  pthread_cond_t cond;   /* CLOCK_MONOTONIC; signalled when a call leaves the
                            in-flight list and when shutdown completes */
  list_node inflight;    /* calls not yet answered and sent, except Watch */
  list_node watchers;    /* Watch streams */
  gsrv_limits lim;       /* fixed at start (docs/OPERATIONS.md, "Limits") */
  uint32_t nparked;      /* calls parked in the core, counted in peers[] */
  uint32_t nwatchers;    /* entries of watchers */
  uint64_t answer_bytes; /* Pull answers built and not yet taken, all peers */
  list_node answer_wait; /* Pulls waiting for room for their answer (aw_node), in order */
  list_node peers[GSRV_PEER_BUCKETS]; /* peer_count.node, by peer_bucket() */
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
  uint64_t fwd_step; /* the write's step (a Push's, an Apply's), 0: none */
  /* While queued for the forwarding pool (grpc_forward.c): the answer to
   * send once forwarded, and whether the call was claimed already. */
  list_node fwd_node;
  grpc_byte_buffer *fwd_reply;
  int fwd_claimed;
  atomic_int refs;
  atomic_int claimed;
  uint64_t start_ns; /* clock_now_ns() when the request arrived */

  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details; /* M_GENERIC only */

  list_node node;           /* in gsrv.inflight or gsrv.watchers, under gsrv.lock */
  int grpc_released;        /* release_grpc() ran */
  int waiting;              /* parked in the core waiting for data (not counted as work) */
  int parked;               /* counted in gsrv.nparked and its peer's count, under gsrv.lock */
  int close_started;        /* RECV_CLOSE_ON_SERVER has its own batch (close_tag) */
  char *peer;               /* grpc_call_get_peer's, for a parked call; gpr_free */
  uint64_t answer_held;     /* bytes counted in the answer budgets, under gsrv.lock */
  uint64_t answer_since_ms; /* clock_now_ms() when they were counted */
  list_node aw_node;        /* in gsrv.answer_wait, under gsrv.lock */
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

/* A method's handler, on a polling thread: `msg` (len bytes) is the request,
 * valid until the handler returns (a handler that needs it later copies it).
 * The handler answers the call, or leaves it parked with a reference that the
 * core's (or the checkpoint service's) callback consumes. */
typedef void (*handler_fn)(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

/* What the transport knows of each method, in one place: its path, its
 * handler, the largest request it takes (a larger one is refused before it is
 * parsed; docs/OPERATIONS.md, "Limits"), the role its caller needs
 * (docs/SECURITY.md, "Roles") and what it is to a replica set
 * (server/replica/replica.h). Row M_GENERIC (any method not registered) has
 * only a role. */
typedef struct gsrv_method {
  const char *path;
  handler_fn fn;
  size_t max_request;
  auth_role role;
  replica_kind kind;
} gsrv_method;

extern const gsrv_method gsrv__methods[M_COUNT + 1];

/* Request decoding with protobuf-c's allocator; NULL when `msg` is not a
 * valid message of the type. */
#define UNPACK(type, desc, msg, len) ((type *)protobuf_c_message_unpack(&(desc), NULL, len, msg))

/* grpc_calls.c: a call's lifetime (references, the lists), its one answer, and the
 * hop from a core thread back to a polling thread. */
/* A call of `method` holding one reference (the caller's); NULL when out of
 * memory. The last gcall_unref frees it and whatever of gRPC's it holds. */
gcall *gcall_new(gsrv *s, int method);
void gcall_ref(gcall *c);
/* grpc_call_start_batch, ordered for ThreadSanitizer (common/base/tsan.h). */
grpc_call_error gsrv__start_batch(grpc_call *call, const grpc_op *ops, size_t n, gtag *tag);
void gcall_unref(gcall *c);
/* gsrv.lock held. */
void gsrv__watch_remove_locked(gsrv *s, gcall *c);
/* Answering (once per call; grpc_server.c says who may): `reply` is owned by
 * the callee from the call on, NULL for an error; `detail` is copied, NULL
 * for zs_strerror's sentence. `claimed`: the caller holds the claim already
 * (after a hop). */
void gsrv__status_op(gcall *c, grpc_op *op, int zs, const char *detail);
void gsrv__send_final(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail);
void gsrv__answer(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail);
void gsrv__finish(gcall *c, int claimed, grpc_byte_buffer *reply, int zs, const char *detail);
/* gsrv__send_final when `claimed`, else gsrv__answer; forwards nothing. */
void gsrv__answer_as(gcall *c, int claimed, grpc_byte_buffer *reply, int zs, const char *detail);
/* A new byte buffer of m packed, owned by the caller. */
grpc_byte_buffer *gsrv__pack_message(const ProtobufCMessage *m);
void gsrv__finish_msg(gcall *c, int claimed, const ProtobufCMessage *m);
void gsrv__finish_err(gcall *c, int claimed, int zs, const char *detail);
void gsrv__bad_message(gcall *c, const char *type);
/* The core's callbacks: `arg` is the gcall, whose reference they consume;
 * they record the outcome and hop to a polling thread. */
void gsrv__resume_from_core(gcall *c);
void gsrv__on_core_version(void *arg, int status, uint64_t version);
void gsrv__on_core_stats(void *arg, int status, const core_stats_result *r);
void gsrv__on_core_apply(void *arg, int status, const core_apply_result *r);
/* Parked in the core or not (for the shutdown grace); the deadline of a wait. */
void gsrv__set_waiting(gcall *c, int waiting);
uint64_t gsrv__wait_deadline(const gcall *c, uint32_t timeout_ms);

/* grpc_forward.c: the forwarding pool of a replicated primary. fwd_start
 * starts it (0, or a status with the sentence in err; what started is
 * stopped by fwd_free). fwd_submit takes a call whose write succeeded here
 * (its answer `reply`, owned from the call on; `claimed` as for
 * gsrv__finish): a pool thread forwards the write to the backups, then
 * answers; once the pool stopped, the call is answered ZS_ECLOSED at once.
 * fwd_stop answers the calls still queued ZS_ECLOSED and waits for the
 * forwards in flight; fwd_free stops and frees the pool (both tolerate a
 * pool never started). */
int gsrv__fwd_start(gsrv *s, char *err, size_t errlen);
void gsrv__fwd_submit(gcall *c, int claimed, grpc_byte_buffer *reply);
void gsrv__fwd_stop(gsrv *s);
void gsrv__fwd_free(gsrv *s);

/* grpc_budget.c: the budgets of parked calls and of Pull answers held. */
/* A call about to wait in the core is counted by park_begin (0, or a status
 * with the sentence in err) until it closes, or until park_uncount when it
 * does not wait after all. A Pull's answer takes room by answer_reserve (or
 * answer_try_reserve, which cannot queue) until answer_release. */
void gsrv__park_uncount(gcall *c);
int gsrv__park_begin(gsrv *s, gcall *c, uint64_t want, char *err, size_t errlen);
int gsrv__answer_reserve(gsrv *s, gcall *c, int claimed);
int gsrv__answer_try_reserve(gsrv *s, gcall *c, uint64_t n, char *err, size_t errlen);
void gsrv__answer_release(gcall *c);

/* grpc_dispatch.c: request slots, and a filled one's way to its handler. */
/* gsrv.lock held; 0, or a status when gRPC refused the slot. */
int gsrv__post_slot_locked(gsrv *s, int method);

/* grpc_replica.c: the replica set's gate and its own methods. */
void gsrv__h_promote(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_replica_join(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_replica_fetch(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
/* 0 to serve the call, -1 when it was answered (refused by the replica set). */
int gsrv__replica_gate(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

/* grpc_health.c: grpc.health.v1.Health. */
void gsrv__h_health_check(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
/* gsrv.lock held: sends a Watch stream what it owes. */
void gsrv__watch_kick_locked(gsrv *s, gcall *c);
void gsrv__h_health_watch(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
/* Sets the serving status and tells every Watch stream. */
void gsrv__set_serving(gsrv *s, int serving);

/* grpc_job.c: a job's methods outside the training step. */
void gsrv__h_open(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_init_params(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_get_info(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_read_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_write_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_close_job(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_change_membership(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

/* grpc_step.c: the training step's methods. */
void gsrv__h_push(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
/* The *_finish functions are a handler's second half, after a hop (claimed
 * 1) or at once (claimed 0); pull_build builds a Pull's answer once it has
 * room. */
void gsrv__pull_finish(gcall *c, int claimed);
void gsrv__pull_build(gcall *c, int claimed);
void gsrv__h_pull(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__stats_finish(gcall *c, int claimed);
void gsrv__h_grad_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__apply_finish(gcall *c, int claimed);
void gsrv__h_apply(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

/* grpc_ckpt.c: the checkpoint methods. */
void gsrv__ckpt_finish(gcall *c, int claimed);
void gsrv__h_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_commit_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_restore(gsrv *s, gcall *c, const uint8_t *msg, size_t len);
void gsrv__h_list_checkpoints(gsrv *s, gcall *c, const uint8_t *msg, size_t len);

#endif
