/*
 * grpc_methods — the one table of what the gRPC transport knows about each
 * method: path, handler, largest request, role and replica kind. A new method
 * is a value of the enum in grpc_internal.h, a row here and its handler
 * (docs/DESIGN.md, "Extension points").
 */
#include "server/transport/grpc/grpc_internal.h"

/* The largest requests: bulk requests (an Open's spec, a chunk of weights,
 * state or gradient) may use the whole listener limit; the clients send
 * initial weights and state in chunks of 1 MiB and gradients in chunks of
 * RPC_PUSH_CHUNK_BYTES.
 *
 * The roles (docs/SECURITY.md, "Roles", which python.test_security_doc holds
 * to this table). Admin: the methods that write checkpoints, roll the state
 * back, overwrite it or end the job, outside of a training step. Trainer: a
 * step's work and what only reads. None: the health service, which load
 * balancers and probes call without a secret. A method added later needs a
 * role: the default, 0, is AUTH_NONE only by value, hence the check in
 * gsrv_start.
 *
 * The replica kinds: what each method is to a replica set
 * (server/replica/replica.h). */
const gsrv_method gsrv__methods[M_COUNT + 1] = {
    [M_OPEN] = {"/zshard.v1.ZShard/Open", gsrv__h_open, GSRV_MAX_REQUEST_BYTES, AUTH_TRAINER,
                REPLICA_WRITE},
    [M_INIT_PARAMS] = {"/zshard.v1.ZShard/InitParams", gsrv__h_init_params, GSRV_MAX_REQUEST_BYTES,
                       AUTH_TRAINER, REPLICA_WRITE},
    [M_PUSH] = {"/zshard.v1.ZShard/Push", gsrv__h_push, GSRV_MAX_REQUEST_BYTES, AUTH_TRAINER,
                REPLICA_WRITE},
    [M_PULL] = {"/zshard.v1.ZShard/Pull", gsrv__h_pull, GSRV_SMALL_REQUEST_BYTES, AUTH_TRAINER,
                REPLICA_READ},
    [M_GRAD_STATS] = {"/zshard.v1.ZShard/GradStats", gsrv__h_grad_stats, GSRV_SMALL_REQUEST_BYTES,
                      AUTH_TRAINER, REPLICA_READ},
    [M_APPLY] = {"/zshard.v1.ZShard/Apply", gsrv__h_apply, GSRV_SMALL_REQUEST_BYTES, AUTH_TRAINER,
                 REPLICA_WRITE},
    [M_GET_INFO] = {"/zshard.v1.ZShard/GetInfo", gsrv__h_get_info, GSRV_SMALL_REQUEST_BYTES,
                    AUTH_TRAINER, REPLICA_ANY},
    [M_STATS] = {"/zshard.v1.ZShard/Stats", gsrv__h_stats, GSRV_SMALL_REQUEST_BYTES, AUTH_TRAINER,
                 REPLICA_READ},
    [M_CHECKPOINT] = {"/zshard.v1.ZShard/Checkpoint", gsrv__h_checkpoint, GSRV_SMALL_REQUEST_BYTES,
                      AUTH_ADMIN, REPLICA_PRIMARY_ONLY},
    [M_COMMIT_CHECKPOINT] = {"/zshard.v1.ZShard/CommitCheckpoint", gsrv__h_commit_checkpoint,
                             GSRV_COMMIT_REQUEST_BYTES, AUTH_ADMIN, REPLICA_PRIMARY_ONLY},
    [M_RESTORE] = {"/zshard.v1.ZShard/Restore", gsrv__h_restore, GSRV_SMALL_REQUEST_BYTES,
                   AUTH_ADMIN, REPLICA_WRITE},
    [M_LIST_CHECKPOINTS] = {"/zshard.v1.ZShard/ListCheckpoints", gsrv__h_list_checkpoints,
                            GSRV_SMALL_REQUEST_BYTES, AUTH_TRAINER, REPLICA_READ},
    [M_CLOSE_JOB] = {"/zshard.v1.ZShard/CloseJob", gsrv__h_close_job, GSRV_SMALL_REQUEST_BYTES,
                     AUTH_ADMIN, REPLICA_WRITE},
    [M_READ_STATE] = {"/zshard.v1.ZShard/ReadState", gsrv__h_read_state, GSRV_SMALL_REQUEST_BYTES,
                      AUTH_TRAINER, REPLICA_READ},
    [M_WRITE_STATE] = {"/zshard.v1.ZShard/WriteState", gsrv__h_write_state, GSRV_MAX_REQUEST_BYTES,
                       AUTH_ADMIN, REPLICA_WRITE},
    /* The client's failover promotes a member, so a trainer may ask; the
     * member takes over only when it sees no live primary itself and moves
     * the term by one (replica_promote). */
    [M_PROMOTE] = {"/zshard.v1.ZShard/Promote", gsrv__h_promote, GSRV_SMALL_REQUEST_BYTES,
                   AUTH_TRAINER, REPLICA_ANY},
    /* Between members, which call each other with the admin token. */
    [M_REPLICA_JOIN] = {"/zshard.v1.ZShard/ReplicaJoin", gsrv__h_replica_join,
                        GSRV_SMALL_REQUEST_BYTES, AUTH_ADMIN, REPLICA_ANY},
    [M_REPLICA_FETCH] = {"/zshard.v1.ZShard/ReplicaFetch", gsrv__h_replica_fetch,
                         GSRV_SMALL_REQUEST_BYTES, AUTH_ADMIN, REPLICA_ANY},
    /* A trainer joins or leaves an elastic job between steps (issue 26):
     * forwarded like every write, so that a backup has the primary's
     * membership when it takes over (DESIGN.md "Membership", replica sets). */
    [M_CHANGE_MEMBERSHIP] = {"/zshard.v1.ZShard/ChangeMembership", gsrv__h_change_membership,
                             GSRV_SMALL_REQUEST_BYTES, AUTH_TRAINER, REPLICA_WRITE},
    [M_HEALTH_CHECK] = {"/grpc.health.v1.Health/Check", gsrv__h_health_check,
                        GSRV_SMALL_REQUEST_BYTES, AUTH_NONE, REPLICA_ANY},
    [M_HEALTH_WATCH] = {"/grpc.health.v1.Health/Watch", gsrv__h_health_watch,
                        GSRV_SMALL_REQUEST_BYTES, AUTH_NONE, REPLICA_ANY},
    /* An unknown method is answered UNIMPLEMENTED only to a caller with a
     * token, so that a stranger learns nothing about the server. */
    [M_GENERIC] = {.role = AUTH_TRAINER},
};
