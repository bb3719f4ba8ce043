/*
 * dp_client_write — requests onto connections (loop thread): which
 * connection takes the next request (pushes apart from the rest, bounded by
 * DPC_UNSENT_MAX), and writing a request's header and payload with one
 * writev.
 */
#include "common/net/dp_client_internal.h"

#include <uv.h>

#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

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
    dpc__req_free(r);
    if (more)
      dpc__dispatch(k->c);
    return;
  }
  if (status < 0 && r->conn) {
    char msg[DP_ERRLEN];
    status_say(msg, sizeof msg, "writing to %s failed: %s", r->conn->c->addr_text,
               stream_detail(w->s));
    dpc__conn_fail(r->conn, ZS_ECONN, msg, NULL, 0);
  }
  if (more && k->state == C_READY)
    dpc__dispatch(k->c);
}

int dpc__is_bulk(const dp_req *r) {
  return r->msg.type == WIRE_PUSH || r->msg.type == WIRE_PUSH_BATCH;
}

static void conn_write(dp_cconn *k, dp_req *r) {
  dp_client *c = k->c;
  r->msg.request_id = ++c->next_id;
  size_t hlen = 0;
  uint8_t *head = r->big_head ? r->big_head : r->head;
  size_t cap = r->big_head ? WIRE_MAX_BATCH_ENCODED : sizeof r->head;
  if (wire_encode(&r->msg, head, cap, &hlen) != 0) {
    dpc__req_complete(r, ZS_EINTERNAL, 0, 0, "cannot encode the request");
    return;
  }
  r->conn = k;
  k->ninflight++;
  k->bytes_inflight += r->nbytes;
  if (dpc__is_bulk(r)) {
    r->wconn = k;
    r->wgen = k->gen;
    r->unsent = r->nbytes;
    k->unsent += r->nbytes;
  }
  list_push(&k->inflight, &r->node);
  dpc__table_put(c, r);
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
    dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
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
void dpc__dispatch(dp_client *c) {
  dp_req *r;
  if (c->auth_status) {
    while ((r = dpc__pending_first(c)) != NULL) {
      dpc__req_detach(c, r);
      dpc__req_complete(r, c->auth_status, 0, 0, c->auth_err);
    }
    dpc__timer_update(c);
    return;
  }
  dp_cconn *k = NULL;
  while ((r = sendable(c, &k)) != NULL) {
    list_remove(&r->node);
    conn_write(k, r);
  }
  if (dpc__pending_first(c)) {
    for (uint32_t i = 0; i < c->nconns; i++)
      if (c->conns[i].state == C_IDLE)
        dpc__conn_start(&c->conns[i]);
  }
  dpc__timer_update(c);
}
