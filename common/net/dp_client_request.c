/*
 * dp_client_request — a request's life in the data plane's client: building
 * Push, Pull, batch and Ping requests and submitting them (any thread, under
 * mu), the in-flight table by request id and the pending lists (loop
 * thread), and completing a request exactly once. Threads, lock order and a
 * request's memory: dp_client.c.
 */
#include "common/net/dp_client_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <uv.h>

#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/wire.h"

void dpc__req_free(dp_req *r) {
  free(r->segs);
  free(r->pieces);
  free(r->piece_data);
  free(r->big_head);
  free(r);
}

void dpc__table_put(dp_client *c, dp_req *r) {
  dp_req **b = &c->table[r->msg.request_id % DPC_BUCKETS];
  r->hnext = *b;
  *b = r;
  r->in_table = 1;
}

dp_req *dpc__table_find(dp_client *c, uint64_t id) {
  for (dp_req *r = c->table[id % DPC_BUCKETS]; r; r = r->hnext)
    if (r->msg.request_id == id)
      return r;
  return NULL;
}

static void table_remove(dp_client *c, dp_req *r) {
  if (!r->in_table)
    return;
  for (dp_req **p = &c->table[r->msg.request_id % DPC_BUCKETS]; *p; p = &(*p)->hnext) {
    if (*p == r) {
      *p = r->hnext;
      break;
    }
  }
  r->in_table = 0;
}

/* Detaches a request from wherever it is (pending list, or its connection's
 * in-flight list and the id table). */
void dpc__req_detach(dp_client *c, dp_req *r) {
  list_remove(&r->node);
  table_remove(c, r);
  if (r->conn) {
    r->conn->ninflight--;
    r->conn->bytes_inflight -= r->nbytes;
    if (r->conn->rx == r)
      r->conn->rx = NULL;
    r->conn = NULL;
  }
}

/* The first waiting request, the others before the pushes; NULL when none
 * waits. */
dp_req *dpc__pending_first(dp_client *c) {
  list_node *l = !list_empty(&c->pending)        ? c->pending.next
                 : !list_empty(&c->pending_bulk) ? c->pending_bulk.next
                                                 : NULL;
  return l ? container_of(l, dp_req, node) : NULL;
}

/* Runs the callback once; frees the request unless libuv still holds its
 * write. The request must be detached. */
void dpc__req_complete_res(dp_req *r, const dp_result *res) {
  r->completed = 1;
  r->cb(r->arg, res);
  if (!r->writing)
    dpc__req_free(r);
}

void dpc__req_complete(dp_req *r, int status, int duplicate, uint64_t version, const char *msg) {
  dp_result res = {.status = status,
                   .duplicate = duplicate,
                   .version = version,
                   .message = status == 0 ? "" : (msg && *msg ? msg : zs_strerror(status))};
  dpc__req_complete_res(r, &res);
}

static int submit(dp_client *c, dp_req *r) {
  pthread_mutex_lock(&c->mu);
  if (c->closing) {
    pthread_mutex_unlock(&c->mu);
    dpc__req_free(r);
    return ZS_ECLOSED;
  }
  if (c->q_tail)
    c->q_tail->qnext = r;
  else
    c->q_head = r;
  c->q_tail = r;
  uv_async_send(&c->async);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

static dp_req *req_new(dp_done_cb cb, void *arg, uint32_t timeout_ms) {
  dp_req *r = calloc(1, sizeof *r);
  if (!r)
    return NULL;
  r->cb = cb;
  r->arg = arg;
  r->timeout_ms = timeout_ms ? timeout_ms : DP_DEFAULT_TIMEOUT_MS;
  return r;
}

int dp_client_push(dp_client *c, const dp_push_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || (!a->data && a->nbytes) || !dtype_valid((int)a->dtype) ||
      a->nbytes > c->max_payload)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PUSH;
  r->msg.u.push = (wire_push){.spec_hash = a->spec_hash,
                              .step = a->step,
                              .rank = a->rank,
                              .micro = a->micro,
                              .tensor = a->tensor,
                              .slice = a->slice,
                              .dtype = (int)a->dtype};
  r->msg.payload_len = a->nbytes;
  /* On the submitting thread: the loop thread has the socket to serve. */
  r->msg.payload_crc = a->nbytes ? crc32c(0, a->data, a->nbytes) : 0;
  r->data = a->data;
  r->nbytes = a->nbytes;
  return submit(c, r);
}

int dp_client_pull(dp_client *c, const dp_pull_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || !a->dst || a->nbytes == 0 || !dtype_valid((int)a->dtype) ||
      a->nbytes > c->max_payload)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PULL;
  r->msg.u.pull = (wire_pull){.spec_hash = a->spec_hash,
                              .min_version = a->min_version,
                              .tensor = a->tensor,
                              .slice = a->slice,
                              .timeout_ms = r->timeout_ms,
                              .dtype = (int)a->dtype};
  r->dst = a->dst;
  r->nbytes = a->nbytes;
  return submit(c, r);
}

/* Checks a batch's pieces and copies them into r (type, pieces, total
 * size). Returns 0 or ZS_EINVAL / ZS_ENOMEM (r is then still the caller's). */
static int batch_prepare(dp_client *c, dp_req *r, wire_type type, const dp_batch_piece *pieces,
                         uint32_t n) {
  if (!pieces || n == 0 || n > WIRE_MAX_BATCH)
    return ZS_EINVAL;
  r->big_head = malloc(WIRE_MAX_BATCH_ENCODED);
  r->pieces = calloc(n, sizeof *r->pieces);
  if (!r->big_head || !r->pieces)
    return ZS_ENOMEM;
  wire_piece *out = r->pieces;
  size_t total = 0;
  for (uint32_t i = 0; i < n; i++) {
    const dp_batch_piece *p = &pieces[i];
    /* A push piece may be empty (no gradient, data NULL); a pull piece
     * never is. */
    if (!dtype_valid((int)p->dtype) || (p->nbytes == 0 && type != WIRE_PUSH_BATCH) ||
        p->nbytes > c->max_payload - total || (type == WIRE_PUSH_BATCH && p->nbytes && !p->data))
      return ZS_EINVAL;
    total += p->nbytes;
    out[i].tensor = p->tensor;
    out[i].slice = p->slice;
    out[i].dtype = (int)p->dtype;
    out[i].length = p->nbytes;
  }
  r->msg.type = type;
  r->nbytes = total;
  return 0;
}

int dp_client_push_batch(dp_client *c, const dp_push_batch_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  int rc = batch_prepare(c, r, WIRE_PUSH_BATCH, a->pieces, a->npieces);
  if (rc == 0 && !(r->piece_data = malloc(a->npieces * sizeof *r->piece_data)))
    rc = ZS_ENOMEM;
  if (rc != 0) {
    dpc__req_free(r);
    return rc;
  }
  wire_push_batch *b = &r->msg.u.push_batch;
  b->spec_hash = a->spec_hash;
  b->step = a->step;
  b->rank = a->rank;
  b->micro = a->micro;
  b->npieces = a->npieces;
  b->pieces = r->pieces;
  /* On the submitting thread, over the pieces in payload order. */
  uint32_t crc = 0;
  for (uint32_t i = 0; i < a->npieces; i++) {
    r->piece_data[i] = a->pieces[i].data;
    if (a->pieces[i].nbytes)
      crc = crc32c(crc, a->pieces[i].data, a->pieces[i].nbytes);
  }
  r->msg.payload_len = r->nbytes;
  r->msg.payload_crc = crc;
  return submit(c, r);
}

/* A pull batch's destinations as the reader's segments: a->dsts[i] for
 * piece i, or a->dst for them all. Returns 0 or ZS_EINVAL / ZS_ENOMEM. */
static int batch_segs(dp_req *r, const dp_pull_batch_args *a) {
  uint32_t n = a->dsts ? a->npieces : 1;
  if (!(r->segs = malloc(n * sizeof *r->segs)))
    return ZS_ENOMEM;
  r->nsegs = n;
  if (!a->dsts) {
    r->segs[0] = (wire_seg){.base = a->dst, .len = r->nbytes};
    return 0;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (!a->dsts[i])
      return ZS_EINVAL;
    r->segs[i] = (wire_seg){.base = a->dsts[i], .len = a->pieces[i].nbytes};
  }
  return 0;
}

int dp_client_pull_batch(dp_client *c, const dp_pull_batch_args *a, dp_done_cb cb, void *arg) {
  if (!c || !a || !cb || !a->dst == !a->dsts)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, a->timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  int rc = batch_prepare(c, r, WIRE_PULL_BATCH, a->pieces, a->npieces);
  if (rc == 0)
    rc = batch_segs(r, a);
  if (rc != 0) {
    dpc__req_free(r);
    return rc;
  }
  wire_pull_batch *b = &r->msg.u.pull_batch;
  b->spec_hash = a->spec_hash;
  b->min_version = a->min_version;
  b->timeout_ms = r->timeout_ms;
  b->npieces = a->npieces;
  b->pieces = r->pieces;
  r->dst = a->dst;
  return submit(c, r);
}

int dp_client_ping(dp_client *c, uint32_t timeout_ms, dp_done_cb cb, void *arg) {
  if (!c || !cb)
    return ZS_EINVAL;
  dp_req *r = req_new(cb, arg, timeout_ms);
  if (!r)
    return ZS_ENOMEM;
  r->msg.type = WIRE_PING;
  return submit(c, r);
}
