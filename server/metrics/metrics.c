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
#include <stddef.h>
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

static void family(metrics_text *b, const metrics_family *f) {
  metrics_text_printf(b, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name, f->type);
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

/* ------------------------------------------------------------------------ */
/* The families                                                             */
/* ------------------------------------------------------------------------ */

/* Everything one render reads, taken once before the first line is written:
 * the core's snapshots and the registry's own numbers. The table below says
 * which field each family shows. */
typedef struct reading {
  uint64_t shards, job_open, initialized, version, parameters, state_bytes, held_bytes;
  uint64_t members, membership_epoch, member_leaves, member_joins, trainer_timeouts;
  uint64_t pushes, duplicate_pushes, rejected_pushes, pulls, received_bytes, sent_bytes;
  uint64_t applies, skipped_steps, rss;
  uint32_t waiting_pulls, waiting_stats;
  double uptime, start_time;
  size_t nrpc; /* registered (transport, method) pairs */
} reading;

/* How a family's samples are read and written. */
typedef enum how {
  HOW_U64,        /* one sample, the uint64_t at `field` */
  HOW_F64,        /* one sample, the double at `field` */
  HOW_BUILD_INFO, /* 1 with the release as a label */
  HOW_WAITING,    /* one sample per method that parks (Pull, GradStats) */
  HOW_APPLY,      /* the registry's apply histogram */
  HOW_RPC_TIME,   /* one histogram per (transport, method); absent with none */
  HOW_RPC_ERRORS, /* one counter per (transport, method); absent with none */
} how;

typedef struct family_desc {
  metrics_family f; /* first, so metrics_family_at can hand out &FAMILIES[i].f */
  how how;
  size_t field; /* offsetof(reading, ...) for HOW_U64 and HOW_F64 */
} family_desc;

#define U64(name, type, help, fld)                                                                 \
  { {name, type, help}, HOW_U64, offsetof(reading, fld) }
#define F64(name, help, fld)                                                                       \
  { {name, "gauge", help}, HOW_F64, offsetof(reading, fld) }

/* Every family this file writes, in the order of the page. The names, units
 * and what to alert on are documented in docs/OPERATIONS.md. */
static const family_desc FAMILIES[] = {
    {{"zshard_build_info", "gauge", "The zshard release this server runs; always 1."},
     HOW_BUILD_INFO,
     0},
    U64("zshard_shards", "gauge", "Number of shard servers in the job (--shards).", shards),
    F64("zshard_uptime_seconds", "Seconds since the server started.", uptime),
    F64("process_start_time_seconds", "Start time of the process since the Unix epoch in seconds.",
        start_time),
    U64("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", rss),
    U64("zshard_job_open", "gauge", "1 when a job is open on this shard, else 0.", job_open),
    U64("zshard_initialized", "gauge",
        "1 when every piece this shard owns has its initial weights, else 0.", initialized),
    U64("zshard_version", "gauge",
        "Parameter version: the number of steps applied or skipped since the initial weights.",
        version),
    U64("zshard_parameters", "gauge", "Parameters (elements) this shard owns.", parameters),
    U64("zshard_state_bytes", "gauge",
        "Bytes of training state this shard holds: master weights, optimizer moments, gradient "
        "accumulator and low-precision copy.",
        state_bytes),
    U64("zshard_held_bytes", "gauge",
        "Bytes of early gradient contributions held until their turn in the fixed summation "
        "order.",
        held_bytes),
    U64("zshard_members", "gauge",
        "Trainer ranks that are members of the pending step (the job's world size unless the "
        "trainer timeout left some out; docs/OPERATIONS.md, \"Elastic trainers\").",
        members),
    U64("zshard_membership_epoch", "gauge",
        "How many times the job's membership changed on this shard.", membership_epoch),
    U64("zshard_member_leaves_total", "counter",
        "Ranks that left the job: left out at the trainer timeout, or closed.", member_leaves),
    U64("zshard_member_joins_total", "counter",
        "Ranks admitted to the job by a join (a new or restarted trainer).", member_joins),
    U64("zshard_trainer_timeouts_total", "counter",
        "Steps whose membership this shard decided at the trainer timeout.", trainer_timeouts),
    U64("zshard_pushes_total", "counter",
        "Gradient contributions accepted (Push), duplicates included.", pushes),
    U64("zshard_duplicate_pushes_total", "counter",
        "Pushes acknowledged as repeats of a contribution already received (retries).",
        duplicate_pushes),
    U64("zshard_rejected_pushes_total", "counter",
        "Pushes refused (wrong hash, step, piece, size or dtype); they changed nothing.",
        rejected_pushes),
    U64("zshard_pulls_total", "counter", "Parameter reads answered (Pull).", pulls),
    U64("zshard_received_bytes_total", "counter", "Gradient payload bytes received in pushes.",
        received_bytes),
    U64("zshard_sent_bytes_total", "counter", "Bytes sent in answers to pulls.", sent_bytes),
    U64("zshard_applies_total", "counter", "Optimizer steps run or skipped (Apply).", applies),
    U64("zshard_skipped_steps_total", "counter",
        "Steps skipped for a gradient overflow (dynamic loss scaling).", skipped_steps),
    {{"zshard_waiting_requests", "gauge",
      "Requests parked in the shard, waiting: Pull for a version, GradStats for the "
      "contributions of the ranks still missing."},
     HOW_WAITING,
     0},
    {{"zshard_apply_duration_seconds", "histogram",
      "Duration of one step's optimizer pass (or skip) on this shard."},
     HOW_APPLY,
     0},
    {{"zshard_request_duration_seconds", "histogram",
      "Time from a request's arrival to its answer, per transport and method; Pull and "
      "GradStats include their wait."},
     HOW_RPC_TIME,
     0},
    {{"zshard_request_errors_total", "counter",
      "Requests answered with an error status, per transport and method."},
     HOW_RPC_ERRORS,
     0},
};

#undef U64
#undef F64

const metrics_family *metrics_family_at(size_t i) {
  return i < sizeof FAMILIES / sizeof FAMILIES[0] ? &FAMILIES[i].f : NULL;
}

/* Takes every number of one render. */
static void read_all(metrics *m, core *c, reading *r) {
  core_info info;
  core_counters k;
  core_membership mb;
  core_get_info(c, &info);
  core_get_counters(c, &k);
  core_get_membership(c, &mb);
  *r = (reading){
      .shards = info.num_shards,
      .job_open = info.has_job ? 1 : 0,
      .initialized = info.has_job && info.initialized ? 1 : 0,
      .version = k.version,
      .parameters = info.has_job ? info.elements : 0,
      .state_bytes = info.has_job ? info.state_bytes : 0,
      .held_bytes = k.held_bytes,
      .members = mb.members.n,
      .membership_epoch = mb.epoch,
      .member_leaves = mb.leaves,
      .member_joins = mb.joins,
      .trainer_timeouts = mb.timeouts,
      .pushes = k.pushes,
      .duplicate_pushes = k.duplicate_pushes,
      .rejected_pushes = k.rejected,
      .pulls = k.pulls,
      .received_bytes = k.bytes_in,
      .sent_bytes = k.bytes_out,
      .applies = k.applies,
      .skipped_steps = k.skipped_steps,
      .rss = metrics_process_rss(),
      .waiting_pulls = k.waiting_pulls,
      .waiting_stats = k.waiting_stats,
      .uptime = (double)(clock_now_ns() - m->start_ns) / 1e9,
      .start_time = m->start_unix_s,
  };
  pthread_mutex_lock(&m->lock);
  r->nrpc = m->nrpc;
  pthread_mutex_unlock(&m->lock);
}

/* Writes one family: its HELP and TYPE lines, then its samples. Entries of
 * the registry below r->nrpc are never changed again, so they are read
 * unlocked. */
static void emit(metrics_text *b, const metrics *m, const reading *r, const family_desc *d) {
  const char *name = d->f.name;
  const uint32_t id = m->shard_id;
  if ((d->how == HOW_RPC_TIME || d->how == HOW_RPC_ERRORS) && r->nrpc == 0)
    return;
  family(b, &d->f);
  switch (d->how) {
  case HOW_U64:
    metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\"} %" PRIu64 "\n", name, id,
                        *(const uint64_t *)((const char *)r + d->field));
    break;
  case HOW_F64:
    metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\"} %.15g\n", name, id,
                        *(const double *)((const char *)r + d->field));
    break;
  case HOW_BUILD_INFO:
    metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\",version=\"%s\"} 1\n", name, id, zs_version());
    break;
  case HOW_WAITING:
    metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\",method=\"Pull\"} %" PRIu32 "\n", name, id,
                        r->waiting_pulls);
    metrics_text_printf(b, "%s{shard=\"%" PRIu32 "\",method=\"GradStats\"} %" PRIu32 "\n", name, id,
                        r->waiting_stats);
    break;
  case HOW_APPLY:
    histogram_lines(b, m, name, "", &m->apply);
    break;
  case HOW_RPC_TIME:
    for (size_t i = 0; i < r->nrpc; i++) {
      char labels[2 * METRICS_MAX_NAME + 32];
      snprintf(labels, sizeof labels, ",transport=\"%s\",method=\"%s\"", m->rpcs[i].transport,
               m->rpcs[i].method);
      histogram_lines(b, m, name, labels, &m->rpcs[i].duration);
    }
    break;
  case HOW_RPC_ERRORS:
    for (size_t i = 0; i < r->nrpc; i++)
      metrics_text_printf(b,
                          "%s{shard=\"%" PRIu32 "\",transport=\"%s\",method=\"%s\"} %" PRIu64 "\n",
                          name, id, m->rpcs[i].transport, m->rpcs[i].method,
                          (uint64_t)atomic_load_explicit(&m->rpcs[i].failed, memory_order_relaxed));
    break;
  }
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

  reading r;
  read_all(m, c, &r);
  for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++)
    emit(&b, m, &r, &FAMILIES[i]);
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
