/*
 * error — the per-thread sentence behind zs_last_error(). A status code says
 * what kind of failure happened; the sentence says where (shard, address,
 * tensor, rank) and what the server said, which is what a user needs to act.
 * It is thread-local so that concurrent calls never see each other's text.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char tls_error[ZC_ERR_LEN];

const char *zs_last_error(void) {
  return tls_error;
}

int zc_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tls_error, sizeof tls_error, fmt, ap);
  va_end(ap);
  return err;
}

int zc_fail_msg(int err, const char *msg) {
  snprintf(tls_error, sizeof tls_error, "%s", msg ? msg : zs_strerror(err));
  return err;
}
