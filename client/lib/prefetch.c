/*
 * prefetch — the prefetch slots: a pull starts pulls of the next tensors
 * into per-tensor slots (zc_prefetch_locked), and a later pull of the same
 * version is served from its slot, copied out (zc_pull_from_slot) or, while
 * the slot's pull is in flight, finished by it (zc_prefetch_finish).
 */
#include <stdint.h>
#include <stdlib.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

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

void zc_prefetch_finish(zs_client *c, zs_request *op, int status, const char *msg) {
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

/* ZC_PULL_SLOT_READY: copies the slot (marked busy) out and finishes op. */
void zc_pull_from_slot(zs_client *c, zs_request *op) {
  zc_slot *slot = &c->slots[op->tensor];
  zc_convert(op->dst, op->buf_dtype, slot->buf, slot_dtype(op->wire_dtype),
             c->sp.tensors[op->tensor].numel);
  pthread_mutex_lock(&c->mu);
  slot->state = ZC_SLOT_EMPTY;
  pthread_mutex_unlock(&c->mu);
  zc_op_part_done(op, ZS_OK, NULL, 0);
}

void zc_slots_free(struct zs_client *c) {
  if (!c->slots)
    return;
  for (uint32_t t = 0; t < c->sp.num_tensors; t++)
    free(c->slots[t].buf);
  free(c->slots);
  c->slots = NULL;
}
