/*
 * stream_impl — the definitions of the stream layer's objects, shared by its
 * implementations (stream.c: the dispatchers and plain TCP; stream_tls.c:
 * TLS over a TCP stream) and by nobody else: owners see only the opaque
 * types of stream.h.
 *
 * Each object starts with the common head the dispatchers use, then a union
 * with one member per implementation. TCP embeds its libuv handles there;
 * TLS keeps a pointer to its own state, which holds the TCP stream it wraps.
 */
#ifndef ZSHARD_COMMON_STREAM_IMPL_H
#define ZSHARD_COMMON_STREAM_IMPL_H

#include "common/net/stream.h"

struct stream {
  const stream_ops *ops;
  void *data;
  int closing;
  /* The wording of the last failure: a static string, or for TLS a buffer in
   * the implementation's state, which lives as long as the stream. */
  const char *detail;
  stream_alloc_cb alloc_cb;
  stream_read_cb read_cb;
  stream_connect_cb connect_cb;
  stream_shutdown_cb shutdown_cb;
  stream_close_cb close_cb;
  union {
    struct {
      uv_tcp_t handle;
      uv_connect_t connect;
      uv_shutdown_t shutdown;
    } tcp;
    struct tls_stream *tls;
  } u;
};

struct stream_listener {
  const stream_ops *ops;
  stream_accept_cb cb;
  void *data;
  const char *detail;
  union {
    uv_tcp_t tcp;
    struct tls_listener *tls;
  } u;
};

struct stream_dialer {
  const stream_ops *ops;
  uv_loop_t *loop;
  struct sockaddr_storage addr;
  /* TLS: the context and the name the server must prove (owned copy), and the
   * TCP dialer the TLS streams are dialled with. */
  struct tls_ctx *tls;
  char *server_name;
  stream_dialer *tcp;
};

#endif
