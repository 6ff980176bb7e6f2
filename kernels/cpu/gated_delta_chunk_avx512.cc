// The avx512 variant of kernels::GatedDeltaChunked (gated_delta_chunk.h): the
// shared body compiled for this ISA (flags by file-name suffix, no
// contraction), 8 tokens per pass over S₀.
#include "kernels/cpu/gated_delta_chunk_inl.h"

EXL3_GATED_DELTA_CHUNKED_DEFINE_VARIANT(avx512, 8)
