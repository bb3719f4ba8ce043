/*
 * dp_client_internal — the data plane client's private types (struct
 * dp_client, a connection, a request), its tuning constants, and the
 * functions that the dp_client*.c files share, prefixed dpc__; everything
 * else in those files is static. Which thread owns what, the lock order, a
 * request's memory and the copies of tensor bytes are at the top of
 * dp_client.c.
 */
#ifndef ZSHARD_COMMON_NET_DP_CLIENT_INTERNAL_H
#define ZSHARD_COMMON_NET_DP_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "common/base/list.h"
#include "common/net/dp_client.h"
#include "common/net/stream.h"
#include "common/net/wire.h"

#define DPC_DEFAULT_CONNECT_MS 10000u
#define DPC_DEFAULT_MAX_INFLIGHT 1024u
/* A Pull's answer may take this long beyond the server's own wait. */
#define DPC_PULL_GRACE_MS 10000u
#define DPC_TICK_MS 50u
#define DPC_BUCKETS 1024u
#define DPC_STAGING (64u << 10)
#define DPC_DIRECT_MIN (16u << 10)
#define DPC_READ_CHUNK (512u << 10)
/* Push payload bytes a connection may have handed to its stream and not yet
 * seen taken by the kernel, before further pushes wait in the client's
 * queue. Requests without a payload (pulls, pings) never wait behind pushes
 * held back this way: a pipelined step's pulls go out while its pushes are
 * still being sent, rather than behind all of them (a trainer's 8 MiB of
 * pushes to one shard is 67 ms at 1 Gbit/s). The kernel's socket buffer
 * still sits ahead of any request; this bounds what libuv queues on top.
 * 1 MiB held a pull request 0.15 s behind the first pushes on emulated
 * 0.25 Gbit/s links, and the pipelined step's answers never made up that
 * start; 256 KiB halved it (docs/PERFORMANCE.md, "The pieces' order"). A
 * larger push is still written whole: the bound only stops the next. */
#define DPC_UNSENT_MAX (UINT64_C(256) << 10)

/* C_HELLO: connected, HELLO sent, its answer awaited (still "connecting"
 * for the connect timeout and for dp_client_open). */
enum { C_IDLE = 0, C_CONNECTING, C_HELLO, C_READY, C_CLOSING };

static inline int dpc__connecting(int state) {
  return state == C_CONNECTING || state == C_HELLO;
}

typedef struct dp_cconn dp_cconn;

typedef struct dp_req {
  list_node node;       /* on the pending list, or on its connection's in-flight list */
  struct dp_req *qnext; /* submission queue */
  struct dp_req *hnext; /* id table bucket */
  wire_msg msg;         /* type, meta, payload length and CRC; id set at write */
  dp_done_cb cb;
  void *arg;
  const void *data; /* Push payload, the caller's */
  void *dst;        /* Pull destination, the caller's */
  size_t nbytes;
  /* A pull batch's destinations in payload order (owned array, the caller's
   * memory): one per piece, or one for the whole payload. */
  wire_seg *segs;
  uint32_t nsegs;
  uint32_t timeout_ms;
  uint64_t deadline_ms; /* set when the loop takes the request */
  dp_cconn *conn;
  /* A push's payload bytes counted in wconn->unsent until its write is
   * done, for the connection's generation wgen. */
  dp_cconn *wconn;
  uint64_t wgen;
  size_t unsent;
  int in_table;
  int writing;   /* the stream still holds wreq */
  int completed; /* the callback ran */
  /* A batch: its pieces, which msg points at (owned), and for a push batch
   * each piece's bytes (owned array, borrowed bytes), in the same order. */
  wire_piece *pieces;
  const void **piece_data;
  /* Where the header is encoded: `head`, or for a batch an owned buffer of
   * WIRE_MAX_BATCH_ENCODED bytes. */
  uint8_t *big_head;
  stream_write_req wreq;
  uint8_t head[WIRE_MAX_ENCODED];
} dp_req;

struct dp_cconn {
  dp_client *c;
  stream *st; /* NULL while C_IDLE; freed by the stream layer after dpc__on_conn_closed */
  int state;
  int index;
  uint64_t connect_deadline_ms;
  wire_reader rd;
  list_node inflight;
  uint32_t ninflight;
  uint64_t bytes_inflight;
  /* Push payload bytes written to the stream whose writes are not done
   * (DPC_UNSENT_MAX); gen counts the connection's streams, so that a write
   * finishing after its stream was replaced counts against nothing. */
  uint64_t unsent, gen;
  dp_req *rx; /* the Pull whose payload is arriving */
  /* The HELLO being written (its bytes live here until hello_req's callback). */
  stream_write_req hello_req;
  uint8_t hello[WIRE_HEADER_SIZE + WIRE_MAX_HELLO_META];
};

struct dp_client {
  uv_loop_t loop;
  uv_async_t async;
  uv_timer_t timer;
  stream_dialer *dialer;
  pthread_t thread;
  int thread_started, loop_inited, timer_on;
  char addr_text[128];
  struct sockaddr_storage addr;
  uint32_t connect_ms, max_inflight;
  uint64_t max_payload;
  uint8_t token[WIRE_MAX_TOKEN]; /* sent in every HELLO */
  uint32_t token_len;
  uint64_t replica_term;               /* sent in every HELLO */
  char congestion[STREAM_CC_NAME_MAX]; /* "" : the host's default */
  uint32_t pacing_mbit;                /* 0: no pacing */
  stream_pacer *pacer;                 /* borrowed; NULL: no link pacing */
  /* Loop thread: the server refused the token (auth_status, auth_err): no
   * connection is tried again, every request fails with that status. */
  int auth_status;
  char auth_err[DP_ERRLEN];
  /* Guarded by mu. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  dp_req *q_head, *q_tail;
  int closing;
  uint32_t settled; /* connects finished (either way) during open */
  char connect_err[DP_ERRLEN];
  int connect_status; /* the status of connect_err */
  /* Loop thread only. */
  int shut;
  /* Requests waiting for a connection: pushes (payload-carrying) apart from
   * the rest, which may overtake them (DPC_UNSENT_MAX). */
  list_node pending, pending_bulk;
  dp_req *table[DPC_BUCKETS];
  uint64_t next_id;
  uint32_t nconns;
  dp_cconn conns[DP_MAX_CONNECTIONS];
  unsigned char *staging;
};

/* dp_client_request.c: requests, the id table and completion (loop thread). */
void dpc__req_free(dp_req *r);
void dpc__table_put(dp_client *c, dp_req *r);
dp_req *dpc__table_find(dp_client *c, uint64_t id);
void dpc__req_detach(dp_client *c, dp_req *r);
dp_req *dpc__pending_first(dp_client *c);
void dpc__req_complete_res(dp_req *r, const dp_result *res);
void dpc__req_complete(dp_req *r, int status, int duplicate, uint64_t version, const char *msg);

/* dp_client_conn.c: connecting, HELLO and failing a connection (loop thread). */
void dpc__settle(dp_client *c);
void dpc__on_conn_closed(stream *st, void *data);
void dpc__conn_fail(dp_cconn *k, int status, const char *msg, dp_req *victim, int victim_status);
int dpc__on_hello_answer(dp_cconn *k);
void dpc__conn_start(dp_cconn *k);

/* dp_client_write.c: requests onto connections (loop thread). */
int dpc__is_bulk(const dp_req *r);
void dpc__dispatch(dp_client *c);

/* dp_client_read.c: the stream's read callbacks and protocol errors. */
void dpc__on_alloc(stream *st, void *data, size_t suggested, uv_buf_t *buf);
void dpc__conn_protocol_error(dp_cconn *k, const char *what);
void dpc__on_read(stream *st, void *data, ssize_t nread, const uv_buf_t *buf);

/* dp_client_timer.c: the timer runs only while something can time out. */
void dpc__timer_update(dp_client *c);

#endif
