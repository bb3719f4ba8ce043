/*
 * grpc_step — the training step's methods: Push (decoded in place, whole or in
 * chunks), Pull, GradStats and Apply, the ones that may wait in the core.
 *
 * Copies of tensor bytes, beyond the kernel's socket copies:
 *  - Push: gRPC hands over the message in slices; a message in one slice is
 *    used in place, one in several is gathered into one buffer (1 copy). The
 *    request is then decoded in place (data points into that buffer) and the
 *    core adds it into its accumulator (or copies an early one to hold it).
 *    A payload larger than a message comes in chunks, each copied once more
 *    into the payload's buffer (push_asm), which the core then reads.
 *  - Pull: the response is one slice of exactly the message's size and
 *    core_read converts the piece from the master arena straight into it
 *    (1 copy, which is also the dtype conversion); gRPC sends that slice.
 *  - InitParams (grpc_job.c, once per job): gather (0-1 copy) + protobuf-c unpack (1).
 */
#include "server/transport/grpc/grpc_internal.h"
#include "server/transport/grpc/pb_inplace.h"

#include <grpc/slice.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"

/* A chunk of a Push payload (PushRequest.total set): checked against the
 * piece before any byte is held, then kept until the payload is whole, which
 * comes back in *whole (malloc'ed) with the last chunk. */
static int push_chunk(gsrv *s, const core_push_args *a, uint64_t offset, uint64_t total,
                      void **whole, char *err, size_t errlen) {
  *whole = NULL;
  core_push_args q = *a;
  q.nbytes = (size_t)total;
  int rc = total > SIZE_MAX ? ZS_ESIZE : service_push_check(s->svc, &q, err, errlen);
  if (rc)
    return rc;
  push_asm_key k = {.hash = a->hash,
                    .step = a->step,
                    .rank = a->rank,
                    .micro = a->micro,
                    .tensor = a->tensor,
                    .slice = a->slice,
                    .dtype = a->dtype};
  return push_asm_add(s->chunks, &k, total, offset, a->data, a->nbytes, whole, err, errlen);
}

void gsrv__h_push(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  pb_push r;
  if (pb_push_decode(msg, len, &r) != PB_OK) {
    gsrv__bad_message(c, "zshard.v1.PushRequest");
    return;
  }
  if (!r.dtype) {
    snprintf(err, sizeof err, "Push needs dtype %s", dtype_names());
    gsrv__finish_err(c, 0, ZS_EDTYPE, err);
    return;
  }
  core_push_args a = {
      .hash = r.hash,
      .step = r.step,
      .rank = r.rank,
      .micro = r.micro,
      .tensor = r.tensor,
      .slice = r.slice,
      .dtype = (zs_dtype)r.dtype,
      .data = r.data,
      .nbytes = r.len,
  };
  /* A joiner's copy made at a version >= the step holds the push already
   * (replica.h, `covered`). */
  c->fwd_step = r.step;
  void *whole = NULL;
  int job_ok = !c->bind.bound || core_job_named(service_core(s->svc), r.hash, c->bind.job);
  /* Before any chunk is kept: a refused push changes nothing. */
  int rc = auth_push_admit(s->auth, c->role, &c->bind, job_ok, r.rank, err, sizeof err);
  if (rc == 0 && r.total) {
    rc = push_chunk(s, &a, r.offset, r.total, &whole, err, sizeof err);
    if (rc == 0 && !whole) { /* more chunks to come: this one is kept */
      Zshard__V1__PushResponse resp = ZSHARD__V1__PUSH_RESPONSE__INIT;
      gsrv__finish_msg(c, 0, &resp.base);
      return;
    }
    a.data = whole;
    a.nbytes = (size_t)r.total;
  }
  int duplicate = 0;
  if (rc == 0)
    rc = service_push(s->svc, &a, &duplicate, err, sizeof err);
  free(whole);
  if (rc) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  Zshard__V1__PushResponse resp = ZSHARD__V1__PUSH_RESPONSE__INIT;
  resp.duplicate = duplicate != 0;
  gsrv__finish_msg(c, 0, &resp.base);
}

/* Builds the PullResponse by hand (pb_inplace.h) in one slice so that
 * core_read writes the piece straight into the message, the one copy of the
 * piece on this path before gRPC sends it. */
void gsrv__pull_finish(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  if (c->async_status != ZS_OK) {
    gsrv__finish_err(
        c, claimed,
        service_pull_wait_failed(c->async_status, c->step, c->tensor, c->slice, err, sizeof err),
        err);
    return;
  }
  int room = gsrv__answer_reserve(s, c, claimed);
  if (room < 0)
    gsrv__finish_err(c, claimed, ZS_ENOMEM, "out of memory counting a Pull answer");
  else if (room > 0)
    gsrv__pull_build(c, claimed);
}

/* gsrv__pull_finish's answer, once it has room. */
void gsrv__pull_build(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  grpc_slice sl = grpc_slice_malloc(pb_pull_cap((int)c->dtype, c->nbytes));
  uint8_t *p = GRPC_SLICE_START_PTR(sl);
  size_t off = pb_pull_head(p, (int)c->dtype, c->nbytes);
  uint64_t version = 0;
  int rc = core_read(s->core, c->hash, c->tensor, c->slice, c->dtype, p + off, c->nbytes, &version,
                     err, sizeof err);
  if (rc) {
    grpc_slice_unref(sl);
    gsrv__finish_err(c, claimed, rc, err);
    return;
  }
  off = pb_pull_tail(p, off + c->nbytes, version);
  GRPC_SLICE_SET_LENGTH(sl, off);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  core_count_pull(s->core, off);
  gsrv__finish(c, claimed, bb, ZS_OK, NULL);
}

void gsrv__h_pull(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__PullRequest *r =
      UNPACK(Zshard__V1__PullRequest, zshard__v1__pull_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.PullRequest");
    return;
  }
  c->hash = r->spec_hash;
  c->tensor = r->tensor;
  c->slice = r->slice;
  c->step = r->min_version; /* reported in a timeout's detail */
  int dtype = (int)r->dtype;
  uint64_t min_version = r->min_version;
  uint32_t timeout_ms = r->timeout_ms;
  protobuf_c_message_free_unpacked(&r->base, NULL);

  if (!dtype_valid(dtype)) {
    snprintf(err, sizeof err, "Pull needs dtype %s", dtype_names());
    gsrv__finish_err(c, 0, ZS_EDTYPE, err);
    return;
  }
  c->dtype = (zs_dtype)dtype;
  /* Size (and so tensor, slice and hash) are checked before waiting, so a bad
   * request fails at once rather than at the end of its wait. */
  int64_t nb = service_piece_bytes(s->svc, c->hash, c->tensor, c->slice, c->dtype, err, sizeof err);
  if (nb < 0) {
    gsrv__finish_err(c, 0, (int)nb, err);
    return;
  }
  /* The message's own fields take a few bytes besides the piece's. */
  if ((uint64_t)nb > RPC_MAX_MESSAGE_BYTES - 64) {
    gsrv__finish_err(c, 0,
                     service_too_large("piece", (uint64_t)nb, RPC_MAX_MESSAGE_BYTES, "gRPC message",
                                       err, sizeof err),
                     err);
    return;
  }
  c->nbytes = (size_t)nb;

  uint64_t version = 0;
  int rc = gsrv__park_begin(s, c, min_version, err, sizeof err);
  if (rc) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  gcall_ref(c);                                /* the core's, released by gsrv__resume_from_core */
  core_piece_id piece = {c->tensor, c->slice}; /* a pipelined job answers it once applied */
  rc =
      core_wait_pieces(s->core, c->hash, &piece, 1, min_version, gsrv__wait_deadline(c, timeout_ms),
                       gsrv__on_core_version, c, &version, err, sizeof err);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  gsrv__set_waiting(c, 0);
  gsrv__park_uncount(c);
  if (rc < 0) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  c->async_status = ZS_OK;
  gsrv__pull_finish(c, 0);
}

void gsrv__stats_finish(gcall *c, int claimed) {
  char err[GSRV_ERRLEN] = "";
  gsrv *s = c->s;
  Zshard__V1__GradStatsResponse resp = ZSHARD__V1__GRAD_STATS_RESPONSE__INIT;
  Zshard__V1__MissingContribution miss[CORE_MAX_MISSING];
  Zshard__V1__MissingContribution *missp[CORE_MAX_MISSING];
  core_missing_entry ent[CORE_MAX_MISSING];
  spec sp; /* a copy, for the missing tensors' names: see gsrv__h_get_info */
  int have = 0;
  uint32_t ranks[CORE_ELASTIC_MAX_W];
  if (c->async_status == ZS_OK) {
    resp.step = c->stats.step;
    resp.complete = 1;
    resp.sum_squares = c->stats.sum_squares;
    resp.nonfinite = c->stats.nonfinite != 0;
    resp.num_members = c->stats.members.n;
    resp.n_members = core_members_list(s->core, &c->stats.members, ranks, CORE_ELASTIC_MAX_W);
    resp.members = ranks;
  } else if (c->async_status == ZS_ETIMEDOUT) {
    /* A timeout is an answer, not an error: the caller learns who is late. */
    resp.step = c->step;
    resp.complete = 0;
    uint32_t total = core_missing(s->core, c->step, ent, CORE_MAX_MISSING);
    uint32_t n = total < CORE_MAX_MISSING ? total : CORE_MAX_MISSING;
    have = n > 0 && core_spec_copy(s->core, &sp, NULL) == 0;
    for (uint32_t i = 0; i < n; i++) {
      zshard__v1__missing_contribution__init(&miss[i]);
      miss[i].rank = ent[i].rank;
      miss[i].micro = ent[i].micro;
      miss[i].tensor = ent[i].tensor;
      miss[i].slice = ent[i].slice;
      miss[i].tensor_name = have && ent[i].tensor < sp.num_tensors
                                ? sp.tensors[ent[i].tensor].name
                                : (char *)protobuf_c_empty_string;
      missp[i] = &miss[i];
    }
    resp.n_missing = n;
    resp.missing = missp;
    resp.missing_total = total;
  } else {
    snprintf(err, sizeof err, "GradStats of step %" PRIu64 ": %s", c->step,
             zs_strerror(c->async_status));
    gsrv__finish_err(c, claimed, c->async_status, err);
    return;
  }
  gsrv__finish_msg(c, claimed, &resp.base);
  if (have)
    spec_free(&sp);
}

void gsrv__h_grad_stats(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__GradStatsRequest *r =
      UNPACK(Zshard__V1__GradStatsRequest, zshard__v1__grad_stats_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.GradStatsRequest");
    return;
  }
  c->hash = r->spec_hash;
  c->step = r->step;
  uint32_t timeout_ms = r->timeout_ms;
  uint32_t acked_rank = r->acked_rank;
  /* The membership asked for (second round of the agreement), checked
   * against the job before anything waits. */
  c->has_want = r->num_members > 0;
  int rc = c->has_want ? core_members_decode(s->core, r->num_members, r->members, r->n_members,
                                             &c->want, err, sizeof err)
                       : 0;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc != 0) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  const core_members *want = c->has_want ? &c->want : NULL;

  rc = gsrv__park_begin(s, c, c->step, err, sizeof err);
  if (rc == ZS_ELIMIT) {
    /* No room to wait, but statistics that are ready need none: asked with
     * a deadline already passed, the core answers them or says
     * ZS_ETIMEDOUT at once, never parking the call. */
    char now_err[GSRV_ERRLEN] = "";
    int now =
        service_grad_stats_members(s->svc, c->hash, c->step, acked_rank, want, clock_now_ms(),
                                   gsrv__on_core_stats, c, &c->stats, now_err, sizeof now_err);
    if (now == ZS_OK) {
      c->async_status = ZS_OK;
      gsrv__stats_finish(c, 0);
      return;
    }
    if (now != ZS_ETIMEDOUT && now != CORE_PENDING) {
      gsrv__finish_err(c, 0, now, now_err);
      return;
    }
  }
  if (rc) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  gcall_ref(c);
  rc = service_grad_stats_members(s->svc, c->hash, c->step, acked_rank, want,
                                  gsrv__wait_deadline(c, timeout_ms), gsrv__on_core_stats, c,
                                  &c->stats, err, sizeof err);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  gsrv__set_waiting(c, 0);
  gsrv__park_uncount(c);
  if (rc < 0 && rc != ZS_ETIMEDOUT) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  c->async_status = rc;
  gsrv__stats_finish(c, 0);
}

void gsrv__apply_finish(gcall *c, int claimed) {
  if (c->async_status != ZS_OK) {
    char err[GSRV_ERRLEN];
    snprintf(err, sizeof err, "Apply of step %" PRIu64 ": %s", c->step,
             zs_strerror(c->async_status));
    gsrv__finish_err(c, claimed, c->async_status, err);
    return;
  }
  Zshard__V1__ApplyResponse resp = ZSHARD__V1__APPLY_RESPONSE__INIT;
  resp.step = c->apply.step;
  resp.version = c->apply.version;
  resp.skipped = c->apply.skipped != 0;
  resp.optimizer_steps = c->apply.optimizer_steps;
  gsrv__finish_msg(c, claimed, &resp.base);
}

void gsrv__h_apply(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ApplyRequest *r =
      UNPACK(Zshard__V1__ApplyRequest, zshard__v1__apply_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ApplyRequest");
    return;
  }
  c->step = r->step;
  c->fwd_step = r->step;
  /* The apply runs on a core thread; this call is work in progress, not a
   * wait, so shutdown gives it the grace period. */
  gcall_ref(c);
  /* protobuf-c bounds n_group_lr by the message's length; the core checks
   * it against the job's group count. */
  uint32_t nglr = r->n_group_lr > UINT32_MAX ? UINT32_MAX : (uint32_t)r->n_group_lr;
  core_step_hparams hp;
#define HP_FROM_REQUEST(up, name)                                                                  \
  hp.v[CORE_HP_##up] = r->group_##name;                                                            \
  hp.n[CORE_HP_##up] = r->n_group_##name > UINT32_MAX ? UINT32_MAX : (uint32_t)r->n_group_##name;
  CORE_STEP_HPARAMS(HP_FROM_REQUEST)
#undef HP_FROM_REQUEST
  core_members members;
  int rc = r->num_members > 0 ? core_members_decode(s->core, r->num_members, r->members,
                                                    r->n_members, &members, err, sizeof err)
                              : 0;
  if (rc == 0)
    rc = service_apply_members(s->svc, r->spec_hash, r->step, r->lr, r->group_lr, nglr, &hp,
                               r->num_members > 0 ? &members : NULL, r->coef, r->skip,
                               r->client_state.data, r->client_state.len, gsrv__on_core_apply, c,
                               &c->apply, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc == CORE_PENDING)
    return;
  gcall_unref(c);
  if (rc < 0) {
    gsrv__finish_err(c, 0, rc, err);
    return;
  }
  /* Answered at once: a repeat of the step just applied, maybe before the
   * replica's applied hook ran (replica.h). */
  replica_wait_applied(s->rep, c->apply.version);
  c->async_status = ZS_OK;
  gsrv__apply_finish(c, 0);
}
