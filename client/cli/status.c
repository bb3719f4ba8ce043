/*
 * status — `zshard status`: one row per shard with its id, address, health
 * (grpc.health.v1 Check), job, parameter version, state bytes, uptime and,
 * in JSON, the pieces and elements the shard owns (zshard.v1 GetInfo),
 * throughput and resident memory (zshard.v1 Stats). A replicated shard
 * ("h:p|h:p" in --shards) has one row per member of its replica set, with
 * the member's ROLE and TERM (GetInfo.replica); those columns appear when a
 * shard is replicated. Every server is asked in parallel, one thread each,
 * so a cluster with dead shards answers within one timeout.
 *
 * Throughput is the difference of two Stats samples of the same shard over
 * the time between them: --sample-ms apart for the first table, the period
 * of --watch for the next ones.
 *
 * Exit status: 0 when every shard is SERVING (in the last table, with
 * --watch), 1 otherwise, 2 on bad usage. The container health check relies
 * on it.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "cli_support.h"
#include "common/base/clock.h"
#include "common/model/spec.h"
#include "grpc/health/v1/health.pb-c.h"
#include "zshard/v1/zshard.pb-c.h"

typedef struct shard_row {
  const char *addr;
  uint32_t timeout_ms;
  /* The shard this row is of and, for a replica set, which member of its
   * nmembers (1: not replicated). */
  uint32_t shard, member, nmembers;
  int health_rc, info_rc, stats_rc;
  int serving; /* the health answer: 1 SERVING, 2 NOT_SERVING, ... */
  char health_err[512], info_err[512];
  uint32_t shard_id, num_shards;
  char job[SPEC_MAX_NAME + 1];
  uint64_t version, state_bytes;
  uint32_t pieces;   /* the job's pieces this shard owns */
  uint64_t elements; /* their parameters */
  double uptime_s;
  int has_info;
  /* GetInfo.replica, when has_replica: the member's view of its set. */
  int has_replica;
  int role; /* Zshard__V1__ReplicaRole */
  uint64_t term, failovers;
  int32_t primary;
  /* Why the member refuses to form a set with its peers (their --replicas
   * lists differ from its own); "": none. The server's text, sanitized. */
  char config_error[256];
  /* From Stats, when has_stats: counters since the server started. */
  int has_stats;
  uint64_t pushes, pulls, bytes_in, bytes_out, rss_bytes;
  uint32_t waiting_pulls, waiting_stats;
  /* The membership (Stats): members of world_size, when trainer_timeout_ms. */
  uint32_t members, world_size, trainer_timeout_ms;
  uint64_t membership_epoch, member_leaves, trainer_timeouts, member_joins;
  char member_log[4096]; /* "from_step:ranks;..." (Stats.member_log) */
  uint64_t sampled_ns;   /* clock_now_ns() when the Stats answer arrived */
  /* Per second since the previous sample of the same shard, when
   * has_rates. */
  int has_rates;
  double push_rate, in_rate, out_rate;
} shard_row;

static void sanitize(char *s);

static void *ask_shard(void *arg) {
  shard_row *r = arg;
  rpc_channel *ch = NULL;
  r->health_rc = r->info_rc = r->stats_rc = zc_channel_open_env(r->addr, &ch);
  if (!ch) {
    snprintf(r->health_err, sizeof r->health_err, "%s", zs_last_error());
    return NULL;
  }
  rpc_status st;
  Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  hreq.service = "";
  Grpc__Health__V1__HealthCheckResponse *hresp = NULL;
  r->health_rc = rpc_call(ch, "/grpc.health.v1.Health/Check", &hreq.base,
                          &grpc__health__v1__health_check_response__descriptor,
                          (ProtobufCMessage **)&hresp, r->timeout_ms, &st);
  if (r->health_rc == ZS_OK) {
    r->serving = (int)hresp->status;
    protobuf_c_message_free_unpacked(&hresp->base, NULL);
  } else {
    snprintf(r->health_err, sizeof r->health_err, "%s", st.message);
  }
  Zshard__V1__GetInfoRequest ireq = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  Zshard__V1__GetInfoResponse *info = NULL;
  r->info_rc = rpc_call(ch, "/zshard.v1.ZShard/GetInfo", &ireq.base,
                        &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)&info,
                        r->timeout_ms, &st);
  if (r->info_rc == ZS_OK) {
    r->has_info = 1;
    r->shard_id = info->shard_id;
    r->num_shards = info->num_shards;
    /* The job name is the server's string: printed bounded and escaped. */
    snprintf(r->job, sizeof r->job, "%s", info->job ? info->job : "");
    r->version = info->version;
    r->state_bytes = info->state_bytes;
    r->pieces = info->pieces;
    r->elements = info->elements;
    r->uptime_s = info->uptime_s;
    if (info->replica) {
      r->has_replica = 1;
      r->role = (int)info->replica->role;
      r->term = info->replica->term;
      r->primary = info->replica->primary;
      r->failovers = info->replica->failovers;
      snprintf(r->config_error, sizeof r->config_error, "%s",
               info->replica->config_error ? info->replica->config_error : "");
      sanitize(r->config_error);
    }
    protobuf_c_message_free_unpacked(&info->base, NULL);
  } else {
    snprintf(r->info_err, sizeof r->info_err, "%s", st.message);
  }
  /* A shard that could not say GetInfo will not say Stats either: one
   * timeout per dead shard is enough. */
  r->stats_rc = r->info_rc;
  if (r->info_rc == ZS_OK) {
    Zshard__V1__StatsRequest sreq = ZSHARD__V1__STATS_REQUEST__INIT;
    Zshard__V1__StatsResponse *stats = NULL;
    r->stats_rc =
        rpc_call(ch, "/zshard.v1.ZShard/Stats", &sreq.base, &zshard__v1__stats_response__descriptor,
                 (ProtobufCMessage **)&stats, r->timeout_ms, &st);
    if (r->stats_rc == ZS_OK) {
      r->sampled_ns = clock_now_ns();
      r->has_stats = 1;
      r->pushes = stats->pushes;
      r->pulls = stats->pulls;
      r->bytes_in = stats->bytes_in;
      r->bytes_out = stats->bytes_out;
      r->rss_bytes = stats->rss_bytes;
      r->waiting_pulls = stats->waiting_pulls;
      r->waiting_stats = stats->waiting_stats;
      r->members = stats->members;
      r->world_size = stats->world_size;
      r->trainer_timeout_ms = stats->trainer_timeout_ms;
      r->membership_epoch = stats->membership_epoch;
      r->member_leaves = stats->member_leaves;
      r->trainer_timeouts = stats->trainer_timeouts;
      r->member_joins = stats->member_joins;
      snprintf(r->member_log, sizeof r->member_log, "%s",
               stats->member_log ? stats->member_log : "");
      protobuf_c_message_free_unpacked(&stats->base, NULL);
    }
  }
  rpc_channel_close(ch);
  return NULL;
}

/* Rates of `cur` over the time since `prev`, a sample of the same shard.
 * None across a restart of the server (its counters start again from 0). */
static void compute_rates(shard_row *cur, const shard_row *prev) {
  cur->has_rates = 0;
  if (!prev || !cur->has_stats || !prev->has_stats || cur->sampled_ns <= prev->sampled_ns)
    return;
  if (cur->pushes < prev->pushes || cur->bytes_in < prev->bytes_in ||
      cur->bytes_out < prev->bytes_out || cur->uptime_s < prev->uptime_s)
    return;
  double dt = (double)(cur->sampled_ns - prev->sampled_ns) / 1e9;
  cur->push_rate = (double)(cur->pushes - prev->pushes) / dt;
  cur->in_rate = (double)(cur->bytes_in - prev->bytes_in) / dt;
  cur->out_rate = (double)(cur->bytes_out - prev->bytes_out) / dt;
  cur->has_rates = 1;
}

static const char *role_name(const shard_row *r) {
  if (!r->has_replica)
    return "-";
  switch (r->role) {
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_STARTING:
    return "STARTING";
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_PRIMARY:
    return "PRIMARY";
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_BACKUP:
    return "BACKUP";
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_JOINING:
    return "JOINING";
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_STALE:
    return "STALE";
  case ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_NONE:
    return "NONE";
  default:
    return "UNKNOWN";
  }
}

static const char *health_name(const shard_row *r) {
  if (r->health_rc != ZS_OK)
    return "UNREACHABLE";
  switch (r->serving) {
  case 1:
    return "SERVING";
  case 2:
    return "NOT_SERVING";
  default:
    return "UNKNOWN";
  }
}

static void uptime(double s, char *buf, size_t len) {
  if (s < 0 || s != s)
    s = 0;
  uint64_t t = (uint64_t)s;
  if (t < 60)
    snprintf(buf, len, "%" PRIu64 "s", t);
  else if (t < 3600)
    snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", t / 60, t % 60);
  else if (t < 86400)
    snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m", t / 3600, (t / 60) % 60);
  else
    snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h", t / 86400, (t / 3600) % 24);
}

/* Writes s as a JSON string literal. */
static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p < 0x20)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

/* Job names come from the network: control characters are not printed raw. */
static void sanitize(char *s) {
  for (; *s; s++)
    if ((unsigned char)*s < 0x20 || *s == 0x7f)
      *s = '?';
}

static void status_usage(FILE *f) {
  fprintf(f, "usage: zshard status --shards ADDR[,ADDR...] [--num-shards N] [--timeout-ms T]\n"
             "                     [--sample-ms MS] [--watch [SECONDS]] [--count N] [--json]\n"
             "  --shards      shard addresses in shard-id order, or a pattern with {i};\n"
             "                a replicated shard lists its members separated by '|'\n"
             "                and gets one row per member, with its ROLE and TERM (and,\n"
             "                when its peers' --replicas lists differ from its own, why it\n"
             "                refuses to form a set: config_error in --json)\n"
             "  --num-shards  the number of shards, with a pattern\n"
             "  --timeout-ms  per call (default 2000)\n"
             "  --sample-ms   measure the throughput columns over this long: every shard's\n"
             "                counters are read twice, MS apart (default 1000; 0: read once,\n"
             "                no throughput in the first table)\n"
             "  --watch [S]   print the table again every S seconds (default 2), with the\n"
             "                throughput since the previous one; on a terminal the screen\n"
             "                is cleared first, otherwise the tables follow one another\n"
             "  --count N     stop after N tables (implies --watch)\n"
             "  --json        a JSON document instead of the table (one per line with\n"
             "                --watch)\n"
             "\n"
             "Exit status: 0 when every shard (every member of a replicated one) answered\n"
             "SERVING (in the last table, with --watch), 1 otherwise, 2 on bad usage.\n");
}

/* Asks every shard in parallel, one thread each, so that a cluster with dead
 * shards answers within one timeout. Fills rows[i] (addr and timeout_ms set,
 * the rest zero). */
static void ask_all(shard_row *rows, uint32_t n, pthread_t *th, int *started) {
  for (uint32_t i = 0; i < n; i++) {
    started[i] = pthread_create(&th[i], NULL, ask_shard, &rows[i]) == 0;
    if (!started[i])
      ask_shard(&rows[i]); /* no thread: ask from here */
  }
  for (uint32_t i = 0; i < n; i++)
    if (started[i])
      pthread_join(th[i], NULL);
}

static void sleep_ms(uint64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* "1.2 MiB/s", or "-" without a rate. */
static void rate_bytes(const shard_row *r, double v, char *buf, size_t len) {
  if (!r->has_rates) {
    snprintf(buf, len, "-");
    return;
  }
  char b[32];
  snprintf(buf, len, "%s/s", cli_bytes(v, b, sizeof b));
}

static void print_json(const shard_row *rows, uint32_t n, int all_serving) {
  printf("{\"shards\":[");
  for (uint32_t i = 0; i < n; i++) {
    const shard_row *r = &rows[i];
    printf("%s{\"index\":%" PRIu32 ",\"address\":", i ? "," : "", r->shard);
    json_str(stdout, r->addr);
    printf(",\"health\":\"%s\"", health_name(r));
    if (r->nmembers > 1) {
      printf(",\"member\":%" PRIu32 ",\"members\":%" PRIu32, r->member, r->nmembers);
      if (r->has_replica)
        printf(",\"role\":\"%s\",\"term\":%" PRIu64 ",\"primary\":%" PRId32
               ",\"failovers\":%" PRIu64,
               role_name(r), r->term, r->primary, r->failovers);
      if (r->has_replica) {
        printf(",\"config_error\":");
        json_str(stdout, r->config_error);
      }
    }
    if (r->has_info) {
      printf(",\"shard_id\":%" PRIu32 ",\"num_shards\":%" PRIu32 ",\"job\":", r->shard_id,
             r->num_shards);
      json_str(stdout, r->job);
      printf(",\"version\":%" PRIu64 ",\"state_bytes\":%" PRIu64 ",\"pieces\":%" PRIu32
             ",\"elements\":%" PRIu64 ",\"uptime_s\":%.3f",
             r->version, r->state_bytes, r->pieces, r->elements, r->uptime_s);
      if (r->has_stats)
        printf(",\"pushes\":%" PRIu64 ",\"pulls\":%" PRIu64 ",\"bytes_in\":%" PRIu64
               ",\"bytes_out\":%" PRIu64 ",\"rss_bytes\":%" PRIu64 ",\"waiting_pulls\":%" PRIu32
               ",\"waiting_stats\":%" PRIu32,
               r->pushes, r->pulls, r->bytes_in, r->bytes_out, r->rss_bytes, r->waiting_pulls,
               r->waiting_stats);
      if (r->has_stats)
        printf(",\"members\":%" PRIu32 ",\"world_size\":%" PRIu32 ",\"trainer_timeout_ms\":%" PRIu32
               ",\"membership_epoch\":%" PRIu64 ",\"member_leaves\":%" PRIu64
               ",\"trainer_timeouts\":%" PRIu64 ",\"member_joins\":%" PRIu64 ",\"member_log\":",
               r->members, r->world_size, r->trainer_timeout_ms, r->membership_epoch,
               r->member_leaves, r->trainer_timeouts, r->member_joins);
      if (r->has_stats)
        json_str(stdout, r->member_log); /* the shard's text: escaped */
      if (r->has_rates)
        printf(",\"pushes_per_s\":%.9g,\"bytes_in_per_s\":%.9g,\"bytes_out_per_s\":%.9g",
               r->push_rate, r->in_rate, r->out_rate);
    } else {
      printf(",\"error\":");
      json_str(stdout, r->info_err[0] ? r->info_err : r->health_err);
    }
    printf("}");
  }
  printf("],\"all_serving\":%s}\n", all_serving ? "true" : "false");
}

static void print_table(const shard_row *rows, uint32_t n) {
  int replicated = 0, elastic = 0;
  for (uint32_t i = 0; i < n; i++) {
    replicated |= rows[i].nmembers > 1;
    elastic |= rows[i].has_stats && rows[i].trainer_timeout_ms > 0;
  }
  printf("%-5s %-24s %-12s ", "ID", "ADDRESS", "HEALTH");
  if (replicated)
    printf("%-9s %5s ", "ROLE", "TERM");
  printf("%-16s %8s %8s %11s %11s %10s %10s %8s\n", "JOB", "VERSION", "PUSHES/S", "IN/S", "OUT/S",
         "STATE", "RSS", "UPTIME");
  for (uint32_t i = 0; i < n; i++) {
    const shard_row *r = &rows[i];
    char id[16] = "?", ver[24] = "-", state[32] = "-", up[32] = "-", rss[32] = "-";
    char pushes[32] = "-", in[40], out[40];
    if (r->has_info) {
      snprintf(id, sizeof id, "%" PRIu32, r->shard_id);
      snprintf(ver, sizeof ver, "%" PRIu64, r->version);
      cli_bytes((double)r->state_bytes, state, sizeof state);
      uptime(r->uptime_s, up, sizeof up);
    }
    if (r->has_stats && r->rss_bytes > 0)
      cli_bytes((double)r->rss_bytes, rss, sizeof rss);
    if (r->has_rates)
      snprintf(pushes, sizeof pushes, "%.1f", r->push_rate);
    rate_bytes(r, r->in_rate, in, sizeof in);
    rate_bytes(r, r->out_rate, out, sizeof out);
    printf("%-5s %-24.24s %-12s ", id, r->addr, health_name(r));
    if (replicated) {
      char term[24] = "-";
      if (r->has_replica && r->term > 0)
        snprintf(term, sizeof term, "%" PRIu64, r->term);
      printf("%-9s %5s ", r->nmembers > 1 ? role_name(r) : "-", r->nmembers > 1 ? term : "-");
    }
    printf("%-16.16s %8s %8s %11s %11s %10s %10s %8s", r->has_info && r->job[0] ? r->job : "-", ver,
           pushes, in, out, state, rss, up);
    if (elastic && r->has_stats && r->world_size > 0)
      printf("  members %" PRIu32 "/%" PRIu32 " epoch %" PRIu64 " left %" PRIu64 " joined %" PRIu64,
             r->members, r->world_size, r->membership_epoch, r->member_leaves, r->member_joins);
    if (!r->has_info)
      printf("  (%s)", r->info_err[0] ? r->info_err : r->health_err);
    else if (r->shard_id != r->shard)
      printf("  (listed at position %" PRIu32 ")", r->shard);
    if (r->has_replica && r->config_error[0])
      printf("  (refuses to form a set: %s)", r->config_error);
    printf("\n");
  }
}

/* --watch's period: a number of seconds from 0.1 to one day. */
static int parse_seconds(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end || errno || !(v >= 0.1 && v <= 86400))
    return -1;
  *out = v;
  return 0;
}

/* The rows to ask: one per shard of addr (nshards of them), one per member
 * of a replicated one, into *rows (each with its address, which points into
 * *members, and timeout) and *n. Returns 0, or -1 after printing why. */
static int make_rows(char **addr, uint32_t nshards, uint32_t timeout_ms, shard_row **rows,
                     char ***members, uint32_t *n) {
  *rows = NULL;
  *members = NULL;
  *n = 0;
  char **m[SPEC_MAX_SHARDS];
  uint32_t nm[SPEC_MAX_SHARDS], total = 0, i;
  for (i = 0; i < nshards; i++) {
    if (zc_shard_members(addr[i], &m[i], &nm[i]) != ZS_OK)
      break;
    total += nm[i];
  }
  shard_row *r = i == nshards ? calloc(total, sizeof *r) : NULL;
  char **all = r ? calloc(total, sizeof *all) : NULL;
  if (all) {
    uint32_t k = 0;
    for (uint32_t s = 0; s < nshards; s++)
      for (uint32_t j = 0; j < nm[s]; j++, k++) {
        all[k] = m[s][j];
        m[s][j] = NULL;
        r[k] = (shard_row){
            .addr = all[k], .timeout_ms = timeout_ms, .shard = s, .member = j, .nmembers = nm[s]};
      }
  }
  for (uint32_t s = 0; s < i; s++)
    zc_free_addresses(m[s], nm[s]);
  if (!all) {
    fprintf(stderr, "zshard status: out of memory\n");
    free(r);
    return -1;
  }
  *rows = r;
  *members = all;
  *n = total;
  return 0;
}

int cli_status(int argc, char **argv) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"sample-ms", required_argument, NULL, 'm'},
                                       {"watch", optional_argument, NULL, 'w'},
                                       {"count", required_argument, NULL, 'c'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *shards = NULL;
  uint32_t num_shards = 0, timeout_ms = 2000;
  uint64_t sample_ms = 1000, count = 0;
  double interval_s = 2.0;
  int json = 0, watch = 0, c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v;
    switch (c) {
    case 's':
      shards = optarg;
      break;
    case 'n':
    case 't':
    case 'm':
    case 'c':
      if (cli_parse_count(optarg, &v) != 0 || v > UINT32_MAX || (c == 'c' && v == 0)) {
        status_usage(stderr);
        return 2;
      }
      if (c == 'n')
        num_shards = (uint32_t)v;
      else if (c == 't')
        timeout_ms = (uint32_t)v;
      else if (c == 'm')
        sample_ms = v;
      else
        count = v, watch = 1;
      break;
    case 'w':
      watch = 1;
      /* "--watch=5" and "--watch 5" both give the period: status takes no
       * other operand, so a number after --watch can only be that. */
      if (!optarg && optind < argc && parse_seconds(argv[optind], &interval_s) == 0)
        optind++;
      else if (optarg && parse_seconds(optarg, &interval_s) != 0) {
        status_usage(stderr);
        return 2;
      }
      break;
    case 'j':
      json = 1;
      break;
    case 'h':
      status_usage(stdout);
      return 0;
    default:
      status_usage(stderr);
      return 2;
    }
  }
  if (!shards || optind != argc) {
    status_usage(stderr);
    return 2;
  }
  char **addr = NULL, **members = NULL;
  uint32_t nshards = 0, n = 0;
  shard_row *rows = NULL;
  if (zc_parse_addresses(shards, num_shards, &addr, &nshards) != ZS_OK) {
    fprintf(stderr, "zshard status: %s\n", zs_last_error());
    return 2;
  }
  int made = make_rows(addr, nshards, timeout_ms, &rows, &members, &n);
  zc_free_addresses(addr, nshards);
  if (made != 0)
    return 1;
  shard_row *cur = calloc(n, sizeof *cur);
  shard_row *prev = calloc(n, sizeof *prev);
  pthread_t *th = calloc(n, sizeof *th);
  int *started = calloc(n, sizeof *started);
  if (!cur || !prev || !th || !started) {
    fprintf(stderr, "zshard status: out of memory\n");
    free(cur);
    free(prev);
    free(th);
    free(started);
    free(rows);
    zc_free_addresses(members, n);
    return 1;
  }
  for (uint32_t i = 0; i < n; i++)
    prev[i] = rows[i];
  /* The first table's throughput comes from a sample taken sample_ms before
   * it; every later table's from the table before. */
  if (sample_ms > 0) {
    ask_all(prev, n, th, started);
    sleep_ms(sample_ms);
  }
  int tty = isatty(STDOUT_FILENO);
  int all_serving = 0;
  for (uint64_t frame = 1;; frame++) {
    for (uint32_t i = 0; i < n; i++)
      cur[i] = rows[i];
    ask_all(cur, n, th, started);
    all_serving = 1;
    for (uint32_t i = 0; i < n; i++) {
      sanitize(cur[i].job);
      compute_rates(&cur[i], &prev[i]);
      all_serving &= cur[i].health_rc == ZS_OK && cur[i].serving == 1;
    }
    if (json) {
      print_json(cur, n, all_serving);
    } else {
      if (watch) {
        char when[64];
        time_t now = time(NULL);
        struct tm tm;
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime_r(&now, &tm));
        /* On a terminal the table replaces the previous one; in a file or
         * a pipe the tables follow one another. */
        if (tty)
          fputs("\033[H\033[2J", stdout);
        else if (frame > 1)
          fputs("\n", stdout);
        printf("Every %gs: zshard status    %s\n\n", interval_s, when);
      }
      print_table(cur, n);
    }
    fflush(stdout);
    if (!watch || (count && frame >= count))
      break;
    shard_row *t = prev;
    prev = cur;
    cur = t;
    sleep_ms((uint64_t)(interval_s * 1000.0 + 0.5));
  }
  free(cur);
  free(prev);
  free(th);
  free(started);
  free(rows);
  zc_free_addresses(members, n);
  return all_serving ? 0 : 1;
}
