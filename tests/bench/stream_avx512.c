/* The STREAM-like kernel for AVX-512, with 512-bit vectors as the optimizer's
 * AVX-512 kernel uses. */
#include <stddef.h>
#define STREAM_NAME stream_mix_avx512
#include "stream_body.h"
