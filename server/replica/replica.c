/*
 * replica — a shard run as a replica set (see replica.h for the contract,
 * docs/DESIGN.md "Replica sets" for why it is built this way).
 *
 * Threads: the transports' threads call replica_admit and the forwards; the
 * core's worker calls replica_on_applied; the monitor thread (monitor_main)
 * probes the peers, drops laggards, steps down and joins. gRPC polling
 * threads run Promote, ReplicaJoin and ReplicaFetch.
 *
 * Lock order: member.conn_mu, then replica.mu (a leaf: never held across a
 * peer call, a core call or a connect).
 */
#include "server/replica/replica.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/model/spec.h"
#include "common/net/dp_client.h"
#include "common/net/hostport.h"
#include "common/net/rpc_client.h"
#include "common/net/tls.h"
#include "zshard/v1/zshard.pb-c.h"

#define REPLICA_PROBE_MS 500u
#define REPLICA_RPC_MS 10000u
/* How long a joiner waits for the primary's copy (made at the primary's
 * next applied step: trainers may be between steps for long). */
#define REPLICA_JOIN_MS 120000u
#define REPLICA_RETRY_MS 20u
#define REPLICA_METHOD(m) "/zshard.v1.ZShard/" m
#define REPLICA_ERRLEN 256
/* How long a peer's probe with a member list unlike this one's keeps the
 * set refused after it (peers probe every REPLICA_MONITOR_MS). */
#define REPLICA_CONFIG_HOLD_MS 5000u
#define REPLICA_CONFIG_LEN 200

typedef struct member {
  char *addr; /* gRPC host:port, owned */
  char host[HOSTPORT_HOST_MAX];

  pthread_mutex_t conn_mu; /* ch, dp, dp_term, retired */
  rpc_channel *ch;
  dp_client *dp;
  uint64_t dp_term;
  dp_client *retired[64]; /* replaced data clients, closed at destroy */
  uint32_t nretired;

  /* replica.mu: the primary's view. */
  int in_sync;      /* receives every write */
  int join_pending; /* asked to join: starts at the next applied step */
  int joining;      /* receives every write; not yet loaded its copy */
  /* The version of the copy it joined with: a write of a step up to it is
   * in the copy already (an Apply of that step would be refused, the core
   * having no record of it), so it is not sent. 0: it joined empty. */
  uint64_t covered;
  /* A joiner's last sign of life of its own: its ReplicaJoin, a ReplicaFetch,
   * an answer to a forward (the probes may fail for a while after it
   * restarted: the channel's reconnect backoff). */
  uint64_t heard_ms;
  uint64_t join_id; /* its ReplicaFetch calls name it; 0: none */

  /* replica.mu: the monitor's view. */
  int seen_role;
  uint64_t seen_term, seen_version, seen_hash;
  int seen_has_job, seen_primary, seen_lists_me;
  int seen_counts_me;  /* it counts this replica in sync (its members[] entry) */
  uint64_t last_ok_ms; /* 0: never */
  int reachable;       /* the last probe was answered */
  uint64_t behind_since_ms;
  char seen_config[REPLICA_CONFIG_LEN]; /* why its member list differs; "": it agrees */
  uint64_t heard_term;                  /* the highest term its probes of this replica carried */
} member;

struct replica {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* stop; a snapshot finished */
  core *core;
  service *svc;
  uint32_t index, n, failover_ms;
  member m[REPLICA_MAX_MEMBERS];
  char *token;
  char *members_list; /* the members' addresses joined by '|', sent with every probe */
  rpc_security sec;
  tls_ctx *dp_tls; /* client context for the peers' data planes; NULL: plain */

  int role;
  uint64_t term;
  int primary; /* -1: unknown */
  uint64_t failovers, forwards, forwarded_bytes, joins;
  int probe_now; /* a trainer hinted at a newer term: the monitor probes at once */
  /* A peer probed with a member list unlike this one's (replica_check_caller). */
  char caller_config[REPLICA_CONFIG_LEN];
  uint64_t caller_config_ms;

  /* The primary's copy for its joiners: every member that asked to join
   * before a step is copied at that step, from one copy; members that ask
   * while it is read wait for the step after the last of them loaded it. */
  core_state snap;
  int snap_busy, snap_ready, snap_status;
  uint32_t snap_packing; /* ReplicaFetch answers pointing into snap, not yet sent */
  uint64_t join_seq;
  /* The version the applied hook saw last (replica_wait_applied). */
  uint64_t hooked_version;
  pthread_cond_t hooked_cv;

  pthread_t monitor;
  int monitor_started, stopping;
};

/* ------------------------------------------------------------ helpers */

const char *replica_role_name(int role) {
  static const char *const names[] = {"none", "starting", "primary", "backup", "joining", "stale"};
  return role >= 0 && role <= REPLICA_STALE ? names[role] : "unknown";
}

/* "the primary of term 3 is member 1 (h:p)" or why none is known. */
static void say_primary_locked(const replica *r, char *buf, size_t len) {
  if (r->primary >= 0 && (uint32_t)r->primary < r->n)
    snprintf(buf, len, "the primary of term %" PRIu64 " is member %d (%s)", r->term, r->primary,
             r->m[r->primary].addr);
  else
    snprintf(buf, len, "no primary is known for term %" PRIu64, r->term);
}

int replica_parse_members(const char *list, char **out, uint32_t max, char *err, size_t errlen) {
  if (!list || !*list)
    return status_fail(err, errlen, ZS_EINVAL, "--replicas needs the members' addresses, \"a|b\"");
  uint32_t n = 0;
  const char *p = list;
  int rc = 0;
  while (rc == 0) {
    size_t k = strcspn(p, "|,");
    hostport hp;
    char one[HOSTPORT_HOST_MAX + 16];
    if (k == 0 || k >= sizeof one) {
      rc = status_fail(err, errlen, ZS_EINVAL,
                       "--replicas: member %u of \"%s\" is empty or too long", n, list);
      break;
    }
    memcpy(one, p, k);
    one[k] = '\0';
    char herr[200];
    if (hostport_parse(one, &hp, herr, sizeof herr) != 0 || hp.port == 0) {
      rc = status_fail(err, errlen, ZS_EINVAL, "--replicas: member %u \"%s\": %s", n, one,
                       hp.port == 0 ? "needs a port" : herr);
      break;
    }
    for (uint32_t i = 0; i < n && rc == 0; i++)
      if (strcmp(out[i], one) == 0)
        rc = status_fail(err, errlen, ZS_EINVAL, "--replicas names %s twice", one);
    if (rc == 0 && n == max)
      rc = status_fail(err, errlen, ZS_EINVAL, "--replicas: at most %u members", max);
    if (rc == 0 && !(out[n++] = strdup(one)))
      rc = ZS_ENOMEM;
    if (p[k] == '\0')
      break;
    p += k + 1;
  }
  if (rc == 0 && n < 2)
    rc = status_fail(err, errlen, ZS_EINVAL, "--replicas needs at least 2 members, \"%s\" has %u",
                     list, n);
  if (rc) {
    for (uint32_t i = 0; i < n; i++)
      free(out[i]);
    return rc;
  }
  return (int)n;
}

/* ------------------------------------------------------------ lifecycle */

int replica_create(const replica_config *cfg, replica **out, char *err, size_t errlen) {
  *out = NULL;
  replica *r = calloc(1, sizeof *r);
  if (!r)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  char *addrs[REPLICA_MAX_MEMBERS];
  int n = replica_parse_members(cfg->members, addrs, REPLICA_MAX_MEMBERS, err, errlen);
  if (n < 0) {
    free(r);
    return n;
  }
  r->n = (uint32_t)n;
  size_t listlen = 1;
  for (uint32_t i = 0; i < r->n; i++)
    listlen += strlen(addrs[i]) + 1;
  r->members_list = calloc(1, listlen);
  for (uint32_t i = 0; i < r->n && r->members_list; i++) {
    if (i)
      strcat(r->members_list, "|");
    strcat(r->members_list, addrs[i]);
  }
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    m->addr = addrs[i];
    hostport hp;
    hostport_parse(m->addr, &hp, NULL, 0);
    snprintf(m->host, sizeof m->host, "%s", hp.host);
    pthread_mutex_init(&m->conn_mu, NULL);
    m->seen_primary = -1;
  }
  int rc = 0;
  if (cfg->index >= r->n)
    rc = status_fail(err, errlen, ZS_EINVAL, "--replica-index %u is not below the %u members",
                     cfg->index, r->n);
  r->index = cfg->index;
  r->core = cfg->core;
  r->svc = cfg->svc;
  r->failover_ms = cfg->failover_ms ? cfg->failover_ms : REPLICA_DEFAULT_FAILOVER_MS;
  r->role = REPLICA_STARTING;
  r->primary = -1;
  if (rc == 0 && !r->members_list)
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  if (rc == 0 && cfg->token && *cfg->token && !(r->token = strdup(cfg->token)))
    rc = ZS_ENOMEM;
  r->sec.token = r->token;
  r->sec.tls_ca_file = cfg->tls_ca_file;
  r->sec.tls_cert_file = cfg->tls_ca_file ? cfg->tls_cert_file : NULL;
  r->sec.tls_key_file = cfg->tls_ca_file ? cfg->tls_key_file : NULL;
  if (rc == 0 && cfg->tls_ca_file)
    rc = tls_client_new(cfg->tls_ca_file, r->sec.tls_cert_file, r->sec.tls_key_file, NULL,
                        &r->dp_tls, err, errlen);
  pthread_mutex_init(&r->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->cv, &ca);
  pthread_cond_init(&r->hooked_cv, &ca);
  pthread_condattr_destroy(&ca);
  if (rc) {
    replica_destroy(r);
    return rc;
  }
  *out = r;
  return 0;
}

static void *monitor_main(void *arg);

int replica_start(replica *r, char *err, size_t errlen) {
  if (pthread_create(&r->monitor, NULL, monitor_main, r) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "cannot start the replica monitor thread");
  r->monitor_started = 1;
  LOG_INFO("replica_started", "index=%u members=%u failover_ms=%u self=%s", r->index, r->n,
           r->failover_ms, r->m[r->index].addr);
  return 0;
}

void replica_set_service(replica *r, service *svc) {
  r->svc = svc;
}

void replica_destroy(replica *r) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  r->stopping = 1;
  pthread_cond_broadcast(&r->cv);
  pthread_cond_broadcast(&r->hooked_cv);
  int pending = r->snap_busy && !r->snap_ready;
  pthread_mutex_unlock(&r->mu);
  if (pending) /* the core calls snap_done before this returns */
    core_cancel_snapshots(r->core);
  if (r->monitor_started)
    pthread_join(r->monitor, NULL);
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    dp_client_close(m->dp);
    for (uint32_t k = 0; k < m->nretired; k++)
      dp_client_close(m->retired[k]);
    rpc_channel_close(m->ch);
    pthread_mutex_destroy(&m->conn_mu);
    free(m->addr);
  }
  core_state_free(&r->snap);
  tls_ctx_free(r->dp_tls);
  free(r->token);
  free(r->members_list);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  pthread_cond_destroy(&r->hooked_cv);
  free(r);
}

/* ------------------------------------------------------------ peer calls */

static rpc_channel *channel(replica *r, member *m) {
  pthread_mutex_lock(&m->conn_mu);
  if (!m->ch) {
    char err[REPLICA_ERRLEN];
    if (rpc_channel_open_secure(m->addr, &r->sec, &m->ch, err, sizeof err) != 0)
      LOG_WARN("replica_channel", "member=%s error=\"%s\"", m->addr, err);
  }
  rpc_channel *ch = m->ch;
  pthread_mutex_unlock(&m->conn_mu);
  return ch;
}

/* GetInfo of a member, deadline ms; 0 and *out (free it) or an error. */
static int peer_info(replica *r, member *m, uint32_t ms, Zshard__V1__GetInfoResponse **out) {
  *out = NULL;
  rpc_channel *ch = channel(r, m);
  if (!ch)
    return ZS_ECONN;
  Zshard__V1__GetInfoRequest q = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  q.replica_members = r->members_list; /* the peer checks it against its own */
  q.replica_index = r->index;
  pthread_mutex_lock(&r->mu);
  q.replica_term = r->term;
  pthread_mutex_unlock(&r->mu);
  rpc_status st;
  return rpc_call(ch, REPLICA_METHOD("GetInfo"), &q.base,
                  &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)out, ms, &st);
}

/* The member's data client for forwards of `term` (opened, or reopened when
 * the term changed: the term travels in its HELLO). NULL: none now. */
static dp_client *data_client(replica *r, member *m, uint64_t term) {
  pthread_mutex_lock(&m->conn_mu);
  if (m->dp && m->dp_term == term) {
    dp_client *d = m->dp;
    pthread_mutex_unlock(&m->conn_mu);
    return d;
  }
  pthread_mutex_unlock(&m->conn_mu);
  Zshard__V1__GetInfoResponse *info = NULL;
  if (peer_info(r, m, REPLICA_PROBE_MS * 2, &info) != 0)
    return NULL;
  uint32_t port = info->data_port;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  if (port == 0 || port > 65535)
    return NULL;
  char hp[HOSTPORT_HOST_MAX + 16];
  hostport_format(hp, sizeof hp, m->host, port);
  dp_client_config dc = {.addr = hp,
                         .connections = 2,
                         .connect_timeout_ms = r->failover_ms,
                         .token = r->token,
                         .tls = r->dp_tls,
                         .replica_term = term};
  dp_client *d = NULL;
  char err[REPLICA_ERRLEN];
  if (dp_client_open(&dc, &d, err, sizeof err) != 0) {
    LOG_WARN("replica_data_client", "member=%s addr=%s error=\"%s\"", m->addr, hp, err);
    return NULL;
  }
  pthread_mutex_lock(&m->conn_mu);
  if (m->dp && m->dp_term == term) { /* another forwarder won */
    pthread_mutex_unlock(&m->conn_mu);
    dp_client_close(d);
    return data_client(r, m, term);
  }
  if (m->dp && m->nretired < sizeof m->retired / sizeof m->retired[0])
    m->retired[m->nretired++] = m->dp;
  else if (m->dp)
    dp_client_close(m->dp); /* only after 64 replacements: no forward still uses it */
  m->dp = d;
  m->dp_term = term;
  pthread_mutex_unlock(&m->conn_mu);
  return d;
}

/* Stops using data client d of m (if it is still m's): the next forward
 * asks the member for its data port again. */
static void retire_data_client(member *m, dp_client *d) {
  pthread_mutex_lock(&m->conn_mu);
  if (m->dp == d) {
    if (m->nretired < sizeof m->retired / sizeof m->retired[0]) {
      m->retired[m->nretired++] = d;
      m->dp = NULL;
    }
  }
  pthread_mutex_unlock(&m->conn_mu);
}

/* ------------------------------------------------------------ forwarding */

/* How a backup's answer to a forward is taken. */
enum { FWD_DONE, FWD_RETRY, FWD_DROP, FWD_DEPOSED };

static int classify(int rc) {
  switch (rc) {
  case ZS_OK:
    return FWD_DONE;
  case ZS_ECONN:
  case ZS_ECLOSED:
  case ZS_ETIMEDOUT:
  case ZS_ECANCELED:
  case ZS_ENOTREADY:
  case ZS_ELIMIT:
  case ZS_ECRC:
    return FWD_RETRY;
  case ZS_ESTALE:
    return FWD_DEPOSED;
  case ZS_EBEHIND:
  case ZS_ESTEP:
  case ZS_EHASH:
  case ZS_ENOTOPEN:
  case ZS_EEXIST:
  case ZS_ENOTPRIMARY:
  case ZS_EUNAUTHENTICATED:
  case ZS_EPERM:
    return FWD_DROP;
  default:
    /* The primary accepted this write: a backup that refuses it does not
     * hold what the primary holds. */
    return FWD_DROP;
  }
}

typedef struct fwd_target {
  uint32_t idx;
  int joining;
} fwd_target;

/* The members a write of `step` (0: a write of no step) goes to, under mu.
 * A member that joined with a copy of version V already holds every write of
 * a step up to V: the forward would only be refused (an Apply the joiner's
 * core has no record of) and the member dropped, so it is left out. */
static uint32_t targets_locked(const replica *r, uint64_t step, fwd_target *t) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !(m->in_sync || m->joining) || (step && step <= m->covered))
      continue;
    t[n++] = (fwd_target){.idx = i, .joining = m->joining};
  }
  return n;
}

static int any_joining_locked(const replica *r) {
  for (uint32_t i = 0; i < r->n; i++)
    if (r->m[i].joining)
      return 1;
  return 0;
}

/* After a joiner loaded the copy or was dropped: once no member reads it,
 * the copy is free for the next join (and its memory released, unless an
 * answer still points into it: then the next copy replaces it). */
static void snap_release_locked(replica *r) {
  if (!r->snap_busy || !r->snap_ready || any_joining_locked(r))
    return;
  r->snap_busy = 0;
  if (r->snap_packing == 0)
    core_state_free(&r->snap);
}

static void drop_locked(replica *r, uint32_t i, int rc, const char *why) {
  member *m = &r->m[i];
  if (!m->in_sync && !m->joining)
    return;
  m->in_sync = m->joining = m->join_pending = 0;
  m->covered = 0;
  m->join_id = 0; /* its ReplicaFetch calls are refused: its join failed */
  snap_release_locked(r);
  LOG_WARN("replica_dropped", "member=%u addr=%s term=%" PRIu64 " error=%s detail=\"%s\"", i,
           m->addr, r->term, zs_err_name(rc), why);
}

static void step_down_locked(replica *r, const char *why) {
  if (r->role == REPLICA_PRIMARY || r->role == REPLICA_BACKUP) {
    LOG_WARN("replica_stepped_down", "term=%" PRIu64 " role=%s detail=\"%s\"", r->term,
             replica_role_name(r->role), why);
    r->role = REPLICA_STALE;
    for (uint32_t i = 0; i < r->n; i++)
      r->m[i].in_sync = r->m[i].joining = r->m[i].join_pending = 0;
  }
}

/* After one attempt on member t with status rc: FWD_DONE (move on),
 * FWD_RETRY (again after a pause), or the member dropped / this replica
 * deposed (both: move on; deposed returns ZS_ENOTPRIMARY). */
static int settle(replica *r, const fwd_target *t, int rc, const char *msg, uint64_t first_fail_ms,
                  uint64_t term, int *deposed) {
  int k = classify(rc);
  pthread_mutex_lock(&r->mu);
  member *m = &r->m[t->idx];
  if (r->term != term || r->role != REPLICA_PRIMARY) {
    pthread_mutex_unlock(&r->mu);
    *deposed = 1;
    return FWD_DONE;
  }
  if (rc != ZS_ECONN && rc != ZS_ECLOSED && rc != ZS_ETIMEDOUT && rc != ZS_ECANCELED)
    m->heard_ms = clock_now_ms();
  if (k == FWD_DONE && m->joining) {
    /* A joiner answers only once it loaded its copy, which it no longer
     * reads. */
    m->joining = 0;
    m->in_sync = 1;
    snap_release_locked(r);
    LOG_INFO("replica_joined", "member=%u addr=%s term=%" PRIu64, t->idx, m->addr, r->term);
  } else if (k == FWD_DEPOSED) {
    step_down_locked(r, msg);
    *deposed = 1;
  } else if (k == FWD_DROP) {
    drop_locked(r, t->idx, rc, msg);
  } else if (k == FWD_RETRY) {
    uint64_t now = clock_now_ms();
    if (!m->in_sync && !m->joining) {
      k = FWD_DONE; /* dropped meanwhile */
    } else if (m->joining && rc == ZS_ENOTREADY && now - first_fail_ms >= r->failover_ms) {
      /* Alive but still reading or loading its copy: a write waits for a
       * joiner as long as for any backup, then the joiner is dropped and
       * asks again (a copy made at a later step). */
      drop_locked(r, t->idx, rc,
                  "it was still loading its copy when a write had waited the failover time for "
                  "it: it joins again");
      k = FWD_DONE;
    } else if (m->joining && rc == ZS_ENOTREADY) {
      /* retried until the failover time */
    } else if (now - first_fail_ms >= r->failover_ms) {
      /* The member's last answer says why (a refusal is not a silence). */
      char why[REPLICA_ERRLEN + 64];
      snprintf(why, sizeof why, "no answer within the failover time; the last: %s",
               msg && msg[0] ? msg : zs_err_name(rc));
      drop_locked(r, t->idx, rc, why);
      k = FWD_DONE;
    }
  }
  pthread_mutex_unlock(&r->mu);
  return k == FWD_RETRY ? FWD_RETRY : FWD_DONE;
}

typedef int (*send_fn)(replica *r, member *m, uint64_t term, const void *arg, char *msg,
                       size_t len);

/* Sends one write to every target, each until it answered or was dropped. */
/* The failover time of a forward counts from `since` (when the write began
 * to wait for its backups; 0: now), so that a dead backup holds a write for
 * --failover-ms however many attempts it took. */
static int forward(replica *r, send_fn fn, const void *arg, uint64_t step, uint64_t bytes,
                   uint64_t since, char *err, size_t errlen) {
  if (!since)
    since = clock_now_ms();
  fwd_target t[REPLICA_MAX_MEMBERS];
  pthread_mutex_lock(&r->mu);
  uint64_t term = r->term;
  int primary = r->role == REPLICA_PRIMARY;
  uint32_t n = primary ? targets_locked(r, step, t) : 0;
  pthread_mutex_unlock(&r->mu);
  if (!primary)
    return status_fail(err, errlen, ZS_ENOTPRIMARY, "this replica stopped being the primary");
  int deposed = 0;
  for (uint32_t i = 0; i < n && !deposed; i++) {
    uint64_t first_fail = 0;
    for (;;) {
      char msg[REPLICA_ERRLEN] = "";
      int rc = fn(r, &r->m[t[i].idx], term, arg, msg, sizeof msg);
      if (rc != 0 && !first_fail)
        first_fail = since;
      if (settle(r, &t[i], rc, msg, first_fail, term, &deposed) != FWD_RETRY)
        break;
      struct timespec ts = {.tv_sec = 0, .tv_nsec = REPLICA_RETRY_MS * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  if (deposed)
    return status_fail(err, errlen, ZS_ENOTPRIMARY,
                       "this replica is no longer its shard's primary (a newer term exists)");
  pthread_mutex_lock(&r->mu);
  r->forwards += n;
  r->forwarded_bytes += bytes * n;
  pthread_mutex_unlock(&r->mu);
  return 0;
}

/* A contribution as a forward: the data plane's push of the same bytes,
 * given the failover time to be answered. */
static dp_push_args dp_push_of(const replica *r, const core_push_args *a) {
  return (dp_push_args){.spec_hash = a->hash,
                        .step = a->step,
                        .rank = a->rank,
                        .micro = a->micro,
                        .tensor = a->tensor,
                        .slice = a->slice,
                        .dtype = a->dtype,
                        .data = a->data,
                        .nbytes = a->nbytes,
                        .timeout_ms = r->failover_ms};
}

static int send_push(replica *r, member *m, uint64_t term, const void *arg, char *msg, size_t len) {
  const core_push_args *a = arg;
  dp_client *d = data_client(r, m, term);
  if (!d)
    return status_fail(msg, len, ZS_ECONN, "no data-plane connection to %s", m->addr);
  dp_push_args p = dp_push_of(r, a);
  int dup = 0;
  int rc = dp_client_push_sync(d, &p, &dup, msg, len);
  if (rc == ZS_ECONN || rc == ZS_ECLOSED || rc == ZS_EUNAUTHENTICATED)
    retire_data_client(m, d); /* a restarted member listens elsewhere: ask again */
  return rc;
}

int replica_forward_push(replica *r, const core_push_args *a, char *err, size_t errlen) {
  return forward(r, send_push, a, a->step, a->nbytes, 0, err, errlen);
}

/* The answers to pushes sent at once. */
typedef struct push_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t pending;
  int failed;
} push_wait;

static void on_push_done(void *arg, const dp_result *res) {
  push_wait *w = arg;
  pthread_mutex_lock(&w->mu);
  if (res->status != 0)
    w->failed = 1;
  if (--w->pending == 0)
    pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Sends n pushes to member m at once (pipelined on its connections) and
 * waits for every answer: 0 when all were taken. */
static int send_pushes(replica *r, member *m, uint64_t term, const core_push_args *a, uint32_t n) {
  dp_client *d = data_client(r, m, term);
  if (!d)
    return ZS_ECONN;
  push_wait w = {.pending = n};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  for (uint32_t i = 0; i < n; i++) {
    dp_push_args p = dp_push_of(r, &a[i]);
    /* Half the failover time: a failure here still leaves the one-by-one
     * path time to retry before the member is dropped. */
    p.timeout_ms = r->failover_ms / 2;
    if (dp_client_push(d, &p, on_push_done, &w) != 0) {
      pthread_mutex_lock(&w.mu);
      w.failed = 1;
      w.pending--;
      pthread_mutex_unlock(&w.mu);
    }
  }
  pthread_mutex_lock(&w.mu);
  while (w.pending)
    pthread_cond_wait(&w.cv, &w.mu);
  int failed = w.failed;
  pthread_mutex_unlock(&w.mu);
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  return failed ? ZS_ECONN : 0;
}

int replica_forward_pushes(replica *r, const core_push_args *a, uint32_t n, char *err,
                           size_t errlen) {
  fwd_target t[REPLICA_MAX_MEMBERS];
  uint64_t since = clock_now_ms();
  pthread_mutex_lock(&r->mu);
  uint64_t term = r->term;
  uint32_t nt = r->role == REPLICA_PRIMARY ? targets_locked(r, 0, t) : 0;
  pthread_mutex_unlock(&r->mu);
  /* The common case at once; any failure takes the one-by-one path, which
   * retries, drops or steps down (a repeat is acknowledged as a duplicate). */
  int all = n > 1 && nt > 0;
  for (uint32_t i = 0; all && i < nt; i++)
    all = send_pushes(r, &r->m[t[i].idx], term, a, n) == 0;
  if (all) {
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = 0; i < nt; i++) {
      member *m = &r->m[t[i].idx];
      if (m->joining || !m->in_sync) /* settle() decides those */
        all = 0;
    }
    if (all && r->term == term) {
      uint64_t bytes = 0;
      for (uint32_t k = 0; k < n; k++)
        bytes += a[k].nbytes;
      r->forwards += (uint64_t)n * nt;
      r->forwarded_bytes += bytes * nt;
    }
    pthread_mutex_unlock(&r->mu);
    if (all)
      return 0;
  }
  for (uint32_t k = 0; k < n; k++) {
    int rc = forward(r, send_push, &a[k], a[k].step, a[k].nbytes, since, err, errlen);
    if (rc)
      return rc;
  }
  return 0;
}

typedef struct raw_req {
  const char *method;
  const void *msg;
  size_t len;
} raw_req;

static int send_raw(replica *r, member *m, uint64_t term, const void *arg, char *msg, size_t len) {
  const raw_req *q = arg;
  rpc_channel *ch = channel(r, m);
  if (!ch)
    return status_fail(msg, len, ZS_ECONN, "no channel to %s", m->addr);
  char tbuf[24], ibuf[12];
  snprintf(tbuf, sizeof tbuf, "%" PRIu64, term);
  snprintf(ibuf, sizeof ibuf, "%u", r->index);
  rpc_md md[2] = {{"zshard-replica-term", tbuf}, {"zshard-replica-from", ibuf}};
  rpc_status st;
  ProtobufCMessage *resp = NULL;
  /* An Apply may wait for a backup's running apply: a backup's deadline is
   * the time an apply may take. A joiner runs no apply before it loaded its
   * copy (it answers ZS_ENOTREADY at once): one that is silent for the
   * failover time is gone. */
  pthread_mutex_lock(&r->mu);
  uint32_t ms = m->joining ? r->failover_ms : REPLICA_RPC_MS;
  pthread_mutex_unlock(&r->mu);
  int rc = rpc_call_raw(ch, q->method, q->msg, q->len, md, 2, NULL, &resp, ms, &st);
  if (rc)
    snprintf(msg, len, "%s", st.message);
  return rc;
}

int replica_forward_raw(replica *r, const char *method, uint64_t step, const void *msg, size_t len,
                        char *err, size_t errlen) {
  raw_req q = {.method = method, .msg = msg, .len = len};
  return forward(r, send_raw, &q, step, len, 0, err, errlen);
}

/* ------------------------------------------------------------ admission */

static int live_primary_locked(const replica *r, uint64_t min);
static int config_error_locked(const replica *r, char *buf, size_t len);
static void probe_all(replica *r, uint32_t ms);

/* Whether a peer whose list agrees probed this replica with `term`. */
static int heard_term_locked(const replica *r, uint64_t term) {
  for (uint32_t i = 0; i < r->n; i++)
    if (i != r->index && r->m[i].heard_term == term)
      return 1;
  return 0;
}

/* Whether a STARTING replica may follow the primary of `term`, whose forward
 * came (has_job: this replica holds a job). It has checked no configuration
 * when a forward reaches it first: it follows only a primary its own probe
 * saw as primary of that term with the same member list, and only while it
 * holds no job (a primary counts a starting member in sync only when
 * neither holds one; one that loaded its checkpoint at a restart joins and
 * copies). 0, or ZS_ENOTREADY (not probed yet: the monitor probes now and
 * the primary retries), ZS_EBEHIND or ZS_EINVAL with a sentence. */
static int starting_may_follow_locked(replica *r, uint64_t term, int has_job, char *err,
                                      size_t errlen) {
  char why[REPLICA_CONFIG_LEN + 64];
  if (config_error_locked(r, why, sizeof why))
    return status_fail(err, errlen, ZS_EINVAL, "replica %u refuses to form a set: %s", r->index,
                       why);
  if (has_job)
    return status_fail(err, errlen, ZS_EBEHIND,
                       "replica %u is starting with a job's state it loaded itself: it joins "
                       "(copies the primary's state) before it takes forwards",
                       r->index);
  int p = live_primary_locked(r, term);
  if (p < 0 || r->m[p].seen_term != term) {
    /* A peer whose probe carried this term with the same list (a new
     * primary probes every peer before it answers Promote) was checked as
     * well: the primary's own index is learnt at the next probe. */
    if (heard_term_locked(r, term)) {
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

/* A forward of term `term` from the primary: follows a newer term. has_job:
 * whether this replica holds a job (read for a STARTING one only; else
 * unused). */
static int admit_forward_locked(replica *r, uint64_t term, int has_job, char *err, size_t errlen) {
  if (term > REPLICA_TERM_MAX)
    return status_fail(err, errlen, ZS_ERANGE,
                       "a forward of term %" PRIu64 ", above the highest term %" PRIu64, term,
                       REPLICA_TERM_MAX);
  if (term < r->term)
    return status_fail(err, errlen, ZS_ESTALE,
                       "a forward of term %" PRIu64 ", but this replica is at term %" PRIu64, term,
                       r->term);
  if (r->role == REPLICA_STARTING) {
    int rc = starting_may_follow_locked(r, term, has_job, err, errlen);
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
      int seen = live_primary_locked(r, fwd_term) >= 0 || heard_term_locked(r, fwd_term);
      pthread_mutex_unlock(&r->mu);
      core_info info;
      core_get_info(r->core, &info);
      has_job = info.has_job;
      if (!seen && !has_job) /* a data-plane push needs a job: never on its loop */
        probe_all(r, REPLICA_PROBE_MS);
      pthread_mutex_lock(&r->mu);
    }
    rc = fwd_admin
             ? admit_forward_locked(r, fwd_term, has_job, err, errlen)
             : status_fail(err, errlen, ZS_EPERM, "a replica's forward needs the admin token");
    pthread_mutex_unlock(&r->mu);
    return rc;
  }
  if (client_term > r->term && !r->probe_now) {
    /* A trainer's word is no proof (any token holder can send any number):
     * the monitor asks the peers now, and a primary steps down only when it
     * sees a newer primary itself. */
    r->probe_now = 1;
    pthread_cond_broadcast(&r->cv);
  }
  int primary = r->role == REPLICA_PRIMARY;
  int serves = primary || (kind == REPLICA_READ && r->role == REPLICA_BACKUP);
  if (!serves) {
    char who[200];
    say_primary_locked(r, who, sizeof who);
    rc = status_fail(err, errlen, ZS_ENOTPRIMARY, "replica %u (%s) is %s; %s", r->index,
                     r->m[r->index].addr, replica_role_name(r->role), who);
  } else if (forward && primary && kind == REPLICA_WRITE) {
    fwd_target t[REPLICA_MAX_MEMBERS];
    *forward = targets_locked(r, 0, t) > 0;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* ------------------------------------------------------------ joins (primary) */

static int snap_view(void *arg, const core_view *v) {
  replica *r = arg;
  core_state *st = &r->snap;
  char err[REPLICA_ERRLEN];
  core_state_free(st);
  int rc = core_state_init(st, v->spec, v->shard_id, err, sizeof err);
  if (rc)
    return rc;
  st->version = v->version;
  st->optimizer_steps = v->optimizer_steps;
  if (v->tensor_steps) {
    size_t n = (size_t)v->spec->num_tensors * sizeof *st->tensor_steps;
    if (!(st->tensor_steps = malloc(n + 1)))
      return ZS_ENOMEM;
    memcpy(st->tensor_steps, v->tensor_steps, n);
  }
  memcpy(st->master, v->master, v->nelems * sizeof(float));
  if (st->m && v->m)
    memcpy(st->m, v->m, v->nelems * sizeof(float));
  if (st->v && v->v)
    memcpy(st->v, v->v, v->nelems * sizeof(float));
  if (v->client_state_len) {
    st->client_state = malloc(v->client_state_len);
    if (!st->client_state)
      return ZS_ENOMEM;
    memcpy(st->client_state, v->client_state, v->client_state_len);
    st->client_state_len = v->client_state_len;
  }
  return 0;
}

static void snap_done(void *arg, int status, double fn_seconds) {
  replica *r = arg;
  pthread_mutex_lock(&r->mu);
  r->snap_ready = 1;
  r->snap_status = status;
  for (uint32_t i = 0; i < r->n && status != 0; i++)
    if (r->m[i].joining)
      drop_locked(r, i, status, "the copy of the state failed");
  snap_release_locked(r); /* all dropped while the copy was made */
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  LOG_INFO("replica_copy", "status=%s copy_s=%.3f", zs_err_name(status), fn_seconds);
}

void replica_on_applied(void *arg, const core_apply_result *res) {
  replica *r = arg;
  pthread_mutex_lock(&r->mu);
  r->hooked_version = res->version;
  pthread_cond_broadcast(&r->hooked_cv);
  /* Only the Apply of the copy's own step can still be forwarded after it
   * (the trainers' Applies of a step are answered before the next one is
   * applied); a restore may also take the version back below it. */
  for (uint32_t i = 0; i < r->n; i++)
    if (r->m[i].covered != res->version)
      r->m[i].covered = 0;
  /* A member that joined or was dropped meanwhile (a promotion, a step
   * down) leaves the copy to the next joiners. */
  snap_release_locked(r);
  uint32_t start = 0;
  int can = r->role == REPLICA_PRIMARY && !r->stopping && !r->snap_busy;
  for (uint32_t i = 0; i < r->n && can; i++) {
    member *m = &r->m[i];
    if (!m->join_pending)
      continue;
    m->join_pending = 0;
    m->joining = 1; /* every write from now on goes to it too */
    m->covered = res->version;
    r->joins++;
    start++;
  }
  if (start) {
    r->snap_busy = 1;
    r->snap_ready = 0;
  }
  pthread_mutex_unlock(&r->mu);
  if (!start)
    return;
  core_info info;
  core_get_info(r->core, &info);
  char err[REPLICA_ERRLEN];
  int rc = core_snapshot_async(r->core, info.spec_hash, res->version, 0, snap_view, r, snap_done, r,
                               err, sizeof err);
  LOG_INFO("replica_copy_start", "members=%u version=%" PRIu64 " status=%s", start, res->version,
           rc == CORE_PENDING ? "pending" : zs_err_name(rc));
  if (rc != CORE_PENDING)
    snap_done(r, rc < 0 ? rc : ZS_EINTERNAL, 0);
}

void replica_wait_applied(replica *r, uint64_t version) {
  if (!r || version == 0)
    return;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += r->failover_ms / 1000;
  ts.tv_nsec += (long)(r->failover_ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&r->mu);
  while (r->role == REPLICA_PRIMARY && r->hooked_version < version && !r->stopping)
    if (pthread_cond_timedwait(&r->hooked_cv, &r->mu, &ts) != 0)
      break;
  pthread_mutex_unlock(&r->mu);
}

int replica_join(replica *r, uint64_t term, uint32_t index, uint64_t *join_id, char *err,
                 size_t errlen) {
  *join_id = 0;
  core_info info;
  core_get_info(r->core, &info);
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  if (r->role != REPLICA_PRIMARY || term != r->term) {
    char who[200];
    say_primary_locked(r, who, sizeof who);
    rc = status_fail(err, errlen, term > r->term ? ZS_ESTALE : ZS_ENOTPRIMARY,
                     "ReplicaJoin for term %" PRIu64 ": this replica is %s of term %" PRIu64 "; %s",
                     term, replica_role_name(r->role), r->term, who);
  } else if (index >= r->n || index == r->index) {
    rc = status_fail(err, errlen, ZS_EINVAL, "ReplicaJoin: member %u is not a peer of member %u",
                     index, r->index);
  } else if (!info.has_job) {
    /* Nothing to copy: it is in sync, and the job's Open will reach it. */
    member *m = &r->m[index];
    m->in_sync = 1;
    m->joining = m->join_pending = 0;
    m->covered = m->join_id = 0;
    snap_release_locked(r);
  } else {
    /* A joiner that came back starts again: the copy it read, if any, is
     * not its copy any more. It called: it is alive now. */
    member *m = &r->m[index];
    m->in_sync = m->joining = 0;
    m->covered = 0;
    m->join_pending = 1;
    m->join_id = ++r->join_seq;
    m->heard_ms = clock_now_ms();
    snap_release_locked(r);
    *join_id = m->join_id; /* its ReplicaFetch calls carry it */
  }
  pthread_mutex_unlock(&r->mu);
  if (rc == 0)
    LOG_INFO("replica_join_asked", "member=%u term=%" PRIu64 " copy=%s", index, term,
             *join_id ? "at the next step" : "none");
  return rc;
}

static int fetch_array(const core_state *st, int part, const float **src) {
  *src = part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_MASTER       ? st->master
         : part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG    ? st->m
         : part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG_SQ ? st->v
                                                                     : NULL;
  return *src ? 0 : ZS_EINVAL;
}

int replica_fetch(replica *r, const Zshard__V1__ReplicaFetchRequest *q,
                  Zshard__V1__ReplicaFetchResponse *resp, char *err, size_t errlen) {
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  const core_state *st = &r->snap;
  member *m = NULL;
  for (uint32_t i = 0; i < r->n && q->join_id; i++)
    if (i != r->index && r->m[i].join_id == q->join_id && (r->m[i].joining || r->m[i].join_pending))
      m = &r->m[i];
  if (m)
    m->heard_ms = clock_now_ms();
  if (r->role != REPLICA_PRIMARY) {
    rc = status_fail(err, errlen, ZS_ENOTPRIMARY, "this replica is no longer the primary");
  } else if (!m) {
    /* Its join ended (dropped, or it asked again): a copy loaded now would
     * miss the writes since, which nobody forwards to it. */
    rc = status_fail(err, errlen, ZS_ECANCELED,
                     "join %" PRIu64 " is not in progress here (dropped): join again", q->join_id);
  } else if (!m->joining || !r->snap_busy || !r->snap_ready) {
    rc = status_fail(err, errlen, ZS_ENOTREADY, "the copy is made at the next applied step");
  } else if (r->snap_status != 0) {
    rc = status_fail(err, errlen, r->snap_status, "the copy of the state failed");
  } else if (q->part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_META) {
    resp->spec = malloc(sizeof *resp->spec);
    if (resp->spec)
      zshard__v1__model_spec__init(resp->spec);
    if (!resp->spec || spec_to_proto(&st->spec, resp->spec) != 0) {
      free(resp->spec);
      resp->spec = NULL;
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
    }
    resp->version = st->version;
    resp->optimizer_steps = st->optimizer_steps;
    resp->n_tensor_steps = st->tensor_steps ? st->spec.num_tensors : 0;
    resp->tensor_steps = st->tensor_steps;
    resp->client_state.data = st->client_state;
    resp->client_state.len = st->client_state_len;
    resp->elements = st->nelems;
    resp->has_exp_avg = st->m != NULL;
    resp->has_exp_avg_sq = st->v != NULL;
    resp->shard_id = st->shard_id;
  } else {
    const float *src = NULL;
    if (fetch_array(st, q->part, &src) != 0 || q->count > REPLICA_FETCH_ELEMS ||
        q->offset > st->nelems || q->count > st->nelems - q->offset) {
      rc = status_fail(err, errlen, ZS_ERANGE,
                       "ReplicaFetch part %d elements [%" PRIu64 ", +%" PRIu64 ") of %" PRIu64
                       " (at most %u at once)",
                       (int)q->part, q->offset, q->count, st->nelems, REPLICA_FETCH_ELEMS);
    } else {
      resp->data.data = (uint8_t *)(uintptr_t)(src + q->offset);
      resp->data.len = q->count * sizeof(float);
    }
  }
  /* The copy is only replaced by the next join, which waits for its
   * joiners to end (snap_busy), and is freed only with no answer pointing
   * into it (snap_packing): the pointers stay valid while it is packed. */
  if (rc == 0)
    r->snap_packing++;
  pthread_mutex_unlock(&r->mu);
  return rc;
}

void replica_fetch_release(replica *r, Zshard__V1__ReplicaFetchResponse *resp, int served) {
  if (served) {
    pthread_mutex_lock(&r->mu);
    r->snap_packing--;
    pthread_mutex_unlock(&r->mu);
  }
  if (resp->spec) {
    spec_proto_release(resp->spec);
    free(resp->spec);
    resp->spec = NULL;
  }
}

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
static void probe_all(replica *r, uint32_t ms) {
  for (uint32_t i = 0; i < r->n; i++) {
    if (i == r->index)
      continue;
    Zshard__V1__GetInfoResponse *info = NULL;
    peer_info(r, &r->m[i], ms, &info);
    pthread_mutex_lock(&r->mu);
    record_locked(r, i, info);
    pthread_mutex_unlock(&r->mu);
    if (info)
      protobuf_c_message_free_unpacked(&info->base, NULL);
  }
}

static int fresh(const member *m) {
  return m->reachable && m->last_ok_ms &&
         clock_now_ms() - m->last_ok_ms < 2 * REPLICA_PROBE_MS + REPLICA_MONITOR_MS;
}

/* The reachable peer that is primary of the highest term above `min`, or -1. */
static int live_primary_locked(const replica *r, uint64_t min) {
  int best = -1;
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !fresh(m) || m->seen_role != REPLICA_PRIMARY || m->seen_config[0])
      continue;
    if (m->seen_term >= min && (best < 0 || m->seen_term > r->m[best].seen_term))
      best = (int)i;
  }
  return best;
}

/* ------------------------------------------------------------ promotion */

/* Why this replica refuses to form a set (a peer's member list differs),
 * into buf; 0 when nothing does. */
static int config_error_locked(const replica *r, char *buf, size_t len) {
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
static int promote_check_locked(replica *r, uint64_t term, int admin, const core_info *info,
                                uint64_t *next, char *err, size_t errlen) {
  char why[REPLICA_CONFIG_LEN + 64];
  if (config_error_locked(r, why, sizeof why))
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
  int p = live_primary_locked(r, r->term);
  if (p >= 0)
    return status_fail(err, errlen, ZS_ENOTPRIMARY,
                       "member %d (%s) is the primary of term %" PRIu64, p, r->m[p].addr,
                       r->m[p].seen_term);
  if (r->role == REPLICA_PRIMARY || r->role == REPLICA_BACKUP)
    return 0;
  /* Not in sync: only when nobody reachable holds more. */
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !fresh(m) || !m->seen_has_job)
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

/* The peers a new primary counts in sync: they hold what it holds (the same
 * job within one version: the trainers' retries bring both to the same
 * step), or, with no job anywhere, nothing. */
static void adopt_backups_locked(replica *r, const core_info *info) {
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    m->join_pending = m->joining = 0;
    m->in_sync = 0;
    if (i == r->index || !fresh(m) || m->seen_config[0])
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
  probe_all(r, r->failover_ms);
  core_info info;
  core_get_info(r->core, &info);
  pthread_mutex_lock(&r->mu);
  uint64_t next = 0;
  int rc = promote_check_locked(r, term, admin, &info, &next, err, errlen);
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
    probe_all(r, REPLICA_PROBE_MS);
  return rc;
}

/* ------------------------------------------------------------ joining (joiner) */

/* One ReplicaFetch from member p, retried while the copy is not made yet. */
static int fetch_part(replica *r, member *p, uint64_t join_id, int part, uint64_t offset,
                      uint64_t count, Zshard__V1__ReplicaFetchResponse **out, char *err,
                      size_t errlen) {
  uint64_t start = clock_now_ms();
  for (;;) {
    rpc_channel *ch = channel(r, p);
    if (!ch)
      return status_fail(err, errlen, ZS_ECONN, "no channel to %s", p->addr);
    Zshard__V1__ReplicaFetchRequest q = ZSHARD__V1__REPLICA_FETCH_REQUEST__INIT;
    q.join_id = join_id;
    q.part = (Zshard__V1__ReplicaPart)part;
    q.offset = offset;
    q.count = count;
    rpc_status st;
    int rc = rpc_call(ch, REPLICA_METHOD("ReplicaFetch"), &q.base,
                      &zshard__v1__replica_fetch_response__descriptor, (ProtobufCMessage **)out,
                      REPLICA_RPC_MS, &st);
    if (rc != ZS_ENOTREADY || clock_now_ms() - start > REPLICA_JOIN_MS) {
      if (rc)
        status_fail(err, errlen, rc, "ReplicaFetch from %s: %s", p->addr, st.message);
      return rc;
    }
    pthread_mutex_lock(&r->mu);
    int stop = r->stopping;
    pthread_mutex_unlock(&r->mu);
    if (stop)
      return status_fail(err, errlen, ZS_ECANCELED, "stopping");
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

static int fetch_array_into(replica *r, member *p, uint64_t join_id, int part, float *dst,
                            uint64_t n, char *err, size_t errlen) {
  for (uint64_t off = 0; off < n;) {
    uint64_t k = n - off < REPLICA_FETCH_ELEMS ? n - off : REPLICA_FETCH_ELEMS;
    Zshard__V1__ReplicaFetchResponse *a = NULL;
    int rc = fetch_part(r, p, join_id, part, off, k, &a, err, errlen);
    if (rc)
      return rc;
    if (a->data.len != k * sizeof(float)) {
      protobuf_c_message_free_unpacked(&a->base, NULL);
      return status_fail(err, errlen, ZS_EPROTO, "ReplicaFetch answered %zu bytes, not %" PRIu64,
                         a->data.len, k * sizeof(float));
    }
    memcpy(dst + off, a->data.data, a->data.len);
    protobuf_c_message_free_unpacked(&a->base, NULL);
    off += k;
  }
  return 0;
}

/* Reads the primary's copy into st (initialised from its META). */
static int fetch_state(replica *r, member *p, uint64_t join_id, core_state *st, char *err,
                       size_t errlen) {
  Zshard__V1__ReplicaFetchResponse *meta = NULL;
  int rc = fetch_part(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_META, 0, 0, &meta, err,
                      errlen);
  if (rc)
    return rc;
  spec sp;
  memset(&sp, 0, sizeof sp);
  rc = meta->spec ? spec_from_proto(&sp, meta->spec, err, errlen)
                  : status_fail(err, errlen, ZS_EPROTO, "the copy's META has no spec");
  if (rc == 0)
    rc = core_state_init(st, &sp, meta->shard_id, err, errlen);
  if (rc == 0 && st->nelems != meta->elements)
    rc = status_fail(err, errlen, ZS_EPROTO, "the copy has %" PRIu64 " elements, the spec %" PRIu64,
                     meta->elements, st->nelems);
  if (rc == 0 && meta->client_state.len) {
    st->client_state = malloc(meta->client_state.len);
    if (!st->client_state)
      rc = ZS_ENOMEM;
    else
      memcpy(st->client_state, meta->client_state.data, meta->client_state.len);
    st->client_state_len = meta->client_state.len;
  }
  if (rc == 0 && meta->n_tensor_steps) {
    if (meta->n_tensor_steps != st->spec.num_tensors)
      rc = status_fail(err, errlen, ZS_EPROTO,
                       "the copy has %zu tensor step counts, the spec %u tensors",
                       meta->n_tensor_steps, st->spec.num_tensors);
    else if (!(st->tensor_steps = malloc(meta->n_tensor_steps * sizeof *st->tensor_steps)))
      rc = ZS_ENOMEM;
    else
      memcpy(st->tensor_steps, meta->tensor_steps, meta->n_tensor_steps * sizeof *st->tensor_steps);
  }
  if (rc == 0) {
    st->version = meta->version;
    st->optimizer_steps = meta->optimizer_steps;
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_MASTER, st->master,
                          st->nelems, err, errlen);
  }
  if (rc == 0 && st->m)
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG, st->m,
                          st->nelems, err, errlen);
  if (rc == 0 && st->v)
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG_SQ, st->v,
                          st->nelems, err, errlen);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&meta->base, NULL);
  return rc;
}

/* Replaces this replica's state by the copy, closing a job of another spec
 * first. */
static int load_state(replica *r, core_state *st, char *err, size_t errlen) {
  core_info info;
  core_get_info(r->core, &info);
  if (info.has_job && info.spec_hash != spec_hash(&st->spec)) {
    core_close_result cr;
    int rc = service_close(r->svc, 0, NULL, &cr, err, errlen);
    if (rc)
      return rc;
  }
  return core_restore(r->core, st, st->version, err, errlen);
}

/* Asks member p (primary of `term`) to join and loads its copy. Returns 0
 * or the failure's status (logged). */
static int join_primary(replica *r, uint32_t p, uint64_t term) {
  pthread_mutex_lock(&r->mu);
  r->role = REPLICA_JOINING;
  r->term = term;
  r->primary = (int)p;
  pthread_mutex_unlock(&r->mu);
  char err[REPLICA_ERRLEN] = "";
  member *pm = &r->m[p];
  uint64_t t0 = clock_now_ms();
  Zshard__V1__ReplicaJoinRequest q = ZSHARD__V1__REPLICA_JOIN_REQUEST__INIT;
  q.term = term;
  q.index = r->index;
  Zshard__V1__ReplicaJoinResponse *resp = NULL;
  rpc_status st;
  rpc_channel *ch = channel(r, pm);
  int rc = ch ? rpc_call(ch, REPLICA_METHOD("ReplicaJoin"), &q.base,
                         &zshard__v1__replica_join_response__descriptor, (ProtobufCMessage **)&resp,
                         REPLICA_RPC_MS, &st)
              : ZS_ECONN;
  if (rc)
    snprintf(err, sizeof err, "%.200s", ch ? st.message : "no channel");
  uint64_t join_id = resp ? resp->join_id : 0;
  if (resp)
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  core_state cs;
  memset(&cs, 0, sizeof cs);
  if (rc == 0 && join_id == 0) {
    core_info info;
    core_get_info(r->core, &info);
    core_close_result cr;
    if (info.has_job)
      rc = service_close(r->svc, 0, NULL, &cr, err, sizeof err);
  } else if (rc == 0) {
    rc = fetch_state(r, pm, join_id, &cs, err, sizeof err);
    if (rc == 0)
      rc = load_state(r, &cs, err, sizeof err);
  }
  core_state_free(&cs);
  pthread_mutex_lock(&r->mu);
  if (r->role == REPLICA_JOINING && r->term == term)
    r->role = rc == 0 ? REPLICA_BACKUP : REPLICA_STALE;
  if (rc == 0)
    r->joins++;
  pthread_mutex_unlock(&r->mu);
  if (rc == 0)
    LOG_INFO("replica_loaded", "primary=%u term=%" PRIu64 " copy=%s took_ms=%" PRIu64, p, term,
             join_id ? "yes" : "none", clock_now_ms() - t0);
  else
    LOG_WARN("replica_join_failed", "primary=%u term=%" PRIu64 " error=%s detail=\"%s\"", p, term,
             zs_err_name(rc), err);
  return rc;
}

/* ------------------------------------------------------------ the monitor */

/* A member asked to join (or joining) that neither answered GetInfo nor
 * called (heard_ms) for the failover time is dropped: a joiner holds the
 * trainers' writes, and one that is gone would hold them until the join's
 * limit. One whose join
 * failed asks again (which starts its join afresh), or is dropped by the
 * forwards it refuses. */
static void monitor_joiners_locked(replica *r, uint64_t now) {
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    if (i == r->index || !(m->joining || m->join_pending))
      continue;
    uint64_t seen = m->heard_ms > m->last_ok_ms ? m->heard_ms : m->last_ok_ms;
    if (fresh(m) || now - seen <= r->failover_ms)
      continue;
    const char *why = "it stopped answering while it joined";
    if (m->joining) {
      drop_locked(r, i, ZS_ECONN, why);
    } else {
      m->join_pending = 0;
      LOG_WARN("replica_join_dropped", "member=%u addr=%s term=%" PRIu64 " detail=\"%s\"", i,
               m->addr, r->term, why);
    }
  }
}

/* The primary's round: a newer primary deposes it; a backup that fell
 * behind, or came back empty, is dropped (it joins again); so is a joiner
 * that is gone. */
static void monitor_primary_locked(replica *r, const core_info *info) {
  int p = live_primary_locked(r, r->term + 1);
  if (p >= 0) {
    step_down_locked(r, "a peer is primary of a newer term");
    return;
  }
  uint64_t now = clock_now_ms();
  monitor_joiners_locked(r, now);
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    if (i == r->index || !m->in_sync || !fresh(m))
      continue;
    /* A probe may race a forward (the job opened here, its Open on the way):
     * only a state that lasts the failover time counts. */
    const char *why = m->seen_config[0] ? "its --replicas list differs from this member's"
                      : info->has_job && !m->seen_has_job ? "it holds no job"
                      : m->seen_version + 1 < info->version
                          ? "its version is more than one step behind"
                      : (m->seen_role != REPLICA_BACKUP || m->seen_term != r->term) &&
                              !(m->seen_role == REPLICA_STARTING && !info->has_job)
                          ? "it is not a backup of this term"
                          : NULL;
    if (!why) {
      m->behind_since_ms = 0;
    } else if (!m->behind_since_ms) {
      m->behind_since_ms = now;
    } else if (now - m->behind_since_ms > r->failover_ms) {
      drop_locked(r, i, ZS_EBEHIND, why);
    }
  }
}

/* A backup's round: dropped by its primary, or a newer primary that does
 * not count it, makes it stale. */
static void monitor_backup_locked(replica *r) {
  int p = live_primary_locked(r, r->term);
  if (p < 0)
    return;
  const member *m = &r->m[p];
  if (m->seen_term == r->term)
    r->primary = p;
  if (!m->seen_lists_me) {
    step_down_locked(r, m->seen_term > r->term ? "a newer primary does not count this replica"
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
static int starting_counted_locked(const replica *r, uint32_t p, int has_job) {
  char why[REPLICA_CONFIG_LEN + 64];
  const member *m = &r->m[p];
  return r->role == REPLICA_STARTING && !has_job && m->seen_counts_me && !m->seen_has_job &&
         !config_error_locked(r, why, sizeof why);
}

static void *monitor_main(void *arg) {
  replica *r = arg;
  for (;;) {
    probe_all(r, REPLICA_PROBE_MS);
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
      monitor_primary_locked(r, &info);
    } else if (r->role == REPLICA_BACKUP) {
      monitor_backup_locked(r);
    }
    if (r->role == REPLICA_STARTING || r->role == REPLICA_STALE) {
      join = live_primary_locked(r, r->term);
      term = join >= 0 ? r->m[join].seen_term : 0;
    }
    if (join >= 0 && starting_counted_locked(r, (uint32_t)join, info.has_job)) {
      LOG_INFO("replica_term", "term=%" PRIu64 " was=%" PRIu64 " role=starting primary=%d", term,
               r->term, join);
      r->role = REPLICA_BACKUP;
      r->term = term;
      r->primary = join;
      join = -1;
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
    if (join >= 0 && join_primary(r, (uint32_t)join, term) != 0) {
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
  if (!why[0] && term <= REPLICA_TERM_MAX && term > r->m[index].heard_term) {
    /* A peer of a newer term (just promoted): look at it now. */
    r->m[index].heard_term = term;
    if (term > r->term) {
      r->probe_now = 1;
      pthread_cond_broadcast(&r->cv);
    }
  }
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

/* ------------------------------------------------------------ observability */

void replica_info(replica *r, Zshard__V1__ReplicaInfo *out, void *members, void **mptr,
                  char *config_error, size_t config_len) {
  Zshard__V1__ReplicaMember *mem = members;
  Zshard__V1__ReplicaMember **ptr = (Zshard__V1__ReplicaMember **)mptr;
  core_info info;
  core_get_info(r->core, &info);
  uint64_t now = clock_now_ms();
  pthread_mutex_lock(&r->mu);
  out->role = (Zshard__V1__ReplicaRole)r->role;
  out->term = r->term;
  out->index = r->index;
  out->primary = r->primary;
  out->failovers = r->failovers;
  out->forwarded_bytes = r->forwarded_bytes;
  out->forwards = r->forwards;
  out->joins = r->joins;
  config_error_locked(r, config_error, config_len);
  out->config_error = config_error;
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    zshard__v1__replica_member__init(&mem[i]);
    mem[i].index = i;
    mem[i].address = m->addr;
    int self = i == r->index;
    mem[i].role = (Zshard__V1__ReplicaRole)(self ? r->role : m->seen_role);
    mem[i].in_sync = self ? (r->role == REPLICA_PRIMARY || r->role == REPLICA_BACKUP) : m->in_sync;
    mem[i].joining = !self && m->joining;
    mem[i].version = self ? info.version : m->seen_version;
    mem[i].last_seen_s = self ? 0.0 : m->last_ok_ms ? (double)(now - m->last_ok_ms) / 1e3 : -1.0;
    ptr[i] = &mem[i];
  }
  out->n_members = r->n;
  out->members = ptr;
  pthread_mutex_unlock(&r->mu);
}

void replica_metrics(void *arg, metrics_text *t) {
  replica *r = arg;
  core_info info;
  core_get_info(r->core, &info);
  pthread_mutex_lock(&r->mu);
  metrics_text_printf(t,
                      "# HELP zshard_replica_role This replica's role in its shard's replica set.\n"
                      "# TYPE zshard_replica_role gauge\n");
  for (int k = REPLICA_STARTING; k <= REPLICA_STALE; k++)
    metrics_text_printf(t, "zshard_replica_role{shard=\"%u\",role=\"%s\"} %d\n", info.shard_id,
                        replica_role_name(k), r->role == k);
  metrics_text_printf(
      t,
      "# HELP zshard_replica_term The replica set's term this replica is at.\n"
      "# TYPE zshard_replica_term gauge\nzshard_replica_term{shard=\"%u\"} %" PRIu64 "\n"
      "# HELP zshard_replica_failovers_total Promotions this replica took.\n"
      "# TYPE zshard_replica_failovers_total counter\n"
      "zshard_replica_failovers_total{shard=\"%u\"} %" PRIu64 "\n"
      "# HELP zshard_replica_forwards_total Writes forwarded to backups.\n"
      "# TYPE zshard_replica_forwards_total counter\n"
      "zshard_replica_forwards_total{shard=\"%u\"} %" PRIu64 "\n"
      "# HELP zshard_replica_forwarded_bytes_total Bytes of writes forwarded to "
      "backups.\n"
      "# TYPE zshard_replica_forwarded_bytes_total counter\n"
      "zshard_replica_forwarded_bytes_total{shard=\"%u\"} %" PRIu64 "\n"
      "# HELP zshard_replica_joins_total State copies served or loaded.\n"
      "# TYPE zshard_replica_joins_total counter\n"
      "zshard_replica_joins_total{shard=\"%u\"} %" PRIu64 "\n"
      "# HELP zshard_replica_member_lag_steps Versions a member is behind this one, "
      "as last seen.\n"
      "# TYPE zshard_replica_member_lag_steps gauge\n",
      info.shard_id, r->term, info.shard_id, r->failovers, info.shard_id, r->forwards,
      info.shard_id, r->forwarded_bytes, info.shard_id, r->joins);
  for (uint32_t i = 0; i < r->n; i++) {
    if (i == r->index || !r->m[i].last_ok_ms)
      continue;
    uint64_t v = r->m[i].seen_version;
    metrics_text_printf(t,
                        "zshard_replica_member_lag_steps{shard=\"%u\",member=\"%u\"} %" PRIu64 "\n",
                        info.shard_id, i, info.version > v ? info.version - v : 0);
  }
  pthread_mutex_unlock(&r->mu);
}
