/*
 * auth — token files, their reload, and the constant-time check (auth.h).
 *
 * Threads: `lock` guards the two secrets; checks take it shared, a reload
 * takes it exclusive only to swap in secrets read beforehand, so a reload
 * never holds up a check while it reads files.
 */
#include "common/net/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/base/status.h"

typedef struct secret {
  size_t len; /* 0: none configured */
  char bytes[AUTH_MAX_TOKEN];
} secret;

struct auth_keys {
  pthread_rwlock_t lock;
  char *trainer_path, *admin_path, *rank_path; /* NULL: not configured */
  secret trainer, admin, rank_key;
  int require_rank;         /* pushes need a rank token (or the admin's) */
  atomic_ullong generation; /* successful reloads */
};

static int say(char *err, size_t errlen, const char *path, const char *what) {
  if (err && errlen)
    snprintf(err, errlen, "token file '%s': %s", path, what);
  return ZS_EINVAL;
}

/* A token anyone may read is no secret, and one that others may rewrite
 * lets them grant themselves access: such a file is refused, as ssh refuses
 * an unprotected key. Group read is allowed: Kubernetes mounts secrets
 * readable by the pod's fsGroup (mode 0440). The mode checked is that of the
 * file opened, so a symbolic link (Kubernetes' secret volumes are made of
 * them) is judged by its target. */
static int check_mode(const struct stat *st, const char *path, char *err, size_t errlen) {
  char why[160];
  unsigned mode = (unsigned)(st->st_mode & 07777);
  if (st->st_mode & (S_IWGRP | S_IWOTH))
    snprintf(why, sizeof why,
             "mode %04o lets the group or others rewrite the token: chmod go-w (0600 or 0400)",
             mode);
  else if (st->st_mode & S_IROTH)
    snprintf(why, sizeof why,
             "mode %04o lets anyone read the token: chmod o-r (0600, 0400, or 0440 for a "
             "shared group)",
             mode);
  else
    return 0;
  return say(err, errlen, path, why);
}

/* The file's first line, trimmed. O_NONBLOCK and the regular-file check keep
 * a FIFO or a device put in the file's place from hanging the caller. */
int auth_read_token_file(const char *path, char *buf, size_t buflen, char *err, size_t errlen) {
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return say(err, errlen, path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return say(err, errlen, path, "not a regular file");
  }
  int bad = check_mode(&st, path, err, errlen);
  if (bad) {
    close(fd);
    return bad;
  }
  char raw[AUTH_MAX_TOKEN + 2];
  ssize_t n = read(fd, raw, sizeof raw);
  int read_errno = errno;
  close(fd);
  if (n < 0)
    return say(err, errlen, path, strerror(read_errno));
  size_t start = 0, end = (size_t)n;
  while (start < end &&
         (raw[start] == ' ' || raw[start] == '\t' || raw[start] == '\r' || raw[start] == '\n'))
    start++;
  size_t line_end = start;
  while (line_end < end && raw[line_end] != '\n')
    line_end++;
  if (line_end == end && (size_t)n == sizeof raw)
    return say(err, errlen, path, "longer than 4096 bytes");
  end = line_end;
  while (end > start && (raw[end - 1] == ' ' || raw[end - 1] == '\t' || raw[end - 1] == '\r'))
    end--;
  size_t len = end - start;
  if (len < AUTH_MIN_TOKEN)
    return say(err, errlen, path, "the token must be at least 16 bytes");
  if (len > AUTH_MAX_TOKEN)
    return say(err, errlen, path, "longer than 4096 bytes");
  for (size_t i = start; i < end; i++)
    if ((unsigned char)raw[i] < 0x21 || (unsigned char)raw[i] > 0x7e)
      return say(err, errlen, path, "the token must be printable ASCII without spaces");
  if (len + 1 > buflen)
    return say(err, errlen, path, "no room for the token");
  memcpy(buf, raw + start, len);
  buf[len] = '\0';
  return (int)len;
}

static int load(const char *path, secret *out, char *err, size_t errlen) {
  out->len = 0;
  if (!path)
    return 0;
  char buf[AUTH_MAX_TOKEN + 1];
  int n = auth_read_token_file(path, buf, sizeof buf, err, errlen);
  if (n < 0)
    return n;
  memcpy(out->bytes, buf, (size_t)n);
  out->len = (size_t)n;
  memset(buf, 0, sizeof buf);
  return 0;
}

/* fresh[0], [1], [2]: the trainer's, the admin's and the rank key. */
static int load_all(const auth_keys *k, secret *fresh, char *err, size_t errlen) {
  int rc = load(k->trainer_path, &fresh[0], err, errlen);
  if (rc == 0)
    rc = load(k->admin_path, &fresh[1], err, errlen);
  if (rc == 0)
    rc = load(k->rank_path, &fresh[2], err, errlen);
  return rc;
}

int auth_keys_new(const char *token_file, const char *admin_token_file, auth_keys **out, char *err,
                  size_t errlen) {
  *out = NULL;
  auth_keys *k = calloc(1, sizeof *k);
  if (!k)
    return ZS_ENOMEM;
  pthread_rwlock_init(&k->lock, NULL);
  if ((token_file && !(k->trainer_path = strdup(token_file))) ||
      (admin_token_file && !(k->admin_path = strdup(admin_token_file)))) {
    auth_keys_free(k);
    return ZS_ENOMEM;
  }
  secret fresh[3];
  int rc = load_all(k, fresh, err, errlen);
  k->trainer = fresh[0];
  k->admin = fresh[1];
  explicit_bzero(fresh, sizeof fresh);
  if (rc != 0) {
    auth_keys_free(k);
    return rc;
  }
  *out = k;
  return 0;
}

int auth_keys_set_rank_key(auth_keys *k, const char *key_file, int require, char *err,
                           size_t errlen) {
  if (!key_file && !require)
    return 0;
  if (!k->trainer_path && !k->admin_path) {
    if (err && errlen)
      snprintf(err, errlen,
               "--rank-key-file and --require-rank-tokens need --token-file or "
               "--admin-token-file: rank tokens alone leave the admin methods open");
    return ZS_EINVAL;
  }
  if (require && !key_file) {
    if (err && errlen)
      snprintf(err, errlen, "--require-rank-tokens needs --rank-key-file");
    return ZS_EINVAL;
  }
  secret *key = calloc(1, sizeof *key);
  char *path = strdup(key_file);
  int rc = key && path ? load(key_file, key, err, errlen) : ZS_ENOMEM;
  if (rc == 0) {
    pthread_rwlock_wrlock(&k->lock);
    k->rank_key = *key;
    k->rank_path = path;
    k->require_rank = require;
    pthread_rwlock_unlock(&k->lock);
    path = NULL;
  }
  if (key)
    explicit_bzero(key, sizeof *key);
  free(key);
  free(path);
  return rc;
}

int auth_keys_reload(auth_keys *k, char *err, size_t errlen) {
  secret *fresh = calloc(3, sizeof *fresh);
  if (!fresh)
    return ZS_ENOMEM;
  int rc = load_all(k, fresh, err, errlen);
  if (rc == 0) {
    pthread_rwlock_wrlock(&k->lock);
    k->trainer = fresh[0];
    k->admin = fresh[1];
    k->rank_key = fresh[2];
    pthread_rwlock_unlock(&k->lock);
    atomic_fetch_add(&k->generation, 1);
  }
  explicit_bzero(fresh, 3 * sizeof *fresh);
  free(fresh);
  return rc;
}

unsigned long long auth_keys_generation(const auth_keys *k) {
  return k ? atomic_load(&((auth_keys *)k)->generation) : 0;
}

int auth_keys_enabled(const auth_keys *k) {
  return k && (k->trainer_path || k->admin_path);
}

/* 1 when the presented bytes equal the secret. The loop always runs over the
 * whole secret, so the time depends on the secret's length only, never on
 * how many leading bytes a guess got right. */
static int same(const secret *s, const char *token, size_t len) {
  if (s->len == 0)
    return 0;
  volatile unsigned char diff = (unsigned char)(len != s->len);
  for (size_t i = 0; i < s->len; i++) {
    unsigned char t = i < len ? (unsigned char)token[i] : 0;
    diff |= (unsigned char)(t ^ (unsigned char)s->bytes[i]);
  }
  return diff == 0;
}

auth_role auth_keys_check(const auth_keys *k, const char *token, size_t len) {
  return auth_keys_check_bound(k, token, len, NULL);
}

/* A rank token's verdict, under the read lock. A token of the rank shape is
 * judged only here, so a shared secret that happens to start "zsr1." cannot
 * be mistaken for a bound credential or the reverse. */
static auth_role check_rank(const auth_keys *k, const char *token, size_t len, auth_binding *b) {
  rank_claim claim;
  char why[128];
  if (rank_token_verify((const unsigned char *)k->rank_key.bytes, k->rank_key.len, token, len,
                        (uint64_t)time(NULL), &claim, why, sizeof why) != 0)
    return AUTH_NONE;
  if (b) {
    b->bound = 1;
    memcpy(b->job, claim.job, sizeof b->job);
    b->rank = claim.rank;
    b->expiry = claim.expiry;
  }
  return AUTH_TRAINER;
}

auth_role auth_keys_check_bound(const auth_keys *k, const char *token, size_t len,
                                auth_binding *b) {
  if (b)
    memset(b, 0, sizeof *b);
  if (!auth_keys_enabled(k))
    return AUTH_ADMIN;
  if (!token)
    len = 0;
  auth_role role = AUTH_NONE;
  pthread_rwlock_rdlock((pthread_rwlock_t *)&k->lock);
  if (k->rank_key.len && rank_token_is(token, len)) {
    role = check_rank(k, token, len, b);
    pthread_rwlock_unlock((pthread_rwlock_t *)&k->lock);
    return role;
  }
  int admin = same(&k->admin, token, len);
  int trainer = same(&k->trainer, token, len);
  if (admin || (trainer && k->admin.len == 0))
    role = AUTH_ADMIN;
  else if (trainer || k->trainer.len == 0)
    role = AUTH_TRAINER;
  pthread_rwlock_unlock((pthread_rwlock_t *)&k->lock);
  return role;
}

int auth_push_admit(const auth_keys *k, auth_role role, const auth_binding *b, int job_matches,
                    uint32_t rank, char *err, size_t errlen) {
  if (b && b->bound) {
    if (!job_matches) {
      snprintf(err, errlen,
               "this rank token is for job '%s' and rank %u: it may not push to "
               "another job",
               b->job, (unsigned)b->rank);
      return ZS_EPERM;
    }
    if (b->expiry != 0 && (uint64_t)time(NULL) > b->expiry) {
      snprintf(err, errlen, "the rank token of rank %u of job '%s' has expired: mint a new one",
               (unsigned)b->rank, b->job);
      return ZS_EPERM;
    }
    if (rank != b->rank) {
      snprintf(err, errlen,
               "this rank token is for rank %u of job '%s': it may not push as "
               "rank %u",
               (unsigned)b->rank, b->job, (unsigned)rank);
      return ZS_EPERM;
    }
    return 0;
  }
  if (k && k->require_rank && !auth_allows(role, AUTH_ADMIN)) {
    snprintf(err, errlen,
             "this server requires a rank token for pushes "
             "(--require-rank-tokens); the caller presented a plain trainer token: "
             "mint one with `zshard mint-rank-token`");
    return ZS_EPERM;
  }
  return 0;
}

void auth_keys_free(auth_keys *k) {
  if (!k)
    return;
  explicit_bzero(&k->trainer, sizeof k->trainer);
  explicit_bzero(&k->admin, sizeof k->admin);
  explicit_bzero(&k->rank_key, sizeof k->rank_key);
  free(k->trainer_path);
  free(k->admin_path);
  free(k->rank_path);
  pthread_rwlock_destroy(&k->lock);
  free(k);
}
