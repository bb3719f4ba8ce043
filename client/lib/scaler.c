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
#include <string.h>

#include "internal.h"

void zs_loss_scaler_init(zs_loss_scaler *s) {
  if (!s)
    return;
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
}

int zs_loss_scaler_update(zs_loss_scaler *s, int overflow) {
  if (!s || s->struct_size != sizeof *s)
    return zc_fail(ZS_EINVAL, "zs_loss_scaler_update: scaler is NULL or not initialised with "
                              "zs_loss_scaler_init");
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
