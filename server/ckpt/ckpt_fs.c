/*
 * ckpt_fs — file operations on checkpoint paths that never leave the state
 * directory (see "Confinement" in ckpt.h).
 *
 * A path under a confined directory (an anchor) is resolved from the
 * anchor's directory descriptor, one component at a time, and no component
 * may be a symbolic link: with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
 * where the kernel has it (Linux 5.6+), otherwise by openat(O_NOFOLLOW |
 * O_DIRECTORY) on each directory component. The last component is then
 * operated on relative to its parent's descriptor (openat with O_NOFOLLOW,
 * fstatat with AT_SYMLINK_NOFOLLOW, unlinkat, renameat, mkdirat), so a link
 * swapped in between a check and a use is never followed either. A symbolic
 * link anywhere below the anchor fails with ELOOP. The anchor itself may be
 * a link (an operator's /var/lib/zshard -> /data/zshard): it is opened once,
 * when it is confined.
 *
 * Paths under no anchor (the CLI's offline commands on an operator's own
 * files) keep plain path semantics.
 *
 * Locks: fs_mu guards the anchor table; it is a leaf, held only to look an
 * anchor up and dup its descriptor, never across file-system calls.
 */
#include "common/base/status.h"
#include "server/ckpt/ckpt.h"
#include "server/ckpt/ckpt_format.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FS_MAX_ANCHORS 16

typedef struct anchor {
  char path[CKPT_PATH_MAX]; /* without trailing slashes */
  size_t len;
  int fd;
  unsigned refs;
} anchor;

static pthread_mutex_t fs_mu = PTHREAD_MUTEX_INITIALIZER;
static anchor anchors[FS_MAX_ANCHORS]; /* (fs_mu) refs == 0: free */
/* 1 once openat2 answered ENOSYS (or a test asked for the fallback). */
static atomic_int no_openat2;

void ckpt__fs_force_component_walk(int on) {
  atomic_store(&no_openat2, on);
}

static size_t trimmed_len(const char *dir) {
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/')
    n--;
  return n;
}

int ckpt_fs_confine(const char *dir, char *err, size_t errlen) {
  size_t n = trimmed_len(dir);
  if (n == 0 || n >= CKPT_PATH_MAX)
    return status_fail(err, errlen, ZS_EINVAL, "state directory path is empty or too long");
  int rc = 0;
  pthread_mutex_lock(&fs_mu);
  anchor *free_slot = NULL;
  for (int i = 0; i < FS_MAX_ANCHORS; i++) {
    anchor *a = &anchors[i];
    if (a->refs == 0) {
      if (!free_slot)
        free_slot = a;
    } else if (a->len == n && memcmp(a->path, dir, n) == 0) {
      a->refs++;
      goto out;
    }
  }
  if (!free_slot) {
    rc = status_fail(err, errlen, ZS_ELIMIT, "more than %d state directories in one process",
                     FS_MAX_ANCHORS);
    goto out;
  }
  memcpy(free_slot->path, dir, n);
  free_slot->path[n] = '\0';
  free_slot->fd = open(free_slot->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (free_slot->fd < 0) {
    rc = status_fail(err, errlen, ZS_EIO, "cannot open state directory %s: %s", free_slot->path,
                     strerror(errno));
    goto out;
  }
  free_slot->len = n;
  free_slot->refs = 1;
out:
  pthread_mutex_unlock(&fs_mu);
  return rc;
}

void ckpt_fs_release(const char *dir) {
  size_t n = trimmed_len(dir);
  pthread_mutex_lock(&fs_mu);
  for (int i = 0; i < FS_MAX_ANCHORS; i++) {
    anchor *a = &anchors[i];
    if (a->refs > 0 && a->len == n && memcmp(a->path, dir, n) == 0) {
      if (--a->refs == 0)
        close(a->fd);
      break;
    }
  }
  pthread_mutex_unlock(&fs_mu);
}

/* The anchor path lies under: a dup of its descriptor and *rel the rest of
 * the path (no leading slashes, "" for the anchor itself); -1 when path is
 * under no anchor (errno 0), or with errno when dup fails. The longest
 * anchor wins, so a subdirectory confined on its own is resolved from its
 * own descriptor. */
static int anchor_of(const char *path, const char **rel) {
  int fd = -1;
  size_t best = 0;
  errno = 0;
  pthread_mutex_lock(&fs_mu);
  for (int i = 0; i < FS_MAX_ANCHORS; i++) {
    const anchor *a = &anchors[i];
    if (a->refs == 0 || a->len < best || strncmp(path, a->path, a->len) != 0)
      continue;
    /* "/" as an anchor is its own separator. */
    if (path[a->len] != '\0' && path[a->len] != '/' && !(a->len == 1 && a->path[0] == '/'))
      continue;
    if (fd >= 0)
      close(fd);
    fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    best = a->len;
    if (fd < 0)
      break;
  }
  pthread_mutex_unlock(&fs_mu);
  if (fd >= 0) {
    const char *r = path + best;
    while (*r == '/')
      r++;
    *rel = r;
  }
  return fd;
}

/* openat2 beneath dirfd with no symbolic link anywhere; -2 when the kernel
 * lacks openat2 (the caller walks instead). */
static int open_beneath2(int dirfd, const char *rel, int flags) {
  if (atomic_load(&no_openat2))
    return -2;
  struct open_how how = {
      .flags = (uint64_t)(flags | O_CLOEXEC),
      .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
  };
  long fd = syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
  if (fd < 0 && (errno == ENOSYS || errno == EPERM)) {
    /* EPERM: a seccomp filter that does not know the call. */
    atomic_store(&no_openat2, 1);
    return -2;
  }
  return (int)fd;
}

/* The descriptor of directory `rel` (components separated by '/', none of
 * them "..", "" for dirfd itself) below dirfd, each component opened with
 * O_NOFOLLOW; with `create`, missing components are made (mode 0755).
 * dirfd is consumed. -1 with errno (ELOOP for a symbolic link). */
static int walk_dirs(int dirfd, const char *rel, int create) {
  if (!create && *rel) {
    int fd = open_beneath2(dirfd, rel, O_RDONLY | O_DIRECTORY);
    if (fd != -2) {
      int e = errno;
      close(dirfd);
      errno = e;
      return fd;
    }
  }
  char comp[CKPT_PATH_MAX];
  const char *p = rel;
  while (*p) {
    const char *e = strchr(p, '/');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n >= sizeof comp || (n == 2 && p[0] == '.' && p[1] == '.')) {
      close(dirfd);
      errno = n >= sizeof comp ? ENAMETOOLONG : EXDEV;
      return -1;
    }
    memcpy(comp, p, n);
    comp[n] = '\0';
    p += n;
    while (*p == '/')
      p++;
    if (n == 0 || (n == 1 && comp[0] == '.'))
      continue;
    if (create && mkdirat(dirfd, comp, 0755) != 0 && errno != EEXIST) {
      int err = errno;
      close(dirfd);
      errno = err;
      return -1;
    }
    int fd = openat(dirfd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      struct stat sb;
      /* O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR; the caller's
       * sentence should say "link". */
      if (err == ENOTDIR && fstatat(dirfd, comp, &sb, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISLNK(sb.st_mode))
        err = ELOOP;
      close(dirfd);
      errno = err;
      return -1;
    }
    close(dirfd);
    dirfd = fd;
  }
  return dirfd;
}

/* Splits a confined path into its parent's descriptor and last component
 * (copied to base). Returns the descriptor, AT_FDCWD with base = path for a
 * path under no anchor, or -1 with errno. The caller closes a descriptor
 * >= 0. */
static int parent_of(const char *path, char *base, size_t baselen) {
  const char *rel;
  int afd = anchor_of(path, &rel);
  if (afd < 0) {
    if (errno != 0)
      return -1;
    if (snprintf(base, baselen, "%s", path) >= (int)baselen) {
      errno = ENAMETOOLONG;
      return -1;
    }
    return AT_FDCWD;
  }
  char dir[CKPT_PATH_MAX];
  size_t n = strlen(rel);
  while (n > 0 && rel[n - 1] == '/')
    n--;
  size_t cut = n;
  while (cut > 0 && rel[cut - 1] != '/')
    cut--;
  if (n - cut >= baselen || cut >= sizeof dir) {
    close(afd);
    errno = ENAMETOOLONG;
    return -1;
  }
  memcpy(base, rel + cut, n - cut);
  base[n - cut] = '\0';
  if (n == 0)
    snprintf(base, baselen, ".");
  memcpy(dir, rel, cut);
  dir[cut] = '\0';
  return walk_dirs(afd, dir, 0);
}

static void close_parent(int fd) {
  if (fd >= 0) {
    int e = errno;
    close(fd);
    errno = e;
  }
}

int ckpt__fs_open(const char *path, int flags, mode_t mode) {
  char base[CKPT_PATH_MAX];
  int dfd = parent_of(path, base, sizeof base);
  if (dfd == -1)
    return -1;
  if (dfd != AT_FDCWD)
    flags |= O_NOFOLLOW;
  int fd = openat(dfd, base, flags | O_CLOEXEC, mode);
  struct stat sb;
  /* O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR; the sentence should
   * say "link". */
  if (fd < 0 && errno == ENOTDIR && dfd != AT_FDCWD &&
      fstatat(dfd, base, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(sb.st_mode))
    errno = ELOOP;
  close_parent(dfd);
  return fd;
}

int ckpt__fs_lstat(const char *path, struct stat *sb) {
  char base[CKPT_PATH_MAX];
  int dfd = parent_of(path, base, sizeof base);
  if (dfd == -1)
    return -1;
  /* Outside any anchor a link is followed as before. */
  int rc = fstatat(dfd, base, sb, dfd == AT_FDCWD ? 0 : AT_SYMLINK_NOFOLLOW);
  close_parent(dfd);
  return rc;
}

int ckpt__fs_unlink(const char *path, int flags) {
  char base[CKPT_PATH_MAX];
  int dfd = parent_of(path, base, sizeof base);
  if (dfd == -1)
    return -1;
  int rc = unlinkat(dfd, base, flags);
  close_parent(dfd);
  return rc;
}

int ckpt__fs_rename(const char *from, const char *to) {
  char b1[CKPT_PATH_MAX], b2[CKPT_PATH_MAX];
  int d1 = parent_of(from, b1, sizeof b1);
  if (d1 == -1)
    return -1;
  int d2 = parent_of(to, b2, sizeof b2);
  if (d2 == -1) {
    close_parent(d1);
    return -1;
  }
  int rc = renameat(d1, b1, d2, b2);
  close_parent(d1);
  close_parent(d2);
  return rc;
}

DIR *ckpt__fs_opendir(const char *path) {
  int fd = ckpt__fs_open(path, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0)
    return NULL;
  DIR *d = fdopendir(fd);
  if (!d)
    close_parent(fd);
  return d;
}

int ckpt__fs_mkdirs(const char *dir) {
  const char *rel;
  int afd = anchor_of(dir, &rel);
  if (afd < 0)
    return errno != 0 ? -1 : 1; /* 1: not confined, the caller makes it */
  int fd = walk_dirs(afd, rel, 1);
  if (fd < 0)
    return -1;
  close(fd);
  return 0;
}

const char *ckpt__fs_strerror(int e) {
  if (e == ELOOP || e == EXDEV)
    return "it or a directory on its way is a symbolic link, and checkpoint paths never follow "
           "links out of the state directory";
  return strerror(e);
}

int ckpt__fs_status(int e) {
  return e == ELOOP || e == EXDEV ? ZS_EPERM : e == ENOENT ? ZS_ENOTFOUND : ZS_EIO;
}
