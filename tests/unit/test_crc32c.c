/*
 * test_crc32c — CRC-32C (common/base/crc32c.h) and each of its implementations
 * (common/base/crc32c_impl.h), forced one at a time: the standard check values,
 * every length from 0 to 5000 at all 16 alignments against a bit-by-bit
 * reference, every block-size boundary of the fast paths, chaining
 * crc(a + b) == crc32c(crc32c(0, a), b) within and across paths, the
 * combination of two CRCs without the second one's bytes (crc32c_combine),
 * and the GF(2) arithmetic the fast paths' constants come from. A path this CPU cannot run
 * is reported as skipped; the table path always runs.
 *
 * `test_crc32c -v` also prints each path's throughput, in cache (64 KiB) and
 * out of cache (256 MiB). Nothing asserts on time.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "common/base/crc32c.h"
#include "common/base/crc32c_impl.h"
#include "common/base/tsan.h"

#define POLY 0x82f63b78u
#define MAXLEN 5000
#define NALIGN 16
/* Under ThreadSanitizer every byte a path loads is checked (about 20 times
 * slower, for a program with one thread), so the two length sweeps visit 4 of
 * the 16 alignments there: 0, 5, 10 and 15, still every residue modulo 4. */
#ifdef ZS_TSAN
#define ALIGN_STEP 5
#else
#define ALIGN_STEP 1
#endif

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rng64(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static void fill_random(uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(rng64() >> 24);
}

/* The raw CRC register (no inversions) after feeding n bytes into `reg`,
 * computed bit by bit from the polynomial's definition, independent of every
 * implementation under test. */
static uint32_t ref_update(uint32_t reg, const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    reg ^= p[i];
    for (int k = 0; k < 8; k++)
      reg = (reg >> 1) ^ (POLY & (0u - (reg & 1u)));
  }
  return reg;
}

/* The standard CRC-32C of p[0..n), continuing from a finished crc. */
static uint32_t ref_crc(uint32_t crc, const uint8_t *p, size_t n) {
  return ~ref_update(~crc, p, n);
}

/* ------------------------------------------------------------------------ */
/* The implementations under test                                            */
/* ------------------------------------------------------------------------ */

/* Each path forced through crc32c_with_path, plus the public crc32c() (which
 * dispatches on its own) as one more. */
#define NIMPL (CRC32C_PATH_COUNT + 1)
#define IMPL_PUBLIC CRC32C_PATH_COUNT

static const char *impl_name(int impl) {
  return impl == IMPL_PUBLIC ? "crc32c()" : crc32c_path_name((crc32c_path)impl);
}

static int impl_runs(int impl) {
  return impl == IMPL_PUBLIC || crc32c_path_supported((crc32c_path)impl);
}

static uint32_t impl_crc(int impl, uint32_t crc, const void *buf, size_t len) {
  if (impl == IMPL_PUBLIC)
    return crc32c(crc, buf, len);
  return crc32c_with_path((crc32c_path)impl, crc, buf, len);
}

/* Says once per process which paths this CPU lets the tests reach, so a
 * green run on a machine without AVX-512 is not mistaken for coverage. */
static int setup_report_paths(void **state) {
  (void)state;
  for (int p = 0; p < CRC32C_PATH_COUNT; p++)
    if (!crc32c_path_supported((crc32c_path)p))
      print_message("[ SKIPPED  ] path %s: not supported by this CPU or ZSHARD_ISA\n",
                    crc32c_path_name((crc32c_path)p));
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Known values                                                              */
/* ------------------------------------------------------------------------ */

static void check_value_of_123456789_is_e3069283_on_every_path(void **state) {
  (void)state;
  assert_int_equal(crc32c_sw(0, "123456789", 9), 0xE3069283u);
  for (int impl = 0; impl < NIMPL; impl++)
    if (impl_runs(impl))
      assert_int_equal(impl_crc(impl, 0, "123456789", 9), 0xE3069283u);
}

static void empty_input_leaves_the_crc_unchanged_on_every_path(void **state) {
  (void)state;
  for (int impl = 0; impl < NIMPL; impl++) {
    if (!impl_runs(impl))
      continue;
    assert_int_equal(impl_crc(impl, 0, NULL, 0), 0);
    assert_int_equal(impl_crc(impl, 0xdeadbeefu, NULL, 0), 0xdeadbeefu);
    assert_int_equal(impl_crc(impl, 0xdeadbeefu, "x", 0), 0xdeadbeefu);
  }
}

static void known_vectors_from_rfc3720_match_on_every_path(void **state) {
  (void)state;
  /* iSCSI (RFC 3720, B.4): 32 bytes of zeros, of 0xff, and 0..31. */
  uint8_t zeros[32], ones[32], count[32];
  memset(zeros, 0, sizeof zeros);
  memset(ones, 0xff, sizeof ones);
  for (int i = 0; i < 32; i++)
    count[i] = (uint8_t)i;
  for (int impl = 0; impl < NIMPL; impl++) {
    if (!impl_runs(impl))
      continue;
    assert_int_equal(impl_crc(impl, 0, zeros, 32), 0x8A9136AAu);
    assert_int_equal(impl_crc(impl, 0, ones, 32), 0x62A8AB43u);
    assert_int_equal(impl_crc(impl, 0, count, 32), 0x46DD794Eu);
  }
}

/* ------------------------------------------------------------------------ */
/* Every length, alignment and boundary                                      */
/* ------------------------------------------------------------------------ */

/* Checks impl on buf + off for every length in [from, to] against the
 * reference, which is extended one byte at a time so its cost stays linear. */
static void check_length_range(const uint8_t *buf, size_t off, size_t from, size_t to,
                               uint32_t seed) {
  uint32_t reg = ref_update(~seed, buf + off, from);
  for (size_t len = from; len <= to; len++) {
    uint32_t want = ~reg;
    for (int impl = 0; impl < NIMPL; impl++) {
      if (!impl_runs(impl))
        continue;
      uint32_t got = impl_crc(impl, seed, buf + off, len);
      if (got != want)
        fail_msg("%s: seed 0x%08x off %zu len %zu: 0x%08x, reference 0x%08x", impl_name(impl), seed,
                 off, len, got, want);
    }
    if (len < to)
      reg = ref_update(reg, buf + off + len, 1);
  }
}

static void every_path_matches_the_reference_for_lengths_0_to_5000_at_16_alignments(void **state) {
  (void)state;
  uint8_t *buf = malloc(MAXLEN + NALIGN);
  assert_non_null(buf);
  fill_random(buf, MAXLEN + NALIGN);
  for (size_t off = 0; off < NALIGN; off += ALIGN_STEP)
    check_length_range(buf, off, 0, MAXLEN, 0);
  free(buf);
}

static void every_path_matches_the_reference_from_a_nonzero_starting_crc(void **state) {
  (void)state;
  uint8_t *buf = malloc(MAXLEN + NALIGN);
  assert_non_null(buf);
  fill_random(buf, MAXLEN + NALIGN);
  check_length_range(buf, 0, 0, MAXLEN, 0xffffffffu);
  check_length_range(buf, 7, 0, MAXLEN, 0x12345678u);
  free(buf);
}

/* Lengths where a path changes how it splits the buffer: every multiple and
 * combination of the three-chain steps, the folding step and its prefetch
 * distance, and the 64- and 16-byte tails after folding. */
static size_t boundary_lengths(size_t *out, size_t cap) {
  const size_t b[CRC32C_CLMUL_BLOCKS] = {CRC32C_CLMUL_BLOCK_0, CRC32C_CLMUL_BLOCK_1,
                                         CRC32C_CLMUL_BLOCK_2, CRC32C_CLMUL_BLOCK_3};
  size_t n = 0;
#define ADD(x)                                                                                     \
  do {                                                                                             \
    if (n < cap)                                                                                   \
      out[n++] = (x);                                                                              \
  } while (0)
  size_t all_steps = 0;
  for (int t = 0; t < CRC32C_CLMUL_BLOCKS; t++) {
    for (size_t k = 1; k <= 4; k++)
      ADD(k * 3 * b[t]);
    all_steps += 3 * b[t];
    ADD(all_steps); /* one step of each size down to this one */
  }
  ADD(2 * 3 * CRC32C_CLMUL_BLOCK_0 + 3 * (3 * CRC32C_CLMUL_BLOCK_1)); /* the most steps */
  ADD(CRC32C_AVX512_MIN);
  for (size_t k = 1; k <= 12; k++)
    ADD(k * CRC32C_AVX512_STEP);
  /* The prefetching loop runs while 2 KiB more than a step remain. */
  ADD(2 * CRC32C_AVX512_STEP + 2048);
  ADD(3 * CRC32C_AVX512_STEP + 2048);
  ADD(CRC32C_AVX512_STEP + 3 * 64 + 3 * 16); /* longest tail after folding */
  ADD(9 * CRC32C_AVX512_STEP + 3 * 64 + 15); /* and with every remainder */
  ADD(65536);
#undef ADD
  return n;
}

static void every_path_matches_the_reference_around_every_block_boundary(void **state) {
  (void)state;
  size_t lens[64];
  size_t n = boundary_lengths(lens, 64);
  size_t maxlen = 0;
  for (size_t i = 0; i < n; i++)
    maxlen = lens[i] > maxlen ? lens[i] : maxlen;
  uint8_t *buf = malloc(maxlen + 20 + NALIGN);
  assert_non_null(buf);
  fill_random(buf, maxlen + 20 + NALIGN);
  for (size_t i = 0; i < n; i++)
    for (size_t off = 0; off < NALIGN; off += ALIGN_STEP)
      check_length_range(buf, off, lens[i] < 17 ? 0 : lens[i] - 17, lens[i] + 17, 0x5eed0000u);
  free(buf);
}

static void every_path_matches_the_reference_on_uniform_data(void **state) {
  (void)state;
  /* All-zero and all-one buffers make every folded product the same, which
   * random data would not; a wrong constant shows up on both kinds. */
  enum { N = 20000 };
  uint8_t *buf = malloc(N);
  assert_non_null(buf);
  const uint8_t fills[] = {0x00, 0xff, 0x80};
  for (size_t f = 0; f < sizeof fills; f++) {
    memset(buf, fills[f], N);
    uint32_t reg = ~0u;
    size_t done = 0;
    for (size_t len = 0; len <= N; len += 61) {
      reg = ref_update(reg, buf + done, len - done);
      done = len;
      for (int impl = 0; impl < NIMPL; impl++)
        if (impl_runs(impl) && impl_crc(impl, 0, buf, len) != ~reg)
          fail_msg("%s: fill 0x%02x len %zu", impl_name(impl), fills[f], len);
    }
  }
  free(buf);
}

static void every_path_matches_the_reference_on_a_one_megabyte_buffer(void **state) {
  (void)state;
  enum { N = (1 << 20) + 13 };
  uint8_t *buf = malloc(N);
  assert_non_null(buf);
  fill_random(buf, N);
  uint32_t want = ref_crc(0, buf, N);
  for (int impl = 0; impl < NIMPL; impl++)
    if (impl_runs(impl)) {
      assert_int_equal(impl_crc(impl, 0, buf, N), want);
      assert_int_equal(impl_crc(impl, 0, buf + 5, N - 5), ref_crc(0, buf + 5, N - 5));
    }
  free(buf);
}

/* ------------------------------------------------------------------------ */
/* Chaining                                                                  */
/* ------------------------------------------------------------------------ */

static void crc_of_a_then_b_equals_crc_of_the_concatenation_on_every_path(void **state) {
  (void)state;
  enum { N = 3 * CRC32C_CLMUL_BLOCK_0 + 3000 };
  uint8_t *buf = malloc(N);
  assert_non_null(buf);
  fill_random(buf, N);
  const size_t lens[] = {0, 1, 17, 191, 192, 300, 1000, 3072, 5000, N};
  for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
    size_t len = lens[li];
    uint32_t whole = ref_crc(0, buf, len);
    /* Every split for short buffers, a spread of them and the very end for
     * long ones. */
    size_t stride = len <= 320 ? 1 : len / 97 + 1;
    for (size_t i = 0; i <= len / stride + 1; i++) {
      size_t split = i * stride < len ? i * stride : len;
      for (int a = 0; a < NIMPL; a++) {
        if (!impl_runs(a))
          continue;
        uint32_t head = impl_crc(a, 0, buf, split);
        for (int b = 0; b < NIMPL; b++) {
          if (!impl_runs(b))
            continue;
          uint32_t got = impl_crc(b, head, buf + split, len - split);
          if (got != whole)
            fail_msg("len %zu split %zu: %s then %s gave 0x%08x, whole 0x%08x", len, split,
                     impl_name(a), impl_name(b), got, whole);
        }
      }
    }
  }
  free(buf);
}

/* A length for the combination tests: 0, 1 and small odd ones often, up to
 * `max` otherwise. */
static size_t random_length(size_t max) {
  switch (rng64() % 5) {
  case 0:
    return (size_t)(rng64() % 3); /* 0, 1 or 2 */
  case 1:
    return (size_t)(rng64() % 64) | 1u;
  default:
    return (size_t)(rng64() % (max + 1));
  }
}

static void combining_two_crcs_gives_the_crc_of_the_concatenation(void **state) {
  (void)state;
  enum { MAX = 3u << 20 }; /* past every block size, odd sizes included */
  uint8_t *buf = malloc(2 * MAX);
  assert_non_null(buf);
  const uint64_t seeds[] = {1, 0x9e3779b97f4a7c15ull, 0xdeadbeefcafef00dull, 42};
  for (size_t si = 0; si < sizeof seeds / sizeof *seeds; si++) {
    rng_state = seeds[si];
    fill_random(buf, 2 * MAX);
    for (int i = 0; i < 60; i++) {
      size_t la = random_length(MAX), lb = random_length(MAX);
      const uint8_t *a = buf + rng64() % (MAX - la + 1), *b = a + la;
      uint32_t want = crc32c(0, a, la + lb);
      uint32_t got = crc32c_combine(crc32c(0, a, la), crc32c(0, b, lb), lb);
      if (got != want)
        fail_msg("seed 0x%llx: |A| %zu |B| %zu gave 0x%08x, crc of A||B 0x%08x",
                 (unsigned long long)seeds[si], la, lb, got, want);
    }
  }
  /* Short ones against the bit-by-bit reference rather than crc32c(). */
  for (size_t la = 0; la < 40; la++)
    for (size_t lb = 0; lb < 40; lb++)
      assert_int_equal(crc32c_combine(ref_crc(0, buf, la), ref_crc(0, buf + la, lb), lb),
                       ref_crc(0, buf, la + lb));
  free(buf);
}

static void combining_piece_by_piece_gives_the_crc_of_the_whole_answer(void **state) {
  (void)state;
  /* As the server builds a batch answer: from 0, one piece's stored CRC and
   * length at a time. */
  enum { MAXP = 256, PIECE = 40000 };
  uint8_t *buf = malloc((size_t)MAXP * PIECE);
  assert_non_null(buf);
  rng_state = 0x5eedull;
  fill_random(buf, (size_t)MAXP * PIECE);
  for (int round = 0; round < 20; round++) {
    size_t n = 1 + (size_t)(rng64() % MAXP), off = 0;
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) {
      size_t len = random_length(PIECE);
      acc = crc32c_combine(acc, crc32c(0, buf + off, len), len);
      off += len;
    }
    assert_int_equal(acc, crc32c(0, buf, off));
  }
  free(buf);
}

static void combining_is_associative_for_lengths_beyond_memory(void **state) {
  (void)state;
  /* (A || B) || C == A || (B || C) for lengths no buffer could hold, up to
   * the top bit of size_t: the shift table is right at every bit. */
  rng_state = 0xc0ffeeull;
  for (int i = 0; i < 2000; i++) {
    uint32_t a = (uint32_t)rng64(), b = (uint32_t)rng64(), c = (uint32_t)rng64();
    size_t lb = (size_t)(rng64() >> (rng64() % 64)) >> 1,
           lc = (size_t)(rng64() >> (rng64() % 64)) >> 1;
    assert_int_equal(crc32c_combine(crc32c_combine(a, b, lb), c, lc),
                     crc32c_combine(a, crc32c_combine(b, c, lc), lb + lc));
  }
  /* Nothing before B: the combination is B's own CRC. */
  for (int i = 0; i < 100; i++) {
    uint32_t b = (uint32_t)rng64();
    assert_int_equal(crc32c_combine(0, b, (size_t)rng64()), b);
  }
}

static void a_single_flipped_bit_changes_the_crc_on_every_path(void **state) {
  (void)state;
  /* 1000 bytes: long enough to go through the folding and three-chain code,
   * not just the single chain. */
  enum { N = 1000 };
  uint8_t *buf = malloc(N);
  assert_non_null(buf);
  fill_random(buf, N);
  for (int impl = 0; impl < NIMPL; impl++) {
    if (!impl_runs(impl))
      continue;
    uint32_t base = impl_crc(impl, 0, buf, N);
    for (size_t bit = 0; bit < 8 * N; bit += 3) {
      buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
      if (impl_crc(impl, 0, buf, N) == base)
        fail_msg("%s: flipping bit %zu left the crc 0x%08x", impl_name(impl), bit, base);
      buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
  }
  free(buf);
}

/* ------------------------------------------------------------------------ */
/* Path selection                                                            */
/* ------------------------------------------------------------------------ */

static void the_public_function_uses_the_fastest_supported_path(void **state) {
  (void)state;
  crc32c_path chosen = crc32c_path_chosen();
  assert_true(crc32c_path_supported(chosen));
  for (int p = chosen + 1; p < CRC32C_PATH_COUNT; p++)
    assert_false(crc32c_path_supported((crc32c_path)p));
  assert_true(crc32c_path_supported(CRC32C_PATH_TABLE));
}

static void an_unsupported_or_unknown_path_falls_back_to_the_table(void **state) {
  (void)state;
  uint8_t buf[600];
  fill_random(buf, sizeof buf);
  uint32_t want = ref_crc(0, buf, sizeof buf);
  assert_false(crc32c_path_supported((crc32c_path)CRC32C_PATH_COUNT));
  assert_false(crc32c_path_supported((crc32c_path)(CRC32C_PATH_COUNT + 3)));
  assert_int_equal(crc32c_with_path((crc32c_path)CRC32C_PATH_COUNT, 0, buf, sizeof buf), want);
  assert_int_equal(crc32c_with_path((crc32c_path)(CRC32C_PATH_COUNT + 3), 0, buf, sizeof buf),
                   want);
  assert_string_equal(crc32c_path_name((crc32c_path)CRC32C_PATH_COUNT), "?");
}

static void path_names_are_distinct(void **state) {
  (void)state;
  for (int a = 0; a < CRC32C_PATH_COUNT; a++)
    for (int b = a + 1; b < CRC32C_PATH_COUNT; b++)
      assert_string_not_equal(crc32c_path_name((crc32c_path)a), crc32c_path_name((crc32c_path)b));
}

/* ------------------------------------------------------------------------ */
/* GF(2) arithmetic                                                          */
/* ------------------------------------------------------------------------ */

static void xpow_agrees_with_multiplying_by_x_one_step_at_a_time(void **state) {
  (void)state;
  uint32_t r = 0x80000000u; /* 1 */
  for (uint64_t e = 0; e <= 70000; e++) {
    if (crc32c_gf2_xpow(e) != r)
      fail_msg("x^%llu: 0x%08x, stepwise 0x%08x", (unsigned long long)e, crc32c_gf2_xpow(e), r);
    r = (r >> 1) ^ (POLY & (0u - (r & 1u)));
  }
}

static void xpow_of_a_sum_is_the_product_of_the_powers(void **state) {
  (void)state;
  for (int i = 0; i < 2000; i++) {
    uint64_t a = rng64() >> 20, b = rng64() >> 20;
    assert_int_equal(crc32c_gf2_xpow(a + b),
                     crc32c_gf2_mul(crc32c_gf2_xpow(a), crc32c_gf2_xpow(b)));
  }
  /* Multiplication is commutative and 1 is its unit. */
  for (int i = 0; i < 2000; i++) {
    uint32_t a = (uint32_t)rng64(), b = (uint32_t)rng64();
    assert_int_equal(crc32c_gf2_mul(a, b), crc32c_gf2_mul(b, a));
    assert_int_equal(crc32c_gf2_mul(a, 0x80000000u), a);
  }
}

static void multiplying_by_x_to_the_8n_equals_feeding_n_zero_bytes(void **state) {
  (void)state;
  /* This is the identity every combination constant rests on: the register
   * after n zero bytes is the register times x^(8n). */
  uint8_t zeros[5000];
  memset(zeros, 0, sizeof zeros);
  for (int i = 0; i < 200; i++) {
    uint32_t reg = (uint32_t)rng64();
    size_t n = (size_t)(rng64() % sizeof zeros);
    assert_int_equal(crc32c_gf2_mul(reg, crc32c_gf2_xpow(8 * (uint64_t)n)),
                     ref_update(reg, zeros, n));
  }
}

/* ------------------------------------------------------------------------ */
/* Throughput (-v)                                                           */
/* ------------------------------------------------------------------------ */

/* Thread CPU time, so time the shared machine gives to other processes is
 * not counted against a path. */
static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Best of several runs of about 20 ms each; returns GB/s. */
static double throughput(int impl, const uint8_t *buf, size_t len, uint32_t *sink) {
  size_t iters = (size_t)(200e6 / (double)len) + 1;
  if (impl == CRC32C_PATH_TABLE)
    iters = iters / 8 + 1;
  int runs = len > (1u << 24) ? 3 : 9;
  double best = 1e30;
  for (int r = 0; r < runs; r++) {
    double t0 = cpu_seconds();
    for (size_t i = 0; i < iters; i++)
      *sink = impl_crc(impl, *sink, buf, len);
    double t = cpu_seconds() - t0;
    best = t < best ? t : best;
  }
  return (double)len * (double)iters / (best > 0 ? best : 1e-9) / 1e9;
}

static void print_throughput(void) {
  const size_t sizes[] = {16, 64, 256, 1500, 4096, 65536, (size_t)256 << 20};
  const size_t big = sizes[sizeof sizes / sizeof *sizes - 1];
  uint8_t *buf = malloc(big);
  if (!buf) {
    printf("throughput: no memory for %zu bytes\n", big);
    return;
  }
  fill_random(buf, big);
  uint32_t sink = 0;
  printf("throughput in GB/s (thread CPU time, best of several runs; chosen path: %s)\n",
         crc32c_path_name(crc32c_path_chosen()));
  printf("%-9s", "path");
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
    printf(" %10zu", sizes[s]);
  printf("\n");
  for (int impl = 0; impl < NIMPL; impl++) {
    if (!impl_runs(impl))
      continue;
    printf("%-9s", impl_name(impl));
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
      printf(" %10.2f", throughput(impl, buf, sizes[s], &sink));
      fflush(stdout);
    }
    printf("\n");
  }
  printf("(checksum of the runs: 0x%08x)\n", sink);
  free(buf);
}

int main(int argc, char **argv) {
  int verbose = 0;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0)
      verbose = 1;

  const struct CMUnitTest tests[] = {
      cmocka_unit_test(check_value_of_123456789_is_e3069283_on_every_path),
      cmocka_unit_test(empty_input_leaves_the_crc_unchanged_on_every_path),
      cmocka_unit_test(known_vectors_from_rfc3720_match_on_every_path),
      cmocka_unit_test(every_path_matches_the_reference_for_lengths_0_to_5000_at_16_alignments),
      cmocka_unit_test(every_path_matches_the_reference_from_a_nonzero_starting_crc),
      cmocka_unit_test(every_path_matches_the_reference_around_every_block_boundary),
      cmocka_unit_test(every_path_matches_the_reference_on_uniform_data),
      cmocka_unit_test(every_path_matches_the_reference_on_a_one_megabyte_buffer),
      cmocka_unit_test(crc_of_a_then_b_equals_crc_of_the_concatenation_on_every_path),
      cmocka_unit_test(combining_two_crcs_gives_the_crc_of_the_concatenation),
      cmocka_unit_test(combining_piece_by_piece_gives_the_crc_of_the_whole_answer),
      cmocka_unit_test(combining_is_associative_for_lengths_beyond_memory),
      cmocka_unit_test(a_single_flipped_bit_changes_the_crc_on_every_path),
      cmocka_unit_test(the_public_function_uses_the_fastest_supported_path),
      cmocka_unit_test(an_unsupported_or_unknown_path_falls_back_to_the_table),
      cmocka_unit_test(path_names_are_distinct),
      cmocka_unit_test(xpow_agrees_with_multiplying_by_x_one_step_at_a_time),
      cmocka_unit_test(xpow_of_a_sum_is_the_product_of_the_powers),
      cmocka_unit_test(multiplying_by_x_to_the_8n_equals_feeding_n_zero_bytes),
  };
  int failed = cmocka_run_group_tests(tests, setup_report_paths, NULL);
  if (verbose)
    print_throughput();
  return failed;
}
