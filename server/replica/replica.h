/*
 * replica — a shard run as a replica set: a primary and its backups that
 * hold the same state, bit for bit (docs/DESIGN.md, "Replica sets";
 * docs/OPERATIONS.md, "Replica sets").
 *
 * Contract:
 *  - Sits between the transports and the service. A transport asks
 *    replica_admit before it serves a request: a trainer's write is taken only
 *    by the primary, a forwarded write (marked with the primary's term: gRPC
 *    metadata "zshard-replica-term", or the data plane's HELLO) only by a
 *    backup of that term. The primary then forwards the write to every backup
 *    in sync (replica_forward_push, replica_forward_raw) and answers the
 *    trainer only when each has acknowledged it or was dropped after
 *    --failover-ms without an answer. Every write is idempotent and every
 *    replica adds contributions in the fixed order, so the replicas' bits
 *    are equal whatever order the forwards arrive in.
 *  - Terms: a replica never makes itself primary. A client that finds no
 *    primary sends Promote(term) to the best member (replica_promote). A
 *    term moves by one: a promotion takes the highest term the member has
 *    seen (its own, its peers' answers) plus one, and refuses a request for
 *    more, so that no caller can push the term out of reach. A trainer's
 *    Promote is a request to check: the member probes its peers and takes
 *    over only when it sees no live primary; only the admin token may move
 *    a live primary's own term. A replica refuses a forward of an older term
 *    (ZS_ESTALE, and the sender steps down) and follows a newer one; a
 *    trainer's call carrying a newer term ("zshard-term") only makes the
 *    member probe its peers at once: a primary steps down when it sees a
 *    newer primary, never on a trainer's word.
 *  - Configuration: every member probes its peers with its own member list
 *    (GetInfo's replica_members) and reads theirs in the answer; a member
 *    whose list or place differs is neither followed, adopted nor joined,
 *    Promote is refused, and ReplicaInfo.config_error says why.
 *  - Joining: a replica without the set's state (started empty, dropped,
 *    deposed) asks the primary (ReplicaJoin). At its next applied step V the
 *    primary adds it to the forwards and copies its state at that version
 *    (core_snapshot_async); the joiner reads the copy (ReplicaFetch), loads it
 *    (core_restore) and becomes a backup. The copy and the forwards meet
 *    exactly at V: no push for a step after V can be taken before the hook
 *    that starts the join has run (the trainers hear of V only after it:
 *    a repeated Apply of V waits for it, replica_wait_applied),
 *    so the joiner gets every one of them; a write of a step up to V (the
 *    trainers' Applies of V, answered after the hook) is in the copy and is
 *    not sent to it. Forwards it gets before it loaded the copy are answered
 *    ZS_ENOTREADY and retried by the primary, so a join holds the trainers'
 *    next pushes for the copy, and at most --failover-ms: a joiner still
 *    loading then, or one that stops answering (the forwards, or the
 *    monitor's GetInfo, for --failover-ms), is dropped and joins again.
 *  - A new primary counts in sync the peers it found BACKUP or PRIMARY of
 *    its job within one version, and STARTING ones only while neither holds
 *    a job: a member that restarted with its own checkpoint joins. A
 *    STARTING member follows a forward only from a primary its own probes
 *    saw, with the same list, while it holds no job.
 *  - Threads: replica_admit and the forwards run on the transports' threads
 *    (a forward blocks its thread for the backups' answers: the data plane
 *    runs every push of a replicated primary on libuv's pool); the applied
 *    hook on the core's worker (it only marks and queues); a monitor thread of
 *    its own asks the peers' GetInfo every REPLICA_MONITOR_MS, drops a backup
 *    that fell behind, steps down before a newer primary and joins.
 *  - Locks: replica.mu guards roles, terms and the member table; it is a leaf
 *    never held across a call to a peer or into the core. member.conn_mu guards
 *    a member's connections and is held while one is opened (a blocking
 *    connect), never with replica.mu.
 */
#ifndef ZSHARD_SERVER_REPLICA_H
#define ZSHARD_SERVER_REPLICA_H

#include <stddef.h>
#include <stdint.h>

#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"

struct Zshard__V1__ReplicaInfo;
struct Zshard__V1__ReplicaFetchRequest;
struct Zshard__V1__ReplicaFetchResponse;

#define REPLICA_MAX_MEMBERS 8u
#define REPLICA_DEFAULT_FAILOVER_MS 2000u
#define REPLICA_MONITOR_MS 250u
/* The highest term a replica takes (from a Promote, a forward or a peer):
 * far beyond what one-by-one promotions reach, far below UINT64_MAX. */
#define REPLICA_TERM_MAX (UINT64_C(1) << 48)
/* Elements of one ReplicaFetch answer (4 MiB). */
#define REPLICA_FETCH_ELEMS (1u << 20)

/* The roles (the proto's ReplicaRole). */
typedef enum replica_role {
  REPLICA_NONE = 0,
  REPLICA_STARTING = 1,
  REPLICA_PRIMARY = 2,
  REPLICA_BACKUP = 3,
  REPLICA_JOINING = 4,
  REPLICA_STALE = 5,
} replica_role;

/* What a request does, for replica_admit. */
typedef enum replica_kind {
  REPLICA_ANY,          /* GetInfo, health, Promote: any role */
  REPLICA_READ,         /* Pull, GradStats, Stats, ReadState, ListCheckpoints */
  REPLICA_WRITE,        /* Open, InitParams, Push, Apply, WriteState, CloseJob, Restore,
                         * ChangeMembership */
  REPLICA_PRIMARY_ONLY, /* Checkpoint, CommitCheckpoint: the primary's files */
} replica_kind;

/* What a forwarded write is. A push (a contribution) counts while it is on
 * its way to a backup: an Apply that backup refuses ZS_ENOTREADY meanwhile
 * waits for it rather than count the failover time. */
typedef enum replica_write {
  REPLICA_FWD_WRITE,   /* Open, InitParams, WriteState, CloseJob, ChangeMembership */
  REPLICA_FWD_PUSH,    /* a contribution: a data-plane push or a gRPC Push */
  REPLICA_FWD_APPLY,   /* an Apply: the backup runs the apply the primary ran */
  REPLICA_FWD_RESTORE, /* a Restore: the backup reads the checkpoint the primary read */
} replica_write;

typedef struct replica replica;

typedef struct replica_config {
  const char *members;  /* "host:port|host:port..." (or ','), every member's gRPC address */
  uint32_t index;       /* this server's place in members */
  uint32_t failover_ms; /* 0: REPLICA_DEFAULT_FAILOVER_MS */
  core *core;           /* borrowed, outlives the replica */
  service *svc;         /* borrowed, outlives the replica; or replica_set_service */
  /* Peers are called with this token (the admin token: forwards need it);
   * NULL: none. Copied. */
  const char *token;
  /* TLS to peers: the CA their certificates chain to, and this server's own
   * certificate and key for servers that ask for one; NULL: plaintext. */
  const char *tls_ca_file, *tls_cert_file, *tls_key_file;
} replica_config;

/* Splits a member list into its addresses (each checked with hostport_parse;
 * 2..REPLICA_MAX_MEMBERS of them, no repeats). Returns the count, or a
 * negative status with a sentence in err. `out` gets malloc'ed strings. */
int replica_parse_members(const char *list, char **out, uint32_t max, char *err, size_t errlen);

/* Checks the configuration and creates the replica as STARTING. Nothing is
 * contacted yet. Returns 0, or ZS_EINVAL / ZS_ENOMEM with a sentence. */
int replica_create(const replica_config *cfg, replica **out, char *err, size_t errlen);

/* The service (created after the replica, whose applied hook it calls);
 * before replica_start. */
void replica_set_service(replica *r, service *svc);

/* Starts the monitor thread. Call after the transports started. */
int replica_start(replica *r, char *err, size_t errlen);

/* Stops the monitor, closes the peers' connections and frees. Call after the
 * transports stopped. NULL is accepted. */
void replica_destroy(replica *r);

/* Whether a request of `kind` may be served here. fwd_term > 0: a forward
 * from the primary of that term, whose caller held the admin role (fwd_admin)
 * when tokens are on. client_term: the "zshard-term" a trainer sent (0:
 * none); one above this replica's term wakes the monitor to probe the peers
 * now, and changes nothing else. On 0, *forward (may be NULL) says the caller is the primary and
 * must forward the write once it is accepted. Otherwise the status (ZS_ENOTPRIMARY naming the
 * primary, ZS_ESTALE, ZS_ENOTREADY while joining, ZS_EBEHIND out of sync, ZS_EPERM) with a
 * sentence. NULL r admits everything. */
int replica_admit(replica *r, replica_kind kind, uint64_t fwd_term, int fwd_admin,
                  uint64_t client_term, int *forward, char *err, size_t errlen);

/* Forwards a contribution the primary accepted to every backup, over the
 * data plane; blocks until each answered or was dropped. ZS_ENOTPRIMARY when
 * a backup knows a newer term (this replica stepped down). */
int replica_forward_push(replica *r, const core_push_args *a, char *err, size_t errlen);

/* replica_forward_push of n contributions at once: each backup gets all n
 * pipelined (one wait, not n). */
int replica_forward_pushes(replica *r, const core_push_args *a, uint32_t n, char *err,
                           size_t errlen);

/* Forwards a gRPC request as it came (`method` the full path, len bytes at
 * msg) to every backup; as replica_forward_push. `kind`: what the write is
 * (a Push is a contribution, REPLICA_FWD_PUSH; an Apply REPLICA_FWD_APPLY).
 * `step`: the step the write belongs to (a Push's, an Apply's), so that a
 * joiner whose copy holds that step already is not sent it; 0: a write of no
 * step, sent to every backup. A backup's attempts together wait at most
 * the failover time, plus len bytes at REPLICA_MIN_RATE, plus (an Apply, a
 * Restore) REPLICA_APPLY_WAIT_FACTOR times this primary's own apply of the
 * step or its last restore (replica_on_restored); a backup that did not
 * answer by then is dropped, so that a silent backup holds a write that
 * long once. */
int replica_forward_raw(replica *r, const char *method, replica_write kind, uint64_t step,
                        const void *msg, size_t len, char *err, size_t errlen);

/* A trainer's Push this primary accepted is on its way to the backups
 * (up: 1), before it waits for a thread of the transport's forwarding pool,
 * or its forward ended, forwarded or not (up: 0; exactly once per up). While
 * one is pending, a backup's ZS_ENOTREADY to an Apply's forward may be the
 * contribution still on its way, and the Apply waits for it as for a push
 * forward under way (see replica_forward_raw) instead of dropping the
 * backup after the failover time. NULL r does nothing. */
void replica_push_pending(replica *r, int up);

/* Test hook: replica__test_stall(name) for the transports (tests only; the
 * names are listed in docs/OPERATIONS.md). */
void replica_test_stall(const char *name);

/* The server is shutting down and the grace for calls in flight is over: a
 * forward makes no further attempt and returns ZS_ECLOSED, so that a backup
 * that keeps refusing, or a wait the rules extend (pushes under way, a
 * joiner's copy), does not hold the shutdown; a gRPC attempt in flight is
 * cancelled within RPC_STOP_POLL_MS (a silent backup does not hold it
 * either), a data-plane push's attempt still ends within what is left of
 * its bound. No member is dropped for it. Call it before waiting for the
 * forwards to end; NULL r does nothing. */
void replica_stop_forwards(replica *r);

/* A Restore succeeded here in restore_ns (reading, verifying and swapping
 * the checkpoint): its forward's bound follows it (replica_forward_raw).
 * Call it before the Restore is forwarded. NULL r does nothing. */
void replica_on_restored(replica *r, uint64_t restore_ns);

/* The service's applied hook: starts a pending join at this version. */
void replica_on_applied(void *arg, const core_apply_result *res);

/* Before a primary answers an Apply of `version` that the core answered at
 * once (a repeat of the step just applied, from a second trainer): waits,
 * at most --failover-ms, until the applied hook saw that version. The
 * core bumps its version before the hook runs, and a trainer told of the
 * step in between would push the next step's gradients before a joiner
 * copied at that version is added to the forwards: it would miss them.
 * NULL r, or a replica that is not primary, returns at once. */
void replica_wait_applied(replica *r, uint64_t version);

/* Promote (see the proto): 0 with the term, role and version after it, or a
 * refusal with a sentence. admin: the caller holds the admin token (or
 * tokens are off). `term` must lie above this replica's term and at most one
 * above the highest term it has seen (ZS_ESTALE, ZS_ERANGE); the term taken
 * is that highest plus one. Refused while a peer answers as primary
 * (ZS_ENOTPRIMARY); a trainer's also by the primary itself (ZS_EPERM): only
 * the admin token moves a live primary's term (by one). Blocks for the
 * peers' GetInfo (the failover time at most). A member that takes over a
 * job marks its state as possibly behind (core_mark_behind): a trainer past
 * its version is told ZS_EBEHIND and to restore. */
int replica_promote(replica *r, uint64_t term, int admin, uint64_t *term_out, int *role_out,
                    uint64_t *version_out, char *err, size_t errlen);

/* GetInfo from a caller that sent its member list (`members`, '|'-separated;
 * NULL or "": none), place and term: a peer's probe. Counted only with the
 * admin role (admin != 0): a list that differs from this replica's is
 * remembered for a few probe rounds (config_error, Promote refused) and
 * logged; from a peer whose list agrees, the term counts as one seen (see
 * replica_promote). */
void replica_check_caller(replica *r, const char *members, uint32_t index, uint64_t term,
                          int admin);

/* ReplicaJoin on the primary: 0 and the join's id (0: nothing to copy, the
 * member is in sync already; else its ReplicaFetch calls carry it), or a
 * refusal. */
int replica_join(replica *r, uint64_t term, uint32_t index, uint64_t *join_id, char *err,
                 size_t errlen);

/* ReplicaFetch on the primary for the join q->join_id: fills *resp (its
 * data points into the replica's copy, kept until replica_fetch_release;
 * the spec's strings are allocated). ZS_ENOTREADY until the copy is made,
 * ZS_ECANCELED once that join ended (the member was dropped). Every call,
 * served or not, is followed by replica_fetch_release with served = (the
 * return was 0). */
int replica_fetch(replica *r, const struct Zshard__V1__ReplicaFetchRequest *q,
                  struct Zshard__V1__ReplicaFetchResponse *resp, char *err, size_t errlen);
void replica_fetch_release(replica *r, struct Zshard__V1__ReplicaFetchResponse *resp, int served);

/* GetInfo's replica field: fills *out with pointers into `members` (an array
 * of REPLICA_MAX_MEMBERS entries), `mptr` and `config_error` (config_len
 * bytes, the caller's: why the set is refused); other strings borrowed from
 * r. */
void replica_info(replica *r, struct Zshard__V1__ReplicaInfo *out, void *members, void **mptr,
                  char *config_error, size_t config_len);

/* Appends the replica's Prometheus lines to *buf (realloc'ed, *len bytes
 * used, *cap allocated). Returns 0 or ZS_ENOMEM. */
void replica_metrics(void *r, metrics_text *t);

const char *replica_role_name(int role);

#endif
