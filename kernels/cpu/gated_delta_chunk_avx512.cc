// The avx512 variant of kernels::GatedDeltaChunked (gated_delta_chunk.h): the
// shared body compiled for this ISA (flags by file-name suffix, no contraction).
#include "kernels/cpu/gated_delta_chunk_inl.h"

namespace exl3serve::kernels::cpu::avx512 {

void GatedDeltaChunked(int64_t position, int64_t tokens, int64_t dk, int64_t dv, const float* q,
                       int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                       int64_t v_stride, const float* g, const float* beta, int64_t gb_stride,
                       float* state, float* o, int64_t o_stride, float* history,
                       int64_t history_stride) {
  internal::GatedDeltaChunkedBody<8>(position, tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride,
                                  g, beta, gb_stride, state, o, o_stride, history, history_stride);
}

}  // namespace exl3serve::kernels::cpu::avx512
