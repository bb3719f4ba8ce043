/*
 * dtype — scalar reference conversions and the run-time dispatch to the vector
 * kernels in dtype_avx2.c and dtype_avx512.c.
 *
 * The one rule set every path follows, bit for bit:
 *
 *  - fp32 -> bf16 and fp32 -> fp16 round to nearest, ties to even. A result too
 *    large for fp16 becomes Inf of the same sign; a result below fp16's normal
 *    range becomes the correctly rounded subnormal or a signed zero. fp32
 *    subnormal inputs are honoured, never flushed: in fp16 they all round to
 *    a signed zero, and bf16, which has fp32's exponent range, keeps their top
 *    bits. The results do not depend on MXCSR (rounding mode, FTZ, DAZ): the
 *    scalar code is integer arithmetic, F16C gets its rounding mode in the
 *    instruction, and F16C ignores FTZ/DAZ (test_dtype checks this).
 *  - NaN -> 16 bits keeps the sign and the top payload bits (bf16: mantissa bits
 *    22..16, fp16: bits 22..13) and sets the quiet bit, so a NaN can never turn
 *    into Inf by losing its payload. This is what F16C's VCVTPS2PH does, and
 *    the bf16 kernels do the same with integer operations.
 *  - bf16 -> fp32 is a 16-bit shift: exact for every pattern, NaN payloads
 *    (signalling ones included) unchanged.
 *  - fp16 -> fp32 is exact for every number; a NaN keeps sign and payload and
 *    gets the quiet bit, as IEEE 754 conversion and F16C's VCVTPH2PS do.
 *  - dtype_accumulate computes acc[i] + x with one fp32 addition, except that
 *    an acc[i] that is already NaN stays that NaN (quiet bit set) whatever x
 *    is. Without that rule the result of NaN + NaN would be whichever operand
 *    the compiler happened to put first (C lets it commute the addition), and
 *    the paths could differ in payload bits. With it, a NaN result has one
 *    defined source: acc's NaN, else x's NaN, else the hardware's default NaN
 *    for Inf - Inf; all three are quiet. The addition itself follows MXCSR
 *    like any fp32 addition, the same way on every path.
 *
 * The vector files handle unaligned pointers and tails themselves (AVX2 by
 * calling the scalar kernels below for the last n % 8 elements, AVX-512 with
 * masked loads and stores). This file holds the table that names every wire
 * dtype, sizes it and lists its kernels per ISA, and the dispatch that picks
 * one of them.
 */
#include "common/base/dtype.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/base/dtype_isa.h"
#include "common/base/status.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "zshard's tensor bytes are little-endian and converted in place; port dtype.c first"
#endif

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* ------------------------------------------------------------------------ */
/* Scalar references                                                         */
/* ------------------------------------------------------------------------ */

uint16_t dtype_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x0040u);
  /* Adding 0x7fff plus the lowest kept bit rounds to nearest even: a tie
   * carries into the kept bits only when they are odd. A carry out of the
   * mantissa increments the exponent, which is the correct rounding, and the
   * largest finite values carry into 0x7f80, which is Inf. */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float dtype_bf16_to_f32(uint16_t h) {
  return f32_from_bits((uint32_t)h << 16);
}

uint16_t dtype_f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;

  if (a > 0x7f800000u)
    return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  /* 65520 is the midpoint between fp16's largest finite value 65504 (odd
   * mantissa) and 65536; the tie goes to the even side, which is Inf. */
  if (a >= 0x477ff000u)
    return (uint16_t)(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    /* Normal fp16 result: rebias the exponent from 127 to 15 and round away
     * 13 mantissa bits, ties to even. A carry into the exponent is correct;
     * overflow to Inf was excluded above. */
    uint32_t r = a - 0x38000000u;
    r += 0x0fffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  /* Below 2^-14 the result is a subnormal m * 2^-24. Up to and including
   * 2^-25 (half the smallest subnormal, a tie that goes to even zero) the
   * result is zero; this covers fp32 zeros and subnormals too. */
  if (a <= 0x33000000u)
    return sign;
  /* Here the fp32 exponent e is 102..112 and the value is m * 2^(e - 150)
   * with the implicit bit in m, i.e. (m >> (126 - e)) units of 2^-24 plus a
   * remainder to round. A round-up from 1023 to 1024 yields 0x0400, the
   * smallest normal, which is the right encoding. */
  uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  unsigned shift = 126u - (a >> 23);
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u)))
    q++;
  return (uint16_t)(sign | q);
}

float dtype_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x03ffu;

  if (exp == 0x1fu) {
    if (mant == 0)
      return f32_from_bits(sign | 0x7f800000u);
    return f32_from_bits(sign | 0x7fc00000u | (mant << 13));
  }
  if (exp != 0)
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0)
    return f32_from_bits(sign);
  /* A subnormal fp16 is a normal fp32: shift the leading one into the
   * implicit position and lower the exponent by the same amount. */
  uint32_t e = 113u;
  while (!(mant & 0x0400u)) {
    mant <<= 1;
    e--;
  }
  return f32_from_bits(sign | (e << 23) | ((mant & 0x03ffu) << 13));
}

/* ------------------------------------------------------------------------ */
/* Scalar array kernels                                                      */
/* ------------------------------------------------------------------------ */

/* Elements are read and written with memcpy because `in` and the 16-bit `out`
 * may sit at any byte address (a payload inside a network frame). */

static uint16_t load_u16(const unsigned char *p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static float load_f32(const unsigned char *p) {
  float v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* acc + x under the accumulation's NaN rule (see the top of the file). */
static float add_keep_nan(float acc, float x) {
  uint32_t a = f32_bits(acc);
  if ((a & 0x7fffffffu) > 0x7f800000u)
    return f32_from_bits(a | 0x00400000u);
  return acc + x;
}

void dtype_scalar_f32_decode(const void *wire, float *out, size_t n) {
  if (n)
    memmove(out, wire, n * sizeof(float));
}

void dtype_scalar_f32_encode(const float *in, void *wire, size_t n) {
  if (n)
    memmove(wire, in, n * sizeof(float));
}

void dtype_scalar_f32_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  for (size_t i = 0; i < n; i++)
    acc[i] = add_keep_nan(acc[i], load_f32(p + 4 * i));
}

void dtype_scalar_f16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  for (size_t i = 0; i < n; i++)
    out[i] = dtype_f16_to_f32(load_u16(p + 2 * i));
}

void dtype_scalar_f16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  for (size_t i = 0; i < n; i++) {
    uint16_t h = dtype_f32_to_f16(in[i]);
    memcpy(p + 2 * i, &h, sizeof h);
  }
}

void dtype_scalar_f16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  for (size_t i = 0; i < n; i++)
    acc[i] = add_keep_nan(acc[i], dtype_f16_to_f32(load_u16(p + 2 * i)));
}

void dtype_scalar_bf16_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  for (size_t i = 0; i < n; i++)
    out[i] = dtype_bf16_to_f32(load_u16(p + 2 * i));
}

void dtype_scalar_bf16_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  for (size_t i = 0; i < n; i++) {
    uint16_t h = dtype_f32_to_bf16(in[i]);
    memcpy(p + 2 * i, &h, sizeof h);
  }
}

void dtype_scalar_bf16_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  for (size_t i = 0; i < n; i++)
    acc[i] = add_keep_nan(acc[i], dtype_bf16_to_f32(load_u16(p + 2 * i)));
}

/* ------------------------------------------------------------------------ */
/* INT8_BLOCK: symmetric int8 per block with an fp32 scale                   */
/* ------------------------------------------------------------------------ */
/*
 * A block of up to DTYPE_INT8_BLOCK elements is [scale: fp32 LE][q: int8 x n]
 * and stands for x[i] = (float)q[i] * scale, one fp32 multiplication. The
 * encoder, per block:
 *
 *  - amax = the largest |x[i]|, found as the largest of the magnitudes' bit
 *    patterns (an integer max, so NaN > Inf > every finite value);
 *  - a block with a NaN, an Inf or a magnitude of 2^127 or more gets scale =
 *    the quiet NaN 0x7fc00000 and q = 0, so every element decodes to NaN: a
 *    non-finite gradient stays non-finite on the shard, where the step's
 *    overflow check sees it. (From 2^127 up, 127 * scale could round to
 *    Inf, and such a value is an overflow in any training run anyway.)
 *  - a block with amax < 2^-100 (zeros, subnormals, anything that small) gets
 *    scale = +0 and q = 0. The cut keeps every scale a normal number far from
 *    the subnormal range, so no operation below sees a subnormal operand
 *    (x[i] / scale of a subnormal x[i] is below 2^-19 and rounds to 0 either
 *    way) and the bits do not depend on FTZ or DAZ;
 *  - otherwise scale = amax / 127 and q[i] = x[i] * (127 / amax) rounded to
 *    nearest, ties to even, then clamped to [-127, 127] (the clamp is never
 *    reached: |x[i] * (127 / amax)| < 127.5). -128 is never produced; a
 *    decoder accepts it as -128 * scale.
 *
 * Each step is one correctly rounded fp32 operation, so the vector kernels
 * compute the same bits with the same operations in the same order. Like the
 * accumulation's addition, they round by MXCSR's rounding mode, the default
 * round-to-nearest-even that nothing in zshard changes; FTZ and DAZ do not
 * matter (no operand or result is subnormal; test_dtype checks).
 */
#define INT8_TINY 0x0d800000u /* 2^-100 */
#define INT8_HUGE 0x7f000000u /* 2^127 */
#define INT8_NAN 0x7fc00000u

/* The block's scale and the multiplier of its elements (0 when every q is
 * 0) from the largest magnitude's bit pattern. Shared by every path. */
void dtype_int8_block_scale(uint32_t amax_bits, float *scale, float *inv) {
  if (amax_bits >= INT8_HUGE) {
    *scale = f32_from_bits(INT8_NAN);
    *inv = 0.0f;
  } else if (amax_bits < INT8_TINY) {
    *scale = 0.0f;
    *inv = 0.0f;
  } else {
    float amax = f32_from_bits(amax_bits);
    *scale = amax / 127.0f;
    *inv = 127.0f / amax;
  }
}

/* Round to nearest, ties to even, for |y| < 2^22: adding 1.5 * 2^23 leaves
 * no fraction bits, so the addition itself rounds (in the default rounding
 * mode), and the subtraction is exact. */
static int8_t int8_round(float y) {
  const float magic = 12582912.0f;
  float r = (y + magic) - magic;
  if (r > 127.0f)
    r = 127.0f;
  if (r < -127.0f)
    r = -127.0f;
  return (int8_t)r;
}

void dtype_scalar_int8_block_encode(const float *in, void *wire, size_t n) {
  unsigned char *p = wire;
  for (size_t b = 0; b < n; b += DTYPE_INT8_BLOCK) {
    size_t len = n - b < DTYPE_INT8_BLOCK ? n - b : DTYPE_INT8_BLOCK;
    uint32_t amax = 0;
    for (size_t i = 0; i < len; i++) {
      uint32_t a = f32_bits(in[b + i]) & 0x7fffffffu;
      amax = a > amax ? a : amax;
    }
    float scale, inv;
    dtype_int8_block_scale(amax, &scale, &inv);
    memcpy(p, &scale, sizeof scale);
    p += sizeof scale;
    for (size_t i = 0; i < len; i++)
      p[i] = (unsigned char)(inv == 0.0f ? 0 : int8_round(in[b + i] * inv));
    p += len;
  }
}

void dtype_scalar_int8_block_decode(const void *wire, float *out, size_t n) {
  const unsigned char *p = wire;
  for (size_t b = 0; b < n; b += DTYPE_INT8_BLOCK) {
    size_t len = n - b < DTYPE_INT8_BLOCK ? n - b : DTYPE_INT8_BLOCK;
    float scale = load_f32(p);
    p += sizeof scale;
    for (size_t i = 0; i < len; i++)
      out[b + i] = (float)(int8_t)p[i] * scale;
    p += len;
  }
}

void dtype_scalar_int8_block_accumulate(const void *wire, float *acc, size_t n) {
  const unsigned char *p = wire;
  for (size_t b = 0; b < n; b += DTYPE_INT8_BLOCK) {
    size_t len = n - b < DTYPE_INT8_BLOCK ? n - b : DTYPE_INT8_BLOCK;
    float scale = load_f32(p);
    p += sizeof scale;
    for (size_t i = 0; i < len; i++)
      acc[b + i] = add_keep_nan(acc[b + i], (float)(int8_t)p[i] * scale);
    p += len;
  }
}

/* ------------------------------------------------------------------------ */
/* The codec table                                                           */
/* ------------------------------------------------------------------------ */

/* Indexed by the zs_dtype value; a hole (name NULL) is not a dtype. A
 * block-quantized dtype (INT8_BLOCK) has its block, elem_bytes and scale_bytes,
 * and kernels that take whole blocks plus a short last one. */
static const dtype_codec codecs[] = {
    [ZS_DTYPE_FP32] =
        {
            .id = ZS_DTYPE_FP32,
            .name = "FP32",
            .block = 1,
            .elem_bytes = 4,
            .encode = {[CPU_ISA_SCALAR] = dtype_scalar_f32_encode},
            .decode = {[CPU_ISA_SCALAR] = dtype_scalar_f32_decode},
            .accumulate = {[CPU_ISA_SCALAR] = dtype_scalar_f32_accumulate,
                           [CPU_ISA_AVX2] = dtype_avx2_f32_accumulate,
                           [CPU_ISA_AVX512] = dtype_avx512_f32_accumulate},
        },
    [ZS_DTYPE_FP16] =
        {
            .id = ZS_DTYPE_FP16,
            .name = "FP16",
            .block = 1,
            .elem_bytes = 2,
            .encode = {[CPU_ISA_SCALAR] = dtype_scalar_f16_encode,
                       [CPU_ISA_AVX2] = dtype_avx2_f16_encode,
                       [CPU_ISA_AVX512] = dtype_avx512_f16_encode},
            .decode = {[CPU_ISA_SCALAR] = dtype_scalar_f16_decode,
                       [CPU_ISA_AVX2] = dtype_avx2_f16_decode,
                       [CPU_ISA_AVX512] = dtype_avx512_f16_decode},
            .accumulate = {[CPU_ISA_SCALAR] = dtype_scalar_f16_accumulate,
                           [CPU_ISA_AVX2] = dtype_avx2_f16_accumulate,
                           [CPU_ISA_AVX512] = dtype_avx512_f16_accumulate},
        },
    [ZS_DTYPE_BF16] =
        {
            .id = ZS_DTYPE_BF16,
            .name = "BF16",
            .block = 1,
            .elem_bytes = 2,
            .encode = {[CPU_ISA_SCALAR] = dtype_scalar_bf16_encode,
                       [CPU_ISA_AVX2] = dtype_avx2_bf16_encode,
                       [CPU_ISA_AVX512] = dtype_avx512_bf16_encode},
            .decode = {[CPU_ISA_SCALAR] = dtype_scalar_bf16_decode,
                       [CPU_ISA_AVX2] = dtype_avx2_bf16_decode,
                       [CPU_ISA_AVX512] = dtype_avx512_bf16_decode},
            .accumulate = {[CPU_ISA_SCALAR] = dtype_scalar_bf16_accumulate,
                           [CPU_ISA_AVX2] = dtype_avx2_bf16_accumulate,
                           [CPU_ISA_AVX512] = dtype_avx512_bf16_accumulate},
        },
    [ZS_DTYPE_INT8_BLOCK] =
        {
            .id = ZS_DTYPE_INT8_BLOCK,
            .name = "INT8_BLOCK",
            .block = DTYPE_INT8_BLOCK,
            .elem_bytes = 1,
            .scale_bytes = 4,
            /* No AVX-512 kernels: the AVX2 ones serve those CPUs (the
             * conversion is bound by memory bandwidth, not by vector width). */
            .encode = {[CPU_ISA_SCALAR] = dtype_scalar_int8_block_encode,
                       [CPU_ISA_AVX2] = dtype_avx2_int8_block_encode},
            .decode = {[CPU_ISA_SCALAR] = dtype_scalar_int8_block_decode,
                       [CPU_ISA_AVX2] = dtype_avx2_int8_block_decode},
            .accumulate = {[CPU_ISA_SCALAR] = dtype_scalar_int8_block_accumulate,
                           [CPU_ISA_AVX2] = dtype_avx2_int8_block_accumulate},
        },
};

#define NCODECS (sizeof codecs / sizeof codecs[0])

_Static_assert(DTYPE_NISA == CPU_ISA_AVX512 + 1, "one kernel slot per cpu_isa");

const dtype_codec *dtype_codec_of(int d) {
  if (d < 0 || (size_t)d >= NCODECS || !codecs[d].name)
    return NULL;
  return &codecs[d];
}

const dtype_codec *dtype_codec_at(size_t i) {
  for (size_t d = 0; d < NCODECS; d++)
    if (codecs[d].name && i-- == 0)
      return &codecs[d];
  return NULL;
}

int dtype_valid(int d) {
  return dtype_codec_of(d) != NULL;
}

int dtype_from_varint(uint64_t v) {
  return v < NCODECS && dtype_valid((int)v) ? (int)v : 0;
}

uint64_t dtype_bytes(int d, uint64_t n) {
  const dtype_codec *k = dtype_codec_of(d);
  if (!k)
    return 0;
  return (n + k->block - 1) / k->block * k->scale_bytes + n * k->elem_bytes;
}

static char names_buf[128];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void names_build(void) {
  size_t count = 0, len = 0;
  while (dtype_codec_at(count))
    count++;
  for (size_t i = 0; i < count; i++) {
    const char *sep = i == 0 ? "" : i + 1 == count ? " or " : ", ";
    int w = snprintf(names_buf + len, sizeof names_buf - len, "%s%s", sep, dtype_codec_at(i)->name);
    /* A table too long for the buffer keeps the names that fit; a test
     * checks the whole list. */
    if (w < 0 || (size_t)w >= sizeof names_buf - len)
      break;
    len += (size_t)w;
  }
}

const char *dtype_names(void) {
  pthread_once(&names_once, names_build);
  return names_buf;
}

int dtype_check(int d, char *err, size_t errlen) {
  if (dtype_valid(d))
    return 0;
  return status_fail(err, errlen, ZS_EDTYPE, "dtype %d is not %s", d, dtype_names());
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------ */

/* The kernel of the best ISA up to `isa` that both the CPU and the entry
 * have. The scalar slot is always filled, so the walk ends there. */
#define PICK(fn, slots, isa)                                                                       \
  do {                                                                                             \
    int i_ = (int)cpu_clamp_isa(isa);                                                              \
    while (i_ > CPU_ISA_SCALAR && !(slots)[i_])                                                    \
      i_--;                                                                                        \
    (fn) = (slots)[i_];                                                                            \
  } while (0)

/* A dtype that is not in the table converts nothing: callers validate dtypes
 * from the network before they get here, and touching `out` with a guessed
 * element size would be worse than leaving it alone. */

void dtype_to_f32_isa(cpu_isa isa, zs_dtype src, const void *in, float *out, size_t n) {
  const dtype_codec *k = dtype_codec_of(src);
  dtype_decode_fn fn;
  if (!k)
    return;
  PICK(fn, k->decode, isa);
  fn(in, out, n);
}

void dtype_from_f32_isa(cpu_isa isa, zs_dtype dst, const float *in, void *out, size_t n) {
  const dtype_codec *k = dtype_codec_of(dst);
  dtype_encode_fn fn;
  if (!k)
    return;
  PICK(fn, k->encode, isa);
  fn(in, out, n);
}

void dtype_accumulate_isa(cpu_isa isa, zs_dtype src, const void *in, float *acc, size_t n) {
  const dtype_codec *k = dtype_codec_of(src);
  dtype_accumulate_fn fn;
  if (!k)
    return;
  PICK(fn, k->accumulate, isa);
  fn(in, acc, n);
}

void dtype_to_f32(zs_dtype src, const void *in, float *out, size_t n) {
  dtype_to_f32_isa(cpu_best_isa(), src, in, out, n);
}

void dtype_from_f32(zs_dtype dst, const float *in, void *out, size_t n) {
  dtype_from_f32_isa(cpu_best_isa(), dst, in, out, n);
}

void dtype_accumulate(zs_dtype src, const void *in, float *acc, size_t n) {
  dtype_accumulate_isa(cpu_best_isa(), src, in, acc, n);
}
