/*
 * wire — frame encoding and decoding (see wire.h for the format).
 *
 * Everything here works on memory the caller hands in; the only allocations
 * are the reader's meta buffer and protobuf-c's unpacked message, freed before
 * each function returns.
 */
#include "common/net/wire.h"

#include <inttypes.h>
#include <protobuf-c/protobuf-c.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/le.h"
#include "common/base/status.h"
#include "zshard/v1/data.pb-c.h"

enum {
  R_HEAD = 0, /* collecting the 40 header bytes */
  R_META,     /* collecting meta_len bytes */
  R_WAIT_DST, /* META reported; waiting for wire_reader_set_payload */
  R_PAYLOAD,  /* receiving (or skipping) the payload */
  R_FATAL,
};

/* Header field offsets. */
#define OFF_MAGIC 0
#define OFF_VERSION 4
#define OFF_TYPE 5
#define OFF_FLAGS 6
#define OFF_REQUEST_ID 8
#define OFF_PAYLOAD_LEN 16
#define OFF_META_LEN 24
#define OFF_PAYLOAD_CRC 28
#define OFF_RESERVED 32
#define OFF_HEADER_CRC 36

/* No receiver bound may exceed this, so that 40 + meta + payload never
 * overflows a 64-bit size. */
#define WIRE_PAYLOAD_CEILING (UINT64_C(1) << 62)

/* Scratch for one wire_encode: the meta message of the frame's type and the
 * arrays a batch's meta points into (on the stack: a few KiB, no
 * allocation). */
typedef struct enc_box {
  char msg[WIRE_MAX_MESSAGE + 1];
  Zshard__V1__DataPiece pc[WIRE_MAX_BATCH];
  Zshard__V1__DataPiece *pcp[WIRE_MAX_BATCH];
  int32_t st[WIRE_MAX_BATCH];
  protobuf_c_boolean dup[WIRE_MAX_BATCH];
  uint64_t lens[WIRE_MAX_BATCH];
  union {
    Zshard__V1__DataPush push;
    Zshard__V1__DataPushAck ack;
    Zshard__V1__DataPull pull;
    Zshard__V1__DataPullData pd;
    Zshard__V1__DataError er;
    Zshard__V1__DataPushBatch pb;
    Zshard__V1__DataPushBatchAck pba;
    Zshard__V1__DataPullBatch qb;
    Zshard__V1__DataPullBatchData qbd;
    Zshard__V1__DataHello hello;
  } u;
} enc_box;

/* One meta decode: the frame and its meta, where the result goes, and what
 * the per-type decoders report back. */
typedef struct meta_dec {
  const wire_header *h;
  const uint8_t *meta;
  wire_msg *out;
  wire_batch *store; /* a batch's arrays; NULL: out of memory */
  int dtype;         /* the frame's dtype field, checked by decode_meta */
  const char *what;  /* set when the meta does not parse: the message's name */
  char *err;
  size_t errlen;
} meta_dec;

#define FRAME_CODEC(name)                                                                          \
  static const ProtobufCMessage *enc_##name(const wire_msg *m, enc_box *b);                        \
  static int dec_##name(meta_dec *d);
FRAME_CODEC(push)
FRAME_CODEC(push_ack)
FRAME_CODEC(pull)
FRAME_CODEC(pull_data)
FRAME_CODEC(error)
FRAME_CODEC(push_batch)
FRAME_CODEC(push_batch_ack)
FRAME_CODEC(pull_batch)
FRAME_CODEC(pull_batch_data)
FRAME_CODEC(hello)
#undef FRAME_CODEC
static uint32_t count_push_batch(const wire_msg *m);
static uint32_t count_push_batch_ack(const wire_msg *m);
static uint32_t count_pull_batch(const wire_msg *m);
static uint32_t count_pull_batch_data(const wire_msg *m);
static int ready_push_batch(const wire_msg *m);
static int ready_push_batch_ack(const wire_msg *m);
static int ready_pull_batch(const wire_msg *m);
static int ready_pull_batch_data(const wire_msg *m);
static int ready_hello(const wire_msg *m);

/* Everything a frame type is, one entry per type: a new frame is an entry,
 * its wire_msg member, its proto message and its encode and decode. */
typedef struct frame_type {
  const char *name;
  uint8_t version;     /* the protocol version that defined it, which its frames carry */
  uint8_t has_meta;    /* 0: meta_len must be 0 (PING, PONG, HELLO_ACK) */
  uint8_t has_payload; /* 0: payload_len must be 0 */
  uint8_t uses_store;  /* its decode keeps arrays in a wire_batch (the reader's) */
  /* A batch's piece count (1 .. WIRE_MAX_BATCH to be sent); NULL for the
   * types that are not batches. */
  uint32_t (*count)(const wire_msg *m);
  /* Whether the caller filled what encode reads beyond the count (arrays,
   * the token); NULL: nothing to check. */
  int (*ready)(const wire_msg *m);
  /* The meta message for m, built in b; NULL only for a type without meta. */
  const ProtobufCMessage *(*encode)(const wire_msg *m, enc_box *b);
  /* Unpacks the meta into d->out (a batch's arrays into d->store), sets
   * d->what when it does not parse and d->dtype when the type has a dtype
   * field; returns the status of the checks of its own fields. NULL: no
   * meta. */
  int (*decode)(meta_dec *d);
} frame_type;

static const frame_type k_types[] = {
    [WIRE_PUSH] = {"PUSH", 1, 1, 1, 0, NULL, NULL, enc_push, dec_push},
    [WIRE_PUSH_ACK] = {"PUSH_ACK", 1, 1, 0, 0, NULL, NULL, enc_push_ack, dec_push_ack},
    [WIRE_PULL] = {"PULL", 1, 1, 0, 0, NULL, NULL, enc_pull, dec_pull},
    [WIRE_PULL_DATA] = {"PULL_DATA", 1, 1, 1, 0, NULL, NULL, enc_pull_data, dec_pull_data},
    [WIRE_ERROR] = {"ERROR", 1, 1, 0, 0, NULL, NULL, enc_error, dec_error},
    [WIRE_PING] = {"PING", 1, 0, 0, 0, NULL, NULL, NULL, NULL},
    [WIRE_PONG] = {"PONG", 1, 0, 0, 0, NULL, NULL, NULL, NULL},
    [WIRE_PUSH_BATCH] = {"PUSH_BATCH", 2, 1, 1, 1, count_push_batch, ready_push_batch,
                         enc_push_batch, dec_push_batch},
    [WIRE_PUSH_BATCH_ACK] = {"PUSH_BATCH_ACK", 2, 1, 0, 1, count_push_batch_ack,
                             ready_push_batch_ack, enc_push_batch_ack, dec_push_batch_ack},
    [WIRE_PULL_BATCH] = {"PULL_BATCH", 2, 1, 0, 1, count_pull_batch, ready_pull_batch,
                         enc_pull_batch, dec_pull_batch},
    [WIRE_PULL_BATCH_DATA] = {"PULL_BATCH_DATA", 2, 1, 1, 1, count_pull_batch_data,
                              ready_pull_batch_data, enc_pull_batch_data, dec_pull_batch_data},
    [WIRE_HELLO] = {"HELLO", 3, 1, 0, 1, NULL, ready_hello, enc_hello, dec_hello},
    [WIRE_HELLO_ACK] = {"HELLO_ACK", 3, 0, 0, 0, NULL, NULL, NULL, NULL},
};

/* The entry of a known type, NULL for any other byte. */
static const frame_type *type_of(int type) {
  if (type < 0 || (size_t)type >= sizeof k_types / sizeof k_types[0] || !k_types[type].name)
    return NULL;
  return &k_types[type];
}

const char *wire_type_name(int type) {
  const frame_type *t = type_of(type);
  return t ? t->name : "UNKNOWN";
}

static uint32_t header_crc(const uint8_t *head, const uint8_t *meta, size_t meta_len) {
  uint32_t c = crc32c(0, head, OFF_HEADER_CRC);
  return meta_len ? crc32c(c, meta, meta_len) : c;
}

/* ------------------------------------------------------------------ encode */

/* The length of the longest prefix of s[0 .. n), at most max bytes, that does
 * not end inside a UTF-8 sequence (proto3 strings must be valid UTF-8 for
 * other implementations, Python's among them): a cut before a continuation
 * byte moves back to the start of its character. */
static size_t utf8_cut(const char *s, size_t n, size_t max) {
  if (n <= max)
    return n;
  n = max;
  while (n > 0 && ((unsigned char)s[n] & 0xC0u) == 0x80u)
    n--;
  return n;
}

/* A caller's message field, which it may not have terminated (never read
 * past its end), cut to WIRE_MAX_MESSAGE on a character boundary into b. */
static char *enc_message(enc_box *b, const char *src, size_t cap) {
  size_t n = utf8_cut(src, strnlen(src, cap), WIRE_MAX_MESSAGE);
  memcpy(b->msg, src, n);
  b->msg[n] = '\0';
  return b->msg;
}

/* A batch's pieces as the meta's DataPiece list, in b. */
static Zshard__V1__DataPiece **enc_pieces(enc_box *b, const wire_piece *src, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    b->pc[i] = (Zshard__V1__DataPiece)ZSHARD__V1__DATA_PIECE__INIT;
    b->pc[i].tensor = src[i].tensor;
    b->pc[i].slice = src[i].slice;
    b->pc[i].dtype = (Zshard__V1__DType)src[i].dtype;
    b->pc[i].length = src[i].length;
    b->pcp[i] = &b->pc[i];
  }
  return b->pcp;
}

static const ProtobufCMessage *enc_push(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPush *o = &b->u.push;
  *o = (Zshard__V1__DataPush)ZSHARD__V1__DATA_PUSH__INIT;
  o->spec_hash = m->u.push.spec_hash;
  o->step = m->u.push.step;
  o->rank = m->u.push.rank;
  o->micro = m->u.push.micro;
  o->tensor = m->u.push.tensor;
  o->slice = m->u.push.slice;
  o->dtype = (Zshard__V1__DType)m->u.push.dtype;
  return &o->base;
}

static const ProtobufCMessage *enc_push_ack(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPushAck *o = &b->u.ack;
  *o = (Zshard__V1__DataPushAck)ZSHARD__V1__DATA_PUSH_ACK__INIT;
  o->duplicate = m->u.push_ack.duplicate != 0;
  return &o->base;
}

static const ProtobufCMessage *enc_pull(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPull *o = &b->u.pull;
  *o = (Zshard__V1__DataPull)ZSHARD__V1__DATA_PULL__INIT;
  o->spec_hash = m->u.pull.spec_hash;
  o->tensor = m->u.pull.tensor;
  o->slice = m->u.pull.slice;
  o->min_version = m->u.pull.min_version;
  o->dtype = (Zshard__V1__DType)m->u.pull.dtype;
  o->timeout_ms = m->u.pull.timeout_ms;
  return &o->base;
}

static const ProtobufCMessage *enc_pull_data(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPullData *o = &b->u.pd;
  *o = (Zshard__V1__DataPullData)ZSHARD__V1__DATA_PULL_DATA__INIT;
  o->version = m->u.pull_data.version;
  o->dtype = (Zshard__V1__DType)m->u.pull_data.dtype;
  return &o->base;
}

static const ProtobufCMessage *enc_error(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataError *o = &b->u.er;
  *o = (Zshard__V1__DataError)ZSHARD__V1__DATA_ERROR__INIT;
  o->status = m->u.error.status;
  o->message = enc_message(b, m->u.error.message, sizeof m->u.error.message);
  return &o->base;
}

static uint32_t count_push_batch(const wire_msg *m) {
  return m->u.push_batch.npieces;
}

static int ready_push_batch(const wire_msg *m) {
  return m->u.push_batch.pieces != NULL;
}

static const ProtobufCMessage *enc_push_batch(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPushBatch *o = &b->u.pb;
  *o = (Zshard__V1__DataPushBatch)ZSHARD__V1__DATA_PUSH_BATCH__INIT;
  o->spec_hash = m->u.push_batch.spec_hash;
  o->step = m->u.push_batch.step;
  o->rank = m->u.push_batch.rank;
  o->micro = m->u.push_batch.micro;
  o->n_pieces = m->u.push_batch.npieces;
  o->pieces = enc_pieces(b, m->u.push_batch.pieces, m->u.push_batch.npieces);
  return &o->base;
}

static uint32_t count_push_batch_ack(const wire_msg *m) {
  return m->u.push_batch_ack.npieces;
}

static int ready_push_batch_ack(const wire_msg *m) {
  return m->u.push_batch_ack.status && m->u.push_batch_ack.duplicate;
}

static const ProtobufCMessage *enc_push_batch_ack(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPushBatchAck *o = &b->u.pba;
  *o = (Zshard__V1__DataPushBatchAck)ZSHARD__V1__DATA_PUSH_BATCH_ACK__INIT;
  uint32_t n = m->u.push_batch_ack.npieces;
  for (uint32_t i = 0; i < n; i++) {
    b->st[i] = m->u.push_batch_ack.status[i];
    b->dup[i] = m->u.push_batch_ack.duplicate[i] != 0;
  }
  o->n_status = n;
  o->status = b->st;
  o->n_duplicate = n;
  o->duplicate = b->dup;
  o->message = enc_message(b, m->u.push_batch_ack.message, sizeof m->u.push_batch_ack.message);
  return &o->base;
}

static uint32_t count_pull_batch(const wire_msg *m) {
  return m->u.pull_batch.npieces;
}

static int ready_pull_batch(const wire_msg *m) {
  return m->u.pull_batch.pieces != NULL;
}

static const ProtobufCMessage *enc_pull_batch(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPullBatch *o = &b->u.qb;
  *o = (Zshard__V1__DataPullBatch)ZSHARD__V1__DATA_PULL_BATCH__INIT;
  o->spec_hash = m->u.pull_batch.spec_hash;
  o->min_version = m->u.pull_batch.min_version;
  o->timeout_ms = m->u.pull_batch.timeout_ms;
  o->n_pieces = m->u.pull_batch.npieces;
  o->pieces = enc_pieces(b, m->u.pull_batch.pieces, m->u.pull_batch.npieces);
  return &o->base;
}

static uint32_t count_pull_batch_data(const wire_msg *m) {
  return m->u.pull_batch_data.npieces;
}

static int ready_pull_batch_data(const wire_msg *m) {
  return m->u.pull_batch_data.length != NULL;
}

static const ProtobufCMessage *enc_pull_batch_data(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPullBatchData *o = &b->u.qbd;
  *o = (Zshard__V1__DataPullBatchData)ZSHARD__V1__DATA_PULL_BATCH_DATA__INIT;
  uint32_t n = m->u.pull_batch_data.npieces;
  for (uint32_t i = 0; i < n; i++)
    b->lens[i] = m->u.pull_batch_data.length[i];
  o->version = m->u.pull_batch_data.version;
  o->n_length = n;
  o->length = b->lens;
  return &o->base;
}

static int ready_hello(const wire_msg *m) {
  return m->u.hello.token_len <= WIRE_MAX_TOKEN && (m->u.hello.token_len == 0 || m->u.hello.token);
}

static const ProtobufCMessage *enc_hello(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataHello *o = &b->u.hello;
  *o = (Zshard__V1__DataHello)ZSHARD__V1__DATA_HELLO__INIT;
  o->token.data = (uint8_t *)(uintptr_t)m->u.hello.token;
  o->token.len = m->u.hello.token_len;
  o->replica_term = m->u.hello.replica_term;
  return &o->base;
}

/* Whether wire_encode can frame `m`: a known type, a payload only where the
 * type has one, a batch's count, and what the type's `ready` checks. */
static int encodable(const wire_msg *m) {
  const frame_type *t = type_of((int)m->type);
  if (!t)
    return 0;
  if (!t->has_payload && m->payload_len != 0)
    return 0;
  if (t->count && (t->count(m) == 0 || t->count(m) > WIRE_MAX_BATCH))
    return 0;
  return !t->ready || t->ready(m);
}

int wire_encode(const wire_msg *m, uint8_t *out, size_t cap, size_t *len) {
  if (!m || !out || !len || !encodable(m))
    return ZS_EINVAL;
  const frame_type *t = type_of((int)m->type);
  enc_box box;
  const ProtobufCMessage *meta = t->encode ? t->encode(m, &box) : NULL;
  size_t mlen = meta ? protobuf_c_message_get_packed_size(meta) : 0;
  if (mlen > WIRE_MAX_META || cap < WIRE_HEADER_SIZE + mlen)
    return ZS_EINVAL;
  if (meta && protobuf_c_message_pack(meta, out + WIRE_HEADER_SIZE) != mlen)
    return ZS_EINVAL;
  le_store32(out + OFF_MAGIC, WIRE_MAGIC);
  out[OFF_VERSION] = t->version;
  out[OFF_TYPE] = (uint8_t)m->type;
  le_store16(out + OFF_FLAGS, 0);
  le_store64(out + OFF_REQUEST_ID, m->request_id);
  le_store64(out + OFF_PAYLOAD_LEN, m->payload_len);
  le_store32(out + OFF_META_LEN, (uint32_t)mlen);
  le_store32(out + OFF_PAYLOAD_CRC, m->payload_len ? m->payload_crc : 0);
  le_store32(out + OFF_RESERVED, 0);
  le_store32(out + OFF_HEADER_CRC, header_crc(out, out + WIRE_HEADER_SIZE, mlen));
  *len = WIRE_HEADER_SIZE + mlen;
  return 0;
}

/* ------------------------------------------------------------------ decode */

int wire_decode_header(const uint8_t in[WIRE_HEADER_SIZE], uint64_t max_payload, wire_header *h,
                       char *err, size_t errlen) {
  if (max_payload == 0)
    max_payload = WIRE_DEFAULT_MAX_PAYLOAD;
  if (max_payload > WIRE_PAYLOAD_CEILING)
    max_payload = WIRE_PAYLOAD_CEILING;
  uint32_t magic = le_load32(in + OFF_MAGIC);
  if (magic != WIRE_MAGIC)
    return status_fail(err, errlen, ZS_EPROTO,
                       "bad frame magic 0x%08" PRIx32 " (expected 0x%08" PRIx32
                       ", \"ZSDP\"): not a zshard data-plane stream",
                       magic, (uint32_t)WIRE_MAGIC);
  memset(h, 0, sizeof *h);
  h->version = in[OFF_VERSION];
  h->type = in[OFF_TYPE];
  h->flags = le_load16(in + OFF_FLAGS);
  h->request_id = le_load64(in + OFF_REQUEST_ID);
  h->payload_len = le_load64(in + OFF_PAYLOAD_LEN);
  h->meta_len = le_load32(in + OFF_META_LEN);
  h->payload_crc = le_load32(in + OFF_PAYLOAD_CRC);
  h->header_crc = le_load32(in + OFF_HEADER_CRC);
  uint32_t reserved = le_load32(in + OFF_RESERVED);
  if (h->version < WIRE_VERSION_MIN || h->version > WIRE_VERSION)
    return status_fail(err, errlen, ZS_EPROTO,
                       "unsupported frame version %u (this side speaks %u to %u)", h->version,
                       WIRE_VERSION_MIN, WIRE_VERSION);
  const frame_type *t = type_of(h->type);
  if (!t)
    return status_fail(err, errlen, ZS_EPROTO, "unknown frame type %u (request id %" PRIu64 ")",
                       h->type, h->request_id);
  if (h->version < t->version)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame (request id %" PRIu64
                       ") says version %u; the type needs version %u",
                       t->name, h->request_id, h->version, t->version);
  if (h->flags != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame has flags 0x%04x set; version 1 defines no flag",
                       wire_type_name(h->type), h->flags);
  if (reserved != 0)
    return status_fail(err, errlen, ZS_EPROTO, "%s frame has reserved field 0x%08" PRIx32 ", not 0",
                       wire_type_name(h->type), reserved);
  if (h->meta_len > WIRE_MAX_META)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s frame meta of %" PRIu32 " bytes exceeds the %u limit",
                       wire_type_name(h->type), h->meta_len, WIRE_MAX_META);
  if (h->payload_len > max_payload)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s frame payload of %" PRIu64
                       " bytes exceeds this side's limit of %" PRIu64,
                       wire_type_name(h->type), h->payload_len, max_payload);
  if (!t->has_payload && h->payload_len != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame carries a payload of %" PRIu64 " bytes; it has none",
                       wire_type_name(h->type), h->payload_len);
  if (!t->has_meta && h->meta_len != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame carries a meta of %" PRIu32 " bytes; it has none",
                       wire_type_name(h->type), h->meta_len);
  if (h->payload_len == 0 && h->payload_crc != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame without payload has payload CRC 0x%08" PRIx32 ", not 0",
                       wire_type_name(h->type), h->payload_crc);
  return 0;
}

int wire_check_header_crc(const wire_header *h, const uint8_t head[WIRE_HEADER_SIZE],
                          const uint8_t *meta, char *err, size_t errlen) {
  uint32_t c = header_crc(head, meta, h->meta_len);
  if (c != h->header_crc)
    return status_fail(err, errlen, ZS_ECRC,
                       "%s frame header CRC 0x%08" PRIx32 " does not match its bytes (0x%08" PRIx32
                       "): the header or meta is corrupt",
                       wire_type_name(h->type), h->header_crc, c);
  return 0;
}

/* Copies an untrusted string for logging and display: cut to the buffer,
 * control bytes shown as '?'. */
static void copy_message(char *dst, size_t cap, const char *src) {
  size_t n = 0;
  if (src)
    for (; src[n] && n + 1 < cap; n++)
      dst[n] = ((unsigned char)src[n] < 0x20u || src[n] == 0x7f) ? '?' : src[n];
  dst[n] = '\0';
}

/* Copies and checks the piece list of a batch request: a count within
 * 1 .. WIRE_MAX_BATCH, every dtype ours and, when `payload_len` is given, the
 * lengths adding up to it exactly (summed so that no overflow can hide a
 * mismatch). Returns 0 or the per-request error. */
static int take_pieces(const wire_header *h, size_t n, Zshard__V1__DataPiece *const *in,
                       wire_piece *out, uint32_t *nout, const uint64_t *payload_len, char *err,
                       size_t errlen) {
  if (!out)
    return status_fail(err, errlen, ZS_ENOMEM, "%s frame (request id %" PRIu64 "): out of memory",
                       wire_type_name(h->type), h->request_id);
  if (n == 0 || n > WIRE_MAX_BATCH)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s frame (request id %" PRIu64 ") has %zu pieces; a batch holds 1 to %u",
                       wire_type_name(h->type), h->request_id, n, WIRE_MAX_BATCH);
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i++) {
    out[i].tensor = in[i]->tensor;
    out[i].slice = in[i]->slice;
    out[i].dtype = (int)in[i]->dtype;
    out[i].length = in[i]->length;
    if (!dtype_valid(out[i].dtype))
      return status_fail(err, errlen, ZS_EDTYPE,
                         "%s frame (request id %" PRIu64 ") piece %zu has dtype %d, not %s",
                         wire_type_name(h->type), h->request_id, i, out[i].dtype, dtype_names());
    if (payload_len && out[i].length > *payload_len - sum)
      return status_fail(err, errlen, ZS_ERANGE,
                         "%s frame (request id %" PRIu64 ") piece %zu of %" PRIu64
                         " bytes runs past the %" PRIu64 "-byte payload",
                         wire_type_name(h->type), h->request_id, i, out[i].length, *payload_len);
    if (payload_len)
      sum += out[i].length;
  }
  if (payload_len && sum != *payload_len)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s frame (request id %" PRIu64 ") pieces add up to %" PRIu64
                       " bytes but the payload has %" PRIu64,
                       wire_type_name(h->type), h->request_id, sum, *payload_len);
  *nout = (uint32_t)n;
  return 0;
}

#define UNPACK(type, desc, h, meta)                                                                \
  ((type *)protobuf_c_message_unpack(&(desc), NULL, (h)->meta_len, (meta)))

/* The per-type decoders of k_types (see frame_type.decode). */

static int dec_push(meta_dec *d) {
  Zshard__V1__DataPush *p =
      UNPACK(Zshard__V1__DataPush, zshard__v1__data_push__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPush";
    return 0;
  }
  d->out->u.push = (wire_push){.spec_hash = p->spec_hash,
                               .step = p->step,
                               .rank = p->rank,
                               .micro = p->micro,
                               .tensor = p->tensor,
                               .slice = p->slice,
                               .dtype = (int)p->dtype};
  d->dtype = d->out->u.push.dtype;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return 0;
}

static int dec_push_ack(meta_dec *d) {
  Zshard__V1__DataPushAck *p =
      UNPACK(Zshard__V1__DataPushAck, zshard__v1__data_push_ack__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPushAck";
    return 0;
  }
  d->out->u.push_ack.duplicate = p->duplicate != 0;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return 0;
}

static int dec_pull(meta_dec *d) {
  Zshard__V1__DataPull *p =
      UNPACK(Zshard__V1__DataPull, zshard__v1__data_pull__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPull";
    return 0;
  }
  d->out->u.pull = (wire_pull){.spec_hash = p->spec_hash,
                               .min_version = p->min_version,
                               .tensor = p->tensor,
                               .slice = p->slice,
                               .timeout_ms = p->timeout_ms,
                               .dtype = (int)p->dtype};
  d->dtype = d->out->u.pull.dtype;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return 0;
}

static int dec_pull_data(meta_dec *d) {
  Zshard__V1__DataPullData *p =
      UNPACK(Zshard__V1__DataPullData, zshard__v1__data_pull_data__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPullData";
    return 0;
  }
  d->out->u.pull_data.version = p->version;
  d->out->u.pull_data.dtype = (int)p->dtype;
  d->dtype = d->out->u.pull_data.dtype;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return 0;
}

static int dec_error(meta_dec *d) {
  int rc = 0;
  Zshard__V1__DataError *p =
      UNPACK(Zshard__V1__DataError, zshard__v1__data_error__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataError";
    return 0;
  }
  d->out->u.error.status = p->status;
  copy_message(d->out->u.error.message, sizeof d->out->u.error.message, p->message);
  protobuf_c_message_free_unpacked(&p->base, NULL);
  if (d->out->u.error.status >= 0 || !status_valid(d->out->u.error.status))
    rc = status_fail(d->err, d->errlen, ZS_EPROTO,
                     "ERROR frame (request id %" PRIu64 ") carries status %d, not a zshard error",
                     d->h->request_id, d->out->u.error.status);
  return rc;
}

static int dec_push_batch(meta_dec *d) {
  int rc = 0;
  Zshard__V1__DataPushBatch *p =
      UNPACK(Zshard__V1__DataPushBatch, zshard__v1__data_push_batch__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPushBatch";
    return 0;
  }
  wire_push_batch *b = &d->out->u.push_batch;
  b->spec_hash = p->spec_hash;
  b->step = p->step;
  b->rank = p->rank;
  b->micro = p->micro;
  rc = take_pieces(d->h, p->n_pieces, p->pieces, d->store ? d->store->pieces : NULL, &b->npieces,
                   &d->h->payload_len, d->err, d->errlen);
  b->pieces = d->store ? d->store->pieces : NULL;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

static int dec_push_batch_ack(meta_dec *d) {
  int rc = 0;
  Zshard__V1__DataPushBatchAck *p = UNPACK(
      Zshard__V1__DataPushBatchAck, zshard__v1__data_push_batch_ack__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPushBatchAck";
    return 0;
  }
  wire_push_batch_ack *a = &d->out->u.push_batch_ack;
  copy_message(a->message, sizeof a->message, p->message);
  if (!d->store) {
    rc = status_fail(d->err, d->errlen, ZS_ENOMEM,
                     "PUSH_BATCH_ACK frame (request id %" PRIu64 "): out of memory",
                     d->h->request_id);
  } else if (p->n_status == 0 || p->n_status > WIRE_MAX_BATCH || p->n_duplicate != p->n_status) {
    rc = status_fail(d->err, d->errlen, ZS_ERANGE,
                     "PUSH_BATCH_ACK frame (request id %" PRIu64
                     ") has %zu statuses and %zu duplicate "
                     "flags; it needs one of each per piece, 1 to %u",
                     d->h->request_id, p->n_status, p->n_duplicate, WIRE_MAX_BATCH);
  } else {
    a->npieces = (uint32_t)p->n_status;
    a->status = d->store->status;
    a->duplicate = d->store->duplicate;
    for (size_t i = 0; i < p->n_status && rc == 0; i++) {
      d->store->status[i] = p->status[i];
      d->store->duplicate[i] = p->duplicate[i] != 0;
      if (p->status[i] > 0 || (p->status[i] < 0 && !status_valid(p->status[i])))
        rc = status_fail(d->err, d->errlen, ZS_EPROTO,
                         "PUSH_BATCH_ACK frame (request id %" PRIu64
                         ") piece %zu has status %d, not 0 "
                         "or a zshard error",
                         d->h->request_id, i, (int)p->status[i]);
    }
  }
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

static int dec_pull_batch(meta_dec *d) {
  int rc = 0;
  Zshard__V1__DataPullBatch *p =
      UNPACK(Zshard__V1__DataPullBatch, zshard__v1__data_pull_batch__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPullBatch";
    return 0;
  }
  wire_pull_batch *b = &d->out->u.pull_batch;
  b->spec_hash = p->spec_hash;
  b->min_version = p->min_version;
  b->timeout_ms = p->timeout_ms;
  rc = take_pieces(d->h, p->n_pieces, p->pieces, d->store ? d->store->pieces : NULL, &b->npieces,
                   NULL, d->err, d->errlen);
  b->pieces = d->store ? d->store->pieces : NULL;
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

static int dec_pull_batch_data(meta_dec *d) {
  int rc = 0;
  Zshard__V1__DataPullBatchData *p = UNPACK(
      Zshard__V1__DataPullBatchData, zshard__v1__data_pull_batch_data__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataPullBatchData";
    return 0;
  }
  wire_pull_batch_data *pd = &d->out->u.pull_batch_data;
  pd->version = p->version;
  if (!d->store) {
    rc = status_fail(d->err, d->errlen, ZS_ENOMEM,
                     "PULL_BATCH_DATA frame (request id %" PRIu64 "): out of memory",
                     d->h->request_id);
  } else if (p->n_length == 0 || p->n_length > WIRE_MAX_BATCH) {
    rc = status_fail(d->err, d->errlen, ZS_ERANGE,
                     "PULL_BATCH_DATA frame (request id %" PRIu64
                     ") has %zu pieces; a batch holds 1 "
                     "to %u",
                     d->h->request_id, p->n_length, WIRE_MAX_BATCH);
  } else {
    uint64_t sum = 0;
    pd->npieces = (uint32_t)p->n_length;
    pd->length = d->store->length;
    for (size_t i = 0; i < p->n_length && rc == 0; i++) {
      d->store->length[i] = p->length[i];
      if (p->length[i] > d->h->payload_len - sum)
        rc = status_fail(d->err, d->errlen, ZS_ERANGE,
                         "PULL_BATCH_DATA frame (request id %" PRIu64 ") piece %zu of %" PRIu64
                         " bytes runs past the %" PRIu64 "-byte payload",
                         d->h->request_id, i, p->length[i], d->h->payload_len);
      else
        sum += p->length[i];
    }
    if (rc == 0 && sum != d->h->payload_len)
      rc = status_fail(d->err, d->errlen, ZS_ERANGE,
                       "PULL_BATCH_DATA frame (request id %" PRIu64 ") pieces add up to %" PRIu64
                       " bytes but the payload has %" PRIu64,
                       d->h->request_id, sum, d->h->payload_len);
  }
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

static int dec_hello(meta_dec *d) {
  Zshard__V1__DataHello *p =
      UNPACK(Zshard__V1__DataHello, zshard__v1__data_hello__descriptor, d->h, d->meta);
  if (!p) {
    d->what = "zshard.v1.DataHello";
    return 0;
  }
  int rc = 0;
  wire_hello *o = &d->out->u.hello;
  if (!d->store) {
    rc = status_fail(d->err, d->errlen, ZS_ENOMEM, "HELLO frame: out of memory");
  } else if (p->token.len > WIRE_MAX_TOKEN) {
    rc = status_fail(d->err, d->errlen, ZS_ERANGE,
                     "HELLO frame token of %zu bytes exceeds the %u limit", p->token.len,
                     WIRE_MAX_TOKEN);
  } else {
    if (p->token.len)
      memcpy(d->store->token, p->token.data, p->token.len);
    o->token = d->store->token;
    o->token_len = (uint32_t)p->token.len;
    o->replica_term = p->replica_term;
  }
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

static int decode_meta(const wire_header *h, const uint8_t *meta, wire_msg *out, wire_batch *store,
                       char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  out->type = (wire_type)h->type;
  out->request_id = h->request_id;
  out->payload_len = h->payload_len;
  out->payload_crc = h->payload_crc;
  meta_dec d = {.h = h,
                .meta = meta,
                .out = out,
                .store = store,
                .dtype = ZS_DTYPE_FP32,
                .err = err,
                .errlen = errlen};
  const frame_type *t = type_of(h->type);
  int rc = t && t->decode ? t->decode(&d) : 0;
  if (d.what)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s frame (request id %" PRIu64 ") meta of %" PRIu32
                       " bytes is not a valid %s",
                       wire_type_name(h->type), h->request_id, h->meta_len, d.what);
  if (rc == 0 && !dtype_valid(d.dtype))
    rc = status_fail(err, errlen, ZS_EDTYPE,
                     "%s frame (request id %" PRIu64 ") has dtype %d, not %s",
                     wire_type_name(h->type), h->request_id, d.dtype, dtype_names());
  return rc;
}

/* The arrays of batches decoded outside a reader: one set per thread. */
static _Thread_local wire_batch tls_batch;

int wire_decode_meta(const wire_header *h, const uint8_t *meta, wire_msg *out, char *err,
                     size_t errlen) {
  return decode_meta(h, meta, out, &tls_batch, err, errlen);
}

int wire_decode_frame(const void *buf, size_t len, uint64_t max_payload, wire_msg *out,
                      const uint8_t **payload, size_t *frame_len, char *err, size_t errlen) {
  const uint8_t *p = buf;
  *frame_len = 0;
  *payload = NULL;
  if (len < WIRE_HEADER_SIZE)
    return status_fail(err, errlen, ZS_EPROTO, "truncated frame: %zu of the %u header bytes", len,
                       WIRE_HEADER_SIZE);
  wire_header h;
  int rc = wire_decode_header(p, max_payload, &h, err, errlen);
  if (rc)
    return rc;
  uint64_t total = WIRE_HEADER_SIZE + (uint64_t)h.meta_len + h.payload_len;
  *frame_len = (size_t)total;
  if (len < WIRE_HEADER_SIZE + (size_t)h.meta_len)
    return status_fail(err, errlen, ZS_EPROTO, "truncated %s frame: %zu of the %u meta bytes",
                       wire_type_name(h.type), len - WIRE_HEADER_SIZE, (unsigned)h.meta_len);
  const uint8_t *meta = p + WIRE_HEADER_SIZE;
  if ((rc = wire_check_header_crc(&h, p, meta, err, errlen)) != 0)
    return rc;
  if ((rc = wire_decode_meta(&h, meta, out, err, errlen)) != 0)
    return rc;
  if ((uint64_t)len < total)
    return status_fail(
        err, errlen, ZS_EPROTO, "truncated %s frame: %" PRIu64 " of the %" PRIu64 " payload bytes",
        wire_type_name(h.type), (uint64_t)len - WIRE_HEADER_SIZE - h.meta_len, h.payload_len);
  const uint8_t *pl = meta + h.meta_len;
  if (h.payload_len) {
    uint32_t c = crc32c(0, pl, (size_t)h.payload_len);
    if (c != h.payload_crc)
      return status_fail(err, errlen, ZS_ECRC,
                         "%s frame (request id %" PRIu64 ") payload CRC 0x%08" PRIx32
                         " does not match its %" PRIu64 " bytes (0x%08" PRIx32 ")",
                         wire_type_name(h.type), h.request_id, h.payload_crc, h.payload_len, c);
  }
  *payload = pl;
  return 0;
}

/* ------------------------------------------------------------------ reader */

void wire_reader_init(wire_reader *r, uint64_t max_payload) {
  memset(r, 0, sizeof *r);
  r->max_payload = max_payload ? max_payload : WIRE_DEFAULT_MAX_PAYLOAD;
  r->max_meta = WIRE_MAX_META;
  r->state = R_HEAD;
}

void wire_reader_limit_meta(wire_reader *r, uint32_t max_meta) {
  r->max_meta = max_meta < WIRE_MAX_META ? max_meta : WIRE_MAX_META;
}

void wire_reader_free(wire_reader *r) {
  free(r->meta);
  r->meta = NULL;
  free(r->batch);
  r->batch = NULL;
  r->meta_cap = 0;
  r->keep = 0;
  r->segs = NULL;
}

/* The segment being filled. */
static const wire_seg *cur_seg(const wire_reader *r) {
  return r->segs ? &r->segs[r->seg] : &r->one;
}

/* Moves past the segments that are full, zero-length ones included, so that
 * the current one has room whenever payload bytes are missing. */
static void seg_settle(wire_reader *r) {
  while (r->seg < r->nsegs && r->seg_have == cur_seg(r)->len) {
    r->seg++;
    r->seg_have = 0;
  }
}

/* Copies n payload bytes from p into the segments, across their boundaries
 * (n is at most what the payload still misses), and runs the CRC over them
 * in payload order. */
static void seg_put(wire_reader *r, const uint8_t *p, size_t n) {
  while (n > 0) {
    const wire_seg *s = cur_seg(r);
    size_t k = s->len - r->seg_have;
    if (k > n)
      k = n;
    memcpy((uint8_t *)s->base + r->seg_have, p, k);
    r->crc = crc32c(r->crc, p, k);
    r->seg_have += k;
    p += k;
    n -= k;
    seg_settle(r);
  }
}

static wire_event reader_fatal(wire_reader *r, int status) {
  r->state = R_FATAL;
  r->status = status;
  return WIRE_EV_FATAL;
}

/* The payload is complete: check its CRC and go back to the next header. */
static wire_event reader_finish(wire_reader *r) {
  r->payload_status = 0;
  if (r->keep && r->crc != r->h.payload_crc)
    r->payload_status = status_fail(r->err, sizeof r->err, ZS_ECRC,
                                    "%s frame (request id %" PRIu64 ") payload CRC 0x%08" PRIx32
                                    " does not match its %" PRIu64 " bytes (0x%08" PRIx32 ")",
                                    wire_type_name(r->h.type), r->h.request_id, r->h.payload_crc,
                                    r->h.payload_len, r->crc);
  r->keep = 0;
  r->segs = NULL;
  r->state = R_HEAD;
  r->head_have = 0;
  return WIRE_EV_DONE;
}

/* The meta is complete: check the header CRC and decode it. */
static wire_event reader_meta(wire_reader *r) {
  int rc = wire_check_header_crc(&r->h, r->head, r->meta, r->err, sizeof r->err);
  if (rc)
    return reader_fatal(r, rc);
  /* The header was checked: the type is known. */
  if (type_of(r->h.type)->uses_store && !r->batch)
    r->batch = malloc(sizeof *r->batch); /* NULL: decode_meta says out of memory */
  r->meta_status = decode_meta(&r->h, r->meta, &r->msg, r->batch, r->err, sizeof r->err);
  r->payload_status = 0;
  r->have = 0;
  r->crc = 0;
  r->keep = 0;
  r->segs = NULL;
  r->state = R_WAIT_DST;
  return WIRE_EV_META;
}

size_t wire_reader_feed(wire_reader *r, const void *in, size_t len, wire_event *ev) {
  /* An empty feed may come as NULL; offsets are never applied to NULL. */
  const uint8_t *p = in ? in : (const uint8_t *)"";
  if (!in)
    len = 0;
  size_t used = 0;
  for (;;) {
    switch (r->state) {
    case R_HEAD: {
      size_t take = WIRE_HEADER_SIZE - r->head_have;
      if (take > len - used)
        take = len - used;
      if (take)
        memcpy(r->head + r->head_have, p + used, take);
      r->head_have += take;
      used += take;
      if (r->head_have < WIRE_HEADER_SIZE) {
        *ev = WIRE_EV_NONE;
        return used;
      }
      int rc = wire_decode_header(r->head, r->max_payload, &r->h, r->err, sizeof r->err);
      if (rc) {
        *ev = reader_fatal(r, rc);
        return used;
      }
      if (r->h.meta_len > r->max_meta) {
        status_fail(r->err, sizeof r->err, ZS_ERANGE,
                    "%s frame meta of %" PRIu32 " bytes exceeds this side's limit of %" PRIu32
                    " for the connection's state",
                    wire_type_name(r->h.type), r->h.meta_len, r->max_meta);
        *ev = reader_fatal(r, ZS_ERANGE);
        return used;
      }
      if (r->h.meta_len > r->meta_cap) {
        /* Grow to a power of two so that a stream of slightly growing metas
         * does not reallocate every frame. */
        size_t cap = 256;
        while (cap < r->h.meta_len)
          cap *= 2;
        uint8_t *m = realloc(r->meta, cap);
        if (!m) {
          status_fail(r->err, sizeof r->err, ZS_ENOMEM, "out of memory for a %" PRIu32 "-byte meta",
                      r->h.meta_len);
          *ev = reader_fatal(r, ZS_ENOMEM);
          return used;
        }
        r->meta = m;
        r->meta_cap = cap;
      }
      r->meta_have = 0;
      r->state = R_META;
      break;
    }
    case R_META: {
      size_t take = r->h.meta_len - r->meta_have;
      if (take > len - used)
        take = len - used;
      if (take)
        memcpy(r->meta + r->meta_have, p + used, take);
      r->meta_have += take;
      used += take;
      if (r->meta_have < r->h.meta_len) {
        *ev = WIRE_EV_NONE;
        return used;
      }
      *ev = reader_meta(r);
      return used;
    }
    case R_WAIT_DST:
      /* Feeding on without saying where the payload goes is a caller bug;
       * refusing it loudly beats guessing. */
      status_fail(r->err, sizeof r->err, ZS_EINVAL,
                  "wire_reader_set_payload was not called after a META event");
      *ev = reader_fatal(r, ZS_EINVAL);
      return used;
    case R_PAYLOAD: {
      uint64_t left = r->h.payload_len - r->have;
      if (left == 0) {
        *ev = reader_finish(r);
        return used;
      }
      size_t take = len - used;
      if ((uint64_t)take > left)
        take = (size_t)left;
      if (take == 0) {
        *ev = WIRE_EV_NONE;
        return used;
      }
      /* The only copy of payload bytes made here: those that came through a
       * staging buffer (in the same read as their header, or into a segment
       * with too little room left for a direct read). */
      if (r->keep)
        seg_put(r, p + used, take);
      r->have += take;
      used += take;
      break;
    }
    default:
      *ev = WIRE_EV_FATAL;
      return used;
    }
  }
}

/* Starts receiving the payload into segs[0 .. nsegs) (NULL: into `one`), or
 * skipping it when nsegs is 0 or there is nothing to receive. */
static void payload_start(wire_reader *r, const wire_seg *segs, uint32_t nsegs) {
  r->keep = nsegs > 0 && r->h.payload_len > 0;
  r->segs = r->keep ? segs : NULL;
  r->nsegs = r->keep ? nsegs : 0;
  r->seg = 0;
  r->seg_have = 0;
  r->have = 0;
  r->crc = 0;
  r->state = R_PAYLOAD;
  seg_settle(r);
}

int wire_reader_set_payload(wire_reader *r, void *dst) {
  if (r->state != R_WAIT_DST || (dst && (r->meta_status != 0 || r->h.payload_len > SIZE_MAX)))
    return ZS_EINVAL;
  r->one = (wire_seg){.base = dst, .len = (size_t)r->h.payload_len};
  payload_start(r, NULL, dst ? 1 : 0);
  return 0;
}

int wire_reader_set_payload_segs(wire_reader *r, const wire_seg *segs, uint32_t nsegs) {
  if (r->state != R_WAIT_DST || r->meta_status != 0 || !segs || nsegs == 0 ||
      nsegs > WIRE_MAX_BATCH)
    return ZS_EINVAL;
  uint64_t sum = 0;
  for (uint32_t i = 0; i < nsegs; i++) {
    if ((segs[i].len && !segs[i].base) || (uint64_t)segs[i].len > r->h.payload_len - sum)
      return ZS_EINVAL;
    sum += segs[i].len;
  }
  if (sum != r->h.payload_len)
    return ZS_EINVAL;
  payload_start(r, segs, nsegs);
  return 0;
}

void *wire_reader_space(wire_reader *r, size_t *len) {
  *len = 0;
  if (r->state != R_PAYLOAD || !r->keep || r->have >= r->h.payload_len)
    return NULL;
  /* seg_settle keeps the current segment one with room while bytes are
   * missing. */
  const wire_seg *s = cur_seg(r);
  *len = s->len - r->seg_have;
  return (uint8_t *)s->base + r->seg_have;
}

void *wire_reader_read_buf(wire_reader *r, void *staging, size_t staging_len, size_t direct_min,
                           size_t chunk, size_t *len) {
  size_t space = 0;
  void *p = wire_reader_space(r, &space);
  if (p && space >= direct_min) {
    *len = space < chunk ? space : chunk;
    return p;
  }
  *len = staging_len;
  return staging;
}

wire_event wire_reader_commit(wire_reader *r, size_t n) {
  size_t room = 0;
  const uint8_t *at = wire_reader_space(r, &room);
  if (!at || n > room) {
    status_fail(r->err, sizeof r->err, ZS_EINVAL, "wire_reader_commit of %zu bytes out of range",
                n);
    return reader_fatal(r, ZS_EINVAL);
  }
  r->crc = crc32c(r->crc, at, n);
  r->have += n;
  r->seg_have += n;
  seg_settle(r);
  return r->have == r->h.payload_len ? reader_finish(r) : WIRE_EV_NONE;
}

void wire_reader_skip_rest(wire_reader *r) {
  if (r->state == R_PAYLOAD) {
    r->keep = 0;
    r->segs = NULL;
  }
}

int wire_reader_mid_frame(const wire_reader *r) {
  return r->state != R_HEAD || r->head_have > 0;
}

int wire_reader_eof(wire_reader *r) {
  switch (r->state) {
  case R_HEAD:
    if (r->head_have == 0)
      return 0;
    return status_fail(r->err, sizeof r->err, ZS_EPROTO,
                       "stream ended inside a frame header (%zu of %u bytes)", r->head_have,
                       WIRE_HEADER_SIZE);
  case R_META:
    return status_fail(r->err, sizeof r->err, ZS_EPROTO,
                       "stream ended inside the meta of a %s frame (request id %" PRIu64
                       ", %zu of %" PRIu32 " bytes)",
                       wire_type_name(r->h.type), r->h.request_id, r->meta_have, r->h.meta_len);
  case R_WAIT_DST:
  case R_PAYLOAD:
    return status_fail(r->err, sizeof r->err, ZS_EPROTO,
                       "stream ended inside the payload of a %s frame (request id %" PRIu64
                       ", %" PRIu64 " of %" PRIu64 " bytes)",
                       wire_type_name(r->h.type), r->h.request_id, r->have, r->h.payload_len);
  default:
    return r->status ? r->status : ZS_EPROTO;
  }
}
