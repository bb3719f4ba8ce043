/*
 * ckpt_util — what the checkpoint integration tests (test_ckpt_*.c) share: a
 * deterministic trainer on libzshard, shard servers started with a state
 * directory on a port of their own (so that a restarted shard comes back at
 * the address the trainers know), and log and file helpers.
 *
 * The trainer's gradient is a function of the parameters it pulled, the step
 * and its rank, so two runs give the same parameters only if every step saw
 * exactly the same state: a checkpoint, a restart or a reshard that lost or
 * changed one bit of master weights or moments shows up in the final
 * parameters, which the tests compare with memcmp against an uninterrupted
 * run's.
 *
 * Everything here is static: each test program includes it once. Functions
 * return a status and never assert, so that trainer threads may use them;
 * the test thread asserts.
 */
#ifndef ZSHARD_TESTS_CKPT_UTIL_H
#define ZSHARD_TESTS_CKPT_UTIL_H

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "harness.h"
#include "zshard/zshard.h"

#define CU_NT 5
#define CU_LR 0.01
#define CU_WAIT_MS 30000u

static const struct {
  const char *name;
  uint64_t numel;
  uint32_t group; /* 0: AdamW, 1: SGD with momentum */
} cu_tensors[CU_NT] = {
    {"w1", 300, 0}, {"b1", 20, 0}, {"w2", 200, 0}, {"b2", 10, 0}, {"norm", 96, 1},
};

typedef struct cu_trainer {
  zs_client *c;
  uint32_t rank, world;
  float *param[CU_NT];
  float *grad[CU_NT];
  uint32_t recoveries; /* zs_restore calls made by train_until */
  uint64_t restored_to;
  char err[512];
} cu_trainer;

/* The initial weights (rank 0 writes them). */
static inline void cu_init_weights(float *w[CU_NT]) {
  uint64_t s = 12345;
  for (int t = 0; t < CU_NT; t++)
    for (uint64_t i = 0; i < cu_tensors[t].numel; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      w[t][i] = ((float)(s >> 40) / (float)(1u << 24) - 0.5f) * 0.2f;
    }
}

static inline int cu_fail(cu_trainer *tr, int rc, const char *what) {
  snprintf(tr->err, sizeof tr->err, "rank %u %s: %s (%s)", tr->rank, what, zs_strerror(rc),
           zs_last_error());
  return rc;
}

/* A client for `addrs` with the test model described (not opened). */
/* Retries of a call to an unreachable shard; 0: the library's default. */
static uint32_t cu_max_retries;
/* When set, trainers use ZS_LOSS_SCALE_DYNAMIC with this scaler. */
static const zs_loss_scaler *cu_dynamic_scaler;

static inline int cu_trainer_init(cu_trainer *tr, const char *addrs, uint32_t rank, uint32_t world,
                                  uint32_t checkpoint_every) {
  memset(tr, 0, sizeof *tr);
  tr->rank = rank;
  tr->world = world;
  for (int t = 0; t < CU_NT; t++) {
    tr->param[t] = calloc(cu_tensors[t].numel, sizeof(float));
    tr->grad[t] = calloc(cu_tensors[t].numel, sizeof(float));
    if (!tr->param[t] || !tr->grad[t])
      return ZS_ENOMEM;
  }
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.rank = rank;
  o.world_size = world;
  o.job = "ckpt-test";
  o.split_threshold = 64;
  o.step_timeout_ms = CU_WAIT_MS;
  o.checkpoint_every = checkpoint_every;
  if (cu_max_retries)
    o.max_retries = cu_max_retries;
  if (cu_dynamic_scaler) {
    o.loss_scaling = ZS_LOSS_SCALE_DYNAMIC;
    o.dynamic_loss_scaler = cu_dynamic_scaler;
  }
  int rc = zs_client_open(&o, &tr->c);
  if (rc != ZS_OK)
    return cu_fail(tr, rc, "zs_client_open");
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_ADAMW);
  if ((rc = zs_add_group(tr->c, &g, NULL)) != ZS_OK)
    return cu_fail(tr, rc, "zs_add_group");
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  g.momentum = 0.9;
  if ((rc = zs_add_group(tr->c, &g, NULL)) != ZS_OK)
    return cu_fail(tr, rc, "zs_add_group");
  for (int t = 0; t < CU_NT; t++)
    if ((rc = zs_add_tensor(tr->c, cu_tensors[t].name, cu_tensors[t].numel, cu_tensors[t].group,
                            NULL, 0, NULL)) != ZS_OK)
      return cu_fail(tr, rc, "zs_add_tensor");
  return ZS_OK;
}

/* zs_open_job with the initial weights (rank 0). */
static inline int cu_trainer_open(cu_trainer *tr) {
  float *w[CU_NT];
  for (int t = 0; t < CU_NT; t++)
    w[t] = malloc(cu_tensors[t].numel * sizeof(float));
  cu_init_weights(w);
  int rc = zs_open_job(tr->c, (const float *const *)w);
  for (int t = 0; t < CU_NT; t++)
    free(w[t]);
  return rc == ZS_OK ? rc : cu_fail(tr, rc, "zs_open_job");
}

static inline void cu_trainer_free(cu_trainer *tr) {
  zs_client_close(tr->c);
  for (int t = 0; t < CU_NT; t++) {
    free(tr->param[t]);
    free(tr->grad[t]);
  }
  memset(tr, 0, sizeof *tr);
}

/* One step: pull everything, gradient from the parameters, push, step. */
static inline int cu_step(cu_trainer *tr) {
  uint64_t step = zs_current_step(tr->c);
  int rc;
  for (int t = 0; t < CU_NT; t++)
    if ((rc = zs_pull(tr->c, (uint32_t)t, tr->param[t], ZS_DTYPE_FP32,
                      cu_tensors[t].numel * sizeof(float), NULL)) != ZS_OK)
      return cu_fail(tr, rc, "zs_pull");
  for (int t = 0; t < CU_NT; t++) {
    for (uint64_t i = 0; i < cu_tensors[t].numel; i++) {
      float bias = (float)((int)((i * 7 + step * 13 + tr->rank * 5) % 17) - 8) * 0.01f;
      tr->grad[t][i] = tr->param[t][i] * 0.5f + bias;
    }
    if ((rc = zs_push(tr->c, (uint32_t)t, 0, tr->grad[t], ZS_DTYPE_FP32,
                      cu_tensors[t].numel * sizeof(float), NULL)) != ZS_OK)
      return cu_fail(tr, rc, "zs_push");
  }
  if ((rc = zs_step(tr->c, CU_LR, 0, 0, NULL)) != ZS_OK)
    return cu_fail(tr, rc, "zs_step");
  return ZS_OK;
}

/* 1 for the failures a shard restart or a restore causes. */
static inline int cu_recoverable(int rc) {
  return rc == ZS_EBEHIND || rc == ZS_ESTEP || rc == ZS_ECONN || rc == ZS_ETIMEDOUT ||
         rc == ZS_ECLOSED || rc == ZS_ENOTREADY;
}

/* Trains until version `last` is reached. With `recover`, a recoverable
 * failure restores the job to the newest common checkpoint (up to 10 times)
 * and training goes on from there: the recovery loop of a real trainer. */
static inline int cu_train_until(cu_trainer *tr, uint64_t last, int recover) {
  while (zs_current_step(tr->c) <= last) {
    int rc = cu_step(tr);
    if (rc == ZS_OK)
      continue;
    if (!recover || !cu_recoverable(rc) || tr->recoveries >= 10)
      return rc;
    tr->recoveries++;
    int rr = zs_restore(tr->c, 0);
    if (rr != ZS_OK && !cu_recoverable(rr))
      return cu_fail(tr, rr, "zs_restore");
    tr->restored_to = zs_current_step(tr->c) - 1;
  }
  return ZS_OK;
}

/* The current parameters, pulled in fp32, into out[t] (allocated). */
static inline int cu_final(cu_trainer *tr, float *out[CU_NT]) {
  for (int t = 0; t < CU_NT; t++) {
    out[t] = malloc(cu_tensors[t].numel * sizeof(float));
    int rc = zs_pull(tr->c, (uint32_t)t, out[t], ZS_DTYPE_FP32, cu_tensors[t].numel * sizeof(float),
                     NULL);
    if (rc != ZS_OK)
      return cu_fail(tr, rc, "final zs_pull");
  }
  return ZS_OK;
}

static inline int cu_same(float *a[CU_NT], float *b[CU_NT]) {
  for (int t = 0; t < CU_NT; t++)
    if (memcmp(a[t], b[t], cu_tensors[t].numel * sizeof(float)) != 0)
      return 0;
  return 1;
}

static inline void cu_free_params(float *p[CU_NT]) {
  for (int t = 0; t < CU_NT; t++) {
    free(p[t]);
    p[t] = NULL;
  }
}

/* ------------------------------------------------------------ servers */

/* Starts shard i of n on `port` (0: any) with `state_dir` (NULL: none) and
 * `env` (may be NULL). */
static inline hs_server *cu_start_shard(uint32_t i, uint32_t n, int port, const char *state_dir,
                                        const char *const *env) {
  char id[16], ns[16], listen[48];
  snprintf(id, sizeof id, "%u", i);
  snprintf(ns, sizeof ns, "%u", n);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  const char *args[16] = {"--shard-id", id, "--shards", ns, "--threads", "1", "--listen", listen};
  int k = 8;
  if (state_dir) {
    args[k++] = "--state-dir";
    args[k++] = state_dir;
  }
  args[k] = NULL;
  return hs_start(args, env);
}

/* kill -9 and reap. */
static inline void cu_kill9(hs_server *s) {
  hs_signal(s, SIGKILL);
  hs_stop(s);
}

/* "addr0,addr1,..." of servers srv[0..n). */
static inline void cu_addrs(hs_server *const *srv, uint32_t n, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < n && o < len; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s%s", i ? "," : "", srv[i]->addr);
}

/* 1 if the file at path contains `needle`. */
static inline int cu_file_has(const char *path, const char *needle) {
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  static char buf[1 << 18];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return strstr(buf, needle) != NULL;
}

/* Polls a server's log until it contains `needle` (bounded: CU_WAIT_MS). */
static inline int cu_wait_log(const hs_server *s, const char *needle) {
  uint64_t end = clock_now_ms() + CU_WAIT_MS;
  while (!cu_file_has(s->log_path, needle)) {
    if (clock_now_ms() >= end)
      return -1;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return 0;
}

extern char **environ;

/* Runs argv (argv[0] a path) to completion with stdout and stderr into
 * `out` (cap bytes, NUL-terminated); returns the exit status, 128 + signal,
 * or -1. Bounded by the program itself: the tests run short commands. */
static inline int cu_run(char *const argv[], char *out, size_t cap) {
  char path[600];
  static unsigned seq;
  snprintf(path, sizeof path, "%s/run-%u.out", hs_tmpdir(), ++seq);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0)
    return -1;
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  out[0] = '\0';
  FILE *f = fopen(path, "r");
  if (f) {
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    fclose(f);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* A fresh directory under the harness's temporary directory. */
static inline void cu_dir(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "%s/%s", hs_tmpdir(), name);
  mkdir(buf, 0755);
}

/* Runs the reference: a fresh cluster of n shards without state, world W,
 * trained to `last` by W trainer threads; fills out[t]. */
typedef struct cu_ref_thread {
  cu_trainer tr;
  uint64_t last;
  int rc;
} cu_ref_thread;

static inline void *cu_ref_main(void *arg) {
  cu_ref_thread *r = arg;
  r->rc = cu_trainer_open(&r->tr);
  if (r->rc == ZS_OK)
    r->rc = cu_train_until(&r->tr, r->last, 0);
  return NULL;
}

/* The parameters of an uninterrupted run: n shards without a state
 * directory, W trainers, to version `last`. Returns 0 or -1 (printed). */
static inline int cu_reference(uint32_t n, uint32_t W, uint64_t last, float *out[CU_NT]) {
  hs_cluster cl;
  if (W > 8 || hs_cluster_start(&cl, n, NULL) != 0)
    return -1;
  char addrs[512];
  cu_addrs(cl.srv, n, addrs, sizeof addrs);
  cu_ref_thread th[8];
  pthread_t tid[8];
  int bad = 0;
  for (uint32_t r = 0; r < W; r++) {
    th[r].last = last;
    th[r].rc = cu_trainer_init(&th[r].tr, addrs, r, W, 0);
    bad |= th[r].rc != ZS_OK;
  }
  for (uint32_t r = 0; r < W && !bad; r++)
    pthread_create(&tid[r], NULL, cu_ref_main, &th[r]);
  for (uint32_t r = 0; r < W && !bad; r++)
    pthread_join(tid[r], NULL);
  for (uint32_t r = 0; r < W; r++) {
    if (th[r].rc != ZS_OK) {
      fprintf(stderr, "reference run: %s\n", th[r].tr.err);
      bad = 1;
    }
  }
  if (!bad && cu_final(&th[0].tr, out) != ZS_OK) {
    fprintf(stderr, "reference run: %s\n", th[0].tr.err);
    bad = 1;
  }
  for (uint32_t r = 0; r < W; r++)
    cu_trainer_free(&th[r].tr);
  hs_cluster_stop(&cl);
  return bad ? -1 : 0;
}

#endif
