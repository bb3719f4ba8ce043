/*
 * pb_inplace — the in-place PushRequest decoder and the PullResponse encoder
 * (pb_inplace.h). Field numbers and types follow proto/zshard/v1/zshard.proto.
 */
#include "server/transport/grpc/pb_inplace.h"

#include <string.h>

#include "common/base/dtype.h"
#include "common/base/le.h"

/* The largest field number protobuf allows. */
#define PB_MAX_FIELD 536870911u

enum { WIRE_VARINT = 0, WIRE_I64 = 1, WIRE_LEN = 2, WIRE_I32 = 5 };

/* Reads a varint of at most max_bytes bytes; the bits past 64 of a tenth
 * byte are dropped, as protobuf does. */
static int read_varint(const uint8_t **p, const uint8_t *end, unsigned max_bytes, uint64_t *v) {
  uint64_t x = 0;
  for (unsigned i = 0; i < max_bytes; i++) {
    if (*p == end)
      return -1;
    uint8_t b = *(*p)++;
    x |= (uint64_t)(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      *v = x;
      return 0;
    }
  }
  return -1;
}

/* One field's value: v for the scalar wire types, v bytes at `bytes` for a
 * length-delimited one. Advances *p past it. */
static pb_status read_value(const uint8_t **p, const uint8_t *end, unsigned wire, uint64_t *v,
                            const uint8_t **bytes) {
  switch (wire) {
  case WIRE_VARINT:
    return read_varint(p, end, 10, v) ? PB_EMALFORMED : PB_OK;
  case WIRE_I64:
    if (end - *p < 8)
      return PB_EMALFORMED;
    *v = le_load64(*p);
    *p += 8;
    return PB_OK;
  case WIRE_LEN:
    /* A length is a varint32 too (protobuf messages stay under 2 GiB). */
    if (read_varint(p, end, 5, v) || *v > (uint64_t)(end - *p))
      return PB_EMALFORMED;
    *bytes = *p;
    *p += *v;
    return PB_OK;
  case WIRE_I32:
    if (end - *p < 4)
      return PB_EMALFORMED;
    *v = le_load32(*p);
    *p += 4;
    return PB_OK;
  default: /* groups (3, 4) are not proto3; 6 and 7 do not exist */
    return PB_EMALFORMED;
  }
}

/* Stores one known field of a PushRequest; unknown ones are skipped. */
static pb_status push_field(pb_push *r, uint64_t field, unsigned wire, uint64_t v,
                            const uint8_t *bytes) {
  switch (field) {
  case 1:
    if (wire != WIRE_I64)
      return PB_EMALFORMED;
    r->hash = v;
    return PB_OK;
  case 2:
  case 9:
  case 10:
    if (wire != WIRE_VARINT)
      return PB_EMALFORMED;
    *(field == 2 ? &r->step : field == 9 ? &r->offset : &r->total) = v;
    return PB_OK;
  case 3:
  case 4:
  case 5:
  case 6:
    if (wire != WIRE_VARINT)
      return PB_EMALFORMED;
    if (v > UINT32_MAX)
      return PB_ERANGE;
    *(field == 3   ? &r->rank
      : field == 4 ? &r->micro
      : field == 5 ? &r->tensor
                   : &r->slice) = (uint32_t)v;
    return PB_OK;
  case 7:
    if (wire != WIRE_VARINT)
      return PB_EMALFORMED;
    /* An enum is an int32 on the wire, truncated from the varint as protobuf
     * does; anything outside our values is kept as 0 and refused as an
     * unknown dtype by the caller. */
    r->dtype = dtype_from_varint((uint32_t)v);
    return PB_OK;
  case 8:
    if (wire != WIRE_LEN)
      return PB_EMALFORMED;
    r->data = bytes;
    r->len = (size_t)v;
    return PB_OK;
  default:
    return PB_OK;
  }
}

pb_status pb_push_decode(const uint8_t *p, size_t n, pb_push *r) {
  memset(r, 0, sizeof *r);
  if (n == 0)
    return PB_OK;
  const uint8_t *end = p + n;
  while (p < end) {
    uint64_t key, v = 0;
    const uint8_t *bytes = NULL;
    /* A tag is a varint32: five bytes at most. */
    if (read_varint(&p, end, 5, &key))
      return PB_EMALFORMED;
    unsigned wire = (unsigned)(key & 7);
    uint64_t field = key >> 3;
    /* The wire type is checked first: protobuf-c refuses a bad one whatever
     * the field number, and so the two agree on which error an input has. */
    pb_status rc = read_value(&p, end, wire, &v, &bytes);
    if (rc)
      return rc;
    if (field == 0 || field > PB_MAX_FIELD)
      return PB_EFIELD;
    rc = push_field(r, field, wire, v, bytes);
    if (rc)
      return rc;
  }
  return PB_OK;
}

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

static size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

/* Two one-byte tags, the dtype, the data's length, the data, a one-byte tag
 * and a version of at most 10 bytes. */
size_t pb_pull_cap(int dtype, size_t nbytes) {
  return 2 + varint_len((uint64_t)dtype) + varint_len(nbytes) + nbytes + 1 + 10;
}

size_t pb_pull_head(uint8_t *p, int dtype, size_t nbytes) {
  size_t off = 0;
  p[off++] = (2 << 3) | WIRE_VARINT;
  off += put_varint(p + off, (uint64_t)dtype);
  p[off++] = (3 << 3) | WIRE_LEN;
  off += put_varint(p + off, nbytes);
  return off;
}

size_t pb_pull_tail(uint8_t *p, size_t data_end, uint64_t version) {
  size_t off = data_end;
  p[off++] = (1 << 3) | WIRE_VARINT;
  off += put_varint(p + off, version);
  return off;
}
