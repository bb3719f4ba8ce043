/*
 * test_dataplane — the data plane end to end, in one process: shard cores
 * created here, each served by a dp_server on 127.0.0.1 port 0, driven by
 * dp_client (and by raw sockets where a test needs a misbehaving peer).
 *
 * The reference for every answer is a second core per shard, driven directly
 * with the same calls: a push or pull over the wire must get the status (and
 * the core's own message) that the core gives, and after every step the
 * pieces pulled over the wire must be bit-identical to core_read on the
 * reference. Batches (PUSH_BATCH, PULL_BATCH) are held to the same
 * reference piece by piece.
 *
 * cmocka's assertions run on the test thread only: client callbacks record
 * what they saw under a lock and the test thread checks it. Waits for an
 * event poll its condition with a bound of WAIT_MS; nothing sleeps in the
 * hope that something happened.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "common/net/auth.h"
#include "common/net/dp_client.h"
#include "common/net/wire.h"
#include "server/core/core.h"
#include "server/transport/dp/dp_server.h"

#define NSHARDS 2u
#define W 2u
#define M 2u
#define WAIT_MS 20000u

/* ------------------------------------------------------------------ fixture */

typedef struct tensor_def {
  const char *name;
  uint64_t numel;
  uint32_t group;
} tensor_def;

/* Split threshold 1024: w0, w1 and big are split over both shards, the small
 * ones placed whole. big's slices are 64 Ki fp32 elements (256 KiB). */
static const tensor_def k_tensors[] = {
    {"w0", 5000, 0}, {"b0", 37, 1}, {"w1", 3000, 0}, {"n1", 17, 1}, {"big", 131072, 0},
};
#define NT (sizeof k_tensors / sizeof k_tensors[0])
#define BIG_TENSOR 4u

typedef struct fixture {
  spec sp;
  layout lay;
  uint64_t hash;
  core *dpc[NSHARDS]; /* served by the data plane */
  core *ref[NSHARDS]; /* driven directly */
  dp_server *srv[NSHARDS];
  dp_client *cli[NSHARDS];
  int port[NSHARDS];
} fixture;

static fixture fx;

/* Server settings of the next setup; tests that need others change them
 * through their own setup function. */
static dp_server_config g_srv_cfg;
/* The token the fixture's clients present (NULL: none). */
static const char *g_cli_token;

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

static float rnd(uint64_t *s) {
  return ((float)(splitmix(s) >> 40) / (float)(1u << 24) * 2.0f - 1.0f);
}

static void build_spec(spec *s) {
  memset(s, 0, sizeof *s);
  s->job = strdup("dataplane-test");
  s->num_groups = 2;
  s->groups = calloc(2, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s->groups[1], ZS_OPTIM_SGD);
  s->groups[1].momentum = 0.9;
  s->num_tensors = NT;
  s->tensors = calloc(NT, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < NT; t++) {
    s->tensors[t].name = strdup(k_tensors[t].name);
    s->tensors[t].numel = k_tensors[t].numel;
    s->tensors[t].group = k_tensors[t].group;
  }
  s->world_size = W;
  s->grad_accum = M;
  s->num_shards = NSHARDS;
  s->split_threshold = 1024;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256] = "";
  assert_int_equal(spec_validate(s, err, sizeof err), 0);
}

static void open_core(core **c, uint32_t shard) {
  core_config cc = {.shard_id = shard, .num_shards = NSHARDS, .threads = 1};
  assert_int_equal(core_create(&cc, c), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(*c, &fx.sp, &r, err, sizeof err), 0);
}

static int setup_with(void **state) {
  (void)state;
  memset(&fx, 0, sizeof fx);
  build_spec(&fx.sp);
  fx.hash = spec_hash(&fx.sp);
  assert_int_equal(layout_build(&fx.sp, &fx.lay), 0);
  uint64_t seed = 12345;
  for (uint32_t i = 0; i < NSHARDS; i++) {
    open_core(&fx.dpc[i], i);
    open_core(&fx.ref[i], i);
  }
  /* Identical initial weights on both cores of each shard. */
  for (uint32_t p = 0; p < fx.lay.num_pieces; p++) {
    const layout_piece *lp = &fx.lay.pieces[p];
    float *w = malloc(lp->numel * sizeof(float));
    assert_non_null(w);
    for (uint64_t e = 0; e < lp->numel; e++)
      w[e] = rnd(&seed) * 0.1f;
    int written = 0;
    uint64_t version = 0;
    char err[256] = "";
    size_t nb = lp->numel * sizeof(float);
    assert_int_equal(core_init_params(fx.dpc[lp->shard], fx.hash, lp->tensor, lp->slice, w, nb,
                                      &written, &version, err, sizeof err),
                     0);
    assert_int_equal(core_init_params(fx.ref[lp->shard], fx.hash, lp->tensor, lp->slice, w, nb,
                                      &written, &version, err, sizeof err),
                     0);
    free(w);
  }
  for (uint32_t i = 0; i < NSHARDS; i++) {
    dp_server_config sc = g_srv_cfg;
    sc.listen = "127.0.0.1:0";
    sc.core = fx.dpc[i];
    char err[256] = "";
    int rc = dp_server_start(&sc, &fx.srv[i], err, sizeof err);
    if (rc)
      fail_msg("dp_server_start: %s", err);
    fx.port[i] = dp_server_port(fx.srv[i]);
    assert_true(fx.port[i] > 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", fx.port[i]);
    dp_client_config cc = {.addr = addr, .connections = 1 + i, .token = g_cli_token};
    rc = dp_client_open(&cc, &fx.cli[i], err, sizeof err);
    if (rc)
      fail_msg("dp_client_open: %s", err);
  }
  return 0;
}

static int setup_default(void **state) {
  dp_server_config_init(&g_srv_cfg);
  g_cli_token = NULL;
  return setup_with(state);
}

static int teardown(void **state) {
  (void)state;
  for (uint32_t i = 0; i < NSHARDS; i++) {
    dp_client_close(fx.cli[i]);
    dp_server_stop(fx.srv[i]);
    core_destroy(fx.dpc[i]);
    core_destroy(fx.ref[i]);
  }
  layout_free(&fx.lay);
  spec_free(&fx.sp);
  return 0;
}

/* ------------------------------------------------------------------ helpers */

static const layout_piece *piece(uint32_t tensor, uint32_t slice) {
  const layout_piece *p = layout_find(&fx.lay, tensor, slice);
  assert_non_null(p);
  return p;
}

/* Polls cond(arg) until it holds or WAIT_MS pass; returns whether it held. */
static int wait_until(int (*cond)(void *), void *arg) {
  uint64_t end = clock_now_ms() + WAIT_MS;
  while (!cond(arg)) {
    if (clock_now_ms() > end)
      return 0;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return 1;
}

/* The gradient of contribution (step, rank, micro) for a piece, in dtype:
 * deterministic, so that both cores get the same bytes. Caller frees. */
static void *gradient(const layout_piece *p, uint64_t step, uint32_t rank, uint32_t micro,
                      zs_dtype dtype, size_t *nbytes) {
  uint64_t seed = step * 1000003u + rank * 7919u + micro * 104729u + p->tensor * 31u + p->slice;
  float *f = malloc(p->numel * sizeof(float));
  assert_non_null(f);
  for (uint64_t e = 0; e < p->numel; e++)
    f[e] = rnd(&seed);
  *nbytes = p->numel * zs_dtype_size(dtype);
  void *out = malloc(*nbytes);
  assert_non_null(out);
  dtype_from_f32(dtype, f, out, p->numel);
  free(f);
  return out;
}

static core_push_args push_args(const layout_piece *p, uint64_t step, uint32_t rank, uint32_t micro,
                                zs_dtype dtype, const void *data, size_t nb) {
  return (core_push_args){.hash = fx.hash,
                          .step = step,
                          .rank = rank,
                          .micro = micro,
                          .tensor = p->tensor,
                          .slice = p->slice,
                          .dtype = dtype,
                          .data = data,
                          .nbytes = nb};
}

static dp_push_args dp_push_of(const core_push_args *a) {
  return (dp_push_args){.spec_hash = a->hash,
                        .step = a->step,
                        .rank = a->rank,
                        .micro = a->micro,
                        .tensor = a->tensor,
                        .slice = a->slice,
                        .dtype = a->dtype,
                        .data = a->data,
                        .nbytes = a->nbytes,
                        .timeout_ms = WAIT_MS};
}

/* Pushes `a` to shard `shard` over the wire and to the reference core, and
 * checks that both give the same status, duplicate flag and (when
 * same_message) message. Returns the status. */
static int push_both(uint32_t shard, const core_push_args *a, int same_message) {
  char e1[DP_ERRLEN] = "", e2[256] = "";
  int d1 = 0, d2 = 0;
  dp_push_args da = dp_push_of(a);
  int r1 = dp_client_push_sync(fx.cli[shard], &da, &d1, e1, sizeof e1);
  int r2 = core_push(fx.ref[shard], a, &d2, e2, sizeof e2);
  if (r1 != r2 || d1 != d2 || (same_message && r1 != 0 && strcmp(e1, e2) != 0))
    fail_msg("push (step %" PRIu64 " rank %u micro %u tensor %u slice %u): wire %s dup %d \"%s\", "
             "core %s dup %d \"%s\"",
             a->step, a->rank, a->micro, a->tensor, a->slice, zs_err_name(r1), d1, e1,
             zs_err_name(r2), d2, e2);
  return r1;
}

/* Every contribution of step `step` to every piece, in reverse contribution
 * order (so that the core holds early ones), with gradient dtypes varying by
 * rank, over the wire and directly. */
static void push_step(uint64_t step) {
  static const zs_dtype dts[] = {ZS_DTYPE_BF16, ZS_DTYPE_FP32, ZS_DTYPE_FP16};
  for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
    const layout_piece *p = &fx.lay.pieces[i];
    for (int k = (int)(W * M) - 1; k >= 0; k--) {
      uint32_t micro = (uint32_t)k / W, rank = (uint32_t)k % W;
      zs_dtype dt = dts[(rank + step) % 3];
      size_t nb = 0;
      void *g = gradient(p, step, rank, micro, dt, &nb);
      core_push_args a = push_args(p, step, rank, micro, dt, g, nb);
      assert_int_equal(push_both(p->shard, &a, 1), 0);
      free(g);
    }
  }
}

typedef struct event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int fired, status;
  core_stats_result stats;
  core_apply_result apply;
} event;

static void on_stats(void *arg, int status, const core_stats_result *r) {
  event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->stats = *r;
  e->status = status;
  e->fired = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static void on_apply(void *arg, int status, const core_apply_result *r) {
  event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->apply = *r;
  e->status = status;
  e->fired = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static int event_wait(event *e) {
  pthread_mutex_lock(&e->mu);
  while (!e->fired)
    pthread_cond_wait(&e->cv, &e->mu);
  int s = e->status;
  pthread_mutex_unlock(&e->mu);
  return s;
}

/* Statistics then apply of `step` on one core, as a trainer would. */
static void apply_core(core *c, uint64_t step) {
  char err[256] = "";
  event e = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  core_stats_result st;
  int rc = core_grad_stats(c, fx.hash, step, clock_now_ms() + WAIT_MS, on_stats, &e, &st, err,
                           sizeof err);
  if (rc == CORE_PENDING)
    rc = event_wait(&e);
  assert_int_equal(rc, 0);
  event e2 = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  core_apply_result ar;
  rc = core_apply(c, fx.hash, step, 1e-2, 0.5f, 0, on_apply, &e2, &ar, err, sizeof err);
  if (rc == CORE_PENDING)
    rc = event_wait(&e2);
  assert_int_equal(rc, 0);
}

static void apply_all(uint64_t step) {
  for (uint32_t i = 0; i < NSHARDS; i++) {
    apply_core(fx.dpc[i], step);
    apply_core(fx.ref[i], step);
  }
}

/* Pulls every piece in every dtype over the wire and compares the bits and
 * the version with core_read on the reference. */
static void check_pulls_match_reference(uint64_t version) {
  static const zs_dtype dts[] = {ZS_DTYPE_FP32, ZS_DTYPE_FP16, ZS_DTYPE_BF16};
  for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
    const layout_piece *p = &fx.lay.pieces[i];
    for (int d = 0; d < 3; d++) {
      size_t nb = p->numel * zs_dtype_size(dts[d]);
      void *a = malloc(nb), *b = malloc(nb);
      assert_true(a && b);
      memset(a, 0xEE, nb);
      dp_pull_args pa = {.spec_hash = fx.hash,
                         .min_version = version,
                         .tensor = p->tensor,
                         .slice = p->slice,
                         .dtype = dts[d],
                         .dst = a,
                         .nbytes = nb,
                         .timeout_ms = WAIT_MS};
      char err[DP_ERRLEN] = "";
      uint64_t v1 = 0, v2 = 0;
      int rc = dp_client_pull_sync(fx.cli[p->shard], &pa, &v1, err, sizeof err);
      if (rc)
        fail_msg("pull tensor %u slice %u: %s %s", p->tensor, p->slice, zs_err_name(rc), err);
      assert_int_equal(core_read(fx.ref[p->shard], fx.hash, p->tensor, p->slice, dts[d], b, nb, &v2,
                                 err, sizeof err),
                       0);
      assert_int_equal(v1, version);
      assert_int_equal(v2, version);
      if (memcmp(a, b, nb) != 0)
        fail_msg("tensor %u slice %u dtype %d differs from the core's", p->tensor, p->slice,
                 dts[d]);
      free(a);
      free(b);
    }
  }
}

/* -------------------------------------------------------------- raw peers */

/* A TCP connection to the port from source address `src` (127.0.0.x),
 * nothing sent yet; rcvbuf > 0 shrinks its receive buffer first. */
static int raw_connect_from(int port, const char *src, int rcvbuf) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  if (rcvbuf > 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  struct sockaddr_in b = {.sin_family = AF_INET};
  assert_int_equal(inet_pton(AF_INET, src, &b.sin_addr), 1);
  assert_int_equal(bind(fd, (struct sockaddr *)&b, sizeof b), 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  /* Every blocking read is bounded. */
  struct timeval tv = {.tv_sec = WAIT_MS / 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

static void raw_send(int fd, const void *p, size_t n) {
  const unsigned char *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    assert_true(w > 0);
    b += w;
    n -= (size_t)w;
  }
}

/* Sends a HELLO with `token` (NULL: none). */
static void raw_send_hello(int fd, const char *token) {
  unsigned char f[WIRE_HEADER_SIZE + WIRE_MAX_HELLO_META];
  wire_msg m = {.type = WIRE_HELLO, .request_id = 1};
  m.u.hello.token = (const uint8_t *)token;
  m.u.hello.token_len = token ? (uint32_t)strlen(token) : 0;
  size_t len = 0;
  assert_int_equal(wire_encode(&m, f, sizeof f, &len), 0);
  raw_send(fd, f, len);
}

/* Authenticates a fresh connection: HELLO, then its HELLO_ACK (exactly one
 * header: nothing else is sent before it). */
static void raw_hello(int fd, const char *token) {
  raw_send_hello(fd, token);
  unsigned char h[WIRE_HEADER_SIZE];
  assert_int_equal(recv(fd, h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
  wire_header hd;
  assert_int_equal(wire_decode_header(h, 0, &hd, NULL, 0), 0);
  assert_int_equal(hd.type, WIRE_HELLO_ACK);
}

/* A connection from 127.0.0.1, authenticated with no token. */
static int raw_connect(int port) {
  int fd = raw_connect_from(port, "127.0.0.1", 0);
  raw_hello(fd, NULL);
  return fd;
}

/* A raw peer's side of a connection: a socket, a reader and what was
 * received but not yet decoded. */
typedef struct raw_conn {
  int fd;
  wire_reader r;
  size_t off, len;
  unsigned char buf[64 << 10];
} raw_conn;

static raw_conn *raw_open(int port) {
  raw_conn *c = calloc(1, sizeof *c);
  assert_non_null(c);
  c->fd = raw_connect(port);
  wire_reader_init(&c->r, 0);
  return c;
}

static void raw_close(raw_conn *c) {
  close(c->fd);
  wire_reader_free(&c->r);
  free(c);
}

/* Reads one frame into *m (its payload into `payload` if it fits in cap,
 * else skipped). Returns 0, 1 on a clean end of stream, -1 on a broken
 * stream, a receive error or a payload CRC mismatch. */
static int raw_read_frame(raw_conn *c, wire_msg *m, void *payload, size_t cap) {
  wire_event ev = WIRE_EV_NONE;
  for (;;) {
    if (ev == WIRE_EV_NONE && c->off == c->len) {
      ssize_t n = recv(c->fd, c->buf, sizeof c->buf, 0);
      if (n == 0)
        return wire_reader_mid_frame(&c->r) ? -1 : 1;
      if (n < 0)
        return -1;
      c->off = 0;
      c->len = (size_t)n;
    }
    c->off += wire_reader_feed(&c->r, c->buf + c->off, c->len - c->off, &ev);
    if (ev == WIRE_EV_FATAL)
      return -1;
    if (ev == WIRE_EV_META) {
      int keep = payload && c->r.meta_status == 0 && c->r.msg.payload_len <= cap;
      wire_reader_set_payload(&c->r, keep ? payload : NULL);
    } else if (ev == WIRE_EV_DONE) {
      *m = c->r.msg;
      return c->r.payload_status == 0 ? 0 : -1;
    }
  }
}

/* Encodes a frame into out (header + meta + payload); returns its length. */
static size_t raw_frame(unsigned char *out, size_t cap, wire_msg *m, const void *payload,
                        size_t plen) {
  m->payload_len = plen;
  m->payload_crc = plen ? crc32c(0, payload, plen) : 0;
  size_t len = 0;
  assert_int_equal(wire_encode(m, out, cap, &len), 0);
  assert_true(len + plen <= cap);
  if (plen)
    memcpy(out + len, payload, plen);
  return len + plen;
}

static dp_server_stats stats_of(uint32_t shard) {
  dp_server_stats s;
  dp_server_get_stats(fx.srv[shard], &s);
  return s;
}

static int mid_frame_is_2(void *arg) {
  (void)arg;
  return stats_of(0).mid_frame == 2;
}

static int stalled_closed_is_2(void *arg) {
  (void)arg;
  return stats_of(0).stalled_closed == 2;
}

static int a_pull_waits(void *arg) {
  (void)arg;
  return stats_of(0).pulls_waiting == 1;
}

static int paused_is_1(void *arg) {
  (void)arg;
  return stats_of(0).paused == 1;
}

static int paused_is_0(void *arg) {
  (void)arg;
  return stats_of(0).paused == 0;
}

/* A first piece owned by shard 0 and one owned by shard 1. */
static const layout_piece *piece_on(uint32_t shard) {
  for (uint32_t i = 0; i < fx.lay.num_pieces; i++)
    if (fx.lay.pieces[i].shard == shard)
      return &fx.lay.pieces[i];
  fail_msg("no piece on shard %u", shard);
  return NULL;
}

/* ------------------------------------------------------------ semantics */

static void pushes_and_pulls_over_the_wire_match_the_core_driven_directly(void **state) {
  (void)state;
  check_pulls_match_reference(0);
  for (uint64_t step = 1; step <= 2; step++) {
    push_step(step);
    apply_all(step);
    check_pulls_match_reference(step);
  }
  /* Every push and pull went through the servers. */
  core_counters k;
  core_get_counters(fx.dpc[0], &k);
  assert_true(k.pushes > 0 && k.pulls > 0);
}

static void refused_pushes_get_the_cores_status_and_message_and_change_nothing(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0), *other = piece_on(1);
  size_t nb = 0;
  void *g = gradient(p, 1, 0, 0, ZS_DTYPE_FP32, &nb);
  uint32_t missing = core_missing(fx.dpc[0], 1, NULL, 0);
  assert_true(missing > 0);
  struct {
    const char *what;
    core_push_args a;
    int status;
  } cases[] = {
      {"wrong spec hash", push_args(p, 1, 0, 0, ZS_DTYPE_FP32, g, nb), ZS_EHASH},
      {"step beyond the next", push_args(p, 3, 0, 0, ZS_DTYPE_FP32, g, nb), ZS_ESTEP},
      {"step 0", push_args(p, 0, 0, 0, ZS_DTYPE_FP32, g, nb), ZS_ESTEP},
      {"rank out of range", push_args(p, 1, W, 0, ZS_DTYPE_FP32, g, nb), ZS_ERANGE},
      {"micro out of range", push_args(p, 1, 0, M, ZS_DTYPE_FP32, g, nb), ZS_ERANGE},
      {"no such tensor", push_args(p, 1, 0, 0, ZS_DTYPE_FP32, g, nb), ZS_ENOTFOUND},
      {"piece of another shard", push_args(other, 1, 0, 0, ZS_DTYPE_FP32, g, nb), ZS_ENOTFOUND},
      {"payload too short", push_args(p, 1, 0, 0, ZS_DTYPE_FP32, g, nb - 4), ZS_ESIZE},
      {"payload in another dtype's size", push_args(p, 1, 0, 0, ZS_DTYPE_BF16, g, nb), ZS_ESIZE},
  };
  cases[0].a.hash ^= 1;
  cases[5].a.tensor = NT + 3;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int rc = push_both(0, &cases[i].a, 1);
    if (rc != cases[i].status)
      fail_msg("%s: %s, expected %s", cases[i].what, zs_err_name(rc), zs_err_name(cases[i].status));
    assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), missing);
  }
  /* A longer payload than the piece is refused without being stored. */
  void *longer = calloc(1, nb + 64);
  assert_non_null(longer);
  memcpy(longer, g, nb);
  core_push_args a = push_args(p, 1, 0, 0, ZS_DTYPE_FP32, longer, nb + 64);
  assert_int_equal(push_both(0, &a, 1), ZS_ESIZE);
  free(longer);
  /* A dtype that is not ours is refused by the client before sending. */
  dp_push_args bad = dp_push_of(&cases[1].a);
  bad.dtype = (zs_dtype)0;
  assert_int_equal(dp_client_push_sync(fx.cli[0], &bad, NULL, NULL, 0), ZS_EINVAL);
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), missing);
  core_counters k1, k2;
  core_get_counters(fx.dpc[0], &k1);
  core_get_counters(fx.ref[0], &k2);
  assert_int_equal(k1.rejected, k2.rejected);
  assert_int_equal(k1.pushes, 0);
  free(g);
  /* The step still completes and matches the reference. */
  push_step(1);
  apply_all(1);
  check_pulls_match_reference(1);
}

static void a_dtype_that_is_not_ours_is_refused_by_the_server_with_edtype(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  raw_conn *rc = raw_open(fx.port[0]);
  int fd = rc->fd;
  unsigned char f[WIRE_MAX_ENCODED + 64];
  wire_msg m = {.type = WIRE_PUSH, .request_id = 5};
  m.u.push = (wire_push){
      .spec_hash = fx.hash, .step = 1, .tensor = p->tensor, .slice = p->slice, .dtype = 0};
  raw_send(fd, f, raw_frame(f, sizeof f, &m, "abcdefgh", 8));
  m = (wire_msg){.type = WIRE_PULL, .request_id = 6};
  m.u.pull = (wire_pull){.spec_hash = fx.hash, .tensor = p->tensor, .slice = p->slice, .dtype = 9};
  raw_send(fd, f, raw_frame(f, sizeof f, &m, NULL, 0));
  for (uint64_t id = 5; id <= 6; id++) {
    wire_msg ans;
    assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
    assert_int_equal(ans.type, WIRE_ERROR);
    assert_int_equal(ans.request_id, id);
    assert_int_equal(ans.u.error.status, ZS_EDTYPE);
    assert_non_null(strstr(ans.u.error.message, "not FP32, FP16, BF16 or INT8_BLOCK"));
  }
  raw_close(rc);
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), core_missing(fx.ref[0], 1, NULL, 0));
}

static void a_repeated_push_is_acknowledged_as_a_duplicate_and_added_once(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  size_t nb = 0;
  void *g = gradient(p, 1, 1, 1, ZS_DTYPE_BF16, &nb);
  core_push_args a = push_args(p, 1, 1, 1, ZS_DTYPE_BF16, g, nb);
  dp_push_args da = dp_push_of(&a);
  int dup = -1;
  assert_int_equal(dp_client_push_sync(fx.cli[0], &da, &dup, NULL, 0), 0);
  assert_int_equal(dup, 0);
  assert_int_equal(dp_client_push_sync(fx.cli[0], &da, &dup, NULL, 0), 0);
  assert_int_equal(dup, 1);
  /* The reference gets it once; push_step then repeats it on both. */
  assert_int_equal(core_push(fx.ref[0], &a, &dup, NULL, 0), 0);
  push_step(1);
  apply_all(1);
  check_pulls_match_reference(1);
  /* A push for a step already applied is a late retry: a duplicate. */
  assert_int_equal(push_both(0, &a, 1), 0);
  assert_int_equal(dp_client_push_sync(fx.cli[0], &da, &dup, NULL, 0), 0);
  assert_int_equal(dup, 1);
  core_counters k;
  core_get_counters(fx.dpc[0], &k);
  assert_int_equal(k.duplicate_pushes, 4);
  free(g);
  check_pulls_match_reference(1);
}

static void refused_pulls_get_clear_statuses(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0), *other = piece_on(1);
  size_t nb = p->numel * sizeof(float);
  float *dst = malloc(nb + 16);
  assert_non_null(dst);
  dp_pull_args base = {.spec_hash = fx.hash,
                       .tensor = p->tensor,
                       .slice = p->slice,
                       .dtype = ZS_DTYPE_FP32,
                       .dst = dst,
                       .nbytes = nb,
                       .timeout_ms = WAIT_MS};
  char err[DP_ERRLEN] = "";
  dp_pull_args a = base;
  a.spec_hash ^= 0x10;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &a, NULL, err, sizeof err), ZS_EHASH);
  assert_non_null(strstr(err, "is not the hash of this shard's job"));
  a = base;
  a.tensor = other->tensor;
  a.slice = other->slice;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &a, NULL, err, sizeof err), ZS_ENOTFOUND);
  assert_non_null(strstr(err, "on this shard"));
  a = base;
  a.nbytes = nb + 16;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &a, NULL, err, sizeof err), ZS_ESIZE);
  assert_non_null(strstr(err, "the destination"));
  /* A version that does not come within the timeout. */
  a = base;
  a.min_version = 2;
  a.timeout_ms = 50;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &a, NULL, err, sizeof err), ZS_ETIMEDOUT);
  assert_non_null(strstr(err, "timed out waiting for version 2"));
  /* One further ahead than a wait may be is refused at once. */
  a.min_version = 5;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &a, NULL, err, sizeof err), ZS_ERANGE);
  assert_non_null(strstr(err, "at most 2 versions past"));
  /* And the connection is still good. */
  uint64_t v = 99;
  assert_int_equal(dp_client_pull_sync(fx.cli[0], &base, &v, err, sizeof err), 0);
  assert_int_equal(v, 0);
  free(dst);
}

typedef struct pull_rec {
  pthread_mutex_t mu;
  int done, status;
  uint64_t version;
} pull_rec;

static void on_pull_done(void *arg, const dp_result *r) {
  pull_rec *p = arg;
  pthread_mutex_lock(&p->mu);
  p->done = 1;
  p->status = r->status;
  p->version = r->version;
  pthread_mutex_unlock(&p->mu);
}

static int rec_done(void *arg) {
  pull_rec *p = arg;
  pthread_mutex_lock(&p->mu);
  int d = p->done;
  pthread_mutex_unlock(&p->mu);
  return d;
}

static void a_pull_waits_for_its_version_and_then_returns_it(void **state) {
  (void)state;
  const layout_piece *p = piece(BIG_TENSOR, 0);
  size_t nb = p->numel * sizeof(uint16_t);
  void *dst = malloc(nb), *want = malloc(nb);
  assert_true(dst && want);
  pull_rec rec = {.mu = PTHREAD_MUTEX_INITIALIZER};
  dp_pull_args a = {.spec_hash = fx.hash,
                    .min_version = 1,
                    .tensor = p->tensor,
                    .slice = p->slice,
                    .dtype = ZS_DTYPE_BF16,
                    .dst = dst,
                    .nbytes = nb,
                    .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_pull(fx.cli[p->shard], &a, on_pull_done, &rec), 0);
  assert_true(wait_until(a_pull_waits, NULL));
  /* Version 1 cannot exist before the apply below. */
  assert_false(rec_done(&rec));
  push_step(1);
  apply_all(1);
  assert_true(wait_until(rec_done, &rec));
  assert_int_equal(rec.status, 0);
  assert_int_equal(rec.version, 1);
  uint64_t v = 0;
  assert_int_equal(core_read(fx.ref[p->shard], fx.hash, p->tensor, p->slice, ZS_DTYPE_BF16, want,
                             nb, &v, NULL, 0),
                   0);
  assert_memory_equal(dst, want, nb);
  assert_int_equal(stats_of(0).pulls_waiting, 0);
  free(dst);
  free(want);
}

/* What a_pull_overtakes_pushes_waiting_to_be_written saw. */
typedef struct order_rec {
  pthread_mutex_t mu;
  uint32_t pushes_done, pushes_failed, pushes_before_pull;
  int pull_done, pull_status;
} order_rec;

#define ORDER_PUSHES 800u
/* How many of them may be answered before the pull at most. Ahead of the
 * pull are what the client holds unsent (DPC_UNSENT_MAX, 1 MiB), the
 * client's socket buffer (tcp_wmem, up to 4 MiB here) and the server's,
 * which autotunes up to tcp_rmem's maximum (32 MiB on the CI machine):
 * about 37 MiB, 296 pushes of 128 KiB, and the server's pushes in flight.
 * Half of the pushes (100 MiB in all) left too little room for that once
 * under ASan on a loaded machine (CI, 2026-12-03: the pull came after 400
 * or more); sent in submission order the pull would come after all 800. */
#define ORDER_PUSHES_BEFORE_PULL_MAX (ORDER_PUSHES - ORDER_PUSHES / 8)

static void on_order_push(void *arg, const dp_result *r) {
  order_rec *o = arg;
  pthread_mutex_lock(&o->mu);
  if (r->status == 0)
    o->pushes_done++;
  else
    o->pushes_failed++;
  pthread_mutex_unlock(&o->mu);
}

static void on_order_pull(void *arg, const dp_result *r) {
  order_rec *o = arg;
  pthread_mutex_lock(&o->mu);
  o->pull_done = 1;
  o->pull_status = r->status;
  o->pushes_before_pull = o->pushes_done;
  pthread_mutex_unlock(&o->mu);
}

static int order_all_done(void *arg) {
  order_rec *o = arg;
  pthread_mutex_lock(&o->mu);
  int done = o->pull_done && o->pushes_done + o->pushes_failed == ORDER_PUSHES;
  pthread_mutex_unlock(&o->mu);
  return done;
}

/* A pipelined step's pulls are sent while its pushes are: a pull submitted
 * behind 100 MiB of pushes is written once a bounded part of them is (the
 * client holds the rest back, DPC_UNSENT_MAX), so its answer arrives while
 * many pushes are still to come (ORDER_PUSHES_BEFORE_PULL_MAX). Sent in submission order, it would
 * be answered after all of them. */
static void a_pull_overtakes_pushes_waiting_to_be_written(void **state) {
  (void)state;
  const layout_piece *p = piece(BIG_TENSOR, 0);
  size_t nb = 0;
  void *g = gradient(p, 1, 0, 0, ZS_DTYPE_BF16, &nb);
  core_push_args a = push_args(p, 1, 0, 0, ZS_DTYPE_BF16, g, nb);
  dp_push_args da = dp_push_of(&a);
  order_rec o = {.mu = PTHREAD_MUTEX_INITIALIZER};
  /* The same contribution each time: the first is added, the rest are
   * duplicates, every one of them carried in full. */
  for (uint32_t i = 0; i < ORDER_PUSHES; i++)
    assert_int_equal(dp_client_push(fx.cli[p->shard], &da, on_order_push, &o), 0);
  void *dst = malloc(nb);
  assert_non_null(dst);
  dp_pull_args q = {.spec_hash = fx.hash,
                    .min_version = 0,
                    .tensor = p->tensor,
                    .slice = p->slice,
                    .dtype = ZS_DTYPE_BF16,
                    .dst = dst,
                    .nbytes = nb,
                    .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_pull(fx.cli[p->shard], &q, on_order_pull, &o), 0);
  assert_true(wait_until(order_all_done, &o));
  assert_int_equal(o.pull_status, 0);
  assert_int_equal(o.pushes_failed, 0);
  assert_true(o.pushes_before_pull < ORDER_PUSHES_BEFORE_PULL_MAX);
  free(dst);
  free(g);
}

/* ----------------------------------------------------------------- batches */

/* What a batch's callback saw, copied for the test thread. */
typedef struct batch_rec {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
  uint64_t version;
  uint32_t npieces;
  int32_t piece_status[WIRE_MAX_BATCH];
  uint8_t piece_dup[WIRE_MAX_BATCH];
  char message[DP_ERRLEN];
} batch_rec;

static void on_batch_rec(void *arg, const dp_result *r) {
  batch_rec *b = arg;
  pthread_mutex_lock(&b->mu);
  b->status = r->status;
  b->version = r->version;
  b->npieces = r->npieces;
  if (r->piece_status) {
    memcpy(b->piece_status, r->piece_status, r->npieces * sizeof r->piece_status[0]);
    memcpy(b->piece_dup, r->piece_duplicate, r->npieces);
  }
  snprintf(b->message, sizeof b->message, "%s", r->message);
  b->done = 1;
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

static int batch_done(void *arg) {
  batch_rec *b = arg;
  pthread_mutex_lock(&b->mu);
  int d = b->done;
  pthread_mutex_unlock(&b->mu);
  return d;
}

static void batch_rec_init(batch_rec *b) {
  memset(b, 0, sizeof *b);
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->cv, NULL);
}

static void batch_rec_wait(batch_rec *b) {
  pthread_mutex_lock(&b->mu);
  while (!b->done)
    pthread_cond_wait(&b->cv, &b->mu);
  pthread_mutex_unlock(&b->mu);
}

/* Pushes pieces[0 .. n) of contribution (step, rank, micro) to `shard` in
 * one batch and, one by one in the same order, to the reference core; checks
 * that every piece got the core's status and duplicate flag. Returns the
 * batch's own status; *rec keeps the answer. */
static int push_batch_both(uint32_t shard, uint64_t hash, uint64_t step, uint32_t rank,
                           uint32_t micro, const dp_batch_piece *pieces, uint32_t n,
                           batch_rec *rec) {
  batch_rec_init(rec);
  dp_push_batch_args a = {.spec_hash = hash,
                          .step = step,
                          .rank = rank,
                          .micro = micro,
                          .pieces = pieces,
                          .npieces = n,
                          .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_push_batch(fx.cli[shard], &a, on_batch_rec, rec), 0);
  batch_rec_wait(rec);
  if (rec->status != 0)
    return rec->status;
  assert_int_equal(rec->npieces, n);
  char first[256] = "";
  for (uint32_t i = 0; i < n; i++) {
    core_push_args c = {.hash = hash,
                        .step = step,
                        .rank = rank,
                        .micro = micro,
                        .tensor = pieces[i].tensor,
                        .slice = pieces[i].slice,
                        .dtype = pieces[i].dtype,
                        .data = pieces[i].data,
                        .nbytes = pieces[i].nbytes};
    char err[256] = "";
    int dup = 0;
    int rc = core_push(fx.ref[shard], &c, &dup, err, sizeof err);
    if (rc != rec->piece_status[i] || (rc == 0 && dup != rec->piece_dup[i]))
      fail_msg("batch piece %u (tensor %u slice %u): wire %s dup %d, core %s dup %d", i,
               pieces[i].tensor, pieces[i].slice, zs_err_name(rec->piece_status[i]),
               rec->piece_dup[i], zs_err_name(rc), dup);
    if (rc != 0 && !first[0])
      snprintf(first, sizeof first, "%s", err);
  }
  /* The batch's message is the first refused piece's, with the core's
   * sentence. */
  if (first[0] && !strstr(rec->message, first))
    fail_msg("batch message \"%s\" does not carry \"%s\"", rec->message, first);
  if (!first[0])
    assert_string_equal(rec->message, "");
  return 0;
}

/* Every contribution of `step`, each (rank, micro) as one batch per shard
 * holding all of that shard's pieces, with the dtypes varying by piece. */
static void push_step_in_batches(uint64_t step) {
  static const zs_dtype dts[] = {ZS_DTYPE_BF16, ZS_DTYPE_FP32, ZS_DTYPE_FP16};
  for (uint32_t shard = 0; shard < NSHARDS; shard++) {
    for (int k = (int)(W * M) - 1; k >= 0; k--) {
      uint32_t micro = (uint32_t)k / W, rank = (uint32_t)k % W;
      dp_batch_piece pcs[16];
      uint32_t n = 0;
      for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
        const layout_piece *p = &fx.lay.pieces[i];
        if (p->shard != shard)
          continue;
        assert_true(n < 16);
        zs_dtype dt = dts[(i + rank + step) % 3];
        size_t nb = 0;
        pcs[n] = (dp_batch_piece){.tensor = p->tensor, .slice = p->slice, .dtype = dt};
        pcs[n].data = gradient(p, step, rank, micro, dt, &nb);
        pcs[n].nbytes = nb;
        n++;
      }
      batch_rec rec;
      assert_int_equal(push_batch_both(shard, fx.hash, step, rank, micro, pcs, n, &rec), 0);
      for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(rec.piece_status[i], 0);
        free((void *)pcs[i].data);
      }
    }
  }
}

/* Pulls every piece of each shard in one batch per dtype and compares each
 * piece's bits and the version with core_read on the reference. */
static void check_batch_pulls_match_reference(uint64_t version) {
  static const zs_dtype dts[] = {ZS_DTYPE_FP32, ZS_DTYPE_FP16, ZS_DTYPE_BF16};
  for (uint32_t shard = 0; shard < NSHARDS; shard++) {
    for (int d = 0; d < 3; d++) {
      dp_batch_piece pcs[16];
      const layout_piece *lp[16];
      uint32_t n = 0;
      size_t total = 0;
      for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
        if (fx.lay.pieces[i].shard != shard)
          continue;
        lp[n] = &fx.lay.pieces[i];
        pcs[n] = (dp_batch_piece){.tensor = lp[n]->tensor,
                                  .slice = lp[n]->slice,
                                  .dtype = dts[d],
                                  .nbytes = lp[n]->numel * zs_dtype_size(dts[d])};
        total += pcs[n].nbytes;
        n++;
      }
      unsigned char *got = malloc(total), *want = malloc(total);
      assert_true(got && want);
      memset(got, 0xEE, total);
      batch_rec rec;
      batch_rec_init(&rec);
      dp_pull_batch_args a = {.spec_hash = fx.hash,
                              .min_version = version,
                              .pieces = pcs,
                              .npieces = n,
                              .dst = got,
                              .timeout_ms = WAIT_MS};
      assert_int_equal(dp_client_pull_batch(fx.cli[shard], &a, on_batch_rec, &rec), 0);
      batch_rec_wait(&rec);
      if (rec.status)
        fail_msg("pull batch of shard %u: %s %s", shard, zs_err_name(rec.status), rec.message);
      assert_int_equal(rec.version, version);
      size_t off = 0;
      for (uint32_t i = 0; i < n; i++) {
        uint64_t v = 0;
        assert_int_equal(core_read(fx.ref[shard], fx.hash, lp[i]->tensor, lp[i]->slice, dts[d],
                                   want + off, pcs[i].nbytes, &v, NULL, 0),
                         0);
        assert_int_equal(v, version);
        off += pcs[i].nbytes;
      }
      if (memcmp(got, want, total) != 0)
        fail_msg("pull batch of shard %u in dtype %d differs from the core's", shard, dts[d]);
      free(got);
      free(want);
    }
  }
}

static void push_and_pull_batches_match_the_core_driven_piece_by_piece(void **state) {
  (void)state;
  check_batch_pulls_match_reference(0);
  for (uint64_t step = 1; step <= 2; step++) {
    push_step_in_batches(step);
    apply_all(step);
    check_batch_pulls_match_reference(step);
    /* Single-piece pulls agree with the batches. */
    check_pulls_match_reference(step);
  }
}

static void a_push_batch_refuses_bad_pieces_one_by_one_and_keeps_the_good_ones(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0), *other = piece_on(1);
  const layout_piece *q = NULL;
  for (uint32_t i = 0; i < fx.lay.num_pieces && !q; i++)
    if (fx.lay.pieces[i].shard == 0 && &fx.lay.pieces[i] != p)
      q = &fx.lay.pieces[i];
  assert_non_null(q);
  size_t nbp = 0, nbq = 0, nbo = 0;
  void *gp = gradient(p, 1, 0, 0, ZS_DTYPE_FP32, &nbp);
  void *gq = gradient(q, 1, 0, 0, ZS_DTYPE_BF16, &nbq);
  void *go = gradient(other, 1, 0, 0, ZS_DTYPE_FP32, &nbo);
  uint32_t missing = core_missing(fx.dpc[0], 1, NULL, 0);

  /* The whole batch refused (wrong hash, wrong step, rank out of range):
   * every piece gets the core's status and nothing changes. */
  dp_batch_piece good[2] = {
      {.tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_FP32, .data = gp, .nbytes = nbp},
      {.tensor = q->tensor, .slice = q->slice, .dtype = ZS_DTYPE_BF16, .data = gq, .nbytes = nbq},
  };
  batch_rec rec;
  assert_int_equal(push_batch_both(0, fx.hash ^ 1, 1, 0, 0, good, 2, &rec), 0);
  assert_int_equal(rec.piece_status[0], ZS_EHASH);
  assert_int_equal(rec.piece_status[1], ZS_EHASH);
  assert_non_null(strstr(rec.message, "piece 0 (tensor"));
  assert_int_equal(push_batch_both(0, fx.hash, 3, 0, 0, good, 2, &rec), 0);
  assert_int_equal(rec.piece_status[1], ZS_ESTEP);
  assert_int_equal(push_batch_both(0, fx.hash, 1, W, 0, good, 2, &rec), 0);
  assert_int_equal(rec.piece_status[0], ZS_ERANGE);
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), missing);

  /* Mixed: a piece of another shard, a piece whose bytes are one element
   * short, a good piece, the same good piece again, a piece in the size of
   * another dtype, another good piece. */
  dp_batch_piece mixed[6] = {
      {.tensor = other->tensor,
       .slice = other->slice,
       .dtype = ZS_DTYPE_FP32,
       .data = go,
       .nbytes = nbo},
      {.tensor = q->tensor,
       .slice = q->slice,
       .dtype = ZS_DTYPE_BF16,
       .data = gq,
       .nbytes = nbq - 2},
      good[0],
      good[0],
      {.tensor = q->tensor, .slice = q->slice, .dtype = ZS_DTYPE_FP16, .data = gp, .nbytes = nbp},
      good[1],
  };
  assert_int_equal(push_batch_both(0, fx.hash, 1, 0, 0, mixed, 6, &rec), 0);
  assert_int_equal(rec.piece_status[0], ZS_ENOTFOUND);
  assert_int_equal(rec.piece_status[1], ZS_ESIZE);
  assert_int_equal(rec.piece_status[2], 0);
  assert_int_equal(rec.piece_dup[2], 0);
  assert_int_equal(rec.piece_status[3], 0);
  assert_int_equal(rec.piece_dup[3], 1);
  assert_int_equal(rec.piece_status[4], ZS_ESIZE);
  assert_int_equal(rec.piece_status[5], 0);
  assert_non_null(strstr(rec.message, "piece 0 (tensor"));
  /* Exactly the two good contributions arrived, as on the reference. */
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), core_missing(fx.ref[0], 1, NULL, 0));
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), missing - 2);
  /* The whole batch again: every good piece is a duplicate now. */
  assert_int_equal(push_batch_both(0, fx.hash, 1, 0, 0, good, 2, &rec), 0);
  assert_int_equal(rec.piece_dup[0], 1);
  assert_int_equal(rec.piece_dup[1], 1);
  free(gp);
  free(gq);
  free(go);
  /* The step completes and matches the reference. */
  push_step(1);
  apply_all(1);
  check_pulls_match_reference(1);
}

static void a_pull_batch_is_refused_whole_when_one_piece_is_bad(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0), *other = piece_on(1);
  size_t nb = p->numel * sizeof(float);
  unsigned char *dst = malloc(2 * nb + 64);
  assert_non_null(dst);
  dp_batch_piece pcs[2] = {
      {.tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_FP32, .nbytes = nb},
      {.tensor = other->tensor,
       .slice = other->slice,
       .dtype = ZS_DTYPE_FP32,
       .nbytes = other->numel * sizeof(float)},
  };
  dp_pull_batch_args a = {
      .spec_hash = fx.hash, .pieces = pcs, .npieces = 2, .dst = dst, .timeout_ms = WAIT_MS};
  batch_rec rec;
  batch_rec_init(&rec);
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), 0);
  batch_rec_wait(&rec);
  assert_int_equal(rec.status, ZS_ENOTFOUND);
  assert_non_null(strstr(rec.message, "piece 1 of the batch: no piece"));
  /* A size that is not the piece's. */
  pcs[1] = pcs[0];
  pcs[1].nbytes = nb + 4;
  batch_rec_init(&rec);
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), 0);
  batch_rec_wait(&rec);
  assert_int_equal(rec.status, ZS_EINVAL);
  assert_non_null(strstr(rec.message, "not the"));
  /* A wrong hash. */
  pcs[1].nbytes = nb;
  a.spec_hash ^= 4;
  batch_rec_init(&rec);
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), 0);
  batch_rec_wait(&rec);
  assert_int_equal(rec.status, ZS_EHASH);
  /* The client refuses what it cannot frame before sending. */
  a.spec_hash = fx.hash;
  a.npieces = 0;
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), ZS_EINVAL);
  a.npieces = WIRE_MAX_BATCH + 1;
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), ZS_EINVAL);
  /* The same piece twice is fine: both copies, of one version. */
  a.npieces = 2;
  batch_rec_init(&rec);
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), 0);
  batch_rec_wait(&rec);
  assert_int_equal(rec.status, 0);
  assert_int_equal(rec.version, 0);
  assert_memory_equal(dst, dst + nb, nb);
  free(dst);
}

static void a_pull_batch_waits_once_for_its_version(void **state) {
  (void)state;
  dp_batch_piece pcs[16];
  const layout_piece *lp[16];
  uint32_t n = 0;
  size_t total = 0;
  for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
    if (fx.lay.pieces[i].shard != 0)
      continue;
    lp[n] = &fx.lay.pieces[i];
    pcs[n] = (dp_batch_piece){.tensor = lp[n]->tensor,
                              .slice = lp[n]->slice,
                              .dtype = ZS_DTYPE_BF16,
                              .nbytes = lp[n]->numel * 2};
    total += pcs[n++].nbytes;
  }
  unsigned char *got = malloc(total), *want = malloc(total);
  assert_true(got && want);
  batch_rec rec;
  batch_rec_init(&rec);
  dp_pull_batch_args a = {.spec_hash = fx.hash,
                          .min_version = 1,
                          .pieces = pcs,
                          .npieces = n,
                          .dst = got,
                          .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_pull_batch(fx.cli[0], &a, on_batch_rec, &rec), 0);
  /* One wait in the core for the whole batch. */
  assert_true(wait_until(a_pull_waits, NULL));
  assert_false(batch_done(&rec));
  push_step(1);
  apply_all(1);
  batch_rec_wait(&rec);
  assert_int_equal(rec.status, 0);
  assert_int_equal(rec.version, 1);
  size_t off = 0;
  for (uint32_t i = 0; i < n; i++) {
    assert_int_equal(core_read(fx.ref[0], fx.hash, lp[i]->tensor, lp[i]->slice, ZS_DTYPE_BF16,
                               want + off, pcs[i].nbytes, NULL, NULL, 0),
                     0);
    off += pcs[i].nbytes;
  }
  assert_memory_equal(got, want, total);
  free(got);
  free(want);
}

static void a_malformed_push_batch_is_refused_and_the_connection_survives(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  uint32_t missing = core_missing(fx.dpc[0], 1, NULL, 0);
  raw_conn *rc = raw_open(fx.port[0]);
  static unsigned char f[WIRE_MAX_BATCH_ENCODED + 4096];
  static wire_msg m;
  unsigned char payload[64] = {0};
  /* Piece lengths that do not add up to the payload: refused by the decoder
   * with the request id; the payload is skipped. */
  wire_piece pcs[2] = {
      {.tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_FP32, .length = 16},
      {.tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_FP32, .length = 16},
  };
  m = (wire_msg){.type = WIRE_PUSH_BATCH, .request_id = 41};
  m.u.push_batch = (wire_push_batch){.spec_hash = fx.hash, .step = 1, .npieces = 2, .pieces = pcs};
  raw_send(rc->fd, f, raw_frame(f, sizeof f, &m, payload, sizeof payload));
  /* Pieces of no bytes at all are contributions without a gradient (the
   * same one twice: the second is a duplicate). */
  m.request_id = 42;
  pcs[0].length = 0;
  pcs[1].length = 0;
  raw_send(rc->fd, f, raw_frame(f, sizeof f, &m, NULL, 0));
  wire_msg ping = {.type = WIRE_PING, .request_id = 43};
  raw_send(rc->fd, f, raw_frame(f, sizeof f, &ping, NULL, 0));
  static wire_msg ans;
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_ERROR);
  assert_int_equal(ans.request_id, 41);
  assert_int_equal(ans.u.error.status, ZS_ERANGE);
  assert_non_null(strstr(ans.u.error.message, "pieces add up to 32 bytes but the payload has 64"));
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_PUSH_BATCH_ACK);
  assert_int_equal(ans.request_id, 42);
  assert_int_equal(ans.u.push_batch_ack.npieces, 2);
  assert_int_equal(ans.u.push_batch_ack.status[0], 0);
  assert_int_equal(ans.u.push_batch_ack.status[1], 0);
  assert_int_equal(ans.u.push_batch_ack.duplicate[0], 0);
  assert_int_equal(ans.u.push_batch_ack.duplicate[1], 1);
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_PONG);
  assert_int_equal(ans.request_id, 43);
  raw_close(rc);
  /* Only the empty contribution was taken. */
  assert_int_equal(core_missing(fx.dpc[0], 1, NULL, 0), missing - 1);
}

/* -------------------------------------------------------------- pipelining */

typedef struct batch {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int outstanding, failures;
  char first_error[DP_ERRLEN];
} batch;

static void on_batch_done(void *arg, const dp_result *r) {
  batch *b = arg;
  pthread_mutex_lock(&b->mu);
  if (r->status != 0 && b->failures++ == 0)
    snprintf(b->first_error, sizeof b->first_error, "%s: %s", zs_err_name(r->status), r->message);
  if (--b->outstanding == 0)
    pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

typedef struct submitter {
  batch *b;
  uint32_t rank;              /* this thread pushes the contributions of one rank */
  void **bufs;                /* [piece * M + micro], owned by the test */
  void *pull_dst[NSHARDS];    /* one per shard: each client has its own loop thread */
  size_t pull_bytes[NSHARDS]; /* big's slice on each shard, in fp32 */
} submitter;

/* A trainer thread: every contribution of its rank, each followed by a pull
 * of version 0, all without waiting. */
static void *submit_thread(void *arg) {
  submitter *s = arg;
  for (uint32_t i = 0; i < fx.lay.num_pieces; i++) {
    const layout_piece *p = &fx.lay.pieces[i];
    for (uint32_t micro = 0; micro < M; micro++) {
      dp_push_args a = {.spec_hash = fx.hash,
                        .step = 1,
                        .rank = s->rank,
                        .micro = micro,
                        .tensor = p->tensor,
                        .slice = p->slice,
                        .dtype = ZS_DTYPE_FP16,
                        .data = s->bufs[i * M + micro],
                        .nbytes = p->numel * 2,
                        .timeout_ms = WAIT_MS};
      pthread_mutex_lock(&s->b->mu);
      s->b->outstanding += 2;
      pthread_mutex_unlock(&s->b->mu);
      if (dp_client_push(fx.cli[p->shard], &a, on_batch_done, s->b) != 0)
        on_batch_done(s->b, &(dp_result){.status = ZS_EINTERNAL, .message = "submit"});
      dp_pull_args q = {.spec_hash = fx.hash,
                        .tensor = BIG_TENSOR,
                        .slice = p->shard,
                        .dtype = ZS_DTYPE_FP32,
                        .dst = s->pull_dst[p->shard],
                        .nbytes = s->pull_bytes[p->shard],
                        .timeout_ms = WAIT_MS};
      if (dp_client_pull(fx.cli[p->shard], &q, on_batch_done, s->b) != 0)
        on_batch_done(s->b, &(dp_result){.status = ZS_EINTERNAL, .message = "submit"});
    }
  }
  return NULL;
}

static void pipelined_requests_from_several_threads_complete_with_their_own_answers(void **state) {
  (void)state;
  batch b = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  submitter subs[W];
  pthread_t th[W];
  for (uint32_t r = 0; r < W; r++) {
    subs[r].b = &b;
    subs[r].rank = r;
    subs[r].bufs = calloc(fx.lay.num_pieces * M, sizeof(void *));
    assert_non_null(subs[r].bufs);
    for (uint32_t i = 0; i < NSHARDS; i++) {
      subs[r].pull_bytes[i] = piece(BIG_TENSOR, i)->numel * 4;
      subs[r].pull_dst[i] = malloc(subs[r].pull_bytes[i]);
      assert_non_null(subs[r].pull_dst[i]);
    }
    for (uint32_t i = 0; i < fx.lay.num_pieces; i++)
      for (uint32_t micro = 0; micro < M; micro++) {
        size_t nb;
        subs[r].bufs[i * M + micro] = gradient(&fx.lay.pieces[i], 1, r, micro, ZS_DTYPE_FP16, &nb);
      }
  }
  /* The outstanding count starts above zero so that it cannot reach zero
   * before every thread has submitted. */
  b.outstanding = 1;
  for (uint32_t r = 0; r < W; r++)
    assert_int_equal(pthread_create(&th[r], NULL, submit_thread, &subs[r]), 0);
  for (uint32_t r = 0; r < W; r++)
    pthread_join(th[r], NULL);
  on_batch_done(&b, &(dp_result){.status = 0, .message = ""});
  pthread_mutex_lock(&b.mu);
  while (b.outstanding > 0)
    pthread_cond_wait(&b.cv, &b.mu);
  pthread_mutex_unlock(&b.mu);
  if (b.failures)
    fail_msg("%d requests failed, first: %s", b.failures, b.first_error);
  /* The same contributions, directly into the reference. */
  for (uint32_t r = 0; r < W; r++)
    for (uint32_t i = 0; i < fx.lay.num_pieces; i++)
      for (uint32_t micro = 0; micro < M; micro++) {
        const layout_piece *p = &fx.lay.pieces[i];
        core_push_args a =
            push_args(p, 1, r, micro, ZS_DTYPE_FP16, subs[r].bufs[i * M + micro], p->numel * 2);
        assert_int_equal(core_push(fx.ref[p->shard], &a, NULL, NULL, 0), 0);
      }
  apply_all(1);
  check_pulls_match_reference(1);
  for (uint32_t r = 0; r < W; r++) {
    for (uint32_t i = 0; i < fx.lay.num_pieces * M; i++)
      free(subs[r].bufs[i]);
    free(subs[r].bufs);
    for (uint32_t i = 0; i < NSHARDS; i++)
      free(subs[r].pull_dst[i]);
  }
}

/* ---------------------------------------------------------- bad peers */

static void a_stalled_peer_does_not_block_other_clients(void **state) {
  (void)state;
  const layout_piece *p = piece(BIG_TENSOR, 0);
  unsigned char *f = malloc(WIRE_MAX_ENCODED + p->numel * 4);
  assert_non_null(f);
  /* Peer A stops inside a header; peer B inside a 256 KiB payload. */
  int a = raw_connect(fx.port[0]);
  int bfd = raw_connect(fx.port[0]);
  wire_msg m = {.type = WIRE_PING, .request_id = 1};
  size_t len = raw_frame(f, WIRE_MAX_ENCODED, &m, NULL, 0);
  raw_send(a, f, len / 2);
  size_t nb = 0;
  void *g = gradient(p, 1, 0, 0, ZS_DTYPE_FP32, &nb);
  m = (wire_msg){.type = WIRE_PUSH, .request_id = 2};
  m.u.push = (wire_push){.spec_hash = fx.hash,
                         .step = 1,
                         .tensor = p->tensor,
                         .slice = p->slice,
                         .dtype = ZS_DTYPE_FP32};
  len = raw_frame(f, WIRE_MAX_ENCODED + nb, &m, g, nb);
  raw_send(bfd, f, len / 2);
  assert_true(wait_until(mid_frame_is_2, NULL));
  /* Meanwhile a whole step goes through for everyone else. */
  push_step(1);
  apply_all(1);
  check_pulls_match_reference(1);
  assert_int_equal(stats_of(0).mid_frame, 2);
  close(a);
  close(bfd);
  free(g);
  free(f);
}

static int setup_short_stall(void **state) {
  dp_server_config_init(&g_srv_cfg);
  g_cli_token = NULL;
  g_srv_cfg.stall_timeout_ms = 200;
  return setup_with(state);
}

static void a_peer_stalled_inside_a_frame_is_disconnected_after_the_stall_timeout(void **state) {
  (void)state;
  int a = raw_connect(fx.port[0]);
  int b = raw_connect(fx.port[0]);
  unsigned char f[WIRE_MAX_ENCODED];
  wire_msg m = {.type = WIRE_PING, .request_id = 1};
  size_t len = raw_frame(f, sizeof f, &m, NULL, 0);
  raw_send(a, f, 10);
  raw_send(b, f, len - 1);
  assert_true(wait_until(stalled_closed_is_2, NULL));
  /* Each sees its connection closed, without an answer. */
  char c;
  assert_int_equal(recv(a, &c, 1, 0), 0);
  assert_int_equal(recv(b, &c, 1, 0), 0);
  close(a);
  close(b);
  /* An idle connection at a frame boundary is not a stall. */
  assert_int_equal(dp_client_ping_sync(fx.cli[0], WAIT_MS, NULL, 0), 0);
}

static void a_corrupt_payload_crc_is_refused_and_the_connection_survives(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  size_t nb = 0;
  void *g = gradient(p, 1, 0, 0, ZS_DTYPE_FP32, &nb);
  unsigned char *f = malloc(WIRE_MAX_ENCODED + nb);
  assert_non_null(f);
  raw_conn *rc = raw_open(fx.port[0]);
  int fd = rc->fd;
  wire_msg m = {.type = WIRE_PUSH, .request_id = 41};
  m.u.push = (wire_push){.spec_hash = fx.hash,
                         .step = 1,
                         .rank = 0,
                         .micro = 0,
                         .tensor = p->tensor,
                         .slice = p->slice,
                         .dtype = ZS_DTYPE_FP32};
  size_t len = raw_frame(f, WIRE_MAX_ENCODED + nb, &m, g, nb);
  f[len - 3] ^= 0x04; /* corrupted in flight */
  raw_send(fd, f, len);
  wire_msg ans;
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_ERROR);
  assert_int_equal(ans.request_id, 41);
  assert_int_equal(ans.u.error.status, ZS_ECRC);
  assert_non_null(strstr(ans.u.error.message, "payload CRC"));
  /* Same connection: a PING, then the intact push, which is new (the corrupt
   * one added nothing). */
  wire_msg ping = {.type = WIRE_PING, .request_id = 42};
  unsigned char pf[WIRE_MAX_ENCODED];
  raw_send(fd, pf, raw_frame(pf, sizeof pf, &ping, NULL, 0));
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_PONG);
  assert_int_equal(ans.request_id, 42);
  m.request_id = 43;
  len = raw_frame(f, WIRE_MAX_ENCODED + nb, &m, g, nb);
  raw_send(fd, f, len);
  assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
  assert_int_equal(ans.type, WIRE_PUSH_ACK);
  assert_int_equal(ans.request_id, 43);
  assert_int_equal(ans.u.push_ack.duplicate, 0);
  assert_int_equal(stats_of(0).crc_errors, 1);
  raw_close(rc);
  free(f);
  free(g);
}

static void a_broken_stream_is_answered_with_request_id_0_and_closed(void **state) {
  (void)state;
  struct {
    const char *what;
    int status;
    const char *needle;
  } cases[] = {
      {"corrupt meta", ZS_ECRC, "header CRC"},
      {"http", ZS_EPROTO, "bad frame magic"},
      {"answer type from a client", ZS_EPROTO, "may send PUSH, PULL or PING"},
      {"oversized payload", ZS_ERANGE, "exceeds this side's limit"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    raw_conn *rc = raw_open(fx.port[0]);
    unsigned char f[WIRE_MAX_ENCODED];
    wire_msg m = {.type = WIRE_PULL, .request_id = 7};
    m.u.pull = (wire_pull){.spec_hash = fx.hash, .dtype = ZS_DTYPE_FP32};
    size_t len = raw_frame(f, sizeof f, &m, NULL, 0);
    if (i == 0) {
      f[WIRE_HEADER_SIZE + 1] ^= 0x20;
    } else if (i == 1) {
      len = (size_t)snprintf((char *)f, sizeof f, "GET / HTTP/1.1\r\nHost: x\r\n\r\n%*s", 20, "");
    } else if (i == 2) {
      m = (wire_msg){.type = WIRE_PUSH_ACK, .request_id = 8};
      len = raw_frame(f, sizeof f, &m, NULL, 0);
    } else {
      /* A 2 GiB payload announced in a well-formed header. */
      m = (wire_msg){.type = WIRE_PUSH, .request_id = 9, .payload_len = UINT64_C(2) << 30};
      m.u.push.dtype = ZS_DTYPE_FP32;
      m.payload_crc = 1;
      assert_int_equal(wire_encode(&m, f, sizeof f, &len), 0);
    }
    raw_send(rc->fd, f, len);
    wire_msg ans;
    assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 0);
    assert_int_equal(ans.type, WIRE_ERROR);
    assert_int_equal(ans.request_id, 0);
    if (ans.u.error.status != cases[i].status || !strstr(ans.u.error.message, cases[i].needle))
      fail_msg("%s: %s \"%s\"", cases[i].what, zs_err_name(ans.u.error.status),
               ans.u.error.message);
    /* Then the server closes. */
    assert_int_equal(raw_read_frame(rc, &ans, NULL, 0), 1);
    raw_close(rc);
  }
  assert_int_equal(stats_of(0).protocol_errors, 4);
  /* Other clients never noticed. */
  assert_int_equal(dp_client_ping_sync(fx.cli[0], WAIT_MS, NULL, 0), 0);
}

static int setup_backpressure(void **state) {
  dp_server_config_init(&g_srv_cfg);
  g_cli_token = NULL;
  g_srv_cfg.max_pending = 8;
  g_srv_cfg.max_queued_bytes = 256u << 10;
  return setup_with(state);
}

static void a_peer_that_does_not_take_its_answers_is_paused_and_others_are_served(void **state) {
  (void)state;
  enum { NPULLS = 200 };
  const layout_piece *p = piece(BIG_TENSOR, 0); /* 256 KiB in fp32 */
  size_t nb = p->numel * 4;
  raw_conn *rc = raw_open(fx.port[0]);
  unsigned char f[WIRE_MAX_ENCODED];
  /* 50 MiB of answers asked for, none read: more than the socket buffers
   * hold, so the server's queue grows past its bound. */
  for (uint64_t id = 1; id <= NPULLS; id++) {
    wire_msg m = {.type = WIRE_PULL, .request_id = id};
    m.u.pull = (wire_pull){
        .spec_hash = fx.hash, .tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_FP32};
    raw_send(rc->fd, f, raw_frame(f, sizeof f, &m, NULL, 0));
  }
  assert_true(wait_until(paused_is_1, NULL));
  /* Everyone else is served meanwhile. */
  push_step(1);
  apply_all(1);
  check_pulls_match_reference(1);
  /* Once the peer reads, every answer arrives, whole and intact. */
  void *buf = malloc(nb);
  assert_non_null(buf);
  int seen[NPULLS + 1] = {0};
  for (int i = 0; i < NPULLS; i++) {
    wire_msg ans;
    assert_int_equal(raw_read_frame(rc, &ans, buf, nb), 0);
    assert_int_equal(ans.type, WIRE_PULL_DATA);
    assert_true(ans.request_id >= 1 && ans.request_id <= NPULLS);
    assert_int_equal(seen[ans.request_id]++, 0);
    assert_int_equal(ans.payload_len, nb);
  }
  /* The server resumes reading once it has seen its last write complete,
   * which may be after the peer read the bytes. */
  assert_true(wait_until(paused_is_0, NULL));
  free(buf);
  raw_close(rc);
}

/* ------------------------------------------------------------ lifecycle */

static void closing_the_client_cancels_its_requests_in_flight(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  size_t nb = p->numel * 4;
  void *dst = malloc(nb);
  assert_non_null(dst);
  pull_rec rec = {.mu = PTHREAD_MUTEX_INITIALIZER};
  dp_pull_args a = {.spec_hash = fx.hash,
                    .min_version = 2, /* as far ahead as a wait may be; never comes */
                    .tensor = p->tensor,
                    .slice = p->slice,
                    .dtype = ZS_DTYPE_FP32,
                    .dst = dst,
                    .nbytes = nb,
                    .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_pull(fx.cli[0], &a, on_pull_done, &rec), 0);
  assert_true(wait_until(a_pull_waits, NULL));
  dp_client_close(fx.cli[0]);
  fx.cli[0] = NULL;
  /* The callback ran before close returned. */
  assert_int_equal(rec.done, 1);
  assert_int_equal(rec.status, ZS_ECANCELED);
  free(dst);
}

static void stopping_the_server_fails_its_connections_and_leaves_waits_to_the_core(void **state) {
  (void)state;
  const layout_piece *p = piece_on(0);
  size_t nb = p->numel * 4;
  void *dst = malloc(nb);
  assert_non_null(dst);
  pull_rec rec = {.mu = PTHREAD_MUTEX_INITIALIZER};
  dp_pull_args a = {.spec_hash = fx.hash,
                    .min_version = 2, /* as far ahead as a wait may be; never comes */
                    .tensor = p->tensor,
                    .slice = p->slice,
                    .dtype = ZS_DTYPE_FP32,
                    .dst = dst,
                    .nbytes = nb,
                    .timeout_ms = WAIT_MS};
  assert_int_equal(dp_client_pull(fx.cli[0], &a, on_pull_done, &rec), 0);
  assert_true(wait_until(a_pull_waits, NULL));
  dp_server_stop(fx.srv[0]);
  fx.srv[0] = NULL;
  assert_true(wait_until(rec_done, &rec));
  assert_int_equal(rec.status, ZS_ECONN);
  /* The wait still registered in the core ends with core_destroy (in the
   * teardown), after the server is gone: it must only free its record. */
  free(dst);
}

/* A server that answers the HELLO and the first PING (so that dp_client_open succeeds) and
 * then reads and answers nothing until its peer leaves. No cmocka assertion
 * here: this is not the test's thread. */
/* A fake server's side of the opening: reads one frame without payload
 * (the HELLO, then the PING) and answers HELLO_ACK or PONG. Returns 0, or
 * -1 when the peer sent something else or left. */
static int fake_answer(int c) {
  unsigned char h[WIRE_HEADER_SIZE];
  if (c < 0 || recv(c, h, sizeof h, MSG_WAITALL) != (ssize_t)sizeof h)
    return -1;
  wire_header hd;
  if (wire_decode_header(h, 0, &hd, NULL, 0) != 0 || hd.payload_len != 0)
    return -1;
  unsigned char meta[WIRE_MAX_HELLO_META];
  if (hd.meta_len > sizeof meta ||
      (hd.meta_len && recv(c, meta, hd.meta_len, MSG_WAITALL) != (ssize_t)hd.meta_len))
    return -1;
  if (hd.type != WIRE_HELLO && hd.type != WIRE_PING)
    return -1;
  wire_msg m = {.type = hd.type == WIRE_HELLO ? WIRE_HELLO_ACK : WIRE_PONG,
                .request_id = hd.request_id};
  unsigned char f[WIRE_MAX_ENCODED];
  size_t len = 0;
  if (wire_encode(&m, f, sizeof f, &len) != 0 || send(c, f, len, MSG_NOSIGNAL) != (ssize_t)len)
    return -1;
  return 0;
}

static void *silent_server(void *arg) {
  int *fds = arg;
  int c = accept(fds[0], NULL, NULL);
  if (fake_answer(c) == 0)
    fake_answer(c);
  /* Swallow whatever comes, answering nothing, until the client leaves. */
  char sink[4096];
  while (c >= 0 && recv(c, sink, sizeof sink, 0) > 0)
    continue;
  fds[1] = c;
  return NULL;
}

/* Answers the first PING, reads 1 MiB of what follows and resets the
 * connection with the rest unread (a shard killed in the middle of a push). */
static void *resetting_server(void *arg) {
  int *fds = arg;
  int c = accept(fds[0], NULL, NULL);
  if (fake_answer(c) == 0)
    fake_answer(c);
  char sink[65536];
  size_t total = 0;
  while (c >= 0 && total < (1u << 20)) {
    ssize_t n = recv(c, sink, sizeof sink, 0);
    if (n <= 0)
      break;
    total += (size_t)n;
  }
  struct linger lg = {.l_onoff = 1, .l_linger = 0};
  if (c >= 0) {
    setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(c);
  }
  return NULL;
}

/* What a push's callback saw on the client's loop thread. */
typedef struct pipe_seen {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status, sigpipe_blocked;
} pipe_seen;

static void on_push_seen(void *arg, const dp_result *r) {
  pipe_seen *p = arg;
  sigset_t cur;
  pthread_sigmask(SIG_BLOCK, NULL, &cur);
  pthread_mutex_lock(&p->mu);
  p->status = r->status;
  p->sigpipe_blocked = sigismember(&cur, SIGPIPE) == 1;
  p->done = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

/* A trainer embeds the client: a shard that goes away in the middle of a
 * large write fails the request with ZS_ECONN. The write to the socket may
 * then meet EPIPE, which must not raise SIGPIPE (its default action would
 * kill the trainer's process): the loop thread, which does every write,
 * runs with SIGPIPE blocked, as the callback (on that thread) checks, while
 * the caller's mask is left as it was. SIGPIPE is at its default here. */
static void a_peer_reset_mid_write_fails_the_request_and_sigpipe_cannot_kill(void **state) {
  (void)state;
  void (*old)(int) = signal(SIGPIPE, SIG_DFL);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(ls, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(ls, 4), 0);
  socklen_t al = sizeof a;
  getsockname(ls, (struct sockaddr *)&a, &al);
  int fds[2] = {ls, -1};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, resetting_server, fds), 0);
  char addr[64], err[DP_ERRLEN] = "";
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(a.sin_port));
  dp_client_config cc = {.addr = addr};
  dp_client *c = NULL;
  int rc = dp_client_open(&cc, &c, err, sizeof err);
  if (rc)
    fail_msg("open: %s", err);
  sigset_t mine;
  pthread_sigmask(SIG_BLOCK, NULL, &mine);
  assert_int_equal(sigismember(&mine, SIGPIPE), 0);
  size_t nbytes = (size_t)64 << 20;
  float *g = calloc(nbytes / sizeof(float), sizeof(float));
  assert_non_null(g);
  dp_push_args pa = {.spec_hash = 1,
                     .step = 1,
                     .dtype = ZS_DTYPE_FP32,
                     .data = g,
                     .nbytes = nbytes,
                     .timeout_ms = 20000};
  pipe_seen ps = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  assert_int_equal(dp_client_push(c, &pa, on_push_seen, &ps), 0);
  pthread_mutex_lock(&ps.mu);
  while (!ps.done)
    pthread_cond_wait(&ps.cv, &ps.mu);
  pthread_mutex_unlock(&ps.mu);
  assert_int_equal(ps.status, ZS_ECONN);
  assert_true(ps.sigpipe_blocked);
  dp_client_close(c);
  pthread_join(th, NULL);
  free(g);
  close(ls);
  signal(SIGPIPE, old);
}

static void a_server_that_does_not_answer_times_requests_out(void **state) {
  (void)state;
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(ls, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(ls, 4), 0);
  socklen_t al = sizeof a;
  getsockname(ls, (struct sockaddr *)&a, &al);
  int fds[2] = {ls, -1};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, silent_server, fds), 0);
  char addr[64], err[DP_ERRLEN] = "";
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(a.sin_port));
  dp_client_config cc = {.addr = addr};
  dp_client *c = NULL;
  int rc = dp_client_open(&cc, &c, err, sizeof err);
  if (rc)
    fail_msg("open: %s", err);
  assert_int_equal(dp_client_ping_sync(c, 100, err, sizeof err), ZS_ETIMEDOUT);
  assert_non_null(strstr(err, "PING request to"));
  assert_non_null(strstr(err, "timed out after 100 ms"));
  /* A push small enough to be written at once times out without taking the
   * connection down. */
  float g[16] = {0};
  dp_push_args pa = {.spec_hash = 1,
                     .step = 1,
                     .dtype = ZS_DTYPE_FP32,
                     .data = g,
                     .nbytes = sizeof g,
                     .timeout_ms = 100};
  assert_int_equal(dp_client_push_sync(c, &pa, NULL, err, sizeof err), ZS_ETIMEDOUT);
  assert_non_null(strstr(err, "PUSH request to"));
  dp_client_close(c);
  pthread_join(th, NULL);
  if (fds[1] >= 0)
    close(fds[1]);
  close(ls);
}

static void connecting_to_a_closed_port_fails_with_econn(void **state) {
  (void)state;
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(ls, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t al = sizeof a;
  getsockname(ls, (struct sockaddr *)&a, &al);
  char addr[64], err[DP_ERRLEN] = "";
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(a.sin_port));
  close(ls); /* bound, never listened: nothing accepts on that port */
  dp_client_config cc = {.addr = addr, .connections = 2};
  dp_client *c = NULL;
  assert_int_equal(dp_client_open(&cc, &c, err, sizeof err), ZS_ECONN);
  assert_non_null(strstr(err, "cannot connect"));
  assert_null(c);
  cc.addr = "no-port-here";
  assert_int_equal(dp_client_open(&cc, &c, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "has no :port"));
}

/* ------------------------------------------------------- authentication */

#define TRAINER_TOKEN "trainer-secret-0123456789abcdef"
#define ADMIN_TOKEN "admin-secret-0123456789abcdef01"

static auth_keys *g_keys;
static char g_token_dir[64];

/* Mode 0600: a token file others may read is refused. */
static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  assert_int_equal(chmod(path, 0600), 0);
}

/* Shards that want the trainers' token (and know the admins'); the
 * fixture's clients present the trainers'. */
static int setup_auth(void **state) {
  status_say(g_token_dir, sizeof g_token_dir, "/tmp/zs_dp_auth_XXXXXX");
  assert_non_null(mkdtemp(g_token_dir));
  char t[128], a[128], err[256] = "";
  status_say(t, sizeof t, "%s/trainer", g_token_dir);
  status_say(a, sizeof a, "%s/admin", g_token_dir);
  write_file(t, TRAINER_TOKEN "\n");
  write_file(a, ADMIN_TOKEN "\n");
  if (auth_keys_new(t, a, &g_keys, err, sizeof err) != 0)
    fail_msg("auth_keys_new: %s", err);
  dp_server_config_init(&g_srv_cfg);
  g_srv_cfg.auth = g_keys;
  g_srv_cfg.hello_timeout_ms = 300;
  g_cli_token = TRAINER_TOKEN;
  return setup_with(state);
}

static int teardown_auth(void **state) {
  teardown(state);
  auth_keys_free(g_keys);
  g_keys = NULL;
  char p[128];
  status_say(p, sizeof p, "%s/trainer", g_token_dir);
  unlink(p);
  status_say(p, sizeof p, "%s/admin", g_token_dir);
  unlink(p);
  rmdir(g_token_dir);
  return 0;
}

/* Reads the connection's next frame, which must be an ERROR for request 0
 * with `status`, then the end of the stream. */
static void expect_closed_with(int fd, int status, const char *needle) {
  raw_conn rc = {.fd = fd};
  wire_reader_init(&rc.r, 0);
  wire_msg m;
  assert_int_equal(raw_read_frame(&rc, &m, NULL, 0), 0);
  assert_int_equal(m.type, WIRE_ERROR);
  assert_int_equal(m.request_id, 0);
  assert_int_equal(m.u.error.status, status);
  if (needle && !strstr(m.u.error.message, needle))
    fail_msg("\"%s\" does not say \"%s\"", m.u.error.message, needle);
  assert_int_equal(raw_read_frame(&rc, &m, NULL, 0), 1);
  wire_reader_free(&rc.r);
}

static void a_connection_must_say_hello_before_anything_else(void **state) {
  (void)state;
  /* Even without tokens: an old client's first PING is refused clearly. */
  int fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  unsigned char f[WIRE_MAX_ENCODED];
  wire_msg ping = {.type = WIRE_PING, .request_id = 5};
  raw_send(fd, f, raw_frame(f, sizeof f, &ping, NULL, 0));
  expect_closed_with(fd, ZS_EUNAUTHENTICATED, "must be HELLO");
  close(fd);
  /* A HELLO whose header promises the largest meta is refused from the
   * header alone: a stranger gets no 64 KiB buffer. */
  fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  unsigned char h[WIRE_HEADER_SIZE] = {0};
  wire_msg hello = {.type = WIRE_HELLO, .request_id = 1};
  size_t len = 0;
  assert_int_equal(wire_encode(&hello, h, sizeof h, &len), 0);
  h[24] = 0x00; /* meta_len = 65536, little-endian */
  h[25] = 0x00;
  h[26] = 0x01;
  raw_send(fd, h, sizeof h);
  expect_closed_with(fd, ZS_ERANGE, "limit");
  close(fd);
  /* Without tokens any HELLO is welcome, an empty one or one with a token. */
  fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  raw_hello(fd, "whatever");
  close(fd);
  /* The PING was an authentication failure, the meta a broken stream. */
  assert_int_equal(stats_of(0).auth_refused, 1);
}

static void tokens_decide_who_may_use_the_data_plane(void **state) {
  (void)state;
  /* The fixture's clients hold the trainers' token and work. */
  char err[DP_ERRLEN] = "";
  assert_int_equal(dp_client_ping_sync(fx.cli[0], WAIT_MS, err, sizeof err), 0);
  /* The admins' token is a trainer's too. */
  int fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  raw_hello(fd, ADMIN_TOKEN);
  close(fd);
  /* No token, or a wrong one: ERROR for request 0, then the close. */
  fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  raw_send_hello(fd, NULL);
  expect_closed_with(fd, ZS_EUNAUTHENTICATED, "no token given");
  close(fd);
  fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  raw_send_hello(fd, TRAINER_TOKEN "x");
  expect_closed_with(fd, ZS_EUNAUTHENTICATED, "wrong token");
  close(fd);
  /* A client with a wrong token fails at once with the server's reason,
   * and tries no second connection. */
  uint64_t before = stats_of(1).accepted;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", fx.port[1]);
  dp_client_config cc = {.addr = addr, .connections = 1, .token = "not-the-token-at-all"};
  dp_client *cli = NULL;
  assert_int_equal(dp_client_open(&cc, &cli, err, sizeof err), ZS_EUNAUTHENTICATED);
  assert_null(cli);
  if (!strstr(err, "refused") || !strstr(err, "token"))
    fail_msg("unclear refusal: %s", err);
  assert_int_equal(stats_of(1).accepted, before + 1);
  assert_int_equal(stats_of(1).auth_refused, 1);
}

static int auth_timed_out(void *arg) {
  (void)arg;
  return stats_of(0).auth_timeouts == 1;
}

static void a_connection_that_does_not_authenticate_in_time_is_closed(void **state) {
  (void)state;
  int fd = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  /* Nothing sent: the server closes it (hello_timeout_ms 300 here). */
  char b;
  assert_int_equal(recv(fd, &b, 1, 0), 0);
  assert_true(wait_until(auth_timed_out, NULL));
  assert_int_equal(stats_of(0).unauthenticated, 0);
  close(fd);
}

static int setup_caps(void **state) {
  dp_server_config_init(&g_srv_cfg);
  g_srv_cfg.max_per_peer = 3;
  g_srv_cfg.max_unauthenticated = 4;
  g_cli_token = NULL;
  return setup_with(state);
}

static void one_address_cannot_take_every_connection_slot(void **state) {
  (void)state;
  /* Shard 0's fixture client holds one connection from 127.0.0.1; an
   * authenticated one and a silent one reach the cap of 3 for that address,
   * and a fourth is refused. */
  int a = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  raw_hello(a, NULL);
  int b = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  int c = raw_connect_from(fx.port[0], "127.0.0.1", 0);
  expect_closed_with(c, ZS_ELIMIT, "from one address");
  close(c);
  /* Another address is served, authenticated or not. */
  int d = raw_connect_from(fx.port[0], "127.0.0.2", 0);
  raw_hello(d, NULL);
  int e = raw_connect_from(fx.port[0], "127.0.0.3", 0);
  int f = raw_connect_from(fx.port[0], "127.0.0.4", 0);
  int g = raw_connect_from(fx.port[0], "127.0.0.5", 0);
  /* b, e, f and g have not authenticated, the cap of 4: a fifth is kept and
   * the oldest stranger, b, makes room. */
  int h = raw_connect_from(fx.port[0], "127.0.0.6", 0);
  expect_closed_with(b, ZS_ELIMIT, "needed the room");
  /* One address holds one of them (4 / 16, at least 1): its own next one
   * pushes out h, not another address's. */
  int i = raw_connect_from(fx.port[0], "127.0.0.6", 0);
  expect_closed_with(h, ZS_ELIMIT, "needed the room");
  char err[DP_ERRLEN] = "";
  assert_int_equal(dp_client_ping_sync(fx.cli[0], WAIT_MS, err, sizeof err), 0);
  assert_int_equal(stats_of(0).limit_refused, 1);
  assert_int_equal(stats_of(0).unauth_evicted, 2);
  close(a);
  close(b);
  close(d);
  close(e);
  close(f);
  close(g);
  close(h);
  close(i);
}

/* ------------------------------------------------------- pinned answers */

static int pin_was_released(void *arg) {
  (void)arg;
  dp_server_stats st = stats_of(0);
  return st.pins_released == 1 && st.pinned_answers == 0;
}

static int setup_short_pin_hold(void **state) {
  dp_server_config_init(&g_srv_cfg);
  g_srv_cfg.pin_hold_ms = 500;
  g_cli_token = NULL;
  return setup_with(state);
}

/* Every frame of the stalled peer was read (so that the loop thread has no
 * request of it left to check against the core, which an apply holding the
 * state lock would make it wait for), and an answer is pinned (or was
 * already let go). */
static int a_pin_is_held_or_released(void *arg) {
  const uint64_t *frames = arg;
  dp_server_stats st = stats_of(0);
  return st.frames_in >= *frames && (st.pinned_answers >= 1 || st.pins_released >= 1);
}

static void a_reader_stalled_on_a_pinned_answer_does_not_hold_up_the_apply(void **state) {
  (void)state;
  /* Step 1's contributions are in; its apply is next. */
  push_step(1);
  /* bf16 pulls (the stored dtype, sent from the low copy) of the big piece,
   * 128 KiB each, to a peer with a small receive buffer that never reads:
   * the socket fills, and an answer stays pinned in it. */
  const layout_piece *p = piece(BIG_TENSOR, 0);
  assert_int_equal(p->shard, 0);
  uint64_t frames = stats_of(0).frames_in + 1 + 128; /* the HELLO and the pulls */
  int fd = raw_connect_from(fx.port[0], "127.0.0.1", 4096);
  raw_hello(fd, NULL);
  unsigned char f[WIRE_MAX_ENCODED];
  for (uint64_t id = 1; id <= 128; id++) {
    wire_msg m = {.type = WIRE_PULL, .request_id = id};
    m.u.pull = (wire_pull){
        .spec_hash = fx.hash, .tensor = p->tensor, .slice = p->slice, .dtype = ZS_DTYPE_BF16};
    raw_send(fd, f, raw_frame(f, sizeof f, &m, NULL, 0));
  }
  assert_true(wait_until(a_pin_is_held_or_released, &frames));
  /* The apply of shard 0 does not wait for the pin (the core writes a
   * fresh copy); the server lets the stalled peer go after the hold, and the
   * peer has read nothing meanwhile. */
  uint64_t t0 = clock_now_ns();
  apply_core(fx.dpc[0], 1);
  uint64_t t1 = clock_now_ns();
  apply_core(fx.ref[0], 1);
  uint64_t t2 = clock_now_ns();
  apply_core(fx.dpc[1], 1);
  apply_core(fx.ref[1], 1);
  printf("apply with a reader stalled on a pinned answer: %.0f ms (pin hold 500 ms); without "
         "pins: %.1f ms\n",
         (double)(t1 - t0) / 1e6, (double)(t2 - t1) / 1e6);
  assert_true(wait_until(pin_was_released, NULL));
  /* Everyone else gets the new version. */
  check_pulls_match_reference(1);
  close(fd);
}

int main(void) {
  log_set_level(LOG_LEVEL_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(pushes_and_pulls_over_the_wire_match_the_core_driven_directly,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(
          refused_pushes_get_the_cores_status_and_message_and_change_nothing, setup_default,
          teardown),
      cmocka_unit_test_setup_teardown(a_dtype_that_is_not_ours_is_refused_by_the_server_with_edtype,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_repeated_push_is_acknowledged_as_a_duplicate_and_added_once,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(refused_pulls_get_clear_statuses, setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_pull_waits_for_its_version_and_then_returns_it,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_pull_overtakes_pushes_waiting_to_be_written, setup_default,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          pipelined_requests_from_several_threads_complete_with_their_own_answers, setup_default,
          teardown),
      cmocka_unit_test_setup_teardown(a_stalled_peer_does_not_block_other_clients, setup_default,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          a_peer_stalled_inside_a_frame_is_disconnected_after_the_stall_timeout, setup_short_stall,
          teardown),
      cmocka_unit_test_setup_teardown(a_corrupt_payload_crc_is_refused_and_the_connection_survives,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_broken_stream_is_answered_with_request_id_0_and_closed,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(
          a_peer_that_does_not_take_its_answers_is_paused_and_others_are_served, setup_backpressure,
          teardown),
      cmocka_unit_test_setup_teardown(closing_the_client_cancels_its_requests_in_flight,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(
          stopping_the_server_fails_its_connections_and_leaves_waits_to_the_core, setup_default,
          teardown),
      cmocka_unit_test_setup_teardown(push_and_pull_batches_match_the_core_driven_piece_by_piece,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(
          a_push_batch_refuses_bad_pieces_one_by_one_and_keeps_the_good_ones, setup_default,
          teardown),
      cmocka_unit_test_setup_teardown(a_pull_batch_is_refused_whole_when_one_piece_is_bad,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_pull_batch_waits_once_for_its_version, setup_default,
                                      teardown),
      cmocka_unit_test_setup_teardown(a_malformed_push_batch_is_refused_and_the_connection_survives,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(a_connection_must_say_hello_before_anything_else,
                                      setup_default, teardown),
      cmocka_unit_test_setup_teardown(tokens_decide_who_may_use_the_data_plane, setup_auth,
                                      teardown_auth),
      cmocka_unit_test_setup_teardown(a_connection_that_does_not_authenticate_in_time_is_closed,
                                      setup_auth, teardown_auth),
      cmocka_unit_test_setup_teardown(one_address_cannot_take_every_connection_slot, setup_caps,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          a_reader_stalled_on_a_pinned_answer_does_not_hold_up_the_apply, setup_short_pin_hold,
          teardown),
      cmocka_unit_test(a_server_that_does_not_answer_times_requests_out),
      cmocka_unit_test(a_peer_reset_mid_write_fails_the_request_and_sigpipe_cannot_kill),
      cmocka_unit_test(connecting_to_a_closed_port_fails_with_econn),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
