/*
 * transfer — requests (ops): pushes of gradients, pulls of parameters,
 * prefetches, and the control calls made to every shard at once.
 *
 * An op is split into tasks, one per piece (or per shard for a control call),
 * which the pool runs in parallel; an isolated push or pull of one piece in
 * its wire dtype skips the pool over the data plane (submit_inline). Each
 * task finishes one part of the op; the last part finishes the op: the
 * client's bookkeeping is updated, the callback (if any) runs, waiters wake,
 * and the op's in-flight reference is dropped. The caller's handle is the
 * other reference, dropped by zs_wait.
 *
 * Copies over gRPC: a push whose buffer dtype is the wire dtype is packed
 * straight from the caller's buffer (protobuf-c's pack is the one copy; gRPC
 * then holds the serialised bytes); with a conversion the piece is first
 * converted into a temporary buffer. A pull converts (or copies) from the
 * unpacked response into the caller's buffer at the piece's offset; a
 * prefetched pull copies once more, from the prefetch buffer. The data plane
 * copies less (dataplane.c).
 */
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"

/* ---- conversion ----------------------------------------------------------- */

/* Whole blocks of any dtype (dtype.h), 4 KiB of floats on the stack. */
#define CONVERT_CHUNK (4 * DTYPE_MAX_BLOCK)

void zc_convert(void *dst, zs_dtype dd, const void *src, zs_dtype sd, size_t n) {
  if (dd == sd) {
    memcpy(dst, src, (size_t)dtype_bytes(dd, n));
    return;
  }
  if (dd == ZS_DTYPE_FP32) {
    dtype_to_f32(sd, src, dst, n);
    return;
  }
  if (sd == ZS_DTYPE_FP32 && ((uintptr_t)src % _Alignof(float)) == 0) {
    dtype_from_f32(dd, src, dst, n);
    return;
  }
  /* 16-bit to another 16-bit format, or unaligned fp32: through an aligned
   * float chunk on the stack, so no allocation is needed. A chunk holds whole
   * blocks, so the one at element i starts at byte dtype_bytes(i). */
  float tmp[CONVERT_CHUNK];
  const unsigned char *s = src;
  unsigned char *d = dst;
  for (size_t i = 0; i < n; i += CONVERT_CHUNK) {
    size_t k = n - i < CONVERT_CHUNK ? n - i : CONVERT_CHUNK;
    if (sd == ZS_DTYPE_FP32)
      memcpy(tmp, s + i * sizeof(float), k * sizeof(float));
    else
      dtype_to_f32(sd, s + dtype_bytes(sd, i), tmp, k);
    dtype_from_f32(dd, tmp, d + dtype_bytes(dd, i), k);
  }
}

/* ---- ops -------------------------------------------------------------------- */

/* The cache of requests. A push or pull of a tensor over up to
 * OP_CACHED_TASKS shards is not freed when its last reference goes but kept
 * for the next one: its allocation (1.2 KiB, zeroed, too large for glibc's
 * per-thread cache, and freed on another thread, a worker) and the set-up of
 * its lock and condition variable were 14 % of a batched submission's
 * instructions (docs/PERFORMANCE.md, "Small calls"). The cache is the
 * process's, not a client's: a caller may zs_wait a request after
 * zs_client_close freed its client. A batch takes the cached requests it
 * needs in one lock round trip (op_cache_take). Bounded: a burst larger than
 * OP_CACHE_MAX requests frees the rest as before. */
#define OP_CACHED_TASKS 4
#define OP_CACHE_MAX 256
#define ZC_OP_RESET_FROM offsetof(zs_request, c)

static pthread_mutex_t op_cache_mu = PTHREAD_MUTEX_INITIALIZER;
/* (op_cache_mu) The cached requests, linked through cache_next, and how
 * many. */
static zs_request *op_cache;
static uint32_t op_cache_len;

/* Moves up to n cached requests onto the list *spare (the caller's). */
static void op_cache_take(uint32_t n, zs_request **spare) {
  pthread_mutex_lock(&op_cache_mu);
  for (; n > 0 && op_cache; n--) {
    zs_request *op = op_cache;
    op_cache = op->cache_next;
    op_cache_len--;
    op->cache_next = *spare;
    *spare = op;
  }
  pthread_mutex_unlock(&op_cache_mu);
}

/* Puts a list of requests (none in use) back into the cache, freeing what
 * does not fit. */
static void op_cache_put(zs_request *list) {
  zs_request *excess = NULL;
  pthread_mutex_lock(&op_cache_mu);
  while (list) {
    zs_request *op = list;
    list = op->cache_next;
    if (op_cache_len < OP_CACHE_MAX) {
      op->cache_next = op_cache;
      op_cache = op;
      op_cache_len++;
    } else {
      op->cache_next = excess;
      excess = op;
    }
  }
  pthread_mutex_unlock(&op_cache_mu);
  while (excess) {
    zs_request *op = excess;
    excess = op->cache_next;
    pthread_mutex_destroy(&op->mu);
    pthread_cond_destroy(&op->cv);
    free(op);
  }
}

/* zc_op_new, taking a cached request from *spare (a batch's) first when
 * spare is not NULL, else from the cache. */
static zs_request *op_new_from(zs_request **spare, struct zs_client *c, zc_op_kind kind,
                               uint32_t ntasks) {
  zs_request *op = NULL;
  if (ntasks <= OP_CACHED_TASKS) {
    zs_request *own = NULL, **from = spare ? spare : &own;
    if (!*from)
      op_cache_take(1, from);
    if ((op = *from) != NULL)
      *from = op->cache_next;
  }
  const uint32_t cap = ntasks <= OP_CACHED_TASKS ? OP_CACHED_TASKS : ntasks;
  if (!op) {
    op = malloc(offsetof(zs_request, tasks) + (size_t)cap * sizeof(zc_task));
    if (!op) {
      zc_fail(ZS_ENOMEM, "out of memory allocating a request of %" PRIu32 " tasks", ntasks);
      return NULL;
    }
    pthread_mutex_init(&op->mu, NULL);
    pthread_cond_init(&op->cv, NULL);
    op->cap = cap;
  }
  memset((char *)op + ZC_OP_RESET_FROM, 0,
         offsetof(zs_request, tasks) - ZC_OP_RESET_FROM + (size_t)ntasks * sizeof(zc_task));
  op->err[0] = '\0';
  atomic_init(&op->refs, 1);
  op->c = c;
  op->kind = kind;
  op->ntasks = ntasks;
  op->pending = ntasks;
  for (uint32_t i = 0; i < ntasks; i++)
    op->tasks[i].op = op;
  return op;
}

struct zs_request *zc_op_new(struct zs_client *c, zc_op_kind kind, uint32_t ntasks) {
  return op_new_from(NULL, c, kind, ntasks);
}

struct zs_request *zc_op_get_info(struct zs_client *c, const Zshard__V1__GetInfoRequest *req) {
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  for (uint32_t i = 0; op && i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("GetInfo");
    t->msg = &req->base; /* shared: packing only reads it */
    t->resp_desc = &zshard__v1__get_info_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  return op;
}

void zc_op_register_locked(struct zs_request *op) {
  op->c->inflight++;
  atomic_fetch_add(&op->c->unfinished, 1);
  if (op->kind == ZC_OP_PUSH)
    op->c->inflight_push++;
}

/* The fast path of a transfer (zc_dp_submit_inline): an op of one task that
 * is the client's only transfer in flight, while the pool is not held, is
 * submitted to its data client on the calling thread. The pool's hand-off
 * costs an isolated round trip a wake-up of a worker (docs/PERFORMANCE.md, "Small
 * "Where a 4 KiB round trip's time goes"); a burst of transfers, each with
 * others in flight, goes through the pool, whose workers coalesce their
 * small pieces into batches. Returns 1 when the op was taken. */
static int submit_inline(zs_request *op) {
  zs_client *c = op->c;
  if (op->ntasks != 1 || (op->kind != ZC_OP_PUSH && op->kind != ZC_OP_PULL) || !c->dp)
    return 0;
  return atomic_load(&c->unfinished) == 1 && !zc_pool_held(&c->pool) &&
         zc_dp_submit_inline(c, &op->tasks[0]);
}

void zc_op_submit(struct zs_request *op) {
  if (!submit_inline(op))
    zc_pool_submit(&op->c->pool, op->tasks, op->ntasks);
}

void zc_op_release(struct zs_request *op) {
  if (atomic_fetch_sub(&op->refs, 1) != 1)
    return;
  free(op->owned_src); /* a push refused before it was queued */
  op->owned_src = NULL;
  if (op->cap == OP_CACHED_TASKS) {
    op->cache_next = NULL;
    op_cache_put(op);
    return;
  }
  pthread_mutex_destroy(&op->mu);
  pthread_cond_destroy(&op->cv);
  free(op);
}

static void prefetch_finish(zs_client *c, zs_request *op, int status, const char *msg);

/* The last part of `op` is done. */
static void op_finish(zs_request *op) {
  zs_client *c = op->c;
  /* No task of op runs any more, so its fields are stable without op->mu. */
  int status = op->status;
  atomic_fetch_sub(&c->unfinished, 1);
  switch (op->kind) {
  case ZC_OP_PUSH:
    free(op->owned_src);
    op->owned_src = NULL;
    pthread_mutex_lock(&c->mu);
    c->inflight_push--;
    c->bytes_pushed += op->bytes;
    /* A pipelined zs_step returns before its pushes are done (step.c): a
     * failure of the step before is the next zs_step's to report. */
    if (status != ZS_OK && (op->step == c->step || op->step + 1 == c->step)) {
      /* The step cannot complete without this contribution: zs_step reports
       * it, and the trainer may push the tensor again. */
      if (c->step_error == ZS_OK) {
        c->step_error = status;
        snprintf(c->step_err, sizeof c->step_err, "%s", op->err);
      }
      size_t bit = (size_t)op->tensor * c->sp.grad_accum + op->micro;
      if (op->step == c->step)
        c->pushed[bit / 8] &= (uint8_t) ~(1u << (bit % 8));
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    break;
  case ZC_OP_PULL:
    pthread_mutex_lock(&c->mu);
    c->bytes_pulled += op->bytes;
    pthread_mutex_unlock(&c->mu);
    break;
  case ZC_OP_PREFETCH:
    prefetch_finish(c, op, status, op->err);
    break;
  case ZC_OP_CALL:
    break;
  }
  if (op->cb) {
    /* The callback reads the failure's sentence with zs_last_error(), as a
     * caller of zs_wait would: it is this thread's last error now. */
    if (status != ZS_OK)
      zc_fail_msg(status, op->err);
    op->cb(op->cb_arg, status);
  }
  pthread_mutex_lock(&op->mu);
  op->done = 1;
  pthread_cond_broadcast(&op->cv);
  pthread_mutex_unlock(&op->mu);
  /* The last access to the client: zs_client_close frees it once its
   * in-flight count is zero. */
  pthread_mutex_lock(&c->mu);
  if (--c->inflight == 0)
    pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  zc_op_release(op);
}

void zc_op_part_done(struct zs_request *op, int status, const char *msg, uint64_t bytes) {
  pthread_mutex_lock(&op->mu);
  if (status != ZS_OK && op->status == ZS_OK) {
    op->status = status;
    snprintf(op->err, sizeof op->err, "%s", msg && *msg ? msg : zs_strerror(status));
  }
  op->bytes += bytes;
  int last = --op->pending == 0;
  pthread_mutex_unlock(&op->mu);
  if (last)
    op_finish(op);
}

int zc_op_wait_done(struct zs_request *op) {
  pthread_mutex_lock(&op->mu);
  while (!op->done)
    pthread_cond_wait(&op->cv, &op->mu);
  int status = op->status;
  if (status != ZS_OK)
    zc_fail_msg(status, op->err);
  pthread_mutex_unlock(&op->mu);
  return status;
}

int zc_call_all(struct zs_request *op) {
  zs_client *c = op->c;
  /* One reference for the caller, who reads the responses after the wait. */
  atomic_fetch_add(&op->refs, 1);
  pthread_mutex_lock(&c->mu);
  zc_op_register_locked(op);
  pthread_mutex_unlock(&c->mu);
  zc_op_submit(op);
  return zc_op_wait_done(op);
}

/* ---- calls with retries ----------------------------------------------------- */

int zc_backoff_wait(struct zs_client *c, uint64_t ms) {
  uint64_t until = clock_now_ms() + ms;
  pthread_mutex_lock(&c->mu);
  while (!c->closing) {
    uint64_t now = clock_now_ms();
    if (now >= until)
      break;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t wait_ms = until - now;
    ts.tv_sec += (time_t)(wait_ms / 1000);
    ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
  }
  int closing = c->closing;
  pthread_mutex_unlock(&c->mu);
  return closing;
}

/* Whether `method` (a full gRPC path) is Push or Pull. */
static int is_transfer(const char *method) {
  const char *m = strrchr(method, '/');
  return m && (strcmp(m, "/Push") == 0 || strcmp(m, "/Pull") == 0);
}

int zc_call(struct zs_client *c, uint32_t shard, const char *method, const ProtobufCMessage *req,
            const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
            uint64_t timeout_ms, rpc_status *st) {
  /* A replica set has its own loop: the same retries, plus the term and the
   * failover (replica.c). A shard that is not replicated takes this one. */
  if (c->rs[shard].n > 1)
    return zc_replica_call(c, shard, method, req, resp_desc, resp, timeout_ms, st);
  uint64_t backoff = c->opt.retry_initial_ms;
  for (uint32_t attempt = 0;; attempt++) {
    int rc = rpc_call(c->rs[shard].chan[0], method, req, resp_desc, resp, timeout_ms, st);
    /* Only UNAVAILABLE and CANCELLED are retried, and RESOURCE_EXHAUSTED for
     * the transfers: the call did not reach the shard's logic or the shard
     * went away (a server shutting down cancels the calls it no longer
     * admits; this client never cancels its own blocking calls, it lets
     * deadlines expire), or a budget of the gRPC listener refused a transfer
     * before acting (docs/OPERATIONS.md, "Limits": room comes back as other
     * calls finish; a limit on other calls, such as a job's size, is for
     * good); and every zshard call is idempotent (a repeated push is
     * acknowledged as a duplicate, a repeated apply returns the recorded
     * outcome). */
    int transient = st->grpc_code == ZC_GRPC_UNAVAILABLE || st->grpc_code == ZC_GRPC_CANCELLED ||
                    (st->grpc_code == ZC_GRPC_RESOURCE_EXHAUSTED && is_transfer(method));
    if (rc == ZS_OK || !transient || attempt >= c->opt.max_retries)
      return rc;
    atomic_fetch_add(&c->retries, 1);
    if (zc_backoff_wait(c, backoff))
      return rc;
    backoff *= 2;
    if (backoff > c->opt.retry_max_ms)
      backoff = c->opt.retry_max_ms;
  }
}

/* ---- tasks ------------------------------------------------------------------ */

static const char *tensor_name(const zs_client *c, uint32_t t) {
  return c->sp.tensors[t].name;
}

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
                         tensor_name(c, op->tensor));
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
             tensor_name(c, op->tensor), pc->slice, op->step, op->micro, t->shard,
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
             tensor_name(c, op->tensor), pc->slice, op->step, t->shard, c->addr[t->shard],
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
             t->shard, c->addr[t->shard], tensor_name(c, op->tensor), pc->slice, (int)resp->dtype,
             resp->data.len, resp->version, (int)op->wire_dtype, wbytes, op->step);
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

/* ---- prefetch ----------------------------------------------------------------- */

/* The dtype a prefetch slot holds a tensor in: the wire dtype, except that
 * a block-quantized one is decoded to fp32 on arrival. Its blocks start
 * afresh in every piece (a piece is an array of its own), so the pieces of
 * a tensor are not one array of that dtype and cannot be laid side by side
 * at dtype_bytes(offset). */
static zs_dtype slot_dtype(zs_dtype wire) {
  const dtype_codec *k = dtype_codec_of(wire);
  return k && k->block > 1 ? ZS_DTYPE_FP32 : wire;
}

uint32_t zc_prefetch_locked(struct zs_client *c, uint32_t first, uint32_t count,
                            uint64_t min_version, zs_dtype wire, struct zs_request **ops) {
  uint32_t n = 0;
  if (!c->slots || c->closing)
    return 0;
  zs_dtype last = wire;
  for (uint32_t t = first; t < c->sp.num_tensors && t - first < count; t++) {
    zc_slot *s = &c->slots[t];
    /* The tensor's group may have a wire dtype of its own; otherwise the
     * client's, or that of the pull that led here. */
    zs_dtype gw = c->group_pull[c->sp.tensors[t].group];
    wire = gw ? gw : c->opt.pull_dtype ? c->opt.pull_dtype : last;
    if (s->state == ZC_SLOT_INFLIGHT || s->state == ZC_SLOT_BUSY)
      continue;
    if (s->state == ZC_SLOT_READY && s->version == min_version && s->wire == wire)
      continue;
    size_t need = (size_t)dtype_bytes(slot_dtype(wire), c->sp.tensors[t].numel);
    if (s->cap < need) {
      void *buf = realloc(s->buf, need);
      if (!buf)
        break; /* prefetching is an optimisation: the pull will fetch it */
      s->buf = buf;
      s->cap = need;
    }
    uint32_t first_piece = c->lay.tensor_first[t], npieces = layout_tensor_pieces(&c->lay, t);
    zs_request *op = zc_op_new(c, ZC_OP_PREFETCH, npieces);
    if (!op)
      break;
    op->tensor = t;
    op->step = min_version;
    op->dst = s->buf;
    op->buf_dtype = slot_dtype(wire);
    op->wire_dtype = wire;
    for (uint32_t i = 0; i < npieces; i++) {
      const layout_piece *pc = &c->lay.pieces[first_piece + i];
      op->tasks[i].shard = pc->shard;
      op->tasks[i].piece = first_piece + i;
      op->tasks[i].bytes = dtype_bytes(wire, pc->numel);
    }
    s->state = ZC_SLOT_INFLIGHT;
    s->version = min_version;
    s->wire = wire;
    s->waiter = NULL;
    zc_op_register_locked(op);
    ops[n++] = op;
  }
  return n;
}

static void prefetch_finish(zs_client *c, zs_request *op, int status, const char *msg) {
  zc_slot *s = &c->slots[op->tensor];
  pthread_mutex_lock(&c->mu);
  zs_request *waiter = s->waiter;
  s->waiter = NULL;
  c->bytes_pulled += op->bytes;
  if (status != ZS_OK)
    s->state = ZC_SLOT_EMPTY;
  else
    s->state = waiter ? ZC_SLOT_BUSY : ZC_SLOT_READY;
  pthread_mutex_unlock(&c->mu);
  if (!waiter)
    return;
  if (status == ZS_OK) {
    /* BUSY keeps new prefetches away from buf while it is copied out. */
    zc_convert(waiter->dst, waiter->buf_dtype, s->buf, slot_dtype(s->wire),
               c->sp.tensors[op->tensor].numel);
    pthread_mutex_lock(&c->mu);
    s->state = ZC_SLOT_EMPTY;
    pthread_mutex_unlock(&c->mu);
  }
  zc_op_part_done(waiter, status, msg, 0);
}

void zc_slots_free(struct zs_client *c) {
  if (!c->slots)
    return;
  for (uint32_t t = 0; t < c->sp.num_tensors; t++)
    free(c->slots[t].buf);
  free(c->slots);
  c->slots = NULL;
}

/* ---- the public transfer functions ------------------------------------------- */

zs_dtype zc_wire_dtype(zs_dtype configured, zs_dtype buf) {
  return configured ? configured : buf;
}

/* The wire dtypes of tensor t: its group's, else the client's, else the
 * buffer's. */
static zs_dtype push_wire(const zs_client *c, uint32_t t, zs_dtype buf) {
  zs_dtype g = c->group_push[c->sp.tensors[t].group];
  return zc_wire_dtype(g ? g : c->opt.push_dtype, buf);
}

static zs_dtype pull_wire(const zs_client *c, uint32_t t, zs_dtype buf) {
  zs_dtype g = c->group_pull[c->sp.tensors[t].group];
  return zc_wire_dtype(g ? g : c->opt.pull_dtype, buf);
}

/* Checks that the job is open. */
static int check_opened(zs_client *c, const char *fn) {
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    return zc_fail(ZS_ENOTOPEN, "%s: the job is not open (call zs_open_job first)", fn);
  return ZS_OK;
}

/* Checks that the open job has the tensor. Once opened, the spec and the
 * layout never change: read without lock. */
static int check_tensor_id(zs_client *c, const char *fn, uint32_t tensor) {
  if (tensor >= c->sp.num_tensors)
    return zc_fail(ZS_ENOTFOUND, "%s: no tensor %" PRIu32 " (the model has %" PRIu32 ")", fn,
                   tensor, c->sp.num_tensors);
  return ZS_OK;
}

/* A push of no gradient: grad NULL and nbytes 0 (zs_push). */
static int is_nograd(const void *grad, size_t nbytes) {
  return !grad && nbytes == 0;
}

/* Checks that the job is open and has the tensor. */
static int check_tensor(zs_client *c, const char *fn, uint32_t tensor) {
  int rc = check_opened(c, fn);
  return rc != ZS_OK ? rc : check_tensor_id(c, fn, tensor);
}

/* Checks the arguments shared by push and pull, the job being open. */
static int check_entry(zs_client *c, const char *fn, uint32_t tensor, const void *buf,
                       zs_dtype dtype, size_t nbytes) {
  int rc = check_tensor_id(c, fn, tensor);
  if (rc != ZS_OK)
    return rc;
  if (!dtype_valid((int)dtype))
    return zc_fail(ZS_EDTYPE, "%s: dtype %d is not %s", fn, (int)dtype, dtype_names());
  if (!buf)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is NULL", fn, tensor_name(c, tensor));
  /* A block-quantized dtype is a wire format only: its blocks restart in
   * every piece, so a tensor split over shards is not one array of it. */
  size_t es = zs_dtype_size(dtype);
  if (es == 0)
    return zc_fail(ZS_EDTYPE,
                   "%s: %s is a wire dtype (push_dtype, pull_dtype), not a buffer dtype: pass "
                   "an fp32, fp16 or bf16 buffer",
                   fn, dtype_codec_of((int)dtype)->name);
  uint64_t numel = c->sp.tensors[tensor].numel, want = dtype_bytes(dtype, numel);
  if ((uint64_t)nbytes != want)
    return zc_fail(ZS_ESIZE,
                   "%s: tensor '%s' has %" PRIu64 " elements = %" PRIu64
                   " bytes of this dtype, the buffer is %zu bytes",
                   fn, tensor_name(c, tensor), numel, want, nbytes);
  if ((uintptr_t)buf % es != 0)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is not aligned to %zu bytes", fn,
                   tensor_name(c, tensor), es);
  return ZS_OK;
}

/* Checks the arguments shared by push and pull. */
static int check_buffer(zs_client *c, const char *fn, uint32_t tensor, const void *buf,
                        zs_dtype dtype, size_t nbytes) {
  int rc = check_opened(c, fn);
  return rc != ZS_OK ? rc : check_entry(c, fn, tensor, buf, dtype, nbytes);
}

/* Waits for a request the call itself made (req == NULL: synchronous). */
static int wait_own(zs_request *op, zc_op_kind kind) {
  uint64_t t0 = clock_now_ns();
  int rc = zc_op_wait_done(op);
  zc_account_wait(op->c, kind, clock_now_ns() - t0);
  zc_op_release(op);
  return rc;
}

/* ---- error feedback ------------------------------------------------------------ */

/* Elements converted at a time: whole blocks of every dtype, on the stack. */
#define EF_CHUNK 2048
_Static_assert(EF_CHUNK % DTYPE_MAX_BLOCK == 0, "EF chunks hold whole blocks");

void zc_ef_free(struct zs_client *c) {
  if (!c->ef_resid)
    return;
  for (uint32_t t = 0; t < c->sp.num_tensors; t++)
    free(c->ef_resid[t]);
  free(c->ef_resid);
  c->ef_resid = NULL;
}

/* Error feedback, with ef_mu held: v = g + r, and r = v - decode(encode(v))
 * with the wire dtype's blocks starting at every piece, as the pushes encode
 * them; *out gets v (the caller's to free). A non-finite v (an overflowed
 * step, which the shards will skip) leaves a zero residual, so one bad step
 * does not poison the next ones. Two passes over the tensor, no allocation
 * but v (and r at the tensor's first push). */
static int ef_apply_locked(zs_client *c, uint32_t tensor, const float *g, zs_dtype wire,
                           float **out) {
  uint64_t numel = c->sp.tensors[tensor].numel;
  if (!c->ef_resid && !(c->ef_resid = calloc(c->sp.num_tensors, sizeof *c->ef_resid)))
    return ZS_ENOMEM;
  float *r = c->ef_resid[tensor];
  if (!r && !(r = c->ef_resid[tensor] = calloc((size_t)numel, sizeof *r)))
    return ZS_ENOMEM;
  float *v = malloc((size_t)numel * sizeof *v);
  if (!v)
    return ZS_ENOMEM;
  unsigned char q[EF_CHUNK * sizeof(float)]; /* no wire dtype takes more than fp32 */
  float back[EF_CHUNK];
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  for (uint32_t p = 0; p < npieces; p++) {
    const layout_piece *pc = &c->lay.pieces[first + p];
    for (uint64_t e = 0; e < pc->numel; e += EF_CHUNK) {
      size_t n = (size_t)(pc->numel - e < EF_CHUNK ? pc->numel - e : EF_CHUNK);
      size_t o = (size_t)(pc->offset + e);
      for (size_t i = 0; i < n; i++)
        v[o + i] = g[o + i] + r[o + i];
      dtype_from_f32(wire, v + o, q, n);
      dtype_to_f32(wire, q, back, n);
      for (size_t i = 0; i < n; i++) {
        float d = v[o + i] - back[i];
        r[o + i] = isfinite(d) ? d : 0.0f;
      }
    }
  }
  *out = v;
  return ZS_OK;
}

void zc_ef_after_step(struct zs_client *c, int skipped, double rescale) {
  pthread_mutex_lock(&c->ef_mu);
  for (uint32_t t = 0; c->ef_resid && t < c->sp.num_tensors; t++) {
    float *r = c->ef_resid[t];
    uint64_t n = c->sp.tensors[t].numel;
    if (!r)
      continue;
    if (skipped)
      memset(r, 0, (size_t)n * sizeof *r);
    else if (rescale != 1.0)
      for (uint64_t i = 0; i < n; i++)
        r[i] = (float)((double)r[i] * rescale);
  }
  pthread_mutex_unlock(&c->ef_mu);
}

/* 1 when a push of an fp32 buffer in `wire` loses bits and the client
 * keeps the residual. */
static int ef_wanted(const zs_client *c, zs_dtype buf, zs_dtype wire) {
  return c->opt.error_feedback && buf == ZS_DTYPE_FP32 && wire != ZS_DTYPE_FP32;
}

/* A push's request, filled but not yet published (push_commit_locked): the
 * client is not changed, but for the residual of error feedback. `spare`:
 * a batch's cached requests (NULL: the cache's). */
static int push_prepare(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad,
                        zs_dtype dtype, size_t nbytes, zs_request_cb cb, void *arg,
                        zs_request **spare, zs_request **out) {
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  zs_request *op = op_new_from(spare, c, ZC_OP_PUSH, npieces);
  if (!op)
    return ZS_ENOMEM;
  op->tensor = tensor;
  op->micro = micro;
  op->src = grad;
  op->buf_dtype = dtype;
  op->wire_dtype = push_wire(c, tensor, dtype);
  if (is_nograd(grad, nbytes)) {
    /* The residual of error feedback stays for the tensor's next gradient. */
    op->nograd = 1;
    op->src = NULL;
    op->buf_dtype = op->wire_dtype = ZS_DTYPE_FP32;
  } else if (ef_wanted(c, dtype, op->wire_dtype)) {
    /* Before the duplicate check (push_commit_locked): a push refused there
     * has then changed the residual, but it is a caller's bug that zs_step
     * reports anyway, and the check needs mu, which ef_mu is never held
     * with. */
    pthread_mutex_lock(&c->ef_mu);
    int rc = ef_apply_locked(c, tensor, grad, op->wire_dtype, &op->owned_src);
    pthread_mutex_unlock(&c->ef_mu);
    if (rc != ZS_OK) {
      zc_op_release(op);
      return zc_fail(rc, "zs_push: out of memory for the error feedback of tensor '%s'",
                     tensor_name(c, tensor));
    }
    op->src = op->owned_src;
  }
  op->cb = cb;
  op->cb_arg = arg;
  for (uint32_t i = 0; i < npieces; i++) {
    const layout_piece *pc = &c->lay.pieces[first + i];
    op->tasks[i].shard = pc->shard;
    op->tasks[i].piece = first + i;
    op->tasks[i].bytes = zc_op_piece_bytes(op, pc);
  }
  *out = op;
  return ZS_OK;
}

/* Publishes a prepared push, with c->mu held: refused while zs_step runs
 * and for a (tensor, micro) already pushed in the step; otherwise marked
 * pushed, counted in flight and, without a callback, given the caller's
 * reference. The caller then queues its tasks. */
static int push_commit_locked(zs_client *c, zs_request *op) {
  if (c->stepping)
    return zc_fail(ZS_EINVAL, "zs_push: called while zs_step runs on this client");
  size_t bit = (size_t)op->tensor * c->sp.grad_accum + op->micro;
  if (c->pushed[bit / 8] & (1u << (bit % 8)))
    return zc_fail(ZS_EEXIST,
                   "zs_push: tensor '%s' micro %" PRIu32 " was already pushed in step %" PRIu64,
                   tensor_name(c, op->tensor), op->micro, c->step);
  c->pushed[bit / 8] |= (uint8_t)(1u << (bit % 8));
  op->step = c->step;
  zc_op_register_locked(op);
  if (!op->cb)
    atomic_fetch_add(&op->refs, 1); /* the handle, or our own wait */
  return ZS_OK;
}

/* zs_push, zs_push_cb: one request, submitted at once. */
static int push_start(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad,
                      zs_dtype dtype, size_t nbytes, zs_request_cb cb, void *arg,
                      zs_request **out) {
  int rc = is_nograd(grad, nbytes) ? check_tensor(c, "zs_push", tensor)
                                   : check_buffer(c, "zs_push", tensor, grad, dtype, nbytes);
  if (rc != ZS_OK)
    return rc;
  if (micro >= c->sp.grad_accum)
    return zc_fail(ZS_ERANGE, "zs_push: micro %" PRIu32 " out of range (grad_accum is %" PRIu32 ")",
                   micro, c->sp.grad_accum);
  uint64_t t0 = clock_now_ns();
  zs_request *op;
  rc = push_prepare(c, tensor, micro, grad, dtype, nbytes, cb, arg, NULL, &op);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  rc = push_commit_locked(c, op);
  pthread_mutex_unlock(&c->mu);
  if (rc != ZS_OK) {
    zc_op_release(op);
    return rc;
  }
  zc_op_submit(op);
  zc_account_wait(c, ZC_OP_PUSH, clock_now_ns() - t0);
  if (cb)
    return ZS_OK;
  if (out) {
    *out = op;
    return ZS_OK;
  }
  return wait_own(op, ZC_OP_PUSH);
}

/* A pull's request, filled but not yet published (pull_commit_locked). */
static zs_request *pull_prepare(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype,
                                zs_request_cb cb, void *arg, zs_request **spare) {
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  zs_dtype wire = pull_wire(c, tensor, dtype);
  zs_request *op = op_new_from(spare, c, ZC_OP_PULL, npieces);
  if (!op)
    return NULL;
  op->tensor = tensor;
  op->dst = dst;
  op->buf_dtype = dtype;
  op->wire_dtype = wire;
  op->cb = cb;
  op->cb_arg = arg;
  for (uint32_t i = 0; i < npieces; i++) {
    const layout_piece *pc = &c->lay.pieces[first + i];
    op->tasks[i].shard = pc->shard;
    op->tasks[i].piece = first + i;
    op->tasks[i].bytes = dtype_bytes(wire, pc->numel);
  }
  return op;
}

/* How a published pull is served (pull_commit_locked). */
enum { PULL_QUEUE = 0, PULL_SLOT_READY = 1, PULL_SLOT_WAIT = 2 };

/* Publishes a prepared pull, with c->mu held: counts it in flight, gives the
 * caller's reference (without a callback) and says how it is served:
 * PULL_QUEUE, its own tasks (the caller queues them); PULL_SLOT_READY, the
 * tensor's prefetch slot holds the version (the caller copies it out,
 * pull_from_slot); PULL_SLOT_WAIT, the slot's prefetch in flight finishes
 * it. Starts the prefetches of the next tensors into prefetch[64] (the
 * caller queues them). */
static int pull_commit_locked(zs_client *c, zs_request *op, zs_request **prefetch,
                              uint32_t *nprefetch) {
  int how = PULL_QUEUE;
  *nprefetch = 0;
  if (!op->cb)
    atomic_fetch_add(&op->refs, 1);
  op->step = c->step - 1;
  zc_op_register_locked(op);
  if (!c->slots)
    return how;
  zc_slot *slot = &c->slots[op->tensor];
  if (slot->version == op->step && slot->wire == op->wire_dtype) {
    /* The op's own tasks are then not used: one part, the slot, finishes
     * it. pending is set before the op is published to prefetch_finish. */
    if (slot->state == ZC_SLOT_READY) {
      slot->state = ZC_SLOT_BUSY;
      op->pending = 1;
      how = PULL_SLOT_READY;
    } else if (slot->state == ZC_SLOT_INFLIGHT && !slot->waiter) {
      op->pending = 1;
      slot->waiter = op;
      how = PULL_SLOT_WAIT;
    }
  }
  c->last_pull_wire = op->wire_dtype;
  uint32_t depth = c->opt.prefetch_depth < 64 ? c->opt.prefetch_depth : 64;
  *nprefetch = zc_prefetch_locked(c, op->tensor + 1, depth, op->step, op->wire_dtype, prefetch);
  return how;
}

/* PULL_SLOT_READY: copies the slot (marked busy) out and finishes op. */
static void pull_from_slot(zs_client *c, zs_request *op) {
  zc_slot *slot = &c->slots[op->tensor];
  zc_convert(op->dst, op->buf_dtype, slot->buf, slot_dtype(op->wire_dtype),
             c->sp.tensors[op->tensor].numel);
  pthread_mutex_lock(&c->mu);
  slot->state = ZC_SLOT_EMPTY;
  pthread_mutex_unlock(&c->mu);
  zc_op_part_done(op, ZS_OK, NULL, 0);
}

/* zs_pull, zs_pull_cb: one request, submitted at once. */
static int pull_start(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
                      zs_request_cb cb, void *arg, zs_request **out) {
  int rc = check_buffer(c, "zs_pull", tensor, dst, dtype, nbytes);
  if (rc != ZS_OK)
    return rc;
  uint64_t t0 = clock_now_ns();
  zs_request *op = pull_prepare(c, tensor, dst, dtype, cb, arg, NULL);
  if (!op)
    return ZS_ENOMEM;
  zs_request *prefetch[64];
  uint32_t nprefetch;
  pthread_mutex_lock(&c->mu);
  int how = pull_commit_locked(c, op, prefetch, &nprefetch);
  pthread_mutex_unlock(&c->mu);
  if (how == PULL_QUEUE)
    zc_op_submit(op);
  else if (how == PULL_SLOT_READY)
    pull_from_slot(c, op);
  for (uint32_t i = 0; i < nprefetch; i++)
    zc_op_submit(prefetch[i]);
  zc_account_wait(c, ZC_OP_PULL, clock_now_ns() - t0);
  if (cb)
    return ZS_OK;
  if (out) {
    *out = op;
    return ZS_OK;
  }
  return wait_own(op, ZC_OP_PULL);
}

int zs_push(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad, zs_dtype dtype,
            size_t nbytes, zs_request **req) {
  if (req)
    *req = NULL;
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = push_start(c, tensor, micro, grad, dtype, nbytes, NULL, NULL, req);
  zc_client_leave(c);
  return rc;
}

int zs_pull(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
            zs_request **req) {
  if (req)
    *req = NULL;
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = pull_start(c, tensor, dst, dtype, nbytes, NULL, NULL, req);
  zc_client_leave(c);
  return rc;
}

int zs_push_cb(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad, zs_dtype dtype,
               size_t nbytes, zs_request_cb cb, void *arg) {
  if (!cb)
    return zc_fail(ZS_EINVAL, "zs_push_cb: the callback is NULL");
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = push_start(c, tensor, micro, grad, dtype, nbytes, cb, arg, NULL);
  zc_client_leave(c);
  return rc;
}

int zs_pull_cb(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
               zs_request_cb cb, void *arg) {
  if (!cb)
    return zc_fail(ZS_EINVAL, "zs_pull_cb: the callback is NULL");
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = pull_start(c, tensor, dst, dtype, nbytes, cb, arg, NULL);
  zc_client_leave(c);
  return rc;
}

int zs_wait(zs_request *req) {
  if (!req)
    return zc_fail(ZS_EINVAL, "zs_wait: the request is NULL");
  return wait_own(req, req->kind);
}

int zs_test(const zs_request *req) {
  if (!req)
    return zc_fail(ZS_EINVAL, "zs_test: the request is NULL");
  zs_request *r = (zs_request *)(uintptr_t)req; /* the lock is not part of the value */
  pthread_mutex_lock(&r->mu);
  int done = r->done;
  pthread_mutex_unlock(&r->mu);
  return done;
}

int zs_wait_pushes(zs_client *c) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  uint64_t t0 = clock_now_ns();
  pthread_mutex_lock(&c->mu);
  while (c->inflight_push > 0)
    pthread_cond_wait(&c->cv, &c->mu);
  rc = c->step_error;
  if (rc != ZS_OK)
    zc_fail_msg(rc, c->step_err);
  pthread_mutex_unlock(&c->mu);
  zc_account_wait(c, ZC_OP_PUSH, clock_now_ns() - t0);
  zc_client_leave(c);
  return rc;
}

/* ---- batches ---------------------------------------------------------------- */

/* Checks a batch's arrays before anything is submitted, so that a refused
 * batch submits nothing: each entry as zs_push/zs_pull would, and no tensor
 * twice (pushes). The job's being open is checked once, and the pushed
 * bits under one lock. */
static int check_batch(zs_client *c, const char *fn, uint32_t n, const uint32_t *tensors,
                       const void *const *bufs, zs_dtype dtype, const size_t *nbytes, int push,
                       uint32_t micro) {
  if (n == 0)
    return ZS_OK;
  if (!tensors || !bufs || !nbytes)
    return zc_fail(ZS_EINVAL, "%s: tensors, buffers and sizes must not be NULL", fn);
  int rc = check_opened(c, fn);
  if (rc != ZS_OK)
    return rc;
  for (uint32_t i = 0; i < n; i++) {
    rc = push && is_nograd(bufs[i], nbytes[i])
             ? check_tensor_id(c, fn, tensors[i])
             : check_entry(c, fn, tensors[i], bufs[i], dtype, nbytes[i]);
    if (rc != ZS_OK) {
      /* zs_last_error() is the buffer zc_fail writes: copy it out first. */
      char why[400];
      snprintf(why, sizeof why, "%s", zs_last_error());
      return zc_fail(rc, "%s: entry %" PRIu32 ": %s", fn, i, why);
    }
  }
  if (!push)
    return ZS_OK;
  if (micro >= c->sp.grad_accum)
    return zc_fail(ZS_ERANGE, "%s: micro %" PRIu32 " out of range (grad_accum is %" PRIu32 ")", fn,
                   micro, c->sp.grad_accum);
  pthread_mutex_lock(&c->mu);
  for (uint32_t i = 0; i < n && rc == ZS_OK; i++) {
    size_t bit = (size_t)tensors[i] * c->sp.grad_accum + micro;
    if (c->pushed[bit / 8] & (1u << (bit % 8)))
      rc = zc_fail(ZS_EEXIST,
                   "%s: tensor '%s' micro %" PRIu32 " was already pushed in step %" PRIu64, fn,
                   tensor_name(c, tensors[i]), micro, c->step);
    for (uint32_t j = 0; j < i && rc == ZS_OK; j++)
      if (tensors[j] == tensors[i])
        rc = zc_fail(ZS_EEXIST,
                     "%s: tensor '%s' appears twice in the batch (entries %" PRIu32 " and %" PRIu32
                     ")",
                     fn, tensor_name(c, tensors[i]), j, i);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Requests whose tasks a batch queues under one pool lock (zc_pool_enqueue_spans). */
#define BATCH_SPANS 32

/* Queues the tasks of the requests on `list` (linked through cache_next, in
 * submission order) in pool lock round trips of BATCH_SPANS requests, and
 * wakes one worker at the end (also when nothing is left to queue: what a
 * round before queued runs). A request's link is read before it is queued:
 * a queued prefetch may finish and go back to the cache at once. */
static void batch_queue(zs_client *c, zs_request *list) {
  zc_task_span spans[BATCH_SPANS];
  uint32_t n = 0;
  while (list) {
    zs_request *op = list;
    list = op->cache_next;
    spans[n++] = (zc_task_span){op->tasks, op->ntasks};
    if (n == BATCH_SPANS && list) {
      zc_pool_enqueue_spans(&c->pool, spans, n, 0);
      n = 0;
    }
  }
  zc_pool_enqueue_spans(&c->pool, spans, n, 1);
}

/* Publishes the prepared requests ops[0, n) under one lock of c->mu, in
 * order, and queues them (batch_queue), pulls served by their prefetch slot
 * aside. Stops at the first push refused (push_commit_locked: a concurrent
 * push of the same tensor, or zs_step begun); returns how many were
 * published in *started. */
static int batch_publish(zs_client *c, zs_request **ops, uint32_t n, int push, uint32_t *started) {
  zs_request *queue = NULL, **tail = &queue, *from_slot = NULL;
  int rc = ZS_OK;
  uint32_t i = 0;
  pthread_mutex_lock(&c->mu);
  for (; i < n; i++) {
    zs_request *op = ops[i], *prefetch[64];
    uint32_t nprefetch = 0;
    int how = PULL_QUEUE;
    if (push && (rc = push_commit_locked(c, op)) != ZS_OK)
      break;
    if (!push)
      how = pull_commit_locked(c, op, prefetch, &nprefetch);
    op->cache_next = NULL;
    if (how == PULL_QUEUE) {
      *tail = op;
      tail = &op->cache_next;
    } else if (how == PULL_SLOT_READY) {
      op->cache_next = from_slot;
      from_slot = op;
    }
    for (uint32_t k = 0; k < nprefetch; k++) {
      prefetch[k]->cache_next = NULL;
      *tail = prefetch[k];
      tail = &prefetch[k]->cache_next;
    }
  }
  pthread_mutex_unlock(&c->mu);
  *started = i;
  batch_queue(c, queue);
  while (from_slot) {
    zs_request *op = from_slot;
    from_slot = op->cache_next;
    pull_from_slot(c, op);
  }
  return rc;
}

/* Submits a checked batch in three passes: every request is prepared
 * (cached ones taken in one lock round trip), then published under one lock
 * of c->mu, then queued under one pool lock with one wake-up. A request that
 * cannot be prepared (out of memory) leaves the batch unsubmitted. Without
 * reqs the call waits for all and returns the first failure. */
static int run_batch(zs_client *c, uint32_t n, const uint32_t *tensors, uint32_t micro,
                     const void *const *bufs, zs_dtype dtype, const size_t *nbytes,
                     zs_request **reqs, int push) {
  zs_request **own = reqs;
  if (!reqs && !(own = calloc(n ? n : 1, sizeof *own)))
    return zc_fail(ZS_ENOMEM, "out of memory for a batch of %" PRIu32 " requests", n);
  int rc = ZS_OK;
  uint32_t prepared = 0, started = 0;
  uint64_t t0 = clock_now_ns();
  zs_request *spare = NULL;
  op_cache_take(n, &spare);
  for (; prepared < n && rc == ZS_OK; prepared++) {
    if (push)
      rc = push_prepare(c, tensors[prepared], micro, bufs[prepared], dtype, nbytes[prepared], NULL,
                        NULL, &spare, &own[prepared]);
    else if (!(own[prepared] = pull_prepare(c, tensors[prepared], (void *)(uintptr_t)bufs[prepared],
                                            dtype, NULL, NULL, &spare)))
      rc = ZS_ENOMEM;
    if (rc != ZS_OK)
      break;
  }
  if (rc == ZS_OK)
    rc = batch_publish(c, own, n, push, &started);
  /* What was not published is nobody's: back to the cache. */
  for (uint32_t i = started; i < prepared; i++) {
    zc_op_release(own[i]);
    own[i] = NULL;
  }
  op_cache_put(spare);
  zc_account_wait(c, push ? ZC_OP_PUSH : ZC_OP_PULL, clock_now_ns() - t0);
  if (!reqs) {
    int first = rc;
    char msg[ZC_ERR_LEN] = "";
    if (first != ZS_OK)
      snprintf(msg, sizeof msg, "%s", zs_last_error());
    for (uint32_t i = 0; i < started; i++) {
      int r = wait_own(own[i], push ? ZC_OP_PUSH : ZC_OP_PULL);
      if (r != ZS_OK && first == ZS_OK) {
        first = r;
        snprintf(msg, sizeof msg, "%s", zs_last_error());
      }
    }
    free(own);
    if (first != ZS_OK)
      zc_fail_msg(first, msg);
    return first;
  }
  return rc;
}

int zs_push_many(zs_client *c, uint32_t n, const uint32_t *tensors, uint32_t micro,
                 const void *const *grads, zs_dtype dtype, const size_t *nbytes,
                 zs_request **reqs) {
  if (reqs && n)
    memset(reqs, 0, (size_t)n * sizeof *reqs);
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  rc = check_batch(c, "zs_push_many", n, tensors, grads, dtype, nbytes, 1, micro);
  if (rc == ZS_OK && n > 0)
    rc = run_batch(c, n, tensors, micro, grads, dtype, nbytes, reqs, 1);
  zc_client_leave(c);
  return rc;
}

int zs_pull_many(zs_client *c, uint32_t n, const uint32_t *tensors, void *const *dsts,
                 zs_dtype dtype, const size_t *nbytes, zs_request **reqs) {
  if (reqs && n)
    memset(reqs, 0, (size_t)n * sizeof *reqs);
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  const void *const *bufs = (const void *const *)dsts;
  rc = check_batch(c, "zs_pull_many", n, tensors, bufs, dtype, nbytes, 0, 0);
  if (rc == ZS_OK && n > 0)
    rc = run_batch(c, n, tensors, 0, bufs, dtype, nbytes, reqs, 0);
  zc_client_leave(c);
  return rc;
}
