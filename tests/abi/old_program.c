/*
 * old_program — see old_program.h. Compiled against zshard_v0.h only: this
 * file must not see today's header, exactly like a program built before it.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "old_program.h"
#include "zshard_v0.h"

/* A struct of type T in a buffer of 0xa5 bytes with OLD_GUARD of them after
 * it; guard_ok checks they are all still there. */
#define GUARDED(T, name)                                                                           \
  unsigned char name##_buf[sizeof(T) + OLD_GUARD];                                                 \
  memset(name##_buf, 0xa5, sizeof name##_buf);                                                     \
  T *name = (T *)(void *)name##_buf

static int guard_ok(const void *buf, size_t size) {
  const unsigned char *g = (const unsigned char *)buf + size;
  for (size_t i = 0; i < OLD_GUARD; i++)
    if (g[i] != 0xa5)
      return 0;
  return 1;
}

void old_inits_stay_inside_the_old_structs(void) {
  GUARDED(zs_client_options, o);
  zs_client_options_init(o);
  assert_true(guard_ok(o, sizeof *o));
  assert_int_equal(o->struct_size, sizeof *o);
  assert_int_equal(o->world_size, 1);
  assert_true(o->static_loss_scale == 1.0);
  assert_null(o->dynamic_loss_scaler);

  GUARDED(zs_group_options, g);
  zs_group_options_init(g, ZS_OPTIM_ADAMW);
  assert_true(guard_ok(g, sizeof *g));
  assert_int_equal(g->struct_size, sizeof *g);
  assert_true(g->beta2 == 0.999 && g->weight_decay == 0.01 && g->dampening == 0);

  GUARDED(zs_loss_scaler, s);
  zs_loss_scaler_init(s);
  assert_true(guard_ok(s, sizeof *s));
  assert_true(s->scale == 65536.0 && s->iter == 0);

  GUARDED(zs_step_result, r);
  zs_step_result_init(r);
  assert_true(guard_ok(r, sizeof *r));
  assert_int_equal(r->struct_size, sizeof *r);
  assert_int_equal(r->step, 0);

  GUARDED(zs_estimate_input, in);
  zs_estimate_input_init(in);
  assert_true(guard_ok(in, sizeof *in));
  assert_int_equal(in->trainers, 1);
  assert_true(in->trainer_gbps == 100.0);
}

void old_scaler_state_it_lacks_takes_defaults(void) {
  GUARDED(zs_loss_scaler, s);
  zs_loss_scaler_init(s);
  s->window = 4;
  /* last_overflow_iter is not in this struct: the library takes its default
   * (-1, no overflow yet) on every call, so the scale grows after 4 clean
   * iterations as it does for a new caller. A garbage value would move it. */
  for (int i = 0; i < 3; i++) {
    assert_int_equal(zs_loss_scaler_update(s, 0), ZS_OK);
    assert_true(s->scale == 65536.0);
  }
  assert_int_equal(zs_loss_scaler_update(s, 0), ZS_OK);
  assert_true(s->scale == 131072.0);
  assert_int_equal(s->iter, 4);
  assert_int_equal(s->struct_size, sizeof *s);
  assert_true(guard_ok(s, sizeof *s));
}

void old_estimate_input_and_rows(void) {
  GUARDED(zs_estimate_input, in);
  zs_estimate_input_init(in);
  in->params = 1000;
  in->trainers = 4;
  in->shards = 2;
  /* The rows, each of the old size, then the guard. */
  unsigned char buf[ZS_STRATEGY_COUNT * sizeof(zs_estimate_row) + OLD_GUARD];
  memset(buf, 0xa5, sizeof buf);
  zs_estimate_row *rows = (zs_estimate_row *)(void *)buf;
  assert_int_equal(zs_estimate(in, rows, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(guard_ok(buf, ZS_STRATEGY_COUNT * sizeof *rows));
  static const char *const names[] = {"dp", "zero1", "zero2", "zero3", "zshard"};
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    assert_int_equal(rows[i].struct_size, sizeof rows[i]);
    assert_int_equal(rows[i].strategy, i);
    assert_string_equal(rows[i].name, names[i]);
  }
  /* optimizer_bytes, which the old input lacks, defaults to K = 12: the
   * ZeRO paper's 16 bytes per parameter for DP with bf16. */
  assert_true(rows[ZS_STRATEGY_DP].device_bytes == 16.0 * 1000);
  assert_true(rows[ZS_STRATEGY_ZERO3].device_bytes == 16.0 * 1000 / 4);
}

void old_trainer_steps(const char *addr) {
  GUARDED(zs_client_options, o);
  zs_client_options_init(o);
  o->addresses = addr;
  o->job = "abi-v0";
  o->param_dtype = ZS_DTYPE_BF16;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(o, &c), ZS_OK);

  /* Adam without bias_correction in the struct: the library's default for
   * Adam is 1, which makes the first step move each weight by about lr (with
   * bias_correction 0 it would be lr * 0.1 / sqrt(0.001), about 3.2 lr). */
  GUARDED(zs_group_options, g);
  zs_group_options_init(g, ZS_OPTIM_ADAM);
  assert_int_equal(zs_add_group(c, g, NULL), ZS_OK);
  enum { N = 8 };
  float w[N], grad[N];
  for (int i = 0; i < N; i++)
    w[i] = 1.0f, grad[i] = 0.5f;
  assert_int_equal(zs_add_tensor(c, "w", N, 0, NULL, 0, NULL), ZS_OK);
  const float *init[1] = {w};
  assert_int_equal(zs_open_job(c, init), ZS_OK);
  assert_int_equal(zs_push(c, 0, 0, grad, ZS_DTYPE_FP32, sizeof grad, NULL), ZS_OK);

  GUARDED(zs_step_result, r);
  zs_step_result_init(r);
  assert_int_equal(zs_step(c, 0.1, 0, 0, r), ZS_OK);
  assert_true(guard_ok(r, sizeof *r));
  assert_int_equal(r->struct_size, sizeof *r);
  assert_int_equal(r->step, 1);
  assert_int_equal(r->version, 1);
  assert_int_equal(r->applied, 1);
  assert_true(fabs(r->grad_norm - sqrt(N * 0.25)) < 1e-6);
  assert_true(r->clip_coef == 1.0);

  GUARDED(zs_timing, t);
  assert_int_equal(zs_last_timing(c, t), ZS_OK);
  assert_true(guard_ok(t, sizeof *t));
  assert_int_equal(t->struct_size, sizeof *t);
  assert_true(t->total_ms >= t->step_ms && t->step_ms >= 0);

  float got[N];
  assert_int_equal(zs_pull(c, 0, got, ZS_DTYPE_FP32, sizeof got, NULL), ZS_OK);
  for (int i = 0; i < N; i++)
    assert_true(fabs(got[i] - 0.9) < 0.01); /* bf16 copy of 1 - 0.1 */
  assert_int_equal(zs_client_close(c), ZS_OK);
}
