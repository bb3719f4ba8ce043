/*
 * grpc_health — grpc.health.v1.Health: Check, and Watch streams told of each
 * change of the serving status.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/slice.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/base/log.h"
#include "grpc/health/v1/health.pb-c.h"

/* The health protocol names the whole server "" and each service by its full
 * name; this server has one service. */
static int service_known(const char *name) {
  return name[0] == '\0' || strcmp(name, SERVICE_NAME) == 0;
}

static int health_status_locked(const gsrv *s) {
  return s->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                    : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

void gsrv__h_health_check(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Grpc__Health__V1__HealthCheckRequest *r =
      UNPACK(Grpc__Health__V1__HealthCheckRequest,
             grpc__health__v1__health_check_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "grpc.health.v1.HealthCheckRequest");
    return;
  }
  if (!service_known(r->service)) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "unknown service \"%.100s\"", r->service);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    gsrv__finish_err(c, 0, ZS_ENOTFOUND, err);
    return;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  pthread_mutex_lock(&s->lock);
  resp.status = health_status_locked(s);
  pthread_mutex_unlock(&s->lock);
  gsrv__finish_msg(c, 0, &resp.base);
}

static void on_watch_sent(gtag *t, int ok);
static void on_watch_final(gtag *t, int ok);
static void on_watch_close(gtag *t, int ok);

/* Sends what a Watch stream owes: the status if it differs from the last one
 * sent, else the end of the stream when the server shuts down. One batch at a
 * time, so messages leave in order. */
void gsrv__watch_kick_locked(gsrv *s, gcall *c) {
  if (c->w_sending || c->w_final || c->w_closed)
    return;
  int st = c->w_known ? health_status_locked(s)
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (st != c->w_sent) {
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = st;
    if (c->w_sent < 0)
      ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    c->reply = gsrv__pack_message(&resp.base);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = c->reply;
    c->w_sending = 1;
    c->w_sent = st;
    c->io_tag.done = on_watch_sent;
    gcall_ref(c);
    grpc_call_error e = gsrv__start_batch(c->call, ops, n, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
      grpc_byte_buffer_destroy(c->reply);
      c->reply = NULL;
      c->w_sending = 0;
      c->w_closed = 1; /* give up on this stream */
      gcall_unref(c);
    }
  } else if (c->w_ending) {
    /* The stream ends with a status alone: its initial metadata went with
     * the first message and its RECV_CLOSE_ON_SERVER has its own batch. */
    c->w_final = 1;
    gsrv__status_op(c, &ops[0], ZS_ECLOSED, "the server is shutting down");
    c->io_tag.done = on_watch_final;
    gcall_ref(c);
    grpc_call_error e = gsrv__start_batch(c->call, ops, 1, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
      gsrv__watch_remove_locked(s, c);
      pthread_cond_broadcast(&s->cond);
      gcall_unref(c); /* cannot be the last: the caller holds one */
    }
  }
}

static void on_watch_sent(gtag *t, int ok) {
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  grpc_byte_buffer_destroy(c->reply);
  c->reply = NULL;
  c->w_sending = 0;
  if (!ok)
    c->w_closed = 1; /* the peer is gone; RECV_CLOSE_ON_SERVER will say so */
  else
    gsrv__watch_kick_locked(s, c);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

static void on_watch_final(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  grpc_slice_unref(c->trailer.value);
  c->trailer.value = grpc_empty_slice();
  pthread_mutex_lock(&s->lock);
  gsrv__watch_remove_locked(s, c);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

static void on_watch_close(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, close_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  c->w_closed = 1;
  gsrv__watch_remove_locked(s, c);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  gcall_unref(c);
}

void gsrv__h_health_watch(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Grpc__Health__V1__HealthCheckRequest *r =
      UNPACK(Grpc__Health__V1__HealthCheckRequest,
             grpc__health__v1__health_check_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "grpc.health.v1.HealthCheckRequest");
    return;
  }
  /* An unknown service is not an error for Watch: the health protocol says
   * to stream SERVICE_UNKNOWN, since the service may appear later. */
  c->w_known = service_known(r->service);
  protobuf_c_message_free_unpacked(&r->base, NULL);

  pthread_mutex_lock(&s->lock);
  if (s->closing) {
    pthread_mutex_unlock(&s->lock);
    gsrv__answer(c, NULL, ZS_ECLOSED, "the server is shutting down");
    return;
  }
  if (s->nwatchers >= s->lim.max_watchers) {
    uint32_t max = s->lim.max_watchers;
    pthread_mutex_unlock(&s->lock);
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err,
             "the server already streams %" PRIu32
             " health Watch calls, its limit; use Check, or retry later",
             max);
    gsrv__answer(c, NULL, ZS_ELIMIT, err);
    return;
  }
  /* The stream is ours from here on: nobody else answers it. */
  atomic_store(&c->claimed, 1);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  c->close_tag.done = on_watch_close;
  gcall_ref(c);
  grpc_call_error e = gsrv__start_batch(c->call, &op, 1, &c->close_tag);
  if (e != GRPC_CALL_OK) {
    pthread_mutex_unlock(&s->lock);
    gcall_unref(c);
    LOG_ERROR("grpc_batch_failed", "method=Watch error=%s", grpc_call_error_to_string(e));
    return;
  }
  list_push(&s->watchers, &c->node);
  s->nwatchers++;
  gsrv__watch_kick_locked(s, c);
  pthread_mutex_unlock(&s->lock);
}

void gsrv__set_serving(gsrv *s, int serving) {
  pthread_mutex_lock(&s->lock);
  s->serving = serving;
  for (list_node *n = s->watchers.next, *next; n != &s->watchers; n = next) {
    next = n->next; /* a kick that fails takes the stream off the list */
    gsrv__watch_kick_locked(s, container_of(n, gcall, node));
  }
  pthread_mutex_unlock(&s->lock);
}
