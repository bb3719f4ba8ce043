/*
 * transfer.h — what the files of requests and transfers share among
 * themselves: request.c, call.c, task.c, prefetch.c, ef.c, check.c,
 * transfer.c, batch.c, convert.c. What the rest of the library calls of
 * them is declared in internal.h; nothing here is seen outside these files.
 */
#ifndef ZSHARD_CLIENT_TRANSFER_H
#define ZSHARD_CLIENT_TRANSFER_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* The name of tensor t of the open job (the spec's string, valid while the
 * client is). */
static inline const char *zc_tensor_name(const zs_client *c, uint32_t t) {
  return c->sp.tensors[t].name;
}

/* A push of no gradient: grad NULL and nbytes 0 (zs_push). */
static inline int zc_is_nograd(const void *grad, size_t nbytes) {
  return !grad && nbytes == 0;
}

/* Counts the op as in flight on its client (so that close waits for it).
 * Called with c->mu held, once per op, before it is submitted. Inline, as
 * it was when one file held every caller: it runs once per request on the
 * submission path. */
static inline void zc_op_register_locked(struct zs_request *op) {
  op->c->inflight++;
  atomic_fetch_add(&op->c->unfinished, 1);
  if (op->kind == ZC_OP_PUSH)
    op->c->inflight_push++;
}

/* 1 when a push of an fp32 buffer in `wire` loses bits and the client keeps
 * the residual of error feedback (ef.c). */
static inline int zc_ef_wanted(const zs_client *c, zs_dtype buf, zs_dtype wire) {
  return c->opt.error_feedback && buf == ZS_DTYPE_FP32 && wire != ZS_DTYPE_FP32;
}

/* ---- request.c: the process's cache of requests ---------------------------- */

/* Moves up to n cached requests onto the list *spare (the caller's, linked
 * through cache_next). */
void zc_op_cache_take(uint32_t n, zs_request **spare);

/* Puts a list of requests (none in use, linked through cache_next) back
 * into the cache, freeing what does not fit. */
void zc_op_cache_put(zs_request *list);

/* zc_op_new, taking a cached request from *spare (a batch's) first when
 * spare is not NULL, else from the cache. */
zs_request *zc_op_new_from(zs_request **spare, struct zs_client *c, zc_op_kind kind,
                           uint32_t ntasks);

/* Waits for a request the caller made (zs_wait, or a synchronous call's
 * own), accounts the wait to `kind` and drops the reference waited with. */
int zc_op_wait_own(zs_request *op, zc_op_kind kind);

/* ---- prefetch.c ------------------------------------------------------------- */

/* A prefetch op finished (request.c, op_finish): fills its slot, or serves
 * the pull waiting on it. */
void zc_prefetch_finish(zs_client *c, zs_request *op, int status, const char *msg);

/* ZC_PULL_SLOT_READY: copies the slot (marked busy) out and finishes op. */
void zc_pull_from_slot(zs_client *c, zs_request *op);

/* ---- ef.c: error feedback ---------------------------------------------------- */

/* With c->ef_mu held: the gradient g of `tensor` plus its residual into
 * *out (fp32, the caller's to free), and the new residual kept. ZS_ENOMEM
 * (no last error set) when an allocation fails. */
int zc_ef_apply_locked(zs_client *c, uint32_t tensor, const float *g, zs_dtype wire, float **out);

/* ---- check.c: a transfer's arguments (ZS_OK, or the failure zc_fail'ed with
 * fn's name) ------------------------------------------------------------------ */

int zc_check_opened(zs_client *c, const char *fn);
int zc_check_tensor_id(zs_client *c, const char *fn, uint32_t tensor);
int zc_check_tensor(zs_client *c, const char *fn, uint32_t tensor);
/* The arguments shared by push and pull, the job being open. */
int zc_check_entry(zs_client *c, const char *fn, uint32_t tensor, const void *buf, zs_dtype dtype,
                   size_t nbytes);
/* zc_check_opened, then zc_check_entry. */
int zc_check_buffer(zs_client *c, const char *fn, uint32_t tensor, const void *buf, zs_dtype dtype,
                    size_t nbytes);

/* ---- transfer.c: one tensor's push or pull, prepared then published ---------- */

/* A push's request, filled but not yet published (zc_push_commit_locked): the
 * client is not changed, but for the residual of error feedback. `spare`: a
 * batch's cached requests (NULL: the cache's). */
int zc_push_prepare(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad, zs_dtype dtype,
                    size_t nbytes, zs_request_cb cb, void *arg, zs_request **spare,
                    zs_request **out);

/* Publishes a prepared push with c->mu held (refused while zs_step runs and
 * for a (tensor, micro) already pushed in the step). The caller then queues
 * its tasks. */
int zc_push_commit_locked(zs_client *c, zs_request *op);

/* A pull's request, filled but not yet published (zc_pull_commit_locked);
 * NULL on ENOMEM. */
zs_request *zc_pull_prepare(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype,
                            zs_request_cb cb, void *arg, zs_request **spare);

/* How a published pull is served (zc_pull_commit_locked). */
enum { ZC_PULL_QUEUE = 0, ZC_PULL_SLOT_READY = 1, ZC_PULL_SLOT_WAIT = 2 };

/* Publishes a prepared pull with c->mu held; returns how it is served and
 * starts the prefetches of the next tensors into prefetch[64] (the caller
 * queues them, *nprefetch of them). */
int zc_pull_commit_locked(zs_client *c, zs_request *op, zs_request **prefetch, uint32_t *nprefetch);

#endif
