/*
 * ckpt: the checkpoint files (server/ckpt_*.c) and the core's snapshot and
 * restore (server/core/core.c), in process.
 *
 * The files are written from states filled with random bits (every element
 * distinct), so that an element landing in the wrong place, a wrong section or
 * a lost byte cannot go unnoticed. The fault tests damage real files on disk:
 * one flipped byte anywhere, a truncation at any length, a foreign file, a
 * full file system and a read-only one (tmpfs mounts, which need root;
 * without it they are skipped, and say so, outside CI and fail in CI:
 * tests/common/privileged.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/common/privileged.h"

#include "common/base/clock.h"
#include "common/base/crc32c.h"
#include "common/base/dtype.h"
#include "common/base/le.h"
#include "common/model/layout.h"
#include "common/model/spec.h"
#include "server/ckpt/ckpt.h"
#include "server/ckpt/ckpt_format.h"
#include "server/ckpt/ckpt_svc.h"
#include "server/core/core.h"

#define WAIT_MS 30000u

static char g_root[256];

/* ------------------------------------------------------------------ helpers */

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

static float rnd(uint64_t *s) {
  return ((float)(splitmix(s) >> 40) / (float)(1u << 24) * 2.0f - 1.0f);
}

/* Tensors on both sides of split threshold 256, in three groups: AdamW (m
 * and v), SGD with momentum (m only) and plain SGD (neither). */
static const struct {
  const char *name;
  uint64_t numel;
  uint32_t group, ndim;
  uint64_t shape[2];
} k_tensors[] = {
    {"embed.weight", 1300, 0, 2, {100, 13}},      {"embed.bias", 13, 2, 0, {0, 0}},
    {"mid.weight", 517, 1, 2, {11, 47}},          {"mid.bias", 47, 1, 1, {47, 0}},
    {"norm.weight", 256, 0, 1, {256, 0}},         {"head.weight", 250, 0, 2, {10, 25}},
    {"head \"quoted\" \\ name", 9, 2, 0, {0, 0}},
};
#define K_NT (sizeof k_tensors / sizeof k_tensors[0])

static void build_spec(spec *s, const char *job, uint32_t N) {
  memset(s, 0, sizeof *s);
  s->job = strdup(job);
  s->num_groups = 3;
  s->groups = calloc(3, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s->groups[1], ZS_OPTIM_SGD);
  s->groups[1].momentum = 0.9;
  spec_group_defaults(&s->groups[2], ZS_OPTIM_SGD);
  s->num_tensors = K_NT;
  s->tensors = calloc(K_NT, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t t = 0; t < K_NT; t++) {
    s->tensors[t].name = strdup(k_tensors[t].name);
    s->tensors[t].numel = k_tensors[t].numel;
    s->tensors[t].group = k_tensors[t].group;
    s->tensors[t].ndim = k_tensors[t].ndim;
    s->tensors[t].shape[0] = k_tensors[t].shape[0];
    s->tensors[t].shape[1] = k_tensors[t].shape[1];
  }
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = N;
  s->split_threshold = 256;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256];
  assert_int_equal(spec_validate(s, err, sizeof err), 0);
}

/* Whole tensors: values[a][t] for arrays master, m, v (m, v NULL for the
 * tensors whose group does not use them). */
typedef struct model {
  float *values[3][K_NT];
} model;

static void model_random(model *md, uint64_t seed) {
  memset(md, 0, sizeof *md);
  for (int a = 0; a < 3; a++) {
    for (uint32_t t = 0; t < K_NT; t++) {
      uint32_t g = k_tensors[t].group;
      if ((a == 1 && g == 2) || (a == 2 && g != 0))
        continue;
      md->values[a][t] = malloc(k_tensors[t].numel * sizeof(float));
      for (uint64_t i = 0; i < k_tensors[t].numel; i++)
        md->values[a][t][i] = rnd(&seed);
    }
  }
}

static void model_free(model *md) {
  for (int a = 0; a < 3; a++)
    for (uint32_t t = 0; t < K_NT; t++)
      free(md->values[a][t]);
}

/* The state of shard i of spec s holding md (padding left zero). */
static void state_from_model(core_state *st, const spec *s, uint32_t shard, const model *md,
                             uint64_t version, uint64_t opt_steps) {
  char err[256];
  assert_int_equal(core_state_init(st, s, shard, err, sizeof err), 0);
  layout l;
  assert_int_equal(layout_build(s, &l), 0);
  float *dst[3] = {st->master, st->m, st->v};
  for (uint32_t i = 0; i < l.num_pieces; i++) {
    const layout_piece *p = &l.pieces[i];
    if (p->shard != shard)
      continue;
    for (int a = 0; a < 3; a++)
      if (dst[a] && md->values[a][p->tensor])
        memcpy(dst[a] + p->arena_off, md->values[a][p->tensor] + p->offset,
               p->numel * sizeof(float));
  }
  layout_free(&l);
  st->version = version;
  st->optimizer_steps = opt_steps;
}

/* Checks that the states of all shards of spec s, put together, are md. */
static void assert_states_hold(core_state *sts, const spec *s, const model *md) {
  layout l;
  assert_int_equal(layout_build(s, &l), 0);
  for (uint32_t i = 0; i < l.num_pieces; i++) {
    const layout_piece *p = &l.pieces[i];
    const core_state *st = &sts[p->shard];
    const float *src[3] = {st->master, st->m, st->v};
    for (int a = 0; a < 3; a++) {
      if (!md->values[a][p->tensor])
        continue;
      assert_non_null(src[a]);
      assert_memory_equal(src[a] + p->arena_off, md->values[a][p->tensor] + p->offset,
                          p->numel * sizeof(float));
    }
  }
  layout_free(&l);
}

/* Writes every shard of md at `step` under root and commits the manifest. */
static void write_checkpoint(const char *root, const spec *s, const model *md, uint64_t step,
                             int commit) {
  char err[512];
  ckpt_manifest m = {.step = step,
                     .version = step,
                     .optimizer_steps = step - 1,
                     .spec_hash = spec_hash(s),
                     .num_shards = s->num_shards};
  m.files = calloc(s->num_shards, sizeof *m.files);
  for (uint32_t i = 0; i < s->num_shards; i++) {
    core_state st;
    state_from_model(&st, s, i, md, step, step - 1);
    int rc = ckpt_write_shard(root, &st, NULL, &m.files[i], err, sizeof err);
    if (rc)
      fprintf(stderr, "write: %s\n", err);
    assert_int_equal(rc, 0);
    core_state_free(&st);
  }
  if (commit) {
    int rc = ckpt_manifest_write(root, &m, 0, err, sizeof err);
    if (rc)
      fprintf(stderr, "manifest: %s\n", err);
    assert_int_equal(rc, 0);
  }
  ckpt_manifest_free(&m);
}

static void load_all(const char *root, uint64_t step, uint32_t N, core_state *sts) {
  char err[512];
  for (uint32_t i = 0; i < N; i++) {
    int rc = ckpt_load(root, step, i, N, &sts[i], err, sizeof err);
    if (rc)
      fprintf(stderr, "load shard %u of %u: %s\n", i, N, err);
    assert_int_equal(rc, 0);
  }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

/* A fresh directory under the test's root for one test. */
static void fresh_dir(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "%s/%s", g_root, name);
  nftw(buf, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  assert_int_equal(mkdir(buf, 0755), 0);
}

static void shard_path(char *buf, size_t len, const char *root, uint64_t step, uint32_t i,
                       uint32_t n) {
  char name[CKPT_NAME_MAX];
  ckpt_file_name(i, n, name, sizeof name);
  snprintf(buf, len, "%s/step-%" PRIu64 "/%s", root, step, name);
}

static uint64_t file_size(const char *path) {
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  return (uint64_t)sb.st_size;
}

static void copy_file(const char *from, const char *to) {
  FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
  assert_non_null(a);
  assert_non_null(b);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, a)) > 0)
    assert_int_equal(fwrite(buf, 1, n, b), n);
  fclose(a);
  fclose(b);
}

static void flip_byte(const char *path, uint64_t off) {
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  uint8_t b;
  assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
  b ^= 0x20;
  assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
  close(fd);
}

/* ------------------------------------------------------------------ files */

/* The bytes of the files of a fixed state, pinned by their size and CRC32C:
 * the group part of the spec and optimizer sections is written from
 * SPEC_GROUP_FIELDS and the moment sections from optim_state_needs, and
 * neither may change a byte of a file that older servers wrote. The values
 * are those of the hand-written encoders that list replaced. */
static void file_bytes_of_a_fixed_state_are_pinned(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "pinned");
  spec s;
  build_spec(&s, "pinned", 2);
  s.groups[0].lr_scale = 0.5;
  s.groups[1].nesterov = 1;
  s.groups[2].bias_correction = 0;
  model md;
  model_random(&md, 7);
  const uint64_t want_bytes[2] = {17088, 14848};
  const uint32_t want_crc[2] = {0xd41505e1, 0x058edd42};
  for (uint32_t i = 0; i < 2; i++) {
    core_state st;
    ckpt_file_info fi;
    state_from_model(&st, &s, i, &md, 3, 2);
    assert_int_equal(ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err), 0);
    assert_int_equal(fi.bytes, want_bytes[i]);
    assert_int_equal(fi.crc32c, want_crc[i]);
    core_state_free(&st);
  }
  model_free(&md);
  spec_free(&s);
}

static void written_checkpoint_loads_back_bit_for_bit(void **state) {
  (void)state;
  char root[512];
  fresh_dir(root, sizeof root, "roundtrip");
  spec s;
  build_spec(&s, "roundtrip", 2);
  model md;
  model_random(&md, 1);
  write_checkpoint(root, &s, &md, 7, 1);
  core_state sts[2];
  load_all(root, 7, 2, sts);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(sts[i].version, 7);
    assert_int_equal(sts[i].optimizer_steps, 6);
    assert_int_equal(spec_hash(&sts[i].spec), spec_hash(&s));
    /* Padding and all: the arenas equal the written ones. */
    core_state orig;
    state_from_model(&orig, &s, i, &md, 7, 6);
    assert_int_equal(sts[i].nelems, orig.nelems);
    assert_memory_equal(sts[i].master, orig.master, orig.nelems * sizeof(float));
    assert_memory_equal(sts[i].m, orig.m, orig.nelems * sizeof(float));
    if (orig.v)
      assert_memory_equal(sts[i].v, orig.v, orig.nelems * sizeof(float));
    core_state_free(&orig);
  }
  assert_states_hold(sts, &s, &md);
  for (uint32_t i = 0; i < 2; i++)
    core_state_free(&sts[i]);
  model_free(&md);
  spec_free(&s);
}

/* A checkpoint written before issue 26 carries the spec hash with the world
 * size in it (spec_hash_legacy) in its headers and manifest: made here by
 * rewriting a new one's hash fields (and their CRCs), it still loads, and
 * the state it gives has today's hash. */
static void a_checkpoint_with_the_hash_before_issue_26_still_loads(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "legacy");
  spec s;
  build_spec(&s, "legacy", 2);
  model md;
  model_random(&md, 3);
  const uint64_t legacy = spec_hash_legacy(&s);
  assert_true(legacy != spec_hash(&s));
  ckpt_manifest m = {
      .step = 4, .version = 4, .optimizer_steps = 3, .spec_hash = legacy, .num_shards = 2};
  m.files = calloc(2, sizeof *m.files);
  for (uint32_t i = 0; i < 2; i++) {
    core_state st;
    state_from_model(&st, &s, i, &md, 4, 3);
    assert_int_equal(ckpt_write_shard(root, &st, NULL, &m.files[i], err, sizeof err), 0);
    core_state_free(&st);
    char path[600];
    shard_path(path, sizeof path, root, 4, i, 2);
    uint64_t n = file_size(path);
    unsigned char *buf = malloc(n);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fread(buf, 1, n, f), n);
    le_store64(buf + 24, legacy);
    le_store32(buf + 124, crc32c(0, buf, 124));
    rewind(f);
    assert_int_equal(fwrite(buf, 1, n, f), n);
    fclose(f);
    m.files[i].crc32c = crc32c(0, buf, n);
    free(buf);
  }
  assert_int_equal(ckpt_manifest_write(root, &m, 0, err, sizeof err), 0);
  ckpt_manifest_free(&m);
  core_state sts[2];
  load_all(root, 4, 2, sts);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(sts[i].version, 4);
    assert_true(spec_hash(&sts[i].spec) == spec_hash(&s));
    core_state_free(&sts[i]);
  }
  model_free(&md);
  spec_free(&s);
}

static void checkpoint_without_manifest_is_never_loaded(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "nomanifest");
  spec s;
  build_spec(&s, "nomanifest", 2);
  model md;
  model_random(&md, 2);
  write_checkpoint(root, &s, &md, 3, 1);
  write_checkpoint(root, &s, &md, 4, 0);
  core_state st;
  assert_int_equal(ckpt_load(root, 4, 0, 2, &st, err, sizeof err), ZS_ENOTFOUND);
  assert_non_null(strstr(err, "not complete"));
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 2);
  assert_int_equal(e[0].step, 3);
  assert_true(e[0].complete);
  assert_int_equal(e[0].num_shards, 2);
  assert_int_equal(e[0].spec_hash, spec_hash(&s));
  assert_int_equal(e[1].step, 4);
  assert_false(e[1].complete);
  free(e);
  model_free(&md);
  spec_free(&s);
}

/* A FIFO named like a checkpoint file or MANIFEST hung open() and
 * with it startup, deaf to SIGTERM. Each is refused at once, as not a
 * regular file, and the rest of the directory stays usable. */
static void fifos_named_like_state_files_are_refused_without_blocking(void **state) {
  (void)state;
  char root[512], err[512], path[700];
  fresh_dir(root, sizeof root, "fifos");
  spec s;
  build_spec(&s, "fifos", 2);
  model md;
  model_random(&md, 5);
  write_checkpoint(root, &s, &md, 2, 1);
  write_checkpoint(root, &s, &md, 3, 1);
  /* Step 3's first file becomes a FIFO, step 4's MANIFEST is one. */
  shard_path(path, sizeof path, root, 3, 0, 2);
  assert_int_equal(unlink(path), 0);
  assert_int_equal(mkfifo(path, 0644), 0);
  snprintf(path, sizeof path, "%s/step-4", root);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/step-4/%s", root, CKPT_MANIFEST);
  assert_int_equal(mkfifo(path, 0644), 0);

  core_state st;
  assert_int_equal(ckpt_load(root, 3, 0, 2, &st, err, sizeof err), ZS_EIO);
  assert_non_null(strstr(err, "not a regular file"));
  ckpt_manifest m;
  assert_int_equal(ckpt_manifest_read(root, 4, &m, err, sizeof err), ZS_EIO);
  assert_non_null(strstr(err, "not a regular file"));
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 3);
  assert_true(e[0].complete);
  assert_false(e[2].complete);
  free(e);
  assert_int_equal(ckpt_load(root, 2, 0, 2, &st, err, sizeof err), 0);
  core_state_free(&st);
  /* Exporting the step with the FIFO is refused the same way. */
  snprintf(path, sizeof path, "%s/out.safetensors", root);
  assert_int_not_equal(ckpt_export_safetensors(root, 3, path, NULL, err, sizeof err), 0);
  assert_non_null(strstr(err, "not a regular file"));
  model_free(&md);
  spec_free(&s);
}

/* One pass of the confinement checks: a link to `outside` as the checkpoint
 * directory, as a step directory, and as a MANIFEST. */
static void confined_links_refused_once(const char *root, const char *outside) {
  char err[512], path[700], target[700];
  ckpt_entry *e;
  size_t n;
  core_state st;
  /* root/lnk -> outside: nothing below it is listed, loaded or created. */
  snprintf(path, sizeof path, "%s/lnk", root);
  assert_int_equal(ckpt_list(path, &e, &n, err, sizeof err), ZS_EPERM);
  assert_non_null(strstr(err, "symbolic link"));
  assert_int_equal(ckpt_load(path, 1, 0, 1, &st, err, sizeof err), ZS_EPERM);
  snprintf(path, sizeof path, "%s/lnk/sub", root);
  assert_int_equal(ckpt_mkdirs(path, err, sizeof err), ZS_EPERM);
  snprintf(target, sizeof target, "%s/sub", outside);
  assert_int_equal(access(target, F_OK), -1);
  /* root/step-7 -> outside/step-1: not listed, not removed through. */
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 1); /* root's own step-1 */
  free(e);
  assert_int_not_equal(ckpt_remove(root, 7, err, sizeof err), 0);
  snprintf(target, sizeof target, "%s/step-1/%s", outside, CKPT_MANIFEST);
  assert_int_equal(access(target, F_OK), 0);
  /* root/m/step-1/MANIFEST -> outside's: incomplete, not loaded. */
  snprintf(path, sizeof path, "%s/m", root);
  ckpt_manifest m;
  assert_int_equal(ckpt_manifest_read(path, 1, &m, err, sizeof err), ZS_EPERM);
  assert_int_equal(ckpt_list(path, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 1);
  assert_false(e[0].complete);
  free(e);
}

static void links_below_a_confined_root_are_never_followed(void **state) {
  (void)state;
  char base[512], root[600], outside[600], path[700], target[700];
  fresh_dir(base, sizeof base, "confined");
  snprintf(root, sizeof root, "%s/state", base);
  snprintf(outside, sizeof outside, "%s/outside", base);
  assert_int_equal(mkdir(root, 0755), 0);
  spec s;
  build_spec(&s, "confined", 1);
  model md;
  model_random(&md, 9);
  write_checkpoint(outside, &s, &md, 1, 1);
  write_checkpoint(root, &s, &md, 1, 1);
  snprintf(path, sizeof path, "%s/lnk", root);
  assert_int_equal(symlink(outside, path), 0);
  snprintf(path, sizeof path, "%s/step-7", root);
  snprintf(target, sizeof target, "%s/step-1", outside);
  assert_int_equal(symlink(target, path), 0);
  snprintf(path, sizeof path, "%s/m/step-1", root);
  char err[512];
  assert_int_equal(ckpt_mkdirs(path, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/m/step-1/%s", root, CKPT_MANIFEST);
  snprintf(target, sizeof target, "%s/step-1/%s", outside, CKPT_MANIFEST);
  assert_int_equal(symlink(target, path), 0);

  /* Unconfined, the links are followed (the CLI's offline commands). */
  snprintf(path, sizeof path, "%s/lnk", root);
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(path, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 1);
  free(e);

  assert_int_equal(ckpt_fs_confine(root, err, sizeof err), 0);
  confined_links_refused_once(root, outside);
  /* The same without openat2, as on kernels before 5.6. */
  ckpt__fs_force_component_walk(1);
  confined_links_refused_once(root, outside);
  /* Real checkpoints below the root still load either way. */
  core_state st;
  assert_int_equal(ckpt_load(root, 1, 0, 1, &st, err, sizeof err), 0);
  core_state_free(&st);
  ckpt__fs_force_component_walk(0);
  assert_int_equal(ckpt_load(root, 1, 0, 1, &st, err, sizeof err), 0);
  core_state_free(&st);
  ckpt_fs_release(root);
  model_free(&md);
  spec_free(&s);
}

static void listing_orders_steps_numerically_and_ignores_other_names(void **state) {
  (void)state;
  char root[512], path[600], err[512];
  fresh_dir(root, sizeof root, "listing");
  spec s;
  build_spec(&s, "listing", 1);
  model md;
  model_random(&md, 3);
  write_checkpoint(root, &s, &md, 10, 1);
  write_checkpoint(root, &s, &md, 9, 1);
  const char *junk[] = {"step-010", "step-", "step-x", "steps-3", "step-99999999999999999999"};
  for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++) {
    snprintf(path, sizeof path, "%s/%s", root, junk[i]);
    assert_int_equal(mkdir(path, 0755), 0);
  }
  snprintf(path, sizeof path, "%s/step-11", root); /* a file, not a directory */
  FILE *f = fopen(path, "w");
  fclose(f);
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 2);
  assert_int_equal(e[0].step, 9);
  assert_int_equal(e[1].step, 10);
  free(e);
  /* A missing root is an empty list, not an error. */
  snprintf(path, sizeof path, "%s/absent", root);
  assert_int_equal(ckpt_list(path, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 0);
  model_free(&md);
  spec_free(&s);
}

static void reshard_two_to_three_and_back_keeps_every_element(void **state) {
  (void)state;
  char a[512], b[512], c[512], err[512];
  fresh_dir(a, sizeof a, "reshard-a");
  fresh_dir(b, sizeof b, "reshard-b");
  fresh_dir(c, sizeof c, "reshard-c");
  spec s2, s3;
  build_spec(&s2, "reshard", 2);
  build_spec(&s3, "reshard", 3);
  model md;
  model_random(&md, 4);
  write_checkpoint(a, &s2, &md, 12, 1);

  /* 2 -> 3: each new shard reads the old files' overlapping pieces. */
  core_state st3[3];
  load_all(a, 12, 3, st3);
  assert_states_hold(st3, &s3, &md);
  ckpt_manifest m = {.step = 12, .version = 12, .spec_hash = spec_hash(&s3), .num_shards = 3};
  m.optimizer_steps = st3[0].optimizer_steps;
  m.files = calloc(3, sizeof *m.files);
  for (uint32_t i = 0; i < 3; i++) {
    assert_int_equal(st3[i].version, 12);
    assert_int_equal(spec_hash(&st3[i].spec), spec_hash(&s3));
    assert_int_equal(ckpt_write_shard(b, &st3[i], NULL, &m.files[i], err, sizeof err), 0);
  }
  assert_int_equal(ckpt_manifest_write(b, &m, 0, err, sizeof err), 0);
  ckpt_manifest_free(&m);

  /* 3 -> 2: the result equals the original 2-shard states bit for bit. */
  core_state st2[2];
  load_all(b, 12, 2, st2);
  for (uint32_t i = 0; i < 2; i++) {
    core_state orig;
    state_from_model(&orig, &s2, i, &md, 12, 11);
    assert_int_equal(st2[i].nelems, orig.nelems);
    assert_memory_equal(st2[i].master, orig.master, orig.nelems * sizeof(float));
    assert_memory_equal(st2[i].m, orig.m, orig.nelems * sizeof(float));
    assert_int_equal(st2[i].optimizer_steps, 11);
    core_state_free(&orig);
    core_state_free(&st2[i]);
  }
  /* 2 -> 1 and 2 -> 5 as well: any N' works. */
  core_state st1;
  assert_int_equal(ckpt_load(a, 12, 0, 1, &st1, err, sizeof err), 0);
  spec s1;
  build_spec(&s1, "reshard", 1);
  assert_states_hold(&st1, &s1, &md);
  core_state_free(&st1);
  spec_free(&s1);
  core_state st5[5];
  load_all(a, 12, 5, st5);
  spec s5;
  build_spec(&s5, "reshard", 5);
  assert_states_hold(st5, &s5, &md);
  for (uint32_t i = 0; i < 5; i++)
    core_state_free(&st5[i]);
  spec_free(&s5);

  /* A file the new shard needs is missing: named, nothing loaded. */
  char path[600];
  shard_path(path, sizeof path, a, 12, 1, 2);
  assert_int_equal(unlink(path), 0);
  core_state st;
  int rc = ckpt_load(a, 12, 2, 3, &st, err, sizeof err);
  assert_int_equal(rc, ZS_ENOTFOUND);
  assert_non_null(strstr(err, "shard-1-of-2.zsc"));
  (void)c;
  for (uint32_t i = 0; i < 3; i++)
    core_state_free(&st3[i]);
  model_free(&md);
  spec_free(&s2);
  spec_free(&s3);
}

/* The section count in a shard file's header. */
static uint32_t file_sections(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  uint8_t h[60];
  assert_int_equal(fread(h, 1, sizeof h, f), sizeof h);
  fclose(f);
  return le_load32(h + 56);
}

static void client_state_travels_with_the_files_and_files_without_it_still_load(void **state) {
  (void)state;
  char with[512], without[512], err[512];
  fresh_dir(with, sizeof with, "cs-with");
  fresh_dir(without, sizeof without, "cs-without");
  spec s2;
  build_spec(&s2, "client-state", 2);
  model md;
  model_random(&md, 5);
  uint8_t blob[CORE_MAX_CLIENT_STATE];
  for (size_t k = 0; k < sizeof blob; k++)
    blob[k] = (uint8_t)(k * 13 + 1);
  /* Every shard keeps the same state; the files carry it in a section of
   * their own. */
  write_checkpoint(without, &s2, &md, 6, 1);
  ckpt_manifest m = {
      .step = 6, .version = 6, .optimizer_steps = 5, .spec_hash = spec_hash(&s2), .num_shards = 2};
  m.files = calloc(2, sizeof *m.files);
  for (uint32_t i = 0; i < 2; i++) {
    core_state st;
    state_from_model(&st, &s2, i, &md, 6, 5);
    st.client_state = malloc(sizeof blob + 1);
    memcpy(st.client_state, blob, sizeof blob);
    st.client_state_len = sizeof blob + 1; /* one byte too many */
    ckpt_file_info fi;
    assert_int_equal(ckpt_write_shard(with, &st, NULL, &fi, err, sizeof err), ZS_EINVAL);
    st.client_state_len = sizeof blob;
    assert_int_equal(ckpt_write_shard(with, &st, NULL, &m.files[i], err, sizeof err), 0);
    core_state_free(&st);
  }
  assert_int_equal(ckpt_manifest_write(with, &m, 0, err, sizeof err), 0);
  ckpt_manifest_free(&m);
  char pw[600], po[600];
  shard_path(pw, sizeof pw, with, 6, 0, 2);
  shard_path(po, sizeof po, without, 6, 0, 2);
  assert_int_equal(file_sections(pw), file_sections(po) + 1);

  /* Same shard count, and resharded to 3 (from the first file). */
  core_state st2[2], st3[3];
  load_all(with, 6, 2, st2);
  load_all(with, 6, 3, st3);
  for (uint32_t i = 0; i < 5; i++) {
    core_state *st = i < 2 ? &st2[i] : &st3[i - 2];
    assert_int_equal(st->client_state_len, sizeof blob);
    assert_memory_equal(st->client_state, blob, sizeof blob);
    core_state_free(st);
  }
  /* A file without the section (as every file before it existed) loads with
   * no client state. */
  load_all(without, 6, 2, st2);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(st2[i].client_state_len, 0);
    assert_null(st2[i].client_state);
    core_state_free(&st2[i]);
  }
  model_free(&md);
  spec_free(&s2);
}

/* The count of tensor t in the per-tensor test below: some at the job's 5,
 * some below (parameters that went without a gradient). */
static uint64_t steps_of(uint32_t t) {
  return 5 - t % 3;
}

/* Every tensor with a piece on shard `shard` of spec s has steps_of(t). */
static void assert_tensor_steps(const core_state *st, const spec *s, uint32_t shard) {
  layout l;
  assert_int_equal(layout_build(s, &l), 0);
  assert_non_null(st->tensor_steps);
  for (uint32_t i = 0; i < l.num_pieces; i++)
    if (l.pieces[i].shard == shard)
      assert_int_equal(st->tensor_steps[l.pieces[i].tensor], steps_of(l.pieces[i].tensor));
  layout_free(&l);
}

static void tensor_step_counts_travel_with_the_files_and_old_files_give_the_jobs(void **state) {
  (void)state;
  char with[512], without[512], same[512], err[512];
  fresh_dir(with, sizeof with, "ts-with");
  fresh_dir(without, sizeof without, "ts-without");
  fresh_dir(same, sizeof same, "ts-same");
  spec s2, s3;
  build_spec(&s2, "tensor-steps", 2);
  build_spec(&s3, "tensor-steps", 3);
  model md;
  model_random(&md, 6);
  /* A file from before the counts: no section (write_checkpoint passes
   * none), as one whose counts all equal the job's. */
  write_checkpoint(without, &s2, &md, 6, 1);
  const char *roots[2] = {with, same};
  for (int r = 0; r < 2; r++) {
    ckpt_manifest m = {.step = 6,
                       .version = 6,
                       .optimizer_steps = 5,
                       .spec_hash = spec_hash(&s2),
                       .num_shards = 2};
    m.files = calloc(2, sizeof *m.files);
    for (uint32_t i = 0; i < 2; i++) {
      core_state st;
      state_from_model(&st, &s2, i, &md, 6, 5);
      st.tensor_steps = calloc(K_NT, sizeof *st.tensor_steps);
      for (uint32_t t = 0; t < K_NT; t++)
        st.tensor_steps[t] = r == 0 ? steps_of(t) : 5;
      assert_int_equal(ckpt_write_shard(roots[r], &st, NULL, &m.files[i], err, sizeof err), 0);
      core_state_free(&st);
    }
    assert_int_equal(ckpt_manifest_write(roots[r], &m, 0, err, sizeof err), 0);
    ckpt_manifest_free(&m);
  }
  char pw[600], po[600], ps[600];
  shard_path(pw, sizeof pw, with, 6, 0, 2);
  shard_path(po, sizeof po, without, 6, 0, 2);
  shard_path(ps, sizeof ps, same, 6, 0, 2);
  assert_int_equal(file_sections(pw), file_sections(po) + 1);
  assert_int_equal(file_sections(ps), file_sections(po));
  assert_int_equal(file_size(ps), file_size(po));

  /* Same shard count, and resharded to 3: every shard has its tensors'
   * counts, each from the old file that held the tensor. */
  core_state st2[2], st3[3];
  load_all(with, 6, 2, st2);
  load_all(with, 6, 3, st3);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(st2[i].optimizer_steps, 5);
    assert_tensor_steps(&st2[i], &s2, i);
    core_state_free(&st2[i]);
  }
  for (uint32_t i = 0; i < 3; i++) {
    assert_tensor_steps(&st3[i], &s3, i);
    core_state_free(&st3[i]);
  }
  /* A file without the section loads with every tensor at the job's count. */
  load_all(without, 6, 2, st2);
  for (uint32_t i = 0; i < 2; i++) {
    assert_non_null(st2[i].tensor_steps);
    for (uint32_t t = 0; t < K_NT; t++)
      assert_int_equal(st2[i].tensor_steps[t], 5);
    core_state_free(&st2[i]);
  }
  model_free(&md);
  spec_free(&s2);
  spec_free(&s3);
}

/* Every damaged copy of `good` at `path` must be refused, with the path in
 * the message, by ckpt_load (manifest bound) and by a reader without the
 * manifest's size and CRC. */
static void expect_refused(const char *root, uint64_t step, const char *path, const char *what) {
  char err[512] = "";
  core_state st;
  int rc = ckpt_load(root, step, 0, 1, &st, err, sizeof err);
  if (rc == 0)
    fprintf(stderr, "%s was loaded\n", what);
  assert_int_not_equal(rc, 0);
  if (!strstr(err, path))
    fprintf(stderr, "%s: message does not name the file: %s\n", what, err);
  assert_non_null(strstr(err, path));
  ckpt_reader *r = NULL;
  rc = ckpt_reader_open(path, NULL, &r, err, sizeof err);
  if (rc == 0)
    fprintf(stderr, "%s was accepted by a reader without the manifest\n", what);
  assert_int_not_equal(rc, 0);
  assert_null(r);
  assert_non_null(strstr(err, path));
}

static void one_flipped_byte_anywhere_is_refused_naming_the_file(void **state) {
  (void)state;
  char root[512], path[600], good[600];
  fresh_dir(root, sizeof root, "corrupt");
  spec s;
  build_spec(&s, "corrupt", 1);
  model md;
  model_random(&md, 5);
  write_checkpoint(root, &s, &md, 2, 1);
  shard_path(path, sizeof path, root, 2, 0, 1);
  snprintf(good, sizeof good, "%s/good.zsc", root);
  copy_file(path, good);
  uint64_t size = file_size(path);
  /* Every byte of the header and the table, then a stride through the rest
   * that visits every section and padding run, then the last byte. */
  int tried = 0;
  for (uint64_t off = 0; off < size; off += off < 512 ? 1 : 61) {
    flip_byte(path, off);
    char what[64];
    snprintf(what, sizeof what, "byte %" PRIu64 " flipped", off);
    expect_refused(root, 2, path, what);
    copy_file(good, path);
    tried++;
  }
  flip_byte(path, size - 1);
  expect_refused(root, 2, path, "last byte flipped");
  copy_file(good, path);
  assert_true(tried > 600);
  /* The intact file still loads. */
  core_state st;
  char err[512];
  assert_int_equal(ckpt_load(root, 2, 0, 1, &st, err, sizeof err), 0);
  core_state_free(&st);
  model_free(&md);
  spec_free(&s);
}

static void truncated_file_is_refused_at_any_length(void **state) {
  (void)state;
  char root[512], path[600], good[600];
  fresh_dir(root, sizeof root, "truncated");
  spec s;
  build_spec(&s, "truncated", 1);
  model md;
  model_random(&md, 6);
  write_checkpoint(root, &s, &md, 2, 1);
  shard_path(path, sizeof path, root, 2, 0, 1);
  snprintf(good, sizeof good, "%s/good.zsc", root);
  copy_file(path, good);
  uint64_t size = file_size(path);
  uint64_t lens[] = {0, 1, 64, 127, 128, 129, 200, 400, size / 2, size - 4, size - 1};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    assert_int_equal(truncate(path, (off_t)lens[i]), 0);
    char what[64];
    snprintf(what, sizeof what, "truncated to %" PRIu64, lens[i]);
    expect_refused(root, 2, path, what);
    copy_file(good, path);
  }
  /* And a file that grew: trailing bytes are refused too. */
  FILE *f = fopen(path, "ab");
  fputs("junk", f);
  fclose(f);
  expect_refused(root, 2, path, "4 bytes appended");
  model_free(&md);
  spec_free(&s);
}

static void file_of_another_job_or_step_is_refused(void **state) {
  (void)state;
  char a[512], b[512], path_a[600], path_b[600], err[512];
  fresh_dir(a, sizeof a, "foreign-a");
  fresh_dir(b, sizeof b, "foreign-b");
  spec sa, sb;
  build_spec(&sa, "job-a", 1);
  build_spec(&sb, "job-b", 1);
  model md;
  model_random(&md, 7);
  write_checkpoint(a, &sa, &md, 5, 1);
  write_checkpoint(b, &sb, &md, 5, 1);
  shard_path(path_a, sizeof path_a, a, 5, 0, 1);
  shard_path(path_b, sizeof path_b, b, 5, 0, 1);
  /* Job b's file in job a's checkpoint: the manifest does not vouch for it. */
  copy_file(path_b, path_a);
  core_state st;
  assert_int_not_equal(ckpt_load(a, 5, 0, 1, &st, err, sizeof err), 0);
  assert_non_null(strstr(err, path_a));
  /* A manifest edited to match the foreign file still fails on the header. */
  ckpt_manifest m;
  assert_int_equal(ckpt_manifest_read(a, 5, &m, err, sizeof err), 0);
  ckpt_reader *r;
  assert_int_equal(ckpt_reader_open(path_a, NULL, &r, err, sizeof err), 0);
  assert_string_equal(ckpt_reader_spec(r)->job, "job-b");
  ckpt_reader_close(r);
  m.files[0].bytes = file_size(path_a);
  ckpt_manifest mb;
  assert_int_equal(ckpt_manifest_read(b, 5, &mb, err, sizeof err), 0);
  m.files[0].crc32c = mb.files[0].crc32c;
  ckpt_manifest_free(&mb);
  assert_int_equal(ckpt_manifest_write(a, &m, 0, err, sizeof err), 0);
  ckpt_manifest_free(&m);
  assert_int_equal(ckpt_load(a, 5, 0, 1, &st, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "disagrees with the manifest"));
  assert_non_null(strstr(err, path_a));
  model_free(&md);
  spec_free(&sa);
  spec_free(&sb);
}

static void damaged_manifest_makes_the_checkpoint_incomplete(void **state) {
  (void)state;
  char root[512], path[600], err[512];
  fresh_dir(root, sizeof root, "badmanifest");
  spec s;
  build_spec(&s, "badmanifest", 2);
  model md;
  model_random(&md, 8);
  write_checkpoint(root, &s, &md, 1, 1);
  snprintf(path, sizeof path, "%s/step-1/MANIFEST", root);
  flip_byte(path, 40);
  ckpt_manifest m;
  int rc = ckpt_manifest_read(root, 1, &m, err, sizeof err);
  assert_true(rc == ZS_ECRC || rc == ZS_EPROTO);
  assert_non_null(strstr(err, path));
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 1);
  assert_false(e[0].complete);
  free(e);
  core_state st;
  assert_int_not_equal(ckpt_load(root, 1, 0, 2, &st, err, sizeof err), 0);
  model_free(&md);
  spec_free(&s);
}

static void rewriting_a_step_uncommits_it_first(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "rewrite");
  spec s;
  build_spec(&s, "rewrite", 2);
  model md;
  model_random(&md, 9);
  write_checkpoint(root, &s, &md, 6, 1);
  core_state st;
  state_from_model(&st, &s, 1, &md, 6, 5);
  ckpt_file_info fi;
  assert_int_equal(ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err), 0);
  core_state_free(&st);
  ckpt_manifest m;
  assert_int_equal(ckpt_manifest_read(root, 6, &m, err, sizeof err), ZS_ENOTFOUND);
  /* Removal takes the whole step. */
  assert_int_equal(ckpt_remove(root, 6, err, sizeof err), 0);
  ckpt_entry *e;
  size_t n;
  assert_int_equal(ckpt_list(root, &e, &n, err, sizeof err), 0);
  assert_int_equal(n, 0);
  free(e);
  model_free(&md);
  spec_free(&s);
}

/* Mounts a tmpfs of `kb` KiB at dir; 0, or -1 when this process may not. */
static int mount_tmpfs(const char *dir, unsigned kb) {
  char opts[64];
  snprintf(opts, sizeof opts, "size=%uk", kb);
  return mount("tmpfs", dir, "tmpfs", 0, opts);
}

static void full_disk_fails_clearly_and_keeps_the_previous_checkpoint(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "full");
  spec s;
  build_spec(&s, "full", 1);
  core_state probe;
  assert_int_equal(core_state_init(&probe, &s, 0, err, sizeof err), 0);
  uint64_t one = probe.nelems * 12u + 8192u;
  core_state_free(&probe);
  /* Room for one checkpoint and a half. */
  if (mount_tmpfs(root, (unsigned)((one * 3 / 2) / 1024 + 8)) != 0) {
    spec_free(&s);
    privileged_unavailable("cannot mount a tmpfs");
  }
  model md;
  model_random(&md, 10);
  write_checkpoint(root, &s, &md, 1, 1);
  core_state st;
  state_from_model(&st, &s, 0, &md, 2, 1);
  ckpt_file_info fi;
  int rc = ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err);
  core_state_free(&st);
  assert_int_equal(rc, ZS_EIO);
  assert_non_null(strstr(err, "No space left on device"));
  assert_non_null(strstr(err, "step-2"));
  /* Nothing of the failed write is left; the previous one loads. */
  char tmp[600];
  snprintf(tmp, sizeof tmp, "%s/step-2/.shard-0-of-1.zsc.tmp", root);
  assert_int_equal(access(tmp, F_OK), -1);
  core_state back;
  assert_int_equal(ckpt_load(root, 1, 0, 1, &back, err, sizeof err), 0);
  assert_states_hold(&back, &s, &md);
  core_state_free(&back);
  assert_int_equal(umount2(root, MNT_DETACH), 0);
  model_free(&md);
  spec_free(&s);
}

static void read_only_directory_fails_clearly_and_keeps_the_previous_checkpoint(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "readonly");
  if (mount_tmpfs(root, 1024) != 0) {
    privileged_unavailable("cannot mount a tmpfs");
  }
  spec s;
  build_spec(&s, "readonly", 1);
  model md;
  model_random(&md, 11);
  write_checkpoint(root, &s, &md, 1, 1);
  assert_int_equal(mount("tmpfs", root, "tmpfs", MS_REMOUNT | MS_RDONLY, NULL), 0);
  core_state st;
  state_from_model(&st, &s, 0, &md, 2, 1);
  ckpt_file_info fi;
  int rc = ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err);
  assert_int_equal(rc, ZS_EIO);
  assert_non_null(strstr(err, "Read-only file system"));
  assert_non_null(strstr(err, root));
  /* Rewriting the committed step fails before it touches the manifest. */
  st.version = 1;
  rc = ckpt_write_shard(root, &st, NULL, &fi, err, sizeof err);
  assert_int_equal(rc, ZS_EIO);
  core_state_free(&st);
  core_state back;
  assert_int_equal(ckpt_load(root, 1, 0, 1, &back, err, sizeof err), 0);
  assert_states_hold(&back, &s, &md);
  core_state_free(&back);
  assert_int_equal(umount2(root, MNT_DETACH), 0);
  model_free(&md);
  spec_free(&s);
}

static void subdirectory_names_from_the_network_are_checked(void **state) {
  (void)state;
  assert_true(ckpt_valid_subdir("best"));
  assert_true(ckpt_valid_subdir("runs/2024-01_a.b"));
  assert_false(ckpt_valid_subdir(""));
  assert_false(ckpt_valid_subdir(NULL));
  assert_false(ckpt_valid_subdir("/etc"));
  assert_false(ckpt_valid_subdir(".."));
  assert_false(ckpt_valid_subdir("a/../b"));
  assert_false(ckpt_valid_subdir("a/./b"));
  assert_false(ckpt_valid_subdir("a//b"));
  assert_false(ckpt_valid_subdir("a/"));
  assert_false(ckpt_valid_subdir("a b"));
  assert_false(ckpt_valid_subdir("a\\b"));
  assert_false(ckpt_valid_subdir("1/2/3/4/5/6/7/8/9"));
}

/* The data_offsets of `key` in the header JSON (a plain search: keys are
 * unique and each is followed by its object). */
static void find_offsets(const char *json, const char *key, uint64_t *b, uint64_t *e) {
  const char *k = strstr(json, key);
  assert_non_null(k);
  const char *d = strstr(k, "\"data_offsets\":[");
  assert_non_null(d);
  assert_int_equal(sscanf(d, "\"data_offsets\":[%" SCNu64 ",%" SCNu64 "]", b, e), 2);
}

static void export_holds_every_tensor_whole(void **state) {
  (void)state;
  char root[512], out[600], err[512];
  fresh_dir(root, sizeof root, "export");
  spec s;
  build_spec(&s, "export", 3);
  model md;
  model_random(&md, 12);
  write_checkpoint(root, &s, &md, 4, 1);
  snprintf(out, sizeof out, "%s/model.safetensors", root);
  ckpt_export_opts o = {.dtype = ZS_DTYPE_FP32, .moments = 1};
  int rc = ckpt_export_safetensors(root, 4, out, &o, err, sizeof err);
  if (rc)
    fprintf(stderr, "%s\n", err);
  assert_int_equal(rc, 0);
  FILE *f = fopen(out, "rb");
  assert_non_null(f);
  uint8_t len8[8];
  assert_int_equal(fread(len8, 1, 8, f), 8);
  uint64_t hl = le_load64(len8);
  assert_int_equal(hl % 8, 0);
  char *json = calloc(hl + 1, 1);
  assert_int_equal(fread(json, 1, hl, f), hl);
  assert_non_null(strstr(json, "\"zshard.step\":\"4\""));
  assert_non_null(strstr(json, "\"head \\\"quoted\\\" \\\\ name\""));
  assert_null(strstr(json, "\"mid.weight.exp_avg\""));
  assert_null(strstr(json, "\"embed.bias.momentum_buffer\""));
  const struct {
    const char *key;
    uint32_t t;
    int a;
  } probes[] = {
      {"\"embed.weight\":", 0, 0},
      {"\"embed.weight.exp_avg\":", 0, 1},
      {"\"embed.weight.exp_avg_sq\":", 0, 2},
      {"\"mid.weight.momentum_buffer\":", 2, 1},
      {"\"head.weight\":", 5, 0},
      {"\"embed.bias\":", 1, 0},
  };
  for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
    uint64_t b, e;
    find_offsets(json, probes[i].key, &b, &e);
    uint64_t n = k_tensors[probes[i].t].numel;
    assert_int_equal(e - b, n * 4);
    float *buf = malloc(n * 4);
    assert_int_equal(fseek(f, (long)(8 + hl + b), SEEK_SET), 0);
    assert_int_equal(fread(buf, 4, n, f), n);
    assert_memory_equal(buf, md.values[probes[i].a][probes[i].t], n * 4);
    free(buf);
  }
  fclose(f);
  free(json);
  /* bf16: round to nearest even of the masters. */
  o.dtype = ZS_DTYPE_BF16;
  o.moments = 0;
  assert_int_equal(ckpt_export_safetensors(root, 4, out, &o, err, sizeof err), 0);
  f = fopen(out, "rb");
  assert_int_equal(fread(len8, 1, 8, f), 8);
  hl = le_load64(len8);
  json = calloc(hl + 1, 1);
  assert_int_equal(fread(json, 1, hl, f), hl);
  assert_non_null(strstr(json, "\"dtype\":\"BF16\""));
  assert_null(strstr(json, "exp_avg"));
  uint64_t b, e;
  find_offsets(json, "\"mid.weight\":", &b, &e);
  uint16_t *h = malloc(517 * 2);
  uint16_t *want = malloc(517 * 2);
  dtype_from_f32(ZS_DTYPE_BF16, md.values[0][2], want, 517);
  assert_int_equal(fseek(f, (long)(8 + hl + b), SEEK_SET), 0);
  assert_int_equal(fread(h, 2, 517, f), 517);
  assert_memory_equal(h, want, 517 * 2);
  free(h);
  free(want);
  free(json);
  fclose(f);
  model_free(&md);
  spec_free(&s);
}

/* ------------------------------------------------------------------ core */

typedef struct waitbox {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
} waitbox;

static void box_init(waitbox *b) {
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->cv, NULL);
  b->done = 0;
  b->status = 0;
}

static void box_set(waitbox *b, int status) {
  pthread_mutex_lock(&b->mu);
  b->status = status;
  b->done = 1;
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

static int box_wait(waitbox *b) {
  pthread_mutex_lock(&b->mu);
  while (!b->done)
    pthread_cond_wait(&b->cv, &b->mu);
  int s = b->status;
  b->done = 0;
  pthread_mutex_unlock(&b->mu);
  return s;
}

static void on_stats(void *arg, int status, const core_stats_result *r) {
  (void)r;
  box_set(arg, status);
}

static void on_apply(void *arg, int status, const core_apply_result *r) {
  (void)r;
  box_set(arg, status);
}

static void on_version(void *arg, int status, uint64_t v) {
  (void)v;
  box_set(arg, status);
}

/* A one-shard core with the test spec's job, initialised from md. */
static core *core_with_job(const spec *s, const model *md) {
  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 2};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  char err[256];
  assert_int_equal(core_open(c, s, NULL, err, sizeof err), 0);
  uint64_t h = spec_hash(s);
  for (uint32_t t = 0; t < K_NT; t++)
    assert_int_equal(core_init_params(c, h, t, 0, md->values[0][t],
                                      k_tensors[t].numel * sizeof(float), NULL, NULL, err,
                                      sizeof err),
                     0);
  return c;
}

/* Pushes a gradient for every tensor and applies step `step`. */
static void train_step(core *c, const spec *s, uint64_t step, uint64_t seed) {
  uint64_t h = spec_hash(s);
  char err[256];
  for (uint32_t t = 0; t < K_NT; t++) {
    float *g = malloc(k_tensors[t].numel * sizeof(float));
    for (uint64_t i = 0; i < k_tensors[t].numel; i++)
      g[i] = rnd(&seed) * 0.1f;
    core_push_args a = {.hash = h,
                        .step = step,
                        .tensor = t,
                        .dtype = ZS_DTYPE_FP32,
                        .data = g,
                        .nbytes = k_tensors[t].numel * sizeof(float)};
    assert_int_equal(core_push(c, &a, NULL, err, sizeof err), 0);
    free(g);
  }
  waitbox b;
  box_init(&b);
  core_stats_result sr;
  int rc =
      core_grad_stats(c, h, step, clock_now_ms() + WAIT_MS, on_stats, &b, &sr, err, sizeof err);
  if (rc == CORE_PENDING)
    rc = box_wait(&b);
  assert_int_equal(rc, 0);
  core_apply_result ar;
  rc = core_apply(c, h, step, 1e-2, 1.0f, 0, on_apply, &b, &ar, err, sizeof err);
  if (rc == CORE_PENDING)
    rc = box_wait(&b);
  assert_int_equal(rc, 0);
}

/* The whole model as the core holds it now (fp32 reads). */
static void read_model(core *c, const spec *s, model *out) {
  memset(out, 0, sizeof *out);
  char err[256];
  for (uint32_t t = 0; t < K_NT; t++) {
    out->values[0][t] = malloc(k_tensors[t].numel * sizeof(float));
    assert_int_equal(core_read(c, spec_hash(s), t, 0, ZS_DTYPE_FP32, out->values[0][t],
                               k_tensors[t].numel * sizeof(float), NULL, err, sizeof err),
                     0);
  }
}

typedef struct copy_ctx {
  core_state st;
  uint64_t seen_version;
} copy_ctx;

static int copy_view(void *arg, const core_view *v) {
  copy_ctx *x = arg;
  x->seen_version = v->version;
  if (x->st.nelems != v->nelems)
    return ZS_EINTERNAL;
  memcpy(x->st.master, v->master, v->nelems * sizeof(float));
  if (x->st.m)
    memcpy(x->st.m, v->m, v->nelems * sizeof(float));
  if (x->st.v)
    memcpy(x->st.v, v->v, v->nelems * sizeof(float));
  free(x->st.client_state);
  x->st.client_state = NULL;
  x->st.client_state_len = v->client_state_len;
  if (v->client_state_len) {
    x->st.client_state = malloc(v->client_state_len);
    memcpy(x->st.client_state, v->client_state, v->client_state_len);
  }
  x->st.version = v->version;
  x->st.optimizer_steps = v->optimizer_steps;
  return 0;
}

static void snapshot_then_restore_gives_an_identical_shard(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "core-ckpt", 1);
  model md;
  model_random(&md, 20);
  core *a = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  char err[256];
  for (uint64_t step = 1; step <= 3; step++)
    train_step(a, &s, step, 100 + step);
  copy_ctx x;
  assert_int_equal(core_state_init(&x.st, &s, 0, err, sizeof err), 0);
  double secs = -1;
  assert_int_equal(core_snapshot(a, h, 3, 0, copy_view, &x, &secs, err, sizeof err), 0);
  assert_true(secs >= 0);
  assert_int_equal(x.st.version, 3);
  assert_int_equal(x.st.optimizer_steps, 3);
  /* An old version is gone. */
  assert_int_equal(core_snapshot(a, h, 2, 0, copy_view, &x, NULL, err, sizeof err), ZS_ESTEP);

  /* A second shard restored from the snapshot trains on like the first. */
  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core *b = NULL;
  assert_int_equal(core_create(&cfg, &b), 0);
  assert_int_equal(core_checkpoint_origin(b, NULL, NULL), 0);
  assert_int_equal(core_restore(b, &x.st, 3, err, sizeof err), 0);
  core_state_free(&x.st); /* b's previous (empty) arenas */
  uint64_t ck;
  int untouched;
  assert_int_equal(core_checkpoint_origin(b, &ck, &untouched), 1);
  assert_int_equal(ck, 3);
  assert_true(untouched);
  core_info info;
  core_get_info(b, &info);
  assert_int_equal(info.version, 3);
  assert_true(info.initialized);
  train_step(a, &s, 4, 777);
  train_step(b, &s, 4, 777);
  assert_int_equal(core_checkpoint_origin(b, NULL, &untouched), 1);
  assert_false(untouched);
  model ma, mb;
  read_model(a, &s, &ma);
  read_model(b, &s, &mb);
  for (uint32_t t = 0; t < K_NT; t++)
    assert_memory_equal(ma.values[0][t], mb.values[0][t], k_tensors[t].numel * sizeof(float));
  /* The low copy was recomputed: bf16 reads agree too. */
  uint16_t la[1300], lb[1300];
  assert_int_equal(core_read(a, h, 0, 0, ZS_DTYPE_BF16, la, sizeof la, NULL, err, sizeof err), 0);
  assert_int_equal(core_read(b, h, 0, 0, ZS_DTYPE_BF16, lb, sizeof lb, NULL, err, sizeof err), 0);
  assert_memory_equal(la, lb, sizeof la);
  model_free(&ma);
  model_free(&mb);
  core_destroy(a);
  core_destroy(b);
  model_free(&md);
  spec_free(&s);
}

typedef struct snap_thread {
  core *c;
  uint64_t hash, step;
  copy_ctx *x;
  int rc;
  atomic_int finished;
  char err[256];
} snap_thread;

static void *run_snapshot(void *arg) {
  snap_thread *t = arg;
  t->rc = core_snapshot(t->c, t->hash, t->step, clock_now_ms() + WAIT_MS, copy_view, t->x, NULL,
                        t->err, sizeof t->err);
  atomic_store(&t->finished, 1);
  return NULL;
}

static void snapshot_of_a_future_step_sees_exactly_that_version(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "core-future", 1);
  model md;
  model_random(&md, 21);
  core *c = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  char err[256];
  copy_ctx x;
  assert_int_equal(core_state_init(&x.st, &s, 0, err, sizeof err), 0);
  /* Asked at version 0 (or, if the thread is slow, at 1 or 2): the copy is
   * made when the applies reach version 2, and the version stays there until
   * the thread is joined. */
  snap_thread t = {.c = c, .hash = h, .step = 2, .x = &x};
  atomic_init(&t.finished, 0);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, run_snapshot, &t), 0);
  train_step(c, &s, 1, 1);
  train_step(c, &s, 2, 2);
  pthread_join(th, NULL);
  assert_int_equal(t.rc, 0);
  assert_int_equal(x.seen_version, 2);
  train_step(c, &s, 3, 3);
  /* Replaying steps 1..2 on a fresh core gives the snapshot's masters. */
  core *ref = core_with_job(&s, &md);
  train_step(ref, &s, 1, 1);
  train_step(ref, &s, 2, 2);
  copy_ctx y;
  assert_int_equal(core_state_init(&y.st, &s, 0, err, sizeof err), 0);
  assert_int_equal(core_snapshot(ref, h, 2, 0, copy_view, &y, NULL, err, sizeof err), 0);
  assert_memory_equal(x.st.master, y.st.master, x.st.nelems * sizeof(float));
  assert_memory_equal(x.st.m, y.st.m, x.st.nelems * sizeof(float));
  core_state_free(&x.st);
  core_state_free(&y.st);
  core_destroy(ref);
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

static void snapshot_wait_ends_by_deadline_or_cancel(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "core-cancel", 1);
  model md;
  model_random(&md, 22);
  core *c = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  char err[256];
  copy_ctx x;
  assert_int_equal(core_state_init(&x.st, &s, 0, err, sizeof err), 0);
  /* A deadline already past: the worker expires it. */
  assert_int_equal(core_snapshot(c, h, 5, clock_now_ms() - 1, copy_view, &x, NULL, err, sizeof err),
                   ZS_ETIMEDOUT);
  assert_non_null(strstr(err, "version 5"));
  snap_thread t = {.c = c, .hash = h, .step = 9, .x = &x};
  atomic_init(&t.finished, 0);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, run_snapshot, &t), 0);
  /* Cancel until the thread has returned: the snapshot may not be registered
   * yet when the first cancel runs. */
  while (!atomic_load(&t.finished)) {
    core_cancel_snapshots(c);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  pthread_join(th, NULL);
  assert_int_equal(t.rc, ZS_ECANCELED);
  assert_int_equal(core_snapshot(c, h ^ 1, 0, 0, copy_view, &x, NULL, err, sizeof err), ZS_EHASH);
  core_state_free(&x.st);
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

static void restore_drops_the_pending_step_and_answers_later_steps_behind(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "core-behind", 1);
  model md;
  model_random(&md, 23);
  core *c = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  char err[512];
  train_step(c, &s, 1, 1);
  copy_ctx x;
  assert_int_equal(core_state_init(&x.st, &s, 0, err, sizeof err), 0);
  assert_int_equal(core_snapshot(c, h, 1, 0, copy_view, &x, NULL, err, sizeof err), 0);
  train_step(c, &s, 2, 2);
  train_step(c, &s, 3, 3);
  /* A push of step 4 and a wait for version 5 are in flight. */
  float g[13] = {1};
  core_push_args a = {
      .hash = h, .step = 4, .tensor = 1, .dtype = ZS_DTYPE_FP32, .data = g, .nbytes = sizeof g};
  assert_int_equal(core_push(c, &a, NULL, err, sizeof err), 0);
  waitbox wb;
  box_init(&wb);
  uint64_t v;
  assert_int_equal(
      core_wait_version(c, h, 5, clock_now_ms() + WAIT_MS, on_version, &wb, &v, err, sizeof err),
      CORE_PENDING);
  assert_int_equal(core_restore(c, &x.st, 1, err, sizeof err), 0);
  /* The waiter learns that the shard went back. */
  assert_int_equal(box_wait(&wb), ZS_EBEHIND);
  core_info info;
  core_get_info(c, &info);
  assert_int_equal(info.version, 1);
  /* Step 4 belongs to a trainer that is ahead: EBEHIND naming the step. */
  a.step = 4;
  assert_int_equal(core_push(c, &a, NULL, err, sizeof err), ZS_EBEHIND);
  assert_non_null(strstr(err, "checkpoint step 1"));
  assert_int_equal(core_wait_version(c, h, 3, 0, on_version, &wb, &v, err, sizeof err), ZS_EBEHIND);
  /* Step 2 starts from nothing: only the new contributions count. */
  assert_int_equal(core_missing(c, 2, NULL, 0), K_NT);
  train_step(c, &s, 2, 2);
  core *ref = core_with_job(&s, &md);
  train_step(ref, &s, 1, 1);
  train_step(ref, &s, 2, 2);
  model mc, mr;
  read_model(c, &s, &mc);
  read_model(ref, &s, &mr);
  for (uint32_t t = 0; t < K_NT; t++)
    assert_memory_equal(mc.values[0][t], mr.values[0][t], k_tensors[t].numel * sizeof(float));
  model_free(&mc);
  model_free(&mr);
  /* Another job's state is refused and changes nothing. */
  spec other;
  build_spec(&other, "another-job", 1);
  core_state os;
  assert_int_equal(core_state_init(&os, &other, 0, err, sizeof err), 0);
  assert_int_equal(core_restore(c, &os, 9, err, sizeof err), ZS_EHASH);
  core_get_info(c, &info);
  assert_int_equal(info.version, 2);
  core_state_free(&os);
  spec_free(&other);
  core_state_free(&x.st);
  core_destroy(ref);
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

/* The core's client state now, as a string, with its version. */
static const char *client_state_of(core *c, uint64_t *version) {
  static char buf[CORE_MAX_CLIENT_STATE + 1];
  size_t n = core_get_client_state(c, buf, CORE_MAX_CLIENT_STATE, version);
  buf[n] = '\0';
  return buf;
}

static void client_state_is_committed_by_its_apply_and_snapshotted_and_restored(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "core-client-state", 1);
  model md;
  model_random(&md, 24);
  core *a = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s), v = 99;
  char err[512];
  assert_string_equal(client_state_of(a, &v), "");
  assert_int_equal(v, 0);
  /* Refused: too long, or another job; nothing is recorded. */
  static uint8_t big[CORE_MAX_CLIENT_STATE + 1];
  assert_int_equal(core_set_apply_client_state(a, h, 1, big, sizeof big, err, sizeof err),
                   ZS_ESIZE);
  assert_non_null(strstr(err, "client_state"));
  assert_int_equal(core_set_apply_client_state(a, h ^ 1, 1, "x", 1, err, sizeof err), ZS_EHASH);
  /* A step other than the pending one is not recorded. */
  assert_int_equal(core_set_apply_client_state(a, h, 2, "early", 5, err, sizeof err), 0);
  train_step(a, &s, 1, 1);
  assert_string_equal(client_state_of(a, &v), "");
  assert_int_equal(v, 1);
  /* The last one recorded before the apply is what the apply commits. */
  assert_int_equal(core_set_apply_client_state(a, h, 2, "first", 5, err, sizeof err), 0);
  assert_int_equal(core_set_apply_client_state(a, h, 2, "two", 3, err, sizeof err), 0);
  train_step(a, &s, 2, 2);
  assert_string_equal(client_state_of(a, &v), "two");
  assert_int_equal(v, 2);
  /* An apply without one keeps the previous version's. */
  assert_int_equal(core_set_apply_client_state(a, h, 3, NULL, 0, err, sizeof err), 0);
  train_step(a, &s, 3, 3);
  assert_string_equal(client_state_of(a, &v), "two");
  assert_int_equal(v, 3);

  /* A snapshot shows it; a restore brings it back, and a state without one
   * clears it. */
  copy_ctx x;
  assert_int_equal(core_state_init(&x.st, &s, 0, err, sizeof err), 0);
  assert_int_equal(core_snapshot(a, h, 3, 0, copy_view, &x, NULL, err, sizeof err), 0);
  assert_int_equal(x.st.client_state_len, 3);
  assert_memory_equal(x.st.client_state, "two", 3);
  core_state empty;
  assert_int_equal(core_state_init(&empty, &s, 0, err, sizeof err), 0);
  empty.version = 1;
  assert_int_equal(core_restore(a, &empty, 1, err, sizeof err), 0);
  assert_string_equal(client_state_of(a, &v), "");
  assert_int_equal(v, 1);
  assert_int_equal(core_restore(a, &x.st, 3, err, sizeof err), 0);
  assert_string_equal(client_state_of(a, &v), "two");
  assert_int_equal(v, 3);
  /* Too long a state is refused and changes nothing. */
  empty.client_state = malloc(sizeof big);
  empty.client_state_len = sizeof big;
  assert_int_equal(core_restore(a, &empty, 1, err, sizeof err), ZS_EINVAL);
  assert_string_equal(client_state_of(a, &v), "two");
  assert_int_equal(v, 3);
  core_state_free(&empty);
  core_state_free(&x.st);
  core_destroy(a);
  model_free(&md);
  spec_free(&s);
}

/* ------------------------------------------------------------------ service */

typedef struct svcbox {
  waitbox b;
  ckpt_svc_result r;
} svcbox;

static void on_svc(void *arg, const ckpt_svc_result *r) {
  svcbox *sb = arg;
  sb->r = *r;
  box_set(&sb->b, r->status);
}

static ckpt_svc *svc_on(core *c, const char *dir, uint32_t keep) {
  ckpt_svc_config cfg = {.state_dir = dir, .core = c, .keep = keep};
  ckpt_svc *sv = NULL;
  char err[512];
  if (ckpt_svc_create(&cfg, &sv, err, sizeof err) != 0)
    fail_msg("ckpt_svc_create: %s", err);
  return sv;
}

static int box_done(waitbox *b) {
  pthread_mutex_lock(&b->mu);
  int d = b->done;
  pthread_mutex_unlock(&b->mu);
  return d;
}

/* Three checkpoints of step 1e9, then gone, blocked the single
 * checkpoint thread, and a real Checkpoint or Restore timed out behind
 * them. A step far ahead is refused at once; one within reach waits in the
 * core, not on the thread, so a checkpoint of the current version is
 * written meanwhile; and the requests a shard holds are bounded. */
static void checkpoints_far_ahead_are_refused_and_near_ones_hold_no_thread(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "svc-ahead");
  spec s;
  build_spec(&s, "svc-ahead", 1);
  model md;
  model_random(&md, 81);
  core *c = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  ckpt_svc *sv = svc_on(c, root, 0);
  svcbox far;
  box_init(&far.b);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(
        ckpt_svc_checkpoint(sv, h, 1000000000u, NULL, 0, on_svc, &far, err, sizeof err), ZS_ESTEP);
    assert_non_null(strstr(err, "steps ahead of shard 0's version 0"));
  }
  /* Step 2 waits for two applies that do not come (for up to a minute). */
  svcbox ahead[CKPT_SVC_MAX_JOBS];
  for (uint32_t i = 0; i < CKPT_SVC_MAX_JOBS - 1; i++) {
    box_init(&ahead[i].b);
    assert_int_equal(ckpt_svc_checkpoint(sv, h, CKPT_SVC_MAX_AHEAD, NULL, clock_now_ms() + 60000u,
                                         on_svc, &ahead[i], err, sizeof err),
                     CORE_PENDING);
  }
  /* The current version is written while they wait. */
  svcbox now;
  box_init(&now.b);
  assert_int_equal(ckpt_svc_checkpoint(sv, h, 0, NULL, 0, on_svc, &now, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(box_wait(&now.b), 0);
  assert_int_equal(now.r.step, 0);
  for (uint32_t i = 0; i < CKPT_SVC_MAX_JOBS - 1; i++)
    assert_false(box_done(&ahead[i].b));
  /* Fifteen waiting and one answered: room for one more, then none. */
  box_init(&ahead[CKPT_SVC_MAX_JOBS - 1].b);
  assert_int_equal(ckpt_svc_checkpoint(sv, h, 1, NULL, clock_now_ms() + 60000u, on_svc,
                                       &ahead[CKPT_SVC_MAX_JOBS - 1], err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(ckpt_svc_restore(sv, h, 0, NULL, on_svc, &now, err, sizeof err), ZS_ELIMIT);
  assert_non_null(strstr(err, "already queued or waiting"));
  /* One apply reaches step 1: its checkpoint is written, the others wait. */
  train_step(c, &s, 1, 82);
  assert_int_equal(box_wait(&ahead[CKPT_SVC_MAX_JOBS - 1].b), 0);
  assert_int_equal(ahead[CKPT_SVC_MAX_JOBS - 1].r.version, 1);
  /* Checkpoints still waiting do not hold a close back: they fail with it. */
  core_close_result cr;
  assert_int_equal(core_close(c, h, NULL, &cr, err, sizeof err), 0);
  assert_int_equal(cr.closed, 1);
  for (uint32_t i = 0; i < CKPT_SVC_MAX_JOBS - 1; i++)
    assert_int_equal(box_wait(&ahead[i].b), ZS_ENOTOPEN);
  ckpt_svc_destroy(sv);
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

static int step_dir_exists(const char *root, const char *sub, uint64_t step) {
  char path[800];
  struct stat sb;
  snprintf(path, sizeof path, "%s/%s/step-%" PRIu64, root, sub, step);
  return stat(path, &sb) == 0;
}

/* Thirty checkpoints into new directories, never committed,
 * escaped --keep-checkpoints and grew the disk thirty-fold. Files written
 * and not committed are bounded wherever they are, and an uncommitted
 * checkpoint older than a committed one counts toward keep: it goes at the
 * commit. */
static void uncommitted_checkpoints_are_bounded_and_count_toward_keep(void **state) {
  (void)state;
  char root[512], err[512], sub[32];
  fresh_dir(root, sizeof root, "svc-keep");
  spec s;
  build_spec(&s, "svc-keep", 1);
  model md;
  model_random(&md, 83);
  core *c = core_with_job(&s, &md);
  uint64_t h = spec_hash(&s);
  ckpt_svc *sv = svc_on(c, root, 2);
  svcbox b;
  box_init(&b.b);
  for (int i = 0; i < 10; i++) {
    snprintf(sub, sizeof sub, "d%d", i);
    assert_int_equal(ckpt_svc_checkpoint(sv, h, 0, sub, 0, on_svc, &b, err, sizeof err),
                     CORE_PENDING);
    assert_int_equal(box_wait(&b.b), 0);
  }
  int left = 0;
  for (int i = 0; i < 10; i++) {
    snprintf(sub, sizeof sub, "d%d", i);
    left += step_dir_exists(root, sub, 0);
  }
  print_message("uncommitted checkpoints left of 10 written: %d\n", left);
  assert_int_equal(left, CKPT_SVC_MAX_UNCOMMITTED);
  assert_true(step_dir_exists(root, "d9", 0));

  /* In one directory: step 0 written, never committed; step 1 committed. */
  assert_int_equal(ckpt_svc_checkpoint(sv, h, 0, "k", 0, on_svc, &b, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(box_wait(&b.b), 0);
  train_step(c, &s, 1, 84);
  assert_int_equal(ckpt_svc_checkpoint(sv, h, 1, "k", 0, on_svc, &b, err, sizeof err),
                   CORE_PENDING);
  assert_int_equal(box_wait(&b.b), 0);
  ckpt_file_info file = b.r.file;
  ckpt_manifest m = {.step = 1,
                     .version = 1,
                     .optimizer_steps = b.r.optimizer_steps,
                     .spec_hash = h,
                     .num_shards = 1,
                     .files = &file};
  assert_true(step_dir_exists(root, "k", 0));
  assert_int_equal(ckpt_svc_commit(sv, h, &m, "k", on_svc, &b, err, sizeof err), CORE_PENDING);
  assert_int_equal(box_wait(&b.b), 0);
  assert_false(step_dir_exists(root, "k", 0));
  assert_true(step_dir_exists(root, "k", 1));
  /* Stopping the service answers a checkpoint still waiting for its step. */
  assert_int_equal(
      ckpt_svc_checkpoint(sv, h, 2, "k", clock_now_ms() + 60000u, on_svc, &b, err, sizeof err),
      CORE_PENDING);
  ckpt_svc_destroy(sv);
  assert_true(box_done(&b.b));
  assert_int_equal(b.b.status, ZS_ECLOSED);
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

static int group_setup(void **state) {
  (void)state;
  const char *tmp = getenv("TMPDIR");
  snprintf(g_root, sizeof g_root, "%s/zshard-ckpt-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  return mkdtemp(g_root) ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  return 0;
}

/* ------------------------------------------------- membership (issue 26) */

/* An elastic job's membership as test_ckpt writes it: W = 3, rank 1 left
 * at step 4, a timeout of the job's own, and the server's flag (500 ms). */
static core_member_state *sample_members(void) {
  core_member_state *ms = calloc(1, sizeof *ms);
  core_member_log_entry *log = calloc(2, sizeof *log);
  assert_non_null(ms);
  assert_non_null(log);
  ms->trainer_timeout_ms = 750;
  ms->flag_timeout_ms = 500;
  ms->epoch = 3;
  ms->leaves = 1;
  ms->timeouts = 1;
  ms->joins = 2;
  core_members_add(&ms->members, 0);
  core_members_add(&ms->members, 2);
  log[0].from_step = 1;
  for (uint32_t r = 0; r < 3; r++)
    core_members_add(&log[0].members, r);
  log[1].from_step = 4;
  log[1].members = ms->members;
  ms->log = log;
  ms->log_n = 2;
  return ms;
}

static void assert_members_equal(const core_member_state *a, const core_member_state *b) {
  assert_non_null(a);
  assert_non_null(b);
  assert_int_equal(a->trainer_timeout_ms, b->trainer_timeout_ms);
  assert_int_equal(a->flag_timeout_ms, b->flag_timeout_ms);
  assert_int_equal(a->epoch, b->epoch);
  assert_int_equal(a->leaves, b->leaves);
  assert_int_equal(a->timeouts, b->timeouts);
  assert_int_equal(a->joins, b->joins);
  assert_true(core_members_equal(&a->members, &b->members));
  assert_int_equal(a->log_n, b->log_n);
  for (uint32_t k = 0; k < a->log_n; k++) {
    assert_int_equal(a->log[k].from_step, b->log[k].from_step);
    assert_true(core_members_equal(&a->log[k].members, &b->log[k].members));
  }
}

static void free_members(core_member_state *ms) {
  if (ms)
    free((void *)ms->log);
  free(ms);
}

static uint32_t file_format(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  uint8_t h[12];
  assert_int_equal(fread(h, 1, sizeof h, f), sizeof h);
  fclose(f);
  return le_load32(h + 8);
}

/* Writes step 6 of md for 2 shards under root, with `ms` (may be NULL) as
 * every file's membership. */
static void write_with_members(const char *root, const spec *s2, const model *md,
                               const core_member_state *ms) {
  char err[512];
  ckpt_manifest m = {
      .step = 6, .version = 6, .optimizer_steps = 6, .spec_hash = spec_hash(s2), .num_shards = 2};
  m.files = calloc(2, sizeof *m.files);
  for (uint32_t i = 0; i < 2; i++) {
    core_state st;
    state_from_model(&st, s2, i, md, 6, 6);
    if (ms) {
      st.members = malloc(sizeof *st.members);
      core_member_log_entry *log = malloc(ms->log_n * sizeof *log + 1);
      *st.members = *ms;
      memcpy(log, ms->log, ms->log_n * sizeof *log);
      st.members->log = log;
    }
    assert_int_equal(ckpt_write_shard(root, &st, NULL, &m.files[i], err, sizeof err), 0);
    core_state_free(&st);
  }
  assert_int_equal(ckpt_manifest_write(root, &m, 0, err, sizeof err), 0);
  ckpt_manifest_free(&m);
}

static void membership_travels_with_the_files_and_old_files_give_every_rank(void **state) {
  (void)state;
  char with[512], without[512];
  fresh_dir(with, sizeof with, "mb-with");
  fresh_dir(without, sizeof without, "mb-without");
  spec s2;
  build_spec(&s2, "members", 2);
  s2.world_size = 3;
  model md;
  model_random(&md, 7);
  core_member_state *ms = sample_members();
  write_with_members(with, &s2, &md, ms);
  write_with_members(without, &s2, &md, NULL);
  char pw[600], po[600];
  shard_path(pw, sizeof pw, with, 6, 0, 2);
  shard_path(po, sizeof po, without, 6, 0, 2);
  /* Format 3 only for a file with the section; one without is format 1,
   * byte for byte what older builds write and read. */
  assert_int_equal(file_format(pw), 3);
  assert_int_equal(file_format(po), 1);
  assert_int_equal(file_sections(pw), file_sections(po) + 1);

  core_state st2[2], st3[3];
  load_all(with, 6, 2, st2);
  load_all(with, 6, 3, st3);
  for (uint32_t i = 0; i < 2; i++) {
    assert_members_equal(st2[i].members, ms);
    core_state_free(&st2[i]);
  }
  for (uint32_t i = 0; i < 3; i++) {
    assert_members_equal(st3[i].members, ms);
    core_state_free(&st3[i]);
  }
  load_all(without, 6, 2, st2);
  for (uint32_t i = 0; i < 2; i++) {
    assert_null(st2[i].members);
    core_state_free(&st2[i]);
  }
  free_members(ms);
  model_free(&md);
  spec_free(&s2);
}

/* Recomputes every section's CRC, the table's and the header's of the file
 * at path, so that a change to a section's bytes reaches its decoder. */
static void reseal(const char *path) {
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  assert_int_equal(fseek(f, 0, SEEK_END), 0);
  long size = ftell(f);
  uint8_t *b = malloc((size_t)size);
  rewind(f);
  assert_int_equal(fread(b, 1, (size_t)size, f), (size_t)size);
  uint32_t nsec = le_load32(b + 56);
  for (uint32_t i = 0; i < nsec; i++) {
    uint8_t *e = b + 128 + 32 * i;
    le_store32(e + 24, crc32c(0, b + le_load64(e + 8), (size_t)le_load64(e + 16)));
  }
  le_store32(b + 72, crc32c(0, b + 128, 32 * (size_t)nsec));
  le_store32(b + 124, crc32c(0, b, 124));
  rewind(f);
  assert_int_equal(fwrite(b, 1, (size_t)size, f), (size_t)size);
  fclose(f);
  free(b);
}

/* The members section's offset and length in the file at path. */
static void members_section(const char *path, uint64_t *off, uint64_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  uint8_t h[128 + 32 * CKPT_MAX_SECTIONS];
  size_t got = fread(h, 1, sizeof h, f);
  fclose(f);
  assert_true(got >= 128);
  *off = *len = 0;
  for (uint32_t i = 0; i < le_load32(h + 56); i++)
    if (le_load32(h + 128 + 32 * i) == CKPT_SEC_MEMBERS) {
      *off = le_load64(h + 128 + 32 * i + 8);
      *len = le_load64(h + 128 + 32 * i + 16);
    }
  assert_true(*len > 0);
}

static void damaged_membership_is_refused_with_a_clear_error(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "mb-damaged");
  spec s2;
  build_spec(&s2, "members", 2);
  s2.world_size = 3;
  model md;
  model_random(&md, 8);
  core_member_state *ms = sample_members();
  bytes good = {0};
  ckpt__enc_members(&good, ms, 3, 3);
  assert_false(good.oom);
  core_member_state *out = NULL;
  assert_int_equal(ckpt__dec_members(good.p, good.len, 3, 6, 3, &out, err, sizeof err), 0);
  assert_members_equal(out, ms);
  free_members(out);
  /* Cut anywhere, or one byte more: refused. */
  for (size_t n = 0; n < good.len; n++) {
    assert_int_equal(ckpt__dec_members(good.p, n, 3, 6, 3, &out, err, sizeof err), ZS_EPROTO);
    assert_null(out);
  }
  uint8_t *longer = calloc(good.len + 1, 1);
  memcpy(longer, good.p, good.len);
  assert_int_equal(ckpt__dec_members(longer, good.len + 1, 3, 6, 3, &out, err, sizeof err),
                   ZS_EPROTO);
  assert_non_null(strstr(err, "after its log"));
  free(longer);
  /* Another world size, a log past the checkpoint's version. */
  assert_int_equal(ckpt__dec_members(good.p, good.len, 4, 6, 3, &out, err, sizeof err), ZS_EPROTO);
  assert_int_equal(ckpt__dec_members(good.p, good.len, 3, 3, 3, &out, err, sizeof err), ZS_EPROTO);
  /* Bytes 0.. the job's timeout, 4.. world size; 40.. the members' count,
   * then ranks 0 and 2; 52.. the log's count, 56.. its first step, 64.. its
   * first count; the last 4 the flag timeout (format 3). */
  const struct {
    size_t at;
    uint32_t value;
    const char *why;
  } bad[] = {
      {40, 4, "count"},
      {40, 0xffffffffu, "count"},
      {44, 3, "rank"},
      {48, 0, "rank"},
      {52, 4097, "entries"},
      {52, 0xffffffffu, "entries"},
      {56, 0, "step"},
      {64, 0, "count"},
      {64, 0x40000000u, "count"},
      {0, CORE_MAX_TRAINER_TIMEOUT_MS + 1, "trainer timeout"},
      {0, 0xffffffffu, "trainer timeout"},
      {good.len - 4, CORE_MAX_TRAINER_TIMEOUT_MS + 1, "flag timeout"},
      {good.len - 4, 0xffffffffu, "flag timeout"},
  };
  char path[600];
  shard_path(path, sizeof path, root, 6, 0, 2);
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    uint8_t *p = malloc(good.len);
    memcpy(p, good.p, good.len);
    le_store32(p + bad[k].at, bad[k].value);
    int rc = ckpt__dec_members(p, good.len, 3, 6, 3, &out, err, sizeof err);
    if (rc != ZS_EPROTO)
      fprintf(stderr, "case %zu: rc %d\n", k, rc);
    assert_int_equal(rc, ZS_EPROTO);
    assert_null(out);
    if (strstr(bad[k].why, "timeout"))
      assert_non_null(strstr(err, bad[k].why));
    /* In a file whose CRCs all match: the reader refuses it naming the
     * file, and ckpt_load (the manifest's CRC no longer matches) too. */
    write_with_members(root, &s2, &md, ms);
    uint64_t off, len;
    members_section(path, &off, &len);
    assert_int_equal(len, good.len);
    FILE *f = fopen(path, "r+b");
    assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
    assert_int_equal(fwrite(p, 1, good.len, f), good.len);
    fclose(f);
    reseal(path);
    ckpt_reader *r = NULL;
    err[0] = '\0';
    assert_int_equal(ckpt_reader_open(path, NULL, &r, err, sizeof err), ZS_EPROTO);
    assert_null(r);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "members section"));
    core_state st;
    assert_int_not_equal(ckpt_load(root, 6, 0, 2, &st, err, sizeof err), 0);
    free(p);
  }
  free(good.p);
  free_members(ms);
  model_free(&md);
  spec_free(&s2);
}

/* A format 2 file (before the flag timeout): the same section without its
 * last 4 bytes, the header's format 2. It still loads, with no flag
 * timeout; a format 2 section decoded as format 3 is short (refused), and a
 * format 3 one decoded as format 2 has 4 bytes too many (refused). */
static void a_format_2_membership_still_loads_without_a_flag_timeout(void **state) {
  (void)state;
  char root[512], err[512];
  fresh_dir(root, sizeof root, "mb-format2");
  spec s2;
  build_spec(&s2, "members", 2);
  s2.world_size = 3;
  model md;
  model_random(&md, 10);
  core_member_state *ms = sample_members();
  bytes f2 = {0}, f3 = {0};
  ckpt__enc_members(&f2, ms, 3, 2);
  ckpt__enc_members(&f3, ms, 3, 3);
  assert_int_equal(f3.len, f2.len + 4);
  assert_memory_equal(f2.p, f3.p, f2.len);
  core_member_state *out = NULL;
  assert_int_equal(ckpt__dec_members(f2.p, f2.len, 3, 6, 2, &out, err, sizeof err), 0);
  assert_int_equal(out->flag_timeout_ms, 0);
  assert_int_equal(out->trainer_timeout_ms, 750);
  free_members(out);
  assert_int_equal(ckpt__dec_members(f2.p, f2.len, 3, 6, 3, &out, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "flag timeout is missing"));
  assert_int_equal(ckpt__dec_members(f3.p, f3.len, 3, 6, 2, &out, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "after its log"));
  assert_null(out);

  write_with_members(root, &s2, &md, ms);
  char path[600];
  shard_path(path, sizeof path, root, 6, 0, 2);
  assert_int_equal(file_format(path), 3);
  uint64_t off, len;
  members_section(path, &off, &len);
  assert_int_equal(len, f3.len);
  /* Rewrite as format 2: the header's format, the section's bytes and its
   * length in the table, the file 4 bytes shorter (the section is the
   * last). */
  assert_int_equal(file_size(path), off + len);
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  uint8_t h[128 + 32 * CKPT_MAX_SECTIONS];
  size_t got = fread(h, 1, sizeof h, f);
  assert_true(got >= 128);
  le_store32(h + 8, 2);
  for (uint32_t i = 0; i < le_load32(h + 56); i++)
    if (le_load32(h + 128 + 32 * i) == CKPT_SEC_MEMBERS)
      le_store64(h + 128 + 32 * i + 16, f2.len);
  rewind(f);
  assert_int_equal(fwrite(h, 1, got, f), got);
  assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
  assert_int_equal(fwrite(f2.p, 1, f2.len, f), f2.len);
  fclose(f);
  assert_int_equal(truncate(path, (off_t)(off + f2.len)), 0);
  reseal(path);
  ckpt_reader *r = NULL;
  assert_int_equal(ckpt_reader_open(path, NULL, &r, err, sizeof err), 0);
  const core_member_state *got_ms = ckpt_reader_members(r);
  assert_non_null(got_ms);
  assert_int_equal(got_ms->flag_timeout_ms, 0);
  core_member_state want = *ms;
  want.flag_timeout_ms = 0;
  assert_members_equal(got_ms, &want);
  ckpt_reader_close(r);
  free(f2.p);
  free(f3.p);
  free_members(ms);
  model_free(&md);
  spec_free(&s2);
}

typedef struct members_seen {
  int has;
  core_member_state ms;
  core_member_log_entry log[4];
} members_seen;

static int see_members(void *arg, const core_view *v) {
  members_seen *x = arg;
  x->has = v->members != NULL;
  if (v->members && v->members->log_n <= 4) {
    x->ms = *v->members;
    memcpy(x->log, v->members->log, v->members->log_n * sizeof *x->log);
    x->ms.log = x->log;
  }
  return 0;
}

static void restore_brings_the_membership_back(void **state) {
  (void)state;
  spec s;
  build_spec(&s, "members-core", 1);
  s.world_size = 3;
  model md;
  model_random(&md, 9);
  char err[256];
  core_state st;
  state_from_model(&st, &s, 0, &md, 6, 6);
  core_member_state *ms = sample_members();
  st.members = ms;
  /* A server without a timeout of its own: the checkpoint's makes the job
   * elastic again, with its members, counters and log. */
  core_config cfg = {.shard_id = 0, .num_shards = 1, .threads = 1};
  core *c = NULL;
  assert_int_equal(core_create(&cfg, &c), 0);
  /* A rank beyond W is refused and nothing changes. */
  core_members_add(&ms->members, 5);
  assert_int_equal(core_restore(c, &st, 6, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "rank 5"));
  assert_int_equal(core_checkpoint_origin(c, NULL, NULL), 0);
  ms->members.bits[0] &= ~(UINT64_C(1) << 5);
  ms->members.n--;
  assert_int_equal(core_restore(c, &st, 6, err, sizeof err), 0);
  core_membership mb;
  core_get_membership(c, &mb);
  assert_int_equal(mb.elastic, 1);
  assert_int_equal(mb.trainer_timeout_ms, 750);
  assert_int_equal(mb.world_size, 3);
  assert_int_equal(mb.epoch, 3);
  assert_int_equal(mb.leaves, 1);
  assert_int_equal(mb.timeouts, 1);
  assert_int_equal(mb.joins, 2);
  assert_true(core_members_equal(&mb.members, &ms->members));
  char log[128];
  assert_int_equal(core_member_log_format(c, log, sizeof log), 2);
  assert_string_equal(log, "1:0,1,2;4:0,2");
  /* A snapshot of the restored shard shows the same membership. */
  members_seen seen = {0};
  uint64_t h = spec_hash(&s);
  assert_int_equal(core_snapshot(c, h, 6, 0, see_members, &seen, NULL, err, sizeof err), 0);
  assert_true(seen.has);
  assert_members_equal(&seen.ms, ms);
  core_state_free(&st); /* the shard's previous arenas, and ms */

  /* A checkpoint without the section (format 1): every rank is a member
   * again and the log starts afresh; the job keeps its own timeout. */
  state_from_model(&st, &s, 0, &md, 6, 6);
  assert_int_equal(core_restore(c, &st, 6, err, sizeof err), 0);
  core_state_free(&st);
  core_get_membership(c, &mb);
  assert_int_equal(mb.elastic, 1); /* the job's own timeout stays */
  assert_int_equal(mb.members.n, 3);
  assert_int_equal(core_member_log_format(c, log, sizeof log), 0);
  assert_string_equal(log, "");
  core_destroy(c);
  model_free(&md);
  spec_free(&s);
}

/* A job elastic only through the server's flag (no timeout of its own, the
 * flag's 500 ms recorded): restored on a server without the flag it keeps
 * the recorded timeout and stays elastic, and its next snapshot records it
 * again; a server with a flag of its own uses its flag; the job's own
 * timeout comes before both (core_timeout_in_effect). A recorded timeout
 * out of range is refused and changes nothing. */
static void a_job_elastic_only_through_the_flag_stays_elastic_after_a_restore(void **state) {
  (void)state;
  assert_int_equal(core_timeout_in_effect(750, 900, 500), 750);
  assert_int_equal(core_timeout_in_effect(0, 900, 500), 900);
  assert_int_equal(core_timeout_in_effect(0, 0, 500), 500);
  assert_int_equal(core_timeout_in_effect(0, 0, 0), 0);
  spec s;
  build_spec(&s, "members-flag", 1);
  s.world_size = 3;
  model md;
  model_random(&md, 11);
  char err[256];
  uint64_t h = spec_hash(&s);
  for (int with_flag = 0; with_flag < 2; with_flag++) {
    core_config cfg = {
        .shard_id = 0, .num_shards = 1, .threads = 1, .trainer_timeout_ms = with_flag ? 900u : 0u};
    core *c = NULL;
    assert_int_equal(core_create(&cfg, &c), 0);
    core_state st;
    state_from_model(&st, &s, 0, &md, 6, 6);
    core_member_state *ms = sample_members();
    ms->trainer_timeout_ms = 0;
    st.members = ms;
    if (!with_flag) {
      ms->flag_timeout_ms = CORE_MAX_TRAINER_TIMEOUT_MS + 1;
      assert_int_equal(core_restore(c, &st, 6, err, sizeof err), ZS_EINVAL);
      assert_non_null(strstr(err, "flag timeout"));
      assert_int_equal(core_checkpoint_origin(c, NULL, NULL), 0);
      ms->flag_timeout_ms = 500;
    }
    assert_int_equal(core_restore(c, &st, 6, err, sizeof err), 0);
    core_membership mb;
    core_get_membership(c, &mb);
    assert_int_equal(mb.elastic, 1);
    assert_int_equal(mb.trainer_timeout_ms, with_flag ? 900 : 500);
    assert_true(core_members_equal(&mb.members, &ms->members));
    members_seen seen = {0};
    assert_int_equal(core_snapshot(c, h, 6, 0, see_members, &seen, NULL, err, sizeof err), 0);
    assert_true(seen.has);
    assert_int_equal(seen.ms.trainer_timeout_ms, 0);
    assert_int_equal(seen.ms.flag_timeout_ms, with_flag ? 900 : 500);
    /* The copy a replica set's joiner gets keeps it too. */
    core_member_state *copy = NULL;
    assert_int_equal(core_member_state_copy(&copy, &seen.ms), 0);
    assert_int_equal(copy->flag_timeout_ms, seen.ms.flag_timeout_ms);
    core_member_state_free(copy);
    core_state_free(&st);
    core_destroy(c);
  }
  model_free(&md);
  spec_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(checkpoints_far_ahead_are_refused_and_near_ones_hold_no_thread),
      cmocka_unit_test(uncommitted_checkpoints_are_bounded_and_count_toward_keep),
      cmocka_unit_test(written_checkpoint_loads_back_bit_for_bit),
      cmocka_unit_test(a_checkpoint_with_the_hash_before_issue_26_still_loads),
      cmocka_unit_test(file_bytes_of_a_fixed_state_are_pinned),
      cmocka_unit_test(checkpoint_without_manifest_is_never_loaded),
      cmocka_unit_test(fifos_named_like_state_files_are_refused_without_blocking),
      cmocka_unit_test(links_below_a_confined_root_are_never_followed),
      cmocka_unit_test(listing_orders_steps_numerically_and_ignores_other_names),
      cmocka_unit_test(reshard_two_to_three_and_back_keeps_every_element),
      cmocka_unit_test(client_state_travels_with_the_files_and_files_without_it_still_load),
      cmocka_unit_test(tensor_step_counts_travel_with_the_files_and_old_files_give_the_jobs),
      cmocka_unit_test(membership_travels_with_the_files_and_old_files_give_every_rank),
      cmocka_unit_test(damaged_membership_is_refused_with_a_clear_error),
      cmocka_unit_test(a_format_2_membership_still_loads_without_a_flag_timeout),
      cmocka_unit_test(a_job_elastic_only_through_the_flag_stays_elastic_after_a_restore),
      cmocka_unit_test(restore_brings_the_membership_back),
      cmocka_unit_test(one_flipped_byte_anywhere_is_refused_naming_the_file),
      cmocka_unit_test(truncated_file_is_refused_at_any_length),
      cmocka_unit_test(file_of_another_job_or_step_is_refused),
      cmocka_unit_test(damaged_manifest_makes_the_checkpoint_incomplete),
      cmocka_unit_test(rewriting_a_step_uncommits_it_first),
      cmocka_unit_test(full_disk_fails_clearly_and_keeps_the_previous_checkpoint),
      cmocka_unit_test(read_only_directory_fails_clearly_and_keeps_the_previous_checkpoint),
      cmocka_unit_test(subdirectory_names_from_the_network_are_checked),
      cmocka_unit_test(export_holds_every_tensor_whole),
      cmocka_unit_test(snapshot_then_restore_gives_an_identical_shard),
      cmocka_unit_test(snapshot_of_a_future_step_sees_exactly_that_version),
      cmocka_unit_test(snapshot_wait_ends_by_deadline_or_cancel),
      cmocka_unit_test(restore_drops_the_pending_step_and_answers_later_steps_behind),
      cmocka_unit_test(client_state_is_committed_by_its_apply_and_snapshotted_and_restored),
  };
  /* One test by name (a cmocka pattern), as python.test_full_disk_tests_in_ci
   * runs the full-disk one without the right to mount. */
  const char *only = getenv("ZS_TEST_FILTER");
  if (only && only[0])
    cmocka_set_test_filter(only);
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
