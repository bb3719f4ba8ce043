/*
 * spec — the job's model spec: ordered tensors, param groups, optimizer
 * configuration, world size, accumulation count and shard count.
 *
 * The spec is what every client and every shard agree on; the layout (layout.h)
 * is a pure function of it, and spec_hash() is a 64-bit hash of its canonical
 * encoding that travels with every request.
 */
#ifndef ZSHARD_COMMON_SPEC_H
#define ZSHARD_COMMON_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "zshard/types.h"

#define SPEC_DEFAULT_SPLIT_THRESHOLD 65536u
#define SPEC_MAX_NAME 256 /* bytes in a tensor or job name, without NUL */
#define SPEC_MAX_TENSORS 1000000u
#define SPEC_MAX_GROUPS 1024u
#define SPEC_MAX_WORLD 65536u /* W */
#define SPEC_MAX_ACCUM 65536u /* M; W*M must also fit SPEC_MAX_CONTRIB */
#define SPEC_MAX_CONTRIB 1048576u
#define SPEC_MAX_SHARDS 4096u
#define SPEC_MAX_DIMS 8u
#define SPEC_MAX_NUMEL (UINT64_C(1) << 40)
/* Whole-model bounds: a spec arrives from the network, and the layout costs
 * memory per piece before any arena is sized. */
#define SPEC_MAX_TOTAL_NUMEL (UINT64_C(1) << 42)
#define SPEC_MAX_PIECES (UINT64_C(1) << 24)

typedef enum spec_reduce {
  SPEC_REDUCE_MEAN = 0,
  SPEC_REDUCE_SUM = 1,
} spec_reduce;

/*
 * The hyper-parameters of a param group, one line each, in the order of the
 * canonical encoding. Everything that lists a group's fields is generated
 * from these lists: the spec_group and optim_params members, the encoding
 * that spec_hash() hashes and checkpoints store (spec_group_put_fields), its
 * decoding, the checkpoint's optimizer section, the proto conversion
 * (spec_proto.c), the client's copy from zs_group_options (client.c), the
 * finite / 0-or-1 checks of spec_validate and the core's optim_params.
 *
 * X(kind, name, proto_field):
 *   kind         F64: a double, encoded as the u64 of its IEEE 754 bits;
 *                FLAG: an int, 0 or 1, encoded as u32, a bool in the proto;
 *                FLAG_NEGATED: the same, but the proto's bool says the
 *                opposite (the proto's defaults are false).
 *   name         the member of spec_group, optim_params and zs_group_options.
 *   proto_field  the member of Zshard__V1__ParamGroup.
 *
 * Adding a hyper-parameter: one line here (SPEC_OPTIM_FIELDS, at the end, so
 * that the fields before it keep their places), its use in the optimizer
 * kernel (optim.c: optim_plan_init and the loops), and what no list can say
 * for it: the field in zshard.proto and in the public zs_group_options (at
 * the end, for the ABI; the generated copies name both, so the build fails
 * until they exist), a non-zero default in spec_group_defaults, a range
 * check in check_group beyond "finite" or "0 or 1", and whether it changes
 * which moment arrays exist (optim_state_needs). It changes the canonical
 * encoding, so every spec hash and the checkpoint format (a version bump)
 * change with it.
 */

/* The optimizer's own hyper-parameters, each of which reaches the kernel as
 * the optim_params member of the same name. */
#define SPEC_OPTIM_FIELDS(X)                                                                       \
  X(F64, beta1, beta1)                                      /* adam, adamw */                      \
  X(F64, beta2, beta2)                                      /* adam, adamw */                      \
  X(F64, eps, eps)                                          /* adam, adamw */                      \
  X(F64, weight_decay, weight_decay)                        /* adam, adamw, sgd */                 \
  X(F64, momentum, momentum)                                /* sgd */                              \
  X(F64, dampening, dampening)                              /* sgd */                              \
  X(FLAG, nesterov, nesterov)                               /* sgd */                              \
  X(FLAG_NEGATED, bias_correction, disable_bias_correction) /* adam, adamw */

/* All of a group's fields after its optimizer: the group's lr scale (which
 * the core folds into the step's lr, so the kernel sees optim_params.lr),
 * then the optimizer's. */
#define SPEC_GROUP_FIELDS(X)                                                                       \
  X(F64, lr_scale, lr_scale) /* this group's lr = the step's lr * lr_scale */                      \
  SPEC_OPTIM_FIELDS(X)

/* How each kind is held in C and how many bytes it takes encoded. */
#define SPEC_FIELD_CTYPE_F64 double
#define SPEC_FIELD_CTYPE_FLAG int
#define SPEC_FIELD_CTYPE_FLAG_NEGATED int
#define SPEC_FIELD_BYTES_F64 8u
#define SPEC_FIELD_BYTES_FLAG 4u
#define SPEC_FIELD_BYTES_FLAG_NEGATED 4u

/* A struct member for each field of a list: SPEC_OPTIM_FIELDS(SPEC_FIELD_MEMBER). */
#define SPEC_FIELD_MEMBER(kind, name, proto) SPEC_FIELD_CTYPE_##kind name;
#define SPEC_FIELD_ADD_BYTES(kind, name, proto) +SPEC_FIELD_BYTES_##kind

/* Bytes of the encoded fields of one group (SPEC_GROUP_FIELDS, without the
 * u32 optimizer that precedes them). */
#define SPEC_GROUP_FIELDS_BYTES (0u SPEC_GROUP_FIELDS(SPEC_FIELD_ADD_BYTES))

typedef struct spec_group {
  zs_optimizer optimizer;
  SPEC_GROUP_FIELDS(SPEC_FIELD_MEMBER)
} spec_group;

typedef struct spec_tensor {
  char *name; /* owned by the spec */
  uint64_t numel;
  uint32_t group; /* index into spec.groups */
  uint32_t ndim;  /* 0: shape is [numel] */
  uint64_t shape[SPEC_MAX_DIMS];
} spec_tensor;

typedef struct spec {
  char *job;          /* owned by the spec */
  spec_group *groups; /* owned, num_groups entries */
  uint32_t num_groups;
  spec_tensor *tensors; /* owned, num_tensors entries */
  uint32_t num_tensors;
  uint32_t world_size;      /* W */
  uint32_t grad_accum;      /* M */
  uint32_t num_shards;      /* N */
  uint64_t split_threshold; /* elements; never 0 after spec_validate */
  spec_reduce reduce;
  zs_dtype param_dtype; /* ZS_DTYPE_BF16 or ZS_DTYPE_FP16 */
  /* 0 or 1. A pipelined job has no global gate: a shard applies each piece
   * as soon as its W*M contributions are in (with the step's lr, which the
   * Apply brings ahead of them) and answers that piece's pulls at once; no
   * gradient statistics, so no clipping and no overflow check (DESIGN.md,
   * "A step"). Hashed, so every trainer, shard and replica agrees. */
  int pipelined;
} spec;

/* Fills `g` with torch's defaults for `opt` (AdamW: betas 0.9/0.999, eps 1e-8,
 * weight decay 0.01; Adam: same with weight decay 0; SGD: all zero), lr_scale 1. */
void spec_group_defaults(spec_group *g, zs_optimizer opt);

/* Writes g's SPEC_GROUP_FIELDS, in order and little-endian, into out
 * (SPEC_GROUP_FIELDS_BYTES bytes): the per-group part of the canonical
 * encoding and of the checkpoint's optimizer section. */
void spec_group_put_fields(const spec_group *g, unsigned char *out);

/* The inverse: reads SPEC_GROUP_FIELDS_BYTES bytes at in into g's fields
 * (the optimizer is left as it is). Values are taken as they come; checking
 * them is spec_validate's job. */
void spec_group_get_fields(spec_group *g, const unsigned char *in);

/* Checks every field for range and consistency (names non-empty and unique,
 * group indices valid, shape products equal numel, hyper-parameters finite and
 * in range, the total element and piece counts within SPEC_MAX_TOTAL_NUMEL and
 * SPEC_MAX_PIECES). Fills a zero split_threshold with the default. Returns 0,
 * or ZS_EINVAL with a sentence in err (which may be NULL), or ZS_ENOMEM. */
int spec_validate(spec *s, char *err, size_t errlen);

/* The 64-bit hash of the canonical encoding of a validated spec, without its
 * world_size (issue 26: the world size at open is the job's initial
 * membership, not part of its identity, so trainers that name another one
 * still open the same job). Equal specs give equal hashes on every machine. */
uint64_t spec_hash(const spec *s);

/* The hash before issue 26, over the whole encoding (world_size included):
 * what checkpoints written before then carry in their headers and manifests.
 * Only for recognising those; nothing new is written with it. */
uint64_t spec_hash_legacy(const spec *s);

/* That canonical encoding itself (what checkpoints store), in *out (malloc'd,
 * the caller frees it) of *len bytes. Returns 0 or ZS_ENOMEM. */
int spec_encode(const spec *s, unsigned char **out, size_t *len);

/* Deep copy of `src` into `dst` (which the caller then frees with spec_free).
 * Returns 0 or ZS_ENOMEM (dst is then empty). */
int spec_copy(spec *dst, const spec *src);

/* Frees what `s` owns and zeroes it; tolerates a partly built or zeroed spec. */
void spec_free(spec *s);

/* Conversion from and to the protobuf-c message zshard.v1.ModelSpec, declared
 * opaquely so that users of this header need not include the generated code. */
struct Zshard__V1__ModelSpec;

/* Builds a spec from the message (copying everything; the message stays the
 * caller's) and validates it. Returns 0, or ZS_EINVAL / ZS_ENOMEM with a
 * sentence in err; on error `out` is left empty. */
int spec_from_proto(spec *out, const struct Zshard__V1__ModelSpec *msg, char *err, size_t errlen);

/* Fills `msg` (initialised by the caller with ZSHARD__V1__MODEL_SPEC__INIT)
 * from `s`. The message points into `s` and into arrays allocated here, freed
 * by spec_proto_release(msg); `s` must outlive the message. Returns 0 or
 * ZS_ENOMEM. */
int spec_to_proto(const spec *s, struct Zshard__V1__ModelSpec *msg);
void spec_proto_release(struct Zshard__V1__ModelSpec *msg);

#endif
