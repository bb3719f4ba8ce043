/*
 * grpc_budget — the limits on what calls hold while they wait: parked calls
 * per server, connection and address, and Pull answers built and not yet
 * taken (docs/OPERATIONS.md, "Limits").
 */
#include "server/transport/grpc/grpc_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"

/* ------------------------------------------------------------------------ */
/* Parked calls                                                             */
/* ------------------------------------------------------------------------ */

/* A parked call costs the server its gRPC call and stream (about 14 KiB) for
 * as long as it waits, up to GSRV_MAX_WAIT_MS. So each one is counted against
 * a whole-server and a per-connection budget, and each has its
 * RECV_CLOSE_ON_SERVER pending from the start: a cancel or a disconnect
 * completes it at once, which answers the call, releases the gRPC call and
 * ends the core's wait (core_cancel_waits) then, not when the wait ends. */

static uint32_t peer_bucket(const char *peer) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const unsigned char *p = (const unsigned char *)peer; *p; p++)
    h = (h ^ *p) * 16777619u;
  return h % GSRV_PEER_BUCKETS;
}

/* The entry of `peer`; NULL when there is none. */
static peer_count *peer_find_locked(gsrv *s, const char *peer) {
  const list_node *bucket = &s->peers[peer_bucket(peer)];
  for (list_node *n = bucket->next; n != bucket; n = n->next) {
    peer_count *e = container_of(n, peer_count, node);
    if (strcmp(e->peer, peer) == 0)
      return e;
  }
  return NULL;
}

/* The entry of `peer`, made if there is none; NULL when out of memory. */
static peer_count *peer_get_locked(gsrv *s, const char *peer) {
  peer_count *e = peer_find_locked(s, peer);
  if (e)
    return e;
  size_t n = strlen(peer) + 1;
  if (!(e = calloc(1, sizeof *e + n)))
    return NULL;
  memcpy(e->peer, peer, n);
  list_push(&s->peers[peer_bucket(peer)], &e->node);
  return e;
}

/* Frees the entry of `peer` once nothing is counted in it. */
static void peer_put_locked(gsrv *s, const char *peer) {
  peer_count *e = peer_find_locked(s, peer);
  if (e && e->n == 0 && e->answer_bytes == 0) {
    list_remove(&e->node);
    free(e);
  }
}

/* The key of a connection's address in s->peers: "@" and grpc's peer name
 * without its port ("@ipv4:10.0.0.7"), so that one host's connections share
 * one count. */
static void peer_addr_key(const char *peer, char *buf, size_t len) {
  snprintf(buf, len, "@%s", peer);
  char *colon = strrchr(buf, ':');
  if ((strncmp(peer, "ipv4:", 5) == 0 || strncmp(peer, "ipv6:", 5) == 0) && colon &&
      colon > buf + 5)
    *colon = '\0';
}

/* One address may park a quarter of the server's budget (at least one
 * connection's), so that a single host opening many connections cannot take
 * every slot from the others. */
static uint32_t park_addr_cap(const gsrv *s) {
  uint32_t q = s->lim.max_parked / 4u;
  return q > s->lim.max_parked_per_conn ? q : s->lim.max_parked_per_conn;
}

/* Counts the call against the budgets; returns 0, or ZS_ELIMIT with the
 * sentence in err when one is full. A call whose version is there already
 * (`now`) does not park: it is never refused and never counted. s->lock
 * held. */
static int park_count_locked(gsrv *s, gcall *c, int now, char *err, size_t errlen) {
  if (now)
    return 0;
  const char *peer = c->peer ? c->peer : "unknown";
  char addr[160];
  peer_addr_key(peer, addr, sizeof addr);
  if (s->nparked >= s->lim.max_parked)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "the server already holds %" PRIu32
                       " waiting calls (Pull, GradStats), its limit; retry later",
                       s->lim.max_parked);
  const peer_count *f = peer_find_locked(s, peer);
  if (f && f->n >= s->lim.max_parked_per_conn)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "this connection already has %" PRIu32
                       " waiting calls (Pull, GradStats), the server's limit per connection",
                       s->lim.max_parked_per_conn);
  f = peer_find_locked(s, addr);
  if (f && f->n >= park_addr_cap(s))
    return status_fail(err, errlen, ZS_ELIMIT,
                       "this address already has %" PRIu32
                       " waiting calls (Pull, GradStats), the server's limit per address",
                       park_addr_cap(s));
  peer_count *e = peer_get_locked(s, peer), *a = e ? peer_get_locked(s, addr) : NULL;
  if (!a) {
    if (e)
      peer_put_locked(s, peer);
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory counting a waiting call");
  }
  e->n++;
  a->n++;
  s->nparked++;
  c->parked = 1;
  return 0;
}

/* Takes the call off the budgets (once; later calls do nothing). */
void gsrv__park_uncount(gcall *c) {
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  if (c->parked) {
    c->parked = 0;
    s->nparked--;
    const char *peer = c->peer ? c->peer : "unknown";
    char addr[160];
    peer_addr_key(peer, addr, sizeof addr);
    peer_count *e = peer_find_locked(s, peer);
    if (e)
      e->n--;
    peer_put_locked(s, peer);
    if ((e = peer_find_locked(s, addr)) != NULL)
      e->n--;
    peer_put_locked(s, addr);
  }
  pthread_mutex_unlock(&s->lock);
}

static void on_park_close(gtag *t, int ok) {
  (void)ok;
  gcall *c = container_of(t, gcall, close_tag);
  gsrv__park_uncount(c);
  /* Not cancelled: the final batch went out, nothing is left to do. Else the
   * peer cancelled or went away: the call is answered now (a core callback
   * that comes later finds it claimed), which releases the gRPC call. */
  if (c->cancelled) {
    gsrv__answer(c, NULL, ZS_ECANCELED, "the client cancelled the call or went away");
    /* The core's callback then finds the call answered and drops it. */
    core_cancel_waits(c->s->core, c);
  }
  gcall_unref(c);
}

/* Before a call may wait in the core for version `want` (a Pull's
 * min_version, a GradStats' step): counts one that may wait against the
 * budgets (service_wait_admission: one whose version is there is neither
 * counted nor refused) and starts its RECV_CLOSE_ON_SERVER. Returns 0, or a
 * status with the sentence in err (the caller answers it). The count ends
 * when the call closes (on_park_close), or earlier by gsrv__park_uncount when it
 * does not wait. */
int gsrv__park_begin(gsrv *s, gcall *c, uint64_t want, char *err, size_t errlen) {
  int now = service_wait_admission(s->svc, c->hash, want);
  if (!c->peer)
    c->peer = grpc_call_get_peer(c->call);
  pthread_mutex_lock(&s->lock);
  int rc = park_count_locked(s, c, now, err, errlen);
  if (rc == 0)
    c->waiting = 1;
  pthread_mutex_unlock(&s->lock);
  if (rc)
    return rc;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  c->close_tag.done = on_park_close;
  c->close_started = 1;
  gcall_ref(c);
  grpc_call_error e = gsrv__start_batch(c->call, &op, 1, &c->close_tag);
  if (e != GRPC_CALL_OK) {
    c->close_started = 0;
    gcall_unref(c);
    gsrv__set_waiting(c, 0);
    gsrv__park_uncount(c);
    return status_fail(err, errlen, ZS_EINTERNAL, "cannot watch the call for a cancel: %s",
                       grpc_call_error_to_string(e));
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Pull answers                                                             */
/* ------------------------------------------------------------------------ */

/* A Pull's answer (the piece, up to 1 GiB) is built once its version is there
 * and held until gRPC has handed it to the socket, which a peer that does not
 * read delays as long as it likes. So answers count against a whole-server
 * and a per-connection budget while they are held. One that does not fit
 * waits in gsrv.answer_wait and is built when room is made, rather than
 * refused: an honest trainer's pulls all come due at once after an apply. */

static int answer_fits_locked(const gsrv *s, const peer_count *e, uint64_t n) {
  return (s->answer_bytes == 0 || s->answer_bytes + n <= s->lim.max_answer_bytes) &&
         (e->answer_bytes == 0 || e->answer_bytes + n <= s->lim.max_answer_bytes_per_conn);
}

static void answer_count_locked(gsrv *s, peer_count *e, gcall *c, uint64_t n) {
  s->answer_bytes += n;
  e->answer_bytes += n;
  c->answer_held = n;
  c->answer_since_ms = clock_now_ms();
}

/* Cancels the calls whose answers were held past answer_stall_ms (their peers
 * stopped reading): their final batches fail, which gives the room back.
 * s->lock held; a call still in s->inflight has its grpc_call. */
static void answer_cancel_stalled_locked(gsrv *s) {
  uint64_t now = clock_now_ms();
  for (list_node *n = s->inflight.next; n != &s->inflight; n = n->next) {
    gcall *i = container_of(n, gcall, node);
    if (!i->answer_held || i->stall_cancelled || !i->call ||
        now - i->answer_since_ms < s->lim.answer_stall_ms)
      continue;
    i->stall_cancelled = 1;
    LOG_WARN("grpc_answer_stalled", "bytes=%" PRIu64 " held_ms=%" PRIu64, i->answer_held,
             now - i->answer_since_ms);
    grpc_call_cancel(i->call, NULL);
  }
}

/* Room for c's answer (c->nbytes bytes): 1 when counted, 0 when c waits in
 * the queue (with a reference) for gsrv__answer_release to build it, -1 when out
 * of memory. */
int gsrv__answer_reserve(gsrv *s, gcall *c, int claimed) {
  int rc = -1;
  pthread_mutex_lock(&s->lock);
  peer_count *e = peer_get_locked(s, c->peer ? c->peer : "unknown");
  if (e && (s->closing || answer_fits_locked(s, e, c->nbytes))) {
    answer_count_locked(s, e, c, c->nbytes);
    rc = 1;
  } else if (e) {
    c->aw_claimed = claimed;
    gcall_ref(c);
    list_push(&s->answer_wait, &c->aw_node);
    answer_cancel_stalled_locked(s);
    rc = 0;
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* Room for an answer of n bytes that cannot wait: 0 when counted, else
 * ZS_ELIMIT (or ZS_ENOMEM) with the sentence in err. */
int gsrv__answer_try_reserve(gsrv *s, gcall *c, uint64_t n, char *err, size_t errlen) {
  if (!c->peer)
    c->peer = grpc_call_get_peer(c->call);
  pthread_mutex_lock(&s->lock);
  peer_count *e = peer_get_locked(s, c->peer ? c->peer : "unknown");
  int rc = 0;
  if (!e) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory counting an answer");
  } else if (!answer_fits_locked(s, e, n)) {
    rc = status_fail(err, errlen, ZS_ELIMIT,
                     "answers not yet taken hold %" PRIu64 " bytes on this connection and %" PRIu64
                     " on the server, the limits; read them, or retry later",
                     e->answer_bytes, s->answer_bytes);
    peer_put_locked(s, c->peer ? c->peer : "unknown");
  } else {
    answer_count_locked(s, e, c, n);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* Gives back the room of c's answer, if it has any, and builds the waiting
 * answers that fit now (once each, in queue order per connection). */
void gsrv__answer_release(gcall *c) {
  gsrv *s = c->s;
  list_node run; /* the answers built below, in queue order */
  list_init(&run);
  pthread_mutex_lock(&s->lock);
  if (!c->answer_held) {
    pthread_mutex_unlock(&s->lock);
    return;
  }
  const char *peer = c->peer ? c->peer : "unknown";
  peer_count *e = peer_find_locked(s, peer);
  s->answer_bytes -= c->answer_held;
  if (e)
    e->answer_bytes -= c->answer_held;
  c->answer_held = 0;
  peer_put_locked(s, peer);
  for (list_node *n = s->answer_wait.next, *next; n != &s->answer_wait; n = next) {
    next = n->next; /* a call that fits moves to `run` */
    gcall *w = container_of(n, gcall, aw_node);
    peer_count *we = peer_get_locked(s, w->peer ? w->peer : "unknown");
    if (we && answer_fits_locked(s, we, w->nbytes)) {
      answer_count_locked(s, we, w, w->nbytes);
      list_remove(n);
      list_push(&run, n);
    }
  }
  pthread_mutex_unlock(&s->lock);
  /* `run` is this thread's alone now: no other thread sees its calls. */
  for (list_node *n; (n = list_pop(&run)) != NULL;) {
    gcall *w = container_of(n, gcall, aw_node);
    gsrv__pull_build(w, w->aw_claimed);
    gcall_unref(w);
  }
}
