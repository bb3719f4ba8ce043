/*
 * bench_transfer — push and pull throughput through libzshard against real
 * zshard-server processes on loopback, for both transports, against raw TCP
 * measured in the same run.
 *
 * For each shard count N and size S (bytes of bf16 on the wire): N servers
 * hold a model of S/2 parameters in tensors of --tensor bytes (16 MiB by
 * default, split over the N shards), with plain SGD (no momentum), so that a
 * shard holds 10 bytes per parameter and the largest case fits in memory. One
 * trainer per transport (rank 0: gRPC, rank 1: data plane, W = 2) pushes
 * every tensor at once and waits (the push phase), both call zs_step
 * (untimed), and each pulls every tensor at once (the pull phase). Every
 * round runs both transports' push phases, alternating which goes first, then
 * the step, then both pull phases. Right before each phase runs a raw TCP
 * pump of S bytes (at least 256 MiB; 4 MiB per write) over as many concurrent
 * connections as the transport uses (gRPC: one per shard; data plane:
 * data_connections per shard): that phase's limit for the round, so that both
 * sides of a ratio see the same moment of this shared machine. Figures are
 * medians over the rounds (after one warm-up round).
 *
 * Usage: bench_transfer [--json] [--quick] [--reps R] [--sizes 64M,256M,1G]
 *          [--shards 1,2,4] [--transports grpc,data] [--tensor 16M]
 *          [--conns C]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define MAX_REPS 100
#define MAX_TRANSPORTS 2
#define PUMP_MIN_BYTES (256u << 20)
#define PUMP_WRITE (4u << 20) /* bytes per write() of the raw pump */

static void usage(void) {
  fprintf(stderr, "usage: bench_transfer [--json] [--quick] [--reps R] [--sizes 64M,256M,1G] "
                  "[--shards 1,2,4] [--transports grpc,data] [--tensor 16M] [--conns C]\n");
  exit(2);
}

/* Connections a transport opens from one trainer to N shards. */
static uint32_t transport_conns(int transport, uint32_t nshards, uint32_t data_conns) {
  if (transport == ZS_TRANSPORT_DATA)
    return nshards * (data_conns ? data_conns : 1);
  return nshards; /* one HTTP/2 connection per channel */
}

/* A raw TCP pump with as many connections as `transport` uses, of `wire`
 * bytes but at least PUMP_MIN_BYTES, so that connection start-up and TCP's
 * ramp-up do not lower the limit of the small sizes. Bytes per second. */
/* Reports one phase: the median over the rounds against the median of the
 * pumps that ran right before it, and, as extra keys, the best round of each
 * (the one least disturbed by the machine's other tenants). secs (phase
 * times) and tcp (pump bandwidths) are sorted in place. */
static void report_phase(const bench_opts *o, const char *metric, const char *transport,
                         const char *op, uint32_t nshards, uint64_t wire, uint32_t conns,
                         uint64_t tensor_bytes, double *secs, double *tcp, int reps) {
  double rate = (double)wire / bench_quantile(secs, (size_t)reps, 0.5) / 1e9;
  double limit = bench_quantile(tcp, (size_t)reps, 0.5) / 1e9;
  double best = (double)wire / secs[0] / 1e9, limit_best = tcp[reps - 1] / 1e9;
  bench_kv kv[] = {BENCH_S("transport", transport),   BENCH_S("op", op),
                   BENCH_N("shards", nshards),        BENCH_N("bytes", wire),
                   BENCH_N("conns", conns),           BENCH_N("tensor_bytes", tensor_bytes),
                   BENCH_N("rounds", reps),           BENCH_N("best", best),
                   BENCH_N("limit_best", limit_best), BENCH_N("ratio_best", best / limit_best)};
  bench_report(o, "transfer", metric, rate, "GB/s", limit, kv, 10);
}

static double pump(int transport, uint32_t nshards, uint32_t data_conns, uint64_t wire) {
  uint32_t conns = transport_conns(transport, nshards, data_conns);
  uint64_t bytes = wire > PUMP_MIN_BYTES ? wire : PUMP_MIN_BYTES;
  return bench_tcp_pump(conns, (bytes + conns - 1) / conns, PUMP_WRITE);
}

/* The command line, with its defaults applied. */
typedef struct transfer_args {
  bench_opts o;
  uint64_t sizes[BENCH_MAX_LIST], shards[BENCH_MAX_LIST];
  int nsizes, nshards;
  uint64_t tensor_bytes, data_conns;
  int transports[MAX_TRANSPORTS];
  int ntransports;
  int reps;
} transfer_args;

static void parse_args(int argc, char **argv, transfer_args *a) {
  memset(a, 0, sizeof *a);
  bench_parse_common(&argc, argv, &a->o);
  a->nsizes = a->nshards = -1;
  a->tensor_bytes = 16u << 20;
  a->transports[0] = ZS_TRANSPORT_GRPC;
  a->transports[1] = ZS_TRANSPORT_DATA;
  a->ntransports = 2;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
      if ((a->nsizes = bench_parse_list(argv[++i], a->sizes, BENCH_MAX_LIST)) < 1)
        usage();
    } else if (strcmp(argv[i], "--shards") == 0 && i + 1 < argc) {
      if ((a->nshards = bench_parse_list(argv[++i], a->shards, BENCH_MAX_LIST)) < 1)
        usage();
    } else if (strcmp(argv[i], "--tensor") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &a->tensor_bytes, 1) != 1 || a->tensor_bytes % 2)
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
  if (a->nsizes < 0) {
    a->nsizes = a->o.quick ? 2 : 3;
    a->sizes[0] = 64u << 20;
    a->sizes[1] = 256u << 20;
    a->sizes[2] = 1u << 30;
  }
  if (a->nshards < 0) {
    a->nshards = a->o.quick ? 2 : 3;
    a->shards[0] = 1;
    a->shards[1] = 2;
    a->shards[2] = 4;
  }
  a->reps = a->o.reps ? a->o.reps : (a->o.quick ? 2 : 3);
  if (a->reps > MAX_REPS)
    a->reps = MAX_REPS;
}

/* One size on one shard count: the model, the transports measured and, per
 * transport and round, the phase times and the raw pumps run right before
 * each phase (that phase's limit for the round). */
typedef struct transfer_case {
  const transfer_args *a;
  uint32_t N;
  bench_model m;
  uint64_t wire; /* S rounded up to whole tensors */
  char label[32];
  int tr[MAX_TRANSPORTS], ntr;
  double push_s[MAX_TRANSPORTS][MAX_REPS], pull_s[MAX_TRANSPORTS][MAX_REPS];
  double push_tcp[MAX_TRANSPORTS][MAX_REPS], pull_tcp[MAX_TRANSPORTS][MAX_REPS];
} transfer_case;

/* The rounds: both transports' push phases (alternating which goes first),
 * the step, then both pull phases; round 0 is the warm-up. */
static void run_rounds(transfer_case *tc, zs_client *cl[2], const uint16_t *grad, uint16_t *dst) {
  uint32_t N = tc->N, dc = (uint32_t)tc->a->data_conns;
  for (int r = 0; r <= tc->a->reps; r++) {
    for (int j = 0; j < 2; j++) {
      int k = (r + j) % 2;
      double bw = k < tc->ntr ? pump(tc->tr[k], N, dc, tc->wire) : 0;
      double t0 = bench_now();
      bench_push_all(cl[k], &tc->m, 0, grad);
      if (r > 0 && k < tc->ntr) {
        tc->push_s[k][r - 1] = bench_now() - t0;
        tc->push_tcp[k][r - 1] = bw;
      }
    }
    bench_step(cl[0], NULL);
    bench_step(cl[1], NULL);
    for (int j = 0; j < 2; j++) {
      int k = (r + j) % 2;
      if (k >= tc->ntr)
        continue;
      double bw = pump(tc->tr[k], N, dc, tc->wire);
      double t0 = bench_now();
      bench_pull_all(cl[k], &tc->m, dst);
      if (r > 0) {
        tc->pull_s[k][r - 1] = bench_now() - t0;
        tc->pull_tcp[k][r - 1] = bw;
      }
    }
  }
}

/* Each transport's push and pull against its pumps, and the raw TCP figure
 * once per connection count. */
static void report_case(transfer_case *tc) {
  const transfer_args *a = tc->a;
  uint32_t N = tc->N;
  int reps = a->reps;
  for (int k = 0; k < tc->ntr; k++) {
    const char *tn = bench_transport_name(tc->tr[k]);
    uint32_t conns = transport_conns(tc->tr[k], N, (uint32_t)a->data_conns);
    char metric[96];
    snprintf(metric, sizeof metric, "push_%s_N%u_%s", tn, N, tc->label);
    report_phase(&a->o, metric, tn, "push", N, tc->wire, conns, a->tensor_bytes, tc->push_s[k],
                 tc->push_tcp[k], reps);
    snprintf(metric, sizeof metric, "pull_%s_N%u_%s", tn, N, tc->label);
    report_phase(&a->o, metric, tn, "pull", N, tc->wire, conns, a->tensor_bytes, tc->pull_s[k],
                 tc->pull_tcp[k], reps);
    bench_kv kv[] = {BENCH_S("transport", "tcp"), BENCH_S("op", "pump"),
                     BENCH_N("shards", N),        BENCH_N("bytes", tc->wire),
                     BENCH_N("conns", conns),     BENCH_N("tensor_bytes", a->tensor_bytes)};
    /* Both transports may use the same number of connections: one raw figure
     * per count. */
    int seen = 0;
    for (int e = 0; e < k; e++)
      seen |= transport_conns(tc->tr[e], N, (uint32_t)a->data_conns) == conns;
    if (seen)
      continue;
    double all[2 * MAX_REPS];
    memcpy(all, tc->push_tcp[k], (size_t)reps * sizeof(double));
    memcpy(all + reps, tc->pull_tcp[k], (size_t)reps * sizeof(double));
    snprintf(metric, sizeof metric, "raw_tcp_%uconn_%s", conns, tc->label);
    bench_report(&a->o, "transfer", metric, bench_quantile(all, 2 * (size_t)reps, 0.5) / 1e9,
                 "GB/s", 0, kv, 6);
  }
}

static void run_case(const transfer_args *a, uint32_t N, uint64_t S) {
  static transfer_case tc; /* large: every round's figures */
  memset(&tc, 0, sizeof tc);
  tc.a = a;
  tc.N = N;
  tc.m = (bench_model){.job = "bench-transfer",
                       .numel = a->tensor_bytes / 2,
                       .optimizer = ZS_OPTIM_SGD,
                       .world_size = 2,
                       .grad_accum = 1};
  tc.m.ntensors = (uint32_t)((S + a->tensor_bytes - 1) / a->tensor_bytes);
  tc.wire = (uint64_t)tc.m.ntensors * tc.m.numel * 2;
  char sz[32];
  bench_bytes_str((double)tc.wire, sz, sizeof sz);
  bench_label(sz, tc.label, sizeof tc.label);
  bench_note("transfer: %u shard(s), %s of bf16 in %u tensors", N, sz, tc.m.ntensors);

  bench_server srv[BENCH_MAX_SERVERS];
  bench_servers_start(srv, N, 0);
  char addrs[512];
  bench_server_list(srv, N, addrs, sizeof addrs);
  /* The data plane is measured only when every server offers it; the library
   * would otherwise quietly use gRPC for the others. */
  int have_data = 1;
  for (uint32_t i = 0; i < N; i++)
    have_data &= srv[i].data_port > 0;
  tc.tr[0] = tc.tr[1] = ZS_TRANSPORT_GRPC;
  for (int k = 0; k < a->ntransports; k++) {
    if (a->transports[k] == ZS_TRANSPORT_DATA && !have_data) {
      bench_note("the servers advertise no data port: data plane skipped");
      continue;
    }
    tc.tr[tc.ntr++] = a->transports[k];
  }
  if (tc.ntr == 0) {
    bench_servers_stop(srv, N);
    return;
  }
  float *init = bench_alloc((size_t)tc.m.numel * sizeof(float));
  bench_fill_f32(init, (size_t)tc.m.numel, 0.1f, 3);
  uint16_t *grad = bench_alloc((size_t)tc.m.numel * sizeof(uint16_t));
  bench_fill_bf16(grad, (size_t)tc.m.numel, 5);
  /* The pulls of one transport finish before the other's start, so they
   * share the destination. */
  uint16_t *dst = bench_alloc((size_t)tc.wire);

  /* Rank r of the job is transport tr[r]; with one transport, rank 1 pushes
   * over it too (untimed) so that steps complete. */
  zs_client *cl[2];
  int rank_tr[2] = {tc.tr[0], tc.ntr > 1 ? tc.tr[1] : tc.tr[0]};
  double t_open = bench_now();
  cl[0] = bench_client_open(&tc.m, addrs, N, 0, rank_tr[0], (uint32_t)a->data_conns, init);
  cl[1] = bench_client_open(&tc.m, addrs, N, 1, rank_tr[1], (uint32_t)a->data_conns, NULL);
  free(init);
  bench_note("open and initial weights (fp32, over gRPC): %.2f s", bench_now() - t_open);
  run_rounds(&tc, cl, grad, dst);
  zs_client_close(cl[0]);
  zs_client_close(cl[1]);
  bench_servers_stop(srv, N);
  free(grad);
  free(dst);
  report_case(&tc);
}

int main(int argc, char **argv) {
  static transfer_args a;
  parse_args(argc, argv, &a);
  for (int si = 0; si < a.nshards; si++) {
    uint32_t N = (uint32_t)a.shards[si];
    if (N < 1 || N > BENCH_MAX_SERVERS)
      bench_die("--shards: 1 to %d", BENCH_MAX_SERVERS);
    for (int zi = 0; zi < a.nsizes; zi++)
      run_case(&a, N, a.sizes[zi]);
  }
  return 0;
}
