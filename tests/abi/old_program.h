/*
 * old_program — a program built against tests/abi/zshard_v0.h (an older
 * zshard.h) and linked to today's libzshard.so. Each function drives the
 * library through the old structs, each followed in memory by guard bytes,
 * and fails a cmocka assertion if the library wrote past one or did not give
 * a missing field its default.
 */
#ifndef ZSHARD_TESTS_OLD_PROGRAM_H
#define ZSHARD_TESTS_OLD_PROGRAM_H

/* Bytes after every struct that must come back unchanged. */
#define OLD_GUARD 64

void old_inits_stay_inside_the_old_structs(void);
void old_scaler_state_it_lacks_takes_defaults(void);
void old_estimate_input_and_rows(void);
/* Against a running shard at `addr`: options, an Adam group lacking
 * bias_correction, one step, its result and timing in the old structs. */
void old_trainer_steps(const char *addr);

#endif
