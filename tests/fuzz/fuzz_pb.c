/*
 * fuzz_pb — libFuzzer target for the gRPC transport's in-place protobuf codec
 * (server/transport/grpc/pb_inplace.h), which decodes every Push request
 * straight from the network.
 *
 * Each input is one PushRequest message. It is decoded twice, by
 * pb_push_decode and by protobuf-c's generated unpack, and the two must agree
 * (a differential oracle, beside ASan and UBSan):
 *  - pb_push_decode accepts: protobuf-c accepts, and every field is equal:
 *    the scalars; the dtype as protobuf-c's int32 when it is a zs_dtype value
 *    and 0 otherwise; the payload's length and bytes, pb_push's pointing into
 *    the input where protobuf-c's is a copy. (PushRequest has no repeated
 *    field; a repeated field protobuf-c would meet here is an unknown one,
 *    which both skip.)
 *  - pb_push_decode refuses PB_EMALFORMED: protobuf-c refuses too.
 *  - pb_push_decode refuses PB_ERANGE or PB_EFIELD: protobuf-c may accept.
 *    These are the two differences the header documents: a uint32 field over
 *    UINT32_MAX (protobuf truncates it; we refuse a rank or tensor the bytes
 *    do not spell) and a field number of 0 or over 2^29-1 in a multi-byte
 *    tag (protobuf-c skips it as unknown; protobuf forbids the number).
 *    Both are stricter, never looser, so a request the server takes is one
 *    protobuf-c reads the same.
 * An accepted request is then answered as a Pull would be (its dtype, its
 * payload, its step as the version) with pb_pull_*, and protobuf-c must read
 * that answer back field for field.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/dtype.h"
#include "server/transport/grpc/pb_inplace.h"
#include "zshard/v1/zshard.pb-c.h"

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      __builtin_trap();                                                                            \
  } while (0)

static void check_same_push(const pb_push *r, const Zshard__V1__PushRequest *m, const uint8_t *in,
                            size_t size) {
  CHECK(r->hash == m->spec_hash);
  CHECK(r->step == m->step);
  CHECK(r->rank == m->rank);
  CHECK(r->micro == m->micro);
  CHECK(r->tensor == m->tensor);
  CHECK(r->slice == m->slice);
  CHECK(r->dtype == (dtype_valid((int)m->dtype) ? (int)m->dtype : 0));
  CHECK(r->offset == m->offset);
  CHECK(r->total == m->total);
  CHECK(r->len == m->data.len);
  if (r->data) /* in place: inside the input, never a copy */
    CHECK(r->data >= in && r->len <= (size_t)(in + size - r->data));
  else
    CHECK(r->len == 0);
  if (r->len)
    CHECK(memcmp(r->data, m->data.data, r->len) == 0);
}

/* The Pull answer to r, built as gsrv__pull_build (grpc_step.c) builds it. */
static void check_pull_answer(const pb_push *r) {
  size_t cap = pb_pull_cap(r->dtype, r->len);
  uint8_t *buf = malloc(cap);
  CHECK(buf);
  size_t off = pb_pull_head(buf, r->dtype, r->len);
  if (r->len)
    memcpy(buf + off, r->data, r->len);
  size_t n = pb_pull_tail(buf, off + r->len, r->step);
  CHECK(n <= cap);
  Zshard__V1__PullResponse *m = (Zshard__V1__PullResponse *)protobuf_c_message_unpack(
      &zshard__v1__pull_response__descriptor, NULL, n, buf);
  CHECK(m);
  CHECK(m->version == r->step);
  CHECK((int)m->dtype == r->dtype);
  CHECK(m->data.len == r->len);
  if (r->len)
    CHECK(memcmp(m->data.data, r->data, r->len) == 0);
  protobuf_c_message_free_unpacked(&m->base, NULL);
  free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  pb_push r;
  pb_status st = pb_push_decode(data, size, &r);
  Zshard__V1__PushRequest *m = (Zshard__V1__PushRequest *)protobuf_c_message_unpack(
      &zshard__v1__push_request__descriptor, NULL, size, data);
  if (st == PB_OK) {
    CHECK(m);
    check_same_push(&r, m, data, size);
    check_pull_answer(&r);
  } else if (st == PB_EMALFORMED) {
    CHECK(!m);
  } else {
    CHECK(st == PB_ERANGE || st == PB_EFIELD);
  }
  if (m)
    protobuf_c_message_free_unpacked(&m->base, NULL);
  return 0;
}
