/*
 * test_hostport — the one "host:port" reader (common/net/hostport.h): IPv4,
 * names, bracketed IPv6 and an empty host are read; every malformed form is
 * refused with a sentence that names the text; hostport_format writes what
 * the parser reads back.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "common/net/hostport.h"
#include "zshard/zshard.h"

static void good_forms_give_host_and_port(void **state) {
  (void)state;
  static const struct {
    const char *text, *host;
    unsigned port;
  } ok[] = {
      {"127.0.0.1:7070", "127.0.0.1", 7070},
      {"zshard-0.zshard.default.svc:7070", "zshard-0.zshard.default.svc", 7070},
      {"localhost:0", "localhost", 0},
      {"[::1]:9090", "::1", 9090},
      {"[fe80::1%eth0]:1", "fe80::1%eth0", 1},
      {"[::]:65535", "::", 65535},
      {":7070", "", 7070}, /* every interface, for listeners */
      {"[]:80", "", 80},   /* the same, bracketed */
      {"h:007", "h", 7},   /* leading zeros are still decimal */
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    hostport hp;
    char err[256] = "";
    if (hostport_parse(ok[i].text, &hp, err, sizeof err) != 0)
      fail_msg("\"%s\" refused: %s", ok[i].text, err);
    assert_string_equal(hp.host, ok[i].host);
    assert_int_equal(hp.port, ok[i].port);
  }
}

static void bad_forms_are_refused_with_a_sentence(void **state) {
  (void)state;
  static const struct {
    const char *text, *needle;
  } bad[] = {
      {"", "no address given"},
      {"nohost", "has no :port"},
      {"host:", "port \"\" of \"host:\" is not a number 0..65535"},
      {"host:65536", "is not a number 0..65535"},
      {"host:99999999999999999999", "is not a number 0..65535"},
      {"host:-1", "is not a number"},
      {"host:+80", "is not a number"},
      {"host: 80", "is not a number"},
      {"host:0x50", "is not a number"},
      {"host:80 ", "is not a number"},
      {"::1:7070", "IPv6 address \"::1:7070\" must be written [address]:port"},
      {"[::1]", "is not [IPv6]:port"},
      {"[::1]7070", "is not [IPv6]:port"},
      {"[::1:7070", "is not [IPv6]:port"},
      {"[::1]:", "is not a number"},
      {"a b:80", "a character no host name has (0x20)"},
      {"dns:///h:80", "must be written [address]:port"},
      {"h/x:80", "a character no host name has (0x2f)"},
      {"a,b:80", "(0x2c)"},
      {"a\tb:80", "(0x09)"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    hostport hp;
    char err[256] = "";
    int rc = hostport_parse(bad[i].text, &hp, err, sizeof err);
    if (rc != ZS_EINVAL)
      fail_msg("\"%s\" gave %d, not ZS_EINVAL", bad[i].text, rc);
    if (!strstr(err, bad[i].needle))
      fail_msg("\"%s\": the sentence \"%s\" lacks \"%s\"", bad[i].text, err, bad[i].needle);
  }
  /* NULL text, and NULL err, are fine. */
  hostport hp;
  assert_int_equal(hostport_parse(NULL, &hp, NULL, 0), ZS_EINVAL);
  assert_int_equal(hostport_parse("x", &hp, NULL, 0), ZS_EINVAL);
}

static void a_host_too_long_is_refused_and_the_longest_fits(void **state) {
  (void)state;
  char text[HOSTPORT_HOST_MAX + 16];
  memset(text, 'a', HOSTPORT_HOST_MAX - 1);
  snprintf(text + HOSTPORT_HOST_MAX - 1, 16, ":1");
  hostport hp;
  char err[512];
  assert_int_equal(hostport_parse(text, &hp, err, sizeof err), 0);
  assert_int_equal(strlen(hp.host), HOSTPORT_HOST_MAX - 1);
  memset(text, 'a', HOSTPORT_HOST_MAX);
  snprintf(text + HOSTPORT_HOST_MAX, 16, ":1");
  assert_int_equal(hostport_parse(text, &hp, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "is too long"));
}

static void format_writes_what_parse_reads_back(void **state) {
  (void)state;
  static const char *const hosts[] = {"127.0.0.1", "::1", "fe80::1%eth0", "name.example", ""};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) {
    char buf[HOSTPORT_TEXT_MAX];
    assert_int_equal(hostport_format(buf, sizeof buf, hosts[i], 65535), 0);
    hostport hp;
    assert_int_equal(hostport_parse(buf, &hp, NULL, 0), 0);
    assert_string_equal(hp.host, hosts[i]);
    assert_int_equal(hp.port, 65535);
  }
  char buf[16];
  assert_int_equal(hostport_format(buf, sizeof buf, "::1", 0), 0);
  assert_string_equal(buf, "[::1]:0");
  assert_int_equal(hostport_format(buf, 6, "host", 7070), ZS_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(good_forms_give_host_and_port),
      cmocka_unit_test(bad_forms_are_refused_with_a_sentence),
      cmocka_unit_test(a_host_too_long_is_refused_and_the_longest_fits),
      cmocka_unit_test(format_writes_what_parse_reads_back),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
