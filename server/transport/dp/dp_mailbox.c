/*
 * dp_mailbox — the one door from core threads into the loop: a Pull whose
 * wait for its version ended is left in the mailbox by the core's callback
 * (on_core_version, any thread, under mailbox.mu), and the loop thread takes
 * the records out (dp__drain_mailbox) and answers or queues them. Pull
 * records are freed here too. Lock order and lifetimes: dp_server.c.
 */
#include "server/transport/dp/dp_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <uv.h>

#include "common/net/wire.h"
#include "server/service/service.h"

void dp__mailbox_unref(dp_mailbox *mb, uint64_t n) {
  pthread_mutex_lock(&mb->mu);
  mb->refs -= n;
  int last = mb->refs == 0;
  pthread_mutex_unlock(&mb->mu);
  if (last) {
    pthread_mutex_destroy(&mb->mu);
    free(mb);
  }
}

void dp__pull_free(dp_pull *p) {
  if (!p)
    return;
  free(p->pieces);
  free(p);
}

/* Core thread: the wait of a Pull ended. */
void dp__on_core_version(void *arg, int status, uint64_t version) {
  dp_pull *p = arg;
  dp_mailbox *mb = p->mb;
  int orphan = 0;
  pthread_mutex_lock(&mb->mu);
  p->status = status;
  p->version = version;
  if (mb->closed) {
    orphan = 1;
  } else {
    p->next = mb->done;
    mb->done = p;
    uv_async_send(mb->async);
  }
  pthread_mutex_unlock(&mb->mu);
  if (orphan) {
    /* The server is gone; its connections with it. */
    dp__pull_free(p);
    dp__mailbox_unref(mb, 1);
  }
}

/* Loop thread: handles the Pulls whose wait ended. */
void dp__drain_mailbox(dp_server *s) {
  dp_mailbox *mb = s->mb;
  pthread_mutex_lock(&mb->mu);
  dp_pull *list = mb->done;
  mb->done = NULL;
  pthread_mutex_unlock(&mb->mu);
  /* Oldest first, as the core fired them. */
  dp_pull *rev = NULL;
  uint64_t n = 0;
  while (list) {
    dp_pull *next = list->next;
    list->next = rev;
    rev = list;
    list = next;
    n++;
  }
  while (rev) {
    dp_pull *p = rev;
    rev = p->next;
    dp_conn *c = p->conn;
    c->waiting--;
    c->pe->waiting--;
    s->nwaiting--;
    dp__count(&s->st_waiting, -1);
    if (c->closing) {
      c->pending--;
    } else if (p->status != 0) {
      char err[DP_ERRLEN];
      service_pull_wait_failed(p->status, p->min_version, p->tensor, p->slice, err, sizeof err);
      dp__observe(s, p->pieces ? WIRE_PULL_BATCH : WIRE_PULL, p->start_ns, 1);
      dp__answer_error(c, p->request_id, p->status, err);
    } else {
      dp__pull_ready(c, p);
      dp__conn_check(c);
      continue;
    }
    dp__conn_check(c);
    dp__conn_unref(c);
    dp__pull_free(p);
  }
  if (n)
    dp__mailbox_unref(mb, n);
}
