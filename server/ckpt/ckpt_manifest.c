/*
 * ckpt_manifest — the checkpoint directory: step directories and file names,
 * the durable-file helpers, the MANIFEST that commits a step (writing and
 * verified reading), and listing and removing steps.
 */
#include "common/base/status.h"
#include "server/ckpt/ckpt_format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/crc32c.h"

#define CKPT_MANIFEST_TAG "zshard-checkpoint-manifest 1"
#define CKPT_MANIFEST_MAX ((size_t)2 << 20)

/* ------------------------------------------------------------------------ */
/* Files and paths                                                           */
/* ------------------------------------------------------------------------ */

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
int ckpt__pread_full(int fd, void *buf, size_t n, uint64_t off) {
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

int ckpt__fsync_dir(const char *dir) {
  int fd = ckpt__fs_open(dir, O_RDONLY | O_DIRECTORY, 0);
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

int ckpt__open_read(const char *path, int *fd, char *err, size_t errlen) {
  *fd = ckpt__fs_open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0);
  if (*fd < 0)
    return status_fail(err, errlen, ckpt__fs_status(errno), "cannot open %s: %s", path,
                       ckpt__fs_strerror(errno));
  struct stat sb;
  if (fstat(*fd, &sb) == 0 && S_ISREG(sb.st_mode))
    return 0; /* O_NONBLOCK means nothing to a regular file's reads */
  close(*fd);
  *fd = -1;
  return status_fail(err, errlen, ZS_EIO,
                     "%s: not a regular file (a FIFO, device or directory is never read as "
                     "checkpoint state)",
                     path);
}

int ckpt__open_write(const char *path) {
  int fd = ckpt__fs_open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_NOCTTY, 0644);
  if (fd < 0)
    return -1;
  struct stat sb;
  if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode))
    return fd;
  close(fd);
  errno = EINVAL;
  return -1;
}

int ckpt__join_path(char *buf, size_t len, const char *dir, const char *name) {
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
  int crc = ckpt__fs_mkdirs(dir);
  if (crc == 0)
    return 0;
  if (crc < 0)
    return status_fail(err, errlen, errno == ELOOP || errno == EXDEV ? ZS_EPERM : ZS_EIO,
                       "cannot create directory %s: %s", dir, ckpt__fs_strerror(errno));
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
      ckpt__join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0 ||
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
  ckpt__bytes_raw(&b, line, (size_t)n);
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
    ckpt__bytes_raw(&b, line, (size_t)n);
  }
  uint32_t crc = b.oom ? 0 : crc32c(0, b.p, b.len);
  n = snprintf(line, sizeof line, "crc32c %08" PRIx32 "\n", crc);
  ckpt__bytes_raw(&b, line, (size_t)n);
  if (b.oom) {
    free(b.p);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory writing %s", path);
  }
  int rc = 0;
  int fd = ckpt__open_write(tmp);
  if (fd < 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot create %s: %s", tmp, strerror(errno));
  } else {
    if (ckpt_write_full(fd, b.p, b.len) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot write %s: %s", tmp, strerror(errno));
    else if (fsync(fd) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot fsync %s: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot close %s: %s", tmp, strerror(errno));
    if (rc == 0 && ckpt__fs_rename(tmp, path) != 0)
      rc = status_fail(err, errlen, ZS_EIO, "cannot rename %s to %s: %s", tmp, path,
                       strerror(errno));
    if (rc != 0)
      ckpt__fs_unlink(tmp, 0);
    else if (ckpt__fsync_dir(dir) != 0)
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
      ckpt__join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  int fd = -1;
  int orc = ckpt__open_read(path, &fd, err, errlen);
  if (orc == ZS_ENOTFOUND)
    return status_fail(err, errlen, ZS_ENOTFOUND,
                       "checkpoint step %" PRIu64 " in %s is not complete (no %s)", step, root,
                       CKPT_MANIFEST);
  if (orc != 0)
    return orc;
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
  if (ckpt__pread_full(fd, text, len, 0) != 0) {
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
  DIR *d = ckpt__fs_opendir(root);
  if (!d)
    return errno == ENOENT ? 0
                           : status_fail(err, errlen, ckpt__fs_status(errno), "cannot list %s: %s",
                                         root, ckpt__fs_strerror(errno));
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
    if (ckpt__join_path(path, sizeof path, root, e->d_name) != 0 ||
        ckpt__fs_lstat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
      continue; /* a link named like a step is not a checkpoint of this directory */
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
      ckpt__join_path(path, sizeof path, dir, CKPT_MANIFEST) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "checkpoint path too long under %.200s", root);
  if (ckpt__fs_unlink(path, 0) == 0) {
    if (ckpt__fsync_dir(dir) != 0)
      return status_fail(err, errlen, ZS_EIO, "cannot fsync directory %s: %s", dir,
                         strerror(errno));
  } else if (errno != ENOENT) {
    return status_fail(err, errlen, ckpt__fs_status(errno), "cannot remove %s: %s", path,
                       ckpt__fs_strerror(errno));
  }
  DIR *d = ckpt__fs_opendir(dir);
  if (!d)
    return errno == ENOENT ? 0
                           : status_fail(err, errlen, ckpt__fs_status(errno), "cannot list %s: %s",
                                         dir, ckpt__fs_strerror(errno));
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
    if (ckpt__join_path(path, sizeof path, dir, nm) != 0 ||
        (ckpt__fs_unlink(path, 0) != 0 && errno != ENOENT)) {
      rc = status_fail(err, errlen, ZS_EIO, "cannot remove %s: %s", path, strerror(errno));
      break;
    }
  }
  closedir(d);
  if (rc == 0 && ckpt__fs_unlink(dir, AT_REMOVEDIR) != 0 && errno != ENOENT)
    rc = status_fail(err, errlen, ZS_EIO, "cannot remove directory %s: %s", dir, strerror(errno));
  if (rc == 0)
    ckpt__fsync_dir(root);
  return rc;
}
