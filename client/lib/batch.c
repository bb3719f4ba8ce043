/*
 * batch — zs_push_many and zs_pull_many: a batch's arrays checked before
 * anything is submitted, its requests prepared (cached ones taken in one
 * lock round trip), published under one lock of the client and queued under
 * one lock of the pool with one wake-up.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

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
  int rc = zc_check_opened(c, fn);
  if (rc != ZS_OK)
    return rc;
  for (uint32_t i = 0; i < n; i++) {
    rc = push && zc_is_nograd(bufs[i], nbytes[i])
             ? zc_check_tensor_id(c, fn, tensors[i])
             : zc_check_entry(c, fn, tensors[i], bufs[i], dtype, nbytes[i]);
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
                   zc_tensor_name(c, tensors[i]), micro, c->step);
    for (uint32_t j = 0; j < i && rc == ZS_OK; j++)
      if (tensors[j] == tensors[i])
        rc = zc_fail(ZS_EEXIST,
                     "%s: tensor '%s' appears twice in the batch (entries %" PRIu32 " and %" PRIu32
                     ")",
                     fn, zc_tensor_name(c, tensors[i]), j, i);
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
 * aside. Stops at the first push refused (zc_push_commit_locked: a concurrent
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
    int how = ZC_PULL_QUEUE;
    if (push && (rc = zc_push_commit_locked(c, op)) != ZS_OK)
      break;
    if (!push)
      how = zc_pull_commit_locked(c, op, prefetch, &nprefetch);
    op->cache_next = NULL;
    if (how == ZC_PULL_QUEUE) {
      *tail = op;
      tail = &op->cache_next;
    } else if (how == ZC_PULL_SLOT_READY) {
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
    zc_pull_from_slot(c, op);
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
  zc_op_cache_take(n, &spare);
  for (; prepared < n && rc == ZS_OK; prepared++) {
    if (push)
      rc = zc_push_prepare(c, tensors[prepared], micro, bufs[prepared], dtype, nbytes[prepared],
                           NULL, NULL, &spare, &own[prepared]);
    else if (!(own[prepared] =
                   zc_pull_prepare(c, tensors[prepared], (void *)(uintptr_t)bufs[prepared], dtype,
                                   NULL, NULL, &spare)))
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
  zc_op_cache_put(spare);
  zc_account_wait(c, push ? ZC_OP_PUSH : ZC_OP_PULL, clock_now_ns() - t0);
  if (!reqs) {
    int first = rc;
    char msg[ZC_ERR_LEN] = "";
    if (first != ZS_OK)
      snprintf(msg, sizeof msg, "%s", zs_last_error());
    for (uint32_t i = 0; i < started; i++) {
      int r = zc_op_wait_own(own[i], push ? ZC_OP_PUSH : ZC_OP_PULL);
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
