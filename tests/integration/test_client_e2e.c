/*
 * test_client_e2e — libzshard against real zshard-server processes.
 *
 * The central check: W trainer threads, each with its own client (rank r),
 * train a small model with M = 2 micro-batches per step for K steps on N
 * shards, with fp32, bf16, fp16 and int8 blocks (with and without error
 * feedback) on the wire; the gradients depend on the
 * parameters each trainer pulled, so pulls and pushes both matter. After the
 * run every parameter, pulled back in fp32, is bit-identical to a
 * single-process reference of the same training computed here: the wire
 * rounding of every pull and push, contributions summed in (micro, rank)
 * order, the shard's grad_scale = (float)(coef / W), and the optimizer kernel
 * itself (optim_apply), with torch-default AdamW, a no-decay AdamW group with
 * lr_scale 0.5 and a Nesterov SGD group. Some ranks use the library's
 * prefetch and coalescing, so those paths are held to the same bits; and a
 * model of many small tensors trains to the same bits whether its pieces
 * travel one by one or in batches (PUSH_BATCH / PULL_BATCH).
 *
 * Then: an injected inf skips the step on every shard and, per DeepSpeed's
 * hysteresis, the second one halves the loss scale; clipping matches
 * clip_grad_norm_'s formula on every rank; a trainer process killed in the
 * middle of a step gives the others ZS_ETIMEDOUT naming its rank and the
 * tensors it did not push; one client shared by several trainer threads
 * gives the same bits; misuse against a live job returns errors.
 *
 * The killed trainer is this program re-executed (/proc/self/exe) with
 * "--trainer-child", so that no process forks while gRPC threads run.
 *
 * CTest runs the program twice: on the default transport, the data plane,
 * and with ZSHARD_TRANSPORT=grpc; every trainer checks that its pushes and
 * pulls really take the transport of the run.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/dtype.h"
#include "harness.h"
#include "internal.h"
#include "server/optim/optim.h"
#include "trainers.h"
#include "zshard/zshard.h"

extern char **environ;

/* ---- the model ------------------------------------------------------------------ */

#define NT 6
#define NG 3
#define K_MAX 4
#define W_MAX 3
#define M_MAX 2
#define SPLIT 64

/* Both sides of the split threshold: split tensors with short last slices,
 * one exactly at the threshold, whole ones of odd sizes. */
static const tr_tensor TENSORS[NT] = {
    {"embed.weight", 200, 0}, {"embed.bias", 37, 1},  {"proj.weight", 130, 0},
    {"proj.bias", 5, 2},      {"head.weight", 64, 0}, {"norm.weight", 1, 1},
};

static void group_options(uint32_t g, zs_group_options *o) {
  switch (g) {
  case 0:
    zs_group_options_init(o, ZS_OPTIM_ADAMW); /* torch's defaults, weight decay 0.01 */
    break;
  case 1:
    zs_group_options_init(o, ZS_OPTIM_ADAMW);
    o->weight_decay = 0;
    o->lr_scale = 0.5;
    break;
  default:
    zs_group_options_init(o, ZS_OPTIM_SGD);
    o->momentum = 0.9;
    o->nesterov = 1;
    o->weight_decay = 0.001;
    break;
  }
}

static float init_value(uint32_t t, uint64_t i) {
  return (float)sin(0.37 * (double)(i + 1) + 1.3 * t) * 0.5f;
}

/* The "backward": depends on the parameter the trainer pulled. */
static float grad_value(uint64_t s, uint32_t r, uint32_t m, uint32_t t, uint64_t i, float pulled) {
  return 0.5f * pulled + 0.01f * tr_noise(s, r, m, t, i) + 0.001f;
}

/* The pieces of tensor t on N shards, by the layout's documented rule: a
 * tensor below the split threshold is one piece; a larger one is cut into
 * slices of roundup(ceil(numel / N), 16) elements, the last one shorter.
 * Fills offsets (count + 1 entries) and returns the count. */
static uint32_t pieces_of(uint32_t t, uint32_t N, uint64_t *at) {
  uint64_t n = TENSORS[t].numel;
  uint64_t c = n < SPLIT ? n : (n / N + (n % N != 0) + 15) / 16 * 16;
  uint32_t k = 0;
  for (uint64_t o = 0; o < n; o += c)
    at[k++] = o;
  at[k] = n;
  return k;
}

/* in through the wire dtype and back, piece by piece as the transfers
 * convert (a block-quantized dtype's blocks restart in every piece). */
static void wire_round_tensor(zs_dtype d, uint32_t t, uint32_t N, const float *in, float *out) {
  uint64_t at[HS_MAX_SHARDS + 2];
  uint32_t k = pieces_of(t, N, at);
  unsigned char *q = malloc((size_t)dtype_bytes(ZS_DTYPE_FP32, TENSORS[t].numel) + 1);
  assert_non_null(q);
  for (uint32_t p = 0; p < k; p++) {
    dtype_from_f32(d, in + at[p], q, (size_t)(at[p + 1] - at[p]));
    dtype_to_f32(d, q, out + at[p], (size_t)(at[p + 1] - at[p]));
  }
  free(q);
}

/* ---- one run ----------------------------------------------------------------------- */

typedef struct run_cfg {
  uint32_t N, W, M, K;
  zs_dtype wire;
  uint32_t ef; /* the clients' error_feedback */
  /* Group 1's own wire dtype (zs_group_options), 0 for the client's. */
  zs_dtype group1_wire;
  double lr, clip;
  zs_loss_scaling scaling;
  uint32_t inject_steps;    /* bit s: rank W-1 pushes an inf at step s */
  uint32_t step_timeout_ms; /* 0: 20 s */
  char addrs[HS_MAX_SHARDS * 32];
  char job[64];
} run_cfg;

/* Tensor t's wire dtype: its group's, else the run's. */
static zs_dtype tensor_wire(const run_cfg *cfg, uint32_t t) {
  return TENSORS[t].group == 1 && cfg->group1_wire ? cfg->group1_wire : cfg->wire;
}

/* Wire bytes of one push or pull of every tensor. */
static uint64_t model_wire_bytes(const run_cfg *cfg) {
  uint64_t total = 0, at[HS_MAX_SHARDS + 2];
  for (uint32_t t = 0; t < NT; t++) {
    uint32_t k = pieces_of(t, cfg->N, at);
    for (uint32_t p = 0; p < k; p++)
      total += dtype_bytes(tensor_wire(cfg, t), at[p + 1] - at[p]);
  }
  return total;
}

typedef struct rank_out {
  int rc;
  char err[512];
  zs_step_result res[K_MAX];
  zs_timing timing[K_MAX];
  double scale_used[K_MAX];
  float *final[NT]; /* the last version, pulled through the wire dtype */
} rank_out;

static int injected(const run_cfg *cfg, uint64_t s, uint32_t r, uint32_t m, uint32_t t,
                    uint64_t i) {
  return (cfg->inject_steps >> s & 1u) && r == cfg->W - 1 && m == cfg->M - 1 && t == 0 && i == 3;
}

static int client_for(const run_cfg *cfg, uint32_t rank, zs_dtype pull_wire, zs_client **out) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg->addrs;
  o.rank = rank;
  o.world_size = cfg->W;
  o.grad_accum = cfg->M;
  o.job = cfg->job;
  o.push_dtype = cfg->wire;
  o.pull_dtype = pull_wire;
  o.error_feedback = cfg->ef;
  o.split_threshold = SPLIT;
  o.step_timeout_ms = cfg->step_timeout_ms ? cfg->step_timeout_ms : 20000;
  o.loss_scaling = cfg->scaling;
  /* Odd ranks prefetch; rank 0 sends every piece on its own, rank 2 uses
   * small buckets and rank 1 the default ones: the same bits are expected
   * whichever path a transfer takes. */
  o.prefetch_depth = rank % 2 ? 2 : 0;
  if (rank == 0)
    o.reduce_bucket_size = o.allgather_bucket_size = 0;
  if (rank == 2)
    o.reduce_bucket_size = o.allgather_bucket_size = 4096;
  int rc = zs_client_open(&o, out);
  for (uint32_t g = 0; rc == ZS_OK && g < NG; g++) {
    zs_group_options go;
    group_options(g, &go);
    /* Trainers only: a client that reads the fp32 masters back (pull_wire
     * 0) must not narrow group 1. */
    if (g == 1 && pull_wire != 0)
      go.push_dtype = go.pull_dtype = cfg->group1_wire;
    rc = zs_add_group(*out, &go, NULL);
  }
  for (uint32_t t = 0; rc == ZS_OK && t < NT; t++)
    rc = zs_add_tensor(*out, TENSORS[t].name, TENSORS[t].numel, TENSORS[t].group, NULL, 0, NULL);
  return rc;
}

static float *init_tensor(uint32_t t) {
  float *p = malloc(TENSORS[t].numel * sizeof *p);
  for (uint64_t i = 0; p && i < TENSORS[t].numel; i++)
    p[i] = init_value(t, i);
  return p;
}

static int trainer_fail(rank_out *out, int rc, const char *what) {
  out->rc = rc;
  snprintf(out->err, sizeof out->err, "%s: %s: %s", what, zs_err_name(rc), zs_last_error());
  return rc;
}

/* The transport this run exercises (see the top of the file). */
static zs_transport run_transport(void) {
  const char *env = getenv("ZSHARD_TRANSPORT");
  return env && strcmp(env, "grpc") == 0 ? ZS_TRANSPORT_GRPC : ZS_TRANSPORT_DATA;
}

/* Every shard of an open client is reached over the run's transport. */
static int check_transport(zs_client *c, uint32_t nshards, rank_out *out) {
  for (uint32_t i = 0; i < nshards; i++) {
    if (zc_shard_transport(c, i) != run_transport()) {
      out->rc = ZS_EINTERNAL;
      snprintf(out->err, sizeof out->err, "shard %" PRIu32 " is not reached over %s", i,
               run_transport() == ZS_TRANSPORT_GRPC ? "gRPC" : "the data plane");
      return ZS_EINTERNAL;
    }
  }
  return ZS_OK;
}

static int trainer_body(const run_cfg *cfg, uint32_t rank, rank_out *out, zs_client *c) {
  float *param[NT] = {0}, *grad[M_MAX][NT] = {{0}}, *init[NT] = {0};
  int rc = ZS_OK;
  for (uint32_t t = 0; t < NT; t++) {
    param[t] = calloc(TENSORS[t].numel, sizeof(float));
    out->final[t] = calloc(TENSORS[t].numel, sizeof(float));
    init[t] = init_tensor(t);
    for (uint32_t m = 0; m < cfg->M; m++)
      grad[m][t] = calloc(TENSORS[t].numel, sizeof(float));
  }
  if ((rc = zs_open_job(c, (const float *const *)init)) != ZS_OK) {
    trainer_fail(out, rc, "zs_open_job");
    goto done;
  }
  if ((rc = check_transport(c, cfg->N, out)) != ZS_OK)
    goto done;
  for (uint64_t s = 1; s <= cfg->K; s++) {
    zs_request *pulls[NT], *pushes[M_MAX][NT];
    for (uint32_t t = 0; t < NT; t++)
      if ((rc = zs_pull(c, t, param[t], ZS_DTYPE_FP32, TENSORS[t].numel * sizeof(float),
                        &pulls[t])) != ZS_OK) {
        trainer_fail(out, rc, "zs_pull");
        goto done;
      }
    for (uint32_t t = 0; t < NT; t++)
      if ((rc = zs_wait(pulls[t])) != ZS_OK) {
        trainer_fail(out, rc, "pull");
        goto done;
      }
    const float scale = (float)zs_loss_scale(c);
    out->scale_used[s - 1] = scale;
    for (uint32_t m = 0; m < cfg->M; m++) {
      for (uint32_t t = NT; t-- > 0;) {
        for (uint64_t i = 0; i < TENSORS[t].numel; i++)
          grad[m][t][i] = injected(cfg, s, rank, m, t, i)
                              ? INFINITY
                              : grad_value(s, rank, m, t, i, param[t][i]) * scale;
        if ((rc = zs_push(c, t, m, grad[m][t], ZS_DTYPE_FP32, TENSORS[t].numel * sizeof(float),
                          &pushes[m][t])) != ZS_OK) {
          trainer_fail(out, rc, "zs_push");
          goto done;
        }
      }
    }
    for (uint32_t m = 0; m < cfg->M; m++)
      for (uint32_t t = 0; t < NT; t++)
        if ((rc = zs_wait(pushes[m][t])) != ZS_OK) {
          trainer_fail(out, rc, "push");
          goto done;
        }
    zs_step_result_init(&out->res[s - 1]);
    if ((rc = zs_step(c, cfg->lr, cfg->clip, 0, &out->res[s - 1])) != ZS_OK) {
      trainer_fail(out, rc, "zs_step");
      goto done;
    }
    if ((rc = zs_last_timing(c, &out->timing[s - 1])) != ZS_OK) {
      trainer_fail(out, rc, "zs_last_timing");
      goto done;
    }
  }
  for (uint32_t t = 0; t < NT; t++)
    if ((rc = zs_pull(c, t, out->final[t], ZS_DTYPE_FP32, TENSORS[t].numel * sizeof(float),
                      NULL)) != ZS_OK) {
      trainer_fail(out, rc, "final zs_pull");
      goto done;
    }
done:
  for (uint32_t t = 0; t < NT; t++) {
    free(param[t]);
    free(init[t]);
    for (uint32_t m = 0; m < M_MAX; m++)
      free(grad[m][t]);
  }
  return rc;
}

static void *trainer_main(void *arg) {
  const tr_trainer *a = arg;
  const run_cfg *cfg = a->cfg;
  zs_client *c = NULL;
  int rc = client_for(cfg, a->rank, cfg->wire, &c);
  if (rc != ZS_OK)
    trainer_fail(a->out, rc, "client setup");
  else
    trainer_body(cfg, a->rank, a->out, c);
  zs_client_close(c);
  return NULL;
}

/* The single-process reference of the same training; fills master[t]. */
static void reference(const run_cfg *cfg, const rank_out *r0, float **master) {
  float *m1[NT], *m2[NT], *acc[NT], *resid[W_MAX][NT];
  uint16_t *low[NT];
  uint64_t applied = 0;
  /* Scratch of the largest tensor's size. */
  float pulled[256], g[256], gq[256];
  for (uint32_t t = 0; t < NT; t++) {
    uint64_t n = TENSORS[t].numel;
    assert_true(n <= 256);
    for (uint32_t r = 0; r < W_MAX; r++)
      resid[r][t] = calloc(n, sizeof(float));
    float *init = init_tensor(t);
    memcpy(master[t], init, n * sizeof(float));
    free(init);
    m1[t] = calloc(n, sizeof(float));
    m2[t] = calloc(n, sizeof(float));
    acc[t] = calloc(n, sizeof(float));
    low[t] = calloc(n, sizeof(uint16_t));
  }
  for (uint64_t s = 1; s <= cfg->K; s++) {
    const zs_step_result *res = &r0->res[s - 1];
    if (cfg->ef && s > 1) {
      /* The client's rule after a step: a skipped step's residuals are
       * dropped with it; otherwise they follow the loss scale. */
      const zs_step_result *prev = &r0->res[s - 2];
      double rescale = prev->next_loss_scale / prev->loss_scale;
      for (uint32_t r = 0; r < W_MAX; r++)
        for (uint32_t t = 0; t < NT; t++)
          for (uint64_t i = 0; i < TENSORS[t].numel; i++)
            resid[r][t][i] = prev->applied ? (float)((double)resid[r][t][i] * rescale) : 0.0f;
    }
    const float scale = (float)r0->scale_used[s - 1];
    assert_true(res->loss_scale == scale);
    int overflow = 0;
    double sumsq = 0;
    for (uint32_t t = 0; t < NT; t++) {
      uint64_t n = TENSORS[t].numel;
      wire_round_tensor(tensor_wire(cfg, t), t, cfg->N, master[t], pulled);
      memset(acc[t], 0, n * sizeof(float));
      /* Contributions in (micro, rank) order, as the shards add them. */
      for (uint32_t m = 0; m < cfg->M; m++)
        for (uint32_t r = 0; r < cfg->W; r++) {
          for (uint64_t i = 0; i < n; i++) {
            g[i] = injected(cfg, s, r, m, t, i) ? INFINITY
                                                : grad_value(s, r, m, t, i, pulled[i]) * scale;
            if (cfg->ef)
              g[i] += resid[r][t][i];
          }
          wire_round_tensor(tensor_wire(cfg, t), t, cfg->N, g, gq);
          for (uint64_t i = 0; i < n; i++) {
            if (cfg->ef) {
              float d = g[i] - gq[i];
              resid[r][t][i] = isfinite(d) ? d : 0.0f;
            }
            acc[t][i] += gq[i];
          }
        }
      for (uint64_t i = 0; i < n; i++) {
        overflow |= !isfinite(acc[t][i]);
        sumsq += (double)acc[t][i] * acc[t][i];
      }
    }
    assert_int_equal(res->overflow, overflow);
    assert_int_equal(res->applied, !overflow);
    assert_int_equal(res->step, s);
    if (overflow) {
      for (uint32_t t = 0; t < NT; t++)
        memset(acc[t], 0, TENSORS[t].numel * sizeof(float));
      continue;
    }
    /* The norm is the shards' sum in another order: equal to rounding. */
    const double norm = sqrt(sumsq) / ((double)scale * cfg->W);
    assert_true(fabs(res->grad_norm - norm) <= 1e-12 * norm);
    double clip = 1.0;
    if (cfg->clip > 0) {
      clip = cfg->clip / (res->grad_norm + 1e-6);
      clip = clip > 1.0 ? 1.0 : clip;
    }
    assert_true(res->clip_coef == clip);
    assert_true(res->coef == (float)(clip / scale));
    applied++;
    for (uint32_t t = 0; t < NT; t++) {
      zs_group_options go;
      group_options(TENSORS[t].group, &go);
      optim_params p = {
          .optimizer = go.optimizer,
          .lr = cfg->lr * go.lr_scale,
          .beta1 = go.beta1,
          .beta2 = go.beta2,
          .eps = go.eps,
          .weight_decay = go.weight_decay,
          .momentum = go.momentum,
          .dampening = go.dampening,
          .nesterov = go.nesterov,
          .bias_correction = go.bias_correction,
          .step = applied,
          .grad_scale = (float)((double)res->coef / (double)cfg->W),
          .low_dtype = ZS_DTYPE_BF16,
      };
      optim_plan plan;
      optim_plan_init(&plan, &p);
      optim_apply(&plan, master[t], m1[t], m2[t], acc[t], low[t], TENSORS[t].numel);
    }
  }
  for (uint32_t t = 0; t < NT; t++) {
    free(m1[t]);
    free(m2[t]);
    free(acc[t]);
    free(low[t]);
    for (uint32_t r = 0; r < W_MAX; r++)
      free(resid[r][t]);
  }
}

static int job_counter;

/* Starts a cluster, trains with W trainer threads, checks everything against
 * the reference, and returns the ranks' results through `outs` (freed here). */
static void run_and_check(run_cfg *cfg, rank_out *outs) {
  hs_cluster cl;
  tr_cluster_up(&cl, cfg->N, NULL, cfg->addrs, sizeof cfg->addrs);
  snprintf(cfg->job, sizeof cfg->job, "e2e-%d", job_counter++);

  memset(outs, 0, W_MAX * sizeof *outs);
  tr_run_trainers(cfg->W, trainer_main, cfg, outs, sizeof *outs);
  for (uint32_t r = 0; r < cfg->W; r++) {
    if (outs[r].rc != ZS_OK)
      fprintf(stderr, "rank %" PRIu32 " failed: %s\n", r, outs[r].err);
    assert_int_equal(outs[r].rc, ZS_OK);
  }
  /* Every trainer computed the same step outcomes, to the bit. */
  for (uint32_t r = 1; r < cfg->W; r++) {
    for (uint32_t s = 0; s < cfg->K; s++) {
      assert_int_equal(outs[r].res[s].applied, outs[0].res[s].applied);
      assert_memory_equal(&outs[r].res[s].grad_norm, &outs[0].res[s].grad_norm, sizeof(double));
      assert_memory_equal(&outs[r].res[s].coef, &outs[0].res[s].coef, sizeof(float));
      assert_true(outs[r].res[s].next_loss_scale == outs[0].res[s].next_loss_scale);
    }
  }

  float *master[NT], *exact[NT];
  for (uint32_t t = 0; t < NT; t++) {
    master[t] = calloc(TENSORS[t].numel, sizeof(float));
    exact[t] = calloc(TENSORS[t].numel, sizeof(float));
  }
  reference(cfg, &outs[0], master);

  /* The fp32 masters, through a client that pulls fp32 (a late joiner: it
   * opens the trained job and does not write initial weights). */
  zs_client *v = NULL;
  assert_int_equal(client_for(cfg, 0, 0, &v), ZS_OK);
  const float *unused[NT] = {0};
  for (uint32_t t = 0; t < NT; t++)
    unused[t] = master[t];
  assert_int_equal(zs_open_job(v, unused), ZS_OK);
  assert_int_equal(zs_current_step(v), cfg->K + 1);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_pull(v, t, exact[t], ZS_DTYPE_FP32, TENSORS[t].numel * 4, NULL), ZS_OK);
  assert_int_equal(zs_client_close(v), ZS_OK);

  for (uint32_t t = 0; t < NT; t++) {
    float want[256];
    wire_round_tensor(tensor_wire(cfg, t), t, cfg->N, master[t], want);
    for (uint64_t i = 0; i < TENSORS[t].numel; i++) {
      if (memcmp(&exact[t][i], &master[t][i], sizeof(float)) != 0)
        fprintf(stderr, "%s[%" PRIu64 "]: shard %.9g, reference %.9g\n", TENSORS[t].name, i,
                exact[t][i], master[t][i]);
      assert_memory_equal(&exact[t][i], &master[t][i], sizeof(float));
      for (uint32_t r = 0; r < cfg->W; r++)
        assert_memory_equal(&outs[r].final[t][i], &want[i], sizeof(float));
    }
    free(master[t]);
    free(exact[t]);
  }
  for (uint32_t r = 0; r < cfg->W; r++)
    for (uint32_t t = 0; t < NT; t++)
      free(outs[r].final[t]);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- the N x W x dtype matrix ------------------------------------------------------ */

static void train_matrix_cell(uint32_t N, uint32_t W) {
  static const zs_dtype wires[] = {ZS_DTYPE_FP32, ZS_DTYPE_BF16, ZS_DTYPE_FP16,
                                   ZS_DTYPE_INT8_BLOCK};
  for (size_t k = 0; k < 4; k++) {
    /* int8 runs with error feedback in the cells where N + W is odd and
     * without in the others, so that both are held to the reference's bits
     * across shard and trainer counts. */
    run_cfg cfg = {.N = N,
                   .W = W,
                   .M = 2,
                   .K = 3,
                   .wire = wires[k],
                   .ef = wires[k] == ZS_DTYPE_INT8_BLOCK && (N + W) % 2 == 1,
                   .lr = 0.01};
    rank_out outs[W_MAX];
    run_and_check(&cfg, outs);
    /* Timing adds up and counts the bytes moved (ranks without prefetch pull
     * each tensor exactly once per step). */
    for (uint32_t r = 0; r < W; r++) {
      const zs_timing *tm = &outs[r].timing[cfg.K - 1];
      assert_true(tm->total_ms >= 0 && tm->compute_ms >= 0 && tm->push_ms >= 0 &&
                  tm->pull_wait_ms >= 0 && tm->step_ms >= 0);
      assert_true(tm->compute_ms <= tm->total_ms);
      uint64_t bytes = model_wire_bytes(&cfg);
      assert_int_equal(tm->bytes_pushed, bytes * cfg.M);
      if (r % 2 == 0)
        assert_int_equal(tm->bytes_pulled, bytes);
    }
  }
}

#define MATRIX_TEST(n, w)                                                                          \
  static void training_matches_reference_bit_for_bit_n##n##_w##w(void **state) {                   \
    (void)state;                                                                                   \
    train_matrix_cell(n, w);                                                                       \
  }
MATRIX_TEST(1, 1)
MATRIX_TEST(1, 2)
MATRIX_TEST(1, 3)
MATRIX_TEST(2, 1)
MATRIX_TEST(2, 2)
MATRIX_TEST(2, 3)
MATRIX_TEST(3, 1)
MATRIX_TEST(3, 2)
MATRIX_TEST(3, 3)

/* int8 blocks with error feedback for the job, bf16 for the group of norms
 * and biases (group 1): each tensor travels in its group's dtype, to the
 * reference's bits, and the bytes counted are each tensor's own. */
static void a_groups_wire_dtype_wins_over_the_clients(void **state) {
  (void)state;
  run_cfg cfg = {.N = 2,
                 .W = 2,
                 .M = 2,
                 .K = 3,
                 .wire = ZS_DTYPE_INT8_BLOCK,
                 .ef = 1,
                 .group1_wire = ZS_DTYPE_BF16,
                 .lr = 0.01};
  rank_out outs[W_MAX];
  run_and_check(&cfg, outs);
  const zs_timing *tm = &outs[0].timing[cfg.K - 1];
  assert_int_equal(tm->bytes_pushed, model_wire_bytes(&cfg) * cfg.M);
  assert_int_equal(tm->bytes_pulled, model_wire_bytes(&cfg));
  run_cfg all_int8 = cfg;
  all_int8.group1_wire = 0;
  assert_true(model_wire_bytes(&cfg) > model_wire_bytes(&all_int8));
}

/* ---- loss scaling and clipping ------------------------------------------------------- */

static void overflow_skips_the_step_everywhere_and_lowers_the_loss_scale(void **state) {
  (void)state;
  /* Steps 2 and 3 carry an inf from the last rank: the first overflow is
   * absorbed by DeepSpeed's hysteresis, the second halves the scale. With
   * fp16, and with int8 blocks and error feedback, whose residuals are
   * dropped with a skipped step and halved with the scale (the reference
   * does the same). */
  for (int k = 0; k < 2; k++) {
    run_cfg cfg = {.N = 2,
                   .W = 2,
                   .M = 2,
                   .K = 4,
                   .wire = k ? ZS_DTYPE_INT8_BLOCK : ZS_DTYPE_FP16,
                   .ef = (uint32_t)k,
                   .lr = 0.01,
                   .scaling = ZS_LOSS_SCALE_DYNAMIC,
                   .inject_steps = (1u << 2) | (1u << 3)};
    rank_out outs[W_MAX];
    run_and_check(&cfg, outs);
    for (uint32_t r = 0; r < cfg.W; r++) {
      const zs_step_result *res = outs[r].res;
      assert_int_equal(res[0].applied, 1);
      assert_int_equal(res[1].applied, 0);
      assert_int_equal(res[1].overflow, 1);
      assert_true(isinf(res[1].grad_norm));
      assert_int_equal(res[2].applied, 0);
      assert_int_equal(res[3].applied, 1);
      assert_true(res[0].loss_scale == 65536.0);
      assert_true(res[1].next_loss_scale == 65536.0); /* hysteresis */
      assert_true(res[2].loss_scale == 65536.0);
      assert_true(res[2].next_loss_scale == 32768.0);
      assert_true(res[3].loss_scale == 32768.0);
      assert_true(outs[r].scale_used[3] == 32768.0);
      assert_int_equal(res[3].version, 4); /* skipped steps still advance the version */
    }
  }
}

static void clipping_scales_by_max_norm_over_norm_on_every_rank(void **state) {
  (void)state;
  run_cfg cfg = {.N = 2, .W = 2, .M = 2, .K = 3, .wire = ZS_DTYPE_FP32, .lr = 0.01, .clip = 0.05};
  rank_out outs[W_MAX];
  run_and_check(&cfg, outs); /* checks clip_coef and coef against the formula */
  for (uint32_t s = 0; s < cfg.K; s++) {
    assert_true(outs[0].res[s].grad_norm > cfg.clip);
    assert_true(outs[0].res[s].clip_coef < 1.0);
  }
  /* A max norm above the norm leaves the gradient alone. */
  run_cfg loose = {.N = 1, .W = 2, .M = 2, .K = 2, .wire = ZS_DTYPE_FP32, .lr = 0.01, .clip = 1e6};
  run_and_check(&loose, outs);
  for (uint32_t s = 0; s < loose.K; s++)
    assert_true(outs[0].res[s].clip_coef == 1.0 && outs[0].res[s].coef == 1.0f);
}

/* ---- a trainer dies in the middle of a step -------------------------------------------- */

/* The child: rank 1 of 3; completes step 1, pushes only tensor 0 of step 2,
 * says "ready" on stdout and waits to be killed. */
static int trainer_child(const char *addrs, const char *job) {
  run_cfg cfg = {.N = 0, .W = 3, .M = 1, .K = 1, .wire = ZS_DTYPE_BF16, .lr = 0.01};
  snprintf(cfg.addrs, sizeof cfg.addrs, "%s", addrs);
  snprintf(cfg.job, sizeof cfg.job, "%s", job);
  zs_client *c = NULL;
  rank_out out;
  memset(&out, 0, sizeof out);
  if (client_for(&cfg, 1, cfg.wire, &c) != ZS_OK || trainer_body(&cfg, 1, &out, c) != ZS_OK) {
    fprintf(stderr, "child: %s\n", out.err[0] ? out.err : zs_last_error());
    return 1;
  }
  float g[200];
  for (int i = 0; i < 200; i++)
    g[i] = 0.01f;
  if (zs_push(c, 0, 0, g, ZS_DTYPE_FP32, sizeof g, NULL) != ZS_OK) {
    fprintf(stderr, "child: push: %s\n", zs_last_error());
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  char buf[8];
  while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
  }
  return 0;
}

/* Opened by the parent once rank 1 is dead, so that the survivors' step 2
 * starts with rank 1's contributions settled. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int gate_open;

typedef struct survivor {
  const run_cfg *cfg;
  uint32_t rank;
  int step2_rc;
  char step2_err[512];
  rank_out out;
} survivor;

static void *survivor_main(void *arg) {
  survivor *s = arg;
  zs_client *c = NULL;
  if (client_for(s->cfg, s->rank, s->cfg->wire, &c) != ZS_OK ||
      trainer_body(s->cfg, s->rank, &s->out, c) != ZS_OK) {
    s->step2_rc = ZS_EINTERNAL;
    snprintf(s->step2_err, sizeof s->step2_err, "step 1 failed: %.480s", s->out.err);
    zs_client_close(c);
    return NULL;
  }
  pthread_mutex_lock(&gate_mu);
  while (!gate_open)
    pthread_cond_wait(&gate_cv, &gate_mu);
  pthread_mutex_unlock(&gate_mu);
  /* Step 2: everything this rank owes, then the step, which cannot complete. */
  float g[200];
  for (int i = 0; i < 200; i++)
    g[i] = 0.01f;
  for (uint32_t t = 0; t < NT; t++)
    zs_push(c, t, 0, g, ZS_DTYPE_FP32, TENSORS[t].numel * sizeof(float), NULL);
  s->step2_rc = zs_step(c, 0.01, 0, 0, NULL);
  snprintf(s->step2_err, sizeof s->step2_err, "%s", zs_last_error());
  zs_client_close(c);
  return NULL;
}

static void killed_trainer_is_named_in_the_others_timeout_error(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.N = 2, .W = 3, .M = 1, .K = 1, .wire = ZS_DTYPE_BF16, .lr = 0.01};
  tr_cluster_up(&cl, 2, NULL, cfg.addrs, sizeof cfg.addrs);
  snprintf(cfg.job, sizeof cfg.job, "killed-%d", job_counter++);

  int out_pipe[2], in_pipe[2];
  assert_int_equal(pipe(out_pipe), 0);
  assert_int_equal(pipe(in_pipe), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_addclose(&fa, out_pipe[0]);
  posix_spawn_file_actions_addclose(&fa, in_pipe[1]);
  char *argv[] = {"test_client_e2e", "--trainer-child", cfg.addrs, cfg.job, NULL};
  pid_t pid;
  assert_int_equal(posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  close(out_pipe[1]);
  close(in_pipe[0]);

  /* The short step timeout is what the survivors wait for rank 1. */
  run_cfg short_cfg = cfg;
  short_cfg.step_timeout_ms = 2000;
  gate_open = 0;
  survivor sv[2] = {{.cfg = &short_cfg, .rank = 0}, {.cfg = &short_cfg, .rank = 2}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++)
    assert_int_equal(pthread_create(&th[k], NULL, survivor_main, &sv[k]), 0);

  /* Rank 1 is killed once it is in the middle of step 2. */
  char line[16] = {0};
  ssize_t got = read(out_pipe[0], line, sizeof line - 1);
  assert_true(got > 0 && strncmp(line, "ready", 5) == 0);
  kill(pid, SIGKILL);
  int wst;
  assert_int_equal(waitpid(pid, &wst, 0), pid);
  assert_true(WIFSIGNALED(wst));
  pthread_mutex_lock(&gate_mu);
  gate_open = 1;
  pthread_cond_broadcast(&gate_cv);
  pthread_mutex_unlock(&gate_mu);
  close(out_pipe[0]);
  close(in_pipe[1]);

  for (int k = 0; k < 2; k++) {
    pthread_join(th[k], NULL);
    fprintf(stderr, "rank %" PRIu32 ": %s: %s\n", sv[k].rank, zs_err_name(sv[k].step2_rc),
            sv[k].step2_err);
    assert_int_equal(sv[k].step2_rc, ZS_ETIMEDOUT);
    assert_non_null(strstr(sv[k].step2_err, "step 2"));
    assert_non_null(strstr(sv[k].step2_err, "from rank(s) 1;"));
    /* Rank 1 pushed tensor 0 (two slices) before dying; the other five
     * tensors' seven pieces are missing, and named. */
    assert_non_null(strstr(sv[k].step2_err, ": 7 contribution(s) missing"));
    assert_non_null(strstr(sv[k].step2_err, "rank 1 micro 0 tensor '"));
    assert_null(strstr(sv[k].step2_err, "tensor 'embed.weight'"));
    for (uint32_t t = 0; t < NT; t++)
      free(sv[k].out.final[t]);
  }
  hs_cluster_stop(&cl);
}

/* ---- one client, several trainer threads ----------------------------------------------- */

typedef struct shared_arg {
  zs_client *c;
  uint32_t first, count; /* this thread's tensors */
  uint32_t M;
  int rc;
  char err[512];
  float *param[NT], *grad[M_MAX][NT];
} shared_arg;

static void *shared_thread(void *arg) {
  shared_arg *a = arg;
  a->rc = ZS_OK;
  for (uint32_t t = a->first; t < a->first + a->count && a->rc == ZS_OK; t++) {
    uint64_t n = TENSORS[t].numel;
    a->rc = zs_pull(a->c, t, a->param[t], ZS_DTYPE_FP32, n * 4, NULL);
    for (uint32_t m = 0; m < a->M && a->rc == ZS_OK; m++) {
      for (uint64_t i = 0; i < n; i++)
        a->grad[m][t][i] = grad_value(1, 0, m, t, i, a->param[t][i]);
      a->rc = zs_push(a->c, t, m, a->grad[m][t], ZS_DTYPE_FP32, n * 4, NULL);
    }
  }
  if (a->rc != ZS_OK)
    snprintf(a->err, sizeof a->err, "%s", zs_last_error());
  return NULL;
}

static void one_client_serves_several_trainer_threads(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.N = 2, .W = 1, .M = 2, .K = 1, .wire = ZS_DTYPE_FP32, .lr = 0.01};
  tr_cluster_up(&cl, 2, NULL, cfg.addrs, sizeof cfg.addrs);
  snprintf(cfg.job, sizeof cfg.job, "shared-%d", job_counter++);
  zs_client *c = NULL;
  assert_int_equal(client_for(&cfg, 0, 0, &c), ZS_OK);
  float *init[NT], *param[NT], *grad[M_MAX][NT], *master[NT], *got[NT];
  for (uint32_t t = 0; t < NT; t++) {
    init[t] = init_tensor(t);
    param[t] = calloc(TENSORS[t].numel, sizeof(float));
    master[t] = calloc(TENSORS[t].numel, sizeof(float));
    got[t] = calloc(TENSORS[t].numel, sizeof(float));
    for (uint32_t m = 0; m < M_MAX; m++)
      grad[m][t] = calloc(TENSORS[t].numel, sizeof(float));
  }
  assert_int_equal(zs_open_job(c, (const float *const *)init), ZS_OK);
  /* Three threads, two tensors each, pulling and pushing at the same time. */
  shared_arg args[3];
  pthread_t th[3];
  for (uint32_t k = 0; k < 3; k++) {
    args[k] = (shared_arg){.c = c, .first = 2 * k, .count = 2, .M = cfg.M};
    memcpy(args[k].param, param, sizeof param);
    memcpy(args[k].grad, grad, sizeof grad);
    assert_int_equal(pthread_create(&th[k], NULL, shared_thread, &args[k]), 0);
  }
  for (uint32_t k = 0; k < 3; k++) {
    pthread_join(th[k], NULL);
    if (args[k].rc != ZS_OK)
      fprintf(stderr, "thread %" PRIu32 ": %s\n", k, args[k].err);
    assert_int_equal(args[k].rc, ZS_OK);
  }
  rank_out out;
  memset(&out, 0, sizeof out);
  out.scale_used[0] = 1.0;
  zs_step_result_init(&out.res[0]);
  assert_int_equal(zs_step(c, cfg.lr, 0, 0, &out.res[0]), ZS_OK);
  reference(&cfg, &out, master);
  for (uint32_t t = 0; t < NT; t++) {
    assert_int_equal(zs_pull(c, t, got[t], ZS_DTYPE_FP32, TENSORS[t].numel * 4, NULL), ZS_OK);
    assert_memory_equal(got[t], master[t], TENSORS[t].numel * sizeof(float));
  }
  assert_int_equal(zs_client_close(c), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    free(init[t]);
    free(param[t]);
    free(master[t]);
    free(got[t]);
    for (uint32_t m = 0; m < M_MAX; m++)
      free(grad[m][t]);
  }
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- many small tensors in buckets ------------------------------------------------------- */

#define SMALL_NT 160
#define SMALL_K 3

static uint64_t small_numel(uint32_t t) {
  return 3 + (uint64_t)(t * 7u % 90u); /* 3 .. 92: whole, and split from SPLIT up */
}

/* Releases the held pool and waits for every request; 0 or the first error. */
static int small_release_and_wait(zs_client *c, zs_request **reqs, uint32_t n) {
  zc_pool_hold(&c->pool, 0);
  int rc = ZS_OK;
  for (uint32_t i = 0; i < n; i++) {
    int r = zs_wait(reqs[i]);
    if (rc == ZS_OK)
      rc = r;
  }
  return rc;
}

/* One trainer, 2 micro-batches, SMALL_K steps of SMALL_NT small tensors on 2
 * fresh shards, bf16 on the wire both ways, with the given bucket size. Each
 * step's pulls and pushes are all submitted while the pool is held, so that
 * the shards' queues hold every piece at once and bucketing (when on) is
 * certain to form batches. The final fp32 masters go to final[t]; returns
 * the batches sent. */
static uint64_t small_run(size_t bucket, float **final) {
  hs_cluster cl;
  char addrs[512], job[64];
  tr_cluster_up(&cl, 2, NULL, addrs, sizeof addrs);
  snprintf(job, sizeof job, "small-%d", job_counter++);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.job = job;
  o.grad_accum = 2;
  o.push_dtype = o.pull_dtype = ZS_DTYPE_BF16;
  o.split_threshold = SPLIT;
  o.reduce_bucket_size = o.allgather_bucket_size = bucket;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options go;
  group_options(0, &go);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  float *param[SMALL_NT], *grad[2][SMALL_NT];
  const float *init[SMALL_NT];
  for (uint32_t t = 0; t < SMALL_NT; t++) {
    char name[32];
    snprintf(name, sizeof name, "small.%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, small_numel(t), 0, NULL, 0, NULL), ZS_OK);
    param[t] = calloc(small_numel(t), sizeof(float));
    grad[0][t] = calloc(small_numel(t), sizeof(float));
    grad[1][t] = calloc(small_numel(t), sizeof(float));
    assert_true(param[t] && grad[0][t] && grad[1][t]);
    for (uint64_t i = 0; i < small_numel(t); i++)
      param[t][i] = init_value(t % NT, i);
    init[t] = param[t];
  }
  assert_int_equal(zs_open_job(c, init), ZS_OK);
  zs_request *reqs[2 * SMALL_NT];
  for (uint64_t s = 1; s <= SMALL_K; s++) {
    zc_pool_hold(&c->pool, 1);
    for (uint32_t t = 0; t < SMALL_NT; t++)
      assert_int_equal(
          zs_pull(c, t, param[t], ZS_DTYPE_FP32, small_numel(t) * sizeof(float), &reqs[t]), ZS_OK);
    assert_int_equal(small_release_and_wait(c, reqs, SMALL_NT), ZS_OK);
    zc_pool_hold(&c->pool, 1);
    for (uint32_t m = 0; m < 2; m++)
      for (uint32_t t = 0; t < SMALL_NT; t++) {
        for (uint64_t i = 0; i < small_numel(t); i++)
          grad[m][t][i] = grad_value(s, 0, m, t % NT, i, param[t][i]);
        assert_int_equal(zs_push(c, t, m, grad[m][t], ZS_DTYPE_FP32, small_numel(t) * sizeof(float),
                                 &reqs[m * SMALL_NT + t]),
                         ZS_OK);
      }
    assert_int_equal(small_release_and_wait(c, reqs, 2 * SMALL_NT), ZS_OK);
    zs_step_result res;
    zs_step_result_init(&res);
    assert_int_equal(zs_step(c, 0.01, 0, 0, &res), ZS_OK);
    assert_int_equal(res.applied, 1);
  }
  uint64_t batches = zc_dp_batches(c);
  assert_int_equal(zs_client_close(c), ZS_OK);

  /* The masters in fp32, piece by piece, through a client without buckets. */
  o.pull_dtype = ZS_DTYPE_FP32;
  o.reduce_bucket_size = o.allgather_bucket_size = 0;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  for (uint32_t t = 0; t < SMALL_NT; t++) {
    char name[32];
    snprintf(name, sizeof name, "small.%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, small_numel(t), 0, NULL, 0, NULL), ZS_OK);
  }
  assert_int_equal(zs_open_job(c, init), ZS_OK);
  for (uint32_t t = 0; t < SMALL_NT; t++)
    assert_int_equal(zs_pull(c, t, final[t], ZS_DTYPE_FP32, small_numel(t) * sizeof(float), NULL),
                     ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  for (uint32_t t = 0; t < SMALL_NT; t++) {
    free(param[t]);
    free(grad[0][t]);
    free(grad[1][t]);
  }
  assert_int_equal(hs_cluster_stop(&cl), 0);
  return batches;
}

static void many_small_tensors_in_buckets_train_to_the_bits_of_single_pieces(void **state) {
  (void)state;
  float *single[SMALL_NT], *bucketed[SMALL_NT];
  for (uint32_t t = 0; t < SMALL_NT; t++) {
    single[t] = calloc(small_numel(t), sizeof(float));
    bucketed[t] = calloc(small_numel(t), sizeof(float));
    assert_true(single[t] && bucketed[t]);
  }
  assert_int_equal(small_run(0, single), 0);
  uint64_t batches = small_run((size_t)1 << 20, bucketed);
  /* Over the data plane each step's pulls and pushes went as batches (over
   * gRPC the buckets have no effect and the run is the same as the other). */
  if (run_transport() == ZS_TRANSPORT_DATA)
    assert_true(batches >= 2 * 2 * SMALL_K);
  else
    assert_int_equal(batches, 0);
  for (uint32_t t = 0; t < SMALL_NT; t++) {
    if (memcmp(single[t], bucketed[t], small_numel(t) * sizeof(float)) != 0)
      fail_msg("tensor small.%" PRIu32 " differs between single pieces and buckets", t);
    free(single[t]);
    free(bucketed[t]);
  }
}

/* ---- misuse against a live job ------------------------------------------------------------ */

/* Initial weights of pieces larger than one InitParams chunk
 * (LAYOUT_INIT_CHUNK_ELEMS) travel in chunks and arrive whole: on 1, 2 and 3
 * shards a 600000-element tensor's pieces hold 3, 2 (each with a short last
 * chunk) and 1 chunk(s); every element pulled back in fp32 is the one sent,
 * and a second rank-0 client opening with different weights is refused. */
static void initial_weights_larger_than_a_chunk_arrive_whole(void **state) {
  (void)state;
  const uint64_t numel = 600000;
  float *init = malloc(numel * sizeof *init), *got = malloc(numel * sizeof *got);
  assert_true(init && got);
  for (uint64_t i = 0; i < numel; i++)
    init[i] = init_value(0, i) + (float)(i % 977) * 1e-3f;
  for (uint32_t n = 1; n <= 3; n++) {
    hs_cluster cl;
    run_cfg cfg = {.N = n, .W = 1, .M = 1, .K = 1, .wire = ZS_DTYPE_BF16, .lr = 0.01};
    tr_cluster_up(&cl, n, NULL, cfg.addrs, sizeof cfg.addrs);
    snprintf(cfg.job, sizeof cfg.job, "wide-%d", job_counter++);
    for (int attempt = 0; attempt < 2; attempt++) {
      zs_client_options o;
      zs_client_options_init(&o);
      o.addresses = cfg.addrs;
      o.job = cfg.job;
      o.split_threshold = SPLIT;
      zs_client *c = NULL;
      assert_int_equal(zs_client_open(&o, &c), ZS_OK);
      assert_int_equal(zs_add_tensor(c, "wide.weight", numel, 0, NULL, 0, NULL), ZS_OK);
      if (attempt == 1) {
        init[numel - 1] += 1.0f; /* in the last chunk of the last piece */
        assert_int_equal(zs_open_job(c, (const float *const *)&init), ZS_EEXIST);
        init[numel - 1] -= 1.0f;
      } else {
        assert_int_equal(zs_open_job(c, (const float *const *)&init), ZS_OK);
        memset(got, 0, numel * sizeof *got);
        assert_int_equal(zs_pull(c, 0, got, ZS_DTYPE_FP32, numel * sizeof *got, NULL), ZS_OK);
        assert_memory_equal(got, init, numel * sizeof *got);
      }
      zs_client_close(c);
    }
    assert_int_equal(hs_cluster_stop(&cl), 0);
  }
  free(init);
  free(got);
}

static void misuse_on_an_open_job_returns_errors(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.N = 2, .W = 1, .M = 2, .K = 1, .wire = ZS_DTYPE_BF16, .lr = 0.01};
  tr_cluster_up(&cl, 2, NULL, cfg.addrs, sizeof cfg.addrs);
  snprintf(cfg.job, sizeof cfg.job, "misuse-%d", job_counter++);
  zs_client *c = NULL;
  assert_int_equal(client_for(&cfg, 0, cfg.wire, &c), ZS_OK);
  float *init[NT];
  for (uint32_t t = 0; t < NT; t++)
    init[t] = init_tensor(t);
  assert_int_equal(zs_open_job(c, (const float *const *)init), ZS_OK);
  assert_int_equal(zs_open_job(c, (const float *const *)init), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "late", 3, 0, NULL, 0, NULL), ZS_EINVAL);
  assert_int_equal(zs_current_step(c), 1);
  assert_true(zs_spec_hash(c) != 0);

  float buf[201];
  uint16_t half[200];
  memset(buf, 0, sizeof buf);
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, 199 * 4, NULL), ZS_ESIZE);
  assert_non_null(strstr(zs_last_error(), "'embed.weight' has 200 elements"));
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, 200 * 2, NULL), ZS_ESIZE);
  assert_int_equal(zs_push(c, 0, 0, buf, (zs_dtype)0, 800, NULL), ZS_EDTYPE);
  assert_int_equal(zs_push(c, 0, 2, buf, ZS_DTYPE_FP32, 800, NULL), ZS_ERANGE);
  assert_int_equal(zs_push(c, NT, 0, buf, ZS_DTYPE_FP32, 800, NULL), ZS_ENOTFOUND);
  assert_int_equal(zs_push(c, 0, 0, NULL, ZS_DTYPE_FP32, 800, NULL), ZS_EINVAL);
  assert_int_equal(zs_pull(c, 0, (char *)buf + 1, ZS_DTYPE_FP32, 800, NULL), ZS_EINVAL);
  assert_int_equal(zs_pull(c, 0, half, ZS_DTYPE_FP16, sizeof half, NULL), ZS_OK);

  /* A step with a contribution missing fails fast and names it. */
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, 800, NULL), ZS_OK);
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, 800, NULL), ZS_EEXIST);
  assert_int_equal(zs_step(c, 0.01, 0, 0, NULL), ZS_ENOTREADY);
  assert_non_null(strstr(zs_last_error(), "tensor 'embed.weight' for micro 1"));

  /* A different model on the same shards is refused by the spec hash. */
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg.addrs;
  o.job = cfg.job;
  zs_client *other = NULL;
  assert_int_equal(zs_client_open(&o, &other), ZS_OK);
  assert_int_equal(zs_add_tensor(other, "w", 4, 0, NULL, 0, NULL), ZS_OK);
  float w4[4] = {0};
  const float *i4[1] = {w4};
  assert_int_equal(zs_open_job(other, i4), ZS_EHASH);
  assert_non_null(strstr(zs_last_error(), "spec hash"));
  assert_int_equal(zs_client_close(other), ZS_OK);

  /* The addresses must be in shard-id order. */
  char swapped[128];
  snprintf(swapped, sizeof swapped, "%s,%s", cl.srv[1]->addr, cl.srv[0]->addr);
  run_cfg sw = cfg;
  snprintf(sw.addrs, sizeof sw.addrs, "%s", swapped);
  assert_int_equal(client_for(&sw, 0, sw.wire, &other), ZS_OK);
  assert_int_equal(zs_open_job(other, (const float *const *)init), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "shard-id order"));
  assert_int_equal(zs_client_close(other), ZS_OK);

  /* A request outlives its client's close and still reports. */
  zs_request *req = NULL;
  assert_int_equal(zs_pull(c, 1, buf, ZS_DTYPE_FP32, 37 * 4, &req), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  int rc = zs_wait(req);
  assert_true(rc == ZS_OK || rc == ZS_ECANCELED);
  for (uint32_t t = 0; t < NT; t++)
    free(init[t]);
  hs_cluster_stop(&cl);
}

typedef struct cb_state {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int calls, last_status;
} cb_state;

static void on_done(void *arg, int status) {
  cb_state *s = arg;
  pthread_mutex_lock(&s->mu);
  s->calls++;
  s->last_status = status;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void callbacks_run_once_per_transfer(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.N = 3, .W = 1, .M = 1, .K = 1, .wire = ZS_DTYPE_FP32, .lr = 0.01};
  tr_cluster_up(&cl, 3, NULL, cfg.addrs, sizeof cfg.addrs);
  snprintf(cfg.job, sizeof cfg.job, "cb-%d", job_counter++);
  zs_client *c = NULL;
  assert_int_equal(client_for(&cfg, 0, 0, &c), ZS_OK);
  float *init[NT], *got[NT];
  for (uint32_t t = 0; t < NT; t++) {
    init[t] = init_tensor(t);
    got[t] = calloc(TENSORS[t].numel, sizeof(float));
  }
  assert_int_equal(zs_open_job(c, (const float *const *)init), ZS_OK);
  cb_state s = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_pull_cb(c, t, got[t], ZS_DTYPE_FP32, TENSORS[t].numel * 4, on_done, &s),
                     ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_push_cb(c, t, 0, init[t], ZS_DTYPE_FP32, TENSORS[t].numel * 4, on_done, &s),
                     ZS_OK);
  pthread_mutex_lock(&s.mu);
  while (s.calls < 2 * NT)
    pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  assert_int_equal(s.last_status, ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    assert_memory_equal(got[t], init[t], TENSORS[t].numel * sizeof(float));
  assert_int_equal(zs_wait_pushes(c), ZS_OK);
  zs_step_result r;
  zs_step_result_init(&r);
  assert_int_equal(zs_step(c, 0.01, 0, 0, &r), ZS_OK);
  assert_int_equal(r.applied, 1);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(s.calls, 2 * NT); /* and never again */
  for (uint32_t t = 0; t < NT; t++) {
    free(init[t]);
    free(got[t]);
  }
  hs_cluster_stop(&cl);
}

/* A callback that tries to close its client and starts the next pull. */
typedef struct chain_state {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  zs_client *c;
  float *second;
  size_t second_bytes;
  int first_status, close_rc, start_rc, second_status;
  int first_done, second_done;
} chain_state;

static void on_second(void *arg, int status) {
  chain_state *s = arg;
  pthread_mutex_lock(&s->mu);
  s->second_status = status;
  s->second_done = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* The second pull may complete (on another thread) before this returns:
 * each callback reports on its own, and the test waits for both. */
static void on_first(void *arg, int status) {
  chain_state *s = arg;
  int close_rc = zs_client_close(s->c);
  int start_rc = zs_pull_cb(s->c, 1, s->second, ZS_DTYPE_FP32, s->second_bytes, on_second, s);
  pthread_mutex_lock(&s->mu);
  s->first_status = status;
  s->close_rc = close_rc;
  s->start_rc = start_rc;
  if (start_rc != ZS_OK)
    s->second_done = 1; /* on_second will not run */
  s->first_done = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void a_callback_may_start_a_transfer_but_not_close_its_client(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.N = 2, .W = 1, .M = 1, .K = 1, .wire = ZS_DTYPE_FP32, .lr = 0.01};
  tr_cluster_up(&cl, 2, NULL, cfg.addrs, sizeof cfg.addrs);
  snprintf(cfg.job, sizeof cfg.job, "chain-%d", job_counter++);
  zs_client *c = NULL;
  assert_int_equal(client_for(&cfg, 0, 0, &c), ZS_OK);
  float *init[NT];
  for (uint32_t t = 0; t < NT; t++)
    init[t] = init_tensor(t);
  assert_int_equal(zs_open_job(c, (const float *const *)init), ZS_OK);
  rank_out out = {0};
  assert_int_equal(check_transport(c, cfg.N, &out), ZS_OK);
  float *first = calloc(TENSORS[0].numel, sizeof(float));
  chain_state s = {.mu = PTHREAD_MUTEX_INITIALIZER,
                   .cv = PTHREAD_COND_INITIALIZER,
                   .c = c,
                   .second = calloc(TENSORS[1].numel, sizeof(float)),
                   .second_bytes = TENSORS[1].numel * sizeof(float)};
  /* On the data plane this callback runs on a data client's loop thread,
   * over gRPC on a worker: either way closing from it would wait for itself. */
  assert_int_equal(
      zs_pull_cb(c, 0, first, ZS_DTYPE_FP32, TENSORS[0].numel * sizeof(float), on_first, &s),
      ZS_OK);
  pthread_mutex_lock(&s.mu);
  while (!s.first_done || !s.second_done)
    pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  assert_int_equal(s.first_status, ZS_OK);
  assert_int_equal(s.close_rc, ZS_EINVAL);
  assert_int_equal(s.start_rc, ZS_OK);
  assert_int_equal(s.second_status, ZS_OK);
  assert_memory_equal(first, init[0], TENSORS[0].numel * sizeof(float));
  assert_memory_equal(s.second, init[1], TENSORS[1].numel * sizeof(float));
  assert_int_equal(zs_client_close(c), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    free(init[t]);
  free(first);
  free(s.second);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "--trainer-child") == 0)
    return trainer_child(argv[2], argv[3]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(training_matches_reference_bit_for_bit_n1_w1),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n1_w2),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n1_w3),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n2_w1),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n2_w2),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n2_w3),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n3_w1),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n3_w2),
      cmocka_unit_test(training_matches_reference_bit_for_bit_n3_w3),
      cmocka_unit_test(a_groups_wire_dtype_wins_over_the_clients),
      cmocka_unit_test(overflow_skips_the_step_everywhere_and_lowers_the_loss_scale),
      cmocka_unit_test(clipping_scales_by_max_norm_over_norm_on_every_rank),
      cmocka_unit_test(killed_trainer_is_named_in_the_others_timeout_error),
      cmocka_unit_test(one_client_serves_several_trainer_threads),
      cmocka_unit_test(many_small_tensors_in_buckets_train_to_the_bits_of_single_pieces),
      cmocka_unit_test(initial_weights_larger_than_a_chunk_arrive_whole),
      cmocka_unit_test(misuse_on_an_open_job_returns_errors),
      cmocka_unit_test(callbacks_run_once_per_transfer),
      cmocka_unit_test(a_callback_may_start_a_transfer_but_not_close_its_client),
  };
  return TR_RUN_TESTS(tests);
}
