/*
 * bench_codec — the INT8_BLOCK kernels (common/base/dtype.h) against STREAM-like
 * kernels with the same streams (stream_codec.h), single-threaded, on arrays
 * far larger than the caches: encode (what a trainer does to each gradient
 * and a shard to each piece once per version), decode (a trainer's pull),
 * accumulate (a shard adding a push into its fp32 sum). Each figure is
 * elements per second with the stream kernel's rate as its limit; the goal
 * is a ratio of at least 0.8. The bf16 kernels are reported the same way
 * for comparison (their limit: the same stream kernels, which move 1.03
 * bytes where bf16 moves 2, so a ratio above 1 is possible there).
 *
 * Contender and limit alternate within each repetition, so that the
 * machine's other tenants load both sides of a ratio alike; medians.
 *
 *   bench_codec [--json] [--quick] [--reps R] [--elems N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/base/cpu.h"
#include "common/base/dtype.h"
#include "stream_codec.h"

#define MAX_REPS 64

typedef struct arrays {
  float *f, *acc;
  unsigned char *w;
  size_t n;
} arrays;

static double time_codec(int kind, zs_dtype d, arrays *a) {
  double t0 = bench_now();
  if (kind == 0)
    dtype_from_f32(d, a->f, a->w, a->n);
  else if (kind == 1)
    dtype_to_f32(d, a->w, a->f, a->n);
  else
    dtype_accumulate(d, a->w, a->acc, a->n);
  return bench_now() - t0;
}

static double time_stream(int kind, arrays *a) {
  double t0 = bench_now();
  if (kind == 0)
    stream_codec_encode(a->f, a->w, a->n);
  else if (kind == 1)
    stream_codec_decode(a->w, a->f, a->n);
  else
    stream_codec_accumulate(a->w, a->acc, a->n);
  return bench_now() - t0;
}

int main(int argc, char **argv) {
  bench_opts o;
  bench_parse_common(&argc, argv, &o);
  uint64_t elems = o.quick ? (uint64_t)8 << 20 : (uint64_t)32 << 20;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--elems") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &elems, 1) != 1)
        bench_die("bench_codec: --elems N");
    } else {
      bench_die("usage: bench_codec [--json] [--quick] [--reps R] [--elems N]");
    }
  }
  elems = elems / DTYPE_MAX_BLOCK * DTYPE_MAX_BLOCK;
  int reps = o.reps ? o.reps : o.quick ? 5 : 11;
  if (reps > MAX_REPS)
    reps = MAX_REPS;
  arrays a = {.n = (size_t)elems};
  a.f = bench_alloc(a.n * sizeof(float));
  a.acc = bench_alloc(a.n * sizeof(float));
  a.w = bench_alloc((size_t)dtype_bytes(ZS_DTYPE_FP32, elems));
  bench_fill_f32(a.f, a.n, 0.01f, 1);
  memset(a.acc, 0, a.n * sizeof(float));
  dtype_from_f32(ZS_DTYPE_INT8_BLOCK, a.f, a.w, a.n);
  bench_note("INT8_BLOCK (block %u) on %s, %llu elements, %d repetitions", DTYPE_INT8_BLOCK,
             cpu_isa_name(cpu_best_isa()), (unsigned long long)elems, reps);

  static const char *kinds[] = {"encode", "decode", "accumulate"};
  static const zs_dtype dtypes[] = {ZS_DTYPE_INT8_BLOCK, ZS_DTYPE_BF16};
  for (int kind = 0; kind < 3; kind++) {
    for (int di = 0; di < 2; di++) {
      double tc[MAX_REPS], ts[MAX_REPS];
      /* One untimed pass of each warms the pages and the branch history. */
      time_codec(kind, dtypes[di], &a);
      time_stream(kind, &a);
      for (int r = 0; r < reps; r++) {
        tc[r] = time_codec(kind, dtypes[di], &a);
        ts[r] = time_stream(kind, &a);
      }
      double rate = (double)elems / bench_quantile(tc, (size_t)reps, 0.5) / 1e9;
      double limit = (double)elems / bench_quantile(ts, (size_t)reps, 0.5) / 1e9;
      char metric[64];
      snprintf(metric, sizeof metric, "%s_%s", dtypes[di] == ZS_DTYPE_BF16 ? "bf16" : "int8",
               kinds[kind]);
      bench_kv kv[] = {BENCH_S("isa", cpu_isa_name(cpu_best_isa())),
                       BENCH_N("block", dtype_codec_of((int)dtypes[di])->block),
                       BENCH_N("elems", (double)elems)};
      bench_report(&o, "codec", metric, rate, "Gelem/s", limit, kv, 3);
    }
  }
  free(a.f);
  free(a.acc);
  free(a.w);
  return 0;
}
