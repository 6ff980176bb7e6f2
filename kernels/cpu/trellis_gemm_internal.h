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

// kBf16 (trellis_gemm.h): fp32 -> bf16 bits, round to nearest even; results
// below 2^-126 in magnitude (bf16 subnormals, which vdpbf16ps reads as zero)
// become ±0; NaN stays a (quiet) NaN, overflow rounds to ±inf.
inline uint16_t FloatToBf16(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, sizeof(b));
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000u);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  b += 0x7FFFu + ((b >> 16) & 1u);  // a normal never rounds down to a subnormal
  return static_cast<uint16_t>(b >> 16);
}
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &b, sizeof(f));
  return f;
}
// kBf16 activations are packed for the micro-kernels: rows in groups of
// kBf16RowGroup (the last group zero-padded), word [g][p][l] (p < k/2) =
// bf16 of x'[6g + l][2p] in the low half, of x'[6g + l][2p + 1] in the high
// half, so one k-pair step of a row group reads 24 contiguous bytes.
inline constexpr int64_t kBf16RowGroup = 6;
// The AMX kernel reads the bf16 activations as ready-made A tiles: m padded
// with zero rows to a multiple of kBf16AmxRows (two 16-row tiles), element
// [i][r] at ((i/16)·(k/32) + r/32)·512 + (i%16)·32 + r%32, so a tile (16 rows
// x 32 k) is 1 KB contiguous (row-major rows 16 KB apart would all fall in
// one L1 set).
inline constexpr int64_t kBf16AmxRows = 32;

struct TrellisGemmProblem {
  const Exl3LinearView* view = nullptr;
  int64_t m = 0;
  TrellisGemmPrecision precision = TrellisGemmPrecision::kFloat;
  const float* x_had = nullptr;  // m x k: x' = (x ⊙ suh)·B_k
  // kFloat, m <= kPositionOrderMaxRows: m x (k/16) x 32, x_pos[i][tk][e] =
  // x'[i][16·tk + GroupPositionRow(e)] (else null).
  const float* x_pos = nullptr;
  // kInt8: the kernels see one 128-row block of k at a time (view->k = 128,
  // the driver sums the blocks; trellis_gemm.h), so every array below is
  // that block's, laid out as for k = 128.
  // kInt8: m x (k/16) x 32 words, the int8 of x'[i][16·tk + GroupPositionRow(e)]/scale
  // replicated into all four bytes (scale: the block's, per row).
  const uint32_t* x_pos_i8 = nullptr;
  // kInt8: m x (k/16) x 8 words, word s = bytes [q(2s), q(2s), q(2s+1), q(2s+1)]
  // with q(r) the int8 of x'[i][16·tk + r] (the AVX-512 VBMI2 GEMV's slices).
  const uint32_t* x_pair_i8 = nullptr;
  // kInt8: the same pairs as int16 words, (k/16) x m x 8 (tk-major, so one
  // pointer plus constant offsets reaches every row of a pass), word s =
  // q(2s) | q(2s+1) << 16 sign-extended (the VBMI2 GEMV's vpdpwssd form).
  const uint32_t* x_pair_i16 = nullptr;
  // kInt8: the kernel's output, m x n exact int32 dots Σ_r t·x_int (of the
  // block's 128 rows of k) in place of y.
  int32_t* y_int = nullptr;
  // kBf16: ceil(m / kBf16RowGroup) x (k/2) x kBf16RowGroup words (see above).
  const uint32_t* x_bf16 = nullptr;
  // kBf16: roundup(m, kBf16AmxRows) x k bf16 in A-tile order (see above).
  const uint16_t* x_bf16_tiles = nullptr;
  float* y = nullptr;  // m x n
};

// Writes y'[i][n0 + c] = Σ_r x'[i][r]·W_h[r][n0 + c] for all i < m, c < 128,
// n0 = 128·block, into problem.y (kInt8: the int32 dots Σ_r t·x_int into
// problem.y_int, see trellis_gemm.h). Must not read y before writing it.
using ColumnBlockFn = void (*)(const TrellisGemmProblem& problem, int64_t block);

// The driver described above; `block_fn` is the variant's inner kernel.
absl::Status RunTrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                            const TrellisGemmOptions& options, ColumnBlockFn block_fn);

// kInt8 epilogue of one 128-row block of k, shared by all variants so they
// agree bit for bit: y' = scale·(kMul1Slope·Σ t·x_int + kMul1Offset·Σ x_int).
// Out of line, in the scalar translation unit: inlined into an FMA-enabled
// file, GCC would contract it into a vfmadd and the variants would differ in
// the last bit.
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
namespace exl3serve::kernels::cpu::avx512bf16 {
// trellis_gemm_bf16_avx512bf16.cc: the kBf16 micro-kernel (vdpbf16ps).
// Supported(): the CPU and OS allow AVX512-BF16. SetEnabledForTest(false)
// makes the AVX-512 variant use its emulation instead (tests cover both).
bool Supported();
void SetEnabledForTest(bool enabled);
bool Enabled();
// y[i][c] (+)= Σ_{p < kc/2} (x'[i][k0+2p+1]·w[2p+1][c] then x'[i][k0+2p]·w[2p][c])
// for i < rows (<= kBf16RowGroup), c < 64, in kBf16 arithmetic. x: the row
// group's packed words from pair k0/2 on (stride kBf16RowGroup per pair);
// panel: kc/2 x 64 words, word [p][c] = bf16 w[2p][c] | bf16 w[2p+1][c] << 16
// (64-byte aligned); first: start from 0 instead of y.
void MicroKernel(int rows, const uint32_t* x, const uint32_t* panel, int kc, float* y,
                 int64_t ldy, bool first);
// AMX-BF16 (TDPBF16PS): AmxSupported() = CPUID + XCR0 tile state + the
// kernel granted XTILEDATA (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per
// process; false if refused). AmxEnabled() also honours SetAmxEnabledForTest.
// The hardware sums each bf16 pair (and more) before adding to the
// accumulator, in an undocumented order, so the AMX result is NOT bit-equal
// to the vdpbf16ps/scalar arithmetic; it differs by fp32 accumulation error
// only and is deterministic (fixed tile walk, independent of threads).
bool AmxSupported();
void SetAmxEnabledForTest(bool enabled);
bool AmxEnabled();
// acc[i][c] += Σ_{kk < kc} x[i][k0 + kk]·w[kk][c] for i < rows (multiple of
// kBf16AmxRows), c < 128. x: x_bf16_tiles + k0·16 (the tile of rows 0-15,
// columns k0..k0+31), k = the full row length; panels: two panels (columns 0-63, 64-127) of kc/2 x 64 pair
// words (layout of MicroKernel), panel_words apart; kc % 32 == 0; acc:
// rows x 128 fp32, row-major.
void AmxChunk(const uint16_t* x, int64_t k, int64_t rows, const uint32_t* panels,
              int64_t panel_words, int kc, float* acc);
}  // namespace exl3serve::kernels::cpu::avx512bf16
namespace exl3serve::kernels::cpu::avx512 {
void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block);
// Test hook: the SIMD mul1 weight (t -> fp32 value of the fp16 weight) the
// kernels use, for an exhaustive check over t = 0..1020 (count % 16 == 0).
void Mul1WeightsForTest(const int32_t* t, int64_t count, float* w);
}  // namespace exl3serve::kernels::cpu::avx512

#endif  // EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_INTERNAL_H_
