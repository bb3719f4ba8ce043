/*
 * test_client_grpc_limits — libzshard against the gRPC listener's limits
 * (docs/OPERATIONS.md, "Limits") on a real zshard-server.
 *
 * A gradient larger than the receive limit (64 MiB of data,
 * RPC_PUSH_CHUNK_BYTES) still trains over gRPC: libzshard sends it in chunks
 * and the shard takes the whole contribution once the last one arrived, so
 * the step's result is the same bits as the arithmetic says (one tensor of 17
 * million fp32 elements, 68 MB, two chunks, plain SGD with lr 0.5 on small
 * integers). A client that sends it whole, as clients before the limit did,
 * is refused RESOURCE_EXHAUSTED (ZS_ELIMIT) and changes nothing.
 *
 * A Pull refused because the server's budget of waiting calls is full is
 * retried by the library until room comes back, rather than failing the
 * trainer.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "common/net/rpc_client.h"
#include "harness.h"
#include "internal.h"
#include "zshard/zshard.h"

#define NUMEL UINT64_C(17000000)

static zs_client *new_client(const char *addr, uint64_t numel) {
  zs_client_options o;
  zs_client_options_init(&o);
  o.addresses = addr;
  o.job = "chunks";
  o.world_size = 1;
  o.rank = 0;
  o.transport = ZS_TRANSPORT_GRPC;
  o.rpc_timeout_ms = 60000;
  o.step_timeout_ms = 60000;
  zs_client *c = NULL;
  assert_int_equal(zs_client_open(&o, &c), ZS_OK);
  zs_group_options go;
  zs_group_options_init(&go, ZS_OPTIM_SGD);
  assert_int_equal(zs_add_group(c, &go, NULL), ZS_OK);
  assert_int_equal(zs_add_tensor(c, "t", numel, 0, NULL, 0, NULL), ZS_OK);
  return c;
}

static void a_push_larger_than_the_receive_limit_travels_in_chunks(void **state) {
  (void)state;
  assert_true(NUMEL * sizeof(float) > RPC_PUSH_CHUNK_BYTES);
  hs_server *srv = hs_start(NULL, NULL);
  assert_non_null(srv);
  float *w = malloc(NUMEL * sizeof(float));
  float *g = malloc(NUMEL * sizeof(float));
  float *out = malloc(NUMEL * sizeof(float));
  assert_true(w && g && out);
  for (uint64_t i = 0; i < NUMEL; i++) {
    w[i] = (float)(i % 13);
    g[i] = (float)(i % 7) - 3.0f;
  }
  zs_client *c = new_client(srv->addr, NUMEL);
  const float *ws[1] = {w};
  assert_int_equal(zs_open_job(c, ws), ZS_OK);

  /* A whole 68 MB Push, as a client without chunks sends it, is refused
   * before it is looked at. */
  rpc_channel *ch = NULL;
  assert_int_equal(rpc_channel_open(srv->addr, &ch), ZS_OK);
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  assert_int_equal(hs_get_info(ch, &info, &st), 0);
  uint64_t hash = info->spec_hash;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  int dup = 0;
  int rc = hs_push(ch, hash, 1, 0, 0, 0, 0, ZS_DTYPE_FP32, g, NUMEL * sizeof(float), &dup, &st);
  assert_int_equal(rc, ZS_ELIMIT);

  /* Through the library it goes in chunks, and the step uses all of it. */
  assert_int_equal(zs_push(c, 0, 0, g, ZS_DTYPE_FP32, NUMEL * sizeof(float), NULL), ZS_OK);
  assert_int_equal(zs_step(c, 0.5, 0, 0, NULL), ZS_OK);
  assert_int_equal(zs_pull(c, 0, out, ZS_DTYPE_FP32, NUMEL * sizeof(float), NULL), ZS_OK);
  for (uint64_t i = 0; i < NUMEL; i++) {
    float want = w[i] - 0.5f * g[i];
    if (out[i] != want)
      fail_msg("element %" PRIu64 ": %g, not %g", i, (double)out[i], (double)want);
  }
  rpc_channel_close(ch);
  assert_int_equal(zs_client_close(c), ZS_OK);
  free(w);
  free(g);
  free(out);
  assert_int_equal(hs_stop(srv), 0);
}

/* Stats.waiting_pulls of the server behind `ch`. */
static uint32_t waiting_pulls(rpc_channel *ch) {
  Zshard__V1__StatsRequest req = ZSHARD__V1__STATS_REQUEST__INIT;
  Zshard__V1__StatsResponse *r = NULL;
  rpc_status st;
  assert_int_equal(rpc_call(ch, "/zshard.v1.ZShard/Stats", &req.base,
                            &zshard__v1__stats_response__descriptor, (ProtobufCMessage **)&r,
                            HS_CALL_TIMEOUT_MS, &st),
                   0);
  uint32_t n = r->waiting_pulls;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return n;
}

typedef struct far_pull {
  rpc_channel *ch;
  uint64_t hash;
  int rc;
} far_pull;

/* A Pull of a version that never comes: it takes the server's one place for
 * a waiting call for 1.5 s, then times out. */
static void *pull_far_ahead(void *arg) {
  far_pull *f = arg;
  float buf[64];
  rpc_status st;
  f->rc = hs_pull(f->ch, f->hash, 0, 0, 2, ZS_DTYPE_FP32, 1500, buf, sizeof buf, NULL, &st);
  return NULL;
}

static void a_pull_answerable_now_is_served_while_the_parking_budget_is_full(void **state) {
  (void)state;
  const char *env[] = {"ZSHARD_GRPC_MAX_PARKED=1", NULL};
  hs_server *srv = hs_start(NULL, env);
  assert_non_null(srv);
  float w[64], out[64];
  for (int i = 0; i < 64; i++)
    w[i] = (float)i;
  zs_client *c = new_client(srv->addr, 64);
  const float *ws[1] = {w};
  assert_int_equal(zs_open_job(c, ws), ZS_OK);

  far_pull f = {.rc = 1};
  assert_int_equal(rpc_channel_open(srv->addr, &f.ch), ZS_OK);
  Zshard__V1__GetInfoResponse *info = NULL;
  rpc_status st;
  assert_int_equal(hs_get_info(f.ch, &info, &st), 0);
  f.hash = info->spec_hash;
  protobuf_c_message_free_unpacked(&info->base, NULL);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, pull_far_ahead, &f), 0);
  /* Bounded poll of the condition: the far pull holds the place. */
  for (int i = 0; i < 2000 && waiting_pulls(f.ch) == 0; i++)
    nanosleep(&(struct timespec){.tv_nsec = 5000000}, NULL);
  assert_int_equal(waiting_pulls(f.ch), 1);

  /* The client's Pull is of the version the job is at: it needs no parking
   * room, so the full budget does not refuse it; before, it was
   * refused RESOURCE_EXHAUSTED and served on a retry. */
  uint64_t retries = atomic_load(&c->retries);
  assert_int_equal(zs_pull(c, 0, out, ZS_DTYPE_FP32, sizeof out, NULL), ZS_OK);
  assert_memory_equal(out, w, sizeof w);
  assert_true(atomic_load(&c->retries) == retries);
  pthread_join(th, NULL);
  assert_int_equal(f.rc, ZS_ETIMEDOUT);
  rpc_channel_close(f.ch);
  assert_int_equal(zs_client_close(c), ZS_OK);
  assert_int_equal(hs_stop(srv), 0);
}

int main(void) {
  if (hs_init() != 0)
    return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(a_push_larger_than_the_receive_limit_travels_in_chunks),
      cmocka_unit_test(a_pull_answerable_now_is_served_while_the_parking_budget_is_full),
  };
  int failures = cmocka_run_group_tests(tests, NULL, NULL);
  hs_finish(failures);
  return failures ? 1 : 0;
}
