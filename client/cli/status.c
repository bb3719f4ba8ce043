/*
 * status — `zshard status`: one row per shard with its id, address, health
 * (grpc.health.v1 Check), job, parameter version, state bytes and uptime
 * (zshard.v1 GetInfo). The shards are asked in parallel, one thread each,
 * so a cluster with dead shards answers within one timeout.
 *
 * Exit status: 0 when every shard is SERVING, 1 otherwise, 2 on bad usage.
 */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "grpc/health/v1/health.pb-c.h"
#include "internal.h"

typedef struct shard_row {
  const char *addr;
  uint32_t timeout_ms;
  int health_rc, info_rc;
  int serving; /* the health answer: 1 SERVING, 2 NOT_SERVING, ... */
  char health_err[512], info_err[512];
  uint32_t shard_id, num_shards;
  char job[SPEC_MAX_NAME + 1];
  uint64_t version, state_bytes;
  double uptime_s;
  int has_info;
} shard_row;

static void *ask_shard(void *arg) {
  shard_row *r = arg;
  rpc_channel *ch = NULL;
  r->health_rc = r->info_rc = rpc_channel_open(r->addr, &ch);
  if (!ch) {
    snprintf(r->health_err, sizeof r->health_err, "%s", zs_strerror(r->health_rc));
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
    r->uptime_s = info->uptime_s;
    protobuf_c_message_free_unpacked(&info->base, NULL);
  } else {
    snprintf(r->info_err, sizeof r->info_err, "%s", st.message);
  }
  rpc_channel_close(ch);
  return NULL;
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
  fprintf(f, "usage: zshard status --shards ADDR[,ADDR...] [--num-shards N] [--timeout-ms T] "
             "[--json]\n"
             "  --shards      shard addresses in shard-id order, or a pattern with {i}\n"
             "  --num-shards  the number of shards, with a pattern\n"
             "  --timeout-ms  per call (default 2000)\n"
             "  --json        one JSON document instead of the table\n");
}

int cli_status(int argc, char **argv) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *shards = NULL;
  uint32_t num_shards = 0, timeout_ms = 2000;
  int json = 0, c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v;
    switch (c) {
    case 's':
      shards = optarg;
      break;
    case 'n':
    case 't':
      if (cli_parse_count(optarg, &v) != 0 || v > UINT32_MAX) {
        status_usage(stderr);
        return 2;
      }
      if (c == 'n')
        num_shards = (uint32_t)v;
      else
        timeout_ms = (uint32_t)v;
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
  char **addr = NULL;
  uint32_t n = 0;
  if (zc_parse_addresses(shards, num_shards, &addr, &n) != ZS_OK) {
    fprintf(stderr, "zshard status: %s\n", zs_last_error());
    return 2;
  }
  shard_row *rows = calloc(n, sizeof *rows);
  pthread_t *th = calloc(n, sizeof *th);
  int *started = calloc(n, sizeof *started);
  if (!rows || !th || !started) {
    fprintf(stderr, "zshard status: out of memory\n");
    return 1;
  }
  for (uint32_t i = 0; i < n; i++) {
    rows[i].addr = addr[i];
    rows[i].timeout_ms = timeout_ms;
    started[i] = pthread_create(&th[i], NULL, ask_shard, &rows[i]) == 0;
    if (!started[i])
      ask_shard(&rows[i]); /* no thread: ask from here */
  }
  for (uint32_t i = 0; i < n; i++)
    if (started[i])
      pthread_join(th[i], NULL);

  int all_serving = 1;
  for (uint32_t i = 0; i < n; i++) {
    sanitize(rows[i].job);
    all_serving &= rows[i].health_rc == ZS_OK && rows[i].serving == 1;
  }
  if (json) {
    printf("{\"shards\":[");
    for (uint32_t i = 0; i < n; i++) {
      const shard_row *r = &rows[i];
      printf("%s{\"index\":%" PRIu32 ",\"address\":", i ? "," : "", i);
      json_str(stdout, r->addr);
      printf(",\"health\":\"%s\"", health_name(r));
      if (r->has_info) {
        printf(",\"shard_id\":%" PRIu32 ",\"num_shards\":%" PRIu32 ",\"job\":", r->shard_id,
               r->num_shards);
        json_str(stdout, r->job);
        printf(",\"version\":%" PRIu64 ",\"state_bytes\":%" PRIu64 ",\"uptime_s\":%.3f", r->version,
               r->state_bytes, r->uptime_s);
      } else {
        printf(",\"error\":");
        json_str(stdout, r->info_err[0] ? r->info_err : r->health_err);
      }
      printf("}");
    }
    printf("],\"all_serving\":%s}\n", all_serving ? "true" : "false");
  } else {
    printf("%-5s %-24s %-12s %-16s %10s %12s %9s\n", "ID", "ADDRESS", "HEALTH", "JOB", "VERSION",
           "STATE", "UPTIME");
    for (uint32_t i = 0; i < n; i++) {
      const shard_row *r = &rows[i];
      char id[16] = "?", ver[24] = "-", state[32] = "-", up[32] = "-";
      if (r->has_info) {
        snprintf(id, sizeof id, "%" PRIu32, r->shard_id);
        snprintf(ver, sizeof ver, "%" PRIu64, r->version);
        cli_bytes((double)r->state_bytes, state, sizeof state);
        uptime(r->uptime_s, up, sizeof up);
      }
      printf("%-5s %-24.24s %-12s %-16.16s %10s %12s %9s", id, r->addr, health_name(r),
             r->has_info && r->job[0] ? r->job : "-", ver, state, up);
      if (!r->has_info)
        printf("  (%s)", r->info_err[0] ? r->info_err : r->health_err);
      else if (r->shard_id != i)
        printf("  (listed at position %" PRIu32 ")", i);
      printf("\n");
    }
  }
  free(rows);
  free(th);
  free(started);
  zc_free_addresses(addr, n);
  return all_serving ? 0 : 1;
}
