/*
 * test_dtype — the fp32 <-> fp16/bf16 conversions (common/base/dtype.h).
 *
 * The scalar functions are checked against references written here from the
 * formats' definitions (ldexp-based decoding, rounding in double with rint),
 * exhaustively where the input space is 2^16 and on every rounding midpoint,
 * then on a large sweep of fp32 bit patterns. Every ISA path is then checked
 * to give the scalar functions' bits for all lengths 0..100 at unaligned
 * offsets, without writing outside its output. Last, the codec table: every
 * entry is sized by its block formula, round-trips, and has per-ISA kernels
 * that match its scalar ones; unknown values are refused with the list of
 * names the table generates.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xmmintrin.h>

#include "common/base/cpu.h"
#include "common/base/dtype.h"

/* ------------------------------------------------------------------------ */
/* Helpers and independent references                                        */
/* ------------------------------------------------------------------------ */

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* xorshift64*: a fixed seed, so a failure reproduces. */
static uint32_t rng32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

/* fp16 decoded from its definition: (-1)^s * 2^(e-15) * 1.m, or 2^-14 * 0.m. */
static double ref_f16_value(uint16_t h) {
  int e = (h >> 10) & 0x1f;
  int m = h & 0x3ff;
  double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

/* bf16 decoded from its definition: 8 exponent bits (bias 127), 7 mantissa. */
static double ref_bf16_value(uint16_t h) {
  int e = (h >> 7) & 0xff;
  int m = h & 0x7f;
  double v = e == 0 ? ldexp(m, -133) : ldexp(128 + m, e - 134);
  return (h & 0x8000) ? -v : v;
}

/* A 16-bit format described by its parameters, with the sorted table of its
 * non-negative finite values for encoding by search. */
typedef struct fmt16 {
  int precision; /* significand bits, implicit one included */
  int emin;      /* exponent of the smallest normal */
  int emax;      /* exponent of the largest finite */
  uint16_t inf;  /* the +Inf pattern */
  double (*value)(uint16_t);
  double table[0x7f81];
  uint16_t count; /* finite non-negative patterns: 0 .. count-1 */
} fmt16;

static fmt16 g_f16 = {11, -14, 15, 0x7c00, ref_f16_value, {0}, 0x7c00};
static fmt16 g_bf16 = {8, -126, 127, 0x7f80, ref_bf16_value, {0}, 0x7f80};

static void fmt_init(fmt16 *f) {
  for (uint32_t h = 0; h < f->count; h++)
    f->table[h] = f->value((uint16_t)h);
}

/* The pattern of a non-negative finite value of the format, found by binary
 * search in the table; -1 if the value is not representable. */
static int fmt_encode(const fmt16 *f, double v) {
  int lo = 0, hi = f->count - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (f->table[mid] == v)
      return mid;
    if (f->table[mid] < v)
      lo = mid + 1;
    else
      hi = mid - 1;
  }
  return -1;
}

/* IEEE round-to-nearest-even of a finite float into the format, computed in
 * double: the value is scaled to units of its quantum (exact: a power of two),
 * rounded with rint (ties to even in the default rounding mode), and scaled
 * back. Results at or beyond 2^(emax+1) are Inf. */
static uint16_t ref_round(const fmt16 *f, float x) {
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double ax = fabs((double)x);
  if (ax == 0.0)
    return sign;
  int ex;
  frexp(ax, &ex); /* ax = fr * 2^ex, fr in [0.5, 1): exponent ex-1 */
  int e = ex - 1 < f->emin ? f->emin : ex - 1;
  double quantum = ldexp(1.0, e - (f->precision - 1));
  double r = rint(ax / quantum) * quantum;
  if (r >= ldexp(1.0, f->emax + 1))
    return sign | f->inf;
  int enc = fmt_encode(f, r);
  if (enc < 0)
    fail_msg("reference: %a is not representable", r);
  return (uint16_t)(sign | enc);
}

/* The NaN rule of dtype.c: sign and top payload bits kept, quiet bit set. */
static uint16_t expect_nan_f16(uint32_t u) {
  return (uint16_t)(((u >> 16) & 0x8000) | 0x7e00 | ((u >> 13) & 0x3ff));
}

static uint16_t expect_nan_bf16(uint32_t u) {
  return (uint16_t)((u >> 16) | 0x0040);
}

/* Checks both scalar conversions of the fp32 pattern u against the
 * references. */
static void check_round_f32(uint32_t u) {
  float x = float_of(u);
  uint16_t h = dtype_f32_to_f16(x);
  uint16_t b = dtype_f32_to_bf16(x);
  uint16_t eh, eb;
  if (isnan(x)) {
    eh = expect_nan_f16(u);
    eb = expect_nan_bf16(u);
  } else if (isinf(x)) {
    eh = (uint16_t)(signbit(x) ? 0xfc00 : 0x7c00);
    eb = (uint16_t)(signbit(x) ? 0xff80 : 0x7f80);
  } else {
    eh = ref_round(&g_f16, x);
    eb = ref_round(&g_bf16, x);
  }
  if (h != eh)
    fail_msg("fp32 0x%08x (%a) -> fp16 0x%04x, expected 0x%04x", u, (double)x, h, eh);
  if (b != eb)
    fail_msg("fp32 0x%08x (%a) -> bf16 0x%04x, expected 0x%04x", u, (double)x, b, eb);
}

static int setup_tables(void **state) {
  (void)state;
  fmt_init(&g_f16);
  fmt_init(&g_bf16);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* 16 -> 32: exhaustive                                                      */
/* ------------------------------------------------------------------------ */

static void every_fp16_pattern_widens_exactly_and_narrows_back(void **state) {
  (void)state;
  for (uint32_t i = 0; i < 0x10000; i++) {
    uint16_t h = (uint16_t)i;
    float f = dtype_f16_to_f32(h);
    uint32_t u = bits_of(f);
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f && m != 0) {
      /* NaN: sign and payload kept, quiet bit set (what F16C does). */
      uint32_t want = ((uint32_t)(h & 0x8000) << 16) | 0x7fc00000u | ((uint32_t)m << 13);
      if (u != want)
        fail_msg("fp16 NaN 0x%04x -> 0x%08x, expected 0x%08x", h, u, want);
      uint16_t back = dtype_f32_to_f16(f);
      if (back != (h | 0x0200))
        fail_msg("fp16 NaN 0x%04x came back as 0x%04x", h, back);
      continue;
    }
    double want = e == 0x1f ? ((h & 0x8000) ? -INFINITY : INFINITY) : ref_f16_value(h);
    if ((double)f != want || !signbit(f) != !signbit(want))
      fail_msg("fp16 0x%04x -> %a, expected %a", h, (double)f, want);
    if (dtype_f32_to_f16(f) != h)
      fail_msg("fp16 0x%04x did not round-trip (0x%04x)", h, dtype_f32_to_f16(f));
  }
}

static void every_bf16_pattern_widens_exactly_and_narrows_back(void **state) {
  (void)state;
  for (uint32_t i = 0; i < 0x10000; i++) {
    uint16_t h = (uint16_t)i;
    float f = dtype_bf16_to_f32(h);
    int e = (h >> 7) & 0xff, m = h & 0x7f;
    if (e == 0xff && m != 0) {
      /* NaN: widening keeps every bit (it is a shift); narrowing back keeps
       * the payload and sets the quiet bit. */
      if (bits_of(f) != (uint32_t)h << 16)
        fail_msg("bf16 NaN 0x%04x -> 0x%08x", h, bits_of(f));
      uint16_t back = dtype_f32_to_bf16(f);
      if (back != (h | 0x0040))
        fail_msg("bf16 NaN 0x%04x came back as 0x%04x", h, back);
      continue;
    }
    double want = e == 0xff ? ((h & 0x8000) ? -INFINITY : INFINITY) : ref_bf16_value(h);
    if ((double)f != want || !signbit(f) != !signbit(want))
      fail_msg("bf16 0x%04x -> %a, expected %a", h, (double)f, want);
    if (dtype_f32_to_bf16(f) != h)
      fail_msg("bf16 0x%04x did not round-trip (0x%04x)", h, dtype_f32_to_bf16(f));
  }
}

/* ------------------------------------------------------------------------ */
/* 32 -> 16: rounding                                                        */
/* ------------------------------------------------------------------------ */

/* For every pair of adjacent finite values (a, b) of the format, the fp32
 * midpoint goes to the one with the even pattern, and the fp32 neighbours of
 * the midpoint go to the nearer one. Both formats' midpoints are exact in
 * fp32 (they need one more bit than the format has). */
static void check_midpoints(const fmt16 *f, uint16_t (*conv)(float)) {
  for (uint32_t a = 0; a + 1 < f->count; a++) {
    for (int neg = 0; neg < 2; neg++) {
      double va = f->table[a], vb = f->table[a + 1];
      float mid = (float)((va + vb) / 2);
      assert_true((double)mid == (va + vb) / 2);
      uint16_t s = neg ? 0x8000 : 0;
      if (neg)
        mid = -mid;
      uint16_t even = (uint16_t)(s | ((a & 1) ? a + 1 : a));
      uint16_t got = conv(mid);
      if (got != even)
        fail_msg("midpoint %a -> 0x%04x, expected even 0x%04x", (double)mid, got, even);
      float below = nextafterf(mid, 0.0f), above = nextafterf(mid, neg ? -INFINITY : INFINITY);
      if (conv(below) != (uint16_t)(s | a))
        fail_msg("%a -> 0x%04x, expected 0x%04x", (double)below, conv(below), s | a);
      if (conv(above) != (uint16_t)(s | (a + 1)))
        fail_msg("%a -> 0x%04x, expected 0x%04x", (double)above, conv(above), s | (a + 1));
    }
  }
}

static void fp16_rounds_every_midpoint_to_even(void **state) {
  (void)state;
  check_midpoints(&g_f16, dtype_f32_to_f16);
}

static void bf16_rounds_every_midpoint_to_even(void **state) {
  (void)state;
  check_midpoints(&g_bf16, dtype_f32_to_bf16);
}

static void fp16_overflows_to_inf_at_65520(void **state) {
  (void)state;
  assert_int_equal(dtype_f32_to_f16(65504.0f), 0x7bff);
  assert_int_equal(dtype_f32_to_f16(nextafterf(65520.0f, 0.0f)), 0x7bff);
  assert_int_equal(dtype_f32_to_f16(65520.0f), 0x7c00);
  assert_int_equal(dtype_f32_to_f16(-65520.0f), 0xfc00);
  assert_int_equal(dtype_f32_to_f16(1e10f), 0x7c00);
  assert_int_equal(dtype_f32_to_f16(-3.4028235e38f), 0xfc00);
  assert_int_equal(dtype_f32_to_f16(INFINITY), 0x7c00);
  assert_int_equal(dtype_f32_to_f16(-INFINITY), 0xfc00);
}

static void bf16_overflows_to_inf_above_its_largest_finite(void **state) {
  (void)state;
  /* bf16's largest finite is 0x7f7f = 0x7f7f0000 in fp32; the midpoint to
   * 2^128 is 0x7f7f8000, a tie that goes to the even side, Inf. */
  assert_int_equal(dtype_f32_to_bf16(float_of(0x7f7f7fffu)), 0x7f7f);
  assert_int_equal(dtype_f32_to_bf16(float_of(0x7f7f8000u)), 0x7f80);
  assert_int_equal(dtype_f32_to_bf16(float_of(0x7f7fffffu)), 0x7f80);
  assert_int_equal(dtype_f32_to_bf16(float_of(0xff7fffffu)), 0xff80);
  assert_int_equal(dtype_f32_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(dtype_f32_to_bf16(-INFINITY), 0xff80);
}

static void fp16_underflows_to_rounded_subnormals_and_signed_zero(void **state) {
  (void)state;
  const float tiny = ldexpf(1.0f, -24); /* fp16's smallest subnormal */
  assert_int_equal(dtype_f32_to_f16(tiny), 0x0001);
  assert_int_equal(dtype_f32_to_f16(-tiny), 0x8001);
  assert_int_equal(dtype_f32_to_f16(tiny / 2), 0x0000); /* tie: even zero */
  assert_int_equal(dtype_f32_to_f16(-tiny / 2), 0x8000);
  assert_int_equal(dtype_f32_to_f16(nextafterf(tiny / 2, 1.0f)), 0x0001);
  assert_int_equal(dtype_f32_to_f16(tiny * 1.5f), 0x0002);    /* tie: even 2 */
  assert_int_equal(dtype_f32_to_f16(tiny * 2.5f), 0x0002);    /* tie: even 2 */
  assert_int_equal(dtype_f32_to_f16(tiny * 1023.5f), 0x0400); /* into the normals */
  assert_int_equal(dtype_f32_to_f16(ldexpf(1.0f, -14)), 0x0400);
  assert_int_equal(dtype_f32_to_f16(1e-30f), 0x0000);
  assert_int_equal(dtype_f32_to_f16(float_of(0x00000001u)), 0x0000); /* fp32 subnormal */
  assert_int_equal(dtype_f32_to_f16(float_of(0x80000001u)), 0x8000);
  assert_int_equal(dtype_f32_to_f16(0.0f), 0x0000);
  assert_int_equal(dtype_f32_to_f16(-0.0f), 0x8000);
  /* bf16 has fp32's exponent range, so fp32 subnormals keep their top bits. */
  assert_int_equal(dtype_f32_to_bf16(float_of(0x00010000u)), 0x0001);
  assert_int_equal(dtype_f32_to_bf16(float_of(0x00008000u)), 0x0000); /* tie: even zero */
  assert_int_equal(dtype_f32_to_bf16(float_of(0x00018000u)), 0x0002); /* tie: even 2 */
  assert_int_equal(dtype_f32_to_bf16(float_of(0x807fffffu)), 0x8080); /* carries to normal */
}

static void nan_stays_a_quiet_nan_with_sign_and_top_payload(void **state) {
  (void)state;
  /* A signalling NaN whose payload lies entirely in the dropped bits must not
   * become Inf. */
  assert_int_equal(dtype_f32_to_f16(float_of(0x7f800001u)), 0x7e00);
  assert_int_equal(dtype_f32_to_bf16(float_of(0x7f800001u)), 0x7fc0);
  assert_int_equal(dtype_f32_to_f16(float_of(0xff812345u)), 0xfe09);
  assert_int_equal(dtype_f32_to_bf16(float_of(0xff812345u)), 0xffc1);
  assert_int_equal(dtype_f32_to_f16(float_of(0x7fffffffu)), 0x7fff);
  assert_int_equal(dtype_f32_to_bf16(float_of(0x7fffffffu)), 0x7fff);
  assert_int_equal(dtype_f32_to_f16(NAN) & 0x7e00, 0x7e00);
  assert_int_equal(dtype_f32_to_bf16(NAN) & 0x7fc0, 0x7fc0);
}

static void random_fp32_patterns_round_like_the_reference(void **state) {
  (void)state;
  rng_state = 0x0123456789abcdefull;
  for (int i = 0; i < (1 << 20); i++)
    check_round_f32(rng32());
  /* A strided walk over the whole 2^32 space reaches every exponent and sign
   * with mantissas of every shape. */
  for (uint64_t u = 0; u < (UINT64_C(1) << 32); u += 65521)
    check_round_f32((uint32_t)u);
  /* Values near fp16's range, where the interesting cases of fp16 are. */
  for (int i = 0; i < (1 << 18); i++) {
    uint32_t u = (rng32() & 0x80ffffffu) | ((uint32_t)(100 + rng32() % 50) << 23);
    check_round_f32(u);
  }
}

/* ------------------------------------------------------------------------ */
/* Array kernels on every ISA                                                */
/* ------------------------------------------------------------------------ */

static const cpu_isa k_isas[] = {CPU_ISA_SCALAR, CPU_ISA_AVX2, CPU_ISA_AVX512};
static const zs_dtype k_dtypes[] = {ZS_DTYPE_FP32, ZS_DTYPE_FP16, ZS_DTYPE_BF16};

#define MAXN 100
#define PAD 64 /* guard bytes on each side of an output */
#define GUARD 0xa5

/* An fp32 pattern that is often special: NaN (quiet and signalling), Inf,
 * zeros, subnormals, near-overflow and tie patterns, else random. */
static uint32_t interesting_f32(void) {
  static const uint32_t special[] = {
      0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0x7f800000u, 0xff800000u,
      0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x477fefffu, 0x477ff000u,
      0x477fe000u, 0x33000000u, 0x33000001u, 0x3f808000u, 0x3f818000u, 0x7f7fffffu,
      0x7f7f8000u, 0x387fe000u, 0x387ff000u, 0x3f800fffu, 0x3f801000u, 0x3f803000u};
  uint32_t r = rng32();
  if (r % 4 == 0)
    return special[rng32() % (sizeof special / sizeof special[0])];
  return rng32();
}

static uint16_t interesting_16(void) {
  static const uint16_t special[] = {0x7c01, 0x7e00, 0xfc00, 0x7c00, 0x0001, 0x8001,
                                     0x03ff, 0x7bff, 0x7f81, 0x7fc0, 0xff80, 0x0000};
  if (rng32() % 4 == 0)
    return special[rng32() % (sizeof special / sizeof special[0])];
  return (uint16_t)rng32();
}

static void fill_input(zs_dtype dt, unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (dt == ZS_DTYPE_FP32) {
      uint32_t u = interesting_f32();
      memcpy(p + 4 * i, &u, 4);
    } else {
      uint16_t h = interesting_16();
      memcpy(p + 2 * i, &h, 2);
    }
  }
}

/* The element i of a packed input, widened by the public scalar functions. */
static float widen_ref(zs_dtype dt, const unsigned char *p, size_t i) {
  uint16_t h;
  switch (dt) {
  case ZS_DTYPE_FP16:
    memcpy(&h, p + 2 * i, 2);
    return dtype_f16_to_f32(h);
  case ZS_DTYPE_BF16:
    memcpy(&h, p + 2 * i, 2);
    return dtype_bf16_to_f32(h);
  default: {
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
  }
  }
}

static void check_guard(const unsigned char *buf, size_t from, size_t to, const char *what) {
  for (size_t i = from; i < to; i++)
    if (buf[i] != GUARD)
      fail_msg("%s wrote outside its output at byte %zu", what, i);
}

static void every_isa_widens_like_scalar_at_all_lengths_and_offsets(void **state) {
  (void)state;
  _Alignas(64) unsigned char in[4 * MAXN + 64];
  _Alignas(64) unsigned char outbuf[4 * MAXN + 2 * PAD + 64];
  rng_state = 42;
  for (size_t ii = 0; ii < 3; ii++) {
    cpu_isa isa = k_isas[ii];
    if (!cpu_supports(isa))
      print_message("CPU lacks %s: its kernels fall back and are not exercised\n",
                    cpu_isa_name(isa));
    for (size_t di = 0; di < 3; di++) {
      zs_dtype dt = k_dtypes[di];
      for (size_t n = 0; n <= MAXN; n++) {
        for (size_t off = 0; off < 4; off++) {
          /* `in` at any byte offset; `out` at any float offset. */
          unsigned char *src = in + off + (off == 0 ? 0 : 1);
          fill_input(dt, src, n);
          memset(outbuf, GUARD, sizeof outbuf);
          float *out = (float *)(void *)(outbuf + PAD + 4 * off);
          dtype_to_f32_isa(isa, dt, src, out, n);
          check_guard(outbuf, 0, PAD + 4 * off, cpu_isa_name(isa));
          check_guard(outbuf, PAD + 4 * off + 4 * n, sizeof outbuf, cpu_isa_name(isa));
          for (size_t i = 0; i < n; i++) {
            float got, want = widen_ref(dt, src, i);
            memcpy(&got, outbuf + PAD + 4 * off + 4 * i, 4);
            if (bits_of(got) != bits_of(want))
              fail_msg("%s dtype %d n=%zu off=%zu [%zu]: 0x%08x, scalar 0x%08x", cpu_isa_name(isa),
                       dt, n, off, i, bits_of(got), bits_of(want));
          }
        }
      }
    }
  }
}

static void every_isa_narrows_like_scalar_at_all_lengths_and_offsets(void **state) {
  (void)state;
  _Alignas(64) unsigned char inbuf[4 * MAXN + 64];
  _Alignas(64) unsigned char out[4 * MAXN + 2 * PAD + 64];
  rng_state = 43;
  for (size_t ii = 0; ii < 3; ii++) {
    cpu_isa isa = k_isas[ii];
    for (size_t di = 0; di < 3; di++) {
      zs_dtype dt = k_dtypes[di];
      size_t esz = dt == ZS_DTYPE_FP32 ? 4 : 2;
      for (size_t n = 0; n <= MAXN; n++) {
        for (size_t off = 0; off < 4; off++) {
          float *in = (float *)(void *)(inbuf + 4 * off);
          fill_input(ZS_DTYPE_FP32, (unsigned char *)in, n);
          memset(out, GUARD, sizeof out);
          size_t o = PAD + off + (off == 0 ? 0 : 1); /* any byte offset */
          dtype_from_f32_isa(isa, dt, in, out + o, n);
          check_guard(out, 0, o, cpu_isa_name(isa));
          check_guard(out, o + esz * n, sizeof out, cpu_isa_name(isa));
          for (size_t i = 0; i < n; i++) {
            uint32_t got = 0, want;
            memcpy(&got, out + o + esz * i, esz);
            if (dt == ZS_DTYPE_FP16)
              want = dtype_f32_to_f16(in[i]);
            else if (dt == ZS_DTYPE_BF16)
              want = dtype_f32_to_bf16(in[i]);
            else
              want = bits_of(in[i]);
            if (got != want)
              fail_msg("%s dtype %d n=%zu off=%zu [%zu] from 0x%08x: 0x%x, scalar 0x%x",
                       cpu_isa_name(isa), dt, n, off, i, bits_of(in[i]), got, want);
          }
        }
      }
    }
  }
}

static void every_isa_accumulates_like_scalar_at_all_lengths_and_offsets(void **state) {
  (void)state;
  _Alignas(64) unsigned char in[4 * MAXN + 64];
  _Alignas(64) unsigned char accbuf[4 * MAXN + 2 * PAD + 64];
  float before[MAXN];
  rng_state = 44;
  for (size_t ii = 0; ii < 3; ii++) {
    cpu_isa isa = k_isas[ii];
    for (size_t di = 0; di < 3; di++) {
      zs_dtype dt = k_dtypes[di];
      for (size_t n = 0; n <= MAXN; n++) {
        for (size_t off = 0; off < 4; off++) {
          unsigned char *src = in + off + (off == 0 ? 0 : 1);
          fill_input(dt, src, n);
          memset(accbuf, GUARD, sizeof accbuf);
          float *acc = (float *)(void *)(accbuf + PAD + 4 * off);
          fill_input(ZS_DTYPE_FP32, (unsigned char *)before, n);
          memcpy(acc, before, 4 * n);
          dtype_accumulate_isa(isa, dt, src, acc, n);
          check_guard(accbuf, 0, PAD + 4 * off, cpu_isa_name(isa));
          check_guard(accbuf, PAD + 4 * off + 4 * n, sizeof accbuf, cpu_isa_name(isa));
          for (size_t i = 0; i < n; i++) {
            float got;
            memcpy(&got, accbuf + PAD + 4 * off + 4 * i, 4);
            /* The NaN rule: a NaN already in acc stays (quieted); otherwise
             * there is at most one NaN operand and the sum's NaN is it. */
            float a = before[i], x = widen_ref(dt, src, i);
            float want = isnan(a) ? float_of(bits_of(a) | 0x00400000u) : a + x;
            if (bits_of(got) != bits_of(want))
              fail_msg("%s dtype %d n=%zu off=%zu [%zu]: 0x%08x + 0x%08x = 0x%08x, want 0x%08x",
                       cpu_isa_name(isa), dt, n, off, i, bits_of(before[i]), bits_of(x),
                       bits_of(got), bits_of(want));
          }
        }
      }
    }
  }
}

/* The shard core adds contribution 1 before contribution 0 when it arrives
 * first (server/core/core.c): that relies on (0 + g1) + g0 having the bits of
 * (0 + g0) + g1 for every pair of inputs but NaNs, on every ISA and dtype. */
static void the_first_two_contributions_commute_bit_for_bit(void **state) {
  (void)state;
  enum { N = 4096 };
  static unsigned char g0[4 * N], g1[4 * N];
  static float fwd[N], rev[N];
  rng_state = 45;
  for (size_t ii = 0; ii < 3; ii++) {
    cpu_isa isa = k_isas[ii];
    for (size_t di = 0; di < 3; di++) {
      zs_dtype dt = k_dtypes[di];
      fill_input(dt, g0, N);
      fill_input(dt, g1, N);
      memset(fwd, 0, sizeof fwd);
      memset(rev, 0, sizeof rev);
      dtype_accumulate_isa(isa, dt, g0, fwd, N);
      dtype_accumulate_isa(isa, dt, g1, fwd, N);
      dtype_accumulate_isa(isa, dt, g1, rev, N);
      dtype_accumulate_isa(isa, dt, g0, rev, N);
      for (size_t i = 0; i < N; i++) {
        if (isnan(fwd[i]) && isnan(rev[i]))
          continue;
        if (bits_of(fwd[i]) != bits_of(rev[i]))
          fail_msg("%s dtype %d [%zu]: (0 + 0x%08x) + 0x%08x = 0x%08x but the other order gives "
                   "0x%08x",
                   cpu_isa_name(isa), dt, i, bits_of(widen_ref(dt, g0, i)),
                   bits_of(widen_ref(dt, g1, i)), bits_of(fwd[i]), bits_of(rev[i]));
      }
    }
  }
}

/* Long arrays go through the main loops many times; a large sweep of random
 * patterns through every ISA must match the scalar functions element by
 * element. */
static void every_isa_matches_scalar_on_a_large_random_sweep(void **state) {
  (void)state;
  enum { N = 1 << 16 };
  float *in = malloc(N * sizeof(float));
  uint16_t *out16 = malloc(N * sizeof(uint16_t));
  float *out32 = malloc(N * sizeof(float));
  assert_non_null(in);
  assert_non_null(out16);
  assert_non_null(out32);
  rng_state = 45;
  for (int round = 0; round < 8; round++) {
    for (size_t i = 0; i < N; i++)
      in[i] = float_of(round < 4 ? rng32() : interesting_f32());
    for (size_t ii = 0; ii < 3; ii++) {
      for (int b = 0; b < 2; b++) {
        zs_dtype dt = b ? ZS_DTYPE_BF16 : ZS_DTYPE_FP16;
        dtype_from_f32_isa(k_isas[ii], dt, in, out16, N);
        for (size_t i = 0; i < N; i++) {
          uint16_t want = b ? dtype_f32_to_bf16(in[i]) : dtype_f32_to_f16(in[i]);
          if (out16[i] != want)
            fail_msg("%s %s of 0x%08x: 0x%04x, scalar 0x%04x", cpu_isa_name(k_isas[ii]),
                     b ? "bf16" : "fp16", bits_of(in[i]), out16[i], want);
        }
        dtype_to_f32_isa(k_isas[ii], dt, out16, out32, N);
        for (size_t i = 0; i < N; i++) {
          float want = b ? dtype_bf16_to_f32(out16[i]) : dtype_f16_to_f32(out16[i]);
          if (bits_of(out32[i]) != bits_of(want))
            fail_msg("%s widening of 0x%04x differs", cpu_isa_name(k_isas[ii]), out16[i]);
        }
      }
    }
  }
  free(in);
  free(out16);
  free(out32);
}

static void accumulate_adds_converted_values_in_place(void **state) {
  (void)state;
  float acc[5] = {1.0f, -2.0f, 0.5f, 0.0f, 100.0f};
  uint16_t g16[5], gb[5];
  const float g[5] = {0.5f, 0.25f, -0.5f, 1024.0f, -1.0f};
  for (int i = 0; i < 5; i++) {
    g16[i] = dtype_f32_to_f16(g[i]);
    gb[i] = dtype_f32_to_bf16(g[i]);
  }
  dtype_accumulate(ZS_DTYPE_FP16, g16, acc, 5);
  dtype_accumulate(ZS_DTYPE_BF16, gb, acc, 5);
  dtype_accumulate(ZS_DTYPE_FP32, g, acc, 5);
  const float want[5] = {2.5f, -1.25f, -1.0f, 3072.0f, 97.0f};
  for (int i = 0; i < 5; i++)
    assert_true(acc[i] == want[i]);
}

static void public_array_functions_use_the_best_isa_with_the_same_bits(void **state) {
  (void)state;
  enum { N = 1000 };
  float in[N], back[N];
  uint16_t a[N], b[N];
  rng_state = 46;
  for (int i = 0; i < N; i++)
    in[i] = float_of(interesting_f32());
  dtype_from_f32(ZS_DTYPE_BF16, in, a, N);
  dtype_from_f32_isa(CPU_ISA_SCALAR, ZS_DTYPE_BF16, in, b, N);
  assert_memory_equal(a, b, sizeof a);
  dtype_from_f32(ZS_DTYPE_FP16, in, a, N);
  dtype_from_f32_isa(CPU_ISA_SCALAR, ZS_DTYPE_FP16, in, b, N);
  assert_memory_equal(a, b, sizeof a);
  dtype_to_f32(ZS_DTYPE_FP16, a, back, N);
  dtype_to_f32_isa(CPU_ISA_SCALAR, ZS_DTYPE_FP16, a, in, N);
  assert_memory_equal(back, in, sizeof back);
}

static void invalid_dtypes_are_rejected_and_convert_nothing(void **state) {
  (void)state;
  assert_true(dtype_valid(ZS_DTYPE_FP32));
  assert_true(dtype_valid(ZS_DTYPE_FP16));
  assert_true(dtype_valid(ZS_DTYPE_BF16));
  assert_false(dtype_valid(0));
  assert_true(dtype_valid(ZS_DTYPE_INT8_BLOCK));
  assert_false(dtype_valid(5));
  assert_false(dtype_valid(-1));
  float in[4] = {1, 2, 3, 4}, out[4] = {9, 9, 9, 9};
  for (size_t ii = 0; ii < 3; ii++) {
    dtype_to_f32_isa(k_isas[ii], (zs_dtype)0, in, out, 4);
    dtype_from_f32_isa(k_isas[ii], (zs_dtype)5, in, out, 4);
    dtype_accumulate_isa(k_isas[ii], (zs_dtype)7, in, out, 4);
  }
  for (int i = 0; i < 4; i++)
    assert_true(out[i] == 9.0f);
}

/* A trainer may run with flush-to-zero and denormals-are-zero set in MXCSR
 * (torch.set_flush_denormal(True)); the conversions must not change, on any
 * path, for fp32 subnormal inputs, fp16 subnormal results or fp16 subnormal
 * inputs. The conversions run under FTZ/DAZ; the references (double
 * arithmetic, which DAZ would disturb) and the comparisons run without. */
static void conversions_ignore_flush_to_zero_and_denormals_are_zero(void **state) {
  (void)state;
  enum { N = 1 << 16 };
  float *in = malloc(2 * N * sizeof(float)), *wide = malloc(3 * N * sizeof(float));
  uint16_t *all = malloc(N * sizeof(uint16_t));
  uint16_t *out = malloc(3 * 2 * 2 * N * sizeof(uint16_t));
  assert_non_null(in);
  assert_non_null(wide);
  assert_non_null(all);
  assert_non_null(out);
  /* fp32 subnormals of both signs, then values around fp16's subnormals. */
  for (uint32_t i = 0; i < N; i++) {
    in[i] = float_of((i << 7) | ((i & 1u) << 31));
    in[N + i] = float_of(0x33000000u + i * 1024u);
    all[i] = (uint16_t)i;
  }

  unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
  for (size_t ii = 0; ii < 3; ii++) {
    dtype_from_f32_isa(k_isas[ii], ZS_DTYPE_FP16, in, out + (ii * 2 + 0) * 2 * N, 2 * N);
    dtype_from_f32_isa(k_isas[ii], ZS_DTYPE_BF16, in, out + (ii * 2 + 1) * 2 * N, 2 * N);
    dtype_to_f32_isa(k_isas[ii], ZS_DTYPE_FP16, all, wide + ii * N, N);
  }
  _mm_setcsr(csr);

  for (size_t ii = 0; ii < 3; ii++) {
    for (int b = 0; b < 2; b++) {
      const uint16_t *h = out + (ii * 2 + (size_t)b) * 2 * N;
      for (uint32_t i = 0; i < 2 * N; i++) {
        uint16_t want = b ? ref_round(&g_bf16, in[i]) : ref_round(&g_f16, in[i]);
        if (h[i] != want)
          fail_msg("%s under FTZ/DAZ: 0x%08x -> 0x%04x, expected 0x%04x", cpu_isa_name(k_isas[ii]),
                   bits_of(in[i]), h[i], want);
      }
    }
    for (uint32_t i = 0; i < N; i++) {
      int e = (i >> 10) & 0x1f;
      if (e != 0x1f && (double)wide[ii * N + i] != ref_f16_value((uint16_t)i))
        fail_msg("%s under FTZ/DAZ: fp16 0x%04x -> %a", cpu_isa_name(k_isas[ii]), i,
                 (double)wide[ii * N + i]);
    }
  }
  free(in);
  free(wide);
  free(all);
  free(out);
}

/* ------------------------------------------------------------------------ */
/* The codec table                                                           */
/* ------------------------------------------------------------------------ */

/* The tests below walk the table rather than a list of dtypes, so that an
 * entry added to it is covered without an edit here. */

static size_t table_count(void) {
  size_t n = 0;
  while (dtype_codec_at(n))
    n++;
  return n;
}

static void every_table_entry_is_found_by_its_value_and_has_scalar_kernels(void **state) {
  (void)state;
  size_t count = table_count();
  assert_true(count >= 3);
  int prev = 0;
  for (size_t i = 0; i < count; i++) {
    const dtype_codec *k = dtype_codec_at(i);
    assert_true((int)k->id > prev); /* increasing, no duplicates */
    prev = (int)k->id;
    assert_ptr_equal(dtype_codec_of((int)k->id), k);
    assert_true(dtype_valid((int)k->id));
    assert_int_equal(dtype_from_varint((uint64_t)k->id), (int)k->id);
    assert_non_null(k->name);
    assert_true(k->block >= 1 && DTYPE_MAX_BLOCK % k->block == 0);
    assert_true(k->elem_bytes + k->scale_bytes > 0);
    assert_non_null(k->encode[CPU_ISA_SCALAR]);
    assert_non_null(k->decode[CPU_ISA_SCALAR]);
    assert_non_null(k->accumulate[CPU_ISA_SCALAR]);
  }
  assert_null(dtype_codec_at(count));
  /* The values of the public enum are all in the table. */
  for (size_t di = 0; di < 3; di++)
    assert_non_null(dtype_codec_of(k_dtypes[di]));
}

/* bytes(n) = ceil(n / block) * scale_bytes + n * elem_bytes for every entry;
 * for fp32, fp16 and bf16 that is the numel * element size every caller
 * computed before the table, and the public functions say the same. */
static void bytes_follow_the_block_formula_and_the_old_element_sizes(void **state) {
  (void)state;
  static const uint64_t ns[] = {0, 1, 2, 7, 255, 256, 257, 1000, 65536, (uint64_t)1 << 40};
  for (size_t i = 0; i < table_count(); i++) {
    const dtype_codec *k = dtype_codec_at(i);
    for (size_t j = 0; j < sizeof ns / sizeof ns[0]; j++) {
      uint64_t n = ns[j];
      uint64_t want = (n + k->block - 1) / k->block * k->scale_bytes + n * k->elem_bytes;
      assert_int_equal(dtype_bytes((int)k->id, n), want);
      assert_int_equal(zs_dtype_bytes((int)k->id, (size_t)n), (size_t)want);
    }
  }
  static const struct {
    zs_dtype d;
    size_t size;
  } old[] = {{ZS_DTYPE_FP32, 4}, {ZS_DTYPE_FP16, 2}, {ZS_DTYPE_BF16, 2}};
  for (size_t i = 0; i < 3; i++) {
    assert_int_equal(zs_dtype_size(old[i].d), old[i].size);
    for (size_t j = 0; j < sizeof ns / sizeof ns[0]; j++) {
      assert_int_equal(dtype_bytes(old[i].d, ns[j]), ns[j] * old[i].size);
      assert_int_equal(zs_dtype_bytes(old[i].d, (size_t)ns[j]), (size_t)ns[j] * old[i].size);
    }
  }
}

/* The list in every "not a dtype" message is generated from the table. */
static void unknown_dtypes_are_refused_with_the_generated_list_of_names(void **state) {
  (void)state;
  char want[256] = "";
  size_t count = table_count();
  for (size_t i = 0; i < count; i++) {
    strcat(want, i == 0 ? "" : i + 1 == count ? " or " : ", ");
    strcat(want, dtype_codec_at(i)->name);
  }
  assert_string_equal(dtype_names(), want);
  assert_string_equal(dtype_names(), "FP32, FP16, BF16 or INT8_BLOCK"); /* today's table */

  static const int bad[] = {0, 5, 6, 77, 255, -1, -3, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int d = bad[i];
    char err[512] = "", msg[512];
    assert_null(dtype_codec_of(d));
    assert_false(dtype_valid(d));
    assert_int_equal(dtype_bytes(d, 10), 0);
    assert_int_equal(zs_dtype_bytes(d, 10), 0);
    assert_int_equal(zs_dtype_size(d), 0);
    assert_int_equal(dtype_check(d, err, sizeof err), ZS_EDTYPE);
    snprintf(msg, sizeof msg, "dtype %d is not %s", d, want);
    assert_string_equal(err, msg);
    assert_int_equal(dtype_check(d, NULL, 0), ZS_EDTYPE);
  }
  for (size_t i = 0; i < count; i++) {
    char err[8] = "x";
    assert_int_equal(dtype_check((int)dtype_codec_at(i)->id, err, sizeof err), 0);
    assert_string_equal(err, "x"); /* success writes nothing */
  }

  /* Protobuf varints: an int32 enum that is negative arrives sign-extended
   * to 64 bits, and values past 2^32 must not truncate into a dtype. */
  static const uint64_t bad_v[] = {0,
                                   5,
                                   ((uint64_t)1 << 32) + ZS_DTYPE_FP32,
                                   ((uint64_t)1 << 63) + ZS_DTYPE_BF16,
                                   (uint64_t)(int64_t)-1,
                                   (uint64_t)(int64_t)-3,
                                   UINT64_MAX - 0xffffffffu + ZS_DTYPE_FP16};
  for (size_t i = 0; i < sizeof bad_v / sizeof bad_v[0]; i++)
    assert_int_equal(dtype_from_varint(bad_v[i]), 0);
}

/* Random bytes: for wire data every pattern, signalling NaNs included. */
static void fill_random(unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)rng32();
}

/* The lengths a kernel is checked at: every short one (all vector tails),
 * then around the first block boundaries and one long array. */
static size_t table_lengths(const dtype_codec *k, size_t *out) {
  size_t m = 0;
  for (size_t n = 0; n <= 40; n++)
    out[m++] = n;
  for (size_t b = 1; b <= 3; b++)
    for (size_t d = 0; d < 3; d++)
      if (b * k->block + d - 1 > 40)
        out[m++] = b * k->block + d - 1;
  out[m++] = 4099;
  return m;
}

/* Every table entry, on every ISA whose slot it fills and the CPU has:
 * decode and accumulate agree bit for bit with the entry's scalar kernels
 * on arbitrary wire bytes, encode agrees with the scalar encode, and
 * encoding then decoding round-trips: wire data the encoder produced
 * decodes to values that encode back to the same bytes. Each kernel touches
 * exactly bytes(n) wire bytes or n floats. */
static void every_table_entry_round_trips_and_every_isa_matches_scalar(void **state) {
  (void)state;
  enum { MAXLEN = 4099, SLACK = 64 };
  size_t wcap = (size_t)dtype_bytes(ZS_DTYPE_FP32, MAXLEN) * 2 + 2 * PAD + SLACK;
  unsigned char *wire_in = malloc(wcap), *wire_ref = malloc(wcap), *wire_got = malloc(wcap);
  float *f_in = malloc((MAXLEN + 32) * sizeof(float));
  float *f_ref = malloc((MAXLEN + 2 * PAD) * sizeof(float));
  float *f_got = malloc((MAXLEN + 2 * PAD) * sizeof(float));
  assert_non_null(wire_in);
  assert_non_null(wire_ref);
  assert_non_null(wire_got);
  assert_non_null(f_in);
  assert_non_null(f_ref);
  assert_non_null(f_got);
  size_t lens[64];
  rng_state = 47;
  for (size_t ti = 0; ti < table_count(); ti++) {
    const dtype_codec *k = dtype_codec_at(ti);
    size_t nlens = table_lengths(k, lens);
    assert_true((size_t)dtype_bytes((int)k->id, MAXLEN) * 2 + 2 * PAD + SLACK <= wcap);
    for (size_t li = 0; li < nlens; li++) {
      size_t n = lens[li], nb = (size_t)dtype_bytes((int)k->id, n);
      size_t off = li % 4; /* wire data at any byte address */
      unsigned char *w = wire_in + PAD + off;
      for (size_t i = 0; i < n; i++)
        f_in[i] = float_of(interesting_f32());

      /* The scalar results, and the round trip through them. */
      memset(wire_ref, GUARD, wcap);
      k->encode[CPU_ISA_SCALAR](f_in, wire_ref + PAD + off, n);
      check_guard(wire_ref, 0, PAD + off, k->name);
      check_guard(wire_ref, PAD + off + nb, wcap, k->name);
      memcpy(w, wire_ref + PAD + off, nb);
      k->decode[CPU_ISA_SCALAR](w, f_ref, n);
      memset(wire_got, GUARD, wcap);
      k->encode[CPU_ISA_SCALAR](f_ref, wire_got + PAD + off, n);
      if (memcmp(wire_got + PAD + off, w, nb) != 0)
        fail_msg("%s n=%zu: encode(decode(encode(x))) differs from encode(x)", k->name, n);

      for (int isa = CPU_ISA_AVX2; isa < DTYPE_NISA; isa++) {
        if (!cpu_supports((cpu_isa)isa))
          continue;
        const char *what = cpu_isa_name((cpu_isa)isa);
        if (k->encode[isa]) {
          memset(wire_got, GUARD, wcap);
          k->encode[isa](f_in, wire_got + PAD + off, n);
          check_guard(wire_got, 0, PAD + off, what);
          check_guard(wire_got, PAD + off + nb, wcap, what);
          if (memcmp(wire_got + PAD + off, wire_ref + PAD + off, nb) != 0)
            fail_msg("%s %s encode n=%zu differs from scalar", what, k->name, n);
        }
        /* Decode and accumulate on arbitrary bytes, then on encoded ones. */
        for (int pass = 0; pass < 2; pass++) {
          if (pass == 0)
            fill_random(w, nb);
          else
            memcpy(w, wire_ref + PAD + off, nb);
          if (k->decode[isa]) {
            k->decode[CPU_ISA_SCALAR](w, f_ref + PAD, n);
            memset(f_got, GUARD, (MAXLEN + 2 * PAD) * sizeof(float));
            k->decode[isa](w, f_got + PAD, n);
            check_guard((unsigned char *)f_got, 0, PAD * sizeof(float), what);
            check_guard((unsigned char *)f_got, (PAD + n) * sizeof(float),
                        (MAXLEN + 2 * PAD) * sizeof(float), what);
            if (memcmp(f_got + PAD, f_ref + PAD, n * sizeof(float)) != 0)
              fail_msg("%s %s decode n=%zu pass %d differs from scalar", what, k->name, n, pass);
          }
          if (k->accumulate[isa]) {
            for (size_t i = 0; i < n; i++)
              f_ref[PAD + i] = float_of(interesting_f32());
            memcpy(f_got + PAD, f_ref + PAD, n * sizeof(float));
            k->accumulate[CPU_ISA_SCALAR](w, f_ref + PAD, n);
            k->accumulate[isa](w, f_got + PAD, n);
            if (memcmp(f_got + PAD, f_ref + PAD, n * sizeof(float)) != 0)
              fail_msg("%s %s accumulate n=%zu pass %d differs from scalar", what, k->name, n,
                       pass);
          }
        }
      }
    }
  }
  free(wire_in);
  free(wire_ref);
  free(wire_got);
  free(f_in);
  free(f_ref);
  free(f_got);
}

/* ------------------------------------------------------------------------ */
/* INT8_BLOCK                                                                */
/* ------------------------------------------------------------------------ */

/* The format from its specification (docs/PROTOCOL.md), written again here
 * in double where exact: per block, amax; NaN/Inf or amax >= 2^127 -> NaN
 * scale and zeros;
 * amax < 2^-100 -> zero scale and zeros; else scale = fl(amax / 127) and
 * q = rint(fl(x * fl(127 / amax))). */
static void ref_int8_encode(const float *in, unsigned char *out, size_t n) {
  for (size_t b = 0; b < n; b += DTYPE_INT8_BLOCK) {
    size_t len = n - b < DTYPE_INT8_BLOCK ? n - b : DTYPE_INT8_BLOCK;
    int nonfinite = 0;
    double amax = 0;
    for (size_t i = 0; i < len; i++) {
      if (!isfinite(in[b + i]) || fabs((double)in[b + i]) >= ldexp(1.0, 127))
        nonfinite = 1;
      else if (fabs((double)in[b + i]) > amax)
        amax = fabs((double)in[b + i]);
    }
    float scale = 0.0f, inv = 0.0f;
    if (nonfinite)
      scale = float_of(0x7fc00000u);
    else if (amax >= ldexp(1.0, -100)) {
      scale = (float)amax / 127.0f;
      inv = 127.0f / (float)amax;
    }
    memcpy(out, &scale, 4);
    out += 4;
    for (size_t i = 0; i < len; i++) {
      float y = in[b + i] * inv;
      out[i] = (unsigned char)(int8_t)(inv == 0.0f ? 0 : (int)rint((double)y));
    }
    out += len;
  }
}

/* Blocks of edge data: zeros of both signs, fp32 subnormals alone and
 * beside normals, the smallest amax that is not cut, values at exact
 * halves of a step, the largest finite values, Inf and NaN. */
static void fill_int8_edges(float *x, size_t n, uint32_t kind) {
  for (size_t i = 0; i < n; i++) {
    switch (kind % 8) {
    case 0:
      x[i] = i % 2 ? -0.0f : 0.0f;
      break;
    case 1:
      x[i] = float_of((rng32() & 0x007fffffu) | (rng32() & 0x80000000u)); /* subnormals */
      break;
    case 2:
      x[i] = i == 3 ? 1.0f : float_of(rng32() & 0x807fffffu); /* subnormals and a 1 */
      break;
    case 3:
      x[i] = ldexpf((float)(int)(rng32() % 255) - 127.0f, -106); /* around the cut */
      break;
    case 4:
      x[i] = ((float)(int)(rng32() % 255) - 127.0f + 0.5f) / 127.0f; /* halves of a step */
      break;
    case 5:
      x[i] = float_of(0x7f7fffffu ^ (rng32() & 0x80000fffu)); /* near FLT_MAX */
      break;
    case 6:
      x[i] = i == n / 2 ? (rng32() % 2 ? INFINITY : -INFINITY) : (float)rng32();
      break;
    default:
      x[i] = i == n - 1 ? float_of(0x7f800001u | (rng32() & 0x803fffffu)) : 1.0f;
      break;
    }
  }
}

static void check_int8(const float *x, size_t n, const char *what) {
  size_t nb = (size_t)dtype_bytes(ZS_DTYPE_INT8_BLOCK, n);
  unsigned char *want = malloc(nb + 1), *got = malloc(nb + 1);
  float *back = malloc((n + 1) * sizeof(float)), *back_isa = malloc((n + 1) * sizeof(float));
  assert_non_null(want);
  assert_non_null(got);
  assert_non_null(back);
  assert_non_null(back_isa);
  ref_int8_encode(x, want, n);
  for (size_t ii = 0; ii < 3; ii++) {
    memset(got, GUARD, nb + 1);
    dtype_from_f32_isa(k_isas[ii], ZS_DTYPE_INT8_BLOCK, x, got, n);
    if (memcmp(got, want, nb) != 0 || got[nb] != GUARD)
      fail_msg("%s: %s encode n=%zu differs from the specification", what, cpu_isa_name(k_isas[ii]),
               n);
    dtype_to_f32_isa(k_isas[ii], ZS_DTYPE_INT8_BLOCK, got, back_isa, n);
    if (ii == 0)
      memcpy(back, back_isa, n * sizeof(float));
    else if (memcmp(back, back_isa, n * sizeof(float)) != 0)
      fail_msg("%s: %s decode n=%zu differs from scalar", what, cpu_isa_name(k_isas[ii]), n);
  }
  /* What the format promises a reader: each element within half a step of
   * its input, a non-finite block all NaN. */
  for (size_t b = 0; b < n; b += DTYPE_INT8_BLOCK) {
    size_t len = n - b < DTYPE_INT8_BLOCK ? n - b : DTYPE_INT8_BLOCK;
    float scale;
    memcpy(&scale, want + (b / DTYPE_INT8_BLOCK) * (DTYPE_INT8_BLOCK + 4), 4);
    for (size_t i = b; i < b + len; i++) {
      if (isnan(scale)) {
        assert_true(isnan(back[i]));
        continue;
      }
      double err = fabs((double)back[i] - (double)x[i]);
      /* Half a step from rounding, plus the rounding of x * (127 / amax)
       * and of q * scale (each under 2^-24 relative to 127 steps). */
      double bound =
          scale == 0.0f ? ldexp(1.0, -100) : (double)scale * (0.5 + 127 * ldexp(1.0, -22));
      if (!(err <= bound))
        fail_msg("%s: n=%zu [%zu] %a decodes to %a (scale %a)", what, n, i, (double)x[i],
                 (double)back[i], (double)scale);
    }
  }
  free(want);
  free(got);
  free(back);
  free(back_isa);
}

/* Every path gives the bits the specification gives, on edge data and on
 * random data, for partial last blocks and for arrays cut at block
 * boundaries (as the shards' pieces are): the encoding of a piece is the
 * piece's bytes of the whole array's encoding. */
static void int8_block_follows_its_specification_on_every_path(void **state) {
  (void)state;
  enum { N = 3 * DTYPE_INT8_BLOCK + 77 };
  float x[N];
  rng_state = 48;
  for (uint32_t kind = 0; kind < 64; kind++) {
    size_t n = kind < 8 ? DTYPE_INT8_BLOCK : 1 + rng32() % N;
    if (kind < 16)
      fill_int8_edges(x, n, kind);
    else
      for (size_t i = 0; i < n; i++)
        x[i] = ldexpf((float)(int32_t)rng32() / 2147483648.0f, (int)(rng32() % 40) - 20);
    check_int8(x, n, kind < 16 ? "edge data" : "random data");
  }
  /* Blocks of edge data side by side, the last one partial. */
  for (size_t b = 0; b < 3; b++)
    fill_int8_edges(x + b * DTYPE_INT8_BLOCK, DTYPE_INT8_BLOCK, (uint32_t)b * 3 + 1);
  fill_int8_edges(x + 3 * DTYPE_INT8_BLOCK, 77, 4);
  check_int8(x, N, "mixed blocks");

  /* A piece starting at a block boundary is an array of its own. */
  unsigned char whole[N + 16], part[N + 16];
  dtype_from_f32(ZS_DTYPE_INT8_BLOCK, x, whole, N);
  size_t at = 2 * DTYPE_INT8_BLOCK;
  dtype_from_f32(ZS_DTYPE_INT8_BLOCK, x + at, part, N - at);
  assert_memory_equal(part, whole + dtype_bytes(ZS_DTYPE_INT8_BLOCK, at),
                      (size_t)dtype_bytes(ZS_DTYPE_INT8_BLOCK, N - at));
}

/* The encoder reads no MXCSR flag: under FTZ and DAZ the bits are the
 * same, subnormal inputs included. */
static void int8_block_ignores_flush_to_zero_and_denormals_are_zero(void **state) {
  (void)state;
  enum { N = 16 * DTYPE_INT8_BLOCK };
  static float x[N];
  static unsigned char plain[3][N + N / 8], ftz[3][N + N / 8];
  rng_state = 49;
  for (uint32_t b = 0; b < 16; b++)
    fill_int8_edges(x + b * DTYPE_INT8_BLOCK, DTYPE_INT8_BLOCK, b % 8);
  for (size_t ii = 0; ii < 3; ii++)
    dtype_from_f32_isa(k_isas[ii], ZS_DTYPE_INT8_BLOCK, x, plain[ii], N);
  unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  for (size_t ii = 0; ii < 3; ii++)
    dtype_from_f32_isa(k_isas[ii], ZS_DTYPE_INT8_BLOCK, x, ftz[ii], N);
  _mm_setcsr(csr);
  for (size_t ii = 0; ii < 3; ii++)
    assert_memory_equal(plain[ii], ftz[ii], (size_t)dtype_bytes(ZS_DTYPE_INT8_BLOCK, N));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(every_fp16_pattern_widens_exactly_and_narrows_back),
      cmocka_unit_test(every_bf16_pattern_widens_exactly_and_narrows_back),
      cmocka_unit_test(fp16_rounds_every_midpoint_to_even),
      cmocka_unit_test(bf16_rounds_every_midpoint_to_even),
      cmocka_unit_test(fp16_overflows_to_inf_at_65520),
      cmocka_unit_test(bf16_overflows_to_inf_above_its_largest_finite),
      cmocka_unit_test(fp16_underflows_to_rounded_subnormals_and_signed_zero),
      cmocka_unit_test(nan_stays_a_quiet_nan_with_sign_and_top_payload),
      cmocka_unit_test(random_fp32_patterns_round_like_the_reference),
      cmocka_unit_test(every_isa_widens_like_scalar_at_all_lengths_and_offsets),
      cmocka_unit_test(every_isa_narrows_like_scalar_at_all_lengths_and_offsets),
      cmocka_unit_test(every_isa_accumulates_like_scalar_at_all_lengths_and_offsets),
      cmocka_unit_test(the_first_two_contributions_commute_bit_for_bit),
      cmocka_unit_test(every_isa_matches_scalar_on_a_large_random_sweep),
      cmocka_unit_test(accumulate_adds_converted_values_in_place),
      cmocka_unit_test(public_array_functions_use_the_best_isa_with_the_same_bits),
      cmocka_unit_test(invalid_dtypes_are_rejected_and_convert_nothing),
      cmocka_unit_test(conversions_ignore_flush_to_zero_and_denormals_are_zero),
      cmocka_unit_test(every_table_entry_is_found_by_its_value_and_has_scalar_kernels),
      cmocka_unit_test(bytes_follow_the_block_formula_and_the_old_element_sizes),
      cmocka_unit_test(unknown_dtypes_are_refused_with_the_generated_list_of_names),
      cmocka_unit_test(every_table_entry_round_trips_and_every_isa_matches_scalar),
      cmocka_unit_test(int8_block_follows_its_specification_on_every_path),
      cmocka_unit_test(int8_block_ignores_flush_to_zero_and_denormals_are_zero),
  };
  return cmocka_run_group_tests(tests, setup_tables, NULL);
}
