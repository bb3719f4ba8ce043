/*
 * test_crc32c — CRC-32C (common/crc32c.h): the standard check value, the
 * hardware path against the table reference on every length and alignment,
 * and the chaining rule crc(a + b) == crc32c(crc32c(0, a), b).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/crc32c.h"

#define MAXLEN 300

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint8_t rng8(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint8_t)(rng_state >> 24);
}

/* CRC-32C computed bit by bit from the polynomial's definition, independent
 * of both implementations. */
static uint32_t crc_bitwise(const uint8_t *p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
  }
  return ~c;
}

static void check_value_of_123456789_is_e3069283(void **state) {
  (void)state;
  assert_int_equal(crc32c(0, "123456789", 9), 0xE3069283u);
  assert_int_equal(crc32c_sw(0, "123456789", 9), 0xE3069283u);
}

static void empty_input_leaves_the_crc_unchanged(void **state) {
  (void)state;
  assert_int_equal(crc32c(0, NULL, 0), 0);
  assert_int_equal(crc32c_sw(0, NULL, 0), 0);
  assert_int_equal(crc32c(0xdeadbeefu, "x", 0), 0xdeadbeefu);
}

static void known_vectors_from_rfc3720_match(void **state) {
  (void)state;
  /* iSCSI (RFC 3720, B.4): 32 bytes of zeros, of 0xff, and 0..31. */
  uint8_t buf[32];
  memset(buf, 0, sizeof buf);
  assert_int_equal(crc32c(0, buf, 32), 0x8A9136AAu);
  memset(buf, 0xff, sizeof buf);
  assert_int_equal(crc32c(0, buf, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; i++)
    buf[i] = (uint8_t)i;
  assert_int_equal(crc32c(0, buf, 32), 0x46DD794Eu);
}

static void hardware_matches_table_on_all_lengths_and_alignments(void **state) {
  (void)state;
  uint8_t buf[MAXLEN + 16];
  for (size_t i = 0; i < sizeof buf; i++)
    buf[i] = rng8();
  for (size_t off = 0; off < 16; off++) {
    for (size_t len = 0; len <= MAXLEN; len++) {
      uint32_t want = crc_bitwise(buf + off, len);
      uint32_t hw = crc32c(0, buf + off, len);
      uint32_t sw = crc32c_sw(0, buf + off, len);
      if (hw != want || sw != want)
        fail_msg("off %zu len %zu: hw 0x%08x sw 0x%08x bitwise 0x%08x", off, len, hw, sw, want);
    }
  }
}

static void crc_of_a_then_b_equals_crc_of_the_concatenation(void **state) {
  (void)state;
  uint8_t buf[MAXLEN];
  for (size_t len = 0; len <= MAXLEN; len++) {
    for (size_t i = 0; i < len; i++)
      buf[i] = rng8();
    uint32_t whole = crc32c(0, buf, len);
    for (size_t split = 0; split <= len; split++) {
      uint32_t hw = crc32c(crc32c(0, buf, split), buf + split, len - split);
      uint32_t sw = crc32c_sw(crc32c_sw(0, buf, split), buf + split, len - split);
      uint32_t mixed = crc32c_sw(crc32c(0, buf, split), buf + split, len - split);
      if (hw != whole || sw != whole || mixed != whole)
        fail_msg("len %zu split %zu: 0x%08x / 0x%08x / 0x%08x, whole 0x%08x", len, split, hw, sw,
                 mixed, whole);
    }
  }
}

static void a_single_flipped_bit_changes_the_crc(void **state) {
  (void)state;
  uint8_t buf[64];
  for (size_t i = 0; i < sizeof buf; i++)
    buf[i] = rng8();
  uint32_t base = crc32c(0, buf, sizeof buf);
  for (size_t bit = 0; bit < 8 * sizeof buf; bit++) {
    buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    assert_int_not_equal(crc32c(0, buf, sizeof buf), base);
    buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(check_value_of_123456789_is_e3069283),
      cmocka_unit_test(empty_input_leaves_the_crc_unchanged),
      cmocka_unit_test(known_vectors_from_rfc3720_match),
      cmocka_unit_test(hardware_matches_table_on_all_lengths_and_alignments),
      cmocka_unit_test(crc_of_a_then_b_equals_crc_of_the_concatenation),
      cmocka_unit_test(a_single_flipped_bit_changes_the_crc),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
