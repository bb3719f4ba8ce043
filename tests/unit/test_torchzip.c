/*
 * test_torchzip — the torch.save zip reader of `zshard import`
 * (client/cli/torchzip.c). The files are built here, byte for byte as
 * torch.save lays them out (STORED members aligned to 64 bytes, a protocol 2
 * pickle of an OrderedDict with _metadata, storages as persistent ids), so
 * that each test can change one thing: a good file's tensors come back with
 * their names, dtypes, shapes and byte ranges (a saved view with its
 * strides); a hostile global, an opcode outside torch.save's, a compressed
 * member, a tensor past its storage and more are refused with a sentence naming the
 * problem; every prefix of the pickle and of the file, and every byte of the
 * pickle changed, is refused or read inside the file (run under ASan: no
 * read past a buffer of exactly the file's size).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/base/le.h"
#include "torchzip.h"

/* ---- a pickle, as torch.save writes one ---------------------------------------- */

typedef struct pb {
  uint8_t b[4096];
  size_t n;
  uint32_t memo;
} pb;

static void pb_bytes(pb *p, const void *s, size_t n) {
  assert_true(p->n + n <= sizeof p->b);
  memcpy(p->b + p->n, s, n);
  p->n += n;
}

static void pb_op(pb *p, uint8_t op) {
  pb_bytes(p, &op, 1);
}

/* BINPUT of the top, as the pickler does after each new object. */
static void pb_put(pb *p) {
  uint8_t op[2] = {'q', (uint8_t)p->memo++};
  pb_bytes(p, op, 2);
}

static void pb_str(pb *p, const char *s) {
  uint8_t len[4];
  le_store32(len, (uint32_t)strlen(s));
  pb_op(p, 'X');
  pb_bytes(p, len, 4);
  pb_bytes(p, s, strlen(s));
  pb_put(p);
}

static void pb_int(pb *p, uint32_t v) {
  uint8_t b[4];
  if (v < 256) {
    pb_op(p, 'K');
    pb_op(p, (uint8_t)v);
  } else if (v < 65536) {
    le_store16(b, (uint16_t)v);
    pb_op(p, 'M');
    pb_bytes(p, b, 2);
  } else {
    le_store32(b, v);
    pb_op(p, 'J');
    pb_bytes(p, b, 4);
  }
}

static void pb_global(pb *p, const char *mod, const char *name) {
  pb_op(p, 'c');
  pb_bytes(p, mod, strlen(mod));
  pb_op(p, '\n');
  pb_bytes(p, name, strlen(name));
  pb_op(p, '\n');
  pb_put(p);
}

static void pb_tuple(pb *p, const uint32_t *v, uint32_t n) {
  if (n == 0) {
    pb_op(p, ')');
    return;
  }
  if (n > 3)
    pb_op(p, '(');
  for (uint32_t i = 0; i < n; i++)
    pb_int(p, v[i]);
  pb_op(p, n > 3 ? 't' : (uint8_t)(0x84 + n));
  pb_put(p);
}

typedef struct tensor_spec {
  const char *name, *cls, *key;
  uint32_t numel, offset, ndim, shape[5], stride[5];
} tensor_spec;

/* _rebuild_tensor_v2(('storage', cls, key, 'cpu', numel), offset, shape,
 * stride, False, OrderedDict()). */
static void pb_tensor(pb *p, const tensor_spec *t) {
  pb_global(p, "torch._utils", "_rebuild_tensor_v2");
  pb_op(p, '(');
  pb_op(p, '(');
  pb_str(p, "storage");
  pb_global(p, "torch", t->cls);
  pb_str(p, t->key);
  pb_str(p, "cpu");
  pb_int(p, t->numel);
  pb_op(p, 't');
  pb_put(p);
  pb_op(p, 'Q');
  pb_int(p, t->offset);
  pb_tuple(p, t->shape, t->ndim);
  pb_tuple(p, t->stride, t->ndim);
  pb_op(p, 0x89);
  pb_global(p, "collections", "OrderedDict");
  pb_op(p, ')');
  pb_op(p, 'R');
  pb_put(p);
  pb_op(p, 't');
  pb_put(p);
  pb_op(p, 'R');
  pb_put(p);
}

/* OrderedDict of the tensors, with its _metadata attribute ({"": {"version":
 * 1}}) set by BUILD, as model.state_dict() pickles. */
static void pb_state_dict(pb *p, const tensor_spec *t, size_t n) {
  memset(p, 0, sizeof *p);
  pb_op(p, 0x80);
  pb_op(p, 2);
  pb_global(p, "collections", "OrderedDict");
  uint32_t od = p->memo - 1;
  pb_op(p, ')');
  pb_op(p, 'R');
  pb_put(p);
  pb_op(p, '(');
  for (size_t i = 0; i < n; i++) {
    pb_str(p, t[i].name);
    pb_tensor(p, &t[i]);
  }
  pb_op(p, 'u');
  pb_op(p, '}');
  pb_put(p);
  pb_str(p, "_metadata");
  uint8_t get[2] = {'h', (uint8_t)od};
  pb_bytes(p, get, 2);
  pb_op(p, ')');
  pb_op(p, 'R');
  pb_put(p);
  pb_str(p, "");
  pb_op(p, '}');
  pb_put(p);
  pb_str(p, "version");
  pb_int(p, 1);
  pb_op(p, 's');
  pb_op(p, 's');
  pb_op(p, 's');
  pb_op(p, 'b');
  pb_op(p, '.');
}

/* ---- a zip, as torch.save writes one ------------------------------------------ */

typedef struct member {
  const char *name;
  const uint8_t *data;
  size_t len;
  uint16_t method;
} member;

typedef struct zb {
  uint8_t *b;
  size_t n, cap;
} zb;

static uint8_t *zb_grow(zb *z, size_t n) {
  if (z->n + n > z->cap) {
    z->cap = (z->n + n) * 2;
    z->b = realloc(z->b, z->cap);
    assert_non_null(z->b);
  }
  uint8_t *at = z->b + z->n;
  memset(at, 0, n);
  z->n += n;
  return at;
}

/* The members STORED (or with `method` claimed), each one's data 64-byte
 * aligned by padding in its local header's extra field; with zip64, the
 * end record's fields overflow into a zip64 end record. */
static uint8_t *make_zip(const member *m, size_t n, int zip64, size_t *size) {
  zb z = {0};
  uint64_t *local = calloc(n, sizeof *local);
  assert_non_null(local);
  for (size_t i = 0; i < n; i++) {
    size_t nl = strlen(m[i].name);
    local[i] = z.n;
    size_t pad = (64 - (z.n + 30 + nl + 4) % 64) % 64;
    uint8_t *h = zb_grow(&z, 30 + nl + 4 + pad);
    le_store32(h, 0x04034b50u);
    le_store16(h + 8, m[i].method);
    le_store32(h + 18, (uint32_t)m[i].len);
    le_store32(h + 22, (uint32_t)m[i].len);
    le_store16(h + 26, (uint16_t)nl);
    le_store16(h + 28, (uint16_t)(4 + pad));
    memcpy(h + 30, m[i].name, nl);
    le_store16(h + 30 + nl, 0x4246); /* "FB": torch's padding field */
    le_store16(h + 30 + nl + 2, (uint16_t)pad);
    memcpy(zb_grow(&z, m[i].len), m[i].data, m[i].len);
  }
  size_t cd = z.n;
  for (size_t i = 0; i < n; i++) {
    size_t nl = strlen(m[i].name);
    uint8_t *c = zb_grow(&z, 46 + nl);
    le_store32(c, 0x02014b50u);
    le_store16(c + 10, m[i].method);
    le_store32(c + 20, (uint32_t)m[i].len);
    le_store32(c + 24, (uint32_t)m[i].len);
    le_store16(c + 28, (uint16_t)nl);
    le_store32(c + 42, (uint32_t)local[i]);
    memcpy(c + 46, m[i].name, nl);
  }
  size_t cd_size = z.n - cd;
  if (zip64) {
    size_t at = z.n;
    uint8_t *r = zb_grow(&z, 56 + 20);
    le_store32(r, 0x06064b50u);
    le_store64(r + 4, 44);
    le_store64(r + 24, n);
    le_store64(r + 32, n);
    le_store64(r + 40, cd_size);
    le_store64(r + 48, cd);
    le_store32(r + 56, 0x07064b50u);
    le_store64(r + 56 + 8, at);
    le_store32(r + 56 + 16, 1);
  }
  uint8_t *e = zb_grow(&z, 22);
  le_store32(e, 0x06054b50u);
  le_store16(e + 8, zip64 ? 0xFFFF : (uint16_t)n);
  le_store16(e + 10, zip64 ? 0xFFFF : (uint16_t)n);
  le_store32(e + 12, zip64 ? 0xFFFFFFFFu : (uint32_t)cd_size);
  le_store32(e + 16, zip64 ? 0xFFFFFFFFu : (uint32_t)cd);
  free(local);
  *size = z.n;
  return z.b;
}

/* ---- the good file ---------------------------------------------------------------- */

static uint8_t f32_data[24], bf16_data[12], f16_data[2];

/* a.weight: fp32 [2, 3]; b: bf16 [4] at element 2 of its storage of 6; s:
 * an fp16 scalar; tied: all of a.weight's storage again, as [6]. */
static const tensor_spec good[] = {
    {"a.weight", "FloatStorage", "0", 6, 0, 2, {2, 3}, {3, 1}},
    {"b", "BFloat16Storage", "1", 6, 2, 1, {4}, {1}},
    {"s", "HalfStorage", "2", 1, 0, 0, {0}, {0}},
    {"tied", "FloatStorage", "0", 6, 0, 1, {6}, {1}},
};

/* The archive of a pickle and the three storages; `extra` (may be NULL)
 * replaces the member of its name. */
static uint8_t *make_file(const pb *pkl, const member *extra, int zip64, size_t *size) {
  member m[6] = {
      {"archive/data.pkl", pkl->b, pkl->n, 0},
      {"archive/byteorder", (const uint8_t *)"little", 6, 0},
      {"archive/data/0", f32_data, 24, 0},
      {"archive/data/1", bf16_data, 12, 0},
      {"archive/data/2", f16_data, 2, 0},
      {"archive/version", (const uint8_t *)"3\n", 2, 0},
  };
  for (size_t i = 0; extra && i < 6; i++)
    if (strcmp(m[i].name, extra->name) == 0)
      m[i] = *extra;
  return make_zip(m, 6, zip64, size);
}

/* tz_parse of a copy of exactly `size` bytes, so that ASan sees any read
 * past the file. */
static int parse_copy(const uint8_t *f, size_t size, st_header *h, char *err, size_t errlen) {
  uint8_t *p = malloc(size ? size : 1);
  assert_non_null(p);
  memcpy(p, f, size);
  int rc = tz_parse(p, size, h, err, errlen);
  for (size_t i = 0; rc == 0 && i < h->n; i++)
    if (h->tensors[i].begin > h->tensors[i].end || h->tensors[i].end > size)
      fail_msg("tensor %zu's range [%llu, %llu) is outside the %zu bytes", i,
               (unsigned long long)h->tensors[i].begin, (unsigned long long)h->tensors[i].end,
               size);
  free(p);
  return rc;
}

/* The file of state dict t[n] parsed, which must succeed; returns the file
 * (the caller frees it and h). */
static uint8_t *parse_good(const tensor_spec *t, size_t n, int zip64, st_header *h) {
  pb p;
  pb_state_dict(&p, t, n);
  size_t size;
  uint8_t *f = make_file(&p, NULL, zip64, &size);
  assert_true(tz_is_zip(f, size));
  char err[512] = "";
  if (tz_parse(f, size, h, err, sizeof err) != 0)
    fail_msg("zip64 %d: %s", zip64, err);
  return f;
}

static void a_state_dict_gives_every_tensor_in_place(void **state) {
  (void)state;
  /* Each tensor's dtype, rank, element count, and where its bytes lie: the
   * member's 64-byte aligned start plus its offset. */
  static const struct {
    zs_dtype dtype;
    uint32_t ndim;
    uint64_t numel, align, bytes;
  } want[] = {{ZS_DTYPE_FP32, 2, 6, 0, 24},
              {ZS_DTYPE_BF16, 1, 4, 4, 8},
              {ZS_DTYPE_FP16, 0, 1, 0, 2},
              {ZS_DTYPE_FP32, 1, 6, 0, 24}};
  for (int zip64 = 0; zip64 < 2; zip64++) {
    st_header h;
    uint8_t *f = parse_good(good, 4, zip64, &h);
    assert_int_equal(h.n, 4);
    assert_int_equal(h.data_start, 0);
    for (size_t i = 0; i < 4; i++) {
      const st_tensor *t = &h.tensors[i];
      assert_string_equal(t->name, good[i].name);
      assert_int_equal(t->dtype, want[i].dtype);
      assert_int_equal(t->ndim, want[i].ndim);
      for (uint32_t d = 0; d < t->ndim; d++)
        assert_int_equal(t->shape[d], good[i].shape[d]);
      assert_int_equal(t->numel, want[i].numel);
      assert_int_equal(t->begin % 64, want[i].align);
      assert_int_equal(t->end - t->begin, want[i].bytes);
    }
    assert_memory_equal(f + h.tensors[0].begin, f32_data, 24);
    assert_memory_equal(f + h.tensors[1].begin, bf16_data + 4, 8);
    /* A storage two tensors share: the same bytes. */
    assert_int_equal(h.tensors[3].begin, h.tensors[0].begin);
    st_header_free(&h);
    free(f);
  }
}

/* A view saved with its strides (a transpose, a slice, an expand) comes
 * back with them, its range covering its furthest element. */
static void a_saved_view_keeps_its_strides(void **state) {
  (void)state;
  tensor_spec t[3] = {good[0], good[0], good[1]};
  t[0].stride[0] = 1, t[0].stride[1] = 2; /* [2, 3] transposed from [3, 2] */
  t[1].name = "slice";
  t[1].offset = 1, t[1].shape[0] = 2, t[1].shape[1] = 2, t[1].stride[0] = 3, t[1].stride[1] = 1;
  t[2].name = "expanded";
  t[2].offset = 5, t[2].ndim = 2, t[2].shape[0] = 3, t[2].shape[1] = 2;
  t[2].stride[0] = 0, t[2].stride[1] = 0;
  st_header h;
  uint8_t *f = parse_good(t, 3, 0, &h);
  assert_int_equal(h.n, 3);
  assert_true(h.tensors[0].strided);
  assert_int_equal(h.tensors[0].stride[0], 1);
  assert_int_equal(h.tensors[0].stride[1], 2);
  assert_int_equal(h.tensors[0].end - h.tensors[0].begin, 24);
  /* Elements 1, 2, 4, 5 of the storage: bytes 4 to 24. */
  assert_true(h.tensors[1].strided);
  assert_int_equal(h.tensors[1].numel, 4);
  assert_int_equal(h.tensors[1].begin % 64, 4);
  assert_int_equal(h.tensors[1].end - h.tensors[1].begin, 20);
  /* Six elements, all of them element 5: two bytes. */
  assert_true(h.tensors[2].strided);
  assert_int_equal(h.tensors[2].numel, 6);
  assert_int_equal(h.tensors[2].begin % 64, 10);
  assert_int_equal(h.tensors[2].end - h.tensors[2].begin, 2);
  st_header_free(&h);
  free(f);
  /* ...and a row-major one is not strided. */
  f = parse_good(good, 1, 0, &h);
  assert_false(h.tensors[0].strided);
  st_header_free(&h);
  free(f);
}

static void a_name_given_twice_keeps_its_last_tensor(void **state) {
  (void)state;
  tensor_spec t[3] = {good[0], good[1], good[3]};
  t[2].name = "a.weight";
  t[2].offset = 2;
  t[2].shape[0] = 4;
  st_header h;
  uint8_t *f = parse_good(t, 3, 0, &h);
  assert_int_equal(h.n, 2);
  assert_string_equal(h.tensors[1].name, "a.weight");
  assert_int_equal(h.tensors[1].numel, 4);
  assert_int_equal(h.tensors[1].begin % 64, 8);
  st_header_free(&h);
  free(f);
}

/* ---- what is refused ---------------------------------------------------------------- */

/* The file of pickle p (and member `extra` in place of its namesake) is
 * refused with `status` and a sentence containing `phrase`. */
static void expect(const pb *p, const member *extra, int status, const char *phrase) {
  size_t size;
  uint8_t *f = make_file(p, extra, 0, &size);
  st_header h;
  char err[512] = "";
  int rc = parse_copy(f, size, &h, err, sizeof err);
  if (rc != status || !strstr(err, phrase))
    fail_msg("status %d, '%s'; wanted %d and '%s'", rc, err, status, phrase);
  assert_int_equal(h.n, 0);
  assert_null(h.tensors);
  free(f);
}

static void expect_tensor(const tensor_spec *t0, int status, const char *phrase) {
  tensor_spec t[2] = {*t0, good[1]};
  pb p;
  pb_state_dict(&p, t, 2);
  expect(&p, NULL, status, phrase);
}

static void bad_tensors_are_refused_with_a_sentence(void **state) {
  (void)state;
  tensor_spec t = good[0];
  t.stride[0] = 3, t.stride[1] = 2; /* its last element would be 3 + 4 */
  expect_tensor(&t, ZS_EPROTO, "8 elements at offset 0 reach past its storage");
  t = good[0];
  t.offset = 1; /* 6 elements from element 1 of 6 */
  expect_tensor(&t, ZS_EPROTO, "reach past its storage");
  t = good[0];
  t.numel = 7; /* the member holds 6 */
  expect_tensor(&t, ZS_EPROTO, "need 28");
  t = good[0];
  t.key = "9";
  expect_tensor(&t, ZS_EPROTO, "has no member archive/data/9");
  t = good[0];
  t.cls = "LongStorage", t.numel = 3, t.ndim = 1, t.shape[0] = 3, t.stride[0] = 1;
  expect_tensor(&t, ZS_EDTYPE, "is in a LongStorage");
  t = good[0];
  t.ndim = 5, t.shape[2] = t.shape[3] = t.shape[4] = 1, t.stride[2] = t.stride[3] = 1;
  t.stride[4] = 1, t.stride[0] = 3, t.stride[1] = 1;
  {
    /* Size-1 dimensions may have any stride: still contiguous. */
    st_header h;
    uint8_t *f = parse_good(&t, 1, 0, &h);
    assert_int_equal(h.tensors[0].ndim, 5);
    st_header_free(&h);
    free(f);
  }
  t = good[0];
  t.cls = "TypedStorage";
  expect_tensor(&t, ZS_EPROTO, "global torch.TypedStorage is not allowed");
}

/* Replaces the first occurrence of `from` in the pickle with `to` (same
 * length). */
static void pb_patch(pb *p, const char *from, const char *to) {
  size_t n = strlen(from);
  assert_int_equal(n, strlen(to));
  for (size_t i = 0; i + n <= p->n; i++)
    if (memcmp(p->b + i, from, n) == 0) {
      memcpy(p->b + i, to, n);
      return;
    }
  fail_msg("'%s' is not in the pickle", from);
}

static void a_hostile_or_foreign_pickle_is_refused_naming_what(void **state) {
  (void)state;
  pb p;
  /* os.system('true'): the global is refused before anything could call it. */
  memset(&p, 0, sizeof p);
  pb_op(&p, 0x80), pb_op(&p, 2);
  pb_global(&p, "os", "system");
  pb_str(&p, "true");
  pb_op(&p, 0x85), pb_op(&p, 'R'), pb_op(&p, '.');
  expect(&p, NULL, ZS_EPROTO, "global os.system is not allowed");
  /* Python 3's default protocol writes STACK_GLOBAL (0x93) and frames. */
  memset(&p, 0, sizeof p);
  pb_op(&p, 0x80), pb_op(&p, 4), pb_op(&p, 0x95);
  expect(&p, NULL, ZS_EPROTO, "opcode 0x95 is not read");
  pb_state_dict(&p, good, 2);
  p.b[2] = 'i'; /* INST in place of the first GLOBAL */
  expect(&p, NULL, ZS_EPROTO, "opcode 0x69 ('i') is not read");
  expect(&p, NULL, ZS_EPROTO, "at byte 2 of archive/data.pkl");
  pb_state_dict(&p, good, 2);
  pb_patch(&p, "_rebuild_tensor_v2", "_rebuild_tensor_v3");
  expect(&p, NULL, ZS_EPROTO, "global torch._utils._rebuild_tensor_v3 is not allowed");
  /* A NUL in a global's name does not make it one of the allowed. */
  memset(&p, 0, sizeof p);
  pb_bytes(&p, "ccollections\0x\nOrderedDict\n)R.", 30);
  expect(&p, NULL, ZS_EPROTO, "is not allowed in a state dict");
  /* A list is not a state dict. */
  memset(&p, 0, sizeof p);
  pb_op(&p, 0x80), pb_op(&p, 2), pb_op(&p, ']'), pb_op(&p, '.');
  expect(&p, NULL, ZS_EPROTO, "opcode 0x5d (']')");
  memset(&p, 0, sizeof p);
  pb_op(&p, 0x80), pb_op(&p, 2), pb_op(&p, ')'), pb_op(&p, '.');
  expect(&p, NULL, ZS_EPROTO, "holds a tuple, not a state dict");
  /* A dict of a name to an int. */
  memset(&p, 0, sizeof p);
  pb_op(&p, '}'), pb_str(&p, "step"), pb_int(&p, 3), pb_op(&p, 's'), pb_op(&p, '.');
  expect(&p, NULL, ZS_EPROTO, "entry 'step' of the state dict is a int, not a tensor");
  /* BINGET of a memo entry never put. */
  memset(&p, 0, sizeof p);
  pb_op(&p, 'h'), pb_op(&p, 7), pb_op(&p, '.');
  expect(&p, NULL, ZS_EPROTO, "memo entry 7 was never put");
  memset(&p, 0, sizeof p);
  pb_op(&p, '}'), pb_op(&p, 'u');
  expect(&p, NULL, ZS_EPROTO, "SETITEMS without a dict");
}

static void bad_members_are_refused_with_a_sentence(void **state) {
  (void)state;
  pb p;
  pb_state_dict(&p, good, 4);
  member m = {"archive/data/0", f32_data, 24, 8}; /* deflated, it says */
  expect(&p, &m, ZS_EPROTO, "member 'archive/data/0' is compressed (method 8)");
  member big = {"archive/byteorder", (const uint8_t *)"big", 3, 0};
  expect(&p, &big, ZS_EPROTO, "only little-endian");
  member two = {"archive/data.pkl", p.b, p.n, 0};
  member other = {"other/data.pkl", p.b, p.n, 0};
  member ms[2] = {two, other};
  size_t size;
  uint8_t *f = make_zip(ms, 2, 0, &size);
  st_header h;
  char err[512] = "";
  assert_int_equal(tz_parse(f, size, &h, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "2 members named <archive>/data.pkl"));
  free(f);
  /* The legacy layout's top-level data.pkl is not torch.save's zip layout. */
  member flat = {"data.pkl", p.b, p.n, 0};
  f = make_zip(&flat, 1, 0, &size);
  assert_int_equal(tz_parse(f, size, &h, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "0 members named"));
  free(f);
}

/* Every prefix of the file (a truncated download) is refused, and so is
 * every prefix of the pickle inside a whole zip. */
static void every_truncation_is_refused(void **state) {
  (void)state;
  pb p;
  pb_state_dict(&p, good, 4);
  size_t size;
  uint8_t *f = make_file(&p, NULL, 0, &size);
  for (size_t n = 0; n < size; n++) {
    st_header h;
    char err[512];
    if (parse_copy(f, n, &h, err, sizeof err) == 0)
      fail_msg("a prefix of %zu of %zu bytes was taken", n, size);
  }
  free(f);
  for (size_t n = 0; n < p.n; n++) {
    member cut = {"archive/data.pkl", p.b, n, 0};
    f = make_file(&p, &cut, 0, &size);
    st_header h;
    char err[512];
    if (parse_copy(f, size, &h, err, sizeof err) == 0)
      fail_msg("a pickle cut to %zu of %zu bytes was taken", n, p.n);
    free(f);
  }
}

/* Each byte of the pickle, and each byte of the zip's central directory
 * and end record, set to a few values: refused, or read with every tensor
 * inside the file (parse_copy checks), never a read out of bounds. */
static void every_corrupt_byte_is_refused_or_read_in_bounds(void **state) {
  (void)state;
  static const uint8_t values[] = {0x00, 0x01, 0x7f, 0x80, 0xff, '(', 't', 'h', 'q', 'J', 'X'};
  pb p;
  pb_state_dict(&p, good, 4);
  size_t taken = 0, tries = 0;
  for (size_t i = 0; i < p.n; i++)
    for (size_t v = 0; v < sizeof values; v++) {
      pb q = p;
      q.b[i] = values[v];
      size_t size;
      uint8_t *f = make_file(&q, NULL, 0, &size);
      st_header h;
      char err[512];
      if (parse_copy(f, size, &h, err, sizeof err) == 0) {
        taken++;
        st_header_free(&h);
      }
      tries++;
      free(f);
    }
  size_t size;
  uint8_t *f = make_file(&p, NULL, 1, &size);
  size_t tail = 6 * (46 + 20) + 56 + 20 + 22; /* past the central directory's start */
  for (size_t i = size - tail; i < size; i++)
    for (size_t v = 0; v < sizeof values; v++) {
      uint8_t keep = f[i];
      f[i] = values[v];
      st_header h;
      char err[512];
      if (parse_copy(f, size, &h, err, sizeof err) == 0)
        st_header_free(&h);
      f[i] = keep;
    }
  free(f);
  print_message("%zu of %zu one-byte changes of the pickle still parse\n", taken, tries);
  assert_true(taken < tries);
}

int main(void) {
  for (size_t i = 0; i < sizeof f32_data; i++)
    f32_data[i] = (uint8_t)(i * 7 + 1);
  for (size_t i = 0; i < sizeof bf16_data; i++)
    bf16_data[i] = (uint8_t)(i * 5 + 3);
  f16_data[0] = 0x00, f16_data[1] = 0x3c;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_state_dict_gives_every_tensor_in_place),
      cmocka_unit_test(a_saved_view_keeps_its_strides),
      cmocka_unit_test(a_name_given_twice_keeps_its_last_tensor),
      cmocka_unit_test(bad_tensors_are_refused_with_a_sentence),
      cmocka_unit_test(a_hostile_or_foreign_pickle_is_refused_naming_what),
      cmocka_unit_test(bad_members_are_refused_with_a_sentence),
      cmocka_unit_test(every_truncation_is_refused),
      cmocka_unit_test(every_corrupt_byte_is_refused_or_read_in_bounds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
