/*
 * Tests that need root (mounting a small tmpfs to fill a disk) skip, saying
 * so, where they cannot have it; scripts/test sets ZSHARD_TEST_PRIVILEGED=1
 * when it runs as root, as CI does, and there such a test fails instead of
 * skipping: a CI that cannot mount a tmpfs must not be green without the
 * full-disk tests.
 */
#ifndef ZSHARD_TESTS_PRIVILEGED_H
#define ZSHARD_TESTS_PRIVILEGED_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Called when `what` failed with errno set; never returns. */
#define privileged_unavailable(what)                                                               \
  do {                                                                                             \
    const char *p_ = getenv("ZSHARD_TEST_PRIVILEGED");                                             \
    if (p_ && strcmp(p_, "1") == 0)                                                                \
      fail_msg("%s: %s (ZSHARD_TEST_PRIVILEGED=1: required, not skipped)", (what),                 \
               strerror(errno));                                                                   \
    fprintf(stderr, "%s: %s: skipped\n", (what), strerror(errno));                                 \
    skip();                                                                                        \
  } while (0)

#endif
