/*
 * metrics — what zshard-server tells Prometheus: a registry of the numbers
 * only the transports and the core know the moment they happen (request and
 * apply latency histograms, failed requests per method), the rendering of
 * those and of the core's counters in the Prometheus text exposition format
 * (version 0.0.4). The HTTP endpoint that serves the page is
 * server/metrics/metrics_http.h.
 *
 * The registry and the endpoint have separate lifetimes, because the core
 * records into the registry from its worker thread until core_destroy
 * returns, while the endpoint reads the core and must stop before it is
 * destroyed:
 *
 *   metrics_create -> core_create (apply_hist) -> transports -> server start
 *   ... server stop -> transports stop -> core_destroy -> metrics_destroy
 *
 * Every metric carries the label shard="<id>". The names, their units and
 * what to alert on are listed in docs/OPERATIONS.md.
 */
#ifndef ZSHARD_SERVER_METRICS_H
#define ZSHARD_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "server/core/core.h"
#include "server/core/histogram.h"

/* Distinct (transport, method) pairs a registry holds. */
#define METRICS_MAX_RPCS 32
/* Longest transport or method name; longer ones are refused. */
#define METRICS_MAX_NAME 31

typedef struct metrics metrics;
/* One (transport, method) pair's request histogram and failure count. */
typedef struct metrics_rpc metrics_rpc;

/* Creates an empty registry for shard `shard_id`; the uptime it reports
 * starts now. Returns 0 and the registry in *out (the caller's, freed with
 * metrics_destroy), or ZS_ENOMEM. */
int metrics_create(uint32_t shard_id, metrics **out);

/* Frees the registry. Every pointer it handed out (metrics_apply_histogram,
 * metrics_rpc_register) dies with it, so it must come after everything that
 * records (the core, the transports) and after metrics_server_stop. NULL is
 * accepted. */
void metrics_destroy(metrics *m);

/* The histogram the core records each apply's duration into (core_config's
 * apply_hist). Owned by the registry. NULL when m is NULL. */
histogram *metrics_apply_histogram(metrics *m);

/* Returns the series of requests to `method` over `transport` ("grpc",
 * "data"), creating it on the first call: the same pair always gives the same
 * pointer. Both strings are copied; they must be 1 to METRICS_MAX_NAME
 * characters of [A-Za-z0-9_.] (they become label values). The result is owned
 * by the registry. Returns NULL when m is NULL, a name is not acceptable or
 * the registry is full; metrics_rpc_observe accepts that NULL, so a transport
 * need not care. Thread-safe. */
metrics_rpc *metrics_rpc_register(metrics *m, const char *transport, const char *method);

/* Records one answered request: how long it took from its arrival to its
 * answer, and whether the answer was an error. Lock-free. `r` may be NULL. */
void metrics_rpc_observe(metrics_rpc *r, uint64_t ns, int failed);

/* The resident set size of this process in bytes (from /proc/self/statm), or
 * 0 when it cannot be read. */
uint64_t metrics_process_rss(void);

/* Renders every metric of `m` and of the core `c` (borrowed, read through
 * core_get_info and core_get_counters, which never wait for an apply) in the
 * Prometheus text format. Returns 0 with a malloc'd, NUL-terminated text in
 * *out (the caller frees it) and its length in *len, or ZS_ENOMEM. */
int metrics_render(metrics *m, core *c, char **out, size_t *len);

/* One family of the page metrics_render writes: its name, its Prometheus
 * type ("gauge", "counter" or "histogram") and its help sentence. The
 * strings are static. */
typedef struct metrics_family {
  const char *name;
  const char *type;
  const char *help;
} metrics_family;

/* The i-th family metrics_render writes itself, in the order of the page
 * (the extras added with metrics_add_extra are not among them), or NULL past
 * the last. The two request families are written only once a (transport,
 * method) pair is registered. The table is static; tests compare the page
 * with it. */
const metrics_family *metrics_family_at(size_t i);

/* The text a render grows: p holds len bytes and a NUL in cap. After a
 * failed allocation it stays failed (oom) and takes nothing more, so the
 * render checks once at the end. */
typedef struct metrics_text {
  char *p;
  size_t len, cap;
  int oom;
} metrics_text;

/* Appends the formatted line(s) to t. */
void metrics_text_printf(metrics_text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* More lines for every render, appended by fn(arg, t): the replica set's,
 * the data plane's. Add them before the endpoint starts and stop the
 * endpoint before freeing arg; fn runs on the rendering thread, in the
 * order added. Returns 0, or ZS_ENOMEM when METRICS_MAX_EXTRA are set. */
#define METRICS_MAX_EXTRA 4
typedef void (*metrics_extra_fn)(void *arg, metrics_text *t);
int metrics_add_extra(metrics *m, metrics_extra_fn fn, void *arg);

#endif
