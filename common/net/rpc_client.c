/*
 * rpc_client — blocking unary gRPC calls over the C core API.
 *
 * Each call gets its own completion queue and the calling thread drives it to
 * completion, so the only state shared between threads is the grpc_channel,
 * which gRPC makes thread-safe. Every rpc_channel holds one reference on the
 * gRPC library (grpc_init in open, grpc_shutdown in close), so a process that
 * closes its last channel releases gRPC's threads.
 *
 * Copies of a response's bytes: gRPC receives the message into its slices; a
 * message that arrived in one slice is parsed in place, one that arrived in
 * several is gathered into one buffer first (one copy); protobuf-c then copies
 * `bytes` fields into the unpacked message (one more).
 */
#include "common/net/rpc_client.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/status.h"

/* Trailing metadata key carrying zshard's own status number. */
#define RPC_ZS_STATUS_KEY "zs-status"

struct rpc_channel {
  grpc_channel *channel;
  /* "Bearer <token>", sent on every call; NULL: no token. */
  grpc_slice auth_value;
  int has_auth;
  int tls; /* the channel speaks TLS */
};

int rpc_read_pem_file(const char *path, const char *what, char **out, char *err, size_t errlen) {
  *out = NULL;
  /* O_NONBLOCK and the regular-file check keep a FIFO put in the file's
   * place from hanging the caller. */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return status_fail(err, errlen, ZS_EINVAL, "%s '%s': %s", what, path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > RPC_MAX_PEM_BYTES) {
    close(fd);
    return status_fail(err, errlen, ZS_EINVAL, "%s '%s': not a regular file of at most %d bytes",
                       what, path, RPC_MAX_PEM_BYTES);
  }
  char *buf = malloc((size_t)st.st_size + 1);
  if (!buf) {
    close(fd);
    return status_fail(err, errlen, ZS_ENOMEM, "%s '%s': out of memory", what, path);
  }
  size_t got = 0;
  while (got < (size_t)st.st_size) {
    ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    got += (size_t)n;
  }
  close(fd);
  buf[got] = '\0';
  if (got != (size_t)st.st_size || !strstr(buf, "-----BEGIN ")) {
    free(buf);
    return status_fail(err, errlen, ZS_EINVAL, "%s '%s': not a PEM file", what, path);
  }
  *out = buf;
  return 0;
}

/* The TLS credentials of `sec` (which has a CA file), or NULL with err set. */
static grpc_channel_credentials *tls_credentials(const rpc_security *sec, int *rc, char *err,
                                                 size_t errlen) {
  char *ca = NULL, *cert = NULL, *key = NULL;
  grpc_channel_credentials *creds = NULL;
  *rc = rpc_read_pem_file(sec->tls_ca_file, "TLS CA file", &ca, err, errlen);
  if (*rc == 0 && sec->tls_cert_file)
    *rc = rpc_read_pem_file(sec->tls_cert_file, "TLS certificate file", &cert, err, errlen);
  if (*rc == 0 && sec->tls_key_file)
    *rc = rpc_read_pem_file(sec->tls_key_file, "TLS key file", &key, err, errlen);
  if (*rc == 0) {
    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
    if (!creds)
      *rc = status_fail(err, errlen, ZS_EINVAL, "%s", "gRPC refused the TLS settings");
  }
  free(ca);
  free(cert);
  if (key) {
    /* The private key does not linger in freed memory. */
    memset(key, 0, strlen(key));
    free(key);
  }
  return creds;
}

/* Checks `sec` before anything is read: a half-given pair is a mistake the
 * handshake would report far less clearly. */
static int check_security(const rpc_security *sec, char *err, size_t errlen) {
  int has_ca = sec->tls_ca_file && sec->tls_ca_file[0];
  int has_cert = sec->tls_cert_file && sec->tls_cert_file[0];
  int has_key = sec->tls_key_file && sec->tls_key_file[0];
  if (has_cert != has_key)
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "a TLS client certificate needs its key and a key its certificate");
  if (!has_ca && (has_cert || (sec->tls_server_name && sec->tls_server_name[0])))
    return status_fail(err, errlen, ZS_EINVAL, "%s",
                       "a TLS client certificate or server name needs a TLS CA file");
  if (sec->token && strlen(sec->token) > RPC_MAX_TOKEN_BYTES)
    return status_fail(err, errlen, ZS_EINVAL, "the token is longer than %d bytes",
                       RPC_MAX_TOKEN_BYTES);
  for (const char *p = sec->token; p && *p; p++)
    if ((unsigned char)*p < 0x21 || (unsigned char)*p > 0x7e)
      return status_fail(err, errlen, ZS_EINVAL, "%s",
                         "the token must be printable ASCII without spaces");
  return 0;
}

int rpc_channel_open(const char *target, rpc_channel **out) {
  return rpc_channel_open_secure(target, NULL, out, NULL, 0);
}

int rpc_channel_open_secure(const char *target, const rpc_security *sec, rpc_channel **out,
                            char *err, size_t errlen) {
  *out = NULL;
  if (!target || !target[0])
    return status_fail(err, errlen, ZS_EINVAL, "%s", "no target address");
  rpc_security none = {0};
  if (!sec)
    sec = &none;
  int rc = check_security(sec, err, errlen);
  if (rc)
    return rc;
  rpc_channel *ch = calloc(1, sizeof *ch);
  if (!ch)
    return status_fail(err, errlen, ZS_ENOMEM, "%s", "out of memory");
  grpc_init();

  /* Bulk messages (a Pull of a large slice, an InitParams of a large piece)
   * exceed gRPC's 4 MiB default receive limit; both ends agree on one bound. */
  grpc_arg args[5];
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = RPC_MAX_MESSAGE_BYTES;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[1].value.integer = RPC_MAX_MESSAGE_BYTES;
  /* A server that was down (killed, restarted by its supervisor) is tried
   * again within RPC_RECONNECT_MAX_MS, not after gRPC's default backoff
   * (up to 120 s): until then every call to it fails at once, and a
   * replica set would drop the restarted member it cannot reach.
   * GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is left alone: gRPC takes it as the
   * least time a connection attempt (TLS handshake included) may take. */
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
  args[2].value.integer = RPC_RECONNECT_MIN_MS;
  args[3].type = GRPC_ARG_INTEGER;
  args[3].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
  args[3].value.integer = RPC_RECONNECT_MAX_MS;
  grpc_channel_args chargs = {.num_args = 4, .args = args};
  if (sec->tls_ca_file && sec->tls_ca_file[0] && sec->tls_server_name && sec->tls_server_name[0]) {
    args[4].type = GRPC_ARG_STRING;
    args[4].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    args[4].value.string = (char *)sec->tls_server_name;
    chargs.num_args = 5;
  }

  grpc_channel_credentials *creds = NULL;
  ch->tls = sec->tls_ca_file && sec->tls_ca_file[0];
  if (ch->tls)
    creds = tls_credentials(sec, &rc, err, errlen);
  else
    creds = grpc_insecure_credentials_create();
  if (creds) {
    ch->channel = grpc_channel_create(target, creds, &chargs);
    grpc_channel_credentials_release(creds);
    if (!ch->channel)
      rc = status_fail(err, errlen, ZS_ENOMEM, "%s", "cannot create the gRPC channel");
  }
  if (rc == 0 && sec->token && sec->token[0]) {
    size_t n = strlen(RPC_AUTH_SCHEME) + strlen(sec->token);
    ch->auth_value = grpc_slice_malloc(n);
    memcpy(GRPC_SLICE_START_PTR(ch->auth_value), RPC_AUTH_SCHEME, strlen(RPC_AUTH_SCHEME));
    memcpy(GRPC_SLICE_START_PTR(ch->auth_value) + strlen(RPC_AUTH_SCHEME), sec->token,
           strlen(sec->token));
    ch->has_auth = 1;
  }
  if (rc) {
    rpc_channel_close(ch);
    return rc;
  }
  *out = ch;
  return 0;
}

void rpc_channel_close(rpc_channel *ch) {
  if (!ch)
    return;
  if (ch->channel)
    grpc_channel_destroy(ch->channel);
  if (ch->has_auth)
    grpc_slice_unref(ch->auth_value);
  grpc_shutdown();
  free(ch);
}

static int set_status(rpc_status *st, int grpc_code, int zs, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int set_status(rpc_status *st, int grpc_code, int zs, const char *fmt, ...) {
  if (st) {
    st->grpc_code = grpc_code;
    st->zs_status = zs;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->message, sizeof st->message, fmt, ap);
    va_end(ap);
  }
  return zs;
}

/* The zshard status in the trailing metadata, or 1 when there is none (or it
 * is not a valid zs_status, which a foreign server could send). */
static int trailer_status(const grpc_metadata_array *md) {
  for (size_t i = 0; i < md->count; i++) {
    if (grpc_slice_str_cmp(md->metadata[i].key, RPC_ZS_STATUS_KEY) != 0)
      continue;
    char buf[16];
    size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
    if (n == 0 || n >= sizeof buf)
      return 1;
    memcpy(buf, GRPC_SLICE_START_PTR(md->metadata[i].value), n);
    buf[n] = '\0';
    char *end;
    long v = strtol(buf, &end, 10);
    if (*end != '\0' || !status_valid((int)v) || v > 0)
      return 1;
    return (int)v;
  }
  return 1;
}

int rpc_message_slice(grpc_byte_buffer *bb, grpc_slice *out) {
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
      bb->data.raw.slice_buffer.count == 1) {
    *out = grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
    return 0;
  }
  grpc_byte_buffer_reader reader;
  if (!grpc_byte_buffer_reader_init(&reader, bb))
    return -1;
  *out = grpc_byte_buffer_reader_readall(&reader);
  grpc_byte_buffer_reader_destroy(&reader);
  return 0;
}

int rpc_call(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
             uint64_t timeout_ms, rpc_status *st) {
  return rpc_call_md(ch, method, req, NULL, 0, resp_desc, resp, timeout_ms, st);
}

int rpc_call_md(rpc_channel *ch, const char *method, const ProtobufCMessage *req, const rpc_md *md,
                size_t nmd, const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                uint64_t timeout_ms, rpc_status *st) {
  *resp = NULL;
  size_t req_len = protobuf_c_message_get_packed_size(req);
  if (req_len > RPC_MAX_MESSAGE_BYTES)
    return set_status(st, GRPC_STATUS_INVALID_ARGUMENT, ZS_EINVAL,
                      "request of %zu bytes exceeds the %d byte message limit", req_len,
                      RPC_MAX_MESSAGE_BYTES);
  grpc_slice req_slice = grpc_slice_malloc(req_len);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(req_slice));
  int rc = rpc_call_raw(ch, method, GRPC_SLICE_START_PTR(req_slice), req_len, md, nmd, resp_desc,
                        resp, timeout_ms, st);
  grpc_slice_unref(req_slice);
  return rc;
}

int rpc_call_raw(rpc_channel *ch, const char *method, const void *req, size_t req_len,
                 const rpc_md *md, size_t nmd, const ProtobufCMessageDescriptor *resp_desc,
                 ProtobufCMessage **resp, uint64_t timeout_ms, rpc_status *st) {
  return rpc_call_raw_stop(ch, method, req, req_len, md, nmd, resp_desc, resp, timeout_ms, NULL,
                           st);
}

/* Waits for the batch `tag` of `call` on its private queue. RECV_STATUS_ON_CLIENT
 * always completes (at the latest at the call's deadline, or soon after a
 * cancel), so the wait is bounded. With `stop`, the wait wakes every
 * RPC_STOP_POLL_MS to ask it, and cancels the call once it says so; returns
 * whether it did. */
static int wait_batch(grpc_completion_queue *cq, grpc_call *call, void *tag, const rpc_stop *stop) {
  int cancelled = 0;
  grpc_event ev;
  for (;;) {
    gpr_timespec until = stop && !cancelled
                             ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                            gpr_time_from_millis(RPC_STOP_POLL_MS, GPR_TIMESPAN))
                             : gpr_inf_future(GPR_CLOCK_MONOTONIC);
    ev = grpc_completion_queue_next(cq, until, NULL);
    if (ev.type == GRPC_OP_COMPLETE && ev.tag == tag)
      return cancelled;
    if (ev.type == GRPC_QUEUE_TIMEOUT && stop && !cancelled && stop->fn(stop->arg)) {
      grpc_call_cancel_with_status(call, GRPC_STATUS_CANCELLED, "stopped by the caller", NULL);
      cancelled = 1;
    }
  }
}

int rpc_call_raw_stop(rpc_channel *ch, const char *method, const void *req, size_t req_len,
                      const rpc_md *md, size_t nmd, const ProtobufCMessageDescriptor *resp_desc,
                      ProtobufCMessage **resp, uint64_t timeout_ms, const rpc_stop *stop,
                      rpc_status *st) {
  *resp = NULL;
  if (st) {
    st->grpc_code = GRPC_STATUS_OK;
    st->zs_status = ZS_OK;
    st->message[0] = '\0';
  }
  if (req_len > RPC_MAX_MESSAGE_BYTES || nmd > RPC_MAX_MD)
    return set_status(st, GRPC_STATUS_INVALID_ARGUMENT, ZS_EINVAL,
                      "request of %zu bytes (limit %d) with %zu metadata entries (limit %d)",
                      req_len, RPC_MAX_MESSAGE_BYTES, nmd, RPC_MAX_MD);

  /* A timeout beyond a year is no timeout; it also keeps the conversion to
   * gpr_timespec far from overflow. */
  gpr_timespec deadline =
      timeout_ms == 0 || timeout_ms > UINT64_C(365) * 86400 * 1000
          ? gpr_inf_future(GPR_CLOCK_MONOTONIC)
          : gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                         gpr_time_from_millis((int64_t)timeout_ms, GPR_TIMESPAN));

  int rc = 0;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  /* The method slice need only live through grpc_channel_create_call. */
  grpc_slice method_slice = grpc_slice_from_copied_string(method);
  grpc_call *call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             method_slice, NULL, deadline, NULL);
  grpc_slice_unref(method_slice);
  grpc_slice req_slice = grpc_slice_from_copied_buffer((const char *)req, req_len);
  grpc_byte_buffer *req_bb = grpc_raw_byte_buffer_create(&req_slice, 1);
  grpc_slice_unref(req_slice);

  grpc_metadata_array initial_md, trailing_md;
  grpc_metadata_array_init(&initial_md);
  grpc_metadata_array_init(&trailing_md);
  grpc_byte_buffer *resp_bb = NULL;
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  /* The token, then the caller's entries (their slices reference the
   * caller's strings, which outlive the call). */
  grpc_metadata sent[RPC_MAX_MD + 1];
  size_t nsent = 0;
  memset(sent, 0, sizeof sent);
  if (ch->has_auth) {
    sent[nsent].key = grpc_slice_from_static_string(RPC_AUTH_KEY);
    sent[nsent++].value = ch->auth_value;
  }
  for (size_t i = 0; i < nmd; i++) {
    sent[nsent].key = grpc_slice_from_static_string(md[i].key);
    sent[nsent++].value = grpc_slice_from_static_string(md[i].value);
  }
  ops[0].data.send_initial_metadata.count = nsent;
  ops[0].data.send_initial_metadata.metadata = nsent ? sent : NULL;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = req_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &resp_bb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
  ops[5].data.recv_status_on_client.status = &code;
  ops[5].data.recv_status_on_client.status_details = &details;

  /* The batch's tag only has to be unique on this call's private queue. */
  void *tag = &ops[0];
  grpc_call_error err = grpc_call_start_batch(call, ops, 6, tag, NULL);
  if (err != GRPC_CALL_OK) {
    rc = set_status(st, GRPC_STATUS_INTERNAL, ZS_EINTERNAL, "grpc_call_start_batch: %s",
                    grpc_call_error_to_string(err));
    goto done;
  }
  if (wait_batch(cq, call, tag, stop) && code != GRPC_STATUS_OK) {
    rc = set_status(st, GRPC_STATUS_CANCELLED, ZS_ECANCELED, "%s: stopped by the caller", method);
    goto done;
  }

  if (code != GRPC_STATUS_OK) {
    int zs = trailer_status(&trailing_md);
    if (zs > 0)
      zs = status_from_grpc(code);
    if (zs == ZS_OK) /* a non-OK gRPC code never means success */
      zs = ZS_EINTERNAL;
    char *msg = grpc_slice_to_c_string(details);
    /* A TLS server closes a plaintext connection as soon as its first bytes
     * are not a TLS handshake, and gRPC reports only the closed socket. */
    const char *hint =
        !ch->tls && code == GRPC_STATUS_UNAVAILABLE && msg && strstr(msg, "Socket closed")
            ? " (if the server speaks TLS, give this client its CA: "
              "tls_ca_file, ZSHARD_TLS_CA or --tls-ca)"
            : "";
    rc = set_status(st, code, zs, "%s: %s%s", method, msg && msg[0] ? msg : zs_strerror(zs), hint);
    gpr_free(msg);
    goto done;
  }
  if (!resp_bb) {
    rc = set_status(st, GRPC_STATUS_INTERNAL, ZS_EPROTO, "%s: OK status without a message", method);
    goto done;
  }
  if (!resp_desc) /* the caller wants only the status */
    goto done;
  grpc_slice msg;
  if (rpc_message_slice(resp_bb, &msg) != 0) {
    rc = set_status(st, GRPC_STATUS_INTERNAL, ZS_EPROTO, "%s: unreadable response", method);
    goto done;
  }
  *resp =
      protobuf_c_message_unpack(resp_desc, NULL, GRPC_SLICE_LENGTH(msg), GRPC_SLICE_START_PTR(msg));
  grpc_slice_unref(msg);
  if (!*resp)
    rc = set_status(st, GRPC_STATUS_INTERNAL, ZS_EPROTO, "%s: response is not a valid %s message",
                    method, resp_desc->name);

done:
  grpc_byte_buffer_destroy(req_bb);
  if (resp_bb)
    grpc_byte_buffer_destroy(resp_bb);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&initial_md);
  grpc_metadata_array_destroy(&trailing_md);
  grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return rc;
}
