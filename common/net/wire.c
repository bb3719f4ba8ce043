/*
 * wire — the frame type table and what every part of the codec shares: a
 * type's entry and the header CRC. The encoder is in wire_encode.c, the
 * header and meta decoders in wire_decode.c, the streaming reader in
 * wire_reader.c (see wire.h for the format).
 *
 * Everything here works on memory the caller hands in; the only allocations
 * are the reader's meta buffer and protobuf-c's unpacked message, freed before
 * each function returns.
 */
#include "common/net/wire.h"

#include "common/base/crc32c.h"
#include "common/net/wire_internal.h"

static const frame_type k_types[] = {
    [WIRE_PUSH] = {"PUSH", 1, 1, 1, 0, NULL, NULL, wire__enc_push, wire__dec_push},
    [WIRE_PUSH_ACK] = {"PUSH_ACK", 1, 1, 0, 0, NULL, NULL, wire__enc_push_ack, wire__dec_push_ack},
    [WIRE_PULL] = {"PULL", 1, 1, 0, 0, NULL, NULL, wire__enc_pull, wire__dec_pull},
    [WIRE_PULL_DATA] = {"PULL_DATA", 1, 1, 1, 0, NULL, NULL, wire__enc_pull_data,
                        wire__dec_pull_data},
    [WIRE_ERROR] = {"ERROR", 1, 1, 0, 0, NULL, NULL, wire__enc_error, wire__dec_error},
    [WIRE_PING] = {"PING", 1, 0, 0, 0, NULL, NULL, NULL, NULL},
    [WIRE_PONG] = {"PONG", 1, 0, 0, 0, NULL, NULL, NULL, NULL},
    [WIRE_PUSH_BATCH] = {"PUSH_BATCH", 2, 1, 1, 1, wire__count_push_batch, wire__ready_push_batch,
                         wire__enc_push_batch, wire__dec_push_batch},
    [WIRE_PUSH_BATCH_ACK] = {"PUSH_BATCH_ACK", 2, 1, 0, 1, wire__count_push_batch_ack,
                             wire__ready_push_batch_ack, wire__enc_push_batch_ack,
                             wire__dec_push_batch_ack},
    [WIRE_PULL_BATCH] = {"PULL_BATCH", 2, 1, 0, 1, wire__count_pull_batch, wire__ready_pull_batch,
                         wire__enc_pull_batch, wire__dec_pull_batch},
    [WIRE_PULL_BATCH_DATA] = {"PULL_BATCH_DATA", 2, 1, 1, 1, wire__count_pull_batch_data,
                              wire__ready_pull_batch_data, wire__enc_pull_batch_data,
                              wire__dec_pull_batch_data},
    [WIRE_HELLO] = {"HELLO", 3, 1, 0, 1, NULL, wire__ready_hello, wire__enc_hello, wire__dec_hello},
    [WIRE_HELLO_ACK] = {"HELLO_ACK", 3, 0, 0, 0, NULL, NULL, NULL, NULL},
};

/* The entry of a known type, NULL for any other byte. */
const frame_type *wire__type_of(int type) {
  if (type < 0 || (size_t)type >= sizeof k_types / sizeof k_types[0] || !k_types[type].name)
    return NULL;
  return &k_types[type];
}

const char *wire_type_name(int type) {
  const frame_type *t = wire__type_of(type);
  return t ? t->name : "UNKNOWN";
}

uint32_t wire__header_crc(const uint8_t *head, const uint8_t *meta, size_t meta_len) {
  uint32_t c = crc32c(0, head, OFF_HEADER_CRC);
  return meta_len ? crc32c(c, meta, meta_len) : c;
}
