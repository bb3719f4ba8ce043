/*
 * replica_terms — the terms protocol in one place: a term moves by one (a
 * promotion takes the highest term this member has seen plus one, never
 * more, and none above REPLICA_TERM_MAX); a trainer may ask for a promotion
 * but only the admin token moves a live primary's term; a forward of an
 * older term is refused and a newer one followed; a term a trainer or a peer
 * mentions is a hint that makes the monitor probe, never a step-down by
 * itself (a member steps down only on what it sees: a newer primary, its
 * primary's refusal).
 */
#include "server/replica/replica_internal.h"

#include <inttypes.h>
#include <pthread.h>

#include "common/base/log.h"
#include "common/base/status.h"

void replica__step_down_locked(replica *r, const char *why) {
  if (r->role == REPLICA_PRIMARY || r->role == REPLICA_BACKUP) {
    LOG_WARN("replica_stepped_down", "term=%" PRIu64 " role=%s detail=\"%s\"", r->term,
             replica_role_name(r->role), why);
    r->role = REPLICA_STALE;
    for (uint32_t i = 0; i < r->n; i++)
      r->m[i].in_sync = r->m[i].joining = r->m[i].join_pending = 0;
  }
}

/* Whether a peer whose list agrees probed this replica with `term`. */
int replica__heard_term_locked(const replica *r, uint64_t term) {
  for (uint32_t i = 0; i < r->n; i++)
    if (i != r->index && r->m[i].heard_term == term)
      return 1;
  return 0;
}

/* A forward of term `term` from the primary: follows a newer term. has_job:
 * whether this replica holds a job (read for a STARTING one only; else
 * unused). */
int replica__admit_forward_locked(replica *r, uint64_t term, int has_job, char *err,
                                  size_t errlen) {
  if (term > REPLICA_TERM_MAX)
    return status_fail(err, errlen, ZS_ERANGE,
                       "a forward of term %" PRIu64 ", above the highest term %" PRIu64, term,
                       REPLICA_TERM_MAX);
  if (term < r->term)
    return status_fail(err, errlen, ZS_ESTALE,
                       "a forward of term %" PRIu64 ", but this replica is at term %" PRIu64, term,
                       r->term);
  if (r->role == REPLICA_STARTING) {
    int rc = replica__starting_may_follow_locked(r, term, has_job, err, errlen);
    if (rc)
      return rc;
    LOG_INFO("replica_term", "term=%" PRIu64 " was=%" PRIu64 " role=starting primary=%d", term,
             r->term, r->primary);
    r->term = term;
    r->role = REPLICA_BACKUP; /* both checked the other's list; neither holds a job */
  } else if (term > r->term) {
    LOG_INFO("replica_term", "term=%" PRIu64 " was=%" PRIu64 " role=%s", term, r->term,
             replica_role_name(r->role));
    r->term = term;
    r->primary = -1;
    if (r->role == REPLICA_PRIMARY)
      r->role = REPLICA_BACKUP; /* the new primary judged this replica in sync */
    else if (r->role == REPLICA_JOINING)
      r->role = REPLICA_STALE; /* its copy was of an older term's primary */
  }
  if (r->role == REPLICA_BACKUP)
    return 0;
  if (r->role == REPLICA_JOINING)
    return status_fail(err, errlen, ZS_ENOTREADY,
                       "this replica is still loading the primary's state");
  return status_fail(err, errlen, ZS_EBEHIND, "this replica is %s: it must join again",
                     replica_role_name(r->role));
}

/* The highest term this replica has seen: its own or a peer's answer. Every
 * one of those was reached one promotion at a time. */
static uint64_t known_term_locked(const replica *r) {
  uint64_t t = r->term;
  for (uint32_t i = 0; i < r->n; i++) {
    if (i != r->index && r->m[i].last_ok_ms && r->m[i].seen_term > t)
      t = r->m[i].seen_term;
    if (i != r->index && r->m[i].heard_term > t)
      t = r->m[i].heard_term;
  }
  return t;
}

/* Why this replica may not become primary now, or 0 with the term it takes
 * in *next. */
int replica__promote_check_locked(replica *r, uint64_t term, int admin, const core_info *info,
                                  uint64_t *next, char *err, size_t errlen) {
  char why[REPLICA_CONFIG_LEN + 64];
  if (replica__config_error_locked(r, why, sizeof why))
    return status_fail(err, errlen, ZS_EINVAL, "replica %u refuses to form a set: %s", r->index,
                       why);
  if (term <= r->term)
    return status_fail(err, errlen, ZS_ESTALE,
                       "replica %u is at term %" PRIu64 " already, not below %" PRIu64, r->index,
                       r->term, term);
  uint64_t known = known_term_locked(r);
  *next = known + 1;
  if (term > known + 1 || known >= REPLICA_TERM_MAX)
    return status_fail(err, errlen, ZS_ERANGE,
                       "Promote to term %" PRIu64 ": replica %u is at term %" PRIu64
                       " and knows no term above %" PRIu64
                       "; a promotion moves the term by one, to %" PRIu64 " at most",
                       term, r->index, r->term, known, known + 1);
  if (r->role == REPLICA_PRIMARY && !admin)
    return status_fail(err, errlen, ZS_EPERM,
                       "replica %u is the primary of term %" PRIu64
                       " and answers; only the admin token moves a live primary's term",
                       r->index, r->term);
  /* A Promote asks the member to take over from a primary it no longer
   * sees: it has just probed its peers (replica_promote). The admin token
   * does not skip this: with tokens off every caller holds it. */
  int p = replica__live_primary_locked(r, r->term);
  if (p >= 0)
    return status_fail(err, errlen, ZS_ENOTPRIMARY,
                       "member %d (%s) is the primary of term %" PRIu64, p, r->m[p].addr,
                       r->m[p].seen_term);
  if (r->role == REPLICA_PRIMARY || r->role == REPLICA_BACKUP)
    return 0;
  /* Not in sync: only when nobody reachable holds more. */
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !replica__fresh(m) || !m->seen_has_job)
      continue;
    if (!info->has_job || m->seen_version > info->version ||
        (m->seen_version == info->version && m->seen_role == REPLICA_BACKUP))
      return status_fail(err, errlen, ZS_ENOTREADY,
                         "replica %u is %s; member %u (%s) holds the job at version %" PRIu64
                         ": promote it",
                         r->index, replica_role_name(r->role), i, m->addr, m->seen_version);
  }
  return 0;
}

void replica__client_term_hint_locked(replica *r, uint64_t term) {
  if (term > r->term && !r->probe_now) {
    /* A trainer's word is no proof (any token holder can send any number):
     * the monitor asks the peers now, and a primary steps down only when it
     * sees a newer primary itself. */
    r->probe_now = 1;
    pthread_cond_broadcast(&r->cv);
  }
}

void replica__peer_term_hint_locked(replica *r, uint32_t index, uint64_t term) {
  if (term <= REPLICA_TERM_MAX && term > r->m[index].heard_term) {
    /* A peer of a newer term (just promoted): look at it now. */
    r->m[index].heard_term = term;
    if (term > r->term) {
      r->probe_now = 1;
      pthread_cond_broadcast(&r->cv);
    }
  }
}
