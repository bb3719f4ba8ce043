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
 *
 * The settings are read and checked in options.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/base/cpu.h"
#include "common/base/log.h"
#include "common/net/auth.h"
#include "common/net/rpc_client.h"
#include "common/net/tls.h"
#include "server/ckpt/ckpt_svc.h"
#include "server/core/core.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_http.h"
#include "server/options.h"
#include "server/replica/replica.h"
#include "server/service/service.h"
#include "server/transport/dp/dp_server.h"
#include "server/transport/grpc/grpc_server.h"
#include "zshard/types.h"

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
    dc.pacing_mbit = o->tcp_pacing_mbit;
    dc.link_mbit = o->tcp_link_mbit;
    dc.link_notsent_lowat = o->tcp_link_lowat;
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
    return options_bad_usage("%s", err);
  /* Without an admin token of its own the trainers' token is the admin's,
   * and the admin role may push as any rank (replica forwards need it). */
  if (o->require_rank_tokens && !o->admin_token_file)
    return options_bad_usage("%s", "--require-rank-tokens needs --admin-token-file: otherwise the "
                                   "trainers' token is the admin's and may push as any rank");
  if (auth_keys_set_rank_key(s->auth, o->rank_key_file, o->require_rank_tokens, err, sizeof err) !=
      0)
    return options_bad_usage("--rank-key-file: %s", err);
  const char *files[] = {o->tls_cert, o->tls_key, o->tls_client_ca};
  const char *names[] = {"--tls-cert", "--tls-key", "--tls-client-ca"};
  for (int i = 0; i < 3; i++) {
    char *pem = NULL;
    if (files[i] && rpc_read_pem_file(files[i], names[i], &pem, err, sizeof err) != 0)
      return options_bad_usage("%s", err);
    if (pem) {
      memset(pem, 0, strlen(pem)); /* a key does not linger in freed memory */
      free(pem);
    }
  }
  /* The data plane's context is made here too: OpenSSL checks that the key
   * is the certificate's, and a mismatch is a usage error like the rest. */
  if (o->tls_cert &&
      tls_server_new(o->tls_cert, o->tls_key, o->tls_client_ca, &s->dp_tls, err, sizeof err) != 0)
    return options_bad_usage("--tls-cert (data plane): %s", err);
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
  int rc = options_parse(argc, argv, &o);
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
