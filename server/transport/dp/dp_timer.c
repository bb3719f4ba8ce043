/*
 * dp_timer — the loop's timers: the sweep (every DP_SWEEP_MS: token reloads,
 * HELLO deadlines, stalled connections, the idle pool) and the pin timer,
 * which runs only while answers pinned in the low copy are out. Loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

void dp__on_sweep(uv_timer_t *t) {
  dp_server *s = t->data;
  uint64_t now = clock_now_ms();
  /* Token files reread (SIGHUP): within a sweep, no connection keeps a
   * token that is no longer valid. */
  unsigned long long gen = auth_keys_generation(s->auth);
  if (gen != s->auth_gen) {
    s->auth_gen = gen;
    dp__recheck_tokens(s);
  }
  /* Under pressure strangers get a short deadline, so that even a flood
   * that outpaces eviction turns over within about a sweep. */
  uint32_t hello_ms = s->nunauth * 2 > s->max_unauth && s->hello_ms > DP_PRESSED_HELLO_MS
                          ? DP_PRESSED_HELLO_MS
                          : s->hello_ms;
  for (list_node *l = s->live.next; l != &s->live;) {
    dp_conn *c = container_of(l, dp_conn, node);
    l = l->next; /* dp__conn_close moves c to the zombies */
    if (!c->authed && !c->fatal && now - c->accepted_ms >= hello_ms) {
      dp__count(&s->st_auth_timeouts, 1);
      LOG_WARN("dp_unauthenticated", "peer=%s detail=\"no HELLO within %u ms\"", c->peer, hello_ms);
      dp__conn_close(c);
      continue;
    }
    if (c->reading && wire_reader_mid_frame(&c->rd) && now - c->last_progress_ms >= s->stall_ms) {
      dp__count(&s->st_stalled, 1);
      LOG_WARN("dp_stalled", "peer=%s detail=\"no byte for %" PRIu64 " ms inside a frame\"",
               c->peer, now - c->last_progress_ms);
      dp__conn_close(c);
      continue;
    }
    size_t wq = stream_write_queue_size(c->st);
    if (wq == 0 || wq != c->wq_seen) {
      c->wq_seen = wq;
      c->wq_since_ms = now;
    } else if (now - c->wq_since_ms >= s->stall_ms) {
      dp__count(&s->st_stalled, 1);
      LOG_WARN("dp_stalled", "peer=%s detail=\"%zu answer bytes not taken for %" PRIu64 " ms\"",
               c->peer, wq, now - c->wq_since_ms);
      dp__conn_close(c);
    }
  }
  if (s->pool_bytes && now - s->pool_last_use_ms >= DP_POOL_IDLE_MS)
    dp__pool_drain(s);
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
    l = l->next; /* dp__conn_close moves c to the zombies */
    if (c->pinned_out == 0)
      continue;
    uint64_t taken = c->handed - stream_write_queue_size(c->st);
    if (taken != c->pin_taken) {
      c->pin_taken = taken;
      c->pin_since_ms = now;
    } else if (now - c->pin_since_ms >= s->pin_hold_ms) {
      dp__count(&s->st_pins_released, 1);
      LOG_WARN("dp_stalled",
               "peer=%s detail=\"took no byte of an answer pinned in the shard's low copy for "
               "%" PRIu64 " ms; closed so that the pin does not hold up an apply\"",
               c->peer, now - c->pin_since_ms);
      dp__conn_close(c);
    }
  }
  dp__pin_timer_update(s);
}

/* The pin timer runs only while pinned answers are out. */
void dp__pin_timer_update(dp_server *s) {
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
