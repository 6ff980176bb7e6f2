#include "sharding/quant/ldlq.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "sharding/quant/hessian.h"
#include "sharding/quant/tile_quantizer.h"
#include "sharding/quant/worker_pool.h"

namespace exl3serve::sharding::quant {
namespace {

// tr(Xᵀ D X) for a 16x16 block X (rows = the strip's 16 input channels) and
// the strip's 16x16 D.
double QuadForm(const float* x, const float* d) {
  double total = 0.0;
  for (int c = 0; c < 16; ++c) {
    for (int r = 0; r < 16; ++r) {
      double row = 0.0;
      for (int s = 0; s < 16; ++s) row += static_cast<double>(d[r * 16 + s]) * x[s * 16 + c];
      total += row * x[r * 16 + c];
    }
  }
  return total;
}

}  // namespace

absl::StatusOr<QuantizedMatrix> QuantizeMatrix(const float* w_r, int64_t k, int64_t n, int bits,
                                               kernels::Codebook codebook, const float* h_t,
                                               WorkerPool* pool, const ProgressFn& progress) {
  if (k <= 0 || n <= 0 || k % 128 != 0 || n % 128 != 0) {
    return absl::InvalidArgumentError("quantize: matrix shape must be positive multiples of 128, got " +
                                      std::to_string(k) + "x" + std::to_string(n));
  }
  if (bits < 1 || bits > 8) {
    return absl::InvalidArgumentError("quantize: bits must be in 1..8, got " + std::to_string(bits));
  }
  for (int64_t i = 0; i < k * n; ++i) {
    if (!std::isfinite(w_r[i])) {
      return absl::InvalidArgumentError("quantize: regularised element " + std::to_string(i) +
                                        " is not finite");
    }
  }
  std::unique_ptr<WorkerPool> own_pool;
  if (pool == nullptr) {
    own_pool = std::make_unique<WorkerPool>(1);
    pool = own_pool.get();
  }
  std::vector<float> l, d;
  if (h_t != nullptr) {
    l.resize(static_cast<size_t>(k * k));
    d.resize(static_cast<size_t>(k / 16 * 256));
    if (!BlockLdl(h_t, k, l.data(), d.data(), pool)) {
      return absl::FailedPreconditionError(
          "quantize: rotated Hessian is not positive definite (raise hessian sigma_reg)");
    }
  }

  const int64_t tiles_k = k / 16;
  const int64_t tiles_n = n / 16;
  QuantizedMatrix out;
  out.states.resize(static_cast<size_t>(tiles_k * tiles_n * kTileSize));
  out.w_q.assign(static_cast<size_t>(k * n), 0.0f);
  std::vector<float> err(static_cast<size_t>(k * n), 0.0f);  // E = W_r - W_q, rows done so far
  std::vector<TileWorkspace> ws(pool->size());
  std::vector<double> num(tiles_n), den(tiles_n);
  double total_num = 0.0, total_den = 0.0;
  const int64_t total_tiles = tiles_k * tiles_n;

  for (int64_t tk = tiles_k - 1; tk >= 0; --tk) {
    const int64_t c0 = 16 * tk;
    // Tiles of a strip are independent: quantize them in groups of up to
    // kTileBatch (one codebook-table pass serves the whole group), with at
    // least one group per worker when the strip is narrow.
    const int64_t group = std::clamp<int64_t>((tiles_n + pool->size() - 1) / pool->size(), 1,
                                              kTileBatch);
    const int64_t groups = (tiles_n + group - 1) / group;
    pool->ParallelFor(groups, [&](int64_t g, int worker) {
      const int64_t tn0 = g * group;
      const int count = static_cast<int>(std::min(group, tiles_n - tn0));
      // target (16x16, row-major r*16+c) = W_r tile + feedback; y = W_r tile
      // + the same product with W_r instead of E (for the denominator).
      float target[kTileBatch][256], y[kTileBatch][256];
      float seq[kTileBatch * kTileSize], decoded[kTileBatch * kTileSize];
      uint16_t states[kTileBatch * kTileSize];
      for (int b = 0; b < count; ++b) {
        const int64_t col0 = 16 * (tn0 + b);
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 16; ++c) {
            target[b][r * 16 + c] = y[b][r * 16 + c] = w_r[(c0 + r) * n + col0 + c];
          }
        }
        if (h_t != nullptr) {
          for (int64_t row = c0 + 16; row < k; ++row) {
            const float* lrow = l.data() + row * k + c0;  // L[row, c0..c0+15]
            const float* erow = err.data() + row * n + col0;
            const float* wrow = w_r + row * n + col0;
            for (int r = 0; r < 16; ++r) {
              const float coef = lrow[r];
              for (int c = 0; c < 16; ++c) {
                target[b][r * 16 + c] += coef * erow[c];
                y[b][r * 16 + c] += coef * wrow[c];
              }
            }
          }
        }
        for (int j = 0; j < kTileSize; ++j) {
          seq[b * kTileSize + j] = target[b][kernels::TilePermutation(j)];
        }
      }
      QuantizeTiles(seq, count, bits, codebook, ws[worker], states, decoded, nullptr);
      for (int b = 0; b < count; ++b) {
        const int64_t tn = tn0 + b;
        const int64_t col0 = 16 * tn;
        std::copy_n(states + b * kTileSize, kTileSize,
                    out.states.data() + (tk * tiles_n + tn) * kTileSize);
        float q[256], resid[256];
        for (int j = 0; j < kTileSize; ++j) {
          q[kernels::TilePermutation(j)] = decoded[b * kTileSize + j];
        }
        double sq = 0.0, wsq = 0.0;
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 16; ++c) {
            const int64_t idx = (c0 + r) * n + col0 + c;
            out.w_q[idx] = q[r * 16 + c];
            err[idx] = w_r[idx] - q[r * 16 + c];
            resid[r * 16 + c] = target[b][r * 16 + c] - q[r * 16 + c];
            sq += static_cast<double>(err[idx]) * err[idx];
            wsq += static_cast<double>(w_r[idx]) * w_r[idx];
          }
        }
        if (h_t != nullptr) {
          // (Lᵀ E)_c = target_c - W_q[c] and (Lᵀ W_r)_c = y, so
          // tr(Eᵀ H E) = Σ_c tr(R_cᵀ D_c R_c) strip by strip.
          num[tn] = QuadForm(resid, d.data() + tk * 256);
          den[tn] = QuadForm(y[b], d.data() + tk * 256);
        } else {
          num[tn] = sq;
          den[tn] = wsq;
        }
      }
    });
    for (int64_t tn = 0; tn < tiles_n; ++tn) {
      total_num += num[tn];
      total_den += den[tn];
    }
    if (progress) progress((tiles_k - tk) * tiles_n, total_tiles);
  }
  if (h_t != nullptr) {
    out.proxy_error = total_den > 0.0 ? total_num / total_den : 0.0;
  } else {
    out.proxy_error = total_num / static_cast<double>(k * n);
  }
  return out;
}

}  // namespace exl3serve::sharding::quant
