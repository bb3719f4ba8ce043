/*
 * wire — the frames of the data plane (docs/PROTOCOL.md): encoding and
 * decoding, pure functions on memory, no I/O.
 *
 * A frame is a fixed 40-byte little-endian header, a protobuf-c meta message
 * (proto/zshard/v1/data.proto) and the raw tensor bytes (the payload):
 *
 *   offset size field
 *        0    4 magic        the bytes "ZSDP" (0x5A 0x53 0x44 0x50)
 *        4    1 version      1; 2 for the batch types, 3 for HELLO(_ACK)
 *        5    1 type         WIRE_PUSH .. WIRE_HELLO_ACK
 *        6    2 flags        0: version 1 defines no flag; a set bit is refused
 *        8    8 request_id   chosen by the client, echoed by the answer
 *       16    8 payload_len  bytes after the meta, <= the receiver's maximum
 *       24    4 meta_len     bytes of the meta message, <= WIRE_MAX_META
 *       28    4 payload_crc  CRC32C of the payload (0 for no payload)
 *       32    4 reserved     0
 *       36    4 header_crc   CRC32C of bytes 0..35 followed by the meta
 *
 * The header CRC is checked before the payload length is trusted, so one
 * flipped bit in a length is a clear error rather than a 1 GiB allocation or a
 * desynchronised stream. Only PUSH, PULL_DATA, PUSH_BATCH and
 * PULL_BATCH_DATA carry a payload; PING, PONG and HELLO_ACK carry neither
 * meta nor payload. HELLO carries the client's token and is the first frame
 * of every connection (docs/PROTOCOL.md, "Authentication"). A batch frame carries up to
 * WIRE_MAX_BATCH pieces of one shard with their bytes concatenated in list order.
 *
 * Errors come in two kinds:
 *  - fatal: the stream can no longer be framed (bad magic, version, type,
 *    flags or reserved field; a length over its bound; a payload on a type
 *    that has none; a header CRC mismatch; the stream ending inside a frame).
 *    The receiver answers ERROR with request id 0 if it can and closes.
 *  - per request: the framing is intact but the frame is refused (the meta
 *    does not parse, a dtype or status is not one of ours, the payload CRC
 *    does not match). The receiver skips the frame, answers an ERROR with the
 *    frame's request id, and the connection lives on.
 * Every error carries a zs_status (ZS_EPROTO, ZS_ERANGE, ZS_ECRC, ZS_EDTYPE)
 * and a sentence naming the field and the values.
 */
#ifndef ZSHARD_COMMON_WIRE_H
#define ZSHARD_COMMON_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define WIRE_MAGIC 0x5044535Au /* "ZSDP" read as a little-endian u32 */
/* Versions this side speaks: 1 defines types 1..7, 2 adds the batch types
 * 8..11, 3 the authentication frames HELLO and HELLO_ACK (12, 13). A frame
 * carries the lowest version that defines its type, so that single-piece
 * frames stay readable by version-1 peers. */
#define WIRE_VERSION_MIN 1u
#define WIRE_VERSION 3u
#define WIRE_HEADER_SIZE 40u
#define WIRE_MAX_META 65536u
/* The payload bound a receiver uses unless configured otherwise. */
#define WIRE_DEFAULT_MAX_PAYLOAD (UINT64_C(1) << 30)
/* Longest ERROR message kept, in bytes (longer ones are cut). */
#define WIRE_MAX_MESSAGE 400u
/* Room for any header + meta wire_encode writes (the longest is an ERROR
 * with a message of WIRE_MAX_MESSAGE bytes). */
#define WIRE_MAX_ENCODED (WIRE_HEADER_SIZE + 512u)
/* Most pieces in one PUSH_BATCH or PULL_BATCH (and its answer). */
#define WIRE_MAX_BATCH 256u
/* Room for any batch frame's header + meta: a piece costs at most 30 meta
 * bytes, an acknowledgement entry 7, plus the fixed fields and a message. */
#define WIRE_MAX_BATCH_ENCODED (WIRE_HEADER_SIZE + 512u + 32u * WIRE_MAX_BATCH)
#define WIRE_ERRLEN 192u
/* Longest token a HELLO carries (auth.h's AUTH_MAX_TOKEN), and the longest
 * meta a HELLO may have: the token and its field's few bytes of framing. */
#define WIRE_MAX_TOKEN 4096u
#define WIRE_MAX_HELLO_META (WIRE_MAX_TOKEN + 16u)

typedef enum wire_type {
  WIRE_PUSH = 1,      /* meta DataPush, payload: the gradient */
  WIRE_PUSH_ACK = 2,  /* meta DataPushAck */
  WIRE_PULL = 3,      /* meta DataPull */
  WIRE_PULL_DATA = 4, /* meta DataPullData, payload: the piece */
  WIRE_ERROR = 5,     /* meta DataError */
  WIRE_PING = 6,      /* nothing: asks for a PONG with the same request id */
  WIRE_PONG = 7,
  WIRE_PUSH_BATCH = 8,       /* meta DataPushBatch, payload: the gradients */
  WIRE_PUSH_BATCH_ACK = 9,   /* meta DataPushBatchAck */
  WIRE_PULL_BATCH = 10,      /* meta DataPullBatch */
  WIRE_PULL_BATCH_DATA = 11, /* meta DataPullBatchData, payload: the pieces */
  WIRE_HELLO = 12,           /* meta DataHello: the client's token, first frame */
  WIRE_HELLO_ACK = 13        /* nothing: the token was accepted */
} wire_type;

/* A header as decoded (every field host-endian). */
typedef struct wire_header {
  uint8_t version, type;
  uint16_t flags;
  uint64_t request_id;
  uint64_t payload_len;
  uint32_t meta_len;
  uint32_t payload_crc;
  uint32_t header_crc;
} wire_header;

/* The meta messages as plain C. dtype fields hold the wire value, which the
 * decoder has checked to be a zs_dtype. */
typedef struct wire_push {
  uint64_t spec_hash, step;
  uint32_t rank, micro, tensor, slice;
  int dtype;
} wire_push;

/* The decoder has checked token_len <= WIRE_MAX_TOKEN. token points into a
 * wire_batch, as a batch's arrays do (see below); to encode, at the caller's
 * bytes (only read during wire_encode). */
typedef struct wire_hello {
  const uint8_t *token;
  uint32_t token_len;
  /* A replica set's primary forwarding writes of this term; 0: a trainer. */
  uint64_t replica_term;
} wire_hello;

typedef struct wire_push_ack {
  int duplicate;
} wire_push_ack;

typedef struct wire_pull {
  uint64_t spec_hash, min_version;
  uint32_t tensor, slice, timeout_ms;
  int dtype;
} wire_pull;

typedef struct wire_pull_data {
  uint64_t version;
  int dtype;
} wire_pull_data;

typedef struct wire_error {
  int status;                         /* a negative zs_status */
  char message[WIRE_MAX_MESSAGE + 1]; /* NUL-terminated, control bytes shown as '?' */
} wire_error;

/* One piece of a batch. length: bytes of the batch payload (PUSH_BATCH) or
 * the size the client expects (PULL_BATCH). */
typedef struct wire_piece {
  uint32_t tensor, slice;
  int dtype;
  uint64_t length;
} wire_piece;

/*
 * The batch messages keep their per-piece arrays out of line, so that a
 * wire_msg stays small for the single-piece frames that make up most of the
 * traffic. To encode, the caller points them at its own arrays (npieces
 * entries, only read during wire_encode). A decoded message points into a
 * wire_batch: the reader's own (valid until its next frame's META event, or
 * wire_reader_free), or for wire_decode_meta / wire_decode_frame one per
 * calling thread (valid until that thread's next call of either).
 */

/* The decoder has checked: 1 <= npieces <= WIRE_MAX_BATCH, every dtype, and
 * that the lengths add up to the payload length exactly. */
typedef struct wire_push_batch {
  uint64_t spec_hash, step;
  uint32_t rank, micro;
  uint32_t npieces;
  const wire_piece *pieces;
} wire_push_batch;

/* One entry per piece; the decoder has checked that there are as many
 * statuses as duplicate flags (1 .. WIRE_MAX_BATCH) and that each status is
 * 0 or a negative zs_status. */
typedef struct wire_push_batch_ack {
  uint32_t npieces;
  const int32_t *status;
  const uint8_t *duplicate;
  char message[WIRE_MAX_MESSAGE + 1]; /* as wire_error.message */
} wire_push_batch_ack;

/* The decoder has checked the piece count and every dtype. */
typedef struct wire_pull_batch {
  uint64_t spec_hash, min_version;
  uint32_t timeout_ms;
  uint32_t npieces;
  const wire_piece *pieces;
} wire_pull_batch;

/* The decoder has checked 1 <= npieces <= WIRE_MAX_BATCH and that the
 * lengths add up to the payload length exactly. */
typedef struct wire_pull_batch_data {
  uint64_t version;
  uint32_t npieces;
  const uint64_t *length;
} wire_pull_batch_data;

/* Room for the arrays of any decoded batch message. */
typedef struct wire_batch {
  wire_piece pieces[WIRE_MAX_BATCH];
  int32_t status[WIRE_MAX_BATCH];
  uint8_t duplicate[WIRE_MAX_BATCH];
  uint64_t length[WIRE_MAX_BATCH];
  uint8_t token[WIRE_MAX_TOKEN]; /* a HELLO's */
} wire_batch;

/* One frame without its payload. */
typedef struct wire_msg {
  wire_type type;
  uint64_t request_id;
  uint64_t payload_len;
  uint32_t payload_crc;
  union {
    wire_push push;
    wire_push_ack push_ack;
    wire_pull pull;
    wire_pull_data pull_data;
    wire_error error;
    wire_push_batch push_batch;
    wire_push_batch_ack push_batch_ack;
    wire_pull_batch pull_batch;
    wire_pull_batch_data pull_batch_data;
    wire_hello hello;
  } u;
} wire_msg;

/* "PUSH", "PULL_DATA" ...; "UNKNOWN" for anything else. A static string. */
const char *wire_type_name(int type);

/* ------------------------------------------------------------------ encode */

/* Writes the header and meta of `m` into out[0 .. *len). The caller fills
 * m->payload_len and m->payload_crc (crc32c(0, payload, len)) and sends the
 * payload right after. An ERROR message longer than WIRE_MAX_MESSAGE is cut.
 * Returns 0, or ZS_EINVAL for an unknown type, a payload on a type that has
 * none, or cap < the encoded size (WIRE_MAX_ENCODED always suffices). `m` is
 * only read; `out` is the caller's. */
int wire_encode(const wire_msg *m, uint8_t *out, size_t cap, size_t *len);

/* ------------------------------------------------------------------ decode */

/* Decodes and checks a header: magic, version (1 or 2, and at least the
 * version that defines the type), type, flags, reserved field,
 * meta_len <= WIRE_MAX_META, payload_len <= max_payload, no payload (and for
 * PING/PONG no meta) on types that carry none. Every failure is fatal for a
 * stream: ZS_EPROTO, or ZS_ERANGE for a length over its bound, with a sentence
 * in err (may be NULL). The header CRC is not checked here: it also covers the
 * meta (wire_check_header_crc). */
int wire_decode_header(const uint8_t in[WIRE_HEADER_SIZE], uint64_t max_payload, wire_header *h,
                       char *err, size_t errlen);

/* ZS_ECRC (fatal) unless h->header_crc is the CRC32C of the 36 header bytes in
 * `head` followed by the h->meta_len bytes of `meta`. */
int wire_check_header_crc(const wire_header *h, const uint8_t head[WIRE_HEADER_SIZE],
                          const uint8_t *meta, char *err, size_t errlen);

/* Decodes the meta of a frame whose header CRC holds into *out (type,
 * request id and lengths copied from h). Returns 0, or a per-request error:
 * ZS_EPROTO (the meta does not parse, an ERROR status is not a negative
 * zs_status), ZS_EDTYPE (a dtype with no entry in dtype.h's table), ZS_ERANGE
 * (a batch with no piece or more than WIRE_MAX_BATCH, piece lengths that do
 * not add up to the payload length, an acknowledgement whose lists differ in
 * length), ZS_ENOMEM.
 * On error *out still holds type and request id, so that the receiver can
 * answer the request. */
int wire_decode_meta(const wire_header *h, const uint8_t *meta, wire_msg *out, char *err,
                     size_t errlen);

/* Decodes one whole frame at the start of buf[0 .. len): header, header CRC,
 * meta and payload CRC. On success returns 0, *out is the frame, *payload
 * points into buf at its payload and *frame_len is the frame's size. Returns
 * ZS_EPROTO if buf ends before the frame does ("truncated"), or the error of
 * the failing step above (*frame_len is set once the header decoded, 0
 * before). For tests and the fuzzer; a stream uses wire_reader. */
int wire_decode_frame(const void *buf, size_t len, uint64_t max_payload, wire_msg *out,
                      const uint8_t **payload, size_t *frame_len, char *err, size_t errlen);

/* ------------------------------------------------------------------ reader */

/* One place a part of a payload goes: `len` bytes at `base`. base may be NULL
 * only when len is 0. There is no "drop these bytes" segment: a payload is
 * either wanted whole (every byte lands somewhere and the CRC is checked) or
 * skipped whole (wire_reader_set_payload(r, NULL), wire_reader_skip_rest). */
typedef struct wire_seg {
  void *base;
  size_t len;
} wire_seg;

/*
 * A reader cuts a byte stream into frames incrementally, whatever the sizes of
 * the pieces it is fed. The caller owns the payload memory: at each frame's
 * META event it says where the payload goes (wire_reader_set_payload, or
 * wire_reader_set_payload_segs for a payload that goes to several places, such
 * as a batch's pieces), and may then let the socket write the payload there
 * directly (wire_reader_space / wire_reader_commit), so that the payload bytes
 * are copied only by the kernel. Bytes of a payload that arrive through
 * wire_reader_feed (in the same read as the header, or read into a staging
 * buffer because the current segment has little room left) are copied once
 * into the destination. The payload CRC is computed as the bytes arrive, in
 * payload order across the segments, while they are still in cache.
 *
 * Events (wire_reader_feed stops at each one):
 *   WIRE_EV_NONE   all input was consumed and no frame boundary was reached.
 *   WIRE_EV_META   a frame's header and meta are in and the header CRC holds:
 *                  r->msg is the frame; r->meta_status is 0 or a per-request
 *                  error (sentence in r->err). The caller must now call
 *                  wire_reader_set_payload (NULL to skip the payload; it must
 *                  skip when meta_status is not 0) or
 *                  wire_reader_set_payload_segs.
 *   WIRE_EV_DONE   the payload is complete (or skipped): r->payload_status is
 *                  0 or ZS_ECRC. r->msg stays valid until the next feed.
 *   WIRE_EV_FATAL  the stream is broken: r->status and r->err say why; every
 *                  later call returns WIRE_EV_FATAL again.
 */
typedef enum wire_event {
  WIRE_EV_NONE = 0,
  WIRE_EV_META,
  WIRE_EV_DONE,
  WIRE_EV_FATAL,
} wire_event;

typedef struct wire_reader {
  /* Results, read-only for the caller (see the events above). */
  wire_msg msg;
  int meta_status;
  int payload_status;
  int status;
  char err[WIRE_ERRLEN];
  /* Private. */
  uint64_t max_payload;
  uint32_t max_meta; /* WIRE_MAX_META unless lowered (wire_reader_limit_meta) */
  int state;
  uint8_t head[WIRE_HEADER_SIZE];
  size_t head_have;
  wire_header h;
  uint8_t *meta;     /* owned, meta_cap bytes */
  wire_batch *batch; /* owned, allocated at the first batch frame */
  size_t meta_cap, meta_have;
  int keep;             /* the payload is received (else skipped) */
  const wire_seg *segs; /* the caller's; NULL: the single segment `one` */
  wire_seg one;         /* wire_reader_set_payload's destination */
  uint32_t nsegs, seg;  /* seg: the segment being filled (nsegs once all are) */
  size_t seg_have;      /* bytes of segment seg received */
  uint64_t have;
  uint32_t crc;
} wire_reader;

/* Initialises `r` for payloads of at most max_payload bytes (0 means
 * WIRE_DEFAULT_MAX_PAYLOAD). The reader is the caller's; wire_reader_free
 * releases what it allocates. */
void wire_reader_init(wire_reader *r, uint64_t max_payload);
void wire_reader_free(wire_reader *r);

/* Lowers (or restores) the longest meta the reader accepts, at most
 * WIRE_MAX_META: a frame whose header declares more is fatal (ZS_ERANGE)
 * before any meta buffer is sized from it. A server keeps an
 * unauthenticated connection at WIRE_MAX_HELLO_META, so that a stranger
 * costs it a few KiB at most. */
void wire_reader_limit_meta(wire_reader *r, uint32_t max_meta);

/* Consumes bytes from in[0 .. len) up to the next event; returns how many.
 * `in` is only read during the call; NULL is an empty input. */
size_t wire_reader_feed(wire_reader *r, const void *in, size_t len, wire_event *ev);

/* After WIRE_EV_META: the payload (r->msg.payload_len bytes) goes to dst, or
 * is skipped if dst is NULL. dst is the caller's and must stay valid until
 * WIRE_EV_DONE, wire_reader_skip_rest or wire_reader_free. Returns 0, or
 * ZS_EINVAL if the reader is not waiting for a destination or dst is given
 * for a refused frame. The one-segment case of wire_reader_set_payload_segs. */
int wire_reader_set_payload(wire_reader *r, void *dst);

/* After WIRE_EV_META: the payload is scattered over segs[0 .. nsegs) in
 * order, segment i receiving the next segs[i].len bytes (zero-length
 * segments receive nothing). 1 <= nsegs <= WIRE_MAX_BATCH and the lengths must
 * add up to r->msg.payload_len exactly. The CRC covers the whole payload as
 * one, as the sender computed it. The array and the memory it points at are
 * the caller's and must stay valid and unchanged (the array) until
 * WIRE_EV_DONE, wire_reader_skip_rest or wire_reader_free. Returns 0, or
 * ZS_EINVAL (nothing changed: the reader still waits for a destination) if
 * the reader is not waiting for one, the frame was refused, the count is out
 * of range, a segment with bytes has no base, or the lengths do not add up. */
int wire_reader_set_payload_segs(wire_reader *r, const wire_seg *segs, uint32_t nsegs);

/* Where the next payload bytes may be written directly: the room left in the
 * current segment (*len); NULL (and *len 0) unless a kept payload is being
 * received. */
void *wire_reader_space(wire_reader *r, size_t *len);

/* Where the next read() should go: straight into the payload at
 * wire_reader_space() when at least direct_min bytes of it are awaited (at
 * most chunk of them, so that reads per wake-up stay bounded), else into
 * `staging` (staging_len bytes), whose bytes then go through
 * wire_reader_feed (the caller tells the two apart by the pointer). Sets *len. */
void *wire_reader_read_buf(wire_reader *r, void *staging, size_t staging_len, size_t direct_min,
                           size_t chunk, size_t *len);

/* Accounts n bytes written at wire_reader_space() (n <= *len given there);
 * filling the current segment moves on to the next one that has room.
 * Returns WIRE_EV_DONE when that completed the payload, else WIRE_EV_NONE
 * (WIRE_EV_FATAL if n is out of range, which is a caller bug). */
wire_event wire_reader_commit(wire_reader *r, size_t n);

/* The payload being received is no longer wanted (its request was given
 * up): the rest of it is skipped, the destination (every segment) is
 * released at once and no CRC is checked. Does nothing outside a payload. */
void wire_reader_skip_rest(wire_reader *r);

/* 1 while part of a frame has been received, 0 at a frame boundary. */
int wire_reader_mid_frame(const wire_reader *r);

/* The stream ended. Returns 0 at a frame boundary, else ZS_EPROTO with a
 * sentence in r->err saying how much of which frame was missing. */
int wire_reader_eof(wire_reader *r);

#endif
