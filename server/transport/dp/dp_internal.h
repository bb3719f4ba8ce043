/*
 * dp_internal — the data plane server's private types (struct dp_server, a
 * connection, a Pull waiting for its version, a request's work, an answer
 * being written, a payload buffer), its tuning constants, and the functions
 * that the dp_*.c files share, prefixed dp__; everything else in those files
 * is static. Which thread owns what, the lock order, the lifetimes and the
 * copies of tensor bytes are at the top of dp_server.c.
 */
#ifndef ZSHARD_SERVER_DP_INTERNAL_H
#define ZSHARD_SERVER_DP_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/base/list.h"
#include "common/net/auth.h"
#include "common/net/dp_client.h"
#include "common/net/stream.h"
#include "common/net/wire.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/replica/replica.h"
#include "server/service/service.h"
#include "server/transport/dp/dp_server.h"

#define DP_DEFAULT_MAX_PENDING 256u
#define DP_DEFAULT_MAX_QUEUED (UINT64_C(64) << 20)
#define DP_DEFAULT_STALL_MS 60000u
#define DP_DEFAULT_MAX_CONNS 1024u
#define DP_DEFAULT_INLINE (UINT64_C(64) << 10)
#define DP_DEFAULT_HELLO_MS 5000u
#define DP_DEFAULT_PER_PEER 64u
#define DP_DEFAULT_UNAUTH 128u
/* One address's share of the connections not yet authenticated is this
 * fraction of the server's (at least 1): a stranger's flood from a few
 * addresses evicts only its own connections. */
#define DP_UNAUTH_SHARE_DIV 16u
/* The HELLO deadline while more than half the unauthenticated budget is in
 * use: a trainer sends HELLO at once, so only a flood needs more. */
#define DP_PRESSED_HELLO_MS 1000u
/* Pulls parked in the core, per connection and in all. They hold no buffer,
 * so they are not part of the backpressure bound (a client may prefetch the
 * next version's pieces while still pushing this step's gradients, and
 * pausing its reads then would hold back the very pushes the version waits
 * for); past these caps the next one is refused. */
#define DP_DEFAULT_WAITING_CONN 4096u
#define DP_DEFAULT_WAITING 65536u
#define DP_DEFAULT_ANSWER (UINT64_C(256) << 20)
#define DP_DEFAULT_ANSWER_TOTAL (UINT64_C(1) << 30)
#define DP_DEFAULT_PIN_HOLD_MS 250u
/* How often connections holding pinned answers are looked at (only while
 * there are some). */
#define DP_PIN_TICK_MS 50u
/* Reads into the shared staging buffer (headers, metas, small payloads). */
#define DP_STAGING (64u << 10)
/* A payload with at least this much still missing is read straight into its
 * buffer; less, and it comes through the staging buffer with what follows. */
#define DP_DIRECT_MIN (16u << 10)
/* Largest single direct read: small enough that its CRC runs on bytes still
 * in cache. */
#define DP_READ_CHUNK (512u << 10)
/* Bytes read from one connection in one loop iteration before it yields to
 * the others until the next iteration. */
#define DP_READ_BUDGET (4u << 20)
/* Pull answers of one connection being produced (core_read) or waiting to
 * be sent, in bytes, before the next ready Pull waits its turn: answers are
 * made just in time for the socket, which bounds the memory a connection
 * holds and lets the pool hand the same few buffers round. One answer is
 * always allowed, however large. */
#define DP_PRODUCE_WINDOW (UINT64_C(32) << 20)
/* Push payload bytes of one connection received and waiting for (or in) the
 * core: at or above it the connection stops reading until they are through,
 * so a trainer that pipelines many large pushes costs the shard at most this
 * (plus the frame being received), not everything it has in flight. Two
 * 16 MiB pieces: one accumulating while the next arrives. */
#define DP_CONSUME_WINDOW (UINT64_C(32) << 20)
/* Idle buffers kept for reuse; one buffer is kept whatever its size when the
 * pool is otherwise empty. */
#define DP_POOL_BYTES (UINT64_C(64) << 20)
/* Buffers from this size up are 2 MiB aligned and asked to be backed by huge
 * pages, so that a fresh one costs 512 times fewer page faults. */
#define DP_HUGE_MIN (UINT64_C(2) << 20)
/* Idle buffers kept per size. DP_POOL_BYTES is what bounds the memory;
 * this only keeps one size from filling the pool with many small buffers.
 * Several trainers pushing at once keep tens of same-size buffers in use
 * (W connections, each up to DP_CONSUME_WINDOW): with four kept, the rest
 * were freed after every step and came back as fresh memory, a page fault
 * per 4 KiB (13 us each on the benchmark VM: the shard's largest cost at
 * W = 4, docs/PERFORMANCE.md). */
#define DP_POOL_PER_CLASS 64
#define DP_POOL_IDLE_MS 10000u
#define DP_SWEEP_MS 1000u
#define DP_POOL_CLASSES 64

#define PAUSE_FAIR 1u
#define PAUSE_BACKPRESSURE 2u

typedef struct dp_seg {
  const unsigned char *data;
  size_t len;
} dp_seg;

/* A payload buffer: capacity is a power of two (its pool class). */
typedef struct dp_buf {
  /* In the pool: each size class is a stack, pushed and popped at its head
   * only and never unlinked from the middle, so one pointer is the whole
   * list; the buffer released last, the warmest in cache, goes out first. */
  struct dp_buf *next;
  size_t cap;
  int cls;             /* size class; -1: not the pool's (freed, never pooled) */
  unsigned char *data; /* 64-byte aligned, cap bytes */
  /* A zero-copy pull answer: data points into this core's low arena, pinned
   * (core_pin_low) until the buffer is released. */
  core *pinned;
  /* A zero-copy batch answer (segs not NULL, room for every piece): data is
   * NULL and the first nsegs pieces are pinned in pinned's low arena, each
   * until the buffer is released. */
  dp_seg *segs;
  uint32_t nsegs;
} dp_buf;

typedef struct dp_server dp_server;

/* One peer address (its port left out): what the per-address caps count.
 * Kept while a connection from it, open or closing, refers to it. */
typedef struct dp_peer {
  list_node node; /* in s->peers */
  int family;
  uint8_t ip[16];
  uint32_t refs;         /* dp_conn records (open or zombie) pointing here */
  uint32_t conns;        /* open connections */
  uint32_t unauth;       /* open connections not yet authenticated */
  uint64_t waiting;      /* Pulls of its connections waiting in the core */
  uint64_t answer_bytes; /* copied answer bytes its connections hold now */
} dp_peer;

typedef struct dp_conn {
  stream *st; /* freed by the stream layer after on_conn_closed */
  dp_server *s;
  list_node node;   /* on s->live, then on s->zombies after close */
  list_node fair;   /* on s->fair while paused for the read budget */
  list_node starve; /* on s->starved while an answer waits for the server's or address's budget */
  list_node unode;  /* on s->unauth_q (oldest first) while counted and not authenticated */
  dp_peer *pe;      /* one reference, dropped in conn_free */
  int authed;       /* a HELLO was accepted */
  uint64_t replica_term; /* the HELLO's: a replica set primary's forwards */
  int admin;             /* its token grants the admin role (or tokens are off) */
  /* The token its HELLO presented (tokens on only; wiped when freed): a
   * reload of the token files (SIGHUP) checks it again, and a connection
   * whose token no longer grants the trainer role is closed. */
  char *token;
  size_t token_len;
  /* What the token granted: a rank token binds every push on the connection
   * to its (job, rank); verified once, at HELLO and again on each reload. */
  auth_role role;
  auth_binding bind;
  int forward_next; /* the push whose payload is coming must be forwarded */
  int counted;      /* counted in the caps (s->nconns, the peer's counts ...) */
  uint64_t accepted_ms;
  uint64_t answer_bytes; /* copied answer bytes of this connection held now */
  /* Answers sent from the low copy and not yet written, and how far the
   * peer had taken its bytes when last looked at. */
  uint32_t pinned_out;
  uint64_t handed, pin_taken, pin_since_ms;
  uint32_t refs;
  int closing;
  int eof;   /* the peer shut its side: answer what is pending, then close */
  int fatal; /* the stream broke: the ERROR frame is on its way, then close */
  unsigned pause;
  int reading;
  int mid; /* counted in stats.mid_frame */
  int bp;  /* counted in stats.paused */
  wire_reader rd;
  dp_buf *rx;         /* payload buffer of the PUSH being received */
  uint32_t pending;   /* requests read whose answer is not yet written */
  uint32_t waiting;   /* Pulls parked in the core */
  uint64_t queued;    /* answer bytes handed to stream_write, not yet completed */
  uint64_t producing; /* Pull answer bytes being read from the core */
  uint64_t consuming; /* Push payload bytes received and not yet through the core */
  uint64_t frame_ns;  /* when the header of the frame being read arrived */
  struct dp_pull *ready_head, *ready_tail; /* Pulls whose version is there, FIFO */
  uint64_t iter, iter_bytes;
  uint64_t last_progress_ms;
  size_t wq_seen;
  uint64_t wq_since_ms;
  char peer[64];
} dp_conn;

/* Where core threads leave finished Pull waits for the loop. Reference
 * counted: the server holds one reference, every Pull outstanding in the core
 * (or queued in `done`) one more, so that a callback arriving after the
 * server stopped still finds it. */
typedef struct dp_mailbox {
  pthread_mutex_t mu;
  int closed;
  uint64_t refs;
  /* Finished waits, newest first: a core thread pushes at the head under mu
   * and the loop takes the whole list at once and reverses it, so a singly
   * linked stack is all it needs. */
  struct dp_pull *done;
  uv_async_t *async; /* valid while !closed */
} dp_mailbox;

typedef struct dp_pull {
  /* In the mailbox's `done` or its connection's ready queue, never in both:
   * each is only added to at one end and taken from the other (or whole), so
   * neither needs a doubly linked list.h node. */
  struct dp_pull *next;
  dp_mailbox *mb;
  dp_conn *conn;
  uint64_t request_id, hash, min_version;
  uint32_t tensor, slice;
  zs_dtype dtype;
  size_t nbytes; /* a batch: the sum of its pieces */
  /* A PULL_BATCH: its pieces (owned, or NULL for a single Pull), in order. */
  wire_piece *pieces;
  uint32_t npieces;
  uint64_t start_ns; /* the request's arrival (its frame's header) */
  /* Written by the core callback. */
  int status;
  uint64_t version;
} dp_pull;

/* Work of one large request on the thread pool (or inline for a small one). */
typedef struct dp_work {
  uv_work_t req;
  dp_conn *conn;
  core *core;        /* what the pool thread may use: never the connection */
  service *svc;      /* as core: pushes go through it */
  uint64_t start_ns; /* the request's arrival (its frame's header) */
  int type;          /* WIRE_PUSH, WIRE_PULL, WIRE_PUSH_BATCH or WIRE_PULL_BATCH */
  uint64_t request_id;
  dp_buf *buf;
  size_t nbytes;
  core_push_args push;
  uint64_t hash;
  uint32_t tensor, slice;
  zs_dtype dtype;
  uint64_t budget;  /* copied answer bytes counted for this pull's answer */
  replica *forward; /* a replicated primary's push: forward once accepted */
  /* A batch: its pieces, owned, in payload order. */
  wire_piece *pieces;
  uint32_t npieces;
  /* Results. A push batch: each piece's status and duplicate flag (owned),
   * and err holds the sentence of the first refused piece. */
  int32_t *piece_status;
  uint8_t *piece_dup;
  int status, duplicate;
  uint64_t version;
  uint32_t crc;
  char err[DP_ERRLEN];
} dp_work;

/* One answer being written. */
typedef struct dp_out {
  stream_write_req req;
  dp_conn *conn;
  dp_buf *payload; /* returned to the pool after the write, or NULL */
  uint64_t bytes;
  uint64_t budget; /* copied answer bytes released when written */
  int pinned;      /* the payload is a pinned piece of the low copy */
  int is_answer;   /* counts against conn->pending */
  int close_after;
  uint8_t head[]; /* WIRE_MAX_ENCODED bytes, WIRE_MAX_BATCH_ENCODED for a batch answer */
} dp_out;

struct dp_server {
  uv_loop_t loop;
  stream_listener *listener; /* NULL once closed */
  uv_async_t async;
  uv_timer_t sweep;
  uv_check_t check;
  pthread_t thread;
  int thread_started;
  int loop_inited;
  int port;
  core *core;
  service *svc; /* every request's checks (service.h) */
  int own_svc;  /* made here: dp_server_config.service was NULL */
  uint64_t max_payload, max_queued, inline_bytes;
  /* Request durations per method (NULL without metrics). */
  metrics_rpc *m_push, *m_pull, *m_push_batch, *m_pull_batch;
  uint32_t max_pending, stall_ms, max_conns;
  auth_keys *auth;
  replica *rep; /* NULL: not replicated */
  uint32_t hello_ms, max_per_peer, max_unauth, max_unauth_peer, max_wait_conn, max_wait,
      pin_hold_ms;
  uint64_t max_answer, max_answer_total, max_answer_peer;
  char congestion[STREAM_CC_NAME_MAX]; /* "": the host's default */
  uint32_t pacing_mbit;                /* 0: no pacing */
  stream_pacer *pacer;                 /* owned; NULL: no link pacing */
  uv_timer_t pin_timer;
  int pin_timer_on;
  atomic_int stop;
  dp_mailbox *mb;
  list_node live, zombies, fair, starved;
  list_node unauth_q;          /* connections not yet authenticated, oldest first */
  unsigned long long auth_gen; /* auth_keys_generation last seen by the sweep */
  list_node peers;             /* dp_peer.node: one per address a connection record refers to */
  uint64_t nconns, nunauth, nwaiting, answer_bytes, npinned;
  int releasing;                        /* budget_release is walking s->starved */
  uint64_t refuse_log_ms, refuse_quiet; /* conn_refuse's log lines */
  uint64_t iter;
  unsigned char *staging;
  dp_buf *pool[DP_POOL_CLASSES];
  int pool_count[DP_POOL_CLASSES];
  uint64_t pool_bytes, pool_last_use_ms;
  /* Counters (written by the loop thread, read by anyone). */
  _Atomic uint64_t st_conns, st_accepted, st_frames_in, st_frames_out, st_bytes_in, st_bytes_out,
      st_req_errors, st_proto_errors, st_crc_errors, st_stalled, st_mid, st_paused, st_waiting,
      st_unauth, st_auth_refused, st_auth_timeouts, st_limit_refused, st_answer_bytes, st_pinned,
      st_pins_released, st_pinned_batches, st_unauth_evicted, st_auth_revoked;
};

/* Adds d to a counter of dp_server_stats (relaxed: each is read on its
 * own, the set is not a snapshot). */
static inline void dp__count(_Atomic uint64_t *c, int64_t d) {
  atomic_fetch_add_explicit(c, (uint64_t)d, memory_order_relaxed);
}

/* dp_pool.c: payload buffers and their pool (loop thread; dp__buf_free and
 * dp__buf_unpin from any thread). dp__pool_get returns NULL when out of
 * memory or when n has no size class; dp__pool_put takes b (NULL is fine). */
void dp__buf_unpin(dp_buf *b);
void dp__buf_free(dp_buf *b);
dp_buf *dp__pool_get(dp_server *s, size_t n);
void dp__pool_put(dp_server *s, dp_buf *b);
void dp__pool_drain(dp_server *s);

/* dp_mailbox.c: finished Pull waits from core threads to the loop. */
void dp__mailbox_unref(dp_mailbox *mb, uint64_t n);
void dp__pull_free(dp_pull *p);
void dp__on_core_version(void *arg, int status, uint64_t version);
void dp__drain_mailbox(dp_server *s);

/* dp_conn.c: a connection's life, its caps and references (loop thread). */
void dp__conn_free(dp_conn *c);
void dp__conn_ref(dp_conn *c);
void dp__conn_unref(dp_conn *c);
void dp__conn_set_mid(dp_conn *c, int mid);
void dp__conn_close(dp_conn *c);
void dp__conn_update_reading(dp_conn *c);
void dp__conn_check(dp_conn *c);
int dp__refusal_logged(dp_server *s, uint64_t *quiet);
void dp__on_connection(stream_listener *l, void *data, int status, stream *st);

/* dp_auth.c: HELLO, rank bindings and token reloads (loop thread). */
void dp__on_hello(dp_conn *c);
int dp__rank_refused(dp_conn *c, const wire_msg *m);
void dp__recheck_tokens(dp_server *s);

/* dp_read.c: the stream's read callbacks and the fairness check handle. */
void dp__on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf);
void dp__on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf);
void dp__on_check(uv_check_t *h);

/* dp_request.c: a frame's header and meta in (dp__on_meta), a frame complete
 * (dp__on_done). */
void dp__on_meta(dp_conn *c);
void dp__on_done(dp_conn *c);

/* dp_work.c: a request's work; dp__work_start takes ownership of w. */
void dp__work_free(dp_work *w);
void dp__observe(dp_server *s, int type, uint64_t start_ns, int failed);
void dp__work_start(dp_work *w);

/* dp_answer.c: answers out, budgets and the produce window. dp__conn_send
 * and dp__conn_send_budget take ownership of payload (may be NULL). */
void dp__budget_release(dp_conn *c, uint64_t n);
void dp__conn_send_budget(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer, int close_after,
                          uint64_t budget);
void dp__conn_send(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer, int close_after);
void dp__answer_error(dp_conn *c, uint64_t id, int status, const char *msg);
void dp__conn_fatal(dp_conn *c, int status, const char *msg);
void dp__conn_produce(dp_conn *c);
void dp__pull_ready(dp_conn *c, dp_pull *p);

/* dp_timer.c: the sweep and the pin timer. */
void dp__on_sweep(uv_timer_t *t);
void dp__pin_timer_update(dp_server *s);

#endif
