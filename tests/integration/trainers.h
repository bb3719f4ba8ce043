/*
 * trainers — the fixture the training tests share (test_client_e2e,
 * test_pipelined, test_client_schedule): a cluster started with its address
 * list for zs_client_options.addresses, trainer threads started and joined,
 * the deterministic gradient noise, and the test program's main. Built into
 * the harness library (tests/CMakeLists.txt), beside harness.h, whose servers
 * it starts.
 *
 * The helpers that check something fail the running cmocka test, as an
 * assert_* in the test itself would; call them from a test's own thread.
 */
#ifndef ZSHARD_TESTS_TRAINERS_H
#define ZSHARD_TESTS_TRAINERS_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"

/* Starts n servers forming one job (hs_cluster_start with `extra`, may be
 * NULL) and writes their addresses, shard 0 first and comma-separated, into
 * addrs (len bytes). Fails the test if the cluster does not start; the
 * caller stops it with hs_cluster_stop. */
void tr_cluster_up(hs_cluster *cl, uint32_t n, const char *const *extra, char *addrs, size_t len);

/* A deterministic value in [-1, 1) from a contribution's identity: step s,
 * rank r, micro-batch m, tensor t, element i (a SplitMix64 finalizer). */
float tr_noise(uint64_t s, uint32_t r, uint32_t m, uint32_t t, uint64_t i);

/* Runs fn on n threads, thread k with args + k * stride (the caller's array
 * of n arguments, borrowed until this returns), and joins them all. Fails
 * the test if a thread cannot be created. */
void tr_run_threads(uint32_t n, void *(*fn)(void *), void *args, size_t stride);

/* The setup of a test program's group: hs_init. */
int tr_group_setup(void **state);

/* Runs the array `tests` as one cmocka group with tr_group_setup, then
 * hs_finish; evaluates to the number of failures (main's exit status). */
#define TR_RUN_TESTS(tests) tr_finish(cmocka_run_group_tests(tests, tr_group_setup, NULL))

/* hs_finish(failures), then returns failures. */
int tr_finish(int failures);

#endif
