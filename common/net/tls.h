/*
 * tls — TLS 1.3 contexts from certificate and key files, for the data
 * plane's TLS streams (common/net/stream_tls.c): what a server presents and which
 * clients it admits, what a client trusts and which name it expects. OpenSSL
 * (Debian's libssl) does the work; this module only loads files, checks them
 * and turns the library's errors into sentences.
 *
 * A context is shared by every stream made from it, on any thread: streams
 * take a session from it under its lock, and tls_ctx_reload swaps the loaded
 * files in while they run (a session keeps the files it started with).
 *
 * Only TLS 1.3 is offered, with AES-128-GCM preferred (AES-NI makes it the
 * fastest; AES-256-GCM and ChaCha20-Poly1305 remain acceptable).
 */
#ifndef ZSHARD_COMMON_TLS_H
#define ZSHARD_COMMON_TLS_H

#include <stddef.h>

typedef struct tls_ctx tls_ctx;

/* A server context: the certificate chain in cert_file (PEM, the leaf first)
 * and its private key in key_file (PEM, unencrypted). With client_ca_file
 * (PEM bundle; may be NULL) every client must present a certificate signed by
 * one of those CAs (mutual TLS); without, clients are not asked for one.
 * The paths are copied (for tls_ctx_reload). Returns 0 and the context in
 * *out (the caller's, freed with tls_ctx_free), or ZS_EINVAL (a file cannot
 * be read, is not PEM, or the key does not match the certificate) /
 * ZS_ENOMEM with a sentence naming the file and OpenSSL's reason in err (may
 * be NULL). */
int tls_server_new(const char *cert_file, const char *key_file, const char *client_ca_file,
                   tls_ctx **out, char *err, size_t errlen);

/* A client context: servers must present a certificate chain to one of the
 * CAs in ca_file (PEM bundle) for the name they are dialled by. With
 * cert_file and key_file (both or neither; may be NULL) the client presents
 * that certificate when asked (mutual TLS). server_name (may be NULL) is the
 * name every server's certificate must carry, a DNS name (also sent as SNI)
 * or an IP address; NULL: the host each stream is dialled with
 * (stream_tls_dialer_new). Strings are copied. Returns as tls_server_new. */
int tls_client_new(const char *ca_file, const char *cert_file, const char *key_file,
                   const char *server_name, tls_ctx **out, char *err, size_t errlen);

/* Reads the context's files again (certificate rotation, on SIGHUP): 0 and
 * new sessions use them, or an error with a sentence in err and the context
 * unchanged. Sessions already running are not affected. Thread-safe. */
int tls_ctx_reload(tls_ctx *c, char *err, size_t errlen);

/* 1 for a server context, 0 for a client's. */
int tls_ctx_is_server(const tls_ctx *c);

/* The client context's server_name, or NULL (none given; or a server's). */
const char *tls_ctx_server_name(const tls_ctx *c);

/* Frees the context; sessions still running keep what they need. NULL is
 * accepted. */
void tls_ctx_free(tls_ctx *c);

/* For stream_tls.c: a new session (an OpenSSL SSL *) from the context's
 * current files, or NULL (out of memory). Thread-safe. */
void *tls_ctx_session(tls_ctx *c);

/* For stream_tls.c: OpenSSL's errors queued on this thread as one sentence
 * into buf ("<reason>" of the first error, then ": <verify result>" when a
 * certificate check failed on `session`, which may be NULL), clearing the
 * queue; `fallback` when nothing is queued. Returns buf. */
const char *tls_error_text(void *session, const char *fallback, char *buf, size_t len);

#endif
