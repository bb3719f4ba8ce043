/*
 * estimate — the memory and traffic model of `zshard estimate`, beside the
 * data-parallel family it replaces. The formulas are documented with their
 * assumptions in docs/CLIENT.md ("zshard estimate"); in short, with P
 * parameters, L in the largest layer, W trainers, N shards, g and p the bytes
 * of a gradient and of a parameter element on the wire, K bytes of optimizer
 * state per parameter (12: fp32 master, Adam's m and v), B the link speed:
 *
 *   model states    dp (p+g+K)P        zero1 (p+g)P + KP/W
 *   (per trainer)   zero2 pP + (g+K)P/W  zero3 (p+g+K)P/W
 *                   zshard 0 (the trainer keeps no parameter between steps)
 *   working memory  zero3 and zshard (2p+g)L: one layer's parameters and
 *                   gradient and the next layer's prefetch; 0 for the others,
 *                   which hold every parameter anyway; 0 when L is not given
 *   shard bytes     zshard (K+6)P/N (K, accumulator 4, the 16-bit copy 2)
 *   trainer wire    dp 2g P(W-1)/W each way; zero1, zero2 (g+p) P(W-1)/W;
 *                   zero3 (g+2p) P(W-1)/W; zshard sends gP, receives pP
 *                   (2pP when parameters are pulled again in backward)
 *   comm time       the busier direction of the busiest NIC over B (links are
 *                   full duplex); for zshard the shards' NICs count too: a
 *                   shard receives WgP/N and sends WpP/N (x2) per step.
 *                   That is the bound with pushes and pulls overlapping.
 *   gated time      zshard's phases one after the other (the gated step):
 *                   push max(gP/Bt, WgP/(N Bs)) + pull max(pP/Bt, WpP/(N Bs))
 *                   (x2 for the pull); the ring collectives' comm time.
 *
 * With bf16 and K = 12 the model states are the ZeRO paper's (Rajbhandari et
 * al. 2020, figure 1): 16P for DP and 16P/W for ZeRO-3, 1.88 GB for 7.5B
 * parameters on 64 devices.
 */
#include <math.h>
#include <string.h>

#include "common/base/dtype.h"
#include "internal.h"

#define EST_OPTIM_BYTES 12u /* K by default: fp32 master + m + v */
#define EST_SHARD_EXTRA 6.0 /* a shard's fp32 accumulator + 16-bit copy */

void zs_estimate_input_init_sized(zs_estimate_input *out, size_t size) {
  if (!out || size < sizeof(size_t))
    return;
  zs_estimate_input own, *in = &own;
  memset(in, 0, sizeof *in);
  in->struct_size = sizeof *in;
  in->trainers = 1;
  in->shards = 1;
  in->grad_dtype = ZS_DTYPE_BF16;
  in->param_dtype = ZS_DTYPE_BF16;
  in->trainer_gbps = 100.0;
  zc_struct_write(out, size, in, sizeof *in);
}

static double max2(double a, double b) {
  return a > b ? a : b;
}

/* The rows, in the library's own struct. */
static void estimate(const zs_estimate_input *in, zs_estimate_row *rows);

int zs_estimate_sized(const zs_estimate_input *caller_in, zs_estimate_row *out, size_t nrows,
                      size_t row_size) {
  if (!caller_in || !out)
    return zc_fail(ZS_EINVAL, "zs_estimate: input and rows must not be NULL");
  zs_estimate_input own;
  zs_estimate_input_init(&own);
  int rc = zc_struct_read(&own, sizeof own, caller_in, "zs_estimate", "zs_estimate_input_init");
  if (rc != ZS_OK)
    return rc;
  rc = zc_struct_check(row_size, "zs_estimate: rows", "sizeof *rows");
  if (rc != ZS_OK)
    return rc;
  const zs_estimate_input *in = &own;
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
  zs_estimate_row rows[ZS_STRATEGY_COUNT];
  estimate(in, rows);
  /* Strided by the caller's row size: an older caller's rows are shorter. */
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++)
    zc_struct_write((char *)out + (size_t)i * row_size, row_size, &rows[i], sizeof rows[i]);
  return ZS_OK;
}

static void estimate(const zs_estimate_input *in, zs_estimate_row *rows) {
  const double P = (double)in->params;
  const double L = (double)in->largest_layer; /* 0: working memory not estimated */
  const double W = in->trainers, N = in->shards;
  /* Bytes per parameter through the codec table, so that a block-quantized
   * dtype counts its scales. */
  const double G = P > 0 ? (double)dtype_bytes((int)in->grad_dtype, in->params) / P : 0;
  const double Pb = P > 0 ? (double)dtype_bytes((int)in->param_dtype, in->params) / P : 0;
  const double K = in->optimizer_bytes ? in->optimizer_bytes : EST_OPTIM_BYTES;
  const double bt = in->trainer_gbps * 1e9 / 8.0;
  const double bs = (in->shard_gbps > 0 ? in->shard_gbps : in->trainer_gbps) * 1e9 / 8.0;
  const double ring = (W - 1.0) / W; /* a ring collective moves (W-1)/W per byte */
  static const char *const names[ZS_STRATEGY_COUNT] = {"dp", "zero1", "zero2", "zero3", "zshard"};

  memset(rows, 0, ZS_STRATEGY_COUNT * sizeof *rows);
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    rows[i].strategy = (zs_strategy)i;
    rows[i].name = names[i];
  }
  rows[ZS_STRATEGY_DP].state_bytes = (Pb + G + K) * P;
  rows[ZS_STRATEGY_DP].sent_bytes = 2.0 * G * P * ring;
  rows[ZS_STRATEGY_ZERO1].state_bytes = (Pb + G) * P + K * P / W;
  rows[ZS_STRATEGY_ZERO1].sent_bytes = (G + Pb) * P * ring;
  rows[ZS_STRATEGY_ZERO2].state_bytes = Pb * P + (G + K) * P / W;
  rows[ZS_STRATEGY_ZERO2].sent_bytes = (G + Pb) * P * ring;
  rows[ZS_STRATEGY_ZERO3].state_bytes = (Pb + G + K) * P / W;
  rows[ZS_STRATEGY_ZERO3].working_bytes = (2.0 * Pb + G) * L;
  rows[ZS_STRATEGY_ZERO3].sent_bytes = (G + 2.0 * Pb) * P * ring;
  for (int i = ZS_STRATEGY_DP; i <= ZS_STRATEGY_ZERO3; i++) {
    /* Ring collectives send and receive the same amount on every device. */
    rows[i].received_bytes = rows[i].sent_bytes;
    rows[i].comm_seconds = rows[i].sent_bytes / bt;
    rows[i].gated_seconds = rows[i].comm_seconds;
  }

  zs_estimate_row *z = &rows[ZS_STRATEGY_ZSHARD];
  const double pulls = in->pull_in_backward ? 2.0 : 1.0;
  z->working_bytes = (2.0 * Pb + G) * L;
  z->shard_bytes = (K + EST_SHARD_EXTRA) * P / N;
  z->sent_bytes = G * P;
  z->received_bytes = pulls * Pb * P;
  z->shard_received_bytes = W * G * P / N;
  z->shard_sent_bytes = W * pulls * Pb * P / N;
  z->shard_wire_bytes = max2(z->shard_received_bytes, z->shard_sent_bytes);
  /* Each phase is as slow as its busiest link: a trainer's own, or a
   * shard's when W trainers send to N < W shards (incast). */
  z->push_seconds = max2(z->sent_bytes / bt, z->shard_received_bytes / bs);
  z->pull_seconds = max2(z->received_bytes / bt, z->shard_sent_bytes / bs);
  z->gated_seconds = z->push_seconds + z->pull_seconds;
  z->comm_seconds = max2(z->push_seconds, z->pull_seconds);
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++)
    rows[i].device_bytes = rows[i].state_bytes + rows[i].working_bytes;
}
