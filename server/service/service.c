/*
 * service — request checks and the observer between the transports and the
 * core (see service.h).
 *
 * Threads: none of its own. Every function runs on its caller's thread;
 * on_applied runs on the core's worker thread (core_set_applied_hook). The
 * service's fields are written once by service_create, before any transport
 * can call in, and only read afterwards, so it needs no lock.
 */
#include "server/service/service.h"

#include <ctype.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/base/status.h"
#include "common/model/layout.h"
#include "common/model/spec_optim.h"

struct service {
  core *core;
  service_observer obs;
  int hooked; /* this service installed the core's applied hook */
  service_limits limits;
};

/* A double the optimizer will see rounded to float: finite, and finite
 * after the rounding. */
static int finite_f32(double x) {
  return isfinite(x) && fabs(x) <= FLT_MAX;
}

static void on_applied(void *arg, const core_apply_result *r) {
  service *s = arg;
  s->obs.applied(s->obs.arg, r);
}

int service_create(core *c, const service_observer *obs, service **out) {
  if (!c || !out)
    return ZS_EINVAL;
  service *s = calloc(1, sizeof *s);
  if (!s)
    return ZS_ENOMEM;
  s->core = c;
  s->limits = service_limits_for_memory(service_memory_limit(NULL));
  if (obs)
    s->obs = *obs;
  if (s->obs.applied) {
    core_set_applied_hook(c, on_applied, s);
    s->hooked = 1;
  }
  *out = s;
  return 0;
}

void service_destroy(service *s) {
  if (!s)
    return;
  if (s->hooked)
    core_set_applied_hook(s->core, NULL, NULL);
  free(s);
}

core *service_core(const service *s) {
  return s->core;
}

/* ------------------------------------------------------- the shard's state */

void service_info(service *s, core_info *out) {
  core_get_info(s->core, out);
}

void service_counters(service *s, core_counters *out) {
  core_get_counters(s->core, out);
}

void service_membership(service *s, core_membership *out) {
  core_get_membership(s->core, out);
}

size_t service_client_state(service *s, void *buf, size_t cap, uint64_t *version) {
  return core_get_client_state(s->core, buf, cap, version);
}

int service_spec_copy(service *s, spec *out, uint64_t *hash) {
  return core_spec_copy(s->core, out, hash);
}

int service_checkpoint_origin(service *s, uint64_t *step, int *untouched) {
  return core_checkpoint_origin(s->core, step, untouched);
}

/* ------------------------------------------------------------- job limits */

/* The first line of file root + path, or "" when it cannot be read. */
static void read_line(const char *root, const char *path, char *buf, size_t cap) {
  char full[4096];
  buf[0] = '\0';
  if (snprintf(full, sizeof full, "%s%s", root, path) >= (int)sizeof full)
    return;
  FILE *f = fopen(full, "re");
  if (!f)
    return;
  if (!fgets(buf, (int)cap, f))
    buf[0] = '\0';
  fclose(f);
  buf[strcspn(buf, "\n")] = '\0';
}

/* A cgroup limit file's value, or UINT64_MAX for "max", a missing file or a
 * v1 "no limit" (the largest page multiple below 2^63). */
static uint64_t cgroup_limit(const char *root, const char *path) {
  char line[64];
  read_line(root, path, line, sizeof line);
  if (!isdigit((unsigned char)line[0]))
    return UINT64_MAX;
  char *end;
  unsigned long long v = strtoull(line, &end, 10);
  return *end || v >= (UINT64_C(1) << 62) ? UINT64_MAX : (uint64_t)v;
}

static uint64_t min_u64(uint64_t a, uint64_t b) {
  return a < b ? a : b;
}

/* The limits of this process's own cgroups, as /proc/self/cgroup names
 * them: "0::/path" (v2) and "N:...memory...:/path" (v1). */
static uint64_t own_cgroup_limit(const char *root) {
  char full[4096], line[1024];
  uint64_t lim = UINT64_MAX;
  if (snprintf(full, sizeof full, "%s/proc/self/cgroup", root) >= (int)sizeof full)
    return lim;
  FILE *f = fopen(full, "re");
  if (!f)
    return lim;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2 || c2[1] != '/' || c2[2] == '\0' || strstr(c2, ".."))
      continue;
    *c2 = '\0';
    char path[1200];
    if (strcmp(c1 + 1, "") == 0 && line[0] == '0')
      snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", c2 + 1);
    else if (strstr(c1 + 1, "memory"))
      snprintf(path, sizeof path, "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", c2 + 1);
    else
      continue;
    lim = min_u64(lim, cgroup_limit(root, path));
  }
  fclose(f);
  return lim;
}

uint64_t service_memory_limit(const char *root) {
  root = root ? root : "";
  uint64_t lim = cgroup_limit(root, "/sys/fs/cgroup/memory.max");
  lim = min_u64(lim, cgroup_limit(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  lim = min_u64(lim, own_cgroup_limit(root));
  char full[4096], line[256];
  uint64_t total = UINT64_MAX;
  FILE *f = NULL;
  if (snprintf(full, sizeof full, "%s/proc/meminfo", root) < (int)sizeof full)
    f = fopen(full, "re");
  while (f && fgets(line, sizeof line, f)) {
    unsigned long long kb;
    if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) {
      total = (uint64_t)kb * 1024u;
      break;
    }
  }
  if (f)
    fclose(f);
  lim = min_u64(lim, total);
  /* The process's own address-space limit (ulimit -v, prlimit --as) bounds
   * what it can map, whatever the machine has; only for the real process
   * (a test's `root` describes another machine). */
  struct rlimit as;
  if (!root[0] && getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    lim = min_u64(lim, (uint64_t)as.rlim_cur);
  return lim == UINT64_MAX ? 0 : lim;
}

service_limits service_limits_for_memory(uint64_t memory) {
  service_limits l = {0, 0};
  if (memory == 0)
    return l;
  l.max_params = memory / 4u * 3u / SERVICE_PARAM_BYTES;
  l.max_tensors = min_u64(memory / 16u / SERVICE_TENSOR_BYTES, SPEC_MAX_TENSORS);
  /* A machine too small for one tensor still gets a usable answer. */
  l.max_params = l.max_params ? l.max_params : 1;
  l.max_tensors = l.max_tensors ? l.max_tensors : 1;
  return l;
}

void service_set_limits(service *s, const service_limits *l) {
  s->limits = *l;
}

service_limits service_get_limits(const service *s) {
  return s->limits;
}

/* Pieces the layout will make of the spec (layout.h's rule: a tensor of at
 * least split_threshold elements is one slice per shard, minus empty trailing
 * ones; any other is one piece), counted without building it. */
static uint64_t spec_pieces(const spec *sp) {
  uint64_t n = 0;
  for (uint32_t t = 0; t < sp->num_tensors; t++) {
    uint64_t numel = sp->tensors[t].numel;
    if (numel < sp->split_threshold || sp->num_shards <= 1) {
      n++;
      continue;
    }
    uint64_t c = (numel + sp->num_shards - 1) / sp->num_shards;
    c = (c + LAYOUT_ALIGN_ELEMS - 1) / LAYOUT_ALIGN_ELEMS * LAYOUT_ALIGN_ELEMS;
    n += (numel + c - 1) / c;
  }
  return n;
}

/* What the core keeps per piece of its own besides the arenas: the piece's
 * state (lock, counters, pointers) and its CRC, plus the bitmap of W * M
 * contributions. An upper bound, not sizeof: the struct is the core's. */
#define PIECE_STATE_BYTES 160u

static int over_tensors(const spec *sp, uint64_t need, uint64_t limit, char *err, size_t errlen) {
  return status_fail(err, errlen, ZS_ELIMIT,
                     "job '%s' needs %" PRIu64 " bytes of bookkeeping on this shard (%" PRIu32
                     " tensors, %" PRIu64 "-bit contribution bitmaps per piece), more than "
                     "--max-tensors (ZSHARD_MAX_TENSORS) %" PRIu64 " x %u bytes allows; nothing "
                     "was opened",
                     sp->job, need, sp->num_tensors, (uint64_t)sp->world_size * sp->grad_accum,
                     limit, SERVICE_TENSOR_BYTES);
}

/* Refuses a job beyond the limits before the core allocates anything; the
 * layout is built here only once its size is known to fit. */
static int check_limits(service *s, const spec *sp, char *err, size_t errlen) {
  service_limits lim = s->limits;
  core_info info;
  core_get_info(s->core, &info);
  if (sp->num_shards != info.num_shards || (lim.max_params == 0 && lim.max_tensors == 0))
    return 0; /* the core words the first; the second is no limit */
  if (info.has_job && info.spec_hash == spec_hash(sp))
    return 0; /* a join: the shard holds it already */
  if (lim.max_tensors && sp->num_tensors > lim.max_tensors)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "job '%s' has %" PRIu32 " tensors, more than this shard's limit of %" PRIu64
                       " (--max-tensors, ZSHARD_MAX_TENSORS); nothing was opened",
                       sp->job, sp->num_tensors, lim.max_tensors);
  uint64_t budget = lim.max_tensors ? lim.max_tensors * SERVICE_TENSOR_BYTES : UINT64_MAX;
  uint64_t names = 0;
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    names += sizeof(spec_tensor) + strlen(sp->tensors[t].name) + 1u + sizeof(uint32_t);
  uint64_t pieces = spec_pieces(sp);
  uint64_t need = names + pieces * (sizeof(layout_piece) + sizeof(uint32_t));
  if (need > budget)
    return over_tensors(sp, need, lim.max_tensors, err, errlen);
  layout l;
  if (layout_build(sp, &l) != 0)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory computing job '%s''s layout",
                       sp->job);
  uint64_t elems = l.shard_elems[info.shard_id], mine = l.shard_pieces[info.shard_id];
  layout_free(&l);
  uint64_t bitmap = ((uint64_t)sp->world_size * sp->grad_accum + 63u) / 64u * 8u;
  need += mine * (PIECE_STATE_BYTES + bitmap);
  if (need > budget)
    return over_tensors(sp, need, lim.max_tensors, err, errlen);
  if (lim.max_params && elems > lim.max_params)
    return status_fail(err, errlen, ZS_ELIMIT,
                       "job '%s' puts %" PRIu64 " parameters on shard %" PRIu32
                       ", more than its limit of %" PRIu64
                       " (--max-params, ZSHARD_MAX_PARAMS); nothing was opened",
                       sp->job, elems, info.shard_id, lim.max_params);
  return 0;
}

/* ------------------------------------------------------------ job requests */

/* spec_validate took every hyper-parameter as a finite double in its range;
 * the kernels see each rounded to float, where 1e300 is infinite and Adam's
 * eps of 1e-50 is 0 (then m / (sqrt(v) + eps) is 0 / 0 on the first step). */
static int groups_check_f32(const spec *sp, char *err, size_t errlen) {
  for (uint32_t g = 0; g < sp->num_groups; g++) {
    const spec_group *grp = &sp->groups[g];
#define CHECK_F64(name)                                                                            \
  if (!finite_f32(grp->name))                                                                      \
    return status_fail(err, errlen, ZS_EINVAL,                                                     \
                       "param group %" PRIu32 ": %s %g is not finite as a float32", g, #name,      \
                       grp->name);
#define CHECK_FLAG(name)
#define CHECK_FLAG_NEGATED(name)
#define CHECK_FIELD(kind, name, proto) CHECK_##kind(name)
    SPEC_GROUP_FIELDS(CHECK_FIELD)
#undef CHECK_FIELD
#undef CHECK_F64
#undef CHECK_FLAG
#undef CHECK_FLAG_NEGATED
    const spec_optim *o = spec_optim_of(grp->optimizer);
    if (o && o->eps_divides && !((float)grp->eps > 0.0f))
      return status_fail(err, errlen, ZS_EINVAL,
                         "param group %" PRIu32 ": eps %g is 0 as a float32", g, grp->eps);
  }
  return 0;
}

int service_open(service *s, const spec *sp, uint32_t rank, core_open_result *out, char *err,
                 size_t errlen) {
  return service_open_mode(s, sp, rank, CORE_OPEN_EITHER, out, err, errlen);
}

int service_open_mode(service *s, const spec *sp, uint32_t rank, int mode, core_open_result *out,
                      char *err, size_t errlen) {
  return service_open_job(s, sp, rank, mode, 0, out, err, errlen);
}

int service_open_job(service *s, const spec *sp, uint32_t rank, int mode,
                     uint32_t trainer_timeout_ms, core_open_result *out, char *err, size_t errlen) {
  if (trainer_timeout_ms > SERVICE_MAX_TRAINER_TIMEOUT_MS)
    return status_fail(err, errlen, ZS_ERANGE,
                       "trainer_timeout_ms %" PRIu32 " is above %u (an hour)", trainer_timeout_ms,
                       SERVICE_MAX_TRAINER_TIMEOUT_MS);
  /* A trainer joining an elastic job (issue 26) opens it as a resume does;
   * it is admitted afterwards, by ChangeMembership. */
  if (mode == CORE_OPEN_JOIN)
    mode = CORE_OPEN_RESUME;
  if (mode != CORE_OPEN_EITHER && mode != CORE_OPEN_CREATE && mode != CORE_OPEN_RESUME)
    return status_fail(err, errlen, ZS_EINVAL,
                       "open mode %d is none of either (0), create (1), resume (2) and join (3)",
                       mode);
  if (!sp)
    return status_fail(err, errlen, ZS_EINVAL, "no spec given");
  /* The spec says how many trainers there are; a rank beyond them would push
   * contributions the core refuses one by one later, so it is refused now. */
  if (rank >= sp->world_size)
    return status_fail(err, errlen, ZS_EINVAL,
                       "rank %" PRIu32 " is not below the world size %" PRIu32, rank,
                       sp->world_size);
  int rc = groups_check_f32(sp, err, errlen);
  if (rc == 0)
    rc = check_limits(s, sp, err, errlen);
  if (rc != 0)
    return rc;
  core_open_result own;
  if (!out)
    out = &own;
  if ((rc = core_open_job(s->core, sp, mode, trainer_timeout_ms, out, err, errlen)) != 0)
    return rc;
  /* The world size is not part of the spec hash (issue 26): the job's, set
   * when it was created, is the rank space, whatever this trainer named.
   * Opening an existing job changes nothing, so the refusal leaves it as it
   * was. */
  if (rank >= out->world_size)
    return status_fail(err, errlen, ZS_EINVAL,
                       "rank %" PRIu32 " is not a rank of job '%s': its world size is %" PRIu32
                       " (set when it was created; a job cannot grow past it: create it with "
                       "the largest number of trainers it may have)",
                       rank, sp->job, out->world_size);
  return 0;
}

void service_member_log(service *s, char *buf, size_t cap) {
  core_member_log_format(s->core, buf, cap);
}

int service_member_change(service *s, uint64_t hash, uint32_t rank, int change, uint64_t step,
                          uint64_t *version, char *err, size_t errlen) {
  return core_member_change(s->core, hash, rank, change, step, version, err, errlen);
}

int service_close(service *s, uint64_t hash, const char *job, core_close_result *out, char *err,
                  size_t errlen) {
  if (job && strlen(job) > SPEC_MAX_NAME)
    return status_fail(err, errlen, ZS_EINVAL,
                       "CloseJob names a job of %zu bytes; job names have at most %u", strlen(job),
                       SPEC_MAX_NAME);
  return core_close(s->core, hash, job, out, err, errlen);
}

int service_init_params(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t offset,
                        const void *data, size_t nbytes, int *written, uint64_t *version, char *err,
                        size_t errlen) {
  if (nbytes % sizeof(float) != 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "InitParams data of %zu bytes is not a whole number of float32", nbytes);
  return core_init_params_range(s->core, hash, tensor, slice, offset, (const float *)data, nbytes,
                                written, version, err, errlen);
}

int service_push(service *s, const core_push_args *a, int *duplicate, char *err, size_t errlen) {
  int dup = 0;
  int rc = core_push(s->core, a, &dup, err, errlen);
  if (duplicate)
    *duplicate = dup;
  if (rc == 0 && !dup && s->obs.contribution)
    s->obs.contribution(s->obs.arg, a);
  return rc;
}

int service_push_check(service *s, const core_push_args *a, char *err, size_t errlen) {
  /* An empty payload is a contribution without a gradient (core_push): it
   * needs only the piece (any dtype's size says whether it is this
   * shard's); the push itself judges the rest. Never pushed from here. */
  int64_t nb = core_piece_bytes(s->core, a->hash, a->tensor, a->slice,
                                a->nbytes == 0 ? ZS_DTYPE_FP32 : a->dtype);
  if (nb >= 0 && (a->nbytes == 0 || (uint64_t)nb == (uint64_t)a->nbytes))
    return 0;
  if (a->nbytes == 0)
    return (int)core_piece_bytes_err(s->core, a->hash, a->tensor, a->slice, ZS_DTYPE_FP32, err,
                                     errlen);
  /* The core refuses this push whatever the payload holds, and its verdict is
   * the answer: core_push checks in its order (job, step, ranges, piece,
   * dtype, size) and fails before it would look at the missing data. */
  core_push_args q = *a;
  q.data = NULL;
  int rc = core_push(s->core, &q, NULL, err, errlen);
  return rc ? rc : status_fail(err, errlen, ZS_EINTERNAL, "the core took a push with no payload");
}

int64_t service_piece_bytes(service *s, uint64_t hash, uint32_t tensor, uint32_t slice,
                            zs_dtype dtype, char *err, size_t errlen) {
  return core_piece_bytes_err(s->core, hash, tensor, slice, dtype, err, errlen);
}

int64_t service_batch_piece_bytes(service *s, uint64_t hash, uint32_t index, uint32_t tensor,
                                  uint32_t slice, zs_dtype dtype, uint64_t length, char *err,
                                  size_t errlen) {
  char why[256] = "";
  int64_t nb = core_piece_bytes_err(s->core, hash, tensor, slice, dtype, why, sizeof why);
  if (nb < 0)
    return status_fail(err, errlen, (int)nb, "piece %" PRIu32 " of the batch: %s", index,
                       why[0] ? why : zs_strerror((int)nb));
  if ((uint64_t)nb != length)
    return status_fail(err, errlen, ZS_EINVAL,
                       "piece %" PRIu32 " of the batch (tensor %" PRIu32 ", slice %" PRIu32
                       ") has %" PRId64 " bytes in dtype %d, not the %" PRIu64 " asked for",
                       index, tensor, slice, nb, (int)dtype, length);
  return nb;
}

int service_wait_admission(service *s, uint64_t hash, uint64_t want) {
  core_info info;
  core_get_info(s->core, &info);
  return !info.has_job || info.spec_hash != hash || want <= info.version;
}

int service_grad_stats(service *s, uint64_t hash, uint64_t step, uint32_t acked_rank,
                       uint64_t deadline_ms, core_stats_cb cb, void *arg, core_stats_result *out,
                       char *err, size_t errlen) {
  if (acked_rank > 0) {
    int lost = core_check_acked(s->core, hash, step, acked_rank - 1, err, errlen);
    if (lost != 0)
      return lost;
  }
  return core_grad_stats(s->core, hash, step, deadline_ms, cb, arg, out, err, errlen);
}

int service_grad_stats_members(service *s, uint64_t hash, uint64_t step, uint32_t acked_rank,
                               const core_members *want, uint64_t deadline_ms, core_stats_cb cb,
                               void *arg, core_stats_result *out, char *err, size_t errlen) {
  if (acked_rank > 0) {
    int lost = core_check_acked(s->core, hash, step, acked_rank - 1, err, errlen);
    if (lost != 0)
      return lost;
  }
  return core_grad_stats_members(s->core, hash, step, want, deadline_ms, cb, arg, out, err, errlen);
}

int service_apply(service *s, uint64_t hash, uint64_t step, double lr, float coef, int skip,
                  const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                  core_apply_result *out, char *err, size_t errlen) {
  return service_apply_groups(s, hash, step, lr, NULL, 0, coef, skip, cs, cs_len, cb, arg, out, err,
                              errlen);
}

int service_apply_groups(service *s, uint64_t hash, uint64_t step, double lr,
                         const double *group_lr, uint32_t ngroup_lr, float coef, int skip,
                         const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                         core_apply_result *out, char *err, size_t errlen) {
  return service_apply_step(s, hash, step, lr, group_lr, ngroup_lr, NULL, coef, skip, cs, cs_len,
                            cb, arg, out, err, errlen);
}

/* The ranges torch's optimizers accept for each of a step's group
 * hyper-parameters (core_step_hparams order): [lo, hi], or [lo, hi) where
 * hi_open. */
static const struct {
  const char *name;
  double lo, hi;
  int hi_open;
} step_hparam_range[CORE_NHP] = {
    {"beta1", 0, 1, 1},           {"beta2", 0, 1, 1},
    {"eps", 0, INFINITY, 0},      {"weight_decay", 0, INFINITY, 0},
    {"momentum", 0, INFINITY, 0}, {"dampening", 0, 1, 0},
};

/* Refuses (ZS_EINVAL, naming the array and the group) a value outside its
 * range or beyond a float32's: the kernels see each rounded to float. */
static int step_hparams_check(const core_step_hparams *hp, char *err, size_t errlen) {
  for (unsigned k = 0; hp && k < CORE_NHP; k++) {
    if (hp->n[k] > 0 && !hp->v[k])
      return status_fail(err, errlen, ZS_EINVAL, "no values of group_%s given",
                         step_hparam_range[k].name);
    for (uint32_t g = 0; g < hp->n[k]; g++) {
      double x = hp->v[k][g], lo = step_hparam_range[k].lo, hi = step_hparam_range[k].hi;
      int open = step_hparam_range[k].hi_open;
      if (!finite_f32(x) || x < lo || (open ? x >= hi : x > hi))
        return status_fail(err, errlen, ZS_EINVAL,
                           "Apply's group_%s[%" PRIu32 "] is %g: it must be finite and in "
                           "[%g, %g%s; nothing was applied",
                           step_hparam_range[k].name, g, x, lo, hi, open ? ")" : "]");
    }
  }
  return 0;
}

int service_apply_step(service *s, uint64_t hash, uint64_t step, double lr, const double *group_lr,
                       uint32_t ngroup_lr, const core_step_hparams *hp, float coef, int skip,
                       const void *cs, size_t cs_len, core_apply_cb cb, void *arg,
                       core_apply_result *out, char *err, size_t errlen) {
  return service_apply_members(s, hash, step, lr, group_lr, ngroup_lr, hp, NULL, coef, skip, cs,
                               cs_len, cb, arg, out, err, errlen);
}

int service_apply_members(service *s, uint64_t hash, uint64_t step, double lr,
                          const double *group_lr, uint32_t ngroup_lr, const core_step_hparams *hp,
                          const core_members *members, float coef, int skip, const void *cs,
                          size_t cs_len, core_apply_cb cb, void *arg, core_apply_result *out,
                          char *err, size_t errlen) {
  /* The core refuses these too; checked first so that the client state of a
   * refused apply is never recorded. */
  /* The kernels see lr as a float: a finite double beyond FLT_MAX (1e300)
   * would become an infinite step and make every weight -inf. */
  if (!finite_f32(lr) || lr < 0 || !isfinite(coef))
    return status_fail(err, errlen, ZS_EINVAL,
                       "Apply needs a finite lr >= 0 and a finite coef, both within float32's "
                       "range (lr=%g coef=%g)",
                       lr, (double)coef);
  if (ngroup_lr > 0 && !group_lr)
    return status_fail(err, errlen, ZS_EINVAL, "no group learning rates given");
  for (uint32_t g = 0; g < ngroup_lr; g++)
    if (!finite_f32(group_lr[g]) || group_lr[g] < 0)
      return status_fail(err, errlen, ZS_EINVAL,
                         "Apply's group_lr[%" PRIu32
                         "] is %g: each must be finite as a float32 and >= 0",
                         g, group_lr[g]);
  int rc = step_hparams_check(hp, err, errlen);
  if (rc != 0)
    return rc;
  /* Recorded before the apply is queued, so that the apply commits it; an
   * oversized one is refused here and the apply never starts. */
  rc = core_set_apply_client_state(s->core, hash, step, cs, cs_len, err, errlen);
  if (rc != 0)
    return rc;
  return core_apply_members(s->core, hash, step, lr, group_lr, ngroup_lr, hp, members, coef, skip,
                            cb, arg, out, err, errlen);
}

/* ------------------------------------------------------------ optimizer state */

static int state_array_check(int which, const char *what, char *err, size_t errlen) {
  if (which == ZS_STATE_MASTER || which == ZS_STATE_EXP_AVG || which == ZS_STATE_EXP_AVG_SQ)
    return 0;
  return status_fail(err, errlen, ZS_EINVAL,
                     "%s needs array MASTER (1), EXP_AVG (2) or EXP_AVG_SQ (3), not %d", what,
                     which);
}

int service_state_read(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                       uint64_t offset, uint64_t count, uint64_t max_bytes, float *dst,
                       uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen) {
  int rc = state_array_check(which, "ReadState", err, errlen);
  if (rc != 0)
    return rc;
  /* Checked before count * 4 is formed, so that it cannot wrap. */
  if (count > max_bytes / sizeof(float))
    return service_too_large("ReadState answer", count > UINT64_MAX / 4 ? UINT64_MAX : count * 4,
                             max_bytes, "gRPC message", err, errlen);
  return core_state_read(s->core, hash, tensor, slice, (zs_state_array)which, offset, dst,
                         (size_t)count * sizeof(float), version, optimizer_steps, err, errlen);
}

int service_state_write(service *s, uint64_t hash, uint32_t tensor, uint32_t slice, int which,
                        uint64_t offset, const void *data, size_t nbytes, const uint64_t *set_steps,
                        uint64_t *version, uint64_t *optimizer_steps, char *err, size_t errlen) {
  if (nbytes % sizeof(float) != 0)
    return status_fail(err, errlen, ZS_ESIZE,
                       "WriteState data of %zu bytes is not a whole number of float32", nbytes);
  if (nbytes == 0 && !set_steps)
    return status_fail(err, errlen, ZS_ESIZE, "WriteState carries neither data nor a step count");
  int rc = nbytes == 0 ? 0 : state_array_check(which, "WriteState", err, errlen);
  if (rc != 0)
    return rc;
  /* The bytes come from a message buffer with no alignment promise: the core
   * copies with memcpy, but its pointer type asks for float alignment. */
  float *aligned = NULL;
  const float *src = data;
  if (nbytes > 0 && ((uintptr_t)data % _Alignof(float)) != 0) {
    if (!(aligned = malloc(nbytes)))
      return status_fail(err, errlen, ZS_ENOMEM, "out of memory copying WriteState data");
    memcpy(aligned, data, nbytes);
    src = aligned;
  }
  rc = core_state_write(s->core, hash, tensor, slice, (zs_state_array)which, offset, src, nbytes,
                        set_steps, version, optimizer_steps, err, errlen);
  free(aligned);
  return rc;
}

int service_tensor_steps(service *s, uint64_t hash, uint32_t tensor, uint64_t *steps, char *err,
                         size_t errlen) {
  return core_tensor_steps(s->core, hash, tensor, steps, err, errlen);
}

int service_set_tensor_steps(service *s, uint64_t hash, uint32_t tensor, uint64_t steps, char *err,
                             size_t errlen) {
  return core_set_tensor_steps(s->core, hash, tensor, steps, err, errlen);
}

/* ------------------------------------------------ sentences of the transports */

int service_too_large(const char *what, uint64_t nbytes, uint64_t limit, const char *limit_name,
                      char *err, size_t errlen) {
  return status_fail(err, errlen, ZS_ERANGE,
                     "%s of %" PRIu64 " bytes exceeds the %" PRIu64 "-byte %s limit", what, nbytes,
                     limit, limit_name);
}

int service_pull_wait_failed(int status, uint64_t min_version, uint32_t tensor, uint32_t slice,
                             char *err, size_t errlen) {
  if (status == ZS_ETIMEDOUT)
    return status_fail(err, errlen, status,
                       "timed out waiting for version %" PRIu64 " of tensor %" PRIu32
                       " slice %" PRIu32,
                       min_version, tensor, slice);
  if (status == ZS_ENOTOPEN)
    return status_fail(err, errlen, status,
                       "the job was closed while this pull of tensor %" PRIu32 " slice %" PRIu32
                       " waited for version %" PRIu64 " (no job is open on this shard now)",
                       tensor, slice, min_version);
  return status_fail(err, errlen, status, "%s", zs_strerror(status));
}
