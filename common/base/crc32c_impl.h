/*
 * crc32c_impl — private: the individual CRC-32C implementations behind
 * crc32c.h, so tests and benchmarks can force each one, and the GF(2)
 * arithmetic that derives their constants. Nothing outside common/base/crc32c.c and
 * its tests should include this header.
 *
 * Every path computes exactly the same function as crc32c(); they differ only
 * in speed and in the instructions they need:
 *
 *   TABLE   one table lookup per byte; any CPU (this is crc32c_sw()).
 *   SSE42   one dependent chain of 8-byte CRC32 instructions.
 *   CLMUL   three independent CRC32 chains over adjacent blocks, joined with
 *           a carry-less multiply (PCLMULQDQ); needs SSE4.2 and PCLMUL.
 *   AVX512  folds 256 bytes per step with 512-bit VPCLMULQDQ and finishes
 *           with CRC32 instructions; needs AVX-512F, VPCLMULQDQ, PCLMUL and
 *           SSE4.2, and is also skipped when ZSHARD_ISA lowers the vector ISA
 *           below avx512 (common/base/cpu.h).
 */
#ifndef ZSHARD_COMMON_CRC32C_IMPL_H
#define ZSHARD_COMMON_CRC32C_IMPL_H

#include <stddef.h>
#include <stdint.h>

typedef enum crc32c_path {
  CRC32C_PATH_TABLE = 0,
  CRC32C_PATH_SSE42 = 1,
  CRC32C_PATH_CLMUL = 2,
  CRC32C_PATH_AVX512 = 3,
  CRC32C_PATH_COUNT = 4,
} crc32c_path;

/* Block sizes, in bytes per stream, of the CLMUL path's three-stream steps,
 * largest first: a buffer takes as many steps of 3 x 4096 bytes as fit, then
 * of 3 x 1024, 3 x 256 and 3 x 64, and finishes the remaining < 192 bytes on
 * one chain. Exposed so the tests can aim at every boundary. */
#define CRC32C_CLMUL_BLOCK_0 4096u
#define CRC32C_CLMUL_BLOCK_1 1024u
#define CRC32C_CLMUL_BLOCK_2 256u
#define CRC32C_CLMUL_BLOCK_3 64u
#define CRC32C_CLMUL_BLOCKS 4

/* The AVX512 path folds in steps of this many bytes, and only buffers of at
 * least CRC32C_AVX512_MIN bytes take it; shorter ones, and the < 256 bytes
 * left after folding, go through the CLMUL path. */
#define CRC32C_AVX512_STEP 256u
#define CRC32C_AVX512_MIN 256u

/* 1 if this CPU can run `path` (TABLE always can). Thread-safe. */
int crc32c_path_supported(crc32c_path path);

/* The path crc32c() uses on this machine: the fastest supported one. */
crc32c_path crc32c_path_chosen(void);

/* "table", "sse42", "clmul", "avx512"; "?" for anything else. The string is
 * static. */
const char *crc32c_path_name(crc32c_path path);

/* crc32c(crc, buf, len) computed by `path`. buf is only read, and only during
 * the call; it may be NULL when len is 0. A path the CPU cannot run (see
 * crc32c_path_supported) is never executed: the table path answers instead,
 * so a caller can never trigger an illegal instruction. */
uint32_t crc32c_with_path(crc32c_path path, uint32_t crc, const void *buf, size_t len);

/*
 * GF(2) polynomial arithmetic modulo the Castagnoli polynomial P, in the CRC's
 * own bit-reflected representation: bit i of a uint32_t holds the coefficient
 * of x^(31-i), so 0x80000000 is 1 and 0x40000000 is x. In that representation
 * the raw CRC register (before the final inversion) after feeding n bytes D
 * into register value r is r * x^(8n) + D * x^32 mod P, which is where every
 * constant of the fast paths comes from.
 */

/* a * b mod P. */
uint32_t crc32c_gf2_mul(uint32_t a, uint32_t b);

/* x^e mod P, by square-and-multiply. The fast paths' constants are all of the
 * form x^(8n - 33) or x^(8n + 31) mod P for the distances n they span; see
 * crc32c.c for why the 33 and the 31. */
uint32_t crc32c_gf2_xpow(uint64_t e);

#endif
