/*
 * test_client_faults — libzshard's retries on connection loss, against real
 * servers reached through a small TCP proxy in this test. The proxy forwards
 * connections to one shard and, on the test's command, refuses the next
 * connection attempts or cuts every open connection, which the client sees as
 * gRPC UNAVAILABLE or, on the data plane, as a failed connection. (gRPC's
 * channel then fails calls fast for its own reconnect backoff, about 1 to
 * 10 s, which is what the retries bridge.) The client must retry with backoff
 * and carry on, counting the retries in the step's timing, or give up after
 * max_retries with ZS_ECONN naming the shard. The proxy can also damage one
 * answer's payload, which the client must refuse by its CRC32C and ask for
 * again.
 *
 * The client reaches a shard's data plane at the host of its gRPC address and
 * the port the shard advertises. So the proxy stands on another loopback
 * address, 127.0.0.61, with one listener for gRPC and one on the shard's own
 * data port, and forwards both to the shard on 127.0.0.1. Not 127.0.0.2: the
 * hostile-client tests running beside this one connect from there, and an
 * ephemeral port they hold on it can be the shard's data port.
 *
 * CTest runs the program on the default transport, the data plane, and with
 * ZSHARD_TRANSPORT=grpc; the tests of the data plane alone are skipped on
 * the latter.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
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

#include "harness.h"
#include "internal.h"
#include "zshard/zshard.h"

/* 1 when this run exercises the data plane (see the top of the file). */
static int data_run(void) {
  const char *env = getenv("ZSHARD_TRANSPORT");
  return !(env && strcmp(env, "grpc") == 0);
}

/* ---- the proxy ----------------------------------------------------------------- */

#define PROXY_MAX_PAIRS 32
#define PROXY_HOST "127.0.0.61"
/* Longer than any frame header and meta: a read from the server of at least
 * this many bytes, starting at a frame's start, ends inside that frame's
 * payload. */
#define PROXY_CORRUPT_MIN 400

/* The proxy's two listeners. */
enum { L_GRPC = 0, L_DATA = 1, L_COUNT = 2 };

typedef struct proxy {
  int lfd[L_COUNT];  /* -1: no such listener */
  int port[L_COUNT]; /* on PROXY_HOST */
  int wake[2];       /* self-pipe: commands for the proxy thread */
  struct sockaddr_in up[L_COUNT];
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int refuse[L_COUNT];  /* (mu) connection attempts still to refuse */
  int cut_req;          /* (mu) close forwarded connections of the listeners in mask */
  int cut_mask;         /* (mu) bit l: listener l */
  int cuts_done;        /* (mu) */
  int stop;             /* (mu) */
  int refused[L_COUNT]; /* (mu) attempts refused so far */
  /* (mu) flip the last byte of the next read of at least PROXY_CORRUPT_MIN
   * bytes from the server on listener l's connections, then disarm */
  int corrupt_armed[L_COUNT];
  int corrupted[L_COUNT];       /* (mu) reads corrupted so far */
  int pair[PROXY_MAX_PAIRS][2]; /* proxy thread only: client fd, upstream fd */
  int pair_l[PROXY_MAX_PAIRS];  /* proxy thread only: the listener of each pair */
  int npairs;
} proxy;

static void close_pair(proxy *p, int i) {
  close(p->pair[i][0]);
  close(p->pair[i][1]);
  /* The last pair takes the freed place. */
  p->pair[i][0] = p->pair[p->npairs - 1][0];
  p->pair[i][1] = p->pair[p->npairs - 1][1];
  p->pair_l[i] = p->pair_l[p->npairs - 1];
  p->npairs--;
}

static int write_all(int fd, const char *buf, ssize_t n) {
  while (n > 0) {
    ssize_t w = write(fd, buf, (size_t)n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    buf += w;
    n -= w;
  }
  return 0;
}

static void *proxy_main(void *arg) {
  proxy *p = arg;
  struct pollfd fds[1 + L_COUNT + 2 * PROXY_MAX_PAIRS];
  char buf[65536];
  for (;;) {
    nfds_t n = 0;
    fds[n++] = (struct pollfd){.fd = p->wake[0], .events = POLLIN};
    /* A missing listener (fd -1) is ignored by poll. */
    for (int l = 0; l < L_COUNT; l++)
      fds[n++] = (struct pollfd){.fd = p->lfd[l], .events = POLLIN};
    for (int i = 0; i < p->npairs; i++) {
      fds[n++] = (struct pollfd){.fd = p->pair[i][0], .events = POLLIN};
      fds[n++] = (struct pollfd){.fd = p->pair[i][1], .events = POLLIN};
    }
    if (poll(fds, n, -1) < 0) {
      if (errno == EINTR)
        continue;
      break;
    }
    if (fds[0].revents) {
      char c;
      if (read(p->wake[0], &c, 1) < 0) {
        /* Nothing to do: the flags below say what was asked. */
      }
      pthread_mutex_lock(&p->mu);
      int stop = p->stop;
      if (p->cut_req) {
        for (int i = p->npairs; i-- > 0;)
          if (p->cut_mask & (1 << p->pair_l[i]))
            close_pair(p, i);
        p->cut_req = 0;
        p->cuts_done++;
        pthread_cond_broadcast(&p->cv);
      }
      pthread_mutex_unlock(&p->mu);
      if (stop)
        break;
      continue; /* the pair list changed: rebuild the poll set */
    }
    int accepted = 0;
    for (int l = 0; l < L_COUNT; l++) {
      if (!(fds[1 + l].revents & POLLIN))
        continue;
      accepted = 1;
      int cfd = accept(p->lfd[l], NULL, NULL);
      if (cfd < 0)
        continue;
      pthread_mutex_lock(&p->mu);
      int refuse = p->refuse[l] > 0;
      if (refuse) {
        p->refuse[l]--;
        p->refused[l]++;
      }
      pthread_mutex_unlock(&p->mu);
      int ufd = -1;
      if (!refuse && p->npairs < PROXY_MAX_PAIRS) {
        ufd = socket(AF_INET, SOCK_STREAM, 0);
        if (ufd >= 0 && connect(ufd, (struct sockaddr *)&p->up[l], sizeof p->up[l]) != 0) {
          close(ufd);
          ufd = -1;
        }
      }
      if (ufd < 0) {
        close(cfd);
      } else {
        p->pair[p->npairs][0] = cfd;
        p->pair[p->npairs][1] = ufd;
        p->pair_l[p->npairs] = l;
        p->npairs++;
      }
    }
    if (accepted)
      continue;
    for (nfds_t k = 1 + L_COUNT; k < n; k++) {
      if (!fds[k].revents)
        continue;
      int i = (int)(k - 1 - L_COUNT) / 2, from = (int)(k - 1 - L_COUNT) % 2;
      ssize_t r = read(p->pair[i][from], buf, sizeof buf);
      if (r >= PROXY_CORRUPT_MIN && from == 1) {
        pthread_mutex_lock(&p->mu);
        if (p->corrupt_armed[p->pair_l[i]]) {
          buf[r - 1] ^= 0x10;
          p->corrupt_armed[p->pair_l[i]] = 0;
          p->corrupted[p->pair_l[i]]++;
        }
        pthread_mutex_unlock(&p->mu);
      }
      if (r <= 0 || write_all(p->pair[i][1 - from], buf, r) != 0)
        close_pair(p, i);
      break; /* indices may have moved: poll again */
    }
  }
  while (p->npairs > 0)
    close_pair(p, p->npairs - 1);
  return NULL;
}

static void poke(proxy *p) {
  char c = 1;
  if (write(p->wake[1], &c, 1) != 1) {
    /* The pipe is never full in this test: one byte per command. */
  }
}

/* A listener on PROXY_HOST:port (0: any free port) forwarding to
 * 127.0.0.1:up_port. Returns 0 or -1. */
static int proxy_listen(proxy *p, int l, int port, int up_port) {
  p->up[l].sin_family = AF_INET;
  p->up[l].sin_port = htons((uint16_t)up_port);
  inet_pton(AF_INET, "127.0.0.1", &p->up[l].sin_addr);
  p->lfd[l] = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, PROXY_HOST, &a.sin_addr);
  socklen_t len = sizeof a;
  if (p->lfd[l] < 0 || bind(p->lfd[l], (struct sockaddr *)&a, sizeof a) != 0 ||
      listen(p->lfd[l], 16) != 0 || getsockname(p->lfd[l], (struct sockaddr *)&a, &len) != 0)
    return -1;
  p->port[l] = ntohs(a.sin_port);
  return 0;
}

/* Starts a proxy for server s: gRPC on a free port, and, with `data`, the
 * data plane (if the server has one) on the server's own data port, both on
 * PROXY_HOST. The first `refuse` gRPC connection attempts are refused. */
static int proxy_start(proxy *p, const hs_server *s, int refuse, int data) {
  memset(p, 0, sizeof *p);
  p->lfd[L_GRPC] = p->lfd[L_DATA] = -1;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->refuse[L_GRPC] = refuse;
  rpc_channel *ch = NULL;
  Zshard__V1__GetInfoResponse *info = NULL;
  if (rpc_channel_open(s->addr, &ch) != 0 || hs_get_info(ch, &info, NULL) != 0) {
    rpc_channel_close(ch);
    return -1;
  }
  int data_port = (int)info->data_port;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
  if (pipe(p->wake) != 0 || proxy_listen(p, L_GRPC, 0, s->port) != 0 ||
      (data && data_port && proxy_listen(p, L_DATA, data_port, data_port) != 0))
    return -1;
  return pthread_create(&p->th, NULL, proxy_main, p) == 0 ? 0 : -1;
}

/* Closes the forwarded connections of the listeners in `mask` and refuses
 * the next `refuse` attempts on each of them; returns once they are closed. */
static void proxy_cut(proxy *p, int mask, int refuse) {
  pthread_mutex_lock(&p->mu);
  int before = p->cuts_done;
  for (int l = 0; l < L_COUNT; l++)
    if (mask & (1 << l))
      p->refuse[l] += refuse;
  p->cut_mask = mask;
  p->cut_req = 1;
  poke(p);
  while (p->cuts_done == before)
    pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

static int proxy_refused(proxy *p, int l) {
  pthread_mutex_lock(&p->mu);
  int n = p->refused[l];
  pthread_mutex_unlock(&p->mu);
  return n;
}

static void proxy_stop(proxy *p) {
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  poke(p);
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->th, NULL);
  for (int l = 0; l < L_COUNT; l++)
    if (p->lfd[l] >= 0)
      close(p->lfd[l]);
  close(p->wake[0]);
  close(p->wake[1]);
}

/* ---- tests ------------------------------------------------------------------------ */

#define NT 3
static const uint64_t NUMEL[NT] = {300, 40, 7};

static zs_client *client_through(const char *addrs, uint32_t max_retries) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = 64;
  o.max_retries = max_retries;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 500;
  o.rpc_timeout_ms = 10000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  return c;
}

static void one_step(zs_client *c, float **buf, zs_step_result *r) {
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_pull(c, t, buf[t], ZS_DTYPE_FP32, NUMEL[t] * 4, NULL), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    assert_int_equal(zs_push(c, t, 0, buf[t], ZS_DTYPE_FP32, NUMEL[t] * 4, NULL), ZS_OK);
  zs_step_result_init(r);
  int rc = zs_step(c, 0.01, 0, 0, r);
  if (rc != ZS_OK)
    fprintf(stderr, "zs_step: %s\n", zs_last_error());
  assert_int_equal(rc, ZS_OK);
}

/* The calls retried in the client's last step. */
static uint64_t last_retries(zs_client *c) {
  zs_timing t;
  assert_int_equal(zs_last_timing(c, &t), ZS_OK);
  return t.retries;
}

static float **alloc_weights(void) {
  float **buf = calloc(NT, sizeof *buf);
  for (uint32_t t = 0; t < NT; t++) {
    buf[t] = calloc(NUMEL[t], sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      buf[t][i] = 0.001f * (float)(i + 1);
  }
  return buf;
}

static void free_weights(float **buf) {
  for (uint32_t t = 0; t < NT; t++)
    free(buf[t]);
  free(buf);
}

/* The address list of a 2-shard cluster whose shard 1 is behind the proxy. */
static void addresses_through(const hs_cluster *cl, const proxy *px, char *buf, size_t len) {
  snprintf(buf, len, "%s,%s:%d", cl->srv[0]->addr, PROXY_HOST, px->port[L_GRPC]);
}

static void a_lost_connection_is_retried_and_counted_in_the_timing(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  proxy px;
  assert_int_equal(proxy_start(&px, cl.srv[1], 0, 1), 0);
  char addrs[128];
  addresses_through(&cl, &px, addrs, sizeof addrs);
  /* After a failed connection gRPC's channel keeps failing fast for its own
   * reconnect backoff (seconds); the budget here is far above that. */
  zs_client *c = client_through(addrs, 200);
  float **buf = alloc_weights();
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_OK);
  zs_step_result r;
  one_step(c, buf, &r);
  assert_int_equal(last_retries(c), 0);
  assert_int_equal(r.applied, 1);

  /* Every connection to shard 1 is lost between steps and the gRPC
   * reconnection is refused once: step 2's calls to shard 1 fail with
   * UNAVAILABLE until the channel reconnects, and are retried. */
  proxy_cut(&px, 1 << L_GRPC | 1 << L_DATA, 1);
  one_step(c, buf, &r);
  assert_int_equal(proxy_refused(&px, L_GRPC), 1);
  assert_true(last_retries(c) >= 1);
  assert_int_equal(r.applied, 1);
  assert_int_equal(r.version, 2);
  assert_int_equal(zs_current_step(c), 3);

  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* A 2-shard cluster whose shard 1 is reached through the proxy, gRPC and
 * data plane; a client (max_retries retries) that opened the job, is on the
 * data plane to shard 1 and made one step (r). */
static void data_job_through_proxy(hs_cluster *cl, proxy *px, uint32_t max_retries, zs_client **c,
                                   float ***buf, zs_step_result *r) {
  assert_int_equal(hs_cluster_start(cl, 2, NULL), 0);
  assert_int_equal(proxy_start(px, cl->srv[1], 0, 1), 0);
  assert_true(px->lfd[L_DATA] >= 0);
  char addrs[128];
  addresses_through(cl, px, addrs, sizeof addrs);
  *c = client_through(addrs, max_retries);
  *buf = alloc_weights();
  assert_int_equal(zs_open_job(*c, (const float *const *)*buf), ZS_OK);
  assert_int_equal(zc_shard_transport(*c, 1), ZS_TRANSPORT_DATA);
  one_step(*c, *buf, r);
}

static void a_lost_data_connection_is_retried_on_the_data_plane(void **state) {
  (void)state;
  if (!data_run())
    skip();
  hs_cluster cl;
  proxy px;
  zs_client *c = NULL;
  float **buf = NULL;
  zs_step_result r;
  data_job_through_proxy(&cl, &px, 200, &c, &buf, &r);
  assert_int_equal(last_retries(c), 0);

  /* Only the data connection is cut, and its next two reconnections are
   * refused: step 2's pulls and pushes to shard 1 fail twice with a lost
   * connection and go through on the third attempt, still on the data plane
   * (gRPC, which carries the rest of the step, is untouched). */
  proxy_cut(&px, 1 << L_DATA, 2);
  one_step(c, buf, &r);
  assert_int_equal(proxy_refused(&px, L_DATA), 2);
  assert_int_equal(proxy_refused(&px, L_GRPC), 0);
  assert_true(last_retries(c) >= 2);
  assert_int_equal(r.applied, 1);
  assert_int_equal(r.version, 2);
  assert_int_equal(zc_shard_transport(c, 1), ZS_TRANSPORT_DATA);

  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* A pull answer damaged on the way fails its payload CRC32C (the connection
 * lives on) and is asked for again: the caller gets the right bytes. This is
 * also what a peer sees when an apply overtakes an answer it stalled on
 * (docs/PROTOCOL.md). */
static void a_pull_answer_failing_its_crc_is_asked_again(void **state) {
  (void)state;
  if (!data_run())
    skip();
  hs_cluster cl;
  proxy px;
  zs_client *c = NULL;
  float **buf = NULL;
  zs_step_result r;
  data_job_through_proxy(&cl, &px, 5, &c, &buf, &r);

  /* t0 is split over both shards: its piece on shard 1 (150 fp32, 600 bytes)
   * comes through the proxy, which damages its last byte once. */
  float *want = calloc(NUMEL[0], sizeof *want), *got = calloc(NUMEL[0], sizeof *got);
  assert_true(want && got);
  assert_int_equal(zs_pull(c, 0, want, ZS_DTYPE_FP32, NUMEL[0] * 4, NULL), ZS_OK);
  pthread_mutex_lock(&px.mu);
  px.corrupt_armed[L_DATA] = 1;
  pthread_mutex_unlock(&px.mu);
  int rc = zs_pull(c, 0, got, ZS_DTYPE_FP32, NUMEL[0] * 4, NULL);
  if (rc != ZS_OK)
    fprintf(stderr, "zs_pull: %s\n", zs_last_error());
  assert_int_equal(rc, ZS_OK);
  pthread_mutex_lock(&px.mu);
  int corrupted = px.corrupted[L_DATA];
  pthread_mutex_unlock(&px.mu);
  assert_int_equal(corrupted, 1);
  assert_memory_equal(got, want, NUMEL[0] * 4);
  assert_int_equal(proxy_refused(&px, L_DATA), 0);

  free(want);
  free(got);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void a_restarted_shard_is_found_at_its_new_data_port(void **state) {
  (void)state;
  if (!data_run())
    skip();
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  char addrs[128];
  snprintf(addrs, sizeof addrs, "%s,%s", cl.srv[0]->addr, cl.srv[1]->addr);
  zs_client *c = client_through(addrs, 100);
  float **buf = alloc_weights();
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_OK);
  zs_step_result r;
  one_step(c, buf, &r);

  /* Shard 1 restarts on the same gRPC address; its data plane gets another
   * free port. (It comes back empty: there are no checkpoints here.) */
  char listen[64];
  snprintf(listen, sizeof listen, "%s", cl.srv[1]->addr);
  assert_int_equal(hs_stop(cl.srv[1]), 0);
  const char *args[] = {"--listen", listen,      "--shard-id", "1", "--shards",
                        "2",        "--threads", "1",          NULL};
  cl.srv[1] = hs_start(args, NULL);
  assert_non_null(cl.srv[1]);

  /* The client's data connection to the old port fails; its retries ask the
   * shard for its data port again and reach the new process there, which
   * answers for itself: it has no job. Without that lookup the retries would
   * end in ZS_ECONN. Tensor 0 is split, so it has a piece on shard 1. */
  int rc = zs_pull(c, 0, buf[0], ZS_DTYPE_FP32, NUMEL[0] * 4, NULL);
  if (rc != ZS_ENOTOPEN)
    fprintf(stderr, "zs_pull: %s: %s\n", zs_err_name(rc), zs_last_error());
  assert_int_equal(rc, ZS_ENOTOPEN);
  assert_non_null(strstr(zs_last_error(), "no job is open"));
  assert_int_equal(zc_shard_transport(c, 1), ZS_TRANSPORT_DATA);

  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void a_shard_without_a_data_port_is_served_over_grpc(void **state) {
  (void)state;
  hs_server *srv[2];
  const char *shard0[] = {"--shard-id", "0", "--shards", "2", "--threads", "1", NULL};
  const char *shard1[] = {"--shard-id",    "1",   "--shards", "2", "--threads", "1",
                          "--data-listen", "off", NULL};
  srv[0] = hs_start(shard0, NULL);
  srv[1] = hs_start(shard1, NULL);
  assert_non_null(srv[0]);
  assert_non_null(srv[1]);
  char addrs[128];
  snprintf(addrs, sizeof addrs, "%s,%s", srv[0]->addr, srv[1]->addr);
  zs_client *c = client_through(addrs, 2);
  float **buf = alloc_weights();
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_OK);
  assert_int_equal(zc_shard_transport(c, 0), data_run() ? ZS_TRANSPORT_DATA : ZS_TRANSPORT_GRPC);
  assert_int_equal(zc_shard_transport(c, 1), ZS_TRANSPORT_GRPC);
  zs_step_result r;
  one_step(c, buf, &r);
  assert_int_equal(r.applied, 1);
  one_step(c, buf, &r);
  assert_int_equal(r.version, 2);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  assert_int_equal(hs_stop(srv[0]), 0);
  assert_int_equal(hs_stop(srv[1]), 0);
}

static void an_unreachable_data_port_fails_open_with_econn_naming_it(void **state) {
  (void)state;
  if (!data_run())
    skip();
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  /* gRPC reaches shard 1 through the proxy; its data port, on the proxy's
   * address, has no listener. */
  proxy px;
  assert_int_equal(proxy_start(&px, cl.srv[1], 0, 0), 0);
  char addrs[128], want[160];
  addresses_through(&cl, &px, addrs, sizeof addrs);
  zs_client *c = client_through(addrs, 2);
  float **buf = alloc_weights();
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_ECONN);
  rpc_channel *ch = NULL;
  Zshard__V1__GetInfoResponse *info = NULL;
  assert_int_equal(rpc_channel_open(cl.srv[1]->addr, &ch), 0);
  assert_int_equal(hs_get_info(ch, &info, NULL), 0);
  snprintf(want, sizeof want, "shard 1 (%s:%d) advertises data port %u", PROXY_HOST,
           px.port[L_GRPC], info->data_port);
  protobuf_c_message_free_unpacked(&info->base, NULL);
  rpc_channel_close(ch);
  if (!strstr(zs_last_error(), want))
    fail_msg("\"%s\" does not say \"%s\"", zs_last_error(), want);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void retries_give_up_with_econn_naming_the_shard(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  proxy px;
  assert_int_equal(proxy_start(&px, cl.srv[1], 1000000, 1), 0); /* never forwards gRPC */
  char addrs[128], want[64];
  addresses_through(&cl, &px, addrs, sizeof addrs);
  snprintf(want, sizeof want, "shard 1 (%s:%d)", PROXY_HOST, px.port[L_GRPC]);
  zs_client *c = client_through(addrs, 2);
  float **buf = alloc_weights();
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_ECONN);
  assert_non_null(strstr(zs_last_error(), want));
  assert_true(proxy_refused(&px, L_GRPC) >= 1);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_weights(buf);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_lost_connection_is_retried_and_counted_in_the_timing),
      cmocka_unit_test(a_lost_data_connection_is_retried_on_the_data_plane),
      cmocka_unit_test(a_pull_answer_failing_its_crc_is_asked_again),
      cmocka_unit_test(a_restarted_shard_is_found_at_its_new_data_port),
      cmocka_unit_test(a_shard_without_a_data_port_is_served_over_grpc),
      cmocka_unit_test(an_unreachable_data_port_fails_open_with_econn_naming_it),
      cmocka_unit_test(retries_give_up_with_econn_naming_the_shard),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
