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
 * Run on both transports (ZSHARD_TRANSPORT, tests/CMakeLists.txt). The
 * servers, the trainer threads and main are the shared fixture's
 * (trainers.h).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "trainers.h"
#include "zshard/zshard.h"

#define NUMEL 300 /* split over both shards (SPLIT) */
#define SPLIT 64
#define LR 0.5
/* Far beyond the step timeout: a step that waited for it fails. */
static const char *const k_elastic[] = {"--trainer-timeout-ms", "600000", NULL};

static zs_client *trainer_opts(const char *addrs, const char *job, uint32_t rank, uint32_t W,
                               zs_open_mode mode, uint32_t trainer_timeout_ms) {
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

static zs_client *trainer(const char *addrs, const char *job, uint32_t rank, uint32_t W,
                          zs_open_mode mode) {
  return trainer_opts(addrs, job, rank, W, mode, 0);
}

static int open_job(zs_client *c, uint32_t rank, zs_open_mode mode) {
  static float zeros[NUMEL];
  const float *w[1] = {zeros};
  return zs_open_job(c, rank == 0 && mode != ZS_OPEN_JOIN ? w : NULL);
}

/* One step of this trainer: its members' count and its rank among them. */
typedef struct stepped {
  uint64_t step;
  uint32_t num_members, member_rank;
} stepped;

/* One step of rank `rank` with the gradient r + 1 everywhere (a step's sum
 * is the sum of its members' r + 1): ZS_OK and *out, or the failure with
 * its sentence in err. Any thread. */
static int try_step(zs_client *c, uint32_t rank, stepped *out, char *err, size_t errlen) {
  float g[NUMEL];
  for (int i = 0; i < NUMEL; i++)
    g[i] = (float)(rank + 1);
  int rc = zs_push(c, 0, 0, g, ZS_DTYPE_FP32, sizeof g, NULL);
  zs_step_options so;
  zs_step_options_init(&so);
  so.lr = LR;
  zs_step_result res;
  zs_step_result_init(&res);
  if (rc == ZS_OK)
    rc = zs_step_ex(c, &so, &res);
  if (rc != ZS_OK) {
    snprintf(err, errlen, "%s: %s", zs_err_name(rc), zs_last_error());
    return rc;
  }
  *out = (stepped){res.step, res.num_members, res.member_rank};
  return ZS_OK;
}

/* One step on the test's own thread. */
static stepped step_once(zs_client *c, uint32_t rank) {
  stepped s = {0};
  char err[600] = "";
  if (try_step(c, rank, &s, err, sizeof err) != ZS_OK)
    fail_msg("rank %" PRIu32 ": %s", rank, err);
  return s;
}

/* The trainers that step side by side (together): rank r uses c[r]. */
typedef struct run {
  zs_client *c[2];
  uint32_t nsteps;
} run;

/* A trainer thread's report: its status, first failure and steps. */
typedef struct ran {
  int rc;
  char err[600];
  stepped out[8];
} ran;

static void *run_steps(void *arg) {
  const tr_trainer *t = arg;
  const run *r = t->cfg;
  ran *out = t->out;
  for (uint32_t i = 0; i < r->nsteps && out->rc == ZS_OK; i++)
    out->rc = try_step(r->c[t->rank], t->rank, &out->out[i], out->err, sizeof out->err);
  return NULL;
}

/* Runs both trainers' steps side by side, one thread each, into outs[2]. */
static void together(const run *r, ran *outs) {
  tr_run_trainers(2, run_steps, r, outs, sizeof *outs);
  for (uint32_t k = 0; k < 2; k++)
    if (outs[k].rc != ZS_OK)
      fail_msg("rank %" PRIu32 ": %s", k, outs[k].err);
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
  char addrs[256];
  tr_cluster_up(&cl, 2, k_elastic, addrs, sizeof addrs);
  zs_client *a = trainer(addrs, "ws", 0, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  /* Another world size opens the same job (not EHASH) and takes its W. */
  zs_client *b = trainer(addrs, "ws", 1, 3, ZS_OPEN_EITHER);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  ran runs[2];
  together(&(run){{a, b}, 1}, runs);
  expect(&runs[0].out[0], 1, 2, 0);
  expect(&runs[1].out[0], 1, 2, 1);
  weights_are(a, -0.5f * 3.0f);
  /* A rank beyond the job's world size (2) is refused, naming it. */
  zs_client *x = trainer(addrs, "ws", 2, 3, ZS_OPEN_EITHER);
  assert_int_equal(open_job(x, 2, ZS_OPEN_EITHER), ZS_EINVAL);
  fprintf(stderr, "rank 2 of a job of W = 2: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "world size is 2"));
  assert_non_null(strstr(zs_last_error(), "cannot grow past it"));
  assert_int_equal(zs_client_close(x), ZS_OK);
  /* So is a join of such a rank: the rank space is fixed at creation. */
  x = trainer(addrs, "ws", 2, 3, ZS_OPEN_JOIN);
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
  char addrs[256];
  tr_cluster_up(&cl, 2, k_elastic, addrs, sizeof addrs);
  zs_client *a = trainer(addrs, "el", 0, 2, ZS_OPEN_EITHER);
  zs_client *b = trainer(addrs, "el", 1, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  /* Steps 1 and 2 with both ranks: the sum is 1 + 2 = 3. */
  ran runs[2];
  together(&(run){{a, b}, 2}, runs);
  for (int s = 0; s < 2; s++) {
    expect(&runs[0].out[s], (uint64_t)s + 1, 2, 0);
    expect(&runs[1].out[s], (uint64_t)s + 1, 2, 1);
  }
  /* Rank 1 closes: step 3 goes on with rank 0 alone, without the timeout. */
  assert_int_equal(zs_client_close(b), ZS_OK);
  expect((stepped[]){step_once(a, 0)}, 3, 1, 0);
  /* Rank 1 comes back in join mode: admitted at step 4, it pulls version 3. */
  zs_client *b2 = trainer(addrs, "el", 1, 2, ZS_OPEN_JOIN);
  assert_int_equal(open_job(b2, 1, ZS_OPEN_JOIN), ZS_OK);
  assert_int_equal(zs_current_step(b2), 4);
  weights_are(b2, -0.5f * (3 + 3 + 1));
  ran again[2];
  together(&(run){{a, b2}, 2}, again);
  for (int s = 0; s < 2; s++) {
    expect(&again[0].out[s], (uint64_t)s + 4, 2, 0);
    expect(&again[1].out[s], (uint64_t)s + 4, 2, 1);
  }
  /* Every member leaves: the job waits on the shards, and goes on when one
   * joins (rank 1 alone now, its member rank 0). */
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(zs_client_close(b2), ZS_OK);
  zs_client *c = trainer(addrs, "el", 1, 2, ZS_OPEN_JOIN);
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
  char addrs[256];
  tr_cluster_up(&cl, 2, NULL, addrs, sizeof addrs);
  zs_client *a = trainer(addrs, "fixed", 0, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  zs_client *j = trainer(addrs, "fixed", 1, 2, ZS_OPEN_JOIN);
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
  char addrs[256];
  tr_cluster_up(&cl, 2, NULL, addrs, sizeof addrs);
  zs_client *big = trainer_opts(addrs, "opt", 0, 2, ZS_OPEN_EITHER, 3600001);
  assert_int_equal(open_job(big, 0, ZS_OPEN_EITHER), ZS_ERANGE);
  fprintf(stderr, "a timeout above an hour: %s\n", zs_last_error());
  assert_int_equal(zs_client_close(big), ZS_OK);
  zs_client *a = trainer_opts(addrs, "opt", 0, 2, ZS_OPEN_EITHER, 600000);
  zs_client *b = trainer(addrs, "opt", 1, 2, ZS_OPEN_EITHER);
  assert_int_equal(open_job(a, 0, ZS_OPEN_EITHER), ZS_OK);
  assert_int_equal(open_job(b, 1, ZS_OPEN_EITHER), ZS_OK);
  ran runs[2];
  together(&(run){{a, b}, 1}, runs);
  expect(&runs[0].out[0], 1, 2, 0);
  assert_int_equal(zs_client_close(b), ZS_OK);
  expect((stepped[]){step_once(a, 0)}, 2, 1, 0);
  weights_are(a, -0.5f * (3 + 1));
  assert_int_equal(zs_client_close(a), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(world_size_is_not_part_of_the_job),
      cmocka_unit_test(trainers_leave_at_a_close_and_join_at_a_step_boundary),
      cmocka_unit_test(join_mode_needs_an_elastic_job),
      cmocka_unit_test(the_trainer_timeout_is_a_job_option_too),
  };
  return TR_RUN_TESTS(tests);
}
