#include "common/base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile log_level g_level = LOG_LEVEL_INFO;
static const char *const level_names[] = {"debug", "info", "warn", "error", "off"};

void log_set_level(log_level level) {
  g_level = level;
}

int log_parse_level(const char *s, log_level *out) {
  for (int i = 0; i <= LOG_LEVEL_OFF; i++) {
    if (s && strcmp(s, level_names[i]) == 0) {
      *out = (log_level)i;
      return 0;
    }
  }
  return -1;
}

void log_write(log_level level, const char *event, const char *fmt, ...) {
  if (level < g_level || level >= LOG_LEVEL_OFF)
    return;
  char line[2048];
  struct timeval tv;
  struct tm tm;
  gettimeofday(&tv, NULL);
  gmtime_r(&tv.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s event=%s",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                   (long)(tv.tv_usec / 1000), level_names[level], event);
  if (fmt && fmt[0] && n > 0 && (size_t)n < sizeof line - 2) {
    line[n++] = ' ';
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m > 0)
      n += m;
  }
  if (n < 0)
    return;
  if ((size_t)n >= sizeof line - 1)
    n = (int)sizeof line - 2; /* truncated: keep the line whole */
  line[n++] = '\n';
  /* One write per line keeps lines from different threads whole. */
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}
