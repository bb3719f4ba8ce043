/*
 * grpc_tls — reloadable TLS settings of the gRPC server (grpc_tls.h).
 */
#include "server/transport/grpc/grpc_tls.h"

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "common/net/rpc_client.h"

struct gtls {
  char *cert_file, *key_file, *ca_file; /* ca_file NULL: no client certificates */
  pthread_mutex_t lock;
  /* The set read last and not yet taken by gRPC (owned), under lock. */
  grpc_ssl_server_certificate_config *pending;
};

static void free_pem(char *pem) {
  if (pem) {
    /* A private key does not linger in freed memory. */
    memset(pem, 0, strlen(pem));
    free(pem);
  }
}

/* Checks with OpenSSL what gRPC would otherwise find only when it takes
 * the set: a certificate and a key that parse and belong together, and a
 * client CA with a certificate in it. gRPC reports a bad pair only in its
 * own log and keeps the old one, so a reload that said "ok" would lie. */
static int check_set(const gtls *t, const char *cert, const char *key, const char *ca, char *err,
                     size_t errlen) {
  BIO *cb = BIO_new_mem_buf(cert, -1), *kb = BIO_new_mem_buf(key, -1);
  BIO *ab = ca ? BIO_new_mem_buf(ca, -1) : NULL;
  X509 *x = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
  EVP_PKEY *k = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
  X509 *a = ab ? PEM_read_bio_X509(ab, NULL, NULL, NULL) : NULL;
  int rc = 0;
  if (!x)
    rc = status_fail(err, errlen, ZS_EINVAL, "--tls-cert '%s': no certificate OpenSSL can read",
                     t->cert_file);
  else if (!k)
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "--tls-key '%s': no private key OpenSSL can read (an encrypted key is not "
                     "supported)",
                     t->key_file);
  else if (X509_check_private_key(x, k) != 1)
    rc = status_fail(err, errlen, ZS_EINVAL, "--tls-key '%s' is not the key of --tls-cert '%s'",
                     t->key_file, t->cert_file);
  else if (ca && !a)
    rc = status_fail(err, errlen, ZS_EINVAL,
                     "--tls-client-ca '%s': no certificate OpenSSL can read", t->ca_file);
  X509_free(a);
  EVP_PKEY_free(k);
  X509_free(x);
  BIO_free(ab);
  BIO_free(kb);
  BIO_free(cb);
  ERR_clear_error(); /* the reason is in err; OpenSSL's queue is per thread */
  return rc;
}

/* Reads the three files into a new certificate config in *out, checked. */
static int read_set(const gtls *t, grpc_ssl_server_certificate_config **out, char *err,
                    size_t errlen) {
  char *cert = NULL, *key = NULL, *ca = NULL;
  int rc = rpc_read_pem_file(t->cert_file, "--tls-cert", &cert, err, errlen);
  if (rc == 0)
    rc = rpc_read_pem_file(t->key_file, "--tls-key", &key, err, errlen);
  if (rc == 0 && t->ca_file)
    rc = rpc_read_pem_file(t->ca_file, "--tls-client-ca", &ca, err, errlen);
  if (rc == 0 && !strstr(key, "PRIVATE KEY-----"))
    rc = status_fail(err, errlen, ZS_EINVAL, "--tls-key '%s': no private key in it", t->key_file);
  if (rc == 0 && !strstr(cert, "-----BEGIN CERTIFICATE-----"))
    rc = status_fail(err, errlen, ZS_EINVAL, "--tls-cert '%s': no certificate in it", t->cert_file);
  if (rc == 0)
    rc = check_set(t, cert, key, ca, err, errlen);
  if (rc == 0) {
    /* gRPC copies the strings. gRPC 1.51 aborts on a fetched config without
     * root certificates (ssl_security_connector.cc asserts them), so
     * without a client CA the server's own chain stands in: the server then
     * asks for no client certificate (gtls_credentials), and the roots are
     * never consulted. */
    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    *out = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &pair, 1);
    if (!*out)
      rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "cannot make the TLS settings");
  }
  free_pem(cert);
  free_pem(key);
  free_pem(ca);
  return rc;
}

int gtls_new(const char *cert_file, const char *key_file, const char *client_ca_file, gtls **out,
             char *err, size_t errlen) {
  *out = NULL;
  if (!cert_file || !key_file)
    return status_fail(err, errlen, ZS_EINVAL, "%s", "TLS needs both --tls-cert and --tls-key");
  gtls *t = calloc(1, sizeof *t);
  if (!t)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  pthread_mutex_init(&t->lock, NULL);
  if (!(t->cert_file = strdup(cert_file)) || !(t->key_file = strdup(key_file)) ||
      (client_ca_file && !(t->ca_file = strdup(client_ca_file)))) {
    gtls_free(t);
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  }
  int rc = read_set(t, &t->pending, err, errlen);
  if (rc) {
    gtls_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

/* gRPC's fetcher: the first call (when the port is added) and the first
 * after each reload take the pending set; every other call is answered
 * "unchanged", so a handshake costs no file read. */
static grpc_ssl_certificate_config_reload_status
fetch(void *user_data, grpc_ssl_server_certificate_config **config) {
  gtls *t = user_data;
  pthread_mutex_lock(&t->lock);
  grpc_ssl_server_certificate_config *p = t->pending;
  t->pending = NULL;
  pthread_mutex_unlock(&t->lock);
  if (!p)
    return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  *config = p; /* gRPC owns it now */
  return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
}

grpc_server_credentials *gtls_credentials(gtls *t) {
  grpc_ssl_client_certificate_request_type req =
      t->ca_file ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                 : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  grpc_ssl_server_credentials_options *o =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(req, fetch, t);
  if (!o)
    return NULL;
  return grpc_ssl_server_credentials_create_with_options(o);
}

int gtls_reload(gtls *t, char *err, size_t errlen) {
  grpc_ssl_server_certificate_config *fresh = NULL;
  int rc = read_set(t, &fresh, err, errlen);
  if (rc)
    return rc;
  pthread_mutex_lock(&t->lock);
  grpc_ssl_server_certificate_config *old = t->pending;
  t->pending = fresh;
  pthread_mutex_unlock(&t->lock);
  if (old) /* read by an earlier reload, never taken: no handshake since */
    grpc_ssl_server_certificate_config_destroy(old);
  return 0;
}

void gtls_free(gtls *t) {
  if (!t)
    return;
  if (t->pending)
    grpc_ssl_server_certificate_config_destroy(t->pending);
  free(t->cert_file);
  free(t->key_file);
  free(t->ca_file);
  pthread_mutex_destroy(&t->lock);
  free(t);
}
