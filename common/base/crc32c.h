/*
 * crc32c — CRC-32C (Castagnoli), as used by iSCSI, ext4 and the frame and
 * checkpoint formats: reflected polynomial 0x82F63B78, initial value and final
 * xor 0xFFFFFFFF. The fastest implementation the CPU supports is chosen on
 * first use (AVX-512 VPCLMULQDQ folding, three interleaved SSE4.2 CRC32 chains
 * joined with PCLMULQDQ, one CRC32 chain, or a table); all give the same
 * result. Every function is thread-safe and keeps no state between calls.
 */
#ifndef ZSHARD_COMMON_CRC32C_H
#define ZSHARD_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 to start) over len bytes: crc32c(crc32c(0, a), b) equals the
 * CRC of a followed by b. crc32c(0, "123456789", 9) == 0xE3069283. buf is only
 * read, and only during the call; it may be NULL when len is 0. */
uint32_t crc32c(uint32_t crc, const void *buf, size_t len);

/* The CRC of A followed by B from crc_a = crc32c(0, A), crc_b = crc32c(0, B)
 * and B's length alone, without B's bytes: for an answer made of pieces
 * whose CRCs are kept beside them. Costs one GF(2) multiplication per set
 * bit of len_b (O(log len_b)). crc32c_combine(crc_a, crc32c(0, B), len)
 * equals crc32c(crc_a, B, len). Thread-safe. */
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b);

/* The same with a byte-at-a-time table, on any CPU: the reference the fast
 * paths are tested against. Same contract as crc32c(). */
uint32_t crc32c_sw(uint32_t crc, const void *buf, size_t len);

#endif
