/*
 * pb_inplace — the gRPC transport's hand-written protobuf codec for the two
 * bulk messages, which protobuf-c would copy: a PushRequest is decoded in
 * place (its payload stays where gRPC received it) and a PullResponse is
 * encoded around a payload that the core writes straight into the message.
 *
 * The decoder reads untrusted bytes. tests/fuzz/fuzz_pb.c holds it to
 * protobuf-c's generated unpack of the same bytes: both accept or both reject,
 * and on accept every field agrees, except for the rejections listed under
 * pb_status, which protobuf-c accepts and this decoder refuses on purpose.
 *
 * Threads: every function is pure (no state), callable from any thread.
 */
#ifndef ZSHARD_SERVER_PB_INPLACE_H
#define ZSHARD_SERVER_PB_INPLACE_H

#include <stddef.h>
#include <stdint.h>

/* What pb_push_decode returns. Every non-zero value is a malformed request;
 * the two last name the inputs protobuf-c accepts but no honest encoder
 * produces, which the fuzzer's comparison allows. */
typedef enum pb_status {
  PB_OK = 0,
  /* Broken by the protobuf wire rules (truncated, a varint over 10 bytes, a
   * group, wire type 6 or 7, a known field with the wrong wire type); a tag
   * or a length over 5 bytes (both are varint32s). protobuf-c refuses all of
   * these. */
  PB_EMALFORMED = -1,
  /* A uint32 field (rank, micro, tensor, slice) holds a value over
   * UINT32_MAX. protobuf truncates it to its low 32 bits; we refuse it, so
   * that a request never names a rank or tensor other than the one its
   * bytes spell. */
  PB_ERANGE = -2,
  /* A field number of 0 or over 2^29-1 (the largest protobuf allows),
   * spelled in a tag of several bytes. protobuf-c skips it as an unknown
   * field; protobuf itself forbids these numbers, so we refuse them. */
  PB_EFIELD = -3,
} pb_status;

/* A zshard.v1.PushRequest decoded in place. */
typedef struct pb_push {
  uint64_t hash, step;
  uint32_t rank, micro, tensor, slice;
  int dtype; /* 0 when absent or not a zs_dtype value */
  /* The payload: points into the message given to pb_push_decode and lives
   * as long as those bytes do (NULL with len 0 when absent). No alignment is
   * promised. */
  const uint8_t *data;
  size_t len;
  uint64_t offset, total; /* a chunk of the payload when total > 0 */
} pb_push;

/* Decodes the n bytes at p (the caller's, only read; may be NULL when n is 0)
 * as a PushRequest into *r (the caller's, overwritten whole), by the protobuf
 * wire rules: fields in any order, the last occurrence of a field wins,
 * unknown fields skipped, an enum truncated to int32 as protobuf does. The
 * payload is not copied: r->data points into p. Returns PB_OK or a negative
 * pb_status, in which case *r holds nothing meaningful. */
pb_status pb_push_decode(const uint8_t *p, size_t n, pb_push *r);

/* A PullResponse is built in three steps in one buffer the caller owns:
 * pb_pull_cap bytes are enough for any version; pb_pull_head writes the dtype
 * and the data field's tag and length and returns where the nbytes of data
 * go; the caller writes them there; pb_pull_tail writes the version after
 * them (fields in any order are valid protobuf, and the version is known
 * only once the data is read) and returns the message's length. */
size_t pb_pull_cap(int dtype, size_t nbytes);
size_t pb_pull_head(uint8_t *p, int dtype, size_t nbytes);
size_t pb_pull_tail(uint8_t *p, size_t data_end, uint64_t version);

#endif
