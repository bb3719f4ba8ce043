/*
 * replica_primary — the primary's role: every write it accepted is forwarded
 * to each backup in sync (and each joiner) and the trainer answered only
 * when every one acknowledged it or was dropped; a member that asks to join
 * is copied at the next applied step and reads the copy (ReplicaJoin,
 * ReplicaFetch); the primary's monitor round drops backups that fell behind
 * and joiners that went silent.
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

/* ------------------------------------------------------------ forwarding */

/* How a backup's answer to a forward is taken. */
enum { FWD_DONE, FWD_RETRY, FWD_DROP, FWD_DEPOSED };

static int classify(int rc) {
  switch (rc) {
  case ZS_OK:
    return FWD_DONE;
  case ZS_ECONN:
  case ZS_ECLOSED:
  case ZS_ETIMEDOUT:
  case ZS_ECANCELED:
  case ZS_ENOTREADY:
  case ZS_ELIMIT:
  case ZS_ECRC:
    return FWD_RETRY;
  case ZS_ESTALE:
    return FWD_DEPOSED;
  case ZS_EBEHIND:
  case ZS_ESTEP:
  case ZS_EHASH:
  case ZS_ENOTOPEN:
  case ZS_EEXIST:
  case ZS_ENOTPRIMARY:
  case ZS_EUNAUTHENTICATED:
  case ZS_EPERM:
    return FWD_DROP;
  default:
    /* The primary accepted this write: a backup that refuses it does not
     * hold what the primary holds. */
    return FWD_DROP;
  }
}

/* The members a write of `step` (0: a write of no step) goes to, under mu.
 * A member that joined with a copy of version V already holds every write of
 * a step up to V: the forward would only be refused (an Apply the joiner's
 * core has no record of) and the member dropped, so it is left out. */
uint32_t replica__targets_locked(const replica *r, uint64_t step, fwd_target *t) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < r->n; i++) {
    const member *m = &r->m[i];
    if (i == r->index || !(m->in_sync || m->joining) || (step && step <= m->covered))
      continue;
    t[n++] = (fwd_target){.idx = i, .joining = m->joining};
  }
  return n;
}

static int any_joining_locked(const replica *r) {
  for (uint32_t i = 0; i < r->n; i++)
    if (r->m[i].joining)
      return 1;
  return 0;
}

/* After a joiner loaded the copy or was dropped: once no member reads it,
 * the copy is free for the next join (and its memory released, unless an
 * answer still points into it: then the next copy replaces it). */
static void snap_release_locked(replica *r) {
  if (!r->snap_busy || !r->snap_ready || any_joining_locked(r))
    return;
  r->snap_busy = 0;
  if (r->snap_packing == 0)
    core_state_free(&r->snap);
}

void replica__drop_locked(replica *r, uint32_t i, int rc, const char *why) {
  member *m = &r->m[i];
  if (!m->in_sync && !m->joining)
    return;
  m->in_sync = m->joining = m->join_pending = 0;
  m->covered = 0;
  m->join_id = 0; /* its ReplicaFetch calls are refused: its join failed */
  snap_release_locked(r);
  LOG_WARN("replica_dropped", "member=%u addr=%s term=%" PRIu64 " error=%s detail=\"%s\"", i,
           m->addr, r->term, zs_err_name(rc), why);
}

/* The clocks of one forward to one member (send_each). A member is
 * dropped once it failed for the failover time counted from first_fail (the
 * write's start once an attempt failed, 0 before). The attempts share one
 * deadline, start + bound (bound: attempt_ms), so that a member that fails
 * fast and then goes silent holds the write about the bound once, not once
 * per attempt; settle moves start (and first_fail) forward only where a
 * rule extends the wait on purpose, each said where it does. */
typedef struct fwd_clock {
  uint64_t first_fail, start;
  uint32_t bound;
} fwd_clock;

/* What the next attempt may wait: what is left of the shared deadline, at
 * least 1 ms (a call given 0 would wait without a deadline). */
static uint32_t attempt_left(const fwd_clock *ck, uint64_t now) {
  uint64_t end = ck->start + ck->bound;
  return end > now + 1 ? (uint32_t)(end - now) : 1u;
}

/* After one attempt on member t with status rc: FWD_DONE (move on),
 * FWD_RETRY (again after a pause), or the member dropped / this replica
 * deposed (both: move on; deposed returns ZS_ENOTPRIMARY). */
static int settle(replica *r, const fwd_target *t, int rc, const char *msg, int is_push,
                  uint64_t sent_ms, fwd_clock *ck, uint64_t term, int *deposed) {
  int k = classify(rc);
  pthread_mutex_lock(&r->mu);
  member *m = &r->m[t->idx];
  if (r->term != term || r->role != REPLICA_PRIMARY) {
    pthread_mutex_unlock(&r->mu);
    *deposed = 1;
    return FWD_DONE;
  }
  if (rc != ZS_ECONN && rc != ZS_ECLOSED && rc != ZS_ETIMEDOUT && rc != ZS_ECANCELED)
    m->heard_ms = clock_now_ms();
  if (k == FWD_DONE && m->joining) {
    /* A joiner answers only once it loaded its copy, which it no longer
     * reads. */
    m->joining = 0;
    m->in_sync = 1;
    snap_release_locked(r);
    LOG_INFO("replica_joined", "member=%u addr=%s term=%" PRIu64, t->idx, m->addr, r->term);
  } else if (k == FWD_DEPOSED) {
    replica__step_down_locked(r, msg);
    *deposed = 1;
  } else if (k == FWD_DROP) {
    replica__drop_locked(r, t->idx, rc, msg);
  } else if (k == FWD_RETRY) {
    uint64_t now = clock_now_ms();
    if (r->fwd_stopping) {
      /* Shutting down (the attempt may have been cancelled by it): nobody
       * is dropped for it; the forward answers ZS_ECLOSED. */
    } else if (!m->in_sync && !m->joining) {
      k = FWD_DONE; /* dropped meanwhile */
    } else if (!is_push && !m->joining && rc == ZS_ENOTREADY &&
               (m->pushing || m->pushed_ms >= sent_ms || r->pushes_pending ||
                r->pending_done_ms >= sent_ms)) {
      /* A backup that answers misses contributions that pushes still under
       * way bring it (each bounded by the failover time, or it is
       * dropped): the failover time counts from when they are through.
       * A push that ended after this attempt was sent may have landed
       * after the backup answered it: the attempt is retried as well.
       * Pushes accepted here but still waiting for a forwarding thread
       * (replica_push_pending) count too: their forward has not begun, so
       * no member.pushing says so yet.
       * Both clocks restart: the next attempt waits the whole bound. */
      ck->first_fail = ck->start = now;
    } else if (m->joining && rc == ZS_ENOTREADY && r->snap_busy && !r->snap_ready) {
      /* The copy is still being made here: the wait is this primary's, not
       * the joiner's (a large shard's copy, a loaded machine); the bound
       * counts from the copy made (snap_done), and the next attempt may
       * wait the whole bound. */
      ck->start = now;
    } else if (m->joining && rc == ZS_ENOTREADY &&
               now - (m->progress_ms > ck->first_fail ? m->progress_ms : ck->first_fail) >=
                   r->failover_ms) {
      /* Alive but still reading or loading its copy: a write waits for a
       * joiner while it makes progress on the copy (a large shard's copy
       * may take longer than the failover time), and at most the failover
       * time since its last step forward; then the joiner is dropped and
       * asks again (a copy made at a later step). */
      replica__drop_locked(r, t->idx, rc,
                           "it was still loading its copy and made no progress on it for the "
                           "failover time while a write waited for it: it joins again");
      k = FWD_DONE;
    } else if (m->joining && rc == ZS_ENOTREADY) {
      /* Retried until the failover time since its last progress, which
       * moves the attempts' deadline too. */
      if (m->progress_ms > ck->start)
        ck->start = m->progress_ms;
    } else if (now - ck->first_fail >= r->failover_ms) {
      /* The member's last answer says why (a refusal is not a silence). */
      char why[REPLICA_ERRLEN + 64];
      snprintf(why, sizeof why, "no answer within the failover time; the last: %s",
               msg && msg[0] ? msg : zs_err_name(rc));
      replica__drop_locked(r, t->idx, rc, why);
      k = FWD_DONE;
    }
  }
  pthread_mutex_unlock(&r->mu);
  return k == FWD_RETRY ? FWD_RETRY : FWD_DONE;
}

/* One attempt of a write on member m, waiting at most wait_ms. */
typedef int (*send_fn)(replica *r, member *m, uint64_t term, const void *arg, uint32_t wait_ms,
                       char *msg, size_t len);

static int send_push(replica *r, member *m, uint64_t term, const void *arg, uint32_t wait_ms,
                     char *msg, size_t len);
static int send_raw(replica *r, member *m, uint64_t term, const void *arg, uint32_t wait_ms,
                    char *msg, size_t len);

/* Marks the n targets t as receiving pushes from this thread (up: 1) or no
 * longer (up: 0); see member.pushing. */
static void count_pushing(replica *r, const fwd_target *t, uint32_t n, int up) {
  pthread_mutex_lock(&r->mu);
  for (uint32_t i = 0; i < n; i++) {
    member *m = &r->m[t[i].idx];
    if (up) {
      m->pushing++;
    } else {
      m->pushing--;
      m->pushed_ms = clock_now_ms();
    }
  }
  pthread_mutex_unlock(&r->mu);
}

void replica_push_pending(replica *r, int up) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  if (up) {
    r->pushes_pending++;
  } else if (r->pushes_pending > 0) {
    r->pushes_pending--;
    r->pending_done_ms = clock_now_ms();
  }
  pthread_mutex_unlock(&r->mu);
}

/* The backups a write of `step` goes to now (replica__targets_locked) and
 * the term they were chosen under; none when this replica is not the primary
 * (*primary: 0). */
static uint32_t targets(replica *r, uint64_t step, fwd_target *t, uint64_t *term, int *primary) {
  pthread_mutex_lock(&r->mu);
  *term = r->term;
  *primary = r->role == REPLICA_PRIMARY;
  uint32_t n = *primary ? replica__targets_locked(r, step, t) : 0;
  pthread_mutex_unlock(&r->mu);
  return n;
}

/* Whether the server stopped its forwards (replica_stop_forwards). */
static int forwards_stopped(replica *r) {
  pthread_mutex_lock(&r->mu);
  int stop = r->fwd_stopping;
  pthread_mutex_unlock(&r->mu);
  return stop;
}

void replica_stop_forwards(replica *r) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  r->fwd_stopping = 1;
  pthread_mutex_unlock(&r->mu);
}

/* Sends one write to the n targets t, chosen under `term`, each until it
 * answered or was dropped. The failover time of a forward counts from
 * `since` (when the write began to wait for its backups), so that a dead
 * backup holds a write for --failover-ms however many attempts it took;
 * the attempts on one member share the deadline of its first attempt's
 * start plus `bound` (fwd_clock). */
static int send_each(replica *r, const fwd_target *t, uint32_t n, uint64_t term, send_fn fn,
                     const void *arg, int is_push, uint64_t bytes, uint32_t bound, uint64_t since,
                     char *err, size_t errlen) {
  int deposed = 0;
  for (uint32_t i = 0; i < n && !deposed; i++) {
    fwd_clock ck = {.first_fail = 0, .start = clock_now_ms(), .bound = bound};
    for (;;) {
      if (forwards_stopped(r))
        return status_fail(err, errlen, ZS_ECLOSED,
                           "the server is shutting down; the write was not forwarded to every "
                           "backup");
      char msg[REPLICA_ERRLEN] = "";
      uint64_t sent = clock_now_ms();
      int rc = fn(r, &r->m[t[i].idx], term, arg, attempt_left(&ck, sent), msg, sizeof msg);
      if (rc != 0 && !ck.first_fail)
        ck.first_fail = since;
      if (settle(r, &t[i], rc, msg, is_push, sent, &ck, term, &deposed) != FWD_RETRY)
        break;
      struct timespec ts = {.tv_sec = 0, .tv_nsec = REPLICA_RETRY_MS * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  if (deposed)
    return status_fail(err, errlen, ZS_ENOTPRIMARY,
                       "this replica is no longer its shard's primary (a newer term exists)");
  pthread_mutex_lock(&r->mu);
  r->forwards += n;
  r->forwarded_bytes += bytes * n;
  pthread_mutex_unlock(&r->mu);
  return 0;
}

static int forward_batch(replica *r, const fwd_target *t, uint32_t nt, uint64_t term,
                         const core_push_args *a, uint32_t n, uint64_t since, char *err,
                         size_t errlen);
static uint32_t attempt_ms(replica *r, replica_write kind, uint64_t bytes);

/* Forwards nw writes of one kind (nw > 1: contributions, `arg` an array of
 * core_push_args sent with send_push) to the backups; `step` (0 for a
 * batch) and `bytes` those of a single write. The one place that counts the
 * targets of a push as receiving it (member.pushing), from before the first
 * attempt until every write of the batch went through. */
static int forward(replica *r, replica_write kind, send_fn fn, const void *arg, uint32_t nw,
                   uint64_t step, uint64_t bytes, char *err, size_t errlen) {
  uint64_t since = clock_now_ms();
  fwd_target t[REPLICA_MAX_MEMBERS];
  uint64_t term;
  int primary;
  uint32_t nt = targets(r, step, t, &term, &primary);
  if (!primary)
    return status_fail(err, errlen, ZS_ENOTPRIMARY, "this replica stopped being the primary");
  int is_push = kind == REPLICA_FWD_PUSH;
  if (is_push)
    count_pushing(r, t, nt, 1);
  int rc = nw == 1 ? send_each(r, t, nt, term, fn, arg, is_push, bytes, attempt_ms(r, kind, bytes),
                               since, err, errlen)
                   : forward_batch(r, t, nt, term, arg, nw, since, err, errlen);
  if (is_push)
    count_pushing(r, t, nt, 0);
  return rc;
}

/* A contribution as a forward: the data plane's push of the same bytes,
 * given wait_ms to be answered. */
static dp_push_args dp_push_of(const core_push_args *a, uint32_t wait_ms) {
  return (dp_push_args){.spec_hash = a->hash,
                        .step = a->step,
                        .rank = a->rank,
                        .micro = a->micro,
                        .tensor = a->tensor,
                        .slice = a->slice,
                        .dtype = a->dtype,
                        .data = a->data,
                        .nbytes = a->nbytes,
                        .timeout_ms = wait_ms};
}

static int send_push(replica *r, member *m, uint64_t term, const void *arg, uint32_t wait_ms,
                     char *msg, size_t len) {
  const core_push_args *a = arg;
  data_link *l = replica__data_client(r, m, term);
  if (!l)
    return status_fail(msg, len, ZS_ECONN, "no data-plane connection to %s", m->addr);
  dp_push_args p = dp_push_of(a, wait_ms);
  int dup = 0;
  int rc = dp_client_push_sync(l->d, &p, &dup, msg, len);
  /* A restarted member listens elsewhere: the next forward asks again. */
  replica__put_data_client(m, l, rc == ZS_ECONN || rc == ZS_ECLOSED || rc == ZS_EUNAUTHENTICATED);
  return rc;
}

int replica_forward_push(replica *r, const core_push_args *a, char *err, size_t errlen) {
  return forward(r, REPLICA_FWD_PUSH, send_push, a, 1, a->step, a->nbytes, err, errlen);
}

/* The answers to pushes sent at once. */
typedef struct push_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t pending;
  int failed;
} push_wait;

static void on_push_done(void *arg, const dp_result *res) {
  push_wait *w = arg;
  pthread_mutex_lock(&w->mu);
  if (res->status != 0)
    w->failed = 1;
  if (--w->pending == 0)
    pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Sends n pushes to member m at once (pipelined on its connections) and
 * waits for every answer: 0 when all were taken. */
static int send_pushes(replica *r, member *m, uint64_t term, const core_push_args *a, uint32_t n) {
  data_link *l = replica__data_client(r, m, term);
  if (!l)
    return ZS_ECONN;
  push_wait w = {.pending = n};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  for (uint32_t i = 0; i < n; i++) {
    /* Half the failover time: a failure here still leaves the one-by-one
     * path time to retry before the member is dropped. */
    dp_push_args p = dp_push_of(&a[i], r->failover_ms / 2);
    if (dp_client_push(l->d, &p, on_push_done, &w) != 0) {
      pthread_mutex_lock(&w.mu);
      w.failed = 1;
      w.pending--;
      pthread_mutex_unlock(&w.mu);
    }
  }
  pthread_mutex_lock(&w.mu);
  while (w.pending)
    pthread_cond_wait(&w.cv, &w.mu);
  int failed = w.failed;
  pthread_mutex_unlock(&w.mu);
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  /* Not retired on a failure: the one-by-one retry tells a dead connection
   * (and retires it) from a refused push. */
  replica__put_data_client(m, l, 0);
  return failed ? ZS_ECONN : 0;
}

int replica_forward_pushes(replica *r, const core_push_args *a, uint32_t n, char *err,
                           size_t errlen) {
  if (n <= 1) /* a single push goes to the backups of its own step */
    return n ? replica_forward_push(r, a, err, errlen) : 0;
  return forward(r, REPLICA_FWD_PUSH, send_push, a, n, 0, 0, err, errlen);
}

/* The n > 1 contributions a to the nt targets t chosen under `term`
 * (forward). The common case at once; any failure takes the one-by-one
 * path, which retries, drops or steps down (a repeat is acknowledged as a
 * duplicate), each push to the targets of its own step then. */
static int forward_batch(replica *r, const fwd_target *t, uint32_t nt, uint64_t term,
                         const core_push_args *a, uint32_t n, uint64_t since, char *err,
                         size_t errlen) {
  int all = n > 1 && nt > 0;
  for (uint32_t i = 0; all && i < nt; i++)
    all = send_pushes(r, &r->m[t[i].idx], term, a, n) == 0;
  if (all) {
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = 0; i < nt; i++) {
      member *m = &r->m[t[i].idx];
      if (m->joining || !m->in_sync) /* settle() decides those */
        all = 0;
    }
    if (all && r->term == term) {
      uint64_t bytes = 0;
      for (uint32_t k = 0; k < n; k++)
        bytes += a[k].nbytes;
      r->forwards += (uint64_t)n * nt;
      r->forwarded_bytes += bytes * nt;
    }
    pthread_mutex_unlock(&r->mu);
  }
  int rc = 0;
  for (uint32_t k = 0; !all && k < n && rc == 0; k++) {
    fwd_target tk[REPLICA_MAX_MEMBERS];
    uint64_t term_k;
    int primary;
    uint32_t ntk = targets(r, a[k].step, tk, &term_k, &primary);
    rc = primary
             ? send_each(r, tk, ntk, term_k, send_push, &a[k], 1, a[k].nbytes,
                         attempt_ms(r, REPLICA_FWD_PUSH, a[k].nbytes), since, err, errlen)
             : status_fail(err, errlen, ZS_ENOTPRIMARY, "this replica stopped being the primary");
  }
  return rc;
}

typedef struct raw_req {
  const char *method;
  const void *msg;
  size_t len;
} raw_req;

static int stop_asked(void *r) {
  return forwards_stopped(r);
}

static int send_raw(replica *r, member *m, uint64_t term, const void *arg, uint32_t wait_ms,
                    char *msg, size_t len) {
  const raw_req *q = arg;
  rpc_channel *ch = replica__channel(r, m);
  if (!ch)
    return status_fail(msg, len, ZS_ECONN, "no channel to %s", m->addr);
  char tbuf[24], ibuf[12];
  snprintf(tbuf, sizeof tbuf, "%" PRIu64, term);
  snprintf(ibuf, sizeof ibuf, "%u", r->index);
  rpc_md md[2] = {{"zshard-replica-term", tbuf}, {"zshard-replica-from", ibuf}};
  rpc_status st;
  ProtobufCMessage *resp = NULL;
  /* At shutdown an attempt in flight ends at once (replica_stop_forwards). */
  rpc_stop stop = {stop_asked, r};
  int rc =
      rpc_call_raw_stop(ch, q->method, q->msg, q->len, md, 2, NULL, &resp, wait_ms, &stop, &st);
  if (rc)
    snprintf(msg, len, "%s", st.message);
  return rc;
}

static uint64_t ns_to_ms_up(uint64_t ns) {
  return (ns + 999999) / 1000000;
}

/* How long a forward of `bytes` bytes may wait for a member's answer, all
 * its attempts together (fwd_clock): the failover time, after which a
 * silent member is dropped (settle), so that it holds the trainers' write
 * that long once; plus the time its bytes take at REPLICA_MIN_RATE (a large
 * InitParams, WriteState or contribution on a slow link); plus, for work
 * that runs on the backup as it ran here, REPLICA_APPLY_WAIT_FACTOR times
 * this primary's own time of it: an Apply's (the step just applied, which
 * a forwarded Apply follows; it may also wait for the backup's apply of the
 * step before it) or a Restore's (reading and verifying the checkpoint). */
static uint32_t attempt_ms(replica *r, replica_write kind, uint64_t bytes) {
  pthread_mutex_lock(&r->mu);
  uint64_t ms = r->failover_ms + (bytes * 1000 + REPLICA_MIN_RATE - 1) / REPLICA_MIN_RATE;
  if (kind == REPLICA_FWD_APPLY)
    ms += REPLICA_APPLY_WAIT_FACTOR * ns_to_ms_up(r->hooked_apply_ns);
  else if (kind == REPLICA_FWD_RESTORE)
    ms += REPLICA_APPLY_WAIT_FACTOR * ns_to_ms_up(r->restore_ns);
  pthread_mutex_unlock(&r->mu);
  return ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
}

int replica_forward_raw(replica *r, const char *method, replica_write kind, uint64_t step,
                        const void *msg, size_t len, char *err, size_t errlen) {
  raw_req q = {.method = method, .msg = msg, .len = len};
  return forward(r, kind, send_raw, &q, 1, step, len, err, errlen);
}

void replica_on_restored(replica *r, uint64_t restore_ns) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  r->restore_ns = restore_ns;
  pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------ joins (primary) */

static int snap_view(void *arg, const core_view *v) {
  replica *r = arg;
  /* Tests only: a copy that takes that much longer to make, as a large
   * shard's would. */
  replica__test_stall("ZSHARD_TEST_COPY_STALL_MS");
  core_state *st = &r->snap;
  char err[REPLICA_ERRLEN];
  core_state_free(st);
  int rc = core_state_init(st, v->spec, v->shard_id, err, sizeof err);
  if (rc)
    return rc;
  st->version = v->version;
  st->optimizer_steps = v->optimizer_steps;
  if (v->tensor_steps) {
    size_t n = (size_t)v->spec->num_tensors * sizeof *st->tensor_steps;
    if (!(st->tensor_steps = malloc(n + 1)))
      return ZS_ENOMEM;
    memcpy(st->tensor_steps, v->tensor_steps, n);
  }
  memcpy(st->master, v->master, v->nelems * sizeof(float));
  if (st->m && v->m)
    memcpy(st->m, v->m, v->nelems * sizeof(float));
  if (st->v && v->v)
    memcpy(st->v, v->v, v->nelems * sizeof(float));
  if (v->client_state_len) {
    st->client_state = malloc(v->client_state_len);
    if (!st->client_state)
      return ZS_ENOMEM;
    memcpy(st->client_state, v->client_state, v->client_state_len);
    st->client_state_len = v->client_state_len;
  }
  /* An elastic job's membership, its log and plans too (core_state_free
   * frees them). */
  return v->members ? core_member_state_copy(&st->members, v->members) : 0;
}

static void snap_done(void *arg, int status, double fn_seconds) {
  replica *r = arg;
  pthread_mutex_lock(&r->mu);
  r->snap_ready = 1;
  r->snap_status = status;
  for (uint32_t i = 0; i < r->n; i++) {
    if (r->m[i].joining && status != 0)
      replica__drop_locked(r, i, status, "the copy of the state failed");
    else if (r->m[i].joining)
      r->m[i].progress_ms = clock_now_ms(); /* its copy is made: it reads it now */
  }
  snap_release_locked(r); /* all dropped while the copy was made */
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  LOG_INFO("replica_copy", "status=%s copy_s=%.3f", zs_err_name(status), fn_seconds);
}

void replica_on_applied(void *arg, const core_apply_result *res) {
  replica *r = arg;
  pthread_mutex_lock(&r->mu);
  r->hooked_version = res->version;
  r->hooked_apply_ns = res->apply_ns;
  pthread_cond_broadcast(&r->hooked_cv);
  /* Only the Apply of the copy's own step can still be forwarded after it
   * (the trainers' Applies of a step are answered before the next one is
   * applied); a restore may also take the version back below it. */
  for (uint32_t i = 0; i < r->n; i++)
    if (r->m[i].covered != res->version)
      r->m[i].covered = 0;
  /* A member that joined or was dropped meanwhile (a promotion, a step
   * down) leaves the copy to the next joiners. */
  snap_release_locked(r);
  uint32_t start = 0;
  int can = r->role == REPLICA_PRIMARY && !r->stopping && !r->snap_busy;
  for (uint32_t i = 0; i < r->n && can; i++) {
    member *m = &r->m[i];
    if (!m->join_pending)
      continue;
    m->join_pending = 0;
    m->joining = 1; /* every write from now on goes to it too */
    m->covered = res->version;
    m->progress_ms = clock_now_ms(); /* its copy is being made */
    r->joins++;
    start++;
  }
  if (start) {
    r->snap_busy = 1;
    r->snap_ready = 0;
  }
  pthread_mutex_unlock(&r->mu);
  if (!start)
    return;
  core_info info;
  core_get_info(r->core, &info);
  char err[REPLICA_ERRLEN];
  int rc = core_snapshot_async(r->core, info.spec_hash, res->version, 0, snap_view, r, snap_done, r,
                               err, sizeof err);
  LOG_INFO("replica_copy_start", "members=%u version=%" PRIu64 " status=%s", start, res->version,
           rc == CORE_PENDING ? "pending" : zs_err_name(rc));
  if (rc != CORE_PENDING)
    snap_done(r, rc < 0 ? rc : ZS_EINTERNAL, 0);
}

void replica_wait_applied(replica *r, uint64_t version) {
  if (!r || version == 0)
    return;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += r->failover_ms / 1000;
  ts.tv_nsec += (long)(r->failover_ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&r->mu);
  while (r->role == REPLICA_PRIMARY && r->hooked_version < version && !r->stopping)
    if (pthread_cond_timedwait(&r->hooked_cv, &r->mu, &ts) != 0)
      break;
  pthread_mutex_unlock(&r->mu);
}

int replica_join(replica *r, uint64_t term, uint32_t index, uint64_t *join_id, char *err,
                 size_t errlen) {
  *join_id = 0;
  core_info info;
  core_get_info(r->core, &info);
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  if (r->role != REPLICA_PRIMARY || term != r->term) {
    char who[200];
    replica__say_primary_locked(r, who, sizeof who);
    rc = status_fail(err, errlen, term > r->term ? ZS_ESTALE : ZS_ENOTPRIMARY,
                     "ReplicaJoin for term %" PRIu64 ": this replica is %s of term %" PRIu64 "; %s",
                     term, replica_role_name(r->role), r->term, who);
  } else if (index >= r->n || index == r->index) {
    rc = status_fail(err, errlen, ZS_EINVAL, "ReplicaJoin: member %u is not a peer of member %u",
                     index, r->index);
  } else if (!info.has_job) {
    /* Nothing to copy: it is in sync, and the job's Open will reach it. */
    member *m = &r->m[index];
    m->in_sync = 1;
    m->joining = m->join_pending = 0;
    m->covered = m->join_id = 0;
    snap_release_locked(r);
  } else {
    /* A joiner that came back starts again: the copy it read, if any, is
     * not its copy any more. It called: it is alive now. */
    member *m = &r->m[index];
    m->in_sync = m->joining = 0;
    m->covered = 0;
    m->join_pending = 1;
    m->join_id = ++r->join_seq;
    m->heard_ms = m->progress_ms = clock_now_ms();
    snap_release_locked(r);
    *join_id = m->join_id; /* its ReplicaFetch calls carry it */
  }
  pthread_mutex_unlock(&r->mu);
  if (rc == 0)
    LOG_INFO("replica_join_asked", "member=%u term=%" PRIu64 " copy=%s", index, term,
             *join_id ? "at the next step" : "none");
  return rc;
}

/* The ranks of m below W into out (W entries of room); their count. */
static size_t pack_ranks(const core_members *m, uint32_t W, uint32_t *out) {
  size_t n = 0;
  for (uint32_t r = 0; r < W && r < CORE_ELASTIC_MAX_W; r++)
    if (core_members_has(m, r))
      out[n++] = r;
  return n;
}

static void membership_free(Zshard__V1__ReplicaMembership *pm) {
  if (!pm)
    return;
  free(pm->members);
  free(pm->log_steps);
  free(pm->log_counts);
  free(pm->log_ranks);
  free(pm);
}

/* The copy's membership as META carries it (the plans borrowed from ms);
 * NULL when out of memory. */
static Zshard__V1__ReplicaMembership *membership_pack(const core_member_state *ms, uint32_t W) {
  Zshard__V1__ReplicaMembership *pm = calloc(1, sizeof *pm);
  if (!pm)
    return NULL;
  zshard__v1__replica_membership__init(pm);
  uint32_t w = W < CORE_ELASTIC_MAX_W ? W : CORE_ELASTIC_MAX_W;
  pm->trainer_timeout_ms = ms->trainer_timeout_ms;
  pm->flag_timeout_ms = ms->flag_timeout_ms;
  pm->epoch = ms->epoch;
  pm->leaves = ms->leaves;
  pm->timeouts = ms->timeouts;
  pm->joins = ms->joins;
  pm->members = malloc((size_t)w * sizeof *pm->members + 1);
  pm->log_steps = malloc((size_t)ms->log_n * sizeof *pm->log_steps + 1);
  pm->log_counts = malloc((size_t)ms->log_n * sizeof *pm->log_counts + 1);
  size_t nranks = 0;
  for (uint32_t k = 0; k < ms->log_n; k++)
    nranks += ms->log[k].members.n;
  pm->log_ranks = malloc(nranks * sizeof *pm->log_ranks + 1);
  if (!pm->members || !pm->log_steps || !pm->log_counts || !pm->log_ranks) {
    membership_free(pm);
    return NULL;
  }
  pm->n_members = pack_ranks(&ms->members, w, pm->members);
  for (uint32_t k = 0; k < ms->log_n; k++) {
    pm->log_steps[k] = ms->log[k].from_step;
    pm->log_counts[k] =
        (uint32_t)pack_ranks(&ms->log[k].members, w, pm->log_ranks + pm->n_log_ranks);
    pm->n_log_ranks += pm->log_counts[k];
  }
  pm->n_log_steps = pm->n_log_counts = ms->log_n;
  if (ms->nplan == w && ms->join_at && ms->leave_at) {
    pm->n_join_at = pm->n_leave_at = w;
    pm->join_at = (uint64_t *)(uintptr_t)ms->join_at;
    pm->leave_at = (uint64_t *)(uintptr_t)ms->leave_at;
  }
  return pm;
}

static int fetch_array(const core_state *st, int part, const float **src) {
  *src = part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_MASTER       ? st->master
         : part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG    ? st->m
         : part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_EXP_AVG_SQ ? st->v
                                                                     : NULL;
  return *src ? 0 : ZS_EINVAL;
}

int replica_fetch(replica *r, const Zshard__V1__ReplicaFetchRequest *q,
                  Zshard__V1__ReplicaFetchResponse *resp, char *err, size_t errlen) {
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  const core_state *st = &r->snap;
  member *m = NULL;
  for (uint32_t i = 0; i < r->n && q->join_id; i++)
    if (i != r->index && r->m[i].join_id == q->join_id && (r->m[i].joining || r->m[i].join_pending))
      m = &r->m[i];
  if (m)
    m->heard_ms = clock_now_ms();
  if (r->role != REPLICA_PRIMARY) {
    rc = status_fail(err, errlen, ZS_ENOTPRIMARY, "this replica is no longer the primary");
  } else if (!m) {
    /* Its join ended (dropped, or it asked again): a copy loaded now would
     * miss the writes since, which nobody forwards to it. */
    rc = status_fail(err, errlen, ZS_ECANCELED,
                     "join %" PRIu64 " is not in progress here (dropped): join again", q->join_id);
  } else if (!m->joining || !r->snap_busy || !r->snap_ready) {
    rc = status_fail(err, errlen, ZS_ENOTREADY, "the copy is made at the next applied step");
  } else if (r->snap_status != 0) {
    rc = status_fail(err, errlen, r->snap_status, "the copy of the state failed");
  } else if (q->part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_LOADING) {
    /* No data: the joiner's word that it works on its copy, reading or
     * loading it (a read that waits, a large shard's load, may outlast the
     * failover time); counted as progress below. */
  } else if (q->part == ZSHARD__V1__REPLICA_PART__REPLICA_PART_META) {
    resp->spec = malloc(sizeof *resp->spec);
    if (resp->spec)
      zshard__v1__model_spec__init(resp->spec);
    if (!resp->spec || spec_to_proto(&st->spec, resp->spec) != 0) {
      free(resp->spec);
      resp->spec = NULL;
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
    }
    resp->version = st->version;
    resp->optimizer_steps = st->optimizer_steps;
    resp->n_tensor_steps = st->tensor_steps ? st->spec.num_tensors : 0;
    resp->tensor_steps = st->tensor_steps;
    resp->client_state.data = st->client_state;
    resp->client_state.len = st->client_state_len;
    resp->elements = st->nelems;
    resp->has_exp_avg = st->m != NULL;
    resp->has_exp_avg_sq = st->v != NULL;
    resp->shard_id = st->shard_id;
    if (rc == 0 && st->members &&
        !(resp->membership = membership_pack(st->members, st->spec.world_size)))
      rc = status_fail(err, errlen, ZS_ENOMEM, "out of memory");
  } else {
    const float *src = NULL;
    if (fetch_array(st, q->part, &src) != 0 || q->count > REPLICA_FETCH_ELEMS ||
        q->offset > st->nelems || q->count > st->nelems - q->offset) {
      rc = status_fail(err, errlen, ZS_ERANGE,
                       "ReplicaFetch part %d elements [%" PRIu64 ", +%" PRIu64 ") of %" PRIu64
                       " (at most %u at once)",
                       (int)q->part, q->offset, q->count, st->nelems, REPLICA_FETCH_ELEMS);
    } else {
      resp->data.data = (uint8_t *)(uintptr_t)(src + q->offset);
      resp->data.len = q->count * sizeof(float);
    }
  }
  /* The copy is only replaced by the next join, which waits for its
   * joiners to end (snap_busy), and is freed only with no answer pointing
   * into it (snap_packing): the pointers stay valid while it is packed. */
  if (rc == 0) {
    r->snap_packing++;
    m->progress_ms = clock_now_ms(); /* a part of the copy served, or a load under way */
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

void replica_fetch_release(replica *r, Zshard__V1__ReplicaFetchResponse *resp, int served) {
  if (served) {
    pthread_mutex_lock(&r->mu);
    r->snap_packing--;
    pthread_mutex_unlock(&r->mu);
  }
  if (resp->spec) {
    spec_proto_release(resp->spec);
    free(resp->spec);
    resp->spec = NULL;
  }
  membership_free(resp->membership);
  resp->membership = NULL;
}

/* A member asked to join (or joining) that neither answered GetInfo nor
 * called (heard_ms) for the failover time is dropped: a joiner holds the
 * trainers' writes, and one that is gone would hold them until the join's
 * limit. One whose join
 * failed asks again (which starts its join afresh), or is dropped by the
 * forwards it refuses. */
static void monitor_joiners_locked(replica *r, uint64_t now) {
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    if (i == r->index || !(m->joining || m->join_pending))
      continue;
    uint64_t seen = m->heard_ms > m->last_ok_ms ? m->heard_ms : m->last_ok_ms;
    if (replica__fresh(m) || now - seen <= r->failover_ms)
      continue;
    const char *why = "it stopped answering while it joined";
    if (m->joining) {
      replica__drop_locked(r, i, ZS_ECONN, why);
    } else {
      m->join_pending = 0;
      LOG_WARN("replica_join_dropped", "member=%u addr=%s term=%" PRIu64 " detail=\"%s\"", i,
               m->addr, r->term, why);
    }
  }
}

/* The primary's round: a newer primary deposes it; a backup that fell
 * behind, or came back empty, is dropped (it joins again); so is a joiner
 * that is gone. */
void replica__primary_round_locked(replica *r, const core_info *info) {
  int p = replica__live_primary_locked(r, r->term + 1);
  if (p >= 0) {
    replica__step_down_locked(r, "a peer is primary of a newer term");
    return;
  }
  uint64_t now = clock_now_ms();
  monitor_joiners_locked(r, now);
  for (uint32_t i = 0; i < r->n; i++) {
    member *m = &r->m[i];
    if (i == r->index || !m->in_sync || !replica__fresh(m))
      continue;
    /* A probe may race a forward (the job opened here, its Open on the way):
     * only a state that lasts the failover time counts. */
    const char *why = m->seen_config[0] ? "its --replicas list differs from this member's"
                      : info->has_job && !m->seen_has_job ? "it holds no job"
                      : m->seen_version + 1 < info->version
                          ? "its version is more than one step behind"
                      : (m->seen_role != REPLICA_BACKUP || m->seen_term != r->term) &&
                              !(m->seen_role == REPLICA_STARTING && !info->has_job)
                          ? "it is not a backup of this term"
                          : NULL;
    if (!why) {
      m->behind_since_ms = 0;
    } else if (!m->behind_since_ms) {
      m->behind_since_ms = now;
    } else if (now - m->behind_since_ms > r->failover_ms) {
      replica__drop_locked(r, i, ZS_EBEHIND, why);
    }
  }
}
