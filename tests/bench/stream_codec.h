/*
 * stream_codec — STREAM-like kernels with the memory traffic of the INT8_BLOCK
 * codec (common/base/dtype.h) and none of its arithmetic beyond a plain
 * conversion, the limits of bench_codec: what the memory system allows for
 * each kernel's mix of streams.
 *
 *  - encode: read 4 bytes per element, write 1 byte per element plus 4 bytes
 *    per block of DTYPE_INT8_BLOCK (the scale);
 *  - decode: read 1 + 4/block bytes per element, write 4;
 *  - accumulate: read 1 + 4/block and 4 bytes (acc) per element, write 4.
 *
 * The arrays are the caller's and do not overlap; n is a multiple of the
 * block.
 */
#ifndef ZSHARD_TESTS_BENCH_STREAM_CODEC_H
#define ZSHARD_TESTS_BENCH_STREAM_CODEC_H

#include <stddef.h>

void stream_codec_encode(const float *in, unsigned char *wire, size_t n);
void stream_codec_decode(const unsigned char *wire, float *out, size_t n);
void stream_codec_accumulate(const unsigned char *wire, float *acc, size_t n);

#endif
