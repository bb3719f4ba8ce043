/*
 * layout — the placement of every tensor element on a shard, and of every
 * piece in its shard's arenas (the rules are in layout.h).
 *
 * layout_build runs in three passes over the tensors, in time proportional to
 * the number of pieces times log N:
 *
 *  1. count the pieces, so that every array is allocated once;
 *  2. place them in tensor order, keeping the shards in a binary min-heap on
 *     (load, shard id), so that "the least-loaded shard, lowest id on ties" is
 *     the heap's top without a scan over all N shards per small tensor;
 *  3. lay out each shard's arena group-major: a stable counting sort of the
 *     pieces by group keeps tensor order within a group, and one cursor per
 *     shard hands out 16-aligned offsets and records the group ranges.
 *
 * All sizes are uint64 and every sum is checked: a validated spec cannot
 * overflow them (at most 2^20 tensors of 2^40 elements), but the checks make
 * that a property of this file rather than of the caller.
 */
#include "common/model/layout.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Shard heap                                                                */
/* ------------------------------------------------------------------------ */

/* heap[k] is a shard id; pos[shard] its index in heap. Ordered by (load, id),
 * so the top is the least-loaded shard with the lowest id among equals. */
typedef struct shard_heap {
  uint32_t *heap;
  uint32_t *pos;
  const uint64_t *load;
  uint32_t n;
} shard_heap;

static int heap_less(const shard_heap *h, uint32_t a, uint32_t b) {
  return h->load[a] < h->load[b] || (h->load[a] == h->load[b] && a < b);
}

/* Restores the heap below index k after the load of heap[k] grew; loads only
 * ever grow, so sifting down is the only repair needed. */
static void heap_sift_down(shard_heap *h, uint32_t k) {
  for (;;) {
    uint64_t l = 2 * (uint64_t)k + 1, r = l + 1, m = k;
    if (l < h->n && heap_less(h, h->heap[l], h->heap[m]))
      m = l;
    if (r < h->n && heap_less(h, h->heap[r], h->heap[m]))
      m = r;
    if (m == k)
      return;
    uint32_t a = h->heap[k], b = h->heap[m];
    h->heap[k] = b;
    h->heap[m] = a;
    h->pos[b] = k;
    h->pos[a] = (uint32_t)m;
    k = (uint32_t)m;
  }
}

static int cmp_desc(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* Rebuilds the whole heap bottom-up in O(N), cheaper than sifting each of
 * many changed shards separately. */
static void heap_rebuild(shard_heap *h) {
  for (uint32_t k = h->n / 2; k-- > 0;)
    heap_sift_down(h, k);
}

/* ------------------------------------------------------------------------ */
/* Build                                                                     */
/* ------------------------------------------------------------------------ */

static uint64_t round16(uint64_t x) {
  return (x + (LAYOUT_ALIGN_ELEMS - 1)) / LAYOUT_ALIGN_ELEMS * LAYOUT_ALIGN_ELEMS;
}

/* The slice length c of a split tensor: roundup(ceil(numel / N), 16). */
static uint64_t slice_len(uint64_t numel, uint32_t n) {
  return round16(numel / n + (numel % n != 0));
}

static uint64_t split_threshold(const spec *s) {
  return s->split_threshold ? s->split_threshold : SPEC_DEFAULT_SPLIT_THRESHOLD;
}

void layout_free(layout *l) {
  if (!l)
    return;
  free(l->pieces);
  free(l->tensor_first);
  free(l->shard_elems);
  free(l->shard_load);
  free(l->shard_pieces);
  free(l->ranges);
  free(l->range_first);
  memset(l, 0, sizeof *l);
}

/* Pass 1: the number of pieces `s` makes with split threshold `thr`. Returns
 * 0, ZS_EINVAL for a tensor that is empty or names no group, or ZS_ENOMEM
 * when the count does not fit the layout's 32-bit piece index. */
static int count_pieces(const spec *s, uint64_t thr, uint32_t *out) {
  const uint32_t N = s->num_shards;
  uint64_t num_pieces = 0;
  for (uint32_t t = 0; t < s->num_tensors; t++) {
    uint64_t numel = s->tensors[t].numel;
    if (numel == 0 || s->tensors[t].group >= s->num_groups)
      return ZS_EINVAL;
    if (numel < thr) {
      num_pieces++;
    } else {
      uint64_t c = slice_len(numel, N);
      num_pieces += numel / c + (numel % c != 0);
    }
  }
  if (num_pieces > UINT32_MAX)
    return ZS_ENOMEM;
  *out = (uint32_t)num_pieces;
  return 0;
}

/* layout_build's working arrays, freed when it returns. Some serve two
 * passes; the passes say where. */
typedef struct build_scratch {
  uint32_t *heap, *pos;  /* pass 2's shard heap; pass 3 borrows heap */
  uint32_t *order;       /* pass 3: piece indices, group-major */
  uint32_t *group_count; /* pass 3: the counting sort's G + 1 counters */
  uint32_t *last_group;  /* per shard; pass 2 borrows it as scratch */
} build_scratch;

static void scratch_free(build_scratch *sc) {
  free(sc->heap);
  free(sc->pos);
  free(sc->order);
  free(sc->group_count);
  free(sc->last_group);
}

/* Allocates every array of `out` but its ranges (their number is known only
 * in pass 3), and the scratch arrays. Returns 0 or ZS_ENOMEM; the caller
 * frees both either way. */
static int build_alloc(layout *out, build_scratch *sc) {
  const uint32_t N = out->num_shards, T = out->num_tensors, G = out->num_groups;
  const size_t np = out->num_pieces ? out->num_pieces : 1;
  out->pieces = calloc(np, sizeof *out->pieces);
  out->tensor_first = calloc((size_t)T + 1, sizeof *out->tensor_first);
  out->shard_elems = calloc(N, sizeof *out->shard_elems);
  out->shard_load = calloc(N, sizeof *out->shard_load);
  out->shard_pieces = calloc(N, sizeof *out->shard_pieces);
  out->range_first = calloc((size_t)N + 1, sizeof *out->range_first);
  sc->heap = malloc((size_t)N * sizeof *sc->heap);
  sc->pos = malloc((size_t)N * sizeof *sc->pos);
  sc->order = malloc(np * sizeof *sc->order);
  sc->group_count = calloc((size_t)G + 1, sizeof *sc->group_count);
  sc->last_group = malloc((size_t)N * sizeof *sc->last_group);
  if (!out->pieces || !out->tensor_first || !out->shard_elems || !out->shard_load ||
      !out->shard_pieces || !out->range_first || !sc->heap || !sc->pos || !sc->order ||
      !sc->group_count || !sc->last_group)
    return ZS_ENOMEM;
  return 0;
}

/* Pass 2: places the pieces in tensor order. Returns 0, or ZS_EINVAL when a
 * shard's load would overflow. */
static int place_pieces(const spec *s, uint64_t thr, layout *out, build_scratch *sc) {
  const uint32_t N = s->num_shards, T = s->num_tensors;
  uint32_t *heap = sc->heap, *pos = sc->pos;
  /* All loads start at 0, so the identity permutation is already a valid
   * heap. */
  shard_heap h = {heap, pos, out->shard_load, N};
  for (uint32_t i = 0; i < N; i++)
    heap[i] = pos[i] = i;
  uint32_t p = 0;
  for (uint32_t t = 0; t < T; t++) {
    const spec_tensor *st = &s->tensors[t];
    out->tensor_first[t] = p;
    if (st->numel < thr) {
      uint32_t shard = heap[0];
      out->pieces[p++] = (layout_piece){.tensor = t,
                                        .slice = 0,
                                        .shard = shard,
                                        .group = st->group,
                                        .offset = 0,
                                        .numel = st->numel};
      if (__builtin_add_overflow(out->shard_load[shard], st->numel, &out->shard_load[shard]))
        return ZS_EINVAL;
      heap_sift_down(&h, 0);
      continue;
    }
    uint64_t c = slice_len(st->numel, N);
    uint32_t k = (uint32_t)(st->numel / c + (st->numel % c != 0));
    for (uint32_t j = 0; j < k; j++) {
      uint64_t begin = (uint64_t)j * c;
      uint64_t len = st->numel - begin < c ? st->numel - begin : c;
      out->pieces[p++] = (layout_piece){
          .tensor = t, .slice = j, .shard = j, .group = st->group, .offset = begin, .numel = len};
      if (__builtin_add_overflow(out->shard_load[j], len, &out->shard_load[j]))
        return ZS_EINVAL;
    }
    /* k shards got heavier: repair the heap around each of them if they are
     * few, else rebuild it, whichever is less work (k log N against N). The
     * repairs go from the deepest heap position up: sifting a node down is
     * only correct when the subtrees below it are heaps already, and a heavier
     * node sifted first could otherwise sit above a subtree whose repair
     * later lifts a lighter shard past it. Sifting position q moves entries
     * within q's subtree only, so the positions still to do stay valid.
     * last_group[] serves as scratch here; pass 3 fills it afresh. */
    if ((uint64_t)k * 8 < N) {
      uint32_t *changed = sc->last_group;
      for (uint32_t j = 0; j < k; j++)
        changed[j] = pos[j];
      qsort(changed, k, sizeof *changed, cmp_desc);
      for (uint32_t j = 0; j < k; j++)
        heap_sift_down(&h, changed[j]);
    } else {
      heap_rebuild(&h);
    }
  }
  out->tensor_first[T] = p;
  return 0;
}

/* Pass 3: arena offsets, group-major. Returns 0, ZS_ENOMEM, or ZS_EINVAL
 * when a shard's arena would overflow. */
static int lay_out_arenas(layout *out, build_scratch *sc) {
  const uint32_t N = out->num_shards, G = out->num_groups;
  uint32_t *order = sc->order, *group_count = sc->group_count, *last_group = sc->last_group;
  /* order[] lists the pieces grouped by param group, each group in tensor
   * order (counting sort is stable). */
  for (uint32_t i = 0; i < out->num_pieces; i++)
    group_count[out->pieces[i].group + 1]++;
  for (uint32_t g = 0; g < G; g++)
    group_count[g + 1] += group_count[g];
  for (uint32_t i = 0; i < out->num_pieces; i++)
    order[group_count[out->pieces[i].group]++] = i;

  /* Count each shard's ranges (one per group with a piece there), then fill
   * them; the second walk repeats the first with the offsets written. */
  for (uint32_t i = 0; i < N; i++)
    last_group[i] = UINT32_MAX;
  for (uint32_t k = 0; k < out->num_pieces; k++) {
    const layout_piece *pc = &out->pieces[order[k]];
    if (last_group[pc->shard] != pc->group) {
      last_group[pc->shard] = pc->group;
      out->range_first[pc->shard + 1]++;
    }
  }
  for (uint32_t i = 0; i < N; i++)
    out->range_first[i + 1] += out->range_first[i];
  uint32_t num_ranges = out->range_first[N];
  out->ranges = calloc(num_ranges ? num_ranges : 1, sizeof *out->ranges);
  if (!out->ranges)
    return ZS_ENOMEM;

  /* last_group[i] now doubles as "shard i's open range is for this group";
   * next_range[i] is where its next range goes, borrowed from heap[]. */
  uint32_t *next_range = sc->heap;
  for (uint32_t i = 0; i < N; i++) {
    last_group[i] = UINT32_MAX;
    next_range[i] = out->range_first[i];
  }
  for (uint32_t k = 0; k < out->num_pieces; k++) {
    layout_piece *pc = &out->pieces[order[k]];
    uint32_t i = pc->shard;
    uint64_t *cursor = &out->shard_elems[i];
    if (last_group[i] != pc->group) {
      last_group[i] = pc->group;
      out->ranges[next_range[i]++] = (layout_range){.group = pc->group, .begin = *cursor};
    }
    pc->arena_off = *cursor;
    if (__builtin_add_overflow(*cursor, round16(pc->numel), cursor))
      return ZS_EINVAL;
    out->ranges[next_range[i] - 1].end = *cursor;
    out->shard_pieces[i]++;
  }
  return 0;
}

int layout_build(const spec *s, layout *out) {
  const uint32_t N = s->num_shards, T = s->num_tensors, G = s->num_groups;
  const uint64_t thr = split_threshold(s);

  memset(out, 0, sizeof *out);
  /* The rest of this file relies on these; spec_validate guarantees them, and
   * a spec that skipped it is refused rather than half laid out. */
  if (N == 0 || G == 0 || !s->tensors)
    return ZS_EINVAL;
  uint32_t num_pieces = 0;
  int rc = count_pieces(s, thr, &num_pieces);
  if (rc)
    return rc;

  out->num_shards = N;
  out->num_tensors = T;
  out->num_groups = G;
  out->num_pieces = num_pieces;
  build_scratch sc = {0};
  rc = build_alloc(out, &sc);
  if (rc == 0)
    rc = place_pieces(s, thr, out, &sc);
  if (rc == 0)
    rc = lay_out_arenas(out, &sc);
  scratch_free(&sc);
  if (rc)
    layout_free(out);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                   */
/* ------------------------------------------------------------------------ */

/* The slices of a tensor are numbered 0..k-1 without gaps and stored in that
 * order, so slice j is at tensor_first[t] + j. */
const layout_piece *layout_find(const layout *l, uint32_t tensor, uint32_t slice) {
  if (!l->tensor_first || tensor >= l->num_tensors)
    return NULL;
  uint32_t first = l->tensor_first[tensor];
  if (slice >= l->tensor_first[tensor + 1] - first)
    return NULL;
  return &l->pieces[first + slice];
}

uint32_t layout_tensor_pieces(const layout *l, uint32_t tensor) {
  if (!l->tensor_first || tensor >= l->num_tensors)
    return 0;
  return l->tensor_first[tensor + 1] - l->tensor_first[tensor];
}
