/*
 * test_server_limits — attacks on a shard's memory through the
 * job it is asked to open: an Open of 80M parameters from a 70-byte request
 * held 1.4 GiB for the server's life, one of a million tensors 715 MiB.
 * With --max-params / --max-tensors (or their variables) the Open is refused
 * with RESOURCE_EXHAUSTED (ZS_ELIMIT) naming the flag, and the server's
 * resident memory, read from /proc/<pid>/status, does not grow by the state
 * it would have held. The other attacks on the core and the checkpoints,
 * over gRPC: an Apply with lr = 1e300 (finite double, infinite float) made
 * every weight -inf; three Checkpoints of step 1e9 blocked the checkpoint
 * thread; a FIFO named like a MANIFEST hung startup.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>

#include <cmocka.h>

#include "common/base/status.h"
#include "tests/integration/harness.h"

/* Growth a refused Open may cause: gRPC's buffers and the transient count;
 * the state it asked for is 20 times this. */
#define RSS_SLACK_KIB (64u * 1024u)

static uint64_t rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  unsigned long long kib = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %llu kB", &kib) == 1)
      break;
  fclose(f);
  assert_true(kib > 0);
  return kib;
}

/* A one-shard AdamW job of `ntensors` tensors of `numel` elements each. */
static void build_spec(spec *s, uint32_t ntensors, uint64_t numel) {
  memset(s, 0, sizeof *s);
  s->job = strdup("limits");
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  s->num_tensors = ntensors;
  s->tensors = calloc(ntensors, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < ntensors; t++) {
    char name[32];
    snprintf(name, sizeof name, "t%u", t);
    s->tensors[t].name = strdup(name);
    s->tensors[t].numel = numel;
  }
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = 1;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256] = "";
  if (spec_validate(s, err, sizeof err) != 0)
    fail_msg("spec: %s", err);
}

/* Opens the job on `srv`; returns the status and its message in st. */
static int open_job(hs_server *srv, uint32_t ntensors, uint64_t numel, rpc_status *st) {
  spec s;
  build_spec(&s, ntensors, numel);
  hs_job j;
  const char *addrs[1] = {srv->addr};
  assert_int_equal(hs_job_init(&j, &s, addrs), 0);
  int rc = hs_job_open(&j, 0, st);
  hs_job_free(&j);
  return rc;
}

static int log_has(const hs_server *srv, const char *part) {
  FILE *f = fopen(srv->log_path, "r");
  assert_non_null(f);
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof line, f))
    found = strstr(line, part) != NULL;
  fclose(f);
  return found;
}

/* Polls the server's log for `part`, for at most 20 s. */
static void wait_log(const hs_server *srv, const char *part) {
  for (int i = 0; i < 2000; i++) {
    if (log_has(srv, part))
      return;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  fail_msg("the server never logged \"%s\"", part);
}

static void test_an_open_beyond_max_params_is_refused_before_allocating(void **state) {
  (void)state;
  const char *args[] = {"--max-params", "1000000", NULL};
  hs_server *srv = hs_start(args, NULL);
  assert_non_null(srv);
  assert_true(log_has(srv, "event=job_limits max_params=1000000 "));
  uint64_t before = rss_kib(srv->pid);
  rpc_status st;
  /* 80M parameters: 1.4 GiB of AdamW state. */
  int rc = open_job(srv, 1, 80000000u, &st);
  uint64_t after = rss_kib(srv->pid);
  print_message("max-params: Open of 80M parameters: status %d (%s); VmRSS %llu -> %llu KiB\n", rc,
                st.message, (unsigned long long)before, (unsigned long long)after);
  assert_int_equal(rc, ZS_ELIMIT);
  assert_non_null(strstr(st.message, "80000000 parameters on shard 0"));
  assert_non_null(strstr(st.message, "--max-params"));
  assert_true(after < before + RSS_SLACK_KIB);
  /* A job within the limit opens. */
  assert_int_equal(open_job(srv, 1, 1000000u, &st), 0);
  assert_int_equal(hs_stop(srv), 0);
}

static void test_an_open_beyond_max_tensors_is_refused_from_the_environment(void **state) {
  (void)state;
  const char *env[] = {"ZSHARD_MAX_TENSORS=1000", NULL};
  hs_server *srv = hs_start(NULL, env);
  assert_non_null(srv);
  assert_true(log_has(srv, " max_tensors=1000 "));
  rpc_status st;
  int rc = open_job(srv, 1001, 16, &st);
  print_message("max-tensors: Open of 1001 tensors: status %d (%s)\n", rc, st.message);
  assert_int_equal(rc, ZS_ELIMIT);
  assert_non_null(strstr(st.message, "1001 tensors"));
  assert_non_null(strstr(st.message, "--max-tensors"));
  assert_int_equal(open_job(srv, 1000, 16, &st), 0);
  assert_int_equal(hs_stop(srv), 0);
}

static void test_default_limits_come_from_the_memory_limit_and_are_logged(void **state) {
  (void)state;
  hs_server *srv = hs_start(NULL, NULL);
  assert_non_null(srv);
  assert_true(log_has(srv, "event=job_limits max_params="));
  assert_true(log_has(srv, "params_from=memory tensors_from=memory"));
  assert_int_equal(hs_stop(srv), 0);
  char out[2048] = "";
  const char *bad[] = {"--max-params", "0", NULL};
  assert_int_equal(hs_run(bad, NULL, out, sizeof out), 2);
  assert_non_null(strstr(out, "--max-params (ZSHARD_MAX_PARAMS) must be a whole number"));
}

/* A one-shard job of two small tensors, opened and initialised to 0.5 on
 * srv; the caller frees j. */
static void ready_job(hs_server *srv, hs_job *j) {
  spec s;
  build_spec(&s, 2, 16);
  const char *addrs[1] = {srv->addr};
  assert_int_equal(hs_job_init(j, &s, addrs), 0);
  rpc_status st;
  assert_int_equal(hs_job_open(j, 0, &st), 0);
  float w0[16], w1[16];
  for (int i = 0; i < 16; i++)
    w0[i] = w1[i] = 0.5f;
  float *const w[2] = {w0, w1};
  assert_int_equal(hs_job_init_params(j, w, &st), 0);
}

static void test_an_apply_with_an_lr_infinite_as_a_float_changes_nothing(void **state) {
  (void)state;
  hs_server *srv = hs_start(NULL, NULL);
  assert_non_null(srv);
  hs_job j;
  ready_job(srv, &j);
  rpc_status st;
  float g[16];
  for (int i = 0; i < 16; i++)
    g[i] = 0.25f;
  for (uint32_t t = 0; t < 2; t++)
    assert_int_equal(hs_push(j.ch[0], j.hash, 1, 0, 0, t, 0, ZS_DTYPE_FP32, g, sizeof g, NULL, &st),
                     0);
  Zshard__V1__GradStatsResponse *gs = NULL;
  assert_int_equal(hs_grad_stats(j.ch[0], j.hash, 1, 30000, &gs, &st), 0);
  protobuf_c_message_free_unpacked(&gs->base, NULL);
  Zshard__V1__ApplyResponse *ar = NULL;
  int rc = hs_apply(j.ch[0], j.hash, 1, 1e300, 1.0f, 0, &ar, &st);
  print_message("Apply lr=1e300: status %d (%s)\n", rc, st.message);
  assert_int_equal(rc, ZS_EINVAL);
  assert_non_null(strstr(st.message, "within float32's range"));
  float p0[16], p1[16];
  float *const out[2] = {p0, p1};
  uint64_t v = 9;
  assert_int_equal(hs_job_pull(&j, 0, out, &v, &st), 0);
  assert_int_equal(v, 0);
  for (int i = 0; i < 16; i++)
    assert_true(p0[i] == 0.5f && p1[i] == 0.5f);
  assert_int_equal(hs_apply(j.ch[0], j.hash, 1, 1e-3, 1.0f, 0, &ar, &st), 0);
  protobuf_c_message_free_unpacked(&ar->base, NULL);
  assert_int_equal(hs_job_pull(&j, 1, out, &v, &st), 0);
  for (int i = 0; i < 16; i++)
    assert_true(p0[i] < 0.5f && p0[i] > 0.49f);
  hs_job_free(&j);
  assert_int_equal(hs_stop(srv), 0);
}

static int checkpoint(rpc_channel *ch, uint64_t hash, uint64_t step, uint32_t timeout_ms,
                      rpc_status *st) {
  Zshard__V1__CheckpointRequest req = ZSHARD__V1__CHECKPOINT_REQUEST__INIT;
  req.spec_hash = hash;
  req.step = step;
  req.timeout_ms = timeout_ms;
  ProtobufCMessage *resp = NULL;
  int rc = rpc_call(ch, "/zshard.v1.ZShard/Checkpoint", &req.base,
                    &zshard__v1__checkpoint_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, st);
  if (rc == 0)
    protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

typedef struct waiting_ckpt {
  rpc_channel *ch;
  uint64_t hash;
  pthread_mutex_t mu;
  int done, rc;
} waiting_ckpt;

static void *checkpoint_step_2(void *arg) {
  waiting_ckpt *w = arg;
  rpc_status st;
  int rc = checkpoint(w->ch, w->hash, 2, 60000, &st);
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->rc = rc;
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static void test_checkpoints_far_ahead_are_refused_and_near_ones_block_nobody(void **state) {
  (void)state;
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ahead-state", hs_tmpdir());
  const char *args[] = {"--state-dir", dir, NULL};
  hs_server *srv = hs_start(args, NULL);
  assert_non_null(srv);
  hs_job j;
  ready_job(srv, &j);
  rpc_status st;
  for (int i = 0; i < 3; i++) {
    int rc = checkpoint(j.ch[0], j.hash, 1000000000u, 0, &st);
    if (i == 0)
      print_message("Checkpoint of step 1e9: status %d (%s)\n", rc, st.message);
    assert_int_equal(rc, ZS_ESTEP);
    assert_non_null(strstr(st.message, "steps ahead"));
  }
  /* One within reach waits (a minute) on a channel of its own; the real
   * checkpoint of version 0 is answered meanwhile. */
  waiting_ckpt w = {.hash = j.hash, .mu = PTHREAD_MUTEX_INITIALIZER};
  assert_int_equal(rpc_channel_open(srv->addr, &w.ch), 0);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, checkpoint_step_2, &w), 0);
  wait_log(srv, "event=checkpoint_waiting step=2 version=0");
  int rc = checkpoint(j.ch[0], j.hash, 0, 0, &st);
  if (rc)
    fail_msg("Checkpoint of step 0: %s", st.message);
  pthread_mutex_lock(&w.mu);
  int waiting = !w.done;
  pthread_mutex_unlock(&w.mu);
  assert_true(waiting);
  /* Stopping the server answers the waiting one. */
  assert_int_equal(hs_stop(srv), 0);
  pthread_join(t, NULL);
  assert_int_not_equal(w.rc, 0);
  rpc_channel_close(w.ch);
  hs_job_free(&j);
}

/* A FIFO named like a MANIFEST or a checkpoint file in the state directory
 * hung startup in open(), ignoring SIGTERM: the server now starts, serves
 * and stops. */
static void test_fifos_in_the_state_directory_do_not_hang_startup(void **state) {
  (void)state;
  char dir[600], path[700];
  snprintf(dir, sizeof dir, "%s/fifo-state", hs_tmpdir());
  assert_int_equal(mkdir(dir, 0755), 0);
  snprintf(path, sizeof path, "%s/step-1", dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/step-1/MANIFEST", dir);
  assert_int_equal(mkfifo(path, 0644), 0);
  snprintf(path, sizeof path, "%s/step-1/shard-0-of-1.zsc", dir);
  assert_int_equal(mkfifo(path, 0644), 0);
  const char *args[] = {"--state-dir", dir, NULL};
  hs_server *srv = hs_start(args, NULL);
  assert_non_null(srv);
  assert_int_equal(hs_stop(srv), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_an_open_beyond_max_params_is_refused_before_allocating),
      cmocka_unit_test(test_an_open_beyond_max_tensors_is_refused_from_the_environment),
      cmocka_unit_test(test_default_limits_come_from_the_memory_limit_and_are_logged),
      cmocka_unit_test(test_fifos_in_the_state_directory_do_not_hang_startup),
      cmocka_unit_test(test_an_apply_with_an_lr_infinite_as_a_float_changes_nothing),
      cmocka_unit_test(test_checkpoints_far_ahead_are_refused_and_near_ones_block_nobody),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures;
}
