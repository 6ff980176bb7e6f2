// sharding/quant/ldlq.h — quantizes a whole regularised matrix tile by tile
// (exl3-format.md §6.4 LDLQ with a Hessian, §6.6 without).
//
//   WorkerPool pool(threads);
//   EXL3_ASSIGN_OR_RETURN(QuantizedMatrix q,
//       QuantizeMatrix(w_r, k, n, 4, Codebook::kMul1, h_t, &pool, progress));
//
// Orientation: W_r is k x n row-major (rows = input channels). Output states
// are in file order [k/16][n/16][256], each tile in trellis sequence order
// (position j holds tile element TilePermutation(j), §3.2); w_q is the
// decoded matrix (k x n).
//
// With a Hessian: block LDL of H_t (16x16 blocks), then 16-row strips from the
// bottom up, each strip's target corrected by the error feedback
// target_c = W_r[c] + L[rows>c, c]ᵀ · E[rows>c], E = W_r - W_q; tiles of one
// strip are quantized in parallel on the pool. Without: every tile alone.
// Thread safety: pure apart from its outputs; borrows the pool for the call.
#ifndef EXL3SERVE_SHARDING_QUANT_LDLQ_H_
#define EXL3SERVE_SHARDING_QUANT_LDLQ_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::sharding::quant {

class WorkerPool;

// Called on the calling thread after each strip: (tiles done, tiles total).
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

struct QuantizedMatrix {
  std::vector<uint16_t> states;  // [k/16][n/16][256]
  std::vector<float> w_q;        // k x n
  // With a Hessian: tr(Eᵀ H_t E) / tr(W_rᵀ H_t W_r). Without: mean((W_r - W_q)²).
  double proxy_error = 0.0;
};

// InvalidArgument: k or n not a positive multiple of 128 (naming the value),
// bits outside 1..8, non-finite W_r. FailedPrecondition: H_t not positive
// definite (Cholesky failed). `h_t` (k x k) may be null; `pool` may be null
// (single-threaded); `progress` may be empty.
absl::StatusOr<QuantizedMatrix> QuantizeMatrix(const float* w_r, int64_t k, int64_t n, int bits,
                                               kernels::Codebook codebook, const float* h_t,
                                               WorkerPool* pool, const ProgressFn& progress);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_LDLQ_H_
