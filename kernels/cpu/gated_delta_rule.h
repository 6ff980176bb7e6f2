// kernels/cpu/gated_delta_rule.h — the gated delta rule of one value head
// over a run of tokens in its recurrent form (Gated DeltaNet,
// arXiv 2412.06464; docs/design/worker.md), in place on its fp32 state
// S [dk][dv]. The model runs the chunked form (gated_delta_chunk.h); this one
// is the token-by-token reference the tests and gdn_bench compare it with:
//
//   S ← exp(g)·S;  u = β(v − Sᵀk̂);  S ← S + k̂uᵀ;  o = Sᵀq̂
//
// The dot products Sᵀk̂ and Sᵀq̂ accumulate in float64 over dk and are rounded
// once; the state update rounds per element. Every variant (scalar, AVX2,
// AVX-512; runtime dispatch through cpu_features.h) is the same source with
// no multiply-add contraction, lane-wise over dv, so all give bit-identical
// states and outputs.
//
//   kernels::GatedDeltaRule(tokens, dk, dv, q, dk, k, dk, v, dv, decay, beta, 1, S, o, dv);
#ifndef EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_H_
#define EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_H_

#include <cstdint>

namespace exl3serve::kernels {

// q, k (normalised, q scaled) [tokens][dk] with row strides q_stride /
// k_stride; v [tokens][dv] stride v_stride; decay = exp(g) and β per token
// at stride gb_stride; state [dk][dv]; o [tokens][dv] stride o_stride; with
// `history`, the state after token t is also copied to history + t·history_stride.
// Requires: dv <= kGatedDeltaRuleMaxDv.
inline constexpr int64_t kGatedDeltaRuleMaxDv = 1024;
void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride);

// The variants behind the dispatcher (tests call them directly; calling one
// the CPU lacks is undefined).
namespace cpu::scalar {
void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride);
}
namespace cpu::avx2 {
void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride);
}
namespace cpu::avx512 {
void GatedDeltaRule(int64_t tokens, int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    const float* decay, const float* beta, int64_t gb_stride, float* state,
                    float* o, int64_t o_stride, float* history, int64_t history_stride);
}

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_CPU_GATED_DELTA_RULE_H_
