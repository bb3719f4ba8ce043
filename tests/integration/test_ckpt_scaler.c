/*
 * test_ckpt_scaler — the trainer's dynamic loss scaler survives checkpoints
 * like the weights do. A run with ZS_LOSS_SCALE_DYNAMIC (window 3,
 * hysteresis 1, 2^16) whose gradients overflow at chosen steps is
 * checkpointed, trained further, killed with kill -9 on every shard and
 * restored: from the restore on it uses at every step exactly the loss scale
 * the uninterrupted run used, and ends with that run's parameters and scale.
 * The same holds for a fresh trainer opening the restarted job, and for one
 * opening it on 3 shards resharded from 2 at start, then on 2 again through
 * the offline `zshard reshard`.
 *
 * The overflow steps are chosen so that a scaler that came back at its
 * initial state, or stayed where the trainer had taken it before the
 * restore, would use another scale right after the restore and end at
 * another one (see k_overflow).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ckpt_util.h"

#define LAST 13
#define K1 7  /* the checkpoint every test restores or reopens first */
#define K2 10 /* trained to before the shards die; the reshard test's second checkpoint */

/* The uninterrupted run uses 2^16 at steps 1-2, 2^15 at 3-5, 2^14 at 6-8,
 * 2^15 at 9-11 and 2^14 at 12-13, and ends at 2^14. A scaler reset to its
 * initial state after the restore to K1 would end at 2^16, one left at its
 * state of K2 at 2^15. */
static const uint64_t k_overflow[] = {2, 5, 11};

static zs_loss_scaler g_scaler;

static int overflows_at(uint64_t step) {
  for (size_t i = 0; i < sizeof k_overflow / sizeof k_overflow[0]; i++)
    if (k_overflow[i] == step)
      return 1;
  return 0;
}

/* One step of ckpt_util's model, loss scaled: the trainer pushes its
 * gradient times zs_loss_scale(), and at the overflow steps times 1e38 as
 * well, which is inf in fp32. scales[step] gets the scale zs_step used. The
 * scales are powers of two, so the unscaled gradient the shards apply is the
 * same bits whatever the scale: only skipped steps change the parameters. */
static int scaled_step(cu_trainer *tr, double *scales) {
  uint64_t step = zs_current_step(tr->c);
  float scale = (float)zs_loss_scale(tr->c);
  float blow = overflows_at(step) ? 1e38f : 1.0f;
  int rc;
  for (int t = 0; t < CU_NT; t++)
    if ((rc = zs_pull(tr->c, (uint32_t)t, tr->param[t], ZS_DTYPE_FP32,
                      cu_tensors[t].numel * sizeof(float), NULL)) != ZS_OK)
      return cu_fail(tr, rc, "zs_pull");
  for (int t = 0; t < CU_NT; t++) {
    for (uint64_t i = 0; i < cu_tensors[t].numel; i++) {
      float bias = (float)((int)((i * 7 + step * 13) % 17) - 8) * 0.01f;
      tr->grad[t][i] = (tr->param[t][i] * 0.5f + bias) * scale * blow;
    }
    if ((rc = zs_push(tr->c, (uint32_t)t, 0, tr->grad[t], ZS_DTYPE_FP32,
                      cu_tensors[t].numel * sizeof(float), NULL)) != ZS_OK)
      return cu_fail(tr, rc, "zs_push");
  }
  zs_step_result r;
  zs_step_result_init(&r);
  if ((rc = zs_step(tr->c, CU_LR, 0, 0, &r)) != ZS_OK)
    return cu_fail(tr, rc, "zs_step");
  if (r.overflow != overflows_at(step) || r.loss_scale != (double)scale) {
    snprintf(tr->err, sizeof tr->err,
             "step %" PRIu64 ": overflow %d with scale %g, expected overflow %d with scale %g",
             step, r.overflow, r.loss_scale, overflows_at(step), (double)scale);
    return ZS_EINTERNAL;
  }
  scales[step] = r.loss_scale;
  return ZS_OK;
}

static int scaled_train_until(cu_trainer *tr, uint64_t last, double *scales) {
  while (zs_current_step(tr->c) <= last) {
    int rc = scaled_step(tr, scales);
    if (rc != ZS_OK)
      return rc;
  }
  return ZS_OK;
}

static void train_ok(cu_trainer *tr, uint64_t last, double *scales) {
  int rc = scaled_train_until(tr, last, scales);
  if (rc)
    fprintf(stderr, "%s\n", tr->err);
  assert_int_equal(rc, ZS_OK);
}

/* The uninterrupted run on 2 shards without state, computed once. */
static struct {
  int done;
  float *param[CU_NT];
  double scales[LAST + 1];
  double final_scale;
} g_ref;

static void reference(void) {
  if (g_ref.done)
    return;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  char addrs[128];
  cu_addrs(cl.srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  train_ok(&tr, LAST, g_ref.scales);
  assert_int_equal(cu_final(&tr, g_ref.param), 0);
  g_ref.final_scale = zs_loss_scale(tr.c);
  cu_trainer_free(&tr);
  assert_int_equal(hs_cluster_stop(&cl), 0);
  fprintf(stderr, "reference: scales");
  for (uint64_t s = 1; s <= LAST; s++)
    fprintf(stderr, " %g", g_ref.scales[s]);
  fprintf(stderr, ", final %g\n", g_ref.final_scale);
  /* The scenario is one where losing the scaler shows (see k_overflow). */
  assert_true(g_ref.scales[K1 + 1] != g_scaler.scale);
  assert_true(g_ref.scales[K2 + 1] != g_scaler.scale);
  assert_true(g_ref.final_scale != g_scaler.scale);
  g_ref.done = 1;
}

/* The run's parameters, scales from step `from` on and final scale are the
 * reference's. */
static void expect_like_reference(cu_trainer *tr, const double *scales, uint64_t from) {
  float *got[CU_NT] = {0};
  assert_int_equal(cu_final(tr, got), 0);
  assert_true(cu_same(g_ref.param, got));
  cu_free_params(got);
  for (uint64_t s = from; s <= LAST; s++) {
    if (scales[s] != g_ref.scales[s])
      fail_msg("step %" PRIu64 " used loss scale %g, the uninterrupted run %g", s, scales[s],
               g_ref.scales[s]);
  }
  assert_true(zs_loss_scale(tr->c) == g_ref.final_scale);
}

static void start_shards(hs_server **srv, uint32_t n, const int *port, const char *dir) {
  for (uint32_t i = 0; i < n; i++)
    assert_non_null(srv[i] = cu_start_shard(i, n, port ? port[i] : 0, dir, NULL));
}

static void stop_shards(hs_server **srv, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
}

/* The reference, two shards with state dir `name` (path in dir, ports in
 * port, addresses in addrs) and a trainer that checkpointed version K1 and
 * trained on to K2, its loss scales in scales. */
static void checkpointed_run(const char *name, char *dir, size_t dirlen, hs_server *srv[2],
                             int port[2], char *addrs, size_t addrlen, cu_trainer *tr,
                             double *scales) {
  reference();
  cu_dir(dir, dirlen, name);
  start_shards(srv, 2, NULL, dir);
  for (int i = 0; i < 2; i++)
    port[i] = srv[i]->port;
  cu_addrs(srv, 2, addrs, addrlen);
  assert_int_equal(cu_trainer_init(tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(tr), 0);
  train_ok(tr, K1, scales);
  assert_int_equal(zs_checkpoint(tr->c, 0), ZS_OK);
  train_ok(tr, K2, scales);
}

static void every_shard_killed_and_restored_resumes_the_loss_scale_of_the_checkpoint(void **state) {
  (void)state;
  char dir[512];
  hs_server *srv[2];
  int port[2];
  char addrs[128];
  double scales[LAST + 1] = {0};
  cu_trainer tr;
  checkpointed_run("scaler-restore", dir, sizeof dir, srv, port, addrs, sizeof addrs, &tr, scales);
  const double before = zs_loss_scale(tr.c);
  assert_true(before != g_ref.scales[K1 + 1]);

  /* Every shard dies and comes back at checkpoint K1; the trainer, at step
   * K2 + 1, finds them behind and restores the job, scaler included. */
  for (uint32_t i = 0; i < 2; i++)
    cu_kill9(srv[i]);
  start_shards(srv, 2, port, dir);
  int rc = scaled_step(&tr, scales);
  fprintf(stderr, "first step after the restart: %s\n", tr.err);
  assert_true(cu_recoverable(rc));
  assert_int_equal(zs_restore(tr.c, 0), ZS_OK);
  assert_int_equal(zs_current_step(tr.c), K1 + 1);
  assert_true(zs_loss_scale(tr.c) == g_ref.scales[K1 + 1]);
  train_ok(&tr, LAST, scales);
  expect_like_reference(&tr, scales, K1 + 1);
  cu_trainer_free(&tr);
  stop_shards(srv, 2);
}

static void a_fresh_trainer_opening_a_restarted_job_resumes_its_loss_scale(void **state) {
  (void)state;
  char dir[512];
  hs_server *srv[2];
  int port[2];
  char addrs[128];
  double scales[LAST + 1] = {0};
  cu_trainer tr;
  checkpointed_run("scaler-open", dir, sizeof dir, srv, port, addrs, sizeof addrs, &tr, scales);
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    cu_kill9(srv[i]);
  start_shards(srv, 2, port, dir);

  /* The new trainer's scaler starts at 2^16 and is set from the shards'
   * state when it opens the job; restoring the checkpoint the shards
   * already hold sets the same. */
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_true(zs_loss_scale(tr.c) == g_scaler.scale);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), K1 + 1);
  assert_true(zs_loss_scale(tr.c) == g_ref.scales[K1 + 1]);
  assert_int_equal(zs_restore(tr.c, 0), ZS_OK);
  assert_true(zs_loss_scale(tr.c) == g_ref.scales[K1 + 1]);
  train_ok(&tr, LAST, scales);
  expect_like_reference(&tr, scales, K1 + 1);
  cu_trainer_free(&tr);
  stop_shards(srv, 2);
}

static void the_loss_scale_survives_resharding_two_to_three_and_back(void **state) {
  (void)state;
  reference();
  char dir[512], dir2[512];
  cu_dir(dir, sizeof dir, "scaler-reshard");
  cu_dir(dir2, sizeof dir2, "scaler-reshard-out");
  hs_server *srv[3];
  char addrs[192];
  double scales[LAST + 1] = {0};
  cu_trainer tr;

  /* 2 shards: steps 1..K1, checkpoint K1. */
  start_shards(srv, 2, NULL, dir);
  cu_addrs(srv, 2, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  train_ok(&tr, K1, scales);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  stop_shards(srv, 2);

  /* 3 shards load their share of the 2-shard checkpoint at start. */
  start_shards(srv, 3, NULL, dir);
  for (uint32_t i = 0; i < 3; i++)
    assert_true(cu_file_has(srv[i]->log_path, "step=7 source_shards=2"));
  cu_addrs(srv, 3, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), K1 + 1);
  assert_true(zs_loss_scale(tr.c) == g_ref.scales[K1 + 1]);
  train_ok(&tr, K2, scales);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  stop_shards(srv, 3);

  /* Offline back to 2 shards. */
  char out[4096];
  char *argv[] = {ZSHARD_CLI_BIN, "reshard", dir, dir2, "--shards", "2", NULL};
  int rc = cu_run(argv, out, sizeof out);
  fprintf(stderr, "%s", out);
  assert_int_equal(rc, 0);
  start_shards(srv, 2, NULL, dir2);
  cu_addrs(srv, 2, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), K2 + 1);
  assert_true(zs_loss_scale(tr.c) == g_ref.scales[K2 + 1]);
  train_ok(&tr, LAST, scales);
  expect_like_reference(&tr, scales, K1 + 1);
  cu_trainer_free(&tr);
  stop_shards(srv, 2);
}

static int group_setup(void **state) {
  (void)state;
  zs_loss_scaler_init(&g_scaler);
  g_scaler.window = 3;
  g_scaler.hysteresis = 1;
  g_scaler.cur_hysteresis = 1;
  cu_dynamic_scaler = &g_scaler;
  return hs_init();
}

static int group_teardown(void **state) {
  (void)state;
  cu_free_params(g_ref.param);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(every_shard_killed_and_restored_resumes_the_loss_scale_of_the_checkpoint),
      cmocka_unit_test(a_fresh_trainer_opening_a_restarted_job_resumes_its_loss_scale),
      cmocka_unit_test(the_loss_scale_survives_resharding_two_to_three_and_back),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, group_teardown);
  hs_finish(failures);
  return failures;
}
