/*
 * test_client_failover — a trainer on replicated shards (docs/CLIENT.md,
 * "Replica sets and failover"; REPLICA.md's contract) loses a primary to
 * SIGKILL in the middle of a step and carries on: the client finds the
 * backup, promotes it after failover_ms, retries the call in flight there,
 * and the run ends with weights bit-identical to an uninterrupted run on
 * shards that are not replicated.
 *
 * Two shards of two members each, real zshard-server processes on
 * 127.0.0.1. A member's --replicas must name every member's gRPC port before
 * any of them starts, so the ports are picked by binding port 0 and
 * releasing it (the harness still reads each server's port back from its
 * port file). The kill points are places in the trainer's loop: during the
 * pushes, between the pushes and zs_step (GradStats and Apply meet the dead
 * primary), and before the pulls; a backup killed during the pushes; a
 * killed primary that restarts, rejoins and takes over again when its
 * replacement is killed; and a fresh set whose first member is down before
 * the job opens.
 * A kill happens at the first kill point from its step on at which every set
 * has its backup in sync (GetInfo), the state a failover needs; a backup
 * joins with a copy made at an applied step, so training goes on meanwhile.
 * Nothing is timed.
 *
 * CTest runs the program on the data plane and again over gRPC alone.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/base/clock.h"
#include "harness.h"
#include "zshard/zshard.h"

#define NSHARDS 2u
#define NREP 2u
#define NT 4u
#define STEPS 16u
/* The client's and the servers' failover_ms: short, so that a test takes
 * seconds. */
#define FAILOVER_MS "800"
/* Between steps while the sets have not settled: room for the servers'
 * monitors (every 250 ms) to ask for their joins, which complete at the
 * next applied step. Not a wait for a condition: training goes on. */
#define PACE_US 100000

static const uint64_t NUMEL[NT] = {3000, 700, 5000, 33};

/* ---- the replicated cluster --------------------------------------------------- */

typedef struct rcluster {
  int port[NSHARDS][NREP];
  hs_server *srv[NSHARDS][NREP]; /* NULL once stopped */
  char list[512];                /* the client's address list */
} rcluster;

/* The first port of the kernel's ephemeral range (the ports port-0 binds
 * and outgoing connections take), 32768 if unreadable. */
static int ephemeral_low(void) {
  int lo = 32768, hi = 60999;
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f) {
    if (fscanf(f, "%d %d", &lo, &hi) != 2)
      lo = 32768;
    fclose(f);
  }
  return lo;
}

/* n distinct free ports of 127.0.0.1: every socket is held until all are
 * bound, so none is handed out twice. They are drawn below the ephemeral
 * range, so that no server's data plane (on port 0) and no client
 * connection can take one between its release and its member's bind. */
static void free_ports(int *ports, int n) {
  int fd[NSHARDS * NREP];
  int lo = ephemeral_low(), first = lo > 12000 ? 10000 : 1024;
  assert_true(lo > first + 100);
  srand((unsigned)getpid() ^ (unsigned)clock_now_ns());
  for (int i = 0, tries = 0; i < n; tries++) {
    assert_true(tries < 1000);
    int port = first + rand() % (lo - first);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd[i] = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd[i] >= 0);
    if (bind(fd[i], (struct sockaddr *)&a, sizeof a) != 0) {
      close(fd[i]);
      continue;
    }
    ports[i++] = port;
  }
  for (int i = 0; i < n; i++)
    close(fd[i]);
}

/* Starts member k of shard i (again, after a kill: same flags, same port). */
static void start_member(rcluster *rc, uint32_t i, uint32_t k) {
  char replicas[128], listen[32], sid[12], nsh[12], idx[12];
  snprintf(replicas, sizeof replicas, "127.0.0.1:%d|127.0.0.1:%d", rc->port[i][0], rc->port[i][1]);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", rc->port[i][k]);
  snprintf(sid, sizeof sid, "%" PRIu32, i);
  snprintf(nsh, sizeof nsh, "%u", NSHARDS);
  snprintf(idx, sizeof idx, "%" PRIu32, k);
  const char *args[] = {
      "--listen",      listen,      "--shard-id", sid,      "--shards",        nsh,
      "--threads",     "1",         "--replicas", replicas, "--replica-index", idx,
      "--failover-ms", FAILOVER_MS, NULL};
  if (rc->srv[i][k])
    hs_stop(rc->srv[i][k]); /* a killed one: reaped, freed */
  rc->srv[i][k] = hs_start(args, NULL);
  assert_non_null(rc->srv[i][k]);
  assert_int_equal(rc->srv[i][k]->port, rc->port[i][k]);
}

static void rcluster_start(rcluster *rc) {
  int ports[NSHARDS * NREP];
  free_ports(ports, (int)(NSHARDS * NREP));
  size_t off = 0;
  for (uint32_t i = 0; i < NSHARDS; i++)
    for (uint32_t k = 0; k < NREP; k++) {
      rc->port[i][k] = ports[i * NREP + k];
      off += (size_t)snprintf(rc->list + off, sizeof rc->list - off, "%s127.0.0.1:%d",
                              k ? "|" : (i ? "," : ""), rc->port[i][k]);
    }
  for (uint32_t i = 0; i < NSHARDS; i++)
    for (uint32_t k = 0; k < NREP; k++)
      start_member(rc, i, k);
}

static void rcluster_stop(rcluster *rc) {
  for (uint32_t i = 0; i < NSHARDS; i++)
    for (uint32_t k = 0; k < NREP; k++)
      if (rc->srv[i][k]) {
        hs_stop(rc->srv[i][k]);
        rc->srv[i][k] = NULL;
      }
}

/* GetInfo.replica of member k of shard i: its role, or -1 when it does not
 * answer (or answers without a replica set); its term in *term and, when
 * it is the primary, in *in_sync a bit per member it forwards every write
 * to (both may be NULL). */
static int member_view(const rcluster *rc, uint32_t i, uint32_t k, uint64_t *term,
                       uint32_t *in_sync) {
  rpc_channel *ch = NULL;
  Zshard__V1__GetInfoResponse *r = NULL;
  int role = -1;
  if (rpc_channel_open(rc->srv[i][k]->addr, &ch) != 0)
    return -1;
  if (hs_get_info(ch, &r, NULL) == 0) {
    if (r->replica) {
      role = (int)r->replica->role;
      if (term)
        *term = r->replica->term;
      for (size_t m = 0; in_sync && m < r->replica->n_members; m++)
        if (r->replica->members[m]->in_sync && r->replica->members[m]->index < 32)
          *in_sync |= 1u << r->replica->members[m]->index;
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
  }
  rpc_channel_close(ch);
  return role;
}

static int member_role(const rcluster *rc, uint32_t i, uint32_t k, uint64_t *term) {
  return member_view(rc, i, k, term, NULL);
}

/* 1 when every set has one PRIMARY and every other live member is a
 * BACKUP that the primary counts in sync: the state a failover needs. */
static int settled(const rcluster *rc) {
  for (uint32_t i = 0; i < NSHARDS; i++) {
    int primaries = 0, backups = 0, live = 0;
    uint32_t in_sync = 0, is_backup = 0;
    for (uint32_t k = 0; k < NREP; k++) {
      if (!rc->srv[i][k] || rc->srv[i][k]->pid == 0)
        continue;
      live++;
      uint32_t view = 0;
      int role = member_view(rc, i, k, NULL, &view);
      if (role == ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_PRIMARY) {
        primaries++;
        in_sync = view;
      } else if (role == ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_BACKUP) {
        backups++;
        is_backup |= 1u << k;
      }
    }
    if (primaries != 1 || primaries + backups != live || (in_sync & is_backup) != is_backup)
      return 0;
  }
  return 1;
}

/* The member of shard i that is primary now, or -1. */
static int primary_of(const rcluster *rc, uint32_t i) {
  for (uint32_t k = 0; k < NREP; k++)
    if (rc->srv[i][k] &&
        member_role(rc, i, k, NULL) == ZSHARD__V1__REPLICA_ROLE__REPLICA_ROLE_PRIMARY)
      return (int)k;
  return -1;
}

/* ---- the trainer ---------------------------------------------------------------- */

typedef enum kill_point {
  KILL_NONE = 0,
  KILL_PRIMARY_MID_PUSH,
  KILL_PRIMARY_BEFORE_STEP,
  KILL_PRIMARY_BEFORE_PULL,
  KILL_BACKUP_MID_PUSH,
  /* The primary before the pulls; once the failover is done it restarts
   * and rejoins, and then the new primary is killed before the pulls. */
  KILL_PRIMARY_TWICE,
  /* Member 0 before the job opens: a fresh set whose first member is down. */
  KILL_MEMBER0_BEFORE_OPEN,
} kill_point;

typedef struct run {
  rcluster *rc; /* NULL: the reference on shards that are not replicated */
  const char *addresses;
  const char *job;
  kill_point when;
  uint32_t kill_step;
  uint32_t victim_shard;
  int armed; /* the sets settled: the kill point fires */
  int killed;
  int phase;        /* KILL_PRIMARY_TWICE: 0 first kill, 1 restart, 2 second kill */
  int dead;         /* KILL_PRIMARY_TWICE: the member killed first */
  uint64_t kill_ms; /* clock_now_ms() at the kill, until the step completes */
  float *final[NT]; /* out: version STEPS, owned */
  uint64_t retries; /* out: the calls retried over the run's steps */
} run;

static float grad_value(uint32_t s, uint32_t t, uint64_t i, float w) {
  return 0.05f * sinf(0.013f * (float)i + 0.37f * (float)s + (float)t) + 0.01f * w;
}

/* SIGKILLs the victim the kill point names: the primary (or the backup) of
 * the victim shard, as the set says now. */
static int kill_victim(run *r) {
  rcluster *rc = r->rc;
  uint32_t i = r->victim_shard;
  int p = primary_of(rc, i);
  assert_true(p >= 0);
  int k = r->when == KILL_BACKUP_MID_PUSH ? (int)(NREP - 1) - p : p;
  hs_signal(rc->srv[i][k], SIGKILL);
  /* Reaped here (its sockets closed when it died), freed by hs_stop. */
  waitpid(rc->srv[i][k]->pid, NULL, 0);
  rc->srv[i][k]->pid = 0;
  return k;
}

static void maybe_kill(run *r, kill_point here) {
  if (r->when == KILL_PRIMARY_TWICE && here == KILL_PRIMARY_BEFORE_PULL && r->armed) {
    r->dead = kill_victim(r);
    r->kill_ms = clock_now_ms();
    r->armed = 0;
    r->killed = r->phase == 2;
    r->phase++;
    return;
  }
  if (r->armed && r->when == here && !r->killed) {
    kill_victim(r);
    r->killed = 1;
    r->kill_ms = clock_now_ms();
  }
}

/* At the start of step s: the kill is armed from kill_step on, once every
 * set settled (checked with GetInfo; until then the trainer paces itself so
 * the joins can complete while it trains). */
static void arm(run *r, uint32_t s) {
  if (!r->rc || r->when == KILL_NONE || r->killed || r->armed || s < r->kill_step)
    return;
  if (r->phase == 1) {
    /* The step after the first kill completed: the killed member comes
     * back, empty, and must rejoin before the second kill. */
    start_member(r->rc, r->victim_shard, (uint32_t)r->dead);
    r->phase = 2;
  }
  r->armed = settled(r->rc);
  if (!r->armed)
    usleep(PACE_US);
}

static zs_client *open_client(const run *r) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = r->addresses;
  o.job = r->job;
  o.split_threshold = 1024;
  o.failover_ms = (uint32_t)atoi(FAILOVER_MS);
  o.max_retries = 60;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 500;
  o.rpc_timeout_ms = 20000;
  o.step_timeout_ms = 30000;
  zs_client *c = NULL;
  if (zs_client_open(&o, &c) != ZS_OK)
    fail_msg("zs_client_open: %s", zs_last_error());
  char name[8];
  for (uint32_t t = 0; t < NT; t++) {
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], 0, NULL, 0, NULL), ZS_OK);
  }
  return c;
}

static void check(int rc, const char *what, uint32_t s) {
  if (rc != ZS_OK)
    fail_msg("%s of step %" PRIu32 ": %s: %s", what, s, zs_err_name(rc), zs_last_error());
}

static void train(run *r) {
  zs_client *c = open_client(r);
  float *w[NT], *g[NT];
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = malloc(NUMEL[t] * sizeof(float));
    g[t] = malloc(NUMEL[t] * sizeof(float));
    assert_non_null(w[t]);
    assert_non_null(g[t]);
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = 0.02f * cosf(0.7f * (float)i + (float)t);
  }
  if (r->rc && r->when == KILL_MEMBER0_BEFORE_OPEN) {
    rcluster *rc = r->rc;
    hs_server *m0 = rc->srv[r->victim_shard][0];
    hs_signal(m0, SIGKILL);
    waitpid(m0->pid, NULL, 0);
    m0->pid = 0;
    r->killed = 1;
  }
  check(zs_open_job(c, (const float *const *)w), "zs_open_job", 0);
  for (uint32_t s = 1; s <= STEPS; s++) {
    arm(r, s);
    maybe_kill(r, KILL_PRIMARY_BEFORE_PULL);
    for (uint32_t t = 0; t < NT; t++)
      check(zs_pull(c, t, w[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), "zs_pull", s);
    for (uint32_t t = 0; t < NT; t++) {
      if (t == NT / 2) {
        maybe_kill(r, KILL_PRIMARY_MID_PUSH);
        maybe_kill(r, KILL_BACKUP_MID_PUSH);
      }
      for (uint64_t i = 0; i < NUMEL[t]; i++)
        g[t][i] = grad_value(s, t, i, w[t][i]);
      check(zs_push(c, t, 0, g[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), "zs_push", s);
    }
    maybe_kill(r, KILL_PRIMARY_BEFORE_STEP);
    check(zs_step(c, 0.01, 0, 0, NULL), "zs_step", s);
    if (r->kill_ms) {
      /* For the log: how long the step that met the kill took after it. */
      print_message("killed at step %" PRIu32 "; the step completed %" PRIu64 " ms later\n", s,
                    clock_now_ms() - r->kill_ms);
      r->kill_ms = 0;
    }
    zs_timing tm;
    memset(&tm, 0, sizeof tm);
    if (zs_last_timing(c, &tm) == ZS_OK)
      r->retries += tm.retries;
  }
  if (r->when != KILL_NONE && !r->killed)
    fail_msg("the replica sets never settled (one primary, its backup in sync) in %u steps", STEPS);
  for (uint32_t t = 0; t < NT; t++) {
    r->final[t] = w[t];
    check(zs_pull(c, t, w[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), "the last zs_pull",
          STEPS + 1);
    free(g[t]);
  }
  assert_int_equal(zs_client_close(c), ZS_OK);
}

/* ---- the reference ----------------------------------------------------------------- */

/* The uninterrupted run's weights, on two shards that are not replicated. */
static float *reference[NT];

static int group_setup(void **state) {
  (void)state;
  if (hs_init() != 0)
    return -1;
  hs_cluster cl;
  if (hs_cluster_start(&cl, NSHARDS, NULL) != 0)
    return -1;
  char list[128];
  snprintf(list, sizeof list, "%s,%s", cl.srv[0]->addr, cl.srv[1]->addr);
  run r = {.addresses = list, .job = "failover-ref"};
  train(&r);
  for (uint32_t t = 0; t < NT; t++)
    reference[t] = r.final[t];
  return hs_cluster_stop(&cl) == 0 ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  for (uint32_t t = 0; t < NT; t++)
    free(reference[t]);
  return 0;
}

/* Runs `when` at step kill_step on a fresh replicated cluster and checks the
 * bits against the reference. Returns the run (weights freed) for more
 * checks; the cluster is left running in *rc. */
static run replicated_run(rcluster *rc, kill_point when, uint32_t kill_step, uint32_t victim) {
  memset(rc, 0, sizeof *rc);
  rcluster_start(rc);
  run r = {.rc = rc,
           .addresses = rc->list,
           .job = "failover",
           .when = when,
           .kill_step = kill_step,
           .victim_shard = victim};
  train(&r);
  for (uint32_t t = 0; t < NT; t++) {
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      if (memcmp(&r.final[t][i], &reference[t][i], sizeof(float)) != 0)
        fail_msg("tensor %" PRIu32 " element %" PRIu64 ": %.9g after the failover, %.9g "
                 "uninterrupted",
                 t, i, (double)r.final[t][i], (double)reference[t][i]);
    free(r.final[t]);
    r.final[t] = NULL;
  }
  return r;
}

/* ---- tests ------------------------------------------------------------------------ */

static void replicated_shards_train_to_the_bits_of_unreplicated_ones(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_NONE, 0, 0);
  rcluster_stop(&rc);
}

/* `zshard status --json` over the list: the killed member UNREACHABLE, the
 * other PRIMARY at a term above the first. */
static void status_shows_the_new_primary(const rcluster *rc, uint32_t i) {
  char cmd[1024], out[8192];
  snprintf(cmd, sizeof cmd, "%s status --json --sample-ms 0 --timeout-ms 2000 --shards '%s'",
           ZSHARD_CLI_BIN, rc->list);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  assert_int_equal(WEXITSTATUS(pclose(f)), 1); /* a member is down */
  int p = primary_of(rc, i);
  assert_true(p >= 0);
  uint64_t term = 0;
  member_role(rc, i, (uint32_t)p, &term);
  assert_true(term >= 2);
  char want[128];
  snprintf(want, sizeof want, "\"member\":%d,\"members\":2,\"role\":\"PRIMARY\",\"term\":%" PRIu64,
           p, term);
  if (!strstr(out, want))
    fail_msg("zshard status lacks '%s': %s", want, out);
  if (!strstr(out, "\"health\":\"UNREACHABLE\",\"member\""))
    fail_msg("zshard status does not show the killed member unreachable: %s", out);
}

static void a_primary_killed_during_the_pushes_fails_over_and_loses_nothing(void **state) {
  (void)state;
  rcluster rc;
  run r = replicated_run(&rc, KILL_PRIMARY_MID_PUSH, 3, 0);
  /* The pushes after the kill met the dead primary and were retried. */
  assert_true(r.retries > 0);
  status_shows_the_new_primary(&rc, 0);
  rcluster_stop(&rc);
}

static void a_primary_killed_before_the_step_fails_over_gradstats_and_apply(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_PRIMARY_BEFORE_STEP, 4, 1);
  rcluster_stop(&rc);
}

static void a_primary_killed_before_the_pulls_fails_over_the_pulls(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_PRIMARY_BEFORE_PULL, 5, 0);
  rcluster_stop(&rc);
}

/* The old primary restarts, rejoins as a backup while training goes on, and
 * takes over again when the primary that replaced it is killed in turn. */
static void a_restarted_primary_rejoins_and_takes_over_at_the_next_failover(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_PRIMARY_TWICE, 3, 0);
  int p = primary_of(&rc, 0);
  uint64_t term = 0;
  assert_true(p >= 0);
  member_role(&rc, 0, (uint32_t)p, &term);
  assert_true(term >= 3);
  rcluster_stop(&rc);
}

/* A fresh set (every member STARTING) whose first member is down: the
 * client promotes the second at once, without waiting failover_ms for a
 * primary that never was. */
static void a_fresh_set_without_its_first_member_promotes_the_second(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_MEMBER0_BEFORE_OPEN, 0, 1);
  assert_int_equal(primary_of(&rc, 1), 1);
  rcluster_stop(&rc);
}

static void a_backup_killed_during_the_pushes_changes_nothing(void **state) {
  (void)state;
  rcluster rc;
  replicated_run(&rc, KILL_BACKUP_MID_PUSH, 3, 1);
  rcluster_stop(&rc);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(replicated_shards_train_to_the_bits_of_unreplicated_ones),
      cmocka_unit_test(a_primary_killed_during_the_pushes_fails_over_and_loses_nothing),
      cmocka_unit_test(a_primary_killed_before_the_step_fails_over_gradstats_and_apply),
      cmocka_unit_test(a_primary_killed_before_the_pulls_fails_over_the_pulls),
      cmocka_unit_test(a_backup_killed_during_the_pushes_changes_nothing),
      cmocka_unit_test(a_restarted_primary_rejoins_and_takes_over_at_the_next_failover),
      cmocka_unit_test(a_fresh_set_without_its_first_member_promotes_the_second),
  };
  int failed = cmocka_run_group_tests(tests, group_setup, group_teardown);
  hs_finish(failed);
  return failed;
}
