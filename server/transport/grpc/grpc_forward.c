/*
 * grpc_forward — the forwarding pool of a replicated primary's gRPC
 * transport. A trainer's write that succeeded here goes to the backups
 * (replica_forward_raw) before the trainer hears of it; the forward waits for
 * every backup to answer or be dropped, up to the failover time and more.
 * Done on a polling thread it held that thread, and with every polling thread
 * holding a forward nobody served a joiner's ReplicaJoin and ReplicaFetch,
 * which the forwards themselves waited for (issue 23: the joiner dropped for
 * making no progress, again and again). So gsrv__finish hands the forward and
 * the call's answer to this pool, and a pool thread forwards and answers.
 *
 * Threads: gsrv.fwd.threads (twice the polling threads, at least
 * GSRV_FWD_MIN_THREADS), started by gsrv_start only when the server is
 * replicated, stopped by gsrv_destroy before it answers the calls still open.
 * A pool thread takes a call off the queue, forwards it and answers it
 * (claimed: gsrv__send_final, else gsrv__answer, as gsrv__finish would have);
 * starting the final batch from a thread that does not poll is what the
 * shutdown sweep does too.
 *
 * Order: a call's forward precedes its answer, which is all the trainers
 * need: a trainer sends what depends on a write (the Apply after its Pushes,
 * the Pushes after Open) only once that write was answered, so forwards of
 * writes that depend on each other never run at once. Writes in flight at
 * once were forwarded in any order before too (several polling threads).
 *
 * Lock order: gsrv.fwd.lock is a leaf, never held while forwarding or
 * answering and never taken with gsrv.lock held.
 *
 * References: a queued call holds one reference (gcall_ref in submit), which
 * the thread that answers it drops.
 */
#include "server/transport/grpc/grpc_internal.h"

#include <grpc/byte_buffer.h>
#include <stdlib.h>

#include "common/base/log.h"
#include "common/base/status.h"

#define GSRV_FWD_MIN_THREADS 4

/* A Push's forward is pending from before it is queued until it ended
 * (replica_push_pending): an Apply forwarded meanwhile waits for it rather
 * than dropping a backup that misses it. Other writes: nothing. */
static void push_pending(gcall *c, int up) {
  if (c->method == M_PUSH)
    replica_push_pending(c->s->rep, up);
}

/* Answers a call that will not be forwarded (the pool stopped): ECLOSED. */
static void answer_closed(gcall *c, int claimed, grpc_byte_buffer *reply) {
  push_pending(c, 0);
  if (reply)
    grpc_byte_buffer_destroy(reply);
  free(c->fwd);
  c->fwd = NULL;
  gsrv__answer_as(c, claimed, NULL, ZS_ECLOSED, "the server is shutting down");
}

/* Forwards the call's write to the backups, then answers it: the reply it
 * was given, or the forward's error. */
static void forward_and_answer(gcall *c) {
  char ferr[GSRV_ERRLEN] = "";
  grpc_byte_buffer *reply = c->fwd_reply;
  c->fwd_reply = NULL;
  replica_write kind = c->method == M_PUSH      ? REPLICA_FWD_PUSH
                       : c->method == M_APPLY   ? REPLICA_FWD_APPLY
                       : c->method == M_RESTORE ? REPLICA_FWD_RESTORE
                                                : REPLICA_FWD_WRITE;
  if (kind == REPLICA_FWD_PUSH)
    replica_test_stall("ZSHARD_TEST_PUSH_FWD_STALL_MS");
  int rc = replica_forward_raw(c->s->rep, gsrv__methods[c->method].path, kind, c->fwd_step, c->fwd,
                               c->fwd_len, ferr, sizeof ferr);
  push_pending(c, 0);
  free(c->fwd);
  c->fwd = NULL;
  if (rc && reply) {
    grpc_byte_buffer_destroy(reply);
    reply = NULL;
  }
  gsrv__answer_as(c, c->fwd_claimed, reply, rc, rc ? ferr : NULL);
}

static void *fwd_main(void *arg) {
  gsrv *s = arg;
  gfwd *p = &s->fwd;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (list_empty(&p->queue) && !p->stopping)
      pthread_cond_wait(&p->cond, &p->lock);
    /* Queued calls not started are answered by gsrv__fwd_stop. */
    if (p->stopping)
      break;
    gcall *c = container_of(list_pop(&p->queue), gcall, fwd_node);
    pthread_mutex_unlock(&p->lock);
    forward_and_answer(c);
    gcall_unref(c);
    pthread_mutex_lock(&p->lock);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int gsrv__fwd_start(gsrv *s, char *err, size_t errlen) {
  gfwd *p = &s->fwd;
  list_init(&p->queue);
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cond, NULL);
  p->inited = 1;
  int want = 2 * s->nthreads < GSRV_FWD_MIN_THREADS ? GSRV_FWD_MIN_THREADS : 2 * s->nthreads;
  p->threads = calloc((size_t)want, sizeof *p->threads);
  if (!p->threads)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  for (int i = 0; i < want; i++) {
    if (pthread_create(&p->threads[i], NULL, fwd_main, s) != 0)
      break;
    p->nthreads++;
  }
  if (p->nthreads == 0)
    return status_fail(err, errlen, ZS_EINTERNAL, "%s", "cannot start the forwarding threads");
  if (p->nthreads < want)
    LOG_WARN("grpc_forward_threads", "started=%d wanted=%d", p->nthreads, want);
  return 0;
}

void gsrv__fwd_submit(gcall *c, int claimed, grpc_byte_buffer *reply) {
  gfwd *p = &c->s->fwd;
  int queued = 0;
  push_pending(c, 1);
  if (p->inited) {
    pthread_mutex_lock(&p->lock);
    if (!p->stopping && p->nthreads > 0) {
      c->fwd_claimed = claimed;
      c->fwd_reply = reply;
      gcall_ref(c);
      list_push(&p->queue, &c->fwd_node);
      pthread_cond_signal(&p->cond);
      queued = 1;
    }
    pthread_mutex_unlock(&p->lock);
  }
  if (!queued)
    answer_closed(c, claimed, reply);
}

void gsrv__fwd_stop(gsrv *s) {
  gfwd *p = &s->fwd;
  if (!p->inited)
    return;
  list_node queued, *n;
  list_init(&queued);
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  while ((n = list_pop(&p->queue)) != NULL)
    list_push(&queued, n);
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
  while ((n = list_pop(&queued)) != NULL) {
    gcall *c = container_of(n, gcall, fwd_node);
    grpc_byte_buffer *reply = c->fwd_reply;
    c->fwd_reply = NULL;
    answer_closed(c, c->fwd_claimed, reply);
    gcall_unref(c);
  }
  /* Forwards in flight got the grace (gsrv_destroy); now they make no
   * further attempt and answer ZS_ECLOSED, each within its attempt in
   * flight: without this a backup that kept refusing, or a wait the forward
   * rules extend, held the shutdown the whole bound and more. */
  replica_stop_forwards(s->rep);
  for (int i = 0; i < p->nthreads; i++)
    pthread_join(p->threads[i], NULL);
  p->nthreads = 0;
}

void gsrv__fwd_free(gsrv *s) {
  gfwd *p = &s->fwd;
  if (!p->inited)
    return;
  gsrv__fwd_stop(s);
  free(p->threads);
  p->threads = NULL;
  pthread_cond_destroy(&p->cond);
  pthread_mutex_destroy(&p->lock);
  p->inited = 0;
}
