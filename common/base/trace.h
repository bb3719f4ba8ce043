/*
 * trace — an opt-in timeline of a process's tensor-piece events, to find
 * where a pipelined step's time goes (tests/bench/netsim --trace DIR, read by
 * tests/bench/netsim.d/timeline.py).
 *
 * Off unless the environment variable ZSHARD_TRACE names a path prefix when
 * the process starts; then every trace_ev() appends one fixed-size record
 * (CLOCK_MONOTONIC nanoseconds, which every network namespace of a host
 * shares, so shards' and trainers' records line up) to an array of
 * ZSHARD_TRACE_MAX records (default 262144 of 32 bytes, 8 MiB, allocated once), and
 * the records are written at exit to PREFIX.<pid>.trace, one line each:
 * "ns kind step tensor slice who". Records past the array's end are counted
 * and dropped (the file's first line says how many). Off, a call costs one
 * load and a branch; on, an atomic increment and a clock read, from any
 * thread.
 */
#ifndef ZSHARD_COMMON_TRACE_H
#define ZSHARD_COMMON_TRACE_H

#include <stdint.h>

/* What happened to a piece; `who` is the rank where one is known (else 0). */
typedef enum trace_kind {
  /* shard */
  TRACE_PUSH_IN = 1,  /* a contribution (rank who) was added or held */
  TRACE_READY = 2,    /* a pipelined piece has every contribution */
  TRACE_APPLIED = 3,  /* a pipelined piece is applied and readable */
  TRACE_PULL_IN = 4,  /* a data-plane pull asked for the piece (who: pieces in its request) */
  TRACE_PULL_GO = 5,  /* the pull's pieces are there: its answer is queued to be made */
  TRACE_PULL_OUT = 6, /* its answer is handed to the connection's writer */
  /* trainer */
  TRACE_C_PUSH = 16,      /* the piece's push is handed to the data-plane client */
  TRACE_C_PUSH_ACK = 17,  /* its acknowledgement arrived */
  TRACE_C_PULL = 18,      /* the piece's pull is handed to the data-plane client */
  TRACE_C_PULL_DONE = 19, /* its bytes arrived */
} trace_kind;

extern int trace__on; /* set once, before any thread starts, by a constructor */

void trace__add(trace_kind kind, uint64_t step, uint32_t tensor, uint32_t slice, uint32_t who);

/* 1 when tracing is on: callers test it before a loop of records or before
 * computing a record's fields, so that tracing off costs one branch. */
static inline int trace_enabled(void) {
  return __builtin_expect(trace__on, 0);
}

static inline void trace_ev(trace_kind kind, uint64_t step, uint32_t tensor, uint32_t slice,
                            uint32_t who) {
  if (trace_enabled())
    trace__add(kind, step, tensor, slice, who);
}

#endif
