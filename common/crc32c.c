/*
 * crc32c — CRC-32C with the SSE4.2 CRC32 instruction, and a table reference.
 *
 * The CRC32 instruction computes exactly the reflected Castagnoli CRC step
 * without the initial and final inversion, so both paths keep the running
 * register as ~crc: a caller's crc of 0 becomes the standard initial value
 * 0xFFFFFFFF, and the inversion on return makes crc32c(crc32c(0, a), b) the CRC
 * of a followed by b.
 *
 * Only the hardware function is compiled for SSE4.2 (a target attribute), so
 * the table fallback stays safe on a CPU without it; the hardware path runs
 * only after __builtin_cpu_supports("sse4.2") said yes.
 */
#include "common/crc32c.h"

#include <nmmintrin.h>
#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

/* ------------------------------------------------------------------------ */
/* Table reference                                                           */
/* ------------------------------------------------------------------------ */

static uint32_t g_table[256];
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;

/* The CRC of each byte value, computed bit by bit from the polynomial. */
static void table_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c & 1u) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
    g_table[i] = c;
  }
}

uint32_t crc32c_sw(uint32_t crc, const void *buf, size_t len) {
  const unsigned char *p = buf;
  pthread_once(&g_table_once, table_init);
  uint32_t c = ~crc;
  for (size_t i = 0; i < len; i++)
    c = g_table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
  return ~c;
}

/* ------------------------------------------------------------------------ */
/* SSE4.2                                                                    */
/* ------------------------------------------------------------------------ */

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf,
                                                            size_t len) {
  const unsigned char *p = buf;
  uint64_t c = ~crc;
  /* Single bytes until p is 8-byte aligned, so the 8-byte loads below never
   * straddle a cache line; memcpy keeps them free of alignment assumptions
   * for the compiler all the same. */
  while (len > 0 && ((uintptr_t)p & 7u) != 0) {
    c = _mm_crc32_u8((uint32_t)c, *p++);
    len--;
  }
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, sizeof w);
    c = _mm_crc32_u64(c, w);
    p += 8;
    len -= 8;
  }
  while (len > 0) {
    c = _mm_crc32_u8((uint32_t)c, *p++);
    len--;
  }
  return ~(uint32_t)c;
}

static int g_have_sse42;
static pthread_once_t g_detect_once = PTHREAD_ONCE_INIT;

static void detect(void) {
  __builtin_cpu_init();
  g_have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

uint32_t crc32c(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&g_detect_once, detect);
  return g_have_sse42 ? crc32c_hw(crc, buf, len) : crc32c_sw(crc, buf, len);
}
