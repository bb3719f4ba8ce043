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

#include "common/base/list.h"
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
  /* Link pacing (stream_pace.c). `pacer` and `pace_bulk` are the loop
   * thread's: the pacer this stream joined (NULL: none) and its bulk writes
   * not yet done. `pace_node` (on the pacer's list of sending streams while
   * pace_bulk > 0), `pace_fd` and `pace_rate` (the cap last set, bytes per
   * second; 0: none yet) are guarded by the pacer's mutex, since any thread
   * that joins the pacer sets the other members' rates. */
  struct stream_pacer *pacer;
  uint32_t pace_bulk;
  list_node pace_node;
  int pace_fd;
  uint64_t pace_rate;
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

/* stream_pace.c, called by the dispatchers and the implementations: a write
 * of `nbytes` is being handed to the stream (it counts as bulk when the
 * stream joined a pacer and it is large enough); the write `req` is done,
 * just before its callback; the stream is closing (it leaves its pacer). */
void stream__pace_write_start(stream *s, stream_write_req *req, size_t nbytes);
void stream__pace_write_undo(stream_write_req *req);
void stream__pace_write_done(stream_write_req *req);
void stream__pace_leave(stream *s);

#endif
