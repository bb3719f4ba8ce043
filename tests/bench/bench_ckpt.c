/*
 * bench_ckpt — what a checkpoint costs a shard, in process (no network):
 *
 *   snapshot  the copy of master, m and v made under the state lock (shared):
 *             the time the next apply is held back, and the copy's speed next
 *             to a plain memcpy of the same bytes measured in the same run;
 *   push      a push of step v+1 issued while the copy runs: pushes take the
 *             lock shared too, so its latency should not include the copy;
 *   write     the file written, fsynced and renamed (the shard goes on
 *             serving meanwhile), and its speed;
 *   load      ckpt_load (read + verify every CRC) and core_restore (swap).
 *
 *   bench_ckpt [PARAMS_MILLIONS (default 25)] [DIR (default $TMPDIR or /tmp)]
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/model/spec.h"
#include "server/ckpt/ckpt.h"
#include "server/core/core.h"

#define TENSOR_ELEMS (UINT64_C(1) << 20)

static double now_s(void) {
  return (double)clock_now_ns() / 1e9;
}

static void die(const char *what, int rc, const char *err) {
  fprintf(stderr, "bench_ckpt: %s: %s (%s)\n", what, zs_strerror(rc), err ? err : "");
  exit(1);
}

typedef struct copy_arg {
  core_state *st;
} copy_arg;

static int copy_view(void *arg, const core_view *v) {
  core_state *st = arg;
  size_t b = (size_t)v->nelems * sizeof(float);
  memcpy(st->master, v->master, b);
  memcpy(st->m, v->m, b);
  memcpy(st->v, v->v, b);
  st->version = v->version;
  st->optimizer_steps = v->optimizer_steps;
  return 0;
}

typedef struct snap_thread {
  core *c;
  uint64_t hash;
  core_state *st;
  double seconds;
  int rc;
} snap_thread;

static void *snap_main(void *arg) {
  snap_thread *t = arg;
  char err[256];
  t->rc = core_snapshot(t->c, t->hash, 1, 0, copy_view, t->st, &t->seconds, err, sizeof err);
  return NULL;
}

static void noop_stats(void *arg, int status, const core_stats_result *r) {
  (void)r;
  *(volatile int *)arg = status + 1000;
}

static void noop_apply(void *arg, int status, const core_apply_result *r) {
  (void)r;
  *(volatile int *)arg = status + 1000;
}

static void wait_flag(volatile int *f) {
  while (*f == 0)
    usleep(100);
}

int main(int argc, char **argv) {
  uint64_t millions = argc > 1 ? strtoull(argv[1], NULL, 10) : 25;
  const char *tmp = getenv("TMPDIR");
  const char *base = argc > 2 ? argv[2] : tmp && *tmp ? tmp : "/tmp";
  char root[512], err[600];
  snprintf(root, sizeof root, "%s/bench-ckpt-%ld", base, (long)getpid());
  uint64_t nt = (millions * 1000000u + TENSOR_ELEMS - 1) / TENSOR_ELEMS;

  spec s;
  memset(&s, 0, sizeof s);
  s.job = strdup("bench-ckpt");
  s.num_groups = 1;
  s.groups = calloc(1, sizeof *s.groups);
  spec_group_defaults(&s.groups[0], ZS_OPTIM_ADAMW);
  s.num_tensors = (uint32_t)nt;
  s.tensors = calloc(nt, sizeof *s.tensors);
  for (uint64_t t = 0; t < nt; t++) {
    char name[32];
    snprintf(name, sizeof name, "t%" PRIu64, t);
    s.tensors[t].name = strdup(name);
    s.tensors[t].numel = TENSOR_ELEMS;
  }
  s.world_size = s.grad_accum = s.num_shards = 1;
  s.param_dtype = ZS_DTYPE_BF16;
  int rc = spec_validate(&s, err, sizeof err);
  if (rc)
    die("spec", rc, err);
  uint64_t hash = spec_hash(&s), params = nt * TENSOR_ELEMS;

  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core *c;
  if ((rc = core_create(&cfg, &c)) != 0)
    die("core_create", rc, NULL);
  if ((rc = core_open(c, &s, NULL, err, sizeof err)) != 0)
    die("core_open", rc, err);
  float *buf = malloc(TENSOR_ELEMS * sizeof(float));
  for (uint64_t i = 0; i < TENSOR_ELEMS; i++)
    buf[i] = (float)(i % 1000) * 1e-3f;
  for (uint64_t t = 0; t < nt; t++)
    if ((rc = core_init_params(c, hash, (uint32_t)t, 0, buf, TENSOR_ELEMS * sizeof(float), NULL,
                               NULL, err, sizeof err)) != 0)
      die("init", rc, err);
  /* Step 1, so that the moments are written, then step 2's pushes but one. */
  for (uint64_t step = 1; step <= 2; step++) {
    for (uint64_t t = step == 2 ? 1 : 0; t < nt; t++) {
      core_push_args a = {.hash = hash,
                          .step = step,
                          .tensor = (uint32_t)t,
                          .dtype = ZS_DTYPE_FP32,
                          .data = buf,
                          .nbytes = TENSOR_ELEMS * sizeof(float)};
      if ((rc = core_push(c, &a, NULL, err, sizeof err)) != 0)
        die("push", rc, err);
    }
    if (step == 2)
      break;
    volatile int done = 0;
    core_stats_result sr;
    rc = core_grad_stats(c, hash, 1, 0, noop_stats, (void *)&done, &sr, err, sizeof err);
    if (rc == CORE_PENDING)
      wait_flag(&done);
    done = 0;
    core_apply_result ar;
    rc = core_apply(c, hash, 1, 1e-3, 1.0f, 0, noop_apply, (void *)&done, &ar, err, sizeof err);
    if (rc == CORE_PENDING)
      wait_flag(&done);
  }

  core_state st;
  if ((rc = core_state_init(&st, &s, 0, err, sizeof err)) != 0)
    die("state", rc, err);
  double bytes = (double)st.nelems * 12.0;
  /* The reference: the same three copies, outside any lock. */
  core_state ref;
  core_state_init(&ref, &s, 0, err, sizeof err);
  double t0 = now_s();
  memcpy(ref.master, st.master, st.nelems * 4);
  memcpy(ref.m, st.m, st.nelems * 4);
  memcpy(ref.v, st.v, st.nelems * 4);
  double t_memcpy = now_s() - t0;
  core_state_free(&ref);

  /* The snapshot, with the last push of step 2 issued while it copies. */
  snap_thread sn = {.c = c, .hash = hash, .st = &st};
  pthread_t th;
  pthread_create(&th, NULL, snap_main, &sn);
  usleep(1000); /* a head start for the copy; the push latency is reported either way */
  core_push_args a = {.hash = hash,
                      .step = 2,
                      .tensor = 0,
                      .dtype = ZS_DTYPE_FP32,
                      .data = buf,
                      .nbytes = TENSOR_ELEMS * sizeof(float)};
  t0 = now_s();
  rc = core_push(c, &a, NULL, err, sizeof err);
  double t_push = now_s() - t0;
  pthread_join(th, NULL);
  if (sn.rc || rc)
    die("snapshot or push", sn.rc ? sn.rc : rc, err);

  t0 = now_s();
  ckpt_file_info fi;
  if ((rc = ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err)) != 0)
    die("write", rc, err);
  double t_write = now_s() - t0;
  ckpt_manifest m = {.step = 1,
                     .version = 1,
                     .optimizer_steps = 1,
                     .spec_hash = hash,
                     .num_shards = 1,
                     .files = &fi};
  if ((rc = ckpt_manifest_write(root, &m, 0, err, sizeof err)) != 0)
    die("manifest", rc, err);
  core_state_free(&st);
  t0 = now_s();
  core_state ld;
  if ((rc = ckpt_load(root, 1, 0, 1, &ld, err, sizeof err)) != 0)
    die("load", rc, err);
  double t_load = now_s() - t0;
  t0 = now_s();
  if ((rc = core_restore(c, &ld, 1, err, sizeof err)) != 0)
    die("restore", rc, err);
  double t_restore = now_s() - t0;
  core_state_free(&ld);

  printf("params %" PRIu64 " (%.0f MB of master + m + v), file %.0f MB in %s\n", params,
         bytes / 1e6, (double)fi.bytes / 1e6, root);
  printf("snapshot: apply held back %.1f ms (%.2f GB/s); plain memcpy %.1f ms (%.2f GB/s)\n",
         sn.seconds * 1e3, bytes / sn.seconds / 1e9, t_memcpy * 1e3, bytes / t_memcpy / 1e9);
  printf("push during the snapshot: %.2f ms (4 MB added into the accumulator)\n", t_push * 1e3);
  printf("write + fsync + rename: %.1f ms (%.2f GB/s)\n", t_write * 1e3,
         (double)fi.bytes / t_write / 1e9);
  printf("load (read, verify every CRC): %.1f ms (%.2f GB/s); restore swap: %.1f ms\n",
         t_load * 1e3, (double)fi.bytes / t_load / 1e9, t_restore * 1e3);
  char errr[512];
  ckpt_remove(root, 1, errr, sizeof errr);
  rmdir(root);
  core_destroy(c);
  free(buf);
  spec_free(&s);
  return 0;
}
