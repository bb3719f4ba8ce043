#include "common/base/clock.h"

#include <stdlib.h>
#include <time.h>

#include "common/base/log.h"

uint64_t clock_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t clock_now_ms(void) {
  return clock_now_ns() / 1000000u;
}

void clock_test_stall(const char *name) {
  const char *v = getenv(name);
  char *end;
  unsigned long ms = v && *v ? strtoul(v, &end, 10) : 0;
  if (!ms || *end != '\0')
    return;
  LOG_WARN("test_hook", "name=%s ms=%lu effect=the_step_takes_that_much_longer", name, ms);
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}
