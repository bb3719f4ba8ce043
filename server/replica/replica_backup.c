/*
 * replica_backup — a backup's role: the admission of calls (forwards from
 * the primary are taken by a backup of that term; a trainer's by the
 * primary), a STARTING member becoming a backup, and the backup's monitor
 * round (dropped by its primary, or not counted by a newer one: STALE).
 */
#include "server/replica/replica_internal.h"

#include <inttypes.h>
#include <pthread.h>

#include "common/base/log.h"
#include "common/base/status.h"

/* Whether a STARTING replica may follow the primary of `term`, whose forward
 * came (has_job: this replica holds a job). It has checked no configuration
 * when a forward reaches it first: it follows only a primary its own probe
 * saw as primary of that term with the same member list, and only while it
 * holds no job (a primary counts a starting member in sync only when
 * neither holds one; one that loaded its checkpoint at a restart joins and
 * copies). 0, or ZS_ENOTREADY (not probed yet: the monitor probes now and
 * the primary retries), ZS_EBEHIND or ZS_EINVAL with a sentence. */
int replica__starting_may_follow_locked(replica *r, uint64_t term, int has_job, char *err,
                                        size_t errlen) {
  char why[REPLICA_CONFIG_LEN + 64];
  if (replica__config_error_locked(r, why, sizeof why))
    return status_fail(err, errlen, ZS_EINVAL, "replica %u refuses to form a set: %s", r->index,
                       why);
  if (has_job)
    return status_fail(err, errlen, ZS_EBEHIND,
                       "replica %u is starting with a job's state it loaded itself: it joins "
                       "(copies the primary's state) before it takes forwards",
                       r->index);
  int p = replica__live_primary_locked(r, term);
  if (p < 0 || r->m[p].seen_term != term) {
    /* A peer whose probe carried this term with the same list (a new
     * primary probes every peer before it answers Promote) was checked as
     * well: the primary's own index is learnt at the next probe. */
    if (replica__heard_term_locked(r, term)) {
      r->primary = -1;
      return 0;
    }
    r->probe_now = 1;
    pthread_cond_broadcast(&r->cv);
    return status_fail(err, errlen, ZS_ENOTREADY,
                       "replica %u is starting and has not yet seen the primary of term %" PRIu64
                       " in its probes",
                       r->index, term);
  }
  r->primary = p;
  return 0;
}

int replica_admit(replica *r, replica_kind kind, uint64_t fwd_term, int fwd_admin,
                  uint64_t client_term, int *forward, char *err, size_t errlen) {
  if (forward)
    *forward = 0;
  if (!r || kind == REPLICA_ANY)
    return 0;
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  if (fwd_term) {
    /* Only a STARTING replica needs to know whether it holds a job; no
     * replica becomes STARTING again, so a first look outside the core's
     * lock (replica.mu is never held into the core) is enough. */
    int has_job = 0;
    if (fwd_admin && r->role == REPLICA_STARTING) {
      /* A new set's first forward (the job's Open) often comes before this
       * member's monitor saw the promotion: it looks now, once, rather than
       * keep the primary retrying (and dropping it) until the next round. */
      int seen =
          replica__live_primary_locked(r, fwd_term) >= 0 || replica__heard_term_locked(r, fwd_term);
      pthread_mutex_unlock(&r->mu);
      core_info info;
      core_get_info(r->core, &info);
      has_job = info.has_job;
      if (!seen && !has_job) /* a data-plane push needs a job: never on its loop */
        replica__probe_all(r, REPLICA_PROBE_MS);
      pthread_mutex_lock(&r->mu);
    }
    rc = fwd_admin
             ? replica__admit_forward_locked(r, fwd_term, has_job, err, errlen)
             : status_fail(err, errlen, ZS_EPERM, "a replica's forward needs the admin token");
    pthread_mutex_unlock(&r->mu);
    return rc;
  }
  replica__client_term_hint_locked(r, client_term);
  int primary = r->role == REPLICA_PRIMARY;
  int serves = primary || (kind == REPLICA_READ && r->role == REPLICA_BACKUP);
  if (!serves) {
    char who[200];
    replica__say_primary_locked(r, who, sizeof who);
    rc = status_fail(err, errlen, ZS_ENOTPRIMARY, "replica %u (%s) is %s; %s", r->index,
                     r->m[r->index].addr, replica_role_name(r->role), who);
  } else if (forward && primary && kind == REPLICA_WRITE) {
    fwd_target t[REPLICA_MAX_MEMBERS];
    *forward = replica__targets_locked(r, 0, t) > 0;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* A backup's round: dropped by its primary, or a newer primary that does
 * not count it, makes it stale. */
void replica__backup_round_locked(replica *r) {
  int p = replica__live_primary_locked(r, r->term);
  if (p < 0)
    return;
  const member *m = &r->m[p];
  if (m->seen_term == r->term)
    r->primary = p;
  if (!m->seen_lists_me) {
    replica__step_down_locked(r, m->seen_term > r->term
                                     ? "a newer primary does not count this replica"
                                     : "the primary dropped this replica");
  } else if (m->seen_term > r->term) {
    /* A backup promoted over a dead primary counts this one in sync: follow
     * it now, as its next forward would make this replica do. Until then
     * the new primary sees a backup of an older term and, after the
     * failover time without a write (three members, the trainers between
     * steps), drops it. */
    LOG_INFO("replica_term", "term=%" PRIu64 " was=%" PRIu64 " role=%s primary=%d", m->seen_term,
             r->term, replica_role_name(r->role), p);
    r->term = m->seen_term;
    r->primary = p;
  }
}

/* A new set: the primary p that this STARTING replica sees counts it in
 * sync and neither holds a job (the primary adopted it at its promotion).
 * It is a backup already: a ReplicaJoin would only make it JOINING, and
 * refuse the job's Open forward meanwhile, for nothing to copy. */
int replica__starting_counted_locked(const replica *r, uint32_t p, int has_job) {
  char why[REPLICA_CONFIG_LEN + 64];
  const member *m = &r->m[p];
  return r->role == REPLICA_STARTING && !has_job && m->seen_counts_me && !m->seen_has_job &&
         !replica__config_error_locked(r, why, sizeof why);
}

/* A new set whose primary p opened the job after it counted this STARTING
 * replica in sync (neither held one then): the job's Open is forwarded to
 * this replica, or is on its way (retried while this replica has not seen
 * the primary's term), and makes it a backup. It waits for that forward
 * rather than join: a ReplicaJoin would make it JOINING, which refuses the
 * Open forward ("still loading") while the primary, which counts it in
 * sync, retries that forward for the failover time on a polling thread
 * that its ReplicaJoin may need (issue 23: the drops at a set's start).
 * Only at version 0 (no step applied yet: the job was just opened): a
 * member restarted empty later finds the primary still counting the
 * process that died, and no Open will come; it joins at once. The wait is
 * bounded: a primary that drops it (or finds it holding no job for the
 * failover time) stops counting it, and it joins at the next round. */
int replica__starting_awaits_open_locked(const replica *r, uint32_t p, int has_job) {
  char why[REPLICA_CONFIG_LEN + 64];
  const member *m = &r->m[p];
  return r->role == REPLICA_STARTING && !has_job && m->seen_counts_me && m->seen_has_job &&
         m->seen_version == 0 && !replica__config_error_locked(r, why, sizeof why);
}
