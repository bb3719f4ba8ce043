/*
 * bench_tls — the data plane's transport with TLS 1.3 against plain TCP:
 * bulk throughput through the stream layer (common/net/stream.h), the path every
 * data-plane byte takes, over loopback, each round measuring both.
 *
 * A round, for one transport: a receiver thread runs its own libuv loop with
 * a listener (plain, or TLS with a certificate and client certificates
 * required, as a server with --tls-client-ca runs), the main thread dials
 * --conns connections from another loop (the TLS handshakes finish before
 * the clock starts), then every connection sends its share of --size bytes
 * in writes of 4 MiB (two in flight), and the receiver reads them into a
 * 4 MiB buffer per connection, as the data plane reads a push into its
 * destination. The time runs from the first write to the receiver's last
 * byte. Rounds alternate which transport goes first; the figures are medians
 * over the rounds, after one warm-up round of each.
 *
 * Reported: TLS's throughput with plain TCP's, measured in the same rounds,
 * as its limit (ratio = TLS / plain; ratio_of_rounds is the median of each
 * round's own ratio), plain TCP's own figure; the CPU-bound rate of each
 * (1 / the CPU seconds per byte of the busier end, sender or receiver, each
 * on its own thread: what the rate would be with a core for each end and
 * nothing else running, which a shared machine disturbs far less than the
 * wall clock) as the same ratio; and that CPU-bound TLS rate against the
 * cipher alone (AES-128-GCM sealing 16 KiB records, bytes per CPU second on
 * one core, measured before each round): the sender encrypts on one core
 * while the receiver decrypts on the other, as a trainer and a shard do, so
 * no TLS stream on one loop thread can beat that.
 *
 * Usage: bench_tls [--json] [--quick] [--reps R] [--size 1G] [--conns 1,2]
 */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "bench.h"
#include "common/net/stream.h"
#include "common/net/tls.h"
#include "tests/unit/tls_certs.h"

#define WRITE_BYTES (4u << 20)
#define WRITES_IN_FLIGHT 2
#define MAX_CONNS 16

static tls_ctx *server_ctx, *client_ctx;

/* CPU seconds the calling thread has used. */
static double thread_cpu(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* What one round measured. */
typedef struct round_result {
  double rate;     /* bytes per second, first write to last byte */
  double send_cpu; /* sender's CPU seconds per GB */
  double recv_cpu; /* receiver's CPU seconds per GB */
} round_result;

/* ---------------------------------------------------------------- receiver */

typedef struct receiver receiver;

typedef struct rconn {
  receiver *r;
  stream *s;
  char *buf;
} rconn;

struct receiver {
  pthread_t thread;
  uv_loop_t loop;
  stream_listener *l;
  int use_tls;
  uint64_t expect, got;
  uint32_t nconns;
  rconn conns[MAX_CONNS];
  double t_done;
  double cpu_first, cpu_done; /* the thread's CPU seconds at the first and last byte */
  const char *failure;        /* a static sentence, or NULL */
  uv_async_t *notify;         /* on the sender's loop: everything arrived, or failed */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int port; /* published once listening; -1: could not */
};

static void recv_alloc(stream *s, void *data, size_t suggested, uv_buf_t *buf) {
  (void)s;
  (void)suggested;
  rconn *c = data;
  *buf = uv_buf_init(c->buf, WRITE_BYTES);
}

/* Everything arrived, or a failure: the receiver closes its side. */
static void recv_finish(receiver *r, const char *failure) {
  r->t_done = bench_now();
  r->cpu_done = thread_cpu();
  r->failure = failure;
  for (uint32_t i = 0; i < r->nconns; i++)
    if (r->conns[i].s)
      stream_close(r->conns[i].s, NULL);
  stream_listener_close(r->l);
  r->l = NULL;
  uv_async_send(r->notify);
}

static void recv_read(stream *s, void *data, ssize_t nread, const uv_buf_t *buf) {
  (void)s;
  (void)buf;
  rconn *c = data;
  receiver *r = c->r;
  if (!r->l)
    return; /* finished */
  if (nread < 0) {
    recv_finish(r, "a connection ended before its bytes arrived");
    return;
  }
  if (r->got == 0)
    r->cpu_first = thread_cpu();
  r->got += (uint64_t)nread;
  if (r->got == r->expect)
    recv_finish(r, NULL);
}

static void recv_accept(stream_listener *l, void *data, int status, stream *s) {
  (void)l;
  receiver *r = data;
  if (status != 0 || r->nconns == MAX_CONNS) {
    recv_finish(r, "a connection was not accepted");
    if (s)
      stream_close(s, NULL);
    return;
  }
  rconn *c = &r->conns[r->nconns++];
  c->s = s;
  stream_set_data(s, c);
  if (stream_read_start(s, recv_alloc, recv_read) != 0)
    recv_finish(r, "cannot read");
}

static void *recv_main(void *arg) {
  receiver *r = arg;
  uv_loop_init(&r->loop);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  char err[256] = "";
  int rc = r->use_tls ? stream_tls_listen(server_ctx, &r->loop, (const struct sockaddr *)&a, 64,
                                          recv_accept, r, &r->l, err, sizeof err)
                      : stream_listen(&stream_tcp_ops, &r->loop, (const struct sockaddr *)&a, 64,
                                      recv_accept, r, &r->l, err, sizeof err);
  struct sockaddr_storage bound;
  int port = -1;
  if (rc == 0 && stream_listener_addr(r->l, &bound) == 0)
    port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
  pthread_mutex_lock(&r->mu);
  r->port = port;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  if (port > 0)
    uv_run(&r->loop, UV_RUN_DEFAULT);
  uv_loop_close(&r->loop);
  return NULL;
}

/* ------------------------------------------------------------------ sender */

typedef struct sconn {
  struct sender *snd;
  stream *s;
  uint64_t left; /* bytes not yet written */
  int connected;
  stream_write_req w[WRITES_IN_FLIGHT];
} sconn;

typedef struct sender {
  uv_loop_t loop;
  uv_async_t notify;
  int notified;
  const char *src;
  uint32_t nconns, connected;
  int failed;
  sconn conns[MAX_CONNS];
} sender;

static void send_next(sconn *c, stream_write_req *w);

static void on_sent(stream_write_req *w, int status) {
  sconn *c = stream_get_data(w->s);
  if (status != 0) {
    c->snd->failed = 1;
    return;
  }
  send_next(c, w);
}

static void send_next(sconn *c, stream_write_req *w) {
  if (c->left == 0)
    return;
  uint64_t n = c->left < WRITE_BYTES ? c->left : WRITE_BYTES;
  c->left -= n;
  uv_buf_t b = uv_buf_init((char *)c->snd->src, (unsigned)n);
  if (stream_write(c->s, w, &b, 1, on_sent) != 0)
    c->snd->failed = 1;
}

static void on_connected(stream *s, void *data, int status) {
  (void)s;
  sconn *c = data;
  if (status != 0) {
    bench_note("connect failed: %s", stream_detail(s));
    c->snd->failed = 1;
    return;
  }
  c->connected = 1;
  c->snd->connected++;
}

static void on_notify(uv_async_t *a) {
  sender *snd = a->data;
  snd->notified = 1;
}

/* One round: `total` bytes over `nconns` connections of one transport. */
static round_result round_once(int use_tls, uint32_t nconns, uint64_t total, const char *src) {
  receiver r;
  memset(&r, 0, sizeof r);
  sender snd;
  memset(&snd, 0, sizeof snd);
  r.use_tls = use_tls;
  r.expect = total;
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  for (uint32_t i = 0; i < nconns; i++) {
    r.conns[i].r = &r;
    r.conns[i].buf = bench_alloc(WRITE_BYTES);
  }
  uv_loop_init(&snd.loop);
  uv_async_init(&snd.loop, &snd.notify, on_notify);
  snd.notify.data = &snd;
  r.notify = &snd.notify;
  snd.src = src;
  snd.nconns = nconns;
  r.port = 0;
  if (pthread_create(&r.thread, NULL, recv_main, &r) != 0)
    bench_die("cannot start the receiver thread");
  pthread_mutex_lock(&r.mu);
  while (r.port == 0)
    pthread_cond_wait(&r.cv, &r.mu);
  pthread_mutex_unlock(&r.mu);
  if (r.port < 0)
    bench_die("the receiver cannot listen");
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", r.port, &a);
  stream_dialer *d = NULL;
  int rc = use_tls ? stream_tls_dialer_new(client_ctx, &snd.loop, (const struct sockaddr *)&a,
                                           "127.0.0.1", &d)
                   : stream_dialer_new(&stream_tcp_ops, &snd.loop, (const struct sockaddr *)&a, &d);
  if (rc != 0)
    bench_die("cannot make a dialer: %s", zs_strerror(rc));
  uint64_t share = total / nconns;
  for (uint32_t i = 0; i < nconns; i++) {
    sconn *c = &snd.conns[i];
    c->snd = &snd;
    c->left = i + 1 < nconns ? share : total - share * (nconns - 1);
    if (stream_dial(d, on_connected, c, &c->s) != 0)
      bench_die("cannot dial");
  }
  while (snd.connected < nconns && !snd.failed)
    uv_run(&snd.loop, UV_RUN_ONCE);
  if (snd.failed)
    bench_die("the connections could not be made");
  double t0 = bench_now(), cpu0 = thread_cpu();
  for (uint32_t i = 0; i < nconns; i++)
    for (int k = 0; k < WRITES_IN_FLIGHT; k++)
      send_next(&snd.conns[i], &snd.conns[i].w[k]);
  while (!snd.notified)
    uv_run(&snd.loop, UV_RUN_ONCE);
  double cpu1 = thread_cpu();
  for (uint32_t i = 0; i < nconns; i++)
    stream_close(snd.conns[i].s, NULL);
  stream_dialer_free(d);
  uv_close((uv_handle_t *)&snd.notify, NULL);
  uv_run(&snd.loop, UV_RUN_DEFAULT);
  uv_loop_close(&snd.loop);
  pthread_join(r.thread, NULL);
  if (r.failure || snd.failed)
    bench_die("a round failed: %s", r.failure ? r.failure : "a write failed");
  for (uint32_t i = 0; i < nconns; i++)
    free(r.conns[i].buf);
  pthread_mutex_destroy(&r.mu);
  pthread_cond_destroy(&r.cv);
  double gb = (double)total / 1e9;
  return (round_result){.rate = (double)total / (r.t_done - t0),
                        .send_cpu = (cpu1 - cpu0) / gb,
                        .recv_cpu = (r.cpu_done - r.cpu_first) / gb};
}

/* The cipher alone: AES-128-GCM sealing `total` bytes in 16 KiB records (a
 * TLS record's most) on this thread, bytes per CPU second (the thread's own
 * CPU time, which other tenants of the machine disturb less than the wall
 * clock). No sender can encrypt faster on one core, so it bounds TLS on one
 * loop thread. */
static double cipher_speed(uint64_t total, const char *src) {
  enum { REC = 16384 };
  static unsigned char out[REC + 16];
  unsigned char key[16] = {1}, iv[12] = {2}, tag[16];
  EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
  if (!x || EVP_EncryptInit_ex(x, EVP_aes_128_gcm(), NULL, key, iv) != 1)
    bench_die("cannot set up AES-128-GCM");
  double t0 = thread_cpu();
  for (uint64_t done = 0; done < total; done += REC) {
    int n = 0;
    iv[0]++;
    if (EVP_EncryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
        EVP_EncryptUpdate(x, out, &n, (const unsigned char *)src + done % WRITE_BYTES, REC) != 1 ||
        EVP_EncryptFinal_ex(x, out + n, &n) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, 16, tag) != 1)
      bench_die("AES-128-GCM failed");
  }
  double t = thread_cpu() - t0;
  EVP_CIPHER_CTX_free(x);
  return (double)total / t;
}

static void usage(void) {
  fprintf(stderr, "usage: bench_tls [--json] [--quick] [--reps R] [--size 1G] [--conns 1,2]\n");
  exit(2);
}

int main(int argc, char **argv) {
  bench_opts o;
  bench_parse_common(&argc, argv, &o);
  uint64_t size = o.quick ? (256u << 20) : (1u << 30);
  uint64_t conns[BENCH_MAX_LIST] = {1, 2};
  int nconns = 2;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &size, 1) != 1 || size == 0)
        usage();
    } else if (strcmp(argv[i], "--conns") == 0 && i + 1 < argc) {
      nconns = bench_parse_list(argv[++i], conns, BENCH_MAX_LIST);
      if (nconns < 1)
        usage();
    } else {
      usage();
    }
  }
  for (int i = 0; i < nconns; i++)
    if (conns[i] < 1 || conns[i] > MAX_CONNS)
      usage();
  int reps = o.reps ? o.reps : (o.quick ? 3 : 7);
  if (reps > 100)
    reps = 100;

  tls_certs certs;
  char err[256] = "";
  if (tls_certs_make(&certs) != 0)
    bench_die("cannot make the certificates with openssl");
  if (tls_server_new(certs.server_crt, certs.server_key, certs.ca, &server_ctx, err, sizeof err) ||
      tls_client_new(certs.ca, certs.client_crt, certs.client_key, NULL, &client_ctx, err,
                     sizeof err))
    bench_die("%s", err);
  char *src = bench_alloc(WRITE_BYTES);
  memset(src, 0x5a, WRITE_BYTES);

  for (int ci = 0; ci < nconns; ci++) {
    uint32_t nc = (uint32_t)conns[ci];
    double tls[100], plain[100], cipher[100], ratios[100];
    double tls_cpu[2][100], plain_cpu[2][100]; /* [0] sender, [1] receiver, s/GB */
    round_once(0, nc, size, src);              /* warm-up */
    round_once(1, nc, size, src);
    for (int k = 0; k < reps; k++) {
      cipher[k] = cipher_speed(size / 4, src);
      round_result rt, rp;
      if (k & 1)
        rt = round_once(1, nc, size, src);
      rp = round_once(0, nc, size, src);
      if (!(k & 1))
        rt = round_once(1, nc, size, src);
      tls[k] = rt.rate;
      plain[k] = rp.rate;
      ratios[k] = rt.rate / rp.rate;
      tls_cpu[0][k] = rt.send_cpu;
      tls_cpu[1][k] = rt.recv_cpu;
      plain_cpu[0][k] = rp.send_cpu;
      plain_cpu[1][k] = rp.recv_cpu;
    }
    size_t n = (size_t)reps;
    double rt = bench_quantile(tls, n, 0.5) / 1e9, rp = bench_quantile(plain, n, 0.5) / 1e9;
    double rr = bench_quantile(ratios, n, 0.5), rc = bench_quantile(cipher, n, 0.5) / 1e9;
    double ts = bench_quantile(tls_cpu[0], n, 0.5), tr = bench_quantile(tls_cpu[1], n, 0.5);
    double ps = bench_quantile(plain_cpu[0], n, 0.5), pr = bench_quantile(plain_cpu[1], n, 0.5);
    /* With a core for each end, the busier end sets the pace: the rate its
     * CPU time per byte allows, which a shared machine disturbs far less
     * than the wall-clock rate. */
    double tb = 1 / (ts > tr ? ts : tr), pb = 1 / (ps > pr ? ps : pr);
    char label[64];
    bench_kv kv[] = {BENCH_N("conns", nc),
                     BENCH_N("bytes", size),
                     BENCH_N("rounds", reps),
                     BENCH_N("ratio_of_rounds", rr),
                     BENCH_N("tls_send_cpu_s_per_GB", ts),
                     BENCH_N("tls_recv_cpu_s_per_GB", tr),
                     BENCH_N("plain_send_cpu_s_per_GB", ps),
                     BENCH_N("plain_recv_cpu_s_per_GB", pr),
                     BENCH_S("cipher", "TLS_AES_128_GCM_SHA256")};
    snprintf(label, sizeof label, "stream_tls_GBps_conns%u", nc);
    bench_report(&o, "tls", label, rt, "GB/s", rp, kv, 9);
    snprintf(label, sizeof label, "stream_plain_GBps_conns%u", nc);
    bench_report(&o, "tls", label, rp, "GB/s", 0, kv, 3);
    snprintf(label, sizeof label, "stream_tls_cpu_bound_GBps_conns%u", nc);
    bench_report(&o, "tls", label, tb, "GB/s", pb, kv, 8);
    /* The CPU-bound TLS rate against the cipher's own on one core. */
    snprintf(label, sizeof label, "stream_tls_cpu_bound_vs_cipher_conns%u", nc);
    bench_report(&o, "tls", label, tb, "GB/s", rc, kv, 3);
  }
  free(src);
  tls_ctx_free(server_ctx);
  tls_ctx_free(client_ctx);
  tls_certs_remove(&certs);
  return 0;
}
