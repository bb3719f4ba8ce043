/*
 * bench_step — a whole training step without compute, W trainers against N
 * real zshard-server processes on loopback, against the bound set by the
 * bytes the step moves; also each shard's peak memory and the scaling of the
 * step with model size and shard count.
 *
 * A step, on each of the W trainer threads (each its own libzshard client,
 * started together): push every tensor's bf16 gradient at once and wait,
 * zs_step (gradient statistics and the AdamW apply on every shard), pull
 * every tensor's bf16 parameters at once and wait. The step time is from the
 * common start until the last trainer is done.
 *
 * The bound: the step moves W * (2Φ + 2Φ) bytes over loopback (each trainer
 * pushes 2Φ bytes of bf16 gradients and pulls 2Φ bytes of bf16 parameters;
 * the control calls are a few hundred bytes), and the fastest loopback can
 * move them is at the aggregate raw TCP bandwidth with as many concurrent
 * connections as the step uses (W * N for gRPC, W * N * data_connections for
 * the data plane), measured by a pump of the same number of bytes (at least
 * 512 MiB) right after each timed step. bound = bytes / bandwidth; the figure is step time / bound
 * (goal <= 1.3). The bound leaves out the optimizer pass, which the step must
 * also wait for: its time on the shards (Stats.apply_seconds_total) is
 * printed as a note beside.
 *
 * Memory: each shard's peak resident set (VmHWM from /proc) over the whole
 * run against 18Φ/N bytes (4 master + 4 exp_avg + 4 exp_avg_sq + 4
 * accumulator + 2 bf16 copy per parameter); goal <= 1.1 * 18Φ/N + 64 MiB.
 * Each transport runs on a cluster of its own, so the peak is also reported
 * per transport (keys peak_data_mib, peak_grpc_mib); the figure is the
 * larger.
 *
 * Scaling: for every (N, Φ) the step cost in nanoseconds per parameter,
 * against the bound's: constant across sizes means cost linear in size.
 *
 * Rounds: per transport, a fresh cluster, one untimed warm-up step (it also
 * faults in the shards' arenas), then `reps` rounds, each one timed step (a
 * round re-opens the trainers, which resume at the job's version) and its
 * pump. Figures are medians over the rounds.
 *
 * Usage: bench_step [--json] [--quick] [--reps R] [--params 64M,256M]
 *          [--shards 2] [--trainers 2] [--transports grpc,data]
 *          [--tensor 8M] [--conns C]
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"

#define MAX_REPS 100
#define MAX_TRAINERS 8
#define MAX_TRANSPORTS 2
#define MIB (1024.0 * 1024.0)
#define PUMP_MIN_BYTES (512u << 20)

static void usage(void) {
  fprintf(stderr, "usage: bench_step [--json] [--quick] [--reps R] [--params 64M,256M] "
                  "[--shards 2] [--trainers 2] [--transports grpc,data] [--tensor 8M] "
                  "[--conns C]\n");
  exit(2);
}

/* ------------------------------------------------------------ trainers */

typedef struct trainer {
  pthread_t th;
  zs_client *c;
  const bench_model *m;
  const uint16_t *grad; /* shared, read only */
  uint16_t *params;     /* this trainer's pull destination */
  pthread_barrier_t *start;
  double done_at;
  double push_s, step_s, pull_s; /* the phases as this trainer saw them */
} trainer;

static void *trainer_main(void *arg) {
  trainer *t = arg;
  pthread_barrier_wait(t->start);
  double t0 = bench_now();
  bench_push_all(t->c, t->m, 0, t->grad);
  double t1 = bench_now();
  bench_step(t->c, NULL);
  double t2 = bench_now();
  bench_pull_all(t->c, t->m, t->params);
  t->done_at = bench_now();
  t->push_s = t1 - t0;
  t->step_s = t2 - t1;
  t->pull_s = t->done_at - t2;
  return NULL;
}

typedef struct step_result {
  double seconds;
  double push_s, step_s, pull_s; /* the slowest trainer's phases */
} step_result;

/* One step by W trainers; returns its wall time. */
static step_result run_step(trainer *tr, uint32_t W) {
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, W + 1);
  for (uint32_t i = 0; i < W; i++) {
    tr[i].start = &start;
    if (pthread_create(&tr[i].th, NULL, trainer_main, &tr[i]) != 0)
      bench_die("pthread_create failed");
  }
  pthread_barrier_wait(&start);
  double t0 = bench_now();
  step_result r = {0};
  for (uint32_t i = 0; i < W; i++) {
    pthread_join(tr[i].th, NULL);
    if (tr[i].done_at - t0 > r.seconds)
      r.seconds = tr[i].done_at - t0;
    if (tr[i].push_s > r.push_s)
      r.push_s = tr[i].push_s;
    if (tr[i].step_s > r.step_s)
      r.step_s = tr[i].step_s;
    if (tr[i].pull_s > r.pull_s)
      r.pull_s = tr[i].pull_s;
  }
  pthread_barrier_destroy(&start);
  return r;
}

/* The sum of apply_seconds_total over the shards (Stats). */
static double apply_seconds(const bench_server *srv, uint32_t n) {
  double sum = 0;
  for (uint32_t i = 0; i < n; i++) {
    rpc_channel *ch = NULL;
    if (rpc_channel_open(srv[i].addr, &ch) != 0)
      continue;
    Zshard__V1__StatsRequest req = ZSHARD__V1__STATS_REQUEST__INIT;
    Zshard__V1__StatsResponse *resp = NULL;
    rpc_status st;
    if (rpc_call(ch, "/zshard.v1.ZShard/Stats", &req.base, &zshard__v1__stats_response__descriptor,
                 (ProtobufCMessage **)&resp, 10000, &st) == 0) {
      sum += resp->apply_seconds_total;
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
    rpc_channel_close(ch);
  }
  return sum;
}

static uint32_t transport_conns(int transport, uint32_t W, uint32_t N, uint32_t data_conns) {
  if (transport == ZS_TRANSPORT_DATA)
    return W * N * (data_conns ? data_conns : 1);
  return W * N;
}

/* ------------------------------------------------------------ main */

/* The command line, with its defaults applied. */
typedef struct step_args {
  bench_opts o;
  uint64_t params[BENCH_MAX_LIST], shards[BENCH_MAX_LIST];
  int nparams, nshards;
  uint64_t W, tensor, data_conns;
  int transports[MAX_TRANSPORTS];
  int ntransports;
  int reps;
} step_args;

static void parse_args(int argc, char **argv, step_args *a) {
  memset(a, 0, sizeof *a);
  bench_parse_common(&argc, argv, &a->o);
  a->nparams = a->nshards = -1;
  a->W = 2;
  a->tensor = 8u << 20;
  a->transports[0] = ZS_TRANSPORT_GRPC;
  a->transports[1] = ZS_TRANSPORT_DATA;
  a->ntransports = 2;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--params") == 0 && i + 1 < argc) {
      if ((a->nparams = bench_parse_list(argv[++i], a->params, BENCH_MAX_LIST)) < 1)
        usage();
    } else if (strcmp(argv[i], "--shards") == 0 && i + 1 < argc) {
      if ((a->nshards = bench_parse_list(argv[++i], a->shards, BENCH_MAX_LIST)) < 1)
        usage();
    } else if (strcmp(argv[i], "--trainers") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &a->W, 1) != 1 || a->W > MAX_TRAINERS)
        usage();
    } else if (strcmp(argv[i], "--tensor") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &a->tensor, 1) != 1)
        usage();
    } else if (strcmp(argv[i], "--conns") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &a->data_conns, 1) != 1 || a->data_conns > 64)
        usage();
    } else if (strcmp(argv[i], "--transports") == 0 && i + 1 < argc) {
      if ((a->ntransports = bench_transport_list(argv[++i], a->transports, MAX_TRANSPORTS)) < 0)
        usage();
    } else {
      usage();
    }
  }
  if (a->nparams < 0) {
    a->nparams = a->o.quick ? 1 : 2;
    a->params[0] = 64u << 20;
    a->params[1] = 256u << 20;
  }
  if (a->nshards < 0) {
    a->nshards = 1;
    a->shards[0] = 2;
  }
  a->reps = a->o.reps ? a->o.reps : (a->o.quick ? 2 : 3);
  if (a->reps > MAX_REPS)
    a->reps = MAX_REPS;
}

/* One model size on one shard count: the trainers, the timed rounds of each
 * transport and the shards' memory figures. */
typedef struct step_case {
  const step_args *a;
  uint32_t N;
  bench_model m;
  uint64_t phi, step_bytes;
  char pl[32]; /* the parameter count as a label, "64M" */
  float *init;
  trainer tr[MAX_TRAINERS];
  /* Per transport measured (tr_list[k]): */
  int ntr, tr_list[MAX_TRANSPORTS];
  step_result res[MAX_TRANSPORTS][MAX_REPS];
  double bound[MAX_TRANSPORTS][MAX_REPS];
  double apply_total[MAX_TRANSPORTS];
  /* The largest shard peak once the job is open and initialised, over the
   * whole life, and what stays. */
  uint64_t hwm_init[MAX_TRANSPORTS], hwm_tr[MAX_TRANSPORTS], rss_end[MAX_TRANSPORTS];
} step_case;

/* Times the rounds of one transport on a cluster of its own, so that its
 * memory figures are its own (what one transport's buffers leave in the
 * allocator would otherwise count against the other). */
static void measure_transport(step_case *sc, int transport) {
  const step_args *a = sc->a;
  uint32_t N = sc->N, W = (uint32_t)a->W;
  bench_server srv[BENCH_MAX_SERVERS];
  bench_servers_start(srv, N, 0);
  int have_data = 1;
  for (uint32_t i = 0; i < N; i++)
    have_data &= srv[i].data_port > 0;
  if (transport == ZS_TRANSPORT_DATA && !have_data) {
    bench_note("the servers advertise no data port: data plane skipped");
    bench_servers_stop(srv, N);
    return;
  }
  int k = sc->ntr++;
  sc->tr_list[k] = transport;
  char addrs[512];
  bench_server_list(srv, N, addrs, sizeof addrs);
  for (int r = 0; r <= a->reps; r++) {
    /* Rank 0 writes the initial weights on the first open only (round 0, an
     * untimed warm-up step); later opens resume at the job's version
     * (libzshard then sends none). */
    for (uint32_t w = 0; w < W; w++)
      sc->tr[w].c = bench_client_open(&sc->m, addrs, N, w, transport, (uint32_t)a->data_conns,
                                      w == 0 ? sc->init : NULL);
    double apply_before = apply_seconds(srv, N);
    if (r == 0)
      for (uint32_t i = 0; i < N; i++) {
        uint64_t h = bench_vmhwm(srv[i].pid);
        sc->hwm_init[k] = h > sc->hwm_init[k] ? h : sc->hwm_init[k];
      }
    step_result st = run_step(sc->tr, W);
    for (uint32_t w = 0; w < W; w++)
      zs_client_close(sc->tr[w].c);
    if (r == 0)
      continue;
    sc->apply_total[k] += apply_seconds(srv, N) - apply_before;
    uint32_t conns = transport_conns(transport, W, N, (uint32_t)a->data_conns);
    /* At least 512 MiB, so that start-up does not lower the bandwidth (and
     * so loosen the bound) of the small models. */
    uint64_t pump = sc->step_bytes > PUMP_MIN_BYTES ? sc->step_bytes : PUMP_MIN_BYTES;
    double bw = bench_tcp_pump(conns, (pump + conns - 1) / conns, 4u << 20);
    sc->res[k][r - 1] = st;
    sc->bound[k][r - 1] = (double)sc->step_bytes / bw;
  }
  for (uint32_t i = 0; i < N; i++) {
    uint64_t h = bench_vmhwm(srv[i].pid), rs = bench_vmrss(srv[i].pid);
    sc->hwm_tr[k] = h > sc->hwm_tr[k] ? h : sc->hwm_tr[k];
    sc->rss_end[k] = rs > sc->rss_end[k] ? rs : sc->rss_end[k];
  }
  bench_servers_stop(srv, N);
}

/* The step time of each transport against its bound, and per parameter. */
static void report_steps(const step_case *sc) {
  const step_args *a = sc->a;
  int reps = a->reps;
  uint32_t N = sc->N;
  for (int k = 0; k < sc->ntr; k++) {
    const char *tn = bench_transport_name(sc->tr_list[k]);
    double secs[MAX_REPS], push[MAX_REPS], stp[MAX_REPS], pull[MAX_REPS], bound[MAX_REPS];
    for (int r = 0; r < reps; r++) {
      secs[r] = sc->res[k][r].seconds;
      push[r] = sc->res[k][r].push_s * 1e3;
      stp[r] = sc->res[k][r].step_s * 1e3;
      pull[r] = sc->res[k][r].pull_s * 1e3;
      bound[r] = sc->bound[k][r];
    }
    double t_med = bench_quantile(secs, (size_t)reps, 0.5);
    double b_med = bench_quantile(bound, (size_t)reps, 0.5);
    /* After the sorts: the best round of each, the least disturbed by the
     * machine's other tenants. */
    double t_best = secs[0], b_best = bound[0];
    double push_ms = bench_quantile(push, (size_t)reps, 0.5);
    double step_ms = bench_quantile(stp, (size_t)reps, 0.5);
    double pull_ms = bench_quantile(pull, (size_t)reps, 0.5);
    double apply_ms = sc->apply_total[k] / reps * 1e3;
    uint32_t conns = transport_conns(sc->tr_list[k], (uint32_t)a->W, N, (uint32_t)a->data_conns);
    char metric[96];
    bench_kv kv[] = {BENCH_S("transport", tn),         BENCH_N("shards", N),
                     BENCH_N("trainers", a->W),        BENCH_N("params", sc->phi),
                     BENCH_N("bytes", sc->step_bytes), BENCH_N("conns", conns),
                     BENCH_N("push_ms", push_ms),      BENCH_N("zs_step_ms", step_ms),
                     BENCH_N("pull_ms", pull_ms),      BENCH_N("apply_ms_sum", apply_ms),
                     BENCH_N("rounds", reps),          BENCH_N("best", t_best),
                     BENCH_N("limit_best", b_best),    BENCH_N("ratio_best", t_best / b_best)};
    snprintf(metric, sizeof metric, "step_time_%s_W%" PRIu64 "_N%u_%s", tn, a->W, N, sc->pl);
    bench_report(&a->o, "step", metric, t_med, "s", b_med, kv, 14);
    snprintf(metric, sizeof metric, "ns_per_param_%s_W%" PRIu64 "_N%u_%s", tn, a->W, N, sc->pl);
    bench_report(&a->o, "scaling", metric, t_med / (double)sc->phi * 1e9, "ns/param",
                 b_med / (double)sc->phi * 1e9, kv, 6);
    bench_note("  %s: step %.3f s (slowest trainer: push %.0f ms, zs_step %.0f ms, pull %.0f "
               "ms); optimizer pass %.0f ms per step (summed over the shards); bound %.3f s",
               tn, t_med, push_ms, step_ms, pull_ms, apply_ms, b_med);
  }
}

/* The shards' peak RSS against the 18Φ/N their state needs. */
static void report_memory(const step_case *sc) {
  uint32_t N = sc->N;
  uint64_t hwm = 0, hwm_open = 0, rss = 0;
  for (int k = 0; k < sc->ntr; k++) {
    hwm = sc->hwm_tr[k] > hwm ? sc->hwm_tr[k] : hwm;
    hwm_open = sc->hwm_init[k] > hwm_open ? sc->hwm_init[k] : hwm_open;
    rss = sc->rss_end[k] > rss ? sc->rss_end[k] : rss;
  }
  double need = 18.0 * (double)sc->phi / N;
  char metric[96];
  snprintf(metric, sizeof metric, "shard_peak_rss_N%u_%s", N, sc->pl);
  bench_kv kv[2 + 3 + MAX_TRANSPORTS] = {BENCH_N("shards", N), BENCH_N("params", sc->phi),
                                         BENCH_N("goal_mib", (1.1 * need + 64 * MIB) / MIB),
                                         BENCH_N("peak_after_open_mib", (double)hwm_open / MIB),
                                         BENCH_N("rss_at_end_mib", (double)rss / MIB)};
  size_t nkv = 5;
  char keys[MAX_TRANSPORTS][32];
  for (int k = 0; k < sc->ntr; k++) {
    snprintf(keys[k], sizeof keys[k], "peak_%s_mib", bench_transport_name(sc->tr_list[k]));
    kv[nkv++] = BENCH_N(keys[k], (double)sc->hwm_tr[k] / MIB);
    bench_note("  shard peak RSS over the %s rounds: %.0f MiB (goal %s)",
               bench_transport_name(sc->tr_list[k]), (double)sc->hwm_tr[k] / MIB,
               (double)sc->hwm_tr[k] <= 1.1 * need + 64 * MIB ? "met" : "missed");
  }
  bench_report(&sc->a->o, "memory", metric, (double)hwm / MIB, "MiB", need / MIB, kv, nkv);
  bench_note("  shard peak RSS %.0f MiB (%.0f MiB once the job was open and initialised, "
             "%.0f MiB resident at the end) vs 18Φ/N = %.0f MiB: goal <= %.0f MiB (%s)",
             (double)hwm / MIB, (double)hwm_open / MIB, (double)rss / MIB, need / MIB,
             (1.1 * need + 64 * MIB) / MIB,
             (double)hwm <= 1.1 * need + 64 * MIB ? "met" : "missed");
}

static void run_case(const step_args *a, uint32_t N, uint64_t params) {
  static step_case sc; /* large: the rounds of every transport */
  memset(&sc, 0, sizeof sc);
  sc.a = a;
  sc.N = N;
  sc.m = (bench_model){.job = "bench-step",
                       .numel = a->tensor,
                       .optimizer = ZS_OPTIM_ADAMW,
                       .world_size = (uint32_t)a->W,
                       .grad_accum = 1};
  sc.m.ntensors = (uint32_t)((params + a->tensor - 1) / a->tensor);
  sc.phi = (uint64_t)sc.m.ntensors * sc.m.numel;
  sc.step_bytes = a->W * 4u * sc.phi;
  snprintf(sc.pl, sizeof sc.pl, "%" PRIu64 "M", sc.phi >> 20);
  bench_note("step: W=%" PRIu64 " trainers, N=%u shards, %s parameters in %u tensors, %.0f "
             "MiB over loopback per step",
             a->W, N, sc.pl, sc.m.ntensors, (double)sc.step_bytes / MIB);

  sc.init = bench_alloc((size_t)sc.m.numel * sizeof(float));
  bench_fill_f32(sc.init, (size_t)sc.m.numel, 0.1f, 3);
  uint16_t *grad = bench_alloc((size_t)sc.m.numel * sizeof(uint16_t));
  bench_fill_bf16(grad, (size_t)sc.m.numel, 5);
  for (uint32_t w = 0; w < a->W; w++) {
    sc.tr[w].m = &sc.m;
    sc.tr[w].grad = grad;
    sc.tr[w].params = bench_alloc((size_t)sc.phi * sizeof(uint16_t));
  }
  for (int t = 0; t < a->ntransports; t++)
    measure_transport(&sc, a->transports[t]);
  free(sc.init);
  free(grad);
  for (uint32_t w = 0; w < a->W; w++)
    free(sc.tr[w].params);
  report_steps(&sc);
  report_memory(&sc);
}

int main(int argc, char **argv) {
  static step_args a;
  parse_args(argc, argv, &a);
  for (int si = 0; si < a.nshards; si++) {
    uint32_t N = (uint32_t)a.shards[si];
    if (N < 1 || N > BENCH_MAX_SERVERS)
      bench_die("--shards: 1 to %d", BENCH_MAX_SERVERS);
    for (int pi = 0; pi < a.nparams; pi++)
      run_case(&a, N, a.params[pi]);
  }
  return 0;
}
