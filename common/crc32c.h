/*
 * crc32c — CRC-32C (Castagnoli), as used by iSCSI, ext4 and the frame and
 * checkpoint formats: reflected polynomial 0x82F63B78, initial value and final
 * xor 0xFFFFFFFF. SSE4.2 instructions when the CPU has them, a table otherwise.
 */
#ifndef ZSHARD_COMMON_CRC32C_H
#define ZSHARD_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 to start) over len bytes: crc32c(crc32c(0, a), b) equals the
 * CRC of a followed by b. crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t crc32c_sw(uint32_t crc, const void *buf, size_t len); /* table reference */

#endif
