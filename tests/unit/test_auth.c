/*
 * test_auth — token files and roles (common/net/auth.h): each configuration of
 * the two files grants the roles auth.h promises, bad files are refused with
 * a sentence naming the file, a FIFO in a token file's place is refused
 * without blocking, and a reload swaps the secrets only when every file is
 * good.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/net/auth.h"
#include "zshard/zshard.h"

#define TRAINER "trainer-secret-0123456789"
#define ADMIN "admin-secret-abcdefghijklmnop"

static char dir[64];

static int setup(void **state) {
  (void)state;
  snprintf(dir, sizeof dir, "/tmp/zs-auth-XXXXXX");
  return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

/* Writes `text` to dir/name and returns the path (static storage per name). */
static const char *put(const char *name, const char *text) {
  static char paths[4][128];
  static int next;
  char *p = paths[next++ % 4];
  snprintf(p, 128, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  assert_int_equal(chmod(p, 0600), 0);
  return p;
}

static auth_role check(const auth_keys *k, const char *token) {
  return auth_keys_check(k, token, token ? strlen(token) : 0);
}

static void no_files_means_everyone_is_admin(void **state) {
  (void)state;
  auth_keys *k;
  assert_int_equal(auth_keys_new(NULL, NULL, &k, NULL, 0), 0);
  assert_false(auth_keys_enabled(k));
  assert_int_equal(check(k, NULL), AUTH_ADMIN);
  assert_int_equal(auth_keys_check(NULL, NULL, 0), AUTH_ADMIN);
  auth_keys_free(k);
}

static void both_files_grant_their_own_roles(void **state) {
  (void)state;
  auth_keys *k;
  const char *t = put("t", "  " TRAINER "\n");
  const char *a = put("a", ADMIN "\r\n\n");
  assert_int_equal(auth_keys_new(t, a, &k, NULL, 0), 0);
  assert_true(auth_keys_enabled(k));
  assert_int_equal(check(k, TRAINER), AUTH_TRAINER);
  assert_int_equal(check(k, ADMIN), AUTH_ADMIN);
  assert_int_equal(check(k, NULL), AUTH_NONE);
  assert_int_equal(check(k, ""), AUTH_NONE);
  assert_int_equal(check(k, TRAINER "x"), AUTH_NONE);
  assert_int_equal(auth_keys_check(k, TRAINER, strlen(TRAINER) - 1), AUTH_NONE);
  assert_true(auth_allows(AUTH_ADMIN, AUTH_TRAINER));
  assert_false(auth_allows(AUTH_TRAINER, AUTH_ADMIN));
  auth_keys_free(k);
}

static void one_file_configurations(void **state) {
  (void)state;
  auth_keys *k;
  const char *t = put("t", TRAINER);
  assert_int_equal(auth_keys_new(t, NULL, &k, NULL, 0), 0);
  assert_int_equal(check(k, TRAINER), AUTH_ADMIN); /* the one secret is both */
  assert_int_equal(check(k, "nope-nope-nope-nope"), AUTH_NONE);
  auth_keys_free(k);
  const char *a = put("a", ADMIN);
  assert_int_equal(auth_keys_new(NULL, a, &k, NULL, 0), 0);
  assert_int_equal(check(k, NULL), AUTH_TRAINER); /* trainer methods are open */
  assert_int_equal(check(k, ADMIN), AUTH_ADMIN);
  auth_keys_free(k);
}

static void bad_files_are_refused_with_their_name(void **state) {
  (void)state;
  static const struct {
    const char *text, *needle;
  } bad[] = {
      {"short", "at least 16 bytes"},
      {"", "at least 16 bytes"},
      {"has a space in the middle of it", "printable ASCII"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *p = put("bad", bad[i].text);
    auth_keys *k = (auth_keys *)1;
    char err[256] = "";
    assert_int_equal(auth_keys_new(p, NULL, &k, err, sizeof err), ZS_EINVAL);
    assert_null(k);
    if (!strstr(err, bad[i].needle) || !strstr(err, p))
      fail_msg("'%s': %s", bad[i].text, err);
  }
  char big[AUTH_MAX_TOKEN + 10];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  char err[256] = "";
  auth_keys *k;
  assert_int_equal(auth_keys_new(put("big", big), NULL, &k, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "longer than"));
  char missing[160];
  snprintf(missing, sizeof missing, "%s/missing", dir);
  assert_int_equal(auth_keys_new(missing, NULL, &k, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "No such file"));
}

static void a_fifo_is_refused_without_blocking(void **state) {
  (void)state;
  char fifo[160];
  snprintf(fifo, sizeof fifo, "%s/fifo", dir);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  auth_keys *k;
  char err[256] = "";
  assert_int_equal(auth_keys_new(fifo, NULL, &k, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "not a regular file"));
}

/* As ssh refuses an unprotected key: a token others may read or rewrite is
 * refused, naming the mode and the fix; group read is allowed (Kubernetes'
 * fsGroup, 0440); a symbolic link is judged by the file it points to. */
static void token_files_others_can_read_or_write_are_refused(void **state) {
  (void)state;
  static const struct {
    mode_t mode;
    const char *words; /* NULL: accepted */
  } cases[] = {
      {0600, NULL},         {0400, NULL},         {0440, NULL},         {0640, NULL},
      {0644, "chmod o-r"},  {0604, "chmod o-r"},  {0620, "chmod go-w"}, {0602, "chmod go-w"},
      {0666, "chmod go-w"}, {0660, "chmod go-w"},
  };
  char err[512];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *p = put("moded", TRAINER "\n");
    assert_int_equal(chmod(p, cases[i].mode), 0);
    auth_keys *k = NULL;
    int rc = auth_keys_new(p, NULL, &k, err, sizeof err);
    if (!cases[i].words) {
      assert_int_equal(rc, ZS_OK);
      auth_keys_free(k);
      continue;
    }
    assert_int_equal(rc, ZS_EINVAL);
    assert_null(k);
    assert_non_null(strstr(err, p));
    assert_non_null(strstr(err, cases[i].words));
  }
  /* A link to a protected file is fine; a link to an unprotected one is not. */
  const char *target = put("target", TRAINER "\n");
  char link[160];
  snprintf(link, sizeof link, "%s/link", dir);
  assert_int_equal(symlink(target, link), 0);
  auth_keys *k = NULL;
  assert_int_equal(auth_keys_new(link, NULL, &k, err, sizeof err), ZS_OK);
  assert_int_not_equal(check(k, TRAINER), AUTH_NONE);
  auth_keys_free(k);
  assert_int_equal(chmod(target, 0644), 0);
  assert_int_equal(auth_keys_new(link, NULL, &k, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "chmod o-r"));
}

static void reload_rotates_and_keeps_old_keys_on_error(void **state) {
  (void)state;
  auth_keys *k;
  const char *t = put("rt", TRAINER);
  assert_int_equal(auth_keys_new(t, NULL, &k, NULL, 0), 0);
  put("rt", "rotated-secret-0000000000");
  assert_int_equal(auth_keys_reload(k, NULL, 0), 0);
  assert_int_equal(check(k, TRAINER), AUTH_NONE);
  assert_int_equal(check(k, "rotated-secret-0000000000"), AUTH_ADMIN);
  put("rt", "tiny");
  char err[256] = "";
  assert_int_equal(auth_keys_reload(k, err, sizeof err), ZS_EINVAL);
  assert_int_equal(check(k, "rotated-secret-0000000000"), AUTH_ADMIN);
  auth_keys_free(k);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(no_files_means_everyone_is_admin),
      cmocka_unit_test(both_files_grant_their_own_roles),
      cmocka_unit_test(one_file_configurations),
      cmocka_unit_test(bad_files_are_refused_with_their_name),
      cmocka_unit_test(a_fifo_is_refused_without_blocking),
      cmocka_unit_test(token_files_others_can_read_or_write_are_refused),
      cmocka_unit_test(reload_rotates_and_keeps_old_keys_on_error),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
