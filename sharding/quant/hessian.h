// sharding/quant/hessian.h — the input Hessian of a linear layer and its
// factorisations (exl3-format.md §6.2, §6.4).
//
//   HessianAccumulator acc(k);
//   acc.Add(x, rows, k);                                  // per calibration batch
//   EXL3_ASSIGN_OR_RETURN(FinalizedHessian h, FinalizeHessian(acc));
//   if (!h.fallback) { RotateHessian(h.h.data(), scale.data(), k); BlockLdl(...); }
//
// All matrices are row-major float (k x k); sums and dot products are
// accumulated in double. Thread safety: HessianAccumulator is
// thread-compatible; the free functions are pure apart from their outputs.
#ifndef EXL3SERVE_SHARDING_QUANT_HESSIAN_H_
#define EXL3SERVE_SHARDING_QUANT_HESSIAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::sharding::quant {

class WorkerPool;

// Accumulates H += XᵀX over calibration rows (the seam the model forward
// feeds, §6.2). Rows containing Inf/NaN are dropped (and counted).
// Ownership: owns its k x k double accumulator (8·k² bytes).
class HessianAccumulator {
 public:
  explicit HessianAccumulator(int64_t k);

  // x is (rows x k) row-major. Requires: k == this->k().
  void Add(const float* x, int64_t rows, int64_t k);

  int64_t k() const { return k_; }
  int64_t count() const { return count_; }
  int64_t dropped_rows() const { return dropped_rows_; }
  const std::vector<double>& sum() const { return sum_; }

 private:
  int64_t k_;
  int64_t count_ = 0;
  int64_t dropped_rows_ = 0;
  std::vector<double> sum_;  // full k x k (both triangles kept in sync)
};

struct HessianOptions {
  double sigma_reg = 0.025;  // damping: H += sigma_reg · mean(diag H) · I   (§6.2)
  int max_retries = 10;      // on Cholesky failure add 2·sigma_reg·mean(diag) again
};

struct FinalizedHessian {
  // True when the tensor must be quantized without a Hessian (§6.6): no rows,
  // non-finite mean diagonal, or mean(diag) < 1e-20. `h` is then empty.
  bool fallback = false;
  std::vector<float> h;      // damped H = XᵀX / count (k x k), positive definite
  double mean_diag = 0.0;    // before damping
  int damping_retries = 0;   // extra damping rounds that were needed
};

// Divide, check, damp, and prove positive definiteness with a Cholesky.
// InvalidArgument if the options are out of range; FailedPrecondition if the
// matrix is still not positive definite after max_retries.
absl::StatusOr<FinalizedHessian> FinalizeHessian(const HessianAccumulator& acc,
                                                 const HessianOptions& options = {},
                                                 WorkerPool* pool = nullptr);

// The same checks and damping for a Hessian that is already averaged
// (H = XᵀX / count, k x k row-major), e.g. one captured elsewhere and padded
// with zero rows/columns for padded input channels. `count` == 0 means no
// calibration rows (fallback). Errors as FinalizeHessian.
absl::StatusOr<FinalizedHessian> FinalizeMeanHessian(std::vector<float> h, int64_t k,
                                                     int64_t count,
                                                     const HessianOptions& options = {},
                                                     WorkerPool* pool = nullptr);

// H <- B_k · diag(scale) · H · diag(scale) · B_k in place (§6.2). `scale` is
// the ±1 sign vector σ_u (exllamav3) or the full su (exact basis).
// Requires: k multiple of 128.
void RotateHessian(float* h, const float* scale, int64_t k);

// Lower Cholesky factor C (H = C·Cᵀ) written to `c` (upper triangle zeroed).
// Returns false if a pivot is not positive/finite. Cost: k³/6 multiply-adds.
bool CholeskyLower(const float* h, int64_t k, float* c, WorkerPool* pool = nullptr);

// Block LDL with 16x16 blocks (§6.4): H = L·D·Lᵀ, L unit block-lower.
// Writes L with its diagonal blocks set to zero (strictly block-lower, as
// LDLQ uses it) to `l` (k x k) and the diagonal blocks D_ii = C_ii·C_iiᵀ to
// `d` (k/16 blocks of 16x16, may be null). Returns false if the Cholesky
// fails. Requires: k multiple of 16.
bool BlockLdl(const float* h, int64_t k, float* l, float* d, WorkerPool* pool = nullptr);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_HESSIAN_H_
