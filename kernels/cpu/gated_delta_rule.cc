#include "kernels/cpu/gated_delta_rule.h"

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gated_delta_rule_inl.h"

namespace exl3serve::kernels {

namespace cpu::scalar {
void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride) {
  internal::GatedDeltaRuleBody(tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride, decay, beta,
                               gb_stride, state, o, o_stride, history, history_stride);
}
}  // namespace cpu::scalar

void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride) {
  switch (cpu::ActiveCpuIsa()) {
    case cpu::CpuIsa::kAvx512:
      return cpu::avx512::GatedDeltaRule(tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride,
                                         decay, beta, gb_stride, state, o, o_stride, history,
                                         history_stride);
    case cpu::CpuIsa::kAvx2:
      return cpu::avx2::GatedDeltaRule(tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride,
                                       decay, beta, gb_stride, state, o, o_stride, history,
                                       history_stride);
    case cpu::CpuIsa::kScalar:
      break;
  }
  cpu::scalar::GatedDeltaRule(tokens, dk, dv, q, q_stride, k, k_stride, v, v_stride, decay, beta,
                              gb_stride, state, o, o_stride, history, history_stride);
}

}  // namespace exl3serve::kernels
