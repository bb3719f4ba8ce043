/*
 * test_dp_limits — the data plane of a real zshard-server against hostile
 * peers (docs/OPERATIONS.md, "Limits"): each test runs one attack through raw
 * sockets and checks the bounded outcome, memory measured as the server's
 * resident set (/proc/<pid>/status) and never as a time.
 *
 *  - a PUSH_BATCH declaring 1 GiB with a bogus hash, on 3 connections, gets
 *    its refusal before any buffer is sized from it;
 *  - 1100 idle connections from one address leave room for a trainer from
 *    another; 1100 connections that each park a Pull far ahead and close
 *    leave room for a trainer from the same address;
 *  - 300 Pulls waiting on one connection do not stop it being read: the
 *    Push after them is acknowledged;
 *  - peers that ask for large PULL_BATCH answers and do not read them hold
 *    at most the server's answer budget, and a batch over the connection's
 *    budget is refused with ZS_ELIMIT.
 *
 * One shard (--shards 1) with a job of one 4 Mi-element tensor (16 MiB in
 * fp32) and a small one; the servers run without tokens, so every
 * connection says HELLO with none, except in the last test, which checks
 * the HELLO against a server started with --token-file.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/crc32c.h"
#include "common/base/status.h"
#include "common/net/dp_client.h"
#include "common/net/wire.h"
#include "tests/integration/harness.h"

#define BIG_NUMEL (UINT64_C(4) << 20) /* 16 MiB in fp32 */
#define BIG_BYTES (BIG_NUMEL * 4u)
#define SMALL_NUMEL 1000u
#define MIB (UINT64_C(1) << 20)

/* ------------------------------------------------------------ the shard */

typedef struct shard {
  hs_server *srv;
  hs_job j;
  int dport;
} shard;

static int build_spec(spec *s) {
  memset(s, 0, sizeof *s);
  s->job = strdup("limits");
  s->groups = calloc(1, sizeof *s->groups);
  s->tensors = calloc(2, sizeof *s->tensors);
  if (!s->job || !s->groups || !s->tensors)
    return ZS_ENOMEM;
  s->num_groups = 1;
  spec_group_defaults(&s->groups[0], ZS_OPTIM_SGD);
  s->num_tensors = 2;
  s->tensors[0].name = strdup("big");
  s->tensors[0].numel = BIG_NUMEL;
  s->tensors[1].name = strdup("small");
  s->tensors[1].numel = SMALL_NUMEL;
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = 1;
  s->split_threshold = BIG_NUMEL; /* both whole: one piece each */
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256];
  int rc = spec_validate(s, err, sizeof err);
  if (rc)
    fprintf(stderr, "spec: %s\n", err);
  return rc;
}

static int data_port_of(const hs_server *s) {
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(s->addr, &ch), 0);
  rpc_status st;
  if (hs_get_info(ch, &info, &st) != 0)
    fail_msg("GetInfo: %s", st.message);
  int port = (int)info->data_port;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
  return port;
}

/* Starts the shard with `env` (may be NULL) and opens the job at version 0
 * with its weights written. */
static void shard_up(shard *s, const char *const *env) {
  memset(s, 0, sizeof *s);
  const char *args[] = {"--shard-id", "0", "--shards", "1", "--threads", "1", NULL};
  s->srv = hs_start(args, env);
  assert_non_null(s->srv);
  spec sp;
  assert_int_equal(build_spec(&sp), 0);
  const char *addrs[] = {s->srv->addr};
  assert_int_equal(hs_job_init(&s->j, &sp, addrs), 0);
  rpc_status st;
  if (hs_job_open(&s->j, 0, &st) != 0)
    fail_msg("Open: %s", st.message);
  float *w[2] = {calloc(BIG_NUMEL, sizeof(float)), calloc(SMALL_NUMEL, sizeof(float))};
  assert_non_null(w[0]);
  assert_non_null(w[1]);
  if (hs_job_init_params(&s->j, w, &st) != 0)
    fail_msg("InitParams: %s", st.message);
  free(w[0]);
  free(w[1]);
  s->dport = data_port_of(s->srv);
}

static void shard_down(shard *s) {
  hs_job_free(&s->j);
  assert_int_equal(hs_stop(s->srv), 0);
}

/* A field of /proc/<pid>/status in bytes ("VmRSS", "VmHWM"). */
static uint64_t proc_bytes(pid_t pid, const char *field) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  uint64_t kib = 0;
  size_t n = strlen(field);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, n) == 0 && line[n] == ':')
      kib = strtoull(line + n + 1, NULL, 10);
  fclose(f);
  assert_true(kib > 0);
  return kib * 1024u;
}

/* Resets the server's peak resident set to its current one, so that VmHWM
 * afterwards is the peak of what follows. */
static void reset_peak(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/clear_refs", (int)pid);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs("5", f);
  assert_int_equal(fclose(f), 0);
}

/* ------------------------------------------------------------ raw peers */

typedef struct raw {
  int fd;
  wire_reader r;
  size_t off, len;
  unsigned char buf[64 << 10];
} raw;

/* A connection from `src` (127.0.0.x); rcvbuf > 0 shrinks its receive
 * buffer. Every blocking read is bounded (a hung server fails the test). */
static int connect_from(int port, const char *src, int rcvbuf) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  if (rcvbuf > 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  struct sockaddr_in b = {.sin_family = AF_INET};
  assert_int_equal(inet_pton(AF_INET, src, &b.sin_addr), 1);
  assert_int_equal(bind(fd, (struct sockaddr *)&b, sizeof b), 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  assert_int_equal(inet_pton(AF_INET, "127.0.0.1", &a.sin_addr), 1);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  struct timeval tv = {.tv_sec = 20};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

static void send_all(int fd, const void *p, size_t n) {
  const unsigned char *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    assert_true(w > 0);
    b += w;
    n -= (size_t)w;
  }
}

static void send_msg(int fd, wire_msg *m) {
  unsigned char f[WIRE_MAX_BATCH_ENCODED];
  size_t len = 0;
  assert_int_equal(wire_encode(m, f, sizeof f, &len), 0);
  send_all(fd, f, len);
}

static raw *raw_new(int fd) {
  raw *r = calloc(1, sizeof *r);
  assert_non_null(r);
  r->fd = fd;
  wire_reader_init(&r->r, 0);
  return r;
}

static void raw_free(raw *r) {
  close(r->fd);
  wire_reader_free(&r->r);
  free(r);
}

/* The next frame (its payload skipped). Returns 0, 1 at a clean end of the
 * stream, -1 on a broken stream or a receive timeout. */
static int read_frame(raw *c, wire_msg *m) {
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
    if (ev == WIRE_EV_META)
      wire_reader_set_payload(&c->r, NULL);
    if (ev == WIRE_EV_DONE) {
      *m = c->r.msg;
      return 0;
    }
  }
}

/* An authenticated connection from `src`. */
static raw *raw_open(int port, const char *src, int rcvbuf) {
  raw *r = raw_new(connect_from(port, src, rcvbuf));
  wire_msg h = {.type = WIRE_HELLO, .request_id = 1};
  send_msg(r->fd, &h);
  wire_msg m;
  assert_int_equal(read_frame(r, &m), 0);
  if (m.type == WIRE_ERROR)
    fail_msg("HELLO from %s refused: %s: %s", src, zs_err_name(m.u.error.status),
             m.u.error.message);
  assert_int_equal(m.type, WIRE_HELLO_ACK);
  return r;
}

static void expect_pong(raw *r, uint64_t id) {
  wire_msg p = {.type = WIRE_PING, .request_id = id};
  send_msg(r->fd, &p);
  wire_msg m;
  assert_int_equal(read_frame(r, &m), 0);
  assert_int_equal(m.type, WIRE_PONG);
  assert_int_equal(m.request_id, id);
}

static wire_msg pull_of(const shard *s, uint32_t tensor, uint64_t min_version, uint64_t id,
                        int dtype) {
  wire_msg m = {.type = WIRE_PULL, .request_id = id};
  m.u.pull = (wire_pull){.spec_hash = s->j.hash,
                         .tensor = tensor,
                         .slice = 0,
                         .min_version = min_version,
                         .dtype = dtype};
  return m;
}

/* ------------------------------------------------------------ the attacks */

static void a_push_batch_of_1_gib_with_a_bogus_hash_is_refused_before_any_allocation(void **state) {
  (void)state;
  shard s;
  shard_up(&s, NULL);
  reset_peak(s.srv->pid);
  uint64_t rss0 = proc_bytes(s.srv->pid, "VmRSS");
  /* Four pieces of 256 MiB each, 1 GiB declared, on 3 connections; 32 MiB
   * of the payload actually sent on each. */
  wire_piece pcs[4];
  for (int i = 0; i < 4; i++)
    pcs[i] = (wire_piece){.tensor = 0, .slice = 0, .dtype = ZS_DTYPE_FP32, .length = 256 * MIB};
  raw *c[3];
  static unsigned char zeros[1 << 20];
  for (int k = 0; k < 3; k++) {
    c[k] = raw_open(s.dport, "127.0.0.1", 0);
    wire_msg m = {
        .type = WIRE_PUSH_BATCH, .request_id = 7, .payload_len = 1024 * MIB, .payload_crc = 1};
    m.u.push_batch =
        (wire_push_batch){.spec_hash = s.j.hash ^ 0x5a5a, .step = 1, .npieces = 4, .pieces = pcs};
    send_msg(c[k]->fd, &m);
    for (int i = 0; i < 32; i++)
      send_all(c[k]->fd, zeros, sizeof zeros);
  }
  /* Each batch is answered at once, every piece refused by the hash. */
  for (int k = 0; k < 3; k++) {
    wire_msg a;
    assert_int_equal(read_frame(c[k], &a), 0);
    assert_int_equal(a.type, WIRE_PUSH_BATCH_ACK);
    assert_int_equal(a.u.push_batch_ack.npieces, 4);
    for (int i = 0; i < 4; i++)
      assert_int_equal(a.u.push_batch_ack.status[i], ZS_EHASH);
  }
  uint64_t peak = proc_bytes(s.srv->pid, "VmHWM");
  printf("push batch attack: server peak %.1f MiB over %.1f MiB before (3 x 1 GiB declared, "
         "3 x 32 MiB sent)\n",
         ((double)peak - (double)rss0) / (double)MIB, (double)rss0 / (double)MIB);
  assert_true(peak < rss0 + 24 * MIB);
  /* The connections live on. */
  for (int k = 0; k < 3; k++)
    raw_free(c[k]);
  shard_down(&s);
}

static void idle_connections_from_one_address_leave_room_for_a_trainer(void **state) {
  (void)state;
  enum { NIDLE = 1100 };
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < NIDLE + 200 && rl.rlim_max >= NIDLE + 200) {
    rl.rlim_cur = NIDLE + 200;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  shard s;
  shard_up(&s, NULL);
  int *fds = malloc(NIDLE * sizeof *fds);
  assert_non_null(fds);
  for (int i = 0; i < NIDLE; i++)
    fds[i] = connect_from(s.dport, "127.0.0.1", 0);
  /* A trainer on another host gets in, authenticates and is answered. */
  raw *t = raw_open(s.dport, "127.0.0.2", 0);
  expect_pong(t, 11);
  /* The address holds only its share of connections without HELLO: the
   * oldest were closed to make room for newer ones, and told why. */
  raw *first = raw_new(fds[0]);
  wire_msg m;
  assert_int_equal(read_frame(first, &m), 0);
  assert_int_equal(m.type, WIRE_ERROR);
  assert_int_equal(m.u.error.status, ZS_ELIMIT);
  raw_free(first);
  for (int i = 1; i < NIDLE; i++)
    close(fds[i]);
  free(fds);
  raw_free(t);
  shard_down(&s);
}

static void connections_that_park_a_pull_and_close_free_their_slots(void **state) {
  (void)state;
  enum { NPARK = 1100 };
  shard s;
  shard_up(&s, NULL);
  for (int i = 0; i < NPARK; i++) {
    raw *r = raw_open(s.dport, "127.0.0.1", 0);
    wire_msg p = pull_of(&s, 1, 1000000, 2, ZS_DTYPE_FP32);
    send_msg(r->fd, &p);
    raw_free(r);
  }
  /* A trainer from the same address is served: connected, answered, and
   * its Pull of the current version returns the piece. */
  raw *t = raw_open(s.dport, "127.0.0.1", 0);
  expect_pong(t, 3);
  wire_msg p = pull_of(&s, 1, 0, 4, ZS_DTYPE_FP32);
  send_msg(t->fd, &p);
  wire_msg m;
  assert_int_equal(read_frame(t, &m), 0);
  assert_int_equal(m.type, WIRE_PULL_DATA);
  assert_int_equal(m.payload_len, SMALL_NUMEL * 4u);
  raw_free(t);
  shard_down(&s);
}

static void waiting_pulls_do_not_stop_the_push_they_wait_for(void **state) {
  (void)state;
  enum { NWAIT = 300 };
  shard s;
  shard_up(&s, NULL);
  raw *r = raw_open(s.dport, "127.0.0.1", 0);
  for (uint64_t id = 1; id <= NWAIT; id++) {
    wire_msg p = pull_of(&s, 1, 1, id, ZS_DTYPE_FP32);
    send_msg(r->fd, &p);
  }
  /* The step's contribution to the small piece, then a PING, on the same
   * connection after the 300 waiting Pulls. */
  static float g[SMALL_NUMEL];
  wire_msg push = {.type = WIRE_PUSH,
                   .request_id = 1000,
                   .payload_len = sizeof g,
                   .payload_crc = crc32c(0, g, sizeof g)};
  push.u.push = (wire_push){
      .spec_hash = s.j.hash, .step = 1, .tensor = 1, .slice = 0, .dtype = ZS_DTYPE_FP32};
  send_msg(r->fd, &push);
  send_all(r->fd, g, sizeof g);
  wire_msg m;
  assert_int_equal(read_frame(r, &m), 0);
  assert_int_equal(m.type, WIRE_PUSH_ACK);
  assert_int_equal(m.request_id, 1000);
  expect_pong(r, 1001);
  raw_free(r);
  shard_down(&s);
}

static void stalled_readers_of_large_answers_hold_at_most_the_answer_budget(void **state) {
  (void)state;
  /* Budgets of 64 MiB per connection and 96 MiB in all (defaults 256 MiB
   * and 1 GiB), so that the test stays small; the per-address share is the
   * whole, since every peer here is 127.0.0.1 (the next test has it). */
  const char *env[] = {"ZSHARD_DP_MAX_ANSWER_BYTES=67108864",
                       "ZSHARD_DP_MAX_ANSWER_BYTES_TOTAL=100663296",
                       "ZSHARD_DP_MAX_ANSWER_BYTES_PEER=100663296", NULL};
  shard s;
  shard_up(&s, env);
  reset_peak(s.srv->pid);
  uint64_t rss0 = proc_bytes(s.srv->pid, "VmRSS");
  wire_piece four[4];
  for (int i = 0; i < 4; i++)
    four[i] = (wire_piece){.tensor = 0, .slice = 0, .dtype = ZS_DTYPE_FP32, .length = BIG_BYTES};
  /* Three peers ask for 64 MiB each and read nothing. */
  raw *c[3];
  for (int k = 0; k < 3; k++) {
    c[k] = raw_open(s.dport, "127.0.0.1", 4096);
    wire_msg m = {.type = WIRE_PULL_BATCH, .request_id = 20 + (uint64_t)k};
    m.u.pull_batch =
        (wire_pull_batch){.spec_hash = s.j.hash, .min_version = 0, .npieces = 4, .pieces = four};
    send_msg(c[k]->fd, &m);
  }
  /* A batch over the connection's budget is refused outright. */
  wire_piece five[5];
  for (int i = 0; i < 5; i++)
    five[i] = four[0];
  raw *big = raw_open(s.dport, "127.0.0.2", 0);
  wire_msg m = {.type = WIRE_PULL_BATCH, .request_id = 30};
  m.u.pull_batch =
      (wire_pull_batch){.spec_hash = s.j.hash, .min_version = 0, .npieces = 5, .pieces = five};
  send_msg(big->fd, &m);
  wire_msg a;
  assert_int_equal(read_frame(big, &a), 0);
  assert_int_equal(a.type, WIRE_ERROR);
  assert_int_equal(a.u.error.status, ZS_ELIMIT);
  assert_non_null(strstr(a.u.error.message, "budget"));
  /* Each stalled peer now reads its answer in turn: whole, and produced
   * only once the budget has room. */
  for (int k = 0; k < 3; k++) {
    assert_int_equal(read_frame(c[k], &a), 0);
    assert_int_equal(a.type, WIRE_PULL_BATCH_DATA);
    assert_int_equal(a.payload_len, 4 * BIG_BYTES);
  }
  uint64_t peak = proc_bytes(s.srv->pid, "VmHWM");
  printf("stalled readers: server peak %.1f MiB over %.1f MiB before (3 x 64 MiB asked, "
         "budget 96 MiB)\n",
         ((double)peak - (double)rss0) / (double)MIB, (double)rss0 / (double)MIB);
  /* Three answers at once would be 192 MiB over; one at a time is 64.
   * Under ThreadSanitizer the server's resident memory also holds the shadow
   * of every byte it touched (several times the bytes themselves), so the
   * figure says nothing about the budget there; the refusal and the whole
   * answers above are still checked. */
#if !defined(__SANITIZE_THREAD__)
  assert_true(peak < rss0 + 140 * MIB);
#endif
  for (int k = 0; k < 3; k++)
    raw_free(c[k]);
  raw_free(big);
  shard_down(&s);
}

static void one_address_that_reads_nothing_holds_only_its_share_of_the_answer_budget(void **state) {
  (void)state;
  /* 64 MiB per connection, 128 MiB in all: the address's share is a
   * quarter, 32 MiB (two 16 MiB answers). */
  const char *env[] = {"ZSHARD_DP_MAX_ANSWER_BYTES=67108864",
                       "ZSHARD_DP_MAX_ANSWER_BYTES_TOTAL=134217728", NULL};
  shard s;
  shard_up(&s, env);
  uint64_t rss0 = proc_bytes(s.srv->pid, "VmRSS");
  /* The attacker, 127.0.0.2, asks on 8 connections for 16 MiB fp32 copies
   * and reads nothing: 128 MiB, the whole server's budget, were it let. */
  enum { NATT = 8 };
  raw *att[NATT];
  for (int k = 0; k < NATT; k++) {
    att[k] = raw_open(s.dport, "127.0.0.2", 4096);
    wire_msg m = pull_of(&s, 0, 0, 40 + (uint64_t)k, ZS_DTYPE_FP32);
    send_msg(att[k]->fd, &m);
  }
  /* Until the attacker holds its share (the copies are made off the loop). */
  for (int i = 0; i < 100 && proc_bytes(s.srv->pid, "VmRSS") < rss0 + 32 * MIB; i++)
    usleep(50 * 1000);
  usleep(200 * 1000);
  /* A copy over the address's share alone is refused (48 MiB fits the
   * connection's and the server's budgets). */
  wire_piece three[3];
  for (int i = 0; i < 3; i++)
    three[i] = (wire_piece){.tensor = 0, .slice = 0, .dtype = ZS_DTYPE_FP32, .length = BIG_BYTES};
  raw *over = raw_open(s.dport, "127.0.0.2", 0);
  wire_msg m = {.type = WIRE_PULL_BATCH, .request_id = 50};
  m.u.pull_batch =
      (wire_pull_batch){.spec_hash = s.j.hash, .min_version = 0, .npieces = 3, .pieces = three};
  send_msg(over->fd, &m);
  wire_msg a;
  assert_int_equal(read_frame(over, &a), 0);
  assert_int_equal(a.type, WIRE_ERROR);
  assert_int_equal(a.u.error.status, ZS_ELIMIT);
  assert_non_null(strstr(a.u.error.message, "budget"));
  /* The trainer, another address, has its copy now: without the share it
   * would wait for the attacker's 60 s stall timeout, past the read bound
   * of connect_from. */
  raw *t = raw_open(s.dport, "127.0.0.1", 0);
  wire_msg p = pull_of(&s, 0, 0, 60, ZS_DTYPE_FP32);
  send_msg(t->fd, &p);
  assert_int_equal(read_frame(t, &a), 0);
  if (a.type == WIRE_ERROR)
    fail_msg("trainer's pull: %s: %s", zs_err_name(a.u.error.status), a.u.error.message);
  assert_int_equal(a.type, WIRE_PULL_DATA);
  assert_int_equal(a.request_id, 60);
  assert_int_equal(a.payload_len, BIG_BYTES);
  raw_free(t);
  raw_free(over);
  for (int k = 0; k < NATT; k++)
    raw_free(att[k]);
  shard_down(&s);
}

static void a_server_with_a_token_file_lets_only_its_token_on_the_data_plane(void **state) {
  (void)state;
  const char *token = "dp-trainer-token-0123456789abcdef";
  char path[512];
  snprintf(path, sizeof path, "%s/dp_trainer.token", hs_tmpdir());
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fprintf(f, "%s\n", token);
  fclose(f);
  assert_int_equal(chmod(path, 0600), 0); /* others may not read a token file */
  const char *args[] = {"--shard-id",   "0",  "--shards", "1", "--threads", "1",
                        "--token-file", path, NULL};
  hs_server *srv = hs_start(args, NULL);
  assert_non_null(srv);
  /* The data port, asked with the token (GetInfo is a trainer's call). */
  rpc_security sec = {.token = token};
  rpc_channel *ch = NULL;
  char err[256] = "";
  assert_int_equal(rpc_channel_open_secure(srv->addr, &sec, &ch, err, sizeof err), 0);
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  if (hs_get_info(ch, &info, &st) != 0)
    fail_msg("GetInfo: %s", st.message);
  int port = (int)info->data_port;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  /* The token works; another fails at once, saying why. */
  dp_client_config cc = {.addr = addr, .token = token};
  dp_client *cli = NULL;
  if (dp_client_open(&cc, &cli, err, sizeof err) != 0)
    fail_msg("dp_client_open with the token: %s", err);
  assert_int_equal(dp_client_ping_sync(cli, 10000, err, sizeof err), 0);
  dp_client_close(cli);
  cc.token = "dp-trainer-token-0123456789abcdeX";
  cli = NULL;
  assert_int_equal(dp_client_open(&cc, &cli, err, sizeof err), ZS_EUNAUTHENTICATED);
  assert_non_null(strstr(err, "refused"));
  cc.token = NULL;
  assert_int_equal(dp_client_open(&cc, &cli, err, sizeof err), ZS_EUNAUTHENTICATED);
  /* A raw peer without a token is told so and closed. */
  raw *r = raw_new(connect_from(port, "127.0.0.1", 0));
  wire_msg h = {.type = WIRE_HELLO, .request_id = 1};
  send_msg(r->fd, &h);
  wire_msg m;
  assert_int_equal(read_frame(r, &m), 0);
  assert_int_equal(m.type, WIRE_ERROR);
  assert_int_equal(m.u.error.status, ZS_EUNAUTHENTICATED);
  assert_int_equal(read_frame(r, &m), 1);
  raw_free(r);
  assert_int_equal(hs_stop(srv), 0);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

static int group_teardown(void **state) {
  (void)state;
  hs_finish(0);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_push_batch_of_1_gib_with_a_bogus_hash_is_refused_before_any_allocation),
      cmocka_unit_test(idle_connections_from_one_address_leave_room_for_a_trainer),
      cmocka_unit_test(connections_that_park_a_pull_and_close_free_their_slots),
      cmocka_unit_test(waiting_pulls_do_not_stop_the_push_they_wait_for),
      cmocka_unit_test(stalled_readers_of_large_answers_hold_at_most_the_answer_budget),
      cmocka_unit_test(one_address_that_reads_nothing_holds_only_its_share_of_the_answer_budget),
      cmocka_unit_test(a_server_with_a_token_file_lets_only_its_token_on_the_data_plane),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
