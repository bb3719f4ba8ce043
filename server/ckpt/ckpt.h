/*
 * ckpt — the checkpoint files (the format is specified in docs/CHECKPOINTS.md):
 *
 *   <root>/step-<s>/shard-<i>-of-<N>.zsc   one per shard: header, section
 *                                          table, sections, each with CRC32C
 *   <root>/step-<s>/MANIFEST               the commit point: written once
 *                                          every shard's file is durable
 *
 * A checkpoint without a MANIFEST is never loaded. Files are written under a
 * temporary name, fsynced, renamed into place and their directory fsynced, so
 * a crash leaves either the old file or the new one, never a mix.
 *
 * Loading verifies everything (magic, format version, sizes, every CRC, the
 * spec's hash, the piece table against the layout the spec implies, the file's
 * size and CRC against the manifest) and every error names the file. Because
 * the layout is a function of the spec, a checkpoint written by N shards loads
 * into shard i of any N' shards (ckpt_load reads the pieces of the old files
 * that overlap the new shard's pieces).
 *
 * Nothing here is thread-safe across calls on one reader; distinct readers and
 * distinct files may be used from any threads. The format assumes a
 * little-endian host (checked at compile time), like the wire format.
 */
#ifndef ZSHARD_SERVER_CKPT_H
#define ZSHARD_SERVER_CKPT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model/layout.h"
#include "common/model/spec.h"
#include "server/core/core.h"

#define CKPT_MAGIC "ZSHDCKPT" /* 8 bytes, no terminator in the file */
/* Format 2 adds the members section, format 3 the flag timeout at its end
 * (the server-flag timeout in effect for the job); a file with the section
 * is written as format 3, one without as format 1 (the same bytes as
 * before), and 1, 2 and 3 are read. */
#define CKPT_FORMAT_VERSION 3u
#define CKPT_FORMAT_VERSION_MIN 1u
#define CKPT_HEADER_BYTES 128u
#define CKPT_ENTRY_BYTES 32u /* one section table entry */
#define CKPT_ALIGN 64u       /* sections start at multiples of this */
#define CKPT_MANIFEST "MANIFEST"
#define CKPT_NAME_MAX 64 /* file names within a step directory */
#define CKPT_PATH_MAX 4096

/* Section kinds, in the order a writer puts them. */
typedef enum ckpt_section {
  CKPT_SEC_SPEC = 1,       /* the spec's canonical encoding (spec.c) */
  CKPT_SEC_OPTIMIZER = 2,  /* optimizer step count and per-group config */
  CKPT_SEC_PIECES = 3,     /* this shard's piece table */
  CKPT_SEC_MASTER = 4,     /* fp32 master weights, the whole arena */
  CKPT_SEC_EXP_AVG = 5,    /* fp32 m arena: Adam's exp_avg, SGD's momentum */
  CKPT_SEC_EXP_AVG_SQ = 6, /* fp32 v arena: Adam's exp_avg_sq */
  /* Optional, written when the state has one: the trainers' client state of
   * the version (core_state.client_state), 1..CORE_MAX_CLIENT_STATE opaque
   * bytes. Files without it (older ones, or jobs that never sent one) load
   * with an empty client state. */
  CKPT_SEC_CLIENT_STATE = 7,
  /* Optional, written when a tensor of the shard's is at another step count
   * than the job (a parameter that went without a gradient): u64 per tensor
   * of the spec, its count (core_state.tensor_steps; meaningful for the
   * tensors with a piece in the file, the others hold the job's count).
   * Files without it load with every tensor at the job's count. */
  CKPT_SEC_TENSOR_STEPS = 8,
  /* Format 2, written for an elastic job (core_view.members): its own
   * trainer timeout, the membership counters, the members of the step after
   * the checkpointed version and the membership log. Files without it load
   * with every rank of W a member and the server's timeout. */
  CKPT_SEC_MEMBERS = 9,
} ckpt_section;

/* The three state arrays a reader can read from. */
typedef enum ckpt_array {
  CKPT_ARRAY_MASTER = 0,
  CKPT_ARRAY_EXP_AVG = 1,
  CKPT_ARRAY_EXP_AVG_SQ = 2,
} ckpt_array;

/* One shard's file as the manifest records it. */
typedef struct ckpt_file_info {
  uint32_t shard_id;
  char name[CKPT_NAME_MAX]; /* "shard-<i>-of-<N>.zsc" */
  uint64_t bytes;
  uint32_t crc32c; /* of the whole file */
} ckpt_file_info;

/* write() of all n bytes, through short writes and EINTR; 0 or -1 (errno). */
int ckpt_write_full(int fd, const void *buf, size_t n);

/* "shard-<i>-of-<n>.zsc" into buf. */
void ckpt_file_name(uint32_t shard_id, uint32_t num_shards, char *buf, size_t len);

/* "<root>/step-<s>" into buf; returns 0 or ZS_EINVAL when it does not fit. */
int ckpt_step_dir(const char *root, uint64_t step, char *buf, size_t len);

/* 1 if `rel` is an acceptable checkpoint directory below a state directory:
 * a relative path of at most 8 components of [A-Za-z0-9._-], none of them "."
 * or "..", at most 200 bytes (it comes from the network). */
int ckpt_valid_subdir(const char *rel);

/* Creates `dir` and its missing parents (mode 0755). Returns 0 or ZS_EIO with
 * a sentence naming the directory. */
int ckpt_mkdirs(const char *dir, char *err, size_t errlen);

/* ------------------------------------------------------------ confinement */

/* Confines every checkpoint path below `dir` (the server's state
 * directory): from now on the ckpt_* calls resolve such paths from a
 * descriptor of dir opened here, never following a symbolic link below it
 * (the link is refused with ZS_EPERM and a sentence naming it), for reads,
 * writes, listings and removals alike. dir itself may be a link; it is
 * resolved once, here. Counted: each call needs one ckpt_fs_release(dir).
 * Paths under no confined directory (the CLI's offline commands) are used
 * as given. Returns 0, ZS_EIO when dir cannot be opened, or ZS_ELIMIT past
 * 16 distinct directories in one process. */
int ckpt_fs_confine(const char *dir, char *err, size_t errlen);
void ckpt_fs_release(const char *dir);

/* ------------------------------------------------------------ writing */

typedef struct ckpt_write_opts {
  /* Checked between blocks of the write; when it becomes non-zero the write
   * stops with ZS_ECANCELED and its temporary file is removed. May be NULL. */
  const atomic_int *cancel;
  /* Test hook (ZSHARD_TEST_CKPT_STALL, docs/CHECKPOINTS.md): when `stall` is
   * set and the state's version is stall_step, the writer stops half way
   * through the temporary file, logs event=checkpoint_stalled and waits
   * until `cancel` is set (or the process is killed). */
  int stall;
  uint64_t stall_step;
} ckpt_write_opts;

/* Writes st (its spec's shard count and st->shard_id name the file) as
 * <root>/step-<version>/shard-<i>-of-<N>.zsc, creating the directories. A
 * MANIFEST already in the step directory is removed first (and the removal
 * made durable), so a checkpoint being rewritten is never loadable half old,
 * half new. On success *info describes the file. On failure nothing of this
 * write is left behind and the error names the path. `o` may be NULL. */
int ckpt_write_shard(const char *root, const core_state *st, const ckpt_write_opts *o,
                     ckpt_file_info *info, char *err, size_t errlen);

/* ------------------------------------------------------------ manifest */

typedef struct ckpt_manifest {
  uint64_t step, version, optimizer_steps, spec_hash;
  uint32_t num_shards;
  ckpt_file_info *files; /* owned, num_shards entries in shard order */
} ckpt_manifest;

/* Writes <root>/step-<m->step>/MANIFEST atomically (temporary file named
 * after `writer`, fsync, rename, directory fsync). The entries must be the
 * canonical names in shard order. */
int ckpt_manifest_write(const char *root, const ckpt_manifest *m, uint32_t writer, char *err,
                        size_t errlen);

/* Reads and checks <root>/step-<step>/MANIFEST into *m (freed with
 * ckpt_manifest_free). ZS_ENOTFOUND when there is none; ZS_ECRC / ZS_EPROTO
 * for a damaged one. */
int ckpt_manifest_read(const char *root, uint64_t step, ckpt_manifest *m, char *err, size_t errlen);
void ckpt_manifest_free(ckpt_manifest *m);

/* ------------------------------------------------------------ listing */

typedef struct ckpt_entry {
  uint64_t step;
  int complete;        /* a valid MANIFEST is present */
  uint32_t num_shards; /* from the manifest (0 when incomplete) */
  uint64_t spec_hash;  /* from the manifest (0 when incomplete) */
} ckpt_entry;

/* The step directories of root in ascending step order (*out owned by the
 * caller, free()d; *n may be 0). A missing root is an empty list. */
int ckpt_list(const char *root, ckpt_entry **out, size_t *n, char *err, size_t errlen);

/* Removes checkpoint `step`: its MANIFEST first (durably), then the shard
 * and temporary files, then the directory. */
int ckpt_remove(const char *root, uint64_t step, char *err, size_t errlen);

/* ------------------------------------------------------------ reading */

typedef struct ckpt_reader ckpt_reader;

typedef struct ckpt_header {
  uint32_t shard_id, num_shards;
  uint64_t spec_hash, version, optimizer_steps, nelems;
  int has_exp_avg, has_exp_avg_sq;
} ckpt_header;

/* Opens and verifies one shard file completely (one streaming read). With
 * `expect` (may be NULL) its size and whole-file CRC must match. On success
 * *out is the caller's, closed with ckpt_reader_close. */
int ckpt_reader_open(const char *path, const ckpt_file_info *expect, ckpt_reader **out, char *err,
                     size_t errlen);
void ckpt_reader_close(ckpt_reader *r);

/* The verified header, spec (as written, its num_shards the file's N) and the
 * layout of that spec; valid until ckpt_reader_close. */
const ckpt_header *ckpt_reader_header(const ckpt_reader *r);
const spec *ckpt_reader_spec(const ckpt_reader *r);
const layout *ckpt_reader_layout(const ckpt_reader *r);
/* The file's client state section (*len 0 and NULL without one); valid until
 * ckpt_reader_close. */
const unsigned char *ckpt_reader_client_state(const ckpt_reader *r, size_t *len);
/* The file's per-tensor step counts (spec.num_tensors of them, valid until
 * ckpt_reader_close), or NULL when it has none: every tensor is then at the
 * header's optimizer_steps. */
const uint64_t *ckpt_reader_tensor_steps(const ckpt_reader *r);
/* The file's membership (its members section, decoded and checked), or NULL
 * when it has none; valid until ckpt_reader_close. */
const core_member_state *ckpt_reader_members(const ckpt_reader *r);

/* Reads n elements of array `a` from arena element `first` into dst. */
int ckpt_reader_read(ckpt_reader *r, ckpt_array a, uint64_t first, uint64_t n, float *dst,
                     char *err, size_t errlen);

/* ------------------------------------------------------------ loading */

/* Loads complete checkpoint `step` of root as the state of shard `shard_id`
 * of `num_shards` into *out (initialised here; freed with core_state_free).
 * With the checkpoint's own shard count only that shard's file is read;
 * otherwise the files holding the elements of the new shard's pieces are (all
 * must be in the step directory). The client state is that shard's file's,
 * or when resharding the first present file's (every shard keeps the same
 * one). ZS_ENOTFOUND when the step has no MANIFEST. */
int ckpt_load(const char *root, uint64_t step, uint32_t shard_id, uint32_t num_shards,
              core_state *out, char *err, size_t errlen);

/* ------------------------------------------------------------ export */

typedef struct ckpt_export_opts {
  zs_dtype dtype; /* ZS_DTYPE_FP32 (default when 0), ZS_DTYPE_BF16 or ZS_DTYPE_FP16 */
  int moments;    /* also "<name>.exp_avg" / "<name>.exp_avg_sq" (and SGD's
                     "<name>.momentum_buffer"), always fp32 */
} ckpt_export_opts;

/* Writes checkpoint `step` of root as one safetensors file at `path`: every
 * tensor whole, with its name and shape, in spec order, and __metadata__
 * naming the job, step and optimizer step count. Tensor by tensor, so memory
 * stays at about the largest tensor. Written to a temporary name and renamed. */
int ckpt_export_safetensors(const char *root, uint64_t step, const char *path,
                            const ckpt_export_opts *o, char *err, size_t errlen);

#endif
