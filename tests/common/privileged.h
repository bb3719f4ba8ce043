/*
 * Tests that need root (mounting a small tmpfs to fill a disk) skip, saying
 * so, where they cannot have it, except where a run must not be green
 * without them: with ZSHARD_TEST_PRIVILEGED=1 (scripts/test sets it when it
 * runs as root) or in a CI (the environment variable CI set, as GitHub
 * Actions, GitLab and most others set it to "true") such a test fails
 * instead, with a sentence naming the variable. A CI that truly cannot mount
 * a tmpfs says so in its own configuration with ZSHARD_TEST_PRIVILEGED=0;
 * the tests then skip, and say so.
 */
#ifndef ZSHARD_TESTS_PRIVILEGED_H
#define ZSHARD_TESTS_PRIVILEGED_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What requires the privileged tests: "ZSHARD_TEST_PRIVILEGED=1", "CI=..."
 * or NULL when they may skip. */
static inline const char *privileged_required_by(void) {
  const char *p = getenv("ZSHARD_TEST_PRIVILEGED");
  if (p && strcmp(p, "1") == 0)
    return "ZSHARD_TEST_PRIVILEGED=1";
  if (p && strcmp(p, "0") == 0)
    return NULL;
  const char *ci = getenv("CI");
  if (ci && ci[0] && strcmp(ci, "0") != 0 && strcmp(ci, "false") != 0)
    return "CI is set";
  return NULL;
}

/* Called when `what` failed with errno set; never returns. */
#define privileged_unavailable(what)                                                               \
  do {                                                                                             \
    int e_ = errno;                                                                                \
    const char *by_ = privileged_required_by();                                                    \
    if (by_)                                                                                       \
      fail_msg("%s: %s (%s: this test is required, not skipped; run as root or with "              \
               "CAP_SYS_ADMIN, or set ZSHARD_TEST_PRIVILEGED=0 to skip it on purpose)",            \
               (what), strerror(e_), by_);                                                         \
    fprintf(stderr, "%s: %s: skipped (neither CI nor ZSHARD_TEST_PRIVILEGED=1 requires it)\n",     \
            (what), strerror(e_));                                                                 \
    skip();                                                                                        \
  } while (0)

#endif
