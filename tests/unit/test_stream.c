/*
 * test_stream — the byte-stream layer (common/net/stream.h) as a conformance
 * suite: every case takes the implementation's ops table from its state, and
 * main runs the whole suite once per table (plain TCP today; a TLS table
 * would be one more row in `transports`).
 *
 * Each case starts a listener on 127.0.0.1 port 0, reads the port back,
 * dials it and runs the loop until both ends are connected: nothing sleeps,
 * the loop runs until the awaited event happened. Covered: addresses and
 * options, large vectored writes arriving whole and in order, reads landing
 * exactly in the buffers the owner handed out (partial reads into caller
 * memory), writes completing in queue order, the end of the stream after a
 * shutdown, a close with writes pending (cancelled before the close
 * callback), and failures reported as zs_status codes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <openssl/ssl.h>
#include <pthread.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/base/list.h"
#include "common/net/stream.h"
#include "common/net/tls.h"
#include "tests/unit/tls_certs.h"

/* The TLS contexts of the "tls" row and of the TLS cases: a server that
 * requires client certificates, a client that has one. */
static tls_certs certs;
static tls_ctx *server_ctx, *client_ctx;

/* An implementation and how its listeners and dialers are made (TLS's
 * constructors take the contexts). */
typedef struct transport {
  const char *name;
  const stream_ops *ops;
  int (*listen)(uv_loop_t *loop, const struct sockaddr *addr, stream_accept_cb cb, void *data,
                stream_listener **out, char *err, size_t errlen);
  int (*dialer_new)(uv_loop_t *loop, const struct sockaddr *addr, stream_dialer **out);
} transport;

static int tcp_listen(uv_loop_t *loop, const struct sockaddr *addr, stream_accept_cb cb, void *data,
                      stream_listener **out, char *err, size_t errlen) {
  return stream_listen(&stream_tcp_ops, loop, addr, 16, cb, data, out, err, errlen);
}

static int tcp_dialer_new(uv_loop_t *loop, const struct sockaddr *addr, stream_dialer **out) {
  return stream_dialer_new(&stream_tcp_ops, loop, addr, out);
}

static int tls_listen(uv_loop_t *loop, const struct sockaddr *addr, stream_accept_cb cb, void *data,
                      stream_listener **out, char *err, size_t errlen) {
  return stream_tls_listen(server_ctx, loop, addr, 16, cb, data, out, err, errlen);
}

static int tls_dialer_new(uv_loop_t *loop, const struct sockaddr *addr, stream_dialer **out) {
  return stream_tls_dialer_new(client_ctx, loop, addr, "127.0.0.1", out);
}

static const transport transports[] = {
    {"tcp", &stream_tcp_ops, tcp_listen, tcp_dialer_new},
    {"tls", &stream_tls_ops, tls_listen, tls_dialer_new},
};

/* Order in which callbacks ran, across the whole fixture. */
static int seq;

/* One end of the connection and what its callbacks saw. */
typedef struct side {
  stream *st;
  int connect_calls, connect_status, connect_seq;
  /* Reads go into dst[got..cap), at most `chunk` bytes a time; bytes beyond
   * cap land in `sink` and are only counted. */
  unsigned char *dst;
  size_t cap, got, chunk, sunk;
  unsigned char sink[4096];
  int refuse_buffers;
  void *handed;
  size_t handed_len;
  int reads, misplaced, ended, read_status, reads_after_end;
  int shutdown_calls, shutdown_status;
  int closed, close_seq;
} side;

typedef struct fx {
  const transport *t;
  const stream_ops *ops;
  uv_loop_t loop;
  stream_listener *l;
  stream_dialer *d;
  struct sockaddr_storage addr; /* the listener's, port included */
  int port;
  int accepts, accept_status;
  char accept_detail[256];
  side server, client;
} fx;

typedef struct wr {
  stream_write_req req;
  int calls, status, seq;
} wr;

/* Runs the loop until `cond` holds; the loop blocks on I/O meanwhile. */
#define RUN_UNTIL(f, cond)                                                                         \
  do {                                                                                             \
    while (!(cond)) {                                                                              \
      if (uv_run(&(f)->loop, UV_RUN_ONCE) == 0 && !(cond))                                         \
        fail_msg("the loop ran dry before: %s", #cond);                                            \
    }                                                                                              \
  } while (0)

static void on_accept(stream_listener *l, void *data, int status, stream *s) {
  fx *f = data;
  f->accepts++;
  f->accept_status = status;
  if (status != 0)
    snprintf(f->accept_detail, sizeof f->accept_detail, "%s", stream_listener_detail(l));
  if (status == 0) {
    f->server.st = s;
    stream_set_data(s, &f->server);
  }
}

static void on_connect(stream *s, void *data, int status) {
  side *c = data;
  assert_ptr_equal(stream_get_data(s), c);
  c->connect_calls++;
  c->connect_status = status;
  c->connect_seq = ++seq;
}

static void on_alloc(stream *s, void *data, size_t suggested, uv_buf_t *buf) {
  (void)s;
  (void)suggested;
  side *d = data;
  if (d->refuse_buffers) {
    buf->base = NULL;
    buf->len = 0;
    return;
  }
  size_t n = d->cap - d->got < d->chunk ? d->cap - d->got : d->chunk;
  if (n == 0) {
    buf->base = (char *)d->sink;
    buf->len = sizeof d->sink;
  } else {
    buf->base = (char *)d->dst + d->got;
    buf->len = n;
  }
  d->handed = buf->base;
  d->handed_len = buf->len;
}

static void on_read(stream *s, void *data, ssize_t nread, const uv_buf_t *buf) {
  (void)s;
  side *d = data;
  if (d->ended) {
    d->reads_after_end++;
    return;
  }
  if (nread < 0) {
    d->ended = 1;
    d->read_status = (int)nread;
    return;
  }
  if (nread == 0)
    return;
  d->reads++;
  if (buf->base != d->handed || (size_t)nread > d->handed_len)
    d->misplaced++;
  if (buf->base == (char *)d->sink)
    d->sunk += (size_t)nread;
  else
    d->got += (size_t)nread;
}

static void on_written(stream_write_req *req, int status) {
  wr *w = container_of(req, wr, req);
  w->calls++;
  w->status = status;
  w->seq = ++seq;
}

static void on_shutdown(stream *s, void *data, int status) {
  (void)s;
  side *d = data;
  d->shutdown_calls++;
  d->shutdown_status = status;
}

static void on_closed(stream *s, void *data) {
  (void)s;
  side *d = data;
  d->closed++;
  d->close_seq = ++seq;
  d->st = NULL;
}

static void fill(unsigned char *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = (unsigned char)x;
  }
}

static int addr_port(const struct sockaddr_storage *a) {
  return a->ss_family == AF_INET6 ? ntohs(((const struct sockaddr_in6 *)a)->sin6_port)
                                  : ntohs(((const struct sockaddr_in *)a)->sin_port);
}

static int setup(void **state) {
  const transport *t = *state;
  fx *f = calloc(1, sizeof *f);
  assert_non_null(f);
  f->t = t;
  f->ops = t->ops;
  seq = 0;
  assert_int_equal(uv_loop_init(&f->loop), 0);
  struct sockaddr_in a;
  assert_int_equal(uv_ip4_addr("127.0.0.1", 0, &a), 0);
  char err[128];
  assert_int_equal(
      t->listen(&f->loop, (const struct sockaddr *)&a, on_accept, f, &f->l, err, sizeof err), 0);
  assert_int_equal(stream_listener_addr(f->l, &f->addr), 0);
  f->port = addr_port(&f->addr);
  assert_true(f->port > 0);
  assert_int_equal(t->dialer_new(&f->loop, (const struct sockaddr *)&f->addr, &f->d), 0);
  assert_int_equal(stream_dial(f->d, on_connect, &f->client, &f->client.st), 0);
  assert_non_null(f->client.st);
  RUN_UNTIL(f, f->client.connect_calls == 1 && f->server.st != NULL);
  assert_int_equal(f->client.connect_status, 0);
  assert_int_equal(f->accept_status, 0);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fx *f = *state;
  if (f->client.st)
    stream_close(f->client.st, on_closed);
  if (f->server.st)
    stream_close(f->server.st, on_closed);
  stream_listener_close(f->l);
  stream_dialer_free(f->d);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  /* Every handle the layer made is closed and freed by now. */
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f->server.dst);
  free(f);
  return 0;
}

static void reads_into(side *d, size_t cap, size_t chunk) {
  d->dst = malloc(cap ? cap : 1);
  assert_non_null(d->dst);
  d->cap = cap;
  d->chunk = chunk;
  assert_int_equal(stream_read_start(d->st, on_alloc, on_read), 0);
}

/* ------------------------------------------------------------------------ */

static void listener_on_port_0_reports_its_port_and_both_ends_agree_on_addresses(void **state) {
  fx *f = *state;
  assert_int_equal(f->accepts, 1);
  struct sockaddr_storage cl, cp, sl, sp;
  assert_int_equal(stream_local_addr(f->client.st, &cl), 0);
  assert_int_equal(stream_peer_addr(f->client.st, &cp), 0);
  assert_int_equal(stream_local_addr(f->server.st, &sl), 0);
  assert_int_equal(stream_peer_addr(f->server.st, &sp), 0);
  assert_int_equal(addr_port(&cp), f->port);
  assert_int_equal(addr_port(&sl), f->port);
  assert_int_equal(addr_port(&cl), addr_port(&sp));
  assert_int_not_equal(addr_port(&cl), f->port);
  assert_string_equal(stream_detail(f->client.st), "");
}

static void socket_options_are_set_or_refused_with_a_status(void **state) {
  fx *f = *state;
  stream *s = f->client.st;
  assert_int_equal(stream_set_option(s, STREAM_OPT_NODELAY, 1), 0);
  assert_int_equal(stream_set_option(s, STREAM_OPT_NODELAY, 0), 0);
  assert_int_equal(stream_set_option(s, STREAM_OPT_SNDBUF, 1 << 20), 0);
  assert_int_equal(stream_set_option(s, STREAM_OPT_RCVBUF, 1 << 20), 0);
  assert_int_equal(stream_set_option(s, STREAM_OPT_KEEPALIVE, 30), 0);
  assert_int_equal(stream_set_option(s, STREAM_OPT_SNDBUF, 0), ZS_EINVAL);
  assert_int_equal(stream_set_option(s, (stream_option)99, 1), ZS_EUNIMPL);
}

/* TCP_CONGESTION on one stream's socket: getsockopt reads back what was
 * set, on that socket only (the peer and the host's default keep theirs);
 * names the kernel lacks, or that are no names, are refused. reno is built
 * into every Linux kernel. */
static void congestion_control_is_set_per_socket_and_read_back(void **state) {
  fx *f = *state;
  char def[32] = "", before[32], got[32];
  FILE *fp = fopen("/proc/sys/net/ipv4/tcp_congestion_control", "r");
  assert_non_null(fp);
  assert_non_null(fgets(def, sizeof def, fp));
  fclose(fp);
  def[strcspn(def, "\n")] = '\0';
  assert_int_equal(stream_congestion(f->server.st, before, sizeof before), 0);
  assert_string_equal(before, def); /* a new socket starts with the default */
  char err[512];
  assert_int_equal(stream_cc_check("reno", err, sizeof err), 0);
  assert_int_equal(stream_set_congestion(f->client.st, "reno"), 0);
  assert_int_equal(stream_congestion(f->client.st, got, sizeof got), 0);
  assert_string_equal(got, "reno");
  assert_int_equal(stream_congestion(f->server.st, got, sizeof got), 0);
  assert_string_equal(got, def);

  assert_int_equal(stream_cc_check("nosuchcc", err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "not available in this kernel"));
  assert_non_null(strstr(err, "reno")); /* the kernel's list */
  assert_int_equal(stream_set_congestion(f->client.st, "nosuchcc"), ZS_EINVAL);
  assert_int_equal(stream_congestion(f->client.st, got, sizeof got), 0);
  assert_string_equal(got, "reno"); /* unchanged by the refusal */
  const char *bad[] = {"", "a b", "x;rm", "sixteen_chars_ab", NULL};
  for (int i = 0; bad[i]; i++) {
    assert_int_equal(stream_cc_check(bad[i], err, sizeof err), ZS_EINVAL);
    assert_non_null(strstr(err, "not a congestion control's name"));
    assert_int_equal(stream_set_congestion(f->client.st, bad[i]), ZS_EINVAL);
  }
  assert_int_equal(stream_cc_check(NULL, err, sizeof err), ZS_EINVAL);
}

/* SO_MAX_PACING_RATE on one stream's socket, in bytes per second: read back
 * as set (60 Mbit/s is 7.5 MB/s; 40 Gbit/s needs the 64-bit form), on that
 * socket only; 0 leaves it as it is; the parser takes 0..100000 and refuses
 * anything else with a sentence naming its source. */
static void pacing_is_set_per_socket_and_read_back(void **state) {
  fx *f = *state;
  uint64_t before = 0, got = 0;
  assert_int_equal(stream_pacing(f->server.st, &before), 0);
  assert_true(before == UINT64_MAX || before == UINT32_MAX); /* none */
  assert_int_equal(stream_set_pacing(f->client.st, 60), 0);
  assert_int_equal(stream_pacing(f->client.st, &got), 0);
  assert_int_equal(got, 7500000u);
  assert_int_equal(stream_pacing(f->server.st, &got), 0);
  assert_int_equal(got, before);
  assert_int_equal(stream_set_pacing(f->client.st, 0), 0);
  assert_int_equal(stream_pacing(f->client.st, &got), 0);
  assert_int_equal(got, 7500000u);
  assert_int_equal(stream_set_pacing(f->client.st, 40000), 0);
  assert_int_equal(stream_pacing(f->client.st, &got), 0);
  assert_int_equal(got, 5000000000u);
  assert_int_equal(stream_set_pacing(f->client.st, STREAM_PACING_MBIT_MAX + 1), ZS_EINVAL);

  char err[256];
  uint32_t mbit = 7;
  assert_int_equal(stream_pacing_parse("0", "X", &mbit, err, sizeof err), 0);
  assert_int_equal(mbit, 0);
  assert_int_equal(stream_pacing_parse("100000", "X", &mbit, err, sizeof err), 0);
  assert_int_equal(mbit, 100000);
  const char *bad[] = {"", "100001", "-1", "+5", " 5", "5 ", "1e3", "60M", "9999999999", NULL};
  for (int i = 0; bad[i]; i++) {
    mbit = 7;
    assert_int_equal(stream_pacing_parse(bad[i], "--flag", &mbit, err, sizeof err), ZS_EINVAL);
    assert_non_null(strstr(err, "--flag must be a whole number of Mbit/s from 0"));
    assert_int_equal(mbit, 7);
  }
  assert_int_equal(stream_pacing_parse(NULL, "X", &mbit, NULL, 0), ZS_EINVAL);
}

/* Link pacing: two streams of one pacer (here the two ends of one
 * connection, each sending to the other) share the link. From the moment
 * both have a large write handed over, each is capped at link / 2; once the
 * first is done the other gets the whole link and the first keeps its cap.
 * A write below min_write neither counts nor sets a cap, the bytes arrive
 * exact, and a stream leaves its pacer when it is closed. */
static void a_link_pacer_shares_the_link_between_the_streams_sending(void **state) {
  fx *f = *state;
  stream_pacer *p = NULL;
  assert_int_equal(stream_pacer_new(0, STREAM_PACER_MIN_WRITE, 0, &p), ZS_EINVAL);
  assert_int_equal(stream_pacer_new(STREAM_PACING_MBIT_MAX + 1, 1, 0, &p), ZS_EINVAL);
  assert_int_equal(stream_pacer_new(800, STREAM_PACER_MIN_WRITE, 64u << 10, &p), 0);
  assert_int_equal(stream_pacer_join(f->client.st, p), 0);
  assert_int_equal(stream_pacer_join(f->client.st, p), ZS_EINVAL);
  assert_int_equal(stream_pacer_join(f->server.st, p), 0);
  stream_pacer_stats ps;
  stream_pacer_get_stats(p, &ps);
  assert_int_equal(ps.members, 2);
  uint64_t none = 0, up_cap = 0, down_cap = 0;
  assert_int_equal(stream_pacing(f->client.st, &none), 0);
  assert_true(none == UINT64_MAX || none == UINT32_MAX);

  size_t len = (8u << 20) + 5;
  unsigned char *src = malloc(len);
  assert_non_null(src);
  fill(src, len, 23);
  reads_into(&f->server, 100 + len, (1u << 20) + 1);
  reads_into(&f->client, len - 1, (1u << 20) + 1);
  uv_buf_t small = {.base = (char *)src, .len = 100};
  wr w0 = {0};
  assert_int_equal(stream_write(f->client.st, &w0.req, &small, 1, on_written), 0);
  stream_pacer_get_stats(p, &ps);
  assert_int_equal(ps.sending, 0);
  RUN_UNTIL(f, f->server.got == 100 && w0.calls == 1);
  assert_int_equal(stream_pacing(f->client.st, &up_cap), 0);
  assert_int_equal(up_cap, none);

  uv_buf_t up = {.base = (char *)src, .len = len};
  uv_buf_t down = {.base = (char *)src + 1, .len = len - 1};
  wr w1 = {0}, w2 = {0};
  assert_int_equal(stream_write(f->client.st, &w1.req, &up, 1, on_written), 0);
  assert_int_equal(stream_write(f->server.st, &w2.req, &down, 1, on_written), 0);
  /* No callback can have run: both are sending. */
  stream_pacer_get_stats(p, &ps);
  assert_int_equal(ps.sending, 2);
  assert_int_equal(stream_pacing(f->client.st, &up_cap), 0);
  assert_int_equal(stream_pacing(f->server.st, &down_cap), 0);
  assert_int_equal(up_cap, 50000000u); /* 400 Mbit/s */
  assert_int_equal(down_cap, 50000000u);

  RUN_UNTIL(f, f->server.got == 100 + len && f->client.got == len - 1 && w1.calls && w2.calls);
  assert_int_equal(w1.status, 0);
  assert_int_equal(w2.status, 0);
  assert_memory_equal(f->server.dst, src, 100);
  assert_memory_equal(f->server.dst + 100, src, len);
  assert_memory_equal(f->client.dst, src + 1, len - 1);
  assert_int_equal(stream_pacing(f->client.st, &up_cap), 0);
  assert_int_equal(stream_pacing(f->server.st, &down_cap), 0);
  uint64_t first = w1.seq < w2.seq ? up_cap : down_cap;
  uint64_t last = w1.seq < w2.seq ? down_cap : up_cap;
  assert_int_equal(first, 50000000u);
  assert_int_equal(last, 100000000u);
  stream_pacer_get_stats(p, &ps);
  assert_int_equal(ps.sending, 0);
  assert_int_equal(ps.starts, 2);
  assert_int_equal(ps.stops, 2);
  /* 1 for the first start, 2 for the second, 1 when the first stopped:
   * nothing is set twice to the same rate. */
  assert_int_equal(ps.rate_sets, 4);
  assert_int_equal(ps.rate_fails, 0);
  /* TCP_NOTSENT_LOWAT keeps what the kernel holds unsent at a write's end
   * near 64 KiB (at most one more segment train on top). */
  assert_true(ps.stop_unsent_max <= (64u << 10) + (128u << 10));

  stream_close(f->client.st, on_closed);
  stream_close(f->server.st, on_closed);
  RUN_UNTIL(f, f->client.closed && f->server.closed);
  stream_pacer_get_stats(p, &ps);
  assert_int_equal(ps.members, 0);
  stream_pacer_free(p);
  free(f->client.dst);
  free(src);
}

/* Three buffers of odd sizes in one write; the reader hands out at most
 * 100003 bytes at a time, always the next place in its own destination. */
static void large_vectored_write_arrives_whole_in_order_straight_into_caller_buffers(void **state) {
  fx *f = *state;
  size_t sizes[3] = {(5u << 20) + 1, 11, (7u << 20) + 3};
  size_t total = sizes[0] + sizes[1] + sizes[2];
  unsigned char *src = malloc(total);
  assert_non_null(src);
  fill(src, total, 7);
  reads_into(&f->server, total, 100003);
  uv_buf_t bufs[3];
  size_t off = 0;
  for (int i = 0; i < 3; i++) {
    bufs[i].base = (char *)src + off;
    bufs[i].len = sizes[i];
    off += sizes[i];
  }
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, bufs, 3, on_written), 0);
  RUN_UNTIL(f, f->server.got == total && w.calls == 1);
  assert_int_equal(w.status, 0);
  assert_int_equal(f->server.misplaced, 0);
  assert_int_equal(f->server.sunk, 0);
  assert_true(f->server.reads >= (int)(total / 100003));
  assert_memory_equal(f->server.dst, src, total);
  assert_int_equal(stream_write_queue_size(f->client.st), 0);
  free(src);
}

static void writes_complete_once_each_in_the_order_they_were_queued(void **state) {
  fx *f = *state;
  enum { N = 200, LEN = 3000 };
  unsigned char *src = malloc((size_t)N * LEN);
  assert_non_null(src);
  fill(src, (size_t)N * LEN, 11);
  reads_into(&f->server, (size_t)N * LEN, 65536);
  wr *w = calloc(N, sizeof *w);
  assert_non_null(w);
  for (int i = 0; i < N; i++) {
    uv_buf_t b = {.base = (char *)src + (size_t)i * LEN, .len = LEN};
    assert_int_equal(stream_write(f->client.st, &w[i].req, &b, 1, on_written), 0);
  }
  RUN_UNTIL(f, f->server.got == (size_t)N * LEN && w[N - 1].calls == 1);
  for (int i = 0; i < N; i++) {
    assert_int_equal(w[i].calls, 1);
    assert_int_equal(w[i].status, 0);
    if (i)
      assert_true(w[i].seq > w[i - 1].seq);
  }
  assert_memory_equal(f->server.dst, src, (size_t)N * LEN);
  free(w);
  free(src);
}

static void shutdown_delivers_the_bytes_then_the_end_of_the_stream_once(void **state) {
  fx *f = *state;
  unsigned char msg[1000];
  fill(msg, sizeof msg, 3);
  reads_into(&f->server, sizeof msg, 64);
  /* A second start while reading keeps reading, with the callbacks given. */
  assert_int_equal(stream_read_start(f->server.st, on_alloc, on_read), 0);
  uv_buf_t b = {.base = (char *)msg, .len = sizeof msg};
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  assert_int_equal(stream_shutdown(f->client.st, on_shutdown), 0);
  RUN_UNTIL(f, f->server.ended && f->client.shutdown_calls == 1);
  assert_int_equal(f->server.read_status, STREAM_EOF);
  assert_int_equal(f->server.got, sizeof msg);
  assert_memory_equal(f->server.dst, msg, sizeof msg);
  assert_int_equal(f->client.shutdown_status, 0);
  assert_int_equal(w.status, 0);
  /* The other direction still works after our side shut. */
  reads_into(&f->client, 5, 5);
  uv_buf_t back = {.base = "hello", .len = 5};
  wr w2 = {0};
  assert_int_equal(stream_write(f->server.st, &w2.req, &back, 1, on_written), 0);
  RUN_UNTIL(f, f->client.got == 5 && w2.calls == 1);
  assert_memory_equal(f->client.dst, "hello", 5);
  free(f->client.dst);
  assert_int_equal(f->server.reads_after_end, 0);
}

/* The peer does not read, so most of 64 MiB stays queued; closing cancels
 * what is left, every write callback runs once and before the close
 * callback, and the buffers are ours again afterwards. */
static void close_with_writes_pending_cancels_them_before_the_close_callback(void **state) {
  fx *f = *state;
  size_t len = 16u << 20;
  unsigned char *src = calloc(1, len);
  assert_non_null(src);
  wr w[4];
  memset(w, 0, sizeof w);
  for (int i = 0; i < 4; i++) {
    uv_buf_t b = {.base = (char *)src, .len = len};
    assert_int_equal(stream_write(f->client.st, &w[i].req, &b, 1, on_written), 0);
  }
  uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_true(stream_write_queue_size(f->client.st) > 0);
  stream *s = f->client.st;
  stream_close(s, on_closed);
  assert_true(stream_is_closing(s));
  /* Refused at once, and its callback never runs. */
  wr late = {0};
  uv_buf_t b = {.base = (char *)src, .len = 1};
  assert_int_equal(stream_write(s, &late.req, &b, 1, on_written), ZS_ECLOSED);
  stream_close(s, on_closed); /* a second close does nothing */
  RUN_UNTIL(f, f->client.closed);
  assert_int_equal(f->client.closed, 1);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(w[i].calls, 1);
    assert_true(w[i].seq < f->client.close_seq);
  }
  assert_int_equal(w[3].status, ZS_ECANCELED);
  assert_int_equal(late.calls, 0);
  /* The server end sees the stream end (or break) after what was sent. */
  reads_into(&f->server, 0, 0);
  RUN_UNTIL(f, f->server.ended);
  assert_true(f->server.read_status == STREAM_EOF || f->server.read_status == ZS_ECONN);
  assert_true(f->server.sunk < 4 * len);
  free(src);
}

/* 64 MiB each way at once, read in pieces of an odd size into the final
 * destination: every byte arrives, in order, in the right place. */
static void a_64_mib_transfer_each_way_at_once_arrives_byte_exact(void **state) {
  fx *f = *state;
  size_t len = (64u << 20) + 5;
  unsigned char *src = malloc(len);
  assert_non_null(src);
  fill(src, len, 19);
  reads_into(&f->server, len, (1u << 20) + 1);
  reads_into(&f->client, len - 1, (1u << 20) + 1);
  uv_buf_t up = {.base = (char *)src, .len = len};
  uv_buf_t down = {.base = (char *)src + 1, .len = len - 1};
  wr w1 = {0}, w2 = {0};
  assert_int_equal(stream_write(f->client.st, &w1.req, &up, 1, on_written), 0);
  assert_int_equal(stream_write(f->server.st, &w2.req, &down, 1, on_written), 0);
  RUN_UNTIL(f, f->server.got == len && f->client.got == len - 1 && w1.calls && w2.calls);
  assert_int_equal(w1.status, 0);
  assert_int_equal(w2.status, 0);
  assert_int_equal(f->server.misplaced + f->client.misplaced, 0);
  assert_int_equal(f->server.sunk + f->client.sunk, 0);
  assert_memory_equal(f->server.dst, src, len);
  assert_memory_equal(f->client.dst, src + 1, len - 1);
  free(f->client.dst);
  free(src);
}

static void connect_to_a_port_nobody_listens_on_is_zs_econn(void **state) {
  fx *f = *state;
  /* A bound socket that does not listen: its port refuses connections. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a;
  assert_int_equal(uv_ip4_addr("127.0.0.1", 0, &a), 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t alen = sizeof a;
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &alen), 0);
  stream_dialer *d = NULL;
  assert_int_equal(f->t->dialer_new(&f->loop, (const struct sockaddr *)&a, &d), 0);
  side c = {0};
  assert_int_equal(stream_dial(d, on_connect, &c, &c.st), 0);
  RUN_UNTIL(f, c.connect_calls == 1);
  assert_int_equal(c.connect_status, ZS_ECONN);
  assert_string_not_equal(stream_detail(c.st), "");
  stream_close(c.st, on_closed);
  RUN_UNTIL(f, c.closed == 1);
  assert_int_equal(c.connect_calls, 1);
  stream_dialer_free(d);
  close(fd);
}

static void listening_on_an_address_in_use_is_zs_einval_with_the_reason(void **state) {
  fx *f = *state;
  stream_listener *l = NULL;
  char err[128];
  int rc =
      f->t->listen(&f->loop, (const struct sockaddr *)&f->addr, on_accept, f, &l, err, sizeof err);
  assert_int_equal(rc, ZS_EINVAL);
  assert_null(l);
  assert_string_not_equal(err, "");
  struct sockaddr_in6 bad;
  memset(&bad, 0, sizeof bad);
  bad.sin6_family = AF_UNIX; /* not an address a dialer can use */
  stream_dialer *d = NULL;
  assert_int_equal(f->t->dialer_new(&f->loop, (const struct sockaddr *)&bad, &d), ZS_EINVAL);
  assert_null(d);
}

/* The peer closes with our bytes unread, which resets the connection: the
 * writes still queued fail with ZS_ECONN, and so does the read. */
static void peer_reset_fails_pending_writes_and_the_read_with_zs_econn(void **state) {
  fx *f = *state;
  size_t len = 64u << 20;
  unsigned char *src = calloc(1, len);
  assert_non_null(src);
  reads_into(&f->client, 16, 16);
  wr w = {0};
  uv_buf_t b = {.base = (char *)src, .len = len};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_true(stream_write_queue_size(f->client.st) > 0);
  stream_close(f->server.st, on_closed);
  RUN_UNTIL(f, w.calls == 1 && f->client.ended);
  assert_int_equal(w.status, ZS_ECONN);
  assert_int_equal(f->client.read_status, ZS_ECONN);
  assert_string_not_equal(stream_detail(f->client.st), "");
  free(f->client.dst);
  free(src);
}

static void a_read_without_a_buffer_is_zs_enomem(void **state) {
  fx *f = *state;
  f->server.refuse_buffers = 1;
  assert_int_equal(stream_read_start(f->server.st, on_alloc, on_read), 0);
  uv_buf_t b = {.base = "x", .len = 1};
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, f->server.ended);
  assert_int_equal(f->server.read_status, ZS_ENOMEM);
}

static void libuv_errors_map_to_zs_status_codes(void **state) {
  (void)state;
  assert_int_equal(stream_status_from_uv(0), 0);
  assert_int_equal(stream_status_from_uv(UV_EOF), STREAM_EOF);
  assert_int_equal(stream_status_from_uv(UV_ECANCELED), ZS_ECANCELED);
  assert_int_equal(stream_status_from_uv(UV_ECONNREFUSED), ZS_ECONN);
  assert_int_equal(stream_status_from_uv(UV_ECONNRESET), ZS_ECONN);
  assert_int_equal(stream_status_from_uv(UV_EPIPE), ZS_ECONN);
  assert_int_equal(stream_status_from_uv(UV_ETIMEDOUT), ZS_ETIMEDOUT);
  assert_int_equal(stream_status_from_uv(UV_ENOBUFS), ZS_ENOMEM);
  assert_int_equal(stream_status_from_uv(UV_EADDRINUSE), ZS_EINVAL);
  assert_int_equal(stream_status_from_uv(UV_EIO), ZS_EIO);
}

/* ------------------------------------------------------------------------ */
/* TLS only: handshakes that must fail, and how                             */
/* ------------------------------------------------------------------------ */

/* A fixture with a listener (TLS with `sctx`, else plain TCP) and a dialer
 * (TLS with `cctx`, else plain TCP) to it, nothing dialled yet; released by
 * teardown. */
static fx *tls_fx(tls_ctx *sctx, tls_ctx *cctx) {
  fx *f = calloc(1, sizeof *f);
  assert_non_null(f);
  seq = 0;
  assert_int_equal(uv_loop_init(&f->loop), 0);
  struct sockaddr_in a;
  assert_int_equal(uv_ip4_addr("127.0.0.1", 0, &a), 0);
  char err[128];
  int rc = sctx ? stream_tls_listen(sctx, &f->loop, (const struct sockaddr *)&a, 16, on_accept, f,
                                    &f->l, err, sizeof err)
                : stream_listen(&stream_tcp_ops, &f->loop, (const struct sockaddr *)&a, 16,
                                on_accept, f, &f->l, err, sizeof err);
  assert_int_equal(rc, 0);
  assert_int_equal(stream_listener_addr(f->l, &f->addr), 0);
  const struct sockaddr *sa = (const struct sockaddr *)&f->addr;
  rc = cctx ? stream_tls_dialer_new(cctx, &f->loop, sa, "127.0.0.1", &f->d)
            : stream_dialer_new(&stream_tcp_ops, &f->loop, sa, &f->d);
  assert_int_equal(rc, 0);
  return f;
}

static tls_ctx *client_with(const char *ca, const char *cert, const char *key, const char *name) {
  tls_ctx *c = NULL;
  char err[256] = "";
  int rc = tls_client_new(ca, cert, key, name, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("tls_client_new: %s", err);
  return c;
}

static void dial(fx *f) {
  assert_int_equal(stream_dial(f->d, on_connect, &f->client, &f->client.st), 0);
}

static void a_server_certificate_from_another_ca_fails_the_connect_with_the_reason(void **state) {
  (void)state;
  tls_ctx *c = client_with(certs.other_ca, certs.client_crt, certs.client_key, NULL);
  fx *f = tls_fx(server_ctx, c);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1 && f->accepts == 1);
  assert_int_equal(f->client.connect_status, ZS_ECONN);
  assert_non_null(strstr(stream_detail(f->client.st), "certificate verify failed"));
  print_message("client: %s\n", stream_detail(f->client.st));
  /* The server heard the client's alert: no stream, an error with a reason. */
  assert_int_equal(f->accept_status, ZS_ECONN);
  assert_null(f->server.st);
  assert_string_not_equal(f->accept_detail, "");
  print_message("server: %s\n", f->accept_detail);
  void *st = f;
  teardown(&st);
  tls_ctx_free(c);
}

static void a_server_certificate_for_another_name_fails_the_connect(void **state) {
  (void)state;
  tls_ctx *c = client_with(certs.ca, certs.client_crt, certs.client_key, "db.example.org");
  fx *f = tls_fx(server_ctx, c);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1);
  assert_int_equal(f->client.connect_status, ZS_ECONN);
  assert_non_null(strstr(stream_detail(f->client.st), "hostname mismatch"));
  void *st = f;
  teardown(&st);
  tls_ctx_free(c);
}

/* TLS 1.3: the client finishes its handshake before the server checked its
 * certificate, so it may hear of the refusal only at its first read. */
static void a_client_without_a_certificate_is_refused_by_a_server_that_requires_one(void **state) {
  (void)state;
  tls_ctx *c = client_with(certs.ca, NULL, NULL, NULL);
  fx *f = tls_fx(server_ctx, c);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1 && f->accepts == 1);
  assert_int_equal(f->accept_status, ZS_ECONN);
  assert_null(f->server.st);
  assert_non_null(strstr(f->accept_detail, "certificate"));
  if (f->client.connect_status == 0) {
    reads_into(&f->client, 16, 16);
    RUN_UNTIL(f, f->client.ended);
    assert_int_equal(f->client.read_status, ZS_ECONN);
    assert_int_equal(f->client.got, 0);
    free(f->client.dst);
  } else {
    assert_int_equal(f->client.connect_status, ZS_ECONN);
  }
  assert_non_null(strstr(stream_detail(f->client.st), "certificate required"));
  print_message("server: %s; client: %s\n", f->accept_detail, stream_detail(f->client.st));
  void *st = f;
  teardown(&st);
  tls_ctx_free(c);
}

/* The same server admits a client without a certificate when it names no
 * client CA. */
static void a_server_without_a_client_ca_admits_clients_without_certificates(void **state) {
  (void)state;
  tls_ctx *sc = NULL, *c = client_with(certs.ca, NULL, NULL, "localhost");
  char err[256] = "";
  assert_int_equal(tls_server_new(certs.server_crt, certs.server_key, NULL, &sc, err, sizeof err),
                   0);
  fx *f = tls_fx(sc, c);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1 && f->server.st != NULL);
  assert_int_equal(f->client.connect_status, 0);
  reads_into(&f->server, 5, 5);
  uv_buf_t b = {.base = "hello", .len = 5};
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, f->server.got == 5 && w.calls == 1);
  assert_memory_equal(f->server.dst, "hello", 5);
  void *st = f;
  teardown(&st);
  tls_ctx_free(c);
  tls_ctx_free(sc);
}

/* A peer that speaks plaintext to a TLS listener: its handshake fails with a
 * reason, the peer's connection ends, and the listener serves the next. */
static void a_plaintext_peer_is_refused_and_the_listener_serves_the_next(void **state) {
  (void)state;
  fx *f = tls_fx(server_ctx, NULL); /* a plain TCP dialer */
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1);
  assert_int_equal(f->client.connect_status, 0);
  reads_into(&f->client, 0, 0);
  uv_buf_t b = {.base = "PUSH 1 GiB, trust me\r\n\r\n", .len = 24};
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, f->accepts == 1 && f->client.ended);
  assert_int_equal(f->accept_status, ZS_ECONN);
  assert_null(f->server.st);
  assert_string_not_equal(f->accept_detail, "");
  assert_true(f->client.read_status == STREAM_EOF || f->client.read_status == ZS_ECONN);
  print_message("server: %s\n", f->accept_detail);
  stream_close(f->client.st, on_closed);
  RUN_UNTIL(f, f->client.closed == 1);
  free(f->client.dst);
  memset(&f->client, 0, sizeof f->client);
  /* A TLS client next. */
  stream_dialer *d = NULL;
  assert_int_equal(stream_tls_dialer_new(client_ctx, &f->loop, (const struct sockaddr *)&f->addr,
                                         "127.0.0.1", &d),
                   0);
  assert_int_equal(stream_dial(d, on_connect, &f->client, &f->client.st), 0);
  RUN_UNTIL(f, f->client.connect_calls == 1 && f->server.st != NULL);
  assert_int_equal(f->client.connect_status, 0);
  assert_int_equal(f->accept_status, 0);
  stream_dialer_free(d);
  void *st = f;
  teardown(&st);
}

/* The client closes while its handshake waits for the server (a plain TCP
 * server that reads the ClientHello and answers nothing): the connect
 * callback runs once, cancelled, before the close callback. */
static void closing_a_client_during_its_handshake_cancels_the_connect_first(void **state) {
  (void)state;
  fx *f = tls_fx(NULL, client_ctx); /* a plain TCP listener */
  dial(f);
  RUN_UNTIL(f, f->server.st != NULL);
  reads_into(&f->server, 0, 0);
  RUN_UNTIL(f, f->server.sunk > 0); /* the ClientHello */
  assert_int_equal(f->client.connect_calls, 0);
  stream *c = f->client.st;
  stream_close(c, on_closed);
  RUN_UNTIL(f, f->client.closed == 1);
  assert_int_equal(f->client.connect_calls, 1);
  assert_int_equal(f->client.connect_status, ZS_ECANCELED);
  assert_true(f->client.connect_seq < f->client.close_seq);
  void *st = f;
  teardown(&st);
}

/* A peer that closes in the middle of the server's handshake (after one byte
 * of a record) is reported as a failed accept; a listener closed while a
 * handshake runs drops it, and its loop closes clean. */
static void
a_peer_gone_mid_handshake_fails_the_accept_and_a_closed_listener_drops_handshakes(void **state) {
  (void)state;
  fx *f = tls_fx(server_ctx, NULL);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1);
  uv_buf_t b = {.base = "\x16", .len = 1};
  wr w = {0};
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, w.calls == 1);
  stream_close(f->client.st, on_closed);
  RUN_UNTIL(f, f->accepts == 1 && f->client.closed == 1);
  assert_int_equal(f->accept_status, ZS_ECONN);
  assert_non_null(strstr(f->accept_detail, "during the TLS handshake"));
  /* Another silent peer, then the listener goes while its handshake runs. */
  memset(&f->client, 0, sizeof f->client);
  dial(f);
  RUN_UNTIL(f, f->client.connect_calls == 1);
  w.calls = 0;
  assert_int_equal(stream_write(f->client.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, w.calls == 1);
  for (int i = 0; i < 5; i++)
    uv_run(&f->loop, UV_RUN_NOWAIT);
  stream_listener_close(f->l);
  f->l = NULL;
  reads_into(&f->client, 0, 0);
  RUN_UNTIL(f, f->client.ended);
  assert_int_equal(f->accepts, 1);
  free(f->client.dst);
  void *st = f;
  teardown(&st); /* asserts that the loop closes with nothing left */
}

/* Peers that connect and never finish a handshake are cut off after the
 * handshake timeout (10 s), on both sides. */
static void a_handshake_that_never_finishes_times_out_on_both_sides(void **state) {
  (void)state;
  fx *srv = tls_fx(server_ctx, NULL); /* a silent plain client dials a TLS listener */
  dial(srv);
  fx *cli = tls_fx(NULL, client_ctx); /* a TLS client dials a silent plain listener */
  dial(cli);
  while (!(srv->accepts == 1 && cli->client.connect_calls == 1)) {
    uv_run(&srv->loop, UV_RUN_NOWAIT);
    uv_run(&cli->loop, UV_RUN_NOWAIT);
    usleep(20000);
  }
  assert_int_equal(srv->accept_status, ZS_ETIMEDOUT);
  assert_string_not_equal(srv->accept_detail, "");
  assert_int_equal(cli->client.connect_status, ZS_ETIMEDOUT);
  void *st = srv;
  teardown(&st);
  st = cli;
  teardown(&st);
}

/* A peer that is plain OpenSSL on a blocking socket (not this layer), which
 * asks for a key update in the middle of its data: the bytes on both sides
 * of the update arrive whole, the update is answered, and the answer's
 * bytes and the peer's close_notify arrive after it. */
typedef struct openssl_peer {
  int port;
  const unsigned char *src;
  size_t len;
  char answer[6];
  int ok;
} openssl_peer;

static void *openssl_peer_main(void *arg) {
  openssl_peer *p = arg;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", p->port, &a);
  SSL *ssl = tls_ctx_session(client_ctx);
  if (fd < 0 || !ssl || connect(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      SSL_set1_host(ssl, "127.0.0.1") != 1 || SSL_set_fd(ssl, fd) != 1 || SSL_connect(ssl) != 1)
    goto out;
  size_t half = p->len / 2;
  if (SSL_write(ssl, p->src, (int)half) != (int)half ||
      SSL_key_update(ssl, SSL_KEY_UPDATE_REQUESTED) != 1 ||
      SSL_write(ssl, p->src + half, (int)(p->len - half)) != (int)(p->len - half))
    goto out;
  size_t got = 0;
  while (got < 5) {
    int r = SSL_read(ssl, p->answer + got, (int)(5 - got));
    /* The context has AUTO_RETRY off: the server's key update comes back
     * as "want read", and the data follows. */
    if (r <= 0 && SSL_get_error(ssl, r) == SSL_ERROR_WANT_READ)
      continue;
    if (r <= 0)
      goto out;
    got += (size_t)r;
  }
  p->ok = SSL_shutdown(ssl) >= 0;
out:
  SSL_free(ssl);
  if (fd >= 0)
    close(fd);
  return NULL;
}

static void a_plain_openssl_peer_that_updates_its_keys_midway_is_understood(void **state) {
  (void)state;
  fx *f = tls_fx(server_ctx, client_ctx);
  size_t len = (2u << 20) + 9;
  unsigned char *src = malloc(len);
  assert_non_null(src);
  fill(src, len, 23);
  openssl_peer p = {.port = addr_port(&f->addr), .src = src, .len = len};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, openssl_peer_main, &p), 0);
  RUN_UNTIL(f, f->server.st != NULL);
  reads_into(&f->server, len, 100003);
  RUN_UNTIL(f, f->server.got == len);
  assert_memory_equal(f->server.dst, src, len);
  uv_buf_t b = {.base = "hello", .len = 5};
  wr w = {0};
  assert_int_equal(stream_write(f->server.st, &w.req, &b, 1, on_written), 0);
  RUN_UNTIL(f, w.calls == 1 && f->server.ended);
  assert_int_equal(w.status, 0);
  assert_int_equal(f->server.read_status, STREAM_EOF); /* the peer's close_notify */
  pthread_join(th, NULL);
  assert_true(p.ok);
  assert_string_equal(p.answer, "hello");
  free(src);
  void *st = f;
  teardown(&st);
}

static void contexts_refuse_missing_or_mismatched_files_with_a_sentence(void **state) {
  (void)state;
  tls_ctx *c = NULL;
  char err[256] = "";
  assert_int_equal(
      tls_server_new("/nonexistent/server.crt", certs.server_key, NULL, &c, err, sizeof err),
      ZS_EINVAL);
  assert_null(c);
  assert_non_null(strstr(err, "/nonexistent/server.crt"));
  /* A key that is not the certificate's. */
  assert_int_equal(tls_server_new(certs.server_crt, certs.client_key, NULL, &c, err, sizeof err),
                   ZS_EINVAL);
  assert_non_null(strstr(err, "private key"));
  assert_int_equal(tls_server_new(certs.server_crt, NULL, NULL, &c, err, sizeof err), ZS_EINVAL);
  assert_int_equal(tls_client_new(NULL, NULL, NULL, NULL, &c, err, sizeof err), ZS_EINVAL);
  assert_int_equal(tls_client_new(certs.ca, certs.client_crt, NULL, NULL, &c, err, sizeof err),
                   ZS_EINVAL);
  assert_int_equal(tls_client_new(certs.server_key, NULL, NULL, NULL, &c, err, sizeof err),
                   ZS_EINVAL);
  assert_non_null(strstr(err, "CA bundle"));
  /* A client context without a name cannot dial without a host. */
  c = client_with(certs.ca, NULL, NULL, NULL);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  struct sockaddr_in a;
  assert_int_equal(uv_ip4_addr("127.0.0.1", 1, &a), 0);
  stream_dialer *d = NULL;
  assert_int_equal(stream_tls_dialer_new(c, &loop, (const struct sockaddr *)&a, NULL, &d),
                   ZS_EINVAL);
  assert_int_equal(stream_tls_dialer_new(server_ctx, &loop, (const struct sockaddr *)&a, "x", &d),
                   ZS_EINVAL);
  /* A TLS table without its constructors refuses. */
  stream_listener *l = NULL;
  assert_int_equal(stream_listen(&stream_tls_ops, &loop, (const struct sockaddr *)&a, 1, on_accept,
                                 NULL, &l, err, sizeof err),
                   ZS_EINVAL);
  assert_int_equal(uv_loop_close(&loop), 0);
  /* Reloading rereads the files. */
  assert_int_equal(tls_ctx_reload(c, err, sizeof err), 0);
  tls_ctx_free(c);
}

#define CASE(fn, t) cmocka_unit_test_prestate_setup_teardown(fn, setup, teardown, (void *)(t))

int main(void) {
  /* Writes to a reset peer must fail with EPIPE, not kill the test. */
  signal(SIGPIPE, SIG_IGN);
  char err[256] = "";
  if (tls_certs_make(&certs) != 0) {
    fprintf(stderr, "cannot make the test certificates with openssl\n");
    return 1;
  }
  if (tls_server_new(certs.server_crt, certs.server_key, certs.ca, &server_ctx, err, sizeof err) ||
      tls_client_new(certs.ca, certs.client_crt, certs.client_key, NULL, &client_ctx, err,
                     sizeof err)) {
    fprintf(stderr, "%s\n", err);
    tls_certs_remove(&certs);
    return 1;
  }
  int failed = 0;
  for (size_t i = 0; i < sizeof transports / sizeof transports[0]; i++) {
    const transport *t = &transports[i];
    const struct CMUnitTest tests[] = {
        CASE(listener_on_port_0_reports_its_port_and_both_ends_agree_on_addresses, t),
        CASE(socket_options_are_set_or_refused_with_a_status, t),
        CASE(congestion_control_is_set_per_socket_and_read_back, t),
        CASE(pacing_is_set_per_socket_and_read_back, t),
        CASE(a_link_pacer_shares_the_link_between_the_streams_sending, t),
        CASE(large_vectored_write_arrives_whole_in_order_straight_into_caller_buffers, t),
        CASE(writes_complete_once_each_in_the_order_they_were_queued, t),
        CASE(shutdown_delivers_the_bytes_then_the_end_of_the_stream_once, t),
        CASE(close_with_writes_pending_cancels_them_before_the_close_callback, t),
        CASE(connect_to_a_port_nobody_listens_on_is_zs_econn, t),
        CASE(listening_on_an_address_in_use_is_zs_einval_with_the_reason, t),
        CASE(peer_reset_fails_pending_writes_and_the_read_with_zs_econn, t),
        CASE(a_read_without_a_buffer_is_zs_enomem, t),
        CASE(a_64_mib_transfer_each_way_at_once_arrives_byte_exact, t),
        cmocka_unit_test(libuv_errors_map_to_zs_status_codes),
    };
    failed += cmocka_run_group_tests_name(t->name, tests, NULL, NULL);
  }
  const struct CMUnitTest tls_tests[] = {
      cmocka_unit_test(a_server_certificate_from_another_ca_fails_the_connect_with_the_reason),
      cmocka_unit_test(a_server_certificate_for_another_name_fails_the_connect),
      cmocka_unit_test(a_client_without_a_certificate_is_refused_by_a_server_that_requires_one),
      cmocka_unit_test(a_server_without_a_client_ca_admits_clients_without_certificates),
      cmocka_unit_test(a_plaintext_peer_is_refused_and_the_listener_serves_the_next),
      cmocka_unit_test(closing_a_client_during_its_handshake_cancels_the_connect_first),
      cmocka_unit_test(
          a_peer_gone_mid_handshake_fails_the_accept_and_a_closed_listener_drops_handshakes),
      cmocka_unit_test(a_handshake_that_never_finishes_times_out_on_both_sides),
      cmocka_unit_test(a_plain_openssl_peer_that_updates_its_keys_midway_is_understood),
      cmocka_unit_test(contexts_refuse_missing_or_mismatched_files_with_a_sentence),
  };
  failed += cmocka_run_group_tests_name("tls handshakes", tls_tests, NULL, NULL);
  tls_ctx_free(server_ctx);
  tls_ctx_free(client_ctx);
  tls_certs_remove(&certs);
  return failed;
}
