/*
 * hostport — the one reader of "host:port" text: listen addresses (server
 * options, metrics), shard addresses (client options, CLI) and data-plane
 * addresses all go through it, so they accept the same forms and refuse the
 * others with the same sentences.
 *
 * Accepted: "name:port", "1.2.3.4:port", "[v6 address]:port" (an IPv6
 * address needs its brackets, as in a URL, because its own colons would
 * otherwise be taken for the port's) and ":port" (an empty host, which
 * listeners take as every interface). The port is 0..65535 in decimal
 * without a sign. The host is not resolved here.
 */
#ifndef ZSHARD_COMMON_HOSTPORT_H
#define ZSHARD_COMMON_HOSTPORT_H

#include <stddef.h>
#include <stdint.h>

#define HOSTPORT_HOST_MAX 256 /* bytes of a host, with its NUL */
/* Room for any host that fits HOSTPORT_HOST_MAX, its brackets and a port. */
#define HOSTPORT_TEXT_MAX (HOSTPORT_HOST_MAX + 8)

typedef struct hostport {
  char host[HOSTPORT_HOST_MAX]; /* without brackets; "" when none was given */
  uint16_t port;
} hostport;

/* Reads `text` (only read during the call) into *out. Returns 0, or
 * ZS_EINVAL with a sentence naming the text in err (which may be NULL);
 * *out is then unspecified. */
int hostport_parse(const char *text, hostport *out, char *err, size_t errlen);

/* Writes host and port as text hostport_parse reads back: "host:port", or
 * "[host]:port" when the host holds a colon (an IPv6 address). Returns 0, or
 * ZS_EINVAL (buf then holds a cut string) when len is too small. */
int hostport_format(char *buf, size_t len, const char *host, unsigned port);

#endif
