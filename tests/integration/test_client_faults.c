/*
 * test_client_faults — libzshard's retries on connection loss, against real
 * servers reached through a small TCP proxy in this test. The proxy forwards
 * connections to one shard and, on the test's command, refuses the next
 * connection attempts or cuts every open connection, which the client sees as
 * gRPC UNAVAILABLE. (gRPC's channel then fails calls fast for its own
 * reconnect backoff, about 1 to 10 s, which is what the retries bridge.) The client must retry with
 * backoff and carry on, counting the retries in the step's timing, or give up after max_retries
 * with ZS_ECONN naming the shard.
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
#include "zshard/zshard.h"

/* ---- the proxy ----------------------------------------------------------------- */

#define PROXY_MAX_PAIRS 32

typedef struct proxy {
  int lfd, port;
  int wake[2]; /* self-pipe: commands for the proxy thread */
  struct sockaddr_in up;
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int refuse;                   /* (mu) connection attempts still to refuse */
  int cut_req;                  /* (mu) close every forwarded connection */
  int cuts_done;                /* (mu) */
  int stop;                     /* (mu) */
  int refused;                  /* (mu) attempts refused so far */
  int pair[PROXY_MAX_PAIRS][2]; /* proxy thread only: client fd, upstream fd */
  int npairs;
} proxy;

static void close_pair(proxy *p, int i) {
  close(p->pair[i][0]);
  close(p->pair[i][1]);
  /* The last pair takes the freed place. */
  p->pair[i][0] = p->pair[p->npairs - 1][0];
  p->pair[i][1] = p->pair[p->npairs - 1][1];
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
  struct pollfd fds[2 + 2 * PROXY_MAX_PAIRS];
  char buf[65536];
  for (;;) {
    nfds_t n = 0;
    fds[n++] = (struct pollfd){.fd = p->wake[0], .events = POLLIN};
    fds[n++] = (struct pollfd){.fd = p->lfd, .events = POLLIN};
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
        while (p->npairs > 0)
          close_pair(p, p->npairs - 1);
        p->cut_req = 0;
        p->cuts_done++;
        pthread_cond_broadcast(&p->cv);
      }
      pthread_mutex_unlock(&p->mu);
      if (stop)
        break;
      continue; /* the pair list changed: rebuild the poll set */
    }
    if (fds[1].revents & POLLIN) {
      int cfd = accept(p->lfd, NULL, NULL);
      if (cfd >= 0) {
        pthread_mutex_lock(&p->mu);
        int refuse = p->refuse > 0;
        if (refuse) {
          p->refuse--;
          p->refused++;
        }
        pthread_mutex_unlock(&p->mu);
        int ufd = -1;
        if (!refuse && p->npairs < PROXY_MAX_PAIRS) {
          ufd = socket(AF_INET, SOCK_STREAM, 0);
          if (ufd >= 0 && connect(ufd, (struct sockaddr *)&p->up, sizeof p->up) != 0) {
            close(ufd);
            ufd = -1;
          }
        }
        if (ufd < 0) {
          close(cfd);
        } else {
          p->pair[p->npairs][0] = cfd;
          p->pair[p->npairs][1] = ufd;
          p->npairs++;
        }
      }
      continue;
    }
    for (nfds_t k = 2; k < n; k++) {
      if (!fds[k].revents)
        continue;
      int i = (int)(k - 2) / 2, from = (int)(k - 2) % 2;
      ssize_t r = read(p->pair[i][from], buf, sizeof buf);
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

static int proxy_start(proxy *p, const char *upstream_addr, int refuse) {
  memset(p, 0, sizeof *p);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->refuse = refuse;
  const char *colon = strrchr(upstream_addr, ':');
  if (!colon || pipe(p->wake) != 0)
    return -1;
  p->up.sin_family = AF_INET;
  p->up.sin_port = htons((uint16_t)atoi(colon + 1));
  inet_pton(AF_INET, "127.0.0.1", &p->up.sin_addr);
  p->lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  socklen_t len = sizeof a;
  if (p->lfd < 0 || bind(p->lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(p->lfd, 16) != 0 ||
      getsockname(p->lfd, (struct sockaddr *)&a, &len) != 0)
    return -1;
  p->port = ntohs(a.sin_port);
  return pthread_create(&p->th, NULL, proxy_main, p) == 0 ? 0 : -1;
}

/* Closes every forwarded connection and refuses the next `refuse` attempts;
 * returns once the connections are closed. */
static void proxy_cut(proxy *p, int refuse) {
  pthread_mutex_lock(&p->mu);
  int before = p->cuts_done;
  p->refuse += refuse;
  p->cut_req = 1;
  poke(p);
  while (p->cuts_done == before)
    pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

static int proxy_refused(proxy *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->refused;
  pthread_mutex_unlock(&p->mu);
  return n;
}

static void proxy_stop(proxy *p) {
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  poke(p);
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->th, NULL);
  close(p->lfd);
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

static void a_lost_connection_is_retried_and_counted_in_the_timing(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  proxy px;
  assert_int_equal(proxy_start(&px, cl.srv[1]->addr, 0), 0);
  char addrs[128];
  snprintf(addrs, sizeof addrs, "%s,127.0.0.1:%d", cl.srv[0]->addr, px.port);
  /* After a failed connection gRPC's channel keeps failing fast for its own
   * reconnect backoff (seconds); the budget here is far above that. */
  zs_client *c = client_through(addrs, 200);
  float *buf[NT];
  for (uint32_t t = 0; t < NT; t++) {
    buf[t] = calloc(NUMEL[t], sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      buf[t][i] = 0.001f * (float)(i + 1);
  }
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_OK);
  zs_step_result r;
  one_step(c, buf, &r);
  assert_int_equal(r.timing.retries, 0);
  assert_int_equal(r.applied, 1);

  /* The connection to shard 1 is lost between steps and the reconnection is
   * refused once: step 2's calls to shard 1 fail with UNAVAILABLE until the
   * channel reconnects, and are retried. */
  proxy_cut(&px, 1);
  one_step(c, buf, &r);
  assert_int_equal(proxy_refused(&px), 1);
  assert_true(r.timing.retries >= 1);
  assert_int_equal(r.applied, 1);
  assert_int_equal(r.version, 2);
  assert_int_equal(zs_current_step(c), 3);

  assert_int_equal(zs_client_close(c), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    free(buf[t]);
  proxy_stop(&px);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void retries_give_up_with_econn_naming_the_shard(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  proxy px;
  assert_int_equal(proxy_start(&px, cl.srv[1]->addr, 1000000), 0); /* never forwards */
  char addrs[128], want[64];
  snprintf(addrs, sizeof addrs, "%s,127.0.0.1:%d", cl.srv[0]->addr, px.port);
  snprintf(want, sizeof want, "shard 1 (127.0.0.1:%d)", px.port);
  zs_client *c = client_through(addrs, 2);
  float *buf[NT];
  for (uint32_t t = 0; t < NT; t++)
    buf[t] = calloc(NUMEL[t], sizeof(float));
  assert_int_equal(zs_open_job(c, (const float *const *)buf), ZS_ECONN);
  assert_non_null(strstr(zs_last_error(), want));
  assert_true(proxy_refused(&px) >= 1);
  assert_int_equal(zs_client_close(c), ZS_OK);
  for (uint32_t t = 0; t < NT; t++)
    free(buf[t]);
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
      cmocka_unit_test(retries_give_up_with_econn_naming_the_shard),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
