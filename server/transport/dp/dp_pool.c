/*
 * dp_pool — the data plane's payload buffers: power-of-two size classes, the
 * pool of idle ones the loop thread hands round (large ones backed by huge
 * pages), and the release of a zero-copy answer's pins. Loop thread only,
 * except buf_free/buf_unpin, which any thread may call on a buffer it owns.
 */
#include "server/transport/dp/dp_internal.h"

#include <stdlib.h>
#include <sys/mman.h>

#include "common/base/clock.h"

static int size_class(size_t n) {
  int c = 12; /* 4 KiB at least */
  while (c < DP_POOL_CLASSES - 1 && ((size_t)1 << c) < n)
    c++;
  return c;
}

/* Releases the pins of a zero-copy answer (from any thread: core_unpin_low
 * never blocks). */
void dp__buf_unpin(dp_buf *b) {
  if (b->segs) {
    for (uint32_t i = 0; i < b->nsegs; i++)
      core_unpin_low(b->pinned, b->segs[i].data);
    b->nsegs = 0;
  } else {
    core_unpin_low(b->pinned, b->data);
    b->data = NULL;
  }
  b->pinned = NULL;
}

void dp__buf_free(dp_buf *b) {
  if (b) {
    if (b->pinned)
      dp__buf_unpin(b);
    else
      free(b->data);
    free(b->segs);
    free(b);
  }
}

dp_buf *dp__pool_get(dp_server *s, size_t n) {
  int c = size_class(n);
  if (((size_t)1 << c) < n)
    return NULL;
  s->pool_last_use_ms = clock_now_ms();
  dp_buf *b = s->pool[c];
  if (b) {
    s->pool[c] = b->next;
    s->pool_count[c]--;
    s->pool_bytes -= b->cap;
    b->next = NULL;
    return b;
  }
  b = calloc(1, sizeof *b);
  if (!b)
    return NULL;
  b->cls = c;
  b->cap = (size_t)1 << c;
  void *p = NULL;
  if (posix_memalign(&p, b->cap >= DP_HUGE_MIN ? DP_HUGE_MIN : 64, b->cap) != 0) {
    free(b);
    return NULL;
  }
  if (b->cap >= DP_HUGE_MIN)
    madvise(p, b->cap, MADV_HUGEPAGE); /* a hint: failure changes nothing */
  b->data = p;
  return b;
}

void dp__pool_put(dp_server *s, dp_buf *b) {
  if (!b)
    return;
  if (b->cls >= 0 && s->pool_count[b->cls] < DP_POOL_PER_CLASS &&
      (s->pool_bytes + b->cap <= DP_POOL_BYTES || s->pool_bytes == 0)) {
    b->next = s->pool[b->cls];
    s->pool[b->cls] = b;
    s->pool_count[b->cls]++;
    s->pool_bytes += b->cap;
    return;
  }
  dp__buf_free(b);
}

void dp__pool_drain(dp_server *s) {
  for (int c = 0; c < DP_POOL_CLASSES; c++) {
    while (s->pool[c]) {
      dp_buf *b = s->pool[c];
      s->pool[c] = b->next;
      dp__buf_free(b);
    }
    s->pool_count[c] = 0;
  }
  s->pool_bytes = 0;
}
