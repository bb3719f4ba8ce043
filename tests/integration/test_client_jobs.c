/*
 * test_client_jobs — a job's life on real zshard-server processes: the open
 * modes (create, resume, either), closing a job (zs_close_job, `zshard
 * close-job`) so that the next job opens on the same servers without a
 * restart and with its own initial weights, a close under a parked pull,
 * and the step's options (per-group learning rates, a clipping coefficient
 * computed elsewhere).
 *
 * Run on both transports (ZSHARD_TRANSPORT, tests/CMakeLists.txt).
 */
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <spawn.h>
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
#include "zshard/zshard.h"

extern char **environ;

#define NT 4
#define SPLIT 64
static const uint64_t NUMEL[NT] = {300, 7, 64, 129};
/* Tensors 0 and 1 are in group 0, 2 and 3 in group 1 (when there are two). */
static uint32_t group_of(uint32_t t, uint32_t ngroups) {
  return ngroups > 1 && t >= 2 ? 1 : 0;
}

typedef struct job_opts {
  const char *job;
  zs_open_mode mode;
  uint32_t world_size, rank;
  uint32_t ngroups;
  double lr_scale[2];
} job_opts;

static job_opts defaults(const char *job, zs_open_mode mode) {
  return (job_opts){
      .job = job, .mode = mode, .world_size = 1, .ngroups = 1, .lr_scale = {1.0, 1.0}};
}

static zs_client *new_client(const hs_cluster *cl, const job_opts *jo) {
  char addrs[256];
  snprintf(addrs, sizeof addrs, "%s,%s", cl->srv[0]->addr, cl->srv[1]->addr);
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.split_threshold = SPLIT;
  o.job = jo->job;
  o.open_mode = jo->mode;
  o.world_size = jo->world_size;
  o.rank = jo->rank;
  o.max_retries = 3;
  o.retry_initial_ms = 20;
  o.retry_max_ms = 200;
  o.rpc_timeout_ms = 10000;
  o.step_timeout_ms = 30000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  for (uint32_t g = 0; g < jo->ngroups; g++) {
    zs_group_options go;
    zs_group_options_init(&go, ZS_OPTIM_SGD);
    go.momentum = 0.9;
    go.weight_decay = 0.01;
    go.lr_scale = jo->lr_scale[g];
    assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  }
  for (uint32_t t = 0; t < NT; t++) {
    char name[16];
    snprintf(name, sizeof name, "t%" PRIu32, t);
    assert_int_equal(zs_add_tensor(c, name, NUMEL[t], group_of(t, jo->ngroups), NULL, 0, NULL),
                     ZS_OK);
  }
  return c;
}

/* Weights that differ with `seed`, gradients with the step. */
static void fill_weights(float **w, float seed) {
  for (uint32_t t = 0; t < NT; t++) {
    w[t] = malloc(NUMEL[t] * sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      w[t][i] = seed + (float)t + (float)i / 16.0f;
  }
}

static void free_bufs(float **b) {
  for (uint32_t t = 0; t < NT; t++)
    free(b[t]);
}

static void push_all(zs_client *c, uint64_t step) {
  for (uint32_t t = 0; t < NT; t++) {
    float *g = malloc(NUMEL[t] * sizeof(float));
    for (uint64_t i = 0; i < NUMEL[t]; i++)
      g[i] = (float)((i + t + step) % 7) - 3.0f;
    assert_int_equal(zs_push(c, t, 0, g, ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), ZS_OK);
    free(g);
  }
}

/* Every tensor in fp32 (the shards' master weights). */
static void pull_all(zs_client *c, float **out) {
  for (uint32_t t = 0; t < NT; t++) {
    out[t] = malloc(NUMEL[t] * sizeof(float));
    assert_int_equal(zs_pull(c, t, out[t], ZS_DTYPE_FP32, NUMEL[t] * sizeof(float), NULL), ZS_OK);
  }
}

static void assert_same_bits(float **a, float **b) {
  for (uint32_t t = 0; t < NT; t++)
    assert_memory_equal(a[t], b[t], NUMEL[t] * sizeof(float));
}

/* The job name shard i reports ("" without a job). */
static void shard_job(const hs_cluster *cl, uint32_t i, char *job, size_t cap, uint64_t *version) {
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl->srv[i]->addr, &ch), ZS_OK);
  Zshard__V1__GetInfoResponse *r = NULL;
  rpc_status st;
  assert_int_equal(hs_get_info(ch, &r, &st), 0);
  snprintf(job, cap, "%s", r->job ? r->job : "");
  if (version)
    *version = r->version;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  rpc_channel_close(ch);
}

static void open_modes_create_resume_either(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  float *w[NT];
  fill_weights(w, 1.0f);

  /* Resume with nothing there: refused, and nothing is created. */
  job_opts jo = defaults("alpha", ZS_OPEN_RESUME);
  zs_client *r0 = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(r0, (const float *const *)w), ZS_ENOTOPEN);
  fprintf(stderr, "resume on empty shards: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "no job"));
  char job[300];
  shard_job(&cl, 0, job, sizeof job, NULL);
  assert_string_equal(job, "");
  assert_int_equal(zs_client_close(r0), ZS_OK);

  /* Create on fresh shards. */
  jo = defaults("alpha", ZS_OPEN_CREATE);
  zs_client *a = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(a, (const float *const *)w), ZS_OK);

  /* Another trainer of the same new run (same model, version 0) joins. */
  zs_client *a2 = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(a2, (const float *const *)w), ZS_OK);
  assert_int_equal(zs_client_close(a2), ZS_OK);

  /* Create of a different job: refused, naming the job that is there. */
  job_opts jb = defaults("beta", ZS_OPEN_CREATE);
  zs_client *b = new_client(&cl, &jb);
  assert_int_equal(zs_open_job(b, (const float *const *)w), ZS_EEXIST);
  fprintf(stderr, "create over another job: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "already has job 'alpha'"));
  assert_non_null(strstr(zs_last_error(), "close-job"));
  assert_int_equal(zs_client_close(b), ZS_OK);

  /* Train alpha one step: a create of alpha is now a new run over a trained
   * one, and refused. */
  push_all(a, 1);
  assert_int_equal(zs_step(a, 0.1, 0, 0, NULL), ZS_OK);
  zs_client *a3 = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(a3, (const float *const *)w), ZS_EEXIST);
  fprintf(stderr, "create over the trained job: %s\n", zs_last_error());
  assert_non_null(strstr(zs_last_error(), "to version 1"));
  assert_int_equal(zs_client_close(a3), ZS_OK);

  /* Resume and either join it at its version. */
  job_opts jr = defaults("alpha", ZS_OPEN_RESUME);
  zs_client *ra = new_client(&cl, &jr);
  assert_int_equal(zs_open_job(ra, (const float *const *)w), ZS_OK);
  assert_int_equal(zs_current_step(ra), 2);
  assert_int_equal(zs_client_close(ra), ZS_OK);
  job_opts je = defaults("alpha", ZS_OPEN_EITHER);
  zs_client *ea = new_client(&cl, &je);
  assert_int_equal(zs_open_job(ea, (const float *const *)w), ZS_OK);
  assert_int_equal(zs_current_step(ea), 2);
  assert_int_equal(zs_client_close(ea), ZS_OK);

  /* Resume of another job: the hash differs. */
  job_opts jrb = defaults("beta", ZS_OPEN_RESUME);
  zs_client *rb = new_client(&cl, &jrb);
  assert_int_equal(zs_open_job(rb, (const float *const *)w), ZS_EHASH);
  assert_int_equal(zs_client_close(rb), ZS_OK);

  /* Closed: resume is refused again, either creates. */
  assert_int_equal(zs_close_job(a), ZS_OK);
  zs_client *ra2 = new_client(&cl, &jr);
  assert_int_equal(zs_open_job(ra2, (const float *const *)w), ZS_ENOTOPEN);
  assert_int_equal(zs_client_close(ra2), ZS_OK);
  zs_client *eb = new_client(&cl, &(job_opts){.job = "beta",
                                              .mode = ZS_OPEN_EITHER,
                                              .world_size = 1,
                                              .ngroups = 1,
                                              .lr_scale = {1, 1}});
  assert_int_equal(zs_open_job(eb, (const float *const *)w), ZS_OK);
  assert_int_equal(zs_current_step(eb), 1);
  shard_job(&cl, 1, job, sizeof job, NULL);
  assert_string_equal(job, "beta");
  assert_int_equal(zs_client_close(eb), ZS_OK);
  assert_int_equal(zs_client_close(a), ZS_OK);
  free_bufs(w);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* The same model run twice on the same servers: after a close, the second
 * run starts from its own initial weights, not from the first run's. */
static void a_closed_job_frees_the_shards_for_the_next_run(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  float *w1[NT], *w2[NT], *p[NT];
  fill_weights(w1, 1.0f);
  fill_weights(w2, 100.0f);
  job_opts jo = defaults("run", ZS_OPEN_CREATE);
  zs_client *a = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(a, (const float *const *)w1), ZS_OK);
  push_all(a, 1);
  assert_int_equal(zs_step(a, 0.1, 0, 0, NULL), ZS_OK);
  assert_int_equal(zs_close_job(a), ZS_OK);
  char job[300];
  for (uint32_t i = 0; i < 2; i++) {
    uint64_t v = 99;
    shard_job(&cl, i, job, sizeof job, &v);
    assert_string_equal(job, ""); /* status shows no job */
    assert_int_equal(v, 0);
  }
  /* This client's job is gone: no transfer, no step, no second open. */
  float one[7];
  assert_int_equal(zs_pull(a, 1, one, ZS_DTYPE_FP32, sizeof one, NULL), ZS_ENOTOPEN);
  assert_int_equal(zs_step(a, 0.1, 0, 0, NULL), ZS_ENOTOPEN);
  assert_int_equal(zs_close_job(a), ZS_ENOTOPEN);
  assert_int_equal(zs_open_job(a, (const float *const *)w1), ZS_EINVAL);
  assert_int_equal(zs_client_close(a), ZS_OK);

  zs_client *b = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(b, (const float *const *)w2), ZS_OK);
  assert_int_equal(zs_current_step(b), 1);
  pull_all(b, p);
  assert_same_bits(p, w2);
  free_bufs(p);
  /* And it trains. */
  push_all(b, 1);
  assert_int_equal(zs_step(b, 0.1, 0, 0, NULL), ZS_OK);
  assert_int_equal(zs_close_job(b), ZS_OK);
  assert_int_equal(zs_client_close(b), ZS_OK);
  free_bufs(w1);
  free_bufs(w2);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

typedef struct cb_seen {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
  char msg[512];
} cb_seen;

static void on_done(void *arg, int status) {
  cb_seen *s = arg;
  pthread_mutex_lock(&s->mu);
  s->status = status;
  snprintf(s->msg, sizeof s->msg, "%s", status != ZS_OK ? zs_last_error() : "");
  s->done = 1;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Pulls waiting in shard i's core (Stats.waiting_pulls). */
static uint32_t waiting_pulls(const hs_cluster *cl, uint32_t i) {
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl->srv[i]->addr, &ch), ZS_OK);
  Zshard__V1__StatsRequest req = ZSHARD__V1__STATS_REQUEST__INIT;
  Zshard__V1__StatsResponse *r = NULL;
  rpc_status st;
  assert_int_equal(rpc_call(ch, "/zshard.v1.ZShard/Stats", &req.base,
                            &zshard__v1__stats_response__descriptor, (ProtobufCMessage **)&r,
                            HS_CALL_TIMEOUT_MS, &st),
                   0);
  uint32_t n = r->waiting_pulls;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  rpc_channel_close(ch);
  return n;
}

/* Rank 1 of a two-trainer job pulls before rank 0 wrote the initial weights:
 * its pull parks in the shards. Closing the job answers it with an error. */
static void a_close_releases_a_parked_pull(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  job_opts jo = defaults("parked", ZS_OPEN_CREATE);
  jo.world_size = 2;
  jo.rank = 1;
  zs_client *r1 = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(r1, NULL), ZS_OK);
  float *buf = malloc(NUMEL[0] * sizeof(float));
  cb_seen s = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  /* Tensor 0 is split over both shards. */
  assert_int_equal(zs_pull_cb(r1, 0, buf, ZS_DTYPE_FP32, NUMEL[0] * sizeof(float), on_done, &s),
                   ZS_OK);
  /* Bounded poll of the condition: both shards hold the pull. */
  for (int i = 0; i < 2000 && (waiting_pulls(&cl, 0) == 0 || waiting_pulls(&cl, 1) == 0); i++)
    nanosleep(&(struct timespec){.tv_nsec = 5000000}, NULL);
  assert_true(waiting_pulls(&cl, 0) > 0 && waiting_pulls(&cl, 1) > 0);
  assert_int_equal(zs_close_job(r1), ZS_OK);
  pthread_mutex_lock(&s.mu);
  while (!s.done)
    pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  fprintf(stderr, "parked pull after the close: %s (%s)\n", zs_err_name(s.status), s.msg);
  assert_int_equal(s.status, ZS_ENOTOPEN);
  assert_non_null(strstr(s.msg, "closed while"));
  assert_int_equal(waiting_pulls(&cl, 0), 0);
  assert_int_equal(waiting_pulls(&cl, 1), 0);
  assert_int_equal(zs_client_close(r1), ZS_OK);
  free(buf);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* Runs the CLI with argv, its stdout and stderr into out; returns the exit
 * status. */
static int run_cli(char *const argv[], char *out, size_t cap) {
  char path[600];
  snprintf(path, sizeof path, "%s/cli.out", hs_tmpdir());
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  assert_int_equal(rc, 0);
  int ws = 0;
  assert_int_equal(waitpid(pid, &ws, 0), pid);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  size_t n = fread(out, 1, cap - 1, f);
  out[n] = '\0';
  fclose(f);
  fprintf(stderr, "%s", out);
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static void the_cli_closes_the_job_it_is_told_to(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  float *w[NT];
  fill_weights(w, 1.0f);
  job_opts jo = defaults("cli-job", ZS_OPEN_CREATE);
  zs_client *a = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(a, (const float *const *)w), ZS_OK);
  push_all(a, 1);
  assert_int_equal(zs_step(a, 0.1, 0, 0, NULL), ZS_OK);
  char addrs[256], out[8192], hash[32];
  snprintf(addrs, sizeof addrs, "%s,%s", cl.srv[0]->addr, cl.srv[1]->addr);
  snprintf(hash, sizeof hash, "%016" PRIx64, zs_spec_hash(a) ^ 1);

  /* The wrong job or hash: refused, the job stays. */
  char *wrong[] = {ZSHARD_CLI_BIN, "close-job", "--shards", addrs, "--job", "other", NULL};
  assert_int_equal(run_cli(wrong, out, sizeof out), 1);
  assert_non_null(strstr(out, "holds job 'cli-job', not 'other'"));
  char *wrong_hash[] = {ZSHARD_CLI_BIN, "close-job", "--shards", addrs, "--hash", hash, NULL};
  assert_int_equal(run_cli(wrong_hash, out, sizeof out), 1);
  assert_non_null(strstr(out, "ZS_EHASH"));
  char job[300];
  shard_job(&cl, 0, job, sizeof job, NULL);
  assert_string_equal(job, "cli-job");

  snprintf(hash, sizeof hash, "%016" PRIx64, zs_spec_hash(a));
  char *right[] = {ZSHARD_CLI_BIN, "close-job", "--shards", addrs, "--job",
                   "cli-job",      "--hash",    hash,       NULL};
  assert_int_equal(run_cli(right, out, sizeof out), 0);
  assert_non_null(strstr(out, "shard 0"));
  assert_non_null(strstr(out, "closed job 'cli-job'"));
  assert_non_null(strstr(out, "at version 1"));
  assert_non_null(strstr(out, "closed the job on 2 of 2 shards"));
  for (uint32_t i = 0; i < 2; i++) {
    shard_job(&cl, i, job, sizeof job, NULL);
    assert_string_equal(job, "");
  }
  /* Again: nothing to close is not an error. */
  assert_int_equal(run_cli(right, out, sizeof out), 0);
  assert_non_null(strstr(out, "no job open"));
  assert_non_null(strstr(out, "closed the job on 0 of 2 shards (2 had none"));
  /* The trainer's job is gone under it: its next push says so. */
  assert_int_equal(zs_push(a, 1, 0, w[1], ZS_DTYPE_FP32, NUMEL[1] * sizeof(float), NULL),
                   ZS_ENOTOPEN);
  assert_non_null(strstr(zs_last_error(), "no job is open"));
  assert_int_equal(zs_client_close(a), ZS_OK);
  free_bufs(w);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* Trains `steps` steps of a fresh job and returns its weights; the job is
 * closed afterwards so that the next one can use the servers. */
static void train(const hs_cluster *cl, const job_opts *jo, const zs_step_options *so, int steps,
                  float **out, zs_step_result *last) {
  float *w[NT];
  fill_weights(w, 1.0f);
  zs_client *c = new_client(cl, jo);
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  for (int s = 1; s <= steps; s++) {
    push_all(c, (uint64_t)s);
    zs_step_result_init(last);
    assert_int_equal(zs_step_ex(c, so, last), ZS_OK);
  }
  pull_all(c, out);
  assert_int_equal(zs_close_job(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
}

/* group_lr {0.5, 0.125} with lr_scale 1 equals lr 1 with lr_scale {0.5,
 * 0.125}, bit for bit; a wrong count is refused by the client and by the
 * shard, changing nothing. */
static void group_learning_rates_match_lr_scales(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  float *a[NT], *b[NT];
  zs_step_result r;
  job_opts scaled = defaults("groups", ZS_OPEN_CREATE);
  scaled.ngroups = 2;
  scaled.lr_scale[0] = 0.5;
  scaled.lr_scale[1] = 0.125;
  zs_step_options so;
  zs_step_options_init(&so);
  so.lr = 1.0;
  train(&cl, &scaled, &so, 3, a, &r);

  job_opts plain = scaled;
  plain.lr_scale[0] = plain.lr_scale[1] = 1.0;
  const double glr[2] = {0.5, 0.125};
  so.group_lr = glr;
  so.num_group_lr = 2;
  so.lr = 7.0; /* not used with group_lr */
  train(&cl, &plain, &so, 3, b, &r);
  assert_same_bits(a, b);
  /* The two groups really moved differently from a single lr: */
  float *c1[NT];
  so.group_lr = NULL;
  so.num_group_lr = 0;
  so.lr = 0.5;
  train(&cl, &plain, &so, 3, c1, &r);
  assert_memory_equal(c1[0], b[0], NUMEL[0] * sizeof(float)); /* group 0: lr 0.5 either way */
  assert_memory_not_equal(c1[2], b[2], NUMEL[2] * sizeof(float));
  free_bufs(c1);

  /* Wrong counts. */
  float *w[NT];
  fill_weights(w, 1.0f);
  zs_client *c = new_client(&cl, &plain);
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  push_all(c, 1);
  so.group_lr = glr;
  so.num_group_lr = 1;
  assert_int_equal(zs_step_ex(c, &so, NULL), ZS_EINVAL);
  assert_non_null(strstr(zs_last_error(), "2 param groups"));
  const double bad[2] = {0.5, -1.0};
  so.group_lr = bad;
  so.num_group_lr = 2;
  assert_int_equal(zs_step_ex(c, &so, NULL), ZS_EINVAL);
  /* The shard's own check, with a raw Apply of three rates. */
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(cl.srv[0]->addr, &ch), ZS_OK);
  Zshard__V1__ApplyRequest req = ZSHARD__V1__APPLY_REQUEST__INIT;
  double three[3] = {0.1, 0.1, 0.1};
  req.spec_hash = zs_spec_hash(c);
  req.step = 1;
  req.lr = 0.1;
  req.coef = 1.0f;
  req.group_lr = three;
  req.n_group_lr = 3;
  Zshard__V1__ApplyResponse *resp = NULL;
  rpc_status st;
  assert_int_equal(rpc_call(ch, "/zshard.v1.ZShard/Apply", &req.base,
                            &zshard__v1__apply_response__descriptor, (ProtobufCMessage **)&resp,
                            HS_CALL_TIMEOUT_MS, &st),
                   ZS_EINVAL);
  fprintf(stderr, "shard refused: %s\n", st.message);
  assert_non_null(strstr(st.message, "3 group learning rates"));
  rpc_channel_close(ch);
  /* Nothing changed: the step goes through with the right count. */
  so.group_lr = glr;
  so.num_group_lr = 2;
  zs_step_result_init(&r);
  assert_int_equal(zs_step_ex(c, &so, &r), ZS_OK);
  assert_int_equal(r.step, 1);
  assert_int_equal(zs_close_job(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);
  free_bufs(a);
  free_bufs(b);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

/* A clipping coefficient computed elsewhere, equal to the one max_grad_norm
 * gives, gives the same weights; zs_grad_norm gives the norm to compute it
 * from before the step. */
static void an_external_clip_coef_equals_the_computed_one(void **state) {
  (void)state;
  hs_cluster cl;
  assert_int_equal(hs_cluster_start(&cl, 2, NULL), 0);
  float *a[NT], *b[NT];
  zs_step_result ra, rb;
  job_opts jo = defaults("clip", ZS_OPEN_CREATE);
  zs_step_options so;
  zs_step_options_init(&so);
  so.lr = 0.05;
  so.max_grad_norm = 0.5;
  train(&cl, &jo, &so, 1, a, &ra);
  assert_true(ra.clip_coef < 1.0); /* clipping was active */

  /* zs_grad_norm before the step: the norm zs_step then reports; the
   * coefficient computed from it by torch's formula is zs_step's. */
  float *w[NT], *g[NT];
  fill_weights(w, 1.0f);
  zs_client *c = new_client(&cl, &jo);
  assert_int_equal(zs_open_job(c, (const float *const *)w), ZS_OK);
  double norm = -1;
  int overflow = -1;
  assert_int_equal(zs_grad_norm(c, 0, &norm, &overflow), ZS_ENOTREADY); /* nothing pushed yet */
  push_all(c, 1);
  assert_int_equal(zs_grad_norm(c, 0, &norm, &overflow), ZS_OK);
  assert_int_equal(overflow, 0);
  assert_true(norm == ra.grad_norm);
  assert_int_equal(zs_current_step(c), 1); /* nothing was applied */
  zs_step_options ext;
  zs_step_options_init(&ext);
  ext.lr = 0.05;
  ext.clip_coef = fmin(1.0, 0.5 / (norm + 1e-6));
  zs_step_result rc;
  zs_step_result_init(&rc);
  assert_int_equal(zs_step_ex(c, &ext, &rc), ZS_OK);
  assert_true(rc.grad_norm == ra.grad_norm);
  pull_all(c, g);
  assert_same_bits(a, g);
  free_bufs(g);
  assert_int_equal(zs_close_job(c), ZS_OK);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free_bufs(w);

  so.max_grad_norm = 0;
  so.clip_coef = ra.clip_coef;
  train(&cl, &jo, &so, 1, b, &rb);
  assert_true(rb.clip_coef == ra.clip_coef);
  assert_true(rb.coef == ra.coef);
  assert_true(rb.grad_norm == ra.grad_norm);
  assert_same_bits(a, b);
  free_bufs(b);
  /* A different coefficient is used too (it is not ignored). */
  so.clip_coef = ra.clip_coef / 2;
  train(&cl, &jo, &so, 1, b, &rb);
  assert_memory_not_equal(a[0], b[0], NUMEL[0] * sizeof(float));
  so.clip_coef = -1;
  assert_int_equal(zs_step_ex(NULL, &so, NULL), ZS_EINVAL);
  free_bufs(a);
  free_bufs(b);
  assert_int_equal(hs_cluster_stop(&cl), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(open_modes_create_resume_either),
      cmocka_unit_test(a_closed_job_frees_the_shards_for_the_next_run),
      cmocka_unit_test(a_close_releases_a_parked_pull),
      cmocka_unit_test(the_cli_closes_the_job_it_is_told_to),
      cmocka_unit_test(group_learning_rates_match_lr_scales),
      cmocka_unit_test(an_external_clip_coef_equals_the_computed_one),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
