/*
 * test_server — training through real zshard-server processes over gRPC must
 * give exactly what the same modules give in one process, whatever the order
 * and duplication of the pushes; bad requests must be refused with the right
 * status and change nothing.
 *
 * The reference is computed in-process with the modules the server uses:
 * contributions summed in (micro, rank) order with dtype_accumulate, then
 * optim_apply with the plan the core builds (gradient scale coef / W rounded
 * once to float, lr * lr_scale, step = optimizer steps so far).
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
#include <unistd.h>

#include <cmocka.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "server/optim/optim.h"
#include "tests/integration/harness.h"

#define LR 1e-2
#define PUSH_THREADS 4
#define MAX_T 16

/* ------------------------------------------------------------ data */

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A value in [-1, 1) fixed by its coordinates. */
static float coord_value(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t i) {
  uint64_t x = mix64(mix64(mix64(mix64(a) ^ b) ^ c) ^ (d << 32 ^ i));
  return (float)((double)(x >> 40) / (double)(1u << 23) - 1.0);
}

/* Ranks push in different dtypes, so the sum mixes all three. */
static zs_dtype rank_dtype(uint32_t rank) {
  static const zs_dtype d[3] = {ZS_DTYPE_FP32, ZS_DTYPE_BF16, ZS_DTYPE_FP16};
  return d[rank % 3];
}

static float **tensors_alloc(const spec *sp) {
  float **t = calloc(sp->num_tensors, sizeof *t);
  assert_non_null(t);
  for (uint32_t i = 0; i < sp->num_tensors; i++) {
    t[i] = calloc(sp->tensors[i].numel, sizeof(float));
    assert_non_null(t[i]);
  }
  return t;
}

static void tensors_free(const spec *sp, float **t) {
  if (!t)
    return;
  for (uint32_t i = 0; i < sp->num_tensors; i++)
    free(t[i]);
  free(t);
}

static float **initial_weights(const spec *sp) {
  float **w = tensors_alloc(sp);
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    for (uint64_t i = 0; i < sp->tensors[t].numel; i++)
      w[t][i] = 0.5f * coord_value(0, 0, 0, t, i);
  return w;
}

/* The gradients of one step: g[(rank * M + micro) * T + tensor] holds the
 * whole tensor in the rank's dtype. */
typedef struct grads {
  const spec *sp;
  void **g;
} grads;

static void grads_make(grads *gr, const spec *sp, uint64_t step) {
  uint32_t W = sp->world_size, M = sp->grad_accum, T = sp->num_tensors;
  gr->sp = sp;
  gr->g = calloc((size_t)W * M * T, sizeof *gr->g);
  assert_non_null(gr->g);
  for (uint32_t r = 0; r < W; r++)
    for (uint32_t m = 0; m < M; m++)
      for (uint32_t t = 0; t < T; t++) {
        uint64_t n = sp->tensors[t].numel;
        float *f = malloc(n * sizeof *f);
        void *out = malloc(n * zs_dtype_size(rank_dtype(r)));
        assert_non_null(f);
        assert_non_null(out);
        for (uint64_t i = 0; i < n; i++)
          f[i] = coord_value(step, r + 1, m + 1, t, i);
        dtype_from_f32(rank_dtype(r), f, out, n);
        free(f);
        gr->g[((size_t)r * M + m) * T + t] = out;
      }
}

static void *grad_of(const grads *gr, uint32_t rank, uint32_t micro, uint32_t tensor) {
  return gr->g[((size_t)rank * gr->sp->grad_accum + micro) * gr->sp->num_tensors + tensor];
}

/* Element i of a gradient, as a float (for planting inf / NaN). */
static void grad_set(grads *gr, uint32_t rank, uint32_t micro, uint32_t tensor, uint64_t i,
                     float v) {
  zs_dtype d = rank_dtype(rank);
  dtype_from_f32(d, &v, (char *)grad_of(gr, rank, micro, tensor) + i * zs_dtype_size(d), 1);
}

static void grads_free(grads *gr) {
  size_t n = (size_t)gr->sp->world_size * gr->sp->grad_accum * gr->sp->num_tensors;
  for (size_t i = 0; i < n; i++)
    free(gr->g[i]);
  free(gr->g);
  gr->g = NULL;
}

/* ------------------------------------------------------------ reference */

typedef struct ref {
  const spec *sp;
  float **master, **m, **v;
  uint64_t opt_steps;
} ref;

static void ref_init(ref *r, const spec *sp, float *const *weights) {
  r->sp = sp;
  r->master = tensors_alloc(sp);
  r->m = tensors_alloc(sp);
  r->v = tensors_alloc(sp);
  r->opt_steps = 0;
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    memcpy(r->master[t], weights[t], sp->tensors[t].numel * sizeof(float));
}

static void ref_free(ref *r) {
  tensors_free(r->sp, r->master);
  tensors_free(r->sp, r->m);
  tensors_free(r->sp, r->v);
}

/* The summed gradient: contributions added in (micro, rank) order. */
static float **ref_accumulate(const grads *gr) {
  const spec *sp = gr->sp;
  float **acc = tensors_alloc(sp);
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    for (uint32_t m = 0; m < sp->grad_accum; m++)
      for (uint32_t r = 0; r < sp->world_size; r++)
        dtype_accumulate(rank_dtype(r), grad_of(gr, r, m, t), acc[t], sp->tensors[t].numel);
  return acc;
}

static void ref_apply(ref *r, float **acc, double lr, float coef, int skip) {
  const spec *sp = r->sp;
  if (skip)
    return;
  r->opt_steps++;
  float grad_scale =
      sp->reduce == SPEC_REDUCE_MEAN ? (float)((double)coef / (double)sp->world_size) : coef;
  for (uint32_t t = 0; t < sp->num_tensors; t++) {
    const spec_group *g = &sp->groups[sp->tensors[t].group];
    optim_params p;
    memset(&p, 0, sizeof p);
    p.optimizer = g->optimizer;
    p.lr = lr * g->lr_scale;
    p.beta1 = g->beta1;
    p.beta2 = g->beta2;
    p.eps = g->eps;
    p.weight_decay = g->weight_decay;
    p.momentum = g->momentum;
    p.dampening = g->dampening;
    p.nesterov = g->nesterov;
    p.bias_correction = g->bias_correction;
    p.step = r->opt_steps;
    p.grad_scale = grad_scale;
    p.low_dtype = sp->param_dtype;
    optim_plan plan;
    optim_plan_init(&plan, &p);
    uint64_t n = sp->tensors[t].numel;
    uint16_t *low = malloc(n * sizeof *low);
    assert_non_null(low);
    optim_apply(&plan, r->master[t], r->m[t], r->v[t], acc[t], low, (size_t)n);
    free(low);
  }
}

/* ------------------------------------------------------------ pushing */

typedef struct push_op {
  uint32_t rank, micro, tensor, slice;
} push_op;

typedef struct pusher {
  hs_job *j;
  const grads *gr;
  uint64_t step;
  const push_op *ops;
  size_t nops;
  atomic_size_t next;
  atomic_int fresh, dups, errors;
  char first_error[512];
  pthread_mutex_t mu;
} pusher;

static int push_one(hs_job *j, const grads *gr, uint64_t step, const push_op *op, int *dup,
                    rpc_status *st) {
  const layout_piece *p = layout_find(&j->lay, op->tensor, op->slice);
  zs_dtype d = rank_dtype(op->rank);
  size_t es = zs_dtype_size(d);
  const char *data = (const char *)grad_of(gr, op->rank, op->micro, op->tensor) + p->offset * es;
  return hs_push(j->ch[p->shard], j->hash, step, op->rank, op->micro, op->tensor, op->slice, d,
                 data, (size_t)p->numel * es, dup, st);
}

static void *push_main(void *arg) {
  pusher *ps = arg;
  for (;;) {
    size_t i = atomic_fetch_add(&ps->next, 1);
    if (i >= ps->nops)
      break;
    int dup = 0;
    rpc_status st;
    if (push_one(ps->j, ps->gr, ps->step, &ps->ops[i], &dup, &st) != 0) {
      pthread_mutex_lock(&ps->mu);
      if (atomic_fetch_add(&ps->errors, 1) == 0)
        snprintf(ps->first_error, sizeof ps->first_error, "%s", st.message);
      pthread_mutex_unlock(&ps->mu);
    } else if (dup) {
      atomic_fetch_add(&ps->dups, 1);
    } else {
      atomic_fetch_add(&ps->fresh, 1);
    }
  }
  return NULL;
}

/* Every contribution of the step except those `leave_out` names, with every
 * third one repeated, in an order shuffled by `seed`; returns the count. */
static size_t build_ops(const hs_job *j, uint64_t seed, int (*leave_out)(const push_op *),
                        push_op **out, size_t *unique) {
  const spec *sp = &j->sp;
  size_t cap = (size_t)sp->world_size * sp->grad_accum * j->lay.num_pieces * 2;
  push_op *ops = malloc(cap * sizeof *ops);
  assert_non_null(ops);
  size_t n = 0;
  for (uint32_t r = 0; r < sp->world_size; r++)
    for (uint32_t m = 0; m < sp->grad_accum; m++)
      for (uint32_t i = 0; i < j->lay.num_pieces; i++) {
        push_op op = {r, m, j->lay.pieces[i].tensor, j->lay.pieces[i].slice};
        if (!leave_out || !leave_out(&op))
          ops[n++] = op;
      }
  *unique = n;
  for (size_t i = 0; i < *unique; i += 3)
    ops[n++] = ops[i];
  uint64_t x = seed;
  for (size_t i = n - 1; i > 0; i--) {
    x = mix64(x);
    size_t k = (size_t)(x % (i + 1));
    push_op t = ops[i];
    ops[i] = ops[k];
    ops[k] = t;
  }
  *out = ops;
  return n;
}

/* Pushes the step's contributions from PUSH_THREADS threads and checks that
 * each was acknowledged once as new and every repeat as a duplicate. */
static void push_step(hs_job *j, const grads *gr, uint64_t step, uint64_t seed,
                      int (*leave_out)(const push_op *)) {
  pusher ps;
  memset(&ps, 0, sizeof ps);
  size_t unique = 0;
  push_op *ops = NULL;
  ps.j = j;
  ps.gr = gr;
  ps.step = step;
  ps.nops = build_ops(j, seed, leave_out, &ops, &unique);
  ps.ops = ops;
  pthread_mutex_init(&ps.mu, NULL);
  pthread_t th[PUSH_THREADS];
  for (int i = 0; i < PUSH_THREADS; i++)
    assert_int_equal(pthread_create(&th[i], NULL, push_main, &ps), 0);
  for (int i = 0; i < PUSH_THREADS; i++)
    pthread_join(th[i], NULL);
  pthread_mutex_destroy(&ps.mu);
  free(ops);
  if (atomic_load(&ps.errors))
    fail_msg("%d pushes failed, the first with: %s", atomic_load(&ps.errors), ps.first_error);
  assert_int_equal(atomic_load(&ps.fresh), (int)unique);
  assert_int_equal(atomic_load(&ps.dups), (int)(ps.nops - unique));
}

/* ------------------------------------------------------------ steps */

/* GradStats on every shard (all complete); returns the summed sum_squares and
 * the shards' nonfinite flags in nonfinite[] (may be NULL). */
static double stats_all(hs_job *j, uint64_t step, int *nonfinite) {
  double sum = 0.0;
  for (uint32_t i = 0; i < j->nshards; i++) {
    Zshard__V1__GradStatsResponse *r = NULL;
    rpc_status st;
    int rc = hs_grad_stats(j->ch[i], j->hash, step, 20000, &r, &st);
    if (rc)
      fail_msg("GradStats on shard %u: %s", i, st.message);
    assert_true(r->complete);
    assert_int_equal(r->step, step);
    sum += r->sum_squares;
    if (nonfinite)
      nonfinite[i] = r->nonfinite;
    else
      assert_false(r->nonfinite);
    protobuf_c_message_free_unpacked(&r->base, NULL);
  }
  return sum;
}

static void apply_all(hs_job *j, uint64_t step, double lr, float coef, int skip,
                      uint64_t opt_steps) {
  for (uint32_t i = 0; i < j->nshards; i++) {
    Zshard__V1__ApplyResponse *r = NULL;
    rpc_status st;
    int rc = hs_apply(j->ch[i], j->hash, step, lr, coef, skip, &r, &st);
    if (rc)
      fail_msg("Apply on shard %u: %s", i, st.message);
    assert_int_equal(r->step, step);
    assert_int_equal(r->version, step);
    assert_int_equal(r->skipped, skip != 0);
    assert_int_equal(r->optimizer_steps, opt_steps);
    protobuf_c_message_free_unpacked(&r->base, NULL);
  }
}

/* Pulls every tensor at `version` in fp32 and bf16 and checks both against
 * the reference bit for bit. */
static void expect_params(hs_job *j, const ref *r, uint64_t version) {
  const spec *sp = &j->sp;
  float **got = tensors_alloc(sp);
  uint64_t v = 0;
  rpc_status st;
  if (hs_job_pull(j, version, got, &v, &st))
    fail_msg("Pull: %s", st.message);
  assert_int_equal(v, version);
  for (uint32_t t = 0; t < sp->num_tensors; t++) {
    uint64_t n = sp->tensors[t].numel;
    for (uint64_t i = 0; i < n; i++)
      if (memcmp(&got[t][i], &r->master[t][i], sizeof(float)) != 0)
        fail_msg("tensor %s element %llu: pulled %.9g, reference %.9g", sp->tensors[t].name,
                 (unsigned long long)i, (double)got[t][i], (double)r->master[t][i]);
  }
  tensors_free(sp, got);
  /* The low-precision copy the optimizer writes is bf16(master). */
  for (uint32_t k = 0; k < j->lay.num_pieces; k++) {
    const layout_piece *p = &j->lay.pieces[k];
    uint16_t *low = malloc(p->numel * 2), *want = malloc(p->numel * 2);
    assert_non_null(low);
    assert_non_null(want);
    assert_int_equal(hs_pull(j->ch[p->shard], j->hash, p->tensor, p->slice, version, ZS_DTYPE_BF16,
                             0, low, p->numel * 2, &v, &st),
                     0);
    dtype_from_f32(ZS_DTYPE_BF16, r->master[p->tensor] + p->offset, want, p->numel);
    assert_memory_equal(low, want, p->numel * 2);
    free(low);
    free(want);
  }
}

/* One whole step: shuffled pushes, statistics, apply, and the reference. */
static void train_step(hs_job *j, ref *r, uint64_t step, uint64_t seed, float coef) {
  grads gr;
  grads_make(&gr, &j->sp, step);
  push_step(j, &gr, step, seed, NULL);
  stats_all(j, step, NULL);
  float **acc = ref_accumulate(&gr);
  ref_apply(r, acc, LR, coef, 0);
  apply_all(j, step, LR, coef, 0, r->opt_steps);
  tensors_free(&j->sp, acc);
  grads_free(&gr);
}

/* A cluster of n shards with an open, initialised job. */
typedef struct fixture {
  hs_cluster cl;
  hs_job j;
  ref r;
  float **w0;
} fixture;

static void fixture_up(fixture *f, const char *name, uint32_t W, uint32_t M, uint32_t N) {
  memset(f, 0, sizeof *f);
  assert_int_equal(hs_cluster_start(&f->cl, N, NULL), 0);
  spec sp;
  assert_int_equal(hs_spec_build(&sp, name, W, M, N), 0);
  assert_int_equal(hs_job_init_cluster(&f->j, &sp, &f->cl), 0);
  rpc_status st;
  if (hs_job_open(&f->j, 0, &st))
    fail_msg("Open: %s", st.message);
  /* A second trainer opening the same spec is accepted. */
  if (hs_job_open(&f->j, W - 1, &st))
    fail_msg("second Open: %s", st.message);
  f->w0 = initial_weights(&f->j.sp);
  if (hs_job_init_params(&f->j, f->w0, &st))
    fail_msg("InitParams: %s", st.message);
  ref_init(&f->r, &f->j.sp, f->w0);
}

static void fixture_down(fixture *f) {
  ref_free(&f->r);
  tensors_free(&f->j.sp, f->w0);
  hs_job_free(&f->j);
  assert_int_equal(hs_cluster_stop(&f->cl), 0);
}

/* ------------------------------------------------------------ tests */

static void test_training_is_bit_identical_to_the_reference_whatever_the_push_order(void **state) {
  (void)state;
  float **final[2] = {NULL, NULL};
  spec keep;
  memset(&keep, 0, sizeof keep);
  for (int run = 0; run < 2; run++) {
    fixture f;
    fixture_up(&f, "order", 3, 2, 3);
    expect_params(&f.j, &f.r, 0);
    for (uint64_t step = 1; step <= 3; step++) {
      train_step(&f.j, &f.r, step, 1000u * (uint64_t)run + step, 0.75f);
      expect_params(&f.j, &f.r, step);
    }
    final[run] = tensors_alloc(&f.j.sp);
    for (uint32_t t = 0; t < f.j.sp.num_tensors; t++)
      memcpy(final[run][t], f.r.master[t], f.j.sp.tensors[t].numel * sizeof(float));
    if (run == 1)
      assert_int_equal(spec_copy(&keep, &f.j.sp), 0);
    fixture_down(&f);
  }
  /* expect_params compared each run with the reference; the reference does
   * not depend on the order, so the runs agree too. Checked outright anyway. */
  for (uint32_t t = 0; t < keep.num_tensors; t++)
    assert_memory_equal(final[0][t], final[1][t], keep.tensors[t].numel * sizeof(float));
  tensors_free(&keep, final[0]);
  tensors_free(&keep, final[1]);
  spec_free(&keep);
}

static void expect_status(int rc, const rpc_status *st, int zs, int grpc_code, const char *word) {
  if (rc != zs)
    fail_msg("expected %s, got %s (%s)", zs_err_name(zs), zs_err_name(rc), st->message);
  assert_int_equal(st->zs_status, zs);
  assert_int_equal(st->grpc_code, grpc_code);
  if (word && !strstr(st->message, word))
    fail_msg("status detail \"%s\" does not mention \"%s\"", st->message, word);
}

static void test_bad_pushes_are_refused_with_their_status_and_change_nothing(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "bad-pushes", 2, 2, 2);
  hs_job *j = &f.j;
  grads gr;
  grads_make(&gr, &j->sp, 1);
  const layout_piece *p = &j->lay.pieces[0];
  rpc_channel *owner = j->ch[p->shard];
  rpc_channel *other = j->ch[(p->shard + 1) % j->nshards];
  const void *data = grad_of(&gr, 0, 0, p->tensor); /* rank 0 pushes fp32 */
  size_t nbytes = (size_t)p->numel * 4;
  rpc_status st;
  int rc;

  rc =
      hs_push(owner, j->hash, 2, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, data, nbytes, NULL, &st);
  expect_status(rc, &st, ZS_ESTEP, 11 /* OUT_OF_RANGE */, "step");
  rc = hs_push(owner, j->hash, 1, 0, 0, j->sp.num_tensors, 0, ZS_DTYPE_FP32, data, nbytes, NULL,
               &st);
  expect_status(rc, &st, ZS_ENOTFOUND, 5 /* NOT_FOUND */, "tensor");
  rc =
      hs_push(other, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, data, nbytes, NULL, &st);
  expect_status(rc, &st, ZS_ENOTFOUND, 5, "owned");
  rc = hs_push(owner, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, data, nbytes - 4, NULL,
               &st);
  expect_status(rc, &st, ZS_ESIZE, 3 /* INVALID_ARGUMENT */, "bytes");
  rc = hs_push(owner, j->hash, 1, 0, 0, p->tensor, p->slice, 0, data, nbytes, NULL, &st);
  expect_status(rc, &st, ZS_EDTYPE, 3, "dtype");
  rc = hs_push(owner, j->hash, 1, 0, 0, p->tensor, p->slice, 7, data, nbytes, NULL, &st);
  expect_status(rc, &st, ZS_EDTYPE, 3, "dtype");
  /* fp16 is a valid dtype, but then the payload is twice too long. */
  rc =
      hs_push(owner, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP16, data, nbytes, NULL, &st);
  expect_status(rc, &st, ZS_ESIZE, 3, "bytes");
  rc = hs_push(owner, j->hash ^ 1, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, data, nbytes, NULL,
               &st);
  expect_status(rc, &st, ZS_EHASH, 9 /* FAILED_PRECONDITION */, "hash");
  rc = hs_push(owner, j->hash, 1, j->sp.world_size, 0, p->tensor, p->slice, ZS_DTYPE_FP32, data,
               nbytes, NULL, &st);
  expect_status(rc, &st, ZS_ERANGE, 11, "rank");

  /* Nothing was added: the weights are the initial ones, no contribution of
   * step 1 is counted as received (push_step checks every push is new), and
   * the step then trains exactly like the reference. */
  expect_params(j, &f.r, 0);
  push_step(j, &gr, 1, 7, NULL);
  stats_all(j, 1, NULL);
  float **acc = ref_accumulate(&gr);
  ref_apply(&f.r, acc, LR, 1.0f, 0);
  apply_all(j, 1, LR, 1.0f, 0, 1);
  expect_params(j, &f.r, 1);
  tensors_free(&j->sp, acc);
  grads_free(&gr);
  fixture_down(&f);
}

static void
test_a_non_finite_gradient_must_be_skipped_and_skipping_keeps_the_weights(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "nonfinite", 2, 2, 2);
  hs_job *j = &f.j;
  grads gr;
  grads_make(&gr, &j->sp, 1);
  const uint32_t t_inf = 3; /* layer.bias, whole */
  grad_set(&gr, 1, 0, t_inf, 5, INFINITY);
  const layout_piece *p = layout_find(&j->lay, t_inf, 0);
  assert_non_null(p);
  push_step(j, &gr, 1, 11, NULL);
  int nonfinite[HS_MAX_SHARDS] = {0};
  stats_all(j, 1, nonfinite);
  for (uint32_t i = 0; i < j->nshards; i++)
    assert_int_equal(nonfinite[i], i == p->shard);

  Zshard__V1__ApplyResponse *ar = NULL;
  rpc_status st;
  int rc = hs_apply(j->ch[p->shard], j->hash, 1, LR, 1.0f, 0, &ar, &st);
  expect_status(rc, &st, ZS_ENONFINITE, 3, "non-finite");
  assert_null(ar);
  expect_params(j, &f.r, 0);

  apply_all(j, 1, LR, 1.0f, 1, 0);
  expect_params(j, &f.r, 1); /* version 1, weights unchanged */
  grads_free(&gr);

  /* The skip dropped the gradient: step 2 trains from the initial weights
   * as the first optimizer step. */
  train_step(j, &f.r, 2, 12, 1.0f);
  assert_int_equal(f.r.opt_steps, 1);
  expect_params(j, &f.r, 2);
  fixture_down(&f);
}

/* Apply of `step` on shard i carrying a client state (len bytes at cs). */
static int apply_with_state(hs_job *j, uint32_t i, uint64_t step, int skip, const void *cs,
                            size_t len, rpc_status *st) {
  Zshard__V1__ApplyRequest req = ZSHARD__V1__APPLY_REQUEST__INIT;
  req.spec_hash = j->hash;
  req.step = step;
  req.lr = LR;
  req.coef = 1.0f;
  req.skip = skip != 0;
  req.client_state.data = (uint8_t *)(uintptr_t)cs;
  req.client_state.len = len;
  ProtobufCMessage *resp = NULL;
  int rc = rpc_call(j->ch[i], "/zshard.v1.ZShard/Apply", &req.base,
                    &zshard__v1__apply_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, st);
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

/* Shard i's answer to Open: its client state into buf (returns the length)
 * and the version it belongs to. */
static size_t open_client_state(hs_job *j, uint32_t i, uint8_t *buf, size_t cap,
                                uint64_t *version) {
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  assert_int_equal(spec_to_proto(&j->sp, &ms), 0);
  Zshard__V1__OpenRequest req = ZSHARD__V1__OPEN_REQUEST__INIT;
  req.spec = &ms;
  ProtobufCMessage *resp = NULL;
  rpc_status st;
  int rc = rpc_call(j->ch[i], "/zshard.v1.ZShard/Open", &req.base,
                    &zshard__v1__open_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, &st);
  spec_proto_release(&ms);
  if (rc)
    fail_msg("Open on shard %u: %s", i, st.message);
  const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)resp;
  assert_true(r->client_state.len <= cap);
  size_t n = r->client_state.len;
  if (n)
    memcpy(buf, r->client_state.data, n);
  *version = r->version;
  protobuf_c_message_free_unpacked(resp, NULL);
  return n;
}

/* The client state of an Apply becomes the shard's state of that version,
 * stays through applies that carry none, and comes back with Open; one
 * above 1024 bytes is refused before anything happens. */
static void test_an_oversized_client_state_is_refused_and_changes_nothing(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "client-state", 1, 1, 2);
  hs_job *j = &f.j;
  grads gr;
  grads_make(&gr, &j->sp, 1);
  push_step(j, &gr, 1, 21, NULL);
  stats_all(j, 1, NULL);
  uint8_t big[1025], got[1024];
  for (size_t k = 0; k < sizeof big; k++)
    big[k] = (uint8_t)(k * 31 + 7);
  uint64_t v = 99;
  rpc_status st;
  for (uint32_t i = 0; i < j->nshards; i++) {
    int rc = apply_with_state(j, i, 1, 0, big, sizeof big, &st);
    expect_status(rc, &st, ZS_ESIZE, 3 /* INVALID_ARGUMENT */, "client_state");
    assert_non_null(strstr(st.message, "1025"));
  }
  /* Not applied, no state kept. */
  expect_params(j, &f.r, 0);
  for (uint32_t i = 0; i < j->nshards; i++) {
    assert_int_equal(open_client_state(j, i, got, sizeof got, &v), 0);
    assert_int_equal(v, 0);
  }

  /* 1024 bytes are kept, as version 1's state. */
  float **acc = ref_accumulate(&gr);
  ref_apply(&f.r, acc, LR, 1.0f, 0);
  tensors_free(&j->sp, acc);
  grads_free(&gr);
  for (uint32_t i = 0; i < j->nshards; i++)
    assert_int_equal(apply_with_state(j, i, 1, 0, big, 1024, &st), 0);
  expect_params(j, &f.r, 1);
  /* A repeat of the applied step is not compared and changes nothing. */
  const uint8_t other[3] = {1, 2, 3};
  assert_int_equal(apply_with_state(j, 0, 1, 0, other, sizeof other, &st), 0);
  for (uint32_t i = 0; i < j->nshards; i++) {
    assert_int_equal(open_client_state(j, i, got, sizeof got, &v), 1024);
    assert_int_equal(v, 1);
    assert_memory_equal(got, big, 1024);
  }

  /* A step applied without one keeps it; a skipped step with one sets it. */
  train_step(j, &f.r, 2, 22, 1.0f);
  for (uint32_t i = 0; i < j->nshards; i++) {
    assert_int_equal(open_client_state(j, i, got, sizeof got, &v), 1024);
    assert_int_equal(v, 2);
  }
  grads_make(&gr, &j->sp, 3);
  push_step(j, &gr, 3, 23, NULL);
  stats_all(j, 3, NULL);
  for (uint32_t i = 0; i < j->nshards; i++)
    assert_int_equal(apply_with_state(j, i, 3, 1, other, sizeof other, &st), 0);
  for (uint32_t i = 0; i < j->nshards; i++) {
    assert_int_equal(open_client_state(j, i, got, sizeof got, &v), sizeof other);
    assert_int_equal(v, 3);
    assert_memory_equal(got, other, sizeof other);
  }
  expect_params(j, &f.r, 3); /* skipped: the weights of version 2 */
  grads_free(&gr);
  fixture_down(&f);
}

/* torch.nn.utils.clip_grad_norm_'s total norm of the gradients `acc`, computed
 * by Debian's python3 with torch; -1 when python3 or torch is missing. */
static double torch_total_norm(const spec *sp, float *const *acc) {
  if (access("/usr/bin/python3", X_OK) != 0)
    return -1.0;
  char path[512];
  snprintf(path, sizeof path, "%s/grads.f32", hs_tmpdir());
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    assert_int_equal(fwrite(acc[t], sizeof(float), sp->tensors[t].numel, f), sp->tensors[t].numel);
  assert_int_equal(fclose(f), 0);
  char cmd[2048];
  int n = snprintf(cmd, sizeof cmd,
                   "/usr/bin/python3 -c '"
                   "import sys, numpy as np, torch\n"
                   "d = np.fromfile(sys.argv[1], dtype=np.float32)\n"
                   "ps, o = [], 0\n"
                   "for k in map(int, sys.argv[2:]):\n"
                   "    p = torch.nn.Parameter(torch.zeros(k))\n"
                   "    p.grad = torch.from_numpy(d[o:o + k].copy())\n"
                   "    ps.append(p)\n"
                   "    o += k\n"
                   "print(repr(float(torch.nn.utils.clip_grad_norm_(ps, 1e30))))\n"
                   "' %s",
                   path);
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %llu",
                  (unsigned long long)sp->tensors[t].numel);
  FILE *pp = popen(cmd, "r");
  assert_non_null(pp);
  char line[256] = "";
  char *got = fgets(line, sizeof line, pp);
  int status = pclose(pp);
  if (!got || status != 0) {
    print_message("torch unavailable (python exit status %d); compared with C only\n", status);
    return -1.0;
  }
  return strtod(line, NULL);
}

static void test_clipping_uses_the_norm_torch_computes_and_matches_the_reference(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "clip", 2, 2, 3);
  hs_job *j = &f.j;
  grads gr;
  grads_make(&gr, &j->sp, 1);
  push_step(j, &gr, 1, 21, NULL);
  double total = stats_all(j, 1, NULL);
  double norm = sqrt(total);
  float **acc = ref_accumulate(&gr);

  double want = 0.0;
  for (uint32_t t = 0; t < j->sp.num_tensors; t++)
    for (uint64_t i = 0; i < j->sp.tensors[t].numel; i++)
      want += (double)acc[t][i] * (double)acc[t][i];
  want = sqrt(want);
  if (fabs(norm - want) > 1e-6 * want)
    fail_msg("norm from the shards %.17g, computed in double %.17g", norm, want);
  double tnorm = torch_total_norm(&j->sp, acc);
  if (tnorm >= 0.0 && fabs(norm - tnorm) > 1e-6 * tnorm)
    fail_msg("norm from the shards %.17g, torch's clip_grad_norm_ %.17g", norm, tnorm);

  /* The gradient is the mean over W, so its norm is norm / W; clip it to a
   * quarter of that as clip_grad_norm_ would. */
  double gnorm = norm / j->sp.world_size;
  double max_norm = 0.25 * gnorm;
  float coef = (float)(max_norm / (gnorm + 1e-6));
  assert_true(coef < 1.0f);
  ref_apply(&f.r, acc, LR, coef, 0);
  apply_all(j, 1, LR, coef, 0, 1);
  expect_params(j, &f.r, 1);
  tensors_free(&j->sp, acc);
  grads_free(&gr);
  fixture_down(&f);
}

/* Held back: rank 1's micro-batch 0 of layer.bias, and rank 0's micro-batch 1
 * of every slice of embed.weight. */
static int held_back(const push_op *op) {
  return (op->tensor == 3 && op->rank == 1 && op->micro == 0) ||
         (op->tensor == 0 && op->rank == 0 && op->micro == 1);
}

static void test_grad_stats_timeout_names_the_missing_ranks_and_tensors(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "missing", 2, 2, 2);
  hs_job *j = &f.j;
  grads gr;
  grads_make(&gr, &j->sp, 1);
  push_step(j, &gr, 1, 31, held_back);

  for (uint32_t s = 0; s < j->nshards; s++) {
    /* What shard s lacks, in (tensor, slice, micro, rank) order. */
    push_op want[64];
    uint32_t nwant = 0;
    for (uint32_t k = 0; k < j->lay.num_pieces; k++) {
      const layout_piece *p = &j->lay.pieces[k];
      if (p->shard != s)
        continue;
      for (uint32_t m = 0; m < j->sp.grad_accum; m++)
        for (uint32_t r = 0; r < j->sp.world_size; r++) {
          push_op op = {r, m, p->tensor, p->slice};
          if (held_back(&op))
            want[nwant++] = op;
        }
    }
    Zshard__V1__GradStatsResponse *gs = NULL;
    rpc_status st;
    /* A shard that lacks nothing answers as soon as its statistics are
     * computed; only the others are expected to time out. */
    if (hs_grad_stats(j->ch[s], j->hash, 1, nwant ? 200 : 20000, &gs, &st))
      fail_msg("GradStats on shard %u: %s", s, st.message);
    assert_int_equal(gs->complete, nwant == 0);
    assert_int_equal(gs->missing_total, nwant);
    assert_int_equal(gs->n_missing, nwant);
    for (uint32_t i = 0; i < nwant; i++) {
      const Zshard__V1__MissingContribution *mc = gs->missing[i];
      assert_int_equal(mc->rank, want[i].rank);
      assert_int_equal(mc->micro, want[i].micro);
      assert_int_equal(mc->tensor, want[i].tensor);
      assert_int_equal(mc->slice, want[i].slice);
      assert_string_equal(mc->tensor_name, j->sp.tensors[want[i].tensor].name);
    }
    protobuf_c_message_free_unpacked(&gs->base, NULL);
  }

  /* The late contributions arrive; the step completes as usual. */
  for (uint32_t k = 0; k < j->lay.num_pieces; k++)
    for (uint32_t m = 0; m < j->sp.grad_accum; m++)
      for (uint32_t r = 0; r < j->sp.world_size; r++) {
        push_op op = {r, m, j->lay.pieces[k].tensor, j->lay.pieces[k].slice};
        int dup = 1;
        rpc_status st;
        if (held_back(&op)) {
          if (push_one(j, &gr, 1, &op, &dup, &st))
            fail_msg("late push: %s", st.message);
          assert_false(dup);
        }
      }
  stats_all(j, 1, NULL);
  float **acc = ref_accumulate(&gr);
  ref_apply(&f.r, acc, LR, 1.0f, 0);
  apply_all(j, 1, LR, 1.0f, 0, 1);
  expect_params(j, &f.r, 1);
  tensors_free(&j->sp, acc);
  grads_free(&gr);
  fixture_down(&f);
}

static void test_pull_of_a_future_version_times_out_with_deadline_exceeded(void **state) {
  (void)state;
  fixture f;
  fixture_up(&f, "future", 1, 1, 2);
  hs_job *j = &f.j;
  const layout_piece *p = &j->lay.pieces[0];
  size_t nbytes = (size_t)p->numel * 4;
  float *buf = malloc(nbytes);
  assert_non_null(buf);
  uint64_t v = 99;
  rpc_status st;
  int rc = hs_pull(j->ch[p->shard], j->hash, p->tensor, p->slice, 2, ZS_DTYPE_FP32, 200, buf,
                   nbytes, &v, &st);
  expect_status(rc, &st, ZS_ETIMEDOUT, 4 /* DEADLINE_EXCEEDED */, "version 2");
  /* The version that exists is served at once. */
  rc = hs_pull(j->ch[p->shard], j->hash, p->tensor, p->slice, 0, ZS_DTYPE_FP32, 200, buf, nbytes,
               &v, &st);
  assert_int_equal(rc, 0);
  assert_int_equal(v, 0);
  assert_memory_equal(buf, f.w0[p->tensor] + p->offset, nbytes);
  free(buf);
  fixture_down(&f);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_training_is_bit_identical_to_the_reference_whatever_the_push_order),
      cmocka_unit_test(test_bad_pushes_are_refused_with_their_status_and_change_nothing),
      cmocka_unit_test(test_a_non_finite_gradient_must_be_skipped_and_skipping_keeps_the_weights),
      cmocka_unit_test(test_an_oversized_client_state_is_refused_and_changes_nothing),
      cmocka_unit_test(test_clipping_uses_the_norm_torch_computes_and_matches_the_reference),
      cmocka_unit_test(test_grad_stats_timeout_names_the_missing_ranks_and_tensors),
      cmocka_unit_test(test_pull_of_a_future_version_times_out_with_deadline_exceeded),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures;
}
