/*
 * convert — tensor bytes from one dtype to another (or copied when the two
 * are the same), as pushes, pulls, prefetch slots and the data plane need.
 */
#include <stdint.h>
#include <string.h>

#include "common/base/dtype.h"
#include "internal.h"
#include "transfer.h"

/* Whole blocks of any dtype (dtype.h), 4 KiB of floats on the stack. */
#define CONVERT_CHUNK (4 * DTYPE_MAX_BLOCK)

void zc_convert(void *dst, zs_dtype dd, const void *src, zs_dtype sd, size_t n) {
  if (dd == sd) {
    memcpy(dst, src, (size_t)dtype_bytes(dd, n));
    return;
  }
  if (dd == ZS_DTYPE_FP32) {
    dtype_to_f32(sd, src, dst, n);
    return;
  }
  if (sd == ZS_DTYPE_FP32 && ((uintptr_t)src % _Alignof(float)) == 0) {
    dtype_from_f32(dd, src, dst, n);
    return;
  }
  /* 16-bit to another 16-bit format, or unaligned fp32: through an aligned
   * float chunk on the stack, so no allocation is needed. A chunk holds whole
   * blocks, so the one at element i starts at byte dtype_bytes(i). */
  float tmp[CONVERT_CHUNK];
  const unsigned char *s = src;
  unsigned char *d = dst;
  for (size_t i = 0; i < n; i += CONVERT_CHUNK) {
    size_t k = n - i < CONVERT_CHUNK ? n - i : CONVERT_CHUNK;
    if (sd == ZS_DTYPE_FP32)
      memcpy(tmp, s + i * sizeof(float), k * sizeof(float));
    else
      dtype_to_f32(sd, s + dtype_bytes(sd, i), tmp, k);
    dtype_from_f32(dd, tmp, d + dtype_bytes(dd, i), k);
  }
}
