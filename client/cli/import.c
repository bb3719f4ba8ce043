/*
 * import — `zshard import`: writes the tensors of a safetensors file or of
 * a torch.save'd state dict (.pt, .bin: torch's zip format) into the master
 * weights of the job the shards hold (pretrained weights, or a file `zshard
 * export` wrote), one tensor at a time.
 *
 * The CLI never described the job: it asks shard 0 for the spec (GetInfo
 * with_spec), describes the same job from it and joins it (ZS_OPEN_RESUME,
 * no initial weights: zs_open_job_deferred), which checks the spec hash on
 * every shard. Then every check comes before the first write: the file's
 * index whole (safetensors.c, or torchzip.c for a zip file, which fills the
 * same index: the name, dtype, shape and byte range of each tensor, so that
 * everything below serves both), and the names against the model's as torch's
 * load_state_dict(strict=True) words them (missing, unexpected, size
 * mismatch). Each tensor is then written with zs_state_write (which also
 * recomputes the low-precision copy that pulls serve) and the next one read.
 *
 * Copies and memory: the file is mapped read-only. An fp32 tensor whose
 * bytes are 4-byte aligned in the mapping is written from it (0 copies
 * here); otherwise it is converted (bf16/fp16, exactly), gathered (a view
 * torch.save wrote with its strides) or copied into one buffer of the
 * largest tensor's fp32 size. After each tensor its pages of
 * the mapping are dropped (MADV_DONTNEED), so that the resident set holds
 * at most one tensor of the file besides that buffer.
 *
 * Exit status: 0 when every tensor was written, 1 on any error (nothing is
 * written on a check's failure; a failed write leaves earlier tensors
 * written, and says which), 2 on bad usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "cli_support.h"
#include "common/base/clock.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/model/spec.h"
#include "safetensors.h"
#include "torchzip.h"
#include "zshard/v1/zshard.pb-c.h"

#define IMPORT_CLI_TIMEOUT_MS 30000u
/* The most names each kind of mismatch lists before "and N more". */
#define IMPORT_MAX_LISTED 20

static const char import_usage[] =
    "usage: zshard import --shards ADDR[,ADDR...] FILE [--partial] [--quiet]\n"
    "                     [--num-shards N] [--timeout-ms T]\n"
    "  Writes the tensors of FILE, a safetensors file or a torch.save'd state dict\n"
    "  (.pt, .bin; F32, F16 or BF16, converted to fp32 exactly) into the master\n"
    "  weights of the job the shards hold, by name, one tensor at a time; the\n"
    "  low-precision copy that pulls serve follows. The job must\n"
    "  be open and idle (between steps: no trainer pushing); trainers that open or\n"
    "  resume the job afterwards pull the new weights. Missing, unexpected and\n"
    "  mis-shaped names are reported before anything is written; --partial allows\n"
    "  missing ones (their weights stay). Needs the admin token (WriteState).\n";

typedef struct import_args {
  const char *shards, *path;
  uint32_t num_shards, timeout_ms;
  int partial, quiet;
} import_args;

static int usage_error(const char *why) {
  fprintf(stderr, "zshard import: %s\n%s", why, import_usage);
  return 2;
}

/* Returns -1 to go on, else the exit status. */
static int parse_args(int argc, char **argv, import_args *a) {
  static const struct option opts[] = {{"shards", required_argument, NULL, 's'},
                                       {"num-shards", required_argument, NULL, 'n'},
                                       {"timeout-ms", required_argument, NULL, 't'},
                                       {"partial", no_argument, NULL, 'p'},
                                       {"quiet", no_argument, NULL, 'q'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  *a = (import_args){.timeout_ms = IMPORT_CLI_TIMEOUT_MS};
  optind = 1;
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    char *end = NULL;
    unsigned long long v;
    switch (ch) {
    case 's':
      a->shards = optarg;
      break;
    case 'n':
      v = strtoull(optarg, &end, 10);
      if (!*optarg || *end || *optarg == '-' || v == 0 || v > SPEC_MAX_SHARDS)
        return usage_error("--num-shards must be 1..4096");
      a->num_shards = (uint32_t)v;
      break;
    case 't':
      v = strtoull(optarg, &end, 10);
      if (!*optarg || *end || *optarg == '-' || v == 0 || v > UINT32_MAX)
        return usage_error("--timeout-ms must be a positive whole number");
      a->timeout_ms = (uint32_t)v;
      break;
    case 'p':
      a->partial = 1;
      break;
    case 'q':
      a->quiet = 1;
      break;
    case 'h':
      fputs(import_usage, stdout);
      return 0;
    default:
      return usage_error("unknown option or missing value");
    }
  }
  if (argc - optind != 1)
    return usage_error("one FILE is required");
  if (!a->shards)
    return usage_error("--shards is required");
  a->path = argv[optind];
  return -1;
}

/* ---- the file --------------------------------------------------------------- */

typedef struct mapped {
  const uint8_t *base;
  uint64_t size;
} mapped;

static int map_file(const char *path, mapped *m) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    fprintf(stderr, "zshard import: %s: %s\n", path, strerror(errno));
    return -1;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0) {
    fprintf(stderr, "zshard import: %s: not a non-empty regular file\n", path);
    close(fd);
    return -1;
  }
  void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    fprintf(stderr, "zshard import: %s: mmap: %s\n", path, strerror(errno));
    return -1;
  }
  m->base = p;
  m->size = (uint64_t)sb.st_size;
  return 0;
}

/* The file's tensors, whichever its format: a zip archive is torch.save's,
 * anything else is taken for safetensors. */
static int read_index(const mapped *m, st_header *h, char *err, size_t errlen) {
  if (tz_is_zip(m->base, m->size))
    return tz_parse(m->base, m->size, h, err, errlen);
  /* A pickle's PROTO 2 opcode: torch.save before torch 1.6 (or with
   * _use_new_zipfile_serialization=False), whose tensors cannot be found
   * without running the pickle's storage objects. */
  if (m->size >= 2 && m->base[0] == 0x80 && m->base[1] == 2)
    return status_fail(err, errlen, ZS_EPROTO,
                       "a torch.save file in the format before torch 1.6 (a bare pickle): save "
                       "it again with torch.save to get the zip format");
  return st_parse(m->base, m->size, h, err, errlen);
}

/* ---- the job ---------------------------------------------------------------- */

/* The spec of the job on shard 0 (GetInfo with_spec) into *out (the
 * caller's, spec_free). */
static int fetch_spec(const import_args *a, spec *out) {
  zs_client_options co;
  zs_client_options_init(&co);
  co.addresses = a->shards;
  co.num_shards = a->num_shards;
  co.rpc_timeout_ms = a->timeout_ms;
  co.max_retries = 2; /* fail fast when a shard is down */
  zs_client *c = NULL;
  if (zs_client_open(&co, &c) != ZS_OK) {
    fprintf(stderr, "zshard import: %s\n", zs_last_error());
    return -1;
  }
  Zshard__V1__GetInfoRequest req = ZSHARD__V1__GET_INFO_REQUEST__INIT;
  req.with_spec = 1;
  Zshard__V1__GetInfoResponse *r = NULL;
  rpc_status st;
  int rc =
      zc_call(c, 0, ZC_METHOD("GetInfo"), &req.base, &zshard__v1__get_info_response__descriptor,
              (ProtobufCMessage **)&r, a->timeout_ms, &st);
  char err[256] = "";
  int parsed = 0;
  if (rc != ZS_OK)
    fprintf(stderr, "zshard import: shard 0 (%s): %s: %s\n", zc_client_address(c, 0),
            zs_err_name(rc), st.message[0] ? st.message : zs_strerror(rc));
  else if (!r->spec && !(r->job && r->job[0]))
    fprintf(stderr,
            "zshard import: shard 0 (%s) holds no job (open the job first: a trainer's "
            "zs_open_job or zshard.torch.shard)\n",
            zc_client_address(c, 0));
  else if (!r->spec)
    fprintf(stderr,
            "zshard import: shard 0 (%s) did not describe its job '%.64s' (closed or replaced "
            "during the call, or a server without GetInfo's with_spec)\n",
            zc_client_address(c, 0), r->job);
  else if (spec_from_proto(out, r->spec, err, sizeof err) != 0)
    fprintf(stderr, "zshard import: shard 0 (%s) answered a spec this tool cannot take: %s\n",
            zc_client_address(c, 0), err);
  else {
    parsed = 1; /* from here on the spec is ours to free unless returned */
    if (spec_hash(out) == r->spec_hash)
      rc = 1;
    else
      fprintf(stderr,
              "zshard import: shard 0's spec does not hash to its spec hash %016" PRIx64 "\n",
              r->spec_hash);
  }
  if (parsed && rc != 1)
    spec_free(out);
  if (r)
    protobuf_c_message_free_unpacked(&r->base, NULL);
  zs_client_close(c);
  return rc == 1 ? 0 : -1;
}

/* A client that describes the job of `sp` and joins it, writing nothing. */
static int join_job(const import_args *a, const spec *sp, zs_client **out) {
  zs_client_options co;
  zs_client_options_init(&co);
  co.addresses = a->shards;
  co.num_shards = sp->num_shards;
  co.rpc_timeout_ms = a->timeout_ms;
  co.max_retries = 2;
  co.job = sp->job;
  co.world_size = sp->world_size;
  co.grad_accum = sp->grad_accum;
  co.split_threshold = sp->split_threshold;
  co.grad_reduce = sp->reduce == SPEC_REDUCE_SUM ? ZS_REDUCE_SUM : ZS_REDUCE_MEAN;
  co.param_dtype = sp->param_dtype;
  co.pipelined = (uint32_t)sp->pipelined;
  co.open_mode = ZS_OPEN_RESUME;
  co.transport = ZS_TRANSPORT_GRPC; /* state writes travel over gRPC only */
  zs_client *c = NULL;
  int rc = zs_client_open(&co, &c);
  for (uint32_t g = 0; rc == ZS_OK && g < sp->num_groups; g++) {
    const spec_group *sg = &sp->groups[g];
    zs_group_options go;
    zs_group_options_init(&go, sg->optimizer);
#define IMPORT_COPY_FIELD(kind, name, proto) go.name = sg->name;
    SPEC_GROUP_FIELDS(IMPORT_COPY_FIELD)
#undef IMPORT_COPY_FIELD
    rc = zs_add_group(c, &go, NULL);
  }
  for (uint32_t t = 0; rc == ZS_OK && t < sp->num_tensors; t++) {
    const spec_tensor *st = &sp->tensors[t];
    rc = zs_add_tensor(c, st->name, st->numel, st->group, st->ndim ? st->shape : NULL, st->ndim,
                       NULL);
  }
  /* Deferred: no initial weights to send (the job has them, or gets them
   * from its trainers); ZS_OPEN_RESUME: join, never create. */
  if (rc == ZS_OK)
    rc = zs_open_job_deferred(c);
  if (rc != ZS_OK) {
    fprintf(stderr, "zshard import: joining job '%s': %s\n", sp->job, zs_last_error());
    if (c)
      zs_client_close(c);
    return -1;
  }
  *out = c;
  return 0;
}

/* ---- the names -------------------------------------------------------------- */

static void print_shape(FILE *f, const uint64_t *shape, uint32_t ndim, uint64_t numel) {
  fputs("[", f);
  if (ndim == 0 && shape == NULL)
    fprintf(f, "%" PRIu64, numel);
  for (uint32_t d = 0; d < ndim; d++)
    fprintf(f, "%s%" PRIu64, d ? ", " : "", shape[d]);
  fputs("]", f);
}

/* 1 if the file's tensor has the model tensor's shape (a flat model tensor,
 * ndim 0, takes any shape of its element count). */
static int same_shape(const st_tensor *f, const spec_tensor *m) {
  if (m->ndim == 0)
    return f->numel == m->numel;
  if (f->ndim != m->ndim)
    return 0;
  for (uint32_t d = 0; d < f->ndim; d++)
    if (f->shape[d] != m->shape[d])
      return 0;
  return 1;
}

/* Prints "head"name, name, ... for the first IMPORT_MAX_LISTED of a list. */
static void list_name(size_t k, const char *head, const char *name) {
  if (k < IMPORT_MAX_LISTED)
    fprintf(stderr, "%s\"%.256s\"", k ? ", " : head, name);
}

static void end_list(size_t k) {
  if (k > IMPORT_MAX_LISTED)
    fprintf(stderr, " and %zu more. \n", k - IMPORT_MAX_LISTED);
  else if (k)
    fputs(". \n", stderr);
}

static const spec *names_spec; /* for by_name: qsort has no argument */

static int by_name(const void *a, const void *b) {
  return strcmp(names_spec->tensors[*(const uint32_t *)a].name,
                names_spec->tensors[*(const uint32_t *)b].name);
}

/* The model tensor called `name` (its index, which is the client's: the
 * job was described in spec order), or UINT32_MAX; `sorted` holds the
 * tensors' indices in name order. */
static uint32_t find_tensor(const spec *sp, const uint32_t *sorted, const char *name) {
  size_t lo = 0, hi = sp->num_tensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int d = strcmp(sp->tensors[sorted[mid]].name, name);
    if (d == 0)
      return sorted[mid];
    if (d < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return UINT32_MAX;
}

/* The model tensor of each file tensor into map[] (UINT32_MAX: none);
 * prints every mismatch as torch's load_state_dict(strict=True) words it.
 * Returns the number of mismatches. */
static size_t match_names(const spec *sp, const st_header *h, int partial, uint32_t *map) {
  uint8_t *seen = calloc(sp->num_tensors ? sp->num_tensors : 1, 1);
  uint32_t *sorted = calloc(sp->num_tensors ? sp->num_tensors : 1, sizeof *sorted);
  if (!seen || !sorted) {
    free(seen);
    free(sorted);
    fprintf(stderr, "zshard import: out of memory\n");
    return 1;
  }
  for (uint32_t t = 0; t < sp->num_tensors; t++)
    sorted[t] = t;
  names_spec = sp;
  qsort(sorted, sp->num_tensors, sizeof *sorted, by_name);
  size_t unexpected = 0, missing = 0, mismatched = 0;
  for (size_t i = 0; i < h->n; i++) {
    map[i] = find_tensor(sp, sorted, h->tensors[i].name);
    if (map[i] != UINT32_MAX)
      seen[map[i]] = 1;
  }
  free(sorted);
  /* torch's order: missing, unexpected, then each size mismatch. */
  for (uint32_t t = 0; t < sp->num_tensors && !partial; t++)
    if (!seen[t])
      list_name(missing++, "Missing key(s) in state_dict: ", sp->tensors[t].name);
  end_list(missing);
  for (size_t i = 0; i < h->n; i++)
    if (map[i] == UINT32_MAX)
      list_name(unexpected++, "Unexpected key(s) in state_dict: ", h->tensors[i].name);
  end_list(unexpected);
  for (size_t i = 0; i < h->n; i++) {
    const st_tensor *f = &h->tensors[i];
    if (map[i] == UINT32_MAX || same_shape(f, &sp->tensors[map[i]]))
      continue;
    const spec_tensor *m = &sp->tensors[map[i]];
    fprintf(stderr, "size mismatch for %s: copying a param with shape ", m->name);
    print_shape(stderr, f->shape, f->ndim, f->numel);
    fputs(" from checkpoint, the shape in current model is ", stderr);
    print_shape(stderr, m->ndim ? m->shape : NULL, m->ndim, m->numel);
    fputs(".\n", stderr);
    mismatched++;
  }
  free(seen);
  return unexpected + missing + mismatched;
}

/* ---- the writes -------------------------------------------------------------- */

/* A view saved whole (st_tensor.strided): its elements in row-major order
 * into buf as fp32, 16-bit ones through a small stage converted a batch at
 * a time. One copy, as for a converted tensor. */
static const float *gather_fp32(const uint8_t *src, const st_tensor *t, float *buf) {
  uint64_t idx[ST_MAX_DIMS] = {0}, off = 0;
  unsigned size = st_dtype_size(t->dtype);
  uint16_t stage[4096];
  size_t staged = 0;
  for (uint64_t e = 0; e < t->numel; e++) {
    if (size == 4)
      memcpy(&buf[e], src + off * 4, 4);
    else
      memcpy(&stage[staged++], src + off * 2, 2);
    if (staged == 4096 || (staged && e + 1 == t->numel)) {
      dtype_to_f32(t->dtype, stage, buf + e + 1 - staged, staged);
      staged = 0;
    }
    /* The next index, the last dimension fastest; tz_parse checked that
     * every element lies inside [begin, end). */
    for (uint32_t d = t->ndim; d-- > 0;) {
      if (++idx[d] < t->shape[d]) {
        off += t->stride[d];
        break;
      }
      off -= (t->shape[d] - 1) * t->stride[d];
      idx[d] = 0;
    }
  }
  return buf;
}

/* Tensor i's elements as fp32: straight from the mapping when they are
 * fp32, row-major and aligned, else gathered or converted into buf. */
static const float *as_fp32(const mapped *m, const st_header *h, const st_tensor *t, float *buf) {
  const uint8_t *src = m->base + h->data_start + t->begin;
  if (t->strided)
    return gather_fp32(src, t, buf);
  if (t->dtype == ZS_DTYPE_FP32 && (uintptr_t)src % _Alignof(float) == 0)
    return (const float *)(const void *)src;
  if (t->dtype == ZS_DTYPE_FP32) {
    memcpy(buf, src, (size_t)t->numel * sizeof(float));
    return buf;
  }
  if ((uintptr_t)src % 2 != 0) {
    /* 16-bit elements at an odd address: through a small aligned stage. */
    uint16_t stage[4096];
    for (uint64_t e = 0; e < t->numel; e += 4096) {
      size_t n = t->numel - e < 4096 ? (size_t)(t->numel - e) : 4096;
      memcpy(stage, src + e * 2, n * 2);
      dtype_to_f32(t->dtype, stage, buf + e, n);
    }
    return buf;
  }
  dtype_to_f32(t->dtype, src, buf, (size_t)t->numel);
  return buf;
}

/* Drops the mapping's pages of [begin, end) of the file from the resident
 * set (whole pages inside it only: a neighbour's bytes stay). */
static void drop_pages(const mapped *m, uint64_t begin, uint64_t end) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t b = (begin + page - 1) / page * page, e = end / page * page;
  if (e > b)
    madvise((void *)(uintptr_t)(m->base + b), (size_t)(e - b), MADV_DONTNEED);
}

static int write_all(const import_args *a, zs_client *c, const mapped *m, const st_header *h,
                     const uint32_t *map, uint64_t *bytes_out) {
  uint64_t largest = 0, total = 0;
  size_t todo = 0;
  for (size_t i = 0; i < h->n; i++)
    if (map[i] != UINT32_MAX) {
      largest = h->tensors[i].numel > largest ? h->tensors[i].numel : largest;
      total += h->tensors[i].end - h->tensors[i].begin;
      todo++;
    }
  float *buf = largest ? malloc((size_t)largest * sizeof(float)) : NULL;
  if (largest && !buf) {
    fprintf(stderr, "zshard import: out of memory for a buffer of %" PRIu64 " floats\n", largest);
    return -1;
  }
  uint64_t done = 0, last_ns = clock_now_ns();
  size_t k = 0;
  int rc = 0;
  for (size_t i = 0; i < h->n && rc == 0; i++) {
    const st_tensor *t = &h->tensors[i];
    if (map[i] == UINT32_MAX)
      continue;
    const float *src = as_fp32(m, h, t, buf);
    if (zs_state_write(c, map[i], ZS_STATE_MASTER, src, (size_t)t->numel * sizeof(float)) !=
        ZS_OK) {
      fprintf(stderr,
              "zshard import: %s\n  %zu of %zu tensors were written before it (the job now "
              "holds a mix: run the import again)\n",
              zs_last_error(), k, todo);
      rc = -1;
    }
    drop_pages(m, h->data_start + t->begin, h->data_start + t->end);
    done += t->end - t->begin;
    k++;
    uint64_t now = clock_now_ns();
    if (!a->quiet && (now - last_ns > 1000000000ull || k == todo)) {
      char b1[32], b2[32];
      printf("  %zu/%zu tensors, %s of %s\n", k, todo, cli_bytes((double)done, b1, sizeof b1),
             cli_bytes((double)total, b2, sizeof b2));
      fflush(stdout);
      last_ns = now;
    }
  }
  free(buf);
  *bytes_out = done;
  return rc;
}

/* This process's peak resident set (VmHWM), bytes; 0 when unknown. Its
 * own mapping's: unlike getrusage's maxrss, it does not carry the peak of
 * the process that forked this one across exec. */
static uint64_t peak_rss(void) {
  FILE *f = fopen("/proc/self/status", "re");
  if (!f)
    return 0;
  char line[256];
  unsigned long long kib = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmHWM: %llu kB", &kib) == 1)
      break;
  fclose(f);
  return (uint64_t)kib * 1024;
}

/* The library's workers allocate and free each 512 KiB write message on
 * their own glibc arenas, which by default hand the memory back (madvise)
 * and fault it in again for the next message (page faults led the
 * profile on the development VM). Fixed thresholds keep the freed messages
 * for reuse: importing 256 MiB of 16 MiB tensors ran 1.7 times as fast in
 * two interleaved pairs of runs, with the same peak resident set (37 and
 * 39 MiB). The environment's MALLOC_*_ settings win, as in the server. */
static void keep_freed_messages(void) {
  if (!getenv("MALLOC_MMAP_THRESHOLD_"))
    mallopt(M_MMAP_THRESHOLD, 4 << 20);
  if (!getenv("MALLOC_TRIM_THRESHOLD_"))
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

int cli_import(int argc, char **argv) {
  import_args a;
  int rc = parse_args(argc, argv, &a);
  if (rc >= 0)
    return rc;
  keep_freed_messages();
  mapped m = {0};
  st_header h = {0};
  spec sp = {0};
  zs_client *c = NULL;
  uint32_t *map = NULL;
  char err[512];
  int status = 1;
  if (map_file(a.path, &m) != 0)
    return 1;
  if (read_index(&m, &h, err, sizeof err) != 0) {
    fprintf(stderr, "zshard import: %s: %s\n", a.path, err);
    goto out;
  }
  if (fetch_spec(&a, &sp) != 0 || join_job(&a, &sp, &c) != 0)
    goto out;
  map = calloc(h.n ? h.n : 1, sizeof *map);
  if (!map) {
    fprintf(stderr, "zshard import: out of memory\n");
    goto out;
  }
  size_t errors = match_names(&sp, &h, a.partial, map);
  if (errors) {
    fprintf(stderr, "zshard import: %s does not fit job '%s' (above); nothing was written\n",
            a.path, sp.job);
    goto out;
  }
  uint64_t t0 = clock_now_ns(), bytes = 0;
  if (write_all(&a, c, &m, &h, map, &bytes) != 0)
    goto out;
  double s = (double)(clock_now_ns() - t0) / 1e9;
  uint64_t fp32 = 0;
  for (size_t i = 0; i < h.n; i++)
    fp32 += h.tensors[i].numel * sizeof(float);
  char b[32], r[32];
  /* GB/s of fp32 masters written: the figure to set beside a push's. */
  printf("imported %zu tensors from %s into job '%s': %s of tensor data, %" PRIu64
         " bytes of fp32 masters in %.3f s: %.3f GB/s; peak resident set %s (%" PRIu64 " bytes)\n",
         h.n, a.path, sp.job, cli_bytes((double)bytes, b, sizeof b), fp32, s,
         s > 0 ? (double)fp32 / s / 1e9 : 0.0, cli_bytes((double)peak_rss(), r, sizeof r),
         peak_rss());
  status = 0;
out:
  free(map);
  if (c)
    zs_client_close(c);
  if (sp.job || sp.tensors)
    spec_free(&sp);
  st_header_free(&h);
  if (m.base)
    munmap((void *)(uintptr_t)m.base, (size_t)m.size);
  return status;
}
