/*
 * service — the layer between the transports and the shard core: what a
 * request means, checked once, whichever transport carried it.
 *
 * Contract:
 *  - Callers are the transports (grpc_server.c, dp_server.c) and tests. A
 *    transport decodes a request, calls the service, and encodes what it
 *    returns; the checks of a request's fields (job hash, step, rank,
 *    micro-batch, tensor, slice, dtype, lengths, Apply's arguments) and the
 *    sentences of their errors live here and in the core, never in a
 *    transport. Every call that fails returns a negative zs_status with a
 *    sentence in err (which may be NULL) and changes nothing.
 *  - Threads: every function may be called from any thread, concurrently
 *    (the gRPC polling threads, the data plane's loop thread and libuv's
 *    thread pool all do). The service keeps no mutable state of its own: a
 *    call costs what the core call it wraps costs, and takes no lock besides
 *    the core's.
 *  - Asynchronous calls follow core.h's contract (ZS_OK with the result at
 *    once, CORE_PENDING and one callback later, or an error and no
 *    callback).
 *  - Ownership: the service borrows its core, which must outlive it; a
 *    transport borrows the service, which must outlive the transport.
 *    Pointers passed into a call are only read during the call unless a
 *    declaration says otherwise.
 *
 * The observer (service_observer) is the one place told that the shard's
 * state moved forward: a contribution accepted, a step applied. The
 * replication of a later step hangs there.
 */
#ifndef ZSHARD_SERVER_SERVICE_H
#define ZSHARD_SERVER_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "common/model/spec.h"
#include "server/core/core.h"

typedef struct service service;

/* What the service tells of the state moving forward. Either function may be
 * NULL. Both follow the core callbacks' rules: they must not block and may
 * call only the core's non-blocking readers (core_read, core_get_info,
 * core_get_counters); they hold back the request (contribution) or the
 * answers of the apply (applied) they report.
 *
 * contribution(arg, a): once per contribution the core accepted that was not
 *   a duplicate (a repeat, or a retry of an applied step, is never reported),
 *   after core_push returned and before the transport answers the push. It
 *   runs on the thread that called service_push: a gRPC polling thread, the
 *   data plane's loop thread or one of libuv's pool threads, so several may
 *   run at once. No core lock and no transport lock is held. `a` and the
 *   bytes at a->data are only valid during the call.
 * applied(arg, r): once per applied step (a skipped step too; a restore is
 *   not an applied step), on the core's worker thread, after the apply
 *   released every core lock and before any trainer's Apply is answered.
 *   `r` is only valid during the call.
 * Nothing orders the two across threads: the contribution that completed a
 *   step may still be in its hook when that step's applied hook runs.
 * `arg` is borrowed until service_destroy returns. */
typedef struct service_observer {
  void (*contribution)(void *arg, const core_push_args *a);
  void (*applied)(void *arg, const core_apply_result *r);
  void *arg;
} service_observer;

/* Creates the service over `c` (borrowed; it must outlive the service). obs
 * (may be NULL: nobody is told) is copied. With an applied function, the
 * service installs the core's applied hook (core_set_applied_hook), so at most
 * one service with one per core; create it before any transport starts.
 * Returns 0, ZS_EINVAL or ZS_ENOMEM. */
int service_create(core *c, const service_observer *obs, service **out);

/* ------------------------------------------------------------- job limits
 *
 * A spec arrives from the network, and a 70-byte Open can ask for 80M
 * parameters (1.4 GiB of state) or a million tensors: service_open refuses
 * a job beyond these limits with ZS_ELIMIT, before the core allocates
 * anything, in a sentence that names the flag to raise.
 *  - max_params: elements of the job's arenas on this shard (its share of
 *    the job's parameters, padding included). Each costs this shard
 *    SERVICE_PARAM_BYTES at most: fp32 master, exp_avg, exp_avg_sq and
 *    accumulator, the 16-bit copy, and while a restore loads or a stalled
 *    reader pins the 16-bit copy, a second master, moments and copy.
 *  - max_tensors: tensors of the job. Every shard holds the whole spec and
 *    layout, so this is not divided over shards; the job's bookkeeping (its
 *    names, pieces, and per piece of this shard a bitmap of W * M
 *    contributions) must also fit max_tensors * SERVICE_TENSOR_BYTES.
 * 0 means no limit. A job the shard already holds (a join, a restored one)
 * is not checked again. */
#define SERVICE_PARAM_BYTES 32u
#define SERVICE_TENSOR_BYTES 1024u

typedef struct service_limits {
  uint64_t max_params;
  uint64_t max_tensors;
} service_limits;

/* The memory this process may use, in bytes: the smallest of the cgroup's
 * limit (v2 memory.max, v1 memory.limit_in_bytes; at the cgroup root and at
 * this process's cgroup as /proc/self/cgroup names it), MemTotal from
 * /proc/meminfo and, for the real root only, the address-space limit
 * (RLIMIT_AS). `root` (NULL or "" for "/") is prefixed to every path, for
 * tests. 0 when none of them can be read. */
uint64_t service_memory_limit(const char *root);

/* The default limits for `memory` bytes: three quarters of it for state
 * (max_params = memory * 3/4 / SERVICE_PARAM_BYTES) and a sixteenth for
 * bookkeeping (max_tensors = memory / 16 / SERVICE_TENSOR_BYTES, at most
 * SPEC_MAX_TENSORS); the rest is the transports'. memory 0 gives no limits. */
service_limits service_limits_for_memory(uint64_t memory);

/* Sets the limits (copied) that service_open checks; service_create starts
 * with service_limits_for_memory(service_memory_limit(NULL)). Call it before
 * any transport uses the service: the service reads its fields without a
 * lock. */
void service_set_limits(service *s, const service_limits *l);
service_limits service_get_limits(const service *s);

/* Clears the core's applied hook if this service set it and frees the
 * service. Call it after every transport using it stopped. NULL is
 * accepted. */
void service_destroy(service *s);

/* The core the service drives. The transports keep it too, for the calls
 * docs/DESIGN.md ("What the transports call in the core") lists with the
 * reason each goes direct (the data path's reads, pins and waits, and the
 * step handlers' readers); scripts/layers refuses any other core function in
 * a transport. */
core *service_core(const service *s);

/* ------------------------------------------------------- the shard's state
 *
 * What the control plane's answers report (Open's version and client state,
 * GetInfo, Stats, CloseJob, WriteState, the checkpoint calls, the data
 * plane's metrics). Each reads the core under its own lock, so two calls may
 * see two versions; the client state's own version is read with it. None
 * blocks; any thread. */

/* The shard and its job (core_get_info). */
void service_info(service *s, core_info *out);

/* The shard's counters (core_get_counters). */
void service_counters(service *s, core_counters *out);

/* The job's trainer membership: members, epoch, leaves (core_get_membership). */
void service_membership(service *s, core_membership *out);

/* The client state of the current version into buf (cap bytes), its length
 * returned and *version (may be NULL) that version (core_get_client_state). */
size_t service_client_state(service *s, void *buf, size_t cap, uint64_t *version);

/* A copy of the open job's spec, freed by the caller with spec_free, and its
 * hash (may be NULL): 0, ZS_ENOTOPEN or ZS_ENOMEM (core_spec_copy). */
int service_spec_copy(service *s, spec *out, uint64_t *hash);

/* 1 when the state was last replaced by a restore, with *step (may be NULL)
 * its checkpoint's step and *untouched (may be NULL) 1 while no step was
 * applied since; else 0 (core_checkpoint_origin). */
int service_checkpoint_origin(service *s, uint64_t *step, int *untouched);

/* ------------------------------------------------------------ job requests */

/* Opens (or joins) the job of `sp` for a trainer of rank `rank`: the rank must
 * be below the spec's world size (ZS_EINVAL), every hyper-parameter finite as
 * a float32 (ZS_EINVAL), a job the shard does not hold within the limits
 * (ZS_ELIMIT, see service_limits), then core_open's rules. */
int service_open(service *s, const spec *sp, uint32_t rank, core_open_result *out, char *err,
                 size_t errlen);

/* service_open with an open mode (CORE_OPEN_*, the proto's OpenMode): a mode
 * that is none of them is ZS_EINVAL; then core_open_ex's rules. The world
 * size is not part of the spec hash (issue 26): rank must also be below the
 * job's (out->world_size), else ZS_EINVAL (the open changed nothing). */
#define SERVICE_MAX_TRAINER_TIMEOUT_MS CORE_MAX_TRAINER_TIMEOUT_MS
/* service_open_mode with the job's trainer timeout (OpenRequest
 * .trainer_timeout_ms; core_open_job's rules): above an hour is ZS_ERANGE. */
int service_open_job(service *s, const spec *sp, uint32_t rank, int mode,
                     uint32_t trainer_timeout_ms, core_open_result *out, char *err, size_t errlen);
int service_open_mode(service *s, const spec *sp, uint32_t rank, int mode, core_open_result *out,
                      char *err, size_t errlen);

/* The job's membership log as text (core_member_log_format), for Stats. */
void service_member_log(service *s, char *buf, size_t cap);

/* A trainer joins or leaves an elastic job at a step boundary
 * (ChangeMembership; core_member_change's rules). */
int service_member_change(service *s, uint64_t hash, uint32_t rank, int change, uint64_t step,
                          uint64_t *version, char *err, size_t errlen);

/* Closes the shard's job (CloseJob): a job name longer than SPEC_MAX_NAME
 * bytes is ZS_EINVAL, then core_close's rules (hash 0 and job NULL or ""
 * match any job). Blocks for at most the apply in progress and the pins'
 * wait (core_close), as core_open may block for an apply. */
int service_close(service *s, uint64_t hash, const char *job, core_close_result *out, char *err,
                  size_t errlen);

/* Initial weights of a piece, elements [offset, offset + nbytes / 4): nbytes
 * must be a whole number of float32 (ZS_ESIZE), then core_init_params_range's
 * rules. `data` must be aligned for float. */
int service_init_params(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                        const void *data, size_t nbytes, int *written, uint64_t *version, char *err,
                        size_t errlen);

/* One contribution, by core_push's rules; reports an accepted, non-duplicate
 * one to the observer before it returns. */
int service_push(service *s, const core_push_args *a, int *duplicate, char *err, size_t errlen);

/* For a transport that learns a push's header before its payload: 0 when a
 * payload of a->nbytes bytes for that piece and dtype is one the core will
 * judge on its content, else the status and sentence service_push would give
 * whatever the payload (counted as a refused push, as it is one), so that the
 * transport can skip the payload unread. a->data is not used. */
int service_push_check(service *s, const core_push_args *a, char *err, size_t errlen);

/* Admission of a call that may wait for version `want` of job `hash` (a
 * Pull's min_version, a GradStats' step): 1 when the job is at want or
 * later, so that the call needs no parking room and must never be refused
 * for lack of it (a pipelined piece may still wait for its apply, briefly),
 * else 0: the call may wait and needs room. A job other than `hash` is left
 * to the call itself to refuse (1). Non-blocking. How far ahead a call may
 * wait at all is the core's rule (CORE_MAX_WAIT_AHEAD). */
int service_wait_admission(service *s, uint64_t hash, uint64_t want);

/* Size in bytes of piece (tensor, slice) in dtype, or a negative status with
 * the core's sentence: what a pull checks before it waits. */
int64_t service_piece_bytes(service *s, uint64_t hash, uint32_t tensor, uint32_t slice,
                            zs_dtype dtype, char *err, size_t errlen);

/* Piece `index` of a pull batch: its size as service_piece_bytes, which must
 * be the `length` the batch asks for (ZS_EINVAL); a sentence names the piece's
 * place in the batch. */
int64_t service_batch_piece_bytes(service *s, uint64_t hash, uint32_t index, uint32_t tensor,
                                  uint32_t slice, zs_dtype dtype, uint64_t length, char *err,
                                  size_t errlen);

/* Gradient statistics of `step`, by core_grad_stats' rules. acked_rank > 0
 * says that rank acked_rank - 1 had every one of its contributions
 * acknowledged: core_check_acked's verdict comes first (a shard that lost them
 * in a restart answers ZS_EBEHIND). Timeouts: ZS_ETIMEDOUT at once is an
 * answer (the caller asks core_missing), as a later callback's is. */
int service_grad_stats(service *s, uint64_t hash, uint64_t step, uint32_t acked_rank,
                       uint64_t deadline_ms, core_stats_cb cb, void *arg, core_stats_result *out,
                       char *err, size_t errlen);
/* service_grad_stats over the ranks `want` (NULL: the shard's set), the
 * second round of the membership agreement (core_grad_stats_members). */
int service_grad_stats_members(service *s, uint64_t hash, uint64_t step, uint32_t acked_rank,
                               const core_members *want, uint64_t deadline_ms, core_stats_cb cb,
                               void *arg, core_stats_result *out, char *err, size_t errlen);

/* The apply of `step`: lr must be finite and >= 0 and coef finite
 * (ZS_EINVAL), the client state (cs_len bytes at cs, copied) is recorded for
 * the apply (core_set_apply_client_state), then core_apply. */
int service_apply(service *s, uint64_t hash, uint64_t step, double lr, float coef, int skip,
                  const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                  core_apply_result *out, char *err, size_t errlen);

/* service_apply with per-group learning rates (ApplyRequest.group_lr): each
 * of the ngroup_lr values must be finite and >= 0 (ZS_EINVAL) before the
 * client state is recorded; the count is core_apply_groups' to check. */
int service_apply_groups(service *s, uint64_t hash, uint64_t step, double lr,
                         const double *group_lr, uint32_t ngroup_lr, float coef, int skip,
                         const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                         core_apply_result *out, char *err, size_t errlen);

/* service_apply_groups with this step's group hyper-parameters
 * (ApplyRequest.group_beta1 ... group_dampening; hp may be NULL). Each value
 * must be finite as a float32 and in the range torch accepts: 0 <= beta1,
 * beta2 < 1; eps, weight_decay, momentum >= 0; dampening in [0, 1]
 * (ZS_EINVAL with a sentence naming the array and group, nothing recorded);
 * the counts and the state rules are core_apply_step's to check. */
int service_apply_step(service *s, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                       uint32_t ngroup_lr, const core_step_hparams *hp, float coef, int skip,
                       const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                       core_apply_result *out, char *err, size_t errlen);
/* service_apply_step naming the step's membership (core_apply_members;
 * NULL: not said). */
int service_apply_members(service *s, uint64_t hash, uint64_t step, double lr,
                          const double *group_lr, uint32_t ngroup_lr, const core_step_hparams *hp,
                          const core_members *members, float coef, int skip, const void *cs,
                          size_t cs_len, core_apply_cb cb, void *arg, core_apply_result *out,
                          char *err, size_t errlen);

/* ReadState: `count` elements of array `which` of piece (tensor, slice) from
 * element `offset` into dst (count * 4 bytes, the caller's). `which` must be
 * a zs_state_array (ZS_EINVAL) and count * 4 at most max_bytes (ZS_ERANGE:
 * the transport's message limit), then core_state_read's rules. */
int service_state_read(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                       uint64_t offset, uint64_t count, uint64_t max_bytes, float *dst,
                       uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen);

/* WriteState: nbytes of little-endian float32 at data (any alignment; only
 * read during the call) into array `which` of the piece from element
 * `offset`; set_steps (may be NULL) the new optimizer step count. data must
 * be a whole number of float32 (ZS_ESIZE) and, unless only the step count is
 * set (nbytes 0 with set_steps), `which` a zs_state_array (ZS_EINVAL) and
 * nbytes above 0 (ZS_ESIZE); then core_state_write's rules. A write is
 * not told to the observer: it is neither a contribution nor a step (a
 * replica would have to be written the same way). */
int service_state_write(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                        uint64_t offset, const void *data, size_t nbytes, const uint64_t *set_steps,
                        uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen);

/* A tensor's step count on this shard (core_tensor_steps), and setting it
 * (core_set_tensor_steps: between steps only). */
int service_tensor_steps(service *s, uint64_t hash, uint32_t tensor, uint64_t *steps, char *err,
                         size_t errlen);
int service_set_tensor_steps(service *s, uint64_t hash, uint32_t tensor, uint64_t steps, char *err,
                             size_t errlen);

/* ------------------------------------------------ sentences of the transports
 *
 * Errors a transport finds itself but words like the other transport. */

/* An answer too large for the transport: returns ZS_ERANGE with "<what> of
 * N bytes exceeds the L-byte <limit_name> limit" in err. */
int service_too_large(const char *what, uint64_t nbytes, uint64_t limit, const char *limit_name,
                      char *err, size_t errlen);

/* The sentence for a Pull whose wait for min_version ended with `status`
 * (ZS_ETIMEDOUT names what it waited for; any other status its zs_strerror);
 * returns status. */
int service_pull_wait_failed(int status, uint64_t min_version, uint32_t tensor, uint32_t slice,
                             char *err, size_t errlen);

#endif
