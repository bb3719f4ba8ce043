/*
 * dtype — the wire dtypes: one table of codecs (name, size, kernels), and the
 * conversions between fp32 and the 16-bit float formats.
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
#include "zshard/types.h"

/* Scalar references. */
uint16_t dtype_f32_to_bf16(float f);
float dtype_bf16_to_f32(uint16_t h);
uint16_t dtype_f32_to_f16(float f);
float dtype_f16_to_f32(uint16_t h);

/* ------------------------------------------------------------------------ */
/* The codec table                                                           */
/* ------------------------------------------------------------------------ */
/*
 * Every wire dtype is one entry of one table (dtype.c): its name, how many
 * bytes n elements take, and its kernels per instruction set. Code that sizes,
 * checks, names or converts wire data asks the table, so a new dtype is a new
 * entry (plus its enum value in zshard.h and the proto), not an edit at every
 * call site.
 *
 * A dtype is a sequence of blocks of `block` elements; each block carries
 * `scale_bytes` of its own (a block-quantized dtype's scale) plus `elem_bytes`
 * per element. fp32, fp16 and bf16 are blocks of one element with no scale.
 * The last block of an array may be short; it still carries its scale, so
 *
 *     bytes(n) = ceil(n / block) * scale_bytes + n * elem_bytes,
 *
 * which is nblocks * (block * elem_bytes + scale_bytes) when block divides n.
 * Element i of an array starts at byte bytes(i) only when block divides i:
 * callers that split an array (pieces, conversion chunks) split it at block
 * boundaries, and every chunk is then an array of its own.
 *
 * The kernels convert n elements, a short last block included; `wire` may
 * sit at any byte address (a payload inside a network frame), the float
 * arrays need float alignment. They follow
 * the rounding and NaN rules at the top of dtype.c and give the same bits on
 * every ISA. A NULL kernel for an ISA means the entry of the next lower ISA
 * serves it (fp32 decode is a memmove everywhere); the scalar ones are never
 * NULL.
 */
typedef void (*dtype_decode_fn)(const void *wire, float *out, size_t n);
typedef void (*dtype_encode_fn)(const float *in, void *wire, size_t n);
typedef void (*dtype_accumulate_fn)(const void *wire, float *acc, size_t n);

/* Every entry's block divides this, so code that cuts arrays into chunks of a
 * multiple of it cuts at block boundaries whatever the dtype (test_dtype
 * checks each entry). */
#define DTYPE_MAX_BLOCK 256

/* Elements per block of ZS_DTYPE_INT8_BLOCK (docs/PROTOCOL.md; the choice is
 * measured in docs/PERFORMANCE.md). Part of the wire format: changing it
 * changes the protocol. */
#define DTYPE_INT8_BLOCK 128

/* Indexes of the per-ISA kernel arrays: the cpu_isa values. */
#define DTYPE_NISA 3

typedef struct dtype_codec {
  zs_dtype id;
  /* The proto enum's name without DTYPE_ ("FP32"); error messages use it. */
  const char *name;
  /* The layout above: elements per block (1 unless block-quantized), bytes
   * per element, bytes each block carries besides its elements. */
  uint32_t block;
  uint32_t elem_bytes;
  uint32_t scale_bytes;
  /* Kernels indexed by cpu_isa: fp32 -> wire, wire -> fp32, and
   * acc[i] += decode(wire)[i] under the accumulation's NaN rule. */
  dtype_encode_fn encode[DTYPE_NISA];
  dtype_decode_fn decode[DTYPE_NISA];
  dtype_accumulate_fn accumulate[DTYPE_NISA];
} dtype_codec;

/* The table entry of `d`, or NULL if `d` is not a wire dtype. The entry is
 * static and lives as long as the program. */
const dtype_codec *dtype_codec_of(int d);

/* The i-th table entry in increasing dtype order, or NULL once i is past the
 * last one: for code (and tests) that walks every dtype. */
const dtype_codec *dtype_codec_at(size_t i);

/* 1 if `d` is a wire dtype (has a table entry). */
int dtype_valid(int d);

/* `v`, a dtype as decoded from a protobuf varint, if it is a wire dtype; 0
 * (never a dtype) otherwise. A value that does not fit an int is refused
 * before any cast can truncate it into range. */
int dtype_from_varint(uint64_t v);

/* Bytes that n elements of `d` take (the formula above), or 0 if `d` is not
 * a wire dtype. n is an element count of something that fits in memory, so
 * the result does not overflow. */
uint64_t dtype_bytes(int d, uint64_t n);

/* The names of every wire dtype, for error messages: "FP32, FP16 or BF16".
 * Written from the table once, on first use (thread-safe); a static string. */
const char *dtype_names(void);

/* 0 if `d` is a wire dtype; otherwise ZS_EDTYPE, with "dtype <d> is not
 * <dtype_names()>" written to err (at most errlen bytes; err may be NULL). */
int dtype_check(int d, char *err, size_t errlen);

/* The array functions below look `src` / `dst` up in the table and call its
 * kernel for the ISA; a value that is not a wire dtype converts nothing. */

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
