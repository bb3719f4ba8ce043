/*
 * layout — who owns which element of which tensor. A pure function of the spec,
 * computed identically by every client and every shard:
 *
 *  - A tensor with numel >= split_threshold is split into N contiguous slices of
 *    c = roundup(ceil(numel / N), 16) elements; slice j is
 *    [j*c, min((j+1)*c, numel)) and lives on shard j. Empty trailing slices are
 *    not pieces at all.
 *  - A smaller tensor is one piece (slice 0), placed whole on the shard with the
 *    least load so far (load = elements assigned, in tensor order; ties: lowest
 *    shard id).
 *
 * Within a shard, pieces are laid out in its arenas group-major (all pieces of
 * param group 0 in tensor order, then group 1, ...) and each piece starts at a
 * multiple of 16 elements (64 bytes of fp32), so that one param group's state is
 * one contiguous, aligned range and the optimizer is one streaming pass over it.
 */
#ifndef ZSHARD_COMMON_LAYOUT_H
#define ZSHARD_COMMON_LAYOUT_H

#include <stdint.h>

#include "spec.h"

#define LAYOUT_ALIGN_ELEMS 16u
/* Initial weights may travel in parts (InitParams.offset): a part is a run of
 * whole chunks of this many elements (1 MiB of fp32), the last chunk of a
 * piece possibly shorter. Clients send one chunk per call so that neither end
 * holds more than a chunk per call in flight; the server tracks which chunks
 * it holds. Part of the protocol: changing it breaks older peers. */
#define LAYOUT_INIT_CHUNK_ELEMS 262144u

typedef struct layout_piece {
  uint32_t tensor;    /* index into spec.tensors */
  uint32_t slice;     /* 0 for a whole tensor */
  uint32_t shard;     /* owner */
  uint32_t group;     /* param group of the tensor */
  uint64_t offset;    /* first element of the piece within the tensor */
  uint64_t numel;     /* > 0 */
  uint64_t arena_off; /* first element within the owner's arenas, multiple of 16 */
} layout_piece;

/* A run of one param group inside one shard's arenas: [begin, end) elements. */
typedef struct layout_range {
  uint32_t group;
  uint64_t begin, end;
} layout_range;

typedef struct layout {
  uint32_t num_shards, num_tensors, num_groups;
  uint32_t num_pieces;
  layout_piece *pieces;   /* all pieces, sorted by (tensor, slice) */
  uint32_t *tensor_first; /* num_tensors + 1 entries: pieces of tensor t are
                             pieces[tensor_first[t] .. tensor_first[t+1]) */
  uint64_t *shard_elems;  /* per shard: arena length in elements (padded) */
  uint64_t *shard_load;   /* per shard: elements owned (unpadded) */
  uint32_t *shard_pieces; /* per shard: number of pieces owned */
  /* Per shard, the group ranges of its arena in order: ranges of shard i are
   * ranges[range_first[i] .. range_first[i+1]); groups with no piece on a shard
   * have no range there. */
  layout_range *ranges;
  uint32_t *range_first; /* num_shards + 1 entries */
} layout;

/* Computes the layout of a validated spec into `out` (freed with layout_free).
 * Returns 0, ZS_ENOMEM, or ZS_EINVAL for a spec spec_validate would refuse
 * (out is then empty). */
int layout_build(const spec *s, layout *out);

/* Frees what `l` owns and zeroes it; tolerates a zeroed layout. */
void layout_free(layout *l);

/* The piece (tensor, slice), or NULL when there is no such piece. */
const layout_piece *layout_find(const layout *l, uint32_t tensor, uint32_t slice);

/* Number of pieces of tensor t (0 if t is out of range). */
uint32_t layout_tensor_pieces(const layout *l, uint32_t tensor);

#endif
