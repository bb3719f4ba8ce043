/*
 * metrics — the registry, the text format and the HTTP endpoint (see
 * metrics.h).
 *
 * Threads and what they own:
 *  - Any thread records: metrics_rpc_observe and histogram_observe_* are
 *    relaxed atomic increments, with no lock.
 *  - metrics.lock guards the list of registered series (nrpc and the names
 *    of the entries below it). An entry's names are written before nrpc
 *    counts it, under the lock, and never change afterwards.
 *  - The server thread owns the listening socket, every connection and their
 *    buffers; it renders the page itself, on the request's arrival. Rendering
 *    takes metrics.lock and, inside the core, core.mu for a moment (as a
 *    Stats call does); never the state lock an apply holds, so a scrape
 *    waits for no apply and no apply waits for a scrape.
 *  - The thread calling metrics_server_stop wakes the server thread through
 *    an eventfd and joins it.
 */
#include "server/metrics.h"
#include "common/status.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/hostport.h"
#include "common/log.h"
#include "zshard/zshard.h"

/* ------------------------------------------------------------------------ */
/* Registry                                                                 */
/* ------------------------------------------------------------------------ */

struct metrics_rpc {
  char transport[METRICS_MAX_NAME + 1];
  char method[METRICS_MAX_NAME + 1];
  histogram duration;
  atomic_uint_fast64_t failed;
};

struct metrics {
  uint32_t shard_id;
  uint64_t start_ns;   /* clock_now_ns() at creation */
  double start_unix_s; /* wall clock at creation */
  histogram apply;
  pthread_mutex_t lock;
  size_t nrpc;
  metrics_rpc rpcs[METRICS_MAX_RPCS];
};

int metrics_create(uint32_t shard_id, metrics **out) {
  *out = NULL;
  metrics *m = calloc(1, sizeof *m);
  if (!m)
    return ZS_ENOMEM;
  if (pthread_mutex_init(&m->lock, NULL) != 0) {
    free(m);
    return ZS_ENOMEM;
  }
  m->shard_id = shard_id;
  m->start_ns = clock_now_ns();
  struct timeval tv;
  gettimeofday(&tv, NULL);
  m->start_unix_s = (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
  histogram_init(&m->apply);
  for (size_t i = 0; i < METRICS_MAX_RPCS; i++) {
    histogram_init(&m->rpcs[i].duration);
    atomic_init(&m->rpcs[i].failed, 0);
  }
  *out = m;
  return 0;
}

void metrics_destroy(metrics *m) {
  if (!m)
    return;
  pthread_mutex_destroy(&m->lock);
  free(m);
}

histogram *metrics_apply_histogram(metrics *m) {
  return m ? &m->apply : NULL;
}

/* Names become label values unescaped, so only a safe alphabet is taken. */
static int name_ok(const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (n == 0 || n > METRICS_MAX_NAME)
    return 0;
  for (size_t i = 0; i < n; i++) {
    char ch = s[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '_' || ch == '.'))
      return 0;
  }
  return 1;
}

metrics_rpc *metrics_rpc_register(metrics *m, const char *transport, const char *method) {
  if (!m || !name_ok(transport) || !name_ok(method))
    return NULL;
  metrics_rpc *r = NULL;
  pthread_mutex_lock(&m->lock);
  for (size_t i = 0; i < m->nrpc && !r; i++)
    if (strcmp(m->rpcs[i].transport, transport) == 0 && strcmp(m->rpcs[i].method, method) == 0)
      r = &m->rpcs[i];
  if (!r && m->nrpc < METRICS_MAX_RPCS) {
    r = &m->rpcs[m->nrpc];
    snprintf(r->transport, sizeof r->transport, "%s", transport);
    snprintf(r->method, sizeof r->method, "%s", method);
    m->nrpc++;
  }
  pthread_mutex_unlock(&m->lock);
  return r;
}

void metrics_rpc_observe(metrics_rpc *r, uint64_t ns, int failed) {
  if (!r)
    return;
  histogram_observe_ns(&r->duration, ns);
  if (failed)
    atomic_fetch_add_explicit(&r->failed, 1, memory_order_relaxed);
}

uint64_t metrics_process_rss(void) {
  /* statm's second field is the resident set in pages; one small read. */
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f)
    return 0;
  unsigned long long size = 0, resident = 0;
  int n = fscanf(f, "%llu %llu", &size, &resident);
  fclose(f);
  long page = sysconf(_SC_PAGESIZE);
  if (n != 2 || page <= 0)
    return 0;
  return (uint64_t)resident * (uint64_t)page;
}

/* ------------------------------------------------------------------------ */
/* Text format                                                              */
/* ------------------------------------------------------------------------ */

/* A growing text buffer; after a failed allocation it stays failed and
 * appends nothing, so the caller checks once at the end. */
typedef struct sbuf {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

__attribute__((format(printf, 2, 3))) static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2;
    while (cap - b->len <= (size_t)n)
      cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

static void family(sbuf *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample_u64(sbuf *b, const metrics *m, const char *name, uint64_t v) {
  sb_printf(b, "%s{shard=\"%" PRIu32 "\"} %" PRIu64 "\n", name, m->shard_id, v);
}

static void sample_f(sbuf *b, const metrics *m, const char *name, double v) {
  sb_printf(b, "%s{shard=\"%" PRIu32 "\"} %.15g\n", name, m->shard_id, v);
}

/* One histogram's _bucket, _sum and _count lines. `labels` are the labels
 * after shard, each written as ,key="value" (may be ""). */
static void histogram_lines(sbuf *b, const metrics *m, const char *name, const char *labels,
                            const histogram *h) {
  histogram_snapshot s;
  histogram_read(h, &s);
  for (size_t i = 0; i <= HISTOGRAM_BOUNDS; i++) {
    char le[32];
    if (i < HISTOGRAM_BOUNDS)
      snprintf(le, sizeof le, "%.6g", histogram_bound_seconds(i));
    else
      snprintf(le, sizeof le, "+Inf");
    sb_printf(b, "%s_bucket{shard=\"%" PRIu32 "\"%s,le=\"%s\"} %" PRIu64 "\n", name, m->shard_id,
              labels, le, s.cumulative[i]);
  }
  sb_printf(b, "%s_sum{shard=\"%" PRIu32 "\"%s} %.9g\n", name, m->shard_id, labels, s.sum_seconds);
  sb_printf(b, "%s_count{shard=\"%" PRIu32 "\"%s} %" PRIu64 "\n", name, m->shard_id, labels,
            s.count);
}

int metrics_render(metrics *m, core *c, char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  sbuf b = {.p = malloc(16384), .cap = 16384};
  if (!b.p)
    return ZS_ENOMEM;
  b.p[0] = '\0';

  core_info info;
  core_counters k;
  core_get_info(c, &info);
  core_get_counters(c, &k);
  uint64_t now = clock_now_ns();
  const uint32_t id = m->shard_id;

  family(&b, "zshard_build_info", "gauge", "The zshard release this server runs; always 1.");
  sb_printf(&b, "zshard_build_info{shard=\"%" PRIu32 "\",version=\"%s\"} 1\n", id, zs_version());
  family(&b, "zshard_shards", "gauge", "Number of shard servers in the job (--shards).");
  sample_u64(&b, m, "zshard_shards", info.num_shards);
  family(&b, "zshard_uptime_seconds", "gauge", "Seconds since the server started.");
  sample_f(&b, m, "zshard_uptime_seconds", (double)(now - m->start_ns) / 1e9);
  family(&b, "process_start_time_seconds", "gauge",
         "Start time of the process since the Unix epoch in seconds.");
  sample_f(&b, m, "process_start_time_seconds", m->start_unix_s);
  family(&b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
  sample_u64(&b, m, "process_resident_memory_bytes", metrics_process_rss());

  family(&b, "zshard_job_open", "gauge", "1 when a job is open on this shard, else 0.");
  sample_u64(&b, m, "zshard_job_open", info.has_job ? 1 : 0);
  family(&b, "zshard_initialized", "gauge",
         "1 when every piece this shard owns has its initial weights, else 0.");
  sample_u64(&b, m, "zshard_initialized", info.has_job && info.initialized ? 1 : 0);
  family(&b, "zshard_version", "gauge",
         "Parameter version: the number of steps applied or skipped since the initial "
         "weights.");
  sample_u64(&b, m, "zshard_version", k.version);
  family(&b, "zshard_parameters", "gauge", "Parameters (elements) this shard owns.");
  sample_u64(&b, m, "zshard_parameters", info.has_job ? info.elements : 0);
  family(&b, "zshard_state_bytes", "gauge",
         "Bytes of training state this shard holds: master weights, optimizer moments, "
         "gradient accumulator and low-precision copy.");
  sample_u64(&b, m, "zshard_state_bytes", info.has_job ? info.state_bytes : 0);
  family(&b, "zshard_held_bytes", "gauge",
         "Bytes of early gradient contributions held until their turn in the fixed "
         "summation order.");
  sample_u64(&b, m, "zshard_held_bytes", k.held_bytes);

  family(&b, "zshard_pushes_total", "counter",
         "Gradient contributions accepted (Push), duplicates included.");
  sample_u64(&b, m, "zshard_pushes_total", k.pushes);
  family(&b, "zshard_duplicate_pushes_total", "counter",
         "Pushes acknowledged as repeats of a contribution already received (retries).");
  sample_u64(&b, m, "zshard_duplicate_pushes_total", k.duplicate_pushes);
  family(&b, "zshard_rejected_pushes_total", "counter",
         "Pushes refused (wrong hash, step, piece, size or dtype); they changed nothing.");
  sample_u64(&b, m, "zshard_rejected_pushes_total", k.rejected);
  family(&b, "zshard_pulls_total", "counter", "Parameter reads answered (Pull).");
  sample_u64(&b, m, "zshard_pulls_total", k.pulls);
  family(&b, "zshard_received_bytes_total", "counter",
         "Gradient payload bytes received in pushes.");
  sample_u64(&b, m, "zshard_received_bytes_total", k.bytes_in);
  family(&b, "zshard_sent_bytes_total", "counter", "Bytes sent in answers to pulls.");
  sample_u64(&b, m, "zshard_sent_bytes_total", k.bytes_out);
  family(&b, "zshard_applies_total", "counter", "Optimizer steps run or skipped (Apply).");
  sample_u64(&b, m, "zshard_applies_total", k.applies);
  family(&b, "zshard_skipped_steps_total", "counter",
         "Steps skipped for a gradient overflow (dynamic loss scaling).");
  sample_u64(&b, m, "zshard_skipped_steps_total", k.skipped_steps);

  family(&b, "zshard_waiting_requests", "gauge",
         "Requests parked in the shard, waiting: Pull for a version, GradStats for the "
         "contributions of the ranks still missing.");
  sb_printf(&b, "zshard_waiting_requests{shard=\"%" PRIu32 "\",method=\"Pull\"} %" PRIu32 "\n", id,
            k.waiting_pulls);
  sb_printf(&b, "zshard_waiting_requests{shard=\"%" PRIu32 "\",method=\"GradStats\"} %" PRIu32 "\n",
            id, k.waiting_stats);

  family(&b, "zshard_apply_duration_seconds", "histogram",
         "Duration of one step's optimizer pass (or skip) on this shard.");
  histogram_lines(&b, m, "zshard_apply_duration_seconds", "", &m->apply);

  pthread_mutex_lock(&m->lock);
  size_t nrpc = m->nrpc;
  pthread_mutex_unlock(&m->lock);
  /* Entries below nrpc are never changed again, so they are read unlocked. */
  if (nrpc > 0) {
    family(&b, "zshard_request_duration_seconds", "histogram",
           "Time from a request's arrival to its answer, per transport and method; Pull and "
           "GradStats include their wait.");
    for (size_t i = 0; i < nrpc; i++) {
      char labels[2 * METRICS_MAX_NAME + 32];
      snprintf(labels, sizeof labels, ",transport=\"%s\",method=\"%s\"", m->rpcs[i].transport,
               m->rpcs[i].method);
      histogram_lines(&b, m, "zshard_request_duration_seconds", labels, &m->rpcs[i].duration);
    }
    family(&b, "zshard_request_errors_total", "counter",
           "Requests answered with an error status, per transport and method.");
    for (size_t i = 0; i < nrpc; i++)
      sb_printf(&b,
                "zshard_request_errors_total{shard=\"%" PRIu32
                "\",transport=\"%s\",method=\"%s\"} %" PRIu64 "\n",
                id, m->rpcs[i].transport, m->rpcs[i].method,
                (uint64_t)atomic_load_explicit(&m->rpcs[i].failed, memory_order_relaxed));
  }

  if (b.oom) {
    free(b.p);
    return ZS_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* HTTP server                                                              */
/* ------------------------------------------------------------------------ */

/* After the answer is sent, what the client still sends is read and dropped
 * (up to this much) before closing: closing a socket with unread input makes
 * the kernel send a reset, which can destroy the answer before the client
 * reads it. */
#define METRICS_DRAIN_BYTES 65536u
/* After accept() fails for lack of descriptors, the listener rests this long,
 * since it stays readable and polling it would spin. */
#define METRICS_ACCEPT_PAUSE_MS 100u

enum { CONN_FREE, CONN_READING, CONN_WRITING, CONN_DRAINING };

typedef struct mconn {
  int fd;
  int state;
  uint64_t deadline_ms;
  size_t inlen;
  size_t scan; /* header_end resumes here */
  size_t drained;
  char *out; /* the whole answer, malloc'd */
  size_t outlen, outoff;
  char in[METRICS_MAX_REQUEST];
} mconn;

struct metrics_server {
  int listen_fd;
  int wake_fd;
  int port;
  metrics *m;
  core *c;
  uint32_t timeout_ms;
  uint32_t max_conns;
  mconn *conns;
  struct pollfd *pfd;
  int *pfd_conn; /* pfd[i] belongs to conns[pfd_conn[i]], or -1 */
  pthread_t thread;
  int thread_started;
  atomic_int stop;
};

static void conn_close(mconn *c) {
  if (c->fd >= 0)
    close(c->fd);
  free(c->out);
  c->out = NULL;
  c->fd = -1;
  c->state = CONN_FREE;
  c->inlen = c->scan = c->outlen = c->outoff = c->drained = 0;
}

static const char *reason(int code) {
  switch (code) {
  case 200:
    return "OK";
  case 400:
    return "Bad Request";
  case 404:
    return "Not Found";
  case 405:
    return "Method Not Allowed";
  case 431:
    return "Request Header Fields Too Large";
  case 500:
    return "Internal Server Error";
  case 503:
    return "Service Unavailable";
  default:
    return "Error";
  }
}

/* Builds the whole answer into c->out. `body` (may be NULL) is copied;
 * with `head_only` only its length is sent. Returns 0 or -1 (no memory). */
static int conn_answer(mconn *c, int code, const char *ctype, const char *body, size_t body_len,
                       int head_only) {
  char head[512];
  int n = snprintf(head, sizeof head,
                   "HTTP/1.1 %d %s\r\n"
                   "Content-Type: %s\r\n"
                   "Content-Length: %zu\r\n"
                   "%s"
                   "Cache-Control: no-store\r\n"
                   "Connection: close\r\n"
                   "\r\n",
                   code, reason(code), ctype, body_len, code == 405 ? "Allow: GET, HEAD\r\n" : "");
  size_t send_body = head_only || !body ? 0 : body_len;
  c->out = malloc((size_t)n + send_body);
  if (!c->out)
    return -1;
  memcpy(c->out, head, (size_t)n);
  if (send_body)
    memcpy(c->out + n, body, send_body);
  c->outlen = (size_t)n + send_body;
  c->outoff = 0;
  c->state = CONN_WRITING;
  return 0;
}

static void conn_error(mconn *c, int code, const char *text) {
  if (conn_answer(c, code, "text/plain; charset=utf-8", text, strlen(text), 0) != 0)
    conn_close(c);
}

/* RFC 9110 token characters, which methods and header names are made of. */
static int is_tchar(unsigned char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
         (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

/* The next line of [*p, end) without its CR LF (a bare LF is accepted too):
 * sets *line and *n and advances *p. Returns 0, or -1 at the end. */
static int next_line(const char **p, const char *end, const char **line, size_t *n) {
  if (*p >= end)
    return -1;
  const char *nl = memchr(*p, '\n', (size_t)(end - *p));
  if (!nl)
    return -1;
  *line = *p;
  *n = (size_t)(nl - *p);
  if (*n > 0 && (*p)[*n - 1] == '\r')
    (*n)--;
  *p = nl + 1;
  return 0;
}

/* Answers a complete request: the first `len` bytes of c->in, which end with
 * the empty line closing the headers. */
static void conn_handle(metrics_server *s, mconn *c, size_t len) {
  const char *p = c->in, *end = c->in + len;
  const char *line;
  size_t n;
  /* RFC 9112 lets a server ignore empty lines before the request line. */
  do {
    if (next_line(&p, end, &line, &n) != 0) {
      conn_error(c, 400, "bad request\n");
      return;
    }
  } while (n == 0);

  /* method SP target SP HTTP/1.x, each part non-empty, one space apart. */
  const char *sp1 = memchr(line, ' ', n);
  const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(line + n - sp1 - 1)) : NULL;
  if (!sp1 || !sp2 || sp1 == line || sp2 == sp1 + 1) {
    conn_error(c, 400, "bad request line\n");
    return;
  }
  size_t mlen = (size_t)(sp1 - line), tlen = (size_t)(sp2 - sp1 - 1);
  size_t vlen = (size_t)(line + n - sp2 - 1);
  const char *method = line, *target = sp1 + 1, *version = sp2 + 1;
  for (size_t i = 0; i < mlen; i++)
    if (!is_tchar((unsigned char)method[i])) {
      conn_error(c, 400, "bad request method\n");
      return;
    }
  for (size_t i = 0; i < tlen; i++)
    if ((unsigned char)target[i] <= 0x20 || (unsigned char)target[i] >= 0x7f) {
      conn_error(c, 400, "bad request target\n");
      return;
    }
  if (target[0] != '/' && !(tlen == 1 && target[0] == '*')) {
    conn_error(c, 400, "bad request target\n");
    return;
  }
  if (vlen != 8 || memcmp(version, "HTTP/1.", 7) != 0 || (version[7] != '0' && version[7] != '1')) {
    conn_error(c, 400, "bad HTTP version\n");
    return;
  }
  /* Headers are not needed, but a malformed one makes the request bad: a
   * name of token characters, then a colon, and no line folding. */
  while (next_line(&p, end, &line, &n) == 0 && n > 0) {
    const char *colon = memchr(line, ':', n);
    if (!colon || colon == line) {
      conn_error(c, 400, "bad header\n");
      return;
    }
    for (const char *q = line; q < colon; q++)
      if (!is_tchar((unsigned char)*q)) {
        conn_error(c, 400, "bad header\n");
        return;
      }
  }

  size_t plen = tlen;
  const char *q = memchr(target, '?', tlen);
  if (q)
    plen = (size_t)(q - target);
  if (plen != 8 || memcmp(target, "/metrics", 8) != 0) {
    conn_error(c, 404, "not found: the metrics are at /metrics\n");
    return;
  }
  int head = mlen == 4 && memcmp(method, "HEAD", 4) == 0;
  if (!(mlen == 3 && memcmp(method, "GET", 3) == 0) && !head) {
    conn_error(c, 405, "method not allowed: use GET\n");
    return;
  }
  char *text = NULL;
  size_t text_len = 0;
  if (metrics_render(s->m, s->c, &text, &text_len) != 0) {
    conn_error(c, 500, "out of memory\n");
    return;
  }
  if (conn_answer(c, 200, "text/plain; version=0.0.4; charset=utf-8", text, text_len, head) != 0)
    conn_close(c);
  free(text);
}

/* The end of the header block in c->in: the length up to and including the
 * empty line that closes it, or 0 when it has not arrived. Empty lines
 * before the request line do not count (conn_handle skips them). The scan
 * resumes where the previous one stopped, so a client sending one byte at a
 * time costs linear work, not quadratic. */
static size_t header_end(mconn *c) {
  size_t i = c->scan;
  if (i == 0)
    while (i < c->inlen && (c->in[i] == '\r' || c->in[i] == '\n'))
      i++;
  if (i == c->inlen) {
    c->scan = i; /* nothing but empty lines so far */
    return 0;
  }
  for (; i < c->inlen; i++) {
    if (c->in[i] != '\n')
      continue;
    if (i + 1 < c->inlen && c->in[i + 1] == '\n')
      return i + 2;
    if (i + 2 < c->inlen && c->in[i + 1] == '\r' && c->in[i + 2] == '\n')
      return i + 3;
    if (i + 2 >= c->inlen)
      break; /* the empty line may still be on its way: look again from here */
  }
  c->scan = i < c->inlen ? i : c->inlen;
  return 0;
}

static void conn_read(metrics_server *s, mconn *c) {
  if (c->state == CONN_DRAINING) {
    char sink[4096];
    ssize_t r = recv(c->fd, sink, sizeof sink, 0);
    if (r > 0)
      c->drained += (size_t)r;
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR) || c->drained > METRICS_DRAIN_BYTES)
      conn_close(c);
    return;
  }
  ssize_t r = recv(c->fd, c->in + c->inlen, sizeof c->in - c->inlen, 0);
  if (r < 0) {
    if (errno != EAGAIN && errno != EINTR)
      conn_close(c);
    return;
  }
  if (r == 0) { /* the client gave up before its request was complete */
    conn_close(c);
    return;
  }
  c->inlen += (size_t)r;
  size_t hl = header_end(c);
  if (hl > 0)
    conn_handle(s, c, hl);
  else if (c->inlen == sizeof c->in)
    conn_error(c, 431, "request header too large\n");
}

static void conn_write(mconn *c) {
  while (c->outoff < c->outlen) {
    ssize_t w = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN)
        conn_close(c);
      return;
    }
    c->outoff += (size_t)w;
  }
  free(c->out);
  c->out = NULL;
  shutdown(c->fd, SHUT_WR);
  c->state = CONN_DRAINING;
}

static void accept_all(metrics_server *s, uint64_t now, uint64_t *paused_until) {
  for (;;) {
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        *paused_until = now + METRICS_ACCEPT_PAUSE_MS;
      return; /* EAGAIN: all taken; others: the peer left already */
    }
    mconn *c = NULL;
    for (uint32_t i = 0; i < s->max_conns && !c; i++)
      if (s->conns[i].state == CONN_FREE)
        c = &s->conns[i];
    if (!c) {
      /* Best effort: the socket buffer of a new connection takes this short
       * answer without blocking. */
      static const char busy[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                 "Connection: close\r\n\r\n";
      ssize_t w = send(fd, busy, sizeof busy - 1, MSG_NOSIGNAL);
      (void)w;
      /* Closing with unread request bytes would answer the client with a
       * reset that can destroy the 503 before it is read: half-close, then
       * drop what already arrived (bounded, non-blocking). */
      shutdown(fd, SHUT_WR);
      char sink[4096];
      for (int i = 0; i < 4 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {
      }
      close(fd);
      continue;
    }
    c->fd = fd;
    c->state = CONN_READING;
    c->inlen = c->scan = c->outlen = c->outoff = c->drained = 0;
    c->deadline_ms = now + s->timeout_ms;
  }
}

static void *server_main(void *arg) {
  metrics_server *s = arg;
  uint64_t accept_paused_until = 0;
  while (!atomic_load(&s->stop)) {
    uint64_t now = clock_now_ms();
    nfds_t n = 0;
    s->pfd[n] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    s->pfd_conn[n++] = -1;
    if (now >= accept_paused_until) {
      s->pfd[n] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
      s->pfd_conn[n++] = -1;
    }
    uint64_t next = accept_paused_until > now ? accept_paused_until : UINT64_MAX;
    for (uint32_t i = 0; i < s->max_conns; i++) {
      mconn *c = &s->conns[i];
      if (c->state == CONN_FREE)
        continue;
      if (c->deadline_ms <= now) {
        conn_close(c); /* too slow to send its request or to take its answer */
        continue;
      }
      if (c->deadline_ms < next)
        next = c->deadline_ms;
      s->pfd[n] =
          (struct pollfd){.fd = c->fd, .events = c->state == CONN_WRITING ? POLLOUT : POLLIN};
      s->pfd_conn[n++] = (int)i;
    }
    int timeout = next == UINT64_MAX ? -1 : (int)(next - now < 60000 ? next - now : 60000);
    int r = poll(s->pfd, n, timeout);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      LOG_ERROR("metrics_poll", "detail=\"%s\"", strerror(errno));
      break;
    }
    now = clock_now_ms();
    for (nfds_t i = 0; i < n; i++) {
      if (!s->pfd[i].revents)
        continue;
      if (s->pfd[i].fd == s->wake_fd)
        continue; /* the loop condition reads the stop flag */
      if (s->pfd_conn[i] < 0) {
        accept_all(s, now, &accept_paused_until);
        continue;
      }
      mconn *c = &s->conns[s->pfd_conn[i]];
      if (c->state == CONN_WRITING) {
        if (s->pfd[i].revents & (POLLERR | POLLNVAL))
          conn_close(c);
        else
          conn_write(c);
      } else {
        conn_read(s, c); /* a hang-up shows as a read of 0 */
      }
      /* An answer made by the read is sent at once, without another poll. */
      if (c->state == CONN_WRITING)
        conn_write(c);
    }
  }
  return NULL;
}

static int open_listener(const char *addr, int *fd_out, int *port_out, char *err, size_t errlen) {
  hostport hp;
  char why[400], port[8];
  if (hostport_parse(addr, &hp, why, sizeof why) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "metrics address: %s", why);
  const char *host = hp.host; /* empty: every interface */
  snprintf(port, sizeof port, "%u", (unsigned)hp.port);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
  if (gai != 0)
    return status_fail(err, errlen, ZS_EINVAL, "metrics address '%s': %s", addr, gai_strerror(gai));
  int fd = -1, saved = 0;
  for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      saved = errno;
      continue;
    }
    /* Lets a restarted server bind while old connections sit in TIME_WAIT;
     * on Linux it does not let two live servers share the port. */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      saved = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0)
    return status_fail(err, errlen, ZS_EINVAL, "cannot listen on metrics address %s: %s", addr,
                       strerror(saved));
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
    close(fd);
    return status_fail(err, errlen, ZS_EINTERNAL, "getsockname: %s", strerror(errno));
  }
  *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  *fd_out = fd;
  return 0;
}

static void server_free(metrics_server *s) {
  if (s->conns)
    for (uint32_t i = 0; i < s->max_conns; i++)
      conn_close(&s->conns[i]);
  if (s->listen_fd >= 0)
    close(s->listen_fd);
  if (s->wake_fd >= 0)
    close(s->wake_fd);
  free(s->conns);
  free(s->pfd);
  free(s->pfd_conn);
  free(s);
}

int metrics_server_start(const metrics_server_config *cfg, metrics_server **out, char *err,
                         size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->listen || !cfg->metrics || !cfg->core)
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "metrics_server_start needs an address, a registry and a core");
  metrics_server *s = calloc(1, sizeof *s);
  if (!s)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  s->listen_fd = s->wake_fd = -1;
  s->m = cfg->metrics;
  s->c = cfg->core;
  s->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : METRICS_DEFAULT_TIMEOUT_MS;
  s->max_conns = cfg->max_connections ? cfg->max_connections : METRICS_DEFAULT_MAX_CONNECTIONS;
  atomic_init(&s->stop, 0);
  int rc = ZS_ENOMEM;
  s->conns = calloc(s->max_conns, sizeof *s->conns);
  s->pfd = calloc(s->max_conns + 2, sizeof *s->pfd);
  s->pfd_conn = calloc(s->max_conns + 2, sizeof *s->pfd_conn);
  if (!s->conns || !s->pfd || !s->pfd_conn) {
    status_fail(err, errlen, rc, "%s", "out of memory");
    goto fail;
  }
  for (uint32_t i = 0; i < s->max_conns; i++)
    s->conns[i].fd = -1;
  s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd < 0) {
    rc = status_fail(err, errlen, ZS_EINTERNAL, "eventfd: %s", strerror(errno));
    goto fail;
  }
  rc = open_listener(cfg->listen, &s->listen_fd, &s->port, err, errlen);
  if (rc)
    goto fail;
  if (pthread_create(&s->thread, NULL, server_main, s) != 0) {
    rc = status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot start the metrics thread");
    goto fail;
  }
  s->thread_started = 1;
  *out = s;
  return 0;

fail:
  server_free(s);
  return rc;
}

int metrics_server_port(const metrics_server *s) {
  return s->port;
}

void metrics_server_stop(metrics_server *s) {
  if (!s)
    return;
  if (s->thread_started) {
    atomic_store(&s->stop, 1);
    uint64_t one = 1;
    ssize_t w = write(s->wake_fd, &one, sizeof one);
    (void)w; /* an eventfd counter cannot overflow from one write */
    pthread_join(s->thread, NULL);
  }
  server_free(s);
}
