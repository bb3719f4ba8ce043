/*
 * tls_certs — test certificates made at run time with the openssl command
 * line tool in a fresh temporary directory (no private key is committed):
 * a CA, a server certificate from it for localhost and 127.0.0.1, a client
 * certificate from it, and a second, unrelated CA. For the tests and the
 * benchmarks of the TLS streams; header-only, so that each program that
 * includes it has its own static copy.
 */
#ifndef ZSHARD_TESTS_TLS_CERTS_H
#define ZSHARD_TESTS_TLS_CERTS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct tls_certs {
  char dir[64];
  char ca[128], other_ca[128];
  char server_crt[128], server_key[128];
  char client_crt[128], client_key[128];
} tls_certs;

/* Makes the certificates (EC P-256: quick to generate) into a new directory
 * under /tmp. Returns 0, or -1 when a command failed (its output was left on
 * stderr). */
static inline int tls_certs_make(tls_certs *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "/tmp/zs-tls-XXXXXX");
  if (!mkdtemp(c->dir))
    return -1;
  const char *key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "set -e; cd %s; "
           "openssl req -x509 %s -keyout ca.key -out ca.crt -days 2 -subj /CN=zshard-test-ca; "
           "openssl req -x509 %s -keyout other-ca.key -out other-ca.crt -days 2 "
           "-subj /CN=other-ca; "
           "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext; "
           "openssl req %s -keyout server.key -out server.csr -subj /CN=localhost; "
           "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
           "-out server.crt -days 2 -extfile server.ext; "
           "printf 'extendedKeyUsage=clientAuth\\n' > client.ext; "
           "openssl req %s -keyout client.key -out client.csr -subj /CN=trainer; "
           "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
           "-out client.crt -days 2 -extfile client.ext",
           c->dir, key, key, key, key);
  /* openssl's progress chatter goes away; its errors still reach stderr. */
  char quiet[2400];
  snprintf(quiet, sizeof quiet,
           "( %s ) >/dev/null 2>%s/openssl.log || { cat %s/openssl.log >&2; "
           "exit 1; }",
           cmd, c->dir, c->dir);
  if (system(quiet) != 0)
    return -1;
  snprintf(c->ca, sizeof c->ca, "%s/ca.crt", c->dir);
  snprintf(c->other_ca, sizeof c->other_ca, "%s/other-ca.crt", c->dir);
  snprintf(c->server_crt, sizeof c->server_crt, "%s/server.crt", c->dir);
  snprintf(c->server_key, sizeof c->server_key, "%s/server.key", c->dir);
  snprintf(c->client_crt, sizeof c->client_crt, "%s/client.crt", c->dir);
  snprintf(c->client_key, sizeof c->client_key, "%s/client.key", c->dir);
  return 0;
}

/* Removes the directory and everything in it. */
static inline void tls_certs_remove(const tls_certs *c) {
  if (!c->dir[0] || strncmp(c->dir, "/tmp/zs-tls-", 12) != 0)
    return;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", c->dir);
  if (system(cmd) != 0)
    fprintf(stderr, "cannot remove %s\n", c->dir);
}

#endif
