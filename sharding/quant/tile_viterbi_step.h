// sharding/quant/tile_viterbi_step.h — internal: one forward step of the tile
// Viterbi (exl3-format.md §6.5) for a batch of up to kMaxBatch tiles, the only
// part that differs per ISA. The two-pass driver and the traceback live in
// tile_quantizer.cc.
//
// With E = 2^(16-K) edges and P = 2^K predecessor choices, for every tile b of
// the batch and every edge e:
//     out_b[e] = min_{p<P} ( prev_b[s >> K] + fma(cb[s], w_b, cb2[s]) ) + vv_b,
//     s = (p << (16-K)) | e,       w_b = -2v_b,   vv_b = v_b·v_b   (all fp32)
// `min` is exact, so its evaluation order is free; the per-candidate value
// must be computed with exactly these two roundings (fma, then add) in every
// variant. The tiles share the codebook tables, so a SIMD step loads each
// table vector once for the whole batch (the point of batching: the 512 KiB of
// tables per position come from L2, which bounds a single tile's step).
// Rows hold E floats plus kRowPad readable (ignored) floats, so a vector load
// may run up to 15 floats past the end of `prev`.
// Requires: out rows 64-byte aligned; prev rows 32-byte aligned.
#ifndef EXL3SERVE_SHARDING_QUANT_TILE_VITERBI_STEP_H_
#define EXL3SERVE_SHARDING_QUANT_TILE_VITERBI_STEP_H_

#include <cstdint>

namespace exl3serve::sharding::quant::internal {

inline constexpr int kRowPad = 16;
inline constexpr int kMaxBatch = 8;

struct BatchStep {
  int bits;   // K, 1..8
  int count;  // tiles in the batch, 1..kMaxBatch
  const float* prev[kMaxBatch];
  float* out[kMaxBatch];
  float w[kMaxBatch];   // -2v per tile
  float vv[kMaxBatch];  // v² per tile
  // Codebook values and squares, natural state order (64-byte aligned).
  const float* cb;
  const float* cb2;
  // The SIMD steps read cb/cb2 from one interleaved table in loop order
  // instead (built by InterleavedCodebook for their lane count; nullptr for
  // the scalar step).
  const float* interleaved;
  // Optional (SIMD steps, K < 4 only; all null or all set): per tile, where
  // to record the step's decisions instead of keeping cost rows. For every
  // vector v of `lanes` edges (v = e / lanes) and p = 1..P-1, a lanes-bit mask
  // (uint16 for 16 lanes, uint8 for 8) at index v·(P-1) + p-1: bit l set iff
  // candidate p of the edge in lane l is strictly below candidates 0..p-1.
  // The winner (smallest p on ties) is the largest p whose bit is set, else
  // 0. Edge offset j in its vector sits in lane (j mod 2^K)·D + (j >> K),
  // D = max(1, lanes >> K) (the σ order above). E·(P-1)/8 bytes per step.
  uint8_t* decisions[kMaxBatch];
};

using ViterbiStepBatchFn = void (*)(const BatchStep& step);

// Interleaved codebook table for SIMD steps with `lanes` (8 or 16) lanes and
// blocks of W = 2·lanes edges (two vectors per block): for block g (edges
// e0 = g·W ..), predecessor p and j < W,
//   t[(g·P + p)·W + j] = cb[(p << (16-K)) | (e0 + σ(j))]
// so a step reads it front to back in one stream (instead of 2^K strided
// streams, more than the L2 prefetcher follows). cb² is not stored: the step
// squares cb exactly (fp16 values), which halves the table traffic. σ is the
// identity for K >= log2(lanes); for smaller K it reorders each vector u of a
// block (j = u·lanes + l) to σ(j) = u·lanes + ((l mod D) << K | (l div D)),
// D = lanes >> K, so that the D predecessor costs of a vector are one
// broadcast load (tile_quantizer_avx512.cc). Values are the same floats as
// cb, so results do not change. 256 KiB, built once per (codebook, K, lanes),
// 64-byte aligned, process lifetime.
const float* InterleavedCodebook(int codebook, int bits, int lanes);

namespace scalar {
void ViterbiStepBatch(const BatchStep& step);
}
namespace avx2 {
void ViterbiStepBatch(const BatchStep& step);
}
namespace avx512 {
void ViterbiStepBatch(const BatchStep& step);
}

}  // namespace exl3serve::sharding::quant::internal

#endif  // EXL3SERVE_SHARDING_QUANT_TILE_VITERBI_STEP_H_
