/*
 * fuzz_wire — libFuzzer target for the data-plane frame decoder
 * (common/net/wire.h), the code that reads untrusted bytes off the network.
 *
 * Each input is a byte stream. It is decoded twice, and the two decoders must
 * agree (a differential oracle, beside ASan and UBSan):
 *  - by wire_reader, fed in pieces whose sizes are drawn from the input
 *    itself, with kept payloads partly written "directly" (as a socket read
 *    would) through wire_reader_space / wire_reader_commit;
 *  - frame by frame with the one-shot wire_decode_frame.
 * Every frame the reader completes must have the length, type, request id,
 * meta and payload that wire_decode_frame finds at the same offset, and be
 * refused exactly when wire_decode_frame refuses it; where the reader stops
 * (fatal error, or input ended mid-frame) wire_decode_frame must fail too.
 * Frames that decode are encoded again and must decode to the same message
 * (batch arrays and HELLO tokens compared element by element).
 *
 * When the input's last byte is odd, the reader runs as a server's does
 * before authentication: its first frame's meta is held to
 * WIRE_MAX_HELLO_META, and a header declaring more is fatal at once (the
 * one-shot decoder, which has no such bound, is then only asked to fail on
 * a frame it cannot hold).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "common/net/wire.h"

/* Payload bound of the receiving side: small, so that inputs explore the
 * "oversized" path cheaply and the fuzzer never allocates much. */
#define FUZZ_MAX_PAYLOAD 4096u
#define MAX_FRAMES 256

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      __builtin_trap();                                                                            \
  } while (0)

typedef struct seen {
  size_t start, end; /* offsets of the frame in the input */
  wire_msg msg;
  wire_batch arrays; /* msg's batch arrays, copied out of the reader */
  int meta_status, payload_status;
  int kept; /* the payload was received into a buffer */
} seen;

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* 1 if m is a batch message whose arrays are there to copy. */
static int has_arrays(const wire_msg *m) {
  switch (m->type) {
  case WIRE_PUSH_BATCH:
    return m->u.push_batch.pieces && m->u.push_batch.npieces;
  case WIRE_PULL_BATCH:
    return m->u.pull_batch.pieces && m->u.pull_batch.npieces;
  case WIRE_PUSH_BATCH_ACK:
    return m->u.push_batch_ack.status && m->u.push_batch_ack.duplicate &&
           m->u.push_batch_ack.npieces;
  case WIRE_PULL_BATCH_DATA:
    return m->u.pull_batch_data.length && m->u.pull_batch_data.npieces;
  case WIRE_HELLO:
    return m->u.hello.token && m->u.hello.token_len;
  default:
    return 0;
  }
}

/* Copies the batch arrays m points at (a decoder's storage, reused by its
 * next frame) into *to and points m there. */
static void keep_arrays(wire_msg *m, wire_batch *to) {
  /* A refused frame may have no arrays at all. */
  if (!has_arrays(m))
    return;
  switch (m->type) {
  case WIRE_PUSH_BATCH:
    memcpy(to->pieces, m->u.push_batch.pieces, m->u.push_batch.npieces * sizeof to->pieces[0]);
    m->u.push_batch.pieces = to->pieces;
    break;
  case WIRE_PULL_BATCH:
    memcpy(to->pieces, m->u.pull_batch.pieces, m->u.pull_batch.npieces * sizeof to->pieces[0]);
    m->u.pull_batch.pieces = to->pieces;
    break;
  case WIRE_PUSH_BATCH_ACK:
    memcpy(to->status, m->u.push_batch_ack.status,
           m->u.push_batch_ack.npieces * sizeof to->status[0]);
    memcpy(to->duplicate, m->u.push_batch_ack.duplicate, m->u.push_batch_ack.npieces);
    m->u.push_batch_ack.status = to->status;
    m->u.push_batch_ack.duplicate = to->duplicate;
    break;
  case WIRE_PULL_BATCH_DATA:
    memcpy(to->length, m->u.pull_batch_data.length,
           m->u.pull_batch_data.npieces * sizeof to->length[0]);
    m->u.pull_batch_data.length = to->length;
    break;
  case WIRE_HELLO:
    memcpy(to->token, m->u.hello.token, m->u.hello.token_len);
    m->u.hello.token = to->token;
    break;
  default:
    break;
  }
}

static int pieces_equal(const wire_piece *a, const wire_piece *b, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (a[i].tensor != b[i].tensor || a[i].slice != b[i].slice || a[i].dtype != b[i].dtype ||
        a[i].length != b[i].length)
      return 0;
  return 1;
}

/* The two messages say the same: the fields, and a batch's arrays element by
 * element (their pointers differ). */
static int msg_equal(const wire_msg *a, const wire_msg *b) {
  if (a->type != b->type)
    return 0;
  switch (a->type) {
  case WIRE_PUSH_BATCH: {
    const wire_push_batch *x = &a->u.push_batch, *y = &b->u.push_batch;
    return x->spec_hash == y->spec_hash && x->step == y->step && x->rank == y->rank &&
           x->micro == y->micro && x->npieces == y->npieces &&
           pieces_equal(x->pieces, y->pieces, x->npieces);
  }
  case WIRE_PULL_BATCH: {
    const wire_pull_batch *x = &a->u.pull_batch, *y = &b->u.pull_batch;
    return x->spec_hash == y->spec_hash && x->min_version == y->min_version &&
           x->timeout_ms == y->timeout_ms && x->npieces == y->npieces &&
           pieces_equal(x->pieces, y->pieces, x->npieces);
  }
  case WIRE_PUSH_BATCH_ACK: {
    const wire_push_batch_ack *x = &a->u.push_batch_ack, *y = &b->u.push_batch_ack;
    return x->npieces == y->npieces &&
           memcmp(x->status, y->status, x->npieces * sizeof x->status[0]) == 0 &&
           memcmp(x->duplicate, y->duplicate, x->npieces) == 0 &&
           strcmp(x->message, y->message) == 0;
  }
  case WIRE_PULL_BATCH_DATA: {
    const wire_pull_batch_data *x = &a->u.pull_batch_data, *y = &b->u.pull_batch_data;
    return x->version == y->version && x->npieces == y->npieces &&
           memcmp(x->length, y->length, x->npieces * sizeof x->length[0]) == 0;
  }
  case WIRE_HELLO: {
    const wire_hello *x = &a->u.hello, *y = &b->u.hello;
    return x->token_len == y->token_len &&
           (x->token_len == 0 || memcmp(x->token, y->token, x->token_len) == 0);
  }
  default:
    return memcmp(&a->u, &b->u, sizeof a->u) == 0;
  }
}

/* decode(encode(m)) == m for a frame that decoded. */
static void check_round_trip(const wire_msg *orig, const uint8_t *payload) {
  /* orig's arrays may live where the decode below writes. */
  static wire_batch kept;
  wire_msg copy = *orig;
  keep_arrays(&copy, &kept);
  const wire_msg *m = &copy;
  uint8_t *f = malloc(WIRE_MAX_BATCH_ENCODED + m->payload_len);
  CHECK(f != NULL);
  size_t len = 0;
  CHECK(wire_encode(m, f, WIRE_MAX_BATCH_ENCODED, &len) == 0);
  if (m->payload_len)
    memcpy(f + len, payload, m->payload_len);
  wire_msg back;
  const uint8_t *pl = NULL;
  size_t flen = 0;
  CHECK(wire_decode_frame(f, len + m->payload_len, FUZZ_MAX_PAYLOAD, &back, &pl, &flen, NULL, 0) ==
        0);
  CHECK(flen == len + m->payload_len);
  CHECK(back.type == m->type && back.request_id == m->request_id &&
        back.payload_len == m->payload_len && back.payload_crc == m->payload_crc);
  CHECK(msg_equal(&back, m));
  free(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static seen frames[MAX_FRAMES];
  uint8_t *payloads[MAX_FRAMES];
  int nframes = 0;
  uint64_t rng = 0x9e3779b97f4a7c15ull ^ size;
  for (size_t i = 0; i < size && i < 8; i++)
    rng = (rng << 8) ^ data[i] ^ (rng >> 56);
  if (!rng)
    rng = 1;

  /* ---- the incremental reader */
  wire_reader r;
  wire_reader_init(&r, FUZZ_MAX_PAYLOAD);
  int limited = size > 0 && (data[size - 1] & 1u);
  if (limited)
    wire_reader_limit_meta(&r, WIRE_MAX_HELLO_META);
  size_t off = 0, frame_start = 0;
  int fatal = 0;
  uint8_t *dst = NULL;
  /* Each round consumes a byte or yields an event; an empty feed at the end
   * still completes a frame that needs no more bytes. */
  for (;;) {
    size_t chunk = 1 + (size_t)(rng_next(&rng) % 64);
    if (chunk > size - off)
      chunk = size - off;
    wire_event ev = WIRE_EV_NONE;
    size_t space = 0;
    uint8_t *sp = wire_reader_space(&r, &space);
    if (sp && chunk > 0 && (rng_next(&rng) & 1)) {
      size_t n = space < chunk ? space : chunk;
      memcpy(sp, data + off, n);
      off += n;
      ev = wire_reader_commit(&r, n);
    } else {
      size_t used = wire_reader_feed(&r, data + off, chunk, &ev);
      CHECK(used <= chunk);
      off += used;
      if (ev == WIRE_EV_NONE && used < chunk)
        __builtin_trap(); /* NONE means everything given was consumed */
    }
    if (ev == WIRE_EV_FATAL) {
      CHECK(r.status < 0);
      fatal = 1;
      break;
    }
    if (ev == WIRE_EV_META) {
      CHECK(r.msg.payload_len <= FUZZ_MAX_PAYLOAD);
      /* Kept whenever the meta is good, as a server would. */
      dst = NULL;
      if (r.meta_status == 0 && r.msg.payload_len > 0) {
        dst = malloc(r.msg.payload_len);
        CHECK(dst != NULL);
      }
      CHECK(wire_reader_set_payload(&r, dst) == 0);
    } else if (ev == WIRE_EV_DONE) {
      if (nframes < MAX_FRAMES) {
        seen *f = &frames[nframes];
        f->start = frame_start;
        f->end = off;
        f->msg = r.msg;
        keep_arrays(&f->msg, &f->arrays);
        f->meta_status = r.meta_status;
        f->payload_status = r.payload_status;
        f->kept = dst != NULL;
        payloads[nframes] = dst;
        nframes++;
      } else {
        free(dst);
      }
      dst = NULL;
      frame_start = off;
      /* Authenticated, as far as the server's reader is concerned. */
      wire_reader_limit_meta(&r, WIRE_MAX_META);
    } else if (off == size) {
      break;
    }
  }
  free(dst);
  CHECK(!fatal || r.status != 0);
  int mid = wire_reader_mid_frame(&r);
  int eof = wire_reader_eof(&r);
  CHECK(fatal || (mid ? eof < 0 : eof == 0));
  wire_reader_free(&r);

  /* ---- the one-shot decoder, frame by frame, must agree */
  for (int i = 0; i < nframes; i++) {
    const seen *f = &frames[i];
    wire_msg m;
    const uint8_t *pl = NULL;
    size_t flen = 0;
    int rc = wire_decode_frame(data + f->start, size - f->start, FUZZ_MAX_PAYLOAD, &m, &pl, &flen,
                               NULL, 0);
    CHECK(flen == f->end - f->start);
    int reader_ok = f->meta_status == 0 && f->payload_status == 0;
    CHECK((rc == 0) == reader_ok);
    if (f->meta_status != 0)
      CHECK(rc == f->meta_status);
    else if (f->payload_status != 0)
      CHECK(rc == f->payload_status);
    if (rc == 0) {
      CHECK(m.type == f->msg.type && m.request_id == f->msg.request_id &&
            m.payload_len == f->msg.payload_len);
      CHECK(msg_equal(&m, &f->msg));
      if (m.payload_len) {
        CHECK(f->kept);
        CHECK(memcmp(pl, payloads[i], m.payload_len) == 0);
      }
      check_round_trip(&m, pl);
    }
    free(payloads[i]);
  }
  /* Where the reader stopped, the one-shot decoder cannot decode a frame. */
  if (frame_start < size || fatal) {
    wire_msg m;
    const uint8_t *pl = NULL;
    size_t flen = 0;
    int rc = wire_decode_frame(data + frame_start, size - frame_start, FUZZ_MAX_PAYLOAD, &m, &pl,
                               &flen, NULL, 0);
    /* A first header over the pre-authentication bound stops the limited
     * reader at once, whatever follows it. */
    int over_hello_bound = limited && nframes == 0 && fatal && r.status == ZS_ERANGE;
    if (nframes < MAX_FRAMES && !over_hello_bound)
      CHECK(rc != 0);
  }
  return 0;
}
