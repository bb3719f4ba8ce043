/*
 * dp_client_conn — the client's connections to one shard (loop thread):
 * connecting, the HELLO and its answer, and failing a connection with the
 * requests it carries.
 */
#include "common/net/dp_client_internal.h"

#include <pthread.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

void dpc__settle(dp_client *c) {
  pthread_mutex_lock(&c->mu);
  c->settled++;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

void dpc__on_conn_closed(stream *st, void *data) {
  (void)st;
  dp_cconn *k = data;
  dp_client *c = k->c;
  k->st = NULL;
  wire_reader_free(&k->rd);
  k->state = C_IDLE;
  /* Requests that waited for a connection get another try. */
  if (!c->shut)
    dpc__dispatch(c);
}

/* Takes connection k down: the socket is closed first, so that no caller
 * buffer is read or written once callbacks start running; then every request
 * on it fails with `status` (`victim`, if any, with `victim_status`). */
void dpc__conn_fail(dp_cconn *k, int status, const char *msg, dp_req *victim, int victim_status) {
  dp_client *c = k->c;
  if (k->state == C_CLOSING || k->state == C_IDLE)
    return;
  int was_connecting = dpc__connecting(k->state);
  if (k->st) {
    k->state = C_CLOSING;
    stream_close(k->st, dpc__on_conn_closed);
  } else {
    /* The connect could not even start: there is no stream to wait for,
     * and no retry from here (dpc__conn_start is what failed). */
    k->state = C_IDLE;
    wire_reader_free(&k->rd);
  }
  if (was_connecting) {
    pthread_mutex_lock(&c->mu);
    status_say(c->connect_err, sizeof c->connect_err, "%s", msg);
    c->connect_status = status;
    pthread_mutex_unlock(&c->mu);
    dpc__settle(c);
  }
  while (!list_empty(&k->inflight)) {
    dp_req *r = container_of(k->inflight.next, dp_req, node);
    dpc__req_detach(c, r);
    dpc__req_complete(r, r == victim ? victim_status : status, 0, 0, msg);
  }
  /* If no connection is left to carry them, waiting requests fail too. */
  int viable = 0;
  for (uint32_t i = 0; i < c->nconns; i++)
    if (c->conns[i].state == C_READY || dpc__connecting(c->conns[i].state))
      viable = 1;
  if ((!viable && was_connecting) || c->auth_status) {
    dp_req *r;
    while ((r = dpc__pending_first(c)) != NULL) {
      dpc__req_detach(c, r);
      dpc__req_complete(r, c->auth_status ? c->auth_status : ZS_ECONN, 0, 0,
                        c->auth_status ? c->auth_err : msg);
    }
  }
  dpc__timer_update(c);
}

static void on_hello_written(stream_write_req *w, int status) {
  dp_cconn *k = container_of(w, dp_cconn, hello_req);
  if (status < 0 && k->state == C_HELLO) {
    char msg[DP_ERRLEN];
    status_say(msg, sizeof msg, "cannot connect to %s: sending HELLO failed: %s", k->c->addr_text,
               stream_detail(w->s)[0] ? stream_detail(w->s) : zs_strerror(status));
    dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
}

/* The connection is made: it authenticates before it carries anything
 * (docs/PROTOCOL.md, "Authentication"), the HELLO_ACK making it ready. */
static void on_connect(stream *st, void *data, int status) {
  dp_cconn *k = data;
  dp_client *c = k->c;
  if (k->state != C_CONNECTING || st != k->st)
    return; /* failed meanwhile (timeout, shutdown): dpc__conn_fail settled it */
  char msg[DP_ERRLEN];
  size_t len = 0;
  if (status == 0) {
    stream_set_option(st, STREAM_OPT_NODELAY, 1);
    /* Checked at open: a refusal now (the allowed list changed since) is
     * the connection's failure, not a silent fall back to the default. */
    if (c->congestion[0])
      status = stream_set_congestion(st, c->congestion);
    if (status == 0 && c->pacing_mbit)
      status = stream_set_pacing(st, c->pacing_mbit);
    if (status == 0 && c->pacer)
      status = stream_pacer_join(st, c->pacer);
  }
  if (status == 0)
    status = stream_read_start(st, dpc__on_alloc, dpc__on_read);
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
    dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
}

/* The answer to the HELLO. Returns 0 (the connection is ready) or -1 (it
 * failed; a refused token fails the client for good: no retry can fix it). */
int dpc__on_hello_answer(dp_cconn *k) {
  dp_client *c = k->c;
  const wire_msg *m = &k->rd.msg;
  char msg[DP_ERRLEN];
  if (m->type == WIRE_HELLO_ACK) {
    wire_reader_set_payload(&k->rd, NULL);
    k->state = C_READY;
    dpc__settle(c);
    dpc__dispatch(c);
    return 0;
  }
  if (m->type != WIRE_ERROR || k->rd.meta_status != 0) {
    status_say(msg, sizeof msg, "the server answered HELLO with %s", wire_type_name(m->type));
    dpc__conn_protocol_error(k, msg);
    return -1;
  }
  if (m->u.error.status == ZS_EUNAUTHENTICATED || m->u.error.status == ZS_EPERM) {
    status_say(c->auth_err, sizeof c->auth_err,
               "%s refused this client's data-plane connection: %s (check the token: "
               "zs_client_options.token, ZSHARD_TOKEN or ZSHARD_TOKEN_FILE)",
               c->addr_text, m->u.error.message);
    c->auth_status = m->u.error.status;
    dpc__conn_fail(k, c->auth_status, c->auth_err, NULL, 0);
    return -1;
  }
  /* A server older than frame version 3 refuses the HELLO's version. */
  status_say(msg, sizeof msg, "%s closed the connection at HELLO: %s%s", c->addr_text,
             m->u.error.message,
             m->u.error.status == ZS_EPROTO ? " (a server before data-plane protocol version 3, "
                                              "which has no HELLO: upgrade the server)"
                                            : "");
  dpc__conn_fail(k, m->u.error.status, msg, NULL, 0);
  return -1;
}

void dpc__conn_start(dp_cconn *k) {
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
    dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
  }
  dpc__timer_update(c);
}
