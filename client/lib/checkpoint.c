/*
 * checkpoint — zs_checkpoint, zs_restore, zs_latest_checkpoint,
 * zs_last_checkpoint and the periodic checkpoint of zs_step (see zshard.h and
 * docs/CHECKPOINTS.md).
 *
 * The client is the coordinator of a checkpoint: it asks every shard to write
 * its file (Checkpoint), and only when every shard has answered with its file
 * (name, size, CRC32C) does it send the whole list to every shard
 * (CommitCheckpoint), each of which then writes the MANIFEST into its own
 * state directory. A shard that dies in the first round leaves files without
 * a manifest, which no shard ever loads; one that dies in the second round
 * leaves the checkpoint complete on some shards only, which zs_restore does
 * not choose (it takes the newest step complete on every shard).
 *
 * All calls go through zc_call_all (the pool, retries on UNAVAILABLE); none
 * holds a lock across a call.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_client.h"
#include "common/base/clock.h"
#include "internal.h"

#define CKPT_DEFAULT_TIMEOUT_MS 600000u

static void free_responses(zs_request *op) {
  for (uint32_t i = 0; i < op->ntasks; i++) {
    if (op->tasks[i].resp) {
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
      op->tasks[i].resp = NULL;
    }
  }
}

static uint64_t ckpt_timeout(const zs_client *c) {
  return c->opt.checkpoint_timeout_ms ? c->opt.checkpoint_timeout_ms : CKPT_DEFAULT_TIMEOUT_MS;
}

/* An op with one call of `method` per shard, all with the same request. */
static zs_request *call_op(zs_client *c, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *resp_desc, uint64_t timeout_ms) {
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op)
    return NULL;
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = method;
    t->msg = req; /* shared: packing only reads it */
    t->resp_desc = resp_desc;
    t->timeout_ms = timeout_ms;
  }
  return op;
}

/* Copies the last error, so that a caller can quote it in its own. */
static void last_error_copy(char *buf, size_t len) {
  snprintf(buf, len, "%s", zs_last_error());
}

/* ---- checkpoint ------------------------------------------------------------ */

int zc_checkpoint(zs_client *c, uint64_t hash, uint64_t step, const char *dir,
                  zc_ckpt_report *rep) {
  char why[ZC_ERR_LEN];
  uint64_t t0 = clock_now_ns();
  Zshard__V1__CheckpointRequest req = ZSHARD__V1__CHECKPOINT_REQUEST__INIT;
  req.spec_hash = hash;
  req.step = step;
  req.dir = (char *)(dir ? dir : "");
  /* The shard waits this long for the version; the write itself is bounded
   * by the call's deadline. */
  req.timeout_ms = c->opt.rpc_timeout_ms;
  zs_request *op =
      call_op(c, ZC_METHOD("Checkpoint"), &req.base, &zshard__v1__checkpoint_response__descriptor,
              ckpt_timeout(c) + c->opt.rpc_timeout_ms);
  if (!op)
    return ZS_ENOMEM;
  Zshard__V1__CheckpointFile **files = NULL;
  zs_request *cop = NULL;
  int rc = zc_call_all(op);
  if (rc != ZS_OK) {
    last_error_copy(why, sizeof why);
    rc = zc_fail(rc,
                 "zs_checkpoint: step %" PRIu64 " was not written on every shard, so nothing "
                 "was committed: %.400s",
                 step, why);
    goto done;
  }
  uint64_t opt_steps = 0, bytes = 0;
  double max_snap = 0, max_write = 0;
  files = calloc(c->nshards, sizeof *files);
  if (!files) {
    rc = zc_fail(ZS_ENOMEM, "zs_checkpoint: out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    const Zshard__V1__CheckpointResponse *r =
        (const Zshard__V1__CheckpointResponse *)op->tasks[i].resp;
    char want[64];
    snprintf(want, sizeof want, "shard-%" PRIu32 "-of-%" PRIu32 ".zsc", i, c->nshards);
    /* The answer is untrusted: it must be this shard's file of this step. */
    if (r->step != step || r->shard_id != i || r->num_shards != c->nshards || !r->file ||
        r->file->shard_id != i || !r->file->name || strcmp(r->file->name, want) != 0 ||
        (i > 0 && r->optimizer_steps != opt_steps)) {
      rc = zc_fail(ZS_EPROTO,
                   "zs_checkpoint: shard %" PRIu32 " (%s) answered Checkpoint of step %" PRIu64
                   " with step %" PRIu64 ", shard %" PRIu32 " of %" PRIu32
                   " and another file or step count than expected; nothing was committed",
                   i, c->addr[i], step, r->step, r->shard_id, r->num_shards);
      goto done;
    }
    opt_steps = r->optimizer_steps;
    bytes += r->file->bytes;
    if (r->snapshot_seconds > max_snap)
      max_snap = r->snapshot_seconds;
    if (r->write_seconds > max_write)
      max_write = r->write_seconds;
    files[i] = r->file;
  }

  Zshard__V1__CommitCheckpointRequest creq = ZSHARD__V1__COMMIT_CHECKPOINT_REQUEST__INIT;
  creq.spec_hash = hash;
  creq.step = step;
  creq.dir = req.dir;
  creq.optimizer_steps = opt_steps;
  creq.n_files = c->nshards;
  creq.files = files;
  cop = call_op(c, ZC_METHOD("CommitCheckpoint"), &creq.base,
                &zshard__v1__commit_checkpoint_response__descriptor, ckpt_timeout(c));
  if (!cop) {
    rc = ZS_ENOMEM;
    goto done;
  }
  rc = zc_call_all(cop);
  if (rc != ZS_OK) {
    last_error_copy(why, sizeof why);
    rc = zc_fail(rc,
                 "zs_checkpoint: step %" PRIu64 " was written but not committed on every shard "
                 "(restores pass it over): %.400s",
                 step, why);
    goto done;
  }
  if (rep) {
    rep->step = step;
    rep->optimizer_steps = opt_steps;
    rep->bytes = bytes;
    rep->max_snapshot_seconds = max_snap;
    rep->max_write_seconds = max_write;
    rep->seconds = (double)(clock_now_ns() - t0) / 1e9;
  }
done:
  if (cop) {
    free_responses(cop);
    zc_op_release(cop);
  }
  free(files); /* the entries point into op's responses */
  free_responses(op);
  zc_op_release(op);
  return rc;
}

/* Records the outcome of a checkpoint attempt for zs_last_checkpoint. */
static void record(zs_client *c, uint64_t step, int rc) {
  pthread_mutex_lock(&c->mu);
  c->ckpt_status = rc;
  if (rc == ZS_OK)
    c->ckpt_step = step;
  else
    snprintf(c->ckpt_err, sizeof c->ckpt_err, "%s", zs_last_error());
  pthread_mutex_unlock(&c->mu);
}

void zc_checkpoint_after_step(zs_client *c, uint64_t step) {
  uint32_t every = c->opt.checkpoint_every;
  if (every == 0 || c->opt.rank != 0 || step % every != 0)
    return;
  /* The step succeeded: a failed checkpoint is reported by
   * zs_last_checkpoint, and the caller's last error stays what it was. */
  char saved[ZC_ERR_LEN];
  last_error_copy(saved, sizeof saved);
  int rc = zc_checkpoint(c, c->hash, step, NULL, NULL);
  record(c, step, rc);
  zc_fail_msg(ZS_OK, saved);
}

int zs_checkpoint(zs_client *c, uint64_t step) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  uint64_t hash = c->hash;
  if (step == 0)
    step = c->step - 1;
  pthread_mutex_unlock(&c->mu);
  if (!opened) {
    zc_client_leave(c);
    return zc_fail(ZS_ENOTOPEN, "zs_checkpoint: the job is not open (call zs_open_job first)");
  }
  rc = zc_checkpoint(c, hash, step, NULL, NULL);
  record(c, step, rc);
  zc_client_leave(c);
  return rc;
}

int zs_last_checkpoint(const zs_client *c, uint64_t *step) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  zs_client *m = (zs_client *)(uintptr_t)c; /* the lock is not part of the value */
  pthread_mutex_lock(&m->mu);
  if (step)
    *step = c->ckpt_step;
  rc = c->ckpt_status;
  if (rc != ZS_OK)
    zc_fail_msg(rc, c->ckpt_err);
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return rc;
}

/* ---- listing ---------------------------------------------------------------- */

/* The candidate steps, newest first, into *out (free()d by the caller). */
static int common_steps(zs_client *c, uint64_t hash, const char *dir, uint64_t **out, size_t *n) {
  *out = NULL;
  *n = 0;
  Zshard__V1__ListCheckpointsRequest req = ZSHARD__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  req.dir = (char *)(dir ? dir : "");
  zs_request *op =
      call_op(c, ZC_METHOD("ListCheckpoints"), &req.base,
              &zshard__v1__list_checkpoints_response__descriptor, c->opt.rpc_timeout_ms);
  if (!op)
    return ZS_ENOMEM;
  int rc = zc_call_all(op);
  if (rc == ZS_OK) {
    const Zshard__V1__ListCheckpointsResponse *r0 =
        (const Zshard__V1__ListCheckpointsResponse *)op->tasks[0].resp;
    uint64_t *v = calloc(r0->n_checkpoints + 1, sizeof *v);
    if (!v) {
      rc = zc_fail(ZS_ENOMEM, "out of memory");
    } else {
      /* A checkpoint written before issue 26 carries the hash with the world
       * size in it (spec_hash_legacy); the job's own spec tells it apart. */
      uint64_t legacy = hash && hash == c->hash ? spec_hash_legacy(&c->sp) : 0;
      /* Shard 0's list, newest first, kept where every shard agrees. */
      for (size_t k = r0->n_checkpoints; k-- > 0;) {
        const Zshard__V1__CheckpointInfo *a = r0->checkpoints[k];
        if (!a->complete || !a->loadable)
          continue;
        /* A checkpoint for this shard count must be of this job; one for
         * another count is checked by the shards when restoring it. */
        if (hash && a->num_shards == c->nshards && a->spec_hash != hash &&
            (legacy == 0 || a->spec_hash != legacy))
          continue;
        int everywhere = 1;
        for (uint32_t i = 1; i < c->nshards && everywhere; i++) {
          const Zshard__V1__ListCheckpointsResponse *ri =
              (const Zshard__V1__ListCheckpointsResponse *)op->tasks[i].resp;
          int found = 0;
          for (size_t q = 0; q < ri->n_checkpoints && !found; q++) {
            const Zshard__V1__CheckpointInfo *b = ri->checkpoints[q];
            found = b->step == a->step && b->complete && b->loadable &&
                    b->num_shards == a->num_shards && b->spec_hash == a->spec_hash;
          }
          everywhere = found;
        }
        if (everywhere)
          v[(*n)++] = a->step;
      }
      *out = v;
    }
  }
  free_responses(op);
  zc_op_release(op);
  return rc;
}

int zc_latest_common(zs_client *c, uint64_t hash, const char *dir, uint64_t *step) {
  uint64_t *v;
  size_t n;
  int rc = common_steps(c, hash, dir, &v, &n);
  if (rc != ZS_OK)
    return rc;
  if (n == 0)
    rc = zc_fail(ZS_ENOTFOUND, "no checkpoint of this job is complete on every shard");
  else
    *step = v[0];
  free(v);
  return rc;
}

int zs_latest_checkpoint(zs_client *c, uint64_t *step) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  uint64_t hash = c->hash;
  pthread_mutex_unlock(&c->mu);
  if (!step)
    rc = zc_fail(ZS_EINVAL, "zs_latest_checkpoint: step is NULL");
  else if (!hash)
    rc = zc_fail(ZS_ENOTOPEN, "zs_latest_checkpoint: call zs_open_job first");
  else
    rc = zc_latest_common(c, hash, NULL, step);
  zc_client_leave(c);
  return rc;
}

void zc_resume_hint(zs_client *c, uint64_t hash, char *buf, size_t len) {
  char saved[ZC_ERR_LEN];
  last_error_copy(saved, sizeof saved);
  uint64_t step = 0;
  int rc = zc_latest_common(c, hash, NULL, &step);
  if (rc == ZS_OK)
    snprintf(buf, len,
             "resume from checkpoint step %" PRIu64 ": call zs_restore(client, %" PRIu64
             ") on every trainer (or run `zshard restore --step %" PRIu64
             "`), then zs_open_job again",
             step, step, step);
  else if (rc == ZS_EUNIMPL)
    snprintf(buf, len, "the shards keep no checkpoints (no --state-dir): the job must start over");
  else
    snprintf(buf, len, "no checkpoint is complete on every shard (%.160s): the job must start over",
             zs_last_error());
  zc_fail_msg(ZS_OK, saved);
}

/* ---- restore ----------------------------------------------------------------- */

/* 1 if `st` says the checkpoint itself is unusable on a shard (damaged,
 * missing, another job), so that an older one may be tried. */
static int checkpoint_problem(int st) {
  return st == ZS_ECRC || st == ZS_EPROTO || st == ZS_ENOTFOUND || st == ZS_EHASH || st == ZS_EIO;
}

int zc_restore(zs_client *c, uint64_t hash, uint64_t step, const char *dir, uint64_t *restored,
               int *changed, uint8_t *cs, size_t *cs_len) {
  if (cs_len)
    *cs_len = 0;
  uint64_t *cand = NULL;
  size_t ncand = 0;
  uint64_t one = step;
  int rc;
  if (step == 0) {
    if ((rc = common_steps(c, hash, dir, &cand, &ncand)) != ZS_OK)
      return rc;
    if (ncand == 0) {
      free(cand);
      return zc_fail(ZS_ENOTFOUND, "zs_restore: no checkpoint of this job is complete on every "
                                   "shard");
    }
  } else {
    cand = &one;
    ncand = 1;
  }
  char tried[ZC_ERR_LEN] = "";
  size_t tl = 0;
  rc = ZS_ENOTFOUND;
  for (size_t k = 0; k < ncand; k++) {
    Zshard__V1__RestoreRequest req = ZSHARD__V1__RESTORE_REQUEST__INIT;
    req.spec_hash = hash;
    req.step = cand[k];
    req.dir = (char *)(dir ? dir : "");
    zs_request *op = call_op(c, ZC_METHOD("Restore"), &req.base,
                             &zshard__v1__restore_response__descriptor, ckpt_timeout(c));
    if (!op) {
      rc = ZS_ENOMEM;
      break;
    }
    rc = zc_call_all(op);
    int retry = 0;
    if (rc == ZS_OK) {
      int any = 0;
      for (uint32_t i = 0; i < c->nshards && rc == ZS_OK; i++) {
        const Zshard__V1__RestoreResponse *r =
            (const Zshard__V1__RestoreResponse *)op->tasks[i].resp;
        if (r->step != cand[k] || r->version != cand[k] || (hash && r->spec_hash != hash))
          rc = zc_fail(ZS_EPROTO,
                       "zs_restore: shard %" PRIu32 " (%s) answered Restore of step %" PRIu64
                       " with step %" PRIu64 ", version %" PRIu64,
                       i, c->addr[i], cand[k], r->step, r->version);
        any |= r->changed;
      }
      if (rc == ZS_OK) {
        if (restored)
          *restored = cand[k];
        if (changed)
          *changed = any;
        for (uint32_t i = 0; cs && cs_len && i < c->nshards && *cs_len == 0; i++) {
          const Zshard__V1__RestoreResponse *r =
              (const Zshard__V1__RestoreResponse *)op->tasks[i].resp;
          if (r->client_state.len > 0 && r->client_state.len <= ZC_MAX_CLIENT_STATE) {
            memcpy(cs, r->client_state.data, r->client_state.len);
            *cs_len = r->client_state.len;
          }
        }
      }
    } else if (step == 0) {
      /* Fall back only when every failure is about the checkpoint itself. */
      retry = 1;
      for (uint32_t i = 0; i < c->nshards; i++)
        if (op->tasks[i].status != ZS_OK && !checkpoint_problem(op->tasks[i].status))
          retry = 0;
      if (retry && tl < sizeof tried - 64) {
        int w = snprintf(tried + tl, sizeof tried - tl, "%sstep %" PRIu64 " (%.180s)",
                         tl ? "; " : "", cand[k], zs_last_error());
        if (w > 0)
          tl += (size_t)w < sizeof tried - tl ? (size_t)w : sizeof tried - tl - 1;
      }
    }
    free_responses(op);
    zc_op_release(op);
    if (!retry)
      break;
  }
  if (rc != ZS_OK && tl > 0)
    rc = zc_fail(rc, "zs_restore: no complete checkpoint could be restored on every shard: %s",
                 tried);
  if (cand != &one)
    free(cand);
  return rc;
}

int zs_restore(zs_client *c, uint64_t step) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  if (c->stepping || c->opening || !c->hash) {
    int stepping = c->stepping || c->opening;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return stepping ? zc_fail(ZS_EINVAL, "zs_restore: zs_step or zs_open_job runs on this client")
                    : zc_fail(ZS_ENOTOPEN, "zs_restore: call zs_open_job first (it may have "
                                           "failed with ZS_EBEHIND)");
  }
  /* Pushes of the old step must not land after the restore (one for the
   * step that follows the checkpoint would count); `stepping` keeps new
   * pushes and steps out meanwhile. */
  c->stepping = 1;
  while (c->inflight_push > 0)
    pthread_cond_wait(&c->cv, &c->mu);
  uint64_t hash = c->hash;
  pthread_mutex_unlock(&c->mu);

  uint64_t restored = 0;
  uint8_t cs[ZC_MAX_CLIENT_STATE];
  size_t cs_len = 0;
  rc = zc_restore(c, hash, step, NULL, &restored, NULL, cs, &cs_len);

  pthread_mutex_lock(&c->mu);
  /* The scaler goes back with the weights; a checkpoint without its state
   * (an older one, or a job stepped without the client's dynamic scaler)
   * leaves it as it is. */
  if (rc == ZS_OK && c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    zc_scaler_decode(&c->scaler, cs, cs_len);
  if (rc == ZS_OK && c->opened) {
    c->step = restored + 1;
    memset(c->pushed, 0, ((size_t)c->sp.num_tensors * c->sp.grad_accum + 7) / 8);
    c->step_error = ZS_OK;
    c->step_err[0] = '\0';
    /* Prefetched parameters belong to the old timeline; a version number of
     * none makes them unmatchable (a prefetch in flight lands there too). */
    if (c->slots) {
      for (uint32_t t = 0; t < c->sp.num_tensors; t++) {
        if (c->slots[t].state == ZC_SLOT_READY)
          c->slots[t].state = ZC_SLOT_EMPTY;
        c->slots[t].version = UINT64_MAX;
      }
    }
    c->mark_ns = clock_now_ns();
    c->push_ns = c->pull_ns = 0;
    c->bytes_pushed = c->bytes_pulled = 0;
  }
  c->stepping = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}
