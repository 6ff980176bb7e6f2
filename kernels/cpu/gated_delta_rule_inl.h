// kernels/cpu/gated_delta_rule_inl.h — the one body of every GatedDeltaRule
// variant (gated_delta_rule.h), included by each ISA's translation unit,
// compiled there with -ffp-contract=off so that no variant fuses a multiply
// into an add the others round separately. Not a public header.
#ifndef EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_INL_H_
#define EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_INL_H_

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/gated_delta_rule.h"

namespace exl3serve::kernels::cpu::internal {
// Internal linkage: each ISA's translation unit keeps its own copy (an inline
// function shared by name would be merged across them by the linker, and a
// variant would run another ISA's code).
namespace {

inline void GatedDeltaRuleBody(int64_t tokens, int64_t dk, int64_t dv, const float* q,
                               int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                               int64_t v_stride, const float* decay, const float* beta,
                               int64_t gb_stride, float* __restrict state, float* o,
                               int64_t o_stride, float* history, int64_t history_stride) {
  alignas(64) double r[kGatedDeltaRuleMaxDv];
  alignas(64) double acc[kGatedDeltaRuleMaxDv];
  for (int64_t t = 0; t < tokens; ++t) {
    const float* qt = q + t * q_stride;
    const float* kt = k + t * k_stride;
    const float* vt = v + t * v_stride;
    const float d = decay[t * gb_stride];
    const double bt = beta[t * gb_stride];
    // S ← exp(g)·S; r = Sᵀk̂.
    for (int64_t j = 0; j < dv; ++j) r[j] = 0.0;
    for (int64_t i = 0; i < dk; ++i) {
      float* __restrict s = state + i * dv;
      const double ki = kt[i];
      for (int64_t j = 0; j < dv; ++j) {
        s[j] *= d;
        r[j] += static_cast<double>(s[j]) * ki;
      }
    }
    // u = β(v − r); S ← S + k̂uᵀ; o = Sᵀq̂ (the updated state).
    for (int64_t j = 0; j < dv; ++j) r[j] = bt * (static_cast<double>(vt[j]) - r[j]);
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0;
    for (int64_t i = 0; i < dk; ++i) {
      float* __restrict s = state + i * dv;
      const double ki = kt[i], qi = qt[i];
      for (int64_t j = 0; j < dv; ++j) {
        s[j] = static_cast<float>(static_cast<double>(s[j]) + ki * r[j]);
        acc[j] += static_cast<double>(s[j]) * qi;
      }
    }
    float* ot = o + t * o_stride;
    for (int64_t j = 0; j < dv; ++j) ot[j] = static_cast<float>(acc[j]);
    if (history != nullptr) std::copy_n(state, dk * dv, history + t * history_stride);
  }
}

}  // namespace
}  // namespace exl3serve::kernels::cpu::internal

#endif  // EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_INL_H_
