/*
 * stream — byte streams, listeners and dialers (see stream.h); the generic
 * dispatchers, then plain TCP over libuv.
 *
 * Every object here is touched only by its loop's thread. The TCP objects
 * embed their libuv handle, whose `data` points back at the object; the
 * object is freed in the handle's close callback, never earlier, because
 * libuv still owns the handle until then.
 *
 * Copies: none. Reads go into whatever buffer the owner's alloc callback
 * returns (libuv passes it to read(2) as is); writes hand the owner's buffer
 * list to uv_write, which sends it with writev(2) and, when the socket
 * cannot take it all at once, keeps a copy of the list (not of the bytes)
 * for the rest.
 */
#include "common/net/stream.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/base/list.h"
#include "common/net/stream_impl.h"

int stream_status_from_uv(int uverr) {
  switch (uverr) {
  case 0:
    return 0;
  case UV_EOF:
    return STREAM_EOF;
  case UV_ECANCELED:
    return ZS_ECANCELED;
  case UV_ECONNREFUSED:
  case UV_ECONNRESET:
  case UV_ECONNABORTED:
  case UV_EPIPE:
  case UV_ENOTCONN:
  case UV_EHOSTUNREACH:
  case UV_ENETUNREACH:
  case UV_ENETDOWN:
  case UV_EHOSTDOWN:
    return ZS_ECONN;
  case UV_ETIMEDOUT:
    return ZS_ETIMEDOUT;
  case UV_ENOMEM:
  case UV_ENOBUFS:
    return ZS_ENOMEM;
  case UV_EINVAL:
  case UV_EADDRINUSE:
  case UV_EADDRNOTAVAIL:
  case UV_EACCES:
  case UV_EAFNOSUPPORT:
    return ZS_EINVAL;
  default:
    return ZS_EIO;
  }
}

/* ------------------------------------------------------------------------ */
/* Dispatchers                                                              */
/* ------------------------------------------------------------------------ */

int stream_listen(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr, int backlog,
                  stream_accept_cb cb, void *data, stream_listener **out, char *err,
                  size_t errlen) {
  if (err && errlen)
    err[0] = '\0';
  if (!ops || !loop || !addr || !cb || !out)
    return ZS_EINVAL;
  return ops->listen(ops, loop, addr, backlog, cb, data, out, err, errlen);
}

int stream_listener_addr(stream_listener *l, struct sockaddr_storage *out) {
  return l->ops->listener_addr(l, out);
}

void stream_listener_close(stream_listener *l) {
  if (l)
    l->ops->listener_close(l);
}

const char *stream_listener_detail(const stream_listener *l) {
  return l->detail ? l->detail : "";
}

int stream_dialer_new(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr,
                      stream_dialer **out) {
  size_t len = !addr                         ? 0
               : addr->sa_family == AF_INET  ? sizeof(struct sockaddr_in)
               : addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                             : 0;
  if (!ops || !loop || !out || len == 0)
    return ZS_EINVAL;
  stream_dialer *d = calloc(1, sizeof *d);
  if (!d)
    return ZS_ENOMEM;
  d->ops = ops;
  d->loop = loop;
  memcpy(&d->addr, addr, len);
  *out = d;
  return 0;
}

int stream_dial(stream_dialer *d, stream_connect_cb cb, void *data, stream **out) {
  *out = NULL;
  if (!cb)
    return ZS_EINVAL;
  return d->ops->dial(d, cb, data, out);
}

void stream_dialer_free(stream_dialer *d) {
  if (!d)
    return;
  /* A TLS dialer's own parts; NULL for the others. */
  stream_dialer_free(d->tcp);
  free(d->server_name);
  free(d);
}

void stream_set_data(stream *s, void *data) {
  s->data = data;
}

void *stream_get_data(const stream *s) {
  return s->data;
}

int stream_read_start(stream *s, stream_alloc_cb alloc_cb, stream_read_cb read_cb) {
  if (s->closing)
    return ZS_ECLOSED;
  if (!alloc_cb || !read_cb)
    return ZS_EINVAL;
  return s->ops->read_start(s, alloc_cb, read_cb);
}

void stream_read_stop(stream *s) {
  if (!s->closing)
    s->ops->read_stop(s);
}

int stream_write(stream *s, stream_write_req *req, const uv_buf_t *bufs, unsigned nbufs,
                 stream_write_cb cb) {
  if (s->closing)
    return ZS_ECLOSED;
  if (!req || !cb || (nbufs && !bufs))
    return ZS_EINVAL;
  req->s = s;
  req->cb = cb;
  req->paced = 0;
  if (s->pacer) {
    size_t n = 0;
    for (unsigned i = 0; i < nbufs; i++)
      n += bufs[i].len;
    stream__pace_write_start(s, req, n);
  }
  int rc = s->ops->write(s, req, bufs, nbufs);
  if (rc != 0)
    stream__pace_write_undo(req); /* no callback will come */
  return rc;
}

size_t stream_write_queue_size(const stream *s) {
  return s->ops->write_queue_size(s);
}

int stream_shutdown(stream *s, stream_shutdown_cb cb) {
  if (s->closing)
    return ZS_ECLOSED;
  return s->ops->shutdown(s, cb);
}

void stream_close(stream *s, stream_close_cb cb) {
  if (!s || s->closing)
    return;
  s->closing = 1;
  s->close_cb = cb;
  stream__pace_leave(s); /* before the socket goes */
  s->ops->close(s);
}

int stream_is_closing(const stream *s) {
  return s->closing;
}

int stream_peer_addr(stream *s, struct sockaddr_storage *out) {
  return s->ops->peer_addr(s, out);
}

int stream_local_addr(stream *s, struct sockaddr_storage *out) {
  return s->ops->local_addr(s, out);
}

int stream_set_option(stream *s, stream_option opt, int value) {
  if (s->closing)
    return ZS_ECLOSED;
  return s->ops->set_option(s, opt, value);
}

const char *stream_detail(const stream *s) {
  return s->detail ? s->detail : "";
}

/* ------------------------------------------------------------------------ */
/* TCP congestion control                                                   */
/* ------------------------------------------------------------------------ */

/* A name the kernel could hold: 1..15 characters of [A-Za-z0-9_]. Checked
 * before anything reaches setsockopt or an error message. */
static int cc_name_ok(const char *name) {
  size_t n = name ? strlen(name) : 0;
  if (n == 0 || n >= STREAM_CC_NAME_MAX)
    return 0;
  for (size_t i = 0; i < n; i++) {
    char ch = name[i];
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '_'))
      return 0;
  }
  return 1;
}

/* The first line of a /proc file into buf ("" when it cannot be read). */
static void cc_read_list(const char *path, char *buf, size_t len) {
  buf[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f)
    return;
  if (!fgets(buf, (int)len, f))
    buf[0] = 0;
  fclose(f);
  buf[strcspn(buf, "\n")] = 0;
}

int stream_cc_check(const char *name, char *err, size_t errlen) {
  char avail[256], allowed[256];
  if (!cc_name_ok(name)) {
    if (err && errlen)
      snprintf(err, errlen,
               "TCP congestion control: '%.32s' is not a congestion control's name (1 to %d "
               "letters, digits or '_', e.g. cubic, reno, bbr)",
               name ? name : "", STREAM_CC_NAME_MAX - 1);
    return ZS_EINVAL;
  }
#ifdef TCP_CONGESTION
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) {
    if (err && errlen)
      snprintf(err, errlen, "TCP congestion control: no socket to try '%s' on (%s)", name,
               strerror(errno));
    return ZS_EIO;
  }
  int rc = setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, (socklen_t)strlen(name));
  int e = errno;
  close(fd);
  if (rc == 0)
    return ZS_OK;
  cc_read_list("/proc/sys/net/ipv4/tcp_available_congestion_control", avail, sizeof avail);
  cc_read_list("/proc/sys/net/ipv4/tcp_allowed_congestion_control", allowed, sizeof allowed);
  if (err && errlen) {
    if (e == EPERM)
      snprintf(err, errlen,
               "TCP congestion control '%s' is available but not allowed to this process "
               "(net.ipv4.tcp_allowed_congestion_control: %s); add it there, or run with "
               "CAP_NET_ADMIN",
               name, allowed);
    else
      snprintf(err, errlen,
               "TCP congestion control '%s' is not available in this kernel (%s; "
               "/proc/sys/net/ipv4/tcp_available_congestion_control: %s; a module such as "
               "tcp_%s may need loading)",
               name, strerror(e), avail, name);
  }
  return ZS_EINVAL;
#else
  (void)avail;
  (void)allowed;
  if (err && errlen)
    snprintf(err, errlen, "TCP congestion control: this system has no TCP_CONGESTION");
  return ZS_EUNIMPL;
#endif
}

int stream_set_congestion(stream *s, const char *name) {
  if (s->closing)
    return ZS_ECLOSED;
  if (!cc_name_ok(name))
    return ZS_EINVAL;
#ifdef TCP_CONGESTION
  int fd = s->ops->fd(s);
  if (fd < 0)
    return fd;
  if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, (socklen_t)strlen(name)) != 0) {
    s->detail = strerror(errno);
    return errno == ENOENT || errno == EPERM ? ZS_EINVAL : ZS_EIO;
  }
  return ZS_OK;
#else
  return ZS_EUNIMPL;
#endif
}

int stream_congestion(const stream *s, char *buf, size_t len) {
  if (!buf || len == 0)
    return ZS_EINVAL;
  buf[0] = 0;
  if (s->closing)
    return ZS_ECLOSED;
#ifdef TCP_CONGESTION
  int fd = s->ops->fd(s);
  if (fd < 0)
    return fd;
  char name[STREAM_CC_NAME_MAX] = {0};
  socklen_t n = sizeof name - 1;
  if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &n) != 0)
    return ZS_EIO;
  name[n < sizeof name ? n : sizeof name - 1] = 0;
  snprintf(buf, len, "%s", name);
  return ZS_OK;
#else
  return ZS_EUNIMPL;
#endif
}

/* ------------------------------------------------------------------------ */
/* TCP pacing                                                               */
/* ------------------------------------------------------------------------ */

/* glibc's <sys/socket.h> has carried it since 2.19; Linux's number. */
#if defined(__linux__) && !defined(SO_MAX_PACING_RATE)
#define SO_MAX_PACING_RATE 47
#endif

/* A whole number of at most `digits` decimal digits and at most max (no
 * sign, no spaces) into *out: 0, or ZS_EINVAL. */
static int parse_whole(const char *text, size_t digits, uint64_t max, uint64_t *out) {
  const char *t = text ? text : "";
  size_t n = strlen(t);
  uint64_t v = 0;
  int ok = n > 0 && n <= digits && strspn(t, "0123456789") == n;
  for (size_t i = 0; ok && i < n; i++)
    v = v * 10 + (unsigned)(t[i] - '0');
  if (!ok || v > max)
    return ZS_EINVAL;
  *out = v;
  return ZS_OK;
}

/* parse_whole into a uint32_t, or ZS_EINVAL with "<what> must be <range>
 * <max>, not '<text>'" at err. */
static int parse_setting(const char *text, size_t digits, uint32_t max, const char *what,
                         const char *range, uint32_t *out, char *err, size_t errlen) {
  uint64_t v;
  if (parse_whole(text, digits, max, &v) != ZS_OK) {
    if (err && errlen)
      snprintf(err, errlen, "%s must be %s %u, not '%.32s'", what, range, max, text ? text : "");
    return ZS_EINVAL;
  }
  *out = (uint32_t)v;
  return ZS_OK;
}

int stream_pacing_parse(const char *text, const char *what, uint32_t *mbit, char *err,
                        size_t errlen) {
  return parse_setting(text, 6, STREAM_PACING_MBIT_MAX, what,
                       "a whole number of Mbit/s from 0 (no pacing) to", mbit, err, errlen);
}

int stream_pacer_lowat_parse(const char *text, const char *what, uint32_t *bytes, char *err,
                             size_t errlen) {
  return parse_setting(text, 10, STREAM_PACER_LOWAT_MAX, what,
                       "a number of bytes from 0 (the kernel's default) to", bytes, err, errlen);
}

int stream_set_pacing(stream *s, uint32_t mbit) {
  if (s->closing)
    return ZS_ECLOSED;
  if (mbit > STREAM_PACING_MBIT_MAX)
    return ZS_EINVAL;
  if (mbit == 0)
    return ZS_OK;
#ifdef SO_MAX_PACING_RATE
  int fd = s->ops->fd(s);
  if (fd < 0)
    return fd;
  /* Bytes per second. Up to 34 Gbit/s it fits the 32-bit form every kernel
   * takes; above, the 64-bit form (Linux 5.0 on). */
  uint64_t rate = (uint64_t)mbit * 125000u;
  uint32_t rate32 = (uint32_t)rate;
  int rc = rate < UINT32_MAX
               ? setsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate32, sizeof rate32)
               : setsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof rate);
  if (rc != 0) {
    s->detail = strerror(errno);
    return errno == EINVAL || errno == ENOPROTOOPT ? ZS_EINVAL : ZS_EIO;
  }
  return ZS_OK;
#else
  return ZS_EUNIMPL;
#endif
}

int stream_pacing(const stream *s, uint64_t *bytes_per_s) {
  if (!bytes_per_s)
    return ZS_EINVAL;
  *bytes_per_s = UINT64_MAX;
  if (s->closing)
    return ZS_ECLOSED;
#ifdef SO_MAX_PACING_RATE
  int fd = s->ops->fd(s);
  if (fd < 0)
    return fd;
  /* A kernel that knows the 64-bit form fills 8 bytes, an older one 4. */
  union {
    uint64_t u64;
    uint32_t u32;
  } v = {0};
  socklen_t n = sizeof v;
  if (getsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &v, &n) != 0)
    return ZS_EIO;
  *bytes_per_s = n >= sizeof v.u64 ? v.u64 : v.u32;
  return ZS_OK;
#else
  return ZS_EUNIMPL;
#endif
}

/* ------------------------------------------------------------------------ */
/* Plain TCP                                                                */
/* ------------------------------------------------------------------------ */

/* Records a libuv failure's wording and returns its zs_status. */
static int tcp_fail(stream *s, int uverr) {
  if (uverr < 0)
    s->detail = uv_strerror(uverr);
  return stream_status_from_uv(uverr);
}

static void tcp_on_closed(uv_handle_t *h) {
  stream *s = h->data;
  if (s->close_cb)
    s->close_cb(s, s->data);
  free(s);
}

/* A stream with an initialised handle, or NULL (out of memory). */
static stream *tcp_new(const stream_ops *ops, uv_loop_t *loop, void *data) {
  stream *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->ops = ops;
  s->data = data;
  /* uv_tcp_init only fails for a bad flag, which we do not pass. */
  uv_tcp_init(loop, &s->u.tcp.handle);
  s->u.tcp.handle.data = s;
  return s;
}

/* Discards a stream the caller never saw: freed once libuv let go of it. */
static void tcp_discard(stream *s) {
  s->closing = 1;
  s->close_cb = NULL;
  uv_close((uv_handle_t *)&s->u.tcp.handle, tcp_on_closed);
}

static void tcp_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  stream *s = h->data;
  s->alloc_cb(s, s->data, suggested, buf);
}

static void tcp_on_read(uv_stream_t *h, ssize_t nread, const uv_buf_t *buf) {
  stream *s = h->data;
  if (nread < 0) {
    /* libuv keeps reading after an error other than the end; the contract
     * says the stream stopped, so that the owner sees one final status. */
    uv_read_stop(h);
    nread = tcp_fail(s, (int)nread);
  }
  s->read_cb(s, s->data, nread, buf);
}

static int tcp_read_start(stream *s, stream_alloc_cb alloc_cb, stream_read_cb read_cb) {
  s->alloc_cb = alloc_cb;
  s->read_cb = read_cb;
  int rc = uv_read_start((uv_stream_t *)&s->u.tcp.handle, tcp_on_alloc, tcp_on_read);
  /* Already reading: the new callbacks are in place, which is all a second
   * start asks for. */
  return rc == UV_EALREADY ? 0 : tcp_fail(s, rc);
}

static void tcp_read_stop(stream *s) {
  uv_read_stop((uv_stream_t *)&s->u.tcp.handle);
}

static void tcp_on_write(uv_write_t *w, int status) {
  stream_write_req *req = container_of(w, stream_write_req, u.uv);
  stream__pace_write_done(req);
  req->cb(req, tcp_fail(req->s, status));
}

static int tcp_write(stream *s, stream_write_req *req, const uv_buf_t *bufs, unsigned nbufs) {
  /* uv_write tries writev(2) at once and queues what the socket did not
   * take; the array is copied by libuv when it must wait, the bytes never. */
  return tcp_fail(s,
                  uv_write(&req->u.uv, (uv_stream_t *)&s->u.tcp.handle, bufs, nbufs, tcp_on_write));
}

static size_t tcp_write_queue_size(const stream *s) {
  return uv_stream_get_write_queue_size((const uv_stream_t *)&s->u.tcp.handle);
}

static void tcp_on_shutdown(uv_shutdown_t *r, int status) {
  stream *s = r->data;
  int rc = tcp_fail(s, status);
  if (s->shutdown_cb)
    s->shutdown_cb(s, s->data, rc);
}

static int tcp_shutdown(stream *s, stream_shutdown_cb cb) {
  s->shutdown_cb = cb;
  s->u.tcp.shutdown.data = s;
  return tcp_fail(
      s, uv_shutdown(&s->u.tcp.shutdown, (uv_stream_t *)&s->u.tcp.handle, tcp_on_shutdown));
}

static void tcp_close(stream *s) {
  /* s->close_cb, set by stream_close, runs in tcp_on_closed. */
  uv_close((uv_handle_t *)&s->u.tcp.handle, tcp_on_closed);
}

static int tcp_peer_addr(stream *s, struct sockaddr_storage *out) {
  int len = sizeof *out;
  return tcp_fail(s, uv_tcp_getpeername(&s->u.tcp.handle, (struct sockaddr *)out, &len));
}

static int tcp_local_addr(stream *s, struct sockaddr_storage *out) {
  int len = sizeof *out;
  return tcp_fail(s, uv_tcp_getsockname(&s->u.tcp.handle, (struct sockaddr *)out, &len));
}

static int tcp_set_option(stream *s, stream_option opt, int value) {
  uv_tcp_t *t = &s->u.tcp.handle;
  switch (opt) {
  case STREAM_OPT_NODELAY:
    return tcp_fail(s, uv_tcp_nodelay(t, value != 0));
  case STREAM_OPT_SNDBUF:
    if (value <= 0)
      return ZS_EINVAL; /* libuv reads 0 as "tell me the size" */
    return tcp_fail(s, uv_send_buffer_size((uv_handle_t *)t, &value));
  case STREAM_OPT_RCVBUF:
    if (value <= 0)
      return ZS_EINVAL;
    return tcp_fail(s, uv_recv_buffer_size((uv_handle_t *)t, &value));
  case STREAM_OPT_KEEPALIVE:
    if (value < 0)
      return ZS_EINVAL;
    return tcp_fail(s, uv_tcp_keepalive(t, value != 0, (unsigned)value));
  }
  return ZS_EUNIMPL;
}

static int tcp_fd(const stream *s) {
  uv_os_fd_t fd;
  int rc = uv_fileno((const uv_handle_t *)&s->u.tcp.handle, &fd);
  return rc < 0 ? stream_status_from_uv(rc) : (int)fd;
}

static void tcp_on_connect(uv_connect_t *r, int status) {
  stream *s = r->data;
  s->connect_cb(s, s->data, tcp_fail(s, status));
}

static int tcp_dial(stream_dialer *d, stream_connect_cb cb, void *data, stream **out) {
  stream *s = tcp_new(d->ops, d->loop, data);
  if (!s)
    return ZS_ENOMEM;
  s->connect_cb = cb;
  s->u.tcp.connect.data = s;
  int rc = uv_tcp_connect(&s->u.tcp.connect, &s->u.tcp.handle, (const struct sockaddr *)&d->addr,
                          tcp_on_connect);
  if (rc != 0) {
    /* A refused connect arrives through the callback; only a connect that
     * could not start (no socket, a bad address) fails here. */
    tcp_discard(s);
    return stream_status_from_uv(rc);
  }
  *out = s;
  return 0;
}

static void tcp_on_listener_closed(uv_handle_t *h) {
  free(h->data);
}

static void tcp_on_connection(uv_stream_t *h, int status) {
  stream_listener *l = h->data;
  if (status < 0) {
    l->detail = uv_strerror(status);
    l->cb(l, l->data, stream_status_from_uv(status), NULL);
    return;
  }
  stream *s = tcp_new(l->ops, h->loop, NULL);
  if (!s) {
    /* The connection stays unaccepted, and libuv stops watching the
     * listener until one is accepted: with the heap exhausted the loop has
     * worse problems, and the owner hears of it at once. */
    l->detail = "out of memory";
    l->cb(l, l->data, ZS_ENOMEM, NULL);
    return;
  }
  int rc = uv_accept(h, (uv_stream_t *)&s->u.tcp.handle);
  if (rc != 0) {
    l->detail = uv_strerror(rc);
    tcp_discard(s);
    l->cb(l, l->data, stream_status_from_uv(rc), NULL);
    return;
  }
  l->cb(l, l->data, 0, s);
}

static int tcp_listen(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr,
                      int backlog, stream_accept_cb cb, void *data, stream_listener **out,
                      char *err, size_t errlen) {
  stream_listener *l = calloc(1, sizeof *l);
  if (!l)
    return ZS_ENOMEM;
  l->ops = ops;
  l->cb = cb;
  l->data = data;
  uv_tcp_init(loop, &l->u.tcp);
  l->u.tcp.data = l;
  int rc = uv_tcp_bind(&l->u.tcp, addr, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&l->u.tcp, backlog, tcp_on_connection);
  if (rc != 0) {
    if (err && errlen) {
      strncpy(err, uv_strerror(rc), errlen - 1);
      err[errlen - 1] = '\0';
    }
    uv_close((uv_handle_t *)&l->u.tcp, tcp_on_listener_closed);
    return stream_status_from_uv(rc);
  }
  *out = l;
  return 0;
}

static int tcp_listener_addr(stream_listener *l, struct sockaddr_storage *out) {
  int len = sizeof *out;
  int rc = uv_tcp_getsockname(&l->u.tcp, (struct sockaddr *)out, &len);
  if (rc != 0)
    l->detail = uv_strerror(rc);
  return stream_status_from_uv(rc);
}

static void tcp_listener_close(stream_listener *l) {
  uv_close((uv_handle_t *)&l->u.tcp, tcp_on_listener_closed);
}

const stream_ops stream_tcp_ops = {
    .name = "tcp",
    .listen = tcp_listen,
    .listener_addr = tcp_listener_addr,
    .listener_close = tcp_listener_close,
    .dial = tcp_dial,
    .read_start = tcp_read_start,
    .read_stop = tcp_read_stop,
    .write = tcp_write,
    .shutdown = tcp_shutdown,
    .close = tcp_close,
    .peer_addr = tcp_peer_addr,
    .local_addr = tcp_local_addr,
    .set_option = tcp_set_option,
    .write_queue_size = tcp_write_queue_size,
    .fd = tcp_fd,
};
