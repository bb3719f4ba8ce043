/*
 * grpc_job — a job's methods outside the training step: Open, InitParams,
 * GetInfo, ReadState, WriteState, CloseJob, ChangeMembership and Stats.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"

/* A job name as it may appear in a log line: printable, no spaces or quotes
 * (a name comes from the network). */
static void log_safe(char *dst, size_t cap, const char *src) {
  size_t i = 0;
  for (; src && src[i] && i + 1 < cap; i++) {
    unsigned char ch = (unsigned char)src[i];
    dst[i] = ch > 0x20 && ch < 0x7f && ch != '"' && ch != '=' ? (char)ch : '_';
  }
  dst[i] = '\0';
}

void gsrv__h_open(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__OpenRequest *r =
      UNPACK(Zshard__V1__OpenRequest, zshard__v1__open_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.OpenRequest");
    return;
  }
  spec sp;
  memset(&sp, 0, sizeof sp);
  int rc;
  if (!r->spec) {
    rc = ZS_EINVAL;
    snprintf(err, sizeof err, "OpenRequest carries no spec");
    goto fail;
  }
  rc = spec_from_proto(&sp, r->spec, err, sizeof err);
  if (rc)
    goto fail;
  core_open_result res;
  rc = service_open_job(s->svc, &sp, r->rank, (int)r->mode, r->trainer_timeout_ms, &res, err,
                        sizeof err);
  if (rc)
    goto fail;
  if (res.created) {
    char job[65];
    log_safe(job, sizeof job, sp.job);
    LOG_INFO("job_opened",
             "job=%s spec_hash=%016" PRIx64 " tensors=%" PRIu32 " world_size=%" PRIu32
             " grad_accum=%" PRIu32 " shards=%" PRIu32 " rank=%" PRIu32,
             job, res.spec_hash, sp.num_tensors, sp.world_size, sp.grad_accum, sp.num_shards,
             r->rank);
  }
  core_info info;
  service_info(s->svc, &info);
  /* The version is read again with the client state, so that the trainer
   * gets the state of the version it resumes at even if an apply ran since
   * core_open looked. */
  uint8_t cs[CORE_MAX_CLIENT_STATE];
  uint64_t cs_version = 0;
  size_t cs_len = service_client_state(s->svc, cs, sizeof cs, &cs_version);
  Zshard__V1__OpenResponse resp = ZSHARD__V1__OPEN_RESPONSE__INIT;
  resp.spec_hash = res.spec_hash;
  resp.version = cs_version;
  resp.client_state.data = cs;
  resp.client_state.len = cs_len;
  resp.shard_id = info.shard_id;
  resp.num_shards = info.num_shards;
  resp.created = res.created != 0;
  resp.initialized = res.initialized != 0;
  resp.world_size = res.world_size;
  gsrv__finish_msg(c, 0, &resp.base);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return;
fail:
  gsrv__finish_err(c, 0, rc, err);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

void gsrv__h_init_params(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__InitParamsRequest *r =
      UNPACK(Zshard__V1__InitParamsRequest, zshard__v1__init_params_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.InitParamsRequest");
    return;
  }
  int written = 0;
  uint64_t version = 0;
  /* protobuf-c allocates the bytes with malloc, so they are float-aligned. */
  int rc = service_init_params(s->svc, r->spec_hash, r->tensor, r->slice, r->offset, r->data.data,
                               r->data.len, &written, &version, err, sizeof err);
  if (rc) {
    gsrv__finish_err(c, 0, rc, err);
  } else {
    Zshard__V1__InitParamsResponse resp = ZSHARD__V1__INIT_PARAMS_RESPONSE__INIT;
    resp.written = written != 0;
    resp.version = version;
    gsrv__finish_msg(c, 0, &resp.base);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

void gsrv__h_get_info(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__GetInfoRequest *r =
      UNPACK(Zshard__V1__GetInfoRequest, zshard__v1__get_info_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.GetInfoRequest");
    return;
  }
  int with_spec = r->with_spec;
  /* A peer's probe carries its member list: the replica compares it. */
  replica_check_caller(s->rep, r->replica_members, r->replica_index, r->replica_term, c->admin);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  core_info info;
  service_info(s->svc, &info);
  pthread_mutex_lock(&s->lock);
  int serving = s->serving;
  pthread_mutex_unlock(&s->lock);
  Zshard__V1__GetInfoResponse resp = ZSHARD__V1__GET_INFO_RESPONSE__INIT;
  resp.shard_id = info.shard_id;
  resp.num_shards = info.num_shards;
  resp.job = info.has_job ? info.job : (char *)protobuf_c_empty_string;
  resp.spec_hash = info.spec_hash;
  resp.version = info.version;
  resp.state_bytes = info.state_bytes;
  resp.pieces = info.pieces;
  resp.elements = info.elements;
  resp.initialized = info.initialized != 0;
  resp.uptime_s = (double)(clock_now_ns() - s->start_ns) / 1e9;
  resp.serving = serving != 0;
  resp.data_port = s->data_port;
  resp.optimizer_steps = info.optimizer_steps;
  Zshard__V1__ReplicaInfo ri = ZSHARD__V1__REPLICA_INFO__INIT;
  Zshard__V1__ReplicaMember members[REPLICA_MAX_MEMBERS];
  void *mptr[REPLICA_MAX_MEMBERS];
  char config_error[256];
  if (s->rep) {
    replica_info(s->rep, &ri, members, mptr, config_error, sizeof config_error);
    resp.replica = &ri;
  }
  /* A copy of the spec (the core's own may be freed by a close and an open
   * on another thread meanwhile); sent only when it is the job the info
   * describes, so that a job closed and replaced in between is not answered
   * with the new one's. The message borrows the copy's strings. */
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  spec sp;
  uint64_t hash = 0;
  int have = with_spec && info.has_job && service_spec_copy(s->svc, &sp, &hash) == 0;
  if (have && hash == info.spec_hash && spec_to_proto(&sp, &ms) == 0)
    resp.spec = &ms;
  gsrv__finish_msg(c, 0, &resp.base);
  if (resp.spec)
    spec_proto_release(&ms);
  if (have)
    spec_free(&sp);
}

/* ReadState and WriteState are rare (a state_dict, a load_state_dict), so
 * they take the plain protobuf-c path: a read copies the range into a buffer
 * and packing copies it once more; a write is unpacked (1 copy) and copied
 * into the arena. Both answer on the polling thread: the core holds the state
 * lock for a copy of at most one message. */
void gsrv__h_read_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReadStateRequest *r =
      UNPACK(Zshard__V1__ReadStateRequest, zshard__v1__read_state_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ReadStateRequest");
    return;
  }
  uint64_t count = r->count, version = 0, steps = 0;
  float *buf = NULL;
  /* The message's own fields take a few bytes besides the data. */
  uint64_t max_bytes = RPC_PUSH_CHUNK_BYTES;
  int rc = 0;
  /* A count too large for a message is the service's to refuse (no buffer
   * is needed for that). The answer counts against the answer budgets, but
   * does not wait for room: a client reads state in 1 MiB chunks. */
  if (count <= max_bytes / sizeof(float)) {
    rc = gsrv__answer_try_reserve(s, c, count * sizeof(float), err, sizeof err);
    if (rc == 0 && !(buf = malloc(count ? count * sizeof(float) : 1))) {
      rc = ZS_ENOMEM;
      snprintf(err, sizeof err, "out of memory for a ReadState answer");
    }
  }
  if (rc == 0)
    rc = service_state_read(s->svc, r->spec_hash, r->tensor, r->slice, (int)r->array, r->offset,
                            count, max_bytes, buf, &version, &steps, err, sizeof err);
  /* The piece was found, so the shard holds a slice of the tensor. */
  uint64_t tsteps = 0;
  if (rc == 0)
    rc = service_tensor_steps(s->svc, r->spec_hash, r->tensor, &tsteps, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    free(buf);
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__ReadStateResponse resp = ZSHARD__V1__READ_STATE_RESPONSE__INIT;
  resp.version = version;
  resp.optimizer_steps = steps;
  resp.tensor_steps = tsteps;
  /* Little-endian float32 is the wire format, and the host's. */
  resp.data.data = (uint8_t *)buf;
  resp.data.len = (size_t)count * sizeof(float);
  gsrv__finish_msg(c, 0, &resp.base);
  free(buf);
}

void gsrv__h_write_state(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__WriteStateRequest *r =
      UNPACK(Zshard__V1__WriteStateRequest, zshard__v1__write_state_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.WriteStateRequest");
    return;
  }
  uint64_t version = 0, steps = 0, set = r->optimizer_steps, tsteps = 0;
  int rc = 0;
  /* A tensor's count alone, or after the data and the job's count. */
  if (!r->set_tensor_steps || r->data.len > 0 || r->set_optimizer_steps)
    rc = service_state_write(s->svc, r->spec_hash, r->tensor, r->slice, (int)r->array, r->offset,
                             r->data.data, r->data.len, r->set_optimizer_steps ? &set : NULL,
                             &version, &steps, err, sizeof err);
  if (rc == 0 && r->set_tensor_steps)
    rc =
        service_set_tensor_steps(s->svc, r->spec_hash, r->tensor, r->tensor_steps, err, sizeof err);
  if (rc == 0) /* stays 0 when the shard holds no slice of the tensor */
    (void)service_tensor_steps(s->svc, r->spec_hash, r->tensor, &tsteps, NULL, 0);
  if (rc == 0 && r->set_tensor_steps && !r->set_optimizer_steps && r->data.len == 0) {
    /* The version and job count of an answer that wrote only the tensor's. */
    core_info info;
    service_info(s->svc, &info);
    version = info.version;
    steps = info.optimizer_steps;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__WriteStateResponse resp = ZSHARD__V1__WRITE_STATE_RESPONSE__INIT;
  resp.version = version;
  resp.optimizer_steps = steps;
  resp.tensor_steps = tsteps;
  gsrv__finish_msg(c, 0, &resp.base);
}

/* Answered on the polling thread: the close waits for the worker (at most
 * the apply in progress), as an Open waits for the state lock. Calls of the
 * job parked in the core are answered ENOTOPEN from the worker meanwhile. */
void gsrv__h_close_job(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__CloseJobRequest *r =
      UNPACK(Zshard__V1__CloseJobRequest, zshard__v1__close_job_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.CloseJobRequest");
    return;
  }
  core_close_result res;
  int rc = service_close(s->svc, r->spec_hash, r->job, &res, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  core_info info;
  service_info(s->svc, &info);
  if (res.closed) {
    char job[65];
    log_safe(job, sizeof job, res.job);
    LOG_INFO("job_closed_by_request", "job=%s spec_hash=%016" PRIx64 " version=%" PRIu64, job,
             res.spec_hash, res.version);
  }
  Zshard__V1__CloseJobResponse resp = ZSHARD__V1__CLOSE_JOB_RESPONSE__INIT;
  resp.closed = res.closed != 0;
  resp.job = res.closed ? res.job : (char *)protobuf_c_empty_string;
  resp.spec_hash = res.spec_hash;
  resp.version = res.version;
  resp.shard_id = info.shard_id;
  resp.state_bytes = res.state_bytes;
  gsrv__finish_msg(c, 0, &resp.base);
}

void gsrv__h_change_membership(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ChangeMembershipRequest *r =
      UNPACK(Zshard__V1__ChangeMembershipRequest, zshard__v1__change_membership_request__descriptor,
             msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ChangeMembershipRequest");
    return;
  }
  Zshard__V1__ChangeMembershipResponse resp = ZSHARD__V1__CHANGE_MEMBERSHIP_RESPONSE__INIT;
  /* A joiner's copy made at a version >= the step holds the change already
   * (replica.h, `covered`). */
  c->fwd_step = r->step;
  /* A rank token changes only its own rank's membership, as it pushes. */
  int job_ok = !c->bind.bound || core_job_named(service_core(s->svc), r->spec_hash, c->bind.job);
  int rc = auth_push_admit(s->auth, c->role, &c->bind, job_ok, r->rank, err, sizeof err);
  if (rc == 0)
    rc = service_member_change(s->svc, r->spec_hash, r->rank, (int)r->change, r->step,
                               &resp.version, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0)
    gsrv__finish_err(c, 0, rc, err);
  else
    gsrv__finish_msg(c, 0, &resp.base);
}

void gsrv__h_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__StatsRequest *r =
      UNPACK(Zshard__V1__StatsRequest, zshard__v1__stats_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.StatsRequest");
    return;
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  core_counters k;
  service_counters(s->svc, &k);
  Zshard__V1__StatsResponse resp = ZSHARD__V1__STATS_RESPONSE__INIT;
  resp.pushes = k.pushes;
  resp.duplicate_pushes = k.duplicate_pushes;
  resp.rejected = k.rejected;
  resp.pulls = k.pulls;
  resp.bytes_in = k.bytes_in;
  resp.bytes_out = k.bytes_out;
  resp.applies = k.applies;
  resp.skipped_steps = k.skipped_steps;
  resp.version = k.version;
  resp.apply_seconds_total = k.apply_seconds_total;
  resp.held_bytes = k.held_bytes;
  resp.waiting_pulls = k.waiting_pulls;
  resp.waiting_stats = k.waiting_stats;
  resp.rss_bytes = metrics_process_rss();
  core_membership mb;
  service_membership(s->svc, &mb);
  resp.members = mb.members.n;
  resp.world_size = mb.world_size;
  resp.membership_epoch = mb.epoch;
  resp.member_leaves = mb.leaves;
  resp.trainer_timeouts = mb.timeouts;
  resp.member_joins = mb.joins;
  char mlog[4096];
  service_member_log(s->svc, mlog, sizeof mlog);
  resp.member_log = mlog;
  resp.trainer_timeout_ms = mb.trainer_timeout_ms;
  gsrv__finish_msg(c, 0, &resp.base);
}
