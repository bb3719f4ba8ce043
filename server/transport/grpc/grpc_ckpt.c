/*
 * grpc_ckpt — the checkpoint methods (Checkpoint, CommitCheckpoint, Restore,
 * ListCheckpoints), run by the checkpoint service (server/ckpt/ckpt_svc.h)
 * and answered after a hop like a core callback.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zshard/v1/zshard.pb-c.h"

/* Runs on the checkpoint service's thread: keeps the outcome and hops back to
 * a polling thread like a core callback. */
static void on_ckpt_done(void *arg, const ckpt_svc_result *r) {
  gcall *c = arg;
  *c->ckpt = *r;
  c->async_status = r->status;
  gsrv__resume_from_core(c);
}

/* What every checkpoint method checks first; answers the call and returns -1
 * when it cannot go on. */
static int ckpt_prepare(gsrv *s, gcall *c) {
  if (!s->ckpt) {
    gsrv__finish_err(c, 0, ZS_EUNIMPL,
                     "checkpoints are off on this shard: start zshard-server with --state-dir DIR");
    return -1;
  }
  c->ckpt = calloc(1, sizeof *c->ckpt);
  if (!c->ckpt) {
    gsrv__finish_err(c, 0, ZS_ENOMEM, "out of memory");
    return -1;
  }
  return 0;
}

/* Queues the work started by `rc` (the service's answer): a pending job
 * answers from on_ckpt_done, anything else at once. */
static void ckpt_started(gcall *c, int rc, const char *err) {
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c); /* the reference meant for the callback */
  gsrv__finish_err(c, 0, rc, err);
}

void gsrv__ckpt_finish(gcall *c, int claimed) {
  const ckpt_svc_result *r = c->ckpt;
  if (r->status != ZS_OK) {
    gsrv__finish_err(c, claimed, r->status, r->err);
    return;
  }
  core_info info;
  service_info(c->s->svc, &info);
  if (c->method == M_CHECKPOINT) {
    Zshard__V1__CheckpointFile file = ZSHARD__V1__CHECKPOINT_FILE__INIT;
    file.shard_id = r->file.shard_id;
    file.name = (char *)r->file.name;
    file.bytes = r->file.bytes;
    file.crc32c = r->file.crc32c;
    Zshard__V1__CheckpointResponse resp = ZSHARD__V1__CHECKPOINT_RESPONSE__INIT;
    resp.step = r->step;
    resp.shard_id = info.shard_id;
    resp.num_shards = info.num_shards;
    resp.file = &file;
    resp.optimizer_steps = r->optimizer_steps;
    resp.snapshot_seconds = r->snapshot_seconds;
    resp.write_seconds = r->write_seconds;
    gsrv__finish_msg(c, claimed, &resp.base);
  } else if (c->method == M_COMMIT_CHECKPOINT) {
    Zshard__V1__CommitCheckpointResponse resp = ZSHARD__V1__COMMIT_CHECKPOINT_RESPONSE__INIT;
    resp.step = r->step;
    gsrv__finish_msg(c, claimed, &resp.base);
  } else {
    /* Before the answer, which forwards the Restore to the backups. */
    replica_on_restored(c->s->rep, (uint64_t)(r->restore_seconds * 1e9));
    uint8_t cs[CORE_MAX_CLIENT_STATE];
    uint64_t cs_version = 0;
    size_t cs_len = service_client_state(c->s->svc, cs, sizeof cs, &cs_version);
    Zshard__V1__RestoreResponse resp = ZSHARD__V1__RESTORE_RESPONSE__INIT;
    resp.step = r->step;
    resp.version = cs_version; /* read with the client state */
    resp.client_state.data = cs;
    resp.client_state.len = cs_len;
    resp.changed = r->changed != 0;
    resp.source_shards = r->source_shards;
    resp.spec_hash = info.spec_hash;
    gsrv__finish_msg(c, claimed, &resp.base);
  }
}

void gsrv__h_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CheckpointRequest *r =
      UNPACK(Zshard__V1__CheckpointRequest, zshard__v1__checkpoint_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.CheckpointRequest");
    return;
  }
  if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c); /* the callback's */
    int rc = ckpt_svc_checkpoint(s->ckpt, r->spec_hash, r->step, r->dir,
                                 gsrv__wait_deadline(c, r->timeout_ms), on_ckpt_done, c, err,
                                 sizeof err);
    ckpt_started(c, rc, err);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

void gsrv__h_commit_checkpoint(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CommitCheckpointRequest *r =
      UNPACK(Zshard__V1__CommitCheckpointRequest, zshard__v1__commit_checkpoint_request__descriptor,
             msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.CommitCheckpointRequest");
    return;
  }
  ckpt_manifest m = {.step = r->step,
                     .version = r->step,
                     .optimizer_steps = r->optimizer_steps,
                     .spec_hash = r->spec_hash,
                     .num_shards = (uint32_t)r->n_files};
  int rc = 0;
  if (r->n_files == 0 || r->n_files > SPEC_MAX_SHARDS) {
    rc = ZS_EINVAL;
    snprintf(err, sizeof err, "a commit lists 1..%u shard files, not %zu", SPEC_MAX_SHARDS,
             r->n_files);
  } else if (!(m.files = calloc(r->n_files, sizeof *m.files))) {
    rc = ZS_ENOMEM;
    snprintf(err, sizeof err, "out of memory");
  }
  for (size_t i = 0; rc == 0 && i < r->n_files; i++) {
    const Zshard__V1__CheckpointFile *f = r->files[i];
    /* Names come from the network: bounded here, checked to be the
     * canonical "shard-<i>-of-<N>.zsc" by the manifest writer. */
    if (f->shard_id != i || strlen(f->name) >= CKPT_NAME_MAX) {
      rc = ZS_EINVAL;
      snprintf(err, sizeof err, "commit entry %zu is not shard %zu's file", i, i);
      break;
    }
    m.files[i].shard_id = f->shard_id;
    snprintf(m.files[i].name, sizeof m.files[i].name, "%s", f->name);
    m.files[i].bytes = f->bytes;
    m.files[i].crc32c = f->crc32c;
  }
  if (rc != 0) {
    gsrv__finish_err(c, 0, rc, err);
  } else if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c);
    rc = ckpt_svc_commit(s->ckpt, r->spec_hash, &m, r->dir, on_ckpt_done, c, err, sizeof err);
    ckpt_started(c, rc, err);
  }
  ckpt_manifest_free(&m);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

void gsrv__h_restore(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__RestoreRequest *r =
      UNPACK(Zshard__V1__RestoreRequest, zshard__v1__restore_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.RestoreRequest");
    return;
  }
  if (ckpt_prepare(s, c) == 0) {
    c->step = r->step;
    gcall_ref(c);
    int rc =
        ckpt_svc_restore(s->ckpt, r->spec_hash, r->step, r->dir, on_ckpt_done, c, err, sizeof err);
    ckpt_started(c, rc, err);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

/* Answered on the polling thread: it reads directory entries and manifests
 * only, no shard file. */
void gsrv__h_list_checkpoints(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ListCheckpointsRequest *r =
      UNPACK(Zshard__V1__ListCheckpointsRequest, zshard__v1__list_checkpoints_request__descriptor,
             msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ListCheckpointsRequest");
    return;
  }
  if (!s->ckpt) {
    protobuf_c_message_free_unpacked(&r->base, NULL);
    gsrv__finish_err(c, 0, ZS_EUNIMPL,
                     "checkpoints are off on this shard: start zshard-server with --state-dir DIR");
    return;
  }
  ckpt_svc_entry *e = NULL;
  size_t n = 0;
  int rc = ckpt_svc_list(s->ckpt, r->dir, &e, &n, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  Zshard__V1__CheckpointInfo *infos = rc == 0 ? calloc(n + 1, sizeof *infos) : NULL;
  Zshard__V1__CheckpointInfo **ptrs = rc == 0 ? calloc(n + 1, sizeof *ptrs) : NULL;
  if (rc == 0 && (!infos || !ptrs)) {
    rc = ZS_ENOMEM;
    snprintf(err, sizeof err, "out of memory");
  }
  if (rc != 0) {
    gsrv__finish_err(c, 0, rc, err);
  } else {
    for (size_t i = 0; i < n; i++) {
      zshard__v1__checkpoint_info__init(&infos[i]);
      infos[i].step = e[i].step;
      infos[i].complete = e[i].complete != 0;
      infos[i].num_shards = e[i].num_shards;
      infos[i].spec_hash = e[i].spec_hash;
      infos[i].loadable = e[i].loadable != 0;
      ptrs[i] = &infos[i];
    }
    Zshard__V1__ListCheckpointsResponse resp = ZSHARD__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
    resp.n_checkpoints = n;
    resp.checkpoints = ptrs;
    uint64_t step = 0;
    resp.from_checkpoint = service_checkpoint_origin(s->svc, &step, NULL) != 0;
    resp.checkpoint_step = step;
    core_info info;
    service_info(s->svc, &info);
    resp.version = info.version;
    resp.state_dir = (char *)ckpt_svc_state_dir(s->ckpt);
    gsrv__finish_msg(c, 0, &resp.base);
  }
  free(e);
  free(infos);
  free(ptrs);
}
