/*
 * ckpt_client — the checkpoint calls of libzshard (checkpoint.c), shared with
 * the rest of the library and with the `zshard` CLI, which drives them with a
 * spec hash it learned from the shards (GetInfo) instead of an opened job.
 * Internal: zc_ prefix, not exported by the shared library. It includes the
 * public header only, so that the CLI can use it without internal.h.
 */
#ifndef ZSHARD_CLIENT_CKPT_CLIENT_H
#define ZSHARD_CLIENT_CKPT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "zshard/zshard.h"

/* What one checkpoint took, for the CLI's report. */
typedef struct zc_ckpt_report {
  uint64_t step, optimizer_steps;
  uint64_t bytes;              /* all shard files together */
  double max_snapshot_seconds; /* the longest an apply was held back */
  double max_write_seconds;    /* the slowest shard's write */
  double seconds;              /* the whole two-round checkpoint */
} zc_ckpt_report;

/* The two rounds of a checkpoint (Checkpoint on every shard, then
 * CommitCheckpoint on every shard) for spec hash `hash` at `step` into
 * `dir` (NULL: the state directories). `rep` may be NULL. Returns 0 or the
 * first failure, with the last error set. */
int zc_checkpoint(zs_client *c, uint64_t hash, uint64_t step, const char *dir, zc_ckpt_report *rep);

/* Restores every shard to `step` (0: the newest checkpoint complete and
 * loadable on every shard, then older ones if a shard refuses it) from `dir`
 * (NULL: the state directories); `hash` 0 lets each shard take the
 * checkpoint's own job. *restored (may be NULL) gets the step restored and
 * *changed (may be NULL) whether any shard changed. With `cs` (may be NULL;
 * ZC_MAX_CLIENT_STATE bytes, the caller's) the restored client state goes
 * there, shard 0's or else the first shard's that has one, and its length to
 * *cs_len (0: none). Does not touch the client's step state. */
int zc_restore(zs_client *c, uint64_t hash, uint64_t step, const char *dir, uint64_t *restored,
               int *changed, uint8_t *cs, size_t *cs_len);

/* The newest step complete and loadable on every shard of `dir`, whose
 * checkpoint is of job `hash` when it has this shard count (hash 0: any).
 * ZS_ENOTFOUND (last error set) when there is none. */
int zc_latest_common(zs_client *c, uint64_t hash, const char *dir, uint64_t *step);

/* Called by zs_step after step `step` completed: the periodic checkpoint
 * (zs_client_options.checkpoint_every, rank 0). Records the outcome for
 * zs_last_checkpoint and never fails the step. */
void zc_checkpoint_after_step(zs_client *c, uint64_t step);

/* A sentence for a trainer that found the shards at different versions: the
 * step to resume from, or that there is none. */
void zc_resume_hint(zs_client *c, uint64_t hash, char *buf, size_t len);

#endif
