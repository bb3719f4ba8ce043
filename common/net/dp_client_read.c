/*
 * dp_client_read — answers off the socket (loop thread): where each read
 * goes (the staging buffer, or straight into the caller's destination),
 * matching an answer to its request, a batch's answer, and a server that
 * breaks the protocol.
 */
#include "common/net/dp_client_internal.h"

#include <inttypes.h>
#include <uv.h>

#include "common/base/status.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

void dpc__on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf) {
  (void)st;
  (void)suggested;
  dp_cconn *k = data;
  size_t len = 0;
  void *p = wire_reader_read_buf(&k->rd, k->c->staging, DPC_STAGING, DPC_DIRECT_MIN, DPC_READ_CHUNK,
                                 &len);
  *buf = uv_buf_init(p, (unsigned)len);
}

/* The server broke the protocol: nothing on this connection can be trusted. */
void dpc__conn_protocol_error(dp_cconn *k, const char *what) {
  char msg[DP_ERRLEN];
  status_say(msg, sizeof msg, "protocol error from %s: %s", k->c->addr_text, what);
  dpc__conn_fail(k, ZS_EPROTO, msg, NULL, 0);
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
    dpc__req_detach(c, r);
    if (a->npieces != r->msg.u.push_batch.npieces) {
      status_say(msg, sizeof msg,
                 "push batch %" PRIu64 " of %" PRIu32 " pieces answered for %" PRIu32,
                 m->request_id, r->msg.u.push_batch.npieces, a->npieces);
      dpc__req_complete(r, ZS_EPROTO, 0, 0, msg);
    } else {
      dp_result res = {.status = 0,
                       .message = a->message,
                       .npieces = a->npieces,
                       .piece_status = a->status,
                       .piece_duplicate = a->duplicate};
      dpc__req_complete_res(r, &res);
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
    dpc__req_detach(c, r);
    dpc__req_complete(r, ZS_EPROTO, 0, 0, msg);
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
    return dpc__on_hello_answer(k);
  if (m->type != WIRE_PUSH_ACK && m->type != WIRE_PULL_DATA && m->type != WIRE_ERROR &&
      m->type != WIRE_PONG && m->type != WIRE_PUSH_BATCH_ACK && m->type != WIRE_PULL_BATCH_DATA) {
    status_say(msg, sizeof msg, "the server sent a %s frame", wire_type_name(m->type));
    dpc__conn_protocol_error(k, msg);
    return -1;
  }
  if (m->type == WIRE_ERROR && m->request_id == 0 && rd->meta_status == 0) {
    /* The server gave up on the connection and says why. */
    status_say(msg, sizeof msg, "%s closed the connection: %s", c->addr_text, m->u.error.message);
    dpc__conn_fail(k, m->u.error.status, msg, NULL, 0);
    return -1;
  }
  dp_req *r = dpc__table_find(c, m->request_id);
  if (r && r->conn != k)
    r = NULL; /* an id this connection never carried */
  if (!r) {
    /* An answer to a request that timed out meanwhile: skipped. */
  } else if (rd->meta_status != 0) {
    dpc__req_detach(c, r);
    dpc__req_complete(r, rd->meta_status, 0, 0, rd->err);
  } else if ((m->type == WIRE_PUSH_ACK && r->msg.type != WIRE_PUSH) ||
             (m->type == WIRE_PULL_DATA && r->msg.type != WIRE_PULL) ||
             (m->type == WIRE_PONG && r->msg.type != WIRE_PING) ||
             (m->type == WIRE_PUSH_BATCH_ACK && r->msg.type != WIRE_PUSH_BATCH) ||
             (m->type == WIRE_PULL_BATCH_DATA && r->msg.type != WIRE_PULL_BATCH)) {
    status_say(msg, sizeof msg, "request %" PRIu64 " (%s) answered with %s", m->request_id,
               wire_type_name(r->msg.type), wire_type_name(m->type));
    dpc__conn_protocol_error(k, msg);
    return -1;
  } else if (m->type == WIRE_ERROR) {
    dpc__req_detach(c, r);
    dpc__req_complete(r, m->u.error.status, 0, 0, m->u.error.message);
  } else if (m->type == WIRE_PUSH_BATCH_ACK || m->type == WIRE_PULL_BATCH_DATA) {
    if (batch_answer(k, r) != 0)
      return -1;
  } else if (m->type == WIRE_PUSH_ACK || m->type == WIRE_PONG) {
    dpc__req_detach(c, r);
    dpc__req_complete(r, 0, m->u.push_ack.duplicate && m->type == WIRE_PUSH_ACK, 0, NULL);
  } else if (m->u.pull_data.dtype != (int)r->msg.u.pull.dtype) {
    status_say(msg, sizeof msg, "pull %" PRIu64 " answered in dtype %d, asked for %d",
               m->request_id, m->u.pull_data.dtype, r->msg.u.pull.dtype);
    dpc__req_detach(c, r);
    dpc__req_complete(r, ZS_EPROTO, 0, 0, msg);
  } else if (m->payload_len != r->nbytes) {
    status_say(msg, sizeof msg,
               "the piece (tensor %" PRIu32 ", slice %" PRIu32 ") has %" PRIu64
               " bytes, the destination %zu",
               r->msg.u.pull.tensor, r->msg.u.pull.slice, m->payload_len, r->nbytes);
    dpc__req_detach(c, r);
    dpc__req_complete(r, ZS_ESIZE, 0, 0, msg);
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
  dpc__req_detach(c, r);
  uint64_t version = k->rd.msg.type == WIRE_PULL_BATCH_DATA ? k->rd.msg.u.pull_batch_data.version
                                                            : k->rd.msg.u.pull_data.version;
  dpc__req_complete(r, k->rd.payload_status, 0, version, k->rd.err);
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
      dpc__conn_protocol_error(k, k->rd.err);
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

void dpc__on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf) {
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
    dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
    return;
  }
  if (buf->base == (char *)c->staging)
    feed(k, c->staging, (size_t)nread);
  else if (wire_reader_commit(&k->rd, (size_t)nread) == WIRE_EV_DONE)
    on_done(k);
}
