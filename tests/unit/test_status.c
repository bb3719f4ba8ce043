/*
 * test_status — the status codes (zshard.h's ZS_STATUS_MAP, common/base/status.h):
 * sentences and names for every code and for unknown ones, the gRPC mapping
 * in both directions, and zs_dtype_size / zs_version.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <grpc/status.h>

#include "common/base/status.h"
#include "zshard/zshard.h"

/* The expected gRPC code of every zs_status, written out against grpc's own
 * names rather than copied from the X-macro list. */
static const struct {
  int err;
  const char *name;
  grpc_status_code grpc;
} k_codes[] = {
    {ZS_OK, "ZS_OK", GRPC_STATUS_OK},
    {ZS_EINVAL, "ZS_EINVAL", GRPC_STATUS_INVALID_ARGUMENT},
    {ZS_ENOMEM, "ZS_ENOMEM", GRPC_STATUS_RESOURCE_EXHAUSTED},
    {ZS_ENOTFOUND, "ZS_ENOTFOUND", GRPC_STATUS_NOT_FOUND},
    {ZS_EHASH, "ZS_EHASH", GRPC_STATUS_FAILED_PRECONDITION},
    {ZS_ESTEP, "ZS_ESTEP", GRPC_STATUS_OUT_OF_RANGE},
    {ZS_ESIZE, "ZS_ESIZE", GRPC_STATUS_INVALID_ARGUMENT},
    {ZS_EDTYPE, "ZS_EDTYPE", GRPC_STATUS_INVALID_ARGUMENT},
    {ZS_ETIMEDOUT, "ZS_ETIMEDOUT", GRPC_STATUS_DEADLINE_EXCEEDED},
    {ZS_ECONN, "ZS_ECONN", GRPC_STATUS_UNAVAILABLE},
    {ZS_EPROTO, "ZS_EPROTO", GRPC_STATUS_INVALID_ARGUMENT},
    {ZS_ECRC, "ZS_ECRC", GRPC_STATUS_DATA_LOSS},
    {ZS_ECLOSED, "ZS_ECLOSED", GRPC_STATUS_UNAVAILABLE},
    {ZS_EEXIST, "ZS_EEXIST", GRPC_STATUS_ALREADY_EXISTS},
    {ZS_ENOTOPEN, "ZS_ENOTOPEN", GRPC_STATUS_FAILED_PRECONDITION},
    {ZS_ENOTREADY, "ZS_ENOTREADY", GRPC_STATUS_FAILED_PRECONDITION},
    {ZS_ENONFINITE, "ZS_ENONFINITE", GRPC_STATUS_INVALID_ARGUMENT},
    {ZS_EIO, "ZS_EIO", GRPC_STATUS_INTERNAL},
    {ZS_EINTERNAL, "ZS_EINTERNAL", GRPC_STATUS_INTERNAL},
    {ZS_EUNIMPL, "ZS_EUNIMPL", GRPC_STATUS_UNIMPLEMENTED},
    {ZS_EBEHIND, "ZS_EBEHIND", GRPC_STATUS_FAILED_PRECONDITION},
    {ZS_ECANCELED, "ZS_ECANCELED", GRPC_STATUS_CANCELLED},
    {ZS_ERANGE, "ZS_ERANGE", GRPC_STATUS_OUT_OF_RANGE},
    {ZS_EUNAUTHENTICATED, "ZS_EUNAUTHENTICATED", GRPC_STATUS_UNAUTHENTICATED},
    {ZS_EPERM, "ZS_EPERM", GRPC_STATUS_PERMISSION_DENIED},
    {ZS_ELIMIT, "ZS_ELIMIT", GRPC_STATUS_RESOURCE_EXHAUSTED},
    {ZS_ENOTPRIMARY, "ZS_ENOTPRIMARY", GRPC_STATUS_FAILED_PRECONDITION},
    {ZS_ESTALE, "ZS_ESTALE", GRPC_STATUS_ABORTED},
    {ZS_ELEFT, "ZS_ELEFT", GRPC_STATUS_FAILED_PRECONDITION},
};
#define NCODES (sizeof k_codes / sizeof k_codes[0])

static void table_covers_every_code_in_the_map(void **state) {
  (void)state;
  size_t n = 0;
#define COUNT(name, value, grpc, msg) n++;
  ZS_STATUS_MAP(COUNT)
#undef COUNT
  assert_int_equal(n, NCODES);
}

static void every_code_has_its_sentence_and_name(void **state) {
  (void)state;
#define CHECK(name, value, grpc, msg)                                                              \
  assert_string_equal(zs_strerror(value), msg);                                                    \
  assert_string_equal(zs_err_name(value), "ZS_" #name);
  ZS_STATUS_MAP(CHECK)
#undef CHECK
  for (size_t i = 0; i < NCODES; i++) {
    assert_string_equal(zs_err_name(k_codes[i].err), k_codes[i].name);
    assert_true(strlen(zs_strerror(k_codes[i].err)) > 0);
    assert_true(status_valid(k_codes[i].err));
    for (size_t k = 0; k < i; k++)
      assert_string_not_equal(zs_strerror(k_codes[i].err), zs_strerror(k_codes[k].err));
  }
  assert_string_equal(zs_strerror(ZS_OK), "success");
  assert_string_equal(zs_strerror(ZS_EHASH), "model spec hash does not match the shard's job");
}

static void unknown_codes_get_generic_text(void **state) {
  (void)state;
  const int unknown[] = {1, 42, -29, -1000, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    assert_string_equal(zs_strerror(unknown[i]), "unknown error");
    assert_string_equal(zs_err_name(unknown[i]), "ZS_UNKNOWN");
    assert_false(status_valid(unknown[i]));
    assert_int_equal(status_to_grpc(unknown[i]), GRPC_STATUS_UNKNOWN);
  }
}

static void each_code_maps_to_its_grpc_status(void **state) {
  (void)state;
  for (size_t i = 0; i < NCODES; i++)
    if (status_to_grpc(k_codes[i].err) != (int)k_codes[i].grpc)
      fail_msg("%s -> gRPC %d, expected %d", k_codes[i].name, status_to_grpc(k_codes[i].err),
               k_codes[i].grpc);
}

static void grpc_codes_map_back_to_the_most_general_status(void **state) {
  (void)state;
  assert_int_equal(status_from_grpc(GRPC_STATUS_OK), ZS_OK);
  assert_int_equal(status_from_grpc(GRPC_STATUS_CANCELLED), ZS_ECANCELED);
  assert_int_equal(status_from_grpc(GRPC_STATUS_INVALID_ARGUMENT), ZS_EINVAL);
  assert_int_equal(status_from_grpc(GRPC_STATUS_DEADLINE_EXCEEDED), ZS_ETIMEDOUT);
  assert_int_equal(status_from_grpc(GRPC_STATUS_NOT_FOUND), ZS_ENOTFOUND);
  assert_int_equal(status_from_grpc(GRPC_STATUS_ALREADY_EXISTS), ZS_EEXIST);
  /* gRPC's own refusals (a message over the size limit) come as
   * RESOURCE_EXHAUSTED without a trailer: a limit, not the server's memory. */
  assert_int_equal(status_from_grpc(GRPC_STATUS_RESOURCE_EXHAUSTED), ZS_ELIMIT);
  assert_int_equal(status_from_grpc(GRPC_STATUS_PERMISSION_DENIED), ZS_EPERM);
  assert_int_equal(status_from_grpc(GRPC_STATUS_UNAUTHENTICATED), ZS_EUNAUTHENTICATED);
  assert_int_equal(status_from_grpc(GRPC_STATUS_FAILED_PRECONDITION), ZS_ENOTREADY);
  assert_int_equal(status_from_grpc(GRPC_STATUS_OUT_OF_RANGE), ZS_ERANGE);
  assert_int_equal(status_from_grpc(GRPC_STATUS_UNIMPLEMENTED), ZS_EUNIMPL);
  assert_int_equal(status_from_grpc(GRPC_STATUS_UNAVAILABLE), ZS_ECONN);
  assert_int_equal(status_from_grpc(GRPC_STATUS_DATA_LOSS), ZS_ECRC);
  /* Codes zshard never sends, and nonsense, are internal errors. */
  assert_int_equal(status_from_grpc(GRPC_STATUS_UNKNOWN), ZS_EINTERNAL);
  assert_int_equal(status_from_grpc(GRPC_STATUS_INTERNAL), ZS_EINTERNAL);
  assert_int_equal(status_from_grpc(GRPC_STATUS_ABORTED), ZS_ESTALE);
  assert_int_equal(status_from_grpc(-1), ZS_EINTERNAL);
  assert_int_equal(status_from_grpc(1000), ZS_EINTERNAL);
  /* Whatever a server sends for a zs code comes back as a code with the same
   * gRPC status, so the mapping never contradicts itself. */
  for (size_t i = 0; i < NCODES; i++) {
    int back = status_from_grpc(status_to_grpc(k_codes[i].err));
    assert_true(status_valid(back));
    assert_int_equal(status_to_grpc(back), status_to_grpc(k_codes[i].err));
  }
}

static void dtype_sizes_are_4_2_2_and_0_otherwise(void **state) {
  (void)state;
  assert_int_equal(zs_dtype_size(ZS_DTYPE_FP32), 4);
  assert_int_equal(zs_dtype_size(ZS_DTYPE_FP16), 2);
  assert_int_equal(zs_dtype_size(ZS_DTYPE_BF16), 2);
  assert_int_equal(zs_dtype_size(0), 0);
  assert_int_equal(zs_dtype_size(4), 0);
  assert_int_equal(zs_dtype_size(-1), 0);
}

static void state_arrays_have_torch_names(void **state) {
  (void)state;
  assert_string_equal(zs_state_array_name(ZS_STATE_MASTER), "master");
  assert_string_equal(zs_state_array_name(ZS_STATE_EXP_AVG), "exp_avg");
  assert_string_equal(zs_state_array_name(ZS_STATE_EXP_AVG_SQ), "exp_avg_sq");
  assert_string_equal(zs_state_array_name(0), "?");
  assert_string_equal(zs_state_array_name(4), "?");
}

static void version_is_major_minor_patch(void **state) {
  (void)state;
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", ZS_VERSION_MAJOR, ZS_VERSION_MINOR, ZS_VERSION_PATCH);
  assert_string_equal(zs_version(), want);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(table_covers_every_code_in_the_map),
      cmocka_unit_test(state_arrays_have_torch_names),
      cmocka_unit_test(every_code_has_its_sentence_and_name),
      cmocka_unit_test(unknown_codes_get_generic_text),
      cmocka_unit_test(each_code_maps_to_its_grpc_status),
      cmocka_unit_test(grpc_codes_map_back_to_the_most_general_status),
      cmocka_unit_test(dtype_sizes_are_4_2_2_and_0_otherwise),
      cmocka_unit_test(version_is_major_minor_patch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
