/*
 * security — the token and TLS files a client uses: each from its option,
 * else from its environment variable (zshard.h, zs_client_options), read
 * once when the client opens, and handed to every gRPC channel and every
 * data-plane client of that client.
 */
#include <stdlib.h>
#include <string.h>

#include "common/net/auth.h"
#include "common/net/tls.h"
#include "internal.h"

/* The option if set, else the environment variable's value, else NULL. */
static const char *pick(const char *opt, const char *env) {
  if (opt && *opt)
    return opt;
  const char *v = getenv(env);
  return v && *v ? v : NULL;
}

static int dup_or_null(const char *s, char **out) {
  *out = NULL;
  if (s && !(*out = strdup(s)))
    return ZS_ENOMEM;
  return 0;
}

void zc_security_free(zc_security *s) {
  if (s->token) {
    memset(s->token, 0, strlen(s->token)); /* no secret left in freed memory */
    free(s->token);
  }
  free(s->tls_ca_file);
  free(s->tls_cert_file);
  free(s->tls_key_file);
  free(s->tls_server_name);
  tls_ctx_free(s->dp_tls);
  memset(s, 0, sizeof *s);
}

/* The token: the option, $ZSHARD_TOKEN, or $ZSHARD_TOKEN_FILE's first line. */
static int resolve_token(const char *opt, char **out, const char *fn) {
  const char *t = pick(opt, "ZSHARD_TOKEN");
  if (t) {
    if (strlen(t) > AUTH_MAX_TOKEN)
      return zc_fail(ZS_EINVAL, "%s: the token is longer than %u bytes", fn, AUTH_MAX_TOKEN);
    return dup_or_null(t, out) ? zc_fail(ZS_ENOMEM, "%s: out of memory", fn) : ZS_OK;
  }
  const char *path = pick(NULL, "ZSHARD_TOKEN_FILE");
  if (!path)
    return ZS_OK;
  char buf[AUTH_MAX_TOKEN + 1], why[400];
  int n = auth_read_token_file(path, buf, sizeof buf, why, sizeof why);
  if (n < 0)
    return zc_fail(n, "%s: ZSHARD_TOKEN_FILE: %s", fn, why);
  int rc = dup_or_null(buf, out);
  memset(buf, 0, sizeof buf);
  return rc ? zc_fail(ZS_ENOMEM, "%s: out of memory", fn) : ZS_OK;
}

int zc_security_resolve(const char *token, const char *tls_ca_file, const char *tls_cert_file,
                        const char *tls_key_file, const char *tls_server_name, zc_security *out,
                        const char *fn) {
  memset(out, 0, sizeof *out);
  int rc = resolve_token(token, &out->token, fn);
  if (rc == ZS_OK &&
      (dup_or_null(pick(tls_ca_file, "ZSHARD_TLS_CA"), &out->tls_ca_file) ||
       dup_or_null(pick(tls_cert_file, "ZSHARD_TLS_CERT"), &out->tls_cert_file) ||
       dup_or_null(pick(tls_key_file, "ZSHARD_TLS_KEY"), &out->tls_key_file) ||
       dup_or_null(pick(tls_server_name, "ZSHARD_TLS_SERVER_NAME"), &out->tls_server_name)))
    rc = zc_fail(ZS_ENOMEM, "%s: out of memory", fn);
  if (rc == ZS_OK && out->tls_ca_file) {
    /* Made once here, so that a CA or key file that cannot be read fails
     * the open with its reason rather than every later connection. */
    char why[400] = "";
    rc = tls_client_new(out->tls_ca_file, out->tls_cert_file, out->tls_key_file,
                        out->tls_server_name, &out->dp_tls, why, sizeof why);
    if (rc != ZS_OK)
      rc = zc_fail(rc, "%s: TLS: %s", fn, why);
  } else if (rc == ZS_OK && (out->tls_cert_file || out->tls_key_file)) {
    rc = zc_fail(ZS_EINVAL, "%s: a TLS client certificate or key needs a CA (tls_ca_file)", fn);
  }
  if (rc != ZS_OK)
    zc_security_free(out);
  return rc;
}

rpc_security zc_security_rpc(const zc_security *s) {
  rpc_security r = {
      .token = s->token,
      .tls_ca_file = s->tls_ca_file,
      .tls_cert_file = s->tls_cert_file,
      .tls_key_file = s->tls_key_file,
      .tls_server_name = s->tls_server_name,
  };
  return r;
}

int zc_channel_open(const zc_security *s, const char *addr, rpc_channel **out, const char *fn) {
  rpc_security r = zc_security_rpc(s);
  char why[400] = "";
  int rc = rpc_channel_open_secure(addr, &r, out, why, sizeof why);
  if (rc != ZS_OK)
    return zc_fail(rc, "%s: cannot open a channel to %s: %s", fn, addr,
                   why[0] ? why : zs_strerror(rc));
  return ZS_OK;
}

int zc_channel_open_env(const char *addr, rpc_channel **out) {
  *out = NULL;
  zc_security s;
  int rc = zc_security_resolve(NULL, NULL, NULL, NULL, NULL, &s, "zshard");
  if (rc == ZS_OK)
    rc = zc_channel_open(&s, addr, out, "zshard");
  zc_security_free(&s);
  return rc;
}
