/*
 * test_client_addresses — how a client reads replicated shard addresses
 * (docs/CLIENT.md, "Replica sets and failover"): shards separated by ',',
 * a shard's replicas by '|', "{i}" expanded in every replica of a pattern;
 * num_shards counts shards; an empty replica, more than 8, or one listed
 * twice is refused with a sentence naming the shard. The failover_ms option
 * and its environment variable. And a replica set none of whose members
 * answers: a call fails within its retries, as a lone dead shard's does.
 *
 * No server runs here; the failover against real servers is
 * tests/integration/test_client_failover.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cli_support.h"
#include "zshard/v1/zshard.pb-c.h"
#include "zshard/zshard.h"

/* Parses `spec` and checks it gives the shard strings `want` (n of them). */
static void parses_to(const char *spec, uint32_t num_shards, const char *const *want, uint32_t n) {
  char **addr = NULL;
  uint32_t count = 0;
  if (zc_parse_addresses(spec, num_shards, &addr, &count) != ZS_OK)
    fail_msg("'%s': %s", spec, zs_last_error());
  assert_int_equal(count, n);
  for (uint32_t i = 0; i < n; i++)
    assert_string_equal(addr[i], want[i]);
  zc_free_addresses(addr, count);
}

/* Parsing `spec` fails with ZS_EINVAL and a sentence holding `needle`. */
static void refuses(const char *spec, uint32_t num_shards, const char *needle) {
  char **addr = NULL;
  uint32_t count = 7;
  assert_int_equal(zc_parse_addresses(spec, num_shards, &addr, &count), ZS_EINVAL);
  assert_null(addr);
  assert_int_equal(count, 0);
  if (!strstr(zs_last_error(), needle))
    fail_msg("'%s': \"%s\" lacks \"%s\"", spec, zs_last_error(), needle);
}

static void a_list_separates_shards_by_comma_and_replicas_by_bar(void **state) {
  (void)state;
  static const char *const two[] = {"127.0.0.1:7001|127.0.0.1:7002",
                                    "127.0.0.1:7003|127.0.0.1:7004"};
  parses_to("127.0.0.1:7001|127.0.0.1:7002,127.0.0.1:7003|127.0.0.1:7004", 0, two, 2);
  /* num_shards counts shards, not replicas. */
  parses_to("127.0.0.1:7001|127.0.0.1:7002,127.0.0.1:7003|127.0.0.1:7004", 2, two, 2);
  refuses("127.0.0.1:7001|127.0.0.1:7002,127.0.0.1:7003|127.0.0.1:7004", 4,
          "2 addresses given but num_shards is 4");
  /* Blanks around either separator go; the order stays. */
  static const char *const trimmed[] = {"h-b:1|h-a:1|[::1]:7", "h-c:2"};
  parses_to(" h-b:1 | h-a:1\t|[::1]:7 , h-c:2 ", 0, trimmed, 2);
  /* Shards may mix: one replicated, one not. */
  static const char *const mixed[] = {"a:1", "b:1|b:2"};
  parses_to("a:1,b:1|b:2", 0, mixed, 2);
  /* Every address form of a lone shard is a replica's too. */
  static const char *const forms[] = {"dns:///localhost:7070|ipv4:127.0.0.1:7071|ipv6:[::1]:7072"};
  parses_to("dns:///localhost:7070|ipv4:127.0.0.1:7071|ipv6:[::1]:7072", 1, forms, 1);
}

static void a_pattern_expands_i_in_every_replica(void **state) {
  (void)state;
  static const char *const three[] = {"zshard-a-0.zshard:7070|zshard-b-0.zshard:7070",
                                      "zshard-a-1.zshard:7070|zshard-b-1.zshard:7070",
                                      "zshard-a-2.zshard:7070|zshard-b-2.zshard:7070"};
  parses_to("zshard-a-{i}.zshard:7070|zshard-b-{i}.zshard:7070", 3, three, 3);
  static const char *const lone[] = {"zshard-0.zshard:7070", "zshard-1.zshard:7070"};
  parses_to("zshard-{i}.zshard:7070", 2, lone, 2);
  refuses("zshard-a-{i}:1|zshard-b-{i}:1", 0, "needs num_shards");
  refuses("zshard-{i}:1,other:1", 2, "holds a ','");
}

static void a_bad_replica_list_is_refused_naming_the_shard(void **state) {
  (void)state;
  refuses("a:1,b:1||b:2", 0, "shard 1 ('b:1||b:2'): replica 1 is empty");
  refuses("a:1|", 0, "shard 0 ('a:1|'): replica 1 is empty");
  refuses("|a:1", 0, "replica 0 is empty");
  refuses("a:1| ,b:1", 0, "replica 1 is empty");
  refuses("h:1|h:2|h:3|h:4|h:5|h:6|h:7|h:8|h:9", 0, "lists 9 replicas; at most 8");
  refuses("a:1|b:1|A:1", 0, "lists A:1 twice (replicas 0 and 2)");
  refuses("dns:///h:1|h:1", 0, "lists h:1 twice (replicas 0 and 1)");
  refuses("x-{i}:1|x-{i}:1", 2, "shard 0 ('x-0:1|x-0:1') lists x-0:1 twice");
  refuses("a:1,b:1|nohost", 0, "shard 1 replica 1 ('nohost')");
  refuses("a:1|b:70000", 0, "shard 0 replica 1 ('b:70000'): port");
  /* A shard that is not replicated keeps its sentences. */
  refuses("127.0.0.1:1,::1:7070", 0, "address 1 ('::1:7070'): IPv6 address");
  /* Eight are allowed. */
  static const char *const eight[] = {"h:1|h:2|h:3|h:4|h:5|h:6|h:7|h:8"};
  parses_to("h:1|h:2|h:3|h:4|h:5|h:6|h:7|h:8", 0, eight, 1);
}

static void shard_members_splits_a_shard_string(void **state) {
  (void)state;
  char **m = NULL;
  uint32_t n = 0;
  assert_int_equal(zc_shard_members("a:1|b:2|c:3", &m, &n), ZS_OK);
  assert_int_equal(n, 3);
  assert_string_equal(m[0], "a:1");
  assert_string_equal(m[2], "c:3");
  zc_free_addresses(m, n);
  assert_int_equal(zc_shard_members("a:1", &m, &n), ZS_OK);
  assert_int_equal(n, 1);
  assert_string_equal(m[0], "a:1");
  zc_free_addresses(m, n);
}

/* ---- the client ------------------------------------------------------------- */

static void open_counts_shards_not_replicas(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  assert_int_equal(o.failover_ms, 0);
  o.addresses = "127.0.0.1:1|127.0.0.1:2,127.0.0.1:3|127.0.0.1:4";
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zc_client_num_shards(c), 2);
  assert_string_equal(zc_client_address(c, 1), "127.0.0.1:3|127.0.0.1:4");
  assert_int_equal(zs_client_close(c), ZS_OK);
  o.addresses = "127.0.0.1:1|127.0.0.1:1";
  c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  assert_non_null(strstr(zs_last_error(), "zs_client_open: shard 0"));
}

static void failover_ms_comes_from_the_option_or_the_environment(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1|127.0.0.1:2";
  static const char *const bad[] = {"abc", "-5", "0", "1e3", "86400001"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("ZSHARD_FAILOVER_MS", bad[i], 1);
    c = NULL;
    assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
    assert_null(c);
    if (!strstr(zs_last_error(), "ZSHARD_FAILOVER_MS"))
      fail_msg("'%s': %s", bad[i], zs_last_error());
  }
  /* The option wins over the environment, as every option does. */
  o.failover_ms = 100;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  o.failover_ms = 0;
  setenv("ZSHARD_FAILOVER_MS", "1500", 1);
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  unsetenv("ZSHARD_FAILOVER_MS");
}

/* No member answers: the failover search finds nobody to promote, and the
 * call fails once its retries are spent, with the transport's status. */
static void a_set_with_no_member_up_fails_within_its_retries(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1|127.0.0.1:2|127.0.0.1:3";
  o.max_retries = 3;
  o.retry_initial_ms = 5;
  o.retry_max_ms = 20;
  o.failover_ms = 30;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  rpc_status st;
  int rc = zc_call(c, 0, ZC_METHOD("GetInfo"), &req.base,
                   &zshard__v1__get_info_response__descriptor, &resp, 2000, &st);
  assert_int_not_equal(rc, ZS_OK);
  assert_null(resp);
  assert_int_equal(st.grpc_code, 14); /* UNAVAILABLE */
  assert_int_equal(zs_client_close(c), ZS_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_list_separates_shards_by_comma_and_replicas_by_bar),
      cmocka_unit_test(a_pattern_expands_i_in_every_replica),
      cmocka_unit_test(a_bad_replica_list_is_refused_naming_the_shard),
      cmocka_unit_test(shard_members_splits_a_shard_string),
      cmocka_unit_test(open_counts_shards_not_replicas),
      cmocka_unit_test(failover_ms_comes_from_the_option_or_the_environment),
      cmocka_unit_test(a_set_with_no_member_up_fails_within_its_retries),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
