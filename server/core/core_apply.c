/*
 * core_apply — the Apply of a step as a caller thread registers it: its
 * checks (job, step, members, plans), its hyper-parameters (the step's own
 * where a trainer sent them, else the spec's), the recorded outcome a
 * repeat gets, and the queueing for the worker (core_worker.c), which runs
 * it (see core.h for the contract; threads and locks: the top of core.c).
 */
#include "common/base/status.h"
#include "server/core/core_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/spec_optim.h"

/* ------------------------------------------------- a step's hyper-parameters */

/* The optimizer parameters of group g with everything that does not depend on
 * the step filled in. */
static optim_params core_group_params(const core *c, uint32_t g) {
  return optim_params_of_group(&c->spec.groups[g], c->spec.param_dtype);
}

/* p with group g's values of this step's hyper-parameters (hp may be NULL:
 * the spec's; its counts are checked, core_check_hparams). */
static void core_step_override(optim_params *p, const core_step_hparams *hp, uint32_t g) {
  if (!hp)
    return;
#define CORE_HP_SET(up, name)                                                                      \
  if (hp->n[CORE_HP_##up])                                                                         \
    p->name = hp->v[CORE_HP_##up][g];
  CORE_STEP_HPARAMS(CORE_HP_SET)
#undef CORE_HP_SET
}

/* The queued apply's hyper-parameters as a view of apply_hp. Called with mu
 * held or on the worker while the apply is queued or running (apply_hp does
 * not change then). */
static core_step_hparams core_queued_hparams(const core *c) {
  core_step_hparams hp;
  memset(&hp, 0, sizeof hp);
  for (unsigned k = 0; k < CORE_NHP; k++)
    if (c->apply_hp_mask & (1u << k)) {
      hp.v[k] = c->apply_hp + (size_t)k * c->spec.num_groups;
      hp.n[k] = c->spec.num_groups;
    }
  return hp;
}

/* Copies hp into dst (CORE_NHP arrays of num_groups) and returns the mask of
 * the given arrays. hp is checked (core_check_hparams). */
static unsigned core_store_hparams(const core *c, double *dst, const core_step_hparams *hp) {
  unsigned mask = 0;
  for (unsigned k = 0; hp && k < CORE_NHP; k++)
    if (hp->n[k]) {
      memcpy(dst + (size_t)k * c->spec.num_groups, hp->v[k], hp->n[k] * sizeof *dst);
      mask |= 1u << k;
    }
  return mask;
}

/* 1 if hp carries the values stored in `stored` under `mask`. */
static int core_same_hparams(const core *c, const core_step_hparams *hp, const double *stored,
                             unsigned mask) {
  for (unsigned k = 0; k < CORE_NHP; k++) {
    uint32_t n = hp ? hp->n[k] : 0;
    if (!n != !(mask & (1u << k)))
      return 0;
    for (uint32_t g = 0; g < n; g++)
      if (hp->v[k][g] != stored[(size_t)k * c->spec.num_groups + g])
        return 0;
  }
  return 1;
}

static const char *const core_hparam_names[CORE_NHP] = {
#define CORE_HP_NAME(up, name) #name,
    CORE_STEP_HPARAMS(CORE_HP_NAME)
#undef CORE_HP_NAME
};

/* Refuses (ZS_EINVAL) a count other than 0 or the group count, and values
 * that torch's state rules forbid: the spec decided whether an SGD group has
 * a momentum buffer, so its momentum stays 0 or above 0 with it, and
 * nesterov keeps torch's "momentum > 0 and dampening 0". The ranges are the
 * service's. Called with mu held and the job open. */
static int core_check_hparams(const core *c, const core_step_hparams *hp, char *err,
                              size_t errlen) {
  for (unsigned k = 0; hp && k < CORE_NHP; k++)
    if (hp->n[k] != 0 && (hp->n[k] != c->spec.num_groups || !hp->v[k]))
      return status_fail(err, errlen, ZS_EINVAL,
                         "apply carries %u values of group_%s but job '%s' has %u param groups",
                         hp->n[k], core_hparam_names[k], c->spec.job, c->spec.num_groups);
  for (uint32_t g = 0; hp && g < c->spec.num_groups; g++) {
    const spec_group *sg = &c->spec.groups[g];
    optim_params p = core_group_params(c, g);
    core_step_override(&p, hp, g);
    /* The step's values as a group: the spec's checks apply to them too,
     * and they may not change which state arrays the group keeps (the
     * arenas were sized from the spec). */
    spec_group now = *sg;
#define COPY_FIELD(kind, name, proto) now.name = p.name;
    SPEC_OPTIM_FIELDS(COPY_FIELD)
#undef COPY_FIELD
    const spec_optim *o = spec_optim_of(sg->optimizer);
    /* Only SGD's arrays depend on a hyper-parameter (its momentum). */
    if (o && o->state(&now) != o->state(sg))
      return status_fail(err, errlen, ZS_EINVAL,
                         "param group %u was created with momentum %g, so it %s momentum "
                         "buffer: its momentum cannot become %g (it may change only between "
                         "values above 0); nothing was applied",
                         g, sg->momentum, sg->momentum != 0 ? "has a" : "has no", p.momentum);
    char why[256];
    if (o && o->check(&now, g, why, sizeof why) != 0)
      return status_fail(err, errlen, ZS_EINVAL, "%s; nothing was applied", why);
  }
  return 0;
}

/* gradient = acc * this: coef, or coef / W rounded once under
 * GRAD_REDUCE_MEAN. */
float core__grad_scale(const core *c, float coef) {
  /* The mean is over the ranks whose contributions were summed: W for a
   * fixed membership, so its bits are the same as before elastic jobs. */
  return c->spec.reduce == SPEC_REDUCE_MEAN ? (float)((double)coef / (double)c->stat_members.n)
                                            : coef;
}

/* The optimizer parameters of group g for this step: the step's
 * hyper-parameters where the queued apply carries them (core_step_override),
 * its lr (glr[g], or lr times the group's lr_scale), the step count and the
 * gradient scale. Every plan of a step, whole-range or per piece, is built
 * here. */
optim_params core__step_params(const core *c, uint32_t g, double lr, const double *glr,
                               uint64_t step, float grad_scale) {
  optim_params p = core_group_params(c, g);
  const core_step_hparams hp = core_queued_hparams(c);
  core_step_override(&p, &hp, g);
  p.lr = glr ? glr[g] : lr * c->spec.groups[g].lr_scale;
  p.step = step;
  p.grad_scale = grad_scale;
  return p;
}

/* Reorders c->batch so that its pieces with a gradient come first and sets
 * c->nwork to their count (the order of the pieces changes no bit: the
 * kernel is elementwise and they are disjoint). With state_rw exclusive,
 * every piece of the batch complete. */
/* ---------------------------------------------------------------- apply */

static int core_same_apply(double lr, float coef, int skip, double lr2, float coef2, int skip2) {
  return lr == lr2 && coef == coef2 && !skip == !skip2;
}

static int core_same_glr(const double *a, uint32_t na, const double *b, uint32_t nb) {
  if (na != nb)
    return 0;
  for (uint32_t i = 0; i < na; i++)
    if (a[i] != b[i])
      return 0;
  return 1;
}

/* An Apply of a step that is already applied (`last`: compare with the
 * arguments it was applied with) or queued (with the queued apply's) is
 * answered again only when it repeats those arguments exactly: a retried
 * Apply must not turn into a second, different update. 0 if it does,
 * ZS_EEXIST naming both otherwise. Called with mu held. */
static int core_apply_same(const core *c, int last, uint64_t step, double lr, float coef, int skip,
                           const double *group_lr, uint32_t ngroup_lr, const core_step_hparams *hp,
                           char *err, size_t errlen) {
  double had_lr = last ? c->last_lr : c->apply_lr;
  float had_coef = last ? c->last_coef : c->apply_coef;
  int had_skip = last ? c->last_skip : c->apply_skip;
  int same_glr = last ? core_same_glr(group_lr, ngroup_lr, c->last_glr, c->last_nglr)
                      : core_same_glr(group_lr, ngroup_lr, c->apply_glr, c->apply_nglr);
  int same_hp = last ? core_same_hparams(c, hp, c->last_hp, c->last_hp_mask)
                     : core_same_hparams(c, hp, c->apply_hp, c->apply_hp_mask);
  if (core_same_apply(lr, coef, skip, had_lr, had_coef, had_skip) && same_glr && same_hp)
    return 0;
  return status_fail(err, errlen, ZS_EEXIST,
                     "step %" PRIu64 " %s with lr=%g coef=%g skip=%d%s, not lr=%g coef=%g skip=%d",
                     step, last ? "was applied" : "is being applied", had_lr, (double)had_coef,
                     had_skip,
                     !same_glr  ? " and other group learning rates"
                     : !same_hp ? " and other group hyper-parameters"
                                : "",
                     lr, (double)coef, !!skip);
}

/* Builds the plan every param group would run with these arguments and
 * refuses them when a scalar the kernels see is not a finite float: a lr of
 * 1e300 is a finite double, but (float)-lr is -inf and so would every weight
 * be. Checked for a skip too, so that a refusal does not depend on it. Called
 * with mu held, the job open and group_lr already checked. */
static int core_apply_check_plans(core *c, double lr, const double *group_lr, uint32_t ngroup_lr,
                                  const core_step_hparams *hp, float coef, char *err,
                                  size_t errlen) {
  float grad_scale = core__grad_scale(c, coef);
  for (uint32_t g = 0; g < c->spec.num_groups; g++) {
    optim_params p = core_group_params(c, g);
    core_step_override(&p, hp, g);
    p.lr = ngroup_lr ? group_lr[g] : lr * c->spec.groups[g].lr_scale;
    p.step = c->optimizer_steps + 1;
    p.grad_scale = grad_scale;
    optim_plan plan;
    optim_plan_init(&plan, &p);
    const char *bad = optim_plan_bad_scalar(&plan);
    if (bad)
      return status_fail(err, errlen, ZS_EINVAL,
                         "apply with lr=%g coef=%g would give param group %u a %s that is not a "
                         "finite float32 (group lr %g, step %" PRIu64 "); nothing was applied",
                         lr, (double)coef, g, bad, p.lr, p.step);
  }
  return 0;
}

/* Queues the apply of the pending step with these arguments and wakes the
 * worker. Called with mu held. */
static void core_apply_record(core *c, double lr, const double *group_lr, uint32_t ngroup_lr,
                              const core_step_hparams *hp, float coef, int skip) {
  c->apply_state = APPLY_QUEUED;
  c->apply_lr = lr;
  c->apply_coef = coef;
  c->apply_skip = !!skip;
  c->apply_nglr = ngroup_lr;
  if (ngroup_lr)
    memcpy(c->apply_glr, group_lr, ngroup_lr * sizeof *c->apply_glr);
  c->apply_hp_mask = core_store_hparams(c, c->apply_hp, hp);
  pthread_cond_signal(&c->worker_cv);
}

int core_apply(core *c, uint64_t hash, uint64_t step, double lr, float coef, int skip,
               core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen) {
  return core_apply_groups(c, hash, step, lr, NULL, 0, coef, skip, cb, arg, out, err, errlen);
}

int core_apply_groups(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                      uint32_t ngroup_lr, float coef, int skip, core_apply_cb cb, void *arg,
                      core_apply_result *out, char *err, size_t errlen) {
  return core_apply_step(c, hash, step, lr, group_lr, ngroup_lr, NULL, coef, skip, cb, arg, out,
                         err, errlen);
}

int core_apply_step(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                    uint32_t ngroup_lr, const core_step_hparams *hp, float coef, int skip,
                    core_apply_cb cb, void *arg, core_apply_result *out, char *err, size_t errlen) {
  return core_apply_members(c, hash, step, lr, group_lr, ngroup_lr, hp, NULL, coef, skip, cb, arg,
                            out, err, errlen);
}

/* Refuses an Apply whose membership is not `have` (NULL stands for every
 * rank the step expected, as an older client's Apply). Called with mu held. */
static int core_apply_check_members(const core *c, uint64_t step, const core_members *members,
                                    const core_members *have, char *err, size_t errlen) {
  if (members ? core_members_equal(members, have) : have->n == c->members.n)
    return 0;
  return status_fail(err, errlen, ZS_EINVAL,
                     "Apply of step %" PRIu64 " names %u member rank(s) but shard %u sums %u "
                     "(the trainers must agree on the membership through GradStats first); "
                     "nothing was applied",
                     step, members ? members->n : c->members.n, c->shard_id, have->n);
}

/* The membership side of an Apply of the pending step (gated job, mu
 * held): a backup of a replica set is never asked for statistics, so the
 * Apply makes it sum the agreed set (a subset of what it summed, or of the
 * ranks complete here while it still waits for others: `decided`), setting
 * *narrowed; otherwise, once the set cannot change any more, `members` must
 * be it. Before the statistics are ready the set may still change: the
 * Apply then waits (ENOTREADY, in the caller) rather than be compared. */
static int core_apply_narrow(core *c, uint64_t step, const core_members *members, int decided,
                             int *narrowed, char *err, size_t errlen) {
  if (c->elastic && members && c->apply_state == APPLY_NONE &&
      ((c->stats_phase == STATS_READY && !core_members_equal(members, &c->stat_members) &&
        core__members_subset(members, &c->stat_members)) ||
       (c->stats_phase == STATS_WAITING && !c->frozen && decided))) {
    core__members_narrow(c, members);
    *narrowed = 1;
    return 0;
  }
  if (c->apply_state != APPLY_NONE || c->stats_phase == STATS_READY)
    return core_apply_check_members(c, step, members, &c->stat_members, err, errlen);
  return 0;
}

int core_apply_members(core *c, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                       uint32_t ngroup_lr, const core_step_hparams *hp, const core_members *members,
                       float coef, int skip, core_apply_cb cb, void *arg, core_apply_result *out,
                       char *err, size_t errlen) {
  waiter *w = NULL;
  /* Every named rank complete here (core_apply_narrow), read before mu. */
  int decided = members && core__members_complete_for(c, members);
  pthread_mutex_lock(&c->mu);
  int rc = c->stop ? status_fail(err, errlen, ZS_ECLOSED, "shard is shutting down")
                   : core__check_job(c, hash, err, errlen);
  if (rc != 0)
    goto done;
  /* A learning rate or coefficient that is not finite would poison every
   * weight of the shard. */
  if (!isfinite(lr) || lr < 0.0 || !isfinite(coef)) {
    rc = status_fail(err, errlen, ZS_EINVAL, "apply needs a finite lr >= 0 and a finite coef");
    goto done;
  }
  if (ngroup_lr != 0 && (ngroup_lr != c->spec.num_groups || !group_lr)) {
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "apply carries %u group learning rates but job '%s' has %u param groups",
                     ngroup_lr, c->spec.job, c->spec.num_groups);
    goto done;
  }
  for (uint32_t g = 0; g < ngroup_lr; g++) {
    if (!isfinite(group_lr[g]) || group_lr[g] < 0.0) {
      rc = status_fail(err, errlen, ZS_EINVAL,
                       "apply's learning rate of group %u is %g: it must be finite and >= 0", g,
                       group_lr[g]);
      goto done;
    }
  }
  if (c->pipelined && skip) {
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "job '%s' is pipelined: a step cannot be skipped, its pieces are applied as "
                     "their contributions arrive",
                     c->spec.job);
    goto done;
  }
  if ((rc = core_check_hparams(c, hp, err, errlen)) != 0 ||
      (rc = core_apply_check_plans(c, lr, group_lr, ngroup_lr, hp, coef, err, errlen)) != 0)
    goto done;
  if (c->last_apply_valid && step == c->version) {
    if ((rc = core_apply_check_members(c, step, members, &c->last_members, err, errlen)) != 0)
      goto done;
    rc = core_apply_same(c, 1, step, lr, coef, skip, group_lr, ngroup_lr, hp, err, errlen);
    if (rc == 0 && out)
      *out = c->last_apply;
    goto done;
  }
  if (c->ckpt_loaded && (step > c->version + 1 || step == c->version)) {
    rc = core__behind(c, "apply", step, err, errlen);
    goto done;
  }
  if (step != c->version + 1) {
    rc = status_fail(err, errlen, ZS_ESTEP,
                     "apply for step %" PRIu64 " but shard %u expects step %" PRIu64, step,
                     c->shard_id, c->version + 1);
    goto done;
  }
  int narrowed = 0;
  if (!c->pipelined &&
      (rc = core_apply_narrow(c, step, members, decided, &narrowed, err, errlen)) != 0)
    goto done;
  if (c->apply_state != APPLY_NONE) {
    rc = core_apply_same(c, 0, step, lr, coef, skip, group_lr, ngroup_lr, hp, err, errlen);
    if (rc != 0)
      goto done;
  } else if (!c->pipelined) {
    /* Narrowed: the statistics over `members` run first, then this apply
     * (the worker's order); the trainers checked their overflow already. */
    if (!narrowed && c->stats_phase != STATS_READY) {
      uint64_t want = (uint64_t)c->npieces * c->WM;
      uint64_t have = atomic_load_explicit(&c->contributions, memory_order_relaxed);
      rc = status_fail(err, errlen, ZS_ENOTREADY,
                       "step %" PRIu64 " still misses %" PRIu64 " of %" PRIu64
                       " contributions on shard %u",
                       step, want - (have < want ? have : want), want, c->shard_id);
      goto done;
    }
    if (!narrowed && c->stats.nonfinite && !skip) {
      rc = status_fail(err, errlen, ZS_ENONFINITE,
                       "step %" PRIu64 " has non-finite gradients on shard %u: it must be skipped",
                       step, c->shard_id);
      goto done;
    }
  }
  if (c->apply_state == APPLY_NONE && !c->pipelined && c->initialized_pieces < c->npieces) {
    rc = status_fail(err, errlen, ZS_ENOTREADY,
                     "%u of %u pieces of shard %u have no initial weights",
                     c->npieces - c->initialized_pieces, c->npieces, c->shard_id);
    goto done;
  }
  if (c->pipelined) {
    /* Apply ahead: the arguments are recorded (or a repeat matched them) and
     * the worker applies each piece once its contributions are in. Nobody
     * waits for that here: the pulls of each piece do (core_wait_pieces).
     * version < step tells the caller the step is not applied yet. */
    if (c->apply_state == APPLY_NONE)
      core_apply_record(c, lr, group_lr, ngroup_lr, hp, coef, 0);
    if (out)
      *out = (core_apply_result){
          .step = step, .version = c->version, .optimizer_steps = c->optimizer_steps};
    goto done;
  }
  if (cb) {
    w = calloc(1, sizeof *w);
    if (!w) {
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory registering an apply");
      goto done;
    }
    w->kind = WAITER_APPLY;
    w->key = step;
    w->cb.apply = cb;
    w->arg = arg;
    waiter_push(&c->apply_waiters, w);
  }
  if (c->apply_state == APPLY_NONE)
    core_apply_record(c, lr, group_lr, ngroup_lr, hp, coef, skip);
  rc = CORE_PENDING;
done:
  pthread_mutex_unlock(&c->mu);
  return rc;
}

void core_set_applied_hook(core *c, core_applied_fn fn, void *arg) {
  pthread_mutex_lock(&c->mu);
  c->applied_fn = fn;
  c->applied_arg = fn ? arg : NULL;
  pthread_mutex_unlock(&c->mu);
}
