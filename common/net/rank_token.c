/*
 * rank_token — mint and verify per-rank tokens (rank_token.h). The MAC is
 * OpenSSL's one-shot HMAC; the compare is CRYPTO_memcmp, whose time does not
 * depend on where the first differing byte is.
 */
#include "common/net/rank_token.h"

#include <inttypes.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <string.h>

#include "common/base/status.h"

#define MAC_LEN 32u

static int fail(char *err, size_t errlen, const char *why) {
  if (err && errlen)
    snprintf(err, errlen, "rank token: %s", why);
  return ZS_EUNAUTHENTICATED;
}

int rank_token_is(const char *token, size_t len) {
  size_t p = sizeof RANK_TOKEN_PREFIX - 1;
  return token && len >= p && memcmp(token, RANK_TOKEN_PREFIX, p) == 0;
}

/* '.' is allowed in a job name (the token is parsed from its right end);
 * '|' is the MAC input's separator and would let two claims sign alike. */
static int job_ok(const char *job, size_t n) {
  if (n == 0 || n > RANK_TOKEN_MAX_JOB)
    return 0;
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)job[i] < 0x21 || (unsigned char)job[i] > 0x7e || job[i] == '|')
      return 0;
  return 1;
}

static int mac(const unsigned char *key, size_t keylen, const char *job, size_t joblen,
               uint32_t rank, uint64_t expiry, unsigned char out[MAC_LEN]) {
  char msg[RANK_TOKEN_MAX + 8];
  int n =
      snprintf(msg, sizeof msg, "zsr1|%.*s|%" PRIu32 "|%" PRIu64, (int)joblen, job, rank, expiry);
  unsigned int outlen = 0;
  if (n < 0 || (size_t)n >= sizeof msg ||
      !HMAC(EVP_sha256(), key, (int)keylen, (const unsigned char *)msg, (size_t)n, out, &outlen) ||
      outlen != MAC_LEN)
    return -1;
  return 0;
}

int rank_token_mint(const unsigned char *key, size_t keylen, const char *job, uint32_t rank,
                    uint64_t expiry, char *out, size_t outlen, char *err, size_t errlen) {
  size_t jl = job ? strlen(job) : 0;
  unsigned char m[MAC_LEN];
  if (!job_ok(job, jl)) {
    if (err && errlen)
      snprintf(err, errlen,
               "a job name in a rank token must be 1 to %u printable ASCII bytes "
               "without spaces or '|'",
               RANK_TOKEN_MAX_JOB);
    return ZS_EINVAL;
  }
  if (keylen == 0 || mac(key, keylen, job, jl, rank, expiry, m) != 0) {
    if (err && errlen)
      snprintf(err, errlen, "could not compute the token's HMAC");
    return ZS_EINVAL;
  }
  char hex[2 * MAC_LEN + 1];
  for (size_t i = 0; i < MAC_LEN; i++)
    snprintf(hex + 2 * i, 3, "%02x", m[i]);
  int n = snprintf(out, outlen, RANK_TOKEN_PREFIX "%s.%" PRIu32 ".%" PRIu64 ".%s", job, rank,
                   expiry, hex);
  if (n < 0 || (size_t)n >= outlen) {
    if (err && errlen)
      snprintf(err, errlen, "no room for the token");
    return ZS_EINVAL;
  }
  return n;
}

/* A decimal field of 1 to maxdigits digits, no sign, no leading zero (one
 * spelling per number, so a token is not re-spelled past a blocklist), at
 * most `max`. */
static int parse_dec(const char *p, size_t n, size_t maxdigits, uint64_t max, uint64_t *out) {
  if (n == 0 || n > maxdigits || (n > 1 && p[0] == '0'))
    return -1;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (p[i] < '0' || p[i] > '9')
      return -1;
    uint64_t d = (uint64_t)(p[i] - '0');
    if (v > (max - d) / 10)
      return -1;
    v = v * 10 + d;
  }
  *out = v;
  return 0;
}

static int hexval(char ch) {
  if (ch >= '0' && ch <= '9')
    return ch - '0';
  if (ch >= 'a' && ch <= 'f')
    return ch - 'a' + 10;
  return -1;
}

/* The index of the last '.' in t[lo, hi), or SIZE_MAX. */
static size_t last_dot(const char *t, size_t lo, size_t hi) {
  for (size_t i = hi; i > lo; i--)
    if (t[i - 1] == '.')
      return i - 1;
  return SIZE_MAX;
}

int rank_token_verify(const unsigned char *key, size_t keylen, const char *token, size_t len,
                      uint64_t now, rank_claim *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  if (!rank_token_is(token, len))
    return fail(err, errlen, "does not start with \"zsr1.\"");
  if (len >= RANK_TOKEN_MAX)
    return fail(err, errlen, "too long");
  size_t lo = sizeof RANK_TOKEN_PREFIX - 1;
  size_t d3 = last_dot(token, lo, len);
  size_t d2 = d3 == SIZE_MAX ? SIZE_MAX : last_dot(token, lo, d3);
  size_t d1 = d2 == SIZE_MAX ? SIZE_MAX : last_dot(token, lo, d2);
  if (d1 == SIZE_MAX)
    return fail(err, errlen, "needs the fields zsr1.<job>.<rank>.<expiry>.<hmac>");
  uint64_t rank = 0, expiry = 0;
  if (!job_ok(token + lo, d1 - lo))
    return fail(err, errlen, "the job name is empty, too long or has bytes a job may not");
  if (parse_dec(token + d1 + 1, d2 - d1 - 1, 10, UINT32_MAX, &rank) != 0)
    return fail(err, errlen, "the rank is not a decimal below 2^32");
  if (parse_dec(token + d2 + 1, d3 - d2 - 1, 20, UINT64_MAX, &expiry) != 0)
    return fail(err, errlen, "the expiry is not a decimal Unix time");
  size_t hl = len - d3 - 1;
  unsigned char got[MAC_LEN], want[MAC_LEN];
  if (hl != 2 * MAC_LEN)
    return fail(err, errlen, "the HMAC must be 64 lower-case hex digits");
  for (size_t i = 0; i < MAC_LEN; i++) {
    int h = hexval(token[d3 + 1 + 2 * i]), l = hexval(token[d3 + 2 + 2 * i]);
    if (h < 0 || l < 0)
      return fail(err, errlen, "the HMAC must be 64 lower-case hex digits");
    got[i] = (unsigned char)(h << 4 | l);
  }
  if (keylen == 0 || mac(key, keylen, token + lo, d1 - lo, (uint32_t)rank, expiry, want) != 0)
    return fail(err, errlen, "could not compute the HMAC");
  int bad = CRYPTO_memcmp(got, want, MAC_LEN) != 0;
  OPENSSL_cleanse(want, sizeof want);
  if (bad)
    return fail(err, errlen, "the HMAC does not match (forged, or signed with another key)");
  if (expiry != 0 && now > expiry)
    return fail(err, errlen, "expired");
  memcpy(out->job, token + lo, d1 - lo);
  out->job[d1 - lo] = '\0';
  out->rank = (uint32_t)rank;
  out->expiry = expiry;
  return 0;
}
