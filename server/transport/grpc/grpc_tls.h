/*
 * grpc_tls — the gRPC server's certificate, key and client CA, reloadable
 * without a restart.
 *
 * gRPC asks a certificate-config fetcher for the server's TLS settings when
 * the port is added and again before every TLS handshake; the fetcher here
 * answers "unchanged" until gtls_reload has read a new set of files, then
 * hands that set over once. Connections already established keep the
 * certificate they were made with.
 *
 * Threads: gtls_reload may run on any thread (main, on SIGHUP) while gRPC's
 * threads call the fetcher; a mutex of this module, a leaf, guards the set
 * waiting to be handed over.
 */
#ifndef ZSHARD_SERVER_GRPC_TLS_H
#define ZSHARD_SERVER_GRPC_TLS_H

#include <grpc/grpc_security.h>
#include <stddef.h>

typedef struct gtls gtls;

/* Reads the PEM files (cert_file and key_file required; client_ca_file
 * NULL: client certificates are neither asked for nor checked; given:
 * every client must present one that chains to it). The paths are copied
 * for reloads. Returns 0 and the settings in *out (the caller's, freed with
 * gtls_free after the gRPC server that uses them is destroyed), or ZS_EINVAL
 * / ZS_ENOMEM with the file and the reason in err. */
int gtls_new(const char *cert_file, const char *key_file, const char *client_ca_file, gtls **out,
             char *err, size_t errlen);

/* New server credentials (the caller's, released with
 * grpc_server_credentials_release once given to grpc_server_add_http2_port)
 * that fetch their certificates from `t`; `t` must outlive them. */
grpc_server_credentials *gtls_credentials(gtls *t);

/* Rereads the files given to gtls_new; the new set is used from the next
 * handshake on. On an error the set in use stays and err says why; returns
 * 0, ZS_EINVAL or ZS_ENOMEM. Both check with OpenSSL that the key belongs
 * to the certificate (a pair gRPC would reject when it takes it, logging in
 * its own words and keeping the old one). */
int gtls_reload(gtls *t, char *err, size_t errlen);

/* NULL is accepted. */
void gtls_free(gtls *t);

#endif
