/*
 * test_ckpt_example — the example trainer's recovery loop (zshard-mlp,
 * --checkpoint-every, --until-step): two trainers train to step 12 with a
 * checkpoint every 5 steps and exit; rank 0 starts again and is in the
 * middle of step 13 when shard 1 is killed (kill -9) and restarted from its
 * own state directory (checkpoint 10). Rank 0's step fails, it restores the
 * job to checkpoint 10 and goes on; rank 1 joins, and both finish step 30
 * with the same held-out score, to the last printed digit, as two trainers
 * that ran 30 steps without interruption. The samples of a step depend on the
 * step alone, so the runs see the same data.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ckpt_util.h"

#define UNTIL "30"

/* Starts zshard-mlp rank r with the common flags plus `extra` (up to 6
 * strings, NULL-terminated) into out_path; returns the pid. */
static pid_t start_mlp(const char *addrs, int r, const char *out_path, const char *const *extra) {
  char rank[8];
  snprintf(rank, sizeof rank, "%d", r);
  char *argv[32] = {ZSHARD_EXAMPLE_BIN,
                    "--shards",
                    (char *)addrs,
                    "--rank",
                    rank,
                    "--world",
                    "2",
                    "--accum",
                    "2",
                    "--batch",
                    "16",
                    "--until-step",
                    UNTIL,
                    "--synthetic",
                    "--log-every",
                    "100"};
  int k = 16;
  for (const char *const *e = extra; e && *e && k < 31; e++)
    argv[k++] = (char *)*e;
  argv[k] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out_path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

static int wait_exit(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The "final: ..." line of an output file, into buf. */
static void final_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  char line[512];
  buf[0] = '\0';
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "final:", 6) == 0)
      snprintf(buf, len, "%s", line);
  fclose(f);
  assert_true(buf[0] != '\0');
}

static void dump(const char *title, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f)
    return;
  fprintf(stderr, "----- %s -----\n", title);
  char line[512];
  while (fgets(line, sizeof line, f))
    fputs(line, stderr);
  fclose(f);
}

/* Both ranks to completion; returns 0 if both exited 0. */
static int run_both(const char *addrs, const char *tag, const char *const *extra) {
  char out[2][600];
  pid_t pid[2];
  for (int r = 0; r < 2; r++) {
    snprintf(out[r], sizeof out[r], "%s/%s-%d.out", hs_tmpdir(), tag, r);
    pid[r] = start_mlp(addrs, r, out[r], extra);
  }
  int bad = 0;
  for (int r = 0; r < 2; r++) {
    if (wait_exit(pid[r]) != 0) {
      dump(out[r], out[r]);
      bad = 1;
    }
  }
  return bad;
}

static void
example_trainer_recovers_from_a_restarted_shard_and_ends_like_an_uninterrupted_run(void **state) {
  (void)state;
  char path[600], want[2][512], got[512];
  /* The uninterrupted run. */
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  char addrs[128];
  cu_addrs(cl.srv, 2, addrs, sizeof addrs);
  assert_int_equal(run_both(addrs, "ref", NULL), 0);
  for (int r = 0; r < 2; r++) {
    snprintf(path, sizeof path, "%s/ref-%d.out", hs_tmpdir(), r);
    final_line(path, want[r], sizeof want[r]);
  }
  hs_cluster_stop(&cl);

  /* Phase 1: steps 1..12, checkpoints 5 and 10, each shard on its volume. */
  char dir[2][512];
  cu_dir(dir[0], sizeof dir[0], "example-0");
  cu_dir(dir[1], sizeof dir[1], "example-1");
  hs_server *srv[2];
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir[i], NULL));
  cu_addrs(srv, 2, addrs, sizeof addrs);
  const char *phase1[] = {"--until-step", "12", "--checkpoint-every", "5", NULL};
  assert_int_equal(run_both(addrs, "phase1", phase1), 0);
  snprintf(path, sizeof path, "%s/phase1-0.out", hs_tmpdir());
  assert_true(cu_file_has(path, "checkpoint step 10\n"));

  /* Phase 2: rank 0 alone starts step 13 and waits for rank 1 in it. */
  const char *phase2[] = {"--checkpoint-every", "5", "--timeout-ms", "3000", NULL};
  char out0[600], out1[600];
  snprintf(out0, sizeof out0, "%s/phase2-0.out", hs_tmpdir());
  snprintf(out1, sizeof out1, "%s/phase2-1.out", hs_tmpdir());
  pid_t p0 = start_mlp(addrs, 0, out0, phase2);
  assert_true(p0 > 0);
  uint64_t end = clock_now_ms() + CU_WAIT_MS;
  while (!cu_file_has(out0, "starting at step 13")) {
    assert_true(clock_now_ms() < end);
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  /* Shard 1 dies and comes back at checkpoint 10. */
  int port1 = srv[1]->port;
  cu_kill9(srv[1]);
  assert_non_null(srv[1] = cu_start_shard(1, 2, port1, dir[1], NULL));
  assert_true(cu_file_has(srv[1]->log_path, "step=10 source_shards=2"));
  pid_t p1 = start_mlp(addrs, 1, out1, phase2);
  assert_true(p1 > 0);
  int s0 = wait_exit(p0), s1 = wait_exit(p1);
  if (s0 || s1) {
    dump("rank 0", out0);
    dump("rank 1", out1);
  }
  assert_int_equal(s0, 0);
  assert_int_equal(s1, 0);
  assert_true(cu_file_has(out0, "recovered: restored checkpoint step 10, resuming at step 11"));
  final_line(out0, got, sizeof got);
  fprintf(stderr, "uninterrupted: %srecovered:     %s", want[0], got);
  assert_string_equal(got, want[0]);
  final_line(out1, got, sizeof got);
  assert_string_equal(got, want[1]);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(
          example_trainer_recovers_from_a_restarted_shard_and_ends_like_an_uninterrupted_run),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
