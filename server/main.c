/*
 * zshard-server — one shard server: the shard core behind the gRPC transport.
 *
 * Threads: main blocks SIGTERM, SIGINT and SIGHUP before any other thread
 * exists (so every thread inherits the mask), starts the core and the
 * transport, and then waits in sigwait(); the signal is handled there, in
 * ordinary code, never in a signal handler. SIGHUP rereads the token files
 * and the TLS files (rotation without a restart); the others stop. The core, the transports and the
 * metrics endpoint own their threads (see server/core/core.h, server/transport/grpc/grpc_server.c,
 * server/transport/dp/dp_server.c and server/metrics/metrics_http.c).
 *
 * Start order: core, data plane, gRPC (which advertises the data port in
 * GetInfo); stop order: gRPC (its calls drain), data plane, core.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/base/cpu.h"
#include "common/base/log.h"
#include "common/model/spec.h"
#include "common/net/auth.h"
#include "common/net/hostport.h"
#include "common/net/rpc_client.h"
#include "common/net/stream.h"
#include "common/net/tls.h"
#include "server/ckpt/ckpt_svc.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_http.h"
#include "server/replica/replica.h"
#include "server/service/service.h"
#include "server/transport/dp/dp_server.h"
#include "server/transport/grpc/grpc_server.h"
#include "zshard/types.h"

#define EXIT_USAGE 2
#define DEFAULT_LISTEN "0.0.0.0:7070"
#define MAX_THREADS 1024

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
} options;

static void usage(FILE *f) {
  fprintf(f,
          "Usage: zshard-server [OPTION]...\n"
          "Serve one shard of a zshard job over gRPC and the data plane.\n"
          "\n"
          "  --listen ADDR      address to listen on (ZSHARD_LISTEN, default %s);\n"
          "                     port 0 picks a free port\n"
          "  --shard-id I       this server's shard id (ZSHARD_SHARD_ID); by default the\n"
          "                     ordinal at the end of the host name, as in a StatefulSet\n"
          "                     pod \"zshard-2\"\n"
          "  --shards N         number of shard servers in the job (ZSHARD_SHARDS,\n"
          "                     default 1)\n"
          "  --threads T        optimizer threads (ZSHARD_THREADS, default: CPUs)\n"
          "  --log-level LEVEL  debug, info, warn, error or off (ZSHARD_LOG_LEVEL,\n"
          "                     default info)\n"
          "  --port-file PATH   once serving, write the bound port to PATH\n"
          "                     (ZSHARD_PORT_FILE)\n"
          "  --data-listen ADDR\n"
          "                     serve Push and Pull on the data plane (framed TCP) at\n"
          "                     ADDR (ZSHARD_DATA_LISTEN; default the --listen host\n"
          "                     with port 0, a free port; the container image sets\n"
          "                     0.0.0.0:7071); \"off\" turns it off. GetInfo tells\n"
          "                     clients the port\n"
          "  --metrics-listen ADDR\n"
          "                     serve Prometheus metrics at http://ADDR/metrics\n"
          "                     (ZSHARD_METRICS_LISTEN, default off; the container\n"
          "                     image sets 0.0.0.0:7090); port 0 picks a free port;\n"
          "                     an address without a host (\":7090\" or \"7090\")\n"
          "                     binds 127.0.0.1 only\n"
          "  --metrics-port-file PATH\n"
          "                     write the metrics port to PATH before the\n"
          "                     --port-file is written (ZSHARD_METRICS_PORT_FILE)\n"
          "  --state-dir DIR    load the newest complete checkpoint in DIR on start and\n"
          "                     write checkpoints there (ZSHARD_STATE_DIR, default\n"
          "                     none: no checkpoints); see docs/CHECKPOINTS.md\n"
          "  --keep-checkpoints K\n"
          "                     after each checkpoint, remove all but the K newest\n"
          "                     complete ones (ZSHARD_KEEP_CHECKPOINTS, default 0:\n"
          "                     keep all)\n"
          "  --token-file PATH  the trainers' token: every gRPC call and data-plane\n"
          "                     connection must present it (ZSHARD_TOKEN_FILE)\n"
          "  --admin-token-file PATH\n"
          "                     the operators' token, needed for Checkpoint, Restore,\n"
          "                     CloseJob and WriteState (ZSHARD_ADMIN_TOKEN_FILE); a\n"
          "                     token file holds one token of 16 to 4096 printable\n"
          "                     bytes; SIGHUP rereads both files\n"
          "  --rank-key-file PATH\n"
          "                     the key that signs per-rank tokens (zshard\n"
          "                     mint-rank-token): a trainer presenting one may push\n"
          "                     only as its job and rank (ZSHARD_RANK_KEY_FILE;\n"
          "                     needs a token file; SIGHUP rereads it)\n"
          "  --require-rank-tokens\n"
          "                     refuse pushes under the plain trainers' token (needs\n"
          "                     --rank-key-file and --admin-token-file)\n"
          "  --tls-cert PATH    PEM certificate chain: gRPC and the data plane speak\n"
          "                     TLS only (ZSHARD_TLS_CERT; needs --tls-key)\n"
          "  --tls-key PATH     PEM private key of --tls-cert (ZSHARD_TLS_KEY)\n"
          "  --tls-client-ca PATH\n"
          "                     PEM CA bundle: every client must present a certificate\n"
          "                     it signed (mTLS; ZSHARD_TLS_CLIENT_CA); SIGHUP rereads\n"
          "                     the three TLS files\n"
          "  --max-params P     refuse a job that puts more than P parameters on this\n"
          "                     shard (ZSHARD_MAX_PARAMS; default: 3/4 of the memory\n"
          "                     limit at 32 bytes each)\n"
          "  --max-tensors T    refuse a job of more than T tensors (ZSHARD_MAX_TENSORS;\n"
          "                     default: 1/16 of the memory limit at 1 KiB each)\n"
          "  --replicas LIST    run as a member of this shard's replica set: LIST is the\n"
          "                     gRPC host:port of every member, separated by '|', the\n"
          "                     same on every member (ZSHARD_REPLICAS)\n"
          "  --replica-index K  this server's place in LIST, from 0\n"
          "                     (ZSHARD_REPLICA_INDEX; needed with --replicas)\n"
          "  --failover-ms MS   a member that does not answer for MS is dropped by the\n"
          "                     primary (ZSHARD_FAILOVER_MS, default 2000)\n"
          "  --trainer-timeout-ms MS\n"
          "                     a trainer that has not given all of a step's\n"
          "                     contributions MS after another one asked for the step's\n"
          "                     statistics is left out of the step, which goes on with\n"
          "                     the others (ZSHARD_TRAINER_TIMEOUT_MS; 0, the default:\n"
          "                     every trainer is awaited; docs/OPERATIONS.md)\n"
          "  --peer-ca PATH     PEM CA bundle the other members' certificates chain to\n"
          "                     (ZSHARD_PEER_CA; default --tls-client-ca)\n"
          "  --tcp-congestion NAME\n"
          "                     TCP congestion control of every data-plane connection\n"
          "                     (TCP_CONGESTION per socket, e.g. cubic; ZSHARD_TCP_CONGESTION;\n"
          "                     default: the host's, which is left unchanged)\n"
          "  --help             print this help and exit\n"
          "  --version          print the version and exit\n"
          "\n"
          "A flag wins over its environment variable. SIGTERM or SIGINT stops the\n"
          "server: health turns NOT_SERVING, calls in progress finish, exit status 0.\n"
          "SIGHUP rereads the token and TLS files; on an error the old ones stay.\n",
          DEFAULT_LISTEN);
}

static int bad_usage(const char *fmt, const char *arg) {
  fputs("zshard-server: ", stderr);
  fprintf(stderr, fmt, arg);
  fputs("\nTry 'zshard-server --help' for more information.\n", stderr);
  return EXIT_USAGE;
}

/* A decimal integer in [lo, hi] and nothing else, or -1. */
static long parse_long(const char *s, long lo, long hi) {
  if (!s || !*s)
    return -1;
  for (const char *p = s; *p; p++)
    if (*p < '0' || *p > '9')
      return -1;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < lo || v > hi)
    return -1;
  return v;
}

/* A job limit: -1 when not given (derived from memory), -2 when malformed. */
static long long parse_limit(const char *s, uint64_t hi) {
  if (!s || !*s)
    return -1;
  long v = parse_long(s, 1, (long)hi);
  return v < 0 ? -2 : v;
}

/* The ordinal a StatefulSet gives its pods: the digits after the last '-' of
 * the host name's first label ("zshard-2", "zshard-2.zshard.ns.svc"). */
static long hostname_ordinal(const char *host) {
  char label[256];
  size_t n = strcspn(host, ".");
  if (n == 0 || n >= sizeof label)
    return -1;
  memcpy(label, host, n);
  label[n] = '\0';
  char *dash = strrchr(label, '-');
  if (!dash || strlen(dash + 1) > 9)
    return -1;
  return parse_long(dash + 1, 0, LONG_MAX);
}

enum {
  OPT_LISTEN = 256,
  OPT_SHARD_ID,
  OPT_SHARDS,
  OPT_THREADS,
  OPT_LOG_LEVEL,
  OPT_PORT_FILE,
  OPT_HOSTNAME,
  OPT_METRICS_LISTEN,
  OPT_METRICS_PORT_FILE,
  OPT_DATA_LISTEN,
  OPT_STATE_DIR,
  OPT_KEEP_CHECKPOINTS,
  OPT_TOKEN_FILE,
  OPT_ADMIN_TOKEN_FILE,
  OPT_RANK_KEY_FILE,
  OPT_REQUIRE_RANK_TOKENS,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TLS_CLIENT_CA,
  OPT_MAX_PARAMS,
  OPT_MAX_TENSORS,
  OPT_REPLICAS,
  OPT_REPLICA_INDEX,
  OPT_FAILOVER_MS,
  OPT_TRAINER_TIMEOUT_MS,
  OPT_PEER_CA,
  OPT_TCP_CONGESTION,
  OPT_HELP,
  OPT_VERSION
};

/* The settings as given: each from its flag, else from its environment
 * variable, else NULL. The strings are argv's or the environment's. */
typedef struct raw_options {
  const char *listen;
  const char *shard_id;
  const char *shards;
  const char *threads;
  const char *level;
  const char *port_file;
  const char *hostname;
  const char *metrics_listen;
  const char *metrics_port_file;
  const char *state_dir;
  const char *keep;
  const char *data_listen;
  const char *token_file;
  const char *admin_token_file;
  const char *rank_key_file;
  int require_rank_tokens;
  const char *tls_cert;
  const char *tls_key;
  const char *tls_client_ca;
  const char *max_params, *max_tensors;
  const char *replicas, *replica_index, *failover_ms, *peer_ca;
  const char *trainer_timeout_ms;
  const char *tcp_congestion;
} raw_options;

static void read_environment(raw_options *r) {
  r->listen = getenv("ZSHARD_LISTEN");
  r->shard_id = getenv("ZSHARD_SHARD_ID");
  r->shards = getenv("ZSHARD_SHARDS");
  r->threads = getenv("ZSHARD_THREADS");
  r->level = getenv("ZSHARD_LOG_LEVEL");
  r->port_file = getenv("ZSHARD_PORT_FILE");
  r->hostname = getenv("ZSHARD_HOSTNAME");
  r->metrics_listen = getenv("ZSHARD_METRICS_LISTEN");
  r->metrics_port_file = getenv("ZSHARD_METRICS_PORT_FILE");
  r->state_dir = getenv("ZSHARD_STATE_DIR");
  r->keep = getenv("ZSHARD_KEEP_CHECKPOINTS");
  r->data_listen = getenv("ZSHARD_DATA_LISTEN");
  r->token_file = getenv("ZSHARD_TOKEN_FILE");
  r->admin_token_file = getenv("ZSHARD_ADMIN_TOKEN_FILE");
  r->rank_key_file = getenv("ZSHARD_RANK_KEY_FILE");
  r->tls_cert = getenv("ZSHARD_TLS_CERT");
  r->tls_key = getenv("ZSHARD_TLS_KEY");
  r->tls_client_ca = getenv("ZSHARD_TLS_CLIENT_CA");
  r->max_params = getenv("ZSHARD_MAX_PARAMS");
  r->max_tensors = getenv("ZSHARD_MAX_TENSORS");
  r->replicas = getenv("ZSHARD_REPLICAS");
  r->replica_index = getenv("ZSHARD_REPLICA_INDEX");
  r->failover_ms = getenv("ZSHARD_FAILOVER_MS");
  r->trainer_timeout_ms = getenv("ZSHARD_TRAINER_TIMEOUT_MS");
  r->peer_ca = getenv("ZSHARD_PEER_CA");
  r->tcp_congestion = getenv("ZSHARD_TCP_CONGESTION");
}

/* Lets the flags override what read_environment found. Returns -1 to go on,
 * or the exit status (0 after --help/--version, EXIT_USAGE on a bad flag). */
static int read_flags(int argc, char **argv, raw_options *r) {
  static const struct option longopts[] = {
      {"listen", required_argument, NULL, OPT_LISTEN},
      {"shard-id", required_argument, NULL, OPT_SHARD_ID},
      {"shards", required_argument, NULL, OPT_SHARDS},
      {"threads", required_argument, NULL, OPT_THREADS},
      {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
      {"port-file", required_argument, NULL, OPT_PORT_FILE},
      {"metrics-listen", required_argument, NULL, OPT_METRICS_LISTEN},
      {"metrics-port-file", required_argument, NULL, OPT_METRICS_PORT_FILE},
      {"data-listen", required_argument, NULL, OPT_DATA_LISTEN},
      /* Hidden: the host name used for the shard ordinal, for tests. */
      {"hostname", required_argument, NULL, OPT_HOSTNAME},
      {"state-dir", required_argument, NULL, OPT_STATE_DIR},
      {"keep-checkpoints", required_argument, NULL, OPT_KEEP_CHECKPOINTS},
      {"token-file", required_argument, NULL, OPT_TOKEN_FILE},
      {"admin-token-file", required_argument, NULL, OPT_ADMIN_TOKEN_FILE},
      {"rank-key-file", required_argument, NULL, OPT_RANK_KEY_FILE},
      {"require-rank-tokens", no_argument, NULL, OPT_REQUIRE_RANK_TOKENS},
      {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
      {"tls-key", required_argument, NULL, OPT_TLS_KEY},
      {"tls-client-ca", required_argument, NULL, OPT_TLS_CLIENT_CA},
      {"max-params", required_argument, NULL, OPT_MAX_PARAMS},
      {"max-tensors", required_argument, NULL, OPT_MAX_TENSORS},
      {"replicas", required_argument, NULL, OPT_REPLICAS},
      {"replica-index", required_argument, NULL, OPT_REPLICA_INDEX},
      {"failover-ms", required_argument, NULL, OPT_FAILOVER_MS},
      {"trainer-timeout-ms", required_argument, NULL, OPT_TRAINER_TIMEOUT_MS},
      {"peer-ca", required_argument, NULL, OPT_PEER_CA},
      {"tcp-congestion", required_argument, NULL, OPT_TCP_CONGESTION},
      {"help", no_argument, NULL, OPT_HELP},
      {"version", no_argument, NULL, OPT_VERSION},
      {NULL, 0, NULL, 0},
  };
  opterr = 0; /* our own messages */
  int ch;
  while ((ch = getopt_long(argc, argv, ":", longopts, NULL)) != -1) {
    switch (ch) {
    case OPT_LISTEN:
      r->listen = optarg;
      break;
    case OPT_SHARD_ID:
      r->shard_id = optarg;
      break;
    case OPT_SHARDS:
      r->shards = optarg;
      break;
    case OPT_THREADS:
      r->threads = optarg;
      break;
    case OPT_LOG_LEVEL:
      r->level = optarg;
      break;
    case OPT_PORT_FILE:
      r->port_file = optarg;
      break;
    case OPT_HOSTNAME:
      r->hostname = optarg;
      break;
    case OPT_METRICS_LISTEN:
      r->metrics_listen = optarg;
      break;
    case OPT_METRICS_PORT_FILE:
      r->metrics_port_file = optarg;
      break;
    case OPT_DATA_LISTEN:
      r->data_listen = optarg;
      break;
    case OPT_STATE_DIR:
      r->state_dir = optarg;
      break;
    case OPT_KEEP_CHECKPOINTS:
      r->keep = optarg;
      break;
    case OPT_TOKEN_FILE:
      r->token_file = optarg;
      break;
    case OPT_ADMIN_TOKEN_FILE:
      r->admin_token_file = optarg;
      break;
    case OPT_RANK_KEY_FILE:
      r->rank_key_file = optarg;
      break;
    case OPT_REQUIRE_RANK_TOKENS:
      r->require_rank_tokens = 1;
      break;
    case OPT_TLS_CERT:
      r->tls_cert = optarg;
      break;
    case OPT_TLS_KEY:
      r->tls_key = optarg;
      break;
    case OPT_TLS_CLIENT_CA:
      r->tls_client_ca = optarg;
      break;
    case OPT_MAX_PARAMS:
      r->max_params = optarg;
      break;
    case OPT_MAX_TENSORS:
      r->max_tensors = optarg;
      break;
    case OPT_REPLICAS:
      r->replicas = optarg;
      break;
    case OPT_REPLICA_INDEX:
      r->replica_index = optarg;
      break;
    case OPT_FAILOVER_MS:
      r->failover_ms = optarg;
      break;
    case OPT_TRAINER_TIMEOUT_MS:
      r->trainer_timeout_ms = optarg;
      break;
    case OPT_PEER_CA:
      r->peer_ca = optarg;
      break;
    case OPT_TCP_CONGESTION:
      r->tcp_congestion = optarg;
      break;
    case OPT_HELP:
      usage(stdout);
      return 0;
    case OPT_VERSION:
      printf("zshard-server %s\n", zs_version());
      return 0;
    case ':':
      return bad_usage("option '%s' needs a value", argv[optind - 1]);
    default:
      return bad_usage("unknown option '%s'", argv[optind - 1]);
    }
  }
  if (optind < argc)
    return bad_usage("unexpected argument '%s'", argv[optind]);
  return -1;
}

/* /metrics tells about the job and the host (memory, traffic): an address
 * without a host, ":7090" or "7090", binds loopback only, and exposing it
 * takes an explicit host such as 0.0.0.0. Rewrites o->metrics_listen into
 * o->metrics_listen_buf when it has no host. An address that does not parse
 * is left as it is, for the metrics endpoint to refuse with its reason. */
static void metrics_loopback(const char *addr, options *o) {
  char text[HOSTPORT_TEXT_MAX + 2];
  int bare_port = addr[0] >= '0' && addr[0] <= '9' && !strchr(addr, ':');
  hostport hp;
  if (snprintf(text, sizeof text, "%s%s", bare_port ? ":" : "", addr) >= (int)sizeof text ||
      hostport_parse(text, &hp, NULL, 0) != 0 || hp.host[0])
    return;
  hostport_format(o->metrics_listen_buf, sizeof o->metrics_listen_buf, "127.0.0.1", hp.port);
  o->metrics_listen = o->metrics_listen_buf;
}

/* The addresses, files and directories of `r` into `o`. Returns -1 to go on
 * or EXIT_USAGE. */
static int set_endpoints(const raw_options *r, options *o) {
  const char *data_listen = r->data_listen;
  o->listen = r->listen && *r->listen ? r->listen : DEFAULT_LISTEN;
  hostport listen_hp;
  char why[400];
  if (hostport_parse(o->listen, &listen_hp, why, sizeof why) != 0)
    return bad_usage("--listen (ZSHARD_LISTEN): %s", why);
  /* By default the data plane listens where gRPC does, on a free port: two
   * servers on one host never collide, and clients read the port from
   * GetInfo. */
  if (!data_listen || !*data_listen) {
    hostport_format(o->data_listen_buf, sizeof o->data_listen_buf, listen_hp.host, 0);
    data_listen = o->data_listen_buf;
  }
  o->data_listen = strcmp(data_listen, "off") != 0 ? data_listen : NULL;
  o->port_file = r->port_file && *r->port_file ? r->port_file : NULL;
  o->hostname = r->hostname && *r->hostname ? r->hostname : NULL;
  /* "off" (or nothing) turns the endpoint off, so a deployment can switch it
   * off over a variable set by the image. */
  const char *metrics_listen = r->metrics_listen;
  o->metrics_listen = metrics_listen && *metrics_listen && strcmp(metrics_listen, "off") != 0
                          ? metrics_listen
                          : NULL;
  if (o->metrics_listen)
    metrics_loopback(o->metrics_listen, o);
  o->metrics_port_file =
      r->metrics_port_file && *r->metrics_port_file ? r->metrics_port_file : NULL;
  if (o->metrics_port_file && !o->metrics_listen)
    return bad_usage("%s", "--metrics-port-file (ZSHARD_METRICS_PORT_FILE) needs --metrics-listen");
  o->state_dir = r->state_dir && *r->state_dir ? r->state_dir : NULL;
  o->token_file = r->token_file && *r->token_file ? r->token_file : NULL;
  o->admin_token_file = r->admin_token_file && *r->admin_token_file ? r->admin_token_file : NULL;
  o->rank_key_file = r->rank_key_file && *r->rank_key_file ? r->rank_key_file : NULL;
  o->require_rank_tokens = r->require_rank_tokens;
  o->tls_cert = r->tls_cert && *r->tls_cert ? r->tls_cert : NULL;
  o->tls_key = r->tls_key && *r->tls_key ? r->tls_key : NULL;
  o->tls_client_ca = r->tls_client_ca && *r->tls_client_ca ? r->tls_client_ca : NULL;
  if (!o->tls_cert != !o->tls_key)
    return bad_usage("%s", "--tls-cert (ZSHARD_TLS_CERT) and --tls-key (ZSHARD_TLS_KEY) go "
                           "together");
  if (o->tls_client_ca && !o->tls_cert)
    return bad_usage("%s", "--tls-client-ca (ZSHARD_TLS_CLIENT_CA) needs --tls-cert and "
                           "--tls-key");
  return -1;
}

/* The numbers and the log level of `r` into `o`. Returns -1 to go on or
 * EXIT_USAGE. */
static int set_numbers(const raw_options *r, options *o) {
  o->keep_checkpoints = 0;
  if (r->keep && *r->keep) {
    o->keep_checkpoints = parse_long(r->keep, 0, 1000000);
    if (o->keep_checkpoints < 0)
      return bad_usage("--keep-checkpoints (ZSHARD_KEEP_CHECKPOINTS) must be a whole number from "
                       "0 to 1000000, not '%s'",
                       r->keep);
  }

  if ((o->max_params = parse_limit(r->max_params, SPEC_MAX_TOTAL_NUMEL)) == -2)
    return bad_usage("--max-params (ZSHARD_MAX_PARAMS) must be a whole number from 1 to "
                     "4398046511104, not '%s'",
                     r->max_params);
  if ((o->max_tensors = parse_limit(r->max_tensors, SPEC_MAX_TENSORS)) == -2)
    return bad_usage("--max-tensors (ZSHARD_MAX_TENSORS) must be a whole number from 1 to "
                     "1000000, not '%s'",
                     r->max_tensors);

  o->level = LOG_LEVEL_INFO;
  if (r->level && *r->level && log_parse_level(r->level, &o->level) != 0)
    return bad_usage(
        "--log-level (ZSHARD_LOG_LEVEL) must be debug, info, warn, error or off, not '%s'",
        r->level);

  o->shards = 1;
  if (r->shards && *r->shards) {
    o->shards = parse_long(r->shards, 1, SPEC_MAX_SHARDS);
    if (o->shards < 0)
      return bad_usage("--shards (ZSHARD_SHARDS) must be a whole number from 1 to 4096, not '%s'",
                       r->shards);
  }
  o->threads = 0;
  if (r->threads && *r->threads) {
    o->threads = parse_long(r->threads, 1, MAX_THREADS);
    if (o->threads < 0)
      return bad_usage("--threads (ZSHARD_THREADS) must be a whole number from 1 to 1024, not '%s'",
                       r->threads);
  }
  return -1;
}

/* The shard id: given, or the host name's ordinal; after set_endpoints and
 * set_numbers (it needs o->hostname and o->shards). Returns -1 to go on or
 * EXIT_USAGE. */
static int set_shard_id(const raw_options *r, options *o) {
  if (r->shard_id && *r->shard_id) {
    o->shard_id = parse_long(r->shard_id, 0, SPEC_MAX_SHARDS - 1);
    if (o->shard_id < 0)
      return bad_usage(
          "--shard-id (ZSHARD_SHARD_ID) must be a whole number from 0 to 4095, not '%s'",
          r->shard_id);
  } else {
    char host[256] = "";
    if (o->hostname)
      snprintf(host, sizeof host, "%s", o->hostname);
    else if (gethostname(host, sizeof host - 1) != 0)
      host[0] = '\0';
    o->shard_id = hostname_ordinal(host);
    /* A single shard needs no id; a host name without an ordinal is then
     * just a name. */
    if (o->shard_id < 0 && o->shards == 1)
      o->shard_id = 0;
    if (o->shard_id < 0)
      return bad_usage("no --shard-id given and the host name '%s' does not end in "
                       "-<ordinal>",
                       host);
  }
  if (o->shard_id >= o->shards) {
    char msg[96];
    snprintf(msg, sizeof msg, "%ld is not below the shard count %ld", o->shard_id, o->shards);
    return bad_usage("shard id %s", msg);
  }
  return -1;
}

/* The replica set of `r` into `o` (checked here, so that a bad list is a
 * usage error). Returns -1 to go on or EXIT_USAGE. */
static int set_replicas(const raw_options *r, options *o) {
  o->replicas = r->replicas && *r->replicas ? r->replicas : NULL;
  o->peer_ca = r->peer_ca && *r->peer_ca ? r->peer_ca : o->tls_client_ca;
  o->trainer_timeout_ms = 0;
  if (r->trainer_timeout_ms && *r->trainer_timeout_ms &&
      (o->trainer_timeout_ms = parse_long(r->trainer_timeout_ms, 0, 3600000)) < 0)
    return bad_usage("--trainer-timeout-ms (ZSHARD_TRAINER_TIMEOUT_MS) must be a whole number "
                     "from 0 to 3600000, not '%s'",
                     r->trainer_timeout_ms);
  o->failover_ms = REPLICA_DEFAULT_FAILOVER_MS;
  if (r->failover_ms && *r->failover_ms &&
      (o->failover_ms = parse_long(r->failover_ms, 100, 600000)) < 0)
    return bad_usage("--failover-ms (ZSHARD_FAILOVER_MS) must be a whole number from 100 to "
                     "600000, not '%s'",
                     r->failover_ms);
  if (!o->replicas)
    return -1;
  char *addrs[REPLICA_MAX_MEMBERS];
  char why[300];
  int n = replica_parse_members(o->replicas, addrs, REPLICA_MAX_MEMBERS, why, sizeof why);
  if (n < 0)
    return bad_usage("%s", why);
  for (int i = 0; i < n; i++)
    free(addrs[i]);
  o->replica_index = r->replica_index ? parse_long(r->replica_index, 0, n - 1) : -1;
  if (o->replica_index < 0)
    return bad_usage("--replicas needs --replica-index (ZSHARD_REPLICA_INDEX), this server's "
                     "place in the list: 0 to %s",
                     n == 2   ? "1"
                     : n == 3 ? "2"
                              : "the members' count - 1");
  if (o->tls_cert && !o->peer_ca)
    return bad_usage("%s", "a replica with --tls-cert needs the CA of its peers' certificates: "
                           "--peer-ca or --tls-client-ca");
  return -1;
}

/* The data plane's TCP congestion control, checked against what this
 * kernel offers and this process may use (a usage error otherwise). Returns
 * -1 to go on or EXIT_USAGE. */
static int set_congestion(const raw_options *r, options *o) {
  o->tcp_congestion = r->tcp_congestion && *r->tcp_congestion ? r->tcp_congestion : NULL;
  char why[400];
  if (o->tcp_congestion && stream_cc_check(o->tcp_congestion, why, sizeof why) != 0)
    return bad_usage("--tcp-congestion (ZSHARD_TCP_CONGESTION): %s", why);
  return -1;
}

/* Fills `o` from the flags and the environment. Returns -1 to go on, or the
 * exit status (0 after --help/--version, EXIT_USAGE on a bad flag). The
 * checks run in a fixed order, so a command line with several mistakes is
 * always told about the same one first. */
static int parse_options(int argc, char **argv, options *o) {
  raw_options r = {0};
  read_environment(&r);
  int rc = read_flags(argc, argv, &r);
  if (rc < 0)
    rc = set_endpoints(&r, o);
  if (rc < 0)
    rc = set_numbers(&r, o);
  if (rc < 0)
    rc = set_shard_id(&r, o);
  if (rc < 0)
    rc = set_replicas(&r, o);
  if (rc < 0)
    rc = set_congestion(&r, o);
  return rc;
}

/* Writes the port to `path` through a temporary file and rename(), so a reader
 * polling for the file sees either nothing or the whole number. */
static int write_port_file(const char *path, int port) {
  char tmp[4096];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
    return -1;
  FILE *f = fopen(tmp, "w");
  if (!f)
    return -1;
  int ok = fprintf(f, "%d\n", port) > 0;
  ok = fflush(f) == 0 && ok;
  ok = fsync(fileno(f)) == 0 && ok;
  ok = fclose(f) == 0 && ok;
  if (!ok || rename(tmp, path) != 0) {
    unlink(tmp);
    return -1;
  }
  return 0;
}

/* What a running shard is made of. Each member is NULL until started;
 * shard_stop releases whatever is there, so every way out of main, a failed
 * start or a signal, goes through it. */
typedef struct shard {
  metrics *mx;
  core *c;
  service *sv; /* one for both transports: its observer hears every request */
  ckpt_svc *svc;
  dp_server *dp;
  gsrv *srv;
  metrics_server *msrv;
  replica *rep;    /* NULL: not replicated */
  auth_keys *auth; /* read before anything starts; freed last */
  tls_ctx *dp_tls; /* the data plane's TLS context (NULL: plain TCP); freed last */
} shard;

/* Loads the newest checkpoint in --state-dir, if one is given. The
 * checkpoint is loaded before any transport starts, so that no trainer ever
 * sees this shard empty when its state directory is not. Returns 0 or an
 * error, logged. */
static int start_checkpoints(const options *o, shard *s) {
  if (!o->state_dir)
    return 0;
  ckpt_svc_config kc = {
      .state_dir = o->state_dir, .core = s->c, .keep = (uint32_t)o->keep_checkpoints};
  char kerr[700] = "";
  int loaded = 0;
  uint64_t step = 0;
  int rc = ckpt_svc_create(&kc, &s->svc, kerr, sizeof kerr);
  if (rc == 0)
    rc = ckpt_svc_load_latest(s->svc, &loaded, &step, kerr, sizeof kerr);
  if (rc)
    LOG_ERROR("startup_failed", "stage=checkpoint dir=%s error=%s detail=\"%s\"", o->state_dir,
              zs_err_name(rc), kerr);
  return rc;
}

/* The transports and the metrics endpoint. Returns 0 or an error, logged. */
static int start_transports(const options *o, shard *s) {
  char err[256] = "";
  int rc;
  /* Before gRPC, whose GetInfo advertises the data port from its first
   * answer on. */
  if (o->data_listen) {
    dp_server_config dc;
    dp_server_config_init(&dc);
    dc.listen = o->data_listen;
    dc.core = s->c;
    dc.service = s->sv;
    dc.metrics = s->mx;
    dc.auth = s->auth;
    dc.tls = s->dp_tls;
    dc.replica = s->rep;
    dc.congestion = o->tcp_congestion;
    rc = dp_server_start(&dc, &s->dp, err, sizeof err);
    if (rc == 0)
      rc = metrics_add_extra(s->mx, dp_server_metrics, s->dp);
    if (rc) {
      LOG_ERROR("startup_failed", "stage=data_plane addr=%s error=%s detail=\"%s\"", o->data_listen,
                zs_err_name(rc), err);
      return rc;
    }
  }
  gsrv_config gc = {.listen = o->listen,
                    .core = s->c,
                    .service = s->sv,
                    .ckpt = s->svc,
                    .metrics = s->mx,
                    .data_port = s->dp ? (uint32_t)dp_server_port(s->dp) : 0,
                    .auth = s->auth,
                    .tls_cert_file = o->tls_cert,
                    .tls_key_file = o->tls_key,
                    .tls_client_ca_file = o->tls_client_ca,
                    .replica = s->rep};
  rc = gsrv_start(&gc, &s->srv, err, sizeof err);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=grpc error=%s detail=\"%s\"", zs_err_name(rc), err);
    return rc;
  }
  if (o->metrics_listen) {
    metrics_server_config mc = {.listen = o->metrics_listen, .metrics = s->mx, .core = s->c};
    rc = metrics_server_start(&mc, &s->msrv, err, sizeof err);
    if (rc) {
      LOG_ERROR("startup_failed", "stage=metrics error=%s detail=\"%s\"", zs_err_name(rc), err);
      return rc;
    }
    LOG_INFO("metrics_listening", "addr=%s port=%d path=/metrics", o->metrics_listen,
             metrics_server_port(s->msrv));
  }
  return 0;
}

/* The job limits: each flag (or variable) given, else derived from the
 * memory limit (service_limits_for_memory), logged once. */
static void set_job_limits(const options *o, service *sv) {
  uint64_t memory = service_memory_limit(NULL);
  service_limits l = service_limits_for_memory(memory);
  if (o->max_params > 0)
    l.max_params = (uint64_t)o->max_params;
  if (o->max_tensors > 0)
    l.max_tensors = (uint64_t)o->max_tensors;
  service_set_limits(sv, &l);
  LOG_INFO("job_limits",
           "max_params=%" PRIu64 " max_tensors=%" PRIu64 " memory_limit_bytes=%" PRIu64
           " params_from=%s tensors_from=%s",
           l.max_params, l.max_tensors, memory, o->max_params > 0 ? "flag" : "memory",
           o->max_tensors > 0 ? "flag" : "memory");
}

/* The replica set, when --replicas is given: its peers are called with the
 * admin token (forwards need the admin role) and, with TLS, this server's
 * own certificate. Returns 0 or an error, logged. */
static int start_replica(const options *o, shard *s) {
  if (!o->replicas)
    return 0;
  char token[4200] = "";
  char err[600] = "";
  int rc = 0;
  /* Without an admin token file the trainers' token is the admin's too. */
  const char *tf = o->admin_token_file ? o->admin_token_file : o->token_file;
  if (tf && (rc = auth_read_token_file(tf, token, sizeof token, err, sizeof err)) < 0) {
    LOG_ERROR("startup_failed", "stage=replica error=%s detail=\"%s\"", zs_err_name(rc), err);
    return rc;
  }
  replica_config rc_cfg = {.members = o->replicas,
                           .index = (uint32_t)o->replica_index,
                           .failover_ms = (uint32_t)o->failover_ms,
                           .core = s->c,
                           .token = token,
                           .tls_ca_file = o->tls_cert ? o->peer_ca : NULL,
                           .tls_cert_file = o->tls_cert,
                           .tls_key_file = o->tls_key};
  rc = replica_create(&rc_cfg, &s->rep, err, sizeof err);
  memset(token, 0, sizeof token);
  if (rc)
    LOG_ERROR("startup_failed", "stage=replica error=%s detail=\"%s\"", zs_err_name(rc), err);
  else if (s->mx)
    rc = metrics_add_extra(s->mx, replica_metrics, s->rep);
  return rc;
}

/* Starts everything in order (see the top of this file). Returns 0, or an
 * error, logged, with what did start left in `s` for shard_stop. */
static int shard_start(const options *o, shard *s) {
  /* The registry outlives everything that records into it: the core records
   * applies until core_destroy returns (see server/metrics/metrics.h). */
  int rc = metrics_create((uint32_t)o->shard_id, &s->mx);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=metrics error=%s", zs_err_name(rc));
    return rc;
  }
  core_config cc = {
      .shard_id = (uint32_t)o->shard_id,
      .num_shards = (uint32_t)o->shards,
      .threads = (int)o->threads,
      .apply_hist = metrics_apply_histogram(s->mx),
      .trainer_timeout_ms = (uint32_t)o->trainer_timeout_ms,
  };
  rc = core_create(&cc, &s->c);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=core error=%s", zs_err_name(rc));
    return rc;
  }
  rc = start_replica(o, s);
  if (rc)
    return rc;
  /* The replica set hears of every applied step (a join starts at one). */
  service_observer obs = {.applied = replica_on_applied, .arg = s->rep};
  rc = service_create(s->c, s->rep ? &obs : NULL, &s->sv);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=service error=%s", zs_err_name(rc));
    return rc;
  }
  if (s->rep)
    replica_set_service(s->rep, s->sv);
  set_job_limits(o, s->sv);
  rc = start_checkpoints(o, s);
  if (rc == 0)
    rc = start_transports(o, s);
  char err[256] = "";
  if (rc == 0 && s->rep && (rc = replica_start(s->rep, err, sizeof err)) != 0)
    LOG_ERROR("startup_failed", "stage=replica error=%s detail=\"%s\"", zs_err_name(rc), err);
  return rc;
}

/* Stops whatever `s` holds, in the stop order. */
static void shard_stop(shard *s) {
  gsrv_destroy(s->srv);
  /* Scrapes are answered while the gRPC calls drain, then stop before the
   * data plane and the core they read go away. */
  metrics_server_stop(s->msrv);
  /* The data plane serves until the gRPC calls drained; its own connections
   * are then closed (clients retry elsewhere or after the restart), and
   * Pulls it left waiting in the core are released by core_destroy. */
  dp_server_stop(s->dp);
  ckpt_svc_destroy(s->svc);
  /* The replica's forwards ran on the transports' threads, all stopped. */
  replica_destroy(s->rep);
  service_destroy(s->sv);
  core_destroy(s->c);
  metrics_destroy(s->mx);
  auth_keys_free(s->auth);
  tls_ctx_free(s->dp_tls);
  memset(s, 0, sizeof *s);
}

/* Writes the port files, the metrics port first: a reader that waits for
 * --port-file then finds both. Returns 0 or -1, logged. */
static int write_port_files(const options *o, const shard *s) {
  const char *bad_file = NULL;
  if (o->metrics_port_file &&
      write_port_file(o->metrics_port_file, metrics_server_port(s->msrv)) != 0)
    bad_file = o->metrics_port_file;
  else if (o->port_file && write_port_file(o->port_file, gsrv_port(s->srv)) != 0)
    bad_file = o->port_file;
  if (bad_file) {
    LOG_ERROR("startup_failed", "stage=port_file path=%s error=\"%s\"", bad_file, strerror(errno));
    return -1;
  }
  return 0;
}

/* Reads the token files into s->auth and checks that the TLS files are
 * readable PEM, so that a mistake in them is told at once as a usage error
 * rather than as a failed start or a failed handshake. Returns -1 to go on
 * or EXIT_USAGE. */
static int load_security(const options *o, shard *s) {
  char err[600] = "";
  if (auth_keys_new(o->token_file, o->admin_token_file, &s->auth, err, sizeof err) != 0)
    return bad_usage("%s", err);
  /* Without an admin token of its own the trainers' token is the admin's,
   * and the admin role may push as any rank (replica forwards need it). */
  if (o->require_rank_tokens && !o->admin_token_file)
    return bad_usage("%s", "--require-rank-tokens needs --admin-token-file: otherwise the "
                           "trainers' token is the admin's and may push as any rank");
  if (auth_keys_set_rank_key(s->auth, o->rank_key_file, o->require_rank_tokens, err, sizeof err) !=
      0)
    return bad_usage("--rank-key-file: %s", err);
  const char *files[] = {o->tls_cert, o->tls_key, o->tls_client_ca};
  const char *names[] = {"--tls-cert", "--tls-key", "--tls-client-ca"};
  for (int i = 0; i < 3; i++) {
    char *pem = NULL;
    if (files[i] && rpc_read_pem_file(files[i], names[i], &pem, err, sizeof err) != 0)
      return bad_usage("%s", err);
    if (pem) {
      memset(pem, 0, strlen(pem)); /* a key does not linger in freed memory */
      free(pem);
    }
  }
  /* The data plane's context is made here too: OpenSSL checks that the key
   * is the certificate's, and a mismatch is a usage error like the rest. */
  if (o->tls_cert &&
      tls_server_new(o->tls_cert, o->tls_key, o->tls_client_ca, &s->dp_tls, err, sizeof err) != 0)
    return bad_usage("--tls-cert (data plane): %s", err);
  if (o->token_file && !o->admin_token_file)
    LOG_WARN("auth_single_token", "detail=\"the trainers' token is also the admin token: give "
                                  "--admin-token-file to keep Restore, Checkpoint, CloseJob and "
                                  "WriteState from the trainers\"");
  if (!auth_keys_enabled(s->auth) && !o->tls_cert)
    LOG_INFO("security_off",
             "detail=\"no token file and no TLS: anyone who reaches the ports may call every "
             "method (docs/OPERATIONS.md, Security)\"");
  return -1;
}

/* SIGHUP: rereads the token files and the TLS files. Whatever fails to
 * reload keeps what it had; the log says which. */
static void reload_security(const options *o, shard *s) {
  char err[600] = "";
  if (auth_keys_enabled(s->auth)) {
    if (auth_keys_reload(s->auth, err, sizeof err) == 0)
      LOG_INFO("reload", "what=tokens outcome=ok");
    else
      LOG_ERROR("reload", "what=tokens outcome=kept_old detail=\"%s\"", err);
  }
  if (o->tls_cert) {
    /* Both transports take the new files at their next handshake. */
    if (gsrv_reload_tls(s->srv, err, sizeof err) == 0)
      LOG_INFO("reload", "what=grpc_tls outcome=ok detail=\"used from the next handshake\"");
    else
      LOG_ERROR("reload", "what=grpc_tls outcome=kept_old detail=\"%s\"", err);
    if (tls_ctx_reload(s->dp_tls, err, sizeof err) == 0)
      LOG_INFO("reload", "what=data_tls outcome=ok detail=\"used from the next handshake\"");
    else
      LOG_ERROR("reload", "what=data_tls outcome=kept_old detail=\"%s\"", err);
  }
}

/* Raises the soft limit on open files to the hard limit. Every connection,
 * checkpoint file and pipe is a descriptor, and gRPC 1.51's listener stops
 * accepting for good after one accept() that fails with EMFILE (grpc/grpc
 * issues 16058 and 20418): with the usual soft limit of 1024, a few hundred
 * idle connections would silence the shard's gRPC port until a restart. The
 * hard limit is the operator's to raise (LimitNOFILE, ulimit -Hn, the
 * container runtime); the log line tells what the shard runs with. */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    return;
  rlim_t was = rl.rlim_cur;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
      rl.rlim_cur = was;
  }
  if (rl.rlim_cur < 4096)
    LOG_WARN("fd_limit",
             "soft=%llu hard=%llu detail=\"fewer than 4096 descriptors: raise the hard "
             "limit (docs/OPERATIONS.md, Limits)\"",
             (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max);
  else
    LOG_INFO("fd_limit", "soft=%llu hard=%llu was=%llu", (unsigned long long)rl.rlim_cur,
             (unsigned long long)rl.rlim_max, (unsigned long long)was);
}

int main(int argc, char **argv) {
  /* Before any thread exists, so that all of them inherit the mask and the
   * signals reach only sigwait() below. */
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, NULL);
  signal(SIGPIPE, SIG_IGN);
  /* Transfer buffers of 1 MiB and more (gRPC messages, InitParams chunks,
   * data-plane payloads beyond its pool) are mapped and unmapped, never
   * kept: by default glibc raises its mmap threshold each time such a block
   * is freed, after which blocks of that size come from the heap and stay
   * resident, which cost a shard up to 1.9 x its state at peak
   * (docs/PERFORMANCE.md, item 5). A threshold given in the environment
   * (MALLOC_MMAP_THRESHOLD_) wins. */
  if (!getenv("MALLOC_MMAP_THRESHOLD_"))
    mallopt(M_MMAP_THRESHOLD, 1 << 20);

  options o;
  memset(&o, 0, sizeof o);
  int rc = parse_options(argc, argv, &o);
  if (rc >= 0)
    return rc;
  log_set_level(o.level);
  raise_fd_limit();

  shard s = {0};
  rc = load_security(&o, &s);
  if (rc >= 0) {
    auth_keys_free(s.auth);
    tls_ctx_free(s.dp_tls);
    return rc;
  }
  int status = 1;
  if (shard_start(&o, &s) != 0)
    goto out;
  long threads = o.threads > 0 ? o.threads : sysconf(_SC_NPROCESSORS_ONLN);
  LOG_INFO("listening",
           "addr=%s port=%d data_addr=%s data_port=%d shard=%ld shards=%ld threads=%ld isa=%s "
           "tokens=%s tls=%s version=%s",
           o.listen, gsrv_port(s.srv), o.data_listen ? o.data_listen : "off",
           s.dp ? dp_server_port(s.dp) : 0, o.shard_id, o.shards, threads,
           cpu_isa_name(cpu_best_isa()), auth_keys_enabled(s.auth) ? "on" : "off",
           !o.tls_cert       ? "off"
           : o.tls_client_ca ? "mtls"
                             : "on",
           zs_version());
  if (write_port_files(&o, &s) != 0)
    goto out;

  int sig = 0;
  for (;;) {
    if (sigwait(&signals, &sig) != 0)
      continue;
    if (sig != SIGHUP)
      break;
    reload_security(&o, &s);
  }
  LOG_INFO("shutdown", "signal=%s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  status = 0;

out:
  shard_stop(&s);
  if (status == 0)
    LOG_INFO("stopped", "shard=%ld", o.shard_id);
  return status;
}
