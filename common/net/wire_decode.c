/*
 * wire_decode — a frame's header (its fields, its limits, its CRC) and the
 * meta of each type, checked field by field; wire_decode_frame for a whole
 * frame in memory. The only allocation is protobuf-c's unpacked message,
 * freed before each function returns.
 */
#include <inttypes.h>
#include <string.h>

#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/le.h"
#include "common/base/status.h"
#include "common/net/wire.h"
#include "common/net/wire_internal.h"

/* No receiver bound may exceed this, so that 40 + meta + payload never
 * overflows a 64-bit size. */
#define WIRE_PAYLOAD_CEILING (UINT64_C(1) << 62)

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
  const frame_type *t = wire__type_of(h->type);
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
  uint32_t c = wire__header_crc(head, meta, h->meta_len);
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

int wire__dec_push(meta_dec *d) {
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

int wire__dec_push_ack(meta_dec *d) {
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

int wire__dec_pull(meta_dec *d) {
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

int wire__dec_pull_data(meta_dec *d) {
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

int wire__dec_error(meta_dec *d) {
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

int wire__dec_push_batch(meta_dec *d) {
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

int wire__dec_push_batch_ack(meta_dec *d) {
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

int wire__dec_pull_batch(meta_dec *d) {
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

int wire__dec_pull_batch_data(meta_dec *d) {
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

int wire__dec_hello(meta_dec *d) {
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

int wire__decode_meta(const wire_header *h, const uint8_t *meta, wire_msg *out, wire_batch *store,
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
  const frame_type *t = wire__type_of(h->type);
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
  return wire__decode_meta(h, meta, out, &tls_batch, err, errlen);
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
