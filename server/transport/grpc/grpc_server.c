/*
 * grpc_server — the gRPC transport (see grpc_server.h): its start, polling
 * threads and shutdown; the description of the whole transport.
 *
 * Threads and what they own:
 *  - `threads` polling threads run grpc_completion_queue_next on the one server
 *    completion queue and run every handler: they parse, call the service
 *    (service.h: the checks, then the core) and start the answering batch.
 *    They never wait for the core: a core call that returns CORE_PENDING
 *    leaves the call parked in the core.
 *  - Core threads call our callbacks (on_core_*). A callback only records the
 *    outcome, claims the call and starts an empty batch on it, whose
 *    completion (on_hop) carries the rest of the work (core_read into the
 *    response, core_missing, packing) back onto a polling thread. So no core
 *    callback blocks, and none calls into the core.
 *  - On a replicated primary, the forwarding pool's threads (grpc_forward.c)
 *    send a trainer's write that succeeded here to the backups and then
 *    answer the call, so that no polling thread waits for a backup.
 *  - The thread calling gsrv_destroy runs the shutdown sequence.
 *
 * Lock order: gsrv.lock, the one lock of the files sharing grpc_internal.h, is
 * a leaf: it is never held while calling into the core (so a core lock is
 * never taken inside it), and a core callback takes it only on an error path,
 * holding no lock of ours. It guards the list of calls in flight, the Watch
 * streams, the serving status, the shutdown flags and the limits' counts
 * (parked calls and answer bytes per connection, the queue of answers waiting
 * for room). gRPC functions called with it held never call back into the
 * transport (completions go through the queue). push_asm has a leaf lock of
 * its own, never taken with gsrv.lock.
 *
 * Limits (docs/OPERATIONS.md, "Limits"; gsrv_limits in the header): the
 * channel arguments bound request sizes, gRPC's memory, streams, idle and
 * handshake time; a parked call counts against the parked budgets until its
 * RECV_CLOSE_ON_SERVER completes; a Pull answer counts against the answer
 * budgets from being built until its final batch completes.
 *
 * A call is answered exactly once: whoever flips gcall.claimed from 0 to 1 (a
 * handler, a core callback, or the shutdown sweep) sends the final batch; the
 * others drop what they prepared. A gcall is reference counted: the handler
 * running it, each batch started on it, each core callback outstanding and
 * the forwarding pool while it holds the call hold one reference. The
 * grpc_call itself is released as soon as the final batch completes, so that
 * server shutdown never waits for a core callback; a gcall kept alive only by
 * the core afterwards touches nothing but itself.
 *
 * The transport's files, one job each (grpc_internal.h holds what they share):
 *  - grpc_server.c: start, the polling threads and the shutdown sequence;
 *  - grpc_calls.c: a call's references, lists, one answer and the hop back
 *    from a core thread;
 *  - grpc_forward.c: the forwarding pool of a replicated primary;
 *  - grpc_budget.c: the parked-call and Pull-answer budgets;
 *  - grpc_dispatch.c: request slots, authentication and the way to a handler;
 *  - grpc_methods.c: the one table of the methods (path, handler, request
 *    limit, role, replica kind);
 *  - grpc_job.c, grpc_step.c, grpc_ckpt.c, grpc_replica.c, grpc_health.c:
 *    the handlers, by what they serve;
 *  - pb_inplace.c, push_asm.c, grpc_tls.c: the in-place codec of the bulk
 *    messages, chunked Push payloads, TLS credentials.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/grpc_security.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "common/net/rpc_client.h"

/* ------------------------------------------------------------------------ */
/* The polling loop                                                         */
/* ------------------------------------------------------------------------ */

static void on_shutdown(gtag *t, int ok) {
  (void)ok;
  gsrv *s = container_of(t, gsrv, shutdown_tag);
  pthread_mutex_lock(&s->lock);
  s->shutdown_done = 1;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

static void *poll_main(void *arg) {
  gsrv *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type == GRPC_OP_COMPLETE) {
      gtag *t = ev.tag;
      tsan_acquire(t);
      t->done(t, ev.success);
    }
  }
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Start and shutdown                                                       */
/* ------------------------------------------------------------------------ */

static void timespec_after_ms(struct timespec *ts, uint64_t ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(ms / 1000);
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Waits on s->cond until *flag is set or `until` passes; s->lock held. */
static void wait_flag_locked(gsrv *s, const int *flag, const struct timespec *until) {
  while (!*flag) {
    if (until) {
      if (pthread_cond_timedwait(&s->cond, &s->lock, until) != 0)
        break;
    } else {
      pthread_cond_wait(&s->cond, &s->lock);
    }
  }
}

/* Shuts the grpc_server down and releases everything; works on a server that
 * never started (a failed gsrv_start) and with no polling thread. */
static void teardown(gsrv *s) {
  gsrv__fwd_free(s);
  if (s->server) {
    if (!s->started)
      grpc_server_start(s->server);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    if (s->nthreads == 0) {
      grpc_event ev;
      do {
        ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_OP_COMPLETE)
          tsan_acquire(ev.tag);
        if (ev.type == GRPC_OP_COMPLETE && ev.tag != &s->shutdown_tag)
          ((gtag *)ev.tag)->done(ev.tag, ev.success);
      } while (ev.type != GRPC_OP_COMPLETE || ev.tag != &s->shutdown_tag);
    } else {
      pthread_mutex_lock(&s->lock);
      struct timespec until;
      timespec_after_ms(&until, s->grace_ms);
      wait_flag_locked(s, &s->shutdown_done, &until);
      if (!s->shutdown_done) {
        /* A peer that does not read its answer keeps its call (and the
         * server) alive; cancelling ends it. */
        pthread_mutex_unlock(&s->lock);
        LOG_WARN("shutdown_cancel", "reason=calls_still_open_after_grace");
        grpc_server_cancel_all_calls(s->server);
        pthread_mutex_lock(&s->lock);
        wait_flag_locked(s, &s->shutdown_done, NULL);
      }
      pthread_mutex_unlock(&s->lock);
    }
  }
  if (s->cq) {
    grpc_completion_queue_shutdown(s->cq);
    if (s->nthreads == 0) {
      while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
             GRPC_QUEUE_SHUTDOWN) {
      }
    }
  }
  for (int i = 0; i < s->nthreads; i++)
    pthread_join(s->threads[i], NULL);
  if (s->server)
    grpc_server_destroy(s->server);
  if (s->cq)
    grpc_completion_queue_destroy(s->cq);
  grpc_shutdown();
  gtls_free(s->tls);
  free(s->threads);
  push_asm_free(s->chunks);
  for (int i = 0; i < GSRV_PEER_BUCKETS; i++) {
    for (list_node *n; (n = list_pop(&s->peers[i])) != NULL;)
      free(container_of(n, peer_count, node));
  }
  if (s->own_svc)
    service_destroy(s->svc);
  pthread_cond_destroy(&s->cond);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

/* A positive integer from the environment, else `def`. */
static uint32_t env_u32(const char *name, uint32_t def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end;
  unsigned long long x = strtoull(v, &end, 10);
  if (*end || x == 0 || x > INT32_MAX) {
    LOG_WARN("bad_env", "name=%s reason=not_a_positive_int32 using=%" PRIu32, name, def);
    return def;
  }
  return (uint32_t)x;
}

void gsrv_limits_init(gsrv_limits *l) {
  l->max_parked = env_u32("ZSHARD_GRPC_MAX_PARKED", GSRV_DEFAULT_MAX_PARKED);
  l->max_parked_per_conn =
      env_u32("ZSHARD_GRPC_MAX_PARKED_PER_CONN", GSRV_DEFAULT_MAX_PARKED_PER_CONN);
  l->max_watchers = env_u32("ZSHARD_GRPC_MAX_WATCHERS", GSRV_DEFAULT_MAX_WATCHERS);
  l->idle_ms = env_u32("ZSHARD_GRPC_IDLE_MS", GSRV_DEFAULT_IDLE_MS);
  l->handshake_ms = env_u32("ZSHARD_GRPC_HANDSHAKE_MS", GSRV_DEFAULT_HANDSHAKE_MS);
  l->keepalive_ms = env_u32("ZSHARD_GRPC_KEEPALIVE_MS", GSRV_DEFAULT_KEEPALIVE_MS);
  l->keepalive_timeout_ms = GSRV_DEFAULT_KEEPALIVE_TIMEOUT_MS;
  l->max_chunked_bytes = (uint64_t)env_u32("ZSHARD_GRPC_MAX_CHUNKED_MB",
                                           (uint32_t)(GSRV_DEFAULT_MAX_CHUNKED_BYTES >> 20))
                         << 20;
  l->chunked_ttl_ms = GSRV_DEFAULT_CHUNKED_TTL_MS;
  l->memory_bytes =
      (uint64_t)env_u32("ZSHARD_GRPC_MEMORY_MB", (uint32_t)(GSRV_DEFAULT_MEMORY_BYTES >> 20)) << 20;
  l->max_answer_bytes = (uint64_t)env_u32("ZSHARD_GRPC_MAX_ANSWER_MB",
                                          (uint32_t)(GSRV_DEFAULT_MAX_ANSWER_BYTES >> 20))
                        << 20;
  l->max_answer_bytes_per_conn =
      (uint64_t)env_u32("ZSHARD_GRPC_MAX_ANSWER_MB_PER_CONN",
                        (uint32_t)(GSRV_DEFAULT_MAX_ANSWER_BYTES_PER_CONN >> 20))
      << 20;
  l->answer_stall_ms = env_u32("ZSHARD_GRPC_ANSWER_STALL_MS", GSRV_DEFAULT_ANSWER_STALL_MS);
}

static void int_arg(grpc_arg *a, const char *key, int value) {
  a->type = GRPC_ARG_INTEGER;
  a->key = (char *)key;
  a->value.integer = value;
}

/* The listener's channel arguments (GSRV_NARGS of them) from its limits. */
#define GSRV_NARGS 11
static void listener_args(const gsrv_limits *l, grpc_resource_quota *quota, grpc_arg *args) {
  int n = 0;
  args[n].type = GRPC_ARG_POINTER;
  args[n].key = (char *)GRPC_ARG_RESOURCE_QUOTA;
  args[n].value.pointer.p = quota;
  args[n++].value.pointer.vtable = grpc_resource_quota_arg_vtable();
  /* No request needs more than a Push chunk and its header (GSRV_MAX_REQUEST
   * says per method); gRPC refuses a larger message RESOURCE_EXHAUSTED. */
  int_arg(&args[n++], GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, GSRV_MAX_REQUEST_BYTES);
  int_arg(&args[n++], GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, RPC_MAX_MESSAGE_BYTES);
  /* gRPC sets SO_REUSEPORT by default, which would let a second server bind
   * a port already in use and silently share its connections. */
  int_arg(&args[n++], GRPC_ARG_ALLOW_REUSEPORT, 0);
  /* An idle connection costs a descriptor and its buffers: gRPC's default
   * keeps it forever, and enough of them starve the checkpoint writer of
   * descriptors (EMFILE). */
  int_arg(&args[n++], GRPC_ARG_MAX_CONNECTION_IDLE_MS, (int)l->idle_ms);
  int_arg(&args[n++], GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, (int)l->handshake_ms);
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_TIME_MS, (int)l->keepalive_ms);
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_TIMEOUT_MS, (int)l->keepalive_timeout_ms);
  /* Clients may ping (to keep NATs open) once a minute, even between calls;
   * more often is gRPC's "too many pings" and ends the connection. */
  int_arg(&args[n++], GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  int_arg(&args[n++], GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 60000);
  /* Streams open at once on one connection: its parked calls and room for
   * the calls in progress beside them. */
  int_arg(
      &args[n++], GRPC_ARG_MAX_CONCURRENT_STREAMS,
      (int)(l->max_parked_per_conn > INT32_MAX - 256 ? INT32_MAX : l->max_parked_per_conn + 256));
}

/* Listens on cfg->listen, with TLS when a certificate is configured.
 * Returns 0 or an error with err set. */
static int add_port(gsrv *s, const gsrv_config *cfg, char *err, size_t errlen) {
  grpc_server_credentials *creds;
  if (cfg->tls_cert_file || cfg->tls_key_file) {
    int rc = gtls_new(cfg->tls_cert_file, cfg->tls_key_file, cfg->tls_client_ca_file, &s->tls, err,
                      errlen);
    if (rc)
      return rc;
    creds = gtls_credentials(s->tls);
  } else if (cfg->tls_client_ca_file) {
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "--tls-client-ca needs --tls-cert and --tls-key");
  } else {
    creds = grpc_insecure_server_credentials_create();
  }
  if (!creds)
    return status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot make the gRPC credentials");
  s->port = grpc_server_add_http2_port(s->server, cfg->listen, creds);
  grpc_server_credentials_release(creds);
  if (s->port <= 0)
    return status_fail(err, errlen, ZS_EINVAL,
                       s->tls ? "cannot listen on %s (address invalid or in use, or gRPC refused "
                                "the certificate and key: see its message above)"
                              : "cannot listen on %s (address invalid or in use)",
                       cfg->listen);
  return 0;
}

int gsrv_reload_tls(gsrv *s, char *err, size_t errlen) {
  return s->tls ? gtls_reload(s->tls, err, errlen) : 0;
}

static int default_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 2 ? 2 : n > 4 ? 4 : (int)n;
}

int gsrv_start(const gsrv_config *cfg, gsrv **out, char *err, size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->core || !cfg->listen || !cfg->listen[0])
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "gsrv_start needs a core and a listen address");
  for (int m = 0; m < M_COUNT; m++)
    if (gsrv__methods[m].role == AUTH_NONE && m != M_HEALTH_CHECK && m != M_HEALTH_WATCH)
      return status_fail(err, errlen, ZS_EINTERNAL, "method %s has no role (grpc_methods.c)",
                         gsrv__methods[m].path);
  gsrv *s = calloc(1, sizeof *s);
  if (!s)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  list_init(&s->inflight);
  list_init(&s->watchers);
  list_init(&s->answer_wait);
  for (int i = 0; i < GSRV_PEER_BUCKETS; i++)
    list_init(&s->peers[i]);
  s->core = cfg->core;
  s->ckpt = cfg->ckpt;
  s->svc = cfg->service;
  if (s->svc && service_core(s->svc) != s->core) {
    free(s);
    return status_fail(err, errlen, ZS_EINVAL, "%s", "gsrv_start: the service drives another core");
  }
  if (!s->svc) {
    if (service_create(s->core, NULL, &s->svc) != 0) {
      free(s);
      return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
    }
    s->own_svc = 1;
  }
  s->data_port = cfg->data_port;
  if (cfg->limits)
    s->lim = *cfg->limits;
  else
    gsrv_limits_init(&s->lim);
  if (push_asm_new(s->lim.max_chunked_bytes, s->lim.chunked_ttl_ms, RPC_PUSH_CHUNK_BYTES,
                   &s->chunks) != 0) {
    if (s->own_svc)
      service_destroy(s->svc);
    free(s);
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  }
  s->auth = cfg->auth;
  s->rep = cfg->replica;
  /* A Watch stream lives as long as its client wants: its duration is no
   * latency, so it is not recorded. */
  for (int m = 0; m < M_COUNT; m++)
    if (m != M_HEALTH_WATCH)
      s->rpc_metric[m] =
          metrics_rpc_register(cfg->metrics, "grpc", strrchr(gsrv__methods[m].path, '/') + 1);
  s->grace_ms = cfg->grace_ms ? cfg->grace_ms : GSRV_DEFAULT_GRACE_MS;
  s->start_ns = clock_now_ns();
  s->shutdown_tag.done = on_shutdown;
  pthread_mutex_init(&s->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cond, &ca);
  pthread_condattr_destroy(&ca);
  grpc_init();

  int rc = ZS_EINTERNAL;
  grpc_arg args[GSRV_NARGS];
  /* gRPC reads a request whole before it checks it against the receive
   * limit, so the limit alone bounds nothing: its memory quota does. Past
   * it, gRPC resets streams (RESOURCE_EXHAUSTED) instead of reading more. */
  grpc_resource_quota *quota = grpc_resource_quota_create("zshard-grpc");
  grpc_resource_quota_resize(quota, (size_t)s->lim.memory_bytes);
  listener_args(&s->lim, quota, args);
  grpc_channel_args chargs = {.num_args = GSRV_NARGS, .args = args};
  s->server = grpc_server_create(&chargs, NULL);
  grpc_resource_quota_unref(quota);
  s->cq = grpc_completion_queue_create_for_next(NULL);
  if (!s->server || !s->cq) {
    status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot create the gRPC server");
    goto fail;
  }
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  for (int m = 0; m < M_COUNT; m++) {
    s->reg[m] = grpc_server_register_method(s->server, gsrv__methods[m].path, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!s->reg[m]) {
      status_fail(err, errlen, ZS_EINTERNAL, "cannot register method %s", gsrv__methods[m].path);
      goto fail;
    }
  }
  if ((rc = add_port(s, cfg, err, errlen)) != 0)
    goto fail;

  int want = cfg->threads > 0 ? cfg->threads : default_threads();
  s->threads = calloc((size_t)want, sizeof *s->threads);
  if (!s->threads) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
    goto fail;
  }
  for (int i = 0; i < want; i++) {
    if (pthread_create(&s->threads[i], NULL, poll_main, s) != 0)
      break;
    s->nthreads++;
  }
  if (s->nthreads == 0) {
    status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot start the polling threads");
    goto fail;
  }
  if (s->rep && (rc = gsrv__fwd_start(s, err, errlen)) != 0)
    goto fail;

  grpc_server_start(s->server);
  s->started = 1;
  pthread_mutex_lock(&s->lock);
  rc = 0;
  for (int m = 0; m <= M_COUNT && rc == 0; m++)
    for (int k = 0; k < (m == M_GENERIC ? GSRV_GENERIC_SLOTS : GSRV_SLOTS_PER_METHOD) && rc == 0;
         k++)
      rc = gsrv__post_slot_locked(s, m);
  s->serving = rc == 0;
  pthread_mutex_unlock(&s->lock);
  if (rc) {
    status_fail(err, errlen, rc, "%s", "cannot post request slots to gRPC");
    gsrv_destroy(s);
    return rc;
  }
  *out = s;
  return 0;

fail:
  teardown(s);
  return rc;
}

int gsrv_port(const gsrv *s) {
  return s->port;
}

/* 1 while a call is being worked on (parsed, computed, answered), as opposed
 * to parked in the core waiting for data that may never come. */
static int has_work_locked(const gsrv *s) {
  for (const list_node *n = s->inflight.next; n != &s->inflight; n = n->next)
    if (!container_of(n, gcall, node)->waiting)
      return 1;
  return 0;
}

void gsrv_destroy(gsrv *s) {
  if (!s)
    return;
  /* 1. Health first, so load balancers and Watch streams stop sending work. */
  gsrv__set_serving(s, 0);

  /* 2. No new calls: gRPC refuses new streams, and no slot is re-posted. */
  pthread_mutex_lock(&s->lock);
  s->stopping = 1;
  pthread_mutex_unlock(&s->lock);
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);

  /* 3. Calls being worked on (a Push being added, an Apply running) get the
   * grace period. Calls waiting for data do not hold shutdown up: with no new
   * Push admitted, what they wait for can only come from work already in
   * progress, which this loop waits for. */
  struct timespec until;
  timespec_after_ms(&until, s->grace_ms);
  pthread_mutex_lock(&s->lock);
  while (has_work_locked(s))
    if (pthread_cond_timedwait(&s->cond, &s->lock, &until) != 0)
      break;
  s->closing = 1;
  for (list_node *n = s->watchers.next, *next; n != &s->watchers; n = next) {
    next = n->next; /* a kick that fails takes the stream off the list */
    gcall *w = container_of(n, gcall, node);
    w->w_ending = 1;
    gsrv__watch_kick_locked(s, w);
  }
  list_node queued, *n;
  list_init(&queued);
  while ((n = list_pop(&s->answer_wait)) != NULL)
    list_push(&queued, n);
  pthread_mutex_unlock(&s->lock);
  /* Answers still waiting for room are not built any more. */
  while ((n = list_pop(&queued)) != NULL) {
    gcall *w = container_of(n, gcall, aw_node);
    gsrv__finish_err(w, w->aw_claimed, ZS_ECLOSED, "the server is shutting down");
    gcall_unref(w);
  }
  /* Forwards not started are answered ECLOSED; those in flight (given the
   * grace above) end within their deadline and answer. From here on a write
   * that succeeds is answered ECLOSED, not forwarded. */
  gsrv__fwd_stop(s);

  /* 4. Every call still open is answered ECLOSED; a core callback that comes
   * later finds it claimed. The list is walked afresh after each answer since
   * the lock is dropped to answer. */
  for (;;) {
    gcall *c = NULL;
    pthread_mutex_lock(&s->lock);
    for (list_node *n = s->inflight.next; n != &s->inflight; n = n->next) {
      gcall *i = container_of(n, gcall, node);
      if (atomic_exchange(&i->claimed, 1) == 0) {
        c = i;
        gcall_ref(c);
        break;
      }
    }
    pthread_mutex_unlock(&s->lock);
    if (!c)
      break;
    gsrv__send_final(c, NULL, ZS_ECLOSED, "the server is shutting down");
    gcall_unref(c);
  }

  /* 5. gRPC reports shutdown once every call is released; then the queue is
   * drained and the threads end. */
  teardown(s);
}
