/*
 * test_pipelined — the pipelined step (zs_client_options.pipelined,
 * spec.pipelined) against real zshard-server processes.
 *
 * The central check: the same training (W = 3 trainer threads, M = 2
 * micro-batches, N = 2 shards, K steps, an AdamW group, a no-decay AdamW
 * group with lr_scale 0.5 and a Nesterov SGD group, a learning rate that
 * changes every step and per-group learning rates in one step, gradients
 * that depend on the parameters each trainer pulled) run once with the
 * gated step and once pipelined, on two clusters, ends in bit-identical
 * parameters: the pipelined apply runs the same kernel over the same
 * accumulator, piece by piece. One pipelined trainer prefetches, so the
 * prefetched pulls of pieces not yet applied are held to the bits too, and
 * one pulls bf16, the copy the shards send from their arena pinned.
 *
 * Then, through single gRPC calls on a pipelined job: the Apply comes ahead
 * of the pushes and is answered at once; a piece whose contributions are all
 * in is pulled at the new version while the shard's version has not moved
 * (the pull overlaps the pushes of the other pieces); the version advances
 * once every piece is applied; a repeat of the Apply gets the recorded
 * outcome, another lr ZS_EEXIST; GradStats and a skip are refused with a
 * sentence. And the client's refusals: clipping, a clip_coef, zs_grad_norm,
 * dynamic loss scaling, and a gated trainer joining a pipelined job. And the
 * spec: pipelined is part of the hash, a gated spec encodes (and hashes) as
 * before the field existed, and a checkpoint's spec section keeps it. And a
 * checkpoint of a pipelined job is of one whole version: taken between two
 * steps, restored after a third, it gives back the bits pulled after the
 * second, and training goes on from there.
 *
 * CTest runs it on the data plane and again with ZSHARD_TRANSPORT=grpc.
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

#include <cmocka.h>

#include "harness.h"
#include "server/ckpt/ckpt_format.h"
#include "trainers.h"
#include "zshard/zshard.h"

#define NT 5
#define NG 3
#define W 3
#define M 2
#define N 2
#define K 5
#define SPLIT 64

/* Split tensors with short last slices and whole ones of odd sizes. */
static const tr_tensor TENSORS[NT] = {
    {"embed.weight", 300, 0}, {"embed.bias", 37, 1},  {"proj.weight", 130, 0},
    {"proj.bias", 5, 2},      {"head.weight", 64, 2},
};

static void group_options(uint32_t g, zs_group_options *o) {
  if (g == 0) {
    zs_group_options_init(o, ZS_OPTIM_ADAMW);
  } else if (g == 1) {
    zs_group_options_init(o, ZS_OPTIM_ADAMW);
    o->weight_decay = 0;
    o->lr_scale = 0.5;
  } else {
    zs_group_options_init(o, ZS_OPTIM_SGD);
    o->momentum = 0.9;
    o->nesterov = 1;
    o->weight_decay = 0.001;
  }
}

static double lr_of(uint64_t s) {
  return 1e-2 * (1.0 + 0.25 * (double)s);
}

/* ---- trainers -------------------------------------------------------------------- */

typedef struct run_cfg {
  char addrs[256];
  int pipelined;
} run_cfg;

/* A rank's status and final parameters. */
typedef tr_report rank_out;
_Static_assert(NT <= TR_MAX_TENSORS, "the report holds every tensor");

static void trainer_fail(rank_out *out, int rc, const char *what) {
  out->rc = rc;
  snprintf(out->err, sizeof out->err, "%s: %s (%s)", what, zs_strerror(rc), zs_last_error());
}

/* A client with the model described; rank 2 of a pipelined run prefetches. */
static int trainer_open(const run_cfg *cfg, uint32_t rank, zs_client **out) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg->addrs;
  o.rank = rank;
  o.world_size = W;
  o.grad_accum = M;
  o.job = "pipe";
  o.split_threshold = SPLIT;
  o.push_dtype = ZS_DTYPE_BF16;
  o.pipelined = (uint32_t)cfg->pipelined;
  o.prefetch_depth = rank == 2 ? 2 : 0;
  /* Rank 1 pulls the shards' stored bf16 copy: on the data plane an
   * answer of one piece (not coalesced into a batch) is sent pinned in the
   * low arena while other pieces are applied. */
  o.pull_dtype = rank == 1 ? ZS_DTYPE_BF16 : 0;
  int rc = zs_client_open(&o, out);
  for (uint32_t g = 0; rc == ZS_OK && g < NG; g++) {
    zs_group_options go;
    group_options(g, &go);
    rc = zs_add_group(*out, &go, NULL);
  }
  for (uint32_t t = 0; rc == ZS_OK && t < NT; t++)
    rc = zs_add_tensor(*out, TENSORS[t].name, TENSORS[t].numel, TENSORS[t].group, NULL, 0, NULL);
  return rc;
}

/* One step of rank `rank`: gradients from the pulled parameters, pushed
 * without waiting, then zs_step (per-group learning rates and
 * hyper-parameters in step 3), then
 * the pushes' outcomes. */
static int trainer_step(zs_client *c, uint32_t rank, uint64_t s, float **param,
                        float *(*grad)[NT]) {
  uint32_t ids[NT];
  size_t nbytes[NT];
  zs_request *reqs[M][NT];
  for (uint32_t t = 0; t < NT; t++) {
    ids[t] = t;
    nbytes[t] = TENSORS[t].numel * sizeof(float);
  }
  int rc = ZS_OK;
  for (uint32_t m = 0; m < M && rc == ZS_OK; m++) {
    for (uint32_t t = 0; t < NT; t++)
      for (uint64_t i = 0; i < TENSORS[t].numel; i++)
        grad[m][t][i] = 0.5f * param[t][i] + 0.01f * tr_noise(s, rank, m, t, i) + 0.001f;
    rc = zs_push_many(c, NT, ids, m, (const void *const *)grad[m], ZS_DTYPE_FP32, nbytes, reqs[m]);
  }
  if (rc != ZS_OK)
    return rc;
  if (s == 3) {
    /* The groups' hyper-parameters of this step only (a scheduler's beta1
     * and momentum): a pipelined shard applies every piece with them, as a
     * gated one applies the step. */
    double glr[NG] = {2e-2, 1e-3, 5e-2};
    const double beta1[NG] = {0.8, 0.95, 0.9}, momentum[NG] = {0, 0, 0.7};
    const double wd[NG] = {0.1, 0.02, 0.0}, eps[NG] = {1e-6, 1e-8, 1e-8};
    zs_step_options o;
    zs_step_options_init(&o);
    o.lr = lr_of(s);
    o.group_lr = glr;
    o.num_group_lr = NG;
    o.group_beta1 = beta1;
    o.group_momentum = momentum;
    o.group_weight_decay = wd;
    o.group_eps = eps;
    rc = zs_step_ex(c, &o, NULL);
  } else {
    rc = zs_step(c, lr_of(s), 0, 0, NULL);
  }
  for (uint32_t m = 0; m < M; m++)
    for (uint32_t t = 0; t < NT; t++) {
      int r = zs_wait(reqs[m][t]);
      if (rc == ZS_OK)
        rc = r;
    }
  return rc;
}

static int pull_all(zs_client *c, float **dst) {
  uint32_t ids[NT];
  size_t nbytes[NT];
  for (uint32_t t = 0; t < NT; t++) {
    ids[t] = t;
    nbytes[t] = TENSORS[t].numel * sizeof(float);
  }
  return zs_pull_many(c, NT, ids, (void *const *)dst, ZS_DTYPE_FP32, nbytes, NULL);
}

static void *trainer_main(void *p) {
  const tr_trainer *a = p;
  const run_cfg *cfg = a->cfg;
  rank_out *out = a->out;
  float *param[NT], *grad[M][NT], *init[NT];
  for (uint32_t t = 0; t < NT; t++) {
    param[t] = calloc(TENSORS[t].numel, sizeof(float));
    init[t] = calloc(TENSORS[t].numel, sizeof(float));
    out->final[t] = calloc(TENSORS[t].numel, sizeof(float));
    for (uint32_t m = 0; m < M; m++)
      grad[m][t] = calloc(TENSORS[t].numel, sizeof(float));
    for (uint64_t i = 0; i < TENSORS[t].numel; i++)
      init[t][i] = (float)sin(0.37 * (double)(i + 1) + 1.3 * t) * 0.5f;
  }
  zs_client *c = NULL;
  int rc = trainer_open(cfg, a->rank, &c);
  if (rc == ZS_OK)
    rc = zs_open_job(c, (const float *const *)init);
  if (rc != ZS_OK)
    trainer_fail(out, rc, "open");
  for (uint64_t s = 1; rc == ZS_OK && s <= K; s++) {
    if ((rc = pull_all(c, param)) != ZS_OK)
      trainer_fail(out, rc, "pull");
    else if ((rc = trainer_step(c, a->rank, s, param, grad)) != ZS_OK)
      trainer_fail(out, rc, "step");
  }
  if (rc == ZS_OK && (rc = pull_all(c, out->final)) != ZS_OK)
    trainer_fail(out, rc, "final pull");
  zs_client_close(c);
  for (uint32_t t = 0; t < NT; t++) {
    free(param[t]);
    free(init[t]);
    for (uint32_t m = 0; m < M; m++)
      free(grad[m][t]);
  }
  return NULL;
}

/* Trains on a fresh cluster; outs[r].final gets rank r's final parameters. */
static void train(int pipelined, rank_out *outs) {
  hs_cluster cl;
  run_cfg cfg = {.pipelined = pipelined};
  tr_cluster_up(&cl, N, NULL, cfg.addrs, sizeof cfg.addrs);
  tr_run_trainers(W, trainer_main, &cfg, outs, sizeof *outs);
  tr_reports_check(outs, W, pipelined ? "pipelined run" : "gated run");
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void pipelined_training_has_the_bits_of_the_gated_one(void **state) {
  (void)state;
  rank_out gated[W], piped[W];
  train(0, gated);
  train(1, piped);
  for (uint32_t r = 0; r < W; r++) {
    for (uint32_t t = 0; t < NT; t++) {
      size_t n = TENSORS[t].numel * sizeof(float);
      /* Each rank pulled the same final parameters on both runs, and every
       * rank but the bf16 one the same as rank 0. */
      if ((r != 1 && memcmp(gated[r].final[t], gated[0].final[t], n) != 0) ||
          memcmp(piped[r].final[t], gated[r].final[t], n) != 0)
        fail_msg("tensor %s differs (rank %u) between the gated and the pipelined run",
                 TENSORS[t].name, r);
      /* And training moved them. */
      assert_true(gated[r].final[t][0] != (float)sin(0.37 + 1.3 * t) * 0.5f);
    }
  }
  tr_reports_free(gated, W, NT);
  tr_reports_free(piped, W, NT);
}

/* ---- the shard's side, call by call --------------------------------------------- */

static void a_piece_is_pulled_at_the_new_version_before_the_shard_moves(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 1, NULL), 0);
  spec sp;
  assert_int_equal(hs_spec_build(&sp, "pipe-calls", 1, 1, 1), 0);
  sp.pipelined = 1;
  hs_job j;
  assert_int_equal(hs_job_init_cluster(&j, &sp, &cl), 0);
  rpc_status st;
  assert_int_equal(hs_job_open(&j, 0, &st), 0);
  float *w[16] = {0};
  for (uint32_t t = 0; t < j.sp.num_tensors; t++) {
    w[t] = calloc(j.sp.tensors[t].numel, sizeof(float));
    for (uint64_t i = 0; i < j.sp.tensors[t].numel; i++)
      w[t][i] = 0.25f + 0.001f * (float)i;
  }
  assert_int_equal(hs_job_init_params(&j, w, &st), 0);
  rpc_channel *ch = j.ch[0];

  /* GradStats has nothing to say in a pipelined job. */
  Zshard__V1__GradStatsResponse *gs = NULL;
  assert_int_equal(hs_grad_stats(ch, j.hash, 1, 1000, &gs, &st), ZS_EINVAL);
  assert_non_null(strstr(st.message, "pipelined"));
  /* The Apply comes first and is answered at once, not applied yet. */
  Zshard__V1__ApplyResponse *ar = NULL;
  assert_int_equal(hs_apply(ch, j.hash, 1, 0.01, 1.0f, 1, &ar, &st), ZS_EINVAL);
  assert_non_null(strstr(st.message, "skipped"));
  assert_int_equal(hs_apply(ch, j.hash, 1, 0.01, 1.0f, 0, &ar, &st), 0);
  assert_int_equal(ar->step, 1);
  assert_int_equal(ar->version, 0);
  protobuf_c_message_free_unpacked(&ar->base, NULL);
  assert_int_equal(hs_apply(ch, j.hash, 1, 0.02, 1.0f, 0, &ar, &st), ZS_EEXIST);

  /* Tensor 0's contribution: its piece is applied, and pulled at version 1
   * while the shard is still at 0 (tensor 1 has no contribution yet). */
  const uint64_t n0 = j.sp.tensors[0].numel, n1 = j.sp.tensors[1].numel;
  float *g = calloc(n0 > n1 ? n0 : n1, sizeof(float));
  for (uint64_t i = 0; i < n0 || i < n1; i++)
    g[i] = 0.125f;
  int dup = 0;
  assert_int_equal(hs_push(ch, j.hash, 1, 0, 0, 0, 0, ZS_DTYPE_FP32, g, n0 * 4, &dup, &st), 0);
  float *p0 = calloc(n0, sizeof(float));
  uint64_t version = 0;
  assert_int_equal(hs_pull(ch, j.hash, 0, 0, 1, ZS_DTYPE_FP32, 30000, p0, n0 * 4, &version, &st),
                   0);
  assert_int_equal(version, 1);
  assert_true(p0[0] != w[0][0]);
  Zshard__V1__GetInfoResponse *info = NULL;
  assert_int_equal(hs_get_info(ch, &info, &st), 0);
  assert_int_equal(info->version, 0);
  protobuf_c_message_free_unpacked(&info->base, NULL);

  /* The other pieces' contributions complete the step. */
  for (uint32_t t = 1; t < j.sp.num_tensors; t++) {
    uint64_t nt = j.sp.tensors[t].numel;
    float *gt = calloc(nt, sizeof(float));
    assert_int_equal(hs_push(ch, j.hash, 1, 0, 0, t, 0, ZS_DTYPE_FP32, gt, nt * 4, &dup, &st), 0);
    free(gt);
  }
  /* Each pull waits for its own piece only: the shard's version is 1 once
   * every piece has been pulled at 1 (the pass that applies the last piece
   * finishes the step under the same lock). */
  float *p1 = calloc(n1, sizeof(float));
  assert_int_equal(hs_pull(ch, j.hash, 1, 0, 1, ZS_DTYPE_FP32, 30000, p1, n1 * 4, &version, &st),
                   0);
  assert_int_equal(version, 1);
  for (uint32_t t = 2; t < j.sp.num_tensors; t++) {
    uint64_t nt = j.sp.tensors[t].numel;
    float *pt = calloc(nt, sizeof(float));
    assert_int_equal(hs_pull(ch, j.hash, t, 0, 1, ZS_DTYPE_FP32, 30000, pt, nt * 4, &version, &st),
                     0);
    assert_int_equal(version, 1);
    free(pt);
  }
  assert_int_equal(hs_get_info(ch, &info, &st), 0);
  assert_int_equal(info->version, 1);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  /* A late trainer's Apply gets the recorded outcome. */
  assert_int_equal(hs_apply(ch, j.hash, 1, 0.01, 1.0f, 0, &ar, &st), 0);
  assert_int_equal(ar->version, 1);
  protobuf_c_message_free_unpacked(&ar->base, NULL);

  for (uint32_t t = 0; t < j.sp.num_tensors; t++)
    free(w[t]);
  free(g);
  free(p0);
  free(p1);
  hs_job_free(&j);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- the client's refusals ------------------------------------------------------ */

static void clipping_and_statistics_are_refused_in_a_pipelined_job(void **state) {
  (void)state;
  hs_cluster cl;
  run_cfg cfg = {.pipelined = 1};
  tr_cluster_up(&cl, 1, NULL, cfg.addrs, sizeof cfg.addrs);

  /* Dynamic loss scaling needs the overflow check. */
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg.addrs;
  o.pipelined = 1;
  o.loss_scaling = ZS_LOSS_SCALE_DYNAMIC;
  zs_client *bad = NULL;
  assert_int_equal(zs_client_open(&o, &bad), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "overflow check"));

  /* One trainer of a one-trainer job: W = 3 here is not what it opens. */
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = cfg.addrs;
  o.job = "pipe-refusals";
  o.pipelined = 1;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options go;
  group_options(0, &go);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  assert_int_equal(zs_add_tensor(c, "w", 40, 0, NULL, 0, NULL), ZS_OK);
  float init[40], grad[40];
  for (int i = 0; i < 40; i++) {
    init[i] = 0.5f;
    grad[i] = 0.25f;
  }
  const float *inits[1] = {init};
  assert_int_equal(zs_open_job(c, inits), ZS_OK);
  assert_int_equal(zs_push(c, 0, 0, grad, ZS_DTYPE_FP32, sizeof grad, NULL), ZS_OK);

  assert_int_equal(zs_step(c, 0.1, 1.0, 0, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "pipelined"));
  zs_step_options so;
  zs_step_options_init(&so);
  so.lr = 0.1;
  so.clip_coef = 0.5;
  assert_int_equal(zs_step_ex(c, &so, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "clip_coef"));
  double norm = 0;
  int overflow = 0;
  assert_int_equal(zs_grad_norm(c, 0, &norm, &overflow), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "pipelined"));

  /* A gated trainer does not join the pipelined job: another spec hash. */
  zs_client *gated = NULL;
  o.pipelined = 0;
  assert_int_equal(zs_client_open(&o, &gated), ZS_OK);
  assert_int_equal(zs_add_group(gated, &go, NULL), ZS_OK);
  assert_int_equal(zs_add_tensor(gated, "w", 40, 0, NULL, 0, NULL), ZS_OK);
  assert_int_equal(zs_open_job(gated, inits), ZS_EHASH);
  zs_client_close(gated);

  /* The refusals changed nothing: the step goes through without clipping. */
  zs_step_result res;
  zs_step_result_init(&res);
  assert_int_equal(zs_step(c, 0.1, 0, 0, &res), ZS_OK);
  assert_int_equal(res.step, 1);
  assert_true(isnan(res.grad_norm));
  float after[40];
  assert_int_equal(zs_pull(c, 0, after, ZS_DTYPE_FP32, sizeof after, NULL), ZS_OK);
  assert_true(after[0] < 0.5f);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- checkpoints ------------------------------------------------------------------ */

/* One pipelined step of a one-trainer job of one tensor "w" (n elements). */
static void solo_step(zs_client *c, float *param, float *grad, size_t n, float seed) {
  assert_int_equal(zs_pull(c, 0, param, ZS_DTYPE_FP32, n * sizeof(float), NULL), ZS_OK);
  for (size_t i = 0; i < n; i++)
    grad[i] = 0.5f * param[i] + seed * 0.01f * (float)(i % 7);
  zs_request *req = NULL;
  assert_int_equal(zs_push(c, 0, 0, grad, ZS_DTYPE_FP32, n * sizeof(float), &req), ZS_OK);
  assert_int_equal(zs_step(c, 0.05, 0, 0, NULL), ZS_OK);
  assert_int_equal(zs_wait(req), ZS_OK);
}

static void a_checkpoint_of_a_pipelined_job_is_one_whole_version(void **state) {
  (void)state;
  char dir[600];
  snprintf(dir, sizeof dir, "%s/pipe-ckpt", hs_tmpdir());
  const char *extra[] = {"--state-dir", dir, NULL};
  hs_cluster cl;
  char addrs[128];
  tr_cluster_up(&cl, 2, extra, addrs, sizeof addrs);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.job = "pipe-ckpt";
  o.split_threshold = SPLIT;
  o.pipelined = 1;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options go;
  group_options(0, &go);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  enum { n = 200 };
  assert_int_equal(zs_add_tensor(c, "w", n, 0, NULL, 0, NULL), ZS_OK);
  float init[n], param[n], grad[n], at2[n], back[n];
  for (int i = 0; i < n; i++)
    init[i] = 0.25f + 0.001f * (float)i;
  const float *inits[1] = {init};
  assert_int_equal(zs_open_job(c, inits), ZS_OK);
  solo_step(c, param, grad, n, 1.0f);
  solo_step(c, param, grad, n, 2.0f);
  /* Between steps 2 and 3: the shards are at version 2, or get there. */
  assert_int_equal(zs_checkpoint(c, 2), ZS_OK);
  assert_int_equal(zs_pull(c, 0, at2, ZS_DTYPE_FP32, sizeof at2, NULL), ZS_OK);
  solo_step(c, param, grad, n, 3.0f);
  assert_int_equal(zs_pull(c, 0, back, ZS_DTYPE_FP32, sizeof back, NULL), ZS_OK);
  assert_true(memcmp(back, at2, sizeof at2) != 0);
  assert_int_equal(zs_restore(c, 2), ZS_OK);
  assert_int_equal(zs_pull(c, 0, back, ZS_DTYPE_FP32, sizeof back, NULL), ZS_OK);
  assert_memory_equal(back, at2, sizeof at2);
  /* The pipelined steps go on from the restored version. */
  solo_step(c, param, grad, n, 3.0f);
  assert_int_equal(zs_pull(c, 0, back, ZS_DTYPE_FP32, sizeof back, NULL), ZS_OK);
  assert_true(memcmp(back, at2, sizeof at2) != 0);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- the spec ------------------------------------------------------------------- */

static void pipelined_is_hashed_and_kept_by_checkpoints(void **state) {
  (void)state;
  spec gated, piped, back;
  assert_int_equal(hs_spec_build(&gated, "pipe-spec", 2, 1, 2), 0);
  assert_int_equal(spec_copy(&piped, &gated), 0);
  piped.pipelined = 1;
  assert_int_equal(spec_validate(&piped, NULL, 0), 0);
  assert_true(spec_hash(&gated) != spec_hash(&piped));
  unsigned char *eg = NULL, *ep = NULL;
  size_t lg = 0, lp = 0;
  assert_int_equal(spec_encode(&gated, &eg, &lg), 0);
  assert_int_equal(spec_encode(&piped, &ep, &lp), 0);
  /* The gated encoding is the pipelined one without its last u32 (1). */
  assert_int_equal(lp, lg + 4);
  assert_memory_equal(eg, ep, lg);
  assert_memory_equal(ep + lg, "\x01\0\0\0", 4);
  char why[256];
  assert_int_equal(ckpt__dec_spec(ep, lp, &back, why, sizeof why), 0);
  assert_int_equal(back.pipelined, 1);
  assert_true(spec_hash(&back) == spec_hash(&piped));
  spec_free(&back);
  assert_int_equal(ckpt__dec_spec(eg, lg, &back, why, sizeof why), 0);
  assert_int_equal(back.pipelined, 0);
  spec_free(&back);
  /* Any other trailing value is refused. */
  ep[lg] = 2;
  assert_int_not_equal(ckpt__dec_spec(ep, lp, &back, why, sizeof why), 0);
  free(eg);
  free(ep);
  spec_free(&gated);
  spec_free(&piped);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(pipelined_training_has_the_bits_of_the_gated_one),
      cmocka_unit_test(a_piece_is_pulled_at_the_new_version_before_the_shard_moves),
      cmocka_unit_test(clipping_and_statistics_are_refused_in_a_pipelined_job),
      cmocka_unit_test(pipelined_is_hashed_and_kept_by_checkpoints),
      cmocka_unit_test(a_checkpoint_of_a_pipelined_job_is_one_whole_version),
  };
  return TR_RUN_TESTS(tests);
}
