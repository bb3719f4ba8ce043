/*
 * service: the request checks both transports rely on, and the observer.
 * Every refusal is checked for its status, its sentence and that it changed
 * nothing (no contribution counted or missing less, no version, no client
 * state, nothing told to the observer). The observer is checked to hear of
 * each accepted contribution exactly once, duplicates and retries never, and
 * of each applied step exactly once however many trainers asked for it.
 *
 * Shard 0 of a two-shard job runs in process; shard 1 only exists so that
 * some pieces belong to another shard.
 *
 * cmocka's assertions only run on the test's thread; the observer and the core
 * callbacks record what they saw and the test thread checks it.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "server/core/core.h"
#include "server/service/service.h"

#define W 2u
#define M 2u
#define WM (W * M)
#define STEPS 3u
#define MAX_PIECES 8u
/* Long enough never to fire on a healthy run, short enough that a lost
 * wake-up shows up as ZS_ETIMEDOUT instead of a hang. */
#define TEST_WAIT_MS 30000u

/* ------------------------------------------------------------------ observer */

typedef struct observed {
  pthread_mutex_t mu;
  uint64_t seq; /* events seen by the observer and the apply callbacks */
  /* [step][local piece][k]: contribution reports. */
  uint32_t contrib[STEPS + 1][MAX_PIECES][WM];
  uint32_t contrib_total;
  uint32_t contrib_bad; /* reports the test cannot place, or without data */
  uint32_t applied[STEPS + 1];
  uint32_t applied_total;
  uint64_t applied_seq[STEPS + 1]; /* seq of each step's applied report */
  int applied_skipped[STEPS + 1];
  int applied_on_caller; /* the applied hook ran on the test's thread */
} observed;

typedef struct fixture {
  spec spec;
  layout layout;
  uint64_t hash;
  core *core;
  service *svc;
  observed obs;
  pthread_t test_thread;
  const layout_piece *mine[MAX_PIECES]; /* shard 0's pieces */
  uint32_t nmine;
  const layout_piece *foreign; /* one of shard 1's */
  float *zeros;                /* large enough for any piece in any dtype */
} fixture;

static fixture fx;

static int local_index(uint32_t tensor, uint32_t slice) {
  for (uint32_t i = 0; i < fx.nmine; i++)
    if (fx.mine[i]->tensor == tensor && fx.mine[i]->slice == slice)
      return (int)i;
  return -1;
}

static void on_contribution(void *arg, const core_push_args *a) {
  observed *o = arg;
  int i = local_index(a->tensor, a->slice);
  uint32_t k = a->micro * W + a->rank;
  pthread_mutex_lock(&o->mu);
  o->seq++;
  o->contrib_total++;
  if (i < 0 || a->step == 0 || a->step > STEPS || k >= WM || !a->data)
    o->contrib_bad++;
  else
    o->contrib[a->step][i][k]++;
  pthread_mutex_unlock(&o->mu);
}

static void on_applied(void *arg, const core_apply_result *r) {
  observed *o = arg;
  pthread_mutex_lock(&o->mu);
  o->seq++;
  o->applied_total++;
  if (r->step >= 1 && r->step <= STEPS) {
    o->applied[r->step]++;
    o->applied_seq[r->step] = o->seq;
    o->applied_skipped[r->step] = r->skipped;
  }
  if (pthread_equal(pthread_self(), fx.test_thread))
    o->applied_on_caller = 1;
  pthread_mutex_unlock(&o->mu);
}

/* ------------------------------------------------------------------ job */

static void build_job(void) {
  memset(&fx, 0, sizeof fx);
  fx.test_thread = pthread_self();
  pthread_mutex_init(&fx.obs.mu, NULL);
  spec *s = &fx.spec;
  s->job = strdup("service-test");
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  static const struct {
    const char *name;
    uint64_t numel;
  } defs[] = {{"w0", 300}, {"b0", 7}, {"w1", 150}, {"b1", 5}};
  s->num_tensors = 4;
  s->tensors = calloc(4, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < 4; t++) {
    s->tensors[t].name = strdup(defs[t].name);
    s->tensors[t].numel = defs[t].numel;
  }
  s->world_size = W;
  s->grad_accum = M;
  s->num_shards = 2;
  s->split_threshold = 64;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256] = "";
  assert_int_equal(spec_validate(s, err, sizeof err), 0);
  fx.hash = spec_hash(s);
  assert_int_equal(layout_build(s, &fx.layout), 0);
  for (uint32_t i = 0; i < fx.layout.num_pieces; i++) {
    const layout_piece *p = &fx.layout.pieces[i];
    if (p->shard == 0) {
      assert_true(fx.nmine < MAX_PIECES);
      fx.mine[fx.nmine++] = p;
    } else if (!fx.foreign) {
      fx.foreign = p;
    }
  }
  assert_true(fx.nmine >= 2);
  assert_non_null(fx.foreign);
  fx.zeros = calloc(400, sizeof(float));
  assert_non_null(fx.zeros);
}

static int setup(void **state) {
  (void)state;
  build_job();
  core_config cfg = {.shard_id = 0, .num_shards = 2, .threads = 2};
  assert_int_equal(core_create(&cfg, &fx.core), 0);
  service_observer obs = {.contribution = on_contribution, .applied = on_applied, .arg = &fx.obs};
  assert_int_equal(service_create(fx.core, &obs, &fx.svc), 0);
  assert_ptr_equal(service_core(fx.svc), fx.core);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  service_destroy(fx.svc);
  core_destroy(fx.core);
  layout_free(&fx.layout);
  spec_free(&fx.spec);
  free(fx.zeros);
  pthread_mutex_destroy(&fx.obs.mu);
  return 0;
}

static void open_job(void) {
  core_open_result r;
  char err[256] = "";
  assert_int_equal(service_open(fx.svc, &fx.spec, 0, &r, err, sizeof err), 0);
  assert_int_equal(r.spec_hash, fx.hash);
}

static void init_all(void) {
  for (uint32_t i = 0; i < fx.nmine; i++) {
    const layout_piece *p = fx.mine[i];
    int written = 0;
    uint64_t version = 0;
    char err[256] = "";
    assert_int_equal(service_init_params(fx.svc, fx.hash, p->tensor, p->slice, 0, fx.zeros,
                                         p->numel * sizeof(float), &written, &version, err,
                                         sizeof err),
                     0);
    assert_int_equal(written, 1);
  }
}

/* A well-formed fp32 push of piece p by contribution k for `step`. */
static core_push_args push_of(const layout_piece *p, uint64_t step, uint32_t k) {
  return (core_push_args){.hash = fx.hash,
                          .step = step,
                          .rank = k % W,
                          .micro = k / W,
                          .tensor = p->tensor,
                          .slice = p->slice,
                          .dtype = ZS_DTYPE_FP32,
                          .data = fx.zeros,
                          .nbytes = (size_t)p->numel * sizeof(float)};
}

static uint32_t contrib_total(void) {
  pthread_mutex_lock(&fx.obs.mu);
  uint32_t n = fx.obs.contrib_total;
  pthread_mutex_unlock(&fx.obs.mu);
  return n;
}

/* ------------------------------------------------------------------ waits */

typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
  uint64_t seq; /* the observer's seq when the callback ran */
  core_stats_result stats;
  core_apply_result apply;
} waiter;

static void waiter_init(waiter *w) {
  memset(w, 0, sizeof *w);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
}

static void waiter_fire(waiter *w, int status) {
  pthread_mutex_lock(&fx.obs.mu);
  uint64_t seq = ++fx.obs.seq;
  pthread_mutex_unlock(&fx.obs.mu);
  pthread_mutex_lock(&w->mu);
  w->status = status;
  w->seq = seq;
  w->done = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static void waiter_wait(waiter *w) {
  pthread_mutex_lock(&w->mu);
  while (!w->done)
    pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
}

static void on_stats(void *arg, int status, const core_stats_result *r) {
  waiter *w = arg;
  w->stats = *r;
  waiter_fire(w, status);
}

static void on_apply(void *arg, int status, const core_apply_result *r) {
  waiter *w = arg;
  w->apply = *r;
  waiter_fire(w, status);
}

/* Waits until the statistics of `step` are there (the apply needs them). */
static void wait_stats(uint64_t step) {
  waiter w;
  waiter_init(&w);
  char err[256] = "";
  int rc = service_grad_stats(fx.svc, fx.hash, step, 0, clock_now_ms() + TEST_WAIT_MS, on_stats, &w,
                              &w.stats, err, sizeof err);
  if (rc == CORE_PENDING) {
    waiter_wait(&w);
    rc = w.status;
  }
  assert_int_equal(rc, 0);
  assert_int_equal(w.stats.step, step);
}

static void assert_has(const char *err, const char *part) {
  if (!strstr(err, part))
    fail_msg("sentence \"%s\" does not mention \"%s\"", err, part);
}

/* ------------------------------------------------------------------ checks */

static void open_refuses_a_rank_beyond_the_world_size_and_opens_nothing(void **state) {
  (void)state;
  core_open_result r;
  char err[256] = "";
  assert_int_equal(service_open(fx.svc, &fx.spec, W, &r, err, sizeof err), ZS_EINVAL);
  assert_string_equal(err, "rank 2 is not below the world size 2");
  assert_int_equal(service_open(fx.svc, NULL, 0, &r, err, sizeof err), ZS_EINVAL);
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 0);
  assert_int_equal(service_open(fx.svc, &fx.spec, W - 1, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 1);
}

static void init_params_refuses_a_partial_float_and_writes_nothing(void **state) {
  (void)state;
  open_job();
  const layout_piece *p = fx.mine[0];
  float ones[400];
  for (int i = 0; i < 400; i++)
    ones[i] = 1.0f;
  int written = -1;
  uint64_t version = 9;
  char err[256] = "";
  assert_int_equal(service_init_params(fx.svc, fx.hash, p->tensor, p->slice, 0, ones,
                                       p->numel * sizeof(float) - 2, &written, &version, err,
                                       sizeof err),
                   ZS_ESIZE);
  char want[128];
  snprintf(want, sizeof want, "InitParams data of %zu bytes is not a whole number of float32",
           (size_t)p->numel * sizeof(float) - 2);
  assert_string_equal(err, want);
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.initialized, 0);
  /* Different data from the refused call is taken whole: nothing of the
   * refused call was written (else this would be ZS_EEXIST). */
  assert_int_equal(service_init_params(fx.svc, fx.hash, p->tensor, p->slice, 0, fx.zeros,
                                       p->numel * sizeof(float), &written, &version, err,
                                       sizeof err),
                   0);
  assert_int_equal(written, 1);
}

typedef struct push_case {
  const char *name;
  core_push_args a;
  int status;
  const char *says;
  int header_refused; /* service_push_check refuses it before the payload */
} push_case;

static void refused_pushes_get_their_status_and_sentence_and_change_nothing(void **state) {
  (void)state;
  open_job();
  init_all();
  const layout_piece *p = fx.mine[0];
  core_push_args ok = push_of(p, 1, 0);
  push_case cases[16];
  size_t n = 0;
  cases[n] = (push_case){"hash", ok, ZS_EHASH, "is not the hash of this shard's job", 1};
  cases[n++].a.hash ^= 1;
  cases[n] = (push_case){"step 0", ok, ZS_ESTEP, "expects step 1", 0};
  cases[n++].a.step = 0;
  cases[n] = (push_case){"step 2", ok, ZS_ESTEP, "push for step 2", 0};
  cases[n++].a.step = 2;
  cases[n] = (push_case){"rank", ok, ZS_ERANGE, "rank 2 / micro-batch 0 out of range", 0};
  cases[n++].a.rank = W;
  cases[n] = (push_case){"micro", ok, ZS_ERANGE, "micro-batch 2 out of range", 0};
  cases[n++].a.micro = M;
  cases[n] = (push_case){"tensor", ok, ZS_ENOTFOUND, "the job has 4 tensors", 1};
  cases[n++].a.tensor = 4;
  cases[n] = (push_case){"slice", ok, ZS_ENOTFOUND, "has no slice 9", 1};
  cases[n++].a.slice = 9;
  cases[n] = (push_case){"foreign", ok, ZS_ENOTFOUND, "owned by shard 1", 1};
  cases[n].a.tensor = fx.foreign->tensor;
  cases[n].a.slice = fx.foreign->slice;
  cases[n++].a.nbytes = (size_t)fx.foreign->numel * sizeof(float);
  cases[n] = (push_case){"dtype", ok, ZS_EDTYPE, "dtype 0 is not", 1};
  cases[n++].a.dtype = (zs_dtype)0;
  cases[n] = (push_case){"size", ok, ZS_ESIZE, "expected", 1};
  cases[n++].a.nbytes -= 4;
  cases[n] = (push_case){"dtype and size", ok, ZS_ESIZE, "expected", 1};
  cases[n++].a.dtype = ZS_DTYPE_BF16; /* fp32's length is twice bf16's */

  uint32_t missing = core_missing(fx.core, 1, NULL, 0);
  assert_int_equal(missing, fx.nmine * WM);
  core_counters before;
  core_get_counters(fx.core, &before);
  for (size_t i = 0; i < n; i++) {
    char err[256] = "";
    int dup = -1;
    int rc = service_push(fx.svc, &cases[i].a, &dup, err, sizeof err);
    if (rc != cases[i].status)
      fail_msg("%s: status %d, expected %d (%s)", cases[i].name, rc, cases[i].status, err);
    assert_int_equal(dup, 0);
    assert_has(err, cases[i].says);
    /* The check a transport makes on a header alone gives the same answer,
     * or defers the ones that depend on more than the header to the push. */
    char herr[256] = "";
    rc = service_push_check(fx.svc, &cases[i].a, herr, sizeof herr);
    if (cases[i].header_refused) {
      assert_int_equal(rc, cases[i].status);
      assert_string_equal(herr, err);
    } else {
      assert_int_equal(rc, 0);
    }
  }
  char err[256] = "";
  assert_int_equal(service_push_check(fx.svc, &ok, err, sizeof err), 0);
  assert_int_equal(core_missing(fx.core, 1, NULL, 0), missing);
  core_counters after;
  core_get_counters(fx.core, &after);
  assert_int_equal(after.pushes, before.pushes);
  assert_int_equal(after.version, 0);
  assert_int_equal(contrib_total(), 0);
}

static void piece_sizes_carry_the_cores_sentence(void **state) {
  (void)state;
  const layout_piece *p = fx.mine[0];
  char err[256] = "";
  assert_int_equal(
      service_piece_bytes(fx.svc, fx.hash, p->tensor, p->slice, ZS_DTYPE_BF16, err, sizeof err),
      ZS_ENOTOPEN);
  assert_has(err, "no job is open on shard 0");
  open_job();
  assert_int_equal(
      service_piece_bytes(fx.svc, fx.hash, p->tensor, p->slice, ZS_DTYPE_BF16, err, sizeof err),
      (int64_t)p->numel * 2);
  assert_int_equal(
      service_piece_bytes(fx.svc, fx.hash, p->tensor, p->slice, ZS_DTYPE_FP32, err, sizeof err),
      (int64_t)p->numel * 4);
  assert_int_equal(
      service_piece_bytes(fx.svc, fx.hash ^ 2, p->tensor, p->slice, ZS_DTYPE_FP32, err, sizeof err),
      ZS_EHASH);
  assert_has(err, "is not the hash of this shard's job");
  assert_int_equal(service_piece_bytes(fx.svc, fx.hash, fx.foreign->tensor, fx.foreign->slice,
                                       ZS_DTYPE_FP32, err, sizeof err),
                   ZS_ENOTFOUND);
  char want[128];
  snprintf(want, sizeof want,
           "no piece (tensor %u, slice %u) on this shard: it is owned by shard 1",
           fx.foreign->tensor, fx.foreign->slice);
  assert_has(err, want);
  assert_int_equal(
      service_piece_bytes(fx.svc, fx.hash, p->tensor, p->slice, (zs_dtype)7, err, sizeof err),
      ZS_EDTYPE);
  assert_has(err, "dtype 7 is not FP32, FP16, BF16 or INT8_BLOCK");

  /* In a batch, the sentence names the piece's place. */
  assert_int_equal(service_batch_piece_bytes(fx.svc, fx.hash, 3, fx.foreign->tensor,
                                             fx.foreign->slice, ZS_DTYPE_FP32, 4, err, sizeof err),
                   ZS_ENOTFOUND);
  assert_has(err, "piece 3 of the batch: no piece (tensor");
  assert_int_equal(service_batch_piece_bytes(fx.svc, fx.hash, 1, p->tensor, p->slice, ZS_DTYPE_FP32,
                                             7, err, sizeof err),
                   ZS_EINVAL);
  snprintf(want, sizeof want, "piece 1 of the batch (tensor %u, slice %u) has %u bytes", p->tensor,
           p->slice, (unsigned)(p->numel * 4));
  assert_has(err, want);
  assert_has(err, "not the 7 asked for");
  assert_int_equal(service_batch_piece_bytes(fx.svc, fx.hash, 0, p->tensor, p->slice, ZS_DTYPE_FP16,
                                             p->numel * 2, err, sizeof err),
                   (int64_t)p->numel * 2);
}

static void refused_applies_record_no_client_state_and_apply_nothing(void **state) {
  (void)state;
  open_job();
  init_all();
  for (uint32_t i = 0; i < fx.nmine; i++)
    for (uint32_t k = 0; k < WM; k++) {
      core_push_args a = push_of(fx.mine[i], 1, k);
      assert_int_equal(service_push(fx.svc, &a, NULL, NULL, 0), 0);
    }
  wait_stats(1);
  static const unsigned char cs[4] = {1, 2, 3, 4};
  static unsigned char big[CORE_MAX_CLIENT_STATE + 1];
  const struct {
    double lr;
    float coef;
    const void *cs;
    size_t len;
    int status;
    const char *says;
  } cases[] = {
      {NAN, 1.0f, cs, sizeof cs, ZS_EINVAL, "Apply needs a finite lr >= 0 and a finite coef"},
      {-0.5, 1.0f, cs, sizeof cs, ZS_EINVAL, "(lr=-0.5 coef=1)"},
      {0.1, INFINITY, cs, sizeof cs, ZS_EINVAL, "range (lr=0.1 coef=inf)"},
      {0.1, 1.0f, big, sizeof big, ZS_ESIZE, "client_state of step 1 has 1025 bytes"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    waiter w;
    waiter_init(&w);
    char err[256] = "";
    int rc = service_apply(fx.svc, fx.hash, 1, cases[i].lr, cases[i].coef, 0, cases[i].cs,
                           cases[i].len, on_apply, &w, &w.apply, err, sizeof err);
    assert_int_equal(rc, cases[i].status);
    assert_has(err, cases[i].says);
    assert_int_equal(w.done, 0);
  }
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.version, 0);
  /* An apply with no client state leaves the previous version's (none) in
   * place: so none of the refused ones was recorded. */
  waiter w;
  waiter_init(&w);
  char err[256] = "";
  int rc = service_apply(fx.svc, fx.hash, 1, 0.1, 1.0f, 0, NULL, 0, on_apply, &w, &w.apply, err,
                         sizeof err);
  assert_int_equal(rc, CORE_PENDING);
  waiter_wait(&w);
  assert_int_equal(w.status, 0);
  unsigned char got[CORE_MAX_CLIENT_STATE];
  uint64_t v = 0;
  assert_int_equal(core_get_client_state(fx.core, got, sizeof got, &v), 0);
  assert_int_equal(v, 1);
  pthread_mutex_lock(&fx.obs.mu);
  assert_int_equal(fx.obs.applied_total, 1);
  pthread_mutex_unlock(&fx.obs.mu);
}

/* lr = 1e300 is a finite double, but the kernels see it as a
 * float, where it is infinite: every weight became -inf. Any lr, group lr or
 * derived scalar that is not a finite float32 is refused, nothing changes. */
static void applies_whose_scalars_overflow_a_float_are_refused_and_change_nothing(void **state) {
  (void)state;
  open_job();
  init_all();
  for (uint32_t i = 0; i < fx.nmine; i++)
    for (uint32_t k = 0; k < WM; k++) {
      core_push_args a = push_of(fx.mine[i], 1, k);
      assert_int_equal(service_push(fx.svc, &a, NULL, NULL, 0), 0);
    }
  wait_stats(1);
  const layout_piece *p = fx.mine[0];
  float before[400], after[400];
  char err[256] = "";
  assert_int_equal(core_read(fx.core, fx.hash, p->tensor, p->slice, ZS_DTYPE_FP32, before,
                             p->numel * sizeof(float), NULL, err, sizeof err),
                   0);
  const double huge_group[1] = {1e300};
  const struct {
    double lr;
    const double *glr;
    uint32_t nglr;
    const char *says;
  } cases[] = {
      {1e300, NULL, 0, "within float32's range (lr=1e+300"},
      {0.1, huge_group, 1, "group_lr[0] is 1e+300: each must be finite as a float32"},
      /* Finite as a float, but lr / (1 - beta1) is not. */
      {3e38, NULL, 0, "a lr / bias_correction1 that is not a finite float32"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    waiter w;
    waiter_init(&w);
    int rc = service_apply_groups(fx.svc, fx.hash, 1, cases[i].lr, cases[i].glr, cases[i].nglr,
                                  1.0f, 0, NULL, 0, on_apply, &w, &w.apply, err, sizeof err);
    assert_int_equal(rc, ZS_EINVAL);
    assert_has(err, cases[i].says);
    assert_int_equal(w.done, 0);
  }
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.version, 0);
  assert_int_equal(core_read(fx.core, fx.hash, p->tensor, p->slice, ZS_DTYPE_FP32, after,
                             p->numel * sizeof(float), NULL, err, sizeof err),
                   0);
  assert_memory_equal(before, after, p->numel * sizeof(float));
  /* The same step with a sane lr goes through: the refusals queued nothing. */
  waiter w;
  waiter_init(&w);
  assert_int_equal(service_apply(fx.svc, fx.hash, 1, 0.1, 1.0f, 0, NULL, 0, on_apply, &w, &w.apply,
                                 err, sizeof err),
                   CORE_PENDING);
  waiter_wait(&w);
  assert_int_equal(w.status, 0);
  assert_int_equal(core_read(fx.core, fx.hash, p->tensor, p->slice, ZS_DTYPE_FP32, after,
                             p->numel * sizeof(float), NULL, err, sizeof err),
                   0);
  for (uint64_t e = 0; e < p->numel; e++)
    assert_true(isfinite(after[e]));
}

/* The spec's hyper-parameters reach the kernels as floats too. */
static void open_refuses_hyper_parameters_that_are_not_finite_floats(void **state) {
  (void)state;
  const struct {
    double weight_decay, eps;
    const char *says;
  } cases[] = {
      {1e300, 1e-8, "param group 0: weight_decay 1e+300 is not finite as a float32"},
      {0.01, 1e-50, "param group 0: eps 1e-50 is 0 as a float32"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    spec s;
    assert_int_equal(spec_copy(&s, &fx.spec), 0);
    s.groups[0].weight_decay = cases[i].weight_decay;
    s.groups[0].eps = cases[i].eps;
    char err[256] = "";
    assert_int_equal(spec_validate(&s, err, sizeof err), 0);
    core_open_result r;
    assert_int_equal(service_open(fx.svc, &s, 0, &r, err, sizeof err), ZS_EINVAL);
    assert_string_equal(err, cases[i].says);
    spec_free(&s);
  }
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 0);
}

/* ------------------------------------------------------------------ limits */

static void put_file(const char *root, const char *path, const char *text) {
  char full[512], cmd[1100];
  snprintf(full, sizeof full, "%s%s", root, path);
  snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", full);
  assert_int_equal(system(cmd), 0);
  FILE *f = fopen(full, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* The default limits follow the smallest of MemTotal and the cgroup limits
 * (v2 at the root and at the process's own cgroup, v1), read under a fake
 * root. */
static void the_memory_limit_is_the_smallest_of_meminfo_and_the_cgroups(void **state) {
  (void)state;
  char root[] = "/tmp/zs-memlimit-XXXXXX";
  assert_non_null(mkdtemp(root));
  assert_int_equal(service_memory_limit(root), 0);
  put_file(root, "/proc/meminfo", "MemFree: 1 kB\nMemTotal:        1048576 kB\n");
  put_file(root, "/sys/fs/cgroup/memory.max", "max\n");
  assert_int_equal(service_memory_limit(root), UINT64_C(1) << 30);
  put_file(root, "/sys/fs/cgroup/memory.max", "536870912\n");
  assert_int_equal(service_memory_limit(root), UINT64_C(1) << 29);
  put_file(root, "/sys/fs/cgroup/memory.max", "max\n");
  put_file(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  assert_int_equal(service_memory_limit(root), UINT64_C(1) << 30);
  put_file(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "268435456\n");
  assert_int_equal(service_memory_limit(root), UINT64_C(1) << 28);
  put_file(root, "/proc/self/cgroup", "1:cpu:/\n0::/job.slice\n");
  put_file(root, "/sys/fs/cgroup/job.slice/memory.max", "134217728\n");
  assert_int_equal(service_memory_limit(root), UINT64_C(1) << 27);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  assert_int_equal(system(cmd), 0);

  service_limits l = service_limits_for_memory(UINT64_C(1) << 30);
  assert_int_equal(l.max_params, (UINT64_C(1) << 30) / 4 * 3 / SERVICE_PARAM_BYTES);
  assert_int_equal(l.max_tensors, (UINT64_C(1) << 30) / 16 / SERVICE_TENSOR_BYTES);
  l = service_limits_for_memory(UINT64_C(1) << 50);
  assert_int_equal(l.max_tensors, SPEC_MAX_TENSORS);
  l = service_limits_for_memory(0);
  assert_int_equal(l.max_params, 0);
  assert_int_equal(l.max_tensors, 0);
}

/* This shard's share is what counts: of a two-shard job it holds 240
 * elements (padded), and a limit of 239 refuses the job, 240 admits it. The
 * bookkeeping budget counts the W * M bitmap of every piece. */
static void open_checks_this_shards_share_against_the_limits(void **state) {
  (void)state;
  service_limits l = {.max_params = 239, .max_tensors = 0};
  service_set_limits(fx.svc, &l);
  core_open_result r;
  char err[300] = "";
  assert_int_equal(service_open(fx.svc, &fx.spec, 0, &r, err, sizeof err), ZS_ELIMIT);
  assert_string_equal(err, "job 'service-test' puts 240 parameters on shard 0, more than its "
                           "limit of 239 (--max-params, ZSHARD_MAX_PARAMS); nothing was opened");
  l.max_tensors = 3;
  service_set_limits(fx.svc, &l);
  assert_int_equal(service_open(fx.svc, &fx.spec, 0, &r, err, sizeof err), ZS_ELIMIT);
  assert_has(err, "has 4 tensors, more than this shard's limit of 3 (--max-tensors");
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 0);
  l = (service_limits){.max_params = 240, .max_tensors = 4};
  service_set_limits(fx.svc, &l);
  assert_int_equal(service_open(fx.svc, &fx.spec, 0, &r, err, sizeof err), 0);
  assert_int_equal(service_get_limits(fx.svc).max_params, 240);
  /* A join of the job the shard holds is not measured again. */
  l.max_params = 1;
  service_set_limits(fx.svc, &l);
  assert_int_equal(service_open(fx.svc, &fx.spec, 1, &r, err, sizeof err), 0);
}

static void grad_stats_asks_the_core_about_acknowledged_pushes_first(void **state) {
  (void)state;
  open_job();
  init_all();
  waiter w;
  waiter_init(&w);
  char err[256] = "";
  /* Rank 1 says every push of it was acknowledged, but this shard has none
   * and never restarted: that cannot be, and nothing waits. */
  int rc = service_grad_stats(fx.svc, fx.hash, 1, 2, clock_now_ms() + TEST_WAIT_MS, on_stats, &w,
                              &w.stats, err, sizeof err);
  assert_int_equal(rc, ZS_EINTERNAL);
  assert_int_equal(w.done, 0);
  core_counters k;
  core_get_counters(fx.core, &k);
  assert_int_equal(k.waiting_stats, 0);
  /* Without the claim the request waits as usual; an expired deadline ends
   * it at once. */
  rc = service_grad_stats(fx.svc, fx.hash, 1, 0, 1, on_stats, &w, &w.stats, err, sizeof err);
  assert_int_equal(rc, ZS_ETIMEDOUT);
}

/* The open mode, the close's job name and the group learning rates are
 * checked before the core is asked: a refusal opens, closes and applies
 * nothing. */
static void job_life_requests_are_checked_and_refusals_change_nothing(void **state) {
  (void)state;
  core_open_result r;
  char err[256] = "";
  assert_int_equal(service_open_mode(fx.svc, &fx.spec, 0, 7, &r, err, sizeof err), ZS_EINVAL);
  assert_has(err, "open mode 7");
  assert_int_equal(service_open_mode(fx.svc, &fx.spec, W, CORE_OPEN_CREATE, &r, err, sizeof err),
                   ZS_EINVAL);
  assert_int_equal(service_open_mode(fx.svc, &fx.spec, 0, CORE_OPEN_RESUME, &r, err, sizeof err),
                   ZS_ENOTOPEN);
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 0);
  assert_int_equal(service_open_mode(fx.svc, &fx.spec, 0, CORE_OPEN_CREATE, &r, err, sizeof err),
                   0);
  assert_int_equal(r.created, 1);
  init_all();
  for (uint32_t i = 0; i < fx.nmine; i++)
    for (uint32_t k = 0; k < WM; k++) {
      core_push_args a = push_of(fx.mine[i], 1, k);
      assert_int_equal(service_push(fx.svc, &a, NULL, NULL, 0), 0);
    }
  wait_stats(1);
  const double nan_lr[1] = {NAN};
  waiter w;
  waiter_init(&w);
  assert_int_equal(service_apply_groups(fx.svc, fx.hash, 1, 0.1, nan_lr, 1, 1.0f, 0, NULL, 0,
                                        on_apply, &w, &w.apply, err, sizeof err),
                   ZS_EINVAL);
  assert_has(err, "group_lr[0] is nan");
  const double two[2] = {0.1, 0.1};
  assert_int_equal(service_apply_groups(fx.svc, fx.hash, 1, 0.1, two, 2, 1.0f, 0, NULL, 0, on_apply,
                                        &w, &w.apply, err, sizeof err),
                   ZS_EINVAL);
  assert_has(err, "has 1 param groups");
  /* A step's hyper-parameters outside torch's ranges (beta1 of 1.5, a
   * negative dampening) are refused before the core sees them. */
  const double bad_beta[1] = {1.5}, bad_damp[1] = {-0.5};
  core_step_hparams hp = {0};
  hp.v[CORE_HP_BETA1] = bad_beta;
  hp.n[CORE_HP_BETA1] = 1;
  assert_int_equal(service_apply_step(fx.svc, fx.hash, 1, 0.1, NULL, 0, &hp, 1.0f, 0, NULL, 0,
                                      on_apply, &w, &w.apply, err, sizeof err),
                   ZS_EINVAL);
  assert_has(err, "group_beta1[0] is 1.5: it must be finite and in [0, 1)");
  hp.v[CORE_HP_BETA1] = NULL;
  hp.n[CORE_HP_BETA1] = 0;
  hp.v[CORE_HP_DAMPENING] = bad_damp;
  hp.n[CORE_HP_DAMPENING] = 1;
  assert_int_equal(service_apply_step(fx.svc, fx.hash, 1, 0.1, NULL, 0, &hp, 1.0f, 0, NULL, 0,
                                      on_apply, &w, &w.apply, err, sizeof err),
                   ZS_EINVAL);
  assert_has(err, "group_dampening[0] is -0.5");
  assert_int_equal(w.done, 0);
  core_get_info(fx.core, &info);
  assert_int_equal(info.version, 0);

  char long_name[SPEC_MAX_NAME + 2];
  memset(long_name, 'x', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = '\0';
  core_close_result cr;
  assert_int_equal(service_close(fx.svc, 0, long_name, &cr, err, sizeof err), ZS_EINVAL);
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 1);
  assert_int_equal(service_close(fx.svc, fx.hash, "service-test", &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 1);
  core_get_info(fx.core, &info);
  assert_int_equal(info.has_job, 0);
}

static void the_transports_sentences(void **state) {
  (void)state;
  char err[256] = "";
  assert_int_equal(service_too_large("piece", 100, 64, "frame", err, sizeof err), ZS_ERANGE);
  assert_string_equal(err, "piece of 100 bytes exceeds the 64-byte frame limit");
  assert_int_equal(service_pull_wait_failed(ZS_ETIMEDOUT, 5, 1, 0, err, sizeof err), ZS_ETIMEDOUT);
  assert_string_equal(err, "timed out waiting for version 5 of tensor 1 slice 0");
  assert_int_equal(service_pull_wait_failed(ZS_ECLOSED, 5, 1, 0, err, sizeof err), ZS_ECLOSED);
  assert_string_equal(err, zs_strerror(ZS_ECLOSED));
  assert_int_equal(service_pull_wait_failed(ZS_ETIMEDOUT, 5, 1, 0, NULL, 0), ZS_ETIMEDOUT);
  assert_int_equal(service_pull_wait_failed(ZS_ENOTOPEN, 5, 1, 0, err, sizeof err), ZS_ENOTOPEN);
  assert_string_equal(err, "the job was closed while this pull of tensor 1 slice 0 waited for "
                           "version 5 (no job is open on this shard now)");
}

/* ------------------------------------------------------------------ observer */

typedef struct pusher {
  uint32_t rank;
  uint64_t step;
  int failures;
} pusher;

/* Every contribution of one rank for one step, each pushed twice (the second
 * a duplicate), pieces in reverse order so that contributions arrive out of
 * turn and are held. */
static void *push_rank(void *arg) {
  pusher *p = arg;
  for (uint32_t m = M; m-- > 0;)
    for (uint32_t i = fx.nmine; i-- > 0;)
      for (int rep = 0; rep < 2; rep++) {
        core_push_args a = push_of(fx.mine[i], p->step, m * W + p->rank);
        int dup = -1;
        if (service_push(fx.svc, &a, &dup, NULL, 0) != 0 || dup != (rep == 1))
          p->failures++;
      }
  return NULL;
}

static void the_observer_hears_each_contribution_and_each_applied_step_once(void **state) {
  (void)state;
  open_job();
  init_all();
  for (uint64_t step = 1; step <= STEPS; step++) {
    /* One thread per rank, as trainers would push. */
    pthread_t th[W];
    pusher ps[W];
    for (uint32_t r = 0; r < W; r++) {
      ps[r] = (pusher){.rank = r, .step = step};
      assert_int_equal(pthread_create(&th[r], NULL, push_rank, &ps[r]), 0);
    }
    for (uint32_t r = 0; r < W; r++) {
      pthread_join(th[r], NULL);
      assert_int_equal(ps[r].failures, 0);
    }
    wait_stats(step);
    /* Every trainer asks for the apply; step 2 is skipped. */
    waiter w[W];
    int skip = step == 2;
    for (uint32_t r = 0; r < W; r++) {
      waiter_init(&w[r]);
      char err[256] = "";
      int rc = service_apply(fx.svc, fx.hash, step, 0.01, 1.0f, skip, NULL, 0, on_apply, &w[r],
                             &w[r].apply, err, sizeof err);
      if (rc == 0) /* the first apply finished before the second asked */
        w[r].done = 1;
      else
        assert_int_equal(rc, CORE_PENDING);
    }
    for (uint32_t r = 0; r < W; r++) {
      waiter_wait(&w[r]);
      assert_int_equal(w[r].status, 0);
      assert_int_equal(w[r].apply.step, step);
    }
    /* A retried push of the applied step is a duplicate and reported by
     * nobody; so is a repeat of the apply. */
    core_push_args again = push_of(fx.mine[0], step, 0);
    int dup = 0;
    assert_int_equal(service_push(fx.svc, &again, &dup, NULL, 0), 0);
    assert_int_equal(dup, 1);
    core_apply_result res;
    char err[256] = "";
    assert_int_equal(service_apply(fx.svc, fx.hash, step, 0.01, 1.0f, skip, NULL, 0, on_apply, NULL,
                                   &res, err, sizeof err),
                     0);
    assert_int_equal(res.version, step);

    pthread_mutex_lock(&fx.obs.mu);
    assert_int_equal(fx.obs.contrib_bad, 0);
    for (uint32_t i = 0; i < fx.nmine; i++)
      for (uint32_t k = 0; k < WM; k++)
        assert_int_equal(fx.obs.contrib[step][i][k], 1);
    assert_int_equal(fx.obs.contrib_total, step * fx.nmine * WM);
    assert_int_equal(fx.obs.applied[step], 1);
    assert_int_equal(fx.obs.applied_total, step);
    assert_int_equal(fx.obs.applied_skipped[step], skip);
    assert_int_equal(fx.obs.applied_on_caller, 0);
    /* Told before any trainer's Apply was answered. */
    for (uint32_t r = 0; r < W; r++)
      if (w[r].seq)
        assert_true(fx.obs.applied_seq[step] < w[r].seq);
    pthread_mutex_unlock(&fx.obs.mu);
  }
  core_info info;
  core_get_info(fx.core, &info);
  assert_int_equal(info.version, STEPS);
}

static void a_service_without_observer_tells_nobody_and_leaves_the_hook_alone(void **state) {
  (void)state;
  /* A transport's own service (no observer) beside the observed one: the
   * observed one keeps hearing of applied steps. */
  service *bare = NULL;
  assert_int_equal(service_create(fx.core, NULL, &bare), 0);
  open_job();
  init_all();
  for (uint32_t i = 0; i < fx.nmine; i++)
    for (uint32_t k = 0; k < WM; k++) {
      core_push_args a = push_of(fx.mine[i], 1, k);
      assert_int_equal(service_push(bare, &a, NULL, NULL, 0), 0);
    }
  assert_int_equal(contrib_total(), 0);
  service_destroy(bare);
  wait_stats(1);
  waiter w;
  waiter_init(&w);
  char err[256] = "";
  assert_int_equal(service_apply(fx.svc, fx.hash, 1, 0.01, 1.0f, 0, NULL, 0, on_apply, &w, &w.apply,
                                 err, sizeof err),
                   CORE_PENDING);
  waiter_wait(&w);
  pthread_mutex_lock(&fx.obs.mu);
  assert_int_equal(fx.obs.applied[1], 1);
  pthread_mutex_unlock(&fx.obs.mu);
  assert_int_equal(service_create(NULL, NULL, &bare), ZS_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(open_refuses_a_rank_beyond_the_world_size_and_opens_nothing,
                                      setup, teardown),
      cmocka_unit_test_setup_teardown(init_params_refuses_a_partial_float_and_writes_nothing, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          refused_pushes_get_their_status_and_sentence_and_change_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(piece_sizes_carry_the_cores_sentence, setup, teardown),
      cmocka_unit_test_setup_teardown(refused_applies_record_no_client_state_and_apply_nothing,
                                      setup, teardown),
      cmocka_unit_test_setup_teardown(
          applies_whose_scalars_overflow_a_float_are_refused_and_change_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(open_refuses_hyper_parameters_that_are_not_finite_floats,
                                      setup, teardown),
      cmocka_unit_test(the_memory_limit_is_the_smallest_of_meminfo_and_the_cgroups),
      cmocka_unit_test_setup_teardown(open_checks_this_shards_share_against_the_limits, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(grad_stats_asks_the_core_about_acknowledged_pushes_first,
                                      setup, teardown),
      cmocka_unit_test_setup_teardown(job_life_requests_are_checked_and_refusals_change_nothing,
                                      setup, teardown),
      cmocka_unit_test(the_transports_sentences),
      cmocka_unit_test_setup_teardown(
          the_observer_hears_each_contribution_and_each_applied_step_once, setup, teardown),
      cmocka_unit_test_setup_teardown(
          a_service_without_observer_tells_nobody_and_leaves_the_hook_alone, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
