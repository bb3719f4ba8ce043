/*
 * wire internals — what the frame type table, the encoder, the decoder and
 * the streaming reader share (wire.c, wire_encode.c, wire_decode.c,
 * wire_reader.c). Not part of zs_net's interface: only those four files
 * include it.
 */
#ifndef ZSHARD_WIRE_INTERNAL_H
#define ZSHARD_WIRE_INTERNAL_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "common/net/wire.h"
#include "zshard/v1/data.pb-c.h"

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
  int dtype;         /* the frame's dtype field, checked by wire__decode_meta */
  const char *what;  /* set when the meta does not parse: the message's name */
  char *err;
  size_t errlen;
} meta_dec;

/* Each type's meta encoder (wire_encode.c) and decoder (wire_decode.c), and
 * a batch's count and the encoder's preconditions (wire_encode.c), named by
 * the table in wire.c. */
#define FRAME_CODEC(name)                                                                          \
  const ProtobufCMessage *wire__enc_##name(const wire_msg *m, enc_box *b);                         \
  int wire__dec_##name(meta_dec *d);
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
uint32_t wire__count_push_batch(const wire_msg *m);
uint32_t wire__count_push_batch_ack(const wire_msg *m);
uint32_t wire__count_pull_batch(const wire_msg *m);
uint32_t wire__count_pull_batch_data(const wire_msg *m);
int wire__ready_push_batch(const wire_msg *m);
int wire__ready_push_batch_ack(const wire_msg *m);
int wire__ready_pull_batch(const wire_msg *m);
int wire__ready_pull_batch_data(const wire_msg *m);
int wire__ready_hello(const wire_msg *m);

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

/* The entry of a known type, NULL for any other byte. */
const frame_type *wire__type_of(int type);

/* The header CRC: CRC32C over the header's first 36 bytes, then the meta. */
uint32_t wire__header_crc(const uint8_t *head, const uint8_t *meta, size_t meta_len);

/* Decodes the meta of a frame whose header was checked into out, a batch's
 * arrays into store (NULL: the decode fails with ZS_ENOMEM where it needs
 * them); returns 0 or the status, with a sentence in err. */
int wire__decode_meta(const wire_header *h, const uint8_t *meta, wire_msg *out, wire_batch *store,
                      char *err, size_t errlen);

#endif
