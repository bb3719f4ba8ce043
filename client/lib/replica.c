/*
 * replica — replicated shards on the client: each shard's members (its
 * replica set, docs/CLIENT.md "Replica sets and failover"; the servers' side
 * is docs/OPERATIONS.md), the member calls go to, and the failover search
 * that finds or makes a new primary when that member fails.
 *
 * A shard listed without '|' has one member and none of this runs for it:
 * zc_call uses member 0's channel exactly as before, sends no term and
 * never searches.
 *
 * The search (zc_replica_failed), one at a time per shard:
 *   1. GetInfo to every member at once (one thread each, ZC_PROBE_MS);
 *   2. a member that is PRIMARY at the highest term anyone reported becomes
 *      the current one;
 *   3. otherwise, when the primary that term names (or, none being named,
 *      any member of a set that had a term) does not answer, nothing changes
 *      until it has not answered for failover_ms since its first failure:
 *      the callers keep retrying it meanwhile, and search again;
 *   4. then, or at once in a fresh set (no term anywhere) or when the named
 *      primary answers but is no longer primary, Promote(highest term + 1)
 *      goes to the best member that answered: one in sync (a backup) first,
 *      then the highest job version (no job counts as 0), ties to the lowest
 *      index. A refusal (ENOTPRIMARY,
 *      ESTALE, ENOTREADY) changes nothing: the caller backs off (at most
 *      ZC_PROMOTE_RETRY_MS) and its next failure searches again, so
 *      max_retries bounds the whole.
 * A failover therefore takes at most failover_ms + one GetInfo round + one
 * Promote after the primary's first failure, plus the caller's backoff
 * granularity, which the search shortens to wake at the failover deadline.
 *
 * Threads and locks: any thread that makes calls (the pool's workers, the
 * caller's threads in zs_step, the CLI) may search. zc_rset.mu is a leaf
 * held for bookkeeping only; the search's calls run without it, the
 * GetInfo round on threads of its own that it joins before it returns.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "internal.h"

/* ---- addresses ---------------------------------------------------------------- */

/* Splits `text` at every '|' into *n strings (each trimmed of blanks, maybe
 * empty), freed with zc_free_addresses. */
static int split_members(const char *text, char ***out, uint32_t *n) {
  uint32_t k = 1;
  for (const char *q = text; *q; q++)
    k += *q == '|';
  char **m = calloc(k, sizeof *m);
  if (!m)
    return zc_fail(ZS_ENOMEM, "out of memory");
  const char *p = text;
  for (uint32_t i = 0; i < k; i++) {
    const char *end = strchr(p, '|');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    const char *s = p;
    while (len && (*s == ' ' || *s == '\t'))
      s++, len--;
    while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
      len--;
    m[i] = strndup(s, len);
    if (!m[i]) {
      zc_free_addresses(m, k);
      return zc_fail(ZS_ENOMEM, "out of memory");
    }
    p = end ? end + 1 : p + strlen(p);
  }
  *out = m;
  *n = k;
  return ZS_OK;
}

int zc_shard_members(const char *shard, char ***out, uint32_t *n) {
  *out = NULL;
  *n = 0;
  return split_members(shard, out, n);
}

/* Checks the members m[0..n) of shard `shard` (text: the shard's string). */
static int check_members(uint32_t shard, const char *text, char **m, uint32_t n) {
  if (n > ZC_MAX_REPLICAS)
    return zc_fail(ZS_EINVAL,
                   "shard %" PRIu32 " ('%.200s') lists %" PRIu32 " replicas; at most %u are "
                   "supported",
                   shard, text, n, ZC_MAX_REPLICAS);
  hostport hp[ZC_MAX_REPLICAS];
  for (uint32_t i = 0; i < n; i++) {
    char why[400];
    if (!m[i][0])
      return zc_fail(ZS_EINVAL,
                     "shard %" PRIu32 " ('%.200s'): replica %" PRIu32
                     " is empty (replicas are separated by '|', shards by ',')",
                     shard, text, i);
    if (zc_address_hostport(m[i], &hp[i], why, sizeof why) != ZS_OK)
      return zc_fail(ZS_EINVAL, "shard %" PRIu32 " replica %" PRIu32 " ('%.200s'): %s", shard, i,
                     m[i], why);
    for (uint32_t j = 0; j < i; j++)
      if (hp[j].port == hp[i].port && strcasecmp(hp[j].host, hp[i].host) == 0)
        return zc_fail(ZS_EINVAL,
                       "shard %" PRIu32 " ('%.200s') lists %.200s twice (replicas %" PRIu32
                       " and %" PRIu32 "); each member of a replica set is listed once",
                       shard, text, m[i], j, i);
  }
  return ZS_OK;
}

int zc_shard_text_check(uint32_t shard, const char *text, char **norm) {
  *norm = NULL;
  char **m = NULL;
  uint32_t n = 0;
  int rc = split_members(text, &m, &n);
  if (rc != ZS_OK)
    return rc;
  rc = check_members(shard, text, m, n);
  size_t len = 0;
  for (uint32_t i = 0; i < n && rc == ZS_OK; i++)
    len += strlen(m[i]) + 1;
  char *out = rc == ZS_OK ? malloc(len) : NULL;
  if (rc == ZS_OK && !out)
    rc = zc_fail(ZS_ENOMEM, "out of memory");
  if (rc == ZS_OK) {
    out[0] = '\0';
    for (uint32_t i = 0; i < n; i++) {
      if (i)
        strcat(out, "|");
      strcat(out, m[i]);
    }
    *norm = out;
  }
  zc_free_addresses(m, n);
  return rc;
}

/* ---- the sets ------------------------------------------------------------------ */

static int rset_open(zs_client *c, zc_rset *rs, const char *text, const char *fn) {
  char **m = NULL;
  uint32_t n = 1;
  int rc;
  if (strchr(text, '|')) {
    rc = split_members(text, &m, &n);
    if (rc != ZS_OK)
      return rc;
  } else {
    m = calloc(1, sizeof *m);
    if (m)
      m[0] = strdup(text);
    if (!m || !m[0]) {
      free(m);
      return zc_fail(ZS_ENOMEM, "%s: out of memory", fn);
    }
  }
  /* zc_parse_addresses checked the count; this keeps the arrays safe. */
  if (n > ZC_MAX_REPLICAS) {
    zc_free_addresses(m, n);
    return zc_fail(ZS_EINVAL, "%s: more than %u replicas", fn, ZC_MAX_REPLICAS);
  }
  rs->n = n;
  for (uint32_t k = 0; k < n; k++) {
    rs->member[k] = m[k];
    m[k] = NULL;
  }
  free(m);
  for (uint32_t k = 0; k < n; k++) {
    rc = zc_channel_open(&c->sec, rs->member[k], &rs->chan[k], fn);
    if (rc != ZS_OK)
      return rc;
  }
  return ZS_OK;
}

int zc_rsets_open(zs_client *c, const char *fn) {
  c->rs = calloc(c->nshards, sizeof *c->rs);
  if (!c->rs)
    return zc_fail(ZS_ENOMEM, "%s: out of memory", fn);
  /* Every lock exists before anything can fail, so that the free below
   * destroys exactly what was made. */
  for (uint32_t i = 0; i < c->nshards; i++) {
    pthread_mutex_init(&c->rs[i].mu, NULL);
    pthread_cond_init(&c->rs[i].cv, NULL);
    atomic_init(&c->rs[i].gen, 1);
    c->rs[i].failover_ms = c->opt.failover_ms;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    int rc = rset_open(c, &c->rs[i], c->addr[i], fn);
    if (rc != ZS_OK)
      return rc;
  }
  return ZS_OK;
}

void zc_rsets_free(zs_client *c) {
  if (!c->rs)
    return;
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_rset *rs = &c->rs[i];
    for (uint32_t k = 0; k < ZC_MAX_REPLICAS; k++) {
      if (rs->chan[k])
        rpc_channel_close(rs->chan[k]);
      free(rs->member[k]);
    }
    pthread_mutex_destroy(&rs->mu);
    pthread_cond_destroy(&rs->cv);
  }
  free(c->rs);
  c->rs = NULL;
}

uint32_t zc_replica_current(zs_client *c, uint32_t shard, uint64_t *gen, rpc_md *md, size_t *nmd,
                            char *term_buf) {
  zc_rset *rs = &c->rs[shard];
  pthread_mutex_lock(&rs->mu);
  uint32_t k = rs->cur;
  uint64_t term = rs->term;
  *gen = atomic_load(&rs->gen);
  pthread_mutex_unlock(&rs->mu);
  *nmd = 0;
  if (term > 0) {
    snprintf(term_buf, 24, "%" PRIu64, term);
    md->key = ZC_TERM_KEY;
    md->value = term_buf;
    *nmd = 1;
  }
  return k;
}

/* Member k answered (a call succeeded): it is not down. */
static void note_answered(zc_rset *rs, uint32_t k) {
  pthread_mutex_lock(&rs->mu);
  rs->down_since[k] = 0;
  pthread_mutex_unlock(&rs->mu);
}

/* ---- the search ------------------------------------------------------------------ */

/* One member's GetInfo in a search round. */
typedef struct probe {
  zs_client *c;
  uint32_t shard, k;
  rpc_channel *ch;
  rpc_md md;
  size_t nmd;
  int answered; /* the member answered (anything) */
  int good;     /* ... as member k of this shard's set: usable */
  int role;     /* Zshard__V1__ReplicaRole */
  uint64_t term, version;
  int32_t primary;
} probe;

static void *probe_run(void *arg) {
  probe *p = arg;
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  Zshard__V1__GetInfoResponse *r = NULL;
  rpc_status st = {0};
  uint64_t timeout =
      p->c->opt.rpc_timeout_ms < ZC_PROBE_MS ? p->c->opt.rpc_timeout_ms : ZC_PROBE_MS;
  int rc = rpc_call_md(p->ch, ZC_METHOD("GetInfo"), &req.base, &p->md, p->nmd,
                       &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)&r, timeout,
                       &st);
  if (rc != ZS_OK) {
    /* An answer with an error still says the member is up. */
    p->answered = st.grpc_code != ZC_GRPC_UNAVAILABLE && st.grpc_code != ZC_GRPC_CANCELLED &&
                  st.grpc_code != 4 /* DEADLINE_EXCEEDED */;
    return NULL;
  }
  p->answered = 1;
  /* The answer is untrusted: a member that is not this shard's k-th
   * replica (a misordered list, a server without --replicas) is never
   * chosen. */
  const Zshard__V1__ReplicaInfo *ri = r->replica;
  if (r->shard_id == p->shard && ri && ri->index == p->k &&
      (ri->primary < 0 || (uint32_t)ri->primary < p->c->rs[p->shard].n)) {
    p->good = 1;
    p->role = (int)ri->role;
    p->term = ri->term;
    p->primary = ri->primary;
    p->version = (r->job && r->job[0]) || r->spec_hash ? r->version : 0;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return NULL;
}

/* GetInfo to every member of the set at once; p[k] gets member k's. */
static void probe_all(zs_client *c, uint32_t shard, probe *p, uint64_t term) {
  zc_rset *rs = &c->rs[shard];
  char term_buf[24];
  pthread_t th[ZC_MAX_REPLICAS];
  int started[ZC_MAX_REPLICAS];
  snprintf(term_buf, sizeof term_buf, "%" PRIu64, term);
  for (uint32_t k = 0; k < rs->n; k++) {
    p[k] = (probe){.c = c, .shard = shard, .k = k, .ch = rs->chan[k], .primary = -1};
    p[k].md = (rpc_md){ZC_TERM_KEY, term_buf};
    p[k].nmd = term > 0;
  }
  for (uint32_t k = 0; k < rs->n; k++) {
    started[k] = pthread_create(&th[k], NULL, probe_run, &p[k]) == 0;
    if (!started[k])
      probe_run(&p[k]); /* no thread: from here */
  }
  for (uint32_t k = 0; k < rs->n; k++)
    if (started[k])
      pthread_join(th[k], NULL);
}

/* What a round decided (decide()). */
typedef struct verdict {
  int primary;       /* the member that is primary now, or -1 */
  int promote;       /* the member to promote, or -1 */
  uint64_t term;     /* the highest term seen */
  uint64_t retry_at; /* with neither: when deciding may change (0: not known) */
} verdict;

/* Whether member k was in sync with the set when it answered: a backup (or
 * a primary) holds every acknowledged write, a starting, stale or joining
 * one may not, whatever its version (a member restarted from a checkpoint
 * comes back at the backup's version without its step's pushes). */
static int in_sync_role(const probe *p) {
  return p->role == 2 /* PRIMARY */ || p->role == 3 /* BACKUP */;
}

/* The member to promote: among the usable answers, one in sync before one
 * that is not, then the highest version, ties to the lowest index; -1 when
 * none answered. The member refuses if a reachable peer is better
 * (ENOTREADY), so this order is the server's. */
static int best_member(const probe *p, uint32_t n) {
  int best = -1;
  for (uint32_t k = 0; k < n; k++) {
    if (!p[k].good)
      continue;
    if (best < 0 || in_sync_role(&p[k]) > in_sync_role(&p[best]) ||
        (in_sync_role(&p[k]) == in_sync_role(&p[best]) && p[k].version > p[best].version))
      best = (int)k;
  }
  return best;
}

/* Decides from a round's answers, with rs->mu held (down_since merged). */
static verdict decide(const zc_rset *rs, const probe *p, uint64_t now) {
  verdict v = {.primary = -1, .promote = -1, .term = rs->term};
  for (uint32_t k = 0; k < rs->n; k++)
    if (p[k].good && p[k].term > v.term)
      v.term = p[k].term;
  int named = -1; /* the primary of the highest term, as its members name it */
  for (uint32_t k = 0; k < rs->n; k++) {
    if (!p[k].good || p[k].term != v.term || v.term == 0)
      continue;
    if (p[k].role == ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_PRIMARY && v.primary < 0)
      v.primary = (int)k;
    if (p[k].primary >= 0 && named < 0)
      named = p[k].primary;
  }
  if (v.primary >= 0)
    return v;
  /* No primary answers. One that may still be alive is given failover_ms
   * from its first failure before another member is promoted over it. */
  uint64_t until = 0;
  if (named >= 0 && !p[named].answered) {
    until = rs->down_since[named] + rs->failover_ms;
  } else if (named < 0 && v.term > 0) {
    for (uint32_t k = 0; k < rs->n; k++)
      if (!p[k].answered && rs->down_since[k] + rs->failover_ms > until)
        until = rs->down_since[k] + rs->failover_ms;
  }
  if (now < until) {
    v.retry_at = until;
    return v;
  }
  v.promote = best_member(p, rs->n);
  return v;
}

/* Promote(term) to member k; returns 1 when it became primary. */
static int promote(zs_client *c, uint32_t shard, uint32_t k, uint64_t seen, uint64_t *term) {
  zc_rset *rs = &c->rs[shard];
  char term_buf[24];
  snprintf(term_buf, sizeof term_buf, "%" PRIu64, seen);
  rpc_md md = {ZC_TERM_KEY, term_buf};
  Zshard__V1__PromoteRequest req = ZSHARD__V1__PROMOTE_REQUEST__INIT;
  Zshard__V1__PromoteResponse *r = NULL;
  rpc_status st = {0};
  req.term = seen + 1;
  req.index = k;
  int rc = rpc_call_md(rs->chan[k], ZC_METHOD("Promote"), &req.base, &md, seen > 0,
                       &zshard__v1__promote_response__descriptor, (ProtobufCMessage **)&r,
                       c->opt.rpc_timeout_ms, &st);
  if (rc != ZS_OK)
    return 0; /* refused or unreachable: the next failure searches again */
  int ok = r->role == ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_PRIMARY && r->term > seen;
  if (ok)
    *term = r->term;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return ok;
}

/* Makes member k (-1: none) current after a search, with rs->mu held. */
static void search_end_locked(zc_rset *rs, int k, uint64_t term, uint64_t retry_at) {
  if (term > rs->term)
    rs->term = term;
  if (k >= 0) {
    if ((uint32_t)k != rs->cur) {
      rs->cur = (uint32_t)k;
      atomic_fetch_add(&rs->gen, 1);
    }
    rs->down_since[k] = 0;
    retry_at = 0;
  }
  rs->found = k >= 0;
  rs->retry_at = retry_at;
  rs->searching = 0;
  pthread_cond_broadcast(&rs->cv);
}

/* Runs one search for the set (searching set by the caller). Returns the
 * member that is primary now, or -1. */
static int search(zs_client *c, uint32_t shard) {
  zc_rset *rs = &c->rs[shard];
  probe p[ZC_MAX_REPLICAS];
  pthread_mutex_lock(&rs->mu);
  uint64_t term = rs->term;
  pthread_mutex_unlock(&rs->mu);
  probe_all(c, shard, p, term);
  uint64_t now = clock_now_ms();
  pthread_mutex_lock(&rs->mu);
  for (uint32_t k = 0; k < rs->n; k++) {
    if (p[k].answered)
      rs->down_since[k] = 0;
    else if (rs->down_since[k] == 0)
      rs->down_since[k] = now;
  }
  verdict v = decide(rs, p, now);
  if (v.promote < 0) {
    search_end_locked(rs, v.primary, v.term, v.retry_at);
    pthread_mutex_unlock(&rs->mu);
    return v.primary;
  }
  pthread_mutex_unlock(&rs->mu);
  uint64_t new_term = v.term;
  int k = promote(c, shard, (uint32_t)v.promote, v.term, &new_term) ? v.promote : -1;
  /* A refusal may only mean that the member has not yet seen for itself
   * what the client saw (a dead primary it still counts as alive): the
   * callers search again soon rather than after a whole backoff. */
  uint64_t again = k < 0 ? clock_now_ms() + ZC_PROMOTE_RETRY_MS : 0;
  pthread_mutex_lock(&rs->mu);
  search_end_locked(rs, k, new_term, again);
  pthread_mutex_unlock(&rs->mu);
  return k;
}

int zc_replica_failed(zs_client *c, uint32_t shard, uint64_t gen, int unreachable,
                      uint64_t *wait_ms) {
  zc_rset *rs = &c->rs[shard];
  *wait_ms = UINT64_MAX;
  pthread_mutex_lock(&rs->mu);
  if (atomic_load(&rs->gen) != gen) {
    /* Another caller's search moved the set on already. */
    pthread_mutex_unlock(&rs->mu);
    return 1;
  }
  if (unreachable && rs->down_since[rs->cur] == 0)
    rs->down_since[rs->cur] = clock_now_ms();
  int ok;
  if (rs->searching) {
    /* A search for this very failure runs: its result is ours. */
    while (rs->searching)
      pthread_cond_wait(&rs->cv, &rs->mu);
    ok = atomic_load(&rs->gen) != gen || rs->found;
  } else {
    rs->searching = 1;
    pthread_mutex_unlock(&rs->mu);
    ok = search(c, shard) >= 0;
    pthread_mutex_lock(&rs->mu);
  }
  uint64_t now = clock_now_ms();
  if (!ok && rs->retry_at > now)
    *wait_ms = rs->retry_at - now;
  pthread_mutex_unlock(&rs->mu);
  return ok;
}

/* ---- calls ------------------------------------------------------------------------ */

/* Whether `method` (a full gRPC path) is Push or Pull. */
static int is_transfer(const char *method) {
  const char *m = strrchr(method, '/');
  return m && (strcmp(m, "/Push") == 0 || strcmp(m, "/Pull") == 0);
}

/* What a failed attempt calls for: 3 a failover search for a member that
 * was silent for the call's whole deadline (stopped, partitioned, or only
 * slow: the search tells), 2 a failover search (the member did not answer,
 * or is not primary), 1 a plain retry, 0 nothing. */
static int after_failure(int rc, const rpc_status *st, const char *method) {
  if (st->grpc_code == ZC_GRPC_DEADLINE_EXCEEDED)
    return 3;
  if (st->grpc_code == ZC_GRPC_UNAVAILABLE || st->grpc_code == ZC_GRPC_CANCELLED ||
      rc == ZS_ENOTPRIMARY || rc == ZS_ESTALE)
    return 2;
  return st->grpc_code == ZC_GRPC_RESOURCE_EXHAUSTED && is_transfer(method);
}

/* After a call's deadline passed without an answer: the member counts as
 * down from now (a primary SIGSTOPped during an Apply answers nothing, and
 * only a failover ends the wait), and the searches run without calling it
 * again (each call would wait a whole deadline) until another member is
 * primary, or the member answers GetInfo as primary: then the call is made
 * once more, and a second silence is its answer (slow, not gone). Returns
 * 0 to call again, -1 to give up with the call's status. */
static int after_silence(zs_client *c, uint32_t shard, uint64_t gen, uint32_t *attempt,
                         int *confirmed) {
  zc_rset *rs = &c->rs[shard];
  uint64_t backoff = c->opt.retry_initial_ms;
  for (;;) {
    uint64_t wait = UINT64_MAX;
    int found = zc_replica_failed(c, shard, gen, 1, &wait);
    if (atomic_load(&rs->gen) != gen)
      return 0;
    if (found)
      return (*confirmed)++ ? -1 : 0;
    if (++*attempt >= c->opt.max_retries || zc_backoff_wait(c, backoff < wait ? backoff : wait))
      return -1;
    atomic_fetch_add(&c->retries, 1);
    backoff *= 2;
    if (backoff > c->opt.retry_max_ms)
      backoff = c->opt.retry_max_ms;
  }
}

int zc_replica_call(zs_client *c, uint32_t shard, const char *method, const ProtobufCMessage *req,
                    const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                    uint64_t timeout_ms, rpc_status *st) {
  zc_rset *rs = &c->rs[shard];
  uint64_t backoff = c->opt.retry_initial_ms;
  int looked = 0;    /* a member without the job made us search once */
  int confirmed = 0; /* a search found a primary without moving: retried at once */
  for (uint32_t attempt = 0;; attempt++) {
    uint64_t gen;
    rpc_md md;
    size_t nmd;
    char term_buf[24];
    uint32_t k = zc_replica_current(c, shard, &gen, &md, &nmd, term_buf);
    int rc = rpc_call_md(rs->chan[k], method, req, &md, nmd, resp_desc, resp, timeout_ms, st);
    if (rc == ZS_OK) {
      note_answered(rs, k);
      return rc;
    }
    int what = after_failure(rc, st, method);
    /* A member that lacks the job or the version (restarted, or joining)
     * may have been left behind by a failover this client has not seen:
     * one search tells; if it moves nothing, the answer stands. */
    if (!what && !looked && (rc == ZS_ENOTOPEN || rc == ZS_ENOTREADY)) {
      uint64_t wait;
      looked = 1;
      zc_replica_failed(c, shard, gen, 0, &wait);
      if (atomic_load(&rs->gen) == gen || attempt >= c->opt.max_retries)
        return rc;
      atomic_fetch_add(&c->retries, 1);
      continue;
    }
    if (!what || attempt >= c->opt.max_retries)
      return rc;
    atomic_fetch_add(&c->retries, 1);
    uint64_t wait = UINT64_MAX;
    if (what == 3) {
      int r = after_silence(c, shard, gen, &attempt, &confirmed);
      if (r < 0)
        return rc;
      continue;
    }
    if (what == 2) {
      int unreachable = st->grpc_code == ZC_GRPC_UNAVAILABLE || st->grpc_code == ZC_GRPC_CANCELLED;
      int found = zc_replica_failed(c, shard, gen, unreachable, &wait);
      /* Another member is primary, or this one is now (a fresh set's first
       * promotion): at once, the latter only once per call, so that a
       * member that keeps refusing what its GetInfo claims backs off. */
      if (atomic_load(&rs->gen) != gen || (found && !confirmed++))
        continue;
    }
    if (zc_backoff_wait(c, backoff < wait ? backoff : wait))
      return rc;
    backoff *= 2;
    if (backoff > c->opt.retry_max_ms)
      backoff = c->opt.retry_max_ms;
  }
}
