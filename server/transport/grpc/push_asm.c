/*
 * push_asm — reassembly of chunked Push payloads (see push_asm.h).
 *
 * The table is a list: payloads being reassembled at once are few (one per
 * trainer thread pushing a piece larger than a chunk), and each costs a chunk
 * of copying per lookup anyway. Copies: each chunk is copied once into the
 * payload's buffer; the caller then hands the whole buffer to the core.
 */
#include "server/transport/grpc/push_asm.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/clock.h"
#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"

/* A payload's chunks are tracked in one 64-bit mask. */
#define PUSH_ASM_MAX_CHUNKS 64u

typedef struct asm_entry asm_entry;
struct asm_entry {
  list_node node; /* in push_asm.entries */
  push_asm_key key;
  uint64_t total;
  uint64_t expires_ms;
  uint64_t have; /* bit i: chunk i arrived */
  uint8_t *buf;
};

struct push_asm {
  pthread_mutex_t mu;
  list_node entries;
  uint64_t held; /* sum of the entries' totals */
  uint64_t budget;
  uint64_t chunk;
  uint32_t ttl_ms;
};

int push_asm_new(uint64_t budget_bytes, uint32_t ttl_ms, uint64_t chunk_bytes, push_asm **out) {
  *out = NULL;
  push_asm *a = calloc(1, sizeof *a);
  if (!a)
    return ZS_ENOMEM;
  pthread_mutex_init(&a->mu, NULL);
  list_init(&a->entries);
  a->budget = budget_bytes;
  a->ttl_ms = ttl_ms;
  a->chunk = chunk_bytes ? chunk_bytes : 1;
  *out = a;
  return 0;
}

/* Unlinks e and frees it (not its buffer). */
static void entry_drop(asm_entry *e) {
  list_remove(&e->node);
  free(e);
}

static void entry_free(asm_entry *e) {
  free(e->buf);
  entry_drop(e);
}

void push_asm_free(push_asm *a) {
  if (!a)
    return;
  while (!list_empty(&a->entries))
    entry_free(container_of(a->entries.next, asm_entry, node));
  pthread_mutex_destroy(&a->mu);
  free(a);
}

static int key_eq(const push_asm_key *x, const push_asm_key *y) {
  return x->hash == y->hash && x->step == y->step && x->rank == y->rank && x->micro == y->micro &&
         x->tensor == y->tensor && x->slice == y->slice && x->dtype == y->dtype;
}

/* Drops the payloads whose time is up; their pushes are lost, and the clients
 * that sent them have long given up waiting. a->mu held. */
static void expire_locked(push_asm *a, uint64_t now) {
  for (list_node *n = a->entries.next, *next; n != &a->entries; n = next) {
    next = n->next; /* an expired entry is unlinked */
    asm_entry *e = container_of(n, asm_entry, node);
    if (e->expires_ms > now)
      continue;
    LOG_WARN("push_chunks_expired",
             "tensor=%" PRIu32 " slice=%" PRIu32 " step=%" PRIu64 " rank=%" PRIu32
             " bytes=%" PRIu64,
             e->key.tensor, e->key.slice, e->key.step, e->key.rank, e->total);
    a->held -= e->total;
    entry_free(e);
  }
}

/* The entry of `k`, made (within the budget) if there is none. a->mu held. */
static int find_or_make_locked(push_asm *a, const push_asm_key *k, uint64_t total, asm_entry **out,
                               char *err, size_t errlen) {
  for (list_node *n = a->entries.next; n != &a->entries; n = n->next) {
    asm_entry *e = container_of(n, asm_entry, node);
    if (key_eq(&e->key, k)) {
      if (e->total != total)
        return status_fail(err, errlen, ZS_EINVAL,
                           "chunk says the payload has %" PRIu64
                           " bytes, an earlier chunk said %" PRIu64,
                           total, e->total);
      *out = e;
      return 0;
    }
  }
  uint64_t now = clock_now_ms();
  expire_locked(a, now);
  if (total > a->budget || a->held > a->budget - total)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "chunked pushes being reassembled hold %" PRIu64 " bytes; %" PRIu64
                       " more would pass the server's limit of %" PRIu64 "; retry later",
                       a->held, total, a->budget);
  asm_entry *e = calloc(1, sizeof *e);
  if (e)
    e->buf = malloc((size_t)total);
  if (!e || !e->buf) {
    free(e);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory for a %" PRIu64 "-byte push", total);
  }
  e->key = *k;
  e->total = total;
  e->expires_ms = now + a->ttl_ms;
  list_push(&a->entries, &e->node);
  a->held += total;
  *out = e;
  return 0;
}

int push_asm_add(push_asm *a, const push_asm_key *k, uint64_t total, uint64_t offset,
                 const void *data, size_t len, void **done, char *err, size_t errlen) {
  *done = NULL;
  uint64_t nchunks = total / a->chunk + (total % a->chunk != 0);
  if (total == 0 || nchunks > PUSH_ASM_MAX_CHUNKS || total > SIZE_MAX)
    return status_fail(err, errlen, ZS_EINVAL,
                       "a chunked push carries 1 to %u chunks of %" PRIu64
                       " bytes, not a payload of %" PRIu64 " bytes",
                       PUSH_ASM_MAX_CHUNKS, a->chunk, total);
  uint64_t want = total - offset < a->chunk ? total - offset : a->chunk;
  if (offset >= total || offset % a->chunk != 0 || len != want)
    return status_fail(err, errlen, ZS_EINVAL,
                       "chunk at offset %" PRIu64 " of %zu bytes is not one of the %" PRIu64
                       "-byte chunks of a %" PRIu64 "-byte payload",
                       offset, len, a->chunk, total);
  pthread_mutex_lock(&a->mu);
  asm_entry *e = NULL;
  int rc = find_or_make_locked(a, k, total, &e, err, errlen);
  if (rc == 0) {
    /* The copy runs under the lock: chunks of one payload are few and come
     * one after the other, and the entry cannot be freed under us. */
    memcpy(e->buf + offset, data, len);
    e->have |= UINT64_C(1) << (offset / a->chunk);
    uint64_t all = nchunks == 64 ? UINT64_MAX : (UINT64_C(1) << nchunks) - 1;
    if (e->have == all) {
      a->held -= e->total;
      *done = e->buf;
      entry_drop(e);
    }
  }
  pthread_mutex_unlock(&a->mu);
  return rc;
}

uint64_t push_asm_held(push_asm *a) {
  pthread_mutex_lock(&a->mu);
  uint64_t h = a->held;
  pthread_mutex_unlock(&a->mu);
  return h;
}
