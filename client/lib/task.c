/*
 * task — running one task of a request on a pool worker: a push or pull of
 * one piece over gRPC (the data plane takes those it can, dataplane.c), or
 * one control call; and cancelling one the pool will never run.
 *
 * Copies over gRPC: a push whose buffer dtype is the wire dtype is packed
 * straight from the caller's buffer (protobuf-c's pack is the one copy; gRPC
 * then holds the serialised bytes); with a conversion the piece is first
 * converted into a temporary buffer. A pull converts (or copies) from the
 * unpacked response into the caller's buffer at the piece's offset; a
 * prefetched pull copies once more, from the prefetch buffer (prefetch.c).
 * The data plane copies less (dataplane.c).
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

static int run_push(zs_client *c, zc_task *t, char *err, size_t errlen, uint64_t *bytes) {
  zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  size_t wbytes = zc_op_piece_bytes(op, pc);
  const unsigned char *src = zc_op_piece_src(op, pc);
  void *tmp = NULL;
  Zshard__V1__PushRequest req = ZSHARD__V1__PUSH_REQUEST__INIT;
  Zshard__V1__PushResponse *resp = NULL;
  rpc_status st = {0};
  int rc;

  const uint8_t *payload = src;
  if (op->wire_dtype != op->buf_dtype) {
    tmp = malloc(wbytes);
    if (!tmp)
      return status_fail(err, errlen, ZS_ENOMEM,
                         "out of memory converting tensor '%s' for its push",
                         zc_tensor_name(c, op->tensor));
    zc_convert(tmp, op->wire_dtype, src, op->buf_dtype, pc->numel);
    payload = tmp;
  }
  req.spec_hash = c->hash;
  req.step = op->step;
  req.rank = c->opt.rank;
  req.micro = op->micro;
  req.tensor = pc->tensor;
  req.slice = pc->slice;
  req.dtype = (Zshard__V1__DType)op->wire_dtype;
  /* A payload beyond the server's receive limit goes in chunks of exactly
   * RPC_PUSH_CHUNK_BYTES, one after the other; the server answers the last
   * one for the whole contribution. A smaller one goes whole, as before. */
  if (wbytes > RPC_PUSH_CHUNK_BYTES)
    req.total = wbytes;
  size_t off = 0;
  do {
    size_t n =
        wbytes - off < RPC_PUSH_CHUNK_BYTES || !req.total ? wbytes - off : RPC_PUSH_CHUNK_BYTES;
    req.offset = off;
    /* protobuf-c only reads the bytes: the cast drops const for its field. */
    req.data.data = (uint8_t *)(uintptr_t)(payload + off);
    req.data.len = n;
    if (resp)
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    resp = NULL;
    rc = zc_call(c, t->shard, ZC_METHOD("Push"), &req.base, &zshard__v1__push_response__descriptor,
                 (ProtobufCMessage **)&resp, c->opt.rpc_timeout_ms, &st);
    off += n;
  } while (rc == ZS_OK && off < wbytes);
  free(tmp);
  if (rc != ZS_OK) {
    snprintf(err, errlen,
             "push of tensor '%s' slice %" PRIu32 " (step %" PRIu64 ", micro %" PRIu32
             ") to shard %" PRIu32 " (%.64s) failed: %.300s",
             zc_tensor_name(c, op->tensor), pc->slice, op->step, op->micro, t->shard,
             c->addr[t->shard], st.message[0] ? st.message : zs_strerror(rc));
    return rc;
  }
  /* A duplicate means an earlier attempt of this very contribution arrived:
   * the shard has it, which is what the push wanted. */
  protobuf_c_message_free_unpacked(&resp->base, NULL);
  *bytes = wbytes;
  return ZS_OK;
}

static int run_pull(zs_client *c, zc_task *t, char *err, size_t errlen, uint64_t *bytes) {
  zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  uint64_t wbytes = dtype_bytes(op->wire_dtype, pc->numel);
  Zshard__V1__PullRequest req = ZSHARD__V1__PULL_REQUEST__INIT;
  Zshard__V1__PullResponse *resp = NULL;
  rpc_status st = {0};
  req.spec_hash = c->hash;
  req.tensor = pc->tensor;
  req.slice = pc->slice;
  req.min_version = op->step;
  req.dtype = (Zshard__V1__DType)op->wire_dtype;
  /* The shard may wait up to step_timeout for the version; the call's
   * deadline leaves room for the transfer on top. */
  req.timeout_ms = c->opt.step_timeout_ms;
  int rc = zc_call(c, t->shard, ZC_METHOD("Pull"), &req.base,
                   &zshard__v1__pull_response__descriptor, (ProtobufCMessage **)&resp,
                   (uint64_t)c->opt.step_timeout_ms + c->opt.rpc_timeout_ms, &st);
  if (rc != ZS_OK) {
    snprintf(err, errlen,
             "pull of tensor '%s' slice %" PRIu32 " (version >= %" PRIu64 ") from shard %" PRIu32
             " (%.64s) failed: %.300s",
             zc_tensor_name(c, op->tensor), pc->slice, op->step, t->shard, c->addr[t->shard],
             st.message[0] ? st.message : zs_strerror(rc));
    return rc;
  }
  /* The response is untrusted: its dtype, length and version are checked
   * before a byte reaches the caller's buffer. */
  if ((int)resp->dtype != (int)op->wire_dtype || resp->data.len != wbytes ||
      resp->version < op->step) {
    snprintf(err, errlen,
             "shard %" PRIu32 " (%s) answered the pull of tensor '%s' slice %" PRIu32
             " with dtype %d, %zu bytes, version %" PRIu64 " (expected dtype %d, %" PRIu64
             " bytes, version >= %" PRIu64 ")",
             t->shard, c->addr[t->shard], zc_tensor_name(c, op->tensor), pc->slice,
             (int)resp->dtype, resp->data.len, resp->version, (int)op->wire_dtype, wbytes,
             op->step);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return ZS_EPROTO;
  }
  zc_convert((unsigned char *)op->dst + dtype_bytes(op->buf_dtype, pc->offset), op->buf_dtype,
             resp->data.data, op->wire_dtype, pc->numel);
  *bytes = resp->data.len;
  protobuf_c_message_free_unpacked(&resp->base, NULL);
  return ZS_OK;
}

static int run_call(zs_client *c, zc_task *t, char *err, size_t errlen) {
  rpc_status st = {0};
  int rc = zc_call(c, t->shard, t->method, t->msg, t->resp_desc, &t->resp, t->timeout_ms, &st);
  if (rc != ZS_OK) {
    const char *name = strrchr(t->method, '/');
    snprintf(err, errlen, "%.32s on shard %" PRIu32 " (%.64s) failed: %.300s",
             name ? name + 1 : t->method, t->shard, c->addr[t->shard],
             st.message[0] ? st.message : zs_strerror(rc));
  }
  return rc;
}

static void task_run_one(zs_client *c, zc_task *t);

void zc_task_run(void *ctx, zc_task *list) {
  zs_client *c = ctx;
  /* Coalesced pieces go over the data plane as batches where they can. */
  if (list->next)
    list = zc_dp_run_batch(c, list);
  while (list) {
    /* Running a task may finish its op and free it: read next first. */
    zc_task *next = list->next;
    list->next = NULL;
    task_run_one(c, list);
    list = next;
  }
}

static void task_run_one(zs_client *c, zc_task *t) {
  /* A push or pull to a shard with a data client goes over the data plane
   * and finishes later, from its answer (dataplane.c). */
  if (zc_dp_run(c, t))
    return;
  char err[ZC_ERR_LEN];
  uint64_t bytes = 0;
  int rc = ZS_EINTERNAL;
  err[0] = '\0';
  switch (t->op->kind) {
  case ZC_OP_PUSH:
    rc = run_push(c, t, err, sizeof err, &bytes);
    break;
  case ZC_OP_PULL:
  case ZC_OP_PREFETCH:
    rc = run_pull(c, t, err, sizeof err, &bytes);
    break;
  case ZC_OP_CALL:
    rc = run_call(c, t, err, sizeof err);
    break;
  }
  t->status = rc;
  zc_pool_release(&c->pool, t);
  zc_op_part_done(t->op, rc, err, bytes);
}

void zc_task_cancel(void *ctx, zc_task *t) {
  zs_client *c = ctx;
  /* A data-plane task waiting for its retry or its conversion. */
  free(t->dp_buf);
  t->dp_buf = NULL;
  t->status = ZS_ECANCELED;
  zc_pool_release(&c->pool, t);
  zc_op_part_done(t->op, ZS_ECANCELED, "cancelled: the client is closing", 0);
}
