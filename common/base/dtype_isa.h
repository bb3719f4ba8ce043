/*
 * dtype_isa — private: the per-ISA kernels behind the codec table in dtype.c.
 * The scalar ones live in dtype.c, the others in dtype_avx2.c and
 * dtype_avx512.c, which are compiled for their ISA and called only after
 * cpu_clamp_isa() said the CPU has it. Each has the signature of its table
 * slot (dtype.h: dtype_decode_fn, dtype_encode_fn, dtype_accumulate_fn).
 * fp32 decode and encode are copies, so the scalar memmove serves every ISA
 * and the vector files have no such kernel.
 */
#ifndef ZSHARD_COMMON_DTYPE_ISA_H
#define ZSHARD_COMMON_DTYPE_ISA_H

#include <stddef.h>
#include <stdint.h>

void dtype_scalar_f32_decode(const void *wire, float *out, size_t n);
void dtype_scalar_f32_encode(const float *in, void *wire, size_t n);
void dtype_scalar_f32_accumulate(const void *wire, float *acc, size_t n);
void dtype_scalar_f16_decode(const void *wire, float *out, size_t n);
void dtype_scalar_f16_encode(const float *in, void *wire, size_t n);
void dtype_scalar_f16_accumulate(const void *wire, float *acc, size_t n);
void dtype_scalar_bf16_decode(const void *wire, float *out, size_t n);
void dtype_scalar_bf16_encode(const float *in, void *wire, size_t n);
void dtype_scalar_bf16_accumulate(const void *wire, float *acc, size_t n);

/* INT8_BLOCK (dtype.c states the format and its rules). The scale and
 * multiplier of a block from the bits of its largest magnitude, shared by
 * every path so that they agree on the special cases. */
void dtype_int8_block_scale(uint32_t amax_bits, float *scale, float *inv);
void dtype_scalar_int8_block_encode(const float *in, void *wire, size_t n);
void dtype_scalar_int8_block_decode(const void *wire, float *out, size_t n);
void dtype_scalar_int8_block_accumulate(const void *wire, float *acc, size_t n);
void dtype_avx2_int8_block_encode(const float *in, void *wire, size_t n);
void dtype_avx2_int8_block_decode(const void *wire, float *out, size_t n);
void dtype_avx2_int8_block_accumulate(const void *wire, float *acc, size_t n);

void dtype_avx2_f32_accumulate(const void *wire, float *acc, size_t n);
void dtype_avx2_f16_decode(const void *wire, float *out, size_t n);
void dtype_avx2_f16_encode(const float *in, void *wire, size_t n);
void dtype_avx2_f16_accumulate(const void *wire, float *acc, size_t n);
void dtype_avx2_bf16_decode(const void *wire, float *out, size_t n);
void dtype_avx2_bf16_encode(const float *in, void *wire, size_t n);
void dtype_avx2_bf16_accumulate(const void *wire, float *acc, size_t n);

void dtype_avx512_f32_accumulate(const void *wire, float *acc, size_t n);
void dtype_avx512_f16_decode(const void *wire, float *out, size_t n);
void dtype_avx512_f16_encode(const float *in, void *wire, size_t n);
void dtype_avx512_f16_accumulate(const void *wire, float *acc, size_t n);
void dtype_avx512_bf16_decode(const void *wire, float *out, size_t n);
void dtype_avx512_bf16_encode(const float *in, void *wire, size_t n);
void dtype_avx512_bf16_accumulate(const void *wire, float *acc, size_t n);

#endif
