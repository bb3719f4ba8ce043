/*
 * replica_join — joining, from the joiner's side: a member with no state of
 * the set (started empty, dropped, deposed) asks the primary (ReplicaJoin),
 * reads its copy (ReplicaFetch, REPLICA_FETCH_ELEMS at a time) and loads it
 * (core_restore), telling the primary meanwhile that it works on its copy
 * (ReplicaFetch of REPLICA_PART_LOADING, from the copy_ticker's thread); the
 * primary's side is in replica_primary.c.
 */
#include "server/replica/replica_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/model/spec.h"

/* ------------------------------------------------------------ joining (joiner) */

/* One ReplicaFetch from member p, retried while the copy is not made yet. */
static int fetch_part(replica *r, member *p, uint64_t join_id, int part, uint64_t offset,
                      uint64_t count, Zshard__V1__ReplicaFetchResponse **out, char *err,
                      size_t errlen) {
  uint64_t start = clock_now_ms();
  for (;;) {
    rpc_channel *ch = replica__channel(r, p);
    if (!ch)
      return status_fail(err, errlen, ZS_ECONN, "no channel to %s", p->addr);
    Zshard__V1__ReplicaFetchRequest q = ZSHARD__V1__REPLICA_FETCH_REQUEST__INIT;
    q.join_id = join_id;
    q.part = (Zshard__V1__ReplicaPart)part;
    q.offset = offset;
    q.count = count;
    rpc_status st;
    int rc = rpc_call(ch, REPLICA_METHOD("ReplicaFetch"), &q.base,
                      &zshard__v1__replica_fetch_response__descriptor, (ProtobufCMessage **)out,
                      REPLICA_RPC_MS, &st);
    if (rc != ZS_ENOTREADY || clock_now_ms() - start > REPLICA_JOIN_MS) {
      if (rc)
        status_fail(err, errlen, rc, "ReplicaFetch from %s: %s", p->addr, st.message);
      return rc;
    }
    pthread_mutex_lock(&r->mu);
    int stop = r->stopping;
    pthread_mutex_unlock(&r->mu);
    if (stop)
      return status_fail(err, errlen, ZS_ECANCELED, "stopping");
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

static int fetch_array_into(replica *r, member *p, uint64_t join_id, int part, float *dst,
                            uint64_t n, char *err, size_t errlen) {
  for (uint64_t off = 0; off < n;) {
    uint64_t k = n - off < REPLICA_FETCH_ELEMS ? n - off : REPLICA_FETCH_ELEMS;
    Zshard__V1__ReplicaFetchResponse *a = NULL;
    int rc = fetch_part(r, p, join_id, part, off, k, &a, err, errlen);
    if (rc)
      return rc;
    if (a->data.len != k * sizeof(float)) {
      protobuf_c_message_free_unpacked(&a->base, NULL);
      return status_fail(err, errlen, ZS_EPROTO, "ReplicaFetch answered %zu bytes, not %" PRIu64,
                         a->data.len, k * sizeof(float));
    }
    memcpy(dst + off, a->data.data, a->data.len);
    protobuf_c_message_free_unpacked(&a->base, NULL);
    off += k;
  }
  return 0;
}

/* Sets m to the n ranks at `ranks`, each below W and none twice. */
static int unpack_ranks(const uint32_t *ranks, size_t n, uint32_t W, core_members *m) {
  memset(m, 0, sizeof *m);
  for (size_t i = 0; i < n; i++) {
    if (ranks[i] >= W || ranks[i] >= CORE_ELASTIC_MAX_W || core_members_has(m, ranks[i]))
      return -1;
    core_members_add(m, ranks[i]);
  }
  return 0;
}

/* The copy's membership (META) into st->members, every count, rank and step
 * checked as a checkpoint's members section is (ckpt__dec_members): the
 * primary is a peer, but a damaged copy must not become a backup's state.
 * The log is unpacked into an array of its own, then copied with the rest
 * (core_member_state_copy): one copy more than needed, of at most
 * CORE_MEMBER_LOG_MAX entries, once a join. */
static int unpack_membership(const Zshard__V1__ReplicaMembership *pm, core_state *st, char *err,
                             size_t errlen) {
  uint32_t W = st->spec.world_size;
  uint32_t w = W < CORE_ELASTIC_MAX_W ? W : CORE_ELASTIC_MAX_W;
  size_t nlog = pm->n_log_steps;
  core_member_state ms = {.trainer_timeout_ms = pm->trainer_timeout_ms,
                          .flag_timeout_ms = pm->flag_timeout_ms,
                          .epoch = pm->epoch,
                          .leaves = pm->leaves,
                          .timeouts = pm->timeouts,
                          .joins = pm->joins,
                          .log_n = (uint32_t)nlog,
                          .join_at = pm->join_at,
                          .leave_at = pm->leave_at,
                          .nplan = (uint32_t)pm->n_join_at};
  if (pm->trainer_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS ||
      pm->flag_timeout_ms > CORE_MAX_TRAINER_TIMEOUT_MS)
    return status_fail(err, errlen, ZS_EPROTO,
                       "the copy's membership has a trainer timeout of %u ms and a flag timeout "
                       "of %u ms (at most %u each)",
                       pm->trainer_timeout_ms, pm->flag_timeout_ms, CORE_MAX_TRAINER_TIMEOUT_MS);
  int bad = W > CORE_ELASTIC_MAX_W || nlog > CORE_MEMBER_LOG_MAX || pm->n_log_counts != nlog ||
            (pm->n_join_at != 0 && pm->n_join_at != w) || pm->n_leave_at != pm->n_join_at ||
            unpack_ranks(pm->members, pm->n_members, W, &ms.members) != 0;
  core_member_log_entry *log = bad ? NULL : malloc(nlog * sizeof *log + 1);
  if (!bad && !log)
    return ZS_ENOMEM;
  size_t at = 0;
  for (size_t k = 0; k < nlog && !bad; k++) {
    bad = pm->log_counts[k] > pm->n_log_ranks - at || pm->log_steps[k] == 0 ||
          pm->log_steps[k] > st->version || (k > 0 && pm->log_steps[k] <= pm->log_steps[k - 1]) ||
          unpack_ranks(pm->log_ranks + at, pm->log_counts[k], W, &log[k].members) != 0;
    log[k].from_step = pm->log_steps[k];
    at += bad ? 0 : pm->log_counts[k];
  }
  int rc = 0;
  if (bad || at != pm->n_log_ranks)
    rc = status_fail(err, errlen, ZS_EPROTO,
                     "the copy's membership does not hold together (world size %u, %zu "
                     "member(s), %zu log entries, %zu plan(s))",
                     W, pm->n_members, nlog, pm->n_join_at);
  ms.log = log;
  if (rc == 0)
    rc = core_member_state_copy(&st->members, &ms);
  free(log);
  return rc;
}

/* Reads the primary's copy into st (initialised from its META). */
static int fetch_state(replica *r, member *p, uint64_t join_id, core_state *st, char *err,
                       size_t errlen) {
  Zshard__V1__ReplicaFetchResponse *meta = NULL;
  int rc = fetch_part(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_META, 0, 0, &meta, err,
                      errlen);
  if (rc)
    return rc;
  spec sp;
  memset(&sp, 0, sizeof sp);
  rc = meta->spec ? spec_from_proto(&sp, meta->spec, err, errlen)
                  : status_fail(err, errlen, ZS_EPROTO, "the copy's META has no spec");
  if (rc == 0)
    rc = core_state_init(st, &sp, meta->shard_id, err, errlen);
  if (rc == 0 && st->nelems != meta->elements)
    rc = status_fail(err, errlen, ZS_EPROTO, "the copy has %" PRIu64 " elements, the spec %" PRIu64,
                     meta->elements, st->nelems);
  if (rc == 0 && meta->client_state.len) {
    st->client_state = malloc(meta->client_state.len);
    if (!st->client_state)
      rc = ZS_ENOMEM;
    else
      memcpy(st->client_state, meta->client_state.data, meta->client_state.len);
    st->client_state_len = meta->client_state.len;
  }
  if (rc == 0 && meta->n_tensor_steps) {
    if (meta->n_tensor_steps != st->spec.num_tensors)
      rc = status_fail(err, errlen, ZS_EPROTO,
                       "the copy has %zu tensor step counts, the spec %u tensors",
                       meta->n_tensor_steps, st->spec.num_tensors);
    else if (!(st->tensor_steps = malloc(meta->n_tensor_steps * sizeof *st->tensor_steps)))
      rc = ZS_ENOMEM;
    else
      memcpy(st->tensor_steps, meta->tensor_steps, meta->n_tensor_steps * sizeof *st->tensor_steps);
  }
  if (rc == 0) {
    st->version = meta->version;
    st->optimizer_steps = meta->optimizer_steps;
    if (meta->membership)
      rc = unpack_membership(meta->membership, st, err, errlen);
  }
  if (rc == 0) {
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_MASTER, st->master,
                          st->nelems, err, errlen);
  }
  if (rc == 0 && st->m)
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG, st->m,
                          st->nelems, err, errlen);
  if (rc == 0 && st->v)
    rc = fetch_array_into(r, p, join_id, ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG_SQ, st->v,
                          st->nelems, err, errlen);
  spec_free(&sp);
  protobuf_c_message_free_unpacked(&meta->base, NULL);
  return rc;
}

/* While the joiner works on its copy, from its first read until the copy is
 * loaded into its core, a thread of its own tells the primary so (a
 * ReplicaFetch of REPLICA_PART_LOADING, the wire's name for that word) every
 * failover time / REPLICA_COPY_TICK: the primary drops a joiner after the
 * failover time without progress, and a read that waits (a loaded machine, a
 * throttled joiner) or a large shard's load may take longer. */
typedef struct copy_ticker {
  replica *r;
  member *p;
  uint64_t join_id;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC; done */
  int done;
  pthread_t thread;
  int started;
} copy_ticker;

static void tell_working_on_copy(copy_ticker *t, uint32_t ms) {
  rpc_channel *ch = replica__channel(t->r, t->p);
  if (!ch)
    return;
  Zshard__V1__ReplicaFetchRequest q = ZSHARD__V1__REPLICA_FETCH_REQUEST__INIT;
  q.join_id = t->join_id;
  q.part = ZSHARD__V1__REPLICA_PART__REPLICA_PART_LOADING;
  Zshard__V1__ReplicaFetchResponse *a = NULL;
  rpc_status st;
  /* A word that comes late or not at all (a primary of an older version,
   * one whose threads are busy) only leaves the bound as it was. */
  if (rpc_call(ch, REPLICA_METHOD("ReplicaFetch"), &q.base,
               &zshard__v1__replica_fetch_response__descriptor, (ProtobufCMessage **)&a, ms,
               &st) == 0)
    protobuf_c_message_free_unpacked(&a->base, NULL);
}

static void *ticker_main(void *arg) {
  copy_ticker *t = arg;
  uint32_t ms = t->r->failover_ms / REPLICA_COPY_TICK;
  if (ms < 10)
    ms = 10;
  pthread_mutex_lock(&t->mu);
  while (!t->done) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    while (!t->done && pthread_cond_timedwait(&t->cv, &t->mu, &ts) == 0) {
    }
    if (t->done)
      break;
    pthread_mutex_unlock(&t->mu);
    tell_working_on_copy(t, ms);
    pthread_mutex_lock(&t->mu);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

/* Starts t's thread (without one the work on the copy goes on untold: the
 * bound stays). */
static void ticker_start(copy_ticker *t, replica *r, member *p, uint64_t join_id) {
  memset(t, 0, sizeof *t);
  t->r = r;
  t->p = p;
  t->join_id = join_id;
  pthread_mutex_init(&t->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  t->started = pthread_create(&t->thread, NULL, ticker_main, t) == 0;
}

static void ticker_stop(copy_ticker *t) {
  pthread_mutex_lock(&t->mu);
  t->done = 1;
  pthread_cond_signal(&t->cv);
  pthread_mutex_unlock(&t->mu);
  if (t->started)
    pthread_join(t->thread, NULL);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
}

/* Replaces this replica's state by the copy, closing a job of another spec
 * first. */
static int load_state(replica *r, core_state *st, char *err, size_t errlen) {
  /* Tests only: a load that takes that much longer, as a large shard's would. */
  replica__test_stall("ZSHARD_TEST_LOAD_STALL_MS");
  core_info info;
  core_get_info(r->core, &info);
  if (info.has_job && info.spec_hash != spec_hash(&st->spec)) {
    core_close_result cr;
    int rc = service_close(r->svc, 0, NULL, &cr, err, errlen);
    if (rc)
      return rc;
  }
  return core_restore(r->core, st, st->version, err, errlen);
}

/* Asks member p (primary of `term`) to join and loads its copy. Returns 0
 * or the failure's status (logged). */
int replica__join_primary(replica *r, uint32_t p, uint64_t term) {
  pthread_mutex_lock(&r->mu);
  r->role = REPLICA_JOINING;
  r->term = term;
  r->primary = (int)p;
  pthread_mutex_unlock(&r->mu);
  char err[REPLICA_ERRLEN] = "";
  member *pm = &r->m[p];
  uint64_t t0 = clock_now_ms();
  Zshard__V1__ReplicaJoinRequest q = ZSHARD__V1__REPLICA_JOIN_REQUEST__INIT;
  q.term = term;
  q.index = r->index;
  Zshard__V1__ReplicaJoinResponse *resp = NULL;
  rpc_status st;
  rpc_channel *ch = replica__channel(r, pm);
  int rc = ch ? rpc_call(ch, REPLICA_METHOD("ReplicaJoin"), &q.base,
                         &zshard__v1__replica_join_response__descriptor, (ProtobufCMessage **)&resp,
                         REPLICA_RPC_MS, &st)
              : ZS_ECONN;
  if (rc)
    snprintf(err, sizeof err, "%.200s", ch ? st.message : "no channel");
  uint64_t join_id = resp ? resp->join_id : 0;
  if (resp)
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  core_state cs;
  memset(&cs, 0, sizeof cs);
  if (rc == 0 && join_id == 0) {
    core_info info;
    core_get_info(r->core, &info);
    core_close_result cr;
    if (info.has_job)
      rc = service_close(r->svc, 0, NULL, &cr, err, sizeof err);
  } else if (rc == 0) {
    /* Told from the first read on: a read of the copy that waits (a loaded
     * machine, a throttled joiner) is progress the primary cannot see. */
    copy_ticker t;
    ticker_start(&t, r, pm, join_id);
    rc = fetch_state(r, pm, join_id, &cs, err, sizeof err);
    if (rc == 0)
      rc = load_state(r, &cs, err, sizeof err);
    ticker_stop(&t);
  }
  core_state_free(&cs);
  pthread_mutex_lock(&r->mu);
  if (r->role == REPLICA_JOINING && r->term == term)
    r->role = rc == 0 ? REPLICA_BACKUP : REPLICA_STALE;
  if (rc == 0)
    r->joins++;
  pthread_mutex_unlock(&r->mu);
  if (rc == 0)
    LOG_INFO("replica_loaded", "primary=%u term=%" PRIu64 " copy=%s took_ms=%" PRIu64, p, term,
             join_id ? "yes" : "none", clock_now_ms() - t0);
  else
    LOG_WARN("replica_join_failed", "primary=%u term=%" PRIu64 " error=%s detail=\"%s\"", p, term,
             zs_err_name(rc), err);
  return rc;
}
