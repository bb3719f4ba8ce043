/*
 * estimate — `zshard estimate`: the memory and traffic model of
 * zs_estimate() (formulas in docs/CLIENT.md) for a user's model, as a table
 * or as JSON.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "zshard/zshard.h"

static void estimate_usage(FILE *f) {
  fprintf(f, "usage: zshard estimate --params P --trainers W --shards N [options]\n"
             "  --params P          parameters (suffixes K, M, B/G, T: 7B, 350M, 1.3e9)\n"
             "  --largest-layer L   parameters of the largest layer (default: P)\n"
             "  --trainers W        data-parallel trainers (default 1)\n"
             "  --shards N          zshard shard servers (default 1)\n"
             "  --grad-dtype D      gradients on the wire: fp32, bf16 (default), fp16\n"
             "  --param-dtype D     parameters on the wire and on trainers (default bf16)\n"
             "  --gbps B            trainer link, Gbit/s each way (default 100)\n"
             "  --shard-gbps B      shard link (default: --gbps)\n"
             "  --pull-in-backward  zshard pulls the parameters again in backward\n"
             "  --json              one JSON document instead of the table\n");
}

static int parse_dtype(const char *s, zs_dtype *out) {
  if (strcmp(s, "fp32") == 0)
    *out = ZS_DTYPE_FP32;
  else if (strcmp(s, "bf16") == 0)
    *out = ZS_DTYPE_BF16;
  else if (strcmp(s, "fp16") == 0)
    *out = ZS_DTYPE_FP16;
  else
    return -1;
  return 0;
}

static const char *dtype_name(zs_dtype d) {
  return d == ZS_DTYPE_FP32 ? "fp32" : d == ZS_DTYPE_FP16 ? "fp16" : "bf16";
}

static const char *const pretty[ZS_STRATEGY_COUNT] = {"DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "zshard"};

static void seconds(double s, char *buf, size_t len) {
  if (s == 0)
    snprintf(buf, len, "0");
  else if (s < 1e-3)
    snprintf(buf, len, "%.1f us", s * 1e6);
  else if (s < 1)
    snprintf(buf, len, "%.1f ms", s * 1e3);
  else
    snprintf(buf, len, "%.2f s", s);
}

int cli_estimate(int argc, char **argv) {
  static const struct option opts[] = {{"params", required_argument, NULL, 'p'},
                                       {"largest-layer", required_argument, NULL, 'l'},
                                       {"trainers", required_argument, NULL, 'w'},
                                       {"shards", required_argument, NULL, 'n'},
                                       {"grad-dtype", required_argument, NULL, 'g'},
                                       {"param-dtype", required_argument, NULL, 'd'},
                                       {"gbps", required_argument, NULL, 'b'},
                                       {"shard-gbps", required_argument, NULL, 'B'},
                                       {"pull-in-backward", no_argument, NULL, 'P'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  zs_estimate_input in;
  zs_estimate_input_init(&in);
  int json = 0, c, bad = 0;
  optind = 1;
  while (!bad && (c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v = 0;
    char *end;
    switch (c) {
    case 'p':
      bad = cli_parse_count(optarg, &in.params) != 0;
      break;
    case 'l':
      bad = cli_parse_count(optarg, &in.largest_layer) != 0;
      break;
    case 'w':
    case 'n':
      bad = cli_parse_count(optarg, &v) != 0 || v == 0 || v > UINT32_MAX;
      if (c == 'w')
        in.trainers = (uint32_t)v;
      else
        in.shards = (uint32_t)v;
      break;
    case 'g':
      bad = parse_dtype(optarg, &in.grad_dtype) != 0;
      break;
    case 'd':
      bad = parse_dtype(optarg, &in.param_dtype) != 0;
      break;
    case 'b':
      in.trainer_gbps = strtod(optarg, &end);
      bad = *end != '\0';
      break;
    case 'B':
      in.shard_gbps = strtod(optarg, &end);
      bad = *end != '\0';
      break;
    case 'P':
      in.pull_in_backward = 1;
      break;
    case 'j':
      json = 1;
      break;
    case 'h':
      estimate_usage(stdout);
      return 0;
    default:
      bad = 1;
    }
  }
  if (bad || optind != argc || in.params == 0) {
    estimate_usage(stderr);
    return 2;
  }
  zs_estimate_row rows[ZS_STRATEGY_COUNT];
  int rc = zs_estimate(&in, rows, ZS_STRATEGY_COUNT);
  if (rc != ZS_OK) {
    fprintf(stderr, "zshard estimate: %s\n", zs_last_error());
    return 2;
  }
  const double shard_gbps = in.shard_gbps > 0 ? in.shard_gbps : in.trainer_gbps;
  const uint64_t largest = in.largest_layer ? in.largest_layer : in.params;
  if (json) {
    printf("{\"input\":{\"params\":%" PRIu64 ",\"largest_layer\":%" PRIu64 ",\"trainers\":%" PRIu32
           ",\"shards\":%" PRIu32
           ",\"grad_dtype\":\"%s\",\"param_dtype\":\"%s\",\"trainer_gbps\":%g,"
           "\"shard_gbps\":%g,\"pull_in_backward\":%s},\"strategies\":[",
           in.params, largest, in.trainers, in.shards, dtype_name(in.grad_dtype),
           dtype_name(in.param_dtype), in.trainer_gbps, shard_gbps,
           in.pull_in_backward ? "true" : "false");
    for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
      const zs_estimate_row *r = &rows[i];
      printf("%s{\"name\":\"%s\",\"device_bytes\":%.0f,\"shard_bytes\":%.0f,\"sent_bytes\":%.0f,"
             "\"received_bytes\":%.0f,\"shard_wire_bytes\":%.0f,\"comm_seconds\":%.9g}",
             i ? "," : "", r->name, r->device_bytes, r->shard_bytes, r->sent_bytes,
             r->received_bytes, r->shard_wire_bytes, r->comm_seconds);
    }
    printf("]}\n");
    return 0;
  }
  printf("model %.3g parameters (largest layer %.3g), %" PRIu32 " trainers, %" PRIu32
         " shards;\ngradients %s, parameters %s on the wire; links %g Gbit/s (shards %g), "
         "full duplex\n\n",
         (double)in.params, (double)largest, in.trainers, in.shards, dtype_name(in.grad_dtype),
         dtype_name(in.param_dtype), in.trainer_gbps, shard_gbps);
  printf("%-8s %12s %12s %12s %12s %14s %12s\n", "", "per device", "per shard", "sent/step",
         "recv/step", "shard NIC/step", "comm >=");
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    const zs_estimate_row *r = &rows[i];
    char dev[32], sh[32] = "-", sent[32], recv[32], snic[32] = "-", t[32];
    cli_bytes(r->device_bytes, dev, sizeof dev);
    if (r->shard_bytes > 0)
      cli_bytes(r->shard_bytes, sh, sizeof sh);
    cli_bytes(r->sent_bytes, sent, sizeof sent);
    cli_bytes(r->received_bytes, recv, sizeof recv);
    if (r->shard_wire_bytes > 0)
      cli_bytes(r->shard_wire_bytes, snic, sizeof snic);
    seconds(r->comm_seconds, t, sizeof t);
    printf("%-8s %12s %12s %12s %12s %14s %12s\n", pretty[i], dev, sh, sent, recv, snic, t);
  }
  printf("\nper device: model states on each trainer (fp32 Adam state = 12 bytes/param);\n"
         "comm >=: the busier direction of the busiest link over its bandwidth. "
         "Formulas: docs/CLIENT.md.\n");
  return 0;
}
