/* The STREAM-like kernel for AVX2. */
#include <stddef.h>
#define STREAM_NAME stream_mix_avx2
#include "stream_body.h"
