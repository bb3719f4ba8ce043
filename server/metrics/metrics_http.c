/*
 * metrics_http — the /metrics endpoint (see metrics_http.h).
 *
 * The HTTP protocol is libmicrohttpd's (Debian's libmicrohttpd12), not ours:
 * the port faces whatever the network sends, and a maintained parser with its
 * own limits (memory per connection, connection count, idle timeout) is a
 * smaller risk than a hand-written one. Serving from the data plane's libuv
 * loop was the other choice; it would still need an HTTP parser of our own,
 * and it would put the rendering of the page on the loop that moves tensor
 * bytes, so a scrape would delay Pushes.
 *
 * Threads and what they own:
 *  - libmicrohttpd's one internal thread owns the listening socket (handed to
 *    it after we bind, so the address rules and messages are ours) and every
 *    connection. on_request runs there and renders the page on the request's
 *    arrival; metrics_render takes only short locks (see metrics.c), so a
 *    scrape never waits for an apply.
 *  - metrics_server_stop, on the caller's thread, stops and joins it.
 */
#include "server/metrics/metrics_http.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/base/log.h"
#include "common/base/status.h"
#include "common/net/hostport.h"

struct metrics_server {
  struct MHD_Daemon *daemon;
  int port;
  metrics *m;
  core *c;
  unsigned max_conns;
  /* Connections open now; written and read only on libmicrohttpd's thread
   * (on_connection, on_accept). */
  unsigned open_conns;
};

/* ------------------------------------------------------------------------ */
/* Answers                                                                  */
/* ------------------------------------------------------------------------ */

/* Queues an answer of `len` bytes of `body`. With `owned` the body was
 * malloc'd and libmicrohttpd frees it (also on failure); otherwise it is a
 * static string. Every answer closes its connection after it, as the old
 * one-request-per-connection endpoint did, so a scraper never depends on
 * keep-alive. */
static enum MHD_Result answer(struct MHD_Connection *conn, unsigned code, const char *ctype,
                              char *body, size_t len, int owned) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
  if (!r) {
    if (owned)
      free(body);
    return MHD_NO; /* libmicrohttpd closes the connection */
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
  if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result ret = MHD_queue_response(conn, code, r);
  MHD_destroy_response(r);
  return ret;
}

static enum MHD_Result answer_text(struct MHD_Connection *conn, unsigned code, const char *text) {
  return answer(conn, code, "text/plain; charset=utf-8", (char *)text, strlen(text), 0);
}

/* RFC 9110 token characters, which a method is made of. libmicrohttpd passes
 * any method on; one that is not a token is a malformed request, not an
 * unsupported one. */
static int is_token(const char *s) {
  if (!*s)
    return 0;
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          (ch && strchr("!#$%&'*+-.^_`|~", ch))))
      return 0;
  }
  return 1;
}

/* libmicrohttpd's access handler: called once the request line and headers
 * are in (`url` is the path without its query string). It answers at that
 * first call, before any body: nothing here takes one, and libmicrohttpd
 * reads and drops a body it was not asked for before it closes. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_ctx) {
  metrics_server *s = cls;
  (void)version;
  (void)upload_data;
  (void)upload_data_size;
  (void)req_ctx;
  if (!is_token(method))
    return answer_text(conn, MHD_HTTP_BAD_REQUEST, "bad request method\n");
  if (url[0] != '/')
    return answer_text(conn, MHD_HTTP_BAD_REQUEST, "bad request target\n");
  if (strcmp(url, "/metrics") != 0)
    return answer_text(conn, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n");
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
    return answer_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed: use GET\n");
  /* HEAD renders too: libmicrohttpd sends the length and drops the body. */
  char *text = NULL;
  size_t len = 0;
  if (metrics_render(s->m, s->c, &text, &len) != 0)
    return answer_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  return answer(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len, 1);
}

/* libmicrohttpd's own complaints (a malformed request, the connection limit)
 * are about clients, not the shard: debug level. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[256];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '.'))
    msg[--n] = '\0';
  for (char *p = msg; *p; p++)
    if (*p == '"')
      *p = '\'';
  LOG_DEBUG("metrics_http", "detail=\"%s\"", msg);
}

/* libmicrohttpd, at its connection limit, stops accepting: a new client
 * would wait in the kernel's backlog until an idle one times out. A scraper
 * is better told at once, so its own limit is set one higher and this
 * refuses (closes) a connection that would go over ours. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
  metrics_server *s = cls;
  (void)addr;
  (void)addrlen;
  return s->open_conns < s->max_conns ? MHD_YES : MHD_NO;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode what) {
  metrics_server *s = cls;
  (void)conn;
  (void)socket_ctx;
  if (what == MHD_CONNECTION_NOTIFY_STARTED)
    s->open_conns++;
  else if (what == MHD_CONNECTION_NOTIFY_CLOSED)
    s->open_conns--;
}

/* ------------------------------------------------------------------------ */
/* Listener                                                                 */
/* ------------------------------------------------------------------------ */

static int open_listener(const char *addr, int *fd_out, int *port_out, char *err, size_t errlen) {
  hostport hp;
  char why[400], port[8];
  if (hostport_parse(addr, &hp, why, sizeof why) != 0)
    return status_fail(err, errlen, ZS_EINVAL, "metrics address: %s", why);
  const char *host = hp.host; /* empty: every interface */
  snprintf(port, sizeof port, "%u", (unsigned)hp.port);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
  if (gai != 0)
    return status_fail(err, errlen, ZS_EINVAL, "metrics address '%s': %s", addr, gai_strerror(gai));
  int fd = -1, saved = 0;
  for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      saved = errno;
      continue;
    }
    /* Lets a restarted server bind while old connections sit in TIME_WAIT;
     * on Linux it does not let two live servers share the port. */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      saved = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0)
    return status_fail(err, errlen, ZS_EINVAL, "cannot listen on metrics address %s: %s", addr,
                       strerror(saved));
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
    close(fd);
    return status_fail(err, errlen, ZS_EINTERNAL, "getsockname: %s", strerror(errno));
  }
  *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  *fd_out = fd;
  return 0;
}

int metrics_server_start(const metrics_server_config *cfg, metrics_server **out, char *err,
                         size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->listen || !cfg->metrics || !cfg->core)
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "metrics_server_start needs an address, a registry and a core");
  int fd = -1, rc;
  metrics_server *s = calloc(1, sizeof *s);
  if (!s)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  s->m = cfg->metrics;
  s->c = cfg->core;
  rc = open_listener(cfg->listen, &fd, &s->port, err, errlen);
  if (rc)
    goto fail;
  uint32_t timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : METRICS_DEFAULT_TIMEOUT_MS;
  s->max_conns = cfg->max_connections ? cfg->max_connections : METRICS_DEFAULT_MAX_CONNECTIONS;
  /* One internal thread polls every connection; the per-connection memory
   * pool bounds the request header block, the timeout (whole seconds) an idle
   * client, the limit how many there are. */
  s->daemon = MHD_start_daemon(
      MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, on_accept, s, on_request, s,
      MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
      MHD_OPTION_CONNECTION_LIMIT, s->max_conns + 1, MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)((timeout_ms + 999) / 1000),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)METRICS_MAX_REQUEST, MHD_OPTION_END);
  if (!s->daemon) {
    rc = status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot start the metrics HTTP server");
    goto fail;
  }
  *out = s;
  return 0;

fail:
  if (fd >= 0)
    close(fd);
  free(s);
  return rc;
}

int metrics_server_port(const metrics_server *s) {
  return s->port;
}

void metrics_server_stop(metrics_server *s) {
  if (!s)
    return;
  /* Closes the connections and the listening socket and joins the thread. */
  MHD_stop_daemon(s->daemon);
  free(s);
}
