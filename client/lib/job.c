/*
 * job — zs_open_job: the Open on every shard, the initial weights (at once
 * or deferred, zs_init_tensor and zs_wait_initialized) and the client state
 * a reopening trainer gets back; and zs_close_job.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt_client.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/net/dp_client.h"
#include "internal.h"

/* ---- opening the job ------------------------------------------------------------ */

/* Open on every shard: *version gets the job's version and cs (*cs_len
 * bytes, at most ZC_MAX_CLIENT_STATE) its client state, shard 0's or else
 * the first shard's that has one (every shard keeps the same). */
static int open_on_shards(zs_client *c, uint64_t *version, uint8_t *cs, size_t *cs_len) {
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  Zshard__V1__OpenRequest *reqs = NULL;
  zs_request *op = NULL;
  int rc = spec_to_proto(&c->sp, &ms);
  if (rc != ZS_OK)
    return zc_fail(rc, "zs_open_job: out of memory encoding the spec");
  reqs = calloc(c->nshards, sizeof *reqs);
  op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!reqs || !op) {
    rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    Zshard__V1__OpenRequest init = ZSHARD__V1__OPEN_REQUEST__INIT;
    reqs[i] = init;
    reqs[i].spec = &ms; /* shared: packing only reads it */
    reqs[i].rank = c->opt.rank;
    /* zs_open_mode's values are the proto's OpenMode. */
    reqs[i].mode = (Zshard__V1__OpenMode)c->opt.open_mode;
    reqs[i].trainer_timeout_ms = c->opt.trainer_timeout_ms;
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("Open");
    t->msg = &reqs[i].base;
    t->resp_desc = &zshard__v1__open_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  rc = zc_call_all(op);
  if (rc == ZS_EHASH) {
    char why[ZC_ERR_LEN]; /* the last error is both source and destination */
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc =
        zc_fail(rc, "zs_open_job: a shard holds a different job (spec hash mismatch): %.400s", why);
  } else if (rc == ZS_EEXIST || rc == ZS_ENOTOPEN) {
    /* The open mode's refusals: the shard's sentence names the job. */
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_open_job (open mode %s): %.400s",
                 c->opt.open_mode == ZS_OPEN_CREATE ? "create"
                 : c->opt.open_mode == ZS_OPEN_JOIN ? "join"
                                                    : "resume",
                 why);
  }
  if (rc != ZS_OK)
    goto done;
  uint64_t vmin = UINT64_MAX, vmax = 0;
  for (uint32_t i = 0; i < c->nshards && rc == ZS_OK; i++) {
    const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)op->tasks[i].resp;
    if (r->spec_hash != c->hash)
      rc = zc_fail(ZS_EHASH,
                   "zs_open_job: shard %" PRIu32 " (%s) answered spec hash %016" PRIx64
                   ", ours is %016" PRIx64,
                   i, c->addr[i], r->spec_hash, c->hash);
    else if (r->shard_id != i || r->num_shards != c->nshards)
      rc = zc_fail(ZS_EINVAL,
                   "zs_open_job: address %" PRIu32 " (%s) is shard %" PRIu32 " of %" PRIu32
                   "; list the addresses in shard-id order, %" PRIu32 " of them",
                   i, c->addr[i], r->shard_id, r->num_shards, c->nshards);
    if (r->version < vmin)
      vmin = r->version;
    if (r->version > vmax)
      vmax = r->version;
  }
  if (rc == ZS_OK)
    rc = zc_adopt_world_size(c, op);
  *cs_len = 0;
  for (uint32_t i = 0; rc == ZS_OK && i < c->nshards && *cs_len == 0; i++) {
    const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)op->tasks[i].resp;
    if (r->client_state.len > 0 && r->client_state.len <= ZC_MAX_CLIENT_STATE) {
      memcpy(cs, r->client_state.data, r->client_state.len);
      *cs_len = r->client_state.len;
    }
  }
  /* A trainer joining a running job may open while an Apply is on its way
   * to some shards; it joins after the newest version (zc_member_join). */
  int joining = c->opt.open_mode == ZS_OPEN_JOIN && vmax - vmin <= 1;
  if (rc == ZS_OK && vmin != vmax && !joining) {
    char hint[ZC_ERR_LEN / 2];
    zc_resume_hint(c, c->hash, hint, sizeof hint);
    rc = zc_fail(ZS_EBEHIND,
                 "zs_open_job: the shards are at different versions (%" PRIu64 " to %" PRIu64
                 "): a shard is behind the cluster and must be restored before training "
                 "resumes; %s",
                 vmin, vmax, hint);
  }
  *version = joining ? vmax : vmin;
done:
  if (op) {
    for (uint32_t i = 0; i < op->ntasks; i++)
      if (op->tasks[i].resp)
        protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
    /* Ours: the caller's reference of zc_call_all, or the only one of an op
     * that was never submitted. */
    zc_op_release(op);
  }
  free(reqs);
  spec_proto_release(&ms);
  return rc;
}

/* Rank 0's initial weights, one call per chunk of LAYOUT_INIT_CHUNK_ELEMS
 * elements (1 MiB), so that neither end holds more than a chunk per call in
 * flight however large a piece is: a whole 8M-parameter piece in one message
 * used to exist several times over in the shard while it was received. */
static uint32_t piece_calls(const layout_piece *pc) {
  return (uint32_t)((pc->numel + LAYOUT_INIT_CHUNK_ELEMS - 1) / LAYOUT_INIT_CHUNK_ELEMS);
}

/* Sends every tensor's weights (only == UINT32_MAX: init[t] those of tensor
 * t, `one` unused), or those of tensor `only` alone (`one` its weights, init
 * unused). */
static int init_params(zs_client *c, const float *const *init, uint32_t only, const float *one) {
  size_t ncalls = 0;
  for (uint32_t i = 0; i < c->lay.num_pieces; i++)
    if (only == UINT32_MAX || c->lay.pieces[i].tensor == only)
      ncalls += piece_calls(&c->lay.pieces[i]);
  Zshard__V1__InitParamsRequest *reqs = calloc(ncalls ? ncalls : 1, sizeof *reqs);
  zs_request *op = zc_op_new(c, ZC_OP_CALL, (uint32_t)ncalls);
  int rc;
  if (!reqs || !op) {
    free(reqs);
    if (op)
      zc_op_release(op);
    return zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
  }
  size_t n = 0;
  for (uint32_t i = 0; i < c->lay.num_pieces; i++) {
    const layout_piece *pc = &c->lay.pieces[i];
    if (only != UINT32_MAX && pc->tensor != only)
      continue;
    for (uint64_t e = 0; e < pc->numel; e += LAYOUT_INIT_CHUNK_ELEMS, n++) {
      uint64_t len =
          pc->numel - e < LAYOUT_INIT_CHUNK_ELEMS ? pc->numel - e : LAYOUT_INIT_CHUNK_ELEMS;
      Zshard__V1__InitParamsRequest r = ZSHARD__V1__INIT_PARAMS_REQUEST__INIT;
      r.spec_hash = c->hash;
      r.tensor = pc->tensor;
      r.slice = pc->slice;
      r.offset = e;
      /* Little-endian float32 is the wire format, and the host's. */
      const float *w = only == UINT32_MAX ? init[pc->tensor] : one;
      r.data.data = (uint8_t *)(uintptr_t)(w + pc->offset + e);
      r.data.len = (size_t)len * sizeof(float);
      reqs[n] = r;
      zc_task *t = &op->tasks[n];
      t->shard = pc->shard;
      t->method = ZC_METHOD("InitParams");
      t->msg = &reqs[n].base;
      t->resp_desc = &zshard__v1__init_params_response__descriptor;
      t->timeout_ms = c->opt.rpc_timeout_ms;
      t->bytes = r.data.len;
    }
  }
  rc = ncalls ? zc_call_all(op) : ZS_OK;
  if (rc == ZS_EEXIST)
    rc = zc_fail(rc,
                 "%s: the shards already hold different initial weights for this "
                 "job (%s)",
                 only == UINT32_MAX ? "zs_open_job" : "zs_init_tensor", op->err);
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  zc_op_release(op);
  free(reqs);
  return rc;
}

static int open_job(zs_client *c, const float *const *init_weights, int deferred) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  if (c->opened || c->opening || c->job_closed) {
    int closed = c->job_closed;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return closed ? zc_fail(ZS_EINVAL, "zs_open_job: this client closed its job (zs_close_job); "
                                       "open another client for the next job")
                  : zc_fail(ZS_EINVAL, "zs_open_job: the job is already open (or being opened)");
  }
  c->opening = 1;
  pthread_mutex_unlock(&c->mu);
  /* From here on the model description is frozen (opening), so it is read
   * without the lock. */
  char err[ZC_ERR_LEN];
  uint64_t version = 0;
  uint8_t cs[ZC_MAX_CLIENT_STATE]; /* the job's client state (Open) */
  size_t cs_len = 0;
  if (c->sp.num_tensors == 0) {
    rc = zc_fail(ZS_EINVAL, "zs_open_job: the model has no tensors (zs_add_tensor)");
    goto fail;
  }
  if (c->opt.rank == 0 && !deferred && c->opt.open_mode != ZS_OPEN_JOIN) {
    if (!init_weights) {
      rc = zc_fail(ZS_EINVAL, "zs_open_job: rank 0 must pass the initial weights");
      goto fail;
    }
    for (uint32_t t = 0; t < c->sp.num_tensors; t++)
      if (!init_weights[t]) {
        rc = zc_fail(ZS_EINVAL, "zs_open_job: the initial weights of tensor '%s' are NULL",
                     c->sp.tensors[t].name);
        goto fail;
      }
  }
  if (c->sp.num_groups == 0) {
    spec_group g;
    spec_group_defaults(&g, ZS_OPTIM_ADAMW);
    pthread_mutex_lock(&c->mu);
    rc = zc_add_group_locked(c, &g, NULL);
    pthread_mutex_unlock(&c->mu);
    if (rc != ZS_OK)
      goto fail;
  }
  if (!c->sp.job) {
    c->sp.job = strdup(c->job);
    if (!c->sp.job) {
      rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
      goto fail;
    }
  }
  c->sp.world_size = c->opt.world_size;
  c->sp.grad_accum = c->opt.grad_accum;
  c->sp.num_shards = c->nshards;
  c->sp.split_threshold = c->opt.split_threshold;
  c->sp.reduce = c->opt.grad_reduce == ZS_REDUCE_SUM ? SPEC_REDUCE_SUM : SPEC_REDUCE_MEAN;
  c->sp.param_dtype = c->opt.param_dtype;
  c->sp.pipelined = c->opt.pipelined != 0;
  rc = spec_validate(&c->sp, err, sizeof err);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_open_job: invalid model: %s", err);
    goto fail;
  }
  layout_free(&c->lay);
  rc = layout_build(&c->sp, &c->lay);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_open_job: out of memory computing the layout");
    goto fail;
  }
  for (uint32_t i = 0; i < c->lay.num_pieces; i++) {
    if (c->lay.pieces[i].numel * sizeof(float) > RPC_MAX_MESSAGE_BYTES - 4096) {
      rc = zc_fail(ZS_ERANGE,
                   "zs_open_job: a piece of tensor '%s' has %" PRIu64
                   " elements, too many for one message; use more shards",
                   c->sp.tensors[c->lay.pieces[i].tensor].name, c->lay.pieces[i].numel);
      goto fail;
    }
  }
  c->hash = spec_hash(&c->sp);
  size_t nbits = (size_t)c->sp.num_tensors * c->sp.grad_accum;
  free(c->pushed);
  c->pushed = calloc((nbits + 7) / 8, 1);
  if (!c->pushed) {
    rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
    goto fail;
  }
  if (c->opt.prefetch_depth && !c->slots) {
    c->slots = calloc(c->sp.num_tensors, sizeof *c->slots);
    if (!c->slots) {
      rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
      goto fail;
    }
  }
  rc = open_on_shards(c, &version, cs, &cs_len);
  if (rc != ZS_OK)
    goto fail;
  if (c->opt.rank == 0 && version == 0 && !deferred && c->opt.open_mode != ZS_OPEN_JOIN) {
    rc = init_params(c, init_weights, UINT32_MAX, NULL);
    if (rc != ZS_OK)
      goto fail;
  }
  if (c->opt.transport == ZS_TRANSPORT_DATA) {
    rc = zc_dp_open(c);
    if (rc != ZS_OK)
      goto fail;
  }
  uint64_t first = version + 1;
  if ((rc = zc_member_join(c, &first)) != ZS_OK)
    goto fail;
  pthread_mutex_lock(&c->mu);
  c->step = first;
  /* Resuming a trained job: the scaler continues where the job's version
   * left it (an absent or foreign state leaves it as configured). */
  if (version > 0 && c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    zc_scaler_decode(&c->scaler, cs, cs_len);
  c->opened = 1;
  c->opening = 0;
  c->mark_ns = clock_now_ns();
  c->push_ns = c->pull_ns = 0;
  c->bytes_pushed = c->bytes_pulled = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return ZS_OK;
fail:
  /* The description stays as it was, so the call can be repeated (for
   * instance once the shards are up). */
  pthread_mutex_lock(&c->mu);
  c->opening = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

int zs_open_job(zs_client *c, const float *const *init_weights) {
  return open_job(c, init_weights, 0);
}

int zs_open_job_deferred(zs_client *c) {
  return open_job(c, NULL, 1);
}

/* ---- deferred initial weights ----------------------------------------------------- */

int zs_init_tensor(zs_client *c, uint32_t tensor, const float *weights) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    rc = zc_fail(ZS_ENOTOPEN, "zs_init_tensor: the job is not open (zs_open_job_deferred)");
  else if (tensor >= c->sp.num_tensors)
    rc = zc_fail(ZS_ENOTFOUND, "zs_init_tensor: no tensor %" PRIu32 " (the job has %" PRIu32 ")",
                 tensor, c->sp.num_tensors);
  else if (!weights)
    rc = zc_fail(ZS_EINVAL, "zs_init_tensor: the weights of tensor '%s' are NULL",
                 c->sp.tensors[tensor].name);
  else
    rc = init_params(c, NULL, tensor, weights);
  zc_client_leave(c);
  return rc;
}

/* How many shards answer GetInfo with every piece initialised; ZS_OK or a
 * failure of the calls. */
static int count_initialized(zs_client *c, uint32_t *ready) {
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  zs_request *op = zc_op_get_info(c, &req);
  if (!op)
    return zc_fail(ZS_ENOMEM, "zs_wait_initialized: out of memory");
  int rc = zc_call_all(op);
  *ready = 0;
  for (uint32_t i = 0; i < op->ntasks; i++) {
    const Zshard__V1__GetInfoResponse *r = (const Zshard__V1__GetInfoResponse *)op->tasks[i].resp;
    if (r && r->spec_hash == c->hash && r->initialized)
      (*ready)++;
    if (r)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  }
  zc_op_release(op);
  return rc;
}

int zs_wait_initialized(zs_client *c, uint64_t timeout_ms) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened) {
    zc_client_leave(c);
    return zc_fail(ZS_ENOTOPEN, "zs_wait_initialized: the job is not open");
  }
  uint64_t start = clock_now_ms(), pause_ms = 10;
  uint32_t ready = 0;
  for (;;) {
    rc = count_initialized(c, &ready);
    if (rc != ZS_OK || ready == c->nshards)
      break;
    uint64_t now = clock_now_ms();
    if (timeout_ms && now - start >= timeout_ms) {
      rc = zc_fail(ZS_ETIMEDOUT,
                   "zs_wait_initialized: %" PRIu32 " of %" PRIu32
                   " shards still lack initial weights after %" PRIu64
                   " ms (rank 0 sends them with zs_init_tensor after zs_open_job_deferred)",
                   c->nshards - ready, c->nshards, now - start);
      break;
    }
    /* Polling, backing off to 200 ms: initialising a large model takes
     * seconds to minutes, and GetInfo is cheap for the shard. */
    struct timespec ts = {0, (long)(pause_ms * 1000000)};
    nanosleep(&ts, NULL);
    pause_ms = pause_ms * 2 > 200 ? 200 : pause_ms * 2;
  }
  zc_client_leave(c);
  return rc;
}

/* ---- closing the job ------------------------------------------------------------- */

int zs_close_job(zs_client *c) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  if (!c->opened || c->stepping) {
    int opened = c->opened;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return opened ? zc_fail(ZS_EINVAL, "zs_close_job: a zs_step is running on this client")
                  : zc_fail(ZS_ENOTOPEN, "zs_close_job: the job is not open");
  }
  /* stepping keeps a zs_step out while the shards close the job. */
  c->stepping = 1;
  pthread_mutex_unlock(&c->mu);
  Zshard__V1__CloseJobRequest req = ZSHARD__V1__CLOSE_JOB_REQUEST__INIT;
  req.spec_hash = c->hash;
  req.job = c->sp.job; /* frozen since zs_open_job; packing only reads it */
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op) {
    rc = zc_fail(ZS_ENOMEM, "zs_close_job: out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("CloseJob");
    t->msg = &req.base;
    t->resp_desc = &zshard__v1__close_job_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  rc = zc_call_all(op);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_close_job: %.440s", why);
  }
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  zc_op_release(op);
done:
  pthread_mutex_lock(&c->mu);
  c->stepping = 0;
  if (rc == ZS_OK) {
    c->opened = 0;
    c->job_closed = 1;
  }
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}
