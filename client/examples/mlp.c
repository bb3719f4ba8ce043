/*
 * zshard-mlp — a real (small) training run through zshard.
 *
 * A multi-layer perceptron 64 -> H1 -> H2 -> 10 with ReLU and softmax
 * cross-entropy, forward and backward in plain C, classifies the 8x8
 * handwritten digits shipped by Debian's python3-sklearn (or a synthetic
 * stand-in, see digits.h). W copies of this program (ranks 0..W-1) each train
 * on their own share of the data; the N shard servers hold the weights and the
 * AdamW state. Every step each trainer
 *
 *   - pulls the six tensors (asynchronously, all at once, waiting for each
 *     layer just before its forward),
 *   - runs forward and backward on M micro-batches, pushing each gradient as
 *     soon as backward produced it (last layer first, overlapping with the
 *     rest of backward),
 *   - calls zs_step, which applies AdamW on the shards once every trainer's
 *     gradients are in,
 *
 * and prints its loss and where the time went. Only the public header
 * <zshard/zshard.h> is used, and the program links the shared library.
 *
 * Recovery: with shards started with --state-dir, --checkpoint-every K makes
 * rank 0 checkpoint the job every K steps. When a step fails because a shard
 * restarted behind the cluster (or is gone for a while), every trainer
 * restores the newest checkpoint common to all shards (zs_restore) and goes
 * on from there. The samples of step s depend on s alone, so a recovered run
 * trains on exactly the data of an uninterrupted one.
 *
 *   zshard-mlp --shards 127.0.0.1:7070,127.0.0.1:7071 --rank 0 --world 2
 */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "digits.h"
#include "zshard/zshard.h"

#define NT 6 /* tensors: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias */
#define MAX_ACCUM 16

typedef struct config {
  const char *shards;
  uint32_t rank, world, accum, steps, batch, h1, h2, prefetch, log_every;
  double lr, clip;
  uint64_t seed;
  const char *data;
  int data_given;
  int synthetic;
  zs_dtype wire;
  uint32_t error_feedback; /* with --wire int8 */
  uint32_t timeout_ms;
  const char *job;
  uint32_t checkpoint_every, max_recoveries;
  uint64_t until_step; /* 0: --steps more steps from where the job is */
} config;

typedef struct model {
  uint32_t dims[4]; /* 64, H1, H2, 10 */
  uint64_t numel[NT];
  float *param[NT];           /* pulled parameters, fp32 */
  float *grad[MAX_ACCUM][NT]; /* one gradient set per micro-batch: pushes of
                                 micro m may still be on the wire while m+1
                                 runs */
  float *act[3];              /* h1, h2, logits for one micro-batch */
  float *dact[3];
} model;

static void usage(FILE *f) {
  fprintf(f,
          "usage: zshard-mlp --shards ADDR[,ADDR...] [options]\n"
          "  --shards LIST      shard addresses in shard-id order (or a {i} pattern with "
          "--num-shards)\n"
          "  --rank R           this trainer's rank (default 0)\n"
          "  --world W          number of trainers (default 1)\n"
          "  --accum M          micro-batches per step (default 1)\n"
          "  --steps S          optimizer steps (default 100)\n"
          "  --until-step S     train until the job's version is S instead (the same\n"
          "                     target for every trainer, however often it restarts)\n"
          "  --batch B          samples per micro-batch (default 32)\n"
          "  --hidden H1,H2     hidden widths (default 64,32)\n"
          "  --lr LR            AdamW learning rate (default 0.01)\n"
          "  --clip NORM        clip the global gradient norm (default 0: off)\n"
          "  --wire fp32|bf16|fp16|int8  dtype of gradients and parameters on the wire\n"
          "                     (default bf16); int8: blocks of 128 with a scale, the\n"
          "                     biases' group in bf16\n"
          "  --error-feedback on|off  keep what int8 pushes lose and add it to the next\n"
          "                     push (default on)\n"
          "  --prefetch K       library prefetch depth (default 0: the example prefetches itself)\n"
          "  --data PATH        digits.csv.gz (default the python3-sklearn copy)\n"
          "  --synthetic        use the synthetic task even if the data is installed\n"
          "  --seed N           initialisation and shuffling seed (default 1)\n"
          "  --timeout-ms T     how long a step waits for the other trainers (default 60000)\n"
          "  --job NAME         job name (default zshard-mlp)\n"
          "  --log-every K      print every K steps (default 1)\n"
          "  --checkpoint-every K  checkpoint the job every K steps (rank 0; the shards\n"
          "                     need --state-dir; default 0: never)\n"
          "  --max-recoveries N restore the newest checkpoint at most N times when a\n"
          "                     shard restarted or was lost (default 5)\n");
}

static int parse_u32(const char *s, uint32_t *out) {
  char *end;
  unsigned long v = strtoul(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v > UINT32_MAX)
    return -1;
  *out = (uint32_t)v;
  return 0;
}

static int parse_args(int argc, char **argv, config *cfg) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"rank", required_argument, NULL, 'r'},
                                       {"world", required_argument, NULL, 'w'},
                                       {"accum", required_argument, NULL, 'm'},
                                       {"steps", required_argument, NULL, 'n'},
                                       {"batch", required_argument, NULL, 'b'},
                                       {"hidden", required_argument, NULL, 'H'},
                                       {"lr", required_argument, NULL, 'l'},
                                       {"clip", required_argument, NULL, 'c'},
                                       {"wire", required_argument, NULL, 'W'},
                                       {"error-feedback", required_argument, NULL, 'E'},
                                       {"prefetch", required_argument, NULL, 'p'},
                                       {"data", required_argument, NULL, 'd'},
                                       {"synthetic", no_argument, NULL, 'S'},
                                       {"seed", required_argument, NULL, 'e'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"job", required_argument, NULL, 'j'},
                                       {"log-every", required_argument, NULL, 'L'},
                                       {"checkpoint-every", required_argument, NULL, 'C'},
                                       {"max-recoveries", required_argument, NULL, 'R'},
                                       {"until-step", required_argument, NULL, 'U'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  *cfg = (config){.rank = 0,
                  .world = 1,
                  .accum = 1,
                  .steps = 100,
                  .batch = 32,
                  .h1 = 64,
                  .h2 = 32,
                  .lr = 0.01,
                  .seed = 1,
                  .data = DIGITS_DEFAULT_PATH,
                  .wire = ZS_DTYPE_BF16,
                  .error_feedback = 1,
                  .timeout_ms = 60000,
                  .job = "zshard-mlp",
                  .log_every = 1,
                  .max_recoveries = 5};
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    int bad = 0;
    switch (c) {
    case 's':
      cfg->shards = optarg;
      break;
    case 'r':
      bad = parse_u32(optarg, &cfg->rank);
      break;
    case 'w':
      bad = parse_u32(optarg, &cfg->world);
      break;
    case 'm':
      bad = parse_u32(optarg, &cfg->accum);
      break;
    case 'n':
      bad = parse_u32(optarg, &cfg->steps);
      break;
    case 'b':
      bad = parse_u32(optarg, &cfg->batch);
      break;
    case 'H':
      bad = sscanf(optarg, "%" SCNu32 ",%" SCNu32, &cfg->h1, &cfg->h2) != 2;
      break;
    case 'l':
      cfg->lr = strtod(optarg, NULL);
      break;
    case 'c':
      cfg->clip = strtod(optarg, NULL);
      break;
    case 'W':
      if (strcmp(optarg, "fp32") == 0)
        cfg->wire = ZS_DTYPE_FP32;
      else if (strcmp(optarg, "bf16") == 0)
        cfg->wire = ZS_DTYPE_BF16;
      else if (strcmp(optarg, "fp16") == 0)
        cfg->wire = ZS_DTYPE_FP16;
      else if (strcmp(optarg, "int8") == 0)
        cfg->wire = ZS_DTYPE_INT8_BLOCK;
      else
        bad = 1;
      break;
    case 'E':
      if (strcmp(optarg, "on") == 0 || strcmp(optarg, "off") == 0)
        cfg->error_feedback = strcmp(optarg, "on") == 0;
      else
        bad = 1;
      break;
    case 'p':
      bad = parse_u32(optarg, &cfg->prefetch);
      break;
    case 'd':
      cfg->data = optarg;
      cfg->data_given = 1;
      break;
    case 'S':
      cfg->synthetic = 1;
      break;
    case 'e':
      cfg->seed = strtoull(optarg, NULL, 10);
      break;
    case 't':
      bad = parse_u32(optarg, &cfg->timeout_ms);
      break;
    case 'j':
      cfg->job = optarg;
      break;
    case 'L':
      bad = parse_u32(optarg, &cfg->log_every);
      break;
    case 'C':
      bad = parse_u32(optarg, &cfg->checkpoint_every);
      break;
    case 'R':
      bad = parse_u32(optarg, &cfg->max_recoveries);
      break;
    case 'U': {
      char *end;
      cfg->until_step = strtoull(optarg, &end, 10);
      bad = *optarg == '\0' || *end != '\0' || cfg->until_step == 0;
      break;
    }
    case 'h':
      usage(stdout);
      exit(0);
    default:
      bad = 1;
    }
    if (bad) {
      usage(stderr);
      return -1;
    }
  }
  if (!cfg->shards || cfg->world == 0 || cfg->rank >= cfg->world || cfg->accum == 0 ||
      cfg->accum > MAX_ACCUM || cfg->batch == 0 || cfg->h1 == 0 || cfg->h2 == 0 ||
      cfg->log_every == 0 || !(cfg->lr > 0) || !(cfg->clip >= 0)) {
    fprintf(stderr,
            "zshard-mlp: --shards is required; rank < world, 1 <= accum <= %d, positive "
            "batch, hidden sizes, lr\n",
            MAX_ACCUM);
    usage(stderr);
    return -1;
  }
  return 0;
}

/* ---- the model ------------------------------------------------------------- */

static void model_free(model *m) {
  for (int t = 0; t < NT; t++) {
    free(m->param[t]);
    for (int k = 0; k < MAX_ACCUM; k++)
      free(m->grad[k][t]);
  }
  for (int i = 0; i < 3; i++) {
    free(m->act[i]);
    free(m->dact[i]);
  }
}

static int model_alloc(model *m, const config *cfg) {
  memset(m, 0, sizeof *m);
  m->dims[0] = DIGITS_FEATURES;
  m->dims[1] = cfg->h1;
  m->dims[2] = cfg->h2;
  m->dims[3] = DIGITS_CLASSES;
  for (int l = 0; l < 3; l++) {
    m->numel[2 * l] = (uint64_t)m->dims[l + 1] * m->dims[l];
    m->numel[2 * l + 1] = m->dims[l + 1];
  }
  for (int t = 0; t < NT; t++) {
    m->param[t] = malloc(m->numel[t] * sizeof(float));
    if (!m->param[t])
      return -1;
    for (uint32_t k = 0; k < cfg->accum; k++)
      if (!(m->grad[k][t] = malloc(m->numel[t] * sizeof(float))))
        return -1;
  }
  for (int l = 0; l < 3; l++) {
    size_t n = (size_t)cfg->batch * m->dims[l + 1];
    if (!(m->act[l] = malloc(n * sizeof(float))) || !(m->dact[l] = malloc(n * sizeof(float))))
      return -1;
  }
  return 0;
}

/* torch.nn.Linear's default initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
 * for weight and bias. Only rank 0's copy is used (it becomes version 0). */
static void model_init(model *m, uint64_t seed) {
  uint64_t rs = seed * 7919u + 17u;
  for (int l = 0; l < 3; l++) {
    float bound = 1.0f / sqrtf((float)m->dims[l]);
    for (int t = 2 * l; t <= 2 * l + 1; t++)
      for (uint64_t i = 0; i < m->numel[t]; i++)
        m->param[t][i] = (2.0f * digits_uniform(&rs) - 1.0f) * bound;
  }
}

/* out[b][o] = relu?(sum_i in[b][i] * w[o][i] + bias[o]) */
static void linear_forward(const float *in, const float *w, const float *bias, float *out,
                           uint32_t batch, uint32_t nin, uint32_t nout, int relu) {
  for (uint32_t b = 0; b < batch; b++) {
    for (uint32_t o = 0; o < nout; o++) {
      float a = bias[o];
      const float *wr = &w[(size_t)o * nin];
      const float *x = &in[(size_t)b * nin];
      for (uint32_t i = 0; i < nin; i++)
        a += wr[i] * x[i];
      out[(size_t)b * nout + o] = relu && a < 0 ? 0 : a;
    }
  }
}

/* Given dout (gradient w.r.t. the layer's output), fills dw, db and (if din)
 * din = dout * w. */
static void linear_backward(const float *in, const float *w, const float *dout, float *dw,
                            float *db, float *din, uint32_t batch, uint32_t nin, uint32_t nout) {
  memset(dw, 0, (size_t)nout * nin * sizeof(float));
  memset(db, 0, nout * sizeof(float));
  for (uint32_t b = 0; b < batch; b++) {
    const float *x = &in[(size_t)b * nin];
    for (uint32_t o = 0; o < nout; o++) {
      float g = dout[(size_t)b * nout + o];
      db[o] += g;
      float *dwr = &dw[(size_t)o * nin];
      for (uint32_t i = 0; i < nin; i++)
        dwr[i] += g * x[i];
    }
  }
  if (!din)
    return;
  for (uint32_t b = 0; b < batch; b++) {
    for (uint32_t i = 0; i < nin; i++) {
      float a = 0;
      for (uint32_t o = 0; o < nout; o++)
        a += dout[(size_t)b * nout + o] * w[(size_t)o * nin + i];
      din[(size_t)b * nin + i] = a;
    }
  }
}

/* Mean softmax cross-entropy of the logits; dlogits gets its gradient times
 * `scale` (1/M for gradient accumulation). */
static double softmax_xent(const float *logits, const uint8_t *y, float *dlogits, uint32_t batch,
                           float scale) {
  double loss = 0;
  for (uint32_t b = 0; b < batch; b++) {
    const float *z = &logits[(size_t)b * DIGITS_CLASSES];
    float *dz = &dlogits[(size_t)b * DIGITS_CLASSES];
    float mx = z[0];
    for (int c = 1; c < DIGITS_CLASSES; c++)
      mx = z[c] > mx ? z[c] : mx;
    double sum = 0;
    for (int c = 0; c < DIGITS_CLASSES; c++)
      sum += exp((double)(z[c] - mx));
    loss += log(sum) + mx - z[y[b]];
    for (int c = 0; c < DIGITS_CLASSES; c++) {
      double p = exp((double)(z[c] - mx)) / sum;
      dz[c] = (float)((p - (c == y[b])) / batch) * scale;
    }
  }
  return loss / batch;
}

/* Gathers a micro-batch from this rank's share of the training set. Sample k
 * of the run (k counts over steps, micro-batches and batch rows) is element
 * k mod n of epoch k / n's shuffle, whose seed depends on the epoch only: the
 * data of a step is a function of the step, so a run resumed from a
 * checkpoint sees what an uninterrupted one saw. */
typedef struct sampler {
  const digits *d;
  size_t *base; /* indices of this rank's samples */
  size_t *idx;  /* their shuffle for epoch `epoch` */
  size_t n;
  uint64_t seed, epoch;
} sampler;

static void shuffle(sampler *s, uint64_t epoch) {
  uint64_t rs = s->seed + epoch * 7919u;
  memcpy(s->idx, s->base, s->n * sizeof *s->idx);
  for (size_t i = s->n; i > 1; i--) {
    size_t j = (size_t)(digits_rand(&rs) % i);
    size_t t = s->idx[i - 1];
    s->idx[i - 1] = s->idx[j];
    s->idx[j] = t;
  }
  s->epoch = epoch;
}

/* Micro-batch `micro` of step `step` (1-based) with `accum` per step. */
static void sample(sampler *s, uint64_t step, uint32_t micro, uint32_t accum, uint32_t batch,
                   float *x, uint8_t *y) {
  uint64_t first = ((step - 1) * accum + micro) * batch;
  for (uint32_t b = 0; b < batch; b++) {
    uint64_t k = first + b;
    if (k / s->n != s->epoch)
      shuffle(s, k / s->n);
    size_t i = s->idx[k % s->n];
    memcpy(&x[(size_t)b * DIGITS_FEATURES], &s->d->x[i * DIGITS_FEATURES],
           DIGITS_FEATURES * sizeof(float));
    y[b] = s->d->y[i];
  }
}

/* ---- training ---------------------------------------------------------------- */

static int fail(const char *what, int rc) {
  fprintf(stderr, "zshard-mlp: %s: %s (%s)\n", what, zs_strerror(rc), zs_last_error());
  return 1;
}

static const char *const names[NT] = {"fc1.weight", "fc1.bias",   "fc2.weight",
                                      "fc2.bias",   "fc3.weight", "fc3.bias"};

/* Accuracy and loss on samples [first, n) with the parameters in m. */
static void evaluate(model *m, const digits *d, size_t first, double *loss, double *acc) {
  float h1[256], h2[256], z[DIGITS_CLASSES], dz[DIGITS_CLASSES];
  double l = 0;
  size_t right = 0, cnt = d->n - first;
  for (size_t i = first; i < d->n; i++) {
    const float *x = &d->x[i * DIGITS_FEATURES];
    linear_forward(x, m->param[0], m->param[1], h1, 1, m->dims[0], m->dims[1], 1);
    linear_forward(h1, m->param[2], m->param[3], h2, 1, m->dims[1], m->dims[2], 1);
    linear_forward(h2, m->param[4], m->param[5], z, 1, m->dims[2], m->dims[3], 0);
    l += softmax_xent(z, &d->y[i], dz, 1, 1.0f);
    int best = 0;
    for (int c = 1; c < DIGITS_CLASSES; c++)
      best = z[c] > z[best] ? c : best;
    right += (size_t)best == d->y[i];
  }
  *loss = cnt ? l / (double)cnt : 0;
  *acc = cnt ? (double)right / (double)cnt : 0;
}

int main(int argc, char **argv) {
  config cfg;
  if (parse_args(argc, argv, &cfg) != 0)
    return 2;
  if (cfg.h1 > 256 || cfg.h2 > 256) {
    fprintf(stderr, "zshard-mlp: hidden sizes are limited to 256\n");
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);

  digits data;
  char err[512];
  if (cfg.synthetic || digits_load(&data, cfg.data, err, sizeof err) != 0) {
    if (cfg.data_given && !cfg.synthetic) {
      fprintf(stderr, "zshard-mlp: %s\n", err);
      return 1;
    }
    if (!cfg.synthetic)
      fprintf(stderr,
              "zshard-mlp: %s; training on the synthetic task instead (install python3-sklearn "
              "for the real digits)\n",
              err);
    if (digits_synthetic(&data, 1797, 1234) != 0) {
      fprintf(stderr, "zshard-mlp: out of memory\n");
      return 1;
    }
  }
  /* The last 297 samples are held out; the rest is dealt round robin. */
  size_t n_eval = data.n > 600 ? 297 : data.n / 5, n_train = data.n - n_eval;
  sampler smp = {.d = &data, .seed = cfg.seed * 1000003u + cfg.rank};
  smp.base = malloc(n_train * sizeof *smp.base);
  smp.idx = malloc(n_train * sizeof *smp.idx);
  model m;
  float *xb = malloc((size_t)cfg.batch * DIGITS_FEATURES * sizeof(float));
  uint8_t *yb = malloc(cfg.batch);
  if (!smp.base || !smp.idx || !xb || !yb || model_alloc(&m, &cfg) != 0) {
    fprintf(stderr, "zshard-mlp: out of memory\n");
    return 1;
  }
  for (size_t i = cfg.rank; i < n_train; i += cfg.world)
    smp.base[smp.n++] = i;
  if (smp.n == 0) {
    fprintf(stderr, "zshard-mlp: rank %" PRIu32 " has no training data\n", cfg.rank);
    return 1;
  }
  shuffle(&smp, 0);

  /* ---- connect and describe the model ---- */
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg.shards;
  o.rank = cfg.rank;
  o.world_size = cfg.world;
  o.grad_accum = cfg.accum;
  o.job = cfg.job;
  o.push_dtype = cfg.wire;
  o.pull_dtype = cfg.wire;
  o.error_feedback = cfg.wire == ZS_DTYPE_INT8_BLOCK && cfg.error_feedback;
  o.step_timeout_ms = cfg.timeout_ms;
  o.prefetch_depth = cfg.prefetch;
  o.checkpoint_every = cfg.checkpoint_every;
  /* Small tensors: split anything of at least 1024 elements over the shards
   * so that the example exercises split and whole pieces alike. */
  o.split_threshold = 1024;
  zs_client *c = NULL;
  int rc = zs_client_open(&o, &c);
  if (rc != ZS_OK)
    return fail("zs_client_open", rc);
  zs_group_options g;
  uint32_t g_decay, g_nodecay;
  zs_group_options_init(&g, ZS_OPTIM_ADAMW); /* weight decay 0.01 */
  if ((rc = zs_add_group(c, &g, &g_decay)) != ZS_OK)
    return fail("zs_add_group", rc);
  g.weight_decay = 0; /* biases are not decayed */
  /* and, being small, are not worth quantizing: their group keeps bf16 */
  if (cfg.wire == ZS_DTYPE_INT8_BLOCK)
    g.push_dtype = g.pull_dtype = ZS_DTYPE_BF16;
  if ((rc = zs_add_group(c, &g, &g_nodecay)) != ZS_OK)
    return fail("zs_add_group", rc);
  for (int t = 0; t < NT; t++) {
    int l = t / 2;
    uint64_t shape[2] = {m.dims[l + 1], m.dims[l]};
    rc = zs_add_tensor(c, names[t], m.numel[t], t % 2 ? g_nodecay : g_decay, shape, t % 2 ? 1 : 2,
                       NULL);
    if (rc != ZS_OK)
      return fail("zs_add_tensor", rc);
  }
  model_init(&m, cfg.seed);
  const float *init[NT];
  for (int t = 0; t < NT; t++)
    init[t] = m.param[t];
  rc = zs_open_job(c, init);
  if (rc == ZS_EBEHIND) {
    /* A shard restarted behind the others: the message names the
     * checkpoint to resume from, which zs_restore(c, 0) picks. */
    fprintf(stderr, "zshard-mlp: %s\n", zs_last_error());
    if ((rc = zs_restore(c, 0)) != ZS_OK)
      return fail("zs_restore", rc);
    rc = zs_open_job(c, init);
  }
  if (rc != ZS_OK)
    return fail("zs_open_job", rc);
  printf("rank %" PRIu32 "/%" PRIu32 ": %s data (%zu train samples here, %zu held out), "
         "MLP 64-%" PRIu32 "-%" PRIu32 "-10, %" PRIu32 " micro-batch(es) of %" PRIu32
         ", starting at step %" PRIu64 "\n",
         cfg.rank, cfg.world, data.synthetic ? "synthetic" : "digits", smp.n, n_eval, cfg.h1,
         cfg.h2, cfg.accum, cfg.batch, zs_current_step(c));

  /* ---- train ---- */
  /* Requests not yet waited for are kept here, so that a failed step can
   * wait for all of them before the job is restored. */
  zs_request *pulls[NT], *pushes[MAX_ACCUM][NT];
  const size_t fb = sizeof(float);
  const uint64_t first = zs_current_step(c);
  const uint64_t target = cfg.until_step ? cfg.until_step : first - 1 + cfg.steps;
  uint32_t recoveries = 0;
  while (zs_current_step(c) <= target) {
    const uint64_t step = zs_current_step(c);
    const char *what = NULL;
    memset(pulls, 0, sizeof pulls);
    memset(pushes, 0, sizeof pushes);
    /* All pulls at once; each layer waits for its own tensors only. */
    for (int t = 0; t < NT && !what; t++)
      if ((rc = zs_pull(c, (uint32_t)t, m.param[t], ZS_DTYPE_FP32, m.numel[t] * fb, &pulls[t])) !=
          ZS_OK)
        what = "zs_pull";
    double loss = 0;
    for (uint32_t mb = 0; mb < cfg.accum && !what; mb++) {
      sample(&smp, step, mb, cfg.accum, cfg.batch, xb, yb);
      for (int l = 0; l < 3 && !what; l++) {
        if (mb == 0) {
          for (int t = 2 * l; t <= 2 * l + 1 && !what; t++) {
            rc = zs_wait(pulls[t]);
            pulls[t] = NULL;
            if (rc != ZS_OK)
              what = "pull";
          }
        }
        if (!what)
          linear_forward(l == 0 ? xb : m.act[l - 1], m.param[2 * l], m.param[2 * l + 1], m.act[l],
                         cfg.batch, m.dims[l], m.dims[l + 1], l < 2);
      }
      if (what)
        break;
      loss += softmax_xent(m.act[2], yb, m.dact[2], cfg.batch, 1.0f / (float)cfg.accum);
      for (int l = 2; l >= 0 && !what; l--) {
        float *din = l > 0 ? m.dact[l - 1] : NULL;
        linear_backward(l == 0 ? xb : m.act[l - 1], m.param[2 * l], m.dact[l], m.grad[mb][2 * l],
                        m.grad[mb][2 * l + 1], din, cfg.batch, m.dims[l], m.dims[l + 1]);
        if (din) /* through the ReLU of the layer below */
          for (size_t i = 0; i < (size_t)cfg.batch * m.dims[l]; i++)
            if (m.act[l - 1][i] <= 0)
              din[i] = 0;
        /* This layer's gradients are final: send them while backward goes on. */
        for (int t = 2 * l; t <= 2 * l + 1 && !what; t++)
          if ((rc = zs_push(c, (uint32_t)t, mb, m.grad[mb][t], ZS_DTYPE_FP32, m.numel[t] * fb,
                            &pushes[mb][t])) != ZS_OK)
            what = "zs_push";
      }
    }
    /* Every request of the step is waited for, failed step or not. */
    for (int t = 0; t < NT; t++)
      if (pulls[t])
        zs_wait(pulls[t]);
    for (uint32_t mb = 0; mb < cfg.accum; mb++) {
      for (int t = 0; t < NT; t++) {
        if (!pushes[mb][t])
          continue;
        int prc = zs_wait(pushes[mb][t]);
        if (prc != ZS_OK && !what) {
          rc = prc;
          what = "push";
        }
      }
    }
    zs_step_result r;
    zs_step_result_init(&r);
    if (!what && (rc = zs_step(c, cfg.lr, cfg.clip, 0, &r)) != ZS_OK)
      what = "zs_step";
    if (what) {
      /* The recovery loop: a shard that restarted behind the cluster
       * answers ZS_EBEHIND; a lost one, connection errors and timeouts. The
       * job goes back to the newest checkpoint every shard holds (the other
       * trainers do the same, and find it done). */
      int lost = rc == ZS_EBEHIND || rc == ZS_ESTEP || rc == ZS_ECONN || rc == ZS_ETIMEDOUT ||
                 rc == ZS_ECLOSED || rc == ZS_ECANCELED;
      if (!lost || recoveries >= cfg.max_recoveries)
        return fail(what, rc);
      fprintf(stderr,
              "zshard-mlp: step %" PRIu64 " failed (%s: %s); restoring the newest checkpoint\n",
              step, what, zs_last_error());
      recoveries++;
      if ((rc = zs_restore(c, 0)) != ZS_OK) {
        fprintf(stderr, "zshard-mlp: zs_restore: %s (%s)\n", zs_strerror(rc), zs_last_error());
        continue; /* the next attempt may find the shard back */
      }
      printf("recovered: restored checkpoint step %" PRIu64 ", resuming at step %" PRIu64 "\n",
             zs_current_step(c) - 1, zs_current_step(c));
      continue;
    }
    zs_timing tm;
    if (step % cfg.log_every == 0 || step == first || step == target)
      if (zs_last_timing(c, &tm) == ZS_OK)
        printf("step %" PRIu64 " loss %.4f grad_norm %.4f %s | ms: total %.2f compute %.2f push "
               "%.2f pull_wait %.2f step %.2f | KiB pushed %.1f pulled %.1f\n",
               r.step, loss / cfg.accum, r.grad_norm, r.applied ? "applied" : "skipped",
               tm.total_ms, tm.compute_ms, tm.push_ms, tm.pull_wait_ms, tm.step_ms,
               tm.bytes_pushed / 1024.0, tm.bytes_pulled / 1024.0);
    if (cfg.checkpoint_every && cfg.rank == 0 && step % cfg.checkpoint_every == 0) {
      uint64_t saved = 0;
      if ((rc = zs_last_checkpoint(c, &saved)) != ZS_OK)
        fprintf(stderr, "zshard-mlp: the checkpoint of step %" PRIu64 " failed: %s\n", step,
                zs_last_error());
      else
        printf("checkpoint step %" PRIu64 "\n", saved);
    }
  }

  /* The final parameters, for the held-out score. */
  for (int t = 0; t < NT; t++)
    if ((rc = zs_pull(c, (uint32_t)t, m.param[t], ZS_DTYPE_FP32, m.numel[t] * fb, NULL)) != ZS_OK)
      return fail("zs_pull", rc);
  double eval_loss, eval_acc;
  evaluate(&m, &data, n_train, &eval_loss, &eval_acc);
  printf("final: held-out loss %.4f accuracy %.3f after %" PRIu64 " steps\n", eval_loss, eval_acc,
         zs_current_step(c) - 1);
  zs_client_close(c);
  model_free(&m);
  free(smp.base);
  free(smp.idx);
  free(xb);
  free(yb);
  digits_free(&data);
  return 0;
}
