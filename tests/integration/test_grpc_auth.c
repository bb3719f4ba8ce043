/*
 * test_grpc_auth — tokens, roles and TLS on the gRPC transport, on real
 * zshard-server processes: a call without the token, or with a wrong one, is
 * UNAUTHENTICATED and changes nothing; a trainer's token opens and trains
 * but every admin method refuses it (PERMISSION_DENIED); the admin token
 * does both; health needs no token; SIGHUP rotates the tokens without a
 * restart; with a certificate the port speaks TLS only, a client with the CA
 * trains, a plaintext client cannot; with a client CA, a client needs a
 * certificate of its own; SIGHUP rotates the certificate too.
 *
 * The certificates are made by the openssl command line tool in the
 * harness's temporary directory. The data plane is off in these servers:
 * its authentication is tested with it (test_dataplane_auth).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "grpc/health/v1/health.pb-c.h"
#include "harness.h"
#include "zshard/zshard.h"

#define TRAINER_TOKEN "trainer-secret-0123456789"
#define ADMIN_TOKEN "admin-secret-0123456789abc"
#define NT 2
#define ZC_METHOD_PATH(name) "/zshard.v1.ZShard/" name
static const uint64_t NUMEL[NT] = {100, 7};

static char trainer_file[600], admin_file[600], certdir[600];

/* Mode 0600: a token file others may read is refused. */
static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  assert_true(fputs(text, f) >= 0);
  assert_int_equal(fclose(f), 0);
  assert_int_equal(chmod(path, 0600), 0);
}

/* Runs a shell command (the openssl CLI); fails the test if it fails. */
static void sh(const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int rc = system(cmd);
  if (rc != 0)
    fprintf(stderr, "command failed (%d): %s\n", rc, cmd);
  assert_int_equal(rc, 0);
}

/* A CA named `ca` and a certificate `name` it signs for localhost and
 * 127.0.0.1, in certdir: <ca>.pem, <ca>.key, <name>.pem, <name>.key. */
static void make_ca(const char *ca) {
  sh("cd '%s' && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
     "-keyout %s.key -out %s.pem -days 2 -subj /CN=%s 2>/dev/null",
     certdir, ca, ca, ca);
}

static void make_cert(const char *ca, const char *name) {
  sh("cd '%s' && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > %s.ext && "
     "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout %s.key "
     "-out %s.csr -subj /CN=localhost 2>/dev/null && "
     "openssl x509 -req -in %s.csr -CA %s.pem -CAkey %s.key -CAcreateserial -out %s.pem "
     "-days 2 -extfile %s.ext 2>/dev/null",
     certdir, name, name, name, name, ca, ca, name, name);
}

static const char *certpath(const char *name, const char *ext, char *buf, size_t cap) {
  snprintf(buf, cap, "%s/%s.%s", certdir, name, ext);
  return buf;
}

static int setup(void **state) {
  (void)state;
  if (hs_init() != 0)
    return -1;
  snprintf(trainer_file, sizeof trainer_file, "%s/trainer.token", hs_tmpdir());
  snprintf(admin_file, sizeof admin_file, "%s/admin.token", hs_tmpdir());
  snprintf(certdir, sizeof certdir, "%s/certs", hs_tmpdir());
  write_file(trainer_file, TRAINER_TOKEN "\n");
  write_file(admin_file, ADMIN_TOKEN "\n");
  sh("mkdir -p '%s'", certdir);
  make_ca("ca");
  make_cert("ca", "server");
  make_cert("ca", "client");
  make_ca("ca2");
  make_cert("ca2", "server2");
  return 0;
}

static int teardown(void **state) {
  (void)state;
  hs_finish(0);
  return 0;
}

/* A server with both tokens, no data plane, plus `more` args. */
static hs_server *start_auth_server(const char *const *more) {
  const char *args[24] = {"--token-file", trainer_file,    "--admin-token-file",
                          admin_file,     "--data-listen", "off"};
  size_t n = 6;
  for (const char *const *a = more; a && *a; a++)
    args[n++] = *a;
  args[n] = NULL;
  hs_server *s = hs_start(args, NULL);
  assert_non_null(s);
  return s;
}

static rpc_channel *channel(const hs_server *s, const rpc_security *sec) {
  rpc_channel *ch = NULL;
  char err[400] = "";
  int rc = rpc_channel_open_secure(s->addr, sec, &ch, err, sizeof err);
  if (rc)
    fprintf(stderr, "rpc_channel_open_secure: %s\n", err);
  assert_int_equal(rc, ZS_OK);
  return ch;
}

/* The job the shard reports, asked with the admin token. */
static void shard_job(const hs_server *s, const rpc_security *sec, char *job, size_t cap,
                      uint64_t *version) {
  rpc_channel *ch = channel(s, sec);
  Zshard__V1__GetInfoResponse *r = NULL;
  rpc_status st;
  int rc = hs_get_info(ch, &r, &st);
  if (rc)
    fprintf(stderr, "GetInfo: %s\n", st.message);
  assert_int_equal(rc, 0);
  snprintf(job, cap, "%s", r->job ? r->job : "");
  if (version)
    *version = r->version;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  rpc_channel_close(ch);
}

static zs_client *new_client(const hs_server *s, const zs_client_options *base) {
  zs_client_options o;
  if (base)
    o = *base;
  else
    zs_client_options_init(&o);
  o.addresses = s->addr;
  o.job = "authjob";
  if (o.transport == ZS_TRANSPORT_DEFAULT)
    o.transport = ZS_TRANSPORT_GRPC;
  o.max_retries = 2;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 100;
  o.rpc_timeout_ms = 10000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &g, NULL), ZS_OK);
  for (uint32_t t = 0; t < NT; t++) {
    char name[8];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  return c;
}

/* Opens the job (creating or resuming it) and trains one step, after which
 * weight 3 of tensor 0 must be `expect`; returns the first failure. */
static int open_and_step_to(zs_client *c, float expect) {
  float w0[100], w1[7], g0[100], g1[7];
  for (int i = 0; i < 100; i++)
    w0[i] = (float)i, g0[i] = 1.0f;
  for (int i = 0; i < 7; i++)
    w1[i] = (float)i, g1[i] = 1.0f;
  const float *init[NT] = {w0, w1};
  int rc = zs_open_job(c, init);
  if (rc == ZS_OK)
    rc = zs_push(c, 0, 0, g0, ZS_DTYPE_FP32, sizeof g0, NULL);
  if (rc == ZS_OK)
    rc = zs_push(c, 1, 0, g1, ZS_DTYPE_FP32, sizeof g1, NULL);
  if (rc == ZS_OK)
    rc = zs_step(c, 0.5, 0, 0, NULL);
  if (rc == ZS_OK) {
    float out[100];
    rc = zs_pull(c, 0, out, ZS_DTYPE_FP32, sizeof out, NULL);
    if (rc == ZS_OK && out[3] != expect)
      rc = ZS_EINTERNAL;
  }
  return rc;
}

/* A new job's first step: SGD, lr 0.5, gradient 1. */
static int open_and_step(zs_client *c) {
  return open_and_step_to(c, 3.0f - 0.5f);
}

/* Waits (bounded) until the server's log holds `text`. */
static int log_has(const hs_server *s, const char *text) {
  for (uint64_t until = clock_now_ns() + 20000000000ull; clock_now_ns() < until;) {
    FILE *f = fopen(s->log_path, "r");
    char buf[1 << 16];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
      fclose(f);
    buf[n] = '\0';
    if (strstr(buf, text))
      return 1;
    usleep(20000);
  }
  return 0;
}

static const rpc_security no_sec = {0};
static const rpc_security trainer_sec = {.token = TRAINER_TOKEN};
static const rpc_security admin_sec = {.token = ADMIN_TOKEN};
static const rpc_security wrong_sec = {.token = "not-the-token-0123456789"};

/* ------------------------------------------------------------------ tokens */

static void no_or_wrong_token_is_unauthenticated_and_changes_nothing(void **state) {
  (void)state;
  hs_server *s = start_auth_server(NULL);
  const char *wrong[] = {NULL, "not-the-token-0123456789"};
  for (int k = 0; k < 2; k++) {
    zs_client_options o;
    zs_client_options_init(&o);
    o.token = wrong[k];
    zs_client *c = new_client(s, &o);
    assert_int_equal(open_and_step(c), ZS_EUNAUTHENTICATED);
    assert_non_null(strstr(zs_last_error(), k == 0 ? "no \"authorization" : "not valid"));
    assert_int_equal(zs_client_close(c), ZS_OK);
  }
  char job[64];
  shard_job(s, &admin_sec, job, sizeof job, NULL);
  assert_string_equal(job, ""); /* no job was opened */
  /* GetInfo, a trainer's method, needs a token too. */
  const rpc_security *bad[] = {&no_sec, &wrong_sec};
  for (int k = 0; k < 2; k++) {
    rpc_channel *ch = channel(s, bad[k]);
    Zshard__V1__GetInfoResponse *r = NULL;
    rpc_status st;
    assert_int_equal(hs_get_info(ch, &r, &st), ZS_EUNAUTHENTICATED);
    assert_int_equal(st.grpc_code, 16);
    rpc_channel_close(ch);
  }
  assert_int_equal(hs_stop(s), 0);
}

/* Every admin method (grpc_methods.c, the role column), called with `sec`. */
static void call_admin_methods(const hs_server *s, const rpc_security *sec, uint64_t hash,
                               int expect) {
  rpc_channel *ch = channel(s, sec);
  rpc_status st;
  ProtobufCMessage *resp = NULL;
  Zshard__V1__CheckpointRequest ck = ZSHARD__V1__CHECKPOINT_REQUEST__INIT;
  ck.spec_hash = hash;
  ck.step = 1;
  ck.dir = "ckpt-x";
  assert_int_equal(rpc_call(ch, ZC_METHOD_PATH("Checkpoint"), &ck.base,
                            &zshard__v1__checkpoint_response__descriptor, &resp, 10000, &st),
                   expect);
  Zshard__V1__CommitCheckpointRequest cc = ZSHARD__V1__COMMIT_CHECKPOINT_REQUEST__INIT;
  cc.spec_hash = hash;
  assert_int_equal(rpc_call(ch, ZC_METHOD_PATH("CommitCheckpoint"), &cc.base,
                            &zshard__v1__commit_checkpoint_response__descriptor, &resp, 10000, &st),
                   expect);
  Zshard__V1__RestoreRequest rs = ZSHARD__V1__RESTORE_REQUEST__INIT;
  rs.spec_hash = hash;
  assert_int_equal(rpc_call(ch, ZC_METHOD_PATH("Restore"), &rs.base,
                            &zshard__v1__restore_response__descriptor, &resp, 10000, &st),
                   expect);
  Zshard__V1__WriteStateRequest ws = ZSHARD__V1__WRITE_STATE_REQUEST__INIT;
  ws.spec_hash = hash;
  assert_int_equal(rpc_call(ch, ZC_METHOD_PATH("WriteState"), &ws.base,
                            &zshard__v1__write_state_response__descriptor, &resp, 10000, &st),
                   expect);
  Zshard__V1__CloseJobRequest cj = ZSHARD__V1__CLOSE_JOB_REQUEST__INIT;
  cj.spec_hash = hash;
  cj.job = "authjob";
  assert_int_equal(rpc_call(ch, ZC_METHOD_PATH("CloseJob"), &cj.base,
                            &zshard__v1__close_job_response__descriptor, &resp, 10000, &st),
                   expect);
  if (expect == ZS_EPERM)
    assert_non_null(strstr(st.message, "admin token"));
  rpc_channel_close(ch);
}

static void trainer_token_trains_but_admin_methods_refuse_it(void **state) {
  (void)state;
  char statedir[700];
  snprintf(statedir, sizeof statedir, "%s/state-roles", hs_tmpdir());
  const char *more[] = {"--state-dir", statedir, NULL};
  hs_server *s = start_auth_server(more);
  zs_client_options o;
  zs_client_options_init(&o);
  o.token = TRAINER_TOKEN;
  zs_client *c = new_client(s, &o);
  assert_int_equal(open_and_step(c), ZS_OK);
  uint64_t hash = zs_spec_hash(c);
  /* The library's own admin calls, with the trainer's token. */
  assert_int_equal(zs_checkpoint(c, 1), ZS_EPERM);
  assert_int_equal(zs_restore(c, 1), ZS_EPERM);
  assert_int_equal(zs_close_job(c), ZS_EPERM);
  call_admin_methods(s, &trainer_sec, hash, ZS_EPERM);
  char job[64];
  uint64_t version = 0;
  shard_job(s, &admin_sec, job, sizeof job, &version);
  assert_string_equal(job, "authjob"); /* still open, still at step 1 */
  assert_int_equal(version, 1);
  assert_int_equal(zs_client_close(c), ZS_OK);

  /* The admin token may do everything: a trainer's step and the admin
   * methods. */
  o.token = ADMIN_TOKEN;
  c = new_client(s, &o);
  assert_int_equal(open_and_step_to(c, 3.0f - 1.0f), ZS_OK); /* resumes the job: step 2 */
  assert_int_equal(zs_checkpoint(c, 2), ZS_OK);
  assert_int_equal(zs_restore(c, 2), ZS_OK);
  assert_int_equal(zs_close_job(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  shard_job(s, &admin_sec, job, sizeof job, NULL);
  assert_string_equal(job, "");
  assert_int_equal(hs_stop(s), 0);
}

static void health_needs_no_token(void **state) {
  (void)state;
  hs_server *s = start_auth_server(NULL);
  rpc_channel *ch = channel(s, &no_sec);
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = "";
  Grpc__Health__V1__HealthCheckResponse *resp = NULL;
  rpc_status st;
  assert_int_equal(rpc_call(ch, "/grpc.health.v1.Health/Check", &req.base,
                            &grpc__health__v1__health_check_response__descriptor,
                            (ProtobufCMessage **)&resp, 10000, &st),
                   ZS_OK);
  assert_int_equal(resp->status, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  protobuf_c_message_free_unpacked(&resp->base, NULL);
  rpc_channel_close(ch);
  assert_int_equal(hs_stop(s), 0);
}

/* GetInfo with `sec`: its status. */
static int get_info_status(const hs_server *s, const rpc_security *sec) {
  rpc_channel *ch = channel(s, sec);
  Zshard__V1__GetInfoResponse *r = NULL;
  rpc_status st;
  int rc = hs_get_info(ch, &r, &st);
  if (r)
    protobuf_c_message_free_unpacked(&r->base, NULL);
  rpc_channel_close(ch);
  return rc;
}

static void sighup_rotates_the_tokens_without_a_restart(void **state) {
  (void)state;
  hs_server *s = start_auth_server(NULL);
  pid_t pid = s->pid;
  assert_int_equal(get_info_status(s, &trainer_sec), ZS_OK);
  const rpc_security fresh = {.token = "rotated-trainer-token-42"};
  assert_int_equal(get_info_status(s, &fresh), ZS_EUNAUTHENTICATED);
  write_file(trainer_file, "rotated-trainer-token-42\n");
  hs_signal(s, SIGHUP);
  /* The reload happens on the server's main thread some time after the
   * signal: poll, bounded. */
  int rc = ZS_EUNAUTHENTICATED;
  for (uint64_t until = clock_now_ns() + 20000000000ull; rc != ZS_OK && clock_now_ns() < until;)
    if ((rc = get_info_status(s, &fresh)) != ZS_OK)
      usleep(20000);
  assert_int_equal(rc, ZS_OK);
  assert_int_equal(get_info_status(s, &trainer_sec), ZS_EUNAUTHENTICATED);
  assert_int_equal(get_info_status(s, &admin_sec), ZS_OK);
  /* A bad file on the next SIGHUP keeps the tokens in use. */
  write_file(trainer_file, "short\n");
  hs_signal(s, SIGHUP);
  assert_true(log_has(s, "what=tokens outcome=kept_old"));
  assert_int_equal(get_info_status(s, &fresh), ZS_OK);
  assert_int_equal(s->pid, pid); /* the same process all along */
  write_file(trainer_file, TRAINER_TOKEN "\n");
  assert_int_equal(hs_stop(s), 0);
}

static void a_bad_token_file_is_a_usage_error(void **state) {
  (void)state;
  char path[700], out[8192];
  /* --help documents the flags. */
  const char *help[] = {"--help", NULL};
  assert_int_equal(hs_run(help, NULL, out, sizeof out), 0);
  const char *flags[] = {"--token-file PATH", "--admin-token-file PATH", "--tls-cert PATH",
                         "--tls-key PATH",    "--tls-client-ca PATH",    "SIGHUP"};
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
    assert_non_null(strstr(out, flags[i]));
  snprintf(path, sizeof path, "%s/short.token", hs_tmpdir());
  write_file(path, "short\n");
  const char *args[] = {"--listen", "127.0.0.1:0", "--token-file", path, NULL};
  assert_int_equal(hs_run(args, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "at least 16 bytes"));
  const char *args2[] = {"--listen", "127.0.0.1:0", "--admin-token-file", "/nonexistent/x", NULL};
  assert_int_equal(hs_run(args2, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "/nonexistent/x"));
  const char *args3[] = {"--listen", "127.0.0.1:0", "--tls-cert", path, "--tls-key", path, NULL};
  assert_int_equal(hs_run(args3, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "not a PEM file"));
  /* A key of another certificate is a usage error, saying so (the data
   * plane's TLS context is made with the other files, before the start). */
  char cert[700], key[700];
  const char *args4[] = {"--listen",   "127.0.0.1:0",
                         "--tls-cert", certpath("server", "pem", cert, sizeof cert),
                         "--tls-key",  certpath("server2", "key", key, sizeof key),
                         NULL};
  assert_int_equal(hs_run(args4, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "key values mismatch"));
}

/* An address without a host binds the metrics endpoint to loopback only. */
static void metrics_without_a_host_listen_on_loopback(void **state) {
  (void)state;
  const char *forms[] = {"0", ":0"};
  for (int k = 0; k < 2; k++) {
    const char *args[] = {"--metrics-listen", forms[k], NULL};
    hs_server *s = hs_start(args, NULL);
    assert_non_null(s);
    assert_true(log_has(s, "event=metrics_listening addr=127.0.0.1:0 "));
    assert_int_equal(hs_stop(s), 0);
  }
}

/* Runs the CLI with `args` (a shell word list); returns its exit status and
 * its stdout and stderr in out. */
static int cli(char *out, size_t cap, const char *fmt, ...) {
  char args[2048], cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", ZSHARD_CLI_BIN, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, cap - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  fprintf(stderr, "$ zshard %s\n%s", args, out);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void cli_takes_the_token_and_tls_flags(void **state) {
  (void)state;
  char cert[700], key[700], ca[700], out[8192];
  certpath("ca", "pem", ca, sizeof ca);
  const char *more[] = {"--tls-cert", certpath("server", "pem", cert, sizeof cert), "--tls-key",
                        certpath("server", "key", key, sizeof key), NULL};
  hs_server *s = start_auth_server(more);
  /* No token: the health check answers (SERVING, status 0), GetInfo does
   * not. */
  assert_int_equal(cli(out, sizeof out, "status --shards %s --tls-ca %s --json", s->addr, ca), 0);
  assert_non_null(strstr(out, "requires a token"));
  assert_null(strstr(out, "\"job\""));
  assert_int_equal(
      cli(out, sizeof out, "status --shards %s --tls-ca %s --token %s", s->addr, ca, TRAINER_TOKEN),
      0);
  assert_non_null(strstr(out, "SERVING"));
  assert_null(strstr(out, "requires a token"));
  /* close-job is an admin's: refused with the trainers' token, done with the
   * admin's token file. */
  assert_int_equal(cli(out, sizeof out, "close-job --shards %s --token %s --tls-ca=%s", s->addr,
                       TRAINER_TOKEN, ca),
                   1);
  assert_non_null(strstr(out, "ZS_EPERM"));
  assert_int_equal(cli(out, sizeof out, "close-job --shards %s --token-file %s --tls-ca %s",
                       s->addr, admin_file, ca),
                   0);
  assert_non_null(strstr(out, "no job open"));
  /* Without --tls-ca the CLI says what is missing. */
  assert_int_equal(cli(out, sizeof out, "close-job --shards %s --token %s", s->addr, ADMIN_TOKEN),
                   1);
  assert_non_null(strstr(out, "speaks TLS"));
  assert_int_equal(hs_stop(s), 0);
}

/* ------------------------------------------------------------------- TLS */

static void tls_client_with_the_ca_trains_and_plaintext_cannot(void **state) {
  (void)state;
  char cert[700], key[700], ca[700], ca2[700];
  const char *more[] = {"--tls-cert", certpath("server", "pem", cert, sizeof cert), "--tls-key",
                        certpath("server", "key", key, sizeof key), NULL};
  hs_server *s = start_auth_server(more);
  certpath("ca", "pem", ca, sizeof ca);
  certpath("ca2", "pem", ca2, sizeof ca2);

  zs_client_options o;
  zs_client_options_init(&o);
  o.token = TRAINER_TOKEN;
  o.tls_ca_file = ca;
  zs_client *c = new_client(s, &o);
  assert_int_equal(open_and_step(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  /* The data plane speaks TLS with the same certificate: a client on it
   * resumes the job and trains its second step (weight 3: 3 - 0.5 - 0.5). */
  o.transport = ZS_TRANSPORT_DATA;
  c = new_client(s, &o);
  assert_int_equal(open_and_step_to(c, 2.0f), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  o.transport = ZS_TRANSPORT_DEFAULT;

  /* Plaintext to a TLS port: the connection fails, clearly. */
  o.tls_ca_file = NULL;
  c = new_client(s, &o);
  int rc = open_and_step(c);
  fprintf(stderr, "plaintext client: %s: %s\n", zs_err_name(rc), zs_last_error());
  assert_int_equal(rc, ZS_ECONN);
  assert_non_null(strstr(zs_last_error(), "speaks TLS"));
  assert_int_equal(zs_client_close(c), ZS_OK);

  /* A CA that did not sign the server's certificate. */
  const rpc_security other_ca = {.token = TRAINER_TOKEN, .tls_ca_file = ca2};
  assert_int_equal(get_info_status(s, &other_ca), ZS_ECONN);
  /* The server name given explicitly. */
  const rpc_security named = {
      .token = TRAINER_TOKEN, .tls_ca_file = ca, .tls_server_name = "localhost"};
  assert_int_equal(get_info_status(s, &named), ZS_OK);
  assert_int_equal(hs_stop(s), 0);
}

static void mtls_needs_a_client_certificate(void **state) {
  (void)state;
  char cert[700], key[700], ca[700], ccert[700], ckey[700];
  certpath("ca", "pem", ca, sizeof ca);
  const char *more[] = {"--tls-cert",
                        certpath("server", "pem", cert, sizeof cert),
                        "--tls-key",
                        certpath("server", "key", key, sizeof key),
                        "--tls-client-ca",
                        ca,
                        NULL};
  hs_server *s = start_auth_server(more);
  const rpc_security without = {.token = TRAINER_TOKEN, .tls_ca_file = ca};
  assert_int_equal(get_info_status(s, &without), ZS_ECONN);
  const rpc_security with = {.token = TRAINER_TOKEN,
                             .tls_ca_file = ca,
                             .tls_cert_file = certpath("client", "pem", ccert, sizeof ccert),
                             .tls_key_file = certpath("client", "key", ckey, sizeof ckey)};
  assert_int_equal(get_info_status(s, &with), ZS_OK);
  /* Through the library too, the files from the environment. */
  setenv("ZSHARD_TLS_CA", ca, 1);
  setenv("ZSHARD_TLS_CERT", ccert, 1);
  setenv("ZSHARD_TLS_KEY", ckey, 1);
  setenv("ZSHARD_TOKEN", TRAINER_TOKEN, 1);
  zs_client *c = new_client(s, NULL);
  assert_int_equal(open_and_step(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  unsetenv("ZSHARD_TLS_CERT");
  unsetenv("ZSHARD_TLS_KEY");
  c = new_client(s, NULL);
  assert_int_equal(open_and_step(c), ZS_ECONN);
  assert_int_equal(zs_client_close(c), ZS_OK);
  unsetenv("ZSHARD_TLS_CA");
  unsetenv("ZSHARD_TOKEN");
  assert_int_equal(hs_stop(s), 0);
}

static void sighup_rotates_the_certificate(void **state) {
  (void)state;
  /* The server's files are copies this test overwrites. */
  char cert[700], key[700], ca[700], ca2[700];
  snprintf(cert, sizeof cert, "%s/rot.pem", certdir);
  snprintf(key, sizeof key, "%s/rot.key", certdir);
  certpath("ca", "pem", ca, sizeof ca);
  certpath("ca2", "pem", ca2, sizeof ca2);
  sh("cp '%s/server.pem' '%s' && cp '%s/server.key' '%s'", certdir, cert, certdir, key);
  const char *more[] = {"--tls-cert", cert, "--tls-key", key, NULL};
  hs_server *s = start_auth_server(more);
  const rpc_security old_ca = {.token = TRAINER_TOKEN, .tls_ca_file = ca};
  const rpc_security new_ca = {.token = TRAINER_TOKEN, .tls_ca_file = ca2};
  assert_int_equal(get_info_status(s, &old_ca), ZS_OK);
  assert_int_equal(get_info_status(s, &new_ca), ZS_ECONN);
  /* A certificate without its key: refused, the pair in use stays. */
  sh("cp '%s/server2.pem' '%s'", certdir, cert);
  hs_signal(s, SIGHUP);
  assert_true(log_has(s, "what=grpc_tls outcome=kept_old"));
  assert_true(log_has(s, "is not the key of --tls-cert"));
  assert_int_equal(get_info_status(s, &old_ca), ZS_OK);
  sh("cp '%s/server2.key' '%s'", certdir, key);
  hs_signal(s, SIGHUP);
  int rc = ZS_ECONN;
  for (uint64_t until = clock_now_ns() + 20000000000ull; rc != ZS_OK && clock_now_ns() < until;)
    if ((rc = get_info_status(s, &new_ca)) != ZS_OK)
      usleep(20000);
  assert_int_equal(rc, ZS_OK);
  assert_int_equal(get_info_status(s, &old_ca), ZS_ECONN);
  assert_int_equal(hs_stop(s), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(no_or_wrong_token_is_unauthenticated_and_changes_nothing),
      cmocka_unit_test(trainer_token_trains_but_admin_methods_refuse_it),
      cmocka_unit_test(health_needs_no_token),
      cmocka_unit_test(sighup_rotates_the_tokens_without_a_restart),
      cmocka_unit_test(a_bad_token_file_is_a_usage_error),
      cmocka_unit_test(metrics_without_a_host_listen_on_loopback),
      cmocka_unit_test(tls_client_with_the_ca_trains_and_plaintext_cannot),
      cmocka_unit_test(mtls_needs_a_client_certificate),
      cmocka_unit_test(cli_takes_the_token_and_tls_flags),
      cmocka_unit_test(sighup_rotates_the_certificate),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
