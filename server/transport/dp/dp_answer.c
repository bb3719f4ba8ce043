/*
 * dp_answer — answers going out: framing and queueing them on the stream
 * (one writev each), the copied-answer budgets of a connection, its peer
 * address and the server, the pinned answers the pin timer watches, and the
 * produce window that turns ready Pulls into answers just in time for the
 * socket. Loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <stdlib.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/trace.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

/* Copied answer bytes leave the budgets; connections whose next answer
 * waited for the server's or their address's budget get their turn, oldest
 * first. */
void dp__budget_release(dp_conn *c, uint64_t n) {
  dp_server *s = c->s;
  if (n == 0)
    return;
  c->answer_bytes -= n;
  c->pe->answer_bytes -= n;
  s->answer_bytes -= n;
  dp__count(&s->st_answer_bytes, -(int64_t)n);
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
    dp__conn_produce(w);
  }
  s->releasing = 0;
}

static void pinned_done(dp_conn *c) {
  dp_server *s = c->s;
  c->pinned_out--;
  s->npinned--;
  dp__count(&s->st_pinned, -1);
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
  dp__pool_put(s, o->payload);
  dp__budget_release(c, o->budget);
  int close_after = o->close_after;
  free(o);
  if (status < 0 || close_after) {
    dp__conn_close(c);
  } else {
    dp__conn_check(c);
    dp__conn_produce(c);
  }
  dp__conn_unref(c);
}

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
void dp__conn_send_budget(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer, int close_after,
                          uint64_t budget) {
  dp_server *s = c->s;
  if (c->closing) {
    dp__pool_put(s, payload);
    dp__budget_release(c, budget);
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
    dp__pool_put(s, payload);
    dp__budget_release(c, budget);
    if (is_answer)
      c->pending--;
    dp__conn_close(c);
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
  dp__conn_ref(c);
  c->queued += o->bytes;
  int rc = stream_write(c->st, &o->req, bufs, nbufs, on_written);
  if (rc < 0) {
    c->queued -= o->bytes;
    if (is_answer)
      c->pending--;
    dp__pool_put(s, payload);
    dp__budget_release(c, budget);
    free(o);
    dp__conn_close(c);
    dp__conn_unref(c);
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
    dp__count(&s->st_pinned, 1);
    dp__pin_timer_update(s);
  }
  dp__count(&s->st_frames_out, 1);
  dp__count(&s->st_bytes_out, (int64_t)o->bytes);
  dp__conn_check(c);
}

void dp__conn_send(dp_conn *c, wire_msg *m, dp_buf *payload, int is_answer, int close_after) {
  dp__conn_send_budget(c, m, payload, is_answer, close_after, 0);
}

void dp__answer_error(dp_conn *c, uint64_t id, int status, const char *msg) {
  wire_msg m = {.type = WIRE_ERROR, .request_id = id};
  m.u.error.status = status;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s",
             msg && *msg ? msg : zs_strerror(status));
  dp__count(&c->s->st_req_errors, 1);
  dp__conn_send(c, &m, NULL, 1, 0);
}

/* The stream broke: say why (request id 0), stop reading, close once the
 * frame is out. */
void dp__conn_fatal(dp_conn *c, int status, const char *msg) {
  dp_server *s = c->s;
  dp__count(&s->st_proto_errors, 1);
  if (status == ZS_ECRC)
    dp__count(&s->st_crc_errors, 1);
  LOG_WARN("dp_protocol_error", "peer=%s status=%s detail=\"%s\"", c->peer, zs_err_name(status),
           msg);
  c->fatal = 1;
  dp__conn_set_mid(c, 0);
  dp__conn_update_reading(c);
  wire_msg m = {.type = WIRE_ERROR, .request_id = 0};
  m.u.error.status = status;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s", msg);
  dp__conn_send(c, &m, NULL, 0, 1);
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
    b = dp__pool_get(s, p->nbytes);
  }
  if (!b) {
    free(w);
    dp__answer_error(c, p->request_id, ZS_ENOMEM, "out of memory for the answer buffer");
    return;
  }
  if (!pin) {
    w->budget = p->nbytes;
    c->answer_bytes += p->nbytes;
    c->pe->answer_bytes += p->nbytes;
    s->answer_bytes += p->nbytes;
    dp__count(&s->st_answer_bytes, (int64_t)p->nbytes);
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
  dp__work_start(w);
}

/* Produces answers for ready Pulls while the connection's window has room.
 * Called whenever a Pull becomes ready or answer bytes leave the window. */
void dp__conn_produce(dp_conn *c) {
  dp_server *s = c->s;
  while (c->ready_head && !c->closing) {
    uint64_t busy = c->producing + c->queued;
    if (busy > 0 && busy >= DP_PRODUCE_WINDOW)
      return;
    dp_pull *p = c->ready_head;
    int pin = pull_can_pin(c, p);
    /* A copy waits for room in the connection's budget (its own answers
     * make it: on_written calls here again), in its peer address's share
     * and in the server's (any connection's answers make it: dp__budget_release
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
    dp__pull_free(p);
    dp__conn_unref(c); /* the record's reference; the work holds its own */
  }
}

/* A Pull whose version is there joins its connection's queue of answers to
 * make; the record keeps its reference to the connection. */
void dp__pull_ready(dp_conn *c, dp_pull *p) {
  trace_ev(TRACE_PULL_GO, p->min_version, p->tensor, p->slice, p->pieces ? p->npieces : 1);
  p->next = NULL;
  if (c->ready_tail)
    c->ready_tail->next = p;
  else
    c->ready_head = p;
  c->ready_tail = p;
  dp__conn_produce(c);
}
