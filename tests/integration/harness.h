/*
 * harness — what the integration tests share: real zshard-server processes
 * started on 127.0.0.1 port 0 (the binary named by ZSHARD_SERVER_BIN), a test
 * job (spec, layout, hash) and the gRPC calls a trainer makes, through
 * rpc_call.
 *
 * Everything a test program starts lives in one temporary directory made by
 * hs_init(): each server's port file and its stderr log. hs_finish() kills
 * what is still running, prints every server log when a test failed, and
 * removes the directory.
 *
 * Waits are bounded (readiness 20 s, stop 30 s) and poll the condition they
 * wait for; none of them sleeps in the hope that something happened.
 */
#ifndef ZSHARD_TESTS_HARNESS_H
#define ZSHARD_TESTS_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/model/layout.h"
#include "common/model/spec.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"

#define HS_MAX_SHARDS 8
/* Timeout of every unary call the helpers make. */
#define HS_CALL_TIMEOUT_MS 30000u

/* ------------------------------------------------------------ processes */

/* Creates the temporary directory and checks ZSHARD_SERVER_BIN. Returns 0, or
 * -1 after printing why. Call once, before anything else here. */
int hs_init(void);

/* Stops every server still running (SIGKILL), prints every server log if
 * `failures` is not 0, and removes the temporary directory. */
void hs_finish(int failures);

/* The temporary directory (valid between hs_init and hs_finish). */
const char *hs_tmpdir(void);

typedef struct hs_server {
  pid_t pid; /* 0 once reaped */
  int port;
  char addr[32]; /* "127.0.0.1:<port>" */
  char log_path[512];
  char port_path[512];
} hs_server;

/* Starts zshard-server with "--listen 127.0.0.1:0 --port-file <tmp>" followed
 * by `args` (NULL-terminated, may be NULL), its stderr going to its log file.
 * `env` (NULL-terminated "NAME=value" strings, may be NULL) is added to the
 * child's environment after every ZSHARD_* variable of ours is removed from it.
 * Waits until the port file appears while checking that the child is alive.
 * Returns the server (owned by the harness until hs_stop, which frees it) or
 * NULL after printing why and the server's log. */
hs_server *hs_start(const char *const *args, const char *const *env);

/* Sends SIGTERM and waits up to 30 s for the exit (then SIGKILL). Returns the
 * exit status (0..255), 128 + signal if the server died of a signal, or -1 if
 * it had to be killed. Frees `s`. */
int hs_stop(hs_server *s);

/* Sends `sig` to the server; for SIGSTOP, waits (up to 5 s) until it is
 * stopped, otherwise returns at once. */
void hs_signal(hs_server *s, int sig);

/* Runs zshard-server with exactly `args` (no --listen added) and `env` as in
 * hs_start, to completion (bounded: killed after 20 s). Returns the exit
 * status as hs_stop does; the first `cap` - 1 bytes of its stdout and stderr
 * go to `out` (may be NULL). */
int hs_run(const char *const *args, const char *const *env, char *out, size_t cap);

/* N servers forming one job: shard i started with --shard-id i --shards N
 * --threads 1, plus `extra` args (may be NULL). */
typedef struct hs_cluster {
  uint32_t n;
  hs_server *srv[HS_MAX_SHARDS];
} hs_cluster;

/* Returns 0, or -1 (servers started so far are stopped). */
int hs_cluster_start(hs_cluster *c, uint32_t n, const char *const *extra);

/* Stops every server; returns 0 if every one exited with status 0. */
int hs_cluster_stop(hs_cluster *c);

/* ------------------------------------------------------------ the job */

/* The test spec: six tensors on both sides of split_threshold 1024 (split ones
 * with uneven last slices, whole ones of odd sizes) in two AdamW param groups
 * (group 1 without weight decay and with lr_scale 0.5), world size W,
 * accumulation M and N shards, GRAD_REDUCE_MEAN, bf16 low copy. `s` is filled
 * and validated; free it with spec_free. Returns 0 or a zs_status. */
int hs_spec_build(spec *s, const char *job, uint32_t W, uint32_t M, uint32_t N);

typedef struct hs_job {
  spec sp;    /* owned */
  layout lay; /* owned */
  uint64_t hash;
  uint32_t nshards;
  rpc_channel *ch[HS_MAX_SHARDS]; /* owned; ch[i] talks to shard i */
} hs_job;

/* Takes ownership of `sp` (left empty), builds the layout and opens a channel
 * to each address (addrs[i] is shard i, sp->num_shards of them). Returns 0
 * or a zs_status (the job is then empty). */
int hs_job_init(hs_job *j, spec *sp, const char *const *addrs);
/* The same with the cluster's addresses. */
int hs_job_init_cluster(hs_job *j, spec *sp, const hs_cluster *c);
void hs_job_free(hs_job *j);

/* Open with `rank` on every shard. Returns 0 or the first failure. */
int hs_job_open(hs_job *j, uint32_t rank, rpc_status *st);

/* InitParams of every piece from full fp32 tensors (weights[t] has numel of
 * tensor t). Returns 0 or the first failure. */
int hs_job_init_params(hs_job *j, float *const *weights, rpc_status *st);

/* Pulls every piece in fp32 with min_version and assembles full tensors into
 * out[t] (numel of tensor t each). *version (may be NULL) gets the smallest
 * version reported. Returns 0 or the first failure. */
int hs_job_pull(hs_job *j, uint64_t min_version, float *const *out, uint64_t *version,
                rpc_status *st);

/* The channel of the shard that owns piece (tensor, slice). */
rpc_channel *hs_job_owner(const hs_job *j, uint32_t tensor, uint32_t slice);

/* ------------------------------------------------------------ single calls */

/* Each returns 0 or the negative zs_status rpc_call returned; `st` may be
 * NULL. Response messages are the caller's, freed with
 * protobuf_c_message_free_unpacked(&resp->base, NULL). */
int hs_push(rpc_channel *ch, uint64_t hash, uint64_t step, uint32_t rank, uint32_t micro,
            uint32_t tensor, uint32_t slice, int dtype, const void *data, size_t nbytes,
            int *duplicate, rpc_status *st);

/* Pulls into dst, which must hold exactly the piece's bytes (a response of any
 * other size is an error). */
int hs_pull(rpc_channel *ch, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t min_version,
            int dtype, uint32_t timeout_ms, void *dst, size_t nbytes, uint64_t *version,
            rpc_status *st);

int hs_grad_stats(rpc_channel *ch, uint64_t hash, uint64_t step, uint32_t timeout_ms,
                  Zshard__V1__GradStatsResponse **out, rpc_status *st);

int hs_apply(rpc_channel *ch, uint64_t hash, uint64_t step, double lr, float coef, int skip,
             Zshard__V1__ApplyResponse **out, rpc_status *st);

int hs_get_info(rpc_channel *ch, Zshard__V1__GetInfoResponse **out, rpc_status *st);

/* ------------------------------------------------------------ health Watch */

/* A grpc.health.v1.Health/Watch stream, driven with the gRPC C API since
 * rpc_call is unary only. */
typedef struct hs_watch hs_watch;

/* Starts watching `service` on `addr`; the stream's deadline is 60 s. Returns
 * 0 or -1. */
int hs_watch_start(const char *addr, const char *service, hs_watch **out);

/* Waits for the next message: returns 0 with its status in *status, or 1 when
 * the stream ended (its gRPC code in *status), or -1 on a local failure. */
int hs_watch_next(hs_watch *w, int *status);

/* Cancels the stream if it is still open and frees everything. */
void hs_watch_free(hs_watch *w);

#endif
