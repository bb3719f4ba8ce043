/*
 * options — zshard-server's flags and environment variables, read and
 * checked (see options.h): the usage text, the raw settings as given
 * (read_environment, read_flags) and their checks into an `options`
 * (set_endpoints, set_numbers, set_shard_id, set_replicas, set_congestion,
 * set_pacing).
 */
#include "server/options.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/model/spec.h"
#include "common/net/hostport.h"
#include "common/net/stream.h"
#include "server/replica/replica.h"
#include "zshard/types.h"

#define DEFAULT_LISTEN "0.0.0.0:7070"
#define MAX_THREADS 1024

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
          "  --tcp-pacing-mbit N\n"
          "                     cap every data-plane socket's send rate at N Mbit/s\n"
          "                     (SO_MAX_PACING_RATE; ZSHARD_TCP_PACING_MBIT; 0, the\n"
          "                     default: no pacing; at most 100000)\n"
          "  --tcp-link-mbit L  pace the data-plane sockets that are sending at L/n\n"
          "                     Mbit/s each, n the number sending now: L is this host's\n"
          "                     link (ZSHARD_TCP_LINK_MBIT; 0, the default: off; not\n"
          "                     with --tcp-pacing-mbit; docs/OPERATIONS.md)\n"
          "  --help             print this help and exit\n"
          "  --version          print the version and exit\n"
          "\n"
          "A flag wins over its environment variable. SIGTERM or SIGINT stops the\n"
          "server: health turns NOT_SERVING, calls in progress finish, exit status 0.\n"
          "SIGHUP rereads the token and TLS files; on an error the old ones stay.\n",
          DEFAULT_LISTEN);
}

int options_bad_usage(const char *fmt, const char *arg) {
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
  OPT_TCP_PACING_MBIT,
  OPT_TCP_LINK_MBIT,
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
  const char *tcp_pacing_mbit;
  const char *tcp_link_mbit;
  const char *tcp_link_lowat;
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
  r->tcp_pacing_mbit = getenv("ZSHARD_TCP_PACING_MBIT");
  r->tcp_link_mbit = getenv("ZSHARD_TCP_LINK_MBIT");
  r->tcp_link_lowat = getenv("ZSHARD_TCP_LINK_NOTSENT_LOWAT");
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
      {"tcp-pacing-mbit", required_argument, NULL, OPT_TCP_PACING_MBIT},
      {"tcp-link-mbit", required_argument, NULL, OPT_TCP_LINK_MBIT},
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
    case OPT_TCP_PACING_MBIT:
      r->tcp_pacing_mbit = optarg;
      break;
    case OPT_TCP_LINK_MBIT:
      r->tcp_link_mbit = optarg;
      break;
    case OPT_HELP:
      usage(stdout);
      return 0;
    case OPT_VERSION:
      printf("zshard-server %s\n", zs_version());
      return 0;
    case ':':
      return options_bad_usage("option '%s' needs a value", argv[optind - 1]);
    default:
      return options_bad_usage("unknown option '%s'", argv[optind - 1]);
    }
  }
  if (optind < argc)
    return options_bad_usage("unexpected argument '%s'", argv[optind]);
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
    return options_bad_usage("--listen (ZSHARD_LISTEN): %s", why);
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
    return options_bad_usage(
        "%s", "--metrics-port-file (ZSHARD_METRICS_PORT_FILE) needs --metrics-listen");
  o->state_dir = r->state_dir && *r->state_dir ? r->state_dir : NULL;
  o->token_file = r->token_file && *r->token_file ? r->token_file : NULL;
  o->admin_token_file = r->admin_token_file && *r->admin_token_file ? r->admin_token_file : NULL;
  o->rank_key_file = r->rank_key_file && *r->rank_key_file ? r->rank_key_file : NULL;
  o->require_rank_tokens = r->require_rank_tokens;
  o->tls_cert = r->tls_cert && *r->tls_cert ? r->tls_cert : NULL;
  o->tls_key = r->tls_key && *r->tls_key ? r->tls_key : NULL;
  o->tls_client_ca = r->tls_client_ca && *r->tls_client_ca ? r->tls_client_ca : NULL;
  if (!o->tls_cert != !o->tls_key)
    return options_bad_usage("%s", "--tls-cert (ZSHARD_TLS_CERT) and --tls-key (ZSHARD_TLS_KEY) go "
                                   "together");
  if (o->tls_client_ca && !o->tls_cert)
    return options_bad_usage("%s", "--tls-client-ca (ZSHARD_TLS_CLIENT_CA) needs --tls-cert and "
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
      return options_bad_usage(
          "--keep-checkpoints (ZSHARD_KEEP_CHECKPOINTS) must be a whole number from "
          "0 to 1000000, not '%s'",
          r->keep);
  }

  if ((o->max_params = parse_limit(r->max_params, SPEC_MAX_TOTAL_NUMEL)) == -2)
    return options_bad_usage("--max-params (ZSHARD_MAX_PARAMS) must be a whole number from 1 to "
                             "4398046511104, not '%s'",
                             r->max_params);
  if ((o->max_tensors = parse_limit(r->max_tensors, SPEC_MAX_TENSORS)) == -2)
    return options_bad_usage("--max-tensors (ZSHARD_MAX_TENSORS) must be a whole number from 1 to "
                             "1000000, not '%s'",
                             r->max_tensors);

  o->level = LOG_LEVEL_INFO;
  if (r->level && *r->level && log_parse_level(r->level, &o->level) != 0)
    return options_bad_usage(
        "--log-level (ZSHARD_LOG_LEVEL) must be debug, info, warn, error or off, not '%s'",
        r->level);

  o->shards = 1;
  if (r->shards && *r->shards) {
    o->shards = parse_long(r->shards, 1, SPEC_MAX_SHARDS);
    if (o->shards < 0)
      return options_bad_usage(
          "--shards (ZSHARD_SHARDS) must be a whole number from 1 to 4096, not '%s'", r->shards);
  }
  o->threads = 0;
  if (r->threads && *r->threads) {
    o->threads = parse_long(r->threads, 1, MAX_THREADS);
    if (o->threads < 0)
      return options_bad_usage(
          "--threads (ZSHARD_THREADS) must be a whole number from 1 to 1024, not '%s'", r->threads);
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
      return options_bad_usage(
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
      return options_bad_usage("no --shard-id given and the host name '%s' does not end in "
                               "-<ordinal>",
                               host);
  }
  if (o->shard_id >= o->shards) {
    char msg[96];
    snprintf(msg, sizeof msg, "%ld is not below the shard count %ld", o->shard_id, o->shards);
    return options_bad_usage("shard id %s", msg);
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
    return options_bad_usage(
        "--trainer-timeout-ms (ZSHARD_TRAINER_TIMEOUT_MS) must be a whole number "
        "from 0 to 3600000, not '%s'",
        r->trainer_timeout_ms);
  o->failover_ms = REPLICA_DEFAULT_FAILOVER_MS;
  if (r->failover_ms && *r->failover_ms &&
      (o->failover_ms = parse_long(r->failover_ms, 100, 600000)) < 0)
    return options_bad_usage(
        "--failover-ms (ZSHARD_FAILOVER_MS) must be a whole number from 100 to "
        "600000, not '%s'",
        r->failover_ms);
  if (!o->replicas)
    return -1;
  char *addrs[REPLICA_MAX_MEMBERS];
  char why[300];
  int n = replica_parse_members(o->replicas, addrs, REPLICA_MAX_MEMBERS, why, sizeof why);
  if (n < 0)
    return options_bad_usage("%s", why);
  for (int i = 0; i < n; i++)
    free(addrs[i]);
  o->replica_index = r->replica_index ? parse_long(r->replica_index, 0, n - 1) : -1;
  if (o->replica_index < 0)
    return options_bad_usage(
        "--replicas needs --replica-index (ZSHARD_REPLICA_INDEX), this server's "
        "place in the list: 0 to %s",
        n == 2   ? "1"
        : n == 3 ? "2"
                 : "the members' count - 1");
  if (o->tls_cert && !o->peer_ca)
    return options_bad_usage("%s",
                             "a replica with --tls-cert needs the CA of its peers' certificates: "
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
    return options_bad_usage("--tcp-congestion (ZSHARD_TCP_CONGESTION): %s", why);
  return -1;
}

/* The data plane's per-socket pacing rate, Mbit/s (0: none). Returns -1 to
 * go on or EXIT_USAGE. */
static int set_pacing(const raw_options *r, options *o) {
  o->tcp_pacing_mbit = 0;
  char why[200];
  if (r->tcp_pacing_mbit && *r->tcp_pacing_mbit &&
      stream_pacing_parse(r->tcp_pacing_mbit, "--tcp-pacing-mbit (ZSHARD_TCP_PACING_MBIT)",
                          &o->tcp_pacing_mbit, why, sizeof why) != 0)
    return options_bad_usage("%s", why);
  o->tcp_link_mbit = 0;
  if (r->tcp_link_mbit && *r->tcp_link_mbit &&
      stream_pacing_parse(r->tcp_link_mbit, "--tcp-link-mbit (ZSHARD_TCP_LINK_MBIT)",
                          &o->tcp_link_mbit, why, sizeof why) != 0)
    return options_bad_usage("%s", why);
  if (o->tcp_link_mbit && o->tcp_pacing_mbit)
    return options_bad_usage("%s", "--tcp-link-mbit (pacing that follows the sockets sending) "
                                   "and --tcp-pacing-mbit (a fixed rate) exclude each other");
  /* The kernel's unsent bytes per paced socket (stream.h, "Link pacing"):
   * a knob for measurements, documented in docs/OPERATIONS.md. */
  o->tcp_link_lowat = STREAM_PACER_NOTSENT_LOWAT;
  if (r->tcp_link_lowat && *r->tcp_link_lowat &&
      stream_pacer_lowat_parse(r->tcp_link_lowat, "ZSHARD_TCP_LINK_NOTSENT_LOWAT",
                               &o->tcp_link_lowat, why, sizeof why) != 0)
    return options_bad_usage("%s", why);
  return -1;
}

/* Fills `o` from the flags and the environment. Returns -1 to go on, or the
 * exit status (0 after --help/--version, EXIT_USAGE on a bad flag). The
 * checks run in a fixed order, so a command line with several mistakes is
 * always told about the same one first. */
int options_parse(int argc, char **argv, options *o) {
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
  if (rc < 0)
    rc = set_pacing(&r, o);
  return rc;
}
