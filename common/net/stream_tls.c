/*
 * stream_tls — TLS 1.3 streams (stream_tls_ops): a TCP stream of the plain
 * implementation underneath, OpenSSL's session on top, joined by a memory
 * BIO of our own over the stream's buffers, so that OpenSSL never touches
 * the socket and libuv stays the only one doing I/O.
 *
 *   reads:  TCP -> rx (our buffer) -> SSL_read -> the owner's buffer
 *   writes: the owner's buffers -> SSL_write -> a chunk -> TCP
 *
 * Copies. Reading, the kernel copies ciphertext into rx, OpenSSL takes each
 * record from rx into its record buffer, decrypts it in place and copies the
 * plaintext into the buffer the owner's alloc callback handed out: so the
 * owner's zero-copy logic (read into the final destination) is unchanged, at
 * the price of two passes of memcpy speed besides the decryption. Writing,
 * OpenSSL encrypts from the owner's buffer into its record buffer and writes
 * the record into the chunk that goes to TCP (one copy besides the
 * encryption). OpenSSL's own BIO_s_mem would add one copy each way (and zero
 * its buffer as it grows): the first version had it, and bench_tls measured
 * the difference (docs/PERFORMANCE.md, "TLS on the data plane"). The cipher
 * (AES-GCM on AES-NI) dominates what is left.
 *
 * Handshake. dial and accept start it; the owner hears of the stream (the
 * connect callback, the accept callback) only once it finished, or of its
 * failure as ZS_ECONN with OpenSSL's reason in stream_detail (client) or
 * stream_listener_detail (server, whose accept callback then gets an error
 * and no stream). A handshake must finish within TLS_HANDSHAKE_MS, and a
 * listener runs at most TLS_MAX_HANDSHAKES at once, so that peers that
 * connect and say nothing cannot pile up. In TLS 1.3 the client finishes
 * first: a server that refuses the client's certificate does so after the
 * client's connect callback ran, and the client's next read fails with
 * ZS_ECONN and the server's alert as the reason.
 *
 * Writes are encrypted lazily: at most TLS_AHEAD bytes of ciphertext wait in
 * TCP's queue, and encryption resumes as chunks complete, so a 1 GiB write
 * does not double into 1 GiB of ciphertext nor hold the loop for the whole
 * encryption. Chunks complete in order (TCP's queue is ordered); each owner
 * write remembers the sequence number of the chunk that carries its last
 * bytes and completes once that chunk did. An empty write still sends a
 * chunk (an empty one), which keeps it in order with the others.
 *
 * Ends. stream_shutdown sends close_notify after the queued writes, then
 * shuts TCP's sending side; the peer reads STREAM_EOF. stream_close is
 * abortive, as TCP's is: no close_notify, and a peer that sees the
 * connection end without one reads ZS_ECONN ("closed without close_notify"),
 * because a TLS stream that ends unannounced may have been cut.
 *
 * Memory: a stream is freed once both its libuv handles (the TCP stream's and
 * the timer's) were closed; the owner's close callback runs just before. A
 * stream holds TLS_RX of ciphertext buffer, OpenSSL's record buffers (about
 * 50 KiB) and at most TLS_AHEAD of ciphertext queued: some 120 KiB when idle,
 * against a few hundred bytes for a plain TCP stream.
 */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/stream_impl.h"
#include "common/net/tls.h"

#define TLS_RX (64u << 10)      /* ciphertext read from TCP at a time */
#define TLS_CHUNK (256u << 10)  /* ciphertext gathered before it goes to TCP */
#define TLS_AHEAD (1u << 20)    /* TCP's queue beyond which encryption waits */
#define TLS_HANDSHAKE_MS 10000u /* longest handshake */
#define TLS_MAX_HANDSHAKES 256u /* handshakes a listener runs at once */
#define TLS_DETAIL 256u

enum { TLS_HANDSHAKE, TLS_OPEN, TLS_FAILED };

typedef struct tls_listener tls_listener;

/* One owner's write: its buffers (the array copied, the bytes borrowed), how
 * far encryption got, and the chunk that carries its last bytes. */
typedef struct tls_wreq {
  list_node node;
  stream_write_req *req;
  uint64_t last_seq;
  unsigned nbufs, i;
  size_t off;
  int encrypted;
  uv_buf_t bufs[];
} tls_wreq;

/* Ciphertext on its way to TCP. */
typedef struct tls_chunk {
  stream_write_req req;
  struct tls_stream *t;
  size_t len;
  char data[];
} tls_chunk;

typedef struct tls_stream {
  stream *s; /* the owner's stream */
  stream *tcp;
  SSL *ssl;
  int state;
  int server;
  int handles; /* libuv handles not yet closed: TCP's, the timer's */
  int reading; /* the owner reads */
  int read_ended;
  int tcp_reading;
  int tcp_end;         /* TCP's final read status (STREAM_EOF or an error), 0 before */
  int connect_pending; /* dialled: the connect callback has not run */
  int shutdown_wanted, shutdown_started;
  int werr;         /* the first failed chunk's status: every write fails with it */
  int need_chunk;   /* an owner write waits for a chunk not yet made (an empty one) */
  list_node writes; /* tls_wreq, oldest first */
  uint64_t seq_sent, seq_done;
  size_t plain_queued;    /* owner bytes not yet encrypted */
  uv_timer_t timer;       /* the handshake's deadline, then deferred reads */
  tls_listener *listener; /* accepted, while its handshake runs */
  list_node pending;      /* in the listener's list meanwhile */
  tls_chunk *out;         /* ciphertext gathered for TCP, NULL when none */
  size_t out_cap;
  size_t rx_off, rx_len; /* rx[rx_off, rx_len): ciphertext not yet taken */
  char detail[TLS_DETAIL];
  char rx[TLS_RX];
} tls_stream;

struct tls_listener {
  stream_listener *outer;
  stream_listener *tcp;
  tls_ctx *ctx;
  uv_loop_t *loop;
  list_node pending; /* tls_stream.pending: handshakes running */
  unsigned npending;
  char detail[TLS_DETAIL];
};

static void pump_writes(tls_stream *t);
static void advance(tls_stream *t);

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */

/* Records the reason of the stream's failure and returns `status`. */
static int say(tls_stream *t, int status, const char *fmt, const char *arg) {
  status_say(t->detail, sizeof t->detail, fmt, arg);
  t->s->detail = t->detail;
  return status;
}

/* Records OpenSSL's reason (what = what failed) and returns `status`. */
static int say_ssl(tls_stream *t, int status, const char *what) {
  char why[TLS_DETAIL - 32];
  tls_error_text(t->ssl, "protocol error", why, sizeof why);
  status_say(t->detail, sizeof t->detail, "%s: %s", what, why);
  t->s->detail = t->detail;
  return status;
}

static void tcp_read_stop_if(tls_stream *t) {
  if (t->tcp_reading) {
    stream_read_stop(t->tcp);
    t->tcp_reading = 0;
  }
}

static void on_rx_alloc(stream *tcp, void *data, size_t suggested, uv_buf_t *buf);
static void on_rx(stream *tcp, void *data, ssize_t nread, const uv_buf_t *buf);

static void tcp_read_start_if(tls_stream *t) {
  if (t->tcp_reading || t->tcp_end || !t->tcp || t->s->closing)
    return;
  int rc = stream_read_start(t->tcp, on_rx_alloc, on_rx);
  if (rc != 0) {
    t->tcp_end = rc;
    say(t, rc, "%s", stream_detail(t->tcp));
    return;
  }
  t->tcp_reading = 1;
}

/* 1 if rx holds at least one whole TLS record (5-byte header: type,
 * version, length), so that SSL_read will not come back empty-handed. */
static int record_ready(tls_stream *t) {
  size_t n = t->rx_len - t->rx_off;
  const unsigned char *p = (const unsigned char *)t->rx + t->rx_off;
  return n >= 5 && n >= 5 + (((size_t)p[3] << 8) | p[4]);
}

/* ------------------------------------------------------------------------ */
/* The BIO between OpenSSL and the stream                                   */
/* ------------------------------------------------------------------------ */

/* A memory BIO of our own over the stream's buffers: OpenSSL reads
 * ciphertext straight out of rx (where TCP put it) and writes records
 * straight into the chunk that goes to TCP, one copy less each way than
 * OpenSSL's BIO_s_mem (whose buffer would sit between) and no zeroing of
 * its growing buffer. Never "would block" on writes; an empty rx asks to
 * retry the read. */
static BIO_METHOD *bio_method;
static pthread_once_t bio_once = PTHREAD_ONCE_INIT;

static int bio_read(BIO *b, char *out, int len) {
  tls_stream *t = BIO_get_data(b);
  size_t avail = t->rx_len - t->rx_off;
  BIO_clear_retry_flags(b);
  if (avail == 0) {
    BIO_set_retry_read(b);
    return -1;
  }
  size_t n = avail < (size_t)len ? avail : (size_t)len;
  memcpy(out, t->rx + t->rx_off, n);
  t->rx_off += n;
  return (int)n;
}

static int bio_write(BIO *b, const char *in, int len) {
  tls_stream *t = BIO_get_data(b);
  BIO_clear_retry_flags(b);
  size_t have = t->out ? t->out->len : 0, need = have + (size_t)len;
  if (need > t->out_cap) {
    size_t cap = t->out_cap ? t->out_cap : TLS_CHUNK + (32u << 10);
    while (cap < need)
      cap *= 2;
    tls_chunk *c = realloc(t->out, sizeof *c + cap);
    if (!c)
      return -1;
    if (!t->out)
      c->len = 0;
    t->out = c;
    t->out_cap = cap;
  }
  memcpy(t->out->data + t->out->len, in, (size_t)len);
  t->out->len += (size_t)len;
  return len;
}

static long bio_ctrl(BIO *b, int cmd, long num, void *ptr) {
  (void)num;
  (void)ptr;
  tls_stream *t = BIO_get_data(b);
  switch (cmd) {
  case BIO_CTRL_FLUSH:
    return 1; /* flush() sends the chunk when the stream decides */
  case BIO_CTRL_PENDING:
    return t ? (long)(t->rx_len - t->rx_off) : 0;
  default:
    return 0;
  }
}

static int bio_create(BIO *b) {
  BIO_set_init(b, 1);
  return 1;
}

static void bio_method_make(void) {
  BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "zshard stream");
  if (m && BIO_meth_set_read(m, bio_read) && BIO_meth_set_write(m, bio_write) &&
      BIO_meth_set_ctrl(m, bio_ctrl) && BIO_meth_set_create(m, bio_create))
    bio_method = m; /* kept for the process's life */
  else
    BIO_meth_free(m);
}

/* ------------------------------------------------------------------------ */
/* Ciphertext to TCP                                                        */
/* ------------------------------------------------------------------------ */

static void complete_writes(tls_stream *t) {
  while (!list_empty(&t->writes)) {
    tls_wreq *w = container_of(t->writes.next, tls_wreq, node);
    int status = t->werr;
    if (!status && !(w->encrypted && w->last_seq <= t->seq_done))
      return;
    list_remove(&w->node);
    if (!w->encrypted) {
      for (unsigned i = w->i; i < w->nbufs; i++)
        t->plain_queued -= w->bufs[i].len - (i == w->i ? w->off : 0);
    }
    stream_write_req *req = w->req;
    free(w);
    stream__pace_write_done(req);
    req->cb(req, status);
  }
}

static void on_chunk_written(stream_write_req *req, int status) {
  tls_chunk *c = container_of(req, tls_chunk, req);
  tls_stream *t = c->t;
  free(c);
  t->seq_done++;
  if (status < 0 && !t->werr) {
    t->werr = status;
    if (status != ZS_ECANCELED)
      say(t, status, "%s", t->tcp ? stream_detail(t->tcp) : "");
  }
  complete_writes(t);
  if (!t->s->closing)
    pump_writes(t);
}

/* Hands the ciphertext gathered in `out` (and, with need_chunk, an empty
 * chunk if there is none) to TCP. Returns 0 or the failure, recorded in
 * werr. */
static int flush(tls_stream *t) {
  if (!t->out && !t->need_chunk)
    return 0;
  tls_chunk *c = t->out;
  t->out = NULL;
  t->out_cap = 0;
  if (t->werr || !t->tcp || t->s->closing) {
    free(c);
    return t->werr ? t->werr : ZS_ECLOSED;
  }
  if (!c) {
    /* The empty chunk an empty write waits for. */
    c = malloc(sizeof *c);
    if (!c) {
      t->werr = say(t, ZS_ENOMEM, "%s", "out of memory for TLS ciphertext");
      return t->werr;
    }
    c->len = 0;
  }
  c->t = t;
  uv_buf_t b = {.base = c->data, .len = c->len};
  int rc = stream_write(t->tcp, &c->req, &b, 1, on_chunk_written);
  if (rc != 0) {
    free(c);
    t->werr = say(t, rc, "%s", stream_detail(t->tcp));
    return rc;
  }
  t->seq_sent++;
  t->need_chunk = 0;
  return 0;
}

static void on_tcp_shutdown(stream *tcp, void *data, int status) {
  (void)tcp;
  tls_stream *t = data;
  if (t->s->shutdown_cb)
    t->s->shutdown_cb(t->s, t->s->data, status);
}

/* close_notify, then TCP's shutdown. Returns 0 (the owner's callback will
 * run) or an error (it will not). */
static int start_shutdown(tls_stream *t) {
  t->shutdown_started = 1;
  ERR_clear_error();
  /* 0: close_notify sent, the peer's not yet seen; never "would block" with
   * a memory BIO. */
  if (SSL_shutdown(t->ssl) < 0)
    return say_ssl(t, ZS_EIO, "cannot send the TLS close_notify");
  int rc = flush(t);
  if (rc == 0)
    rc = stream_shutdown(t->tcp, on_tcp_shutdown);
  return rc;
}

/* Encrypts queued owner bytes while TCP's queue is short, TLS_AHEAD at most
 * per call, then starts a wanted shutdown once nothing is left. Called
 * whenever there is something new: a write, a chunk done, the handshake
 * done. */
static void pump_writes(tls_stream *t) {
  if (t->state != TLS_OPEN || t->werr || t->s->closing)
    return;
  size_t budget = TLS_AHEAD;
  list_node *n = t->writes.next;
  for (; n != &t->writes; n = n->next) {
    tls_wreq *w = container_of(n, tls_wreq, node);
    while (!w->encrypted) {
      if (budget == 0 || stream_write_queue_size(t->tcp) >= TLS_AHEAD)
        goto out; /* a chunk is in flight: its completion calls us again */
      while (w->i < w->nbufs && w->off == w->bufs[w->i].len) {
        w->i++;
        w->off = 0;
      }
      if (w->i == w->nbufs) {
        w->encrypted = 1;
        w->last_seq = t->seq_sent + 1; /* the next chunk, possibly empty */
        t->need_chunk = 1;
        break;
      }
      size_t len = w->bufs[w->i].len - w->off;
      if (len > TLS_CHUNK)
        len = TLS_CHUNK;
      ERR_clear_error();
      int r = SSL_write(t->ssl, w->bufs[w->i].base + w->off, (int)len);
      if (r <= 0) {
        t->werr = say_ssl(t, ZS_EIO, "cannot encrypt");
        complete_writes(t);
        return;
      }
      w->off += (size_t)r;
      t->plain_queued -= (size_t)r;
      budget -= (size_t)r < budget ? (size_t)r : budget;
      if (t->out && t->out->len >= TLS_CHUNK && flush(t) != 0) {
        complete_writes(t);
        return;
      }
    }
  }
out:
  if (flush(t) != 0) {
    complete_writes(t);
    return;
  }
  if (n == &t->writes && t->shutdown_wanted && !t->shutdown_started) {
    int rc = start_shutdown(t);
    if (rc != 0 && t->s->shutdown_cb)
      t->s->shutdown_cb(t->s, t->s->data, rc);
  }
}

/* ------------------------------------------------------------------------ */
/* Handshake                                                                */
/* ------------------------------------------------------------------------ */

static void discard(tls_stream *t);

static void listener_unlink(tls_stream *t) {
  if (t->listener) {
    list_remove(&t->pending);
    t->listener->npending--;
    t->listener = NULL;
  }
}

static void handshake_failed(tls_stream *t, int status) {
  t->state = TLS_FAILED;
  uv_timer_stop(&t->timer);
  tcp_read_stop_if(t);
  /* The alert OpenSSL wrote (if any) goes out before anything else. */
  flush(t);
  if (t->server) {
    tls_listener *l = t->listener;
    listener_unlink(t);
    discard(t);
    if (l) {
      status_say(l->detail, sizeof l->detail, "%s", t->detail);
      l->outer->detail = l->detail;
      l->outer->cb(l->outer, l->outer->data, status, NULL);
    }
    return;
  }
  t->connect_pending = 0;
  t->s->connect_cb(t->s, t->s->data, status);
}

static void handshake_done(tls_stream *t) {
  t->state = TLS_OPEN;
  uv_timer_stop(&t->timer);
  if (t->server) {
    tls_listener *l = t->listener;
    listener_unlink(t);
    l->outer->cb(l->outer, l->outer->data, 0, t->s);
  } else {
    t->connect_pending = 0;
    t->s->connect_cb(t->s, t->s->data, 0);
  }
  if (t->s->closing)
    return;
  pump_writes(t);
  if (t->reading)
    advance(t);
  else
    tcp_read_stop_if(t);
}

static void handshake_step(tls_stream *t) {
  ERR_clear_error();
  int r = SSL_do_handshake(t->ssl);
  int e = r == 1 ? SSL_ERROR_NONE : SSL_get_error(t->ssl, r);
  if (e == SSL_ERROR_NONE || e == SSL_ERROR_WANT_READ) {
    if (flush(t) != 0) {
      handshake_failed(t, ZS_ECONN);
      return;
    }
  }
  if (e == SSL_ERROR_NONE) {
    handshake_done(t);
  } else if (e == SSL_ERROR_WANT_READ) {
    if (t->tcp_end) {
      /* TCP's own failure is in the detail already. */
      if (t->tcp_end == STREAM_EOF)
        say(t, ZS_ECONN, "%s", "the peer closed the connection during the TLS handshake");
      handshake_failed(t, ZS_ECONN);
    } else {
      tcp_read_start_if(t);
    }
  } else {
    say_ssl(t, ZS_ECONN, "TLS handshake failed");
    handshake_failed(t, ZS_ECONN);
  }
}

/* ------------------------------------------------------------------------ */
/* Plaintext to the owner                                                   */
/* ------------------------------------------------------------------------ */

/* The owner's final read status; `buf` (may be NULL) is a buffer its alloc
 * callback handed out, given back. */
static void read_end(tls_stream *t, int status, const uv_buf_t *buf) {
  t->read_ended = 1;
  t->reading = 0;
  tcp_read_stop_if(t);
  uv_buf_t none = {.base = NULL, .len = 0};
  t->s->read_cb(t->s, t->s->data, status, buf ? buf : &none);
}

/* Decrypts what rx holds into buffers from the owner's alloc callback,
 * each filled as far as whole records allow before the read callback, until
 * the owner stops reading or nothing whole is left. Bounded by one TCP
 * read's worth of ciphertext (plus a partial record), like TCP's reads. */
static void deliver(tls_stream *t) {
  stream *s = t->s;
  while (t->reading && !s->closing && !t->read_ended &&
         (SSL_pending(t->ssl) > 0 || record_ready(t))) {
    uv_buf_t buf = {.base = NULL, .len = 0};
    s->alloc_cb(s, s->data, TLS_RX, &buf);
    if (!buf.base || buf.len == 0) {
      read_end(t, say(t, ZS_ENOMEM, "%s", "no buffer to read into"), &buf);
      return;
    }
    size_t got = 0, rx_before = t->rx_off;
    int e = SSL_ERROR_NONE;
    while (got < buf.len && (SSL_pending(t->ssl) > 0 || record_ready(t))) {
      size_t want = buf.len - got > INT32_MAX ? INT32_MAX : buf.len - got;
      ERR_clear_error();
      int r = SSL_read(t->ssl, buf.base + got, (int)want);
      if (r > 0) {
        got += (size_t)r;
        continue;
      }
      e = SSL_get_error(t->ssl, r);
      break;
    }
    /* A key update asks for an answer. */
    flush(t);
    int ok = e == SSL_ERROR_NONE || e == SSL_ERROR_WANT_READ;
    if (got > 0 || ok)
      s->read_cb(s, s->data, (ssize_t)got, &buf);
    /* OpenSSL took nothing although a whole record seemed to be there: rx
     * is not where a record starts (which AUTO_RETRY, off in tls.c, could
     * cause). Wait for more bytes rather than spin. */
    if (e == SSL_ERROR_WANT_READ && got == 0 && t->rx_off == rx_before)
      break;
    if (ok)
      continue;
    /* The buffer goes back with the final status if no bytes took it. */
    const uv_buf_t *back = got > 0 ? NULL : &buf;
    if (s->closing || t->read_ended || !t->reading)
      return;
    if (e == SSL_ERROR_ZERO_RETURN)
      read_end(t, STREAM_EOF, back);
    else
      read_end(t, say_ssl(t, ZS_ECONN, "TLS read failed"), back);
    return;
  }
  if (!t->reading || s->closing || t->read_ended)
    return;
  if (t->tcp_end) {
    if (t->tcp_end == STREAM_EOF)
      say(t, ZS_ECONN, "%s", "the peer closed the connection without a TLS close_notify");
    read_end(t, t->tcp_end == STREAM_EOF ? ZS_ECONN : t->tcp_end, NULL);
    return;
  }
  tcp_read_start_if(t);
}

static void advance(tls_stream *t) {
  if (t->state == TLS_HANDSHAKE)
    handshake_step(t);
  else if (t->state == TLS_OPEN)
    deliver(t);
}

/* TCP reads into rx after what OpenSSL has not taken yet (a partial record
 * at most, while the owner reads), which moves to the front only when the
 * room behind it gets short. */
static void on_rx_alloc(stream *tcp, void *data, size_t suggested, uv_buf_t *buf) {
  (void)tcp;
  (void)suggested;
  tls_stream *t = data;
  if (t->rx_off == t->rx_len) {
    t->rx_off = t->rx_len = 0;
  } else if (sizeof t->rx - t->rx_len < TLS_RX / 2) {
    memmove(t->rx, t->rx + t->rx_off, t->rx_len - t->rx_off);
    t->rx_len -= t->rx_off;
    t->rx_off = 0;
  }
  buf->base = t->rx + t->rx_len;
  buf->len = sizeof t->rx - t->rx_len;
}

static void on_rx(stream *tcp, void *data, ssize_t nread, const uv_buf_t *buf) {
  tls_stream *t = data;
  if (nread == 0)
    return;
  if (nread < 0) {
    t->tcp_reading = 0;
    t->tcp_end = (int)nread;
    if (nread != STREAM_EOF)
      say(t, (int)nread, "%s", stream_detail(tcp));
  } else {
    (void)buf; /* rx + rx_len, from on_rx_alloc */
    t->rx_len += (size_t)nread;
  }
  advance(t);
}

static void on_timer(uv_timer_t *h) {
  tls_stream *t = h->data;
  if (t->state == TLS_HANDSHAKE) {
    say(t, ZS_ETIMEDOUT, "%s", "the TLS handshake did not finish in time");
    handshake_failed(t, ZS_ETIMEDOUT);
  } else {
    advance(t);
  }
}

/* ------------------------------------------------------------------------ */
/* Streams: birth and death                                                 */
/* ------------------------------------------------------------------------ */

static void on_handle_closed(tls_stream *t) {
  if (--t->handles > 0)
    return;
  stream *s = t->s;
  if (s->close_cb)
    s->close_cb(s, s->data);
  SSL_free(t->ssl);
  free(t->out);
  free(t);
  free(s);
}

static void on_timer_closed(uv_handle_t *h) {
  on_handle_closed(h->data);
}

/* TCP is gone, and with it every chunk (their callbacks ran, cancelled):
 * what the owner still waits for is cancelled, in the order the contract
 * gives, before the close callback. */
static void on_tcp_closed(stream *tcp, void *data) {
  (void)tcp;
  tls_stream *t = data;
  stream *s = t->s;
  t->tcp = NULL;
  if (!t->werr)
    t->werr = ZS_ECANCELED;
  complete_writes(t);
  if (t->connect_pending) {
    t->connect_pending = 0;
    s->connect_cb(s, s->data, ZS_ECANCELED);
  }
  if (t->shutdown_wanted && !t->shutdown_started && s->shutdown_cb)
    s->shutdown_cb(s, s->data, ZS_ECANCELED);
  on_handle_closed(t);
}

static void tls_close(stream *s) {
  tls_stream *t = s->u.tls;
  t->reading = 0;
  t->tcp_reading = 0;
  uv_timer_stop(&t->timer);
  uv_close((uv_handle_t *)&t->timer, on_timer_closed);
  /* A stream never dialled (its TCP dial failed) has no TCP stream. */
  if (t->tcp)
    stream_close(t->tcp, on_tcp_closed);
  else
    on_tcp_closed(NULL, t);
}

/* Closes a stream its owner never saw (a failed or abandoned handshake on
 * the server): no callback runs. */
static void discard(tls_stream *t) {
  listener_unlink(t);
  t->s->closing = 1;
  t->s->close_cb = NULL;
  tls_close(t->s);
}

/* A stream and its session, not yet tied to TCP, or NULL (out of memory).
 * For a client, `name` is what the server's certificate must carry. */
static tls_stream *tls_new(uv_loop_t *loop, tls_ctx *ctx, int server, const char *name,
                           void *data) {
  stream *s = calloc(1, sizeof *s);
  tls_stream *t = calloc(1, sizeof *t);
  SSL *ssl = tls_ctx_session(ctx);
  pthread_once(&bio_once, bio_method_make);
  BIO *bio = bio_method ? BIO_new(bio_method) : NULL;
  if (!s || !t || !ssl || !bio)
    goto fail;
  BIO_set_data(bio, t);
  SSL_set_bio(ssl, bio, bio); /* one reference, which ssl now owns */
  bio = NULL;
  if (server) {
    SSL_set_accept_state(ssl);
  } else {
    unsigned char ip[16];
    int literal = inet_pton(AF_INET, name, ip) == 1 || inet_pton(AF_INET6, name, ip) == 1;
    /* SSL_set1_host checks an IP address literal as one; SNI carries only
     * DNS names (RFC 6066). */
    if (SSL_set1_host(ssl, name) != 1 || (!literal && SSL_set_tlsext_host_name(ssl, name) != 1))
      goto fail;
    SSL_set_connect_state(ssl);
  }
  s->ops = &stream_tls_ops;
  s->data = data;
  s->u.tls = t;
  t->s = s;
  t->ssl = ssl;
  t->server = server;
  t->state = TLS_HANDSHAKE;
  list_init(&t->writes);
  list_init(&t->pending);
  uv_timer_init(loop, &t->timer);
  t->timer.data = t;
  t->handles = 2;
  return t;
fail:
  BIO_free(bio);
  SSL_free(ssl);
  free(t);
  free(s);
  ERR_clear_error();
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Operations                                                               */
/* ------------------------------------------------------------------------ */

static int tls_read_start(stream *s, stream_alloc_cb alloc_cb, stream_read_cb read_cb) {
  tls_stream *t = s->u.tls;
  s->alloc_cb = alloc_cb;
  s->read_cb = read_cb;
  if (t->read_ended)
    return ZS_ECLOSED;
  t->reading = 1;
  if (t->state != TLS_OPEN)
    return 0; /* the handshake's end starts the reading */
  /* Plaintext or ciphertext already here, or TCP's end, is delivered from
   * the loop, never from inside this call. */
  if (SSL_pending(t->ssl) > 0 || t->rx_len > t->rx_off || t->tcp_end)
    uv_timer_start(&t->timer, on_timer, 0, 0);
  else
    tcp_read_start_if(t);
  return 0;
}

static void tls_read_stop(stream *s) {
  tls_stream *t = s->u.tls;
  t->reading = 0;
  if (t->state == TLS_OPEN) {
    uv_timer_stop(&t->timer);
    tcp_read_stop_if(t);
  }
}

static int tls_write(stream *s, stream_write_req *req, const uv_buf_t *bufs, unsigned nbufs) {
  tls_stream *t = s->u.tls;
  if (t->werr)
    return t->werr;
  if (t->state == TLS_FAILED || t->shutdown_wanted)
    return ZS_ECONN;
  tls_wreq *w = malloc(sizeof *w + (size_t)nbufs * sizeof *bufs);
  if (!w)
    return ZS_ENOMEM;
  w->req = req;
  w->nbufs = nbufs;
  w->i = 0;
  w->off = 0;
  w->encrypted = 0;
  w->last_seq = 0;
  for (unsigned i = 0; i < nbufs; i++) {
    w->bufs[i] = bufs[i];
    t->plain_queued += bufs[i].len;
  }
  list_push(&t->writes, &w->node);
  pump_writes(t);
  return 0;
}

static size_t tls_write_queue_size(const stream *s) {
  const tls_stream *t = s->u.tls;
  return t->plain_queued + (t->tcp ? stream_write_queue_size(t->tcp) : 0);
}

static int tls_shutdown(stream *s, stream_shutdown_cb cb) {
  tls_stream *t = s->u.tls;
  if (t->shutdown_wanted)
    return ZS_EINVAL;
  if (t->werr)
    return t->werr;
  if (t->state == TLS_FAILED)
    return ZS_ECONN;
  s->shutdown_cb = cb;
  t->shutdown_wanted = 1;
  /* close_notify follows the last queued byte: with writes still to
   * encrypt (or the handshake still running), pump_writes sends it later. */
  int all_encrypted = t->state == TLS_OPEN;
  for (list_node *n = t->writes.next; n != &t->writes; n = n->next)
    all_encrypted &= container_of(n, tls_wreq, node)->encrypted;
  if (!all_encrypted)
    return 0;
  int rc = start_shutdown(t);
  if (rc != 0) {
    t->shutdown_wanted = 0;
    s->shutdown_cb = NULL;
  }
  return rc;
}

static int tls_peer_addr(stream *s, struct sockaddr_storage *out) {
  tls_stream *t = s->u.tls;
  return t->tcp ? stream_peer_addr(t->tcp, out) : ZS_ECLOSED;
}

static int tls_local_addr(stream *s, struct sockaddr_storage *out) {
  tls_stream *t = s->u.tls;
  return t->tcp ? stream_local_addr(t->tcp, out) : ZS_ECLOSED;
}

static int tls_set_option(stream *s, stream_option opt, int value) {
  tls_stream *t = s->u.tls;
  return t->tcp ? stream_set_option(t->tcp, opt, value) : ZS_ECLOSED;
}

/* The TCP stream's socket: a congestion control set on it applies to the
 * TLS stream's bytes. */
static int tls_fd(const stream *s) {
  const tls_stream *t = s->u.tls;
  return t->tcp ? t->tcp->ops->fd(t->tcp) : ZS_ECLOSED;
}

/* ------------------------------------------------------------------------ */
/* Dialer                                                                   */
/* ------------------------------------------------------------------------ */

static void on_tcp_connect(stream *tcp, void *data, int status) {
  tls_stream *t = data;
  if (t->s->closing)
    return; /* on_tcp_closed reports the cancel */
  if (status != 0) {
    say(t, status, "%s", stream_detail(tcp));
    t->state = TLS_FAILED;
    uv_timer_stop(&t->timer);
    t->connect_pending = 0;
    t->s->connect_cb(t->s, t->s->data, status);
    return;
  }
  handshake_step(t); /* the ClientHello */
}

static int tls_dial(stream_dialer *d, stream_connect_cb cb, void *data, stream **out) {
  if (!d->tls || !d->tcp || !d->server_name)
    return ZS_EINVAL; /* made by stream_dialer_new, not stream_tls_dialer_new */
  tls_stream *t = tls_new(d->loop, d->tls, 0, d->server_name, data);
  if (!t)
    return ZS_ENOMEM;
  stream *s = t->s;
  s->connect_cb = cb;
  int rc = stream_dial(d->tcp, on_tcp_connect, t, &t->tcp);
  if (rc != 0) {
    s->closing = 1;
    tls_close(s); /* nothing to call back: s->close_cb is NULL */
    return rc;
  }
  t->connect_pending = 1;
  uv_timer_start(&t->timer, on_timer, TLS_HANDSHAKE_MS, 0);
  *out = s;
  return 0;
}

int stream_tls_dialer_new(tls_ctx *ctx, uv_loop_t *loop, const struct sockaddr *addr,
                          const char *host, stream_dialer **out) {
  if (!out)
    return ZS_EINVAL;
  *out = NULL;
  const char *name = ctx ? tls_ctx_server_name(ctx) : NULL;
  if (!name)
    name = host;
  if (!ctx || tls_ctx_is_server(ctx) || !name || !name[0])
    return ZS_EINVAL;
  stream_dialer *d = NULL;
  int rc = stream_dialer_new(&stream_tls_ops, loop, addr, &d);
  if (rc != 0)
    return rc;
  d->tls = ctx;
  d->server_name = strdup(name);
  rc = d->server_name ? stream_dialer_new(&stream_tcp_ops, loop, addr, &d->tcp) : ZS_ENOMEM;
  if (rc != 0) {
    stream_dialer_free(d);
    return rc;
  }
  *out = d;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Listener                                                                 */
/* ------------------------------------------------------------------------ */

static void on_tcp_accept(stream_listener *tcp_l, void *data, int status, stream *tcp) {
  tls_listener *l = data;
  stream_listener *outer = l->outer;
  if (status != 0) {
    outer->detail = stream_listener_detail(tcp_l);
    outer->cb(outer, outer->data, status, NULL);
    return;
  }
  if (l->npending >= TLS_MAX_HANDSHAKES) {
    stream_close(tcp, NULL);
    outer->detail = "too many TLS handshakes in progress";
    outer->cb(outer, outer->data, ZS_ELIMIT, NULL);
    return;
  }
  tls_stream *t = tls_new(l->loop, l->ctx, 1, NULL, NULL);
  if (!t) {
    stream_close(tcp, NULL);
    outer->detail = "out of memory";
    outer->cb(outer, outer->data, ZS_ENOMEM, NULL);
    return;
  }
  t->tcp = tcp;
  stream_set_data(tcp, t);
  t->listener = l;
  list_push(&l->pending, &t->pending);
  l->npending++;
  uv_timer_start(&t->timer, on_timer, TLS_HANDSHAKE_MS, 0);
  tcp_read_start_if(t);
  if (t->tcp_end) /* reading could not start */
    handshake_failed(t, ZS_ECONN);
}

static int tls_listen(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr,
                      int backlog, stream_accept_cb cb, void *data, stream_listener **out,
                      char *err, size_t errlen) {
  (void)ops;
  (void)loop;
  (void)addr;
  (void)backlog;
  (void)cb;
  (void)data;
  (void)out;
  status_say(err, errlen, "a TLS listener needs its certificate: stream_tls_listen makes one");
  return ZS_EINVAL;
}

int stream_tls_listen(tls_ctx *ctx, uv_loop_t *loop, const struct sockaddr *addr, int backlog,
                      stream_accept_cb cb, void *data, stream_listener **out, char *err,
                      size_t errlen) {
  if (err && errlen)
    err[0] = '\0';
  if (!ctx || !tls_ctx_is_server(ctx) || !loop || !addr || !cb || !out) {
    status_say(err, errlen, "a TLS listener needs a server's TLS context");
    return ZS_EINVAL;
  }
  *out = NULL;
  stream_listener *outer = calloc(1, sizeof *outer);
  tls_listener *l = calloc(1, sizeof *l);
  if (!outer || !l) {
    free(outer);
    free(l);
    status_say(err, errlen, "out of memory");
    return ZS_ENOMEM;
  }
  outer->ops = &stream_tls_ops;
  outer->cb = cb;
  outer->data = data;
  outer->u.tls = l;
  l->outer = outer;
  l->ctx = ctx;
  l->loop = loop;
  list_init(&l->pending);
  int rc =
      stream_listen(&stream_tcp_ops, loop, addr, backlog, on_tcp_accept, l, &l->tcp, err, errlen);
  if (rc != 0) {
    free(l);
    free(outer);
    return rc;
  }
  *out = outer;
  return 0;
}

static int tls_listener_addr(stream_listener *outer, struct sockaddr_storage *out) {
  return stream_listener_addr(outer->u.tls->tcp, out);
}

/* TCP's listener calls nothing back once closed, and the handshakes still
 * running are abandoned, so both objects can go now. */
static void tls_listener_close(stream_listener *outer) {
  tls_listener *l = outer->u.tls;
  stream_listener_close(l->tcp);
  while (!list_empty(&l->pending))
    discard(container_of(l->pending.next, tls_stream, pending));
  free(l);
  free(outer);
}

const stream_ops stream_tls_ops = {
    .name = "tls",
    .listen = tls_listen,
    .listener_addr = tls_listener_addr,
    .listener_close = tls_listener_close,
    .dial = tls_dial,
    .read_start = tls_read_start,
    .read_stop = tls_read_stop,
    .write = tls_write,
    .shutdown = tls_shutdown,
    .close = tls_close,
    .peer_addr = tls_peer_addr,
    .local_addr = tls_local_addr,
    .set_option = tls_set_option,
    .write_queue_size = tls_write_queue_size,
    .fd = tls_fd,
};
