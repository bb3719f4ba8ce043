/*
 * dp_auth — who may speak on a connection: the HELLO that must come first
 * (its token checked with auth_keys_check_bound), the rank binding checked
 * on every push, and the recheck of every connection's token after the
 * token files are reread. Loop thread.
 */
#include "server/transport/dp/dp_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/list.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/net/wire.h"
#include "server/replica/replica.h"

/* The first frame of a connection: a HELLO whose token grants the trainer
 * role, or the connection goes (ERROR with request id 0, then the close).
 * Nothing else is read before it. */
void dp__on_hello(dp_conn *c) {
  dp_server *s = c->s;
  wire_reader *rd = &c->rd;
  const wire_msg *m = &rd->msg;
  char err[DP_ERRLEN];
  int status = ZS_EUNAUTHENTICATED;
  auth_role role = AUTH_NONE;
  if (m->type != WIRE_HELLO) {
    status_say(err, sizeof err,
               "the first frame on a data-plane connection must be HELLO (frame version 3) with "
               "the client's token, not %s: upgrade the client to one that speaks version 3",
               wire_type_name(m->type));
  } else if (rd->meta_status != 0) {
    status = rd->meta_status;
    status_say(err, sizeof err, "%s", rd->err);
  } else if (!auth_allows((role = auth_keys_check_bound(s->auth, (const char *)m->u.hello.token,
                                                        m->u.hello.token_len, &c->bind)),
                          AUTH_TRAINER)) {
    status_say(err, sizeof err, "the server refused the token of this data-plane connection (%s)",
               m->u.hello.token_len ? "wrong token" : "no token given");
  } else {
    if (auth_keys_enabled(s->auth) && m->u.hello.token_len > 0 &&
        (c->token = malloc(m->u.hello.token_len)) == NULL) {
      status = ZS_ENOMEM;
      status_say(err, sizeof err, "out of memory keeping the connection's token");
      goto refuse;
    }
    if (c->token) {
      memcpy(c->token, m->u.hello.token, m->u.hello.token_len);
      c->token_len = m->u.hello.token_len;
    }
    c->authed = 1;
    c->replica_term = m->u.hello.replica_term;
    c->admin = !auth_keys_enabled(s->auth) || auth_allows(role, AUTH_ADMIN);
    c->role = role;
    if (c->counted) {
      s->nunauth--;
      dp__count(&s->st_unauth, -1);
      c->pe->unauth--;
      list_remove(&c->unode);
    }
    wire_reader_limit_meta(rd, WIRE_MAX_META);
    wire_reader_set_payload(rd, NULL);
    wire_msg ack = {.type = WIRE_HELLO_ACK, .request_id = m->request_id};
    dp__conn_send(c, &ack, NULL, 0, 0);
    return;
  }
refuse:
  dp__count(&s->st_auth_refused, 1);
  uint64_t quiet = 0;
  if (dp__refusal_logged(s, &quiet))
    LOG_WARN("dp_unauthenticated", "peer=%s refused_since_last_line=%" PRIu64 " detail=\"%s\"",
             c->peer, quiet, err);
  c->fatal = 1;
  dp__conn_set_mid(c, 0);
  dp__conn_update_reading(c);
  wire_msg e = {.type = WIRE_ERROR, .request_id = 0};
  e.u.error.status = status;
  status_say(e.u.error.message, sizeof e.u.error.message, "%s", err);
  dp__conn_send(c, &e, NULL, 0, 1);
}

/* A push under a rank token must be for the token's job and rank; with
 * --require-rank-tokens a plain trainer token may not push at all. Checked
 * on every PUSH and PUSH_BATCH (a batch has one rank) before any byte of the
 * payload is kept: 1 when refused (answered ZS_EPERM; the payload is
 * skipped and nothing changes). No HMAC here: the token was verified at
 * HELLO. */
int dp__rank_refused(dp_conn *c, const wire_msg *m) {
  if (m->type != WIRE_PUSH && m->type != WIRE_PUSH_BATCH)
    return 0;
  uint64_t hash = m->type == WIRE_PUSH ? m->u.push.spec_hash : m->u.push_batch.spec_hash;
  uint32_t rank = m->type == WIRE_PUSH ? m->u.push.rank : m->u.push_batch.rank;
  int job_ok = !c->bind.bound || core_job_named(c->s->core, hash, c->bind.job);
  char err[DP_ERRLEN] = "";
  int rc = auth_push_admit(c->s->auth, c->role, &c->bind, job_ok, rank, err, sizeof err);
  if (rc == 0)
    return 0;
  dp__answer_error(c, m->request_id, rc, err);
  return 1;
}

/* After a reload of the token files: every authenticated connection's token
 * is checked again; one that no longer grants the trainer role is told so
 * and closed, one that lost the admin role keeps the trainer's. */
void dp__recheck_tokens(dp_server *s) {
  for (list_node *l = s->live.next; l != &s->live;) {
    dp_conn *c = container_of(l, dp_conn, node);
    l = l->next; /* dp__conn_close moves c to the zombies */
    if (!c->authed || c->fatal || !auth_keys_enabled(s->auth))
      continue;
    auth_role role = auth_keys_check_bound(s->auth, c->token, c->token_len, &c->bind);
    c->admin = auth_allows(role, AUTH_ADMIN);
    c->role = role;
    if (auth_allows(role, AUTH_TRAINER))
      continue;
    dp__count(&s->st_auth_revoked, 1);
    LOG_WARN("dp_unauthenticated", "peer=%s detail=\"token revoked by a reload\"", c->peer);
    c->fatal = 1;
    dp__conn_set_mid(c, 0);
    dp__conn_update_reading(c);
    wire_msg e = {.type = WIRE_ERROR, .request_id = 0};
    e.u.error.status = ZS_EUNAUTHENTICATED;
    status_say(e.u.error.message, sizeof e.u.error.message,
               "the token of this data-plane connection is no longer accepted (the server reread "
               "its token files); reconnect with the current token");
    dp__conn_send(c, &e, NULL, 0, 1);
  }
}
