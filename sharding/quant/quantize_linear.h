// sharding/quant/quantize_linear.h — the top-level EXL3 quantizer for one
// linear layer (exl3-format.md §6.3-6.6): regularise, search the global scale,
// LDLQ (or per-tile fallback), and report the errors.
//
//   QuantizeLinearOptions opt;  opt.bits = 4;  opt.seed = module_index;
//   opt.hessian = finalized.h.data();                    // optional
//   EXL3_ASSIGN_OR_RETURN(QuantizedLinear q,
//       QuantizeLinear(w_hf, out, in, opt, [](int64_t d, int64_t t) { ... }));
//   // q.states -> pack per §3.4 into trellis [in/16][out/16][16K]; q.suh/q.svh
//
// Thread safety: pure; creates its own WorkerPool of opt.threads threads.
#ifndef EXL3SERVE_SHARDING_QUANT_QUANTIZE_LINEAR_H_
#define EXL3SERVE_SHARDING_QUANT_QUANTIZE_LINEAR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/trellis_decode.h"
#include "sharding/quant/ldlq.h"
#include "sharding/quant/regularize.h"

namespace exl3serve::sharding::quant {

// Which basis the Hessian is rotated into (§6.2 note).
enum class HessianBasis {
  kSignsOnly,   // B·diag(σ_u)·H·diag(σ_u)·B — what exllamav3 does
  kWithScales,  // B·diag(su)·H·diag(su)·B — the exact basis of the tiles (default)
};

struct QuantizeLinearOptions {
  int bits = 4;                                     // K, 1..8
  kernels::Codebook codebook = kernels::Codebook::kMul1;
  OutScalesMode out_scales = OutScalesMode::kAlways;
  uint64_t seed = 0;                                // sign vectors (per module)
  int threads = 1;
  // Optional finalized, damped Hessian H (in x in, input-channel basis, not
  // rotated; FinalizedHessian::h). Null: fallback quantization (§6.6).
  const float* hessian = nullptr;
  HessianBasis hessian_basis = HessianBasis::kWithScales;
};

struct QuantizedLinear {
  std::vector<uint16_t> states;  // [k/16][n/16][256], k = in, n = out
  std::vector<uint16_t> suh;     // fp16 bits, length k
  std::vector<uint16_t> svh;     // fp16 bits, length n
  float global_scale = 1.0f;
  double proxy_error = 0.0;      // see QuantizedMatrix::proxy_error
  // ||W_eff - W|| / ||W|| (Frobenius) with W_eff = diag(suh)·B·W_q·B·diag(svh);
  // 0 for an all-zero W.
  double relative_frobenius_error = 0.0;
};

// `w_hf` is the HF weight (out x in, row-major), already zero-padded to
// multiples of 128. InvalidArgument (naming the value) for bad shapes, bits,
// threads or non-finite weights; FailedPrecondition if the rotated Hessian is
// not positive definite.
absl::StatusOr<QuantizedLinear> QuantizeLinear(const float* w_hf, int64_t out, int64_t in,
                                               const QuantizeLinearOptions& options,
                                               const ProgressFn& progress);

// W_eff (k x n, EXL3 orientation) from decoded W_q and the stored scales
// (§5.2), in double. For tests and error reports.
std::vector<double> EffectiveWeight(const float* w_q, const uint16_t* suh, const uint16_t* svh,
                                    int64_t k, int64_t n);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_QUANTIZE_LINEAR_H_
