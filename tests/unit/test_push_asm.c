/*
 * test_push_asm — reassembly of chunked Push payloads: chunks in any order
 * and repeated make the payload once; malformed chunks are refused and hold
 * nothing; the budget refuses a payload that does not fit and is given back
 * when one completes; a payload past its time to live is dropped when room
 * is needed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "server/transport/grpc/push_asm.h"

#define CHUNK 16u

static push_asm_key key(uint32_t tensor) {
  return (push_asm_key){.hash = 7, .step = 1, .tensor = tensor, .dtype = ZS_DTYPE_FP32};
}

static void chunks_in_any_order_make_the_payload_once(void **state) {
  (void)state;
  push_asm *a = NULL;
  assert_int_equal(push_asm_new(1000, 60000, CHUNK, &a), 0);
  uint8_t want[40];
  for (size_t i = 0; i < sizeof want; i++)
    want[i] = (uint8_t)i;
  push_asm_key k = key(0);
  void *done = NULL;
  char err[256];
  /* Chunks 2 (the short last one), 0, 0 again, then 1. */
  assert_int_equal(push_asm_add(a, &k, 40, 32, want + 32, 8, &done, err, sizeof err), 0);
  assert_null(done);
  assert_int_equal(push_asm_held(a), 40);
  assert_int_equal(push_asm_add(a, &k, 40, 0, want, CHUNK, &done, err, sizeof err), 0);
  assert_int_equal(push_asm_add(a, &k, 40, 0, want, CHUNK, &done, err, sizeof err), 0);
  assert_null(done);
  assert_int_equal(push_asm_add(a, &k, 40, 16, want + 16, CHUNK, &done, err, sizeof err), 0);
  assert_non_null(done);
  assert_memory_equal(done, want, sizeof want);
  free(done);
  assert_int_equal(push_asm_held(a), 0);
  push_asm_free(a);
}

static void malformed_chunks_are_refused_and_hold_nothing(void **state) {
  (void)state;
  push_asm *a = NULL;
  assert_int_equal(push_asm_new(1000, 60000, CHUNK, &a), 0);
  uint8_t buf[CHUNK] = {0};
  push_asm_key k = key(0);
  void *done = NULL;
  char err[256];
  /* Off a chunk boundary; short but not last; past the end; too many chunks. */
  assert_int_equal(push_asm_add(a, &k, 40, 8, buf, 8, &done, err, sizeof err), ZS_EINVAL);
  assert_int_equal(push_asm_add(a, &k, 40, 0, buf, 8, &done, err, sizeof err), ZS_EINVAL);
  assert_int_equal(push_asm_add(a, &k, 40, 48, buf, 8, &done, err, sizeof err), ZS_EINVAL);
  assert_int_equal(push_asm_add(a, &k, CHUNK * 65, 0, buf, CHUNK, &done, err, sizeof err),
                   ZS_EINVAL);
  assert_int_equal(push_asm_held(a), 0);
  /* A chunk that disagrees with an earlier one about the payload's size. */
  assert_int_equal(push_asm_add(a, &k, 40, 0, buf, CHUNK, &done, err, sizeof err), 0);
  assert_int_equal(push_asm_add(a, &k, 48, 16, buf, CHUNK, &done, err, sizeof err), ZS_EINVAL);
  assert_int_equal(push_asm_held(a), 40);
  push_asm_free(a); /* frees the unfinished payload */
}

static void the_budget_refuses_and_is_given_back(void **state) {
  (void)state;
  push_asm *a = NULL;
  assert_int_equal(push_asm_new(64, 60000, CHUNK, &a), 0);
  uint8_t buf[CHUNK] = {0};
  push_asm_key k0 = key(0), k1 = key(1);
  void *done = NULL;
  char err[256];
  assert_int_equal(push_asm_add(a, &k0, 48, 0, buf, CHUNK, &done, err, sizeof err), 0);
  assert_int_equal(push_asm_add(a, &k1, 32, 0, buf, CHUNK, &done, err, sizeof err), ZS_ELIMIT);
  assert_non_null(strstr(err, "limit"));
  assert_int_equal(push_asm_add(a, &k0, 48, 16, buf, CHUNK, &done, err, sizeof err), 0);
  assert_int_equal(push_asm_add(a, &k0, 48, 32, buf, CHUNK, &done, err, sizeof err), 0);
  assert_non_null(done);
  free(done);
  assert_int_equal(push_asm_add(a, &k1, 32, 0, buf, CHUNK, &done, err, sizeof err), 0);
  assert_null(done);
  push_asm_free(a);
}

static void an_abandoned_payload_is_dropped_when_room_is_needed(void **state) {
  (void)state;
  push_asm *a = NULL;
  assert_int_equal(push_asm_new(64, 1, CHUNK, &a), 0); /* 1 ms to live */
  uint8_t buf[CHUNK] = {0};
  push_asm_key k0 = key(0), k1 = key(1);
  void *done = NULL;
  char err[256];
  assert_int_equal(push_asm_add(a, &k0, 64, 0, buf, CHUNK, &done, err, sizeof err), 0);
  usleep(5000); /* past its time to live: the outcome, not a duration, is checked */
  assert_int_equal(push_asm_add(a, &k1, 32, 0, buf, CHUNK, &done, err, sizeof err), 0);
  assert_int_equal(push_asm_held(a), 32);
  push_asm_free(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(chunks_in_any_order_make_the_payload_once),
      cmocka_unit_test(malformed_chunks_are_refused_and_hold_nothing),
      cmocka_unit_test(the_budget_refuses_and_is_given_back),
      cmocka_unit_test(an_abandoned_payload_is_dropped_when_room_is_needed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
