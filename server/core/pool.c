/*
 * pool — fixed thread pool with a blocking parallel-for.
 *
 * Threads and locks:
 *  - run_mu serialises whole pool_run calls, so that one job's fields are never
 *    overwritten while another job is running. It is taken before mu.
 *  - mu guards the job description (fn, arg, nchunks), the generation counter,
 *    `active`, `busy` and `stop`. Chunk indices themselves are handed out with
 *    an atomic counter so that taking a chunk costs no lock.
 *  - The pool's threads only ever run chunks of the job they joined under mu;
 *    the caller of pool_run owns the job from publishing it until every thread
 *    that joined it has left (busy == 0), after which it is closed (active = 0)
 *    and a thread that wakes late cannot join it any more.
 */
#include "server/core/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "zshard/types.h"

struct pool {
  pthread_mutex_t run_mu;
  pthread_mutex_t mu;
  pthread_cond_t work_cv; /* a new job was published, or stop */
  pthread_cond_t done_cv; /* busy dropped to zero */

  /* The current job, guarded by mu. */
  pool_fn fn;
  void *arg;
  size_t nchunks;
  uint64_t generation; /* incremented for every published job */
  int active;          /* 1 while the current job may still be joined */
  int busy;            /* pool threads working on the current job */
  int stop;

  atomic_size_t next; /* the next chunk index to hand out */

  int threads;     /* workers on a run, the caller included */
  int started;     /* pool threads actually started */
  pthread_t *tids; /* owned, threads - 1 entries */
  int sync_inited; /* mutexes and conditions initialised */
};

/* Takes chunks of the current job until none is left. Called by the pool's
 * threads and by the caller of pool_run without holding any lock. */
static void pool_drain(pool *p, pool_fn fn, void *arg, size_t nchunks) {
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (i >= nchunks)
      return;
    fn(arg, i);
  }
}

static void *pool_thread(void *varg) {
  pool *p = varg;
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->generation == seen)
      pthread_cond_wait(&p->work_cv, &p->mu);
    if (p->stop)
      break;
    seen = p->generation;
    /* A thread that wakes after the caller closed the job must not touch it:
     * the caller may already be publishing the next one. */
    if (!p->active)
      continue;
    pool_fn fn = p->fn;
    void *arg = p->arg;
    size_t nchunks = p->nchunks;
    p->busy++;
    pthread_mutex_unlock(&p->mu);
    pool_drain(p, fn, arg, nchunks);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0)
      pthread_cond_signal(&p->done_cv);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int pool_create(int threads, pool **out) {
  if (threads < 1)
    threads = 1;
  pool *p = calloc(1, sizeof *p);
  if (!p)
    return ZS_ENOMEM;
  p->threads = threads;
  atomic_init(&p->next, 0);
  if (pthread_mutex_init(&p->run_mu, NULL) != 0)
    goto fail_free;
  if (pthread_mutex_init(&p->mu, NULL) != 0)
    goto fail_run_mu;
  if (pthread_cond_init(&p->work_cv, NULL) != 0)
    goto fail_mu;
  if (pthread_cond_init(&p->done_cv, NULL) != 0)
    goto fail_work_cv;
  p->sync_inited = 1;
  if (threads > 1) {
    p->tids = calloc((size_t)threads - 1, sizeof *p->tids);
    if (!p->tids)
      goto fail;
    for (int i = 0; i < threads - 1; i++) {
      if (pthread_create(&p->tids[i], NULL, pool_thread, p) != 0)
        goto fail;
      p->started++;
    }
  }
  *out = p;
  return 0;

fail:
  /* pool_destroy stops and joins the threads started so far. */
  pool_destroy(p);
  return ZS_ENOMEM;
fail_work_cv:
  pthread_cond_destroy(&p->work_cv);
fail_mu:
  pthread_mutex_destroy(&p->mu);
fail_run_mu:
  pthread_mutex_destroy(&p->run_mu);
fail_free:
  free(p);
  return ZS_ENOMEM;
}

void pool_destroy(pool *p) {
  if (!p)
    return;
  if (p->sync_inited) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++)
      pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->work_cv);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
  }
  free(p->tids);
  free(p);
}

void pool_run(pool *p, size_t nchunks, pool_fn fn, void *arg) {
  if (nchunks == 0)
    return;
  /* One chunk, or no thread to share with: waking threads would only add
   * latency. */
  if (nchunks == 1 || p->started == 0) {
    for (size_t i = 0; i < nchunks; i++)
      fn(arg, i);
    return;
  }
  pthread_mutex_lock(&p->run_mu);
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  p->nchunks = nchunks;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  p->generation++;
  p->active = 1;
  pthread_cond_broadcast(&p->work_cv);
  pthread_mutex_unlock(&p->mu);

  pool_drain(p, fn, arg, nchunks);

  /* Every chunk has been taken; the ones still running belong to threads that
   * joined the job and are counted in busy. */
  pthread_mutex_lock(&p->mu);
  while (p->busy > 0)
    pthread_cond_wait(&p->done_cv, &p->mu);
  p->active = 0;
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->run_mu);
}

int pool_threads(const pool *p) {
  return p->started + 1;
}
