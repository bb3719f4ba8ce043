#include "common/base/cpu.h"

#include <cpuid.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static cpu_isa g_hw = CPU_ISA_SCALAR;
static cpu_isa g_best = CPU_ISA_SCALAR;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* F16C is CPUID leaf 1, ECX bit 29; clang's __builtin_cpu_supports does not
 * know the name, so it is read directly. */
static int cpu_has_f16c(void) {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}

static void cpu_detect(void) {
  __builtin_cpu_init();
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
  g_hw = avx512 ? CPU_ISA_AVX512 : avx2 ? CPU_ISA_AVX2 : CPU_ISA_SCALAR;
  g_best = g_hw;
  /* ZSHARD_ISA can only lower the choice: asking for more than the CPU has
   * would crash with SIGILL. */
  const char *env = getenv("ZSHARD_ISA");
  if (env) {
    if (strcmp(env, "scalar") == 0)
      g_best = CPU_ISA_SCALAR;
    else if (strcmp(env, "avx2") == 0 && g_hw >= CPU_ISA_AVX2)
      g_best = CPU_ISA_AVX2;
  }
}

cpu_isa cpu_best_isa(void) {
  pthread_once(&g_once, cpu_detect);
  return g_best;
}

int cpu_supports(cpu_isa isa) {
  pthread_once(&g_once, cpu_detect);
  return isa <= g_hw;
}

cpu_isa cpu_clamp_isa(cpu_isa isa) {
  pthread_once(&g_once, cpu_detect);
  return isa <= g_hw ? isa : g_hw;
}

const char *cpu_isa_name(cpu_isa isa) {
  switch (isa) {
  case CPU_ISA_AVX512:
    return "avx512";
  case CPU_ISA_AVX2:
    return "avx2";
  default:
    return "scalar";
  }
}
