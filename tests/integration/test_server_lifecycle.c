/*
 * test_server_lifecycle — zshard-server as a process: its flags and
 * environment, health checking, unknown methods, and shutdown on SIGTERM with
 * calls in flight.
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "common/base/status.h"
#include "grpc/health/v1/health.pb-c.h"
#include "tests/integration/harness.h"

enum {
  SERVING = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
  NOT_SERVING = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING,
  SERVICE_UNKNOWN = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN,
};

/* gRPC status codes used below. */
enum { G_DEADLINE = 4, G_NOT_FOUND = 5, G_UNIMPLEMENTED = 12, G_UNAVAILABLE = 14 };

static void expect_shard(hs_server *s, uint32_t shard, uint32_t shards) {
  assert_non_null(s);
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(s->addr, &ch), 0);
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  if (hs_get_info(ch, &info, &st))
    fail_msg("GetInfo: %s", st.message);
  assert_int_equal(info->shard_id, shard);
  assert_int_equal(info->num_shards, shards);
  assert_true(info->serving);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
}

static int health_check(rpc_channel *ch, const char *service, int *status, rpc_status *st) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)service;
  ProtobufCMessage *resp = NULL;
  int rc =
      rpc_call(ch, "/grpc.health.v1.Health/Check", &req.base,
               &grpc__health__v1__health_check_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, st);
  if (rc == 0) {
    *status = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return rc;
}

/* ------------------------------------------------------------ flags */

static void expect_usage_error(const char *const *args, const char *const *env, const char *word) {
  char out[4096];
  int rc = hs_run(args, env, out, sizeof out);
  if (rc != 2)
    fail_msg("%s ...: exit status %d, expected 2; output:\n%s", args[0], rc, out);
  if (!strstr(out, word))
    fail_msg("%s ...: the message does not mention \"%s\":\n%s", args[0], word, out);
}

static void test_bad_flags_exit_with_status_2_and_say_why(void **state) {
  (void)state;
  expect_usage_error((const char *[]){"--bogus", NULL}, NULL, "--bogus");
  expect_usage_error((const char *[]){"--listen", NULL}, NULL, "needs a value");
  expect_usage_error((const char *[]){"--shards", "0", NULL}, NULL, "--shards");
  expect_usage_error((const char *[]){"--shards", "two", NULL}, NULL, "--shards");
  expect_usage_error((const char *[]){"--shard-id", "-1", NULL}, NULL, "--shard-id");
  expect_usage_error((const char *[]){"--shard-id", "2", "--shards", "2", NULL}, NULL, "not below");
  expect_usage_error((const char *[]){"--threads", "0", NULL}, NULL, "--threads");
  expect_usage_error((const char *[]){"--log-level", "loud", NULL}, NULL, "--log-level");
  expect_usage_error((const char *[]){"stray", NULL}, NULL, "stray");
  /* Environment values are checked like flags. */
  expect_usage_error((const char *[]){"--shard-id", "0", NULL},
                     (const char *[]){"ZSHARD_SHARDS=many", NULL}, "many");
  /* Several shards and neither an id nor a host name ending in -<ordinal>. */
  expect_usage_error((const char *[]){"--shards", "2", "--hostname", "worker", NULL}, NULL,
                     "worker");
}

static void test_help_and_version_exit_0(void **state) {
  (void)state;
  char out[4096];
  assert_int_equal(hs_run((const char *[]){"--help", NULL}, NULL, out, sizeof out), 0);
  assert_non_null(strstr(out, "--listen"));
  assert_non_null(strstr(out, "ZSHARD_SHARD_ID"));
  assert_int_equal(hs_run((const char *[]){"--version", NULL}, NULL, out, sizeof out), 0);
  assert_non_null(strstr(out, zs_version()));
}

static void test_shard_id_comes_from_a_statefulset_host_name(void **state) {
  (void)state;
  hs_server *s = hs_start((const char *[]){"--shards", "3", "--hostname", "zshard-2", NULL}, NULL);
  expect_shard(s, 2, 3);
  assert_int_equal(hs_stop(s), 0);
  s = hs_start(NULL, (const char *[]){"ZSHARD_HOSTNAME=zshard-1.zshard.default.svc",
                                      "ZSHARD_SHARDS=2", NULL});
  expect_shard(s, 1, 2);
  assert_int_equal(hs_stop(s), 0);
  /* An ordinal beyond the shard count is an error, not a wrap-around. */
  expect_usage_error((const char *[]){"--shards", "2", "--hostname", "zshard-2", NULL}, NULL,
                     "not below");
}

static void test_flags_win_over_the_environment(void **state) {
  (void)state;
  hs_server *s = hs_start((const char *[]){"--shard-id", "0", "--shards", "2", NULL},
                          (const char *[]){"ZSHARD_SHARD_ID=1", "ZSHARD_SHARDS=4", NULL});
  expect_shard(s, 0, 2);
  assert_int_equal(hs_stop(s), 0);
  s = hs_start(NULL, (const char *[]){"ZSHARD_SHARD_ID=3", "ZSHARD_SHARDS=4", NULL});
  expect_shard(s, 3, 4);
  assert_int_equal(hs_stop(s), 0);
}

static void test_a_port_in_use_is_a_startup_error(void **state) {
  (void)state;
  hs_server *a = hs_start(NULL, NULL);
  assert_non_null(a);
  char out[4096];
  int rc = hs_run((const char *[]){"--listen", a->addr, NULL}, NULL, out, sizeof out);
  if (rc != 1)
    fail_msg("a second server on %s: exit status %d, expected 1; output:\n%s", a->addr, rc, out);
  assert_non_null(strstr(out, "startup_failed"));
  assert_int_equal(hs_stop(a), 0);
}

/* ------------------------------------------------------------ gRPC */

static void test_an_unknown_method_is_unimplemented_at_once(void **state) {
  (void)state;
  hs_server *s = hs_start(NULL, NULL);
  assert_non_null(s);
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(s->addr, &ch), 0);
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  const char *methods[] = {"/zshard.v1.ZShard/NoSuchMethod", "/other.Service/Call"};
  for (int i = 0; i < 2; i++) {
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    /* Were the call left unanswered, it would end with DEADLINE_EXCEEDED
     * after these 20 s instead. */
    int rc = rpc_call(ch, methods[i], &req.base, &zshard__v1__get_info_response__descriptor, &resp,
                      20000, &st);
    assert_int_equal(rc, ZS_EUNIMPL);
    assert_int_equal(st.grpc_code, G_UNIMPLEMENTED);
    assert_int_equal(st.zs_status, ZS_EUNIMPL);
    assert_non_null(strstr(st.message, methods[i]));
  }
  rpc_channel_close(ch);
  assert_int_equal(hs_stop(s), 0);
}

static void test_health_check_serves_the_server_and_its_service_only(void **state) {
  (void)state;
  hs_server *s = hs_start(NULL, NULL);
  assert_non_null(s);
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(s->addr, &ch), 0);
  int status = -1;
  rpc_status st;
  assert_int_equal(health_check(ch, "", &status, &st), 0);
  assert_int_equal(status, SERVING);
  assert_int_equal(health_check(ch, "zshard.v1.ZShard", &status, &st), 0);
  assert_int_equal(status, SERVING);
  assert_int_equal(health_check(ch, "no.such.Service", &status, &st), ZS_ENOTFOUND);
  assert_int_equal(st.grpc_code, G_NOT_FOUND);
  rpc_channel_close(ch);
  assert_int_equal(hs_stop(s), 0);
}

static void test_watch_streams_serving_then_not_serving_on_sigterm(void **state) {
  (void)state;
  hs_server *s = hs_start(NULL, NULL);
  assert_non_null(s);
  hs_watch *w = NULL, *unknown = NULL;
  assert_int_equal(hs_watch_start(s->addr, "", &w), 0);
  assert_int_equal(hs_watch_start(s->addr, "no.such.Service", &unknown), 0);
  int status = -1;
  assert_int_equal(hs_watch_next(w, &status), 0);
  assert_int_equal(status, SERVING);
  assert_int_equal(hs_watch_next(unknown, &status), 0);
  assert_int_equal(status, SERVICE_UNKNOWN);

  hs_signal(s, SIGTERM);
  assert_int_equal(hs_watch_next(w, &status), 0);
  assert_int_equal(status, NOT_SERVING);
  /* Then the stream ends, as the server goes away. */
  assert_int_equal(hs_watch_next(w, &status), 1);
  assert_int_equal(status, G_UNAVAILABLE);
  /* The unknown service's status does not change; its stream just ends. */
  assert_int_equal(hs_watch_next(unknown, &status), 1);
  assert_int_equal(status, G_UNAVAILABLE);
  hs_watch_free(w);
  hs_watch_free(unknown);
  assert_int_equal(hs_stop(s), 0);
}

typedef struct pending_pull {
  hs_job *j;
  int rc;
  rpc_status st;
} pending_pull;

static void *pull_main(void *arg) {
  pending_pull *pp = arg;
  const layout_piece *p = &pp->j->lay.pieces[0];
  size_t nbytes = (size_t)p->numel * 4;
  float *buf = malloc(nbytes);
  /* Version 2 (as far ahead as a wait may be) will never come; only the
   * shutdown can end this wait. */
  pp->rc = hs_pull(pp->j->ch[0], pp->j->hash, p->tensor, p->slice, 2, ZS_DTYPE_FP32, 60000, buf,
                   nbytes, NULL, &pp->st);
  free(buf);
  return NULL;
}

static void test_sigterm_during_a_pending_pull_ends_it_cleanly_and_exits_0(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 1, NULL), 0);
  spec sp;
  assert_int_equal(hs_spec_build(&sp, "sigterm", 1, 1, 1), 0);
  hs_job j;
  assert_int_equal(hs_job_init_cluster(&j, &sp, &cl), 0);
  rpc_status st;
  assert_int_equal(hs_job_open(&j, 0, &st), 0);
  float *w[16] = {0};
  for (uint32_t t = 0; t < j.sp.num_tensors; t++)
    w[t] = calloc(j.sp.tensors[t].numel, sizeof(float));
  assert_int_equal(hs_job_init_params(&j, w, &st), 0);

  pending_pull pp = {.j = &j, .rc = 1};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, pull_main, &pp), 0);
  /* SIGTERM only once the server holds the Pull waiting: its Stats count
   * waiting pulls (bounded poll; the thread may not have sent it yet). */
  uint32_t waiting = 0;
  for (int i = 0; i < 2000 && waiting == 0; i++) {
    Zshard__V1__StatsRequest sreq = ZSHARD__V1__STATS_REQUEST__INIT;
    Zshard__V1__StatsResponse *sresp = NULL;
    assert_int_equal(rpc_call(j.ch[0], "/zshard.v1.ZShard/Stats", &sreq.base,
                              &zshard__v1__stats_response__descriptor, (ProtobufCMessage **)&sresp,
                              5000, &st),
                     0);
    waiting = sresp->waiting_pulls;
    protobuf_c_message_free_unpacked(&sresp->base, NULL);
    if (waiting == 0)
      nanosleep(&(struct timespec){.tv_nsec = 5000000}, NULL);
  }
  assert_int_equal(waiting, 1);

  assert_int_equal(hs_cluster_stop(&cl), 0); /* SIGTERM, then exit status 0 */
  pthread_join(th, NULL);
  /* The Pull ended as UNAVAILABLE: answered ZS_ECLOSED by the server while it
   * shut down (or refused by gRPC had it arrived just too late), and not by
   * its own 60 s deadline. */
  if (pp.st.grpc_code != G_UNAVAILABLE)
    fail_msg("the pending Pull ended with gRPC code %d (%s)", pp.st.grpc_code, pp.st.message);
  assert_true(pp.rc == ZS_ECLOSED || pp.rc == ZS_ECONN);
  for (uint32_t t = 0; t < j.sp.num_tensors; t++)
    free(w[t]);
  hs_job_free(&j);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_flags_exit_with_status_2_and_say_why),
      cmocka_unit_test(test_help_and_version_exit_0),
      cmocka_unit_test(test_shard_id_comes_from_a_statefulset_host_name),
      cmocka_unit_test(test_flags_win_over_the_environment),
      cmocka_unit_test(test_a_port_in_use_is_a_startup_error),
      cmocka_unit_test(test_an_unknown_method_is_unimplemented_at_once),
      cmocka_unit_test(test_health_check_serves_the_server_and_its_service_only),
      cmocka_unit_test(test_watch_streams_serving_then_not_serving_on_sigterm),
      cmocka_unit_test(test_sigterm_during_a_pending_pull_ends_it_cleanly_and_exits_0),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures;
}
