/*
 * test_histogram — the latency histogram and the metrics registry, in
 * process: bucket bounds are inclusive (Prometheus' "le"), out-of-range
 * durations land in the first or the +Inf bucket, concurrent recording loses
 * nothing, a (transport, method) pair is registered once, and the rendered
 * page carries what was recorded. The HTTP endpoint and promtool's opinion
 * are tested against a real server in tests/integration/test_metrics.c.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/core/core.h"
#include "server/core/histogram.h"
#include "server/metrics/metrics.h"

static void bucket_bounds_are_inclusive_like_prometheus_le(void **state) {
  (void)state;
  histogram h;
  histogram_init(&h);
  /* 1 ms is a bound: exactly 1 ms is in its bucket, 1 ns more is not. */
  size_t ms = 0;
  while (histogram_bound_seconds(ms) != 0.001)
    ms++;
  histogram_observe_ns(&h, 1000000);
  histogram_observe_ns(&h, 1000001);
  histogram_snapshot s;
  histogram_read(&h, &s);
  assert_int_equal(s.cumulative[ms], 1);
  assert_int_equal(s.cumulative[ms + 1], 2);
  assert_int_equal(s.cumulative[ms - 1], 0);
  assert_int_equal(s.count, 2);
  assert_true(fabs(s.sum_seconds - 0.002000001) < 1e-12);
}

static void bounds_rise_from_50_microseconds_to_5_minutes(void **state) {
  (void)state;
  assert_true(histogram_bound_seconds(0) == 50e-6);
  for (size_t i = 1; i < HISTOGRAM_BOUNDS; i++)
    assert_true(histogram_bound_seconds(i) > histogram_bound_seconds(i - 1));
  assert_true(histogram_bound_seconds(HISTOGRAM_BOUNDS - 1) == 300.0);
  assert_true(isinf(histogram_bound_seconds(HISTOGRAM_BOUNDS)));
}

static void odd_durations_land_in_the_first_or_the_inf_bucket(void **state) {
  (void)state;
  histogram h;
  histogram_init(&h);
  histogram_observe_seconds(&h, 0.0);
  histogram_observe_seconds(&h, -3.0);
  histogram_observe_seconds(&h, NAN);
  histogram_observe_seconds(&h, 301.0);
  histogram_observe_seconds(&h, 1e300);
  histogram_observe_seconds(&h, INFINITY);
  histogram_snapshot s;
  histogram_read(&h, &s);
  assert_int_equal(s.cumulative[0], 3);
  assert_int_equal(s.cumulative[HISTOGRAM_BOUNDS - 1], 3);
  assert_int_equal(s.cumulative[HISTOGRAM_BOUNDS], 6);
  assert_int_equal(s.count, 6);
  /* NULL records nothing and does not crash: callers without metrics pass
   * it on. */
  histogram_observe_ns(NULL, 5);
  histogram_observe_seconds(NULL, 5);
  metrics_rpc_observe(NULL, 5, 1);
}

#define THREADS 4
#define PER_THREAD 200000

static void *record_many(void *arg) {
  histogram *h = arg;
  for (uint64_t i = 0; i < PER_THREAD; i++)
    histogram_observe_ns(h, (i % 1000) * 1000000); /* 0 to 999 ms */
  return NULL;
}

static void concurrent_recording_loses_no_observation(void **state) {
  (void)state;
  histogram *h = calloc(1, sizeof *h);
  assert_non_null(h);
  histogram_init(h);
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++)
    assert_int_equal(pthread_create(&th[i], NULL, record_many, h), 0);
  for (int i = 0; i < THREADS; i++)
    pthread_join(th[i], NULL);
  histogram_snapshot s;
  histogram_read(h, &s);
  assert_int_equal(s.count, (uint64_t)THREADS * PER_THREAD);
  /* The sum of 0..999 ms, 200 times per thread, exactly (integer ns). */
  double want = (double)THREADS * (PER_THREAD / 1000) * (999.0 * 1000.0 / 2.0) / 1000.0;
  assert_true(fabs(s.sum_seconds - want) < 1e-6);
  free(h);
}

static void a_method_is_registered_once_and_bad_names_are_refused(void **state) {
  (void)state;
  metrics *m = NULL;
  assert_int_equal(metrics_create(3, &m), 0);
  metrics_rpc *a = metrics_rpc_register(m, "grpc", "Push");
  assert_non_null(a);
  assert_ptr_equal(metrics_rpc_register(m, "grpc", "Push"), a);
  assert_ptr_not_equal(metrics_rpc_register(m, "data", "Push"), a);
  /* Names become label values, so nothing that would need escaping. */
  assert_null(metrics_rpc_register(m, "grpc", "Pu\"sh"));
  assert_null(metrics_rpc_register(m, "grpc", "a b"));
  assert_null(metrics_rpc_register(m, "", "Push"));
  assert_null(metrics_rpc_register(m, "grpc", "a_name_longer_than_thirty_one_chars"));
  assert_null(metrics_rpc_register(NULL, "grpc", "Push"));
  assert_null(metrics_apply_histogram(NULL));
  /* The registry has room for METRICS_MAX_RPCS pairs, then says no. */
  int made = 2;
  for (int i = 0; made < METRICS_MAX_RPCS; i++, made++) {
    char name[16];
    snprintf(name, sizeof name, "M%d", i);
    assert_non_null(metrics_rpc_register(m, "grpc", name));
  }
  assert_null(metrics_rpc_register(m, "grpc", "OneTooMany"));
  metrics_destroy(m);
  metrics_destroy(NULL);
}

static void the_page_carries_what_was_recorded(void **state) {
  (void)state;
  metrics *m = NULL;
  assert_int_equal(metrics_create(3, &m), 0);
  core_config cc = {
      .shard_id = 3, .num_shards = 4, .threads = 1, .apply_hist = metrics_apply_histogram(m)};
  core *c = NULL;
  assert_int_equal(core_create(&cc, &c), 0);
  metrics_rpc *push = metrics_rpc_register(m, "grpc", "Push");
  metrics_rpc_observe(push, 2000000, 0);  /* 2 ms */
  metrics_rpc_observe(push, 40000000, 1); /* 40 ms, failed */
  histogram_observe_seconds(metrics_apply_histogram(m), 0.3);
  char *page = NULL;
  size_t len = 0;
  assert_int_equal(metrics_render(m, c, &page, &len), 0);
  assert_int_equal(strlen(page), len);
  const char *want[] = {
      "# TYPE zshard_request_duration_seconds histogram\n",
      "zshard_request_duration_seconds_bucket{shard=\"3\",transport=\"grpc\",method=\"Push\","
      "le=\"0.001\"} 0\n",
      "zshard_request_duration_seconds_bucket{shard=\"3\",transport=\"grpc\",method=\"Push\","
      "le=\"0.0025\"} 1\n",
      "zshard_request_duration_seconds_bucket{shard=\"3\",transport=\"grpc\",method=\"Push\","
      "le=\"0.05\"} 2\n",
      "zshard_request_duration_seconds_bucket{shard=\"3\",transport=\"grpc\",method=\"Push\","
      "le=\"+Inf\"} 2\n",
      "zshard_request_duration_seconds_sum{shard=\"3\",transport=\"grpc\",method=\"Push\"} 0.042\n",
      "zshard_request_duration_seconds_count{shard=\"3\",transport=\"grpc\",method=\"Push\"} 2\n",
      "zshard_request_errors_total{shard=\"3\",transport=\"grpc\",method=\"Push\"} 1\n",
      "zshard_apply_duration_seconds_bucket{shard=\"3\",le=\"0.25\"} 0\n",
      "zshard_apply_duration_seconds_bucket{shard=\"3\",le=\"0.5\"} 1\n",
      "zshard_apply_duration_seconds_count{shard=\"3\"} 1\n",
      "zshard_shards{shard=\"3\"} 4\n",
      "zshard_job_open{shard=\"3\"} 0\n",
      "# TYPE zshard_pushes_total counter\n",
      "# TYPE process_resident_memory_bytes gauge\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (!strstr(page, want[i]))
      fail_msg("the page lacks %s\n%s", want[i], page);
  free(page);
  core_destroy(c);
  metrics_destroy(m);
}

static void process_rss_is_read_from_proc(void **state) {
  (void)state;
  uint64_t rss = metrics_process_rss();
  /* This test program, with cmocka and libc, is more than a megabyte. */
  assert_true(rss > 1000000);
  assert_true(rss < (uint64_t)1 << 40);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(bucket_bounds_are_inclusive_like_prometheus_le),
      cmocka_unit_test(bounds_rise_from_50_microseconds_to_5_minutes),
      cmocka_unit_test(odd_durations_land_in_the_first_or_the_inf_bucket),
      cmocka_unit_test(concurrent_recording_loses_no_observation),
      cmocka_unit_test(a_method_is_registered_once_and_bad_names_are_refused),
      cmocka_unit_test(the_page_carries_what_was_recorded),
      cmocka_unit_test(process_rss_is_read_from_proc),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
