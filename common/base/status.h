/*
 * status — the internal side of zs_status: mapping to and from gRPC codes.
 * zs_strerror / zs_err_name are public (zshard.h) and generated from the same
 * X-macro list in status.c.
 */
#ifndef ZSHARD_COMMON_STATUS_H
#define ZSHARD_COMMON_STATUS_H

#include <stddef.h>

#include "zshard/types.h"

/* The grpc_status_code a server answers `err` with. */
int status_to_grpc(int err);

/* The zs_status for a gRPC code received without a "zs-status" trailer. */
int status_from_grpc(int grpc_code);

/* 1 if `err` is a value of zs_status. */
int status_valid(int err);

/* Formats a sentence into err (when err is not NULL and errlen > 0) and
 * returns `status`: the one-line error return of every module that reports
 * why ("return status_fail(err, errlen, ZS_ESIZE, "...", ...)"). */
int status_fail(char *err, size_t errlen, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The same sentence where no status is returned with it (a message field
 * filled for later): formats into err (may be NULL or errlen 0). A sentence
 * too long for its buffer is cut, which is what a message field wants; going
 * through this function also spares the caller -Wformat-truncation. */
void status_say(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
