/*
 * grpc_server — the gRPC transport of zshard-server: every method of
 * zshard.v1.ZShard and grpc.health.v1.Health (Check and Watch) served with the
 * gRPC C core API, parsing requests with protobuf-c and handing them to the
 * shard core (core.h).
 *
 * Answers carry the gRPC code that the status X-macro maps zshard's status to
 * (status_to_grpc), a detail sentence naming the problem, and the trailing
 * metadata "zs-status: <int>" with zshard's own status number. A call to a
 * method the server does not know is answered UNIMPLEMENTED at once.
 *
 * Authentication: with tokens configured, every call but the health
 * service's carries "authorization: Bearer <token>" in its metadata; a call
 * without a valid token is answered UNAUTHENTICATED, a trainer's token on an
 * admin method PERMISSION_DENIED, before its request is parsed (the table
 * of roles is in grpc_methods.c and docs/SECURITY.md, "Roles"). With a
 * certificate and key the port speaks TLS only.
 */
#ifndef ZSHARD_SERVER_GRPC_SERVER_H
#define ZSHARD_SERVER_GRPC_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "common/net/auth.h"
#include "server/ckpt/ckpt_svc.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"

/* Longest a Pull or GradStats waits for its version or its contributions,
 * whatever the request's timeout or the call's deadline say. */
#define GSRV_MAX_WAIT_MS (5u * 60u * 1000u)
/* How long shutdown lets calls in progress finish before answering the rest
 * with ZS_ECLOSED. */
#define GSRV_DEFAULT_GRACE_MS 10000u

typedef struct gsrv gsrv;

/* What one gRPC listener lets its peers hold (docs/OPERATIONS.md, "Limits").
 * A call beyond a count is answered RESOURCE_EXHAUSTED (ZS_ELIMIT) with a
 * sentence naming the limit; a connection beyond a time is closed. */
typedef struct gsrv_limits {
  /* Calls parked in the core (a Pull waiting for its version, a GradStats
   * for its contributions): on the whole server, and per connection. */
  uint32_t max_parked;
  uint32_t max_parked_per_conn;
  /* grpc.health.v1 Watch streams open at once on the whole server. */
  uint32_t max_watchers;
  /* A connection with no call in flight is closed after idle_ms; one that
   * has not finished its HTTP/2 (or TLS) handshake after handshake_ms. */
  uint32_t idle_ms;
  uint32_t handshake_ms;
  /* The server pings a connection silent for keepalive_ms and closes it when
   * no answer comes in keepalive_timeout_ms: a peer that vanished without a
   * FIN releases its parked calls then. */
  uint32_t keepalive_ms;
  uint32_t keepalive_timeout_ms;
  /* Bytes that Push payloads arriving in chunks may hold on the whole server
   * while they are reassembled, and how long one may take to complete. */
  uint64_t max_chunked_bytes;
  uint32_t chunked_ttl_ms;
  /* gRPC's memory quota for the listener: requests being read (a request is
   * read whole before the receive limit is checked), connections' buffers,
   * calls' arenas. Past it gRPC resets the streams it reads. */
  uint64_t memory_bytes;
  /* Bytes of Pull answers built and not yet taken by their peers: on the
   * whole server, and per connection. An answer that does not fit waits for
   * room (it is not refused); one answer always fits where none is held, so
   * a piece of any size is served. An answer not taken after
   * answer_stall_ms has its call cancelled when another answer waits. */
  uint64_t max_answer_bytes;
  uint64_t max_answer_bytes_per_conn;
  uint32_t answer_stall_ms;
} gsrv_limits;

#define GSRV_DEFAULT_MAX_PARKED 16384u
#define GSRV_DEFAULT_MAX_PARKED_PER_CONN 1024u
#define GSRV_DEFAULT_MAX_WATCHERS 256u
#define GSRV_DEFAULT_IDLE_MS (5u * 60u * 1000u)
#define GSRV_DEFAULT_HANDSHAKE_MS 10000u
#define GSRV_DEFAULT_KEEPALIVE_MS (2u * 60u * 1000u)
#define GSRV_DEFAULT_KEEPALIVE_TIMEOUT_MS 20000u
#define GSRV_DEFAULT_MAX_CHUNKED_BYTES (UINT64_C(2) << 30)
#define GSRV_DEFAULT_CHUNKED_TTL_MS 60000u
#define GSRV_DEFAULT_MEMORY_BYTES (UINT64_C(1) << 30)
#define GSRV_DEFAULT_MAX_ANSWER_BYTES (UINT64_C(2) << 30)
#define GSRV_DEFAULT_MAX_ANSWER_BYTES_PER_CONN (UINT64_C(256) << 20)
#define GSRV_DEFAULT_ANSWER_STALL_MS 60000u

/* Fills *l with the defaults above, each overridden by its hidden environment
 * knob when set to a positive integer (ZSHARD_GRPC_MAX_PARKED,
 * ZSHARD_GRPC_MAX_PARKED_PER_CONN, ZSHARD_GRPC_MAX_WATCHERS,
 * ZSHARD_GRPC_IDLE_MS, ZSHARD_GRPC_HANDSHAKE_MS, ZSHARD_GRPC_KEEPALIVE_MS,
 * ZSHARD_GRPC_MAX_CHUNKED_MB, ZSHARD_GRPC_MEMORY_MB, ZSHARD_GRPC_MAX_ANSWER_MB,
 * ZSHARD_GRPC_MAX_ANSWER_MB_PER_CONN, ZSHARD_GRPC_ANSWER_STALL_MS):
 * they exist for tests and emergencies, not as tuning advice. */
void gsrv_limits_init(gsrv_limits *l);

typedef struct gsrv_config {
  /* "host:port" to listen on; port 0 picks a free port (see gsrv_port). The
   * string is only read during gsrv_start. */
  const char *listen;
  /* The shard core the methods drive. Borrowed: it must outlive the server,
   * i.e. be destroyed only after gsrv_destroy returned. */
  core *core;
  /* Completion-queue polling threads; <= 0 means 2 to 4 depending on the
   * number of CPUs. */
  int threads;
  /* Reported by GetInfo; 0 when the server has no data plane. */
  uint32_t data_port;
  /* Shutdown grace period in ms; 0 means GSRV_DEFAULT_GRACE_MS. */
  uint32_t grace_ms;
  /* Where each answered call's duration and outcome is recorded, per method
   * (transport "grpc"); NULL records nothing. Borrowed: it must outlive the
   * server. */
  metrics *metrics;
  /* Serves Checkpoint, CommitCheckpoint, Restore and ListCheckpoints; NULL
   * (no --state-dir) answers them UNIMPLEMENTED. Borrowed: it must outlive
   * the server. */
  ckpt_svc *ckpt;
  /* The service layer every request goes through (its checks and its
   * observer); it must drive `core`. NULL: the server makes its own, with no
   * observer. Borrowed: it must outlive the server. */
  service *service;
  /* The tokens a caller must present (common/net/auth.h); NULL or keys without a
   * token file: every caller may call every method. Borrowed: it must
   * outlive the server; the owner may reload it at any time. */
  auth_keys *auth;
  /* PEM files of the server's certificate chain and key: both given, the
   * port speaks TLS only; both NULL, plaintext. With tls_client_ca_file too,
   * every client must present a certificate that chains to it (mTLS). Only
   * read during gsrv_start and gsrv_reload_tls (the paths are copied). */
  const char *tls_cert_file;
  const char *tls_key_file;
  const char *tls_client_ca_file;
  /* The shard's replica set (server/replica/replica.h), borrowed; NULL: not
   * replicated. Every call is admitted by it first; a primary forwards a
   * trainer's write to its backups before serving it. */
  struct replica *replica;
  /* The listener's limits; NULL means gsrv_limits_init's. Read only during
   * gsrv_start. */
  const gsrv_limits *limits;
} gsrv_config;

/* Binds, starts the polling threads and starts serving (health SERVING).
 * Returns 0 and the server in *out (the caller's, released with
 * gsrv_destroy), or ZS_EINVAL (cannot listen on the address) / ZS_ENOMEM /
 * ZS_EINTERNAL with a sentence in err (which may be NULL). */
int gsrv_start(const gsrv_config *cfg, gsrv **out, char *err, size_t errlen);

/* The TCP port the server listens on. */
int gsrv_port(const gsrv *s);

/* Rereads the TLS files named in the config; new handshakes use them from
 * then on, connections already made keep theirs. Returns 0 (also when the
 * server has no TLS: nothing to reread), or ZS_EINVAL / ZS_ENOMEM with the
 * reason in err, the files in use staying. Any thread. */
int gsrv_reload_tls(gsrv *s, char *err, size_t errlen);

/* Shuts the server down and frees it: health turns NOT_SERVING (Watch streams
 * see it and then end), no new call is admitted, calls in progress get the
 * grace period to finish, then every call still open (a Pull or GradStats
 * still waiting, an Apply still running) is answered UNAVAILABLE (ZS_ECLOSED)
 * and cancelled if its peer does not take the answer. Returns when every call
 * is gone and the threads are joined. Core callbacks still outstanding may
 * run later (at the latest in core_destroy); they only release memory. NULL is
 * accepted. */
void gsrv_destroy(gsrv *s);

#endif
