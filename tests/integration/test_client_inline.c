/*
 * test_client_inline — the transfer fast path (client/lib/request.c,
 * submit_inline): an isolated push or pull of one piece in its wire dtype is
 * submitted to its data client on the caller's thread, sparing the pool's
 * hand-off; conversions, split tensors, batch calls and a held pool keep the
 * pool. Whichever path a transfer takes, the contract of zshard.h holds: a
 * completion callback runs once, on a library thread, never inside the call
 * that started the transfer; a failure reaches it with its sentence; closing
 * the client ends a transfer in flight.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "internal.h"
#include "zshard/zshard.h"

#define NT 3
/* Tensor 1 is split over both shards (two tasks); 0 and 2 are whole. */
static const uint64_t NUMEL[NT] = {7, 300, 5};

static zs_client *open_client(const hs_cluster *cl, uint32_t max_retries) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = 64;
  o.pull_dtype = ZS_DTYPE_BF16; /* fp32 buffers convert, bf16 ones do not */
  o.max_retries = max_retries;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 100;
  o.rpc_timeout_ms = 5000;
  o.step_timeout_ms = 5000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &g, NULL), ZS_OK);
  float *w[NT];
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
    w[t] = malloc(NUMEL[t] * sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = (float)(t + 1) + (float)i / 3.0f;
  }
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    free(w[t]);
  return c;
}

/* The shard that holds whole tensor t. */
static uint32_t shard_of(zs_client *c, uint32_t t) {
  uint32_t shard = 0;
  assert_int_equal(zs_tensor_slice(c, t, 0, &shard, NULL, NULL), ZS_OK);
  return shard;
}

static void only_isolated_one_piece_transfers_in_their_wire_dtype_skip_the_pool(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 3);
  uint16_t b0[7], b0_pool[7], b1[300];
  float f0[7], g0[7] = {1, 2, 3, 4, 5, 6, 7}, g2[5] = {1, 1, 1, 1, 1};
  uint64_t n = zc_dp_inline_submits(c);
  assert_int_equal(zs_pull(c, 0, b0, ZS_DTYPE_BF16, sizeof b0, NULL), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  /* A conversion is a worker's job; a split tensor has two pieces. */
  assert_int_equal(zs_pull(c, 0, f0, ZS_DTYPE_FP32, sizeof f0, NULL), ZS_OK);
  assert_int_equal(zs_pull(c, 1, b1, ZS_DTYPE_BF16, sizeof b1, NULL), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  /* The same piece through a held pool: the same bits, and not inline. */
  zs_request *req = NULL;
  zc_pool_hold(&c->pool, 1);
  assert_int_equal(zs_pull(c, 0, b0_pool, ZS_DTYPE_BF16, sizeof b0_pool, &req), ZS_OK);
  zc_pool_hold(&c->pool, 0);
  assert_int_equal(zs_wait(req), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  assert_memory_equal(b0, b0_pool, sizeof b0);
  /* Pushes: a lone one inline, a batch call (even of one) through the pool. */
  assert_int_equal(zs_push(c, 0, 0, g0, ZS_DTYPE_FP32, sizeof g0, NULL), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 2);
  uint32_t t2 = 2;
  size_t nb2 = sizeof g2;
  const void *grads[1] = {g2};
  assert_int_equal(zs_push_many(c, 1, &t2, 0, grads, ZS_DTYPE_FP32, &nb2, NULL), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 2);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

typedef struct seen {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int calls, status;
  pthread_t thread;
  char msg[512];
} seen;

#define SEEN_INIT                                                                                  \
  { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER }

static void on_done(void *arg, int status) {
  seen *s = arg;
  pthread_mutex_lock(&s->mu);
  s->calls++;
  s->status = status;
  s->thread = pthread_self();
  snprintf(s->msg, sizeof s->msg, "%s", status != ZS_OK ? zs_last_error() : "");
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void wait_seen(seen *s) {
  pthread_mutex_lock(&s->mu);
  while (s->calls == 0)
    pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

static void an_inline_transfers_callback_runs_once_on_a_library_thread(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 3);
  uint16_t b0[7];
  seen s = SEEN_INIT;
  uint64_t n = zc_dp_inline_submits(c);
  assert_int_equal(zs_pull_cb(c, 0, b0, ZS_DTYPE_BF16, sizeof b0, on_done, &s), ZS_OK);
  wait_seen(&s);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  assert_int_equal(s.status, ZS_OK);
  assert_false(pthread_equal(s.thread, pthread_self()));
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(s.calls, 1);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* The shard of tensor 0 is gone: the call that starts the pull succeeds,
 * and the failure comes to the callback, on a library thread, with the
 * sentence naming the shard. */
static void an_inline_transfer_that_fails_tells_its_callback_not_the_call(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 0);
  uint32_t shard = shard_of(c, 0);
  assert_int_equal(hs_stop(cl.srv[shard]), 0);
  cl.srv[shard] = NULL;
  uint16_t b0[7];
  seen s = SEEN_INIT;
  uint64_t n = zc_dp_inline_submits(c);
  assert_int_equal(zs_pull_cb(c, 0, b0, ZS_DTYPE_BF16, sizeof b0, on_done, &s), ZS_OK);
  wait_seen(&s);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  assert_int_equal(s.status, ZS_ECONN);
  assert_false(pthread_equal(s.thread, pthread_self()));
  fprintf(stderr, "callback saw: %s\n", s.msg);
  assert_non_null(strstr(s.msg, "shard"));
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(s.calls, 1);
  assert_int_equal(hs_cluster_stop(&cl), 0); /* the other shard */
}

/* A pull on the wire to a shard that does not answer (stopped) when the
 * client closes: its callback runs once, before zs_client_close returns,
 * with the transfer cancelled (its deadline is seconds away). */
static void closing_the_client_ends_an_inline_transfer_in_flight(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 0);
  uint32_t shard = shard_of(c, 0);
  hs_signal(cl.srv[shard], SIGSTOP);
  uint16_t b0[7];
  seen s = SEEN_INIT;
  uint64_t n = zc_dp_inline_submits(c);
  assert_int_equal(zs_pull_cb(c, 0, b0, ZS_DTYPE_BF16, sizeof b0, on_done, &s), ZS_OK);
  assert_int_equal(zc_dp_inline_submits(c), n + 1);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(s.calls, 1);
  fprintf(stderr, "callback saw: %s (%s)\n", zs_err_name(s.status), s.msg);
  assert_int_equal(s.status, ZS_ECANCELED);
  hs_signal(cl.srv[shard], SIGCONT);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(only_isolated_one_piece_transfers_in_their_wire_dtype_skip_the_pool),
      cmocka_unit_test(an_inline_transfers_callback_runs_once_on_a_library_thread),
      cmocka_unit_test(an_inline_transfer_that_fails_tells_its_callback_not_the_call),
      cmocka_unit_test(closing_the_client_ends_an_inline_transfer_in_flight),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
