/*
 * metrics_http — the HTTP endpoint that serves the page of server/metrics/metrics.h
 * (GET /metrics) on its own port, with libmicrohttpd.
 *
 * It borrows the registry and the core; see metrics.h for the order in which
 * they are created and destroyed around it.
 */
#ifndef ZSHARD_SERVER_METRICS_HTTP_H
#define ZSHARD_SERVER_METRICS_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "server/core/core.h"
#include "server/metrics/metrics.h"

/* The memory a connection may use for its request line and headers (and the
 * head of its answer); a request whose header block does not fit is answered
 * 431. */
#define METRICS_MAX_REQUEST 8192
/* A connection that sends or takes nothing for this long is closed. */
#define METRICS_DEFAULT_TIMEOUT_MS 10000u
/* Connections served at once; more are answered 503 and closed. */
#define METRICS_DEFAULT_MAX_CONNECTIONS 16u

typedef struct metrics_server metrics_server;

typedef struct metrics_server_config {
  /* "host:port" or "[v6]:port" to listen on; port 0 picks a free port (see
   * metrics_server_port). Only read during metrics_server_start. */
  const char *listen;
  /* Borrowed; both must outlive the server (metrics_server_stop first). */
  metrics *metrics;
  core *core;
  /* 0 means METRICS_DEFAULT_TIMEOUT_MS; rounded up to whole seconds. */
  uint32_t timeout_ms;
  /* 0 means METRICS_DEFAULT_MAX_CONNECTIONS. */
  uint32_t max_connections;
} metrics_server_config;

/* Binds and starts the server thread. Returns 0 and the server in *out (the
 * caller's, released with metrics_server_stop), or ZS_EINVAL (the address is
 * not host:port, or cannot be bound) / ZS_ENOMEM / ZS_EINTERNAL with a
 * sentence in err (which may be NULL).
 *
 * What it answers, one request per connection (Connection: close):
 *  - GET or HEAD /metrics (any query string): 200, the text of
 *    metrics_render;
 *  - another path: 404; another method: 405 with Allow: GET, HEAD;
 *  - a method that is not a token, a target that is not a path: 400; a
 *    request libmicrohttpd cannot parse: 400, or 505 for an HTTP version
 *    other than 1.x, or the connection closed without an answer; a header
 *    block over METRICS_MAX_REQUEST: 431;
 *  - a connection over the limit: closed at once, unanswered.
 * A client that goes quiet, sending or reading nothing, is closed at its
 * timeout; no client can hold up another or the shard. */
int metrics_server_start(const metrics_server_config *cfg, metrics_server **out, char *err,
                         size_t errlen);

/* The TCP port the server listens on. */
int metrics_server_port(const metrics_server *s);

/* Closes every connection and the listener, joins the thread and frees the
 * server. NULL is accepted. */
void metrics_server_stop(metrics_server *s);

#endif
