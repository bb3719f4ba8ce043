/*
 * test_safetensors — the header reader of `zshard import`
 * (client/cli/safetensors.c): a good file's tensors come back with their
 * names (escapes decoded), dtypes, shapes and ranges; every malformed or
 * hostile header is refused with a sentence naming the problem, and every
 * prefix of a good file is refused (none reads past its end: run under ASan).
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
#include "safetensors.h"

/* A file of header `json` followed by `data_len` zero bytes, in a buffer of
 * exactly its size (the caller frees). */
static uint8_t *make_file(const char *json, size_t data_len, size_t *size) {
  size_t n = strlen(json);
  *size = 8 + n + data_len;
  uint8_t *f = calloc(1, *size);
  assert_non_null(f);
  le_store64(f, n);
  memcpy(f + 8, json, n);
  return f;
}

static int parse(const char *json, size_t data_len, st_header *h, char *err, size_t errlen) {
  size_t size;
  uint8_t *f = make_file(json, data_len, &size);
  int rc = st_parse(f, size, h, err, errlen);
  free(f);
  return rc;
}

static void a_good_header_gives_every_tensor(void **state) {
  (void)state;
  const char *json = "{\"__metadata__\": {\"format\": \"pt\", \"k\\\"\": \"v\"},\n"
                     " \"a.weight\": {\"dtype\": \"F32\", \"shape\": [2, 3], "
                     "\"data_offsets\": [0, 24]},\n"
                     " \"b\\u00e9\\ud83d\\ude00\": {\"shape\": [4], \"data_offsets\": [24, 32], "
                     "\"dtype\": \"BF16\"},\n"
                     " \"s\": {\"dtype\": \"F16\", \"shape\": [], \"data_offsets\": [32, 34]},\n"
                     " \"empty\": {\"dtype\": \"F32\", \"shape\": [0, 5], "
                     "\"data_offsets\": [34, 34]}}   ";
  st_header h;
  char err[256] = "";
  assert_int_equal(parse(json, 34, &h, err, sizeof err), 0);
  assert_int_equal(h.n, 4);
  assert_int_equal(h.data_start, 8 + strlen(json));
  assert_int_equal(h.data_len, 34);
  assert_string_equal(h.tensors[0].name, "a.weight");
  assert_int_equal(h.tensors[0].dtype, ZS_DTYPE_FP32);
  assert_int_equal(h.tensors[0].ndim, 2);
  assert_int_equal(h.tensors[0].shape[1], 3);
  assert_int_equal(h.tensors[0].numel, 6);
  assert_string_equal(h.tensors[1].name, "b\xc3\xa9\xf0\x9f\x98\x80");
  assert_int_equal(h.tensors[1].dtype, ZS_DTYPE_BF16);
  assert_int_equal(h.tensors[1].begin, 24);
  assert_int_equal(h.tensors[1].end, 32);
  assert_int_equal(h.tensors[2].ndim, 0);
  assert_int_equal(h.tensors[2].numel, 1);
  assert_int_equal(h.tensors[2].dtype, ZS_DTYPE_FP16);
  assert_int_equal(h.tensors[3].numel, 0);
  st_header_free(&h);
  assert_int_equal(parse("{}", 0, &h, err, sizeof err), 0);
  assert_int_equal(h.n, 0);
  st_header_free(&h);
}

/* Each bad header, the status and a phrase of the sentence it must get. */
static const struct {
  const char *json;
  size_t data_len;
  int status;
  const char *phrase;
} bad[] = {
    {"[1, 2]", 0, ZS_EPROTO, "must be a JSON object"},
    {"{\"a\": 1}", 0, ZS_EPROTO, "must be an object"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, ZS_EPROTO, "lacks"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4], \"x\": 1}}", 4,
     ZS_EPROTO, "once each"},
    {"{\"a\": {\"dtype\": \"F32\", \"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
     4, ZS_EPROTO, "once each"},
    {"{\"a\": {\"dtype\": \"I64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 8, ZS_EDTYPE,
     "dtype 'I64'"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "non-negative integer"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "not an integer"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [01], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "leading zero"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [99999999999999999999], \"data_offsets\": [0, 4]}}",
     4, ZS_EPROTO, "beyond 2^64"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
     "\"data_offsets\": [0, 4]}}",
     4, ZS_EPROTO, "overflows"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "
     "\"data_offsets\": [0, 4]}}",
     4, ZS_EPROTO, "too many entries"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 8, ZS_EPROTO,
     "two entries"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 4, ZS_EPROTO,
     "not a range inside the 4 data bytes"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 0]}}", 4, ZS_EPROTO,
     "not a range"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "need 8"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}, "
     "\"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
     12, ZS_EPROTO, "overlap"},
    /* An overlap hidden behind an empty tensor between the two. */
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
     "\"z\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 4]}, "
     "\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
     16, ZS_EPROTO, "overlap"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
     "\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
     8, ZS_EPROTO, "twice"},
    {"{\"\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "empty name"},
    {"{\"a\\u0000b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
     ZS_EPROTO, "\\u escape"},
    {"{\"\\ud800x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "\\u escape"},
    {"{\"a\\q\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "bad escape"},
    {"{\"a\n\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, ZS_EPROTO,
     "control character"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}} x", 4, ZS_EPROTO,
     "bytes after"},
    {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}", 4, ZS_EPROTO,
     "expected"},
    {"{\"__metadata__\": {\"k\": 1}}", 0, ZS_EPROTO, "a string was expected"},
    {"{\"__metadata__\": {}, \"__metadata__\": {}}", 0, ZS_EPROTO, "twice"},
    {"{\"a", 0, ZS_EPROTO, "runs past"},
};

static void a_bad_header_is_refused_with_a_sentence(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    st_header h;
    char err[512] = "";
    int rc = parse(bad[i].json, bad[i].data_len, &h, err, sizeof err);
    if (rc != bad[i].status || !strstr(err, bad[i].phrase))
      fail_msg("case %zu (%s): status %d, '%s'; wanted %d and '%s'", i, bad[i].json, rc, err,
               bad[i].status, bad[i].phrase);
    assert_int_equal(h.n, 0);
    assert_null(h.tensors);
  }
}

static void lengths_beyond_the_file_or_the_limit_are_refused(void **state) {
  (void)state;
  st_header h;
  char err[256];
  uint8_t f[16] = {0};
  assert_int_equal(st_parse(f, 7, &h, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "too short"));
  le_store64(f, 9);
  assert_int_equal(st_parse(f, 16, &h, err, sizeof err), ZS_EPROTO);
  assert_non_null(strstr(err, "beyond the file"));
  le_store64(f, UINT64_MAX);
  assert_int_equal(st_parse(f, 16, &h, err, sizeof err), ZS_EPROTO);
  le_store64(f, 8);
  memcpy(f + 8, "{}      ", 8);
  assert_int_equal(st_parse(f, 16, &h, err, sizeof err), 0);
  st_header_free(&h);
}

/* Every prefix of a good file (a truncated download) is refused: the
 * header's length no longer fits, or the JSON or the data ends early. Each
 * prefix is copied into a buffer of exactly its size, so that a read past
 * it is an ASan error. */
static void every_truncation_is_refused(void **state) {
  (void)state;
  const char *json = "{\"a\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 8]},"
                     " \"b\\u00e9\": {\"dtype\": \"F32\", \"shape\": [1], "
                     "\"data_offsets\": [8, 12]}}";
  size_t size;
  uint8_t *f = make_file(json, 12, &size);
  for (size_t n = 0; n < size; n++) {
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    memcpy(p, f, n);
    st_header h;
    char err[256];
    if (st_parse(p, n, &h, err, sizeof err) == 0)
      fail_msg("a prefix of %zu of %zu bytes was taken", n, size);
    free(p);
  }
  st_header h;
  char err[256];
  assert_int_equal(st_parse(f, size, &h, err, sizeof err), 0);
  st_header_free(&h);
  /* ...and so is the header's length field cut into the JSON. */
  le_store64(f, strlen(json) - 1);
  assert_int_not_equal(st_parse(f, size, &h, err, sizeof err), 0);
  free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_good_header_gives_every_tensor),
      cmocka_unit_test(a_bad_header_is_refused_with_a_sentence),
      cmocka_unit_test(lengths_beyond_the_file_or_the_limit_are_refused),
      cmocka_unit_test(every_truncation_is_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
