/*
 * ckpt — checkpoint files: writing, verifying, reading, loading with
 * resharding, listing, the manifest (see ckpt.h and docs/CHECKPOINTS.md).
 *
 * Every multi-byte integer of the header, the table and the small sections is
 * encoded little-endian byte by byte; the fp32 arenas are written as they lie
 * in memory, which is little-endian on every host this builds on (checked
 * below), so a reader on any machine can decode them as '<f4'.
 *
 * The small sections (spec, optimizer, pieces) are verified by regenerating
 * them from the decoded spec and comparing bytes: a file whose piece table
 * disagrees with the layout our code computes for its spec is refused rather
 * than loaded with elements in the wrong places.
 */
#include "server/ckpt.h"
#include "common/status.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/le.h"
#include "common/log.h"
#include "server/optim.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "checkpoint arenas are written as little-endian fp32 straight from memory");

#define CKPT_MAX_SECTIONS 16u
#define CKPT_IO_BLOCK ((size_t)8 << 20) /* bytes per write/read call */
#define CKPT_SPEC_TAG "zshard.spec.v1"
#define CKPT_SPEC_TAG_LEN 14u
#define CKPT_OPT_HEAD 16u /* optimizer section: u64 steps, u32 groups, u32 0 */
#define CKPT_OPT_GROUP (8u + SPEC_GROUP_FIELDS_BYTES) /* bytes per group */
#define CKPT_PIECE_HEAD 8u                            /* pieces section: u32 count, u32 0 */
#define CKPT_PIECE 40u                                /* bytes per piece */
#define CKPT_MANIFEST_TAG "zshard-checkpoint-manifest 1"
#define CKPT_MANIFEST_MAX ((size_t)2 << 20)

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

static uint64_t align_up(uint64_t x) {
  return (x + CKPT_ALIGN - 1) / CKPT_ALIGN * CKPT_ALIGN;
}

/* A growable byte string for the small sections. */
typedef struct bytes {
  uint8_t *p;
  size_t len, cap;
  int oom;
} bytes;

static uint8_t *bytes_grow(bytes *b, size_t n) {
  if (b->oom)
    return NULL;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n)
      cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return NULL;
    }
    b->p = p;
    b->cap = cap;
  }
  uint8_t *at = b->p + b->len;
  b->len += n;
  return at;
}

static void bytes_u32(bytes *b, uint32_t v) {
  uint8_t *p = bytes_grow(b, 4);
  if (p)
    le_store32(p, v);
}

static void bytes_u64(bytes *b, uint64_t v) {
  uint8_t *p = bytes_grow(b, 8);
  if (p)
    le_store64(p, v);
}

static void bytes_raw(bytes *b, const void *src, size_t n) {
  uint8_t *p = bytes_grow(b, n);
  if (p && n)
    memcpy(p, src, n);
}

int ckpt_write_full(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads exactly n bytes at off; a short file is errno EIO-like 0 (ENODATA). */
static int pread_full(int fd, void *buf, size_t n, uint64_t off) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t r = pread(fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    if (r == 0) {
      errno = ENODATA;
      return -1;
    }
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

static int fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  int rc = fsync(fd);
  int e = errno;
  close(fd);
  errno = e;
  return rc;
}

void ckpt_file_name(uint32_t shard_id, uint32_t num_shards, char *buf, size_t len) {
  snprintf(buf, len, "shard-%" PRIu32 "-of-%" PRIu32 ".zsc", shard_id, num_shards);
}

int ckpt_step_dir(const char *root, uint64_t step, char *buf, size_t len) {
  int n = snprintf(buf, len, "%s/step-%" PRIu64, root, step);
  return n < 0 || (size_t)n >= len ? ZS_EINVAL : 0;
}

static int join_path(char *buf, size_t len, const char *dir, const char *name) {
  int n = snprintf(buf, len, "%s/%s", dir, name);
  return n < 0 || (size_t)n >= len ? ZS_EINVAL : 0;
}

int ckpt_valid_subdir(const char *rel) {
  if (!rel || !*rel || strlen(rel) > 200 || rel[0] == '/')
    return 0;
  int parts = 0;
  const char *p = rel;
  while (*p) {
    const char *e = strchr(p, '/');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n == 0 || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.'))
      return 0;
    for (size_t i = 0; i < n; i++) {
      char ch = p[i];
      if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
            ch == '.' || ch == '_' || ch == '-'))
        return 0;
    }
    if (++parts > 8)
      return 0;
    if (!e)
      break;
    p = e + 1;
    if (!*p)
      return 0; /* trailing slash */
  }
  return 1;
}

int ckpt_mkdirs(const char *dir, char *err, size_t errlen) {
  char path[CKPT_PATH_MAX];
  if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path)
    return status_fail(err, errlen, ZS_EINVAL, "path too long: %.200s...", dir);
  for (char *p = path + 1;; p++) {
    if (*p == '/' || *p == '\0') {
      char saved = *p;
      *p = '\0';
      if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return status_fail(err, errlen, ZS_EIO, "cannot create directory %s: %s", path,
                           strerror(errno));
      struct stat sb;
      if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return status_fail(err, errlen, ZS_EIO, "cannot create directory %s: %s", path,
                           stat(path, &sb) != 0 ? strerror(errno)
                                                : "a file of that name is in the way");
      *p = saved;
      if (saved == '\0')
        break;
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Section encodings                                                         */
/* ------------------------------------------------------------------------ */

/* The spec's canonical encoding (spec_encode): the byte string spec_hash()
 * hashes, so that its hash is the spec hash of the header. */
static void enc_spec(bytes *b, const spec *s) {
  unsigned char *p = NULL;
  size_t n = 0;
  if (spec_encode(s, &p, &n) != 0) {
    b->oom = 1;
    return;
  }
  bytes_raw(b, p, n);
  free(p);
}

/* A bounds-checked cursor over an untrusted byte string. */
typedef struct cursor {
  const uint8_t *p;
  size_t left;
  int bad;
} cursor;

static const uint8_t *cur_take(cursor *c, size_t n) {
  if (c->bad || c->left < n) {
    c->bad = 1;
    return NULL;
  }
  const uint8_t *at = c->p;
  c->p += n;
  c->left -= n;
  return at;
}

static uint32_t cur_u32(cursor *c) {
  const uint8_t *p = cur_take(c, 4);
  return p ? le_load32(p) : 0;
}

static uint64_t cur_u64(cursor *c) {
  const uint8_t *p = cur_take(c, 8);
  return p ? le_load64(p) : 0;
}

/* A string of at most SPEC_MAX_NAME bytes; NULL (and c->bad) otherwise. */
static char *cur_str(cursor *c) {
  uint32_t n = cur_u32(c);
  if (c->bad || n > SPEC_MAX_NAME) {
    c->bad = 1;
    return NULL;
  }
  const uint8_t *p = cur_take(c, n);
  if (!p)
    return NULL;
  if (memchr(p, 0, n)) {
    c->bad = 1; /* a NUL would cut the name short */
    return NULL;
  }
  char *s = malloc((size_t)n + 1);
  if (!s) {
    c->bad = 2;
    return NULL;
  }
  memcpy(s, p, n);
  s[n] = '\0';
  return s;
}

/* Decodes the canonical encoding into *out (validated). Counts are checked
 * against the bytes left before anything is allocated for them. */
static int dec_spec(const uint8_t *p, size_t n, spec *out, char *why, size_t whylen) {
  memset(out, 0, sizeof *out);
  cursor c = {p, n, 0};
  const uint8_t *tag = cur_take(&c, CKPT_SPEC_TAG_LEN);
  if (!tag || memcmp(tag, CKPT_SPEC_TAG, CKPT_SPEC_TAG_LEN) != 0)
    return status_fail(why, whylen, ZS_EPROTO, "the spec section does not start with \"%s\"",
                       CKPT_SPEC_TAG);
  out->job = cur_str(&c);
  out->world_size = cur_u32(&c);
  out->grad_accum = cur_u32(&c);
  out->num_shards = cur_u32(&c);
  out->split_threshold = cur_u64(&c);
  out->reduce = (spec_reduce)cur_u32(&c);
  out->param_dtype = (zs_dtype)cur_u32(&c);
  uint32_t ngroups = cur_u32(&c);
  if (c.bad || ngroups == 0 || ngroups > SPEC_MAX_GROUPS ||
      (uint64_t)ngroups * (4u + SPEC_GROUP_FIELDS_BYTES) > c.left)
    goto bad;
  out->groups = calloc(ngroups, sizeof *out->groups);
  if (!out->groups)
    goto oom;
  out->num_groups = ngroups;
  for (uint32_t i = 0; i < ngroups; i++) {
    spec_group *g = &out->groups[i];
    g->optimizer = (zs_optimizer)cur_u32(&c);
    const uint8_t *fields = cur_take(&c, SPEC_GROUP_FIELDS_BYTES);
    if (fields)
      spec_group_get_fields(g, fields);
  }
  uint32_t ntensors = cur_u32(&c);
  /* A tensor takes at least 20 bytes (empty name, numel, group, ndim). */
  if (c.bad || ntensors == 0 || ntensors > SPEC_MAX_TENSORS || (uint64_t)ntensors * 20u > c.left)
    goto bad;
  out->tensors = calloc(ntensors, sizeof *out->tensors);
  if (!out->tensors)
    goto oom;
  out->num_tensors = ntensors;
  for (uint32_t i = 0; i < ntensors && !c.bad; i++) {
    spec_tensor *t = &out->tensors[i];
    t->name = cur_str(&c);
    t->numel = cur_u64(&c);
    t->group = cur_u32(&c);
    t->ndim = cur_u32(&c);
    if (t->ndim > SPEC_MAX_DIMS) {
      c.bad = 1;
      break;
    }
    for (uint32_t d = 0; d < t->ndim; d++)
      t->shape[d] = cur_u64(&c);
  }
  if (c.bad == 2)
    goto oom;
  if (c.bad)
    goto bad;
  if (c.left != 0) {
    spec_free(out);
    return status_fail(why, whylen, ZS_EPROTO, "the spec section has %zu bytes after its end",
                       c.left);
  }
  if (!out->job || !out->job[0])
    goto bad;
  char verr[256];
  if (spec_validate(out, verr, sizeof verr) != 0) {
    spec_free(out);
    return status_fail(why, whylen, ZS_EPROTO, "the spec section holds an invalid spec: %s", verr);
  }
  return 0;
bad:
  spec_free(out);
  return status_fail(why, whylen, ZS_EPROTO, "the spec section is malformed");
oom:
  spec_free(out);
  return status_fail(why, whylen, ZS_ENOMEM, "out of memory decoding the spec section");
}

/* Optimizer section: u64 optimizer_steps, u32 num_groups, u32 0, then per
 * group u32 optimizer, u32 state flags (optim_state_needs: bit 0, its pieces'
 * m arena elements are state, bit 1: v), then the group's SPEC_GROUP_FIELDS
 * as the spec's canonical encoding has them (today f64 lr_scale, beta1,
 * beta2, eps, weight_decay, momentum, dampening, u32 nesterov,
 * bias_correction). */
static void enc_optimizer(bytes *b, const spec *s, uint64_t optimizer_steps) {
  _Static_assert(OPTIM_STATE_M == 1u && OPTIM_STATE_V == 2u,
                 "the state flags are written as optim_state_needs gives them");
  bytes_u64(b, optimizer_steps);
  bytes_u32(b, s->num_groups);
  bytes_u32(b, 0);
  for (uint32_t i = 0; i < s->num_groups; i++) {
    const spec_group *g = &s->groups[i];
    bytes_u32(b, (uint32_t)g->optimizer);
    bytes_u32(b, optim_state_needs(g));
    uint8_t *p = bytes_grow(b, SPEC_GROUP_FIELDS_BYTES);
    if (p)
      spec_group_put_fields(g, p);
  }
}

/* Pieces section: u32 count, u32 0, then per piece of the shard in (tensor,
 * slice) order u32 tensor, u32 slice, u32 group, u32 0, u64 offset within the
 * tensor, u64 numel, u64 arena offset (elements). */
static void enc_pieces(bytes *b, const layout *l, uint32_t shard) {
  bytes_u32(b, l->shard_pieces[shard]);
  bytes_u32(b, 0);
  for (uint32_t i = 0; i < l->num_pieces; i++) {
    const layout_piece *pc = &l->pieces[i];
    if (pc->shard != shard)
      continue;
    bytes_u32(b, pc->tensor);
    bytes_u32(b, pc->slice);
    bytes_u32(b, pc->group);
    bytes_u32(b, 0);
    bytes_u64(b, pc->offset);
    bytes_u64(b, pc->numel);
    bytes_u64(b, pc->arena_off);
  }
}

/* Whether shard `shard` keeps m and v arenas: the rule of core_state_init. */
static void shard_uses(const spec *s, const layout *l, uint32_t shard, int *m, int *v) {
  unsigned needs = 0;
  for (uint32_t r = l->range_first[shard]; r < l->range_first[shard + 1]; r++)
    needs |= optim_state_needs(&s->groups[l->ranges[r].group]);
  *m = (needs & OPTIM_STATE_M) != 0;
  *v = (needs & OPTIM_STATE_V) != 0;
}

static const char *section_name(uint32_t kind) {
  switch (kind) {
  case CKPT_SEC_SPEC:
    return "spec";
  case CKPT_SEC_OPTIMIZER:
    return "optimizer";
  case CKPT_SEC_PIECES:
    return "pieces";
  case CKPT_SEC_MASTER:
    return "master";
  case CKPT_SEC_EXP_AVG:
    return "exp_avg";
  case CKPT_SEC_EXP_AVG_SQ:
    return "exp_avg_sq";
  case CKPT_SEC_CLIENT_STATE:
    return "client_state";
  default:
    return "unknown";
  }
}

/* ------------------------------------------------------------------------ */
/* Writing                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct out_section {
  uint32_t kind;
  const uint8_t *data;
  uint64_t len, off;
  uint32_t crc;
} out_section;

/* Sequential writer of the temporary file: counts bytes, extends the
 * whole-file CRC, honours cancellation and the test stall. */
typedef struct writer {
  int fd;
  const char *path;
  const ckpt_write_opts *o;
  uint64_t written, total, stall_at;
  uint32_t crc;
  int stalled;
  uint64_t version;
} writer;

static int cancelled(const ckpt_write_opts *o) {
  return o && o->cancel && atomic_load(o->cancel);
}

static int w_bytes(writer *w, const void *buf, uint64_t n, char *err, size_t errlen) {
  const uint8_t *p = buf;
  while (n > 0) {
    if (cancelled(w->o))
      return status_fail(err, errlen, ZS_ECANCELED,
                         "writing %s: cancelled (the server is stopping)", w->path);
    uint64_t k = n < CKPT_IO_BLOCK ? n : CKPT_IO_BLOCK;
    if (!w->stalled && w->stall_at && w->written < w->stall_at && w->written + k > w->stall_at)
      k = w->stall_at - w->written;
    if (ckpt_write_full(w->fd, p, (size_t)k) != 0)
      return status_fail(err, errlen, ZS_EIO, "cannot write %s: %s", w->path, strerror(errno));
    w->crc = crc32c(w->crc, p, (size_t)k);
    w->written += k;
    p += k;
    n -= k;
    if (!w->stalled && w->stall_at && w->written == w->stall_at) {
      /* The test hook: a partial temporary file is on disk; wait here until
       * the process is killed or the service stops. */
      w->stalled = 1;
      LOG_WARN("checkpoint_stalled",
               "file=%s version=%" PRIu64 " written=%" PRIu64 " total=%" PRIu64
               " reason=ZSHARD_TEST_CKPT_STALL",
               w->path, w->version, w->written, w->total);
      while (!cancelled(w->o)) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
      }
    }
  }
  return 0;
}

static int w_zeros(writer *w, uint64_t n, char *err, size_t errlen) {
  static const uint8_t zero[CKPT_ALIGN];
  while (n > 0) {
    uint64_t k = n < sizeof zero ? n : sizeof zero;
    int rc = w_bytes(w, zero, k, err, errlen);
    if (rc)
      return rc;
    n -= k;
  }
  return 0;
}

/* Lists the sections of shard st's file in their order, gives each its
 * aligned offset and its CRC, and returns the file's size. The CRCs are
 * computed first, in memory (the whole state is in memory anyway), so that
 * the table can precede the data and the file is written in one pass. */
static uint64_t plan_sections(const core_state *st, int need_m, int need_v, const bytes *bspec,
                              const bytes *bopt, const bytes *bpieces, out_section *sec,
                              uint32_t *nsec_out) {
  uint32_t nsec = 0;
  uint64_t arena_bytes = st->nelems * sizeof(float);
  sec[nsec++] = (out_section){CKPT_SEC_SPEC, bspec->p, bspec->len, 0, 0};
  sec[nsec++] = (out_section){CKPT_SEC_OPTIMIZER, bopt->p, bopt->len, 0, 0};
  sec[nsec++] = (out_section){CKPT_SEC_PIECES, bpieces->p, bpieces->len, 0, 0};
  sec[nsec++] = (out_section){CKPT_SEC_MASTER, (const uint8_t *)st->master, arena_bytes, 0, 0};
  if (need_m)
    sec[nsec++] = (out_section){CKPT_SEC_EXP_AVG, (const uint8_t *)st->m, arena_bytes, 0, 0};
  if (need_v)
    sec[nsec++] = (out_section){CKPT_SEC_EXP_AVG_SQ, (const uint8_t *)st->v, arena_bytes, 0, 0};
  /* Only when there is one: a job without a client state writes the same
   * bytes as before the section existed, which older builds still read. */
  if (st->client_state_len > 0)
    sec[nsec++] =
        (out_section){CKPT_SEC_CLIENT_STATE, st->client_state, st->client_state_len, 0, 0};
  uint64_t off = align_up(CKPT_HEADER_BYTES + (uint64_t)nsec * CKPT_ENTRY_BYTES);
  for (uint32_t i = 0; i < nsec; i++) {
    sec[i].off = off;
    sec[i].crc = sec[i].len ? crc32c(0, sec[i].data, (size_t)sec[i].len) : 0;
    off = align_up(off + sec[i].len);
  }
  *nsec_out = nsec;
  return sec[nsec - 1].off + sec[nsec - 1].len;
}

/* Encodes the section table and the header that covers it (docs/CHECKPOINTS.md
 * gives the byte offsets). */
static void encode_table_header(const core_state *st, const out_section *sec, uint32_t nsec,
                                uint8_t table[CKPT_MAX_SECTIONS * CKPT_ENTRY_BYTES],
                                uint8_t hdr[CKPT_HEADER_BYTES]) {
  const spec *s = &st->spec;
  memset(table, 0, CKPT_MAX_SECTIONS * CKPT_ENTRY_BYTES);
  for (uint32_t i = 0; i < nsec; i++) {
    uint8_t *e = table + (size_t)i * CKPT_ENTRY_BYTES;
    le_store32(e, sec[i].kind);
    le_store32(e + 4, 0);
    le_store64(e + 8, sec[i].off);
    le_store64(e + 16, sec[i].len);
    le_store32(e + 24, sec[i].crc);
    le_store32(e + 28, 0);
  }
  memset(hdr, 0, CKPT_HEADER_BYTES);
  memcpy(hdr, CKPT_MAGIC, 8);
  le_store32(hdr + 8, CKPT_FORMAT_VERSION);
  le_store32(hdr + 12, CKPT_HEADER_BYTES);
  le_store32(hdr + 16, st->shard_id);
  le_store32(hdr + 20, s->num_shards);
  le_store64(hdr + 24, spec_hash(s));
  le_store64(hdr + 32, st->version);
  le_store64(hdr + 40, st->optimizer_steps);
  le_store64(hdr + 48, st->nelems);
  le_store32(hdr + 56, nsec);
  le_store32(hdr + 60, 0);
  le_store64(hdr + 64, CKPT_HEADER_BYTES);
  le_store32(hdr + 72, crc32c(0, table, (size_t)nsec * CKPT_ENTRY_BYTES));
  le_store32(hdr + 124, crc32c(0, hdr, 124));
}

/* Makes the step directory durable in root and, when the step is being
 * rewritten, removes its manifest first: the old checkpoint stops being
 * loadable before any byte of it changes. */
static int prepare_step_dir(const char *root, const char *dir, char *err, size_t errlen) {
  int rc = ckpt_mkdirs(dir, err, errlen);
  if (rc != 0)
    return rc;
  if (fsync_dir(root) != 0)
    return status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", root, strerror(errno));
  char manifest[CKPT_PATH_MAX];
  if (join_path(manifest, sizeof manifest, dir, CKPT_MANIFEST) == 0 && unlink(manifest) == 0 &&
      fsync_dir(dir) != 0)
    return status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", dir, strerror(errno));
  return 0;
}

/* Where one shard file goes: the final name and the temporary one beside it. */
typedef struct shard_paths {
  char dir[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX], final[CKPT_PATH_MAX], name[CKPT_NAME_MAX];
} shard_paths;

/* Writes header, table and sections into the temporary file, makes it
 * durable and renames it into place. On failure the temporary file is
 * removed. */
static int write_and_publish(const shard_paths *p, const core_state *st, const ckpt_write_opts *o,
                             const uint8_t *hdr, const uint8_t *table, const out_section *sec,
                             uint32_t nsec, uint64_t total, ckpt_file_info *info, char *err,
                             size_t errlen) {
  int rc, tmp_made = 0;
  int fd = open(p->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return status_fail(err, errlen, ZS_EIO, "cannot create %s: %s", p->tmp, strerror(errno));
  tmp_made = 1;
  writer w = {.fd = fd, .path = p->tmp, .o = o, .total = total, .version = st->version};
  if (o && o->stall && o->stall_step == st->version)
    w.stall_at = total / 2 ? total / 2 : 1;
  if ((rc = w_bytes(&w, hdr, CKPT_HEADER_BYTES, err, errlen)) != 0 ||
      (rc = w_bytes(&w, table, (uint64_t)nsec * CKPT_ENTRY_BYTES, err, errlen)) != 0)
    goto done;
  for (uint32_t i = 0; i < nsec; i++) {
    if ((rc = w_zeros(&w, sec[i].off - w.written, err, errlen)) != 0 ||
        (rc = w_bytes(&w, sec[i].data, sec[i].len, err, errlen)) != 0)
      goto done;
  }
  if (fsync(fd) != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot fsync %s: %s", p->tmp, strerror(errno));
    goto done;
  }
  int cerr = close(fd);
  fd = -1;
  if (cerr != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot close %s: %s", p->tmp, strerror(errno));
    goto done;
  }
  if (rename(p->tmp, p->final) != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot rename %s to %s: %s", p->tmp, p->final,
                     strerror(errno));
    goto done;
  }
  tmp_made = 0;
  if (fsync_dir(p->dir) != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", p->dir, strerror(errno));
    goto done;
  }
  info->shard_id = st->shard_id;
  snprintf(info->name, sizeof info->name, "%s", p->name);
  info->bytes = w.written;
  info->crc32c = w.crc;
  rc = 0;
done:
  if (fd >= 0)
    close(fd);
  if (tmp_made)
    unlink(p->tmp);
  return rc;
}

int ckpt_write_shard(const char *root, const core_state *st, const ckpt_write_opts *o,
                     ckpt_file_info *info, char *err, size_t errlen) {
  const spec *s = &st->spec;
  layout l;
  memset(&l, 0, sizeof l);
  bytes bspec = {0}, bopt = {0}, bpieces = {0};
  shard_paths p;
  int rc;
  memset(info, 0, sizeof *info);

  if (st->shard_id >= s->num_shards)
    return status_fail(err, errlen, ZS_EINVAL, "state of shard %u of %u", st->shard_id,
                       s->num_shards);
  if (layout_build(s, &l) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory computing the layout");
  int need_m, need_v;
  shard_uses(s, &l, st->shard_id, &need_m, &need_v);
  if (l.shard_elems[st->shard_id] != st->nelems || (st->nelems > 0 && !st->master) ||
      (need_m && st->nelems > 0 && !st->m) || (need_v && st->nelems > 0 && !st->v)) {
    rc = status_fail(err, errlen, ZS_EINTERNAL, "the state does not match its spec's layout");
    goto done;
  }
  if (st->client_state_len > CORE_MAX_CLIENT_STATE ||
      (st->client_state_len > 0 && !st->client_state)) {
    rc = status_fail(err, errlen, ZS_EINVAL, "a client state of %zu bytes (at most %u)",
                     st->client_state_len, CORE_MAX_CLIENT_STATE);
    goto done;
  }
  ckpt_file_name(st->shard_id, s->num_shards, p.name, sizeof p.name);
  if (ckpt_step_dir(root, st->version, p.dir, sizeof p.dir) != 0 ||
      join_path(p.final, sizeof p.final, p.dir, p.name) != 0 ||
      snprintf(p.tmp, sizeof p.tmp, "%s/.%s.tmp", p.dir, p.name) >= (int)sizeof p.tmp) {
    rc = status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
    goto done;
  }

  enc_spec(&bspec, s);
  enc_optimizer(&bopt, s, st->optimizer_steps);
  enc_pieces(&bpieces, &l, st->shard_id);
  if (bspec.oom || bopt.oom || bpieces.oom) {
    rc =
        status_fail(err, errlen, ZS_ENOMEM, "out of memory encoding the checkpoint of %s", p.final);
    goto done;
  }
  out_section sec[7];
  uint32_t nsec;
  uint64_t total = plan_sections(st, need_m, need_v, &bspec, &bopt, &bpieces, sec, &nsec);
  uint8_t table[CKPT_MAX_SECTIONS * CKPT_ENTRY_BYTES], hdr[CKPT_HEADER_BYTES];
  encode_table_header(st, sec, nsec, table, hdr);
  if ((rc = prepare_step_dir(root, p.dir, err, errlen)) == 0)
    rc = write_and_publish(&p, st, o, hdr, table, sec, nsec, total, info, err, errlen);
done:
  free(bspec.p);
  free(bopt.p);
  free(bpieces.p);
  layout_free(&l);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Manifest                                                                  */
/* ------------------------------------------------------------------------ */

void ckpt_manifest_free(ckpt_manifest *m) {
  if (!m)
    return;
  free(m->files);
  memset(m, 0, sizeof *m);
}

int ckpt_manifest_write(const char *root, const ckpt_manifest *m, uint32_t writer_id, char *err,
                        size_t errlen) {
  char dir[CKPT_PATH_MAX], path[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX];
  if (ckpt_step_dir(root, m->step, dir, sizeof dir) != 0 ||
      join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0 ||
      snprintf(tmp, sizeof tmp, "%s/.%s.%" PRIu32 ".tmp", dir, CKPT_MANIFEST, writer_id) >=
          (int)sizeof tmp)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  if (m->num_shards == 0 || m->num_shards > SPEC_MAX_SHARDS || !m->files)
    return status_fail(err, errlen, ZS_EINVAL, "a manifest needs 1..%u shard files",
                       SPEC_MAX_SHARDS);
  bytes b = {0};
  char line[256];
  int n = snprintf(line, sizeof line,
                   "%s\nstep %" PRIu64 "\nversion %" PRIu64 "\noptimizer_steps %" PRIu64
                   "\nspec_hash %016" PRIx64 "\nnum_shards %" PRIu32 "\n",
                   CKPT_MANIFEST_TAG, m->step, m->version, m->optimizer_steps, m->spec_hash,
                   m->num_shards);
  bytes_raw(&b, line, (size_t)n);
  for (uint32_t i = 0; i < m->num_shards; i++) {
    const ckpt_file_info *f = &m->files[i];
    char want[CKPT_NAME_MAX];
    ckpt_file_name(i, m->num_shards, want, sizeof want);
    if (f->shard_id != i || strcmp(f->name, want) != 0) {
      free(b.p);
      return status_fail(err, errlen, ZS_EINVAL, "manifest entry %" PRIu32 " names %.64s, not %s",
                         i, f->name, want);
    }
    n = snprintf(line, sizeof line, "shard %" PRIu32 " %s %" PRIu64 " %08" PRIx32 "\n", i, f->name,
                 f->bytes, f->crc32c);
    bytes_raw(&b, line, (size_t)n);
  }
  uint32_t crc = b.oom ? 0 : crc32c(0, b.p, b.len);
  n = snprintf(line, sizeof line, "crc32c %08" PRIx32 "\n", crc);
  bytes_raw(&b, line, (size_t)n);
  if (b.oom) {
    free(b.p);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory writing %s", path);
  }
  int rc = 0;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot create %s: %s", tmp, strerror(errno));
  } else {
    if (ckpt_write_full(fd, b.p, b.len) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot write %s: %s", tmp, strerror(errno));
    else if (fsync(fd) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot fsync %s: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot close %s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot rename %s to %s: %s", tmp, path,
                       strerror(errno));
    if (rc != 0)
      unlink(tmp);
    else if (fsync_dir(dir) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", dir, strerror(errno));
  }
  free(b.p);
  return rc;
}

/* Parses "<key> <u64>\n" at *p; advances past the line. */
static int man_u64(const char **p, const char *end, const char *key, int hex, uint64_t *out) {
  size_t kl = strlen(key);
  if ((size_t)(end - *p) < kl + 2 || memcmp(*p, key, kl) != 0 || (*p)[kl] != ' ')
    return -1;
  const char *q = *p + kl + 1;
  uint64_t v = 0;
  int digits = 0;
  for (; q < end && *q != '\n'; q++, digits++) {
    int d;
    if (*q >= '0' && *q <= '9')
      d = *q - '0';
    else if (hex && *q >= 'a' && *q <= 'f')
      d = *q - 'a' + 10;
    else
      return -1;
    unsigned base = hex ? 16u : 10u;
    if (v > (UINT64_MAX - (uint64_t)d) / base)
      return -1;
    v = v * base + (uint64_t)d;
  }
  if (q == end || digits == 0 || digits > 20)
    return -1;
  *p = q + 1;
  *out = v;
  return 0;
}

int ckpt_manifest_read(const char *root, uint64_t step, ckpt_manifest *m, char *err,
                       size_t errlen) {
  memset(m, 0, sizeof *m);
  char dir[CKPT_PATH_MAX], path[CKPT_PATH_MAX];
  if (ckpt_step_dir(root, step, dir, sizeof dir) != 0 ||
      join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT
               ? status_fail(err, errlen, ZS_ENOTFOUND,
                             "checkpoint step %" PRIu64 " in %s is not complete (no %s)", step,
                             root, CKPT_MANIFEST)
               : status_fail(err, errlen, ZS_EIO, "cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  char *text = NULL;
  int rc = 0;
  if (fstat(fd, &sb) != 0 || sb.st_size <= 0 || (uint64_t)sb.st_size > CKPT_MANIFEST_MAX) {
    rc = status_fail(err, errlen, ZS_EPROTO, "%s: empty, unreadable or too large", path);
    goto done;
  }
  size_t len = (size_t)sb.st_size;
  text = malloc(len + 1);
  if (!text) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory reading %s", path);
    goto done;
  }
  if (pread_full(fd, text, len, 0) != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot read %s: %s", path, strerror(errno));
    goto done;
  }
  text[len] = '\0';
  /* The last line is "crc32c <8 hex>\n", over every byte before it. */
  const char *end = text + len;
  const char *last = NULL;
  if (len >= 16 && text[len - 1] == '\n') {
    last = end - 1;
    while (last > text && last[-1] != '\n')
      last--;
  }
  uint64_t crc = 0;
  const char *q = last;
  if (!last || man_u64(&q, end, "crc32c", 1, &crc) != 0 || q != end) {
    rc = status_fail(err, errlen, ZS_EPROTO, "%s: no valid crc32c line at its end (truncated?)",
                     path);
    goto done;
  }
  if (crc32c(0, text, (size_t)(last - text)) != (uint32_t)crc || crc > UINT32_MAX) {
    rc = status_fail(err, errlen, ZS_ECRC, "%s: CRC32C mismatch (the manifest is damaged)", path);
    goto done;
  }
  const char *p = text;
  size_t tl = strlen(CKPT_MANIFEST_TAG);
  uint64_t ns = 0;
  if ((size_t)(last - p) < tl + 1 || memcmp(p, CKPT_MANIFEST_TAG, tl) != 0 || p[tl] != '\n') {
    rc = status_fail(err, errlen, ZS_EPROTO, "%s: not a zshard checkpoint manifest (version 1)",
                     path);
    goto done;
  }
  p += tl + 1;
  if (man_u64(&p, last, "step", 0, &m->step) != 0 ||
      man_u64(&p, last, "version", 0, &m->version) != 0 ||
      man_u64(&p, last, "optimizer_steps", 0, &m->optimizer_steps) != 0 ||
      man_u64(&p, last, "spec_hash", 1, &m->spec_hash) != 0 ||
      man_u64(&p, last, "num_shards", 0, &ns) != 0 || ns == 0 || ns > SPEC_MAX_SHARDS) {
    rc = status_fail(err, errlen, ZS_EPROTO, "%s: malformed header lines", path);
    goto done;
  }
  if (m->step != step) {
    rc = status_fail(err, errlen, ZS_EPROTO,
                     "%s: says step %" PRIu64 " but is in the directory of step %" PRIu64, path,
                     m->step, step);
    goto done;
  }
  m->num_shards = (uint32_t)ns;
  m->files = calloc(ns, sizeof *m->files);
  if (!m->files) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory reading %s", path);
    goto done;
  }
  for (uint32_t i = 0; i < m->num_shards; i++) {
    ckpt_file_info *f = &m->files[i];
    char want[CKPT_NAME_MAX], fmt[96];
    ckpt_file_name(i, m->num_shards, want, sizeof want);
    /* "shard <i> <name> <bytes> <crc>\n" with the canonical name. */
    int k = snprintf(fmt, sizeof fmt, "shard %" PRIu32 " %s ", i, want);
    const char *nl = memchr(p, '\n', (size_t)(last - p));
    if (!nl || nl - p < k || memcmp(p, fmt, (size_t)k) != 0) {
      rc = status_fail(err, errlen, ZS_EPROTO, "%s: entry %" PRIu32 " is not \"%s...\"", path, i,
                       fmt);
      goto done;
    }
    const char *r = p + k;
    uint64_t bytes_v = 0, crc_v = 0;
    int digits = 0;
    for (; r < nl && *r >= '0' && *r <= '9' && digits < 20; r++, digits++)
      bytes_v = bytes_v * 10 + (uint64_t)(*r - '0');
    if (digits == 0 || r == nl || *r != ' ' || nl - (r + 1) != 8) {
      rc = status_fail(err, errlen, ZS_EPROTO, "%s: entry %" PRIu32 " is malformed", path, i);
      goto done;
    }
    for (r++; r < nl; r++) {
      int d = (*r >= '0' && *r <= '9') ? *r - '0' : (*r >= 'a' && *r <= 'f') ? *r - 'a' + 10 : -1;
      if (d < 0) {
        rc = status_fail(err, errlen, ZS_EPROTO, "%s: entry %" PRIu32 " is malformed", path, i);
        goto done;
      }
      crc_v = crc_v * 16 + (uint64_t)d;
    }
    f->shard_id = i;
    snprintf(f->name, sizeof f->name, "%s", want);
    f->bytes = bytes_v;
    f->crc32c = (uint32_t)crc_v;
    p = nl + 1;
  }
  if (p != last) {
    rc = status_fail(err, errlen, ZS_EPROTO, "%s: unexpected lines before its crc32c line", path);
    goto done;
  }
done:
  free(text);
  close(fd);
  if (rc != 0)
    ckpt_manifest_free(m);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Listing and removal                                                       */
/* ------------------------------------------------------------------------ */

/* The step of a directory name "step-<decimal>" in canonical form, or -1. */
static int parse_step_name(const char *name, uint64_t *step) {
  if (strncmp(name, "step-", 5) != 0)
    return -1;
  const char *d = name + 5;
  size_t n = strlen(d);
  if (n == 0 || n > 20 || (n > 1 && d[0] == '0'))
    return -1;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (d[i] < '0' || d[i] > '9' || v > (UINT64_MAX - (uint64_t)(d[i] - '0')) / 10)
      return -1;
    v = v * 10 + (uint64_t)(d[i] - '0');
  }
  *step = v;
  return 0;
}

static int cmp_entry(const void *a, const void *b) {
  uint64_t x = ((const ckpt_entry *)a)->step, y = ((const ckpt_entry *)b)->step;
  return x < y ? -1 : x > y;
}

int ckpt_list(const char *root, ckpt_entry **out, size_t *n, char *err, size_t errlen) {
  *out = NULL;
  *n = 0;
  DIR *d = opendir(root);
  if (!d)
    return errno == ENOENT
               ? 0
               : status_fail(err, errlen, ZS_EIO, "cannot list %s: %s", root, strerror(errno));
  ckpt_entry *v = NULL;
  size_t len = 0, cap = 0;
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    uint64_t step;
    if (parse_step_name(e->d_name, &step) != 0)
      continue;
    char path[CKPT_PATH_MAX];
    struct stat sb;
    if (join_path(path, sizeof path, root, e->d_name) != 0 || stat(path, &sb) != 0 ||
        !S_ISDIR(sb.st_mode))
      continue;
    if (len == cap) {
      size_t nc = cap ? 2 * cap : 16;
      ckpt_entry *nv = realloc(v, nc * sizeof *nv);
      if (!nv) {
        rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory listing %s", root);
        break;
      }
      v = nv;
      cap = nc;
    }
    ckpt_entry *ce = &v[len++];
    memset(ce, 0, sizeof *ce);
    ce->step = step;
    ckpt_manifest m;
    if (ckpt_manifest_read(root, step, &m, NULL, 0) == 0) {
      ce->complete = 1;
      ce->num_shards = m.num_shards;
      ce->spec_hash = m.spec_hash;
      ckpt_manifest_free(&m);
    }
  }
  closedir(d);
  if (rc != 0) {
    free(v);
    return rc;
  }
  if (len > 1)
    qsort(v, len, sizeof *v, cmp_entry);
  *out = v;
  *n = len;
  return 0;
}

static int ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && strcmp(s + a - b, suffix) == 0;
}

int ckpt_remove(const char *root, uint64_t step, char *err, size_t errlen) {
  char dir[CKPT_PATH_MAX], path[CKPT_PATH_MAX];
  if (ckpt_step_dir(root, step, dir, sizeof dir) != 0 ||
      join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  if (unlink(path) == 0) {
    if (fsync_dir(dir) != 0)
      return status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", dir,
                         strerror(errno));
  } else if (errno != ENOENT) {
    return status_fail(err, errlen, ZS_EIO, "cannot remove %s: %s", path, strerror(errno));
  }
  DIR *d = opendir(dir);
  if (!d)
    return errno == ENOENT
               ? 0
               : status_fail(err, errlen, ZS_EIO, "cannot list %s: %s", dir, strerror(errno));
  struct dirent *e;
  int rc = 0;
  while ((e = readdir(d)) != NULL) {
    const char *nm = e->d_name;
    /* Only the names this module writes; anything else stays (and keeps
     * the directory). */
    int ours = (strncmp(nm, "shard-", 6) == 0 && ends_with(nm, ".zsc")) ||
               (nm[0] == '.' && ends_with(nm, ".tmp"));
    if (!ours)
      continue;
    if (join_path(path, sizeof path, dir, nm) != 0 || (unlink(path) != 0 && errno != ENOENT)) {
      rc = status_fail(err, errlen, ZS_EIO, "cannot remove %s: %s", path, strerror(errno));
      break;
    }
  }
  closedir(d);
  if (rc == 0 && rmdir(dir) != 0 && errno != ENOENT)
    rc = status_fail(err, errlen, ZS_EIO, "cannot remove directory %s: %s", dir, strerror(errno));
  if (rc == 0)
    fsync_dir(root);
  return rc;
}

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

void ckpt_reader_close(ckpt_reader *r) {
  if (!r)
    return;
  if (r->fd >= 0)
    close(r->fd);
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
    if (pread_full(r->fd, buf, k, pos) != 0) {
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
  in_section sec[CKPT_MAX_SECTIONS]; /* sorted by offset once verified */
  const in_section *spec, *optimizer, *pieces, *client_state;
} reader_scan;

/* Opens the file and checks that it is a regular file of the size the
 * manifest recorded (when there is a manifest). */
static int reader_open_file(ckpt_reader *r, const ckpt_file_info *expect, reader_scan *s, char *err,
                            size_t errlen) {
  const char *path = r->path;
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0)
    return status_fail(err, errlen, errno == ENOENT ? ZS_ENOTFOUND : ZS_EIO, "cannot open %s: %s",
                       path, strerror(errno));
  struct stat sb;
  if (fstat(r->fd, &sb) != 0 || !S_ISREG(sb.st_mode))
    return status_fail(err, errlen, ZS_EIO, "%s: not a regular file", path);
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
  if (s->size < CKPT_HEADER_BYTES || pread_full(r->fd, hdr, sizeof hdr, 0) != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: truncated: %" PRIu64 " bytes, shorter than a header", path, s->size);
  if (memcmp(hdr, CKPT_MAGIC, 8) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "%s: not a zshard checkpoint (bad magic)", path);
  if (crc32c(0, hdr, 124) != le_load32(hdr + 124))
    return status_fail(err, errlen, ZS_ECRC, "%s: header CRC32C mismatch (the file is damaged)",
                       path);
  uint32_t fmt = le_load32(hdr + 8), hbytes = le_load32(hdr + 12), nsec = le_load32(hdr + 56);
  uint64_t table_off = le_load64(hdr + 64);
  if (fmt != CKPT_FORMAT_VERSION)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%s: format version %" PRIu32 ", this build reads %u", path, fmt,
                       CKPT_FORMAT_VERSION);
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
  if (s->size < s->table_end || pread_full(r->fd, table, tlen, CKPT_HEADER_BYTES) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "%s: truncated in its section table", path);
  if (crc32c(0, table, tlen) != s->table_crc)
    return status_fail(err, errlen, ZS_ECRC,
                       "%s: section table CRC32C mismatch (the file is damaged)", path);
  int seen[CKPT_SEC_CLIENT_STATE + 1] = {0};
  for (uint32_t i = 0; i < s->nsec; i++) {
    const uint8_t *e = table + (size_t)i * CKPT_ENTRY_BYTES;
    in_section *sec = &s->sec[i];
    *sec = (in_section){.kind = le_load32(e),
                        .off = le_load64(e + 8),
                        .len = le_load64(e + 16),
                        .crc = le_load32(e + 24),
                        .got = 0};
    if (sec->kind < CKPT_SEC_SPEC || sec->kind > CKPT_SEC_CLIENT_STATE || seen[sec->kind]++ ||
        le_load32(e + 4) != 0 || le_load32(e + 28) != 0)
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: section %" PRIu32 " has an unknown or repeated kind %" PRIu32, path,
                         i, sec->kind);
    if (sec->off % CKPT_ALIGN != 0 || sec->off < s->table_end || sec->len > s->size ||
        sec->off > s->size - sec->len)
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: truncated: the %s section spans bytes %" PRIu64 "..%" PRIu64
                         " but the file has %" PRIu64,
                         path, section_name(sec->kind), sec->off, sec->off + sec->len, s->size);
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
                         section_name(sec[i].kind));
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
    }
    if (sec->kind >= CKPT_SEC_MASTER && sec->kind <= CKPT_SEC_EXP_AVG_SQ &&
        sec->len != r->h.nelems * sizeof(float))
      return status_fail(err, errlen, ZS_EPROTO,
                         "%s: the %s section has %" PRIu64
                         " bytes, the header's arena needs %" PRIu64,
                         r->path, section_name(sec->kind), sec->len, r->h.nelems * sizeof(float));
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
  if (pread_full(r->fd, got, (size_t)sec->len, sec->off) != 0)
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
  if ((rc = dec_spec(*small, (size_t)s->spec->len, &r->spec, why, sizeof why)) != 0)
    return status_fail(err, errlen, rc, "%s: %s", path, why);
  if (spec_hash(&r->spec) != r->h.spec_hash || r->spec.num_shards != r->h.num_shards)
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
      enc_optimizer(&expect_bytes, &r->spec, r->h.optimizer_steps);
    else
      enc_pieces(&expect_bytes, &r->lay, r->h.shard_id);
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
          r->path, section_name((uint32_t)regen[k].kind));
  }
  free(expect_bytes.p);
  return rc;
}

/* The moment sections present must be exactly those the shard's optimizers
 * use; the client state, opaque to the shard, is read when present. */
static int reader_load_rest(ckpt_reader *r, const reader_scan *s, char *err, size_t errlen) {
  const char *path = r->path;
  int need_m, need_v;
  shard_uses(&r->spec, &r->lay, r->h.shard_id, &need_m, &need_v);
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
    if (pread_full(r->fd, r->client_state, (size_t)sc->len, sc->off) != 0)
      return status_fail(err, errlen, ZS_EIO, "%s: read error: %s", path, strerror(errno));
    r->client_state_len = (size_t)sc->len;
  }
  return 0;
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
                       section_name(CKPT_SEC_MASTER + (uint32_t)a));
  if (first > r->h.nelems || n > r->h.nelems - first)
    return status_fail(err, errlen, ZS_ERANGE,
                       "%s: elements %" PRIu64 "..%" PRIu64 " are past its arena", r->path, first,
                       first + n);
  if (n == 0)
    return 0;
  if (pread_full(r->fd, dst, (size_t)(n * sizeof(float)), r->arr_off[a] + first * sizeof(float)) !=
      0)
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
  if (join_path(path, sizeof path, dir, m->files[j].name) != 0)
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
        (rc = take_client_state(r, out, err, errlen)) != 0)
      goto done;
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
      if (join_path(path, sizeof path, dir, m.files[j0].name) == 0 && stat(path, &sb) == 0)
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
        (rc = take_client_state(r, out, err, errlen)) != 0)
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
      if (!needed[j] ||
          (join_path(path, sizeof path, dir, m.files[j].name) == 0 && stat(path, &sb) == 0))
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
