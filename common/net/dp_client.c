/*
 * dp_client — the data plane's client (see dp_client.h): address
 * resolution, opening the client (its settings, the handles, the first
 * connects, the loop thread), the loop's wake-up door, and closing it.
 *
 * The rest is one file per concern, sharing the types and the dpc__
 * functions of dp_client_internal.h:
 *  - dp_client_request.c  building, submitting and completing requests;
 *  - dp_client_conn.c     connecting, HELLO, failing a connection;
 *  - dp_client_write.c    requests onto connections, one writev each;
 *  - dp_client_read.c     answers off the socket, protocol errors;
 *  - dp_client_timer.c    connect deadlines and request timeouts;
 *  - dp_client_sync.c     the blocking wrappers.
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
 * batch's: each piece's own), handed out by dpc__on_alloc, except the bytes read
 * into the staging buffer and copied once from it: those that arrive in the
 * same read as their header, and those read while less than DPC_DIRECT_MIN
 * bytes of the current destination (a batch piece) are awaited, which one
 * read takes many of at once.
 */
#include "common/net/dp_client.h"
#include "common/net/dp_client_internal.h"

#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/hostport.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

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

static void shutdown_loop(dp_client *c) {
  c->shut = 1;
  const char *msg = "the data-plane client was closed";
  for (uint32_t i = 0; i < c->nconns; i++) {
    dp_cconn *k = &c->conns[i];
    if (k->state == C_IDLE || k->state == C_CLOSING)
      continue;
    if (dpc__connecting(k->state))
      dpc__settle(c);
    k->state = C_CLOSING;
    stream_close(k->st, dpc__on_conn_closed);
    while (!list_empty(&k->inflight)) {
      dp_req *r = container_of(k->inflight.next, dp_req, node);
      dpc__req_detach(c, r);
      dpc__req_complete(r, ZS_ECANCELED, 0, 0, msg);
    }
  }
  dp_req *r;
  while ((r = dpc__pending_first(c)) != NULL) {
    dpc__req_detach(c, r);
    dpc__req_complete(r, ZS_ECANCELED, 0, 0, msg);
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
    list_push(dpc__is_bulk(r) ? &c->pending_bulk : &c->pending, &r->node);
  }
  if (closing)
    shutdown_loop(c);
  else
    dpc__dispatch(c);
}

static void *loop_main(void *arg) {
  dp_client *c = arg;
  uv_run(&c->loop, UV_RUN_DEFAULT);
  return NULL;
}

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
  if (cfg->pacing_mbit > STREAM_PACING_MBIT_MAX) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    return status_fail(err, errlen, ZS_EINVAL, "pacing of %u Mbit/s: at most %u", cfg->pacing_mbit,
                       STREAM_PACING_MBIT_MAX);
  }
  c->pacing_mbit = cfg->pacing_mbit;
  c->pacer = cfg->pacer;
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
    dpc__conn_start(&c->conns[i]);
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
