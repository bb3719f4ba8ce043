/*
 * test_layout — who owns which element (common/model/layout.h).
 *
 * check_layout() states every documented property of a layout and verifies it
 * against an independent re-computation (a linear scan for the least-loaded
 * shard rather than the heap layout.c uses); it runs on hand-made specs with
 * known answers and on hundreds of random ones.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/model/layout.h"
#include "common/model/spec.h"

/* ------------------------------------------------------------------------ */
/* Spec construction                                                         */
/* ------------------------------------------------------------------------ */

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint64_t rng64(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545f4914f6cdd1dull;
}

static uint64_t rng_below(uint64_t n) {
  return rng64() % n;
}

/* A valid spec of `num_tensors` tensors with the given sizes and groups
 * (groups may be NULL: all in group 0). */
static void make_spec(spec *s, uint32_t shards, uint64_t threshold, uint32_t num_groups,
                      uint32_t num_tensors, const uint64_t *numel, const uint32_t *group) {
  memset(s, 0, sizeof *s);
  s->job = strdup("layout-test");
  s->world_size = 2;
  s->grad_accum = 1;
  s->num_shards = shards;
  s->split_threshold = threshold;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  s->num_groups = num_groups;
  s->groups = calloc(num_groups, sizeof *s->groups);
  assert_non_null(s->groups);
  for (uint32_t g = 0; g < num_groups; g++)
    spec_group_defaults(&s->groups[g], ZS_OPTIM_ADAMW);
  s->num_tensors = num_tensors;
  s->tensors = calloc(num_tensors, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < num_tensors; t++) {
    char name[32];
    snprintf(name, sizeof name, "t%u", t);
    s->tensors[t].name = strdup(name);
    s->tensors[t].numel = numel[t];
    s->tensors[t].group = group ? group[t] : 0;
  }
  char err[256];
  int rc = spec_validate(s, err, sizeof err);
  if (rc)
    fail_msg("test spec rejected: %s", err);
}

/* ------------------------------------------------------------------------ */
/* The properties                                                            */
/* ------------------------------------------------------------------------ */

static uint64_t round16(uint64_t x) {
  return (x + 15) / 16 * 16;
}

static uint64_t ref_slice_len(uint64_t numel, uint32_t n) {
  return round16((numel + n - 1) / n);
}

/*
 * The balance bound. Let spread = max load - min load over the shards, and
 * follow it through the tensors in order:
 *
 *  - A small tensor of s elements goes to a least-loaded shard. If that shard
 *    becomes the most loaded, the new spread is at most (old min + s) - old
 *    min = s, since no load fell below the old min. Otherwise the max is
 *    unchanged and the min did not decrease. So spread' <= max(spread, s).
 *  - A split tensor adds to each shard between its smallest slice (0 for a
 *    shard with no slice) and its largest, c. So spread' <= spread + d where
 *    d = largest - smallest slice given to any shard.
 *
 * Hence, with B = 0 at the start, B = max(B, s) per small tensor and B += d
 * per split tensor, the final spread is at most B. The bound is tight for a
 * run of small tensors alone (spread <= the largest small tensor), and it
 * shows the imbalance splitting can leave: shard 0 always gets a full slice.
 */

/* Checks every documented property of `l` for `s`. */
static void check_layout(const spec *s, const layout *l) {
  const uint32_t N = s->num_shards, T = s->num_tensors, G = s->num_groups;
  const uint64_t thr = s->split_threshold;
  uint64_t *load = calloc(N, sizeof *load);
  uint32_t *npieces = calloc(N, sizeof *npieces);
  assert_non_null(load);
  assert_non_null(npieces);
  uint64_t bound = 0;

  assert_int_equal(l->num_shards, N);
  assert_int_equal(l->num_tensors, T);
  assert_int_equal(l->num_groups, G);
  assert_int_equal(l->tensor_first[0], 0);
  assert_int_equal(l->tensor_first[T], l->num_pieces);

  /* Ownership: each tensor's pieces cover [0, numel) contiguously and in
   * slice order, so every element is owned exactly once. */
  for (uint32_t t = 0; t < T; t++) {
    const spec_tensor *st = &s->tensors[t];
    uint32_t first = l->tensor_first[t], k = l->tensor_first[t + 1] - first;
    assert_true(l->tensor_first[t + 1] >= first);
    assert_int_equal(layout_tensor_pieces(l, t), k);
    uint64_t covered = 0;
    for (uint32_t j = 0; j < k; j++) {
      const layout_piece *p = &l->pieces[first + j];
      assert_int_equal(p->tensor, t);
      assert_int_equal(p->slice, j);
      assert_int_equal(p->group, st->group);
      assert_true(p->numel > 0);
      assert_true(p->shard < N);
      assert_int_equal(p->offset, covered);
      covered += p->numel;
      assert_ptr_equal(layout_find(l, t, j), p);
    }
    assert_int_equal(covered, st->numel);
    assert_null(layout_find(l, t, k));
    assert_null(layout_find(l, t, UINT32_MAX));

    if (st->numel >= thr) {
      /* Split: slice j of c elements on shard j, empty trailing slices
       * omitted. */
      uint64_t c = ref_slice_len(st->numel, N);
      assert_int_equal(k, (st->numel + c - 1) / c);
      assert_true(k <= N);
      uint64_t smallest = k < N ? 0 : st->numel - (uint64_t)(k - 1) * c;
      for (uint32_t j = 0; j < k; j++) {
        const layout_piece *p = &l->pieces[first + j];
        uint64_t want = st->numel - (uint64_t)j * c < c ? st->numel - (uint64_t)j * c : c;
        assert_int_equal(p->shard, j);
        assert_int_equal(p->offset, (uint64_t)j * c);
        assert_int_equal(p->numel, want);
        load[j] += p->numel;
        npieces[j]++;
      }
      bound += c - smallest;
    } else {
      /* Small: one piece on the least-loaded shard, lowest id on ties. */
      assert_int_equal(k, 1);
      uint32_t best = 0;
      for (uint32_t i = 1; i < N; i++)
        if (load[i] < load[best])
          best = i;
      if (l->pieces[first].shard != best)
        fail_msg("tensor %u (%llu elements) on shard %u, least loaded is %u", t,
                 (unsigned long long)st->numel, l->pieces[first].shard, best);
      load[best] += st->numel;
      npieces[best]++;
      if (st->numel > bound)
        bound = st->numel;
    }
  }
  assert_null(layout_find(l, T, 0));
  assert_null(layout_find(l, UINT32_MAX, 0));
  assert_int_equal(layout_tensor_pieces(l, T), 0);
  assert_int_equal(layout_tensor_pieces(l, UINT32_MAX), 0);

  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint32_t i = 0; i < N; i++) {
    assert_int_equal(l->shard_load[i], load[i]);
    assert_int_equal(l->shard_pieces[i], npieces[i]);
    lo = load[i] < lo ? load[i] : lo;
    hi = load[i] > hi ? load[i] : hi;
  }
  if (hi - lo > bound)
    fail_msg("load spread %llu exceeds the proven bound %llu", (unsigned long long)(hi - lo),
             (unsigned long long)bound);

  /* Arenas: walk each shard's pieces in the documented order (group-major,
   * tensor order within a group). They must sit back to back at 16-aligned
   * offsets from 0, and each group's run must be exactly its range. */
  assert_int_equal(l->range_first[0], 0);
  for (uint32_t i = 0; i < N; i++) {
    uint64_t cursor = 0;
    uint32_t r = l->range_first[i];
    assert_true(l->range_first[i + 1] >= r);
    for (uint32_t g = 0; g < G; g++) {
      uint64_t begin = cursor;
      int any = 0;
      for (uint32_t pi = 0; pi < l->num_pieces; pi++) {
        const layout_piece *p = &l->pieces[pi];
        if (p->shard != i || p->group != g)
          continue;
        any = 1;
        assert_int_equal(p->arena_off % LAYOUT_ALIGN_ELEMS, 0);
        if (p->arena_off != cursor)
          fail_msg("shard %u: piece (%u, %u) at %llu, expected %llu", i, p->tensor, p->slice,
                   (unsigned long long)p->arena_off, (unsigned long long)cursor);
        cursor = round16(p->arena_off + p->numel);
      }
      if (!any)
        continue;
      assert_true(r < l->range_first[i + 1]);
      assert_int_equal(l->ranges[r].group, g);
      assert_int_equal(l->ranges[r].begin, begin);
      assert_int_equal(l->ranges[r].end, cursor);
      r++;
    }
    assert_int_equal(r, l->range_first[i + 1]);
    assert_int_equal(l->shard_elems[i], cursor);
  }
  free(load);
  free(npieces);
}

/* Builds the layout of `s` twice, checks it and that both builds agree. */
static void build_and_check(const spec *s) {
  layout a, b;
  assert_int_equal(layout_build(s, &a), 0);
  check_layout(s, &a);
  assert_int_equal(layout_build(s, &b), 0);
  assert_int_equal(a.num_pieces, b.num_pieces);
  assert_memory_equal(a.pieces, b.pieces, a.num_pieces * sizeof *a.pieces);
  assert_memory_equal(a.tensor_first, b.tensor_first, (s->num_tensors + 1) * sizeof(uint32_t));
  assert_memory_equal(a.shard_elems, b.shard_elems, s->num_shards * sizeof(uint64_t));
  assert_memory_equal(a.range_first, b.range_first, (s->num_shards + 1) * sizeof(uint32_t));
  assert_memory_equal(a.ranges, b.ranges, a.range_first[s->num_shards] * sizeof *a.ranges);
  layout_free(&a);
  layout_free(&b);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */
/* ------------------------------------------------------------------------ */

static void large_tensor_is_split_into_n_aligned_slices(void **state) {
  (void)state;
  /* c = roundup(ceil(100000 / 3), 16) = roundup(33334, 16) = 33344. */
  const uint64_t numel[] = {100000};
  spec s;
  make_spec(&s, 3, 0, 1, 1, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(l.num_pieces, 3);
  const uint64_t want_off[] = {0, 33344, 66688}, want_len[] = {33344, 33344, 33312};
  for (uint32_t j = 0; j < 3; j++) {
    const layout_piece *p = layout_find(&l, 0, j);
    assert_non_null(p);
    assert_int_equal(p->shard, j);
    assert_int_equal(p->offset, want_off[j]);
    assert_int_equal(p->numel, want_len[j]);
    assert_int_equal(p->arena_off, 0);
  }
  assert_int_equal(l.shard_elems[2], 33312);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void empty_trailing_slices_are_not_pieces(void **state) {
  (void)state;
  /* 20 elements over 7 shards with threshold 1: c = 16, so slices 16 and 4
   * on shards 0 and 1, and nothing on shards 2..6. */
  const uint64_t numel[] = {20};
  spec s;
  make_spec(&s, 7, 1, 1, 1, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(l.num_pieces, 2);
  assert_int_equal(layout_tensor_pieces(&l, 0), 2);
  assert_int_equal(layout_find(&l, 0, 1)->numel, 4);
  assert_null(layout_find(&l, 0, 2));
  for (uint32_t i = 2; i < 7; i++) {
    assert_int_equal(l.shard_pieces[i], 0);
    assert_int_equal(l.shard_elems[i], 0);
    assert_int_equal(l.range_first[i + 1] - l.range_first[i], 0);
  }
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void tensor_at_the_threshold_is_split_and_below_it_is_whole(void **state) {
  (void)state;
  const uint64_t numel[] = {1000, 999};
  spec s;
  make_spec(&s, 4, 1000, 1, 2, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(layout_tensor_pieces(&l, 0), 4);
  assert_int_equal(layout_tensor_pieces(&l, 1), 1);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void small_tensors_go_to_least_loaded_shard_lowest_id_first(void **state) {
  (void)state;
  /* Loads after each tensor, 3 shards:
   *  t0 10 -> s0 [10,0,0]; t1 10 -> s1 [10,10,0]; t2 5 -> s2 [10,10,5];
   *  t3 5 -> s2 [10,10,10]; t4 1 -> s0 (tie, lowest id) [11,10,10];
   *  t5 30 -> s1 (tie with s2, lowest id) [11,40,10]; t6 2 -> s2. */
  const uint64_t numel[] = {10, 10, 5, 5, 1, 30, 2};
  const uint32_t want[] = {0, 1, 2, 2, 0, 1, 2};
  spec s;
  make_spec(&s, 3, 0, 1, 7, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  for (uint32_t t = 0; t < 7; t++)
    assert_int_equal(layout_find(&l, t, 0)->shard, want[t]);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void split_slices_count_towards_the_load_of_later_small_tensors(void **state) {
  (void)state;
  /* The split tensor of 128 (threshold 50, 2 shards, c = 64) gives both
   * shards 64; the small tensor of 10 then goes to shard 0 (tie), and the
   * next one to shard 1. Then one of 100 (c = 64: slices 64 and 36) leaves
   * shard 1 less loaded (110 vs 138), so the last small one goes there. */
  const uint64_t numel[] = {128, 10, 10, 100, 20};
  spec s;
  make_spec(&s, 2, 50, 1, 5, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(layout_find(&l, 1, 0)->shard, 0);
  assert_int_equal(layout_find(&l, 2, 0)->shard, 1);
  assert_int_equal(layout_find(&l, 3, 1)->numel, 36);
  assert_int_equal(layout_find(&l, 4, 0)->shard, 1);
  assert_int_equal(l.shard_load[0], 138);
  assert_int_equal(l.shard_load[1], 130);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void arena_is_group_major_with_16_aligned_pieces(void **state) {
  (void)state;
  /* One shard: tensors in groups 1, 0, 1, 0 land in the arena as t1, t3
   * (group 0), then t0, t2 (group 1), each padded to 16 elements. */
  const uint64_t numel[] = {5, 17, 16, 1};
  const uint32_t group[] = {1, 0, 1, 0};
  spec s;
  make_spec(&s, 1, 0, 3, 4, numel, group);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(layout_find(&l, 1, 0)->arena_off, 0);
  assert_int_equal(layout_find(&l, 3, 0)->arena_off, 32);
  assert_int_equal(layout_find(&l, 0, 0)->arena_off, 48);
  assert_int_equal(layout_find(&l, 2, 0)->arena_off, 64);
  assert_int_equal(l.shard_elems[0], 80);
  /* Group 2 has no tensors, so it has no range. */
  assert_int_equal(l.range_first[1], 2);
  assert_int_equal(l.ranges[0].group, 0);
  assert_int_equal(l.ranges[0].begin, 0);
  assert_int_equal(l.ranges[0].end, 48);
  assert_int_equal(l.ranges[1].group, 1);
  assert_int_equal(l.ranges[1].begin, 48);
  assert_int_equal(l.ranges[1].end, 80);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

/* Random specs: `iters` of them with 1..max_shards shards and tensors of up
 * to max_numel elements. */
static void check_random_specs(int iters, uint32_t max_shards, uint64_t max_numel) {
  for (int iter = 0; iter < iters; iter++) {
    uint32_t shards = 1 + (uint32_t)rng_below(max_shards);
    uint32_t groups = 1 + (uint32_t)rng_below(4);
    uint32_t tensors = 1 + (uint32_t)rng_below(60);
    static const uint64_t thresholds[] = {0, 1, 16, 100, 1000, 4096, 65536, 300001};
    uint64_t thr = rng_below(4) == 0 ? 1 + rng_below(max_numel) : thresholds[rng_below(8)];
    uint64_t numel[60];
    uint32_t group[60];
    for (uint32_t t = 0; t < tensors; t++) {
      /* Mostly small tensors (biases, norms) with some large ones, as in a
       * model, and sizes of every residue modulo 16. */
      switch (rng_below(4)) {
      case 0:
        numel[t] = 1 + rng_below(32);
        break;
      case 1:
        numel[t] = 1 + rng_below(max_numel < 5000 ? max_numel : 5000);
        break;
      default:
        numel[t] = 1 + rng_below(max_numel);
        break;
      }
      group[t] = (uint32_t)rng_below(groups);
    }
    spec s;
    make_spec(&s, shards, thr, groups, tensors, numel, group);
    build_and_check(&s);
    spec_free(&s);
  }
}

static void random_specs_satisfy_every_layout_property(void **state) {
  (void)state;
  rng_state = 0x853c49e6748fea9bull;
  check_random_specs(300, 7, 300000);
}

/* With many shards and small split tensors, a tensor often has far fewer
 * slices than there are shards, which takes the other of layout.c's two ways
 * of updating its heap of shard loads. */
static void random_specs_with_many_shards_satisfy_every_layout_property(void **state) {
  (void)state;
  rng_state = 99;
  check_random_specs(100, 300, 300000);
  check_random_specs(300, 300, 2000);
}

static void many_small_tensors_stay_within_the_largest_one_of_balance(void **state) {
  (void)state;
  enum { T = 2000 };
  uint64_t numel[T];
  rng_state = 7;
  uint64_t biggest = 0;
  for (uint32_t t = 0; t < T; t++) {
    numel[t] = 1 + rng_below(4096);
    biggest = numel[t] > biggest ? numel[t] : biggest;
  }
  spec s;
  make_spec(&s, 5, 0, 1, T, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint32_t i = 0; i < 5; i++) {
    lo = l.shard_load[i] < lo ? l.shard_load[i] : lo;
    hi = l.shard_load[i] > hi ? l.shard_load[i] : hi;
  }
  assert_true(hi - lo <= biggest);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void one_shard_owns_everything(void **state) {
  (void)state;
  const uint64_t numel[] = {70000, 3, 65536, 1};
  spec s;
  make_spec(&s, 1, 0, 1, 4, numel, NULL);
  layout l;
  assert_int_equal(layout_build(&s, &l), 0);
  assert_int_equal(l.num_pieces, 4);
  for (uint32_t t = 0; t < 4; t++)
    assert_int_equal(layout_find(&l, t, 0)->numel, numel[t]);
  check_layout(&s, &l);
  layout_free(&l);
  spec_free(&s);
}

static void maximum_shard_count_lays_out(void **state) {
  (void)state;
  const uint64_t numel[] = {SPEC_MAX_SHARDS * 16ull + 1, 5, 7};
  spec s;
  make_spec(&s, SPEC_MAX_SHARDS, 0, 1, 3, numel, NULL);
  build_and_check(&s);
  spec_free(&s);
}

static void layout_free_tolerates_a_zeroed_layout_and_repeats(void **state) {
  (void)state;
  layout l;
  memset(&l, 0, sizeof l);
  layout_free(&l);
  layout_free(&l);
  assert_null(layout_find(&l, 0, 0));
  assert_int_equal(layout_tensor_pieces(&l, 0), 0);
}

static void spec_that_skipped_validation_is_refused(void **state) {
  (void)state;
  const uint64_t numel[] = {10};
  spec s;
  make_spec(&s, 2, 0, 1, 1, numel, NULL);
  layout l;
  s.num_shards = 0;
  assert_int_equal(layout_build(&s, &l), ZS_EINVAL);
  assert_null(l.pieces);
  s.num_shards = 2;
  s.tensors[0].group = 5;
  assert_int_equal(layout_build(&s, &l), ZS_EINVAL);
  s.tensors[0].group = 0;
  s.tensors[0].numel = 0;
  assert_int_equal(layout_build(&s, &l), ZS_EINVAL);
  spec_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(large_tensor_is_split_into_n_aligned_slices),
      cmocka_unit_test(empty_trailing_slices_are_not_pieces),
      cmocka_unit_test(tensor_at_the_threshold_is_split_and_below_it_is_whole),
      cmocka_unit_test(small_tensors_go_to_least_loaded_shard_lowest_id_first),
      cmocka_unit_test(split_slices_count_towards_the_load_of_later_small_tensors),
      cmocka_unit_test(arena_is_group_major_with_16_aligned_pieces),
      cmocka_unit_test(random_specs_satisfy_every_layout_property),
      cmocka_unit_test(random_specs_with_many_shards_satisfy_every_layout_property),
      cmocka_unit_test(many_small_tensors_stay_within_the_largest_one_of_balance),
      cmocka_unit_test(one_shard_owns_everything),
      cmocka_unit_test(maximum_shard_count_lays_out),
      cmocka_unit_test(layout_free_tolerates_a_zeroed_layout_and_repeats),
      cmocka_unit_test(spec_that_skipped_validation_is_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
