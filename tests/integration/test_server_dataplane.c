/*
 * test_server_dataplane — the data plane of real zshard-server processes:
 * its port is advertised in GetInfo (and can be turned off), a port that
 * cannot be bound stops the start, pushes and pulls over it train exactly as
 * over gRPC, a refused request gets the status and the message gRPC gives
 * for it and changes nothing, and a stopping server closes its data
 * connections and still exits 0.
 *
 * The servers are started by the harness (port 0, a temporary directory); the
 * data plane is driven with dp_client, and with a raw socket where a test
 * needs a broken stream. test_dataplane covers the protocol in depth in one
 * process; this program checks the wiring through the real binary.
 *
 * The zero-copy answers of PULL_BATCH (the pieces sent from the shard's
 * low copy, pinned) are checked in this process, over a core of its own
 * (see "zero-copy batches" below for why): their CRC, their version while
 * steps run under them, the copies a mixed batch or a peer behind gets, and
 * the pins released by a closed connection or a stopped server.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/net/dp_client.h"
#include "common/net/wire.h"
#include "server/core/core.h"
#include "server/core/core_internal.h"
#include "server/transport/dp/dp_server.h"
#include "tests/integration/harness.h"

#define N 2u
#define W 2u
#define LR 1e-2
#define WAIT_MS 20000u

/* ------------------------------------------------------------ fixture */

/* One cluster of N shards with the harness's test job open (W ranks, one
 * micro-batch each), rank 0's initial weights written, and a data client to
 * every shard. */
typedef struct cluster {
  hs_cluster cl;
  hs_job j;
  dp_client *dp[N];
} cluster;

static int data_port_of(const hs_server *s) {
  rpc_channel *ch = NULL;
  Zshard__V1__GetInfoResponse *info = NULL;
  assert_int_equal(rpc_channel_open(s->addr, &ch), 0);
  rpc_status st;
  if (hs_get_info(ch, &info, &st) != 0)
    fail_msg("GetInfo: %s", st.message);
  int port = (int)info->data_port;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
  return port;
}

static dp_client *dp_connect(int port) {
  char addr[64], err[DP_ERRLEN];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  dp_client_config cfg = {.addr = addr};
  dp_client *c = NULL;
  if (dp_client_open(&cfg, &c, err, sizeof err) != 0)
    fail_msg("dp_client_open %s: %s", addr, err);
  return c;
}

static float init_value(uint32_t t, uint64_t i) {
  return 0.25f * (float)((t * 7919u + i * 104729u) % 2001u) / 1000.0f - 0.25f;
}

static void cluster_up(cluster *c, const char *job) {
  memset(c, 0, sizeof *c);
  assert_int_equal(hs_cluster_start(&c->cl, N, NULL), 0);
  spec sp;
  assert_int_equal(hs_spec_build(&sp, job, W, 1, N), 0);
  assert_int_equal(hs_job_init_cluster(&c->j, &sp, &c->cl), 0);
  rpc_status st;
  for (uint32_t r = 0; r < W; r++)
    if (hs_job_open(&c->j, r, &st) != 0)
      fail_msg("Open: %s", st.message);
  float **w = calloc(c->j.sp.num_tensors, sizeof *w);
  assert_non_null(w);
  for (uint32_t t = 0; t < c->j.sp.num_tensors; t++) {
    w[t] = malloc(c->j.sp.tensors[t].numel * sizeof(float));
    assert_non_null(w[t]);
    for (uint64_t i = 0; i < c->j.sp.tensors[t].numel; i++)
      w[t][i] = init_value(t, i);
  }
  if (hs_job_init_params(&c->j, w, &st) != 0)
    fail_msg("InitParams: %s", st.message);
  for (uint32_t t = 0; t < c->j.sp.num_tensors; t++)
    free(w[t]);
  free(w);
  for (uint32_t i = 0; i < N; i++)
    c->dp[i] = dp_connect(data_port_of(c->cl.srv[i]));
}

static void cluster_down(cluster *c) {
  for (uint32_t i = 0; i < N; i++)
    dp_client_close(c->dp[i]);
  hs_job_free(&c->j);
  assert_int_equal(hs_cluster_stop(&c->cl), 0);
}

/* ------------------------------------------------------------ data */

/* Rank r pushes in this dtype, so that a step mixes all three. */
static zs_dtype rank_dtype(uint32_t rank) {
  return rank == 0 ? ZS_DTYPE_FP32 : ZS_DTYPE_BF16;
}

/* The gradient of piece p for (step, rank) in the rank's dtype; the caller
 * frees it. */
static void *piece_grad(const layout_piece *p, uint64_t step, uint32_t rank, size_t *nbytes) {
  zs_dtype d = rank_dtype(rank);
  float *f = malloc(p->numel * sizeof *f);
  void *out = malloc(p->numel * zs_dtype_size(d));
  assert_non_null(f);
  assert_non_null(out);
  for (uint64_t i = 0; i < p->numel; i++) {
    uint64_t x = (step * 1000003u + rank * 10007u + p->tensor * 101u + p->offset + i) * 2654435761u;
    f[i] = (float)(x % 20001u) / 10000.0f - 1.0f;
  }
  dtype_from_f32(d, f, out, p->numel);
  free(f);
  *nbytes = p->numel * zs_dtype_size(d);
  return out;
}

/* ------------------------------------------------------------ transports */

/* Every push and pull of these tests goes through one of these, so that a
 * test can run the same request over either transport. */
typedef enum { OVER_GRPC, OVER_DATA } transport;

typedef struct outcome {
  int status;
  int duplicate;
  uint64_t version;
  char message[512];
} outcome;

/* The shard's own sentence of a failed gRPC call: rpc_call puts the method in
 * front of it ("/zshard.v1.ZShard/Push: ..."), the data plane does not. */
static void grpc_message(outcome *o, const char *method, const rpc_status *st) {
  size_t n = strlen(method);
  const char *msg = st->message;
  if (strncmp(msg, method, n) == 0 && strncmp(msg + n, ": ", 2) == 0)
    msg += n + 2;
  snprintf(o->message, sizeof o->message, "%s", o->status ? msg : "");
}

static outcome push(cluster *c, transport how, uint32_t shard, uint64_t hash, uint64_t step,
                    uint32_t rank, uint32_t micro, uint32_t tensor, uint32_t slice, zs_dtype dtype,
                    const void *data, size_t nbytes) {
  outcome o = {0};
  if (how == OVER_GRPC) {
    rpc_status st = {0};
    o.status = hs_push(c->j.ch[shard], hash, step, rank, micro, tensor, slice, (int)dtype, data,
                       nbytes, &o.duplicate, &st);
    grpc_message(&o, "/zshard.v1.ZShard/Push", &st);
  } else {
    dp_push_args a = {.spec_hash = hash,
                      .step = step,
                      .rank = rank,
                      .micro = micro,
                      .tensor = tensor,
                      .slice = slice,
                      .dtype = dtype,
                      .data = data,
                      .nbytes = nbytes};
    o.status = dp_client_push_sync(c->dp[shard], &a, &o.duplicate, o.message, sizeof o.message);
  }
  return o;
}

static outcome pull(cluster *c, transport how, uint32_t shard, uint64_t hash, uint32_t tensor,
                    uint32_t slice, uint64_t min_version, zs_dtype dtype, uint32_t timeout_ms,
                    void *dst, size_t nbytes) {
  outcome o = {0};
  if (how == OVER_GRPC) {
    rpc_status st = {0};
    o.status = hs_pull(c->j.ch[shard], hash, tensor, slice, min_version, (int)dtype, timeout_ms,
                       dst, nbytes, &o.version, &st);
    grpc_message(&o, "/zshard.v1.ZShard/Pull", &st);
  } else {
    dp_pull_args a = {.spec_hash = hash,
                      .min_version = min_version,
                      .tensor = tensor,
                      .slice = slice,
                      .dtype = dtype,
                      .dst = dst,
                      .nbytes = nbytes,
                      .timeout_ms = timeout_ms};
    o.status = dp_client_pull_sync(c->dp[shard], &a, &o.version, o.message, sizeof o.message);
  }
  return o;
}

/* Every (rank, piece) contribution of a step, over `how`. */
static void push_step(cluster *c, transport how, uint64_t step) {
  const layout *lay = &c->j.lay;
  for (uint32_t r = 0; r < W; r++) {
    for (uint32_t k = 0; k < lay->num_pieces; k++) {
      const layout_piece *p = &lay->pieces[k];
      size_t nb;
      void *g = piece_grad(p, step, r, &nb);
      outcome o =
          push(c, how, p->shard, c->j.hash, step, r, 0, p->tensor, p->slice, rank_dtype(r), g, nb);
      if (o.status)
        fail_msg("push of piece %u: %s: %s", k, zs_err_name(o.status), o.message);
      assert_false(o.duplicate);
      /* A repeat of the first piece is acknowledged and not added. */
      if (k == 0) {
        o = push(c, how, p->shard, c->j.hash, step, r, 0, p->tensor, p->slice, rank_dtype(r), g,
                 nb);
        assert_int_equal(o.status, 0);
        assert_true(o.duplicate);
      }
      free(g);
    }
  }
}

/* GradStats then Apply on every shard; the shards' sums of squares go to
 * sums[] so that clusters can be compared bit for bit. */
static void finish_step(cluster *c, uint64_t step, double *sums) {
  for (uint32_t i = 0; i < N; i++) {
    Zshard__V1__GradStatsResponse *gs = NULL;
    rpc_status st;
    if (hs_grad_stats(c->j.ch[i], c->j.hash, step, WAIT_MS, &gs, &st) != 0)
      fail_msg("GradStats: %s", st.message);
    assert_true(gs->complete);
    assert_false(gs->nonfinite);
    sums[i] = gs->sum_squares;
    protobuf_c_message_free_unpacked(&gs->base, NULL);
    Zshard__V1__ApplyResponse *ar = NULL;
    if (hs_apply(c->j.ch[i], c->j.hash, step, LR, 0.5f, 0, &ar, &st) != 0)
      fail_msg("Apply: %s", st.message);
    assert_int_equal(ar->version, step);
    protobuf_c_message_free_unpacked(&ar->base, NULL);
  }
}

/* Piece k of `version` in `dtype`, pulled over `how`; the caller frees it. */
static void *pull_piece(cluster *c, transport how, uint32_t k, uint64_t version, zs_dtype dtype) {
  const layout_piece *p = &c->j.lay.pieces[k];
  size_t nb = p->numel * zs_dtype_size(dtype);
  void *buf = malloc(nb);
  assert_non_null(buf);
  outcome o = pull(c, how, p->shard, c->j.hash, p->tensor, p->slice, version, dtype, 0, buf, nb);
  if (o.status)
    fail_msg("pull of piece %u: %s: %s", k, zs_err_name(o.status), o.message);
  assert_int_equal(o.version, version);
  return buf;
}

/* ------------------------------------------------------------ raw frames */

/* A blocking socket to the data port whose reads give up after 10 s (a
 * bound, not an expectation: every answer here comes at once), with a
 * receive buffer of rcvbuf bytes (0: the system's). */
static int raw_connect_rcvbuf(int port, int rcvbuf) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  if (rcvbuf)
    assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf), 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  struct timeval tv = {.tv_sec = 10};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

static void raw_send(int fd, const void *p, size_t n) {
  const char *b = p;
  while (n > 0) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    assert_true(w > 0);
    b += w;
    n -= (size_t)w;
  }
}

/* Reads exactly n bytes; returns 0, or -1 at the end of the stream. */
static int raw_read(int fd, void *p, size_t n) {
  char *b = p;
  while (n > 0) {
    ssize_t r = recv(fd, b, n, 0);
    if (r < 0 && errno == EINTR)
      continue;
    assert_true(r >= 0); /* a timeout fails the test */
    if (r == 0)
      return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

/* Reads one answer frame without payload into *m. */
static void raw_read_frame(int fd, wire_msg *m) {
  uint8_t buf[WIRE_MAX_ENCODED + WIRE_MAX_META];
  wire_header h;
  char err[WIRE_ERRLEN];
  assert_int_equal(raw_read(fd, buf, WIRE_HEADER_SIZE), 0);
  if (wire_decode_header(buf, 0, &h, err, sizeof err) != 0)
    fail_msg("answer header: %s", err);
  assert_true(h.meta_len <= sizeof buf - WIRE_HEADER_SIZE);
  assert_int_equal(h.payload_len, 0);
  assert_int_equal(raw_read(fd, buf + WIRE_HEADER_SIZE, h.meta_len), 0);
  const uint8_t *payload;
  size_t len;
  if (wire_decode_frame(buf, WIRE_HEADER_SIZE + h.meta_len, 0, m, &payload, &len, err,
                        sizeof err) != 0)
    fail_msg("answer frame: %s", err);
}

/* A connection that authenticated (a HELLO without token: the servers here
 * run without tokens). */
static int raw_connect_hello_rcvbuf(int port, int rcvbuf) {
  int fd = raw_connect_rcvbuf(port, rcvbuf);
  uint8_t f[WIRE_MAX_ENCODED];
  wire_msg h = {.type = WIRE_HELLO, .request_id = 1};
  size_t len = 0;
  assert_int_equal(wire_encode(&h, f, sizeof f, &len), 0);
  raw_send(fd, f, len);
  wire_msg m;
  raw_read_frame(fd, &m);
  assert_int_equal(m.type, WIRE_HELLO_ACK);
  return fd;
}

static int raw_connect_hello(int port) {
  return raw_connect_hello_rcvbuf(port, 0);
}

/* ------------------------------------------------------------ tests */

static void the_data_port_is_advertised_in_getinfo_and_off_turns_it_off(void **state) {
  (void)state;
  hs_server *dflt = hs_start(NULL, NULL);
  assert_non_null(dflt);
  int port = data_port_of(dflt);
  assert_true(port > 0);
  assert_int_not_equal(port, dflt->port);
  /* The port answers the protocol. */
  dp_client *dc = dp_connect(port);
  char err[DP_ERRLEN];
  assert_int_equal(dp_client_ping_sync(dc, 5000, err, sizeof err), 0);
  dp_client_close(dc);

  const char *off_flag[] = {"--data-listen", "off", NULL};
  const char *off_env[] = {"ZSHARD_DATA_LISTEN=off", NULL};
  const char *explicit_flag[] = {"--data-listen", "127.0.0.1:0", NULL};
  hs_server *by_flag = hs_start(off_flag, NULL);
  hs_server *by_env = hs_start(NULL, off_env);
  hs_server *flag_wins = hs_start(explicit_flag, off_env);
  assert_non_null(by_flag);
  assert_non_null(by_env);
  assert_non_null(flag_wins);
  assert_int_equal(data_port_of(by_flag), 0);
  assert_int_equal(data_port_of(by_env), 0);
  assert_true(data_port_of(flag_wins) > 0);

  assert_int_equal(hs_stop(dflt), 0);
  assert_int_equal(hs_stop(by_flag), 0);
  assert_int_equal(hs_stop(by_env), 0);
  assert_int_equal(hs_stop(flag_wins), 0);
}

static void a_data_address_that_cannot_be_bound_stops_the_start(void **state) {
  (void)state;
  /* A port this test holds. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  socklen_t len = sizeof a;
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(fd, 1), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  char taken[64];
  snprintf(taken, sizeof taken, "127.0.0.1:%d", ntohs(a.sin_port));

  char out[4096];
  const char *busy[] = {"--listen", "127.0.0.1:0", "--data-listen", taken, NULL};
  assert_int_equal(hs_run(busy, NULL, out, sizeof out), 1);
  assert_non_null(strstr(out, "stage=data_plane"));
  assert_non_null(strstr(out, taken));
  const char *bad[] = {"--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:http", NULL};
  assert_int_equal(hs_run(bad, NULL, out, sizeof out), 1);
  assert_non_null(strstr(out, "stage=data_plane"));
  close(fd);
}

static void pushes_and_pulls_over_the_data_plane_train_bit_identically_to_grpc(void **state) {
  (void)state;
  cluster g, d;
  cluster_up(&g, "dp-vs-grpc");
  cluster_up(&d, "dp-vs-grpc");
  static const zs_dtype dtypes[] = {ZS_DTYPE_FP32, ZS_DTYPE_BF16, ZS_DTYPE_FP16};
  for (uint64_t step = 1; step <= 2; step++) {
    push_step(&g, OVER_GRPC, step);
    push_step(&d, OVER_DATA, step);
    double sg[N], sd[N];
    finish_step(&g, step, sg);
    finish_step(&d, step, sd);
    assert_memory_equal(sg, sd, sizeof sg);
    /* Every piece, in every dtype: over gRPC from the gRPC-trained cluster,
     * and over both transports from the data-trained one, all the same bits. */
    for (uint32_t k = 0; k < g.j.lay.num_pieces; k++) {
      const layout_piece *p = &g.j.lay.pieces[k];
      for (size_t x = 0; x < sizeof dtypes / sizeof dtypes[0]; x++) {
        void *a = pull_piece(&g, OVER_GRPC, k, step, dtypes[x]);
        void *b = pull_piece(&d, OVER_DATA, k, step, dtypes[x]);
        void *e = pull_piece(&d, OVER_GRPC, k, step, dtypes[x]);
        assert_memory_equal(a, b, p->numel * zs_dtype_size(dtypes[x]));
        assert_memory_equal(a, e, p->numel * zs_dtype_size(dtypes[x]));
        free(a);
        free(b);
        free(e);
      }
    }
  }
  cluster_down(&g);
  cluster_down(&d);
}

/* Sends the same push over both transports: both are refused with `want`
 * and the same message. */
static void same_push_refusal(cluster *c, int want, uint32_t shard, uint64_t hash, uint64_t step,
                              uint32_t rank, uint32_t micro, uint32_t tensor, uint32_t slice,
                              zs_dtype dtype, const void *data, size_t nbytes) {
  outcome og =
      push(c, OVER_GRPC, shard, hash, step, rank, micro, tensor, slice, dtype, data, nbytes);
  outcome od =
      push(c, OVER_DATA, shard, hash, step, rank, micro, tensor, slice, dtype, data, nbytes);
  if (og.status != want || od.status != want || strcmp(og.message, od.message) != 0)
    fail_msg("expected %s on both transports; gRPC: %s \"%s\", data plane: %s \"%s\"",
             zs_err_name(want), zs_err_name(og.status), og.message, zs_err_name(od.status),
             od.message);
}

static void same_pull_refusal(cluster *c, int want, uint32_t shard, uint64_t hash, uint32_t tensor,
                              uint32_t slice, uint64_t min_version, uint32_t timeout_ms,
                              size_t nbytes) {
  void *buf = malloc(nbytes);
  assert_non_null(buf);
  outcome og = pull(c, OVER_GRPC, shard, hash, tensor, slice, min_version, ZS_DTYPE_FP32,
                    timeout_ms, buf, nbytes);
  outcome od = pull(c, OVER_DATA, shard, hash, tensor, slice, min_version, ZS_DTYPE_FP32,
                    timeout_ms, buf, nbytes);
  free(buf);
  if (og.status != want || od.status != want || strcmp(og.message, od.message) != 0)
    fail_msg("expected %s on both transports; gRPC: %s \"%s\", data plane: %s \"%s\"",
             zs_err_name(want), zs_err_name(og.status), og.message, zs_err_name(od.status),
             od.message);
}

static void refused_requests_get_grpcs_status_and_message_and_change_nothing(void **state) {
  (void)state;
  cluster bad, clean;
  cluster_up(&bad, "refusals");
  cluster_up(&clean, "refusals");
  const hs_job *j = &bad.j;
  const layout_piece *p = &j->lay.pieces[0];
  uint32_t owner = p->shard, other = (p->shard + 1) % N;
  size_t nb;
  void *g = piece_grad(p, 1, 0, &nb); /* fp32 */

  same_push_refusal(&bad, ZS_ESTEP, owner, j->hash, 2, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, g,
                    nb);
  same_push_refusal(&bad, ZS_ENOTFOUND, owner, j->hash, 1, 0, 0, j->sp.num_tensors, 0,
                    ZS_DTYPE_FP32, g, nb);
  same_push_refusal(&bad, ZS_ENOTFOUND, other, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32,
                    g, nb);
  same_push_refusal(&bad, ZS_ESIZE, owner, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32, g,
                    nb - 4);
  same_push_refusal(&bad, ZS_ESIZE, owner, j->hash, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP16, g,
                    nb);
  same_push_refusal(&bad, ZS_EHASH, owner, j->hash ^ 1, 1, 0, 0, p->tensor, p->slice, ZS_DTYPE_FP32,
                    g, nb);
  same_push_refusal(&bad, ZS_ERANGE, owner, j->hash, 1, W, 0, p->tensor, p->slice, ZS_DTYPE_FP32, g,
                    nb);
  same_push_refusal(&bad, ZS_ERANGE, owner, j->hash, 1, 0, 1, p->tensor, p->slice, ZS_DTYPE_FP32, g,
                    nb);

  size_t piece_bytes = p->numel * 4;
  same_pull_refusal(&bad, ZS_EHASH, owner, j->hash ^ 1, p->tensor, p->slice, 0, 0, piece_bytes);
  same_pull_refusal(&bad, ZS_ENOTFOUND, other, j->hash, p->tensor, p->slice, 0, 0, piece_bytes);
  same_pull_refusal(&bad, ZS_ENOTFOUND, owner, j->hash, j->sp.num_tensors, 0, 0, 0, piece_bytes);
  /* Version 1 does not exist before step 1 is applied. */
  same_pull_refusal(&bad, ZS_ETIMEDOUT, owner, j->hash, p->tensor, p->slice, 1, 50, piece_bytes);

  /* Broken frames through the real process: a payload CRC mismatch is
   * refused for that request and the connection lives on; bytes that are no
   * frame at all end it with an ERROR for request 0. */
  int port = data_port_of(bad.cl.srv[owner]);
  int fd = raw_connect_hello(port);
  wire_msg m = {.type = WIRE_PUSH,
                .request_id = 41,
                .payload_len = nb,
                .payload_crc = crc32c(0, g, nb) ^ 1u,
                .u.push = {.spec_hash = j->hash,
                           .step = 1,
                           .rank = 0,
                           .micro = 0,
                           .tensor = p->tensor,
                           .slice = p->slice,
                           .dtype = ZS_DTYPE_FP32}};
  uint8_t head[WIRE_MAX_ENCODED];
  size_t hlen;
  assert_int_equal(wire_encode(&m, head, sizeof head, &hlen), 0);
  raw_send(fd, head, hlen);
  raw_send(fd, g, nb);
  wire_msg ans;
  raw_read_frame(fd, &ans);
  assert_int_equal(ans.type, WIRE_ERROR);
  assert_int_equal(ans.request_id, 41);
  assert_int_equal(ans.u.error.status, ZS_ECRC);
  wire_msg ping = {.type = WIRE_PING, .request_id = 42};
  assert_int_equal(wire_encode(&ping, head, sizeof head, &hlen), 0);
  raw_send(fd, head, hlen);
  raw_read_frame(fd, &ans);
  assert_int_equal(ans.type, WIRE_PONG);
  assert_int_equal(ans.request_id, 42);
  static const char garbage[] = "GET / HTTP/1.1\r\nHost: zshard\r\n\r\n.......";
  raw_send(fd, garbage, WIRE_HEADER_SIZE);
  raw_read_frame(fd, &ans);
  assert_int_equal(ans.type, WIRE_ERROR);
  assert_int_equal(ans.request_id, 0);
  assert_int_equal(ans.u.error.status, ZS_EPROTO);
  char byte;
  assert_int_equal(raw_read(fd, &byte, 1), -1); /* closed */
  close(fd);
  free(g);

  /* None of it counted: the same valid step on both clusters gives the same
   * statistics and the same weights. */
  push_step(&bad, OVER_DATA, 1);
  push_step(&clean, OVER_DATA, 1);
  double sb[N], sc[N];
  finish_step(&bad, 1, sb);
  finish_step(&clean, 1, sc);
  assert_memory_equal(sb, sc, sizeof sb);
  for (uint32_t k = 0; k < j->lay.num_pieces; k++) {
    void *a = pull_piece(&bad, OVER_DATA, k, 1, ZS_DTYPE_FP32);
    void *b = pull_piece(&clean, OVER_DATA, k, 1, ZS_DTYPE_FP32);
    assert_memory_equal(a, b, j->lay.pieces[k].numel * 4);
    free(a);
    free(b);
  }
  cluster_down(&bad);
  cluster_down(&clean);
}

typedef struct waited {
  pthread_mutex_t mu;
  int done, status;
} waited;

static void on_waited(void *arg, const dp_result *r) {
  waited *w = arg;
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->status = r->status;
  pthread_mutex_unlock(&w->mu);
}

static void a_stopping_server_closes_its_data_connections_and_exits_0(void **state) {
  (void)state;
  cluster c;
  cluster_up(&c, "stop");
  const layout_piece *p = &c.j.lay.pieces[0];
  size_t nb = p->numel * 4;
  void *buf = malloc(nb);
  assert_non_null(buf);
  /* A Pull of a version that never comes waits in the shard... */
  waited w = {.mu = PTHREAD_MUTEX_INITIALIZER};
  dp_pull_args a = {.spec_hash = c.j.hash,
                    .min_version = 2, /* as far ahead as a wait may be */
                    .tensor = p->tensor,
                    .slice = p->slice,
                    .dtype = ZS_DTYPE_FP32,
                    .dst = buf,
                    .nbytes = nb,
                    .timeout_ms = 60000};
  assert_int_equal(dp_client_pull(c.dp[p->shard], &a, on_waited, &w), 0);
  /* ...which is seen in its Stats before it is stopped. */
  uint64_t end = clock_now_ms() + WAIT_MS;
  for (;;) {
    Zshard__V1__StatsRequest sreq = ZSHARD__V1__STATS_REQUEST__INIT;
    Zshard__V1__StatsResponse *st = NULL;
    rpc_status rs;
    assert_int_equal(rpc_call(c.j.ch[p->shard], "/zshard.v1.ZShard/Stats", &sreq.base,
                              &zshard__v1__stats_response__descriptor, (ProtobufCMessage **)&st,
                              HS_CALL_TIMEOUT_MS, &rs),
                     0);
    uint32_t waiting = st->waiting_pulls;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    if (waiting > 0)
      break;
    assert_true(clock_now_ms() < end);
    usleep(10000); /* polling a condition, bounded above */
  }
  /* SIGTERM: the server exits 0 and the waiting Pull fails as a lost
   * connection, long before its own timeout. */
  assert_int_equal(hs_stop(c.cl.srv[p->shard]), 0);
  c.cl.srv[p->shard] = NULL;
  end = clock_now_ms() + WAIT_MS;
  for (;;) {
    pthread_mutex_lock(&w.mu);
    int done = w.done, status = w.status;
    pthread_mutex_unlock(&w.mu);
    if (done) {
      assert_int_equal(status, ZS_ECONN);
      break;
    }
    assert_true(clock_now_ms() < end);
    usleep(10000);
  }
  free(buf);
  for (uint32_t i = 0; i < N; i++)
    dp_client_close(c.dp[i]);
  hs_job_free(&c.j);
  for (uint32_t i = 0; i < N; i++)
    if (c.cl.srv[i])
      assert_int_equal(hs_stop(c.cl.srv[i]), 0);
}

/* ------------------------------------------------ zero-copy batches */

/*
 * The cases below run the data plane in this process, over a core of its
 * own (shard 0 of 1), because they look at what the binary does not show:
 * the server's count of PULL_BATCH answers sent from the low copy
 * (dp_server_stats.pinned_batches: a fast path silently not taken fails
 * them), and the core's pins (one leaked by a closed connection fails them;
 * ASan alone would not tell, since the core frees its retired copies at
 * destroy whatever their pins). Every answer is held to single pulls of the
 * same version, and its CRC to one computed here over the bytes received.
 */

/* Odd element counts, so that piece lengths in bf16 are neither multiples
 * of 4 nor of 8. One shard holds every tensor whole: about 8 MiB in all,
 * more than the thread pool's threshold, and more than the socket buffers
 * of a peer that reads nothing take (Linux grows a sending socket's buffer
 * up to tcp_wmem's 4 MiB). */
static const uint64_t k_zc_numel[] = {1, 7, 33, 4099, 70001, 4000001};
#define ZC_NT (sizeof k_zc_numel / sizeof *k_zc_numel)
#define ZC_W 2u

typedef struct zc {
  spec sp;
  layout lay;
  uint64_t hash;
  core *core;
  dp_server *srv;
  int port;
  dp_client *trainer; /* every rank's pushes */
  dp_client *single;  /* single pulls: the reference */
  dp_client *batcher; /* batch pulls */
} zc;

static void zc_spec(spec *s, int pipelined) {
  memset(s, 0, sizeof *s);
  s->job = strdup("zero-copy-batch");
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_SGD);
  s->num_tensors = ZC_NT;
  s->tensors = calloc(ZC_NT, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < ZC_NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    s->tensors[t].name = strdup(name);
    s->tensors[t].numel = k_zc_numel[t];
  }
  s->world_size = ZC_W;
  s->grad_accum = 1;
  s->num_shards = 1;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  s->pipelined = pipelined;
  char err[256] = "";
  if (spec_validate(s, err, sizeof err) != 0)
    fail_msg("spec: %s", err);
}

static void zc_up(zc *z, int pipelined) {
  memset(z, 0, sizeof *z);
  zc_spec(&z->sp, pipelined);
  z->hash = spec_hash(&z->sp);
  assert_int_equal(layout_build(&z->sp, &z->lay), 0);
  core_config cc = {.shard_id = 0, .num_shards = 1, .threads = 1};
  assert_int_equal(core_create(&cc, &z->core), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(z->core, &z->sp, &r, err, sizeof err), 0);
  for (uint32_t k = 0; k < z->lay.num_pieces; k++) {
    const layout_piece *p = &z->lay.pieces[k];
    float *w = malloc(p->numel * sizeof *w);
    assert_non_null(w);
    for (uint64_t i = 0; i < p->numel; i++)
      w[i] = init_value(p->tensor, p->offset + i);
    int written = 0;
    uint64_t v = 0;
    if (core_init_params(z->core, z->hash, p->tensor, p->slice, w, p->numel * sizeof *w, &written,
                         &v, err, sizeof err) != 0)
      fail_msg("init: %s", err);
    free(w);
  }
  dp_server_config sc;
  dp_server_config_init(&sc);
  sc.listen = "127.0.0.1:0";
  sc.core = z->core;
  /* Tests here hold pinned answers on purpose; the stall rule has its own
   * tests (test_dataplane). */
  sc.pin_hold_ms = 600000;
  if (dp_server_start(&sc, &z->srv, err, sizeof err) != 0)
    fail_msg("dp_server_start: %s", err);
  z->port = dp_server_port(z->srv);
  z->trainer = dp_connect(z->port);
  z->single = dp_connect(z->port);
  z->batcher = dp_connect(z->port);
}

/* Answers pinned in the core's low copies, the current one and those
 * retired while pinned. */
static uint64_t zc_core_pins(core *c) {
  pthread_mutex_lock(&c->low_mu);
  uint64_t n = c->low_cur ? c->low_cur->pins : 0;
  for (const low_buf *b = c->low_retired; b; b = b->next)
    n += b->pins;
  pthread_mutex_unlock(&c->low_mu);
  return n;
}

static void zc_down(zc *z) {
  dp_client_close(z->trainer);
  dp_client_close(z->single);
  dp_client_close(z->batcher);
  dp_server_stop(z->srv);
  /* Every answer is gone with the server: none may still hold a pin. */
  assert_int_equal(zc_core_pins(z->core), 0);
  core_destroy(z->core);
  layout_free(&z->lay);
  spec_free(&z->sp);
}

static dp_server_stats zc_stats(const zc *z) {
  dp_server_stats st;
  dp_server_get_stats(z->srv, &st);
  return st;
}

/* Polls until the server has one answer from the low copy in its socket
 * queue (a bounded poll of a condition, never a sleep in the hope of one). */
static void zc_wait_pinned(const zc *z) {
  uint64_t end = clock_now_ms() + WAIT_MS;
  while (zc_stats(z).pinned_answers != 1) {
    if (clock_now_ms() > end) {
      dp_server_stats st = zc_stats(z);
      fail_msg("no pinned answer: %" PRIu64 " pinned, %" PRIu64 " pinned batches, %" PRIu64
               " frames out, %" PRIu64 " answer bytes held",
               st.pinned_answers, st.pinned_batches, st.frames_out, st.answer_bytes);
    }
    usleep(1000);
  }
}

/* Polls until the core holds no pin: a written (or dropped) answer releases
 * its pins right after the server stops counting it. */
static void zc_wait_unpinned(const zc *z) {
  uint64_t end = clock_now_ms() + WAIT_MS;
  while (zc_core_pins(z->core) != 0) {
    if (clock_now_ms() > end)
      fail_msg("%" PRIu64 " pins still held", zc_core_pins(z->core));
    usleep(1000);
  }
}

static uint64_t zc_version(const zc *z) {
  core_info info;
  core_get_info(z->core, &info);
  return info.version;
}

typedef struct zc_event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int fired, status;
} zc_event;

static void zc_fire(zc_event *e, int status) {
  pthread_mutex_lock(&e->mu);
  e->status = status;
  e->fired = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static void zc_on_apply(void *arg, int status, const core_apply_result *r) {
  (void)r;
  zc_fire(arg, status);
}

static void zc_on_stats(void *arg, int status, const core_stats_result *r) {
  (void)r;
  zc_fire(arg, status);
}

/* *rc is what the asynchronous call returned: CORE_PENDING becomes the
 * callback's status once it ran. */
static void zc_event_wait(zc_event *e, int *rc) {
  if (*rc != CORE_PENDING)
    return;
  pthread_mutex_lock(&e->mu);
  while (!e->fired)
    pthread_cond_wait(&e->cv, &e->mu);
  *rc = e->status;
  pthread_mutex_unlock(&e->mu);
}

/* Every rank's fp32 gradient of every piece for `step`, then its apply: in
 * a gated job the apply follows the pushes; in a pipelined one it comes
 * first and each piece is applied as its last contribution lands. Returns
 * once the shard is at version `step`. */
static void zc_step(zc *z, uint64_t step) {
  char err[DP_ERRLEN] = "";
  zc_event e = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  core_apply_result ar;
  if (z->sp.pipelined)
    assert_int_equal(
        core_apply(z->core, z->hash, step, 0.5, 1.0f, 0, zc_on_apply, &e, &ar, err, sizeof err), 0);
  for (uint32_t r = 0; r < ZC_W; r++)
    for (uint32_t k = 0; k < z->lay.num_pieces; k++) {
      const layout_piece *p = &z->lay.pieces[k];
      float *g = malloc(p->numel * sizeof *g);
      assert_non_null(g);
      for (uint64_t i = 0; i < p->numel; i++)
        g[i] = (float)((step * 31u + r * 7u + p->tensor + p->offset + i) % 17u) / 16.0f - 0.5f;
      dp_push_args a = {.spec_hash = z->hash,
                        .step = step,
                        .rank = r,
                        .tensor = p->tensor,
                        .slice = p->slice,
                        .dtype = ZS_DTYPE_FP32,
                        .data = g,
                        .nbytes = p->numel * sizeof *g,
                        .timeout_ms = WAIT_MS};
      int dup = 0;
      if (dp_client_push_sync(z->trainer, &a, &dup, err, sizeof err) != 0)
        fail_msg("push of step %" PRIu64 ": %s", step, err);
      free(g);
    }
  if (!z->sp.pipelined) {
    /* The statistics first, as a trainer's step: the apply needs them. */
    core_stats_result sr;
    int rc = core_grad_stats(z->core, z->hash, step, 0, zc_on_stats, &e, &sr, err, sizeof err);
    zc_event_wait(&e, &rc);
    if (rc != 0)
      fail_msg("statistics of step %" PRIu64 ": %s", step, err);
    e.fired = 0;
    rc = core_apply(z->core, z->hash, step, 0.5, 1.0f, 0, zc_on_apply, &e, &ar, err, sizeof err);
    zc_event_wait(&e, &rc);
    if (rc != 0)
      fail_msg("apply of step %" PRIu64 ": %s", step, err);
  }
  uint64_t end = clock_now_ms() + WAIT_MS;
  while (zc_version(z) < step) {
    assert_true(clock_now_ms() < end);
    usleep(1000);
  }
}

/* The pieces a batch asks for: every piece, last first (several tensors, a
 * split one included, and not in layout order), in `dtype`, or in FP32 for
 * every other piece when `mixed`. Returns the payload's size. */
static size_t zc_pieces(const zc *z, int mixed, dp_batch_piece *out, uint32_t *n) {
  size_t total = 0;
  *n = z->lay.num_pieces;
  for (uint32_t i = 0; i < *n; i++) {
    const layout_piece *p = &z->lay.pieces[*n - 1 - i];
    zs_dtype d = mixed && i % 2 ? ZS_DTYPE_FP32 : ZS_DTYPE_BF16;
    out[i] = (dp_batch_piece){
        .tensor = p->tensor, .slice = p->slice, .dtype = d, .nbytes = p->numel * zs_dtype_size(d)};
    total += out[i].nbytes;
  }
  return total;
}

/* The batch's bytes at `version`, made of single PULLs (which must answer
 * that version); the caller frees it. */
static uint8_t *zc_reference(const zc *z, const dp_batch_piece *pcs, uint32_t n, size_t total,
                             uint64_t version) {
  uint8_t *ref = malloc(total);
  assert_non_null(ref);
  size_t off = 0;
  for (uint32_t i = 0; i < n; i++) {
    dp_pull_args a = {.spec_hash = z->hash,
                      .min_version = version,
                      .tensor = pcs[i].tensor,
                      .slice = pcs[i].slice,
                      .dtype = pcs[i].dtype,
                      .dst = ref + off,
                      .nbytes = pcs[i].nbytes,
                      .timeout_ms = WAIT_MS};
    uint64_t v = 0;
    char err[DP_ERRLEN] = "";
    if (dp_client_pull_sync(z->single, &a, &v, err, sizeof err) != 0)
      fail_msg("single pull: %s", err);
    assert_int_equal(v, version);
    off += pcs[i].nbytes;
  }
  return ref;
}

/* A raw connection's PULL_BATCH of pcs. */
static void zc_send_batch(const zc *z, int fd, uint64_t id, const dp_batch_piece *pcs, uint32_t n,
                          uint64_t min_version) {
  wire_piece wp[WIRE_MAX_BATCH];
  for (uint32_t i = 0; i < n; i++)
    wp[i] = (wire_piece){.tensor = pcs[i].tensor,
                         .slice = pcs[i].slice,
                         .dtype = pcs[i].dtype,
                         .length = pcs[i].nbytes};
  wire_msg m = {.type = WIRE_PULL_BATCH, .request_id = id};
  m.u.pull_batch = (wire_pull_batch){.spec_hash = z->hash,
                                     .min_version = min_version,
                                     .timeout_ms = WAIT_MS,
                                     .npieces = n,
                                     .pieces = wp};
  uint8_t f[WIRE_MAX_BATCH_ENCODED];
  size_t len = 0;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), 0);
  raw_send(fd, f, len);
}

/* Reads one PULL_BATCH_DATA of request `id` from a raw connection and checks
 * what the client library would: the header CRC, and the payload CRC
 * against one computed here over the bytes received. Returns the payload
 * (the caller frees it) and its version. */
static uint8_t *zc_read_batch(int fd, uint64_t id, size_t total, uint64_t *version) {
  uint8_t buf[WIRE_MAX_BATCH_ENCODED];
  wire_header h;
  wire_msg m;
  char err[WIRE_ERRLEN];
  assert_int_equal(raw_read(fd, buf, WIRE_HEADER_SIZE), 0);
  if (wire_decode_header(buf, 0, &h, err, sizeof err) != 0)
    fail_msg("answer header: %s", err);
  assert_true(h.meta_len <= sizeof buf - WIRE_HEADER_SIZE);
  assert_int_equal(raw_read(fd, buf + WIRE_HEADER_SIZE, h.meta_len), 0);
  assert_int_equal(wire_check_header_crc(&h, buf, buf + WIRE_HEADER_SIZE, err, sizeof err), 0);
  assert_int_equal(wire_decode_meta(&h, buf + WIRE_HEADER_SIZE, &m, err, sizeof err), 0);
  if (m.type == WIRE_ERROR)
    fail_msg("batch %" PRIu64 ": %s: %s", id, zs_err_name(m.u.error.status), m.u.error.message);
  assert_int_equal(m.type, WIRE_PULL_BATCH_DATA);
  assert_int_equal(m.request_id, id);
  assert_int_equal(h.payload_len, total);
  uint8_t *payload = malloc(total);
  assert_non_null(payload);
  assert_int_equal(raw_read(fd, payload, total), 0);
  if (crc32c(0, payload, total) != h.payload_crc)
    fail_msg("batch %" PRIu64 ": payload CRC 0x%08x in the header, 0x%08x over the bytes", id,
             h.payload_crc, crc32c(0, payload, total));
  *version = m.u.pull_batch_data.version;
  return payload;
}

/* A raw connection with a receive buffer of 4 KiB (set before the connect,
 * so that the window stays that small): an answer it does not read stays
 * in the server's queue, pinned. */
static int zc_slow_reader(int port) {
  return raw_connect_hello_rcvbuf(port, 4096);
}

static void batch_answers_carry_the_crc_of_their_bytes_and_go_out_pinned(void **state) {
  (void)state;
  zc z;
  zc_up(&z, 0);
  zc_step(&z, 1);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  uint32_t n = 0;
  size_t total = zc_pieces(&z, 0, pcs, &n);
  uint8_t *ref = zc_reference(&z, pcs, n, total, 1);
  int fd = raw_connect_hello(z.port);
  uint64_t before = zc_stats(&z).pinned_batches;
  /* The whole batch (the thread pool's path), then the three smallest
   * pieces alone (the loop's inline path), one at a time. */
  zc_send_batch(&z, fd, 10, pcs, n, 1);
  uint64_t v = 0;
  uint8_t *got = zc_read_batch(fd, 10, total, &v);
  assert_int_equal(v, 1);
  assert_memory_equal(got, ref, total);
  free(got);
  size_t small = pcs[n - 3].nbytes + pcs[n - 2].nbytes + pcs[n - 1].nbytes;
  zc_send_batch(&z, fd, 11, pcs + n - 3, 3, 0);
  got = zc_read_batch(fd, 11, small, &v);
  assert_int_equal(v, 1);
  assert_memory_equal(got, ref + total - small, small);
  free(got);
  assert_int_equal(zc_stats(&z).pinned_batches, before + 2);
  close(fd);
  free(ref);
  zc_down(&z);
}

/* The answer of a batch goes out pinned; a whole step (pushes of both
 * ranks and the apply, or in a pipelined job each piece's apply) runs while
 * it waits in the socket; read then, it is still every piece of the version
 * it was pinned at, bit-equal to single pulls of that version, and the
 * pins go once it is out. */
static void pinned_batch_outlives_a_step(int pipelined) {
  zc z;
  zc_up(&z, pipelined);
  zc_step(&z, 1);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  uint32_t n = 0;
  size_t total = zc_pieces(&z, 0, pcs, &n);
  uint8_t *ref1 = zc_reference(&z, pcs, n, total, 1);
  uint64_t before = zc_stats(&z).pinned_batches;
  int fd = zc_slow_reader(z.port);
  zc_send_batch(&z, fd, 20, pcs, n, 1);
  zc_wait_pinned(&z);
  assert_int_equal(zc_core_pins(z.core), n);
  zc_step(&z, 2);
  uint8_t *ref2 = zc_reference(&z, pcs, n, total, 2);
  assert_memory_not_equal(ref1, ref2, total); /* the step changed every piece */
  uint64_t v = 0;
  uint8_t *got = zc_read_batch(fd, 20, total, &v);
  assert_int_equal(v, 1);
  assert_memory_equal(got, ref1, total);
  assert_int_equal(zc_stats(&z).pinned_batches, before + 1);
  /* Once written, nothing stays pinned, and the next batch sees step 2. */
  zc_wait_unpinned(&z);
  free(got);
  zc_send_batch(&z, fd, 21, pcs, n, 2);
  got = zc_read_batch(fd, 21, total, &v);
  assert_int_equal(v, 2);
  assert_memory_equal(got, ref2, total);
  free(got);
  close(fd);
  free(ref1);
  free(ref2);
  zc_down(&z);
}

static void a_pinned_batch_keeps_its_version_while_the_next_step_applies(void **state) {
  (void)state;
  pinned_batch_outlives_a_step(0);
}

static void a_pinned_batch_keeps_its_version_while_pipelined_pieces_apply(void **state) {
  (void)state;
  pinned_batch_outlives_a_step(1);
}

/* What a puller thread saw: every batch answer checked against the
 * reference of its version, which the stepping thread publishes. */
typedef struct zc_puller {
  zc *z;
  const dp_batch_piece *pcs;
  uint32_t n;
  size_t total;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint8_t *ref[16]; /* by version, published by the stepping thread */
  int stop;
  uint64_t answers, mismatched, min_seen, max_seen;
  int failed;
  char why[DP_ERRLEN + 64];
  /* The current request's completion. */
  int done, status;
  uint64_t version;
} zc_puller;

static void zc_on_batch(void *arg, const dp_result *r) {
  zc_puller *p = arg;
  pthread_mutex_lock(&p->mu);
  p->status = r->status;
  p->version = r->version;
  if (r->status != 0)
    snprintf(p->why, sizeof p->why, "%s: %s", zs_err_name(r->status), r->message);
  p->done = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

/* Pulls the batch over and over (cmocka asserts only on the test thread:
 * failures are recorded for it). */
static void *zc_pull_loop(void *arg) {
  zc_puller *p = arg;
  uint8_t *dst = malloc(p->total);
  if (!dst)
    return NULL;
  pthread_mutex_lock(&p->mu);
  while (!p->stop && !p->failed) {
    p->done = 0;
    pthread_mutex_unlock(&p->mu);
    dp_pull_batch_args a = {.spec_hash = p->z->hash,
                            .pieces = p->pcs,
                            .npieces = p->n,
                            .dst = dst,
                            .timeout_ms = WAIT_MS};
    int rc = dp_client_pull_batch(p->z->batcher, &a, zc_on_batch, p);
    pthread_mutex_lock(&p->mu);
    while (rc == 0 && !p->done)
      pthread_cond_wait(&p->cv, &p->mu);
    if (rc != 0 || p->status != 0 || p->version >= 16) {
      p->failed = 1;
      break;
    }
    /* Its version's reference is published once the step is over. */
    while (!p->ref[p->version] && !p->stop)
      pthread_cond_wait(&p->cv, &p->mu);
    if (!p->ref[p->version])
      break;
    p->answers++;
    p->mismatched += memcmp(dst, p->ref[p->version], p->total) != 0;
    p->min_seen = p->version < p->min_seen ? p->version : p->min_seen;
    p->max_seen = p->version > p->max_seen ? p->version : p->max_seen;
  }
  pthread_mutex_unlock(&p->mu);
  free(dst);
  return NULL;
}

static void batches_pulled_while_pushes_and_applies_run_are_each_one_version(void **state) {
  (void)state;
  enum { STEPS = 8 };
  zc z;
  zc_up(&z, 0);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  zc_puller p = {.z = &z, .pcs = pcs, .min_seen = UINT64_MAX};
  pthread_mutex_init(&p.mu, NULL);
  pthread_cond_init(&p.cv, NULL);
  p.total = zc_pieces(&z, 0, pcs, &p.n);
  p.ref[0] = zc_reference(&z, pcs, p.n, p.total, 0);
  uint64_t before = zc_stats(&z).pinned_batches;
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, zc_pull_loop, &p), 0);
  for (uint64_t s = 1; s <= STEPS; s++) {
    zc_step(&z, s);
    uint8_t *ref = zc_reference(&z, pcs, p.n, p.total, s);
    pthread_mutex_lock(&p.mu);
    p.ref[s] = ref;
    pthread_cond_broadcast(&p.cv);
    pthread_mutex_unlock(&p.mu);
  }
  pthread_mutex_lock(&p.mu);
  p.stop = 1;
  pthread_cond_broadcast(&p.cv);
  pthread_mutex_unlock(&p.mu);
  pthread_join(th, NULL);
  if (p.failed)
    fail_msg("a batch pull failed: %s", p.why);
  printf("%" PRIu64 " batches of versions %" PRIu64 "..%" PRIu64 " while %d steps ran\n", p.answers,
         p.min_seen, p.max_seen, STEPS);
  assert_int_equal(p.mismatched, 0);
  assert_true(p.answers > 0);
  /* The puller's socket is empty whenever it asks (one request at a time),
   * so every answer went out pinned; the one in flight at the stop may have
   * been answered and not checked. */
  uint64_t pinned = zc_stats(&z).pinned_batches - before;
  assert_true(pinned >= p.answers && pinned <= p.answers + 1);
  for (uint64_t v = 0; v <= STEPS; v++)
    free(p.ref[v]);
  pthread_mutex_destroy(&p.mu);
  pthread_cond_destroy(&p.cv);
  zc_down(&z);
}

static void a_batch_mixing_dtypes_is_copied_and_still_right(void **state) {
  (void)state;
  zc z;
  zc_up(&z, 0);
  zc_step(&z, 1);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  uint32_t n = 0;
  size_t total = zc_pieces(&z, 1, pcs, &n);
  uint8_t *ref = zc_reference(&z, pcs, n, total, 1);
  uint64_t before = zc_stats(&z).pinned_batches;
  int fd = raw_connect_hello(z.port);
  zc_send_batch(&z, fd, 30, pcs, n, 1);
  uint64_t v = 0;
  uint8_t *got = zc_read_batch(fd, 30, total, &v);
  assert_int_equal(v, 1);
  assert_memory_equal(got, ref, total);
  assert_int_equal(zc_stats(&z).pinned_batches, before);
  free(got);
  close(fd);
  free(ref);
  zc_down(&z);
}

/* A peer whose socket still holds unsent bytes gets a copy (PROTOCOL.md), a
 * batch as a single piece: of two batches asked back to back on a socket
 * that reads nothing, the first goes out pinned, the second is copied. */
static void a_batch_behind_unsent_bytes_is_copied(void **state) {
  (void)state;
  zc z;
  zc_up(&z, 0);
  zc_step(&z, 1);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  uint32_t n = 0;
  size_t total = zc_pieces(&z, 0, pcs, &n);
  uint8_t *ref = zc_reference(&z, pcs, n, total, 1);
  uint64_t before = zc_stats(&z).pinned_batches;
  int fd = zc_slow_reader(z.port);
  zc_send_batch(&z, fd, 40, pcs, n, 1);
  zc_wait_pinned(&z);
  zc_send_batch(&z, fd, 41, pcs, n, 1);
  /* The copy is counted against the answer budget until it is written. */
  uint64_t end = clock_now_ms() + WAIT_MS;
  while (zc_stats(&z).answer_bytes != total) {
    assert_true(clock_now_ms() < end);
    usleep(1000);
  }
  for (uint64_t id = 40; id <= 41; id++) {
    uint64_t v = 0;
    uint8_t *got = zc_read_batch(fd, id, total, &v);
    assert_int_equal(v, 1);
    assert_memory_equal(got, ref, total);
    free(got);
  }
  assert_int_equal(zc_stats(&z).pinned_batches, before + 1);
  close(fd);
  free(ref);
  zc_down(&z);
}

/* A peer that goes away mid-answer, or a server that stops under one,
 * releases the pins: the next step writes in place (no copy retired), and
 * the job closes with nothing pinned. */
static void closing_mid_answer_releases_the_pins(int stop_server) {
  zc z;
  zc_up(&z, 0);
  zc_step(&z, 1);
  dp_batch_piece pcs[WIRE_MAX_BATCH];
  uint32_t n = 0;
  size_t total = zc_pieces(&z, 0, pcs, &n);
  int fd = zc_slow_reader(z.port);
  zc_send_batch(&z, fd, 50, pcs, n, 1);
  zc_wait_pinned(&z);
  assert_int_equal(zc_core_pins(z.core), n);
  /* Part of the answer, then the end. */
  uint8_t head[WIRE_HEADER_SIZE + 100];
  assert_int_equal(raw_read(fd, head, sizeof head), 0);
  assert_true(total > sizeof head);
  if (stop_server) {
    dp_server_stop(z.srv);
    z.srv = NULL;
  } else {
    close(fd);
    zc_wait_unpinned(&z);
  }
  assert_int_equal(zc_core_pins(z.core), 0);
  if (!stop_server) {
    zc_step(&z, 2);
    pthread_mutex_lock(&z.core->low_mu);
    int retired = z.core->low_retired != NULL;
    pthread_mutex_unlock(&z.core->low_mu);
    assert_false(retired);
  } else {
    close(fd);
  }
  char err[256] = "";
  core_close_result cr;
  assert_int_equal(core_close(z.core, z.hash, NULL, &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 1);
  assert_int_equal(zc_core_pins(z.core), 0);
  zc_down(&z);
}

static void a_connection_closed_mid_batch_answer_releases_its_pins(void **state) {
  (void)state;
  closing_mid_answer_releases_the_pins(0);
}

static void a_server_stopped_mid_batch_answer_releases_its_pins(void **state) {
  (void)state;
  closing_mid_answer_releases_the_pins(1);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(the_data_port_is_advertised_in_getinfo_and_off_turns_it_off),
      cmocka_unit_test(a_data_address_that_cannot_be_bound_stops_the_start),
      cmocka_unit_test(pushes_and_pulls_over_the_data_plane_train_bit_identically_to_grpc),
      cmocka_unit_test(refused_requests_get_grpcs_status_and_message_and_change_nothing),
      cmocka_unit_test(a_stopping_server_closes_its_data_connections_and_exits_0),
      cmocka_unit_test(batch_answers_carry_the_crc_of_their_bytes_and_go_out_pinned),
      cmocka_unit_test(a_pinned_batch_keeps_its_version_while_the_next_step_applies),
      cmocka_unit_test(a_pinned_batch_keeps_its_version_while_pipelined_pieces_apply),
      cmocka_unit_test(batches_pulled_while_pushes_and_applies_run_are_each_one_version),
      cmocka_unit_test(a_batch_mixing_dtypes_is_copied_and_still_right),
      cmocka_unit_test(a_batch_behind_unsent_bytes_is_copied),
      cmocka_unit_test(a_connection_closed_mid_batch_answer_releases_its_pins),
      cmocka_unit_test(a_server_stopped_mid_batch_answer_releases_its_pins),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
