/*
 * bench — the shared half of the benchmarks (see bench.h).
 *
 * Processes and threads: the servers are child processes started with
 * fork+exec. The raw TCP limits fork children that only call
 * async-signal-safe functions (accept, read, write, close, _exit), so forking
 * is safe even after gRPC or libzshard started threads in the parent. Their
 * buffers are allocated before the fork.
 */
#include "bench.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/net/rpc_client.h"
#include "zshard/v1/zshard.pb-c.h"

#ifndef ZSHARD_SERVER_BIN
#define ZSHARD_SERVER_BIN "zshard-server"
#endif

/* Readiness of a server: its port file must appear within this time. */
#define START_TIMEOUT_MS 30000u
#define STOP_TIMEOUT_MS 30000u
#define POLL_NS 5000000L

extern char **environ;

/* ------------------------------------------------------------------ options */

void bench_parse_common(int *argc, char **argv, bench_opts *o) {
  memset(o, 0, sizeof *o);
  int out = 1;
  for (int i = 1; i < *argc; i++) {
    if (strcmp(argv[i], "--json") == 0) {
      o->json = 1;
    } else if (strcmp(argv[i], "--quick") == 0) {
      o->quick = 1;
    } else if (strcmp(argv[i], "--reps") == 0) {
      char *end = NULL;
      long r = i + 1 < *argc ? strtol(argv[i + 1], &end, 10) : 0;
      if (i + 1 >= *argc || *end != '\0' || r < 1 || r > 1000) {
        fprintf(stderr, "%s: --reps needs a count from 1 to 1000\n", argv[0]);
        exit(2);
      }
      o->reps = (int)r;
      i++;
    } else {
      argv[out++] = argv[i];
    }
  }
  argv[out] = NULL;
  *argc = out;
}

int bench_parse_list(const char *s, uint64_t *out, int max) {
  int n = 0;
  const char *p = s;
  while (*p) {
    char *end = NULL;
    errno = 0;
    double v = strtod(p, &end);
    if (end == p || errno || !(v > 0))
      return -1;
    double mul = 1;
    if (*end == 'K' || *end == 'k')
      mul = 1024.0;
    else if (*end == 'M' || *end == 'm')
      mul = 1024.0 * 1024.0;
    else if (*end == 'G' || *end == 'g')
      mul = 1024.0 * 1024.0 * 1024.0;
    if (mul > 1) {
      end++;
      if (*end == 'i')
        end++;
    }
    if (*end != ',' && *end != '\0')
      return -1;
    if (n >= max || v * mul >= 1.8e19)
      return -1;
    out[n++] = (uint64_t)llround(v * mul);
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

/* ------------------------------------------------------------------ report */

static void json_string(const char *s) {
  putchar('"');
  for (; *s; s++) {
    if (*s == '"' || *s == '\\')
      printf("\\%c", *s);
    else if ((unsigned char)*s < 0x20)
      printf("\\u%04x", (unsigned char)*s);
    else
      putchar(*s);
  }
  putchar('"');
}

/* JSON has no NaN or infinity; such a figure is printed as null. Whole
 * numbers (byte and parameter counts) are printed exactly. */
static void json_number(double v) {
  if (!isfinite(v))
    printf("null");
  else if (v == floor(v) && fabs(v) < 1e15)
    printf("%.0f", v);
  else
    printf("%.6g", v);
}

void bench_report(const bench_opts *o, const char *bench, const char *metric, double value,
                  const char *unit, double limit, const bench_kv *extra, size_t nextra) {
  double ratio = limit > 0 ? value / limit : NAN;
  if (o->json) {
    printf("{\"bench\":");
    json_string(bench);
    printf(",\"metric\":");
    json_string(metric);
    printf(",\"value\":");
    json_number(value);
    printf(",\"unit\":");
    json_string(unit);
    printf(",\"limit\":");
    json_number(limit > 0 ? limit : NAN);
    printf(",\"ratio\":");
    json_number(ratio);
    for (size_t i = 0; i < nextra; i++) {
      putchar(',');
      json_string(extra[i].key);
      putchar(':');
      if (extra[i].s)
        json_string(extra[i].s);
      else
        json_number(extra[i].num);
    }
    printf("}\n");
  } else {
    printf("%-9s %-40s %12.4g %-9s", bench, metric, value, unit);
    if (limit > 0)
      printf("  limit %10.4g  ratio %6.3f", limit, ratio);
    printf("\n");
  }
  fflush(stdout);
}

void bench_note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("# ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

void bench_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* ------------------------------------------------------------------ timing */

double bench_now(void) {
  return (double)clock_now_ns() / 1e9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_quantile(double *v, size_t n, double q) {
  if (n == 0)
    return 0;
  qsort(v, n, sizeof *v, cmp_double);
  /* Nearest rank: the smallest value with at least q*n values at or below
   * it. */
  size_t rank = (size_t)ceil(q * (double)n);
  if (rank < 1)
    rank = 1;
  if (rank > n)
    rank = n;
  return v[rank - 1];
}

const char *bench_bytes_str(double bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    u++;
  }
  snprintf(buf, len, "%.*f %s", bytes == floor(bytes) ? 0 : 1, bytes, units[u]);
  return buf;
}

const char *bench_label(const char *s, char *buf, size_t len) {
  size_t k = 0;
  for (; *s && k + 1 < len; s++)
    if (*s != ' ')
      buf[k++] = *s;
  buf[k] = '\0';
  return buf;
}

/* Buffers from this size up are kept out of forked children. glibc serves
 * them by mmap whatever its dynamic threshold (which stops at 32 MiB on
 * 64-bit) and unmaps them on free(), so the flag never outlives the buffer
 * on pages malloc hands out again: a child's own buffers are never hit. */
#define BENCH_DONTFORK_MIN (32u << 20)

void *bench_alloc(size_t bytes) {
  size_t rounded = (bytes + 63) & ~(size_t)63;
  void *p = aligned_alloc(64, rounded ? rounded : 64);
  if (!p)
    bench_die("out of memory allocating %zu bytes", bytes);
  memset(p, 0, rounded);
  if (bytes < BENCH_DONTFORK_MIN)
    return p;
  /* The pumps fork their readers before every phase they bound. A fork
   * marks every private page of this process copy-on-write, and the next
   * write to each then faults, even once the child is gone: pulls into a
   * 256 MiB buffer cost the client 4.7 CPU s/GiB instead of 0.5 (bench_cpu,
   * data plane, this VM), which a trainer, not forking, never pays. */
  uintptr_t a = ((uintptr_t)p + 4095) & ~(uintptr_t)4095;
  uintptr_t e = ((uintptr_t)p + bytes) & ~(uintptr_t)4095;
  if (madvise((void *)a, e - a, MADV_DONTFORK) != 0)
    bench_die("madvise(MADV_DONTFORK): %s", strerror(errno));
  return p;
}

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

void bench_fill_f32(float *p, size_t n, float scale, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = ((float)(splitmix(&seed) >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * scale;
}

void bench_fill_bf16(uint16_t *p, size_t n, uint64_t seed) {
  float tmp[1024];
  for (size_t i = 0; i < n; i += 1024) {
    size_t k = n - i < 1024 ? n - i : 1024;
    bench_fill_f32(tmp, k, 0.01f, seed + i);
    dtype_from_f32(ZS_DTYPE_BF16, tmp, p + i, k);
  }
}

/* ------------------------------------------------------------------ servers */

static char g_tmpdir[256];

const char *bench_server_bin(void) {
  const char *b = getenv("ZSHARD_SERVER_BIN");
  return b && *b ? b : ZSHARD_SERVER_BIN;
}

static void pause_poll(void) {
  struct timespec ts = {0, POLL_NS};
  nanosleep(&ts, NULL);
}

int bench_server_has_data_plane(void) {
  static int known = -1;
  if (known >= 0)
    return known;
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "'%s' --help 2>&1", bench_server_bin());
  FILE *f = popen(cmd, "r");
  known = 0;
  if (!f)
    return known;
  char line[512];
  while (fgets(line, sizeof line, f))
    if (strstr(line, "--data-listen"))
      known = 1;
  pclose(f);
  return known;
}

static int read_port_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  int port = -1;
  if (fscanf(f, "%d", &port) != 1)
    port = -1;
  fclose(f);
  return port;
}

/* The child's environment: ours without ZSHARD_* variables, so that a
 * setting meant for the client (ZSHARD_TRANSPORT ...) or left in the shell
 * does not change the servers. The array is the caller's; its strings are
 * environ's. */
static char **server_env(void) {
  size_t n = 0;
  for (char **e = environ; *e; e++)
    n++;
  char **out = calloc(n + 1, sizeof *out);
  if (!out)
    bench_die("out of memory");
  size_t k = 0;
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "ZSHARD_", 7) != 0)
      out[k++] = *e;
  return out;
}

static void print_log(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f)
    return;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0)
    fwrite(buf, 1, n, stderr);
  fclose(f);
}

/* The TLS files of bench_servers_tls: empty strings for plain TCP. */
static struct { char cert[256], key[256], ca[256]; } g_tls;

void bench_servers_tls(const char *cert, const char *key, const char *ca) {
  memset(&g_tls, 0, sizeof g_tls);
  if (!cert)
    return;
  snprintf(g_tls.cert, sizeof g_tls.cert, "%s", cert);
  snprintf(g_tls.key, sizeof g_tls.key, "%s", key);
  snprintf(g_tls.ca, sizeof g_tls.ca, "%s", ca);
}

/* Asks the server for its data port (GetInfo.data_port), over TLS when the
 * servers speak it. */
static int query_data_port(const char *addr) {
  rpc_channel *ch = NULL;
  rpc_security sec = {.tls_ca_file = g_tls.ca};
  char err[256];
  if (rpc_channel_open_secure(addr, g_tls.ca[0] ? &sec : NULL, &ch, err, sizeof err) != 0)
    return 0;
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  Zshard__V1__GetInfoResponse *resp = NULL;
  rpc_status st;
  int port = 0;
  if (rpc_call(ch, "/zshard.v1.ZShard/GetInfo", &req.base,
               &zshard__v1__get_info_response__descriptor, (ProtobufCMessage **)&resp, 10000,
               &st) == 0) {
    port = (int)resp->data_port;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  } else {
    bench_note("GetInfo on %s failed: %s", addr, st.message);
  }
  rpc_channel_close(ch);
  return port;
}

void bench_servers_start(bench_server *srv, uint32_t n, int threads) {
  if (n > BENCH_MAX_SERVERS)
    bench_die("at most %d servers", BENCH_MAX_SERVERS);
  if (!g_tmpdir[0]) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_tmpdir, sizeof g_tmpdir, "%s/zshard-bench-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_tmpdir))
      bench_die("mkdtemp: %s", strerror(errno));
  }
  const char *bin = bench_server_bin();
  int dp = bench_server_has_data_plane();
  char **env = server_env();
  static unsigned seq;
  char port_path[BENCH_MAX_SERVERS][400], log_path[BENCH_MAX_SERVERS][400];
  for (uint32_t i = 0; i < n; i++) {
    memset(&srv[i], 0, sizeof srv[i]);
    unsigned id = seq++;
    snprintf(port_path[i], sizeof port_path[i], "%s/port-%u", g_tmpdir, id);
    snprintf(log_path[i], sizeof log_path[i], "%s/log-%u", g_tmpdir, id);
    char sid[16], nsh[16], thr[16];
    snprintf(sid, sizeof sid, "%u", i);
    snprintf(nsh, sizeof nsh, "%u", n);
    snprintf(thr, sizeof thr, "%d", threads);
    const char *argv[24];
    int a = 0;
    argv[a++] = bin;
    argv[a++] = "--listen";
    argv[a++] = "127.0.0.1:0";
    argv[a++] = "--port-file";
    argv[a++] = port_path[i];
    argv[a++] = "--shard-id";
    argv[a++] = sid;
    argv[a++] = "--shards";
    argv[a++] = nsh;
    argv[a++] = "--log-level";
    argv[a++] = "warn";
    if (threads > 0) {
      argv[a++] = "--threads";
      argv[a++] = thr;
    }
    if (g_tls.cert[0]) {
      argv[a++] = "--tls-cert";
      argv[a++] = g_tls.cert;
      argv[a++] = "--tls-key";
      argv[a++] = g_tls.key;
    }
    if (dp) {
      argv[a++] = "--data-listen";
      argv[a++] = "127.0.0.1:0";
    }
    argv[a] = NULL;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
      bench_die("fork: %s", strerror(errno));
    if (pid == 0) {
      /* A benchmark that dies or is interrupted takes its servers along. */
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(125);
      int fd = open(log_path[i], O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
      }
      execve(bin, (char *const *)argv, env);
      _exit(127);
    }
    srv[i].pid = pid;
  }
  free(env);
  for (uint32_t i = 0; i < n; i++) {
    uint64_t deadline = clock_now_ms() + START_TIMEOUT_MS;
    int port = -1;
    while ((port = read_port_file(port_path[i])) <= 0) {
      int status;
      if (waitpid(srv[i].pid, &status, WNOHANG) == srv[i].pid) {
        print_log(log_path[i]);
        bench_die("zshard-server (%s) exited before serving", bin);
      }
      if (clock_now_ms() > deadline) {
        print_log(log_path[i]);
        bench_die("zshard-server did not write its port file within %u ms", START_TIMEOUT_MS);
      }
      pause_poll();
    }
    srv[i].port = port;
    snprintf(srv[i].addr, sizeof srv[i].addr, "127.0.0.1:%d", port);
    srv[i].data_port = query_data_port(srv[i].addr);
    if (srv[i].data_port > 0)
      snprintf(srv[i].data_addr, sizeof srv[i].data_addr, "127.0.0.1:%d", srv[i].data_port);
  }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

void bench_servers_stop(bench_server *srv, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (srv[i].pid > 0)
      kill(srv[i].pid, SIGTERM);
  for (uint32_t i = 0; i < n; i++) {
    if (srv[i].pid <= 0)
      continue;
    uint64_t deadline = clock_now_ms() + STOP_TIMEOUT_MS;
    int status;
    while (waitpid(srv[i].pid, &status, WNOHANG) == 0) {
      if (clock_now_ms() > deadline) {
        bench_note("server %d did not stop within %u ms: killed", (int)srv[i].pid, STOP_TIMEOUT_MS);
        kill(srv[i].pid, SIGKILL);
        waitpid(srv[i].pid, &status, 0);
        break;
      }
      pause_poll();
    }
    srv[i].pid = 0;
  }
  /* The logs of servers that stopped are of no further use; a later start
   * makes a new directory. */
  if (g_tmpdir[0]) {
    nftw(g_tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    g_tmpdir[0] = '\0';
  }
}

/* The "<key>: <n> kB" line of /proc/<pid>/status, in bytes. */
static uint64_t proc_status_kb(pid_t pid, const char *key) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  char line[256];
  size_t klen = strlen(key);
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, key, klen) == 0 && line[klen] == ':' &&
        sscanf(line + klen + 1, "%llu", &kb) == 1)
      break;
  fclose(f);
  return (uint64_t)kb * 1024u;
}

uint64_t bench_vmhwm(pid_t pid) {
  return proc_status_kb(pid, "VmHWM");
}

uint64_t bench_vmrss(pid_t pid) {
  return proc_status_kb(pid, "VmRSS");
}

void bench_server_list(const bench_server *srv, uint32_t n, char *buf, size_t len) {
  size_t off = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < n && off < len; i++)
    off += (size_t)snprintf(buf + off, len - off, "%s%s", i ? "," : "", srv[i].addr);
}

/* ------------------------------------------------------------------ limits */

/* A listening socket on 127.0.0.1, port 0; *port gets the port. */
static int listen_loopback(int backlog, int *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    bench_die("socket: %s", strerror(errno));
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, backlog) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &alen) != 0)
    bench_die("bind/listen on loopback: %s", strerror(errno));
  *port = ntohs(a.sin_port);
  return fd;
}

static int connect_loopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    bench_die("socket: %s", strerror(errno));
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
    bench_die("connect to 127.0.0.1:%d: %s", port, strerror(errno));
  return fd;
}

static void write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      bench_die("write: %s", strerror(errno));
    p += w;
    n -= (size_t)w;
  }
}

/* Reads exactly n bytes; returns 0, or -1 at EOF or on an error. Only
 * async-signal-safe calls, so forked children use it too. */
static int child_read_full(int fd, char *buf, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, buf, n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    buf += r;
    n -= (size_t)r;
  }
  return 0;
}

typedef struct pump_sender {
  pthread_t th;
  int fd;
  const char *buf;
  size_t write_size;
  uint64_t bytes;
  pthread_barrier_t *start;
  double done_at;
} pump_sender;

static void *pump_send(void *arg) {
  pump_sender *s = arg;
  pthread_barrier_wait(s->start);
  uint64_t left = s->bytes;
  while (left > 0) {
    size_t k = left < s->write_size ? (size_t)left : s->write_size;
    write_all(s->fd, s->buf, k);
    left -= k;
  }
  /* The reader closes once it has read everything, so the EOF it sends back
   * marks the moment the last byte was received, not merely queued. */
  shutdown(s->fd, SHUT_WR);
  char c;
  while (read(s->fd, &c, 1) > 0) {
  }
  s->done_at = bench_now();
  return NULL;
}

double bench_tcp_pump(uint32_t conns, uint64_t bytes_per_conn, size_t write_size) {
  if (conns == 0 || conns > 256)
    bench_die("bench_tcp_pump: 1 to 256 connections");
  int port = 0;
  int lfd = listen_loopback((int)conns, &port);
  char *rbuf = bench_alloc(write_size);
  char *sbuf = bench_alloc(write_size);
  memset(sbuf, 0x5a, write_size);
  /* One reader process per connection, as each shard is its own process. */
  pid_t *kids = calloc(conns, sizeof *kids);
  if (!kids)
    bench_die("out of memory");
  for (uint32_t i = 0; i < conns; i++) {
    pid_t pid = fork();
    if (pid < 0)
      bench_die("fork: %s", strerror(errno));
    if (pid == 0) {
      int fd = accept(lfd, NULL, NULL);
      if (fd < 0)
        _exit(1);
      /* Copy-on-write faults on the inherited buffer happen once per page,
       * during the first reads; the buffer was touched before the fork. */
      while (read(fd, rbuf, write_size) > 0) {
      }
      close(fd);
      _exit(0);
    }
    kids[i] = pid;
  }
  pump_sender *s = calloc(conns, sizeof *s);
  if (!s)
    bench_die("out of memory");
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, conns + 1);
  for (uint32_t i = 0; i < conns; i++) {
    s[i].fd = connect_loopback(port);
    s[i].buf = sbuf;
    s[i].write_size = write_size;
    s[i].bytes = bytes_per_conn;
    s[i].start = &start;
    if (pthread_create(&s[i].th, NULL, pump_send, &s[i]) != 0)
      bench_die("pthread_create failed");
  }
  double t0 = bench_now();
  pthread_barrier_wait(&start);
  double end = t0;
  for (uint32_t i = 0; i < conns; i++) {
    pthread_join(s[i].th, NULL);
    close(s[i].fd);
    if (s[i].done_at > end)
      end = s[i].done_at;
  }
  for (uint32_t i = 0; i < conns; i++)
    waitpid(kids[i], NULL, 0);
  pthread_barrier_destroy(&start);
  close(lfd);
  free(s);
  free(kids);
  free(rbuf);
  free(sbuf);
  return (double)conns * (double)bytes_per_conn / (end - t0);
}

#define PINGPONG_MAX (16u << 20)

struct bench_pingpong {
  pid_t pid;
  int fd;
  char *buf; /* 8 + PINGPONG_MAX bytes */
};

/* The peer's loop, in the forked child: only async-signal-safe calls. */
static void pingpong_peer(int lfd, char *buf) {
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0)
    _exit(1);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uint32_t len[2];
  while (child_read_full(fd, (char *)len, sizeof len) == 0) {
    if (len[0] > PINGPONG_MAX || len[1] > PINGPONG_MAX || child_read_full(fd, buf, len[0]) != 0)
      _exit(1);
    size_t left = len[1];
    const char *p = buf;
    while (left > 0) {
      ssize_t w = write(fd, p, left);
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0)
        _exit(1);
      p += w;
      left -= (size_t)w;
    }
  }
  _exit(0);
}

bench_pingpong *bench_pingpong_open(void) {
  bench_pingpong *p = calloc(1, sizeof *p);
  if (!p)
    bench_die("out of memory");
  p->buf = bench_alloc(8 + PINGPONG_MAX);
  int port = 0;
  int lfd = listen_loopback(1, &port);
  p->pid = fork();
  if (p->pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (p->pid == 0)
    pingpong_peer(lfd, p->buf + 8);
  close(lfd);
  p->fd = connect_loopback(port);
  int one = 1;
  setsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return p;
}

double bench_pingpong_once(bench_pingpong *p, size_t req_bytes, size_t resp_bytes) {
  if (req_bytes > PINGPONG_MAX || resp_bytes > PINGPONG_MAX)
    bench_die("ping-pong of more than %u bytes", PINGPONG_MAX);
  uint32_t len[2] = {(uint32_t)req_bytes, (uint32_t)resp_bytes};
  memcpy(p->buf, len, sizeof len);
  double t0 = bench_now();
  write_all(p->fd, p->buf, 8 + req_bytes);
  if (child_read_full(p->fd, p->buf + 8, resp_bytes) != 0)
    bench_die("the ping-pong peer closed early");
  return bench_now() - t0;
}

void bench_pingpong_close(bench_pingpong *p) {
  if (!p)
    return;
  close(p->fd);
  waitpid(p->pid, NULL, 0);
  free(p->buf);
  free(p);
}

pid_t bench_pingpong_peer(const bench_pingpong *p) {
  return p->pid;
}

/* voluntary_ctxt_switches of one thread: the times it blocked (and so was
 * woken again). Preemptions (nonvoluntary) count the machine's load, not
 * the code's wake-ups. */
static uint64_t task_switches(const char *status_path) {
  FILE *f = fopen(status_path, "r");
  if (!f)
    return 0; /* the thread has just exited */
  char line[256];
  uint64_t n = 0;
  unsigned long long v;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1)
      n += v;
  fclose(f);
  return n;
}

uint64_t bench_switches(pid_t pid) {
  char dir[64];
  if (pid)
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
  else
    snprintf(dir, sizeof dir, "/proc/self/task");
  DIR *d = opendir(dir);
  if (!d)
    bench_die("cannot open %s", dir);
  uint64_t n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[sizeof dir + sizeof e->d_name + 8];
    snprintf(path, sizeof path, "%s/%s/status", dir, e->d_name);
    n += task_switches(path);
  }
  closedir(d);
  return n;
}

/* ------------------------------------------------------------------ clients */

int bench_transport_list(char *list, int *out, int max) {
  int n = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    int t = strcmp(tok, "grpc") == 0   ? ZS_TRANSPORT_GRPC
            : strcmp(tok, "data") == 0 ? ZS_TRANSPORT_DATA
                                       : -1;
    if (t < 0 || n == max)
      return -1;
    out[n++] = t;
  }
  return n > 0 ? n : -1;
}

const char *bench_transport_name(int transport) {
  return transport == ZS_TRANSPORT_GRPC ? "grpc" : transport == ZS_TRANSPORT_DATA ? "data" : "?";
}

zs_client *bench_client_open(const bench_model *m, const char *addrs, uint32_t nshards,
                             uint32_t rank, int transport, uint32_t data_conns, const float *init) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addrs;
  o.num_shards = nshards;
  o.rank = rank;
  o.world_size = m->world_size;
  o.grad_accum = m->grad_accum;
  o.job = m->job;
  o.param_dtype = ZS_DTYPE_BF16;
  o.transport = (zs_transport)transport;
  o.data_connections = data_conns;
  /* A benchmark must fail rather than wait out a stuck peer for minutes. */
  o.rpc_timeout_ms = 120000;
  o.step_timeout_ms = 120000;
  zs_client *c = NULL;
  if (zs_client_open(&o, &c) != 0)
    bench_die("zs_client_open: %s", zs_last_error());
  zs_group_options g;
  zs_group_options_init(&g, m->optimizer);
  if (zs_add_group(c, &g, NULL) != 0)
    bench_die("zs_add_group: %s", zs_last_error());
  for (uint32_t t = 0; t < m->ntensors; t++) {
    char name[32];
    snprintf(name, sizeof name, "t%u", t);
    if (zs_add_tensor(c, name, m->numel, 0, NULL, 0, NULL) != 0)
      bench_die("zs_add_tensor: %s", zs_last_error());
  }
  const float **w = NULL;
  if (rank == 0) {
    w = calloc(m->ntensors, sizeof *w);
    if (!w)
      bench_die("out of memory");
    for (uint32_t t = 0; t < m->ntensors; t++)
      w[t] = init;
  }
  if (zs_open_job(c, w) != 0)
    bench_die("zs_open_job (%s): %s", bench_transport_name(transport), zs_last_error());
  free(w);
  return c;
}

void bench_push_all(zs_client *c, const bench_model *m, uint32_t micro, const uint16_t *grad) {
  /* Trainer threads call this at once: the handles are per call. */
  zs_request **req = calloc(m->ntensors ? m->ntensors : 1, sizeof *req);
  if (!req)
    bench_die("out of memory");
  size_t nbytes = (size_t)m->numel * sizeof(uint16_t);
  for (uint32_t t = 0; t < m->ntensors; t++)
    if (zs_push(c, t, micro, grad, ZS_DTYPE_BF16, nbytes, &req[t]) != 0)
      bench_die("zs_push: %s", zs_last_error());
  for (uint32_t t = 0; t < m->ntensors; t++)
    if (zs_wait(req[t]) != 0)
      bench_die("push of tensor %u: %s", t, zs_last_error());
  free(req);
}

void bench_pull_all(zs_client *c, const bench_model *m, uint16_t *dst) {
  /* Trainer threads call this at once: the handles are per call. */
  zs_request **req = calloc(m->ntensors ? m->ntensors : 1, sizeof *req);
  if (!req)
    bench_die("out of memory");
  size_t nbytes = (size_t)m->numel * sizeof(uint16_t);
  for (uint32_t t = 0; t < m->ntensors; t++)
    if (zs_pull(c, t, dst + (size_t)t * m->numel, ZS_DTYPE_BF16, nbytes, &req[t]) != 0)
      bench_die("zs_pull: %s", zs_last_error());
  for (uint32_t t = 0; t < m->ntensors; t++)
    if (zs_wait(req[t]) != 0)
      bench_die("pull of tensor %u: %s", t, zs_last_error());
  free(req);
}

void bench_step(zs_client *c, zs_timing *timing) {
  zs_step_result r;
  zs_step_result_init(&r);
  if (zs_step(c, 1e-3, 0.0, 0.0, &r) != 0)
    bench_die("zs_step: %s", zs_last_error());
  if (timing && zs_last_timing(c, timing) != 0)
    bench_die("zs_last_timing: %s", zs_last_error());
}
