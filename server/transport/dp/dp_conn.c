/*
 * dp_conn — a connection's life on the loop thread: accepting it (its peer
 * address's entry, the connection caps and the eviction of connections not
 * yet authenticated), its reference count, whether it is read
 * (backpressure), and closing it. What it reads is dp_read.c's; what it
 * answers, dp_answer.c's.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

/* The entry of the address in `ss` (created with no count), with one more
 * reference; NULL when out of memory. A linear list: there are at most as
 * many entries as connections, and one look per accept. */
static dp_peer *peer_get(dp_server *s, const struct sockaddr_storage *ss) {
  int fam = ss->ss_family;
  uint8_t ip[16] = {0};
  if (fam == AF_INET)
    memcpy(ip, &((const struct sockaddr_in *)ss)->sin_addr, 4);
  else if (fam == AF_INET6)
    memcpy(ip, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
  for (list_node *n = s->peers.next; n != &s->peers; n = n->next) {
    dp_peer *p = container_of(n, dp_peer, node);
    if (p->family == fam && memcmp(p->ip, ip, sizeof ip) == 0) {
      p->refs++;
      return p;
    }
  }
  dp_peer *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  p->family = fam;
  memcpy(p->ip, ip, sizeof ip);
  p->refs = 1;
  list_push(&s->peers, &p->node);
  return p;
}

static void peer_unref(dp_peer *p) {
  if (!p || --p->refs > 0)
    return;
  list_remove(&p->node);
  free(p);
}

void dp__conn_free(dp_conn *c) {
  if (c->token) {
    explicit_bzero(c->token, c->token_len);
    free(c->token);
  }
  list_remove(&c->node);
  wire_reader_free(&c->rd);
  dp__buf_free(c->rx);
  peer_unref(c->pe);
  free(c);
}

void dp__conn_ref(dp_conn *c) {
  c->refs++;
}

void dp__conn_unref(dp_conn *c) {
  if (--c->refs == 0)
    dp__conn_free(c);
}

static void on_conn_closed(stream *st, void *data) {
  (void)st;
  dp_conn *c = data;
  dp__conn_unref(c);
}

void dp__conn_set_mid(dp_conn *c, int mid) {
  if (mid != c->mid) {
    c->mid = mid;
    dp__count(&c->s->st_mid, mid ? 1 : -1);
  }
}

/* The connection stops counting against the caps (when it closes, or at
 * once when it is refused and only its ERROR frame is still to be sent). */
static void conn_uncount(dp_conn *c) {
  dp_server *s = c->s;
  if (!c->counted)
    return;
  c->counted = 0;
  s->nconns--;
  dp__count(&s->st_conns, -1);
  c->pe->conns--;
  if (!c->authed) {
    s->nunauth--;
    dp__count(&s->st_unauth, -1);
    c->pe->unauth--;
    list_remove(&c->unode);
  }
}

void dp__conn_close(dp_conn *c) {
  if (c->closing)
    return;
  dp_server *s = c->s;
  c->closing = 1;
  list_remove(&c->fair);
  list_remove(&c->starve);
  list_remove(&c->node);
  list_push(&s->zombies, &c->node);
  conn_uncount(c);
  dp__conn_set_mid(c, 0);
  if (c->bp) {
    c->bp = 0;
    dp__count(&s->st_paused, -1);
  }
  /* The receive buffer of an unfinished PUSH and the Pulls not yet answered
   * go with the stream (the stream's reference keeps c alive meanwhile). */
  dp__pool_put(s, c->rx);
  c->rx = NULL;
  while (c->ready_head) {
    dp_pull *p = c->ready_head;
    c->ready_head = p->next;
    c->pending--;
    dp__pull_free(p);
    dp__conn_unref(c);
  }
  c->ready_tail = NULL;
  /* Writes still queued complete with ZS_ECANCELED in on_written. */
  stream_close(c->st, on_conn_closed);
}

void dp__conn_update_reading(dp_conn *c) {
  int want = !c->closing && !c->eof && !c->fatal && c->pause == 0;
  if (want && !c->reading) {
    if (stream_read_start(c->st, dp__on_alloc, dp__on_read) == 0) {
      c->reading = 1;
      /* Time spent paused by us is not the peer's stall. */
      c->last_progress_ms = clock_now_ms();
    } else {
      dp__conn_close(c);
    }
  } else if (!want && c->reading) {
    stream_read_stop(c->st);
    c->reading = 0;
  }
}

/* Re-evaluates the backpressure bound after pending or queued changed, and
 * closes a half-closed connection once everything is answered. */
void dp__conn_check(dp_conn *c) {
  if (c->closing)
    return;
  dp_server *s = c->s;
  /* A peer that shut its side gets the answers in progress, but not those
   * of Pulls still waiting for their version: those can take minutes, and
   * the connection's slot is freed for others at once (their records stay
   * with the core until the wait ends, never touching the connection). */
  if (c->eof && c->pending == c->waiting) {
    dp__conn_close(c);
    return;
  }
  /* Waiting Pulls hold no buffer and must not stop the reads: the Push
   * their version needs may be the next frame. */
  int over = c->pending - c->waiting >= s->max_pending || c->queued >= s->max_queued ||
             c->consuming >= DP_CONSUME_WINDOW;
  if (over != c->bp) {
    c->bp = over;
    dp__count(&s->st_paused, over ? 1 : -1);
    if (over)
      c->pause |= PAUSE_BACKPRESSURE;
    else
      c->pause &= ~PAUSE_BACKPRESSURE;
    dp__conn_update_reading(c);
  }
}

/* Whether a refused connection gets its log line: one a second at most, so
 * that a flood of them (or of guessed tokens) does not flood the log too;
 * *quiet gets how many went unlogged since the last line. */
int dp__refusal_logged(dp_server *s, uint64_t *quiet) {
  uint64_t now = clock_now_ms();
  if (now - s->refuse_log_ms < 1000u) {
    s->refuse_quiet++;
    return 0;
  }
  *quiet = s->refuse_quiet;
  s->refuse_log_ms = now;
  s->refuse_quiet = 0;
  return 1;
}

/* Names the peer for log lines and finds its address's entry (a peer whose
 * address cannot be read shares the entry of the empty address). Returns 0
 * or ZS_ENOMEM. */
static int peer_name(dp_conn *c) {
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  status_say(c->peer, sizeof c->peer, "?");
  int known = stream_peer_addr(c->st, &ss) == 0;
  c->pe = peer_get(c->s, &ss);
  if (!c->pe)
    return ZS_ENOMEM;
  if (!known)
    return 0;
  char host[48] = "";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
    uv_ip4_name(a, host, sizeof host);
    port = ntohs(a->sin_port);
    status_say(c->peer, sizeof c->peer, "%s:%d", host, port);
  } else if (ss.ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
    uv_ip6_name(a, host, sizeof host);
    port = ntohs(a->sin6_port);
    status_say(c->peer, sizeof c->peer, "[%s]:%d", host, port);
  }
  return 0;
}

/* A connection over a cap: told why (request id 0), then closed. */
static void conn_refuse(dp_conn *c, const char *why) {
  dp_server *s = c->s;
  uint64_t quiet = 0;
  if (dp__refusal_logged(s, &quiet))
    LOG_WARN("dp_accept", "peer=%s refused_since_last_line=%" PRIu64 " detail=\"%s\"", c->peer,
             quiet, why);
  /* A burst of refused connections must not fill the caps for the next
   * ones while their ERROR frames are on their way. */
  conn_uncount(c);
  c->fatal = 1;
  wire_msg m = {.type = WIRE_ERROR, .request_id = 0};
  m.u.error.status = ZS_ELIMIT;
  status_say(m.u.error.message, sizeof m.u.error.message, "%s", why);
  dp__conn_send(c, &m, NULL, 0, 1);
}

/* Closes the oldest connection not yet authenticated (from peer `pe`, or
 * from anyone when pe is NULL), other than `keep`, telling it why. */
static void unauth_evict_oldest(dp_server *s, const dp_peer *pe, const dp_conn *keep) {
  for (list_node *l = s->unauth_q.next; l != &s->unauth_q; l = l->next) {
    dp_conn *v = container_of(l, dp_conn, unode);
    if (v == keep || (pe && v->pe != pe))
      continue;
    dp__count(&s->st_unauth_evicted, 1);
    if (v->fatal) {
      dp__conn_close(v); /* already refused: its ERROR frame was on its way */
      return;
    }
    char why[200];
    status_say(why, sizeof why,
               "closed without HELLO: a newer connection needed the room (%u data-plane "
               "connections not yet authenticated, %u from one address)",
               s->max_unauth, s->max_unauth_peer);
    conn_refuse(v, why);
    return;
  }
}

void dp__on_connection(stream_listener *l, void *data, int status, stream *st) {
  dp_server *s = data;
  if (status < 0) {
    LOG_WARN("dp_accept", "detail=\"%s\"", stream_listener_detail(l));
    return;
  }
  dp_conn *c = calloc(1, sizeof *c);
  if (!c) {
    LOG_ERROR("dp_accept", "detail=\"out of memory\"");
    stream_close(st, NULL);
    return;
  }
  c->s = s;
  c->refs = 1; /* the stream's, dropped in on_conn_closed */
  wire_reader_init(&c->rd, s->max_payload);
  /* Until the HELLO, a stranger costs a few KiB at most. */
  wire_reader_limit_meta(&c->rd, WIRE_MAX_HELLO_META);
  /* c->fair and c->starve stay zeroed (unlinked) until they are used. */
  c->st = st;
  stream_set_data(st, c);
  if (peer_name(c) != 0) {
    LOG_ERROR("dp_accept", "detail=\"out of memory\"");
    stream_close(st, NULL);
    free(c);
    return;
  }
  list_push(&s->live, &c->node);
  list_push(&s->unauth_q, &c->unode);
  c->counted = 1;
  s->nconns++;
  s->nunauth++;
  c->pe->conns++;
  c->pe->unauth++;
  dp__count(&s->st_conns, 1);
  dp__count(&s->st_unauth, 1);
  dp__count(&s->st_accepted, 1);
  c->accepted_ms = c->last_progress_ms = clock_now_ms();
  /* Small answers (acks, errors, latency probes) must not wait for Nagle. */
  stream_set_option(c->st, STREAM_OPT_NODELAY, 1);
  /* Checked at start; should the kernel refuse it now (the allowed list
   * changed), the connection keeps the host's default and a line says so. */
  if (s->congestion[0] && stream_set_congestion(c->st, s->congestion) != 0)
    LOG_WARN("dp_congestion_failed", "cc=%s detail=\"%s\"", s->congestion, stream_detail(c->st));
  /* Likewise: an unpaced connection still works, and a line says so. */
  if (s->pacing_mbit && stream_set_pacing(c->st, s->pacing_mbit) != 0)
    LOG_WARN("dp_pacing_failed", "pacing_mbit=%u detail=\"%s\"", s->pacing_mbit,
             stream_detail(c->st));
  if (s->pacer && stream_pacer_join(c->st, s->pacer) != 0)
    LOG_WARN("dp_link_pacing_failed", "detail=\"%s\"", stream_detail(c->st));
  char why[160];
  if (s->nconns > s->max_conns)
    status_say(why, sizeof why, "the server's limit of %u data-plane connections is reached",
               s->max_conns);
  else if (c->pe->conns > s->max_per_peer)
    status_say(why, sizeof why,
               "the limit of %u data-plane connections from one address is reached",
               s->max_per_peer);
  else
    why[0] = '\0';
  if (why[0]) {
    dp__count(&s->st_limit_refused, 1);
    conn_refuse(c, why);
    return;
  }
  /* Over its address's share, or the server's budget, of connections that
   * have not said HELLO: the oldest such connection (of that address, or
   * any) makes room, never the new one. A trainer says HELLO at once, so
   * strangers that connect and wait can no longer keep it out; they only
   * push each other out. */
  if (c->pe->unauth > s->max_unauth_peer)
    unauth_evict_oldest(s, c->pe, c);
  if (s->nunauth > s->max_unauth)
    unauth_evict_oldest(s, NULL, c);
  dp__conn_update_reading(c);
}
