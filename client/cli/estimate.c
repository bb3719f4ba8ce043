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
             "  --largest-layer L   parameters of the largest layer, what ZeRO-3 gathers and\n"
             "                      zshard pulls at a time (a transformer block: 12 h^2 for\n"
             "                      width h), for the working-memory column. No default:\n"
             "                      without it that column is left out for ZeRO-3 and zshard\n"
             "                      rather than guessed\n"
             "  --trainers W        data-parallel trainers (default 1)\n"
             "  --shards N          zshard shard servers (default 1)\n"
             "  --grad-dtype D      gradients on the wire: fp32, bf16 (default), fp16, int8\n"
             "                      (blocks of 128 with an fp32 scale: 1.03 bytes each)\n"
             "  --param-dtype D     parameters on the wire and on trainers (default bf16)\n"
             "  --gbps B            trainer link, Gbit/s each way (default 100)\n"
             "  --shard-gbps B      shard link (default: --gbps)\n"
             "  --pull-in-backward  zshard pulls the parameters again in backward\n"
             "  --optimizer-bytes K optimizer state per parameter, bytes (default 12: fp32\n"
             "                      master weights and Adam's two moments)\n"
             "  --json              one JSON document instead of the table\n");
}

static int parse_dtype(const char *s, zs_dtype *out) {
  if (strcmp(s, "fp32") == 0)
    *out = ZS_DTYPE_FP32;
  else if (strcmp(s, "bf16") == 0)
    *out = ZS_DTYPE_BF16;
  else if (strcmp(s, "fp16") == 0)
    *out = ZS_DTYPE_FP16;
  else if (strcmp(s, "int8") == 0)
    *out = ZS_DTYPE_INT8_BLOCK;
  else
    return -1;
  return 0;
}

static const char *dtype_name(zs_dtype d) {
  return d == ZS_DTYPE_FP32         ? "fp32"
         : d == ZS_DTYPE_FP16       ? "fp16"
         : d == ZS_DTYPE_INT8_BLOCK ? "int8"
                                    : "bf16";
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
                                       {"optimizer-bytes", required_argument, NULL, 'k'},
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
    case 'k':
      bad = cli_parse_count(optarg, &v) != 0 || v == 0 || v > 1024;
      in.optimizer_bytes = (uint32_t)v;
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
  const uint32_t K = in.optimizer_bytes ? in.optimizer_bytes : 12;
  /* Without the largest layer, the working memory of the strategies that
   * gather layers is unknown (the library leaves it 0): said, not shown. */
  const int known = in.largest_layer != 0;
  if (json) {
    char largest[32] = "null";
    if (known)
      snprintf(largest, sizeof largest, "%" PRIu64, in.largest_layer);
    printf("{\"input\":{\"params\":%" PRIu64 ",\"largest_layer\":%s,\"trainers\":%" PRIu32
           ",\"shards\":%" PRIu32
           ",\"grad_dtype\":\"%s\",\"param_dtype\":\"%s\",\"trainer_gbps\":%g,"
           "\"shard_gbps\":%g,\"pull_in_backward\":%s,\"optimizer_bytes\":%" PRIu32
           "},\"strategies\":[",
           in.params, largest, in.trainers, in.shards, dtype_name(in.grad_dtype),
           dtype_name(in.param_dtype), in.trainer_gbps, shard_gbps,
           in.pull_in_backward ? "true" : "false", K);
    for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
      const zs_estimate_row *r = &rows[i];
      const int gathers = i == ZS_STRATEGY_ZERO3 || i == ZS_STRATEGY_ZSHARD;
      char working[32] = "null", device[32] = "null";
      if (known || !gathers) {
        snprintf(working, sizeof working, "%.0f", r->working_bytes);
        snprintf(device, sizeof device, "%.0f", r->device_bytes);
      }
      printf("%s{\"name\":\"%s\",\"state_bytes\":%.0f,\"working_bytes\":%s,"
             "\"device_bytes\":%s,\"shard_bytes\":%.0f,\"sent_bytes\":%.0f,"
             "\"received_bytes\":%.0f,\"shard_wire_bytes\":%.0f,\"comm_seconds\":%.9g}",
             i ? "," : "", r->name, r->state_bytes, working, device, r->shard_bytes, r->sent_bytes,
             r->received_bytes, r->shard_wire_bytes, r->comm_seconds);
    }
    printf("]}\n");
    return 0;
  }
  char layer[48] = "largest layer not given";
  if (known)
    snprintf(layer, sizeof layer, "largest layer %.3g", (double)in.largest_layer);
  printf("model %.3g parameters (%s), %" PRIu32 " trainers, %" PRIu32
         " shards;\ngradients %s, parameters %s on the wire, optimizer state %" PRIu32
         " bytes/param; links %g Gbit/s (shards %g), full duplex\n\n",
         (double)in.params, layer, in.trainers, in.shards, dtype_name(in.grad_dtype),
         dtype_name(in.param_dtype), K, in.trainer_gbps, shard_gbps);
  printf("%-8s %12s %12s %12s %12s %12s %14s %12s\n", "", "states/dev", "working/dev", "per shard",
         "sent/step", "recv/step", "shard NIC/step", "comm >=");
  for (int i = 0; i < ZS_STRATEGY_COUNT; i++) {
    const zs_estimate_row *r = &rows[i];
    const int gathers = i == ZS_STRATEGY_ZERO3 || i == ZS_STRATEGY_ZSHARD;
    char st[32], wk[32] = "-", sh[32] = "-", sent[32], recv[32], snic[32] = "-", t[32];
    cli_bytes(r->state_bytes, st, sizeof st);
    if (known || !gathers)
      cli_bytes(r->working_bytes, wk, sizeof wk);
    if (r->shard_bytes > 0)
      cli_bytes(r->shard_bytes, sh, sizeof sh);
    cli_bytes(r->sent_bytes, sent, sizeof sent);
    cli_bytes(r->received_bytes, recv, sizeof recv);
    if (r->shard_wire_bytes > 0)
      cli_bytes(r->shard_wire_bytes, snic, sizeof snic);
    seconds(r->comm_seconds, t, sizeof t);
    printf("%-8s %12s %12s %12s %12s %12s %14s %12s\n", pretty[i], st, wk, sh, sent, recv, snic, t);
  }
  printf("\nstates/dev: model states kept on each trainer: parameters, gradients and\n"
         "optimizer state, or its partition of them (the ZeRO paper's figure).\n"
         "working/dev: the layer ZeRO-3 gathers or zshard pulls, its gradient and the next\n"
         "layer's prefetch%s. Activations are in neither.\n"
         "comm >=: the busier direction of the busiest link over its bandwidth.\n"
         "Formulas: docs/CLIENT.md.\n",
         known ? "" : " ('-': needs --largest-layer)");
  return 0;
}
