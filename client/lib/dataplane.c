/*
 * dataplane — pushes and pulls over the data plane (common/net/dp_client.h,
 * docs/PROTOCOL.md): finding each shard's data port, one data client per
 * shard, and the tasks that run on them.
 *
 * Discovery: zs_open_job asks every shard for GetInfo.data_port and connects
 * to that port at the host of the shard's gRPC address. A shard that
 * advertises no data port is served over gRPC (its tasks run the blocking
 * path of task.c).
 *
 * A task in three phases. A push or pull task does not hold its worker while
 * the bytes travel:
 *   SEND    the worker prepares the piece (a conversion into the task's own
 *           buffer when the wire dtype differs from the caller's), submits it
 *           to the shard's data client (which computes the payload CRC on
 *           this thread) and returns; for an isolated one-piece transfer
 *           without conversion the caller's thread does this instead
 *           (zc_dp_submit_inline, from request.c's zc_op_submit);
 *   FINISH  the answer arrives on the data client's loop thread, which must
 *           not block: a plain push or pull finishes there; a pull that needs
 *           a conversion, and any prefetch (whose last piece copies the whole
 *           tensor into a waiting pull), go back to the pool and finish on a
 *           worker;
 *   RETRY   a transfer whose connection failed (ZS_ECONN), or that a closing
 *           shard refused (ZS_ECLOSED: gRPC's UNAVAILABLE on the other
 *           transport), goes back to the pool too: the worker backs off as
 *           zc_call does, asks the shard for its data port again and, if the
 *           shard now lives elsewhere (a restarted server on a new port, a
 *           rescheduled pod with a new address), opens a data client there
 *           and swaps it in; then it submits the piece again. Pushes are
 *           idempotent on the shard, so a push that did arrive before the
 *           connection failed is acknowledged as a duplicate.
 * Replicated shards: the data client follows the member gRPC calls go to
 * (replica.c). A failed transfer, or one a member refused as not primary
 * (ZS_ENOTPRIMARY, ZS_ESTALE), reports the failure to the replica set
 * (which may fail over) before the retry; and a worker that finds the set's
 * current member changed since the data client was opened (a gRPC call
 * failed over first) refreshes before it submits. The refresh asks the
 * current member for its data port and connects at that member's host.
 * When the client is closing, nothing goes back to the pool: a retry fails
 * with ZS_ECANCELED and a conversion runs on the loop thread.
 *
 * Copies of tensor bytes on the client: a push in the caller's dtype none (the
 * socket reads the caller's buffer), with a conversion one (into the task's
 * buffer); a pull in the caller's dtype none (the socket writes into the
 * caller's buffer at the piece's offset), with a conversion one; a prefetch
 * none into its slot, and the pull served from the slot one more. Pieces sent
 * as a batch (see "batches" below) copy as single ones.
 *
 * Threads and locks: zc_dp.mu guards each shard's current data client, the
 * number of workers submitting to it and its generation. It is a leaf: no
 * other lock is taken and no blocking call is made while it is held, so the
 * loop threads may take it. A data client is closed only once no worker
 * submits to it (users == 0) and never under a lock; its loop thread then
 * fails the requests still on it with ZS_ECANCELED, which are retried when
 * the client was replaced (the task's generation is then not the shard's).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/base/trace.h"
#include "common/net/dp_client.h"
#include "common/net/hostport.h"
#include "common/net/stream.h"
#include "common/net/wire.h"
#include "internal.h"

#define DP_HOST_MAX HOSTPORT_HOST_MAX
#define DP_HOSTPORT_MAX HOSTPORT_TEXT_MAX
/* Longest wait for a data connection when (re)opening a shard's client. */
#define DP_CONNECT_MS 10000u

/* ---- state ------------------------------------------------------------------ */

/* One data client and the workers submitting to it right now. */
typedef struct zc_dpconn {
  dp_client *cli; /* owned */
  uint32_t users; /* (zc_dp.mu) */
} zc_dpconn;

typedef struct zc_dp_shard {
  zc_dpconn *cur; /* (mu) owned; NULL: this shard is served over gRPC */
  uint64_t gen;   /* (mu) changes whenever cur is replaced */
  int refreshing; /* (mu) a worker is looking the shard up again */
  /* (mu) the port and address cur connects to. */
  uint32_t port;
  struct sockaddr_storage addr;
  /* The host of the gRPC address of the member cur connects to: immutable
   * for a shard that is not replicated; (mu) for a replica set, whose
   * member (index) and generation (zc_rset.gen) it was taken at are kept
   * too. */
  char host[DP_HOST_MAX];
  uint32_t member;
  uint64_t rgen;
} zc_dp_shard;

typedef struct zc_dp {
  atomic_uint_least64_t batches;        /* batch requests submitted */
  atomic_uint_least64_t inline_submits; /* tasks zc_dp_submit_inline took */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* (mu) users dropped to 0, a refresh ended */
  uint64_t next_gen; /* (mu) */
  uint32_t n;
  zc_dp_shard shard[];
} zc_dp;

/* Set on a loop thread while it runs a completion, see zc_dp_in_callback. */
static _Thread_local int tls_in_callback;

int zc_dp_in_callback(void) {
  return tls_in_callback;
}

/* ---- transport choice ----------------------------------------------------------- */

int zc_transport_resolve(zs_transport requested, zs_transport *out) {
  if (requested == ZS_TRANSPORT_DATA || requested == ZS_TRANSPORT_GRPC) {
    *out = requested;
    return ZS_OK;
  }
  const char *env = getenv("ZSHARD_TRANSPORT");
  if (!env || !*env || strcmp(env, "data") == 0) {
    *out = ZS_TRANSPORT_DATA;
    return ZS_OK;
  }
  if (strcmp(env, "grpc") == 0) {
    *out = ZS_TRANSPORT_GRPC;
    return ZS_OK;
  }
  return zc_fail(ZS_EINVAL, "zs_client_open: ZSHARD_TRANSPORT is '%.64s'; it must be data or grpc",
                 env);
}

/* The rotated schedule's window: the option, else $ZSHARD_SCHEDULE_WINDOW,
 * else 2 (pool.c says why). */
static int window_resolve(uint32_t *window) {
  if (*window > 64)
    return zc_fail(ZS_EINVAL, "zs_client_open: schedule_window must be at most 64");
  const char *env = getenv("ZSHARD_SCHEDULE_WINDOW");
  if (*window == 0 && env && *env) {
    char *end;
    unsigned long v = strtoul(env, &end, 10);
    if (*end || v == 0 || v > 64 || env[0] == '-' || env[0] == ' ')
      return zc_fail(ZS_EINVAL,
                     "zs_client_open: ZSHARD_SCHEDULE_WINDOW is '%.64s'; it must be 1 to 64", env);
    *window = (uint32_t)v;
  }
  if (*window == 0)
    *window = 2;
  return ZS_OK;
}

int zc_schedule_resolve(zs_schedule requested, zs_schedule *out, uint32_t *window) {
  int rc = window_resolve(window);
  if (rc != ZS_OK)
    return rc;
  if (requested == ZS_SCHEDULE_FIFO || requested == ZS_SCHEDULE_ROTATED) {
    *out = requested;
    return ZS_OK;
  }
  if (requested != ZS_SCHEDULE_DEFAULT)
    return zc_fail(ZS_EINVAL, "zs_client_open: schedule %d is not a zs_schedule value",
                   (int)requested);
  const char *env = getenv("ZSHARD_SCHEDULE");
  if (!env || !*env || strcmp(env, "fifo") == 0) {
    *out = ZS_SCHEDULE_FIFO;
    return ZS_OK;
  }
  if (strcmp(env, "rotated") == 0) {
    *out = ZS_SCHEDULE_ROTATED;
    return ZS_OK;
  }
  return zc_fail(ZS_EINVAL,
                 "zs_client_open: ZSHARD_SCHEDULE is '%.64s'; it must be fifo or rotated", env);
}

int zc_congestion_resolve(const char *requested, char *out, size_t len) {
  const char *name = requested && *requested ? requested : getenv("ZSHARD_TCP_CONGESTION");
  out[0] = '\0';
  if (!name || !*name)
    return ZS_OK;
  char why[400];
  int rc = stream_cc_check(name, why, sizeof why);
  if (rc != ZS_OK)
    return zc_fail(rc, "zs_client_open: %s%s",
                   requested && *requested ? "" : "ZSHARD_TCP_CONGESTION: ", why);
  snprintf(out, len, "%s", name);
  return ZS_OK;
}

int zc_pacing_resolve(uint32_t requested, uint32_t *out) {
  const char *env = getenv("ZSHARD_TCP_PACING_MBIT");
  *out = requested;
  if (requested > STREAM_PACING_MBIT_MAX)
    return zc_fail(ZS_EINVAL,
                   "zs_client_open: tcp_pacing_mbit is %" PRIu32 "; it must be at most %u Mbit/s",
                   requested, STREAM_PACING_MBIT_MAX);
  if (requested || !env || !*env)
    return ZS_OK;
  char why[200];
  if (stream_pacing_parse(env, "ZSHARD_TCP_PACING_MBIT", out, why, sizeof why) != 0)
    return zc_fail(ZS_EINVAL, "zs_client_open: %s", why);
  return ZS_OK;
}

int zc_link_resolve(uint32_t pacing_mbit, struct stream_pacer **out) {
  const char *env = getenv("ZSHARD_TCP_LINK_MBIT");
  *out = NULL;
  uint32_t link = 0;
  char why[200];
  if (env && *env && stream_pacing_parse(env, "ZSHARD_TCP_LINK_MBIT", &link, why, sizeof why) != 0)
    return zc_fail(ZS_EINVAL, "zs_client_open: %s", why);
  if (link == 0)
    return ZS_OK;
  if (pacing_mbit)
    return zc_fail(ZS_EINVAL,
                   "zs_client_open: ZSHARD_TCP_LINK_MBIT (pacing that follows the sockets "
                   "sending) and a fixed tcp_pacing_mbit (%" PRIu32 ") exclude each other",
                   pacing_mbit);
  uint32_t lowat = STREAM_PACER_NOTSENT_LOWAT;
  const char *lw = getenv("ZSHARD_TCP_LINK_NOTSENT_LOWAT");
  if (lw && *lw &&
      stream_pacer_lowat_parse(lw, "ZSHARD_TCP_LINK_NOTSENT_LOWAT", &lowat, why, sizeof why) != 0)
    return zc_fail(ZS_EINVAL, "zs_client_open: %s", why);
  if (stream_pacer_new(link, STREAM_PACER_MIN_WRITE, lowat, out) != 0)
    return zc_fail(ZS_ENOMEM, "zs_client_open: out of memory");
  return ZS_OK;
}

zs_transport zc_shard_transport(const struct zs_client *c, uint32_t shard) {
  zc_dp *dp = c->dp;
  if (!dp || shard >= dp->n)
    return ZS_TRANSPORT_GRPC;
  pthread_mutex_lock(&dp->mu);
  int data = dp->shard[shard].cur != NULL;
  pthread_mutex_unlock(&dp->mu);
  return data ? ZS_TRANSPORT_DATA : ZS_TRANSPORT_GRPC;
}

/* ---- addresses ------------------------------------------------------------------ */

/* The host part of a gRPC address: "h:7070" -> "h", "[::1]:7070" -> "::1"
 * (zc_address_hostport). Returns 0 or ZS_EINVAL. */
static int host_of(const char *addr, char *host, size_t cap) {
  hostport hp;
  if (zc_address_hostport(addr, &hp, NULL, 0) != ZS_OK || strlen(hp.host) >= cap)
    return ZS_EINVAL;
  memcpy(host, hp.host, strlen(hp.host) + 1);
  return ZS_OK;
}

/* ---- opening and closing ----------------------------------------------------------- */

/* Opens a data client to host:port. Returns 0, or the dp_client_open failure
 * with its sentence in err. */
static int open_client(const zs_client *c, const char *host, uint32_t port, zc_dpconn **out,
                       struct sockaddr_storage *resolved, char *err, size_t errlen) {
  char hp[DP_HOSTPORT_MAX];
  hostport_format(hp, sizeof hp, host, port);
  int rc = dp_resolve(hp, 0, resolved, err, errlen);
  if (rc != ZS_OK)
    return rc;
  zc_dpconn *k = calloc(1, sizeof *k);
  if (!k)
    return status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  dp_client_config cfg = {
      .addr = hp,
      .connections = c->opt.data_connections,
      .connect_timeout_ms =
          c->opt.rpc_timeout_ms < DP_CONNECT_MS ? c->opt.rpc_timeout_ms : DP_CONNECT_MS,
      .token = c->sec.token,
      .tls = c->sec.dp_tls,
      .congestion = c->tcp_congestion,
      .pacing_mbit = c->opt.tcp_pacing_mbit,
      .pacer = c->pacer,
  };
  rc = dp_client_open(&cfg, &k->cli, err, errlen);
  if (rc != ZS_OK) {
    free(k);
    return rc;
  }
  *out = k;
  return ZS_OK;
}

static void conn_free(zc_dpconn *k) {
  if (!k)
    return;
  dp_client_close(k->cli);
  free(k);
}

void zc_dp_close(struct zs_client *c) {
  zc_dp *dp = c->dp;
  if (!dp)
    return;
  /* No worker runs any more (the pool stopped first), so no data client is
   * in use or being replaced: each is closed, cancelling what it carries.
   * Those completions find the client closing and retry nothing. */
  for (uint32_t i = 0; i < dp->n; i++) {
    conn_free(dp->shard[i].cur);
    dp->shard[i].cur = NULL;
  }
  c->dp = NULL;
  pthread_mutex_destroy(&dp->mu);
  pthread_cond_destroy(&dp->cv);
  free(dp);
}

/* GetInfo of one shard: its data port in *port. The answer is untrusted. */
static int check_info(const zs_client *c, uint32_t shard, const Zshard__V1__GetInfoResponse *r,
                      uint32_t *port) {
  if (r->data_port > 65535)
    return zc_fail(ZS_EPROTO,
                   "zs_open_job: shard %" PRIu32 " (%s) advertises data port %" PRIu32
                   ", which is not a TCP port",
                   shard, c->addr[shard], r->data_port);
  *port = r->data_port;
  return ZS_OK;
}

/* The gRPC address of the member of shard i whose GetInfo answer `r` is:
 * for a replica set the member the answer names (the call went to the
 * current member, but a failover may have moved it meanwhile), with its
 * index and the set's generation in *member and *rgen (0 when it is not the
 * current member any more: the first transfer refreshes then). */
static const char *answering_member(zs_client *c, uint32_t i, const Zshard__V1__GetInfoResponse *r,
                                    uint32_t *member, uint64_t *rgen) {
  zc_rset *rs = &c->rs[i];
  *member = 0;
  *rgen = 0;
  if (rs->n == 1)
    return c->addr[i];
  rpc_md md;
  size_t nmd;
  char term_buf[24];
  uint32_t cur = zc_replica_current(c, i, rgen, &md, &nmd, term_buf);
  uint32_t k = r->replica && r->replica->index < rs->n ? r->replica->index : cur;
  if (k != cur)
    *rgen = 0;
  *member = k;
  return rs->member[k];
}

int zc_dp_open(struct zs_client *c) {
  if (c->dp)
    return ZS_OK;
  zc_dp *dp = calloc(1, sizeof *dp + (size_t)c->nshards * sizeof dp->shard[0]);
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  zs_request *op = zc_op_get_info(c, &req);
  int rc;
  if (!dp || !op) {
    free(dp);
    if (op)
      zc_op_release(op);
    return zc_fail(ZS_ENOMEM, "zs_open_job: out of memory");
  }
  pthread_mutex_init(&dp->mu, NULL);
  pthread_cond_init(&dp->cv, NULL);
  dp->n = c->nshards;
  dp->next_gen = 1;
  rc = zc_call_all(op);
  for (uint32_t i = 0; i < c->nshards && rc == ZS_OK; i++) {
    zc_dp_shard *s = &dp->shard[i];
    s->gen = dp->next_gen++;
    rc = check_info(c, i, (const Zshard__V1__GetInfoResponse *)op->tasks[i].resp, &s->port);
    if (rc != ZS_OK)
      break;
    if (s->port == 0)
      continue; /* served over gRPC */
    const char *where = answering_member(
        c, i, (const Zshard__V1__GetInfoResponse *)op->tasks[i].resp, &s->member, &s->rgen);
    if (host_of(where, s->host, sizeof s->host) != ZS_OK) {
      rc = zc_fail(ZS_EINVAL,
                   "zs_open_job: no data-plane host can be taken from the address of shard "
                   "%" PRIu32 " (%s); use transport ZS_TRANSPORT_GRPC (ZSHARD_TRANSPORT=grpc)",
                   i, c->addr[i]);
      break;
    }
    char err[DP_ERRLEN];
    rc = open_client(c, s->host, s->port, &s->cur, &s->addr, err, sizeof err);
    if (rc != ZS_OK)
      rc = zc_fail(rc,
                   "zs_open_job: shard %" PRIu32 " (%s) advertises data port %" PRIu32
                   " but its data plane cannot be reached: %s (ZSHARD_TRANSPORT=grpc uses "
                   "gRPC only)",
                   i, c->addr[i], s->port, err);
  }
  for (uint32_t i = 0; i < op->ntasks; i++)
    if (op->tasks[i].resp)
      protobuf_c_message_free_unpacked(op->tasks[i].resp, NULL);
  zc_op_release(op);
  c->dp = dp;
  if (rc != ZS_OK)
    zc_dp_close(c); /* nothing has used it yet */
  return rc;
}

/* ---- refreshing a shard's data client --------------------------------------------- */

/* Before a retry on shard i, whose data client of generation `seen` failed:
 * asks the shard (a replica set's current member) for its data port again
 * and, when it moved (another port, its host now resolves to another
 * address, or another member), opens a client there and swaps it in. When
 * nothing moved the old client stays: it reconnects by itself for the next
 * request. Failures leave everything as it was (the retry then fails again
 * and backs off further). Runs on a worker. */
static void refresh(zs_client *c, uint32_t i, uint64_t seen) {
  zc_dp *dp = c->dp;
  zc_dp_shard *s = &dp->shard[i];
  const zc_rset *rs = &c->rs[i];
  pthread_mutex_lock(&dp->mu);
  while (s->refreshing)
    pthread_cond_wait(&dp->cv, &dp->mu);
  if (s->gen != seen) {
    /* Another worker replaced the client meanwhile. */
    pthread_mutex_unlock(&dp->mu);
    return;
  }
  s->refreshing = 1;
  uint32_t old_port = s->port, old_member = s->member;
  struct sockaddr_storage old_addr = s->addr;
  char host[DP_HOST_MAX];
  memcpy(host, s->host, sizeof host);
  pthread_mutex_unlock(&dp->mu);

  /* One attempt, no retries of its own: this runs inside a retry loop. A
   * replica set is asked at its current member, with the term. */
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st = {0};
  rpc_md md;
  size_t nmd = 0;
  char term_buf[24];
  uint32_t member = 0;
  uint64_t rgen = 0;
  int moved = 0, ok = 0, looked = 1;
  if (rs->n > 1) {
    member = zc_replica_current(c, i, &rgen, &md, &nmd, term_buf);
    looked = host_of(rs->member[member], host, sizeof host) == ZS_OK;
  }
  zc_dpconn *fresh = NULL;
  uint32_t port = 0;
  struct sockaddr_storage addr;
  memset(&addr, 0, sizeof addr);
  if (looked && rpc_call_md(rs->chan[member], ZC_METHOD("GetInfo"), &req.base, &md, nmd,
                            &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)&info,
                            c->opt.rpc_timeout_ms, &st) == ZS_OK) {
    if (info->data_port <= 65535 && info->shard_id == i &&
        (rs->n == 1 || (info->replica && info->replica->index == member))) {
      port = info->data_port;
      char err[DP_ERRLEN];
      if (port == 0) {
        moved = old_port != 0;
        ok = 1;
      } else {
        char hp[DP_HOSTPORT_MAX];
        hostport_format(hp, sizeof hp, host, port);
        if (dp_resolve(hp, 0, &addr, err, sizeof err) == ZS_OK) {
          moved = port != old_port || memcmp(&addr, &old_addr, sizeof addr) != 0 ||
                  member != old_member;
          ok = !moved || open_client(c, host, port, &fresh, &addr, err, sizeof err) == ZS_OK;
        }
      }
    }
    protobuf_c_message_free_unpacked(&info->base, NULL);
  }

  zc_dpconn *old = NULL;
  pthread_mutex_lock(&dp->mu);
  if (ok && moved) {
    old = s->cur;
    s->cur = fresh;
    s->port = port;
    s->addr = addr;
    s->gen = dp->next_gen++;
    /* Submissions to the old client finish before it is closed. */
    while (old && old->users > 0)
      pthread_cond_wait(&dp->cv, &dp->mu);
  }
  if (ok && rs->n > 1) {
    /* The member looked up is the one the data plane follows now. */
    memcpy(s->host, host, sizeof host);
    s->member = member;
    s->rgen = rgen;
  }
  s->refreshing = 0;
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  /* Its requests in flight complete with ZS_ECANCELED and, their generation
   * being stale, are retried on the new client. */
  conn_free(old);
}

/* For a replica set: 1 when its current member is no longer the one the
 * data client was opened for (a gRPC call failed over first), with the
 * data client's generation in *seen for refresh(). */
static int member_moved(const zs_client *c, uint32_t i, uint64_t *seen) {
  if (c->rs[i].n == 1)
    return 0;
  zc_dp *dp = c->dp;
  pthread_mutex_lock(&dp->mu);
  int moved = dp->shard[i].rgen != atomic_load(&c->rs[i].gen);
  *seen = dp->shard[i].gen;
  pthread_mutex_unlock(&dp->mu);
  return moved;
}

/* ---- tasks ------------------------------------------------------------------------ */

static void on_answer(void *arg, const dp_result *r);

/* Finishes the task's part of its op; t may be freed by the time it returns. */
static void task_finish(zc_task *t, int status, const char *msg, uint64_t bytes) {
  free(t->dp_buf);
  t->dp_buf = NULL;
  t->status = status;
  zc_pool_release(&t->op->c->pool, t);
  zc_op_part_done(t->op, status, msg, bytes);
}

/* Formats the failure of a push or pull task as task.c does for gRPC. */
static void describe_failure(const zs_client *c, const zc_task *t, const char *why, char *err,
                             size_t errlen) {
  const zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  const char *name = c->sp.tensors[op->tensor].name;
  if (op->kind == ZC_OP_PUSH)
    snprintf(err, errlen,
             "push of tensor '%s' slice %" PRIu32 " (step %" PRIu64 ", micro %" PRIu32
             ") to shard %" PRIu32 " (%.64s) failed: %.300s",
             name, pc->slice, op->step, op->micro, t->shard, c->addr[t->shard], why);
  else
    snprintf(err, errlen,
             "pull of tensor '%s' slice %" PRIu32 " (version >= %" PRIu64 ") from shard %" PRIu32
             " (%.64s) failed: %.300s",
             name, pc->slice, op->step, t->shard, c->addr[t->shard], why);
}

static void task_fail(zs_client *c, zc_task *t, int status, const char *why) {
  char err[ZC_ERR_LEN];
  describe_failure(c, t, why, err, sizeof err);
  task_finish(t, status, err, 0);
}

/* Puts the task back on the pool for its next phase. Returns 0 when the
 * client is closing (the pool may be stopping: nothing may be queued). */
static int requeue(zs_client *c, zc_task *t, int phase) {
  t->dp_phase = phase;
  /* closing is set under c->mu before the pool stops, so a task queued while
   * it is 0 is either run or cancelled by zc_pool_stop. */
  pthread_mutex_lock(&c->mu);
  int ok = !c->closing;
  if (ok)
    zc_pool_submit(&c->pool, t, 1);
  pthread_mutex_unlock(&c->mu);
  return ok;
}

/* A trace record of task t's piece (common/base/trace.h; off unless
 * ZSHARD_TRACE is set). */
static void trace_task(const zs_client *c, const zc_task *t, trace_kind kind) {
  if (!trace_enabled())
    return;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  trace_ev(kind, t->op->step, pc->tensor, pc->slice, c->opt.rank);
}

/* The FINISH phase of a pull: the piece is in, in the wire dtype. */
static void pull_finish(zs_client *c, zc_task *t) {
  zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  if (t->dp_buf)
    zc_convert((unsigned char *)op->dst + dtype_bytes(op->buf_dtype, pc->offset), op->buf_dtype,
               t->dp_buf, op->wire_dtype, pc->numel);
  task_finish(t, ZS_OK, NULL, dtype_bytes(op->wire_dtype, pc->numel));
}

/* Hands the task's piece (converted into t->dp_buf already when its dtypes
 * differ) to the shard's current data client. Returns 0 when the shard has
 * none (t->dp_buf is released), else 1 with the data client's verdict in
 * *rc: 0, the answer will finish the task (which may already have happened:
 * t is not the caller's any more); an error, nothing was sent and t is still
 * the caller's. */
static int hand_to_client(zs_client *c, zc_task *t, int *rc) {
  zc_dp *dp = c->dp;
  zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  size_t boff = (size_t)dtype_bytes(op->buf_dtype, pc->offset);
  size_t nbytes = op->kind == ZC_OP_PUSH ? zc_op_piece_bytes(op, pc)
                                         : (size_t)dtype_bytes(op->wire_dtype, pc->numel);
  pthread_mutex_lock(&dp->mu);
  zc_dpconn *k = dp->shard[t->shard].cur;
  if (k) {
    k->users++;
    t->dp_gen = dp->shard[t->shard].gen;
    t->dp_rgen = dp->shard[t->shard].rgen;
  }
  pthread_mutex_unlock(&dp->mu);
  if (!k) {
    free(t->dp_buf);
    t->dp_buf = NULL;
    return 0;
  }
  trace_task(c, t, op->kind == ZC_OP_PUSH ? TRACE_C_PUSH : TRACE_C_PULL);
  if (op->kind == ZC_OP_PUSH) {
    dp_push_args a = {
        .spec_hash = c->hash,
        .step = op->step,
        .rank = c->opt.rank,
        .micro = op->micro,
        .tensor = pc->tensor,
        .slice = pc->slice,
        .dtype = op->wire_dtype,
        .data = t->dp_buf ? t->dp_buf : zc_op_piece_src(op, pc),
        .nbytes = nbytes,
        .timeout_ms = c->opt.rpc_timeout_ms,
    };
    *rc = dp_client_push(k->cli, &a, on_answer, t);
  } else {
    dp_pull_args a = {
        .spec_hash = c->hash,
        .min_version = op->step,
        .tensor = pc->tensor,
        .slice = pc->slice,
        .dtype = op->wire_dtype,
        .dst = t->dp_buf ? t->dp_buf : (unsigned char *)op->dst + boff,
        .nbytes = nbytes,
        /* The shard waits up to step_timeout for the version. */
        .timeout_ms = c->opt.step_timeout_ms,
    };
    *rc = dp_client_pull(k->cli, &a, on_answer, t);
  }
  /* From here on t belongs to the answer (when *rc is 0), which may already
   * have finished it: only k is touched. */
  pthread_mutex_lock(&dp->mu);
  if (--k->users == 0)
    pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  return 1;
}

/* Submits the task's piece to the shard's current data client. Returns 0
 * when the shard has none (the caller falls back to gRPC). */
static int submit(zs_client *c, zc_task *t) {
  zs_request *op = t->op;
  const layout_piece *pc = &c->lay.pieces[t->piece];
  size_t boff = (size_t)dtype_bytes(op->buf_dtype, pc->offset);
  size_t nbytes = (size_t)dtype_bytes(op->wire_dtype, pc->numel);

  /* The conversion runs before the client is taken, so that a refresh never
   * waits for it; a retry reuses the converted push. */
  if (op->buf_dtype != op->wire_dtype && !t->dp_buf) {
    t->dp_buf = malloc(nbytes);
    if (!t->dp_buf) {
      task_fail(c, t, ZS_ENOMEM, "out of memory for the piece in its wire dtype");
      return 1;
    }
    if (op->kind == ZC_OP_PUSH)
      zc_convert(t->dp_buf, op->wire_dtype, (const unsigned char *)op->src + boff, op->buf_dtype,
                 pc->numel);
  }
  int rc = ZS_OK;
  if (!hand_to_client(c, t, &rc))
    return 0;
  if (rc != ZS_OK)
    task_fail(c, t, rc, "the data-plane client refused the request");
  return 1;
}

int zc_dp_submit_inline(struct zs_client *c, zc_task *t) {
  const zs_request *op = t->op;
  /* A conversion is work for a worker; a replica set may have to look its
   * primary up (refresh: a blocking call); a loop thread must not wait on
   * another data client's lock while its own connections wait. */
  if (!c->dp || (op->kind != ZC_OP_PUSH && op->kind != ZC_OP_PULL) ||
      op->buf_dtype != op->wire_dtype || t->dp_phase != ZC_DP_SEND || c->rs[t->shard].n > 1 ||
      tls_in_callback)
    return 0;
  int rc = ZS_OK;
  /* A refusal (the client closing, out of memory) goes to the pool, whose
   * worker submits again and fails the task there: never inside the call
   * that started the transfer. */
  if (!hand_to_client(c, t, &rc) || rc != ZS_OK)
    return 0;
  atomic_fetch_add(&c->dp->inline_submits, 1);
  return 1;
}

/* 1 if a failed attempt should be made again. */
static int retryable(zs_client *c, zc_task *t, int status) {
  /* A payload that failed its CRC32C (either way) changed nothing and
   * pushes and pulls are idempotent: the bytes were damaged on the way, or
   * a pull answer was overtaken by an apply (docs/PROTOCOL.md). */
  if (status == ZS_ECONN || status == ZS_ECLOSED || status == ZS_ECRC)
    return 1;
  if (c->rs[t->shard].n > 1) {
    /* A member that is not primary (any more) sends us to the set's
     * primary; one that lacks the job or the version may have been left
     * behind by a failover we have not seen, which one search tells
     * (replica.c). */
    if (status == ZS_ENOTPRIMARY || status == ZS_ESTALE)
      return 1;
    /* A primary that went silent (its host gone, its process stopped)
     * fails no connection: its requests time out, and the search tells a
     * slow primary (it answers GetInfo) from a lost one. */
    if (status == ZS_ETIMEDOUT)
      return 1;
    if ((status == ZS_ENOTOPEN || status == ZS_ENOTREADY) && !t->dp_looked) {
      t->dp_looked = 1;
      return 1;
    }
  }
  if (status != ZS_ECANCELED)
    return 0;
  /* Cancelled because its client was replaced (not because we are closing):
   * the new client carries it. */
  zc_dp *dp = c->dp;
  pthread_mutex_lock(&dp->mu);
  int stale = dp->shard[t->shard].gen != t->dp_gen;
  pthread_mutex_unlock(&dp->mu);
  return stale;
}

/* A failed attempt of task t: retried through the pool when another may
 * succeed, else the task fails with it. On a loop thread. */
static void attempt_failed(zs_client *c, zc_task *t, int status, const char *msg) {
  if (retryable(c, t, status) && t->dp_attempt < c->opt.max_retries) {
    t->dp_failed = status;
    t->dp_attempt++;
    atomic_fetch_add(&c->retries, 1);
    if (!requeue(c, t, ZC_DP_RETRY))
      task_fail(c, t, ZS_ECANCELED, "cancelled: the client is closing");
  } else {
    task_fail(c, t, status, msg);
  }
}

/* A pull task's piece arrived at its destination in the wire dtype, of
 * `version`: a plain pull finishes here; a conversion, and any prefetch
 * (whose last piece copies the whole tensor into a waiting pull), on a
 * worker. On a loop thread. */
static void pull_answered(zs_client *c, zc_task *t, uint64_t version) {
  trace_task(c, t, TRACE_C_PULL_DONE);
  if (version < t->op->step) {
    char why[160];
    snprintf(why, sizeof why, "the shard answered with version %" PRIu64, version);
    task_fail(c, t, ZS_EPROTO, why);
  } else if ((!t->dp_buf && t->op->kind == ZC_OP_PULL) || !requeue(c, t, ZC_DP_FINISH)) {
    /* Here, or because the client is closing: no worker is left to do it. */
    pull_finish(c, t);
  }
}

/* The answer of a data-plane request, on the data client's loop thread. */
static void on_answer(void *arg, const dp_result *r) {
  zc_task *t = arg;
  zs_request *op = t->op;
  zs_client *c = op->c;
  tls_in_callback = 1;
  if (r->status != ZS_OK) {
    attempt_failed(c, t, r->status, r->message);
  } else if (op->kind == ZC_OP_PUSH) {
    trace_task(c, t, TRACE_C_PUSH_ACK);
    /* A duplicate means an earlier attempt of this very contribution
     * arrived: the shard has it, which is what the push wanted. */
    task_finish(t, ZS_OK, NULL, dtype_bytes(op->wire_dtype, c->lay.pieces[t->piece].numel));
  } else {
    pull_answered(c, t, r->version);
  }
  tls_in_callback = 0;
}

/* ---- batches ------------------------------------------------------------------------ */

/* Small pieces the pool coalesced for one shard travel as one PUSH_BATCH or
 * PULL_BATCH (docs/PROTOCOL.md). A batch holds tasks of one direction and,
 * for pushes, one (step, micro); for pulls, one min_version. Each task still
 * finishes on its own: a push piece the shard refuses fails only its task,
 * and a batch that fails as a whole (connection lost, shard closing) sends
 * each task back to the pool for the single-piece retry path.
 *
 * Copies: as single pieces. A push batch is written from the callers'
 * buffers (or a task's converted one); a pull batch's payload is scattered
 * by the data client over the pieces' destinations, each the one a single
 * pull of the piece would have: the caller's buffer (or prefetch slot) at the
 * piece's offset, or the task's buffer when a worker converts it after. A
 * batch that fails may have written any of them: they are rewritten by the
 * retries, and a request that fails leaves its buffer unspecified, as a
 * single pull does (docs/CLIENT.md). */
typedef struct zc_dpbatch {
  zs_client *c;
  int push;
  uint32_t n;
  zc_task *t[WIRE_MAX_BATCH];
} zc_dpbatch;

static void on_batch_answer(void *arg, const dp_result *r);

/* 1 if t may join a batch whose first task is `first`. */
static int batchable(const zc_task *first, const zc_task *t) {
  const zs_request *a = first->op, *b = t->op;
  if (t->dp_phase != ZC_DP_SEND || t->shard != first->shard)
    return 0;
  if (a->kind == ZC_OP_PUSH)
    return b->kind == ZC_OP_PUSH && b->step == a->step && b->micro == a->micro;
  return (b->kind == ZC_OP_PULL || b->kind == ZC_OP_PREFETCH) && b->step == a->step;
}

/* Submits one batch of tasks b->t[0 .. n). Returns 0 when the shard has no
 * data client (the tasks are untouched, for gRPC), 1 when every task was
 * taken (each finishes later, or already failed). */
static int batch_submit(zc_dpbatch *b) {
  zs_client *c = b->c;
  zc_dp *dp = c->dp;
  const uint32_t shard = b->t[0]->shard;
  dp_batch_piece pieces[WIRE_MAX_BATCH];
  void *dsts[WIRE_MAX_BATCH];
  int rc = ZS_OK;
  for (uint32_t i = 0; i < b->n; i++) {
    zc_task *t = b->t[i];
    zs_request *op = t->op;
    const layout_piece *pc = &c->lay.pieces[t->piece];
    size_t boff = (size_t)dtype_bytes(op->buf_dtype, pc->offset);
    size_t nbytes =
        b->push ? zc_op_piece_bytes(op, pc) : (size_t)dtype_bytes(op->wire_dtype, pc->numel);
    pieces[i] = (dp_batch_piece){
        .tensor = pc->tensor, .slice = pc->slice, .dtype = op->wire_dtype, .nbytes = nbytes};
    /* As submit(): a piece in another dtype goes through the task's buffer,
     * converted before the client is taken (push) or after the answer, on
     * a worker (pull). */
    const int convert = op->buf_dtype != op->wire_dtype;
    if (convert && !t->dp_buf && !(t->dp_buf = malloc(nbytes))) {
      rc = ZS_ENOMEM;
      break;
    }
    if (!b->push) {
      dsts[i] = convert ? t->dp_buf : (unsigned char *)op->dst + boff;
    } else if (convert) {
      zc_convert(t->dp_buf, op->wire_dtype, (const unsigned char *)op->src + boff, op->buf_dtype,
                 pc->numel);
      pieces[i].data = t->dp_buf;
    } else {
      pieces[i].data = zc_op_piece_src(op, pc);
    }
  }
  if (rc != ZS_OK) {
    for (uint32_t i = 0; i < b->n; i++)
      task_fail(c, b->t[i], rc, "out of memory for a batch");
    free(b);
    return 1;
  }

  pthread_mutex_lock(&dp->mu);
  zc_dpconn *k = dp->shard[shard].cur;
  if (k) {
    k->users++;
    for (uint32_t i = 0; i < b->n; i++) {
      b->t[i]->dp_gen = dp->shard[shard].gen;
      b->t[i]->dp_rgen = dp->shard[shard].rgen;
    }
  }
  pthread_mutex_unlock(&dp->mu);
  if (!k) {
    for (uint32_t i = 0; i < b->n; i++) {
      free(b->t[i]->dp_buf);
      b->t[i]->dp_buf = NULL;
    }
    free(b);
    return 0;
  }
  const zs_request *op0 = b->t[0]->op;
  uint32_t n = b->n;
  for (uint32_t i = 0; trace_enabled() && i < n; i++)
    trace_task(c, b->t[i], b->push ? TRACE_C_PUSH : TRACE_C_PULL);
  zc_task *tasks[WIRE_MAX_BATCH];
  memcpy(tasks, b->t, n * sizeof tasks[0]);
  if (b->push) {
    dp_push_batch_args a = {.spec_hash = c->hash,
                            .step = op0->step,
                            .rank = c->opt.rank,
                            .micro = op0->micro,
                            .pieces = pieces,
                            .npieces = n,
                            .timeout_ms = c->opt.rpc_timeout_ms};
    rc = dp_client_push_batch(k->cli, &a, on_batch_answer, b);
  } else {
    dp_pull_batch_args a = {.spec_hash = c->hash,
                            .min_version = op0->step,
                            .pieces = pieces,
                            .npieces = n,
                            .dsts = dsts,
                            .timeout_ms = c->opt.step_timeout_ms};
    rc = dp_client_pull_batch(k->cli, &a, on_batch_answer, b);
  }
  /* From here on b belongs to the answer (when rc is 0). */
  if (rc == ZS_OK)
    atomic_fetch_add(&dp->batches, 1);
  pthread_mutex_lock(&dp->mu);
  if (--k->users == 0)
    pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  if (rc != ZS_OK) {
    for (uint32_t i = 0; i < n; i++)
      task_fail(c, tasks[i], rc, "the data-plane client refused the batch");
    free(b);
  }
  return 1;
}

/* Piece i of a push batch the shard answered: its task finishes with the
 * piece's own status. The sentence names the first refused piece
 * (*first_refusal, cleared once used); the others get their status's own. */
static void push_piece_answered(zs_client *c, zc_task *t, const dp_result *r, uint32_t i,
                                int *first_refusal) {
  int st = i < r->npieces ? r->piece_status[i] : ZS_EPROTO;
  if (st == ZS_OK) {
    trace_task(c, t, TRACE_C_PUSH_ACK);
    task_finish(t, ZS_OK, NULL, dtype_bytes(t->op->wire_dtype, c->lay.pieces[t->piece].numel));
    return;
  }
  task_fail(c, t, st, *first_refusal ? r->message : zs_strerror(st));
  *first_refusal = 0;
}

/* The answer of a batch, on the data client's loop thread: each task
 * finishes (or is retried) as its single request would have. A pull batch's
 * pieces are already where single pulls would have put them. */
static void on_batch_answer(void *arg, const dp_result *r) {
  zc_dpbatch *b = arg;
  zs_client *c = b->c;
  tls_in_callback = 1;
  int first_refusal = 1;
  for (uint32_t i = 0; i < b->n; i++) {
    zc_task *t = b->t[i];
    if (r->status != ZS_OK) {
      attempt_failed(c, t, r->status, r->message);
    } else if (!b->push) {
      pull_answered(c, t, r->version);
    } else {
      push_piece_answered(c, t, r, i, &first_refusal);
    }
  }
  free(b);
  tls_in_callback = 0;
}

uint64_t zc_dp_batches(const struct zs_client *c) {
  return c->dp ? atomic_load(&c->dp->batches) : 0;
}

uint64_t zc_dp_inline_submits(const struct zs_client *c) {
  return c->dp ? atomic_load(&c->dp->inline_submits) : 0;
}

zc_task *zc_dp_run_batch(struct zs_client *c, zc_task *list) {
  if (!c->dp)
    return list;
  zc_task *rest = NULL, **rest_tail = &rest;
  while (list) {
    zc_task *first = list;
    zc_op_kind kind = first->op->kind;
    if (first->dp_phase != ZC_DP_SEND ||
        (kind != ZC_OP_PUSH && kind != ZC_OP_PULL && kind != ZC_OP_PREFETCH)) {
      list = first->next;
      first->next = NULL;
      *rest_tail = first;
      rest_tail = &first->next;
      continue;
    }
    /* The longest run of tasks behind `first` that can share its batch. */
    zc_dpbatch *b = calloc(1, sizeof *b);
    if (!b) {
      /* Without memory for a batch the tasks go one by one. */
      *rest_tail = list;
      break;
    }
    b->c = c;
    b->push = kind == ZC_OP_PUSH;
    zc_task *t = list;
    while (t && b->n < WIRE_MAX_BATCH && batchable(first, t)) {
      b->t[b->n++] = t;
      t = t->next;
    }
    list = t;
    for (uint32_t i = 0; i < b->n; i++)
      b->t[i]->next = NULL;
    if (b->n == 1) {
      *rest_tail = first;
      rest_tail = &first->next;
      free(b);
      continue;
    }
    zc_task *taken[WIRE_MAX_BATCH];
    uint32_t n = b->n;
    memcpy(taken, b->t, n * sizeof taken[0]);
    uint64_t seen;
    if (member_moved(c, first->shard, &seen))
      refresh(c, first->shard, seen);
    if (!batch_submit(b)) {
      /* A shard without a data client: its tasks run over gRPC. */
      for (uint32_t i = 0; i < n; i++) {
        *rest_tail = taken[i];
        rest_tail = &taken[i]->next;
      }
    }
  }
  return rest;
}

/* Before the retry of task t on a replica set: reports the member's failure
 * to the set (which may fail over, replica.c) and returns how long to back
 * off: nothing when another member is primary now, at most until the set
 * can decide more. */
static uint64_t replica_failed(zs_client *c, zc_task *t, uint64_t backoff) {
  int f = t->dp_failed;
  if (t->dp_rgen == 0 ||
      (f != ZS_ECONN && f != ZS_ECLOSED && f != ZS_ENOTPRIMARY && f != ZS_ESTALE &&
       f != ZS_ENOTOPEN && f != ZS_ENOTREADY && f != ZS_ETIMEDOUT))
    return backoff;
  uint64_t wait;
  int unreachable = f == ZS_ECONN || f == ZS_ECLOSED || f == ZS_ETIMEDOUT;
  zc_replica_failed(c, t->shard, t->dp_rgen, unreachable, &wait);
  if (atomic_load(&c->rs[t->shard].gen) != t->dp_rgen)
    return 0;
  return wait < backoff ? wait : backoff;
}

int zc_dp_run(struct zs_client *c, zc_task *t) {
  zc_op_kind kind = t->op->kind;
  if ((kind != ZC_OP_PUSH && kind != ZC_OP_PULL && kind != ZC_OP_PREFETCH) || !c->dp)
    return 0;
  switch (t->dp_phase) {
  case ZC_DP_FINISH:
    pull_finish(c, t);
    return 1;
  case ZC_DP_RETRY: {
    uint64_t backoff = c->opt.retry_initial_ms;
    for (uint32_t i = 1; i < t->dp_attempt && backoff < c->opt.retry_max_ms; i++)
      backoff *= 2;
    if (backoff > c->opt.retry_max_ms)
      backoff = c->opt.retry_max_ms;
    if (c->rs[t->shard].n > 1)
      backoff = replica_failed(c, t, backoff);
    if (zc_backoff_wait(c, backoff)) {
      task_fail(c, t, ZS_ECANCELED, "cancelled: the client is closing");
      return 1;
    }
    refresh(c, t->shard, t->dp_gen);
    break;
  }
  default: {
    uint64_t seen;
    if (member_moved(c, t->shard, &seen))
      refresh(c, t->shard, seen);
    break;
  }
  }
  t->dp_phase = ZC_DP_SEND;
  return submit(c, t);
}
