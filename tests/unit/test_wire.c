/*
 * test_wire — the data-plane frame format (common/net/wire.h): the header layout
 * byte by byte, encode/decode round trips of every frame type (whole, and
 * through the incremental reader in pieces of every size and with direct
 * payload writes), and every malformed input: bad magic, version, type, flags
 * and reserved field, oversized lengths, payloads where none belong,
 * truncation, header and payload CRC mismatches, metas that do not parse and
 * values that are not ours, each with its status and a sentence naming it.
 * Batch frames (version 2): round trips up to the largest batch, and every
 * count, length and list in their metas checked against the payload.
 * Scattered payloads (wire_reader_set_payload_segs): the stream cut at every
 * offset, fed a byte at a time or written directly, zero-length segments, a
 * CRC mismatch, and segment lists that do not cover the payload exactly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/crc32c.h"
#include "common/base/le.h"
#include "common/net/wire.h"
#include "zshard/v1/data.pb-c.h"
#include "zshard/zshard.h"

#define BIG (WIRE_MAX_ENCODED + 4096)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rng32(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 16);
}

/* A whole frame in one buffer: header + meta from wire_encode, then the
 * payload. Returns its length. */
static size_t frame(uint8_t *out, size_t cap, wire_msg *m, const void *payload, size_t plen) {
  m->payload_len = plen;
  m->payload_crc = plen ? crc32c(0, payload, plen) : 0;
  size_t len = 0;
  assert_int_equal(wire_encode(m, out, cap, &len), 0);
  assert_true(len + plen <= cap);
  if (plen)
    memcpy(out + len, payload, plen);
  return len + plen;
}

static wire_msg push_msg(uint64_t id) {
  wire_msg m = {.type = WIRE_PUSH, .request_id = id};
  m.u.push = (wire_push){.spec_hash = 0x0123456789abcdefull,
                         .step = 7,
                         .rank = 3,
                         .micro = 1,
                         .tensor = 42,
                         .slice = 5,
                         .dtype = ZS_DTYPE_BF16};
  return m;
}

/* A header with arbitrary field values and a correct header CRC over it and
 * `meta`, so that a test reaches exactly the check it is about. */
static void raw_header(uint8_t h[WIRE_HEADER_SIZE], uint32_t magic, uint8_t version, uint8_t type,
                       uint16_t flags, uint64_t id, uint64_t payload_len, uint32_t meta_len,
                       uint32_t payload_crc, uint32_t reserved, const uint8_t *meta) {
  le_store32(h, magic);
  h[4] = version;
  h[5] = type;
  le_store16(h + 6, flags);
  le_store64(h + 8, id);
  le_store64(h + 16, payload_len);
  le_store32(h + 24, meta_len);
  le_store32(h + 28, payload_crc);
  le_store32(h + 32, reserved);
  uint32_t c = crc32c(0, h, 36);
  if (meta && meta_len)
    c = crc32c(c, meta, meta_len);
  le_store32(h + 36, c);
}

/* Recomputes the header CRC of an encoded frame after a test edited it. */
static void reseal(uint8_t *f) {
  uint32_t meta_len = le_load32(f + 24);
  uint32_t c = crc32c(crc32c(0, f, 36), f + WIRE_HEADER_SIZE, meta_len);
  le_store32(f + 36, c);
}

/* Decodes a whole frame and checks the status and that the sentence names
 * `needle`. */
static void expect_decode_error(const uint8_t *f, size_t len, uint64_t max_payload, int status,
                                const char *needle) {
  wire_msg m;
  const uint8_t *pl = NULL;
  size_t flen = 0;
  char err[WIRE_ERRLEN] = "";
  int rc = wire_decode_frame(f, len, max_payload, &m, &pl, &flen, err, sizeof err);
  if (rc != status || !strstr(err, needle))
    fail_msg("expected %s containing \"%s\", got %s: \"%s\"", zs_err_name(status), needle,
             zs_err_name(rc), err);
}

/* Feeds `len` bytes to a fresh reader in one piece and returns the first
 * event that is not WIRE_EV_NONE (keeping payloads in `dst`). */
static wire_event reader_first_event(wire_reader *r, const uint8_t *f, size_t len, void *dst) {
  size_t off = 0;
  for (;;) {
    wire_event ev;
    off += wire_reader_feed(r, f + off, len - off, &ev);
    if (ev == WIRE_EV_META) {
      if (r->meta_status != 0)
        return ev;
      assert_int_equal(wire_reader_set_payload(r, dst), 0);
      continue;
    }
    if (ev != WIRE_EV_NONE || off == len)
      return ev;
  }
}

/* ------------------------------------------------------------ layout */

static void header_fields_sit_at_their_documented_little_endian_offsets(void **state) {
  (void)state;
  uint8_t f[BIG];
  uint8_t payload[3] = {1, 2, 3};
  wire_msg m = push_msg(0x1122334455667788ull);
  size_t len = frame(f, sizeof f, &m, payload, sizeof payload);
  assert_memory_equal(f, "ZSDP", 4);
  assert_int_equal(f[4], 1);
  assert_int_equal(f[5], WIRE_PUSH);
  assert_int_equal(f[6] | f[7], 0);
  static const uint8_t id_le[8] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11};
  assert_memory_equal(f + 8, id_le, 8);
  static const uint8_t plen_le[8] = {3, 0, 0, 0, 0, 0, 0, 0};
  assert_memory_equal(f + 16, plen_le, 8);
  uint32_t meta_len = f[24] | f[25] << 8 | f[26] << 16 | (uint32_t)f[27] << 24;
  assert_int_equal(len, WIRE_HEADER_SIZE + meta_len + sizeof payload);
  uint32_t pcrc = crc32c(0, payload, 3);
  uint8_t pcrc_le[4] = {(uint8_t)pcrc, (uint8_t)(pcrc >> 8), (uint8_t)(pcrc >> 16),
                        (uint8_t)(pcrc >> 24)};
  assert_memory_equal(f + 28, pcrc_le, 4);
  static const uint8_t zero4[4] = {0};
  assert_memory_equal(f + 32, zero4, 4);
  uint32_t hcrc = crc32c(crc32c(0, f, 36), f + 40, meta_len);
  assert_int_equal(f[36] | f[37] << 8 | f[38] << 16 | (uint32_t)f[39] << 24, hcrc);
  /* The payload follows the meta unchanged. */
  assert_memory_equal(f + 40 + meta_len, payload, 3);
}

/* ------------------------------------------------------------ round trips */

static void every_frame_type_round_trips_through_encode_and_decode(void **state) {
  (void)state;
  uint8_t f[BIG];
  uint8_t payload[1000];
  for (size_t i = 0; i < sizeof payload; i++)
    payload[i] = (uint8_t)rng32();
  wire_msg in[7];
  memset(in, 0, sizeof in);
  in[0] = push_msg(1);
  in[1] = (wire_msg){.type = WIRE_PUSH_ACK, .request_id = 2};
  in[1].u.push_ack.duplicate = 1;
  in[2] = (wire_msg){.type = WIRE_PULL, .request_id = 3};
  in[2].u.pull = (wire_pull){.spec_hash = ~0ull,
                             .min_version = 1ull << 40,
                             .tensor = 999999,
                             .slice = 4095,
                             .timeout_ms = 12345,
                             .dtype = ZS_DTYPE_FP16};
  in[3] = (wire_msg){.type = WIRE_PULL_DATA, .request_id = ~0ull};
  in[3].u.pull_data = (wire_pull_data){.version = 17, .dtype = ZS_DTYPE_FP32};
  in[4] = (wire_msg){.type = WIRE_ERROR, .request_id = 5};
  in[4].u.error.status = ZS_ESTEP;
  strcpy(in[4].u.error.message, "push for step 9 but shard 0 expects step 8");
  in[5] = (wire_msg){.type = WIRE_PING, .request_id = 6};
  in[6] = (wire_msg){.type = WIRE_PONG, .request_id = 0};
  for (int i = 0; i < 7; i++) {
    int has_payload = in[i].type == WIRE_PUSH || in[i].type == WIRE_PULL_DATA;
    size_t plen = has_payload ? sizeof payload : 0;
    size_t len = frame(f, sizeof f, &in[i], payload, plen);
    wire_msg out;
    const uint8_t *pl = NULL;
    size_t flen = 0;
    char err[WIRE_ERRLEN] = "";
    int rc = wire_decode_frame(f, len, 0, &out, &pl, &flen, err, sizeof err);
    if (rc)
      fail_msg("%s: %s", wire_type_name(in[i].type), err);
    assert_int_equal(flen, len);
    assert_int_equal(out.type, in[i].type);
    assert_int_equal(out.request_id, in[i].request_id);
    assert_int_equal(out.payload_len, plen);
    if (plen)
      assert_memory_equal(pl, payload, plen);
    /* The union holds exactly what went in (both were zeroed first). */
    assert_memory_equal(&out.u, &in[i].u, sizeof out.u);
  }
}

/* Feeds a stream of several frames in pieces of `chunk` bytes (0: random
 * sizes) and checks that each frame comes out whole and in order. */
static void feed_stream_in_chunks(size_t chunk, int direct) {
  enum { NF = 5, PL = 3000 };
  uint8_t *stream = malloc(NF * (WIRE_MAX_ENCODED + PL));
  uint8_t payloads[NF][PL];
  size_t plen[NF];
  assert_non_null(stream);
  size_t total = 0;
  for (int i = 0; i < NF; i++) {
    plen[i] = (i % 2 == 0) ? (size_t)(i * 700) : 0;
    for (size_t k = 0; k < plen[i]; k++)
      payloads[i][k] = (uint8_t)rng32();
    wire_msg m = i % 2 == 0 ? push_msg((uint64_t)i + 100)
                            : (wire_msg){.type = WIRE_PULL, .request_id = (uint64_t)i + 100};
    if (m.type == WIRE_PULL)
      m.u.pull.dtype = ZS_DTYPE_BF16;
    total += frame(stream + total, WIRE_MAX_ENCODED + PL, &m, payloads[i], plen[i]);
  }
  wire_reader r;
  wire_reader_init(&r, 0);
  uint8_t dst[PL];
  int next = 0;
  size_t off = 0;
  while (off < total) {
    size_t n = chunk ? chunk : 1 + rng32() % 97;
    if (n > total - off)
      n = total - off;
    size_t used = 0;
    while (used < n) {
      /* With direct writes, payload bytes go straight to the reader's
       * destination, the way a socket read would put them there. */
      size_t space = 0;
      uint8_t *sp = direct ? wire_reader_space(&r, &space) : NULL;
      wire_event ev;
      if (sp) {
        size_t k = space < n - used ? space : n - used;
        memcpy(sp, stream + off + used, k);
        used += k;
        ev = wire_reader_commit(&r, k);
      } else {
        used += wire_reader_feed(&r, stream + off + used, n - used, &ev);
      }
      if (ev == WIRE_EV_META) {
        assert_int_equal(r.meta_status, 0);
        assert_int_equal(r.msg.request_id, (uint64_t)next + 100);
        assert_int_equal(r.msg.payload_len, plen[next]);
        assert_int_equal(wire_reader_set_payload(&r, dst), 0);
        assert_true(wire_reader_mid_frame(&r));
      } else if (ev == WIRE_EV_DONE) {
        assert_int_equal(r.payload_status, 0);
        assert_int_equal(r.msg.request_id, (uint64_t)next + 100);
        if (plen[next])
          assert_memory_equal(dst, payloads[next], plen[next]);
        next++;
      } else {
        assert_int_equal(ev, WIRE_EV_NONE);
      }
    }
    off += n;
  }
  /* A frame without payload completes on the next feed, even an empty one. */
  wire_event ev;
  assert_int_equal(wire_reader_feed(&r, NULL, 0, &ev), 0);
  if (ev == WIRE_EV_DONE)
    next++;
  assert_int_equal(next, NF);
  assert_false(wire_reader_mid_frame(&r));
  assert_int_equal(wire_reader_eof(&r), 0);
  wire_reader_free(&r);
  free(stream);
}

static void reader_reassembles_frames_fed_one_byte_at_a_time(void **state) {
  (void)state;
  feed_stream_in_chunks(1, 0);
}

static void reader_reassembles_frames_fed_in_random_pieces(void **state) {
  (void)state;
  for (int i = 0; i < 20; i++)
    feed_stream_in_chunks(0, 0);
}

static void reader_accepts_payload_bytes_written_directly_into_the_destination(void **state) {
  (void)state;
  feed_stream_in_chunks(4096, 1);
  for (int i = 0; i < 10; i++)
    feed_stream_in_chunks(0, 1);
}

static void reader_skips_a_payload_when_told_to_and_stays_in_step(void **state) {
  (void)state;
  uint8_t f[2 * BIG];
  uint8_t payload[2000];
  memset(payload, 0x5a, sizeof payload);
  wire_msg a = push_msg(1), b = push_msg(2);
  size_t la = frame(f, sizeof f, &a, payload, sizeof payload);
  size_t lb = frame(f + la, sizeof f - la, &b, payload, 10);
  wire_reader r;
  wire_reader_init(&r, 0);
  wire_event ev;
  size_t off = wire_reader_feed(&r, f, la + lb, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  assert_int_equal(wire_reader_set_payload(&r, NULL), 0);
  size_t space = 1;
  assert_null(wire_reader_space(&r, &space));
  assert_int_equal(space, 0);
  off += wire_reader_feed(&r, f + off, la + lb - off, &ev);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(off, la);
  uint8_t dst[10];
  assert_int_equal(reader_first_event(&r, f + off, lb, dst), WIRE_EV_DONE);
  assert_int_equal(r.msg.request_id, 2);
  assert_memory_equal(dst, payload, 10);
  wire_reader_free(&r);
}

/* ------------------------------------------------------------ malformed */

static void bad_magic_is_refused_as_not_our_protocol(void **state) {
  (void)state;
  uint8_t f[BIG];
  wire_msg m = {.type = WIRE_PING, .request_id = 1};
  size_t len = frame(f, sizeof f, &m, NULL, 0);
  memcpy(f, "GET ", 4); /* an HTTP client on the data port */
  expect_decode_error(f, len, 0, ZS_EPROTO, "bad frame magic");
  wire_reader r;
  wire_reader_init(&r, 0);
  assert_int_equal(reader_first_event(&r, f, len, NULL), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_EPROTO);
  assert_non_null(strstr(r.err, "not a zshard data-plane stream"));
  wire_reader_free(&r);
}

static void unsupported_version_is_refused(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 4, WIRE_PING, 0, 1, 0, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO,
                      "unsupported frame version 4 (this side speaks 1 to 3)");
  raw_header(h, WIRE_MAGIC, 0, WIRE_PING, 0, 1, 0, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "unsupported frame version 0");
  /* The batch types came with version 2: a version-1 frame cannot carry one. */
  raw_header(h, WIRE_MAGIC, 1, WIRE_PULL_BATCH, 0, 1, 0, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO,
                      "PULL_BATCH frame (request id 1) says version 1; the type needs version 2");
  /* HELLO came with version 3. */
  raw_header(h, WIRE_MAGIC, 2, WIRE_HELLO, 0, 1, 0, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO,
                      "HELLO frame (request id 1) says version 2; the type needs version 3");
}

static void unknown_frame_type_is_refused(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  const uint8_t bad[] = {0, 14, 99, 255};
  for (size_t i = 0; i < sizeof bad; i++) {
    raw_header(h, WIRE_MAGIC, 3, bad[i], 0, 77, 0, 0, 0, 0, NULL);
    char needle[64];
    snprintf(needle, sizeof needle, "unknown frame type %u (request id 77)", bad[i]);
    expect_decode_error(h, sizeof h, 0, ZS_EPROTO, needle);
  }
}

static void flags_and_reserved_bits_must_be_zero(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 1, WIRE_PING, 0x0100, 1, 0, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "flags 0x0100");
  raw_header(h, WIRE_MAGIC, 1, WIRE_PING, 0, 1, 0, 0, 0, 0xdead, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "reserved field");
}

static void oversized_meta_length_is_refused_before_reading_it(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 1, WIRE_PULL, 0, 1, 0, WIRE_MAX_META + 1, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_ERANGE, "meta of 65537 bytes exceeds the 65536 limit");
  raw_header(h, WIRE_MAGIC, 1, WIRE_PULL, 0, 1, 0, 0xffffffffu, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_ERANGE, "exceeds the 65536 limit");
  /* The reader refuses it from the header alone: no meta buffer is grown. */
  wire_reader r;
  wire_reader_init(&r, 0);
  assert_int_equal(reader_first_event(&r, h, sizeof h, NULL), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_ERANGE);
  assert_int_equal(r.meta_cap, 0);
  wire_reader_free(&r);
}

static void oversized_payload_length_is_refused_against_the_receivers_limit(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 1, WIRE_PUSH, 0, 1, WIRE_DEFAULT_MAX_PAYLOAD + 1, 0, 1, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_ERANGE, "payload of 1073741825 bytes exceeds");
  raw_header(h, WIRE_MAGIC, 1, WIRE_PUSH, 0, 1, UINT64_MAX, 0, 1, 0, NULL);
  expect_decode_error(h, sizeof h, UINT64_MAX, ZS_ERANGE, "exceeds this side's limit");
  /* A configured limit applies exactly: 1000 passes, 1001 does not. */
  raw_header(h, WIRE_MAGIC, 1, WIRE_PUSH, 0, 1, 1001, 0, 1, 0, NULL);
  wire_reader r;
  wire_reader_init(&r, 1000);
  assert_int_equal(reader_first_event(&r, h, sizeof h, NULL), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_ERANGE);
  assert_non_null(strstr(r.err, "limit of 1000"));
  wire_reader_free(&r);
  wire_header hd;
  raw_header(h, WIRE_MAGIC, 1, WIRE_PUSH, 0, 1, 1000, 0, 1, 0, NULL);
  assert_int_equal(wire_decode_header(h, 1000, &hd, NULL, 0), 0);
}

static void payload_or_meta_on_a_type_without_them_is_refused(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 1, WIRE_PULL, 0, 1, 16, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "PULL frame carries a payload of 16 bytes");
  raw_header(h, WIRE_MAGIC, 1, WIRE_ERROR, 0, 1, 1, 0, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "ERROR frame carries a payload");
  raw_header(h, WIRE_MAGIC, 1, WIRE_PING, 0, 1, 0, 4, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "PING frame carries a meta of 4 bytes");
  raw_header(h, WIRE_MAGIC, 1, WIRE_PULL, 0, 1, 0, 0, 0x1234, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "without payload has payload CRC");
}

static void truncated_frames_are_refused_at_every_length(void **state) {
  (void)state;
  uint8_t f[BIG];
  uint8_t payload[64];
  memset(payload, 7, sizeof payload);
  wire_msg m = push_msg(9);
  size_t len = frame(f, sizeof f, &m, payload, sizeof payload);
  for (size_t cut = 0; cut < len; cut++) {
    wire_msg out;
    const uint8_t *pl = NULL;
    size_t flen = 0;
    char err[WIRE_ERRLEN] = "";
    int rc = wire_decode_frame(f, cut, 0, &out, &pl, &flen, err, sizeof err);
    if (rc != ZS_EPROTO || !strstr(err, "truncated"))
      fail_msg("cut at %zu: %s \"%s\"", cut, zs_err_name(rc), err);
    /* A stream that ends there is mid-frame, and says so. */
    wire_reader r;
    wire_reader_init(&r, 0);
    uint8_t dst[64];
    wire_event ev = reader_first_event(&r, f, cut, dst);
    assert_int_equal(ev, WIRE_EV_NONE);
    assert_int_equal(wire_reader_mid_frame(&r), cut > 0);
    int eof = wire_reader_eof(&r);
    if (cut == 0)
      assert_int_equal(eof, 0);
    else if (eof != ZS_EPROTO || !strstr(r.err, "stream ended inside"))
      fail_msg("eof at %zu: %s \"%s\"", cut, zs_err_name(eof), r.err);
    wire_reader_free(&r);
  }
}

static void header_crc_mismatch_is_fatal(void **state) {
  (void)state;
  uint8_t f[BIG];
  wire_msg m = push_msg(9);
  size_t len = frame(f, sizeof f, &m, NULL, 0);
  /* A corrupted payload length: plausible on its own, caught by the CRC. */
  f[17] ^= 0x01;
  expect_decode_error(f, len, 0, ZS_ECRC, "header CRC");
  f[17] ^= 0x01;
  /* A corrupted meta byte is covered by the same CRC. */
  f[WIRE_HEADER_SIZE + 2] ^= 0x40;
  expect_decode_error(f, len, 0, ZS_ECRC, "the header or meta is corrupt");
  wire_reader r;
  wire_reader_init(&r, 0);
  assert_int_equal(reader_first_event(&r, f, len, NULL), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_ECRC);
  /* Fatal is final: nothing more is consumed. */
  wire_event ev;
  assert_int_equal(wire_reader_feed(&r, f, len, &ev), 0);
  assert_int_equal(ev, WIRE_EV_FATAL);
  wire_reader_free(&r);
}

static void payload_crc_mismatch_refuses_that_frame_and_the_next_one_decodes(void **state) {
  (void)state;
  uint8_t f[2 * BIG];
  uint8_t payload[256];
  for (size_t i = 0; i < sizeof payload; i++)
    payload[i] = (uint8_t)i;
  wire_msg a = push_msg(1), b = push_msg(2);
  size_t la = frame(f, sizeof f, &a, payload, sizeof payload);
  size_t lb = frame(f + la, sizeof f - la, &b, payload, sizeof payload);
  f[la - 1] ^= 0x80; /* last payload byte of the first frame */
  expect_decode_error(f, la, 0, ZS_ECRC, "payload CRC");
  wire_reader r;
  wire_reader_init(&r, 0);
  uint8_t dst[256];
  size_t off = 0;
  wire_event ev;
  off += wire_reader_feed(&r, f, la + lb, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  assert_int_equal(wire_reader_set_payload(&r, dst), 0);
  off += wire_reader_feed(&r, f + off, la + lb - off, &ev);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(r.payload_status, ZS_ECRC);
  assert_non_null(strstr(r.err, "request id 1"));
  assert_int_equal(off, la);
  assert_int_equal(reader_first_event(&r, f + off, lb, dst), WIRE_EV_DONE);
  assert_int_equal(r.payload_status, 0);
  assert_int_equal(r.msg.request_id, 2);
  wire_reader_free(&r);
}

static void meta_that_does_not_parse_is_a_per_request_error(void **state) {
  (void)state;
  /* A varint that never ends, behind a header whose CRC holds: the framing
   * is sound, the message is not. */
  uint8_t f[WIRE_HEADER_SIZE + 4 + WIRE_HEADER_SIZE];
  const uint8_t garbage[4] = {0x10, 0xff, 0xff, 0xff};
  raw_header(f, WIRE_MAGIC, 1, WIRE_PULL, 0, 31, 0, 4, 0, 0, garbage);
  memcpy(f + WIRE_HEADER_SIZE, garbage, 4);
  expect_decode_error(f, WIRE_HEADER_SIZE + 4, 0, ZS_EPROTO, "is not a valid zshard.v1.DataPull");
  /* The reader reports it with the request id and carries on. */
  wire_msg ping = {.type = WIRE_PING, .request_id = 32};
  size_t lp = 0;
  assert_int_equal(wire_encode(&ping, f + WIRE_HEADER_SIZE + 4, WIRE_HEADER_SIZE, &lp), 0);
  wire_reader r;
  wire_reader_init(&r, 0);
  wire_event ev;
  size_t off = wire_reader_feed(&r, f, sizeof f, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  assert_int_equal(r.meta_status, ZS_EPROTO);
  assert_int_equal(r.msg.request_id, 31);
  assert_int_equal(r.msg.type, WIRE_PULL);
  /* A refused frame's payload can only be skipped. */
  uint8_t dst[1];
  assert_int_equal(wire_reader_set_payload(&r, dst), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload(&r, NULL), 0);
  off += wire_reader_feed(&r, f + off, sizeof f - off, &ev);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(reader_first_event(&r, f + off, sizeof f - off, NULL), WIRE_EV_DONE);
  assert_int_equal(r.msg.type, WIRE_PING);
  assert_int_equal(r.msg.request_id, 32);
  wire_reader_free(&r);
}

static void a_dtype_that_is_not_ours_is_refused_with_edtype(void **state) {
  (void)state;
  uint8_t f[BIG];
  wire_msg m = push_msg(4);
  m.u.push.dtype = 0;
  size_t len = frame(f, sizeof f, &m, "ab", 2);
  expect_decode_error(f, len, 0, ZS_EDTYPE, "PUSH frame (request id 4) has dtype 0");
  m = (wire_msg){.type = WIRE_PULL, .request_id = 5};
  m.u.pull.dtype = 77;
  len = frame(f, sizeof f, &m, NULL, 0);
  expect_decode_error(f, len, 0, ZS_EDTYPE, "has dtype 77");
  m = (wire_msg){.type = WIRE_PULL_DATA, .request_id = 6};
  m.u.pull_data.dtype = -3;
  len = frame(f, sizeof f, &m, "abcd", 4);
  expect_decode_error(f, len, 0, ZS_EDTYPE, "has dtype -3");
}

static void an_error_frame_must_carry_a_zshard_error_status(void **state) {
  (void)state;
  uint8_t f[BIG];
  const int bad[] = {0, 1, -1000};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    wire_msg m = {.type = WIRE_ERROR, .request_id = 8};
    m.u.error.status = bad[i];
    size_t len = frame(f, sizeof f, &m, NULL, 0);
    expect_decode_error(f, len, 0, ZS_EPROTO, "not a zshard error");
  }
}

static void error_messages_are_cut_and_cleaned_of_control_bytes(void **state) {
  (void)state;
  uint8_t f[BIG];
  wire_msg m = {.type = WIRE_ERROR, .request_id = 8};
  m.u.error.status = ZS_EINVAL;
  memset(m.u.error.message, 'x', sizeof m.u.error.message); /* not even terminated */
  m.u.error.message[3] = '\n';
  m.u.error.message[4] = '\033';
  size_t len = frame(f, sizeof f, &m, NULL, 0);
  wire_msg out;
  const uint8_t *pl;
  size_t flen;
  assert_int_equal(wire_decode_frame(f, len, 0, &out, &pl, &flen, NULL, 0), 0);
  assert_int_equal(strlen(out.u.error.message), WIRE_MAX_MESSAGE);
  assert_memory_equal(out.u.error.message, "xxx??xx", 7);
  /* A multi-byte character is never cut in half (proto3 strings are UTF-8). */
  memset(m.u.error.message, 0, sizeof m.u.error.message);
  memset(m.u.error.message, 'y', WIRE_MAX_MESSAGE - 1);
  memcpy(m.u.error.message + WIRE_MAX_MESSAGE - 1, "\xc3\xa9", 2); /* é straddles the cut */
  len = frame(f, sizeof f, &m, NULL, 0);
  assert_int_equal(wire_decode_frame(f, len, 0, &out, &pl, &flen, NULL, 0), 0);
  assert_int_equal(strlen(out.u.error.message), WIRE_MAX_MESSAGE - 1);
}

static void every_single_bit_flip_of_a_frame_is_detected(void **state) {
  (void)state;
  uint8_t f[BIG];
  uint8_t payload[48];
  for (size_t i = 0; i < sizeof payload; i++)
    payload[i] = (uint8_t)rng32();
  wire_msg m = push_msg(0xabcdef);
  size_t len = frame(f, sizeof f, &m, payload, sizeof payload);
  for (size_t bit = 0; bit < 8 * len; bit++) {
    f[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    wire_msg out;
    const uint8_t *pl;
    size_t flen;
    int rc = wire_decode_frame(f, len, 0, &out, &pl, &flen, NULL, 0);
    if (rc == 0)
      fail_msg("flipping bit %zu (byte %zu) went unnoticed", bit, bit / 8);
    f[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  }
  wire_msg out;
  const uint8_t *pl;
  size_t flen;
  assert_int_equal(wire_decode_frame(f, len, 0, &out, &pl, &flen, NULL, 0), 0);
}

static void resealed_edits_reach_the_field_checks(void **state) {
  (void)state;
  /* With the header CRC recomputed, an edited field is judged on its own. */
  uint8_t f[BIG];
  wire_msg m = {.type = WIRE_PULL, .request_id = 1};
  m.u.pull.dtype = ZS_DTYPE_FP32;
  size_t len = frame(f, sizeof f, &m, NULL, 0);
  f[5] = WIRE_PING; /* a PULL meta on a PING */
  reseal(f);
  expect_decode_error(f, len, 0, ZS_EPROTO, "PING frame carries a meta");
}

/* ------------------------------------------------------------ misuse */

static void encoder_refuses_what_it_cannot_frame(void **state) {
  (void)state;
  uint8_t f[BIG];
  size_t len = 0;
  wire_msg m = {.type = (wire_type)14};
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  /* A token over the limit, or a length without bytes. */
  static uint8_t tok[WIRE_MAX_TOKEN + 1];
  m = (wire_msg){.type = WIRE_HELLO};
  m.u.hello.token = tok;
  m.u.hello.token_len = WIRE_MAX_TOKEN + 1;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  m.u.hello.token = NULL;
  m.u.hello.token_len = 1;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  m = (wire_msg){.type = WIRE_PULL, .payload_len = 1};
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  m = push_msg(1);
  assert_int_equal(wire_encode(&m, f, WIRE_HEADER_SIZE, &len), ZS_EINVAL);
  m = (wire_msg){.type = WIRE_ERROR};
  m.u.error.status = ZS_EINVAL;
  memset(m.u.error.message, 'z', WIRE_MAX_MESSAGE);
  assert_int_equal(wire_encode(&m, f, WIRE_MAX_ENCODED, &len), 0);
  assert_true(len <= WIRE_MAX_ENCODED);
}

/* ------------------------------------------------------------ batches */

static wire_piece piece(uint32_t tensor, uint32_t slice, int dtype, uint64_t length) {
  return (wire_piece){.tensor = tensor, .slice = slice, .dtype = dtype, .length = length};
}

static void decode_ok(const uint8_t *f, size_t len, wire_msg *out, const uint8_t **pl) {
  size_t flen = 0;
  char err[WIRE_ERRLEN] = "";
  int rc = wire_decode_frame(f, len, 0, out, pl, &flen, err, sizeof err);
  if (rc)
    fail_msg("%s", err);
  assert_int_equal(flen, len);
}

static void batch_frames_round_trip_with_every_piece_in_order(void **state) {
  (void)state;
  static uint8_t f[WIRE_MAX_BATCH_ENCODED + 4096];
  uint8_t payload[100];
  for (size_t i = 0; i < sizeof payload; i++)
    payload[i] = (uint8_t)rng32();
  static wire_msg m, out;
  static wire_piece pcs[WIRE_MAX_BATCH];
  static int32_t st[WIRE_MAX_BATCH];
  static uint8_t dup[WIRE_MAX_BATCH];
  static uint64_t lens[WIRE_MAX_BATCH];
  const uint8_t *pl = NULL;

  m = (wire_msg){.type = WIRE_PUSH_BATCH, .request_id = 11};
  m.u.push_batch.pieces = pcs;
  m.u.push_batch.spec_hash = 0xfeedfacecafebeefull;
  m.u.push_batch.step = 9;
  m.u.push_batch.rank = 2;
  m.u.push_batch.micro = 3;
  m.u.push_batch.npieces = 3;
  pcs[0] = piece(4, 0, ZS_DTYPE_FP32, 40);
  pcs[1] = piece(7, 1, ZS_DTYPE_BF16, 0);
  pcs[2] = piece(UINT32_MAX, 5, ZS_DTYPE_FP16, 60);
  decode_ok(f, frame(f, sizeof f, &m, payload, sizeof payload), &out, &pl);
  /* Batch frames say version 2, which defines them. */
  assert_int_equal(f[4], 2);
  assert_int_equal(out.type, WIRE_PUSH_BATCH);
  assert_int_equal(out.u.push_batch.spec_hash, m.u.push_batch.spec_hash);
  assert_int_equal(out.u.push_batch.step, 9);
  assert_int_equal(out.u.push_batch.rank, 2);
  assert_int_equal(out.u.push_batch.micro, 3);
  assert_int_equal(out.u.push_batch.npieces, 3);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(out.u.push_batch.pieces[i].tensor, pcs[i].tensor);
    assert_int_equal(out.u.push_batch.pieces[i].slice, pcs[i].slice);
    assert_int_equal(out.u.push_batch.pieces[i].dtype, pcs[i].dtype);
    assert_int_equal(out.u.push_batch.pieces[i].length, pcs[i].length);
  }
  assert_memory_equal(pl, payload, sizeof payload);

  m = (wire_msg){.type = WIRE_PUSH_BATCH_ACK, .request_id = 11};
  m.u.push_batch_ack.npieces = 3;
  m.u.push_batch_ack.status = st;
  m.u.push_batch_ack.duplicate = dup;
  st[1] = ZS_ESTEP;
  dup[2] = 1;
  strcpy(m.u.push_batch_ack.message, "piece 1: push for step 9 but the shard expects step 8");
  decode_ok(f, frame(f, sizeof f, &m, NULL, 0), &out, &pl);
  assert_int_equal(out.u.push_batch_ack.npieces, 3);
  assert_int_equal(out.u.push_batch_ack.status[0], 0);
  assert_int_equal(out.u.push_batch_ack.status[1], ZS_ESTEP);
  assert_int_equal(out.u.push_batch_ack.status[2], 0);
  assert_int_equal(out.u.push_batch_ack.duplicate[0], 0);
  assert_int_equal(out.u.push_batch_ack.duplicate[2], 1);
  assert_string_equal(out.u.push_batch_ack.message, m.u.push_batch_ack.message);

  /* The largest batch, with the widest values, fits WIRE_MAX_BATCH_ENCODED. */
  m = (wire_msg){.type = WIRE_PULL_BATCH, .request_id = 12};
  m.u.pull_batch.spec_hash = ~0ull;
  m.u.pull_batch.min_version = ~0ull;
  m.u.pull_batch.timeout_ms = UINT32_MAX;
  m.u.pull_batch.npieces = WIRE_MAX_BATCH;
  m.u.pull_batch.pieces = pcs;
  for (uint32_t i = 0; i < WIRE_MAX_BATCH; i++)
    pcs[i] = piece(UINT32_MAX - i, UINT32_MAX, ZS_DTYPE_BF16, ~0ull);
  size_t len = 0;
  assert_int_equal(wire_encode(&m, f, WIRE_MAX_BATCH_ENCODED, &len), 0);
  decode_ok(f, len, &out, &pl);
  assert_int_equal(out.u.pull_batch.npieces, WIRE_MAX_BATCH);
  assert_int_equal(out.u.pull_batch.timeout_ms, UINT32_MAX);
  assert_int_equal(out.u.pull_batch.pieces[WIRE_MAX_BATCH - 1].tensor,
                   UINT32_MAX - (WIRE_MAX_BATCH - 1));
  assert_int_equal(out.u.pull_batch.pieces[7].length, ~0ull);

  m = (wire_msg){.type = WIRE_PUSH_BATCH_ACK, .request_id = ~0ull};
  m.u.push_batch_ack.npieces = WIRE_MAX_BATCH;
  m.u.push_batch_ack.status = st;
  m.u.push_batch_ack.duplicate = dup;
  for (uint32_t i = 0; i < WIRE_MAX_BATCH; i++) {
    st[i] = ZS_EINTERNAL;
    dup[i] = 1;
  }
  memset(m.u.push_batch_ack.message, 'q', WIRE_MAX_MESSAGE);
  assert_int_equal(wire_encode(&m, f, WIRE_MAX_BATCH_ENCODED, &len), 0);

  m = (wire_msg){.type = WIRE_PULL_BATCH_DATA, .request_id = 13};
  m.u.pull_batch_data.version = 1ull << 50;
  m.u.pull_batch_data.npieces = 2;
  m.u.pull_batch_data.length = lens;
  lens[0] = 99;
  lens[1] = 1;
  decode_ok(f, frame(f, sizeof f, &m, payload, sizeof payload), &out, &pl);
  assert_int_equal(out.u.pull_batch_data.version, 1ull << 50);
  assert_int_equal(out.u.pull_batch_data.npieces, 2);
  assert_int_equal(out.u.pull_batch_data.length[0], 99);
  assert_int_equal(out.u.pull_batch_data.length[1], 1);
  assert_memory_equal(pl, payload, sizeof payload);
}

/* A version-2 frame of batch `type` around a meta packed from `msg` (any
 * field values, so that the decoder's own checks are reached) and `plen`
 * payload bytes. */
static size_t raw_frame(uint8_t *f, size_t cap, uint8_t type, const ProtobufCMessage *msg,
                        const uint8_t *payload, size_t plen) {
  size_t mlen = protobuf_c_message_get_packed_size(msg);
  assert_true(WIRE_HEADER_SIZE + mlen + plen <= cap);
  protobuf_c_message_pack(msg, f + WIRE_HEADER_SIZE);
  raw_header(f, WIRE_MAGIC, 2, type, 0, 77, plen, (uint32_t)mlen,
             plen ? crc32c(0, payload, plen) : 0, 0, f + WIRE_HEADER_SIZE);
  if (plen)
    memcpy(f + WIRE_HEADER_SIZE + mlen, payload, plen);
  return WIRE_HEADER_SIZE + mlen + plen;
}

static Zshard__V1__DataPiece pb_pieces[WIRE_MAX_BATCH + 1];
static Zshard__V1__DataPiece *pb_ptrs[WIRE_MAX_BATCH + 1];

/* A piece list of n pieces of `length` bytes each. */
static Zshard__V1__DataPiece **pb_list(size_t n, uint64_t length) {
  for (size_t i = 0; i < n; i++) {
    pb_pieces[i] = (Zshard__V1__DataPiece)ZSHARD__V1__DATA_PIECE__INIT;
    pb_pieces[i].tensor = (uint32_t)i;
    pb_pieces[i].dtype = ZSHARD__V1__DTYPE__DTYPE_FP32;
    pb_pieces[i].length = length;
    pb_ptrs[i] = &pb_pieces[i];
  }
  return pb_ptrs;
}

static void expect_push_batch_error(size_t n, uint64_t length, size_t plen, int status,
                                    const char *needle) {
  static uint8_t f[WIRE_MAX_BATCH_ENCODED + 4096];
  static uint8_t payload[1024];
  Zshard__V1__DataPushBatch b = ZSHARD__V1__DATA_PUSH_BATCH__INIT;
  b.n_pieces = n;
  b.pieces = pb_list(n, length);
  size_t len = raw_frame(f, sizeof f, WIRE_PUSH_BATCH, &b.base, payload, plen);
  expect_decode_error(f, len, 0, status, needle);
}

static void malformed_push_batches_are_refused_per_request(void **state) {
  (void)state;
  expect_push_batch_error(0, 0, 0, ZS_ERANGE, "has 0 pieces; a batch holds 1 to 256");
  expect_push_batch_error(WIRE_MAX_BATCH + 1, 0, 0, ZS_ERANGE, "has 257 pieces");
  /* Lengths short of the payload, past it, and one so large that a plain sum
   * would wrap round to the payload length. */
  expect_push_batch_error(3, 8, 32, ZS_ERANGE, "pieces add up to 24 bytes but the payload has 32");
  expect_push_batch_error(3, 16, 32, ZS_ERANGE, "piece 2 of 16 bytes runs past the 32-byte");
  expect_push_batch_error(1, ~0ull, 32, ZS_ERANGE, "piece 0 of 18446744073709551615 bytes runs");
  pb_list(2, 0);
  static uint8_t f[4096];
  static uint8_t payload[16];
  Zshard__V1__DataPushBatch b = ZSHARD__V1__DATA_PUSH_BATCH__INIT;
  b.n_pieces = 2;
  b.pieces = pb_list(2, 8);
  pb_pieces[1].length = UINT64_MAX - 7; /* 8 + this wraps to 0 */
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH, &b.base, payload, 16), 0,
                      ZS_ERANGE, "piece 1 of");
  b.pieces = pb_list(2, 8);
  pb_pieces[1].dtype = (Zshard__V1__DType)77;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH, &b.base, payload, 16), 0,
                      ZS_EDTYPE, "piece 1 has dtype 77");

  /* The framing is intact, so a reader reports the refusal with the request
   * id, skips the payload and decodes the next frame. */
  b.pieces = pb_list(2, 4);
  size_t la = raw_frame(f, sizeof f, WIRE_PUSH_BATCH, &b.base, payload, 16);
  wire_msg ping = {.type = WIRE_PING, .request_id = 78};
  size_t lp = 0;
  assert_int_equal(wire_encode(&ping, f + la, sizeof f - la, &lp), 0);
  wire_reader r;
  wire_reader_init(&r, 0);
  wire_event ev;
  size_t off = wire_reader_feed(&r, f, la + lp, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  assert_int_equal(r.meta_status, ZS_ERANGE);
  assert_int_equal(r.msg.request_id, 77);
  assert_int_equal(wire_reader_set_payload(&r, NULL), 0);
  off += wire_reader_feed(&r, f + off, la + lp - off, &ev);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(reader_first_event(&r, f + off, la + lp - off, NULL), WIRE_EV_DONE);
  assert_int_equal(r.msg.type, WIRE_PING);
  assert_int_equal(r.msg.request_id, 78);
  wire_reader_free(&r);
}

static void malformed_batch_answers_and_pull_batches_are_refused(void **state) {
  (void)state;
  static uint8_t f[WIRE_MAX_BATCH_ENCODED + 4096];
  static uint8_t payload[64];
  Zshard__V1__DataPullBatch q = ZSHARD__V1__DATA_PULL_BATCH__INIT;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH, &q.base, NULL, 0), 0, ZS_ERANGE,
                      "PULL_BATCH frame (request id 77) has 0 pieces");
  q.n_pieces = WIRE_MAX_BATCH + 1;
  q.pieces = pb_list(WIRE_MAX_BATCH + 1, 4);
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH, &q.base, NULL, 0), 0, ZS_ERANGE,
                      "has 257 pieces");
  q.n_pieces = 3;
  pb_pieces[2].dtype = (Zshard__V1__DType)0;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH, &q.base, NULL, 0), 0, ZS_EDTYPE,
                      "piece 2 has dtype 0");
  /* A pull batch carries no payload. */
  pb_list(3, 4);
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH, &q.base, payload, 4), 0, ZS_EPROTO,
                      "carries a payload of 4 bytes; it has none");

  Zshard__V1__DataPushBatchAck a = ZSHARD__V1__DATA_PUSH_BATCH_ACK__INIT;
  int32_t st[3] = {0, ZS_ESTEP, 0};
  protobuf_c_boolean dup[3] = {0, 0, 1};
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH_ACK, &a.base, NULL, 0), 0,
                      ZS_ERANGE, "has 0 statuses and 0 duplicate flags");
  a.n_status = 3;
  a.status = st;
  a.n_duplicate = 2;
  a.duplicate = dup;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH_ACK, &a.base, NULL, 0), 0,
                      ZS_ERANGE, "has 3 statuses and 2 duplicate flags");
  a.n_duplicate = 3;
  st[1] = 5;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH_ACK, &a.base, NULL, 0), 0,
                      ZS_EPROTO, "piece 1 has status 5, not 0 or a zshard error");
  st[1] = -9999;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PUSH_BATCH_ACK, &a.base, NULL, 0), 0,
                      ZS_EPROTO, "piece 1 has status -9999");

  Zshard__V1__DataPullBatchData d = ZSHARD__V1__DATA_PULL_BATCH_DATA__INIT;
  uint64_t lens[2] = {8, 8};
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH_DATA, &d.base, payload, 16), 0,
                      ZS_ERANGE, "PULL_BATCH_DATA frame (request id 77) has 0 pieces");
  d.n_length = 2;
  d.length = lens;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH_DATA, &d.base, payload, 20), 0,
                      ZS_ERANGE, "pieces add up to 16 bytes but the payload has 20");
  lens[1] = UINT64_MAX - 7;
  expect_decode_error(f, raw_frame(f, sizeof f, WIRE_PULL_BATCH_DATA, &d.base, payload, 16), 0,
                      ZS_ERANGE, "piece 1 of");
}

static void encoder_refuses_a_batch_without_pieces_or_over_the_bound(void **state) {
  (void)state;
  static uint8_t f[WIRE_MAX_BATCH_ENCODED];
  static wire_msg m;
  size_t len = 0;
  const wire_type types[] = {WIRE_PUSH_BATCH, WIRE_PUSH_BATCH_ACK, WIRE_PULL_BATCH,
                             WIRE_PULL_BATCH_DATA};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
    memset(&m, 0, sizeof m);
    m.type = types[i];
    assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  }
  static wire_piece one[WIRE_MAX_BATCH + 1];
  one[0] = piece(0, 0, ZS_DTYPE_FP32, 4);
  m = (wire_msg){.type = WIRE_PULL_BATCH};
  m.u.pull_batch.pieces = one;
  m.u.pull_batch.npieces = WIRE_MAX_BATCH + 1;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  /* Pieces that are not there. */
  m.u.pull_batch.npieces = 1;
  m.u.pull_batch.pieces = NULL;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  /* A pull batch has no payload to announce. */
  m.u.pull_batch.pieces = one;
  m.payload_len = 4;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), ZS_EINVAL);
  m.payload_len = 0;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), 0);
}

static void reader_refuses_feeding_on_without_a_payload_destination(void **state) {
  (void)state;
  uint8_t f[2 * BIG];
  wire_msg a = push_msg(1);
  size_t la = frame(f, sizeof f, &a, "abcd", 4);
  wire_reader r;
  wire_reader_init(&r, 0);
  wire_event ev;
  size_t off = wire_reader_feed(&r, f, la, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  assert_int_equal(wire_reader_feed(&r, f + off, la - off, &ev), 0);
  assert_int_equal(ev, WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload(&r, NULL), ZS_EINVAL);
  assert_int_equal(wire_reader_commit(&r, 1), WIRE_EV_FATAL);
  wire_reader_free(&r);
}

/* HELLO carries the token byte for byte (any bytes, none at all included)
 * and HELLO_ACK nothing; both say version 3. */
static void hello_frames_round_trip_with_their_token(void **state) {
  (void)state;
  static uint8_t f[WIRE_HEADER_SIZE + WIRE_MAX_HELLO_META];
  static uint8_t tok[WIRE_MAX_TOKEN];
  for (size_t i = 0; i < sizeof tok; i++)
    tok[i] = (uint8_t)(i * 7u + 1u);
  const uint32_t lens[] = {0, 1, 16, WIRE_MAX_TOKEN};
  for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
    wire_msg m = {.type = WIRE_HELLO, .request_id = 9};
    m.u.hello.token = tok;
    m.u.hello.token_len = lens[k];
    size_t len = 0;
    assert_int_equal(wire_encode(&m, f, sizeof f, &len), 0);
    assert_int_equal(f[4], 3);
    assert_true(len - WIRE_HEADER_SIZE <= WIRE_MAX_HELLO_META);
    wire_msg out;
    const uint8_t *pl = NULL;
    size_t flen = 0;
    char err[WIRE_ERRLEN] = "";
    assert_int_equal(wire_decode_frame(f, len, 0, &out, &pl, &flen, err, sizeof err), 0);
    assert_int_equal(out.type, WIRE_HELLO);
    assert_int_equal(out.request_id, 9);
    assert_int_equal(out.u.hello.token_len, lens[k]);
    if (lens[k])
      assert_memory_equal(out.u.hello.token, tok, lens[k]);
  }
  wire_msg ack = {.type = WIRE_HELLO_ACK, .request_id = 9};
  size_t len = 0;
  assert_int_equal(wire_encode(&ack, f, sizeof f, &len), 0);
  assert_int_equal(len, WIRE_HEADER_SIZE);
  assert_int_equal(f[4], 3);
  /* A HELLO_ACK with a meta is refused as any type without one. */
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 3, WIRE_HELLO_ACK, 0, 1, 0, 4, 0, 0, NULL);
  expect_decode_error(h, sizeof h, 0, ZS_EPROTO, "HELLO_ACK frame carries a meta of 4 bytes");
}

/* A reader held to a small meta (a server before the HELLO) refuses a
 * longer one from its header alone, before sizing any buffer from it. */
static void a_reader_limited_to_a_small_meta_refuses_a_longer_one_from_the_header(void **state) {
  (void)state;
  uint8_t h[WIRE_HEADER_SIZE];
  raw_header(h, WIRE_MAGIC, 3, WIRE_HELLO, 0, 1, 0, WIRE_MAX_META, 0, 0, NULL);
  wire_reader r;
  wire_reader_init(&r, 0);
  wire_reader_limit_meta(&r, WIRE_MAX_HELLO_META);
  assert_int_equal(reader_first_event(&r, h, sizeof h, NULL), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_ERANGE);
  assert_non_null(strstr(r.err, "exceeds this side's limit"));
  assert_null(r.meta);
  wire_reader_free(&r);
}

/* ------------------------------------------------------------ scatter */

/* A payload scattered over segments of separate buffers, zero-length ones
 * first, in the middle and last, as a pull batch's pieces are. */
enum { SC_N = 7, SC_TOTAL = 321 };
static const size_t SC_LEN[SC_N] = {0, 7, 1, 0, 300, 13, 0};

/* A PULL_BATCH_DATA frame (id 21) of SC_TOTAL random bytes cut as SC_LEN,
 * then a PUSH (id 22) of 5 bytes, in one stream. */
typedef struct scatter_case {
  uint8_t stream[2 * BIG];
  size_t total;
  uint8_t payload[SC_TOTAL];
} scatter_case;

static void scatter_case_build(scatter_case *k, int corrupt) {
  uint64_t lens[SC_N];
  for (int i = 0; i < SC_N; i++)
    lens[i] = SC_LEN[i];
  for (size_t i = 0; i < SC_TOTAL; i++)
    k->payload[i] = (uint8_t)rng32();
  wire_msg a = {.type = WIRE_PULL_BATCH_DATA, .request_id = 21};
  a.u.pull_batch_data = (wire_pull_batch_data){.version = 4, .npieces = SC_N, .length = lens};
  wire_msg b = push_msg(22);
  k->total = frame(k->stream, sizeof k->stream, &a, k->payload, SC_TOTAL);
  if (corrupt)
    k->stream[k->total - SC_TOTAL + 310] ^= 0x01; /* inside segment 5 */
  k->total += frame(k->stream + k->total, sizeof k->stream - k->total, &b, "hello", 5);
}

/* One step of a feed loop: n bytes at p go in through wire_reader_feed, or
 * with `direct` (when the reader offers room) are written at
 * wire_reader_space and committed, as a socket read would. Returns how many
 * were taken and the event. */
static size_t scatter_step(wire_reader *r, const uint8_t *p, size_t n, int direct, wire_event *ev) {
  size_t space = 0;
  uint8_t *sp = direct ? wire_reader_space(r, &space) : NULL;
  if (!sp)
    return wire_reader_feed(r, p, n, ev);
  assert_true(space > 0); /* room offered is room to fill: no spinning on an empty segment */
  size_t k = space < n ? space : n;
  memcpy(sp, p, k);
  *ev = wire_reader_commit(r, k);
  return k;
}

/* Feeds k's stream to a fresh reader: its first `first` bytes in one piece,
 * then pieces of `chunk` bytes (0: random sizes). The first frame's payload
 * goes to SC_N separately allocated segments (a zero-length one has a guard
 * byte, or no base at all, behind it); the second must come out whole after
 * it. Returns the first frame's payload_status, its bytes checked when 0. */
static int scatter_feed(const scatter_case *k, size_t first, size_t chunk, int direct) {
  uint8_t *mem[SC_N];
  uint8_t guard = 0xa5, small[5];
  wire_seg segs[SC_N];
  for (int i = 0; i < SC_N; i++) {
    mem[i] = SC_LEN[i] ? malloc(SC_LEN[i]) : NULL;
    segs[i] = (wire_seg){.base = SC_LEN[i] ? mem[i] : i == 0 ? NULL : &guard, .len = SC_LEN[i]};
  }
  wire_reader r;
  wire_reader_init(&r, 0);
  int done = 0, st = -1;
  size_t off = 0;
  while (off < k->total) {
    size_t n = off == 0 ? first : chunk ? chunk : 1 + rng32() % 97;
    if (n > k->total - off)
      n = k->total - off;
    for (size_t used = 0; used < n;) {
      wire_event ev;
      used += scatter_step(&r, k->stream + off + used, n - used, direct, &ev);
      assert_int_not_equal(ev, WIRE_EV_FATAL);
      if (ev == WIRE_EV_META && r.msg.request_id == 21)
        assert_int_equal(wire_reader_set_payload_segs(&r, segs, SC_N), 0);
      else if (ev == WIRE_EV_META)
        assert_int_equal(wire_reader_set_payload(&r, small), 0);
      else if (ev == WIRE_EV_DONE && done++ == 0)
        st = r.payload_status;
      else if (ev == WIRE_EV_DONE)
        assert_int_equal(r.payload_status, 0);
    }
    off += n;
  }
  assert_int_equal(done, 2);
  assert_memory_equal(small, "hello", 5);
  assert_int_equal(guard, 0xa5);
  size_t at = 0;
  for (int i = 0; i < SC_N; i++) {
    if (st == 0 && SC_LEN[i])
      assert_memory_equal(mem[i], k->payload + at, SC_LEN[i]);
    at += SC_LEN[i];
    free(mem[i]);
  }
  assert_false(wire_reader_mid_frame(&r));
  wire_reader_free(&r);
  return st;
}

static void a_scattered_payload_lands_in_its_segments_however_the_stream_is_cut(void **state) {
  (void)state;
  static scatter_case k;
  scatter_case_build(&k, 0);
  /* A cut at every offset: before, at and after every segment boundary and
   * inside every segment, the rest in one piece, fed or written directly. */
  for (size_t first = 1; first < k.total; first++) {
    assert_int_equal(scatter_feed(&k, first, k.total, 0), 0);
    assert_int_equal(scatter_feed(&k, first, k.total, 1), 0);
  }
  assert_int_equal(scatter_feed(&k, 1, 1, 0), 0);
  assert_int_equal(scatter_feed(&k, 1, 1, 1), 0);
  for (int i = 0; i < 20; i++) {
    assert_int_equal(scatter_feed(&k, 1 + rng32() % 97, 0, 0), 0);
    assert_int_equal(scatter_feed(&k, 1 + rng32() % 97, 0, 1), 0);
  }
}

static void
a_scattered_payload_that_fails_its_crc_is_refused_and_the_next_frame_decodes(void **state) {
  (void)state;
  static scatter_case k;
  scatter_case_build(&k, 1);
  assert_int_equal(scatter_feed(&k, k.total, k.total, 0), ZS_ECRC);
  assert_int_equal(scatter_feed(&k, 1, 1, 0), ZS_ECRC);
  assert_int_equal(scatter_feed(&k, 1, 1, 1), ZS_ECRC);
  assert_int_equal(scatter_feed(&k, 50, 0, 1), ZS_ECRC);
}

/* A fresh reader at the META event of a 10-byte PUSH frame in f. */
static size_t reader_at_meta(wire_reader *r, uint8_t *f, size_t cap, size_t *len) {
  wire_msg m = push_msg(5);
  *len = frame(f, cap, &m, "0123456789", 10);
  wire_reader_init(r, 0);
  wire_event ev;
  size_t off = wire_reader_feed(r, f, *len, &ev);
  assert_int_equal(ev, WIRE_EV_META);
  return off;
}

static void segments_that_do_not_cover_the_payload_exactly_are_refused(void **state) {
  (void)state;
  uint8_t f[BIG], a[10], b[10];
  size_t len = 0;
  wire_reader r;
  size_t off = reader_at_meta(&r, f, sizeof f, &len);
  static wire_seg many[WIRE_MAX_BATCH + 1];
  for (uint32_t i = 0; i < WIRE_MAX_BATCH + 1; i++)
    many[i] = (wire_seg){.base = a, .len = 0};
  const wire_seg short_[] = {{a, 4}, {b, 5}};
  const wire_seg long_[] = {{a, 4}, {b, 7}};
  const wire_seg wrapping[] = {{a, 4}, {b, SIZE_MAX - 1}};
  const wire_seg no_base[] = {{a, 4}, {NULL, 6}};
  assert_int_equal(wire_reader_set_payload_segs(&r, short_, 2), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload_segs(&r, long_, 2), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload_segs(&r, wrapping, 2), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload_segs(&r, no_base, 2), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload_segs(&r, short_, 0), ZS_EINVAL);
  assert_int_equal(wire_reader_set_payload_segs(&r, NULL, 1), ZS_EINVAL);
  many[WIRE_MAX_BATCH].len = 10;
  assert_int_equal(wire_reader_set_payload_segs(&r, many, WIRE_MAX_BATCH + 1), ZS_EINVAL);
  /* Refusals changed nothing: the reader still waits, and the most
   * segments allowed (all but the last empty) are taken. */
  many[WIRE_MAX_BATCH - 1].len = 10;
  many[WIRE_MAX_BATCH - 1].base = b;
  assert_int_equal(wire_reader_set_payload_segs(&r, many, WIRE_MAX_BATCH), 0);
  assert_int_equal(wire_reader_set_payload_segs(&r, many, WIRE_MAX_BATCH), ZS_EINVAL);
  wire_event ev;
  assert_int_equal(wire_reader_feed(&r, f + off, len - off, &ev), len - off);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(r.payload_status, 0);
  assert_memory_equal(b, "0123456789", 10);
  wire_reader_free(&r);
}

static void a_commit_never_runs_past_the_current_segment(void **state) {
  (void)state;
  uint8_t f[BIG], a[4], b[6];
  size_t len = 0;
  wire_reader r;
  reader_at_meta(&r, f, sizeof f, &len);
  const wire_seg segs[] = {{a, 4}, {b, 6}};
  assert_int_equal(wire_reader_set_payload_segs(&r, segs, 2), 0);
  size_t room = 0;
  assert_ptr_equal(wire_reader_space(&r, &room), a);
  assert_int_equal(room, 4);
  assert_int_equal(wire_reader_commit(&r, 3), WIRE_EV_NONE);
  assert_ptr_equal(wire_reader_space(&r, &room), a + 3);
  assert_int_equal(room, 1);
  /* Two bytes would run into memory that is not the payload's. */
  assert_int_equal(wire_reader_commit(&r, 2), WIRE_EV_FATAL);
  assert_int_equal(r.status, ZS_EINVAL);
  wire_reader_free(&r);
}

static void skipping_the_rest_releases_every_segment(void **state) {
  (void)state;
  uint8_t f[BIG], a[4], b[6] = {0};
  size_t len = 0;
  wire_reader r;
  size_t off = reader_at_meta(&r, f, sizeof f, &len);
  const wire_seg segs[] = {{a, 4}, {b, 6}};
  assert_int_equal(wire_reader_set_payload_segs(&r, segs, 2), 0);
  wire_event ev;
  off += wire_reader_feed(&r, f + off, 5, &ev); /* segment 0 and one byte of 1 */
  assert_int_equal(ev, WIRE_EV_NONE);
  assert_int_equal(b[0], '4');
  wire_reader_skip_rest(&r);
  size_t room = 1;
  assert_null(wire_reader_space(&r, &room));
  assert_int_equal(room, 0);
  off += wire_reader_feed(&r, f + off, len - off, &ev);
  assert_int_equal(ev, WIRE_EV_DONE);
  assert_int_equal(off, len);
  assert_int_equal(r.payload_status, 0); /* a skipped payload is not checked */
  assert_int_equal(b[1], 0);
  wire_reader_free(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(header_fields_sit_at_their_documented_little_endian_offsets),
      cmocka_unit_test(every_frame_type_round_trips_through_encode_and_decode),
      cmocka_unit_test(reader_reassembles_frames_fed_one_byte_at_a_time),
      cmocka_unit_test(reader_reassembles_frames_fed_in_random_pieces),
      cmocka_unit_test(reader_accepts_payload_bytes_written_directly_into_the_destination),
      cmocka_unit_test(reader_skips_a_payload_when_told_to_and_stays_in_step),
      cmocka_unit_test(bad_magic_is_refused_as_not_our_protocol),
      cmocka_unit_test(unsupported_version_is_refused),
      cmocka_unit_test(unknown_frame_type_is_refused),
      cmocka_unit_test(flags_and_reserved_bits_must_be_zero),
      cmocka_unit_test(oversized_meta_length_is_refused_before_reading_it),
      cmocka_unit_test(oversized_payload_length_is_refused_against_the_receivers_limit),
      cmocka_unit_test(payload_or_meta_on_a_type_without_them_is_refused),
      cmocka_unit_test(truncated_frames_are_refused_at_every_length),
      cmocka_unit_test(header_crc_mismatch_is_fatal),
      cmocka_unit_test(payload_crc_mismatch_refuses_that_frame_and_the_next_one_decodes),
      cmocka_unit_test(meta_that_does_not_parse_is_a_per_request_error),
      cmocka_unit_test(a_dtype_that_is_not_ours_is_refused_with_edtype),
      cmocka_unit_test(an_error_frame_must_carry_a_zshard_error_status),
      cmocka_unit_test(error_messages_are_cut_and_cleaned_of_control_bytes),
      cmocka_unit_test(every_single_bit_flip_of_a_frame_is_detected),
      cmocka_unit_test(resealed_edits_reach_the_field_checks),
      cmocka_unit_test(encoder_refuses_what_it_cannot_frame),
      cmocka_unit_test(hello_frames_round_trip_with_their_token),
      cmocka_unit_test(a_reader_limited_to_a_small_meta_refuses_a_longer_one_from_the_header),
      cmocka_unit_test(reader_refuses_feeding_on_without_a_payload_destination),
      cmocka_unit_test(batch_frames_round_trip_with_every_piece_in_order),
      cmocka_unit_test(malformed_push_batches_are_refused_per_request),
      cmocka_unit_test(malformed_batch_answers_and_pull_batches_are_refused),
      cmocka_unit_test(encoder_refuses_a_batch_without_pieces_or_over_the_bound),
      cmocka_unit_test(a_scattered_payload_lands_in_its_segments_however_the_stream_is_cut),
      cmocka_unit_test(
          a_scattered_payload_that_fails_its_crc_is_refused_and_the_next_frame_decodes),
      cmocka_unit_test(segments_that_do_not_cover_the_payload_exactly_are_refused),
      cmocka_unit_test(a_commit_never_runs_past_the_current_segment),
      cmocka_unit_test(skipping_the_rest_releases_every_segment),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
