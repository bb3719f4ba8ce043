/*
 * call — one gRPC call to a shard, retried with backoff on the statuses
 * that say it did not reach the shard's logic (zc_call), and the backoff's
 * wait, which a closing client interrupts.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "internal.h"
#include "transfer.h"

int zc_backoff_wait(struct zs_client *c, uint64_t ms) {
  uint64_t until = clock_now_ms() + ms;
  pthread_mutex_lock(&c->mu);
  while (!c->closing) {
    uint64_t now = clock_now_ms();
    if (now >= until)
      break;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t wait_ms = until - now;
    ts.tv_sec += (time_t)(wait_ms / 1000);
    ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
  }
  int closing = c->closing;
  pthread_mutex_unlock(&c->mu);
  return closing;
}

/* Whether `method` (a full gRPC path) is Push or Pull. */
static int is_transfer(const char *method) {
  const char *m = strrchr(method, '/');
  return m && (strcmp(m, "/Push") == 0 || strcmp(m, "/Pull") == 0);
}

int zc_call(struct zs_client *c, uint32_t shard, const char *method, const ProtobufCMessage *req,
            const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
            uint64_t timeout_ms, rpc_status *st) {
  /* A replica set has its own loop: the same retries, plus the term and the
   * failover (replica.c). A shard that is not replicated takes this one. */
  if (c->rs[shard].n > 1)
    return zc_replica_call(c, shard, method, req, resp_desc, resp, timeout_ms, st);
  uint64_t backoff = c->opt.retry_initial_ms;
  for (uint32_t attempt = 0;; attempt++) {
    int rc = rpc_call(c->rs[shard].chan[0], method, req, resp_desc, resp, timeout_ms, st);
    /* Only UNAVAILABLE and CANCELLED are retried, and RESOURCE_EXHAUSTED for
     * the transfers: the call did not reach the shard's logic or the shard
     * went away (a server shutting down cancels the calls it no longer
     * admits; this client never cancels its own blocking calls, it lets
     * deadlines expire), or a budget of the gRPC listener refused a transfer
     * before acting (docs/OPERATIONS.md, "Limits": room comes back as other
     * calls finish; a limit on other calls, such as a job's size, is for
     * good); and every zshard call is idempotent (a repeated push is
     * acknowledged as a duplicate, a repeated apply returns the recorded
     * outcome). */
    int transient = st->grpc_code == ZC_GRPC_UNAVAILABLE || st->grpc_code == ZC_GRPC_CANCELLED ||
                    (st->grpc_code == ZC_GRPC_RESOURCE_EXHAUSTED && is_transfer(method));
    if (rc == ZS_OK || !transient || attempt >= c->opt.max_retries)
      return rc;
    atomic_fetch_add(&c->retries, 1);
    if (zc_backoff_wait(c, backoff))
      return rc;
    backoff *= 2;
    if (backoff > c->opt.retry_max_ms)
      backoff = c->opt.retry_max_ms;
  }
}
