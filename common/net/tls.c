/*
 * tls — TLS 1.3 contexts (see tls.h).
 *
 * A tls_ctx holds the file names it was made from and the OpenSSL SSL_CTX
 * loaded from them. The SSL_CTX is reference-counted by OpenSSL: every
 * session (SSL) takes a reference, so tls_ctx_reload can swap in a newly
 * loaded one under the mutex and drop its own reference to the old one,
 * which goes when its last session does.
 */
#include "common/net/tls.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "common/base/status.h"

/* AES-128-GCM first: with AES-NI it is the cheapest of the three, and the
 * data plane's throughput is bound by the cipher. */
#define TLS_SUITES "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"

struct tls_ctx {
  int server;
  char *cert_file, *key_file, *ca_file, *server_name;
  pthread_mutex_t mu; /* guards ssl_ctx */
  SSL_CTX *ssl_ctx;
};

const char *tls_error_text(void *session, const char *fallback, char *buf, size_t len) {
  unsigned long e = ERR_get_error();
  const char *reason = e ? ERR_reason_error_string(e) : NULL;
  char other[64];
  if (e && !reason) {
    /* A system error (a file that cannot be opened) has no reason string of
     * OpenSSL's own; its number is errno. */
    if (ERR_GET_LIB(e) == ERR_LIB_SYS)
      reason = strerror(ERR_GET_REASON(e));
    else {
      snprintf(other, sizeof other, "OpenSSL error %lx", e);
      reason = other;
    }
  }
  long verify = session ? SSL_get_verify_result((SSL *)session) : X509_V_OK;
  if (verify != X509_V_OK)
    status_say(buf, len, "%s: %s", reason ? reason : "certificate verify failed",
               X509_verify_cert_error_string(verify));
  else
    status_say(buf, len, "%s", reason ? reason : fallback);
  ERR_clear_error();
  return buf;
}

/* A new SSL_CTX from c's files into *out: 0, or ZS_ENOMEM / ZS_EINVAL with
 * a sentence in err. */
static int load(const tls_ctx *c, SSL_CTX **out, char *err, size_t errlen) {
  char why[256];
  ERR_clear_error();
  SSL_CTX *x = SSL_CTX_new(c->server ? TLS_server_method() : TLS_client_method());
  if (!x)
    return status_fail(err, errlen, ZS_ENOMEM, "cannot create a TLS context: %s",
                       tls_error_text(NULL, "out of memory", why, sizeof why));
  const char *what = "the TLS settings", *file = "";
  if (!SSL_CTX_set_min_proto_version(x, TLS1_3_VERSION) || !SSL_CTX_set_ciphersuites(x, TLS_SUITES))
    goto fail;
  /* No session tickets: the data plane's connections are long-lived, and a
   * ticket is bytes on every handshake that nothing would use. */
  SSL_CTX_set_num_tickets(x, 0);
  /* One record per SSL_read: after a record that carries no data (a key
   * update), OpenSSL must return rather than read on, because stream_tls.c
   * hands it only whole records and finds where they start in its buffer. */
  SSL_CTX_clear_mode(x, SSL_MODE_AUTO_RETRY);
  SSL_CTX_set_mode(x, SSL_MODE_RELEASE_BUFFERS);
  if (c->cert_file) {
    what = "the TLS certificate";
    file = c->cert_file;
    if (SSL_CTX_use_certificate_chain_file(x, c->cert_file) != 1)
      goto fail;
    what = "the TLS private key";
    file = c->key_file;
    if (SSL_CTX_use_PrivateKey_file(x, c->key_file, SSL_FILETYPE_PEM) != 1)
      goto fail;
    what = "the TLS private key against its certificate";
    if (SSL_CTX_check_private_key(x) != 1)
      goto fail;
  }
  if (c->ca_file) {
    what = c->server ? "the TLS client CA bundle" : "the TLS CA bundle";
    file = c->ca_file;
    if (SSL_CTX_load_verify_locations(x, c->ca_file, NULL) != 1)
      goto fail;
    int mode = SSL_VERIFY_PEER;
    if (c->server) {
      /* Mutual TLS: a client without a certificate is refused. */
      mode |= SSL_VERIFY_FAIL_IF_NO_PEER_CERT;
      STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(c->ca_file);
      if (names)
        SSL_CTX_set_client_CA_list(x, names);
    }
    SSL_CTX_set_verify(x, mode, NULL);
  }
  *out = x;
  return 0;
fail:
  SSL_CTX_free(x);
  return status_fail(err, errlen, ZS_EINVAL, "cannot load %s%s%s: %s", what, file[0] ? " " : "",
                     file, tls_error_text(NULL, "unknown OpenSSL error", why, sizeof why));
}

/* Copies s (NULL stays NULL) into *out; 0 or ZS_ENOMEM. */
static int dup_opt(const char *s, char **out) {
  *out = NULL;
  if (!s)
    return 0;
  *out = strdup(s);
  return *out ? 0 : ZS_ENOMEM;
}

static int ctx_new(int server, const char *cert, const char *key, const char *ca, const char *name,
                   tls_ctx **out, char *err, size_t errlen) {
  *out = NULL;
  tls_ctx *c = calloc(1, sizeof *c);
  if (!c)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  c->server = server;
  if (dup_opt(cert, &c->cert_file) || dup_opt(key, &c->key_file) || dup_opt(ca, &c->ca_file) ||
      dup_opt(name, &c->server_name) || pthread_mutex_init(&c->mu, NULL) != 0) {
    free(c->cert_file);
    free(c->key_file);
    free(c->ca_file);
    free(c->server_name);
    free(c);
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  }
  int rc = load(c, &c->ssl_ctx, err, errlen);
  if (rc != 0) {
    tls_ctx_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

int tls_server_new(const char *cert_file, const char *key_file, const char *client_ca_file,
                   tls_ctx **out, char *err, size_t errlen) {
  if (!out)
    return status_fail(err, errlen, ZS_EINVAL, "no place for the TLS context");
  *out = NULL;
  if (!cert_file || !cert_file[0] || !key_file || !key_file[0])
    return status_fail(err, errlen, ZS_EINVAL,
                       "a TLS server needs both a certificate and a private key file");
  if (client_ca_file && !client_ca_file[0])
    client_ca_file = NULL;
  return ctx_new(1, cert_file, key_file, client_ca_file, NULL, out, err, errlen);
}

int tls_client_new(const char *ca_file, const char *cert_file, const char *key_file,
                   const char *server_name, tls_ctx **out, char *err, size_t errlen) {
  if (!out)
    return status_fail(err, errlen, ZS_EINVAL, "no place for the TLS context");
  *out = NULL;
  if (!ca_file || !ca_file[0])
    return status_fail(err, errlen, ZS_EINVAL, "a TLS client needs a CA bundle to trust");
  int has_cert = cert_file && cert_file[0], has_key = key_file && key_file[0];
  if (has_cert != has_key)
    return status_fail(err, errlen, ZS_EINVAL,
                       "a TLS client certificate needs its private key, and a key its certificate");
  if (server_name && !server_name[0])
    server_name = NULL;
  return ctx_new(0, has_cert ? cert_file : NULL, has_key ? key_file : NULL, ca_file, server_name,
                 out, err, errlen);
}

int tls_ctx_reload(tls_ctx *c, char *err, size_t errlen) {
  SSL_CTX *x = NULL;
  int rc = load(c, &x, err, errlen);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  SSL_CTX *old = c->ssl_ctx;
  c->ssl_ctx = x;
  pthread_mutex_unlock(&c->mu);
  SSL_CTX_free(old);
  return 0;
}

int tls_ctx_is_server(const tls_ctx *c) {
  return c->server;
}

const char *tls_ctx_server_name(const tls_ctx *c) {
  return c->server_name;
}

void *tls_ctx_session(tls_ctx *c) {
  pthread_mutex_lock(&c->mu);
  SSL *s = SSL_new(c->ssl_ctx);
  pthread_mutex_unlock(&c->mu);
  return s;
}

void tls_ctx_free(tls_ctx *c) {
  if (!c)
    return;
  SSL_CTX_free(c->ssl_ctx);
  pthread_mutex_destroy(&c->mu);
  free(c->cert_file);
  free(c->key_file);
  free(c->ca_file);
  free(c->server_name);
  free(c);
}
