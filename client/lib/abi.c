/*
 * abi — the caller's struct sizes: the one place that applies the growth
 * rules at the top of zshard.h. Every zs_ function that takes or fills a
 * public struct goes through these three helpers, so that "read what the
 * caller has, default what it lacks, refuse what we do not know, never write
 * past its end" is written once.
 */
#include <stddef.h>
#include <string.h>

#include "internal.h"

/* Rule 3: no public struct ends in padding. Were there padding, a field a
 * newer header appends could land in it, inside the library's own sizeof,
 * where zc_struct_read would neither honour it nor refuse it. Appending a
 * field without updating the last field named here breaks the build. */
#define ZC_ENDS_AT(type, last)                                                                     \
  _Static_assert(sizeof(type) == offsetof(type, last) + sizeof(((type *)0)->last),                 \
                 #type " must end with " #last " and have no tail padding (zshard.h, rule 3)");    \
  _Static_assert(sizeof(type) % sizeof(size_t) == 0, #type)
ZC_ENDS_AT(zs_loss_scaler, last_overflow_iter);
ZC_ENDS_AT(zs_client_options, tcp_pacing_mbit);
ZC_ENDS_AT(zs_step_options, group_dampening);
ZC_ENDS_AT(zs_group_options, pull_dtype);
ZC_ENDS_AT(zs_timing, retries);
ZC_ENDS_AT(zs_step_result, member_rank);
ZC_ENDS_AT(zs_estimate_input, optimizer_bytes);
ZC_ENDS_AT(zs_estimate_row, gated_seconds);

int zc_struct_check(size_t size, const char *fn, const char *init) {
  if (size < sizeof(size_t) || size > ZC_STRUCT_SIZE_MAX || size % sizeof(size_t) != 0)
    return zc_fail(ZS_EINVAL,
                   "%s: struct_size %zu is not the size of a struct initialised with %s "
                   "(a multiple of %zu up to %u)",
                   fn, size, init, sizeof(size_t), ZC_STRUCT_SIZE_MAX);
  return ZS_OK;
}

int zc_struct_read(void *dst, size_t own, const void *src, const char *fn, const char *init) {
  size_t size;
  memcpy(&size, src, sizeof size); /* every public struct starts with it */
  int rc = zc_struct_check(size, fn, init);
  if (rc != ZS_OK)
    return rc;
  const unsigned char *s = src;
  for (size_t i = own; i < size; i++)
    if (s[i] != 0)
      return zc_fail(ZS_EUNIMPL,
                     "%s: the caller's struct has %zu bytes and sets byte %zu, beyond the %zu "
                     "this libzshard knows: a field of a newer zshard.h that this library "
                     "cannot honour",
                     fn, size, i, own);
  memcpy(dst, src, size < own ? size : own);
  memcpy(dst, &own, sizeof own); /* dst is the library's struct now */
  return ZS_OK;
}

void zc_struct_write(void *dst, size_t size, const void *src, size_t own) {
  unsigned char *d = dst;
  memcpy(d, src, size < own ? size : own);
  if (size > own)
    memset(d + own, 0, size - own);
  memcpy(d, &size, sizeof size);
}
