/*
 * test_rank_token — per-rank tokens (common/net/rank_token.h) and their use
 * by auth (common/net/auth.h): a minted token verifies to its claim; every
 * malformed shape (truncated, bad hex, upper-case hex, a rank of 2^32 or
 * more, leading zeros, a missing field, a job with '|') is refused; a token
 * signed with another key, edited after signing or expired is refused; auth
 * grants such a token the trainer role bound to its (job, rank) and
 * auth_push_admit lets it push as that rank of that job only.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/net/auth.h"
#include "common/net/rank_token.h"
#include "zshard/zshard.h"

#define KEY "rank-key-0123456789abcdef"
#define OTHER_KEY "another-key-0123456789abcdef"

static const unsigned char *key = (const unsigned char *)KEY;
static const size_t keylen = sizeof KEY - 1;

static int mint(const char *k, const char *job, uint32_t rank, uint64_t expiry, char *out) {
  char err[200];
  return rank_token_mint((const unsigned char *)k, strlen(k), job, rank, expiry, out,
                         RANK_TOKEN_MAX, err, sizeof err);
}

static int verify(const char *token, uint64_t now, rank_claim *c) {
  char err[200] = "";
  int rc = rank_token_verify(key, keylen, token, strlen(token), now, c, err, sizeof err);
  if (rc != 0)
    assert_true(strncmp(err, "rank token: ", 12) == 0);
  return rc;
}

static void minted_token_verifies_to_its_claim(void **state) {
  (void)state;
  char t[RANK_TOKEN_MAX];
  rank_claim c;
  assert_true(mint(KEY, "job.with.dots", 4294967295u, 0, t) > 0);
  assert_int_equal(verify(t, (uint64_t)time(NULL), &c), 0);
  assert_string_equal(c.job, "job.with.dots");
  assert_int_equal(c.rank, 4294967295u);
  assert_int_equal(c.expiry, 0);
  assert_true(mint(KEY, "j", 0, 2000000000ull, t) > 0);
  assert_int_equal(strncmp(t, "zsr1.j.0.2000000000.", 20), 0);
  assert_int_equal(verify(t, 1999999999ull, &c), 0);
  assert_int_equal(verify(t, 2000000000ull, &c), 0);
}

static void expired_token_is_refused(void **state) {
  (void)state;
  char t[RANK_TOKEN_MAX];
  rank_claim c;
  assert_true(mint(KEY, "job", 1, 1000, t) > 0);
  assert_int_equal(verify(t, 1001, &c), ZS_EUNAUTHENTICATED);
}

static void forged_or_edited_token_is_refused(void **state) {
  (void)state;
  char t[RANK_TOKEN_MAX], u[RANK_TOKEN_MAX];
  rank_claim c;
  assert_true(mint(OTHER_KEY, "job", 1, 0, t) > 0);
  assert_int_equal(verify(t, 0, &c), ZS_EUNAUTHENTICATED);
  /* Rank 1's MAC on a claim for rank 0. */
  assert_true(mint(KEY, "job", 1, 0, t) > 0);
  snprintf(u, sizeof u, "zsr1.job.0.0.%s", t + strlen(t) - 64);
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  /* Another job's MAC. */
  snprintf(u, sizeof u, "zsr1.jox.1.0.%s", t + strlen(t) - 64);
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  /* One flipped MAC digit. */
  snprintf(u, sizeof u, "%s", t);
  u[strlen(u) - 1] = u[strlen(u) - 1] == '0' ? '1' : '0';
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  assert_int_equal(verify(t, 0, &c), 0);
}

static void malformed_tokens_are_refused(void **state) {
  (void)state;
  char t[RANK_TOKEN_MAX], u[RANK_TOKEN_MAX + 64];
  rank_claim c;
  assert_true(mint(KEY, "job", 7, 0, t) > 0);
  const char *mac = t + strlen(t) - 64;
  /* Every truncation of a good token. */
  for (size_t n = 0; n < strlen(t); n++) {
    char err[200];
    assert_int_equal(rank_token_verify(key, keylen, t, n, 0, &c, err, sizeof err),
                     ZS_EUNAUTHENTICATED);
  }
  const char *bad[] = {
      "zsr1.",
      "zsr1....",
      "zsr1.job.7.0.",
      "zsr1.job.7.",
      "zsr2.job.7.0.%s",
      "zsr1..7.0.%s",
      "zsr1.job..0.%s",
      "zsr1.job.7..%s",
      "zsr1.job.07.0.%s",
      "zsr1.job.+7.0.%s",
      "zsr1.job.-7.0.%s",
      "zsr1.job.4294967296.0.%s",
      "zsr1.job.99999999999999999999.0.%s",
      "zsr1.job.7.18446744073709551616.0.%s",
      "zsr1.job.7.00.%s",
      "zsr1.j|b.7.0.%s",
      "zsr1.j b.7.0.%s",
      "zsr1.job.7.0.%sa",
      "zsr1.job.7.0.x%s",
      "zsr1.job.7.0.0.%s",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(u, sizeof u, bad[i], mac);
    assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  }
  /* Bad hex: upper case, and a non-hex digit. */
  snprintf(u, sizeof u, "%s", t);
  char *m = u + strlen(u) - 64;
  for (int i = 0; i < 64; i++)
    if (m[i] >= 'a' && m[i] <= 'f') {
      m[i] = (char)(m[i] - 'a' + 'A');
      break;
    }
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  snprintf(u, sizeof u, "%s", t);
  u[strlen(u) - 10] = 'g';
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  /* A job name of 257 bytes is refused to mint and to verify. */
  char job[300];
  memset(job, 'a', 257);
  job[257] = '\0';
  assert_int_equal(mint(KEY, job, 1, 0, t), ZS_EINVAL);
  snprintf(u, sizeof u, "zsr1.%s.1.0.%s", job, mac);
  assert_int_equal(verify(u, 0, &c), ZS_EUNAUTHENTICATED);
  job[256] = '\0';
  assert_true(mint(KEY, job, 1, 0, t) > 0);
  assert_int_equal(verify(t, 0, &c), 0);
  assert_int_equal(mint(KEY, "", 1, 0, t), ZS_EINVAL);
  assert_int_equal(mint(KEY, "a|b", 1, 0, t), ZS_EINVAL);
}

static char dir[64];

static void put(const char *name, const char *text) {
  char p[128];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  assert_int_equal(chmod(p, 0600), 0);
}

static void auth_binds_a_rank_token_to_its_job_and_rank(void **state) {
  (void)state;
  snprintf(dir, sizeof dir, "/tmp/zs-rank-XXXXXX");
  assert_non_null(mkdtemp(dir));
  put("t", "trainer-secret-0123456789\n");
  put("a", "admin-secret-abcdefghijklmnop\n");
  put("k", KEY "\n");
  char tp[128], ap[128], kp[128], err[600], t[RANK_TOKEN_MAX];
  snprintf(tp, sizeof tp, "%s/t", dir);
  snprintf(ap, sizeof ap, "%s/a", dir);
  snprintf(kp, sizeof kp, "%s/k", dir);
  auth_keys *k = NULL;
  assert_int_equal(auth_keys_new(tp, ap, &k, err, sizeof err), 0);
  assert_int_equal(auth_keys_set_rank_key(k, kp, 1, err, sizeof err), 0);
  auth_binding b;
  assert_true(mint(KEY, "job", 3, 0, t) > 0);
  assert_int_equal(auth_keys_check_bound(k, t, strlen(t), &b), AUTH_TRAINER);
  assert_true(b.bound);
  assert_string_equal(b.job, "job");
  assert_int_equal(b.rank, 3);
  assert_int_equal(auth_push_admit(k, AUTH_TRAINER, &b, 1, 3, err, sizeof err), 0);
  assert_int_equal(auth_push_admit(k, AUTH_TRAINER, &b, 1, 2, err, sizeof err), ZS_EPERM);
  assert_non_null(strstr(err, "may not push as rank 2"));
  assert_int_equal(auth_push_admit(k, AUTH_TRAINER, &b, 0, 3, err, sizeof err), ZS_EPERM);
  /* Required: the plain trainer token may not push, the admin's may. */
  const char *plain = "trainer-secret-0123456789";
  assert_int_equal(auth_keys_check_bound(k, plain, strlen(plain), &b), AUTH_TRAINER);
  assert_false(b.bound);
  assert_int_equal(auth_push_admit(k, AUTH_TRAINER, &b, 1, 0, err, sizeof err), ZS_EPERM);
  assert_int_equal(auth_push_admit(k, AUTH_ADMIN, &b, 1, 0, err, sizeof err), 0);
  /* A forged one grants nothing. */
  assert_true(mint(OTHER_KEY, "job", 3, 0, t) > 0);
  assert_int_equal(auth_keys_check_bound(k, t, strlen(t), &b), AUTH_NONE);
  assert_false(b.bound);
  /* A reload with a new key: the old key's tokens go. */
  assert_true(mint(KEY, "job", 3, 0, t) > 0);
  put("k", OTHER_KEY "\n");
  assert_int_equal(auth_keys_reload(k, err, sizeof err), 0);
  assert_int_equal(auth_keys_check_bound(k, t, strlen(t), &b), AUTH_NONE);
  /* An unprotected key file is refused as a token file is. */
  chmod(kp, 0644);
  assert_int_equal(auth_keys_reload(k, err, sizeof err), ZS_EINVAL);
  auth_keys_free(k);
  /* Rank tokens without any token file: refused at start. */
  assert_int_equal(auth_keys_new(NULL, NULL, &k, err, sizeof err), 0);
  chmod(kp, 0600);
  assert_int_equal(auth_keys_set_rank_key(k, kp, 0, err, sizeof err), ZS_EINVAL);
  auth_keys_free(k);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(minted_token_verifies_to_its_claim),
      cmocka_unit_test(expired_token_is_refused),
      cmocka_unit_test(forged_or_edited_token_is_refused),
      cmocka_unit_test(malformed_tokens_are_refused),
      cmocka_unit_test(auth_binds_a_rank_token_to_its_job_and_rank),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
