/*
 * replica_monitor — the monitor thread and what it learns: every
 * REPLICA_MONITOR_MS it probes the peers (GetInfo, carrying this member's
 * list and term), checks that their member lists agree, and runs the round
 * of this member's role; failover (Promote) decides on the same probes.
 */
#include "server/replica/replica_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/model/spec.h"

/* ------------------------------------------------------------ probing */

/* Why the set member i describes in its answer differs from this
 * replica's, into buf; "" when it agrees. */
static void config_diff(const replica *r, uint32_t i, const Zshard__V1__ReplicaInfo *ri, char *buf,
                        size_t len) {
  buf[0] = '\0';
  if (!ri) {
    snprintf(buf, len, "answers as a server without --replicas");
    return;
  }
  if (ri->index != i) {
    snprintf(buf, len, "counts itself member %u of its --replicas, this member counts it %u",
             ri->index, i);
    return;
  }
  if (ri->n_members != r->n) {
    snprintf(buf, len, "lists %zu members in its --replicas, this member %u", ri->n_members, r->n);
    return;
  }
  for (uint32_t k = 0; k < r->n; k++) {
    const char *a = ri->members[k]->address;
    if (!a || strcmp(a, r->m[k].addr) != 0) {
      snprintf(buf, len, "names '%.64s' as member %u, this member names %s", a ? a : "", k,
               r->m[k].addr);
      return;
    }
  }
}

/* Records what member i answered (info NULL: no answer). */
static void record_locked(replica *r, uint32_t i, const Zshard__V1__GetInfoResponse *info) {
  member *m = &r->m[i];
  m->reachable = info != NULL;
  if (!info)
    return;
  char why[REPLICA_CONFIG_LEN];
  config_diff(r, i, info->replica, why, sizeof why);
  if (strcmp(why, m->seen_config) != 0) {
    /* One line when the verdict changes, not one a probe. */
    if (why[0])
      LOG_ERROR("replica_config_mismatch",
                "member=%u addr=%s detail=\"%s\" action=\"no set is formed with it: fix "
                "--replicas/--replica-index so that every member has the same list\"",
                i, m->addr, why);
    else
      LOG_INFO("replica_config_agrees", "member=%u addr=%s", i, m->addr);
    snprintf(m->seen_config, sizeof m->seen_config, "%s", why);
  }
  m->last_ok_ms = clock_now_ms();
  m->seen_version = info->version;
  m->seen_hash = info->spec_hash;
  m->seen_has_job = info->job && info->job[0];
  const Zshard__V1__ReplicaInfo *ri = info->replica;
  m->seen_role = ri ? (int)ri->role : REPLICA_NONE;
  /* No replica takes a term above REPLICA_TERM_MAX: a peer that claims one
   * is not believed. */
  m->seen_term = ri && ri->term <= REPLICA_TERM_MAX ? ri->term : 0;
  m->seen_primary = ri ? ri->primary : -1;
  m->seen_lists_me = m->seen_counts_me = 0;
  for (size_t k = 0; ri && k < ri->n_members; k++)
    if (ri->members[k]->index == r->index) {
      m->seen_lists_me = ri->members[k]->in_sync || ri->members[k]->joining;
      m->seen_counts_me = ri->members[k]->in_sync;
    }
}

/* GetInfo of every peer (deadline ms each), recorded. */
void replica__probe_all(replica *r, uint32_t ms) {
  for (uint32_t i = 0; i < r->n; i++) {
    if (i == r->index)
      continue;
    Zshard__V1__GetInfoResponse *info = NULL;
    replica__peer_info(r, &r->m[i], ms, &info);
    pthread_mutex_lock(&r->mu);
    record_locked(r, i, info);
    pthread_mutex_unlock(&r->mu);
    if (info)
      protobuf_c_message_free_unpacked(&info->base, NULL);
  }
}

int replica__fresh(const member *m) {
  return m->reachable && m->last_ok_ms &&
         clock_now_ms() - m->last_ok_ms < 2 * REPLICA_PROBE_MS + REPLICA_MONITOR_MS;
}

/* The reachable peer that is primary of the highest term above `min`, or -1. */
int replica__live_primary_locked(const replica *r, uint64_t min) {
  int best = -1;
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !replica__fresh(m) || m->seen_role != REPLICA_PRIMARY || m->seen_config[0])
      continue;
    if (m->seen_term >= min && (best < 0 || m->seen_term > r->m[best].seen_term))
      best = (int)i;
  }
  return best;
}

/* ------------------------------------------------------------ promotion */

/* Why this replica refuses to form a set (a peer's member list differs),
 * into buf; 0 when nothing does. */
int replica__config_error_locked(const replica *r, char *buf, size_t len) {
  buf[0] = '\0';
  for (uint32_t i = 0; i < r->n; i++)
    if (i != r->index && r->m[i].seen_config[0]) {
      snprintf(buf, len, "member %u (%s) %s", i, r->m[i].addr, r->m[i].seen_config);
      return 1;
    }
  if (r->caller_config_ms && clock_now_ms() - r->caller_config_ms < REPLICA_CONFIG_HOLD_MS) {
    snprintf(buf, len, "%s", r->caller_config);
    return 1;
  }
  return 0;
}

/* The peers a new primary counts in sync: they hold what it holds (the same
 * job within one version: the trainers' retries bring both to the same
 * step), or, with no job anywhere, nothing. */
static void adopt_backups_locked(replica *r, const core_info *info) {
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    m->join_pending = m->joining = 0;
    m->in_sync = 0;
    if (i == r->index || !replica__fresh(m) || m->seen_config[0])
      continue;
    int synced = m->seen_role == REPLICA_BACKUP || m->seen_role == REPLICA_PRIMARY;
    /* A STARTING member counts only while neither holds a job (a new set:
     * the job's Open is forwarded to it). One that holds a job loaded it
     * from its own checkpoint at a restart: it has none of the pushes of
     * the step in progress, maybe not the last steps either, however close
     * its version; it joins and copies this member's state. */
    if (!info->has_job)
      m->in_sync = (synced || m->seen_role == REPLICA_STARTING) && !m->seen_has_job;
    else
      m->in_sync = synced && m->seen_has_job && m->seen_hash == info->spec_hash &&
                   m->seen_version + 1 >= info->version && m->seen_version <= info->version + 1;
  }
}

int replica_promote(replica *r, uint64_t term, int admin, uint64_t *term_out, int *role_out,
                    uint64_t *version_out, char *err, size_t errlen) {
  /* Who is in sync is decided on these answers: a slow peer gets the
   * failover time to answer rather than be left out. */
  replica__probe_all(r, r->failover_ms);
  core_info info;
  core_get_info(r->core, &info);
  pthread_mutex_lock(&r->mu);
  uint64_t next = 0;
  int rc = replica__promote_check_locked(r, term, admin, &info, &next, err, errlen);
  if (rc == 0) {
    uint64_t was_term = r->term;
    int was_role = r->role;
    r->term = next;
    r->role = REPLICA_PRIMARY;
    r->primary = (int)r->index;
    r->failovers++;
    adopt_backups_locked(r, &info);
    /* The members counted in sync at once ("1,2"; "": none, they join). */
    char backups[REPLICA_MAX_MEMBERS * 4] = "";
    for (uint32_t i = 0, k = 0; i < r->n; i++)
      if (r->m[i].in_sync)
        k += (uint32_t)snprintf(backups + k, sizeof backups - k, "%s%u", k ? "," : "", i);
    LOG_WARN("replica_promoted",
             "term=%" PRIu64 " was_term=%" PRIu64 " was_role=%s version=%" PRIu64
             " by=%s backups=\"%s\"",
             next, was_term, replica_role_name(was_role), info.version, admin ? "admin" : "trainer",
             backups);
  }
  *term_out = r->term;
  *role_out = r->role;
  *version_out = info.version;
  pthread_mutex_unlock(&r->mu);
  /* The primary this one replaces may have acknowledged steps that never
   * reached it (it was dropped, or cut off, and cannot know): a trainer past
   * its version is told ZS_EBEHIND and to restore, as after a restart. */
  if (rc == 0 && info.has_job)
    core_mark_behind(r->core);
  /* Every reachable peer hears the new term before any trainer does (the
   * probe carries it): should this member die at once, the next Promote a
   * trainer sends with the term it learnt here is one the peers know. */
  if (rc == 0)
    replica__probe_all(r, REPLICA_PROBE_MS);
  return rc;
}

/* ------------------------------------------------------------ the monitor */

void *replica__monitor_main(void *arg) {
  replica *r = arg;
  for (;;) {
    replica__probe_all(r, REPLICA_PROBE_MS);
    core_info info;
    core_get_info(r->core, &info);
    pthread_mutex_lock(&r->mu);
    if (r->stopping) {
      pthread_mutex_unlock(&r->mu);
      break;
    }
    int join = -1;
    uint64_t term = 0;
    if (r->role == REPLICA_PRIMARY) {
      replica__primary_round_locked(r, &info);
    } else if (r->role == REPLICA_BACKUP) {
      replica__backup_round_locked(r);
    }
    if (r->role == REPLICA_STARTING || r->role == REPLICA_STALE) {
      join = replica__live_primary_locked(r, r->term);
      term = join >= 0 ? r->m[join].seen_term : 0;
    }
    if (join >= 0 && replica__starting_counted_locked(r, (uint32_t)join, info.has_job)) {
      LOG_INFO("replica_term", "term=%" PRIu64 " was=%" PRIu64 " role=starting primary=%d", term,
               r->term, join);
      r->role = REPLICA_BACKUP;
      r->term = term;
      r->primary = join;
      join = -1;
    } else if (join >= 0 && replica__starting_awaits_open_locked(r, (uint32_t)join, info.has_job)) {
      join = -1; /* the job's Open forward makes it a backup */
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)REPLICA_MONITOR_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    if (join < 0 && !r->stopping && !r->probe_now)
      pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    r->probe_now = 0;
    pthread_mutex_unlock(&r->mu);
    if (join >= 0 && replica__join_primary(r, (uint32_t)join, term) != 0) {
      /* Not again before the next round (the peer may be gone). */
      struct timespec pause = {.tv_sec = 0, .tv_nsec = (long)REPLICA_MONITOR_MS * 1000000L};
      nanosleep(&pause, NULL);
    }
  }
  return NULL;
}

void replica_check_caller(replica *r, const char *members, uint32_t index, uint64_t term,
                          int admin) {
  /* Only a peer holds the admin token: a trainer's list would let it refuse
   * the set for everyone. */
  if (!r || !admin || !members || !members[0])
    return;
  char why[REPLICA_CONFIG_LEN] = "";
  if (strcmp(members, r->members_list) != 0) {
    char shown[72];
    size_t k = 0;
    for (const char *p = members; *p && k + 1 < sizeof shown; p++)
      shown[k++] = *p >= 0x20 && *p < 0x7f && *p != '"' && *p != '\'' ? *p : '?';
    shown[k] = '\0';
    snprintf(why, sizeof why, "a peer (its member %u) probes with --replicas '%s%s'", index, shown,
             members[k] ? "..." : "");
  } else if (index == r->index || index >= r->n) {
    snprintf(why, sizeof why, "a peer with the same --replicas counts itself member %u", index);
  }
  pthread_mutex_lock(&r->mu);
  uint64_t now = clock_now_ms();
  int held = r->caller_config_ms && now - r->caller_config_ms < REPLICA_CONFIG_HOLD_MS;
  if (!why[0])
    replica__peer_term_hint_locked(r, index, term);
  if (why[0]) {
    if (!held || strcmp(why, r->caller_config) != 0)
      LOG_ERROR("replica_config_mismatch",
                "detail=\"%s; this member's is '%s' (index %u)\" action=\"no set is "
                "formed with it: fix --replicas/--replica-index so that every member has the same "
                "list\"",
                why, r->members_list, r->index);
    snprintf(r->caller_config, sizeof r->caller_config, "%s", why);
    r->caller_config_ms = now;
  }
  pthread_mutex_unlock(&r->mu);
}
