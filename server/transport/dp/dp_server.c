/*
 * dp_server — the data plane's libuv server (see dp_server.h).
 *
 * Threads and what they own:
 *  - The loop thread runs uv_run and owns every handle, every connection,
 *    the buffer pool and every counter it writes: it accepts, reads and
 *    decodes frames, calls the core for small requests, and writes answers.
 *  - libuv's thread pool runs the work of large requests (core_push of a
 *    received gradient; core_read of a piece into its answer buffer, and the
 *    answer's CRC), so that the loop keeps serving other peers meanwhile. A
 *    work item touches only its own dp_work and the buffer it carries; libuv
 *    hands it back to the loop thread for the answer.
 *  - Core threads call on_core_version when a Pull's version arrives (or its
 *    wait ends). The callback touches only its dp_pull record and the
 *    mailbox: it queues the record there and wakes the loop with
 *    uv_async_send, the one door into the loop from other threads.
 *  - The thread calling dp_server_start / dp_server_stop creates the handles
 *    before the loop thread runs, and after joining it frees what is left;
 *    in between it only sets `stop` and wakes the loop through the same door.
 *
 * Lock order: mailbox.mu is the only lock here and a leaf. It is never held
 * while calling into the core, and the core calls on_core_version holding no
 * lock of its own that we could wait for.
 *
 * Lifetimes: a connection is reference counted (loop thread only): its
 * stream, each thread-pool work, each answer being written and each Pull
 * waiting in the core hold one reference. After stream_close the connection
 * is a "zombie" until its last reference goes; a Pull record outstanding in the
 * core when the server stops is then owned by the mailbox and never touches
 * its connection again, and the server frees the zombies itself.
 *
 * Copies of tensor bytes, beyond the kernel's socket copies:
 *  - Push: the payload is read from the socket straight into a buffer sized
 *    from the header (taken from a small pool, so that large buffers are not
 *    faulted in afresh for every frame), except for the bytes that arrived in
 *    the same read as the header (at most DP_STAGING bytes, copied once). The
 *    CRC is computed on each read's bytes while they are in cache. core_push
 *    then adds the buffer into the accumulator (or copies an early
 *    contribution to hold it, the core's own rule). 0 extra copies for large
 *    payloads: on_alloc hands that buffer to the stream layer, which over
 *    plain TCP reads into it as is.
 *  - Pull of the stored dtype: none at all. The piece is pinned in the low
 *    arena (core_pin_low), its CRC is the one kept beside it, and
 *    stream_write sends header+meta and the piece from there with one
 *    writev (common/net/stream.h: plain TCP adds no copy; TLS encrypts from it).
 *  - Pull of another dtype (or to a peer whose socket holds unsent bytes):
 *    core_read converts the piece from the master arena into the answer
 *    buffer (1 pass, which is the dtype conversion or the copy), the CRC
 *    reads it once more in cache, and one writev sends it. 1 copy.
 *  - PUSH_BATCH: as Push, with one buffer for all the pieces of the batch;
 *    each piece goes through core_push at its place in it. 0 extra copies.
 *  - PULL_BATCH of the stored dtype: none. Each piece is pinned where it
 *    lies, the payload CRC is combined from the pieces' stored ones
 *    (crc32c_combine, no byte read), and one writev sends the header and
 *    every piece from the arena. Otherwise as a Pull of another dtype, with
 *    one answer buffer for all the pieces (each read at its place). 1 copy.
 */
#include "server/transport/dp/dp_server.h"
#include "server/replica/replica.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/net/dp_client.h"
#include "common/net/stream.h"
#include "common/net/wire.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"

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

/* ------------------------------------------------------------------------ */
/* Types                                                                    */
/* ------------------------------------------------------------------------ */

/* One piece of a zero-copy batch answer: its bytes in the low arena. */
typedef struct dp_seg {
  const unsigned char *data;
  size_t len;
} dp_seg;

/* A payload buffer: capacity is a power of two (its pool class). */
typedef struct dp_buf {
  struct dp_buf *next; /* in the pool */
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
  struct dp_peer *next;
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
  struct dp_pull *done; /* LIFO */
  uv_async_t *async;    /* valid while !closed */
} dp_mailbox;

typedef struct dp_pull {
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
  uv_timer_t pin_timer;
  int pin_timer_on;
  atomic_int stop;
  dp_mailbox *mb;
  list_node live, zombies, fair, starved;
  list_node unauth_q;          /* connections not yet authenticated, oldest first */
  unsigned long long auth_gen; /* auth_keys_generation last seen by the sweep */
  dp_peer *peers;
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

static void count(_Atomic uint64_t *c, int64_t d) {
  atomic_fetch_add_explicit(c, (uint64_t)d, memory_order_relaxed);
}

/* ------------------------------------------------------------------------ */
/* Buffer pool (loop thread)                                                */
/* ------------------------------------------------------------------------ */

static int size_class(size_t n) {
  int c = 12; /* 4 KiB at least */
  while (c < DP_POOL_CLASSES - 1 && ((size_t)1 << c) < n)
    c++;
  return c;
}

/* Releases the pins of a zero-copy answer (from any thread: core_unpin_low
 * never blocks). */
static void buf_unpin(dp_buf *b) {
  if (b->segs) {
    for (uint32_t i = 0; i < b->nsegs; i++)
      core_unpin_low(b->pinned, b->segs[i].data);
    b->nsegs = 0;
  } else {
    core_unpin_low(b->pinned, b->data);
    b->data = NULL;
  }
  b->pinned = NULL;
}

static void buf_free(dp_buf *b) {
  if (b) {
    if (b->pinned)
      buf_unpin(b);
    else
      free(b->data);
    free(b->segs);
    free(b);
  }
}

static dp_buf *pool_get(dp_server *s, size_t n) {
  int c = size_class(n);
  if (((size_t)1 << c) < n)
    return NULL;
  s->pool_last_use_ms = clock_now_ms();
  dp_buf *b = s->pool[c];
  if (b) {
    s->pool[c] = b->next;
    s->pool_count[c]--;
    s->pool_bytes -= b->cap;
    b->next = NULL;
    return b;
  }
  b = calloc(1, sizeof *b);
  if (!b)
    return NULL;
  b->cls = c;
  b->cap = (size_t)1 << c;
  void *p = NULL;
  if (posix_memalign(&p, b->cap >= DP_HUGE_MIN ? DP_HUGE_MIN : 64, b->cap) != 0) {
    free(b);
    return NULL;
  }
  if (b->cap >= DP_HUGE_MIN)
    madvise(p, b->cap, MADV_HUGEPAGE); /* a hint: failure changes nothing */
  b->data = p;
  return b;
}

static void pool_put(dp_server *s, dp_buf *b) {
  if (!b)
    return;
  if (b->cls >= 0 && s->pool_count[b->cls] < DP_POOL_PER_CLASS &&
      (s->pool_bytes + b->cap <= DP_POOL_BYTES || s->pool_bytes == 0)) {
    b->next = s->pool[b->cls];
    s->pool[b->cls] = b;
    s->pool_count[b->cls]++;
    s->pool_bytes += b->cap;
    return;
  }
  buf_free(b);
}

static void pool_drain(dp_server *s) {
  for (int c = 0; c < DP_POOL_CLASSES; c++) {
    while (s->pool[c]) {
      dp_buf *b = s->pool[c];
      s->pool[c] = b->next;
      buf_free(b);
    }
    s->pool_count[c] = 0;
  }
  s->pool_bytes = 0;
}

/* ------------------------------------------------------------------------ */
/* Mailbox                                                                  */
/* ------------------------------------------------------------------------ */

static void mailbox_unref(dp_mailbox *mb, uint64_t n) {
  pthread_mutex_lock(&mb->mu);
  mb->refs -= n;
  int last = mb->refs == 0;
  pthread_mutex_unlock(&mb->mu);
  if (last) {
    pthread_mutex_destroy(&mb->mu);
    free(mb);
  }
}

static void pull_free(dp_pull *p) {
  if (!p)
    return;
  free(p->pieces);
  free(p);
}

/* Core thread: the wait of a Pull ended. */
static void on_core_version(void *arg, int status, uint64_t version) {
  dp_pull *p = arg;
  dp_mailbox *mb = p->mb;
  int orphan = 0;
  pthread_mutex_lock(&mb->mu);
  p->status = status;
  p->version = version;
  if (mb->closed) {
    orphan = 1;
  } else {
    p->next = mb->done;
    mb->done = p;
    uv_async_send(mb->async);
  }
  pthread_mutex_unlock(&mb->mu);
  if (orphan) {
    /* The server is gone; its connections with it. */
    pull_free(p);
    mailbox_unref(mb, 1);
  }
}

/* ------------------------------------------------------------------------ */
/* Connections                                                              */
/* ------------------------------------------------------------------------ */

/* ------------------------------------------------------------------------ */
/* Peer addresses                                                           */
/* ------------------------------------------------------------------------ */

/* The entry of the address in `ss` (created with no count), with one more
 * reference; NULL when out of memory. A linear list: there are at most as
 * many entries as connections, and one look per accept. */
static dp_peer *peer_get(dp_server *s, const struct sockaddr_storage *ss) {
  int fam = ss->ss_family;
  uint8_t ip[16] = {0};
  if (fam == AF_INET)
    memcpy(ip, &((const struct sockaddr_in *)ss)->sin_addr, 4);
  else if (fam == AF_INET6)
    memcpy(ip, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
  for (dp_peer *p = s->peers; p; p = p->next) {
    if (p->family == fam && memcmp(p->ip, ip, sizeof ip) == 0) {
      p->refs++;
      return p;
    }
  }
  dp_peer *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  p->family = fam;
  memcpy(p->ip, ip, sizeof ip);
  p->refs = 1;
  p->next = s->peers;
  s->peers = p;
  return p;
}

static void peer_unref(dp_server *s, dp_peer *p) {
  if (!p || --p->refs > 0)
    return;
  for (dp_peer **pp = &s->peers; *pp; pp = &(*pp)->next) {
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  }
  free(p);
}

static void conn_free(dp_conn *c) {
  if (c->token) {
    explicit_bzero(c->token, c->token_len);
    free(c->token);
  }
  list_remove(&c->node);
  wire_reader_free(&c->rd);
  buf_free(c->rx);
  peer_unref(c->s, c->pe);
  free(c);
}

static void conn_ref(dp_conn *c) {
  c->refs++;
}

static void conn_unref(dp_conn *c) {
  if (--c->refs == 0)
    conn_free(c);
}

static void on_conn_closed(stream *st, void *data) {
  (void)st;
  dp_conn *c = data;
  conn_unref(c);
}

static void conn_set_mid(dp_conn *c, int mid) {
  if (mid != c->mid) {
    c->mid = mid;
    count(&c->s->st_mid, mid ? 1 : -1);
  }
}

/* The connection stops counting against the caps (when it closes, or at
 * once when it is refused and only its ERROR frame is still to be sent). */
static void conn_uncount(dp_conn *c) {
  dp_server *s = c->s;
  if (!c->counted)
    return;
  c->counted = 0;
  s->nconns--;
  count(&s->st_conns, -1);
  c->pe->conns--;
  if (!c->authed) {
    s->nunauth--;
    count(&s->st_unauth, -1);
    c->pe->unauth--;
    list_remove(&c->unode);
  }
}

static void conn_close(dp_conn *c) {
  if (c->closing)
    return;
  dp_server *s = c->s;
  c->closing = 1;
  list_remove(&c->fair);
  list_remove(&c->starve);
  list_remove(&c->node);
  list_push(&s->zombies, &c->node);
  conn_uncount(c);
  conn_set_mid(c, 0);
  if (c->bp) {
    c->bp = 0;
    count(&s->st_paused, -1);
  }
  /* The receive buffer of an unfinished PUSH and the Pulls not yet answered
   * go with the stream (the stream's reference keeps c alive meanwhile). */
  pool_put(s, c->rx);
  c->rx = NULL;
  while (c->ready_head) {
    dp_pull *p = c->ready_head;
    c->ready_head = p->next;
    c->pending--;
    pull_free(p);
    conn_unref(c);
  }
  c->ready_tail = NULL;
  /* Writes still queued complete with ZS_ECANCELED in on_written. */
  stream_close(c->st, on_conn_closed);
}

static void on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf);
static void on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf);
static void conn_produce(dp_conn *c);

static void conn_update_reading(dp_conn *c) {
  int want = !c->closing && !c->eof && !c->fatal && c->pause == 0;
  if (want && !c->reading) {
    if (stream_read_start(c->st, on_alloc, on_read) == 0) {
      c->reading = 1;
      /* Time spent paused by us is not the peer's stall. */
      c->last_progress_ms = clock_now_ms();
    } else {
      conn_close(c);
    }
  } else if (!want && c->reading) {
    stream_read_stop(c->st);
    c->reading = 0;
  }
}

/* Re-evaluates the backpressure bound after pending or queued changed, and
 * closes a half-closed connection once everything is answered. */
static void conn_check(dp_conn *c) {
  if (c->closing)
    return;
  dp_server *s = c->s;
  /* A peer that shut its side gets the answers in progress, but not those
   * of Pulls still waiting for their version: those can take minutes, and
   * the connection's slot is freed for others at once (their records stay
   * with the core until the wait ends, never touching the connection). */
  if (c->eof && c->pending == c->waiting) {
    conn_close(c);
    return;
  }
  /* Waiting Pulls hold no buffer and must not stop the reads: the Push
   * their version needs may be the next frame. */
  int over = c->pending - c->waiting >= s->max_pending || c->queued >= s->max_queued ||
             c->consuming >= DP_CONSUME_WINDOW;
  if (over != c->bp) {
    c->bp = over;
    count(&s->st_paused, over ? 1 : -1);
    if (over)
      c->pause |= PAUSE_BACKPRESSURE;
    else
      c->pause &= ~PAUSE_BACKPRESSURE;
    conn_update_reading(c);
  }
}

/* ------------------------------------------------------------------------ */
/* Answers                                                                  */
/* ------------------------------------------------------------------------ */

/* Copied answer bytes leave the budgets; connections whose next answer
 * waited for the server's or their address's budget get their turn, oldest
 * first. */
static void budget_release(dp_conn *c, uint64_t n) {
  dp_server *s = c->s;
  if (n == 0)
    return;
  c->answer_bytes -= n;
  c->pe->answer_bytes -= n;
  s->answer_bytes -= n;
  count(&s->st_answer_bytes, -(int64_t)n);
  if (s->releasing)
    return; /* the outer call goes on with the list */
  s->releasing = 1;
  /* Each waiting connection is looked at once: one that still does not fit
   * puts itself back at the tail. */
  size_t n_starved = 0;
  for (list_node *l = s->starved.next; l != &s->starved; l = l->next)
    n_starved++;
  for (size_t i = 0; i < n_starved && !list_empty(&s->starved); i++) {
    dp_conn *w = container_of(s->starved.next, dp_conn, starve);
    list_remove(&w->starve);
    conn_produce(w);
  }
  s->releasing = 0;
}

static void pinned_done(dp_conn *c) {
  dp_server *s = c->s;
  c->pinned_out--;
  s->npinned--;
  count(&s->st_pinned, -1);
}

static void on_written(stream_write_req *req, int status) {
  dp_out *o = container_of(req, dp_out, req);
  dp_conn *c = o->conn;
  dp_server *s = c->s;
  c->queued -= o->bytes;
  if (o->is_answer)
    c->pending--;
  if (o->pinned)
    pinned_done(c);
  pool_put(s, o->payload);
  budget_release(c, o->budget);
  int close_after = o->close_after;
  free(o);
  if (status < 0 || close_after) {
    conn_close(c);
  } else {
    conn_check(c);
    conn_produce(c);
  }
  conn_unref(c);
}

static void pin_timer_update(dp_server *s);

/* The payload's place(s) in memory: one buffer, or each piece of a
 * zero-copy batch where it lies in the low arena (one writev takes them
 * all, after the header). Returns how many it wrote at out. */
static unsigned payload_bufs(const dp_buf *payload, uint64_t len, uv_buf_t *out) {
  /* Set directly: uv_buf_init takes an unsigned int length. */
  if (!payload->segs) {
    out[0].base = (char *)payload->data;
    out[0].len = (size_t)len;
    return 1;
  }
  for (uint32_t i = 0; i < payload->nsegs; i++) {
    out[i].base = (char *)(uintptr_t)payload->segs[i].data;
    out[i].len = payload->segs[i].len;
  }
  return payload->nsegs;
}

/* Queues frame `m` (header + meta) and `payload` (may be NULL; ownership
 * passes here) for writing with one writev. `is_answer` says whether it
 * answers a request counted in conn->pending; `budget` is the copied answer
 * bytes it holds, released once it is written (or dropped). */
static void conn_send_budget(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer,
                             int close_after, uint64_t budget) {
  dp_server *s = c->s;
  if (c->closing) {
    pool_put(s, payload);
    budget_release(c, budget);
    if (is_answer)
      c->pending--;
    return;
  }
  size_t cap = m->type == WIRE_PUSH_BATCH_ACK || m->type == WIRE_PULL_BATCH_DATA
                   ? WIRE_MAX_BATCH_ENCODED
                   : WIRE_MAX_ENCODED;
  dp_out *o = malloc(sizeof *o + cap);
  size_t hlen = 0;
  if (!o || wire_encode(m, o->head, cap, &hlen) != 0) {
    /* Neither can happen with our own frames short of memory running out;
     * the peer's requests cannot be answered, so the connection goes. */
    LOG_ERROR("dp_send", "peer=%s type=%s detail=\"cannot build an answer\"", c->peer,
              wire_type_name(m->type));
    free(o);
    pool_put(s, payload);
    budget_release(c, budget);
    if (is_answer)
      c->pending--;
    conn_close(c);
    return;
  }
  o->conn = c;
  o->payload = payload;
  o->budget = budget;
  o->pinned = 0;
  o->is_answer = is_answer;
  o->close_after = close_after;
  o->bytes = hlen + m->payload_len;
  uv_buf_t bufs[1 + WIRE_MAX_BATCH];
  bufs[0] = uv_buf_init((char *)o->head, (unsigned)hlen);
  unsigned nbufs = 1;
  if (m->payload_len)
    nbufs += payload_bufs(payload, m->payload_len, bufs + 1);
  conn_ref(c);
  c->queued += o->bytes;
  int rc = stream_write(c->st, &o->req, bufs, nbufs, on_written);
  if (rc < 0) {
    c->queued -= o->bytes;
    if (is_answer)
      c->pending--;
    pool_put(s, payload);
    budget_release(c, budget);
    free(o);
    conn_close(c);
    conn_unref(c);
    return;
  }
  c->handed += o->bytes;
  if (payload && payload->pinned) {
    /* Watched by the pin timer from now on: the stream tried the write at
     * once, so what it still holds is what the peer has not taken. */
    o->pinned = 1;
    if (c->pinned_out++ == 0) {
      c->pin_taken = c->handed - stream_write_queue_size(c->st);
      c->pin_since_ms = clock_now_ms();
    }
    s->npinned++;
    count(&s->st_pinned, 1);
    pin_timer_update(s);
  }
  count(&s->st_frames_out, 1);
  count(&s->st_bytes_out, (int64_t)o->bytes);
  conn_check(c);
}

static void conn_send(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer, int close_after) {
  conn_send_budget(c, m, payload, is_answer, close_after, 0);
}

static void answer_error(dp_conn *c, uint64_t id, int status, const char *msg) {
  wire_msg m = {.type = WIRE_ERROR, .request_id = id};
  m.u.error.status = status;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s",
             msg && *msg ? msg : zs_strerror(status));
  count(&c->s->st_req_errors, 1);
  conn_send(c, &m, NULL, 1, 0);
}

/* The stream broke: say why (request id 0), stop reading, close once the
 * frame is out. */
static void conn_fatal(dp_conn *c, int status, const char *msg) {
  dp_server *s = c->s;
  count(&s->st_proto_errors, 1);
  if (status == ZS_ECRC)
    count(&s->st_crc_errors, 1);
  LOG_WARN("dp_protocol_error", "peer=%s status=%s detail=\"%s\"", c->peer, zs_err_name(status),
           msg);
  c->fatal = 1;
  conn_set_mid(c, 0);
  conn_update_reading(c);
  wire_msg m = {.type = WIRE_ERROR, .request_id = 0};
  m.u.error.status = status;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s", msg);
  conn_send(c, &m, NULL, 0, 1);
}

/* ------------------------------------------------------------------------ */
/* Push and Pull work                                                       */
/* ------------------------------------------------------------------------ */

/* Reads pulls of an apply that lands between two pieces of a batch give
 * pieces of two versions; the batch is read again, this many times at most
 * (an apply is short, and the next one needs every trainer's pushes). */
#define DP_BATCH_READ_TRIES 4

static void work_free(dp_work *w) {
  free(w->pieces);
  free(w->piece_status);
  free(w->piece_dup);
  free(w);
}

/* Each piece of a push batch goes through service_push on its own, in order:
 * a refused piece (its status kept) leaves the others alone, exactly as
 * separate PUSH frames would. */
static void work_run_push_batch(dp_work *w) {
  size_t off = 0;
  w->err[0] = '\0';
  core_push_args fwd[WIRE_MAX_BATCH];
  uint32_t nfwd = 0;
  for (uint32_t i = 0; i < w->npieces; i++) {
    const wire_piece *pc = &w->pieces[i];
    core_push_args a = w->push;
    a.tensor = pc->tensor;
    a.slice = pc->slice;
    a.dtype = (zs_dtype)pc->dtype;
    a.data = w->buf->data + off;
    a.nbytes = (size_t)pc->length;
    char err[DP_ERRLEN] = "";
    int dup = 0;
    int rc = service_push(w->svc, &a, &dup, err, sizeof err);
    if (rc == 0 && w->forward)
      fwd[nfwd++] = a;
    w->piece_status[i] = rc;
    w->piece_dup[i] = rc == 0 && dup;
    if (rc != 0 && w->err[0] == '\0')
      status_say(w->err, sizeof w->err,
                 "piece %" PRIu32 " (tensor %" PRIu32 ", slice %" PRIu32 "): %s", i, pc->tensor,
                 pc->slice, err[0] ? err : zs_strerror(rc));
    off += (size_t)pc->length;
  }
  /* The accepted pieces go to the backups together before the batch is
   * answered; if that fails, so do they. */
  char err[DP_ERRLEN] = "";
  int rc = nfwd ? replica_forward_pushes(w->forward, fwd, nfwd, err, sizeof err) : 0;
  for (uint32_t i = 0; rc && i < w->npieces; i++)
    if (w->piece_status[i] == 0) {
      w->piece_status[i] = rc;
      w->piece_dup[i] = 0;
      status_say(w->err, sizeof w->err, "%s", err);
    }
}

/* The pieces of a batch never came out of one version. */
static void batch_mixed(dp_work *w) {
  w->status = ZS_EINTERNAL;
  status_say(w->err, sizeof w->err,
             "the %" PRIu32 " pieces of the batch kept changing version while being read",
             w->npieces);
}

/* A pinned answer that cannot be pinned after all (the job's dtype changed
 * under us, a restore): a buffer of its own for the copy, outside the pool
 * and the answer budgets, as the pin would have been. */
static int buf_own(dp_work *w) {
  dp_buf *b = w->buf;
  void *mem = NULL;
  if (posix_memalign(&mem, 64, w->nbytes ? w->nbytes : 1) != 0) {
    w->status = ZS_ENOMEM;
    status_say(w->err, sizeof w->err, "out of memory for the answer buffer");
    return w->status;
  }
  free(b->segs);
  b->segs = NULL;
  b->data = mem;
  b->cap = w->nbytes;
  return 0;
}

/* Pins every piece of a batch in the low arena (core_pin_low, one piece at a
 * time), all of one version, and makes the payload's CRC from the pieces'
 * stored ones: no byte is read. An apply that lands between two pins gives
 * two versions; the pins are dropped and taken again, as the copy reads
 * again. Returns 0 (the buffer holds the pins), CORE_NOT_PINNED (a piece is
 * not in the stored dtype: nothing is pinned) or w->status's error. */
static int batch_pin(dp_work *w, core *co) {
  dp_buf *b = w->buf;
  for (int attempt = 0; attempt < DP_BATCH_READ_TRIES; attempt++) {
    int mixed = 0;
    w->crc = 0;
    b->pinned = co;
    for (uint32_t i = 0; i < w->npieces && !mixed; i++) {
      const wire_piece *pc = &w->pieces[i];
      const void *p = NULL;
      uint64_t v = 0;
      uint32_t crc = 0;
      w->status = core_pin_low(co, w->hash, pc->tensor, pc->slice, (zs_dtype)pc->dtype,
                               (size_t)pc->length, &p, &v, &crc, w->err, sizeof w->err);
      if (w->status != 0) {
        buf_unpin(b);
        return w->status;
      }
      b->segs[b->nsegs++] = (dp_seg){p, (size_t)pc->length};
      if (i == 0)
        w->version = v;
      else
        mixed = v != w->version;
      w->crc = crc32c_combine(w->crc, crc, (size_t)pc->length);
    }
    if (!mixed)
      return 0;
    buf_unpin(b);
  }
  batch_mixed(w);
  return w->status;
}

/* A pull batch: pinned where it lies (a buffer with room for the pieces),
 * else every piece into one answer buffer, of one version. */
static void work_run_pull_batch(dp_work *w, core *co) {
  if (w->buf->segs && (batch_pin(w, co) != CORE_NOT_PINNED || buf_own(w) != 0))
    return;
  for (int attempt = 0; attempt < DP_BATCH_READ_TRIES; attempt++) {
    size_t off = 0;
    int mixed = 0;
    w->crc = 0;
    for (uint32_t i = 0; i < w->npieces; i++) {
      const wire_piece *pc = &w->pieces[i];
      uint64_t v = 0;
      w->status =
          core_read_crc(co, w->hash, pc->tensor, pc->slice, (zs_dtype)pc->dtype, w->buf->data + off,
                        (size_t)pc->length, &v, &w->crc, w->err, sizeof w->err);
      if (w->status != 0)
        return;
      if (i == 0)
        w->version = v;
      else if (v != w->version)
        mixed = 1;
      off += (size_t)pc->length;
    }
    if (!mixed)
      return;
  }
  batch_mixed(w);
}

static void work_run(dp_work *w, core *co) {
  if (w->type == WIRE_PUSH_BATCH) {
    work_run_push_batch(w);
  } else if (w->type == WIRE_PULL_BATCH) {
    work_run_pull_batch(w, co);
  } else if (w->type == WIRE_PUSH) {
    w->push.data = w->buf->data;
    w->status = service_push(w->svc, &w->push, &w->duplicate, w->err, sizeof w->err);
    if (w->status == 0 && w->forward)
      w->status = replica_forward_push(w->forward, &w->push, w->err, sizeof w->err);
  } else {
    w->crc = 0;
    if (w->buf->cls < 0) {
      /* Zero-copy candidate: sent straight from the low arena. */
      const void *p = NULL;
      w->status = core_pin_low(co, w->hash, w->tensor, w->slice, w->dtype, w->nbytes, &p,
                               &w->version, &w->crc, w->err, sizeof w->err);
      if (w->status == 0) {
        w->buf->data = (unsigned char *)(uintptr_t)p;
        w->buf->pinned = co;
        return;
      }
      if (w->status != CORE_NOT_PINNED || buf_own(w) != 0)
        return;
    }
    w->status = core_read_crc(co, w->hash, w->tensor, w->slice, w->dtype, w->buf->data, w->nbytes,
                              &w->version, &w->crc, w->err, sizeof w->err);
  }
}

/* Records a request's time from arrival to answer. */
static void observe(dp_server *s, int type, uint64_t start_ns, int failed) {
  metrics_rpc *r = type == WIRE_PUSH         ? s->m_push
                   : type == WIRE_PULL       ? s->m_pull
                   : type == WIRE_PUSH_BATCH ? s->m_push_batch
                                             : s->m_pull_batch;
  metrics_rpc_observe(r, clock_now_ns() - start_ns, failed);
}

/* Loop thread: answers a finished work and releases it. */
static void work_finish(dp_work *w) {
  dp_conn *c = w->conn;
  dp_server *s = c->s;
  observe(s, w->type, w->start_ns, w->status != 0);
  int pull = w->type == WIRE_PULL || w->type == WIRE_PULL_BATCH;
  if (pull)
    c->producing -= w->nbytes;
  else
    c->consuming -= w->nbytes;
  if (w->type == WIRE_PUSH_BATCH && w->status == 0) {
    pool_put(s, w->buf);
    wire_msg m = {.type = WIRE_PUSH_BATCH_ACK, .request_id = w->request_id};
    m.u.push_batch_ack.npieces = w->npieces;
    m.u.push_batch_ack.status = w->piece_status;
    m.u.push_batch_ack.duplicate = w->piece_dup;
    status_say(m.u.push_batch_ack.message, sizeof m.u.push_batch_ack.message, "%s", w->err);
    conn_send(c, &m, NULL, 1, 0);
  } else if (w->type == WIRE_PULL_BATCH && w->status == 0) {
    uint64_t lengths[WIRE_MAX_BATCH];
    wire_msg m = {.type = WIRE_PULL_BATCH_DATA,
                  .request_id = w->request_id,
                  .payload_len = w->nbytes,
                  .payload_crc = w->crc};
    m.u.pull_batch_data.version = w->version;
    m.u.pull_batch_data.npieces = w->npieces;
    m.u.pull_batch_data.length = lengths;
    for (uint32_t i = 0; i < w->npieces; i++) {
      lengths[i] = w->pieces[i].length;
      core_count_pull(s->core, w->pieces[i].length + (i == 0 ? WIRE_HEADER_SIZE : 0));
    }
    /* Counted before the write, which may reach the peer at once. */
    if (w->buf->segs)
      count(&s->st_pinned_batches, 1);
    conn_send_budget(c, &m, w->buf, 1, 0, w->budget);
  } else if (w->status != 0) {
    pool_put(s, w->buf);
    budget_release(c, w->budget);
    answer_error(c, w->request_id, w->status, w->err);
  } else if (w->type == WIRE_PUSH) {
    pool_put(s, w->buf);
    wire_msg m = {.type = WIRE_PUSH_ACK, .request_id = w->request_id};
    m.u.push_ack.duplicate = w->duplicate;
    conn_send(c, &m, NULL, 1, 0);
  } else {
    wire_msg m = {.type = WIRE_PULL_DATA,
                  .request_id = w->request_id,
                  .payload_len = w->nbytes,
                  .payload_crc = w->crc};
    m.u.pull_data.version = w->version;
    m.u.pull_data.dtype = (int)w->dtype;
    core_count_pull(s->core, WIRE_HEADER_SIZE + w->nbytes);
    conn_send_budget(c, &m, w->buf, 1, 0, w->budget);
  }
  if (pull)
    conn_produce(c);
  work_free(w);
  conn_unref(c);
}

static void on_work(uv_work_t *req) {
  dp_work *w = container_of(req, dp_work, req);
  work_run(w, w->core);
}

static void on_work_done(uv_work_t *req, int status) {
  dp_work *w = container_of(req, dp_work, req);
  if (status < 0 && w->status == 0) {
    w->status = ZS_ECANCELED;
    status_say(w->err, sizeof w->err, "the server is shutting down");
  }
  work_finish(w);
}

/* Runs a work inline when it is small, else on the thread pool. Takes
 * ownership of w. */
static void work_start(dp_work *w) {
  dp_conn *c = w->conn;
  dp_server *s = c->s;
  conn_ref(c);
  w->core = s->core;
  w->svc = s->svc;
  if (w->type == WIRE_PUSH || w->type == WIRE_PUSH_BATCH)
    c->consuming += w->nbytes;
  /* A forward waits for the backups: never on the loop thread. */
  if (w->nbytes <= s->inline_bytes && !w->forward) {
    work_run(w, s->core);
    work_finish(w);
    return;
  }
  int rc = uv_queue_work(&s->loop, &w->req, on_work, on_work_done);
  if (rc < 0) {
    w->status = ZS_EINTERNAL;
    status_say(w->err, sizeof w->err, "cannot queue work: %s", uv_strerror(rc));
    work_finish(w);
    return;
  }
  /* The request is pending, so this only pauses reading (DP_CONSUME_WINDOW). */
  conn_check(c);
}

/* Whether every piece of a Pull (one, or a batch's) is in `dtype`. */
static int pull_all_dtype(const dp_pull *p, zs_dtype dtype) {
  if (!p->pieces)
    return p->dtype == dtype;
  for (uint32_t i = 0; i < p->npieces; i++)
    if ((zs_dtype)p->pieces[i].dtype != dtype)
      return 0;
  return 1;
}

/* Whether a ready Pull's answer may be sent straight from the low copy:
 * every piece (one, or a batch's) in the stored dtype, to a peer that is
 * taking its bytes (its socket holds nothing unsent). A slow peer gets
 * copies instead, so that the pins an apply waits for belong to peers that
 * are reading; a copy over the connection's budget is pinned anyway (the
 * pin timer bounds it). */
static int pull_can_pin(dp_conn *c, const dp_pull *p) {
  if (!pull_all_dtype(p, core_low_dtype(c->s->core)))
    return 0;
  return stream_write_queue_size(c->st) == 0 || p->nbytes > c->s->max_answer;
}

/* Starts reading the piece of a ready Pull into an answer buffer (or
 * pinning it, `pin`). */
static void pull_read(dp_conn *c, dp_pull *p, int pin) {
  dp_server *s = c->s;
  dp_work *w = calloc(1, sizeof *w);
  dp_buf *b = NULL;
  if (w && pin) {
    /* The stored dtype: the work pins the piece (or each piece of the
     * batch) in the low arena and the answer goes out from there
     * (core_pin_low), no copy. */
    b = calloc(1, sizeof *b);
    if (b)
      b->cls = -1;
    if (b && p->pieces && !(b->segs = calloc(p->npieces, sizeof *b->segs))) {
      free(b);
      b = NULL;
    }
  } else if (w) {
    b = pool_get(s, p->nbytes);
  }
  if (!b) {
    free(w);
    answer_error(c, p->request_id, ZS_ENOMEM, "out of memory for the answer buffer");
    return;
  }
  if (!pin) {
    w->budget = p->nbytes;
    c->answer_bytes += p->nbytes;
    c->pe->answer_bytes += p->nbytes;
    s->answer_bytes += p->nbytes;
    count(&s->st_answer_bytes, (int64_t)p->nbytes);
  }
  w->conn = c;
  w->type = p->pieces ? WIRE_PULL_BATCH : WIRE_PULL;
  w->pieces = p->pieces; /* the work owns them now */
  w->npieces = p->npieces;
  p->pieces = NULL;
  w->request_id = p->request_id;
  w->start_ns = p->start_ns;
  w->buf = b;
  w->nbytes = p->nbytes;
  w->hash = p->hash;
  w->tensor = p->tensor;
  w->slice = p->slice;
  w->dtype = p->dtype;
  c->producing += p->nbytes;
  work_start(w);
}

/* Produces answers for ready Pulls while the connection's window has room.
 * Called whenever a Pull becomes ready or answer bytes leave the window. */
static void conn_produce(dp_conn *c) {
  dp_server *s = c->s;
  while (c->ready_head && !c->closing) {
    uint64_t busy = c->producing + c->queued;
    if (busy > 0 && busy >= DP_PRODUCE_WINDOW)
      return;
    dp_pull *p = c->ready_head;
    int pin = pull_can_pin(c, p);
    /* A copy waits for room in the connection's budget (its own answers
     * make it: on_written calls here again), in its peer address's share
     * and in the server's (any connection's answers make it: budget_release
     * calls here again). The address's share is what keeps one host that
     * does not read its answers from holding the whole server's budget, so
     * that another host's answers still find room. One copy is always
     * allowed where nothing is held, which pull_new's size check keeps
     * within all three. */
    if (!pin && c->answer_bytes > 0 && c->answer_bytes + p->nbytes > s->max_answer)
      return;
    dp_peer *pe = c->pe;
    if (!pin && ((pe->answer_bytes > 0 && pe->answer_bytes + p->nbytes > s->max_answer_peer) ||
                 (s->answer_bytes > 0 && s->answer_bytes + p->nbytes > s->max_answer_total))) {
      if (!c->starve.next)
        list_push(&s->starved, &c->starve);
      return;
    }
    c->ready_head = p->next;
    if (!c->ready_head)
      c->ready_tail = NULL;
    pull_read(c, p, pin);
    pull_free(p);
    conn_unref(c); /* the record's reference; the work holds its own */
  }
}

/* A Pull whose version is there joins its connection's queue of answers to
 * make; the record keeps its reference to the connection. */
static void pull_ready(dp_conn *c, dp_pull *p) {
  p->next = NULL;
  if (c->ready_tail)
    c->ready_tail->next = p;
  else
    c->ready_head = p;
  c->ready_tail = p;
  conn_produce(c);
}

/* Loop thread: handles the Pulls whose wait ended. */
static void drain_mailbox(dp_server *s) {
  dp_mailbox *mb = s->mb;
  pthread_mutex_lock(&mb->mu);
  dp_pull *list = mb->done;
  mb->done = NULL;
  pthread_mutex_unlock(&mb->mu);
  /* Oldest first, as the core fired them. */
  dp_pull *rev = NULL;
  uint64_t n = 0;
  while (list) {
    dp_pull *next = list->next;
    list->next = rev;
    rev = list;
    list = next;
    n++;
  }
  while (rev) {
    dp_pull *p = rev;
    rev = p->next;
    dp_conn *c = p->conn;
    c->waiting--;
    c->pe->waiting--;
    s->nwaiting--;
    count(&s->st_waiting, -1);
    if (c->closing) {
      c->pending--;
    } else if (p->status != 0) {
      char err[DP_ERRLEN];
      service_pull_wait_failed(p->status, p->min_version, p->tensor, p->slice, err, sizeof err);
      observe(s, p->pieces ? WIRE_PULL_BATCH : WIRE_PULL, p->start_ns, 1);
      answer_error(c, p->request_id, p->status, err);
    } else {
      pull_ready(c, p);
      conn_check(c);
      continue;
    }
    conn_check(c);
    conn_unref(c);
    pull_free(p);
  }
  if (n)
    mailbox_unref(mb, n);
}

/* ------------------------------------------------------------------------ */
/* Requests                                                                 */
/* ------------------------------------------------------------------------ */

static uint64_t pull_deadline(uint32_t timeout_ms) {
  uint32_t rel = timeout_ms && timeout_ms < DP_MAX_WAIT_MS ? timeout_ms : DP_MAX_WAIT_MS;
  return clock_now_ms() + rel;
}

static void pull_wait(dp_conn *c, dp_pull *p, uint32_t timeout_ms);

/* What every Pull and pull batch passes before it may wait (its answer fits a
 * frame and, when it must be copied, the answer budgets; when it may wait
 * (its version is not there yet; the core refuses one too far ahead), there is
 * room for one more waiting pull on the connection, its peer address and the
 * server: one whose version is there is never refused for lack of that room)
 * and its record; NULL when the request was answered with an error instead.
 * `copied`: the answer can only be a copy (a piece not in the stored dtype). */
static dp_pull *pull_new(dp_conn *c, uint64_t request_id, uint64_t hash, uint64_t min_version,
                         uint64_t nbytes, int copied, const char *what) {
  dp_server *s = c->s;
  char err[DP_ERRLEN];
  if (nbytes > s->max_payload) {
    answer_error(c, request_id,
                 service_too_large(what, nbytes, s->max_payload, "frame", err, sizeof err), err);
    return NULL;
  }
  uint64_t budget = s->max_answer < s->max_answer_total ? s->max_answer : s->max_answer_total;
  if (s->max_answer_peer < budget)
    budget = s->max_answer_peer;
  if (copied && nbytes > budget) {
    status_say(err, sizeof err,
               "the %s's answer of %" PRIu64 " bytes exceeds the server's budget of %" PRIu64
               " bytes for a copied answer; ask for fewer pieces, or in the stored dtype",
               what, nbytes, budget);
    answer_error(c, request_id, ZS_ELIMIT, err);
    return NULL;
  }
  int now = service_wait_admission(s->svc, hash, min_version);
  const char *full = NULL;
  uint64_t cap = 0;
  if (now) {
    /* Answered without waiting: no parking room needed. */
  } else if (c->waiting >= s->max_wait_conn) {
    full = "on this connection";
    cap = s->max_wait_conn;
  } else if (c->pe->waiting >= (s->max_wait + 3u) / 4u) {
    full = "from this peer address";
    cap = (s->max_wait + 3u) / 4u;
  } else if (s->nwaiting >= s->max_wait) {
    full = "on this server";
    cap = s->max_wait;
  }
  if (full) {
    status_say(err, sizeof err, "%" PRIu64 " pulls already wait for their version %s", cap, full);
    answer_error(c, request_id, ZS_ELIMIT, err);
    return NULL;
  }
  dp_pull *p = calloc(1, sizeof *p);
  if (!p) {
    answer_error(c, request_id, ZS_ENOMEM, "out of memory registering a pull");
    return NULL;
  }
  p->mb = s->mb;
  p->conn = c;
  p->request_id = request_id;
  p->start_ns = c->frame_ns;
  return p;
}

static void handle_pull(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_pull *q = &m->u.pull;
  char err[DP_ERRLEN] = "";
  zs_dtype dtype = (zs_dtype)q->dtype;
  /* Size (and so hash, tensor and slice) are checked before waiting, so a
   * bad request fails at once rather than at the end of its wait. */
  int64_t nb =
      service_piece_bytes(s->svc, q->spec_hash, q->tensor, q->slice, dtype, err, sizeof err);
  if (nb < 0) {
    answer_error(c, m->request_id, (int)nb, err);
    return;
  }
  dp_pull *p = pull_new(c, m->request_id, q->spec_hash, q->min_version, (uint64_t)nb,
                        dtype != core_low_dtype(s->core), "piece");
  if (!p)
    return;
  p->hash = q->spec_hash;
  p->min_version = q->min_version;
  p->tensor = q->tensor;
  p->slice = q->slice;
  p->dtype = dtype;
  p->nbytes = (size_t)nb;
  pull_wait(c, p, q->timeout_ms);
}

/* A PULL_BATCH: every piece is checked (and sized) before the one wait for
 * the version; one bad piece refuses the whole batch, so that the answer is
 * either every piece, of one version, or an ERROR. */
static void handle_pull_batch(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_pull_batch *q = &m->u.pull_batch;
  char err[DP_ERRLEN] = "";
  uint64_t total = 0;
  int copied = 0;
  for (uint32_t i = 0; i < q->npieces; i++) {
    const wire_piece *pc = &q->pieces[i];
    copied |= (zs_dtype)pc->dtype != core_low_dtype(s->core);
    int64_t nb = service_batch_piece_bytes(s->svc, q->spec_hash, i, pc->tensor, pc->slice,
                                           (zs_dtype)pc->dtype, pc->length, err, sizeof err);
    if (nb < 0) {
      answer_error(c, m->request_id, (int)nb, err);
      return;
    }
    total += (uint64_t)nb; /* at most WIRE_MAX_BATCH pieces below 2^62 bytes: no overflow */
  }
  dp_pull *p = pull_new(c, m->request_id, q->spec_hash, q->min_version, total, copied, "batch");
  if (!p)
    return;
  wire_piece *pcs = calloc(q->npieces, sizeof *pcs);
  if (!pcs) {
    pull_free(p);
    answer_error(c, m->request_id, ZS_ENOMEM, "out of memory registering a pull batch");
    return;
  }
  memcpy(pcs, q->pieces, q->npieces * sizeof *pcs);
  p->hash = q->spec_hash;
  p->min_version = q->min_version;
  p->tensor = pcs[0].tensor;
  p->slice = pcs[0].slice;
  p->dtype = (zs_dtype)pcs[0].dtype;
  p->nbytes = (size_t)total;
  p->pieces = pcs;
  p->npieces = q->npieces;
  pull_wait(c, p, q->timeout_ms);
}

/* Parks a Pull (or a batch) until its version is there, or answers it at
 * once when it already is. Takes ownership of p. */
static void pull_wait(dp_conn *c, dp_pull *p, uint32_t timeout_ms) {
  dp_server *s = c->s;
  char err[DP_ERRLEN] = "";
  /* The callback may run on a core thread before core_wait_version even
   * returns, so everything it needs is counted first. */
  pthread_mutex_lock(&s->mb->mu);
  s->mb->refs++;
  pthread_mutex_unlock(&s->mb->mu);
  conn_ref(c);
  c->waiting++;
  c->pe->waiting++;
  s->nwaiting++;
  count(&s->st_waiting, 1);
  uint64_t version = 0;
  uint64_t id = p->request_id;
  /* Per piece: a pipelined job answers each piece once it is applied. */
  core_piece_id one = {p->tensor, p->slice}, *ids = &one;
  uint32_t n = p->pieces ? p->npieces : 1;
  if (p->pieces && (ids = calloc(n, sizeof *ids)) != NULL)
    for (uint32_t i = 0; i < n; i++)
      ids[i] = (core_piece_id){p->pieces[i].tensor, p->pieces[i].slice};
  int rc =
      ids ? core_wait_pieces(s->core, p->hash, ids, n, p->min_version, pull_deadline(timeout_ms),
                             on_core_version, p, &version, err, sizeof err)
          : status_fail(err, sizeof err, ZS_ENOMEM, "out of memory registering a pull");
  if (ids != &one)
    free(ids);
  if (rc == CORE_PENDING)
    return;
  c->waiting--;
  c->pe->waiting--;
  s->nwaiting--;
  count(&s->st_waiting, -1);
  mailbox_unref(s->mb, 1);
  if (rc < 0) {
    answer_error(c, id, rc, err);
    conn_unref(c); /* cannot be the last: the handle holds one */
    pull_free(p);
    return;
  }
  pull_ready(c, p);
}

/* Whether a refused connection gets its log line: one a second at most, so
 * that a flood of them (or of guessed tokens) does not flood the log too;
 * *quiet gets how many went unlogged since the last line. */
static int refusal_logged(dp_server *s, uint64_t *quiet) {
  uint64_t now = clock_now_ms();
  if (now - s->refuse_log_ms < 1000u) {
    s->refuse_quiet++;
    return 0;
  }
  *quiet = s->refuse_quiet;
  s->refuse_log_ms = now;
  s->refuse_quiet = 0;
  return 1;
}

/* The first frame of a connection: a HELLO whose token grants the trainer
 * role, or the connection goes (ERROR with request id 0, then the close).
 * Nothing else is read before it. */
static void on_hello(dp_conn *c) {
  dp_server *s = c->s;
  wire_reader *rd = &c->rd;
  const wire_msg *m = &rd->msg;
  char err[DP_ERRLEN];
  int status = ZS_EUNAUTHENTICATED;
  auth_role role = AUTH_NONE;
  if (m->type != WIRE_HELLO) {
    status_say(err, sizeof err,
               "the first frame on a data-plane connection must be HELLO (frame version 3) with "
               "the client's token, not %s: upgrade the client to one that speaks version 3",
               wire_type_name(m->type));
  } else if (rd->meta_status != 0) {
    status = rd->meta_status;
    status_say(err, sizeof err, "%s", rd->err);
  } else if (!auth_allows((role = auth_keys_check_bound(s->auth, (const char *)m->u.hello.token,
                                                        m->u.hello.token_len, &c->bind)),
                          AUTH_TRAINER)) {
    status_say(err, sizeof err, "the server refused the token of this data-plane connection (%s)",
               m->u.hello.token_len ? "wrong token" : "no token given");
  } else {
    if (auth_keys_enabled(s->auth) && m->u.hello.token_len > 0 &&
        (c->token = malloc(m->u.hello.token_len)) == NULL) {
      status = ZS_ENOMEM;
      status_say(err, sizeof err, "out of memory keeping the connection's token");
      goto refuse;
    }
    if (c->token) {
      memcpy(c->token, m->u.hello.token, m->u.hello.token_len);
      c->token_len = m->u.hello.token_len;
    }
    c->authed = 1;
    c->replica_term = m->u.hello.replica_term;
    c->admin = !auth_keys_enabled(s->auth) || auth_allows(role, AUTH_ADMIN);
    c->role = role;
    if (c->counted) {
      s->nunauth--;
      count(&s->st_unauth, -1);
      c->pe->unauth--;
      list_remove(&c->unode);
    }
    wire_reader_limit_meta(rd, WIRE_MAX_META);
    wire_reader_set_payload(rd, NULL);
    wire_msg ack = {.type = WIRE_HELLO_ACK, .request_id = m->request_id};
    conn_send(c, &ack, NULL, 0, 0);
    return;
  }
refuse:
  count(&s->st_auth_refused, 1);
  uint64_t quiet = 0;
  if (refusal_logged(s, &quiet))
    LOG_WARN("dp_unauthenticated", "peer=%s refused_since_last_line=%" PRIu64 " detail=\"%s\"",
             c->peer, quiet, err);
  c->fatal = 1;
  conn_set_mid(c, 0);
  conn_update_reading(c);
  wire_msg e = {.type = WIRE_ERROR, .request_id = 0};
  e.u.error.status = status;
  status_say(e.u.error.message, sizeof e.u.error.message, "%s", err);
  conn_send(c, &e, NULL, 0, 1);
}

/* PUSH_BATCH: every piece is checked as a single PUSH is before anything is
 * allocated for the payload. When none could be added whatever its bytes
 * say, the batch is answered at once (each piece's status) and its payload
 * is skipped unread into memory. Returns 1 when answered. */
static int push_batch_refused(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_push_batch *q = &m->u.push_batch;
  int32_t st[WIRE_MAX_BATCH];
  uint8_t dup[WIRE_MAX_BATCH] = {0};
  wire_msg ack = {.type = WIRE_PUSH_BATCH_ACK, .request_id = m->request_id};
  for (uint32_t i = 0; i < q->npieces; i++) {
    const wire_piece *pc = &q->pieces[i];
    core_push_args a = {.hash = q->spec_hash,
                        .step = q->step,
                        .rank = q->rank,
                        .micro = q->micro,
                        .tensor = pc->tensor,
                        .slice = pc->slice,
                        .dtype = (zs_dtype)pc->dtype,
                        .nbytes = (size_t)pc->length};
    char err[DP_ERRLEN] = "";
    st[i] = service_push_check(s->svc, &a, err, sizeof err);
    if (st[i] == 0)
      return 0;
    if (i == 0)
      status_say(ack.u.push_batch_ack.message, sizeof ack.u.push_batch_ack.message,
                 "piece 0 (tensor %" PRIu32 ", slice %" PRIu32 "): %s", pc->tensor, pc->slice,
                 err[0] ? err : zs_strerror(st[i]));
  }
  ack.u.push_batch_ack.npieces = q->npieces;
  ack.u.push_batch_ack.status = st;
  ack.u.push_batch_ack.duplicate = dup;
  conn_send(c, &ack, NULL, 1, 0);
  return 1;
}

/* A replicated shard's verdict on a push or pull (replica_admit): 1 when
 * refused (and answered). A trainer's push to the primary is marked to be
 * forwarded. */
static int replica_refused(dp_conn *c, const wire_msg *m) {
  c->forward_next = 0;
  if (!c->s->rep)
    return 0;
  int push = m->type == WIRE_PUSH || m->type == WIRE_PUSH_BATCH;
  char err[DP_ERRLEN] = "";
  int rc = replica_admit(c->s->rep, push ? REPLICA_WRITE : REPLICA_READ, c->replica_term, c->admin,
                         0, &c->forward_next, err, sizeof err);
  if (rc == 0)
    return 0;
  answer_error(c, m->request_id, rc, err);
  return 1;
}

/* A push under a rank token must be for the token's job and rank; with
 * --require-rank-tokens a plain trainer token may not push at all. Checked
 * on every PUSH and PUSH_BATCH (a batch has one rank) before any byte of the
 * payload is kept: 1 when refused (answered ZS_EPERM; the payload is
 * skipped and nothing changes). No HMAC here: the token was verified at
 * HELLO. */
static int rank_refused(dp_conn *c, const wire_msg *m) {
  if (m->type != WIRE_PUSH && m->type != WIRE_PUSH_BATCH)
    return 0;
  uint64_t hash = m->type == WIRE_PUSH ? m->u.push.spec_hash : m->u.push_batch.spec_hash;
  uint32_t rank = m->type == WIRE_PUSH ? m->u.push.rank : m->u.push_batch.rank;
  int job_ok = !c->bind.bound || core_job_named(c->s->core, hash, c->bind.job);
  char err[DP_ERRLEN] = "";
  int rc = auth_push_admit(c->s->auth, c->role, &c->bind, job_ok, rank, err, sizeof err);
  if (rc == 0)
    return 0;
  answer_error(c, m->request_id, rc, err);
  return 1;
}

/* Header and meta of a frame are in: decide where its payload goes. */
static void on_meta(dp_conn *c) {
  dp_server *s = c->s;
  wire_reader *rd = &c->rd;
  const wire_msg *m = &rd->msg;
  void *dst = NULL;
  if (!c->authed) {
    on_hello(c);
    return;
  }
  if (m->type != WIRE_PUSH && m->type != WIRE_PULL && m->type != WIRE_PING &&
      m->type != WIRE_PUSH_BATCH && m->type != WIRE_PULL_BATCH) {
    char err[DP_ERRLEN];
    status_say(err, sizeof err,
               "a client may send PUSH, PULL or PING (or PUSH_BATCH, PULL_BATCH), and HELLO only "
               "first, not %s (request id %" PRIu64 ")",
               wire_type_name(m->type), m->request_id);
    conn_fatal(c, ZS_EPROTO, err);
    return;
  }
  c->pending++;
  c->frame_ns = clock_now_ns();
  if (rd->meta_status != 0) {
    answer_error(c, m->request_id, rd->meta_status, rd->err);
  } else if (m->type == WIRE_PING) {
    wire_msg pong = {.type = WIRE_PONG, .request_id = m->request_id};
    conn_send(c, &pong, NULL, 1, 0);
  } else if (rank_refused(c, m) || replica_refused(c, m)) {
    /* Answered; a push's payload is skipped. */
  } else if (m->type == WIRE_PULL) {
    handle_pull(c, m);
  } else if (m->type == WIRE_PULL_BATCH) {
    handle_pull_batch(c, m);
  } else if (m->type == WIRE_PUSH_BATCH) {
    /* The decoder checked that the pieces tile the payload exactly; the core
     * judges each piece once the bytes are in (on_done). */
    /* An empty payload is a batch of pieces without a gradient (each piece
     * empty, as the decoder checked). */
    if (push_batch_refused(c, m)) {
      /* Answered; the payload is skipped. */
    } else {
      c->rx = pool_get(s, (size_t)m->payload_len);
      if (!c->rx)
        answer_error(c, m->request_id, ZS_ENOMEM, "out of memory for the push batch payload");
      else
        dst = c->rx->data;
    }
  } else {
    const wire_push *q = &m->u.push;
    core_push_args a = {.hash = q->spec_hash,
                        .step = q->step,
                        .rank = q->rank,
                        .micro = q->micro,
                        .tensor = q->tensor,
                        .slice = q->slice,
                        .dtype = (zs_dtype)q->dtype,
                        .data = NULL,
                        .nbytes = (size_t)m->payload_len};
    char err[DP_ERRLEN] = "";
    int rc = service_push_check(s->svc, &a, err, sizeof err);
    if (rc != 0) {
      /* Refused whatever the payload says: it is skipped unread into
       * memory. */
      answer_error(c, m->request_id, rc, err);
    } else {
      c->rx = pool_get(s, (size_t)m->payload_len);
      if (!c->rx)
        answer_error(c, m->request_id, ZS_ENOMEM, "out of memory for the push payload");
      else
        dst = c->rx->data;
    }
  }
  if (c->closing || c->fatal)
    return;
  wire_reader_set_payload(rd, dst);
}

/* A frame is complete. */
static void on_done(dp_conn *c) {
  dp_server *s = c->s;
  wire_reader *rd = &c->rd;
  count(&s->st_frames_in, 1);
  if ((rd->msg.type != WIRE_PUSH && rd->msg.type != WIRE_PUSH_BATCH) || !c->rx)
    return;
  dp_buf *b = c->rx;
  c->rx = NULL;
  if (rd->payload_status != 0) {
    count(&s->st_crc_errors, 1);
    pool_put(s, b);
    answer_error(c, rd->msg.request_id, rd->payload_status, rd->err);
    return;
  }
  dp_work *w = calloc(1, sizeof *w);
  if (!w) {
    pool_put(s, b);
    answer_error(c, rd->msg.request_id, ZS_ENOMEM, "out of memory");
    return;
  }
  if (rd->msg.type == WIRE_PUSH_BATCH) {
    const wire_push_batch *q = &rd->msg.u.push_batch;
    w->pieces = calloc(q->npieces, sizeof *w->pieces);
    w->piece_status = calloc(q->npieces, sizeof *w->piece_status);
    w->piece_dup = calloc(q->npieces, 1);
    if (!w->pieces || !w->piece_status || !w->piece_dup) {
      work_free(w);
      pool_put(s, b);
      answer_error(c, rd->msg.request_id, ZS_ENOMEM, "out of memory");
      return;
    }
    memcpy(w->pieces, q->pieces, q->npieces * sizeof *w->pieces);
    w->npieces = q->npieces;
    w->conn = c;
    w->type = WIRE_PUSH_BATCH;
    w->request_id = rd->msg.request_id;
    w->start_ns = c->frame_ns;
    w->buf = b;
    w->nbytes = (size_t)rd->msg.payload_len;
    w->push =
        (core_push_args){.hash = q->spec_hash, .step = q->step, .rank = q->rank, .micro = q->micro};
    w->forward = c->forward_next ? s->rep : NULL;
    work_start(w);
    return;
  }
  const wire_push *q = &rd->msg.u.push;
  w->conn = c;
  w->type = WIRE_PUSH;
  w->request_id = rd->msg.request_id;
  w->start_ns = c->frame_ns;
  w->buf = b;
  w->nbytes = (size_t)rd->msg.payload_len;
  w->push = (core_push_args){.hash = q->spec_hash,
                             .step = q->step,
                             .rank = q->rank,
                             .micro = q->micro,
                             .tensor = q->tensor,
                             .slice = q->slice,
                             .dtype = (zs_dtype)q->dtype,
                             .nbytes = w->nbytes};
  w->forward = c->forward_next ? s->rep : NULL;
  work_start(w);
}

/* ------------------------------------------------------------------------ */
/* Reading                                                                  */
/* ------------------------------------------------------------------------ */

static void on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf) {
  (void)st;
  (void)suggested;
  dp_conn *c = data;
  size_t len = 0;
  void *p =
      wire_reader_read_buf(&c->rd, c->s->staging, DP_STAGING, DP_DIRECT_MIN, DP_READ_CHUNK, &len);
  *buf = uv_buf_init(p, (unsigned)len);
}

/* Runs the reader over bytes that came through the staging buffer. */
static void feed(dp_conn *c, const unsigned char *p, size_t len) {
  for (;;) {
    wire_event ev;
    size_t n = wire_reader_feed(&c->rd, p, len, &ev);
    p += n;
    len -= n;
    switch (ev) {
    case WIRE_EV_NONE:
      return;
    case WIRE_EV_META:
      on_meta(c);
      break;
    case WIRE_EV_DONE:
      on_done(c);
      break;
    case WIRE_EV_FATAL:
      if (!c->fatal)
        conn_fatal(c, c->rd.status, c->rd.err);
      return;
    }
    if (c->closing || c->fatal)
      return;
  }
}

static void on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf) {
  dp_conn *c = data;
  dp_server *s = c->s;
  if (nread == 0 || c->closing)
    return;
  if (nread < 0) {
    if (nread == STREAM_EOF && !wire_reader_mid_frame(&c->rd)) {
      /* The peer is done sending; it still gets its answers. */
      c->eof = 1;
      conn_update_reading(c);
      conn_check(c);
      return;
    }
    if (nread == STREAM_EOF) {
      wire_reader_eof(&c->rd);
      count(&s->st_proto_errors, 1);
      LOG_INFO("dp_disconnect", "peer=%s detail=\"%s\"", c->peer, c->rd.err);
    } else {
      LOG_INFO("dp_disconnect", "peer=%s detail=\"%s\"", c->peer, stream_detail(st));
    }
    conn_close(c);
    return;
  }
  count(&s->st_bytes_in, nread);
  c->last_progress_ms = clock_now_ms();
  if (buf->base == (char *)s->staging) {
    feed(c, s->staging, (size_t)nread);
  } else if (wire_reader_commit(&c->rd, (size_t)nread) == WIRE_EV_DONE) {
    on_done(c);
  }
  if (c->closing)
    return;
  conn_set_mid(c, wire_reader_mid_frame(&c->rd) && !c->fatal);
  /* Fairness: past its budget for this iteration, the connection waits for
   * the next one (the check handle resumes it), so the loop serves the
   * other ready peers first. */
  if (c->iter != s->iter) {
    c->iter = s->iter;
    c->iter_bytes = 0;
  }
  c->iter_bytes += (uint64_t)nread;
  if (c->iter_bytes >= DP_READ_BUDGET && !(c->pause & PAUSE_FAIR)) {
    c->pause |= PAUSE_FAIR;
    list_push(&s->fair, &c->fair);
    conn_update_reading(c);
  }
}

static void on_check(uv_check_t *h) {
  dp_server *s = h->data;
  s->iter++;
  while (!list_empty(&s->fair)) {
    dp_conn *c = container_of(s->fair.next, dp_conn, fair);
    list_remove(&c->fair);
    c->pause &= ~PAUSE_FAIR;
    conn_update_reading(c);
  }
}

/* ------------------------------------------------------------------------ */
/* Accepting, sweeping, stopping                                            */
/* ------------------------------------------------------------------------ */

/* Names the peer for log lines and finds its address's entry (a peer whose
 * address cannot be read shares the entry of the empty address). Returns 0
 * or ZS_ENOMEM. */
static int peer_name(dp_conn *c) {
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  status_say(c->peer, sizeof c->peer, "?");
  int known = stream_peer_addr(c->st, &ss) == 0;
  c->pe = peer_get(c->s, &ss);
  if (!c->pe)
    return ZS_ENOMEM;
  if (!known)
    return 0;
  char host[48] = "";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
    uv_ip4_name(a, host, sizeof host);
    port = ntohs(a->sin_port);
    status_say(c->peer, sizeof c->peer, "%s:%d", host, port);
  } else if (ss.ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
    uv_ip6_name(a, host, sizeof host);
    port = ntohs(a->sin6_port);
    status_say(c->peer, sizeof c->peer, "[%s]:%d", host, port);
  }
  return 0;
}

/* A connection over a cap: told why (request id 0), then closed. */
static void conn_refuse(dp_conn *c, const char *why) {
  dp_server *s = c->s;
  uint64_t quiet = 0;
  if (refusal_logged(s, &quiet))
    LOG_WARN("dp_accept", "peer=%s refused_since_last_line=%" PRIu64 " detail=\"%s\"", c->peer,
             quiet, why);
  /* A burst of refused connections must not fill the caps for the next
   * ones while their ERROR frames are on their way. */
  conn_uncount(c);
  c->fatal = 1;
  wire_msg m = {.type = WIRE_ERROR, .request_id = 0};
  m.u.error.status = ZS_ELIMIT;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s", why);
  conn_send(c, &m, NULL, 0, 1);
}

/* Closes the oldest connection not yet authenticated (from peer `pe`, or
 * from anyone when pe is NULL), other than `keep`, telling it why. */
static void unauth_evict_oldest(dp_server *s, const dp_peer *pe, const dp_conn *keep) {
  for (list_node *l = s->unauth_q.next; l != &s->unauth_q; l = l->next) {
    dp_conn *v = container_of(l, dp_conn, unode);
    if (v == keep || (pe && v->pe != pe))
      continue;
    count(&s->st_unauth_evicted, 1);
    if (v->fatal) {
      conn_close(v); /* already refused: its ERROR frame was on its way */
      return;
    }
    char why[200];
    status_say(why, sizeof why,
               "closed without HELLO: a newer connection needed the room (%u data-plane "
               "connections not yet authenticated, %u from one address)",
               s->max_unauth, s->max_unauth_peer);
    conn_refuse(v, why);
    return;
  }
}

static void on_connection(stream_listener *l, void *data, int status, stream *st) {
  dp_server *s = data;
  if (status < 0) {
    LOG_WARN("dp_accept", "detail=\"%s\"", stream_listener_detail(l));
    return;
  }
  dp_conn *c = calloc(1, sizeof *c);
  if (!c) {
    LOG_ERROR("dp_accept", "detail=\"out of memory\"");
    stream_close(st, NULL);
    return;
  }
  c->s = s;
  c->refs = 1; /* the stream's, dropped in on_conn_closed */
  wire_reader_init(&c->rd, s->max_payload);
  /* Until the HELLO, a stranger costs a few KiB at most. */
  wire_reader_limit_meta(&c->rd, WIRE_MAX_HELLO_META);
  /* c->fair and c->starve stay zeroed (unlinked) until they are used. */
  c->st = st;
  stream_set_data(st, c);
  if (peer_name(c) != 0) {
    LOG_ERROR("dp_accept", "detail=\"out of memory\"");
    stream_close(st, NULL);
    free(c);
    return;
  }
  list_push(&s->live, &c->node);
  list_push(&s->unauth_q, &c->unode);
  c->counted = 1;
  s->nconns++;
  s->nunauth++;
  c->pe->conns++;
  c->pe->unauth++;
  count(&s->st_conns, 1);
  count(&s->st_unauth, 1);
  count(&s->st_accepted, 1);
  c->accepted_ms = c->last_progress_ms = clock_now_ms();
  /* Small answers (acks, errors, latency probes) must not wait for Nagle. */
  stream_set_option(c->st, STREAM_OPT_NODELAY, 1);
  /* Checked at start; should the kernel refuse it now (the allowed list
   * changed), the connection keeps the host's default and a line says so. */
  if (s->congestion[0] && stream_set_congestion(c->st, s->congestion) != 0)
    LOG_WARN("dp_congestion_failed", "cc=%s detail=\"%s\"", s->congestion, stream_detail(c->st));
  char why[160];
  if (s->nconns > s->max_conns)
    status_say(why, sizeof why, "the server's limit of %u data-plane connections is reached",
               s->max_conns);
  else if (c->pe->conns > s->max_per_peer)
    status_say(why, sizeof why,
               "the limit of %u data-plane connections from one address is reached",
               s->max_per_peer);
  else
    why[0] = '\0';
  if (why[0]) {
    count(&s->st_limit_refused, 1);
    conn_refuse(c, why);
    return;
  }
  /* Over its address's share, or the server's budget, of connections that
   * have not said HELLO: the oldest such connection (of that address, or
   * any) makes room, never the new one. A trainer says HELLO at once, so
   * strangers that connect and wait can no longer keep it out; they only
   * push each other out. */
  if (c->pe->unauth > s->max_unauth_peer)
    unauth_evict_oldest(s, c->pe, c);
  if (s->nunauth > s->max_unauth)
    unauth_evict_oldest(s, NULL, c);
  conn_update_reading(c);
}

/* After a reload of the token files: every authenticated connection's token
 * is checked again; one that no longer grants the trainer role is told so
 * and closed, one that lost the admin role keeps the trainer's. */
static void recheck_tokens(dp_server *s) {
  for (list_node *l = s->live.next; l != &s->live;) {
    dp_conn *c = container_of(l, dp_conn, node);
    l = l->next; /* conn_close moves c to the zombies */
    if (!c->authed || c->fatal || !auth_keys_enabled(s->auth))
      continue;
    auth_role role = auth_keys_check_bound(s->auth, c->token, c->token_len, &c->bind);
    c->admin = auth_allows(role, AUTH_ADMIN);
    c->role = role;
    if (auth_allows(role, AUTH_TRAINER))
      continue;
    count(&s->st_auth_revoked, 1);
    LOG_WARN("dp_unauthenticated", "peer=%s detail=\"token revoked by a reload\"", c->peer);
    c->fatal = 1;
    conn_set_mid(c, 0);
    conn_update_reading(c);
    wire_msg e = {.type = WIRE_ERROR, .request_id = 0};
    e.u.error.status = ZS_EUNAUTHENTICATED;
    status_say(e.u.error.message, sizeof e.u.error.message,
               "the token of this data-plane connection is no longer accepted (the server reread "
               "its token files); reconnect with the current token");
    conn_send(c, &e, NULL, 0, 1);
  }
}

static void on_sweep(uv_timer_t *t) {
  dp_server *s = t->data;
  uint64_t now = clock_now_ms();
  /* Token files reread (SIGHUP): within a sweep, no connection keeps a
   * token that is no longer valid. */
  unsigned long long gen = auth_keys_generation(s->auth);
  if (gen != s->auth_gen) {
    s->auth_gen = gen;
    recheck_tokens(s);
  }
  /* Under pressure strangers get a short deadline, so that even a flood
   * that outpaces eviction turns over within about a sweep. */
  uint32_t hello_ms = s->nunauth * 2 > s->max_unauth && s->hello_ms > DP_PRESSED_HELLO_MS
                          ? DP_PRESSED_HELLO_MS
                          : s->hello_ms;
  for (list_node *l = s->live.next; l != &s->live;) {
    dp_conn *c = container_of(l, dp_conn, node);
    l = l->next; /* conn_close moves c to the zombies */
    if (!c->authed && !c->fatal && now - c->accepted_ms >= hello_ms) {
      count(&s->st_auth_timeouts, 1);
      LOG_WARN("dp_unauthenticated", "peer=%s detail=\"no HELLO within %u ms\"", c->peer, hello_ms);
      conn_close(c);
      continue;
    }
    if (c->reading && wire_reader_mid_frame(&c->rd) && now - c->last_progress_ms >= s->stall_ms) {
      count(&s->st_stalled, 1);
      LOG_WARN("dp_stalled", "peer=%s detail=\"no byte for %" PRIu64 " ms inside a frame\"",
               c->peer, now - c->last_progress_ms);
      conn_close(c);
      continue;
    }
    size_t wq = stream_write_queue_size(c->st);
    if (wq == 0 || wq != c->wq_seen) {
      c->wq_seen = wq;
      c->wq_since_ms = now;
    } else if (now - c->wq_since_ms >= s->stall_ms) {
      count(&s->st_stalled, 1);
      LOG_WARN("dp_stalled", "peer=%s detail=\"%zu answer bytes not taken for %" PRIu64 " ms\"",
               c->peer, wq, now - c->wq_since_ms);
      conn_close(c);
    }
  }
  if (s->pool_bytes && now - s->pool_last_use_ms >= DP_POOL_IDLE_MS)
    pool_drain(s);
}

/* Connections holding answers pinned in the low copy: one whose peer took
 * no byte for pin_hold_ms is closed, which cancels its writes and so
 * releases the pins at once; the apply that waits for them goes on, and the
 * peer (stalled, or too slow to matter) reconnects and asks again.
 *
 * This runs on the loop thread, which checks new requests against the core
 * under its state lock (shared). An apply that waits for pins while holding
 * that lock exclusively can therefore keep this tick from running until the
 * core's own bound (core_config.pin_wait_ms) ends the wait; an apply that
 * waits for pins before taking the lock is released here within
 * pin_hold_ms. */
static void on_pin_tick(uv_timer_t *t) {
  dp_server *s = t->data;
  uint64_t now = clock_now_ms();
  for (list_node *l = s->live.next; l != &s->live;) {
    dp_conn *c = container_of(l, dp_conn, node);
    l = l->next; /* conn_close moves c to the zombies */
    if (c->pinned_out == 0)
      continue;
    uint64_t taken = c->handed - stream_write_queue_size(c->st);
    if (taken != c->pin_taken) {
      c->pin_taken = taken;
      c->pin_since_ms = now;
    } else if (now - c->pin_since_ms >= s->pin_hold_ms) {
      count(&s->st_pins_released, 1);
      LOG_WARN("dp_stalled",
               "peer=%s detail=\"took no byte of an answer pinned in the shard's low copy for "
               "%" PRIu64 " ms; closed so that the pin does not hold up an apply\"",
               c->peer, now - c->pin_since_ms);
      conn_close(c);
    }
  }
  pin_timer_update(s);
}

/* The pin timer runs only while pinned answers are out. */
static void pin_timer_update(dp_server *s) {
  if (atomic_load(&s->stop))
    return;
  if (s->npinned > 0 && !s->pin_timer_on) {
    uv_timer_start(&s->pin_timer, on_pin_tick, DP_PIN_TICK_MS, DP_PIN_TICK_MS);
    s->pin_timer_on = 1;
  } else if (s->npinned == 0 && s->pin_timer_on) {
    uv_timer_stop(&s->pin_timer);
    s->pin_timer_on = 0;
  }
}

static void on_async(uv_async_t *h) {
  dp_server *s = h->data;
  drain_mailbox(s);
  if (!atomic_load(&s->stop))
    return;
  /* Stop: from here on core callbacks free their records themselves. */
  pthread_mutex_lock(&s->mb->mu);
  s->mb->closed = 1;
  pthread_mutex_unlock(&s->mb->mu);
  drain_mailbox(s);
  stream_listener_close(s->listener);
  s->listener = NULL;
  uv_close((uv_handle_t *)&s->sweep, NULL);
  uv_close((uv_handle_t *)&s->pin_timer, NULL);
  uv_close((uv_handle_t *)&s->check, NULL);
  uv_close((uv_handle_t *)&s->async, NULL);
  while (!list_empty(&s->live))
    conn_close(container_of(s->live.next, dp_conn, node));
}

static void *loop_main(void *arg) {
  dp_server *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Public                                                                   */
/* ------------------------------------------------------------------------ */

/* A setting the tests (and an operator who knows) may give through the
 * environment; anything but a positive number keeps the default. */
static uint64_t env_knob(const char *name, uint64_t def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end = NULL;
  unsigned long long n = strtoull(v, &end, 10);
  if (*end != '\0' || n == 0) {
    LOG_WARN("dp_config", "name=%s value=\"%s\" detail=\"not a positive number; ignored\"", name,
             v);
    return def;
  }
  return (uint64_t)n;
}

void dp_server_config_init(dp_server_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
}

static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

/* Frees a server whose loop thread is not running (never started, or
 * joined). */
static void server_free(dp_server *s) {
  if (s->loop_inited) {
    /* After a normal stop every handle is closed already; after a failed
     * start some were never run. Either way the loop finishes the closes.
     * The listener goes through its layer, which frees it in its callback. */
    stream_listener_close(s->listener);
    s->listener = NULL;
    uv_walk(&s->loop, close_walk, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    int rc = uv_loop_close(&s->loop);
    if (rc != 0)
      LOG_ERROR("dp_stop", "detail=\"loop not closed: %s\"", uv_strerror(rc));
  }
  /* What is left are connections kept only by Pulls still parked in the
   * core; their records belong to the mailbox now and never look at them. */
  while (!list_empty(&s->zombies))
    conn_free(container_of(s->zombies.next, dp_conn, node));
  pool_drain(s);
  free(s->staging);
  if (s->mb) {
    pthread_mutex_lock(&s->mb->mu);
    s->mb->closed = 1;
    pthread_mutex_unlock(&s->mb->mu);
    mailbox_unref(s->mb, 1);
  }
  if (s->own_svc)
    service_destroy(s->svc);
  free(s);
}

int dp_server_start(const dp_server_config *cfg, dp_server **out, char *err, size_t errlen) {
  if (err && errlen)
    err[0] = '\0';
  if (!cfg || !cfg->core || !cfg->listen || !out)
    return status_fail(err, errlen, ZS_EINVAL, "dp_server_start needs a listen address and a core");
  struct sockaddr_storage addr;
  int rc = dp_resolve(cfg->listen, 1, &addr, err, errlen);
  if (rc)
    return rc;
  if (cfg->congestion && cfg->congestion[0] &&
      (rc = stream_cc_check(cfg->congestion, err, errlen)) != 0)
    return rc;
  dp_server *s = calloc(1, sizeof *s);
  if (!s)
    return ZS_ENOMEM;
  s->core = cfg->core;
  s->svc = cfg->service;
  if (s->svc && service_core(s->svc) != s->core) {
    free(s);
    if (err && errlen)
      status_say(err, errlen, "dp_server_start: the service drives another core");
    return ZS_EINVAL;
  }
  if (!s->svc && service_create(s->core, NULL, &s->svc) != 0) {
    free(s);
    return ZS_ENOMEM;
  }
  s->own_svc = !cfg->service;
  s->max_payload = cfg->max_payload ? cfg->max_payload : WIRE_DEFAULT_MAX_PAYLOAD;
  s->max_pending = cfg->max_pending ? cfg->max_pending : DP_DEFAULT_MAX_PENDING;
  s->max_queued = cfg->max_queued_bytes ? cfg->max_queued_bytes : DP_DEFAULT_MAX_QUEUED;
  s->stall_ms = cfg->stall_timeout_ms ? cfg->stall_timeout_ms : DP_DEFAULT_STALL_MS;
  s->max_conns = cfg->max_connections ? cfg->max_connections : DP_DEFAULT_MAX_CONNS;
  s->inline_bytes = cfg->inline_bytes ? cfg->inline_bytes : DP_DEFAULT_INLINE;
  s->auth = cfg->auth;
  s->auth_gen = auth_keys_generation(s->auth);
  s->rep = cfg->replica;
  s->hello_ms = cfg->hello_timeout_ms ? cfg->hello_timeout_ms
                                      : env_knob("ZSHARD_DP_HELLO_TIMEOUT_MS", DP_DEFAULT_HELLO_MS);
  s->max_per_peer = cfg->max_per_peer ? cfg->max_per_peer : DP_DEFAULT_PER_PEER;
  s->max_unauth = cfg->max_unauthenticated ? cfg->max_unauthenticated : DP_DEFAULT_UNAUTH;
  s->max_unauth_peer =
      s->max_unauth / DP_UNAUTH_SHARE_DIV ? s->max_unauth / DP_UNAUTH_SHARE_DIV : 1;
  s->max_wait_conn =
      cfg->max_waiting_per_conn ? cfg->max_waiting_per_conn : DP_DEFAULT_WAITING_CONN;
  s->max_wait = cfg->max_waiting ? cfg->max_waiting : DP_DEFAULT_WAITING;
  s->max_answer = cfg->max_answer_bytes ? cfg->max_answer_bytes
                                        : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES", DP_DEFAULT_ANSWER);
  s->max_answer_total = cfg->max_answer_bytes_total
                            ? cfg->max_answer_bytes_total
                            : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES_TOTAL", DP_DEFAULT_ANSWER_TOTAL);
  /* A quarter of the server's budget by default, as for waiting pulls: one
   * address cannot hold it all, so the others' answers still find room. */
  uint64_t quarter = (s->max_answer_total + 3u) / 4u;
  s->max_answer_peer = cfg->max_answer_bytes_per_peer
                           ? cfg->max_answer_bytes_per_peer
                           : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES_PEER", quarter);
  s->pin_hold_ms = cfg->pin_hold_ms ? cfg->pin_hold_ms : DP_DEFAULT_PIN_HOLD_MS;
  if (cfg->congestion && cfg->congestion[0])
    memcpy(s->congestion, cfg->congestion, strlen(cfg->congestion) + 1); /* checked above */
  if (cfg->metrics) {
    s->m_push = metrics_rpc_register(cfg->metrics, "data", "Push");
    s->m_pull = metrics_rpc_register(cfg->metrics, "data", "Pull");
    s->m_push_batch = metrics_rpc_register(cfg->metrics, "data", "PushBatch");
    s->m_pull_batch = metrics_rpc_register(cfg->metrics, "data", "PullBatch");
  }
  atomic_init(&s->stop, 0);
  list_init(&s->live);
  list_init(&s->unauth_q);
  list_init(&s->zombies);
  list_init(&s->fair);
  list_init(&s->starved);
  rc = ZS_ENOMEM;
  s->staging = malloc(DP_STAGING);
  s->mb = calloc(1, sizeof *s->mb);
  if (!s->staging || !s->mb)
    goto fail;
  if (pthread_mutex_init(&s->mb->mu, NULL) != 0) {
    free(s->mb);
    s->mb = NULL;
    goto fail;
  }
  s->mb->refs = 1;
  rc = ZS_EINTERNAL;
  if (uv_loop_init(&s->loop) != 0)
    goto fail;
  s->loop_inited = 1;
  char detail[128];
  int lrc = cfg->tls ? stream_tls_listen(cfg->tls, &s->loop, (const struct sockaddr *)&addr, 1024,
                                         on_connection, s, &s->listener, detail, sizeof detail)
                     : stream_listen(&stream_tcp_ops, &s->loop, (const struct sockaddr *)&addr,
                                     1024, on_connection, s, &s->listener, detail, sizeof detail);
  if (lrc != 0) {
    rc = status_fail(err, errlen, ZS_EINVAL, "cannot listen on %s: %s", cfg->listen,
                     detail[0] ? detail : zs_strerror(lrc));
    goto fail;
  }
  struct sockaddr_storage bound;
  if (stream_listener_addr(s->listener, &bound) != 0)
    goto fail;
  s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                              : ((struct sockaddr_in *)&bound)->sin_port);
  if (uv_async_init(&s->loop, &s->async, on_async) != 0)
    goto fail;
  s->async.data = s;
  s->mb->async = &s->async;
  uv_timer_init(&s->loop, &s->sweep);
  s->sweep.data = s;
  uv_timer_start(&s->sweep, on_sweep, DP_SWEEP_MS, DP_SWEEP_MS);
  uv_timer_init(&s->loop, &s->pin_timer);
  s->pin_timer.data = s;
  uv_check_init(&s->loop, &s->check);
  s->check.data = s;
  uv_check_start(&s->check, on_check);
  if (pthread_create(&s->thread, NULL, loop_main, s) != 0)
    goto fail;
  s->thread_started = 1;
  LOG_INFO("dp_listening", "addr=%s port=%d", cfg->listen, s->port);
  *out = s;
  return 0;

fail:
  if (err && errlen && !err[0])
    status_say(err, errlen, "cannot start the data plane on %s: %s", cfg->listen, zs_strerror(rc));
  server_free(s);
  return rc;
}

int dp_server_port(const dp_server *s) {
  return s->port;
}

void dp_server_get_stats(const dp_server *s, dp_server_stats *o) {
  dp_server *m = (dp_server *)s; /* atomics are read through a non-const pointer */
  o->connections = atomic_load_explicit(&m->st_conns, memory_order_relaxed);
  o->accepted = atomic_load_explicit(&m->st_accepted, memory_order_relaxed);
  o->frames_in = atomic_load_explicit(&m->st_frames_in, memory_order_relaxed);
  o->frames_out = atomic_load_explicit(&m->st_frames_out, memory_order_relaxed);
  o->bytes_in = atomic_load_explicit(&m->st_bytes_in, memory_order_relaxed);
  o->bytes_out = atomic_load_explicit(&m->st_bytes_out, memory_order_relaxed);
  o->request_errors = atomic_load_explicit(&m->st_req_errors, memory_order_relaxed);
  o->protocol_errors = atomic_load_explicit(&m->st_proto_errors, memory_order_relaxed);
  o->crc_errors = atomic_load_explicit(&m->st_crc_errors, memory_order_relaxed);
  o->stalled_closed = atomic_load_explicit(&m->st_stalled, memory_order_relaxed);
  o->mid_frame = atomic_load_explicit(&m->st_mid, memory_order_relaxed);
  o->paused = atomic_load_explicit(&m->st_paused, memory_order_relaxed);
  o->pulls_waiting = atomic_load_explicit(&m->st_waiting, memory_order_relaxed);
  o->unauthenticated = atomic_load_explicit(&m->st_unauth, memory_order_relaxed);
  o->auth_refused = atomic_load_explicit(&m->st_auth_refused, memory_order_relaxed);
  o->auth_timeouts = atomic_load_explicit(&m->st_auth_timeouts, memory_order_relaxed);
  o->limit_refused = atomic_load_explicit(&m->st_limit_refused, memory_order_relaxed);
  o->answer_bytes = atomic_load_explicit(&m->st_answer_bytes, memory_order_relaxed);
  o->pinned_answers = atomic_load_explicit(&m->st_pinned, memory_order_relaxed);
  o->pins_released = atomic_load_explicit(&m->st_pins_released, memory_order_relaxed);
  o->pinned_batches = atomic_load_explicit(&m->st_pinned_batches, memory_order_relaxed);
  o->unauth_evicted = atomic_load_explicit(&m->st_unauth_evicted, memory_order_relaxed);
  o->auth_revoked = atomic_load_explicit(&m->st_auth_revoked, memory_order_relaxed);
}

/* One /metrics family: a name under zshard_dp_, its type, its help, and
 * where its value sits in dp_server_stats. */
typedef struct dp_metric {
  const char *name, *type, *help;
  size_t off;
} dp_metric;

#define DP_METRIC(name, type, field, help)                                                         \
  { name, type, help, offsetof(dp_server_stats, field) }
static const dp_metric dp_metrics[] = {
    DP_METRIC("connections", "gauge", connections, "Data-plane connections open now."),
    DP_METRIC("accepted_total", "counter", accepted, "Data-plane connections accepted."),
    DP_METRIC("frames_received_total", "counter", frames_in, "Complete frames received."),
    DP_METRIC("frames_sent_total", "counter", frames_out, "Answers queued to send."),
    DP_METRIC("received_bytes_total", "counter", bytes_in,
              "Bytes read from data-plane connections, headers included."),
    DP_METRIC("sent_bytes_total", "counter", bytes_out,
              "Bytes written to data-plane connections, headers included."),
    DP_METRIC("protocol_errors_total", "counter", protocol_errors,
              "Connections closed for a broken stream (a frame the decoder refused)."),
    DP_METRIC("crc_errors_total", "counter", crc_errors,
              "Frames whose header or payload CRC did not match."),
    DP_METRIC("stalled_closed_total", "counter", stalled_closed,
              "Connections closed by the stall timeout (inside a frame, or not reading "
              "their answers)."),
    DP_METRIC("auth_refused_total", "counter", auth_refused,
              "Connections closed for a missing or refused HELLO."),
    DP_METRIC("auth_timeouts_total", "counter", auth_timeouts,
              "Connections closed for not authenticating in time."),
    DP_METRIC("limit_refused_total", "counter", limit_refused,
              "Connections refused by a connection cap."),
    DP_METRIC("unauthenticated_evicted_total", "counter", unauth_evicted,
              "Connections closed before their HELLO to make room for a newer one."),
    DP_METRIC("auth_revoked_total", "counter", auth_revoked,
              "Connections closed because a reload of the token files revoked their token."),
    DP_METRIC("paused_connections", "gauge", paused,
              "Connections not read now, for backpressure (answers or memory)."),
    DP_METRIC("answer_bytes", "gauge", answer_bytes,
              "Copied Pull answer bytes held now, all connections."),
    DP_METRIC("pinned_answers", "gauge", pinned_answers,
              "Pull answers being sent now from the shard's low-precision copy, uncopied."),
    DP_METRIC("pinned_batches_total", "counter", pinned_batches,
              "PullBatch answers sent from the low-precision copy, uncopied."),
    DP_METRIC("pins_released_total", "counter", pins_released,
              "Connections closed for stalling while an answer pinned the copy."),
};

void dp_server_metrics(void *arg, metrics_text *t) {
  dp_server *s = arg;
  dp_server_stats st;
  dp_server_get_stats(s, &st);
  core_info info;
  service_info(s->svc, &info);
  for (size_t i = 0; i < sizeof dp_metrics / sizeof dp_metrics[0]; i++) {
    const dp_metric *m = &dp_metrics[i];
    uint64_t v;
    memcpy(&v, (const char *)&st + m->off, sizeof v);
    metrics_text_printf(t,
                        "# HELP zshard_dp_%s %s\n# TYPE zshard_dp_%s %s\n"
                        "zshard_dp_%s{shard=\"%" PRIu32 "\"} %" PRIu64 "\n",
                        m->name, m->help, m->name, m->type, m->name, info.shard_id, v);
  }
}

void dp_server_stop(dp_server *s) {
  if (!s)
    return;
  if (s->thread_started) {
    atomic_store(&s->stop, 1);
    uv_async_send(&s->async);
    pthread_join(s->thread, NULL);
  }
  server_free(s);
}
