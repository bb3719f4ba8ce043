/*
 * bench — `zshard bench`: load-tests a running cluster through libzshard,
 * the way redis-benchmark load-tests a Redis server: a number of requests of
 * a given payload with a given number in flight, and the throughput and the
 * latency distribution that came out.
 *
 * The load is a synthetic job (--job, default "zshard-bench"): --tensors
 * tensors of --payload bytes of bf16 each, plain SGD, W = --trainers trainer
 * threads (ranks 0 .. W-1), one micro-batch. A round is one training step
 * without compute: every trainer pushes every tensor once (a request each,
 * at most --concurrency in flight per trainer), zs_step, then every trainer
 * pulls every tensor once. Rounds repeat until each trainer has made
 * --requests pushes and as many pulls. A tensor above the split threshold
 * (64 Ki elements, 128 KiB of bf16) is split over all shards, so one request
 * then fans out to every shard.
 *
 * A request's latency runs from its submission (zs_push_cb / zs_pull_cb) to
 * its callback. Throughput is the payload bytes of a phase over the phase's
 * wall time (from the first trainer's start to the last one's end), summed
 * over the rounds.
 *
 * The shards keep one job for their lifetime: they must hold no job yet, or
 * the job of an earlier `zshard bench` with the same --job, --payload,
 * --tensors and --trainers (the run then continues at that job's step).
 *
 * Threads: the main thread parses, opens the clients and prints; one thread
 * per trainer runs the rounds; completions run on libzshard's threads and
 * only record the time and wake the trainer (under its mutex).
 */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_support.h"
#include "common/base/clock.h"
#include "zshard/zshard.h"

#define BENCH_MAX_TRAINERS 64u
#define BENCH_MAX_CONCURRENCY 4096u
#define BENCH_MAX_TENSORS 100000u

/* What the trainer threads share: the phase barrier and the gate that lets
 * them start once every one of them exists. */
typedef struct bench_sync {
  pthread_barrier_t phase;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int go; /* (mu) 1: run, -1: give up (not every trainer could start) */
} bench_sync;

enum { PH_PUSH = 0, PH_STEP = 1, PH_PULL = 2, PH_COUNT = 3 };

/* clock_now_ns() at the start [0] and end [1] of each phase of a round. */
typedef struct round_times {
  uint64_t t[PH_COUNT][2];
} round_times;

typedef struct bench_cfg {
  char **addr;
  uint32_t nshards;
  const char *addresses;
  uint64_t payload; /* bytes per request */
  uint64_t requests;
  uint32_t tensors, concurrency, trainers, connections;
  uint64_t rounds;
  zs_transport transport;
  const char *job;
  int json;
} bench_cfg;

/* One trainer: its client, its buffers and what it measured. */
typedef struct trainer {
  const bench_cfg *cfg;
  uint32_t rank;
  zs_client *c;
  pthread_t th;
  bench_sync *sync;     /* shared by all trainers */
  const uint16_t *grad; /* shared, read only */
  /* Pull destinations: one slot per request in flight. */
  uint16_t *slots;
  uint32_t *free_slots; /* (mu) stack of free slot indices */
  uint32_t nfree;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t inflight; /* (mu) */
  int failed;        /* (mu) the first failure's status */
  char err[256];     /* (mu) its sentence */
  /* Per request, in submission order: latency in seconds. */
  double *push_lat, *pull_lat;
  uint64_t npush, npull;
  /* Per round: this trainer's start and end of each phase. */
  struct round_times *rt;
} trainer;

/* A request in flight: which trainer, when it left, where its latency goes,
 * and the pull slot it holds (UINT32_MAX for a push). */
typedef struct inflight_req {
  trainer *t;
  uint64_t t0;
  double *lat;
  uint32_t slot;
} inflight_req;

static void bench_usage(FILE *f) {
  fprintf(f,
          "usage: zshard bench --shards ADDR[,ADDR...] [options]\n"
          "Load-tests a running cluster: pushes and pulls through libzshard, as a\n"
          "trainer makes them, with throughput and latency percentiles.\n"
          "\n"
          "  --shards LIST        shard addresses in shard-id order, or a pattern with {i}\n"
          "  --num-shards N       the number of shards, with a pattern\n"
          "  --payload BYTES      bf16 bytes per request, binary units (4K = 4096, 16M;\n"
          "                       default 4K)\n"
          "  --requests N         pushes (and as many pulls) per trainer (default 10000)\n"
          "  --tensors T          tensors in the model: one step pushes each once\n"
          "                       (default: --requests, at most 1024)\n"
          "  --concurrency C      requests in flight per trainer (default 1)\n"
          "  --trainers W         trainer threads, ranks 0..W-1 of the job (default 1)\n"
          "  --transport T        data or grpc (default: $ZSHARD_TRANSPORT, else data)\n"
          "  --connections K      data-plane connections per shard (default: the\n"
          "                       library's)\n"
          "  --job NAME           the benchmark job's name (default zshard-bench)\n"
          "  --json               one JSON object per figure:\n"
          "                       {\"bench\",\"metric\",\"value\",\"unit\",\"limit\",\"ratio\"}\n"
          "\n"
          "The shards keep one job for their lifetime: use shards without a job, or\n"
          "that an earlier `zshard bench` with the same --job, --payload, --tensors\n"
          "and --trainers set up. The job uses SGD: 10 bytes of shard memory per\n"
          "parameter, payload/2 parameters per tensor.\n");
}

/* A byte count with an optional binary suffix: 4096, 4K, 4KiB, 16M, 1G. */
static int parse_bytes(const char *s, uint64_t *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || !isfinite(v) || v <= 0)
    return -1;
  double mul = 1;
  if (*end == 'K' || *end == 'k')
    mul = 1024.0;
  else if (*end == 'M' || *end == 'm')
    mul = 1024.0 * 1024.0;
  else if (*end == 'G' || *end == 'g')
    mul = 1024.0 * 1024.0 * 1024.0;
  if (mul > 1) {
    end++;
    if (*end == 'i')
      end++;
    if (*end == 'B')
      end++;
  }
  if (*end != '\0' || v * mul >= 1e15)
    return -1;
  *out = (uint64_t)llround(v * mul);
  return 0;
}

/* ------------------------------------------------------------------ requests */

static void on_done(void *arg, int status) {
  inflight_req *r = arg;
  trainer *t = r->t;
  uint64_t now = clock_now_ns();
  pthread_mutex_lock(&t->mu);
  *r->lat = (double)(now - r->t0) / 1e9;
  if (status != ZS_OK && !t->failed) {
    t->failed = status;
    snprintf(t->err, sizeof t->err, "%s", zs_strerror(status));
  }
  if (r->slot != UINT32_MAX)
    t->free_slots[t->nfree++] = r->slot;
  t->inflight--;
  pthread_cond_signal(&t->cv);
  pthread_mutex_unlock(&t->mu);
  free(r);
}

/* Waits until fewer than `limit` requests are in flight; returns the first
 * failure so far. */
static int wait_below(trainer *t, uint32_t limit) {
  pthread_mutex_lock(&t->mu);
  while (t->inflight >= limit && t->inflight > 0)
    pthread_cond_wait(&t->cv, &t->mu);
  int failed = t->failed;
  pthread_mutex_unlock(&t->mu);
  return failed;
}

/* Submits a push (pull = 0) or a pull of tensor `tensor`; returns 0 or the
 * failure (the sentence in t->err). */
static int submit(trainer *t, int pull, uint32_t tensor) {
  const bench_cfg *cfg = t->cfg;
  int rc = wait_below(t, cfg->concurrency);
  if (rc)
    return rc;
  inflight_req *r = malloc(sizeof *r);
  if (!r) {
    pthread_mutex_lock(&t->mu);
    snprintf(t->err, sizeof t->err, "out of memory");
    pthread_mutex_unlock(&t->mu);
    return ZS_ENOMEM;
  }
  r->t = t;
  r->slot = UINT32_MAX;
  pthread_mutex_lock(&t->mu);
  if (pull) {
    r->slot = t->free_slots[--t->nfree];
    r->lat = &t->pull_lat[t->npull++];
  } else {
    r->lat = &t->push_lat[t->npush++];
  }
  t->inflight++;
  pthread_mutex_unlock(&t->mu);
  size_t nbytes = (size_t)cfg->payload;
  r->t0 = clock_now_ns();
  if (pull) {
    uint16_t *dst = t->slots + (size_t)r->slot * (nbytes / 2);
    rc = zs_pull_cb(t->c, tensor, dst, ZS_DTYPE_BF16, nbytes, on_done, r);
  } else {
    rc = zs_push_cb(t->c, tensor, 0, t->grad, ZS_DTYPE_BF16, nbytes, on_done, r);
  }
  if (rc != ZS_OK) {
    /* The callback will not run: undo what it would have done. */
    pthread_mutex_lock(&t->mu);
    snprintf(t->err, sizeof t->err, "%s", zs_last_error());
    if (r->slot != UINT32_MAX)
      t->free_slots[t->nfree++] = r->slot;
    t->inflight--;
    pthread_mutex_unlock(&t->mu);
    free(r);
  }
  return rc;
}

/* Waits for the gate; returns 1 to run, 0 to give up. */
static int wait_gate(bench_sync *sy) {
  pthread_mutex_lock(&sy->mu);
  while (sy->go == 0)
    pthread_cond_wait(&sy->cv, &sy->mu);
  int go = sy->go > 0;
  pthread_mutex_unlock(&sy->mu);
  return go;
}

static void *trainer_main(void *arg) {
  trainer *t = arg;
  const bench_cfg *cfg = t->cfg;
  if (!wait_gate(t->sync))
    return NULL;
  int rc = 0;
  /* Every phase starts together on all trainers, so that a phase's wall time
   * is the cluster's, not one trainer's. A trainer that failed goes on
   * meeting the others at every barrier, doing nothing, so that none of them
   * waits forever (they fail in turn when their step times out). */
  for (uint64_t round = 0; round < cfg->rounds; round++) {
    round_times *rt = &t->rt[round];
    pthread_barrier_wait(&t->sync->phase);
    rt->t[PH_PUSH][0] = clock_now_ns();
    for (uint32_t k = 0; k < cfg->tensors && !rc; k++)
      rc = submit(t, 0, k);
    int drained = wait_below(t, 1);
    rc = rc ? rc : drained;
    rt->t[PH_PUSH][1] = clock_now_ns();

    pthread_barrier_wait(&t->sync->phase);
    rt->t[PH_STEP][0] = clock_now_ns();
    if (!rc) {
      zs_step_result res;
      zs_step_result_init(&res);
      rc = zs_step(t->c, 1e-3, 0.0, 0.0, &res);
      if (rc) {
        pthread_mutex_lock(&t->mu);
        snprintf(t->err, sizeof t->err, "%s", zs_last_error());
        pthread_mutex_unlock(&t->mu);
      }
    }
    rt->t[PH_STEP][1] = clock_now_ns();

    pthread_barrier_wait(&t->sync->phase);
    rt->t[PH_PULL][0] = clock_now_ns();
    for (uint32_t k = 0; k < cfg->tensors && !rc; k++)
      rc = submit(t, 1, k);
    drained = wait_below(t, 1);
    rc = rc ? rc : drained;
    rt->t[PH_PULL][1] = clock_now_ns();
  }
  pthread_mutex_lock(&t->mu);
  if (rc && !t->failed)
    t->failed = rc;
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

/* ------------------------------------------------------------------ output */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Nearest-rank quantile of sorted v[0 .. n). */
static double quantile(const double *v, size_t n, double q) {
  if (n == 0)
    return 0;
  size_t rank = (size_t)ceil(q * (double)n);
  rank = rank < 1 ? 1 : rank > n ? n : rank;
  return v[rank - 1];
}

static void figure(const bench_cfg *cfg, const char *metric, double value, const char *unit) {
  if (!cfg->json)
    return;
  printf("{\"bench\":\"zshard-bench\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\","
         "\"limit\":null,\"ratio\":null,\"shards\":%" PRIu32 ",\"payload\":%" PRIu64
         ",\"concurrency\":%" PRIu32 ",\"trainers\":%" PRIu32 ",\"transport\":\"%s\"}\n",
         metric, value, unit, cfg->nshards, cfg->payload, cfg->concurrency, cfg->trainers,
         cfg->transport == ZS_TRANSPORT_GRPC ? "grpc" : "data");
}

/* Prints one operation's line: throughput over the summed phase times and
 * the latency distribution of all its requests. */
static void report_op(const bench_cfg *cfg, const char *name, double *lat, size_t n,
                      double phase_s) {
  qsort(lat, n, sizeof *lat, cmp_double);
  double bytes = (double)n * (double)cfg->payload;
  double rps = phase_s > 0 ? (double)n / phase_s : 0;
  double mibps = phase_s > 0 ? bytes / phase_s / (1024.0 * 1024.0) : 0;
  double p50 = quantile(lat, n, 0.5) * 1e3, p99 = quantile(lat, n, 0.99) * 1e3;
  double p999 = quantile(lat, n, 0.999) * 1e3, mx = n ? lat[n - 1] * 1e3 : 0;
  if (cfg->json) {
    char m[64];
    snprintf(m, sizeof m, "%s_requests_per_s", name);
    figure(cfg, m, rps, "1/s");
    snprintf(m, sizeof m, "%s_throughput", name);
    figure(cfg, m, bytes / phase_s / 1e9, "GB/s");
    snprintf(m, sizeof m, "%s_latency_p50", name);
    figure(cfg, m, p50, "ms");
    snprintf(m, sizeof m, "%s_latency_p99", name);
    figure(cfg, m, p99, "ms");
    snprintf(m, sizeof m, "%s_latency_p999", name);
    figure(cfg, m, p999, "ms");
    snprintf(m, sizeof m, "%s_latency_max", name);
    figure(cfg, m, mx, "ms");
    return;
  }
  printf("====== %s ======\n", name);
  printf("  %zu requests in %.3f s: %.0f requests/s, %.1f MiB/s (%.3f GB/s)\n", n, phase_s, rps,
         mibps, bytes / phase_s / 1e9);
  printf("  latency: p50 %.3f ms, p99 %.3f ms, p99.9 %.3f ms, max %.3f ms\n", p50, p99, p999, mx);
}

/* The wall time of phase `ph` in round r: from the earliest start to the
 * latest end over the trainers. */
static double phase_seconds(const trainer *tr, uint32_t W, uint64_t r, int ph) {
  uint64_t a = UINT64_MAX, b = 0;
  for (uint32_t w = 0; w < W; w++) {
    const round_times *rt = &tr[w].rt[r];
    a = rt->t[ph][0] < a ? rt->t[ph][0] : a;
    b = rt->t[ph][1] > b ? rt->t[ph][1] : b;
  }
  return b > a ? (double)(b - a) / 1e9 : 0;
}

static double phase_total(const trainer *tr, uint32_t W, uint64_t rounds, int ph) {
  double sum = 0;
  for (uint64_t r = 0; r < rounds; r++)
    sum += phase_seconds(tr, W, r, ph);
  return sum;
}

/* ------------------------------------------------------------------ main */

static void trainer_free(trainer *t) {
  if (t->c)
    zs_client_close(t->c);
  free(t->slots);
  free(t->free_slots);
  free(t->push_lat);
  free(t->pull_lat);
  free(t->rt);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
}

/* Creates trainer `rank`'s client and opens the job. Returns 0 or a status
 * (with the sentence printed). */
static int trainer_open(trainer *t, const bench_cfg *cfg, const float *init) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg->addresses;
  o.num_shards = cfg->nshards;
  o.rank = t->rank;
  o.world_size = cfg->trainers;
  o.job = cfg->job;
  o.transport = cfg->transport;
  o.data_connections = cfg->connections;
  int rc = zs_client_open(&o, &t->c);
  if (rc) {
    fprintf(stderr, "zshard bench: %s\n", zs_last_error());
    return rc;
  }
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  rc = zs_add_group(t->c, &g, NULL);
  uint64_t numel = cfg->payload / 2;
  for (uint32_t k = 0; k < cfg->tensors && !rc; k++) {
    char name[32];
    snprintf(name, sizeof name, "bench%" PRIu32, k);
    rc = zs_add_tensor(t->c, name, numel, 0, NULL, 0, NULL);
  }
  const float **w = NULL;
  if (!rc && t->rank == 0) {
    w = malloc(cfg->tensors * sizeof *w);
    if (!w)
      rc = ZS_ENOMEM;
    for (uint32_t k = 0; w && k < cfg->tensors; k++)
      w[k] = init;
  }
  if (!rc)
    rc = zs_open_job(t->c, w);
  free(w);
  if (rc == ZS_EHASH)
    fprintf(stderr,
            "zshard bench: %s\nThe shards hold another job. zshard bench needs shards without "
            "a job, or the job of an earlier run with the same --job, --payload, --tensors and "
            "--trainers.\n",
            zs_last_error());
  else if (rc)
    fprintf(stderr, "zshard bench: %s\n", zs_last_error());
  return rc;
}

/* Reads the command line into `cfg`. Returns -1 to go on, or the exit
 * status (0 after --help, 2 with the usage printed). */
static int bench_parse(int argc, char **argv, bench_cfg *cfg, uint32_t *num_shards) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"payload", required_argument, NULL, 'd'},
                                       {"requests", required_argument, NULL, 'r'},
                                       {"tensors", required_argument, NULL, 't'},
                                       {"concurrency", required_argument, NULL, 'c'},
                                       {"trainers", required_argument, NULL, 'w'},
                                       {"transport", required_argument, NULL, 'T'},
                                       {"connections", required_argument, NULL, 'k'},
                                       {"job", required_argument, NULL, 'J'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *shards = NULL;
  uint64_t tensors = 0;
  int c, bad = 0;
  optind = 1;
  while (!bad && (c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v = 0;
    switch (c) {
    case 's':
      shards = optarg;
      break;
    case 'd':
      bad = parse_bytes(optarg, &cfg->payload) != 0 || cfg->payload % 2 != 0;
      break;
    case 'n':
    case 'r':
    case 't':
    case 'c':
    case 'w':
    case 'k':
      bad = cli_parse_count(optarg, &v) != 0 || v == 0 || v > UINT32_MAX;
      if (c == 'n')
        *num_shards = (uint32_t)v;
      else if (c == 'r')
        cfg->requests = v;
      else if (c == 't')
        tensors = v;
      else if (c == 'c')
        cfg->concurrency = (uint32_t)v;
      else if (c == 'w')
        cfg->trainers = (uint32_t)v;
      else
        cfg->connections = (uint32_t)v;
      break;
    case 'T':
      if (strcmp(optarg, "data") == 0)
        cfg->transport = ZS_TRANSPORT_DATA;
      else if (strcmp(optarg, "grpc") == 0)
        cfg->transport = ZS_TRANSPORT_GRPC;
      else
        bad = 1;
      break;
    case 'J':
      cfg->job = optarg;
      break;
    case 'j':
      cfg->json = 1;
      break;
    case 'h':
      bench_usage(stdout);
      return 0;
    default:
      bad = 1;
    }
  }
  if (bad || !shards || optind != argc || cfg->trainers > BENCH_MAX_TRAINERS ||
      cfg->concurrency > BENCH_MAX_CONCURRENCY || tensors > BENCH_MAX_TENSORS) {
    bench_usage(stderr);
    return 2;
  }
  if (cfg->transport == ZS_TRANSPORT_DEFAULT) {
    /* The library's rule, resolved here so that the output can say which
     * transport ran. */
    const char *env = getenv("ZSHARD_TRANSPORT");
    cfg->transport = env && strcmp(env, "grpc") == 0 ? ZS_TRANSPORT_GRPC : ZS_TRANSPORT_DATA;
  }
  cfg->tensors = (uint32_t)(tensors ? tensors : (cfg->requests < 1024 ? cfg->requests : 1024));
  cfg->rounds = (cfg->requests + cfg->tensors - 1) / cfg->tensors;
  cfg->addresses = shards;
  return -1;
}

/* Sets up trainer `t` (rank already set): its locks, its buffers for `nreq`
 * requests, its client and the job. *opened counts the trainers that
 * trainer_free must release, this one included as soon as its locks exist.
 * Returns 0 or a status (with the sentence printed). */
static int trainer_prepare(trainer *t, const bench_cfg *cfg, const uint16_t *grad,
                           const float *init, size_t nreq, uint32_t *opened) {
  t->cfg = cfg;
  t->grad = grad;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  (*opened)++;
  t->slots = malloc((size_t)cfg->concurrency * (size_t)cfg->payload);
  t->free_slots = malloc(cfg->concurrency * sizeof *t->free_slots);
  t->push_lat = calloc(nreq, sizeof(double));
  t->pull_lat = calloc(nreq, sizeof(double));
  t->rt = calloc(cfg->rounds, sizeof *t->rt);
  if (!t->slots || !t->free_slots || !t->push_lat || !t->pull_lat || !t->rt) {
    fprintf(stderr, "zshard bench: out of memory\n");
    return ZS_ENOMEM;
  }
  for (uint32_t s = 0; s < cfg->concurrency; s++)
    t->free_slots[s] = s;
  t->nfree = cfg->concurrency;
  return trainer_open(t, cfg, init);
}

/* Runs every trainer on its own thread until all are done. Returns 0, or a
 * status when a thread could not start or a trainer failed (printed). */
static int trainers_run(const bench_cfg *cfg, trainer *tr) {
  bench_sync sy = {.go = 0};
  pthread_barrier_init(&sy.phase, NULL, cfg->trainers);
  pthread_mutex_init(&sy.mu, NULL);
  pthread_cond_init(&sy.cv, NULL);
  uint32_t started = 0;
  for (uint32_t w = 0; w < cfg->trainers; w++) {
    tr[w].sync = &sy;
    if (pthread_create(&tr[w].th, NULL, trainer_main, &tr[w]) != 0)
      break;
    started++;
  }
  /* The barrier counts every trainer: the threads start only once all of
   * them exist, and give up together otherwise. */
  pthread_mutex_lock(&sy.mu);
  sy.go = started == cfg->trainers ? 1 : -1;
  pthread_cond_broadcast(&sy.cv);
  pthread_mutex_unlock(&sy.mu);
  for (uint32_t w = 0; w < started; w++)
    pthread_join(tr[w].th, NULL);
  pthread_barrier_destroy(&sy.phase);
  pthread_mutex_destroy(&sy.mu);
  pthread_cond_destroy(&sy.cv);
  if (started < cfg->trainers) {
    fprintf(stderr, "zshard bench: cannot start %" PRIu32 " trainer threads\n", cfg->trainers);
    return ZS_EINTERNAL;
  }

  int rc = 0;
  for (uint32_t w = 0; w < cfg->trainers; w++) {
    if (tr[w].failed) {
      fprintf(stderr, "zshard bench: trainer %" PRIu32 " failed: %s\n", w, tr[w].err);
      rc = tr[w].failed;
    }
  }
  return rc;
}

/* Prints the push and pull latencies and throughput of all trainers
 * together, and the step times. Returns 0 or ZS_ENOMEM. */
static int bench_report(const bench_cfg *cfg, const trainer *tr, size_t nreq) {
  size_t total = nreq * cfg->trainers;
  double *lat = malloc(total * sizeof *lat);
  double *steps = malloc(cfg->rounds * sizeof *steps);
  if (!lat || !steps) {
    free(lat);
    free(steps);
    return ZS_ENOMEM;
  }
  double push_s = phase_total(tr, cfg->trainers, cfg->rounds, PH_PUSH);
  double pull_s = phase_total(tr, cfg->trainers, cfg->rounds, PH_PULL);
  for (uint32_t w = 0; w < cfg->trainers; w++)
    memcpy(lat + w * nreq, tr[w].push_lat, nreq * sizeof *lat);
  report_op(cfg, "push", lat, total, push_s);
  for (uint32_t w = 0; w < cfg->trainers; w++)
    memcpy(lat + w * nreq, tr[w].pull_lat, nreq * sizeof *lat);
  report_op(cfg, "pull", lat, total, pull_s);
  /* zs_step: gradient statistics and the optimizer on every shard. */
  for (uint64_t r = 0; r < cfg->rounds; r++)
    steps[r] = phase_seconds(tr, cfg->trainers, r, PH_STEP);
  qsort(steps, cfg->rounds, sizeof *steps, cmp_double);
  if (cfg->json) {
    figure(cfg, "step_p50", quantile(steps, cfg->rounds, 0.5) * 1e3, "ms");
    figure(cfg, "step_max", steps[cfg->rounds - 1] * 1e3, "ms");
  } else {
    printf("====== step ======\n  %" PRIu64 " steps: p50 %.3f ms, max %.3f ms\n", cfg->rounds,
           quantile(steps, cfg->rounds, 0.5) * 1e3, steps[cfg->rounds - 1] * 1e3);
  }
  free(lat);
  free(steps);
  return 0;
}

int cli_bench(int argc, char **argv) {
  bench_cfg cfg = {.payload = 4096,
                   .requests = 10000,
                   .concurrency = 1,
                   .trainers = 1,
                   .job = "zshard-bench",
                   .transport = ZS_TRANSPORT_DEFAULT};
  uint32_t num_shards = 0;
  int rc = bench_parse(argc, argv, &cfg, &num_shards);
  if (rc >= 0)
    return rc;
  if (zc_parse_addresses(cfg.addresses, num_shards, &cfg.addr, &cfg.nshards) != ZS_OK) {
    fprintf(stderr, "zshard bench: %s\n", zs_last_error());
    return 2;
  }

  size_t nbytes = (size_t)cfg.payload;
  size_t nreq = (size_t)(cfg.rounds * cfg.tensors);
  uint16_t *grad = malloc(nbytes);
  float *init = calloc(nbytes / 2, sizeof(float));
  trainer *tr = calloc(cfg.trainers, sizeof *tr);
  rc = !grad || !init || !tr ? ZS_ENOMEM : 0;
  uint32_t opened = 0;
  if (rc) {
    fprintf(stderr, "zshard bench: out of memory\n");
    goto done;
  }
  /* Small gradients and weights, so that many SGD steps change nothing
   * that matters; 0x3c00 is bf16 for 2^-7. */
  for (size_t i = 0; i < nbytes / 2; i++) {
    grad[i] = 0x3c00;
    init[i] = 0.01f;
  }
  for (uint32_t w = 0; w < cfg.trainers; w++) {
    tr[w].rank = w;
    if ((rc = trainer_prepare(&tr[w], &cfg, grad, init, nreq, &opened)) != 0)
      goto done;
  }
  char pay[32];
  if (!cfg.json)
    printf("zshard bench: %" PRIu32 " shard(s) over %s, %" PRIu32 " trainer(s), %s per request, "
           "%zu pushes and %zu pulls per trainer (%" PRIu64 " steps of %" PRIu32
           " tensors), %" PRIu32 " in flight per trainer\n",
           cfg.nshards, cfg.transport == ZS_TRANSPORT_GRPC ? "gRPC" : "the data plane",
           cfg.trainers, cli_bytes((double)cfg.payload, pay, sizeof pay), nreq, nreq, cfg.rounds,
           cfg.tensors, cfg.concurrency);
  rc = trainers_run(&cfg, tr);
  if (rc == 0)
    rc = bench_report(&cfg, tr, nreq);
done:
  for (uint32_t w = 0; w < opened; w++)
    trainer_free(&tr[w]);
  free(tr);
  free(grad);
  free(init);
  zc_free_addresses(cfg.addr, cfg.nshards);
  return rc ? 1 : 0;
}
