/*
 * replica — a shard run as a replica set (see replica.h for the contract,
 * docs/DESIGN.md "Replica sets" for why it is built this way). This file is
 * the object itself: the member list, creation and teardown, the
 * connections to the peers (gRPC channels, data clients) and what GetInfo
 * and /metrics show. Each role lives in a file of its own (replica_internal.h
 * lists them).
 *
 * Threads: the transports' threads call replica_admit and the forwards; the
 * core's worker calls replica_on_applied; the monitor thread
 * (replica__monitor_main) probes the peers, drops laggards, steps down and
 * joins. gRPC polling threads run Promote, ReplicaJoin and ReplicaFetch.
 *
 * Lock order: member.conn_mu, then replica.mu (a leaf: never held across a
 * peer call, a core call or a connect).
 */
#include "server/replica/replica_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"

/* ------------------------------------------------------------ helpers */

const char *replica_role_name(int role) {
  static const char *const names[] = {"none", "starting", "primary", "backup", "joining", "stale"};
  return role >= 0 && role <= REPLICA_STALE ? names[role] : "unknown";
}

/* The environment variable `name` holds a whole number of milliseconds: the
 * calling thread sleeps that long, logged each time as a test hook acts. */
void replica__test_stall(const char *name) {
  clock_test_stall(name);
}

void replica_test_stall(const char *name) {
  replica__test_stall(name);
}

/* "the primary of term 3 is member 1 (h:p)" or why none is known. */
void replica__say_primary_locked(const replica *r, char *buf, size_t len) {
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

int replica_start(replica *r, char *err, size_t errlen) {
  if (pthread_create(&r->monitor, NULL, replica__monitor_main, r) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "cannot start the replica monitor thread");
  r->monitor_started = 1;
  LOG_INFO("replica_started", "index=%u members=%u failover_ms=%u self=%s", r->index, r->n,
           r->failover_ms, r->m[r->index].addr);
  return 0;
}

void replica_set_service(replica *r, service *svc) {
  r->svc = svc;
}

static void link_close(data_link *l) {
  if (l) {
    dp_client_close(l->d);
    free(l);
  }
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
    /* Every forward has ended: no link has a user left. */
    link_close(m->dp);
    while (m->retired) {
      data_link *l = m->retired;
      m->retired = l->next;
      link_close(l);
    }
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

rpc_channel *replica__channel(replica *r, member *m) {
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
int replica__peer_info(replica *r, member *m, uint32_t ms, Zshard__V1__GetInfoResponse **out) {
  *out = NULL;
  rpc_channel *ch = replica__channel(r, m);
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

/* Retires the current link of m (conn_mu held): it leaves m->dp and, when
 * forwards still use it, waits in m->retired for the last of them. Returns
 * the link to close now (the caller closes it after unlocking), or NULL. */
static data_link *retire_locked(member *m) {
  data_link *l = m->dp;
  m->dp = NULL;
  if (!l || l->users == 0)
    return l;
  l->next = m->retired;
  m->retired = l;
  return NULL;
}

/* The member's data client for forwards of `term` (opened, or reopened when
 * the term changed: the term travels in its HELLO), held for the caller. */
data_link *replica__data_client(replica *r, member *m, uint64_t term) {
  pthread_mutex_lock(&m->conn_mu);
  if (m->dp && m->dp->term == term) {
    data_link *l = m->dp;
    l->users++;
    pthread_mutex_unlock(&m->conn_mu);
    return l;
  }
  pthread_mutex_unlock(&m->conn_mu);
  Zshard__V1__GetInfoResponse *info = NULL;
  if (replica__peer_info(r, m, REPLICA_PROBE_MS * 2, &info) != 0)
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
  data_link *l = calloc(1, sizeof *l);
  char err[REPLICA_ERRLEN];
  if (!l || dp_client_open(&dc, &l->d, err, sizeof err) != 0) {
    LOG_WARN("replica_data_client", "member=%s addr=%s error=\"%s\"", m->addr, hp,
             l ? err : "out of memory");
    free(l);
    return NULL;
  }
  l->term = term;
  pthread_mutex_lock(&m->conn_mu);
  if (m->dp && m->dp->term == term) { /* another forwarder won */
    pthread_mutex_unlock(&m->conn_mu);
    link_close(l);
    return replica__data_client(r, m, term);
  }
  data_link *old = retire_locked(m);
  l->users = 1;
  m->dp = l;
  pthread_mutex_unlock(&m->conn_mu);
  link_close(old);
  return l;
}

void replica__put_data_client(member *m, data_link *l, int broken) {
  data_link *done = NULL;
  pthread_mutex_lock(&m->conn_mu);
  if (broken && m->dp == l)
    retire_locked(m); /* l has a user (this caller): never closed here */
  l->users--;
  if (l->users == 0 && m->dp != l) { /* replaced and now unused */
    for (data_link **p = &m->retired; *p; p = &(*p)->next)
      if (*p == l) {
        *p = l->next;
        done = l;
        break;
      }
  }
  pthread_mutex_unlock(&m->conn_mu);
  link_close(done);
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
  replica__config_error_locked(r, config_error, config_len);
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
