#include "common/base/trace.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/clock.h"

typedef struct trace_rec {
  uint64_t ns;
  uint64_t step;
  uint32_t tensor, slice, who;
  uint16_t kind;
} trace_rec;

int trace__on;
static trace_rec *recs;
static size_t cap;
static atomic_size_t used;
static char prefix[512];

void trace__add(trace_kind kind, uint64_t step, uint32_t tensor, uint32_t slice, uint32_t who) {
  size_t i = atomic_fetch_add_explicit(&used, 1, memory_order_relaxed);
  if (i >= cap)
    return; /* counted, dropped: the file says how many */
  recs[i] = (trace_rec){.ns = clock_now_ns(),
                        .step = step,
                        .tensor = tensor,
                        .slice = slice,
                        .who = who,
                        .kind = (uint16_t)kind};
}

/* At exit every other thread has stopped recording or is about to be cut
 * off: a record being written as the file is may read half old; the
 * analysis tolerates a wrong line, and the run's last moments are not what
 * a trace is for. */
static void trace_write(void) {
  char path[600];
  snprintf(path, sizeof path, "%s.%ld.trace", prefix, (long)getpid());
  FILE *f = fopen(path, "w");
  if (!f)
    return;
  size_t n = atomic_load(&used);
  size_t kept = n < cap ? n : cap;
  fprintf(f, "# zshard trace pid %ld records %zu dropped %zu\n", (long)getpid(), kept, n - kept);
  for (size_t i = 0; i < kept; i++)
    fprintf(f, "%" PRIu64 " %u %" PRIu64 " %u %u %u\n", recs[i].ns, recs[i].kind, recs[i].step,
            recs[i].tensor, recs[i].slice, recs[i].who);
  fclose(f);
}

/* A constructor, so that the server, the client library and the tools all
 * trace without a call of their own; it runs before any thread exists. */
__attribute__((constructor)) static void trace_init(void) {
  const char *p = getenv("ZSHARD_TRACE");
  if (!p || !*p || strlen(p) >= sizeof prefix)
    return;
  const char *m = getenv("ZSHARD_TRACE_MAX");
  char *end = NULL;
  unsigned long long want = m && *m ? strtoull(m, &end, 10) : 0;
  cap = want > 0 && end && *end == '\0' && want <= (1ull << 26) ? (size_t)want : (size_t)1 << 18;
  recs = calloc(cap, sizeof *recs);
  if (!recs)
    return;
  memcpy(prefix, p, strlen(p) + 1);
  if (atexit(trace_write) != 0)
    return;
  trace__on = 1;
}
