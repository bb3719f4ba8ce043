/*
 * pool — a small fixed set of threads offering one verb: a blocking
 * parallel-for. pool_run() hands out chunk indices 0 .. nchunks-1 to the pool's
 * threads and to the calling thread, which takes part in the work, and returns
 * once every chunk has run exactly once.
 *
 * Which thread runs which chunk, and in what order, is unspecified: a caller
 * that needs a result independent of the thread count writes each chunk's
 * result to its own slot and combines the slots in index order afterwards.
 */
#ifndef ZSHARD_SERVER_POOL_H
#define ZSHARD_SERVER_POOL_H

#include <stddef.h>

typedef struct pool pool;

/* Runs chunk `chunk` of a parallel-for; `arg` is pool_run's argument. */
typedef void (*pool_fn)(void *arg, size_t chunk);

/* Creates a pool in which `threads` threads work on each pool_run, the caller
 * of pool_run included, so threads - 1 threads are started (threads <= 1
 * starts none: pool_run then runs every chunk on the caller). Returns 0 or
 * ZS_ENOMEM; *out is set only on success and is freed with pool_destroy. */
int pool_create(int threads, pool **out);

/* Stops and joins the pool's threads and frees the pool. Must not be called
 * while a pool_run is in progress. Tolerates NULL. */
void pool_destroy(pool *p);

/* Calls fn(arg, i) once for every i in [0, nchunks), on the pool's threads and
 * on the calling thread, and returns when all calls have returned. `arg` is the
 * caller's and is only used during the call. Calls from several threads at
 * once are serialised. fn must not call pool_run on the same pool. */
void pool_run(pool *p, size_t nchunks, pool_fn fn, void *arg);

/* The number of threads that work on a pool_run, the caller included. */
int pool_threads(const pool *p);

#endif
