/*
 * zshard's shared vocabulary: the status codes, the dtypes, the optimizers,
 * the state arrays, the version and the functions that name them.
 *
 * The client's public header (<zshard/zshard.h>) includes this one, and it is
 * the only part of the public API that common/ and server/ use: the server
 * builds without client/. Everything here is part of libzshard's ABI and
 * follows the rules written at the top of zshard.h.
 */
#ifndef ZSHARD_TYPES_H
#define ZSHARD_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ZS_BUILDING_LIBRARY)
#define ZS_EXTERN __attribute__((visibility("default")))
#else
#define ZS_EXTERN
#endif

#define ZS_VERSION_MAJOR 0
#define ZS_VERSION_MINOR 2
#define ZS_VERSION_PATCH 0

/*
 * The one list of status codes. Columns: name, value, gRPC status code the
 * server answers with, and the sentence zs_strerror() returns. The list
 * generates the enum, zs_strerror(), zs_err_name() and the gRPC mapping, so a
 * new code is added here and nowhere else.
 */
/* clang-format off */
#define ZS_STATUS_MAP(XX)                                                           \
  XX(OK, 0, 0, "success")                                                           \
  XX(EINVAL, -1, 3, "invalid argument")                                             \
  XX(ENOMEM, -2, 8, "out of memory")                                                \
  XX(ENOTFOUND, -3, 5, "no such tensor, slice or job")                              \
  XX(EHASH, -4, 9, "model spec hash does not match the shard's job")                \
  XX(ESTEP, -5, 11, "step is not the one the shard expects")                        \
  XX(ESIZE, -6, 3, "payload length does not match the slice")                       \
  XX(EDTYPE, -7, 3, "unsupported dtype")                                            \
  XX(ETIMEDOUT, -8, 4, "timed out")                                                 \
  XX(ECONN, -9, 14, "connection to a shard failed")                                 \
  XX(EPROTO, -10, 3, "malformed message")                                           \
  XX(ECRC, -11, 15, "checksum mismatch")                                            \
  XX(ECLOSED, -12, 14, "closed or shutting down")                                   \
  XX(EEXIST, -13, 6, "conflicting state already exists")                            \
  XX(ENOTOPEN, -14, 9, "no job is open on this shard")                              \
  XX(ENOTREADY, -15, 9, "not ready: contributions or initial weights missing")      \
  XX(ENONFINITE, -16, 3, "non-finite gradient: the step must be skipped")           \
  XX(EIO, -17, 13, "I/O error")                                                     \
  XX(EINTERNAL, -18, 13, "internal error")                                          \
  XX(EUNIMPL, -19, 12, "not implemented")                                           \
  XX(EBEHIND, -20, 9, "shard is behind the cluster")                                \
  XX(ECANCELED, -21, 1, "canceled")                                                 \
  XX(ERANGE, -22, 11, "value out of range")                                         \
  XX(EUNAUTHENTICATED, -23, 16, "no or a wrong token")                             \
  XX(EPERM, -24, 7, "the token's role may not do this")                           \
  XX(ELIMIT, -25, 8, "a server limit was reached")                                 \
  XX(ENOTPRIMARY, -26, 9, "this replica is not its shard's primary")               \
  XX(ESTALE, -27, 10, "a newer term of the shard's replica set exists")           \
  XX(ELEFT, -28, 9, "this rank is not a member of the step: it left or timed out")
/* clang-format on */

typedef enum zs_status {
#define ZS__STATUS_ENUM(name, value, grpc, msg) ZS_##name = value,
  ZS_STATUS_MAP(ZS__STATUS_ENUM)
#undef ZS__STATUS_ENUM
} zs_status;

/* Element types on the wire and in caller buffers. Values match the proto. */
typedef enum zs_dtype {
  ZS_DTYPE_FP32 = 1,
  ZS_DTYPE_FP16 = 2,
  ZS_DTYPE_BF16 = 3,
  /* Block-quantized int8: blocks of 128 elements, each an fp32 scale then
   * 128 int8 (the last block of an array may be short); x = q * scale.
   * 1.03 bytes per element. docs/PROTOCOL.md specifies it. For wire
   * buffers (push_dtype, pull_dtype, zs_push, zs_pull), not for the shards'
   * param_dtype. */
  ZS_DTYPE_INT8_BLOCK = 4,
} zs_dtype;

/* Optimizers a param group can use. Values match the proto. */
typedef enum zs_optimizer {
  ZS_OPTIM_ADAMW = 0,
  ZS_OPTIM_ADAM = 1,
  ZS_OPTIM_SGD = 2,
  /* Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled
   * weight decay; beta1, beta2 and weight_decay are its hyper-parameters. */
  ZS_OPTIM_LION = 3,
} zs_optimizer;

/* The arrays of a tensor's optimizer state on the shards (zs_state_read,
 * zs_state_write). Values match the proto's StateArray. */
typedef enum zs_state_array {
  ZS_STATE_MASTER = 1,     /* the fp32 master weights */
  ZS_STATE_EXP_AVG = 2,    /* Adam(W)'s exp_avg; SGD's momentum_buffer */
  ZS_STATE_EXP_AVG_SQ = 3, /* Adam(W)'s exp_avg_sq */
} zs_state_array;

/* The name torch gives array `which` ("master", "exp_avg", "exp_avg_sq"), or
 * "?" for a value that is not a zs_state_array; a static string. */
ZS_EXTERN const char *zs_state_array_name(int which);

/* The library's version as "major.minor.patch"; a static string. */
ZS_EXTERN const char *zs_version(void);

/* A sentence describing status `err`; a static string, never NULL. */
ZS_EXTERN const char *zs_strerror(int err);

/* The symbolic name of status `err` ("ZS_EINVAL"); a static string. */
ZS_EXTERN const char *zs_err_name(int err);

/* Bytes per element of `dtype`, or 0 for a value that is not a zs_dtype and
 * for a block-quantized dtype, whose elements share per-block scales and so
 * have no size of their own: use zs_dtype_bytes to size buffers. */
ZS_EXTERN size_t zs_dtype_size(int dtype);

/* Bytes that `numel` elements of `dtype` take in a buffer or on the wire, or
 * 0 for a value that is not a zs_dtype. For fp32, fp16 and bf16 this is
 * numel * zs_dtype_size(dtype); a block-quantized dtype adds its scales (one
 * per started block). The nbytes of zs_push and zs_pull must equal it. */
ZS_EXTERN size_t zs_dtype_bytes(int dtype, size_t numel);

#ifdef __cplusplus
}
#endif
#endif /* ZSHARD_TYPES_H */
