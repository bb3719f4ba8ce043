/*
 * core_data — the job's tensors on one shard: initial weights, pushes of
 * contributions, reads and the pins of the low copy (see core.h for the
 * contract; threads and locks are described at the top of core.c).
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/base/trace.h"
#include "common/model/spec_optim.h"

/* ---------------------------------------------------------------- lookups */

/* The state of piece (tensor, slice) if this shard owns it. Called with
 * state_rw held. */
static int core_find_piece(core *c, uint32_t tensor, uint32_t slice, piece_state **out, char *err,
                           size_t errlen) {
  const layout *l = &c->layout;
  /* Every sentence starts the same way, so that a caller can tell "not
   * here" apart from why without parsing. */
  if (tensor >= l->num_tensors)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: the job has %u tensors",
                       tensor, slice, l->num_tensors);
  const layout_piece *lp = layout_find(l, tensor, slice);
  if (!lp)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: tensor %u has no slice %u",
                       tensor, slice, tensor, slice);
  if (lp->shard != c->shard_id)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "no piece (tensor %u, slice %u) on this shard: it is owned by shard %u, "
                       "not by shard %u",
                       tensor, slice, lp->shard, c->shard_id);
  *out = &c->pieces[c->local_of[lp - l->pieces]];
  return 0;
}

int core__piece_index(core *c, uint32_t tensor, uint32_t slice, uint32_t *index, char *err,
                      size_t errlen) {
  piece_state *ps = NULL;
  int rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc == 0)
    *index = (uint32_t)(ps - c->pieces);
  return rc;
}

static int core_check_payload(const piece_state *ps, int dtype, size_t nbytes, const void *data,
                              char *err, size_t errlen) {
  int rc = dtype_check(dtype, err, errlen);
  if (rc != 0)
    return rc;
  uint64_t want = dtype_bytes(dtype, ps->lp->numel);
  if ((uint64_t)nbytes != want)
    return status_fail(err, errlen, ZS_ESIZE,
                       "payload of slice %u of tensor %u has %zu bytes, expected %" PRIu64,
                       ps->lp->slice, ps->lp->tensor, nbytes, want);
  if (!data)
    return status_fail(err, errlen, ZS_EINVAL, "payload pointer is NULL");
  return 0;
}

/* The checks of a read of piece (tensor, slice) into nbytes of dtype at dst:
 * the job, the piece's owner, the size. With state_rw held. */
static int core_find_readable(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                              zs_dtype dtype, size_t nbytes, const void *dst, piece_state **ps,
                              char *err, size_t errlen) {
  int rc = core__check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, ps, err, errlen);
  if (rc == 0)
    rc = core_check_payload(*ps, (int)dtype, nbytes, dst, err, errlen);
  return rc;
}

/* ------------------------------------------------------- the low copy's pins */

/* Called wherever the low copy of piece i was rewritten from the master
 * (initial weights, every apply, restore, a state write), with state_rw held
 * exclusively: its CRC, and the INT8_BLOCK copy with its CRC once a trainer
 * pulls int8, so that a version's int8 pulls are quantized once here and
 * never per request. The optimizer pass computes the CRC itself, chunk by
 * chunk (core_worker.c); the other writers pass core__low_crc_task's. */
void core__low_crc_set(core *c, uint32_t i, uint32_t crc) {
  piece_state *ps = &c->pieces[i];
  const layout_piece *lp = ps->lp;
  c->low_crc[i] = crc;
  ps->q8_fresh = 0;
  if (atomic_load_explicit(&c->q8_wanted, memory_order_relaxed)) {
    unsigned char *q = c->q8 + ps->q8_off;
    dtype_from_f32(ZS_DTYPE_INT8_BLOCK, c->master + lp->arena_off, q, (size_t)lp->numel);
    c->q8_crc[i] = crc32c(0, q, (size_t)dtype_bytes(ZS_DTYPE_INT8_BLOCK, lp->numel));
    ps->q8_fresh = 1;
  }
}

void core__low_crc_task(void *arg, size_t i) {
  core *c = arg;
  const layout_piece *lp = c->pieces[i].lp;
  core__low_crc_set(c, (uint32_t)i,
                    crc32c(0, c->low + lp->arena_off, (size_t)lp->numel * sizeof(uint16_t)));
}

/* zeroed: the first buffer of a job (its padding stays 0); else the caller
 * overwrites every byte at once, and zeroing first would double the cost. */
static low_buf *low_buf_new(uint64_t nelems, int zeroed) {
  low_buf *b = calloc(1, sizeof *b);
  if (!b)
    return NULL;
  b->nelems = nelems;
  void *p = NULL;
  if (zeroed)
    b->data = core__arena_alloc(nelems * sizeof(uint16_t));
  else if (nelems > 0 && posix_memalign(&p, 64, (size_t)nelems * sizeof(uint16_t)) == 0)
    b->data = p;
  if (nelems > 0 && !b->data) {
    free(b);
    return NULL;
  }
  return b;
}

static void low_buf_free(low_buf *b) {
  if (b) {
    free(b->data);
    free(b);
  }
}

int core__low_create(core *c) {
  if (!(c->low_cur = low_buf_new(c->nelems, 1)))
    return ZS_ENOMEM;
  c->low = c->low_cur->data;
  return 0;
}

/* Moves b to the retired list, or frees it when its pins are gone. Called
 * with low_mu held; returns the buffer to free after unlocking, if any. */
static low_buf *low_retire(core *c, low_buf *b) {
  if (b->pins == 0)
    return b;
  b->next = c->low_retired;
  c->low_retired = b;
  c->nretired++;
  return NULL;
}

void core__low_release(core *c) {
  if (!c->low_mu_inited)
    return;
  pthread_mutex_lock(&c->low_mu);
  low_buf *gone = c->low_cur ? low_retire(c, c->low_cur) : NULL;
  c->low_cur = NULL;
  c->low = NULL;
  pthread_mutex_unlock(&c->low_mu);
  low_buf_free(gone);
}

void core__low_writable(core *c, const char *what) {
  pthread_mutex_lock(&c->low_mu);
  uint64_t pins = c->low_cur ? c->low_cur->pins : 0;
  uint32_t retired = c->nretired;
  pthread_mutex_unlock(&c->low_mu);
  if (pins == 0)
    return; /* steady training: no answer is out while a step is written */
  /* No new pin can start (state_rw is exclusive), so the copy made here
   * holds the current bytes; one copy of 2 bytes per element, only while
   * an answer of the old version is still being sent. */
  low_buf *fresh = retired < CORE_LOW_RETIRED_MAX ? low_buf_new(c->nelems, 0) : NULL;
  if (!fresh) {
    atomic_fetch_add_explicit(&c->low_overtaken, 1, memory_order_relaxed);
    LOG_WARN("pull_answers_overtaken",
             "shard=%u what=%s answers=%" PRIu64 " retired_copies=%u detail=\"answers still being "
             "sent from the low copy and no room for another copy; their readers will refuse "
             "them by CRC and ask again\"",
             c->shard_id, what, pins, retired);
    return;
  }
  if (c->nelems > 0)
    memcpy(fresh->data, c->low, (size_t)c->nelems * sizeof(uint16_t));
  pthread_mutex_lock(&c->low_mu);
  low_buf *gone = low_retire(c, c->low_cur);
  c->low_cur = fresh;
  c->low = fresh->data;
  /* The pins are the retired buffer's now. */
  if (c->piece_pins && c->npieces > 0)
    memset(c->piece_pins, 0, (size_t)c->npieces * sizeof *c->piece_pins);
  pthread_mutex_unlock(&c->low_mu);
  low_buf_free(gone);
  LOG_DEBUG("low_copy_retired", "shard=%u what=%s answers=%" PRIu64, c->shard_id, what, pins);
}

void core__low_batch_writable(core *c) {
  int pinned = 0;
  pthread_mutex_lock(&c->low_mu);
  for (uint32_t b = 0; b < c->nbatch && !pinned; b++)
    pinned = c->piece_pins[c->batch[b]] > 0;
  pthread_mutex_unlock(&c->low_mu);
  if (pinned)
    core__low_writable(c, "piece apply");
}

/* The local index of the piece whose low copy holds element `off` of the
 * arena (by_off is sorted; off lies in some piece). Called with low_mu held
 * while low_cur is set. */
static uint32_t piece_at(const core *c, uint64_t off) {
  uint32_t lo = 0, hi = c->npieces; /* the answer is in [lo, hi) */
  while (hi - lo > 1) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (c->by_off[mid].off <= off)
      lo = mid;
    else
      hi = mid;
  }
  return c->by_off[lo].index;
}

int core_pin_low(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                 size_t nbytes, const void **data, uint64_t *version, uint32_t *crc, char *err,
                 size_t errlen) {
  piece_state *ps = NULL;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_find_readable(c, hash, tensor, slice, dtype, nbytes, data, &ps, err, errlen);
  if (rc == 0 && (dtype != c->spec.param_dtype || !ps->initialized))
    rc = CORE_NOT_PINNED;
  if (rc == 0) {
    uint32_t i = (uint32_t)(ps - c->pieces);
    *data = c->low + ps->lp->arena_off;
    *crc = c->low_crc[i];
    /* As core_read: a piece a pipelined step applied ahead of the others is
     * at the pending step's version already, and its low copy holds it. */
    if (version)
      *version = c->version + (uint64_t)ps->ahead;
    /* low_cur only changes under state_rw exclusive, so it is the buffer
     * *data points into. */
    pthread_mutex_lock(&c->low_mu);
    c->low_cur->pins++;
    c->piece_pins[i]++; /* a pipelined pass of this piece copies the arena first */
    pthread_mutex_unlock(&c->low_mu);
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

zs_dtype core_low_dtype(core *c) {
  return (zs_dtype)atomic_load(&c->low_dtype);
}

void core_unpin_low(core *c, const void *data) {
  const uint16_t *p = data;
  low_buf *gone = NULL;
  int found = 0;
  pthread_mutex_lock(&c->low_mu);
  low_buf *b = c->low_cur;
  if (b && b->pins > 0 && p >= b->data && p < b->data + b->nelems) {
    b->pins--;
    uint32_t *pp = &c->piece_pins[piece_at(c, (uint64_t)(p - b->data))];
    if (*pp > 0)
      (*pp)--;
    found = 1;
  }
  for (low_buf **pb = &c->low_retired; !found && *pb; pb = &(*pb)->next) {
    b = *pb;
    if (p < b->data || p >= b->data + b->nelems)
      continue;
    found = 1;
    if (--b->pins == 0) {
      *pb = b->next;
      c->nretired--;
      gone = b;
    }
    break; /* *pb may be NULL now: no step to its next */
  }
  pthread_mutex_unlock(&c->low_mu);
  low_buf_free(gone);
  if (!found)
    LOG_ERROR("unpin_unknown", "shard=%u detail=\"core_unpin_low of an answer never pinned\"",
              c->shard_id);
}

/* ---------------------------------------------------------------- initial weights */

static uint64_t chunks_of(uint64_t numel) {
  return (numel + LAYOUT_INIT_CHUNK_ELEMS - 1) / LAYOUT_INIT_CHUNK_ELEMS;
}

static int chunk_have(const piece_state *ps, uint64_t k) {
  if (ps->initialized)
    return 1;
  return ps->init_chunks && (ps->init_chunks[k / 64] >> (k % 64) & 1u);
}

/* Checks a part of the initial weights against the piece and against what
 * was written before; with state_rw held exclusively. */
static int init_range_check(core *c, const piece_state *ps, uint64_t offset, const float *data,
                            size_t nbytes, char *err, size_t errlen) {
  const layout_piece *lp = ps->lp;
  if (!data)
    return status_fail(err, errlen, ZS_EINVAL, "payload pointer is NULL");
  if (nbytes % sizeof(float) != 0 || nbytes == 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights of %zu bytes are not a positive number of float32", nbytes);
  uint64_t n = nbytes / sizeof(float);
  if (offset % LAYOUT_INIT_CHUNK_ELEMS != 0)
    return status_fail(err, errlen, ZS_ERANGE,
                       "initial weights at element %" PRIu64 " of slice %u of tensor %u: a part "
                       "must start at a multiple of %u elements",
                       offset, lp->slice, lp->tensor, LAYOUT_INIT_CHUNK_ELEMS);
  if (offset > lp->numel || n > lp->numel - offset)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights for elements [%" PRIu64 ", %" PRIu64 ") of slice %u of "
                       "tensor %u, which has %" PRIu64 " elements",
                       offset, offset + n, lp->slice, lp->tensor, lp->numel);
  if ((offset + n) % LAYOUT_INIT_CHUNK_ELEMS != 0 && offset + n != lp->numel)
    return status_fail(err, errlen, ZS_ESIZE,
                       "initial weights for elements [%" PRIu64 ", %" PRIu64 ") of slice %u of "
                       "tensor %u: a part must end at a multiple of %u elements or at the "
                       "piece's end (%" PRIu64 ")",
                       offset, offset + n, lp->slice, lp->tensor, LAYOUT_INIT_CHUNK_ELEMS,
                       lp->numel);
  if (c->version > 0)
    return 0; /* training has moved on: the initial weights are history */
  const float *dst = c->master + lp->arena_off;
  for (uint64_t e = offset; e < offset + n; e += LAYOUT_INIT_CHUNK_ELEMS) {
    uint64_t k = e / LAYOUT_INIT_CHUNK_ELEMS;
    uint64_t len =
        offset + n - e < LAYOUT_INIT_CHUNK_ELEMS ? offset + n - e : LAYOUT_INIT_CHUNK_ELEMS;
    if (chunk_have(ps, k) && memcmp(dst + e, data + (e - offset), len * sizeof(float)) != 0)
      return status_fail(err, errlen, ZS_EEXIST,
                         "slice %u of tensor %u already holds different initial weights (elements "
                         "from %" PRIu64 ")",
                         lp->slice, lp->tensor, e);
  }
  return 0;
}

int core_init_params_range(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                           const float *data, size_t nbytes, int *written, uint64_t *version,
                           char *err, size_t errlen) {
  piece_state *ps = NULL;
  int w = 0;
  pthread_rwlock_wrlock(&c->state_rw);
  int rc = core__check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc == 0)
    rc = init_range_check(c, ps, offset, data, nbytes, err, errlen);
  if (rc != 0 || c->version > 0 || ps->initialized)
    goto done;
  uint64_t total = chunks_of(ps->lp->numel);
  if (!ps->init_chunks && !(ps->init_chunks = calloc((total + 63) / 64, sizeof(uint64_t)))) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory for the initial weights' bitmap");
    goto done;
  }
  float *dst = c->master + ps->lp->arena_off;
  uint64_t end = offset + nbytes / sizeof(float);
  for (uint64_t e = offset; e < end; e += LAYOUT_INIT_CHUNK_ELEMS) {
    uint64_t k = e / LAYOUT_INIT_CHUNK_ELEMS;
    if (chunk_have(ps, k))
      continue;
    size_t len = (size_t)(end - e < LAYOUT_INIT_CHUNK_ELEMS ? end - e : LAYOUT_INIT_CHUNK_ELEMS);
    memcpy(dst + e, data + (e - offset), len * sizeof(float));
    dtype_from_f32(c->spec.param_dtype, dst + e, c->low + ps->lp->arena_off + e, len);
    ps->init_chunks[k / 64] |= (uint64_t)1 << (k % 64);
    ps->init_have++;
    w = 1;
  }
  if (ps->init_have == total) {
    free(ps->init_chunks);
    ps->init_chunks = NULL;
    core__low_crc_task(c, (size_t)(ps - c->pieces));
    ps->initialized = 1;
    pthread_mutex_lock(&c->mu);
    if (++c->initialized_pieces == c->npieces) {
      c->version_event = 1;
      pthread_cond_signal(&c->worker_cv);
    }
    pthread_mutex_unlock(&c->mu);
  }
done:
  if (rc == 0) {
    if (written)
      *written = w;
    if (version)
      *version = c->version;
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

int core_init_params(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, const float *data,
                     size_t nbytes, int *written, uint64_t *version, char *err, size_t errlen) {
  return core_init_params_range(c, hash, tensor, slice, 0, data, nbytes, written, version, err,
                                errlen);
}

/* ---------------------------------------------------------------- push */

static int bit_test(const uint64_t *bits, uint32_t k) {
  return (int)((bits[k / 64] >> (k % 64)) & 1u);
}

static void bit_set(uint64_t *bits, uint32_t k) {
  bits[k / 64] |= UINT64_C(1) << (k % 64);
}

/* Adds contribution data into the piece's accumulator range; an empty one
 * (no gradient) adds nothing, which has the bits of adding zeros (x + 0 is
 * x, -0 aside). */
static void piece_add(core *c, piece_state *ps, zs_dtype dtype, const void *data, size_t nbytes) {
  if (nbytes > 0)
    dtype_accumulate(dtype, data, c->acc + ps->lp->arena_off, (size_t)ps->lp->numel);
}

held_contrib *core__held_get(core *c, size_t nbytes) {
  pthread_mutex_lock(&c->held_mu);
  held_contrib **pp = &c->held_cache;
  while (*pp && ((*pp)->cap < nbytes || (*pp)->cap / 2 > nbytes))
    pp = &(*pp)->next;
  held_contrib *h = *pp;
  if (h) {
    *pp = h->next;
    c->held_cache_bytes -= h->cap;
    c->held_reused++;
  }
  pthread_mutex_unlock(&c->held_mu);
  if (!h && (h = malloc(sizeof *h + nbytes)) != NULL)
    h->cap = nbytes;
  return h;
}

void core__piece_drop_held(core *c, piece_state *ps) {
  if (!ps->held)
    return;
  for (uint32_t k = 0; k < c->WM; k++)
    core__held_put(c, ps->held[k]);
  free(ps->held);
  ps->held = NULL;
}

void core__held_put(core *c, held_contrib *h) {
  if (!h)
    return;
  if (!c->held_mu_inited) {
    free(h); /* a core torn down before it was built */
    return;
  }
  pthread_mutex_lock(&c->held_mu);
  int keep = c->held_cache_bytes + h->cap <= CORE_HELD_CACHE_BYTES;
  if (keep) {
    h->next = c->held_cache;
    c->held_cache = h;
    c->held_cache_bytes += h->cap;
  }
  pthread_mutex_unlock(&c->held_mu);
  if (!keep)
    free(h);
}

void core__held_drain(core *c) {
  while (c->held_cache) {
    held_contrib *h = c->held_cache;
    c->held_cache = h->next;
    free(h);
  }
  c->held_cache_bytes = 0;
}

/* The push proper, with state_rw held shared. */
static int core_push_locked(core *c, const core_push_args *a, int *duplicate, char *err,
                            size_t errlen) {
  int rc = core__check_job(c, a->hash, err, errlen);
  if (rc != 0)
    return rc;
  if (a->step > c->version + 1 && c->ckpt_loaded)
    return core__behind(c, "push", a->step, err, errlen);
  if (a->step == 0 || a->step > c->version + 1)
    return status_fail(err, errlen, ZS_ESTEP,
                       "push for step %" PRIu64 " but shard %u expects step %" PRIu64, a->step,
                       c->shard_id, c->version + 1);
  if (a->rank >= c->W || a->micro >= c->M)
    return status_fail(err, errlen, ZS_ERANGE,
                       "rank %u / micro-batch %u out of range (world size %u, accumulation %u)",
                       a->rank, a->micro, c->W, c->M);
  piece_state *ps = NULL;
  if ((rc = core_find_piece(c, a->tensor, a->slice, &ps, err, errlen)) != 0)
    return rc;
  /* Every piece has at least one element, so an empty payload is never a
   * gradient: it is the trainer saying it has none (its dtype must still be
   * one of ours, since replicas forward it). */
  rc = a->nbytes > 0 ? core_check_payload(ps, (int)a->dtype, a->nbytes, a->data, err, errlen)
                     : dtype_check((int)a->dtype, err, errlen);
  if (rc != 0)
    return rc;
  if (a->step <= c->version && (rc = core__push_left(c, a->rank, a->step, err, errlen)) != 0)
    return rc;
  if (a->step <= c->version) {
    /* A step is applied only after every contribution arrived, so a push for
     * an applied step is a retry whose first copy got through (its answer was
     * lost): acknowledge it as a duplicate, as the design's idempotent push
     * promises, and add nothing. */
    atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->duplicate_pushes, 1, memory_order_relaxed);
    if (duplicate)
      *duplicate = 1;
    return 0;
  }

  /* Contribution order is (micro, rank), so the sum never depends on which
   * push arrives first: acc = (((0 + g0) + g1) + g2) + ... with each addition
   * rounded. Floating-point addition is not associative but it is
   * commutative, and 0 + x is x except that -0 becomes +0, so
   * (0 + g1) + g0 has the bits of (0 + g0) + g1 (NaN payloads aside, and a
   * non-finite step is skipped whatever its bits): contribution 1 is added
   * at once when it comes before 0, which spares every out-of-order arrival
   * a held copy when W * M = 2 and the first one otherwise. */
  uint32_t k = a->micro * c->W + a->rank;
  int completed = 0;
  pthread_mutex_lock(&ps->mu);
  if (bit_test(ps->received, k)) {
    pthread_mutex_unlock(&ps->mu);
    atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->duplicate_pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->bytes_in, a->nbytes, memory_order_relaxed);
    if (duplicate)
      *duplicate = 1;
    return 0;
  }
  if (c->elastic) {
    /* Kept, not added: the worker sums the step once its members are
     * decided (core_members.c). */
    rc = core__push_keep(c, ps, k, a->rank, a->dtype, a->data, a->nbytes, err, errlen);
    pthread_mutex_unlock(&ps->mu);
    if (rc == 0) {
      atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
      atomic_fetch_add_explicit(&c->bytes_in, a->nbytes, memory_order_relaxed);
    }
    return rc;
  }
  if (k == 1 && ps->next_k == 0) {
    /* Before 0, which it commutes with: added now, next_k stays. */
    piece_add(c, ps, a->dtype, a->data, a->nbytes);
    ps->one_before_zero = 1;
  } else if (k == ps->next_k) {
    /* In turn: added straight from the caller's buffer, no copy. */
    piece_add(c, ps, a->dtype, a->data, a->nbytes);
    ps->next_k++;
    if (ps->one_before_zero) {
      ps->one_before_zero = 0;
      ps->next_k++;
    }
    while (ps->nheld > 0 && ps->next_k < c->WM && ps->held[ps->next_k]) {
      held_contrib *h = ps->held[ps->next_k];
      piece_add(c, ps, h->dtype, h->data, h->nbytes);
      ps->held[ps->next_k] = NULL;
      atomic_fetch_sub_explicit(&c->held_bytes, h->nbytes, memory_order_relaxed);
      core__held_put(c, h);
      ps->nheld--;
      ps->next_k++;
    }
    if (ps->nheld == 0) {
      free(ps->held);
      ps->held = NULL;
    }
  } else {
    /* Early (k > next_k, since every k < next_k is marked received): one copy
     * of the payload, kept until its turn. */
    if (!ps->held) {
      ps->held = calloc(c->WM, sizeof *ps->held);
      if (!ps->held) {
        pthread_mutex_unlock(&ps->mu);
        return status_fail(err, errlen, ZS_ENOMEM, "out of memory holding an early push");
      }
    }
    held_contrib *h = core__held_get(c, a->nbytes);
    if (!h) {
      if (ps->nheld == 0) {
        free(ps->held);
        ps->held = NULL;
      }
      pthread_mutex_unlock(&ps->mu);
      return status_fail(err, errlen, ZS_ENOMEM, "out of memory holding an early push");
    }
    h->dtype = a->dtype;
    h->nbytes = a->nbytes;
    if (a->nbytes > 0)
      memcpy(h->data, a->data, a->nbytes);
    ps->held[k] = h;
    ps->nheld++;
    atomic_fetch_add_explicit(&c->held_bytes, a->nbytes, memory_order_relaxed);
  }
  bit_set(ps->received, k);
  trace_ev(TRACE_PUSH_IN, a->step, a->tensor, a->slice, a->rank);
  if (a->nbytes > 0)
    ps->has_grad = 1;
  atomic_fetch_add_explicit(&c->contributions, 1, memory_order_relaxed);
  completed = ps->next_k == c->WM;
  if (completed && c->pipelined) {
    /* The worker applies it once the step's Apply is in (core_worker.c). */
    trace_ev(TRACE_READY, a->step, a->tensor, a->slice, 0);
    pthread_mutex_lock(&c->mu);
    c->complete_pieces++;
    c->ready[c->nready++] = (uint32_t)(ps - c->pieces);
    if (c->apply_state == APPLY_QUEUED)
      pthread_cond_signal(&c->worker_cv);
    pthread_mutex_unlock(&c->mu);
  } else if (completed) {
    pthread_mutex_lock(&c->mu);
    if (++c->complete_pieces == c->npieces) {
      c->stats_phase = STATS_COMPUTING;
      pthread_cond_signal(&c->worker_cv);
    }
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&ps->mu);
  atomic_fetch_add_explicit(&c->pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&c->bytes_in, a->nbytes, memory_order_relaxed);
  return 0;
}

int core_push(core *c, const core_push_args *a, int *duplicate, char *err, size_t errlen) {
  if (duplicate)
    *duplicate = 0;
  if (!a) {
    atomic_fetch_add_explicit(&c->rejected, 1, memory_order_relaxed);
    return status_fail(err, errlen, ZS_EINVAL, "no push arguments given");
  }
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_push_locked(c, a, duplicate, err, errlen);
  pthread_rwlock_unlock(&c->state_rw);
  if (rc != 0)
    atomic_fetch_add_explicit(&c->rejected, 1, memory_order_relaxed);
  return rc;
}

/* ---------------------------------------------------------------- read */

/* Bytes per chunk of a read with a CRC: small enough that the chunk just
 * written is still in L1/L2 when the CRC reads it. */
#define CORE_READ_CHUNK (64u << 10)

int core_read_crc(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                  void *dst, size_t nbytes, uint64_t *version, uint32_t *crc, char *err,
                  size_t errlen) {
  piece_state *ps = NULL;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core_find_readable(c, hash, tensor, slice, dtype, nbytes, dst, &ps, err, errlen);
  if (rc == 0) {
    uint64_t off = ps->lp->arena_off, numel = ps->lp->numel;
    const dtype_codec *k = dtype_codec_of(dtype);
    /* fp32 and the stored low-precision copy are copies; another dtype is
     * converted from the master. */
    const unsigned char *copy_from =
        dtype == ZS_DTYPE_FP32         ? (const unsigned char *)(c->master + off)
        : dtype == c->spec.param_dtype ? (const unsigned char *)(c->low + off)
                                       : NULL;
    if (dtype == ZS_DTYPE_INT8_BLOCK) {
      /* The stored copy when it is this version's; otherwise (the job's
       * first int8 pulls, until the next apply makes the copy) the same
       * bytes quantized from the master here. */
      atomic_store_explicit(&c->q8_wanted, 1, memory_order_relaxed);
      if (ps->q8_fresh)
        copy_from = c->q8 + ps->q8_off;
    }
    /* Chunks of whole blocks of about CORE_READ_CHUNK bytes: each is an
     * array of its own, starting at byte dtype_bytes(e) (dtype.h). */
    uint64_t step = numel;
    if (crc) {
      step = CORE_READ_CHUNK / (k->block * k->elem_bytes + k->scale_bytes) * k->block;
      step = step ? step : k->block;
    }
    unsigned char *out = dst;
    if (dtype == ZS_DTYPE_INT8_BLOCK && ps->q8_fresh && crc && *crc == 0) {
      /* The stored CRC is this answer's when it starts one (a CRC run from
       * 0 over these bytes): one copy, no CRC pass. */
      memcpy(out, copy_from, nbytes);
      *crc = c->q8_crc[ps - c->pieces];
    } else {
      for (uint64_t e = 0; e < numel; e += step) {
        uint64_t cnt = numel - e < step ? numel - e : step;
        size_t b = (size_t)dtype_bytes(dtype, e), len = (size_t)dtype_bytes(dtype, cnt);
        if (copy_from)
          memcpy(out + b, copy_from + b, len);
        else
          dtype_from_f32(dtype, c->master + off + e, out + b, (size_t)cnt);
        if (crc)
          *crc = crc32c(*crc, out + b, len);
      }
    }
    /* A piece a pipelined step applied ahead of the others is at the
     * pending step's version already. */
    if (version)
      *version = c->version + (uint64_t)ps->ahead;
  }
  pthread_rwlock_unlock(&c->state_rw);
  /* Pulls are counted by the transport (core_count_pull), which knows the
   * bytes it really put on the wire. */
  return rc;
}

int core_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype, void *dst,
              size_t nbytes, uint64_t *version, char *err, size_t errlen) {
  return core_read_crc(c, hash, tensor, slice, dtype, dst, nbytes, version, NULL, err, errlen);
}

int64_t core_piece_bytes_err(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                             zs_dtype dtype, char *err, size_t errlen) {
  piece_state *ps = NULL;
  int64_t r;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core__check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc == 0 && !dtype_valid((int)dtype))
    rc = dtype_check((int)dtype, err, errlen);
  r = rc != 0 ? rc : (int64_t)dtype_bytes((int)dtype, ps->lp->numel);
  pthread_rwlock_unlock(&c->state_rw);
  return r;
}

int64_t core_piece_bytes(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_dtype dtype) {
  return core_piece_bytes_err(c, hash, tensor, slice, dtype, NULL, 0);
}

/* ---------------------------------------------------------------- contributions */

int core_check_acked(core *c, uint64_t hash, uint64_t step, uint32_t rank, char *err,
                     size_t errlen) {
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = core__check_job(c, hash, err, errlen);
  if (rc != 0 || step != c->version + 1 || rank >= c->W) {
    pthread_rwlock_unlock(&c->state_rw);
    return rc == 0 ? 0 : rc;
  }
  uint32_t lost_tensor = 0, lost_slice = 0, lost_micro = 0, lost = 0;
  for (uint32_t i = 0; i < c->npieces && !lost; i++) {
    piece_state *ps = &c->pieces[i];
    pthread_mutex_lock(&ps->mu);
    for (uint32_t m = 0; m < c->M; m++) {
      if (!bit_test(ps->received, m * c->W + rank)) {
        lost = 1;
        lost_tensor = ps->lp->tensor;
        lost_slice = ps->lp->slice;
        lost_micro = m;
        break;
      }
    }
    pthread_mutex_unlock(&ps->mu);
  }
  if (lost) {
    pthread_mutex_lock(&c->mu);
    int ready = c->stats_phase == STATS_READY;
    pthread_mutex_unlock(&c->mu);
    if (ready)
      lost = 0;
  }
  if (lost && c->ckpt_loaded)
    rc = status_fail(err, errlen, ZS_EBEHIND,
                     "rank %u's acknowledged contribution to step %" PRIu64
                     " (tensor %u slice %u micro %u) is gone: shard %u restarted or was restored "
                     "at checkpoint step %" PRIu64 " (version %" PRIu64
                     "); restore the job to a checkpoint (zs_restore, "
                     "zshard restore) to resume",
                     rank, step, lost_tensor, lost_slice, lost_micro, c->shard_id, c->ckpt_step,
                     c->version);
  else if (lost)
    rc = status_fail(err, errlen, ZS_EINTERNAL,
                     "rank %u's acknowledged contribution to step %" PRIu64
                     " (tensor %u slice %u micro %u) is missing on shard %u",
                     rank, step, lost_tensor, lost_slice, lost_micro, c->shard_id);
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

uint32_t core_missing(core *c, uint64_t step, core_missing_entry *out, uint32_t max) {
  uint64_t total = 0;
  pthread_rwlock_rdlock(&c->state_rw);
  if (!c->open || step != c->version + 1)
    goto done;
  for (uint32_t i = 0; i < c->npieces; i++) {
    piece_state *ps = &c->pieces[i];
    pthread_mutex_lock(&ps->mu);
    /* Every k below next_k has been received; the rest is read off the
     * bitmap. k ascending is (micro, rank) ascending. */
    for (uint32_t k = ps->next_k; k < c->WM; k++) {
      /* A rank left out of the job contributes nothing: not missing. */
      if (bit_test(ps->received, k) || (c->elastic && !core_members_has(&c->members, k % c->W)))
        continue;
      if (out && total < max)
        out[total] = (core_missing_entry){
            .rank = k % c->W, .micro = k / c->W, .tensor = ps->lp->tensor, .slice = ps->lp->slice};
      total++;
    }
    pthread_mutex_unlock(&ps->mu);
  }
done:
  pthread_rwlock_unlock(&c->state_rw);
  return total > UINT32_MAX ? UINT32_MAX : (uint32_t)total;
}

/* ---------------------------------------------------------------- optimizer state */

/* The checks of core_state_read and core_state_write; *arena gets the
 * array's first element of the range. With state_rw held. */
static int state_range(core *c, uint64_t hash, uint32_t tensor, uint32_t slice,
                       zs_state_array which, uint64_t offset, size_t nbytes, const void *buf,
                       float **arena, char *err, size_t errlen) {
  piece_state *ps = NULL;
  int rc = core__check_job(c, hash, err, errlen);
  if (rc == 0)
    rc = core_find_piece(c, tensor, slice, &ps, err, errlen);
  if (rc != 0)
    return rc;
  const layout_piece *lp = ps->lp;
  const spec_group *g = &c->spec.groups[c->spec.tensors[tensor].group];
  unsigned needs = optim_state_needs(g);
  float *base = NULL;
  if (which == ZS_STATE_MASTER)
    base = c->master;
  else if (which == ZS_STATE_EXP_AVG && (needs & OPTIM_STATE_M))
    base = c->m;
  else if (which == ZS_STATE_EXP_AVG_SQ && (needs & OPTIM_STATE_V))
    base = c->v;
  else if (which != ZS_STATE_EXP_AVG && which != ZS_STATE_EXP_AVG_SQ)
    return status_fail(err, errlen, ZS_EINVAL,
                       "state array %d is none of master (1), exp_avg (2) "
                       "and exp_avg_sq (3)",
                       (int)which);
  if (!base) {
    const spec_optim *o = spec_optim_of(g->optimizer);
    return status_fail(err, errlen, ZS_EINVAL, "tensor %u's param group %u (%s%s) keeps no %s",
                       tensor, c->spec.tensors[tensor].group, o ? o->title : "?",
                       g->optimizer == ZS_OPTIM_SGD && g->momentum == 0.0 ? " without momentum"
                                                                          : "",
                       zs_state_array_name((int)which));
  }
  if (nbytes % sizeof(float) != 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "%s of slice %u of tensor %u: %zu bytes are not a whole number of float32",
                       zs_state_array_name((int)which), slice, tensor, nbytes);
  uint64_t n = nbytes / sizeof(float);
  if (offset > lp->numel || n > lp->numel - offset)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%" PRIu64 " %s elements from element %" PRIu64 " of slice %u of tensor %u: "
                       "the piece has %" PRIu64 " elements",
                       n, zs_state_array_name((int)which), offset, slice, tensor, lp->numel);
  if (n > 0 && !buf)
    return status_fail(err, errlen, ZS_EINVAL, "state buffer pointer is NULL");
  if (!ps->initialized)
    return status_fail(err, errlen, ZS_ENOTREADY,
                       "slice %u of tensor %u has no initial weights yet on shard %u", slice,
                       tensor, c->shard_id);
  *arena = base + lp->arena_off + offset;
  return 0;
}

int core_state_read(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_state_array which,
                    uint64_t offset, float *dst, size_t nbytes, uint64_t *version,
                    uint64_t *optimizer_steps, char *err, size_t errlen) {
  float *from = NULL;
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = state_range(c, hash, tensor, slice, which, offset, nbytes, dst, &from, err, errlen);
  if (rc == 0) {
    if (nbytes > 0)
      memcpy(dst, from, nbytes);
    /* Both change only under state_rw exclusive (and mu), so the shared lock
     * is enough to read them with the data. */
    if (version)
      *version = c->version;
    if (optimizer_steps)
      *optimizer_steps = c->optimizer_steps;
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

/* A step is in progress when the pending step has received a contribution or
 * its apply is queued: a write then would change the state under a step that
 * trainers already computed against the old one. With state_rw exclusive (no
 * push runs, so the count is exact). */
static int state_write_idle(core *c, char *err, size_t errlen) {
  uint64_t have = atomic_load_explicit(&c->contributions, memory_order_relaxed);
  pthread_mutex_lock(&c->mu);
  int queued = c->apply_state != APPLY_NONE;
  uint64_t step = c->version + 1;
  pthread_mutex_unlock(&c->mu);
  if (have == 0 && !queued)
    return 0;
  return status_fail(err, errlen, ZS_ENOTREADY,
                     "step %" PRIu64 " is in progress on shard %u (%" PRIu64
                     " contributions received%s): optimizer state is written only between "
                     "steps, while every trainer holds the job idle; nothing was written",
                     step, c->shard_id, have, queued ? ", apply queued" : "");
}

int core_state_write(core *c, uint64_t hash, uint32_t tensor, uint32_t slice, zs_state_array which,
                     uint64_t offset, const float *src, size_t nbytes, const uint64_t *set_steps,
                     uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen) {
  float *to = NULL;
  pthread_rwlock_wrlock(&c->state_rw);
  int rc = 0;
  if (nbytes == 0 && set_steps)
    rc = core__check_job(c, hash, err, errlen);
  else
    rc = state_range(c, hash, tensor, slice, which, offset, nbytes, src, &to, err, errlen);
  if (rc == 0)
    rc = state_write_idle(c, err, errlen);
  if (rc != 0)
    goto done;
  if (nbytes > 0) {
    size_t n = nbytes / sizeof(float);
    if (which == ZS_STATE_MASTER) {
      /* Pulls served from the low arena must see the new weights at once. */
      piece_state *ps = NULL;
      core_find_piece(c, tensor, slice, &ps, NULL, 0);
      core__low_writable(c, "state write");
      memcpy(to, src, nbytes);
      dtype_from_f32(c->spec.param_dtype, to, c->low + ps->lp->arena_off + offset, n);
      core__low_crc_task(c, (size_t)(ps - c->pieces));
    } else {
      memcpy(to, src, nbytes);
    }
  }
  pthread_mutex_lock(&c->mu);
  if (set_steps) {
    c->optimizer_steps = *set_steps;
    for (uint32_t t = 0; t < c->spec.num_tensors; t++)
      c->tensor_steps[t] = *set_steps;
  }
  /* The state is no longer the checkpoint's it was restored from. */
  c->ckpt_untouched = 0;
  pthread_mutex_unlock(&c->mu);
done:
  if (rc == 0) {
    if (version)
      *version = c->version;
    if (optimizer_steps)
      *optimizer_steps = c->optimizer_steps;
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

/* The checks of core_tensor_steps and core_set_tensor_steps: the job, and a
 * tensor with a piece on this shard. With state_rw held. */
static int tensor_steps_check(core *c, uint64_t hash, uint32_t tensor, char *err, size_t errlen) {
  int rc = core__check_job(c, hash, err, errlen);
  if (rc != 0)
    return rc;
  if (tensor >= c->layout.num_tensors)
    return status_fail(err, errlen, ZS_ENOTFOUND, "no tensor %u (the model has %u)", tensor,
                       c->layout.num_tensors);
  uint32_t first = c->layout.tensor_first[tensor], end = c->layout.tensor_first[tensor + 1];
  for (uint32_t i = first; i < end; i++)
    if (c->local_of[i] != UINT32_MAX)
      return 0;
  return status_fail(err, errlen, ZS_ENOTFOUND, "shard %u holds no slice of tensor %u", c->shard_id,
                     tensor);
}

int core_tensor_steps(core *c, uint64_t hash, uint32_t tensor, uint64_t *steps, char *err,
                      size_t errlen) {
  pthread_rwlock_rdlock(&c->state_rw);
  int rc = tensor_steps_check(c, hash, tensor, err, errlen);
  if (rc == 0 && steps)
    *steps = c->tensor_steps[tensor];
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}

int core_set_tensor_steps(core *c, uint64_t hash, uint32_t tensor, uint64_t steps, char *err,
                          size_t errlen) {
  pthread_rwlock_wrlock(&c->state_rw);
  int rc = tensor_steps_check(c, hash, tensor, err, errlen);
  if (rc == 0)
    rc = state_write_idle(c, err, errlen);
  if (rc == 0) {
    pthread_mutex_lock(&c->mu);
    c->tensor_steps[tensor] = steps;
    c->ckpt_untouched = 0;
    pthread_mutex_unlock(&c->mu);
  }
  pthread_rwlock_unlock(&c->state_rw);
  return rc;
}
