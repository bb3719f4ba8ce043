/*
 * stream_codec — see stream_codec.h. Compiled with -O3 and the AVX2 flags
 * the codec's kernels use, so that the compiler vectorises these loops as
 * wide as they are (bench_codec compares against the AVX2 kernels, which
 * also serve AVX-512 machines). The per-block scale is written and read as
 * the codec does; the element loops are plain conversions.
 */
#include "stream_codec.h"

#include <stdint.h>
#include <string.h>

#include "common/base/dtype.h"

#define B DTYPE_INT8_BLOCK

void stream_codec_encode(const float *restrict in, unsigned char *restrict wire, size_t n) {
  for (size_t b = 0; b < n; b += B) {
    memcpy(wire, in + b, sizeof(float));
    wire += sizeof(float);
    for (size_t i = 0; i < B; i++)
      wire[i] = (unsigned char)(int8_t)(int32_t)in[b + i];
    wire += B;
  }
}

void stream_codec_decode(const unsigned char *restrict wire, float *restrict out, size_t n) {
  for (size_t b = 0; b < n; b += B) {
    float s;
    memcpy(&s, wire, sizeof s);
    wire += sizeof s;
    for (size_t i = 0; i < B; i++)
      out[b + i] = (float)(int8_t)wire[i] + s;
    wire += B;
  }
}

void stream_codec_accumulate(const unsigned char *restrict wire, float *restrict acc, size_t n) {
  for (size_t b = 0; b < n; b += B) {
    float s;
    memcpy(&s, wire, sizeof s);
    wire += sizeof s;
    for (size_t i = 0; i < B; i++)
      acc[b + i] += (float)(int8_t)wire[i] + s;
    wire += B;
  }
}
