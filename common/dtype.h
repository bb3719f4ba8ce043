/*
 * dtype — conversion between fp32 and the 16-bit float formats.
 *
 * fp32 -> fp16/bf16 rounds to nearest, ties to even; NaN stays NaN (quiet) and
 * Inf stays Inf; fp16 overflow gives Inf, underflow gives subnormals or zero as
 * IEEE 754 prescribes. 16 -> 32 is exact. The array kernels are vectorised
 * (F16C, AVX2, AVX-512) and chosen at run time; every path gives the same bits
 * as the scalar reference.
 */
#ifndef ZSHARD_COMMON_DTYPE_H
#define ZSHARD_COMMON_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "cpu.h"
#include "zshard/zshard.h"

/* Scalar references. */
uint16_t dtype_f32_to_bf16(float f);
float dtype_bf16_to_f32(uint16_t h);
uint16_t dtype_f32_to_f16(float f);
float dtype_f16_to_f32(uint16_t h);

/* 1 if `d` is a zs_dtype value. */
int dtype_valid(int d);

/* out[i] = (float)in[i] for n elements of dtype src. `in` may be unaligned. */
void dtype_to_f32(zs_dtype src, const void *in, float *out, size_t n);
/* out[i] = convert(in[i]) to dtype dst. */
void dtype_from_f32(zs_dtype dst, const float *in, void *out, size_t n);
/* acc[i] += (float)in[i]: the push accumulation, one pass, no temporary. */
void dtype_accumulate(zs_dtype src, const void *in, float *acc, size_t n);

/* The same with an explicit instruction set, for tests and benchmarks; an ISA
 * the CPU lacks falls back to the best one it has. */
void dtype_to_f32_isa(cpu_isa isa, zs_dtype src, const void *in, float *out, size_t n);
void dtype_from_f32_isa(cpu_isa isa, zs_dtype dst, const float *in, void *out, size_t n);
void dtype_accumulate_isa(cpu_isa isa, zs_dtype src, const void *in, float *acc, size_t n);

#endif
