/*
 * test_client_state — the shards' optimizer state through libzshard
 * (zs_state_read, zs_state_write, zs_optimizer_steps, zs_set_optimizer_steps)
 * and the ReadState / WriteState calls behind them, on two real
 * zshard-server processes: the initial weights read back bit for bit, one
 * AdamW step's moments and weights equal the optimizer kernel's, written
 * state is what the next step starts from (compared bit for bit with
 * optim_apply on the written values), the low copy the pulls serve follows
 * a master write, refusals change nothing, and tensors split over both
 * shards and larger than one chunk round-trip.
 */
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/dtype.h"
#include "harness.h"
#include "server/optim/optim.h"
#include "zshard/zshard.h"

#define NT 5
#define SPLIT 64
/* t0 AdamW split over both shards, t1 AdamW whole, t2 plain SGD (no state
 * but the master), t3 SGD with momentum (an exp_avg), t4 AdamW split and
 * larger than a chunk (262144 elements) on each shard. */
static const uint64_t NUMEL[NT] = {300, 7, 64, 129, 600000};
static const uint32_t GROUP[NT] = {0, 0, 1, 2, 0};
#define NG 3
#define LR 0.01

static void group_opts(uint32_t g, zs_group_options *go) {
  if (g == 0) {
    zs_group_options_init(go, ZS_OPTIM_ADAMW);
  } else {
    zs_group_options_init(go, ZS_OPTIM_SGD);
    go->momentum = g == 2 ? 0.9 : 0.0;
    go->weight_decay = g == 2 ? 0.01 : 0.0;
  }
}

static hs_cluster cl;

static zs_client *new_client(const char *job) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl.srv[0]->addr, cl.srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = SPLIT;
  o.job = job;
  o.open_mode = ZS_OPEN_CREATE;
  o.prefetch_depth = 2;
  o.max_retries = 3;
  o.rpc_timeout_ms = 10000;
  o.step_timeout_ms = 30000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  for (uint32_t g = 0; g < NG; g++) {
    zs_group_options go;
    group_opts(g, &go);
    assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  }
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], GROUP[t], NULL, 0, NULL), ZS_OK);
  }
  return c;
}

static float *fbuf(uint32_t t) {
  float *b = calloc(NUMEL[t], sizeof(float));
  assert_non_null(b);
  return b;
}

static void fill(float **w, float seed, float scale) {
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = fbuf(t);
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = scale * (seed + (float)t + (float)(i % 97) / 16.0f - 3.0f);
  }
}

static void free_all(float **b) {
  for (uint32_t t = 0; t < NT; t++)
    free(b[t]);
}

/* Gradients of step `step`, pushed in fp32. */
static void grads(float **g, uint64_t step) {
  for (uint32_t t = 0; t < NT; t++) {
    g[t] = fbuf(t);
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      g[t][i] = ((float)((i * 7 + t + step) % 11) - 5.0f) / 8.0f;
  }
}

static void push_all(zs_client *c, float **g) {
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_push(c, t, 0, g[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), ZS_OK);
}

static void read_all(zs_client *c, zs_state_array which, float **out) {
  for (uint32_t t = 0; t < NT; t++) {
    out[t] = fbuf(t);
    if (which == ZS_STATE_MASTER || (which == ZS_STATE_EXP_AVG && GROUP[t] != 1) || GROUP[t] == 0)
      assert_int_equal(zs_state_read(c, t, which, out[t], NUMEL[t] * sizeof(float)), ZS_OK);
  }
}

static void assert_bits(float **a, float **b) {
  for (uint32_t t = 0; t < NT; t++)
    assert_memory_equal(a[t], b[t], NUMEL[t] * sizeof(float));
}

/* One step of the shards' kernel over whole tensor t: master, m, v in
 * place, with `step` the tensor's step count including this one. */
static void reference_tensor(uint32_t t, float **master, float **m, float **v, float **g,
                             uint64_t step) {
  zs_group_options go;
  group_opts(GROUP[t], &go);
  optim_params p = {
      .optimizer = go.optimizer,
      .lr = LR * go.lr_scale,
      .beta1 = go.beta1,
      .beta2 = go.beta2,
      .eps = go.eps,
      .weight_decay = go.weight_decay,
      .momentum = go.momentum,
      .dampening = go.dampening,
      .nesterov = go.nesterov,
      .bias_correction = go.bias_correction,
      .step = step,
      .grad_scale = 1.0f,
      .low_dtype = ZS_DTYPE_BF16,
  };
  optim_plan plan;
  optim_plan_init(&plan, &p);
  float *acc = fbuf(t);
  memcpy(acc, g[t], NUMEL[t] * sizeof(float));
  uint16_t *low = calloc(NUMEL[t], sizeof(uint16_t));
  optim_apply(&plan, master[t], GROUP[t] == 1 ? NULL : m[t], GROUP[t] == 0 ? v[t] : NULL, acc, low,
              NUMEL[t]);
  free(acc);
  free(low);
}

/* One step over every tensor, all at count `step`. */
static void reference_step(float **master, float **m, float **v, float **g, uint64_t step) {
  for (uint32_t t = 0; t < NT; t++)
    reference_tensor(t, master, m, v, g, step);
}

static uint64_t shard_version(uint32_t i) {
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl.srv[i]->addr, &ch), ZS_OK);
  Zshard__V1__GetInfoResponse *r = NULL;
  assert_int_equal(hs_get_info(ch, &r, NULL), 0);
  uint64_t v = r->version;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  rpc_channel_close(ch);
  return v;
}

static void close_job(zs_client *c) {
  assert_int_equal(zs_close_job(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

/* ------------------------------------------------------------------------ */

static void initial_weights_read_back_exactly(void **state) {
  (void)state;
  float *w[NT], *r[NT], *m[NT];
  fill(w, 1.0f, 1.0f);
  zs_client *c = new_client("init");
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  read_all(c, ZS_STATE_MASTER, r);
  assert_bits(r, w);
  read_all(c, ZS_STATE_EXP_AVG, m);
  for (uint64_t i = 0; i < NUMEL[0]; i++)
    assert_true(m[0][i] == 0.0f);
  uint64_t steps = 99;
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 0);
  free_all(r);
  free_all(m);
  free_all(w);
  close_job(c);
}

/* One AdamW step from zero moments: m = (1 - b1) g and v = (1 - b2) g² as the
 * kernel rounds them, and the master the kernel computes. Then chosen values
 * written into master, m and v (and a step count) are what the next step
 * starts from, bit for bit. */
static void written_state_is_what_the_next_step_starts_from(void **state) {
  (void)state;
  float *w[NT], *g1[NT], *g2[NT];
  fill(w, 1.0f, 1.0f);
  grads(g1, 1);
  grads(g2, 2);
  zs_client *c = new_client("adam");
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  push_all(c, g1);
  assert_int_equal(zs_step(c, LR, 0, 0, NULL), ZS_OK);

  float *master[NT], *m[NT], *v[NT], *rm[NT], *rv[NT], *rw[NT];
  for (uint32_t t = 0; t < NT; t++) {
    master[t] = fbuf(t);
    memcpy(master[t], w[t], NUMEL[t] * sizeof(float));
    m[t] = fbuf(t);
    v[t] = fbuf(t);
  }
  reference_step(master, m, v, g1, 1);
  read_all(c, ZS_STATE_MASTER, rw);
  read_all(c, ZS_STATE_EXP_AVG, rm);
  read_all(c, ZS_STATE_EXP_AVG_SQ, rv);
  assert_bits(rw, master);
  assert_bits(rm, m);
  assert_bits(rv, v);
  /* The moments really are the first step's: nonzero where g is, and m is
   * (1 - beta1) g to float precision. */
  for (uint64_t i = 0; i < NUMEL[0]; i++) {
    assert_true(fabsf(rm[0][i] - 0.1f * g1[0][i]) <= 1e-7f);
    assert_true(fabsf(rv[0][i] - 0.001f * g1[0][i] * g1[0][i]) <= 1e-8f);
    assert_true((g1[0][i] != 0.0f) == (rm[0][i] != 0.0f));
  }
  assert_memory_not_equal(rw[0], w[0], NUMEL[0] * sizeof(float));
  /* The master the shards pull in fp32 is the one read. */
  float *p0 = fbuf(0);
  assert_int_equal(zs_pull(c, 0, p0, ZS_DTYPE_FP32, NUMEL[0] * sizeof(float), NULL), ZS_OK);
  assert_memory_equal(p0, rw[0], NUMEL[0] * sizeof(float));
  free(p0);
  uint64_t steps = 0;
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 1);
  free_all(rw);
  free_all(rm);
  free_all(rv);

  /* Chosen values: master, m (every group that has one), v, step count 5. */
  float *nw[NT], *nm[NT], *nv[NT];
  fill(nw, 7.0f, 0.5f);
  fill(nm, 2.0f, 0.01f);
  fill(nv, 3.0f, 0.0f);
  for (uint32_t t = 0; t < NT; t++)
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      nv[t][i] = (float)(i % 13) * 1e-4f;
  for (uint32_t t = 0; t < NT; t++) {
    size_t nb = NUMEL[t] * sizeof(float);
    assert_int_equal(zs_state_write(c, t, ZS_STATE_MASTER, nw[t], nb), ZS_OK);
    if (GROUP[t] != 1)
      assert_int_equal(zs_state_write(c, t, ZS_STATE_EXP_AVG, nm[t], nb), ZS_OK);
    if (GROUP[t] == 0)
      assert_int_equal(zs_state_write(c, t, ZS_STATE_EXP_AVG_SQ, nv[t], nb), ZS_OK);
  }
  assert_int_equal(zs_set_optimizer_steps(c, 5), ZS_OK);
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 5);
  /* Writes are not steps. */
  assert_int_equal(shard_version(0), 1);
  assert_int_equal(shard_version(1), 1);
  assert_int_equal(zs_current_step(c), 2);
  read_all(c, ZS_STATE_MASTER, rw);
  assert_bits(rw, nw);
  free_all(rw);
  /* The pulls see the new weights at once, in the stored bf16 copy too (the
   * prefetched old ones were dropped). */
  for (uint32_t t = 0; t < NT; t++) {
    uint16_t *lo = calloc(NUMEL[t], 2), *want = calloc(NUMEL[t], 2);
    float *f = fbuf(t);
    assert_int_equal(zs_pull(c, t, lo, ZS_DTYPE_BF16, NUMEL[t] * 2, NULL), ZS_OK);
    dtype_from_f32(ZS_DTYPE_BF16, nw[t], want, NUMEL[t]);
    assert_memory_equal(lo, want, NUMEL[t] * 2);
    assert_int_equal(zs_pull(c, t, f, ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), ZS_OK);
    assert_memory_equal(f, nw[t], NUMEL[t] * sizeof(float));
    free(lo);
    free(want);
    free(f);
  }

  /* The next step starts from them, with step count 6. */
  push_all(c, g2);
  assert_int_equal(zs_step(c, LR, 0, 0, NULL), ZS_OK);
  reference_step(nw, nm, nv, g2, 6);
  read_all(c, ZS_STATE_MASTER, rw);
  read_all(c, ZS_STATE_EXP_AVG, rm);
  read_all(c, ZS_STATE_EXP_AVG_SQ, rv);
  assert_bits(rw, nw);
  for (uint32_t t = 0; t < NT; t++) {
    if (GROUP[t] != 1)
      assert_memory_equal(rm[t], nm[t], NUMEL[t] * sizeof(float));
    if (GROUP[t] == 0)
      assert_memory_equal(rv[t], nv[t], NUMEL[t] * sizeof(float));
  }
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 6);
  free_all(rw);
  free_all(rm);
  free_all(rv);
  free_all(nw);
  free_all(nm);
  free_all(nv);
  free_all(master);
  free_all(m);
  free_all(v);
  free_all(g1);
  free_all(g2);
  free_all(w);
  close_job(c);
}

/* A raw WriteState of piece (tensor, slice 0) of master on its shard. */
static int raw_write(zs_client *c, uint32_t tensor, int array, uint64_t offset, const void *data,
                     size_t len, uint64_t hash, rpc_status *st) {
  uint32_t shard = 0;
  assert_int_equal(zs_tensor_slice(c, tensor, 0, &shard, NULL, NULL), ZS_OK);
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl.srv[shard]->addr, &ch), ZS_OK);
  Zshard__V1__WriteStateRequest req = ZSHARD__V1__WRITE_STATE_REQUEST__INIT;
  req.spec_hash = hash;
  req.tensor = tensor;
  req.slice = 0;
  req.array = (Zshard__V1__StateArray)array;
  req.offset = offset;
  req.data.data = (uint8_t *)(uintptr_t)data;
  req.data.len = len;
  Zshard__V1__WriteStateResponse *resp = NULL;
  int rc = rpc_call(ch, "/zshard.v1.ZShard/WriteState", &req.base,
                    &zshard__v1__write_state_response__descriptor, (ProtobufCMessage **)&resp,
                    HS_CALL_TIMEOUT_MS, st);
  if (resp)
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  rpc_channel_close(ch);
  fprintf(stderr, "WriteState t%" PRIu32 " array %d offset %" PRIu64 " %zu bytes: %s %s\n", tensor,
          array, offset, len, zs_err_name(rc), st->message);
  return rc;
}

static int raw_read(zs_client *c, uint32_t tensor, int array, uint64_t offset, uint64_t count,
                    rpc_status *st) {
  uint32_t shard = 0;
  assert_int_equal(zs_tensor_slice(c, tensor, 0, &shard, NULL, NULL), ZS_OK);
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl.srv[shard]->addr, &ch), ZS_OK);
  Zshard__V1__ReadStateRequest req = ZSHARD__V1__READ_STATE_REQUEST__INIT;
  req.spec_hash = zs_spec_hash(c);
  req.tensor = tensor;
  req.array = (Zshard__V1__StateArray)array;
  req.offset = offset;
  req.count = count;
  Zshard__V1__ReadStateResponse *resp = NULL;
  int rc = rpc_call(ch, "/zshard.v1.ZShard/ReadState", &req.base,
                    &zshard__v1__read_state_response__descriptor, (ProtobufCMessage **)&resp,
                    HS_CALL_TIMEOUT_MS, st);
  if (resp) {
    assert_int_equal(resp->data.len, count * sizeof(float));
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  rpc_channel_close(ch);
  fprintf(stderr, "ReadState t%" PRIu32 " array %d [%" PRIu64 ", +%" PRIu64 "): %s %s\n", tensor,
          array, offset, count, zs_err_name(rc), st->message);
  return rc;
}

static void refusals_change_nothing(void **state) {
  (void)state;
  float *w[NT], *g[NT], *r[NT];
  fill(w, 1.0f, 1.0f);
  grads(g, 1);
  zs_client *c = new_client("refusals");
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  uint64_t hash = zs_spec_hash(c);
  float *buf = fbuf(3);
  rpc_status st;

  /* Arrays the group does not keep. */
  assert_int_equal(zs_state_read(c, 2, ZS_STATE_EXP_AVG, buf, NUMEL[2] * sizeof(float)), ZS_EINVAL);
  fprintf(stderr, "%s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "SGD without momentum"));
  assert_non_null(strstr(zs_last_error(), "keeps no exp_avg"));
  assert_non_null(strstr(zs_last_error(), "t2"));
  assert_int_equal(zs_state_write(c, 2, ZS_STATE_EXP_AVG, buf, NUMEL[2] * sizeof(float)),
                   ZS_EINVAL);
  assert_int_equal(zs_state_read(c, 3, ZS_STATE_EXP_AVG_SQ, buf, NUMEL[3] * sizeof(float)),
                   ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "keeps no exp_avg_sq"));
  assert_int_equal(zs_state_read(c, 3, ZS_STATE_EXP_AVG, buf, NUMEL[3] * sizeof(float)), ZS_OK);
  assert_int_equal(zs_state_read(c, 3, (zs_state_array)7, buf, NUMEL[3] * sizeof(float)),
                   ZS_EINVAL);
  /* Sizes: the client's check, and the shard's on a raw call. */
  assert_int_equal(zs_state_write(c, 1, ZS_STATE_MASTER, buf, 6 * sizeof(float)), ZS_ESIZE);
  assert_non_null(strstr(zs_last_error(), "'t1'"));
  float junk[8] = {9, 9, 9, 9, 9, 9, 9, 9};
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, 0, junk, 6, hash, &st), ZS_ESIZE);
  /* Ranges outside the piece (t1 has 7 elements). */
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, 4, junk, 4 * sizeof(float), hash, &st),
                   ZS_ERANGE);
  assert_non_null(strstr(st.message, "4 master elements from element 4"));
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, UINT64_MAX, junk, sizeof(float), hash, &st),
                   ZS_ERANGE);
  assert_int_equal(raw_read(c, 1, ZS_STATE_MASTER, 3, 5, &st), ZS_ERANGE);
  assert_int_equal(raw_read(c, 1, ZS_STATE_MASTER, 0, UINT64_MAX / 2, &st), ZS_ERANGE);
  assert_int_equal(raw_read(c, 1, 0, 0, 7, &st), ZS_EINVAL);
  assert_int_equal(raw_read(c, 1, ZS_STATE_MASTER, 2, 5, &st), ZS_OK);
  /* Another job's hash; an unknown array. */
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, 0, junk, sizeof(float), hash ^ 1, &st),
                   ZS_EHASH);
  assert_int_equal(raw_write(c, 1, 4, 0, junk, sizeof(float), hash, &st), ZS_EINVAL);
  /* A write during a step: this client's pushes, then another trainer's
   * raw write, once a contribution is on the shard. */
  assert_int_equal(zs_push(c, 1, 0, g[1], ZS_DTYPE_FP32, NUMEL[1] * sizeof(float), NULL), ZS_OK);
  assert_int_equal(zs_state_write(c, 1, ZS_STATE_MASTER, junk, NUMEL[1] * sizeof(float)),
                   ZS_ENOTREADY);
  fprintf(stderr, "%s\n", zs_last_error());
  assert_int_equal(zs_set_optimizer_steps(c, 3), ZS_ENOTREADY);
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, 0, junk, sizeof(float), hash, &st),
                   ZS_ENOTREADY);
  assert_non_null(strstr(st.message, "step 1 is in progress"));
  /* Nothing changed: the master is the initial weights, the count 0. */
  read_all(c, ZS_STATE_MASTER, r);
  assert_bits(r, w);
  free_all(r);
  uint64_t steps = 9;
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 0);
  /* And the step goes on. */
  for (uint32_t t = 0; t < NT; t++)
    if (t != 1)
      assert_int_equal(zs_push(c, t, 0, g[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL),
                       ZS_OK);
  assert_int_equal(zs_step(c, LR, 0, 0, NULL), ZS_OK);
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 1);
  /* Between steps a write goes through again. */
  assert_int_equal(raw_write(c, 1, ZS_STATE_MASTER, 0, junk, sizeof(float), hash, &st), ZS_OK);
  free(buf);
  free_all(g);
  free_all(w);
  close_job(c);
}

/* Tensors split over both shards, one of them larger than a chunk on each,
 * round-trip every array they have. */
static void split_tensors_round_trip(void **state) {
  (void)state;
  float *w[NT], *x[NT];
  fill(w, 1.0f, 1.0f);
  fill(x, 5.0f, 0.25f);
  zs_client *c = new_client("split");
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  const uint32_t split[2] = {0, 4};
  for (int k = 0; k < 2; k++) {
    uint32_t t = split[k], n = 0, s0 = 9, s1 = 9;
    assert_int_equal(zs_tensor_slices(c, t, &n), ZS_OK);
    assert_int_equal(n, 2);
    assert_int_equal(zs_tensor_slice(c, t, 0, &s0, NULL, NULL), ZS_OK);
    assert_int_equal(zs_tensor_slice(c, t, 1, &s1, NULL, NULL), ZS_OK);
    assert_int_not_equal(s0, s1);
    size_t nb = NUMEL[t] * sizeof(float);
    for (int a = ZS_STATE_MASTER; a <= ZS_STATE_EXP_AVG_SQ; a++) {
      float *back = fbuf(t);
      /* Each array its own values, so a mix-up shows. */
      for (uint64_t i = 0; i < NUMEL[t]; i++)
        x[t][i] += (float)a;
      assert_int_equal(zs_state_write(c, t, (zs_state_array)a, x[t], nb), ZS_OK);
      assert_int_equal(zs_state_read(c, t, (zs_state_array)a, back, nb), ZS_OK);
      assert_memory_equal(back, x[t], nb);
      free(back);
    }
  }
  free_all(w);
  free_all(x);
  close_job(c);
}

/* A tensor every trainer pushed "no gradient" for (zs_push and
 * zs_push_many with no buffer) is skipped by the shards: weights and
 * moments stay, and so does its own step count, which the next step's bias
 * correction then follows. */
static void a_tensor_without_a_gradient_is_skipped_and_keeps_its_count(void **state) {
  (void)state;
  float *w[NT], *g[NT], *master[NT], *m[NT], *v[NT], *rw[NT], *rm[NT];
  fill(w, 1.0f, 1.0f);
  zs_client *c = new_client("nograd");
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    master[t] = fbuf(t);
    memcpy(master[t], w[t], NUMEL[t] * sizeof(float));
    m[t] = fbuf(t);
    v[t] = fbuf(t);
  }
  uint64_t tsteps[NT] = {0};
  /* Step 1: t0 (split) and t1 without a gradient, one push each; step 2:
   * t1 again, in a batch with the others. */
  for (uint64_t step = 1; step <= 2; step++) {
    grads(g, step);
    int has[NT] = {step == 2, 0, 1, 1, 1};
    if (step == 1) {
      for (uint32_t t = 0; t < NT; t++)
        assert_int_equal(zs_push(c, t, 0, has[t] ? g[t] : NULL, ZS_DTYPE_FP32,
                                 has[t] ? NUMEL[t] * sizeof(float) : 0, NULL),
                         ZS_OK);
    } else {
      uint32_t ids[NT];
      const void *bufs[NT];
      size_t nbytes[NT];
      for (uint32_t t = 0; t < NT; t++) {
        ids[t] = t;
        bufs[t] = has[t] ? g[t] : NULL;
        nbytes[t] = has[t] ? NUMEL[t] * sizeof(float) : 0;
      }
      assert_int_equal(zs_push_many(c, NT, ids, 0, bufs, ZS_DTYPE_FP32, nbytes, NULL), ZS_OK);
    }
    assert_int_equal(zs_step(c, LR, 0, 0, NULL), ZS_OK);
    for (uint32_t t = 0; t < NT; t++)
      if (has[t])
        reference_tensor(t, master, m, v, g, ++tsteps[t]);
    read_all(c, ZS_STATE_MASTER, rw);
    read_all(c, ZS_STATE_EXP_AVG, rm);
    assert_bits(rw, master);
    for (uint32_t t = 0; t < NT; t++)
      if (GROUP[t] != 1)
        assert_memory_equal(rm[t], m[t], NUMEL[t] * sizeof(float));
    for (uint32_t t = 0; t < NT; t++) {
      uint64_t n = 99;
      assert_int_equal(zs_tensor_steps(c, t, &n), ZS_OK);
      assert_int_equal(n, tsteps[t]);
    }
    free_all(rw);
    free_all(rm);
    free_all(g);
  }
  assert_memory_equal(master[1], w[1], NUMEL[1] * sizeof(float));
  uint64_t steps = 0;
  assert_int_equal(zs_optimizer_steps(c, &steps), ZS_OK);
  assert_int_equal(steps, 2);
  /* Setting a tensor's count; the job's sets every tensor's. */
  assert_int_equal(zs_set_tensor_steps(c, 4, 9), ZS_OK);
  assert_int_equal(zs_tensor_steps(c, 4, &steps), ZS_OK);
  assert_int_equal(steps, 9);
  assert_int_equal(zs_set_optimizer_steps(c, 3), ZS_OK);
  assert_int_equal(zs_tensor_steps(c, 1, &steps), ZS_OK);
  assert_int_equal(steps, 3);
  assert_int_equal(zs_tensor_steps(c, NT, &steps), ZS_ENOTFOUND);
  free_all(master);
  free_all(m);
  free_all(v);
  free_all(w);
  close_job(c);
}

static int setup(void **state) {
  (void)state;
  return hs_cluster_start(&cl, 2, NULL);
}

static int teardown(void **state) {
  (void)state;
  return hs_cluster_stop(&cl);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(initial_weights_read_back_exactly),
      cmocka_unit_test(written_state_is_what_the_next_step_starts_from),
      cmocka_unit_test(refusals_change_nothing),
      cmocka_unit_test(split_tensors_round_trip),
      cmocka_unit_test(a_tensor_without_a_gradient_is_skipped_and_keeps_its_count),
  };
  int failures = cmocka_run_group_tests(tests, setup, teardown);
  hs_finish(failures);
  return failures ? 1 : 0;
}
