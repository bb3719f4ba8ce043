/*
 * client — the zs_client handle: options, the registry of live clients,
 * zs_client_open and zs_client_close. The shard addresses are addresses.c,
 * the model description model.c, the job's opening and closing job.c.
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

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/net/dp_client.h"
#include "common/net/stream.h"
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
  stream_pacer_free(c->pacer); /* after the data clients, its members */
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
  if (rc == ZS_OK)
    rc = zc_pacing_resolve(opt.tcp_pacing_mbit, &c->opt.tcp_pacing_mbit);
  if (rc == ZS_OK)
    rc = zc_link_resolve(c->opt.tcp_pacing_mbit, &c->pacer);
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
  /* Over the data plane a run only hands pieces on: one at a time per
   * shard keeps them in the order they were pushed (pool.c). */
  zc_pool_order_pushes(&c->pool, batches);
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
