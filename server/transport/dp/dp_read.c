/*
 * dp_read — bytes off the socket into the frame reader: where each read
 * goes (the staging buffer, or straight into a push's payload buffer), the
 * reader's events handed to dp_request.c, end of stream, and the per
 * iteration read budget that keeps one fast peer from starving the others.
 * Loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

void dp__on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf) {
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
      dp__on_meta(c);
      break;
    case WIRE_EV_DONE:
      dp__on_done(c);
      break;
    case WIRE_EV_FATAL:
      if (!c->fatal)
        dp__conn_fatal(c, c->rd.status, c->rd.err);
      return;
    }
    if (c->closing || c->fatal)
      return;
  }
}

void dp__on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf) {
  dp_conn *c = data;
  dp_server *s = c->s;
  if (nread == 0 || c->closing)
    return;
  if (nread < 0) {
    if (nread == STREAM_EOF && !wire_reader_mid_frame(&c->rd)) {
      /* The peer is done sending; it still gets its answers. */
      c->eof = 1;
      dp__conn_update_reading(c);
      dp__conn_check(c);
      return;
    }
    if (nread == STREAM_EOF) {
      wire_reader_eof(&c->rd);
      dp__count(&s->st_proto_errors, 1);
      LOG_INFO("dp_disconnect", "peer=%s detail=\"%s\"", c->peer, c->rd.err);
    } else {
      LOG_INFO("dp_disconnect", "peer=%s detail=\"%s\"", c->peer, stream_detail(st));
    }
    dp__conn_close(c);
    return;
  }
  dp__count(&s->st_bytes_in, nread);
  c->last_progress_ms = clock_now_ms();
  if (buf->base == (char *)s->staging) {
    feed(c, s->staging, (size_t)nread);
  } else if (wire_reader_commit(&c->rd, (size_t)nread) == WIRE_EV_DONE) {
    dp__on_done(c);
  }
  if (c->closing)
    return;
  dp__conn_set_mid(c, wire_reader_mid_frame(&c->rd) && !c->fatal);
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
    dp__conn_update_reading(c);
  }
}

void dp__on_check(uv_check_t *h) {
  dp_server *s = h->data;
  s->iter++;
  while (!list_empty(&s->fair)) {
    dp_conn *c = container_of(s->fair.next, dp_conn, fair);
    list_remove(&c->fair);
    c->pause &= ~PAUSE_FAIR;
    dp__conn_update_reading(c);
  }
}
