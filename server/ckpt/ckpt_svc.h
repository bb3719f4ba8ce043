/*
 * ckpt_svc — a shard server's checkpoint service: the state directory and one
 * thread of its own that snapshots, writes, commits, restores and loads
 * checkpoints (ckpt.h) for the shard core, so that none of that work runs on
 * a transport thread.
 *
 * The asynchronous calls follow core.h's contract: CORE_PENDING and the
 * callback runs exactly once later, on the service thread; or a negative
 * zs_status with a sentence in err and the callback never runs. Callbacks must
 * not block and must not call back into the service.
 *
 * Who commits: a checkpoint is two rounds driven by one client (zs_checkpoint,
 * `zshard checkpoint`). Checkpoint makes every shard write and fsync its own
 * file; once all answered, CommitCheckpoint hands every shard the list of all
 * files (name, size, CRC32C) and each writes the MANIFEST into its own step
 * directory. Shards sharing one directory write identical manifests (rename
 * makes the last one win, with the same bytes); shards on separate volumes
 * each get theirs. A shard restarting loads the newest step its directory
 * holds a valid MANIFEST for.
 */
#ifndef ZSHARD_SERVER_CKPT_SVC_H
#define ZSHARD_SERVER_CKPT_SVC_H

#include <stddef.h>
#include <stdint.h>

#include "server/ckpt/ckpt.h"
#include "server/core/core.h"

typedef struct ckpt_svc ckpt_svc;

/* Bounds on what a caller (the network) can make a shard hold:
 *  - CKPT_SVC_MAX_JOBS checkpoint, commit and restore requests queued,
 *    waiting for their step or running; more are ZS_ELIMIT.
 *  - A checkpoint of a step more than CKPT_SVC_MAX_AHEAD beyond the shard's
 *    version is ZS_ESTEP at once. One of a step within reach waits for it
 *    in the core, not on the service thread, so later requests (a real
 *    Checkpoint, a Restore) are served meanwhile.
 *  - CKPT_SVC_MAX_UNCOMMITTED files written and not committed: writing one
 *    more removes the oldest such checkpoint (when still without a
 *    MANIFEST), in whichever subdirectory it is. */
#define CKPT_SVC_MAX_JOBS 16u
#define CKPT_SVC_MAX_AHEAD 2u
#define CKPT_SVC_MAX_UNCOMMITTED 2u

typedef struct ckpt_svc_config {
  const char *state_dir; /* copied; created if missing */
  core *core;            /* borrowed: destroy the service before the core */
  /* Complete checkpoints kept after each commit (older ones, and incomplete
   * ones older than the newest complete one, are removed); 0 keeps
   * everything complete. */
  uint32_t keep;
} ckpt_svc_config;

/* Creates the state directory if needed and starts the thread. Reads the test
 * hook ZSHARD_TEST_CKPT_STALL=<step> (see docs/CHECKPOINTS.md). Returns 0 and
 * the service in *out (the caller's, released with ckpt_svc_destroy), or a
 * negative status with a sentence in err. */
int ckpt_svc_create(const ckpt_svc_config *cfg, ckpt_svc **out, char *err, size_t errlen);

/* Cancels a snapshot wait or a write in progress (its temporary file is
 * removed), fails queued work with ZS_ECLOSED (callbacks run before this
 * returns), joins the thread and frees the service. NULL is accepted. */
void ckpt_svc_destroy(ckpt_svc *s);

/* Startup: loads the newest complete checkpoint of the state directory into
 * the core (resharding when it was written with another shard count), falling
 * back to older complete ones, with an error logged for each that cannot be
 * loaded. *loaded is 0 when the directory holds no complete checkpoint (the
 * shard starts empty); an error is returned when it holds some but none
 * loads. Blocking; call it before serving. */
int ckpt_svc_load_latest(ckpt_svc *s, int *loaded, uint64_t *step, char *err, size_t errlen);

typedef struct ckpt_svc_result {
  int status;
  char err[600];
  uint64_t step;
  uint64_t version, optimizer_steps; /* of the shard after the work */
  ckpt_file_info file;               /* checkpoint: the file written */
  double snapshot_seconds;           /* checkpoint: how long an apply was held back */
  double write_seconds;              /* checkpoint: writing and fsyncing the file */
  int changed;                       /* restore: 0 when the shard already held it, untouched */
  uint32_t source_shards;            /* restore: the checkpoint's shard count */
  double restore_seconds;            /* restore: reading, verifying and swapping */
} ckpt_svc_result;

typedef void (*ckpt_svc_cb)(void *arg, const ckpt_svc_result *r);

/* Writes this shard's file of checkpoint `step` (the parameter version
 * `step`; a later step is waited for until deadline_ms). `dir` (NULL or ""
 * for the state directory itself) is a subdirectory accepted by
 * ckpt_valid_subdir. */
int ckpt_svc_checkpoint(ckpt_svc *s, uint64_t hash, uint64_t step, const char *dir,
                        uint64_t deadline_ms, ckpt_svc_cb cb, void *arg, char *err, size_t errlen);

/* Writes the MANIFEST of checkpoint m->step (m is copied): m must list every
 * shard's file, this shard's entry must describe the file on disk, and
 * m->spec_hash must be `hash`, the job's. */
int ckpt_svc_commit(ckpt_svc *s, uint64_t hash, const ckpt_manifest *m, const char *dir,
                    ckpt_svc_cb cb, void *arg, char *err, size_t errlen);

/* Replaces the shard's state by complete checkpoint `step`. `hash` is the
 * job's spec hash for this shard count; 0 accepts the checkpoint's job when
 * the shard has no job or the same one. Restoring the checkpoint the shard
 * already holds, with no step applied since, changes nothing (changed = 0),
 * so that every trainer of a job may ask for the same restore. */
int ckpt_svc_restore(ckpt_svc *s, uint64_t hash, uint64_t step, const char *dir, ckpt_svc_cb cb,
                     void *arg, char *err, size_t errlen);

typedef struct ckpt_svc_entry {
  uint64_t step;
  int complete;        /* a valid MANIFEST */
  uint32_t num_shards; /* the checkpoint's (0 when incomplete) */
  uint64_t spec_hash;  /* the checkpoint's, for its shard count */
  int loadable;        /* complete, and every file this shard would read is present */
} ckpt_svc_entry;

/* The checkpoints of the state directory (or its subdirectory `dir`), oldest
 * first, in *out (free()d by the caller). Reads manifests only: cheap enough
 * for a transport thread. */
int ckpt_svc_list(ckpt_svc *s, const char *dir, ckpt_svc_entry **out, size_t *n, char *err,
                  size_t errlen);

const char *ckpt_svc_state_dir(const ckpt_svc *s);

#endif
