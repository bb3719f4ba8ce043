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
 * of roles is in grpc_server.c and docs/OPERATIONS.md, "Security"). With a
 * certificate and key the port speaks TLS only.
 */
#ifndef ZSHARD_SERVER_GRPC_SERVER_H
#define ZSHARD_SERVER_GRPC_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "common/auth.h"
#include "server/ckpt_svc.h"
#include "server/core.h"
#include "server/metrics.h"
#include "server/service.h"

/* Longest a Pull or GradStats waits for its version or its contributions,
 * whatever the request's timeout or the call's deadline say. */
#define GSRV_MAX_WAIT_MS (5u * 60u * 1000u)
/* How long shutdown lets calls in progress finish before answering the rest
 * with ZS_ECLOSED. */
#define GSRV_DEFAULT_GRACE_MS 10000u

typedef struct gsrv gsrv;

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
  /* The tokens a caller must present (common/auth.h); NULL or keys without a
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
