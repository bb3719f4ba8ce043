/*
 * replica_internal.h — what the files of zs_replica share: the member table,
 * the replica object and the functions one role's file calls in another's.
 * Nothing outside server/replica/ includes it; the contract is replica.h.
 *
 * The files, one role each (docs/DESIGN.md, "Replica sets"):
 *   replica.c          the object: members, lifecycle, peer connections,
 *                      GetInfo and metrics
 *   replica_primary.c  the primary: forwarding writes, serving joins
 *                      (ReplicaJoin, ReplicaFetch), its monitor round
 *   replica_backup.c   a backup: admitting forwards, its monitor round
 *                      (STALE), a STARTING member becoming a backup
 *   replica_monitor.c  the monitor thread: probes, configuration checks,
 *                      failover (Promote)
 *   replica_join.c     a joiner: ReplicaJoin and ReplicaFetch from its side,
 *                      loading the copy
 *   replica_terms.c    the terms protocol: who may move the term, by how
 *                      much, what a hint may do, stepping down
 *
 * Lock order: member.conn_mu, then replica.mu (a leaf: never held across a
 * peer call, a core call or a connect). A function named *_locked is called
 * with replica.mu held and keeps it held.
 */
#ifndef ZS_REPLICA_INTERNAL_H
#define ZS_REPLICA_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "common/net/dp_client.h"
#include "common/net/hostport.h"
#include "common/net/rpc_client.h"
#include "common/net/tls.h"
#include "server/replica/replica.h"
#include "zshard/v1/zshard.pb-c.h"

#define REPLICA_PROBE_MS 500u
#define REPLICA_RPC_MS 10000u
/* A backup runs the apply its primary ran, on a machine alike: its Apply
 * forward gets the failover time and this many times the primary's own
 * apply time of the step (a loaded backup, a cold cache). */
#define REPLICA_APPLY_WAIT_FACTOR 4u
/* The slowest link a forward's bytes are given time for, in bytes per
 * second: a forward waits the failover time and its bytes at this rate (a
 * 64 MiB InitParams or contribution: 4 s more), so that a large write on a
 * slow link does not drop a backup that is only receiving it. */
#define REPLICA_MIN_RATE (16ull * 1024 * 1024)
/* How long a joiner waits for the primary's copy (made at the primary's
 * next applied step: trainers may be between steps for long). */
#define REPLICA_JOIN_MS 120000u
#define REPLICA_RETRY_MS 20u
/* A joiner working on its copy (from its first read until the copy is loaded)
 * tells the primary so every failover time / this (ReplicaFetch of
 * REPLICA_PART_LOADING; replica_join.c's copy_ticker). */
#define REPLICA_COPY_TICK 4u
#define REPLICA_METHOD(m) "/zshard.v1.ZShard/" m
#define REPLICA_ERRLEN 256
/* How long a peer's probe with a member list unlike this one's keeps the
 * set refused after it (peers probe every REPLICA_MONITOR_MS). */
#define REPLICA_CONFIG_HOLD_MS 5000u
#define REPLICA_CONFIG_LEN 200

/* A data client to a member and the forwards using it (member.conn_mu). A
 * replaced one (a new term, a restarted member) stays open while forwards
 * still use it and is closed by the last one to put it back: a forward never
 * finds its client closed under it, and replacements never pile up. */
typedef struct data_link {
  dp_client *d;
  uint64_t term;          /* the term in its HELLO */
  uint32_t users;         /* forwards holding it */
  struct data_link *next; /* in member.retired */
} data_link;

typedef struct member {
  char *addr; /* gRPC host:port, owned */
  char host[HOSTPORT_HOST_MAX];

  pthread_mutex_t conn_mu; /* ch, dp, retired, every data_link's users */
  rpc_channel *ch;
  data_link *dp;      /* the current data client, NULL: none yet */
  data_link *retired; /* replaced ones still in use */

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
  /* A joiner's last step forward on its copy: its ReplicaJoin, the copy
   * made, a ReplicaFetch served (a part of the copy, or the joiner's word,
   * every REPLICA_COPY_TICK of the failover time, that it works on its
   * copy: reads or loads it). A joiner still loading is dropped only
   * after the failover time without one, however long the whole copy takes. */
  uint64_t progress_ms;

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
  /* replica.mu: push forwards under way that count it a target. An Apply it
   * refuses ZS_ENOTREADY meanwhile misses pushes that are on their way to
   * it (the trainers' first Apply runs once the primary holds every
   * contribution, which may be before another thread's forward of them got
   * past a dead backup listed before this one). */
  uint32_t pushing;
  /* replica.mu: clock_now_ms() when the last of them ended. An Apply sent
   * before that may have been answered before the push landed. */
  uint64_t pushed_ms;
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
  /* The version the applied hook saw last (replica_wait_applied), and how
   * long its apply took here (the bound of an Apply's forward). */
  uint64_t hooked_version;
  uint64_t hooked_apply_ns;
  pthread_cond_t hooked_cv;
  /* How long this primary's last Restore took (replica_on_restored): the
   * bound of a Restore's forward. */
  uint64_t restore_ns;

  pthread_t monitor;
  int monitor_started, stopping;
  /* Set by replica_stop_forwards: no forward makes another attempt. */
  int fwd_stopping;
  /* mu: gRPC Pushes this primary accepted whose forward has not ended, from
   * before they wait in the transport's forwarding pool (replica_push_pending):
   * such a push is on its way to every backup though no forward counts it
   * in member.pushing yet. */
  uint32_t pushes_pending;
  /* mu: clock_now_ms() when the last of them ended. */
  uint64_t pending_done_ms;
};

typedef struct fwd_target {
  uint32_t idx;
  int joining;
} fwd_target;

/* ------------------------------------------------------------ replica.c */

/* A test hook (tests only; docs/OPERATIONS.md lists them): when the
 * environment variable `name` (a string constant) holds a whole number of
 * milliseconds above 0, the calling thread sleeps that long, as a large
 * shard's slow step would take; logged as test_hook each time. Otherwise
 * nothing. */
void replica__test_stall(const char *name);
/* "the primary of term 3 is member 1 (h:p)" or why none is known, into buf. */
void replica__say_primary_locked(const replica *r, char *buf, size_t len);
/* The gRPC channel to member m (opened at first use, owned by m, closed at
 * replica_destroy); NULL when it cannot be opened. */
rpc_channel *replica__channel(replica *r, member *m);
/* GetInfo of member m with deadline ms: 0 and *out (the caller frees it with
 * protobuf_c_message_free_unpacked), or an error and *out NULL. */
int replica__peer_info(replica *r, member *m, uint32_t ms, Zshard__V1__GetInfoResponse **out);
/* Member m's data client for forwards of `term`, held for the caller until
 * it hands it back with replica__put_data_client (the link and its client
 * stay owned by m); NULL: none now. */
data_link *replica__data_client(replica *r, member *m, uint64_t term);
/* Hands back link l taken from replica__data_client. broken: l's connection
 * failed (the member may have restarted elsewhere), so the next forward asks
 * the member for its data port again. Closes l when it was replaced and this
 * was its last user. */
void replica__put_data_client(member *m, data_link *l, int broken);

/* ------------------------------------------------------------ replica_primary.c */

/* The members a write of `step` goes to (into t, REPLICA_MAX_MEMBERS
 * entries), and how many. */
uint32_t replica__targets_locked(const replica *r, uint64_t step, fwd_target *t);
/* Takes member i out of the set (it joins again); why is logged. */
void replica__drop_locked(replica *r, uint32_t i, int rc, const char *why);
/* The primary's monitor round (info: this member's core, read unlocked). */
void replica__primary_round_locked(replica *r, const core_info *info);

/* ------------------------------------------------------------ replica_backup.c */

/* Whether a STARTING member may follow the primary of `term` (0), or why not. */
int replica__starting_may_follow_locked(replica *r, uint64_t term, int has_job, char *err,
                                        size_t errlen);
/* A backup's monitor round: may make it STALE, or follow a newer term. */
void replica__backup_round_locked(replica *r);
/* Whether the primary p counts this STARTING member in sync already. */
int replica__starting_counted_locked(const replica *r, uint32_t p, int has_job);
/* Whether this STARTING member, counted in sync by the primary p that holds
 * a job, waits for the job's Open forward rather than join. */
int replica__starting_awaits_open_locked(const replica *r, uint32_t p, int has_job);

/* ------------------------------------------------------------ replica_monitor.c */

/* GetInfo of every peer (deadline ms each), recorded; takes replica.mu. */
void replica__probe_all(replica *r, uint32_t ms);
/* Whether member m answered a probe lately. */
int replica__fresh(const member *m);
/* The reachable peer that is primary of the highest term >= min, or -1. */
int replica__live_primary_locked(const replica *r, uint64_t min);
/* Why this replica refuses to form a set, into buf; 0 when nothing does. */
int replica__config_error_locked(const replica *r, char *buf, size_t len);
/* The monitor thread's body (arg: the replica). */
void *replica__monitor_main(void *arg);

/* ------------------------------------------------------------ replica_join.c */

/* Joins the primary p of `term` and loads its copy; 0 or the failure. */
int replica__join_primary(replica *r, uint32_t p, uint64_t term);

/* ------------------------------------------------------------ replica_terms.c */

/* Makes a primary or backup STALE (why is logged). */
void replica__step_down_locked(replica *r, const char *why);
/* Whether a peer whose list agrees probed this replica with `term`. */
int replica__heard_term_locked(const replica *r, uint64_t term);
/* A forward of `term` from the primary: 0 when this replica takes it. */
int replica__admit_forward_locked(replica *r, uint64_t term, int has_job, char *err, size_t errlen);
/* Why this replica may not be promoted to `term` now, or 0 and the term it
 * takes in *next (info: its core, read unlocked). */
int replica__promote_check_locked(replica *r, uint64_t term, int admin, const core_info *info,
                                  uint64_t *next, char *err, size_t errlen);
/* A trainer's call carried `term`: a hint, that only makes the monitor probe. */
void replica__client_term_hint_locked(replica *r, uint64_t term);
/* Peer `index`, whose list agrees, probed with `term`: recorded; a newer
 * term than this replica's makes the monitor probe. */
void replica__peer_term_hint_locked(replica *r, uint32_t index, uint64_t term);

#endif
