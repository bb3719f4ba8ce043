/*
 * le — little-endian loads and stores of 16-, 32- and 64-bit integers at any
 * address.
 *
 * Every byte format of ours (wire frames, the spec's canonical encoding,
 * checkpoint files, the client state blob) is little-endian whatever the
 * host's byte order. These go byte by byte, so neither the host's order nor
 * the pointer's alignment matters; compilers turn each into one load or
 * store on a little-endian host. `p` points at the first of the 2, 4 or 8
 * bytes, which the caller owns.
 */
#ifndef ZSHARD_COMMON_LE_H
#define ZSHARD_COMMON_LE_H

#include <stdint.h>
#include <string.h>

static inline void le_store16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

static inline void le_store32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline void le_store64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t le_load16(const uint8_t *p) {
  return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

static inline uint32_t le_load32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++)
    v |= (uint32_t)p[i] << (8 * i);
  return v;
}

static inline uint64_t le_load64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* The n low bytes of v (n at most 8), for fields narrower than a C type. */
static inline void le_store(uint8_t *p, uint64_t v, unsigned n) {
  for (unsigned i = 0; i < n; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t le_load(const uint8_t *p, unsigned n) {
  uint64_t v = 0;
  for (unsigned i = 0; i < n; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* A double as the u64 of its IEEE 754 bits, so -0.0 and NaN payloads
 * survive. */
static inline void le_store_f64(uint8_t *p, double d) {
  uint64_t v;
  memcpy(&v, &d, sizeof v);
  le_store64(p, v);
}

static inline double le_load_f64(const uint8_t *p) {
  uint64_t v = le_load64(p);
  double d;
  memcpy(&d, &v, sizeof d);
  return d;
}

#endif
