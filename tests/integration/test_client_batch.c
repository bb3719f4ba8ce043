/*
 * test_client_batch — the calls a framework binding needs, against real
 * zshard-server processes: the layout query (which shard holds which slice),
 * batch submission (zs_push_many / zs_pull_many: the same bits as one call per
 * tensor, a refused batch submits nothing), and the failure's sentence inside
 * a completion callback.
 *
 * The model is trained with plain SGD (lr 1, no momentum) and W = 1, so that
 * after one step every parameter is exactly init - grad: what a batch pushed
 * and pulled is checked element by element.
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

#define NT 5
#define SPLIT 64
static const uint64_t NUMEL[NT] = {300, 7, 64, 1, 129};

static zs_client *open_client(const hs_cluster *cl, uint32_t max_retries) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = SPLIT;
  o.max_retries = max_retries;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 200;
  o.rpc_timeout_ms = 5000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  g.weight_decay = 0;
  assert_int_equal(zs_add_group(c, &g, NULL), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  return c;
}

/* Tensor t's buffers: the initial weights and a gradient of exact values. */
static float init_value(uint32_t t, uint64_t i) {
  return (float)(t + 1) + (float)i / 8.0f;
}
static float grad_value(uint32_t t, uint64_t i) {
  return (float)((i % 5) + t) / 4.0f;
}

static void open_job(zs_client *c, float **w) {
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = malloc(NUMEL[t] * sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = init_value(t, i);
  }
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
}

static void free_bufs(float **b) {
  for (uint32_t t = 0; t < NT; t++)
    free(b[t]);
}

static void slices_cover_each_tensor_once(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 3);
  uint32_t n = 0;
  assert_int_equal(zs_tensor_slices(c, 0, &n), ZS_ENOTOPEN);
  float *w[NT];
  open_job(c, w);
  for (uint32_t t = 0; t < NT; t++) {
    assert_int_equal(zs_tensor_slices(c, t, &n), ZS_OK);
    /* At or above the threshold: one slice per shard; below: one. */
    assert_int_equal(n, NUMEL[t] >= SPLIT ? 2 : 1);
    uint64_t next = 0;
    for (uint32_t i = 0; i < n; i++) {
      uint32_t shard = 99;
      uint64_t off = 0, numel = 0;
      assert_int_equal(zs_tensor_slice(c, t, i, &shard, &off, &numel), ZS_OK);
      assert_true(shard < 2);
      if (n == 2)
        assert_int_equal(shard, i); /* slice j lives on shard j */
      assert_int_equal(off, next);
      assert_true(numel > 0);
      next = off + numel;
    }
    assert_int_equal(next, NUMEL[t]);
    assert_int_equal(zs_tensor_slice(c, t, n, NULL, NULL, NULL), ZS_ENOTFOUND);
    assert_non_null(strstr(zs_last_error(), "slice"));
  }
  assert_int_equal(zs_tensor_slices(c, NT, &n), ZS_ENOTFOUND);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* One step through the batch calls (with requests, then synchronous): every
 * parameter is init - grad, bit for bit. */
static void batches_push_and_pull_every_tensor(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 3);
  float *w[NT], *g[NT], *p[NT];
  open_job(c, w);
  uint32_t tensors[NT];
  size_t nbytes[NT];
  for (uint32_t t = 0; t < NT; t++) {
    tensors[t] = t;
    nbytes[t] = NUMEL[t] * sizeof(float);
    g[t] = malloc(nbytes[t]);
    p[t] = calloc(NUMEL[t], sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      g[t][i] = grad_value(t, i);
  }
  /* Version 0 through a batch with requests. */
  zs_request *reqs[NT];
  assert_int_equal(zs_pull_many(c, NT, tensors, (void *const *)p, ZS_DTYPE_FP32, nbytes, reqs),
                   ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    assert_non_null(reqs[t]);
    assert_int_equal(zs_wait(reqs[t]), ZS_OK);
    assert_memory_equal(p[t], w[t], nbytes[t]);
  }
  assert_int_equal(
      zs_push_many(c, NT, tensors, 0, (const void *const *)g, ZS_DTYPE_FP32, nbytes, reqs), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_wait(reqs[t]), ZS_OK);
  zs_step_result r;
  zs_step_result_init(&r);
  assert_int_equal(zs_step(c, 1.0, 0, 0, &r), ZS_OK);
  /* Version 1, synchronously. */
  assert_int_equal(zs_pull_many(c, NT, tensors, (void *const *)p, ZS_DTYPE_FP32, nbytes, NULL),
                   ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      assert_true(p[t][i] == w[t][i] - g[t][i]);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
  free_bufs(g);
  free_bufs(p);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* A batch with one bad entry, or one tensor twice, submits nothing: the same
 * tensors can then be pushed, once each. */
static void a_refused_batch_submits_nothing(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 3);
  float *w[NT];
  open_job(c, w);
  uint32_t tensors[3] = {0, 1, 2};
  size_t nbytes[3] = {NUMEL[0] * 4, NUMEL[1] * 4, NUMEL[2] * 4 - 4};
  const void *bufs[3] = {w[0], w[1], w[2]};
  zs_request *reqs[3] = {(zs_request *)1, (zs_request *)1, (zs_request *)1};
  assert_int_equal(zs_push_many(c, 3, tensors, 0, bufs, ZS_DTYPE_FP32, nbytes, reqs), ZS_ESIZE);
  assert_non_null(strstr(zs_last_error(), "entry 2"));
  for (int i = 0; i < 3; i++)
    assert_null(reqs[i]);
  nbytes[2] = NUMEL[0] * 4;
  tensors[2] = 0;
  bufs[2] = w[0];
  assert_int_equal(zs_push_many(c, 3, tensors, 0, bufs, ZS_DTYPE_FP32, nbytes, NULL), ZS_EEXIST);
  assert_non_null(strstr(zs_last_error(), "twice"));
  /* Nothing of either batch was pushed. */
  tensors[2] = 2;
  nbytes[2] = NUMEL[2] * 4;
  bufs[2] = w[2];
  assert_int_equal(zs_push_many(c, 3, tensors, 0, bufs, ZS_DTYPE_FP32, nbytes, NULL), ZS_OK);
  assert_int_equal(zs_push(c, 0, 0, w[0], ZS_DTYPE_FP32, NUMEL[0] * 4, NULL), ZS_EEXIST);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

typedef struct cb_seen {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
  char msg[512];
} cb_seen;

static void on_done(void *arg, int status) {
  cb_seen *s = arg;
  pthread_mutex_lock(&s->mu);
  s->status = status;
  snprintf(s->msg, sizeof s->msg, "%s", status != ZS_OK ? zs_last_error() : "");
  s->done = 1;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* A pull that fails after it was submitted (its shard is gone) tells the
 * callback why, through zs_last_error. */
static void a_callback_reads_the_failure_sentence(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 1);
  float *w[NT];
  open_job(c, w);
  assert_int_equal(hs_stop(cl.srv[1]), 0);
  cl.srv[1] = NULL;
  cb_seen s = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  /* Tensor 0 is split: its second slice is on the stopped shard 1. */
  assert_int_equal(zs_pull_cb(c, 0, w[0], ZS_DTYPE_FP32, NUMEL[0] * 4, on_done, &s), ZS_OK);
  pthread_mutex_lock(&s.mu);
  while (!s.done)
    pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  assert_int_not_equal(s.status, ZS_OK);
  fprintf(stderr, "callback saw: %s (%s)\n", zs_err_name(s.status), s.msg);
  assert_true(strlen(s.msg) > 0);
  assert_string_not_equal(s.msg, zs_strerror(s.status)); /* a sentence, not the code's name */
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
  cl.n = 1;
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(slices_cover_each_tensor_once),
      cmocka_unit_test(batches_push_and_pull_every_tensor),
      cmocka_unit_test(a_refused_batch_submits_nothing),
      cmocka_unit_test(a_callback_reads_the_failure_sentence),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
