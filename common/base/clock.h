/*
 * clock — monotonic time in milliseconds and nanoseconds, for deadlines.
 */
#ifndef ZSHARD_COMMON_CLOCK_H
#define ZSHARD_COMMON_CLOCK_H

#include <stdint.h>

uint64_t clock_now_ms(void); /* CLOCK_MONOTONIC */
uint64_t clock_now_ns(void);

#endif
