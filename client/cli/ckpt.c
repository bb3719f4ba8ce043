/*
 * ckpt — the checkpoint commands of `zshard` (docs/CHECKPOINTS.md):
 *
 *   zshard checkpoint  --shards LIST [--step S] [--dir D]     online, two rounds
 *   zshard restore     --shards LIST [--step S] [--dir D]     online
 *   zshard checkpoints --shards LIST [--dir D] [--json]       what every shard holds
 *   zshard reshard IN OUT --shards N [--step S]               offline
 *   zshard export  IN OUT.safetensors [--step S] [--dtype fp32|bf16|fp16] [--moments]
 *
 * The online commands drive the shards like a trainer would, with the spec
 * hash the shards report (GetInfo) instead of an opened job. The offline ones
 * read and write checkpoint files with the server's own code (server/ckpt/ckpt.h),
 * so they verify every file they read exactly as a shard would. IN is a state
 * directory (the newest complete checkpoint, or --step) or a step directory
 * ".../step-<s>".
 *
 * Exit status: 0 on success, 1 on failure, 2 on bad usage.
 */
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt_client.h"
#include "cli.h"
#include "cli_support.h"
#include "common/base/clock.h"
#include "server/ckpt/ckpt.h"
#include "zshard/v1/zshard.pb-c.h"

#define CKPT_CLI_TIMEOUT_MS 10000u

typedef struct online_opts {
  const char *shards;
  uint32_t num_shards;
  uint64_t step;
  int step_given;
  const char *dir;
  uint32_t timeout_ms;
  int json;
} online_opts;

static int parse_u64(const char *s, uint64_t *out) {
  char *end;
  if (!s || !*s || *s == '-')
    return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end)
    return -1;
  *out = v;
  return 0;
}

static int usage_error(const char *cmd, const char *usage, const char *why) {
  fprintf(stderr, "zshard %s: %s\n%s", cmd, why, usage);
  return 2;
}

/* Parses the options of the online commands. Returns -1 to go on, else the
 * exit status. */
static int parse_online(int argc, char **argv, const char *cmd, const char *usage, online_opts *o) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"step", required_argument, NULL, 'S'},
                                       {"dir", required_argument, NULL, 'd'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  memset(o, 0, sizeof *o);
  o->timeout_ms = CKPT_CLI_TIMEOUT_MS;
  optind = 1;
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    uint64_t v;
    switch (ch) {
    case 's':
      o->shards = optarg;
      break;
    case 'n':
      if (parse_u64(optarg, &v) != 0 || v == 0 || v > 4096)
        return usage_error(cmd, usage, "--num-shards must be 1..4096");
      o->num_shards = (uint32_t)v;
      break;
    case 'S':
      if (parse_u64(optarg, &o->step) != 0)
        return usage_error(cmd, usage, "--step must be a whole number");
      o->step_given = 1;
      break;
    case 'd':
      o->dir = optarg;
      break;
    case 't':
      if (parse_u64(optarg, &v) != 0 || v == 0 || v > UINT32_MAX)
        return usage_error(cmd, usage, "--timeout-ms must be a positive whole number");
      o->timeout_ms = (uint32_t)v;
      break;
    case 'j':
      o->json = 1;
      break;
    case 'h':
      fputs(usage, stdout);
      return 0;
    default:
      return usage_error(cmd, usage, "unknown option or missing value");
    }
  }
  if (optind < argc)
    return usage_error(cmd, usage, "unexpected argument");
  if (!o->shards)
    return usage_error(cmd, usage, "--shards is required");
  return -1;
}

/* A client over the shard list, for calls without an opened job. */
static int open_client(const online_opts *o, uint32_t timeout_ms, zs_client **out) {
  zs_client_options co;
  zs_client_options_init(&co);
  co.addresses = o->shards;
  co.num_shards = o->num_shards;
  co.rpc_timeout_ms = o->timeout_ms;
  co.checkpoint_timeout_ms = timeout_ms;
  /* A command line tool fails fast when a shard is down. */
  co.max_retries = 2;
  int rc = zs_client_open(&co, out);
  if (rc != ZS_OK)
    fprintf(stderr, "zshard: %s\n", zs_last_error());
  return rc;
}

/* Asks every shard for its job: the common spec hash (0 when no shard has
 * a job) and the highest version. All shards with a job must agree. */
static int shard_jobs(zs_client *c, uint64_t *hash, uint64_t *max_version, uint32_t *with_job) {
  *hash = 0;
  *max_version = 0;
  *with_job = 0;
  for (uint32_t i = 0; i < zc_client_num_shards(c); i++) {
    Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
    Zshard__V1__GetInfoResponse *r = NULL;
    rpc_status st;
    int rc =
        zc_call(c, i, ZC_METHOD("GetInfo"), &req.base, &zshard__v1__get_info_response__descriptor,
                (ProtobufCMessage **)&r, zc_client_rpc_timeout_ms(c), &st);
    if (rc != ZS_OK) {
      fprintf(stderr, "zshard: GetInfo on shard %" PRIu32 " (%s) failed: %s\n", i,
              zc_client_address(c, i), st.message[0] ? st.message : zs_strerror(rc));
      return rc;
    }
    int bad = r->shard_id != i || r->num_shards != zc_client_num_shards(c);
    if (!bad && r->job && r->job[0]) {
      if (*with_job && r->spec_hash != *hash)
        bad = 2;
      *hash = r->spec_hash;
      (*with_job)++;
      if (r->version > *max_version)
        *max_version = r->version;
    }
    uint32_t sid = r->shard_id, n = r->num_shards;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    if (bad == 1) {
      fprintf(stderr,
              "zshard: address %" PRIu32 " (%s) is shard %" PRIu32 " of %" PRIu32
              "; list the %" PRIu32 " shards in shard-id order\n",
              i, zc_client_address(c, i), sid, n, zc_client_num_shards(c));
      return ZS_EINVAL;
    }
    if (bad == 2) {
      fprintf(stderr, "zshard: the shards hold different jobs (spec hashes differ)\n");
      return ZS_EHASH;
    }
  }
  return ZS_OK;
}

static const char ckpt_usage[] =
    "usage: zshard checkpoint --shards ADDR[,ADDR...] [--step S] [--dir D] [--timeout-ms T]\n"
    "  Checkpoints the job every shard holds: each shard writes its file, then all\n"
    "  commit it. --step: the parameter version to save (default: the highest any\n"
    "  shard has reached; a shard not there yet waits for it). --dir: a directory\n"
    "  below the shards' state directories (default: the state directories).\n"
    "  --timeout-ms: per call (default 10000; the write itself gets 10 minutes).\n";

int cli_checkpoint(int argc, char **argv) {
  online_opts o;
  int rc = parse_online(argc, argv, "checkpoint", ckpt_usage, &o);
  if (rc >= 0)
    return rc;
  zs_client *c = NULL;
  if (open_client(&o, 600000, &c) != ZS_OK)
    return 1;
  uint64_t hash, vmax;
  uint32_t with_job;
  int status = 1;
  if (shard_jobs(c, &hash, &vmax, &with_job) != ZS_OK)
    goto done;
  if (with_job != zc_client_num_shards(c)) {
    fprintf(stderr, "zshard checkpoint: %" PRIu32 " of %" PRIu32 " shards have a job open\n",
            with_job, zc_client_num_shards(c));
    goto done;
  }
  zc_ckpt_report rep;
  memset(&rep, 0, sizeof rep);
  uint64_t step = o.step_given ? o.step : vmax;
  rc = zc_checkpoint(c, hash, step, o.dir, &rep);
  if (rc != ZS_OK) {
    fprintf(stderr, "zshard checkpoint: %s\n", zs_last_error());
    goto done;
  }
  char b[32];
  printf("checkpoint step %" PRIu64 " committed on %" PRIu32 " shards: %s, optimizer steps %" PRIu64
         "; longest apply hold %.3f ms, slowest write %.1f ms, %.1f ms in all\n",
         rep.step, zc_client_num_shards(c), cli_bytes((double)rep.bytes, b, sizeof b),
         rep.optimizer_steps, rep.max_snapshot_seconds * 1e3, rep.max_write_seconds * 1e3,
         rep.seconds * 1e3);
  status = 0;
done:
  zs_client_close(c);
  return status;
}

static const char restore_usage[] =
    "usage: zshard restore --shards ADDR[,ADDR...] [--step S] [--dir D] [--timeout-ms T]\n"
    "  Replaces the state of every shard by checkpoint S (default: the newest one\n"
    "  complete on every shard, else older ones). Trainers then resume at S + 1.\n";

int cli_restore(int argc, char **argv) {
  online_opts o;
  int rc = parse_online(argc, argv, "restore", restore_usage, &o);
  if (rc >= 0)
    return rc;
  zs_client *c = NULL;
  if (open_client(&o, 600000, &c) != ZS_OK)
    return 1;
  uint64_t hash, vmax, restored = 0;
  uint32_t with_job;
  int changed = 0, status = 1;
  if (shard_jobs(c, &hash, &vmax, &with_job) != ZS_OK)
    goto done;
  /* Shards without a job take the checkpoint's job (hash 0 lets them). */
  rc = zc_restore(c, with_job == zc_client_num_shards(c) ? hash : 0, o.step_given ? o.step : 0,
                  o.dir, &restored, &changed, NULL, NULL);
  if (rc != ZS_OK) {
    fprintf(stderr, "zshard restore: %s\n", zs_last_error());
    goto done;
  }
  printf("restored checkpoint step %" PRIu64 " on %" PRIu32
         " shards%s; trainers resume at step %" PRIu64 "\n",
         restored, zc_client_num_shards(c), changed ? "" : " (they already held it)", restored + 1);
  status = 0;
done:
  zs_client_close(c);
  return status;
}

static const char list_usage[] =
    "usage: zshard checkpoints --shards ADDR[,ADDR...] [--dir D] [--json]\n"
    "  The checkpoints each shard holds: per step, on how many shards it is\n"
    "  complete and loadable, and the shard count it was written with.\n";

int cli_checkpoints(int argc, char **argv) {
  online_opts o;
  int rc = parse_online(argc, argv, "checkpoints", list_usage, &o);
  if (rc >= 0)
    return rc;
  zs_client *c = NULL;
  if (open_client(&o, o.timeout_ms, &c) != ZS_OK)
    return 1;
  int status = 1;
  Zshard__V1__ListCheckpointsResponse **lists = calloc(zc_client_num_shards(c), sizeof *lists);
  if (!lists)
    goto done;
  Zshard__V1__ListCheckpointsRequest req = ZSHARD__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  req.dir = (char *)(o.dir ? o.dir : "");
  for (uint32_t i = 0; i < zc_client_num_shards(c); i++) {
    rpc_status st;
    rc = zc_call(c, i, ZC_METHOD("ListCheckpoints"), &req.base,
                 &zshard__v1__list_checkpoints_response__descriptor, (ProtobufCMessage **)&lists[i],
                 zc_client_rpc_timeout_ms(c), &st);
    if (rc != ZS_OK) {
      fprintf(stderr, "zshard checkpoints: shard %" PRIu32 " (%s): %s\n", i,
              zc_client_address(c, i), st.message[0] ? st.message : zs_strerror(rc));
      goto done;
    }
  }
  /* Every step any shard knows, ascending: merged from the sorted lists. */
  size_t *pos = calloc(zc_client_num_shards(c), sizeof *pos);
  if (!pos)
    goto done;
  if (o.json)
    printf("{\"checkpoints\":[");
  else
    printf("%-12s %-10s %-10s %-8s\n", "STEP", "COMPLETE", "LOADABLE", "WRITTEN");
  int first = 1;
  for (;;) {
    uint64_t step = UINT64_MAX;
    for (uint32_t i = 0; i < zc_client_num_shards(c); i++)
      if (pos[i] < lists[i]->n_checkpoints && lists[i]->checkpoints[pos[i]]->step < step)
        step = lists[i]->checkpoints[pos[i]]->step;
    if (step == UINT64_MAX)
      break;
    uint32_t complete = 0, loadable = 0, written = 0;
    for (uint32_t i = 0; i < zc_client_num_shards(c); i++) {
      if (pos[i] < lists[i]->n_checkpoints && lists[i]->checkpoints[pos[i]]->step == step) {
        const Zshard__V1__CheckpointInfo *e = lists[i]->checkpoints[pos[i]++];
        complete += e->complete;
        loadable += e->loadable;
        if (e->num_shards)
          written = e->num_shards;
      }
    }
    if (o.json)
      printf("%s{\"step\":%" PRIu64 ",\"complete\":%" PRIu32 ",\"loadable\":%" PRIu32
             ",\"written_by\":%" PRIu32 "}",
             first ? "" : ",", step, complete, loadable, written);
    else
      printf("%-12" PRIu64 " %" PRIu32 "/%-8" PRIu32 " %" PRIu32 "/%-8" PRIu32 " %" PRIu32 "\n",
             step, complete, zc_client_num_shards(c), loadable, zc_client_num_shards(c), written);
    first = 0;
  }
  if (o.json)
    printf("],\"shards\":%" PRIu32 "}\n", zc_client_num_shards(c));
  free(pos);
  status = 0;
done:
  if (lists)
    for (uint32_t i = 0; i < zc_client_num_shards(c); i++)
      if (lists[i])
        protobuf_c_message_free_unpacked(&lists[i]->base, NULL);
  free(lists);
  zs_client_close(c);
  return status;
}

/* ------------------------------------------------------------ offline */

/* The checkpoint root and step an IN argument names: ".../step-<s>" with a
 * MANIFEST is that step; anything else is a root whose newest complete
 * checkpoint (or `step` when given) is meant. */
static int resolve_in(const char *in, int step_given, uint64_t step_opt, char *root, size_t len,
                      uint64_t *step) {
  char manifest[CKPT_PATH_MAX];
  const char *base = strrchr(in, '/');
  base = base ? base + 1 : in;
  uint64_t s;
  struct stat sb;
  if (strncmp(base, "step-", 5) == 0 && parse_u64(base + 5, &s) == 0 &&
      snprintf(manifest, sizeof manifest, "%s/%s", in, CKPT_MANIFEST) < (int)sizeof manifest &&
      stat(manifest, &sb) == 0) {
    int n = (int)(base - in);
    snprintf(root, len, "%.*s", n > 1 ? n - 1 : n, n ? in : ".");
    if (step_given && step_opt != s) {
      fprintf(stderr, "zshard: %s is step %" PRIu64 ", not --step %" PRIu64 "\n", in, s, step_opt);
      return -1;
    }
    *step = s;
    return 0;
  }
  snprintf(root, len, "%s", in);
  if (step_given) {
    *step = step_opt;
    return 0;
  }
  ckpt_entry *e = NULL;
  size_t n = 0;
  char err[512];
  if (ckpt_list(root, &e, &n, err, sizeof err) != 0) {
    fprintf(stderr, "zshard: %s\n", err);
    return -1;
  }
  int found = 0;
  for (size_t i = n; i-- > 0 && !found;) {
    if (e[i].complete) {
      *step = e[i].step;
      found = 1;
    }
  }
  free(e);
  if (!found)
    fprintf(stderr, "zshard: %s holds no complete checkpoint\n", root);
  return found ? 0 : -1;
}

static const char reshard_usage[] =
    "usage: zshard reshard IN OUT --shards N [--step S]\n"
    "  Rewrites a checkpoint for N shards: IN is a state directory (its newest\n"
    "  complete checkpoint, or --step) or a step directory; the result is\n"
    "  OUT/step-<s>/shard-<i>-of-<N>.zsc and its MANIFEST. Every file of IN is\n"
    "  verified as it is read. OUT must not be IN's directory.\n";

int cli_reshard(int argc, char **argv) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 'n'},
                                       {"step", required_argument, NULL, 'S'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  uint64_t n = 0, step_opt = 0;
  int step_given = 0;
  optind = 1;
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'n':
      if (parse_u64(optarg, &n) != 0 || n == 0 || n > 4096)
        return usage_error("reshard", reshard_usage, "--shards must be 1..4096");
      break;
    case 'S':
      if (parse_u64(optarg, &step_opt) != 0)
        return usage_error("reshard", reshard_usage, "--step must be a whole number");
      step_given = 1;
      break;
    case 'h':
      fputs(reshard_usage, stdout);
      return 0;
    default:
      return usage_error("reshard", reshard_usage, "unknown option or missing value");
    }
  }
  if (argc - optind != 2 || n == 0)
    return usage_error("reshard", reshard_usage, "IN, OUT and --shards N are required");
  const char *in = argv[optind], *out = argv[optind + 1];
  char root[CKPT_PATH_MAX], err[700];
  uint64_t step;
  if (resolve_in(in, step_given, step_opt, root, sizeof root, &step) != 0)
    return 1;
  char rin[PATH_MAX], rout[PATH_MAX];
  if (ckpt_mkdirs(out, err, sizeof err) != 0) {
    fprintf(stderr, "zshard reshard: %s\n", err);
    return 1;
  }
  if (realpath(root, rin) && realpath(out, rout) && strcmp(rin, rout) == 0) {
    fprintf(stderr, "zshard reshard: OUT is IN's directory; write to another one\n");
    return 1;
  }
  uint64_t t0 = clock_now_ns();
  ckpt_manifest m;
  memset(&m, 0, sizeof m);
  m.num_shards = (uint32_t)n;
  m.step = step;
  m.files = calloc(n, sizeof *m.files);
  if (!m.files)
    return 1;
  uint32_t source = 0;
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n; i++) {
    core_state st;
    int rc = ckpt_load(root, step, i, (uint32_t)n, &st, err, sizeof err);
    if (rc == 0) {
      rc = ckpt_write_shard(out, &st, NULL, &m.files[i], err, sizeof err);
      m.version = st.version;
      m.optimizer_steps = st.optimizer_steps;
      m.spec_hash = spec_hash(&st.spec);
      core_state_free(&st);
    }
    if (rc != 0) {
      fprintf(stderr, "zshard reshard: %s\n", err);
      ckpt_manifest_free(&m);
      return 1;
    }
    bytes += m.files[i].bytes;
  }
  ckpt_manifest src;
  if (ckpt_manifest_read(root, step, &src, NULL, 0) == 0) {
    source = src.num_shards;
    ckpt_manifest_free(&src);
  }
  int rc = ckpt_manifest_write(out, &m, 0, err, sizeof err);
  ckpt_manifest_free(&m);
  if (rc != 0) {
    fprintf(stderr, "zshard reshard: %s\n", err);
    return 1;
  }
  char b[32];
  printf("resharded checkpoint step %" PRIu64 " from %" PRIu32 " to %" PRIu64
         " shards into %s/step-%" PRIu64 " (%s, %.1f ms)\n",
         step, source, n, out, step, cli_bytes((double)bytes, b, sizeof b),
         (double)(clock_now_ns() - t0) / 1e6);
  return 0;
}

static const char export_usage[] =
    "usage: zshard export IN OUT.safetensors [--step S] [--dtype fp32|bf16|fp16] [--moments]\n"
    "  Writes a checkpoint's full tensors (names and shapes from the model spec) as\n"
    "  one safetensors file that torch and safetensors load. --moments adds the\n"
    "  optimizer state as \"<name>.exp_avg\" and \"<name>.exp_avg_sq\" (Adam, AdamW)\n"
    "  or \"<name>.momentum_buffer\" (SGD), in fp32. IN as for `zshard reshard`.\n";

int cli_export(int argc, char **argv) {
  static const struct option opts[] = {{"step", required_argument, NULL, 'S'},
                                       {"dtype", required_argument, NULL, 'd'},
                                       {"moments", no_argument, NULL, 'm'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  ckpt_export_opts eo = {.dtype = ZS_DTYPE_FP32, .moments = 0};
  uint64_t step_opt = 0;
  int step_given = 0;
  optind = 1;
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'S':
      if (parse_u64(optarg, &step_opt) != 0)
        return usage_error("export", export_usage, "--step must be a whole number");
      step_given = 1;
      break;
    case 'd':
      if (strcmp(optarg, "fp32") == 0)
        eo.dtype = ZS_DTYPE_FP32;
      else if (strcmp(optarg, "bf16") == 0)
        eo.dtype = ZS_DTYPE_BF16;
      else if (strcmp(optarg, "fp16") == 0)
        eo.dtype = ZS_DTYPE_FP16;
      else
        return usage_error("export", export_usage, "--dtype is fp32, bf16 or fp16");
      break;
    case 'm':
      eo.moments = 1;
      break;
    case 'h':
      fputs(export_usage, stdout);
      return 0;
    default:
      return usage_error("export", export_usage, "unknown option or missing value");
    }
  }
  if (argc - optind != 2)
    return usage_error("export", export_usage, "IN and OUT are required");
  const char *in = argv[optind], *out = argv[optind + 1];
  char root[CKPT_PATH_MAX], err[700];
  uint64_t step;
  if (resolve_in(in, step_given, step_opt, root, sizeof root, &step) != 0)
    return 1;
  uint64_t t0 = clock_now_ns();
  if (ckpt_export_safetensors(root, step, out, &eo, err, sizeof err) != 0) {
    fprintf(stderr, "zshard export: %s\n", err);
    return 1;
  }
  struct stat sb;
  char b[32];
  printf("exported checkpoint step %" PRIu64 " to %s (%s, %s%s, %.1f ms)\n", step, out,
         cli_bytes(stat(out, &sb) == 0 ? (double)sb.st_size : 0, b, sizeof b),
         eo.dtype == ZS_DTYPE_BF16   ? "bf16"
         : eo.dtype == ZS_DTYPE_FP16 ? "fp16"
                                     : "fp32",
         eo.moments ? " with moments" : "", (double)(clock_now_ns() - t0) / 1e6);
  return 0;
}
