/*
 * scaler — dynamic loss scaling with DeepSpeed's DynamicLossScaler rules
 * (deepspeed/runtime/fp16/loss_scaler.py, consecutive_hysteresis off):
 *
 *   overflow:    if hysteresis is exhausted (cur_hysteresis == 1) the scale is
 *                divided by factor, not below min_scale; otherwise one unit of
 *                hysteresis is consumed and the scale stays. The iteration is
 *                remembered as the last overflow.
 *   no overflow: when (iter - last_overflow_iter) is a multiple of window, the
 *                hysteresis is restored and the scale multiplied by factor.
 *   iter counts every update.
 *
 * With the defaults (2^16, window 1000, hysteresis 2) a first overflow skips
 * the step without lowering the scale; a second one before the window has
 * passed halves it.
 */
#include <math.h>
#include <string.h>

#include "common/base/le.h"
#include "internal.h"

#define SCALER_BLOB_MAGIC "ZSLS"
#define SCALER_BLOB_VERSION 1u

void zs_loss_scaler_init_sized(zs_loss_scaler *out, size_t size) {
  if (!out || size < sizeof(size_t))
    return;
  zs_loss_scaler own, *s = &own;
  memset(s, 0, sizeof *s);
  s->struct_size = sizeof *s;
  s->scale = 65536.0;
  s->min_scale = 1.0;
  s->factor = 2.0;
  s->window = 1000;
  s->hysteresis = 2;
  s->cur_hysteresis = 2;
  s->iter = 0;
  s->last_overflow_iter = -1;
  zc_struct_write(out, size, s, sizeof *s);
}

/* The rules, on the library's own struct. */
static int scaler_update(zs_loss_scaler *s, int overflow) {
  if (!(s->scale > 0) || !(s->min_scale > 0) || !(s->factor >= 1) || s->window == 0 ||
      s->hysteresis == 0)
    return zc_fail(ZS_EINVAL, "zs_loss_scaler_update: scale, min_scale, factor, window and "
                              "hysteresis must be positive (factor >= 1)");
  if (overflow) {
    if (s->hysteresis == 1 || s->cur_hysteresis <= 1) {
      double next = s->scale / s->factor;
      s->scale = next < s->min_scale ? s->min_scale : next;
    } else {
      s->cur_hysteresis--;
    }
    s->last_overflow_iter = s->iter;
  } else if ((s->iter - s->last_overflow_iter) % (int64_t)s->window == 0) {
    s->cur_hysteresis = s->hysteresis;
    s->scale *= s->factor;
  }
  s->iter++;
  return ZS_OK;
}

int zs_loss_scaler_update(zs_loss_scaler *caller, int overflow) {
  if (!caller)
    return zc_fail(ZS_EINVAL, "zs_loss_scaler_update: scaler is NULL");
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  int rc = zc_struct_read(&s, sizeof s, caller, "zs_loss_scaler_update", "zs_loss_scaler_init");
  if (rc == ZS_OK)
    rc = scaler_update(&s, overflow);
  if (rc == ZS_OK)
    zc_struct_write(caller, caller->struct_size, &s, sizeof s);
  return rc;
}

/* ---- the state the shards carry --------------------------------------------
 *
 * Byte by byte little-endian, so that the blob means the same on every host
 * and a checkpoint reader in another language can decode it. */

void zc_scaler_encode(const zs_loss_scaler *s, uint8_t *out) {
  uint64_t bits;
  memcpy(&bits, &s->scale, sizeof bits);
  memcpy(out, SCALER_BLOB_MAGIC, 4);
  le_store(out + 4, SCALER_BLOB_VERSION, 4);
  le_store(out + 8, bits, 8);
  le_store(out + 16, s->cur_hysteresis, 4);
  le_store(out + 20, (uint64_t)s->iter, 8);
  le_store(out + 28, (uint64_t)s->last_overflow_iter, 8);
}

int zc_scaler_decode(zs_loss_scaler *s, const uint8_t *blob, size_t len) {
  if (!blob || len != ZC_SCALER_BLOB_BYTES || memcmp(blob, SCALER_BLOB_MAGIC, 4) != 0 ||
      le_load(blob + 4, 4) != SCALER_BLOB_VERSION)
    return 0;
  uint64_t bits = le_load(blob + 8, 8);
  double scale;
  memcpy(&scale, &bits, sizeof scale);
  int64_t iter = (int64_t)le_load(blob + 20, 8);
  int64_t last = (int64_t)le_load(blob + 28, 8);
  /* What zs_loss_scaler_update can produce: a positive finite scale, and the
   * last overflow (-1: none) before the next iteration. */
  if (!(scale > 0) || !isfinite(scale) || iter < 0 || last < -1 || last >= iter)
    return 0;
  s->scale = scale;
  s->cur_hysteresis = (uint32_t)le_load(blob + 16, 4);
  s->iter = iter;
  s->last_overflow_iter = last;
  return 1;
}
