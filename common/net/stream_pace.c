/*
 * stream_pace — link pacing (stream.h, "Link pacing"): one host link shared
 * between the streams that send on it, each paced at link / n with n the
 * number sending now.
 *
 * Why: a fixed per-socket cap of link / 4 keeps four flows per link from
 * filling the bottleneck's queue, but once fewer than four are left (the end
 * of a step) each is still capped and the link idles. Following n keeps the
 * sum at the link's rate throughout.
 *
 * Threads and locks: a stream's pacer, pace_bulk and its requests' `paced`
 * are its loop thread's. The pacer's mutex guards its list of sending
 * streams, every member's pace_node, pace_fd and pace_rate, and the
 * counters; it is the innermost lock (nothing is called under it but
 * setsockopt and ioctl). A thread that changes n sets the rates of members
 * that other loops own: only their descriptors are touched, under the
 * mutex, and a member leaves (under the mutex) before stream_close closes
 * its socket.
 *
 * Copies: none; this only counts bytes.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include "common/base/list.h"
#include "common/base/status.h"
#include "common/net/stream.h"
#include "common/net/stream_impl.h"

#if defined(__linux__)
#include <linux/sockios.h>
#endif

/* glibc's <sys/socket.h> has carried it since 2.19; Linux's number. */
#if defined(__linux__) && !defined(SO_MAX_PACING_RATE)
#define SO_MAX_PACING_RATE 47
#endif

struct stream_pacer {
  pthread_mutex_t mu;
  uint64_t link_rate; /* bytes per second */
  size_t min_write;
  uint32_t notsent_lowat;
  list_node sending; /* streams with pace_bulk > 0 */
  stream_pacer_stats st;
};

int stream_pacer_new(uint32_t link_mbit, size_t min_write, uint32_t notsent_lowat,
                     stream_pacer **out) {
  if (!out || link_mbit == 0 || link_mbit > STREAM_PACING_MBIT_MAX)
    return ZS_EINVAL;
  *out = NULL;
  stream_pacer *p = calloc(1, sizeof *p);
  if (!p)
    return ZS_ENOMEM;
  if (pthread_mutex_init(&p->mu, NULL) != 0) {
    free(p);
    return ZS_ENOMEM;
  }
  p->link_rate = (uint64_t)link_mbit * 125000u;
  p->min_write = min_write;
  p->notsent_lowat = notsent_lowat;
  list_init(&p->sending);
  *out = p;
  return ZS_OK;
}

void stream_pacer_free(stream_pacer *p) {
  if (!p)
    return;
  pthread_mutex_destroy(&p->mu);
  free(p);
}

void stream_pacer_get_stats(stream_pacer *p, stream_pacer_stats *out) {
  pthread_mutex_lock(&p->mu);
  *out = p->st;
  pthread_mutex_unlock(&p->mu);
}

int stream_pacer_join(stream *s, stream_pacer *p) {
  if (!s || !p || s->pacer)
    return ZS_EINVAL;
  if (s->closing)
    return ZS_ECLOSED;
  int fd = s->ops->fd(s);
  if (fd < 0)
    return fd;
#ifdef TCP_NOTSENT_LOWAT
  if (p->notsent_lowat) {
    int v = (int)p->notsent_lowat;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &v, sizeof v) != 0) {
      s->detail = "the kernel refused TCP_NOTSENT_LOWAT";
      return ZS_EIO;
    }
  }
#endif
  pthread_mutex_lock(&p->mu);
  s->pacer = p;
  s->pace_fd = fd;
  s->pace_rate = 0;
  s->pace_node.prev = s->pace_node.next = NULL;
  p->st.members++;
  pthread_mutex_unlock(&p->mu);
  return ZS_OK;
}

/* Under p->mu: each sending member's cap to link / n, where it differs. */
static void repace(stream_pacer *p) {
  if (p->st.sending == 0)
    return;
  uint64_t rate = p->link_rate / p->st.sending;
  for (list_node *l = p->sending.next; l != &p->sending; l = l->next) {
    stream *m = container_of(l, stream, pace_node);
    if (m->pace_rate == rate)
      continue;
#ifdef SO_MAX_PACING_RATE
    /* Up to 34 Gbit/s the 32-bit form every kernel takes; above, the 64-bit
     * one (Linux 5.0 on), as stream_set_pacing. */
    uint32_t rate32 = (uint32_t)rate;
    int rc = rate < UINT32_MAX
                 ? setsockopt(m->pace_fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate32, sizeof rate32)
                 : setsockopt(m->pace_fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof rate);
    p->st.rate_sets++;
    if (rc != 0) {
      p->st.rate_fails++;
      continue; /* unpaced, still correct; tried again at the next change */
    }
#endif
    m->pace_rate = rate;
  }
}

/* Under p->mu: bytes the kernel holds for s and has not sent yet. */
static uint64_t unsent_in_kernel(const stream *s) {
#ifdef SIOCOUTQNSD
  int v = 0;
  if (ioctl(s->pace_fd, SIOCOUTQNSD, &v) == 0 && v > 0)
    return (uint64_t)v;
#else
  (void)s;
#endif
  return 0;
}

void stream__pace_write_start(stream *s, stream_write_req *req, size_t nbytes) {
  stream_pacer *p = s->pacer;
  if (!p || nbytes < p->min_write)
    return;
  req->paced = 1;
  if (s->pace_bulk++ > 0)
    return;
  pthread_mutex_lock(&p->mu);
  list_push(&p->sending, &s->pace_node);
  p->st.sending++;
  p->st.starts++;
  repace(p);
  pthread_mutex_unlock(&p->mu);
}

/* Under p->mu: s stops sending, if it was (count_unsent: record what the
 * kernel still holds for it). */
static void stop_locked(stream_pacer *p, stream *s, int count_unsent) {
  if (!s->pace_node.next)
    return;
  list_remove(&s->pace_node);
  p->st.sending--;
  p->st.stops++;
  if (count_unsent) {
    uint64_t u = unsent_in_kernel(s);
    p->st.stop_unsent += u;
    if (u > p->st.stop_unsent_max)
      p->st.stop_unsent_max = u;
  }
  /* Its own cap stays as it was: what it still holds in the kernel (at
   * most notsent_lowat) leaves at the rate it was given, and the others
   * take the freed share. */
  repace(p);
}

/* A paced write of req's stream is done (count_unsent) or undone: at the
 * last one the stream stops sending. */
static void write_end(stream_write_req *req, int count_unsent) {
  stream *s = req->s;
  if (!req->paced)
    return;
  req->paced = 0;
  if (--s->pace_bulk == 0 && s->pacer) {
    pthread_mutex_lock(&s->pacer->mu);
    stop_locked(s->pacer, s, count_unsent);
    pthread_mutex_unlock(&s->pacer->mu);
  }
}

void stream__pace_write_undo(stream_write_req *req) {
  write_end(req, 0);
}

void stream__pace_write_done(stream_write_req *req) {
  write_end(req, 1);
}

void stream__pace_leave(stream *s) {
  stream_pacer *p = s->pacer;
  if (!p)
    return;
  pthread_mutex_lock(&p->mu);
  stop_locked(p, s, 0);
  p->st.members--;
  pthread_mutex_unlock(&p->mu);
  /* Writes still queued complete (cancelled) later and count down
   * pace_bulk; with no pacer they touch nothing else. */
  s->pacer = NULL;
}
