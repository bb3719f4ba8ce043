/*
 * bench_optim — the shard's fused optimizer pass (AdamW, bf16 low copy)
 * against the memory roofline measured in the same run.
 *
 * The pass must move 34 bytes per parameter: it reads the accumulated
 * gradient, the fp32 master, exp_avg and exp_avg_sq (16 bytes) and writes the
 * master, both moments, the zeroed accumulator (16 bytes) and the bf16 copy
 * (2 bytes). The limit is a STREAM-like kernel with exactly that mix of
 * streams (stream.h), run on the same arrays with the same thread split;
 * limit in parameters per second = its bandwidth / 34 bytes.
 *
 * Figures are medians over rounds (after one warm-up round); a round runs
 * every contender once, each right after a stream pass of its own, which is
 * that contender's limit for the round (this machine's other tenants come and
 * go; pairing exposes both sides of a ratio to the same moment). Each pass
 * covers all parameters, with the accumulator refilled first, untimed. The
 * contenders:
 *   - optim_apply directly, 1 thread, for each ISA the CPU has (scalar is
 *     the plain-loop baseline), and split over all threads;
 *   - the shard core's apply (core_apply, its thread pool and chunking
 *     included), 1 thread and all threads, timed from the call to the
 *     callback, and as the core itself times the pass; and its process CPU
 *     time against the bare kernel's (apply_core_cpu_over_direct, the
 *     medians' ratio), which the machine's other tenants move far less;
 *   - torch.optim.AdamW (Debian's python3-torch) on a tensor of the same
 *     size, stepped by /usr/bin/python3 as a co-process (torch_adamw.py) with
 *     torch.set_num_threads matching.
 *
 * Usage: bench_optim [--json] [--quick] [--reps R] [--params N] [--threads T]
 *                    [--no-torch]
 *
 * Threads: the main thread, plus T - 1 helper threads created per timed
 * pass; the core's own threads (server/core/core.h) for the core figures.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "common/base/cpu.h"
#include "common/base/dtype.h"
#include "common/model/spec.h"
#include "server/core/core.h"
#include "server/optim/optim.h"
#include "stream.h"

#ifndef ZS_SOURCE_DIR
#define ZS_SOURCE_DIR "."
#endif

#define MAX_THREADS 64

typedef struct arrays {
  size_t n;
  float *master, *m, *v, *acc;
  uint16_t *low;
} arrays;

/* The gradient the accumulator is refilled with: cheap to generate, not
 * constant, small enough that nothing overflows over many passes. */
static void refill_acc(arrays *a) {
  for (size_t i = 0; i < a->n; i++)
    a->acc[i] = (float)((int)(i & 1023u) - 512) * 1e-5f;
}

static void adamw_params(optim_params *p, uint64_t step) {
  memset(p, 0, sizeof *p);
  p->optimizer = ZS_OPTIM_ADAMW;
  p->lr = 1e-3;
  p->beta1 = 0.9;
  p->beta2 = 0.999;
  p->eps = 1e-8;
  p->weight_decay = 0.01;
  p->bias_correction = 1;
  p->step = step;
  p->grad_scale = 1.0f;
  p->low_dtype = ZS_DTYPE_BF16;
}

/* ------------------------------------------------------------ the kernels */

typedef enum kernel_kind { K_STREAM, K_OPTIM } kernel_kind;

typedef struct job {
  kernel_kind kind;
  cpu_isa isa;
  const optim_plan *plan;
  arrays *a;
  int threads;
  pthread_barrier_t start;
} job;

typedef struct worker {
  pthread_t th;
  job *j;
  int index;
} worker;

/* Runs worker `index`'s share: contiguous ranges whose boundaries are
 * multiples of 16 elements (64 bytes), as the core splits its arenas. */
static void run_share(job *j, int index) {
  size_t n = j->a->n;
  size_t per = (n / (size_t)j->threads + 15) & ~(size_t)15;
  size_t b = per * (size_t)index;
  size_t e = b + per < n ? b + per : n;
  if (b >= e)
    return;
  arrays *a = j->a;
  if (j->kind == K_STREAM)
    stream_mix(a->master + b, a->m + b, a->v + b, a->acc + b, a->low + b, e - b);
  else
    optim_apply_isa(j->isa, j->plan, a->master + b, a->m + b, a->v + b, a->acc + b, a->low + b,
                    e - b);
}

static void *worker_main(void *arg) {
  worker *w = arg;
  pthread_barrier_wait(&w->j->start);
  run_share(w->j, w->index);
  return NULL;
}

/* CPU seconds of the whole process so far: every thread's running time,
 * without the time a thread waited for a CPU. On a shared machine the wall
 * clock of a pass moves with the other tenants' load; its CPU time moves far
 * less, so the core's pass is also compared with the bare kernel in CPU
 * time (apply_core_cpu_over_direct). */
static double process_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The process CPU seconds of the last timed_pass. */
static double g_pass_cpu_s;

/* One timed pass over all elements with `threads` threads. */
static double timed_pass(kernel_kind kind, cpu_isa isa, const optim_plan *plan, arrays *a,
                         int threads) {
  job j = {.kind = kind, .isa = isa, .plan = plan, .a = a, .threads = threads};
  worker w[MAX_THREADS];
  pthread_barrier_init(&j.start, NULL, (unsigned)threads);
  for (int i = 1; i < threads; i++) {
    w[i].j = &j;
    w[i].index = i;
    if (pthread_create(&w[i].th, NULL, worker_main, &w[i]) != 0)
      bench_die("pthread_create failed");
  }
  pthread_barrier_wait(&j.start);
  double c0 = process_cpu_s();
  double t0 = bench_now();
  run_share(&j, 0);
  for (int i = 1; i < threads; i++)
    pthread_join(w[i].th, NULL);
  double t = bench_now() - t0;
  g_pass_cpu_s = process_cpu_s() - c0;
  pthread_barrier_destroy(&j.start);
  return t;
}

/* One pass with the accumulator refilled first (untimed). */
static double pass(kernel_kind kind, cpu_isa isa, arrays *a, int threads, uint64_t step) {
  optim_params p;
  optim_plan plan;
  adamw_params(&p, step);
  optim_plan_init(&plan, &p);
  refill_acc(a);
  return timed_pass(kind, isa, &plan, a, threads);
}

/* ------------------------------------------------------------ the core */

typedef struct waitbox {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
} waitbox;

static void waitbox_init(waitbox *w) {
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  w->done = 0;
  w->status = 0;
}

static void waitbox_fire(waitbox *w, int status) {
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->status = status;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static int waitbox_wait(waitbox *w) {
  pthread_mutex_lock(&w->mu);
  while (!w->done)
    pthread_cond_wait(&w->cv, &w->mu);
  int st = w->status;
  w->done = 0;
  pthread_mutex_unlock(&w->mu);
  return st;
}

static void on_stats(void *arg, int status, const core_stats_result *r) {
  (void)r;
  waitbox_fire(arg, status);
}

static void on_apply(void *arg, int status, const core_apply_result *r) {
  (void)r;
  waitbox_fire(arg, status);
}

/* A shard core holding n parameters in one tensor, stepped one apply at a
 * time. */
typedef struct core_bench {
  core *c;
  spec s;
  uint64_t hash, step;
  size_t n;
  uint16_t *grad; /* owned: the bf16 gradient pushed before each apply */
  waitbox wb;
} core_bench;

static void core_bench_open(core_bench *cb, size_t n, int threads) {
  char err[256] = "";
  memset(cb, 0, sizeof *cb);
  cb->n = n;
  spec *s = &cb->s;
  s->job = strdup("bench-optim");
  s->num_groups = 1;
  s->groups = calloc(1, sizeof *s->groups);
  s->num_tensors = 1;
  s->tensors = calloc(1, sizeof *s->tensors);
  if (!s->job || !s->groups || !s->tensors)
    bench_die("out of memory");
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  s->tensors[0].name = strdup("w");
  s->tensors[0].numel = n;
  s->world_size = 1;
  s->grad_accum = 1;
  s->num_shards = 1;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  if (!s->tensors[0].name || spec_validate(s, err, sizeof err) != 0)
    bench_die("spec: %s", err);
  cb->hash = spec_hash(s);
  core_config cc = {.shard_id = 0, .num_shards = 1, .threads = threads};
  if (core_create(&cc, &cb->c) != 0)
    bench_die("core_create failed");
  core_open_result orr;
  if (core_open(cb->c, s, &orr, err, sizeof err) != 0)
    bench_die("core_open: %s", err);
  float *w = bench_alloc(n * sizeof(float));
  bench_fill_f32(w, n, 0.1f, 7);
  int written = 0;
  uint64_t version = 0;
  if (core_init_params(cb->c, cb->hash, 0, 0, w, n * sizeof(float), &written, &version, err,
                       sizeof err))
    bench_die("core_init_params: %s", err);
  free(w);
  cb->grad = bench_alloc(n * sizeof(uint16_t));
  bench_fill_bf16(cb->grad, n, 11);
  waitbox_init(&cb->wb);
}

static void core_bench_close(core_bench *cb) {
  core_destroy(cb->c);
  free(cb->grad);
  spec_free(&cb->s);
}

/* One step: the push and the statistics untimed, then the apply, timed from
 * the call to its callback (what a transport waits). *pass_s gets the core's
 * own timing of the pass (apply_seconds_total), which leaves out the hand-off
 * to its worker thread. */
static double core_bench_step(core_bench *cb, double *pass_s, double *cpu_s) {
  char err[256] = "";
  uint64_t step = ++cb->step;
  int dup = 0;
  core_push_args pa = {.hash = cb->hash,
                       .step = step,
                       .dtype = ZS_DTYPE_BF16,
                       .data = cb->grad,
                       .nbytes = cb->n * sizeof(uint16_t)};
  if (core_push(cb->c, &pa, &dup, err, sizeof err) != 0)
    bench_die("core_push: %s", err);
  core_stats_result sr;
  int rc = core_grad_stats(cb->c, cb->hash, step, 0, on_stats, &cb->wb, &sr, err, sizeof err);
  if (rc == CORE_PENDING)
    rc = waitbox_wait(&cb->wb);
  if (rc != 0)
    bench_die("core_grad_stats: %s %s", zs_err_name(rc), err);
  core_counters before, after;
  core_get_counters(cb->c, &before);
  core_apply_result ar;
  double c0 = process_cpu_s();
  double t0 = bench_now();
  rc = core_apply(cb->c, cb->hash, step, 1e-3, 1.0f, 0, on_apply, &cb->wb, &ar, err, sizeof err);
  if (rc == CORE_PENDING)
    rc = waitbox_wait(&cb->wb);
  double dt = bench_now() - t0;
  *cpu_s = process_cpu_s() - c0;
  if (rc != 0)
    bench_die("core_apply: %s %s", zs_err_name(rc), err);
  core_get_counters(cb->c, &after);
  *pass_s = after.apply_seconds_total - before.apply_seconds_total;
  return dt;
}

/* ------------------------------------------------------------ torch */

/* torch_adamw.py as a co-process: commands on `to`, answers on `from`. */
typedef struct torch_proc {
  pid_t pid;
  FILE *to, *from;
} torch_proc;

/* Starts the co-process and waits for "ready"; returns 0, or -1 (with a note)
 * if torch is not available. */
static int torch_start(torch_proc *tp, size_t n, int threads) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
    bench_die("pipe: %s", strerror(errno));
  char script[1024], params[32], thr[16];
  snprintf(script, sizeof script, "%s/tests/bench/torch_adamw.py", ZS_SOURCE_DIR);
  snprintf(params, sizeof params, "%zu", n);
  snprintf(thr, sizeof thr, "%d", threads);
  char *const argv[] = {"/usr/bin/python3", script, "--params", params, "--threads", thr, NULL};
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    /* Only async-signal-safe calls: the parent has threads. */
    dup2(in[0], 0);
    dup2(out[1], 1);
    execv(argv[0], argv);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  tp->pid = pid;
  tp->to = fdopen(in[1], "w");
  tp->from = fdopen(out[0], "r");
  if (!tp->to || !tp->from)
    bench_die("fdopen failed");
  char line[256];
  if (!fgets(line, sizeof line, tp->from) || strncmp(line, "ready", 5) != 0) {
    bench_note("torch.optim.AdamW could not be timed (/usr/bin/python3 with torch is needed)");
    fclose(tp->to);
    fclose(tp->from);
    waitpid(pid, NULL, 0);
    return -1;
  }
  return 0;
}

static double torch_step(torch_proc *tp) {
  char line[256];
  fputs("step\n", tp->to);
  fflush(tp->to);
  if (!fgets(line, sizeof line, tp->from))
    bench_die("torch_adamw.py stopped answering");
  return strtod(line, NULL);
}

static void torch_stop(torch_proc *tp) {
  fputs("quit\n", tp->to);
  fclose(tp->to);
  fclose(tp->from);
  waitpid(tp->pid, NULL, 0);
}

/* ------------------------------------------------------------ main */

static void usage(void) {
  fprintf(stderr, "usage: bench_optim [--json] [--quick] [--reps R] [--params N] [--threads T] "
                  "[--no-torch]\n");
  exit(2);
}

/* The contenders of one round, in the order they run, each right after a
 * stream pass of its own. */
enum {
  C_DIRECT, /* optim_apply, best ISA, split over the threads */
  C_SCALAR, /* 1 thread only */
  C_AVX2,   /* 1 thread only, when the best ISA is AVX-512 */
  C_CORE,   /* core_apply, call to callback */
  C_CORE_PASS /* the core's own timing of the same applies */,
  C_TORCH,
  C_COUNT
};

#define MAX_REPS 1000

/* Reports a contender's rate: the median over the rounds against the median
 * of its paired stream passes, and, as extra keys, the best round of each
 * (the round least disturbed by the machine's other tenants). t and st are
 * seconds per pass; they are sorted in place. */
static void report_rate(const bench_opts *o, const char *metric, int threads, const char *isa,
                        uint64_t n, double *t, double *st, int reps) {
  double rate = (double)n / bench_quantile(t, (size_t)reps, 0.5) / 1e9;
  double limit = (double)n / bench_quantile(st, (size_t)reps, 0.5) / 1e9;
  double best = (double)n / t[0] / 1e9, limit_best = (double)n / st[0] / 1e9;
  bench_kv kv[] = {BENCH_N("threads", threads),
                   BENCH_S("isa", isa),
                   BENCH_N("params", n),
                   BENCH_N("rounds", reps),
                   BENCH_N("best", best),
                   BENCH_N("limit_best", limit_best),
                   BENCH_N("ratio_best", best / limit_best)};
  bench_report(o, "optim", metric, rate, "Gparam/s", limit, kv, 7);
}

int main(int argc, char **argv) {
  bench_opts o;
  bench_parse_common(&argc, argv, &o);
  uint64_t n = 64ull << 20;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  int all = ncpu > 0 ? (int)(ncpu < MAX_THREADS ? ncpu : MAX_THREADS) : 1;
  int want_torch = 1;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--params") == 0 && i + 1 < argc) {
      if (bench_parse_list(argv[++i], &n, 1) != 1)
        usage();
    } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      all = atoi(argv[++i]);
      if (all < 1 || all > MAX_THREADS)
        usage();
    } else if (strcmp(argv[i], "--no-torch") == 0) {
      want_torch = 0;
    } else {
      usage();
    }
  }
  int reps = o.reps ? o.reps : (o.quick ? 3 : 7);
  if (reps > MAX_REPS)
    reps = MAX_REPS;
  int thread_counts[2] = {1, all};
  int nthreads = all > 1 ? 2 : 1;
  cpu_isa best = cpu_best_isa();
  char buf[32];
  bench_note("optimizer pass: AdamW, %" PRIu64 " parameters (%s of shard state), %d rounds, "
             "ISA %s; every round runs each contender once, each right after a stream pass",
             n, bench_bytes_str((double)n * 18, buf, sizeof buf), reps, cpu_isa_name(best));
  bench_note("bytes the fused pass must move per parameter: reads acc, master, m, v (16 B); "
             "writes master, m, v, acc (16 B) and the bf16 copy (2 B): %u B",
             STREAM_BYTES_PER_ELEM);

  arrays a = {.n = (size_t)n};
  a.master = bench_alloc(a.n * sizeof(float));
  a.m = bench_alloc(a.n * sizeof(float));
  a.v = bench_alloc(a.n * sizeof(float));
  a.acc = bench_alloc(a.n * sizeof(float));
  a.low = bench_alloc(a.n * sizeof(uint16_t));
  bench_fill_f32(a.master, a.n, 0.1f, 1);

  static double t[C_COUNT][MAX_REPS], st[C_COUNT][MAX_REPS];
  static double cpu_direct[MAX_REPS], cpu_core[MAX_REPS];
  static double all_stream[C_COUNT * MAX_REPS];
  size_t nstream = 0;
  double core_rate[2] = {0, 0}, torch_rate[2] = {0, 0};
  for (int k = 0; k < nthreads; k++) {
    int T = thread_counts[k];
    core_bench cb;
    core_bench_open(&cb, (size_t)n, T);
    torch_proc tp;
    int have_torch = want_torch && torch_start(&tp, (size_t)n, T) == 0;
    int single = T == 1;
    int have_avx2 = single && best == CPU_ISA_AVX512 && cpu_supports(CPU_ISA_AVX2);
    uint64_t step = 0;
    /* Round 0 warms every path up (page faults, thread start-up, caches) and
     * is not counted. */
    for (int r = 0; r <= reps; r++) {
      /* v: each contender's time; sv: the stream pass run right before it,
       * its own limit for this round. */
      double v[C_COUNT] = {0}, sv[C_COUNT] = {0};
      sv[C_DIRECT] = pass(K_STREAM, CPU_ISA_SCALAR, &a, T, ++step);
      v[C_DIRECT] = pass(K_OPTIM, best, &a, T, ++step);
      double direct_cpu = g_pass_cpu_s, core_cpu = 0;
      if (single) {
        sv[C_SCALAR] = pass(K_STREAM, CPU_ISA_SCALAR, &a, T, ++step);
        v[C_SCALAR] = pass(K_OPTIM, CPU_ISA_SCALAR, &a, 1, ++step);
      }
      if (have_avx2) {
        sv[C_AVX2] = pass(K_STREAM, CPU_ISA_SCALAR, &a, T, ++step);
        v[C_AVX2] = pass(K_OPTIM, CPU_ISA_AVX2, &a, 1, ++step);
      }
      sv[C_CORE] = sv[C_CORE_PASS] = pass(K_STREAM, CPU_ISA_SCALAR, &a, T, ++step);
      v[C_CORE] = core_bench_step(&cb, &v[C_CORE_PASS], &core_cpu);
      if (have_torch) {
        sv[C_TORCH] = pass(K_STREAM, CPU_ISA_SCALAR, &a, T, ++step);
        v[C_TORCH] = torch_step(&tp);
      }
      if (r > 0) {
        cpu_direct[r - 1] = direct_cpu;
        cpu_core[r - 1] = core_cpu;
      }
      if (r > 0)
        for (int c = 0; c < C_COUNT; c++) {
          t[c][r - 1] = v[c];
          st[c][r - 1] = sv[c];
          if (sv[c] > 0 && c != C_CORE_PASS)
            all_stream[nstream++] = sv[c];
        }
    }
    core_bench_close(&cb);
    if (have_torch)
      torch_stop(&tp);

    /* Medians over the rounds; each contender's limit is the median of the
     * stream passes that ran right before it, so that a burst of load from
     * the machine's other tenants moves both sides of its ratio. */
    double med[C_COUNT];
    for (int c = 0; c < C_COUNT; c++)
      med[c] = bench_quantile(t[c], (size_t)reps, 0.5);
    double stream_rate = (double)n / bench_quantile(all_stream, nstream, 0.5);
    nstream = 0;
    char metric[64];
    bench_kv kv[] = {BENCH_N("threads", T), BENCH_S("isa", cpu_isa_name(best)),
                     BENCH_N("params", n), BENCH_N("bytes_per_param", STREAM_BYTES_PER_ELEM)};
    snprintf(metric, sizeof metric, "stream_mix_%dt", T);
    bench_report(&o, "optim", metric, stream_rate * STREAM_BYTES_PER_ELEM / 1e9, "GB/s", 0, kv, 4);
    snprintf(metric, sizeof metric, "apply_direct_%s_%dt", cpu_isa_name(best), T);
    report_rate(&o, metric, T, cpu_isa_name(best), n, t[C_DIRECT], st[C_DIRECT], reps);
    if (have_avx2) {
      snprintf(metric, sizeof metric, "apply_direct_avx2_%dt", T);
      report_rate(&o, metric, T, "avx2", n, t[C_AVX2], st[C_AVX2], reps);
    }
    if (single) {
      snprintf(metric, sizeof metric, "apply_direct_scalar_%dt", T);
      report_rate(&o, metric, T, "scalar", n, t[C_SCALAR], st[C_SCALAR], reps);
      bench_report(&o, "optim", "speedup_direct_vs_scalar_1t", med[C_SCALAR] / med[C_DIRECT], "x",
                   0, kv, 2);
    }
    core_rate[k] = (double)n / med[C_CORE];
    snprintf(metric, sizeof metric, "apply_core_%dt", T);
    report_rate(&o, metric, T, cpu_isa_name(best), n, t[C_CORE], st[C_CORE], reps);
    snprintf(metric, sizeof metric, "apply_core_pass_%dt", T);
    report_rate(&o, metric, T, cpu_isa_name(best), n, t[C_CORE_PASS], st[C_CORE_PASS], reps);
    /* The core's overhead over the bare kernel in CPU time (no limit: the
     * bare kernel is the floor the core's pass adds to). */
    double cpu_c = bench_quantile(cpu_core, (size_t)reps, 0.5);
    double cpu_d = bench_quantile(cpu_direct, (size_t)reps, 0.5);
    bench_kv ckv[] = {BENCH_N("threads", T), BENCH_N("params", n), BENCH_N("core_cpu_s", cpu_c),
                      BENCH_N("direct_cpu_s", cpu_d)};
    snprintf(metric, sizeof metric, "apply_core_cpu_over_direct_%dt", T);
    bench_report(&o, "optim", metric, cpu_c / cpu_d, "x", 0, ckv, 4);
    if (have_torch) {
      torch_rate[k] = (double)n / med[C_TORCH];
      snprintf(metric, sizeof metric, "torch_adamw_%dt", T);
      report_rate(&o, metric, T, "torch", n, t[C_TORCH], st[C_TORCH], reps);
      snprintf(metric, sizeof metric, "speedup_core_vs_torch_%dt", T);
      bench_report(&o, "optim", metric, core_rate[k] / torch_rate[k], "x", 0, kv, 2);
    }
  }
  free(a.master);
  free(a.m);
  free(a.v);
  free(a.acc);
  free(a.low);
  return 0;
}
