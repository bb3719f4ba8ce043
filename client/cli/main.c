/*
 * zshard — the operator's command line tool.
 *
 *   zshard status   --shards LIST [--json]     one row per shard (per member
 *                                              of a replicated one)
 *   zshard estimate --params P ... [--json]    memory and traffic, zshard vs
 *                                              DP and ZeRO-1/2/3
 *   zshard checkpoint | restore | checkpoints   checkpoints of a running job
 *   zshard close-job --shards LIST              frees the job on every shard
 *   zshard reshard | export                     checkpoint files, offline
 *   zshard import   --shards LIST FILE          a safetensors or .pt file into the
 *                                              open job's master weights
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "zshard/zshard.h"

const char *cli_bytes(double bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (fabs(bytes) >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%.0f %s", bytes, units[u]);
  else
    snprintf(buf, len, "%.1f %s", bytes, units[u]);
  return buf;
}

int cli_parse_count(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || !isfinite(v) || v < 0)
    return -1;
  double mul = 1;
  if (*end) {
    switch (*end) {
    case 'k':
    case 'K':
      mul = 1e3;
      break;
    case 'm':
    case 'M':
      mul = 1e6;
      break;
    case 'b':
    case 'B':
    case 'g':
    case 'G':
      mul = 1e9;
      break;
    case 't':
    case 'T':
      mul = 1e12;
      break;
    default:
      return -1;
    }
    if (end[1] != '\0')
      return -1;
  }
  v *= mul;
  if (v >= 1.8e19)
    return -1;
  *out = (uint64_t)llround(v);
  return 0;
}

/* The security flags every subcommand takes, and the environment variable
 * each one sets: the subcommands reach the shards through libzshard, which
 * reads these variables when a client or channel opens (zshard.h), so a flag
 * here is exactly the variable set for this run. */
static const struct {
  const char *flag, *env;
} security_flags[] = {
    {"--token", "ZSHARD_TOKEN"},     {"--token-file", "ZSHARD_TOKEN_FILE"},
    {"--tls-ca", "ZSHARD_TLS_CA"},   {"--tls-cert", "ZSHARD_TLS_CERT"},
    {"--tls-key", "ZSHARD_TLS_KEY"}, {"--tls-server-name", "ZSHARD_TLS_SERVER_NAME"},
};
#define N_SECURITY_FLAGS (sizeof security_flags / sizeof security_flags[0])

static const char security_usage[] =
    "options of every command that talks to the shards (each also an environment variable):\n"
    "  --token TOKEN          the shards' token (ZSHARD_TOKEN; visible in `ps`: prefer\n"
    "                         --token-file)\n"
    "  --token-file PATH      read the token from PATH's first line (ZSHARD_TOKEN_FILE)\n"
    "  --tls-ca PATH          speak TLS and check the shards' certificates against this\n"
    "                         PEM CA bundle (ZSHARD_TLS_CA)\n"
    "  --tls-cert PATH        this client's certificate, for mTLS (ZSHARD_TLS_CERT)\n"
    "  --tls-key PATH         its private key (ZSHARD_TLS_KEY)\n"
    "  --tls-server-name NAME the name the shards' certificates carry, when not the\n"
    "                         host of --shards (ZSHARD_TLS_SERVER_NAME)\n";

/* Takes the security flags ("--flag VALUE" or "--flag=VALUE") out of argv,
 * setting their variables; returns the new argc, or -1 after printing why. */
static int take_security_flags(int argc, char **argv) {
  int out = 0;
  for (int i = 0; i < argc; i++) {
    size_t k = 0;
    const char *value = NULL;
    for (; k < N_SECURITY_FLAGS; k++) {
      size_t n = strlen(security_flags[k].flag);
      if (strcmp(argv[i], security_flags[k].flag) == 0) {
        if (i + 1 >= argc) {
          fprintf(stderr, "zshard: %s needs a value\n", argv[i]);
          return -1;
        }
        value = argv[++i];
        break;
      }
      if (strncmp(argv[i], security_flags[k].flag, n) == 0 && argv[i][n] == '=') {
        value = argv[i] + n + 1;
        break;
      }
    }
    if (!value) {
      argv[out++] = argv[i];
      continue;
    }
    setenv(security_flags[k].env, value, 1);
    /* A token given on the command line wins over a token file in the
     * environment, and the other way round. */
    if (strcmp(security_flags[k].env, "ZSHARD_TOKEN_FILE") == 0)
      unsetenv("ZSHARD_TOKEN");
  }
  argv[out] = NULL;
  return out;
}

static void usage(FILE *f) {
  fprintf(f, "usage: zshard <command> [options]\n"
             "\n"
             "commands:\n"
             "  status     health, version, state size and uptime of every shard; role and\n"
             "             term of every member of a replicated one (--shards h:p|h:p,...)\n"
             "  estimate   memory per device and per shard, bytes on the wire and the\n"
             "             communication lower bound per step: zshard beside DP and ZeRO-1/2/3\n"
             "  checkpoint checkpoint the running job on every shard\n"
             "  restore    roll every shard back to a checkpoint\n"
             "  checkpoints list the checkpoints every shard holds\n"
             "  close-job  close the job on every shard, ready for the next one\n"
             "  reshard    rewrite a checkpoint for another shard count (offline)\n"
             "  export     write a checkpoint as one safetensors file (offline)\n"
             "  import     write a safetensors or .pt file into the open job's master weights\n"
             "  bench      load-test a running cluster: push/pull throughput and latency\n"
             "  mint-rank-token\n"
             "             print a token that may push only as one rank of one job\n"
             "  version    print the library version\n"
             "\n"
             "`zshard <command> --help` describes a command's options.\n"
             "\n");
  fputs(security_usage, f);
}

/* bench.c (declared here rather than in cli.h, which belongs to others). */
int cli_bench(int argc, char **argv);
/* jobs.c */
int cli_close_job(int argc, char **argv);
/* import.c */
int cli_import(int argc, char **argv);
/* mint.c */
int cli_mint_rank_token(int argc, char **argv);

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  argc = take_security_flags(argc, argv);
  if (argc < 0)
    return 2;
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "status") == 0)
    return cli_status(argc - 1, argv + 1);
  if (strcmp(cmd, "estimate") == 0)
    return cli_estimate(argc - 1, argv + 1);
  if (strcmp(cmd, "checkpoint") == 0)
    return cli_checkpoint(argc - 1, argv + 1);
  if (strcmp(cmd, "restore") == 0)
    return cli_restore(argc - 1, argv + 1);
  if (strcmp(cmd, "checkpoints") == 0)
    return cli_checkpoints(argc - 1, argv + 1);
  if (strcmp(cmd, "reshard") == 0)
    return cli_reshard(argc - 1, argv + 1);
  if (strcmp(cmd, "export") == 0)
    return cli_export(argc - 1, argv + 1);
  if (strcmp(cmd, "import") == 0)
    return cli_import(argc - 1, argv + 1);
  if (strcmp(cmd, "close-job") == 0)
    return cli_close_job(argc - 1, argv + 1);
  if (strcmp(cmd, "bench") == 0)
    return cli_bench(argc - 1, argv + 1);
  if (strcmp(cmd, "mint-rank-token") == 0)
    return cli_mint_rank_token(argc - 1, argv + 1);
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("zshard %s\n", zs_version());
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    usage(stdout);
    return 0;
  }
  fprintf(stderr, "zshard: unknown command '%s'\n", cmd);
  usage(stderr);
  return 2;
}
