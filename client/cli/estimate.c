/*
 * estimate — `zshard estimate`: the memory and traffic model of
 * zs_estimate() (formulas in docs/CLIENT.md) for a user's model, as a table
 * or as JSON; with --link-gbit, also what every link carries per step and how
 * long that takes, for zshard (gated and overlapped) and for a ring
 * all-reduce of the gradients.
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
             "  --link-gbit B       every trainer's and shard's link is B Gbit/s each way\n"
             "                      (instead of --gbps and --shard-gbps), and the per-link\n"
             "                      table: bytes in and out and their time per trainer and\n"
             "                      per shard, zshard gated and overlapped, and the ring\n"
             "                      all-reduce\n"
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

/* What the command line asked for beyond zs_estimate_input. */
typedef struct estimate_args {
  zs_estimate_input in;
  int json;
  int links; /* --link-gbit given: print the per-link table */
} estimate_args;

/* Reads a positive, finite Gbit/s figure. */
static int parse_gbit(const char *s, double *out) {
  char *end;
  *out = strtod(s, &end);
  return *end != '\0' || !(*out > 0) || *out > 1e6;
}

/* 0 on success, 1 to print the usage to stdout (--help), 2 on a bad
 * command line. */
static int parse_estimate_args(int argc, char **argv, estimate_args *a) {
  static const struct option opts[] = {{"params", required_argument, NULL, 'p'},
                                       {"largest-layer", required_argument, NULL, 'l'},
                                       {"trainers", required_argument, NULL, 'w'},
                                       {"shards", required_argument, NULL, 'n'},
                                       {"grad-dtype", required_argument, NULL, 'g'},
                                       {"param-dtype", required_argument, NULL, 'd'},
                                       {"gbps", required_argument, NULL, 'b'},
                                       {"shard-gbps", required_argument, NULL, 'B'},
                                       {"link-gbit", required_argument, NULL, 'L'},
                                       {"pull-in-backward", no_argument, NULL, 'P'},
                                       {"optimizer-bytes", required_argument, NULL, 'k'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  zs_estimate_input *in = &a->in;
  int c, bad = 0, speeds = 0;
  optind = 1;
  while (!bad && (c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v = 0;
    char *end;
    switch (c) {
    case 'p':
      bad = cli_parse_count(optarg, &in->params) != 0;
      break;
    case 'l':
      bad = cli_parse_count(optarg, &in->largest_layer) != 0;
      break;
    case 'w':
    case 'n':
      bad = cli_parse_count(optarg, &v) != 0 || v == 0 || v > UINT32_MAX;
      if (c == 'w')
        in->trainers = (uint32_t)v;
      else
        in->shards = (uint32_t)v;
      break;
    case 'g':
      bad = parse_dtype(optarg, &in->grad_dtype) != 0;
      break;
    case 'd':
      bad = parse_dtype(optarg, &in->param_dtype) != 0;
      break;
    case 'b':
      in->trainer_gbps = strtod(optarg, &end);
      bad = *end != '\0';
      speeds |= 1;
      break;
    case 'B':
      in->shard_gbps = strtod(optarg, &end);
      bad = *end != '\0';
      speeds |= 1;
      break;
    case 'L':
      bad = parse_gbit(optarg, &in->trainer_gbps);
      in->shard_gbps = in->trainer_gbps;
      a->links = 1;
      break;
    case 'P':
      in->pull_in_backward = 1;
      break;
    case 'k':
      bad = cli_parse_count(optarg, &v) != 0 || v == 0 || v > 1024;
      in->optimizer_bytes = (uint32_t)v;
      break;
    case 'j':
      a->json = 1;
      break;
    case 'h':
      return 1;
    default:
      bad = 1;
    }
  }
  /* --link-gbit sets both links: with --gbps or --shard-gbps as well, one
   * of them would be silently overridden. */
  if (a->links && speeds)
    bad = 1;
  return bad || optind != argc || in->params == 0 ? 2 : 0;
}

/* The per-link figures of --link-gbit as a JSON object: ingress and egress
 * of one trainer's and one shard's link, the phases, and the step bounds. */
static void print_links_json(const zs_estimate_input *in, const zs_estimate_row *rows) {
  const zs_estimate_row *z = &rows[ZS_STRATEGY_ZSHARD], *ring = &rows[ZS_STRATEGY_DP];
  printf(",\"links\":{\"gbit\":%g,"
         "\"zshard\":{\"trainer_egress_bytes\":%.0f,\"trainer_ingress_bytes\":%.0f,"
         "\"shard_ingress_bytes\":%.0f,\"shard_egress_bytes\":%.0f,"
         "\"push_seconds\":%.9g,\"pull_seconds\":%.9g,\"gated_seconds\":%.9g,"
         "\"overlap_seconds\":%.9g},"
         "\"ring\":{\"trainer_egress_bytes\":%.0f,\"trainer_ingress_bytes\":%.0f,"
         "\"seconds\":%.9g}}",
         in->trainer_gbps, z->sent_bytes, z->received_bytes, z->shard_received_bytes,
         z->shard_sent_bytes, z->push_seconds, z->pull_seconds, z->gated_seconds, z->comm_seconds,
         ring->sent_bytes, ring->received_bytes, ring->comm_seconds);
}

static void print_json(const estimate_args *a, const zs_estimate_row *rows) {
  const zs_estimate_input *in = &a->in;
  const double shard_gbps = in->shard_gbps > 0 ? in->shard_gbps : in->trainer_gbps;
  const uint32_t K = in->optimizer_bytes ? in->optimizer_bytes : 12;
  const int known = in->largest_layer != 0;
  char largest[32] = "null";
  if (known)
    snprintf(largest, sizeof largest, "%" PRIu64, in->largest_layer);
  printf("{\"input\":{\"params\":%" PRIu64 ",\"largest_layer\":%s,\"trainers\":%" PRIu32
         ",\"shards\":%" PRIu32 ",\"grad_dtype\":\"%s\",\"param_dtype\":\"%s\",\"trainer_gbps\":%g,"
         "\"shard_gbps\":%g,\"pull_in_backward\":%s,\"optimizer_bytes\":%" PRIu32
         "},\"strategies\":[",
         in->params, largest, in->trainers, in->shards, dtype_name(in->grad_dtype),
         dtype_name(in->param_dtype), in->trainer_gbps, shard_gbps,
         in->pull_in_backward ? "true" : "false", K);
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
           "\"received_bytes\":%.0f,\"shard_wire_bytes\":%.0f,\"comm_seconds\":%.9g,"
           "\"gated_seconds\":%.9g}",
           i ? "," : "", r->name, r->state_bytes, working, device, r->shard_bytes, r->sent_bytes,
           r->received_bytes, r->shard_wire_bytes, r->comm_seconds, r->gated_seconds);
  }
  printf("]");
  if (a->links)
    print_links_json(in, rows);
  printf("}\n");
}

/* One row of the per-link table: a link's egress and ingress per step and
 * their time at B bytes/s. */
static void print_link_row(const char *what, double out, double in, double B) {
  char ob[32], ib[32], ot[32], it[32];
  cli_bytes(out, ob, sizeof ob);
  cli_bytes(in, ib, sizeof ib);
  seconds(out / B, ot, sizeof ot);
  seconds(in / B, it, sizeof it);
  printf("%-22s %12s %12s %12s %12s\n", what, ob, ib, ot, it);
}

static void print_links(const zs_estimate_input *in, const zs_estimate_row *rows) {
  const zs_estimate_row *z = &rows[ZS_STRATEGY_ZSHARD], *ring = &rows[ZS_STRATEGY_DP];
  const double B = in->trainer_gbps * 1e9 / 8.0;
  char push[32], pull[32], gated[32], over[32], rt[32];
  printf("\nPer link at %g Gbit/s each way (full duplex), per step:\n", in->trainer_gbps);
  printf("%-22s %12s %12s %12s %12s\n", "", "egress", "ingress", "time out", "time in");
  print_link_row("zshard, each trainer", z->sent_bytes, z->received_bytes, B);
  print_link_row("zshard, each shard", z->shard_sent_bytes, z->shard_received_bytes, B);
  print_link_row("ring, each trainer", ring->sent_bytes, ring->received_bytes, B);
  seconds(z->push_seconds, push, sizeof push);
  seconds(z->pull_seconds, pull, sizeof pull);
  seconds(z->gated_seconds, gated, sizeof gated);
  seconds(z->comm_seconds, over, sizeof over);
  seconds(ring->comm_seconds, rt, sizeof rt);
  printf("\nzshard push phase %s, pull phase %s (each its busiest link)\n"
         "zshard, gated (every push in, then the pulls): %s\n"
         "zshard, overlapped (pulls during pushes):       %s\n"
         "ring all-reduce of the gradients, 2(W-1)/W of them each way: %s\n",
         push, pull, gated, over, rt);
}

static void print_table(const estimate_args *a, const zs_estimate_row *rows) {
  const zs_estimate_input *in = &a->in;
  const double shard_gbps = in->shard_gbps > 0 ? in->shard_gbps : in->trainer_gbps;
  const uint32_t K = in->optimizer_bytes ? in->optimizer_bytes : 12;
  const int known = in->largest_layer != 0;
  char layer[48] = "largest layer not given";
  if (known)
    snprintf(layer, sizeof layer, "largest layer %.3g", (double)in->largest_layer);
  printf("model %.3g parameters (%s), %" PRIu32 " trainers, %" PRIu32
         " shards;\ngradients %s, parameters %s on the wire, optimizer state %" PRIu32
         " bytes/param; links %g Gbit/s (shards %g), full duplex\n\n",
         (double)in->params, layer, in->trainers, in->shards, dtype_name(in->grad_dtype),
         dtype_name(in->param_dtype), K, in->trainer_gbps, shard_gbps);
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
  if (a->links)
    print_links(in, rows);
}

int cli_estimate(int argc, char **argv) {
  estimate_args a;
  memset(&a, 0, sizeof a);
  zs_estimate_input_init(&a.in);
  int rc = parse_estimate_args(argc, argv, &a);
  if (rc != 0) {
    estimate_usage(rc == 1 ? stdout : stderr);
    return rc == 1 ? 0 : 2;
  }
  zs_estimate_row rows[ZS_STRATEGY_COUNT];
  if (zs_estimate(&a.in, rows, ZS_STRATEGY_COUNT) != ZS_OK) {
    fprintf(stderr, "zshard estimate: %s\n", zs_last_error());
    return 2;
  }
  if (a.json)
    print_json(&a, rows);
  else
    print_table(&a, rows);
  return 0;
}
