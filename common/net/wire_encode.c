/*
 * wire_encode — a wire_msg to a frame's header and meta (the payload is the
 * caller's, written after them). The meta is built on the stack (enc_box)
 * and packed straight into the caller's buffer: no allocation.
 */
#include <string.h>

#include "common/base/le.h"
#include "common/base/status.h"
#include "common/net/wire.h"
#include "common/net/wire_internal.h"

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

const ProtobufCMessage *wire__enc_push(const wire_msg *m, enc_box *b) {
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

const ProtobufCMessage *wire__enc_push_ack(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPushAck *o = &b->u.ack;
  *o = (Zshard__V1__DataPushAck)ZSHARD__V1__DATA_PUSH_ACK__INIT;
  o->duplicate = m->u.push_ack.duplicate != 0;
  return &o->base;
}

const ProtobufCMessage *wire__enc_pull(const wire_msg *m, enc_box *b) {
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

const ProtobufCMessage *wire__enc_pull_data(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPullData *o = &b->u.pd;
  *o = (Zshard__V1__DataPullData)ZSHARD__V1__DATA_PULL_DATA__INIT;
  o->version = m->u.pull_data.version;
  o->dtype = (Zshard__V1__DType)m->u.pull_data.dtype;
  return &o->base;
}

const ProtobufCMessage *wire__enc_error(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataError *o = &b->u.er;
  *o = (Zshard__V1__DataError)ZSHARD__V1__DATA_ERROR__INIT;
  o->status = m->u.error.status;
  o->message = enc_message(b, m->u.error.message, sizeof m->u.error.message);
  return &o->base;
}

uint32_t wire__count_push_batch(const wire_msg *m) {
  return m->u.push_batch.npieces;
}

int wire__ready_push_batch(const wire_msg *m) {
  return m->u.push_batch.pieces != NULL;
}

const ProtobufCMessage *wire__enc_push_batch(const wire_msg *m, enc_box *b) {
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

uint32_t wire__count_push_batch_ack(const wire_msg *m) {
  return m->u.push_batch_ack.npieces;
}

int wire__ready_push_batch_ack(const wire_msg *m) {
  return m->u.push_batch_ack.status && m->u.push_batch_ack.duplicate;
}

const ProtobufCMessage *wire__enc_push_batch_ack(const wire_msg *m, enc_box *b) {
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

uint32_t wire__count_pull_batch(const wire_msg *m) {
  return m->u.pull_batch.npieces;
}

int wire__ready_pull_batch(const wire_msg *m) {
  return m->u.pull_batch.pieces != NULL;
}

const ProtobufCMessage *wire__enc_pull_batch(const wire_msg *m, enc_box *b) {
  Zshard__V1__DataPullBatch *o = &b->u.qb;
  *o = (Zshard__V1__DataPullBatch)ZSHARD__V1__DATA_PULL_BATCH__INIT;
  o->spec_hash = m->u.pull_batch.spec_hash;
  o->min_version = m->u.pull_batch.min_version;
  o->timeout_ms = m->u.pull_batch.timeout_ms;
  o->n_pieces = m->u.pull_batch.npieces;
  o->pieces = enc_pieces(b, m->u.pull_batch.pieces, m->u.pull_batch.npieces);
  return &o->base;
}

uint32_t wire__count_pull_batch_data(const wire_msg *m) {
  return m->u.pull_batch_data.npieces;
}

int wire__ready_pull_batch_data(const wire_msg *m) {
  return m->u.pull_batch_data.length != NULL;
}

const ProtobufCMessage *wire__enc_pull_batch_data(const wire_msg *m, enc_box *b) {
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

int wire__ready_hello(const wire_msg *m) {
  return m->u.hello.token_len <= WIRE_MAX_TOKEN && (m->u.hello.token_len == 0 || m->u.hello.token);
}

const ProtobufCMessage *wire__enc_hello(const wire_msg *m, enc_box *b) {
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
  const frame_type *t = wire__type_of((int)m->type);
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
  const frame_type *t = wire__type_of((int)m->type);
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
  le_store32(out + OFF_HEADER_CRC, wire__header_crc(out, out + WIRE_HEADER_SIZE, mlen));
  *len = WIRE_HEADER_SIZE + mlen;
  return 0;
}
