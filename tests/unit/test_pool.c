/*
 * pool: the parallel-for runs every chunk exactly once, whatever the thread
 * and chunk counts, and returns only when all chunks have run.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "server/core/pool.h"

typedef struct coverage {
  atomic_int *hits;
  size_t n;
} coverage;

static void count_chunk(void *arg, size_t i) {
  coverage *cv = arg;
  /* Out-of-range indices are counted in the extra slot at the end. */
  atomic_fetch_add(&cv->hits[i < cv->n ? i : cv->n], 1);
}

/* Runs nchunks chunks and returns how many chunk indices did not run exactly
 * once (an index beyond the range counts as one). It does not assert, so that
 * threads other than the test's own can call it. */
static size_t run_and_count_miscovered(pool *p, size_t nchunks) {
  coverage cv = {.hits = calloc(nchunks + 1, sizeof(atomic_int)), .n = nchunks};
  if (!cv.hits)
    return SIZE_MAX;
  pool_run(p, nchunks, count_chunk, &cv);
  size_t bad = atomic_load(&cv.hits[nchunks]) != 0;
  for (size_t i = 0; i < nchunks; i++)
    bad += atomic_load(&cv.hits[i]) != 1;
  free(cv.hits);
  return bad;
}

static void check_run_covers_each_chunk_once(pool *p, size_t nchunks) {
  assert_int_equal(run_and_count_miscovered(p, nchunks), 0);
}

static void test_parallel_for_covers_every_chunk_exactly_once(void **state) {
  (void)state;
  const int threads[] = {1, 2, 3, 4, 8};
  const size_t chunks[] = {0, 1, 2, 3, 7, 16, 64, 1000, 4099};
  for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
    pool *p = NULL;
    assert_int_equal(pool_create(threads[t], &p), 0);
    assert_int_equal(pool_threads(p), threads[t]);
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++)
      check_run_covers_each_chunk_once(p, chunks[c]);
    pool_destroy(p);
  }
}

static void test_back_to_back_runs_never_mix_jobs(void **state) {
  (void)state;
  /* Many short jobs in a row: a thread that wakes late for one job must not
   * run chunks of the next one with the old function or argument. */
  pool *p = NULL;
  assert_int_equal(pool_create(4, &p), 0);
  for (int round = 0; round < 500; round++)
    check_run_covers_each_chunk_once(p, (size_t)(2 + round % 9));
  pool_destroy(p);
}

static void record_thread(void *arg, size_t i) {
  pthread_t *who = arg;
  who[i] = pthread_self();
}

static void test_single_thread_pool_runs_everything_on_the_caller(void **state) {
  (void)state;
  pool *p = NULL;
  assert_int_equal(pool_create(0, &p), 0);
  assert_int_equal(pool_threads(p), 1);
  pthread_t who[5];
  pool_run(p, 5, record_thread, who);
  for (int i = 0; i < 5; i++)
    assert_true(pthread_equal(who[i], pthread_self()));
  pool_destroy(p);
}

typedef struct runner {
  pool *p;
  size_t nchunks;
  int rounds;
  size_t bad;
} runner;

static void *run_many(void *arg) {
  runner *r = arg;
  for (int i = 0; i < r->rounds; i++)
    r->bad += run_and_count_miscovered(r->p, r->nchunks);
  return NULL;
}

static void test_runs_from_several_threads_are_serialised(void **state) {
  (void)state;
  pool *p = NULL;
  assert_int_equal(pool_create(3, &p), 0);
  runner a = {.p = p, .nchunks = 37, .rounds = 100};
  runner b = {.p = p, .nchunks = 11, .rounds = 100};
  pthread_t ta, tb;
  assert_int_equal(pthread_create(&ta, NULL, run_many, &a), 0);
  assert_int_equal(pthread_create(&tb, NULL, run_many, &b), 0);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  assert_int_equal(a.bad, 0);
  assert_int_equal(b.bad, 0);
  pool_destroy(p);
}

static void test_destroy_tolerates_null(void **state) {
  (void)state;
  pool_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parallel_for_covers_every_chunk_exactly_once),
      cmocka_unit_test(test_back_to_back_runs_never_mix_jobs),
      cmocka_unit_test(test_single_thread_pool_runs_everything_on_the_caller),
      cmocka_unit_test(test_runs_from_several_threads_are_serialised),
      cmocka_unit_test(test_destroy_tolerates_null),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
