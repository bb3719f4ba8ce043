/*
 * ckpt_format — the encodings of a checkpoint file's small sections (spec,
 * optimizer, pieces), the growable byte string they are built in, and the
 * section kinds' names: the code the writer and the reader share.
 */
#include "server/ckpt/ckpt_format.h"
#include "common/base/status.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/le.h"
#include "server/optim/optim.h"

#define CKPT_SPEC_TAG "zshard.spec.v1"
#define CKPT_SPEC_TAG_LEN 14u
#define CKPT_OPT_HEAD 16u /* optimizer section: u64 steps, u32 groups, u32 0 */
#define CKPT_OPT_GROUP (8u + SPEC_GROUP_FIELDS_BYTES) /* bytes per group */
#define CKPT_PIECE_HEAD 8u                            /* pieces section: u32 count, u32 0 */
#define CKPT_PIECE 40u                                /* bytes per piece */

/* ------------------------------------------------------------------------ */
/* Byte strings                                                              */
/* ------------------------------------------------------------------------ */

static uint8_t *bytes_grow(bytes *b, size_t n) {
  if (b->oom)
    return NULL;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n)
      cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return NULL;
    }
    b->p = p;
    b->cap = cap;
  }
  uint8_t *at = b->p + b->len;
  b->len += n;
  return at;
}

static void bytes_u32(bytes *b, uint32_t v) {
  uint8_t *p = bytes_grow(b, 4);
  if (p)
    le_store32(p, v);
}

static void bytes_u64(bytes *b, uint64_t v) {
  uint8_t *p = bytes_grow(b, 8);
  if (p)
    le_store64(p, v);
}

void ckpt__bytes_raw(bytes *b, const void *src, size_t n) {
  uint8_t *p = bytes_grow(b, n);
  if (p && n)
    memcpy(p, src, n);
}

/* ------------------------------------------------------------------------ */
/* Section encodings                                                         */
/* ------------------------------------------------------------------------ */

/* The spec's canonical encoding (spec_encode): the byte string spec_hash()
 * hashes, so that its hash is the spec hash of the header. */
void ckpt__enc_spec(bytes *b, const spec *s) {
  unsigned char *p = NULL;
  size_t n = 0;
  if (spec_encode(s, &p, &n) != 0) {
    b->oom = 1;
    return;
  }
  ckpt__bytes_raw(b, p, n);
  free(p);
}

/* A bounds-checked cursor over an untrusted byte string. */
typedef struct cursor {
  const uint8_t *p;
  size_t left;
  int bad;
} cursor;

static const uint8_t *cur_take(cursor *c, size_t n) {
  if (c->bad || c->left < n) {
    c->bad = 1;
    return NULL;
  }
  const uint8_t *at = c->p;
  c->p += n;
  c->left -= n;
  return at;
}

static uint32_t cur_u32(cursor *c) {
  const uint8_t *p = cur_take(c, 4);
  return p ? le_load32(p) : 0;
}

static uint64_t cur_u64(cursor *c) {
  const uint8_t *p = cur_take(c, 8);
  return p ? le_load64(p) : 0;
}

/* A string of at most SPEC_MAX_NAME bytes; NULL (and c->bad) otherwise. */
static char *cur_str(cursor *c) {
  uint32_t n = cur_u32(c);
  if (c->bad || n > SPEC_MAX_NAME) {
    c->bad = 1;
    return NULL;
  }
  const uint8_t *p = cur_take(c, n);
  if (!p)
    return NULL;
  if (memchr(p, 0, n)) {
    c->bad = 1; /* a NUL would cut the name short */
    return NULL;
  }
  char *s = malloc((size_t)n + 1);
  if (!s) {
    c->bad = 2;
    return NULL;
  }
  memcpy(s, p, n);
  s[n] = '\0';
  return s;
}

/* Decodes the canonical encoding into *out (validated). Counts are checked
 * against the bytes left before anything is allocated for them. */
int ckpt__dec_spec(const uint8_t *p, size_t n, spec *out, char *why, size_t whylen) {
  memset(out, 0, sizeof *out);
  cursor c = {p, n, 0};
  const uint8_t *tag = cur_take(&c, CKPT_SPEC_TAG_LEN);
  if (!tag || memcmp(tag, CKPT_SPEC_TAG, CKPT_SPEC_TAG_LEN) != 0)
    return status_fail(why, whylen, ZS_EPROTO, "the spec section does not start with \"%s\"",
                       CKPT_SPEC_TAG);
  out->job = cur_str(&c);
  out->world_size = cur_u32(&c);
  out->grad_accum = cur_u32(&c);
  out->num_shards = cur_u32(&c);
  out->split_threshold = cur_u64(&c);
  out->reduce = (spec_reduce)cur_u32(&c);
  out->param_dtype = (zs_dtype)cur_u32(&c);
  uint32_t ngroups = cur_u32(&c);
  if (c.bad || ngroups == 0 || ngroups > SPEC_MAX_GROUPS ||
      (uint64_t)ngroups * (4u + SPEC_GROUP_FIELDS_BYTES) > c.left)
    goto bad;
  out->groups = calloc(ngroups, sizeof *out->groups);
  if (!out->groups)
    goto oom;
  out->num_groups = ngroups;
  for (uint32_t i = 0; i < ngroups; i++) {
    spec_group *g = &out->groups[i];
    g->optimizer = (zs_optimizer)cur_u32(&c);
    const uint8_t *fields = cur_take(&c, SPEC_GROUP_FIELDS_BYTES);
    if (fields)
      spec_group_get_fields(g, fields);
  }
  uint32_t ntensors = cur_u32(&c);
  /* A tensor takes at least 20 bytes (empty name, numel, group, ndim). */
  if (c.bad || ntensors == 0 || ntensors > SPEC_MAX_TENSORS || (uint64_t)ntensors * 20u > c.left)
    goto bad;
  out->tensors = calloc(ntensors, sizeof *out->tensors);
  if (!out->tensors)
    goto oom;
  out->num_tensors = ntensors;
  for (uint32_t i = 0; i < ntensors && !c.bad; i++) {
    spec_tensor *t = &out->tensors[i];
    t->name = cur_str(&c);
    t->numel = cur_u64(&c);
    t->group = cur_u32(&c);
    t->ndim = cur_u32(&c);
    if (t->ndim > SPEC_MAX_DIMS) {
      c.bad = 1;
      break;
    }
    for (uint32_t d = 0; d < t->ndim; d++)
      t->shape[d] = cur_u64(&c);
  }
  if (c.bad == 2)
    goto oom;
  if (c.bad)
    goto bad;
  /* A pipelined job's encoding ends in u32 1 (spec.c); a gated one's ends
   * with its tensors. */
  if (c.left == 4) {
    out->pipelined = (int)cur_u32(&c);
    if (out->pipelined != 1)
      goto bad;
  }
  if (c.left != 0) {
    spec_free(out);
    return status_fail(why, whylen, ZS_EPROTO, "the spec section has %zu bytes after its end",
                       c.left);
  }
  if (!out->job || !out->job[0])
    goto bad;
  char verr[256];
  if (spec_validate(out, verr, sizeof verr) != 0) {
    spec_free(out);
    return status_fail(why, whylen, ZS_EPROTO, "the spec section holds an invalid spec: %s", verr);
  }
  return 0;
bad:
  spec_free(out);
  return status_fail(why, whylen, ZS_EPROTO, "the spec section is malformed");
oom:
  spec_free(out);
  return status_fail(why, whylen, ZS_ENOMEM, "out of memory decoding the spec section");
}

/* Optimizer section: u64 optimizer_steps, u32 num_groups, u32 0, then per
 * group u32 optimizer, u32 state flags (optim_state_needs: bit 0, its pieces'
 * m arena elements are state, bit 1: v), then the group's SPEC_GROUP_FIELDS
 * as the spec's canonical encoding has them (today f64 lr_scale, beta1,
 * beta2, eps, weight_decay, momentum, dampening, u32 nesterov,
 * bias_correction). */
void ckpt__enc_optimizer(bytes *b, const spec *s, uint64_t optimizer_steps) {
  _Static_assert(OPTIM_STATE_M == 1u && OPTIM_STATE_V == 2u,
                 "the state flags are written as optim_state_needs gives them");
  bytes_u64(b, optimizer_steps);
  bytes_u32(b, s->num_groups);
  bytes_u32(b, 0);
  for (uint32_t i = 0; i < s->num_groups; i++) {
    const spec_group *g = &s->groups[i];
    bytes_u32(b, (uint32_t)g->optimizer);
    bytes_u32(b, optim_state_needs(g));
    uint8_t *p = bytes_grow(b, SPEC_GROUP_FIELDS_BYTES);
    if (p)
      spec_group_put_fields(g, p);
  }
}

/* Pieces section: u32 count, u32 0, then per piece of the shard in (tensor,
 * slice) order u32 tensor, u32 slice, u32 group, u32 0, u64 offset within the
 * tensor, u64 numel, u64 arena offset (elements). */
void ckpt__enc_pieces(bytes *b, const layout *l, uint32_t shard) {
  bytes_u32(b, l->shard_pieces[shard]);
  bytes_u32(b, 0);
  for (uint32_t i = 0; i < l->num_pieces; i++) {
    const layout_piece *pc = &l->pieces[i];
    if (pc->shard != shard)
      continue;
    bytes_u32(b, pc->tensor);
    bytes_u32(b, pc->slice);
    bytes_u32(b, pc->group);
    bytes_u32(b, 0);
    bytes_u64(b, pc->offset);
    bytes_u64(b, pc->numel);
    bytes_u64(b, pc->arena_off);
  }
}

/* Whether shard `shard` keeps m and v arenas: the rule of core_state_init. */
void ckpt__shard_uses(const spec *s, const layout *l, uint32_t shard, int *m, int *v) {
  unsigned needs = 0;
  for (uint32_t r = l->range_first[shard]; r < l->range_first[shard + 1]; r++)
    needs |= optim_state_needs(&s->groups[l->ranges[r].group]);
  *m = (needs & OPTIM_STATE_M) != 0;
  *v = (needs & OPTIM_STATE_V) != 0;
}

/* One set: its count, then its ranks in ascending order. */
static void enc_set(bytes *b, const core_members *m, uint32_t world_size) {
  uint32_t n = 0;
  for (uint32_t r = 0; r < world_size && r < CORE_ELASTIC_MAX_W; r++)
    n += core_members_has(m, r) ? 1u : 0u;
  bytes_u32(b, n);
  for (uint32_t r = 0; r < world_size && r < CORE_ELASTIC_MAX_W; r++)
    if (core_members_has(m, r))
      bytes_u32(b, r);
}

void ckpt__enc_members(bytes *b, const core_member_state *ms, uint32_t world_size, uint32_t fmt) {
  bytes_u32(b, ms->trainer_timeout_ms);
  bytes_u32(b, world_size);
  bytes_u64(b, ms->epoch);
  bytes_u64(b, ms->leaves);
  bytes_u64(b, ms->timeouts);
  bytes_u64(b, ms->joins);
  enc_set(b, &ms->members, world_size);
  bytes_u32(b, ms->log_n);
  for (uint32_t k = 0; k < ms->log_n; k++) {
    bytes_u64(b, ms->log[k].from_step);
    enc_set(b, &ms->log[k].members, world_size);
  }
  if (fmt >= 3)
    bytes_u32(b, ms->flag_timeout_ms);
}

/* Decodes one set: a count of at most world_size, then that many ranks,
 * strictly ascending and below world_size. */
static int dec_set(cursor *c, uint32_t world_size, core_members *out, const char *what, char *why,
                   size_t whylen) {
  memset(out, 0, sizeof *out);
  uint32_t n = cur_u32(c);
  if (c->bad || n > world_size || (size_t)n * 4 > c->left)
    return status_fail(why, whylen, ZS_EPROTO,
                       "the members section's %s has a count of %u ranks (world size %u, %zu "
                       "bytes left)",
                       what, n, world_size, c->left);
  for (uint32_t k = 0, prev = 0; k < n; k++) {
    uint32_t r = cur_u32(c);
    if (r >= world_size || (k > 0 && r <= prev))
      return status_fail(why, whylen, ZS_EPROTO,
                         "the members section's %s names rank %u out of order or beyond the "
                         "world size %u",
                         what, r, world_size);
    core_members_add(out, r);
    prev = r;
  }
  return 0;
}

int ckpt__dec_members(const uint8_t *p, size_t n, uint32_t world_size, uint64_t version,
                      uint32_t fmt, core_member_state **out, char *why, size_t whylen) {
  *out = NULL;
  cursor c = {p, n, 0};
  core_member_state *ms = calloc(1, sizeof *ms);
  if (!ms)
    return status_fail(why, whylen, ZS_ENOMEM, "out of memory");
  core_member_log_entry *log = NULL;
  int rc = 0;
  ms->trainer_timeout_ms = cur_u32(&c);
  uint32_t w = cur_u32(&c);
  ms->epoch = cur_u64(&c);
  ms->leaves = cur_u64(&c);
  ms->timeouts = cur_u64(&c);
  ms->joins = cur_u64(&c);
  if (c.bad) {
    rc = status_fail(why, whylen, ZS_EPROTO, "the members section is truncated (%zu bytes)", n);
    goto fail;
  }
  if (ms->trainer_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS) {
    rc = status_fail(why, whylen, ZS_EPROTO,
                     "the members section's trainer timeout is %u ms (at most %u)",
                     ms->trainer_timeout_ms, CORE_MAX_TRAINER_TIMEOUT_MS);
    goto fail;
  }
  if (w != world_size || w == 0 || w > CORE_ELASTIC_MAX_W) {
    rc = status_fail(why, whylen, ZS_EPROTO,
                     "the members section is for a world size of %u, the spec's is %u (at most "
                     "%u)",
                     w, world_size, CORE_ELASTIC_MAX_W);
    goto fail;
  }
  if ((rc = dec_set(&c, w, &ms->members, "members", why, whylen)) != 0)
    goto fail;
  uint32_t log_n = cur_u32(&c);
  /* Each entry takes at least 12 bytes (its step and count). */
  if (c.bad || log_n > CORE_MEMBER_LOG_MAX || (size_t)log_n * 12 > c.left) {
    rc = status_fail(why, whylen, ZS_EPROTO,
                     "the members section's log has %u entries (at most %u, %zu bytes left)", log_n,
                     CORE_MEMBER_LOG_MAX, c.left);
    goto fail;
  }
  log = malloc((size_t)log_n * sizeof *log + 1);
  if (!log) {
    rc = status_fail(why, whylen, ZS_ENOMEM, "out of memory");
    goto fail;
  }
  for (uint32_t k = 0; k < log_n; k++) {
    log[k].from_step = cur_u64(&c);
    /* Steps strictly ascending, from 1, none past the checkpoint's version. */
    if (c.bad || log[k].from_step == 0 || log[k].from_step > version ||
        (k > 0 && log[k].from_step <= log[k - 1].from_step)) {
      rc = status_fail(why, whylen, ZS_EPROTO,
                       "the members section's log entry %u has step %" PRIu64
                       " (out of order, or past version %" PRIu64 ")",
                       k, log[k].from_step, version);
      goto fail;
    }
    if ((rc = dec_set(&c, w, &log[k].members, "log", why, whylen)) != 0)
      goto fail;
    if (log[k].members.n == 0) {
      rc = status_fail(why, whylen, ZS_EPROTO,
                       "the members section's log entry %u (step %" PRIu64 ") has no rank", k,
                       log[k].from_step);
      goto fail;
    }
  }
  /* Format 3: the server-flag timeout in effect for the job follows the
   * log (formats 2 and older: none, 0). */
  if (fmt >= 3) {
    ms->flag_timeout_ms = cur_u32(&c);
    if (c.bad || ms->flag_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS) {
      rc = status_fail(why, whylen, ZS_EPROTO,
                       "the members section's flag timeout is %s (at most %u ms)",
                       c.bad ? "missing" : "out of range", CORE_MAX_TRAINER_TIMEOUT_MS);
      goto fail;
    }
  }
  if (c.left != 0) {
    rc = status_fail(why, whylen, ZS_EPROTO, "the members section has %zu bytes after its log%s",
                     c.left, fmt >= 3 ? " and flag timeout" : "");
    goto fail;
  }
  ms->log = log;
  ms->log_n = log_n;
  *out = ms;
  return 0;
fail:
  free(log);
  free(ms);
  return rc;
}

const char *ckpt__section_name(uint32_t kind) {
  switch (kind) {
  case CKPT_SEC_SPEC:
    return "spec";
  case CKPT_SEC_OPTIMIZER:
    return "optimizer";
  case CKPT_SEC_PIECES:
    return "pieces";
  case CKPT_SEC_MASTER:
    return "master";
  case CKPT_SEC_EXP_AVG:
    return "exp_avg";
  case CKPT_SEC_EXP_AVG_SQ:
    return "exp_avg_sq";
  case CKPT_SEC_CLIENT_STATE:
    return "client_state";
  case CKPT_SEC_TENSOR_STEPS:
    return "tensor_steps";
  case CKPT_SEC_MEMBERS:
    return "members";
  default:
    return "unknown";
  }
}
