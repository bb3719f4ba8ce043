/*
 * test_client_elastic — elastic trainers (issue 26) on real zshard-server
 * processes started with --trainer-timeout-ms: the world size is not part of
 * the job's identity, a trainer that closes leaves at the next step boundary
 * (the others do not wait for the timeout, which is set far beyond the step
 * timeout so that waiting for it would fail the test), a trainer that opens
 * in ZS_OPEN_JOIN mode is admitted at a step boundary and contributes from
 * there, a job whose every member left waits until one joins, and the
 * timeout can be the job's own option (zs_client_options.trainer_timeout_ms).
 *
 * The gradients are small integers and the learning rate a power of two, so
 * the weights every membership gives are exact and known in advance.
 *
 * Run on both transports (ZSHARD_TRANSPORT, tests/CMakeLists.txt).
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "zshard/zshard.h"

#define NUMEL 300 /* split over both shards (SPLIT) */
#define SPLIT 64
#define LR 0.5
/* Far beyond the step timeout: a step that waited for it fails. */
static const char *const k_elastic[] = {"--trainer-timeout-ms", "600000", NULL};

static zs_client *trainer_opts(const hs_cluster *cl, const char *job, uint32_t rank, uint32_t W,
                               zs_open_mode mode, uint32_t trainer_timeout_ms) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = SPLIT;
  o.job = job;
  o.open_mode = mode;
  o.world_size = W;
  o.rank = rank;
  o.grad_reduce = ZS_REDUCE_SUM;
  o.max_retries = 3;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 200;
  o.rpc_timeout_ms = 10000;
  o.step_timeout_ms = 30000;
  o.trainer_timeout_ms = trainer_timeout_ms;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options go;
  zs_group_options_init(&go, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  assert_int_equal(zs_add_tensor(c, "w", NUMEL, 0, NULL, 0, NULL), ZS_OK);
  return c;
}

static zs_client *trainer(const hs_cluster *cl, const char *job, uint32_t rank, uint32_t W,
                          zs_open_mode mode) {
  return trainer_opts(cl, job, rank, W, mode, 0);
}

static int open_job(zs_client *c, uint32_t rank, zs_open_mode mode) {
  static float zeros[NUMEL];
  const float *w[1] = {zeros};
  return zs_open_job(c, rank == 0 && mode != ZS_OPEN_JOIN ? w : NULL);
}

/* Rank r's gradient: r + 1 everywhere, so a step's sum is the sum of its
 * members' (r + 1). */
static void push(zs_client *c, uint32_t rank) {
  float g[NUMEL];
  for (int i = 0; i < NUMEL; i++)
    g[i] = (float)(rank + 1);
  assert_int_equal(zs_push(c, 0, 0, g, ZS_DTYPE_FP32, sizeof g, NULL), ZS_OK);
}

/* One step of this trainer: its members' count and its rank among them. */
typedef struct stepped {
  uint64_t step;
  uint32_t num_members, member_rank;
} stepped;

static stepped step_once(zs_client *c, uint32_t rank) {
  push(c, rank);
  zs_step_options so;
  zs_step_options_init(&so);
  so.lr = LR;
  zs_step_result res;
  zs_step_result_init(&res);
  int rc = zs_step_ex(c, &so, &res);
  if (rc != ZS_OK)
    fprintf(stderr, "rank %" PRIu32 ": %s\n", rank, zs_last_error());
  assert_int_equal(rc, ZS_OK);
  return (stepped){res.step, res.num_members, res.member_rank};
}

typedef struct run {
  zs_client *c;
  uint32_t rank, nsteps;
  stepped out[8];
} run;

static void *run_steps(void *arg) {
  run *r = arg;
  for (uint32_t i = 0; i < r->nsteps; i++)
    r->out[i] = step_once(r->c, r->rank);
  return NULL;
}

/* Runs the trainers' steps side by side, one thread each. */
static void together(run *runs, int n) {
  pthread_t th[4];
  for (int i = 0; i < n; i++)
    assert_int_equal(pthread_create(&th[i], NULL, run_steps, &runs[i]), 0);
  for (int i = 0; i < n; i++)
    pthread_join(th[i], NULL);
}

static void expect(const stepped *s, uint64_t step, uint32_t members, uint32_t member_rank) {
  assert_int_equal(s->step, step);
  assert_int_equal(s->num_members, members);
  assert_int_equal(s->member_rank, member_rank);
}

static void weights_are(zs_client *c, float want) {
  float w[NUMEL];
  assert_int_equal(zs_pull(c, 0, w, ZS_DTYPE_FP32, sizeof w, NULL), ZS_OK);
  for (int i = 0; i < NUMEL; i++)
    assert_true(w[i] == want);
}

static void world_size_is_not_part_of_the_job(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, k_elastic), 0);
  zs_client *a = trainer(&cl, "ws", 0, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  /* Another world size opens the same job (not EHASH) and takes its W. */
  zs_client *b = trainer(&cl, "ws", 1, 3, ZS_OPEN_EITHER);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  run runs[2] = {{.c = a, .rank = 0, .nsteps = 1}, {.c = b, .rank = 1, .nsteps = 1}};
  together(runs, 2);
  expect(&runs[0].out[0], 1, 2, 0);
  expect(&runs[1].out[0], 1, 2, 1);
  weights_are(a, -0.5f * 3.0f);
  /* A rank beyond the job's world size (2) is refused, naming it. */
  zs_client *x = trainer(&cl, "ws", 2, 3, ZS_OPEN_EITHER);
  assert_int_equal(open_job(x, 2, ZS_OPEN_EITHER), ZS_EINVAL);
  fprintf(stderr, "rank 2 of a job of W = 2: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "world size is 2"));
  assert_non_null(strstr(zs_last_error(), "cannot grow past it"));
  assert_int_equal(zs_client_close(x), ZS_OK);
  /* So is a join of such a rank: the rank space is fixed at creation. */
  x = trainer(&cl, "ws", 2, 3, ZS_OPEN_JOIN);
  assert_int_equal(open_job(x, 2, ZS_OPEN_JOIN), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "cannot grow past it"));
  assert_int_equal(zs_client_close(x), ZS_OK);
  assert_int_equal(zs_client_close(b), ZS_OK);
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void trainers_leave_at_a_close_and_join_at_a_step_boundary(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, k_elastic), 0);
  zs_client *a = trainer(&cl, "el", 0, 2, ZS_OPEN_EITHER);
  zs_client *b = trainer(&cl, "el", 1, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  /* Steps 1 and 2 with both ranks: the sum is 1 + 2 = 3. */
  run runs[2] = {{.c = a, .rank = 0, .nsteps = 2}, {.c = b, .rank = 1, .nsteps = 2}};
  together(runs, 2);
  for (int s = 0; s < 2; s++) {
    expect(&runs[0].out[s], (uint64_t)s + 1, 2, 0);
    expect(&runs[1].out[s], (uint64_t)s + 1, 2, 1);
  }
  /* Rank 1 closes: step 3 goes on with rank 0 alone, without the timeout. */
  assert_int_equal(zs_client_close(b), ZS_OK);
  expect((stepped[]){step_once(a, 0)}, 3, 1, 0);
  /* Rank 1 comes back in join mode: admitted at step 4, it pulls version 3. */
  zs_client *b2 = trainer(&cl, "el", 1, 2, ZS_OPEN_JOIN);
  assert_int_equal(open_job(b2, 1, ZS_OPEN_JOIN), ZS_OK);
  assert_int_equal(zs_current_step(b2), 4);
  weights_are(b2, -0.5f * (3 + 3 + 1));
  run again[2] = {{.c = a, .rank = 0, .nsteps = 2}, {.c = b2, .rank = 1, .nsteps = 2}};
  together(again, 2);
  for (int s = 0; s < 2; s++) {
    expect(&again[0].out[s], (uint64_t)s + 4, 2, 0);
    expect(&again[1].out[s], (uint64_t)s + 4, 2, 1);
  }
  /* Every member leaves: the job waits on the shards, and goes on when one
   * joins (rank 1 alone now, its member rank 0). */
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(zs_client_close(b2), ZS_OK);
  zs_client *c = trainer(&cl, "el", 1, 2, ZS_OPEN_JOIN);
  assert_int_equal(open_job(c, 1, ZS_OPEN_JOIN), ZS_OK);
  assert_int_equal(zs_current_step(c), 6);
  expect((stepped[]){step_once(c, 1)}, 6, 1, 0);
  weights_are(c, -0.5f * (3 + 3 + 1 + 3 + 3 + 2));
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void join_mode_needs_an_elastic_job(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *a = trainer(&cl, "fixed", 0, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  zs_client *j = trainer(&cl, "fixed", 1, 2, ZS_OPEN_JOIN);
  assert_int_equal(open_job(j, 1, ZS_OPEN_JOIN), ZS_EINVAL);
  fprintf(stderr, "join of a fixed membership: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "fixed membership"));
  assert_int_equal(zs_client_close(j), ZS_OK);
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* The timeout as the job's option: shards without the flag, a job created
 * with trainer_timeout_ms is elastic (a close leaves at once); beyond an
 * hour is refused. */
static void the_trainer_timeout_is_a_job_option_too(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *big = trainer_opts(&cl, "opt", 0, 2, ZS_OPEN_EITHER, 3600001);
  assert_int_equal(open_job(big, 0, ZS_OPEN_EITHER), ZS_ERANGE);
  fprintf(stderr, "a timeout above an hour: %s\n", zs_last_error());
  assert_int_equal(zs_client_close(big), ZS_OK);
  zs_client *a = trainer_opts(&cl, "opt", 0, 2, ZS_OPEN_EITHER, 600000);
  zs_client *b = trainer(&cl, "opt", 1, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  run runs[2] = {{.c = a, .rank = 0, .nsteps = 1}, {.c = b, .rank = 1, .nsteps = 1}};
  together(runs, 2);
  expect(&runs[0].out[0], 1, 2, 0);
  assert_int_equal(zs_client_close(b), ZS_OK);
  expect((stepped[]){step_once(a, 0)}, 2, 1, 0);
  weights_are(a, -0.5f * (3 + 1));
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(world_size_is_not_part_of_the_job),
      cmocka_unit_test(trainers_leave_at_a_close_and_join_at_a_step_boundary),
      cmocka_unit_test(join_mode_needs_an_elastic_job),
      cmocka_unit_test(the_trainer_timeout_is_a_job_option_too),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures;
}
