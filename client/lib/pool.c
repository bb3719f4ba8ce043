/*
 * pool — the client's worker threads and their task queues.
 *
 * A task is one call to one shard (one piece of a push or a pull, or one
 * control call). There is one FIFO per shard and workers serve the shards
 * round robin, so a burst of work for one shard does not starve the others:
 * every shard's link stays busy, which is what makes a split tensor's
 * transfer use all of them at once.
 *
 * Coalescing: when a worker takes a small piece (below the bucket size) it
 * also takes the small pieces of the same direction queued right behind it
 * for the same shard, up to the bucket size in bytes, and runs them as one
 * list: over the data plane they travel as one batch request
 * (dataplane.c); over gRPC they are issued back to back, one call each.
 *
 * The rotated schedule (zc_pool_set_schedule; issue 25). Over the data
 * plane a worker only submits a piece and moves on, so by default every
 * piece of a burst is on the wire at once: each trainer sends to every shard
 * at the same moment, and each shard link carries W flows in each
 * direction. TCP in that pattern keeps 0.65 of the link where one flow per
 * link and direction keeps 0.93 (docs/PERFORMANCE.md, netsim). Under the
 * rotated schedule pushes and pulls wait in classes of their own and are
 * admitted in round-robin order over the shards, starting at the trainer's
 * rank, with at most `window` of each direction in flight: trainer r sends
 * its k-th piece for shard r, then for r + 1, ..., as in MPI's pairwise
 * all-to-all, so that at any moment the W trainers send to W different
 * shards. A window of 2 keeps the next piece written while the last one's
 * answer comes back. The order changes when bytes travel, never what is
 * summed: the shards reduce in rank order whatever the arrival order.
 * Prefetches and control calls are not held back (a prefetch waits on the
 * shard for a version, which may need pushes queued behind it).
 *
 * Order (zc_pool_order_pushes; issue 25). A data-plane run only hands its
 * pieces to the shard's connection, but between taking a piece and handing
 * it on a worker may be preempted (the pool has 2N + 2 workers, often on
 * fewer cores), and the pieces queued behind it then reach the connection
 * first. A pipelined step applies a piece once every trainer's copy is in,
 * so one trainer's late piece holds that piece for all of them: traces of
 * emulated 0.25 Gbit/s runs showed a quarter of a shard's pieces completing
 * only at the end of the push phase that way. So a shard's first-attempt
 * pushes run one list at a time (busy[shard]), in queue order; the shards
 * still run in parallel, and a list's conversion still runs on its worker.
 *
 * Threads: the workers are created by zc_pool_start and joined by
 * zc_pool_stop; everything in zc_pool marked (mu) is guarded by pool.mu,
 * which is never held while a task runs. zc_pool_release runs on any thread
 * (a data client's loop thread, mostly).
 *
 * Wake-ups: a submission wakes one idle worker, whatever the number of
 * tasks, and a worker that takes a task while more are queued wakes the
 * next one. Waking every worker at once (a broadcast) made each submission
 * cost the caller a context switch: on a machine with fewer cores than
 * workers the woken threads preempt the submitting one, which in the Python
 * package measured 75 us per call (median) instead of 15 us. The chain
 * moves those wake-ups onto the workers. For the same reason the workers
 * run under SCHED_BATCH on Linux, which takes away a woken thread's right to
 * preempt the running one: the trainer's thread keeps its core through a
 * submission (median per tensor from the Python package under load, 21-33
 * us before, 6-8 us after; docs/PERFORMANCE.md, PyTorch).
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int task_is_push(const zc_task *t) {
  return t->op->kind == ZC_OP_PUSH;
}

static int task_is_pull(const zc_task *t) {
  return t->op->kind == ZC_OP_PULL || t->op->kind == ZC_OP_PREFETCH;
}

/* The bucket that applies to t, 0 when t is never coalesced. */
static size_t bucket_of(const zc_pool *p, const zc_task *t) {
  if (task_is_push(t))
    return p->push_bucket;
  if (task_is_pull(t))
    return p->pull_bucket;
  return 0;
}

/* The class a task waits in when it is queued. */
static int class_of(const zc_pool *p, const zc_task *t) {
  if (!p->window || t->sched)
    return ZC_Q_ANY; /* FIFO, or a task back for its next phase */
  if (t->op->kind == ZC_OP_PUSH)
    return ZC_Q_PUSH;
  if (t->op->kind == ZC_OP_PULL)
    return ZC_Q_PULL;
  return ZC_Q_ANY;
}

/* 1 when t is a push whose run must wait for the run of its shard's last
 * one (zc_pool_order_pushes): a retry backs off in its run, so it is not
 * held to the order, nor does it hold others. */
static int ordered_push(const zc_pool *p, const zc_task *t) {
  return p->ordered && task_is_push(t) && t->dp_phase == ZC_DP_SEND;
}

/* The first queue of class k at or after its cursor with a task that may be
 * taken now, or -1; none for a class whose window is full. */
static int next_queue_locked(const zc_pool *p, int k) {
  if (k != ZC_Q_ANY && p->admitted[k] >= p->window)
    return -1;
  for (uint32_t i = 0; i < p->nqueues; i++) {
    uint32_t q = (p->cursor[k] + i) % p->nqueues;
    const zc_task *t = p->head[k * p->nqueues + q];
    if (t && !(p->busy && p->busy[q] && ordered_push(p, t)))
      return (int)q;
  }
  return -1;
}

/* 1 when a worker could take a task now. */
static int runnable_locked(const zc_pool *p) {
  if (p->queued == 0 || p->held)
    return 0;
  for (int k = 0; k < ZC_Q_CLASSES; k++)
    if (next_queue_locked(p, k) >= 0)
      return 1;
  return 0;
}

static zc_task *pop_locked(zc_pool *p, uint32_t q) {
  zc_task *t = p->head[q];
  p->head[q] = t->next;
  if (!p->head[q])
    p->tail[q] = NULL;
  t->next = NULL;
  p->queued--;
  return t;
}

/* Takes the next task, and the small ones that coalesce with it, as a list
 * linked through next; each task of a rotated class takes a place in its
 * window. *ordered_q is the shard whose pushes wait for this run to return
 * (zc_pool_order_pushes), or -1. Called with mu held and
 * runnable_locked(p). */
static zc_task *take_locked(zc_pool *p, int *ordered_q) {
  int k = ZC_Q_ANY, found = -1;
  for (; k < ZC_Q_CLASSES && found < 0; k++)
    found = next_queue_locked(p, k);
  k--;
  uint32_t q = (uint32_t)found + (uint32_t)k * p->nqueues;
  p->cursor[k] = ((uint32_t)found + 1) % p->nqueues;
  zc_task *first = pop_locked(p, q), *last = first;
  *ordered_q = -1;
  if (p->busy && ordered_push(p, first)) {
    p->busy[found] = 1;
    *ordered_q = found;
  }
  size_t bucket = bucket_of(p, first);
  if (bucket != 0 && first->bytes < bucket) {
    size_t total = first->bytes;
    while (p->head[q] && bucket_of(p, p->head[q]) == bucket &&
           task_is_push(p->head[q]) == task_is_push(first) && total + p->head[q]->bytes <= bucket) {
      total += p->head[q]->bytes;
      last->next = pop_locked(p, q);
      last = last->next;
    }
  }
  if (k != ZC_Q_ANY) {
    for (zc_task *t = first; t; t = t->next) {
      t->sched = k;
      p->admitted[k]++;
    }
  }
  return first;
}

static void *worker_main(void *arg) {
  zc_pool *p = arg;
#ifdef SCHED_BATCH
  /* Linux: a woken worker does not preempt the thread that woke it (the
   * trainer's, computing); it runs on an idle core, or when the scheduler
   * next picks it. Best effort: without it the pool works as well. */
  struct sched_param sp = {0};
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
#endif
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && !runnable_locked(p)) {
      p->idle++;
      pthread_cond_wait(&p->cv, &p->mu);
      p->idle--;
    }
    if (p->stop)
      break; /* zc_pool_stop cancels what is left */
    int ordered_q;
    zc_task *list = take_locked(p, &ordered_q);
    int more = runnable_locked(p) && p->idle > 0;
    pthread_mutex_unlock(&p->mu);
    if (more)
      pthread_cond_signal(&p->cv); /* the next link of the chain */
    /* The whole list at once, so that its pieces can travel as one batch. */
    p->run(p->ctx, list);
    pthread_mutex_lock(&p->mu);
    if (ordered_q >= 0) {
      /* The shard's next push may go: this worker takes it below unless
       * another idle one is woken first. */
      p->busy[ordered_q] = 0;
      if (p->idle > 0 && runnable_locked(p))
        pthread_cond_signal(&p->cv);
    }
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int zc_pool_start(zc_pool *p, uint32_t nqueues, uint32_t nthreads, size_t push_bucket,
                  size_t pull_bucket, zc_task_run_fn run, zc_task_cancel_fn cancel, void *ctx) {
  memset(p, 0, sizeof *p);
  if (nqueues == 0 || nthreads == 0)
    return ZS_EINVAL;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->nqueues = nqueues;
  p->push_bucket = push_bucket;
  p->pull_bucket = pull_bucket;
  p->run = run;
  p->cancel = cancel;
  p->ctx = ctx;
  p->head = calloc((size_t)nqueues * ZC_Q_CLASSES, sizeof *p->head);
  p->tail = calloc((size_t)nqueues * ZC_Q_CLASSES, sizeof *p->tail);
  p->threads = calloc(nthreads, sizeof *p->threads);
  p->busy = calloc(nqueues, sizeof *p->busy);
  if (!p->head || !p->tail || !p->threads || !p->busy)
    return ZS_ENOMEM;
  for (uint32_t i = 0; i < nthreads; i++) {
    if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0)
      return ZS_EINTERNAL;
    p->nthreads++;
  }
  return ZS_OK;
}

void zc_pool_order_pushes(zc_pool *p, int on) {
  pthread_mutex_lock(&p->mu);
  p->ordered = on && p->busy != NULL;
  pthread_mutex_unlock(&p->mu);
}

void zc_pool_hold(zc_pool *p, int hold) {
  pthread_mutex_lock(&p->mu);
  p->held = hold;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

int zc_pool_held(zc_pool *p) {
  pthread_mutex_lock(&p->mu);
  int held = p->held;
  pthread_mutex_unlock(&p->mu);
  return held;
}

/* Queues the tasks under p->mu; returns 0 when the pool is stopping (the
 * tasks are then neither queued nor cancelled). */
static int queue_locked(zc_pool *p, zc_task *tasks, uint32_t n) {
  if (p->stop)
    return 0;
  for (uint32_t i = 0; i < n; i++) {
    zc_task *t = &tasks[i];
    uint32_t q = (uint32_t)class_of(p, t) * p->nqueues + t->shard % p->nqueues;
    t->next = NULL;
    if (p->tail[q])
      p->tail[q]->next = t;
    else
      p->head[q] = t;
    p->tail[q] = t;
    p->queued++;
  }
  return 1;
}

void zc_pool_submit(zc_pool *p, zc_task *tasks, uint32_t n) {
  pthread_mutex_lock(&p->mu);
  if (!queue_locked(p, tasks, n)) {
    pthread_mutex_unlock(&p->mu);
    /* The pool is stopping: the tasks will never run. */
    for (uint32_t i = 0; i < n; i++)
      p->cancel(p->ctx, &tasks[i]);
    return;
  }
  /* One worker, whatever n: it wakes the next (see the top of the file). */
  int wake = n > 0 && p->idle > 0;
  pthread_mutex_unlock(&p->mu);
  if (wake)
    pthread_cond_signal(&p->cv);
}

void zc_pool_enqueue_spans(zc_pool *p, const zc_task_span *spans, uint32_t n, int wake) {
  pthread_mutex_lock(&p->mu);
  int queued = !p->stop;
  for (uint32_t i = 0; queued && i < n; i++)
    queued = queue_locked(p, spans[i].tasks, spans[i].n);
  wake = queued && wake && p->queued > 0 && p->idle > 0;
  pthread_mutex_unlock(&p->mu);
  if (!queued) {
    for (uint32_t i = 0; i < n; i++)
      for (uint32_t k = 0; k < spans[i].n; k++)
        p->cancel(p->ctx, &spans[i].tasks[k]);
    return;
  }
  if (wake)
    pthread_cond_signal(&p->cv);
}

void zc_pool_set_schedule(zc_pool *p, uint32_t start, uint32_t window) {
  pthread_mutex_lock(&p->mu);
  p->window = window;
  p->cursor[ZC_Q_PUSH] = p->cursor[ZC_Q_PULL] = p->nqueues ? start % p->nqueues : 0;
  pthread_mutex_unlock(&p->mu);
}

void zc_pool_release(zc_pool *p, zc_task *t) {
  /* Read without the lock: only the worker that admitted the task set it,
   * before the task ran, and nothing else writes it until here. */
  if (!t->sched)
    return;
  pthread_mutex_lock(&p->mu);
  p->admitted[t->sched]--;
  t->sched = 0;
  int wake = p->idle > 0 && runnable_locked(p);
  pthread_mutex_unlock(&p->mu);
  if (wake)
    pthread_cond_signal(&p->cv);
}

/* Frees everything the pool holds but the struct. */
static void pool_free_all(zc_pool *p) {
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  free(p->head);
  free(p->tail);
  free(p->threads);
  free(p->busy);
  memset(p, 0, sizeof *p);
}

void zc_pool_free(zc_pool *p) {
  if (p->stopped)
    pool_free_all(p);
}

void zc_pool_stop(zc_pool *p) {
  if (p->stopped)
    return;
  if (!p->head) {
    free(p->tail);
    free(p->threads);
    free(p->busy);
    memset(p, 0, sizeof *p);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  /* Unhook everything still queued, then cancel it outside the lock: cancel
   * finishes ops, which may run user callbacks. */
  zc_task *cancelled = NULL;
  for (uint32_t q = 0; q < p->nqueues * ZC_Q_CLASSES; q++) {
    while (p->head[q]) {
      zc_task *t = pop_locked(p, q);
      t->next = cancelled;
      cancelled = t;
    }
  }
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  while (cancelled) {
    zc_task *next = cancelled->next;
    cancelled->next = NULL;
    p->cancel(p->ctx, cancelled);
    cancelled = next;
  }
  for (uint32_t i = 0; i < p->nthreads; i++)
    pthread_join(p->threads[i], NULL);
  /* Tasks the rotated schedule admitted may still be on the data plane,
   * whose loop threads release them: the lock stays until zc_pool_free. */
  pthread_mutex_lock(&p->mu);
  int held = p->admitted[ZC_Q_PUSH] + p->admitted[ZC_Q_PULL] > 0;
  pthread_mutex_unlock(&p->mu);
  if (!held) {
    pool_free_all(p);
    return;
  }
  p->nthreads = 0;
  p->stopped = 1;
}
