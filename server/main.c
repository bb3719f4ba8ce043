/*
 * zshard-server — one shard server: the shard core behind the gRPC transport.
 *
 * Threads: main blocks SIGTERM and SIGINT before any other thread exists (so
 * every thread inherits the mask), starts the core and the transport, and
 * then waits in sigwait(); the signal is handled there, in ordinary code,
 * never in a signal handler. The core, the transports and the metrics endpoint
 * own their threads (see server/core.h, server/grpc_server.c,
 * server/dp_server.c and server/metrics_http.c).
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
#include <unistd.h>

#include "common/cpu.h"
#include "common/hostport.h"
#include "common/log.h"
#include "common/spec.h"
#include "server/ckpt_svc.h"
#include "server/core.h"
#include "server/dp_server.h"
#include "server/grpc_server.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/service.h"
#include "zshard/zshard.h"

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
  long long max_params, max_tensors; /* -1: derived from the memory limit */
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
          "                     image sets 0.0.0.0:7090); port 0 picks a free port\n"
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
          "  --max-params P     refuse a job that puts more than P parameters on this\n"
          "                     shard (ZSHARD_MAX_PARAMS; default: 3/4 of the memory\n"
          "                     limit at 32 bytes each)\n"
          "  --max-tensors T    refuse a job of more than T tensors (ZSHARD_MAX_TENSORS;\n"
          "                     default: 1/16 of the memory limit at 1 KiB each)\n"
          "  --help             print this help and exit\n"
          "  --version          print the version and exit\n"
          "\n"
          "A flag wins over its environment variable. SIGTERM or SIGINT stops the\n"
          "server: health turns NOT_SERVING, calls in progress finish, exit status 0.\n",
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
  OPT_MAX_PARAMS,
  OPT_MAX_TENSORS,
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
  const char *max_params, *max_tensors;
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
  r->max_params = getenv("ZSHARD_MAX_PARAMS");
  r->max_tensors = getenv("ZSHARD_MAX_TENSORS");
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
      {"max-params", required_argument, NULL, OPT_MAX_PARAMS},
      {"max-tensors", required_argument, NULL, OPT_MAX_TENSORS},
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
    case OPT_MAX_PARAMS:
      r->max_params = optarg;
      break;
    case OPT_MAX_TENSORS:
      r->max_tensors = optarg;
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
  o->metrics_port_file =
      r->metrics_port_file && *r->metrics_port_file ? r->metrics_port_file : NULL;
  if (o->metrics_port_file && !o->metrics_listen)
    return bad_usage("%s", "--metrics-port-file (ZSHARD_METRICS_PORT_FILE) needs --metrics-listen");
  o->state_dir = r->state_dir && *r->state_dir ? r->state_dir : NULL;
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

/* Fills `o` from the flags and the environment. Returns -1 to go on, or the
 * exit status (0 after --help/--version, EXIT_USAGE on a bad flag). The
 * checks run in a fixed order, so a command line with several mistakes is
 * always told about the same one first. */
static int parse_options(int argc, char **argv, options *o) {
  raw_options r;
  read_environment(&r);
  int rc = read_flags(argc, argv, &r);
  if (rc < 0)
    rc = set_endpoints(&r, o);
  if (rc < 0)
    rc = set_numbers(&r, o);
  if (rc < 0)
    rc = set_shard_id(&r, o);
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
    rc = dp_server_start(&dc, &s->dp, err, sizeof err);
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
                    .data_port = s->dp ? (uint32_t)dp_server_port(s->dp) : 0};
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

/* Starts everything in order (see the top of this file). Returns 0, or an
 * error, logged, with what did start left in `s` for shard_stop. */
static int shard_start(const options *o, shard *s) {
  /* The registry outlives everything that records into it: the core records
   * applies until core_destroy returns (see server/metrics.h). */
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
  };
  rc = core_create(&cc, &s->c);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=core error=%s", zs_err_name(rc));
    return rc;
  }
  /* Nobody observes the service's hooks yet. */
  rc = service_create(s->c, NULL, &s->sv);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=service error=%s", zs_err_name(rc));
    return rc;
  }
  set_job_limits(o, s->sv);
  rc = start_checkpoints(o, s);
  if (rc == 0)
    rc = start_transports(o, s);
  return rc;
}

/* Stops whatever `s` holds, in the stop order. */
static void shard_stop(shard *s) {
  gsrv_destroy(s->srv);
  /* The data plane serves until the gRPC calls drained; its own connections
   * are then closed (clients retry elsewhere or after the restart), and
   * Pulls it left waiting in the core are released by core_destroy. */
  dp_server_stop(s->dp);
  /* Scrapes are answered while the gRPC calls drain, then stop before the
   * core they read goes away. */
  metrics_server_stop(s->msrv);
  ckpt_svc_destroy(s->svc);
  service_destroy(s->sv);
  core_destroy(s->c);
  metrics_destroy(s->mx);
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

int main(int argc, char **argv) {
  /* Before any thread exists, so that all of them inherit the mask and the
   * signals reach only sigwait() below. */
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);
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

  shard s = {0};
  int status = 1;
  if (shard_start(&o, &s) != 0)
    goto out;
  long threads = o.threads > 0 ? o.threads : sysconf(_SC_NPROCESSORS_ONLN);
  LOG_INFO("listening",
           "addr=%s port=%d data_addr=%s data_port=%d shard=%ld shards=%ld threads=%ld isa=%s "
           "version=%s",
           o.listen, gsrv_port(s.srv), o.data_listen ? o.data_listen : "off",
           s.dp ? dp_server_port(s.dp) : 0, o.shard_id, o.shards, threads,
           cpu_isa_name(cpu_best_isa()), zs_version());
  if (write_port_files(&o, &s) != 0)
    goto out;

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  LOG_INFO("shutdown", "signal=%s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  status = 0;

out:
  shard_stop(&s);
  if (status == 0)
    LOG_INFO("stopped", "shard=%ld", o.shard_id);
  return status;
}
