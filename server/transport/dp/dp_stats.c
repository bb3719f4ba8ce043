/*
 * dp_stats — the data plane's counters read from any thread
 * (dp_server_get_stats) and as /metrics families zshard_dp_*.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include "server/metrics/metrics.h"
#include "server/service/service.h"

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
