/*
 * ckpt_format — private to server/ckpt_*.c: what the checkpoint writer, the
 * reader and the manifest share (the section encodings of ckpt_format.c and
 * the file and path helpers of ckpt_manifest.c). The public API is ckpt.h.
 *
 * Every multi-byte integer of the header, the table and the small sections is
 * encoded little-endian byte by byte; the fp32 arenas are written as they lie
 * in memory, which is little-endian on every host this builds on (checked
 * below), so a reader on any machine can decode them as '<f4'.
 */
#ifndef ZSHARD_SERVER_CKPT_FORMAT_H
#define ZSHARD_SERVER_CKPT_FORMAT_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common/model/layout.h"
#include "common/model/spec.h"
#include "server/ckpt/ckpt.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "checkpoint arenas are written as little-endian fp32 straight from memory");

#define CKPT_MAX_SECTIONS 16u
#define CKPT_IO_BLOCK ((size_t)8 << 20) /* bytes per write/read call */

/* ------------------------------------------------------------------------ */
/* Section encodings (ckpt_format.c)                                         */
/* ------------------------------------------------------------------------ */

/* A growable byte string for the small sections. Zero-initialise it; the
 * caller owns p and frees it. A failed allocation sets oom and makes every
 * later append a no-op, so a sequence of appends is checked once at its end. */
typedef struct bytes {
  uint8_t *p;
  size_t len, cap;
  int oom;
} bytes;

/* Appends n bytes copied from src (borrowed for the call). */
void ckpt__bytes_raw(bytes *b, const void *src, size_t n);

/* Appends the spec section of s: the spec's canonical encoding. */
void ckpt__enc_spec(bytes *b, const spec *s);

/* Decodes and validates an untrusted spec section of n bytes at p into *out,
 * which the caller then owns (spec_free) on success; on failure *out holds
 * nothing and why says what is wrong. Returns 0 or a ZS_ status. */
int ckpt__dec_spec(const uint8_t *p, size_t n, spec *out, char *why, size_t whylen);

/* Appends the optimizer section of s at optimizer_steps. */
void ckpt__enc_optimizer(bytes *b, const spec *s, uint64_t optimizer_steps);

/* Appends the pieces section of shard `shard` under layout l. */
void ckpt__enc_pieces(bytes *b, const layout *l, uint32_t shard);

/* Appends the members section of an elastic job of world_size ranks
 * (CKPT_SEC_MEMBERS; the encoding is in docs/CHECKPOINTS.md) as file format
 * fmt has it: 3 adds the flag timeout after the log; 2 (tests only) not. */
void ckpt__enc_members(bytes *b, const core_member_state *ms, uint32_t world_size, uint32_t fmt);

/* Decodes an untrusted members section of n bytes at p for a spec of
 * world_size ranks and a checkpoint of `version` in file format fmt (2 or
 * 3): every count is checked against the bytes left and its bound, every
 * rank against world_size (ascending, no repeat), the log's steps ascending
 * from 1 to version, the timeouts against CORE_MAX_TRAINER_TIMEOUT_MS (a
 * format 2 section has no flag timeout: 0), and nothing may follow. On
 * success *out is the caller's (free its log, then it); on failure *out is
 * NULL and why says what is wrong (ZS_EPROTO, or ZS_ENOMEM). */
int ckpt__dec_members(const uint8_t *p, size_t n, uint32_t world_size, uint64_t version,
                      uint32_t fmt, core_member_state **out, char *why, size_t whylen);

/* Sets *m and *v to whether shard `shard` keeps m and v arenas. */
void ckpt__shard_uses(const spec *s, const layout *l, uint32_t shard, int *m, int *v);

/* The name of a section kind for messages (a static string). */
const char *ckpt__section_name(uint32_t kind);

/* ------------------------------------------------------------------------ */
/* Files and paths (ckpt_manifest.c)                                         */
/* ------------------------------------------------------------------------ */

/* Reads exactly n bytes at off into buf; 0, or -1 with errno (ENODATA when
 * the file ends first). */
int ckpt__pread_full(int fd, void *buf, size_t n, uint64_t off);

/* fsyncs directory dir; 0, or -1 with errno. */
int ckpt__fsync_dir(const char *dir);

/* Opens a state file for reading without ever blocking in open(): a FIFO
 * or a device named like a checkpoint file or MANIFEST would hang a plain
 * open() (and startup with it, deaf to SIGTERM), so the file is opened
 * O_NONBLOCK and fstat'ed to be a regular file. Returns 0 and the fd in
 * *fd, ZS_ENOTFOUND when it does not exist, or ZS_EIO with a sentence. */
int ckpt__open_read(const char *path, int *fd, char *err, size_t errlen);

/* open(path, O_WRONLY | O_CREAT | O_TRUNC) for a file this process is about
 * to write, with the same guard: a FIFO in its place fails (ENXIO without a
 * reader, EINVAL once fstat sees it) instead of blocking. Returns the fd, or
 * -1 with errno. */
int ckpt__open_write(const char *path);

/* Writes "<dir>/<name>" into buf; ZS_EINVAL when it does not fit in len. */
int ckpt__join_path(char *buf, size_t len, const char *dir, const char *name);

/* ------------------------------------------------------------------------ */
/* Confined file operations (ckpt_fs.c)                                      */
/* ------------------------------------------------------------------------ */

/* The ckpt__fs_* calls take whole paths. A path below a directory confined
 * with ckpt_fs_confine is resolved from that directory's descriptor without
 * following any symbolic link (ELOOP instead); any other path behaves as the
 * plain call would. Each returns what the plain call returns, with errno. */
int ckpt__fs_open(const char *path, int flags, mode_t mode);
int ckpt__fs_lstat(const char *path, struct stat *sb);
int ckpt__fs_unlink(const char *path, int flags); /* flags: 0 or AT_REMOVEDIR */
int ckpt__fs_rename(const char *from, const char *to);
DIR *ckpt__fs_opendir(const char *path);
/* Creates a confined directory and its missing parents below the anchor:
 * 0, -1 with errno, or 1 when dir is under no anchor (nothing done). */
int ckpt__fs_mkdirs(const char *dir);
/* strerror, with a sentence naming the link for ELOOP. */
const char *ckpt__fs_strerror(int e);
/* The status for a failed confined open: ZS_EPERM for a link, ZS_ENOTFOUND
 * for ENOENT, ZS_EIO otherwise. */
int ckpt__fs_status(int e);
/* Test hook: 1 makes every resolution walk component by component, as on a
 * kernel without openat2. */
void ckpt__fs_force_component_walk(int on);

#endif
