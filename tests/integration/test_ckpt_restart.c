/*
 * test_ckpt_restart — checkpoints survive kill -9: a job checkpointed,
 * trained further, killed on every shard and restarted from its state
 * directory ends, after restore and more training, with exactly the
 * parameters of an uninterrupted run; trainers that find a restarted shard
 * behind the cluster get ZS_EBEHIND naming the checkpoint, restore the job
 * (every trainer, the later ones changing nothing) and end exactly like the
 * uninterrupted run; and a restore rolls a live job back to an older
 * checkpoint from which the same steps replay bit for bit; a shard that
 * lost acknowledged pushes in a restart says so at once.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ckpt_util.h"

#define LAST 10

static void
every_shard_killed_restarts_from_its_checkpoint_and_ends_like_an_uninterrupted_run(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);

  char dir[512];
  cu_dir(dir, sizeof dir, "restart-all");
  hs_server *srv[2];
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir, NULL));
  int port[2] = {srv[0]->port, srv[1]->port};
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);

  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 4, 0), 0);
  uint64_t step = 99;
  assert_int_equal(zs_last_checkpoint(tr.c, &step), ZS_OK);
  assert_int_equal(step, 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  assert_int_equal(zs_last_checkpoint(tr.c, &step), ZS_OK);
  assert_int_equal(step, 4);
  /* Trained past the checkpoint, then every shard dies. */
  assert_int_equal(cu_train_until(&tr, 7, 0), 0);
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    cu_kill9(srv[i]);

  for (uint32_t i = 0; i < 2; i++) {
    assert_non_null(srv[i] = cu_start_shard(i, 2, port[i], dir, NULL));
    char want[600];
    snprintf(want, sizeof want, "event=checkpoint_loaded dir=%s step=4 source_shards=2", dir);
    assert_true(cu_file_has(srv[i]->log_path, want));
  }
  /* A fresh trainer resumes at the checkpoint; restoring it again changes
   * nothing. Checkpoints then come every 3 steps on their own. */
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 3), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), 5);
  assert_int_equal(zs_restore(tr.c, 0), ZS_OK);
  assert_int_equal(zs_current_step(tr.c), 5);
  assert_true(cu_file_has(srv[0]->log_path, "event=checkpoint_restore_skipped step=4"));
  int rc = cu_train_until(&tr, LAST, 0);
  if (rc)
    fprintf(stderr, "%s\n", tr.err);
  assert_int_equal(rc, 0);
  assert_int_equal(zs_last_checkpoint(tr.c, &step), ZS_OK);
  assert_int_equal(step, 9);
  uint64_t latest = 0;
  assert_int_equal(zs_latest_checkpoint(tr.c, &latest), ZS_OK);
  assert_int_equal(latest, 9);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

typedef struct phase {
  cu_trainer *tr;
  uint64_t last;
  int recover, open, rc;
} phase;

static void *phase_main(void *arg) {
  phase *p = arg;
  p->rc = p->open ? cu_trainer_open(p->tr) : ZS_OK;
  if (p->rc == ZS_OK)
    p->rc = cu_train_until(p->tr, p->last, p->recover);
  return NULL;
}

/* Both trainers run to `last` in threads. */
static void run_phase(cu_trainer *tr, uint64_t last, int recover, int open) {
  phase p[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    p[r] = (phase){.tr = &tr[r], .last = last, .recover = recover, .open = open};
    assert_int_equal(pthread_create(&th[r], NULL, phase_main, &p[r]), 0);
  }
  for (int r = 0; r < 2; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    if (p[r].rc)
      fprintf(stderr, "%s\n", tr[r].err);
    assert_int_equal(p[r].rc, 0);
  }
}

static void
trainers_find_a_restarted_shard_behind_restore_and_end_like_an_uninterrupted_run(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 2, LAST, ref), 0);

  /* Each shard on its own volume, as in the StatefulSet. */
  char dir[2][512];
  cu_dir(dir[0], sizeof dir[0], "behind-0");
  cu_dir(dir[1], sizeof dir[1], "behind-1");
  hs_server *srv[2];
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir[i], NULL));
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr[2];
  for (uint32_t r = 0; r < 2; r++)
    assert_int_equal(cu_trainer_init(&tr[r], addrs, r, 2, 0), 0);
  run_phase(tr, 4, 0, 1);
  assert_int_equal(zs_checkpoint(tr[0].c, 4), ZS_OK);
  run_phase(tr, 6, 0, 0);

  /* Shard 1 dies and comes back at checkpoint 4; the cluster is at 6. */
  int port1 = srv[1]->port;
  cu_kill9(srv[1]);
  assert_non_null(srv[1] = cu_start_shard(1, 2, port1, dir[1], NULL));
  assert_true(cu_file_has(srv[1]->log_path, "event=checkpoint_loaded"));

  /* A trainer joining now is told where to resume. */
  cu_trainer probe;
  assert_int_equal(cu_trainer_init(&probe, addrs, 0, 2, 0), 0);
  assert_int_equal(cu_trainer_open(&probe), ZS_EBEHIND);
  fprintf(stderr, "joining trainer: %s\n", probe.err);
  assert_non_null(strstr(probe.err, "resume from checkpoint step 4"));
  uint64_t latest = 0;
  assert_int_equal(zs_latest_checkpoint(probe.c, &latest), ZS_OK);
  assert_int_equal(latest, 4);
  cu_trainer_free(&probe);

  /* The running trainers hit the restarted shard, restore and go on. */
  run_phase(tr, LAST, 1, 0);
  for (int r = 0; r < 2; r++) {
    fprintf(stderr, "rank %d: %u recoveries, restored to %" PRIu64 "\n", r, tr[r].recoveries,
            tr[r].restored_to);
    assert_true(tr[r].recoveries >= 1);
    assert_int_equal(tr[r].restored_to, 4);
  }
  /* One restore replaced shard 0's state; the other found it done. */
  assert_true(cu_file_has(srv[0]->log_path, "event=checkpoint_restored step=4"));
  assert_int_equal(cu_final(&tr[0], got), 0);
  assert_true(cu_same(ref, got));
  for (int r = 0; r < 2; r++)
    cu_trainer_free(&tr[r]);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

/* The uninterrupted reference in ref, two shards with state dir `name` (its
 * path in dir), one trainer that trained to version `until` and
 * checkpointed it. */
static void one_trainer_checkpointed(float *ref[CU_NT], const char *name, char *dir, size_t dirlen,
                                     hs_server *srv[2], cu_trainer *tr, uint64_t until) {
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  cu_dir(dir, dirlen, name);
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir, NULL));
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(tr), 0);
  assert_int_equal(cu_train_until(tr, until, 0), 0);
  assert_int_equal(zs_checkpoint(tr->c, until), ZS_OK);
}

/* A shard that dies after acknowledging this step's pushes and comes back
 * at a checkpoint of exactly the step's version accepts the step number
 * (it is version + 1), but has lost the pushes: zs_step learns it at once
 * (ZS_EBEHIND naming the checkpoint), not after the step timeout, which is
 * 30 s here; the trainer restores and ends like the uninterrupted run. */
static void a_shard_that_lost_acknowledged_pushes_says_so_at_once(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  char dir[512];
  hs_server *srv[2];
  cu_trainer tr;
  one_trainer_checkpointed(ref, "lost-pushes", dir, sizeof dir, srv, &tr, 4);

  /* Step 5's pulls and pushes, every push acknowledged (zs_push without a
   * request handle returns once it is). */
  assert_int_equal(zs_current_step(tr.c), 5);
  for (int t = 0; t < CU_NT; t++)
    assert_int_equal(zs_pull(tr.c, (uint32_t)t, tr.param[t], ZS_DTYPE_FP32,
                             cu_tensors[t].numel * sizeof(float), NULL),
                     ZS_OK);
  for (int t = 0; t < CU_NT; t++) {
    for (uint64_t i = 0; i < cu_tensors[t].numel; i++)
      tr.grad[t][i] = tr.param[t][i] * 0.5f;
    assert_int_equal(zs_push(tr.c, (uint32_t)t, 0, tr.grad[t], ZS_DTYPE_FP32,
                             cu_tensors[t].numel * sizeof(float), NULL),
                     ZS_OK);
  }
  int port1 = srv[1]->port;
  cu_kill9(srv[1]);
  assert_non_null(srv[1] = cu_start_shard(1, 2, port1, dir, NULL));
  assert_true(cu_file_has(srv[1]->log_path, "event=checkpoint_loaded"));

  int rc = zs_step(tr.c, CU_LR, 0, 0, NULL);
  fprintf(stderr, "zs_step after the restart: %s: %s\n", zs_err_name(rc), zs_last_error());
  assert_int_equal(rc, ZS_EBEHIND);
  assert_non_null(strstr(zs_last_error(), "checkpoint step 4"));
  assert_non_null(strstr(zs_last_error(), "acknowledged"));

  assert_int_equal(zs_restore(tr.c, 0), ZS_OK);
  assert_int_equal(zs_current_step(tr.c), 5);
  assert_int_equal(cu_train_until(&tr, LAST, 0), 0);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

static void restore_rolls_a_live_job_back_and_the_steps_replay_exactly(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  char dir[512];
  hs_server *srv[2];
  cu_trainer tr;
  one_trainer_checkpointed(ref, "rollback", dir, sizeof dir, srv, &tr, 3);
  assert_int_equal(cu_train_until(&tr, 8, 0), 0);
  /* A step that was never checkpointed cannot be restored: nothing changes. */
  assert_int_equal(zs_restore(tr.c, 6), ZS_ENOTFOUND);
  assert_non_null(strstr(zs_last_error(), "not complete"));
  assert_int_equal(zs_current_step(tr.c), 9);
  assert_int_equal(zs_restore(tr.c, 3), ZS_OK);
  assert_int_equal(zs_current_step(tr.c), 4);
  assert_int_equal(cu_train_until(&tr, LAST, 0), 0);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(
          every_shard_killed_restarts_from_its_checkpoint_and_ends_like_an_uninterrupted_run),
      cmocka_unit_test(
          trainers_find_a_restarted_shard_behind_restore_and_end_like_an_uninterrupted_run),
      cmocka_unit_test(a_shard_that_lost_acknowledged_pushes_says_so_at_once),
      cmocka_unit_test(restore_rolls_a_live_job_back_and_the_steps_replay_exactly),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
