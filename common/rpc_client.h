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
/* A Push payload larger than this travels in chunks of exactly this many bytes
 * (PushRequest.offset and total); the server receives no message larger than
 * this plus RPC_HEADROOM_BYTES for the other fields of a message. */
#define RPC_PUSH_CHUNK_BYTES (64 * 1024 * 1024)
#define RPC_HEADROOM_BYTES (64 * 1024)

typedef struct rpc_channel rpc_channel;

/* Opens a channel to `target` ("host:port"); the connection is made lazily by
 * the first call. Returns 0 or ZS_ENOMEM / ZS_EINVAL. The channel is the
 * caller's, closed with rpc_channel_close. */
int rpc_channel_open(const char *target, rpc_channel **out);
void rpc_channel_close(rpc_channel *ch);

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

#endif
