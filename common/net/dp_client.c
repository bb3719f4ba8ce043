/*
 * dp_client — the data plane's client (see dp_client.h).
 *
 * Threads and what they own:
 *  - Submitting threads (any, including the loop thread from a callback)
 *    build a request, compute its payload CRC on their own time, and append
 *    it to the submission queue under `mu`, waking the loop with
 *    uv_async_send while still holding `mu` (so that the async handle cannot
 *    be closed between the check of `closing` and the send).
 *  - The loop thread owns everything else: the connections, the requests
 *    taken from the queue (the pending list, the in-flight table), the
 *    reader state and every callback invocation.
 *  - dp_client_open / dp_client_close run on the caller's thread: open
 *    creates the handles and starts the connects before the loop thread runs,
 *    then waits on `cv` until every connect has settled; close sets `closing`
 *    and joins the loop thread, after which it frees what is left.
 *
 * Lock order: `mu` is the only lock and a leaf; no callback runs under it.
 *
 * A request's memory lives until both its callback has run and the stream
 * layer is done with its write (the stream_write_req and header live inside
 * it). A Push whose bytes are still being written when it must fail (timeout)
 * takes its connection down with it: a stream cannot withdraw half a write,
 * and closing the stream is what guarantees that the caller's buffer is not
 * read after the callback.
 *
 * Copies of tensor bytes: none over plain TCP (common/net/stream.h). Push
 * payloads go from the caller's buffer to the socket by one vectored write;
 * Pull payloads come from the socket into the caller's destination (a pull
 * batch's: each piece's own), handed out by on_alloc, except the bytes read
 * into the staging buffer and copied once from it: those that arrive in the
 * same read as their header, and those read while less than DPC_DIRECT_MIN
 * bytes of the current destination (a batch piece) are awaited, which one
 * read takes many of at once.
 */
#include "common/net/dp_client.h"
#include "common/base/status.h"
#include "common/net/hostport.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/list.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

#define DPC_DEFAULT_CONNECT_MS 10000u
#define DPC_DEFAULT_MAX_INFLIGHT 1024u
/* A Pull's answer may take this long beyond the server's own wait. */
#define DPC_PULL_GRACE_MS 10000u
#define DPC_TICK_MS 50u
#define DPC_BUCKETS 1024u
#define DPC_STAGING (64u << 10)
#define DPC_DIRECT_MIN (16u << 10)
#define DPC_READ_CHUNK (512u << 10)
/* Push payload bytes a connection may have handed to its stream and not yet
 * seen taken by the kernel, before further pushes wait in the client's
 * queue. Requests without a payload (pulls, pings) never wait behind pushes
 * held back this way: a pipelined step's pulls go out while its pushes are
 * still being sent, rather than behind all of them (a trainer's 8 MiB of
 * pushes to one shard is 67 ms at 1 Gbit/s). The kernel's socket buffer
 * still sits ahead of any request; this bounds what libuv queues on top. */
#define DPC_UNSENT_MAX (UINT64_C(1) << 20)

/* ------------------------------------------------------------------------ */
/* Address resolution                                                       */
/* ------------------------------------------------------------------------ */

int dp_resolve(const char *hostport, int passive, struct sockaddr_storage *out, char *err,
               size_t errlen) {
  struct hostport hp; /* the struct tag: the parameter hides the typedef */
  int rc = hostport_parse(hostport, &hp, err, errlen);
  if (rc != 0)
    return rc;
  char *host = hp.host;
  uint16_t p = hp.port;
  if (!host[0]) {
    if (!passive)
      return status_fail(err, errlen, ZS_EINVAL, "address \"%s\" has no host", hostport);
    status_say(host, sizeof hp.host, "0.0.0.0");
  }
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  rc = getaddrinfo(host, NULL, &hints, &res);
  if (rc != 0 || !res)
    return status_fail(err, errlen, ZS_EINVAL, "cannot resolve \"%s\": %s", host, gai_strerror(rc));
  memset(out, 0, sizeof *out);
  memcpy(out, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (out->ss_family == AF_INET)
    ((struct sockaddr_in *)out)->sin_port = htons((uint16_t)p);
  else if (out->ss_family == AF_INET6)
    ((struct sockaddr_in6 *)out)->sin6_port = htons((uint16_t)p);
  else
    return status_fail(err, errlen, ZS_EINVAL, "\"%s\" is not an IPv4 or IPv6 address", host);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Types                                                                    */
/* ------------------------------------------------------------------------ */

/* C_HELLO: connected, HELLO sent, its answer awaited (still "connecting"
 * for the connect timeout and for dp_client_open). */
enum { C_IDLE = 0, C_CONNECTING, C_HELLO, C_READY, C_CLOSING };

static int connecting(int state) {
  return state == C_CONNECTING || state == C_HELLO;
}

typedef struct dp_cconn dp_cconn;

typedef struct dp_req {
  list_node node;       /* on the pending list, or on its connection's in-flight list */
  struct dp_req *qnext; /* submission queue */
  struct dp_req *hnext; /* id table bucket */
  wire_msg msg;         /* type, meta, payload length and CRC; id set at write */
  dp_done_cb cb;
  void *arg;
  const void *data; /* Push payload, the caller's */
  void *dst;        /* Pull destination, the caller's */
  size_t nbytes;
  /* A pull batch's destinations in payload order (owned array, the caller's
   * memory): one per piece, or one for the whole payload. */
  wire_seg *segs;
  uint32_t nsegs;
  uint32_t timeout_ms;
  uint64_t deadline_ms; /* set when the loop takes the request */
  dp_cconn *conn;
  /* A push's payload bytes counted in wconn->unsent until its write is
   * done, for the connection's generation wgen. */
  dp_cconn *wconn;
  uint64_t wgen;
  size_t unsent;
  int in_table;
  int writing;   /* the stream still holds wreq */
  int completed; /* the callback ran */
  /* A batch: its pieces, which msg points at (owned), and for a push batch
   * each piece's bytes (owned array, borrowed bytes), in the same order. */
  wire_piece *pieces;
  const void **piece_data;
  /* Where the header is encoded: `head`, or for a batch an owned buffer of
   * WIRE_MAX_BATCH_ENCODED bytes. */
  uint8_t *big_head;
  stream_write_req wreq;
  uint8_t head[WIRE_MAX_ENCODED];
} dp_req;

static void req_free(dp_req *r) {
  free(r->segs);
  free(r->pieces);
  free(r->piece_data);
  free(r->big_head);
  free(r);
}

struct dp_cconn {
  dp_client *c;
  stream *st; /* NULL while C_IDLE; freed by the stream layer after on_conn_closed */
  int state;
  int index;
  uint64_t connect_deadline_ms;
  wire_reader rd;
  list_node inflight;
  uint32_t ninflight;
  uint64_t bytes_inflight;
  /* Push payload bytes written to the stream whose writes are not done
   * (DPC_UNSENT_MAX); gen counts the connection's streams, so that a write
   * finishing after its stream was replaced counts against nothing. */
  uint64_t unsent, gen;
  dp_req *rx; /* the Pull whose payload is arriving */
  /* The HELLO being written (its bytes live here until hello_req's callback). */
  stream_write_req hello_req;
  uint8_t hello[WIRE_HEADER_SIZE + WIRE_MAX_HELLO_META];
};

struct dp_client {
  uv_loop_t loop;
  uv_async_t async;
  uv_timer_t timer;
  stream_dialer *dialer;
  pthread_t thread;
  int thread_started, loop_inited, timer_on;
  char addr_text[128];
  struct sockaddr_storage addr;
  uint32_t connect_ms, max_inflight;
  uint64_t max_payload;
  uint8_t token[WIRE_MAX_TOKEN]; /* sent in every HELLO */
  uint32_t token_len;
  uint64_t replica_term;               /* sent in every HELLO */
  char congestion[STREAM_CC_NAME_MAX]; /* "" : the host's default */
  /* Loop thread: the server refused the token (auth_status, auth_err): no
   * connection is tried again, every request fails with that status. */
  int auth_status;
  char auth_err[DP_ERRLEN];
  /* Guarded by mu. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  dp_req *q_head, *q_tail;
  int closing;
  uint32_t settled; /* connects finished (either way) during open */
  char connect_err[DP_ERRLEN];
  int connect_status; /* the status of connect_err */
  /* Loop thread only. */
  int shut;
  /* Requests waiting for a connection: pushes (payload-carrying) apart from
   * the rest, which may overtake them (DPC_UNSENT_MAX). */
  list_node pending, pending_bulk;
  dp_req *table[DPC_BUCKETS];
  uint64_t next_id;
  uint32_t nconns;
  dp_cconn conns[DP_MAX_CONNECTIONS];
  unsigned char *staging;
};

/* ------------------------------------------------------------------------ */
/* Requests (loop thread)                                                   */
/* ------------------------------------------------------------------------ */

static void table_put(dp_client *c, dp_req *r) {
  dp_req **b = &c->table[r->msg.request_id % DPC_BUCKETS];
  r->hnext = *b;
  *b = r;
  r->in_table = 1;
}

static dp_req *table_find(dp_client *c, uint64_t id) {
  for (dp_req *r = c->table[id % DPC_BUCKETS]; r; r = r->hnext)
    if (r->msg.request_id == id)
      return r;
  return NULL;
}

static void table_remove(dp_client *c, dp_req *r) {
  if (!r->in_table)
    return;
  for (dp_req **p = &c->table[r->msg.request_id % DPC_BUCKETS]; *p; p = &(*p)->hnext) {
    if (*p == r) {
      *p = r->hnext;
      break;
    }
  }
  r->in_table = 0;
}

/* Detaches a request from wherever it is (pending list, or its connection's
 * in-flight list and the id table). */
static void req_detach(dp_client *c, dp_req *r) {
  list_remove(&r->node);
  table_remove(c, r);
  if (r->conn) {
    r->conn->ninflight--;
    r->conn->bytes_inflight -= r->nbytes;
    if (r->conn->rx == r)
      r->conn->rx = NULL;
    r->conn = NULL;
  }
}

/* The first waiting request, the others before the pushes; NULL when none
 * waits. */
static dp_req *pending_first(dp_client *c) {
  list_node *l = !list_empty(&c->pending)        ? c->pending.next
                 : !list_empty(&c->pending_bulk) ? c->pending_bulk.next
                                                 : NULL;
  return l ? container_of(l, dp_req, node) : NULL;
}

/* Runs the callback once; frees the request unless libuv still holds its
 * write. The request must be detached. */
static void req_complete_res(dp_req *r, const dp_result *res) {
  r->completed = 1;
  r->cb(r->arg, res);
  if (!r->writing)
    req_free(r);
}

static void req_complete(dp_req *r, int status, int duplicate, uint64_t version, const char *msg) {
  dp_result res = {.status = status,
                   .duplicate = duplicate,
                   .version = version,
                   .message = status == 0 ? "" : (msg && *msg ? msg : zs_strerror(status))};
  req_complete_res(r, &res);
}

/* ------------------------------------------------------------------------ */
/* Connections (loop thread)                                                */
/* ------------------------------------------------------------------------ */

static void dispatch(dp_client *c);
static void timer_update(dp_client *c);

static void settle(dp_client *c) {
  pthread_mutex_lock(&c->mu);
  c->settled++;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void on_conn_closed(stream *st, void *data) {
  (void)st;
  dp_cconn *k = data;
  dp_client *c = k->c;
  k->st = NULL;
  wire_reader_free(&k->rd);
  k->state = C_IDLE;
  /* Requests that waited for a connection get another try. */
  if (!c->shut)
    dispatch(c);
}

/* Takes connection k down: the socket is closed first, so that no caller
 * buffer is read or written once callbacks start running; then every request
 * on it fails with `status` (`victim`, if any, with `victim_status`). */
static void conn_fail(dp_cconn *k, int status, const char *msg, dp_req *victim, int victim_status) {
  dp_client *c = k->c;
  if (k->state == C_CLOSING || k->state == C_IDLE)
    return;
  int was_connecting = connecting(k->state);
  if (k->st) {
    k->state = C_CLOSING;
    stream_close(k->st, on_conn_closed);
  } else {
    /* The connect could not even start: there is no stream to wait for,
     * and no retry from here (conn_start is what failed). */
    k->state = C_IDLE;
    wire_reader_free(&k->rd);
  }
  if (was_connecting) {
    pthread_mutex_lock(&c->mu);
    status_say(c->connect_err, sizeof c->connect_err, "%s", msg);
    c->connect_status = status;
    pthread_mutex_unlock(&c->mu);
    settle(c);
  }
  while (!list_empty(&k->inflight)) {
    dp_req *r = container_of(k->inflight.next, dp_req, node);
    req_detach(c, r);
    req_complete(r, r == victim ? victim_status : status, 0, 0, msg);
  }
  /* If no connection is left to carry them, waiting requests fail too. */
  int viable = 0;
  for (uint32_t i = 0; i < c->nconns; i++)
    if (c->conns[i].state == C_READY || connecting(c->conns[i].state))
      viable = 1;
  if ((!viable && was_connecting) || c->auth_status) {
    dp_req *r;
    while ((r = pending_first(c)) != NULL) {
      req_detach(c, r);
      req_complete(r, c->auth_status ? c->auth_status : ZS_ECONN, 0, 0,
                   c->auth_status ? c->auth_err : msg);
    }
  }
  timer_update(c);
}

static void on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf);
static void on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf);
static void conn_protocol_error(dp_cconn *k, const char *what);

static void on_hello_written(stream_write_req *w, int status) {
  dp_cconn *k = container_of(w, dp_cconn, hello_req);
  if (status < 0 && k->state == C_HELLO) {
    char msg[DP_ERRLEN];
    status_say(msg, sizeof msg, "cannot connect to %s: sending HELLO failed: %s", k->c->addr_text,
               stream_detail(w->s)[0] ? stream_detail(w->s) : zs_strerror(status));
    conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
}

/* The connection is made: it authenticates before it carries anything
 * (docs/PROTOCOL.md, "Authentication"), the HELLO_ACK making it ready. */
static void on_connect(stream *st, void *data, int status) {
  dp_cconn *k = data;
  dp_client *c = k->c;
  if (k->state != C_CONNECTING || st != k->st)
    return; /* failed meanwhile (timeout, shutdown): conn_fail settled it */
  char msg[DP_ERRLEN];
  size_t len = 0;
  if (status == 0) {
    stream_set_option(st, STREAM_OPT_NODELAY, 1);
    /* Checked at open: a refusal now (the allowed list changed since) is
     * the connection's failure, not a silent fall back to the default. */
    if (c->congestion[0])
      status = stream_set_congestion(st, c->congestion);
  }
  if (status == 0)
    status = stream_read_start(st, on_alloc, on_read);
  if (status == 0) {
    wire_msg m = {.type = WIRE_HELLO};
    m.u.hello.token = c->token;
    m.u.hello.token_len = c->token_len;
    m.u.hello.replica_term = c->replica_term;
    status = wire_encode(&m, k->hello, sizeof k->hello, &len);
  }
  if (status == 0) {
    uv_buf_t b = uv_buf_init((char *)k->hello, (unsigned)len);
    k->state = C_HELLO;
    status = stream_write(st, &k->hello_req, &b, 1, on_hello_written);
    if (status != 0)
      k->state = C_CONNECTING;
  }
  if (status != 0) {
    status_say(msg, sizeof msg, "cannot connect to %s: %s", c->addr_text,
               stream_detail(st)[0] ? stream_detail(st) : zs_strerror(status));
    conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
}

/* The answer to the HELLO. Returns 0 (the connection is ready) or -1 (it
 * failed; a refused token fails the client for good: no retry can fix it). */
static int on_hello_answer(dp_cconn *k) {
  dp_client *c = k->c;
  const wire_msg *m = &k->rd.msg;
  char msg[DP_ERRLEN];
  if (m->type == WIRE_HELLO_ACK) {
    wire_reader_set_payload(&k->rd, NULL);
    k->state = C_READY;
    settle(c);
    dispatch(c);
    return 0;
  }
  if (m->type != WIRE_ERROR || k->rd.meta_status != 0) {
    status_say(msg, sizeof msg, "the server answered HELLO with %s", wire_type_name(m->type));
    conn_protocol_error(k, msg);
    return -1;
  }
  if (m->u.error.status == ZS_EUNAUTHENTICATED || m->u.error.status == ZS_EPERM) {
    status_say(c->auth_err, sizeof c->auth_err,
               "%s refused this client's data-plane connection: %s (check the token: "
               "zs_client_options.token, ZSHARD_TOKEN or ZSHARD_TOKEN_FILE)",
               c->addr_text, m->u.error.message);
    c->auth_status = m->u.error.status;
    conn_fail(k, c->auth_status, c->auth_err, NULL, 0);
    return -1;
  }
  /* A server older than frame version 3 refuses the HELLO's version. */
  status_say(msg, sizeof msg, "%s closed the connection at HELLO: %s%s", c->addr_text,
             m->u.error.message,
             m->u.error.status == ZS_EPROTO ? " (a server before data-plane protocol version 3, "
                                              "which has no HELLO: upgrade the server)"
                                            : "");
  conn_fail(k, m->u.error.status, msg, NULL, 0);
  return -1;
}

static void conn_start(dp_cconn *k) {
  dp_client *c = k->c;
  char msg[DP_ERRLEN];
  wire_reader_init(&k->rd, c->max_payload);
  k->rx = NULL;
  k->gen++;
  k->unsent = 0;
  k->state = C_CONNECTING;
  k->connect_deadline_ms = clock_now_ms() + c->connect_ms;
  int rc = stream_dial(c->dialer, on_connect, k, &k->st);
  if (rc != 0) {
    status_say(msg, sizeof msg, "cannot connect to %s: %s", c->addr_text, zs_strerror(rc));
    conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
  timer_update(c);
}

/* ------------------------------------------------------------------------ */
/* Writing (loop thread)                                                    */
/* ------------------------------------------------------------------------ */

static void dispatch(dp_client *c);

static void on_written(stream_write_req *w, int status) {
  dp_req *r = container_of(w, dp_req, wreq);
  r->writing = 0;
  dp_cconn *k = r->wconn;
  int more = 0;
  if (r->unsent && k->gen == r->wgen) {
    /* Room for the pushes held back, if they were. */
    k->unsent -= r->unsent;
    more = k->state == C_READY;
  }
  r->unsent = 0;
  if (r->completed) {
    req_free(r);
    if (more)
      dispatch(k->c);
    return;
  }
  if (status < 0 && r->conn) {
    char msg[DP_ERRLEN];
    status_say(msg, sizeof msg, "writing to %s failed: %s", r->conn->c->addr_text,
               stream_detail(w->s));
    conn_fail(r->conn, ZS_ECONN, msg, NULL, 0);
  }
  if (more && k->state == C_READY)
    dispatch(k->c);
}

static int is_bulk(const dp_req *r) {
  return r->msg.type == WIRE_PUSH || r->msg.type == WIRE_PUSH_BATCH;
}

static void conn_write(dp_cconn *k, dp_req *r) {
  dp_client *c = k->c;
  r->msg.request_id = ++c->next_id;
  size_t hlen = 0;
  uint8_t *head = r->big_head ? r->big_head : r->head;
  size_t cap = r->big_head ? WIRE_MAX_BATCH_ENCODED : sizeof r->head;
  if (wire_encode(&r->msg, head, cap, &hlen) != 0) {
    req_complete(r, ZS_EINTERNAL, 0, 0, "cannot encode the request");
    return;
  }
  r->conn = k;
  k->ninflight++;
  k->bytes_inflight += r->nbytes;
  if (is_bulk(r)) {
    r->wconn = k;
    r->wgen = k->gen;
    r->unsent = r->nbytes;
    k->unsent += r->nbytes;
  }
  list_push(&k->inflight, &r->node);
  table_put(c, r);
  /* One vectored write: the header, then each payload straight from the
   * caller's memory (the array is only read during the call, so it may live
   * on the stack). */
  uv_buf_t bufs[WIRE_MAX_BATCH + 1];
  bufs[0] = uv_buf_init((char *)head, (unsigned)hlen);
  unsigned n = 1;
  if (r->msg.type == WIRE_PUSH && r->nbytes) {
    /* Set directly: uv_buf_init takes an unsigned int length. */
    bufs[1].base = (char *)r->data;
    bufs[1].len = r->nbytes;
    n = 2;
  } else if (r->msg.type == WIRE_PUSH_BATCH) {
    for (uint32_t i = 0; i < r->msg.u.push_batch.npieces; i++) {
      if (r->msg.u.push_batch.pieces[i].length == 0)
        continue; /* no gradient: nothing to send */
      bufs[n].base = (char *)r->piece_data[i];
      bufs[n].len = (size_t)r->msg.u.push_batch.pieces[i].length;
      n++;
    }
  }
  r->writing = 1;
  int rc = stream_write(k->st, &r->wreq, bufs, n, on_written);
  if (rc != 0) {
    r->writing = 0;
    char msg[DP_ERRLEN];
    status_say(msg, sizeof msg, "writing to %s failed: %s", c->addr_text,
               stream_detail(k->st)[0] ? stream_detail(k->st) : zs_strerror(rc));
    conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
}

/* The ready connection with the fewest bytes in flight and room for one more
 * request (for a push: below DPC_UNSENT_MAX unsent bytes), or NULL. */
static dp_cconn *pick(dp_client *c, int bulk) {
  dp_cconn *best = NULL;
  for (uint32_t i = 0; i < c->nconns; i++) {
    dp_cconn *k = &c->conns[i];
    if (k->state != C_READY || k->ninflight >= c->max_inflight ||
        (bulk && k->unsent >= DPC_UNSENT_MAX))
      continue;
    if (!best || k->bytes_inflight < best->bytes_inflight)
      best = k;
  }
  return best;
}

/* The next request that may be written now and its connection: a waiting
 * pull (or ping) first, then the oldest push while a connection has room
 * for it (DPC_UNSENT_MAX). */
static dp_req *sendable(dp_client *c, dp_cconn **k) {
  if (!list_empty(&c->pending) && (*k = pick(c, 0)) != NULL)
    return container_of(c->pending.next, dp_req, node);
  if (!list_empty(&c->pending_bulk) && (*k = pick(c, 1)) != NULL)
    return container_of(c->pending_bulk.next, dp_req, node);
  return NULL;
}

/* Writes waiting requests to connections with room; reconnects idle
 * connections when requests wait. */
static void dispatch(dp_client *c) {
  dp_req *r;
  if (c->auth_status) {
    while ((r = pending_first(c)) != NULL) {
      req_detach(c, r);
      req_complete(r, c->auth_status, 0, 0, c->auth_err);
    }
    timer_update(c);
    return;
  }
  dp_cconn *k = NULL;
  while ((r = sendable(c, &k)) != NULL) {
    list_remove(&r->node);
    conn_write(k, r);
  }
  if (pending_first(c)) {
    for (uint32_t i = 0; i < c->nconns; i++)
      if (c->conns[i].state == C_IDLE)
        conn_start(&c->conns[i]);
  }
  timer_update(c);
}

/* ------------------------------------------------------------------------ */
/* Reading (loop thread)                                                    */
/* ------------------------------------------------------------------------ */

static void on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf) {
  (void)st;
  (void)suggested;
  dp_cconn *k = data;
  size_t len = 0;
  void *p = wire_reader_read_buf(&k->rd, k->c->staging, DPC_STAGING, DPC_DIRECT_MIN, DPC_READ_CHUNK,
                                 &len);
  *buf = uv_buf_init(p, (unsigned)len);
}

/* The server broke the protocol: nothing on this connection can be trusted. */
static void conn_protocol_error(dp_cconn *k, const char *what) {
  char msg[DP_ERRLEN];
  status_say(msg, sizeof msg, "protocol error from %s: %s", k->c->addr_text, what);
  conn_fail(k, ZS_EPROTO, msg, NULL, 0);
}

/* The answer to a batch request r of its own type: a push batch completes
 * with each piece's outcome; a pull batch whose pieces are the ones asked
 * for becomes k->rx, its payload going to r->segs. The answer is untrusted:
 * its piece count and lengths must be the request's, which r->segs add up
 * to. Returns 0, or -1 if the connection failed. */
static int batch_answer(dp_cconn *k, dp_req *r) {
  dp_client *c = k->c;
  const wire_msg *m = &k->rd.msg;
  char msg[DP_ERRLEN];
  if (m->type == WIRE_PUSH_BATCH_ACK) {
    const wire_push_batch_ack *a = &m->u.push_batch_ack;
    req_detach(c, r);
    if (a->npieces != r->msg.u.push_batch.npieces) {
      status_say(msg, sizeof msg,
                 "push batch %" PRIu64 " of %" PRIu32 " pieces answered for %" PRIu32,
                 m->request_id, r->msg.u.push_batch.npieces, a->npieces);
      req_complete(r, ZS_EPROTO, 0, 0, msg);
    } else {
      dp_result res = {.status = 0,
                       .message = a->message,
                       .npieces = a->npieces,
                       .piece_status = a->status,
                       .piece_duplicate = a->duplicate};
      req_complete_res(r, &res);
    }
    return k->state == C_READY ? 0 : -1;
  }
  const wire_pull_batch_data *d = &m->u.pull_batch_data;
  const wire_pull_batch *q = &r->msg.u.pull_batch;
  int ok = d->npieces == q->npieces;
  for (uint32_t i = 0; ok && i < q->npieces; i++)
    ok = d->length[i] == q->pieces[i].length;
  if (!ok) {
    status_say(msg, sizeof msg,
               "pull batch %" PRIu64 " of %" PRIu32 " pieces answered with %" PRIu32
               " pieces or other sizes",
               m->request_id, q->npieces, d->npieces);
    req_detach(c, r);
    req_complete(r, ZS_EPROTO, 0, 0, msg);
    return k->state == C_READY ? 0 : -1;
  }
  k->rx = r;
  return 0;
}

/* Header and meta of an answer are in. Returns 0 to go on, -1 if the
 * connection failed. */
static int on_meta(dp_cconn *k) {
  dp_client *c = k->c;
  wire_reader *rd = &k->rd;
  const wire_msg *m = &rd->msg;
  char msg[DP_ERRLEN];
  void *dst = NULL;
  if (k->state == C_HELLO)
    return on_hello_answer(k);
  if (m->type != WIRE_PUSH_ACK && m->type != WIRE_PULL_DATA && m->type != WIRE_ERROR &&
      m->type != WIRE_PONG && m->type != WIRE_PUSH_BATCH_ACK && m->type != WIRE_PULL_BATCH_DATA) {
    status_say(msg, sizeof msg, "the server sent a %s frame", wire_type_name(m->type));
    conn_protocol_error(k, msg);
    return -1;
  }
  if (m->type == WIRE_ERROR && m->request_id == 0 && rd->meta_status == 0) {
    /* The server gave up on the connection and says why. */
    status_say(msg, sizeof msg, "%s closed the connection: %s", c->addr_text, m->u.error.message);
    conn_fail(k, m->u.error.status, msg, NULL, 0);
    return -1;
  }
  dp_req *r = table_find(c, m->request_id);
  if (r && r->conn != k)
    r = NULL; /* an id this connection never carried */
  if (!r) {
    /* An answer to a request that timed out meanwhile: skipped. */
  } else if (rd->meta_status != 0) {
    req_detach(c, r);
    req_complete(r, rd->meta_status, 0, 0, rd->err);
  } else if ((m->type == WIRE_PUSH_ACK && r->msg.type != WIRE_PUSH) ||
             (m->type == WIRE_PULL_DATA && r->msg.type != WIRE_PULL) ||
             (m->type == WIRE_PONG && r->msg.type != WIRE_PING) ||
             (m->type == WIRE_PUSH_BATCH_ACK && r->msg.type != WIRE_PUSH_BATCH) ||
             (m->type == WIRE_PULL_BATCH_DATA && r->msg.type != WIRE_PULL_BATCH)) {
    status_say(msg, sizeof msg, "request %" PRIu64 " (%s) answered with %s", m->request_id,
               wire_type_name(r->msg.type), wire_type_name(m->type));
    conn_protocol_error(k, msg);
    return -1;
  } else if (m->type == WIRE_ERROR) {
    req_detach(c, r);
    req_complete(r, m->u.error.status, 0, 0, m->u.error.message);
  } else if (m->type == WIRE_PUSH_BATCH_ACK || m->type == WIRE_PULL_BATCH_DATA) {
    if (batch_answer(k, r) != 0)
      return -1;
  } else if (m->type == WIRE_PUSH_ACK || m->type == WIRE_PONG) {
    req_detach(c, r);
    req_complete(r, 0, m->u.push_ack.duplicate && m->type == WIRE_PUSH_ACK, 0, NULL);
  } else if (m->u.pull_data.dtype != (int)r->msg.u.pull.dtype) {
    status_say(msg, sizeof msg, "pull %" PRIu64 " answered in dtype %d, asked for %d",
               m->request_id, m->u.pull_data.dtype, r->msg.u.pull.dtype);
    req_detach(c, r);
    req_complete(r, ZS_EPROTO, 0, 0, msg);
  } else if (m->payload_len != r->nbytes) {
    status_say(msg, sizeof msg,
               "the piece (tensor %" PRIu32 ", slice %" PRIu32 ") has %" PRIu64
               " bytes, the destination %zu",
               r->msg.u.pull.tensor, r->msg.u.pull.slice, m->payload_len, r->nbytes);
    req_detach(c, r);
    req_complete(r, ZS_ESIZE, 0, 0, msg);
  } else {
    k->rx = r;
    dst = r->dst;
  }
  if (k->state != C_READY)
    return -1; /* a callback closed the client's connection */
  if (k->rx && k->rx->segs)
    wire_reader_set_payload_segs(rd, k->rx->segs, k->rx->nsegs);
  else
    wire_reader_set_payload(rd, dst);
  return 0;
}

static void on_done(dp_cconn *k) {
  dp_client *c = k->c;
  dp_req *r = k->rx;
  if (!r)
    return;
  k->rx = NULL;
  req_detach(c, r);
  uint64_t version = k->rd.msg.type == WIRE_PULL_BATCH_DATA ? k->rd.msg.u.pull_batch_data.version
                                                            : k->rd.msg.u.pull_data.version;
  req_complete(r, k->rd.payload_status, 0, version, k->rd.err);
}

static void feed(dp_cconn *k, const unsigned char *p, size_t len) {
  for (;;) {
    wire_event ev;
    size_t n = wire_reader_feed(&k->rd, p, len, &ev);
    p += n;
    len -= n;
    if (ev == WIRE_EV_NONE)
      return;
    if (ev == WIRE_EV_FATAL) {
      conn_protocol_error(k, k->rd.err);
      return;
    }
    if (ev == WIRE_EV_META && on_meta(k) != 0)
      return;
    if (ev == WIRE_EV_DONE)
      on_done(k);
    if (k->state != C_READY)
      return;
  }
}

static void on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf) {
  dp_cconn *k = data;
  dp_client *c = k->c;
  if (nread == 0 || (k->state != C_READY && k->state != C_HELLO))
    return;
  if (nread < 0) {
    char msg[DP_ERRLEN];
    if (nread == STREAM_EOF && wire_reader_eof(&k->rd) != 0)
      status_say(msg, sizeof msg, "%s closed the connection: %s", c->addr_text, k->rd.err);
    else
      status_say(msg, sizeof msg, "connection to %s lost: %s", c->addr_text, stream_detail(st));
    conn_fail(k, ZS_ECONN, msg, NULL, 0);
    return;
  }
  if (buf->base == (char *)c->staging)
    feed(k, c->staging, (size_t)nread);
  else if (wire_reader_commit(&k->rd, (size_t)nread) == WIRE_EV_DONE)
    on_done(k);
}

/* ------------------------------------------------------------------------ */
/* Timeouts, submission, shutdown (loop thread)                             */
/* ------------------------------------------------------------------------ */

static void on_tick(uv_timer_t *t) {
  dp_client *c = t->data;
  uint64_t now = clock_now_ms();
  char msg[DP_ERRLEN];
  for (uint32_t i = 0; i < c->nconns; i++) {
    dp_cconn *k = &c->conns[i];
    if (connecting(k->state) && now >= k->connect_deadline_ms) {
      status_say(msg, sizeof msg, "cannot connect to %s: no answer within %u ms", c->addr_text,
                 c->connect_ms);
      conn_fail(k, ZS_ECONN, msg, NULL, 0);
      continue;
    }
    if (k->state != C_READY)
      continue;
    for (list_node *l = k->inflight.next; l != &k->inflight;) {
      dp_req *r = container_of(l, dp_req, node);
      l = l->next;
      if (now < r->deadline_ms)
        continue;
      status_say(msg, sizeof msg, "%s request to %s timed out after %u ms",
                 wire_type_name(r->msg.type), c->addr_text, r->timeout_ms);
      if (r->writing && is_bulk(r)) {
        /* The socket still reads the caller's buffer: only closing it stops
         * that. The other requests on it fail as a lost connection. */
        conn_fail(k, ZS_ECONN, msg, r, ZS_ETIMEDOUT);
        break;
      }
      if (k->rx == r)
        wire_reader_skip_rest(&k->rd);
      req_detach(c, r);
      req_complete(r, ZS_ETIMEDOUT, 0, 0, msg);
      if (k->state != C_READY)
        break;
    }
  }
  list_node *lists[2] = {&c->pending, &c->pending_bulk};
  for (int i = 0; i < 2; i++) {
    for (list_node *l = lists[i]->next; l != lists[i];) {
      dp_req *r = container_of(l, dp_req, node);
      l = l->next;
      if (now < r->deadline_ms)
        continue;
      status_say(msg, sizeof msg, "%s request to %s timed out after %u ms waiting for a connection",
                 wire_type_name(r->msg.type), c->addr_text, r->timeout_ms);
      req_detach(c, r);
      req_complete(r, ZS_ETIMEDOUT, 0, 0, msg);
    }
  }
  timer_update(c);
}

/* The timer runs only while something can time out. */
static void timer_update(dp_client *c) {
  if (c->shut)
    return;
  int busy = pending_first(c) != NULL;
  for (uint32_t i = 0; i < c->nconns && !busy; i++)
    busy = c->conns[i].ninflight > 0 || connecting(c->conns[i].state);
  if (busy && !c->timer_on) {
    uv_timer_start(&c->timer, on_tick, DPC_TICK_MS, DPC_TICK_MS);
    c->timer_on = 1;
  } else if (!busy && c->timer_on) {
    uv_timer_stop(&c->timer);
    c->timer_on = 0;
  }
}

static void shutdown_loop(dp_client *c) {
  c->shut = 1;
  const char *msg = "the data-plane client was closed";
  for (uint32_t i = 0; i < c->nconns; i++) {
    dp_cconn *k = &c->conns[i];
    if (k->state == C_IDLE || k->state == C_CLOSING)
      continue;
    if (connecting(k->state))
      settle(c);
    k->state = C_CLOSING;
    stream_close(k->st, on_conn_closed);
    while (!list_empty(&k->inflight)) {
      dp_req *r = container_of(k->inflight.next, dp_req, node);
      req_detach(c, r);
      req_complete(r, ZS_ECANCELED, 0, 0, msg);
    }
  }
  dp_req *r;
  while ((r = pending_first(c)) != NULL) {
    req_detach(c, r);
    req_complete(r, ZS_ECANCELED, 0, 0, msg);
  }
  uv_close((uv_handle_t *)&c->timer, NULL);
  uv_close((uv_handle_t *)&c->async, NULL);
}

static void on_async(uv_async_t *h) {
  dp_client *c = h->data;
  if (c->shut)
    return;
  pthread_mutex_lock(&c->mu);
  dp_req *q = c->q_head;
  c->q_head = c->q_tail = NULL;
  int closing = c->closing;
  pthread_mutex_unlock(&c->mu);
  uint64_t now = clock_now_ms();
  while (q) {
    dp_req *r = q;
    q = r->qnext;
    uint64_t t = r->timeout_ms;
    if (r->msg.type == WIRE_PULL)
      t += DPC_PULL_GRACE_MS;
    r->deadline_ms = now + t;
    list_push(is_bulk(r) ? &c->pending_bulk : &c->pending, &r->node);
  }
  if (closing)
    shutdown_loop(c);
  else
    dispatch(c);
}

static void *loop_main(void *arg) {
  dp_client *c = arg;
  uv_run(&c->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Public                                                                   */
/* ------------------------------------------------------------------------ */

static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

static void client_free(dp_client *c) {
  if (c->loop_inited) {
    /* Streams still open (a failed open) go through their layer, which
     * frees them in its own callback; a connection closing meanwhile must
     * not dispatch (and so reconnect) from here. */
    c->shut = 1;
    for (uint32_t i = 0; i < c->nconns; i++) {
      /* Idle first, so that a connect cancelled by the close is ignored. */
      c->conns[i].state = C_IDLE;
      stream_close(c->conns[i].st, NULL);
    }
    uv_walk(&c->loop, close_walk, NULL);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    uv_loop_close(&c->loop);
  }
  for (uint32_t i = 0; i < c->nconns; i++)
    wire_reader_free(&c->conns[i].rd);
  /* Requests submitted after the loop's last look were refused (closing),
   * so the queue is empty here. */
  stream_dialer_free(c->dialer);
  free(c->staging);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

int dp_client_open(const dp_client_config *cfg, dp_client **out, char *err, size_t errlen) {
  if (err && errlen)
    err[0] = '\0';
  if (!cfg || !cfg->addr || !out)
    return status_fail(err, errlen, ZS_EINVAL, "dp_client_open needs an address");
  if (cfg->connections > DP_MAX_CONNECTIONS)
    return status_fail(err, errlen, ZS_EINVAL, "%u connections asked, at most %u", cfg->connections,
                       DP_MAX_CONNECTIONS);
  dp_client *c = calloc(1, sizeof *c);
  if (!c)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  int rc = dp_resolve(cfg->addr, 0, &c->addr, err, errlen);
  if (rc) {
    free(c);
    return rc;
  }
  if (pthread_mutex_init(&c->mu, NULL) != 0) {
    free(c);
    return status_fail(err, errlen, ZS_ENOMEM, "cannot create a mutex");
  }
  if (pthread_cond_init(&c->cv, NULL) != 0) {
    pthread_mutex_destroy(&c->mu);
    free(c);
    return status_fail(err, errlen, ZS_ENOMEM, "cannot create a condition variable");
  }
  status_say(c->addr_text, sizeof c->addr_text, "%s", cfg->addr);
  size_t tlen = cfg->token ? strlen(cfg->token) : 0;
  if (tlen > WIRE_MAX_TOKEN) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    return status_fail(err, errlen, ZS_EINVAL, "the token has %zu bytes, at most %u", tlen,
                       WIRE_MAX_TOKEN);
  }
  if (tlen)
    memcpy(c->token, cfg->token, tlen);
  c->token_len = (uint32_t)tlen;
  c->replica_term = cfg->replica_term;
  if (cfg->congestion && cfg->congestion[0]) {
    rc = stream_cc_check(cfg->congestion, err, errlen);
    if (rc) {
      pthread_cond_destroy(&c->cv);
      pthread_mutex_destroy(&c->mu);
      free(c);
      return rc;
    }
    memcpy(c->congestion, cfg->congestion, strlen(cfg->congestion) + 1);
  }
  c->nconns = cfg->connections ? cfg->connections : 1;
  c->connect_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : DPC_DEFAULT_CONNECT_MS;
  c->max_inflight = cfg->max_inflight ? cfg->max_inflight : DPC_DEFAULT_MAX_INFLIGHT;
  c->max_payload = cfg->max_payload ? cfg->max_payload : WIRE_DEFAULT_MAX_PAYLOAD;
  list_init(&c->pending);
  list_init(&c->pending_bulk);
  for (uint32_t i = 0; i < c->nconns; i++) {
    c->conns[i].c = c;
    c->conns[i].index = (int)i;
    list_init(&c->conns[i].inflight);
  }
  rc = ZS_ENOMEM;
  c->staging = malloc(DPC_STAGING);
  if (!c->staging)
    goto fail;
  rc = ZS_EINTERNAL;
  if (uv_loop_init(&c->loop) != 0)
    goto fail;
  c->loop_inited = 1;
  /* TLS checks the server's certificate for the host dialled (dp_resolve
   * parsed the address already). */
  hostport hp = {.host = ""};
  if (cfg->tls && hostport_parse(cfg->addr, &hp, err, errlen) == 0)
    rc = stream_tls_dialer_new(cfg->tls, &c->loop, (const struct sockaddr *)&c->addr, hp.host,
                               &c->dialer);
  else
    rc = cfg->tls ? ZS_EINVAL
                  : stream_dialer_new(&stream_tcp_ops, &c->loop, (const struct sockaddr *)&c->addr,
                                      &c->dialer);
  if (rc != 0)
    goto fail;
  rc = ZS_EINTERNAL;
  if (uv_async_init(&c->loop, &c->async, on_async) != 0)
    goto fail;
  c->async.data = c;
  uv_timer_init(&c->loop, &c->timer);
  c->timer.data = c;
  /* The connects start here, before the loop thread exists, so that nothing
   * runs concurrently with these calls. */
  for (uint32_t i = 0; i < c->nconns; i++)
    conn_start(&c->conns[i]);
  /* The loop thread writes to the sockets: a write to a peer that went away
   * must fail with EPIPE, not raise SIGPIPE, whose default action would kill
   * the trainer that embeds this library. The thread starts with SIGPIPE
   * blocked (it inherits the mask), so such a signal stays pending on it and
   * never acts; the caller's own mask is restored at once. */
  sigset_t pipe_only, saved;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_only, &saved);
  int started = pthread_create(&c->thread, NULL, loop_main, c) == 0;
  pthread_sigmask(SIG_SETMASK, &saved, NULL);
  if (!started)
    goto fail;
  c->thread_started = 1;
  pthread_mutex_lock(&c->mu);
  while (c->settled < c->nconns)
    pthread_cond_wait(&c->cv, &c->mu);
  char cerr[DP_ERRLEN];
  status_say(cerr, sizeof cerr, "%s", c->connect_err);
  int cstatus = c->connect_status;
  pthread_mutex_unlock(&c->mu);
  /* The loop thread owns the connection states now; a connection counts as
   * made if any is ready, which the loop reports through a ping. A server
   * that refused us says why (a token refused, a limit reached): that
   * status is kept, anything else is a connection that could not be made. */
  rc = dp_client_ping_sync(c, c->connect_ms, err, errlen);
  if (rc != 0) {
    int st = cstatus && cstatus != ZS_ECONN ? cstatus : ZS_ECONN;
    if (cerr[0])
      status_fail(err, errlen, st, "%s", cerr);
    dp_client_close(c);
    return st;
  }
  *out = c;
  return 0;

fail:
  status_fail(err, errlen, rc, "cannot start the data-plane client: %s", zs_strerror(rc));
  if (c->thread_started)
    dp_client_close(c);
  else
    client_free(c);
  return rc;
}

void dp_client_close(dp_client *c) {
  if (!c)
    return;
  if (c->thread_started) {
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    uv_async_send(&c->async);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
  }
  client_free(c);
}

static int submit(dp_client *c, dp_req *r) {
  pthread_mutex_lock(&c->mu);
  if (c->closing) {
    pthread_mutex_unlock(&c->mu);
    req_free(r);
    return ZS_ECLOSED;
  }
  if (c->q_tail)
    c->q_tail->qnext = r;
  else
    c->q_head = r;
  c->q_tail = r;
  uv_async_send(&c->async);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static dp_req *req_new(dp_done_cb cb, void *arg, uint32_t timeout_ms) {
  dp_req *r = calloc(1, sizeof *r);
  if (!r)
    return NULL;
  r->cb = cb;
  r->arg = arg;
  r->timeout_ms = timeout_ms ? timeout_ms : DP_DEFAULT_TIMEOUT_MS;
  return r;
}

int dp_client_push(dp_client *c, const dp_push_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || (!a->data && a->nbytes) || !dtype_valid((int)a->dtype) ||
      a->nbytes > c->max_payload)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PUSH;
  r->msg.u.push = (wire_push){.spec_hash = a->spec_hash,
                              .step = a->step,
                              .rank = a->rank,
                              .micro = a->micro,
                              .tensor = a->tensor,
                              .slice = a->slice,
                              .dtype = (int)a->dtype};
  r->msg.payload_len = a->nbytes;
  /* On the submitting thread: the loop thread has the socket to serve. */
  r->msg.payload_crc = a->nbytes ? crc32c(0, a->data, a->nbytes) : 0;
  r->data = a->data;
  r->nbytes = a->nbytes;
  return submit(c, r);
}

int dp_client_pull(dp_client *c, const dp_pull_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || !a->dst || a->nbytes == 0 || !dtype_valid((int)a->dtype) ||
      a->nbytes > c->max_payload)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PULL;
  r->msg.u.pull = (wire_pull){.spec_hash = a->spec_hash,
                              .min_version = a->min_version,
                              .tensor = a->tensor,
                              .slice = a->slice,
                              .timeout_ms = r->timeout_ms,
                              .dtype = (int)a->dtype};
  r->dst = a->dst;
  r->nbytes = a->nbytes;
  return submit(c, r);
}

/* Checks a batch's pieces and copies them into r (type, pieces, total
 * size). Returns 0 or ZS_EINVAL / ZS_ENOMEM (r is then still the caller's). */
static int batch_prepare(dp_client *c, dp_req *r, wire_type type, const dp_batch_piece *pieces,
                         uint32_t n) {
  if (!pieces || n == 0 || n > WIRE_MAX_BATCH)
    return ZS_EINVAL;
  r->big_head = malloc(WIRE_MAX_BATCH_ENCODED);
  r->pieces = calloc(n, sizeof *r->pieces);
  if (!r->big_head || !r->pieces)
    return ZS_ENOMEM;
  wire_piece *out = r->pieces;
  size_t total = 0;
  for (uint32_t i = 0; i < n; i++) {
    const dp_batch_piece *p = &pieces[i];
    /* A push piece may be empty (no gradient, data NULL); a pull piece
     * never is. */
    if (!dtype_valid((int)p->dtype) || (p->nbytes == 0 && type != WIRE_PUSH_BATCH) ||
        p->nbytes > c->max_payload - total || (type == WIRE_PUSH_BATCH && p->nbytes && !p->data))
      return ZS_EINVAL;
    total += p->nbytes;
    out[i].tensor = p->tensor;
    out[i].slice = p->slice;
    out[i].dtype = (int)p->dtype;
    out[i].length = p->nbytes;
  }
  r->msg.type = type;
  r->nbytes = total;
  return 0;
}

int dp_client_push_batch(dp_client *c, const dp_push_batch_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  int rc = batch_prepare(c, r, WIRE_PUSH_BATCH, a->pieces, a->npieces);
  if (rc == 0 && !(r->piece_data = malloc(a->npieces * sizeof *r->piece_data)))
    rc = ZS_ENOMEM;
  if (rc != 0) {
    req_free(r);
    return rc;
  }
  wire_push_batch *b = &r->msg.u.push_batch;
  b->spec_hash = a->spec_hash;
  b->step = a->step;
  b->rank = a->rank;
  b->micro = a->micro;
  b->npieces = a->npieces;
  b->pieces = r->pieces;
  /* On the submitting thread, over the pieces in payload order. */
  uint32_t crc = 0;
  for (uint32_t i = 0; i < a->npieces; i++) {
    r->piece_data[i] = a->pieces[i].data;
    if (a->pieces[i].nbytes)
      crc = crc32c(crc, a->pieces[i].data, a->pieces[i].nbytes);
  }
  r->msg.payload_len = r->nbytes;
  r->msg.payload_crc = crc;
  return submit(c, r);
}

/* A pull batch's destinations as the reader's segments: a->dsts[i] for
 * piece i, or a->dst for them all. Returns 0 or ZS_EINVAL / ZS_ENOMEM. */
static int batch_segs(dp_req *r, const dp_pull_batch_args *a) {
  uint32_t n = a->dsts ? a->npieces : 1;
  if (!(r->segs = malloc(n * sizeof *r->segs)))
    return ZS_ENOMEM;
  r->nsegs = n;
  if (!a->dsts) {
    r->segs[0] = (wire_seg){.base = a->dst, .len = r->nbytes};
    return 0;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (!a->dsts[i])
      return ZS_EINVAL;
    r->segs[i] = (wire_seg){.base = a->dsts[i], .len = a->pieces[i].nbytes};
  }
  return 0;
}

int dp_client_pull_batch(dp_client *c, const dp_pull_batch_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || !a->dst == !a->dsts)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  int rc = batch_prepare(c, r, WIRE_PULL_BATCH, a->pieces, a->npieces);
  if (rc == 0)
    rc = batch_segs(r, a);
  if (rc != 0) {
    req_free(r);
    return rc;
  }
  wire_pull_batch *b = &r->msg.u.pull_batch;
  b->spec_hash = a->spec_hash;
  b->min_version = a->min_version;
  b->timeout_ms = r->timeout_ms;
  b->npieces = a->npieces;
  b->pieces = r->pieces;
  r->dst = a->dst;
  return submit(c, r);
}

int dp_client_ping(dp_client *c, uint32_t timeout_ms, dp_done_cb cb, void *arg) {
  if (!c || !cb)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PING;
  return submit(c, r);
}

/* ------------------------------------------------------------------------ */
/* Blocking wrappers                                                        */
/* ------------------------------------------------------------------------ */

typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  dp_result res;
  char msg[DP_ERRLEN];
} waiter;

static void waiter_init(waiter *w) {
  memset(w, 0, sizeof *w);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
}

static void on_sync_done(void *arg, const dp_result *r) {
  waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->res = *r;
  status_say(w->msg, sizeof w->msg, "%s", r->message);
  w->res.message = w->msg;
  w->done = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Waits for the callback of a submitted request (rc 0), or passes the
 * submission error through. */
static int waiter_finish(waiter *w, int rc, char *err, size_t errlen) {
  if (rc == 0) {
    pthread_mutex_lock(&w->mu);
    while (!w->done)
      pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    rc = status_fail(err, errlen, w->res.status, "%s", w->msg);
  } else {
    status_fail(err, errlen, rc, "%s", zs_strerror(rc));
  }
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  return rc;
}

int dp_client_push_sync(dp_client *c, const dp_push_args *a, int *duplicate, char *err,
                        size_t errlen) {
  waiter w;
  waiter_init(&w);
  int rc = waiter_finish(&w, dp_client_push(c, a, on_sync_done, &w), err, errlen);
  if (duplicate)
    *duplicate = rc == 0 && w.res.duplicate;
  return rc;
}

int dp_client_pull_sync(dp_client *c, const dp_pull_args *a, uint64_t *version, char *err,
                        size_t errlen) {
  waiter w;
  waiter_init(&w);
  int rc = waiter_finish(&w, dp_client_pull(c, a, on_sync_done, &w), err, errlen);
  if (version)
    *version = rc == 0 ? w.res.version : 0;
  return rc;
}

int dp_client_ping_sync(dp_client *c, uint32_t timeout_ms, char *err, size_t errlen) {
  waiter w;
  waiter_init(&w);
  return waiter_finish(&w, dp_client_ping(c, timeout_ms, on_sync_done, &w), err, errlen);
}
