/*
 * check — the arguments of a push or pull checked before anything is
 * submitted: the job open, the tensor known, the buffer's dtype, size and
 * alignment. Each failure sets the last error, naming the function.
 */
#include <inttypes.h>
#include <stdint.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

/* Checks that the job is open. */
int zc_check_opened(zs_client *c, const char *fn) {
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    return zc_fail(ZS_ENOTOPEN, "%s: the job is not open (call zs_open_job first)", fn);
  return ZS_OK;
}

/* Checks that the open job has the tensor. Once opened, the spec and the
 * layout never change: read without lock. */
int zc_check_tensor_id(zs_client *c, const char *fn, uint32_t tensor) {
  if (tensor >= c->sp.num_tensors)
    return zc_fail(ZS_ENOTFOUND, "%s: no tensor %" PRIu32 " (the model has %" PRIu32 ")", fn,
                   tensor, c->sp.num_tensors);
  return ZS_OK;
}

/* Checks that the job is open and has the tensor. */
int zc_check_tensor(zs_client *c, const char *fn, uint32_t tensor) {
  int rc = zc_check_opened(c, fn);
  return rc != ZS_OK ? rc : zc_check_tensor_id(c, fn, tensor);
}

/* Checks the arguments shared by push and pull, the job being open. */
int zc_check_entry(zs_client *c, const char *fn, uint32_t tensor, const void *buf, zs_dtype dtype,
                   size_t nbytes) {
  int rc = zc_check_tensor_id(c, fn, tensor);
  if (rc != ZS_OK)
    return rc;
  if (!dtype_valid((int)dtype))
    return zc_fail(ZS_EDTYPE, "%s: dtype %d is not %s", fn, (int)dtype, dtype_names());
  if (!buf)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is NULL", fn,
                   zc_tensor_name(c, tensor));
  /* A block-quantized dtype is a wire format only: its blocks restart in
   * every piece, so a tensor split over shards is not one array of it. */
  size_t es = zs_dtype_size(dtype);
  if (es == 0)
    return zc_fail(ZS_EDTYPE,
                   "%s: %s is a wire dtype (push_dtype, pull_dtype), not a buffer dtype: pass "
                   "an fp32, fp16 or bf16 buffer",
                   fn, dtype_codec_of((int)dtype)->name);
  uint64_t numel = c->sp.tensors[tensor].numel, want = dtype_bytes(dtype, numel);
  if ((uint64_t)nbytes != want)
    return zc_fail(ZS_ESIZE,
                   "%s: tensor '%s' has %" PRIu64 " elements = %" PRIu64
                   " bytes of this dtype, the buffer is %zu bytes",
                   fn, zc_tensor_name(c, tensor), numel, want, nbytes);
  if ((uintptr_t)buf % es != 0)
    return zc_fail(ZS_EINVAL, "%s: the buffer of tensor '%s' is not aligned to %zu bytes", fn,
                   zc_tensor_name(c, tensor), es);
  return ZS_OK;
}

/* Checks the arguments shared by push and pull. */
int zc_check_buffer(zs_client *c, const char *fn, uint32_t tensor, const void *buf, zs_dtype dtype,
                    size_t nbytes) {
  int rc = zc_check_opened(c, fn);
  return rc != ZS_OK ? rc : zc_check_entry(c, fn, tensor, buf, dtype, nbytes);
}
