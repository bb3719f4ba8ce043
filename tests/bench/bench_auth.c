/*
 * bench_auth — what a rank token costs the server per check, beside the
 * plain shared token: auth_keys_check_bound (the HMAC-SHA256 verify) and
 * auth_push_admit (the per-push binding check). The data plane verifies once
 * per connection (HELLO) and checks the binding per push; gRPC verifies per
 * call. Prints ns per operation, median of 5 runs of N.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/net/auth.h"
#include "common/net/rank_token.h"

#define N 200000
#define RUNS 5

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void put(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f || fputs(text, f) < 0 || fclose(f) != 0 || chmod(path, 0600) != 0) {
    perror(path);
    exit(1);
  }
}

/* ns per call of one check; `sink` keeps the result live. */
static double time_check(auth_keys *k, const char *tok, int push, volatile int *sink) {
  double per[RUNS];
  auth_binding b;
  char err[256];
  auth_role role = auth_keys_check_bound(k, tok, strlen(tok), &b);
  for (int r = 0; r < RUNS; r++) {
    double t0 = now_ns();
    for (int i = 0; i < N; i++)
      *sink += push ? auth_push_admit(k, role, &b, 1, b.rank, err, sizeof err)
                    : (int)auth_keys_check_bound(k, tok, strlen(tok), &b);
    per[r] = (now_ns() - t0) / N;
  }
  qsort(per, RUNS, sizeof per[0], cmp);
  return per[RUNS / 2];
}

int main(void) {
  char dir[] = "/tmp/zs-bench-auth-XXXXXX";
  if (!mkdtemp(dir))
    return 1;
  char tp[64], ap[64], kp[64], err[600], tok[RANK_TOKEN_MAX];
  snprintf(tp, sizeof tp, "%s/t", dir);
  snprintf(ap, sizeof ap, "%s/a", dir);
  snprintf(kp, sizeof kp, "%s/k", dir);
  const char *trainer = "trainer-0123456789abcdef0123456789abcdef";
  const char *key = "rank-key-0123456789abcdef0123456789abcdef";
  put(tp, trainer);
  put(ap, "admin-0123456789abcdef0123456789abcdef");
  put(kp, key);
  auth_keys *k = NULL;
  if (auth_keys_new(tp, ap, &k, err, sizeof err) != 0 ||
      auth_keys_set_rank_key(k, kp, 0, err, sizeof err) != 0 ||
      rank_token_mint((const unsigned char *)key, strlen(key), "bench-job", 3, 0, tok, sizeof tok,
                      err, sizeof err) < 0) {
    fprintf(stderr, "bench_auth: %s\n", err);
    return 1;
  }
  volatile int sink = 0;
  printf("check, plain trainer token:  %8.1f ns\n", time_check(k, trainer, 0, &sink));
  printf("check, rank token (HMAC):    %8.1f ns\n", time_check(k, tok, 0, &sink));
  printf("push admission, rank token:  %8.1f ns\n", time_check(k, tok, 1, &sink));
  auth_keys_free(k);
  unlink(tp);
  unlink(ap);
  unlink(kp);
  rmdir(dir);
  return sink == 42 ? 2 : 0;
}
