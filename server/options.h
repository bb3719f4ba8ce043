/*
 * options — zshard-server's settings: each from its flag, else from its
 * environment variable, else its default, checked before anything starts
 * (docs/OPERATIONS.md lists them). main.c starts the shard from them.
 */
#ifndef ZSHARD_SERVER_OPTIONS_H
#define ZSHARD_SERVER_OPTIONS_H

#include <stdint.h>

#include "common/base/log.h"

#define EXIT_USAGE 2

typedef struct options {
  const char *listen;
  const char *port_file;
  const char *hostname; /* only for the shard ordinal; NULL: gethostname() */
  long shard_id;        /* -1: from the hostname */
  long shards;
  long threads; /* 0: number of CPUs */
  log_level level;
  const char *metrics_listen; /* NULL: no metrics endpoint */
  const char *metrics_port_file;
  const char *state_dir;   /* NULL: no checkpoints */
  long keep_checkpoints;   /* 0: keep all */
  const char *data_listen; /* NULL: no data plane */
  char data_listen_buf[300];
  char metrics_listen_buf[300];
  /* Security (docs/SECURITY.md); NULL: not given. */
  const char *token_file;
  const char *admin_token_file;
  const char *rank_key_file; /* the key of per-rank tokens (rank_token.h) */
  int require_rank_tokens;   /* pushes need a rank token (or the admin's) */
  const char *tls_cert;
  const char *tls_key;
  const char *tls_client_ca;
  long long max_params, max_tensors; /* -1: derived from the memory limit */
  /* The replica set (docs/OPERATIONS.md, "Replica sets"); NULL: none. */
  const char *replicas;
  long replica_index;
  long failover_ms;
  long trainer_timeout_ms; /* 0: a fixed membership */
  const char *peer_ca;
  const char *tcp_congestion; /* NULL: the host's default */
  uint32_t tcp_pacing_mbit;   /* per data-plane socket; 0: no pacing */
  uint32_t tcp_link_mbit;     /* link pacing (stream.h); 0: off */
  uint32_t tcp_link_lowat;    /* TCP_NOTSENT_LOWAT of link-paced sockets; 0: the kernel's */
} options;

/* Fills `o` from the flags and the environment. Returns -1 to go on, or the
 * exit status (0 after --help/--version, EXIT_USAGE on a bad flag). The
 * strings `o` points to are argv's, the environment's or o's own buffers:
 * they live as long as the process does. */
int options_parse(int argc, char **argv, options *o);

/* Prints "zshard-server: " and fmt (one %s, given arg) to stderr with a
 * pointer to --help, for a setting found wrong after options_parse (the
 * security files); returns EXIT_USAGE. */
int options_bad_usage(const char *fmt, const char *arg);

#endif
