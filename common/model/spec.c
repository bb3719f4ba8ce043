/*
 * spec — defaults, validation, canonical hash, copy and free of the model spec.
 *
 * spec_validate() is the gate for specs that arrive over the network: after it
 * returns 0, every count is within the SPEC_MAX_* limits, every index is in
 * range, every name is printable UTF-8 and every hyper-parameter is one torch
 * itself would accept, so the layout and the optimizer may use the spec without
 * further checks.
 */
#include "common/model/spec.h"
#include "common/model/spec_optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/le.h"
#include "common/base/status.h"

/* ------------------------------------------------------------------------ */
/* Defaults                                                                  */
/* ------------------------------------------------------------------------ */

void spec_group_defaults(spec_group *g, zs_optimizer opt) {
  memset(g, 0, sizeof *g);
  g->optimizer = opt;
  g->lr_scale = 1.0;
  /* Bias correction is on for every optimizer, as the proto's default
   * (disable_bias_correction = false) says; the ones without one ignore it. */
  g->bias_correction = 1;
  const spec_optim *o = spec_optim_of(opt);
  if (o)
    o->defaults(g);
}

/* ------------------------------------------------------------------------ */
/* Validation                                                                */
/* ------------------------------------------------------------------------ */

/* A name made safe to print inside double quotes in an error message: the
 * name may be exactly what is being rejected (control characters, bad UTF-8,
 * 10 kB long), so bytes outside printable ASCII become \xNN and the text is
 * cut at a readable length. */
typedef struct quoted {
  char s[96];
} quoted;

static quoted quote(const char *name) {
  quoted q;
  size_t o = 0;
  if (!name) {
    snprintf(q.s, sizeof q.s, "(null)");
    return q;
  }
  for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
    if (o + 8 >= sizeof q.s) {
      memcpy(q.s + o, "...", 4);
      return q;
    }
    if (*p >= 0x20 && *p < 0x7f && *p != '"' && *p != '\\')
      q.s[o++] = (char)*p;
    else
      o += (size_t)snprintf(q.s + o, sizeof q.s - o, "\\x%02x", *p);
  }
  q.s[o] = '\0';
  return q;
}

#define SPEC_STR2(x) #x
#define SPEC_STR(x) SPEC_STR2(x)

/* NULL if `s` is an acceptable name (1..SPEC_MAX_NAME bytes of well-formed
 * UTF-8 without control characters), else the reason, as a phrase. */
static const char *name_problem(const char *s) {
  if (!s || !*s)
    return "name is empty";
  size_t len = strnlen(s, SPEC_MAX_NAME + 1);
  if (len > SPEC_MAX_NAME)
    return "name is longer than " SPEC_STR(SPEC_MAX_NAME) " bytes";
  const unsigned char *p = (const unsigned char *)s;
  for (size_t i = 0; i < len;) {
    unsigned c = p[i];
    if (c < 0x20 || c == 0x7f)
      return "name contains a control character";
    if (c < 0x80) {
      i++;
      continue;
    }
    /* Multi-byte UTF-8: the lead byte gives the length and the smallest code
     * point that length may encode (no overlong forms); surrogates and code
     * points above U+10FFFF are not characters. C1 controls (U+0080..U+009F)
     * are control characters too. */
    size_t n;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) {
      n = 2, cp = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 3, cp = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return "name is not valid UTF-8";
    }
    if (i + n > len)
      return "name is not valid UTF-8";
    for (size_t k = 1; k < n; k++) {
      if ((p[i + k] & 0xc0) != 0x80)
        return "name is not valid UTF-8";
      cp = (cp << 6) | (p[i + k] & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return "name is not valid UTF-8";
    if (cp <= 0x9f)
      return "name contains a control character";
    i += n;
  }
  return NULL;
}

static int check_group(const spec_group *g, uint32_t i, char *err, size_t errlen) {
  /* Every double is hashed and may be read by the optimizer, so even the
   * ones this optimizer ignores must be finite; every flag is 0 or 1. The
   * doubles are checked first, in list order, then the flags. */
#define CHECK_F64(name)                                                                            \
  if (!isfinite(g->name))                                                                          \
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: %s is not finite (%g)", i, #name,  \
                       g->name);
#define CHECK_FLAG(name)
#define CHECK_FLAG_NEGATED(name)
#define CHECK_FINITE(kind, name, proto) CHECK_##kind(name)
  SPEC_GROUP_FIELDS(CHECK_FINITE)
#undef CHECK_FINITE
#undef CHECK_F64
#undef CHECK_FLAG
#undef CHECK_FLAG_NEGATED
  if (g->lr_scale < 0)
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: lr_scale %g is negative", i,
                       g->lr_scale);
  if (g->weight_decay < 0)
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: weight_decay %g is negative", i,
                       g->weight_decay);
#define CHECK_F64(name)
#define CHECK_FLAG(name)                                                                           \
  if (g->name != 0 && g->name != 1)                                                                \
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: %s is %d, not 0 or 1", i, #name,   \
                       g->name);
#define CHECK_FLAG_NEGATED(name) CHECK_FLAG(name)
#define CHECK_01(kind, name, proto) CHECK_##kind(name)
  SPEC_GROUP_FIELDS(CHECK_01)
#undef CHECK_01
#undef CHECK_F64
#undef CHECK_FLAG
#undef CHECK_FLAG_NEGATED

  const spec_optim *o = spec_optim_of(g->optimizer);
  if (!o)
    return status_fail(err, errlen, ZS_EINVAL, "param group %u: unknown optimizer %d", i,
                       (int)g->optimizer);
  return o->check(g, i, err, errlen);
}

static int check_tensor(const spec *s, uint32_t i, char *err, size_t errlen) {
  const spec_tensor *t = &s->tensors[i];
  const char *why = name_problem(t->name);
  if (why)
    return status_fail(err, errlen, ZS_EINVAL, "tensor %u (\"%s\"): %s", i, quote(t->name).s, why);
  if (t->numel == 0)
    return status_fail(err, errlen, ZS_EINVAL, "tensor %u (\"%s\"): numel is 0", i,
                       quote(t->name).s);
  if (t->numel > SPEC_MAX_NUMEL)
    return status_fail(
        err, errlen, ZS_EINVAL, "tensor %u (\"%s\"): numel %llu exceeds the limit of %llu", i,
        quote(t->name).s, (unsigned long long)t->numel, (unsigned long long)SPEC_MAX_NUMEL);
  if (t->group >= s->num_groups)
    return status_fail(err, errlen, ZS_EINVAL,
                       "tensor %u (\"%s\"): group %u out of range (%u groups)", i, quote(t->name).s,
                       t->group, s->num_groups);
  if (t->ndim > SPEC_MAX_DIMS)
    return status_fail(err, errlen, ZS_EINVAL,
                       "tensor %u (\"%s\"): %u dimensions, at most %u allowed", i, quote(t->name).s,
                       t->ndim, SPEC_MAX_DIMS);
  uint64_t prod = 1;
  for (uint32_t d = 0; d < t->ndim; d++) {
    /* The product is checked for overflow at each step: a shape of huge
     * dimensions must not wrap around to numel. */
    if (t->shape[d] == 0 || __builtin_mul_overflow(prod, t->shape[d], &prod))
      return status_fail(err, errlen, ZS_EINVAL,
                         "tensor %u (\"%s\"): shape dimension %u (%llu) is invalid", i,
                         quote(t->name).s, d, (unsigned long long)t->shape[d]);
  }
  if (t->ndim > 0 && prod != t->numel)
    return status_fail(err, errlen, ZS_EINVAL,
                       "tensor %u (\"%s\"): shape product %llu differs from numel %llu", i,
                       quote(t->name).s, (unsigned long long)prod, (unsigned long long)t->numel);
  return 0;
}

static int cmp_name_index(const void *a, const void *b, void *arg) {
  const spec_tensor *t = arg;
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  int c = strcmp(t[x].name, t[y].name);
  if (c != 0)
    return c;
  return x < y ? -1 : x > y;
}

/* Names are compared after sorting an index array, O(n log n) for up to a
 * million tensors. Returns 0, ZS_EINVAL naming both tensors, or ZS_ENOMEM. */
static int check_unique_names(const spec *s, char *err, size_t errlen) {
  uint32_t *idx = malloc((size_t)s->num_tensors * sizeof *idx);
  if (!idx)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory while checking %u tensor names",
                       s->num_tensors);
  for (uint32_t i = 0; i < s->num_tensors; i++)
    idx[i] = i;
  qsort_r(idx, s->num_tensors, sizeof *idx, cmp_name_index, s->tensors);
  int rc = 0;
  for (uint32_t k = 1; k < s->num_tensors; k++) {
    if (strcmp(s->tensors[idx[k - 1]].name, s->tensors[idx[k]].name) == 0) {
      rc = status_fail(err, errlen, ZS_EINVAL, "tensor %u (\"%s\"): name already used by tensor %u",
                       idx[k], quote(s->tensors[idx[k]].name).s, idx[k - 1]);
      break;
    }
  }
  free(idx);
  return rc;
}

/* The layout numbers pieces with 32 bits; a tensor has at most one piece per
 * shard, so the limits alone keep every valid spec within that. */
_Static_assert((uint64_t)SPEC_MAX_TENSORS *SPEC_MAX_SHARDS <= UINT32_MAX,
               "the layout's 32-bit piece count could overflow");

/* Bounds the whole model: the element total (arenas) and the piece count (the
 * layout allocates per piece before any arena is sized), counted as the layout
 * will split (each tensor was checked to be at most SPEC_MAX_NUMEL, so the sums
 * cannot overflow before the comparison stops them). */
static int check_totals(const spec *s, char *err, size_t errlen) {
  uint64_t threshold = s->split_threshold ? s->split_threshold : SPEC_DEFAULT_SPLIT_THRESHOLD;
  uint64_t total = 0, pieces = 0;
  for (uint32_t i = 0; i < s->num_tensors; i++) {
    uint64_t n = s->tensors[i].numel;
    total += n;
    if (n >= threshold) {
      uint64_t chunks = (n + 15) / 16; /* slices are multiples of 16 elements */
      pieces += chunks < s->num_shards ? chunks : s->num_shards;
    } else {
      pieces += 1;
    }
    if (total > SPEC_MAX_TOTAL_NUMEL)
      return status_fail(err, errlen, ZS_EINVAL, "the model has more than %llu elements in all",
                         (unsigned long long)SPEC_MAX_TOTAL_NUMEL);
    if (pieces > SPEC_MAX_PIECES)
      return status_fail(err, errlen, ZS_EINVAL, "the layout would have more than %llu pieces",
                         (unsigned long long)SPEC_MAX_PIECES);
  }
  return 0;
}

int spec_validate(spec *s, char *err, size_t errlen) {
  if (err && errlen > 0)
    err[0] = '\0';
  if (!s)
    return status_fail(err, errlen, ZS_EINVAL, "no spec given");

  const char *why = name_problem(s->job);
  if (why)
    return status_fail(err, errlen, ZS_EINVAL, "job \"%s\": %s", quote(s->job).s, why);

  if (s->world_size < 1 || s->world_size > SPEC_MAX_WORLD)
    return status_fail(err, errlen, ZS_EINVAL, "world_size %u is outside 1..%u", s->world_size,
                       SPEC_MAX_WORLD);
  if (s->grad_accum < 1 || s->grad_accum > SPEC_MAX_ACCUM)
    return status_fail(err, errlen, ZS_EINVAL, "grad_accum %u is outside 1..%u", s->grad_accum,
                       SPEC_MAX_ACCUM);
  if ((uint64_t)s->world_size * s->grad_accum > SPEC_MAX_CONTRIB)
    return status_fail(
        err, errlen, ZS_EINVAL,
        "world_size %u times grad_accum %u is %llu contributions per step, more than %u",
        s->world_size, s->grad_accum, (unsigned long long)s->world_size * s->grad_accum,
        SPEC_MAX_CONTRIB);
  if (s->num_shards < 1 || s->num_shards > SPEC_MAX_SHARDS)
    return status_fail(err, errlen, ZS_EINVAL, "num_shards %u is outside 1..%u", s->num_shards,
                       SPEC_MAX_SHARDS);
  if (s->reduce != SPEC_REDUCE_MEAN && s->reduce != SPEC_REDUCE_SUM)
    return status_fail(err, errlen, ZS_EINVAL, "grad_reduce %d is neither mean (0) nor sum (1)",
                       (int)s->reduce);
  if (s->param_dtype != ZS_DTYPE_BF16 && s->param_dtype != ZS_DTYPE_FP16)
    return status_fail(err, errlen, ZS_EINVAL, "param_dtype %d is neither bf16 (%d) nor fp16 (%d)",
                       (int)s->param_dtype, ZS_DTYPE_BF16, ZS_DTYPE_FP16);
  if (s->pipelined != 0 && s->pipelined != 1)
    return status_fail(err, errlen, ZS_EINVAL, "pipelined is %d, not 0 or 1", s->pipelined);

  if (s->num_groups < 1 || s->num_groups > SPEC_MAX_GROUPS)
    return status_fail(err, errlen, ZS_EINVAL, "%u param groups, expected 1..%u", s->num_groups,
                       SPEC_MAX_GROUPS);
  if (!s->groups)
    return status_fail(err, errlen, ZS_EINVAL, "%u param groups declared but none given",
                       s->num_groups);
  for (uint32_t i = 0; i < s->num_groups; i++) {
    int rc = check_group(&s->groups[i], i, err, errlen);
    if (rc)
      return rc;
  }

  if (s->num_tensors < 1 || s->num_tensors > SPEC_MAX_TENSORS)
    return status_fail(err, errlen, ZS_EINVAL, "%u tensors, expected 1..%u", s->num_tensors,
                       SPEC_MAX_TENSORS);
  if (!s->tensors)
    return status_fail(err, errlen, ZS_EINVAL, "%u tensors declared but none given",
                       s->num_tensors);
  for (uint32_t i = 0; i < s->num_tensors; i++) {
    int rc = check_tensor(s, i, err, errlen);
    if (rc)
      return rc;
  }
  int rc = check_unique_names(s, err, errlen);
  if (rc)
    return rc;
  if ((rc = check_totals(s, err, errlen)) != 0)
    return rc;

  /* Filled last, so that a rejected spec is left exactly as it came. */
  if (s->split_threshold == 0)
    s->split_threshold = SPEC_DEFAULT_SPLIT_THRESHOLD;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Canonical hash                                                            */
/* ------------------------------------------------------------------------ */

/*
 * spec_encode writes this byte string (checkpoints store it), every integer
 * little-endian whatever the host's byte order, and spec_hash is FNV-1a 64
 * (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over it without the
 * world_size field (issue 26: trainers that name another world size open the
 * same job; spec_hash_legacy, the hash of checkpoints written before, keeps
 * the field):
 *
 *   "zshard.spec.v1"                      14 bytes, a version tag
 *   u32 len(job), job bytes
 *   u32 world_size, u32 grad_accum, u32 num_shards
 *   u64 split_threshold                   0 encoded as the default, 65536
 *   u32 reduce, u32 param_dtype
 *   u32 num_groups, then per group:
 *     u32 optimizer
 *     SPEC_GROUP_FIELDS in their order (spec.h), an F64 as the u64 of its
 *     IEEE 754 bits (so 0.0 and -0.0 differ), a FLAG as u32: today
 *     lr_scale, beta1, beta2, eps, weight_decay, momentum, dampening,
 *     then nesterov, bias_correction
 *   u32 num_tensors, then per tensor:
 *     u32 len(name), name bytes
 *     u64 numel, u32 group, u32 ndim, u64 shape[0 .. ndim)
 *   u32 1, only for a pipelined job: a gated job's encoding (and so its hash
 *     and its checkpoints) is what it was before the field existed, and the
 *     tensors' counted encoding ends where this begins, so no two specs
 *     share an encoding
 *
 * Lengths precede strings so that no two different specs encode to the same
 * bytes ("ab" + "c" vs "a" + "bc"). Shape entries at and beyond ndim are not
 * part of the spec and not hashed. A final mixing step (the 64-bit finaliser
 * of MurmurHash3, a published constant sequence) spreads FNV's weak low bits
 * over the whole word, so any 32 bits of the hash are as good as any other.
 */

/* Where the encoding goes: a hash, a length count or a buffer. */
typedef struct sink {
  void (*put)(struct sink *k, const unsigned char *p, size_t n);
  uint64_t h;         /* hash: the FNV-1a state */
  unsigned char *buf; /* buffer: room for len bytes, counted in at */
  size_t at;
} sink;

static void put_u32(sink *k, uint32_t v) {
  unsigned char b[4];
  le_store32(b, v);
  k->put(k, b, sizeof b);
}

static void put_u64(sink *k, uint64_t v) {
  unsigned char b[8];
  le_store64(b, v);
  k->put(k, b, sizeof b);
}

/* Each kind's encoding; FLAG values are not normalised here: a validated
 * spec holds only 0 and 1, and the hash of anything else must differ. */
#define PUT_F64(p, v) le_store_f64(p, v)
#define PUT_FLAG(p, v) le_store32(p, (uint32_t)(v))
#define PUT_FLAG_NEGATED(p, v) le_store32(p, (uint32_t)(v))
#define GET_F64(p) le_load_f64(p)
#define GET_FLAG(p) (int)le_load32(p)
#define GET_FLAG_NEGATED(p) (int)le_load32(p)

void spec_group_put_fields(const spec_group *g, unsigned char *out) {
#define PUT_FIELD(kind, name, proto)                                                               \
  PUT_##kind(out, g->name);                                                                        \
  out += SPEC_FIELD_BYTES_##kind;
  SPEC_GROUP_FIELDS(PUT_FIELD)
#undef PUT_FIELD
}

void spec_group_get_fields(spec_group *g, const unsigned char *in) {
#define GET_FIELD(kind, name, proto)                                                               \
  g->name = GET_##kind(in);                                                                        \
  in += SPEC_FIELD_BYTES_##kind;
  SPEC_GROUP_FIELDS(GET_FIELD)
#undef GET_FIELD
}

static void put_str(sink *k, const char *s) {
  size_t n = s ? strlen(s) : 0;
  put_u32(k, (uint32_t)n);
  k->put(k, (const unsigned char *)s, n);
}

/* The canonical encoding (above), the one place it is written; with_world 0
 * leaves world_size out (what spec_hash hashes). */
static void spec_emit(const spec *s, sink *k, int with_world) {
  k->put(k, (const unsigned char *)"zshard.spec.v1", 14);
  put_str(k, s->job);
  if (with_world)
    put_u32(k, s->world_size);
  put_u32(k, s->grad_accum);
  put_u32(k, s->num_shards);
  put_u64(k, s->split_threshold ? s->split_threshold : SPEC_DEFAULT_SPLIT_THRESHOLD);
  put_u32(k, (uint32_t)s->reduce);
  put_u32(k, (uint32_t)s->param_dtype);
  put_u32(k, s->num_groups);
  for (uint32_t i = 0; i < s->num_groups; i++) {
    unsigned char fields[SPEC_GROUP_FIELDS_BYTES];
    put_u32(k, (uint32_t)s->groups[i].optimizer);
    spec_group_put_fields(&s->groups[i], fields);
    k->put(k, fields, sizeof fields);
  }
  put_u32(k, s->num_tensors);
  for (uint32_t i = 0; i < s->num_tensors; i++) {
    const spec_tensor *t = &s->tensors[i];
    uint32_t ndim = t->ndim <= SPEC_MAX_DIMS ? t->ndim : SPEC_MAX_DIMS;
    put_str(k, t->name);
    put_u64(k, t->numel);
    put_u32(k, t->group);
    put_u32(k, t->ndim);
    for (uint32_t d = 0; d < ndim; d++)
      put_u64(k, t->shape[d]);
  }
  if (s->pipelined)
    put_u32(k, (uint32_t)s->pipelined);
}

static void hash_put(sink *k, const unsigned char *p, size_t n) {
  uint64_t h = k->h;
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  k->h = h;
}

static void count_put(sink *k, const unsigned char *p, size_t n) {
  (void)p;
  k->at += n;
}

static void copy_put(sink *k, const unsigned char *p, size_t n) {
  if (n)
    memcpy(k->buf + k->at, p, n);
  k->at += n;
}

static uint64_t hash_emit(const spec *s, int with_world) {
  sink k = {.put = hash_put, .h = 0xcbf29ce484222325ull};
  spec_emit(s, &k, with_world);
  uint64_t h = k.h;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

uint64_t spec_hash(const spec *s) {
  return hash_emit(s, 0);
}

uint64_t spec_hash_legacy(const spec *s) {
  return hash_emit(s, 1);
}

int spec_encode(const spec *s, unsigned char **out, size_t *len) {
  sink k = {.put = count_put};
  spec_emit(s, &k, 1);
  unsigned char *buf = malloc(k.at ? k.at : 1);
  if (!buf)
    return ZS_ENOMEM;
  k = (sink){.put = copy_put, .buf = buf};
  spec_emit(s, &k, 1);
  *out = buf;
  *len = k.at;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Copy and free                                                             */
/* ------------------------------------------------------------------------ */

int spec_copy(spec *dst, const spec *src) {
  memset(dst, 0, sizeof *dst);
  *dst = *src;
  dst->job = NULL;
  dst->groups = NULL;
  dst->tensors = NULL;
  /* Counts stay zero until their array exists, so spec_free() on the way out
   * never walks past what was built. */
  dst->num_groups = 0;
  dst->num_tensors = 0;

  if (src->job && !(dst->job = strdup(src->job)))
    goto fail;
  if (src->num_groups > 0) {
    dst->groups = malloc((size_t)src->num_groups * sizeof *dst->groups);
    if (!dst->groups)
      goto fail;
    memcpy(dst->groups, src->groups, (size_t)src->num_groups * sizeof *dst->groups);
    dst->num_groups = src->num_groups;
  }
  if (src->num_tensors > 0) {
    dst->tensors = calloc(src->num_tensors, sizeof *dst->tensors);
    if (!dst->tensors)
      goto fail;
    dst->num_tensors = src->num_tensors;
    for (uint32_t i = 0; i < src->num_tensors; i++) {
      dst->tensors[i] = src->tensors[i];
      dst->tensors[i].name = NULL;
      if (src->tensors[i].name && !(dst->tensors[i].name = strdup(src->tensors[i].name)))
        goto fail;
    }
  }
  return 0;

fail:
  spec_free(dst);
  return ZS_ENOMEM;
}

void spec_free(spec *s) {
  if (!s)
    return;
  if (s->tensors)
    for (uint32_t i = 0; i < s->num_tensors; i++)
      free(s->tensors[i].name);
  free(s->tensors);
  free(s->groups);
  free(s->job);
  memset(s, 0, sizeof *s);
}
