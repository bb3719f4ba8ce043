/*
 * estimate — the memory and traffic model of `zshard estimate`, beside the
 * data-parallel family it replaces. The formulas are documented with their
 * assumptions in docs/CLIENT.md ("zshard estimate"); in short, with P
 * parameters, L in the largest layer, W trainers, N shards, g and p the bytes
 * of a gradient and of a parameter element on the wire, K = 12 bytes of fp32
 * optimizer state per parameter (master, Adam's m and v), B the link speed:
 *
 *   device bytes    dp (p+g+K)P        zero1 (p+g)P + KP/W
 *                   zero2 pP + (g+K)P/W  zero3 (p+g+K)P/W + (2p+g)L
 *                   zshard (2p+g)L     (one layer's parameters and gradient,
 *                                       and the next layer's prefetch)
 *   shard bytes     zshard 18P/N (master, m, v, accumulator 4 each, 2-byte copy)
 *   trainer wire    dp 2g P(W-1)/W each way; zero1, zero2 (g+p) P(W-1)/W;
 *                   zero3 (g+2p) P(W-1)/W; zshard sends gP, receives pP
 *                   (2pP when parameters are pulled again in backward)
 *   comm time       the busier direction of the busiest NIC over B (links are
 *                   full duplex); for zshard the shards' NICs count too: a
 *                   shard receives WgP/N and sends WpP/N (x2) per step.
 */
#include <math.h>
#include <string.h>

#include "common/dtype.h"
#include "internal.h"

#define EST_OPTIM_BYTES 12.0 /* fp32 master + m + v */
#define EST_SHARD_BYTES 18.0 /* + fp32 accumulator + 16-bit copy */

void zs_estimate_input_init(zs_estimate_input *in) {
  if (!in)
    return;
  memset(in, 0, sizeof *in);
  in->struct_size = sizeof *in;
  in->trainers = 1;
  in->shards = 1;
  in->grad_dtype = ZS_DTYPE_BF16;
  in->param_dtype = ZS_DTYPE_BF16;
  in->trainer_gbps = 100.0;
}

static double max2(double a, double b) {
  return a > b ? a : b;
}

int zs_estimate(const zs_estimate_input *in, zs_estimate_row *rows, size_t nrows) {
  if (!in || !rows)
    return zc_fail(ZS_EINVAL, "zs_estimate: input and rows must not be NULL");
  if (in->struct_size != sizeof *in)
    return zc_fail(ZS_EINVAL, "zs_estimate: input not initialised with zs_estimate_input_init");
  if (nrows < ZS_STRATEGY_COUNT)
    return zc_fail(ZS_EINVAL, "zs_estimate: rows must have room for %d entries",
                   (int)ZS_STRATEGY_COUNT);
  if (in->params == 0 || in->trainers == 0 || in->shards == 0)
    return zc_fail(ZS_EINVAL, "zs_estimate: params, trainers and shards must be positive");
  if (in->largest_layer > in->params)
    return zc_fail(ZS_EINVAL, "zs_estimate: the largest layer cannot exceed the parameter count");
  /* Bytes per element, averaged over the model: a block-quantized dtype's
   * scales are spread over its elements. */
  uint64_t g = dtype_bytes(in->grad_dtype, in->params),
           p = dtype_bytes(in->param_dtype, in->params);
  if (g == 0 || p == 0)
    return zc_fail(ZS_EDTYPE, "zs_estimate: grad_dtype and param_dtype must be zs_dtype values");
  if (!(in->trainer_gbps > 0) || !isfinite(in->trainer_gbps) || !(in->shard_gbps >= 0) ||
      !isfinite(in->shard_gbps))
    return zc_fail(ZS_EINVAL, "zs_estimate: link speeds must be positive and finite");

  const double P = (double)in->params;
  const double L = (double)(in->largest_layer ? in->largest_layer : in->params);
  const double W = in->trainers, N = in->shards;
  const double G = (double)g / P, Pb = (double)p / P, K = EST_OPTIM_BYTES;
  const double bt = in->trainer_gbps * 1e9 / 8.0;
  const double bs = (in->shard_gbps > 0 ? in->shard_gbps : in->trainer_gbps) * 1e9 / 8.0;
  const double ring = (W - 1.0) / W; /* a ring collective moves (W-1)/W per byte */
  static const char *const names[ZS_STRATEGY_COUNT] = {"dp", "zero1", "zero2", "zero3", "zshard"};

  memset(rows, 0, ZS_STRATEGY_COUNT * sizeof *rows);
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    rows[i].strategy = (zs_strategy)i;
    rows[i].name = names[i];
  }
  rows[ZS_STRATEGY_DP].device_bytes = (Pb + G + K) * P;
  rows[ZS_STRATEGY_DP].sent_bytes = 2.0 * G * P * ring;
  rows[ZS_STRATEGY_ZERO1].device_bytes = (Pb + G) * P + K * P / W;
  rows[ZS_STRATEGY_ZERO1].sent_bytes = (G + Pb) * P * ring;
  rows[ZS_STRATEGY_ZERO2].device_bytes = Pb * P + (G + K) * P / W;
  rows[ZS_STRATEGY_ZERO2].sent_bytes = (G + Pb) * P * ring;
  rows[ZS_STRATEGY_ZERO3].device_bytes = (Pb + G + K) * P / W + (2.0 * Pb + G) * L;
  rows[ZS_STRATEGY_ZERO3].sent_bytes = (G + 2.0 * Pb) * P * ring;
  for (int i = ZS_STRATEGY_DP; i <= ZS_STRATEGY_ZERO3; i++) {
    /* Ring collectives send and receive the same amount on every device. */
    rows[i].received_bytes = rows[i].sent_bytes;
    rows[i].comm_seconds = rows[i].sent_bytes / bt;
  }

  zs_estimate_row *z = &rows[ZS_STRATEGY_ZSHARD];
  const double pulls = in->pull_in_backward ? 2.0 : 1.0;
  z->device_bytes = (2.0 * Pb + G) * L;
  z->shard_bytes = EST_SHARD_BYTES * P / N;
  z->sent_bytes = G * P;
  z->received_bytes = pulls * Pb * P;
  const double shard_in = W * G * P / N, shard_out = W * pulls * Pb * P / N;
  z->shard_wire_bytes = max2(shard_in, shard_out);
  z->comm_seconds = max2(max2(z->sent_bytes, z->received_bytes) / bt, z->shard_wire_bytes / bs);
  return ZS_OK;
}
