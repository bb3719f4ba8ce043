/*
 * test_abi — the growth rules at the top of zshard.h, checked on the built
 * libzshard.so:
 *
 *   - zshard_v0.h, an older header, has structs that are prefixes of
 *     today's: field by field, at compile time (so it cannot drift);
 *   - a program built against it (old_program.c) gets inits, results, rows
 *     and timing that stop at its struct's end (guard bytes) and the
 *     defaults of the fields it lacks, including through a real step against
 *     a real shard;
 *   - a program built against a newer header than the library (structs with
 *     fields appended after today's) gets those fields zeroed by init and
 *     results, and a call that sets one is refused with ZS_EUNIMPL;
 *   - every function the header declares is exported, and nothing else.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "old_program.h"
#include "zshard/zshard.h"

/* The old structs under other names, beside today's. */
#define ZSV0_LAYOUT_ONLY
#define zs_loss_scaler v0_loss_scaler
#define zs_client_options v0_client_options
#define zs_group_options v0_group_options
#define zs_timing v0_timing
#define zs_step_result v0_step_result
#define zs_estimate_input v0_estimate_input
#define zs_estimate_row v0_estimate_row
#include "zshard_v0.h"
#undef zs_loss_scaler
#undef zs_client_options
#undef zs_group_options
#undef zs_timing
#undef zs_step_result
#undef zs_estimate_input
#undef zs_estimate_row

/* Field f of the old struct is where today's is, with the same size. */
#define PREFIX(T, f)                                                                               \
  _Static_assert(offsetof(v0_##T, f) == offsetof(zs_##T, f) &&                                     \
                     sizeof(((v0_##T *)0)->f) == sizeof(((zs_##T *)0)->f),                         \
                 "zshard_v0.h: " #T "." #f " moved or changed size")
/* ... and `last` is the old struct's last field: nothing unchecked after it. */
#define PREFIX_END(T, last)                                                                        \
  PREFIX(T, last);                                                                                 \
  _Static_assert(sizeof(v0_##T) - (offsetof(v0_##T, last) + sizeof(((v0_##T *)0)->last)) <         \
                         _Alignof(v0_##T) &&                                                       \
                     sizeof(v0_##T) < sizeof(zs_##T),                                              \
                 "zshard_v0.h: " #T " is not a shorter prefix ending at " #last)

PREFIX(loss_scaler, struct_size);
PREFIX(loss_scaler, scale);
PREFIX(loss_scaler, min_scale);
PREFIX(loss_scaler, factor);
PREFIX(loss_scaler, window);
PREFIX(loss_scaler, hysteresis);
PREFIX(loss_scaler, cur_hysteresis);
PREFIX_END(loss_scaler, iter);

PREFIX(client_options, struct_size);
PREFIX(client_options, addresses);
PREFIX(client_options, num_shards);
PREFIX(client_options, rank);
PREFIX(client_options, world_size);
PREFIX(client_options, grad_accum);
PREFIX(client_options, job);
PREFIX(client_options, grad_reduce);
PREFIX(client_options, param_dtype);
PREFIX(client_options, split_threshold);
PREFIX(client_options, push_dtype);
PREFIX(client_options, pull_dtype);
PREFIX(client_options, threads);
PREFIX(client_options, reduce_bucket_size);
PREFIX(client_options, allgather_bucket_size);
PREFIX(client_options, prefetch_depth);
PREFIX(client_options, rpc_timeout_ms);
PREFIX(client_options, step_timeout_ms);
PREFIX(client_options, max_retries);
PREFIX(client_options, retry_initial_ms);
PREFIX(client_options, retry_max_ms);
PREFIX(client_options, loss_scaling);
PREFIX(client_options, static_loss_scale);
PREFIX_END(client_options, dynamic_loss_scaler);

PREFIX(group_options, struct_size);
PREFIX(group_options, optimizer);
PREFIX(group_options, lr_scale);
PREFIX(group_options, beta1);
PREFIX(group_options, beta2);
PREFIX(group_options, eps);
PREFIX(group_options, weight_decay);
PREFIX(group_options, momentum);
PREFIX_END(group_options, dampening);

PREFIX(timing, struct_size);
PREFIX(timing, total_ms);
PREFIX(timing, compute_ms);
PREFIX(timing, push_ms);
PREFIX(timing, pull_wait_ms);
PREFIX_END(timing, step_ms);

PREFIX(step_result, struct_size);
PREFIX(step_result, step);
PREFIX(step_result, version);
PREFIX(step_result, applied);
PREFIX(step_result, overflow);
PREFIX(step_result, grad_norm);
PREFIX_END(step_result, clip_coef);

PREFIX(estimate_input, struct_size);
PREFIX(estimate_input, params);
PREFIX(estimate_input, largest_layer);
PREFIX(estimate_input, trainers);
PREFIX(estimate_input, shards);
PREFIX(estimate_input, grad_dtype);
PREFIX(estimate_input, param_dtype);
PREFIX(estimate_input, trainer_gbps);
PREFIX_END(estimate_input, shard_gbps);

PREFIX(estimate_row, struct_size);
PREFIX(estimate_row, strategy);
PREFIX(estimate_row, name);
PREFIX_END(estimate_row, device_bytes);

/* ---- the older program --------------------------------------------------- */

static void old_program_inits_stay_inside_its_structs(void **state) {
  (void)state;
  old_inits_stay_inside_the_old_structs();
}

static void old_program_scaler_gets_defaults_for_missing_state(void **state) {
  (void)state;
  old_scaler_state_it_lacks_takes_defaults();
}

static void old_program_estimate_rows_are_strided_by_its_size(void **state) {
  (void)state;
  old_estimate_input_and_rows();
}

static void old_program_trains_a_step_against_a_shard(void **state) {
  (void)state;
  hs_server *s = hs_start(NULL, NULL);
  assert_non_null(s);
  old_trainer_steps(s->addr);
  assert_int_equal(hs_stop(s), 0);
}

/* ---- a newer program ------------------------------------------------------- */

/* Today's struct with a field a later header appends, and guard bytes. */
#define NEWER(T)                                                                                   \
  struct {                                                                                         \
    T cur;                                                                                         \
    uint64_t later;                                                                                \
    unsigned char guard[32];                                                                       \
  }
#define NEWER_SIZE(T) (sizeof(T) + sizeof(uint64_t))

static int guard_ok(const unsigned char *g, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (g[i] != 0xa5)
      return 0;
  return 1;
}

static void newer_program_fields_are_zeroed_and_refused_if_set(void **state) {
  (void)state;
  /* An init zeroes what it does not know, and stops at the newer size. */
  NEWER(zs_estimate_input) in;
  memset(&in, 0xa5, sizeof in);
  zs_estimate_input_init_sized(&in.cur, NEWER_SIZE(zs_estimate_input));
  assert_int_equal(in.cur.struct_size, NEWER_SIZE(zs_estimate_input));
  assert_int_equal(in.later, 0);
  assert_true(guard_ok(in.guard, sizeof in.guard));
  in.cur.params = 1000;

  /* Rows strided by the newer size: the unknown field zeroed, nothing past
   * the last row touched. */
  const size_t rs = NEWER_SIZE(zs_estimate_row);
  unsigned char rows[ZS_STRATEGY_COUNT * NEWER_SIZE(zs_estimate_row) + 32];
  memset(rows, 0xa5, sizeof rows);
  assert_int_equal(
      zs_estimate_sized(&in.cur, (zs_estimate_row *)(void *)rows, ZS_STRATEGY_COUNT, rs), ZS_OK);
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    zs_estimate_row row;
    uint64_t later;
    memcpy(&row, rows + (size_t)i * rs, sizeof row);
    memcpy(&later, rows + (size_t)i * rs + sizeof row, sizeof later);
    assert_int_equal(row.struct_size, rs);
    assert_int_equal(row.strategy, i);
    assert_int_equal(later, 0);
    if (i == ZS_STRATEGY_DP)
      assert_true(row.state_bytes == 16.0 * 1000);
  }
  assert_true(guard_ok(rows + ZS_STRATEGY_COUNT * rs, 32));

  /* A setting this library cannot honour is refused, not dropped. */
  in.later = 1;
  assert_int_equal(
      zs_estimate_sized(&in.cur, (zs_estimate_row *)(void *)rows, ZS_STRATEGY_COUNT, rs),
      ZS_EUNIMPL);
  assert_non_null(strstr(zs_last_error(), "newer zshard.h"));

  /* The same for the client's options, and for the scaler they point to. */
  NEWER(zs_client_options) o;
  memset(&o, 0xa5, sizeof o);
  zs_client_options_init_sized(&o.cur, NEWER_SIZE(zs_client_options));
  assert_int_equal(o.later, 0);
  assert_true(guard_ok(o.guard, sizeof o.guard));
  o.cur.addresses = "127.0.0.1:1";
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o.cur, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  NEWER(zs_loss_scaler) s;
  memset(&s, 0xa5, sizeof s);
  zs_loss_scaler_init_sized(&s.cur, NEWER_SIZE(zs_loss_scaler));
  o.cur.loss_scaling = ZS_LOSS_SCALE_DYNAMIC;
  o.cur.dynamic_loss_scaler = &s.cur;
  assert_int_equal(zs_client_open(&o.cur, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  s.later = 7;
  assert_int_equal(zs_client_open(&o.cur, &c), ZS_EUNIMPL);
  s.later = 0;
  o.later = 7;
  assert_int_equal(zs_client_open(&o.cur, &c), ZS_EUNIMPL);
  assert_null(c);

  /* Results: zs_last_timing before any step fills zeros up to the newer
   * size and no further; a step result's unknown tail is zeroed by init. */
  o.later = 0;
  assert_int_equal(zs_client_open(&o.cur, &c), ZS_OK);
  NEWER(zs_timing) t;
  memset(&t, 0xa5, sizeof t);
  assert_int_equal(zs_last_timing_sized(c, &t.cur, NEWER_SIZE(zs_timing)), ZS_OK);
  assert_int_equal(t.cur.struct_size, NEWER_SIZE(zs_timing));
  assert_true(t.cur.total_ms == 0 && t.cur.retries == 0 && t.later == 0);
  assert_true(guard_ok(t.guard, sizeof t.guard));
  assert_int_equal(zs_client_close(c), ZS_OK);
  NEWER(zs_step_result) r;
  memset(&r, 0xa5, sizeof r);
  zs_step_result_init_sized(&r.cur, NEWER_SIZE(zs_step_result));
  assert_int_equal(r.later, 0);
  assert_true(guard_ok(r.guard, sizeof r.guard));
}

static void sizes_that_no_struct_has_are_refused(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  in.params = 10;
  zs_estimate_row rows[ZS_STRATEGY_COUNT];
  static const size_t bad[] = {0, 4, sizeof(size_t) + 1, 4096 + sizeof(size_t), SIZE_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    in.struct_size = bad[i];
    assert_int_equal(zs_estimate(&in, rows, ZS_STRATEGY_COUNT), ZS_EINVAL);
    assert_non_null(strstr(zs_last_error(), "zs_estimate_input_init"));
  }
  in.struct_size = sizeof in;
  assert_int_equal(zs_estimate_sized(&in, rows, ZS_STRATEGY_COUNT, 3), ZS_EINVAL);
  /* The smallest struct: struct_size alone, every field a default. */
  zs_loss_scaler s;
  zs_loss_scaler_init_sized(&s, sizeof(size_t));
  assert_int_equal(s.struct_size, sizeof(size_t));
  assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
}

/* ---- the export map -------------------------------------------------------- */

/* Every ZS_EXTERN function of the header is exported by the library, and
 * the library exports no other function. */
static void exports_match_the_header(void **state) {
  (void)state;
  char declared[64][64];
  int nd = 0;
  char line[512];
  /* The public header and the vocabulary it includes. */
  static const char *const headers[] = {"zshard.h", "types.h"};
  for (size_t hi = 0; hi < sizeof headers / sizeof headers[0]; hi++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/include/zshard/%s", ZS_SOURCE_DIR, headers[hi]);
    FILE *h = fopen(path, "r");
    assert_non_null(h);
    while (fgets(line, sizeof line, h)) {
      if (strncmp(line, "ZS_EXTERN ", 10) != 0)
        continue;
      char *paren = strchr(line, '(');
      assert_non_null(paren);
      char *name = paren;
      while (name > line && (name[-1] == '_' || (name[-1] >= 'a' && name[-1] <= 'z')))
        name--;
      assert_true(nd < 64);
      snprintf(declared[nd++], sizeof declared[0], "%.*s", (int)(paren - name), name);
    }
    fclose(h);
  }
  assert_true(nd > 30);

  char cmd[1200];
  snprintf(cmd, sizeof cmd, "nm -D --defined-only '%s'", ZSHARD_SHARED_LIB);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  int found[64] = {0}, unexpected = 0;
  while (fgets(line, sizeof line, p)) {
    char addr[64], type[8], name[400];
    if (sscanf(line, "%63s %7s %399s", addr, type, name) != 3 || strcmp(type, "T") != 0)
      continue;
    char *at = strchr(name, '@'); /* name@@ZSHARD_0 */
    if (at)
      *at = '\0';
    int k = 0;
    while (k < nd && strcmp(declared[k], name) != 0)
      k++;
    if (k == nd) {
      fprintf(stderr, "exported but not in zshard.h: %s\n", name);
      unexpected++;
    } else {
      found[k] = 1;
    }
  }
  assert_int_equal(pclose(p), 0);
  for (int k = 0; k < nd; k++)
    if (!found[k])
      fprintf(stderr, "declared in zshard.h but not exported: %s\n", declared[k]);
  for (int k = 0; k < nd; k++)
    assert_true(found[k]);
  assert_int_equal(unexpected, 0);
}

static int setup(void **state) {
  (void)state;
  return hs_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(old_program_inits_stay_inside_its_structs),
      cmocka_unit_test(old_program_scaler_gets_defaults_for_missing_state),
      cmocka_unit_test(old_program_estimate_rows_are_strided_by_its_size),
      cmocka_unit_test(old_program_trains_a_step_against_a_shard),
      cmocka_unit_test(newer_program_fields_are_zeroed_and_refused_if_set),
      cmocka_unit_test(sizes_that_no_struct_has_are_refused),
      cmocka_unit_test(exports_match_the_header),
  };
  int failures = cmocka_run_group_tests(tests, setup, NULL);
  hs_finish(failures);
  return failures;
}
