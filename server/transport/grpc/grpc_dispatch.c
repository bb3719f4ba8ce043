/*
 * grpc_dispatch — from a request slot to a handler: the slots posted to gRPC,
 * the caller's token checked against its method's role, the request's size,
 * the replica gate, then the handler of grpc_methods.c.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "common/net/rpc_client.h"

static void on_request(gtag *t, int ok);

/* Offers gRPC one more slot for `method`. Called with s->lock held, checking
 * s->stopping under it, so that no slot is posted once shutdown began (a slot
 * posted later would complete on a queue that is already shut down). */
int gsrv__post_slot_locked(gsrv *s, int method) {
  gcall *c = gcall_new(s, method);
  if (!c)
    return ZS_ENOMEM;
  c->req_tag.done = on_request;
  grpc_call_error e;
  tsan_release(&c->req_tag);
  if (method == M_GENERIC)
    e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq,
                                 &c->req_tag);
  else
    e = grpc_server_request_registered_call(s->server, s->reg[method], &c->call, &c->deadline,
                                            &c->md, &c->payload, s->cq, s->cq, &c->req_tag);
  if (e != GRPC_CALL_OK) {
    LOG_ERROR("grpc_request_failed", "error=%s", grpc_call_error_to_string(e));
    gcall_unref(c);
    return ZS_EINTERNAL;
  }
  return 0;
}

static const char *call_token(const gcall *c, size_t *len) {
  const size_t scheme = strlen(RPC_AUTH_SCHEME);
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, RPC_AUTH_KEY) != 0)
      continue;
    const char *v = (const char *)GRPC_SLICE_START_PTR(c->md.metadata[i].value);
    size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
    /* The scheme's name is case-insensitive (RFC 7235). */
    if (n <= scheme || strncasecmp(v, RPC_AUTH_SCHEME, scheme) != 0)
      return NULL;
    *len = n - scheme;
    return v + scheme;
  }
  return NULL;
}

/* Logs a refusal with the peer's address, at most one a second: a scan or a
 * misconfigured trainer in a loop must not flood the log. */
static void log_refusal(gsrv *s, gcall *c, int zs) {
  uint64_t now = clock_now_ns();
  uint64_t last = atomic_load(&s->refuse_ns);
  if (now - last < 1000000000ull || !atomic_compare_exchange_strong(&s->refuse_ns, &last, now)) {
    atomic_fetch_add(&s->refused, 1);
    return;
  }
  unsigned suppressed = atomic_exchange(&s->refused, 0);
  char *peer = grpc_call_get_peer(c->call);
  const char *path = c->method < M_COUNT ? gsrv__methods[c->method].path : "unknown";
  LOG_WARN("auth_refused", "method=%s peer=%s error=%s suppressed=%u", path, peer ? peer : "?",
           zs_err_name(zs), suppressed);
  gpr_free(peer);
}

/* Answers the call UNAUTHENTICATED or PERMISSION_DENIED and returns -1 when
 * its token does not allow its method; returns 0 otherwise. */
static int authorize(gsrv *s, gcall *c) {
  auth_role need = gsrv__methods[c->method].role;
  memset(&c->bind, 0, sizeof c->bind);
  c->admin = !auth_keys_enabled(s->auth);
  c->role = AUTH_ADMIN;
  if (c->admin)
    return 0;
  size_t len = 0;
  const char *token = call_token(c, &len);
  auth_role role = auth_keys_check_bound(s->auth, token, token ? len : 0, &c->bind);
  c->admin = auth_allows(role, AUTH_ADMIN);
  c->role = role;
  if (need == AUTH_NONE || auth_allows(role, need))
    return 0;
  int zs = role == AUTH_NONE ? ZS_EUNAUTHENTICATED : ZS_EPERM;
  log_refusal(s, c, zs);
  gsrv__answer(c, NULL, zs,
               zs == ZS_EPERM ? "this method needs the admin token (--admin-token-file); the call "
                                "carried a trainer's"
               : token        ? "the call's token is not valid on this server"
                       : "the call carries no \"authorization: Bearer <token>\" metadata and "
                         "this server requires a token");
  return -1;
}

static void dispatch(gsrv *s, gcall *c) {
  if (authorize(s, c) != 0)
    return;
  if (c->method == M_GENERIC) {
    char err[GSRV_ERRLEN];
    size_t n = GRPC_SLICE_LENGTH(c->details.method);
    snprintf(err, sizeof err, "unknown method %.*s", (int)(n > 200 ? 200 : n),
             (const char *)GRPC_SLICE_START_PTR(c->details.method));
    gsrv__answer(c, NULL, ZS_EUNIMPL, err);
    return;
  }
  if (!c->payload) {
    gsrv__answer(c, NULL, ZS_EPROTO, "the call carries no request message");
    return;
  }
  size_t n = grpc_byte_buffer_length(c->payload);
  if (n > gsrv__methods[c->method].max_request) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "a %s request has at most %zu bytes, not %zu",
             strrchr(gsrv__methods[c->method].path, '/') + 1, gsrv__methods[c->method].max_request,
             n);
    gsrv__answer(c, NULL, ZS_ELIMIT, err);
    return;
  }
  grpc_slice msg;
  if (rpc_message_slice(c->payload, &msg) != 0) {
    gsrv__answer(c, NULL, ZS_EPROTO, "the request message cannot be read");
    return;
  }
  /* The message is in msg now; the byte buffer is not needed any more. */
  grpc_byte_buffer_destroy(c->payload);
  c->payload = NULL;
  if (!s->rep || gsrv__replica_gate(s, c, GRPC_SLICE_START_PTR(msg), GRPC_SLICE_LENGTH(msg)) == 0)
    gsrv__methods[c->method].fn(s, c, GRPC_SLICE_START_PTR(msg), GRPC_SLICE_LENGTH(msg));
  /* The message may share its memory with other calls' messages (slices of
   * one read buffer), and the last unreference frees it on whichever polling
   * thread drops it, ordered by gRPC's own atomic reference count: invisible
   * to ThreadSanitizer, hence not recorded (common/base/tsan.h). */
  tsan_ignore_begin();
  grpc_slice_unref(msg);
  tsan_ignore_end();
}

static void on_request(gtag *t, int ok) {
  gcall *c = container_of(t, gcall, req_tag);
  gsrv *s = c->s;
  if (!ok) { /* the server shuts down: the slot is returned unfilled */
    gcall_unref(c);
    return;
  }
  c->start_ns = clock_now_ns();
  pthread_mutex_lock(&s->lock);
  if (!s->stopping)
    gsrv__post_slot_locked(s, c->method);
  int closing = s->closing;
  if (c->method != M_HEALTH_WATCH)
    list_push(&s->inflight, &c->node);
  pthread_mutex_unlock(&s->lock);
  if (closing)
    gsrv__answer(c, NULL, ZS_ECLOSED, "the server is shutting down");
  else
    dispatch(s, c);
  gcall_unref(c); /* the handler's reference */
}
