/*
 * log — one line per event on stderr, key=value:
 *   ts=2026-11-29T15:12:45.123Z level=info event=listening addr=0.0.0.0:7070
 * The format string passed to LOG_* holds the key=value pairs after the event.
 * Thread-safe: each line is written with one write(2).
 */
#ifndef ZSHARD_COMMON_LOG_H
#define ZSHARD_COMMON_LOG_H

typedef enum log_level {
  LOG_LEVEL_DEBUG = 0,
  LOG_LEVEL_INFO = 1,
  LOG_LEVEL_WARN = 2,
  LOG_LEVEL_ERROR = 3,
  LOG_LEVEL_OFF = 4,
} log_level;

void log_set_level(log_level level);
/* Parses "debug", "info", "warn", "error", "off". Returns 0 or -1. */
int log_parse_level(const char *s, log_level *out);

void log_write(log_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define LOG_DEBUG(event, ...) log_write(LOG_LEVEL_DEBUG, event, __VA_ARGS__)
#define LOG_INFO(event, ...) log_write(LOG_LEVEL_INFO, event, __VA_ARGS__)
#define LOG_WARN(event, ...) log_write(LOG_LEVEL_WARN, event, __VA_ARGS__)
#define LOG_ERROR(event, ...) log_write(LOG_LEVEL_ERROR, event, __VA_ARGS__)

#endif
