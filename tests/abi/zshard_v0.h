/*
 * zshard_v0.h — zshard.h as a program built against an older libzshard saw
 * it: the same functions, and structs that are strict prefixes of today's
 * (every struct lacks fields appended since). tests/abi/test_abi.c checks the
 * prefix property field by field against the real header, so this file
 * cannot drift from it unnoticed; old_program.c is the older program.
 *
 * With ZSV0_LAYOUT_ONLY defined (after including the real header, and with
 * the struct names #defined to other names) only the structs are declared,
 * for that check.
 */
#ifndef ZSHARD_TESTS_ZSHARD_V0_H
#define ZSHARD_TESTS_ZSHARD_V0_H

#include <stddef.h>
#include <stdint.h>

#ifndef ZSV0_LAYOUT_ONLY
typedef enum zs_status { ZS_OK = 0, ZS_EINVAL = -1, ZS_EUNIMPL = -19 } zs_status;
typedef enum zs_dtype { ZS_DTYPE_FP32 = 1, ZS_DTYPE_FP16 = 2, ZS_DTYPE_BF16 = 3 } zs_dtype;
typedef enum zs_optimizer { ZS_OPTIM_ADAMW = 0, ZS_OPTIM_ADAM = 1, ZS_OPTIM_SGD = 2 } zs_optimizer;
typedef enum zs_grad_reduce { ZS_REDUCE_MEAN = 0, ZS_REDUCE_SUM = 1 } zs_grad_reduce;
typedef enum zs_loss_scaling {
  ZS_LOSS_SCALE_NONE = 0,
  ZS_LOSS_SCALE_STATIC = 1,
  ZS_LOSS_SCALE_DYNAMIC = 2,
} zs_loss_scaling;
typedef enum zs_strategy {
  ZS_STRATEGY_DP = 0,
  ZS_STRATEGY_ZERO1 = 1,
  ZS_STRATEGY_ZERO2 = 2,
  ZS_STRATEGY_ZERO3 = 3,
  ZS_STRATEGY_ZSHARD = 4,
  ZS_STRATEGY_COUNT = 5
} zs_strategy;
typedef struct zs_client zs_client;
typedef struct zs_request zs_request;
#endif

/* No last_overflow_iter yet. */
typedef struct zs_loss_scaler {
  size_t struct_size;
  double scale;
  double min_scale;
  double factor;
  uint32_t window;
  uint32_t hysteresis;
  uint32_t cur_hysteresis;
  int64_t iter;
} zs_loss_scaler;

/* No transport, data_connections, checkpoint_every, checkpoint_timeout_ms. */
typedef struct zs_client_options {
  size_t struct_size;
  const char *addresses;
  uint32_t num_shards;
  uint32_t rank;
  uint32_t world_size;
  uint32_t grad_accum;
  const char *job;
  zs_grad_reduce grad_reduce;
  zs_dtype param_dtype;
  uint64_t split_threshold;
  zs_dtype push_dtype;
  zs_dtype pull_dtype;
  uint32_t threads;
  size_t reduce_bucket_size;
  size_t allgather_bucket_size;
  uint32_t prefetch_depth;
  uint32_t rpc_timeout_ms;
  uint32_t step_timeout_ms;
  uint32_t max_retries;
  uint32_t retry_initial_ms;
  uint32_t retry_max_ms;
  zs_loss_scaling loss_scaling;
  double static_loss_scale;
  const zs_loss_scaler *dynamic_loss_scaler;
} zs_client_options;

/* No nesterov, bias_correction. */
typedef struct zs_group_options {
  size_t struct_size;
  zs_optimizer optimizer;
  double lr_scale;
  double beta1, beta2, eps;
  double weight_decay;
  double momentum, dampening;
} zs_group_options;

/* No bytes_pushed, bytes_pulled, retries. */
typedef struct zs_timing {
  size_t struct_size;
  double total_ms, compute_ms, push_ms, pull_wait_ms, step_ms;
} zs_timing;

/* No coef, loss_scale, next_loss_scale. */
typedef struct zs_step_result {
  size_t struct_size;
  uint64_t step;
  uint64_t version;
  int applied;
  int overflow;
  double grad_norm;
  double clip_coef;
} zs_step_result;

/* No pull_in_backward, optimizer_bytes. */
typedef struct zs_estimate_input {
  size_t struct_size;
  uint64_t params;
  uint64_t largest_layer;
  uint32_t trainers;
  uint32_t shards;
  zs_dtype grad_dtype;
  zs_dtype param_dtype;
  double trainer_gbps;
  double shard_gbps;
} zs_estimate_input;

/* Only the memory on each trainer, no breakdown, no traffic. */
typedef struct zs_estimate_row {
  size_t struct_size;
  zs_strategy strategy;
  const char *name;
  double device_bytes;
} zs_estimate_row;

#ifndef ZSV0_LAYOUT_ONLY
const char *zs_last_error(void);

void zs_loss_scaler_init_sized(zs_loss_scaler *s, size_t size);
#define zs_loss_scaler_init(s) zs_loss_scaler_init_sized((s), sizeof *(s))
int zs_loss_scaler_update(zs_loss_scaler *s, int overflow);

void zs_client_options_init_sized(zs_client_options *o, size_t size);
#define zs_client_options_init(o) zs_client_options_init_sized((o), sizeof *(o))
int zs_client_open(const zs_client_options *o, zs_client **out);
int zs_client_close(zs_client *c);

void zs_group_options_init_sized(zs_group_options *g, zs_optimizer optimizer, size_t size);
#define zs_group_options_init(g, optimizer)                                                        \
  zs_group_options_init_sized((g), (optimizer), sizeof *(g))
int zs_add_group(zs_client *c, const zs_group_options *g, uint32_t *id);
int zs_add_tensor(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                  const uint64_t *shape, uint32_t ndim, uint32_t *id);
int zs_open_job(zs_client *c, const float *const *init_weights);
int zs_push(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad, zs_dtype dtype,
            size_t nbytes, zs_request **req);
int zs_pull(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
            zs_request **req);

void zs_step_result_init_sized(zs_step_result *r, size_t size);
#define zs_step_result_init(r) zs_step_result_init_sized((r), sizeof *(r))
int zs_step(zs_client *c, double lr, double max_grad_norm, double loss_scale, zs_step_result *out);
int zs_last_timing_sized(const zs_client *c, zs_timing *out, size_t size);
#define zs_last_timing(c, out) zs_last_timing_sized((c), (out), sizeof *(out))

void zs_estimate_input_init_sized(zs_estimate_input *in, size_t size);
#define zs_estimate_input_init(in) zs_estimate_input_init_sized((in), sizeof *(in))
int zs_estimate_sized(const zs_estimate_input *in, zs_estimate_row *rows, size_t nrows,
                      size_t row_size);
#define zs_estimate(in, rows, nrows) zs_estimate_sized((in), (rows), (nrows), sizeof *(rows))
#endif

#endif
