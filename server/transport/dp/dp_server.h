/*
 * dp_server — the data plane of zshard-server: Push and Pull over the framed
 * binary protocol of common/net/wire.h (docs/PROTOCOL.md) on TCP, served by a
 * libuv loop on its own thread and handed to the same shard core (core.h) as
 * the gRPC transport, with the same statuses and messages from the core.
 *
 * Requests on a connection are pipelined: a client may send any number of
 * frames without waiting, and answers come back tagged with the request id,
 * in the order they complete (a Pull waiting for its version does not hold
 * back the Push answers behind it). A PING is answered with a PONG.
 *
 * Errors: a request the core refuses, a payload CRC mismatch or a meta that
 * does not parse is answered with an ERROR frame carrying the request id, and
 * the connection lives on. A stream that can no longer be framed (bad magic,
 * version or type, a length over its bound, a header CRC mismatch) is answered
 * with one ERROR frame with request id 0 and closed.
 *
 * Authentication: the first frame of every connection must be a HELLO whose
 * token auth_keys_check accepts for the trainer role (any token, even an
 * empty one, when the server has no keys). Until then nothing else is
 * processed, a frame's meta may not exceed WIRE_MAX_HELLO_META, and the
 * connection counts against the unauthenticated cap; a connection that has
 * not authenticated within hello_timeout_ms is closed.
 *
 * Caps and budgets (each refusal is ZS_ELIMIT with a sentence): connections
 * per peer address and in all; unauthenticated connections; Pulls waiting
 * for their version per connection, per peer address and in all; the bytes
 * of copied Pull answers per connection, per peer address and in all
 * (answers wait for room rather than being refused, unless one alone is over
 * a budget; an address waits only for its own share, a quarter of the
 * server's budget by default, so a host that does not read cannot keep the
 * others' answers waiting). An answer
 * sent straight from the shard's low-precision copy keeps that copy pinned
 * only while the peer takes its bytes: a connection that holds a pin and
 * takes no byte for pin_hold_ms is closed, so that an apply never waits for
 * a stalled reader.
 *
 * Fairness and backpressure: reads are bounded per loop iteration and per
 * connection, so that one fast peer cannot starve the others; a connection
 * whose answers are not being taken (pending requests or unsent bytes over
 * their bounds) is no longer read until they drain; a peer that stops in the
 * middle of a frame, or stops taking its answers, for longer than the stall
 * timeout is disconnected. None of this affects other connections.
 */
#ifndef ZSHARD_SERVER_DP_SERVER_H
#define ZSHARD_SERVER_DP_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "common/net/auth.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"

/* Longest a Pull waits for its version, whatever its timeout says (the same
 * bound as the gRPC transport's). */
#define DP_MAX_WAIT_MS (5u * 60u * 1000u)

typedef struct dp_server dp_server;

typedef struct dp_server_config {
  /* "host:port" (IPv4, or [IPv6]:port) to listen on; port 0 picks a free
   * port (see dp_server_port). Only read during dp_server_start. */
  const char *listen;
  /* The shard core. Borrowed: it must outlive the server, i.e. be destroyed
   * only after dp_server_stop returned. */
  core *core;
  /* The service layer every request goes through (its checks and its
   * observer); it must drive `core`. NULL: the server makes its own, with no
   * observer. Borrowed: it must outlive the server. */
  service *service;
  /* Largest payload accepted; 0 means WIRE_DEFAULT_MAX_PAYLOAD (1 GiB). A
   * Pull of a larger piece is answered ZS_ERANGE. */
  uint64_t max_payload;
  /* Requests of one connection in progress (read but not yet answered, not
   * counting Pulls waiting for their version) before the server stops
   * reading from it; 0 means 256. */
  uint32_t max_pending;
  /* Answer bytes of one connection queued but not yet sent before the server
   * stops reading from it; 0 means 64 MiB. */
  uint64_t max_queued_bytes;
  /* A connection stalled this long inside a frame, or with answers it does
   * not take, is closed; 0 means 60 s. */
  uint32_t stall_timeout_ms;
  /* Connections served at once; more are accepted and closed at once (an
   * ERROR ZS_ELIMIT with request id 0, then the close). 0 means 1024. */
  uint32_t max_connections;
  /* The tokens a HELLO is checked against (auth_keys_check; the trainer
   * role is needed). NULL: authentication is off, any token is accepted,
   * but the HELLO is still required. Borrowed: it must outlive the server;
   * auth_keys_reload may swap its secrets at any time. */
  auth_keys *auth;
  /* The shard's replica set (server/replica/replica.h), borrowed; NULL: not
   * replicated. Pushes and pulls are admitted by it; a primary's pushes are
   * forwarded to its backups on the pool before they are acknowledged. */
  struct replica *replica;
  /* Longest a connection may take to authenticate; 0 means 5 s (or the
   * environment's ZSHARD_DP_HELLO_TIMEOUT_MS, a knob for tests). While more
   * than half of max_unauthenticated is in use it is at most 1 s. */
  uint32_t hello_timeout_ms;
  /* Connections from one peer address (authenticated or not), so that one
   * host cannot take every slot; 0 means 64. */
  uint32_t max_per_peer;
  /* Connections not yet authenticated, in all; 0 means 128. One address
   * may hold 1/16 of them (at least 1). A new connection over either count
   * is not refused: the oldest connection not yet authenticated (of that
   * address, or of any) is closed to make room, so strangers cannot keep a
   * trainer, who says HELLO at once, from connecting. */
  uint32_t max_unauthenticated;
  /* Pulls waiting for their version: per connection (0 means 4096) and in
   * all (0 means 65536; a Pull of a connection that closed still counts
   * until its wait ends in the core, and counts against its peer address,
   * which may hold a quarter of the total). */
  uint32_t max_waiting_per_conn;
  uint32_t max_waiting;
  /* Bytes of Pull answers copied out of the shard (any dtype but the
   * stored one, and every PULL_BATCH) that one connection may have being
   * produced or waiting for the socket; a single answer larger than this
   * is refused with ZS_ELIMIT. 0 means 256 MiB. */
  uint64_t max_answer_bytes;
  /* The same bytes over all connections; an answer that does not fit waits
   * until others are sent. 0 means 1 GiB. */
  uint64_t max_answer_bytes_total;
  /* The same bytes over the connections of one peer address, so that one
   * host that does not read its answers cannot hold the whole server's
   * budget; an answer that does not fit waits until that address's answers
   * are sent (other addresses are not held up by it). 0 means a quarter of
   * max_answer_bytes_total (256 MiB by default). */
  uint64_t max_answer_bytes_per_peer;
  /* A connection whose socket holds an answer pinned in the shard's
   * low-precision copy and that takes no byte for this long is closed; 0
   * means 250 ms. */
  uint32_t pin_hold_ms;
  /* Pushes and Pulls of at most this many payload bytes run on the loop
   * thread; larger ones run on libuv's thread pool, so that the loop keeps
   * reading and writing for the other peers meanwhile. 0 means 64 KiB. */
  uint64_t inline_bytes;
  /* Where each request's time from arrival to answer is recorded
   * (zshard_request_duration_seconds{transport="data", method=Push, Pull,
   * PushBatch or PullBatch}); NULL records nothing. Borrowed: it must outlive
   * the server. */
  struct metrics *metrics;
  /* TLS 1.3 on every connection as the server of this context
   * (common/net/tls.h: tls_server_new; with a client CA, clients must present a
   * certificate); NULL: plain TCP. Borrowed: it must outlive the server. */
  struct tls_ctx *tls;
  /* TCP congestion control of every accepted connection (TCP_CONGESTION,
   * e.g. "cubic"), set on its socket; NULL or "": the host's default, which
   * is never changed. dp_server_start fails with ZS_EINVAL for a name this
   * process cannot use (stream_cc_check's sentence in err). Copied. */
  const char *congestion;
  /* Per-socket pacing of every accepted connection, Mbit/s
   * (SO_MAX_PACING_RATE on its socket; stream_set_pacing); 0: none. Above
   * STREAM_PACING_MBIT_MAX dp_server_start fails with ZS_EINVAL. */
  uint32_t pacing_mbit;
  /* Link pacing (common/net/stream.h, "Link pacing"): the accepted
   * connections that are sending answers share link_mbit Mbit/s, each paced
   * at link_mbit / n; 0: off. Not with pacing_mbit (ZS_EINVAL). Each
   * socket's TCP_NOTSENT_LOWAT is link_notsent_lowat bytes (0: the
   * kernel's default). */
  uint32_t link_mbit;
  uint32_t link_notsent_lowat;
} dp_server_config;

/* Fills `cfg` with the defaults (every field 0 / NULL, which means the
 * defaults above); the caller then sets listen and core. */
void dp_server_config_init(dp_server_config *cfg);

/* Binds, starts the loop thread and starts serving. Returns 0 and the server
 * in *out (the caller's, released with dp_server_stop), or ZS_EINVAL (bad
 * address, cannot listen) / ZS_ENOMEM / ZS_EINTERNAL with a sentence in err
 * (which may be NULL). */
int dp_server_start(const dp_server_config *cfg, dp_server **out, char *err, size_t errlen);

/* The TCP port the server listens on. */
int dp_server_port(const dp_server *s);

/* Counters, for tests and metrics; each is read atomically, the set is not a
 * snapshot. */
typedef struct dp_server_stats {
  uint64_t connections; /* open now */
  uint64_t accepted;    /* since start */
  uint64_t frames_in;   /* complete frames received */
  uint64_t frames_out;  /* answers queued */
  uint64_t bytes_in, bytes_out;
  uint64_t request_errors;  /* ERROR answers with a request id */
  uint64_t protocol_errors; /* connections closed for a broken stream */
  uint64_t crc_errors;      /* payload or header CRC mismatches */
  uint64_t stalled_closed;  /* connections closed by the stall timeout */
  uint64_t mid_frame;       /* connections now inside a partly received frame */
  uint64_t paused;          /* connections now not read for backpressure */
  uint64_t pulls_waiting;   /* Pulls now waiting in the core for their version */
  uint64_t unauthenticated; /* connections now open that have not authenticated */
  uint64_t auth_refused;    /* connections closed for a missing or refused HELLO */
  uint64_t auth_timeouts;   /* connections closed for not authenticating in time */
  uint64_t limit_refused;   /* connections refused by a connection cap */
  uint64_t answer_bytes;    /* copied Pull answer bytes now held, all connections */
  uint64_t pinned_answers;  /* answers now being sent from the low copy */
  uint64_t pins_released;   /* connections closed for stalling on a pinned answer */
  uint64_t pinned_batches;  /* PULL_BATCH answers sent from the low copy, since the start */
  uint64_t unauth_evicted;  /* connections closed before HELLO to make room for a newer one */
  uint64_t auth_revoked;    /* connections closed because a token reload revoked their token */
} dp_server_stats;
void dp_server_get_stats(const dp_server *s, dp_server_stats *out);

/* The stats above as /metrics families zshard_dp_* (a metrics_extra_fn;
 * arg is the dp_server). */
void dp_server_metrics(void *arg, metrics_text *t);

/* Stops serving and frees the server: the listener closes, every connection
 * is closed (answers not yet sent are dropped), thread-pool work in progress
 * finishes, the loop thread is joined. Pulls still waiting in the core stay
 * registered there; their callbacks, which may run later (at the latest in
 * core_destroy), then only release memory. Must not be called from the loop
 * thread. NULL is accepted. */
void dp_server_stop(dp_server *s);

#endif
