/*
 * bench_cpu — CPU seconds per GiB moved, on the client and on the shard, for
 * each transport, beside those of a raw TCP pump moving the same bytes in the
 * same rounds (issue 11, on loopback).
 *
 * For each transport (grpc, data: the data plane over plain TCP, data_tls:
 * the data plane over TLS 1.3, grpc_tls on request) one zshard-server (TLS:
 * with a certificate made by the openssl tool for this run) holds a model of
 * --size bytes of bf16 in tensors of 16 MiB (plain SGD); one trainer (W = 1)
 * pushes every tensor at once and waits (the push phase), steps (untimed) and
 * pulls every tensor at once (the pull phase). Around each phase it reads the
 * CPU time of this process (/proc/self/stat: every client thread, the loop
 * threads and the pool's) and of the server (/proc/PID/stat), utime + stime.
 * Each round then runs a raw TCP pump of the same bytes over one connection
 * (bench_tcp_pump: sender threads here, the reader a child process whose CPU
 * getrusage(RUSAGE_CHILDREN) returns once it is reaped). Figures are the CPU
 * seconds summed over the rounds (after a warm-up round) divided by the GiB
 * moved, so that the 10 ms ticks of /proc add up over several phases; the
 * limit of each is the pump's end that does the same job (the sender for the
 * pushing client and the pulled shard, the reader for the others).
 *
 * What the shard's figure holds beyond moving bytes: on push, adding each
 * gradient into its fp32 accumulator and the CRC32C check; on pull, the CRC
 * was computed by the optimizer pass, outside the window.
 *
 * Usage: bench_cpu [--json] [--quick] [--reps R] [--size 512M]
 *          [--transports grpc,data,data_tls,grpc_tls]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench.h"
#include "tests/unit/tls_certs.h"

#define TENSOR_BYTES (16u << 20)
#define PUMP_WRITE (4u << 20)
#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_CASES 4

typedef struct cpu_case {
  const char *name;
  int transport;
  int tls;
} cpu_case;

static const cpu_case all_cases[MAX_CASES] = {{"grpc", ZS_TRANSPORT_GRPC, 0},
                                              {"data", ZS_TRANSPORT_DATA, 0},
                                              {"data_tls", ZS_TRANSPORT_DATA, 1},
                                              {"grpc_tls", ZS_TRANSPORT_GRPC, 1}};

/* CPU seconds, summed over the measured rounds. */
typedef struct cpu_totals {
  double push_client, push_shard, pull_client, pull_shard; /* the transport */
  double push_wall, pull_wall;
  double pump_send, pump_recv, pump_wall; /* the raw pump */
  double bytes;                           /* moved each way */
} cpu_totals;

static void usage(void) {
  fprintf(stderr, "usage: bench_cpu [--json] [--quick] [--reps R] [--size 512M] "
                  "[--transports grpc,data,data_tls,grpc_tls]\n");
  exit(2);
}

/* utime + stime of a process (0: this one) from /proc, in seconds. */
static double proc_cpu(pid_t pid) {
  char path[64], buf[1024];
  if (pid)
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  else
    snprintf(path, sizeof path, "/proc/self/stat");
  FILE *f = fopen(path, "r");
  if (!f)
    bench_die("cannot read %s", path);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  /* The fields after the command name, which may hold spaces: state is
   * field 3, utime 14 and stime 15. */
  const char *p = strrchr(buf, ')');
  unsigned long long ut = 0, st = 0;
  if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
    bench_die("cannot parse %s", path);
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double children_cpu(void) {
  struct rusage ru;
  getrusage(RUSAGE_CHILDREN, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* One phase (push or pull) with the CPU of both ends around it. */
typedef struct cpu_window {
  double wall, client, shard;
} cpu_window;

static cpu_window window_start(pid_t server) {
  return (cpu_window){bench_now(), proc_cpu(0), proc_cpu(server)};
}

static void window_add(const cpu_window *w, pid_t server, double *wall, double *client,
                       double *shard) {
  *wall += bench_now() - w->wall;
  *client += proc_cpu(0) - w->client;
  *shard += proc_cpu(server) - w->shard;
}

/* The raw pump of this round: `bytes` over one connection. */
static void pump_round(uint64_t bytes, cpu_totals *t) {
  double c0 = proc_cpu(0), k0 = children_cpu(), w0 = bench_now();
  bench_tcp_pump(1, bytes, PUMP_WRITE);
  t->pump_wall += bench_now() - w0;
  t->pump_send += proc_cpu(0) - c0;
  t->pump_recv += children_cpu() - k0;
}

static void run_rounds(zs_client *c, const bench_model *m, pid_t server, int reps, uint64_t wire,
                       const uint16_t *grad, uint16_t *dst, cpu_totals *t) {
  for (int r = 0; r <= reps; r++) {
    cpu_totals scratch = {0}, *into = r > 0 ? t : &scratch;
    cpu_window w = window_start(server);
    bench_push_all(c, m, 0, grad);
    window_add(&w, server, &into->push_wall, &into->push_client, &into->push_shard);
    bench_step(c, NULL);
    w = window_start(server);
    bench_pull_all(c, m, dst);
    window_add(&w, server, &into->pull_wall, &into->pull_client, &into->pull_shard);
    pump_round(wire, into);
    into->bytes += (double)wire;
  }
}

/* Reports one end of one phase against the pump's end doing the same job. */
static void report(const bench_opts *o, const char *metric, const char *transport, const char *op,
                   const char *end, double cpu, double limit, double wall, const cpu_totals *t,
                   int reps) {
  bench_kv kv[] = {BENCH_S("transport", transport),
                   BENCH_S("op", op),
                   BENCH_S("end", end),
                   BENCH_N("bytes", t->bytes),
                   BENCH_N("rounds", reps),
                   BENCH_N("cpu_s", cpu),
                   BENCH_N("rate_gbs", t->bytes / wall / 1e9),
                   BENCH_N("pump_rate_gbs", t->bytes / t->pump_wall / 1e9)};
  bench_report(o, "cpu", metric, cpu / (t->bytes / GIB), "CPU s/GiB", limit / (t->bytes / GIB), kv,
               8);
}

static void report_case(const bench_opts *o, const char *name, const cpu_totals *t, int reps) {
  char metric[64];
  snprintf(metric, sizeof metric, "cpu_push_client_%s", name);
  report(o, metric, name, "push", "client", t->push_client, t->pump_send, t->push_wall, t, reps);
  snprintf(metric, sizeof metric, "cpu_push_shard_%s", name);
  report(o, metric, name, "push", "shard", t->push_shard, t->pump_recv, t->push_wall, t, reps);
  snprintf(metric, sizeof metric, "cpu_pull_client_%s", name);
  report(o, metric, name, "pull", "client", t->pull_client, t->pump_recv, t->pull_wall, t, reps);
  snprintf(metric, sizeof metric, "cpu_pull_shard_%s", name);
  report(o, metric, name, "pull", "shard", t->pull_shard, t->pump_send, t->pull_wall, t, reps);
  bench_kv kv[] = {BENCH_S("transport", "tcp"), BENCH_N("bytes", t->bytes),
                   BENCH_N("rate_gbs", t->bytes / t->pump_wall / 1e9)};
  snprintf(metric, sizeof metric, "cpu_pump_send_%s", name);
  bench_report(o, "cpu", metric, t->pump_send / (t->bytes / GIB), "CPU s/GiB", 0, kv, 3);
  snprintf(metric, sizeof metric, "cpu_pump_recv_%s", name);
  bench_report(o, "cpu", metric, t->pump_recv / (t->bytes / GIB), "CPU s/GiB", 0, kv, 3);
}

static void run_case(const bench_opts *o, const cpu_case *cc, uint64_t size, int reps,
                     const tls_certs *certs) {
  bench_model m = {.job = "bench-cpu",
                   .numel = TENSOR_BYTES / 2,
                   .optimizer = ZS_OPTIM_SGD,
                   .world_size = 1,
                   .grad_accum = 1};
  m.ntensors = (uint32_t)((size + TENSOR_BYTES - 1) / TENSOR_BYTES);
  uint64_t wire = (uint64_t)m.ntensors * m.numel * 2;
  bench_note("cpu: %s, %u tensors of 16 MiB each way, %d rounds", cc->name, m.ntensors, reps);
  bench_servers_tls(cc->tls ? certs->server_crt : NULL, certs->server_key, certs->ca);
  bench_server srv;
  bench_servers_start(&srv, 1, 0);
  if (cc->transport == ZS_TRANSPORT_DATA && srv.data_port <= 0)
    bench_die("the server advertises no data port");
  if (cc->tls)
    setenv("ZSHARD_TLS_CA", certs->ca, 1);
  float *init = bench_alloc((size_t)m.numel * sizeof(float));
  bench_fill_f32(init, (size_t)m.numel, 0.1f, 3);
  uint16_t *grad = bench_alloc((size_t)m.numel * sizeof(uint16_t));
  bench_fill_bf16(grad, (size_t)m.numel, 5);
  uint16_t *dst = bench_alloc((size_t)wire);
  zs_client *c = bench_client_open(&m, srv.addr, 1, 0, cc->transport, 0, init);
  unsetenv("ZSHARD_TLS_CA");
  free(init);
  cpu_totals t = {0};
  run_rounds(c, &m, srv.pid, reps, wire, grad, dst, &t);
  zs_client_close(c);
  bench_servers_stop(&srv, 1);
  bench_servers_tls(NULL, NULL, NULL);
  free(grad);
  free(dst);
  report_case(o, cc->name, &t, reps);
}

/* The --transports list into cases; returns their count. */
static int parse_cases(char *list, const cpu_case **out) {
  int n = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    int found = 0;
    for (int i = 0; i < MAX_CASES && n < MAX_CASES; i++)
      if (strcmp(tok, all_cases[i].name) == 0) {
        out[n++] = &all_cases[i];
        found = 1;
      }
    if (!found)
      usage();
  }
  return n;
}

/* The certificates, removed at exit, bench_die's included. */
static tls_certs g_certs;

static void remove_certs(void) {
  tls_certs_remove(&g_certs);
}

int main(int argc, char **argv) {
  bench_opts o;
  bench_parse_common(&argc, argv, &o);
  uint64_t size = o.quick ? (256u << 20) : (512u << 20);
  const cpu_case *cases[MAX_CASES] = {&all_cases[0], &all_cases[1], &all_cases[2]};
  int ncases = 3;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &size, 1) != 1 || size < TENSOR_BYTES)
        usage();
    } else if (strcmp(argv[i], "--transports") == 0 && i + 1 < argc) {
      if ((ncases = parse_cases(argv[++i], cases)) < 1)
        usage();
    } else {
      usage();
    }
  }
  int reps = o.reps ? o.reps : (o.quick ? 2 : 4);
  if (tls_certs_make(&g_certs) != 0)
    bench_die("cannot make the certificates with openssl");
  atexit(remove_certs);
  for (int i = 0; i < ncases; i++)
    run_case(&o, cases[i], size, reps, &g_certs);
  return 0;
}
