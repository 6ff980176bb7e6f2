#include "sharding/quant/quantize_linear.h"

#include <cmath>
#include <string>

#include "kernels/hadamard.h"
#include "sharding/quant/hessian.h"
#include "sharding/quant/worker_pool.h"

namespace exl3serve::sharding::quant {

std::vector<double> EffectiveWeight(const float* w_q, const uint16_t* suh, const uint16_t* svh,
                                    int64_t k, int64_t n) {
  std::vector<double> w(static_cast<size_t>(k * n));
  for (int64_t i = 0; i < k * n; ++i) w[i] = w_q[i];
  kernels::BlockHadamardColumns(w.data(), k, n);
  kernels::BlockHadamardRows(w.data(), k, n);
  for (int64_t i = 0; i < k; ++i) {
    const double u = kernels::HalfBitsToFloat(suh[i]);
    for (int64_t j = 0; j < n; ++j) w[i * n + j] *= u * kernels::HalfBitsToFloat(svh[j]);
  }
  return w;
}

absl::StatusOr<QuantizedLinear> QuantizeLinear(const float* w_hf, int64_t out, int64_t in,
                                               const QuantizeLinearOptions& options,
                                               const ProgressFn& progress) {
  if (out <= 0 || in <= 0 || out % 128 != 0 || in % 128 != 0) {
    return absl::InvalidArgumentError("quantize: weight shape must be padded to multiples of 128, got " +
                                      std::to_string(out) + "x" + std::to_string(in));
  }
  if (options.bits < 1 || options.bits > 8) {
    return absl::InvalidArgumentError("quantize: bits must be in 1..8, got " + std::to_string(options.bits));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError("quantize: threads must be >= 1, got " + std::to_string(options.threads));
  }
  const int64_t k = in;
  const int64_t n = out;
  std::vector<float> w(static_cast<size_t>(k * n));  // EXL3 orientation: W = HFᵀ
  for (int64_t o = 0; o < n; ++o) {
    for (int64_t i = 0; i < k; ++i) w[i * n + o] = w_hf[o * k + i];
  }
  WorkerPool pool(options.threads);

  RegularizeOptions reg;
  reg.codebook = options.codebook;
  reg.bits = options.bits;
  reg.out_scales = options.out_scales;
  reg.seed = options.seed;
  std::vector<float> diag;
  if (options.hessian != nullptr) {
    diag.resize(k);
    for (int64_t i = 0; i < k; ++i) diag[i] = options.hessian[i * k + i];
    reg.hessian_diag = diag.data();
  }
  auto regularized = Regularize(w.data(), k, n, reg, &pool);
  if (!regularized.ok()) return regularized.status();
  Regularized& r = *regularized;

  std::vector<float> h_t;
  if (options.hessian != nullptr) {
    h_t.assign(options.hessian, options.hessian + k * k);
    std::vector<float> scale(k);
    if (options.hessian_basis == HessianBasis::kWithScales) {
      scale = r.su;
    } else {
      std::vector<float> sigma_u;
      SignVector(options.seed, kSignStreamInput, k, &sigma_u);
      scale = sigma_u;
    }
    RotateHessian(h_t.data(), scale.data(), k);
  }
  auto quantized = QuantizeMatrix(r.w_r.data(), k, n, options.bits, options.codebook,
                                  h_t.empty() ? nullptr : h_t.data(), &pool, progress);
  if (!quantized.ok()) return quantized.status();

  QuantizedLinear result;
  result.states = std::move(quantized->states);
  result.suh = r.suh;
  result.svh = r.svh;
  result.global_scale = r.global_scale;
  result.proxy_error = quantized->proxy_error;
  const std::vector<double> w_eff = EffectiveWeight(quantized->w_q.data(), r.suh.data(), r.svh.data(), k, n);
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < k * n; ++i) {
    const double d = w_eff[i] - w[i];
    diff += d * d;
    norm += static_cast<double>(w[i]) * w[i];
  }
  result.relative_frobenius_error = norm > 0.0 ? std::sqrt(diff / norm) : 0.0;
  return result;
}

}  // namespace exl3serve::sharding::quant
