/*
 * core: the shard core in process, without a transport. The reference for a
 * step is computed here from the same kernels the core uses (dtype_accumulate
 * in contribution order k = micro * W + rank into a zeroed buffer, then
 * optim_apply on a copy of the state with the same plan), so these tests check
 * the core's own work: ordering, holding, validation, statistics, apply
 * arguments, versions, waits and ownership.
 *
 * cmocka's assertions only run on the test's thread; pushing threads and core
 * callbacks record what they saw and the test thread checks it.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "server/core/core.h"
#include "server/core/core_internal.h" /* the int8 copy's freshness, for one test */
#include "server/optim/optim.h"

/* Long enough never to fire on a healthy run, short enough that a lost
 * wake-up shows up as ZS_ETIMEDOUT instead of a hang. */
#define TEST_WAIT_MS 30000u

/* ------------------------------------------------------------------ job */

typedef struct tensor_def {
  const char *name;
  uint64_t numel;
  uint32_t group;
} tensor_def;

/* With a split threshold of 64, the large ones are split over the shards and
 * the small ones are placed whole; the groups interleave so that each group's
 * range collects pieces of several tensors. */
static const tensor_def k_tensors[] = {
    {"w0", 1000, 0}, {"b0", 37, 0}, {"w1", 300, 1}, {"b1", 5, 1}, {"w2", 130, 0}, {"n2", 17, 1},
};
#define K_NT (sizeof k_tensors / sizeof k_tensors[0])

typedef struct job {
  spec spec;
  layout layout;
  uint64_t hash;
  uint32_t W, M, WM, N;
  zs_dtype gdt; /* gradient dtype pushed */
  uint32_t nt;
  float **init; /* [t]: initial weights */
  /* [t * WM + k]: this step's gradient of tensor t from contribution k, in
   * gdt, for the whole tensor. */
  unsigned char **grad;
  /* The reference state, whole tensors. */
  float **ref_master, **ref_m, **ref_v;
  uint16_t **ref_low;
  uint64_t ref_opt_steps;
  double ref_sumsq;
  int ref_nonfinite;
} job;

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

/* Uniform in [-scale, scale). */
static float rnd(uint64_t *s, float scale) {
  return ((float)(splitmix(s) >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * scale;
}

/* Fills the spec's fields; the caller may adjust groups before job_finish. */
static void job_start(job *j, const tensor_def *defs, uint32_t nt, uint32_t W, uint32_t M,
                      uint32_t N, zs_dtype param_dtype, spec_reduce reduce, zs_dtype gdt) {
  memset(j, 0, sizeof *j);
  spec *s = &j->spec;
  s->job = strdup("core-test");
  s->num_groups = 2;
  s->groups = calloc(2, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s->groups[1], ZS_OPTIM_SGD);
  s->groups[1].momentum = 0.9;
  s->groups[1].nesterov = 1;
  s->groups[1].weight_decay = 1e-3;
  s->groups[1].lr_scale = 0.5;
  s->num_tensors = nt;
  s->tensors = calloc(nt, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < nt; t++) {
    s->tensors[t].name = strdup(defs[t].name);
    s->tensors[t].numel = defs[t].numel;
    s->tensors[t].group = defs[t].group;
  }
  s->world_size = W;
  s->grad_accum = M;
  s->num_shards = N;
  s->split_threshold = 64;
  s->reduce = reduce;
  s->param_dtype = param_dtype;
  j->W = W;
  j->M = M;
  j->WM = W * M;
  j->N = N;
  j->nt = nt;
  j->gdt = gdt;
}

static void job_finish(job *j, uint64_t seed) {
  char err[256] = "";
  assert_int_equal(spec_validate(&j->spec, err, sizeof err), 0);
  j->hash = spec_hash(&j->spec);
  assert_int_equal(layout_build(&j->spec, &j->layout), 0);
  j->init = calloc(j->nt, sizeof *j->init);
  j->ref_master = calloc(j->nt, sizeof *j->ref_master);
  j->ref_m = calloc(j->nt, sizeof *j->ref_m);
  j->ref_v = calloc(j->nt, sizeof *j->ref_v);
  j->ref_low = calloc(j->nt, sizeof *j->ref_low);
  j->grad = calloc((size_t)j->nt * j->WM, sizeof *j->grad);
  assert_true(j->init && j->ref_master && j->ref_m && j->ref_v && j->ref_low && j->grad);
  for (uint32_t t = 0; t < j->nt; t++) {
    size_t n = (size_t)j->spec.tensors[t].numel;
    j->init[t] = malloc(n * sizeof(float));
    j->ref_master[t] = malloc(n * sizeof(float));
    j->ref_m[t] = calloc(n, sizeof(float));
    j->ref_v[t] = calloc(n, sizeof(float));
    j->ref_low[t] = malloc(n * sizeof(uint16_t));
    assert_true(j->init[t] && j->ref_master[t] && j->ref_m[t] && j->ref_v[t] && j->ref_low[t]);
    for (size_t i = 0; i < n; i++)
      j->init[t][i] = rnd(&seed, 1.0f);
    memcpy(j->ref_master[t], j->init[t], n * sizeof(float));
    dtype_from_f32(j->spec.param_dtype, j->init[t], j->ref_low[t], n);
    for (uint32_t k = 0; k < j->WM; k++) {
      j->grad[t * j->WM + k] = malloc(n * zs_dtype_size(j->gdt));
      assert_non_null(j->grad[t * j->WM + k]);
    }
  }
}

static void job_free(job *j) {
  for (uint32_t t = 0; t < j->nt; t++) {
    free(j->init[t]);
    free(j->ref_master[t]);
    free(j->ref_m[t]);
    free(j->ref_v[t]);
    free(j->ref_low[t]);
    for (uint32_t k = 0; k < j->WM; k++)
      free(j->grad[t * j->WM + k]);
  }
  free(j->init);
  free(j->ref_master);
  free(j->ref_m);
  free(j->ref_v);
  free(j->ref_low);
  free(j->grad);
  layout_free(&j->layout);
  spec_free(&j->spec);
}

/* The gradients of one step: random values rounded to the pushed dtype. */
static void job_make_grads(job *j, uint64_t seed) {
  for (uint32_t t = 0; t < j->nt; t++) {
    size_t n = (size_t)j->spec.tensors[t].numel;
    float *tmp = malloc(n * sizeof(float));
    assert_non_null(tmp);
    for (uint32_t k = 0; k < j->WM; k++) {
      for (size_t i = 0; i < n; i++)
        tmp[i] = rnd(&seed, 2.0f);
      dtype_from_f32(j->gdt, tmp, j->grad[t * j->WM + k], n);
    }
    free(tmp);
  }
}

/* Overwrites element i of tensor t's gradient from contribution k. */
static void job_poke_grad(job *j, uint32_t t, uint32_t k, size_t i, float value) {
  dtype_from_f32(j->gdt, &value, j->grad[t * j->WM + k] + i * zs_dtype_size(j->gdt), 1);
}

static float **job_ref_sums(job *j) {
  float **acc = calloc(j->nt, sizeof *acc);
  assert_non_null(acc);
  for (uint32_t t = 0; t < j->nt; t++) {
    size_t n = (size_t)j->spec.tensors[t].numel;
    acc[t] = calloc(n, sizeof(float));
    assert_non_null(acc[t]);
    for (uint32_t k = 0; k < j->WM; k++)
      dtype_accumulate(j->gdt, j->grad[t * j->WM + k], acc[t], n);
  }
  return acc;
}

static void free_sums(job *j, float **acc) {
  for (uint32_t t = 0; t < j->nt; t++)
    free(acc[t]);
  free(acc);
}

/* The reference step over whole tensors (the optimizer is elementwise, so
 * whole tensors give the same bits as the shards' slices). */
static void job_ref_step(job *j, double lr, float coef, int skip) {
  float **acc = job_ref_sums(j);
  if (!skip) {
    j->ref_opt_steps++;
    for (uint32_t t = 0; t < j->nt; t++) {
      const spec_group *g = &j->spec.groups[j->spec.tensors[t].group];
      optim_params p = {
          .optimizer = g->optimizer,
          .lr = lr * g->lr_scale,
          .beta1 = g->beta1,
          .beta2 = g->beta2,
          .eps = g->eps,
          .weight_decay = g->weight_decay,
          .momentum = g->momentum,
          .dampening = g->dampening,
          .nesterov = g->nesterov,
          .bias_correction = g->bias_correction,
          .step = j->ref_opt_steps,
          .grad_scale = j->spec.reduce == SPEC_REDUCE_MEAN ? (float)((double)coef / j->W) : coef,
          .low_dtype = j->spec.param_dtype,
      };
      optim_plan plan;
      optim_plan_init(&plan, &p);
      optim_apply(&plan, j->ref_master[t], j->ref_m[t], j->ref_v[t], acc[t], j->ref_low[t],
                  (size_t)j->spec.tensors[t].numel);
    }
  }
  free_sums(j, acc);
}

/* The statistics a shard must report: its accumulator laid out as in its
 * arena, summed with optim_sum_squares over CORE_STATS_BLOCK blocks, added in
 * block order (or, to show that the order matters, in reverse). */
static void job_ref_stats_ordered(job *j, uint32_t shard, int reverse, double *sum,
                                  int *nonfinite) {
  const layout *l = &j->layout;
  uint64_t n = l->shard_elems[shard];
  float *arena = calloc(n + 1, sizeof(float));
  assert_non_null(arena);
  float **acc = job_ref_sums(j);
  for (uint32_t i = 0; i < l->num_pieces; i++) {
    const layout_piece *p = &l->pieces[i];
    if (p->shard == shard)
      memcpy(arena + p->arena_off, acc[p->tensor] + p->offset, p->numel * sizeof(float));
  }
  uint64_t nblocks = (n + CORE_STATS_BLOCK - 1) / CORE_STATS_BLOCK;
  *sum = 0.0;
  *nonfinite = 0;
  for (uint64_t i = 0; i < nblocks; i++) {
    uint64_t b = (reverse ? nblocks - 1 - i : i) * CORE_STATS_BLOCK;
    int nf = 0;
    *sum += optim_sum_squares(arena + b,
                              (size_t)(n - b < CORE_STATS_BLOCK ? n - b : CORE_STATS_BLOCK), &nf);
    *nonfinite |= nf;
  }
  free_sums(j, acc);
  free(arena);
}

static void job_ref_stats(job *j, uint32_t shard, double *sum, int *nonfinite) {
  job_ref_stats_ordered(j, shard, 0, sum, nonfinite);
}

/* ------------------------------------------------------------------ events */

/* Records one core callback; optionally holds the calling (worker) thread at a
 * gate until the test opens it. */
typedef struct event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int fired;
  int status;
  uint64_t version;
  core_stats_result stats;
  core_apply_result apply;
  int gate_closed;
  int at_gate;
} event;

static void event_init(event *e) {
  memset(e, 0, sizeof *e);
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
}

static void event_destroy(event *e) {
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
}

static int event_fired(event *e) {
  pthread_mutex_lock(&e->mu);
  int f = e->fired;
  pthread_mutex_unlock(&e->mu);
  return f;
}

static void event_wait(event *e, int count) {
  pthread_mutex_lock(&e->mu);
  while (e->fired < count)
    pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

static void event_fire_locked(event *e, int status) {
  e->fired++;
  e->status = status;
  pthread_cond_broadcast(&e->cv);
  while (e->gate_closed) {
    e->at_gate = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_cond_wait(&e->cv, &e->mu);
  }
}

static void on_version(void *arg, int status, uint64_t version) {
  event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->version = version;
  event_fire_locked(e, status);
  pthread_mutex_unlock(&e->mu);
}

static void on_stats(void *arg, int status, const core_stats_result *r) {
  event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->stats = *r;
  event_fire_locked(e, status);
  pthread_mutex_unlock(&e->mu);
}

static void on_apply(void *arg, int status, const core_apply_result *r) {
  event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->apply = *r;
  event_fire_locked(e, status);
  pthread_mutex_unlock(&e->mu);
}

static void event_wait_at_gate(event *e) {
  pthread_mutex_lock(&e->mu);
  while (!e->at_gate)
    pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

static void event_open_gate(event *e) {
  pthread_mutex_lock(&e->mu);
  e->gate_closed = 0;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

/* ------------------------------------------------------------------ core helpers */

static core *open_core(job *j, uint32_t shard, int threads) {
  core_config cfg = {.shard_id = shard, .num_shards = j->N, .threads = threads};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(c, &j->spec, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 1);
  assert_int_equal(r.spec_hash, j->hash);
  assert_int_equal(r.version, 0);
  return c;
}

static void init_all(core *c, job *j, uint32_t shard) {
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    int written = -1;
    uint64_t version = 99;
    char err[256] = "";
    assert_int_equal(core_init_params(c, j->hash, p->tensor, p->slice,
                                      j->init[p->tensor] + p->offset, p->numel * sizeof(float),
                                      &written, &version, err, sizeof err),
                     0);
    assert_int_equal(written, 1);
  }
}

static core_push_args push_args(job *j, uint64_t step, const layout_piece *p, uint32_t k) {
  size_t es = zs_dtype_size(j->gdt);
  core_push_args a = {
      .hash = j->hash,
      .step = step,
      .rank = k % j->W,
      .micro = k / j->W,
      .tensor = p->tensor,
      .slice = p->slice,
      .dtype = j->gdt,
      .data = j->grad[p->tensor * j->WM + k] + p->offset * es,
      .nbytes = p->numel * es,
  };
  return a;
}

typedef struct push_item {
  uint32_t piece; /* index into the layout's pieces */
  uint32_t k;
} push_item;

typedef struct pusher {
  core *c;
  job *j;
  uint64_t step;
  const push_item *items;
  size_t begin, end;
  int first_error;
  uint64_t duplicates;
} pusher;

static void *push_thread(void *arg) {
  pusher *p = arg;
  for (size_t i = p->begin; i < p->end; i++) {
    core_push_args a =
        push_args(p->j, p->step, &p->j->layout.pieces[p->items[i].piece], p->items[i].k);
    int dup = 0;
    int rc = core_push(p->c, &a, &dup, NULL, 0);
    if (rc != 0 && p->first_error == 0)
      p->first_error = rc;
    p->duplicates += (uint64_t)dup;
  }
  return NULL;
}

/* Every contribution of the shard's pieces, except those `exclude` names,
 * plus `dups` repeats, in an order shuffled by `seed`. */
static push_item *shard_items(job *j, uint32_t shard, uint64_t seed, size_t dups, size_t *count,
                              int (*exclude)(const layout_piece *, uint32_t)) {
  size_t n = 0, cap = (size_t)j->layout.num_pieces * j->WM + dups + 1;
  push_item *items = calloc(cap, sizeof *items);
  assert_non_null(items);
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    if (j->layout.pieces[i].shard != shard)
      continue;
    for (uint32_t k = 0; k < j->WM; k++)
      if (!exclude || !exclude(&j->layout.pieces[i], k))
        items[n++] = (push_item){i, k};
  }
  size_t distinct = n;
  for (size_t d = 0; d < dups && distinct > 0; d++)
    items[n++] = items[splitmix(&seed) % distinct];
  for (size_t i = n; i > 1; i--) {
    size_t r = (size_t)(splitmix(&seed) % i);
    push_item t = items[i - 1];
    items[i - 1] = items[r];
    items[r] = t;
  }
  *count = n;
  return items;
}

/* Pushes items over `nthreads` threads, each taking a contiguous share of the
 * shuffled list. Returns the number of duplicate acknowledgements. */
static uint64_t push_items(core *c, job *j, uint64_t step, const push_item *items, size_t n,
                           int nthreads) {
  pusher ps[8];
  pthread_t tid[8];
  assert_true(nthreads >= 1 && nthreads <= 8);
  for (int t = 0; t < nthreads; t++) {
    ps[t] = (pusher){.c = c,
                     .j = j,
                     .step = step,
                     .items = items,
                     .begin = n * (size_t)t / (size_t)nthreads,
                     .end = n * (size_t)(t + 1) / (size_t)nthreads};
    assert_int_equal(pthread_create(&tid[t], NULL, push_thread, &ps[t]), 0);
  }
  uint64_t dups = 0;
  for (int t = 0; t < nthreads; t++) {
    pthread_join(tid[t], NULL);
    assert_int_equal(ps[t].first_error, 0);
    dups += ps[t].duplicates;
  }
  return dups;
}

static int push_one(core *c, job *j, uint64_t step, uint32_t tensor, uint32_t slice, uint32_t k,
                    int *dup) {
  const layout_piece *p = layout_find(&j->layout, tensor, slice);
  assert_non_null(p);
  core_push_args a = push_args(j, step, p, k);
  return core_push(c, &a, dup, NULL, 0);
}

static int stats_sync(core *c, job *j, uint64_t step, core_stats_result *out) {
  event e;
  event_init(&e);
  char err[256] = "";
  int rc = core_grad_stats(c, j->hash, step, clock_now_ms() + TEST_WAIT_MS, on_stats, &e, out, err,
                           sizeof err);
  if (rc == CORE_PENDING) {
    event_wait(&e, 1);
    rc = e.status;
    *out = e.stats;
  }
  event_destroy(&e);
  return rc;
}

static int apply_sync(core *c, job *j, uint64_t step, double lr, float coef, int skip,
                      core_apply_result *out) {
  event e;
  event_init(&e);
  char err[256] = "";
  int rc = core_apply(c, j->hash, step, lr, coef, skip, on_apply, &e, out, err, sizeof err);
  if (rc == CORE_PENDING) {
    event_wait(&e, 1);
    rc = e.status;
    *out = e.apply;
  }
  event_destroy(&e);
  return rc;
}

/* Reads every piece the shard owns in every dtype and compares the bits with
 * the reference state. */
static void check_shard_matches_reference(core *c, job *j, uint32_t shard, uint64_t want_version) {
  zs_dtype pdt = j->spec.param_dtype;
  zs_dtype other = pdt == ZS_DTYPE_BF16 ? ZS_DTYPE_FP16 : ZS_DTYPE_BF16;
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    size_t n = (size_t)p->numel;
    float *f = malloc(n * sizeof(float));
    uint16_t *h = malloc(n * sizeof(uint16_t));
    uint16_t *want_other = malloc(n * sizeof(uint16_t));
    assert_true(f && h && want_other);
    uint64_t version = 999;
    char err[256] = "";
    assert_int_equal(core_read(c, j->hash, p->tensor, p->slice, ZS_DTYPE_FP32, f, n * sizeof(float),
                               &version, err, sizeof err),
                     0);
    assert_int_equal(version, want_version);
    assert_memory_equal(f, j->ref_master[p->tensor] + p->offset, n * sizeof(float));
    assert_int_equal(
        core_read(c, j->hash, p->tensor, p->slice, pdt, h, n * 2, &version, err, sizeof err), 0);
    assert_memory_equal(h, j->ref_low[p->tensor] + p->offset, n * 2);
    assert_int_equal(
        core_read(c, j->hash, p->tensor, p->slice, other, h, n * 2, &version, err, sizeof err), 0);
    dtype_from_f32(other, j->ref_master[p->tensor] + p->offset, want_other, n);
    assert_memory_equal(h, want_other, n * 2);
    free(f);
    free(h);
    free(want_other);
  }
}

/* One full step on one shard: shuffled pushes with duplicates from several
 * threads, statistics, apply; then the reference step and the comparison. */
static void run_step(core *c, job *j, uint32_t shard, uint64_t step, uint64_t seed, int nthreads,
                     double lr, float coef) {
  size_t n = 0;
  push_item *items = shard_items(j, shard, seed, 17, &n, NULL);
  core_counters before, after;
  core_get_counters(c, &before);
  uint64_t dups = push_items(c, j, step, items, n, nthreads);
  core_get_counters(c, &after);
  assert_int_equal(dups, 17);
  assert_int_equal(after.duplicate_pushes - before.duplicate_pushes, 17);
  assert_int_equal(after.pushes - before.pushes, n);
  assert_int_equal(after.held_bytes, 0);
  free(items);

  core_stats_result st;
  assert_int_equal(stats_sync(c, j, step, &st), 0);
  double want_sum;
  int want_nf;
  job_ref_stats(j, shard, &want_sum, &want_nf);
  assert_int_equal(st.step, step);
  assert_true(st.sum_squares == want_sum);
  assert_int_equal(st.nonfinite, want_nf);

  core_apply_result ar;
  assert_int_equal(apply_sync(c, j, step, lr, coef, 0, &ar), 0);
  assert_int_equal(ar.step, step);
  assert_int_equal(ar.version, step);
  assert_int_equal(ar.skipped, 0);
  job_ref_step(j, lr, coef, 0);
  assert_int_equal(ar.optimizer_steps, j->ref_opt_steps);
  check_shard_matches_reference(c, j, shard, step);
}

/* ------------------------------------------------------------------ tests */

static void test_requests_without_a_job_are_refused_as_not_open(void **state) {
  (void)state;
  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  assert_null(core_spec(c));
  assert_null(core_layout(c));
  char err[256] = "";
  float x[4] = {0};
  core_push_args a = {.hash = 1, .step = 1, .dtype = ZS_DTYPE_FP32, .data = x, .nbytes = 16};
  assert_int_equal(core_push(c, &a, NULL, err, sizeof err), ZS_ENOTOPEN);
  uint64_t v;
  assert_int_equal(core_read(c, 1, 0, 0, ZS_DTYPE_FP32, x, 16, &v, err, sizeof err), ZS_ENOTOPEN);
  assert_int_equal(core_wait_version(c, 1, 0, 0, on_version, NULL, &v, err, sizeof err),
                   ZS_ENOTOPEN);
  core_apply_result ar;
  assert_int_equal(core_apply(c, 1, 1, 0.1, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ENOTOPEN);
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.has_job, 0);
  core_counters cnt;
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.rejected, 1);
  core_destroy(c);
}

static void test_create_rejects_a_shard_id_outside_the_shard_count(void **state) {
  (void)state;
  core *c = NULL;
  core_config cfg = {.shard_id = 2, .num_shards = 2, .threads = 1};
  assert_int_equal(core_create(&cfg, &c), ZS_EINVAL);
  cfg.num_shards = 0;
  cfg.shard_id = 0;
  assert_int_equal(core_create(&cfg, &c), ZS_EINVAL);
}

static void test_open_creates_once_accepts_identical_and_rejects_other_specs(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 1);
  core *c = open_core(&j, 1, 1);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(c, &j.spec, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 0);
  assert_int_equal(r.spec_hash, j.hash);
  assert_int_equal(r.initialized, 0);

  /* Another world size is the same job (issue 26: W is its initial
   * membership, not its identity), which keeps its own W. */
  job wider;
  job_start(&wider, k_tensors, K_NT, 3, 2, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&wider, 1);
  assert_true(wider.hash == j.hash);
  assert_int_equal(core_open(c, &wider.spec, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 0);
  assert_int_equal(r.world_size, 2);

  /* Another spec (different accumulation count) on the open job. */
  job other;
  job_start(&other, k_tensors, K_NT, 2, 3, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&other, 1);
  assert_true(other.hash != j.hash);
  assert_int_equal(core_open(c, &other.spec, &r, err, sizeof err), ZS_EHASH);
  char hex[32];
  snprintf(hex, sizeof hex, "%016" PRIx64, j.hash);
  assert_non_null(strstr(err, hex));
  snprintf(hex, sizeof hex, "%016" PRIx64, other.hash);
  assert_non_null(strstr(err, hex));

  /* A spec for another shard count. */
  job three;
  job_start(&three, k_tensors, K_NT, 2, 2, 3, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&three, 1);
  err[0] = 0;
  assert_int_equal(core_open(c, &three.spec, &r, err, sizeof err), ZS_EINVAL);
  assert_true(strlen(err) > 0);

  /* The info reflects the job and the arenas: master, acc, m, v (AdamW group,
   * SGD with momentum) at 4 bytes and the low copy at 2 bytes per element. */
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.has_job, 1);
  assert_string_equal(info.job, "core-test");
  assert_int_equal(info.spec_hash, j.hash);
  assert_int_equal(info.pieces, j.layout.shard_pieces[1]);
  assert_int_equal(info.elements, j.layout.shard_load[1]);
  assert_int_equal(info.state_bytes, j.layout.shard_elems[1] * 18u);
  assert_non_null(core_spec(c));
  assert_int_equal(spec_hash(core_spec(c)), j.hash);
  assert_int_equal(core_layout(c)->num_pieces, j.layout.num_pieces);
  core_destroy(c);
  job_free(&three);
  job_free(&other);
  job_free(&wider);
  job_free(&j);
}

static void test_arenas_for_moments_exist_only_when_an_optimizer_needs_them(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_FP16, SPEC_REDUCE_SUM, ZS_DTYPE_FP32);
  /* Plain SGD everywhere: no momentum buffer, no second moment. */
  spec_group_defaults(&j.spec.groups[0], ZS_OPTIM_SGD);
  spec_group_defaults(&j.spec.groups[1], ZS_OPTIM_SGD);
  job_finish(&j, 2);
  core *c = open_core(&j, 0, 1);
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.state_bytes, j.layout.shard_elems[0] * 10u);
  init_all(c, &j, 0);
  job_make_grads(&j, 3);
  run_step(c, &j, 0, 1, 4, 2, 0.1, 1.0f);
  core_destroy(c);
  job_free(&j);
}

static void test_init_params_writes_once_while_the_version_is_zero(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 5);
  core *c = open_core(&j, 0, 1);
  const layout_piece *p = layout_find(&j.layout, 0, 0); /* slice 0 of w0 is shard 0's */
  size_t nb = p->numel * sizeof(float);
  const float *data = j.init[p->tensor] + p->offset;
  int written = -1;
  uint64_t version = 9;
  char err[256] = "";

  assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, data, nb, &written, &version,
                                    err, sizeof err),
                   0);
  assert_int_equal(written, 1);
  assert_int_equal(version, 0);
  assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, data, nb, &written, &version,
                                    err, sizeof err),
                   0);
  assert_int_equal(written, 0);

  float *changed = malloc(nb);
  assert_non_null(changed);
  memcpy(changed, data, nb);
  changed[0] += 1.0f;
  assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, changed, nb, &written, &version,
                                    err, sizeof err),
                   ZS_EEXIST);
  assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, data, nb - 4, &written,
                                    &version, err, sizeof err),
                   ZS_ESIZE);
  assert_int_equal(core_init_params(c, j.hash + 1, p->tensor, p->slice, data, nb, &written,
                                    &version, err, sizeof err),
                   ZS_EHASH);
  /* Slice 1 of the split tensor w0 belongs to shard 1. */
  const layout_piece *q = layout_find(&j.layout, 0, 1);
  assert_int_equal(q->shard, 1);
  assert_int_equal(core_init_params(c, j.hash, 0, 1, j.init[0] + q->offset,
                                    q->numel * sizeof(float), &written, &version, err, sizeof err),
                   ZS_ENOTFOUND);
  assert_non_null(strstr(err, "shard 1"));

  /* The stored weights are the first ones, and the low copy is their
   * rounding. */
  float *got = malloc(nb);
  uint16_t *low = malloc(p->numel * 2);
  uint16_t *want_low = malloc(p->numel * 2);
  assert_true(got && low && want_low);
  assert_int_equal(
      core_read(c, j.hash, p->tensor, p->slice, ZS_DTYPE_FP32, got, nb, &version, err, sizeof err),
      0);
  assert_memory_equal(got, data, nb);
  assert_int_equal(core_read(c, j.hash, p->tensor, p->slice, ZS_DTYPE_BF16, low, p->numel * 2,
                             &version, err, sizeof err),
                   0);
  dtype_from_f32(ZS_DTYPE_BF16, data, want_low, (size_t)p->numel);
  assert_memory_equal(low, want_low, p->numel * 2);

  free(got);
  free(low);
  free(want_low);
  free(changed);
  core_destroy(c);
  job_free(&j);
}

/* Initial weights in parts of whole chunks (InitParams.offset): any order,
 * overlaps compared, misfits refused with nothing written, and the piece
 * initialized only once every chunk is in. */
static void test_init_params_in_chunks_any_order_overlaps_compared(void **state) {
  (void)state;
  const uint64_t chunk = LAYOUT_INIT_CHUNK_ELEMS;
  const tensor_def big[] = {{"big", 2 * LAYOUT_INIT_CHUNK_ELEMS + 1000, 0}};
  job j;
  job_start(&j, big, 1, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 11);
  core *c = open_core(&j, 0, 1);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  assert_int_equal(p->numel, 2 * chunk + 1000);
  const float *data = j.init[0];
  int written = -1;
  uint64_t version = 9;
  char err[256] = "";
  core_info info;

  /* Misfits: a start inside a chunk, an end inside a chunk before the piece's
   * end, a range beyond the piece, no data. */
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 16, data + 16, (chunk - 16) * 4,
                                          &written, &version, err, sizeof err),
                   ZS_ERANGE);
  assert_non_null(strstr(err, "multiple of"));
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 0, data, (chunk - 1) * 4, &written,
                                          &version, err, sizeof err),
                   ZS_ESIZE);
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 2 * chunk, data + 2 * chunk, 1001 * 4,
                                          &written, &version, err, sizeof err),
                   ZS_ESIZE);
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 3 * chunk, data, 4, &written, &version,
                                          err, sizeof err),
                   ZS_ESIZE);
  core_get_info(c, &info);
  assert_false(info.initialized);

  /* The short last chunk, then the first: not yet initialized. */
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 2 * chunk, data + 2 * chunk, 1000 * 4,
                                          &written, &version, err, sizeof err),
                   0);
  assert_int_equal(written, 1);
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, 0, data, chunk * 4, &written, &version,
                                          err, sizeof err),
                   0);
  assert_int_equal(written, 1);
  core_get_info(c, &info);
  assert_false(info.initialized);

  /* The whole piece with a difference in a chunk already written: refused,
   * and the missing middle chunk is not written by it. */
  float *changed = malloc(p->numel * sizeof(float));
  assert_non_null(changed);
  memcpy(changed, data, p->numel * sizeof(float));
  changed[2 * chunk + 7] += 1.0f;
  assert_int_equal(core_init_params(c, j.hash, 0, 0, changed, p->numel * sizeof(float), &written,
                                    &version, err, sizeof err),
                   ZS_EEXIST);
  assert_non_null(strstr(err, "different initial weights"));
  core_get_info(c, &info);
  assert_false(info.initialized);

  /* The whole piece, identical where written: fills the middle chunk. */
  assert_int_equal(core_init_params(c, j.hash, 0, 0, data, p->numel * sizeof(float), &written,
                                    &version, err, sizeof err),
                   0);
  assert_int_equal(written, 1);
  core_get_info(c, &info);
  assert_true(info.initialized);
  /* A repeat of one chunk once initialized: compared, nothing written. */
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, chunk, data + chunk, chunk * 4, &written,
                                          &version, err, sizeof err),
                   0);
  assert_int_equal(written, 0);
  assert_int_equal(core_init_params_range(c, j.hash, 0, 0, chunk, changed, chunk * 4, &written,
                                          &version, err, sizeof err),
                   ZS_EEXIST);

  float *got = malloc(p->numel * sizeof(float));
  uint16_t *low = malloc(p->numel * 2);
  uint16_t *want_low = malloc(p->numel * 2);
  assert_true(got && low && want_low);
  assert_int_equal(core_read(c, j.hash, 0, 0, ZS_DTYPE_FP32, got, p->numel * sizeof(float),
                             &version, err, sizeof err),
                   0);
  assert_memory_equal(got, data, p->numel * sizeof(float));
  assert_int_equal(
      core_read(c, j.hash, 0, 0, ZS_DTYPE_BF16, low, p->numel * 2, &version, err, sizeof err), 0);
  dtype_from_f32(ZS_DTYPE_BF16, data, want_low, (size_t)p->numel);
  assert_memory_equal(low, want_low, p->numel * 2);
  free(got);
  free(low);
  free(want_low);
  free(changed);
  core_destroy(c);
  job_free(&j);
}

static void test_init_params_after_the_first_step_changes_nothing(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_BF16);
  job_finish(&j, 6);
  core *c = open_core(&j, 0, 1);
  init_all(c, &j, 0);
  job_make_grads(&j, 7);
  run_step(c, &j, 0, 1, 8, 2, 1e-2, 1.0f);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  size_t nb = p->numel * sizeof(float);
  int written = -1;
  uint64_t version = 0;
  char err[256] = "";
  /* Different data than what is stored: still accepted, still unchanged. */
  assert_int_equal(
      core_init_params(c, j.hash, 0, 0, j.init[0], nb, &written, &version, err, sizeof err), 0);
  assert_int_equal(written, 0);
  assert_int_equal(version, 1);
  check_shard_matches_reference(c, &j, 0, 1);
  core_destroy(c);
  job_free(&j);
}

static void test_identical_init_repeats_report_nothing_written(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 9);
  core *c = open_core(&j, 0, 1);
  init_all(c, &j, 0);
  for (uint32_t i = 0; i < j.layout.num_pieces; i++) {
    const layout_piece *p = &j.layout.pieces[i];
    int written = -1;
    uint64_t version = 5;
    assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, j.init[p->tensor] + p->offset,
                                      p->numel * sizeof(float), &written, &version, NULL, 0),
                     0);
    assert_int_equal(written, 0);
    assert_int_equal(version, 0);
  }
  core_open_result r;
  assert_int_equal(core_open(c, &j.spec, &r, NULL, 0), 0);
  assert_int_equal(r.initialized, 1);
  core_destroy(c);
  job_free(&j);
}

/* The main property: for each gradient dtype and world size, several shuffled
 * arrival orders with duplicates, pushed from several threads, give the
 * reference bits, over two steps (so the moments carry over). */
static void
test_shuffled_concurrent_pushes_with_duplicates_match_the_reference_bitwise(void **state) {
  (void)state;
  const zs_dtype gdts[] = {ZS_DTYPE_FP32, ZS_DTYPE_FP16, ZS_DTYPE_BF16};
  for (size_t d = 0; d < 3; d++) {
    for (uint32_t W = 2; W <= 4; W++) {
      zs_dtype pdt = W == 3 ? ZS_DTYPE_FP16 : ZS_DTYPE_BF16;
      spec_reduce red = W == 4 ? SPEC_REDUCE_SUM : SPEC_REDUCE_MEAN;
      float *first_master = NULL;
      for (int shuffle = 0; shuffle < 3; shuffle++) {
        job j;
        job_start(&j, k_tensors, K_NT, W, 2, 1, pdt, red, gdts[d]);
        job_finish(&j, 100 + W);
        core *c = open_core(&j, 0, 2);
        init_all(c, &j, 0);
        for (uint64_t step = 1; step <= 2; step++) {
          job_make_grads(&j, 1000 * step + W);
          run_step(c, &j, 0, step, 7919u * (uint64_t)(shuffle + 1) + step, 1 + shuffle % 3, 1e-3,
                   red == SPEC_REDUCE_SUM ? 0.25f : 1.0f);
        }
        /* And across shuffles directly: the core's bits of w0. */
        size_t nb = (size_t)j.spec.tensors[0].numel * sizeof(float);
        float *got = malloc(nb);
        assert_non_null(got);
        assert_int_equal(core_read(c, j.hash, 0, 0, ZS_DTYPE_FP32, got, nb, NULL, NULL, 0), 0);
        if (shuffle == 0)
          first_master = got;
        else {
          assert_memory_equal(got, first_master, nb);
          free(got);
        }
        core_destroy(c);
        job_free(&j);
      }
      free(first_master);
    }
  }
}

static int skip_none(const layout_piece *p, uint32_t k) {
  (void)p;
  (void)k;
  return 0;
}

static int skip_last_of_first_piece(const layout_piece *p, uint32_t k) {
  return p->tensor == 0 && p->slice == 0 && k == 3;
}

/* Reads the whole fp32 master of shard 0's pieces into one buffer. */
static float *read_all_master(core *c, job *j, uint32_t shard, size_t *len) {
  size_t total = 0;
  for (uint32_t i = 0; i < j->layout.num_pieces; i++)
    if (j->layout.pieces[i].shard == shard)
      total += (size_t)j->layout.pieces[i].numel;
  float *buf = malloc((total + 1) * sizeof(float));
  assert_non_null(buf);
  size_t at = 0;
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    assert_int_equal(core_read(c, j->hash, p->tensor, p->slice, ZS_DTYPE_FP32, buf + at,
                               p->numel * sizeof(float), NULL, NULL, 0),
                     0);
    at += (size_t)p->numel;
  }
  *len = total * sizeof(float);
  return buf;
}

static void test_invalid_pushes_get_their_status_and_change_nothing(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP16);
  job_finish(&j, 11);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  job_make_grads(&j, 12);

  /* Half of the contributions first, so that some are held. */
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 13, 0, &n, skip_none);
  size_t half = n / 2;
  assert_int_equal(push_items(c, &j, 1, items, half, 2), 0);
  size_t before_len, after_len;
  float *before = read_all_master(c, &j, 0, &before_len);
  core_missing_entry miss_before[CORE_MAX_MISSING], miss_after[CORE_MAX_MISSING];
  uint32_t nmiss = core_missing(c, 1, miss_before, CORE_MAX_MISSING);
  assert_int_equal(nmiss, n - half);
  core_counters cnt0;
  core_get_counters(c, &cnt0);

  const layout_piece *p = layout_find(&j.layout, 0, 0); /* shard 0's slice of w0 */
  const layout_piece *foreign = layout_find(&j.layout, 0, 1);
  assert_int_equal(foreign->shard, 1);
  char err[256];
  int dup = 0, rejected = 0;
  core_push_args a;

#define EXPECT_REJECT(status)                                                                      \
  do {                                                                                             \
    err[0] = 0;                                                                                    \
    dup = 7;                                                                                       \
    assert_int_equal(core_push(c, &a, &dup, err, sizeof err), (status));                           \
    assert_int_equal(dup, 0);                                                                      \
    assert_true(strlen(err) > 0);                                                                  \
    rejected++;                                                                                    \
  } while (0)

  a = push_args(&j, 2, p, 0);
  EXPECT_REJECT(ZS_ESTEP);
  assert_non_null(strstr(err, "expects step 1"));
  a = push_args(&j, 0, p, 0);
  EXPECT_REJECT(ZS_ESTEP);
  a = push_args(&j, 1, p, 0);
  a.hash ^= 1;
  EXPECT_REJECT(ZS_EHASH);
  a = push_args(&j, 1, p, 0);
  a.rank = j.W;
  EXPECT_REJECT(ZS_ERANGE);
  a = push_args(&j, 1, p, 0);
  a.micro = j.M;
  EXPECT_REJECT(ZS_ERANGE);
  a = push_args(&j, 1, p, 0);
  a.tensor = j.nt;
  EXPECT_REJECT(ZS_ENOTFOUND);
  a = push_args(&j, 1, p, 0);
  a.slice = 7; /* w0 has two slices */
  EXPECT_REJECT(ZS_ENOTFOUND);
  a = push_args(&j, 1, foreign, 0);
  EXPECT_REJECT(ZS_ENOTFOUND);
  assert_non_null(strstr(err, "owned by shard 1"));
  a = push_args(&j, 1, p, 0);
  a.dtype = (zs_dtype)0;
  EXPECT_REJECT(ZS_EDTYPE);
  a = push_args(&j, 1, p, 0);
  a.dtype = (zs_dtype)5;
  EXPECT_REJECT(ZS_EDTYPE);
  a = push_args(&j, 1, p, 0);
  a.dtype = ZS_DTYPE_FP32; /* the fp16 payload is half the length fp32 needs */
  EXPECT_REJECT(ZS_ESIZE);
  a = push_args(&j, 1, p, 0);
  a.nbytes -= 2;
  EXPECT_REJECT(ZS_ESIZE);
  char want[64];
  snprintf(want, sizeof want, "%zu bytes, expected %zu", a.nbytes, a.nbytes + 2);
  assert_non_null(strstr(err, want));
  a = push_args(&j, 1, p, 0);
  a.nbytes += 2;
  EXPECT_REJECT(ZS_ESIZE);
#undef EXPECT_REJECT

  core_counters cnt1;
  core_get_counters(c, &cnt1);
  assert_int_equal(cnt1.rejected - cnt0.rejected, (uint64_t)rejected);
  assert_int_equal(cnt1.pushes, cnt0.pushes);
  assert_int_equal(cnt1.bytes_in, cnt0.bytes_in);
  assert_int_equal(cnt1.held_bytes, cnt0.held_bytes);
  float *after = read_all_master(c, &j, 0, &after_len);
  assert_int_equal(before_len, after_len);
  assert_memory_equal(before, after, before_len);
  assert_int_equal(core_missing(c, 1, miss_after, CORE_MAX_MISSING), nmiss);
  assert_memory_equal(miss_before, miss_after,
                      (nmiss < CORE_MAX_MISSING ? nmiss : CORE_MAX_MISSING) * sizeof *miss_after);

  /* The rest of the step still gives the reference. */
  assert_int_equal(push_items(c, &j, 1, items + half, n - half, 3), 0);
  free(items);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  core_apply_result ar;
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 0.5f, 0, &ar), 0);
  job_ref_step(&j, 1e-3, 0.5f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  free(before);
  free(after);
  core_destroy(c);
  job_free(&j);
}

static void
test_an_early_contribution_is_held_until_its_turn_but_one_before_zero_is_not(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP16);
  job_finish(&j, 18);
  core *c = open_core(&j, 0, 1);
  init_all(c, &j, 0);
  job_make_grads(&j, 19);
  const layout_piece *p = layout_find(&j.layout, 1, 0);
  size_t nb = p->numel * 2;
  core_counters cnt;
  int dup = 9;
  /* k = 3 arrives before k = 0: held. */
  assert_int_equal(push_one(c, &j, 1, 1, 0, 3, &dup), 0);
  assert_int_equal(dup, 0);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, nb);
  /* k = 1 before k = 0 is added at once (the first two terms commute). */
  assert_int_equal(push_one(c, &j, 1, 1, 0, 1, &dup), 0);
  assert_int_equal(dup, 0);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, nb);
  /* k = 2 before k = 0: held. */
  assert_int_equal(push_one(c, &j, 1, 1, 0, 2, &dup), 0);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, 2 * nb);
  /* Repeats of a held one and of the one added early are duplicates and
   * hold nothing more. */
  assert_int_equal(push_one(c, &j, 1, 1, 0, 3, &dup), 0);
  assert_int_equal(dup, 1);
  assert_int_equal(push_one(c, &j, 1, 1, 0, 1, &dup), 0);
  assert_int_equal(dup, 1);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, 2 * nb);
  assert_int_equal(cnt.duplicate_pushes, 2);
  /* k = 0 adds itself and drains k = 2 and k = 3, whose buffers are kept
   * for the next early ones. */
  assert_int_equal(cnt.held_reused, 0);
  assert_int_equal(push_one(c, &j, 1, 1, 0, 0, &dup), 0);
  assert_int_equal(dup, 0);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, 0);
  assert_int_equal(cnt.held_cached_bytes, 2 * nb);
  assert_int_equal(cnt.held_reused, 0);
  /* A repeat of one already added is a duplicate too. */
  assert_int_equal(push_one(c, &j, 1, 1, 0, 0, &dup), 0);
  assert_int_equal(dup, 1);
  core_missing_entry miss[CORE_MAX_MISSING];
  uint32_t nmiss = core_missing(c, 1, miss, CORE_MAX_MISSING);
  for (uint32_t i = 0; i < nmiss && i < CORE_MAX_MISSING; i++)
    assert_true(miss[i].tensor != 1);

  /* The other pieces in order; the result is the reference. */
  for (uint32_t i = 0; i < j.layout.num_pieces; i++) {
    const layout_piece *q = &j.layout.pieces[i];
    for (uint32_t k = 0; k < j.WM && q->tensor != 1; k++)
      assert_int_equal(push_one(c, &j, 1, q->tensor, q->slice, k, &dup), 0);
  }
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  core_apply_result ar;
  assert_int_equal(apply_sync(c, &j, 1, 1e-2, 1.0f, 0, &ar), 0);
  job_ref_step(&j, 1e-2, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  /* The next step's early contribution of the same piece is held in one of
   * the two buffers kept from this one, not in fresh memory. */
  core_get_counters(c, &cnt);
  uint64_t reused = cnt.held_reused;
  assert_int_equal(cnt.held_cached_bytes, 2 * nb);
  assert_int_equal(push_one(c, &j, 2, 1, 0, 3, &dup), 0);
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.held_bytes, nb);
  assert_int_equal(cnt.held_reused, reused + 1);
  assert_int_equal(cnt.held_cached_bytes, nb);
  core_destroy(c);
  job_free(&j);
}

/* Pushes every contribution of `step` for the pieces shard 0 owns, in order. */
static void push_all_in_order(core *c, job *j, uint64_t step) {
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *q = &j->layout.pieces[i];
    for (uint32_t k = 0; k < j->WM && q->shard == 0; k++)
      assert_int_equal(push_one(c, j, step, q->tensor, q->slice, k, NULL), 0);
  }
}

/* Every piece's pinned low copy equals what core_read gives and carries the
 * CRC32C of its bytes. */
static void check_pins_match_reads(core *c, job *j, uint64_t want_version) {
  char err[256] = "";
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *q = &j->layout.pieces[i];
    if (q->shard != 0)
      continue;
    size_t nb = (size_t)q->numel * 2;
    const void *data = NULL;
    uint64_t v = 99;
    uint32_t crc = 0;
    assert_int_equal(core_pin_low(c, j->hash, q->tensor, q->slice, ZS_DTYPE_BF16, nb, &data, &v,
                                  &crc, err, sizeof err),
                     0);
    assert_int_equal(v, want_version);
    void *copy = malloc(nb);
    assert_non_null(copy);
    assert_int_equal(
        core_read(c, j->hash, q->tensor, q->slice, ZS_DTYPE_BF16, copy, nb, NULL, err, sizeof err),
        0);
    assert_memory_equal(data, copy, nb);
    assert_int_equal(crc, crc32c(0, copy, nb));
    free(copy);
    core_unpin_low(c, data);
  }
}

static core *open_core_pins(job *j) {
  core_config cfg = {.shard_id = 0, .num_shards = j->N, .threads = 2};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(c, &j->spec, &r, err, sizeof err), 0);
  return c;
}

/* core_pin_low: answers of the stored dtype straight from the low arena with
 * the CRC kept beside it, other dtypes and uninitialised pieces left to
 * core_read, the usual refusals. One peer stalled reading the bf16
 * copy made every apply wait 2 s with the state lock held. An answer still
 * pinned holds nothing back now: the apply runs to completion while it is
 * pinned, and the pinned bytes stay those of the version they were pinned
 * at, with their CRC, until released. */
static void test_pinned_answers_keep_their_bytes_while_the_apply_goes_ahead(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 31);
  core *c = open_core_pins(&j);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  size_t nb = (size_t)p->numel * 2;
  const void *data = NULL;
  uint64_t v = 0;
  uint32_t crc = 0;
  char err[256] = "";
  assert_int_equal(core_low_dtype(c), ZS_DTYPE_BF16);
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb, &data, &v, &crc, err, sizeof err),
      CORE_NOT_PINNED); /* not initialised yet */
  init_all(c, &j, 0);
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_FP32, nb * 2, &data, &v, &crc, err, sizeof err),
      CORE_NOT_PINNED);
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_FP16, nb, &data, &v, &crc, err, sizeof err),
      CORE_NOT_PINNED);
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb - 2, &data, &v, &crc, err, sizeof err),
      ZS_ESIZE);
  assert_int_equal(
      core_pin_low(c, j.hash + 1, 0, 0, ZS_DTYPE_BF16, nb, &data, &v, &crc, err, sizeof err),
      ZS_EHASH);
  check_pins_match_reads(c, &j, 0);

  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb, &data, &v, &crc, err, sizeof err), 0);
  void *before = malloc(nb);
  assert_non_null(before);
  memcpy(before, data, nb);
  job_make_grads(&j, 32);
  push_all_in_order(c, &j, 1);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  /* The apply completes with the answer still pinned (the wait has no
   * deadline: before the fix it ended only once the pin was released). */
  event e;
  event_init(&e);
  core_apply_result ar;
  assert_int_equal(core_apply(c, j.hash, 1, 1e-2, 1.0f, 0, on_apply, &e, &ar, err, sizeof err),
                   CORE_PENDING);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  event_destroy(&e);
  assert_memory_equal(data, before, nb);
  assert_int_equal(crc32c(0, data, nb), crc);
  job_ref_step(&j, 1e-2, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  check_pins_match_reads(c, &j, 1); /* new pins see the new version */
  assert_memory_equal(data, before, nb);
  core_unpin_low(c, data);
  check_pins_match_reads(c, &j, 1);
  free(before);
  core_destroy(c);
  job_free(&j);
}

/* The optimizer pass computes each piece's CRC from its chunks' (every
 * CORE_APPLY_CHUNK elements, joined with crc32c_combine): pieces of one
 * chunk, of several with a short last one, and of exactly two, stepped
 * twice with two pool threads, keep the reference bits and the CRC of their
 * bytes. */
static void test_crcs_of_pieces_longer_than_a_chunk_join_their_chunks(void **state) {
  (void)state;
  static const tensor_def defs[] = {
      {"long", 3 * CORE_APPLY_CHUNK + 80, 0}, {"b", 48, 1}, {"two", 2 * CORE_APPLY_CHUNK, 0}};
  job j;
  job_start(&j, defs, 3, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 71);
  core *c = open_core_pins(&j);
  init_all(c, &j, 0);
  check_pins_match_reads(c, &j, 0);
  for (uint64_t step = 1; step <= 2; step++) {
    job_make_grads(&j, 71 + step);
    push_all_in_order(c, &j, step);
    core_stats_result st;
    assert_int_equal(stats_sync(c, &j, step, &st), 0);
    core_apply_result ar;
    assert_int_equal(apply_sync(c, &j, step, 1e-2, 1.0f, 0, &ar), 0);
    job_ref_step(&j, 1e-2, 1.0f, 0);
    check_shard_matches_reference(c, &j, 0, step);
    check_pins_match_reads(c, &j, step);
  }
  core_destroy(c);
  job_free(&j);
}

/* A reader that never finishes costs one copy of the 16-bit weights, not
 * one per step: the second pinned version in a row is overwritten under its
 * reader, whose CRC then refuses it, while the first stays intact. */
static void test_an_answer_never_released_costs_one_copy_then_is_overtaken(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 34);
  core *c = open_core_pins(&j);
  init_all(c, &j, 0);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  size_t nb = (size_t)p->numel * 2;
  const void *d0 = NULL, *d1 = NULL;
  uint64_t v = 9;
  uint32_t crc0 = 0, crc1 = 0;
  char err[256] = "";
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb, &d0, &v, &crc0, err, sizeof err), 0);
  assert_int_equal(v, 0);
  core_stats_result st;
  core_apply_result ar;
  for (uint64_t step = 1; step <= 2; step++) {
    job_make_grads(&j, 35 + step);
    push_all_in_order(c, &j, step);
    assert_int_equal(stats_sync(c, &j, step, &st), 0);
    assert_int_equal(apply_sync(c, &j, step, 1e-2, 1.0f, 0, &ar), 0);
    assert_int_equal(ar.step, step);
    job_ref_step(&j, 1e-2, 1.0f, 0);
    if (step == 1) {
      assert_int_equal(
          core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb, &d1, &v, &crc1, err, sizeof err), 0);
      assert_int_equal(v, 1);
      assert_ptr_not_equal(d1, d0);
    }
  }
  assert_int_equal(crc32c(0, d0, nb), crc0);
  assert_true(crc32c(0, d1, nb) != crc1);
  core_unpin_low(c, d1);
  core_unpin_low(c, d0);
  check_shard_matches_reference(c, &j, 0, 2);
  check_pins_match_reads(c, &j, 2);
  core_destroy(c);
  job_free(&j);
}

static void test_reads_validate_and_convert_to_every_dtype(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_FP16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 14);
  core *c = open_core(&j, 0, 1);
  init_all(c, &j, 0);
  check_shard_matches_reference(c, &j, 0, 0);
  /* Reads are not pulls: the transport counts what it sends. */
  core_counters cnt;
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.pulls, 0);
  assert_int_equal(cnt.bytes_out, 0);

  float buf[8];
  char err[256];
  assert_int_equal(core_read(c, j.hash, 3, 0, ZS_DTYPE_FP32, buf, 4 * 4, NULL, err, sizeof err),
                   ZS_ESIZE);
  assert_int_equal(core_read(c, j.hash, 3, 0, (zs_dtype)9, buf, 5 * 4, NULL, err, sizeof err),
                   ZS_EDTYPE);
  assert_int_equal(core_read(c, j.hash, 3, 1, ZS_DTYPE_FP32, buf, 5 * 4, NULL, err, sizeof err),
                   ZS_ENOTFOUND);
  assert_int_equal(core_read(c, j.hash + 1, 3, 0, ZS_DTYPE_FP32, buf, 5 * 4, NULL, err, sizeof err),
                   ZS_EHASH);
  assert_int_equal(core_read(c, j.hash, 3, 0, ZS_DTYPE_FP32, buf, 5 * 4, NULL, err, sizeof err), 0);
  assert_int_equal(core_piece_bytes(c, j.hash, 3, 0, ZS_DTYPE_BF16), 10);
  assert_int_equal(core_piece_bytes(c, j.hash, 3, 0, ZS_DTYPE_FP32), 20);
  assert_int_equal(core_piece_bytes(c, j.hash, 3, 1, ZS_DTYPE_FP32), ZS_ENOTFOUND);
  assert_int_equal(core_piece_bytes(c, j.hash, 3, 0, (zs_dtype)0), ZS_EDTYPE);
  assert_int_equal(core_piece_bytes(c, j.hash ^ 4, 3, 0, ZS_DTYPE_FP32), ZS_EHASH);
  core_count_pull(c, 100);
  core_count_pull(c, 20);
  core_counters cnt2;
  core_get_counters(c, &cnt2);
  assert_int_equal(cnt2.pulls, 2);
  assert_int_equal(cnt2.bytes_out, 100 + 20);
  core_destroy(c);
  job_free(&j);
}

/* Every piece of shard 0 read as INT8_BLOCK (with a CRC run from 0, as a
 * single pull asks) is the encoding of its fp32 master, with that CRC; and
 * whether each piece's stored copy is this version's is `fresh`. */
static void check_int8_reads(core *c, job *j, int fresh) {
  char err[256] = "";
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *q = &j->layout.pieces[i];
    if (q->shard != 0)
      continue;
    size_t n = (size_t)q->numel, nb = (size_t)dtype_bytes(ZS_DTYPE_INT8_BLOCK, n);
    float *master = malloc(n * sizeof *master);
    unsigned char *want = malloc(nb), *got = malloc(nb);
    assert_non_null(master);
    assert_non_null(want);
    assert_non_null(got);
    assert_int_equal(core_read(c, j->hash, q->tensor, q->slice, ZS_DTYPE_FP32, master,
                               n * sizeof *master, NULL, err, sizeof err),
                     0);
    dtype_from_f32(ZS_DTYPE_INT8_BLOCK, master, want, n);
    assert_int_equal(c->pieces[c->local_of[i]].q8_fresh, fresh);
    uint32_t crc = 0;
    assert_int_equal(core_read_crc(c, j->hash, q->tensor, q->slice, ZS_DTYPE_INT8_BLOCK, got, nb,
                                   NULL, &crc, err, sizeof err),
                     0);
    assert_memory_equal(got, want, nb);
    assert_int_equal(crc, crc32c(0, want, nb));
    /* A read inside a batch continues a CRC: the same bytes, chained. */
    uint32_t chained = 7;
    assert_int_equal(core_read_crc(c, j->hash, q->tensor, q->slice, ZS_DTYPE_INT8_BLOCK, got, nb,
                                   NULL, &chained, err, sizeof err),
                     0);
    assert_int_equal(chained, crc32c(7, want, nb));
    assert_int_equal(core_read(c, j->hash, q->tensor, q->slice, ZS_DTYPE_INT8_BLOCK, got, nb - 1,
                               NULL, err, sizeof err),
                     ZS_ESIZE);
    free(master);
    free(want);
    free(got);
  }
}

/* INT8_BLOCK pulls: before any trainer asked for int8 the shard keeps no
 * int8 copy and encodes on request; from then on the copy is made with the
 * low copy, once per version (after every apply, and after a state write of
 * the master), and reads are served from it, to the same bytes. */
static void test_int8_reads_come_from_a_copy_made_once_per_version(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 21);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  check_int8_reads(c, &j, 0); /* first int8 reads: encoded on request */
  check_int8_reads(c, &j, 0); /* still version 0: no copy yet */
  job_make_grads(&j, 22);
  run_step(c, &j, 0, 1, 22, 2, 0.01, 1.0f);
  check_int8_reads(c, &j, 1); /* made by the apply */
  job_make_grads(&j, 23);
  run_step(c, &j, 0, 2, 23, 2, 0.01, 1.0f);
  check_int8_reads(c, &j, 1);
  float w[16];
  for (int i = 0; i < 16; i++)
    w[i] = (float)i - 7.5f;
  char err[256] = "";
  assert_int_equal(core_state_write(c, j.hash, 0, 0, ZS_STATE_MASTER, 32, w, sizeof w, NULL, NULL,
                                    NULL, err, sizeof err),
                   0);
  check_int8_reads(c, &j, 1); /* the written weights, not the old copy */
  core_destroy(c);
  job_free(&j);
}

static const tensor_def k_big[] = {
    {"big", 150000, 0},
    {"bias", 33, 1},
    {"mid", 70000, 1},
};

/* Sets element `a` of shard's arena in contribution k's gradient (fp32). */
static void set_arena_grad(job *j, uint32_t shard, uint32_t k, uint64_t a, float value) {
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard == shard && a >= p->arena_off && a < p->arena_off + p->numel) {
      ((float *)j->grad[p->tensor * j->WM + k])[p->offset + (a - p->arena_off)] = value;
      return;
    }
  }
  fail_msg("arena element %" PRIu64 " is padding", a);
}

static void test_stats_sum_squares_in_block_order_and_match_the_reference(void **state) {
  (void)state;
  job j;
  job_start(&j, k_big, 3, 1, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 15);
  /* Four blocks on one shard, so the block order matters. */
  assert_int_equal((j.layout.shard_elems[0] + CORE_STATS_BLOCK - 1) / CORE_STATS_BLOCK, 4);
  core *c = open_core(&j, 0, 3);
  init_all(c, &j, 0);

  /* Step 1, random gradients: the reference in block order. */
  job_make_grads(&j, 16);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 17, 0, &n, NULL);
  push_items(c, &j, 1, items, n, 2);
  free(items);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  double want;
  int nf;
  job_ref_stats(&j, 0, &want, &nf);
  assert_true(st.sum_squares == want);
  assert_int_equal(st.nonfinite, 0);
  /* And it is a sum of squares: a plain double sum agrees closely. */
  float **acc = job_ref_sums(&j);
  double plain = 0.0;
  for (uint32_t t = 0; t < j.nt; t++)
    for (uint64_t i = 0; i < j.spec.tensors[t].numel; i++)
      plain += (double)acc[t][i] * (double)acc[t][i];
  free_sums(&j, acc);
  assert_true(fabs(st.sum_squares - plain) <= 1e-9 * plain);
  assert_true(st.sum_squares > 0.0);
  core_apply_result ar;
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 1, &ar), 0);

  /* Step 2: block 0 sums to 2^54 (whose ulp is 4) and blocks 1-3 to 1.25
   * each. Added in block order, each 1.25 is rounded away; added in reverse,
   * 3.75 survives as 4. */
  for (uint32_t t = 0; t < j.nt; t++)
    for (uint32_t k = 0; k < j.WM; k++)
      memset(j.grad[t * j.WM + k], 0, j.spec.tensors[t].numel * sizeof(float));
  set_arena_grad(&j, 0, 0, 0, 134217728.0f); /* 2^27 */
  for (uint64_t b = 1; b < 4; b++) {
    set_arena_grad(&j, 0, 0, b * CORE_STATS_BLOCK + 5, 1.0f);
    set_arena_grad(&j, 0, 1, b * CORE_STATS_BLOCK + 6, 0.5f);
  }
  double forward, backward;
  job_ref_stats_ordered(&j, 0, 0, &forward, &nf);
  job_ref_stats_ordered(&j, 0, 1, &backward, &nf);
  assert_true(forward == 18014398509481984.0);
  assert_true(backward == 18014398509481988.0);
  items = shard_items(&j, 0, 18, 0, &n, NULL);
  push_items(c, &j, 2, items, n, 2);
  free(items);
  assert_int_equal(stats_sync(c, &j, 2, &st), 0);
  assert_true(st.sum_squares == forward);
  core_destroy(c);
  job_free(&j);
}

static void test_nonfinite_gradients_refuse_apply_and_skip_clears_the_accumulator(void **state) {
  (void)state;
  const float bad[2] = {INFINITY, NAN};
  for (int b = 0; b < 2; b++) {
    job j;
    job_start(&j, k_tensors, K_NT, 2, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN,
              b ? ZS_DTYPE_BF16 : ZS_DTYPE_FP32);
    job_finish(&j, 20);
    core *c = open_core(&j, 0, 2);
    init_all(c, &j, 0);
    job_make_grads(&j, 21);
    job_poke_grad(&j, 2, 3, 17, bad[b]);
    size_t n = 0;
    push_item *items = shard_items(&j, 0, 22, 5, &n, NULL);
    push_items(c, &j, 1, items, n, 2);
    free(items);
    core_stats_result st;
    assert_int_equal(stats_sync(c, &j, 1, &st), 0);
    assert_int_equal(st.nonfinite, 1);

    char err[256];
    core_apply_result ar;
    assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                     ZS_ENONFINITE);
    core_info info;
    core_get_info(c, &info);
    assert_int_equal(info.version, 0);

    assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 1, &ar), 0);
    assert_int_equal(ar.skipped, 1);
    assert_int_equal(ar.version, 1);
    assert_int_equal(ar.optimizer_steps, 0);
    job_ref_step(&j, 1e-3, 1.0f, 1);
    /* Weights and low copy as initialised. */
    check_shard_matches_reference(c, &j, 0, 1);
    core_counters cnt;
    core_get_counters(c, &cnt);
    assert_int_equal(cnt.skipped_steps, 1);
    assert_int_equal(cnt.applies, 1);

    /* The next step sees only its own gradients: the accumulator was
     * cleared, and the optimizer counts its first real step as step 1. */
    job_make_grads(&j, 23);
    run_step(c, &j, 0, 2, 24, 2, 1e-3, 1.0f);
    assert_int_equal(j.ref_opt_steps, 1);
    core_destroy(c);
    job_free(&j);
  }
}

static void test_pull_waits_until_every_piece_is_initialised(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 30);
  core *c = open_core(&j, 0, 1);
  event e;
  event_init(&e);
  uint64_t version = 77;
  char err[256];
  assert_int_equal(core_wait_version(c, j.hash, 0, clock_now_ms() + TEST_WAIT_MS, on_version, &e,
                                     &version, err, sizeof err),
                   CORE_PENDING);
  for (uint32_t i = 0; i + 1 < j.layout.num_pieces; i++) {
    const layout_piece *p = &j.layout.pieces[i];
    assert_int_equal(core_init_params(c, j.hash, p->tensor, p->slice, j.init[p->tensor] + p->offset,
                                      p->numel * sizeof(float), NULL, NULL, NULL, 0),
                     0);
  }
  /* One piece still lacks its weights: the wait cannot have completed. */
  assert_int_equal(event_fired(&e), 0);
  const layout_piece *last = &j.layout.pieces[j.layout.num_pieces - 1];
  assert_int_equal(core_init_params(c, j.hash, last->tensor, last->slice,
                                    j.init[last->tensor] + last->offset,
                                    last->numel * sizeof(float), NULL, NULL, NULL, 0),
                   0);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  assert_int_equal(e.version, 0);
  /* Now a pull of version 0 is answered at once. */
  assert_int_equal(core_wait_version(c, j.hash, 0, 0, on_version, &e, &version, err, sizeof err),
                   0);
  assert_int_equal(version, 0);
  assert_int_equal(event_fired(&e), 1);
  core_destroy(c);
  event_destroy(&e);
  job_free(&j);
}

static void test_pull_waiter_fires_when_apply_advances_the_version(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 31);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  event e;
  event_init(&e);
  uint64_t version = 0;
  char err[256];
  assert_int_equal(core_wait_version(c, j.hash, 1, clock_now_ms() + TEST_WAIT_MS, on_version, &e,
                                     &version, err, sizeof err),
                   CORE_PENDING);
  job_make_grads(&j, 32);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 33, 0, &n, NULL);
  push_items(c, &j, 1, items, n, 2);
  free(items);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  assert_int_equal(event_fired(&e), 0);
  core_apply_result ar;
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 0, &ar), 0);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  assert_int_equal(e.version, 1);
  assert_int_equal(core_wait_version(c, j.hash, 1, 0, on_version, &e, &version, err, sizeof err),
                   0);
  assert_int_equal(version, 1);
  core_destroy(c);
  event_destroy(&e);
  job_free(&j);
}

static void test_stats_waiter_fires_when_the_last_push_arrives(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 34);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  job_make_grads(&j, 35);
  event e;
  event_init(&e);
  core_stats_result st;
  char err[256];
  assert_int_equal(core_grad_stats(c, j.hash, 1, clock_now_ms() + TEST_WAIT_MS, on_stats, &e, &st,
                                   err, sizeof err),
                   CORE_PENDING);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 36, 0, &n, skip_last_of_first_piece);
  push_items(c, &j, 1, items, n, 3);
  free(items);
  assert_int_equal(event_fired(&e), 0);
  int dup = 1;
  assert_int_equal(push_one(c, &j, 1, 0, 0, 3, &dup), 0);
  assert_int_equal(dup, 0);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  assert_int_equal(e.stats.step, 1);
  double want;
  int nf;
  job_ref_stats(&j, 0, &want, &nf);
  assert_true(e.stats.sum_squares == want);
  core_destroy(c);
  event_destroy(&e);
  job_free(&j);
}

/* Misses (tensor 0 slice 0, micro 1, rank 0) and (tensor 2, micro 0, rank 1). */
static int skip_two(const layout_piece *p, uint32_t k) {
  return (p->tensor == 0 && k == 2) || (p->tensor == 2 && k == 1);
}

static void test_timeouts_fire_and_missing_names_the_contributions(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 40);
  core *c = open_core(&j, 0, 1);
  init_all(c, &j, 0);
  job_make_grads(&j, 41);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 42, 3, &n, skip_two);
  push_items(c, &j, 1, items, n, 2);
  free(items);

  event es, ev;
  event_init(&es);
  event_init(&ev);
  core_stats_result st;
  uint64_t version;
  char err[256];
  assert_int_equal(
      core_grad_stats(c, j.hash, 1, clock_now_ms() + 30, on_stats, &es, &st, err, sizeof err),
      CORE_PENDING);
  assert_int_equal(core_wait_version(c, j.hash, 1, clock_now_ms() + 20, on_version, &ev, &version,
                                     err, sizeof err),
                   CORE_PENDING);
  event_wait(&es, 1);
  event_wait(&ev, 1);
  assert_int_equal(es.status, ZS_ETIMEDOUT);
  assert_int_equal(es.stats.step, 1);
  assert_int_equal(ev.status, ZS_ETIMEDOUT);

  core_missing_entry miss[CORE_MAX_MISSING];
  assert_int_equal(core_missing(c, 1, miss, CORE_MAX_MISSING), 2);
  assert_int_equal(miss[0].tensor, 0);
  assert_int_equal(miss[0].slice, 0);
  assert_int_equal(miss[0].micro, 1);
  assert_int_equal(miss[0].rank, 0);
  assert_int_equal(miss[1].tensor, 2);
  assert_int_equal(miss[1].slice, 0);
  assert_int_equal(miss[1].micro, 0);
  assert_int_equal(miss[1].rank, 1);
  assert_int_equal(core_missing(c, 1, miss, 1), 2); /* total, even when cut short */
  assert_int_equal(core_missing(c, 2, miss, CORE_MAX_MISSING), 0);

  core_apply_result ar;
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ENOTREADY);
  assert_non_null(strstr(err, "misses 2 of"));

  /* A deadline already past answers at once. */
  assert_int_equal(core_wait_version(c, j.hash, 1, clock_now_ms() - 1, on_version, &ev, &version,
                                     err, sizeof err),
                   ZS_ETIMEDOUT);

  /* The step can still complete after the timeouts. */
  int dup;
  assert_int_equal(push_one(c, &j, 1, 0, 0, 2, &dup), 0);
  assert_int_equal(push_one(c, &j, 1, 2, 0, 1, &dup), 0);
  assert_int_equal(core_missing(c, 1, miss, CORE_MAX_MISSING), 0);
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 0, &ar), 0);
  job_ref_step(&j, 1e-3, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  core_destroy(c);
  event_destroy(&es);
  event_destroy(&ev);
  job_free(&j);
}

static void test_destroy_fails_pending_waits_with_closed(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 50);
  core *c = open_core(&j, 0, 2);
  event ev0, ev1, es;
  event_init(&ev0);
  event_init(&ev1);
  event_init(&es);
  uint64_t version;
  core_stats_result st;
  char err[256];
  /* Version 0 waits for the initial weights, version 1 for a step. */
  assert_int_equal(core_wait_version(c, j.hash, 0, 0, on_version, &ev0, &version, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(core_wait_version(c, j.hash, 1, 0, on_version, &ev1, &version, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(core_grad_stats(c, j.hash, 1, 0, on_stats, &es, &st, err, sizeof err),
                   CORE_PENDING);
  core_destroy(c);
  /* The callbacks ran before core_destroy returned. */
  assert_int_equal(ev0.fired, 1);
  assert_int_equal(ev0.status, ZS_ECLOSED);
  assert_int_equal(ev1.fired, 1);
  assert_int_equal(ev1.status, ZS_ECLOSED);
  assert_int_equal(es.fired, 1);
  assert_int_equal(es.status, ZS_ECLOSED);
  event_destroy(&ev0);
  event_destroy(&ev1);
  event_destroy(&es);
  job_free(&j);
}

/* What core_cancel_waits' callbacks saw, per wait's arg: they run on the
 * cancelling thread, so no lock is needed. */
typedef struct cancel_slot {
  int fired, canceled;
} cancel_slot;

static void on_cancel_version(void *arg, int status, uint64_t version) {
  (void)version;
  cancel_slot *s = arg;
  s->fired++;
  s->canceled += status == ZS_ECANCELED;
}

static void on_cancel_stats(void *arg, int status, const core_stats_result *r) {
  (void)r;
  on_cancel_version(arg, status, 0);
}

#define CANCEL_WAITS 50000u

/* A mass cancel (a gRPC connection dropping its parked Pulls at once) ends
 * every wait of the arg given and only those, in any order; a wait that
 * already fired is not found again; what is left still fails at destroy, so
 * the lists stay whole after waits leave from their middle. */
static void test_cancel_ends_each_wait_of_its_arg_in_any_order(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 51);
  core *c = open_core(&j, 0, 2);
  cancel_slot *slots = calloc(CANCEL_WAITS, sizeof *slots);
  assert_non_null(slots);
  uint64_t version;
  core_stats_result st;
  char err[256];
  uint64_t deadline = clock_now_ms() + TEST_WAIT_MS;
  /* Every arg waits for version 1; every other one for the statistics too. */
  for (uint32_t i = 0; i < CANCEL_WAITS; i++) {
    assert_int_equal(core_wait_version(c, j.hash, 1, deadline, on_cancel_version, &slots[i],
                                       &version, err, sizeof err),
                     CORE_PENDING);
    if (i % 2 == 0)
      assert_int_equal(
          core_grad_stats(c, j.hash, 1, deadline, on_cancel_stats, &slots[i], &st, err, sizeof err),
          CORE_PENDING);
  }
  core_counters k;
  memset(&k, 0, sizeof k);
  core_get_counters(c, &k);
  assert_int_equal(k.waiting_pulls, CANCEL_WAITS);
  assert_int_equal(k.waiting_stats, CANCEL_WAITS / 2);
  /* All but the last 10 in a scrambled order (7919 is prime to 50000). */
  uint32_t left = 10;
  for (uint32_t n = 0; n < CANCEL_WAITS; n++) {
    uint32_t i = (uint32_t)(((uint64_t)n * 7919u) % CANCEL_WAITS);
    if (i >= CANCEL_WAITS - left)
      continue;
    core_cancel_waits(c, &slots[i]);
    int want = i % 2 == 0 ? 2 : 1;
    assert_int_equal(slots[i].fired, want);
    assert_int_equal(slots[i].canceled, want);
    core_cancel_waits(c, &slots[i]); /* gone: nothing fires twice */
    assert_int_equal(slots[i].fired, want);
  }
  core_get_counters(c, &k);
  assert_int_equal(k.waiting_pulls, left);
  assert_int_equal(k.waiting_stats, left / 2);
  for (uint32_t i = CANCEL_WAITS - left; i < CANCEL_WAITS; i++)
    assert_int_equal(slots[i].fired, 0);

  /* A wait that fired on the worker is on no list: a cancel that comes
   * after it finds nothing and its callback runs once. */
  event e;
  event_init(&e);
  assert_int_equal(
      core_wait_version(c, j.hash, 0, deadline, on_version, &e, &version, err, sizeof err),
      CORE_PENDING);
  init_all(c, &j, 0);
  event_wait(&e, 1);
  core_cancel_waits(c, &e);
  assert_int_equal(event_fired(&e), 1);
  assert_int_equal(e.status, 0);

  core_destroy(c);
  for (uint32_t i = CANCEL_WAITS - left; i < CANCEL_WAITS; i++) {
    int want = i % 2 == 0 ? 2 : 1;
    assert_int_equal(slots[i].fired, want);
    assert_int_equal(slots[i].canceled, 0);
  }
  free(slots);
  event_destroy(&e);
  job_free(&j);
}

static void test_apply_repeats_give_the_recorded_outcome_and_conflicts_are_refused(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 2, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 60);
  core *c = open_core(&j, 0, 2);
  char err[256];
  core_apply_result ar;
  /* Nothing pushed yet. */
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ENOTREADY);
  /* All pushed but no initial weights. */
  job_make_grads(&j, 61);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 62, 0, &n, NULL);
  push_items(c, &j, 1, items, n, 2);
  free(items);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ENOTREADY);
  assert_non_null(strstr(err, "initial weights"));
  init_all(c, &j, 0);
  assert_int_equal(core_apply(c, j.hash, 2, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ESTEP);
  assert_int_equal(core_apply(c, j.hash, 0, 1e-3, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_ESTEP);
  assert_int_equal(core_apply(c, j.hash, 1, NAN, 1.0f, 0, on_apply, NULL, &ar, err, sizeof err),
                   ZS_EINVAL);

  core_apply_result first;
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 0, &first), 0);
  job_ref_step(&j, 1e-3, 1.0f, 0);

  /* The identical repeat answers at once with the same outcome. */
  event e;
  event_init(&e);
  memset(&ar, 0, sizeof ar);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, &e, &ar, err, sizeof err), 0);
  assert_memory_equal(&ar, &first, sizeof ar);
  assert_int_equal(core_apply(c, j.hash, 1, 2e-3, 1.0f, 0, on_apply, &e, &ar, err, sizeof err),
                   ZS_EEXIST);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 0.5f, 0, on_apply, &e, &ar, err, sizeof err),
                   ZS_EEXIST);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 1, on_apply, &e, &ar, err, sizeof err),
                   ZS_EEXIST);
  assert_int_equal(core_apply(c, j.hash, 3, 1e-3, 1.0f, 0, on_apply, &e, &ar, err, sizeof err),
                   ZS_ESTEP);
  assert_int_equal(event_fired(&e), 0);

  /* A push retried after its step was applied is acknowledged as a duplicate
   * and adds nothing; a malformed one is still refused. */
  {
    core_counters before, after;
    core_get_counters(c, &before);
    uint32_t missing = core_missing(c, 2, NULL, 0);
    assert_true(missing > 0);
    core_push_args retry = push_args(&j, 1, &j.layout.pieces[0], 0);
    int dup = 0;
    assert_int_equal(core_push(c, &retry, &dup, err, sizeof err), 0);
    assert_int_equal(dup, 1);
    retry.nbytes -= 1;
    assert_int_equal(core_push(c, &retry, &dup, err, sizeof err), ZS_ESIZE);
    core_get_counters(c, &after);
    assert_int_equal(after.duplicate_pushes, before.duplicate_pushes + 1);
    assert_int_equal(core_missing(c, 2, NULL, 0), missing);
  }

  /* The statistics of the applied step stay available; others are refused. */
  core_stats_result again;
  assert_int_equal(core_grad_stats(c, j.hash, 1, 0, on_stats, &e, &again, err, sizeof err), 0);
  assert_memory_equal(&again, &st, sizeof st);
  assert_int_equal(core_grad_stats(c, j.hash, 0, 0, on_stats, &e, &again, err, sizeof err),
                   ZS_ESTEP);
  assert_int_equal(core_grad_stats(c, j.hash, 3, 0, on_stats, &e, &again, err, sizeof err),
                   ZS_ESTEP);
  assert_int_equal(event_fired(&e), 0);

  core_counters cnt;
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.applies, 1);
  assert_int_equal(cnt.version, 1);
  assert_true(cnt.apply_seconds_total >= 0.0);
  check_shard_matches_reference(c, &j, 0, 1);
  core_destroy(c);
  event_destroy(&e);
  job_free(&j);
}

static void test_concurrent_identical_applies_share_one_run_and_outcome(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 70);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  job_make_grads(&j, 71);

  /* A stats callback that holds the worker at a gate keeps the apply queued
   * (not yet run) while the test sends its applies, so the "already running"
   * path is taken deterministically. Real callbacks must not block. */
  event gate, a1, a2;
  event_init(&gate);
  event_init(&a1);
  event_init(&a2);
  gate.gate_closed = 1;
  core_stats_result st;
  char err[256];
  assert_int_equal(core_grad_stats(c, j.hash, 1, clock_now_ms() + TEST_WAIT_MS, on_stats, &gate,
                                   &st, err, sizeof err),
                   CORE_PENDING);
  size_t n = 0;
  push_item *items = shard_items(&j, 0, 72, 0, &n, NULL);
  push_items(c, &j, 1, items, n, 2);
  free(items);
  event_wait_at_gate(&gate);

  core_apply_result ar;
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, &a1, &ar, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 0, on_apply, &a2, &ar, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-3, 1.0f, 1, on_apply, &a2, &ar, err, sizeof err),
                   ZS_EEXIST);
  assert_int_equal(core_apply(c, j.hash, 1, 5e-3, 1.0f, 0, on_apply, &a2, &ar, err, sizeof err),
                   ZS_EEXIST);
  event_open_gate(&gate);
  event_wait(&a1, 1);
  event_wait(&a2, 1);
  assert_int_equal(a1.status, 0);
  assert_int_equal(a2.status, 0);
  assert_memory_equal(&a1.apply, &a2.apply, sizeof a1.apply);
  assert_int_equal(a1.apply.version, 1);
  assert_int_equal(a1.apply.optimizer_steps, 1);
  core_counters cnt;
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.applies, 1);
  job_ref_step(&j, 1e-3, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  core_destroy(c);
  assert_int_equal(a1.fired, 1);
  assert_int_equal(a2.fired, 1);
  event_destroy(&gate);
  event_destroy(&a1);
  event_destroy(&a2);
  job_free(&j);
}

static void test_each_piece_is_owned_by_exactly_one_of_several_shards(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 3, 2, 3, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_BF16);
  job_finish(&j, 80);
  core *c[3];
  for (uint32_t s = 0; s < 3; s++)
    c[s] = open_core(&j, s, 1);
  uint32_t pieces = 0;
  uint64_t elements = 0;
  for (uint32_t s = 0; s < 3; s++) {
    core_info info;
    core_get_info(c[s], &info);
    assert_int_equal(info.shard_id, s);
    assert_int_equal(info.num_shards, 3);
    pieces += info.pieces;
    elements += info.elements;
  }
  uint64_t total = 0;
  for (uint32_t t = 0; t < j.nt; t++)
    total += j.spec.tensors[t].numel;
  assert_int_equal(pieces, j.layout.num_pieces);
  assert_int_equal(elements, total);
  for (uint32_t i = 0; i < j.layout.num_pieces; i++) {
    const layout_piece *p = &j.layout.pieces[i];
    for (uint32_t s = 0; s < 3; s++) {
      int64_t b = core_piece_bytes(c[s], j.hash, p->tensor, p->slice, ZS_DTYPE_FP32);
      if (s == p->shard)
        assert_int_equal(b, (int64_t)(p->numel * 4u));
      else
        assert_int_equal(b, ZS_ENOTFOUND);
    }
  }
  /* One full step on every shard reproduces the whole-tensor reference. */
  for (uint32_t s = 0; s < 3; s++)
    init_all(c[s], &j, s);
  job_make_grads(&j, 81);
  for (uint32_t s = 0; s < 3; s++) {
    size_t n = 0;
    push_item *items = shard_items(&j, s, 82 + s, 4, &n, NULL);
    push_items(c[s], &j, 1, items, n, 2);
    free(items);
  }
  for (uint32_t s = 0; s < 3; s++) {
    core_stats_result st;
    assert_int_equal(stats_sync(c[s], &j, 1, &st), 0);
    double want;
    int nf;
    job_ref_stats(&j, s, &want, &nf);
    assert_true(st.sum_squares == want);
    core_apply_result ar;
    assert_int_equal(apply_sync(c[s], &j, 1, 1e-3, 1.0f, 0, &ar), 0);
  }
  job_ref_step(&j, 1e-3, 1.0f, 0);
  for (uint32_t s = 0; s < 3; s++) {
    check_shard_matches_reference(c[s], &j, s, 1);
    core_destroy(c[s]);
  }
  job_free(&j);
}

static const tensor_def k_tiny[] = {{"only", 5, 0}};

static void test_a_shard_without_pieces_steps_trivially(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tiny, 1, 2, 2, 3, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 90);
  assert_int_equal(j.layout.pieces[0].shard, 0);
  core *c = open_core(&j, 2, 1);
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.pieces, 0);
  assert_int_equal(info.state_bytes, 0);
  assert_int_equal(info.initialized, 1);
  uint64_t version = 9;
  char err[256];
  assert_int_equal(core_wait_version(c, j.hash, 0, 0, on_version, NULL, &version, err, sizeof err),
                   0);
  assert_int_equal(version, 0);
  core_stats_result st;
  assert_int_equal(core_grad_stats(c, j.hash, 1, 0, on_stats, NULL, &st, err, sizeof err), 0);
  assert_true(st.sum_squares == 0.0);
  core_apply_result ar;
  assert_int_equal(apply_sync(c, &j, 1, 1e-3, 1.0f, 0, &ar), 0);
  assert_int_equal(ar.version, 1);
  assert_int_equal(core_wait_version(c, j.hash, 1, 0, on_version, NULL, &version, err, sizeof err),
                   0);
  assert_int_equal(version, 1);
  core_destroy(c);
  job_free(&j);
}

/* ------------------------------------------------------------------ a job's life */

/* The open modes, decided by the core: create joins the same spec only at
 * version 0, resume needs a job, either is core_open. */
static void test_open_modes_create_resume_either(void **state) {
  (void)state;
  job j, other;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 60);
  job_start(&other, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_SUM, ZS_DTYPE_FP32);
  job_finish(&other, 61);
  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_RESUME, &r, err, sizeof err), ZS_ENOTOPEN);
  assert_null(core_spec(c)); /* nothing was created */
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_CREATE, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 1);
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_CREATE, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 0);
  assert_int_equal(core_open_ex(c, &other.spec, CORE_OPEN_CREATE, &r, err, sizeof err), ZS_EEXIST);
  assert_non_null(strstr(err, "already has job 'core-test'"));
  assert_int_equal(core_open_ex(c, &other.spec, CORE_OPEN_RESUME, &r, err, sizeof err), ZS_EHASH);
  init_all(c, &j, 0);
  job_make_grads(&j, 62);
  push_all_in_order(c, &j, 1);
  core_stats_result st;
  core_apply_result ar;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  assert_int_equal(apply_sync(c, &j, 1, 1e-2, 1.0f, 0, &ar), 0);
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_CREATE, &r, err, sizeof err), ZS_EEXIST);
  assert_non_null(strstr(err, "to version 1"));
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_RESUME, &r, err, sizeof err), 0);
  assert_int_equal(r.version, 1);
  assert_int_equal(core_open_ex(c, &j.spec, CORE_OPEN_EITHER, &r, err, sizeof err), 0);
  assert_int_equal(r.version, 1);
  core_destroy(c);
  job_free(&j);
  job_free(&other);
}

/* A close checks what it is told to close, fails every wait of the job with
 * ZS_ENOTOPEN before it returns, and leaves an empty shard that opens the
 * next job from scratch. */
static void test_close_fails_waits_and_empties_the_shard(void **state) {
  (void)state;
  job j, other;
  job_start(&j, k_tensors, K_NT, 2, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 63);
  job_start(&other, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_FP16, SPEC_REDUCE_SUM, ZS_DTYPE_FP32);
  job_finish(&other, 64);
  core *c = open_core(&j, 0, 2);
  const spec *before = core_spec(c);
  assert_non_null(before);
  spec copy;
  uint64_t copy_hash = 0;
  assert_int_equal(core_spec_copy(c, &copy, &copy_hash), 0);
  assert_int_equal(copy_hash, j.hash);
  event ev0, ev1, es;
  event_init(&ev0);
  event_init(&ev1);
  event_init(&es);
  uint64_t version;
  core_stats_result st;
  char err[256] = "";
  assert_int_equal(core_wait_version(c, j.hash, 0, 0, on_version, &ev0, &version, err, sizeof err),
                   CORE_PENDING);
  init_all(c, &j, 0);
  event_wait(&ev0, 1);
  assert_int_equal(core_wait_version(c, j.hash, 1, 0, on_version, &ev1, &version, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(core_grad_stats(c, j.hash, 1, 0, on_stats, &es, &st, err, sizeof err),
                   CORE_PENDING);
  core_close_result cr;
  assert_int_equal(core_close(c, j.hash + 1, NULL, &cr, err, sizeof err), ZS_EHASH);
  assert_int_equal(core_close(c, 0, "other", &cr, err, sizeof err), ZS_ENOTFOUND);
  assert_non_null(strstr(err, "not 'other'"));
  assert_int_equal(event_fired(&ev1), 0); /* refused closes changed nothing */
  assert_int_equal(core_close(c, j.hash, "core-test", &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 1);
  assert_string_equal(cr.job, "core-test");
  assert_int_equal(cr.spec_hash, j.hash);
  assert_true(cr.state_bytes > 0);
  /* The callbacks ran before core_close returned. */
  assert_int_equal(ev1.fired, 1);
  assert_int_equal(ev1.status, ZS_ENOTOPEN);
  assert_int_equal(es.fired, 1);
  assert_int_equal(es.status, ZS_ENOTOPEN);
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.has_job, 0);
  assert_int_equal(info.version, 0);
  core_counters k;
  core_get_counters(c, &k);
  assert_int_equal(k.waiting_pulls, 0);
  assert_int_equal(k.waiting_stats, 0);
  assert_null(core_spec(c));
  assert_string_equal(before->job, "core-test"); /* still readable */
  spec none;
  assert_int_equal(core_spec_copy(c, &none, NULL), ZS_ENOTOPEN);
  assert_int_equal(push_one(c, &j, 1, 0, 0, 0, NULL), ZS_ENOTOPEN);
  assert_int_equal(core_close(c, j.hash, NULL, &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 0);

  /* The next job, on the same core, from its own initial weights. */
  core_open_result r;
  assert_int_equal(core_open_ex(c, &other.spec, CORE_OPEN_CREATE, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 1);
  assert_int_equal(r.version, 0);
  assert_int_equal(r.initialized, 0);
  /* core_spec's pointer is gone with the next open; a copy is the caller's. */
  assert_string_equal(copy.job, "core-test");
  assert_int_equal(spec_hash(&copy), j.hash);
  spec_free(&copy);
  init_all(c, &other, 0);
  job_make_grads(&other, 65);
  push_all_in_order(c, &other, 1);
  core_apply_result ar;
  assert_int_equal(stats_sync(c, &other, 1, &st), 0);
  assert_int_equal(apply_sync(c, &other, 1, 1e-2, 1.0f, 0, &ar), 0);
  job_ref_step(&other, 1e-2, 1.0f, 0);
  check_shard_matches_reference(c, &other, 0, 1);
  event_destroy(&ev0);
  event_destroy(&ev1);
  event_destroy(&es);
  core_destroy(c);
  job_free(&j);
  job_free(&other);
}

/* A pull answer pinned in the low arena does not hold the close: the job is
 * closed at once and the pinned bytes stay readable until released. */
static void test_close_goes_ahead_while_an_answer_is_pinned(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 66);
  core *c = open_core_pins(&j);
  init_all(c, &j, 0);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  const void *data = NULL;
  uint64_t v = 0;
  uint32_t crc = 0;
  char err[256] = "";
  assert_int_equal(core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, (size_t)p->numel * 2, &data, &v,
                                &crc, err, sizeof err),
                   0);
  core_close_result cr;
  assert_int_equal(core_close(c, j.hash, NULL, &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 1);
  assert_null(core_spec(c));
  assert_int_equal(crc32c(0, data, (size_t)p->numel * 2), crc); /* not freed */
  core_unpin_low(c, data);
  core_open_result r;
  assert_int_equal(core_open(c, &j.spec, &r, err, sizeof err), 0);
  assert_int_equal(r.created, 1);
  core_destroy(c);
  job_free(&j);
}

/* Per-group learning rates equal to lr * lr_scale give the same bits as
 * core_apply; a wrong count or value is refused, and a repeat must carry
 * the same rates. */
static void test_group_learning_rates_replace_lr_times_lr_scale(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 67);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  job_make_grads(&j, 68);
  push_all_in_order(c, &j, 1);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  const double lr = 1e-2;
  const double glr[2] = {lr * j.spec.groups[0].lr_scale, lr * j.spec.groups[1].lr_scale};
  const double one[1] = {lr};
  const double neg[2] = {lr, -1.0};
  core_apply_result ar;
  char err[256] = "";
  assert_int_equal(
      core_apply_groups(c, j.hash, 1, 5.0, one, 1, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EINVAL);
  assert_non_null(strstr(err, "1 group learning rates"));
  assert_int_equal(
      core_apply_groups(c, j.hash, 1, 5.0, neg, 2, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EINVAL);
  event e;
  event_init(&e);
  assert_int_equal(
      core_apply_groups(c, j.hash, 1, 5.0, glr, 2, 1.0f, 0, on_apply, &e, &ar, err, sizeof err),
      CORE_PENDING);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  event_destroy(&e);
  job_ref_step(&j, lr, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 1);
  /* Repeats: the same rates are the recorded outcome, others a conflict,
   * and so is the step's plain lr without them. */
  assert_int_equal(
      core_apply_groups(c, j.hash, 1, 5.0, glr, 2, 1.0f, 0, NULL, NULL, &ar, err, sizeof err), 0);
  assert_int_equal(ar.version, 1);
  const double glr2[2] = {glr[0], glr[1] * 2};
  assert_int_equal(
      core_apply_groups(c, j.hash, 1, 5.0, glr2, 2, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EEXIST);
  assert_non_null(strstr(err, "other group learning rates"));
  assert_int_equal(core_apply(c, j.hash, 1, 5.0, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
                   ZS_EEXIST);
  core_destroy(c);
  job_free(&j);
}

/* A step's group hyper-parameters (core_apply_step) are used for that step
 * only: the bits are the reference's with those values, the next step's
 * with the spec's again. Counts other than the group count and values that
 * break torch's state rules (an SGD momentum of 0 for a group with a
 * momentum buffer, nesterov with dampening) are refused with nothing
 * applied, and a repeat must carry the same values. */
static void test_step_hyper_parameters_apply_to_their_step_only(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 73);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  job_make_grads(&j, 74);
  push_all_in_order(c, &j, 1);
  core_stats_result st;
  assert_int_equal(stats_sync(c, &j, 1, &st), 0);
  /* Group 0 is AdamW, group 1 SGD with nesterov momentum 0.9. */
  const double beta1[2] = {0.5, 0.9}, momentum[2] = {0.0, 0.7}, zero[2] = {0.0, 0.0};
  const double one[1] = {0.5}, no_momentum[2] = {0.0, 0.0}, damp[2] = {0.0, 0.1};
  core_step_hparams hp = {0};
  char err[256] = "";
  core_apply_result ar;
  hp.v[CORE_HP_BETA1] = one;
  hp.n[CORE_HP_BETA1] = 1;
  assert_int_equal(
      core_apply_step(c, j.hash, 1, 1e-2, NULL, 0, &hp, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EINVAL);
  assert_non_null(strstr(err, "1 values of group_beta1"));
  hp.v[CORE_HP_BETA1] = NULL;
  hp.n[CORE_HP_BETA1] = 0;
  hp.v[CORE_HP_MOMENTUM] = no_momentum;
  hp.n[CORE_HP_MOMENTUM] = 2;
  assert_int_equal(
      core_apply_step(c, j.hash, 1, 1e-2, NULL, 0, &hp, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EINVAL);
  assert_non_null(strstr(err, "has a momentum buffer"));
  hp.v[CORE_HP_MOMENTUM] = momentum;
  hp.v[CORE_HP_DAMPENING] = damp;
  hp.n[CORE_HP_DAMPENING] = 2;
  assert_int_equal(
      core_apply_step(c, j.hash, 1, 1e-2, NULL, 0, &hp, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      ZS_EINVAL);
  assert_non_null(strstr(err, "nesterov"));
  core_counters cnt;
  core_get_counters(c, &cnt);
  assert_int_equal(cnt.version, 0);

  hp.v[CORE_HP_DAMPENING] = zero;
  hp.v[CORE_HP_BETA1] = beta1;
  hp.n[CORE_HP_BETA1] = 2;
  event e;
  event_init(&e);
  assert_int_equal(core_apply_step(c, j.hash, 1, 1e-2, NULL, 0, &hp, 1.0f, 0, on_apply, &e, &ar,
                                   err, sizeof err),
                   CORE_PENDING);
  event_wait(&e, 1);
  assert_int_equal(e.status, 0);
  event_destroy(&e);
  j.spec.groups[0].beta1 = 0.5;
  j.spec.groups[1].momentum = 0.7;
  job_ref_step(&j, 1e-2, 1.0f, 0);
  j.spec.groups[0].beta1 = 0.9;
  j.spec.groups[1].momentum = 0.9;
  check_shard_matches_reference(c, &j, 0, 1);
  /* Repeats: the same values are the recorded outcome, others a conflict. */
  assert_int_equal(
      core_apply_step(c, j.hash, 1, 1e-2, NULL, 0, &hp, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
      0);
  assert_int_equal(ar.version, 1);
  assert_int_equal(core_apply(c, j.hash, 1, 1e-2, 1.0f, 0, NULL, NULL, &ar, err, sizeof err),
                   ZS_EEXIST);
  assert_non_null(strstr(err, "other group hyper-parameters"));

  /* The next step without them runs with the spec's values. */
  job_make_grads(&j, 75);
  push_all_in_order(c, &j, 2);
  assert_int_equal(stats_sync(c, &j, 2, &st), 0);
  assert_int_equal(apply_sync(c, &j, 2, 1e-2, 1.0f, 0, &ar), 0);
  job_ref_step(&j, 1e-2, 1.0f, 0);
  check_shard_matches_reference(c, &j, 0, 2);
  core_destroy(c);
  job_free(&j);
}

/* core_state_write: a master range refreshes the low copy the pulls serve
 * (bytes and CRC; a pinned answer keeps its bytes, as under an apply), keeps the version, marks a
 * restored state as touched, and is refused while the pending step has a contribution, changing
 * nothing. */
static void test_state_writes_refresh_the_low_copy_and_wait_for_idle(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 1, 1, 1, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  job_finish(&j, 71);
  core *c = open_core_pins(&j);
  char err[256] = "";
  float buf[64];
  uint64_t v = 99, steps = 99;
  assert_int_equal(core_state_read(c, j.hash, 0, 0, ZS_STATE_MASTER, 0, buf, sizeof buf, &v, &steps,
                                   err, sizeof err),
                   ZS_ENOTREADY); /* no initial weights yet */
  init_all(c, &j, 0);
  core_state st;
  assert_int_equal(core_state_init(&st, &j.spec, 0, err, sizeof err), 0);
  const layout_piece *p = layout_find(&j.layout, 0, 0);
  memcpy(st.master + p->arena_off, j.init[0], (size_t)p->numel * sizeof(float));
  assert_int_equal(core_restore(c, &st, 7, err, sizeof err), 0);
  core_state_free(&st);
  int untouched = 0;
  assert_int_equal(core_checkpoint_origin(c, NULL, &untouched), 1);
  assert_int_equal(untouched, 1);

  size_t nb = (size_t)p->numel * 2;
  const void *data = NULL;
  uint32_t crc = 0;
  assert_int_equal(
      core_pin_low(c, j.hash, 0, 0, ZS_DTYPE_BF16, nb, &data, &v, &crc, err, sizeof err), 0);
  for (int i = 0; i < 64; i++)
    buf[i] = 100.0f + (float)i;
  assert_int_equal(core_state_write(c, j.hash, 0, 0, ZS_STATE_MASTER, 32, buf, sizeof buf, NULL, &v,
                                    &steps, err, sizeof err),
                   0);
  assert_int_equal(v, 0);
  assert_int_equal(steps, 0);
  assert_int_equal(crc32c(0, data, nb), crc); /* the pinned answer keeps its bytes */
  core_unpin_low(c, data);
  check_pins_match_reads(c, &j, 0);
  float back[64];
  uint16_t lo[64], want[64];
  assert_int_equal(core_state_read(c, j.hash, 0, 0, ZS_STATE_MASTER, 32, back, sizeof back, &v,
                                   NULL, err, sizeof err),
                   0);
  assert_memory_equal(back, buf, sizeof buf);
  uint16_t *all = malloc(nb);
  assert_int_equal(core_read(c, j.hash, 0, 0, ZS_DTYPE_BF16, all, nb, NULL, err, sizeof err), 0);
  memcpy(lo, all + 32, sizeof lo);
  dtype_from_f32(ZS_DTYPE_BF16, buf, want, 64);
  assert_memory_equal(lo, want, sizeof lo);
  free(all);
  assert_int_equal(core_checkpoint_origin(c, NULL, &untouched), 1);
  assert_int_equal(untouched, 0);

  /* Mid-step: one contribution in, and every write is refused. */
  job_make_grads(&j, 72);
  assert_int_equal(push_one(c, &j, 1, 0, 0, 0, NULL), 0);
  uint64_t five = 5;
  float other[64] = {0};
  assert_int_equal(core_state_write(c, j.hash, 0, 0, ZS_STATE_EXP_AVG, 32, other, sizeof other,
                                    NULL, NULL, NULL, err, sizeof err),
                   ZS_ENOTREADY);
  assert_non_null(strstr(err, "step 1 is in progress"));
  assert_int_equal(
      core_state_write(c, j.hash, 0, 0, 0, 0, NULL, 0, &five, NULL, &steps, err, sizeof err),
      ZS_ENOTREADY);
  assert_int_equal(core_state_read(c, j.hash, 0, 0, ZS_STATE_MASTER, 32, back, sizeof back, &v,
                                   &steps, err, sizeof err),
                   0);
  assert_memory_equal(back, buf, sizeof buf);
  assert_int_equal(steps, 0);
  core_destroy(c);
  job_free(&j);
}

/* ------------------------------------------------------------------ no gradient */

/* Which contributions of a step carry a gradient: has[t * WM + k]. */
typedef struct grad_mask {
  int has[K_NT * 4];
} grad_mask;

/* The reference step of torch with .grad None: a tensor without any
 * gradient is skipped (weights, moments and its step count stay); one with
 * some sums only the contributions that have one (the others count as
 * zeros), at its own step count tsteps[t]. */
static void job_ref_step_masked(job *j, double lr, const grad_mask *mask, uint64_t *tsteps) {
  for (uint32_t t = 0; t < j->nt; t++) {
    size_t n = (size_t)j->spec.tensors[t].numel;
    float *acc = calloc(n, sizeof(float));
    assert_non_null(acc);
    int any = 0;
    for (uint32_t k = 0; k < j->WM; k++) {
      if (!mask->has[t * j->WM + k])
        continue;
      dtype_accumulate(j->gdt, j->grad[t * j->WM + k], acc, n);
      any = 1;
    }
    if (any) {
      const spec_group *g = &j->spec.groups[j->spec.tensors[t].group];
      optim_params p = optim_params_of_group(g, j->spec.param_dtype);
      p.lr = lr * g->lr_scale;
      p.step = ++tsteps[t];
      p.grad_scale = (float)(1.0 / j->W);
      optim_plan plan;
      optim_plan_init(&plan, &p);
      optim_apply(&plan, j->ref_master[t], j->ref_m[t], j->ref_v[t], acc, j->ref_low[t], n);
    }
    free(acc);
  }
}

/* Pushes every contribution of the shard's pieces, those the mask marks
 * without a gradient as empty pushes, in reverse k order (so that empty ones
 * are held early too). */
static void push_masked(core *c, job *j, uint32_t shard, uint64_t step, const grad_mask *mask) {
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    for (uint32_t k = j->WM; k-- > 0;) {
      core_push_args a = push_args(j, step, p, k);
      if (!mask->has[p->tensor * j->WM + k]) {
        a.data = NULL;
        a.nbytes = 0;
      }
      char err[256] = "";
      int dup = 1;
      assert_int_equal(core_push(c, &a, &dup, err, sizeof err), 0);
      assert_int_equal(dup, 0);
    }
  }
}

static void wait_version(core *c, job *j, uint64_t version) {
  event e;
  event_init(&e);
  char err[256] = "";
  uint64_t v = 0;
  int rc = core_wait_version(c, j->hash, version, clock_now_ms() + TEST_WAIT_MS, on_version, &e, &v,
                             err, sizeof err);
  if (rc == CORE_PENDING) {
    event_wait(&e, 1);
    rc = e.status;
    v = e.version;
  }
  assert_int_equal(rc, 0);
  assert_int_equal(v, version);
  event_destroy(&e);
}

/* The shard's moments of every piece equal the reference's. */
static void check_moments(core *c, job *j, uint32_t shard) {
  for (uint32_t i = 0; i < j->layout.num_pieces; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    float *f = malloc((size_t)p->numel * sizeof(float));
    assert_non_null(f);
    char err[256] = "";
    assert_int_equal(core_state_read(c, j->hash, p->tensor, p->slice, ZS_STATE_EXP_AVG, 0, f,
                                     (size_t)p->numel * sizeof(float), NULL, NULL, err, sizeof err),
                     0);
    assert_memory_equal(f, j->ref_m[p->tensor] + p->offset, (size_t)p->numel * sizeof(float));
    free(f);
  }
}

static void run_without_some_gradients(int pipelined) {
  job j;
  job_start(&j, k_tensors, K_NT, 2, 1, 2, ZS_DTYPE_BF16, SPEC_REDUCE_MEAN, ZS_DTYPE_FP32);
  j.spec.pipelined = pipelined;
  job_finish(&j, 81);
  core *c = open_core(&j, 0, 2);
  init_all(c, &j, 0);
  uint64_t tsteps[K_NT] = {0};
  const double lr = 1e-2;
  for (uint64_t step = 1; step <= 4; step++) {
    grad_mask mask;
    for (size_t i = 0; i < sizeof mask.has / sizeof mask.has[0]; i++)
      mask.has[i] = 1;
    if (step == 1) {
      mask.has[1 * 2 + 0] = mask.has[1 * 2 + 1] = 0; /* b0: nobody, first used at step 2 */
      mask.has[2 * 2 + 0] = 0;                       /* w1 (SGD, split): rank 1 only */
    } else if (step == 3) {
      mask.has[0 * 2 + 0] = mask.has[0 * 2 + 1] = 0; /* w0 (AdamW, split): nobody */
      mask.has[5 * 2 + 0] = mask.has[5 * 2 + 1] = 0; /* n2 (SGD): nobody */
    }
    job_make_grads(&j, 100 + step);
    core_apply_result ar;
    if (pipelined) {
      /* The Apply comes first; each piece is applied when its last
       * contribution lands. */
      assert_int_equal(apply_sync(c, &j, step, lr, 1.0f, 0, &ar), 0);
      push_masked(c, &j, 0, step, &mask);
      wait_version(c, &j, step);
    } else {
      push_masked(c, &j, 0, step, &mask);
      core_stats_result st;
      assert_int_equal(stats_sync(c, &j, step, &st), 0);
      assert_int_equal(apply_sync(c, &j, step, lr, 1.0f, 0, &ar), 0);
      assert_int_equal(ar.version, step);
    }
    job_ref_step_masked(&j, lr, &mask, tsteps);
    check_shard_matches_reference(c, &j, 0, step);
    check_moments(c, &j, 0);
    for (uint32_t t = 0; t < K_NT; t++) {
      uint64_t got = 99;
      char err[256] = "";
      int rc = core_tensor_steps(c, j.hash, t, &got, err, sizeof err);
      if (layout_find(&j.layout, t, 0)->shard != 0 && layout_tensor_pieces(&j.layout, t) == 1) {
        assert_int_equal(rc, ZS_ENOTFOUND);
        continue;
      }
      assert_int_equal(rc, 0);
      assert_int_equal(got, tsteps[t]);
    }
  }
  /* A job-wide count written sets every tensor's; a tensor's own then. */
  char err[256] = "";
  uint64_t seven = 7, got = 0;
  assert_int_equal(
      core_state_write(c, j.hash, 0, 0, 0, 0, NULL, 0, &seven, NULL, NULL, err, sizeof err), 0);
  assert_int_equal(core_tensor_steps(c, j.hash, 0, &got, err, sizeof err), 0);
  assert_int_equal(got, 7);
  assert_int_equal(core_set_tensor_steps(c, j.hash, 0, 3, err, sizeof err), 0);
  assert_int_equal(core_tensor_steps(c, j.hash, 0, &got, err, sizeof err), 0);
  assert_int_equal(got, 3);
  assert_int_equal(core_set_tensor_steps(c, j.hash, K_NT, 3, err, sizeof err), ZS_ENOTFOUND);
  core_destroy(c);
  job_free(&j);
}

static void test_a_piece_nobody_gave_a_gradient_keeps_its_state_and_step_count(void **state) {
  (void)state;
  run_without_some_gradients(0);
}

static void test_a_pipelined_piece_nobody_gave_a_gradient_is_skipped_too(void **state) {
  (void)state;
  run_without_some_gradients(1);
}

/* ------------------------------------------------------------ elastic membership */

static core *open_elastic(job *j, uint32_t shard, uint32_t timeout_ms) {
  core_config cfg = {
      .shard_id = shard, .num_shards = j->N, .threads = 2, .trainer_timeout_ms = timeout_ms};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(c, &j->spec, &r, err, sizeof err), 0);
  init_all(c, j, shard);
  return c;
}

/* Pushes every contribution of `rank` to the pieces of `shard` (the first
 * `limit` of them). */
static void push_rank(core *c, job *j, uint32_t shard, uint64_t step, uint32_t rank,
                      uint32_t limit) {
  for (uint32_t i = 0, n = 0; i < j->layout.num_pieces && n < limit; i++) {
    const layout_piece *p = &j->layout.pieces[i];
    if (p->shard != shard)
      continue;
    n++;
    int dup = -1;
    assert_int_equal(push_one(c, j, step, p->tensor, p->slice, rank, &dup), 0);
    assert_int_equal(dup, 0);
  }
}

static int apply_members_sync(core *c, job *j, uint64_t step, const core_members *m, char *err,
                              size_t errlen) {
  event e;
  event_init(&e);
  core_apply_result out;
  int rc = core_apply_members(c, j->hash, step, 0.01, NULL, 0, NULL, m, 1.0f, 0, on_apply, &e, &out,
                              err, errlen);
  if (rc == CORE_PENDING) {
    event_wait(&e, 1);
    rc = e.status;
  }
  event_destroy(&e);
  return rc;
}

/* Issue 26: rank 2 of 3 dies halfway through its pushes of step 1: some of
 * shard 0's pieces, all of shard 1's. Shard 0 decides {0, 1} at the trainer
 * timeout; shard 1, complete, is asked for {0, 1} (the agreement's second
 * round); a backup of shard 1 that only sees the Apply sums {0, 1} too. Each
 * ends with the bits of a step rank 2 never pushed to, and refuses rank 2
 * from then on (ZS_ELEFT). */
static void test_elastic_a_rank_left_out_halfway_is_discarded_alike_on_every_shard(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 3, 1, 2, ZS_DTYPE_BF16, SPEC_REDUCE_SUM, ZS_DTYPE_BF16);
  job_finish(&j, 7);
  job_make_grads(&j, 8);
  core *c0 = open_elastic(&j, 0, 100), *c1 = open_elastic(&j, 1, 100);
  core *b0 = open_elastic(&j, 0, 100), *b1 = open_elastic(&j, 1, 100);
  for (uint32_t r = 0; r < 2; r++) {
    push_rank(b0, &j, 0, 1, r, UINT32_MAX);
    push_rank(c0, &j, 0, 1, r, UINT32_MAX);
    push_rank(c1, &j, 1, 1, r, UINT32_MAX);
    push_rank(b1, &j, 1, 1, r, UINT32_MAX);
  }
  push_rank(c0, &j, 0, 1, 2, 2);
  push_rank(b0, &j, 0, 1, 2, 2);
  push_rank(c1, &j, 1, 1, 2, UINT32_MAX);
  push_rank(b1, &j, 1, 1, 2, UINT32_MAX);

  core_stats_result s0, s1;
  assert_int_equal(stats_sync(c0, &j, 1, &s0), 0); /* after the timeout */
  assert_int_equal(s0.members.n, 2);
  assert_false(core_members_has(&s0.members, 2));
  assert_int_equal(stats_sync(c1, &j, 1, &s1), 0);
  assert_int_equal(s1.members.n, 3);
  char err[256] = "";
  /* Late: rank 2's push to shard 0 is refused, and changes nothing. */
  int dup = -1;
  const layout_piece *last = NULL;
  for (uint32_t i = 0; i < j.layout.num_pieces; i++)
    if (j.layout.pieces[i].shard == 0)
      last = &j.layout.pieces[i];
  core_push_args late = push_args(&j, 1, last, 2);
  assert_int_equal(core_push(c0, &late, &dup, err, sizeof err), ZS_ELEFT);
  assert_non_null(strstr(err, "rank 2"));
  /* The second round on shard 1. */
  event e;
  event_init(&e);
  int rc = core_grad_stats_members(c1, j.hash, 1, &s0.members, clock_now_ms() + TEST_WAIT_MS,
                                   on_stats, &e, &s1, err, sizeof err);
  if (rc == CORE_PENDING) {
    event_wait(&e, 1);
    rc = e.status;
    s1 = e.stats;
  }
  event_destroy(&e);
  assert_int_equal(rc, 0);
  assert_true(core_members_equal(&s1.members, &s0.members));
  /* Another set than the one summed is refused. */
  core_members all = s0.members;
  core_members_add(&all, 2);
  assert_int_equal(apply_members_sync(c0, &j, 1, &all, err, sizeof err), ZS_EINVAL);
  assert_int_equal(apply_members_sync(c0, &j, 1, &s0.members, err, sizeof err), 0);
  assert_int_equal(apply_members_sync(c1, &j, 1, &s0.members, err, sizeof err), 0);
  /* Backups (never asked for statistics): b1 summed all three ranks, b0
   * still waits for rank 2; the Apply decides both. */
  assert_int_equal(apply_members_sync(b1, &j, 1, &s0.members, err, sizeof err), 0);
  assert_int_equal(apply_members_sync(b0, &j, 1, &s0.members, err, sizeof err), 0);

  /* The reference: rank 2 contributed nothing (x + 0 is x). */
  for (uint32_t t = 0; t < j.nt; t++)
    memset(j.grad[t * j.WM + 2], 0, (size_t)j.spec.tensors[t].numel * 2);
  j.ref_opt_steps = 0;
  job_ref_step(&j, 0.01, 1.0f, 0);
  check_shard_matches_reference(c0, &j, 0, 1);
  check_shard_matches_reference(c1, &j, 1, 1);
  check_shard_matches_reference(b1, &j, 1, 1);
  check_shard_matches_reference(b0, &j, 0, 1);

  /* Step 2 goes on with ranks 0 and 1; rank 2 is refused everywhere. */
  late = push_args(&j, 2, last, 2);
  assert_int_equal(core_push(c0, &late, &dup, err, sizeof err), ZS_ELEFT);
  core_membership mb;
  core_get_membership(c1, &mb);
  assert_int_equal(mb.members.n, 2);
  assert_int_equal(mb.epoch, 1);
  assert_int_equal(mb.leaves, 1);
  core_destroy(c0);
  core_destroy(c1);
  core_destroy(b0);
  core_destroy(b1);
  job_free(&j);
}

static core_members ranks_of(uint32_t a, uint32_t b, uint32_t c) {
  core_members m;
  memset(&m, 0, sizeof m);
  core_members_add(&m, a);
  core_members_add(&m, b);
  if (c != UINT32_MAX)
    core_members_add(&m, c);
  return m;
}

/* Joins and clean leaves (core_member_change), keyed by step: a join or a
 * leave at the pending step, decided or not, planned for a later one, a
 * stale leave, and the membership log they leave behind. No timeout fires
 * (600 s): every set below is decided by the members' pushes and the
 * changes alone. */
static void test_elastic_joins_and_leaves_take_effect_at_their_step(void **state) {
  (void)state;
  job j;
  job_start(&j, k_tensors, K_NT, 3, 1, 2, ZS_DTYPE_BF16, SPEC_REDUCE_SUM, ZS_DTYPE_BF16);
  job_finish(&j, 7);
  job_make_grads(&j, 9);
  core *c = open_elastic(&j, 0, 600000);
  char err[256] = "";
  uint64_t v = 0;
  assert_int_equal(core_member_change(c, j.hash, 3, CORE_MEMBER_JOIN, 1, &v, err, sizeof err),
                   ZS_EINVAL);
  assert_int_equal(core_member_change(c, j.hash, 0, 9, 1, &v, err, sizeof err), ZS_EINVAL);

  /* Step 1, every rank in: its set is decided, so a join at 1 is late and
   * a leave at 1 takes effect at 2. */
  for (uint32_t r = 0; r < 3; r++)
    push_rank(c, &j, 0, 1, r, UINT32_MAX);
  core_stats_result s;
  assert_int_equal(stats_sync(c, &j, 1, &s), 0);
  assert_int_equal(s.members.n, 3);
  assert_int_equal(core_member_change(c, j.hash, 2, CORE_MEMBER_JOIN, 1, &v, err, sizeof err),
                   ZS_ESTEP);
  assert_non_null(strstr(err, "decided its members already"));
  assert_int_equal(core_member_change(c, j.hash, 2, CORE_MEMBER_LEAVE, 1, &v, err, sizeof err), 0);
  assert_int_equal(apply_members_sync(c, &j, 1, &s.members, err, sizeof err), 0);
  core_membership mb;
  core_get_membership(c, &mb);
  assert_int_equal(mb.members.n, 2);
  /* A leave for an applied step is a stale client's: ignored. */
  assert_int_equal(core_member_change(c, j.hash, 1, CORE_MEMBER_LEAVE, 1, &v, err, sizeof err), 0);
  assert_int_equal(v, 1);
  core_get_membership(c, &mb);
  assert_int_equal(mb.members.n, 2);

  /* Rank 2 asks to join at 3 while 2 is pending: planned. Step 2 needs
   * ranks 0 and 1 only. */
  assert_int_equal(core_member_change(c, j.hash, 2, CORE_MEMBER_JOIN, 3, &v, err, sizeof err), 0);
  push_rank(c, &j, 0, 2, 0, UINT32_MAX);
  push_rank(c, &j, 0, 2, 1, UINT32_MAX);
  assert_int_equal(stats_sync(c, &j, 2, &s), 0);
  core_members two = ranks_of(0, 1, UINT32_MAX);
  assert_true(core_members_equal(&s.members, &two));
  assert_int_equal(apply_members_sync(c, &j, 2, &two, err, sizeof err), 0);

  /* Step 3 has all three; rank 1 pushes, then leaves at 3 (undecided):
   * its pushes are dropped and the step completes with ranks 0 and 2. */
  push_rank(c, &j, 0, 3, 1, UINT32_MAX);
  assert_int_equal(core_member_change(c, j.hash, 1, CORE_MEMBER_LEAVE, 3, &v, err, sizeof err), 0);
  push_rank(c, &j, 0, 3, 0, UINT32_MAX);
  push_rank(c, &j, 0, 3, 2, UINT32_MAX);
  assert_int_equal(stats_sync(c, &j, 3, &s), 0);
  core_members zero_two = ranks_of(0, 2, UINT32_MAX);
  assert_true(core_members_equal(&s.members, &zero_two));
  assert_int_equal(apply_members_sync(c, &j, 3, &zero_two, err, sizeof err), 0);

  core_get_membership(c, &mb);
  assert_int_equal(mb.joins, 1);
  assert_int_equal(mb.leaves, 2);
  char log[256];
  assert_int_equal(core_member_log_format(c, log, sizeof log), 3);
  assert_string_equal(log, "1:0,1,2;2:0,1;3:0,2");
  /* Too small for all: the newest entries that fit. */
  assert_int_equal(core_member_log_format(c, log, 12), 2);
  assert_string_equal(log, "2:0,1;3:0,2");
  core_destroy(c);
  job_free(&j);
}

/* core_member_state_copy owns what it copies: the copy keeps every field
 * and entry after the source's arrays are overwritten, and a state without
 * a log or plans (a checkpoint's) stays without them. */
static void test_member_state_copy_is_deep_and_keeps_absent_arrays_absent(void **state) {
  (void)state;
  core_member_log_entry log[2];
  memset(log, 0, sizeof log);
  log[0].from_step = 1;
  core_members_add(&log[0].members, 0);
  core_members_add(&log[0].members, 2);
  log[1].from_step = 4;
  core_members_add(&log[1].members, 1);
  uint64_t join_at[3] = {0, 7, 0}, leave_at[3] = {9, 0, 0};
  core_member_state from = {.trainer_timeout_ms = 250,
                            .epoch = 3,
                            .leaves = 1,
                            .timeouts = 2,
                            .joins = 4,
                            .log = log,
                            .log_n = 2,
                            .join_at = join_at,
                            .leave_at = leave_at,
                            .nplan = 3};
  core_members_add(&from.members, 1);
  core_members_add(&from.members, 2);
  core_member_state *c = NULL;
  assert_int_equal(core_member_state_copy(&c, &from), 0);
  assert_non_null(c);
  memset(log, 0xff, sizeof log);
  join_at[1] = leave_at[0] = 0;
  assert_int_equal(c->trainer_timeout_ms, 250);
  assert_true(c->epoch == 3 && c->leaves == 1 && c->timeouts == 2 && c->joins == 4);
  assert_true(c->members.n == 2 && core_members_has(&c->members, 1) &&
              core_members_has(&c->members, 2));
  assert_int_equal(c->log_n, 2);
  assert_true(c->log != log && c->log[0].from_step == 1 && c->log[1].from_step == 4);
  assert_true(c->log[0].members.n == 2 && core_members_has(&c->log[0].members, 2));
  assert_true(c->log[1].members.n == 1 && core_members_has(&c->log[1].members, 1));
  assert_int_equal(c->nplan, 3);
  assert_true(c->join_at[1] == 7 && c->leave_at[0] == 9 && c->join_at[0] == 0);
  core_member_state_free(c);

  core_member_state bare = {.epoch = 5};
  assert_int_equal(core_member_state_copy(&c, &bare), 0);
  assert_true(c->epoch == 5 && c->log == NULL && c->join_at == NULL && c->leave_at == NULL);
  core_member_state_free(c);
  core_member_state_free(NULL);
}

int main(void) {
  /* One "apply" line per step on stderr would drown the test output. */
  log_set_level(LOG_LEVEL_WARN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_requests_without_a_job_are_refused_as_not_open),
      cmocka_unit_test(test_create_rejects_a_shard_id_outside_the_shard_count),
      cmocka_unit_test(test_open_creates_once_accepts_identical_and_rejects_other_specs),
      cmocka_unit_test(test_arenas_for_moments_exist_only_when_an_optimizer_needs_them),
      cmocka_unit_test(test_init_params_writes_once_while_the_version_is_zero),
      cmocka_unit_test(test_init_params_after_the_first_step_changes_nothing),
      cmocka_unit_test(test_init_params_in_chunks_any_order_overlaps_compared),
      cmocka_unit_test(test_identical_init_repeats_report_nothing_written),
      cmocka_unit_test(test_shuffled_concurrent_pushes_with_duplicates_match_the_reference_bitwise),
      cmocka_unit_test(test_invalid_pushes_get_their_status_and_change_nothing),
      cmocka_unit_test(
          test_an_early_contribution_is_held_until_its_turn_but_one_before_zero_is_not),
      cmocka_unit_test(test_reads_validate_and_convert_to_every_dtype),
      cmocka_unit_test(test_pinned_answers_keep_their_bytes_while_the_apply_goes_ahead),
      cmocka_unit_test(test_crcs_of_pieces_longer_than_a_chunk_join_their_chunks),
      cmocka_unit_test(test_an_answer_never_released_costs_one_copy_then_is_overtaken),
      cmocka_unit_test(test_int8_reads_come_from_a_copy_made_once_per_version),
      cmocka_unit_test(test_stats_sum_squares_in_block_order_and_match_the_reference),
      cmocka_unit_test(test_nonfinite_gradients_refuse_apply_and_skip_clears_the_accumulator),
      cmocka_unit_test(test_pull_waits_until_every_piece_is_initialised),
      cmocka_unit_test(test_pull_waiter_fires_when_apply_advances_the_version),
      cmocka_unit_test(test_stats_waiter_fires_when_the_last_push_arrives),
      cmocka_unit_test(test_timeouts_fire_and_missing_names_the_contributions),
      cmocka_unit_test(test_destroy_fails_pending_waits_with_closed),
      cmocka_unit_test(test_cancel_ends_each_wait_of_its_arg_in_any_order),
      cmocka_unit_test(test_apply_repeats_give_the_recorded_outcome_and_conflicts_are_refused),
      cmocka_unit_test(test_concurrent_identical_applies_share_one_run_and_outcome),
      cmocka_unit_test(test_each_piece_is_owned_by_exactly_one_of_several_shards),
      cmocka_unit_test(test_a_shard_without_pieces_steps_trivially),
      cmocka_unit_test(test_open_modes_create_resume_either),
      cmocka_unit_test(test_close_fails_waits_and_empties_the_shard),
      cmocka_unit_test(test_close_goes_ahead_while_an_answer_is_pinned),
      cmocka_unit_test(test_group_learning_rates_replace_lr_times_lr_scale),
      cmocka_unit_test(test_step_hyper_parameters_apply_to_their_step_only),
      cmocka_unit_test(test_state_writes_refresh_the_low_copy_and_wait_for_idle),
      cmocka_unit_test(test_a_piece_nobody_gave_a_gradient_keeps_its_state_and_step_count),
      cmocka_unit_test(test_a_pipelined_piece_nobody_gave_a_gradient_is_skipped_too),
      cmocka_unit_test(test_elastic_a_rank_left_out_halfway_is_discarded_alike_on_every_shard),
      cmocka_unit_test(test_elastic_joins_and_leaves_take_effect_at_their_step),
      cmocka_unit_test(test_member_state_copy_is_deep_and_keeps_absent_arrays_absent),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
