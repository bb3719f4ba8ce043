/*
 * cpu — run-time choice of instruction set for the vector kernels.
 */
#ifndef ZSHARD_COMMON_CPU_H
#define ZSHARD_COMMON_CPU_H

typedef enum cpu_isa {
  CPU_ISA_SCALAR = 0,
  CPU_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
  CPU_ISA_AVX512 = 2, /* AVX-512 F + BW + VL (+ F16C) */
} cpu_isa;

/* The best ISA this CPU supports, lowered by the environment variable
 * ZSHARD_ISA=scalar|avx2|avx512 when set. Computed once; thread-safe. */
cpu_isa cpu_best_isa(void);

/* 1 if the CPU (not the environment) supports `isa`. */
int cpu_supports(cpu_isa isa);

/* min(isa, what the CPU supports). */
cpu_isa cpu_clamp_isa(cpu_isa isa);

/* "scalar", "avx2", "avx512". */
const char *cpu_isa_name(cpu_isa isa);

#endif
