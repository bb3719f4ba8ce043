/*
 * dp_work — the work of one request against the shard: a push (or push
 * batch) through the service, forwarded to the backups on a replicated
 * primary; a pull (or pull batch) pinned in the low copy or read into its
 * answer buffer, all pieces of one version. Small work runs inline on the
 * loop thread, large work on libuv's thread pool (touching only its own
 * dp_work and buffer); its answer is made back on the loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <uv.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/list.h"
#include "common/base/status.h"
#include "common/base/trace.h"
#include "common/net/wire.h"
#include "server/metrics/metrics.h"
#include "server/replica/replica.h"
#include "server/service/service.h"

/* Reads pulls of an apply that lands between two pieces of a batch give
 * pieces of two versions; the batch is read again, this many times at most
 * (an apply is short, and the next one needs every trainer's pushes). */
#define DP_BATCH_READ_TRIES 4

void dp__work_free(dp_work *w) {
  free(w->pieces);
  free(w->piece_status);
  free(w->piece_dup);
  free(w);
}

/* Each piece of a push batch goes through service_push on its own, in order:
 * a refused piece (its status kept) leaves the others alone, exactly as
 * separate PUSH frames would. */
static void work_run_push_batch(dp_work *w) {
  size_t off = 0;
  w->err[0] = '\0';
  core_push_args fwd[WIRE_MAX_BATCH];
  uint32_t nfwd = 0;
  for (uint32_t i = 0; i < w->npieces; i++) {
    const wire_piece *pc = &w->pieces[i];
    core_push_args a = w->push;
    a.tensor = pc->tensor;
    a.slice = pc->slice;
    a.dtype = (zs_dtype)pc->dtype;
    a.data = w->buf->data + off;
    a.nbytes = (size_t)pc->length;
    char err[DP_ERRLEN] = "";
    int dup = 0;
    int rc = service_push(w->svc, &a, &dup, err, sizeof err);
    if (rc == 0 && w->forward)
      fwd[nfwd++] = a;
    w->piece_status[i] = rc;
    w->piece_dup[i] = rc == 0 && dup;
    if (rc != 0 && w->err[0] == '\0')
      status_say(w->err, sizeof w->err,
                 "piece %" PRIu32 " (tensor %" PRIu32 ", slice %" PRIu32 "): %s", i, pc->tensor,
                 pc->slice, err[0] ? err : zs_strerror(rc));
    off += (size_t)pc->length;
  }
  /* The accepted pieces go to the backups together before the batch is
   * answered; if that fails, so do they. */
  char err[DP_ERRLEN] = "";
  int rc = nfwd ? replica_forward_pushes(w->forward, fwd, nfwd, err, sizeof err) : 0;
  for (uint32_t i = 0; rc && i < w->npieces; i++)
    if (w->piece_status[i] == 0) {
      w->piece_status[i] = rc;
      w->piece_dup[i] = 0;
      status_say(w->err, sizeof w->err, "%s", err);
    }
}

/* The pieces of a batch never came out of one version. */
static void batch_mixed(dp_work *w) {
  w->status = ZS_EINTERNAL;
  status_say(w->err, sizeof w->err,
             "the %" PRIu32 " pieces of the batch kept changing version while being read",
             w->npieces);
}

/* A pinned answer that cannot be pinned after all (the job's dtype changed
 * under us, a restore): a buffer of its own for the copy, outside the pool
 * and the answer budgets, as the pin would have been. */
static int buf_own(dp_work *w) {
  dp_buf *b = w->buf;
  void *mem = NULL;
  if (posix_memalign(&mem, 64, w->nbytes ? w->nbytes : 1) != 0) {
    w->status = ZS_ENOMEM;
    status_say(w->err, sizeof w->err, "out of memory for the answer buffer");
    return w->status;
  }
  free(b->segs);
  b->segs = NULL;
  b->data = mem;
  b->cap = w->nbytes;
  return 0;
}

/* Pins every piece of a batch in the low arena (core_pin_low, one piece at a
 * time), all of one version, and makes the payload's CRC from the pieces'
 * stored ones: no byte is read. An apply that lands between two pins gives
 * two versions; the pins are dropped and taken again, as the copy reads
 * again. Returns 0 (the buffer holds the pins), CORE_NOT_PINNED (a piece is
 * not in the stored dtype: nothing is pinned) or w->status's error. */
static int batch_pin(dp_work *w, core *co) {
  dp_buf *b = w->buf;
  for (int attempt = 0; attempt < DP_BATCH_READ_TRIES; attempt++) {
    int mixed = 0;
    w->crc = 0;
    b->pinned = co;
    for (uint32_t i = 0; i < w->npieces && !mixed; i++) {
      const wire_piece *pc = &w->pieces[i];
      const void *p = NULL;
      uint64_t v = 0;
      uint32_t crc = 0;
      w->status = core_pin_low(co, w->hash, pc->tensor, pc->slice, (zs_dtype)pc->dtype,
                               (size_t)pc->length, &p, &v, &crc, w->err, sizeof w->err);
      if (w->status != 0) {
        dp__buf_unpin(b);
        return w->status;
      }
      b->segs[b->nsegs++] = (dp_seg){p, (size_t)pc->length};
      if (i == 0)
        w->version = v;
      else
        mixed = v != w->version;
      w->crc = crc32c_combine(w->crc, crc, (size_t)pc->length);
    }
    if (!mixed)
      return 0;
    dp__buf_unpin(b);
  }
  batch_mixed(w);
  return w->status;
}

/* A pull batch: pinned where it lies (a buffer with room for the pieces),
 * else every piece into one answer buffer, of one version. */
static void work_run_pull_batch(dp_work *w, core *co) {
  if (w->buf->segs && (batch_pin(w, co) != CORE_NOT_PINNED || buf_own(w) != 0))
    return;
  for (int attempt = 0; attempt < DP_BATCH_READ_TRIES; attempt++) {
    size_t off = 0;
    int mixed = 0;
    w->crc = 0;
    for (uint32_t i = 0; i < w->npieces; i++) {
      const wire_piece *pc = &w->pieces[i];
      uint64_t v = 0;
      w->status =
          core_read_crc(co, w->hash, pc->tensor, pc->slice, (zs_dtype)pc->dtype, w->buf->data + off,
                        (size_t)pc->length, &v, &w->crc, w->err, sizeof w->err);
      if (w->status != 0)
        return;
      if (i == 0)
        w->version = v;
      else if (v != w->version)
        mixed = 1;
      off += (size_t)pc->length;
    }
    if (!mixed)
      return;
  }
  batch_mixed(w);
}

static void work_run(dp_work *w, core *co) {
  if (w->type == WIRE_PUSH_BATCH) {
    work_run_push_batch(w);
  } else if (w->type == WIRE_PULL_BATCH) {
    work_run_pull_batch(w, co);
  } else if (w->type == WIRE_PUSH) {
    w->push.data = w->buf->data;
    w->status = service_push(w->svc, &w->push, &w->duplicate, w->err, sizeof w->err);
    if (w->status == 0 && w->forward)
      w->status = replica_forward_push(w->forward, &w->push, w->err, sizeof w->err);
  } else {
    w->crc = 0;
    if (w->buf->cls < 0) {
      /* Zero-copy candidate: sent straight from the low arena. */
      const void *p = NULL;
      w->status = core_pin_low(co, w->hash, w->tensor, w->slice, w->dtype, w->nbytes, &p,
                               &w->version, &w->crc, w->err, sizeof w->err);
      if (w->status == 0) {
        w->buf->data = (unsigned char *)(uintptr_t)p;
        w->buf->pinned = co;
        return;
      }
      if (w->status != CORE_NOT_PINNED || buf_own(w) != 0)
        return;
    }
    w->status = core_read_crc(co, w->hash, w->tensor, w->slice, w->dtype, w->buf->data, w->nbytes,
                              &w->version, &w->crc, w->err, sizeof w->err);
  }
}

/* Records a request's time from arrival to answer. */
void dp__observe(dp_server *s, int type, uint64_t start_ns, int failed) {
  metrics_rpc *r = type == WIRE_PUSH         ? s->m_push
                   : type == WIRE_PULL       ? s->m_pull
                   : type == WIRE_PUSH_BATCH ? s->m_push_batch
                                             : s->m_pull_batch;
  metrics_rpc_observe(r, clock_now_ns() - start_ns, failed);
}

/* Loop thread: answers a finished work and releases it. */
static void work_finish(dp_work *w) {
  dp_conn *c = w->conn;
  dp_server *s = c->s;
  dp__observe(s, w->type, w->start_ns, w->status != 0);
  int pull = w->type == WIRE_PULL || w->type == WIRE_PULL_BATCH;
  if (pull && w->status == 0 && trace_enabled()) {
    if (w->pieces)
      for (uint32_t i = 0; i < w->npieces; i++)
        trace_ev(TRACE_PULL_OUT, w->version, w->pieces[i].tensor, w->pieces[i].slice, w->npieces);
    else
      trace_ev(TRACE_PULL_OUT, w->version, w->tensor, w->slice, 1);
  }
  if (pull)
    c->producing -= w->nbytes;
  else
    c->consuming -= w->nbytes;
  if (w->type == WIRE_PUSH_BATCH && w->status == 0) {
    dp__pool_put(s, w->buf);
    wire_msg m = {.type = WIRE_PUSH_BATCH_ACK, .request_id = w->request_id};
    m.u.push_batch_ack.npieces = w->npieces;
    m.u.push_batch_ack.status = w->piece_status;
    m.u.push_batch_ack.duplicate = w->piece_dup;
    status_say(m.u.push_batch_ack.message, sizeof m.u.push_batch_ack.message, "%s", w->err);
    dp__conn_send(c, &m, NULL, 1, 0);
  } else if (w->type == WIRE_PULL_BATCH && w->status == 0) {
    uint64_t lengths[WIRE_MAX_BATCH];
    wire_msg m = {.type = WIRE_PULL_BATCH_DATA,
                  .request_id = w->request_id,
                  .payload_len = w->nbytes,
                  .payload_crc = w->crc};
    m.u.pull_batch_data.version = w->version;
    m.u.pull_batch_data.npieces = w->npieces;
    m.u.pull_batch_data.length = lengths;
    for (uint32_t i = 0; i < w->npieces; i++) {
      lengths[i] = w->pieces[i].length;
      core_count_pull(s->core, w->pieces[i].length + (i == 0 ? WIRE_HEADER_SIZE : 0));
    }
    /* Counted before the write, which may reach the peer at once. */
    if (w->buf->segs)
      dp__count(&s->st_pinned_batches, 1);
    dp__conn_send_budget(c, &m, w->buf, 1, 0, w->budget);
  } else if (w->status != 0) {
    dp__pool_put(s, w->buf);
    dp__budget_release(c, w->budget);
    dp__answer_error(c, w->request_id, w->status, w->err);
  } else if (w->type == WIRE_PUSH) {
    dp__pool_put(s, w->buf);
    wire_msg m = {.type = WIRE_PUSH_ACK, .request_id = w->request_id};
    m.u.push_ack.duplicate = w->duplicate;
    dp__conn_send(c, &m, NULL, 1, 0);
  } else {
    wire_msg m = {.type = WIRE_PULL_DATA,
                  .request_id = w->request_id,
                  .payload_len = w->nbytes,
                  .payload_crc = w->crc};
    m.u.pull_data.version = w->version;
    m.u.pull_data.dtype = (int)w->dtype;
    core_count_pull(s->core, WIRE_HEADER_SIZE + w->nbytes);
    dp__conn_send_budget(c, &m, w->buf, 1, 0, w->budget);
  }
  if (pull)
    dp__conn_produce(c);
  dp__work_free(w);
  dp__conn_unref(c);
}

static void on_work(uv_work_t *req) {
  dp_work *w = container_of(req, dp_work, req);
  work_run(w, w->core);
}

static void on_work_done(uv_work_t *req, int status) {
  dp_work *w = container_of(req, dp_work, req);
  if (status < 0 && w->status == 0) {
    w->status = ZS_ECANCELED;
    status_say(w->err, sizeof w->err, "the server is shutting down");
  }
  work_finish(w);
}

/* Runs a work inline when it is small, else on the thread pool. Takes
 * ownership of w. */
void dp__work_start(dp_work *w) {
  dp_conn *c = w->conn;
  dp_server *s = c->s;
  dp__conn_ref(c);
  w->core = s->core;
  w->svc = s->svc;
  if (w->type == WIRE_PUSH || w->type == WIRE_PUSH_BATCH)
    c->consuming += w->nbytes;
  /* A forward waits for the backups: never on the loop thread. */
  if (w->nbytes <= s->inline_bytes && !w->forward) {
    work_run(w, s->core);
    work_finish(w);
    return;
  }
  int rc = uv_queue_work(&s->loop, &w->req, on_work, on_work_done);
  if (rc < 0) {
    w->status = ZS_EINTERNAL;
    status_say(w->err, sizeof w->err, "cannot queue work: %s", uv_strerror(rc));
    work_finish(w);
    return;
  }
  /* The request is pending, so this only pauses reading (DP_CONSUME_WINDOW). */
  dp__conn_check(c);
}
