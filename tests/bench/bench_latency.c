/*
 * bench_latency — round trips of 4 KiB pushes and pulls against one real
 * zshard-server on loopback, for both transports, through libzshard (what a
 * trainer sees) and through the bare transport clients (rpc_call for gRPC,
 * dp_client for the data plane), against a raw TCP ping-pong in the same run.
 *
 * The job has one tensor of 2048 parameters (4 KiB of bf16, below the split
 * threshold, so one piece on one shard) and M = samples micro-batches, so that
 * every push of a step is a new contribution that the shard adds. Each pushing
 * contender is a rank of the job: libzshard over gRPC, libzshard over the data
 * plane, dp_client, rpc_call; one more dp_client talks to a shard core and
 * dp_server of its own inside this process (its own job), which shows what
 * the protocol and the core cost without a second process. Each sample runs
 * one synchronous push of every
 * contender and one raw round trip (4 KiB + an 8-byte header out, 64 bytes
 * back) over a kept-open TCP connection with TCP_NODELAY to a forked peer, in
 * an order that rotates, so all of them see the same moments of this shared
 * machine. After the step, the pulls run the same way (the raw round trip is
 * then 64 bytes out, 4 KiB back). The first tenth of the samples warm up and
 * are not counted.
 *
 * Then, for each contender alone, a few hundred more round trips back to
 * back count the context switches per round trip of every thread at both
 * ends (voluntary ones, /proc/PID/task/ * /status): each is a thread that slept and was
 * woken, which is where a round trip's time goes beyond the wire on a
 * machine whose cores are shared. The ping-pong's is the limit: one wake-up
 * at each end.
 *
 * Usage: bench_latency [--json] [--quick] [--samples K] [--bytes B]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/model/spec.h"
#include "common/net/dp_client.h"
#include "common/net/rpc_client.h"
#include "server/core/core.h"
#include "server/transport/dp/dp_server.h"
#include "zshard/v1/zshard.pb-c.h"

#define SMALL_BYTES 64u
#define CALL_TIMEOUT_MS 30000u
#define MAX_CONTENDERS 6

/* K_INPROC: dp_client to a dp_server and shard core of its own, in this
 * process (its own one-shard job), so that the server's loop thread and the
 * client's share one process, as the raw ping-pong's two ends do not: what
 * the protocol and the core cost without a second process to wake up. */
typedef enum kind { K_LIB, K_DPC, K_RPC, K_INPROC, K_RAW } kind;

typedef struct contender {
  kind k;
  const char *name; /* in the metric: push_<name>_p50 */
  const char *transport;
  uint32_t rank;
  zs_client *lib;
  dp_client *dpc;
  rpc_channel *rpc;
  /* K_INPROC: the in-process shard, its server and its job's hash. */
  core *core;
  dp_server *srv;
  uint64_t hash;
  double *t; /* samples */
} contender;

typedef struct ctx {
  uint64_t hash;
  size_t bytes;
  uint16_t *buf;
  bench_pingpong *pp;
} ctx;

static void usage(void) {
  fprintf(stderr, "usage: bench_latency [--json] [--quick] [--samples K] [--bytes B]\n");
  exit(2);
}

/* One synchronous push of micro-batch `micro`; returns its seconds. */
static double push_once(const ctx *x, contender *c, uint32_t micro) {
  char err[600] = "";
  double t0 = bench_now();
  int rc = 0;
  switch (c->k) {
  case K_LIB:
    rc = zs_push(c->lib, 0, micro, x->buf, ZS_DTYPE_BF16, x->bytes, NULL);
    if (rc)
      snprintf(err, sizeof err, "%s", zs_last_error());
    break;
  case K_DPC:
  case K_INPROC: {
    dp_push_args a = {.spec_hash = c->k == K_INPROC ? c->hash : x->hash,
                      .step = 1,
                      .rank = c->k == K_INPROC ? 0 : c->rank,
                      .micro = micro,
                      .dtype = ZS_DTYPE_BF16,
                      .data = x->buf,
                      .nbytes = x->bytes};
    int dup = 0;
    rc = dp_client_push_sync(c->dpc, &a, &dup, err, sizeof err);
    break;
  }
  case K_RPC: {
    Zshard__V1__PushRequest req = ZSHARD__V1__PUSH_REQUEST__INIT;
    req.spec_hash = x->hash;
    req.step = 1;
    req.rank = c->rank;
    req.micro = micro;
    req.dtype = ZSHARD__V1__DTYPE__DTYPE_BF16;
    req.data.data = (uint8_t *)x->buf;
    req.data.len = x->bytes;
    Zshard__V1__PushResponse *resp = NULL;
    rpc_status st;
    rc = rpc_call(c->rpc, "/zshard.v1.ZShard/Push", &req.base,
                  &zshard__v1__push_response__descriptor, (ProtobufCMessage **)&resp,
                  CALL_TIMEOUT_MS, &st);
    if (rc)
      snprintf(err, sizeof err, "%s", st.message);
    else
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    break;
  }
  case K_RAW:
    return bench_pingpong_once(x->pp, x->bytes, SMALL_BYTES);
  }
  if (rc)
    bench_die("push (%s): %s", c->name, err);
  return bench_now() - t0;
}

/* One synchronous pull of version 1; returns its seconds. */
static double pull_once(const ctx *x, contender *c) {
  char err[600] = "";
  double t0 = bench_now();
  int rc = 0;
  switch (c->k) {
  case K_LIB:
    rc = zs_pull(c->lib, 0, x->buf, ZS_DTYPE_BF16, x->bytes, NULL);
    if (rc)
      snprintf(err, sizeof err, "%s", zs_last_error());
    break;
  case K_DPC:
  case K_INPROC: {
    /* The in-process job never steps: its initial version is as good a
     * piece to read. */
    dp_pull_args a = {.spec_hash = c->k == K_INPROC ? c->hash : x->hash,
                      .min_version = c->k == K_INPROC ? 0 : 1,
                      .dtype = ZS_DTYPE_BF16,
                      .dst = x->buf,
                      .nbytes = x->bytes};
    uint64_t version = 0;
    rc = dp_client_pull_sync(c->dpc, &a, &version, err, sizeof err);
    break;
  }
  case K_RPC: {
    Zshard__V1__PullRequest req = ZSHARD__V1__PULL_REQUEST__INIT;
    req.spec_hash = x->hash;
    req.min_version = 1;
    req.dtype = ZSHARD__V1__DTYPE__DTYPE_BF16;
    Zshard__V1__PullResponse *resp = NULL;
    rpc_status st;
    rc = rpc_call(c->rpc, "/zshard.v1.ZShard/Pull", &req.base,
                  &zshard__v1__pull_response__descriptor, (ProtobufCMessage **)&resp,
                  CALL_TIMEOUT_MS, &st);
    if (rc) {
      snprintf(err, sizeof err, "%s", st.message);
    } else {
      /* What a client does with the answer: copy it out. */
      if (resp->data.len == x->bytes) {
        memcpy(x->buf, resp->data.data, x->bytes);
      } else {
        snprintf(err, sizeof err, "%zu bytes, not %zu", resp->data.len, x->bytes);
        rc = ZS_ESIZE;
      }
      protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
    break;
  }
  case K_RAW:
    return bench_pingpong_once(x->pp, SMALL_BYTES, x->bytes);
  }
  if (rc)
    bench_die("pull (%s): %s", c->name, err);
  return bench_now() - t0;
}

/* Creates the in-process shard of a K_INPROC contender: a one-tensor job of
 * numel parameters and `micro` micro-batches, initialised, served by a
 * dp_server on 127.0.0.1 port 0, and a dp_client to it. */
static void inproc_open(contender *c, uint64_t numel, uint32_t micro) {
  char err[256] = "";
  spec s;
  memset(&s, 0, sizeof s);
  s.job = strdup("bench-latency-inproc");
  s.num_groups = 1;
  s.groups = calloc(1, sizeof *s.groups);
  s.num_tensors = 1;
  s.tensors = calloc(1, sizeof *s.tensors);
  if (!s.job || !s.groups || !s.tensors || !(s.tensors[0].name = strdup("t0")))
    bench_die("out of memory");
  spec_group_defaults(&s.groups[0], ZS_OPTIM_ADAMW);
  s.tensors[0].numel = numel;
  s.world_size = 1;
  s.grad_accum = micro;
  s.num_shards = 1;
  s.reduce = SPEC_REDUCE_MEAN;
  s.param_dtype = ZS_DTYPE_BF16;
  if (spec_validate(&s, err, sizeof err) != 0)
    bench_die("spec: %s", err);
  c->hash = spec_hash(&s);
  core_config cc = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core_open_result orr;
  if (core_create(&cc, &c->core) != 0 || core_open(c->core, &s, &orr, err, sizeof err) != 0)
    bench_die("in-process core: %s", err);
  spec_free(&s);
  float *w = bench_alloc((size_t)numel * sizeof(float));
  int written = 0;
  uint64_t version = 0;
  if (core_init_params(c->core, c->hash, 0, 0, w, (size_t)numel * sizeof(float), &written, &version,
                       err, sizeof err) != 0)
    bench_die("core_init_params: %s", err);
  free(w);
  dp_server_config sc;
  dp_server_config_init(&sc);
  sc.listen = "127.0.0.1:0";
  sc.core = c->core;
  if (dp_server_start(&sc, &c->srv, err, sizeof err) != 0)
    bench_die("dp_server_start: %s", err);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", dp_server_port(c->srv));
  dp_client_config cfg = {.addr = addr};
  if (dp_client_open(&cfg, &c->dpc, err, sizeof err) != 0)
    bench_die("dp_client_open: %s", err);
}

/* Context switches per round trip: `n` more synchronous round trips of one
 * contender back to back (pushes of micro-batches micro0 ..), counting the
 * switches of every thread of this process and of the other end's (the
 * shard's, the ping-pong's peer; for K_INPROC both ends are here). Each one
 * is a thread that blocked and was woken: on a busy machine, a wait for a
 * core. */
typedef struct switches {
  double here, there;
} switches;

static switches count_switches(const ctx *x, contender *c, pid_t server, int push, uint32_t micro0,
                               size_t n) {
  pid_t other = c->k == K_RAW ? bench_pingpong_peer(x->pp) : c->k == K_INPROC ? 0 : server;
  uint64_t h0 = bench_switches(0), t0 = other ? bench_switches(other) : 0;
  for (size_t i = 0; i < n; i++)
    (void)(push ? push_once(x, c, micro0 + (uint32_t)i) : pull_once(x, c));
  uint64_t h1 = bench_switches(0), t1 = other ? bench_switches(other) : 0;
  return (switches){(double)(h1 - h0) / (double)n, (double)(t1 - t0) / (double)n};
}

/* The switches of every contender, each against the raw ping-pong's. */
static void report_switches(const bench_opts *o, const char *op, const ctx *x, contender *cs,
                            int nc, pid_t server, uint32_t micro0, size_t n) {
  switches sw[MAX_CONTENDERS];
  for (int k = 0; k < nc; k++)
    sw[k] = count_switches(x, &cs[k], server, strcmp(op, "push") == 0, micro0, n);
  double raw = sw[nc - 1].here + sw[nc - 1].there;
  for (int k = 0; k < nc; k++) {
    char metric[64];
    snprintf(metric, sizeof metric, "%s_%s_switches", op, cs[k].name);
    bench_kv kv[] = {BENCH_S("transport", cs[k].transport), BENCH_S("op", op),
                     BENCH_N("client_process", sw[k].here), BENCH_N("server_process", sw[k].there),
                     BENCH_N("round_trips", n)};
    bench_report(o, "latency", metric, sw[k].here + sw[k].there, "switches",
                 cs[k].k == K_RAW ? 0 : raw, kv, 5);
  }
}

static void report(const bench_opts *o, const char *op, contender *c, contender *raw, size_t n,
                   uint64_t bytes) {
  static const struct {
    const char *name;
    double q;
  } qs[] = {{"p50", 0.5}, {"p99", 0.99}};
  for (size_t i = 0; i < 2; i++) {
    double val = bench_quantile(c->t, n, qs[i].q) * 1e6;
    double lim = bench_quantile(raw->t, n, qs[i].q) * 1e6;
    char metric[64];
    snprintf(metric, sizeof metric, "%s_%s_%s", op, c->name, qs[i].name);
    bench_kv kv[] = {BENCH_S("transport", c->transport),
                     BENCH_S("client", c->k == K_LIB ? "libzshard" : "transport"),
                     BENCH_S("op", op),
                     BENCH_S("quantile", qs[i].name),
                     BENCH_N("bytes", bytes),
                     BENCH_N("samples", n)};
    bench_report(o, "latency", metric, val, "us", c->k == K_RAW ? 0 : lim, kv, 6);
  }
}

int main(int argc, char **argv) {
  bench_opts o;
  bench_parse_common(&argc, argv, &o);
  uint64_t samples = 0, bytes = 4096;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--samples") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &samples, 1) != 1 || samples > 60000)
        usage();
    } else if (strcmp(argv[i], "--bytes") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &bytes, 1) != 1 || bytes % 2 || bytes > (1u << 20))
        usage();
    } else {
      usage();
    }
  }
  if (!samples)
    samples = o.quick ? 500 : 3000;
  size_t warm = (size_t)samples / 10;
  size_t total = (size_t)samples + warm;
  /* Round trips counted for the context switches, after the timed ones. */
  size_t nswitch = o.quick ? 200 : 500;

  bench_server srv[1];
  bench_servers_start(srv, 1, 0);
  int have_data = srv[0].data_port > 0;
  if (!have_data)
    bench_note("the server advertises no data port: data plane skipped");

  contender cs[MAX_CONTENDERS];
  int nc = 0;
  cs[nc++] = (contender){.k = K_LIB, .name = "grpc_lib", .transport = "grpc"};
  if (have_data)
    cs[nc++] = (contender){.k = K_LIB, .name = "data_lib", .transport = "data"};
  cs[nc++] = (contender){.k = K_RPC, .name = "grpc_rpc_call", .transport = "grpc"};
  if (have_data)
    cs[nc++] = (contender){.k = K_DPC, .name = "data_dp_client", .transport = "data"};
  /* Every contender so far is a rank of the server's job. */
  uint32_t W = (uint32_t)nc;
  cs[nc++] = (contender){.k = K_INPROC, .name = "data_dp_client_inproc", .transport = "data"};
  cs[nc++] = (contender){.k = K_RAW, .name = "raw_tcp", .transport = "tcp"};
  for (int k = 0; k < nc; k++)
    cs[k].rank = (uint32_t)k;

  bench_model m = {.job = "bench-latency",
                   .ntensors = 1,
                   .numel = bytes / 2,
                   .optimizer = ZS_OPTIM_ADAMW,
                   .world_size = W,
                   .grad_accum = (uint32_t)(total + nswitch)};
  float *init = bench_alloc((size_t)m.numel * sizeof(float));
  bench_fill_f32(init, (size_t)m.numel, 0.1f, 3);
  ctx x = {.bytes = (size_t)bytes};
  zs_client *first_lib = NULL;
  for (int k = 0; k < nc; k++) {
    contender *c = &cs[k];
    char err[256] = "";
    if (c->k == K_LIB) {
      int tr = strcmp(c->transport, "data") == 0 ? ZS_TRANSPORT_DATA : ZS_TRANSPORT_GRPC;
      c->lib = bench_client_open(&m, srv[0].addr, 1, c->rank, tr, 0, c->rank == 0 ? init : NULL);
      if (!first_lib)
        first_lib = c->lib;
    } else if (c->k == K_DPC) {
      dp_client_config cc = {.addr = srv[0].data_addr};
      if (dp_client_open(&cc, &c->dpc, err, sizeof err) != 0)
        bench_die("dp_client_open: %s", err);
    } else if (c->k == K_RPC) {
      if (rpc_channel_open(srv[0].addr, &c->rpc) != 0)
        bench_die("rpc_channel_open failed");
    } else if (c->k == K_INPROC) {
      inproc_open(c, m.numel, (uint32_t)(total + nswitch));
    }
    if (!(c->t = calloc(total, sizeof(double))))
      bench_die("out of memory");
  }
  free(init);
  x.hash = zs_spec_hash(first_lib);
  x.buf = bench_alloc((size_t)bytes);
  bench_fill_bf16(x.buf, (size_t)m.numel, 9);
  x.pp = bench_pingpong_open();
  char sz[32];
  bench_note("latency: %s pushes and pulls, %" PRIu64 " samples (+%zu warm-up) per figure",
             bench_bytes_str((double)bytes, sz, sizeof sz), samples, warm);

  /* Pushes: contribution i of each rank is micro-batch i of step 1. */
  for (size_t i = 0; i < total; i++)
    for (int j = 0; j < nc; j++) {
      contender *c = &cs[(i + (size_t)j) % (size_t)nc];
      c->t[i] = push_once(&x, c, (uint32_t)i);
    }
  contender *raw = &cs[nc - 1];
  for (int k = 0; k < nc; k++) {
    memmove(cs[k].t, cs[k].t + warm, (size_t)samples * sizeof(double));
    report(&o, "push", &cs[k], raw, (size_t)samples, bytes);
  }
  report_switches(&o, "push", &x, cs, nc, srv[0].pid, (uint32_t)total, nswitch);
  /* Every rank's contributions are in: the step runs on the shard once a
   * trainer asks (the others' zs_step returns the recorded outcome). */
  for (int k = 0; k < nc; k++)
    if (cs[k].k == K_LIB)
      bench_step(cs[k].lib, NULL);

  for (size_t i = 0; i < total; i++)
    for (int j = 0; j < nc; j++) {
      contender *c = &cs[(i + (size_t)j) % (size_t)nc];
      c->t[i] = pull_once(&x, c);
    }
  for (int k = 0; k < nc; k++) {
    memmove(cs[k].t, cs[k].t + warm, (size_t)samples * sizeof(double));
    report(&o, "pull", &cs[k], raw, (size_t)samples, bytes);
  }
  report_switches(&o, "pull", &x, cs, nc, srv[0].pid, 0, nswitch);

  bench_pingpong_close(x.pp);
  for (int k = 0; k < nc; k++) {
    if (cs[k].lib)
      zs_client_close(cs[k].lib);
    /* The client before its server, the server before its core. */
    dp_client_close(cs[k].dpc);
    dp_server_stop(cs[k].srv);
    if (cs[k].core)
      core_destroy(cs[k].core);
    if (cs[k].rpc)
      rpc_channel_close(cs[k].rpc);
    free(cs[k].t);
  }
  bench_servers_stop(srv, 1);
  free(x.buf);
  return 0;
}
