/*
 * test_pb_inplace — the gRPC transport's in-place protobuf codec against
 * protobuf-c on the same bytes: a PushRequest decodes in place with every
 * field protobuf-c finds; fields come in any order and the last one wins;
 * a tag or a length longer than a varint32 is malformed, and an enum is
 * truncated to int32, as protobuf-c reads them (inputs found by
 * tests/fuzz/fuzz_pb, on which the decoder once disagreed with protobuf-c);
 * the two documented refusals (a uint32 over range, a forbidden field number)
 * are inputs protobuf-c accepts; a Pull answer reads back with protobuf-c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/transport/grpc/pb_inplace.h"
#include "zshard/types.h"
#include "zshard/v1/zshard.pb-c.h"

/* A message under construction. */
typedef struct msg {
  uint8_t b[512];
  size_t n;
} msg;

static void put(msg *m, const void *p, size_t n) {
  assert_true(m->n + n <= sizeof m->b);
  memcpy(m->b + m->n, p, n);
  m->n += n;
}

static void varint(msg *m, uint64_t v) {
  while (v >= 0x80) {
    uint8_t b = (uint8_t)(v | 0x80);
    put(m, &b, 1);
    v >>= 7;
  }
  uint8_t b = (uint8_t)v;
  put(m, &b, 1);
}

static void uint_field(msg *m, unsigned field, uint64_t v) {
  varint(m, (uint64_t)field << 3);
  varint(m, v);
}

static void bytes_field(msg *m, unsigned field, const void *p, size_t n) {
  varint(m, (uint64_t)field << 3 | 2);
  varint(m, n);
  put(m, p, n);
}

static void fixed64_field(msg *m, unsigned field, uint64_t v) {
  varint(m, (uint64_t)field << 3 | 1);
  uint8_t le[8];
  for (int i = 0; i < 8; i++)
    le[i] = (uint8_t)(v >> (8 * i));
  put(m, le, 8);
}

static Zshard__V1__PushRequest *unpack(const msg *m) {
  return (Zshard__V1__PushRequest *)protobuf_c_message_unpack(&zshard__v1__push_request__descriptor,
                                                              NULL, m->n, m->b);
}

/* Decodes m both ways and asserts they agree field for field. */
static void assert_agree(const msg *m, pb_push *r) {
  Zshard__V1__PushRequest *p = unpack(m);
  assert_non_null(p);
  assert_int_equal(pb_push_decode(m->b, m->n, r), PB_OK);
  assert_true(r->hash == p->spec_hash && r->step == p->step && r->rank == p->rank);
  assert_true(r->micro == p->micro && r->tensor == p->tensor && r->slice == p->slice);
  assert_true(r->offset == p->offset && r->total == p->total);
  assert_int_equal(r->len, p->data.len);
  if (r->len)
    assert_memory_equal(r->data, p->data.data, r->len);
  protobuf_c_message_free_unpacked(&p->base, NULL);
}

static void a_request_decodes_in_place_with_every_field(void **state) {
  (void)state;
  const uint8_t payload[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  msg m = {.n = 0};
  fixed64_field(&m, 1, 0x1234567890abcdefu);
  uint_field(&m, 2, 7);
  uint_field(&m, 3, 1);
  uint_field(&m, 4, 2);
  uint_field(&m, 5, 3);
  uint_field(&m, 6, 4);
  uint_field(&m, 7, ZS_DTYPE_FP32);
  size_t at = m.n + 2; /* the payload follows a one-byte tag and length */
  bytes_field(&m, 8, payload, sizeof payload);
  uint_field(&m, 9, 64);
  uint_field(&m, 10, 76);
  pb_push r;
  assert_agree(&m, &r);
  assert_int_equal(r.dtype, ZS_DTYPE_FP32);
  assert_ptr_equal(r.data, m.b + at); /* not a copy */
  assert_int_equal(r.hash, 0x1234567890abcdefu);
  assert_int_equal(r.slice, 4);
  assert_int_equal(r.total, 76);
}

static void fields_come_in_any_order_and_the_last_wins(void **state) {
  (void)state;
  msg m = {.n = 0};
  bytes_field(&m, 8, "first", 5);
  uint_field(&m, 3, 9);
  uint_field(&m, 11, 5);       /* unknown: skipped */
  bytes_field(&m, 12, "x", 1); /* unknown: skipped */
  uint_field(&m, 3, 2);
  bytes_field(&m, 8, "last", 4);
  fixed64_field(&m, 1, 1);
  pb_push r;
  assert_agree(&m, &r);
  assert_int_equal(r.rank, 2);
  assert_int_equal(r.len, 4);
  assert_memory_equal(r.data, "last", 4);
  assert_int_equal(pb_push_decode(NULL, 0, &r), PB_OK); /* the empty message */
}

static void a_tag_or_length_longer_than_a_varint32_is_malformed(void **state) {
  (void)state;
  /* Field 3 as a six-byte tag: a valid varint, but protobuf-c reads a tag in
   * five bytes at most. */
  const uint8_t long_tag[] = {0x98, 0x80, 0x80, 0x80, 0x80, 0x00, 0x01};
  /* Field 8 with its length, 1, spelled in six bytes. */
  const uint8_t long_len[] = {0x42, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00, 0xaa};
  msg a = {.n = 0}, b = {.n = 0};
  put(&a, long_tag, sizeof long_tag);
  put(&b, long_len, sizeof long_len);
  pb_push r;
  assert_null(unpack(&a));
  assert_int_equal(pb_push_decode(a.b, a.n, &r), PB_EMALFORMED);
  assert_null(unpack(&b));
  assert_int_equal(pb_push_decode(b.b, b.n, &r), PB_EMALFORMED);
  /* The same field in a five-byte tag is read by both. */
  const uint8_t five[] = {0x98, 0x80, 0x80, 0x80, 0x00, 0x01};
  msg c = {.n = 0};
  put(&c, five, sizeof five);
  assert_agree(&c, &r);
  assert_int_equal(r.rank, 1);
}

static void a_dtype_is_truncated_to_int32_as_protobuf_does(void **state) {
  (void)state;
  msg m = {.n = 0};
  uint_field(&m, 7, (UINT64_C(1) << 32) | ZS_DTYPE_FP32);
  pb_push r;
  assert_agree(&m, &r);
  assert_int_equal(r.dtype, ZS_DTYPE_FP32);
  msg neg = {.n = 0};
  uint_field(&neg, 7, UINT64_MAX); /* -1: not a dtype */
  assert_agree(&neg, &r);
  assert_int_equal(r.dtype, 0);
}

static void the_documented_refusals_are_inputs_protobuf_c_accepts(void **state) {
  (void)state;
  pb_push r;
  msg big = {.n = 0};
  uint_field(&big, 5, UINT64_C(1) << 32); /* a tensor id protobuf would read as 0 */
  Zshard__V1__PushRequest *p = unpack(&big);
  assert_non_null(p);
  assert_int_equal(p->tensor, 0);
  protobuf_c_message_free_unpacked(&p->base, NULL);
  assert_int_equal(pb_push_decode(big.b, big.n, &r), PB_ERANGE);

  const uint8_t field0[] = {0x80, 0x00, 0x01};                      /* field 0 in a two-byte tag */
  const uint8_t field_max[] = {0xf8, 0xff, 0xff, 0xff, 0x1f, 0x01}; /* field 2^30-1 */
  msg a = {.n = 0}, b = {.n = 0};
  put(&a, field0, sizeof field0);
  put(&b, field_max, sizeof field_max);
  for (msg *m = &a; m; m = m == &a ? &b : NULL) {
    p = unpack(m);
    assert_non_null(p);
    protobuf_c_message_free_unpacked(&p->base, NULL);
    assert_int_equal(pb_push_decode(m->b, m->n, &r), PB_EFIELD);
  }
}

static void broken_wire_rules_are_malformed_for_both(void **state) {
  (void)state;
  pb_push r;
  const uint8_t cases[][4] = {
      {0x18, 0x80, 0, 0}, /* a varint cut short (length 2) */
      {0x19, 1, 2, 3},    /* rank as a fixed64 */
      {0x0b, 0x0c, 0, 0}, /* a group (length 2) */
      {0x42, 0x05, 1, 2}, /* data longer than the message */
      {0x0e, 0, 0, 0},    /* wire type 6 (length 1) */
      {0x00, 0x01, 0, 0}, /* field 0 in a one-byte tag (length 2) */
  };
  const size_t lens[] = {2, 4, 2, 4, 1, 2};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    msg m = {.n = 0};
    put(&m, cases[i], lens[i]);
    assert_null(unpack(&m));
    assert_int_not_equal(pb_push_decode(m.b, m.n, &r), PB_OK);
  }
}

static void a_pull_answer_reads_back_with_protobuf_c(void **state) {
  (void)state;
  uint8_t data[300];
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)i;
  size_t cap = pb_pull_cap(ZS_DTYPE_BF16, sizeof data);
  uint8_t *buf = malloc(cap);
  assert_non_null(buf);
  size_t off = pb_pull_head(buf, ZS_DTYPE_BF16, sizeof data);
  memcpy(buf + off, data, sizeof data);
  size_t n = pb_pull_tail(buf, off + sizeof data, UINT64_MAX);
  assert_true(n <= cap);
  Zshard__V1__PullResponse *p = (Zshard__V1__PullResponse *)protobuf_c_message_unpack(
      &zshard__v1__pull_response__descriptor, NULL, n, buf);
  assert_non_null(p);
  assert_true(p->version == UINT64_MAX);
  assert_int_equal(p->dtype, ZS_DTYPE_BF16);
  assert_int_equal(p->data.len, sizeof data);
  assert_memory_equal(p->data.data, data, sizeof data);
  protobuf_c_message_free_unpacked(&p->base, NULL);
  free(buf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_request_decodes_in_place_with_every_field),
      cmocka_unit_test(fields_come_in_any_order_and_the_last_wins),
      cmocka_unit_test(a_tag_or_length_longer_than_a_varint32_is_malformed),
      cmocka_unit_test(a_dtype_is_truncated_to_int32_as_protobuf_does),
      cmocka_unit_test(the_documented_refusals_are_inputs_protobuf_c_accepts),
      cmocka_unit_test(broken_wire_rules_are_malformed_for_both),
      cmocka_unit_test(a_pull_answer_reads_back_with_protobuf_c),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
