/*
 * cli_support — what libzshard lends its own command line tool (client/cli)
 * beyond the public API: address parsing, one retried call to one shard, and
 * a look at an open client's shards. The CLI includes this header and
 * ckpt_client.h, never internal.h (the build enforces it).
 *
 * Why not the public API: the CLI is the operator's side of the library. It
 * checkpoints, restores and lists jobs whose model it never described (it
 * knows only the spec hash the shards report) and speaks raw protobuf to the
 * shards; those calls are not for trainers and must stay free to change, so
 * they keep the zc_ prefix and are not exported by the shared library (the
 * CLI links the static zshard_client).
 *
 * Why not internal.h: that header lays out zs_client, the pool and the
 * requests, and a CLI that includes it reads their fields, so every change to
 * the library's insides becomes a change to the CLI. Here it sees functions.
 */
#ifndef ZSHARD_CLIENT_CLI_SUPPORT_H
#define ZSHARD_CLIENT_CLI_SUPPORT_H

#include <stdint.h>

#include "common/net/rpc_client.h"
#include "zshard/zshard.h"

#define ZC_METHOD(name) "/zshard.v1.ZShard/" name

/* Splits a shard address list ("h:p,h:p") or expands a pattern with "{i}"
 * (num_shards required; every "{i}" is replaced) into *out, an array of
 * *count strings the caller frees with zc_free_addresses: one per shard. A
 * shard's replicas are separated by '|' ("h:p|h:p,h:p|h:p"); its string
 * then holds them all, trimmed, in the listed order (zc_shard_members splits
 * it). num_shards counts shards, not replicas; 0 with a list means "as many
 * as listed". Returns 0 or ZS_EINVAL / ZS_ENOMEM with the last error set.
 * The parser of zs_client_open, so the CLI reads --shards exactly as a
 * trainer reads its addresses. */
int zc_parse_addresses(const char *spec, uint32_t num_shards, char ***out, uint32_t *count);
void zc_free_addresses(char **addr, uint32_t n);

/* The members of one shard's string as zc_parse_addresses left it ("h:p",
 * or "h:p|h:p" for a replica set) into *out, *n strings the caller frees
 * with zc_free_addresses. Returns 0 or ZS_ENOMEM with the last error set. */
int zc_shard_members(const char *shard, char ***out, uint32_t *n);

/* A call with retries on UNAVAILABLE and backoff (interrupted by close).
 * Same contract as rpc_call. To a replicated shard it goes to the current
 * member, carries the term, and fails over (docs/CLIENT.md). */
int zc_call(zs_client *c, uint32_t shard, const char *method, const ProtobufCMessage *req,
            const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
            uint64_t timeout_ms, rpc_status *st);

/* The open client's shard count, the address of shard `shard` (the
 * client's string, valid until zs_client_close; "" for no such shard) and
 * the deadline of one call, as zs_client_open settled them. */
uint32_t zc_client_num_shards(const zs_client *c);
const char *zc_client_address(const zs_client *c, uint32_t shard);
uint32_t zc_client_rpc_timeout_ms(const zs_client *c);

/* Opens a channel to `addr` with the token and TLS files of the environment
 * (ZSHARD_TOKEN, ZSHARD_TOKEN_FILE, ZSHARD_TLS_*), as zs_client_open would
 * with those options unset. Returns 0 and the channel in *out (the
 * caller's, closed with rpc_channel_close), or an error with the last error
 * set. */
int zc_channel_open_env(const char *addr, rpc_channel **out);

#endif
