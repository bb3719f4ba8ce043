/*
 * ckpt_write — writing one shard's checkpoint file: the sections planned and
 * CRC'd in memory, then header, table and sections written in one pass to a
 * temporary file that is made durable and renamed into place.
 */
#include "common/base/status.h"
#include "server/ckpt/ckpt_format.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/base/crc32c.h"
#include "common/base/le.h"
#include "common/base/log.h"

static uint64_t align_up(uint64_t x) {
  return (x + CKPT_ALIGN - 1) / CKPT_ALIGN * CKPT_ALIGN;
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
                              const bytes *bopt, const bytes *bpieces, const bytes *bsteps,
                              const bytes *bmembers, out_section *sec, uint32_t *nsec_out) {
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
  /* The same rule: only when a tensor's count is not the job's. */
  if (bsteps->len > 0)
    sec[nsec++] = (out_section){CKPT_SEC_TENSOR_STEPS, bsteps->p, bsteps->len, 0, 0};
  /* An elastic job's membership (format 2). */
  if (bmembers->len > 0)
    sec[nsec++] = (out_section){CKPT_SEC_MEMBERS, bmembers->p, bmembers->len, 0, 0};
  uint64_t off = align_up(CKPT_HEADER_BYTES + (uint64_t)nsec * CKPT_ENTRY_BYTES);
  for (uint32_t i = 0; i < nsec; i++) {
    sec[i].off = off;
    sec[i].crc = sec[i].len ? crc32c(0, sec[i].data, (size_t)sec[i].len) : 0;
    off = align_up(off + sec[i].len);
  }
  *nsec_out = nsec;
  return sec[nsec - 1].off + sec[nsec - 1].len;
}

/* Appends the tensor_steps section of st to b when one of the shard's
 * tensors is at another count than the job; nothing otherwise. A tensor
 * without a piece here is written at the job's count. */
static void enc_tensor_steps(bytes *b, const core_state *st, const layout *l) {
  if (!st->tensor_steps)
    return;
  int differs = 0;
  for (uint32_t i = 0; i < l->num_pieces && !differs; i++)
    differs = l->pieces[i].shard == st->shard_id &&
              st->tensor_steps[l->pieces[i].tensor] != st->optimizer_steps;
  if (!differs)
    return;
  for (uint32_t t = 0; t < st->spec.num_tensors; t++) {
    uint64_t n = st->optimizer_steps;
    for (uint32_t i = l->tensor_first[t]; i < l->tensor_first[t + 1]; i++)
      if (l->pieces[i].shard == st->shard_id)
        n = st->tensor_steps[t];
    uint8_t le[8];
    le_store64(le, n);
    ckpt__bytes_raw(b, le, sizeof le);
  }
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
  /* Format 1 unless the file has a members section: older builds still
   * read every checkpoint of a job with a fixed membership. */
  uint32_t fmt = CKPT_FORMAT_VERSION_MIN;
  for (uint32_t i = 0; i < nsec; i++)
    if (sec[i].kind == CKPT_SEC_MEMBERS)
      fmt = CKPT_FORMAT_VERSION;
  le_store32(hdr + 8, fmt);
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
  if (ckpt__fsync_dir(root) != 0)
    return status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", root, strerror(errno));
  char manifest[CKPT_PATH_MAX];
  if (ckpt__join_path(manifest, sizeof manifest, dir, CKPT_MANIFEST) == 0 &&
      ckpt__fs_unlink(manifest, 0) == 0 && ckpt__fsync_dir(dir) != 0)
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
  int fd = ckpt__open_write(p->tmp);
  if (fd < 0)
    return status_fail(err, errlen, ckpt__fs_status(errno), "cannot create %s: %s", p->tmp,
                       ckpt__fs_strerror(errno));
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
  if (ckpt__fs_rename(p->tmp, p->final) != 0) {
    rc = status_fail(err, errlen, ckpt__fs_status(errno), "cannot rename %s to %s: %s", p->tmp,
                     p->final, ckpt__fs_strerror(errno));
    goto done;
  }
  tmp_made = 0;
  if (ckpt__fsync_dir(p->dir) != 0) {
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
    ckpt__fs_unlink(p->tmp, 0);
  return rc;
}

int ckpt_write_shard(const char *root, const core_state *st, const ckpt_write_opts *o,
                     ckpt_file_info *info, char *err, size_t errlen) {
  const spec *s = &st->spec;
  layout l;
  memset(&l, 0, sizeof l);
  bytes bspec = {0}, bopt = {0}, bpieces = {0}, bsteps = {0}, bmembers = {0};
  shard_paths p;
  int rc;
  memset(info, 0, sizeof *info);

  if (st->shard_id >= s->num_shards)
    return status_fail(err, errlen, ZS_EINVAL, "state of shard %u of %u", st->shard_id,
                       s->num_shards);
  if (layout_build(s, &l) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory computing the layout");
  int need_m, need_v;
  ckpt__shard_uses(s, &l, st->shard_id, &need_m, &need_v);
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
      ckpt__join_path(p.final, sizeof p.final, p.dir, p.name) != 0 ||
      snprintf(p.tmp, sizeof p.tmp, "%s/.%s.tmp", p.dir, p.name) >= (int)sizeof p.tmp) {
    rc = status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
    goto done;
  }

  ckpt__enc_spec(&bspec, s);
  ckpt__enc_optimizer(&bopt, s, st->optimizer_steps);
  ckpt__enc_pieces(&bpieces, &l, st->shard_id);
  enc_tensor_steps(&bsteps, st, &l);
  if (st->members)
    ckpt__enc_members(&bmembers, st->members, s->world_size, CKPT_FORMAT_VERSION);
  if (bspec.oom || bopt.oom || bpieces.oom || bsteps.oom || bmembers.oom) {
    rc =
        status_fail(err, errlen, ZS_ENOMEM, "out of memory encoding the checkpoint of %s", p.final);
    goto done;
  }
  out_section sec[CKPT_MAX_SECTIONS];
  uint32_t nsec;
  uint64_t total =
      plan_sections(st, need_m, need_v, &bspec, &bopt, &bpieces, &bsteps, &bmembers, sec, &nsec);
  uint8_t table[CKPT_MAX_SECTIONS * CKPT_ENTRY_BYTES], hdr[CKPT_HEADER_BYTES];
  encode_table_header(st, sec, nsec, table, hdr);
  if ((rc = prepare_step_dir(root, p.dir, err, errlen)) == 0)
    rc = write_and_publish(&p, st, o, hdr, table, sec, nsec, total, info, err, errlen);
done:
  free(bspec.p);
  free(bopt.p);
  free(bpieces.p);
  free(bsteps.p);
  free(bmembers.p);
  layout_free(&l);
  return rc;
}
