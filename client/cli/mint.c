/*
 * zshard mint-rank-token — prints a per-rank token (common/net/rank_token.h)
 * signed with the key the shards were given as --rank-key-file. The admin
 * runs it once per job and rank and hands each trainer its own; a trainer
 * that holds one can push only as that rank of that job.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/net/auth.h"
#include "common/net/rank_token.h"

int cli_mint_rank_token(int argc, char **argv);

static void mint_usage(FILE *f) {
  fputs("usage: zshard mint-rank-token --key-file PATH --job NAME --rank R [--expires-in S]\n"
        "\n"
        "Prints a token that lets a trainer push only as rank R of job NAME on shards\n"
        "started with --rank-key-file PATH (the same key). --expires-in S: the token\n"
        "is refused S seconds from now (default: never). The key file is checked as\n"
        "the server checks it (not readable or writable by others).\n",
        f);
}

/* A decimal with nothing after it, at most max. */
static int parse_u64(const char *s, uint64_t max, uint64_t *out) {
  char *end = NULL;
  if (!s || !*s || *s == '-' || *s == '+')
    return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end || v > max)
    return -1;
  *out = v;
  return 0;
}

int cli_mint_rank_token(int argc, char **argv) {
  static const struct option opts[] = {
      {"key-file", required_argument, NULL, 'k'}, {"job", required_argument, NULL, 'J'},
      {"rank", required_argument, NULL, 'r'},     {"expires-in", required_argument, NULL, 'e'},
      {"help", no_argument, NULL, 'h'},           {NULL, 0, NULL, 0}};
  const char *key_file = NULL, *job = NULL, *rank_s = NULL, *exp_s = NULL;
  int ch;
  optind = 1;
  while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (ch) {
    case 'k':
      key_file = optarg;
      break;
    case 'J':
      job = optarg;
      break;
    case 'r':
      rank_s = optarg;
      break;
    case 'e':
      exp_s = optarg;
      break;
    case 'h':
      mint_usage(stdout);
      return 0;
    default:
      mint_usage(stderr);
      return 2;
    }
  }
  uint64_t rank = 0, expires_in = 0;
  if (!key_file || !job || !rank_s || optind != argc) {
    mint_usage(stderr);
    return 2;
  }
  if (parse_u64(rank_s, UINT32_MAX, &rank) != 0) {
    fprintf(stderr, "zshard mint-rank-token: --rank must be a whole number below 2^32\n");
    return 2;
  }
  /* Ten years at most: a longer life is a token nobody means to rotate. */
  if (exp_s && (parse_u64(exp_s, 315360000ull, &expires_in) != 0 || expires_in == 0)) {
    fprintf(stderr, "zshard mint-rank-token: --expires-in must be 1 to 315360000 seconds\n");
    return 2;
  }
  char key[AUTH_MAX_TOKEN + 1], err[600], token[RANK_TOKEN_MAX];
  int n = auth_read_token_file(key_file, key, sizeof key, err, sizeof err);
  if (n < 0) {
    fprintf(stderr, "zshard mint-rank-token: %s\n", err);
    return 1;
  }
  uint64_t expiry = expires_in ? (uint64_t)time(NULL) + expires_in : 0;
  int rc = rank_token_mint((const unsigned char *)key, (size_t)n, job, (uint32_t)rank, expiry,
                           token, sizeof token, err, sizeof err);
  memset(key, 0, sizeof key);
  if (rc < 0) {
    fprintf(stderr, "zshard mint-rank-token: %s\n", err);
    return 2;
  }
  printf("%s\n", token);
  return 0;
}
