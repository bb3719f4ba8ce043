/*
 * hostport — parsing and writing "host:port" (see hostport.h).
 */
#include "common/net/hostport.h"

#include <stdio.h>
#include <string.h>

#include "common/base/status.h"

int hostport_parse(const char *text, hostport *out, char *err, size_t errlen) {
  if (!text || !*text)
    return status_fail(err, errlen, ZS_EINVAL, "no address given");
  const char *host, *port;
  size_t hlen;
  if (text[0] == '[') {
    const char *close = strchr(text, ']');
    if (!close || close[1] != ':')
      return status_fail(err, errlen, ZS_EINVAL, "address \"%.300s\" is not [IPv6]:port", text);
    host = text + 1;
    hlen = (size_t)(close - host);
    port = close + 2;
  } else {
    /* The last colon, so that "a:b:7070" is reported as an IPv6 address
     * without brackets rather than as a bad port "b:7070". */
    const char *colon = strrchr(text, ':');
    if (!colon)
      return status_fail(err, errlen, ZS_EINVAL, "address \"%.300s\" has no :port", text);
    host = text;
    hlen = (size_t)(colon - text);
    if (memchr(host, ':', hlen))
      return status_fail(err, errlen, ZS_EINVAL,
                         "IPv6 address \"%.300s\" must be written [address]:port", text);
    port = colon + 1;
  }
  if (hlen >= sizeof out->host)
    return status_fail(err, errlen, ZS_EINVAL, "address \"%.300s...\" is too long", text);
  for (size_t i = 0; i < hlen; i++) {
    unsigned char ch = (unsigned char)host[i];
    /* No name or address holds these; refusing them here gives a sentence
     * about the text instead of a resolver's "name unknown". */
    if (ch <= ' ' || ch == 0x7f || ch == '/' || ch == ',' || ch == '[' || ch == ']')
      return status_fail(err, errlen, ZS_EINVAL,
                         "address \"%.300s\": the host holds a character no host name has (0x%02x)",
                         text, ch);
  }
  /* Decimal digits only: strtoul would take a sign, spaces and "0x". */
  unsigned long p = 0;
  size_t n = 0;
  for (; port[n] >= '0' && port[n] <= '9' && p <= 65535; n++)
    p = p * 10 + (unsigned long)(port[n] - '0');
  if (n == 0 || port[n] != '\0' || p > 65535)
    return status_fail(err, errlen, ZS_EINVAL,
                       "port \"%.40s\" of \"%.300s\" is not a number 0..65535", port, text);
  memcpy(out->host, host, hlen);
  out->host[hlen] = '\0';
  out->port = (uint16_t)p;
  return 0;
}

int hostport_format(char *buf, size_t len, const char *host, unsigned port) {
  int n = strchr(host, ':') ? snprintf(buf, len, "[%s]:%u", host, port)
                            : snprintf(buf, len, "%s:%u", host, port);
  return n < 0 || (size_t)n >= len ? ZS_EINVAL : 0;
}
