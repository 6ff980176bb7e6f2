// kernels/cpu/trellis_gemm_internal.h — what the scalar, AVX2 and AVX-512
// variants of TrellisGemm share (not a public header; include only from
// kernels/cpu/trellis_gemm*.cc and tests).
//
// Every variant runs the same driver (RunTrellisGemm): validate, input
// transform x' = (x ⊙ suh)·B_k (§5.3 step 1), build the activation layouts
// the inner loops read, then one pool task per 128-wide output column block:
// the variant's ColumnBlockFn writes y'[:, n0:n0+128) = x'·W_h[:, n0:n0+128)
// into y, and the driver applies the output transform of that block in place
// (Hadamard of the block, ⊙ svh, + bias; §5.3 step 3). Because B_n acts on
// aligned 128-blocks, a block task needs nothing from other blocks, and its
// arithmetic does not depend on the thread that runs it.
#ifndef EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_INTERNAL_H_
#define EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_INTERNAL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_gemm.h"

namespace exl3serve::kernels::cpu::internal {

inline constexpr int64_t kColumnBlock = 128;  // = kExl3ChannelGranularity; the unit of work

// Rows up to which the driver builds the position-order activations x_pos
// (the GEMV paths read them); above it only x' (the tile-GEMM path) exists.
inline constexpr int64_t kPositionOrderMaxRows = 16;

// Positions 32p .. 32p+31 of a tile (lanes 4p .. 4p+3, §3.2) cover all 16
// rows of columns p and p+8. The row of position 32p + e does not depend on
// p; the column is p + 8·((e >> 2) & 1).
constexpr int GroupPositionRow(int e) { return 2 * (e >> 3) + (e & 1) + 8 * ((e >> 1) & 1); }
constexpr int GroupPositionColumnOffset(int e) { return 8 * ((e >> 2) & 1); }

// mul1 before the fp16 rounding is affine in the byte sum t (§4.3):
// value = (1774 t - 905216)·2^-18 = kMul1Slope·t + kMul1Offset, both exact.
inline constexpr float kMul1Slope = 1774.0f / 262144.0f;
inline constexpr float kMul1Offset = -905216.0f / 262144.0f;
// Float bit pattern of 2^23: (kFloatMagicBits + t) read as float is 2^23 + t
// for 0 <= t < 2^23; kMul1MagicOffset = kMul1Offset - 2^23·kMul1Slope
// (= -7266746·2^-7, exact), so (2^23 + t)·kMul1Slope + kMul1MagicOffset is
// the exact pre-rounding mul1 value (one FMA, no int->float conversion).
inline constexpr int32_t kFloatMagicBits = 0x4B000000;
inline constexpr float kMul1MagicOffset = -7266746.0f / 128.0f;
static_assert(kMul1MagicOffset == kMul1Offset - 8388608.0f * kMul1Slope);

struct TrellisGemmProblem {
  const Exl3LinearView* view = nullptr;
  int64_t m = 0;
  TrellisGemmPrecision precision = TrellisGemmPrecision::kFloat;
  const float* x_had = nullptr;  // m x k: x' = (x ⊙ suh)·B_k
  // kFloat, m <= kPositionOrderMaxRows: m x (k/16) x 32, x_pos[i][tk][e] =
  // x'[i][16·tk + GroupPositionRow(e)] (else null).
  const float* x_pos = nullptr;
  // kInt8: m x (k/16) x 32 words, the int8 of x'[i][16·tk + GroupPositionRow(e)]/scale
  // replicated into all four bytes; x_scale[i], x_int_sum[i] = Σ_r int8 of x'[i][r].
  const uint32_t* x_pos_i8 = nullptr;
  // kInt8: m x (k/16) x 8 words, word s = bytes [q(2s), q(2s), q(2s+1), q(2s+1)]
  // with q(r) the int8 of x'[i][16·tk + r] (the AVX-512 VBMI2 GEMV's slices).
  const uint32_t* x_pair_i8 = nullptr;
  const float* x_scale = nullptr;
  const int32_t* x_int_sum = nullptr;
  float* y = nullptr;  // m x n
};

// Writes y'[i][n0 + c] = Σ_r x'[i][r]·W_h[r][n0 + c] for all i < m, c < 128,
// n0 = 128·block (kInt8: the affine int8 estimate, see trellis_gemm.h), into
// problem.y. Must not read y before writing it.
using ColumnBlockFn = void (*)(const TrellisGemmProblem& problem, int64_t block);

// The driver described above; `block_fn` is the variant's inner kernel.
absl::Status RunTrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                            const TrellisGemmOptions& options, ColumnBlockFn block_fn);

// kInt8 epilogue shared by all variants so they agree bit for bit:
// y' = scale·(kMul1Slope·Σ t·x_int + kMul1Offset·Σ x_int). Out of line, in
// the scalar translation unit: inlined into an FMA-enabled file, GCC would
// contract it into a vfmadd and the variants would differ in the last bit.
float Int8Epilogue(int32_t t_dot, int32_t x_sum, float scale);

}  // namespace exl3serve::kernels::cpu::internal

namespace exl3serve::kernels::cpu::scalar {
void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block);
}  // namespace exl3serve::kernels::cpu::scalar
namespace exl3serve::kernels::cpu::avx2 {
void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block);
void Mul1WeightsForTest(const int32_t* t, int64_t count, float* w);  // count % 8 == 0
}  // namespace exl3serve::kernels::cpu::avx2
namespace exl3serve::kernels::cpu::avx512icl {
// trellis_gemm_gemv_avx512icl.cc: the mul1 GEMV for K <= 4 on CPUs with
// AVX512-VBMI/VBMI2/VNNI. Supported() checks the CPU; Mul1GemvBlockFn
// returns null for K > 4. The returned function handles any m (kFloat reads
// x_had, kInt8 reads x_pair_i8).
bool Supported();
internal::ColumnBlockFn Mul1GemvBlockFn(int bits, bool int8);
// Test hook: false makes the AVX-512 variant fall back to its 32-bit-lane
// GEMV (the path of AVX-512 CPUs without VBMI2), so tests cover both.
void SetEnabledForTest(bool enabled);
bool Enabled();  // Supported() and not disabled for a test
}  // namespace exl3serve::kernels::cpu::avx512icl
namespace exl3serve::kernels::cpu::avx512 {
void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block);
// Test hook: the SIMD mul1 weight (t -> fp32 value of the fp16 weight) the
// kernels use, for an exhaustive check over t = 0..1020 (count % 16 == 0).
void Mul1WeightsForTest(const int32_t* t, int64_t count, float* w);
}  // namespace exl3serve::kernels::cpu::avx512

#endif  // EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_INTERNAL_H_
