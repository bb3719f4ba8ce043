/*
 * stream — a reliable, ordered byte stream between two peers, with the
 * listener that accepts them and the dialer that opens them. The data plane
 * (server/transport/dp/dp_server.c, common/net/dp_client.c) talks to its peers only through
 * this module, so that the transport under it can change without touching
 * the frame code.
 *
 * Every stream, listener and dialer belongs to one libuv loop and is used on
 * that loop's thread only. Each object carries its implementation's ops
 * table (stream_ops); the functions below are thin dispatchers. Plain TCP on
 * libuv is stream_tcp_ops, the default; TLS 1.3 over it is stream_tls_ops
 * (stream_tls.c, whose header comment says how it keeps this contract).
 *
 * Conventions (libuv's, which the TCP implementation inherits):
 *  - Functions return 0 or a negative zs_status. When a function that takes
 *    a callback returns an error, that callback is never called.
 *  - Errors reach callbacks as zs_status codes: ZS_ECLOSED for the end of
 *    the stream (the peer shut its sending side: STREAM_EOF), ZS_ECANCELED
 *    for an operation cut short by stream_close, ZS_ECONN for a connection
 *    refused, reset or broken, ZS_ETIMEDOUT, ZS_ENOMEM, ZS_EINVAL, and
 *    ZS_EIO for anything else. The system's own wording of the last failure
 *    is kept for log lines: stream_detail().
 *  - A stream's memory is released only after its close callback ran; write,
 *    shutdown and connect callbacks still pending at stream_close run first,
 *    with ZS_ECANCELED.
 *
 * Copies. The read path asks its owner for the buffer of every read
 * (stream_alloc_cb), so a caller that knows how many bytes are coming hands
 * out the final destination and the bytes land there straight from the
 * kernel; the write path takes a list of buffers and sends them with one
 * vectored write, borrowing them until the write callback. Over plain TCP
 * both directions make no copy of their own beyond the kernel's.
 *
 * How TLS slots in: stream_tls.c fills a second stream_ops. Its stream
 * wraps a TCP stream (kept in the implementation's part of the object) and
 * adds the TLS session: a handshake state entered by dial and accept, during
 * which writes are queued and the connect or accept callback is held back
 * until the handshake finished (or failed, reported as ZS_ECONN with the
 * library's reason in stream_detail). Reads keep their shape: ciphertext is
 * read into the implementation's own buffer and the plaintext lands in the
 * buffers the owner's alloc callback hands out, so the owner's zero-copy
 * logic (read into the final destination) is unchanged. Writes cannot be
 * zero-copy: each buffer is encrypted into the implementation's ciphertext
 * queue, the request completes when that ciphertext has gone to the socket,
 * and stream_write_queue_size counts the bytes not yet encrypted plus the
 * ciphertext not yet taken by the kernel. Options and addresses pass through
 * to the TCP stream; shutdown sends a close_notify, then shuts TCP. The
 * certificates and keys are given to the TLS listener and dialer
 * constructors (stream_tls_listen, stream_tls_dialer_new), not to these
 * calls.
 */
#ifndef ZSHARD_COMMON_STREAM_H
#define ZSHARD_COMMON_STREAM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <uv.h>

#include "zshard/types.h"

/* The status of a read that found the end of the stream. */
#define STREAM_EOF ZS_ECLOSED

typedef struct stream stream;
typedef struct stream_listener stream_listener;
typedef struct stream_dialer stream_dialer;
typedef struct stream_ops stream_ops;
typedef struct stream_write_req stream_write_req;

/* Called before each read for the buffer to read into. Set buf->len to 0
 * (or buf->base to NULL) to have the read reported as ZS_ENOMEM. `data` is
 * the stream's (stream_set_data). */
typedef void (*stream_alloc_cb)(stream *s, void *data, size_t suggested, uv_buf_t *buf);

/* nread > 0: that many bytes arrived in buf (the alloc callback's buffer);
 * 0: nothing this time (buf is handed back unused); < 0: a zs_status, and
 * the stream stopped reading (STREAM_EOF: the peer will send nothing more). */
typedef void (*stream_read_cb)(stream *s, void *data, ssize_t nread, const uv_buf_t *buf);

/* The write finished (status 0: every byte went to the kernel) or failed;
 * the buffers are the caller's again. */
typedef void (*stream_write_cb)(stream_write_req *req, int status);

typedef void (*stream_shutdown_cb)(stream *s, void *data, int status);

/* The stream is about to be freed: s may only be compared, not used. */
typedef void (*stream_close_cb)(stream *s, void *data);

/* The connect of a dialled stream finished: status 0 and the stream can be
 * read and written, or an error (ZS_ECANCELED when it was closed first); the
 * stream must be closed either way. */
typedef void (*stream_connect_cb)(stream *s, void *data, int status);

/* A peer connected: status 0 and `s`, a new stream owned by the callee (it
 * must be closed with stream_close; its data is NULL until stream_set_data),
 * or an error and s NULL (the listener keeps listening). `data` is the
 * listener's. */
typedef void (*stream_accept_cb)(stream_listener *l, void *data, int status, stream *s);

/* One write in flight; the caller's memory (usually embedded in its own
 * record, found again with container_of in the callback), which must stay
 * valid until the callback ran. Its fields are the layer's. */
struct stream_write_req {
  stream *s;
  stream_write_cb cb;
  int paced; /* counted as a bulk write of s's pacer (stream_pace.c) */
  union {
    uv_write_t uv; /* TCP: the libuv request itself */
    void *impl[4]; /* other implementations: their bookkeeping */
  } u;
};

typedef enum stream_option {
  STREAM_OPT_NODELAY = 1, /* value 0/1: send small writes at once (no Nagle) */
  STREAM_OPT_SNDBUF,      /* value: the kernel's send buffer in bytes */
  STREAM_OPT_RCVBUF,      /* value: the kernel's receive buffer in bytes */
  STREAM_OPT_KEEPALIVE    /* value: 0 off, else the idle seconds before probes */
} stream_option;

/* An implementation. Each entry has the contract of the function below that
 * calls it; the dispatchers check the arguments and the closing state first.
 * The objects' definitions are shared by the implementations only, through
 * the private stream_impl.h (a common head, then a union member of each
 * implementation's own). */
struct stream_ops {
  const char *name;
  int (*listen)(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr, int backlog,
                stream_accept_cb cb, void *data, stream_listener **out, char *err, size_t errlen);
  int (*listener_addr)(stream_listener *l, struct sockaddr_storage *out);
  void (*listener_close)(stream_listener *l);
  int (*dial)(stream_dialer *d, stream_connect_cb cb, void *data, stream **out);
  int (*read_start)(stream *s, stream_alloc_cb alloc_cb, stream_read_cb read_cb);
  void (*read_stop)(stream *s);
  int (*write)(stream *s, stream_write_req *req, const uv_buf_t *bufs, unsigned nbufs);
  int (*shutdown)(stream *s, stream_shutdown_cb cb);
  void (*close)(stream *s); /* then calls the close callback stream_close kept */
  int (*peer_addr)(stream *s, struct sockaddr_storage *out);
  int (*local_addr)(stream *s, struct sockaddr_storage *out);
  int (*set_option)(stream *s, stream_option opt, int value);
  size_t (*write_queue_size)(const stream *s);
  int (*fd)(const stream *s); /* the TCP socket's descriptor, or a zs_status */
};

/* Plain TCP over libuv. */
extern const stream_ops stream_tcp_ops;

/* TLS 1.3 over a TCP stream (common/net/stream_tls.c, OpenSSL). Its listeners and
 * dialers carry a TLS context (common/net/tls.h), so they are made by
 * stream_tls_listen and stream_tls_dialer_new; stream_listen and
 * stream_dialer_new with this table refuse (ZS_EINVAL). Everything else goes
 * through the functions below, as for TCP. */
extern const stream_ops stream_tls_ops;
typedef struct tls_ctx tls_ctx;

/* ---- Listener ----------------------------------------------------------- */

/* Binds `addr` (port 0: any free port, read back with stream_listener_addr)
 * and listens with `ops`. Every connection is accepted and handed to `cb`
 * with `data`. Returns 0 and the listener in *out (the caller's, released
 * with stream_listener_close), or ZS_EINVAL (the address cannot be bound:
 * in use, not local, no permission) / ZS_ENOMEM / ZS_EIO with the system's
 * wording in err (may be NULL). `addr` is only read during the call. */
int stream_listen(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr, int backlog,
                  stream_accept_cb cb, void *data, stream_listener **out, char *err, size_t errlen);

/* stream_listen for TLS: every accepted connection first completes a TLS
 * handshake as the server of `ctx` (a tls_server_new context: its
 * certificate, and with a client CA, client certificates required), and only
 * then reaches `cb`; a failed handshake reaches it as ZS_ECONN (or
 * ZS_ETIMEDOUT when it took too long, ZS_ELIMIT when too many run at once)
 * with no stream and the reason in stream_listener_detail. `ctx` is borrowed:
 * it must outlive the listener and the streams it accepts. */
int stream_tls_listen(tls_ctx *ctx, uv_loop_t *loop, const struct sockaddr *addr, int backlog,
                      stream_accept_cb cb, void *data, stream_listener **out, char *err,
                      size_t errlen);

/* The bound address into *out. Returns 0 or a zs_status. */
int stream_listener_addr(stream_listener *l, struct sockaddr_storage *out);

/* Stops accepting; the listener's memory goes once the loop has run the
 * close (the loop must run on, as for uv_close). Streams already accepted are
 * not affected. NULL is accepted. */
void stream_listener_close(stream_listener *l);

/* The system's wording of the listener's last accept failure, or "". */
const char *stream_listener_detail(const stream_listener *l);

/* ---- Dialer ------------------------------------------------------------- */

/* A dialer opens streams to one address with `ops`. Returns 0 and the dialer
 * in *out (the caller's, freed with stream_dialer_free), or ZS_EINVAL /
 * ZS_ENOMEM. `addr` is copied. */
int stream_dialer_new(const stream_ops *ops, uv_loop_t *loop, const struct sockaddr *addr,
                      stream_dialer **out);

/* stream_dialer_new for TLS: each stream dialled completes a TLS handshake
 * as a client of `ctx` (a tls_client_new context) before its connect
 * callback runs with 0; a server whose certificate does not verify against
 * the context's CAs, or does not carry the expected name, fails the connect
 * with ZS_ECONN and OpenSSL's reason in stream_detail. The name is the
 * context's server_name, or else `host` (the host dialled, a DNS name or an
 * IP address; copied; may be NULL when the context has a name). `ctx` is
 * borrowed: it must outlive the dialer and its streams. Returns as
 * stream_dialer_new; ZS_EINVAL also when there is no name to check. */
int stream_tls_dialer_new(tls_ctx *ctx, uv_loop_t *loop, const struct sockaddr *addr,
                          const char *host, stream_dialer **out);

/* Starts a connect. Returns 0 and the new stream in *out (the caller's: it
 * must be closed with stream_close, whatever the connect's outcome), `cb`
 * running once with `data` when the connect finished; or an error (*out
 * NULL, cb never called). The stream's data is `data`. */
int stream_dial(stream_dialer *d, stream_connect_cb cb, void *data, stream **out);

/* Frees the dialer; streams it opened live on. NULL is accepted. */
void stream_dialer_free(stream_dialer *d);

/* ---- Streams ------------------------------------------------------------ */

/* The pointer handed to the stream's callbacks; the caller's, never
 * dereferenced by the layer. */
void stream_set_data(stream *s, void *data);
void *stream_get_data(const stream *s);

/* Starts reading: alloc_cb, then read_cb, for each read, until stream_read_stop,
 * an error or the end of the stream. Starting twice replaces the callbacks.
 * Returns 0 or ZS_ECLOSED (closing) / another zs_status. */
int stream_read_start(stream *s, stream_alloc_cb alloc_cb, stream_read_cb read_cb);

/* Stops reading; no callback runs for bytes that arrive meanwhile (the kernel
 * keeps them, and its window pushes back on the peer). */
void stream_read_stop(stream *s);

/* Queues the bytes of bufs[0..nbufs) to be written in order, after every
 * write queued before. The bytes are borrowed until cb runs (the bufs array
 * itself only during the call); req is the caller's memory, as above.
 * Returns 0 (cb will run once), or ZS_ECLOSED / ZS_ECONN / ZS_EINVAL / ZS_ENOMEM
 * (cb will not run). */
int stream_write(stream *s, stream_write_req *req, const uv_buf_t *bufs, unsigned nbufs,
                 stream_write_cb cb);

/* Bytes queued and not yet taken by the kernel. */
size_t stream_write_queue_size(const stream *s);

/* Shuts the sending side once the queued writes are out: the peer reads
 * STREAM_EOF; reading goes on. Returns 0 (cb, if not NULL, runs once) or a
 * zs_status. */
int stream_shutdown(stream *s, stream_shutdown_cb cb);

/* Closes the stream: reading stops, pending writes, shutdown and connect
 * complete with ZS_ECANCELED, then cb (may be NULL) runs and the stream is
 * freed. A second call, or a NULL stream, does nothing. */
void stream_close(stream *s, stream_close_cb cb);

/* 1 once stream_close was called. */
int stream_is_closing(const stream *s);

/* The peer's or our own address into *out. Returns 0 or a zs_status. */
int stream_peer_addr(stream *s, struct sockaddr_storage *out);
int stream_local_addr(stream *s, struct sockaddr_storage *out);

/* Sets a socket option (see stream_option). Returns 0, ZS_EUNIMPL if the
 * implementation has no such option, or another zs_status. */
int stream_set_option(stream *s, stream_option opt, int value);

/* The system's wording of the stream's last failure (for log lines), or "". */
const char *stream_detail(const stream *s);

/* ---- TCP congestion control --------------------------------------------- */

/* The longest congestion control name Linux takes (TCP_CA_NAME_MAX), with
 * its terminating NUL. */
#define STREAM_CC_NAME_MAX 16

/* Checks that this process can set `name` as a socket's TCP congestion
 * control (TCP_CONGESTION): a short name of letters, digits and '_' that the
 * kernel offers (/proc/sys/net/ipv4/tcp_available_congestion_control) and
 * lets this process use (net.ipv4.tcp_allowed_congestion_control, or
 * CAP_NET_ADMIN for the others). It tries the name on a scratch socket, so
 * the answer is the kernel's. Returns 0, or ZS_EINVAL with a sentence that
 * names the lists in err (may be NULL), or ZS_EUNIMPL on a system without
 * TCP_CONGESTION. Changes nothing on the host: the host's default
 * (net.ipv4.tcp_congestion_control) stays what it is. `name` is only read. */
int stream_cc_check(const char *name, char *err, size_t errlen);

/* Sets the stream's own TCP congestion control (setsockopt TCP_CONGESTION
 * on its socket; for TLS, the TCP stream's). Returns 0, ZS_EINVAL when the
 * kernel refuses the name (stream_detail says why), ZS_ECLOSED, or
 * ZS_EUNIMPL. `name` is only read. */
int stream_set_congestion(stream *s, const char *name);

/* The stream's TCP congestion control into buf (getsockopt TCP_CONGESTION;
 * at most len - 1 characters and a NUL). Returns 0 or a zs_status. */
int stream_congestion(const stream *s, char *buf, size_t len);

/* ---- TCP pacing ----------------------------------------------------------- */

/* The highest per-socket pacing rate zshard takes, Mbit/s (100 Gbit/s). */
#define STREAM_PACING_MBIT_MAX 100000u

/* Parses a pacing rate in Mbit/s: a whole number from 0 (off) to
 * STREAM_PACING_MBIT_MAX, no sign, no spaces. Returns 0 with the rate in
 * *mbit, or ZS_EINVAL with a sentence in err (may be NULL) that names
 * `what` (the flag or variable the text came from). Only reads its
 * strings. */
int stream_pacing_parse(const char *text, const char *what, uint32_t *mbit, char *err,
                        size_t errlen);

/* Caps the rate at which the kernel sends on the stream's socket (for TLS,
 * the TCP stream's) at `mbit` Mbit/s (setsockopt SO_MAX_PACING_RATE, in
 * bytes per second; Linux's TCP paces by itself once it is set, no fq qdisc
 * needed since 4.20). 0 leaves the socket unpaced. Returns 0, ZS_EINVAL
 * above STREAM_PACING_MBIT_MAX or when the kernel refuses it (stream_detail
 * says why), ZS_ECLOSED, or ZS_EUNIMPL without SO_MAX_PACING_RATE. */
int stream_set_pacing(stream *s, uint32_t mbit);

/* The socket's pacing cap in bytes per second (getsockopt
 * SO_MAX_PACING_RATE) into *bytes_per_s; UINT64_MAX or UINT32_MAX mean
 * none. Returns 0 or a zs_status. */
int stream_pacing(const stream *s, uint64_t *bytes_per_s);

/* ---- Link pacing --------------------------------------------------------- */

/* A pacer shares one host link of `link_mbit` Mbit/s between the streams
 * that joined it and are sending: each such stream's socket is paced at
 * link / n (SO_MAX_PACING_RATE), n the number of them sending now, and the
 * rates are set again whenever n changes, and only on the sockets whose
 * rate changes. A stream is sending while it holds at least one write of
 * `min_write` bytes or more that is not done; smaller writes (requests,
 * acknowledgements) neither count nor wait. A write is done once the
 * kernel took its bytes; so that this is close to their leaving the host,
 * joining sets TCP_NOTSENT_LOWAT to `notsent_lowat` bytes on the socket
 * (0 leaves the kernel's default, which lets it hold megabytes unsent).
 *
 * Threads: the streams may live on different loops (a client's shards);
 * the pacer's mutex guards its list and the members' rates, and a thread
 * that starts or stops a stream's sending sets the other members' rates
 * under it. A stream leaves its pacer in stream_close, before its socket
 * is closed, so no thread touches a closed descriptor. */
typedef struct stream_pacer stream_pacer;

/* The data plane's min_write: its pushes and pull answers of tensor pieces
 * count, its requests and acknowledgements do not. */
#define STREAM_PACER_MIN_WRITE (16u << 10)

/* The notsent_lowat zshard's data plane uses unless told otherwise
 * (ZSHARD_TCP_LINK_NOTSENT_LOWAT): 128 KiB, 4 ms at 250 Mbit/s. */
#define STREAM_PACER_NOTSENT_LOWAT (128u << 10)

/* The highest notsent_lowat zshard takes: 1 GiB. */
#define STREAM_PACER_LOWAT_MAX (1u << 30)

/* Parses a notsent_lowat in bytes: a whole number from 0 (the kernel's
 * default) to STREAM_PACER_LOWAT_MAX, no sign, no spaces; as
 * stream_pacing_parse (0, or ZS_EINVAL with a sentence naming `what`). */
int stream_pacer_lowat_parse(const char *text, const char *what, uint32_t *bytes, char *err,
                             size_t errlen);

/* What a pacer did, for tests and logs. */
typedef struct stream_pacer_stats {
  uint32_t members;     /* streams joined now */
  uint32_t sending;     /* streams sending now */
  uint64_t rate_sets;   /* setsockopt calls made */
  uint64_t rate_fails;  /* of which the kernel refused */
  uint64_t starts;      /* a stream began sending */
  uint64_t stops;       /* a stream stopped sending */
  uint64_t stop_unsent; /* bytes still unsent in the kernel at those stops (SIOCOUTQNSD) */
  uint64_t stop_unsent_max;
} stream_pacer_stats;

/* A pacer for a link of link_mbit (1 to STREAM_PACING_MBIT_MAX) into *out,
 * the caller's, freed with stream_pacer_free once every member is closed.
 * Returns 0, ZS_EINVAL or ZS_ENOMEM. */
int stream_pacer_new(uint32_t link_mbit, size_t min_write, uint32_t notsent_lowat,
                     stream_pacer **out);

/* Frees p (NULL: nothing); no stream may still be a member. */
void stream_pacer_free(stream_pacer *p);

/* The stream's loop thread: s joins p (once; p must outlive s's close).
 * Its socket stays unpaced until it sends. Returns 0, ZS_EINVAL (already a
 * member of a pacer), ZS_ECLOSED, or the failure to set TCP_NOTSENT_LOWAT. */
int stream_pacer_join(stream *s, stream_pacer *p);

/* p's counters into *out (any thread). */
void stream_pacer_get_stats(stream_pacer *p, stream_pacer_stats *out);

/* The zs_status for a libuv error code (UV_EOF is STREAM_EOF); implementations
 * report through it. */
int stream_status_from_uv(int uverr);

#endif
