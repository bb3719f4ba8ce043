/*
 * test_dataplane_tls — the data plane over TLS 1.3, in one process: a shard
 * core served by a dp_server with a TLS context (its certificate, client
 * certificates required), driven by dp_clients with TLS contexts of their
 * own, over real sockets on 127.0.0.1 port 0. Certificates are made at run
 * time with the openssl tool (tests/unit/tls_certs.h).
 *
 * Covered: pushes and pulls arrive byte-exact (a pull of the initial weights
 * equals them; a push's payload passes the server's CRC check and its
 * repeat is a duplicate), and every way a connection must be refused: a
 * client that does not trust the server's CA, a client without a
 * certificate, a plaintext client talking to the TLS server and a TLS client
 * talking to a plaintext server. Each refusal fails dp_client_open with
 * ZS_ECONN and the reason, and the server keeps serving.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/log.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "common/net/dp_client.h"
#include "common/net/tls.h"
#include "server/core/core.h"
#include "server/transport/dp/dp_server.h"
#include "tests/unit/tls_certs.h"

/* 4 Mi fp32 parameters: 16 MiB each way, in many TLS records. */
#define NUMEL (4u << 20)

static tls_certs certs;

typedef struct fixture {
  spec sp;
  layout lay;
  uint64_t hash;
  core *core;
  tls_ctx *server_tls; /* NULL: the server speaks plain TCP */
  dp_server *srv;
  char addr[64];
  float *init;
} fixture;

static fixture fx;

static void build_spec(spec *s) {
  memset(s, 0, sizeof *s);
  s->job = strdup("dataplane-tls-test");
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_SGD);
  s->num_tensors = 1;
  s->tensors = calloc(1, sizeof *s->tensors);
  assert_non_null(s->tensors);
  s->tensors[0].name = strdup("w");
  s->tensors[0].numel = NUMEL;
  s->tensors[0].group = 0;
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = 1;
  s->split_threshold = 1024;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256] = "";
  assert_int_equal(spec_validate(s, err, sizeof err), 0);
}

static int start(int tls) {
  memset(&fx, 0, sizeof fx);
  build_spec(&fx.sp);
  fx.hash = spec_hash(&fx.sp);
  assert_int_equal(layout_build(&fx.sp, &fx.lay), 0);
  assert_int_equal(fx.lay.num_pieces, 1);
  core_config cc = {.shard_id = 0, .num_shards = 1, .threads = 1};
  assert_int_equal(core_create(&cc, &fx.core), 0);
  core_open_result r;
  char err[256] = "";
  assert_int_equal(core_open(fx.core, &fx.sp, &r, err, sizeof err), 0);
  fx.init = malloc(NUMEL * sizeof(float));
  assert_non_null(fx.init);
  for (uint32_t i = 0; i < NUMEL; i++)
    fx.init[i] = (float)((i * 2654435761u) >> 8) / (float)(1u << 24) - 0.5f;
  int written = 0;
  uint64_t version = 0;
  assert_int_equal(core_init_params(fx.core, fx.hash, 0, 0, fx.init, NUMEL * sizeof(float),
                                    &written, &version, err, sizeof err),
                   0);
  if (tls)
    assert_int_equal(tls_server_new(certs.server_crt, certs.server_key, certs.ca, &fx.server_tls,
                                    err, sizeof err),
                     0);
  dp_server_config sc;
  dp_server_config_init(&sc);
  sc.listen = "127.0.0.1:0";
  sc.core = fx.core;
  sc.tls = fx.server_tls;
  if (dp_server_start(&sc, &fx.srv, err, sizeof err) != 0)
    fail_msg("dp_server_start: %s", err);
  snprintf(fx.addr, sizeof fx.addr, "127.0.0.1:%d", dp_server_port(fx.srv));
  return 0;
}

static int setup_tls(void **state) {
  (void)state;
  return start(1);
}

static int setup_plain(void **state) {
  (void)state;
  return start(0);
}

static int teardown(void **state) {
  (void)state;
  dp_server_stop(fx.srv);
  core_destroy(fx.core);
  tls_ctx_free(fx.server_tls);
  layout_free(&fx.lay);
  spec_free(&fx.sp);
  free(fx.init);
  return 0;
}

/* A client context of the test CA (or `ca`), with the client certificate
 * unless `anonymous`. */
static tls_ctx *client_tls(const char *ca, int anonymous) {
  tls_ctx *c = NULL;
  char err[256] = "";
  int rc = tls_client_new(ca, anonymous ? NULL : certs.client_crt,
                          anonymous ? NULL : certs.client_key, NULL, &c, err, sizeof err);
  if (rc != 0)
    fail_msg("tls_client_new: %s", err);
  return c;
}

/* dp_client_open with `tls` (may be NULL): its status, the message in err. */
static int open_client(tls_ctx *tls, dp_client **out, char *err, size_t errlen) {
  dp_client_config cc = {
      .addr = fx.addr, .connections = 2, .connect_timeout_ms = 20000, .tls = tls};
  *out = NULL;
  return dp_client_open(&cc, out, err, errlen);
}

/* ------------------------------------------------------------------------ */

static void pulls_and_pushes_over_tls_arrive_byte_exact(void **state) {
  (void)state;
  tls_ctx *tls = client_tls(certs.ca, 0);
  dp_client *c = NULL;
  char err[512] = "";
  if (open_client(tls, &c, err, sizeof err) != 0)
    fail_msg("dp_client_open: %s", err);
  float *got = malloc(NUMEL * sizeof(float));
  assert_non_null(got);
  memset(got, 0xee, NUMEL * sizeof(float));
  dp_pull_args pa = {.spec_hash = fx.hash,
                     .tensor = 0,
                     .slice = 0,
                     .dtype = ZS_DTYPE_FP32,
                     .dst = got,
                     .nbytes = NUMEL * sizeof(float)};
  uint64_t version = 99;
  if (dp_client_pull_sync(c, &pa, &version, err, sizeof err) != 0)
    fail_msg("pull: %s", err);
  assert_int_equal(version, 0);
  assert_memory_equal(got, fx.init, NUMEL * sizeof(float));
  /* The server checks the push's CRC over its payload: a byte changed on the
   * way is refused, and a repeat is acknowledged as a duplicate. */
  dp_push_args a = {.spec_hash = fx.hash,
                    .step = 1,
                    .rank = 0,
                    .micro = 0,
                    .tensor = 0,
                    .slice = 0,
                    .dtype = ZS_DTYPE_FP32,
                    .data = fx.init,
                    .nbytes = NUMEL * sizeof(float)};
  int dup = -1;
  if (dp_client_push_sync(c, &a, &dup, err, sizeof err) != 0)
    fail_msg("push: %s", err);
  assert_int_equal(dup, 0);
  assert_int_equal(dp_client_push_sync(c, &a, &dup, err, sizeof err), 0);
  assert_int_equal(dup, 1);
  free(got);
  dp_client_close(c);
  tls_ctx_free(tls);
}

static void a_client_that_does_not_trust_the_server_is_refused_with_the_reason(void **state) {
  (void)state;
  tls_ctx *tls = client_tls(certs.other_ca, 0);
  dp_client *c = NULL;
  char err[512] = "";
  assert_int_equal(open_client(tls, &c, err, sizeof err), ZS_ECONN);
  assert_null(c);
  print_message("%s\n", err);
  assert_non_null(strstr(err, "certificate verify failed"));
  tls_ctx_free(tls);
}

static void a_client_without_a_certificate_is_refused_by_the_server(void **state) {
  (void)state;
  tls_ctx *tls = client_tls(certs.ca, 1);
  dp_client *c = NULL;
  char err[512] = "";
  assert_int_equal(open_client(tls, &c, err, sizeof err), ZS_ECONN);
  assert_null(c);
  print_message("%s\n", err);
  assert_non_null(strstr(err, "certificate required"));
  tls_ctx_free(tls);
  /* The server goes on serving clients that have one. */
  tls = client_tls(certs.ca, 0);
  char e2[512] = "";
  if (open_client(tls, &c, e2, sizeof e2) != 0)
    fail_msg("dp_client_open: %s", e2);
  assert_int_equal(dp_client_ping_sync(c, 20000, e2, sizeof e2), 0);
  dp_client_close(c);
  tls_ctx_free(tls);
}

static void a_plaintext_client_is_refused_by_the_tls_server(void **state) {
  (void)state;
  dp_client *c = NULL;
  char err[512] = "";
  assert_int_equal(open_client(NULL, &c, err, sizeof err), ZS_ECONN);
  assert_null(c);
  print_message("%s\n", err);
}

static void a_tls_client_is_refused_by_a_plaintext_server(void **state) {
  (void)state;
  tls_ctx *tls = client_tls(certs.ca, 0);
  dp_client *c = NULL;
  char err[512] = "";
  assert_int_equal(open_client(tls, &c, err, sizeof err), ZS_ECONN);
  assert_null(c);
  print_message("%s\n", err);
  assert_non_null(strstr(err, "TLS"));
  tls_ctx_free(tls);
}

int main(void) {
  log_set_level(LOG_LEVEL_ERROR);
  if (tls_certs_make(&certs) != 0) {
    fprintf(stderr, "cannot make the test certificates with openssl\n");
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(pulls_and_pushes_over_tls_arrive_byte_exact, setup_tls,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          a_client_that_does_not_trust_the_server_is_refused_with_the_reason, setup_tls, teardown),
      cmocka_unit_test_setup_teardown(a_client_without_a_certificate_is_refused_by_the_server,
                                      setup_tls, teardown),
      cmocka_unit_test_setup_teardown(a_plaintext_client_is_refused_by_the_tls_server, setup_tls,
                                      teardown),
      cmocka_unit_test_setup_teardown(a_tls_client_is_refused_by_a_plaintext_server, setup_plain,
                                      teardown),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  tls_certs_remove(&certs);
  return failed;
}
