/*
 * test_le — the little-endian loads and stores of common/base/le.h: the byte order
 * of each width, any alignment, the n-byte forms and doubles bit for bit.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/le.h"

static void stores_put_the_least_significant_byte_first(void **state) {
  (void)state;
  uint8_t b[8];
  le_store16(b, 0x0102);
  assert_memory_equal(b, "\x02\x01", 2);
  le_store32(b, 0x01020304u);
  assert_memory_equal(b, "\x04\x03\x02\x01", 4);
  le_store64(b, UINT64_C(0x0102030405060708));
  assert_memory_equal(b, "\x08\x07\x06\x05\x04\x03\x02\x01", 8);
}

static void loads_read_the_least_significant_byte_first(void **state) {
  (void)state;
  const uint8_t b[8] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0xf1};
  assert_int_equal(le_load16(b), 0x0708);
  assert_int_equal(le_load32(b), 0x05060708u);
  assert_true(le_load64(b) == UINT64_C(0xf102030405060708));
  /* The top bit of each width is a value bit, not a sign. */
  const uint8_t top[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  assert_int_equal(le_load16(top), 0xffff);
  assert_int_equal(le_load32(top), 0xffffffffu);
  assert_true(le_load64(top) == UINT64_MAX);
}

static void every_width_round_trips_at_every_alignment(void **state) {
  (void)state;
  uint8_t buf[16 + 8];
  uint64_t x = UINT64_C(0x9e3779b97f4a7c15);
  for (size_t off = 0; off < 16; off++) {
    x = x * UINT64_C(6364136223846793005) + 1442695040888963407u;
    memset(buf, 0xaa, sizeof buf);
    le_store16(buf + off, (uint16_t)x);
    assert_int_equal(le_load16(buf + off), (uint16_t)x);
    assert_int_equal(buf[off + 2], 0xaa); /* writes exactly its bytes */
    le_store32(buf + off, (uint32_t)x);
    assert_int_equal(le_load32(buf + off), (uint32_t)x);
    assert_int_equal(buf[off + 4], 0xaa);
    le_store64(buf + off, x);
    assert_true(le_load64(buf + off) == x);
    if (off > 0)
      assert_int_equal(buf[off - 1], 0xaa);
  }
}

static void n_byte_forms_agree_with_the_fixed_widths(void **state) {
  (void)state;
  uint8_t a[8], b[8];
  const uint64_t v = UINT64_C(0x1122334455667788);
  le_store(a, v, 4);
  le_store32(b, (uint32_t)v);
  assert_memory_equal(a, b, 4);
  le_store(a, v, 8);
  le_store64(b, v);
  assert_memory_equal(a, b, 8);
  assert_true(le_load(a, 8) == v);
  assert_true(le_load(a, 4) == (uint32_t)v);
  assert_true(le_load(a, 3) == (v & 0xffffffu));
  assert_true(le_load(a, 0) == 0);
}

static void doubles_keep_every_bit(void **state) {
  (void)state;
  uint8_t b[8];
  le_store_f64(b, 1.0);
  assert_memory_equal(b, "\0\0\0\0\0\0\xf0\x3f", 8);
  le_store_f64(b, -0.0);
  assert_memory_equal(b, "\0\0\0\0\0\0\0\x80", 8);
  double z = le_load_f64(b);
  assert_true(z == 0.0 && signbit(z));
  const double vals[] = {0.1, -1e-300, 1e308, INFINITY, 5e-324};
  for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
    le_store_f64(b, vals[i]);
    double back = le_load_f64(b);
    assert_memory_equal(&back, &vals[i], sizeof back);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(stores_put_the_least_significant_byte_first),
      cmocka_unit_test(loads_read_the_least_significant_byte_first),
      cmocka_unit_test(every_width_round_trips_at_every_alignment),
      cmocka_unit_test(n_byte_forms_agree_with_the_fixed_widths),
      cmocka_unit_test(doubles_keep_every_bit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
