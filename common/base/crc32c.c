/*
 * crc32c — CRC-32C: a table reference and three hardware paths (see
 * crc32c_impl.h), chosen once per process from what the CPU supports.
 *
 * The register. The SSE4.2 CRC32 instruction computes exactly the reflected
 * Castagnoli CRC step without the initial and final inversion, so every path
 * keeps the running register as ~crc: a caller's crc of 0 becomes the standard
 * initial value 0xFFFFFFFF, and the inversion on return makes
 * crc32c(crc32c(0, a), b) the CRC of a followed by b.
 *
 * The algebra. Read as a polynomial over GF(2) in the reflected bit order of
 * crc32c_impl.h, feeding n bytes D into register r gives
 *
 *     r' = r * x^(8n) + D * x^32   (mod P).
 *
 * It is linear, so a buffer A || B can be split: run B from a zero register,
 * run A from r, and join them as crc(A) * x^(8|B|) + crc(B). Multiplying a
 * 32-bit remainder by a constant is one carry-less multiply (PCLMULQDQ) and a
 * reduction mod P; the CRC32 instruction itself does the reduction, which
 * fixes the constants:
 *
 *   - PCLMULQDQ of two reflected 32-bit values a and k leaves in the low 64
 *     bits a product whose bit j is the coefficient of x^(62-j). Read as 8
 *     bytes of reflected data (bit j is x^(63-j)) that is a * k * x.
 *   - CRC32 of those 8 bytes from a zero register gives (a * k * x) * x^32,
 *     that is a * k * x^33 mod P.
 *
 * So a shift by n bytes uses k = x^(8n - 33) mod P. The same reading extends
 * to the 128-bit lanes of the folding path: a 16-byte lane X holds, in memory
 * order, a high half H (its first 8 bytes, coefficients of x^127..x^64) and a
 * low half L (x^63..x^0). Multiplying a 64-bit half by a 32-bit constant k
 * gives a 128-bit lane worth half * k * x^33, so moving X forward by F bits,
 * X * x^F = H * x^(64+F) + L * x^F, takes k = x^(F+31) for H and
 * k = x^(F-33) for L. The product has at most 95 bits, so it fits the lane
 * and can be xored into the data F bits further on. All these constants come
 * from crc32c_gf2_xpow() at first use; none is a magic number.
 *
 * Only the hardware functions are compiled for their instruction sets (target
 * attributes), so the table fallback stays safe on any x86-64 CPU; a hardware
 * path runs only after __builtin_cpu_supports() said the CPU has it.
 */
#include "common/base/crc32c.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "common/base/cpu.h"
#include "common/base/crc32c_impl.h"

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */
#define PREFETCH_AHEAD 2048u    /* bytes, in the folding loop */

#define TARGET_SSE42 __attribute__((target("sse4.2")))
#define TARGET_CLMUL __attribute__((target("sse4.2,pclmul")))
#define TARGET_AVX512 __attribute__((target("avx512f,vpclmulqdq,sse4.2,pclmul")))

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
/* GF(2) arithmetic mod P                                                    */
/* ------------------------------------------------------------------------ */

/* a * x mod P: the coefficient of x^31 sits in bit 0 and moves out to x^32,
 * which P's low terms replace. */
static uint32_t gf2_mul_x(uint32_t a) {
  return (a >> 1) ^ (CRC32C_POLY & (0u - (a & 1u)));
}

uint32_t crc32c_gf2_mul(uint32_t a, uint32_t b) {
  /* Horner's rule over a's coefficients from x^31 (bit 0) down to x^0. */
  uint32_t p = 0;
  for (int i = 0; i < 32; i++)
    p = gf2_mul_x(p) ^ (b & (0u - ((a >> i) & 1u)));
  return p;
}

uint32_t crc32c_gf2_xpow(uint64_t e) {
  uint32_t r = 0x80000000u;  /* 1 */
  uint32_t sq = 0x40000000u; /* x^(2^i) as i runs over e's bits */
  for (; e != 0; e >>= 1) {
    if (e & 1u)
      r = crc32c_gf2_mul(r, sq);
    sq = crc32c_gf2_mul(sq, sq);
  }
  return r;
}

/* ------------------------------------------------------------------------ */
/* Constants and CPU detection                                               */
/* ------------------------------------------------------------------------ */

static const size_t k_clmul_block[CRC32C_CLMUL_BLOCKS] = {
    CRC32C_CLMUL_BLOCK_0, CRC32C_CLMUL_BLOCK_1, CRC32C_CLMUL_BLOCK_2, CRC32C_CLMUL_BLOCK_3};

static struct {
  /* Per CLMUL block size b: shifts by 2b bytes ([0]) and by b bytes ([1]). */
  uint64_t clmul[CRC32C_CLMUL_BLOCKS][2];
  /* Moving a 16-byte lane forward by d bytes takes {x^(8d+31), x^(8d-33)},
   * in the order the lane's halves H and L sit in a register. fold_by_256
   * is one folding step; fold_by_64 holds d = 192, 128, 64, which move
   * registers 0, 1, 2 of the last step onto register 3 (and d = 64 then
   * takes single 64-byte blocks). */
  uint64_t fold_by_256[2];
  uint64_t fold_by_64[3][2];
  /* Lanes 0, 1, 2 of one 512-bit register onto lane 3 (d = 48, 32, 16),
   * and zeros for lane 3, which is added as it is. The d = 16 pair also
   * takes single 16-byte blocks. */
  _Alignas(64) uint64_t fold_lanes[8];
  /* x^(8 * 2^i) mod P: appending 2^i bytes, for crc32c_combine. */
  uint32_t shift_pow2[64];
} g_k;

static int g_supported[CRC32C_PATH_COUNT];
static crc32c_path g_chosen = CRC32C_PATH_TABLE;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void fold_constants(uint64_t k[2], uint64_t bytes) {
  k[0] = crc32c_gf2_xpow(8 * bytes + 31);
  k[1] = crc32c_gf2_xpow(8 * bytes - 33);
}

static void crc_init(void) {
  for (int t = 0; t < CRC32C_CLMUL_BLOCKS; t++) {
    uint64_t bits = 8u * (uint64_t)k_clmul_block[t];
    g_k.clmul[t][0] = crc32c_gf2_xpow(2 * bits - 33);
    g_k.clmul[t][1] = crc32c_gf2_xpow(bits - 33);
  }
  fold_constants(g_k.fold_by_256, CRC32C_AVX512_STEP);
  for (int i = 0; i < 3; i++)
    fold_constants(g_k.fold_by_64[i], 64u * (uint64_t)(3 - i));
  for (int i = 0; i < 3; i++)
    fold_constants(&g_k.fold_lanes[2 * i], 16u * (uint64_t)(3 - i));
  g_k.fold_lanes[6] = g_k.fold_lanes[7] = 0;
  /* By squaring rather than crc32c_gf2_xpow, whose exponent would overflow
   * for the largest i. */
  g_k.shift_pow2[0] = crc32c_gf2_xpow(8);
  for (int i = 1; i < 64; i++)
    g_k.shift_pow2[i] = crc32c_gf2_mul(g_k.shift_pow2[i - 1], g_k.shift_pow2[i - 1]);

  __builtin_cpu_init();
  int sse42 = __builtin_cpu_supports("sse4.2") != 0;
  int clmul = sse42 && __builtin_cpu_supports("pclmul");
  /* The 512-bit path also bows to ZSHARD_ISA through cpu_best_isa(), so a
   * deployment that keeps AVX-512 off (for clock speed) keeps it off here. */
  int avx512 = clmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
               cpu_best_isa() >= CPU_ISA_AVX512;
  g_supported[CRC32C_PATH_TABLE] = 1;
  g_supported[CRC32C_PATH_SSE42] = sse42;
  g_supported[CRC32C_PATH_CLMUL] = clmul;
  g_supported[CRC32C_PATH_AVX512] = avx512;
  g_chosen = avx512  ? CRC32C_PATH_AVX512
             : clmul ? CRC32C_PATH_CLMUL
             : sse42 ? CRC32C_PATH_SSE42
                     : CRC32C_PATH_TABLE;
}

/* ------------------------------------------------------------------------ */
/* SSE4.2: one chain                                                         */
/* ------------------------------------------------------------------------ */

/* Loads through memcpy carry no alignment or aliasing assumption; they compile
 * to one unaligned load, which costs nothing extra here since the chain is
 * bound by the CRC32 instruction's latency. */
static inline uint64_t load64(const unsigned char *p) {
  uint64_t w;
  memcpy(&w, p, sizeof w);
  return w;
}

/* Raw register c (not inverted) extended over len bytes, 8 at a time. */
TARGET_SSE42 static inline uint64_t chain1(uint64_t c, const unsigned char *p, size_t len) {
  for (; len >= 8; len -= 8, p += 8)
    c = _mm_crc32_u64(c, load64(p));
  if (len & 4u) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    c = _mm_crc32_u32((uint32_t)c, w);
    p += 4;
  }
  if (len & 2u) {
    uint16_t w;
    memcpy(&w, p, sizeof w);
    c = _mm_crc32_u16((uint32_t)c, w);
    p += 2;
  }
  if (len & 1u)
    c = _mm_crc32_u8((uint32_t)c, *p);
  return c;
}

TARGET_SSE42 static uint32_t crc32c_sse42(uint32_t crc, const void *buf, size_t len) {
  return ~(uint32_t)chain1(~crc, buf, len);
}

/* ------------------------------------------------------------------------ */
/* SSE4.2 + PCLMUL: three chains                                             */
/* ------------------------------------------------------------------------ */

/* a * x^(8n) mod P as 8 bytes still to be reduced by CRC32, for k =
 * x^(8n - 33) (see the top of the file). */
TARGET_CLMUL static inline __m128i clmul_shift(uint64_t a, uint64_t k) {
  return _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)a), _mm_cvtsi64_si128((long long)k),
                              0x00);
}

/* One step over 3 * b bytes: CRC32 has a latency of three cycles and a
 * throughput of one per cycle, so three independent chains over the three
 * thirds keep it busy every cycle. The chains of the second and third thirds
 * start from zero, and the first two are shifted past the bytes that follow
 * them before the three are added. */
TARGET_CLMUL static inline uint64_t chain3(uint64_t c, const unsigned char *p, size_t b,
                                           const uint64_t k[2]) {
  uint64_t c1 = 0, c2 = 0;
  for (size_t i = 0; i < b; i += 8) {
    c = _mm_crc32_u64(c, load64(p + i));
    c1 = _mm_crc32_u64(c1, load64(p + b + i));
    c2 = _mm_crc32_u64(c2, load64(p + 2 * b + i));
  }
  __m128i shifted = _mm_xor_si128(clmul_shift(c, k[0]), clmul_shift(c1, k[1]));
  return _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(shifted)) ^ c2;
}

/* Raw register c extended over len bytes: the largest steps first, so a long
 * buffer pays for the join (about a dozen cycles) once per 12 KiB. Kept out
 * of line so the short-buffer branch of its callers saves no registers. */
TARGET_CLMUL __attribute__((noinline)) static uint64_t chains(uint64_t c, const unsigned char *p,
                                                              size_t len) {
  for (int t = 0; t < CRC32C_CLMUL_BLOCKS; t++) {
    size_t b = k_clmul_block[t];
    for (; len >= 3 * b; len -= 3 * b, p += 3 * b)
      c = chain3(c, p, b, g_k.clmul[t]);
  }
  return chain1(c, p, len);
}

TARGET_CLMUL static uint32_t crc32c_clmul(uint32_t crc, const void *buf, size_t len) {
  if (len < 3 * CRC32C_CLMUL_BLOCK_3)
    return ~(uint32_t)chain1(~crc, buf, len);
  return ~(uint32_t)chains(~crc, buf, len);
}

/* ------------------------------------------------------------------------ */
/* AVX-512 VPCLMULQDQ: folding                                               */
/* ------------------------------------------------------------------------ */

/* Each 128-bit lane of x moved forward by the distance k was made for, as a
 * 95-bit remainder (see the top of the file). */
TARGET_AVX512 static inline __m512i fold(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                          _mm512_clmulepi64_epi128(x, k, 0x11));
}

TARGET_AVX512 static inline __m512i fold_into(__m512i x, __m512i k, __m512i data) {
  /* 0x96 is the truth table of a ^ b ^ c. */
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), data, 0x96);
}

TARGET_AVX512 static inline __m512i lane_constants(const uint64_t k[2]) {
  return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k[1], (long long)k[0]));
}

/* The 16-byte remainder x moved forward by the distance k was made for, plus
 * the 16 bytes that lie that far on. */
TARGET_AVX512 static inline __m128i fold16_into(__m128i x, __m128i k, __m128i data) {
  return _mm_xor_si128(
      _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

/* Four 512-bit registers carry the remainder of the buffer so far, each lane
 * standing for 16 bytes of it; every step multiplies them 256 bytes forward
 * and adds the next 256 bytes. Two VPCLMULQDQ per 64 bytes, on a port the
 * loads and xors leave free, is several times the CRC32 instruction's 8
 * bytes per cycle. The four registers then fold into one, which takes the
 * remaining 64-byte blocks, and its four lanes into one, which takes the
 * remaining 16-byte blocks. That lane is congruent mod P to the whole buffer
 * read so far, so CRC32 of its 16 bytes from a zero register is the buffer's
 * CRC register, and the last 0..15 bytes go through CRC32 directly. */
TARGET_AVX512 __attribute__((noinline)) static uint32_t folds(uint32_t crc, const unsigned char *p,
                                                              size_t len) {
  /* The incoming register joins the data as its first four bytes: r * x^(8n)
   * is what those bytes would contribute as data (times x^32). */
  __m512i x0 =
      _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  p += CRC32C_AVX512_STEP;
  len -= CRC32C_AVX512_STEP;

  /* The hardware prefetcher alone leaves this loop waiting for memory, both
   * from L2 and from DRAM: asking for the bytes 2 KiB ahead measured 10 to
   * 20% faster here. The first loop prefetches only inside the buffer. */
  const __m512i k256 = lane_constants(g_k.fold_by_256);
  for (; len >= CRC32C_AVX512_STEP + PREFETCH_AHEAD;
       len -= CRC32C_AVX512_STEP, p += CRC32C_AVX512_STEP) {
    for (size_t i = 0; i < CRC32C_AVX512_STEP; i += 64)
      _mm_prefetch((const char *)p + PREFETCH_AHEAD + i, _MM_HINT_T0);
    x0 = fold_into(x0, k256, _mm512_loadu_si512(p));
    x1 = fold_into(x1, k256, _mm512_loadu_si512(p + 64));
    x2 = fold_into(x2, k256, _mm512_loadu_si512(p + 128));
    x3 = fold_into(x3, k256, _mm512_loadu_si512(p + 192));
  }
  for (; len >= CRC32C_AVX512_STEP; len -= CRC32C_AVX512_STEP, p += CRC32C_AVX512_STEP) {
    x0 = fold_into(x0, k256, _mm512_loadu_si512(p));
    x1 = fold_into(x1, k256, _mm512_loadu_si512(p + 64));
    x2 = fold_into(x2, k256, _mm512_loadu_si512(p + 128));
    x3 = fold_into(x3, k256, _mm512_loadu_si512(p + 192));
  }

  const __m512i k64 = lane_constants(g_k.fold_by_64[2]);
  x3 = _mm512_ternarylogic_epi64(fold(x0, lane_constants(g_k.fold_by_64[0])),
                                 fold(x1, lane_constants(g_k.fold_by_64[1])), x3, 0x96);
  x3 = fold_into(x2, k64, x3);
  for (; len >= 64; len -= 64, p += 64)
    x3 = fold_into(x3, k64, _mm512_loadu_si512(p));

  __m512i y = fold(x3, _mm512_load_si512(g_k.fold_lanes));
  __m128i v = _mm_xor_si128(
      _mm_xor_si128(_mm512_castsi512_si128(y), _mm512_extracti32x4_epi32(y, 1)),
      _mm_xor_si128(_mm512_extracti32x4_epi32(y, 2), _mm512_extracti32x4_epi32(x3, 3)));
  const __m128i k16 = _mm_loadu_si128((const __m128i *)&g_k.fold_lanes[4]);
  for (; len >= 16; len -= 16, p += 16)
    v = fold16_into(v, k16, _mm_loadu_si128((const __m128i *)p));

  uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(v));
  c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(v, 1));
  return ~(uint32_t)chain1(c, p, len);
}

/* Short buffers stay on the CRC32 chains, where folding's fixed cost (about
 * 30 cycles to reduce the registers) would not pay for itself. */
TARGET_AVX512 static uint32_t crc32c_avx512(uint32_t crc, const void *buf, size_t len) {
  if (len < 3 * CRC32C_CLMUL_BLOCK_3)
    return ~(uint32_t)chain1(~crc, buf, len);
  if (len < CRC32C_AVX512_MIN)
    return ~(uint32_t)chains(~crc, buf, len);
  return folds(crc, buf, len);
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------ */

typedef uint32_t (*crc_fn)(uint32_t crc, const void *buf, size_t len);

static const crc_fn k_path_fn[CRC32C_PATH_COUNT] = {
    [CRC32C_PATH_TABLE] = crc32c_sw,
    [CRC32C_PATH_SSE42] = crc32c_sse42,
    [CRC32C_PATH_CLMUL] = crc32c_clmul,
    [CRC32C_PATH_AVX512] = crc32c_avx512,
};

static uint32_t crc32c_first(uint32_t crc, const void *buf, size_t len);

/* crc32c() is called for every frame header as well as every payload, so its
 * dispatch is one acquire load and one indirect call rather than a call into
 * pthread_once. The pointer starts at crc32c_first, which runs the detection
 * and then publishes the chosen path; the release store orders the constants
 * in g_k before it for any thread that loads the new pointer. */
static _Atomic(crc_fn) g_fn = crc32c_first;

static void crc_init_once(void) {
  crc_init();
  atomic_store_explicit(&g_fn, k_path_fn[g_chosen], memory_order_release);
}

static uint32_t crc32c_first(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&g_once, crc_init_once);
  return k_path_fn[g_chosen](crc, buf, len);
}

uint32_t crc32c(uint32_t crc, const void *buf, size_t len) {
  return atomic_load_explicit(&g_fn, memory_order_acquire)(crc, buf, len);
}

/* The register after A || B, started from ~0, is r_A * x^(8|B|) + B * x^32;
 * B's own register, started from ~0 too, is ~0 * x^(8|B|) + B * x^32. Their
 * sum is (r_A + ~0) * x^(8|B|), and r_A + ~0 is crc_a itself (the inversion
 * on return), so crc(A || B) = crc_a * x^(8|B|) + crc_b: the inversions
 * cancel. One multiplication per set bit of len_b. */
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) {
  pthread_once(&g_once, crc_init_once);
  uint32_t r = crc_a;
  for (int i = 0; len_b != 0 && r != 0; i++, len_b >>= 1)
    if (len_b & 1u)
      r = crc32c_gf2_mul(r, g_k.shift_pow2[i]);
  return r ^ crc_b;
}

int crc32c_path_supported(crc32c_path path) {
  pthread_once(&g_once, crc_init_once);
  return (unsigned)path < CRC32C_PATH_COUNT && g_supported[path];
}

crc32c_path crc32c_path_chosen(void) {
  pthread_once(&g_once, crc_init_once);
  return g_chosen;
}

const char *crc32c_path_name(crc32c_path path) {
  switch (path) {
  case CRC32C_PATH_TABLE:
    return "table";
  case CRC32C_PATH_SSE42:
    return "sse42";
  case CRC32C_PATH_CLMUL:
    return "clmul";
  case CRC32C_PATH_AVX512:
    return "avx512";
  default:
    return "?";
  }
}

uint32_t crc32c_with_path(crc32c_path path, uint32_t crc, const void *buf, size_t len) {
  if (!crc32c_path_supported(path))
    path = CRC32C_PATH_TABLE;
  return k_path_fn[path](crc, buf, len);
}
