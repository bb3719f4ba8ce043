/*
 * test_client_api — libzshard's API contract without a server: options and
 * their defaults, every kind of misuse (NULL, wrong sizes, wrong dtype, calls
 * out of order, use after close) answered with an error and a sentence, the
 * DeepSpeed loss-scaler rules, the `zshard estimate` formulas, and the
 * shared library exporting nothing but zs_* symbols.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "zshard/zshard.h"

/* A client that can be created without any server: channels connect lazily. */
static zs_client *open_client(const char *addresses, uint32_t num_shards) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addresses;
  o.num_shards = num_shards;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_non_null(c);
  return c;
}

/* ---- options ---------------------------------------------------------------- */

static void options_init_fills_documented_defaults(void **state) {
  (void)state;
  zs_client_options o;
  memset(&o, 0xab, sizeof o);
  zs_client_options_init(&o);
  assert_int_equal(o.struct_size, sizeof o);
  assert_null(o.addresses);
  assert_int_equal(o.world_size, 1);
  assert_int_equal(o.grad_accum, 1);
  assert_int_equal(o.rank, 0);
  assert_string_equal(o.job, "zshard");
  assert_int_equal(o.param_dtype, ZS_DTYPE_BF16);
  assert_int_equal(o.push_dtype, 0);
  assert_int_equal(o.pull_dtype, 0);
  assert_int_equal(o.grad_reduce, ZS_REDUCE_MEAN);
  assert_int_equal(o.rpc_timeout_ms, 30000);
  assert_int_equal(o.step_timeout_ms, 60000);
  assert_int_equal(o.max_retries, 20);
  assert_int_equal(o.loss_scaling, ZS_LOSS_SCALE_NONE);
  assert_null(o.dynamic_loss_scaler); /* DeepSpeed's defaults */
  assert_int_equal(o.transport, ZS_TRANSPORT_DEFAULT);
  assert_int_equal(o.data_connections, 0);
}

static void group_options_init_uses_torch_defaults(void **state) {
  (void)state;
  zs_group_options g;
  zs_group_options_init(&g, ZS_OPTIM_ADAMW);
  assert_int_equal(g.struct_size, sizeof g);
  assert_true(g.beta1 == 0.9 && g.beta2 == 0.999 && g.eps == 1e-8);
  assert_true(g.weight_decay == 0.01);
  assert_true(g.lr_scale == 1.0);
  assert_int_equal(g.bias_correction, 1);
  zs_group_options_init(&g, ZS_OPTIM_ADAM);
  assert_true(g.weight_decay == 0.0);
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(g.optimizer, ZS_OPTIM_SGD);
  assert_true(g.momentum == 0.0 && g.dampening == 0.0 && g.weight_decay == 0.0);
}

static void open_rejects_missing_or_uninitialised_options(void **state) {
  (void)state;
  zs_client *c = (zs_client *)0x1;
  assert_int_equal(zs_client_open(NULL, &c), ZS_EINVAL);
  assert_null(c);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  assert_int_equal(zs_client_open(&o, NULL), ZS_EINVAL);
  o.struct_size = 3;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "zs_client_options_init"));
  zs_client_options_init(&o);
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL); /* no addresses */
  assert_non_null(strstr(zs_last_error(), "addresses"));
}

static void open_rejects_inconsistent_topology(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.world_size = 2;
  o.rank = 2;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "rank 2"));
  o.rank = 0;
  o.world_size = 0;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.world_size = 1;
  o.grad_accum = 0;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.grad_accum = 1;
  o.addresses = "127.0.0.1:1,127.0.0.1:2";
  o.num_shards = 3;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "2 addresses"));
  o.addresses = "zshard-{i}.zshard:7070";
  o.num_shards = 0;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "num_shards"));
  o.addresses = "127.0.0.1:1,nohost";
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "'nohost'"));
  o.addresses = "127.0.0.1:1,,127.0.0.1:2";
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
}

static void open_rejects_bad_dtypes_and_scaling(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.param_dtype = ZS_DTYPE_FP32; /* the low copy is 16-bit */
  assert_int_equal(zs_client_open(&o, &c), ZS_EDTYPE);
  o.param_dtype = ZS_DTYPE_FP16;
  o.push_dtype = (zs_dtype)9;
  assert_int_equal(zs_client_open(&o, &c), ZS_EDTYPE);
  o.push_dtype = 0;
  o.loss_scaling = ZS_LOSS_SCALE_STATIC;
  o.static_loss_scale = -1;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.static_loss_scale = INFINITY;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.loss_scaling = (zs_loss_scaling)7;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.loss_scaling = ZS_LOSS_SCALE_DYNAMIC;
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  s.window = 0;
  o.dynamic_loss_scaler = &s;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  s.window = 1000;
  s.struct_size = 0;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "zs_loss_scaler_init"));
  assert_null(c);
}

static void open_checks_the_transport_and_zshard_transport(void **state) {
  (void)state;
  zs_client_options o;
  zs_client *c = NULL;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.transport = (zs_transport)3;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  o.transport = ZS_TRANSPORT_DATA;
  o.data_connections = 65;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  o.data_connections = 64;

  /* The variable decides only when the options leave it to it. */
  assert_int_equal(setenv("ZSHARD_TRANSPORT", "pigeon", 1), 0);
  o.transport = ZS_TRANSPORT_DEFAULT;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "ZSHARD_TRANSPORT"));
  assert_null(c);
  o.transport = ZS_TRANSPORT_GRPC;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(setenv("ZSHARD_TRANSPORT", "grpc", 1), 0);
  o.transport = ZS_TRANSPORT_DEFAULT;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(unsetenv("ZSHARD_TRANSPORT"), 0);

  /* A program built before the transport fields existed passes a shorter
   * struct; it gets the defaults. */
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.struct_size = offsetof(zs_client_options, transport);
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

static void open_accepts_an_address_pattern_and_a_list(void **state) {
  (void)state;
  zs_client *c = open_client("zshard-{i}.zshard:7070", 3);
  assert_int_equal(zs_client_close(c), ZS_OK);
  c = open_client(" 127.0.0.1:7070 , 127.0.0.1:7071", 0);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

/* Shard addresses are read by the one host:port parser (common/net/hostport.h),
 * after an optional gRPC scheme: every form it reads opens, every other is
 * refused with its sentence and the address's index. */
static void open_reads_every_address_form_and_refuses_the_others(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:7070,[::1]:7071,zshard-2.zshard:7072", 0);
  assert_int_equal(zs_client_close(c), ZS_OK);
  c = open_client("dns:///localhost:7070,ipv4:127.0.0.1:7071,ipv6:[::1]:7072", 0);
  assert_int_equal(zs_client_close(c), ZS_OK);
  static const struct {
    const char *addresses, *needle;
  } bad[] = {
      {"127.0.0.1:1,::1:7070", "address 1 ('::1:7070'): IPv6 address"},
      {"127.0.0.1:70000", "address 0 ('127.0.0.1:70000'): port \"70000\""},
      {":7070", "has no host"},
      {"[::1]", "is not [IPv6]:port"},
      {"host:-1", "is not a number 0..65535"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    zs_client_options o;
    zs_client_options_init(&o);
    o.addresses = bad[i].addresses;
    c = NULL;
    assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
    assert_null(c);
    if (!strstr(zs_last_error(), bad[i].needle))
      fail_msg("'%s': \"%s\" lacks \"%s\"", bad[i].addresses, zs_last_error(), bad[i].needle);
  }
}

/* ---- model description ------------------------------------------------------- */

static void add_tensor_checks_name_numel_shape_and_duplicates(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  uint32_t id = 99;
  uint64_t shape[2] = {3, 4};
  assert_int_equal(zs_add_tensor(c, NULL, 4, 0, NULL, 0, &id), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "", 4, 0, NULL, 0, &id), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "w", 0, 0, NULL, 0, &id), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "w", 13, 0, shape, 2, &id), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "shape"));
  assert_int_equal(zs_add_tensor(c, "w", 12, 0, NULL, 2, &id), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "w", 12, 0, shape, 9, &id), ZS_EINVAL);
  assert_int_equal(zs_add_tensor(c, "w", 12, 0, shape, 2, &id), ZS_OK);
  assert_int_equal(id, 0);
  assert_int_equal(zs_add_tensor(c, "w", 12, 0, NULL, 0, &id), ZS_EEXIST);
  assert_int_equal(zs_add_tensor(c, "b", 4, 0, NULL, 0, &id), ZS_OK);
  assert_int_equal(id, 1);
  assert_int_equal(zs_num_tensors(c), 2);
  assert_int_equal(zs_tensor_numel(c, 0), 12);
  assert_int_equal(zs_tensor_numel(c, 7), 0);
  assert_int_equal(zs_find_tensor(c, "b", &id), ZS_OK);
  assert_int_equal(id, 1);
  assert_int_equal(zs_find_tensor(c, "nope", &id), ZS_ENOTFOUND);
  assert_int_equal(zs_find_tensor(c, NULL, &id), ZS_EINVAL);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

static void add_group_checks_options(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  zs_group_options g;
  uint32_t id = 99;
  assert_int_equal(zs_add_group(c, NULL, &id), ZS_EINVAL);
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  g.struct_size = 1;
  assert_int_equal(zs_add_group(c, &g, &id), ZS_EINVAL);
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  g.optimizer = (zs_optimizer)5;
  assert_int_equal(zs_add_group(c, &g, &id), ZS_EINVAL);
  zs_group_options_init(&g, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &g, &id), ZS_OK);
  assert_int_equal(id, 0);
  zs_group_options_init(&g, ZS_OPTIM_ADAMW);
  assert_int_equal(zs_add_group(c, &g, &id), ZS_OK);
  assert_int_equal(id, 1);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

static void open_job_needs_tensors_and_rank0_weights(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  assert_int_equal(zs_open_job(c, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "no tensors"));
  assert_int_equal(zs_add_tensor(c, "w", 8, 0, NULL, 0, NULL), ZS_OK);
  assert_int_equal(zs_open_job(c, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "initial weights"));
  const float *init[1] = {NULL};
  assert_int_equal(zs_open_job(c, init), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "'w'"));
  assert_int_equal(zs_client_close(c), ZS_OK);
}

static void open_job_reports_an_invalid_spec(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  /* Group 3 does not exist: spec validation says so before any traffic. */
  assert_int_equal(zs_add_tensor(c, "w", 8, 3, NULL, 0, NULL), ZS_OK);
  float w[8] = {0};
  const float *init[1] = {w};
  assert_int_equal(zs_open_job(c, init), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "invalid model"));
  assert_int_equal(zs_client_close(c), ZS_OK);
}

/* ---- calls out of order ---------------------------------------------------------- */

static void transfers_and_step_before_open_are_refused(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  assert_int_equal(zs_add_tensor(c, "w", 4, 0, NULL, 0, NULL), ZS_OK);
  float buf[4] = {0};
  zs_request *req = (zs_request *)0x1;
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, sizeof buf, &req), ZS_ENOTOPEN);
  assert_null(req);
  assert_int_equal(zs_pull(c, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL), ZS_ENOTOPEN);
  assert_int_equal(zs_step(c, 0.1, 0, 0, NULL), ZS_ENOTOPEN);
  assert_int_equal(zs_current_step(c), 0);
  assert_int_equal(zs_spec_hash(c), 0);
  zs_step_result r;
  memset(&r, 0, sizeof r);
  assert_int_equal(zs_step(c, 0.1, 0, 0, &r), ZS_EINVAL); /* not initialised */
  zs_step_result_init(&r);
  assert_int_equal(zs_step(c, NAN, 0, 0, &r), ZS_EINVAL);
  assert_int_equal(zs_step(c, 0.1, -1, 0, &r), ZS_EINVAL);
  assert_int_equal(zs_push_cb(c, 0, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL, NULL), ZS_EINVAL);
  assert_int_equal(zs_pull_cb(c, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL, NULL), ZS_EINVAL);
  assert_int_equal(zs_client_close(c), ZS_OK);
}

static void null_handles_are_errors_not_crashes(void **state) {
  (void)state;
  float buf[4] = {0};
  assert_int_equal(zs_client_close(NULL), ZS_OK);
  assert_int_equal(zs_add_tensor(NULL, "w", 4, 0, NULL, 0, NULL), ZS_EINVAL);
  assert_int_equal(zs_add_group(NULL, NULL, NULL), ZS_EINVAL);
  assert_int_equal(zs_open_job(NULL, NULL), ZS_EINVAL);
  assert_int_equal(zs_push(NULL, 0, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL), ZS_EINVAL);
  assert_int_equal(zs_pull(NULL, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL), ZS_EINVAL);
  assert_int_equal(zs_step(NULL, 0.1, 0, 0, NULL), ZS_EINVAL);
  assert_int_equal(zs_wait(NULL), ZS_EINVAL);
  assert_int_equal(zs_test(NULL), ZS_EINVAL);
  assert_int_equal(zs_wait_pushes(NULL), ZS_EINVAL);
  zs_timing t;
  assert_int_equal(zs_last_timing(NULL, &t), ZS_EINVAL);
  assert_int_equal(zs_num_tensors(NULL), 0);
  assert_int_equal(zs_tensor_numel(NULL, 0), 0);
  assert_true(zs_loss_scale(NULL) == 1.0);
}

static void use_after_close_returns_eclosed(void **state) {
  (void)state;
  zs_client *c = open_client("127.0.0.1:1", 0);
  assert_int_equal(zs_client_close(c), ZS_OK);
  /* The handle is dangling now; the library's registry of live clients makes
   * every call on it an error. */
  float buf[4] = {0};
  assert_int_equal(zs_add_tensor(c, "w", 4, 0, NULL, 0, NULL), ZS_ECLOSED);
  assert_non_null(strstr(zs_last_error(), "closed"));
  assert_int_equal(zs_open_job(c, NULL), ZS_ECLOSED);
  assert_int_equal(zs_push(c, 0, 0, buf, ZS_DTYPE_FP32, sizeof buf, NULL), ZS_ECLOSED);
  assert_int_equal(zs_step(c, 0.1, 0, 0, NULL), ZS_ECLOSED);
  assert_int_equal(zs_client_close(c), ZS_ECLOSED);
}

static void *fail_on_another_thread(void *arg) {
  (void)arg;
  zs_test(NULL);
  return NULL;
}

static void last_error_is_per_thread_and_kept_by_success(void **state) {
  (void)state;
  assert_int_equal(zs_client_close((zs_client *)&state), ZS_ECLOSED);
  char mine[512];
  snprintf(mine, sizeof mine, "%s", zs_last_error());
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, fail_on_another_thread, NULL), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_string_equal(zs_last_error(), mine);
  assert_int_equal(zs_wait(NULL), ZS_EINVAL);
  assert_string_equal(zs_last_error(), "zs_wait: the request is NULL");
  zs_client *c = open_client("127.0.0.1:1", 0);
  assert_string_equal(zs_last_error(), "zs_wait: the request is NULL");
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_string_equal(zs_strerror(ZS_ECLOSED), "closed or shutting down");
  assert_string_equal(zs_err_name(ZS_ETIMEDOUT), "ZS_ETIMEDOUT");
}

/* ---- loss scaler -------------------------------------------------------------- */

static void loss_scaler_defaults_are_deepspeeds(void **state) {
  (void)state;
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  assert_true(s.scale == 65536.0);
  assert_int_equal(s.window, 1000);
  assert_int_equal(s.hysteresis, 2);
  assert_true(s.min_scale == 1.0);
  assert_true(s.factor == 2.0);
}

static void loss_scaler_first_overflow_uses_hysteresis_second_halves(void **state) {
  (void)state;
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
  assert_true(s.scale == 65536.0); /* hysteresis 2: one overflow is absorbed */
  assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
  assert_true(s.scale == 32768.0);
  assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
  assert_true(s.scale == 16384.0); /* hysteresis stays exhausted */
}

static void loss_scaler_grows_after_a_clean_window(void **state) {
  (void)state;
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  s.window = 4;
  for (int i = 0; i < 3; i++) {
    assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_OK);
    assert_true(s.scale == 65536.0);
  }
  assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_OK); /* the 4th clean iteration */
  assert_true(s.scale == 131072.0);
  /* After an overflow at iteration 4 (absorbed by hysteresis), growth waits a
   * full window counted from it. */
  assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
  assert_true(s.scale == 131072.0);
  for (int i = 0; i < 3; i++)
    assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_OK);
  assert_true(s.scale == 131072.0);
  assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_OK);
  assert_true(s.scale == 262144.0);
  assert_int_equal(s.cur_hysteresis, 2); /* restored with the growth */
}

static void loss_scaler_never_goes_below_min(void **state) {
  (void)state;
  zs_loss_scaler s;
  zs_loss_scaler_init(&s);
  s.scale = 4.0;
  s.hysteresis = 1;
  s.cur_hysteresis = 1;
  for (int i = 0; i < 5; i++)
    assert_int_equal(zs_loss_scaler_update(&s, 1), ZS_OK);
  assert_true(s.scale == 1.0);
}

static void loss_scaler_rejects_garbage(void **state) {
  (void)state;
  zs_loss_scaler s;
  assert_int_equal(zs_loss_scaler_update(NULL, 0), ZS_EINVAL);
  memset(&s, 0, sizeof s);
  assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_EINVAL);
  zs_loss_scaler_init(&s);
  s.window = 0;
  assert_int_equal(zs_loss_scaler_update(&s, 0), ZS_EINVAL);
}

/* ---- estimate -------------------------------------------------------------------- */

static void estimate_matches_the_documented_formulas(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  in.params = 1000000000ull; /* 1e9 */
  in.largest_layer = 50000000ull;
  in.trainers = 8;
  in.shards = 8;
  in.trainer_gbps = 100;
  zs_estimate_row r[ZS_STRATEGY_COUNT];
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  const double P = 1e9, L = 5e7, W = 8, B = 100e9 / 8;
  /* bf16 everywhere: the ZeRO paper's 16 bytes per parameter for DP. */
  assert_string_equal(r[ZS_STRATEGY_DP].name, "dp");
  assert_true(r[ZS_STRATEGY_DP].device_bytes == 16 * P);
  assert_true(r[ZS_STRATEGY_ZERO1].device_bytes == 4 * P + 12 * P / W);
  assert_true(r[ZS_STRATEGY_ZERO2].device_bytes == 2 * P + 14 * P / W);
  assert_true(r[ZS_STRATEGY_ZERO3].device_bytes == 16 * P / W + 6 * L);
  assert_true(r[ZS_STRATEGY_ZERO3].state_bytes == 16 * P / W);
  assert_true(r[ZS_STRATEGY_ZERO3].working_bytes == 6 * L);
  assert_true(r[ZS_STRATEGY_DP].working_bytes == 0);
  assert_true(r[ZS_STRATEGY_ZSHARD].device_bytes == 6 * L);
  assert_true(r[ZS_STRATEGY_ZSHARD].state_bytes == 0);
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++)
    assert_int_equal(r[i].struct_size, sizeof r[i]);
  assert_true(r[ZS_STRATEGY_ZSHARD].shard_bytes == 18 * P / 8);
  assert_true(r[ZS_STRATEGY_DP].shard_bytes == 0);
  /* Wire: 2*2P(W-1)/W for DP's ring all-reduce, 3*2P(W-1)/W for ZeRO-3,
   * 2P each way for zshard (DESIGN.md). */
  assert_true(fabs(r[ZS_STRATEGY_DP].sent_bytes - 4 * P * 7 / 8) < 1);
  assert_true(fabs(r[ZS_STRATEGY_ZERO1].sent_bytes - 4 * P * 7 / 8) < 1);
  assert_true(fabs(r[ZS_STRATEGY_ZERO3].sent_bytes - 6 * P * 7 / 8) < 1);
  assert_true(r[ZS_STRATEGY_ZSHARD].sent_bytes == 2 * P);
  assert_true(r[ZS_STRATEGY_ZSHARD].received_bytes == 2 * P);
  assert_true(r[ZS_STRATEGY_ZSHARD].shard_wire_bytes == W * 2 * P / 8);
  assert_true(fabs(r[ZS_STRATEGY_DP].comm_seconds - 4 * P * 7 / 8 / B) < 1e-9);
  /* With N = W and equal links the trainer NIC bounds zshard: 2P/B. */
  assert_true(fabs(r[ZS_STRATEGY_ZSHARD].comm_seconds - 2 * P / B) < 1e-9);
}

static void estimate_counts_slow_shards_and_backward_pulls(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  in.params = 1000;
  in.trainers = 4;
  in.shards = 2;
  in.grad_dtype = ZS_DTYPE_FP32;
  in.param_dtype = ZS_DTYPE_FP16;
  in.pull_in_backward = 1;
  in.trainer_gbps = 8; /* 1e9 bytes/s */
  in.shard_gbps = 0.8; /* 1e8 bytes/s */
  zs_estimate_row r[ZS_STRATEGY_COUNT];
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  const zs_estimate_row *z = &r[ZS_STRATEGY_ZSHARD];
  assert_true(z->sent_bytes == 4000);
  assert_true(z->received_bytes == 4000);             /* 2 pulls of 2 bytes */
  assert_true(z->shard_wire_bytes == 4 * 4000.0 / 2); /* in: W*4P/N, out: W*2*2P/N */
  assert_true(fabs(z->comm_seconds - 8000.0 / 1e8) < 1e-12);
  /* largest_layer 0: working memory is not known, and not guessed. */
  assert_true(z->working_bytes == 0 && z->device_bytes == 0);
  assert_true(r[ZS_STRATEGY_ZERO3].working_bytes == 0);
  in.largest_layer = 100;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(z->working_bytes == (2 * 2 + 4) * 100.0);
  in.largest_layer = 0;
  /* One trainer: no collective traffic at all for the DP family. */
  in.trainers = 1;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(r[ZS_STRATEGY_DP].sent_bytes == 0 && r[ZS_STRATEGY_ZERO3].comm_seconds == 0);
}

/* Per link, W = 4 trainers and N = 2 shards at 8 Gbit/s (10^9 bytes/s, so
 * that a byte takes a nanosecond), 1000 parameters in bf16: each trainer
 * sends and receives 2000 bytes; each shard receives 4 x 2000 / 2 = 4000 and
 * sends as much (incast: the shards' links bound both phases, 4 us each);
 * the gated step is their sum, the overlapped one either; a ring
 * all-reduce moves 2 x 2000 x 3/4 = 3000 bytes each way in 3 us. With N = W
 * the trainers' links bound zshard: 2 us a phase, 4 us gated, 2 us
 * overlapped, 1.5 times faster than the ring, and the gated step 0.75 times. */
static void estimate_gives_each_links_bytes_and_time(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  in.params = 1000;
  in.trainers = 4;
  in.shards = 2;
  in.trainer_gbps = in.shard_gbps = 8;
  zs_estimate_row r[ZS_STRATEGY_COUNT];
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  const zs_estimate_row *z = &r[ZS_STRATEGY_ZSHARD], *ring = &r[ZS_STRATEGY_DP];
  assert_true(z->sent_bytes == 2000 && z->received_bytes == 2000);
  assert_true(z->shard_received_bytes == 4000 && z->shard_sent_bytes == 4000);
  assert_true(z->push_seconds == 4000 / 1e9 && z->pull_seconds == 4000 / 1e9);
  assert_true(z->gated_seconds == 8000 / 1e9 && z->comm_seconds == 4000 / 1e9);
  assert_true(ring->sent_bytes == 3000 && ring->received_bytes == 3000);
  assert_true(ring->comm_seconds == 3000 / 1e9 && ring->gated_seconds == ring->comm_seconds);
  assert_true(ring->push_seconds == 0 && ring->shard_sent_bytes == 0);
  in.shards = 4;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(z->shard_received_bytes == 2000 && z->shard_sent_bytes == 2000);
  assert_true(z->push_seconds == 2000 / 1e9 && z->pull_seconds == 2000 / 1e9);
  assert_true(z->gated_seconds == 4000 / 1e9 && z->comm_seconds == 2000 / 1e9);
  assert_true(ring->comm_seconds / z->comm_seconds == 1.5);
  assert_true(ring->comm_seconds / z->gated_seconds == 0.75);
  /* A slower shard link bounds only the phases it carries. */
  in.shard_gbps = 4;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(z->push_seconds == 4000 / 1e9 && z->gated_seconds == 8000 / 1e9);
  assert_true(ring->comm_seconds == 3000 / 1e9);
}

/* The ZeRO paper (Rajbhandari et al. 2020, figure 1): model states per device
 * for a 7.5B-parameter model on 64 devices with mixed-precision Adam (K = 12):
 * 120 GB baseline, 31.4 GB with Pos, 16.6 GB with Pos+g, 1.88 GB with
 * Pos+g+p. Working memory is a separate column and does not change them. */
static void estimate_reproduces_the_zero_papers_model_states(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  in.params = 7500000000ull;
  in.trainers = 64;
  in.grad_dtype = in.param_dtype = ZS_DTYPE_FP16;
  zs_estimate_row r[ZS_STRATEGY_COUNT];
  for (int pass = 0; pass < 2; pass++) {
    assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
    assert_true(fabs(r[ZS_STRATEGY_DP].state_bytes / 1e9 - 120.0) < 0.05);
    assert_true(fabs(r[ZS_STRATEGY_ZERO1].state_bytes / 1e9 - 31.4) < 0.05);
    assert_true(fabs(r[ZS_STRATEGY_ZERO2].state_bytes / 1e9 - 16.6) < 0.05);
    assert_true(fabs(r[ZS_STRATEGY_ZERO3].state_bytes / 1e9 - 1.875) < 0.005);
    /* ZeRO-3 keeps less than ZeRO-1 whatever its working memory adds for
     * a layer of a realistic size (here 1/32 of the model). */
    assert_true(r[ZS_STRATEGY_ZERO3].device_bytes < r[ZS_STRATEGY_ZERO1].device_bytes);
    in.largest_layer = in.params / 32;
  }
  assert_true(r[ZS_STRATEGY_ZERO3].working_bytes == 6.0 * (double)in.largest_layer);
  /* K is an input: plain fp32 SGD with momentum keeps 8 bytes. */
  in.optimizer_bytes = 8;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_OK);
  assert_true(r[ZS_STRATEGY_DP].state_bytes == 12.0 * 7.5e9);
}

static void estimate_rejects_bad_input(void **state) {
  (void)state;
  zs_estimate_input in;
  zs_estimate_row r[ZS_STRATEGY_COUNT];
  zs_estimate_input_init(&in);
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_EINVAL); /* params 0 */
  in.params = 10;
  assert_int_equal(zs_estimate(&in, r, 2), ZS_EINVAL);
  assert_int_equal(zs_estimate(NULL, r, ZS_STRATEGY_COUNT), ZS_EINVAL);
  in.largest_layer = 11;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_EINVAL);
  in.largest_layer = 0;
  in.grad_dtype = (zs_dtype)0;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_EDTYPE);
  in.grad_dtype = ZS_DTYPE_BF16;
  in.trainer_gbps = 0;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_EINVAL);
  in.trainer_gbps = 1;
  in.struct_size = 0;
  assert_int_equal(zs_estimate(&in, r, ZS_STRATEGY_COUNT), ZS_EINVAL);
}

/* ---- the shared library -------------------------------------------------------- */

static void shared_library_exports_only_zs_symbols(void **state) {
  (void)state;
#ifdef ZSHARD_SHARED_LIB
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "nm -D --defined-only '%s'", ZSHARD_SHARED_LIB);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  char line[512];
  int zs = 0, others = 0;
  while (fgets(line, sizeof line, p)) {
    char addr[64], type[8], name[400];
    if (sscanf(line, "%63s %7s %399s", addr, type, name) != 3)
      continue;
    /* The version node itself is an absolute symbol. */
    if (strcmp(name, "ZSHARD_0") == 0)
      continue;
    if (strncmp(name, "zs_", 3) == 0)
      zs++;
    else {
      fprintf(stderr, "unexpected export: %s", line);
      others++;
    }
  }
  assert_int_equal(pclose(p), 0);
  assert_int_equal(others, 0);
  assert_true(zs > 30);
#else
  skip();
#endif
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(options_init_fills_documented_defaults),
      cmocka_unit_test(group_options_init_uses_torch_defaults),
      cmocka_unit_test(open_rejects_missing_or_uninitialised_options),
      cmocka_unit_test(open_rejects_inconsistent_topology),
      cmocka_unit_test(open_rejects_bad_dtypes_and_scaling),
      cmocka_unit_test(open_checks_the_transport_and_zshard_transport),
      cmocka_unit_test(open_accepts_an_address_pattern_and_a_list),
      cmocka_unit_test(open_reads_every_address_form_and_refuses_the_others),
      cmocka_unit_test(add_tensor_checks_name_numel_shape_and_duplicates),
      cmocka_unit_test(add_group_checks_options),
      cmocka_unit_test(open_job_needs_tensors_and_rank0_weights),
      cmocka_unit_test(open_job_reports_an_invalid_spec),
      cmocka_unit_test(transfers_and_step_before_open_are_refused),
      cmocka_unit_test(null_handles_are_errors_not_crashes),
      cmocka_unit_test(use_after_close_returns_eclosed),
      cmocka_unit_test(last_error_is_per_thread_and_kept_by_success),
      cmocka_unit_test(loss_scaler_defaults_are_deepspeeds),
      cmocka_unit_test(loss_scaler_first_overflow_uses_hysteresis_second_halves),
      cmocka_unit_test(loss_scaler_grows_after_a_clean_window),
      cmocka_unit_test(loss_scaler_never_goes_below_min),
      cmocka_unit_test(loss_scaler_rejects_garbage),
      cmocka_unit_test(estimate_matches_the_documented_formulas),
      cmocka_unit_test(estimate_counts_slow_shards_and_backward_pulls),
      cmocka_unit_test(estimate_gives_each_links_bytes_and_time),
      cmocka_unit_test(estimate_reproduces_the_zero_papers_model_states),
      cmocka_unit_test(estimate_rejects_bad_input),
      cmocka_unit_test(shared_library_exports_only_zs_symbols),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
