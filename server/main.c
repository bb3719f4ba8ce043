/*
 * zshard-server — one shard server: the shard core behind the gRPC transport.
 *
 * Threads: main blocks SIGTERM and SIGINT before any other thread exists (so
 * every thread inherits the mask), starts the core and the transport, and
 * then waits in sigwait(); the signal is handled there, in ordinary code,
 * never in a signal handler. The core, the transports and the metrics endpoint
 * own their threads (see server/core.h, server/grpc_server.c,
 * server/dp_server.c and server/metrics.c).
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
  OPT_HELP,
  OPT_VERSION
};

/* Fills `o` from the flags and the environment. Returns -1 to go on, or the
 * exit status (0 after --help/--version, EXIT_USAGE on a bad flag). */
static int parse_options(int argc, char **argv, options *o) {
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
      {"help", no_argument, NULL, OPT_HELP},
      {"version", no_argument, NULL, OPT_VERSION},
      {NULL, 0, NULL, 0},
  };
  const char *listen = getenv("ZSHARD_LISTEN");
  const char *shard_id = getenv("ZSHARD_SHARD_ID");
  const char *shards = getenv("ZSHARD_SHARDS");
  const char *threads = getenv("ZSHARD_THREADS");
  const char *level = getenv("ZSHARD_LOG_LEVEL");
  const char *port_file = getenv("ZSHARD_PORT_FILE");
  const char *hostname = getenv("ZSHARD_HOSTNAME");
  const char *metrics_listen = getenv("ZSHARD_METRICS_LISTEN");
  const char *metrics_port_file = getenv("ZSHARD_METRICS_PORT_FILE");
  const char *state_dir = getenv("ZSHARD_STATE_DIR");
  const char *keep = getenv("ZSHARD_KEEP_CHECKPOINTS");
  const char *data_listen = getenv("ZSHARD_DATA_LISTEN");

  opterr = 0; /* our own messages */
  int ch;
  while ((ch = getopt_long(argc, argv, ":", longopts, NULL)) != -1) {
    switch (ch) {
    case OPT_LISTEN:
      listen = optarg;
      break;
    case OPT_SHARD_ID:
      shard_id = optarg;
      break;
    case OPT_SHARDS:
      shards = optarg;
      break;
    case OPT_THREADS:
      threads = optarg;
      break;
    case OPT_LOG_LEVEL:
      level = optarg;
      break;
    case OPT_PORT_FILE:
      port_file = optarg;
      break;
    case OPT_HOSTNAME:
      hostname = optarg;
      break;
    case OPT_METRICS_LISTEN:
      metrics_listen = optarg;
      break;
    case OPT_METRICS_PORT_FILE:
      metrics_port_file = optarg;
      break;
    case OPT_DATA_LISTEN:
      data_listen = optarg;
      break;
    case OPT_STATE_DIR:
      state_dir = optarg;
      break;
    case OPT_KEEP_CHECKPOINTS:
      keep = optarg;
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

  o->listen = listen && *listen ? listen : DEFAULT_LISTEN;
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
  o->port_file = port_file && *port_file ? port_file : NULL;
  o->hostname = hostname && *hostname ? hostname : NULL;
  /* "off" (or nothing) turns the endpoint off, so a deployment can switch it
   * off over a variable set by the image. */
  o->metrics_listen = metrics_listen && *metrics_listen && strcmp(metrics_listen, "off") != 0
                          ? metrics_listen
                          : NULL;
  o->metrics_port_file = metrics_port_file && *metrics_port_file ? metrics_port_file : NULL;
  if (o->metrics_port_file && !o->metrics_listen)
    return bad_usage("%s", "--metrics-port-file (ZSHARD_METRICS_PORT_FILE) needs --metrics-listen");
  o->state_dir = state_dir && *state_dir ? state_dir : NULL;
  o->keep_checkpoints = 0;
  if (keep && *keep) {
    o->keep_checkpoints = parse_long(keep, 0, 1000000);
    if (o->keep_checkpoints < 0)
      return bad_usage("--keep-checkpoints (ZSHARD_KEEP_CHECKPOINTS) must be a whole number from "
                       "0 to 1000000, not '%s'",
                       keep);
  }

  o->level = LOG_LEVEL_INFO;
  if (level && *level && log_parse_level(level, &o->level) != 0)
    return bad_usage(
        "--log-level (ZSHARD_LOG_LEVEL) must be debug, info, warn, error or off, not '%s'", level);

  o->shards = 1;
  if (shards && *shards) {
    o->shards = parse_long(shards, 1, SPEC_MAX_SHARDS);
    if (o->shards < 0)
      return bad_usage("--shards (ZSHARD_SHARDS) must be a whole number from 1 to 4096, not '%s'",
                       shards);
  }
  o->threads = 0;
  if (threads && *threads) {
    o->threads = parse_long(threads, 1, MAX_THREADS);
    if (o->threads < 0)
      return bad_usage("--threads (ZSHARD_THREADS) must be a whole number from 1 to 1024, not '%s'",
                       threads);
  }

  if (shard_id && *shard_id) {
    o->shard_id = parse_long(shard_id, 0, SPEC_MAX_SHARDS - 1);
    if (o->shard_id < 0)
      return bad_usage(
          "--shard-id (ZSHARD_SHARD_ID) must be a whole number from 0 to 4095, not '%s'", shard_id);
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

  /* The registry outlives everything that records into it: the core records
   * applies until core_destroy returns (see server/metrics.h). */
  metrics *mx = NULL;
  rc = metrics_create((uint32_t)o.shard_id, &mx);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=metrics error=%s", zs_err_name(rc));
    return 1;
  }
  core_config cc = {
      .shard_id = (uint32_t)o.shard_id,
      .num_shards = (uint32_t)o.shards,
      .threads = (int)o.threads,
      .apply_hist = metrics_apply_histogram(mx),
  };
  core *c = NULL;
  rc = core_create(&cc, &c);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=core error=%s", zs_err_name(rc));
    metrics_destroy(mx);
    return 1;
  }

  char err[256] = "";
  /* The checkpoint is loaded before any transport starts, so that no
   * trainer ever sees this shard empty when its state directory is not. */
  ckpt_svc *svc = NULL;
  if (o.state_dir) {
    ckpt_svc_config kc = {
        .state_dir = o.state_dir, .core = c, .keep = (uint32_t)o.keep_checkpoints};
    char kerr[700] = "";
    int loaded = 0;
    uint64_t step = 0;
    rc = ckpt_svc_create(&kc, &svc, kerr, sizeof kerr);
    if (rc == 0)
      rc = ckpt_svc_load_latest(svc, &loaded, &step, kerr, sizeof kerr);
    if (rc) {
      LOG_ERROR("startup_failed", "stage=checkpoint dir=%s error=%s detail=\"%s\"", o.state_dir,
                zs_err_name(rc), kerr);
      ckpt_svc_destroy(svc);
      core_destroy(c);
      metrics_destroy(mx);
      return 1;
    }
  }
  /* Before gRPC, whose GetInfo advertises the data port from its first
   * answer on. */
  dp_server *dp = NULL;
  if (o.data_listen) {
    dp_server_config dc;
    dp_server_config_init(&dc);
    dc.listen = o.data_listen;
    dc.core = c;
    dc.metrics = mx;
    rc = dp_server_start(&dc, &dp, err, sizeof err);
    if (rc) {
      LOG_ERROR("startup_failed", "stage=data_plane addr=%s error=%s detail=\"%s\"", o.data_listen,
                zs_err_name(rc), err);
      ckpt_svc_destroy(svc);
      core_destroy(c);
      metrics_destroy(mx);
      return 1;
    }
  }
  gsrv_config gc = {.listen = o.listen,
                    .core = c,
                    .ckpt = svc,
                    .metrics = mx,
                    .data_port = dp ? (uint32_t)dp_server_port(dp) : 0};
  gsrv *srv = NULL;
  rc = gsrv_start(&gc, &srv, err, sizeof err);
  if (rc) {
    LOG_ERROR("startup_failed", "stage=grpc error=%s detail=\"%s\"", zs_err_name(rc), err);
    dp_server_stop(dp);
    ckpt_svc_destroy(svc);
    core_destroy(c);
    metrics_destroy(mx);
    return 1;
  }
  metrics_server *msrv = NULL;
  if (o.metrics_listen) {
    metrics_server_config mc = {.listen = o.metrics_listen, .metrics = mx, .core = c};
    rc = metrics_server_start(&mc, &msrv, err, sizeof err);
    if (rc) {
      LOG_ERROR("startup_failed", "stage=metrics error=%s detail=\"%s\"", zs_err_name(rc), err);
      gsrv_destroy(srv);
      dp_server_stop(dp);
      ckpt_svc_destroy(svc);
      core_destroy(c);
      metrics_destroy(mx);
      return 1;
    }
    LOG_INFO("metrics_listening", "addr=%s port=%d path=/metrics", o.metrics_listen,
             metrics_server_port(msrv));
  }
  long threads = o.threads > 0 ? o.threads : sysconf(_SC_NPROCESSORS_ONLN);
  LOG_INFO("listening",
           "addr=%s port=%d data_addr=%s data_port=%d shard=%ld shards=%ld threads=%ld isa=%s "
           "version=%s",
           o.listen, gsrv_port(srv), o.data_listen ? o.data_listen : "off",
           dp ? dp_server_port(dp) : 0, o.shard_id, o.shards, threads, cpu_isa_name(cpu_best_isa()),
           zs_version());
  /* The metrics port first: a reader that waits for --port-file then finds
   * both. */
  const char *bad_file = NULL;
  if (o.metrics_port_file && write_port_file(o.metrics_port_file, metrics_server_port(msrv)) != 0)
    bad_file = o.metrics_port_file;
  else if (o.port_file && write_port_file(o.port_file, gsrv_port(srv)) != 0)
    bad_file = o.port_file;
  if (bad_file) {
    LOG_ERROR("startup_failed", "stage=port_file path=%s error=\"%s\"", bad_file, strerror(errno));
    gsrv_destroy(srv);
    dp_server_stop(dp);
    metrics_server_stop(msrv);
    ckpt_svc_destroy(svc);
    core_destroy(c);
    metrics_destroy(mx);
    return 1;
  }

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  LOG_INFO("shutdown", "signal=%s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  gsrv_destroy(srv);
  /* The data plane serves until the gRPC calls drained; its own connections
   * are then closed (clients retry elsewhere or after the restart), and
   * Pulls it left waiting in the core are released by core_destroy. */
  dp_server_stop(dp);
  /* Scrapes are answered while the gRPC calls drain, then stop before the
   * core they read goes away. */
  metrics_server_stop(msrv);
  ckpt_svc_destroy(svc);
  core_destroy(c);
  metrics_destroy(mx);
  LOG_INFO("stopped", "shard=%ld", o.shard_id);
  return 0;
}
