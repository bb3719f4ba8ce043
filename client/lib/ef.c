/*
 * ef — error feedback: per tensor, the residual a lossy wire dtype left of
 * the last push, added to the next gradient before it is encoded
 * (zc_ef_apply_locked), and rescaled or dropped after a step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

/* Elements converted at a time: whole blocks of every dtype, on the stack. */
#define EF_CHUNK 2048
_Static_assert(EF_CHUNK % DTYPE_MAX_BLOCK == 0, "EF chunks hold whole blocks");

void zc_ef_free(struct zs_client *c) {
  if (!c->ef_resid)
    return;
  for (uint32_t t = 0; t < c->sp.num_tensors; t++)
    free(c->ef_resid[t]);
  free(c->ef_resid);
  c->ef_resid = NULL;
}

/* Error feedback, with ef_mu held: v = g + r, and r = v - decode(encode(v))
 * with the wire dtype's blocks starting at every piece, as the pushes encode
 * them; *out gets v (the caller's to free). A non-finite v (an overflowed
 * step, which the shards will skip) leaves a zero residual, so one bad step
 * does not poison the next ones. Two passes over the tensor, no allocation
 * but v (and r at the tensor's first push). */
int zc_ef_apply_locked(zs_client *c, uint32_t tensor, const float *g, zs_dtype wire, float **out) {
  uint64_t numel = c->sp.tensors[tensor].numel;
  if (!c->ef_resid && !(c->ef_resid = calloc(c->sp.num_tensors, sizeof *c->ef_resid)))
    return ZS_ENOMEM;
  float *r = c->ef_resid[tensor];
  if (!r && !(r = c->ef_resid[tensor] = calloc((size_t)numel, sizeof *r)))
    return ZS_ENOMEM;
  float *v = malloc((size_t)numel * sizeof *v);
  if (!v)
    return ZS_ENOMEM;
  unsigned char q[EF_CHUNK * sizeof(float)]; /* no wire dtype takes more than fp32 */
  float back[EF_CHUNK];
  uint32_t first = c->lay.tensor_first[tensor], npieces = layout_tensor_pieces(&c->lay, tensor);
  for (uint32_t p = 0; p < npieces; p++) {
    const layout_piece *pc = &c->lay.pieces[first + p];
    for (uint64_t e = 0; e < pc->numel; e += EF_CHUNK) {
      size_t n = (size_t)(pc->numel - e < EF_CHUNK ? pc->numel - e : EF_CHUNK);
      size_t o = (size_t)(pc->offset + e);
      for (size_t i = 0; i < n; i++)
        v[o + i] = g[o + i] + r[o + i];
      dtype_from_f32(wire, v + o, q, n);
      dtype_to_f32(wire, q, back, n);
      for (size_t i = 0; i < n; i++) {
        float d = v[o + i] - back[i];
        r[o + i] = isfinite(d) ? d : 0.0f;
      }
    }
  }
  *out = v;
  return ZS_OK;
}

void zc_ef_after_step(struct zs_client *c, int skipped, double rescale) {
  pthread_mutex_lock(&c->ef_mu);
  for (uint32_t t = 0; c->ef_resid && t < c->sp.num_tensors; t++) {
    float *r = c->ef_resid[t];
    uint64_t n = c->sp.tensors[t].numel;
    if (!r)
      continue;
    if (skipped)
      memset(r, 0, (size_t)n * sizeof *r);
    else if (rescale != 1.0)
      for (uint64_t i = 0; i < n; i++)
        r[i] = (float)((double)r[i] * rescale);
  }
  pthread_mutex_unlock(&c->ef_mu);
}
