/*
 * test_client_scatter — a pull batch's pieces go straight to where single
 * pulls would put them (client/lib/dataplane.c, "batches"): the callers'
 * buffers at each piece's offset, a task's own buffer when its piece is
 * converted (fp32 buffers, bf16 on the wire), a prefetch slot. Against real
 * zshard-server processes, the bits are checked against single pulls, and
 * bytes around every buffer against stray writes.
 *
 * Below libzshard, the data client scatters an answer over the pieces'
 * destinations (dp_pull_batch_args.dsts): against a scripted data-plane
 * server in this test, which answers right, with a payload that fails its
 * CRC32C, or by closing the connection in the middle of the payload, the
 * client refuses the damaged answers (ZS_ECRC, ZS_ECONN) and the next batch
 * lands whole.
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
#include <unistd.h>

#include <cmocka.h>

#include "common/base/crc32c.h"
#include "common/net/dp_client.h"
#include "common/net/wire.h"
#include "harness.h"
#include "internal.h"
#include "zshard/zshard.h"

/* ---- libzshard against real shards -------------------------------------------- */

#define NT 7
#define SPLIT 64
/* Whole and split tensors; the last one's pieces (10000 elements, 20000
 * bytes in bf16) are big enough for the data client to read them straight
 * from the socket, the others come through its staging buffer. */
static const uint64_t NUMEL[NT] = {300, 7, 64, 1, 129, 20000, 2};
/* Bytes kept between buffers, which no pull may touch. */
#define GAP 64
#define GAP_BYTE 0xee

static zs_client *open_client(const hs_cluster *cl, uint32_t prefetch) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = SPLIT;
  o.pull_dtype = ZS_DTYPE_BF16;
  o.prefetch_depth = prefetch;
  o.rpc_timeout_ms = 10000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &g, NULL), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  float *w[NT];
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = malloc(NUMEL[t] * sizeof(float));
    /* Values bf16 cannot hold, so that a conversion shows in the bits. */
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = (float)(t + 1) + (float)i / 3.0f;
  }
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    free(w[t]);
  return c;
}

/* Every tensor's buffer, in fp32 or bf16, laid out in one arena with GAP
 * bytes of GAP_BYTE before, between and after them. */
typedef struct arena {
  unsigned char *mem;
  size_t size;
  void *buf[NT];
  zs_dtype dtype[NT];
  size_t nbytes[NT];
} arena;

static void arena_init(arena *a, int fp32_parity) {
  size_t off = GAP;
  for (uint32_t t = 0; t < NT; t++) {
    a->dtype[t] = (int)(t % 2) == fp32_parity ? ZS_DTYPE_FP32 : ZS_DTYPE_BF16;
    a->nbytes[t] = (size_t)zs_dtype_bytes(a->dtype[t], NUMEL[t]);
    off += (a->nbytes[t] + 7) / 8 * 8 + GAP;
  }
  a->size = off;
  a->mem = malloc(a->size);
  assert_non_null(a->mem);
  memset(a->mem, GAP_BYTE, a->size);
  off = GAP;
  for (uint32_t t = 0; t < NT; t++) {
    a->buf[t] = a->mem + off;
    memset(a->buf[t], 0, a->nbytes[t]);
    off += (a->nbytes[t] + 7) / 8 * 8 + GAP;
  }
}

/* No byte outside the buffers was written. */
static void arena_check_gaps(const arena *a) {
  size_t off = 0;
  for (uint32_t t = 0; t <= NT; t++) {
    size_t end = t < NT ? (size_t)((unsigned char *)a->buf[t] - a->mem) : a->size;
    for (; off < end; off++)
      if (a->mem[off] != GAP_BYTE)
        fail_msg("byte %zu of the arena, outside every buffer, was written", off);
    if (t < NT)
      off = end + a->nbytes[t];
  }
}

/* Each tensor pulled alone, synchronously (one piece per shard in flight:
 * nothing to batch), in fp32 and in bf16. */
static void single_pulls(zs_client *c, void **fp32, void **bf16) {
  uint64_t before = zc_dp_batches(c);
  for (uint32_t t = 0; t < NT; t++) {
    fp32[t] = malloc(NUMEL[t] * 4);
    bf16[t] = malloc(NUMEL[t] * 2);
    assert_int_equal(zs_pull(c, t, fp32[t], ZS_DTYPE_FP32, NUMEL[t] * 4, NULL), ZS_OK);
    assert_int_equal(zs_pull(c, t, bf16[t], ZS_DTYPE_BF16, NUMEL[t] * 2, NULL), ZS_OK);
  }
  assert_int_equal(zc_dp_batches(c), before);
}

static void free_refs(void **fp32, void **bf16) {
  for (uint32_t t = 0; t < NT; t++) {
    free(fp32[t]);
    free(bf16[t]);
  }
}

/* The arena's buffers hold the reference's bits. */
static void arena_check(const arena *a, void **fp32, void **bf16) {
  for (uint32_t t = 0; t < NT; t++)
    assert_memory_equal(a->buf[t], a->dtype[t] == ZS_DTYPE_FP32 ? fp32[t] : bf16[t], a->nbytes[t]);
  arena_check_gaps(a);
}

/* Submits every pull while the pool is held, so that each shard's queue
 * holds all its pieces when a worker looks and they travel as one batch per
 * shard. */
static void held_pulls(zs_client *c, arena *a) {
  zs_request *reqs[NT];
  zc_pool_hold(&c->pool, 1);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_pull(c, t, a->buf[t], a->dtype[t], a->nbytes[t], &reqs[t]), ZS_OK);
  zc_pool_hold(&c->pool, 0);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_wait(reqs[t]), ZS_OK);
}

/* Pieces converted on a worker (fp32 buffers) and pieces written where they
 * belong (bf16 buffers) in the same batches, every tensor both ways: the
 * same bits as single pulls, nothing written beside the buffers. */
static void a_pull_batch_puts_each_piece_where_a_single_pull_would(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *c = open_client(&cl, 0);
  void *fp32[NT], *bf16[NT];
  single_pulls(c, fp32, bf16);
  for (int parity = 0; parity < 2; parity++) {
    arena a;
    arena_init(&a, parity);
    uint64_t before = zc_dp_batches(c);
    held_pulls(c, &a);
    /* One batch per shard: every tensor has a piece on each, or is whole. */
    assert_int_equal(zc_dp_batches(c) - before, 2);
    arena_check(&a, fp32, bf16);
    free(a.mem);
  }
  free_refs(fp32, bf16);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* A pull of tensor 0 starts prefetches of all the others; with the pool
 * held they travel in the same batches, their pieces going into the
 * prefetch slots, from which the later pulls are served. */
static void prefetched_pieces_of_a_batch_serve_the_later_pulls(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  zs_client *ref = open_client(&cl, 0);
  void *fp32[NT], *bf16[NT];
  single_pulls(ref, fp32, bf16);
  assert_int_equal(zs_client_close(ref), ZS_OK);

  zs_client *c = open_client(&cl, NT);
  arena a;
  arena_init(&a, 0);
  uint64_t before = zc_dp_batches(c);
  zs_request *req = NULL;
  zc_pool_hold(&c->pool, 1);
  assert_int_equal(zs_pull(c, 0, a.buf[0], a.dtype[0], a.nbytes[0], &req), ZS_OK);
  zc_pool_hold(&c->pool, 0);
  assert_int_equal(zs_wait(req), ZS_OK);
  assert_int_equal(zc_dp_batches(c) - before, 2);
  for (uint32_t t = 1; t < NT; t++)
    assert_int_equal(zs_pull(c, t, a.buf[t], a.dtype[t], a.nbytes[t], NULL), ZS_OK);
  /* Served from the slots: no more batches, and the bits of single pulls. */
  assert_int_equal(zc_dp_batches(c) - before, 2);
  arena_check(&a, fp32, bf16);
  free(a.mem);
  free_refs(fp32, bf16);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ---- the data client against a scripted server ------------------------------- */

/* How the scripted server answers the next PULL_BATCH. */
enum { ANSWER_RIGHT = 0, ANSWER_BAD_CRC, ANSWER_CUT };

typedef struct script {
  int lfd, port;
  pthread_t th;
  pthread_mutex_t mu;
  int next;         /* (mu) ANSWER_*, back to ANSWER_RIGHT once used */
  int connections;  /* (mu) accepted so far */
  uint64_t last_id; /* (mu) the request id of the last answer */
} script;

/* Piece i's byte k of request `id`: different for every request, so that a
 * stale byte is told from a fresh one. */
static uint8_t piece_byte(uint64_t id, uint32_t i, size_t k) {
  return (uint8_t)(id * 131u + i * 17u + k * 7u + (k >> 8));
}

static int send_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Answers one PULL_BATCH (its pieces in q) as the script says. Returns 0, or
 * -1 when the connection is to be closed. */
static int script_answer(script *s, int fd, uint64_t id, const wire_pull_batch *q) {
  static uint8_t head[WIRE_MAX_BATCH_ENCODED];
  uint64_t lens[WIRE_MAX_BATCH];
  size_t total = 0;
  for (uint32_t i = 0; i < q->npieces; i++)
    total += lens[i] = q->pieces[i].length;
  uint8_t *payload = malloc(total), *p = payload;
  assert_non_null(payload);
  for (uint32_t i = 0; i < q->npieces; i++)
    for (size_t k = 0; k < lens[i]; k++)
      *p++ = piece_byte(id, i, k);
  pthread_mutex_lock(&s->mu);
  int how = s->next;
  s->next = ANSWER_RIGHT;
  s->last_id = id;
  pthread_mutex_unlock(&s->mu);
  wire_msg m = {.type = WIRE_PULL_BATCH_DATA, .request_id = id, .payload_len = total};
  m.u.pull_batch_data = (wire_pull_batch_data){.version = 1, .npieces = q->npieces, .length = lens};
  m.payload_crc = crc32c(0, payload, total) ^ (how == ANSWER_BAD_CRC ? 1u : 0u);
  size_t hlen = 0;
  int rc = wire_encode(&m, head, sizeof head, &hlen);
  /* A cut answer stops in the middle of its payload. */
  size_t send_len = how == ANSWER_CUT ? total / 2 : total;
  if (rc == 0)
    rc = send_all(fd, head, hlen) || send_all(fd, payload, send_len) ? -1 : 0;
  free(payload);
  return how == ANSWER_CUT ? -1 : rc;
}

/* A frame without meta or payload: HELLO_ACK, PONG. */
static int script_reply(int fd, wire_type type, uint64_t id) {
  wire_msg ack = {.type = type, .request_id = id};
  uint8_t h[WIRE_MAX_ENCODED];
  size_t hlen = 0;
  return wire_encode(&ack, h, sizeof h, &hlen) == 0 ? send_all(fd, h, hlen) : -1;
}

/* Serves one connection: HELLO_ACK to the HELLO, PONG to a PING, and the
 * pull batches. */
static void script_serve(script *s, int fd) {
  wire_reader r;
  wire_reader_init(&r, 0);
  uint8_t buf[4096];
  for (int open = 1; open;) {
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0)
      break;
    /* A frame without payload ends on the feed after its META event, even
     * an empty one: feed until the input is used up and nothing happens. */
    size_t used = 0;
    wire_event ev;
    do {
      used += wire_reader_feed(&r, buf + used, (size_t)n - used, &ev);
      if (ev == WIRE_EV_FATAL)
        open = 0;
      else if (ev == WIRE_EV_META)
        wire_reader_set_payload(&r, NULL);
      else if (ev == WIRE_EV_DONE && r.msg.type == WIRE_HELLO)
        open = script_reply(fd, WIRE_HELLO_ACK, r.msg.request_id) == 0;
      else if (ev == WIRE_EV_DONE && r.msg.type == WIRE_PING)
        open = script_reply(fd, WIRE_PONG, r.msg.request_id) == 0;
      else if (ev == WIRE_EV_DONE && r.msg.type == WIRE_PULL_BATCH)
        open = script_answer(s, fd, r.msg.request_id, &r.msg.u.pull_batch) == 0;
    } while (open && (used < (size_t)n || ev != WIRE_EV_NONE));
  }
  wire_reader_free(&r);
  close(fd);
}

static void *script_main(void *arg) {
  script *s = arg;
  for (;;) {
    int fd = accept(s->lfd, NULL, NULL);
    if (fd < 0)
      return NULL; /* the listener was shut down */
    pthread_mutex_lock(&s->mu);
    s->connections++;
    pthread_mutex_unlock(&s->mu);
    script_serve(s, fd);
  }
}

static void script_start(script *s) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  s->lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  socklen_t len = sizeof a;
  assert_true(s->lfd >= 0);
  assert_int_equal(bind(s->lfd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(s->lfd, 4), 0);
  assert_int_equal(getsockname(s->lfd, (struct sockaddr *)&a, &len), 0);
  s->port = ntohs(a.sin_port);
  assert_int_equal(pthread_create(&s->th, NULL, script_main, s), 0);
}

/* Called once the client is closed: its connection ended, so the serving
 * thread is back in accept, which the shutdown ends. */
static void script_stop(script *s) {
  shutdown(s->lfd, SHUT_RDWR);
  pthread_join(s->th, NULL);
  close(s->lfd);
  pthread_mutex_destroy(&s->mu);
}

static void script_next(script *s, int how) {
  pthread_mutex_lock(&s->mu);
  s->next = how;
  pthread_mutex_unlock(&s->mu);
}

typedef struct batch_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
} batch_wait;

static void on_batch(void *arg, const dp_result *r) {
  batch_wait *w = arg;
  pthread_mutex_lock(&w->mu);
  w->status = r->status;
  w->done = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Pieces of 5, 40000, 3, 70000 and 100 bytes: the two big ones read
 * straight from the socket, the small ones through the staging buffer. */
#define NP 5
static const size_t PIECE_LEN[NP] = {5, 40000, 3, 70000, 100};

/* Pulls one batch of NP pieces into separate buffers (dsts); returns its
 * status. */
static int pull_batch(dp_client *cli, void *const *dsts) {
  dp_batch_piece pieces[NP];
  for (uint32_t i = 0; i < NP; i++)
    pieces[i] = (dp_batch_piece){.tensor = i, .dtype = ZS_DTYPE_BF16, .nbytes = PIECE_LEN[i]};
  dp_pull_batch_args a = {.pieces = pieces, .npieces = NP, .dsts = dsts, .timeout_ms = 10000};
  batch_wait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  assert_int_equal(dp_client_pull_batch(cli, &a, on_batch, &w), 0);
  pthread_mutex_lock(&w.mu);
  while (!w.done)
    pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  return w.status;
}

/* Each piece holds the bytes of the server's last answer for it. */
static void check_pieces(script *s, void *const *dsts) {
  pthread_mutex_lock(&s->mu);
  uint64_t id = s->last_id;
  pthread_mutex_unlock(&s->mu);
  for (uint32_t i = 0; i < NP; i++)
    for (size_t k = 0; k < PIECE_LEN[i]; k++)
      if (((uint8_t *)dsts[i])[k] != piece_byte(id, i, k))
        fail_msg("piece %" PRIu32 " byte %zu is not answer %" PRIu64 "'s", i, k, id);
}

static void a_data_client_scatters_answers_and_refuses_damaged_ones(void **state) {
  (void)state;
  script s;
  script_start(&s);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", s.port);
  dp_client_config cfg = {.addr = addr};
  dp_client *cli = NULL;
  char err[DP_ERRLEN];
  if (dp_client_open(&cfg, &cli, err, sizeof err) != 0)
    fail_msg("dp_client_open: %s", err);
  void *dsts[NP];
  for (uint32_t i = 0; i < NP; i++)
    dsts[i] = malloc(PIECE_LEN[i]);

  /* Misuse: a missing destination, or both forms at once. */
  dp_batch_piece one = {.dtype = ZS_DTYPE_BF16, .nbytes = 4};
  void *none[1] = {NULL};
  dp_pull_batch_args bad = {.pieces = &one, .npieces = 1, .dsts = none};
  batch_wait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  assert_int_equal(dp_client_pull_batch(cli, &bad, on_batch, &w), ZS_EINVAL);
  bad.dsts = dsts;
  bad.dst = dsts[0];
  assert_int_equal(dp_client_pull_batch(cli, &bad, on_batch, &w), ZS_EINVAL);
  bad.dsts = NULL;
  bad.dst = NULL;
  assert_int_equal(dp_client_pull_batch(cli, &bad, on_batch, &w), ZS_EINVAL);

  assert_int_equal(pull_batch(cli, dsts), 0);
  check_pieces(&s, dsts);
  /* A damaged payload fails its CRC; the connection lives on. */
  script_next(&s, ANSWER_BAD_CRC);
  assert_int_equal(pull_batch(cli, dsts), ZS_ECRC);
  assert_int_equal(pull_batch(cli, dsts), 0);
  check_pieces(&s, dsts);
  /* A connection closed in the middle of the payload fails the batch; the
   * next one reconnects and lands whole. */
  script_next(&s, ANSWER_CUT);
  assert_int_equal(pull_batch(cli, dsts), ZS_ECONN);
  assert_int_equal(pull_batch(cli, dsts), 0);
  check_pieces(&s, dsts);
  pthread_mutex_lock(&s.mu);
  assert_int_equal(s.connections, 2);
  pthread_mutex_unlock(&s.mu);

  dp_client_close(cli);
  script_stop(&s);
  for (uint32_t i = 0; i < NP; i++)
    free(dsts[i]);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_pull_batch_puts_each_piece_where_a_single_pull_would),
      cmocka_unit_test(prefetched_pieces_of_a_batch_serve_the_later_pulls),
      cmocka_unit_test(a_data_client_scatters_answers_and_refuses_damaged_ones),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
