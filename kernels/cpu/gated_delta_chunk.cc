// The scalar variant of kernels::GatedDeltaChunked and the dispatcher.
#include "kernels/cpu/gated_delta_chunk.h"

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gated_delta_chunk_inl.h"

EXL3_GATED_DELTA_CHUNKED_DEFINE_VARIANT(scalar, 4)

namespace exl3serve::kernels {

void GatedDeltaChunked(int64_t position, int64_t tokens, int64_t dk, int64_t dv, const float* q,
                       int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                       int64_t v_stride, const float* g, const float* beta, int64_t gb_stride,
                       float* state, float* o, int64_t o_stride, float* history,
                       int64_t history_stride) {
  auto* fn = &cpu::scalar::GatedDeltaChunked;
  switch (cpu::ActiveCpuIsa()) {
    case cpu::CpuIsa::kAvx512: fn = &cpu::avx512::GatedDeltaChunked; break;
    case cpu::CpuIsa::kAvx2: fn = &cpu::avx2::GatedDeltaChunked; break;
    case cpu::CpuIsa::kScalar: break;
  }
  fn(position, tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride, g, beta, gb_stride, state, o,
     o_stride, history, history_stride);
}

}  // namespace exl3serve::kernels
