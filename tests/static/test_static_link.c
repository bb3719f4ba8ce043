/*
 * libzshard.a inside a host program: the host defines functions with the
 * names of the library's internals (common/, the client's own modules, the
 * generated protobuf code) and still links and runs. Without the archive's
 * localized symbols this program does not link ("multiple definition").
 * The second test reads the archive's symbol table: every global definition
 * is a public zs_* name.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <zshard/zshard.h>

/* The host's own functions, with the names (not the signatures) of internal
 * symbols the archive carried before it was localized. */
uint32_t crc32c(uint32_t crc, const void *p, size_t n);
int layout_build(int x);
int log_write(int x);
int spec_encode(int x);
int zc_call(int x);
int zshard__v1__apply_request__init(int x);

uint32_t crc32c(uint32_t crc, const void *p, size_t n) {
  (void)p;
  return crc + (uint32_t)n + 1000u;
}
int layout_build(int x) {
  return x + 1;
}
int log_write(int x) {
  return x + 2;
}
int spec_encode(int x) {
  return x + 3;
}
int zc_call(int x) {
  return x + 4;
}
int zshard__v1__apply_request__init(int x) {
  return x + 5;
}

static void host_and_library_names_coexist(void **state) {
  (void)state;
  /* The host's definitions answer the host's calls... */
  assert_int_equal(crc32c(1, "", 2), 1003);
  assert_int_equal(layout_build(1), 2);
  assert_int_equal(log_write(1), 3);
  assert_int_equal(spec_encode(1), 4);
  assert_int_equal(zc_call(1), 5);
  assert_int_equal(zshard__v1__apply_request__init(1), 6);
  /* ...and the library still works through its public API, which uses its
   * own internal functions of the same names. */
  assert_string_equal(zs_strerror(ZS_EHASH), "model spec hash does not match the shard's job");
  assert_non_null(zs_version());
  zs_client_options o;
  zs_client_options_init(&o);
  zs_client *c = NULL;
  /* No addresses: refused with a sentence, which exercises the library's
   * own error path (log and error modules). */
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  assert_true(strlen(zs_last_error()) > 0);
}

static void archive_defines_only_public_names(void **state) {
  (void)state;
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "nm -g --defined-only '%s'", ZSHARD_STATIC_LIB);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  char line[512];
  int globals = 0, foreign = 0;
  while (fgets(line, sizeof line, f)) {
    char addr[64], type[8], name[400];
    if (sscanf(line, "%63s %7s %399s", addr, type, name) != 3)
      continue; /* the member's header line */
    globals++;
    if (strncmp(name, "zs_", 3) != 0) {
      fprintf(stderr, "libzshard.a defines a global non-zs_ symbol: %s", line);
      foreign++;
    }
  }
  assert_int_equal(pclose(f), 0);
  assert_true(globals > 20); /* the public API is there at all */
  assert_int_equal(foreign, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(host_and_library_names_coexist),
      cmocka_unit_test(archive_defines_only_public_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
