/*
 * digits — loading the sklearn digits CSV (through zlib) and the synthetic
 * stand-in. See digits.h.
 */
#include "digits.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef ZSHARD_HAVE_ZLIB
#include <zlib.h>
#endif

uint64_t digits_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float digits_uniform(uint64_t *state) {
  /* The top 24 bits give every float in [0, 1) with a 2^-24 step. */
  return (float)(digits_rand(state) >> 40) * (1.0f / 16777216.0f);
}

void digits_free(digits *d) {
  free(d->x);
  free(d->y);
  memset(d, 0, sizeof *d);
}

static int grow(digits *d, size_t *cap) {
  size_t nc = *cap ? 2 * *cap : 2048;
  float *x = realloc(d->x, nc * DIGITS_FEATURES * sizeof *x);
  if (!x)
    return -1;
  d->x = x;
  uint8_t *y = realloc(d->y, nc);
  if (!y)
    return -1;
  d->y = y;
  *cap = nc;
  return 0;
}

int digits_load(digits *d, const char *path, char *err, size_t errlen) {
  memset(d, 0, sizeof *d);
#ifndef ZSHARD_HAVE_ZLIB
  (void)path;
  snprintf(err, errlen, "built without zlib: cannot read %s", path);
  return -1;
#else
  gzFile f = gzopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
    return -1;
  }
  size_t cap = 0, lineno = 0;
  char line[4096];
  while (gzgets(f, line, sizeof line)) {
    lineno++;
    if (line[0] == '\n' || line[0] == '\0')
      continue;
    if (d->n == cap && grow(d, &cap) != 0) {
      snprintf(err, errlen, "out of memory reading %s", path);
      goto fail;
    }
    char *p = line;
    double v[DIGITS_FEATURES + 1];
    for (int k = 0; k <= DIGITS_FEATURES; k++) {
      char *end;
      v[k] = strtod(p, &end);
      if (end == p || !isfinite(v[k])) {
        snprintf(err, errlen, "%s line %zu: expected 65 numbers", path, lineno);
        goto fail;
      }
      p = end;
      if (k < DIGITS_FEATURES) {
        if (*p != ',') {
          snprintf(err, errlen, "%s line %zu: expected 65 comma-separated numbers", path, lineno);
          goto fail;
        }
        p++;
      }
    }
    if (v[DIGITS_FEATURES] < 0 || v[DIGITS_FEATURES] > 9 ||
        v[DIGITS_FEATURES] != floor(v[DIGITS_FEATURES])) {
      snprintf(err, errlen, "%s line %zu: the label must be 0..9", path, lineno);
      goto fail;
    }
    for (int k = 0; k < DIGITS_FEATURES; k++)
      d->x[d->n * DIGITS_FEATURES + k] = (float)(v[k] / 16.0);
    d->y[d->n] = (uint8_t)v[DIGITS_FEATURES];
    d->n++;
  }
  gzclose(f);
  if (d->n == 0) {
    snprintf(err, errlen, "%s holds no samples", path);
    digits_free(d);
    return -1;
  }
  return 0;
fail:
  gzclose(f);
  digits_free(d);
  return -1;
#endif
}

int digits_synthetic(digits *d, size_t n, uint64_t seed) {
  memset(d, 0, sizeof *d);
  d->x = malloc(n * DIGITS_FEATURES * sizeof *d->x);
  d->y = malloc(n);
  if (!d->x || !d->y) {
    digits_free(d);
    return -1;
  }
  uint64_t rs = seed;
  /* Ten "glyphs": 8x8 patterns with about a third of the pixels inked, like
   * the pen strokes of the real digits. */
  float proto[DIGITS_CLASSES][DIGITS_FEATURES];
  for (int c = 0; c < DIGITS_CLASSES; c++)
    for (int k = 0; k < DIGITS_FEATURES; k++)
      proto[c][k] = digits_uniform(&rs) < 0.33f ? 1.0f : 0.0f;
  for (size_t s = 0; s < n; s++) {
    int c = (int)(digits_rand(&rs) % DIGITS_CLASSES);
    float ink = 0.5f + 0.5f * digits_uniform(&rs); /* pen pressure */
    float *x = &d->x[s * DIGITS_FEATURES];
    for (int k = 0; k < DIGITS_FEATURES; k++) {
      /* Each inked pixel may be missed, and noise is added everywhere, so
       * that classes overlap a little and the task is not trivial. */
      float on = proto[c][k] > 0 && digits_uniform(&rs) < 0.6f ? ink : 0.0f;
      float v = on + 0.8f * digits_uniform(&rs);
      x[k] = v > 1.0f ? 1.0f : v;
    }
    d->y[s] = (uint8_t)c;
  }
  d->n = n;
  d->synthetic = 1;
  return 0;
}
