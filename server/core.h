/*
 * core — the shard core: one job's state on one shard, independent of any
 * transport. A transport parses and validates the envelope of a request and
 * calls in here; the core checks everything that depends on the job (hash,
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

#include "common/layout.h"
#include "common/spec.h"

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
} core_open_result;
int core_open(core *c, const spec *s, core_open_result *out, char *err, size_t errlen);

/* Initial fp32 weights of one piece. Written once while the version is 0; an
 * identical repeat is accepted (written = 0); different data is ZS_EEXIST;
 * after the first applied step the call changes nothing (written = 0). */
int core_init_params(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, const float *data,
                     size_t nbytes, int *written, uint64_t *version, char *err, size_t errlen);

/* One contribution. Only step == version + 1 is added; a well-formed push for
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

/* Copies piece (tensor, slice) in `dtype` into dst (exactly numel * dtype size
 * bytes), consistent with one version, reported in *version. Never blocks on
 * the optimizer longer than one apply. */
int core_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype, void *dst,
              size_t nbytes, uint64_t *version, char *err, size_t errlen);

/* Size in bytes of piece (tensor, slice) in dtype, or a negative status. */
int64_t core_piece_bytes(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype);

/* Gradient statistics of step `step` (== version + 1, or == version for a
 * step already applied, whose statistics are kept). Waits until all W*M
 * contributions of every piece are in and the statistics are computed. On
 * timeout the callback gets ZS_ETIMEDOUT and core_missing() says what is
 * missing. */
typedef struct core_stats_result {
  uint64_t step;
  double sum_squares;
  int nonfinite;
} core_stats_result;
typedef void (*core_stats_cb)(void *arg, int status, const core_stats_result *r);
int core_grad_stats(core *c, uint64_t hash, uint64_t step, uint64_t deadline_ms, core_stats_cb cb,
                    void *arg, core_stats_result *out, char *err, size_t errlen);

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
 * once; different arguments are ZS_EEXIST. */
typedef struct core_apply_result {
  uint64_t step, version;
  int skipped;
  uint64_t optimizer_steps;
} core_apply_result;
typedef void (*core_apply_cb)(void *arg, int status, const core_apply_result *r);
int core_apply(core *c, uint64_t hash, uint64_t step, double lr, float coef, int skip,
               core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen);

typedef struct core_info {
  uint32_t shard_id, num_shards;
  int has_job;
  char job[SPEC_MAX_NAME + 1];
  uint64_t spec_hash, version;
  uint64_t state_bytes;
  uint32_t pieces;
  uint64_t elements;
  int initialized;
} core_info;
void core_get_info(core *c, core_info *out);

typedef struct core_counters {
  uint64_t pushes, duplicate_pushes, rejected, pulls, bytes_in, bytes_out;
  uint64_t applies, skipped_steps, version, held_bytes;
  double apply_seconds_total;
  uint32_t waiting_pulls; /* core_wait_version calls not yet answered */
  uint32_t waiting_stats; /* core_grad_stats calls not yet answered */
} core_counters;
void core_get_counters(core *c, core_counters *out);
/* Counts one pull and the bytes the transport sent for it. core_read does not
 * count, so a transport calls this once per answered pull. */
void core_count_pull(core *c, uint64_t bytes_out);

/* The spec of the open job (NULL without one); valid until core_destroy. */
const spec *core_spec(core *c);
const layout *core_layout(core *c);

#endif
