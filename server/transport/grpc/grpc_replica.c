/*
 * grpc_replica — the replica set at the gRPC transport: the gate every call
 * passes (replica_admit, and a primary's copy of a write for its backups) and
 * the members' own methods Promote, ReplicaJoin and ReplicaFetch.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/slice.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/status.h"
#include "zshard/v1/zshard.pb-c.h"

/* Promote, ReplicaJoin, ReplicaFetch: the replica set's own methods
 * (server/replica/replica.h). A server that is not replicated answers EUNIMPL. */
static int no_replica(gsrv *s, gcall *c, const char *what) {
  if (s->rep)
    return 0;
  char err[GSRV_ERRLEN];
  snprintf(err, sizeof err, "%s: this server is not a member of a replica set (--replicas)", what);
  gsrv__finish_err(c, 0, ZS_EUNIMPL, err);
  return 1;
}

void gsrv__h_promote(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__PromoteRequest *r =
      UNPACK(Zshard__V1__PromoteRequest, zshard__v1__promote_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.PromoteRequest");
    return;
  }
  uint64_t term = r->term;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (no_replica(s, c, "Promote"))
    return;
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__PromoteResponse resp = ZSHARD__V1__PROMOTE_RESPONSE__INIT;
  int role = 0;
  /* Blocks this polling thread for the peers' GetInfo (a short deadline):
   * promotions are rare. A trainer may call it (the client's failover), but
   * only the admin token moves a live primary's term. */
  int rc =
      replica_promote(s->rep, term, c->admin, &resp.term, &role, &resp.version, err, sizeof err);
  resp.role = (Zshard__V1__ReplicaRole)role;
  if (rc)
    gsrv__finish_err(c, 0, rc, err);
  else
    gsrv__finish_msg(c, 0, &resp.base);
}

void gsrv__h_replica_join(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__ReplicaJoinRequest *r = UNPACK(
      Zshard__V1__ReplicaJoinRequest, zshard__v1__replica_join_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ReplicaJoinRequest");
    return;
  }
  uint64_t term = r->term;
  uint32_t index = r->index;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (no_replica(s, c, "ReplicaJoin"))
    return;
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReplicaJoinResponse resp = ZSHARD__V1__REPLICA_JOIN_RESPONSE__INIT;
  resp.term = term;
  int rc = replica_join(s->rep, term, index, &resp.join_id, err, sizeof err);
  if (rc)
    gsrv__finish_err(c, 0, rc, err);
  else
    gsrv__finish_msg(c, 0, &resp.base);
}

void gsrv__h_replica_fetch(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  Zshard__V1__ReplicaFetchRequest *r = UNPACK(
      Zshard__V1__ReplicaFetchRequest, zshard__v1__replica_fetch_request__descriptor, msg, len);
  if (!r) {
    gsrv__bad_message(c, "zshard.v1.ReplicaFetchRequest");
    return;
  }
  if (no_replica(s, c, "ReplicaFetch")) {
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return;
  }
  char err[GSRV_ERRLEN] = "";
  Zshard__V1__ReplicaFetchResponse resp = ZSHARD__V1__REPLICA_FETCH_RESPONSE__INIT;
  /* Up to REPLICA_FETCH_ELEMS elements, packed (copied once) here. */
  int rc = replica_fetch(s->rep, r, &resp, err, sizeof err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (rc)
    gsrv__finish_err(c, 0, rc, err);
  else
    gsrv__finish_msg(c, 0, &resp.base);
  replica_fetch_release(s->rep, &resp, rc == 0);
}

/* A decimal metadata value of the call, or 0 (absent, malformed). */
static uint64_t md_u64(const gcall *c, const char *key) {
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, key) != 0)
      continue;
    char buf[24];
    size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
    if (n == 0 || n >= sizeof buf)
      return 0;
    memcpy(buf, GRPC_SLICE_START_PTR(c->md.metadata[i].value), n);
    buf[n] = '\0';
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    return *end == '\0' && buf[0] >= '0' && buf[0] <= '9' ? (uint64_t)v : 0;
  }
  return 0;
}

/* The replica set's verdict on the call (replica_admit); a primary keeps a
 * copy of a trainer's write for its backups (forwarded by finish once it
 * succeeded here). Returns 0 to serve it, or -1 when answered. */
int gsrv__replica_gate(gsrv *s, gcall *c, const uint8_t *msg, size_t len) {
  char err[GSRV_ERRLEN] = "";
  int forward = 0;
  int rc = replica_admit(s->rep, gsrv__methods[c->method].kind, md_u64(c, "zshard-replica-term"),
                         c->admin, md_u64(c, "zshard-term"), &forward, err, sizeof err);
  if (rc == 0 && forward) {
    c->fwd = malloc(len ? len : 1);
    c->fwd_len = len;
    if (c->fwd)
      memcpy(c->fwd, msg, len);
    else
      rc = status_fail(err, sizeof err, ZS_ENOMEM, "out of memory for the backups' copy");
  }
  if (rc == 0)
    return 0;
  gsrv__answer(c, NULL, rc, err);
  return -1;
}
