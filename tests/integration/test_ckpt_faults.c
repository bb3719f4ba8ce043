/*
 * test_ckpt_faults — damaged checkpoints and disks that refuse writes:
 *
 *  - one flipped byte in a shard's file: the shard refuses that checkpoint at
 *    start with a message naming the file and loads the previous one;
 *    `zshard restore` of the damaged step fails naming the file; zs_restore
 *    of "the newest" falls back to the previous checkpoint, and training
 *    from it ends like an uninterrupted run;
 *  - a truncated file: refused, named, by the server and by `zshard export`;
 *  - a full disk (a tiny tmpfs) and a read-only one: zs_checkpoint fails
 *    with the disk's own words and the shard named, nothing is committed,
 *    and the previous checkpoint is what the shards restart from;
 *  - no --state-dir: checkpoints are refused as not enabled.
 * The disk tests mount tmpfs; without root they skip (saying so) outside CI
 * and fail in CI (tests/common/privileged.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mount.h>
#include <sys/statvfs.h>

#include <cmocka.h>

#include "tests/common/privileged.h"

#include "ckpt_util.h"

#define LAST 10

static char g_mount[512]; /* a tmpfs to unmount in teardown */

static void flip_byte(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  assert_int_equal(fseek(f, off, SEEK_SET), 0);
  int ch = fgetc(f);
  assert_int_equal(fseek(f, off, SEEK_SET), 0);
  fputc(ch ^ 0x01, f);
  fclose(f);
}

static long file_size(const char *path) {
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  return (long)sb.st_size;
}

/* Two shards on `dir`, trained to 3 (checkpoint) and 6 (checkpoint). */
static void two_checkpoints(const char *dir, hs_server **srv, int *port) {
  for (uint32_t i = 0; i < 2; i++) {
    assert_non_null(srv[i] = cu_start_shard(i, 2, 0, dir, NULL));
    port[i] = srv[i]->port;
  }
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 3, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  assert_int_equal(cu_train_until(&tr, 6, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
}

static void
flipped_byte_is_refused_naming_the_file_and_training_resumes_from_the_previous(void **state) {
  (void)state;
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  char dir[512], path[600];
  cu_dir(dir, sizeof dir, "corrupt");
  hs_server *srv[2];
  int port[2];
  two_checkpoints(dir, srv, port);
  snprintf(path, sizeof path, "%s/step-6/shard-0-of-2.zsc", dir);
  flip_byte(path, file_size(path) / 2);

  for (uint32_t i = 0; i < 2; i++)
    assert_non_null(srv[i] = cu_start_shard(i, 2, port[i], dir, NULL));
  char want[700];
  snprintf(want, sizeof want, "event=checkpoint_refused dir=%s step=6", dir);
  assert_true(cu_file_has(srv[0]->log_path, want));
  assert_true(cu_file_has(srv[0]->log_path, path));
  assert_true(cu_file_has(srv[0]->log_path, "step=3 source_shards=2"));
  assert_true(cu_file_has(srv[1]->log_path, "step=6 source_shards=2"));

  char addrs[128], out[4096];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  char *argv[] = {ZSHARD_CLI_BIN, "restore", "--shards", addrs, "--step", "6", NULL};
  assert_int_equal(cu_run(argv, out, sizeof out), 1);
  fprintf(stderr, "zshard restore --step 6: %s", out);
  assert_non_null(strstr(out, path));
  assert_non_null(strstr(out, "CRC32C mismatch"));

  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), ZS_EBEHIND);
  assert_int_equal(zs_restore(tr.c, 0), ZS_OK);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), 4);
  assert_int_equal(cu_train_until(&tr, LAST, 0), 0);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

static void truncated_file_is_refused_naming_it(void **state) {
  (void)state;
  char dir[512], path[600], out[4096], dest[600];
  cu_dir(dir, sizeof dir, "truncated");
  hs_server *srv[2];
  int port[2];
  two_checkpoints(dir, srv, port);
  snprintf(path, sizeof path, "%s/step-6/shard-1-of-2.zsc", dir);
  assert_int_equal(truncate(path, file_size(path) - 100), 0);
  snprintf(dest, sizeof dest, "%s/model.safetensors", hs_tmpdir());
  char *argv[] = {ZSHARD_CLI_BIN, "export", dir, dest, NULL};
  assert_int_equal(cu_run(argv, out, sizeof out), 1);
  fprintf(stderr, "zshard export: %s", out);
  assert_non_null(strstr(out, path));
  assert_non_null(strstr(out, "truncated"));
  assert_int_equal(access(dest, F_OK), -1);
  /* The previous checkpoint exports; a server starting refuses step 6. */
  char *argv3[] = {ZSHARD_CLI_BIN, "export", dir, dest, "--step", "3", NULL};
  assert_int_equal(cu_run(argv3, out, sizeof out), 0);
  assert_non_null(srv[1] = cu_start_shard(1, 2, 0, dir, NULL));
  assert_true(cu_file_has(srv[1]->log_path, path));
  assert_true(cu_file_has(srv[1]->log_path, "step=3 source_shards=2"));
  assert_int_equal(hs_stop(srv[1]), 0);
}

/* Mounts a tmpfs of `kb` KiB on dir (kept in g_mount for teardown); 0, or -1
 * when this process may not mount. */
static int mount_tmpfs(const char *dir, unsigned kb) {
  char opts[64];
  snprintf(opts, sizeof opts, "size=%uk", kb);
  if (mount("tmpfs", dir, "tmpfs", 0, opts) != 0)
    return -1;
  snprintf(g_mount, sizeof g_mount, "%s", dir);
  return 0;
}

static int unmount(void **state) {
  (void)state;
  if (g_mount[0])
    umount2(g_mount, MNT_DETACH);
  g_mount[0] = '\0';
  return 0;
}

/* Shard 0 on the tmpfs at dir0, shard 1 on dir1: checkpoint 2, then `spoil`
 * makes the tmpfs refuse writes, then checkpoint 4 must fail with `words`;
 * after kill -9 both restart from 2 and train to the end like the reference. */
static void failing_disk_scenario(const char *name, void (*spoil)(const char *dir),
                                  const char *words) {
  char dir0[512], dir1[600];
  cu_dir(dir0, sizeof dir0, name);
  snprintf(dir1, sizeof dir1, "%s-1", dir0);
  mkdir(dir1, 0755);
  if (mount_tmpfs(dir0, 1024) != 0) {
    privileged_unavailable("cannot mount a tmpfs");
  }
  float *ref[CU_NT] = {0}, *got[CU_NT] = {0};
  assert_int_equal(cu_reference(2, 1, LAST, ref), 0);
  hs_server *srv[2];
  assert_non_null(srv[0] = cu_start_shard(0, 2, 0, dir0, NULL));
  assert_non_null(srv[1] = cu_start_shard(1, 2, 0, dir1, NULL));
  int port[2] = {srv[0]->port, srv[1]->port};
  char addrs[128];
  cu_addrs(srv, 2, addrs, sizeof addrs);
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(cu_train_until(&tr, 2, 0), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_OK);
  assert_int_equal(cu_train_until(&tr, 4, 0), 0);
  spoil(dir0);
  int rc = zs_checkpoint(tr.c, 0);
  fprintf(stderr, "zs_checkpoint on a %s disk: %s\n", name, zs_last_error());
  assert_int_equal(rc, ZS_EIO);
  assert_non_null(strstr(zs_last_error(), words));
  assert_non_null(strstr(zs_last_error(), "shard 0"));
  assert_non_null(strstr(zs_last_error(), "nothing was committed"));
  uint64_t step = 0;
  assert_int_equal(zs_last_checkpoint(tr.c, &step), ZS_EIO);
  assert_int_equal(step, 2);
  assert_int_equal(zs_latest_checkpoint(tr.c, &step), ZS_OK);
  assert_int_equal(step, 2);
  char tmp[700];
  snprintf(tmp, sizeof tmp, "%s/step-4/.shard-0-of-2.zsc.tmp", dir0);
  assert_int_equal(access(tmp, F_OK), -1);
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    cu_kill9(srv[i]);
  assert_non_null(srv[0] = cu_start_shard(0, 2, port[0], dir0, NULL));
  assert_non_null(srv[1] = cu_start_shard(1, 2, port[1], dir1, NULL));
  for (uint32_t i = 0; i < 2; i++)
    assert_true(cu_file_has(srv[i]->log_path, "step=2 source_shards=2"));
  assert_int_equal(cu_trainer_init(&tr, addrs, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_current_step(tr.c), 3);
  assert_int_equal(cu_train_until(&tr, LAST, 0), 0);
  assert_int_equal(cu_final(&tr, got), 0);
  assert_true(cu_same(ref, got));
  cu_trainer_free(&tr);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(hs_stop(srv[i]), 0);
  cu_free_params(ref);
  cu_free_params(got);
}

/* Leaves one free page: the next shard file (two pages or more) cannot fit. */
static void fill_up(const char *dir) {
  struct statvfs vs;
  assert_int_equal(statvfs(dir, &vs), 0);
  unsigned long used_kb = (unsigned long)((vs.f_blocks - vs.f_bfree) * vs.f_frsize / 1024);
  char opts[64];
  snprintf(opts, sizeof opts, "size=%luk", used_kb + 4);
  assert_int_equal(mount("tmpfs", dir, "tmpfs", MS_REMOUNT, opts), 0);
}

static void make_read_only(const char *dir) {
  assert_int_equal(mount("tmpfs", dir, "tmpfs", MS_REMOUNT | MS_RDONLY, NULL), 0);
}

static void full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(void **state) {
  (void)state;
  failing_disk_scenario("full", fill_up, "No space left on device");
}

static void read_only_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(void **state) {
  (void)state;
  failing_disk_scenario("readonly", make_read_only, "Read-only file system");
}

static void checkpoint_without_a_state_dir_is_refused_as_not_enabled(void **state) {
  (void)state;
  hs_server *srv[1];
  assert_non_null(srv[0] = cu_start_shard(0, 1, 0, NULL, NULL));
  cu_trainer tr;
  assert_int_equal(cu_trainer_init(&tr, srv[0]->addr, 0, 1, 0), 0);
  assert_int_equal(cu_trainer_open(&tr), 0);
  assert_int_equal(zs_checkpoint(tr.c, 0), ZS_EUNIMPL);
  assert_non_null(strstr(zs_last_error(), "--state-dir"));
  assert_int_equal(zs_restore(tr.c, 0), ZS_EUNIMPL);
  cu_trainer_free(&tr);
  assert_int_equal(hs_stop(srv[0]), 0);
}

static int group_setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(
          flipped_byte_is_refused_naming_the_file_and_training_resumes_from_the_previous),
      cmocka_unit_test(truncated_file_is_refused_naming_it),
      cmocka_unit_test_teardown(full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one,
                                unmount),
      cmocka_unit_test_teardown(
          read_only_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one, unmount),
      cmocka_unit_test(checkpoint_without_a_state_dir_is_refused_as_not_enabled),
  };
  int failures = cmocka_run_group_tests(tests, group_setup, NULL);
  unmount(NULL);
  hs_finish(failures);
  return failures;
}
