#include "sharding/quant/hessian.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/hadamard.h"
#include "sharding/quant/worker_pool.h"

namespace exl3serve::sharding::quant {

HessianAccumulator::HessianAccumulator(int64_t k) : k_(k), sum_(static_cast<size_t>(k * k), 0.0) {}

void HessianAccumulator::Add(const float* x, int64_t rows, int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    bool finite = true;
    for (int64_t i = 0; i < k; ++i) finite = finite && std::isfinite(row[i]);
    if (!finite) {
      ++dropped_rows_;
      continue;
    }
    // Lower triangle only; mirrored below.
    for (int64_t i = 0; i < k; ++i) {
      const double xi = row[i];
      double* dst = sum_.data() + i * k;
      for (int64_t j = 0; j <= i; ++j) dst[j] += xi * row[j];
    }
    ++count_;
  }
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = i + 1; j < k; ++j) sum_[i * k + j] = sum_[j * k + i];
  }
}

bool CholeskyLower(const float* h, int64_t k, float* c, WorkerPool* pool) {
  // Left-looking, column by column: column j needs columns < j only, and its
  // rows i > j are independent (dot products of rows of C, contiguous).
  for (int64_t i = 0; i < k * k; ++i) c[i] = 0.0f;
  std::vector<double> inv_diag(k);
  for (int64_t j = 0; j < k; ++j) {
    const float* cj = c + j * k;
    double d = h[j * k + j];
    for (int64_t t = 0; t < j; ++t) d -= static_cast<double>(cj[t]) * cj[t];
    if (!(d > 0.0) || !std::isfinite(d)) return false;
    const double djj = std::sqrt(d);
    c[j * k + j] = static_cast<float>(djj);
    const double inv = 1.0 / djj;
    auto row = [&](int64_t i) {
      float* ci = c + i * k;
      double s = h[i * k + j];
      for (int64_t t = 0; t < j; ++t) s -= static_cast<double>(ci[t]) * cj[t];
      ci[j] = static_cast<float>(s * inv);
    };
    const int64_t rows = k - j - 1;
    if (pool != nullptr && pool->size() > 1 && rows * j > (1 << 16)) {
      const int64_t chunk = 64;
      pool->ParallelFor((rows + chunk - 1) / chunk, [&](int64_t b, int) {
        for (int64_t i = j + 1 + b * chunk; i < std::min(k, j + 1 + (b + 1) * chunk); ++i) row(i);
      });
    } else {
      for (int64_t i = j + 1; i < k; ++i) row(i);
    }
  }
  return true;
}

bool BlockLdl(const float* h, int64_t k, float* l, float* d, WorkerPool* pool) {
  if (!CholeskyLower(h, k, l, pool)) return false;
  const int64_t blocks = k / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t b0 = 16 * b;
    // C_bb (lower 16x16) and D_bb = C_bb C_bbᵀ.
    double cbb[16][16];
    for (int r = 0; r < 16; ++r) {
      for (int s = 0; s < 16; ++s) cbb[r][s] = l[(b0 + r) * k + b0 + s];
    }
    if (d != nullptr) {
      float* db = d + b * 256;
      for (int r = 0; r < 16; ++r) {
        for (int s = 0; s < 16; ++s) {
          double acc = 0.0;
          for (int t = 0; t < 16; ++t) acc += cbb[r][t] * cbb[s][t];
          db[r * 16 + s] = static_cast<float>(acc);
        }
      }
    }
    // Rows below: X = C[i, b] · C_bb^-1, i.e. solve X · C_bb = C[i, b] by
    // back substitution over columns (C_bb lower triangular).
    auto solve_row = [&](int64_t i) {
      float* row = l + i * k + b0;
      double x[16];
      for (int s = 15; s >= 0; --s) {
        double acc = row[s];
        for (int t = s + 1; t < 16; ++t) acc -= x[t] * cbb[t][s];
        x[s] = acc / cbb[s][s];
      }
      for (int s = 0; s < 16; ++s) row[s] = static_cast<float>(x[s]);
    };
    if (pool != nullptr && pool->size() > 1 && k - b0 - 16 > 1024) {
      const int64_t chunk = 256;
      const int64_t first = b0 + 16;
      pool->ParallelFor((k - first + chunk - 1) / chunk, [&](int64_t c, int) {
        for (int64_t i = first + c * chunk; i < std::min(k, first + (c + 1) * chunk); ++i) solve_row(i);
      });
    } else {
      for (int64_t i = b0 + 16; i < k; ++i) solve_row(i);
    }
    for (int r = 0; r < 16; ++r) {
      for (int s = 0; s < 16; ++s) l[(b0 + r) * k + b0 + s] = 0.0f;
    }
  }
  return true;
}

void RotateHessian(float* h, const float* scale, int64_t k) {
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < k; ++j) h[i * k + j] *= scale[i] * scale[j];
  }
  kernels::BlockHadamardColumns(h, k, k);  // B · H
  kernels::BlockHadamardRows(h, k, k);     // (B · H) · B
}

absl::StatusOr<FinalizedHessian> FinalizeHessian(const HessianAccumulator& acc,
                                                 const HessianOptions& options, WorkerPool* pool) {
  const int64_t k = acc.k();
  std::vector<float> h;
  if (acc.count() > 0) {
    const double inv_count = 1.0 / static_cast<double>(acc.count());
    h.resize(static_cast<size_t>(k * k));
    for (int64_t i = 0; i < k * k; ++i) h[i] = static_cast<float>(acc.sum()[i] * inv_count);
  }
  return FinalizeMeanHessian(std::move(h), k, acc.count(), options, pool);
}

absl::StatusOr<FinalizedHessian> FinalizeMeanHessian(std::vector<float> h, int64_t k,
                                                     int64_t count, const HessianOptions& options,
                                                     WorkerPool* pool) {
  if (!(options.sigma_reg > 0.0) || options.max_retries < 0) {
    return absl::InvalidArgumentError("hessian: sigma_reg must be > 0 and max_retries >= 0, got " +
                                      std::to_string(options.sigma_reg) + " and " +
                                      std::to_string(options.max_retries));
  }
  FinalizedHessian out;
  if (count == 0) {
    out.fallback = true;
    return out;
  }
  if (static_cast<int64_t>(h.size()) != k * k) {
    return absl::InvalidArgumentError("hessian: " + std::to_string(h.size()) +
                                      " values for k = " + std::to_string(k));
  }
  double diag_sum = 0.0;
  for (int64_t i = 0; i < k; ++i) diag_sum += h[i * k + i];
  out.mean_diag = diag_sum / static_cast<double>(k);
  if (!std::isfinite(out.mean_diag) || out.mean_diag < 1e-20) {
    out.fallback = true;
    return out;
  }
  out.h = std::move(h);
  const float damp = static_cast<float>(options.sigma_reg * out.mean_diag);
  for (int64_t i = 0; i < k; ++i) out.h[i * k + i] += damp;
  std::vector<float> chol(static_cast<size_t>(k * k));
  for (int attempt = 0;; ++attempt) {
    if (CholeskyLower(out.h.data(), k, chol.data(), pool)) break;
    if (attempt == options.max_retries) {
      return absl::FailedPreconditionError(
          "hessian: not positive definite after " + std::to_string(options.max_retries) +
          " damping retries (raise hessian sigma_reg)");
    }
    for (int64_t i = 0; i < k; ++i) out.h[i * k + i] += 2.0f * damp;
    ++out.damping_retries;
  }
  return out;
}

}  // namespace exl3serve::sharding::quant
