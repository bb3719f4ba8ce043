/*
 * bench — what the benchmarks under tests/bench share: command line options,
 * the report format, timing and percentiles, zshard-server processes, and the
 * physical limits measured in the same run (a raw TCP pump and a raw TCP
 * ping-pong over loopback).
 *
 * Report format: every figure is printed as one human line on stdout, or
 * with --json as one JSON object per line:
 *   {"bench": ..., "metric": ..., "value": ..., "unit": ..., "limit": ...,
 *    "ratio": ..., <extra keys>}
 * where `limit` is the physical limit for that figure measured in the same run
 * and ratio = value / limit (so for a throughput the goal is a ratio near 1
 * from below, for a time or a size a ratio near 1 from above). Extra keys
 * (transport, shards, bytes, threads, params ...) describe the configuration,
 * for plot.py and docs/PERFORMANCE.md. Progress and notes go to stderr.
 *
 * None of this is thread-safe unless a function says so; the benchmarks call
 * it from their main thread, except the client helpers at the end, which
 * trainer threads call at once, each with its own client.
 */
#ifndef ZSHARD_TESTS_BENCH_H
#define ZSHARD_TESTS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "zshard/zshard.h"

#define BENCH_MAX_LIST 16
#define BENCH_MAX_SERVERS 8

/* ------------------------------------------------------------------ options */

typedef struct bench_opts {
  int json;  /* --json: JSON lines instead of human lines */
  int quick; /* --quick: smaller sizes and fewer repetitions */
  int reps;  /* --reps R: repetitions per figure; 0: the benchmark's default */
} bench_opts;

/* Parses --json, --quick and --reps R out of argv, leaving every other
 * argument in place (argc is updated), so that a benchmark can parse its own
 * options afterwards. Exits with status 2 on a malformed --reps. */
void bench_parse_common(int *argc, char **argv, bench_opts *o);

/* Parses a comma-separated list of counts with optional suffixes (K, M, G as
 * binary powers: 64M = 64 * 2^20, and Ki/Mi/Gi the same) into out[0 .. max).
 * Returns the number parsed, or -1 on a malformed list. */
int bench_parse_list(const char *s, uint64_t *out, int max);

/* ------------------------------------------------------------------ report */

/* An extra key of a report line: a string or a number. */
typedef struct bench_kv {
  const char *key;
  const char *s; /* the value if not NULL ... */
  double num;    /* ... else this number */
} bench_kv;

#define BENCH_S(k, v) ((bench_kv){.key = (k), .s = (v)})
#define BENCH_N(k, v) ((bench_kv){.key = (k), .s = NULL, .num = (double)(v)})

/* Prints one figure (see the format above). limit <= 0 means "no limit
 * measured": the JSON then has limit and ratio null. `extra` has nextra
 * entries (may be NULL with 0). */
void bench_report(const bench_opts *o, const char *bench, const char *metric, double value,
                  const char *unit, double limit, const bench_kv *extra, size_t nextra);

/* A note for the reader (stderr, prefixed with "# "). */
void bench_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints to stderr and exits with status 1. */
void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* ------------------------------------------------------------------ timing */

double bench_now(void); /* seconds on the monotonic clock */

/* Sorts v[0 .. n) in place and returns its q-quantile (0 <= q <= 1) by the
 * nearest-rank method; 0 for n == 0. */
double bench_quantile(double *v, size_t n, double q);

/* "64 MiB" style, into buf. */
const char *bench_bytes_str(double bytes, char *buf, size_t len);
/* `s` without its spaces ("64MiB"), for metric names, into buf. */
const char *bench_label(const char *s, char *buf, size_t len);

/* A buffer of `bytes` bytes, 64-byte aligned, every page touched (so that page
 * faults do not land in a timed region); from 32 MiB up its whole pages are
 * kept out of forked children (MADV_DONTFORK: the pumps fork, and a fork
 * would make the next write to every page fault), so a forked child must not
 * touch one. Exits on failure; free() releases. */
void *bench_alloc(size_t bytes);

/* Fills n bf16 values with small pseudo-random numbers in (-0.01, 0.01). */
void bench_fill_bf16(uint16_t *p, size_t n, uint64_t seed);
/* Fills n floats with pseudo-random numbers in (-scale, scale). */
void bench_fill_f32(float *p, size_t n, float scale, uint64_t seed);

/* ------------------------------------------------------------------ servers */

typedef struct bench_server {
  pid_t pid;
  int port;      /* gRPC */
  int data_port; /* the data plane's port from GetInfo, 0 when there is none */
  char addr[32]; /* "127.0.0.1:<port>" */
  char data_addr[32];
} bench_server;

/* The zshard-server binary: $ZSHARD_SERVER_BIN, else the one built beside the
 * benchmarks. */
const char *bench_server_bin(void);

/* Starts `n` zshard-server processes forming one cluster (shard i gets
 * --shard-id i --shards n --listen 127.0.0.1:0, plus --threads T when
 * threads > 0, plus the data plane on 127.0.0.1:0 when the server offers it),
 * waits until each writes its port file and asks each for its data port.
 * Logs go to a temporary directory that bench_servers_stop removes. Exits on
 * failure. */
void bench_servers_start(bench_server *srv, uint32_t n, int threads);

/* Makes the servers that bench_servers_start starts from now on speak TLS
 * only (gRPC and the data plane: --tls-cert, --tls-key), and its GetInfo
 * check them against the CA bundle `ca`; cert NULL: plain TCP again. The
 * strings are copied. Clients find the CA as trainers do, in ZSHARD_TLS_CA,
 * which the servers' environment never carries. */
void bench_servers_tls(const char *cert, const char *key, const char *ca);

/* SIGTERM, bounded wait (then SIGKILL) and reaping of every server. */
void bench_servers_stop(bench_server *srv, uint32_t n);

/* The peak resident set (VmHWM) of process `pid`, in bytes; 0 if unknown. */
uint64_t bench_vmhwm(pid_t pid);
/* The current resident set (VmRSS) of process `pid`, in bytes; 0 if unknown. */
uint64_t bench_vmrss(pid_t pid);

/* "127.0.0.1:p0,127.0.0.1:p1,..." of the gRPC ports into buf. */
void bench_server_list(const bench_server *srv, uint32_t n, char *buf, size_t len);

/* 1 if zshard-server has a data plane (it lists --data-listen in --help). */
int bench_server_has_data_plane(void);

/* ------------------------------------------------------------------ limits */

/* Raw TCP bandwidth over loopback: `conns` connections at once, each sending
 * bytes_per_conn bytes with write() calls of write_size bytes into a reader
 * that recv()s them into a buffer of the same size and discards them. The
 * readers run in a child process, as a server would. Returns the aggregate
 * bytes per second (total bytes / time from start until the last byte was
 * read). */
double bench_tcp_pump(uint32_t conns, uint64_t bytes_per_conn, size_t write_size);

/* Raw TCP round trips over one loopback connection with TCP_NODELAY on both
 * ends, to a peer in a child process. Each round trip writes an 8-byte
 * request header (the two lengths) and req_bytes in one write; the peer
 * answers resp_bytes as soon as the request is complete. The connection
 * stays open between round trips, so that the benchmark can interleave them
 * with the round trips it compares them to. */
typedef struct bench_pingpong bench_pingpong;

/* Forks the peer and connects; exits on failure. The handle is the caller's
 * (bench_pingpong_close). */
bench_pingpong *bench_pingpong_open(void);

/* One round trip (req_bytes, resp_bytes <= 16 MiB); returns its seconds. */
double bench_pingpong_once(bench_pingpong *p, size_t req_bytes, size_t resp_bytes);

/* Closes the connection, reaps the peer and frees p. */
void bench_pingpong_close(bench_pingpong *p);

/* The peer's process id, for bench_switches. */
pid_t bench_pingpong_peer(const bench_pingpong *p);

/* The voluntary context switches of every thread of process `pid` (0: this
 * one) so far, from /proc/PID/task/ * /status: a thread that blocks and is
 * woken again counts one; preemptions do not count. Threads that have
 * exited are not counted. */
uint64_t bench_switches(pid_t pid);

/* ------------------------------------------------------------------ clients */

/* A synthetic model for the end-to-end benchmarks: `ntensors` tensors of
 * `numel` parameters each ("t0", "t1", ...), one param group of `optimizer`
 * with torch's defaults, bf16 low copy, split over every shard. */
typedef struct bench_model {
  const char *job;
  uint32_t ntensors;
  uint64_t numel;
  zs_optimizer optimizer;
  uint32_t world_size, grad_accum;
} bench_model;

/* A comma-separated list of transports by name ("grpc", "data") into out
 * (ZS_TRANSPORT_GRPC / ZS_TRANSPORT_DATA, at most max): their count, or -1
 * for an unknown name, an empty list or too many. `list` is modified. */
int bench_transport_list(char *list, int *out, int max);
const char *bench_transport_name(int transport);

/* Opens a libzshard client of `m` as `rank` on the cluster `addrs` (nshards
 * shards) with `transport` (and `data_conns` data-plane connections per
 * shard, 0 for the library's default), and opens the job. On rank 0 every
 * tensor's initial weights are `init` (m->numel floats, shared by all
 * tensors; read during the call). Exits on failure. The client is the
 * caller's (zs_client_close). */
zs_client *bench_client_open(const bench_model *m, const char *addrs, uint32_t nshards,
                             uint32_t rank, int transport, uint32_t data_conns, const float *init);

/* Pushes every tensor of the current step (micro-batch `micro`) from `grad`
 * (m->numel bf16 values, shared by all tensors, only read) and waits for
 * all. Exits on failure. Threads may call this (and bench_pull_all,
 * bench_step) at once with different clients. */
void bench_push_all(zs_client *c, const bench_model *m, uint32_t micro, const uint16_t *grad);

/* Pulls every tensor in bf16 into dst (m->ntensors * m->numel values, tensor
 * t at t * numel) and waits for all. Exits on failure. */
void bench_pull_all(zs_client *c, const bench_model *m, uint16_t *dst);

/* zs_step with lr 1e-3, no clipping; exits on failure. *timing (may be NULL)
 * gets the step's timing. */
void bench_step(zs_client *c, zs_timing *timing);

#endif
