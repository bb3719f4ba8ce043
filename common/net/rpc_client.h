/*
 * rpc_client — blocking unary gRPC calls over the gRPC C core API, carrying
 * protobuf-c messages. Used by the client library, the CLI and the tests.
 *
 * Threads: an rpc_channel may be used by any number of threads at once; each
 * call runs on the calling thread with its own completion queue, and gRPC
 * multiplexes concurrent calls over the channel's HTTP/2 connection.
 */
#ifndef ZSHARD_COMMON_RPC_CLIENT_H
#define ZSHARD_COMMON_RPC_CLIENT_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* Bulk messages: both ends raise gRPC's 4 MiB default to this for what they
 * send, and a client for what it receives (a Pull of a large piece). */
#define RPC_MAX_MESSAGE_BYTES (1024 * 1024 * 1024)
/* Reconnect backoff of every channel to a server that went away. */
#define RPC_RECONNECT_MIN_MS 50
#define RPC_RECONNECT_MAX_MS 500
/* A Push payload larger than this travels in chunks of exactly this many bytes
 * (PushRequest.offset and total); the server receives no message larger than
 * this plus RPC_HEADROOM_BYTES for the other fields of a message. */
#define RPC_PUSH_CHUNK_BYTES (64 * 1024 * 1024)
#define RPC_HEADROOM_BYTES (64 * 1024)

/* Largest PEM file (certificate chain, key, CA bundle) read. */
#define RPC_MAX_PEM_BYTES (1024 * 1024)
/* The metadata key and scheme a token travels in on every call. */
#define RPC_AUTH_KEY "authorization"
#define RPC_AUTH_SCHEME "Bearer "
/* The longest token sent (common/net/auth.h's AUTH_MAX_TOKEN). */
#define RPC_MAX_TOKEN_BYTES 4096

typedef struct rpc_channel rpc_channel;

/* gRPC's types, declared here so that only the files calling
 * rpc_message_slice include gRPC's headers. */
struct grpc_byte_buffer;
struct grpc_slice;

/* The message in `bb` (the caller's, only read) as one contiguous slice in
 * *out, a new reference the caller releases with grpc_slice_unref: a message
 * that gRPC holds in one uncompressed slice is referenced, not copied;
 * otherwise it is gathered (one copy). Returns 0, or -1 if the buffer cannot
 * be read (*out untouched). Used by both ends of a call. */
int rpc_message_slice(struct grpc_byte_buffer *bb, struct grpc_slice *out);

/* How a channel proves who it talks to and who it is. Every string is the
 * caller's and only read during rpc_channel_open_secure (the channel keeps
 * its own copies). */
typedef struct rpc_security {
  /* Sent as "authorization: Bearer <token>" on every call; NULL or "": no
   * token. */
  const char *token;
  /* PEM file of the CAs the server's certificate must chain to; NULL:
   * plaintext (and the three below must be NULL too). */
  const char *tls_ca_file;
  /* PEM files of this client's certificate chain and key, for a server that
   * requires client certificates (mTLS); both or neither. */
  const char *tls_cert_file;
  const char *tls_key_file;
  /* The name the server's certificate must carry; NULL: the target's host. */
  const char *tls_server_name;
} rpc_security;

/* Opens a plaintext channel without a token to `target` ("host:port"); the
 * connection is made lazily by the first call. Returns 0 or ZS_ENOMEM /
 * ZS_EINVAL. The channel is the caller's, closed with rpc_channel_close. */
int rpc_channel_open(const char *target, rpc_channel **out);

/* As rpc_channel_open, with the token and TLS settings of `sec` (NULL: as
 * rpc_channel_open). A PEM file that cannot be read, or a certificate
 * without its key, is ZS_EINVAL with the reason in err (may be NULL).
 * Certificates themselves are checked by the TLS handshake of the first
 * call, whose failure that call reports (ZS_EUNAVAILABLE). */
int rpc_channel_open_secure(const char *target, const rpc_security *sec, rpc_channel **out,
                            char *err, size_t errlen);
void rpc_channel_close(rpc_channel *ch);

/* Reads a whole PEM file (a regular file of at most RPC_MAX_PEM_BYTES that
 * contains "-----BEGIN ") into a NUL-terminated string the caller frees
 * with free(). Returns 0, or ZS_EINVAL / ZS_ENOMEM with the file and the
 * reason in err (may be NULL). `what` names the file in the message
 * ("--tls-cert"). */
int rpc_read_pem_file(const char *path, const char *what, char **out, char *err, size_t errlen);

typedef struct rpc_status {
  int grpc_code;     /* grpc_status_code */
  int zs_status;     /* from the "zs-status" trailer, else status_from_grpc() */
  char message[512]; /* the server's status details, or a local description */
} rpc_status;

/* Calls `method` ("/zshard.v1.ZShard/Push") with `req` and waits at most
 * timeout_ms for the answer (0: no deadline). On success returns 0 and *resp is a message of
 * type resp_desc that the caller frees with protobuf_c_message_free_unpacked().
 * On failure returns a negative zs_status (also in st->zs_status, with
 * st->grpc_code and st->message filled) and *resp is NULL. `st` may be NULL. */
int rpc_call(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
             uint64_t timeout_ms, rpc_status *st);

/* One metadata entry sent with a call: a lower-case key and a printable
 * value, both the caller's and only read during the call. */
typedef struct rpc_md {
  const char *key;
  const char *value;
} rpc_md;
#define RPC_MAX_MD 4

/* rpc_call with up to RPC_MAX_MD metadata entries besides the token. */
int rpc_call_md(rpc_channel *ch, const char *method, const ProtobufCMessage *req, const rpc_md *md,
                size_t nmd, const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                uint64_t timeout_ms, rpc_status *st);

/* rpc_call_md with a request already encoded: req_len bytes at req (copied
 * once into gRPC's buffer), e.g. a request a server forwards as it came.
 * resp_desc NULL: only the status is wanted (*resp stays NULL). */
int rpc_call_raw(rpc_channel *ch, const char *method, const void *req, size_t req_len,
                 const rpc_md *md, size_t nmd, const ProtobufCMessageDescriptor *resp_desc,
                 ProtobufCMessage **resp, uint64_t timeout_ms, rpc_status *st);

/* How a caller ends a call of its own early: while the call waits, fn(arg)
 * is asked every RPC_STOP_POLL_MS; once it returns nonzero the call is
 * cancelled and ends ZS_ECANCELED ("...: stopped by the caller"). fn runs
 * on the calling thread and must not block. */
typedef struct rpc_stop {
  int (*fn)(void *arg);
  void *arg;
} rpc_stop;
#define RPC_STOP_POLL_MS 50

/* rpc_call_raw that `stop` (NULL: none) may end early. */
int rpc_call_raw_stop(rpc_channel *ch, const char *method, const void *req, size_t req_len,
                      const rpc_md *md, size_t nmd, const ProtobufCMessageDescriptor *resp_desc,
                      ProtobufCMessage **resp, uint64_t timeout_ms, const rpc_stop *stop,
                      rpc_status *st);

#endif
