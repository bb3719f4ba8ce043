/*
 * dp_client_timer — the client's timer (loop thread): connect deadlines,
 * request timeouts and reconnecting idle connections; it runs only while
 * something can time out.
 */
#include "common/net/dp_client_internal.h"

#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/wire.h"

static void on_tick(uv_timer_t *t) {
  dp_client *c = t->data;
  uint64_t now = clock_now_ms();
  char msg[DP_ERRLEN];
  for (uint32_t i = 0; i < c->nconns; i++) {
    dp_cconn *k = &c->conns[i];
    if (dpc__connecting(k->state) && now >= k->connect_deadline_ms) {
      status_say(msg, sizeof msg, "cannot connect to %s: no answer within %u ms", c->addr_text,
                 c->connect_ms);
      dpc__conn_fail(k, ZS_ECONN, msg, NULL, 0);
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
      if (r->writing && dpc__is_bulk(r)) {
        /* The socket still reads the caller's buffer: only closing it stops
         * that. The other requests on it fail as a lost connection. */
        dpc__conn_fail(k, ZS_ECONN, msg, r, ZS_ETIMEDOUT);
        break;
      }
      if (k->rx == r)
        wire_reader_skip_rest(&k->rd);
      dpc__req_detach(c, r);
      dpc__req_complete(r, ZS_ETIMEDOUT, 0, 0, msg);
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
      dpc__req_detach(c, r);
      dpc__req_complete(r, ZS_ETIMEDOUT, 0, 0, msg);
    }
  }
  dpc__timer_update(c);
}

/* The timer runs only while something can time out. */
void dpc__timer_update(dp_client *c) {
  if (c->shut)
    return;
  int busy = dpc__pending_first(c) != NULL;
  for (uint32_t i = 0; i < c->nconns && !busy; i++)
    busy = c->conns[i].ninflight > 0 || dpc__connecting(c->conns[i].state);
  if (busy && !c->timer_on) {
    uv_timer_start(&c->timer, on_tick, DPC_TICK_MS, DPC_TICK_MS);
    c->timer_on = 1;
  } else if (!busy && c->timer_on) {
    uv_timer_stop(&c->timer);
    c->timer_on = 0;
  }
}
