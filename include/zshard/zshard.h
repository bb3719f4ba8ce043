/*
 * zshard — the trainer's client library (libzshard).
 *
 * This is the single public header. Every public symbol starts with zs_ / ZS_;
 * everything else in the library is hidden. Functions return 0 (ZS_OK) or a
 * negative zs_status; zs_strerror() turns one into a sentence.
 *
 * How the ABI grows. A program built against one version of this header must
 * keep working with a later libzshard of the same SOVERSION, and fail cleanly
 * with an earlier one. Every struct the API passes in or out follows these
 * rules, which the library enforces in one place (client/lib/abi.c) and
 * tests/abi checks against an older copy of this header:
 *
 *   1. It starts with `size_t struct_size`, the size of the struct as the
 *      caller's header declares it. The zs_*_init() macros (and the macros
 *      zs_last_timing() and zs_estimate()) pass sizeof *(ptr) to a *_sized
 *      function; a caller that cannot use the macros (another language, a
 *      function pointer) calls that function with its own size.
 *   2. Fields are only ever appended. A field added after the first release of
 *      its struct has 0 as its default, so a zeroed field and a missing one
 *      mean the same thing.
 *   3. Fields are scalars and pointers only: no struct or array is embedded
 *      by value (each struct grows on its own; a related struct is passed by
 *      pointer, with its own struct_size), and no struct has padding at its
 *      end. struct_size is therefore a multiple of sizeof(size_t) and never
 *      cuts a field in two; another value, one below sizeof(size_t) or one
 *      above 4096 is refused with ZS_EINVAL as "not initialised".
 *   4. An init function writes exactly struct_size bytes: the library's
 *      defaults for the fields it knows, zeros beyond them.
 *   5. A struct the library reads: it takes min(struct_size, its own size)
 *      bytes; the fields the caller's struct lacks keep their defaults. Bytes
 *      beyond the fields the library knows (a program built against a newer
 *      header than the library) must be zero, as the library's init leaves
 *      them; anything else fails with ZS_EUNIMPL, because a setting the
 *      library cannot honour must not be dropped silently.
 *   6. A struct the library writes (zs_step_result, zs_timing, the
 *      zs_estimate_row array, zs_loss_scaler's state): it writes min(caller,
 *      own) bytes, zeroes the rest of the caller's struct (fields it does not
 *      know read as 0) and never a byte past struct_size; arrays are strided
 *      by the caller's struct size.
 *   7. Functions keep their signature; one that has to change gets a new
 *      name. The export map (client/lib/zshard.map) exports zs_* under
 *      ZSHARD_0, the SOVERSION is 0, and until 1.0 a release may still remove
 *      symbols or re-lay a struct (0.2 did both: the *_init functions became
 *      *_init_sized, so a program built against 0.1 fails to load instead of
 *      misreading a struct).
 */
#ifndef ZSHARD_ZSHARD_H
#define ZSHARD_ZSHARD_H

#include <stddef.h>
#include <stdint.h>

#include "zshard/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================== */
/* Conventions of the client API                                            */
/* ======================================================================== */
/*
 * Return values: every function returning int returns 0 (ZS_OK) or a negative
 * zs_status unless its comment says otherwise. When a function fails it also
 * leaves a sentence with the details (which shard, which tensor, what the
 * server said) for zs_last_error() on the calling thread.
 *
 * Option and result structs carry their own size in their first field
 * (`struct_size`; the rules are at the top of this header): always fill them
 * with the matching zs_*_init() macro, which sets struct_size and every
 * default, and then change the fields you need. Do not build them with an
 * initializer or a compound literal, which leave struct_size 0.
 *
 * Threads: unless a function says otherwise it may be called from any thread,
 * concurrently with any other call on the same client. The library runs its
 * own worker threads (see zs_client_options.threads); completion callbacks run
 * on them.
 *
 * Steps are 1-based: step s turns parameter version s-1 into version s. A
 * client starts at step version+1 of the job it opens (1 for a new job).
 */

/* The calling thread's description of the last failure of a zs_ call on this
 * thread: a static-per-thread string, never NULL, overwritten by the next
 * failure on the same thread (successful calls leave it alone). */
ZS_EXTERN const char *zs_last_error(void);

/* ======================================================================== */
/* Dynamic loss scaling (DeepSpeed semantics)                               */
/* ======================================================================== */
/*
 * A plain value type the trainer owns; zs_step uses one inside the client when
 * zs_client_options.loss_scaling is ZS_LOSS_SCALE_DYNAMIC, and a trainer that
 * manages scaling itself can use these functions directly.
 *
 * The rules are those of DeepSpeed's DynamicLossScaler: on an overflow the
 * step is skipped and, once `hysteresis` overflows have been absorbed, the
 * scale is divided by `factor` (never below `min_scale`); after `window`
 * iterations without an overflow the scale is multiplied by `factor` and the
 * hysteresis is restored.
 */
typedef struct zs_loss_scaler {
  size_t struct_size;  /* set by zs_loss_scaler_init */
  double scale;        /* the current scale; initial 2^16 */
  double min_scale;    /* 1 */
  double factor;       /* 2 */
  uint32_t window;     /* 1000 */
  uint32_t hysteresis; /* 2 (DeepSpeed's delayed_shift) */
  /* State: */
  uint32_t cur_hysteresis;
  int64_t iter;
  int64_t last_overflow_iter;
} zs_loss_scaler;

/* Fills `s`, the caller's struct of `size` bytes, with DeepSpeed's defaults
 * (scale 2^16, window 1000, hysteresis 2, min 1, factor 2), a fresh state
 * and struct_size = size. Use the macro. */
ZS_EXTERN void zs_loss_scaler_init_sized(zs_loss_scaler *s, size_t size);
#define zs_loss_scaler_init(s) zs_loss_scaler_init_sized((s), sizeof *(s))

/* Records one iteration's outcome (overflow 1 or 0) and updates s->scale
 * (and the state fields), reading and writing s->struct_size bytes of `s`.
 * Returns ZS_EINVAL for a NULL or uninitialised `s`. Not thread-safe for one
 * `s`: the caller serialises calls on it. */
ZS_EXTERN int zs_loss_scaler_update(zs_loss_scaler *s, int overflow);

/* ======================================================================== */
/* Client                                                                   */
/* ======================================================================== */

/* One trainer's connection to the N shards of one job. Opaque. */
typedef struct zs_client zs_client;

typedef enum zs_grad_reduce {
  ZS_REDUCE_MEAN = 0, /* the gradient is the mean over the W trainers */
  ZS_REDUCE_SUM = 1,  /* the gradient is their sum */
} zs_grad_reduce;

typedef enum zs_loss_scaling {
  ZS_LOSS_SCALE_NONE = 0,    /* loss scale 1 unless zs_step is given one */
  ZS_LOSS_SCALE_STATIC = 1,  /* static_loss_scale every step */
  ZS_LOSS_SCALE_DYNAMIC = 2, /* the client's zs_loss_scaler */
} zs_loss_scaling;

/* The order pushes and pulls go on the wire (zs_client_options.schedule). */
typedef enum zs_schedule {
  /* The ZSHARD_SCHEDULE environment variable ("fifo" or "rotated") if it is
   * set, else ZS_SCHEDULE_FIFO. */
  ZS_SCHEDULE_DEFAULT = 0,
  /* Every piece is submitted as soon as a worker takes it: a trainer sends
   * to all shards at once. */
  ZS_SCHEDULE_FIFO = 1,
  /* Pairwise exchange: trainer r sends its pieces round robin over the
   * shards starting at shard r, a few pushes and pulls in flight
   * (schedule_window),
   * so that at any moment each trainer sends to one shard and each shard
   * answers one trainer (with W <= N). */
  ZS_SCHEDULE_ROTATED = 2,
} zs_schedule;

/* How pushes and pulls travel (every other call uses gRPC). */
typedef enum zs_transport {
  /* The ZSHARD_TRANSPORT environment variable ("data" or "grpc") if it is
   * set, else ZS_TRANSPORT_DATA. */
  ZS_TRANSPORT_DEFAULT = 0,
  /* The framed TCP data plane (docs/PROTOCOL.md) to every shard that
   * advertises a data port in GetInfo; gRPC to a shard that advertises none. */
  ZS_TRANSPORT_DATA = 1,
  /* gRPC unary calls only. */
  ZS_TRANSPORT_GRPC = 2,
} zs_transport;

/* What zs_open_job may find on the shards (zs_client_options.open_mode). */
typedef enum zs_open_mode {
  /* Create the job, or join it as it is: a shard that already trained the
   * same model resumes at its version and the initial weights are ignored
   * (the behaviour of zshard 0.2). */
  ZS_OPEN_EITHER = 0,
  /* A new run: create the job. Every trainer of the run opens with it: the
   * same model still at version 0 (the first trainer created it) is joined;
   * a different job, or the same model already trained past version 0, fails
   * with ZS_EEXIST and a sentence naming it (close it first: zs_close_job,
   * `zshard close-job`). Initial weights other than those already written
   * at version 0 fail with ZS_EEXIST too. */
  ZS_OPEN_CREATE = 1,
  /* Resume the job on the shards: ZS_ENOTOPEN when a shard has none (nothing
   * is created), ZS_EHASH when it holds another. */
  ZS_OPEN_RESUME = 2,
  /* Join an elastic job as a new or restarted trainer (issue 26;
   * docs/CLIENT.md "Elastic trainers"): the job must be on the shards, as
   * for ZS_OPEN_RESUME, rank 0 passes no initial weights (NULL), and the
   * rank is admitted at the next step boundary every shard agrees on; its
   * first zs_step is that step's, and its pulls wait for the version before
   * it. A job with a fixed membership fails ZS_EINVAL. Every other mode
   * joins too when the job is elastic, but ignores a fixed membership. */
  ZS_OPEN_JOIN = 3,
} zs_open_mode;

typedef struct zs_client_options {
  size_t struct_size;
  /* Shard addresses in shard-id order, "host:port,host:port", or a pattern
   * with "{i}" replaced by 0..num_shards-1, e.g. "zshard-{i}.zshard:7070".
   * A replicated shard lists its replica set's members separated by '|',
   * in the order of the servers' --replicas: "h:1|h:2,h:3|h:4", or as a
   * pattern "zshard-a-{i}.zshard:7070|zshard-b-{i}.zshard:7070" (at most 8
   * members; see failover_ms). Required. Copied by zs_client_open. */
  const char *addresses;
  /* The number of shards (not replicas): with a pattern required; with a
   * list 0 or its length. */
  uint32_t num_shards;
  uint32_t rank;       /* this trainer, < world_size */
  uint32_t world_size; /* W trainers; default 1 */
  uint32_t grad_accum; /* M micro-batches per step and trainer; default 1 */
  /* The job's name (copied). Default "zshard". */
  const char *job;
  zs_grad_reduce grad_reduce; /* default ZS_REDUCE_MEAN */
  /* The shards' low-precision copy of the weights: ZS_DTYPE_BF16 (default) or
   * ZS_DTYPE_FP16. */
  zs_dtype param_dtype;
  /* Tensors with at least this many elements are split over all shards;
   * 0 means the default, 65536. */
  uint64_t split_threshold;
  /* Wire dtypes: gradients are converted to push_dtype before sending and
   * parameters travel as pull_dtype; 0 means "the dtype of the caller's
   * buffer" (no conversion). Default 0. ZS_DTYPE_INT8_BLOCK quantizes on
   * the wire (see error_feedback); a param group's own wire dtypes
   * (zs_group_options) win over these for its tensors. */
  zs_dtype push_dtype;
  zs_dtype pull_dtype;
  /* Worker threads issuing calls in parallel; 0: 2*N + 2, at most 32. */
  uint32_t threads;
  /* Coalescing: a worker that takes a piece smaller than the bucket size from
   * a shard's queue also takes the small pieces queued behind it for that
   * shard, up to this many bytes, and sends them over the data plane as one
   * batch request (up to 256 pieces of one step and micro-batch, or of one
   * version). No effect over gRPC, whose calls carry one piece each.
   * 0 disables. Defaults 1 MiB (see docs/CLIENT.md for measurements). */
  size_t reduce_bucket_size;    /* pushes */
  size_t allgather_bucket_size; /* pulls */
  /* After a pull of tensor t, start pulls of tensors t+1 .. t+prefetch_depth
   * (model order) for the same version into internal buffers; after a step,
   * of tensors 0 .. prefetch_depth-1. A later zs_pull of a prefetched tensor
   * takes the data from there. 0 (default) disables. */
  uint32_t prefetch_depth;
  /* Deadline of one call (push, pull transfer, open, init, apply), ms.
   * Default 30000. */
  uint32_t rpc_timeout_ms;
  /* How long zs_step waits for every trainer's contributions and a pull
   * waits for its parameter version, ms. Default 60000. */
  uint32_t step_timeout_ms;
  /* Retries of a call answered UNAVAILABLE, or of a data-plane transfer
   * whose connection failed (connection lost, shard restarting), with
   * exponential backoff from retry_initial_ms doubling up to retry_max_ms.
   * Defaults 20, 50, 2000: about 30 s in all, above the ~10 s gRPC's channel
   * takes to reconnect after a lost connection here. */
  uint32_t max_retries;
  uint32_t retry_initial_ms;
  uint32_t retry_max_ms;
  /* Loss scaling used by zs_step when it is given loss_scale 0. */
  zs_loss_scaling loss_scaling; /* default ZS_LOSS_SCALE_NONE */
  double static_loss_scale;     /* ZS_LOSS_SCALE_STATIC; default 1 */
  /* ZS_LOSS_SCALE_DYNAMIC: the scaler the client starts from, configuration
   * and state (a zs_loss_scaler_init'ed struct, then changed). The caller's;
   * read (copied) by zs_client_open only. NULL (default): DeepSpeed's
   * defaults, as zs_loss_scaler_init sets them. */
  const zs_loss_scaler *dynamic_loss_scaler;
  /* The transport of pushes and pulls; default ZS_TRANSPORT_DEFAULT. An
   * explicit ZS_TRANSPORT_DATA or ZS_TRANSPORT_GRPC wins over the
   * environment. */
  zs_transport transport;
  /* Data plane: TCP connections per shard; 0 means 1, at most 64. */
  uint32_t data_connections;
  /* Checkpoints (see zs_checkpoint): on rank 0, zs_step checkpoints the job
   * after every checkpoint_every-th step (0, the default: never); a failed
   * periodic checkpoint does not fail the step (zs_last_checkpoint tells). */
  uint32_t checkpoint_every;
  /* Deadline of one shard's checkpoint write or restore, ms; default
   * 600000. */
  uint32_t checkpoint_timeout_ms;
  /* What zs_open_job may find on the shards; default ZS_OPEN_EITHER. */
  zs_open_mode open_mode;
  /* Error feedback for lossy pushes (1 on, 0 off, the default): when a
   * push converts an fp32 gradient to a narrower wire dtype (push_dtype
   * ZS_DTYPE_INT8_BLOCK, or BF16/FP16), the client keeps what the wire
   * format lost (the residual, per tensor) and adds it to the tensor's next
   * push, so that no part of a gradient is lost for good, only delayed. It
   * costs 4 bytes per element of every tensor so pushed, for the life of
   * the client, plus 4 bytes per element of a push in flight. Was
   * `reserved0`, which had to be 0: the layout is unchanged. */
  uint32_t error_feedback;
  /* Security (docs/CLIENT.md, "Security"). Each string is the caller's and
   * only read during zs_client_open, which copies what it needs (a token
   * file is read then, once). A field left NULL (or "") takes its
   * environment variable, and unset that, nothing.
   * The shards' token, sent with every gRPC call ("authorization: Bearer")
   * and presented by every data-plane connection. Default: $ZSHARD_TOKEN,
   * else the first line of the file $ZSHARD_TOKEN_FILE names. */
  const char *token;
  /* PEM file of the CAs the shards' certificates must chain to; set, every
   * connection (gRPC and data plane) speaks TLS and checks the shard's
   * certificate. Default: $ZSHARD_TLS_CA; unset, plaintext. */
  const char *tls_ca_file;
  /* PEM files of this client's certificate chain and key, for shards that
   * require client certificates (mTLS); both or neither, and only with a
   * CA. Defaults: $ZSHARD_TLS_CERT, $ZSHARD_TLS_KEY. */
  const char *tls_cert_file;
  const char *tls_key_file;
  /* The name the shards' certificates must carry, when it is not the host
   * of their addresses (an IP address, a Service's short name). Default:
   * $ZSHARD_TLS_SERVER_NAME. */
  const char *tls_server_name;
  /* The pipelined step (1 on, 0 off, the default): the shards apply each
   * piece as soon as every trainer's contributions to it are in and answer
   * its pulls at once, so that pulls overlap pushes on a full-duplex link.
   * Part of the job's spec (every trainer must set the same). zs_step then
   * has no global gate: no clipping (max_grad_norm and clip_coef must be 0),
   * no overflow check (loss_scaling must not be ZS_LOSS_SCALE_DYNAMIC); it
   * sends the step's lr and returns without waiting for the shards, and the
   * next pulls wait for each piece (docs/CLIENT.md, "The pipelined step").
   * Its bits equal the gated step's without clipping. */
  uint32_t pipelined;
  /* Replicated shards (addresses "h:p|h:p,..."; docs/CLIENT.md, "Replica
   * sets and failover"): how long a shard's primary may fail to answer,
   * counted from its first failure, before the client promotes another
   * member of its replica set, ms. A failover takes at most this plus one
   * round of GetInfo (500 ms) and one Promote. 0: $ZSHARD_FAILOVER_MS,
   * unset 3000. Shards listed without '|' never fail over. */
  uint32_t failover_ms;
  /* The order pushes and pulls go on the wire (docs/CLIENT.md, "Traffic
   * schedules"); default ZS_SCHEDULE_DEFAULT. Only when bytes travel
   * changes: every schedule gives the same results, bit for bit. */
  zs_schedule schedule;
  /* ZS_SCHEDULE_ROTATED: pushes, and pulls, in flight at a time; 0 means 2
   * ($ZSHARD_SCHEDULE_WINDOW when set), at most 64. */
  uint32_t schedule_window;
  /* TCP congestion control of this client's data-plane connections
   * (TCP_CONGESTION on each socket, e.g. "cubic"; the host's default is left
   * as it is). NULL or "": $ZSHARD_TCP_CONGESTION, unset the host's default.
   * zs_client_open fails with ZS_EINVAL when the kernel lacks the algorithm
   * or does not let this process use it. Only read during the call. */
  const char *tcp_congestion;
  /* The job's trainer timeout, ms (docs/CLIENT.md, "Elastic trainers"):
   * when this client's zs_open_job creates the job, > 0 makes it elastic
   * with that timeout whatever the shards' --trainer-timeout-ms; 0 (the
   * default) takes the shards'. At most 3600000 (zs_open_job fails ZS_ERANGE,
   * from the shards, beyond). Ignored when the job is
   * already on the shards (its creator's value holds). */
  uint32_t trainer_timeout_ms;
  /* Per-socket pacing of this client's data-plane connections, Mbit/s:
   * the kernel sends on each socket at most this fast (SO_MAX_PACING_RATE;
   * Linux's TCP paces by itself, no fq qdisc needed). 0 (the default):
   * $ZSHARD_TCP_PACING_MBIT, unset no pacing. At most 100000; zs_client_open
   * fails with ZS_EINVAL above, or for a variable that is no such number.
   * Was `reserved1`, which had to be 0: the layout is unchanged. */
  uint32_t tcp_pacing_mbit;
} zs_client_options;

/* Fills `o`, the caller's struct of `size` bytes, with the defaults above
 * and struct_size = size. Use the macro. */
ZS_EXTERN void zs_client_options_init_sized(zs_client_options *o, size_t size);
#define zs_client_options_init(o) zs_client_options_init_sized((o), sizeof *(o))

/* Creates a client: checks the options (ZS_EINVAL also for a
 * ZSHARD_TRANSPORT that is neither "data" nor "grpc" when it applies), opens
 * (lazy) channels to the shards and starts the worker threads. No network
 * traffic happens yet. On success *out is a client owned by the caller,
 * released with zs_client_close. `o` and the strings it points to are only
 * read during the call. */
ZS_EXTERN int zs_client_open(const zs_client_options *o, zs_client **out);

/* Closes the client: queued transfers are cancelled (their requests complete
 * with ZS_ECANCELED and their callbacks run), gRPC calls already on the wire
 * are waited for (at most their deadlines), data-plane transfers in flight
 * are cancelled, the threads stop and the client is freed. Requests still
 * held by the caller stay valid until zs_wait. Any later use of `c` fails
 * with ZS_ECLOSED (the library keeps a registry of live clients), although
 * holding on to a closed handle is a bug. NULL is accepted. Must not be
 * called from a completion callback. */
ZS_EXTERN int zs_client_close(zs_client *c);

/* ---- Describing the model (before zs_open_job) ------------------------- */

typedef struct zs_group_options {
  size_t struct_size;
  zs_optimizer optimizer;
  double lr_scale;            /* this group's lr = the step's lr * lr_scale; default 1 */
  double beta1, beta2, eps;   /* adam/adamw 0.9, 0.999, 1e-8; lion 0.9, 0.99 (no eps) */
  double weight_decay;        /* adamw 0.01, adam 0, sgd 0 (torch's defaults), lion 0 */
  double momentum, dampening; /* sgd; 0, 0 */
  int nesterov;               /* sgd; 0 */
  int bias_correction;        /* adam/adamw; 1 */
  /* Wire dtypes of this group's tensors, over the client's push_dtype and
   * pull_dtype; 0 (default): the client's. E.g. ZS_DTYPE_BF16 for a group
   * of norms and biases in a job that sends int8 blocks. A trainer's own
   * choice: not part of the job, the shards accept any wire dtype. */
  zs_dtype push_dtype;
  zs_dtype pull_dtype;
} zs_group_options;

/* Fills `g`, the caller's struct of `size` bytes, with torch's defaults for
 * `optimizer` and struct_size = size. Use the macro. */
ZS_EXTERN void zs_group_options_init_sized(zs_group_options *g, zs_optimizer optimizer,
                                           size_t size);
#define zs_group_options_init(g, optimizer)                                                        \
  zs_group_options_init_sized((g), (optimizer), sizeof *(g))

/* Adds a param group; *id (may be NULL) gets its index (0, 1, ...). If no
 * group is added before zs_open_job, one AdamW group with torch's defaults is
 * used. `g` is only read during the call; the fields a shorter (older)
 * struct lacks take torch's defaults for its optimizer. Returns ZS_EINVAL
 * after zs_open_job. */
ZS_EXTERN int zs_add_group(zs_client *c, const zs_group_options *g, uint32_t *id);

/* Adds a tensor (the model's tensors in a fixed order, the same on every
 * trainer); *id (may be NULL) gets its index, which the transfer functions
 * take. `name` (unique, at most 256 bytes) and `shape` (ndim entries whose
 * product is numel; NULL with ndim 0 for a flat tensor) are copied. */
ZS_EXTERN int zs_add_tensor(zs_client *c, const char *name, uint64_t numel, uint32_t group,
                            const uint64_t *shape, uint32_t ndim, uint32_t *id);

/* Registers the job on every shard (creating it or verifying that the shard's
 * job has the same spec hash) and, on rank 0, writes the initial fp32 weights
 * of every piece. init_weights has one pointer per tensor, in tensor order,
 * each to numel floats; it is read only during the call, is required on rank
 * 0 and ignored (may be NULL) elsewhere. Other ranks' first pulls wait until
 * rank 0 has written the weights. What the shards may already hold is
 * zs_client_options.open_mode's to say (ZS_EEXIST, ZS_ENOTOPEN are the modes'
 * refusals; after one, shards that did take the open hold the job at version
 * 0: a repeated zs_open_job joins it there, `zshard close-job` removes it).
 * Opening a job the shards have already trained (ZS_OPEN_EITHER,
 * ZS_OPEN_RESUME) resumes at its version (the initial weights are then
 * ignored) and, with ZS_LOSS_SCALE_DYNAMIC, sets the client's loss scaler to
 * the state zs_step left for that version (the shards keep it with the
 * weights, in checkpoints too; a job stepped without it leaves the scaler as
 * configured).
 * With the data plane (zs_client_options.transport) it then asks every shard
 * for its data port (GetInfo) and connects to it, at the host of the shard's
 * address. Returns ZS_EHASH if a shard holds a different job, ZS_EINVAL if a
 * shard's id or shard count does not match the address list, ZS_ECONN if a
 * shard's advertised data port cannot be reached. */
ZS_EXTERN int zs_open_job(zs_client *c, const float *const *init_weights);

/* Deferred initialisation, for a model too large to hold whole on one
 * trainer: opens the job as zs_open_job does, but sends no initial weights.
 * The job's creator (rank 0 by convention) then sends each tensor's with
 * zs_init_tensor, one tensor at a time, and may free it in between; the
 * shards serve pulls and take pushes once every piece has its weights
 * (until then a pull waits, up to its deadline: the other ranks call
 * zs_wait_initialized first). Resuming a job the shards already trained
 * (zs_current_step > 1) needs no initial weights. */
ZS_EXTERN int zs_open_job_deferred(zs_client *c);

/* Sends tensor `tensor`'s initial weights (zs_tensor_numel floats, fp32, at
 * `weights`, which the call only reads and the caller owns) to the shards
 * that own its slices, in chunks of 1 MiB, and returns once they hold them.
 * Sending the same weights again is harmless; different ones for a tensor a
 * shard already initialised fail with ZS_EEXIST, and a job that has moved
 * past version 0 ignores them. Needs an open job (ZS_ENOTOPEN);
 * ZS_ENOTFOUND for a tensor that does not exist. */
ZS_EXTERN int zs_init_tensor(zs_client *c, uint32_t tensor, const float *weights);

/* Waits until every shard holds the job's initial weights (GetInfo, polled
 * every 10 to 200 ms), at most `timeout_ms` (0: without limit); ZS_ETIMEDOUT
 * then, with the number of shards still waiting. */
ZS_EXTERN int zs_wait_initialized(zs_client *c, uint64_t timeout_ms);

/* Closes the job on every shard (the CloseJob call): each shard frees the
 * job's state and is empty again, ready for the next job, without a restart;
 * `zshard status` then shows no job. For the end of a run: call it from one
 * trainer (rank 0), after every other trainer is done with the job. Calls of
 * the job still waiting on a shard (another trainer's pull, zs_step) fail
 * with ZS_ENOTOPEN, as does every later one. A shard that has no job (closed
 * already) is not an error, so the call can be repeated after a failure. A
 * shard with another job open is ZS_EHASH and keeps it; one taking a
 * checkpoint or restore of the job answers ZS_ENOTREADY (retry later).
 * Afterwards this client's job is not open (transfers and zs_step fail with
 * ZS_ENOTOPEN) and it cannot open one again: close the client. Needs an
 * open job (ZS_ENOTOPEN); must not run concurrently with zs_step. */
ZS_EXTERN int zs_close_job(zs_client *c);

/* ---- Inspecting the job -------------------------------------------------- */

/* Number of tensors added so far. */
ZS_EXTERN uint32_t zs_num_tensors(const zs_client *c);
/* numel of tensor t, or 0 if there is no such tensor. */
ZS_EXTERN uint64_t zs_tensor_numel(const zs_client *c, uint32_t t);
/* Where tensor t lives (after zs_open_job): *n gets the number of its slices.
 * A tensor of at least split_threshold elements has one slice per shard (the
 * last ones may be empty and are then not counted), a smaller one a single
 * slice on one shard. Returns ZS_ENOTOPEN before zs_open_job, ZS_ENOTFOUND
 * for a tensor that does not exist. */
ZS_EXTERN int zs_tensor_slices(const zs_client *c, uint32_t t, uint32_t *n);
/* Slice i (0 <= i < the count above) of tensor t: the shard that owns it and
 * its elements [offset, offset + numel) of the tensor. Any out pointer may be
 * NULL. Every trainer and every shard computes the same layout from the spec. */
ZS_EXTERN int zs_tensor_slice(const zs_client *c, uint32_t t, uint32_t i, uint32_t *shard,
                              uint64_t *offset, uint64_t *numel);
/* Index of the tensor called `name`. ZS_ENOTFOUND if none. */
ZS_EXTERN int zs_find_tensor(const zs_client *c, const char *name, uint32_t *id);
/* The step the next zs_step will complete (version + 1), 0 before the job
 * is open. */
ZS_EXTERN uint64_t zs_current_step(const zs_client *c);
/* The loss scale the trainer multiplies its loss by for the current step
 * (1 without loss scaling). */
ZS_EXTERN double zs_loss_scale(const zs_client *c);
/* The spec hash of the open job (0 before zs_open_job). */
ZS_EXTERN uint64_t zs_spec_hash(const zs_client *c);

/* ======================================================================== */
/* Transfers                                                                 */
/* ======================================================================== */

/* A pending push or pull. Created by zs_push / zs_pull, owned by the caller
 * and released by zs_wait (and only by it). */
typedef struct zs_request zs_request;

/* Completion callback: runs once, with the request's status, on a library
 * thread: a worker, a data-plane I/O thread, or, for a transfer cancelled by
 * zs_client_close, the thread closing the client. It may run before the call
 * that started the transfer returns (on one of those threads), never inside
 * it on the caller's thread. It must not block (no
 * zs_wait, no synchronous transfer, no zs_step, no zs_client_close) but may
 * start new transfers. When status is not ZS_OK, zs_last_error() called in
 * the callback returns the failure's sentence (naming the tensor and shard),
 * as it would after zs_wait. */
typedef void (*zs_request_cb)(void *arg, int status);

/* Pushes the gradient of tensor `tensor` for micro-batch `micro` (< M) of the
 * current step: numel elements of `dtype` at `grad` (nbytes must be
 * zs_dtype_bytes(dtype, numel)), sent to every owning shard in parallel
 * (converted to push_dtype first if that differs). `grad` is the caller's and
 * must stay valid and unchanged until the request completes. Each (tensor,
 * micro) is pushed once per step (ZS_EEXIST otherwise). With `req` NULL the
 * call waits for completion; otherwise *req is a request the caller must
 * zs_wait.
 * Must not be called while zs_step runs on the same client.
 *
 * grad NULL with nbytes 0 pushes "no gradient" (dtype is not looked at;
 * error feedback keeps the tensor's residual): when no trainer gave the
 * tensor a gradient in any micro-batch of the step, the shards skip it (its
 * weights, moments and step count stay, as torch skips a parameter whose
 * .grad is None); when one did, this push counts as zeros (DDP's
 * find_unused_parameters). A server of 0.2 or before refuses it (ZS_ESIZE). */
ZS_EXTERN int zs_push(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad,
                      zs_dtype dtype, size_t nbytes, zs_request **req);

/* Pulls tensor `tensor`'s parameters of version current_step - 1 (waiting on
 * the shards until they have it) into `dst`: numel elements of `dtype`
 * (nbytes = zs_dtype_bytes(dtype, numel)). `dst` is the caller's and must
 * stay valid and untouched until the request completes; if the request fails
 * its contents are unspecified (the data plane writes pieces into it as they
 * arrive). With `req` NULL the call waits; otherwise *req is a request the
 * caller must zs_wait. */
ZS_EXTERN int zs_pull(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
                      zs_request **req);

/* The same with a completion callback instead of a request handle: on success
 * cb(arg, status) is called exactly once, later, from a library thread; when
 * the function returns an error the callback is never called. */
ZS_EXTERN int zs_push_cb(zs_client *c, uint32_t tensor, uint32_t micro, const void *grad,
                         zs_dtype dtype, size_t nbytes, zs_request_cb cb, void *arg);
ZS_EXTERN int zs_pull_cb(zs_client *c, uint32_t tensor, void *dst, zs_dtype dtype, size_t nbytes,
                         zs_request_cb cb, void *arg);

/* Batches: n pushes (or pulls) submitted in one call, as n calls of zs_push
 * (zs_pull) would, for a fraction of the cost: the library wakes its workers
 * once for the whole batch rather than once per tensor, and may coalesce the
 * batch's pieces into fewer messages. tensors, grads/dsts and nbytes are
 * arrays of n entries (the buffers' ownership is zs_push's/zs_pull's: each
 * must stay valid until its request completes); all pushes are of micro-batch
 * `micro` and all buffers of `dtype`. Every entry is checked before anything
 * is submitted, so a refused batch submits nothing (the sentence names the
 * entry); a push batch may not name a tensor twice. With reqs (an array of n)
 * each entry's request is returned there, to zs_wait each; with reqs NULL the
 * call waits for all and returns the first failure. In the one case where a
 * batch fails half-way (another thread pushed one of its tensors meanwhile),
 * the requests of the entries before it are in reqs and must be waited; the
 * rest are NULL. */
/* An entry of a push batch with grads[i] NULL and nbytes[i] 0 is "no
 * gradient", as in zs_push. */
ZS_EXTERN int zs_push_many(zs_client *c, uint32_t n, const uint32_t *tensors, uint32_t micro,
                           const void *const *grads, zs_dtype dtype, const size_t *nbytes,
                           zs_request **reqs);
ZS_EXTERN int zs_pull_many(zs_client *c, uint32_t n, const uint32_t *tensors, void *const *dsts,
                           zs_dtype dtype, const size_t *nbytes, zs_request **reqs);

/* Waits for `req` to complete, returns its status and frees it: `req` is
 * invalid afterwards. May be called from any one thread (not from a
 * callback). Works after the client was closed. */
ZS_EXTERN int zs_wait(zs_request *req);

/* 1 if `req` has completed (zs_wait then returns at once), 0 if not,
 * ZS_EINVAL for NULL. Does not free the request. */
ZS_EXTERN int zs_test(const zs_request *req);

/* Waits until every push of the current step issued so far by this client
 * has completed; returns the first push failure of the step, if any. */
ZS_EXTERN int zs_wait_pushes(zs_client *c);

/* ======================================================================== */
/* Step                                                                      */
/* ======================================================================== */

/* Where one step's wall time went, in milliseconds, measured on this client
 * from the end of the previous zs_step (or zs_open_job) to the end of this
 * one. push: time spent in zs_push / waiting for pushes (including zs_step's
 * drain of outstanding pushes); pull_wait: time spent waiting for pulls;
 * step: zs_step's statistics and apply; compute: the rest, i.e. the trainer's
 * own work between calls. With several trainer threads the waits of different
 * threads may overlap and compute is clamped at 0. */
typedef struct zs_timing {
  size_t struct_size; /* written by zs_last_timing: the caller's size */
  double total_ms, compute_ms, push_ms, pull_wait_ms, step_ms;
  uint64_t bytes_pushed; /* wire bytes of gradients sent this step */
  uint64_t bytes_pulled; /* wire bytes of parameters received this step */
  uint64_t retries;      /* calls retried after UNAVAILABLE */
} zs_timing;

/* The result of one zs_step. The step's timing is not in it (a struct is
 * never embedded in another, so that each can grow): zs_last_timing gives it
 * until the next zs_step. */
typedef struct zs_step_result {
  size_t struct_size;
  uint64_t step;          /* the step this call completed */
  uint64_t version;       /* parameter version after it (== step) */
  int applied;            /* 1: the optimizer ran; 0: skipped (overflow) */
  int overflow;           /* an inf/NaN was in the gradient */
  double grad_norm;       /* L2 norm of the reduced gradient divided by the
                             loss scale, before clipping (inf on overflow) */
  double clip_coef;       /* min(1, max_norm / (grad_norm + 1e-6)), or 1 */
  float coef;             /* sent to the shards: clip_coef / loss_scale */
  double loss_scale;      /* used for this step */
  double next_loss_scale; /* to use for the next step */
  /* The step's membership (docs/CLIENT.md "Elastic trainers"): how many
   * ranks contributed to it (the world size unless the shards' trainer
   * timeout left some out), and this rank's place among them, from 0 (a
   * data loader re-shards by these). */
  uint32_t num_members;
  uint32_t member_rank;
} zs_step_result;

/* Fills `r`, the caller's struct of `size` bytes, with zeros and
 * struct_size = size. Use the macro. */
ZS_EXTERN void zs_step_result_init_sized(zs_step_result *r, size_t size);
#define zs_step_result_init(r) zs_step_result_init_sized((r), sizeof *(r))

/* Completes the current step s (zs_step_ex, below, takes per-group learning
 * rates and an external clipping coefficient): waits for this client's
 * pushes, collects the gradient statistics of step s from every shard (waiting up to
 * step_timeout_ms for every trainer's contributions), computes the global
 * gradient norm and overflow flag exactly as every other trainer does, and
 * applies step s on every shard with learning rate `lr`, clipping to
 * `max_grad_norm` (0: no clipping) and loss scale `loss_scale` (0: the
 * client's loss scaling). On overflow the step is skipped on every shard. On
 * success (applied or skipped) the client moves to step s+1 and `out` (may be
 * NULL; else initialised with zs_step_result_init) says what happened. On
 * ZS_ETIMEDOUT zs_last_error() names the ranks and tensors still missing.
 * On any failure the client stays at step s and zs_step may be called again
 * (after a timeout, once the missing trainer is back; after a failed push,
 * once that tensor was pushed again). One zs_step at a time per client, with
 * no zs_push running concurrently. */
ZS_EXTERN int zs_step(zs_client *c, double lr, double max_grad_norm, double loss_scale,
                      zs_step_result *out);

/* The options of zs_step_ex. */
typedef struct zs_step_options {
  size_t struct_size;
  /* The learning rate; each group's is lr * lr_scale (zs_group_options)
   * unless group_lr is given. Default 0. */
  double lr;
  /* NULL (default), or num_group_lr learning rates, one per param group in
   * zs_add_group order, each finite and >= 0, used as they are for this
   * step (lr_scale is not applied): what a scheduler sets in torch's
   * param_groups. num_group_lr must then equal the number of groups
   * (ZS_EINVAL otherwise). The caller's, read during the call. Every
   * trainer passes the same values. */
  const double *group_lr;
  uint32_t num_group_lr;
  uint32_t reserved0; /* must be 0 */
  /* Clip the gradient's global norm to this (0, default: no clipping). */
  double max_grad_norm;
  /* The loss scale the loss was multiplied by (0, default: the client's
   * loss scaling, as zs_step's loss_scale 0). */
  double loss_scale;
  /* > 0: the clipping coefficient to use, computed elsewhere (for instance
   * over more parameters than this job's), instead of the one max_grad_norm
   * gives; finite. The gradient is multiplied by clip_coef / loss_scale.
   * 0 (default): computed from max_grad_norm. */
  double clip_coef;
  /* This step's values of the groups' other hyper-parameters, as a
   * scheduler sets them in torch's param_groups (OneCycleLR and CyclicLR
   * cycle SGD's momentum or Adam's beta1): each NULL (default: every group
   * keeps its zs_group_options value) or an array of one double per param
   * group (the job's group count, in zs_add_group order), used for this
   * step only. The caller's, read during the call. Every trainer passes the
   * same values. The shards refuse (ZS_EINVAL, nothing applied) a value
   * outside torch's ranges (0 <= beta1, beta2 < 1; eps, weight_decay,
   * momentum >= 0; dampening in [0, 1]; all finite), an SGD group's momentum
   * that is 0 when its zs_group_options momentum is not or the reverse (the
   * momentum buffer exists from the first step or never), and a nesterov
   * group without momentum > 0 and dampening 0. Checkpoints keep none of
   * them: the trainer sends the values every step. */
  const double *group_beta1;
  const double *group_beta2;
  const double *group_eps;
  const double *group_weight_decay;
  const double *group_momentum;
  const double *group_dampening;
} zs_step_options;

/* Fills `o`, the caller's struct of `size` bytes, with the defaults above
 * (every field 0) and struct_size = size. Use the macro. */
ZS_EXTERN void zs_step_options_init_sized(zs_step_options *o, size_t size);
#define zs_step_options_init(o) zs_step_options_init_sized((o), sizeof *(o))

/* zs_step with options: the same contract, and zs_step(c, lr, m, s, out) is
 * zs_step_ex with lr, max_grad_norm m and loss_scale s. `o` is read during
 * the call; out may be NULL. The result's clip_coef is the one used. */
ZS_EXTERN int zs_step_ex(zs_client *c, const zs_step_options *o, zs_step_result *out);

/* The global gradient norm of the current step without applying it: what
 * zs_step would report as grad_norm (and overflow), for a trainer that
 * decides the clipping coefficient itself (over this job's parameters and
 * others) and then passes it to zs_step_ex as clip_coef. Waits for this
 * client's pushes and for every trainer's contributions (GradStats, as
 * zs_step does; the shards keep the answer, so the zs_step that follows asks
 * again at no cost). loss_scale as zs_step's (0: the client's loss scaling).
 * The client stays at its step; a failed push is reported here and again by
 * zs_step. grad_norm and overflow may be NULL. Must not run concurrently
 * with zs_step. */
ZS_EXTERN int zs_grad_norm(zs_client *c, double loss_scale, double *grad_norm, int *overflow);

/* The timing of the last completed step (zeros before the first) into `out`,
 * the caller's struct of `size` bytes (its struct_size is set to size; it
 * needs no init). Use the macro, which passes sizeof *(out). */
ZS_EXTERN int zs_last_timing_sized(const zs_client *c, zs_timing *out, size_t size);
#define zs_last_timing(c, out) zs_last_timing_sized((c), (out), sizeof *(out))

/* ======================================================================== */
/* Checkpoints (docs/CHECKPOINTS.md)                                         */
/* ======================================================================== */
/*
 * Shards started with --state-dir write checkpoints there. The checkpoint of
 * step s is the job's state at parameter version s: every shard's master
 * weights, optimizer moments and step count. A shard that restarts loads the
 * newest complete checkpoint of its state directory; a trainer that then
 * finds it behind the cluster (ZS_EBEHIND, whose message names the
 * checkpoint) restores the whole job to a checkpoint every shard has and
 * continues from there.
 */

/* Checkpoints the job at step `step` (0: the version this client is at,
 * zs_current_step() - 1): every shard writes and fsyncs its file (a shard
 * below that version waits for it, up to checkpoint_timeout_ms), and once all
 * have, every shard commits the checkpoint. On failure nothing is committed,
 * the previous checkpoints stay as they were, and zs_last_error() names the
 * shard and the reason (a full disk, an unwritable directory...). Call it
 * from one trainer (rank 0). Needs an open job; blocks. */
ZS_EXTERN int zs_checkpoint(zs_client *c, uint64_t step);

/* Replaces the state of every shard by complete checkpoint `step`, or, with
 * step 0, by the newest checkpoint complete on every shard (falling back to
 * older ones when a shard cannot load it). On success the client continues
 * at the step after the checkpoint: zs_current_step() says which, and the
 * trainer resumes its data from there; with ZS_LOSS_SCALE_DYNAMIC the loss
 * scaler is back at the checkpoint's state too (scale, hysteresis and
 * counters; zs_loss_scale() reports it), unless the checkpoint holds none.
 * Every trainer of the job calls it (after the first, the shards already
 * hold the checkpoint and nothing changes). Also works after zs_open_job
 * failed with ZS_EBEHIND: call zs_open_job again afterwards. Waits for this
 * client's pushes first; must not run concurrently with zs_step or transfers
 * on the same client. */
ZS_EXTERN int zs_restore(zs_client *c, uint64_t step);

/* The newest step that every shard holds a complete checkpoint of (and can
 * load); ZS_ENOTFOUND when there is none. Needs zs_open_job to have been
 * called (it may have failed with ZS_EBEHIND). */
ZS_EXTERN int zs_latest_checkpoint(zs_client *c, uint64_t *step);

/* The outcome of this client's last checkpoint attempt (zs_checkpoint or
 * periodic): ZS_OK when it succeeded or none was made, else its failure,
 * described by zs_last_error(). *step (may be NULL) gets the step of the
 * last checkpoint committed by this client, 0 if none. */
ZS_EXTERN int zs_last_checkpoint(const zs_client *c, uint64_t *step);

/* ======================================================================== */
/* Optimizer state (docs/CLIENT.md)                                          */
/* ======================================================================== */
/*
 * The shards' optimizer state of one tensor, whole, in fp32: the master
 * weights, Adam(W)'s exp_avg and exp_avg_sq, SGD's momentum buffer and
 * Lion's exp_avg (ZS_STATE_EXP_AVG), and the optimizer step count the bias corrections use
 * (torch's state 'step'): what a trainer needs to hand a run to another
 * optimizer and take one over (torch's state_dict / load_state_dict). The
 * library splits a tensor per piece and each piece in chunks of 1 MiB (gRPC
 * ReadState / WriteState, whatever the transport of pushes and pulls).
 *
 * Which arrays exist follows the tensor's param group: master always,
 * exp_avg for Adam, AdamW, Lion and SGD with momentum, exp_avg_sq for Adam
 * and AdamW; asking for another is ZS_EINVAL. Failures name the tensor, the
 * shard and the server's reason.
 */

/* Reads array `which` of tensor `tensor` (numel float32, nbytes = numel * 4,
 * float-aligned) into dst, the caller's buffer, written only during the
 * call (its contents are unspecified after a failure). Every piece is read
 * at one version on its shard; pieces on different shards that answer
 * different versions (a step ran meanwhile) fail the call with ZS_ESTEP:
 * read while the job is idle (between zs_step and the next push) for a
 * consistent copy. Needs an open job; may run concurrently with transfers. */
ZS_EXTERN int zs_state_read(zs_client *c, uint32_t tensor, zs_state_array which, float *dst,
                            size_t nbytes);

/* Overwrites array `which` of tensor `tensor` on its shards with src (numel
 * float32, nbytes = numel * 4, float-aligned; the caller's, only read during
 * the call). Writing ZS_STATE_MASTER also refreshes the low-precision copy
 * the pulls serve, so the next pull returns the new weights, and drops what
 * this client prefetched. A write is not a step: the version stays. It is
 * refused, changing nothing on the shard that refuses, with ZS_ENOTREADY
 * while a step is in progress: this client pushed gradients of the current
 * step, or a shard received a contribution of it from any trainer. Every
 * trainer must therefore hold the job idle (no push, no zs_step) while one
 * writes, for instance between two barriers; a failure part-way may leave
 * some pieces written: repeat the call, which is idempotent. Other trainers'
 * prefetched pulls of the old weights are not dropped: either they have not
 * pulled since their last zs_step (prefetch_depth 0, or the state is loaded
 * right after zs_open_job), or each of them writes the same values too. Must
 * not run concurrently with zs_step on the same client (ZS_EINVAL). */
ZS_EXTERN int zs_state_write(zs_client *c, uint32_t tensor, zs_state_array which, const float *src,
                             size_t nbytes);

/* The optimizer step count of the job (applied, not skipped, steps; a
 * restore or zs_set_optimizer_steps sets it; each tensor also has its own,
 * zs_tensor_steps) into *steps: every shard's, which
 * must agree (ZS_EBEHIND names the shard that does not). */
ZS_EXTERN int zs_optimizer_steps(zs_client *c, uint64_t *steps);

/* Sets the optimizer step count on every shard: the next applied step is
 * steps + 1 in the bias corrections (Adam, AdamW) and, for SGD with momentum,
 * a count above 0 makes the next step use the momentum buffer rather than
 * start it from the gradient. For a state taken from torch, steps is its
 * 'step' (Adam, AdamW), or 1 for SGD with momentum buffers. The same rules
 * as zs_state_write (between steps only, ZS_ENOTREADY otherwise); the
 * version stays. */
ZS_EXTERN int zs_set_optimizer_steps(zs_client *c, uint64_t steps);

/* Tensor `tensor`'s own step count into *steps: the applied steps that gave
 * it a gradient (a push of "no gradient" from every trainer skips a step:
 * see zs_push), torch's per-parameter state['step'], which its bias
 * corrections (Adam, AdamW) and SGD's first momentum step follow. Every
 * shard holding a slice of it must agree (ZS_EBEHIND names the one that
 * does not). zs_set_optimizer_steps sets every tensor's count too. */
ZS_EXTERN int zs_tensor_steps(zs_client *c, uint32_t tensor, uint64_t *steps);

/* Sets tensor `tensor`'s step count on its shards, under the rules of
 * zs_state_write (between steps only, ZS_ENOTREADY otherwise); the version
 * stays. For a torch state whose parameters are at different 'step's: call
 * zs_set_optimizer_steps first (it sets every tensor's), then this for
 * those that differ. A server without per-tensor counts is ZS_EUNIMPL. */
ZS_EXTERN int zs_set_tensor_steps(zs_client *c, uint32_t tensor, uint64_t steps);

/* ======================================================================== */
/* Memory and traffic estimates (`zshard estimate`)                          */
/* ======================================================================== */

typedef struct zs_estimate_input {
  size_t struct_size;
  uint64_t params; /* P, total parameters */
  /* L, parameters of the largest layer: what ZeRO-3 gathers and zshard pulls
   * at a time, the working-memory term. 0 (default): not known, and working
   * memory is left out (working_bytes 0) rather than guessed. */
  uint64_t largest_layer;
  uint32_t trainers;    /* W */
  uint32_t shards;      /* N (zshard only) */
  zs_dtype grad_dtype;  /* gradients on the wire; default BF16 */
  zs_dtype param_dtype; /* parameters on the wire and in trainer memory; BF16 */
  double trainer_gbps;  /* trainer NIC, Gbit/s each way; default 100 */
  double shard_gbps;    /* shard NIC, Gbit/s each way; 0: trainer_gbps */
  int pull_in_backward; /* zshard pulls parameters again in backward */
  /* K, bytes of optimizer state per parameter (fp32 master weights and
   * moments); 0 (default): 12, mixed-precision Adam as in the ZeRO paper. */
  uint32_t optimizer_bytes;
} zs_estimate_input;

/* Fills `in`, the caller's struct of `size` bytes, with the defaults (params
 * and largest_layer 0, W = N = 1) and struct_size = size. Use the macro. */
ZS_EXTERN void zs_estimate_input_init_sized(zs_estimate_input *in, size_t size);
#define zs_estimate_input_init(in) zs_estimate_input_init_sized((in), sizeof *(in))

typedef enum zs_strategy {
  ZS_STRATEGY_DP = 0,
  ZS_STRATEGY_ZERO1 = 1,
  ZS_STRATEGY_ZERO2 = 2,
  ZS_STRATEGY_ZERO3 = 3,
  ZS_STRATEGY_ZSHARD = 4,
  ZS_STRATEGY_COUNT = 5
} zs_strategy;

typedef struct zs_estimate_row {
  size_t struct_size; /* written by zs_estimate: the caller's size */
  zs_strategy strategy;
  const char *name; /* static string: "dp", "zero1", ... */
  /* Memory on each trainer, state_bytes + working_bytes. */
  double device_bytes;
  /* Model states kept on each trainer between steps: parameters, gradients
   * and optimizer state, or this trainer's partition of them (the ZeRO
   * paper's "model states"). */
  double state_bytes;
  /* Working memory on each trainer for parameters that are not its own: the
   * layer gathered (ZeRO-3) or pulled (zshard), its gradient and the next
   * layer's prefetch; 0 when largest_layer is not given. */
  double working_bytes;
  double shard_bytes;      /* memory on each shard server; 0 if none */
  double sent_bytes;       /* per trainer per step */
  double received_bytes;   /* per trainer per step */
  double shard_wire_bytes; /* per shard per step, the busier direction */
  /* Lower bound on communication time per step when the step's traffic in
   * both directions overlaps: the busier direction of the busiest link over
   * its bandwidth (links are full duplex). For zshard, pushes and pulls at
   * once (the pipelined step); for the ring collectives, their time. */
  double comm_seconds;
  /* Per link (appended after 0.2: an older caller's rows end above). */
  double shard_received_bytes; /* per shard per step, its link's ingress */
  double shard_sent_bytes;     /* per shard per step, its link's egress */
  /* zshard's two phases at link speed, each bound by its busiest link: the
   * gradients (trainers' egress, shards' ingress) and the parameters
   * (shards' egress, trainers' ingress); 0 for the ring collectives, whose
   * reduce and gather run in both directions at once. */
  double push_seconds;
  double pull_seconds;
  /* The same bound with the phases one after the other, as in the gated
   * step (every push is in before any pull is answered): push_seconds +
   * pull_seconds for zshard, comm_seconds for the ring collectives. */
  double gated_seconds;
} zs_estimate_row;

/* Computes one row per strategy into rows[0 .. ZS_STRATEGY_COUNT) (formulas
 * in docs/CLIENT.md). `in` is read; `rows`, an array of nrows structs of
 * `row_size` bytes each (the caller's sizeof), is written. Both are the
 * caller's. Use the macro, which passes sizeof *(rows). */
ZS_EXTERN int zs_estimate_sized(const zs_estimate_input *in, zs_estimate_row *rows, size_t nrows,
                                size_t row_size);
#define zs_estimate(in, rows, nrows) zs_estimate_sized((in), (rows), (nrows), sizeof *(rows))

#ifdef __cplusplus
}
#endif
#endif /* ZSHARD_ZSHARD_H */
