/*
 * addresses — the shard addresses a client is given: a pattern with "{i}"
 * per shard, or a comma-separated list (a shard's replicas joined with "|"),
 * and the host and port of one address (cli_support.h and internal.h).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "internal.h"

/* Shard i's text from a pattern: every "{i}" replaced by i. NULL on ENOMEM. */
static char *expand_pattern(const char *spec, uint32_t i) {
  char num[12];
  int nlen = snprintf(num, sizeof num, "%" PRIu32, i);
  size_t count = 0;
  for (const char *p = spec; (p = strstr(p, "{i}")); p += 3)
    count++;
  char *out = malloc(strlen(spec) + count * (size_t)nlen + 1);
  if (!out)
    return NULL;
  char *o = out;
  for (const char *p = spec;;) {
    const char *q = strstr(p, "{i}");
    size_t len = q ? (size_t)(q - p) : strlen(p);
    memcpy(o, p, len);
    o += len;
    if (!q)
      break;
    memcpy(o, num, (size_t)nlen);
    o += nlen;
    p = q + 3;
  }
  *o = '\0';
  return out;
}

/* The next shard of a list at *p (up to ',' or the end), trimmed of blanks;
 * *p moves past it. NULL on ENOMEM. */
static char *next_listed(const char **p) {
  const char *s = *p, *end = strchr(s, ',');
  size_t len = end ? (size_t)(end - s) : strlen(s);
  *p = end ? end + 1 : s + len;
  while (len && (*s == ' ' || *s == '\t'))
    s++, len--;
  while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
    len--;
  return strndup(s, len);
}

/* Checks shard i's text a; a replica set's text is replaced by its
 * normalised form (members trimmed). */
static int check_shard_text(uint32_t i, char **a) {
  if (strchr(*a, '|')) {
    char *norm = NULL;
    int rc = zc_shard_text_check(i, *a, &norm);
    if (rc == ZS_OK) {
      free(*a);
      *a = norm;
    }
    return rc;
  }
  hostport hp;
  char why[400];
  if (zc_address_hostport(*a, &hp, why, sizeof why) != ZS_OK)
    return zc_fail(ZS_EINVAL, "address %" PRIu32 " ('%s'): %s", i, *a, why);
  return ZS_OK;
}

int zc_parse_addresses(const char *spec, uint32_t num_shards, char ***out, uint32_t *count) {
  *out = NULL;
  *count = 0;
  if (!spec || !*spec)
    return zc_fail(ZS_EINVAL, "no shard addresses given");
  const int pattern = strstr(spec, "{i}") != NULL;
  uint32_t n = 0;
  if (pattern) {
    if (num_shards == 0)
      return zc_fail(ZS_EINVAL, "the address pattern '%s' needs num_shards, the number of shards",
                     spec);
    if (strchr(spec, ','))
      return zc_fail(ZS_EINVAL,
                     "the address pattern '%s' holds a ',': a pattern is one shard's address "
                     "(or its replicas separated by '|') with {i} for the shard's index",
                     spec);
    n = num_shards;
  } else {
    n = 1;
    for (const char *p = spec; *p; p++)
      n += *p == ',';
    if (num_shards != 0 && num_shards != n)
      return zc_fail(ZS_EINVAL, "%" PRIu32 " addresses given but num_shards is %" PRIu32, n,
                     num_shards);
  }
  if (n > SPEC_MAX_SHARDS)
    return zc_fail(ZS_EINVAL, "%" PRIu32 " shards, at most %u are supported", n, SPEC_MAX_SHARDS);
  char **addr = calloc(n, sizeof *addr);
  if (!addr)
    return zc_fail(ZS_ENOMEM, "out of memory");
  int rc = ZS_OK;
  const char *p = spec;
  for (uint32_t i = 0; i < n && rc == ZS_OK; i++) {
    addr[i] = pattern ? expand_pattern(spec, i) : next_listed(&p);
    rc = addr[i] ? check_shard_text(i, &addr[i]) : zc_fail(ZS_ENOMEM, "out of memory");
  }
  if (rc != ZS_OK) {
    zc_free_addresses(addr, n);
    return rc;
  }
  *out = addr;
  *count = n;
  return ZS_OK;
}

int zc_address_hostport(const char *addr, hostport *out, char *err, size_t errlen) {
  static const char *const schemes[] = {"dns:", "ipv4:", "ipv6:"};
  const char *text = addr;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    size_t n = strlen(schemes[i]);
    if (strncmp(text, schemes[i], n) == 0) {
      text += n;
      break;
    }
  }
  const char *slash = strrchr(text, '/');
  if (slash)
    text = slash + 1;
  int rc = hostport_parse(text, out, err, errlen);
  if (rc != 0)
    return rc;
  if (!out->host[0])
    return status_fail(err, errlen, ZS_EINVAL, "address \"%.300s\" has no host", addr);
  return ZS_OK;
}

void zc_free_addresses(char **addr, uint32_t n) {
  if (!addr)
    return;
  for (uint32_t i = 0; i < n; i++)
    free(addr[i]);
  free(addr);
}
