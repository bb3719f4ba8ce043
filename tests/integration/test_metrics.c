/*
 * test_metrics — operating a shard: the /metrics endpoint and `zshard status`.
 *
 * A real zshard-server is driven through a training step over gRPC; its
 * /metrics page must count exactly what was done (pushes, duplicates,
 * rejections, pulls, bytes, applies, requests per method, the parked Pull and
 * GradStats calls), be valid Prometheus text according to `promtool check
 * metrics` (Debian's prometheus package; the test fails when promtool is
 * missing), and shrug off bad HTTP requests (404/405/431 answers, 400 or a
 * closed connection for malformed ones, a refusal over the connection limit)
 * while the shard goes on serving. `zshard status` must report the same counts, the
 * process's memory and a push rate that agrees with its two samples, and
 * --watch must repeat the table --count times (clearing the screen only on a
 * terminal).
 *
 * The CLI comes from the build (ZSHARD_CLI_BIN, set by tests/CMakeLists.txt).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "internal.h"
#include "server/metrics/metrics.h"
#include "tests/integration/harness.h"
#include "zshard/zshard.h"

#ifndef ZSHARD_CLI_BIN
#error "ZSHARD_CLI_BIN must name the zshard CLI (tests/CMakeLists.txt sets it)"
#endif

extern char **environ;

/* Every wait here polls a condition and gives up after this long. */
#define WAIT_MS 20000u
/* The server's limit of connections served at once (metrics_http.h). */
#define MAX_CONNECTIONS 16

/* ------------------------------------------------------------ servers */

typedef struct mserver {
  hs_server *srv;
  int metrics_port;
} mserver;

static int read_int_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  int v = 0;
  if (fscanf(f, "%d", &v) != 1)
    v = 0;
  fclose(f);
  return v;
}

/* A single-shard server with the metrics endpoint on a free port. The
 * server writes the metrics port file before its gRPC port file, which
 * hs_start waits for, so the port is known when this returns. */
static void mserver_start(mserver *m) {
  static unsigned seq;
  char path[600];
  snprintf(path, sizeof path, "%s/metrics-%u.port", hs_tmpdir(), ++seq);
  const char *args[] = {
      "--shards", "1", "--threads", "1", "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
      path,       NULL};
  m->srv = hs_start(args, NULL);
  assert_non_null(m->srv);
  m->metrics_port = read_int_file(path);
  assert_true(m->metrics_port > 0);
}

static void mserver_stop(mserver *m) {
  assert_int_equal(hs_stop(m->srv), 0);
  m->srv = NULL;
}

/* ------------------------------------------------------------ HTTP */

typedef struct http_resp {
  int status;
  char *text; /* the whole answer, NUL-terminated */
  size_t len;
  const char *body; /* inside text */
  size_t body_len;
} http_resp;

static void http_free(http_resp *r) {
  free(r->text);
  memset(r, 0, sizeof *r);
}

static int connect_local(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  /* Reads are bounded: a server that never answers fails the test instead
   * of hanging it. */
  struct timeval tv = {WAIT_MS / 1000, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    fail_msg("connect to 127.0.0.1:%d: %s", port, strerror(errno));
  return fd;
}

static void send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      fail_msg("send: %s", strerror(errno));
    p += w;
    n -= (size_t)w;
  }
}

/* Reads the answer on fd until the server closes the connection. */
static void read_answer(int fd, http_resp *out) {
  memset(out, 0, sizeof *out);
  size_t cap = 65536, len = 0;
  char *buf = malloc(cap);
  assert_non_null(buf);
  for (;;) {
    if (len + 1 == cap) {
      cap *= 2;
      buf = realloc(buf, cap);
      assert_non_null(buf);
    }
    ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && errno == ECONNRESET && len == 0) {
      /* Refused before anything was read: status -1, for the callers that
       * accept a refusal; every other caller's status check fails on it. */
      free(buf);
      out->status = -1;
      out->text = strdup("(connection reset)");
      return;
    }
    if (r < 0)
      fail_msg("recv: %s (no answer from the metrics server)", strerror(errno));
    if (r == 0 && len == 0) {
      /* Closed without a word: status 0, like a reset for the callers. */
      free(buf);
      out->status = 0;
      out->text = strdup("(closed without an answer)");
      return;
    }
    if (r == 0)
      break;
    len += (size_t)r;
  }
  buf[len] = '\0';
  out->text = buf;
  out->len = len;
  if (sscanf(buf, "HTTP/1.1 %d ", &out->status) != 1)
    fail_msg("not an HTTP/1.1 answer: %.200s", buf);
  char *end = strstr(buf, "\r\n\r\n");
  assert_non_null(end);
  out->body = end + 4;
  out->body_len = len - (size_t)(out->body - buf);
}

/* Sends `req` (len bytes) on a new connection and reads the whole answer. */
static void http_exchange(int port, const char *req, size_t len, http_resp *out) {
  int fd = connect_local(port);
  send_all(fd, req, len);
  read_answer(fd, out);
  close(fd);
}

static void http_req(int port, const char *req, http_resp *out) {
  http_exchange(port, req, strlen(req), out);
}

/* GET /metrics; the page (the caller frees it). */
static char *scrape(int port) {
  http_resp r;
  http_req(port, "GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n", &r);
  if (r.status != 200)
    fail_msg("GET /metrics answered %d:\n%s", r.status, r.text);
  assert_non_null(strstr(r.text, "\r\nContent-Type: text/plain; version=0.0.4"));
  char *page = strndup(r.body, r.body_len);
  assert_non_null(page);
  http_free(&r);
  return page;
}

/* ------------------------------------------------------------ the page */

/* The value of the sample whose name and labels are exactly `series` (as in
 * zshard_pushes_total{shard="0"}); fails the test when it is absent. */
static double value_of(const char *page, const char *series) {
  size_t n = strlen(series);
  for (const char *p = page; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    if (strncmp(p, series, n) == 0 && p[n] == ' ') {
      char *end;
      double v = strtod(p + n + 1, &end);
      if (end == p + n + 1)
        fail_msg("sample %s has no number", series);
      return v;
    }
  }
  fail_msg("no sample %s on the page:\n%s", series, page);
  return NAN;
}

static uint64_t count_of(const char *page, const char *series) {
  double v = value_of(page, series);
  if (v < 0 || v != floor(v))
    fail_msg("%s is %g, not a count", series, v);
  return (uint64_t)v;
}

static uint64_t requests_of(const char *page, const char *method) {
  char s[160];
  snprintf(s, sizeof s,
           "zshard_request_duration_seconds_count{shard=\"0\",transport=\"grpc\",method=\"%s\"}",
           method);
  return count_of(page, s);
}

static uint64_t errors_of(const char *page, const char *method) {
  char s[160];
  snprintf(s, sizeof s, "zshard_request_errors_total{shard=\"0\",transport=\"grpc\",method=\"%s\"}",
           method);
  return count_of(page, s);
}

/* Every bucket series of a histogram: cumulative counts that never fall,
 * ending in le="+Inf" equal to _count. */
static void expect_histogram_consistent(const char *page, const char *name, const char *labels) {
  char prefix[256], count[256];
  snprintf(prefix, sizeof prefix, "%s_bucket{shard=\"0\"%s,le=\"", name, labels);
  snprintf(count, sizeof count, "%s_count{shard=\"0\"%s}", name, labels);
  size_t n = strlen(prefix);
  double last = -1;
  int buckets = 0, inf = 0;
  for (const char *p = page; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    if (strncmp(p, prefix, n) != 0)
      continue;
    const char *sp = strchr(p, ' ');
    assert_non_null(sp);
    double v = strtod(sp + 1, NULL);
    if (v < last)
      fail_msg("%s: bucket %.*s holds %g, less than the bucket before (%g)", name,
               (int)(sp - p - n), p + n, v, last);
    last = v;
    buckets++;
    inf = strncmp(p + n, "+Inf\"", 5) == 0;
  }
  assert_true(buckets > 1);
  assert_true(inf); /* the last bucket is +Inf */
  assert_true(last == value_of(page, count));
}

/* Every sample line carries the shard label. */
static void expect_shard_label_everywhere(const char *page) {
  for (const char *p = page; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    if (*p == '#' || *p == '\n')
      continue;
    const char *nl = strchr(p, '\n');
    size_t len = nl ? (size_t)(nl - p) : strlen(p);
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)(len < 511 ? len : 511), p);
    if (!strstr(line, "{shard=\"0\""))
      fail_msg("sample without the shard label: %s", line);
  }
}

/* ------------------------------------------------------------ promtool */

static const char *find_promtool(char *buf, size_t cap) {
  const char *path = getenv("PATH");
  if (!path)
    path = "/usr/local/bin:/usr/bin:/bin";
  while (*path) {
    size_t n = strcspn(path, ":");
    snprintf(buf, cap, "%.*s/promtool", (int)n, path);
    if (n > 0 && access(buf, X_OK) == 0)
      return buf;
    path += n + (path[n] == ':');
  }
  return NULL;
}

/* Runs `promtool check metrics` on the page; fails the test with promtool's
 * words unless it is satisfied (exit 0, which also means no lint problem). */
static void expect_promtool_accepts(const char *page) {
  char bin[1024];
  if (!find_promtool(bin, sizeof bin))
    fail_msg("promtool is not installed: it comes with Debian's `prometheus` package "
             "(scripts/setup installs it; or: apt-get install prometheus)");
  char in_path[600], out_path[600];
  snprintf(in_path, sizeof in_path, "%s/page.prom", hs_tmpdir());
  snprintf(out_path, sizeof out_path, "%s/promtool.out", hs_tmpdir());
  FILE *f = fopen(in_path, "w");
  assert_non_null(f);
  assert_int_equal(fwrite(page, 1, strlen(page), f), strlen(page));
  assert_int_equal(fclose(f), 0);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, in_path, O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out_path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  char *argv[] = {bin, "check", "metrics", NULL};
  pid_t pid;
  int rc = posix_spawn(&pid, bin, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  assert_int_equal(rc, 0);
  int ws;
  while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
    char said[4096] = "";
    FILE *o = fopen(out_path, "r");
    if (o) {
      size_t k = fread(said, 1, sizeof said - 1, o);
      said[k] = '\0';
      fclose(o);
    }
    fail_msg("promtool check metrics refused the page (status %d):\n%s",
             WIFEXITED(ws) ? WEXITSTATUS(ws) : -1, said);
  }
}

/* ------------------------------------------------------------ the job */

typedef struct job {
  hs_job j;
  uint64_t piece_bytes; /* fp32 bytes of all pieces together */
  float *zeros;         /* as long as the largest piece */
} job;

static void job_open(job *jb, const hs_server *srv, uint32_t W) {
  memset(jb, 0, sizeof *jb);
  spec sp;
  assert_int_equal(hs_spec_build(&sp, "metrics-test", W, 1, 1), 0);
  const char *addrs[] = {srv->addr};
  assert_int_equal(hs_job_init(&jb->j, &sp, addrs), 0);
  rpc_status st;
  if (hs_job_open(&jb->j, 0, &st))
    fail_msg("Open: %s", st.message);
  uint64_t maxn = 0;
  for (uint32_t i = 0; i < jb->j.lay.num_pieces; i++) {
    uint64_t n = jb->j.lay.pieces[i].numel;
    jb->piece_bytes += n * sizeof(float);
    maxn = n > maxn ? n : maxn;
  }
  jb->zeros = calloc(maxn, sizeof(float));
  assert_non_null(jb->zeros);
  const spec *s = &jb->j.sp;
  float **w = calloc(s->num_tensors, sizeof *w);
  assert_non_null(w);
  for (uint32_t t = 0; t < s->num_tensors; t++) {
    w[t] = calloc(s->tensors[t].numel, sizeof(float));
    assert_non_null(w[t]);
    for (uint64_t i = 0; i < s->tensors[t].numel; i++)
      w[t][i] = 0.01f * (float)(i % 7);
  }
  if (hs_job_init_params(&jb->j, w, &st))
    fail_msg("InitParams: %s", st.message);
  for (uint32_t t = 0; t < s->num_tensors; t++)
    free(w[t]);
  free(w);
}

static void job_close(job *jb) {
  free(jb->zeros);
  hs_job_free(&jb->j);
}

/* Pushes piece i of rank r for `step` (zero gradients); returns the status. */
static int push_piece(job *jb, uint64_t step, uint32_t rank, uint32_t i, int *dup) {
  const layout_piece *p = &jb->j.lay.pieces[i];
  rpc_status st;
  return hs_push(jb->j.ch[0], jb->j.hash, step, rank, 0, p->tensor, p->slice, ZS_DTYPE_FP32,
                 jb->zeros, (size_t)p->numel * sizeof(float), dup, &st);
}

/* Every contribution of `step` from every rank; returns the pushes made. */
static uint64_t push_step(job *jb, uint64_t step) {
  uint64_t n = 0;
  for (uint32_t r = 0; r < jb->j.sp.world_size; r++)
    for (uint32_t i = 0; i < jb->j.lay.num_pieces; i++) {
      int dup = 1;
      assert_int_equal(push_piece(jb, step, r, i, &dup), 0);
      assert_false(dup);
      n++;
    }
  return n;
}

static void stats_and_apply(job *jb, uint64_t step) {
  Zshard__V1__GradStatsResponse *g = NULL;
  rpc_status st;
  if (hs_grad_stats(jb->j.ch[0], jb->j.hash, step, 20000, &g, &st))
    fail_msg("GradStats: %s", st.message);
  assert_true(g->complete);
  protobuf_c_message_free_unpacked(&g->base, NULL);
  Zshard__V1__ApplyResponse *a = NULL;
  if (hs_apply(jb->j.ch[0], jb->j.hash, step, 1e-3, 1.0f, 0, &a, &st))
    fail_msg("Apply: %s", st.message);
  assert_int_equal(a->version, step);
  protobuf_c_message_free_unpacked(&a->base, NULL);
}

static Zshard__V1__StatsResponse *get_stats(rpc_channel *ch) {
  Zshard__V1__StatsRequest req = ZSHARD__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  rpc_status st;
  if (rpc_call(ch, "/zshard.v1.ZShard/Stats", &req.base, &zshard__v1__stats_response__descriptor,
               &resp, HS_CALL_TIMEOUT_MS, &st))
    fail_msg("Stats: %s", st.message);
  return (Zshard__V1__StatsResponse *)resp;
}

/* ------------------------------------------------------------ threads that wait */

typedef struct waiter {
  job *jb;
  uint64_t step;
  int rc;
  uint64_t version;
  int complete;
} waiter;

static void *pull_waiter(void *arg) {
  waiter *w = arg;
  const layout_piece *p = &w->jb->j.lay.pieces[0];
  float *dst = malloc(p->numel * sizeof(float));
  rpc_status st;
  w->rc = hs_pull(w->jb->j.ch[0], w->jb->j.hash, p->tensor, p->slice, w->step, ZS_DTYPE_FP32, 30000,
                  dst, (size_t)p->numel * sizeof(float), &w->version, &st);
  free(dst);
  return NULL;
}

static void *stats_waiter(void *arg) {
  waiter *w = arg;
  Zshard__V1__GradStatsResponse *g = NULL;
  rpc_status st;
  w->rc = hs_grad_stats(w->jb->j.ch[0], w->jb->j.hash, w->step, 30000, &g, &st);
  if (w->rc == 0) {
    w->complete = g->complete;
    protobuf_c_message_free_unpacked(&g->base, NULL);
  }
  return NULL;
}

static void pause_10ms(void) {
  struct timespec ts = {0, 10000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ tests: /metrics */

static void metrics_count_exactly_what_the_shard_did_and_pass_promtool(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);

  /* Before any job: zeros, and already a valid page. */
  char *page = scrape(m.metrics_port);
  expect_promtool_accepts(page);
  assert_int_equal(count_of(page, "zshard_pushes_total{shard=\"0\"}"), 0);
  assert_int_equal(count_of(page, "zshard_job_open{shard=\"0\"}"), 0);
  assert_int_equal(count_of(page, "zshard_state_bytes{shard=\"0\"}"), 0);
  assert_true(value_of(page, "process_resident_memory_bytes{shard=\"0\"}") > 1e6);
  assert_non_null(strstr(page, "\nzshard_build_info{shard=\"0\",version=\""));
  free(page);

  job jb;
  job_open(&jb, m.srv, 2);
  const uint32_t np = jb.j.lay.num_pieces;
  const uint64_t piece0_bytes = jb.j.lay.pieces[0].numel * sizeof(float);

  /* Step 1: every contribution once, one of them again (a retry), and one
   * for a step that is not next (refused, changes nothing). */
  uint64_t pushes = push_step(&jb, 1);
  int dup = 0;
  assert_int_equal(push_piece(&jb, 1, 0, 0, &dup), 0);
  assert_true(dup);
  assert_int_equal(push_piece(&jb, 5, 0, 0, &dup), ZS_ESTEP);
  stats_and_apply(&jb, 1);
  float **got = calloc(jb.j.sp.num_tensors, sizeof *got);
  for (uint32_t t = 0; t < jb.j.sp.num_tensors; t++)
    got[t] = calloc(jb.j.sp.tensors[t].numel, sizeof(float));
  uint64_t version = 0;
  rpc_status st;
  if (hs_job_pull(&jb.j, 1, got, &version, &st))
    fail_msg("Pull: %s", st.message);
  assert_int_equal(version, 1);
  for (uint32_t t = 0; t < jb.j.sp.num_tensors; t++)
    free(got[t]);
  free(got);
  Zshard__V1__GetInfoResponse *info = NULL;
  assert_int_equal(hs_get_info(jb.j.ch[0], &info, &st), 0);
  Zshard__V1__StatsResponse *stats = get_stats(jb.j.ch[0]);

  page = scrape(m.metrics_port);
  expect_promtool_accepts(page);
  expect_shard_label_everywhere(page);
  /* The core's counters. */
  assert_int_equal(count_of(page, "zshard_pushes_total{shard=\"0\"}"), pushes + 1);
  assert_int_equal(count_of(page, "zshard_duplicate_pushes_total{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_rejected_pushes_total{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_received_bytes_total{shard=\"0\"}"),
                   2 * jb.piece_bytes + piece0_bytes);
  assert_int_equal(count_of(page, "zshard_pulls_total{shard=\"0\"}"), np);
  /* Each answer is the piece's bytes plus a few bytes of protobuf framing. */
  uint64_t sent = count_of(page, "zshard_sent_bytes_total{shard=\"0\"}");
  assert_true(sent >= jb.piece_bytes && sent <= jb.piece_bytes + 32u * np);
  assert_int_equal(count_of(page, "zshard_applies_total{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_skipped_steps_total{shard=\"0\"}"), 0);
  assert_int_equal(count_of(page, "zshard_version{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_job_open{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_initialized{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_held_bytes{shard=\"0\"}"), 0);
  assert_int_equal(count_of(page, "zshard_state_bytes{shard=\"0\"}"), info->state_bytes);
  assert_int_equal(count_of(page, "zshard_parameters{shard=\"0\"}"), info->elements);
  assert_int_equal(count_of(page, "zshard_shards{shard=\"0\"}"), 1);
  assert_int_equal(count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"Pull\"}"), 0);
  assert_int_equal(count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"GradStats\"}"), 0);
  assert_true(value_of(page, "zshard_uptime_seconds{shard=\"0\"}") > 0);
  /* The same numbers as the Stats method, and RSS from both. */
  assert_int_equal(stats->pushes, pushes + 1);
  assert_int_equal(stats->bytes_out, sent);
  assert_true(stats->rss_bytes > 1000000);
  assert_true(value_of(page, "process_resident_memory_bytes{shard=\"0\"}") > 1e6);
  /* One apply in the apply histogram. */
  assert_int_equal(count_of(page, "zshard_apply_duration_seconds_count{shard=\"0\"}"), 1);
  expect_histogram_consistent(page, "zshard_apply_duration_seconds", "");
  /* Every call answered, per method; only the refused push is an error. */
  assert_int_equal(requests_of(page, "Open"), 1);
  assert_int_equal(requests_of(page, "InitParams"), np);
  assert_int_equal(requests_of(page, "Push"), pushes + 2);
  assert_int_equal(requests_of(page, "GradStats"), 1);
  assert_int_equal(requests_of(page, "Apply"), 1);
  assert_int_equal(requests_of(page, "Pull"), np);
  assert_int_equal(requests_of(page, "GetInfo"), 1);
  assert_int_equal(requests_of(page, "Stats"), 1);
  assert_int_equal(requests_of(page, "Check"), 0);
  assert_int_equal(errors_of(page, "Push"), 1);
  assert_int_equal(errors_of(page, "Pull"), 0);
  assert_int_equal(errors_of(page, "Open"), 0);
  expect_histogram_consistent(page, "zshard_request_duration_seconds",
                              ",transport=\"grpc\",method=\"Push\"");
  expect_histogram_consistent(page, "zshard_request_duration_seconds",
                              ",transport=\"grpc\",method=\"Pull\"");
  /* A Watch stream's life is no latency: it has no series. */
  assert_null(strstr(page, "method=\"Watch\""));
  free(page);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  protobuf_c_message_free_unpacked(&stats->base, NULL);

  /* Step 2: a Pull of version 2 and a GradStats of step 2 park in the shard
   * until the step's pushes are in; the gauge shows them while they wait. */
  waiter pw = {.jb = &jb, .step = 2, .rc = -1}, gw = {.jb = &jb, .step = 2, .rc = -1};
  pthread_t pt, gt;
  assert_int_equal(pthread_create(&pt, NULL, pull_waiter, &pw), 0);
  assert_int_equal(pthread_create(&gt, NULL, stats_waiter, &gw), 0);
  uint64_t end = clock_now_ms() + WAIT_MS;
  for (;;) {
    page = scrape(m.metrics_port);
    uint64_t wp = count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"Pull\"}");
    uint64_t ws = count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"GradStats\"}");
    free(page);
    if (wp == 1 && ws == 1)
      break;
    if (clock_now_ms() > end)
      fail_msg("the waiting Pull and GradStats never showed: Pull %" PRIu64 ", GradStats %" PRIu64,
               wp, ws);
    pause_10ms();
  }
  pushes += push_step(&jb, 2);
  pthread_join(gt, NULL);
  assert_int_equal(gw.rc, 0);
  assert_true(gw.complete);
  Zshard__V1__ApplyResponse *a = NULL;
  assert_int_equal(hs_apply(jb.j.ch[0], jb.j.hash, 2, 1e-3, 1.0f, 0, &a, &st), 0);
  protobuf_c_message_free_unpacked(&a->base, NULL);
  pthread_join(pt, NULL);
  assert_int_equal(pw.rc, 0);
  assert_int_equal(pw.version, 2);

  page = scrape(m.metrics_port);
  expect_promtool_accepts(page);
  assert_int_equal(count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"Pull\"}"), 0);
  assert_int_equal(count_of(page, "zshard_waiting_requests{shard=\"0\",method=\"GradStats\"}"), 0);
  assert_int_equal(count_of(page, "zshard_version{shard=\"0\"}"), 2);
  assert_int_equal(count_of(page, "zshard_applies_total{shard=\"0\"}"), 2);
  assert_int_equal(count_of(page, "zshard_apply_duration_seconds_count{shard=\"0\"}"), 2);
  assert_int_equal(count_of(page, "zshard_pushes_total{shard=\"0\"}"), pushes + 1);
  assert_int_equal(requests_of(page, "Pull"), np + 1);
  assert_int_equal(requests_of(page, "GradStats"), 2);
  free(page);

  job_close(&jb);
  mserver_stop(&m);
}

/* The data plane's requests have their own series: a trainer on the default
 * transport pushes and pulls a large tensor (single-piece frames) and small
 * ones (batches), and every one of them is counted with its latency. */
static void data_plane_requests_are_timed_per_method(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = m.srv->addr;
  o.job = "metrics-data";
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  const uint64_t numel[3] = {400000, 100, 7}; /* 1.6 MB alone; two in one bucket */
  float *w[3];
  for (uint32_t t = 0; t < 3; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, numel[t], 0, NULL, 0, NULL), ZS_OK);
    w[t] = calloc(numel[t], sizeof(float));
    assert_non_null(w[t]);
  }
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  assert_int_equal(zc_shard_transport(c, 0), ZS_TRANSPORT_DATA);
  for (uint32_t t = 0; t < 3; t++)
    assert_int_equal(zs_pull(c, t, w[t], ZS_DTYPE_FP32, numel[t] * 4, NULL), ZS_OK);
  for (uint32_t t = 0; t < 3; t++)
    assert_int_equal(zs_push(c, t, 0, w[t], ZS_DTYPE_FP32, numel[t] * 4, NULL), ZS_OK);
  assert_int_equal(zs_step(c, 1e-3, 0, 0, NULL), ZS_OK);

  char *page = scrape(m.metrics_port);
  expect_promtool_accepts(page);
  const char *methods[4] = {"Push", "Pull", "PushBatch", "PullBatch"};
  uint64_t n[4];
  for (int i = 0; i < 4; i++) {
    char series[160], labels[96];
    snprintf(series, sizeof series,
             "zshard_request_duration_seconds_count{shard=\"0\",transport=\"data\",method=\"%s\"}",
             methods[i]);
    n[i] = count_of(page, series);
    snprintf(labels, sizeof labels, ",transport=\"data\",method=\"%s\"", methods[i]);
    expect_histogram_consistent(page, "zshard_request_duration_seconds", labels);
    snprintf(series, sizeof series,
             "zshard_request_errors_total{shard=\"0\",transport=\"data\",method=\"%s\"}",
             methods[i]);
    assert_int_equal(count_of(page, series), 0);
  }
  /* Every piece went in one frame or another: the large tensor alone, the
   * two small ones in batches or alone, however the client grouped them. */
  assert_true(n[0] >= 1 && n[1] >= 1);
  assert_int_equal(n[0] + n[2] >= 2, 1);
  assert_int_equal(n[1] + n[3] >= 2, 1);
  assert_true(n[0] + n[2] <= 3 && n[1] + n[3] <= 3);
  /* The data plane's own families: this client's connection, its frames
   * and bytes (the 1.6 MB push at least, both ways), no errors. */
  assert_true(count_of(page, "zshard_dp_connections{shard=\"0\"}") >= 1);
  assert_true(count_of(page, "zshard_dp_accepted_total{shard=\"0\"}") >= 1);
  assert_true(count_of(page, "zshard_dp_frames_received_total{shard=\"0\"}") >=
              n[0] + n[1] + n[2] + n[3]);
  assert_true(count_of(page, "zshard_dp_frames_sent_total{shard=\"0\"}") >=
              n[0] + n[1] + n[2] + n[3]);
  assert_true(count_of(page, "zshard_dp_received_bytes_total{shard=\"0\"}") >= numel[0] * 4);
  assert_true(count_of(page, "zshard_dp_sent_bytes_total{shard=\"0\"}") >= numel[0] * 4);
  const char *zero[] = {"protocol_errors_total", "crc_errors_total",    "stalled_closed_total",
                        "auth_refused_total",    "limit_refused_total", "pins_released_total"};
  for (size_t i = 0; i < sizeof zero / sizeof zero[0]; i++) {
    char series[96];
    snprintf(series, sizeof series, "zshard_dp_%s{shard=\"0\"}", zero[i]);
    assert_int_equal(count_of(page, series), 0);
  }
  free(page);
  assert_int_equal(zs_client_close(c), ZS_OK);
  c = NULL;
  /* The connection's close is counted once the shard's loop has seen it. */
  uint64_t t0 = clock_now_ms();
  for (;;) {
    page = scrape(m.metrics_port);
    uint64_t open = count_of(page, "zshard_dp_connections{shard=\"0\"}");
    free(page);
    if (open == 0)
      break;
    assert_true(clock_now_ms() - t0 < WAIT_MS);
    pause_10ms();
  }
  for (uint32_t t = 0; t < 3; t++)
    free(w[t]);
  mserver_stop(&m);
}

/* The status line of an answer to `req`. */
static int status_of(int port, const char *req) {
  http_resp r;
  http_req(port, req, &r);
  int code = r.status;
  http_free(&r);
  return code;
}

/* A malformed request is answered 400 (505 for an HTTP version other than
 * 1.x) or its connection is closed without an answer (-1 or 0): never
 * served. Which of these is libmicrohttpd's choice. */
static void expect_malformed_refused(int port, const char *req, size_t len) {
  http_resp r;
  http_exchange(port, req, len, &r);
  if (r.status != 400 && r.status != 505 && r.status != 0 && r.status != -1)
    fail_msg("malformed request %.40s answered %d", req, r.status);
  http_free(&r);
}

static void bad_http_requests_get_their_4xx_and_the_shard_serves_on(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);
  job jb;
  job_open(&jb, m.srv, 1);
  uint64_t pushes = push_step(&jb, 1);
  int port = m.metrics_port;

  http_resp r;
  /* Other methods: 405 naming the ones allowed; the body sent along is read
   * and dropped, so the answer arrives whole. */
  http_req(port, "POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello", &r);
  assert_int_equal(r.status, 405);
  assert_non_null(strstr(r.text, "\r\nAllow: GET, HEAD\r\n"));
  http_free(&r);
  assert_int_equal(status_of(port, "DELETE /metrics HTTP/1.1\r\n\r\n"), 405);
  assert_int_equal(status_of(port, "PATCH /metrics HTTP/1.1\r\nHost: t\r\n\r\n"), 405);
  /* Other paths: 404, whatever the method. */
  assert_int_equal(status_of(port, "GET / HTTP/1.1\r\n\r\n"), 404);
  assert_int_equal(status_of(port, "GET /metricsx HTTP/1.1\r\n\r\n"), 404);
  assert_int_equal(status_of(port, "GET /metrics/ HTTP/1.1\r\n\r\n"), 404);
  assert_int_equal(status_of(port, "PUT /admin HTTP/1.1\r\n\r\n"), 404);
  assert_int_equal(status_of(port, "HEAD /nothing/here HTTP/1.1\r\n\r\n"), 404);
  /* Malformed requests are refused; the ones the endpoint itself checks
   * (a method that is not a token, a target that is not a path) get 400. */
  static const char *const malformed[] = {
      "garbage\r\n\r\n",
      "GET /metrics\r\n\r\n",
      "GET /metrics HTTP/2.0\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
      "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", /* a TLS hello, roughly */
  };
  for (size_t i = 0; i < sizeof malformed / sizeof *malformed; i++)
    expect_malformed_refused(port, malformed[i], strlen(malformed[i]));
  assert_int_equal(status_of(port, "GET metrics HTTP/1.1\r\n\r\n"), 400);
  assert_int_equal(status_of(port, "G(T /metrics HTTP/1.1\r\n\r\n"), 400);
  /* A header block over the bound: 431, and the rest of it is dropped. */
  size_t big = 3 * 8192;
  char *huge = malloc(big + 64);
  assert_non_null(huge);
  int k = snprintf(huge, 64, "GET /metrics HTTP/1.1\r\nX-Pad: ");
  memset(huge + k, 'a', big - (size_t)k - 4);
  memcpy(huge + big - 4, "\r\n\r\n", 4);
  http_exchange(port, huge, big, &r);
  assert_int_equal(r.status, 431);
  http_free(&r);
  free(huge);
  /* Accepted forms: HEAD (the length, no body), a query string, HTTP/1.0,
   * bare LF line ends, empty lines before the request line. */
  http_req(port, "HEAD /metrics HTTP/1.1\r\nHost: t\r\n\r\n", &r);
  assert_int_equal(r.status, 200);
  assert_int_equal(r.body_len, 0);
  assert_non_null(strstr(r.text, "\r\nContent-Length: "));
  assert_null(strstr(r.text, "Content-Length: 0\r\n"));
  http_free(&r);
  assert_int_equal(status_of(port, "GET /metrics?name[]=x HTTP/1.1\r\n\r\n"), 200);
  assert_int_equal(status_of(port, "GET /metrics HTTP/1.0\r\n\r\n"), 200);
  assert_int_equal(status_of(port, "GET /metrics HTTP/1.1\nHost: t\n\n"), 200);
  assert_int_equal(status_of(port, "\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n"), 200);

  /* A client that sends half a request and waits holds only its own
   * connection: a scrape beside it is answered. */
  int idle = connect_local(port);
  send_all(idle, "GET /metr", 9);
  char *page = scrape(port);
  free(page);
  /* A request split into single bytes is still one request. */
  int slow = connect_local(port);
  const char *req = "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n";
  for (const char *p = req; *p; p++)
    send_all(slow, p, 1);
  read_answer(slow, &r);
  assert_int_equal(r.status, 200);
  http_free(&r);
  close(slow);

  /* With every connection slot held by idle clients, one more is refused
   * (closed) at once rather than queued behind them. */
  int held[MAX_CONNECTIONS];
  for (int i = 0; i < MAX_CONNECTIONS; i++)
    held[i] = connect_local(port);
  int extra = connect_local(port);
  read_answer(extra, &r);
  if (r.status != 0 && r.status != -1)
    fail_msg("a connection over the limit was answered %d, not refused", r.status);
  http_free(&r);
  close(extra);
  /* The shard itself does not notice any of this. */
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  assert_int_equal(hs_get_info(jb.j.ch[0], &info, &st), 0);
  assert_true(info->serving);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  close(idle);
  for (int i = 0; i < MAX_CONNECTIONS; i++)
    close(held[i]);
  /* Once they hang up their slots are free again. */
  uint64_t end = clock_now_ms() + WAIT_MS;
  for (;;) {
    int code = status_of(port, "GET /metrics HTTP/1.1\r\n\r\n");
    if (code == 200)
      break;
    /* Still full: closed, or reset when the refusal raced the request. */
    if (code != 0 && code != -1)
      fail_msg("expected 200 or a refusal once the clients left, got %d", code);
    if (clock_now_ms() > end)
      fail_msg("the metrics server kept refusing after its clients left");
    pause_10ms();
  }

  /* The step goes on as if nothing happened, and the counts are untouched. */
  stats_and_apply(&jb, 1);
  page = scrape(port);
  assert_int_equal(count_of(page, "zshard_pushes_total{shard=\"0\"}"), pushes);
  assert_int_equal(count_of(page, "zshard_rejected_pushes_total{shard=\"0\"}"), 0);
  assert_int_equal(count_of(page, "zshard_version{shard=\"0\"}"), 1);
  free(page);
  job_close(&jb);
  mserver_stop(&m);
}

/* Expects the server to close `fd` (a read of 0, or a reset) within
 * WAIT_MS: connect_local bounds the read. */
static void expect_closed_by_server(int fd, const char *who) {
  char buf[256];
  for (;;) {
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r > 0)
      continue; /* an answer, if any, before the close */
    if (r == 0 || (r < 0 && errno == ECONNRESET))
      return;
    if (errno == EINTR)
      continue;
    fail_msg("%s was not closed by the server: %s", who, strerror(errno));
  }
}

static void quiet_clients_hold_up_no_scrape_and_are_closed_at_their_timeout(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);
  int port = m.metrics_port;
  /* One client that connects and says nothing, one that stops halfway
   * through its request line, one that asks and never reads. */
  int silent = connect_local(port);
  int half = connect_local(port);
  const char *partial = "GET /metrics HTTP/1.1\r\nHo";
  send_all(half, partial, strlen(partial));
  int deaf = connect_local(port);
  const char *req = "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n";
  send_all(deaf, req, strlen(req));
  /* Scrapes beside them are answered, one after another. */
  for (int i = 0; i < 3; i++) {
    char *page = scrape(port);
    assert_non_null(strstr(page, "# TYPE zshard_pushes_total counter\n"));
    free(page);
  }
  /* The quiet ones are closed by the server's timeout (10 s), not left to
   * hold their slots for ever. */
  expect_closed_by_server(silent, "a silent client");
  expect_closed_by_server(half, "a client with half a request");
  close(silent);
  close(half);
  close(deaf);
  char *page = scrape(port);
  free(page);
  mserver_stop(&m);
}

static void metrics_flags_are_checked_and_the_endpoint_is_off_by_default(void **state) {
  (void)state;
  char out[4096];
  /* --help documents the flags (tests/deploy/run-k8s-check reads it). */
  const char *help[] = {"--help", NULL};
  assert_int_equal(hs_run(help, NULL, out, sizeof out), 0);
  assert_non_null(strstr(out, "\n  --metrics-listen ADDR"));
  assert_non_null(strstr(out, "\n  --metrics-port-file PATH"));
  /* A port file with nothing to report is a usage error. */
  const char *nolisten[] = {"--listen", "127.0.0.1:0", "--metrics-port-file", "/dev/null", NULL};
  assert_int_equal(hs_run(nolisten, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "needs --metrics-listen"));
  /* An address that is not host:port, or is taken, stops the start. */
  const char *bad[] = {"--listen", "127.0.0.1:0", "--metrics-listen", "nonsense", NULL};
  assert_int_equal(hs_run(bad, NULL, out, sizeof out), 1);
  assert_non_null(strstr(out, "stage=metrics"));
  mserver m;
  mserver_start(&m);
  char busy[32];
  snprintf(busy, sizeof busy, "127.0.0.1:%d", m.metrics_port);
  const char *taken[] = {"--listen", "127.0.0.1:0", "--metrics-listen", busy, NULL};
  assert_int_equal(hs_run(taken, NULL, out, sizeof out), 1);
  assert_non_null(strstr(out, "cannot listen on metrics address"));
  mserver_stop(&m);

  /* The environment works like the flags ... */
  char port_path[600], port_env[700];
  snprintf(port_path, sizeof port_path, "%s/env-metrics.port", hs_tmpdir());
  snprintf(port_env, sizeof port_env, "ZSHARD_METRICS_PORT_FILE=%s", port_path);
  const char *env[] = {"ZSHARD_METRICS_LISTEN=127.0.0.1:0", port_env, NULL};
  hs_server *s = hs_start(NULL, env);
  assert_non_null(s);
  int port = read_int_file(port_path);
  assert_true(port > 0);
  char *page = scrape(port);
  assert_non_null(strstr(page, "# TYPE zshard_pushes_total counter\n"));
  free(page);
  assert_int_equal(hs_stop(s), 0);
  /* ... and without either, or with "off", no metrics port is opened: the
   * server's log names none. */
  const char *off[] = {"--metrics-listen", "off", NULL};
  hs_server *quiet[2] = {hs_start(NULL, NULL), hs_start(off, NULL)};
  for (int i = 0; i < 2; i++) {
    assert_non_null(quiet[i]);
    char log[4096] = "";
    FILE *f = fopen(quiet[i]->log_path, "r");
    assert_non_null(f);
    size_t n = fread(log, 1, sizeof log - 1, f);
    log[n] = '\0';
    fclose(f);
    assert_non_null(strstr(log, "event=listening"));
    assert_null(strstr(log, "metrics_listening"));
    assert_int_equal(hs_stop(quiet[i]), 0);
  }
}

/* ------------------------------------------------------------ tests: zshard status */

/* Runs the CLI with stdout and stderr into `out_path`; returns the pid. */
static pid_t spawn_cli(char *const argv[], const char *out_path) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out_path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  assert_int_equal(rc, 0);
  return pid;
}

static int wait_exit(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  size_t cap = 1 << 16;
  char *buf = malloc(cap);
  assert_non_null(buf);
  size_t n = fread(buf, 1, cap - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* The number after "key": in a JSON text, or NAN. */
static double json_number(const char *json, const char *key) {
  char k[64];
  snprintf(k, sizeof k, "\"%s\":", key);
  const char *p = strstr(json, k);
  return p ? strtod(p + strlen(k), NULL) : NAN;
}

static int occurrences(const char *text, const char *what) {
  int n = 0;
  for (const char *p = strstr(text, what); p; p = strstr(p + 1, what))
    n++;
  return n;
}

static void status_reports_counts_memory_and_a_push_rate_from_two_samples(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);
  job jb;
  job_open(&jb, m.srv, 1);

  char out_path[600];
  snprintf(out_path, sizeof out_path, "%s/status-rate.out", hs_tmpdir());
  char *argv[] = {ZSHARD_CLI_BIN, "status",   "--json",    "--sample-ms",
                  "3000",         "--shards", m.srv->addr, NULL};
  pid_t pid = spawn_cli(argv, out_path);
  /* The first sample is taken when the server has answered one Stats call;
   * the pushes then fall between the two samples. */
  uint64_t end = clock_now_ms() + WAIT_MS;
  for (;;) {
    char *page = scrape(m.metrics_port);
    uint64_t n = requests_of(page, "Stats");
    free(page);
    if (n >= 1)
      break;
    if (clock_now_ms() > end)
      fail_msg("zshard status never asked for Stats");
    pause_10ms();
  }
  uint64_t pushes = push_step(&jb, 1);
  char *page = scrape(m.metrics_port);
  int in_window = requests_of(page, "Stats") == 1;
  free(page);
  assert_int_equal(wait_exit(pid), 0);
  char *json = slurp(out_path);
  fprintf(stderr, "%s", json);
  assert_non_null(strstr(json, "\"health\":\"SERVING\",\"shard_id\":0"));
  assert_non_null(strstr(json, "\"all_serving\":true"));
  assert_true(json_number(json, "pushes") == (double)pushes);
  assert_true(json_number(json, "bytes_in") == (double)jb.piece_bytes);
  /* The one shard owns every piece of the job (GetInfo's counts). */
  assert_true(json_number(json, "pieces") == (double)jb.j.lay.num_pieces);
  assert_true(json_number(json, "elements") == (double)(jb.piece_bytes / sizeof(float)));
  assert_true(json_number(json, "rss_bytes") > 1e6);
  assert_true(json_number(json, "waiting_pulls") == 0);
  double rate = json_number(json, "pushes_per_s");
  double in_rate = json_number(json, "bytes_in_per_s");
  assert_false(isnan(rate));
  /* Both rates are over the same interval: their ratio is the bytes of one
   * push on average. */
  double per_push = (double)jb.piece_bytes / (double)pushes;
  assert_true(fabs(in_rate / rate - per_push) <= 1e-6 * per_push);
  if (in_window) {
    /* Every push fell between the samples, which are at least 3 s apart. */
    assert_true(rate > 0);
    assert_true(rate <= (double)pushes / 3.0 + 1e-9);
  } else {
    fprintf(stderr, "note: the second sample came before the pushes ended; the rate's bounds "
                    "were not checked\n");
  }
  free(json);

  /* The table shows the same, with the memory columns. */
  char *targv[] = {ZSHARD_CLI_BIN, "status", "--sample-ms", "0", "--shards", m.srv->addr, NULL};
  pid = spawn_cli(targv, out_path);
  assert_int_equal(wait_exit(pid), 0);
  char *table = slurp(out_path);
  fprintf(stderr, "%s", table);
  assert_non_null(strstr(table, "PUSHES/S"));
  assert_non_null(strstr(table, "RSS"));
  assert_non_null(strstr(table, " MiB "));
  assert_non_null(strstr(table, "metrics-test"));
  free(table);
  job_close(&jb);
  mserver_stop(&m);
}

static void status_watch_prints_count_tables_and_exits_by_the_last(void **state) {
  (void)state;
  mserver m;
  mserver_start(&m);
  char out_path[600];
  snprintf(out_path, sizeof out_path, "%s/status-watch.out", hs_tmpdir());
  /* Into a file: plain tables one after the other, no escape codes. */
  char *argv[] = {ZSHARD_CLI_BIN, "status", "--watch",  "0.1",       "--count", "3",
                  "--sample-ms",  "0",      "--shards", m.srv->addr, NULL};
  pid_t pid = spawn_cli(argv, out_path);
  assert_int_equal(wait_exit(pid), 0);
  char *text = slurp(out_path);
  fprintf(stderr, "%s", text);
  assert_int_equal(occurrences(text, "Every 0.1s: zshard status"), 3);
  assert_int_equal(occurrences(text, "\nID    ADDRESS"), 3);
  assert_int_equal(occurrences(text, "SERVING"), 3);
  assert_null(strchr(text, '\033'));
  free(text);
  /* As JSON: one document per line. */
  char *jargv[] = {ZSHARD_CLI_BIN, "status",    "--json", "--watch=0.1", "--count", "2",
                   "--shards",     m.srv->addr, NULL};
  pid = spawn_cli(jargv, out_path);
  assert_int_equal(wait_exit(pid), 0);
  text = slurp(out_path);
  assert_int_equal(occurrences(text, "{\"shards\":["), 2);
  assert_int_equal(occurrences(text, "}\n"), 2);
  /* Every table after a first sample has the rate fields. */
  assert_int_equal(occurrences(text, "\"pushes_per_s\":"), 2);
  free(text);

  /* On a terminal each table clears the screen first. */
  int master = posix_openpt(O_RDWR | O_NOCTTY);
  assert_true(master >= 0);
  assert_int_equal(grantpt(master), 0);
  assert_int_equal(unlockpt(master), 0);
  const char *slave_name = ptsname(master);
  assert_non_null(slave_name);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, slave_name, O_RDWR | O_NOCTTY, 0);
  char *targv[] = {ZSHARD_CLI_BIN, "status", "--watch",  "0.1",       "--count", "2",
                   "--sample-ms",  "0",      "--shards", m.srv->addr, NULL};
  assert_int_equal(posix_spawn(&pid, targv[0], &fa, NULL, targv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  char screen[16384];
  size_t got = 0;
  uint64_t end = clock_now_ms() + WAIT_MS;
  /* Read until the child has exited and the terminal is drained (EIO once
   * no one holds its other end). */
  for (;;) {
    struct pollfd p = {.fd = master, .events = POLLIN};
    if (poll(&p, 1, 100) > 0) {
      ssize_t r = read(master, screen + got, sizeof screen - 1 - got);
      if (r <= 0)
        break;
      got += (size_t)r;
    }
    if (clock_now_ms() > end)
      fail_msg("zshard status --watch --count 2 on a terminal did not finish");
  }
  screen[got] = '\0';
  close(master);
  assert_int_equal(wait_exit(pid), 0);
  assert_int_equal(occurrences(screen, "\033[H\033[2J"), 2);
  assert_int_equal(occurrences(screen, "SERVING"), 2);

  /* With a shard that does not answer, the last table decides: exit 1. */
  char gone[32];
  snprintf(gone, sizeof gone, "%s", m.srv->addr);
  mserver_stop(&m);
  char *dargv[] = {ZSHARD_CLI_BIN, "status", "--watch",  "0.1", "--count", "2", "--sample-ms", "0",
                   "--timeout-ms", "2000",   "--shards", gone,  NULL};
  pid = spawn_cli(dargv, out_path);
  assert_int_equal(wait_exit(pid), 1);
  text = slurp(out_path);
  assert_int_equal(occurrences(text, "UNREACHABLE"), 2);
  free(text);
  /* Bad periods and counts are usage errors. */
  char *uargv[] = {ZSHARD_CLI_BIN, "status", "--watch=0", "--shards", "127.0.0.1:1", NULL};
  pid = spawn_cli(uargv, out_path);
  assert_int_equal(wait_exit(pid), 2);
  char *cargv[] = {ZSHARD_CLI_BIN, "status", "--count", "0", "--shards", "127.0.0.1:1", NULL};
  pid = spawn_cli(cargv, out_path);
  assert_int_equal(wait_exit(pid), 2);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

/* The families metrics.c writes, in the order of the page: the golden list
 * the table in metrics.c must match (a family renamed, dropped or moved is a
 * change users see, in docs/OPERATIONS.md and their dashboards). */
static const char *const GOLDEN_FAMILIES[] = {
    "zshard_build_info",
    "zshard_shards",
    "zshard_uptime_seconds",
    "process_start_time_seconds",
    "process_resident_memory_bytes",
    "zshard_job_open",
    "zshard_initialized",
    "zshard_version",
    "zshard_parameters",
    "zshard_state_bytes",
    "zshard_held_bytes",
    "zshard_members",
    "zshard_membership_epoch",
    "zshard_member_leaves_total",
    "zshard_member_joins_total",
    "zshard_trainer_timeouts_total",
    "zshard_pushes_total",
    "zshard_duplicate_pushes_total",
    "zshard_rejected_pushes_total",
    "zshard_pulls_total",
    "zshard_received_bytes_total",
    "zshard_sent_bytes_total",
    "zshard_applies_total",
    "zshard_skipped_steps_total",
    "zshard_waiting_requests",
    "zshard_apply_duration_seconds",
    "zshard_request_duration_seconds",
    "zshard_request_errors_total",
};

/* The page writes each family of metrics.c's table once, in the table's
 * order, with the table's HELP and TYPE, and samples under its name; the
 * table holds exactly the golden names. */
static void the_page_writes_every_family_of_the_table_with_its_help_and_type(void **state) {
  (void)state;
  const size_t ngolden = sizeof GOLDEN_FAMILIES / sizeof GOLDEN_FAMILIES[0];
  size_t n = 0;
  while (metrics_family_at(n))
    n++;
  assert_int_equal(n, ngolden);
  for (size_t i = 0; i < n; i++) {
    const metrics_family *f = metrics_family_at(i);
    assert_string_equal(f->name, GOLDEN_FAMILIES[i]);
    assert_true(strcmp(f->type, "gauge") == 0 || strcmp(f->type, "counter") == 0 ||
                strcmp(f->type, "histogram") == 0);
    assert_true(f->help[0] != '\0' && !strchr(f->help, '\n'));
  }

  mserver m;
  mserver_start(&m);
  /* One answered request, so that the request families have a series. */
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(m.srv->addr, &ch), 0);
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  assert_int_equal(hs_get_info(ch, &info, &st), 0);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);

  char *page = scrape(m.metrics_port);
  const char *prev = page;
  for (size_t i = 0; i < n; i++) {
    const metrics_family *f = metrics_family_at(i);
    char head[1024], help_line[256], sample[128];
    snprintf(head, sizeof head, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name, f->type);
    const char *at = strstr(page, head);
    if (!at || at < prev)
      fail_msg("family %s: its HELP and TYPE lines are missing or out of order", f->name);
    assert_null(strstr(at + 1, head));
    /* No other HELP line for the name, and the next line is a sample of it. */
    snprintf(help_line, sizeof help_line, "# HELP %s ", f->name);
    assert_true(strstr(page, help_line) == at && !strstr(at + 1, help_line));
    snprintf(sample, sizeof sample, "%s%s{shard=\"0\"", f->name,
             strcmp(f->type, "histogram") == 0 ? "_bucket" : "");
    assert_int_equal(strncmp(at + strlen(head), sample, strlen(sample)), 0);
    prev = at;
  }
  free(page);
  mserver_stop(&m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(the_page_writes_every_family_of_the_table_with_its_help_and_type),
      cmocka_unit_test(metrics_count_exactly_what_the_shard_did_and_pass_promtool),
      cmocka_unit_test(data_plane_requests_are_timed_per_method),
      cmocka_unit_test(bad_http_requests_get_their_4xx_and_the_shard_serves_on),
      cmocka_unit_test(quiet_clients_hold_up_no_scrape_and_are_closed_at_their_timeout),
      cmocka_unit_test(metrics_flags_are_checked_and_the_endpoint_is_off_by_default),
      cmocka_unit_test(status_reports_counts_memory_and_a_push_rate_from_two_samples),
      cmocka_unit_test(status_watch_prints_count_tables_and_exits_by_the_last),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
