/*
 * stream — a STREAM-like kernel with the memory traffic of the shard's fused
 * optimizer pass and none of its arithmetic, so that its speed is what the
 * memory system allows for that mix of streams: per element it reads acc,
 * master, m and v (16 bytes) and writes master, m, v, acc (16 bytes) and a
 * 16-bit copy (2 bytes): 34 bytes, with ordinary (write-allocate) stores as
 * the optimizer's kernels use.
 */
#ifndef ZSHARD_TESTS_BENCH_STREAM_H
#define ZSHARD_TESTS_BENCH_STREAM_H

#include <stddef.h>
#include <stdint.h>

#define STREAM_BYTES_PER_ELEM 34u

/* master += acc; m += acc; v += acc; acc = 0; low = top half of master's
 * bits, for n elements. The arrays are the caller's and must not overlap. */
void stream_mix(float *master, float *m, float *v, float *acc, uint16_t *low, size_t n);

#endif
