/*
 * grpc_calls — a call's life: its references and the lists it is on, its one
 * answer (whoever claims it sends the final batch; grpc_server.c says why)
 * and the hop from a core thread back to a polling thread.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "common/net/rpc_client.h"

/* ------------------------------------------------------------------------ */
/* Call lifetime                                                            */
/* ------------------------------------------------------------------------ */

gcall *gcall_new(gsrv *s, int method) {
  gcall *c = calloc(1, sizeof *c);
  if (!c)
    return NULL;
  c->s = s;
  c->method = method;
  atomic_init(&c->refs, 1);
  atomic_init(&c->claimed, 0);
  grpc_metadata_array_init(&c->md);
  if (method == M_GENERIC)
    grpc_call_details_init(&c->details);
  c->status_details = grpc_empty_slice();
  c->w_sent = -1;
  return c;
}

void gcall_ref(gcall *c) {
  atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

/* grpc_call_start_batch, telling ThreadSanitizer that whatever the caller did
 * to the call so far happens before the tag comes out of the queue (see
 * common/base/tsan.h). The arguments are read before the release, in the caller. */
grpc_call_error gsrv__start_batch(grpc_call *call, const grpc_op *ops, size_t n, gtag *tag) {
  tsan_release(tag);
  return grpc_call_start_batch(call, ops, n, tag, NULL);
}

/* Releases everything of gRPC's that the call holds, the grpc_call last. Runs
 * when the final batch completes, so that a gcall kept alive afterwards only by
 * a core callback (possibly past grpc_shutdown) holds plain memory only. */
static void release_grpc(gcall *c) {
  if (c->grpc_released)
    return;
  c->grpc_released = 1;
  if (c->payload)
    grpc_byte_buffer_destroy(c->payload);
  if (c->reply)
    grpc_byte_buffer_destroy(c->reply);
  c->payload = c->reply = NULL;
  grpc_slice_unref(c->status_details);
  grpc_slice_unref(c->trailer.value);
  grpc_metadata_array_destroy(&c->md);
  if (c->method == M_GENERIC)
    grpc_call_details_destroy(&c->details);
  if (c->call)
    grpc_call_unref(c->call);
  c->call = NULL;
}

void gcall_unref(gcall *c) {
  if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1)
    return;
  release_grpc(c);
  gpr_free(c->peer);
  free(c->ckpt);
  free(c->fwd);
  free(c);
}

/* Takes a Watch stream off gsrv.watchers (once; later calls do nothing). */
void gsrv__watch_remove_locked(gsrv *s, gcall *c) {
  if (c->node.next)
    s->nwatchers--;
  list_remove(&c->node);
}

/* ------------------------------------------------------------------------ */
/* Answering                                                                */
/* ------------------------------------------------------------------------ */

static void on_final(gtag *t, int ok);

/* Everything after the final batch: the call leaves the in-flight list, its
 * grpc_call is released and so is the room its answer took. */
static void final_done(gcall *c) {
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  if (c->method == M_HEALTH_WATCH)
    gsrv__watch_remove_locked(s, c);
  else
    list_remove(&c->node);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  release_grpc(c);
  gsrv__answer_release(c);
}

static void on_final(gtag *t, int ok) {
  (void)ok; /* a failed batch means the peer is gone; nothing more to do */
  gcall *c = container_of(t, gcall, io_tag);
  final_done(c);
  gcall_unref(c);
}

/* Fills the status operation of a final batch: the gRPC code of `zs`, the
 * detail sentence (zs_strerror's when none is given) and the zs-status
 * trailer. The slices live in the call until the batch completes. */
void gsrv__status_op(gcall *c, grpc_op *op, int zs, const char *detail) {
  snprintf(c->zs_buf, sizeof c->zs_buf, "%d", zs);
  grpc_slice_unref(c->trailer.value);
  memset(&c->trailer, 0, sizeof c->trailer);
  c->trailer.key = grpc_slice_from_static_string(ZS_STATUS_KEY);
  c->trailer.value = grpc_slice_from_copied_string(c->zs_buf);
  grpc_slice_unref(c->status_details);
  c->status_details = grpc_slice_from_copied_string(
      detail && detail[0] ? detail : (zs != ZS_OK ? zs_strerror(zs) : ""));
  if (zs != ZS_OK)
    LOG_DEBUG("rpc_error", "method=%s status=%s detail=\"%s\"",
              c->method < M_COUNT ? gsrv__methods[c->method].path : "unknown", zs_err_name(zs),
              detail ? detail : "");
  op->op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  op->data.send_status_from_server.status = (grpc_status_code)status_to_grpc(zs);
  op->data.send_status_from_server.trailing_metadata_count = 1;
  op->data.send_status_from_server.trailing_metadata = &c->trailer;
  op->data.send_status_from_server.status_details = zs != ZS_OK ? &c->status_details : NULL;
}

/* Sends the answer: `reply` (owned from here on; NULL for an error) and the
 * status of `zs`. The caller must have claimed the call. */
void gsrv__send_final(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail) {
  c->reply = reply;
  if (c->method < M_COUNT && c->start_ns)
    metrics_rpc_observe(c->s->rpc_metric[c->method], clock_now_ns() - c->start_ns, zs != ZS_OK);
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (reply) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = reply;
  }
  gsrv__status_op(c, &ops[n++], zs, detail);
  if (!c->close_started) { /* a parked call has it in a batch of its own */
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  }
  c->io_tag.done = on_final;
  gcall_ref(c);
  grpc_call_error e = gsrv__start_batch(c->call, ops, n, &c->io_tag);
  if (e != GRPC_CALL_OK) {
    LOG_ERROR("grpc_batch_failed", "method=%s error=%s",
              c->method < M_COUNT ? gsrv__methods[c->method].path : "unknown",
              grpc_call_error_to_string(e));
    final_done(c);
    gcall_unref(c);
  }
}

/* Claims the call and answers it; if someone else answered first (the
 * shutdown sweep), drops `reply`. */
void gsrv__answer(gcall *c, grpc_byte_buffer *reply, int zs, const char *detail) {
  if (atomic_exchange(&c->claimed, 1)) {
    if (reply)
      grpc_byte_buffer_destroy(reply);
    /* The one who answered released the call's room, possibly before this
     * answer counted it. */
    gsrv__answer_release(c);
    return;
  }
  gsrv__send_final(c, reply, zs, detail);
}

void gsrv__answer_as(gcall *c, int claimed, grpc_byte_buffer *reply, int zs, const char *detail) {
  if (claimed)
    gsrv__send_final(c, reply, zs, detail);
  else
    gsrv__answer(c, reply, zs, detail);
}

/* Answers through gsrv__answer() or, when the caller already holds the claim (after
 * a hop), through gsrv__send_final(). */
void gsrv__finish(gcall *c, int claimed, grpc_byte_buffer *reply, int zs, const char *detail) {
  if (c->fwd && zs == ZS_OK) {
    /* The write succeeded here: the backups get it before the trainer hears
     * of it (server/replica/replica.h), on a thread of the forwarding pool,
     * which then answers (grpc_forward.c says why not here). */
    gsrv__fwd_submit(c, claimed, reply);
    return;
  }
  free(c->fwd);
  c->fwd = NULL;
  gsrv__answer_as(c, claimed, reply, zs, detail);
}

grpc_byte_buffer *gsrv__pack_message(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  grpc_slice sl = grpc_slice_malloc(n);
  protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(sl));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  return bb;
}

void gsrv__finish_msg(gcall *c, int claimed, const ProtobufCMessage *m) {
  gsrv__finish(c, claimed, gsrv__pack_message(m), ZS_OK, NULL);
}

void gsrv__finish_err(gcall *c, int claimed, int zs, const char *detail) {
  gsrv__finish(c, claimed, NULL, zs, detail);
}

/* ------------------------------------------------------------------------ */
/* Request decoding                                                         */
/* ------------------------------------------------------------------------ */

void gsrv__bad_message(gcall *c, const char *type) {
  char err[GSRV_ERRLEN];
  snprintf(err, sizeof err, "the request is not a valid %s message", type);
  gsrv__answer(c, NULL, ZS_EPROTO, err);
}

/* ------------------------------------------------------------------------ */
/* Core callbacks and the hop back to a polling thread                      */
/* ------------------------------------------------------------------------ */

static void on_hop(gtag *t, int ok) {
  (void)ok; /* an empty batch always completes; a dead peer shows later */
  gcall *c = container_of(t, gcall, io_tag);
  gsrv *s = c->s;
  pthread_mutex_lock(&s->lock);
  c->waiting = 0;
  pthread_mutex_unlock(&s->lock);
  switch (c->method) {
  case M_PULL:
    gsrv__pull_finish(c, 1);
    break;
  case M_GRAD_STATS:
    gsrv__stats_finish(c, 1);
    break;
  case M_CHECKPOINT:
  case M_COMMIT_CHECKPOINT:
  case M_RESTORE:
    gsrv__ckpt_finish(c, 1);
    break;
  default:
    gsrv__apply_finish(c, 1);
    break;
  }
  gcall_unref(c);
}

/* Runs on a core thread: claims the call and moves on to a polling thread by
 * an empty batch, which gRPC completes at once on the call's queue. If the
 * shutdown sweep answered the call already, only the core's reference is
 * dropped. */
void gsrv__resume_from_core(gcall *c) {
  if (atomic_exchange(&c->claimed, 1) == 0) {
    c->io_tag.done = on_hop;
    gcall_ref(c);
    grpc_call_error e = gsrv__start_batch(c->call, NULL, 0, &c->io_tag);
    if (e != GRPC_CALL_OK) {
      gcall_unref(c);
      gsrv__send_final(c, NULL, ZS_EINTERNAL, "cannot resume the call after the core answered");
    }
  }
  gcall_unref(c);
}

void gsrv__on_core_version(void *arg, int status, uint64_t version) {
  gcall *c = arg;
  (void)version; /* core_read reports the version it reads */
  c->async_status = status;
  gsrv__resume_from_core(c);
}

void gsrv__on_core_stats(void *arg, int status, const core_stats_result *r) {
  gcall *c = arg;
  c->async_status = status;
  if (r)
    c->stats = *r;
  gsrv__resume_from_core(c);
}

void gsrv__on_core_apply(void *arg, int status, const core_apply_result *r) {
  gcall *c = arg;
  c->async_status = status;
  if (r)
    c->apply = *r;
  gsrv__resume_from_core(c);
}

/* Marks the call as parked in the core (or not), for the shutdown grace. */
void gsrv__set_waiting(gcall *c, int waiting) {
  pthread_mutex_lock(&c->s->lock);
  c->waiting = waiting;
  pthread_mutex_unlock(&c->s->lock);
}

/* The absolute clock_now_ms() deadline of a wait: the request's timeout, else
 * the call's deadline (the earlier of both when both are set), never more
 * than GSRV_MAX_WAIT_MS. */
uint64_t gsrv__wait_deadline(const gcall *c, uint32_t timeout_ms) {
  uint64_t rel = GSRV_MAX_WAIT_MS;
  if (timeout_ms > 0 && timeout_ms < rel)
    rel = timeout_ms;
  gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) < 0) {
    gpr_timespec left = gpr_time_sub(dl, gpr_now(GPR_CLOCK_MONOTONIC));
    if (left.tv_sec < 0) {
      rel = 0;
    } else if ((uint64_t)left.tv_sec < rel / 1000 + 1) {
      uint64_t ms = (uint64_t)left.tv_sec * 1000 + (uint64_t)left.tv_nsec / 1000000;
      if (ms < rel)
        rel = ms;
    }
  }
  return clock_now_ms() + rel;
}
