/*
 * client — the zs_client handle: options, the registry of live clients, the
 * model description and zs_open_job.
 *
 * The registry exists so that a call on a closed handle is an error, not a
 * crash, and so that zs_client_close can wait for calls running on other
 * threads: every public function enters the client (counted under
 * zc_registry_mu) and leaves it; close marks the client closing, stops the
 * pool (cancelling queued work), waits for the active calls and the in-flight
 * ops, and only then frees it.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt_client.h"
#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/model/spec_optim.h"
#include "common/net/dp_client.h"
#include "internal.h"

/* ---- registry ------------------------------------------------------------- */

static pthread_mutex_t zc_registry_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t zc_registry_cv = PTHREAD_COND_INITIALIZER;
static zs_client **zc_registry; /* (zc_registry_mu) live clients */
static size_t zc_registry_n, zc_registry_cap;

static int registry_find_locked(const zs_client *c) {
  for (size_t i = 0; i < zc_registry_n; i++)
    if (zc_registry[i] == c)
      return (int)i;
  return -1;
}

static int registry_add(zs_client *c) {
  pthread_mutex_lock(&zc_registry_mu);
  if (zc_registry_n == zc_registry_cap) {
    size_t cap = zc_registry_cap ? 2 * zc_registry_cap : 8;
    zs_client **r = realloc(zc_registry, cap * sizeof *r);
    if (!r) {
      pthread_mutex_unlock(&zc_registry_mu);
      return ZS_ENOMEM;
    }
    zc_registry = r;
    zc_registry_cap = cap;
  }
  zc_registry[zc_registry_n++] = c;
  pthread_mutex_unlock(&zc_registry_mu);
  return ZS_OK;
}

int zc_client_enter(const zs_client *c) {
  if (!c)
    return zc_fail(ZS_EINVAL, "the client handle is NULL");
  pthread_mutex_lock(&zc_registry_mu);
  if (registry_find_locked(c) < 0) {
    pthread_mutex_unlock(&zc_registry_mu);
    return zc_fail(ZS_ECLOSED, "the client handle is closed (or was never opened)");
  }
  zs_client *m = (zs_client *)(uintptr_t)c; /* the counters are not part of the value */
  pthread_mutex_lock(&m->mu);
  int closing = m->closing;
  pthread_mutex_unlock(&m->mu);
  if (!closing)
    m->active++;
  pthread_mutex_unlock(&zc_registry_mu);
  if (closing)
    return zc_fail(ZS_ECLOSED, "the client is closing");
  return ZS_OK;
}

void zc_client_leave(const zs_client *c) {
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&zc_registry_mu);
  if (--m->active == 0)
    pthread_cond_broadcast(&zc_registry_cv);
  pthread_mutex_unlock(&zc_registry_mu);
}

void zc_account_wait(zs_client *c, zc_op_kind kind, uint64_t ns) {
  pthread_mutex_lock(&zc_registry_mu);
  if (registry_find_locked(c) >= 0) {
    pthread_mutex_lock(&c->mu);
    if (kind == ZC_OP_PUSH)
      c->push_ns += ns;
    else
      c->pull_ns += ns;
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&zc_registry_mu);
}

/* ---- options ---------------------------------------------------------------- */

void zs_client_options_init_sized(zs_client_options *out, size_t size) {
  if (!out || size < sizeof(size_t))
    return;
  zs_client_options own, *o = &own;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->world_size = 1;
  o->grad_accum = 1;
  o->job = "zshard";
  o->grad_reduce = ZS_REDUCE_MEAN;
  o->param_dtype = ZS_DTYPE_BF16;
  o->rpc_timeout_ms = 30000;
  o->step_timeout_ms = 60000;
  o->max_retries = 20;
  o->retry_initial_ms = 50;
  o->retry_max_ms = 2000;
  o->checkpoint_timeout_ms = 600000;
  /* Measured with 256 tensors of 64 fp32 on 2 shards (docs/CLIENT.md). */
  o->reduce_bucket_size = o->allgather_bucket_size = (size_t)1 << 20;
  o->loss_scaling = ZS_LOSS_SCALE_NONE;
  o->static_loss_scale = 1.0;
  zc_struct_write(out, size, o, sizeof *o);
}

void zs_group_options_init_sized(zs_group_options *out, zs_optimizer optimizer, size_t size) {
  if (!out || size < sizeof(size_t))
    return;
  zs_group_options own, *g = &own;
  spec_group sg;
  spec_group_defaults(&sg, optimizer);
  memset(g, 0, sizeof *g);
  g->struct_size = sizeof *g;
  g->optimizer = optimizer;
#define FROM_SPEC(kind, name, proto) g->name = sg.name;
  SPEC_GROUP_FIELDS(FROM_SPEC)
#undef FROM_SPEC
  zc_struct_write(out, size, g, sizeof *g);
}

/* Shard i's text from a pattern: every "{i}" replaced by i. NULL on ENOMEM. */
static char *expand_pattern(const char *spec, uint32_t i) {
  char num[12];
  int nlen = snprintf(num, sizeof num, "%" PRIu32, i);
  size_t count = 0;
  for (const char *p = spec; (p = strstr(p, "{i}")); p += 3)
    count++;
  char *out = malloc(strlen(spec) + count * (size_t)nlen + 1);
  if (!out)
    return NULL;
  char *o = out;
  for (const char *p = spec;;) {
    const char *q = strstr(p, "{i}");
    size_t len = q ? (size_t)(q - p) : strlen(p);
    memcpy(o, p, len);
    o += len;
    if (!q)
      break;
    memcpy(o, num, (size_t)nlen);
    o += nlen;
    p = q + 3;
  }
  *o = '\0';
  return out;
}

/* The next shard of a list at *p (up to ',' or the end), trimmed of blanks;
 * *p moves past it. NULL on ENOMEM. */
static char *next_listed(const char **p) {
  const char *s = *p, *end = strchr(s, ',');
  size_t len = end ? (size_t)(end - s) : strlen(s);
  *p = end ? end + 1 : s + len;
  while (len && (*s == ' ' || *s == '\t'))
    s++, len--;
  while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
    len--;
  return strndup(s, len);
}

/* Checks shard i's text a; a replica set's text is replaced by its
 * normalised form (members trimmed). */
static int check_shard_text(uint32_t i, char **a) {
  if (strchr(*a, '|')) {
    char *norm = NULL;
    int rc = zc_shard_text_check(i, *a, &norm);
    if (rc == ZS_OK) {
      free(*a);
      *a = norm;
    }
    return rc;
  }
  hostport hp;
  char why[400];
  if (zc_address_hostport(*a, &hp, why, sizeof why) != ZS_OK)
    return zc_fail(ZS_EINVAL, "address %" PRIu32 " ('%s'): %s", i, *a, why);
  return ZS_OK;
}

int zc_parse_addresses(const char *spec, uint32_t num_shards, char ***out, uint32_t *count) {
  *out = NULL;
  *count = 0;
  if (!spec || !*spec)
    return zc_fail(ZS_EINVAL, "no shard addresses given");
  const int pattern = strstr(spec, "{i}") != NULL;
  uint32_t n = 0;
  if (pattern) {
    if (num_shards == 0)
      return zc_fail(ZS_EINVAL, "the address pattern '%s' needs num_shards, the number of shards",
                     spec);
    if (strchr(spec, ','))
      return zc_fail(ZS_EINVAL,
                     "the address pattern '%s' holds a ',': a pattern is one shard's address "
                     "(or its replicas separated by '|') with {i} for the shard's index",
                     spec);
    n = num_shards;
  } else {
    n = 1;
    for (const char *p = spec; *p; p++)
      n += *p == ',';
    if (num_shards != 0 && num_shards != n)
      return zc_fail(ZS_EINVAL, "%" PRIu32 " addresses given but num_shards is %" PRIu32, n,
                     num_shards);
  }
  if (n > SPEC_MAX_SHARDS)
    return zc_fail(ZS_EINVAL, "%" PRIu32 " shards, at most %u are supported", n, SPEC_MAX_SHARDS);
  char **addr = calloc(n, sizeof *addr);
  if (!addr)
    return zc_fail(ZS_ENOMEM, "out of memory");
  int rc = ZS_OK;
  const char *p = spec;
  for (uint32_t i = 0; i < n && rc == ZS_OK; i++) {
    addr[i] = pattern ? expand_pattern(spec, i) : next_listed(&p);
    rc = addr[i] ? check_shard_text(i, &addr[i]) : zc_fail(ZS_ENOMEM, "out of memory");
  }
  if (rc != ZS_OK) {
    zc_free_addresses(addr, n);
    return rc;
  }
  *out = addr;
  *count = n;
  return ZS_OK;
}

int zc_address_hostport(const char *addr, hostport *out, char *err, size_t errlen) {
  static const char *const schemes[] = {"dns:", "ipv4:", "ipv6:"};
  const char *text = addr;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    size_t n = strlen(schemes[i]);
    if (strncmp(text, schemes[i], n) == 0) {
      text += n;
      break;
    }
  }
  const char *slash = strrchr(text, '/');
  if (slash)
    text = slash + 1;
  int rc = hostport_parse(text, out, err, errlen);
  if (rc != 0)
    return rc;
  if (!out->host[0])
    return status_fail(err, errlen, ZS_EINVAL, "address \"%.300s\" has no host", addr);
  return ZS_OK;
}

void zc_free_addresses(char **addr, uint32_t n) {
  if (!addr)
    return;
  for (uint32_t i = 0; i < n; i++)
    free(addr[i]);
  free(addr);
}

/* The CLI's view of a client (cli_support.h): fixed once zs_client_open
 * returned, so read without a lock. */
uint32_t zc_client_num_shards(const zs_client *c) {
  return c->nshards;
}

const char *zc_client_address(const zs_client *c, uint32_t shard) {
  return shard < c->nshards ? c->addr[shard] : "";
}

uint32_t zc_client_rpc_timeout_ms(const zs_client *c) {
  return c->opt.rpc_timeout_ms;
}

static int check_options(const zs_client_options *o, const zs_loss_scaler *s) {
  if (!o->addresses || !*o->addresses)
    return zc_fail(ZS_EINVAL, "zs_client_open: addresses are required");
  if (o->world_size == 0 || o->world_size > SPEC_MAX_WORLD)
    return zc_fail(ZS_EINVAL, "zs_client_open: world_size must be in 1..%u", SPEC_MAX_WORLD);
  if (o->rank >= o->world_size)
    return zc_fail(ZS_EINVAL, "zs_client_open: rank %" PRIu32 " is not below world_size %" PRIu32,
                   o->rank, o->world_size);
  if (o->grad_accum == 0 || o->grad_accum > SPEC_MAX_ACCUM ||
      (uint64_t)o->grad_accum * o->world_size > SPEC_MAX_CONTRIB)
    return zc_fail(ZS_EINVAL,
                   "zs_client_open: grad_accum must be in 1..%u and world_size * grad_accum at "
                   "most %u",
                   SPEC_MAX_ACCUM, SPEC_MAX_CONTRIB);
  if (!o->job || !*o->job || strlen(o->job) > SPEC_MAX_NAME)
    return zc_fail(ZS_EINVAL, "zs_client_open: the job name must have 1..%d bytes", SPEC_MAX_NAME);
  if (o->grad_reduce != ZS_REDUCE_MEAN && o->grad_reduce != ZS_REDUCE_SUM)
    return zc_fail(ZS_EINVAL, "zs_client_open: grad_reduce must be ZS_REDUCE_MEAN or SUM");
  if (o->param_dtype != 0 && o->param_dtype != ZS_DTYPE_BF16 && o->param_dtype != ZS_DTYPE_FP16)
    return zc_fail(ZS_EDTYPE, "zs_client_open: param_dtype must be ZS_DTYPE_BF16 or FP16");
  if ((o->push_dtype != 0 && !dtype_valid(o->push_dtype)) ||
      (o->pull_dtype != 0 && !dtype_valid(o->pull_dtype)))
    return zc_fail(ZS_EDTYPE, "zs_client_open: push_dtype and pull_dtype must be 0 or a zs_dtype");
  if (o->loss_scaling != ZS_LOSS_SCALE_NONE && o->loss_scaling != ZS_LOSS_SCALE_STATIC &&
      o->loss_scaling != ZS_LOSS_SCALE_DYNAMIC)
    return zc_fail(ZS_EINVAL, "zs_client_open: loss_scaling is not a zs_loss_scaling value");
  if (o->loss_scaling == ZS_LOSS_SCALE_STATIC &&
      !(o->static_loss_scale > 0 && isfinite(o->static_loss_scale)))
    return zc_fail(ZS_EINVAL, "zs_client_open: static_loss_scale must be positive and finite");
  if (o->loss_scaling == ZS_LOSS_SCALE_DYNAMIC) {
    if (!(s->scale > 0 && isfinite(s->scale)) || !(s->min_scale > 0) || !(s->factor >= 1) ||
        s->window == 0 || s->hysteresis == 0)
      return zc_fail(ZS_EINVAL, "zs_client_open: dynamic_loss_scaler must have positive "
                                "settings");
  }
  if (o->transport != ZS_TRANSPORT_DEFAULT && o->transport != ZS_TRANSPORT_DATA &&
      o->transport != ZS_TRANSPORT_GRPC)
    return zc_fail(ZS_EINVAL, "zs_client_open: transport %d is not a zs_transport value",
                   (int)o->transport);
  if (o->data_connections > DP_MAX_CONNECTIONS)
    return zc_fail(ZS_EINVAL, "zs_client_open: data_connections must be at most %u",
                   DP_MAX_CONNECTIONS);
  if (o->reserved1 != 0)
    return zc_fail(ZS_EINVAL, "zs_client_open: reserved1 must be 0");
  if (o->open_mode != ZS_OPEN_EITHER && o->open_mode != ZS_OPEN_CREATE &&
      o->open_mode != ZS_OPEN_RESUME && o->open_mode != ZS_OPEN_JOIN)
    return zc_fail(ZS_EINVAL, "zs_client_open: open_mode %d is not a zs_open_mode value",
                   (int)o->open_mode);
  if (o->error_feedback > 1)
    return zc_fail(ZS_EINVAL, "zs_client_open: error_feedback must be 0 or 1");
  if (o->pipelined > 1)
    return zc_fail(ZS_EINVAL, "zs_client_open: pipelined must be 0 or 1");
  if (o->pipelined && o->loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    return zc_fail(ZS_EINVAL, "zs_client_open: the pipelined step has no overflow check, which "
                              "dynamic loss scaling needs: use the gated step (pipelined 0) or "
                              "a static loss scale");
  return ZS_OK;
}

/* failover_ms: the option, else $ZSHARD_FAILOVER_MS, else 3000. */
static int resolve_failover_ms(uint32_t opt, uint32_t *out) {
  *out = opt ? opt : 3000;
  const char *env = getenv("ZSHARD_FAILOVER_MS");
  if (opt || !env || !*env)
    return ZS_OK;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(env, &end, 10);
  if (*end || errno || v == 0 || v > 86400000ull || env[0] == '-' || env[0] == ' ')
    return zc_fail(ZS_EINVAL,
                   "zs_client_open: ZSHARD_FAILOVER_MS is '%.64s'; it must be a number of "
                   "milliseconds from 1 to 86400000",
                   env);
  *out = (uint32_t)v;
  return ZS_OK;
}

static void client_free(zs_client *c) {
  if (!c)
    return;
  zc_pool_stop(&c->pool);
  zc_dp_close(c);
  zc_pool_free(&c->pool);
  zc_slots_free(c);
  zc_ef_free(c);
  layout_free(&c->lay);
  spec_free(&c->sp);
  free(c->pushed);
  zc_rsets_free(c);
  zc_free_addresses(c->addr, c->nshards);
  free(c->job);
  zc_security_free(&c->sec);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->ef_mu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

int zs_client_open(const zs_client_options *o, zs_client **out) {
  if (out)
    *out = NULL;
  if (!o || !out)
    return zc_fail(ZS_EINVAL, "zs_client_open: options and out must not be NULL");
  /* An older header's smaller structs get the defaults of the fields they
   * lack; the scaler, a struct of its own, grows on its own. */
  zs_client_options opt;
  zs_client_options_init(&opt);
  int rc = zc_struct_read(&opt, sizeof opt, o, "zs_client_open", "zs_client_options_init");
  if (rc != ZS_OK)
    return rc;
  zs_loss_scaler scaler;
  zs_loss_scaler_init(&scaler);
  if (opt.dynamic_loss_scaler) {
    rc = zc_struct_read(&scaler, sizeof scaler, opt.dynamic_loss_scaler,
                        "zs_client_open: dynamic_loss_scaler", "zs_loss_scaler_init");
    if (rc != ZS_OK)
      return rc;
  }
  rc = check_options(&opt, &scaler);
  if (rc != ZS_OK)
    return rc;

  zs_client *c = calloc(1, sizeof *c);
  if (!c)
    return zc_fail(ZS_ENOMEM, "zs_client_open: out of memory");
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->ef_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  /* Retry backoff waits on cv with a CLOCK_MONOTONIC deadline. */
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cv, &ca);
  pthread_condattr_destroy(&ca);
  c->opt = opt;
  c->opt.addresses = NULL;
  c->opt.job = NULL;
  c->opt.dynamic_loss_scaler = NULL;
  c->opt.token = c->opt.tls_ca_file = c->opt.tls_cert_file = c->opt.tls_key_file =
      c->opt.tls_server_name = NULL;
  if (!c->opt.param_dtype)
    c->opt.param_dtype = ZS_DTYPE_BF16;
  if (!c->opt.rpc_timeout_ms)
    c->opt.rpc_timeout_ms = 30000;
  if (!c->opt.step_timeout_ms)
    c->opt.step_timeout_ms = 60000;
  if (!c->opt.retry_initial_ms)
    c->opt.retry_initial_ms = 50;
  if (c->opt.retry_max_ms < c->opt.retry_initial_ms)
    c->opt.retry_max_ms = c->opt.retry_initial_ms;
  if (!c->opt.checkpoint_timeout_ms)
    c->opt.checkpoint_timeout_ms = 600000;
  c->scaler = scaler;
  atomic_init(&c->retries, 0);
  c->opt.tcp_congestion = NULL;
  rc = zc_transport_resolve(opt.transport, &c->opt.transport);
  if (rc == ZS_OK)
    rc = resolve_failover_ms(opt.failover_ms, &c->opt.failover_ms);
  if (rc == ZS_OK)
    rc = zc_schedule_resolve(opt.schedule, &c->opt.schedule, &c->opt.schedule_window);
  if (rc == ZS_OK)
    rc = zc_congestion_resolve(opt.tcp_congestion, c->tcp_congestion, sizeof c->tcp_congestion);
  if (rc != ZS_OK)
    goto fail;
  c->job = strdup(opt.job);
  if (!c->job) {
    rc = zc_fail(ZS_ENOMEM, "zs_client_open: out of memory");
    goto fail;
  }
  rc = zc_parse_addresses(opt.addresses, opt.num_shards, &c->addr, &c->nshards);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN]; /* the last error is both source and destination */
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_client_open: %.480s", why);
    goto fail;
  }
  /* The token file is read here, once: a rotation reaches a trainer when
   * it reopens its client. */
  rc = zc_security_resolve(opt.token, opt.tls_ca_file, opt.tls_cert_file, opt.tls_key_file,
                           opt.tls_server_name, &c->sec, "zs_client_open");
  if (rc != ZS_OK)
    goto fail;
  /* One channel per member of each shard's replica set (one for a shard
   * that is not replicated), all lazy: a backup is first reached by a
   * failover search. */
  rc = zc_rsets_open(c, "zs_client_open");
  if (rc != ZS_OK)
    goto fail;
  uint32_t threads = opt.threads ? opt.threads : 2 * c->nshards + 2;
  if (!opt.threads && threads > 32)
    threads = 32;
  if (threads > ZC_MAX_THREADS)
    threads = ZC_MAX_THREADS;
  c->opt.threads = threads;
  /* Buckets pay only where pieces travel as batches, the data plane; over
   * gRPC a bucket would queue calls behind each other on one worker rather
   * than issue them in parallel (docs/CLIENT.md). */
  const int batches = c->opt.transport == ZS_TRANSPORT_DATA;
  rc = zc_pool_start(&c->pool, c->nshards, threads, batches ? opt.reduce_bucket_size : 0,
                     batches ? opt.allgather_bucket_size : 0, zc_task_run, zc_task_cancel, c);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_client_open: cannot start %" PRIu32 " worker threads", threads);
    goto fail;
  }
  if (c->opt.schedule == ZS_SCHEDULE_ROTATED) {
    /* Two of each direction in flight: the next piece is written while the
     * last one's answer comes back (pool.c). */
    zc_pool_set_schedule(&c->pool, opt.rank, c->opt.schedule_window);
  }
  rc = registry_add(c);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_client_open: out of memory");
    goto fail;
  }
  *out = c;
  return ZS_OK;
fail:
  client_free(c);
  return rc;
}

int zs_client_close(zs_client *c) {
  if (!c)
    return ZS_OK;
  pthread_mutex_lock(&zc_registry_mu);
  if (registry_find_locked(c) < 0) {
    pthread_mutex_unlock(&zc_registry_mu);
    return zc_fail(ZS_ECLOSED, "zs_client_close: the client handle is already closed");
  }
  /* A worker cannot join itself, nor a data client's loop thread: close from
   * a callback is refused. */
  if (zc_dp_in_callback()) {
    pthread_mutex_unlock(&zc_registry_mu);
    return zc_fail(ZS_EINVAL, "zs_client_close: called from a completion callback");
  }
  for (uint32_t i = 0; i < c->pool.nthreads; i++) {
    if (pthread_equal(pthread_self(), c->pool.threads[i])) {
      pthread_mutex_unlock(&zc_registry_mu);
      return zc_fail(ZS_EINVAL, "zs_client_close: called from a completion callback");
    }
  }
  pthread_mutex_lock(&c->mu);
  int already = c->closing;
  c->closing = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&zc_registry_mu);
  if (already)
    return zc_fail(ZS_ECLOSED, "zs_client_close: the client is already closing");
  zc_member_leave(c); /* issue 26: before the pool stops; no retries once closing */

  /* Queued tasks are cancelled, running ones finish by their deadlines, and
   * data-plane transfers in flight are cancelled (no worker is left to submit
   * or retry one); then every op has finished, which lets the calls blocked
   * on them return. */
  zc_pool_stop(&c->pool);
  zc_dp_close(c);
  pthread_mutex_lock(&zc_registry_mu);
  while (c->active > 0)
    pthread_cond_wait(&zc_registry_cv, &zc_registry_mu);
  int i = registry_find_locked(c);
  zc_registry[i] = zc_registry[--zc_registry_n];
  pthread_mutex_unlock(&zc_registry_mu);
  pthread_mutex_lock(&c->mu);
  while (c->inflight > 0)
    pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  client_free(c);
  return ZS_OK;
}

/* ---- model description -------------------------------------------------------- */

/* Called with c->mu held. */
static int check_describable_locked(const zs_client *c, const char *fn) {
  if (c->opened || c->opening)
    return zc_fail(ZS_EINVAL, "%s: the model cannot change once zs_open_job has been called", fn);
  return ZS_OK;
}

static int add_group_locked(zs_client *c, const spec_group *g, uint32_t *id) {
  if (c->sp.num_groups >= SPEC_MAX_GROUPS)
    return zc_fail(ZS_ERANGE, "zs_add_group: at most %u param groups", SPEC_MAX_GROUPS);
  if (c->sp.num_groups == c->group_cap) {
    uint32_t cap = c->group_cap ? 2 * c->group_cap : 4;
    spec_group *ng = realloc(c->sp.groups, cap * sizeof *ng);
    if (!ng)
      return zc_fail(ZS_ENOMEM, "zs_add_group: out of memory");
    c->sp.groups = ng;
    c->group_cap = cap;
  }
  c->sp.groups[c->sp.num_groups] = *g;
  if (id)
    *id = c->sp.num_groups;
  c->sp.num_groups++;
  return ZS_OK;
}

/* Reads the caller's group options into *g: a shorter (older) struct gets
 * torch's defaults for its optimizer in the fields it lacks. */
static int read_group_options(const zs_group_options *in, zs_group_options *g) {
  if (!in)
    return zc_fail(ZS_EINVAL, "zs_add_group: options NULL");
  int rc = zc_struct_check(in->struct_size, "zs_add_group", "zs_group_options_init");
  if (rc != ZS_OK)
    return rc;
  zs_optimizer optimizer = ZS_OPTIM_ADAMW;
  if (in->struct_size >= offsetof(zs_group_options, optimizer) + sizeof in->optimizer)
    optimizer = in->optimizer;
  zs_group_options_init(g, optimizer);
  return zc_struct_read(g, sizeof *g, in, "zs_add_group", "zs_group_options_init");
}

int zs_add_group(zs_client *c, const zs_group_options *caller_g, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  zs_group_options own;
  const zs_group_options *g = &own;
  rc = read_group_options(caller_g, &own);
  if (rc != ZS_OK) {
    zc_client_leave(c);
    return rc;
  }
  if (!spec_optim_of(g->optimizer)) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_add_group: optimizer %d is not a zs_optimizer",
                   (int)g->optimizer);
  }
  /* Ranges are checked by spec_validate at zs_open_job, with the same rules
   * the shards apply. */
  spec_group sg = {.optimizer = g->optimizer};
  /* Flags are normalised to 0 or 1, as a C truth value means. */
#define NORM_F64(v) (v)
#define NORM_FLAG(v) ((v) != 0)
#define NORM_FLAG_NEGATED(v) ((v) != 0)
#define TO_SPEC(kind, name, proto) sg.name = NORM_##kind(g->name);
  SPEC_GROUP_FIELDS(TO_SPEC)
#undef TO_SPEC
#undef NORM_F64
#undef NORM_FLAG
#undef NORM_FLAG_NEGATED
  if ((g->push_dtype != 0 && !dtype_valid(g->push_dtype)) ||
      (g->pull_dtype != 0 && !dtype_valid(g->pull_dtype))) {
    zc_client_leave(c);
    return zc_fail(ZS_EDTYPE, "zs_add_group: push_dtype and pull_dtype must be 0 or a zs_dtype");
  }
  pthread_mutex_lock(&c->mu);
  rc = check_describable_locked(c, "zs_add_group");
  if (rc == ZS_OK) {
    uint32_t gid = c->sp.num_groups;
    rc = add_group_locked(c, &sg, id);
    if (rc == ZS_OK) {
      c->group_push[gid] = g->push_dtype;
      c->group_pull[gid] = g->pull_dtype;
    }
  }
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

static int add_tensor_locked(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                             const uint64_t *shape, uint32_t ndim, uint32_t *id) {
  int rc = check_describable_locked(c, "zs_add_tensor");
  if (rc != ZS_OK)
    return rc;
  if (c->sp.num_tensors >= SPEC_MAX_TENSORS)
    return zc_fail(ZS_ERANGE, "zs_add_tensor: at most %u tensors", SPEC_MAX_TENSORS);
  for (uint32_t i = 0; i < c->sp.num_tensors; i++)
    if (strcmp(c->sp.tensors[i].name, name) == 0)
      return zc_fail(ZS_EEXIST, "zs_add_tensor: a tensor named '%s' exists already", name);
  if (c->sp.num_tensors == c->tensor_cap) {
    uint32_t cap = c->tensor_cap ? 2 * c->tensor_cap : 16;
    spec_tensor *nt = realloc(c->sp.tensors, cap * sizeof *nt);
    if (!nt)
      return zc_fail(ZS_ENOMEM, "zs_add_tensor: out of memory");
    c->sp.tensors = nt;
    c->tensor_cap = cap;
  }
  spec_tensor *t = &c->sp.tensors[c->sp.num_tensors];
  memset(t, 0, sizeof *t);
  t->name = strdup(name);
  if (!t->name)
    return zc_fail(ZS_ENOMEM, "zs_add_tensor: out of memory");
  t->numel = numel;
  t->group = group;
  t->ndim = ndim;
  for (uint32_t d = 0; d < ndim; d++)
    t->shape[d] = shape[d];
  if (id)
    *id = c->sp.num_tensors;
  c->sp.num_tensors++;
  return ZS_OK;
}

int zs_add_tensor(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                  const uint64_t *shape, uint32_t ndim, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!name || !*name || strlen(name) > SPEC_MAX_NAME)
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: the name must have 1..%d bytes", SPEC_MAX_NAME);
  else if (numel == 0 || numel > SPEC_MAX_NUMEL)
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: tensor '%s' has %" PRIu64 " elements (1..2^40)", name,
                 numel);
  else if (ndim > SPEC_MAX_DIMS || (ndim > 0 && !shape))
    rc = zc_fail(ZS_EINVAL, "zs_add_tensor: tensor '%s': ndim must be at most %u, with a shape",
                 name, SPEC_MAX_DIMS);
  if (rc == ZS_OK && ndim > 0) {
    /* The product is checked here, with overflow in mind, for a clear message. */
    uint64_t prod = 1;
    for (uint32_t d = 0; d < ndim && rc == ZS_OK; d++) {
      if (shape[d] == 0 || prod > SPEC_MAX_NUMEL / shape[d])
        rc = ZS_EINVAL;
      else
        prod *= shape[d];
    }
    if (rc != ZS_OK || prod != numel)
      rc = zc_fail(ZS_EINVAL,
                   "zs_add_tensor: the shape of tensor '%s' does not multiply to %" PRIu64, name,
                   numel);
  }
  if (rc == ZS_OK) {
    pthread_mutex_lock(&c->mu);
    rc = add_tensor_locked(c, name, numel, group, shape, ndim, id);
    pthread_mutex_unlock(&c->mu);
  }
  zc_client_leave(c);
  return rc;
}

/* ---- opening the job ------------------------------------------------------------ */

/* Open on every shard: *version gets the job's version and cs (*cs_len
 * bytes, at most ZC_MAX_CLIENT_STATE) its client state, shard 0's or else
 * the first shard's that has one (every shard keeps the same). */
static int open_on_shards(zs_client *c, uint64_t *version, uint8_t *cs, size_t *cs_len) {
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  Zshard__V1__OpenRequest *reqs = NULL;
  zs_request *op = NULL;
  int rc = spec_to_proto(&c->sp, &ms);
  if (rc != ZS_OK)
    return zc_fail(rc, "zs_open_job: out of memory encoding the spec");
  reqs = calloc(c->nshards, sizeof *reqs);
  op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!reqs || !op) {
    rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    Zshard__V1__OpenRequest init = ZSHARD__V1__OPEN_REQUEST__INIT;
    reqs[i] = init;
    reqs[i].spec = &ms; /* shared: packing only reads it */
    reqs[i].rank = c->opt.rank;
    /* zs_open_mode's values are the proto's OpenMode. */
    reqs[i].mode = (Zshard__V1__OpenMode)c->opt.open_mode;
    reqs[i].trainer_timeout_ms = c->opt.trainer_timeout_ms;
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("Open");
    t->msg = &reqs[i].base;
    t->resp_desc = &zshard__v1__open_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  rc = zc_call_all(op);
  if (rc == ZS_EHASH) {
    char why[ZC_ERR_LEN]; /* the last error is both source and destination */
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc =
        zc_fail(rc, "zs_open_job: a shard holds a different job (spec hash mismatch): %.400s", why);
  } else if (rc == ZS_EEXIST || rc == ZS_ENOTOPEN) {
    /* The open mode's refusals: the shard's sentence names the job. */
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_open_job (open mode %s): %.400s",
                 c->opt.open_mode == ZS_OPEN_CREATE ? "create"
                 : c->opt.open_mode == ZS_OPEN_JOIN ? "join"
                                                    : "resume",
                 why);
  }
  if (rc != ZS_OK)
    goto done;
  uint64_t vmin = UINT64_MAX, vmax = 0;
  for (uint32_t i = 0; i < c->nshards && rc == ZS_OK; i++) {
    const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)op->tasks[i].resp;
    if (r->spec_hash != c->hash)
      rc = zc_fail(ZS_EHASH,
                   "zs_open_job: shard %" PRIu32 " (%s) answered spec hash %016" PRIx64
                   ", ours is %016" PRIx64,
                   i, c->addr[i], r->spec_hash, c->hash);
    else if (r->shard_id != i || r->num_shards != c->nshards)
      rc = zc_fail(ZS_EINVAL,
                   "zs_open_job: address %" PRIu32 " (%s) is shard %" PRIu32 " of %" PRIu32
                   "; list the addresses in shard-id order, %" PRIu32 " of them",
                   i, c->addr[i], r->shard_id, r->num_shards, c->nshards);
    if (r->version < vmin)
      vmin = r->version;
    if (r->version > vmax)
      vmax = r->version;
  }
  if (rc == ZS_OK)
    rc = zc_adopt_world_size(c, op);
  *cs_len = 0;
  for (uint32_t i = 0; rc == ZS_OK && i < c->nshards && *cs_len == 0; i++) {
    const Zshard__V1__OpenResponse *r = (const Zshard__V1__OpenResponse *)op->tasks[i].resp;
    if (r->client_state.len > 0 && r->client_state.len <= ZC_MAX_CLIENT_STATE) {
      memcpy(cs, r->client_state.data, r->client_state.len);
      *cs_len = r->client_state.len;
    }
  }
  /* A trainer joining a running job may open while an Apply is on its way
   * to some shards; it joins after the newest version (zc_member_join). */
  int joining = c->opt.open_mode == ZS_OPEN_JOIN && vmax - vmin <= 1;
  if (rc == ZS_OK && vmin != vmax && !joining) {
    char hint[ZC_ERR_LEN / 2];
    zc_resume_hint(c, c->hash, hint, sizeof hint);
    rc = zc_fail(ZS_EBEHIND,
                 "zs_open_job: the shards are at different versions (%" PRIu64 " to %" PRIu64
                 "): a shard is behind the cluster and must be restored before training "
                 "resumes; %s",
                 vmin, vmax, hint);
  }
  *version = joining ? vmax : vmin;
done:
  if (op) {
    for (uint32_t i = 0; i < op->ntasks; i++)
      if (op->tasks[i].resp)
        protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
    /* Ours: the caller's reference of zc_call_all, or the only one of an op
     * that was never submitted. */
    zc_op_release(op);
  }
  free(reqs);
  spec_proto_release(&ms);
  return rc;
}

/* Rank 0's initial weights, one call per chunk of LAYOUT_INIT_CHUNK_ELEMS
 * elements (1 MiB), so that neither end holds more than a chunk per call in
 * flight however large a piece is: a whole 8M-parameter piece in one message
 * used to exist several times over in the shard while it was received. */
static uint32_t piece_calls(const layout_piece *pc) {
  return (uint32_t)((pc->numel + LAYOUT_INIT_CHUNK_ELEMS - 1) / LAYOUT_INIT_CHUNK_ELEMS);
}

/* Sends every tensor's weights (only == UINT32_MAX: init[t] those of tensor
 * t, `one` unused), or those of tensor `only` alone (`one` its weights, init
 * unused). */
static int init_params(zs_client *c, const float *const *init, uint32_t only, const float *one) {
  size_t ncalls = 0;
  for (uint32_t i = 0; i < c->lay.num_pieces; i++)
    if (only == UINT32_MAX || c->lay.pieces[i].tensor == only)
      ncalls += piece_calls(&c->lay.pieces[i]);
  Zshard__V1__InitParamsRequest *reqs = calloc(ncalls ? ncalls : 1, sizeof *reqs);
  zs_request *op = zc_op_new(c, ZC_OP_CALL, (uint32_t)ncalls);
  int rc;
  if (!reqs || !op) {
    free(reqs);
    if (op)
      zc_op_release(op);
    return zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
  }
  size_t n = 0;
  for (uint32_t i = 0; i < c->lay.num_pieces; i++) {
    const layout_piece *pc = &c->lay.pieces[i];
    if (only != UINT32_MAX && pc->tensor != only)
      continue;
    for (uint64_t e = 0; e < pc->numel; e += LAYOUT_INIT_CHUNK_ELEMS, n++) {
      uint64_t len =
          pc->numel - e < LAYOUT_INIT_CHUNK_ELEMS ? pc->numel - e : LAYOUT_INIT_CHUNK_ELEMS;
      Zshard__V1__InitParamsRequest r = ZSHARD__V1__INIT_PARAMS_REQUEST__INIT;
      r.spec_hash = c->hash;
      r.tensor = pc->tensor;
      r.slice = pc->slice;
      r.offset = e;
      /* Little-endian float32 is the wire format, and the host's. */
      const float *w = only == UINT32_MAX ? init[pc->tensor] : one;
      r.data.data = (uint8_t *)(uintptr_t)(w + pc->offset + e);
      r.data.len = (size_t)len * sizeof(float);
      reqs[n] = r;
      zc_task *t = &op->tasks[n];
      t->shard = pc->shard;
      t->method = ZC_METHOD("InitParams");
      t->msg = &reqs[n].base;
      t->resp_desc = &zshard__v1__init_params_response__descriptor;
      t->timeout_ms = c->opt.rpc_timeout_ms;
      t->bytes = r.data.len;
    }
  }
  rc = ncalls ? zc_call_all(op) : ZS_OK;
  if (rc == ZS_EEXIST)
    rc = zc_fail(rc,
                 "%s: the shards already hold different initial weights for this "
                 "job (%s)",
                 only == UINT32_MAX ? "zs_open_job" : "zs_init_tensor", op->err);
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  zc_op_release(op);
  free(reqs);
  return rc;
}

static int open_job(zs_client *c, const float *const *init_weights, int deferred) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  if (c->opened || c->opening || c->job_closed) {
    int closed = c->job_closed;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return closed ? zc_fail(ZS_EINVAL, "zs_open_job: this client closed its job (zs_close_job); "
                                       "open another client for the next job")
                  : zc_fail(ZS_EINVAL, "zs_open_job: the job is already open (or being opened)");
  }
  c->opening = 1;
  pthread_mutex_unlock(&c->mu);
  /* From here on the model description is frozen (opening), so it is read
   * without the lock. */
  char err[ZC_ERR_LEN];
  uint64_t version = 0;
  uint8_t cs[ZC_MAX_CLIENT_STATE]; /* the job's client state (Open) */
  size_t cs_len = 0;
  if (c->sp.num_tensors == 0) {
    rc = zc_fail(ZS_EINVAL, "zs_open_job: the model has no tensors (zs_add_tensor)");
    goto fail;
  }
  if (c->opt.rank == 0 && !deferred && c->opt.open_mode != ZS_OPEN_JOIN) {
    if (!init_weights) {
      rc = zc_fail(ZS_EINVAL, "zs_open_job: rank 0 must pass the initial weights");
      goto fail;
    }
    for (uint32_t t = 0; t < c->sp.num_tensors; t++)
      if (!init_weights[t]) {
        rc = zc_fail(ZS_EINVAL, "zs_open_job: the initial weights of tensor '%s' are NULL",
                     c->sp.tensors[t].name);
        goto fail;
      }
  }
  if (c->sp.num_groups == 0) {
    spec_group g;
    spec_group_defaults(&g, ZS_OPTIM_ADAMW);
    pthread_mutex_lock(&c->mu);
    rc = add_group_locked(c, &g, NULL);
    pthread_mutex_unlock(&c->mu);
    if (rc != ZS_OK)
      goto fail;
  }
  if (!c->sp.job) {
    c->sp.job = strdup(c->job);
    if (!c->sp.job) {
      rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
      goto fail;
    }
  }
  c->sp.world_size = c->opt.world_size;
  c->sp.grad_accum = c->opt.grad_accum;
  c->sp.num_shards = c->nshards;
  c->sp.split_threshold = c->opt.split_threshold;
  c->sp.reduce = c->opt.grad_reduce == ZS_REDUCE_SUM ? SPEC_REDUCE_SUM : SPEC_REDUCE_MEAN;
  c->sp.param_dtype = c->opt.param_dtype;
  c->sp.pipelined = c->opt.pipelined != 0;
  rc = spec_validate(&c->sp, err, sizeof err);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_open_job: invalid model: %s", err);
    goto fail;
  }
  layout_free(&c->lay);
  rc = layout_build(&c->sp, &c->lay);
  if (rc != ZS_OK) {
    rc = zc_fail(rc, "zs_open_job: out of memory computing the layout");
    goto fail;
  }
  for (uint32_t i = 0; i < c->lay.num_pieces; i++) {
    if (c->lay.pieces[i].numel * sizeof(float) > RPC_MAX_MESSAGE_BYTES - 4096) {
      rc = zc_fail(ZS_ERANGE,
                   "zs_open_job: a piece of tensor '%s' has %" PRIu64
                   " elements, too many for one message; use more shards",
                   c->sp.tensors[c->lay.pieces[i].tensor].name, c->lay.pieces[i].numel);
      goto fail;
    }
  }
  c->hash = spec_hash(&c->sp);
  size_t nbits = (size_t)c->sp.num_tensors * c->sp.grad_accum;
  free(c->pushed);
  c->pushed = calloc((nbits + 7) / 8, 1);
  if (!c->pushed) {
    rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
    goto fail;
  }
  if (c->opt.prefetch_depth && !c->slots) {
    c->slots = calloc(c->sp.num_tensors, sizeof *c->slots);
    if (!c->slots) {
      rc = zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
      goto fail;
    }
  }
  rc = open_on_shards(c, &version, cs, &cs_len);
  if (rc != ZS_OK)
    goto fail;
  if (c->opt.rank == 0 && version == 0 && !deferred && c->opt.open_mode != ZS_OPEN_JOIN) {
    rc = init_params(c, init_weights, UINT32_MAX, NULL);
    if (rc != ZS_OK)
      goto fail;
  }
  if (c->opt.transport == ZS_TRANSPORT_DATA) {
    rc = zc_dp_open(c);
    if (rc != ZS_OK)
      goto fail;
  }
  uint64_t first = version + 1;
  if ((rc = zc_member_join(c, &first)) != ZS_OK)
    goto fail;
  pthread_mutex_lock(&c->mu);
  c->step = first;
  /* Resuming a trained job: the scaler continues where the job's version
   * left it (an absent or foreign state leaves it as configured). */
  if (version > 0 && c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    zc_scaler_decode(&c->scaler, cs, cs_len);
  c->opened = 1;
  c->opening = 0;
  c->mark_ns = clock_now_ns();
  c->push_ns = c->pull_ns = 0;
  c->bytes_pushed = c->bytes_pulled = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return ZS_OK;
fail:
  /* The description stays as it was, so the call can be repeated (for
   * instance once the shards are up). */
  pthread_mutex_lock(&c->mu);
  c->opening = 0;
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

int zs_open_job(zs_client *c, const float *const *init_weights) {
  return open_job(c, init_weights, 0);
}

int zs_open_job_deferred(zs_client *c) {
  return open_job(c, NULL, 1);
}

/* ---- deferred initial weights ----------------------------------------------------- */

int zs_init_tensor(zs_client *c, uint32_t tensor, const float *weights) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened)
    rc = zc_fail(ZS_ENOTOPEN, "zs_init_tensor: the job is not open (zs_open_job_deferred)");
  else if (tensor >= c->sp.num_tensors)
    rc = zc_fail(ZS_ENOTFOUND, "zs_init_tensor: no tensor %" PRIu32 " (the job has %" PRIu32 ")",
                 tensor, c->sp.num_tensors);
  else if (!weights)
    rc = zc_fail(ZS_EINVAL, "zs_init_tensor: the weights of tensor '%s' are NULL",
                 c->sp.tensors[tensor].name);
  else
    rc = init_params(c, NULL, tensor, weights);
  zc_client_leave(c);
  return rc;
}

/* How many shards answer GetInfo with every piece initialised; ZS_OK or a
 * failure of the calls. */
static int count_initialized(zs_client *c, uint32_t *ready) {
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  zs_request *op = zc_op_get_info(c, &req);
  if (!op)
    return zc_fail(ZS_ENOMEM, "zs_wait_initialized: out of memory");
  int rc = zc_call_all(op);
  *ready = 0;
  for (uint32_t i = 0; i < op->ntasks; i++) {
    const Zshard__V1__GetInfoResponse *r = (const Zshard__V1__GetInfoResponse *)op->tasks[i].resp;
    if (r && r->spec_hash == c->hash && r->initialized)
      (*ready)++;
    if (r)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  }
  zc_op_release(op);
  return rc;
}

int zs_wait_initialized(zs_client *c, uint64_t timeout_ms) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&c->mu);
  if (!opened) {
    zc_client_leave(c);
    return zc_fail(ZS_ENOTOPEN, "zs_wait_initialized: the job is not open");
  }
  uint64_t start = clock_now_ms(), pause_ms = 10;
  uint32_t ready = 0;
  for (;;) {
    rc = count_initialized(c, &ready);
    if (rc != ZS_OK || ready == c->nshards)
      break;
    uint64_t now = clock_now_ms();
    if (timeout_ms && now - start >= timeout_ms) {
      rc = zc_fail(ZS_ETIMEDOUT,
                   "zs_wait_initialized: %" PRIu32 " of %" PRIu32
                   " shards still lack initial weights after %" PRIu64
                   " ms (rank 0 sends them with zs_init_tensor after zs_open_job_deferred)",
                   c->nshards - ready, c->nshards, now - start);
      break;
    }
    /* Polling, backing off to 200 ms: initialising a large model takes
     * seconds to minutes, and GetInfo is cheap for the shard. */
    struct timespec ts = {0, (long)(pause_ms * 1000000)};
    nanosleep(&ts, NULL);
    pause_ms = pause_ms * 2 > 200 ? 200 : pause_ms * 2;
  }
  zc_client_leave(c);
  return rc;
}

/* ---- closing the job ------------------------------------------------------------- */

int zs_close_job(zs_client *c) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  pthread_mutex_lock(&c->mu);
  if (!c->opened || c->stepping) {
    int opened = c->opened;
    pthread_mutex_unlock(&c->mu);
    zc_client_leave(c);
    return opened ? zc_fail(ZS_EINVAL, "zs_close_job: a zs_step is running on this client")
                  : zc_fail(ZS_ENOTOPEN, "zs_close_job: the job is not open");
  }
  /* stepping keeps a zs_step out while the shards close the job. */
  c->stepping = 1;
  pthread_mutex_unlock(&c->mu);
  Zshard__V1__CloseJobRequest req = ZSHARD__V1__CLOSE_JOB_REQUEST__INIT;
  req.spec_hash = c->hash;
  req.job = c->sp.job; /* frozen since zs_open_job; packing only reads it */
  zs_request *op = zc_op_new(c, ZC_OP_CALL, c->nshards);
  if (!op) {
    rc = zc_fail(ZS_ENOMEM, "zs_close_job: out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < c->nshards; i++) {
    zc_task *t = &op->tasks[i];
    t->shard = i;
    t->method = ZC_METHOD("CloseJob");
    t->msg = &req.base;
    t->resp_desc = &zshard__v1__close_job_response__descriptor;
    t->timeout_ms = c->opt.rpc_timeout_ms;
  }
  rc = zc_call_all(op);
  if (rc != ZS_OK) {
    char why[ZC_ERR_LEN];
    snprintf(why, sizeof why, "%s", zs_last_error());
    rc = zc_fail(rc, "zs_close_job: %.440s", why);
  }
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  zc_op_release(op);
done:
  pthread_mutex_lock(&c->mu);
  c->stepping = 0;
  if (rc == ZS_OK) {
    c->opened = 0;
    c->job_closed = 1;
  }
  pthread_mutex_unlock(&c->mu);
  zc_client_leave(c);
  return rc;
}

/* ---- accessors -------------------------------------------------------------------- */

uint32_t zs_num_tensors(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint32_t n = c->sp.num_tensors;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return n;
}

uint64_t zs_tensor_numel(const zs_client *c, uint32_t t) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t n = t < c->sp.num_tensors ? c->sp.tensors[t].numel : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return n;
}

int zs_tensor_slices(const zs_client *c, uint32_t t, uint32_t *n) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  int opened = c->opened;
  pthread_mutex_unlock(&m->mu);
  /* Once opened, the layout never changes: read without the lock. */
  if (!opened)
    rc = zc_fail(ZS_ENOTOPEN, "zs_tensor_slices: the job is not open (the layout is computed by "
                              "zs_open_job)");
  else if (!n)
    rc = zc_fail(ZS_EINVAL, "zs_tensor_slices: n is NULL");
  else if (t >= c->sp.num_tensors)
    rc =
        zc_fail(ZS_ENOTFOUND, "zs_tensor_slices: no tensor %" PRIu32 " (the model has %" PRIu32 ")",
                t, c->sp.num_tensors);
  else
    *n = layout_tensor_pieces(&c->lay, t);
  zc_client_leave(c);
  return rc;
}

int zs_tensor_slice(const zs_client *c, uint32_t t, uint32_t i, uint32_t *shard, uint64_t *offset,
                    uint64_t *numel) {
  uint32_t n = 0;
  int rc = zs_tensor_slices(c, t, &n);
  if (rc != ZS_OK)
    return rc;
  if (i >= n)
    return zc_fail(ZS_ENOTFOUND,
                   "zs_tensor_slice: tensor %" PRIu32 " has %" PRIu32 " slice(s), not %" PRIu32, t,
                   n, i + 1);
  const layout_piece *pc = &c->lay.pieces[c->lay.tensor_first[t] + i];
  if (shard)
    *shard = pc->shard;
  if (offset)
    *offset = pc->offset;
  if (numel)
    *numel = pc->numel;
  return ZS_OK;
}

int zs_find_tensor(const zs_client *c, const char *name, uint32_t *id) {
  int rc = zc_client_enter(c);
  if (rc != ZS_OK)
    return rc;
  if (!name || !id) {
    zc_client_leave(c);
    return zc_fail(ZS_EINVAL, "zs_find_tensor: name and id must not be NULL");
  }
  zs_client *m = (zs_client *)(uintptr_t)c;
  rc = zc_fail(ZS_ENOTFOUND, "zs_find_tensor: no tensor named '%s'", name);
  pthread_mutex_lock(&m->mu);
  for (uint32_t i = 0; i < c->sp.num_tensors; i++) {
    if (strcmp(c->sp.tensors[i].name, name) == 0) {
      *id = i;
      rc = ZS_OK;
      break;
    }
  }
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return rc;
}

uint64_t zs_current_step(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t s = c->opened ? c->step : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return s;
}

double zs_loss_scale(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 1.0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  double s = 1.0;
  if (c->opt.loss_scaling == ZS_LOSS_SCALE_STATIC)
    s = c->opt.static_loss_scale;
  else if (c->opt.loss_scaling == ZS_LOSS_SCALE_DYNAMIC)
    s = c->scaler.scale;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return s;
}

uint64_t zs_spec_hash(const zs_client *c) {
  if (zc_client_enter(c) != ZS_OK)
    return 0;
  zs_client *m = (zs_client *)(uintptr_t)c;
  pthread_mutex_lock(&m->mu);
  uint64_t h = c->opened ? c->hash : 0;
  pthread_mutex_unlock(&m->mu);
  zc_client_leave(c);
  return h;
}
