/*
 * rank_token — per-rank credentials that a shard verifies without a
 * database: `zsr1.<job>.<rank>.<expiry>.<mac>`, where <mac> is the lower-case
 * hex of HMAC-SHA256(key, "zsr1|<job>|<rank>|<expiry>"), <rank> a decimal
 * below 2^32, <expiry> the Unix second after which the token is refused (0:
 * never). The job name may itself contain dots; the token is parsed from its
 * right end. Pure functions, any thread.
 */
#ifndef ZSHARD_COMMON_RANK_TOKEN_H
#define ZSHARD_COMMON_RANK_TOKEN_H

#include <stddef.h>
#include <stdint.h>

#define RANK_TOKEN_PREFIX "zsr1."
/* The longest job name a rank token may carry (the spec's limit). */
#define RANK_TOKEN_MAX_JOB 256u
/* Room for the longest token and its NUL. */
#define RANK_TOKEN_MAX (5u + RANK_TOKEN_MAX_JOB + 1u + 10u + 1u + 20u + 1u + 64u + 1u)

typedef struct rank_claim {
  char job[RANK_TOKEN_MAX_JOB + 1];
  uint32_t rank;
  uint64_t expiry; /* Unix seconds; 0: never */
} rank_claim;

/* 1 when `token` (len bytes) has the rank-token prefix: such a token is
 * judged by rank_token_verify only, never compared with the shared secrets. */
int rank_token_is(const char *token, size_t len);

/* Writes the token for (job, rank, expiry) signed with key (keylen bytes)
 * into out (outlen bytes, RANK_TOKEN_MAX is enough); returns its length, or
 * ZS_EINVAL (a job name empty, too long or with bytes a token may not carry:
 * space, control, non-ASCII, '|') with the reason in err. */
int rank_token_mint(const unsigned char *key, size_t keylen, const char *job, uint32_t rank,
                    uint64_t expiry, char *out, size_t outlen, char *err, size_t errlen);

/* Checks `token` (len bytes, not NUL-terminated): its shape, its MAC against
 * key (compared in constant time) and, when its expiry is not 0, that `now`
 * (Unix seconds) is not past it. Returns 0 and the claim in *out, or
 * ZS_EUNAUTHENTICATED with the reason in err (never the key or the MAC). */
int rank_token_verify(const unsigned char *key, size_t keylen, const char *token, size_t len,
                      uint64_t now, rank_claim *out, char *err, size_t errlen);

#endif
