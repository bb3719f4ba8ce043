/*
 * dp_client — a client of one shard's data plane (server/transport/dp/dp_server.h,
 * docs/PROTOCOL.md): pipelined Push and Pull over one or more TCP
 * connections, driven by a libuv loop on the client's own thread.
 *
 * Any thread may submit requests at any time; they are queued under a lock
 * and handed to the loop with uv_async_send. Every request completes exactly
 * once through its callback, which runs on the loop thread: with the
 * server's answer, ZS_ETIMEDOUT when its timeout passed, ZS_ECONN when its
 * connection failed, or ZS_ECANCELED when the client was closed first. When a
 * submitting function returns an error, the callback is never called.
 *
 * Tensor bytes are never copied by the client: a Push is written to the
 * socket straight from the caller's buffer (scatter/gather with the frame
 * header), and a Pull's payload is read from the socket straight into the
 * caller's destination (a pull batch's pieces each into its own), its CRC32C
 * computed as it arrives. Only the bytes that come in a read with others
 * (a header, small pieces) are copied once, out of the client's staging
 * buffer.
 *
 * Every connection authenticates first (a HELLO with the configured token,
 * docs/PROTOCOL.md). A token the server refuses fails dp_client_open, or
 * later every request, with ZS_EUNAUTHENTICATED (or ZS_EPERM) and the
 * server's sentence, and no connection is tried again: retrying cannot fix a
 * wrong secret.
 *
 * A connection that fails otherwise is reopened for the next request that
 * needs it; requests are never resent by the client (the caller decides, and
 * Push is idempotent on the server).
 */
#ifndef ZSHARD_COMMON_DP_CLIENT_H
#define ZSHARD_COMMON_DP_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "zshard/types.h"

/* Timeout of a request whose timeout_ms is 0. */
#define DP_DEFAULT_TIMEOUT_MS 60000u
#define DP_MAX_CONNECTIONS 64u
#define DP_ERRLEN 256u

typedef struct dp_client dp_client;

typedef struct dp_client_config {
  /* "host:port" or "[v6-address]:port" of the shard's data port. Only read
   * during dp_client_open. */
  const char *addr;
  /* Connections to open; requests go to the one with the fewest bytes in
   * flight. 0 means 1, at most DP_MAX_CONNECTIONS. */
  uint32_t connections;
  /* Longest wait for a connection to be established; 0 means 10 s. */
  uint32_t connect_timeout_ms;
  /* Largest payload accepted in an answer; 0 means WIRE_DEFAULT_MAX_PAYLOAD. */
  uint64_t max_payload;
  /* Requests written to one connection and not yet answered, beyond which
   * new requests wait in the client's queue; 0 means 1024. */
  uint32_t max_inflight;
  /* The secret every connection presents in its HELLO (NUL-terminated, at
   * most WIRE_MAX_TOKEN bytes); NULL or "" for a server without tokens.
   * Copied during dp_client_open. */
  const char *token;
  /* TLS 1.3 on every connection as a client of this context (common/net/tls.h:
   * tls_client_new), the server's certificate checked for the context's
   * server name, else for the host of `addr`; NULL: plain TCP. Borrowed: it
   * must outlive the client. */
  struct tls_ctx *tls;
  /* Sent in every HELLO: nonzero only on a replica set primary's connections
   * to a backup (its term; docs/PROTOCOL.md, "Authentication"). */
  uint64_t replica_term;
  /* TCP congestion control of every connection (TCP_CONGESTION, e.g.
   * "cubic"), set on its socket once connected; NULL or "": the host's
   * default. Checked (stream_cc_check) and copied during dp_client_open,
   * which fails with ZS_EINVAL for a name this process cannot use. */
  const char *congestion;
  /* Per-socket pacing of every connection, Mbit/s (SO_MAX_PACING_RATE,
   * stream_set_pacing), set once connected; 0: none. dp_client_open fails
   * with ZS_EINVAL above STREAM_PACING_MBIT_MAX. */
  uint32_t pacing_mbit;
  /* Link pacing (stream.h, "Link pacing"): every connection joins this
   * pacer once connected; NULL: none. Borrowed: it must outlive the client,
   * and may be shared with other clients (other loops). */
  struct stream_pacer *pacer;
} dp_client_config;

/* Resolves "host:port" or "[v6]:port" (a numeric address or a name; with
 * `passive`, an empty host means every local address) into *out. Returns 0 or
 * ZS_EINVAL with a sentence in err (may be NULL). Blocks on name resolution. */
int dp_resolve(const char *hostport, int passive, struct sockaddr_storage *out, char *err,
               size_t errlen);

/* Starts the loop thread and connects (and authenticates) every connection,
 * waiting up to the connect timeout. Returns 0 and the client in *out (the
 * caller's, released with dp_client_close), or ZS_EINVAL (bad address, token
 * too long) / ZS_ECONN (no connection could be made) / ZS_EUNAUTHENTICATED
 * or ZS_EPERM (the token was refused) / ZS_ELIMIT (a connection cap of the
 * server) / ZS_EPROTO (a server without HELLO) / ZS_ENOMEM with a sentence in
 * err (may be NULL). */
int dp_client_open(const dp_client_config *cfg, dp_client **out, char *err, size_t errlen);

/* Fails every request not yet completed with ZS_ECANCELED (their callbacks
 * run before this returns), closes the connections and joins the loop
 * thread. Afterwards no buffer given to the client is touched any more. Must
 * not be called from a completion callback. NULL is accepted. */
void dp_client_close(dp_client *c);

/* The outcome of a request, valid only during the callback. */
typedef struct dp_result {
  int status;          /* 0 or a negative zs_status */
  int duplicate;       /* Push: already received by the shard, not added again */
  uint64_t version;    /* Pull, pull batch: the version the piece(s) belong to */
  const char *message; /* a sentence when status != 0 ("" otherwise), never NULL;
                        * a push batch: the first refused piece's, or "" */
  /* A push batch answered by the shard (status 0): each piece's own status
   * (0 or a negative zs_status) and duplicate flag, npieces entries in the
   * order submitted; NULL and 0 otherwise. */
  uint32_t npieces;
  const int32_t *piece_status;
  const uint8_t *piece_duplicate;
} dp_result;

/* Runs on the client's loop thread; must not block and must not call
 * dp_client_close, may submit new requests. */
typedef void (*dp_done_cb)(void *arg, const dp_result *r);

typedef struct dp_push_args {
  uint64_t spec_hash, step;
  uint32_t rank, micro, tensor, slice;
  zs_dtype dtype;
  /* The gradient: nbytes little-endian elements of dtype. Borrowed: it must
   * stay valid and unchanged until the callback ran. */
  const void *data;
  size_t nbytes;
  uint32_t timeout_ms; /* 0: DP_DEFAULT_TIMEOUT_MS */
} dp_push_args;

/* Submits a Push. The CRC of the payload is computed on the calling thread.
 * Returns 0 (the callback will run), or ZS_EINVAL (bad arguments, payload
 * over the limit) / ZS_ECLOSED (the client is closing) / ZS_ENOMEM. `a` is
 * only read during the call (a->data: see above); `arg` is passed to cb. */
int dp_client_push(dp_client *c, const dp_push_args *a, dp_done_cb cb, void *arg);

typedef struct dp_pull_args {
  uint64_t spec_hash, min_version;
  uint32_t tensor, slice;
  zs_dtype dtype;
  /* Receives the piece: exactly nbytes bytes, the piece's size in dtype.
   * Borrowed: it must stay valid until the callback ran, and its contents
   * are unspecified if the status is not 0. */
  void *dst;
  size_t nbytes;
  /* The server waits up to this long for min_version, and the client as long
   * plus the time the answer takes; 0: DP_DEFAULT_TIMEOUT_MS. */
  uint32_t timeout_ms;
} dp_pull_args;

/* Submits a Pull; returns as dp_client_push does. */
int dp_client_pull(dp_client *c, const dp_pull_args *a, dp_done_cb cb, void *arg);

/* One piece of a batch. Push: `data` holds its nbytes little-endian elements
 * of dtype, borrowed as dp_push_args.data is; nbytes 0 (data may be NULL) is
 * a contribution without a gradient, as an empty PUSH. Pull: nbytes is the piece's
 * size in dtype (the shard checks it) and data is not used. */
typedef struct dp_batch_piece {
  uint32_t tensor, slice;
  zs_dtype dtype;
  const void *data;
  size_t nbytes;
} dp_batch_piece;

/* Several contributions of one (step, rank, micro) to this shard in one
 * PUSH_BATCH frame (docs/PROTOCOL.md). The shard applies or refuses each
 * piece on its own, as separate pushes would be. */
typedef struct dp_push_batch_args {
  uint64_t spec_hash, step;
  uint32_t rank, micro;
  /* 1 .. WIRE_MAX_BATCH pieces; the array is only read during the call, each
   * piece's data is borrowed until the callback ran. */
  const dp_batch_piece *pieces;
  uint32_t npieces;
  uint32_t timeout_ms; /* 0: DP_DEFAULT_TIMEOUT_MS */
} dp_push_batch_args;

/* Submits a push batch; its payload CRC is computed on the calling thread.
 * The callback's status is the batch's (0 when the shard answered; then
 * piece_status says what became of each piece), otherwise as
 * dp_client_push. Returns 0, or ZS_EINVAL (no pieces or more than
 * WIRE_MAX_BATCH, a bad dtype, a total over the payload limit) /
 * ZS_ECLOSED / ZS_ENOMEM. */
int dp_client_push_batch(dp_client *c, const dp_push_batch_args *a, dp_done_cb cb, void *arg);

/* Several pieces of this shard in one PULL_BATCH frame: one wait for
 * min_version, one answer with every piece of one version, or an error for
 * the whole batch. */
typedef struct dp_pull_batch_args {
  uint64_t spec_hash, min_version;
  /* 1 .. WIRE_MAX_BATCH pieces, only read during the call. */
  const dp_batch_piece *pieces;
  uint32_t npieces;
  /* Where the pieces go; exactly one of the two is given. dst receives them
   * concatenated in order (the sum of their nbytes); dsts[i] (npieces
   * entries, none NULL) receives piece i, its nbytes bytes, so that each
   * piece lands where the caller wants it without a copy. The dsts array is
   * only read during the call; the buffers are borrowed as dp_pull_args.dst
   * is: valid until the callback ran, their contents unspecified if the
   * status is not 0 (a failed batch may have written any of them). */
  void *dst;
  void *const *dsts;
  uint32_t timeout_ms; /* as dp_pull_args.timeout_ms */
} dp_pull_batch_args;

/* Submits a pull batch; returns as dp_client_push_batch does (ZS_EINVAL
 * also for both or neither of dst and dsts, or a NULL entry in dsts). */
int dp_client_pull_batch(dp_client *c, const dp_pull_batch_args *a, dp_done_cb cb, void *arg);

/* Submits a PING (a round trip through the server's loop, nothing else). */
int dp_client_ping(dp_client *c, uint32_t timeout_ms, dp_done_cb cb, void *arg);

/* Blocking conveniences: submit and wait for the callback. They return the
 * request's status; err (may be NULL) gets its message. Must not be called
 * from a completion callback. */
int dp_client_push_sync(dp_client *c, const dp_push_args *a, int *duplicate, char *err,
                        size_t errlen);
int dp_client_pull_sync(dp_client *c, const dp_pull_args *a, uint64_t *version, char *err,
                        size_t errlen);
int dp_client_ping_sync(dp_client *c, uint32_t timeout_ms, char *err, size_t errlen);

#endif
