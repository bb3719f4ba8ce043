/*
 * auth — the shared secrets that let a caller in, and the role each one
 * grants. Both transports (gRPC's `authorization: Bearer` metadata and the
 * data plane's first frame) check a presented token here, so the two cannot
 * disagree about who may do what.
 *
 * Roles. A trainer may open and use a job (push, pull, step, read state); an
 * admin may also restore, checkpoint, close jobs and write state. The admin
 * role includes the trainer's. Which methods need which role is the
 * transports' table, written once in each (see docs/OPERATIONS.md,
 * "Security").
 *
 * Configurations:
 *  - no token file at all: authentication is off and every caller is an
 *    admin (the loopback default of a development machine);
 *  - a trainer token only: that token is the admin token too (one secret;
 *    the server logs a warning at start);
 *  - an admin token only: trainer methods are open to anyone, admin methods
 *    need the admin token;
 *  - both: each token grants its own role.
 *
 * Threads: auth_keys_check may run on any thread at any time;
 * auth_keys_reload swaps the secrets under a write lock (rotation without a
 * restart, on SIGHUP). The secrets are compared in constant time with respect
 * to their contents.
 */
#ifndef ZSHARD_COMMON_AUTH_H
#define ZSHARD_COMMON_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "common/net/rank_token.h"

/* The longest token accepted, in bytes; files and frames longer are refused. */
#define AUTH_MAX_TOKEN 4096u
/* The shortest token a file may hold: a guessable secret is refused at start. */
#define AUTH_MIN_TOKEN 16u

typedef enum auth_role {
  AUTH_NONE = 0,    /* no or a wrong token */
  AUTH_TRAINER = 1, /* the trainers' shared secret */
  AUTH_ADMIN = 2    /* the operators' secret */
} auth_role;

typedef struct auth_keys auth_keys;

/* Reads the token files (either may be NULL: that role has no token of its
 * own; both NULL: authentication is off). A file holds the token on its
 * first line; surrounding white space is dropped; AUTH_MIN_TOKEN to
 * AUTH_MAX_TOKEN printable bytes. Returns 0 and the keys in *out (the
 * caller's, freed with auth_keys_free), or ZS_EINVAL with the reason (file
 * and what is wrong with it) in err. The paths are copied for reloads. */
int auth_keys_new(const char *token_file, const char *admin_token_file, auth_keys **out, char *err,
                  size_t errlen);

/* Rereads the files given to auth_keys_new. On any error the keys in use
 * stay as they were and err says why; returns 0 or ZS_EINVAL. */
int auth_keys_reload(auth_keys *k, char *err, size_t errlen);

/* How many reloads have succeeded: a holder of a long-lived session (a
 * data-plane connection) that sees it change checks its token again. Any
 * thread. */
unsigned long long auth_keys_generation(const auth_keys *k);

/* 1 when at least one token is configured (callers must present one). */
int auth_keys_enabled(const auth_keys *k);

/* The role `token` (len bytes, not NUL-terminated, may be NULL) grants:
 * AUTH_ADMIN when authentication is off; otherwise the role of the matching
 * token, AUTH_TRAINER for any caller when only an admin token is configured,
 * or AUTH_NONE. NULL keys mean authentication is off. */
auth_role auth_keys_check(const auth_keys *k, const char *token, size_t len);

/* Whether `role` may call a method that needs `need`. */
static inline int auth_allows(auth_role role, auth_role need) {
  return role >= need;
}

/* Per-rank credentials (rank_token.h). With a rank key configured, a token
 * that starts "zsr1." is never compared with the shared secrets: it grants
 * the trainer role when its HMAC under the key is right and it has not
 * expired, bound to the (job, rank) it names; otherwise AUTH_NONE. */
typedef struct auth_binding {
  int bound; /* 1: a valid rank token; job and rank say for what */
  char job[RANK_TOKEN_MAX_JOB + 1];
  uint32_t rank;
  uint64_t expiry; /* Unix seconds; 0: never. Pushes check it too, so a
                      long-lived data-plane connection does not outlive it */
} auth_binding;

/* Adds a rank key read from key_file (a file as auth_read_token_file reads
 * it: mode checked, AUTH_MIN_TOKEN to AUTH_MAX_TOKEN bytes; reloaded with
 * the token files), and whether pushes need a rank token (require: a push
 * under a plain trainer token is refused; the admin token's are not, since
 * replica forwards carry it). Call once, before any check; key_file may be
 * NULL (no rank tokens). Needs a token file given to auth_keys_new (rank
 * tokens alone would leave the admin methods without a secret): ZS_EINVAL
 * with the reason in err otherwise. */
int auth_keys_set_rank_key(auth_keys *k, const char *key_file, int require, char *err,
                           size_t errlen);

/* As auth_keys_check, and fills *b (may be NULL) with the binding of a rank
 * token; b->bound is 0 for every other token. */
auth_role auth_keys_check_bound(const auth_keys *k, const char *token, size_t len, auth_binding *b);

/* Whether a push for `rank` of job `job_matches` (1 when the push's job is
 * the job named by the binding, which the caller checks against its open
 * job) may go on, for a caller whose token granted `role` and *b: 0, or
 * ZS_EPERM with a sentence in err. A bound caller pushes for its own job and
 * rank only; an unbound trainer is refused when rank tokens are required. */
int auth_push_admit(const auth_keys *k, auth_role role, const auth_binding *b, int job_matches,
                    uint32_t rank, char *err, size_t errlen);

/* NULL is accepted. */
void auth_keys_free(auth_keys *k);

/* Reads one token file into buf (NUL-terminated) as auth_keys_new does;
 * returns its length, or ZS_EINVAL with the reason in err. For clients that
 * take ZSHARD_TOKEN_FILE. */
int auth_read_token_file(const char *path, char *buf, size_t buflen, char *err, size_t errlen);

#endif
