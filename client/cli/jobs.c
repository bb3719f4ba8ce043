/*
 * jobs — `zshard close-job`: closes the job on every shard (CloseJob), so
 * that the shards take the next job without a restart.
 *
 * The shards are asked one after the other, in shard order; each answer is
 * printed as it comes, so that an operator whose close failed half-way sees
 * which shards still hold the job (running the command again closes the
 * rest: a shard without a job is not an error).
 *
 * Exit status: 0 when no shard holds the job any more, 1 otherwise, 2 on bad
 * usage.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_support.h"
#include "common/model/spec.h"
#include "zshard/v1/zshard.pb-c.h"

#define CLOSE_CLI_TIMEOUT_MS 30000u

static const char close_usage[] =
    "usage: zshard close-job --shards ADDR[,ADDR...] [--job NAME] [--hash H] [--timeout-ms T]\n"
    "  Closes the job on every shard: its state is freed and the shard is ready for\n"
    "  the next job without a restart. For the end of a run, once every trainer is\n"
    "  done (their calls still waiting fail). --job and --hash (hex, as `zshard\n"
    "  status --json` shows it) make sure the right job is closed: a shard holding\n"
    "  another one keeps it and the command fails. A shard without a job is skipped.\n";

static int usage_error(const char *why) {
  fprintf(stderr, "zshard close-job: %s\n%s", why, close_usage);
  return 2;
}

int cli_close_job(int argc, char **argv) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"job", required_argument, NULL, 'j'},
                                       {"hash", required_argument, NULL, 'H'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *shards = NULL, *job = NULL;
  uint64_t hash = 0;
  uint32_t num_shards = 0, timeout_ms = CLOSE_CLI_TIMEOUT_MS;
  optind = 1;
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    char *end = NULL;
    unsigned long long v;
    switch (ch) {
    case 's':
      shards = optarg;
      break;
    case 'n':
      v = strtoull(optarg, &end, 10);
      if (!*optarg || *end || *optarg == '-' || v == 0 || v > SPEC_MAX_SHARDS)
        return usage_error("--num-shards must be 1..4096");
      num_shards = (uint32_t)v;
      break;
    case 'j':
      if (!*optarg || strlen(optarg) > SPEC_MAX_NAME)
        return usage_error("--job must have 1..256 bytes");
      job = optarg;
      break;
    case 'H':
      v = strtoull(optarg, &end, 16);
      if (!*optarg || *end || *optarg == '-' || v == 0)
        return usage_error("--hash must be a non-zero hexadecimal spec hash");
      hash = v;
      break;
    case 't':
      v = strtoull(optarg, &end, 10);
      if (!*optarg || *end || *optarg == '-' || v == 0 || v > UINT32_MAX)
        return usage_error("--timeout-ms must be a positive whole number");
      timeout_ms = (uint32_t)v;
      break;
    case 'h':
      fputs(close_usage, stdout);
      return 0;
    default:
      return usage_error("unknown option or missing value");
    }
  }
  if (optind < argc)
    return usage_error("unexpected argument");
  if (!shards)
    return usage_error("--shards is required");

  zs_client_options co;
  zs_client_options_init(&co);
  co.addresses = shards;
  co.num_shards = num_shards;
  co.rpc_timeout_ms = timeout_ms;
  co.max_retries = 2; /* fail fast when a shard is down */
  zs_client *c = NULL;
  if (zs_client_open(&co, &c) != ZS_OK) {
    fprintf(stderr, "zshard close-job: %s\n", zs_last_error());
    return 1;
  }
  Zshard__V1__CloseJobRequest req = ZSHARD__V1__CLOSE_JOB_REQUEST__INIT;
  req.spec_hash = hash;
  req.job = (char *)(job ? job : "");
  uint32_t n = zc_client_num_shards(c), closed = 0, empty = 0, failed = 0;
  for (uint32_t i = 0; i < n; i++) {
    Zshard__V1__CloseJobResponse *r = NULL;
    rpc_status st;
    int rc =
        zc_call(c, i, ZC_METHOD("CloseJob"), &req.base, &zshard__v1__close_job_response__descriptor,
                (ProtobufCMessage **)&r, timeout_ms, &st);
    if (rc != ZS_OK) {
      fprintf(stderr, "zshard close-job: shard %" PRIu32 " (%s): %s: %s\n", i,
              zc_client_address(c, i), zs_err_name(rc),
              st.message[0] ? st.message : zs_strerror(rc));
      failed++;
      continue;
    }
    if (r->closed) {
      char b[32];
      /* The job name is the server's string: printed bounded. */
      printf("shard %" PRIu32 " (%s): closed job '%.64s' (spec hash %016" PRIx64
             ") at version %" PRIu64 ", freed %s\n",
             i, zc_client_address(c, i), r->job ? r->job : "", r->spec_hash, r->version,
             cli_bytes((double)r->state_bytes, b, sizeof b));
      closed++;
    } else {
      printf("shard %" PRIu32 " (%s): no job open\n", i, zc_client_address(c, i));
      empty++;
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
  }
  printf("closed the job on %" PRIu32 " of %" PRIu32 " shards (%" PRIu32 " had none, %" PRIu32
         " failed)\n",
         closed, n, empty, failed);
  zs_client_close(c);
  return failed ? 1 : 0;
}
