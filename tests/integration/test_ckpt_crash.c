/*
 * test_ckpt_crash — a checkpoint that never reached its commit is never
 * loaded: a shard killed (kill -9) half way through writing its file, made to
 * stop there by the test hook ZSHARD_TEST_CKPT_STALL, leaves a partial
 * temporary file and no MANIFEST; files written by every shard but never
 * committed are passed over as well. In both cases every shard restarts from
 * the previous checkpoint, and training from it ends exactly like an
 * uninterrupted run.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ckpt_util.h"

#define LAST 10

typedef struct ckpt_thread {
  zs_client *c;
  uint64_t step;
  int rc;
  char err[512];
} ckpt_thread;

static void *run_checkpoint(void *arg) {
  ckpt_thread *t = arg;
  t->rc = zs_checkpoint(t->c, t->step);
  snprintf(t->err, sizeof t->err, "%s", zs_last_error());
  return NULL;
}

static int exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

/* Restarts both shards on their ports and checks they loaded `step` and
 * ignored `ignored`; then trains a fresh trainer from there and compares. */
static void restart_and_finish(hs_server **srv, const int *port, const char *dir, uint64_t step,
                               uint64_t ignored, float *ref[CU_NT]) {
  char want[600];
  for (uint32_t i = 0; i < 2; i++) {
    assert_non_null(srv[i] = cu_start_shard(i, 2, port[i], dir, NULL));
    snprintf(want, sizeof want, "event=checkpoint_loaded dir=%s step=%" PRIu64, dir, step);
    assert_true(cu_file_has(srv[i]->log_path, want));
    snprintf(want, sizeof want, "event=checkpoint_incomplete_ignored dir=%s step=%" PRIu64, dir,
             ignored);
    assert_true(cu_file_has(srv[i]->log_path, want));
  }
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), step + 1);
  uint64_t latest = 0;
  assert_int_equal(zs_latest_checkpoint(tr.c, &latest), ZS_OK);
  assert_int_equal(latest, step);
  int rc = cu_train_until(&tr, LAST, 0);
  if (rc)
    fprintf(stderr, "%s\n", tr.err);
  assert_int_equal(rc, 0);
  float *got[CU_NT] = {0};
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_free_params(got);
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
}

static void shard_killed_while_writing_never_loads_the_partial_checkpoint(void **state) {
  (void)state;
  float *ref[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  char dir[512];
  cu_dir(dir, sizeof dir, "killed-writing");
  /* Shard 1 stops half way through its file of step 6. */
  const char *stall[] = {"ZSHARD_TEST_CKPT_STALL=6", NULL};
  hs_server *srv[2];
  assert_non_null(srv[0] = cu_start_shard(0, 2, 0, dir, NULL));
  assert_non_null(srv[1] = cu_start_shard(1, 2, 0, dir, stall));
  int port[2] = {srv[0]->port, srv[1]->port};
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  /* A lost shard is given up on quickly: the test waits for the failure. */
  cu_max_retries = 3;
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  cu_max_retries = 0;
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 3, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  assert_int_equal(cu_train_until(&tr, 6, 0), 0);

  ckpt_thread ct = {.c = tr.c, .step = 6};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, run_checkpoint, &ct), 0);
  assert_int_equal(cu_wait_log(srv[1], "event=checkpoint_stalled"), 0);
  char tmp[600], manifest[600];
  snprintf(tmp, sizeof tmp, "%s/step-6/.shard-1-of-2.zsc.tmp", dir);
  snprintf(manifest, sizeof manifest, "%s/step-6/MANIFEST", dir);
  assert_true(exists(tmp));
  cu_kill9(srv[1]);
  pthread_join(th, NULL);
  fprintf(stderr, "zs_checkpoint while shard 1 died: %s\n", ct.err);
  assert_int_not_equal(ct.rc, ZS_OK);
  assert_non_null(strstr(ct.err, "nothing was committed"));
  assert_false(exists(manifest));
  uint64_t last = 0;
  assert_int_equal(zs_last_checkpoint(tr.c, &last), ct.rc);
  assert_int_equal(last, 3);
  cu_trainer_free(&tr);
  /* Every shard goes down; the partial checkpoint stays on disk. */
  cu_kill9(srv[0]);
  assert_true(exists(tmp));
  restart_and_finish(srv, port, dir, 3, 6, ref);
  cu_free_params(ref);
}

static void files_written_but_never_committed_are_never_loaded(void **state) {
  (void)state;
  float *ref[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  char dir[512];
  cu_dir(dir, sizeof dir, "uncommitted");
  hs_server *srv[2];
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir, NULL));
  int port[2] = {srv[0]->port, srv[1]->port};
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 3, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 3), ZS_OK);
  assert_int_equal(cu_train_until(&tr, 5, 0), 0);
  /* The first round only, as a coordinator that died before committing
   * would leave it: every shard's file of step 5 is complete and durable. */
  uint64_t hash = zs_spec_hash(tr.c);
  for (uint32_t i = 0; i < 2; i++) {
    rpc_channel *ch;
    assert_int_equal(rpc_channel_open(srv[i]->addr, &ch), 0);
    Zshard__V1__CheckpointRequest req = ZSHARD__V1__CHECKPOINT_REQUEST__INIT;
    req.spec_hash = hash;
    req.step = 5;
    Zshard__V1__CheckpointResponse *resp = NULL;
    rpc_status st;
    assert_int_equal(rpc_call(ch, "/zshard.v1.ZShard/Checkpoint", &req.base,
                              &zshard__v1__checkpoint_response__descriptor,
                              (ProtobufCMessage **)&resp, HS_CALL_TIMEOUT_MS, &st),
                     0);
    assert_int_equal(resp->step, 5);
    assert_non_null(resp->file);
    char path[600];
    snprintf(path, sizeof path, "%s/step-5/%s", dir, resp->file->name);
    assert_true(exists(path));
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    rpc_channel_close(ch);
  }
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    cu_kill9(srv[i]);
  restart_and_finish(srv, port, dir, 3, 5, ref);
  cu_free_params(ref);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(shard_killed_while_writing_never_loads_the_partial_checkpoint),
      cmocka_unit_test(files_written_but_never_committed_are_never_loaded),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
