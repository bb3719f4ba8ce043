/*
 * wire_reader — the streaming reader: frames fed in pieces of any size, the
 * header and meta collected and decoded (wire_decode.c), the payload
 * received into the caller's segments or skipped, its CRC checked. The only
 * allocations are the meta buffer and a batch's arrays, kept across frames.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/crc32c.h"
#include "common/base/status.h"
#include "common/net/wire.h"
#include "common/net/wire_internal.h"

enum {
  R_HEAD = 0, /* collecting the 40 header bytes */
  R_META,     /* collecting meta_len bytes */
  R_WAIT_DST, /* META reported; waiting for wire_reader_set_payload */
  R_PAYLOAD,  /* receiving (or skipping) the payload */
  R_FATAL,
};

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
  if (wire__type_of(r->h.type)->uses_store && !r->batch)
    r->batch = malloc(sizeof *r->batch); /* NULL: wire__decode_meta says out of memory */
  r->meta_status = wire__decode_meta(&r->h, r->meta, &r->msg, r->batch, r->err, sizeof r->err);
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
