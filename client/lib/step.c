/*
 * step — zs_step: the trainer's optimizer.step().
 *
 *   1. Drain: wait for this client's pushes of the step; a failed push fails
 *      the step, and so does a (tensor, micro) this rank never pushed.
 *   2. GradStats on every shard in parallel: each answers once all W*M
 *      contributions of its pieces are in, with the sum of squares of its
 *      summed gradient and a non-finite flag, or, after step_timeout, with
 *      what is missing.
 *   3. The global norm and the overflow flag, from the shards' answers taken
 *      in shard order, so that every trainer computes the same bits:
 *        true gradient = summed * 1 / (loss_scale * D), D = W (mean) or 1 (sum)
 *        grad_norm     = sqrt(sum of sum_squares) / (loss_scale * D)
 *        clip_coef     = min(1, max_norm / (grad_norm + 1e-6))   (torch's
 *                        clip_grad_norm_), 1 without clipping
 *        coef          = (float)(clip_coef / loss_scale)
 *      The shard multiplies the summed gradient by coef / D (rounded once to
 *      float) before the optimizer.
 *   4. Apply(step, lr, coef, skip) on every shard in parallel; skip on
 *      overflow. Identical arguments from every trainer make the later Applies
 *      repeats of the first, which the shards answer with the same outcome.
 *      With the client's dynamic loss scaler, the Apply also carries the
 *      scaler's state after this step's update (client_state), which the
 *      shards keep with the version and checkpoint, so that a restart or a
 *      restore brings the scaler back with the weights (zs_open_job,
 *      zs_restore). The client's own scaler changes only once the Apply
 *      succeeded, so a failed zs_step can be called again.
 *
 * The pipelined step (a job opened with zs_client_options.pipelined) has no
 * gate: it checks that every (tensor, micro) was pushed and no push failed,
 * sends Apply(step, lr, 1 / loss_scale) to every shard, which accepts it at
 * once and applies each piece when its last contribution lands, and returns
 * without waiting for its pushes or the shards: the pulls of the next
 * forward wait on the shards for each piece (core_wait_pieces), so they
 * overlap the other trainers' pushes. A push of the step that fails later is
 * reported by the next zs_step (its pulls wait in vain until step_timeout).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_client.h"
#include "common/base/clock.h"
#include "internal.h"

#define STEP_MAX_EXAMPLES 6 /* missing contributions quoted in an error */

void zs_step_result_init_sized(zs_step_result *r, size_t size) {
  if (!r || size < sizeof(size_t))
    return;
  zs_step_result own;
  memset(&own, 0, sizeof own);
  zc_struct_write(r, size, &own, sizeof own);
}

int zs_last_timing_sized(const zs_client *c, zs_timing *out, size_t size) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!out) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_last_timing: out is NULL");
  }
  rc = zc_struct_check(size, "zs_last_timing", "sizeof *out");
  if (rc != ZS_OK) {
    zc_client_leave(c);
    return rc;
  }
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  zs_timing t = c->last_timing;
  pthread_mutex_unlock(&m->mu);
  zc_struct_write(out, size, &t, sizeof t);
  zc_client_leave(c);
  return ZS_OK;
}

/* The first (tensor, micro) this rank has not pushed in the step, as a
 * sentence; 0 if all were pushed. Called with c->mu held. */
static int find_unpushed_locked(const zs_client *c, char *msg, size_t len) {
  uint32_t M = c->sp.grad_accum;
  size_t n = (size_t)c->sp.num_tensors * M;
  for (size_t bit = 0; bit < n; bit++) {
    if (!(c->pushed[bit / 8] & (1u << (bit % 8)))) {
      snprintf(msg, len,
               "zs_step: rank %" PRIu32 " has not pushed tensor '%s' for micro %" PRIu32
               " of step %" PRIu64 " (every tensor is pushed once per micro-batch)",
               c->opt.rank, c->sp.tensors[bit / M].name, (uint32_t)(bit % M), c->step);
      return 1;
    }
  }
  return 0;
}

/* Builds the "what is missing" sentence from the shards' GradStats answers. */
static void describe_missing(const zs_client *c, uint64_t step, zs_request *op, char *msg,
                             size_t len) {
  uint64_t total = 0;
  /* Ranks named in the answers, as a bitmap over W. */
  uint8_t *ranks = calloc((c->sp.world_size + 7) / 8, 1);
  char examples[ZC_ERR_LEN] = "";
  size_t ex_len = 0;
  int nex = 0;
  for (uint32_t i = 0; i < op->ntasks; i++) {
    const Zshard__V1__GradStatsResponse *r =
        (const Zshard__V1__GradStatsResponse *)op->tasks[i].resp;
    if (!r || r->complete)
      continue;
    total += r->missing_total;
    for (size_t k = 0; k < r->n_missing; k++) {
      const Zshard__V1__MissingContribution *mc = r->missing[k];
      if (ranks && mc->rank < c->sp.world_size)
        ranks[mc->rank / 8] |= (uint8_t)(1u << (mc->rank % 8));
      if (nex < STEP_MAX_EXAMPLES && ex_len < sizeof examples - 1) {
        /* The tensor name comes from our own spec when the index is valid:
         * the shard's string is untrusted and only a fallback. */
        const char *name = mc->tensor < c->sp.num_tensors
                               ? c->sp.tensors[mc->tensor].name
                               : (mc->tensor_name ? mc->tensor_name : "?");
        int w = snprintf(examples + ex_len, sizeof examples - ex_len,
                         "%srank %" PRIu32 " micro %" PRIu32 " tensor '%.64s' slice %" PRIu32
                         " on shard %" PRIu32,
                         nex ? "; " : "", mc->rank, mc->micro, name, mc->slice, i);
        if (w > 0)
          ex_len += (size_t)w < sizeof examples - ex_len ? (size_t)w : sizeof examples - ex_len - 1;
        nex++;
      }
    }
  }
  char rank_list[128] = "";
  size_t rl = 0;
  for (uint32_t r = 0; ranks && r < c->sp.world_size && rl < sizeof rank_list - 16; r++) {
    if (ranks[r / 8] & (1u << (r % 8))) {
      int w = snprintf(rank_list + rl, sizeof rank_list - rl, "%s%" PRIu32, rl ? ", " : "", r);
      if (w > 0)
        rl += (size_t)w;
    }
  }
  free(ranks);
  snprintf(msg, len,
           "step %" PRIu64 " incomplete after %" PRIu32 " ms: %" PRIu64
           " contribution(s) missing, from rank(s) %s; e.g. %s",
           step, c->opt.step_timeout_ms, total, rl ? rank_list : "?", examples);
}

static void free_responses(zs_request *op) {
  for (uint32_t i = 0; i < op->ntasks; i++) {
    if (op->tasks[i].resp) {
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
      op->tasks[i].resp = NULL;
    }
  }
}

/* A set of ranks of the job (a step's membership, docs/DESIGN.md
 * "Membership"): n of them, one bit each in bits (words of 64 over W). */
typedef struct step_members {
  uint32_t n;
  uint32_t words;
  uint64_t *bits;
} step_members;

static int members_has(const step_members *m, uint32_t r) {
  return (int)((m->bits[r / 64] >> (r % 64)) & 1u);
}

/* A shard's answered set into *m (words already sized): num_members 0 (a
 * server before elastic trainers) or the world size without a list is every
 * rank. A list that names a rank twice, one out of range or disagrees with
 * its count is EPROTO. */
static int members_from(const zs_client *c, uint32_t shard, uint32_t num, const uint32_t *ranks,
                        size_t nranks, step_members *m) {
  const uint32_t W = c->sp.world_size;
  memset(m->bits, 0, m->words * sizeof *m->bits);
  m->n = 0;
  if (num == 0 || (num == W && nranks == 0)) {
    for (uint32_t r = 0; r < W; r++)
      m->bits[r / 64] |= UINT64_C(1) << (r % 64);
    m->n = W;
    return ZS_OK;
  }
  for (size_t i = 0; i < nranks; i++) {
    if (ranks[i] >= W || members_has(m, ranks[i]))
      return zc_fail(ZS_EPROTO,
                     "zs_step: shard %" PRIu32 " (%s) answered a membership with rank %" PRIu32
                     " %s",
                     shard, c->addr[shard], ranks[i], ranks[i] >= W ? "out of range" : "twice");
    m->bits[ranks[i] / 64] |= UINT64_C(1) << (ranks[i] % 64);
    m->n++;
  }
  if (m->n != num || num > W)
    return zc_fail(ZS_EPROTO,
                   "zs_step: shard %" PRIu32 " (%s) answered %" PRIu32 " members but listed %zu",
                   shard, c->addr[shard], num, nranks);
  return ZS_OK;
}

/* How many rounds of GradStats a step may take to agree on its membership:
 * the first, and one asking every shard for the intersection (a shard that
 * was still summing may need another). */
#define STEP_MEMBER_ROUNDS 4

/* One round of GradStats on every shard, over `want` (NULL: each shard's
 * own set): the sum of squares and overflow, in shard order, and the
 * intersection of the shards' member sets in *agreed; *same is 1 when every
 * shard summed exactly that set. */
static int stats_round(zs_client *c, uint64_t step, const step_members *want, step_members *agreed,
                       int *same, double *sum_squares, int *nonfinite) {
  Zshard__V1__GradStatsRequest req = ZSHARD__V1__GRAD_STATS_REQUEST__INIT;
  req.spec_hash = c->hash;
  req.step = step;
  req.timeout_ms = c->opt.step_timeout_ms;
  /* The drain saw every push of this rank acknowledged: a shard that lacks
   * one lost it (a restart at the step's version) and says so at once. */
  req.acked_rank = c->opt.rank + 1;
  uint32_t *list = NULL;
  if (want) {
    req.num_members = want->n;
    if (want->n < c->sp.world_size) {
      list = malloc((want->n + 1) * sizeof *list);
      if (!list)
        return zc_fail(ZS_ENOMEM, "zs_step: out of memory");
      for (uint32_t r = 0; r < c->sp.world_size; r++)
        if (members_has(want, r))
          list[req.n_members++] = r;
      req.members = list;
    }
  }
  step_members got = {.words = agreed->words};
  got.bits = calloc(got.words, sizeof *got.bits);
  zs_request *op = got.bits ? zc_op_new(c, ZC_OP_CALL, c->nshards) : NULL;
  if (!op) {
    free(list);
    free(got.bits);
    return ZS_ENOMEM;
  }
  if (!op)
    return ZS_ENOMEM;
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("GradStats");
    t->msg = &req.base; /* shared: packing only reads it */
    t->resp_desc = &zshard__v1__grad_stats_response__descriptor;
    /* The shard answers by its own timeout; the deadline leaves it room. */
    t->timeout_ms = (uint64_t)c->opt.step_timeout_ms + c->opt.rpc_timeout_ms;
  }
  int rc = zc_call_all(op);
  int incomplete = 0;
  double sum = 0.0;
  int nf = 0;
  uint32_t max_n = 0;
  int have = 0;
  for (uint32_t i = 0; rc == ZS_OK && i < c->nshards; i++) {
    const Zshard__V1__GradStatsResponse *r =
        (const Zshard__V1__GradStatsResponse *)op->tasks[i].resp;
    if (!r->complete) {
      incomplete = 1;
      continue;
    }
    rc = members_from(c, i, r->num_members, r->members, r->n_members, &got);
    if (rc != ZS_OK)
      break;
    /* The intersection is a subset of every shard's set, so a shard summed
     * exactly it when the counts are equal. */
    if (got.n > max_n)
      max_n = got.n;
    for (uint32_t w = 0; w < agreed->words; w++)
      agreed->bits[w] = have ? agreed->bits[w] & got.bits[w] : got.bits[w];
    have = 1;
    if (r->step != step) {
      rc = zc_fail(ZS_EPROTO,
                   "zs_step: shard %" PRIu32 " (%s) answered GradStats for step %" PRIu64
                   " instead of %" PRIu64,
                   i, c->addr[i], r->step, step);
      break;
    }
    /* Summed in shard order: every trainer adds the same doubles in the same
     * order and gets the same bits. */
    sum += r->sum_squares;
    nf |= r->nonfinite != 0;
  }
  if (rc == ZS_OK && incomplete) {
    char msg[ZC_ERR_LEN];
    describe_missing(c, step, op, msg, sizeof msg);
    rc = zc_fail_msg(ZS_ETIMEDOUT, msg);
  }
  agreed->n = 0;
  for (uint32_t r = 0; have && r < c->sp.world_size; r++)
    agreed->n += (uint32_t)members_has(agreed, r);
  *same = have && max_n == agreed->n;
  free_responses(op);
  zc_op_release(op);
  free(list);
  free(got.bits);
  *sum_squares = sum;
  *nonfinite = nf;
  return rc;
}

/* GradStats on every shard: sum of squares and overflow over the step's
 * membership, agreed as docs/DESIGN.md "Membership" says: each shard
 * answers the set it summed (every member, or those complete when the
 * trainer timeout left the others out); the intersection is the step's
 * set, and shards that summed more are asked for it. Every trainer gets
 * the same answers, so all agree. *members gets the set; a set without
 * this rank is ZS_ELEFT. */
static int collect_stats(zs_client *c, uint64_t step, double *sum_squares, int *nonfinite,
                         step_members *members) {
  int same = 0, rc = ZS_OK;
  step_members want = {.words = members->words};
  want.bits = calloc(want.words, sizeof *want.bits);
  if (!want.bits)
    return zc_fail(ZS_ENOMEM, "zs_step: out of memory");
  for (int round = 0; round < STEP_MEMBER_ROUNDS && !same; round++) {
    rc = stats_round(c, step, round ? &want : NULL, members, &same, sum_squares, nonfinite);
    if (rc != ZS_OK)
      break;
    if (members->n == 0) {
      rc = zc_fail(ZS_ETIMEDOUT,
                   "zs_step: no rank gave every contribution of step %" PRIu64
                   " to every shard before the trainer timeout; the step cannot complete",
                   step);
      break;
    }
    want.n = members->n;
    memcpy(want.bits, members->bits, want.words * sizeof *want.bits);
  }
  free(want.bits);
  if (rc == ZS_OK && !same)
    rc = zc_fail(ZS_EPROTO,
                 "zs_step: the shards did not agree on the membership of step %" PRIu64
                 " after %d rounds of GradStats",
                 step, STEP_MEMBER_ROUNDS);
  if (rc == ZS_OK && !members_has(members, c->opt.rank))
    rc = zc_fail(ZS_ELEFT,
                 "zs_step: rank %" PRIu32 " was left out of step %" PRIu64
                 " (it missed the shards' trainer timeout); the step went on with %" PRIu32
                 " other rank(s): open the job again to rejoin",
                 c->opt.rank, step, members->n);
  return rc;
}

/* `cs` (cs_len bytes, may be 0) becomes the shards' client state of `step`.
 * A pipelined job's shards accept the Apply before the step is applied
 * (version step - 1) or repeat its outcome (version step). */
static int apply_all(zs_client *c, uint64_t step, const zs_step_options *o, float coef, int skip,
                     const uint8_t *cs, size_t cs_len, const step_members *members) {
  const int ahead = c->sp.pipelined;
  Zshard__V1__ApplyRequest req = ZSHARD__V1__APPLY_REQUEST__INIT;
  uint32_t *list = NULL;
  if (members) {
    req.num_members = members->n;
    if (members->n < c->sp.world_size) {
      list = malloc((members->n + 1) * sizeof *list);
      if (!list)
        return zc_fail(ZS_ENOMEM, "zs_step: out of memory");
      for (uint32_t r = 0; r < c->sp.world_size; r++)
        if (members_has(members, r))
          list[req.n_members++] = r;
      req.members = list;
    }
  }
  req.spec_hash = c->hash;
  req.step = step;
  req.lr = o->lr;
  req.group_lr = (double *)(uintptr_t)o->group_lr; /* packing only reads it */
  req.n_group_lr = o->num_group_lr;
  /* The step's group hyper-parameters: one per group, or none. */
#define STEP_HPARAM(name)                                                                          \
  req.group_##name = (double *)(uintptr_t)o->group_##name;                                         \
  req.n_group_##name = o->group_##name ? c->sp.num_groups : 0;
  STEP_HPARAM(beta1)
  STEP_HPARAM(beta2)
  STEP_HPARAM(eps)
  STEP_HPARAM(weight_decay)
  STEP_HPARAM(momentum)
  STEP_HPARAM(dampening)
#undef STEP_HPARAM
  req.coef = coef;
  req.skip = skip != 0;
  req.client_state.data = (uint8_t *)(uintptr_t)cs; /* packing only reads it */
  req.client_state.len = cs_len;
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op) {
    free(list);
    return ZS_ENOMEM;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("Apply");
    t->msg = &req.base;
    t->resp_desc = &zshard__v1__apply_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  int rc = zc_call_all(op);
  for (uint32_t i = 0; rc == ZS_OK && i < c->nshards; i++) {
    const Zshard__V1__ApplyResponse *r = (const Zshard__V1__ApplyResponse *)op->tasks[i].resp;
    int version_ok = r->version == step || (ahead && r->version + 1 == step);
    if (r->step != step || !version_ok || (r->skipped != 0) != (skip != 0))
      rc = zc_fail(ZS_EPROTO,
                   "zs_step: shard %" PRIu32 " (%s) answered Apply of step %" PRIu64
                   " with step %" PRIu64 ", version %" PRIu64 ", skipped %d",
                   i, c->addr[i], step, r->step, r->version, (int)r->skipped);
  }
  free_responses(op);
  zc_op_release(op);
  free(list);
  return rc;
}

static double ms(uint64_t ns) {
  return (double)ns / 1e6;
}

void zs_step_options_init_sized(zs_step_options *o, size_t size) {
  if (!o || size < sizeof(size_t))
    return;
  zs_step_options own;
  memset(&own, 0, sizeof own);
  zc_struct_write(o, size, &own, sizeof own);
}

static int step_run(zs_client *c, const zs_step_options *o, zs_step_result *out);

int zs_step(zs_client *c, double lr, double max_grad_norm, double loss_scale, zs_step_result *out) {
  zs_step_options o;
  zs_step_options_init(&o);
  o.lr = lr;
  o.max_grad_norm = max_grad_norm;
  o.loss_scale = loss_scale;
  return step_run(c, &o, out);
}

int zs_step_ex(zs_client *c, const zs_step_options *caller_o, zs_step_result *out) {
  if (!caller_o)
    return zc_fail(ZS_EINVAL, "zs_step_ex: no options given");
  zs_step_options o;
  zs_step_options_init(&o); /* the defaults of what an older caller's struct lacks */
  int rc = zc_struct_read(&o, sizeof o, caller_o, "zs_step_ex", "zs_step_options_init");
  if (rc != ZS_OK)
    return rc;
  if (o.reserved0 != 0)
    return zc_fail(ZS_EINVAL, "zs_step_ex: reserved0 must be 0");
  if (!isfinite(o.clip_coef) || o.clip_coef < 0)
    return zc_fail(ZS_EINVAL, "zs_step_ex: clip_coef must be finite and >= 0 (0: computed)");
  if (o.num_group_lr > 0 && !o.group_lr)
    return zc_fail(ZS_EINVAL, "zs_step_ex: num_group_lr is %" PRIu32 " but group_lr is NULL",
                   o.num_group_lr);
  for (uint32_t g = 0; g < o.num_group_lr; g++)
    if (!isfinite(o.group_lr[g]) || o.group_lr[g] < 0)
      return zc_fail(ZS_EINVAL,
                     "zs_step_ex: group_lr[%" PRIu32 "] is %g: each must be finite and >= 0", g,
                     o.group_lr[g]);
  return step_run(c, &o, out);
}

/* With c->mu held (and released on return): waits until this client's
 * pushes of `step` are done, and fails (with the sentence set) if one of them
 * failed or a tensor was not pushed. */
static int drain_pushes_unlock(zs_client *c, uint64_t step, uint64_t t_begin, uint64_t *drain_ns) {
  while (c->inflight_push > 0)
    pthread_cond_wait(&c->cv, &c->mu);
  *drain_ns = clock_now_ns() - t_begin;
  c->push_ns += *drain_ns;
  char msg[ZC_ERR_LEN];
  int rc = ZS_OK;
  if (c->step_error != ZS_OK) {
    rc = c->step_error;
    snprintf(msg, sizeof msg, "zs_step: a push of step %" PRIu64 " failed: %.440s", step,
             c->step_err);
    c->step_error = ZS_OK;
    c->step_err[0] = '\0';
  } else if (find_unpushed_locked(c, msg, sizeof msg)) {
    rc = ZS_ENOTREADY;
  }
  pthread_mutex_unlock(&c->mu);
  if (rc != ZS_OK)
    zc_fail_msg(rc, msg);
  return rc;
}

/* The step is applied on every shard: the client moves to the next step,
 * keeps the scaler's next state (next_scaler, NULL without the dynamic
 * scaler), records the step's timing and starts the prefetches of the next
 * step. Returns the loss scale of the next step. */
static double complete_step(zs_client *c, uint64_t step, const zs_loss_scaler *next_scaler,
                            double loss_scale, uint64_t t_begin, uint64_t drain_ns) {
  zs_request *prefetch[64];
  uint32_t nprefetch = 0;
  const uint64_t now = clock_now_ns();
  pthread_mutex_lock(&c->mu);
  c->step = step + 1;
  memset(c->pushed, 0, ((size_t)c->sp.num_tensors * c->sp.grad_accum + 7) / 8);
  double next_scale = loss_scale;
  if (next_scaler) {
    c->scaler = *next_scaler;
    next_scale = c->scaler.scale;
  }
  zs_timing *tm = &c->last_timing;
  memset(tm, 0, sizeof *tm);
  tm->total_ms = ms(now - c->mark_ns);
  tm->push_ms = ms(c->push_ns);
  tm->pull_wait_ms = ms(c->pull_ns);
  tm->step_ms = ms(now - t_begin - drain_ns);
  tm->compute_ms = tm->total_ms - tm->push_ms - tm->pull_wait_ms - tm->step_ms;
  if (tm->compute_ms < 0)
    tm->compute_ms = 0;
  tm->bytes_pushed = c->bytes_pushed;
  tm->bytes_pulled = c->bytes_pulled;
  tm->retries = atomic_exchange(&c->retries, 0);
  c->mark_ns = now;
  c->push_ns = c->pull_ns = 0;
  c->bytes_pushed = c->bytes_pulled = 0;
  if (c->slots && c->last_pull_wire) {
    uint32_t depth = c->opt.prefetch_depth < 64 ? c->opt.prefetch_depth : 64;
    nprefetch = zc_prefetch_locked(c, 0, depth, step, c->last_pull_wire, prefetch);
  }
  pthread_mutex_unlock(&c->mu);
  for (uint32_t i = 0; i < nprefetch; i++)
    zc_op_submit(prefetch[i]);
  return next_scale;
}

/* The pipelined step (top of the file), with c->mu held (released on
 * return) and `stepping` set. */
static int step_pipelined_unlock(zs_client *c, const zs_step_options *o, uint64_t step,
                                 double loss_scale, zs_step_result *out) {
  char msg[ZC_ERR_LEN];
  int rc = ZS_OK;
  if (o->max_grad_norm > 0 || o->clip_coef > 0) {
    rc = ZS_EINVAL;
    snprintf(msg, sizeof msg,
             "zs_step: job '%s' is pipelined (zs_client_options.pipelined): it has no global "
             "gradient norm, so no clipping; max_grad_norm and clip_coef must be 0",
             c->sp.job);
  } else if (c->step_error != ZS_OK) {
    rc = c->step_error;
    snprintf(msg, sizeof msg, "zs_step: a push of step %" PRIu64 " or %" PRIu64 " failed: %.400s",
             step - 1, step, c->step_err);
    c->step_error = ZS_OK;
    c->step_err[0] = '\0';
  } else if (find_unpushed_locked(c, msg, sizeof msg)) {
    rc = ZS_ENOTREADY;
  }
  pthread_mutex_unlock(&c->mu);
  if (rc != ZS_OK)
    return zc_fail_msg(rc, msg);
  const uint64_t t_begin = clock_now_ns();
  const float coef = (float)(1.0 / loss_scale);
  rc = apply_all(c, step, o, coef, 0, NULL, 0, NULL);
  if (rc != ZS_OK)
    return rc;
  complete_step(c, step, NULL, loss_scale, t_begin, 0);
  if (c->opt.error_feedback)
    zc_ef_after_step(c, 0, 1.0);
  if (out) {
    zs_step_result res;
    memset(&res, 0, sizeof res);
    res.step = step;
    res.version = step;
    res.applied = 1;
    res.grad_norm = NAN;                /* never computed: no statistics */
    res.num_members = c->sp.world_size; /* a pipelined job's membership is fixed */
    res.member_rank = c->opt.rank;
    res.clip_coef = 1.0;
    res.coef = coef;
    res.loss_scale = loss_scale;
    res.next_loss_scale = loss_scale;
    zc_struct_write(out, out->struct_size, &res, sizeof res);
  }
  zc_checkpoint_after_step(c, step);
  return ZS_OK;
}

static int step_run(zs_client *c, const zs_step_options *o, zs_step_result *out) {
  double lr = o->lr, max_grad_norm = o->max_grad_norm, loss_scale = o->loss_scale;
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (out) {
    rc = zc_struct_check(out->struct_size, "zs_step: result", "zs_step_result_init");
    if (rc != ZS_OK) {
      zc_client_leave(c);
      return rc;
    }
  }
  if (!isfinite(lr) || lr < 0 || !isfinite(max_grad_norm) || max_grad_norm < 0 ||
      !isfinite(loss_scale) || loss_scale < 0) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_step: lr, max_grad_norm and loss_scale must be finite and >= 0");
  }
  pthread_mutex_lock(&c->mu);
  if (!c->opened || c->stepping) {
    int opened = c->opened;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return opened ? zc_fail(ZS_EINVAL, "zs_step: another zs_step is running on this client")
                  : zc_fail(ZS_ENOTOPEN, "zs_step: the job is not open");
  }
  /* The group count is frozen once the job is open. */
  if (o->num_group_lr != 0 && o->num_group_lr != c->sp.num_groups) {
    uint32_t ng = c->sp.num_groups;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL,
                   "zs_step_ex: %" PRIu32 " group learning rates given but the job has %" PRIu32
                   " param groups (one per zs_add_group)",
                   o->num_group_lr, ng);
  }
  c->stepping = 1;
  const uint64_t step = c->step;
  step_members members = {0};
  const int own_scaler = loss_scale == 0;
  const int dynamic = own_scaler && c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC;
  /* The scaler as it will be after this step; `stepping` keeps every other
   * writer of c->scaler out until it is stored back. */
  zs_loss_scaler next_scaler = c->scaler;
  if (own_scaler) {
    if (c->opt.loss_scaling == ZS_LOSS_SCALE_STATIC)
      loss_scale = c->opt.static_loss_scale;
    else if (dynamic)
      loss_scale = c->scaler.scale;
    else
      loss_scale = 1.0;
  }

  if (c->sp.pipelined) {
    rc = step_pipelined_unlock(c, o, step, loss_scale, out);
    goto done;
  }

  /* 1. Drain this client's pushes. */
  const uint64_t t_begin = clock_now_ns();
  uint64_t drain_ns = 0;
  if ((rc = drain_pushes_unlock(c, step, t_begin, &drain_ns)) != ZS_OK)
    goto done;

  /* 2. and 3. Statistics over the step's members, norm, clipping. */
  double sum_squares = 0.0;
  int nonfinite = 0;
  members.words = (c->sp.world_size + 63) / 64;
  members.bits = calloc(members.words, sizeof *members.bits);
  if (!members.bits) {
    rc = zc_fail(ZS_ENOMEM, "zs_step: out of memory");
    goto done;
  }
  rc = collect_stats(c, step, &sum_squares, &nonfinite, &members);
  if (rc != ZS_OK)
    goto done;
  /* The mean is over the ranks that contributed: W unless some left. */
  const double reduce_div = c->sp.reduce == SPEC_REDUCE_MEAN ? (double)members.n : 1.0;
  const int overflow = nonfinite || !isfinite(sum_squares);
  const double grad_norm = overflow ? INFINITY : sqrt(sum_squares) / (loss_scale * reduce_div);
  double clip_coef = 1.0;
  if (o->clip_coef > 0) {
    /* Computed elsewhere (over more than this job's parameters, say): used
     * as given, so every trainer must pass the same. */
    clip_coef = o->clip_coef;
  } else if (!overflow && max_grad_norm > 0) {
    clip_coef = max_grad_norm / (grad_norm + 1e-6);
    if (clip_coef > 1.0)
      clip_coef = 1.0;
  }
  /* On overflow coef is not used by the shards, but it must be the same on
   * every trainer (a repeated Apply must match the first), hence finite. */
  const float coef = (float)(clip_coef / loss_scale);

  /* 4. Apply everywhere, with the scaler's next state for the shards to keep. */
  uint8_t cs[ZC_SCALER_BLOB_BYTES];
  size_t cs_len = 0;
  if (dynamic) {
    zs_loss_scaler_update(&next_scaler, overflow);
    zc_scaler_encode(&next_scaler, cs);
    cs_len = sizeof cs;
  }
  rc = apply_all(c, step, o, coef, overflow, cs, cs_len, &members);
  if (rc != ZS_OK)
    goto done;

  /* The step is complete on every shard. */
  double next_scale =
      complete_step(c, step, dynamic ? &next_scaler : NULL, loss_scale, t_begin, drain_ns);
  if (c->opt.error_feedback)
    zc_ef_after_step(c, overflow, next_scale / loss_scale);
  if (out) {
    zs_step_result res;
    memset(&res, 0, sizeof res);
    res.step = step;
    res.version = step;
    res.applied = !overflow;
    res.overflow = overflow;
    res.grad_norm = grad_norm;
    res.clip_coef = clip_coef;
    res.coef = coef;
    res.loss_scale = loss_scale;
    res.next_loss_scale = next_scale;
    res.num_members = members.n;
    for (uint32_t r = 0; r < c->opt.rank; r++)
      res.member_rank += (uint32_t)members_has(&members, r);
    zc_struct_write(out, out->struct_size, &res, sizeof res);
  }
  zc_checkpoint_after_step(c, step);
done:
  free(members.bits);
  pthread_mutex_lock(&c->mu);
  c->stepping = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

int zs_grad_norm(zs_client *c, double loss_scale, double *grad_norm, int *overflow) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!isfinite(loss_scale) || loss_scale < 0) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_grad_norm: loss_scale must be finite and >= 0");
  }
  pthread_mutex_lock(&c->mu);
  if (!c->opened || c->stepping) {
    int opened = c->opened;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return opened ? zc_fail(ZS_EINVAL, "zs_grad_norm: a zs_step is running on this client")
                  : zc_fail(ZS_ENOTOPEN, "zs_grad_norm: the job is not open");
  }
  if (c->sp.pipelined) {
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL,
                   "zs_grad_norm: job '%s' is pipelined (zs_client_options.pipelined): "
                   "the shards keep no gradient statistics",
                   c->sp.job);
  }
  c->stepping = 1;
  const uint64_t step = c->step;
  if (loss_scale == 0)
    loss_scale = c->opt.loss_scaling == ZS_LOSS_SCALE_STATIC    ? c->opt.static_loss_scale
                 : c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC ? c->scaler.scale
                                                                : 1.0;
  /* zs_step's drain, except that a failed push is reported and left for
   * zs_step to report again: this call changes nothing. */
  const uint64_t t_begin = clock_now_ns();
  while (c->inflight_push > 0)
    pthread_cond_wait(&c->cv, &c->mu);
  c->push_ns += clock_now_ns() - t_begin;
  char msg[ZC_ERR_LEN];
  if (c->step_error != ZS_OK) {
    rc = c->step_error;
    snprintf(msg, sizeof msg, "zs_grad_norm: a push of step %" PRIu64 " failed: %.440s", step,
             c->step_err);
  } else if (find_unpushed_locked(c, msg, sizeof msg)) {
    rc = ZS_ENOTREADY;
  }
  pthread_mutex_unlock(&c->mu);
  if (rc != ZS_OK) {
    zc_fail_msg(rc, msg);
    goto done;
  }
  double sum_squares = 0.0;
  int nonfinite = 0;
  step_members members = {.words = (c->sp.world_size + 63) / 64};
  members.bits = calloc(members.words, sizeof *members.bits);
  rc = members.bits ? collect_stats(c, step, &sum_squares, &nonfinite, &members)
                    : zc_fail(ZS_ENOMEM, "zs_grad_norm: out of memory");
  free(members.bits);
  if (rc == ZS_OK) {
    /* zs_step's formula, so that its result reports the same bits. */
    const double reduce_div = c->sp.reduce == SPEC_REDUCE_MEAN ? (double)members.n : 1.0;
    const int of = nonfinite || !isfinite(sum_squares);
    if (grad_norm)
      *grad_norm = of ? INFINITY : sqrt(sum_squares) / (loss_scale * reduce_div);
    if (overflow)
      *overflow = of;
  }
done:
  pthread_mutex_lock(&c->mu);
  c->stepping = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

/* ---- the job's world size ---------------------------------------------------- */

int zc_adopt_world_size(zs_client *c, const zs_request *op) {
  uint32_t W = 0;
  for (uint32_t i = 0; i < c->nshards; i++) {
    const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)op->tasks[i].resp;
    if (r->world_size == 0)
      continue;
    if (W != 0 && r->world_size != W)
      return zc_fail(ZS_EINVAL,
                     "zs_open_job: the shards disagree on the job's world size (%" PRIu32
                     " and %" PRIu32 " on shard %" PRIu32 ")",
                     W, r->world_size, i);
    W = r->world_size;
  }
  if (W == 0 || W == c->sp.world_size)
    return ZS_OK;
  if (c->opt.rank >= W)
    return zc_fail(ZS_EINVAL,
                   "zs_open_job: rank %" PRIu32 " is not a rank of job '%s', whose world size "
                   "is %" PRIu32,
                   c->opt.rank, c->sp.job, W);
  /* Only the membership's rank space follows the job: the spec hash does
   * not cover it, and the contributions a step waits for are the shards'
   * business (their members). */
  c->sp.world_size = W;
  return ZS_OK;
}

/* ---- joining and leaving (issue 26) ------------------------------------------ */

#define ZC_JOIN_TRIES 64 /* rounds a join may chase the shards before it gives up */

/* ChangeMembership on shard i; ZS_OK or the shard's status, with st. */
static int member_call(zs_client *c, uint32_t i, Zshard__V1__MemberChange change, uint64_t step,
                       rpc_status *st) {
  Zshard__V1__ChangeMembershipRequest req = ZSHARD__V1__CHANGE_MEMBERSHIP_REQUEST__INIT;
  req.spec_hash = c->hash;
  req.rank = c->opt.rank;
  req.change = change;
  req.step = step;
  Zshard__V1__ChangeMembershipResponse *r = NULL;
  int rc = zc_call(c, i, ZC_METHOD("ChangeMembership"), &req.base,
                   &zshard__v1__change_membership_response__descriptor, (ProtobufCMessage **)&r,
                   c->opt.rpc_timeout_ms, st);
  if (r)
    protobuf_c_message_free_unpacked(&r->base, NULL);
  return rc;
}

/* Waits until every shard applied step - 1, the version a joiner admitted at
 * `step` starts from (a push of `step` before would be refused ZS_ESTEP), at
 * most step_timeout_ms. A join is rare: GetInfo is polled with backoff. */
static int member_wait_version(zs_client *c, uint64_t step) {
  uint64_t deadline = clock_now_ms() + c->opt.step_timeout_ms, backoff = 5;
  for (uint32_t i = 0; i < c->nshards;) {
    Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
    Zshard__V1__GetInfoResponse *r = NULL;
    rpc_status st;
    memset(&st, 0, sizeof st);
    int rc =
        zc_call(c, i, ZC_METHOD("GetInfo"), &req.base, &zshard__v1__get_info_response__descriptor,
                (ProtobufCMessage **)&r, c->opt.rpc_timeout_ms, &st);
    uint64_t version = rc == ZS_OK ? r->version : 0;
    if (r)
      protobuf_c_message_free_unpacked(&r->base, NULL);
    if (rc != ZS_OK)
      return zc_fail(rc, "zs_open_job: GetInfo on shard %" PRIu32 " (%s): %.400s", i, c->addr[i],
                     st.message[0] ? st.message : zs_strerror(rc));
    if (version + 1 >= step) {
      i++;
      continue;
    }
    if (clock_now_ms() >= deadline || zc_backoff_wait(c, backoff))
      return zc_fail(ZS_ETIMEDOUT,
                     "zs_open_job: rank %" PRIu32 " joined at step %" PRIu64 " but shard %" PRIu32
                     " is still at version %" PRIu64 " after %" PRIu32 " ms",
                     c->opt.rank, step, i, version, c->opt.step_timeout_ms);
    backoff = backoff < 200 ? 2 * backoff : 200;
  }
  return ZS_OK;
}

int zc_member_join(zs_client *c, uint64_t *step) {
  int join = c->opt.open_mode == ZS_OPEN_JOIN;
  uint64_t s = *step, lead = 1;
  /* A late try aims further ahead each time (1, 2, 4, ... up to 16 steps):
   * the others keep training while a round of calls goes over the shards, so
   * aiming only one step further could lose the race for as long as they run. */
  for (int tries = 0; tries < ZC_JOIN_TRIES; tries++, s += lead, lead = lead < 16 ? 2 * lead : 16) {
    int late = 0;
    for (uint32_t i = 0; i < c->nshards && !late; i++) {
      rpc_status st;
      memset(&st, 0, sizeof st);
      int rc = member_call(c, i, ZSHARD__V1__MEMBER_CHANGE__MEMBER_CHANGE_JOIN, s, &st);
      if (rc == ZS_ESTEP) {
        /* This shard decided step s already: every shard is asked for the
         * next one (a shard that admitted the rank at s drops it again). */
        late = 1;
      } else if (rc != ZS_OK && !join && (rc == ZS_EINVAL || rc == ZS_EUNIMPL) && i == 0) {
        return ZS_OK; /* a fixed membership, or an older server */
      } else if (rc != ZS_OK) {
        return zc_fail(rc,
                       "zs_open_job: rank %" PRIu32 " could not join at step %" PRIu64
                       " on shard %" PRIu32 " (%s): %.400s",
                       c->opt.rank, s, i, c->addr[i], st.message[0] ? st.message : zs_strerror(rc));
      }
    }
    if (!late) {
      int rc = s > *step ? member_wait_version(c, s) : ZS_OK;
      if (rc == ZS_OK)
        *step = s;
      return rc;
    }
  }
  return zc_fail(ZS_ETIMEDOUT,
                 "zs_open_job: rank %" PRIu32 " could not join: in %d rounds (up to step %" PRIu64
                 ") some shard had always decided the step before every one admitted it",
                 c->opt.rank, ZC_JOIN_TRIES, s);
}

void zc_member_leave(zs_client *c) {
  pthread_mutex_lock(&c->mu);
  int go = c->opened && !c->stepping && !c->sp.pipelined;
  uint64_t step = c->step;
  pthread_mutex_unlock(&c->mu);
  for (uint32_t i = 0; go && i < c->nshards; i++) {
    rpc_status st;
    memset(&st, 0, sizeof st);
    int rc = member_call(c, i, ZSHARD__V1__MEMBER_CHANGE__MEMBER_CHANGE_LEAVE, step, &st);
    if (i == 0 && rc != ZS_OK)
      return; /* a fixed membership (or no such call, or no shard): nothing to leave */
  }
}
