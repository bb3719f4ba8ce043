/*
 * ckpt_svc — the checkpoint service (see ckpt_svc.h).
 *
 * Threads: the service thread runs every job of the queue in order (so a
 * commit never overtakes the write it commits, and two writes never compete
 * for the disk); callers only queue jobs. Inside a job the thread blocks on
 * the core (core_snapshot, core_restore), which hands the work to the core's
 * worker and is therefore ordered with the applies.
 *
 * Locks: svc.mu guards the queue, the stop flag and the record of files
 * written; it is a leaf, never held while calling the core, the file system
 * or a callback. The cancel flag is atomic: destroy sets it to stop a write
 * or a stalled write between blocks.
 */
#include "server/ckpt/ckpt_svc.h"
#include "common/base/status.h"
#include "server/ckpt/ckpt_format.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/log.h"

#define SVC_RECENT 8 /* files written remembered, for the commit's check */

typedef enum job_kind { JOB_CHECKPOINT, JOB_WRITE, JOB_COMMIT, JOB_RESTORE } job_kind;

/* A checkpoint is two jobs of the queue: JOB_CHECKPOINT registers the
 * snapshot with the core (core_snapshot_async) and lets the thread go; the
 * snapshot's end turns the same job into JOB_WRITE, queued first, which
 * writes the copy. A checkpoint of a step not yet reached therefore holds
 * no thread while it waits, only its place in the count of jobs. */
typedef struct job {
  struct job *next;
  job_kind kind;
  uint64_t hash, step, deadline_ms;
  char root[CKPT_PATH_MAX];
  ckpt_manifest manifest; /* commit: owned copy */
  ckpt_svc_cb cb;
  void *arg;
  struct ckpt_svc *svc;
  core_state st;           /* checkpoint: the copy (allocated by then, or by the snapshot) */
  int snap_status;         /* write: the snapshot's outcome */
  double snapshot_seconds; /* write */
  char err[600];           /* write: the snapshot's sentence */
} job;

/* A file this process wrote and nobody committed yet (a ring, oldest
 * first): the oldest is removed when a new one would exceed it, so that
 * abandoned checkpoints (a client that never commits, or writes every one
 * into a new directory) cannot fill the disk. */
typedef struct pending_file {
  char root[CKPT_PATH_MAX];
  uint64_t step;
} pending_file;

typedef struct recent_file {
  char root[CKPT_PATH_MAX];
  uint64_t step;
  ckpt_file_info info;
} recent_file;

struct ckpt_svc {
  char *dir;
  core *core;
  uint32_t keep;
  ckpt_write_opts wopts;
  atomic_int cancel;

  pthread_mutex_t mu;
  pthread_cond_t cv;
  job *head, *tail; /* (mu) */
  int stop;         /* (mu) */
  pthread_t thread;
  int started;
  recent_file recent[SVC_RECENT]; /* (mu) ring */
  unsigned nrecent;               /* (mu) */
  uint32_t njobs;                 /* (mu) queued, waiting for a snapshot or running */
  uint32_t parked;                /* (mu) checkpoints waiting for their snapshot */
  /* Service thread only. */
  pending_file uncommitted[CKPT_SVC_MAX_UNCOMMITTED];
  uint32_t nuncommitted;
  /* The root the shard's state was last loaded or restored from, for the
   * "already restored" check (service thread only). */
  char loaded_root[CKPT_PATH_MAX];
  int confined; /* ckpt_fs_confine(dir) holds a reference */
};

const char *ckpt_svc_state_dir(const ckpt_svc *s) {
  return s->dir;
}

/* The checkpoint root for a request: the state directory or a checked
 * subdirectory of it. */
static int resolve_root(const ckpt_svc *s, const char *dir, char *out, size_t len, char *err,
                        size_t errlen) {
  int n;
  if (!dir || !*dir) {
    n = snprintf(out, len, "%s", s->dir);
  } else {
    if (!ckpt_valid_subdir(dir))
      return status_fail(err, errlen, ZS_EINVAL,
                         "checkpoint directory \"%.64s\" is not a relative path of [A-Za-z0-9._-] "
                         "components below the state directory",
                         dir);
    n = snprintf(out, len, "%s/%s", s->dir, dir);
  }
  return n < 0 || (size_t)n >= len ? status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long")
                                   : 0;
}

/* ------------------------------------------------------------------ jobs */

static int run_checkpoint(ckpt_svc *s, job *j, ckpt_svc_result *r);
static void run_commit(ckpt_svc *s, job *j, ckpt_svc_result *r);
static void run_restore(ckpt_svc *s, job *j, ckpt_svc_result *r);

static void job_free(job *j) {
  ckpt_manifest_free(&j->manifest);
  core_state_free(&j->st);
  free(j);
}

static int run_write(ckpt_svc *s, job *j, ckpt_svc_result *r);

/* A job about to be answered no longer counts against CKPT_SVC_MAX_JOBS:
 * uncounted before its callback runs, so that whoever the answer wakes may
 * queue the next request at once. */
static void job_uncount(ckpt_svc *s) {
  pthread_mutex_lock(&s->mu);
  s->njobs--;
  pthread_mutex_unlock(&s->mu);
}

static void *svc_main(void *arg) {
  ckpt_svc *s = arg;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    /* A parked snapshot comes back as a write, even when stopping (it is
     * then answered ZS_ECLOSED): the thread stays until none is out. */
    while (!s->head && (!s->stop || s->parked > 0))
      pthread_cond_wait(&s->cv, &s->mu);
    job *j = s->head;
    if (j) {
      s->head = j->next;
      if (!s->head)
        s->tail = NULL;
    }
    int stop = s->stop;
    pthread_mutex_unlock(&s->mu);
    if (!j)
      break;
    ckpt_svc_result *r = calloc(1, sizeof *r);
    if (!r) {
      ckpt_svc_result oom = {.status = ZS_ENOMEM, .step = j->step};
      snprintf(oom.err, sizeof oom.err, "out of memory");
      job_uncount(s);
      j->cb(j->arg, &oom);
      job_free(j);
      continue;
    }
    r->step = j->step;
    if (stop) {
      r->status = ZS_ECLOSED;
      snprintf(r->err, sizeof r->err, "the shard is shutting down");
    } else if (j->kind == JOB_CHECKPOINT) {
      if (run_checkpoint(s, j, r) == CORE_PENDING) {
        free(r); /* parked: the snapshot's end queues the write */
        continue;
      }
    } else if (j->kind == JOB_WRITE) {
      run_write(s, j, r);
    } else if (j->kind == JOB_COMMIT) {
      run_commit(s, j, r);
    } else {
      run_restore(s, j, r);
    }
    job_uncount(s);
    j->cb(j->arg, r);
    free(r);
    job_free(j);
  }
  return NULL;
}

static int enqueue(ckpt_svc *s, job *j, char *err, size_t errlen) {
  pthread_mutex_lock(&s->mu);
  int stop = s->stop, full = s->njobs >= CKPT_SVC_MAX_JOBS;
  uint32_t njobs = s->njobs;
  if (!stop && !full) {
    j->next = NULL;
    if (s->tail)
      s->tail->next = j;
    else
      s->head = j;
    s->tail = j;
    s->njobs++;
    pthread_cond_signal(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  if (stop || full) {
    job_free(j);
    return stop ? status_fail(err, errlen, ZS_ECLOSED, "the shard is shutting down")
                : status_fail(err, errlen, ZS_ELIMIT,
                              "%u checkpoint, commit and restore requests are already queued or "
                              "waiting on this shard (at most %u); retry once they are answered",
                              njobs, CKPT_SVC_MAX_JOBS);
  }
  return CORE_PENDING;
}

static job *job_new(ckpt_svc *s, job_kind kind, uint64_t hash, uint64_t step, const char *dir,
                    ckpt_svc_cb cb, void *arg, char *err, size_t errlen, int *rc) {
  job *j = calloc(1, sizeof *j);
  if (!j) {
    *rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
    return NULL;
  }
  if ((*rc = resolve_root(s, dir, j->root, sizeof j->root, err, errlen)) != 0) {
    free(j);
    return NULL;
  }
  j->kind = kind;
  j->hash = hash;
  j->step = step;
  j->cb = cb;
  j->arg = arg;
  j->svc = s;
  return j;
}

int ckpt_svc_checkpoint(ckpt_svc *s, uint64_t hash, uint64_t step, const char *dir,
                        uint64_t deadline_ms, ckpt_svc_cb cb, void *arg, char *err, size_t errlen) {
  int rc;
  /* A step far beyond the job's would wait for applies that may never come
   * (the attack: three checkpoints of step 1e9, then gone). */
  core_info info;
  core_get_info(s->core, &info);
  if (info.has_job && step > info.version && step - info.version > CKPT_SVC_MAX_AHEAD)
    return status_fail(err, errlen, ZS_ESTEP,
                       "checkpoint of step %" PRIu64 " is %" PRIu64
                       " steps ahead of shard %u's version %" PRIu64
                       "; a checkpoint may wait for at most %u steps",
                       step, step - info.version, info.shard_id, info.version, CKPT_SVC_MAX_AHEAD);
  job *j = job_new(s, JOB_CHECKPOINT, hash, step, dir, cb, arg, err, errlen, &rc);
  if (!j)
    return rc;
  j->deadline_ms = deadline_ms;
  return enqueue(s, j, err, errlen);
}

int ckpt_svc_commit(ckpt_svc *s, uint64_t hash, const ckpt_manifest *m, const char *dir,
                    ckpt_svc_cb cb, void *arg, char *err, size_t errlen) {
  if (!m || m->num_shards == 0 || m->num_shards > SPEC_MAX_SHARDS || !m->files)
    return status_fail(err, errlen, ZS_EINVAL, "a commit lists 1..%u shard files", SPEC_MAX_SHARDS);
  int rc;
  job *j = job_new(s, JOB_COMMIT, hash, m->step, dir, cb, arg, err, errlen, &rc);
  if (!j)
    return rc;
  j->manifest = *m;
  j->manifest.files = malloc((size_t)m->num_shards * sizeof *m->files);
  if (!j->manifest.files) {
    free(j);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  }
  memcpy(j->manifest.files, m->files, (size_t)m->num_shards * sizeof *m->files);
  return enqueue(s, j, err, errlen);
}

int ckpt_svc_restore(ckpt_svc *s, uint64_t hash, uint64_t step, const char *dir, ckpt_svc_cb cb,
                     void *arg, char *err, size_t errlen) {
  int rc;
  job *j = job_new(s, JOB_RESTORE, hash, step, dir, cb, arg, err, errlen, &rc);
  if (!j)
    return rc;
  return enqueue(s, j, err, errlen);
}

/* ------------------------------------------------------------------ work */

/* Allocates the copy: its memory (zeroed) before the snapshot, so that the
 * time an apply is held back is the memcpy alone, when the step is the
 * shard's; else inside the snapshot, so that a checkpoint waiting for a
 * later step holds no memory. */
static int job_alloc_copy(job *j, const spec *sp, uint32_t shard_id, char *err, size_t errlen) {
  int rc = core_state_init(&j->st, sp, shard_id, err, errlen);
  if (rc != 0)
    return rc;
  j->st.client_state = malloc(CORE_MAX_CLIENT_STATE);
  j->st.tensor_steps = calloc((size_t)sp->num_tensors + 1, sizeof *j->st.tensor_steps);
  if (!j->st.client_state || !j->st.tensor_steps) {
    core_state_free(&j->st);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  }
  return 0;
}

static int copy_view(void *arg, const core_view *v) {
  job *j = arg;
  core_state *st = &j->st;
  if (!st->spec.job && job_alloc_copy(j, v->spec, v->shard_id, j->err, sizeof j->err) != 0)
    return ZS_ENOMEM;
  /* The state was sized from the same spec; a mismatch means the job changed
   * under us, which core_open does not allow. */
  if (st->nelems != v->nelems || !st->m != !v->m || !st->v != !v->v)
    return ZS_EINTERNAL;
  size_t bytes = (size_t)v->nelems * sizeof(float);
  if (bytes) {
    memcpy(st->master, v->master, bytes);
    if (v->m)
      memcpy(st->m, v->m, bytes);
    if (v->v)
      memcpy(st->v, v->v, bytes);
  }
  /* client_state has room for the largest one (job_alloc_copy). */
  if (v->client_state_len > CORE_MAX_CLIENT_STATE)
    return ZS_EINTERNAL;
  if (v->client_state_len > 0)
    memcpy(st->client_state, v->client_state, v->client_state_len);
  st->client_state_len = v->client_state_len;
  if (v->members) {
    /* The log is copied here, inside the snapshot: at most
     * CORE_MEMBER_LOG_MAX entries. */
    core_member_state *ms = malloc(sizeof *ms);
    core_member_log_entry *log = malloc((size_t)v->members->log_n * sizeof *log + 1);
    if (!ms || !log) {
      free(ms);
      free(log);
      return ZS_ENOMEM;
    }
    *ms = *v->members;
    if (ms->log_n > 0)
      memcpy(log, v->members->log, (size_t)ms->log_n * sizeof *log);
    ms->log = log;
    /* The view's plans are the core's; a checkpoint does not record them. */
    ms->join_at = ms->leave_at = NULL;
    ms->nplan = 0;
    if (st->members)
      free((void *)st->members->log);
    free(st->members);
    st->members = ms;
  }
  st->version = v->version;
  st->optimizer_steps = v->optimizer_steps;
  for (uint32_t t = 0; t < st->spec.num_tensors; t++)
    st->tensor_steps[t] = v->tensor_steps ? v->tensor_steps[t] : v->optimizer_steps;
  return 0;
}

/* The snapshot's end (on the core's worker, or on the thread that cancelled
 * it): the job comes back first in the queue, as a write. */
static void on_snapshot_done(void *arg, int status, double seconds) {
  job *j = arg;
  ckpt_svc *s = j->svc;
  j->kind = JOB_WRITE;
  j->snap_status = status;
  j->snapshot_seconds = seconds;
  if (status == ZS_EINTERNAL)
    snprintf(j->err, sizeof j->err, "the shard's arenas changed size during the snapshot");
  else if (status != 0 && status != ZS_ENOMEM)
    snprintf(j->err, sizeof j->err, "snapshot of version %" PRIu64 ": %s", j->step,
             status == ZS_ETIMEDOUT ? "deadline passed before the version was reached"
             : status == ZS_ESTEP   ? "the shard moved past that version"
             : status == ZS_ECLOSED ? "the shard is shutting down"
                                    : "cancelled");
  pthread_mutex_lock(&s->mu);
  s->parked--;
  j->next = s->head;
  s->head = j;
  if (!s->tail)
    s->tail = j;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Registers the snapshot; CORE_PENDING when it is (the job is then the
 * snapshot's until on_snapshot_done), else the outcome in r. */
static int run_checkpoint(ckpt_svc *s, job *j, ckpt_svc_result *r) {
  /* A copy: the core's spec may be freed by a close and an open meanwhile. */
  spec sp;
  uint64_t hash = 0;
  core_info info;
  core_get_info(s->core, &info);
  if (core_spec_copy(s->core, &sp, &hash) != 0)
    return r->status = status_fail(r->err, sizeof r->err, ZS_ENOTOPEN,
                                   "shard %u has no job to checkpoint", info.shard_id);
  if (j->hash != hash) {
    spec_free(&sp);
    return r->status = status_fail(r->err, sizeof r->err, ZS_EHASH,
                                   "checkpoint request for spec hash %016" PRIx64
                                   " but the job's is %016" PRIx64,
                                   j->hash, hash);
  }
  if (j->step <= info.version)
    r->status = job_alloc_copy(j, &sp, info.shard_id, r->err, sizeof r->err);
  spec_free(&sp);
  if (j->step <= info.version && r->status != 0)
    return r->status;
  pthread_mutex_lock(&s->mu);
  s->parked++;
  pthread_mutex_unlock(&s->mu);
  int rc = core_snapshot_async(s->core, j->hash, j->step, j->deadline_ms, copy_view, j,
                               on_snapshot_done, j, r->err, sizeof r->err);
  if (rc == CORE_PENDING && j->step > info.version)
    LOG_INFO("checkpoint_waiting", "step=%" PRIu64 " version=%" PRIu64 " dir=%s", j->step,
             info.version, j->root);
  if (rc != CORE_PENDING) {
    pthread_mutex_lock(&s->mu);
    s->parked--;
    pthread_mutex_unlock(&s->mu);
    r->status = rc;
  }
  return rc;
}

/* Keeps the record of files written and not committed within
 * CKPT_SVC_MAX_UNCOMMITTED by removing the oldest (when still without a
 * MANIFEST). Service thread only. */
static void note_uncommitted(ckpt_svc *s, const char *root, uint64_t step) {
  for (uint32_t i = 0; i < s->nuncommitted; i++)
    if (s->uncommitted[i].step == step && strcmp(s->uncommitted[i].root, root) == 0)
      return; /* written again */
  if (s->nuncommitted == CKPT_SVC_MAX_UNCOMMITTED) {
    pending_file *old = &s->uncommitted[0];
    ckpt_manifest m;
    char err[512];
    if (ckpt_manifest_read(old->root, old->step, &m, NULL, 0) == 0) {
      ckpt_manifest_free(&m); /* committed by another shard's client meanwhile */
    } else if (ckpt_remove(old->root, old->step, err, sizeof err) != 0) {
      LOG_WARN("checkpoint_abandoned_remove_failed", "dir=%s step=%" PRIu64 " detail=\"%s\"",
               old->root, old->step, err);
    } else {
      LOG_WARN("checkpoint_abandoned_removed",
               "dir=%s step=%" PRIu64 " limit=%u detail=\"written but never committed\"", old->root,
               old->step, CKPT_SVC_MAX_UNCOMMITTED);
    }
    memmove(&s->uncommitted[0], &s->uncommitted[1],
            (CKPT_SVC_MAX_UNCOMMITTED - 1) * sizeof s->uncommitted[0]);
    s->nuncommitted--;
  }
  pending_file *p = &s->uncommitted[s->nuncommitted++];
  snprintf(p->root, sizeof p->root, "%s", root);
  p->step = step;
}

static void forget_uncommitted(ckpt_svc *s, const char *root, uint64_t step) {
  for (uint32_t i = 0; i < s->nuncommitted; i++) {
    if (s->uncommitted[i].step == step && strcmp(s->uncommitted[i].root, root) == 0) {
      memmove(&s->uncommitted[i], &s->uncommitted[i + 1],
              (s->nuncommitted - i - 1) * sizeof s->uncommitted[0]);
      s->nuncommitted--;
      return;
    }
  }
}

/* Writes the copy the snapshot made. */
static int run_write(ckpt_svc *s, job *j, ckpt_svc_result *r) {
  r->snapshot_seconds = j->snapshot_seconds;
  if ((r->status = j->snap_status) != 0) {
    snprintf(r->err, sizeof r->err, "%s", j->err);
    return r->status;
  }
  core_state *st = &j->st;
  uint64_t t0 = clock_now_ns();
  r->status = ckpt_write_shard(j->root, st, &s->wopts, &r->file, r->err, sizeof r->err);
  r->write_seconds = (double)(clock_now_ns() - t0) / 1e9;
  if (r->status != 0) {
    LOG_ERROR("checkpoint_failed", "step=%" PRIu64 " error=%s detail=\"%s\"", j->step,
              zs_err_name(r->status), r->err);
    return r->status;
  }
  note_uncommitted(s, j->root, j->step);
  r->version = st->version;
  r->optimizer_steps = st->optimizer_steps;
  pthread_mutex_lock(&s->mu);
  recent_file *rf = &s->recent[s->nrecent++ % SVC_RECENT];
  snprintf(rf->root, sizeof rf->root, "%s", j->root);
  rf->step = j->step;
  rf->info = r->file;
  pthread_mutex_unlock(&s->mu);
  LOG_INFO("checkpoint_written",
           "step=%" PRIu64 " dir=%s file=%s bytes=%" PRIu64 " crc32c=%08" PRIx32
           " snapshot_seconds=%.6f write_seconds=%.6f",
           j->step, j->root, r->file.name, r->file.bytes, r->file.crc32c, r->snapshot_seconds,
           r->write_seconds);
  return 0;
}

/* The CRC32C of a whole file, read in blocks. */
static int file_crc(const char *path, uint64_t *size, uint32_t *crc, char *err, size_t errlen) {
  int fd = -1;
  int orc = ckpt__open_read(path, &fd, err, errlen);
  if (orc != 0)
    return orc;
  size_t cap = (size_t)1 << 20;
  uint8_t *buf = malloc(cap);
  int rc = buf ? 0 : status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  uint32_t c = 0;
  uint64_t total = 0;
  while (rc == 0) {
    ssize_t n = read(fd, buf, cap);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot read %s: %s", path, strerror(errno));
    if (n <= 0)
      break;
    c = crc32c(c, buf, (size_t)n);
    total += (uint64_t)n;
  }
  free(buf);
  close(fd);
  *size = total;
  *crc = c;
  return rc;
}

/* Removes what retention no longer keeps (after a commit). */
static void apply_retention(ckpt_svc *s, const char *root) {
  if (s->keep == 0)
    return;
  ckpt_entry *e = NULL;
  size_t n = 0;
  char err[512];
  if (ckpt_list(root, &e, &n, err, sizeof err) != 0) {
    LOG_WARN("checkpoint_retention_failed", "dir=%s detail=\"%s\"", root, err);
    return;
  }
  size_t complete = 0, oldest_kept = n, newest = n;
  for (size_t i = n; i-- > 0;) {
    if (e[i].complete && newest == n)
      newest = i;
    if (e[i].complete && complete < s->keep) {
      complete++;
      oldest_kept = i;
    }
  }
  /* An incomplete checkpoint older than the newest complete one was
   * abandoned (the client moved on and committed a later one): it counts
   * toward keep like any other, so it goes now rather than when keep
   * complete ones have piled up. Newer incomplete ones may be commits in
   * progress and stay. */
  for (size_t i = 0; i < newest && newest < n; i++) {
    if (e[i].complete || (complete == s->keep && i < oldest_kept))
      continue;
    if (ckpt_remove(root, e[i].step, err, sizeof err) == 0)
      LOG_INFO("checkpoint_removed", "dir=%s step=%" PRIu64 " keep=%u reason=abandoned", root,
               e[i].step, s->keep);
  }
  if (complete == s->keep) {
    for (size_t i = 0; i < oldest_kept; i++) {
      if (ckpt_remove(root, e[i].step, err, sizeof err) != 0)
        LOG_WARN("checkpoint_retention_failed", "dir=%s step=%" PRIu64 " detail=\"%s\"", root,
                 e[i].step, err);
      else
        LOG_INFO("checkpoint_removed", "dir=%s step=%" PRIu64 " keep=%u", root, e[i].step, s->keep);
    }
  }
  free(e);
}

static void run_commit(ckpt_svc *s, job *j, ckpt_svc_result *r) {
  ckpt_manifest *m = &j->manifest;
  core_info info;
  core_get_info(s->core, &info);
  if (!info.has_job || j->hash != info.spec_hash || m->spec_hash != info.spec_hash) {
    r->status = status_fail(r->err, sizeof r->err, ZS_EHASH,
                            "commit of checkpoint step %" PRIu64 " for spec hash %016" PRIx64
                            " but the job's is %016" PRIx64,
                            m->step, m->spec_hash, info.spec_hash);
    return;
  }
  if (m->num_shards != info.num_shards) {
    r->status = status_fail(r->err, sizeof r->err, ZS_EINVAL,
                            "commit lists %u shard files, the job has %u shards", m->num_shards,
                            info.num_shards);
    return;
  }
  /* This shard vouches for its own entry: the file on disk must be the one
   * the entry describes. */
  const ckpt_file_info *mine = &m->files[info.shard_id];
  char want[CKPT_NAME_MAX], dir[CKPT_PATH_MAX], path[CKPT_PATH_MAX];
  ckpt_file_name(info.shard_id, info.num_shards, want, sizeof want);
  if (mine->shard_id != info.shard_id || strcmp(mine->name, want) != 0) {
    r->status = status_fail(r->err, sizeof r->err, ZS_EINVAL, "commit entry %u names %.64s, not %s",
                            info.shard_id, mine->name, want);
    return;
  }
  if (ckpt_step_dir(j->root, m->step, dir, sizeof dir) != 0 ||
      snprintf(path, sizeof path, "%s/%s", dir, want) >= (int)sizeof path) {
    r->status = status_fail(r->err, sizeof r->err, ZS_EINVAL, "checkpoint path too long");
    return;
  }
  int known = 0;
  pthread_mutex_lock(&s->mu);
  for (unsigned i = 0; i < SVC_RECENT && i < s->nrecent; i++) {
    const recent_file *rf = &s->recent[i];
    if (rf->step == m->step && strcmp(rf->root, j->root) == 0 && strcmp(rf->info.name, want) == 0)
      known = rf->info.bytes == mine->bytes && rf->info.crc32c == mine->crc32c ? 1 : -1;
  }
  pthread_mutex_unlock(&s->mu);
  struct stat sb;
  int st = ckpt__fs_lstat(path, &sb);
  if (st != 0 || !S_ISREG(sb.st_mode)) {
    const char *why = st != 0               ? ckpt__fs_strerror(errno)
                      : S_ISLNK(sb.st_mode) ? ckpt__fs_strerror(ELOOP)
                                            : "not a regular file";
    r->status =
        status_fail(r->err, sizeof r->err,
                    st != 0               ? ckpt__fs_status(errno)
                    : S_ISLNK(sb.st_mode) ? ZS_EPERM
                                          : ZS_ENOTFOUND,
                    "cannot commit checkpoint step %" PRIu64 ": %s: %s", m->step, path, why);
    return;
  }
  if (known <= 0) {
    /* Not written by this process (or written again since): read it back. */
    uint64_t size = 0;
    uint32_t crc = 0;
    if ((r->status = file_crc(path, &size, &crc, r->err, sizeof r->err)) != 0)
      return;
    if (size != mine->bytes || crc != mine->crc32c) {
      r->status =
          status_fail(r->err, sizeof r->err, ZS_ECRC,
                      "cannot commit checkpoint step %" PRIu64 ": %s has %" PRIu64
                      " bytes and CRC32C %08" PRIx32 ", the commit says %" PRIu64 " and %08" PRIx32,
                      m->step, path, size, crc, mine->bytes, mine->crc32c);
      return;
    }
  } else if ((uint64_t)sb.st_size != mine->bytes) {
    r->status = status_fail(r->err, sizeof r->err, ZS_ECRC, "cannot commit: %s changed size", path);
    return;
  }
  if ((r->status = ckpt_manifest_write(j->root, m, info.shard_id, r->err, sizeof r->err)) != 0) {
    LOG_ERROR("checkpoint_commit_failed", "step=%" PRIu64 " detail=\"%s\"", m->step, r->err);
    return;
  }
  r->version = m->version;
  r->optimizer_steps = m->optimizer_steps;
  LOG_INFO("checkpoint_committed", "step=%" PRIu64 " dir=%s shards=%u", m->step, j->root,
           m->num_shards);
  forget_uncommitted(s, j->root, m->step);
  apply_retention(s, j->root);
}

/* Loads checkpoint `step` of root and swaps it into the core. */
static int restore_from(ckpt_svc *s, const char *root, uint64_t step, uint64_t hash,
                        ckpt_svc_result *r) {
  core_info info;
  core_get_info(s->core, &info);
  core_state st;
  uint64_t t0 = clock_now_ns();
  int rc = ckpt_load(root, step, info.shard_id, info.num_shards, &st, r->err, sizeof r->err);
  if (rc != 0)
    return rc;
  uint64_t h = spec_hash(&st.spec);
  if (hash != 0 && h != hash) {
    rc =
        status_fail(r->err, sizeof r->err, ZS_EHASH,
                    "checkpoint step %" PRIu64 " in %s is of job '%.64s' with spec hash %016" PRIx64
                    " (for %u shards); the request's job has hash %016" PRIx64,
                    step, root, st.spec.job, h, info.num_shards, hash);
    core_state_free(&st);
    return rc;
  }
  ckpt_manifest m;
  r->source_shards = ckpt_manifest_read(root, step, &m, NULL, 0) == 0 ? m.num_shards : 0;
  ckpt_manifest_free(&m);
  clock_test_stall("ZSHARD_TEST_RESTORE_STALL_MS");
  rc = core_restore(s->core, &st, step, r->err, sizeof r->err);
  core_state_free(&st); /* on success, the shard's previous arenas */
  if (rc != 0)
    return rc;
  r->restore_seconds = (double)(clock_now_ns() - t0) / 1e9;
  r->changed = 1;
  snprintf(s->loaded_root, sizeof s->loaded_root, "%s", root);
  core_get_info(s->core, &info);
  r->version = info.version;
  return 0;
}

static void run_restore(ckpt_svc *s, job *j, ckpt_svc_result *r) {
  core_info info;
  core_get_info(s->core, &info);
  if (j->hash != 0 && info.has_job && info.spec_hash != j->hash) {
    r->status =
        status_fail(r->err, sizeof r->err, ZS_EHASH,
                    "restore for spec hash %016" PRIx64 " but the shard's job has %016" PRIx64,
                    j->hash, info.spec_hash);
    return;
  }
  uint64_t ck = 0;
  int untouched = 0;
  if (info.has_job && core_checkpoint_origin(s->core, &ck, &untouched) && untouched &&
      ck == j->step && info.version == j->step && strcmp(s->loaded_root, j->root) == 0) {
    /* Every trainer of the job may ask for the restore that one of them
     * already made; contributions to the next step are kept. */
    r->status = 0;
    r->changed = 0;
    r->version = info.version;
    LOG_INFO("checkpoint_restore_skipped", "step=%" PRIu64 " reason=already_holds_it", j->step);
    return;
  }
  r->status = restore_from(s, j->root, j->step, j->hash, r);
  if (r->status != 0) {
    LOG_ERROR("checkpoint_restore_failed", "step=%" PRIu64 " dir=%s error=%s detail=\"%s\"",
              j->step, j->root, zs_err_name(r->status), r->err);
    return;
  }
  LOG_INFO("checkpoint_restored", "step=%" PRIu64 " dir=%s source_shards=%u shards=%u seconds=%.3f",
           j->step, j->root, r->source_shards, info.num_shards, r->restore_seconds);
}

/* ------------------------------------------------------------------ startup */

int ckpt_svc_load_latest(ckpt_svc *s, int *loaded, uint64_t *step, char *err, size_t errlen) {
  *loaded = 0;
  *step = 0;
  ckpt_entry *e = NULL;
  size_t n = 0;
  int rc = ckpt_list(s->dir, &e, &n, err, errlen);
  if (rc != 0)
    return rc;
  size_t complete = 0;
  char last_err[600] = "";
  for (size_t i = n; i-- > 0;) {
    if (!e[i].complete) {
      LOG_INFO("checkpoint_incomplete_ignored", "dir=%s step=%" PRIu64, s->dir, e[i].step);
      continue;
    }
    complete++;
    ckpt_svc_result r;
    memset(&r, 0, sizeof r);
    rc = restore_from(s, s->dir, e[i].step, 0, &r);
    if (rc == 0) {
      *loaded = 1;
      *step = e[i].step;
      LOG_INFO("checkpoint_loaded",
               "dir=%s step=%" PRIu64 " source_shards=%u version=%" PRIu64 " seconds=%.3f", s->dir,
               e[i].step, r.source_shards, r.version, r.restore_seconds);
      break;
    }
    LOG_ERROR("checkpoint_refused", "dir=%s step=%" PRIu64 " error=%s detail=\"%s\"", s->dir,
              e[i].step, zs_err_name(rc), r.err);
    snprintf(last_err, sizeof last_err, "%s", r.err);
  }
  free(e);
  if (complete > 0 && !*loaded)
    return status_fail(err, errlen, rc ? rc : ZS_EIO,
                       "%s holds %zu complete checkpoint(s) and none loads; the last error: %s",
                       s->dir, complete, last_err);
  if (complete == 0)
    LOG_INFO("checkpoint_none", "dir=%s", s->dir);
  return 0;
}

/* ------------------------------------------------------------------ listing */

int ckpt_svc_list(ckpt_svc *s, const char *dir, ckpt_svc_entry **out, size_t *n, char *err,
                  size_t errlen) {
  *out = NULL;
  *n = 0;
  char root[CKPT_PATH_MAX];
  int rc = resolve_root(s, dir, root, sizeof root, err, errlen);
  if (rc != 0)
    return rc;
  ckpt_entry *e = NULL;
  size_t len = 0;
  if ((rc = ckpt_list(root, &e, &len, err, errlen)) != 0)
    return rc;
  ckpt_svc_entry *v = calloc(len + 1, sizeof *v);
  if (!v) {
    free(e);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  }
  core_info info;
  core_get_info(s->core, &info);
  for (size_t i = 0; i < len; i++) {
    v[i].step = e[i].step;
    v[i].complete = e[i].complete;
    v[i].num_shards = e[i].num_shards;
    v[i].spec_hash = e[i].spec_hash;
    if (!e[i].complete)
      continue;
    /* Own file with the same shard count; every file when resharding. */
    char sdir[CKPT_PATH_MAX];
    if (ckpt_step_dir(root, e[i].step, sdir, sizeof sdir) != 0)
      continue;
    int all = 1;
    for (uint32_t k = 0; k < e[i].num_shards && all; k++) {
      if (e[i].num_shards == info.num_shards && k != info.shard_id)
        continue;
      char name[CKPT_NAME_MAX], path[CKPT_PATH_MAX];
      struct stat sb;
      ckpt_file_name(k, e[i].num_shards, name, sizeof name);
      all = snprintf(path, sizeof path, "%s/%s", sdir, name) < (int)sizeof path &&
            ckpt__fs_lstat(path, &sb) == 0 && S_ISREG(sb.st_mode);
    }
    v[i].loadable = all;
  }
  free(e);
  *out = v;
  *n = len;
  return 0;
}

/* ------------------------------------------------------------------ lifecycle */

int ckpt_svc_create(const ckpt_svc_config *cfg, ckpt_svc **out, char *err, size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->state_dir || !*cfg->state_dir || !cfg->core)
    return status_fail(err, errlen, ZS_EINVAL, "the checkpoint service needs a state directory");
  if (strlen(cfg->state_dir) > CKPT_PATH_MAX - 512)
    return status_fail(err, errlen, ZS_EINVAL, "state directory path too long");
  ckpt_svc *s = calloc(1, sizeof *s);
  if (!s)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  s->dir = strdup(cfg->state_dir);
  /* Trailing slashes would make "<dir>//step-1" and defeat the comparisons
   * of roots. */
  if (s->dir)
    for (size_t l = strlen(s->dir); l > 1 && s->dir[l - 1] == '/'; l--)
      s->dir[l - 1] = '\0';
  s->core = cfg->core;
  s->keep = cfg->keep;
  atomic_init(&s->cancel, 0);
  s->wopts.cancel = &s->cancel;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  int rc;
  if (!s->dir) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
    goto fail;
  }
  const char *stall = getenv("ZSHARD_TEST_CKPT_STALL");
  if (stall && *stall) {
    char *end;
    s->wopts.stall_step = strtoull(stall, &end, 10);
    s->wopts.stall = *end == '\0';
    if (s->wopts.stall)
      LOG_WARN("test_hook",
               "name=ZSHARD_TEST_CKPT_STALL step=%" PRIu64
               " effect=the_checkpoint_of_that_step_stops_half_written",
               s->wopts.stall_step);
  }
  if ((rc = ckpt_mkdirs(s->dir, err, errlen)) != 0)
    goto fail;
  /* Every path a request names lies below the state directory; from here on
   * none of them follows a symbolic link out of it. */
  if ((rc = ckpt_fs_confine(s->dir, err, errlen)) != 0)
    goto fail;
  s->confined = 1;
  if (access(s->dir, W_OK | X_OK) != 0)
    LOG_WARN("state_dir_not_writable", "dir=%s error=\"%s\"", s->dir, strerror(errno));
  if (pthread_create(&s->thread, NULL, svc_main, s) != 0) {
    rc = status_fail(err, errlen, ZS_EINTERNAL, "cannot start the checkpoint thread");
    goto fail;
  }
  s->started = 1;
  *out = s;
  return 0;
fail:
  ckpt_svc_destroy(s);
  return rc;
}

void ckpt_svc_destroy(ckpt_svc *s) {
  if (!s)
    return;
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
  atomic_store(&s->cancel, 1);
  if (s->started) {
    /* A job blocked in core_snapshot waits for a version that may never
     * come; cancelling releases it. It may register just after a cancel, so
     * cancel until the thread is gone. */
    for (;;) {
      core_cancel_snapshots(s->core);
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 20 * 1000 * 1000;
      if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      if (pthread_timedjoin_np(s->thread, NULL, &ts) == 0)
        break;
    }
  }
  /* The thread drained the queue (failing each job with ZS_ECLOSED). */
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  if (s->confined)
    ckpt_fs_release(s->dir);
  free(s->dir);
  free(s);
}
