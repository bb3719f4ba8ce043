/*
 * test_spec — the model spec (common/model/spec.h): torch's defaults, validation of
 * every field with a readable reason, the canonical hash (sensitive to every
 * field, stable across copies, proto round trips and machines) and the proto
 * conversion.
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

#include "common/model/spec.h"
#include "common/model/spec_optim.h"
#include "zshard/v1/zshard.pb-c.h"

/* ------------------------------------------------------------------------ */
/* A valid spec to start from                                                */
/* ------------------------------------------------------------------------ */

/* Three groups (AdamW defaults, Adam with weight decay, SGD with nesterov
 * momentum) and four tensors, the fourth named "fc1.weight" in group 2. */
static void make_spec(spec *s) {
  memset(s, 0, sizeof *s);
  s->job = strdup("test-job");
  s->world_size = 4;
  s->grad_accum = 2;
  s->num_shards = 3;
  s->split_threshold = 1000;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  s->num_groups = 3;
  s->groups = calloc(3, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s->groups[1], ZS_OPTIM_ADAM);
  s->groups[1].weight_decay = 1e-4;
  spec_group_defaults(&s->groups[2], ZS_OPTIM_SGD);
  s->groups[2].momentum = 0.9;
  s->groups[2].nesterov = 1;
  s->groups[2].lr_scale = 0.5;
  s->num_tensors = 4;
  s->tensors = calloc(4, sizeof *s->tensors);
  assert_non_null(s->tensors);
  const char *names[] = {"embed.weight", "fc0.bias", "norm.weight", "fc1.weight"};
  const uint64_t numel[] = {50000, 64, 64, 4096};
  const uint32_t group[] = {0, 1, 1, 2};
  for (int i = 0; i < 4; i++) {
    s->tensors[i].name = strdup(names[i]);
    s->tensors[i].numel = numel[i];
    s->tensors[i].group = group[i];
  }
  s->tensors[0].ndim = 2;
  s->tensors[0].shape[0] = 1000;
  s->tensors[0].shape[1] = 50;
  s->tensors[3].ndim = 2;
  s->tensors[3].shape[0] = 64;
  s->tensors[3].shape[1] = 64;
  char err[256];
  if (spec_validate(s, err, sizeof err) != 0)
    fail_msg("the base spec is invalid: %s", err);
}

static void set_name(char **slot, const char *name) {
  free(*slot);
  *slot = name ? strdup(name) : NULL;
}

/* ------------------------------------------------------------------------ */
/* Defaults                                                                  */
/* ------------------------------------------------------------------------ */

static void defaults_match_torch(void **state) {
  (void)state;
  /* torch 1.13: AdamW(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01),
   * Adam(... weight_decay=0), SGD(momentum=0, dampening=0, weight_decay=0,
   * nesterov=False). */
  spec_group g;
  spec_group_defaults(&g, ZS_OPTIM_ADAMW);
  assert_int_equal(g.optimizer, ZS_OPTIM_ADAMW);
  assert_true(g.lr_scale == 1.0 && g.beta1 == 0.9 && g.beta2 == 0.999 && g.eps == 1e-8);
  assert_true(g.weight_decay == 0.01 && g.momentum == 0 && g.dampening == 0);
  assert_int_equal(g.nesterov, 0);
  assert_int_equal(g.bias_correction, 1);
  spec_group_defaults(&g, ZS_OPTIM_ADAM);
  assert_int_equal(g.optimizer, ZS_OPTIM_ADAM);
  assert_true(g.lr_scale == 1.0 && g.beta1 == 0.9 && g.beta2 == 0.999 && g.eps == 1e-8);
  assert_true(g.weight_decay == 0.0);
  assert_int_equal(g.bias_correction, 1);
  spec_group_defaults(&g, ZS_OPTIM_SGD);
  assert_int_equal(g.optimizer, ZS_OPTIM_SGD);
  assert_true(g.lr_scale == 1.0 && g.momentum == 0 && g.dampening == 0 && g.weight_decay == 0);
  assert_int_equal(g.nesterov, 0);
  /* Lion, which torch 1.13 lacks: the paper's betas=(0.9, 0.99), no decay. */
  spec_group_defaults(&g, ZS_OPTIM_LION);
  assert_int_equal(g.optimizer, ZS_OPTIM_LION);
  assert_true(g.lr_scale == 1.0 && g.beta1 == 0.9 && g.beta2 == 0.99 && g.weight_decay == 0);
  /* Every optimizer the table lists is findable by its id and its name. */
  size_t n = 0;
  for (const spec_optim *o; (o = spec_optim_at(n)); n++) {
    assert_ptr_equal(spec_optim_of(o->id), o);
    assert_ptr_equal(spec_optim_named(o->name), o);
  }
  assert_int_equal(n, 4);
  assert_null(spec_optim_of((zs_optimizer)4));
  assert_null(spec_optim_named("adagrad"));
}

static void validation_fills_default_split_threshold(void **state) {
  (void)state;
  spec s;
  make_spec(&s);
  assert_int_equal(s.split_threshold, 1000);
  s.split_threshold = 0;
  assert_int_equal(spec_validate(&s, NULL, 0), 0);
  assert_int_equal(s.split_threshold, SPEC_DEFAULT_SPLIT_THRESHOLD);
  spec_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Validation                                                                */
/* ------------------------------------------------------------------------ */

typedef struct bad_case {
  const char *what; /* the test case, for the failure message */
  void (*mutate)(spec *s);
  const char *expect; /* a substring the error sentence must hold */
} bad_case;

#define MUT(fn, body)                                                                              \
  static void fn(spec *s) {                                                                        \
    body;                                                                                          \
  }

MUT(m_job_empty, set_name(&s->job, ""))
MUT(m_job_null, set_name(&s->job, NULL))
MUT(m_job_ctrl, set_name(&s->job, "job\nname"))
MUT(m_world_0, s->world_size = 0)
MUT(m_world_big, s->world_size = SPEC_MAX_WORLD + 1)
MUT(m_accum_0, s->grad_accum = 0)
MUT(m_accum_big, s->grad_accum = SPEC_MAX_ACCUM + 1)
MUT(m_contrib, (s->world_size = 2048, s->grad_accum = 1024))
MUT(m_shards_0, s->num_shards = 0)
MUT(m_shards_big, s->num_shards = SPEC_MAX_SHARDS + 1)
MUT(m_reduce, s->reduce = (spec_reduce)2)
MUT(m_dtype_fp32, s->param_dtype = ZS_DTYPE_FP32)
MUT(m_dtype_0, s->param_dtype = (zs_dtype)0)
MUT(m_groups_0, s->num_groups = 0)
MUT(m_groups_big, s->num_groups = SPEC_MAX_GROUPS + 1)
MUT(m_groups_null, (free(s->groups), s->groups = NULL))
MUT(m_optimizer, s->groups[1].optimizer = (zs_optimizer)4)
MUT(m_lion_beta2, s->groups[2].optimizer = ZS_OPTIM_LION; s->groups[2].beta2 = 1.0)
MUT(m_lr_nan, s->groups[0].lr_scale = NAN)
MUT(m_lr_inf, s->groups[0].lr_scale = INFINITY)
MUT(m_lr_neg, s->groups[0].lr_scale = -1)
MUT(m_beta1_one, s->groups[0].beta1 = 1.0)
MUT(m_beta1_neg, s->groups[0].beta1 = -0.1)
MUT(m_beta2_one, s->groups[1].beta2 = 1.0)
MUT(m_beta2_nan, s->groups[1].beta2 = NAN)
MUT(m_eps_zero, s->groups[0].eps = 0)
MUT(m_eps_neg, s->groups[0].eps = -1e-8)
MUT(m_wd_neg, s->groups[1].weight_decay = -1e-4)
MUT(m_unused_inf, s->groups[0].momentum = INFINITY)
MUT(m_momentum_neg, (s->groups[2].momentum = -0.9, s->groups[2].nesterov = 0))
MUT(m_dampening_big, (s->groups[2].dampening = 1.5, s->groups[2].nesterov = 0))
MUT(m_dampening_neg, (s->groups[2].dampening = -0.1, s->groups[2].nesterov = 0))
MUT(m_nesterov_no_momentum, s->groups[2].momentum = 0)
MUT(m_nesterov_dampening, s->groups[2].dampening = 0.1)
MUT(m_nesterov_2, s->groups[2].nesterov = 2)
MUT(m_bias_correction_2, s->groups[0].bias_correction = 2)
MUT(m_tensors_0, s->num_tensors = 0)
MUT(m_tensors_big, s->num_tensors = SPEC_MAX_TENSORS + 1)
MUT(m_tensors_null,
    (spec_free(&(spec){.tensors = s->tensors, .num_tensors = s->num_tensors}), s->tensors = NULL))
MUT(m_name_empty, set_name(&s->tensors[2].name, ""))
MUT(m_name_null, set_name(&s->tensors[2].name, NULL))
MUT(m_name_ctrl, set_name(&s->tensors[2].name, "norm\x01weight"))
MUT(m_name_del, set_name(&s->tensors[2].name, "norm\x7f"))
MUT(m_name_bad_utf8, set_name(&s->tensors[2].name, "norm\xff"))
MUT(m_name_overlong, set_name(&s->tensors[2].name, "norm\xc0\xaf"))
MUT(m_name_surrogate, set_name(&s->tensors[2].name, "norm\xed\xa0\x80"))
MUT(m_name_truncated, set_name(&s->tensors[2].name, "norm\xe5\x90"))
MUT(m_name_c1, set_name(&s->tensors[2].name, "norm\xc2\x85"))
MUT(m_name_dup, set_name(&s->tensors[3].name, "fc0.bias"))
MUT(m_numel_0, s->tensors[1].numel = 0)
MUT(m_numel_big, s->tensors[1].numel = SPEC_MAX_NUMEL + 1)
MUT(m_group_range, s->tensors[3].group = 7)
MUT(m_ndim_big, s->tensors[3].ndim = SPEC_MAX_DIMS + 1)
MUT(m_shape_product, s->tensors[3].shape[1] = 63)
MUT(m_shape_zero, (s->tensors[3].shape[1] = 0, s->tensors[3].numel = 64))
/* (2^62 + 1) * 4 wraps around 2^64 to exactly numel = 4. */
MUT(m_shape_overflow, (s->tensors[3].numel = 4, s->tensors[3].shape[0] = (UINT64_C(1) << 62) + 1,
                       s->tensors[3].shape[1] = 4))

static void m_name_long(spec *s) {
  char name[SPEC_MAX_NAME + 2];
  memset(name, 'a', SPEC_MAX_NAME + 1);
  name[SPEC_MAX_NAME + 1] = '\0';
  set_name(&s->tensors[2].name, name);
}

static const bad_case k_bad[] = {
    {"empty job", m_job_empty, "job \"\": name is empty"},
    {"no job", m_job_null, "job"},
    {"job with newline", m_job_ctrl, "job \"job\\x0aname\": name contains a control character"},
    {"world 0", m_world_0, "world_size 0 is outside 1..65536"},
    {"world too big", m_world_big, "world_size 65537"},
    {"accum 0", m_accum_0, "grad_accum 0 is outside"},
    {"accum too big", m_accum_big, "grad_accum 65537"},
    {"W*M too big", m_contrib, "world_size 2048 times grad_accum 1024"},
    {"no shards", m_shards_0, "num_shards 0 is outside 1..4096"},
    {"too many shards", m_shards_big, "num_shards 4097"},
    {"bad reduce", m_reduce, "grad_reduce 2"},
    {"fp32 params", m_dtype_fp32, "param_dtype 1 is neither bf16"},
    {"unset param dtype", m_dtype_0, "param_dtype 0"},
    {"no groups", m_groups_0, "0 param groups"},
    {"too many groups", m_groups_big, "1025 param groups"},
    {"groups missing", m_groups_null, "none given"},
    {"bad optimizer", m_optimizer, "param group 1: unknown optimizer 4"},
    {"lion beta2 of 1", m_lion_beta2, "param group 2: beta2 1 is outside [0, 1)"},
    {"lr_scale NaN", m_lr_nan, "param group 0: lr_scale is not finite"},
    {"lr_scale Inf", m_lr_inf, "lr_scale is not finite"},
    {"lr_scale negative", m_lr_neg, "param group 0: lr_scale -1 is negative"},
    {"beta1 1", m_beta1_one, "param group 0: beta1 1 is outside [0, 1)"},
    {"beta1 negative", m_beta1_neg, "beta1 -0.1 is outside"},
    {"beta2 1", m_beta2_one, "param group 1: beta2 1 is outside [0, 1)"},
    {"beta2 NaN", m_beta2_nan, "beta2 is not finite"},
    {"eps 0", m_eps_zero, "param group 0: eps 0 is not positive"},
    {"eps negative", m_eps_neg, "eps -1e-08 is not positive"},
    {"weight decay negative", m_wd_neg, "param group 1: weight_decay -0.0001 is negative"},
    {"unused field Inf", m_unused_inf, "param group 0: momentum is not finite"},
    {"momentum negative", m_momentum_neg, "param group 2: momentum -0.9 is negative"},
    {"dampening above 1", m_dampening_big, "dampening 1.5 is outside [0, 1]"},
    {"dampening negative", m_dampening_neg, "dampening -0.1 is outside"},
    {"nesterov without momentum", m_nesterov_no_momentum, "nesterov requires momentum > 0"},
    {"nesterov with dampening", m_nesterov_dampening, "dampening 0.1)"},
    {"nesterov 2", m_nesterov_2, "nesterov is 2, not 0 or 1"},
    {"bias_correction 2", m_bias_correction_2, "bias_correction is 2"},
    {"no tensors", m_tensors_0, "0 tensors"},
    {"too many tensors", m_tensors_big, "1000001 tensors"},
    {"tensors missing", m_tensors_null, "none given"},
    {"empty name", m_name_empty, "tensor 2 (\"\"): name is empty"},
    {"no name", m_name_null, "tensor 2 (\"(null)\"): name is empty"},
    {"control char", m_name_ctrl, "tensor 2 (\"norm\\x01weight\"): name contains a control"},
    {"DEL char", m_name_del, "name contains a control character"},
    {"bad UTF-8", m_name_bad_utf8, "tensor 2 (\"norm\\xff\"): name is not valid UTF-8"},
    {"overlong UTF-8", m_name_overlong, "not valid UTF-8"},
    {"surrogate", m_name_surrogate, "not valid UTF-8"},
    {"truncated UTF-8", m_name_truncated, "not valid UTF-8"},
    {"C1 control", m_name_c1, "name contains a control character"},
    {"long name", m_name_long, "name is longer than 256 bytes"},
    {"duplicate name", m_name_dup, "tensor 3 (\"fc0.bias\"): name already used by tensor 1"},
    {"numel 0", m_numel_0, "tensor 1 (\"fc0.bias\"): numel is 0"},
    {"numel too big", m_numel_big, "numel 1099511627777 exceeds"},
    {"group out of range", m_group_range,
     "tensor 3 (\"fc1.weight\"): group 7 out of range (3 groups)"},
    {"too many dims", m_ndim_big, "9 dimensions, at most 8"},
    {"shape product", m_shape_product, "shape product 4032 differs from numel 4096"},
    {"zero dimension", m_shape_zero, "shape dimension 1 (0) is invalid"},
    {"shape overflow", m_shape_overflow, "shape dimension 1 (4) is invalid"},
};

static void validation_rejects_each_bad_field_with_a_sentence(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
    spec s;
    make_spec(&s);
    uint32_t nt = s.num_tensors, ng = s.num_groups;
    k_bad[i].mutate(&s);
    char err[256] = "untouched";
    int rc = spec_validate(&s, err, sizeof err);
    if (rc != ZS_EINVAL)
      fail_msg("%s: accepted (rc %d)", k_bad[i].what, rc);
    if (!strstr(err, k_bad[i].expect))
      fail_msg("%s: message \"%s\" lacks \"%s\"", k_bad[i].what, err, k_bad[i].expect);
    /* Some cases fake the counts; restore them so that spec_free walks
     * exactly what exists. */
    s.num_tensors = nt;
    s.num_groups = ng;
    spec_free(&s);
  }
}

/* A spec of `nt` tensors of `numel` elements each over `shards` shards. */
static void make_wide_spec(spec *s, uint32_t nt, uint64_t numel, uint32_t shards) {
  memset(s, 0, sizeof *s);
  s->job = strdup("wide");
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = shards;
  s->param_dtype = ZS_DTYPE_BF16;
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  assert_non_null(s->groups);
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  s->num_tensors = nt;
  s->tensors = calloc(nt, sizeof *s->tensors);
  assert_non_null(s->tensors);
  for (uint32_t i = 0; i < nt; i++) {
    char name[32];
    snprintf(name, sizeof name, "t%u", i);
    s->tensors[i].name = strdup(name);
    s->tensors[i].numel = numel;
  }
}

static void validation_bounds_the_whole_model_not_only_each_tensor(void **state) {
  (void)state;
  char err[256];
  spec s;
  /* Five tensors each at the per-tensor limit exceed the total. */
  make_wide_spec(&s, 5, SPEC_MAX_NUMEL, 1);
  assert_int_equal(spec_validate(&s, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "elements in all"));
  spec_free(&s);
  make_wide_spec(&s, 4, SPEC_MAX_NUMEL, 1);
  assert_int_equal(spec_validate(&s, err, sizeof err), 0);
  spec_free(&s);
  /* 4097 split tensors over 4096 shards make one piece too many. */
  make_wide_spec(&s, 4097, SPEC_DEFAULT_SPLIT_THRESHOLD, SPEC_MAX_SHARDS);
  assert_int_equal(spec_validate(&s, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "pieces"));
  spec_free(&s);
  make_wide_spec(&s, 4096, SPEC_DEFAULT_SPLIT_THRESHOLD, SPEC_MAX_SHARDS);
  assert_int_equal(spec_validate(&s, err, sizeof err), 0);
  spec_free(&s);
}

static void validation_accepts_edge_values(void **state) {
  (void)state;
  spec s;
  make_spec(&s);
  char name[SPEC_MAX_NAME + 1];
  memset(name, 'b', SPEC_MAX_NAME);
  name[SPEC_MAX_NAME] = '\0';
  set_name(&s.tensors[2].name, name);                                        /* exactly the limit */
  set_name(&s.tensors[1].name, "t\xc3\xa9te.\xe5\x90\x8d.\xf0\x9f\x98\x80"); /* UTF-8 */
  s.groups[0].beta1 = 0;
  s.groups[0].beta2 = nextafter(1.0, 0.0);
  s.groups[0].lr_scale = 0;
  s.groups[2].dampening = 0;
  s.groups[2].nesterov = 0;
  s.groups[2].dampening = 1;
  s.world_size = 1024;
  s.grad_accum = 1024; /* W*M == SPEC_MAX_CONTRIB */
  s.num_shards = SPEC_MAX_SHARDS;
  s.tensors[1].numel = SPEC_MAX_NUMEL;
  s.tensors[3].ndim = SPEC_MAX_DIMS;
  for (uint32_t d = 0; d < SPEC_MAX_DIMS; d++)
    s.tensors[3].shape[d] = d < 4 ? 8 : 1;
  s.param_dtype = ZS_DTYPE_FP16;
  s.reduce = SPEC_REDUCE_SUM;
  char err[256];
  int rc = spec_validate(&s, err, sizeof err);
  if (rc)
    fail_msg("rejected: %s", err);
  spec_free(&s);
}

static void validation_error_text_is_truncated_safely(void **state) {
  (void)state;
  spec s;
  make_spec(&s);
  s.tensors[3].group = 7;
  char err[8];
  memset(err, 'x', sizeof err);
  assert_int_equal(spec_validate(&s, err, sizeof err), ZS_EINVAL);
  assert_int_equal(strlen(err), 7);
  assert_int_equal(spec_validate(&s, NULL, 0), ZS_EINVAL);
  assert_int_equal(spec_validate(NULL, NULL, 0), ZS_EINVAL);
  spec_free(&s);
}

static void hostile_name_is_escaped_and_shortened_in_the_error(void **state) {
  (void)state;
  spec s;
  make_spec(&s);
  char name[4000];
  memset(name, '\x01', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  set_name(&s.tensors[0].name, name);
  char err[512];
  assert_int_equal(spec_validate(&s, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "\\x01\\x01"));
  assert_non_null(strstr(err, "..."));
  for (const char *p = err; *p; p++)
    assert_true(*p >= 0x20 && *p < 0x7f);
  spec_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Hash                                                                      */
/* ------------------------------------------------------------------------ */

static void flip_low_bit(double *d) {
  uint64_t u;
  memcpy(&u, d, sizeof u);
  u ^= 1;
  memcpy(d, &u, sizeof u);
}

MUT(h_job, s->job[0] = 'T')
MUT(h_accum, s->grad_accum++)
MUT(h_shards, s->num_shards++)
MUT(h_threshold, s->split_threshold++)
MUT(h_reduce, s->reduce = SPEC_REDUCE_SUM)
MUT(h_dtype, s->param_dtype = ZS_DTYPE_FP16)
MUT(h_num_groups, s->num_groups--) /* drops the last group from the spec */
MUT(h_optimizer, s->groups[1].optimizer = ZS_OPTIM_ADAMW)
MUT(h_lr_scale, flip_low_bit(&s->groups[2].lr_scale))
MUT(h_beta1, flip_low_bit(&s->groups[0].beta1))
MUT(h_beta2, flip_low_bit(&s->groups[0].beta2))
MUT(h_eps, flip_low_bit(&s->groups[0].eps))
MUT(h_wd, flip_low_bit(&s->groups[1].weight_decay))
MUT(h_momentum, flip_low_bit(&s->groups[2].momentum))
MUT(h_dampening, s->groups[2].dampening = -0.0) /* sign bit only */
MUT(h_nesterov, s->groups[2].nesterov = 0)
MUT(h_bias_correction, s->groups[0].bias_correction = 0)
MUT(h_num_tensors, s->num_tensors--)
MUT(h_name, s->tensors[1].name[0] = 'g')
MUT(h_name_len, s->tensors[1].name[strlen(s->tensors[1].name) - 1] = '\0')
MUT(h_numel, s->tensors[2].numel++)
MUT(h_group, s->tensors[2].group = 0)
MUT(h_ndim, s->tensors[1].ndim = 1)
MUT(h_shape, (s->tensors[0].shape[0] = 500, s->tensors[0].shape[1] = 100))
MUT(h_order, (s->tensors[1].name[2] = '9', s->tensors[2].name[0] = 'f'))

static const struct {
  const char *what;
  void (*mutate)(spec *s);
} k_changes[] = {
    {"job", h_job},
    {"grad_accum", h_accum},
    {"num_shards", h_shards},
    {"split_threshold", h_threshold},
    {"reduce", h_reduce},
    {"param_dtype", h_dtype},
    {"num_groups", h_num_groups},
    {"optimizer", h_optimizer},
    {"lr_scale bit", h_lr_scale},
    {"beta1 bit", h_beta1},
    {"beta2 bit", h_beta2},
    {"eps bit", h_eps},
    {"weight_decay bit", h_wd},
    {"momentum bit", h_momentum},
    {"dampening sign", h_dampening},
    {"nesterov", h_nesterov},
    {"bias_correction", h_bias_correction},
    {"num_tensors", h_num_tensors},
    {"name", h_name},
    {"name length", h_name_len},
    {"numel", h_numel},
    {"group", h_group},
    {"ndim", h_ndim},
    {"shape", h_shape},
    {"two names", h_order},
};

static void hash_changes_when_any_single_field_changes(void **state) {
  (void)state;
  spec base;
  make_spec(&base);
  uint64_t h0 = spec_hash(&base);
  uint64_t seen[sizeof k_changes / sizeof k_changes[0]];
  for (size_t i = 0; i < sizeof k_changes / sizeof k_changes[0]; i++) {
    spec s;
    assert_int_equal(spec_copy(&s, &base), 0);
    uint32_t nt = s.num_tensors, ng = s.num_groups;
    k_changes[i].mutate(&s);
    seen[i] = spec_hash(&s);
    if (seen[i] == h0)
      fail_msg("changing %s did not change the hash", k_changes[i].what);
    for (size_t k = 0; k < i; k++)
      if (seen[k] == seen[i])
        fail_msg("changing %s and %s gave the same hash", k_changes[k].what, k_changes[i].what);
    s.num_tensors = nt;
    s.num_groups = ng;
    spec_free(&s);
  }
  spec_free(&base);
}

static void hash_ignores_what_is_not_part_of_the_spec(void **state) {
  (void)state;
  spec s;
  make_spec(&s);
  uint64_t h = spec_hash(&s);
  s.tensors[1].shape[5] = 77; /* beyond ndim = 0 */
  s.tensors[0].shape[2] = 3;  /* beyond ndim = 2 */
  assert_true(spec_hash(&s) == h);
  /* A zero threshold means the default, before and after validation. */
  s.split_threshold = 0;
  uint64_t h_zero = spec_hash(&s);
  s.split_threshold = SPEC_DEFAULT_SPLIT_THRESHOLD;
  assert_true(spec_hash(&s) == h_zero);
  /* The world size is the job's initial membership, not its identity
   * (issue 26): trainers naming another one open the same job. The legacy
   * hash of old checkpoints still tells them apart. */
  uint64_t legacy = spec_hash_legacy(&s);
  s.world_size++;
  assert_true(spec_hash(&s) == h_zero);
  assert_true(spec_hash_legacy(&s) != legacy);
  spec_free(&s);
}

/* The hash of a fixed spec, computed from the encoding documented in spec.c
 * by an independent Python script (struct.pack little-endian, FNV-1a 64 and
 * the MurmurHash3 finaliser). It pins the canonical encoding: if this value
 * changes, every deployed client and checkpoint disagrees with the new code. */
static void hash_of_a_fixed_spec_is_stable(void **state) {
  (void)state;
  spec s;
  memset(&s, 0, sizeof s);
  s.job = strdup("golden");
  s.world_size = 4;
  s.grad_accum = 2;
  s.num_shards = 3;
  s.reduce = SPEC_REDUCE_SUM;
  s.param_dtype = ZS_DTYPE_FP16;
  s.num_groups = 2;
  s.groups = calloc(2, sizeof *s.groups);
  assert_non_null(s.groups);
  spec_group_defaults(&s.groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s.groups[1], ZS_OPTIM_SGD);
  s.groups[1].lr_scale = 0.5;
  s.groups[1].weight_decay = 1e-4;
  s.groups[1].momentum = 0.9;
  s.groups[1].nesterov = 1;
  s.num_tensors = 3;
  s.tensors = calloc(3, sizeof *s.tensors);
  assert_non_null(s.tensors);
  s.tensors[0] = (spec_tensor){strdup("fc1.weight"), 1048576, 0, 2, {1024, 1024}};
  s.tensors[1] = (spec_tensor){strdup("fc1.bias"), 1024, 1, 0, {0}};
  s.tensors[2] = (spec_tensor){strdup("h\xc3\xa9"
                                      "ad"),
                               6,
                               0,
                               3,
                               {1, 2, 3}};
  assert_int_equal(spec_validate(&s, NULL, 0), 0);
  /* The hash before issue 26 (world_size hashed too): checkpoints written
   * then carry it, and are recognised by it. */
  assert_true(spec_hash_legacy(&s) == UINT64_C(0x7e088d174123e360));
  assert_true(spec_hash(&s) != spec_hash_legacy(&s));
  /* spec_encode gives that byte string (what checkpoints store): the tag,
   * and 319 bytes as the layout in spec.c adds up for this spec. */
  unsigned char *enc = NULL;
  size_t len = 0;
  assert_int_equal(spec_encode(&s, &enc, &len), 0);
  assert_int_equal(len, 319);
  assert_memory_equal(enc, "zshard.spec.v1\x06\0\0\0golden\x04\0\0\0", 28);
  free(enc);
  spec_free(&s);
}

/* Every group field at its own distinct value, so that the pinned bytes
 * below say where each one goes and in which order: the encoding is written
 * from SPEC_GROUP_FIELDS, and reordering that list must fail here. The hex is
 * the output of the hand-written encoder this list replaced. */
static void encoding_of_every_group_field_is_pinned(void **state) {
  (void)state;
  spec s;
  memset(&s, 0, sizeof s);
  s.job = strdup("j");
  s.world_size = 1;
  s.grad_accum = 1;
  s.num_shards = 1;
  s.reduce = SPEC_REDUCE_MEAN;
  s.param_dtype = ZS_DTYPE_BF16;
  s.num_groups = 2;
  s.groups = calloc(2, sizeof *s.groups);
  assert_non_null(s.groups);
  s.groups[0] = (spec_group){.optimizer = ZS_OPTIM_ADAM,
                             .lr_scale = 1.5,
                             .beta1 = 0.25,
                             .beta2 = 0.5,
                             .eps = 2.0,
                             .weight_decay = 3.0,
                             .momentum = 4.0,
                             .dampening = 0.75,
                             .nesterov = 0,
                             .bias_correction = 1};
  s.groups[1] = (spec_group){.optimizer = ZS_OPTIM_SGD,
                             .lr_scale = 0.125,
                             .momentum = 0.5,
                             .nesterov = 1,
                             .bias_correction = 0};
  s.num_tensors = 1;
  s.tensors = calloc(1, sizeof *s.tensors);
  assert_non_null(s.tensors);
  s.tensors[0] = (spec_tensor){strdup("t"), 2, 1, 1, {2}};
  assert_int_equal(spec_validate(&s, NULL, 0), 0);
  unsigned char *enc = NULL;
  size_t len = 0;
  assert_int_equal(spec_encode(&s, &enc, &len), 0);
  char hex[1024];
  assert_true(2 * len < sizeof hex);
  for (size_t i = 0; i < len; i++)
    snprintf(hex + 2 * i, 3, "%02x", enc[i]);
  assert_string_equal(
      hex,
      /* tag, job, world_size, grad_accum, num_shards, split_threshold, reduce, param_dtype,
       * num_groups */
      "7a73686172642e737065632e7631010000006a010000000100000001000000000001000000000000"
      "0000000300000002000000"
      /* group 0: optimizer, lr_scale, beta1, beta2, eps, weight_decay, momentum,
       * dampening, nesterov, bias_correction */
      "01000000000000000000f83f000000000000d03f000000000000e03f000000000000004000000000"
      "000008400000000000001040000000000000e83f0000000001000000"
      /* group 1 */
      "02000000000000000000c03f00000000000000000000000000000000000000000000000000000000"
      "00000000000000000000e03f00000000000000000100000000000000"
      /* num_tensors, the tensor */
      "010000000100000074020000000000000001000000010000000200000000000000");
  assert_true(spec_hash_legacy(&s) == UINT64_C(0x7b38819a6c98f3cd));
  /* The same bytes without world_size's four (offset 19), hashed by the
   * same independent script: spec_hash since issue 26. */
  assert_true(spec_hash(&s) == UINT64_C(0x3de07dd9e7d1945f));
  free(enc);
  spec_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Copy and proto                                                            */
/* ------------------------------------------------------------------------ */

static void copy_is_deep_and_hashes_equal(void **state) {
  (void)state;
  spec a, b;
  make_spec(&a);
  assert_int_equal(spec_copy(&b, &a), 0);
  assert_true(spec_hash(&a) == spec_hash(&b));
  assert_ptr_not_equal(a.job, b.job);
  assert_ptr_not_equal(a.groups, b.groups);
  assert_ptr_not_equal(a.tensors, b.tensors);
  assert_ptr_not_equal(a.tensors[0].name, b.tensors[0].name);
  b.tensors[0].name[0] = 'E';
  assert_string_equal(a.tensors[0].name, "embed.weight");
  spec_free(&a);
  /* b outlives a: nothing in it points into a. */
  assert_int_equal(spec_validate(&b, NULL, 0), 0);
  spec_free(&b);
}

static void free_tolerates_zeroed_and_freed_specs(void **state) {
  (void)state;
  spec s;
  memset(&s, 0, sizeof s);
  spec_free(&s);
  make_spec(&s);
  spec_free(&s);
  assert_null(s.tensors);
  assert_int_equal(s.num_tensors, 0);
  spec_free(&s);
  spec_free(NULL);
}

/* spec -> message -> bytes -> message -> spec, as between client and shard. */
static void round_trip(const spec *in, spec *out) {
  Zshard__V1__ModelSpec msg = ZSHARD__V1__MODEL_SPEC__INIT;
  assert_int_equal(spec_to_proto(in, &msg), 0);
  size_t len = zshard__v1__model_spec__get_packed_size(&msg);
  uint8_t *buf = malloc(len + 1);
  assert_non_null(buf);
  assert_int_equal(zshard__v1__model_spec__pack(&msg, buf), len);
  spec_proto_release(&msg);
  assert_null(msg.groups);
  assert_null(msg.tensors);
  Zshard__V1__ModelSpec *back = zshard__v1__model_spec__unpack(NULL, len, buf);
  assert_non_null(back);
  char err[256];
  int rc = spec_from_proto(out, back, err, sizeof err);
  if (rc)
    fail_msg("round trip rejected: %s", err);
  zshard__v1__model_spec__free_unpacked(back, NULL);
  free(buf);
}

static void proto_round_trip_keeps_every_field_and_the_hash(void **state) {
  (void)state;
  spec a, b;
  make_spec(&a);
  a.groups[1].bias_correction = 0;
  a.reduce = SPEC_REDUCE_SUM;
  a.param_dtype = ZS_DTYPE_FP16;
  round_trip(&a, &b);
  assert_true(spec_hash(&a) == spec_hash(&b));
  assert_string_equal(a.job, b.job);
  assert_int_equal(a.world_size, b.world_size);
  assert_int_equal(a.grad_accum, b.grad_accum);
  assert_int_equal(a.num_shards, b.num_shards);
  assert_int_equal(a.split_threshold, b.split_threshold);
  assert_int_equal(a.reduce, b.reduce);
  assert_int_equal(a.param_dtype, b.param_dtype);
  assert_int_equal(a.num_groups, b.num_groups);
  assert_memory_equal(a.groups, b.groups, a.num_groups * sizeof *a.groups);
  assert_int_equal(a.num_tensors, b.num_tensors);
  for (uint32_t i = 0; i < a.num_tensors; i++) {
    assert_string_equal(a.tensors[i].name, b.tensors[i].name);
    assert_int_equal(a.tensors[i].numel, b.tensors[i].numel);
    assert_int_equal(a.tensors[i].group, b.tensors[i].group);
    assert_int_equal(a.tensors[i].ndim, b.tensors[i].ndim);
    assert_memory_equal(a.tensors[i].shape, b.tensors[i].shape,
                        a.tensors[i].ndim * sizeof(uint64_t));
  }
  spec_free(&a);
  spec_free(&b);
}

static void proto_defaults_mean_bias_correction_on_and_bf16(void **state) {
  (void)state;
  /* A message as a minimal grpcio client would send it: only the fields it
   * cares about set, everything else proto3's zero. */
  Zshard__V1__ParamGroup g = ZSHARD__V1__PARAM_GROUP__INIT;
  g.lr_scale = 1;
  g.beta1 = 0.9;
  g.beta2 = 0.999;
  g.eps = 1e-8;
  g.weight_decay = 0.01;
  Zshard__V1__ParamGroup *gs[] = {&g};
  Zshard__V1__TensorSpec t = ZSHARD__V1__TENSOR_SPEC__INIT;
  t.name = "w";
  t.numel = 10;
  Zshard__V1__TensorSpec *ts[] = {&t};
  Zshard__V1__ModelSpec m = ZSHARD__V1__MODEL_SPEC__INIT;
  m.job = "j";
  m.n_groups = 1;
  m.groups = gs;
  m.n_tensors = 1;
  m.tensors = ts;
  m.world_size = 1;
  m.grad_accum = 1;
  m.num_shards = 1;
  spec s;
  char err[256];
  int rc = spec_from_proto(&s, &m, err, sizeof err);
  if (rc)
    fail_msg("rejected: %s", err);
  assert_int_equal(s.param_dtype, ZS_DTYPE_BF16);
  assert_int_equal(s.split_threshold, SPEC_DEFAULT_SPLIT_THRESHOLD);
  assert_int_equal(s.groups[0].bias_correction, 1);
  assert_int_equal(s.groups[0].optimizer, ZS_OPTIM_ADAMW);
  assert_int_equal(s.tensors[0].ndim, 0);
  /* And it is the spec the C library builds with the defaults. */
  spec_group ref;
  spec_group_defaults(&ref, ZS_OPTIM_ADAMW);
  assert_memory_equal(&ref, &s.groups[0], sizeof ref);
  spec_free(&s);

  g.disable_bias_correction = 1;
  m.param_dtype = ZSHARD__V1__DTYPE__DTYPE_FP16;
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), 0);
  assert_int_equal(s.groups[0].bias_correction, 0);
  assert_int_equal(s.param_dtype, ZS_DTYPE_FP16);
  spec_free(&s);
}

static void proto_with_bad_content_is_rejected_and_leaves_out_empty(void **state) {
  (void)state;
  Zshard__V1__ParamGroup g = ZSHARD__V1__PARAM_GROUP__INIT;
  g.lr_scale = 1;
  g.beta2 = 0.5;
  g.eps = 1;
  Zshard__V1__ParamGroup *gs[] = {&g};
  uint64_t shape[9] = {1, 1, 1, 1, 1, 1, 1, 1, 10};
  Zshard__V1__TensorSpec t = ZSHARD__V1__TENSOR_SPEC__INIT;
  t.name = "w";
  t.numel = 10;
  t.n_shape = 9;
  t.shape = shape;
  Zshard__V1__TensorSpec *ts[] = {&t};
  Zshard__V1__ModelSpec m = ZSHARD__V1__MODEL_SPEC__INIT;
  m.job = "j";
  m.n_groups = 1;
  m.groups = gs;
  m.n_tensors = 1;
  m.tensors = ts;
  m.world_size = 1;
  m.grad_accum = 1;
  m.num_shards = 1;
  spec s;
  char err[256];

  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "tensor 0: 9 dimensions, at most 8 allowed"));
  assert_null(s.tensors);

  t.n_shape = 2;
  shape[1] = 9; /* product 9, numel 10 */
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "shape product 9 differs from numel 10"));
  assert_null(s.tensors);
  assert_null(s.job);

  shape[1] = 10;
  m.param_dtype = ZSHARD__V1__DTYPE__DTYPE_FP32;
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "param_dtype 1"));

  m.param_dtype = ZSHARD__V1__DTYPE__DTYPE_BF16;
  m.n_groups = 0;
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "0 param groups"));
  m.n_groups = 1;
  m.n_tensors = SPEC_MAX_TENSORS + 1;
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), ZS_EINVAL);
  assert_non_null(strstr(err, "1000001 tensors"));
  m.n_tensors = 1;
  assert_int_equal(spec_from_proto(&s, NULL, err, sizeof err), ZS_EINVAL);

  /* With everything repaired the same message is accepted. */
  assert_int_equal(spec_from_proto(&s, &m, err, sizeof err), 0);
  spec_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(defaults_match_torch),
      cmocka_unit_test(encoding_of_every_group_field_is_pinned),
      cmocka_unit_test(validation_fills_default_split_threshold),
      cmocka_unit_test(validation_rejects_each_bad_field_with_a_sentence),
      cmocka_unit_test(validation_accepts_edge_values),
      cmocka_unit_test(validation_bounds_the_whole_model_not_only_each_tensor),
      cmocka_unit_test(validation_error_text_is_truncated_safely),
      cmocka_unit_test(hostile_name_is_escaped_and_shortened_in_the_error),
      cmocka_unit_test(hash_changes_when_any_single_field_changes),
      cmocka_unit_test(hash_ignores_what_is_not_part_of_the_spec),
      cmocka_unit_test(hash_of_a_fixed_spec_is_stable),
      cmocka_unit_test(copy_is_deep_and_hashes_equal),
      cmocka_unit_test(free_tolerates_zeroed_and_freed_specs),
      cmocka_unit_test(proto_round_trip_keeps_every_field_and_the_hash),
      cmocka_unit_test(proto_defaults_mean_bias_correction_on_and_bf16),
      cmocka_unit_test(proto_with_bad_content_is_rejected_and_leaves_out_empty),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
