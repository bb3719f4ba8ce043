/*
 * ckpt_read — the verified reader of one checkpoint file, and ckpt_load, which
 * fills a shard's state from a complete checkpoint, resharding when it was
 * written by another number of shards.
 *
 * The small sections (spec, optimizer, pieces) are verified by regenerating
 * them from the decoded spec and comparing bytes: a file whose piece table
 * disagrees with the layout our code computes for its spec is refused rather
 * than loaded with elements in the wrong places.
 */
#include "common/base/status.h"
#include "server/ckpt/ckpt_format.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/crc32c.h"
#include "common/base/le.h"

/* ------------------------------------------------------------------------ */
/* Reading                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct in_section {
  uint32_t kind;
  uint64_t off, len;
  uint32_t crc, got;
} in_section;

struct ckpt_reader {
  int fd;
  char path[CKPT_PATH_MAX];
  ckpt_header h;
  spec spec;
  layout lay;
  uint64_t arr_off[3]; /* file offset of each array, when present */
  int has[3];
  unsigned char client_state[CORE_MAX_CLIENT_STATE];
  size_t client_state_len;
  uint64_t *tensor_steps;     /* spec.num_tensors, or NULL without the section */
  core_member_state *members; /* owned, or NULL without the section */
};

const ckpt_header *ckpt_reader_header(const ckpt_reader *r) {
  return &r->h;
}
const spec *ckpt_reader_spec(const ckpt_reader *r) {
  return &r->spec;
}
const layout *ckpt_reader_layout(const ckpt_reader *r) {
  return &r->lay;
}
const unsigned char *ckpt_reader_client_state(const ckpt_reader *r, size_t *len) {
  *len = r->client_state_len;
  return r->client_state_len ? r->client_state : NULL;
}

const uint64_t *ckpt_reader_tensor_steps(const ckpt_reader *r) {
  return r->tensor_steps;
}

const core_member_state *ckpt_reader_members(const ckpt_reader *r) {
  return r->members;
}

void ckpt_reader_close(ckpt_reader *r) {
  if (!r)
    return;
  if (r->fd >= 0)
    close(r->fd);
  free(r->tensor_steps);
  if (r->members)
    free((void *)r->members->log);
  free(r->members);
  layout_free(&r->lay);
  spec_free(&r->spec);
  free(r);
}

static int cmp_in_section(const void *a, const void *b) {
  uint64_t x = ((const in_section *)a)->off, y = ((const in_section *)b)->off;
  return x < y ? -1 : x > y;
}

/* One streaming pass over the whole file: the whole-file CRC, each section's
 * CRC, and zeros in every padding byte (bytes in no section past the
 * table). */
static int stream_verify(ckpt_reader *r, uint64_t size, uint64_t table_end, in_section *sec,
                         uint32_t nsec, uint32_t *file_crc, char *err, size_t errlen) {
  uint8_t *buf = malloc(CKPT_IO_BLOCK);
  if (!buf)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory verifying %s", r->path);
  uint32_t crc = 0;
  uint32_t next = 0; /* first section not yet wholly passed */
  int rc = 0;
  for (uint64_t pos = 0; pos < size;) {
    size_t k = size - pos < CKPT_IO_BLOCK ? (size_t)(size - pos) : CKPT_IO_BLOCK;
    if (ckpt__pread_full(r->fd, buf, k, pos) != 0) {
      rc = status_fail(err, errlen, ZS_EIO, "%s: read error at byte %" PRIu64 ": %s", r->path, pos,
                       errno == ENODATA ? "the file shrank while being read" : strerror(errno));
      break;
    }
    crc = crc32c(crc, buf, k);
    uint64_t end = pos + k;
    for (uint64_t x = pos < table_end ? table_end : pos; x < end;) {
      while (next < nsec && sec[next].off + sec[next].len <= x)
        next++;
      if (next < nsec && x >= sec[next].off) {
        uint64_t e = sec[next].off + sec[next].len < end ? sec[next].off + sec[next].len : end;
        sec[next].got = crc32c(sec[next].got, buf + (x - pos), (size_t)(e - x));
        x = e;
      } else {
        uint64_t e = next < nsec && sec[next].off < end ? sec[next].off : end;
        for (uint64_t y = x; y < e; y++) {
          if (buf[y - pos] != 0) {
            rc =
                status_fail(err, errlen, ZS_ECRC,
                            "%s: non-zero padding byte at offset %" PRIu64 " (the file is damaged)",
                            r->path, y);
            goto out;
          }
        }
        x = e;
      }
    }
    pos = end;
  }
out:
  free(buf);
  *file_crc = crc;
  return rc;
}

/* What ckpt_reader_open learns from the header and the section table, passed
 * between its steps. */
typedef struct reader_scan {
  uint64_t size;      /* the file's size */
  uint64_t table_end; /* first byte after the section table */
  uint32_t nsec, table_crc;
  uint32_t fmt;                      /* the file's format version */
  uint32_t max_kind;                 /* the last section kind the file's format has */
  in_section sec[CKPT_MAX_SECTIONS]; /* sorted by offset once verified */
  const in_section *spec, *optimizer, *pieces, *client_state, *tensor_steps, *members;
} reader_scan;

/* Opens the file and checks that it is a regular file of the size the
 * manifest recorded (when there is a manifest). */
static int reader_open_file(ckpt_reader *r, const ckpt_file_info *expect, reader_scan *s, char *err,
                            size_t errlen) {
  const char *path = r->path;
  int rc = ckpt__open_read(path, &r->fd, err, errlen);
  if (rc != 0)
    return rc;
  struct stat sb;
  if (fstat(r->fd, &sb) != 0)
    return status_fail(err, errlen, ZS_EIO, "cannot stat %s: %s", path, strerror(errno));
  s->size = (uint64_t)sb.st_size;
  if (expect && s->size != expect->bytes)
    return status_fail(err, errlen, ZS_ECRC,
                       "%s: %" PRIu64 " bytes, but the manifest says %" PRIu64
                       " (truncated or replaced)",
                       path, s->size, expect->bytes);
  return 0;
}

/* Reads and checks the fixed header: magic, CRC, format version, every field
 * in range and the reserved bytes zero. Fills r->h and the table's size. */
static int reader_read_header(ckpt_reader *r, reader_scan *s, char *err, size_t errlen) {
  const char *path = r->path;
  uint8_t hdr[CKPT_HEADER_BYTES];
  if (s->size < CKPT_HEADER_BYTES || ckpt__pread_full(r->fd, hdr, sizeof hdr, 0) != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: truncated: %" PRIu64 " bytes, shorter than a header", path, s->size);
  if (memcmp(hdr, CKPT_MAGIC, 8) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "%s: not a zshard checkpoint (bad magic)", path);
  if (crc32c(0, hdr, 124) != le_load32(hdr + 124))
    return status_fail(err, errlen, ZS_ECRC, "%s: header CRC32C mismatch (the file is damaged)",
                       path);
  uint32_t fmt = le_load32(hdr + 8), hbytes = le_load32(hdr + 12), nsec = le_load32(hdr + 56);
  uint64_t table_off = le_load64(hdr + 64);
  if (fmt < CKPT_FORMAT_VERSION_MIN || fmt > CKPT_FORMAT_VERSION)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: format version %" PRIu32 ", this build reads %u to %u", path, fmt,
                       CKPT_FORMAT_VERSION_MIN, CKPT_FORMAT_VERSION);
  /* Format 1 has no members section. */
  s->fmt = fmt;
  s->max_kind = fmt >= 2 ? CKPT_SEC_MEMBERS : CKPT_SEC_TENSOR_STEPS;
  r->h.shard_id = le_load32(hdr + 16);
  r->h.num_shards = le_load32(hdr + 20);
  r->h.spec_hash = le_load64(hdr + 24);
  r->h.version = le_load64(hdr + 32);
  r->h.optimizer_steps = le_load64(hdr + 40);
  r->h.nelems = le_load64(hdr + 48);
  if (hbytes != CKPT_HEADER_BYTES || table_off != CKPT_HEADER_BYTES || nsec < 4 ||
      nsec > CKPT_MAX_SECTIONS || le_load32(hdr + 60) != 0 || r->h.num_shards == 0 ||
      r->h.num_shards > SPEC_MAX_SHARDS || r->h.shard_id >= r->h.num_shards ||
      r->h.nelems > SPEC_MAX_TOTAL_NUMEL + (uint64_t)LAYOUT_ALIGN_ELEMS * SPEC_MAX_PIECES)
    return status_fail(err, errlen, ZS_EPROTO, "%s: header fields out of range", path);
  for (int i = 76; i < 124; i++) {
    if (hdr[i] != 0)
      return status_fail(err, errlen, ZS_EPROTO, "%s: reserved header bytes are not zero", path);
  }
  s->nsec = nsec;
  s->table_crc = le_load32(hdr + 72);
  s->table_end = CKPT_HEADER_BYTES + (uint64_t)nsec * CKPT_ENTRY_BYTES;
  return 0;
}

/* Reads the section table and checks each entry on its own: a known kind seen
 * once, zero reserved words, an aligned range inside the file past the table;
 * and that the four required sections are there. */
static int reader_read_table(ckpt_reader *r, reader_scan *s, char *err, size_t errlen) {
  const char *path = r->path;
  uint8_t table[CKPT_MAX_SECTIONS * CKPT_ENTRY_BYTES];
  size_t tlen = (size_t)(s->table_end - CKPT_HEADER_BYTES);
  if (s->size < s->table_end || ckpt__pread_full(r->fd, table, tlen, CKPT_HEADER_BYTES) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "%s: truncated in its section table", path);
  if (crc32c(0, table, tlen) != s->table_crc)
    return status_fail(err, errlen, ZS_ECRC,
                       "%s: section table CRC32C mismatch (the file is damaged)", path);
  int seen[CKPT_SEC_MEMBERS + 1] = {0};
  for (uint32_t i = 0; i < s->nsec; i++) {
    const uint8_t *e = table + (size_t)i * CKPT_ENTRY_BYTES;
    in_section *sec = &s->sec[i];
    *sec = (in_section){.kind = le_load32(e),
                        .off = le_load64(e + 8),
                        .len = le_load64(e + 16),
                        .crc = le_load32(e + 24),
                        .got = 0};
    if (sec->kind < CKPT_SEC_SPEC || sec->kind > s->max_kind || seen[sec->kind]++ ||
        le_load32(e + 4) != 0 || le_load32(e + 28) != 0)
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: section %" PRIu32 " has an unknown or repeated kind %" PRIu32, path,
                         i, sec->kind);
    if (sec->off % CKPT_ALIGN != 0 || sec->off < s->table_end || sec->len > s->size ||
        sec->off > s->size - sec->len)
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: truncated: the %s section spans bytes %" PRIu64 "..%" PRIu64
                         " but the file has %" PRIu64,
                         path, ckpt__section_name(sec->kind), sec->off, sec->off + sec->len,
                         s->size);
  }
  if (!seen[CKPT_SEC_SPEC] || !seen[CKPT_SEC_OPTIMIZER] || !seen[CKPT_SEC_PIECES] ||
      !seen[CKPT_SEC_MASTER])
    return status_fail(err, errlen, ZS_EPROTO, "%s: a required section is missing", path);
  return 0;
}

/* Checks the sections together and against their CRCs: no overlap, nothing
 * after the last one, then one streaming pass (stream_verify) for every
 * section's CRC, the padding and the whole file's CRC against the manifest. */
static int reader_verify_sections(ckpt_reader *r, const ckpt_file_info *expect, reader_scan *s,
                                  char *err, size_t errlen) {
  const char *path = r->path;
  in_section *sec = s->sec;
  uint32_t nsec = s->nsec;
  qsort(sec, nsec, sizeof *sec, cmp_in_section);
  for (uint32_t i = 1; i < nsec; i++) {
    if (sec[i].off < sec[i - 1].off + sec[i - 1].len)
      return status_fail(err, errlen, ZS_EPROTO, "%s: sections overlap", path);
  }
  uint64_t data_end = sec[nsec - 1].off + sec[nsec - 1].len;
  if (s->size != data_end)
    return status_fail(err, errlen, ZS_EPROTO, "%s: %" PRIu64 " bytes after the last section", path,
                       s->size - data_end);
  uint32_t file_crc = 0;
  int rc = stream_verify(r, s->size, s->table_end, sec, nsec, &file_crc, err, errlen);
  if (rc != 0)
    return rc;
  for (uint32_t i = 0; i < nsec; i++) {
    if (sec[i].got != sec[i].crc)
      return status_fail(err, errlen, ZS_ECRC,
                         "%s: CRC32C mismatch in the %s section (the file is damaged)", path,
                         ckpt__section_name(sec[i].kind));
  }
  if (expect && file_crc != expect->crc32c)
    return status_fail(err, errlen, ZS_ECRC,
                       "%s: the file's CRC32C %08" PRIx32 " is not the manifest's %08" PRIx32, path,
                       file_crc, expect->crc32c);
  return 0;
}

/* Finds each section by kind (now known to be intact) and checks that every
 * state array holds exactly the header's arena. */
static int reader_index_sections(ckpt_reader *r, reader_scan *s, char *err, size_t errlen) {
  for (uint32_t i = 0; i < s->nsec; i++) {
    const in_section *sec = &s->sec[i];
    switch (sec->kind) {
    case CKPT_SEC_SPEC:
      s->spec = sec;
      break;
    case CKPT_SEC_OPTIMIZER:
      s->optimizer = sec;
      break;
    case CKPT_SEC_PIECES:
      s->pieces = sec;
      break;
    case CKPT_SEC_MASTER:
      r->arr_off[CKPT_ARRAY_MASTER] = sec->off;
      r->has[CKPT_ARRAY_MASTER] = 1;
      break;
    case CKPT_SEC_EXP_AVG:
      r->arr_off[CKPT_ARRAY_EXP_AVG] = sec->off;
      r->has[CKPT_ARRAY_EXP_AVG] = 1;
      break;
    case CKPT_SEC_EXP_AVG_SQ:
      r->arr_off[CKPT_ARRAY_EXP_AVG_SQ] = sec->off;
      r->has[CKPT_ARRAY_EXP_AVG_SQ] = 1;
      break;
    case CKPT_SEC_CLIENT_STATE:
      s->client_state = sec;
      break;
    case CKPT_SEC_TENSOR_STEPS:
      s->tensor_steps = sec;
      break;
    case CKPT_SEC_MEMBERS:
      s->members = sec;
      break;
    }
    if (sec->kind >= CKPT_SEC_MASTER && sec->kind <= CKPT_SEC_EXP_AVG_SQ &&
        sec->len != r->h.nelems * sizeof(float))
      return status_fail(
          err, errlen, ZS_EPROTO,
          "%s: the %s section has %" PRIu64 " bytes, the header's arena needs %" PRIu64, r->path,
          ckpt__section_name(sec->kind), sec->len, r->h.nelems * sizeof(float));
  }
  return 0;
}

/* Reads a small section whole into *buf (grown as needed). */
static int reader_read_small(ckpt_reader *r, const in_section *sec, uint8_t **buf, char *err,
                             size_t errlen) {
  uint8_t *got = realloc(*buf, (size_t)sec->len + 1);
  if (!got)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory reading %s", r->path);
  *buf = got;
  if (ckpt__pread_full(r->fd, got, (size_t)sec->len, sec->off) != 0)
    return status_fail(err, errlen, ZS_EIO, "%s: read error: %s", r->path, strerror(errno));
  return 0;
}

/* Decodes the spec section, checks it against the header's hash and shard
 * count, and computes the layout, whose arena must be the header's. */
static int reader_load_spec(ckpt_reader *r, const reader_scan *s, uint8_t **small, char *err,
                            size_t errlen) {
  const char *path = r->path;
  int rc = reader_read_small(r, s->spec, small, err, errlen);
  if (rc != 0)
    return rc;
  char why[320];
  if ((rc = ckpt__dec_spec(*small, (size_t)s->spec->len, &r->spec, why, sizeof why)) != 0)
    return status_fail(err, errlen, rc, "%s: %s", path, why);
  /* A checkpoint written before issue 26 carries the hash with world_size
   * in it (spec_hash_legacy); it loads as it did, and the job it restores
   * has today's hash (computed from the spec, not taken from the header). */
  uint64_t want = r->h.spec_hash;
  if ((spec_hash(&r->spec) != want && spec_hash_legacy(&r->spec) != want) ||
      r->spec.num_shards != r->h.num_shards)
    return status_fail(err, errlen, ZS_EHASH,
                       "%s: the spec section hashes to %016" PRIx64 " (for %" PRIu32
                       " shards), the header says %016" PRIx64 " (for %" PRIu32 ")",
                       path, spec_hash(&r->spec), r->spec.num_shards, r->h.spec_hash,
                       r->h.num_shards);
  if (layout_build(&r->spec, &r->lay) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory computing the layout of %s", path);
  if (r->lay.shard_elems[r->h.shard_id] != r->h.nelems)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: the header's arena of %" PRIu64
                       " elements is not the layout's %" PRIu64,
                       path, r->h.nelems, r->lay.shard_elems[r->h.shard_id]);
  return 0;
}

/* The optimizer and pieces sections are redundant with the spec: regenerated
 * from it and compared byte for byte, so that a file from an incompatible
 * layout is refused rather than misread. */
static int reader_check_regenerated(ckpt_reader *r, const reader_scan *s, uint8_t **small,
                                    char *err, size_t errlen) {
  const struct {
    const in_section *s;
    int kind;
  } regen[2] = {{s->optimizer, CKPT_SEC_OPTIMIZER}, {s->pieces, CKPT_SEC_PIECES}};
  bytes expect_bytes = {0};
  int rc = 0;
  for (int k = 0; k < 2 && rc == 0; k++) {
    expect_bytes.len = 0;
    if (regen[k].kind == CKPT_SEC_OPTIMIZER)
      ckpt__enc_optimizer(&expect_bytes, &r->spec, r->h.optimizer_steps);
    else
      ckpt__enc_pieces(&expect_bytes, &r->lay, r->h.shard_id);
    if (expect_bytes.oom) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory verifying %s", r->path);
      break;
    }
    if ((rc = reader_read_small(r, regen[k].s, small, err, errlen)) != 0)
      break;
    if (regen[k].s->len != expect_bytes.len ||
        memcmp(*small, expect_bytes.p, expect_bytes.len) != 0)
      rc = status_fail(
          err, errlen, ZS_EPROTO,
          "%s: the %s section does not match its spec (written by an incompatible layout?)",
          r->path, ckpt__section_name((uint32_t)regen[k].kind));
  }
  free(expect_bytes.p);
  return rc;
}

/* Decodes the members section, when there is one, every count and rank
 * checked (ckpt__dec_members). */
static int reader_load_members(ckpt_reader *r, const reader_scan *s, char *err, size_t errlen) {
  const in_section *ms = s->members;
  if (!ms)
    return 0;
  /* The largest a valid one can be: its fixed part (the flag timeout of
   * format 3 included), the members and a full log of full sets. */
  uint64_t most = 48 + 4 * (uint64_t)CORE_ELASTIC_MAX_W +
                  (uint64_t)CORE_MEMBER_LOG_MAX * (12 + 4 * (uint64_t)CORE_ELASTIC_MAX_W);
  if (ms->len > most)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: the members section has %" PRIu64 " bytes, more than %" PRIu64, r->path,
                       ms->len, most);
  uint8_t *raw = malloc((size_t)ms->len + 1);
  if (!raw)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory reading %s", r->path);
  int rc = 0;
  char why[256];
  if (ckpt__pread_full(r->fd, raw, (size_t)ms->len, ms->off) != 0)
    rc = status_fail(err, errlen, ZS_EIO, "%s: read error: %s", r->path, strerror(errno));
  else if ((rc = ckpt__dec_members(raw, (size_t)ms->len, r->spec.world_size, r->h.version, s->fmt,
                                   &r->members, why, sizeof why)) != 0)
    rc = status_fail(err, errlen, rc, "%s: %s", r->path, why);
  free(raw);
  return rc;
}

/* The moment sections present must be exactly those the shard's optimizers
 * use; the client state, opaque to the shard, is read when present. */
static int reader_load_rest(ckpt_reader *r, const reader_scan *s, char *err, size_t errlen) {
  const char *path = r->path;
  int need_m, need_v;
  ckpt__shard_uses(&r->spec, &r->lay, r->h.shard_id, &need_m, &need_v);
  if (need_m != r->has[CKPT_ARRAY_EXP_AVG] || need_v != r->has[CKPT_ARRAY_EXP_AVG_SQ])
    return status_fail(
        err, errlen, ZS_EPROTO,
        "%s: the moment sections present (exp_avg %d, exp_avg_sq %d) are not those its "
        "optimizers use (%d, %d)",
        path, r->has[CKPT_ARRAY_EXP_AVG], r->has[CKPT_ARRAY_EXP_AVG_SQ], need_m, need_v);
  r->h.has_exp_avg = need_m;
  r->h.has_exp_avg_sq = need_v;
  const in_section *sc = s->client_state;
  if (sc) {
    /* Only its size is checked (a writer never puts an empty one). */
    if (sc->len == 0 || sc->len > CORE_MAX_CLIENT_STATE)
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: the client_state section has %" PRIu64 " bytes, not 1 to %u", path,
                         sc->len, CORE_MAX_CLIENT_STATE);
    if (ckpt__pread_full(r->fd, r->client_state, (size_t)sc->len, sc->off) != 0)
      return status_fail(err, errlen, ZS_EIO, "%s: read error: %s", path, strerror(errno));
    r->client_state_len = (size_t)sc->len;
  }
  const in_section *ts = s->tensor_steps;
  if (ts) {
    uint64_t n = r->spec.num_tensors;
    if (ts->len != n * sizeof(uint64_t))
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: the tensor_steps section has %" PRIu64
                         " bytes, not 8 per tensor (%" PRIu64 ")",
                         path, ts->len, n * sizeof(uint64_t));
    uint8_t *raw = malloc((size_t)ts->len + 1);
    r->tensor_steps = malloc((size_t)n * sizeof *r->tensor_steps + 1);
    if (!raw || !r->tensor_steps) {
      free(raw);
      return status_fail(err, errlen, ZS_ENOMEM, "out of memory reading %s", path);
    }
    if (ckpt__pread_full(r->fd, raw, (size_t)ts->len, ts->off) != 0) {
      free(raw);
      return status_fail(err, errlen, ZS_EIO, "%s: read error: %s", path, strerror(errno));
    }
    for (uint64_t t = 0; t < n; t++)
      r->tensor_steps[t] = le_load64(raw + t * 8);
    free(raw);
  }
  return reader_load_members(r, s, err, errlen);
}

int ckpt_reader_open(const char *path, const ckpt_file_info *expect, ckpt_reader **out, char *err,
                     size_t errlen) {
  *out = NULL;
  ckpt_reader *r = calloc(1, sizeof *r);
  reader_scan *s = calloc(1, sizeof *s);
  uint8_t *small = NULL;
  int rc;
  if (!r || !s) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory opening %s", path);
    goto fail;
  }
  r->fd = -1;
  snprintf(r->path, sizeof r->path, "%s", path);
  /* Everything is checked before anything is believed: the header and the
   * table, then every byte against its CRC, and only then the contents. */
  if ((rc = reader_open_file(r, expect, s, err, errlen)) != 0 ||
      (rc = reader_read_header(r, s, err, errlen)) != 0 ||
      (rc = reader_read_table(r, s, err, errlen)) != 0 ||
      (rc = reader_verify_sections(r, expect, s, err, errlen)) != 0 ||
      (rc = reader_index_sections(r, s, err, errlen)) != 0 ||
      (rc = reader_load_spec(r, s, &small, err, errlen)) != 0 ||
      (rc = reader_check_regenerated(r, s, &small, err, errlen)) != 0 ||
      (rc = reader_load_rest(r, s, err, errlen)) != 0)
    goto fail;
  free(small);
  free(s);
  *out = r;
  return 0;
fail:
  free(small);
  free(s);
  ckpt_reader_close(r);
  return rc;
}

int ckpt_reader_read(ckpt_reader *r, ckpt_array a, uint64_t first, uint64_t n, float *dst,
                     char *err, size_t errlen) {
  if ((int)a < 0 || a > CKPT_ARRAY_EXP_AVG_SQ || !r->has[a])
    return status_fail(err, errlen, ZS_ENOTFOUND, "%s: has no %s section", r->path,
                       ckpt__section_name(CKPT_SEC_MASTER + (uint32_t)a));
  if (first > r->h.nelems || n > r->h.nelems - first)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s: elements %" PRIu64 "..%" PRIu64 " are past its arena", r->path, first,
                       first + n);
  if (n == 0)
    return 0;
  if (ckpt__pread_full(r->fd, dst, (size_t)(n * sizeof(float)),
                       r->arr_off[a] + first * sizeof(float)) != 0)
    return status_fail(err, errlen, ZS_EIO, "%s: read error: %s", r->path,
                       errno == ENODATA ? "the file shrank after it was verified"
                                        : strerror(errno));
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Loading                                                                   */
/* ------------------------------------------------------------------------ */

/* Opens shard j's file of a complete checkpoint and checks its header against
 * the manifest. */
static int open_shard_file(const char *dir, const ckpt_manifest *m, uint32_t j, ckpt_reader **out,
                           char *err, size_t errlen) {
  char path[CKPT_PATH_MAX];
  if (ckpt__join_path(path, sizeof path, dir, m->files[j].name) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long in %.200s", dir);
  int rc = ckpt_reader_open(path, &m->files[j], out, err, errlen);
  if (rc != 0)
    return rc;
  const ckpt_header *h = ckpt_reader_header(*out);
  if (h->shard_id != j || h->num_shards != m->num_shards || h->spec_hash != m->spec_hash ||
      h->version != m->version || h->optimizer_steps != m->optimizer_steps) {
    rc = status_fail(err, errlen, ZS_EPROTO,
                     "%s: its header (shard %" PRIu32 " of %" PRIu32 ", spec %016" PRIx64
                     ", version %" PRIu64 ") disagrees with the manifest",
                     path, h->shard_id, h->num_shards, h->spec_hash, h->version);
    ckpt_reader_close(*out);
    *out = NULL;
  }
  return rc;
}

/* Copies, for every array the new state has, the elements of old piece `q`
 * (read from r) that fall into new shard `shard`'s pieces of the same tensor
 * under layout nl. */
static int copy_overlaps(ckpt_reader *r, const layout_piece *q, const layout *nl, uint32_t shard,
                         core_state *st, char *err, size_t errlen) {
  float *dst[3] = {st->master, st->m, st->v};
  uint32_t first = nl->tensor_first[q->tensor], last = nl->tensor_first[q->tensor + 1];
  for (uint32_t i = first; i < last; i++) {
    const layout_piece *p = &nl->pieces[i];
    if (p->shard != shard)
      continue;
    uint64_t b = q->offset > p->offset ? q->offset : p->offset;
    uint64_t e =
        q->offset + q->numel < p->offset + p->numel ? q->offset + q->numel : p->offset + p->numel;
    if (b >= e)
      continue;
    for (int a = 0; a < 3; a++) {
      if (!dst[a])
        continue;
      int rc = ckpt_reader_read(r, (ckpt_array)a, q->arena_off + (b - q->offset), e - b,
                                dst[a] + p->arena_off + (b - p->offset), err, errlen);
      if (rc != 0)
        return rc;
    }
  }
  return 0;
}

/* Copies the reader's client state into st (which owns the copy). */
/* Gives st a step count per tensor, every one at `steps` (the job's), for
 * take_tensor_steps to overwrite from the files. */
static int init_tensor_steps(core_state *st, uint64_t steps, char *err, size_t errlen) {
  st->tensor_steps = malloc((size_t)st->spec.num_tensors * sizeof *st->tensor_steps + 1);
  if (!st->tensor_steps)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  for (uint32_t t = 0; t < st->spec.num_tensors; t++)
    st->tensor_steps[t] = steps;
  return 0;
}

/* The counts of the tensors that file r (of shard `shard` under the old
 * layout) holds pieces of, when it has them. */
static void take_tensor_steps(const ckpt_reader *r, const layout *old, uint32_t shard,
                              core_state *st) {
  const uint64_t *ts = ckpt_reader_tensor_steps(r);
  for (uint32_t i = 0; ts && i < old->num_pieces; i++)
    if (old->pieces[i].shard == shard)
      st->tensor_steps[old->pieces[i].tensor] = ts[old->pieces[i].tensor];
}

/* Copies the reader's membership into st (every shard's file holds the
 * same one). */
static int take_members(const ckpt_reader *r, core_state *st, char *err, size_t errlen) {
  const core_member_state *ms = ckpt_reader_members(r);
  if (!ms)
    return 0;
  core_member_state *c = malloc(sizeof *c);
  core_member_log_entry *log = malloc((size_t)ms->log_n * sizeof *log + 1);
  if (!c || !log) {
    free(c);
    free(log);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  }
  *c = *ms;
  if (ms->log_n > 0)
    memcpy(log, ms->log, (size_t)ms->log_n * sizeof *log);
  c->log = log;
  c->join_at = c->leave_at = NULL; /* a checkpoint has no plans */
  c->nplan = 0;
  st->members = c;
  return 0;
}

static int take_client_state(const ckpt_reader *r, core_state *st, char *err, size_t errlen) {
  size_t len = 0;
  const unsigned char *cs = ckpt_reader_client_state(r, &len);
  if (len == 0)
    return 0;
  st->client_state = malloc(len);
  if (!st->client_state)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  memcpy(st->client_state, cs, len);
  st->client_state_len = len;
  return 0;
}

/* 1 if old piece q holds elements of a piece of `shard` in the new layout. */
static int overlaps_new(const layout_piece *q, const layout *nl, uint32_t shard) {
  for (uint32_t i = nl->tensor_first[q->tensor]; i < nl->tensor_first[q->tensor + 1]; i++) {
    const layout_piece *p = &nl->pieces[i];
    if (p->shard == shard && p->offset < q->offset + q->numel && q->offset < p->offset + p->numel)
      return 1;
  }
  return 0;
}

int ckpt_load(const char *root, uint64_t step, uint32_t shard_id, uint32_t num_shards,
              core_state *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  ckpt_manifest m;
  char dir[CKPT_PATH_MAX];
  if (ckpt_step_dir(root, step, dir, sizeof dir) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  int rc = ckpt_manifest_read(root, step, &m, err, errlen);
  if (rc != 0)
    return rc;
  ckpt_reader *r = NULL;
  uint8_t *needed = NULL;
  layout old;
  memset(&old, 0, sizeof old);
  if (shard_id >= num_shards) {
    rc = status_fail(err, errlen, ZS_EINVAL, "shard %" PRIu32 " of %" PRIu32 " does not exist",
                     shard_id, num_shards);
    goto done;
  }
  if (m.num_shards == num_shards) {
    /* The common case: this shard's own file, read straight into the state. */
    if ((rc = open_shard_file(dir, &m, shard_id, &r, err, errlen)) != 0)
      goto done;
    if ((rc = core_state_init(out, ckpt_reader_spec(r), shard_id, err, errlen)) != 0 ||
        (rc = take_client_state(r, out, err, errlen)) != 0 ||
        (rc = take_members(r, out, err, errlen)) != 0 ||
        (rc = init_tensor_steps(out, m.optimizer_steps, err, errlen)) != 0)
      goto done;
    take_tensor_steps(r, ckpt_reader_layout(r), shard_id, out);
    float *dst[3] = {out->master, out->m, out->v};
    for (int a = 0; a < 3 && rc == 0; a++)
      if (dst[a])
        rc = ckpt_reader_read(r, (ckpt_array)a, 0, out->nelems, dst[a], err, errlen);
    if (rc != 0)
      goto done;
  } else {
    /* Resharding: the spec comes from the first file present; the new
     * layout says which old files hold this shard's elements. */
    uint32_t j0 = 0;
    for (; j0 < m.num_shards; j0++) {
      char path[CKPT_PATH_MAX];
      struct stat sb;
      if (ckpt__join_path(path, sizeof path, dir, m.files[j0].name) == 0 &&
          ckpt__fs_lstat(path, &sb) == 0)
        break;
    }
    if (j0 == m.num_shards) {
      rc = status_fail(err, errlen, ZS_ENOTFOUND,
                       "checkpoint step %" PRIu64 " in %s: no shard file is present", step, root);
      goto done;
    }
    if ((rc = open_shard_file(dir, &m, j0, &r, err, errlen)) != 0)
      goto done;
    spec ns = *ckpt_reader_spec(r); /* shallow: core_state_init deep-copies it */
    ns.num_shards = num_shards;
    if ((rc = core_state_init(out, &ns, shard_id, err, errlen)) != 0 ||
        (rc = take_client_state(r, out, err, errlen)) != 0 ||
        (rc = take_members(r, out, err, errlen)) != 0 ||
        (rc = init_tensor_steps(out, m.optimizer_steps, err, errlen)) != 0)
      goto done;
    if (layout_build(ckpt_reader_spec(r), &old) != 0) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory computing a layout");
      goto done;
    }
    needed = calloc(m.num_shards, 1);
    if (!needed) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
      goto done;
    }
    layout nl;
    if (layout_build(&out->spec, &nl) != 0) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory computing a layout");
      goto done;
    }
    for (uint32_t i = 0; i < old.num_pieces; i++)
      if (overlaps_new(&old.pieces[i], &nl, shard_id))
        needed[old.pieces[i].shard] = 1;
    /* Every file needed must be there before any is read, so the error names
     * all that are missing. */
    char missing[512] = "";
    size_t ml = 0;
    for (uint32_t j = 0; j < m.num_shards; j++) {
      char path[CKPT_PATH_MAX];
      struct stat sb;
      if (!needed[j] || (ckpt__join_path(path, sizeof path, dir, m.files[j].name) == 0 &&
                         ckpt__fs_lstat(path, &sb) == 0))
        continue;
      if (ml < sizeof missing - 80)
        ml += (size_t)snprintf(missing + ml, sizeof missing - ml, "%s%s", ml ? ", " : "",
                               m.files[j].name);
    }
    if (ml) {
      layout_free(&nl);
      rc = status_fail(err, errlen, ZS_ENOTFOUND,
                       "checkpoint step %" PRIu64 " was written by %" PRIu32
                       " shards; shard %" PRIu32 " of %" PRIu32 " needs %s in %s, which %s missing "
                       "(gather every shard's file there, or run `zshard reshard`)",
                       step, m.num_shards, shard_id, num_shards, missing, dir,
                       strchr(missing, ',') ? "are" : "is");
      goto done;
    }
    for (uint32_t j = 0; j < m.num_shards && rc == 0; j++) {
      if (!needed[j])
        continue;
      if (j != j0) {
        ckpt_reader_close(r);
        r = NULL;
        if ((rc = open_shard_file(dir, &m, j, &r, err, errlen)) != 0)
          break;
      }
      take_tensor_steps(r, &old, j, out);
      for (uint32_t i = 0; i < old.num_pieces && rc == 0; i++)
        if (old.pieces[i].shard == j)
          rc = copy_overlaps(r, &old.pieces[i], &nl, shard_id, out, err, errlen);
    }
    layout_free(&nl);
    if (rc != 0)
      goto done;
  }
  out->version = m.version;
  out->optimizer_steps = m.optimizer_steps;
done:
  if (rc != 0)
    core_state_free(out);
  ckpt_reader_close(r);
  layout_free(&old);
  free(needed);
  ckpt_manifest_free(&m);
  return rc;
}
