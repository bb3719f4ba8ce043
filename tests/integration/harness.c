/*
 * harness — see harness.h.
 *
 * Children are started with fork + execve and an environment built before the
 * fork: a test program has gRPC threads running, and after fork only
 * async-signal-safe calls (open, dup2, execve, _exit) are safe in the child.
 */
#include "tests/integration/harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "grpc/health/v1/health.pb-c.h"

extern char **environ;

#define HS_MAX_LIVE 64
#define HS_MAX_LOGS 256
#define HS_READY_MS 20000u
#define HS_STOP_MS 30000u
#define HS_RUN_MS 20000u
#define HS_POLL_NS 10000000L /* 10 ms between two looks at a child */

static struct {
  char root[256];
  const char *bin;
  unsigned seq;
  hs_server *live[HS_MAX_LIVE];
  char *logs[HS_MAX_LOGS];
  unsigned nlogs;
} g;

/* ------------------------------------------------------------ processes */

static void poll_pause(void) {
  struct timespec ts = {0, HS_POLL_NS};
  nanosleep(&ts, NULL);
}

static void print_file(const char *title, const char *path) {
  FILE *f = fopen(path, "r");
  fprintf(stderr, "----- %s (%s) -----\n", title, path);
  if (!f) {
    fprintf(stderr, "(cannot open: %s)\n", strerror(errno));
    return;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0)
    fwrite(buf, 1, n, stderr);
  fclose(f);
  fprintf(stderr, "----- end of %s -----\n", title);
}

int hs_init(void) {
  g.bin = getenv("ZSHARD_SERVER_BIN");
  if (!g.bin || access(g.bin, X_OK) != 0) {
    fprintf(stderr, "harness: ZSHARD_SERVER_BIN must name the zshard-server binary (got %s)\n",
            g.bin ? g.bin : "nothing");
    return -1;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(g.root, sizeof g.root, "%s/zshard-it-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g.root)) {
    fprintf(stderr, "harness: mkdtemp: %s\n", strerror(errno));
    return -1;
  }
  return 0;
}

const char *hs_tmpdir(void) {
  return g.root;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

void hs_finish(int failures) {
  for (int i = 0; i < HS_MAX_LIVE; i++) {
    if (g.live[i] && g.live[i]->pid > 0) {
      kill(g.live[i]->pid, SIGKILL);
      waitpid(g.live[i]->pid, NULL, 0);
    }
    free(g.live[i]);
    g.live[i] = NULL;
  }
  for (unsigned i = 0; i < g.nlogs; i++) {
    if (failures)
      print_file("zshard-server log", g.logs[i]);
    free(g.logs[i]);
  }
  g.nlogs = 0;
  if (g.root[0])
    nftw(g.root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  g.root[0] = '\0';
}

/* The child's environment: ours without any ZSHARD_* variable, plus `env`.
 * The array and its strings are the caller's (free_env). */
static char **build_env(const char *const *env) {
  size_t n = 0, m = 0;
  for (char **e = environ; *e; e++)
    n++;
  for (const char *const *e = env; e && *e; e++)
    m++;
  char **out = calloc(n + m + 1, sizeof *out);
  if (!out)
    return NULL;
  size_t k = 0;
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "ZSHARD_", 7) != 0)
      out[k++] = *e;
  for (const char *const *e = env; e && *e; e++)
    out[k++] = (char *)*e;
  out[k] = NULL;
  return out;
}

/* Forks and execs the server with argv; stdout and stderr go to out_path.
 * Returns the pid or -1. */
static pid_t spawn(char *const *argv, const char *const *env, const char *out_path) {
  char **envp = build_env(env);
  if (!envp)
    return -1;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    /* A test that fails between start and stop (cmocka leaves the test at
     * the failed assertion) must not leave its servers running: they die
     * with the test process (the forking thread: always the test's). */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
      _exit(125);
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int nul = open("/dev/null", O_RDONLY);
    if (fd < 0 || nul < 0)
      _exit(126);
    dup2(nul, STDIN_FILENO);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execve(g.bin, argv, envp);
    _exit(127);
  }
  free(envp);
  return pid;
}

static int status_code(int wstatus) {
  if (WIFEXITED(wstatus))
    return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus))
    return 128 + WTERMSIG(wstatus);
  return -1;
}

/* Waits up to ms for pid; returns the status code, or -2 if it is still
 * running. */
static int wait_bounded(pid_t pid, uint64_t ms) {
  uint64_t end = clock_now_ms() + ms;
  for (;;) {
    int ws;
    pid_t r = waitpid(pid, &ws, WNOHANG);
    if (r == pid)
      return status_code(ws);
    if (r < 0 && errno != EINTR)
      return -1;
    if (clock_now_ms() >= end)
      return -2;
    poll_pause();
  }
}

static int read_port(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  int port = 0;
  if (fscanf(f, "%d", &port) != 1)
    port = 0;
  fclose(f);
  return port > 0 && port < 65536 ? port : 0;
}

static void remember_log(const char *path) {
  if (g.nlogs < HS_MAX_LOGS)
    g.logs[g.nlogs++] = strdup(path);
}

static void forget(hs_server *s) {
  for (int i = 0; i < HS_MAX_LIVE; i++)
    if (g.live[i] == s)
      g.live[i] = NULL;
}

hs_server *hs_start(const char *const *args, const char *const *env) {
  hs_server *s = calloc(1, sizeof *s);
  int slot = -1;
  for (int i = 0; i < HS_MAX_LIVE && slot < 0; i++)
    if (!g.live[i])
      slot = i;
  if (!s || slot < 0) {
    fprintf(stderr, "harness: too many servers\n");
    free(s);
    return NULL;
  }
  unsigned id = ++g.seq;
  snprintf(s->log_path, sizeof s->log_path, "%s/server-%u.log", g.root, id);
  snprintf(s->port_path, sizeof s->port_path, "%s/server-%u.port", g.root, id);
  remember_log(s->log_path);

  char *argv[64];
  int n = 0;
  argv[n++] = (char *)g.bin;
  argv[n++] = "--listen";
  argv[n++] = "127.0.0.1:0";
  argv[n++] = "--port-file";
  argv[n++] = s->port_path;
  for (const char *const *a = args; a && *a && n < 63; a++)
    argv[n++] = (char *)*a;
  argv[n] = NULL;

  s->pid = spawn(argv, env, s->log_path);
  if (s->pid < 0) {
    fprintf(stderr, "harness: cannot start %s: %s\n", g.bin, strerror(errno));
    free(s);
    return NULL;
  }
  g.live[slot] = s;
  uint64_t end = clock_now_ms() + HS_READY_MS;
  for (;;) {
    s->port = read_port(s->port_path);
    if (s->port)
      break;
    int ws;
    if (waitpid(s->pid, &ws, WNOHANG) == s->pid) {
      fprintf(stderr, "harness: zshard-server exited with status %d before serving\n",
              status_code(ws));
      s->pid = 0;
      goto fail;
    }
    if (clock_now_ms() >= end) {
      fprintf(stderr, "harness: zshard-server not ready after %u ms\n", HS_READY_MS);
      goto fail;
    }
    poll_pause();
  }
  snprintf(s->addr, sizeof s->addr, "127.0.0.1:%d", s->port);
  return s;

fail:
  print_file("zshard-server log", s->log_path);
  if (s->pid > 0) {
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
  }
  forget(s);
  free(s);
  return NULL;
}

/* 1 once the process is stopped (state T in /proc/PID/stat). */
static int is_stopped(pid_t pid) {
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *close = strrchr(buf, ')');
  return close && close[1] == ' ' && close[2] == 'T';
}

void hs_signal(hs_server *s, int sig) {
  if (!s || s->pid <= 0)
    return;
  kill(s->pid, sig);
  /* kill returns before the target stops: a server busy on another CPU
   * could still answer a request sent right after. Wait (up to 5 s) until it
   * no longer runs. */
  for (int i = 0; sig == SIGSTOP && i < 5000 && !is_stopped(s->pid); i++)
    usleep(1000);
}

int hs_stop(hs_server *s) {
  if (!s)
    return -1;
  int rc = -1;
  if (s->pid > 0) {
    kill(s->pid, SIGTERM);
    rc = wait_bounded(s->pid, HS_STOP_MS);
    if (rc == -2) {
      fprintf(stderr, "harness: zshard-server %s ignored SIGTERM for %u ms; killing it\n", s->addr,
              HS_STOP_MS);
      kill(s->pid, SIGKILL);
      waitpid(s->pid, NULL, 0);
      rc = -1;
    }
    s->pid = 0;
  }
  forget(s);
  free(s);
  return rc;
}

int hs_run(const char *const *args, const char *const *env, char *out, size_t cap) {
  char path[512];
  snprintf(path, sizeof path, "%s/run-%u.out", g.root, ++g.seq);
  char *argv[64];
  int n = 0;
  argv[n++] = (char *)g.bin;
  for (const char *const *a = args; a && *a && n < 63; a++)
    argv[n++] = (char *)*a;
  argv[n] = NULL;
  pid_t pid = spawn(argv, env, path);
  if (pid < 0)
    return -1;
  int rc = wait_bounded(pid, HS_RUN_MS);
  if (rc == -2) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    rc = -1;
  }
  if (out && cap) {
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f) {
      size_t k = fread(out, 1, cap - 1, f);
      out[k] = '\0';
      fclose(f);
    }
  }
  return rc;
}

int hs_cluster_start(hs_cluster *c, uint32_t n, const char *const *extra) {
  memset(c, 0, sizeof *c);
  if (n == 0 || n > HS_MAX_SHARDS)
    return -1;
  char shards[16];
  snprintf(shards, sizeof shards, "%u", n);
  for (uint32_t i = 0; i < n; i++) {
    char id[16];
    snprintf(id, sizeof id, "%u", i);
    const char *args[48] = {"--shard-id", id, "--shards", shards, "--threads", "1"};
    int k = 6;
    for (const char *const *a = extra; a && *a && k < 47; a++)
      args[k++] = *a;
    args[k] = NULL;
    c->srv[i] = hs_start(args, NULL);
    if (!c->srv[i]) {
      hs_cluster_stop(c);
      return -1;
    }
    c->n = i + 1;
  }
  return 0;
}

int hs_cluster_stop(hs_cluster *c) {
  int bad = 0;
  for (uint32_t i = 0; i < HS_MAX_SHARDS; i++) {
    if (c->srv[i] && hs_stop(c->srv[i]) != 0)
      bad = 1;
    c->srv[i] = NULL;
  }
  c->n = 0;
  return bad ? -1 : 0;
}

/* ------------------------------------------------------------ the job */

static const struct {
  const char *name;
  uint64_t numel;
  uint32_t group;
} hs_tensors[] = {
    {"embed.weight", 2600, 0}, /* split, short last slice */
    {"embed.bias", 40, 1},     /* whole */
    {"layer.weight", 1030, 0}, /* just above the threshold: split */
    {"layer.bias", 17, 1},     /* whole, odd size */
    {"norm.weight", 1024, 1},  /* exactly the threshold: split */
    {"head.weight", 900, 0},   /* below the threshold: whole */
};

int hs_spec_build(spec *s, const char *job, uint32_t W, uint32_t M, uint32_t N) {
  memset(s, 0, sizeof *s);
  size_t nt = sizeof hs_tensors / sizeof hs_tensors[0];
  s->job = strdup(job);
  s->groups = calloc(2, sizeof *s->groups);
  s->tensors = calloc(nt, sizeof *s->tensors);
  if (!s->job || !s->groups || !s->tensors) {
    spec_free(s);
    return ZS_ENOMEM;
  }
  s->num_groups = 2;
  spec_group_defaults(&s->groups[0], ZS_OPTIM_ADAMW);
  spec_group_defaults(&s->groups[1], ZS_OPTIM_ADAMW);
  s->groups[1].weight_decay = 0.0;
  s->groups[1].lr_scale = 0.5;
  s->num_tensors = (uint32_t)nt;
  for (size_t i = 0; i < nt; i++) {
    s->tensors[i].name = strdup(hs_tensors[i].name);
    if (!s->tensors[i].name) {
      spec_free(s);
      return ZS_ENOMEM;
    }
    s->tensors[i].numel = hs_tensors[i].numel;
    s->tensors[i].group = hs_tensors[i].group;
  }
  s->world_size = W;
  s->grad_accum = M;
  s->num_shards = N;
  s->split_threshold = 1024;
  s->reduce = SPEC_REDUCE_MEAN;
  s->param_dtype = ZS_DTYPE_BF16;
  char err[256];
  int rc = spec_validate(s, err, sizeof err);
  if (rc) {
    fprintf(stderr, "harness: test spec invalid: %s\n", err);
    spec_free(s);
  }
  return rc;
}

int hs_job_init(hs_job *j, spec *sp, const char *const *addrs) {
  memset(j, 0, sizeof *j);
  j->sp = *sp;
  memset(sp, 0, sizeof *sp);
  j->nshards = j->sp.num_shards;
  int rc = j->nshards <= HS_MAX_SHARDS ? layout_build(&j->sp, &j->lay) : ZS_EINVAL;
  if (rc)
    goto fail;
  j->hash = spec_hash(&j->sp);
  for (uint32_t i = 0; i < j->nshards; i++)
    if ((rc = rpc_channel_open(addrs[i], &j->ch[i])) != 0)
      goto fail;
  return 0;
fail:
  hs_job_free(j);
  return rc;
}

int hs_job_init_cluster(hs_job *j, spec *sp, const hs_cluster *c) {
  const char *addrs[HS_MAX_SHARDS] = {0};
  for (uint32_t i = 0; i < c->n; i++)
    addrs[i] = c->srv[i]->addr;
  if (sp->num_shards != c->n) {
    spec_free(sp);
    memset(j, 0, sizeof *j);
    return ZS_EINVAL;
  }
  return hs_job_init(j, sp, addrs);
}

void hs_job_free(hs_job *j) {
  for (uint32_t i = 0; i < HS_MAX_SHARDS; i++)
    rpc_channel_close(j->ch[i]);
  layout_free(&j->lay);
  spec_free(&j->sp);
  memset(j, 0, sizeof *j);
}

rpc_channel *hs_job_owner(const hs_job *j, uint32_t tensor, uint32_t slice) {
  const layout_piece *p = layout_find(&j->lay, tensor, slice);
  return p ? j->ch[p->shard] : NULL;
}

int hs_job_open(hs_job *j, uint32_t rank, rpc_status *st) {
  Zshard__V1__ModelSpec ms = ZSHARD__V1__MODEL_SPEC__INIT;
  int rc = spec_to_proto(&j->sp, &ms);
  if (rc)
    return rc;
  Zshard__V1__OpenRequest req = ZSHARD__V1__OPEN_REQUEST__INIT;
  req.spec = &ms;
  req.rank = rank;
  for (uint32_t i = 0; i < j->nshards && rc == 0; i++) {
    ProtobufCMessage *resp = NULL;
    rc = rpc_call(j->ch[i], "/zshard.v1.ZShard/Open", &req.base,
                  &zshard__v1__open_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, st);
    if (rc == 0) {
      Zshard__V1__OpenResponse *r = (Zshard__V1__OpenResponse *)resp;
      if (r->spec_hash != j->hash || r->shard_id != i || r->num_shards != j->nshards) {
        fprintf(stderr, "harness: Open on shard %u answered hash %016llx shard %u of %u\n", i,
                (unsigned long long)r->spec_hash, r->shard_id, r->num_shards);
        rc = ZS_EINTERNAL;
      }
      protobuf_c_message_free_unpacked(resp, NULL);
    }
  }
  spec_proto_release(&ms);
  return rc;
}

int hs_job_init_params(hs_job *j, float *const *weights, rpc_status *st) {
  for (uint32_t i = 0; i < j->lay.num_pieces; i++) {
    const layout_piece *p = &j->lay.pieces[i];
    Zshard__V1__InitParamsRequest req = ZSHARD__V1__INIT_PARAMS_REQUEST__INIT;
    req.spec_hash = j->hash;
    req.tensor = p->tensor;
    req.slice = p->slice;
    req.data.data = (uint8_t *)(weights[p->tensor] + p->offset);
    req.data.len = (size_t)p->numel * sizeof(float);
    ProtobufCMessage *resp = NULL;
    int rc = rpc_call(j->ch[p->shard], "/zshard.v1.ZShard/InitParams", &req.base,
                      &zshard__v1__init_params_response__descriptor, &resp, HS_CALL_TIMEOUT_MS, st);
    if (rc)
      return rc;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return 0;
}

int hs_job_pull(hs_job *j, uint64_t min_version, float *const *out, uint64_t *version,
                rpc_status *st) {
  uint64_t vmin = UINT64_MAX;
  for (uint32_t i = 0; i < j->lay.num_pieces; i++) {
    const layout_piece *p = &j->lay.pieces[i];
    uint64_t v = 0;
    int rc = hs_pull(j->ch[p->shard], j->hash, p->tensor, p->slice, min_version, ZS_DTYPE_FP32, 0,
                     out[p->tensor] + p->offset, (size_t)p->numel * sizeof(float), &v, st);
    if (rc)
      return rc;
    if (v < vmin)
      vmin = v;
  }
  if (version)
    *version = vmin;
  return 0;
}

/* ------------------------------------------------------------ single calls */

int hs_push(rpc_channel *ch, uint64_t hash, uint64_t step, uint32_t rank, uint32_t micro,
            uint32_t tensor, uint32_t slice, int dtype, const void *data, size_t nbytes,
            int *duplicate, rpc_status *st) {
  Zshard__V1__PushRequest req = ZSHARD__V1__PUSH_REQUEST__INIT;
  req.spec_hash = hash;
  req.step = step;
  req.rank = rank;
  req.micro = micro;
  req.tensor = tensor;
  req.slice = slice;
  req.dtype = (Zshard__V1__DType)dtype;
  req.data.data = (uint8_t *)data; /* only read by pack */
  req.data.len = nbytes;
  ProtobufCMessage *resp = NULL;
  int rc = rpc_call(ch, "/zshard.v1.ZShard/Push", &req.base, &zshard__v1__push_response__descriptor,
                    &resp, HS_CALL_TIMEOUT_MS, st);
  if (rc)
    return rc;
  if (duplicate)
    *duplicate = ((Zshard__V1__PushResponse *)resp)->duplicate;
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

int hs_pull(rpc_channel *ch, uint64_t hash, uint32_t tensor, uint32_t slice, uint64_t min_version,
            int dtype, uint32_t timeout_ms, void *dst, size_t nbytes, uint64_t *version,
            rpc_status *st) {
  Zshard__V1__PullRequest req = ZSHARD__V1__PULL_REQUEST__INIT;
  req.spec_hash = hash;
  req.tensor = tensor;
  req.slice = slice;
  req.min_version = min_version;
  req.dtype = (Zshard__V1__DType)dtype;
  req.timeout_ms = timeout_ms;
  ProtobufCMessage *resp = NULL;
  uint64_t call_timeout =
      timeout_ms ? (uint64_t)timeout_ms + HS_CALL_TIMEOUT_MS : HS_CALL_TIMEOUT_MS;
  int rc = rpc_call(ch, "/zshard.v1.ZShard/Pull", &req.base, &zshard__v1__pull_response__descriptor,
                    &resp, call_timeout, st);
  if (rc)
    return rc;
  Zshard__V1__PullResponse *r = (Zshard__V1__PullResponse *)resp;
  if (r->data.len != nbytes || (int)r->dtype != dtype) {
    fprintf(stderr,
            "harness: Pull of tensor %u slice %u returned %zu bytes of dtype %d, "
            "expected %zu of dtype %d\n",
            tensor, slice, r->data.len, (int)r->dtype, nbytes, dtype);
    protobuf_c_message_free_unpacked(resp, NULL);
    return ZS_EPROTO;
  }
  memcpy(dst, r->data.data, nbytes);
  if (version)
    *version = r->version;
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

int hs_grad_stats(rpc_channel *ch, uint64_t hash, uint64_t step, uint32_t timeout_ms,
                  Zshard__V1__GradStatsResponse **out, rpc_status *st) {
  Zshard__V1__GradStatsRequest req = ZSHARD__V1__GRAD_STATS_REQUEST__INIT;
  req.spec_hash = hash;
  req.step = step;
  req.timeout_ms = timeout_ms;
  return rpc_call(ch, "/zshard.v1.ZShard/GradStats", &req.base,
                  &zshard__v1__grad_stats_response__descriptor, (ProtobufCMessage **)out,
                  (uint64_t)timeout_ms + HS_CALL_TIMEOUT_MS, st);
}

int hs_apply(rpc_channel *ch, uint64_t hash, uint64_t step, double lr, float coef, int skip,
             Zshard__V1__ApplyResponse **out, rpc_status *st) {
  Zshard__V1__ApplyRequest req = ZSHARD__V1__APPLY_REQUEST__INIT;
  req.spec_hash = hash;
  req.step = step;
  req.lr = lr;
  req.coef = coef;
  req.skip = skip != 0;
  return rpc_call(ch, "/zshard.v1.ZShard/Apply", &req.base, &zshard__v1__apply_response__descriptor,
                  (ProtobufCMessage **)out, HS_CALL_TIMEOUT_MS, st);
}

int hs_get_info(rpc_channel *ch, Zshard__V1__GetInfoResponse **out, rpc_status *st) {
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  return rpc_call(ch, "/zshard.v1.ZShard/GetInfo", &req.base,
                  &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)out,
                  HS_CALL_TIMEOUT_MS, st);
}

/* ------------------------------------------------------------ health Watch */

enum { WATCH_TAG_START = 1, WATCH_TAG_STATUS, WATCH_TAG_MESSAGE };

struct hs_watch {
  grpc_channel *ch;
  grpc_completion_queue *cq;
  grpc_call *call;
  grpc_byte_buffer *req;
  grpc_byte_buffer *msg;
  grpc_metadata_array initial_md, trailing_md;
  grpc_status_code code;
  grpc_slice details;
  int status_done; /* RECV_STATUS_ON_CLIENT completed */
};

/* Waits for `tag`, noting the status batch if it completes meanwhile. The
 * call's deadline bounds every wait. */
static void watch_wait(hs_watch *w, intptr_t tag) {
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE)
      continue;
    if ((intptr_t)ev.tag == WATCH_TAG_STATUS)
      w->status_done = 1;
    if ((intptr_t)ev.tag == tag)
      return;
  }
}

int hs_watch_start(const char *addr, const char *service, hs_watch **out) {
  *out = NULL;
  hs_watch *w = calloc(1, sizeof *w);
  if (!w)
    return -1;
  grpc_init();
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  w->ch = grpc_channel_create(addr, creds, NULL);
  grpc_channel_credentials_release(creds);
  w->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_metadata_array_init(&w->initial_md);
  grpc_metadata_array_init(&w->trailing_md);
  w->details = grpc_empty_slice();
  grpc_slice method = grpc_slice_from_static_string("/grpc.health.v1.Health/Watch");
  gpr_timespec deadline =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(60, GPR_TIMESPAN));
  w->call = grpc_channel_create_call(w->ch, NULL, GRPC_PROPAGATE_DEFAULTS, w->cq, method, NULL,
                                     deadline, NULL);

  Grpc__Health__V1__HealthCheckRequest r = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  r.service = (char *)service;
  grpc_slice sl = grpc_slice_malloc(protobuf_c_message_get_packed_size(&r.base));
  protobuf_c_message_pack(&r.base, GRPC_SLICE_START_PTR(sl));
  w->req = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);

  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = w->req;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &w->initial_md;
  if (grpc_call_start_batch(w->call, ops, 4, (void *)(intptr_t)WATCH_TAG_START, NULL) !=
      GRPC_CALL_OK)
    goto fail;
  grpc_op st;
  memset(&st, 0, sizeof st);
  st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  st.data.recv_status_on_client.trailing_metadata = &w->trailing_md;
  st.data.recv_status_on_client.status = &w->code;
  st.data.recv_status_on_client.status_details = &w->details;
  if (grpc_call_start_batch(w->call, &st, 1, (void *)(intptr_t)WATCH_TAG_STATUS, NULL) !=
      GRPC_CALL_OK) {
    watch_wait(w, WATCH_TAG_START);
    goto fail;
  }
  watch_wait(w, WATCH_TAG_START);
  *out = w;
  return 0;
fail:
  w->status_done = 1; /* nothing to wait for in hs_watch_free */
  hs_watch_free(w);
  return -1;
}

int hs_watch_next(hs_watch *w, int *status) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &w->msg;
  w->msg = NULL;
  if (grpc_call_start_batch(w->call, &op, 1, (void *)(intptr_t)WATCH_TAG_MESSAGE, NULL) !=
      GRPC_CALL_OK)
    return -1;
  watch_wait(w, WATCH_TAG_MESSAGE);
  if (!w->msg) { /* end of stream */
    if (!w->status_done)
      watch_wait(w, WATCH_TAG_STATUS);
    *status = (int)w->code;
    return 1;
  }
  grpc_byte_buffer_reader reader;
  int rc = -1;
  if (grpc_byte_buffer_reader_init(&reader, w->msg)) {
    grpc_slice sl = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    Grpc__Health__V1__HealthCheckResponse *r =
        (Grpc__Health__V1__HealthCheckResponse *)protobuf_c_message_unpack(
            &grpc__health__v1__health_check_response__descriptor, NULL, GRPC_SLICE_LENGTH(sl),
            GRPC_SLICE_START_PTR(sl));
    grpc_slice_unref(sl);
    if (r) {
      *status = (int)r->status;
      protobuf_c_message_free_unpacked(&r->base, NULL);
      rc = 0;
    }
  }
  grpc_byte_buffer_destroy(w->msg);
  w->msg = NULL;
  return rc;
}

void hs_watch_free(hs_watch *w) {
  if (!w)
    return;
  if (w->call) {
    if (!w->status_done) {
      grpc_call_cancel(w->call, NULL);
      watch_wait(w, WATCH_TAG_STATUS);
    }
    grpc_call_unref(w->call);
  }
  if (w->req)
    grpc_byte_buffer_destroy(w->req);
  grpc_metadata_array_destroy(&w->initial_md);
  grpc_metadata_array_destroy(&w->trailing_md);
  grpc_slice_unref(w->details);
  grpc_completion_queue_shutdown(w->cq);
  while (grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(w->cq);
  grpc_channel_destroy(w->ch);
  grpc_shutdown();
  free(w);
}
