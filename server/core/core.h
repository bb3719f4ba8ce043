/*
 * core — the shard core: one job's state on one shard, independent of any
 * transport. A transport decodes a request and calls the service layer
 * (service.h), which checks what needs no job state and calls in here; the
 * core checks everything that depends on the job (hash,
 * step, tensor, slice, sizes, dtype), owns the state, its locking and the
 * optimizer, and runs long work (gradient statistics, apply) on its own worker
 * thread, never on the caller's.
 *
 * Asynchronous calls follow one contract: a function taking a callback returns
 *   - ZS_OK when the result is available at once (the callback is never called
 *     and the result is in the out parameter),
 *   - CORE_PENDING when the callback will be called exactly once later, from a
 *     core thread, with the outcome (ZS_OK, ZS_ETIMEDOUT, ZS_ECLOSED ...),
 *   - a negative zs_status on error (the callback is never called).
 * Callbacks must not block and must not call back into the core except for the
 * non-blocking readers (core_read, core_get_info, core_get_counters).
 *
 * Deadlines are absolute clock_now_ms() values; 0 means the core's default
 * (60 s from now).
 */
#ifndef ZSHARD_SERVER_CORE_H
#define ZSHARD_SERVER_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/model/layout.h"
#include "common/model/spec.h"

#define CORE_PENDING 1
#define CORE_MAX_MISSING 64
/* The gradient statistics are summed over fixed blocks of this many arena
 * elements (optim_sum_squares per block), and the block sums are added in block
 * order, so that the result does not depend on the thread count. */
#define CORE_STATS_BLOCK 65536u

typedef struct core core;

typedef struct core_config {
  uint32_t shard_id;
  uint32_t num_shards;
  int threads; /* optimizer threads; <= 0 means the number of CPUs */
  /* Each apply's duration is recorded here (server/core/histogram.h) when not
   * NULL. Borrowed: it must outlive the core. */
  struct histogram *apply_hist;
  /* A member rank that has not given every contribution of the pending step
   * this long after the first GradStats of the step reached this shard is
   * left out of the step (DESIGN.md "Membership"); 0: a fixed membership,
   * the job's W ranks, as before elastic trainers. */
  uint32_t trainer_timeout_ms;
} core_config;

/* Creates an empty shard (no job). Returns 0 or ZS_ENOMEM / ZS_EINVAL. */
int core_create(const core_config *cfg, core **out);

/* Fails every pending wait with ZS_ECLOSED (their callbacks run before this
 * returns), stops the threads and frees everything. */
void core_destroy(core *c);

/* Registers the job. The first call creates it (copying `s`); later calls with
 * an identical spec are accepted; any other spec is ZS_EHASH. The spec's shard
 * count must equal the shard's. err gets a sentence on error (may be NULL). */
typedef struct core_open_result {
  uint64_t spec_hash;
  uint64_t version;
  int created;
  int initialized;
  uint32_t world_size; /* the job's, whatever the opening spec said (issue 26) */
} core_open_result;
int core_open(core *c, const spec *s, core_open_result *out, char *err, size_t errlen);

/* core_open with an open mode (the proto's OpenMode), decided under the same
 * lock as the creation, so that two opens racing a close cannot both win:
 *  - CORE_OPEN_EITHER: core_open.
 *  - CORE_OPEN_CREATE: creates the job, or joins it when the shard holds the
 *    same spec still at version 0 (the other trainers of the run opening
 *    after the first); another job, or the same one at a version above 0,
 *    is ZS_EEXIST with a sentence naming it. Initial weights that differ
 *    from those already written at version 0 are then refused by
 *    core_init_params (ZS_EEXIST), so a new run never trains on an old
 *    run's weights.
 *  - CORE_OPEN_RESUME: joins the job on the shard (another spec: ZS_EHASH);
 *    no job is ZS_ENOTOPEN, and nothing is created.
 * Any other mode is treated as CORE_OPEN_EITHER (the service refuses it). */
/* CORE_OPEN_JOIN (issue 26): service_open_mode opens as CORE_OPEN_RESUME; the
 * trainer is admitted to the membership afterwards (core_member_change). */
enum { CORE_OPEN_EITHER = 0, CORE_OPEN_CREATE = 1, CORE_OPEN_RESUME = 2, CORE_OPEN_JOIN = 3 };
int core_open_ex(core *c, const spec *s, int mode, core_open_result *out, char *err, size_t errlen);
/* core_open_ex with the job's trainer timeout (issue 26): when this call
 * creates the job, trainer_timeout_ms > 0 is its timeout, and makes it
 * elastic (DESIGN.md "Membership"); 0 takes core_config.trainer_timeout_ms.
 * Opening an existing job leaves its timeout as it is. A job restored from
 * a checkpoint takes the core's. */
int core_open_job(core *c, const spec *s, int mode, uint32_t trainer_timeout_ms,
                  core_open_result *out, char *err, size_t errlen);

/* Closes the shard's job: fails every wait of it (version, statistics,
 * apply) with ZS_ENOTOPEN (their callbacks run on the worker before this
 * returns), frees its state and leaves the shard empty, as core_create left
 * it, for the next core_open of any job. Every later request of the closed
 * job gets ZS_ENOTOPEN. hash (0: any) and job (NULL or "": any) must name
 * the shard's job (ZS_EHASH, ZS_ENOTFOUND). Refused with ZS_ENOTREADY while a
 * restore is queued; on any error nothing changes. Snapshots still waiting
 * for their version fail with ZS_ENOTOPEN like the other waits.
 * Pull answers pinned in the low arena (core_pin_low) keep their buffer
 * alive until they are released; the close does not wait for them. With no job open it returns 0
 * with out->closed 0. Blocks its caller until the worker ran it, i.e. for at most the apply or
 * statistics pass in progress. The job's spec and layout
 * stay allocated until the next core_open or core_destroy, so that what
 * core_spec returned before the close remains readable (core_spec itself
 * returns NULL once closed). out may be NULL. */
typedef struct core_close_result {
  int closed;
  char job[SPEC_MAX_NAME + 1];
  uint64_t spec_hash, version, state_bytes;
} core_close_result;
int core_close(core *c, uint64_t hash, const char *job, core_close_result *out, char *err,
               size_t errlen);

/* Initial fp32 weights of one piece. Written once while the version is 0; an
 * identical repeat is accepted (written = 0); different data is ZS_EEXIST;
 * after the first applied step the call changes nothing (written = 0). */
int core_init_params(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, const float *data,
                     size_t nbytes, int *written, uint64_t *version, char *err, size_t errlen);

/* Part of a piece's initial weights: elements [offset, offset + nbytes / 4).
 * offset must be a multiple of LAYOUT_INIT_CHUNK_ELEMS and the range must end
 * on a multiple of it or at the piece's end, so that a range is a run of whole
 * chunks; chunks may come in any order and ranges may overlap. Every chunk of
 * the range that is already written must hold the same data (else ZS_EEXIST
 * and nothing is written); the others are written (written = 1). The piece is
 * initialized once every chunk is written. core_init_params is the range of
 * the whole piece. */
int core_init_params_range(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                           const float *data, size_t nbytes, int *written, uint64_t *version,
                           char *err, size_t errlen);

/* One contribution. nbytes 0 (every piece has at least one element) is a
 * contribution without a gradient: it counts towards the step's W*M like
 * any other and adds nothing (data is not looked at), and a
 * piece whose contributions all came without one is skipped by the apply
 * (weights, moments, low copy and its tensor's step count stay), as torch
 * skips a parameter whose .grad is None. One with a gradient among them
 * makes the others count as zeros. Only step == version + 1 is added; a well-formed push for
 * an already applied step is a retry and is acknowledged as a duplicate; any
 * other step is ZS_ESTEP;
 * rank < W, micro < M; the piece must be this shard's; nbytes must equal
 * numel * dtype size. A repeat of a contribution already received sets
 * *duplicate and changes nothing. Contributions are added in the fixed order
 * (micro, rank); one that arrives early is copied and held until its turn.
 * `data` is only read during the call. */
typedef struct core_push_args {
  uint64_t hash, step;
  uint32_t rank, micro, tensor, slice;
  zs_dtype dtype;
  const void *data;
  size_t nbytes;
} core_push_args;
int core_push(core *c, const core_push_args *a, int *duplicate, char *err, size_t errlen);

/* Waits until every piece of this shard is initialised and the version is at
 * least min_version. cb(arg, status, version). */
typedef void (*core_version_cb)(void *arg, int status, uint64_t version);
int core_wait_version(core *c, uint64_t hash, uint64_t min_version, uint64_t deadline_ms,
                      core_version_cb cb, void *arg, uint64_t *version, char *err, size_t errlen);

/* How far past the shard's version core_wait_pieces waits; further ahead is
 * ZS_ERANGE at once. */
#define CORE_MAX_WAIT_AHEAD 2u

/* One piece a pull reads: core_wait_pieces. */
typedef struct core_piece_id {
  uint32_t tensor, slice;
} core_piece_id;

/* core_wait_version for the pieces a pull reads (n of them; `pieces` is
 * only read during the call; n 0 is core_wait_version): in a gated job a
 * piece's version is the shard's, and this is core_wait_version; in a
 * pipelined job (spec.pipelined) a piece the pending step already applied
 * is at version + 1 before the shard is, and a wait for it ends then, so
 * that pulls of applied pieces overlap the pushes of the others. cb gets
 * the lowest version of the pieces. A piece this shard does not own is
 * ZS_ENOTFOUND (nothing is registered); a min_version more than
 * CORE_MAX_WAIT_AHEAD past the shard's version is ZS_ERANGE (or
 * ZS_EBEHIND after a checkpoint load, as for any wait ahead). */
int core_wait_pieces(core *c, uint64_t hash, const core_piece_id *pieces, uint32_t n,
                     uint64_t min_version, uint64_t deadline_ms, core_version_cb cb, void *arg,
                     uint64_t *version, char *err, size_t errlen);

/* Ends at once the waits of core_wait_version and core_grad_stats registered
 * with `arg`: their callbacks run with ZS_ECANCELED on the calling thread
 * before this returns (one that already fired is not found). For a transport
 * whose caller went away, so that the wait's memory is not kept until its
 * deadline. Its cost does not grow with the number of other waits (they
 * are found by arg), so a mass cancel is linear. Call it with no lock the
 * callbacks take. */
void core_cancel_waits(core *c, void *arg);

/* Copies piece (tensor, slice) in `dtype` into dst (exactly numel * dtype size
 * bytes), consistent with one version, reported in *version: the piece's
 * (version + 1 for a piece a pipelined step applied ahead). Never blocks on
 * the optimizer longer than one apply. */
int core_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype, void *dst,
              size_t nbytes, uint64_t *version, char *err, size_t errlen);

/* core_read that also extends *crc (CRC32C, as crc32c(*crc, dst, nbytes)) over
 * the bytes it writes, chunk by chunk while each chunk is still in cache: one
 * pass over the answer instead of a copy and then a second read of it. */
int core_read_crc(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                  void *dst, size_t nbytes, uint64_t *version, uint32_t *crc, char *err,
                  size_t errlen);

/* ------------------------------------------------------- optimizer state
 *
 * The arrays of one piece (zs_state_array: master weights, exp_avg / SGD's
 * momentum buffer, exp_avg_sq) in element ranges [offset, offset + nbytes / 4)
 * of the piece, fp32. Both check the job (hash), the piece (this shard's,
 * ZS_ENOTFOUND), that the piece's param group keeps the array
 * (optim_state_needs; ZS_EINVAL otherwise), that the range is inside the
 * piece (ZS_ERANGE), that nbytes is a whole number of float32 (ZS_ESIZE) and
 * that the piece has its initial weights (ZS_ENOTREADY); on any error
 * nothing is read or written. */

/* A tensor's optimizer step count on this shard: the applied steps that gave
 * it a gradient (torch's per-parameter state['step']), which its Adam bias
 * corrections and SGD's first momentum step follow. The shard must own a
 * piece of the tensor (ZS_ENOTFOUND). core_set_tensor_steps sets it under
 * the rules of core_state_write (between steps only, ZS_ENOTREADY; the
 * version stays). */
int core_tensor_steps(core *c, uint64_t hash, uint32_t tensor, uint64_t *steps, char *err,
                      size_t errlen);
int core_set_tensor_steps(core *c, uint64_t hash, uint32_t tensor, uint64_t steps, char *err,
                          size_t errlen);

/* Copies the range into dst with state_rw held shared, so that it is one
 * version's: *version and *optimizer_steps (either may be NULL) are read
 * under the same lock. Never waits longer than one apply. */
int core_state_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_state_array which,
                    uint64_t offset, float *dst, size_t nbytes, uint64_t *version,
                    uint64_t *optimizer_steps, char *err, size_t errlen);

/* Overwrites the range from src (only read during the call) with state_rw
 * held exclusively, so that no apply, push, pull or snapshot overlaps it; a
 * master write also recomputes the low-precision copy of the range (and the
 * piece's CRC), into a fresh copy when pull answers are pinned in the low
 * arena, as an apply does. With set_steps not NULL the optimizer step count becomes
 * *set_steps, the job's and every tensor's; with nbytes 0 and set_steps, only the count is written
 * and tensor, slice and which are not looked at. Refused with ZS_ENOTREADY while a step is in
 * progress (a contribution of the pending step received, or its apply queued). The version stays: a
 * write is not a step. A state that came from a checkpoint no longer counts as untouched
 * (core_checkpoint_origin), so restoring that checkpoint loads it again. *version and
 * *optimizer_steps (may be NULL) get the values after the write. */
int core_state_write(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_state_array which,
                     uint64_t offset, const float *src, size_t nbytes, const uint64_t *set_steps,
                     uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen);

/* Zero-copy pulls of the stored low-precision copy. When dtype is the job's
 * param_dtype and the piece is initialised, sets *data to the piece's bytes
 * in the low arena (nbytes of them), *crc to their CRC32C and *version, and
 * pins the arena: the caller sends the bytes from there and calls
 * core_unpin_low(c, *data) once they are out (from any thread; it never
 * blocks). Nobody waits for a pin: an apply, restore, state write or close
 * that finds answers pinned (a pipelined job's piece apply: answers of the
 * pieces it writes) writes a fresh copy (or frees nothing) and the
 * pinned one stays intact, with its version's bytes, until its last pin is
 * released; a peer that stalls mid-answer costs one copy of the 16-bit
 * weights, never the other trainers' time. Past CORE_LOW_RETIRED_MAX such
 * copies the current one is overwritten under its readers, whose CRC32C
 * check refuses the torn answers. Returns 0, a negative
 * status with a message (the checks of core_read), or CORE_NOT_PINNED when
 * the piece must be read with core_read (another dtype). */
#define CORE_NOT_PINNED 2 /* never CORE_PENDING's value: both are "not an error" */
int core_pin_low(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                 size_t nbytes, const void **data, uint64_t *version, uint32_t *crc, char *err,
                 size_t errlen);
/* data is the *data core_pin_low gave. */
void core_unpin_low(core *c, const void *data);
/* The dtype core_pin_low serves (the job's param_dtype), 0 before a job is
 * open. Lock-free, for transports deciding how to answer. */
zs_dtype core_low_dtype(core *c);

/* Size in bytes of piece (tensor, slice) in dtype, or a negative status;
 * core_piece_bytes_err also gives the status's sentence (the one the other
 * calls give for it) in err (may be NULL). */
int64_t core_piece_bytes(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype);
int64_t core_piece_bytes_err(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                             zs_dtype dtype, char *err, size_t errlen);

/* Gradient statistics of step `step` (== version + 1, or == version for a
 * step already applied, whose statistics are kept). Waits until all W*M
 * contributions of every piece are in and the statistics are computed. On
 * timeout the callback gets ZS_ETIMEDOUT and core_missing() says what is
 * missing. A pipelined job has none: ZS_EINVAL with a sentence. */
/* A set of trainer ranks: the members of a step (DESIGN.md "Membership").
 * An elastic job (core_config.trainer_timeout_ms > 0, not pipelined) has at
 * most CORE_ELASTIC_MAX_W ranks; one with more keeps a fixed membership. n
 * is the count of bits set; a job with a fixed membership reports all W
 * ranks (n = W, bits set when W <= CORE_ELASTIC_MAX_W). */
#define CORE_ELASTIC_MAX_W 1024u
#define CORE_MEMBER_WORDS (CORE_ELASTIC_MAX_W / 64u)
typedef struct core_members {
  uint32_t n;
  uint64_t bits[CORE_MEMBER_WORDS];
} core_members;
static inline int core_members_has(const core_members *m, uint32_t rank) {
  return rank < CORE_ELASTIC_MAX_W && ((m->bits[rank / 64] >> (rank % 64)) & 1u);
}
/* Sets rank in m (rank < CORE_ELASTIC_MAX_W), counting it once. */
void core_members_add(core_members *m, uint32_t rank);
/* 1 when a and b hold the same ranks. */
int core_members_equal(const core_members *a, const core_members *b);
/* A membership from the network (GradStatsRequest, ApplyRequest): num ranks
 * listed in ranks (nranks of them), or num = W with none listed for every
 * rank. Checked against the open job: every rank below W, none twice, the
 * count matching (ZS_EINVAL with a sentence; ZS_ENOTOPEN without a job). */
int core_members_decode(core *c, uint32_t num, const uint32_t *ranks, size_t nranks,
                        core_members *out, char *err, size_t errlen);
/* The ranks of m in ascending order into ranks (cap of them) for an answer;
 * 0 when m holds every rank of the job, which an answer does not list. */
size_t core_members_list(core *c, const core_members *m, uint32_t *ranks, size_t cap);

typedef struct core_stats_result {
  uint64_t step;
  double sum_squares;
  int nonfinite;
  /* The ranks whose contributions the statistics (and the apply they lead
   * to) sum: the step's members, or fewer once the trainer timeout left
   * some out or a caller narrowed it (core_grad_stats_members). */
  core_members members;
} core_stats_result;
typedef void (*core_stats_cb)(void *arg, int status, const core_stats_result *r);
int core_grad_stats(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_stats_cb cb,
                    void *arg, core_stats_result *out, char *err, size_t errlen);

/* core_grad_stats asking for the statistics over the ranks `want` (NULL:
 * whatever set the shard decided), the second round of the membership
 * agreement (DESIGN.md "Membership"): every rank of `want` must have all its
 * contributions on this shard, else the answer is ZS_EINVAL with a sentence;
 * a set the shard's statistics already cover is answered as it is, a
 * smaller one makes the shard sum the step again over `want` only, and
 * pushes of ranks outside it are refused from then on (ZS_ELEFT). For an
 * applied step, `want` must be the set it was applied with (ZS_EEXIST). */
int core_grad_stats_members(core *c, uint64_t hash, uint64_t step, const core_members *want,
                            uint64_t deadline_ms, core_stats_cb cb, void *arg,
                            core_stats_result *out, char *err, size_t errlen);
/* For a trainer that had every contribution of `rank` to this shard for
 * `step` acknowledged: 0 when the shard holds them all (or the step's
 * statistics are done, or step is not the pending one: core_grad_stats
 * answers those), else ZS_EBEHIND naming the checkpoint the shard restarted
 * from (or was restored to), which lost them; ZS_EINTERNAL if it never
 * restarted. */
int core_check_acked(core *c, uint64_t hash, uint64_t step, uint32_t rank, char *err,
                     size_t errlen);

/* What step `step` still lacks: up to `max` entries in ascending (tensor,
 * slice, micro, rank) order; returns the total count missing (0 if complete or
 * the step is not the pending one). */
typedef struct core_missing_entry {
  uint32_t rank, micro, tensor, slice;
} core_missing_entry;
uint32_t core_missing(core *c, uint64_t step, core_missing_entry *out, uint32_t max);

/* Runs the optimizer for step `step` (== version + 1) once all contributions
 * are in: gradient = acc * coef (coef / W under GRAD_REDUCE_MEAN, rounded once
 * to float), lr per group = lr * lr_scale. skip advances the version without
 * touching weights or moments (the accumulator is cleared). Non-finite
 * gradients without skip are ZS_ENONFINITE and change nothing. A repeat for an
 * applied step with the same (lr, coef, skip) returns the recorded outcome at
 * once; different arguments are ZS_EEXIST.
 *
 * In a pipelined job (spec.pipelined) the Apply of the pending step comes
 * ahead of its contributions: it is accepted whether they are in or not
 * (even before the initial weights, which the pieces then wait for) and
 * answered at once with ZS_OK and
 * out->version below step (the callback is never called); the worker then
 * applies each piece when its last contribution lands, with the same
 * kernel, plans and accumulator as the gated apply, and the version
 * advances once every piece is applied (the applied hook runs then). A
 * repeat with the same arguments gets the same answer, or the recorded
 * outcome once the step is applied; skip is ZS_EINVAL. */
typedef struct core_apply_result {
  uint64_t step, version;
  int skipped;
  uint64_t optimizer_steps;
  /* How long the worker ran the step's apply, once applied (0 before, and
   * for a step not applied here). A replicated primary bounds the wait for a
   * backup's apply of the same step with it (replica_forward_raw). */
  uint64_t apply_ns;
} core_apply_result;
typedef void (*core_apply_cb)(void *arg, int status, const core_apply_result *r);
int core_apply(core *c, uint64_t hash, uint64_t step, double lr, float coef, int skip,
               core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen);

/* core_apply with per-group learning rates: ngroup_lr 0 is core_apply (lr *
 * lr_scale per group); otherwise group_lr holds exactly one finite value >= 0
 * per param group of the spec (else ZS_EINVAL, nothing changes), used as
 * that group's lr (lr_scale is not applied; lr is only compared). A repeat of
 * the step must carry the same values (else ZS_EEXIST). group_lr is copied. */
int core_apply_groups(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                      uint32_t ngroup_lr, float coef, int skip, core_apply_cb cb, void *arg,
                      core_apply_result *out, char *err, size_t errlen);

/* The param-group hyper-parameters an Apply may set for its step alone
 * (ApplyRequest.group_beta1 ... group_dampening), in that order: the
 * scheduled values of torch's param_groups (OneCycleLR's cycled momentum or
 * beta1, say). nesterov, the optimizer and bias_correction stay the spec's. */
#define CORE_STEP_HPARAMS(X)                                                                       \
  X(BETA1, beta1) /* adam, adamw */                                                                \
  X(BETA2, beta2) /* adam, adamw */                                                                \
  X(EPS, eps)     /* adam, adamw */                                                                \
  X(WEIGHT_DECAY, weight_decay)                                                                    \
  X(MOMENTUM, momentum)   /* sgd */                                                                \
  X(DAMPENING, dampening) /* sgd */

#define CORE_HP_ENUM(up, name) CORE_HP_##up,
enum { CORE_STEP_HPARAMS(CORE_HP_ENUM) CORE_NHP };
#undef CORE_HP_ENUM

/* One step's values: v[k] NULL with n[k] 0 keeps the spec's value of
 * hyper-parameter k in every group; otherwise v[k] holds n[k] values, one
 * per param group, borrowed for the call. */
typedef struct core_step_hparams {
  const double *v[CORE_NHP];
  uint32_t n[CORE_NHP];
} core_step_hparams;

/* core_apply_groups with hyper-parameters for this step (hp may be NULL: the
 * spec's). Each given array must hold one value per param group (ZS_EINVAL
 * otherwise; the ranges are the service's to check), and a group keeps
 * what torch requires of it for its state: an SGD group's momentum stays 0
 * if the spec's is 0 and above 0 if the spec's is (the momentum buffer exists
 * or not from the start), and with nesterov momentum > 0 and dampening 0.
 * Nothing changes on a refusal. The values are copied, used for this step
 * only, and a repeat of the step must carry the same (else ZS_EEXIST). */
int core_apply_step(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                    uint32_t ngroup_lr, const core_step_hparams *hp, float coef, int skip,
                    core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen);

/* core_apply_step naming the step's membership, the set the trainers agreed
 * on (DESIGN.md "Membership"): it must be the set the shard's statistics
 * cover (else ZS_EINVAL, nothing changes), and under GRAD_REDUCE_MEAN the
 * gradient is the sum over those ranks divided by their count. NULL is the
 * set of every rank the step expected (an older client's Apply): refused
 * when the shard's set is smaller. */
int core_apply_members(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                       uint32_t ngroup_lr, const core_step_hparams *hp, const core_members *members,
                       float coef, int skip, core_apply_cb cb, void *arg, core_apply_result *out,
                       char *err, size_t errlen);

/* The membership of the shard's job (DESIGN.md "Membership"), for status
 * pages and /metrics: the pending step's members, the epoch (how many times
 * the membership changed), ranks left out by the trainer timeout, steps
 * decided by a timeout, and the timeout itself. Non-blocking. */
typedef struct core_membership {
  int elastic;
  uint32_t trainer_timeout_ms, world_size;
  uint64_t epoch, leaves, timeouts, joins;
  core_members members;
} core_membership;
void core_get_membership(core *c, core_membership *out);

/* The membership log of an elastic job (issue 26): which ranks contributed
 * to which applied step, one entry per change of the set, the steps from
 * from_step on up to the next entry's. Kept on the shard for the job's
 * life and in its checkpoints (core_member_state), at most
 * CORE_MEMBER_LOG_MAX entries. */
#define CORE_MEMBER_LOG_MAX 4096u
typedef struct core_member_log_entry {
  uint64_t from_step;
  core_members members;
} core_member_log_entry;
/* Writes the last entries of the log into buf as text, oldest first:
 * "from_step:rank,rank,...;from_step:..." (e.g. "1:0,1,2;3:0,1;5:0,1,2"),
 * as many whole entries as fit in cap bytes (NUL included); "" for a job
 * with a fixed membership or no step applied. Returns the entries written. */
size_t core_member_log_format(core *c, char *buf, size_t cap);

/* The largest trainer timeout (an hour): the server's flag, a job's option
 * and a checkpoint's or a replica copy's recorded ones alike. */
#define CORE_MAX_TRAINER_TIMEOUT_MS 3600000u

/* An elastic job's membership as a checkpoint records it (DESIGN.md
 * "Membership", CHECKPOINTS.md's members section): the job's own trainer
 * timeout (0: it had none, the server's flag applies), the server-flag
 * timeout that was in effect for the job (flag_timeout_ms, 0: none; what a
 * job elastic only through the flag keeps when it is restored where the
 * flag is not set, core_timeout_in_effect), the counters, the members of the
 * step after the checkpointed version, and the log. */
typedef struct core_member_state {
  uint32_t trainer_timeout_ms;
  uint32_t flag_timeout_ms;
  uint64_t epoch, leaves, timeouts, joins;
  core_members members;
  const core_member_log_entry *log; /* log_n entries, oldest first */
  uint32_t log_n;
  /* The joins and leaves planned for later steps, per rank below nplan
   * (0: none): a replica set's state copy carries them (a joiner must make
   * the changes the primary made before the copy); a checkpoint does not
   * (NULL, nplan 0). */
  const uint64_t *join_at, *leave_at;
  uint32_t nplan;
} core_member_state;

/* The trainer timeout a job gets (0: a fixed membership), the one rule for
 * a job created by Open and for one restored from a checkpoint or a replica
 * copy: the job's own option (open_ms) first, then the server's flag on
 * this server (server_flag_ms), then the flag timeout recorded with the job
 * (recorded_flag_ms: the flag of the server it ran on before; 0 for a job
 * created here). */
uint32_t core_timeout_in_effect(uint32_t open_ms, uint32_t server_flag_ms,
                                uint32_t recorded_flag_ms);

/* A deep copy of `from` (borrowed for the call) into *out: the counters, the
 * members, and log_n log entries and nplan plans copied into arrays of the
 * copy's own (a NULL log or plan stays NULL). The copy is malloc'd and owned
 * by the caller, who frees it with core_member_state_free, or hands it to a
 * core_state as its members (core_state_free then frees it). Returns 0, or
 * ZS_ENOMEM with *out NULL. */
int core_member_state_copy(core_member_state **out, const core_member_state *from);

/* Frees ms (from core_member_state_copy) and its log and plans; NULL is a
 * no-op. */
void core_member_state_free(core_member_state *ms);

/* A trainer's change of membership in an elastic job (issue 26; DESIGN.md
 * "Membership"), keyed by step so that every shard makes it at the same step
 * boundary whatever order the requests and the applies come in:
 *  - CORE_MEMBER_JOIN: rank contributes from step `step` on. Refused
 *    ZS_ESTEP (nothing changed) when this shard applied step or decided its
 *    members already: the trainer asks again for a later step. A rank that
 *    is still a member (a restarted trainer) loses what it pushed to the
 *    pending step, if that step is not decided, and starts afresh at `step`.
 *  - CORE_MEMBER_LEAVE: rank contributes nothing from step `step` on (a
 *    clean close): if the pending step is not decided, its pushes to it are
 *    discarded and the step goes on without it at once; else it leaves at
 *    the next step. Leaving twice, a rank that is not a member, or a step
 *    already applied (a stale client's: a newer life of the rank may have
 *    joined since) is a no-op.
 * A job that is not elastic, a rank at or beyond W, or another kind:
 * ZS_EINVAL. *version gets the shard's version. Takes state_rw exclusive:
 * call it with no lock held. */
enum { CORE_MEMBER_JOIN = 1, CORE_MEMBER_LEAVE = 2 };
int core_member_change(core *c, uint64_t hash, uint32_t rank, int kind, uint64_t step,
                       uint64_t *version, char *err, size_t errlen);
/* Installs the one hook told of every applied step (a skipped one included),
 * whoever asked for it: fn(arg, r) runs once per step on the core's worker
 * thread, after the apply released every core lock and before the apply's
 * callbacks answer anyone. It follows the callbacks' rules (no blocking, only
 * the non-blocking readers). A restore is not an applied step. Set it before
 * anything can call core_apply; NULL clears it. `arg` is borrowed until the
 * hook is cleared or the core destroyed. */
typedef void (*core_applied_fn)(void *arg, const core_apply_result *r);
void core_set_applied_hook(core *c, core_applied_fn fn, void *arg);

/* ------------------------------------------------------------- client state
 *
 * An opaque blob the trainers hand the shard with each Apply (libzshard's
 * dynamic loss scaler), kept with the version it belongs to so that
 * checkpoints, restarts and restores carry it like the weights. The shard
 * never looks inside. */
#define CORE_MAX_CLIENT_STATE 1024u

/* The client state that the apply of `step` is to commit: called by a
 * transport right before core_apply for the same step. It is recorded while
 * step is version + 1 and that step's apply is not yet queued (identical
 * trainers send identical blobs, so the one recorded last before the apply
 * is queued is as good as the first), and ignored otherwise (a repeat of an
 * applied or queued step). When the apply of `step` runs, a non-empty blob
 * becomes the client state of version `step`; an empty one (len 0) leaves
 * the previous version's in place. `data` is copied. Returns 0, ZS_ESIZE
 * (len above CORE_MAX_CLIENT_STATE) or the job checks' status, with a
 * sentence in err; on error nothing changes. */
int core_set_apply_client_state(core *c, uint64_t hash, uint64_t step, const void *data, size_t len,
                                char *err, size_t errlen);

/* Copies the client state of the current version into buf (cap bytes, at
 * least CORE_MAX_CLIENT_STATE to be sure it fits; a longer state is cut to
 * cap) and returns its length (0: none); *version (may be NULL) gets that
 * version, read under the same lock. Non-blocking. */
size_t core_get_client_state(core *c, void *buf, size_t cap, uint64_t *version);

typedef struct core_info {
  uint32_t shard_id, num_shards;
  int has_job;
  char job[SPEC_MAX_NAME + 1];
  uint64_t spec_hash, version;
  uint64_t state_bytes;
  uint32_t pieces;
  uint64_t elements;
  int initialized;
  uint64_t optimizer_steps;
} core_info;
void core_get_info(core *c, core_info *out);

typedef struct core_counters {
  uint64_t pushes, duplicate_pushes, rejected, pulls, bytes_in, bytes_out;
  uint64_t applies, skipped_steps, version, held_bytes;
  /* Freed early-contribution buffers kept for reuse, and the early
   * contributions held in such a buffer rather than fresh memory. */
  uint64_t held_cached_bytes, held_reused;
  double apply_seconds_total;
  uint32_t waiting_pulls; /* core_wait_version calls not yet answered */
  uint32_t waiting_stats; /* core_grad_stats calls not yet answered */
} core_counters;
void core_get_counters(core *c, core_counters *out);
/* Counts one pull and the bytes the transport sent for it. core_read does not
 * count, so a transport calls this once per answered pull. */
void core_count_pull(core *c, uint64_t bytes_out);

/* The spec of the open job (NULL without one); valid until core_destroy, or
 * until the core_open that follows a core_close. */
const spec *core_spec(core *c);
const layout *core_layout(core *c);
/* Copies the open job's spec into *out (which the caller frees with
 * spec_free) and its hash into *hash (may be NULL); ZS_ENOTOPEN without a job,
 * ZS_ENOMEM. Unlike core_spec's pointer, the copy stays valid whatever
 * happens to the job, so a transport thread can read it while the job is
 * closed and another opened. */
int core_spec_copy(core *c, spec *out, uint64_t *hash);
/* 1 when the open job's hash is `hash` and its name is `name` (a job a rank
 * token names); 0 otherwise, or without a job. Any thread; no copy. */
int core_job_named(core *c, uint64_t hash, const char *name);

/* ---------------------------------------------------------------- checkpoints
 *
 * The two calls below block their caller until the core's worker thread has
 * done the work, so that they are ordered with every apply: call them from a
 * thread of your own (the checkpoint service's), never from a transport
 * thread or a core callback.
 *
 * After a core_restore, a request for a step beyond version + 1 (a push,
 * statistics, an apply, or a wait for a version above version + 1) comes from
 * a trainer that is ahead of the restored shard and gets ZS_EBEHIND naming the
 * checkpoint, as do the waits that were pending when the state was replaced.
 *
 * In a pipelined job a version is whole only until the next step applies its
 * first piece: a snapshot of it must be registered before then (the worker
 * takes it before that piece), later it is ZS_ESTEP like a version passed.
 */

/* The shard's state at exactly one version, as core_snapshot shows it. Every
 * pointer is borrowed from the core and valid only during the call that
 * received the view; m and v are NULL when no param group on this shard uses
 * them. Padding between pieces is part of the arenas (zeros). */
typedef struct core_view {
  const spec *spec;
  uint32_t shard_id, num_shards;
  uint64_t hash, version, optimizer_steps, nelems;
  /* Per tensor of the spec: its step count (core_tensor_steps); meaningful
   * for the tensors with a piece on this shard. */
  const uint64_t *tensor_steps;
  const float *master, *m, *v;
  /* The client state of `version` (NULL with length 0 when there is none). */
  const unsigned char *client_state;
  size_t client_state_len;
  /* The membership of an elastic job (its log borrowed like the rest);
   * NULL for a job with a fixed membership. */
  const core_member_state *members;
} core_view;

typedef int (*core_view_fn)(void *arg, const core_view *view);

/* Waits until the shard is at version `step` with every piece initialised and
 * calls fn(arg, view) once, on the core's worker thread, with the state lock
 * held shared: pushes and pulls go on meanwhile and only the next apply waits
 * until fn returns, so fn should copy and return. A step above the version
 * waits for the applies that reach it (until deadline_ms, as in core.h's
 * deadlines: ZS_ETIMEDOUT); a step below it is ZS_ESTEP. Returns what fn
 * returned, or a negative status when fn was not called. *fn_seconds (may be
 * NULL) gets how long fn ran, i.e. how long it held an apply back. */
int core_snapshot(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_view_fn fn,
                  void *arg, double *fn_seconds, char *err, size_t errlen);

/* core_snapshot without blocking its caller: fn(fn_arg, view) runs on the
 * worker as core_snapshot's does, and done(done_arg, status, fn_seconds)
 * follows exactly once: on the worker, or on the thread of the
 * core_cancel_snapshots or core_destroy that ended the wait. status is what
 * fn returned, or ZS_ETIMEDOUT, ZS_ESTEP (the shard moved past the step),
 * ZS_ECANCELED or ZS_ECLOSED. done follows the callbacks' rules. Returns
 * CORE_PENDING, or a negative status with a sentence (done is then never
 * called). A snapshot waiting for a later version thus holds no thread. */
typedef void (*core_snapshot_done)(void *arg, int status, double fn_seconds);
int core_snapshot_async(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms,
                        core_view_fn fn, void *fn_arg, core_snapshot_done done, void *done_arg,
                        char *err, size_t errlen);

/* Fails every core_snapshot still waiting for its version with ZS_ECANCELED
 * (for a checkpoint service that stops). */
void core_cancel_snapshots(core *c);

/* A complete replacement state for one shard: what a checkpoint holds. */
typedef struct core_state {
  spec spec; /* owned; num_shards is the shard count the state is laid out for */
  uint32_t shard_id;
  uint64_t version, optimizer_steps;
  uint64_t nelems; /* arena length in elements of shard_id under spec's layout */
  /* Owned, 64-byte aligned, nelems elements each and zeroed by
   * core_state_init; m (exp_avg, SGD's momentum) and v (exp_avg_sq) are NULL
   * when no param group with a piece on the shard uses them. */
  float *master, *m, *v;
  /* Owned (malloc), spec.num_tensors entries: each tensor's step count
   * (core_tensor_steps); NULL (as core_state_init leaves it) gives every
   * tensor optimizer_steps, as a checkpoint from before per-tensor counts. */
  uint64_t *tensor_steps;
  /* Owned (malloc), NULL when empty: the client state of `version`, at most
   * CORE_MAX_CLIENT_STATE bytes (core_set_apply_client_state). */
  unsigned char *client_state;
  size_t client_state_len;
  /* Owned (malloc, its log too), NULL for a checkpoint without a members
   * section (a fixed membership, or a file from before format 2): the
   * restore then makes every rank of W a member, with the server's
   * timeout. */
  core_member_state *members;
} core_state;

/* Copies and validates `s` into st and allocates its arenas for shard
 * `shard_id` (version and optimizer_steps 0). Returns 0, or ZS_EINVAL /
 * ZS_ENOMEM with a sentence in err (st is then empty). */
int core_state_init(core_state *st, const spec *s, uint32_t shard_id, char *err, size_t errlen);

/* Frees what st owns and zeroes it; tolerates a zeroed state. */
void core_state_free(core_state *st);

/* Replaces the shard's state by st: version, optimizer step counts, master, m,
 * v, the client state (copied; an empty one clears the shard's) and, with
 * st->members, the elastic membership (the job's timeout, members, counters
 * and log; a rank at or beyond the job's W is ZS_EINVAL); the
 * low-precision copy is recomputed from the master, the
 * accumulator and every contribution of the pending step are dropped. With no
 * job open, st->spec's job is opened first; otherwise st->spec must have the
 * job's hash (ZS_EHASH). st->spec.num_shards and st->shard_id must be the
 * shard's own, and the client state at most CORE_MAX_CLIENT_STATE bytes
 * (ZS_EINVAL). On success the arenas are exchanged, so st holds
 * the shard's previous ones, for the caller to free with core_state_free; on
 * failure the shard is unchanged. The shard then reports (core_checkpoint_origin)
 * that its state is checkpoint `ckpt_step`. */
int core_restore(core *c, core_state *st, uint64_t ckpt_step, char *err, size_t errlen);

/* 1 if the shard's state was last replaced by core_restore, with *step (may
 * be NULL) the checkpoint's step and *untouched (may be NULL) 1 while no step
 * has been applied since; 0 otherwise. */
int core_checkpoint_origin(core *c, uint64_t *step, int *untouched);

/* Marks the open job's state as possibly behind the cluster at its current
 * version, as a restored checkpoint is: a request for a step beyond
 * version + 1 is then answered ZS_EBEHIND with the hint to restore, not
 * ZS_ESTEP. A replica set's member calls it when it takes over as primary
 * (the primary it replaces may have acknowledged steps it never got). Until
 * the next open, close or restore; nothing when no job is open or the state
 * came from a checkpoint already. */
void core_mark_behind(core *c);

#endif
