/*
 * trainers — the fixture the training tests share (test_client_e2e,
 * test_pipelined, test_client_schedule, test_client_elastic): a cluster started with its address
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

/* A tensor of a test's model: its name, its element count and its param
 * group. */
typedef struct tr_tensor {
  const char *name;
  uint64_t numel;
  uint32_t group;
} tr_tensor;

/* One trainer thread's argument (tr_run_trainers): the run's configuration
 * and the rank's report, both of the test's own types. */
typedef struct tr_trainer {
  const void *cfg; /* shared by the ranks, borrowed */
  uint32_t rank;
  void *out; /* the rank's own report */
} tr_trainer;

#define TR_MAX_TRAINERS 16
#define TR_MAX_TENSORS 8

/* What a trainer thread reports when all it returns is its final
 * parameters: its status, the sentence of its first failure and the
 * tensors (calloc'd by the trainer, freed with tr_reports_free). */
typedef struct tr_report {
  int rc;
  char err[600];
  float *final[TR_MAX_TENSORS];
} tr_report;

/* Fails the test, naming `what`, the rank and its sentence, if one of the W
 * reports is not ZS_OK. */
void tr_reports_check(const tr_report *outs, uint32_t W, const char *what);

/* Frees the first nt tensors of each of the W reports. */
void tr_reports_free(tr_report *outs, uint32_t W, uint32_t nt);

/* Runs fn on W threads (at most TR_MAX_TRAINERS), thread r with the
 * tr_trainer of rank r whose out is outs + r * out_size (the caller's array
 * of W reports, zeroed here first), and joins them all. `cfg` and `outs`
 * are borrowed until this returns. Fails the test if a thread cannot be
 * created. */
void tr_run_trainers(uint32_t W, void *(*fn)(void *), const void *cfg, void *outs, size_t out_size);

/* The setup of a test program's group: hs_init. */
int tr_group_setup(void **state);

/* Runs the array `tests` as one cmocka group with tr_group_setup, then
 * hs_finish; evaluates to the number of failures (main's exit status). */
#define TR_RUN_TESTS(tests) tr_finish(cmocka_run_group_tests(tests, tr_group_setup, NULL))

/* hs_finish(failures), then returns failures. */
int tr_finish(int failures);

#endif
