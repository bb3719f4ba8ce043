/*
 * safetensors — a strict reader of the safetensors header, for `zshard
 * import`.
 *
 * The format: an 8-byte little-endian length n, n bytes of a JSON object
 * {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
 *  ..., "__metadata__": {"key": "value", ...}}, then the raw little-endian
 * data, each tensor's bytes at [begin, end) of it.
 *
 * The file is untrusted: st_parse checks everything before it returns a
 * header, so that an import writes nothing from a file it would reject later
 * — the JSON itself (its own small parser: objects, arrays, strings with
 * their escapes, non-negative integers; nothing else is needed or taken),
 * unique names, dtypes (F32, F16 and BF16: what the fp32 masters hold
 * exactly), shapes, and offsets: inside the data, of the size the shape
 * needs, not overlapping another tensor's.
 */
#ifndef ZSHARD_CLI_SAFETENSORS_H
#define ZSHARD_CLI_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "zshard/types.h"

/* The most dimensions of a tensor, and the longest header taken (the
 * format's reference reader refuses longer ones too). */
#define ST_MAX_DIMS 16
#define ST_MAX_HEADER_BYTES (100u << 20)

typedef struct st_tensor {
  char *name;     /* owned by the header; NUL-terminated UTF-8, unescaped */
  zs_dtype dtype; /* ZS_DTYPE_FP32, _FP16 or _BF16 */
  uint32_t ndim;
  uint64_t shape[ST_MAX_DIMS];
  uint64_t numel;
  uint64_t begin, end; /* bytes of the data section (after the header) */
  /* A view saved as it was (torchzip only: a transpose, a slice): its
   * elements lie at begin + (i0 * stride[0] + i1 * stride[1] + ...) elements,
   * every one inside [begin, end); 0 for the row-major tensors of both
   * formats, whose elements are [begin, end) in order. */
  int strided;
  uint64_t stride[ST_MAX_DIMS];
} st_tensor;

typedef struct st_header {
  st_tensor *tensors; /* owned, n entries, in the header's order */
  size_t n;
  uint64_t data_start; /* 8 + the header's length: where the data begins */
  uint64_t data_len;   /* bytes of data after it */
} st_header;

/* Parses and checks the header of the `size` bytes at `file` (the whole
 * file, typically mapped; only read). Returns 0 and fills *out (freed with
 * st_header_free), or ZS_EPROTO (malformed), ZS_EINVAL (a dtype that is not
 * imported) or ZS_ENOMEM with a sentence in err; *out is then empty. */
int st_parse(const uint8_t *file, uint64_t size, st_header *out, char *err, size_t errlen);

/* Frees what st_parse allocated; tolerates an empty or zeroed header. */
void st_header_free(st_header *h);

/* "F32", "F16", "BF16". */
const char *st_dtype_name(zs_dtype d);

/* Bytes per element of an imported dtype: 4 for FP32, 2 for FP16 and BF16. */
unsigned st_dtype_size(zs_dtype d);

/* The element count of a shape into *numel; -1 when it, or its bytes at 8
 * per element, would not fit in 64 bits (a shape from a file that cannot
 * be a tensor), else 0. Both readers size their tensors with it. */
int st_shape_numel(const uint64_t *shape, uint32_t ndim, uint64_t *numel);

#endif
