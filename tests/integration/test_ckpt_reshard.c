/*
 * test_ckpt_reshard — a checkpoint written by N shards opens on N' shards:
 * mid-training the job moves from 2 shards to 3 (the new shards load the
 * 2-shard checkpoint from their state directory on start) and back from 3 to
 * 2 (through `zshard reshard`, offline), and ends with exactly the parameters
 * of an uninterrupted run on 2 shards. Without clipping every element's
 * update is independent of where it lives, so equality is bit for bit. A
 * shard that cannot reach every file it needs refuses to start and names
 * the missing file.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ckpt_util.h"

#define LAST 10

static void stop_all(hs_server **srv, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
}

static void reshard_two_to_three_and_three_to_two_ends_like_an_uninterrupted_run(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  char dir[512], dir2[512];
  cu_dir(dir, sizeof dir, "reshard");
  cu_dir(dir2, sizeof dir2, "reshard-out");

  /* 2 shards: steps 1..4, checkpoint 4. */
  hs_server *srv[3];
  char addrs[192];
  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir, NULL));
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 4, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  stop_all(srv, 2);

  /* 3 shards on the same directory: each loads its share of the 2-shard
   * files; steps 5..7, checkpoint 7 (now written by 3 shards). */
  for (uint32_t i = 0; i < 3; i++) {
    assert_non_null(srv[i] = cu_start_shard(i, 3, 0, dir, NULL));
    assert_true(cu_file_has(srv[i]->log_path, "event=checkpoint_loaded"));
    assert_true(cu_file_has(srv[i]->log_path, "step=4 source_shards=2"));
  }
  cu_addrs(srv, 3, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), 5);
  assert_int_equal(cu_train_until(&tr, 7, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  stop_all(srv, 3);

  /* Offline back to 2 shards; the tool refuses to write over its input. */
  char out[4096];
  char *same[] = {ZSHARD_CLI_BIN, "reshard", dir, dir, "--shards", "2", NULL};
  assert_int_equal(cu_run(same, out, sizeof out), 1);
  assert_non_null(strstr(out, "OUT is IN's directory"));
  char *argv[] = {ZSHARD_CLI_BIN, "reshard", dir, dir2, "--shards", "2", NULL};
  int rc = cu_run(argv, out, sizeof out);
  fprintf(stderr, "%s", out);
  assert_int_equal(rc, 0);
  assert_non_null(strstr(out, "resharded checkpoint step 7 from 3 to 2 shards"));

  for (uint32_t i = 0; i < 2; i++) {
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir2, NULL));
    assert_true(cu_file_has(srv[i]->log_path, "step=7 source_shards=2"));
  }
  cu_addrs(srv, 2, addrs, sizeof addrs);
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), 8);
  assert_int_equal(cu_train_until(&tr, LAST, 0), 0);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  stop_all(srv, 2);
  cu_free_params(ref);
  cu_free_params(got);
}

static void reshard_at_open_without_every_file_refuses_to_start_and_names_it(void **state) {
  (void)state;
  /* Two shards on separate volumes write a checkpoint... */
  char d0[512], d1[512];
  cu_dir(d0, sizeof d0, "separate-0");
  cu_dir(d1, sizeof d1, "separate-1");
  hs_server *srv[2];
  assert_non_null(srv[0] = cu_start_shard(0, 2, 0, d0, NULL));
  assert_non_null(srv[1] = cu_start_shard(1, 2, 0, d1, NULL));
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 2, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  stop_all(srv, 2);
  /* ...and shard 1 of 3, on volume 0, needs elements of both old shards
   * (w1's middle third straddles their slices) but has only old shard 0's
   * file. */
  const char *args[] = {"--listen",  "127.0.0.1:0", "--shard-id",  "1", "--shards", "3",
                        "--threads", "1",           "--state-dir", d0,  NULL};
  char out[4096];
  int rc = hs_run(args, NULL, out, sizeof out);
  fprintf(stderr, "%s", out);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "event=startup_failed stage=checkpoint"));
  assert_non_null(strstr(out, "shard-1-of-2.zsc"));
  assert_non_null(strstr(out, "zshard reshard"));
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(reshard_two_to_three_and_three_to_two_ends_like_an_uninterrupted_run),
      cmocka_unit_test(reshard_at_open_without_every_file_refuses_to_start_and_names_it),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  hs_finish(failures);
  return failures;
}
