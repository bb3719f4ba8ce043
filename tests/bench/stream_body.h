/*
 * The body of the STREAM-like kernel (stream.h), compiled once per
 * instruction set: the including file defines STREAM_NAME and is compiled
 * with that ISA's flags, so the compiler vectorises the same loop for each.
 */
#include <stdint.h>
#include <string.h>

void STREAM_NAME(float *restrict master, float *restrict m, float *restrict v, float *restrict acc,
                 uint16_t *restrict low, size_t n);

void STREAM_NAME(float *restrict master, float *restrict m, float *restrict v, float *restrict acc,
                 uint16_t *restrict low, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float a = acc[i];
    float w = master[i] + a;
    master[i] = w;
    m[i] = m[i] + a;
    v[i] = v[i] + a;
    acc[i] = 0.0f;
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    low[i] = (uint16_t)(bits >> 16);
  }
}
