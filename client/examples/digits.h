/*
 * digits — the example's data: the 8x8 handwritten digits that Debian's
 * python3-sklearn ships (1797 images, 64 pixels valued 0..16, 10 classes), or,
 * when that file is not installed, a synthetic stand-in of the same shape.
 */
#ifndef ZSHARD_EXAMPLES_DIGITS_H
#define ZSHARD_EXAMPLES_DIGITS_H

#include <stddef.h>
#include <stdint.h>

#define DIGITS_FEATURES 64
#define DIGITS_CLASSES 10
#define DIGITS_DEFAULT_PATH "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"

typedef struct digits {
  size_t n;   /* samples */
  float *x;   /* owned, n * 64 features scaled to [0, 1] */
  uint8_t *y; /* owned, n labels 0..9 */
  int synthetic;
} digits;

/* Loads the gzip'ed CSV at `path` (65 comma-separated numbers per line: 64
 * pixels then the label). Returns 0, or -1 with a sentence in err. */
int digits_load(digits *d, const char *path, char *err, size_t errlen);

/* The synthetic task, used when the real data is absent: n 8x8 images of ten
 * random "glyphs" (fixed patterns with about a third of the pixels inked),
 * each drawn with a random pen pressure, some inked pixels missed and uniform
 * noise added, labelled with their glyph; all from `seed`. Like the digits it
 * is learnable but not trivial. Returns 0 or -1 (out of memory). */
int digits_synthetic(digits *d, size_t n, uint64_t seed);

void digits_free(digits *d);

/* A small deterministic generator (splitmix64) shared by the example. */
uint64_t digits_rand(uint64_t *state);
/* Uniform in [0, 1). */
float digits_uniform(uint64_t *state);

#endif
