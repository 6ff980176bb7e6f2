// kernels/reconstruct.h — one EXL3 linear layer in kernel terms, and the
// scalar CPU reference for decoding it, reconstructing its weight, running
// it, and slicing it for tensor parallelism (exl3-format.md §3, §5).
//
// Orientation is EXL3's throughout: W is k x n = (in_features, out_features),
// row-major, y = x · W_eff + bias, and
//   W_eff = diag(suh) · B_k · W_h · B_n · diag(svh)                    (§5.2)
// with W_h the decoded inner matrix and B_d the block-diagonal 128-point
// Hadamard (kernels/hadamard.h).
//
// Exactness (§1, §10): DecodeInnerMatrix / DecodeInnerMatrixFloat are
// bit-exact (every correct decoder, CPU or CUDA, returns the same fp16 bits).
// Everything after the decode is ordinary floating point; other kernels
// (fused GEMM, CUDA) match these references only to a tolerance. The
// references themselves are deterministic: fixed loop orders, fp32 butterflies
// in natural bit order, fp32 accumulation over k in ascending order.
//
// Usage sketch (a test-vector check):
//   Exl3LinearView view{trellis, k, n, bits, Codebook::kMcg, suh, svh, bias};
//   EXL3_RETURN_IF_ERROR(ValidateExl3LinearView(view));
//   std::vector<uint16_t> w_h(k * n);  EXL3_RETURN_IF_ERROR(DecodeInnerMatrix(view, w_h.data()));
//   std::vector<float> y(m * n);       EXL3_RETURN_IF_ERROR(ReferenceForward(view, x, m, y.data()));
//   EXL3_ASSIGN_OR_RETURN(Exl3LinearData shard, SliceColumns(view, n0, n1));
//
// All functions are pure (no global state besides the lazily built codebook
// tables of trellis_lut.h) and thread-compatible. Outputs must not alias
// inputs.
#ifndef EXL3SERVE_KERNELS_RECONSTRUCT_H_
#define EXL3SERVE_KERNELS_RECONSTRUCT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {

// Channel granularity of EXL3 linears: k and n must be multiples of 128
// because B_k and B_n act on aligned blocks of 128 channels (§5.1) — the
// transform is undefined on a partial block — and exllamav3's converter pads
// every quantized linear to it (§2.4). The same 128 is the TP split unit (§5.5).
inline constexpr int64_t kExl3ChannelGranularity = 128;

// A borrowed description of one EXL3 linear. Zero-sized k or n is allowed (a
// rank may hold no channels, §5.5); then the matching pointers may be null.
//
// Ownership: borrows every array; they must outlive any call using the view.
// Thread safety: immutable view, safe to share.
struct Exl3LinearView {
  const uint16_t* trellis = nullptr;  // [k/16][n/16][16*bits], file I16 data as uint16
  int64_t k = 0;                      // input features (rows of W), multiple of 128
  int64_t n = 0;                      // output features (columns of W), multiple of 128
  int bits = 0;                       // K, bits per weight, 1..8
  Codebook codebook = Codebook::k3Inst;
  const float* suh = nullptr;         // [k] input-side signs x scales
  const float* svh = nullptr;         // [n] output-side signs x scales
  const float* bias = nullptr;        // [n], or nullptr for no bias
};

// An owned EXL3 linear, as produced by the slicing helpers (or built by a
// loader). `bias` empty means no bias.
//
// Ownership: owns all arrays; view() borrows them, so the view is valid while
// this object lives and is not modified.
// Thread safety: thread-compatible (a plain value type).
struct Exl3LinearData {
  std::vector<uint16_t> trellis;
  int64_t k = 0;
  int64_t n = 0;
  int bits = 0;
  Codebook codebook = Codebook::k3Inst;
  std::vector<float> suh;
  std::vector<float> svh;
  std::vector<float> bias;

  Exl3LinearView view() const;
};

// OK when the view describes a usable linear. InvalidArgument, naming the
// field and value, when: bits outside 1..8; k or n negative or not a multiple
// of 128; codebook not one of the three; trellis/suh/svh null while the
// matching dimension is non-zero.
absl::Status ValidateExl3LinearView(const Exl3LinearView& view);

// W_h as fp16 bit patterns, row-major k x n (w_h[r * n + c], r = input row),
// placing trellis position j of tile [tk, tn] at row 16·tk + TilePermutation
// row, column 16·tn + column (§3.1-3.2). Bit-exact.
// Errors: those of ValidateExl3LinearView (w_h untouched).
// Requires: w_h has k·n elements. Cost: O(k·n), no allocation.
absl::Status DecodeInnerMatrix(const Exl3LinearView& view, uint16_t* w_h);

// The same W_h converted to float (exact). Errors and requirements as above.
absl::Status DecodeInnerMatrixFloat(const Exl3LinearView& view, float* w_h);

// W_eff = diag(suh) · B_k · W_h · B_n · diag(svh) (§5.2), row-major k x n,
// computed in the output's precision: decode, t = B_k · W_h · B_n (row
// mixing, then column mixing), then w_eff[r][c] = (t[r][c] * suh[r]) * svh[c].
// The double variant is the reference for tolerance checks.
// Errors as DecodeInnerMatrix.
// Requires: w_eff has k·n elements. Cost: O(k·n·log 128), no allocation.
absl::Status ReconstructEffectiveWeight(const Exl3LinearView& view, float* w_eff);
absl::Status ReconstructEffectiveWeight(const Exl3LinearView& view, double* w_eff);

// y = x · W_eff + bias for m rows, in the transform order of §5.3, all fp32:
//   1. x' = (x ⊙ suh) · B_k          (per row, butterflies in natural order)
//   2. y' = x' · W_h                 (fp32 accumulate, ascending k)
//   3. y  = (y' · B_n) ⊙ svh + bias
// x is row-major m x k, y row-major m x n. m = 0 is allowed.
// Errors: those of ValidateExl3LinearView, or InvalidArgument for m < 0 (y
// untouched). Requires: x, y non-null when m·k, m·n are non-zero.
// Cost: O(m·k·n); allocates m·(k+n) + 16·n floats (W_h is decoded one row of
// tiles at a time, never materialised whole).
absl::Status ReferenceForward(const Exl3LinearView& view, const float* x, int64_t m, float* y);

// Column-parallel shard [n0, n1) (§5.5): full suh, trellis[:, n0/16 : n1/16, :],
// svh[n0:n1], bias[n0:n1] (if any). The shard's forward output equals columns
// [n0, n1) of the unsliced forward output bit for bit.
// Errors: those of ValidateExl3LinearView; InvalidArgument unless
// 0 <= n0 <= n1 <= n with n0, n1 multiples of 128. Cost: copies the shard.
absl::StatusOr<Exl3LinearData> SliceColumns(const Exl3LinearView& view, int64_t n0, int64_t n1);

// Row-parallel shard [k0, k1) (§5.5): suh[k0:k1], trellis[k0/16 : k1/16, :, :],
// full svh, and the bias only when k0 == 0 (so summing the shards' outputs
// adds it once). Summing the shards' forward outputs gives the unsliced
// output up to fp32 rounding. Errors as SliceColumns, for k0, k1 against k.
absl::StatusOr<Exl3LinearData> SliceRows(const Exl3LinearView& view, int64_t k0, int64_t k1);

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_RECONSTRUCT_H_
