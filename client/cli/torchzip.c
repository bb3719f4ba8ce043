/*
 * torchzip — the reader of torch.save's zip format (torchzip.h says what it
 * takes and refuses).
 *
 * Three steps, each over bytes it has bounds-checked: the zip's central
 * directory into a table of members sorted by name (zip_*); data.pkl run
 * through a pickle interpreter that knows only torch.save's opcodes and
 * builds inert values (pk_*): a tensor is a record of its storage, offset,
 * size and stride, and a GLOBAL only ever names one of a fixed list, so
 * nothing from the file is imported or called; then each tensor of the
 * resulting dict is resolved to bytes of the file (tensor_*).
 *
 * The interpreter's memory is bounded by the pickle's length: every opcode
 * reads at least one byte and makes at most one value, and the values, the
 * stack and the memo are all capped (TZ_MAX_VALUES).
 */
#include "torchzip.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/le.h"
#include "common/base/status.h"

/* The most values one pickle may make: a state dict's tensor costs about
 * ten (its record, storage, persistent id and their strings and tuples), so
 * this takes 400k tensors and caps a hostile pickle's memory near 256 MiB. */
#define TZ_MAX_VALUES (4u << 20)

/* ---- the zip ----------------------------------------------------------------- */

#define ZIP_EOCD_SIG 0x06054b50u
#define ZIP_EOCD64_LOCATOR_SIG 0x07064b50u
#define ZIP_EOCD64_SIG 0x06064b50u
#define ZIP_CENTRAL_SIG 0x02014b50u
#define ZIP_LOCAL_SIG 0x04034b50u
#define ZIP_EOCD_BYTES 22u
#define ZIP_CENTRAL_BYTES 46u
#define ZIP_LOCAL_BYTES 30u
#define ZIP_U32_MAX 0xFFFFFFFFull

typedef struct zip_member {
  const uint8_t *name; /* in the file; not NUL-terminated */
  uint32_t name_len;
  uint16_t flags, method;
  uint64_t csize, size, local; /* local: its local header's offset */
} zip_member;

typedef struct zip {
  const uint8_t *file;
  uint64_t size;
  zip_member *m; /* owned, n, sorted by name */
  size_t n;
  uint64_t members_end; /* where the central directory begins */
} zip;

/* The central directory's place and entry count, from the end record (and
 * the zip64 one that it points to when a field overflowed). */
static int zip_end_record(zip *z, uint64_t *cd, uint64_t *cd_size, uint64_t *count, char *err,
                          size_t errlen) {
  const uint8_t *f = z->file;
  if (z->size < ZIP_EOCD_BYTES)
    return status_fail(err, errlen, ZS_EPROTO, "torch zip: %" PRIu64 " bytes: too short", z->size);
  /* The record is the last thing in the file but for a comment of at most
   * 65535 bytes, whose length it gives: search back for one that fits. */
  uint64_t lo = z->size > ZIP_EOCD_BYTES + 0xFFFFu ? z->size - ZIP_EOCD_BYTES - 0xFFFFu : 0;
  uint64_t at = z->size - ZIP_EOCD_BYTES + 1;
  while (at-- > lo)
    if (le_load32(f + at) == ZIP_EOCD_SIG &&
        at + ZIP_EOCD_BYTES + le_load16(f + at + 20) == z->size)
      break;
  if (at + 1 == lo || le_load32(f + at) != ZIP_EOCD_SIG)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: no end of central directory record (cut short, or not a zip "
                       "archive)");
  if (le_load16(f + at + 4) != 0 || le_load16(f + at + 6) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "torch zip: a multi-disk archive");
  *count = le_load16(f + at + 10);
  *cd_size = le_load32(f + at + 12);
  *cd = le_load32(f + at + 16);
  if (*count == 0xFFFF || *cd_size == ZIP_U32_MAX || *cd == ZIP_U32_MAX) {
    if (at < 20 || le_load32(f + at - 20) != ZIP_EOCD64_LOCATOR_SIG)
      return status_fail(err, errlen, ZS_EPROTO,
                         "torch zip: zip64 sizes without a zip64 end record locator");
    uint64_t o = le_load64(f + at - 20 + 8);
    if (o > at - 20 || at - 20 - o < 56 || le_load32(f + o) != ZIP_EOCD64_SIG)
      return status_fail(err, errlen, ZS_EPROTO,
                         "torch zip: the zip64 end record at %" PRIu64 " is not one", o);
    *count = le_load64(f + o + 32);
    *cd_size = le_load64(f + o + 40);
    *cd = le_load64(f + o + 48);
    at = o;
  }
  if (*cd > at || *cd_size > at - *cd)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: the central directory [%" PRIu64 ", +%" PRIu64
                       ") is not before its end record at %" PRIu64,
                       *cd, *cd_size, at);
  if (*count > *cd_size / ZIP_CENTRAL_BYTES)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: %" PRIu64
                       " entries do not fit in a central directory of %" PRIu64 " bytes",
                       *count, *cd_size);
  z->members_end = *cd;
  return 0;
}

/* A central entry's zip64 extra field: the 8-byte forms of the sizes and
 * offset whose 4-byte fields are all ones, in that order. -1 if the extra
 * fields do not parse. */
static int zip_extra(zip_member *m, const uint8_t *x, uint32_t len) {
  while (len >= 4) {
    uint32_t id = le_load16(x), n = le_load16(x + 2);
    if (n > len - 4)
      return -1;
    if (id == 1) {
      uint64_t *wide[3] = {&m->size, &m->csize, &m->local};
      const uint8_t *v = x + 4;
      uint32_t left = n;
      for (int k = 0; k < 3; k++) {
        if (*wide[k] != ZIP_U32_MAX)
          continue;
        if (left < 8)
          return -1;
        *wide[k] = le_load64(v);
        v += 8;
        left -= 8;
      }
    }
    x += 4 + n;
    len -= 4 + n;
  }
  return 0;
}

static int by_member_name(const void *a, const void *b) {
  const zip_member *x = a, *y = b;
  uint32_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
  int d = memcmp(x->name, y->name, n);
  return d ? d : (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

static int zip_open(zip *z, const uint8_t *file, uint64_t size, char *err, size_t errlen) {
  memset(z, 0, sizeof *z);
  z->file = file;
  z->size = size;
  uint64_t cd = 0, cd_size = 0, count = 0;
  int rc = zip_end_record(z, &cd, &cd_size, &count, err, errlen);
  if (rc != 0)
    return rc;
  z->m = calloc(count ? count : 1, sizeof *z->m);
  if (!z->m)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  const uint8_t *p = file + cd, *end = p + cd_size;
  for (uint64_t i = 0; i < count; i++) {
    if ((uint64_t)(end - p) < ZIP_CENTRAL_BYTES || le_load32(p) != ZIP_CENTRAL_SIG)
      return status_fail(err, errlen, ZS_EPROTO,
                         "torch zip: central directory entry %" PRIu64 " is cut short or not one",
                         i);
    zip_member *m = &z->m[i];
    m->flags = le_load16(p + 8);
    m->method = le_load16(p + 10);
    m->csize = le_load32(p + 20);
    m->size = le_load32(p + 24);
    uint32_t nl = le_load16(p + 28), xl = le_load16(p + 30), cl = le_load16(p + 32);
    m->local = le_load32(p + 42);
    if ((uint64_t)(end - p) - ZIP_CENTRAL_BYTES < (uint64_t)nl + xl + cl)
      return status_fail(err, errlen, ZS_EPROTO,
                         "torch zip: central directory entry %" PRIu64 " runs past the directory",
                         i);
    m->name = p + ZIP_CENTRAL_BYTES;
    m->name_len = nl;
    if (zip_extra(m, m->name + nl, xl) != 0)
      return status_fail(err, errlen, ZS_EPROTO, "torch zip: member '%.*s': bad extra fields",
                         (int)(nl > 200 ? 200 : nl), (const char *)m->name);
    p += ZIP_CENTRAL_BYTES + nl + xl + cl;
  }
  z->n = (size_t)count;
  qsort(z->m, z->n, sizeof *z->m, by_member_name);
  for (size_t i = 1; i < z->n; i++)
    if (by_member_name(&z->m[i - 1], &z->m[i]) == 0)
      return status_fail(err, errlen, ZS_EPROTO, "torch zip: member '%.*s' twice",
                         (int)(z->m[i].name_len > 200 ? 200 : z->m[i].name_len),
                         (const char *)z->m[i].name);
  return 0;
}

static const zip_member *zip_find(const zip *z, const char *name) {
  zip_member key = {.name = (const uint8_t *)name, .name_len = (uint32_t)strlen(name)};
  return bsearch(&key, z->m, z->n, sizeof *z->m, by_member_name);
}

/* Where member m's bytes begin in the file (*at): its local header found
 * and checked, the member stored (not compressed or encrypted) and inside
 * the members' part of the file. */
static int zip_data(const zip *z, const zip_member *m, uint64_t *at, char *err, size_t errlen) {
  int nl = (int)(m->name_len > 200 ? 200 : m->name_len);
  const char *name = (const char *)m->name;
  if (m->flags & 1)
    return status_fail(err, errlen, ZS_EPROTO, "torch zip: member '%.*s' is encrypted", nl, name);
  if (m->method != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: member '%.*s' is compressed (method %u): torch.save stores "
                       "its members uncompressed, and import reads them in place (save it again "
                       "with torch.save, or zip it with -0)",
                       nl, name, m->method);
  if (m->csize != m->size)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: member '%.*s' is stored in %" PRIu64 " bytes for %" PRIu64, nl,
                       name, m->csize, m->size);
  const uint8_t *f = z->file;
  if (m->local > z->members_end || z->members_end - m->local < ZIP_LOCAL_BYTES ||
      le_load32(f + m->local) != ZIP_LOCAL_SIG)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: member '%.*s': no local header at %" PRIu64, nl, name, m->local);
  uint64_t data =
      m->local + ZIP_LOCAL_BYTES + le_load16(f + m->local + 26) + le_load16(f + m->local + 28);
  if (data > z->members_end || m->size > z->members_end - data)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: member '%.*s': its %" PRIu64 " bytes at %" PRIu64
                       " run past the members (the central directory is at %" PRIu64 ")",
                       nl, name, m->size, data, z->members_end);
  if (le_load16(f + m->local + 26) != m->name_len ||
      memcmp(f + m->local + ZIP_LOCAL_BYTES, m->name, m->name_len) != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: member '%.*s': its local header names another", nl, name);
  *at = data;
  return 0;
}

/* ---- the pickle's values --------------------------------------------------------- */

typedef enum pv_kind {
  PV_NONE,
  PV_BOOL,
  PV_INT,
  PV_STR,
  PV_TUPLE,
  PV_DICT,
  PV_GLOBAL,
  PV_STORAGE,
  PV_TENSOR
} pv_kind;

static const char *const pv_kind_names[] = {"None", "bool",   "int",     "str",   "tuple",
                                            "dict", "global", "storage", "tensor"};

typedef enum pv_global {
  GL_ORDERED_DICT,
  GL_REBUILD_TENSOR,
  GL_REBUILD_PARAMETER,
  GL_STORAGE_TYPE
} pv_global;

/* torch's storage classes: the ones imported, and the others a state dict
 * holds (buffers such as BatchNorm's num_batches_tracked), refused by name
 * when a tensor of theirs is asked for. */
static const struct storage_type {
  const char *name;
  zs_dtype dtype; /* 0: not imported */
  unsigned size;
} storage_types[] = {{"FloatStorage", ZS_DTYPE_FP32, 4},
                     {"HalfStorage", ZS_DTYPE_FP16, 2},
                     {"BFloat16Storage", ZS_DTYPE_BF16, 2},
                     {"DoubleStorage", 0, 8},
                     {"LongStorage", 0, 8},
                     {"IntStorage", 0, 4},
                     {"ShortStorage", 0, 2},
                     {"CharStorage", 0, 1},
                     {"ByteStorage", 0, 1},
                     {"BoolStorage", 0, 1}};
#define N_STORAGE_TYPES (sizeof storage_types / sizeof storage_types[0])

typedef struct pv {
  pv_kind kind;
  struct pv *next; /* every value made, for freeing */
  union {
    int64_t i; /* BOOL, INT */
    struct {
      char *s;
      size_t len;
    } str; /* STR: NUL-terminated copy */
    struct {
      struct pv **v;
      size_t n, cap;
    } seq; /* TUPLE; DICT as k, v, k, v... */
    struct {
      pv_global g;
      unsigned type;
    } global; /* type: storage_types[] */
    struct {
      unsigned type;
      const char *key;
      uint64_t numel;
    } storage;
    struct {
      struct pv *storage, *size, *stride;
      uint64_t offset;
    } tensor;
  } u;
} pv;

typedef struct pk {
  const uint8_t *p, *start, *end;
  pv **stack;
  size_t sp, scap;
  size_t *marks; /* stack heights at each MARK */
  size_t nmarks, mcap;
  pv **memo;
  size_t nmemo;
  pv *all;
  size_t nvalues;
  const char *member;
  char *err;
  size_t errlen;
} pk;

/* A sentence about the opcode at `op` (its offset in the pickle). */
static int pk_fail(pk *k, const uint8_t *op, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int pk_fail(pk *k, const uint8_t *op, const char *fmt, ...) {
  char what[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return status_fail(k->err, k->errlen, ZS_EPROTO, "torch zip: %s, at byte %zu of %s", what,
                     (size_t)(op - k->start), k->member);
}

static pv *pv_new(pk *k, pv_kind kind) {
  if (k->nvalues >= TZ_MAX_VALUES)
    return NULL;
  pv *v = calloc(1, sizeof *v);
  if (!v)
    return NULL;
  v->kind = kind;
  v->next = k->all;
  k->all = v;
  k->nvalues++;
  return v;
}

static void pv_free_all(pv *v) {
  while (v) {
    pv *next = v->next;
    if (v->kind == PV_STR)
      free(v->u.str.s);
    else if (v->kind == PV_TUPLE || v->kind == PV_DICT)
      free(v->u.seq.v);
    free(v);
    v = next;
  }
}

/* Grows *arr (of *cap elements of `size`) to hold `need`. */
static int grow(void *arr, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t nc = *cap ? *cap : 16;
  while (nc < need)
    nc *= 2;
  void *n = realloc(*(void **)arr, nc * size);
  if (!n)
    return -1;
  *(void **)arr = n;
  *cap = nc;
  return 0;
}

static int pk_push(pk *k, const uint8_t *op, pv *v) {
  if (!v)
    return k->nvalues >= TZ_MAX_VALUES
               ? pk_fail(k, op, "more than %u values: not a state dict this reader takes",
                         TZ_MAX_VALUES)
               : status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
  if (k->sp >= TZ_MAX_VALUES)
    return pk_fail(k, op, "a stack deeper than %u", TZ_MAX_VALUES);
  if (grow(&k->stack, &k->scap, k->sp + 1, sizeof *k->stack) != 0)
    return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
  k->stack[k->sp++] = v;
  return 0;
}

/* The stack's top (NULL when it is empty or a MARK is above the rest). */
static pv *pk_top(pk *k) {
  size_t floor = k->nmarks ? k->marks[k->nmarks - 1] : 0;
  return k->sp > floor ? k->stack[k->sp - 1] : NULL;
}

static pv *pk_pop(pk *k) {
  pv *v = pk_top(k);
  if (v)
    k->sp--;
  return v;
}

/* The values above the last MARK into a new TUPLE's items (or appended to
 * dict d's when d is given), the MARK dropped. */
static int pk_take_marked(pk *k, const uint8_t *op, pv *into) {
  if (!k->nmarks)
    return pk_fail(k, op, "no MARK to take items from");
  size_t from = k->marks[--k->nmarks], n = k->sp - from;
  if (into->kind == PV_DICT && n % 2)
    return pk_fail(k, op, "SETITEMS of an odd number of values");
  if (grow(&into->u.seq.v, &into->u.seq.cap, into->u.seq.n + n, sizeof(pv *)) != 0)
    return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
  if (n)
    memcpy(into->u.seq.v + into->u.seq.n, k->stack + from, n * sizeof(pv *));
  into->u.seq.n += n;
  k->sp = from;
  return 0;
}

/* A tuple of the top n values (TUPLE1..3). */
static int pk_tuple_n(pk *k, const uint8_t *op, size_t n) {
  size_t floor = k->nmarks ? k->marks[k->nmarks - 1] : 0;
  if (k->sp - floor < n)
    return pk_fail(k, op, "a tuple of %zu from a stack of %zu", n, k->sp - floor);
  pv *t = pv_new(k, PV_TUPLE);
  if (t && grow(&t->u.seq.v, &t->u.seq.cap, n, sizeof(pv *)) != 0)
    return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
  if (t) {
    memcpy(t->u.seq.v, k->stack + k->sp - n, n * sizeof(pv *));
    t->u.seq.n = n;
    k->sp -= n;
  }
  return pk_push(k, op, t);
}

/* ---- the pickle's opcodes -------------------------------------------------------- */

/* n bytes of operand after the opcode at op, or NULL past the pickle. */
static const uint8_t *pk_arg(pk *k, size_t n) {
  if ((size_t)(k->end - k->p) < n)
    return NULL;
  const uint8_t *a = k->p;
  k->p += n;
  return a;
}

/* BININT1, BININT2, BININT, LONG1. */
static int pk_int(pk *k, const uint8_t *op) {
  const uint8_t *a;
  int64_t v;
  if (*op == 'K' && (a = pk_arg(k, 1)))
    v = a[0];
  else if (*op == 'M' && (a = pk_arg(k, 2)))
    v = le_load16(a);
  else if (*op == 'J' && (a = pk_arg(k, 4)))
    v = (int32_t)le_load32(a);
  else if (*op == 0x8a && (a = pk_arg(k, 1))) {
    size_t n = a[0];
    if (n > 8)
      return pk_fail(k, op, "an integer of %zu bytes (8 at most are read)", n);
    if (!(a = pk_arg(k, n)))
      return pk_fail(k, op, "an integer runs past the pickle");
    uint64_t u = n ? le_load(a, (unsigned)n) : 0;
    if (n && n < 8 && (a[n - 1] & 0x80))
      u |= ~0ull << (8 * n); /* two's complement: sign-extend */
    v = (int64_t)u;
  } else
    return pk_fail(k, op, "an integer runs past the pickle");
  pv *i = pv_new(k, PV_INT);
  if (i)
    i->u.i = v;
  return pk_push(k, op, i);
}

static int pk_unicode(pk *k, const uint8_t *op) {
  const uint8_t *a = pk_arg(k, 4), *s;
  if (!a || !(s = pk_arg(k, le_load32(a))))
    return pk_fail(k, op, "a string runs past the pickle");
  size_t n = le_load32(a);
  if (memchr(s, 0, n))
    return pk_fail(k, op, "a string with a NUL byte");
  pv *v = pv_new(k, PV_STR);
  if (v && !(v->u.str.s = malloc(n + 1)))
    return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
  if (v) {
    memcpy(v->u.str.s, s, n);
    v->u.str.s[n] = '\0';
    v->u.str.len = n;
  }
  return pk_push(k, op, v);
}

/* GLOBAL "module\nname\n": only the names torch.save writes for a state
 * dict become values; every other one is refused, never imported. */
static int pk_global(pk *k, const uint8_t *op) {
  const uint8_t *nl1 = memchr(k->p, '\n', (size_t)(k->end - k->p));
  const uint8_t *nl2 = nl1 ? memchr(nl1 + 1, '\n', (size_t)(k->end - nl1 - 1)) : NULL;
  if (!nl2)
    return pk_fail(k, op, "a GLOBAL runs past the pickle");
  char mod[64] = "", name[64] = "";
  size_t ml = (size_t)(nl1 - k->p), nml = (size_t)(nl2 - nl1 - 1);
  /* A NUL inside a name would make it compare equal to its prefix. */
  if (ml < sizeof mod && nml < sizeof name && !memchr(k->p, 0, (size_t)(nl2 - k->p))) {
    memcpy(mod, k->p, ml);
    mod[ml] = '\0';
    memcpy(name, nl1 + 1, nml);
    name[nml] = '\0';
  }
  const char *shown_mod = (const char *)k->p, *shown_name = (const char *)nl1 + 1;
  k->p = nl2 + 1;
  pv_global g = GL_STORAGE_TYPE;
  unsigned type = 0;
  if (strcmp(mod, "collections") == 0 && strcmp(name, "OrderedDict") == 0)
    g = GL_ORDERED_DICT;
  else if (strcmp(mod, "torch._utils") == 0 && strcmp(name, "_rebuild_tensor_v2") == 0)
    g = GL_REBUILD_TENSOR;
  else if (strcmp(mod, "torch._utils") == 0 && strcmp(name, "_rebuild_parameter") == 0)
    g = GL_REBUILD_PARAMETER;
  else {
    for (type = 0; type < N_STORAGE_TYPES; type++)
      if (strcmp(mod, "torch") == 0 && strcmp(name, storage_types[type].name) == 0)
        break;
    if (type == N_STORAGE_TYPES)
      return pk_fail(k, op,
                     "global %.*s.%.*s is not allowed in a state dict (only torch's tensors, "
                     "storages and OrderedDict are read; nothing is imported or called)",
                     (int)(ml > 64 ? 64 : ml), shown_mod, (int)(nml > 64 ? 64 : nml), shown_name);
  }
  pv *v = pv_new(k, PV_GLOBAL);
  if (v) {
    v->u.global.g = g;
    v->u.global.type = type;
  }
  return pk_push(k, op, v);
}

static int is_uint(const pv *v) {
  return v && v->kind == PV_INT && v->u.i >= 0;
}

/* A tuple of at most ST_MAX_DIMS non-negative integers. */
static int is_dims(const pv *v) {
  if (!v || v->kind != PV_TUPLE || v->u.seq.n > ST_MAX_DIMS)
    return 0;
  for (size_t i = 0; i < v->u.seq.n; i++)
    if (!is_uint(v->u.seq.v[i]))
      return 0;
  return 1;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
 * backward_hooks[, metadata]) as a record of where its elements are. */
static pv *pk_rebuild_tensor(pk *k, const uint8_t *op, const pv *args, int *rc) {
  pv *const *a = args->u.seq.v;
  size_t n = args->u.seq.n;
  if ((n != 6 && n != 7) || a[0]->kind != PV_STORAGE || !is_uint(a[1]) || !is_dims(a[2]) ||
      !is_dims(a[3]) || a[2]->u.seq.n != a[3]->u.seq.n || a[4]->kind != PV_BOOL ||
      a[5]->kind != PV_DICT) {
    *rc = pk_fail(k, op,
                  "_rebuild_tensor_v2 with arguments that are not (storage, offset, size, "
                  "stride, requires_grad, hooks)");
    return NULL;
  }
  if (n == 7 && (a[6]->kind != PV_DICT || a[6]->u.seq.n)) {
    /* torch's metadata holds a tensor's conj/neg bits: values not as stored. */
    *rc = pk_fail(k, op, "a tensor with metadata (conjugate or negative bits) is not read");
    return NULL;
  }
  pv *t = pv_new(k, PV_TENSOR);
  if (t) {
    t->u.tensor.storage = a[0];
    t->u.tensor.offset = (uint64_t)a[1]->u.i;
    t->u.tensor.size = a[2];
    t->u.tensor.stride = a[3];
  }
  return t;
}

/* REDUCE: only an OrderedDict() and torch's two tensor rebuilders. */
static int pk_reduce(pk *k, const uint8_t *op) {
  pv *args = pk_pop(k), *fn = pk_pop(k);
  if (!args || !fn || args->kind != PV_TUPLE || fn->kind != PV_GLOBAL ||
      fn->u.global.g == GL_STORAGE_TYPE)
    return pk_fail(k, op,
                   "REDUCE of a %s with a %s: only OrderedDict and torch's tensor "
                   "rebuilders are called (as records, not code)",
                   fn ? pv_kind_names[fn->kind] : "missing callable",
                   args ? pv_kind_names[args->kind] : "missing argument tuple");
  int rc = 0;
  pv *v = NULL;
  size_t n = args->u.seq.n;
  if (fn->u.global.g == GL_ORDERED_DICT) {
    if (n)
      return pk_fail(k, op, "OrderedDict with arguments");
    v = pv_new(k, PV_DICT);
  } else if (fn->u.global.g == GL_REBUILD_TENSOR) {
    v = pk_rebuild_tensor(k, op, args, &rc);
  } else {
    /* _rebuild_parameter(data, requires_grad, backward_hooks): the data. */
    if (n != 3 || args->u.seq.v[0]->kind != PV_TENSOR)
      return pk_fail(k, op,
                     "_rebuild_parameter with arguments that are not (tensor, "
                     "requires_grad, hooks)");
    v = args->u.seq.v[0];
  }
  return rc ? rc : pk_push(k, op, v);
}

/* BINPERSID: ('storage', storage class, key, location, numel). */
static int pk_persid(pk *k, const uint8_t *op) {
  pv *id = pk_pop(k);
  pv *const *a = id && id->kind == PV_TUPLE ? id->u.seq.v : NULL;
  if (!a || id->u.seq.n != 5 || a[0]->kind != PV_STR || strcmp(a[0]->u.str.s, "storage") != 0 ||
      a[1]->kind != PV_GLOBAL || a[1]->u.global.g != GL_STORAGE_TYPE || a[2]->kind != PV_STR ||
      a[3]->kind != PV_STR || !is_uint(a[4]))
    return pk_fail(k, op, "a persistent id that is not ('storage', class, key, location, numel)");
  pv *s = pv_new(k, PV_STORAGE);
  if (s) {
    s->u.storage.type = a[1]->u.global.type;
    s->u.storage.key = a[2]->u.str.s;
    s->u.storage.numel = (uint64_t)a[4]->u.i;
  }
  return pk_push(k, op, s);
}

/* BINPUT, LONG_BINPUT, BINGET, LONG_BINGET. The pickler numbers its memo
 * from 0, so an index beyond the values made so far is malformed. */
static int pk_memo(pk *k, const uint8_t *op) {
  int get = *op == 'h' || *op == 'j';
  const uint8_t *a = pk_arg(k, (*op == 'q' || *op == 'h') ? 1 : 4);
  if (!a)
    return pk_fail(k, op, "a memo index runs past the pickle");
  size_t i = (*op == 'q' || *op == 'h') ? a[0] : le_load32(a);
  if (get) {
    if (i >= k->nmemo || !k->memo[i])
      return pk_fail(k, op, "memo entry %zu was never put", i);
    return pk_push(k, op, k->memo[i]);
  }
  pv *top = pk_top(k);
  if (!top)
    return pk_fail(k, op, "a memo put from an empty stack");
  if (i > k->nvalues)
    return pk_fail(k, op, "memo index %zu beyond the %zu values made", i, k->nvalues);
  size_t cap = k->nmemo;
  if (i >= k->nmemo) {
    if (grow(&k->memo, &cap, i + 1, sizeof *k->memo) != 0)
      return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
    memset(k->memo + k->nmemo, 0, (cap - k->nmemo) * sizeof *k->memo);
    k->nmemo = cap;
  }
  k->memo[i] = top;
  return 0;
}

/* SETITEM, SETITEMS, BUILD: what fills a dict. */
static int pk_dict_op(pk *k, const uint8_t *op) {
  if (*op == 'u') {
    size_t from = k->nmarks ? k->marks[k->nmarks - 1] : 0;
    pv *d = from ? k->stack[from - 1] : NULL;
    if (!k->nmarks || !d || d->kind != PV_DICT)
      return pk_fail(k, op, "SETITEMS without a dict below its MARK");
    return pk_take_marked(k, op, d);
  }
  pv *b = pk_pop(k), *a = pk_pop(k), *d = pk_top(k);
  if (*op == 's') {
    if (!a || !d || d->kind != PV_DICT)
      return pk_fail(k, op, "SETITEM without a dict, key and value");
    if (grow(&d->u.seq.v, &d->u.seq.cap, d->u.seq.n + 2, sizeof(pv *)) != 0)
      return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
    d->u.seq.v[d->u.seq.n++] = a;
    d->u.seq.v[d->u.seq.n++] = b;
    return 0;
  }
  /* BUILD: an OrderedDict's attributes (a state dict's _metadata, the
   * modules' versions), which the import has no use for: dropped. */
  if (!a || !b || a->kind != PV_DICT || (b->kind != PV_DICT && b->kind != PV_NONE))
    return pk_fail(k, op, "BUILD of something other than a dict's attributes");
  return pk_push(k, op, a);
}

/* One opcode; *done set at STOP. */
static int pk_step(pk *k, int *done) {
  const uint8_t *op = k->p++;
  switch (*op) {
  case 0x80: /* PROTO */
    return pk_arg(k, 1) ? 0 : pk_fail(k, op, "PROTO runs past the pickle");
  case '.': /* STOP */
    if (k->nmarks || k->sp != 1)
      return pk_fail(k, op, "STOP with %zu values and %zu marks left", k->sp, k->nmarks);
    *done = 1;
    return 0;
  case 'N':
    return pk_push(k, op, pv_new(k, PV_NONE));
  case 0x88: /* NEWTRUE */
  case 0x89: {
    pv *v = pv_new(k, PV_BOOL);
    if (v)
      v->u.i = *op == 0x88;
    return pk_push(k, op, v);
  }
  case 'K':
  case 'M':
  case 'J':
  case 0x8a:
    return pk_int(k, op);
  case 'X':
    return pk_unicode(k, op);
  case '}':
    return pk_push(k, op, pv_new(k, PV_DICT));
  case ')':
    return pk_push(k, op, pv_new(k, PV_TUPLE));
  case '(':
    if (grow(&k->marks, &k->mcap, k->nmarks + 1, sizeof *k->marks) != 0)
      return status_fail(k->err, k->errlen, ZS_ENOMEM, "out of memory");
    k->marks[k->nmarks++] = k->sp;
    return 0;
  case 't': {
    pv *t = pv_new(k, PV_TUPLE);
    int rc = t ? pk_take_marked(k, op, t) : 0;
    return rc ? rc : pk_push(k, op, t);
  }
  case 0x85:
  case 0x86:
  case 0x87:
    return pk_tuple_n(k, op, (size_t)(*op - 0x84));
  case 's':
  case 'u':
  case 'b':
    return pk_dict_op(k, op);
  case 'c':
    return pk_global(k, op);
  case 'R':
    return pk_reduce(k, op);
  case 'Q':
    return pk_persid(k, op);
  case 'q':
  case 'r':
  case 'h':
  case 'j':
    return pk_memo(k, op);
  default:
    if (*op >= 0x20 && *op < 0x7f)
      return pk_fail(k, op,
                     "opcode 0x%02x ('%c') is not read (only those torch.save writes for "
                     "a state dict of tensors)",
                     *op, *op);
    return pk_fail(k, op,
                   "opcode 0x%02x is not read (only those torch.save writes for a state dict "
                   "of tensors)",
                   *op);
  }
}

/* Runs the pickle to its STOP; *out is the dict it made (owned by k). */
static int pk_run(pk *k, pv **out) {
  int done = 0, rc = 0;
  while (rc == 0 && !done) {
    if (k->p >= k->end)
      return pk_fail(k, k->p, "the pickle ends without a STOP");
    rc = pk_step(k, &done);
  }
  if (rc != 0)
    return rc;
  pv *v = k->stack[0];
  if (v->kind != PV_DICT)
    return pk_fail(k, k->p - 1, "the pickle holds a %s, not a state dict", pv_kind_names[v->kind]);
  for (size_t i = 0; i < v->u.seq.n; i += 2) {
    const pv *key = v->u.seq.v[i], *val = v->u.seq.v[i + 1];
    if (key->kind != PV_STR || !key->u.str.len)
      return pk_fail(k, k->p - 1, "key %zu of the state dict is not a name", i / 2);
    if (val->kind != PV_TENSOR)
      return pk_fail(k, k->p - 1, "entry '%.200s' of the state dict is a %s, not a tensor",
                     key->u.str.s, pv_kind_names[val->kind]);
  }
  *out = v;
  return 0;
}

static void pk_free(pk *k) {
  pv_free_all(k->all);
  free(k->stack);
  free(k->marks);
  free(k->memo);
}

/* ---- the tensors ------------------------------------------------------------------ */

/* The dict's entry i into t: its bytes in the file, every bound checked. */
static int tensor_place(const zip *z, const char *prefix, const pv *key, const pv *val,
                        st_tensor *t, char *err, size_t errlen) {
  const char *name = key->u.str.s;
  const pv *s = val->u.tensor.storage, *size = val->u.tensor.size, *stride = val->u.tensor.stride;
  const struct storage_type *ty = &storage_types[s->u.storage.type];
  if (!ty->dtype)
    return status_fail(err, errlen, ZS_EDTYPE,
                       "tensor '%.200s' is in a %s: FloatStorage, HalfStorage and BFloat16Storage "
                       "(float32, float16 and bfloat16) are imported",
                       name, ty->name);
  t->dtype = ty->dtype;
  t->ndim = (uint32_t)size->u.seq.n;
  for (uint32_t d = 0; d < t->ndim; d++)
    t->shape[d] = (uint64_t)size->u.seq.v[d]->u.i;
  if (st_shape_numel(t->shape, t->ndim, &t->numel) != 0)
    return status_fail(err, errlen, ZS_EPROTO, "torch zip: tensor '%.200s': its shape overflows",
                       name);
  /* Row-major when each dimension's stride is the product of the sizes
   * after it (a dimension of size 1 may have any stride; so may an empty
   * tensor); anything else is a view saved whole (a transpose, a slice of a
   * larger storage, an expanded stride 0), gathered as it is written. Its
   * span: one past its furthest element, in elements from its offset. */
  uint64_t want = 1, span = 1;
  for (uint32_t d = t->ndim; d-- > 0 && t->numel;) {
    uint64_t st = (uint64_t)stride->u.seq.v[d]->u.i, reach;
    t->stride[d] = st;
    if (t->shape[d] != 1 && st != want)
      t->strided = 1;
    want *= t->shape[d];
    if (__builtin_mul_overflow(t->shape[d] - 1, st, &reach) ||
        __builtin_add_overflow(span, reach, &span) || span > UINT64_MAX / 8)
      return status_fail(err, errlen, ZS_EPROTO, "torch zip: tensor '%.200s': its strides overflow",
                         name);
  }
  if (!t->numel)
    span = 0;
  char member[512];
  int n = snprintf(member, sizeof member, "%sdata/%s", prefix, s->u.storage.key);
  const zip_member *m = n > 0 && (size_t)n < sizeof member ? zip_find(z, member) : NULL;
  if (!m)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: tensor '%.200s': its storage '%.64s' has no member %.300s", name,
                       s->u.storage.key, member);
  uint64_t at, snumel = s->u.storage.numel;
  int rc = zip_data(z, m, &at, err, errlen);
  if (rc != 0)
    return rc;
  if (snumel > UINT64_MAX / 8 || m->size != snumel * ty->size)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: storage '%.64s' is %" PRIu64 " bytes, its %" PRIu64
                       " elements of %s need %" PRIu64,
                       s->u.storage.key, m->size, snumel, ty->name, snumel * ty->size);
  uint64_t off = val->u.tensor.offset;
  if (t->numel && (off > snumel || span > snumel - off))
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: tensor '%.200s': %" PRIu64 " elements at offset %" PRIu64
                       " reach past its storage '%.64s' of %" PRIu64,
                       name, span, off, s->u.storage.key, snumel);
  t->begin = t->numel ? at + off * ty->size : at;
  t->end = t->begin + span * ty->size;
  if (!(t->name = strdup(name)))
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  return 0;
}

static const pv *sort_dict; /* for by_key: qsort has no argument */

/* Entries by name, then by position: the last of a name is the one kept. */
static int by_key(const void *a, const void *b) {
  size_t i = *(const size_t *)a, j = *(const size_t *)b;
  int d = strcmp(sort_dict->u.seq.v[2 * i]->u.str.s, sort_dict->u.seq.v[2 * j]->u.str.s);
  return d ? d : (i > j) - (i < j);
}

/* The dict's tensors into h in the dict's order, a name given twice once
 * (its last value, as unpickling the dict keeps). */
static int tensors_of(const zip *z, const char *prefix, const pv *dict, st_header *h, char *err,
                      size_t errlen) {
  size_t n = dict->u.seq.n / 2;
  size_t *order = malloc((n ? n : 1) * sizeof *order);
  uint8_t *keep = malloc(n ? n : 1);
  h->tensors = calloc(n ? n : 1, sizeof *h->tensors);
  int rc = 0;
  if (!order || !keep || !h->tensors)
    rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  for (size_t i = 0; i < n && rc == 0; i++)
    order[i] = i, keep[i] = 1;
  if (rc == 0) {
    sort_dict = dict;
    qsort(order, n, sizeof *order, by_key);
    for (size_t i = 1; i < n; i++)
      if (strcmp(dict->u.seq.v[2 * order[i - 1]]->u.str.s, dict->u.seq.v[2 * order[i]]->u.str.s) ==
          0)
        keep[order[i - 1]] = 0;
  }
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (!keep[i])
      continue;
    rc = tensor_place(z, prefix, dict->u.seq.v[2 * i], dict->u.seq.v[2 * i + 1], &h->tensors[h->n],
                      err, errlen);
    if (rc == 0)
      h->n++;
  }
  free(order);
  free(keep);
  return rc;
}

/* The archive's one "<prefix>/data.pkl" member, its prefix (with the
 * slash) into prefix. */
static const zip_member *find_pickle(const zip *z, char *prefix, size_t cap, char *err,
                                     size_t errlen) {
  const zip_member *found = NULL;
  size_t count = 0;
  for (size_t i = 0; i < z->n; i++) {
    const zip_member *m = &z->m[i];
    const uint8_t *slash = memchr(m->name, '/', m->name_len);
    if (slash && slash > m->name && (size_t)(slash - m->name) + 9 == m->name_len &&
        memcmp(slash, "/data.pkl", 9) == 0)
      found = m, count++;
  }
  if (count != 1 || found->name_len - 8 >= cap) {
    status_fail(err, errlen, ZS_EPROTO,
                "torch zip: not a torch.save file (%zu members named <archive>/data.pkl, one "
                "is needed)",
                count);
    return NULL;
  }
  memcpy(prefix, found->name, found->name_len - 8);
  prefix[found->name_len - 8] = '\0';
  return found;
}

/* A "<prefix>byteorder" member (torch >= 2.1) must say little. */
static int check_byteorder(const zip *z, const char *prefix, char *err, size_t errlen) {
  char name[300];
  snprintf(name, sizeof name, "%sbyteorder", prefix);
  const zip_member *m = zip_find(z, name);
  uint64_t at;
  if (!m)
    return 0;
  int rc = zip_data(z, m, &at, err, errlen);
  if (rc != 0)
    return rc;
  if (m->size != 6 || memcmp(z->file + at, "little", 6) != 0)
    return status_fail(err, errlen, ZS_EPROTO,
                       "torch zip: %s does not say 'little': only little-endian files are read",
                       name);
  return 0;
}

int tz_is_zip(const uint8_t *file, uint64_t size) {
  return size >= 4 && le_load32(file) == ZIP_LOCAL_SIG;
}

int tz_parse(const uint8_t *file, uint64_t size, st_header *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  zip z;
  pk k = {.err = err, .errlen = errlen};
  char prefix[260];
  int rc = zip_open(&z, file, size, err, errlen);
  const zip_member *pkl = rc == 0 ? find_pickle(&z, prefix, sizeof prefix, err, errlen) : NULL;
  uint64_t at = 0;
  if (rc == 0 && !pkl)
    rc = ZS_EPROTO;
  if (rc == 0)
    rc = check_byteorder(&z, prefix, err, errlen);
  if (rc == 0)
    rc = zip_data(&z, pkl, &at, err, errlen);
  if (rc == 0 && pkl->size > TZ_MAX_PICKLE_BYTES)
    rc = status_fail(err, errlen, ZS_EPROTO,
                     "torch zip: a data.pkl of %" PRIu64 " bytes (the limit is %u)", pkl->size,
                     TZ_MAX_PICKLE_BYTES);
  char member[300];
  pv *dict = NULL;
  if (rc == 0) {
    snprintf(member, sizeof member, "%sdata.pkl", prefix);
    k.p = k.start = file + at;
    k.end = file + at + pkl->size;
    k.member = member;
    rc = pk_run(&k, &dict);
  }
  if (rc == 0) {
    out->data_start = 0;
    out->data_len = size;
    rc = tensors_of(&z, prefix, dict, out, err, errlen);
  }
  pk_free(&k);
  free(z.m);
  if (rc != 0)
    st_header_free(out);
  return rc;
}
