/*
 * push_asm — reassembly of Push payloads that arrive in chunks (a gRPC Push
 * larger than the listener's receive limit; see PushRequest.offset and total
 * in zshard.proto).
 *
 * A payload is held in one buffer of its full size from its first chunk until
 * its last, keyed by the push's header (spec hash, step, rank, micro, tensor,
 * slice, dtype), so a retried chunk lands on the same bytes. What all
 * payloads being reassembled hold is bounded by a budget: a first chunk that
 * would exceed it is refused ZS_ELIMIT, after dropping payloads older than
 * their time to live (a client that sent some chunks and went away).
 *
 * Threads: every function may be called from any thread; one mutex guards the
 * table and is a leaf (nothing is called with it held).
 */
#ifndef ZSHARD_SERVER_PUSH_ASM_H
#define ZSHARD_SERVER_PUSH_ASM_H

#include <stddef.h>
#include <stdint.h>

#include "zshard/types.h"

typedef struct push_asm push_asm;

/* What identifies one payload. */
typedef struct push_asm_key {
  uint64_t hash, step;
  uint32_t rank, micro, tensor, slice;
  zs_dtype dtype;
} push_asm_key;

/* A table holding at most budget_bytes of payloads, each for at most ttl_ms
 * after its first chunk. Returns 0 or ZS_ENOMEM. *out is the caller's, freed
 * with push_asm_free. */
int push_asm_new(uint64_t budget_bytes, uint32_t ttl_ms, uint64_t chunk_bytes, push_asm **out);
void push_asm_free(push_asm *a);

/* Copies chunk [offset, offset + len) of the payload of `k`, whose whole
 * length is `total` (checked by the caller to be the piece's size). The chunk
 * must be chunk `offset / chunk_bytes`: offset a multiple of chunk_bytes below
 * total, len exactly chunk_bytes or the rest (ZS_EINVAL otherwise). Returns 0
 * with *done NULL while chunks are missing; 0 with *done the whole payload
 * (malloc'ed, `total` bytes, the caller's to free) when this chunk was the
 * last one missing; ZS_ELIMIT when a new payload does not fit the budget;
 * ZS_ENOMEM. A sentence goes to err. `data` is only read during the call. */
int push_asm_add(push_asm *a, const push_asm_key *k, uint64_t total, uint64_t offset,
                 const void *data, size_t len, void **done, char *err, size_t errlen);

/* Bytes the payloads being reassembled hold now. */
uint64_t push_asm_held(push_asm *a);

#endif
