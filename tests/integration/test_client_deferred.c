/*
 * test_client_deferred — deferred initial weights against real zshard-server
 * processes: a job opened with zs_open_job_deferred is not ready until
 * zs_init_tensor has sent every tensor's weights, one tensor at a time;
 * another rank waits for them with zs_wait_initialized; the same weights sent
 * twice are accepted and different ones refused; bad calls name what is
 * wrong and send nothing.
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
#include "zshard/zshard.h"

#define NT 3
#define SPLIT 64
static const uint64_t NUMEL[NT] = {300, 7, 129};

static zs_client *open_client(const hs_cluster *cl, uint32_t rank) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.rank = rank;
  o.world_size = 2;
  o.split_threshold = SPLIT;
  o.rpc_timeout_ms = 5000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &g, NULL), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  return c;
}

static float *weights(uint32_t t, float bias) {
  float *w = malloc(NUMEL[t] * sizeof(float));
  assert_non_null(w);
  for (uint64_t i = 0; i < NUMEL[t]; i++)
    w[i] = bias + (float)t + (float)i / 16.0f;
  return w;
}

static void a_job_is_ready_once_every_tensor_has_its_weights(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *r0 = open_client(&cl, 0), *r1 = open_client(&cl, 1);
  assert_int_equal(zs_open_job_deferred(r0), ZS_OK);
  assert_int_equal(zs_open_job_deferred(r1), ZS_OK);
  /* Nothing sent yet: rank 1 times out waiting, and says why. */
  assert_int_equal(zs_wait_initialized(r1, 150), ZS_ETIMEDOUT);
  assert_non_null(strstr(zs_last_error(), "lack initial weights"));
  float *w[NT];
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = weights(t, 1.0f);
    assert_int_equal(zs_init_tensor(r0, t, w[t]), ZS_OK);
    if (t + 1 < NT) /* not ready until the last tensor */
      assert_int_equal(zs_wait_initialized(r1, 50), ZS_ETIMEDOUT);
  }
  assert_int_equal(zs_wait_initialized(r1, 0), ZS_OK);
  assert_int_equal(zs_wait_initialized(r0, 1000), ZS_OK);
  /* Both ranks pull exactly the weights rank 0 sent. */
  for (uint32_t t = 0; t < NT; t++) {
    float *got = calloc(NUMEL[t], sizeof(float));
    zs_request *req = NULL;
    assert_int_equal(zs_pull(r1, t, got, ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), &req), ZS_OK);
    assert_int_equal(zs_wait(req), ZS_OK);
    assert_memory_equal(got, w[t], NUMEL[t] * sizeof(float));
    free(got);
  }
  /* The same weights again are harmless; different ones are refused. */
  assert_int_equal(zs_init_tensor(r0, 0, w[0]), ZS_OK);
  float *other = weights(0, 2.0f);
  assert_int_equal(zs_init_tensor(r0, 0, other), ZS_EEXIST);
  assert_non_null(strstr(zs_last_error(), "zs_init_tensor"));
  free(other);
  for (uint32_t t = 0; t < NT; t++)
    free(w[t]);
  assert_int_equal(zs_client_close(r0), ZS_OK);
  assert_int_equal(zs_client_close(r1), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void bad_calls_name_the_problem(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 0);
  float *w = weights(0, 1.0f);
  assert_int_equal(zs_init_tensor(c, 0, w), ZS_ENOTOPEN);
  assert_int_equal(zs_wait_initialized(c, 10), ZS_ENOTOPEN);
  assert_int_equal(zs_open_job_deferred(c), ZS_OK);
  assert_int_equal(zs_init_tensor(c, NT, w), ZS_ENOTFOUND);
  assert_non_null(strstr(zs_last_error(), "no tensor 3"));
  assert_int_equal(zs_init_tensor(c, 1, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "'t1'"));
  /* Nothing was sent by the refused calls. */
  assert_int_equal(zs_wait_initialized(c, 50), ZS_ETIMEDOUT);
  free(w);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_job_is_ready_once_every_tensor_has_its_weights),
      cmocka_unit_test(bad_calls_name_the_problem),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
