#include "server/core/histogram.h"

#include <math.h>
#include <string.h>

/* The bounds in nanoseconds, so that recording compares integers. */
static const uint64_t bounds_ns[HISTOGRAM_BOUNDS] = {
    50000ull,       100000ull,       250000ull,       500000ull,     1000000ull,     2500000ull,
    5000000ull,     10000000ull,     25000000ull,     50000000ull,   100000000ull,   250000000ull,
    500000000ull,   1000000000ull,   2500000000ull,   5000000000ull, 10000000000ull, 30000000000ull,
    60000000000ull, 120000000000ull, 300000000000ull,
};

void histogram_init(histogram *h) {
  for (size_t i = 0; i <= HISTOGRAM_BOUNDS; i++)
    atomic_init(&h->counts[i], 0);
  atomic_init(&h->sum_ns, 0);
}

void histogram_observe_ns(histogram *h, uint64_t ns) {
  if (!h)
    return;
  /* Most observations are short, so a forward scan ends early; it is at most
   * 21 integer compares. */
  size_t i = 0;
  while (i < HISTOGRAM_BOUNDS && ns > bounds_ns[i])
    i++;
  atomic_fetch_add_explicit(&h->counts[i], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

void histogram_observe_seconds(histogram *h, double seconds) {
  if (!h)
    return;
  uint64_t ns;
  if (!(seconds > 0)) /* also NaN */
    ns = 0;
  else if (seconds >= 1.8e10) /* 2^64 ns is about 1.8e10 s */
    ns = UINT64_MAX / 2;
  else
    ns = (uint64_t)llround(seconds * 1e9);
  histogram_observe_ns(h, ns);
}

double histogram_bound_seconds(size_t i) {
  return i < HISTOGRAM_BOUNDS ? (double)bounds_ns[i] / 1e9 : INFINITY;
}

void histogram_read(const histogram *h, histogram_snapshot *out) {
  memset(out, 0, sizeof *out);
  uint64_t run = 0;
  for (size_t i = 0; i <= HISTOGRAM_BOUNDS; i++) {
    /* The atomics are only read; the cast drops the const that C11's
     * atomic_load does not accept on older compilers. */
    run += atomic_load_explicit((atomic_uint_fast64_t *)&h->counts[i], memory_order_relaxed);
    out->cumulative[i] = run;
  }
  out->count = run;
  out->sum_seconds =
      (double)atomic_load_explicit((atomic_uint_fast64_t *)&h->sum_ns, memory_order_relaxed) / 1e9;
}
