/*
 * clock — monotonic time in milliseconds and nanoseconds, for deadlines, and
 * the tests' stall hook.
 */
#ifndef ZSHARD_COMMON_CLOCK_H
#define ZSHARD_COMMON_CLOCK_H

#include <stdint.h>

uint64_t clock_now_ms(void); /* CLOCK_MONOTONIC */
uint64_t clock_now_ns(void);

/* A test hook (tests only; docs/OPERATIONS.md lists the names): when the
 * environment variable `name` holds a whole number of milliseconds above 0,
 * the calling thread sleeps that long, as a large shard's slow step would
 * take, and logs test_hook each time. Otherwise nothing. */
void clock_test_stall(const char *name);

#endif
