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

/* NULL is accepted. */
void auth_keys_free(auth_keys *k);

/* Reads one token file into buf (NUL-terminated) as auth_keys_new does;
 * returns its length, or ZS_EINVAL with the reason in err. For clients that
 * take ZSHARD_TOKEN_FILE. */
int auth_read_token_file(const char *path, char *buf, size_t buflen, char *err, size_t errlen);

#endif
