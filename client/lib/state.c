/*
 * state — the optimizer state of the job's tensors on the shards: reading and
 * writing master weights and moments (zs_state_read, zs_state_write) and the
 * optimizer step counts (the job's, and each tensor's: zs_tensor_steps), for a trainer that moves a
 * run between zshard and another optimizer (torch's state_dict and load_state_dict).
 *
 * A tensor's state is one ReadState / WriteState call per chunk of each of its
 * pieces (STATE_CHUNK_ELEMS elements, 512 KiB), run in parallel by the pool
 * as ZC_OP_CALL tasks. gRPC only: the data plane carries pushes and pulls,
 * not this.
 *
 * Copies: a read is unpacked from the response (protobuf-c, 1 copy) and copied
 * into the caller's buffer at the piece's offset (1); a write is packed
 * straight from the caller's buffer (1).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "internal.h"

/* Half the 1 MiB of the initial weights' chunks: a message of 1 MiB of
 * data is just over the server's mmap threshold (1 MiB, server/main.c) and
 * glibc's on the client once raised, so each one was a fresh mapping and a
 * page fault per 4 KiB on both sides. At 512 KiB the buffers come from the
 * heap and are reused: writing 64 MiB over 2 local shards took the client
 * 0.1 s of CPU instead of 0.54 s, and half the wall time (`zshard import`,
 * zshard.torch.load_pretrained). */
#define STATE_CHUNK_ELEMS 131072u

/* The checks both directions share; the spec and layout are immutable once
 * the job is open. */
static int check_state_args(zs_client *c, const char *fn, uint32_t tensor, zs_state_array which,
                            const void *buf, size_t nbytes) {
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    return zc_fail(ZS_ENOTOPEN, "%s: the job is not open (call zs_open_job first)", fn);
  if (tensor >= c->sp.num_tensors)
    return zc_fail(ZS_ENOTFOUND, "%s: no tensor %" PRIu32 " (the model has %" PRIu32 ")", fn,
                   tensor, c->sp.num_tensors);
  if (which != ZS_STATE_MASTER && which != ZS_STATE_EXP_AVG && which != ZS_STATE_EXP_AVG_SQ)
    return zc_fail(ZS_EINVAL, "%s: array %d is none of ZS_STATE_MASTER, _EXP_AVG, _EXP_AVG_SQ", fn,
                   (int)which);
  const char *name = c->sp.tensors[tensor].name;
  if (!buf)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is NULL", fn, name);
  if ((uintptr_t)buf % _Alignof(float) != 0)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is not aligned to float", fn, name);
  uint64_t numel = c->sp.tensors[tensor].numel;
  if ((uint64_t)nbytes != numel * sizeof(float))
    return zc_fail(ZS_ESIZE,
                   "%s: tensor '%s' has %" PRIu64 " elements = %" PRIu64
                   " bytes of float32, the buffer is %zu bytes",
                   fn, name, numel, numel * (uint64_t)sizeof(float), nbytes);
  return ZS_OK;
}

/* The job is open and has tensor `tensor`. */
static int check_tensor_open(zs_client *c, const char *fn, uint32_t tensor) {
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    return zc_fail(ZS_ENOTOPEN, "%s: the job is not open (call zs_open_job first)", fn);
  if (tensor >= c->sp.num_tensors)
    return zc_fail(ZS_ENOTFOUND, "%s: no tensor %" PRIu32 " (the model has %" PRIu32 ")", fn,
                   tensor, c->sp.num_tensors);
  return ZS_OK;
}

/* The chunks of tensor t: how many calls a whole-tensor transfer makes. */
static uint32_t count_chunks(const zs_client *c, uint32_t t) {
  uint32_t first = c->lay.tensor_first[t], np = layout_tensor_pieces(&c->lay, t);
  uint64_t n = 0;
  for (uint32_t i = 0; i < np; i++)
    n += (c->lay.pieces[first + i].numel + STATE_CHUNK_ELEMS - 1) / STATE_CHUNK_ELEMS;
  return (uint32_t)n;
}

/* Calls fill(arg, task, piece, offset in the piece, count) once per chunk of
 * tensor t, in order. */
typedef void (*chunk_fn)(void *arg, zc_task *t, const layout_piece *pc, uint64_t off, uint64_t n);
static void for_each_chunk(zs_client *c, uint32_t tensor, zs_request *op, chunk_fn fill,
                           void *arg) {
  uint32_t first = c->lay.tensor_first[tensor], np = layout_tensor_pieces(&c->lay, tensor);
  uint32_t k = 0;
  for (uint32_t i = 0; i < np; i++) {
    const layout_piece *pc = &c->lay.pieces[first + i];
    for (uint64_t e = 0; e < pc->numel; e += STATE_CHUNK_ELEMS, k++) {
      uint64_t n = pc->numel - e < STATE_CHUNK_ELEMS ? pc->numel - e : STATE_CHUNK_ELEMS;
      zc_task *t = &op->tasks[k];
      t->shard = pc->shard;
      t->piece = first + i;
      t->timeout_ms = c->opt.rpc_timeout_ms;
      fill(arg, t, pc, e, n);
    }
  }
}

static void free_responses(zs_request *op) {
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
}

/* ---- reading ------------------------------------------------------------------- */

typedef struct read_ctx {
  zs_client *c;
  zs_state_array which;
  Zshard__V1__ReadStateRequest *reqs;
  uint32_t k;
} read_ctx;

static void fill_read(void *arg, zc_task *t, const layout_piece *pc, uint64_t off, uint64_t n) {
  read_ctx *x = arg;
  Zshard__V1__ReadStateRequest r = ZSHARD__V1__READ_STATE_REQUEST__INIT;
  r.spec_hash = x->c->hash;
  r.tensor = pc->tensor;
  r.slice = pc->slice;
  r.array = (Zshard__V1__StateArray)x->which;
  r.offset = off;
  r.count = n;
  x->reqs[x->k] = r;
  t->method = ZC_METHOD("ReadState");
  t->msg = &x->reqs[x->k].base;
  t->resp_desc = &zshard__v1__read_state_response__descriptor;
  t->bytes = (size_t)n * sizeof(float);
  x->k++;
}

static int state_read(zs_client *c, uint32_t tensor, zs_state_array which, float *dst,
                      size_t nbytes) {
  int rc = check_state_args(c, "zs_state_read", tensor, which, dst, nbytes);
  if (rc != ZS_OK)
    return rc;
  const char *name = c->sp.tensors[tensor].name;
  uint32_t n = count_chunks(c, tensor);
  read_ctx x = {.c = c, .which = which, .reqs = calloc(n ? n : 1, sizeof *x.reqs)};
  zs_request *op = zc_op_new(c, ZC_OP_CALL, n);
  if (!x.reqs || !op) {
    free(x.reqs);
    if (op)
      zc_op_release(op);
    return zc_fail(ZS_ENOMEM, "zs_state_read: out of memory");
  }
  for_each_chunk(c, tensor, op, fill_read, &x);
  rc = zc_call_all(op);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_state_read of tensor '%s' (%s): %.400s", name,
                 zs_state_array_name((int)which), why);
  }
  uint64_t vmin = UINT64_MAX, vmax = 0;
  for (uint32_t i = 0; i < n && rc == ZS_OK; i++) {
    const zc_task *t = &op->tasks[i];
    const Zshard__V1__ReadStateResponse *r = (const Zshard__V1__ReadStateResponse *)t->resp;
    const layout_piece *pc = &c->lay.pieces[t->piece];
    /* The answer is untrusted: its length is checked before it is copied. */
    if (r->data.len != (size_t)x.reqs[i].count * sizeof(float)) {
      rc = zc_fail(ZS_EPROTO,
                   "zs_state_read: shard %" PRIu32 " (%s) answered %zu bytes for %" PRIu64
                   " elements of tensor '%s' slice %" PRIu32,
                   t->shard, c->addr[t->shard], r->data.len, x.reqs[i].count, name, pc->slice);
      break;
    }
    memcpy(dst + pc->offset + x.reqs[i].offset, r->data.data, r->data.len);
    vmin = r->version < vmin ? r->version : vmin;
    vmax = r->version > vmax ? r->version : vmax;
  }
  if (rc == ZS_OK && n > 0 && vmin != vmax)
    rc = zc_fail(ZS_ESTEP,
                 "zs_state_read of tensor '%s' (%s): the shards answered versions %" PRIu64
                 " to %" PRIu64 ": a step ran during the read; read while the job is idle",
                 name, zs_state_array_name((int)which), vmin, vmax);
  free_responses(op);
  zc_op_release(op);
  free(x.reqs);
  return rc;
}

int zs_state_read(zs_client *c, uint32_t tensor, zs_state_array which, float *dst, size_t nbytes) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = state_read(c, tensor, which, dst, nbytes);
  zc_client_leave(c);
  return rc;
}

/* ---- writing ------------------------------------------------------------------- */

/* Keeps zs_step (and a second writer on this client) out while a write runs,
 * as zs_close_job does, and refuses while this client has pushed gradients
 * of the current step: the shards would refuse the write anyway. */
static int begin_write(zs_client *c, const char *fn) {
  pthread_mutex_lock(&c->mu);
  int rc = ZS_OK;
  if (!c->opened) {
    rc = zc_fail(ZS_ENOTOPEN, "%s: the job is not open (call zs_open_job first)", fn);
  } else if (c->stepping) {
    rc = zc_fail(ZS_EINVAL, "%s: a zs_step (or another state write) is running on this client", fn);
  } else {
    size_t nbits = (size_t)c->sp.num_tensors * c->sp.grad_accum;
    int pushed = c->inflight_push > 0;
    for (size_t b = 0; b < (nbits + 7) / 8 && !pushed; b++)
      pushed = c->pushed[b] != 0;
    if (pushed)
      rc = zc_fail(ZS_ENOTREADY,
                   "%s: this client pushed gradients of step %" PRIu64
                   "; optimizer state is written only between steps",
                   fn, c->step);
  }
  if (rc == ZS_OK)
    c->stepping = 1;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Ends a write; after new master weights, prefetched pulls of the old ones
 * are dropped: a ready slot is emptied, and one in flight is given a version
 * no pull asks for, so that its data is never used. */
static void end_write(zs_client *c, int master_written) {
  pthread_mutex_lock(&c->mu);
  c->stepping = 0;
  for (uint32_t t = 0; master_written && c->slots && t < c->sp.num_tensors; t++) {
    zc_slot *s = &c->slots[t];
    if (s->state == ZC_SLOT_READY)
      s->state = ZC_SLOT_EMPTY;
    else if (s->state == ZC_SLOT_INFLIGHT && !s->waiter)
      s->version = UINT64_MAX;
  }
  pthread_mutex_unlock(&c->mu);
}

typedef struct write_ctx {
  zs_client *c;
  zs_state_array which;
  const float *src;
  Zshard__V1__WriteStateRequest *reqs;
  uint32_t k;
} write_ctx;

static void fill_write(void *arg, zc_task *t, const layout_piece *pc, uint64_t off, uint64_t n) {
  write_ctx *x = arg;
  Zshard__V1__WriteStateRequest r = ZSHARD__V1__WRITE_STATE_REQUEST__INIT;
  r.spec_hash = x->c->hash;
  r.tensor = pc->tensor;
  r.slice = pc->slice;
  r.array = (Zshard__V1__StateArray)x->which;
  r.offset = off;
  /* Little-endian float32 is the wire format, and the host's; protobuf-c
   * only reads the bytes. */
  r.data.data = (uint8_t *)(uintptr_t)(x->src + pc->offset + off);
  r.data.len = (size_t)n * sizeof(float);
  x->reqs[x->k] = r;
  t->method = ZC_METHOD("WriteState");
  t->msg = &x->reqs[x->k].base;
  t->resp_desc = &zshard__v1__write_state_response__descriptor;
  t->bytes = r.data.len;
  x->k++;
}

static int state_write(zs_client *c, uint32_t tensor, zs_state_array which, const float *src,
                       size_t nbytes) {
  int rc = check_state_args(c, "zs_state_write", tensor, which, src, nbytes);
  if (rc != ZS_OK)
    return rc;
  const char *name = c->sp.tensors[tensor].name;
  uint32_t n = count_chunks(c, tensor);
  write_ctx x = {.c = c, .which = which, .src = src, .reqs = calloc(n ? n : 1, sizeof *x.reqs)};
  zs_request *op = zc_op_new(c, ZC_OP_CALL, n);
  if (!x.reqs || !op) {
    free(x.reqs);
    if (op)
      zc_op_release(op);
    return zc_fail(ZS_ENOMEM, "zs_state_write: out of memory");
  }
  for_each_chunk(c, tensor, op, fill_write, &x);
  if ((rc = begin_write(c, "zs_state_write")) == ZS_OK) {
    rc = zc_call_all(op);
    if (rc != ZS_OK) {
      char why[ZC_ERR_LEN];
      snprintf(why, sizeof why, "%s", zs_last_error());
      rc = zc_fail(rc, "zs_state_write of tensor '%s' (%s): %.400s", name,
                   zs_state_array_name((int)which), why);
    }
    /* Even a failed write may have changed some chunks. */
    end_write(c, which == ZS_STATE_MASTER);
    free_responses(op);
  }
  zc_op_release(op);
  free(x.reqs);
  return rc;
}

int zs_state_write(zs_client *c, uint32_t tensor, zs_state_array which, const float *src,
                   size_t nbytes) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = state_write(c, tensor, which, src, nbytes);
  zc_client_leave(c);
  return rc;
}

/* ---- the step count ------------------------------------------------------------- */

static int optimizer_steps(zs_client *c, uint64_t *steps) {
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    return zc_fail(ZS_ENOTOPEN, "zs_optimizer_steps: the job is not open (call zs_open_job first)");
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op)
    return zc_fail(ZS_ENOMEM, "zs_optimizer_steps: out of memory");
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("GetInfo");
    t->msg = &req.base;
    t->resp_desc = &zshard__v1__get_info_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  int rc = zc_call_all(op);
  uint64_t first = 0;
  for (uint32_t i = 0; i < c->nshards && rc == ZS_OK; i++) {
    const Zshard__V1__GetInfoResponse *r = (const Zshard__V1__GetInfoResponse *)op->tasks[i].resp;
    if (r->spec_hash != c->hash)
      rc = zc_fail(ZS_EHASH,
                   "zs_optimizer_steps: shard %" PRIu32 " (%s) holds spec hash %016" PRIx64
                   ", not this job's %016" PRIx64,
                   i, c->addr[i], r->spec_hash, c->hash);
    else if (i == 0)
      first = r->optimizer_steps;
    else if (r->optimizer_steps != first)
      rc = zc_fail(ZS_EBEHIND,
                   "zs_optimizer_steps: shard 0 counts %" PRIu64 " optimizer steps, shard %" PRIu32
                   " (%s) %" PRIu64 ": a shard is behind the cluster",
                   first, i, c->addr[i], r->optimizer_steps);
  }
  if (rc == ZS_OK && steps)
    *steps = first;
  free_responses(op);
  zc_op_release(op);
  return rc;
}

int zs_optimizer_steps(zs_client *c, uint64_t *steps) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = optimizer_steps(c, steps);
  zc_client_leave(c);
  return rc;
}

static int set_optimizer_steps(zs_client *c, uint64_t steps) {
  int rc = begin_write(c, "zs_set_optimizer_steps");
  if (rc != ZS_OK)
    return rc;
  Zshard__V1__WriteStateRequest req = ZSHARD__V1__WRITE_STATE_REQUEST__INIT;
  req.spec_hash = c->hash;
  req.set_optimizer_steps = 1;
  req.optimizer_steps = steps;
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op) {
    end_write(c, 0);
    return zc_fail(ZS_ENOMEM, "zs_set_optimizer_steps: out of memory");
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("WriteState");
    t->msg = &req.base;
    t->resp_desc = &zshard__v1__write_state_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  rc = zc_call_all(op);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_set_optimizer_steps: %.440s", why);
  }
  end_write(c, 0);
  free_responses(op);
  zc_op_release(op);
  return rc;
}

int zs_set_optimizer_steps(zs_client *c, uint64_t steps) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = set_optimizer_steps(c, steps);
  zc_client_leave(c);
  return rc;
}

/* ---- a tensor's step count ------------------------------------------------------ */

/* One call per piece of tensor t (reqs: one request each, filled by the
 * caller), run in parallel; the responses are in op's tasks. */
static zs_request *piece_calls(zs_client *c, uint32_t tensor, const char *method,
                               ProtobufCMessage *const *reqs,
                               const ProtobufCMessageDescriptor *resp_desc) {
  uint32_t first = c->lay.tensor_first[tensor], np = layout_tensor_pieces(&c->lay, tensor);
  zs_request *op = zc_op_new(c, ZC_OP_CALL, np);
  for (uint32_t i = 0; op && i < np; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = c->lay.pieces[first + i].shard;
    t->piece = first + i;
    t->method = method;
    t->msg = reqs[i];
    t->resp_desc = resp_desc;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  return op;
}

static int tensor_steps(zs_client *c, uint32_t tensor, uint64_t *steps) {
  int rc = check_tensor_open(c, "zs_tensor_steps", tensor);
  if (rc != ZS_OK)
    return rc;
  uint32_t first = c->lay.tensor_first[tensor], np = layout_tensor_pieces(&c->lay, tensor);
  Zshard__V1__ReadStateRequest *reqs = calloc(np, sizeof *reqs);
  ProtobufCMessage **msgs = calloc(np, sizeof *msgs);
  zs_request *op = NULL;
  if (reqs && msgs) {
    for (uint32_t i = 0; i < np; i++) {
      /* No elements: the answer carries the count alone. */
      zshard__v1__read_state_request__init(&reqs[i]);
      reqs[i].spec_hash = c->hash;
      reqs[i].tensor = tensor;
      reqs[i].slice = c->lay.pieces[first + i].slice;
      reqs[i].array = ZSHARD__V1__STATE_ARRAY__STATE_ARRAY_MASTER;
      msgs[i] = &reqs[i].base;
    }
    op = piece_calls(c, tensor, ZC_METHOD("ReadState"), msgs,
                     &zshard__v1__read_state_response__descriptor);
  }
  if (!op) {
    free(reqs);
    free(msgs);
    return zc_fail(ZS_ENOMEM, "zs_tensor_steps: out of memory");
  }
  const char *name = c->sp.tensors[tensor].name;
  rc = zc_call_all(op);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_tensor_steps of tensor '%s': %.400s", name, why);
  }
  uint64_t n0 = 0;
  for (uint32_t i = 0; i < np && rc == ZS_OK; i++) {
    uint64_t n = ((const Zshard__V1__ReadStateResponse *)op->tasks[i].resp)->tensor_steps;
    if (i == 0)
      n0 = n;
    else if (n != n0)
      rc = zc_fail(ZS_EBEHIND,
                   "zs_tensor_steps: slice %" PRIu32 " of tensor '%s' counts %" PRIu64
                   " steps on shard %" PRIu32 ", slice %" PRIu32 " %" PRIu64 " on shard %" PRIu32
                   ": a shard is behind the cluster",
                   c->lay.pieces[first].slice, name, n0, op->tasks[0].shard,
                   c->lay.pieces[first + i].slice, n, op->tasks[i].shard);
  }
  if (rc == ZS_OK && steps)
    *steps = n0;
  free_responses(op);
  zc_op_release(op);
  free(reqs);
  free(msgs);
  return rc;
}

int zs_tensor_steps(zs_client *c, uint32_t tensor, uint64_t *steps) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = tensor_steps(c, tensor, steps);
  zc_client_leave(c);
  return rc;
}

static int set_tensor_steps(zs_client *c, uint32_t tensor, uint64_t steps) {
  int rc = check_tensor_open(c, "zs_set_tensor_steps", tensor);
  if (rc != ZS_OK)
    return rc;
  uint32_t first = c->lay.tensor_first[tensor], np = layout_tensor_pieces(&c->lay, tensor);
  Zshard__V1__WriteStateRequest *reqs = calloc(np, sizeof *reqs);
  ProtobufCMessage **msgs = calloc(np, sizeof *msgs);
  zs_request *op = NULL;
  if (reqs && msgs) {
    for (uint32_t i = 0; i < np; i++) {
      zshard__v1__write_state_request__init(&reqs[i]);
      reqs[i].spec_hash = c->hash;
      reqs[i].tensor = tensor;
      reqs[i].slice = c->lay.pieces[first + i].slice;
      reqs[i].set_tensor_steps = 1;
      reqs[i].tensor_steps = steps;
      msgs[i] = &reqs[i].base;
    }
    op = piece_calls(c, tensor, ZC_METHOD("WriteState"), msgs,
                     &zshard__v1__write_state_response__descriptor);
  }
  if (!op) {
    free(reqs);
    free(msgs);
    return zc_fail(ZS_ENOMEM, "zs_set_tensor_steps: out of memory");
  }
  const char *name = c->sp.tensors[tensor].name;
  if ((rc = begin_write(c, "zs_set_tensor_steps")) == ZS_OK) {
    rc = zc_call_all(op);
    if (rc != ZS_OK) {
      char why[ZC_ERR_LEN];
      snprintf(why, sizeof why, "%s", zs_last_error());
      rc = zc_fail(rc, "zs_set_tensor_steps of tensor '%s': %.400s", name, why);
    }
    /* A server from before the counts ignores the request's fields and
     * answers 0. */
    for (uint32_t i = 0; i < np && rc == ZS_OK; i++)
      if (((const Zshard__V1__WriteStateResponse *)op->tasks[i].resp)->tensor_steps != steps)
        rc = zc_fail(ZS_EUNIMPL,
                     "zs_set_tensor_steps: shard %" PRIu32
                     " (%s) keeps no step count per tensor (a server from before 0.3?)",
                     op->tasks[i].shard, c->addr[op->tasks[i].shard]);
    end_write(c, 0);
    free_responses(op);
  }
  zc_op_release(op);
  free(reqs);
  free(msgs);
  return rc;
}

int zs_set_tensor_steps(zs_client *c, uint32_t tensor, uint64_t steps) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = set_tensor_steps(c, tensor, steps);
  zc_client_leave(c);
  return rc;
}
