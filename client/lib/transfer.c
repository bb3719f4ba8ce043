/*
 * transfer — a push of one tensor's gradient or a pull of its parameters:
 * the wire dtype chosen, the request prepared and published on the client
 * (also for a batch, batch.c), and zs_push, zs_pull, their _cb forms and
 * zs_wait_pushes.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

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

/* A push's request, filled but not yet published (zc_push_commit_locked): the
 * client is not changed, but for the residual of error feedback. `spare`:
 * a batch's cached requests (NULL: the cache's). */
int zc_push_prepare(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad, zs_dtype dtype,
                    size_t nbytes, zs_request_cb cb, void *arg, zs_request **spare,
                    zs_request **out) {
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  zs_request *op = zc_op_new_from(spare, c, ZC_OP_PUSH, npieces);
  if (!op)
    return ZS_ENOMEM;
  op->tensor = tensor;
  op->micro = micro;
  op->src = grad;
  op->buf_dtype = dtype;
  op->wire_dtype = push_wire(c, tensor, dtype);
  if (zc_is_nograd(grad, nbytes)) {
    /* The residual of error feedback stays for the tensor's next gradient. */
    op->nograd = 1;
    op->src = NULL;
    op->buf_dtype = op->wire_dtype = ZS_DTYPE_FP32;
  } else if (zc_ef_wanted(c, dtype, op->wire_dtype)) {
    /* Before the duplicate check (zc_push_commit_locked): a push refused there
     * has then changed the residual, but it is a caller's bug that zs_step
     * reports anyway, and the check needs mu, which ef_mu is never held
     * with. */
    pthread_mutex_lock(&c->ef_mu);
    int rc = zc_ef_apply_locked(c, tensor, grad, op->wire_dtype, &op->owned_src);
    pthread_mutex_unlock(&c->ef_mu);
    if (rc != ZS_OK) {
      zc_op_release(op);
      return zc_fail(rc, "zs_push: out of memory for the error feedback of tensor '%s'",
                     zc_tensor_name(c, tensor));
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
int zc_push_commit_locked(zs_client *c, zs_request *op) {
  if (c->stepping)
    return zc_fail(ZS_EINVAL, "zs_push: called while zs_step runs on this client");
  size_t bit = (size_t)op->tensor * c->sp.grad_accum + op->micro;
  if (c->pushed[bit / 8] & (1u << (bit % 8)))
    return zc_fail(ZS_EEXIST,
                   "zs_push: tensor '%s' micro %" PRIu32 " was already pushed in step %" PRIu64,
                   zc_tensor_name(c, op->tensor), op->micro, c->step);
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
  int rc = zc_is_nograd(grad, nbytes) ? zc_check_tensor(c, "zs_push", tensor)
                                      : zc_check_buffer(c, "zs_push", tensor, grad, dtype, nbytes);
  if (rc != ZS_OK)
    return rc;
  if (micro >= c->sp.grad_accum)
    return zc_fail(ZS_ERANGE, "zs_push: micro %" PRIu32 " out of range (grad_accum is %" PRIu32 ")",
                   micro, c->sp.grad_accum);
  uint64_t t0 = clock_now_ns();
  zs_request *op;
  rc = zc_push_prepare(c, tensor, micro, grad, dtype, nbytes, cb, arg, NULL, &op);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  rc = zc_push_commit_locked(c, op);
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
  return zc_op_wait_own(op, ZC_OP_PUSH);
}

/* A pull's request, filled but not yet published (zc_pull_commit_locked). */
zs_request *zc_pull_prepare(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype,
                            zs_request_cb cb, void *arg, zs_request **spare) {
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  zs_dtype wire = pull_wire(c, tensor, dtype);
  zs_request *op = zc_op_new_from(spare, c, ZC_OP_PULL, npieces);
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

/* Publishes a prepared pull, with c->mu held: counts it in flight, gives the
 * caller's reference (without a callback) and says how it is served:
 * ZC_PULL_QUEUE, its own tasks (the caller queues them); ZC_PULL_SLOT_READY, the
 * tensor's prefetch slot holds the version (the caller copies it out,
 * zc_pull_from_slot); ZC_PULL_SLOT_WAIT, the slot's prefetch in flight finishes
 * it. Starts the prefetches of the next tensors into prefetch[64] (the
 * caller queues them). */
int zc_pull_commit_locked(zs_client *c, zs_request *op, zs_request **prefetch,
                          uint32_t *nprefetch) {
  int how = ZC_PULL_QUEUE;
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
     * it. pending is set before the op is published to zc_prefetch_finish. */
    if (slot->state == ZC_SLOT_READY) {
      slot->state = ZC_SLOT_BUSY;
      op->pending = 1;
      how = ZC_PULL_SLOT_READY;
    } else if (slot->state == ZC_SLOT_INFLIGHT && !slot->waiter) {
      op->pending = 1;
      slot->waiter = op;
      how = ZC_PULL_SLOT_WAIT;
    }
  }
  c->last_pull_wire = op->wire_dtype;
  uint32_t depth = c->opt.prefetch_depth < 64 ? c->opt.prefetch_depth : 64;
  *nprefetch = zc_prefetch_locked(c, op->tensor + 1, depth, op->step, op->wire_dtype, prefetch);
  return how;
}

/* zs_pull, zs_pull_cb: one request, submitted at once. */
static int pull_start(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
                      zs_request_cb cb, void *arg, zs_request **out) {
  int rc = zc_check_buffer(c, "zs_pull", tensor, dst, dtype, nbytes);
  if (rc != ZS_OK)
    return rc;
  uint64_t t0 = clock_now_ns();
  zs_request *op = zc_pull_prepare(c, tensor, dst, dtype, cb, arg, NULL);
  if (!op)
    return ZS_ENOMEM;
  zs_request *prefetch[64];
  uint32_t nprefetch;
  pthread_mutex_lock(&c->mu);
  int how = zc_pull_commit_locked(c, op, prefetch, &nprefetch);
  pthread_mutex_unlock(&c->mu);
  if (how == ZC_PULL_QUEUE)
    zc_op_submit(op);
  else if (how == ZC_PULL_SLOT_READY)
    zc_pull_from_slot(c, op);
  for (uint32_t i = 0; i < nprefetch; i++)
    zc_op_submit(prefetch[i]);
  zc_account_wait(c, ZC_OP_PULL, clock_now_ns() - t0);
  if (cb)
    return ZS_OK;
  if (out) {
    *out = op;
    return ZS_OK;
  }
  return zc_op_wait_own(op, ZC_OP_PULL);
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
