/*
 * trainers — the training tests' shared fixture (see trainers.h).
 */
#include "trainers.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

void tr_cluster_up(hs_cluster *cl, uint32_t n, const char *const *extra, char *addrs, size_t len) {
  assert_int_equal(hs_cluster_start(cl, n, extra), 0);
  addrs[0] = '\0';
  for (uint32_t i = 0; i < cl->n; i++) {
    size_t used = strlen(addrs);
    snprintf(addrs + used, len - used, "%s%s", i ? "," : "", cl->srv[i]->addr);
  }
}

float tr_noise(uint64_t s, uint32_t r, uint32_t m, uint32_t t, uint64_t i) {
  uint64_t z = s * 0x9e3779b97f4a7c15ull ^ ((uint64_t)r << 48) ^ ((uint64_t)m << 40) ^
               ((uint64_t)t << 32) ^ i;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

void tr_run_trainers(uint32_t W, void *(*fn)(void *), const void *cfg, void *outs,
                     size_t out_size) {
  pthread_t th[TR_MAX_TRAINERS];
  tr_trainer args[TR_MAX_TRAINERS];
  assert_true(W <= TR_MAX_TRAINERS);
  memset(outs, 0, W * out_size);
  for (uint32_t r = 0; r < W; r++) {
    args[r] = (tr_trainer){.cfg = cfg, .rank = r, .out = (char *)outs + r * out_size};
    assert_int_equal(pthread_create(&th[r], NULL, fn, &args[r]), 0);
  }
  for (uint32_t r = 0; r < W; r++)
    pthread_join(th[r], NULL);
}

void tr_reports_check(const tr_report *outs, uint32_t W, const char *what) {
  for (uint32_t r = 0; r < W; r++)
    if (outs[r].rc != 0)
      fail_msg("%s, rank %u: %s", what, r, outs[r].err);
}

void tr_reports_free(tr_report *outs, uint32_t W, uint32_t nt) {
  for (uint32_t r = 0; r < W; r++)
    for (uint32_t t = 0; t < nt; t++)
      free(outs[r].final[t]);
}

int tr_group_setup(void **state) {
  (void)state;
  return hs_init();
}

int tr_finish(int failures) {
  hs_finish(failures);
  return failures;
}
