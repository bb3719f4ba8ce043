#include "common/base/status.h"

#include "common/base/dtype.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

const char *zs_strerror(int err) {
  switch (err) {
#define ZS__STATUS_STR(name, value, grpc, msg)                                                     \
  case value:                                                                                      \
    return msg;
    ZS_STATUS_MAP(ZS__STATUS_STR)
#undef ZS__STATUS_STR
  }
  return "unknown error";
}

const char *zs_err_name(int err) {
  switch (err) {
#define ZS__STATUS_NAME(name, value, grpc, msg)                                                    \
  case value:                                                                                      \
    return "ZS_" #name;
    ZS_STATUS_MAP(ZS__STATUS_NAME)
#undef ZS__STATUS_NAME
  }
  return "ZS_UNKNOWN";
}

int status_valid(int err) {
  switch (err) {
#define ZS__STATUS_VALID(name, value, grpc, msg)                                                   \
  case value:                                                                                      \
    return 1;
    ZS_STATUS_MAP(ZS__STATUS_VALID)
#undef ZS__STATUS_VALID
  }
  return 0;
}

int status_to_grpc(int err) {
  switch (err) {
#define ZS__STATUS_GRPC(name, value, grpc, msg)                                                    \
  case value:                                                                                      \
    return grpc;
    ZS_STATUS_MAP(ZS__STATUS_GRPC)
#undef ZS__STATUS_GRPC
  }
  return 2; /* GRPC_STATUS_UNKNOWN */
}

int status_from_grpc(int grpc_code) {
  /* Several zs codes share a gRPC code; without the server's "zs-status"
   * trailer the most general one is the honest answer. */
  switch (grpc_code) {
  case 0:
    return ZS_OK;
  case 1:
    return ZS_ECANCELED;
  case 3:
    return ZS_EINVAL;
  case 4:
    return ZS_ETIMEDOUT;
  case 5:
    return ZS_ENOTFOUND;
  case 6:
    return ZS_EEXIST;
  case 7:
    return ZS_EPERM;
  case 8:
    return ZS_ELIMIT;
  case 9:
    return ZS_ENOTREADY;
  case 10:
    return ZS_ESTALE;
  case 11:
    return ZS_ERANGE;
  case 12:
    return ZS_EUNIMPL;
  case 14:
    return ZS_ECONN;
  case 15:
    return ZS_ECRC;
  case 16:
    return ZS_EUNAUTHENTICATED;
  default:
    return ZS_EINTERNAL;
  }
}

size_t zs_dtype_size(int dtype) {
  const dtype_codec *k = dtype_codec_of(dtype);
  return k && k->block == 1 && k->scale_bytes == 0 ? k->elem_bytes : 0;
}

size_t zs_dtype_bytes(int dtype, size_t numel) {
  return (size_t)dtype_bytes(dtype, numel);
}

const char *zs_version(void) {
#define ZS__STR2(x) #x
#define ZS__STR(x) ZS__STR2(x)
  return ZS__STR(ZS_VERSION_MAJOR) "." ZS__STR(ZS_VERSION_MINOR) "." ZS__STR(ZS_VERSION_PATCH);
}

void status_say(char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
}

int status_fail(char *err, size_t errlen, int status, const char *fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return status;
}

const char *zs_state_array_name(int which) {
  switch (which) {
  case ZS_STATE_MASTER:
    return "master";
  case ZS_STATE_EXP_AVG:
    return "exp_avg";
  case ZS_STATE_EXP_AVG_SQ:
    return "exp_avg_sq";
  }
  return "?";
}
