/*
 * dp_server — the data plane's libuv server (see dp_server.h): starting it
 * (its settings, the listener, the handles, the loop thread), the loop's
 * wake-up door, and stopping it.
 *
 * The rest of the server is one file per concern, sharing the types and the
 * dp__ functions of dp_internal.h:
 *  - dp_conn.c     a connection's life: accept, caps, references, close;
 *  - dp_auth.c     HELLO, rank bindings, token reloads;
 *  - dp_read.c     bytes off the socket into the frame reader, fairness;
 *  - dp_request.c  a decoded frame to the service, a pull's wait;
 *  - dp_work.c     a request's work (inline or on the thread pool),
 *                  replica forwarding of a primary's pushes;
 *  - dp_answer.c   answers out, the answer budgets, the produce window;
 *  - dp_mailbox.c  finished Pull waits from core threads to the loop;
 *  - dp_pool.c     payload buffers and their pool;
 *  - dp_timer.c    the sweep and the pin timer;
 *  - dp_stats.c    counters and the /metrics families.
 *
 * Threads and what they own:
 *  - The loop thread runs uv_run and owns every handle, every connection,
 *    the buffer pool and every counter it writes: it accepts, reads and
 *    decodes frames, calls the core for small requests, and writes answers.
 *  - libuv's thread pool runs the work of large requests (core_push of a
 *    received gradient; core_read of a piece into its answer buffer, and the
 *    answer's CRC), so that the loop keeps serving other peers meanwhile. A
 *    work item touches only its own dp_work and the buffer it carries; libuv
 *    hands it back to the loop thread for the answer.
 *  - Core threads call on_core_version when a Pull's version arrives (or its
 *    wait ends). The callback touches only its dp_pull record and the
 *    mailbox: it queues the record there and wakes the loop with
 *    uv_async_send, the one door into the loop from other threads.
 *  - The thread calling dp_server_start / dp_server_stop creates the handles
 *    before the loop thread runs, and after joining it frees what is left;
 *    in between it only sets `stop` and wakes the loop through the same door.
 *
 * Lock order: mailbox.mu is the only lock here and a leaf. It is never held
 * while calling into the core, and the core calls on_core_version holding no
 * lock of its own that we could wait for.
 *
 * Lifetimes: a connection is reference counted (loop thread only): its
 * stream, each thread-pool work, each answer being written and each Pull
 * waiting in the core hold one reference. After stream_close the connection
 * is a "zombie" until its last reference goes; a Pull record outstanding in the
 * core when the server stops is then owned by the mailbox and never touches
 * its connection again, and the server frees the zombies itself.
 *
 * Copies of tensor bytes, beyond the kernel's socket copies:
 *  - Push: the payload is read from the socket straight into a buffer sized
 *    from the header (taken from a small pool, so that large buffers are not
 *    faulted in afresh for every frame), except for the bytes that arrived in
 *    the same read as the header (at most DP_STAGING bytes, copied once). The
 *    CRC is computed on each read's bytes while they are in cache. core_push
 *    then adds the buffer into the accumulator (or copies an early
 *    contribution to hold it, the core's own rule). 0 extra copies for large
 *    payloads: on_alloc hands that buffer to the stream layer, which over
 *    plain TCP reads into it as is.
 *  - Pull of the stored dtype: none at all. The piece is pinned in the low
 *    arena (core_pin_low), its CRC is the one kept beside it, and
 *    stream_write sends header+meta and the piece from there with one
 *    writev (common/net/stream.h: plain TCP adds no copy; TLS encrypts from it).
 *  - Pull of another dtype (or to a peer whose socket holds unsent bytes):
 *    core_read converts the piece from the master arena into the answer
 *    buffer (1 pass, which is the dtype conversion or the copy), the CRC
 *    reads it once more in cache, and one writev sends it. 1 copy.
 *  - PUSH_BATCH: as Push, with one buffer for all the pieces of the batch;
 *    each piece goes through core_push at its place in it. 0 extra copies.
 *  - PULL_BATCH of the stored dtype: none. Each piece is pinned where it
 *    lies, the payload CRC is combined from the pieces' stored ones
 *    (crc32c_combine, no byte read), and one writev sends the header and
 *    every piece from the arena. Otherwise as a Pull of another dtype, with
 *    one answer buffer for all the pieces (each read at its place). 1 copy.
 */
#include "server/transport/dp/dp_server.h"
#include "server/transport/dp/dp_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/net/dp_client.h"
#include "common/net/stream.h"
#include "common/net/wire.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"

static void on_async(uv_async_t *h) {
  dp_server *s = h->data;
  dp__drain_mailbox(s);
  if (!atomic_load(&s->stop))
    return;
  /* Stop: from here on core callbacks free their records themselves. */
  pthread_mutex_lock(&s->mb->mu);
  s->mb->closed = 1;
  pthread_mutex_unlock(&s->mb->mu);
  dp__drain_mailbox(s);
  stream_listener_close(s->listener);
  s->listener = NULL;
  uv_close((uv_handle_t *)&s->sweep, NULL);
  uv_close((uv_handle_t *)&s->pin_timer, NULL);
  uv_close((uv_handle_t *)&s->check, NULL);
  uv_close((uv_handle_t *)&s->async, NULL);
  while (!list_empty(&s->live))
    dp__conn_close(container_of(s->live.next, dp_conn, node));
}

static void *loop_main(void *arg) {
  dp_server *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* A setting the tests (and an operator who knows) may give through the
 * environment; anything but a positive number keeps the default. */
static uint64_t env_knob(const char *name, uint64_t def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end = NULL;
  unsigned long long n = strtoull(v, &end, 10);
  if (*end != '\0' || n == 0) {
    LOG_WARN("dp_config", "name=%s value=\"%s\" detail=\"not a positive number; ignored\"", name,
             v);
    return def;
  }
  return (uint64_t)n;
}

void dp_server_config_init(dp_server_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
}

static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

/* Frees a server whose loop thread is not running (never started, or
 * joined). */
static void server_free(dp_server *s) {
  if (s->loop_inited) {
    /* After a normal stop every handle is closed already; after a failed
     * start some were never run. Either way the loop finishes the closes.
     * The listener goes through its layer, which frees it in its callback. */
    stream_listener_close(s->listener);
    s->listener = NULL;
    uv_walk(&s->loop, close_walk, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    int rc = uv_loop_close(&s->loop);
    if (rc != 0)
      LOG_ERROR("dp_stop", "detail=\"loop not closed: %s\"", uv_strerror(rc));
  }
  /* What is left are connections kept only by Pulls still parked in the
   * core; their records belong to the mailbox now and never look at them. */
  while (!list_empty(&s->zombies))
    dp__conn_free(container_of(s->zombies.next, dp_conn, node));
  dp__pool_drain(s);
  free(s->staging);
  if (s->mb) {
    pthread_mutex_lock(&s->mb->mu);
    s->mb->closed = 1;
    pthread_mutex_unlock(&s->mb->mu);
    dp__mailbox_unref(s->mb, 1);
  }
  if (s->own_svc)
    service_destroy(s->svc);
  if (s->pacer) {
    /* Every connection is closed: what the pacer did, for the operator. */
    stream_pacer_stats ps;
    stream_pacer_get_stats(s->pacer, &ps);
    LOG_INFO("dp_link_pacing",
             "rate_sets=%llu rate_fails=%llu starts=%llu stops=%llu stop_unsent_avg=%llu "
             "stop_unsent_max=%llu",
             (unsigned long long)ps.rate_sets, (unsigned long long)ps.rate_fails,
             (unsigned long long)ps.starts, (unsigned long long)ps.stops,
             (unsigned long long)(ps.stops ? ps.stop_unsent / ps.stops : 0),
             (unsigned long long)ps.stop_unsent_max);
    stream_pacer_free(s->pacer);
  }
  free(s);
}

int dp_server_start(const dp_server_config *cfg, dp_server **out, char *err, size_t errlen) {
  if (err && errlen)
    err[0] = '\0';
  if (!cfg || !cfg->core || !cfg->listen || !out)
    return status_fail(err, errlen, ZS_EINVAL, "dp_server_start needs a listen address and a core");
  struct sockaddr_storage addr;
  int rc = dp_resolve(cfg->listen, 1, &addr, err, errlen);
  if (rc)
    return rc;
  if (cfg->congestion && cfg->congestion[0] &&
      (rc = stream_cc_check(cfg->congestion, err, errlen)) != 0)
    return rc;
  if (cfg->pacing_mbit > STREAM_PACING_MBIT_MAX)
    return status_fail(err, errlen, ZS_EINVAL, "pacing of %u Mbit/s: at most %u", cfg->pacing_mbit,
                       STREAM_PACING_MBIT_MAX);
  if (cfg->link_mbit > STREAM_PACING_MBIT_MAX || (cfg->link_mbit && cfg->pacing_mbit))
    return status_fail(err, errlen, ZS_EINVAL,
                       "link pacing of %u Mbit/s: at most %u, and not with a fixed pacing",
                       cfg->link_mbit, STREAM_PACING_MBIT_MAX);
  dp_server *s = calloc(1, sizeof *s);
  if (!s)
    return ZS_ENOMEM;
  s->core = cfg->core;
  s->svc = cfg->service;
  if (s->svc && service_core(s->svc) != s->core) {
    free(s);
    if (err && errlen)
      status_say(err, errlen, "dp_server_start: the service drives another core");
    return ZS_EINVAL;
  }
  if (!s->svc && service_create(s->core, NULL, &s->svc) != 0) {
    free(s);
    return ZS_ENOMEM;
  }
  s->own_svc = !cfg->service;
  s->max_payload = cfg->max_payload ? cfg->max_payload : WIRE_DEFAULT_MAX_PAYLOAD;
  s->max_pending = cfg->max_pending ? cfg->max_pending : DP_DEFAULT_MAX_PENDING;
  s->max_queued = cfg->max_queued_bytes ? cfg->max_queued_bytes : DP_DEFAULT_MAX_QUEUED;
  s->stall_ms = cfg->stall_timeout_ms ? cfg->stall_timeout_ms : DP_DEFAULT_STALL_MS;
  s->max_conns = cfg->max_connections ? cfg->max_connections : DP_DEFAULT_MAX_CONNS;
  s->inline_bytes = cfg->inline_bytes ? cfg->inline_bytes : DP_DEFAULT_INLINE;
  s->auth = cfg->auth;
  s->auth_gen = auth_keys_generation(s->auth);
  s->rep = cfg->replica;
  s->hello_ms = cfg->hello_timeout_ms ? cfg->hello_timeout_ms
                                      : env_knob("ZSHARD_DP_HELLO_TIMEOUT_MS", DP_DEFAULT_HELLO_MS);
  s->max_per_peer = cfg->max_per_peer ? cfg->max_per_peer : DP_DEFAULT_PER_PEER;
  s->max_unauth = cfg->max_unauthenticated ? cfg->max_unauthenticated : DP_DEFAULT_UNAUTH;
  s->max_unauth_peer =
      s->max_unauth / DP_UNAUTH_SHARE_DIV ? s->max_unauth / DP_UNAUTH_SHARE_DIV : 1;
  s->max_wait_conn =
      cfg->max_waiting_per_conn ? cfg->max_waiting_per_conn : DP_DEFAULT_WAITING_CONN;
  s->max_wait = cfg->max_waiting ? cfg->max_waiting : DP_DEFAULT_WAITING;
  s->max_answer = cfg->max_answer_bytes ? cfg->max_answer_bytes
                                        : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES", DP_DEFAULT_ANSWER);
  s->max_answer_total = cfg->max_answer_bytes_total
                            ? cfg->max_answer_bytes_total
                            : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES_TOTAL", DP_DEFAULT_ANSWER_TOTAL);
  /* A quarter of the server's budget by default, as for waiting pulls: one
   * address cannot hold it all, so the others' answers still find room. */
  uint64_t quarter = (s->max_answer_total + 3u) / 4u;
  s->max_answer_peer = cfg->max_answer_bytes_per_peer
                           ? cfg->max_answer_bytes_per_peer
                           : env_knob("ZSHARD_DP_MAX_ANSWER_BYTES_PEER", quarter);
  s->pin_hold_ms = cfg->pin_hold_ms ? cfg->pin_hold_ms : DP_DEFAULT_PIN_HOLD_MS;
  if (cfg->congestion && cfg->congestion[0])
    memcpy(s->congestion, cfg->congestion, strlen(cfg->congestion) + 1); /* checked above */
  s->pacing_mbit = cfg->pacing_mbit;
  if (cfg->link_mbit && stream_pacer_new(cfg->link_mbit, STREAM_PACER_MIN_WRITE,
                                         cfg->link_notsent_lowat, &s->pacer) != 0) {
    if (s->own_svc)
      service_destroy(s->svc);
    free(s);
    return ZS_ENOMEM;
  }
  if (cfg->metrics) {
    s->m_push = metrics_rpc_register(cfg->metrics, "data", "Push");
    s->m_pull = metrics_rpc_register(cfg->metrics, "data", "Pull");
    s->m_push_batch = metrics_rpc_register(cfg->metrics, "data", "PushBatch");
    s->m_pull_batch = metrics_rpc_register(cfg->metrics, "data", "PullBatch");
  }
  atomic_init(&s->stop, 0);
  list_init(&s->live);
  list_init(&s->unauth_q);
  list_init(&s->zombies);
  list_init(&s->fair);
  list_init(&s->starved);
  list_init(&s->peers);
  rc = ZS_ENOMEM;
  s->staging = malloc(DP_STAGING);
  s->mb = calloc(1, sizeof *s->mb);
  if (!s->staging || !s->mb)
    goto fail;
  if (pthread_mutex_init(&s->mb->mu, NULL) != 0) {
    free(s->mb);
    s->mb = NULL;
    goto fail;
  }
  s->mb->refs = 1;
  rc = ZS_EINTERNAL;
  if (uv_loop_init(&s->loop) != 0)
    goto fail;
  s->loop_inited = 1;
  char detail[128];
  int lrc = cfg->tls
                ? stream_tls_listen(cfg->tls, &s->loop, (const struct sockaddr *)&addr, 1024,
                                    dp__on_connection, s, &s->listener, detail, sizeof detail)
                : stream_listen(&stream_tcp_ops, &s->loop, (const struct sockaddr *)&addr, 1024,
                                dp__on_connection, s, &s->listener, detail, sizeof detail);
  if (lrc != 0) {
    rc = status_fail(err, errlen, ZS_EINVAL, "cannot listen on %s: %s", cfg->listen,
                     detail[0] ? detail : zs_strerror(lrc));
    goto fail;
  }
  struct sockaddr_storage bound;
  if (stream_listener_addr(s->listener, &bound) != 0)
    goto fail;
  s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                              : ((struct sockaddr_in *)&bound)->sin_port);
  if (uv_async_init(&s->loop, &s->async, on_async) != 0)
    goto fail;
  s->async.data = s;
  s->mb->async = &s->async;
  uv_timer_init(&s->loop, &s->sweep);
  s->sweep.data = s;
  uv_timer_start(&s->sweep, dp__on_sweep, DP_SWEEP_MS, DP_SWEEP_MS);
  uv_timer_init(&s->loop, &s->pin_timer);
  s->pin_timer.data = s;
  uv_check_init(&s->loop, &s->check);
  s->check.data = s;
  uv_check_start(&s->check, dp__on_check);
  if (pthread_create(&s->thread, NULL, loop_main, s) != 0)
    goto fail;
  s->thread_started = 1;
  LOG_INFO("dp_listening", "addr=%s port=%d cc=%s pacing_mbit=%u link_mbit=%u", cfg->listen,
           s->port, s->congestion[0] ? s->congestion : "default", s->pacing_mbit, cfg->link_mbit);
  *out = s;
  return 0;

fail:
  if (err && errlen && !err[0])
    status_say(err, errlen, "cannot start the data plane on %s: %s", cfg->listen, zs_strerror(rc));
  server_free(s);
  return rc;
}

int dp_server_port(const dp_server *s) {
  return s->port;
}

void dp_server_stop(dp_server *s) {
  if (!s)
    return;
  if (s->thread_started) {
    atomic_store(&s->stop, 1);
    uv_async_send(&s->async);
    pthread_join(s->thread, NULL);
  }
  server_free(s);
}
