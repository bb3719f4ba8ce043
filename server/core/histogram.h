/*
 * histogram — a latency histogram that any thread may record into without a
 * lock, and that a reader (the metrics endpoint) copies whenever it likes.
 *
 * Every histogram has the same fixed bucket bounds, from 50 µs to 300 s in
 * 1-2.5-5 steps (the longest wait a Pull or GradStats may take is 5 minutes),
 * plus the +Inf bucket. One observation is one relaxed atomic increment of its
 * bucket and one of the sum: nothing is allocated, nothing blocks, and a
 * recording thread never waits for a reader.
 *
 * A copy is not one instant: buckets recorded while histogram_read runs may
 * or may not be in it, and the sum may disagree with the buckets by those
 * observations. The count of a copy is the sum of its buckets, so the
 * cumulative +Inf bucket always equals the count, as Prometheus requires.
 */
#ifndef ZSHARD_SERVER_HISTOGRAM_H
#define ZSHARD_SERVER_HISTOGRAM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Number of finite bucket bounds. */
#define HISTOGRAM_BOUNDS 21

typedef struct histogram {
  /* Per bucket, not cumulative: counts[i] holds observations in
   * (bound[i-1], bound[i]]; counts[HISTOGRAM_BOUNDS] those above the last. */
  atomic_uint_fast64_t counts[HISTOGRAM_BOUNDS + 1];
  atomic_uint_fast64_t sum_ns;
} histogram;

/* Zeroes `h`. A histogram in static storage or from calloc is already zero;
 * one on the stack or from malloc needs this before use. */
void histogram_init(histogram *h);

/* Records one duration. `h` may be NULL (nothing is recorded), so a caller
 * with metrics turned off needs no test of its own. */
void histogram_observe_ns(histogram *h, uint64_t ns);

/* The same for a duration in seconds; negative and NaN count as 0, and
 * durations too large for nanoseconds in 64 bits count in the +Inf bucket. */
void histogram_observe_seconds(histogram *h, double seconds);

/* Upper bound of bucket i (0 <= i < HISTOGRAM_BOUNDS), in seconds. */
double histogram_bound_seconds(size_t i);

/* A copy of a histogram for printing: cumulative bucket counts. */
typedef struct histogram_snapshot {
  /* cumulative[i]: observations <= bound i; cumulative[HISTOGRAM_BOUNDS] is
   * every observation and equals count. */
  uint64_t cumulative[HISTOGRAM_BOUNDS + 1];
  uint64_t count;
  double sum_seconds;
} histogram_snapshot;

/* Copies `h` into *out (see the top of this file for what a copy means). */
void histogram_read(const histogram *h, histogram_snapshot *out);

#endif
