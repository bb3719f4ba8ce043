/*
 * dp_client_sync — blocking wrappers over the asynchronous calls: the
 * caller's thread waits on a condition variable for the callback.
 */
#include "common/net/dp_client_internal.h"

#include <pthread.h>
#include <string.h>

#include "common/base/status.h"

typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  dp_result res;
  char msg[DP_ERRLEN];
} waiter;

static void waiter_init(waiter *w) {
  memset(w, 0, sizeof *w);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
}

static void on_sync_done(void *arg, const dp_result *r) {
  waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->res = *r;
  status_say(w->msg, sizeof w->msg, "%s", r->message);
  w->res.message = w->msg;
  w->done = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Waits for the callback of a submitted request (rc 0), or passes the
 * submission error through. */
static int waiter_finish(waiter *w, int rc, char *err, size_t errlen) {
  if (rc == 0) {
    pthread_mutex_lock(&w->mu);
    while (!w->done)
      pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    rc = status_fail(err, errlen, w->res.status, "%s", w->msg);
  } else {
    status_fail(err, errlen, rc, "%s", zs_strerror(rc));
  }
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  return rc;
}

int dp_client_push_sync(dp_client *c, const dp_push_args *a, int *duplicate, char *err,
                        size_t errlen) {
  waiter w;
  waiter_init(&w);
  int rc = waiter_finish(&w, dp_client_push(c, a, on_sync_done, &w), err, errlen);
  if (duplicate)
    *duplicate = rc == 0 && w.res.duplicate;
  return rc;
}

int dp_client_pull_sync(dp_client *c, const dp_pull_args *a, uint64_t *version, char *err,
                        size_t errlen) {
  waiter w;
  waiter_init(&w);
  int rc = waiter_finish(&w, dp_client_pull(c, a, on_sync_done, &w), err, errlen);
  if (version)
    *version = rc == 0 ? w.res.version : 0;
  return rc;
}

int dp_client_ping_sync(dp_client *c, uint32_t timeout_ms, char *err, size_t errlen) {
  waiter w;
  waiter_init(&w);
  return waiter_finish(&w, dp_client_ping(c, timeout_ms, on_sync_done, &w), err, errlen);
}
