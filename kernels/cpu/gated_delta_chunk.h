// kernels/cpu/gated_delta_chunk.h — the gated delta rule of one value head
// (Gated DeltaNet, arXiv 2412.06464; docs/design/worker.md) in its chunked
// form, the form every path of the model runs (prefill, decode, verification).
//
// The recurrence, per token with normalised q̂ (scaled), k̂, value v, gate
// g = log of the decay, and β:
//
//   S ← exp(g)·S;  u = β(v − Sᵀk̂);  S ← S + k̂uᵀ;  o = Sᵀq̂
//
// Chunked: positions are cut into chunks of C = kGatedDeltaChunk at multiples
// of C from position 0. Inside a chunk starting with state S₀, with
// Gᵢ = g₀ + … + gᵢ (the chunk's cumulative log decay) and γᵢ = exp(Gᵢ):
//
//   uᵢ = β(v − γᵢ·S₀ᵀk̂) − β·Σ_{j<i} exp(Gᵢ−Gⱼ)(k̂·k̂ⱼ)·uⱼ
//   oᵢ = γᵢ·S₀ᵀq̂ + Σ_{j≤i} exp(Gᵢ−Gⱼ)(q̂·k̂ⱼ)·uⱼ
//   at the chunk's end:  S₀ ← γ_{C−1}·S₀ + Σⱼ exp(G_{C−1}−Gⱼ)·k̂ⱼuⱼᵀ
//
// which equals the recurrence in exact arithmetic. The state is S₀ plus the
// open chunk's rows (k̂ⱼ, uⱼ and gⱼ for the tokens since the last multiple of
// C); how many are open follows from the position. S₀ changes only at a
// chunk's end: the S₀ᵀk̂ and S₀ᵀq̂ of all tokens of a chunk are taken in one
// pass over S₀ (a matrix product, the parallel form's speed-up), and the state
// is written once per C tokens instead of twice per token.
//
// Precision: S₀ᵀx and the chunk-end update in fp32 (the O(dk·dv) work per
// token); the gates' sums exp(g_{j+1} + … + gᵢ), the dot products inside the
// chunk and the sums that make u and o in float64, each u and o rounded once
// (the O(C·(dk + dv)) work; cancellation in v − Sᵀk̂ makes it the sensitive
// part). Against a float64 recurrence: ~1e-6 relative on strong decays.
//
// Exactness: every output and state depends only on the tokens and their
// positions, never on how the tokens are split into calls (one call of 2 048
// tokens, one token per call, any cut) — each token's arithmetic is the same
// sequence of operations. Dot products over dk: 16 lane sums over blocks of
// 16, reduced as a tree, then the tail in order; S₀ᵀx and the chunk-end
// update: per element of dv, ascending rows. Every variant (scalar, AVX2,
// AVX-512; runtime dispatch) is the same source compiled with no multiply-add
// contraction, so all are bit-identical.
//
//   float* head = state + h * GatedDeltaHeadStateFloats(dk, dv);   // zero at position 0
//   kernels::GatedDeltaChunked(position, tokens, dk, dv, q, dk, k, dk, v, dv, g, beta, 1,
//                              head, o, dv, nullptr, 0);
#ifndef EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_H_
#define EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_H_

#include <cstdint>

namespace exl3serve::kernels {

inline constexpr int64_t kGatedDeltaChunk = 16;
// dk and dv at most this (the kernel's scratch lives on the stack).
inline constexpr int64_t kGatedDeltaChunkMaxDim = 512;  // sharding/model_arch.cc refuses more

// Floats of one value head's state: S₀ [dk][dv], then the open rows k̂
// [C−1][dk], u [C−1][dv] and g [C−1]. All zero at position 0.
constexpr int64_t GatedDeltaHeadStateFloats(int64_t dk, int64_t dv) {
  return dk * dv + (kGatedDeltaChunk - 1) * (dk + dv + 1);
}

// Tokens at positions position … position + tokens − 1 of one value head:
// q, k [tokens][dk] (rows at q_stride / k_stride), v [tokens][dv] (v_stride),
// g (log decay, <= 0) and β per token at gb_stride; `state` the head's state
// (GatedDeltaHeadStateFloats) after the tokens before `position`; writes
// o [tokens][dv] (o_stride); with `history`, the state after token t is also
// copied to history + t·history_stride. Requires dk, dv <= kGatedDeltaChunkMaxDim.
void GatedDeltaChunked(int64_t position, int64_t tokens, int64_t dk, int64_t dv, const float* q,
                       int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                       int64_t v_stride, const float* g, const float* beta, int64_t gb_stride,
                       float* state, float* o, int64_t o_stride, float* history,
                       int64_t history_stride);

// The variants behind the dispatcher (tests call them directly; calling one
// the CPU lacks is undefined).
#define EXL3_GATED_DELTA_CHUNKED_VARIANT                                                         \
  void GatedDeltaChunked(int64_t position, int64_t tokens, int64_t dk, int64_t dv, const float* q, \
                         int64_t q_stride, const float* k, int64_t k_stride, const float* v,       \
                         int64_t v_stride, const float* g, const float* beta, int64_t gb_stride,   \
                         float* state, float* o, int64_t o_stride, float* history,                 \
                         int64_t history_stride);
namespace cpu::scalar {
EXL3_GATED_DELTA_CHUNKED_VARIANT
}
namespace cpu::avx2 {
EXL3_GATED_DELTA_CHUNKED_VARIANT
}
namespace cpu::avx512 {
EXL3_GATED_DELTA_CHUNKED_VARIANT
}
#undef EXL3_GATED_DELTA_CHUNKED_VARIANT

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_H_
