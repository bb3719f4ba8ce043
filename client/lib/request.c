/*
 * request — the life of a request (an op): allocated or taken from the
 * process's cache, counted in flight, submitted, finished part by part,
 * waited for and released.
 *
 * An op is split into tasks, one per piece (or per shard for a control call),
 * which the pool runs in parallel (task.c); an isolated push or pull of one
 * piece in its wire dtype skips the pool over the data plane (submit_inline).
 * Each task finishes one part of the op; the last part finishes the op: the
 * client's bookkeeping is updated, the callback (if any) runs, waiters wake,
 * and the op's in-flight reference is dropped. The caller's handle is the
 * other reference, dropped by zs_wait.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

/* The cache of requests. A push or pull of a tensor over up to
 * OP_CACHED_TASKS shards is not freed when its last reference goes but kept
 * for the next one: its allocation (1.2 KiB, zeroed, too large for glibc's
 * per-thread cache, and freed on another thread, a worker) and the set-up of
 * its lock and condition variable were 14 % of a batched submission's
 * instructions (docs/PERFORMANCE.md, "Small calls"). The cache is the
 * process's, not a client's: a caller may zs_wait a request after
 * zs_client_close freed its client. A batch takes the cached requests it
 * needs in one lock round trip (zc_op_cache_take). Bounded: a burst larger than
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
void zc_op_cache_take(uint32_t n, zs_request **spare) {
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
void zc_op_cache_put(zs_request *list) {
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
zs_request *zc_op_new_from(zs_request **spare, struct zs_client *c, zc_op_kind kind,
                           uint32_t ntasks) {
  zs_request *op = NULL;
  if (ntasks <= OP_CACHED_TASKS) {
    zs_request *own = NULL, **from = spare ? spare : &own;
    if (!*from)
      zc_op_cache_take(1, from);
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
  return zc_op_new_from(NULL, c, kind, ntasks);
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
    zc_op_cache_put(op);
    return;
  }
  pthread_mutex_destroy(&op->mu);
  pthread_cond_destroy(&op->cv);
  free(op);
}

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
    zc_prefetch_finish(c, op, status, op->err);
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

/* Waits for a request the call itself made (req == NULL: synchronous). */
int zc_op_wait_own(zs_request *op, zc_op_kind kind) {
  uint64_t t0 = clock_now_ns();
  int rc = zc_op_wait_done(op);
  zc_account_wait(op->c, kind, clock_now_ns() - t0);
  zc_op_release(op);
  return rc;
}

int zs_wait(zs_request *req) {
  if (!req)
    return zc_fail(ZS_EINVAL, "zs_wait: the request is NULL");
  return zc_op_wait_own(req, req->kind);
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
