/*
 * metrics — the registry and the text format (see metrics.h).
 *
 * Threads and what they own:
 *  - Any thread records: metrics_rpc_observe and histogram_observe_* are
 *    relaxed atomic increments, with no lock.
 *  - metrics.lock guards the list of registered series (nrpc and the names
 *    of the entries below it). An entry's names are written before nrpc
 *    counts it, under the lock, and never change afterwards.
 *  - metrics_render runs on whichever thread asks (the HTTP endpoint's). It
 *    takes metrics.lock and, inside the core, core.mu for a moment (as a
 *    Stats call does); never the state lock an apply holds, so a scrape
 *    waits for no apply and no apply waits for a scrape.
 */
#include "server/metrics/metrics.h"
#include "common/base/status.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/net/hostport.h"
#include "zshard/types.h"

/* ------------------------------------------------------------------------ */
/* Registry                                                                 */
/* ------------------------------------------------------------------------ */

struct metrics_rpc {
  char transport[METRICS_MAX_NAME + 1];
  char method[METRICS_MAX_NAME + 1];
  histogram duration;
  atomic_uint_fast64_t failed;
};

struct metrics {
  uint32_t shard_id;
  uint64_t start_ns;   /* clock_now_ns() at creation */
  double start_unix_s; /* wall clock at creation */
  histogram apply;
  pthread_mutex_t lock;
  size_t nrpc;
  metrics_rpc rpcs[METRICS_MAX_RPCS];
  size_t nextra; /* set before the endpoint starts */
  struct {
    metrics_extra_fn fn;
    void *arg;
  } extra[METRICS_MAX_EXTRA];
};

int metrics_create(uint32_t shard_id, metrics **out) {
  *out = NULL;
  metrics *m = calloc(1, sizeof *m);
  if (!m)
    return ZS_ENOMEM;
  if (pthread_mutex_init(&m->lock, NULL) != 0) {
    free(m);
    return ZS_ENOMEM;
  }
  m->shard_id = shard_id;
  m->start_ns = clock_now_ns();
  struct timeval tv;
  gettimeofday(&tv, NULL);
  m->start_unix_s = (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
  histogram_init(&m->apply);
  for (size_t i = 0; i < METRICS_MAX_RPCS; i++) {
    histogram_init(&m->rpcs[i].duration);
    atomic_init(&m->rpcs[i].failed, 0);
  }
  *out = m;
  return 0;
}

void metrics_destroy(metrics *m) {
  if (!m)
    return;
  pthread_mutex_destroy(&m->lock);
  free(m);
}

histogram *metrics_apply_histogram(metrics *m) {
  return m ? &m->apply : NULL;
}

/* Names become label values unescaped, so only a safe alphabet is taken. */
static int name_ok(const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (n == 0 || n > METRICS_MAX_NAME)
    return 0;
  for (size_t i = 0; i < n; i++) {
    char ch = s[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '_' || ch == '.'))
      return 0;
  }
  return 1;
}

metrics_rpc *metrics_rpc_register(metrics *m, const char *transport, const char *method) {
  if (!m || !name_ok(transport) || !name_ok(method))
    return NULL;
  metrics_rpc *r = NULL;
  pthread_mutex_lock(&m->lock);
  for (size_t i = 0; i < m->nrpc && !r; i++)
    if (strcmp(m->rpcs[i].transport, transport) == 0 && strcmp(m->rpcs[i].method, method) == 0)
      r = &m->rpcs[i];
  if (!r && m->nrpc < METRICS_MAX_RPCS) {
    r = &m->rpcs[m->nrpc];
    snprintf(r->transport, sizeof r->transport, "%s", transport);
    snprintf(r->method, sizeof r->method, "%s", method);
    m->nrpc++;
  }
  pthread_mutex_unlock(&m->lock);
  return r;
}

void metrics_rpc_observe(metrics_rpc *r, uint64_t ns, int failed) {
  if (!r)
    return;
  histogram_observe_ns(&r->duration, ns);
  if (failed)
    atomic_fetch_add_explicit(&r->failed, 1, memory_order_relaxed);
}

uint64_t metrics_process_rss(void) {
  /* statm's second field is the resident set in pages; one small read. */
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f)
    return 0;
  unsigned long long size = 0, resident = 0;
  int n = fscanf(f, "%llu %llu", &size, &resident);
  fclose(f);
  long page = sysconf(_SC_PAGESIZE);
  if (n != 2 || page <= 0)
    return 0;
  return (uint64_t)resident * (uint64_t)page;
}

/* ------------------------------------------------------------------------ */
/* Text format                                                              */
/* ------------------------------------------------------------------------ */

void metrics_text_printf(metrics_text *b, const char *fmt, ...) {
  if (b->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2;
    while (cap - b->len <= (size_t)n)
      cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

static void family(metrics_text *b, const char *name, const char *type, const char *help) {
  metrics_text_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample_u64(metrics_text *b, const metrics *m, const char *name, uint64_t v) {
  metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\"} %" PRIu64 "\n", name, m->shard_id, v);
}

static void sample_f(metrics_text *b, const metrics *m, const char *name, double v) {
  metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\"} %.15g\n", name, m->shard_id, v);
}

/* One histogram's _bucket, _sum and _count lines. `labels` are the labels
 * after shard, each written as ,key="value" (may be ""). */
static void histogram_lines(metrics_text *b, const metrics *m, const char *name, const char *labels,
                            const histogram *h) {
  histogram_snapshot s;
  histogram_read(h, &s);
  for (size_t i = 0; i <= HISTOGRAM_BOUNDS; i++) {
    char le[32];
    if (i < HISTOGRAM_BOUNDS)
      snprintf(le, sizeof le, "%.6g", histogram_bound_seconds(i));
    else
      snprintf(le, sizeof le, "+Inf");
    metrics_text_printf(b, "%s_bucket{shard=\"%" PRIu32 "\"%s,le=\"%s\"} %" PRIu64 "\n", name,
                        m->shard_id, labels, le, s.cumulative[i]);
  }
  metrics_text_printf(b, "%s_sum{shard=\"%" PRIu32 "\"%s} %.9g\n", name, m->shard_id, labels,
                      s.sum_seconds);
  metrics_text_printf(b, "%s_count{shard=\"%" PRIu32 "\"%s} %" PRIu64 "\n", name, m->shard_id,
                      labels, s.count);
}

int metrics_add_extra(metrics *m, metrics_extra_fn fn, void *arg) {
  if (m->nextra == METRICS_MAX_EXTRA)
    return ZS_ENOMEM;
  m->extra[m->nextra].fn = fn;
  m->extra[m->nextra].arg = arg;
  m->nextra++;
  return 0;
}

int metrics_render(metrics *m, core *c, char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  metrics_text b = {.p = malloc(16384), .cap = 16384};
  if (!b.p)
    return ZS_ENOMEM;
  b.p[0] = '\0';

  core_info info;
  core_counters k;
  core_get_info(c, &info);
  core_get_counters(c, &k);
  uint64_t now = clock_now_ns();
  const uint32_t id = m->shard_id;

  family(&b, "zshard_build_info", "gauge", "The zshard release this server runs; always 1.");
  metrics_text_printf(&b, "zshard_build_info{shard=\"%" PRIu32 "\",version=\"%s\"} 1\n", id,
                      zs_version());
  family(&b, "zshard_shards", "gauge", "Number of shard servers in the job (--shards).");
  sample_u64(&b, m, "zshard_shards", info.num_shards);
  family(&b, "zshard_uptime_seconds", "gauge", "Seconds since the server started.");
  sample_f(&b, m, "zshard_uptime_seconds", (double)(now - m->start_ns) / 1e9);
  family(&b, "process_start_time_seconds", "gauge",
         "Start time of the process since the Unix epoch in seconds.");
  sample_f(&b, m, "process_start_time_seconds", m->start_unix_s);
  family(&b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
  sample_u64(&b, m, "process_resident_memory_bytes", metrics_process_rss());

  family(&b, "zshard_job_open", "gauge", "1 when a job is open on this shard, else 0.");
  sample_u64(&b, m, "zshard_job_open", info.has_job ? 1 : 0);
  family(&b, "zshard_initialized", "gauge",
         "1 when every piece this shard owns has its initial weights, else 0.");
  sample_u64(&b, m, "zshard_initialized", info.has_job && info.initialized ? 1 : 0);
  family(&b, "zshard_version", "gauge",
         "Parameter version: the number of steps applied or skipped since the initial "
         "weights.");
  sample_u64(&b, m, "zshard_version", k.version);
  family(&b, "zshard_parameters", "gauge", "Parameters (elements) this shard owns.");
  sample_u64(&b, m, "zshard_parameters", info.has_job ? info.elements : 0);
  family(&b, "zshard_state_bytes", "gauge",
         "Bytes of training state this shard holds: master weights, optimizer moments, "
         "gradient accumulator and low-precision copy.");
  sample_u64(&b, m, "zshard_state_bytes", info.has_job ? info.state_bytes : 0);
  family(&b, "zshard_held_bytes", "gauge",
         "Bytes of early gradient contributions held until their turn in the fixed "
         "summation order.");
  sample_u64(&b, m, "zshard_held_bytes", k.held_bytes);

  core_membership mb;
  core_get_membership(c, &mb);
  family(&b, "zshard_members", "gauge",
         "Trainer ranks that are members of the pending step (the job's world size unless "
         "the trainer timeout left some out; docs/OPERATIONS.md, \"Elastic trainers\").");
  sample_u64(&b, m, "zshard_members", mb.members.n);
  family(&b, "zshard_membership_epoch", "gauge",
         "How many times the job's membership changed on this shard.");
  sample_u64(&b, m, "zshard_membership_epoch", mb.epoch);
  family(&b, "zshard_member_leaves_total", "counter",
         "Ranks that left the job: left out at the trainer timeout, or closed.");
  sample_u64(&b, m, "zshard_member_leaves_total", mb.leaves);
  family(&b, "zshard_member_joins_total", "counter",
         "Ranks admitted to the job by a join (a new or restarted trainer).");
  sample_u64(&b, m, "zshard_member_joins_total", mb.joins);
  family(&b, "zshard_trainer_timeouts_total", "counter",
         "Steps whose membership this shard decided at the trainer timeout.");
  sample_u64(&b, m, "zshard_trainer_timeouts_total", mb.timeouts);

  family(&b, "zshard_pushes_total", "counter",
         "Gradient contributions accepted (Push), duplicates included.");
  sample_u64(&b, m, "zshard_pushes_total", k.pushes);
  family(&b, "zshard_duplicate_pushes_total", "counter",
         "Pushes acknowledged as repeats of a contribution already received (retries).");
  sample_u64(&b, m, "zshard_duplicate_pushes_total", k.duplicate_pushes);
  family(&b, "zshard_rejected_pushes_total", "counter",
         "Pushes refused (wrong hash, step, piece, size or dtype); they changed nothing.");
  sample_u64(&b, m, "zshard_rejected_pushes_total", k.rejected);
  family(&b, "zshard_pulls_total", "counter", "Parameter reads answered (Pull).");
  sample_u64(&b, m, "zshard_pulls_total", k.pulls);
  family(&b, "zshard_received_bytes_total", "counter",
         "Gradient payload bytes received in pushes.");
  sample_u64(&b, m, "zshard_received_bytes_total", k.bytes_in);
  family(&b, "zshard_sent_bytes_total", "counter", "Bytes sent in answers to pulls.");
  sample_u64(&b, m, "zshard_sent_bytes_total", k.bytes_out);
  family(&b, "zshard_applies_total", "counter", "Optimizer steps run or skipped (Apply).");
  sample_u64(&b, m, "zshard_applies_total", k.applies);
  family(&b, "zshard_skipped_steps_total", "counter",
         "Steps skipped for a gradient overflow (dynamic loss scaling).");
  sample_u64(&b, m, "zshard_skipped_steps_total", k.skipped_steps);

  family(&b, "zshard_waiting_requests", "gauge",
         "Requests parked in the shard, waiting: Pull for a version, GradStats for the "
         "contributions of the ranks still missing.");
  metrics_text_printf(
      &b, "zshard_waiting_requests{shard=\"%" PRIu32 "\",method=\"Pull\"} %" PRIu32 "\n", id,
      k.waiting_pulls);
  metrics_text_printf(
      &b, "zshard_waiting_requests{shard=\"%" PRIu32 "\",method=\"GradStats\"} %" PRIu32 "\n", id,
      k.waiting_stats);

  family(&b, "zshard_apply_duration_seconds", "histogram",
         "Duration of one step's optimizer pass (or skip) on this shard.");
  histogram_lines(&b, m, "zshard_apply_duration_seconds", "", &m->apply);

  pthread_mutex_lock(&m->lock);
  size_t nrpc = m->nrpc;
  pthread_mutex_unlock(&m->lock);
  /* Entries below nrpc are never changed again, so they are read unlocked. */
  if (nrpc > 0) {
    family(&b, "zshard_request_duration_seconds", "histogram",
           "Time from a request's arrival to its answer, per transport and method; Pull and "
           "GradStats include their wait.");
    for (size_t i = 0; i < nrpc; i++) {
      char labels[2 * METRICS_MAX_NAME + 32];
      snprintf(labels, sizeof labels, ",transport=\"%s\",method=\"%s\"", m->rpcs[i].transport,
               m->rpcs[i].method);
      histogram_lines(&b, m, "zshard_request_duration_seconds", labels, &m->rpcs[i].duration);
    }
    family(&b, "zshard_request_errors_total", "counter",
           "Requests answered with an error status, per transport and method.");
    for (size_t i = 0; i < nrpc; i++)
      metrics_text_printf(&b,
                          "zshard_request_errors_total{shard=\"%" PRIu32
                          "\",transport=\"%s\",method=\"%s\"} %" PRIu64 "\n",
                          id, m->rpcs[i].transport, m->rpcs[i].method,
                          (uint64_t)atomic_load_explicit(&m->rpcs[i].failed, memory_order_relaxed));
  }

  for (size_t i = 0; i < m->nextra; i++)
    m->extra[i].fn(m->extra[i].arg, &b);
  if (b.oom) {
    free(b.p);
    return ZS_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}
