/*
 * dp_request — a decoded frame to the service: each request's checks
 * (service layer, replica set admission), the payload's destination for a
 * push, the work of a complete push, and a pull's admission and its wait for
 * its version in the core. Loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/base/trace.h"
#include "common/net/wire.h"
#include "server/replica/replica.h"
#include "server/service/service.h"

static uint64_t pull_deadline(uint32_t timeout_ms) {
  uint32_t rel = timeout_ms && timeout_ms < DP_MAX_WAIT_MS ? timeout_ms : DP_MAX_WAIT_MS;
  return clock_now_ms() + rel;
}

static void pull_wait(dp_conn *c, dp_pull *p, uint32_t timeout_ms);

/* What every Pull and pull batch passes before it may wait (its answer fits a
 * frame and, when it must be copied, the answer budgets; when it may wait
 * (its version is not there yet; the core refuses one too far ahead), there is
 * room for one more waiting pull on the connection, its peer address and the
 * server: one whose version is there is never refused for lack of that room)
 * and its record; NULL when the request was answered with an error instead.
 * `copied`: the answer can only be a copy (a piece not in the stored dtype). */
static dp_pull *pull_new(dp_conn *c, uint64_t request_id, uint64_t hash, uint64_t min_version,
                         uint64_t nbytes, int copied, const char *what) {
  dp_server *s = c->s;
  char err[DP_ERRLEN];
  if (nbytes > s->max_payload) {
    dp__answer_error(c, request_id,
                     service_too_large(what, nbytes, s->max_payload, "frame", err, sizeof err),
                     err);
    return NULL;
  }
  uint64_t budget = s->max_answer < s->max_answer_total ? s->max_answer : s->max_answer_total;
  if (s->max_answer_peer < budget)
    budget = s->max_answer_peer;
  if (copied && nbytes > budget) {
    status_say(err, sizeof err,
               "the %s's answer of %" PRIu64 " bytes exceeds the server's budget of %" PRIu64
               " bytes for a copied answer; ask for fewer pieces, or in the stored dtype",
               what, nbytes, budget);
    dp__answer_error(c, request_id, ZS_ELIMIT, err);
    return NULL;
  }
  int now = service_wait_admission(s->svc, hash, min_version);
  const char *full = NULL;
  uint64_t cap = 0;
  if (now) {
    /* Answered without waiting: no parking room needed. */
  } else if (c->waiting >= s->max_wait_conn) {
    full = "on this connection";
    cap = s->max_wait_conn;
  } else if (c->pe->waiting >= (s->max_wait + 3u) / 4u) {
    full = "from this peer address";
    cap = (s->max_wait + 3u) / 4u;
  } else if (s->nwaiting >= s->max_wait) {
    full = "on this server";
    cap = s->max_wait;
  }
  if (full) {
    status_say(err, sizeof err, "%" PRIu64 " pulls already wait for their version %s", cap, full);
    dp__answer_error(c, request_id, ZS_ELIMIT, err);
    return NULL;
  }
  dp_pull *p = calloc(1, sizeof *p);
  if (!p) {
    dp__answer_error(c, request_id, ZS_ENOMEM, "out of memory registering a pull");
    return NULL;
  }
  p->mb = s->mb;
  p->conn = c;
  p->request_id = request_id;
  p->start_ns = c->frame_ns;
  return p;
}

static void handle_pull(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_pull *q = &m->u.pull;
  char err[DP_ERRLEN] = "";
  zs_dtype dtype = (zs_dtype)q->dtype;
  /* Size (and so hash, tensor and slice) are checked before waiting, so a
   * bad request fails at once rather than at the end of its wait. */
  int64_t nb =
      service_piece_bytes(s->svc, q->spec_hash, q->tensor, q->slice, dtype, err, sizeof err);
  if (nb < 0) {
    dp__answer_error(c, m->request_id, (int)nb, err);
    return;
  }
  dp_pull *p = pull_new(c, m->request_id, q->spec_hash, q->min_version, (uint64_t)nb,
                        dtype != core_low_dtype(s->core), "piece");
  if (!p)
    return;
  p->hash = q->spec_hash;
  p->min_version = q->min_version;
  p->tensor = q->tensor;
  p->slice = q->slice;
  p->dtype = dtype;
  p->nbytes = (size_t)nb;
  trace_ev(TRACE_PULL_IN, q->min_version, q->tensor, q->slice, 1);
  pull_wait(c, p, q->timeout_ms);
}

/* A PULL_BATCH: every piece is checked (and sized) before the one wait for
 * the version; one bad piece refuses the whole batch, so that the answer is
 * either every piece, of one version, or an ERROR. */
static void handle_pull_batch(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_pull_batch *q = &m->u.pull_batch;
  char err[DP_ERRLEN] = "";
  uint64_t total = 0;
  int copied = 0;
  for (uint32_t i = 0; i < q->npieces; i++) {
    const wire_piece *pc = &q->pieces[i];
    copied |= (zs_dtype)pc->dtype != core_low_dtype(s->core);
    int64_t nb = service_batch_piece_bytes(s->svc, q->spec_hash, i, pc->tensor, pc->slice,
                                           (zs_dtype)pc->dtype, pc->length, err, sizeof err);
    if (nb < 0) {
      dp__answer_error(c, m->request_id, (int)nb, err);
      return;
    }
    total += (uint64_t)nb; /* at most WIRE_MAX_BATCH pieces below 2^62 bytes: no overflow */
  }
  dp_pull *p = pull_new(c, m->request_id, q->spec_hash, q->min_version, total, copied, "batch");
  if (!p)
    return;
  wire_piece *pcs = calloc(q->npieces, sizeof *pcs);
  if (!pcs) {
    dp__pull_free(p);
    dp__answer_error(c, m->request_id, ZS_ENOMEM, "out of memory registering a pull batch");
    return;
  }
  memcpy(pcs, q->pieces, q->npieces * sizeof *pcs);
  p->hash = q->spec_hash;
  p->min_version = q->min_version;
  p->tensor = pcs[0].tensor;
  p->slice = pcs[0].slice;
  p->dtype = (zs_dtype)pcs[0].dtype;
  p->nbytes = (size_t)total;
  p->pieces = pcs;
  p->npieces = q->npieces;
  for (uint32_t i = 0; trace_enabled() && i < q->npieces; i++)
    trace_ev(TRACE_PULL_IN, q->min_version, pcs[i].tensor, pcs[i].slice, q->npieces);
  pull_wait(c, p, q->timeout_ms);
}

/* Parks a Pull (or a batch) until its version is there, or answers it at
 * once when it already is. Takes ownership of p. */
static void pull_wait(dp_conn *c, dp_pull *p, uint32_t timeout_ms) {
  dp_server *s = c->s;
  char err[DP_ERRLEN] = "";
  /* The callback may run on a core thread before core_wait_version even
   * returns, so everything it needs is counted first. */
  pthread_mutex_lock(&s->mb->mu);
  s->mb->refs++;
  pthread_mutex_unlock(&s->mb->mu);
  dp__conn_ref(c);
  c->waiting++;
  c->pe->waiting++;
  s->nwaiting++;
  dp__count(&s->st_waiting, 1);
  uint64_t version = 0;
  uint64_t id = p->request_id;
  /* Per piece: a pipelined job answers each piece once it is applied. */
  core_piece_id one = {p->tensor, p->slice}, *ids = &one;
  uint32_t n = p->pieces ? p->npieces : 1;
  if (p->pieces && (ids = calloc(n, sizeof *ids)) != NULL)
    for (uint32_t i = 0; i < n; i++)
      ids[i] = (core_piece_id){p->pieces[i].tensor, p->pieces[i].slice};
  int rc =
      ids ? core_wait_pieces(s->core, p->hash, ids, n, p->min_version, pull_deadline(timeout_ms),
                             dp__on_core_version, p, &version, err, sizeof err)
          : status_fail(err, sizeof err, ZS_ENOMEM, "out of memory registering a pull");
  if (ids != &one)
    free(ids);
  if (rc == CORE_PENDING)
    return;
  c->waiting--;
  c->pe->waiting--;
  s->nwaiting--;
  dp__count(&s->st_waiting, -1);
  dp__mailbox_unref(s->mb, 1);
  if (rc < 0) {
    dp__answer_error(c, id, rc, err);
    dp__conn_unref(c); /* cannot be the last: the handle holds one */
    dp__pull_free(p);
    return;
  }
  dp__pull_ready(c, p);
}

/* The core's arguments `a` for the piece pc of a push. */
static core_push_args push_piece(core_push_args a, const wire_piece *pc) {
  a.tensor = pc->tensor;
  a.slice = pc->slice;
  a.dtype = (zs_dtype)pc->dtype;
  a.nbytes = (size_t)pc->length;
  return a;
}

/* The core's arguments for a push, without its bytes: a PUSH's own (one
 * piece, the whole payload), or the header of a PUSH_BATCH (each piece
 * filling in its own: push_piece). */
static core_push_args push_args(const wire_msg *m) {
  if (m->type == WIRE_PUSH_BATCH) {
    const wire_push_batch *q = &m->u.push_batch;
    return (core_push_args){
        .hash = q->spec_hash, .step = q->step, .rank = q->rank, .micro = q->micro};
  }
  const wire_push *q = &m->u.push;
  core_push_args a = {.hash = q->spec_hash, .step = q->step, .rank = q->rank, .micro = q->micro};
  return push_piece(a, &(wire_piece){q->tensor, q->slice, q->dtype, m->payload_len});
}

/* PUSH_BATCH: every piece is checked as a single PUSH is before anything is
 * allocated for the payload. When none could be added whatever its bytes
 * say, the batch is answered at once (each piece's status) and its payload
 * is skipped unread into memory. Returns 1 when answered. */
static int push_batch_refused(dp_conn *c, const wire_msg *m) {
  dp_server *s = c->s;
  const wire_push_batch *q = &m->u.push_batch;
  int32_t st[WIRE_MAX_BATCH];
  uint8_t dup[WIRE_MAX_BATCH] = {0};
  wire_msg ack = {.type = WIRE_PUSH_BATCH_ACK, .request_id = m->request_id};
  for (uint32_t i = 0; i < q->npieces; i++) {
    const wire_piece *pc = &q->pieces[i];
    core_push_args a = push_piece(push_args(m), pc);
    char err[DP_ERRLEN] = "";
    st[i] = service_push_check(s->svc, &a, err, sizeof err);
    if (st[i] == 0)
      return 0;
    if (i == 0)
      status_say(ack.u.push_batch_ack.message, sizeof ack.u.push_batch_ack.message,
                 "piece 0 (tensor %" PRIu32 ", slice %" PRIu32 "): %s", pc->tensor, pc->slice,
                 err[0] ? err : zs_strerror(st[i]));
  }
  ack.u.push_batch_ack.npieces = q->npieces;
  ack.u.push_batch_ack.status = st;
  ack.u.push_batch_ack.duplicate = dup;
  dp__conn_send(c, &ack, NULL, 1, 0);
  return 1;
}

/* A PUSH or PUSH_BATCH that its checks admit: where its payload goes, a
 * buffer from the pool. NULL when it was answered instead (refused whatever
 * its bytes say, or no memory for them): the payload is then skipped unread
 * into memory. */
static void *push_admit(dp_conn *c, const wire_msg *m) {
  int batch = m->type == WIRE_PUSH_BATCH;
  if (batch) {
    if (push_batch_refused(c, m))
      return NULL;
  } else {
    core_push_args a = push_args(m);
    char err[DP_ERRLEN] = "";
    int rc = service_push_check(c->s->svc, &a, err, sizeof err);
    if (rc != 0) {
      dp__answer_error(c, m->request_id, rc, err);
      return NULL;
    }
  }
  c->rx = dp__pool_get(c->s, (size_t)m->payload_len);
  if (!c->rx) {
    dp__answer_error(c, m->request_id, ZS_ENOMEM,
                     batch ? "out of memory for the push batch payload"
                           : "out of memory for the push payload");
    return NULL;
  }
  return c->rx->data;
}

/* A replicated shard's verdict on a push or pull (replica_admit): 1 when
 * refused (and answered). A trainer's push to the primary is marked to be
 * forwarded. */
static int replica_refused(dp_conn *c, const wire_msg *m) {
  c->forward_next = 0;
  if (!c->s->rep)
    return 0;
  int push = m->type == WIRE_PUSH || m->type == WIRE_PUSH_BATCH;
  char err[DP_ERRLEN] = "";
  int rc = replica_admit(c->s->rep, push ? REPLICA_WRITE : REPLICA_READ, c->replica_term, c->admin,
                         0, &c->forward_next, err, sizeof err);
  if (rc == 0)
    return 0;
  dp__answer_error(c, m->request_id, rc, err);
  return 1;
}

/* Header and meta of a frame are in: decide where its payload goes. */
void dp__on_meta(dp_conn *c) {
  wire_reader *rd = &c->rd;
  const wire_msg *m = &rd->msg;
  void *dst = NULL;
  if (!c->authed) {
    dp__on_hello(c);
    return;
  }
  if (m->type != WIRE_PUSH && m->type != WIRE_PULL && m->type != WIRE_PING &&
      m->type != WIRE_PUSH_BATCH && m->type != WIRE_PULL_BATCH) {
    char err[DP_ERRLEN];
    status_say(err, sizeof err,
               "a client may send PUSH, PULL or PING (or PUSH_BATCH, PULL_BATCH), and HELLO only "
               "first, not %s (request id %" PRIu64 ")",
               wire_type_name(m->type), m->request_id);
    dp__conn_fatal(c, ZS_EPROTO, err);
    return;
  }
  c->pending++;
  c->frame_ns = clock_now_ns();
  if (rd->meta_status != 0) {
    dp__answer_error(c, m->request_id, rd->meta_status, rd->err);
  } else if (m->type == WIRE_PING) {
    wire_msg pong = {.type = WIRE_PONG, .request_id = m->request_id};
    dp__conn_send(c, &pong, NULL, 1, 0);
  } else if (dp__rank_refused(c, m) || replica_refused(c, m)) {
    /* Answered; a push's payload is skipped. */
  } else if (m->type == WIRE_PULL) {
    handle_pull(c, m);
  } else if (m->type == WIRE_PULL_BATCH) {
    handle_pull_batch(c, m);
  } else {
    /* A PUSH or PUSH_BATCH. For a batch the decoder checked that the pieces
     * tile the payload exactly (an empty payload is a batch of pieces
     * without a gradient, each piece empty); the core judges each piece
     * once the bytes are in (dp__on_done). */
    dst = push_admit(c, m);
  }
  if (c->closing || c->fatal)
    return;
  wire_reader_set_payload(rd, dst);
}

/* A frame is complete. */
void dp__on_done(dp_conn *c) {
  dp_server *s = c->s;
  wire_reader *rd = &c->rd;
  dp__count(&s->st_frames_in, 1);
  if ((rd->msg.type != WIRE_PUSH && rd->msg.type != WIRE_PUSH_BATCH) || !c->rx)
    return;
  dp_buf *b = c->rx;
  c->rx = NULL;
  if (rd->payload_status != 0) {
    dp__count(&s->st_crc_errors, 1);
    dp__pool_put(s, b);
    dp__answer_error(c, rd->msg.request_id, rd->payload_status, rd->err);
    return;
  }
  dp_work *w = calloc(1, sizeof *w);
  if (!w) {
    dp__pool_put(s, b);
    dp__answer_error(c, rd->msg.request_id, ZS_ENOMEM, "out of memory");
    return;
  }
  if (rd->msg.type == WIRE_PUSH_BATCH) {
    const wire_push_batch *q = &rd->msg.u.push_batch;
    w->pieces = calloc(q->npieces, sizeof *w->pieces);
    w->piece_status = calloc(q->npieces, sizeof *w->piece_status);
    w->piece_dup = calloc(q->npieces, 1);
    if (!w->pieces || !w->piece_status || !w->piece_dup) {
      dp__work_free(w);
      dp__pool_put(s, b);
      dp__answer_error(c, rd->msg.request_id, ZS_ENOMEM, "out of memory");
      return;
    }
    memcpy(w->pieces, q->pieces, q->npieces * sizeof *w->pieces);
    w->npieces = q->npieces;
  }
  w->conn = c;
  w->type = rd->msg.type;
  w->request_id = rd->msg.request_id;
  w->start_ns = c->frame_ns;
  w->buf = b;
  w->nbytes = (size_t)rd->msg.payload_len;
  w->push = push_args(&rd->msg);
  w->forward = c->forward_next ? s->rep : NULL;
  dp__work_start(w);
}
