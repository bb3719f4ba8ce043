/*
 * test_client_schedule — the order pushes and pulls go on the wire
 * (zs_client_options.schedule, client/lib/pool.c) and the data plane's TCP
 * congestion control (zs_client_options.tcp_congestion, zshard-server
 * --tcp-congestion).
 *
 * The rotated schedule, on the pool itself: pushes and pulls are admitted
 * round robin over the shards starting at the given one (the rank), at most
 * `window` of each direction until one is released, prefetches and control
 * calls never held back; the FIFO schedule admits everything at once.
 *
 * The bits: the same training (W = 3 trainer threads, N = 3 shards, split
 * tensors and whole ones, gradients that depend on the pulled parameters)
 * run with the FIFO schedule and with the rotated one (windows 1 and 2),
 * gated and pipelined, ends in bit-identical parameters on every rank. CTest
 * runs it on the data plane and again with ZSHARD_TRANSPORT=grpc.
 *
 * The congestion control: a name this kernel lacks, or one that is no name,
 * is refused by zs_client_open (ZS_EINVAL, the kernel's list in the
 * sentence) and by zshard-server (exit 2); a client and a server given an
 * algorithm other than the host's default carry it on their data-plane
 * sockets (ss -tin shows it per connection), and the host's default is
 * unchanged.
 *
 * The pacing (zs_client_options.tcp_pacing_mbit, zshard-server
 * --tcp-pacing-mbit): a client and a server given a rate carry it as their
 * data-plane sockets' SO_MAX_PACING_RATE (ss -tin shows it after the
 * socket's own pacing rate), the server logs it, and a rate over 100000
 * Mbit/s or one that is no number is refused by both.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "internal.h"
#include "trainers.h"
#include "zshard/zshard.h"

/* ---- the pool's admission order ---------------------------------------------------- */

typedef struct ran_log {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  zc_task *ran[64];
  int n;
} ran_log;

static void log_run(void *ctx, zc_task *list) {
  ran_log *r = ctx;
  pthread_mutex_lock(&r->mu);
  while (list) {
    zc_task *next = list->next;
    list->next = NULL;
    r->ran[r->n++] = list;
    list = next;
  }
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

static void log_cancel(void *ctx, zc_task *t) {
  (void)ctx;
  (void)t;
}

/* Waits (at most 10 s) until `n` tasks ran; returns how many did. */
static int wait_ran(ran_log *r, int n) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 10;
  pthread_mutex_lock(&r->mu);
  while (r->n < n && pthread_cond_timedwait(&r->cv, &r->mu, &dl) == 0)
    ;
  int got = r->n;
  pthread_mutex_unlock(&r->mu);
  return got;
}

/* An op of `n` tasks of `kind`, task i for shard i % 4 (freed with free). */
static zs_request *fake_op(zc_op_kind kind, uint32_t n) {
  zs_request *op = calloc(1, sizeof *op + n * sizeof(zc_task));
  assert_non_null(op);
  op->kind = kind;
  op->ntasks = n;
  for (uint32_t i = 0; i < n; i++) {
    op->tasks[i].op = op;
    op->tasks[i].shard = i % 4;
  }
  return op;
}

/* Orders the first two entries of v ascending. */
static void sort_pair(uint32_t *v) {
  if (v[0] > v[1]) {
    uint32_t t = v[0];
    v[0] = v[1];
    v[1] = t;
  }
}

static void rotated_schedule_admits_round_robin_from_the_rank_within_its_window(void **state) {
  (void)state;
  ran_log r = {.n = 0};
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  zc_pool p;
  assert_int_equal(zc_pool_start(&p, 4, 3, 0, 0, log_run, log_cancel, &r), ZS_OK);
  zc_pool_set_schedule(&p, 2, 2);
  zs_request *push = fake_op(ZC_OP_PUSH, 8), *pull = fake_op(ZC_OP_PULL, 4);
  zs_request *pre = fake_op(ZC_OP_PREFETCH, 4), *call = fake_op(ZC_OP_CALL, 4);
  zc_pool_hold(&p, 1);
  zc_pool_submit(&p, push->tasks, 8);
  zc_pool_submit(&p, pull->tasks, 4);
  zc_pool_submit(&p, pre->tasks, 4);
  zc_pool_submit(&p, call->tasks, 4);
  zc_pool_hold(&p, 0);
  /* Prefetches and calls all run; two pushes and two pulls are admitted. */
  assert_int_equal(wait_ran(&r, 12), 12);
  usleep(200 * 1000); /* nothing more may start without a release */
  assert_int_equal(wait_ran(&r, 12), 12);
  int npush = 0, npull = 0;
  uint32_t push_order[8], pull_order[4];
  for (int done = 0; done < 12; done++) {
    /* The oldest admitted push or pull still held gives its place back. */
    zc_task *t = NULL;
    pthread_mutex_lock(&r.mu);
    for (int i = 0; i < r.n && !t; i++)
      if (r.ran[i]->sched)
        t = r.ran[i];
    int held_push = 0, held_pull = 0;
    for (int i = 0; i < r.n; i++) {
      held_push += r.ran[i]->sched == ZC_Q_PUSH;
      held_pull += r.ran[i]->sched == ZC_Q_PULL;
    }
    pthread_mutex_unlock(&r.mu);
    assert_non_null(t);
    assert_true(held_push <= 2 && held_pull <= 2);
    if (t->op->kind == ZC_OP_PUSH)
      push_order[npush++] = t->shard;
    else
      pull_order[npull++] = t->shard;
    /* A queued one of the same direction, if any is left, takes the place. */
    int before = wait_ran(&r, 0), same = 0;
    for (int i = 0; i < before; i++)
      same += r.ran[i]->op->kind == t->op->kind;
    zc_pool_release(&p, t);
    if (same < (int)t->op->ntasks)
      assert_int_equal(wait_ran(&r, before + 1), before + 1);
  }
  assert_int_equal(npush, 8);
  assert_int_equal(npull, 4);
  /* The first two of each direction are admitted together, and which of
   * their workers logs its run first is up to the scheduler: they are
   * released in that order, so compare them as a pair. Every later one is
   * admitted alone, when one is released, and comes in round-robin order. */
  sort_pair(push_order);
  sort_pair(pull_order);
  const uint32_t want_push[8] = {2, 3, 0, 1, 2, 3, 0, 1}, want_pull[4] = {2, 3, 0, 1};
  assert_memory_equal(push_order, want_push, sizeof want_push);
  assert_memory_equal(pull_order, want_pull, sizeof want_pull);
  zc_pool_stop(&p);
  zc_pool_free(&p);
  free(push);
  free(pull);
  free(pre);
  free(call);
}

static void fifo_schedule_admits_everything_at_once(void **state) {
  (void)state;
  ran_log r = {.n = 0};
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  zc_pool p;
  assert_int_equal(zc_pool_start(&p, 4, 3, 0, 0, log_run, log_cancel, &r), ZS_OK);
  zs_request *push = fake_op(ZC_OP_PUSH, 8), *pull = fake_op(ZC_OP_PULL, 8);
  zc_pool_submit(&p, push->tasks, 8);
  zc_pool_submit(&p, pull->tasks, 8);
  assert_int_equal(wait_ran(&r, 16), 16);
  for (int i = 0; i < 16; i++)
    assert_int_equal(r.ran[i]->sched, 0);
  zc_pool_stop(&p);
  zc_pool_free(&p);
  free(push);
  free(pull);
}

/* A pool whose run of shard 0's first push stalls until nine other runs
 * were logged, as a worker preempted between taking a piece and handing it
 * on would; `others` is how many it saw. */
typedef struct stall_log {
  ran_log log;
  int others;
} stall_log;

static void stall_run(void *ctx, zc_task *list) {
  stall_log *s = ctx;
  if (list->shard == 0 && list == &list->op->tasks[0])
    s->others = wait_ran(&s->log, 9);
  log_run(&s->log, list);
}

/* The index in the log of task i of op, or -1. */
static int logged_at(ran_log *r, const zs_request *op, uint32_t i) {
  for (int k = 0; k < r->n; k++)
    if (r->ran[k] == &op->tasks[i])
      return k;
  return -1;
}

static void a_shards_pushes_are_handed_on_in_their_order_while_other_shards_go_on(void **state) {
  (void)state;
  stall_log s = {.log = {.n = 0}};
  pthread_mutex_init(&s.log.mu, NULL);
  pthread_cond_init(&s.log.cv, NULL);
  zc_pool p;
  assert_int_equal(zc_pool_start(&p, 4, 3, 0, 0, stall_run, log_cancel, &s), ZS_OK);
  zc_pool_order_pushes(&p, 1);
  /* Shard 0 gets tasks 0, 4 and 8; shards 1 to 3 the nine others. */
  zs_request *push = fake_op(ZC_OP_PUSH, 12);
  zc_pool_submit(&p, push->tasks, 12);
  assert_int_equal(wait_ran(&s.log, 12), 12);
  /* Every other shard's push ran while shard 0's first was held up ... */
  assert_int_equal(s.others, 9);
  /* ... and shard 0's came after it, in their order, although two workers
   * were free to take them meanwhile. */
  int at0 = logged_at(&s.log, push, 0), at4 = logged_at(&s.log, push, 4),
      at8 = logged_at(&s.log, push, 8);
  assert_true(at0 >= 0 && at0 < at4 && at4 < at8);
  zc_pool_stop(&p);
  zc_pool_free(&p);
  free(push);
}

/* ---- the bits of every schedule ----------------------------------------------------- */

#define NT 4
#define W 3
#define N 3
#define K 4
#define SPLIT 64

static const uint64_t NUMEL[NT] = {300, 37, 130, 64};

typedef struct run_cfg {
  char addrs[256];
  int pipelined;
  zs_schedule schedule;
  uint32_t window;
  char job[32];
} run_cfg;

/* A rank's status and final parameters. */
typedef tr_report rank_out;
_Static_assert(NT <= TR_MAX_TENSORS, "the report holds every tensor");

static int trainer_open(const run_cfg *cfg, uint32_t rank, zs_client **out) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cfg->addrs;
  o.rank = rank;
  o.world_size = W;
  o.job = cfg->job;
  o.split_threshold = SPLIT;
  o.push_dtype = ZS_DTYPE_BF16;
  o.pipelined = (uint32_t)cfg->pipelined;
  o.schedule = cfg->schedule;
  o.schedule_window = cfg->window;
  int rc = zs_client_open(&o, out);
  zs_group_options go;
  zs_group_options_init(&go, ZS_OPTIM_ADAMW);
  if (rc == ZS_OK)
    rc = zs_add_group(*out, &go, NULL);
  for (uint32_t t = 0; rc == ZS_OK && t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    rc = zs_add_tensor(*out, name, NUMEL[t], 0, NULL, 0, NULL);
  }
  return rc;
}

static int pull_all(zs_client *c, float **dst) {
  uint32_t ids[NT];
  size_t nbytes[NT];
  for (uint32_t t = 0; t < NT; t++) {
    ids[t] = t;
    nbytes[t] = NUMEL[t] * sizeof(float);
  }
  return zs_pull_many(c, NT, ids, (void *const *)dst, ZS_DTYPE_FP32, nbytes, NULL);
}

/* Gradients from the pulled parameters, pushed without waiting, the step,
 * then the pushes' outcomes. */
static int trainer_step(zs_client *c, uint32_t rank, uint64_t s, float **param, float **grad) {
  uint32_t ids[NT];
  size_t nbytes[NT];
  zs_request *reqs[NT];
  for (uint32_t t = 0; t < NT; t++) {
    ids[t] = t;
    nbytes[t] = NUMEL[t] * sizeof(float);
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      grad[t][i] = 0.5f * param[t][i] + 0.01f * tr_noise(s, rank, 0, t, i) + 0.001f;
  }
  int rc = zs_push_many(c, NT, ids, 0, (const void *const *)grad, ZS_DTYPE_FP32, nbytes, reqs);
  if (rc != ZS_OK)
    return rc;
  rc = zs_step(c, 1e-2 * (1.0 + 0.25 * (double)s), 0, 0, NULL);
  for (uint32_t t = 0; t < NT; t++) {
    int r = zs_wait(reqs[t]);
    if (rc == ZS_OK)
      rc = r;
  }
  return rc;
}

static void *trainer_main(void *p) {
  const tr_trainer *a = p;
  const run_cfg *cfg = a->cfg;
  rank_out *out = a->out;
  float *param[NT], *grad[NT], *init[NT];
  for (uint32_t t = 0; t < NT; t++) {
    param[t] = calloc(NUMEL[t], sizeof(float));
    grad[t] = calloc(NUMEL[t], sizeof(float));
    init[t] = calloc(NUMEL[t], sizeof(float));
    out->final[t] = calloc(NUMEL[t], sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      init[t][i] = (float)sin(0.37 * (double)(i + 1) + 1.3 * t) * 0.5f;
  }
  zs_client *c = NULL;
  int rc = trainer_open(cfg, a->rank, &c);
  if (rc == ZS_OK)
    rc = zs_open_job(c, (const float *const *)init);
  const char *what = "open";
  for (uint64_t s = 1; rc == ZS_OK && s <= K; s++) {
    what = "pull";
    if ((rc = pull_all(c, param)) == ZS_OK) {
      what = "step";
      rc = trainer_step(c, a->rank, s, param, grad);
    }
  }
  if (rc == ZS_OK) {
    what = "final pull";
    rc = pull_all(c, out->final);
  }
  if (rc != ZS_OK) {
    out->rc = rc;
    snprintf(out->err, sizeof out->err, "%s: %s (%s)", what, zs_strerror(rc), zs_last_error());
  }
  zs_client_close(c);
  for (uint32_t t = 0; t < NT; t++) {
    free(param[t]);
    free(grad[t]);
    free(init[t]);
  }
  return NULL;
}

/* Trains job `job` on a fresh cluster (a shard holds one job); outs[r].final
 * gets rank r's parameters. */
static void train(const char *job, int pipelined, zs_schedule schedule, uint32_t window,
                  rank_out *outs) {
  hs_cluster cl;
  run_cfg cfg = {.pipelined = pipelined, .schedule = schedule, .window = window};
  snprintf(cfg.job, sizeof cfg.job, "%s", job);
  tr_cluster_up(&cl, N, NULL, cfg.addrs, sizeof cfg.addrs);
  tr_run_trainers(W, trainer_main, &cfg, outs, sizeof *outs);
  char what[64];
  snprintf(what, sizeof what, "job %s", job);
  tr_reports_check(outs, W, what);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

static void every_schedule_trains_to_the_same_bits(void **state) {
  (void)state;
  for (int pipelined = 0; pipelined <= 1; pipelined++) {
    rank_out fifo[W], rot1[W], rot2[W];
    train("sched", pipelined, ZS_SCHEDULE_FIFO, 0, fifo);
    train("sched", pipelined, ZS_SCHEDULE_ROTATED, 1, rot1);
    train("sched", pipelined, ZS_SCHEDULE_ROTATED, 2, rot2);
    for (uint32_t r = 0; r < W; r++) {
      for (uint32_t t = 0; t < NT; t++) {
        size_t n = NUMEL[t] * sizeof(float);
        if (memcmp(fifo[r].final[t], fifo[0].final[t], n) != 0 ||
            memcmp(rot1[r].final[t], fifo[r].final[t], n) != 0 ||
            memcmp(rot2[r].final[t], fifo[r].final[t], n) != 0)
          fail_msg("%s: tensor %u differs (rank %u) between the schedules",
                   pipelined ? "pipelined" : "gated", t, r);
        /* And training moved them. */
        assert_true(fifo[r].final[t][1] != (float)sin(0.37 * 2 + 1.3 * t) * 0.5f);
      }
    }
    tr_reports_free(fifo, W, NT);
    tr_reports_free(rot1, W, NT);
    tr_reports_free(rot2, W, NT);
  }
}

static void a_bad_schedule_is_refused(void **state) {
  (void)state;
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.schedule = (zs_schedule)7;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  o.schedule = ZS_SCHEDULE_ROTATED;
  o.schedule_window = 65;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "schedule_window"));
  o.schedule = ZS_SCHEDULE_DEFAULT;
  o.schedule_window = 0;
  setenv("ZSHARD_SCHEDULE", "zigzag", 1);
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "ZSHARD_SCHEDULE"));
  unsetenv("ZSHARD_SCHEDULE");
}

/* ---- TCP congestion control ------------------------------------------------------------ */

static void read_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  assert_non_null(fgets(buf, (int)len, f));
  fclose(f);
  buf[strcspn(buf, "\n")] = '\0';
}

/* An algorithm this kernel offers other than the host's default, into buf
 * (reno is built into every Linux; the default may be it). */
static void other_algorithm(char *buf, size_t len) {
  char def[64], avail[256];
  read_line("/proc/sys/net/ipv4/tcp_congestion_control", def, sizeof def);
  read_line("/proc/sys/net/ipv4/tcp_available_congestion_control", avail, sizeof avail);
  buf[0] = '\0';
  for (char *save = NULL, *tok = strtok_r(avail, " ", &save); tok; tok = strtok_r(NULL, " ", &save))
    if (strcmp(tok, def) != 0 && !buf[0])
      snprintf(buf, len, "%s", tok);
  if (!buf[0])
    fail_msg("the kernel offers only '%s': no other congestion control to tell apart", def);
}

/* How many established TCP sockets of process `pid` have an info line
 * (ss -tinp: one line per socket, then its info line) that `match`es, and
 * how many it has in all. */
static void count_sockets_where(pid_t pid, int (*match)(char *info, const void *arg),
                                const void *arg, int *with, int *all) {
  char line[4096], want[32];
  snprintf(want, sizeof want, "pid=%d,", (int)pid);
  FILE *f = popen("ss -Htinp state established 2>/dev/null", "r");
  assert_non_null(f);
  *with = *all = 0;
  int mine = 0;
  while (fgets(line, sizeof line, f)) {
    if (line[0] != ' ' && line[0] != '\t') {
      mine = strstr(line, want) != NULL;
      continue;
    }
    if (!mine)
      continue;
    (*all)++;
    *with += match(line, arg) != 0;
    mine = 0;
  }
  pclose(f);
}

/* The info line starts with the congestion control's name: a word of its
 * own ("reno", not "bbr:(...)"), after the options (ts, sack, ecn) when
 * there are any. */
static int uses_cc(char *info, const void *arg) {
  int found = 0;
  for (char *save = NULL, *tok = strtok_r(info, " \t\n", &save); tok && !found;
       tok = strtok_r(NULL, " \t\n", &save))
    found = strcmp(tok, (const char *)arg) == 0;
  return found;
}

/* How many established TCP sockets of process `pid` use congestion control
 * `cc`, and how many it has in all. */
static void count_sockets(pid_t pid, const char *cc, int *with, int *all) {
  count_sockets_where(pid, uses_cc, cc, with, all);
}

static void tcp_congestion_reaches_the_data_plane_sockets(void **state) {
  (void)state;
  char cc[32], def_before[64], def_after[64];
  other_algorithm(cc, sizeof cc);
  read_line("/proc/sys/net/ipv4/tcp_congestion_control", def_before, sizeof def_before);
  const char *extra[] = {"--tcp-congestion", cc, NULL};
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 1, extra), 0);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cl.srv[0]->addr;
  o.transport = ZS_TRANSPORT_DATA;
  o.tcp_congestion = cc;
  o.data_connections = 2;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_add_tensor(c, "w", 1000, 0, NULL, 0, NULL), ZS_OK);
  float w[1000] = {0};
  const float *init[1] = {w};
  assert_int_equal(zs_open_job(c, init), ZS_OK);
  assert_int_equal(zs_pull(c, 0, w, ZS_DTYPE_FP32, sizeof w, NULL), ZS_OK);
  int with = 0, all = 0;
  /* The client's data connections (2) carry it; its gRPC channel does not. */
  count_sockets(getpid(), cc, &with, &all);
  if (with != 2)
    fail_msg("client: %d of %d sockets use %s, want the 2 data-plane ones", with, all, cc);
  assert_true(all > with);
  count_sockets(cl.srv[0]->pid, cc, &with, &all);
  if (with != 2)
    fail_msg("server: %d of %d sockets use %s, want the 2 data-plane ones", with, all, cc);
  zs_client_close(c);
  read_line("/proc/sys/net/ipv4/tcp_congestion_control", def_after, sizeof def_after);
  assert_string_equal(def_before, def_after);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* ss -tin writes "pacing_rate <now>bps/<cap>bps" for a socket with a cap:
 * whether the cap of that very rate is *arg bits per second. */
static int capped_at(char *info, const void *arg) {
  char cap[48];
  snprintf(cap, sizeof cap, "/%" PRIu64 "bps ", *(const uint64_t *)arg);
  const char *p = strstr(info, "pacing_rate ");
  const char *sp = p ? strchr(p + strlen("pacing_rate "), ' ') : NULL;
  const char *c = p ? strstr(p, cap) : NULL;
  return c && sp && c + strlen(cap) - 1 == sp;
}

/* How many established TCP sockets of process `pid` have their pacing capped
 * at `bps` bits per second, and how many it has in all. */
static void count_paced(pid_t pid, uint64_t bps, int *with, int *all) {
  count_sockets_where(pid, capped_at, &bps, with, all);
}

static int file_has(const char *path, const char *needle) {
  char buf[16384];
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

static void tcp_pacing_reaches_the_data_plane_sockets(void **state) {
  (void)state;
  const char *extra[] = {"--tcp-pacing-mbit", "60", NULL};
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 1, extra), 0);
  assert_true(file_has(cl.srv[0]->log_path, "pacing_mbit=60"));
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = cl.srv[0]->addr;
  o.transport = ZS_TRANSPORT_DATA;
  o.tcp_pacing_mbit = 40;
  o.data_connections = 2;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  assert_int_equal(zs_add_tensor(c, "w", 1000, 0, NULL, 0, NULL), ZS_OK);
  float w[1000] = {0};
  const float *init[1] = {w};
  assert_int_equal(zs_open_job(c, init), ZS_OK);
  assert_int_equal(zs_pull(c, 0, w, ZS_DTYPE_FP32, sizeof w, NULL), ZS_OK);
  int with = 0, all = 0;
  /* The client's data connections (2) carry 40 Mbit/s; its gRPC channel is
   * not paced. */
  count_paced(getpid(), 40000000u, &with, &all);
  if (with != 2)
    fail_msg("client: %d of %d sockets paced at 40 Mbit/s, want the 2 data-plane ones", with, all);
  assert_true(all > with);
  count_paced(cl.srv[0]->pid, 60000000u, &with, &all);
  if (with != 2)
    fail_msg("server: %d of %d sockets paced at 60 Mbit/s, want the 2 data-plane ones", with, all);
  zs_client_close(c);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* zshard-server with `flag value`: its exit status, its output in out. */
static int run_server(const char *flag, const char *value, char *out, size_t cap) {
  const char *bin = getenv("ZSHARD_SERVER_BIN");
  assert_non_null(bin);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' --listen 127.0.0.1:0 %s '%s' 2>&1", bin, flag, value);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  size_t n = fread(out, 1, cap - 1, f);
  out[n] = '\0';
  int status = pclose(f);
  assert_true(WIFEXITED(status));
  return WEXITSTATUS(status);
}

static void a_bad_pacing_rate_is_refused(void **state) {
  (void)state;
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.tcp_pacing_mbit = 100001;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  assert_non_null(strstr(zs_last_error(), "tcp_pacing_mbit is 100001"));
  o.tcp_pacing_mbit = 0;
  const char *bad[] = {"fast", "-5", "100001", " 60", "1e3"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("ZSHARD_TCP_PACING_MBIT", bad[i], 1);
    assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
    assert_null(c);
    assert_non_null(strstr(zs_last_error(), "ZSHARD_TCP_PACING_MBIT must be a whole number"));
  }
  unsetenv("ZSHARD_TCP_PACING_MBIT");

  /* The server: a usage error naming the flag, before it listens. */
  char out[2048];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(run_server("--tcp-pacing-mbit", bad[i], out, sizeof out), 2);
    if (!strstr(out, "--tcp-pacing-mbit (ZSHARD_TCP_PACING_MBIT) must be a whole number"))
      fail_msg("'%s': %s", bad[i], out);
  }
}

static void an_unknown_congestion_control_is_refused(void **state) {
  (void)state;
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = "127.0.0.1:1";
  o.tcp_congestion = "nosuchcc";
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_null(c);
  assert_non_null(strstr(zs_last_error(), "not available in this kernel"));
  assert_non_null(strstr(zs_last_error(), "reno")); /* the kernel's list */
  o.tcp_congestion = "cu bic;";
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "not a congestion control's name"));
  o.tcp_congestion = NULL;
  setenv("ZSHARD_TCP_CONGESTION", "nosuchcc", 1);
  assert_int_equal(zs_client_open(&o, &c), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "ZSHARD_TCP_CONGESTION"));
  unsetenv("ZSHARD_TCP_CONGESTION");

  /* The server: a usage error naming the flag, before it listens. */
  const char *bin = getenv("ZSHARD_SERVER_BIN");
  assert_non_null(bin);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' --listen 127.0.0.1:0 --tcp-congestion nosuchcc 2>&1", bin);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  char out[2048];
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  int status = pclose(f);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 2);
  assert_non_null(strstr(out, "--tcp-congestion"));
  assert_non_null(strstr(out, "not available in this kernel"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(rotated_schedule_admits_round_robin_from_the_rank_within_its_window),
      cmocka_unit_test(fifo_schedule_admits_everything_at_once),
      cmocka_unit_test(a_shards_pushes_are_handed_on_in_their_order_while_other_shards_go_on),
      cmocka_unit_test(a_bad_schedule_is_refused),
      cmocka_unit_test(an_unknown_congestion_control_is_refused),
      cmocka_unit_test(tcp_congestion_reaches_the_data_plane_sockets),
      cmocka_unit_test(a_bad_pacing_rate_is_refused),
      cmocka_unit_test(tcp_pacing_reaches_the_data_plane_sockets),
      cmocka_unit_test(every_schedule_trains_to_the_same_bits),
  };
  return TR_RUN_TESTS(tests);
}
