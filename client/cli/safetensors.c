/*
 * safetensors — the header reader (safetensors.h says what it checks).
 *
 * The JSON parser is a recursive descent over a bounded buffer that knows
 * exactly the shapes the header has: the top object, each tensor's object,
 * the shape and offset arrays, and the metadata object of strings. It never
 * reads past `end`, accepts only non-negative integers below 2^64 (no sign,
 * fraction, exponent or leading zero), refuses duplicate keys, and reports
 * the byte offset of the first thing it cannot take.
 */
#include "safetensors.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/le.h"
#include "common/base/status.h"

typedef struct jp {
  const uint8_t *p, *start, *end;
  char *err;
  size_t errlen;
} jp;

static int jp_fail(jp *j, const char *what) {
  return status_fail(j->err, j->errlen, ZS_EPROTO, "safetensors header: %s at byte %zu", what,
                     (size_t)(j->p - j->start) + 8);
}

static void jp_ws(jp *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
    j->p++;
}

/* Consumes character c after whitespace; 1 if it was there. */
static int jp_eat(jp *j, char c) {
  jp_ws(j);
  if (j->p < j->end && *j->p == (uint8_t)c) {
    j->p++;
    return 1;
  }
  return 0;
}

static int hex4(const uint8_t *p, uint32_t *out) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    uint8_t c = p[i];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f')
      v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      v |= (uint32_t)(c - 'A' + 10);
    else
      return -1;
  }
  *out = v;
  return 0;
}

static size_t put_utf8(uint32_t cp, char *o) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* One \u escape at j->p (after the backslash and 'u'), a surrogate pair
 * taken whole, as UTF-8 into o; returns its length or 0 when malformed. */
static size_t jp_unicode(jp *j, char *o) {
  uint32_t cp, lo;
  if (j->end - j->p < 4 || hex4(j->p, &cp) != 0)
    return 0;
  j->p += 4;
  if (cp >= 0xDC00 && cp <= 0xDFFF)
    return 0;
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || hex4(j->p + 2, &lo) != 0 ||
        lo < 0xDC00 || lo > 0xDFFF)
      return 0;
    j->p += 6;
    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
  }
  if (cp == 0)
    return 0; /* names are C strings */
  return put_utf8(cp, o);
}

/* A string, unescaped into a new NUL-terminated buffer (*out, the
 * caller's). An escape never grows the text (\uXXXX is 6 bytes, at most 4
 * of UTF-8), so the raw length bounds the result. Control characters and a
 * NUL are refused. */
static int jp_string(jp *j, char **out) {
  if (!jp_eat(j, '"'))
    return jp_fail(j, "a string was expected");
  const uint8_t *s = j->p;
  while (s < j->end && *s != '"')
    s += (*s == '\\' && s + 1 < j->end) ? 2 : 1;
  if (s >= j->end)
    return jp_fail(j, "a string runs past the header");
  char *o = malloc((size_t)(s - j->p) + 1);
  if (!o)
    return status_fail(j->err, j->errlen, ZS_ENOMEM, "out of memory");
  size_t n = 0;
  while (*j->p != '"') {
    uint8_t c = *j->p++;
    if (c < 0x20) {
      free(o);
      return jp_fail(j, "a control character in a string");
    }
    if (c != '\\') {
      o[n++] = (char)c;
      continue;
    }
    uint8_t e = *j->p++;
    const char *simple = strchr("\"\\/bfnrt", e);
    if (e && simple) {
      static const char map[] = "\"\\/\b\f\n\r\t";
      o[n++] = map[simple - "\"\\/bfnrt"];
    } else if (e == 'u') {
      size_t k = jp_unicode(j, o + n);
      if (k == 0) {
        free(o);
        return jp_fail(j, "a bad \\u escape");
      }
      n += k;
    } else {
      free(o);
      return jp_fail(j, "a bad escape");
    }
  }
  j->p++;
  o[n] = '\0';
  *out = o;
  return 0;
}

static int jp_uint(jp *j, uint64_t *out) {
  jp_ws(j);
  if (j->p >= j->end || *j->p < '0' || *j->p > '9')
    return jp_fail(j, "a non-negative integer was expected");
  if (*j->p == '0' && j->p + 1 < j->end && j->p[1] >= '0' && j->p[1] <= '9')
    return jp_fail(j, "an integer with a leading zero");
  uint64_t v = 0;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    uint64_t d = (uint64_t)(*j->p - '0');
    if (v > (UINT64_MAX - d) / 10)
      return jp_fail(j, "an integer beyond 2^64");
    v = v * 10 + d;
    j->p++;
  }
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    return jp_fail(j, "a number that is not an integer");
  *out = v;
  return 0;
}

/* An array of at most `max` integers into v; *n gets the count. */
static int jp_uints(jp *j, uint64_t *v, uint32_t max, uint32_t *n, const char *what) {
  if (!jp_eat(j, '['))
    return jp_fail(j, what);
  *n = 0;
  if (jp_eat(j, ']'))
    return 0;
  do {
    if (*n == max)
      return jp_fail(j, "too many entries in an array");
    int rc = jp_uint(j, &v[(*n)++]);
    if (rc != 0)
      return rc;
  } while (jp_eat(j, ','));
  return jp_eat(j, ']') ? 0 : jp_fail(j, "',' or ']' was expected");
}

/* "__metadata__": an object of string values, checked and dropped. */
static int jp_metadata(jp *j) {
  if (!jp_eat(j, '{'))
    return jp_fail(j, "__metadata__ must be an object");
  if (jp_eat(j, '}'))
    return 0;
  do {
    char *k = NULL, *v = NULL;
    int rc = jp_string(j, &k);
    if (rc == 0 && !jp_eat(j, ':'))
      rc = jp_fail(j, "':' was expected");
    if (rc == 0)
      rc = jp_string(j, &v);
    free(k);
    free(v);
    if (rc != 0)
      return rc;
  } while (jp_eat(j, ','));
  return jp_eat(j, '}') ? 0 : jp_fail(j, "',' or '}' was expected in __metadata__");
}

const char *st_dtype_name(zs_dtype d) {
  return d == ZS_DTYPE_BF16 ? "BF16" : d == ZS_DTYPE_FP16 ? "F16" : "F32";
}

unsigned st_dtype_size(zs_dtype d) {
  return d == ZS_DTYPE_FP32 ? 4 : 2;
}

int st_shape_numel(const uint64_t *shape, uint32_t ndim, uint64_t *numel) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < ndim; d++) {
    if (shape[d] && n > UINT64_MAX / 8 / shape[d])
      return -1;
    n *= shape[d];
  }
  *numel = n;
  return 0;
}

static int dtype_of(const char *s, zs_dtype *out) {
  if (strcmp(s, "F32") == 0)
    *out = ZS_DTYPE_FP32;
  else if (strcmp(s, "F16") == 0)
    *out = ZS_DTYPE_FP16;
  else if (strcmp(s, "BF16") == 0)
    *out = ZS_DTYPE_BF16;
  else
    return -1;
  return 0;
}

/* One tensor's object: its three keys, each exactly once. */
static int jp_tensor(jp *j, st_tensor *t) {
  if (!jp_eat(j, '{'))
    return jp_fail(j, "a tensor's entry must be an object");
  int seen = 0, rc = 0;
  do {
    char *k = NULL;
    if ((rc = jp_string(j, &k)) != 0)
      return rc;
    int bit = strcmp(k, "dtype") == 0          ? 1
              : strcmp(k, "shape") == 0        ? 2
              : strcmp(k, "data_offsets") == 0 ? 4
                                               : 0;
    free(k);
    if (!bit || (seen & bit))
      return jp_fail(j, "a tensor's keys must be dtype, shape and data_offsets, once each");
    seen |= bit;
    if (!jp_eat(j, ':'))
      return jp_fail(j, "':' was expected");
    if (bit == 1) {
      char *d = NULL;
      if ((rc = jp_string(j, &d)) != 0)
        return rc;
      int bad = dtype_of(d, &t->dtype) != 0;
      if (bad)
        rc = status_fail(j->err, j->errlen, ZS_EDTYPE,
                         "tensor '%.200s' has dtype '%.16s': F32, F16 and BF16 are imported",
                         t->name, d);
      free(d);
      if (bad)
        return rc;
    } else if (bit == 2) {
      if ((rc = jp_uints(j, t->shape, ST_MAX_DIMS, &t->ndim, "shape must be an array")) != 0)
        return rc;
    } else {
      uint64_t off[3];
      uint32_t n;
      if ((rc = jp_uints(j, off, 3, &n, "data_offsets must be an array")) != 0)
        return rc;
      if (n != 2)
        return jp_fail(j, "data_offsets must have two entries");
      t->begin = off[0];
      t->end = off[1];
    }
  } while (jp_eat(j, ','));
  if (!jp_eat(j, '}'))
    return jp_fail(j, "',' or '}' was expected in a tensor's entry");
  return seen == 7 ? 0 : jp_fail(j, "a tensor lacks dtype, shape or data_offsets");
}

/* The top object into h->tensors (grown as needed). */
static int jp_top(jp *j, st_header *h) {
  if (!jp_eat(j, '{'))
    return jp_fail(j, "the header must be a JSON object");
  if (jp_eat(j, '}'))
    return 0;
  size_t cap = 0;
  int meta = 0;
  do {
    char *name = NULL;
    int rc = jp_string(j, &name);
    if (rc == 0 && !jp_eat(j, ':'))
      rc = jp_fail(j, "':' was expected");
    if (rc == 0 && strcmp(name, "__metadata__") == 0) {
      rc = meta++ ? jp_fail(j, "__metadata__ twice") : jp_metadata(j);
      free(name);
      if (rc != 0)
        return rc;
      continue;
    }
    if (rc == 0 && h->n == cap) {
      size_t nc = cap ? 2 * cap : 64;
      st_tensor *nt = realloc(h->tensors, nc * sizeof *nt);
      if (!nt)
        rc = status_fail(j->err, j->errlen, ZS_ENOMEM, "out of memory");
      else
        h->tensors = nt, cap = nc;
    }
    if (rc != 0) {
      free(name);
      return rc;
    }
    st_tensor *t = &h->tensors[h->n++];
    memset(t, 0, sizeof *t);
    t->name = name;
    if ((rc = jp_tensor(j, t)) != 0)
      return rc;
  } while (jp_eat(j, ','));
  if (!jp_eat(j, '}'))
    return jp_fail(j, "',' or '}' was expected after a tensor");
  jp_ws(j);
  return j->p == j->end ? 0 : jp_fail(j, "bytes after the header's object");
}

static int cmp_begin(const void *a, const void *b) {
  const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
  return x->begin < y->begin   ? -1
         : x->begin > y->begin ? 1
         : x->end < y->end     ? -1
                               : x->end > y->end;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

/* What the JSON cannot say: sizes, ranges, overlaps, unique names. */
static int check_tensors(st_header *h, char *err, size_t errlen) {
  for (size_t i = 0; i < h->n; i++) {
    st_tensor *t = &h->tensors[i];
    if (!t->name[0])
      return status_fail(err, errlen, ZS_EPROTO, "safetensors header: a tensor has an empty name");
    uint64_t numel;
    if (st_shape_numel(t->shape, t->ndim, &numel) != 0)
      return status_fail(err, errlen, ZS_EPROTO,
                         "safetensors header: tensor '%.200s': its shape overflows", t->name);
    t->numel = numel;
    uint64_t bytes = numel * st_dtype_size(t->dtype);
    if (t->begin > t->end || t->end > h->data_len)
      return status_fail(err, errlen, ZS_EPROTO,
                         "safetensors header: tensor '%.200s': data_offsets [%" PRIu64 ", %" PRIu64
                         ") are not a range inside the %" PRIu64 " data bytes",
                         t->name, t->begin, t->end, h->data_len);
    if (t->end - t->begin != bytes)
      return status_fail(err, errlen, ZS_EPROTO,
                         "safetensors header: tensor '%.200s': data_offsets [%" PRIu64 ", %" PRIu64
                         ") hold %" PRIu64 " bytes, its %" PRIu64 " elements of %s need %" PRIu64,
                         t->name, t->begin, t->end, t->end - t->begin, numel,
                         st_dtype_name(t->dtype), bytes);
  }
  if (h->n < 2)
    return 0;
  const st_tensor **by = malloc(h->n * sizeof *by);
  if (!by)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  for (size_t i = 0; i < h->n; i++)
    by[i] = &h->tensors[i];
  int rc = 0;
  qsort(by, h->n, sizeof *by, cmp_name);
  for (size_t i = 1; i < h->n && rc == 0; i++)
    if (strcmp(by[i - 1]->name, by[i]->name) == 0)
      rc = status_fail(err, errlen, ZS_EPROTO, "safetensors header: tensor '%.200s' twice",
                       by[i]->name);
  /* In order of their begin, each non-empty range must start at or after
   * the furthest end so far (an empty range overlaps nothing). */
  qsort(by, h->n, sizeof *by, cmp_begin);
  const st_tensor *far = NULL;
  for (size_t i = 0; i < h->n && rc == 0; i++) {
    if (by[i]->begin == by[i]->end)
      continue;
    if (far && by[i]->begin < far->end)
      rc = status_fail(err, errlen, ZS_EPROTO,
                       "safetensors header: tensors '%.200s' and '%.200s' overlap in the data",
                       far->name, by[i]->name);
    if (!far || by[i]->end > far->end)
      far = by[i];
  }
  free(by);
  return rc;
}

int st_parse(const uint8_t *file, uint64_t size, st_header *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  if (size < 8)
    return status_fail(err, errlen, ZS_EPROTO,
                       "%" PRIu64 " bytes: too short for a safetensors file", size);
  uint64_t n = le_load64(file);
  if (n > ST_MAX_HEADER_BYTES || n > size - 8)
    return status_fail(err, errlen, ZS_EPROTO,
                       "safetensors header length %" PRIu64 " is beyond the file (%" PRIu64
                       " bytes) or the limit (%u)",
                       n, size, ST_MAX_HEADER_BYTES);
  out->data_start = 8 + n;
  out->data_len = size - 8 - n;
  jp j = {.p = file + 8, .start = file + 8, .end = file + 8 + n, .err = err, .errlen = errlen};
  int rc = jp_top(&j, out);
  if (rc == 0)
    rc = check_tensors(out, err, errlen);
  if (rc != 0)
    st_header_free(out);
  return rc;
}

void st_header_free(st_header *h) {
  for (size_t i = 0; i < h->n; i++)
    free(h->tensors[i].name);
  free(h->tensors);
  memset(h, 0, sizeof *h);
}
