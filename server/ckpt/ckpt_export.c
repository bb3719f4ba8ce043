/*
 * ckpt_export — a checkpoint as one safetensors file of whole tensors (see
 * ckpt.h). The layout of the output, from the published safetensors format:
 *
 *   u64 little-endian N, the length of the header
 *   N bytes of JSON: {"__metadata__": {string: string, ...},
 *                     "<name>": {"dtype": "F32"|"BF16"|"F16",
 *                                "shape": [d0, d1, ...],
 *                                "data_offsets": [begin, end]}, ...}
 *     padded with spaces to a multiple of 8 bytes
 *   the tensors' bytes, little-endian, row-major, back to back: offsets are
 *   relative to the first byte after the header and cover it without holes.
 *
 * Tensors are assembled one at a time from the pieces of every shard file
 * (each file is verified when opened), so memory stays at about one tensor.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/dtype.h"
#include "common/base/le.h"
#include "common/base/status.h"
#include "server/ckpt/ckpt.h"
#include "server/ckpt/ckpt_format.h"
#include "server/optim/optim.h"

/* A growable string for the JSON header. */
typedef struct sbuf {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
  if (b->oom)
    return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n + 1)
      cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

__attribute__((format(printf, 2, 3))) static void sb_printf(sbuf *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0)
    sb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string: names are validated UTF-8 without control characters
 * (spec_validate), so only the quote and the backslash need escaping. */
static void sb_json_str(sbuf *b, const char *s, const char *suffix) {
  sb_add(b, "\"", 1);
  for (const char *p = s; *p; p++) {
    if (*p == '"' || *p == '\\')
      sb_add(b, "\\", 1);
    sb_add(b, p, 1);
  }
  if (suffix)
    sb_add(b, suffix, strlen(suffix));
  sb_add(b, "\"", 1);
}

/* One output tensor: a parameter or a moment of one. */
typedef struct out_tensor {
  uint32_t tensor;
  ckpt_array array;
  const char *suffix; /* NULL, ".exp_avg", ".exp_avg_sq", ".momentum_buffer" */
  zs_dtype dtype;
  uint64_t begin, end;
} out_tensor;

static const char *dtype_name(zs_dtype d) {
  return d == ZS_DTYPE_BF16 ? "BF16" : d == ZS_DTYPE_FP16 ? "F16" : "F32";
}

/* 1 if some other output name equals tensor t's name plus suffix. */
static int name_taken(const spec *s, const char *base, const char *suffix) {
  size_t bl = strlen(base), sl = strlen(suffix);
  for (uint32_t i = 0; i < s->num_tensors; i++) {
    const char *n = s->tensors[i].name;
    if (strlen(n) == bl + sl && strncmp(n, base, bl) == 0 && strcmp(n + bl, suffix) == 0)
      return 1;
  }
  return 0;
}

/* Opens every shard file of the checkpoint (each verified whole) and checks
 * that its header agrees with the manifest. */
static int open_readers(const char *dir, const ckpt_manifest *m, ckpt_reader **readers, char *err,
                        size_t errlen) {
  for (uint32_t j = 0; j < m->num_shards; j++) {
    char fpath[CKPT_PATH_MAX];
    if (snprintf(fpath, sizeof fpath, "%s/%s", dir, m->files[j].name) >= (int)sizeof fpath)
      return status_fail(err, errlen, ZS_EINVAL, "path too long");
    int rc = ckpt_reader_open(fpath, &m->files[j], &readers[j], err, errlen);
    if (rc != 0)
      return rc;
    const ckpt_header *h = ckpt_reader_header(readers[j]);
    if (h->shard_id != j || h->spec_hash != m->spec_hash || h->version != m->version)
      return status_fail(err, errlen, ZS_EPROTO, "%s: its header disagrees with the manifest",
                         fpath);
  }
  return 0;
}

/* The output list, each parameter followed by its moments when asked, with
 * their byte ranges; *largest is the most elements of one tensor. */
static int list_outputs(const spec *s, zs_dtype dtype, int moments, out_tensor **outs_out,
                        size_t *nouts_out, uint64_t *largest_out, char *err, size_t errlen) {
  out_tensor *outs = calloc((size_t)s->num_tensors * 3, sizeof *outs);
  size_t nouts = 0;
  if (!outs)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  *outs_out = outs;
  uint64_t off = 0, largest = 0;
  for (uint32_t t = 0; t < s->num_tensors; t++) {
    const spec_tensor *st = &s->tensors[t];
    const spec_group *g = &s->groups[st->group];
    unsigned needs = optim_state_needs(g);
    if (st->numel > largest)
      largest = st->numel;
    outs[nouts++] = (out_tensor){t, CKPT_ARRAY_MASTER, NULL, dtype, 0, 0};
    if (moments && (needs & OPTIM_STATE_M))
      outs[nouts++] = (out_tensor){
          t, CKPT_ARRAY_EXP_AVG, spec_optim_of(g->optimizer)->m_name, ZS_DTYPE_FP32, 0, 0};
    if (moments && (needs & OPTIM_STATE_V))
      outs[nouts++] = (out_tensor){
          t, CKPT_ARRAY_EXP_AVG_SQ, spec_optim_of(g->optimizer)->v_name, ZS_DTYPE_FP32, 0, 0};
  }
  *nouts_out = nouts;
  *largest_out = largest;
  for (size_t i = 0; i < nouts; i++) {
    out_tensor *ot = &outs[i];
    if (ot->suffix && name_taken(s, s->tensors[ot->tensor].name, ot->suffix))
      return status_fail(err, errlen, ZS_EEXIST,
                         "cannot export the moments: a tensor is already named \"%.200s%s\"",
                         s->tensors[ot->tensor].name, ot->suffix);
    ot->begin = off;
    off += dtype_bytes(ot->dtype, s->tensors[ot->tensor].numel);
    ot->end = off;
  }
  return 0;
}

/* The safetensors JSON header: the run's metadata, then every output with
 * its dtype, shape and byte range, padded to 8 bytes. */
static int build_header(sbuf *js, const spec *s, const ckpt_manifest *m, const out_tensor *outs,
                        size_t nouts, char *err, size_t errlen) {
  const char *head = "{\"__metadata__\":{\"format\":\"pt\",\"zshard.job\":";
  sb_add(js, head, strlen(head));
  sb_json_str(js, s->job, NULL);
  sb_printf(js,
            ",\"zshard.step\":\"%" PRIu64 "\",\"zshard.optimizer_steps\":\"%" PRIu64
            "\",\"zshard.spec_hash\":\"%016" PRIx64 "\"}",
            m->step, m->optimizer_steps, m->spec_hash);
  for (size_t i = 0; i < nouts; i++) {
    const out_tensor *ot = &outs[i];
    const spec_tensor *st = &s->tensors[ot->tensor];
    sb_add(js, ",", 1);
    sb_json_str(js, st->name, ot->suffix);
    sb_printf(js, ":{\"dtype\":\"%s\",\"shape\":[", dtype_name(ot->dtype));
    if (st->ndim == 0)
      sb_printf(js, "%" PRIu64, st->numel);
    for (uint32_t d = 0; d < st->ndim; d++)
      sb_printf(js, "%s%" PRIu64, d ? "," : "", st->shape[d]);
    sb_printf(js, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", ot->begin, ot->end);
  }
  sb_add(js, "}", 1);
  while (!js->oom && js->len % 8 != 0)
    sb_add(js, " ", 1); /* the data then starts 8-byte aligned */
  if (js->oom)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory building the safetensors header");
  return 0;
}

/* Writes the header and then each output, assembled from its pieces in every
 * shard's file and converted when the export dtype asks. f32 and f16 hold the
 * largest tensor. */
static int write_tensors(int fd, const char *tmp, const sbuf *js, ckpt_reader **readers,
                         const spec *s, const layout *l, const out_tensor *outs, size_t nouts,
                         float *f32, uint16_t *f16, char *err, size_t errlen) {
  uint8_t len8[8];
  le_store64(len8, (uint64_t)js->len);
  if (ckpt_write_full(fd, len8, 8) != 0 || ckpt_write_full(fd, js->p, js->len) != 0)
    return status_fail(err, errlen, ZS_EIO, "cannot write %s: %s", tmp, strerror(errno));
  for (size_t i = 0; i < nouts; i++) {
    const out_tensor *ot = &outs[i];
    uint32_t t = ot->tensor;
    for (uint32_t k = l->tensor_first[t]; k < l->tensor_first[t + 1]; k++) {
      const layout_piece *pc = &l->pieces[k];
      int rc = ckpt_reader_read(readers[pc->shard], ot->array, pc->arena_off, pc->numel,
                                f32 + pc->offset, err, errlen);
      if (rc != 0)
        return rc;
    }
    uint64_t n = s->tensors[t].numel;
    const void *src = f32;
    if (ot->dtype != ZS_DTYPE_FP32) {
      dtype_from_f32(ot->dtype, f32, f16, (size_t)n);
      src = f16;
    }
    if (ckpt_write_full(fd, src, (size_t)(ot->end - ot->begin)) != 0)
      return status_fail(err, errlen, ZS_EIO, "cannot write %s: %s", tmp, strerror(errno));
  }
  return 0;
}

int ckpt_export_safetensors(const char *root, uint64_t step, const char *path,
                            const ckpt_export_opts *o, char *err, size_t errlen) {
  zs_dtype dtype = o && o->dtype ? o->dtype : ZS_DTYPE_FP32;
  int moments = o && o->moments;
  if (dtype != ZS_DTYPE_FP32 && dtype != ZS_DTYPE_BF16 && dtype != ZS_DTYPE_FP16)
    return status_fail(err, errlen, ZS_EDTYPE, "export dtype must be fp32, bf16 or fp16");
  char dir[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX];
  if (ckpt_step_dir(root, step, dir, sizeof dir) != 0 ||
      snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
    return status_fail(err, errlen, ZS_EINVAL, "path too long");
  ckpt_manifest m;
  int rc = ckpt_manifest_read(root, step, &m, err, errlen);
  if (rc != 0)
    return rc;
  ckpt_reader **readers = calloc(m.num_shards, sizeof *readers);
  out_tensor *outs = NULL;
  size_t nouts = 0;
  uint64_t largest = 0;
  sbuf js = {0};
  float *f32 = NULL;
  uint16_t *f16 = NULL;
  int fd = -1;
  if (!readers) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
    goto done;
  }
  if ((rc = open_readers(dir, &m, readers, err, errlen)) != 0)
    goto done;
  const spec *s = ckpt_reader_spec(readers[0]);
  const layout *l = ckpt_reader_layout(readers[0]);
  if ((rc = list_outputs(s, dtype, moments, &outs, &nouts, &largest, err, errlen)) != 0 ||
      (rc = build_header(&js, s, &m, outs, nouts, err, errlen)) != 0)
    goto done;

  f32 = malloc((size_t)(largest ? largest : 1) * sizeof(float));
  if (dtype != ZS_DTYPE_FP32)
    f16 = malloc((size_t)dtype_bytes(dtype, largest ? largest : 1));
  if (!f32 || (dtype != ZS_DTYPE_FP32 && !f16)) {
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory for a tensor of %" PRIu64 " elements",
                     largest);
    goto done;
  }
  fd = ckpt__open_write(tmp);
  if (fd < 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot create %s: %s", tmp, strerror(errno));
    goto done;
  }
  if ((rc = write_tensors(fd, tmp, &js, readers, s, l, outs, nouts, f32, f16, err, errlen)) != 0)
    goto done;
  if (fsync(fd) != 0 || close(fd) != 0) {
    fd = -1;
    rc = status_fail(err, errlen, ZS_EIO, "cannot finish %s: %s", tmp, strerror(errno));
    goto done;
  }
  fd = -1;
  if (ckpt__fs_rename(tmp, path) != 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    goto done;
  }
  rc = 0;
done:
  if (fd >= 0)
    close(fd);
  if (rc != 0)
    ckpt__fs_unlink(tmp, 0);
  if (readers)
    for (uint32_t j = 0; j < m.num_shards; j++)
      ckpt_reader_close(readers[j]);
  free(readers);
  free(outs);
  free(js.p);
  free(f32);
  free(f16);
  ckpt_manifest_free(&m);
  return rc;
}
