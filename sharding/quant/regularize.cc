#include "sharding/quant/regularize.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/hadamard.h"
#include "sharding/quant/tile_quantizer.h"
#include "sharding/quant/worker_pool.h"

namespace exl3serve::sharding::quant {
namespace {

constexpr double k3InstCodebookRms = 1.24371088;  // §6.3 step 3 (exllamav3's codebook_scale)
constexpr double kScaleEpsilon = 1e-10;
constexpr double kZeroChannelScale = 0.1;
constexpr double kAutoSkewFraction = 0.02;   // top 2 % of sqrt(diag H)
constexpr double kAutoSkewThreshold = 0.15;

absl::Status CheckShape(int64_t k, int64_t n) {
  if (k <= 0 || n <= 0 || k % 128 != 0 || n % 128 != 0) {
    return absl::InvalidArgumentError("quantize: matrix shape must be positive multiples of 128, got " +
                                      std::to_string(k) + "x" + std::to_string(n));
  }
  return absl::OkStatus();
}

double FitError(const std::vector<std::vector<float>>& tiles, const std::vector<size_t>& which,
                double g_scale, int bits, kernels::Codebook codebook, WorkerPool* pool,
                std::vector<TileWorkspace>& ws) {
  // Sample tiles are independent: quantize them in groups of up to kTileBatch
  // (one codebook-table pass per group), at least one group per worker.
  const int64_t count = static_cast<int64_t>(which.size());
  const int workers = pool != nullptr ? pool->size() : 1;
  const int64_t group = std::clamp<int64_t>((count + workers - 1) / workers, 1, kTileBatch);
  const int64_t groups = (count + group - 1) / group;
  std::vector<double> err(which.size());
  auto one = [&](int64_t g, int worker) {
    const int64_t i0 = g * group;
    const int n = static_cast<int>(std::min(group, count - i0));
    float scaled[kTileBatch * kTileSize];
    uint16_t states[kTileBatch * kTileSize];
    float decoded[kTileBatch * kTileSize];
    for (int b = 0; b < n; ++b) {
      const float* t = tiles[which[i0 + b]].data();
      for (int j = 0; j < kTileSize; ++j) scaled[b * kTileSize + j] = static_cast<float>(g_scale * t[j]);
    }
    QuantizeTiles(scaled, n, bits, codebook, ws[worker], states, decoded, nullptr);
    for (int b = 0; b < n; ++b) {
      const float* t = tiles[which[i0 + b]].data();
      double sq = 0.0;
      for (int j = 0; j < kTileSize; ++j) {
        const double d = decoded[b * kTileSize + j] / g_scale - t[j];
        sq += d * d;
      }
      err[i0 + b] = sq;
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(groups, one);
  } else {
    for (int64_t g = 0; g < groups; ++g) one(g, 0);
  }
  return std::accumulate(err.begin(), err.end(), 0.0) / (static_cast<double>(which.size()) * kTileSize);
}

}  // namespace

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void SignVector(uint64_t seed, uint64_t stream, int64_t length, std::vector<float>* out) {
  uint64_t mix = seed ^ (stream << 40);
  uint64_t state = SplitMix64(mix);
  out->resize(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) (*out)[i] = (SplitMix64(state) >> 63) ? -1.0f : 1.0f;
}

std::vector<std::pair<int64_t, int64_t>> ScaleSearchTiles(const float* w_r, int64_t k, int64_t n) {
  const int64_t tk = k / 16;
  const int64_t tn = n / 16;
  std::vector<char> taken(static_cast<size_t>(tk * tn), 0);
  std::vector<std::pair<int64_t, int64_t>> out;
  auto add = [&](int64_t r, int64_t c) {
    if (!taken[r * tn + c]) {
      taken[r * tn + c] = 1;
      out.emplace_back(r, c);
    }
  };
  for (int64_t i = 0; i < std::max(tk, tn); ++i) {
    for (int64_t d = 0; d < 3; ++d) add(i % tk, (i + d) % tn);
  }
  std::vector<std::pair<double, int64_t>> rms(static_cast<size_t>(tk * tn));
  for (int64_t r = 0; r < tk; ++r) {
    for (int64_t c = 0; c < tn; ++c) {
      double sq = 0.0;
      for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 16; ++j) {
          const double v = w_r[(16 * r + i) * n + 16 * c + j];
          sq += v * v;
        }
      }
      rms[r * tn + c] = {sq, r * tn + c};
    }
  }
  std::sort(rms.begin(), rms.end());
  const int64_t extremes = std::min<int64_t>(8, tk * tn);
  for (int64_t i = 0; i < extremes; ++i) {
    add(rms[i].second / tn, rms[i].second % tn);
    add(rms[rms.size() - 1 - i].second / tn, rms[rms.size() - 1 - i].second % tn);
  }
  return out;
}

float SearchGlobalScale(const float* w_r, int64_t k, int64_t n, int bits,
                        kernels::Codebook codebook, WorkerPool* pool) {
  const auto sample = ScaleSearchTiles(w_r, k, n);
  std::vector<std::vector<float>> tiles(sample.size(), std::vector<float>(kTileSize));
  for (size_t i = 0; i < sample.size(); ++i) GatherTile(w_r, n, sample[i].first, sample[i].second, tiles[i].data());
  std::vector<TileWorkspace> ws(pool != nullptr ? pool->size() : 1);
  std::vector<size_t> every_third, all(sample.size());
  for (size_t i = 0; i < sample.size(); i += 3) every_third.push_back(i);
  std::iota(all.begin(), all.end(), size_t{0});

  double best_g = 0.1;
  double best_err = INFINITY;
  for (int i = 0; i < 10; ++i) {  // 0.1, 0.3, ..., 1.9
    const double g = 0.1 + 0.2 * i;
    const double e = FitError(tiles, every_third, g, bits, codebook, pool, ws);
    if (e < best_err) {
      best_err = e;
      best_g = g;
    }
  }
  constexpr double kStep = 0.075;
  double grid[5], errs[5];
  int best = 0;
  for (int i = 0; i < 5; ++i) {
    grid[i] = std::max(0.01, best_g + (i - 2) * kStep);
    errs[i] = FitError(tiles, all, grid[i], bits, codebook, pool, ws);
    if (errs[i] < errs[best]) best = i;
  }
  double g = grid[best];
  if (best > 0 && best < 4) {
    // Parabola through (x-h, e0), (x, e1), (x+h, e2): vertex offset
    // h·(e0 - e2) / (2·(e0 - 2e1 + e2)), clamped to ±h/2.
    const double e0 = errs[best - 1], e1 = errs[best], e2 = errs[best + 1];
    const double denom = e0 - 2.0 * e1 + e2;
    if (denom > 0.0) {
      const double offset = std::clamp(kStep * (e0 - e2) / (2.0 * denom), -kStep / 2, kStep / 2);
      g += offset;
    }
  }
  return static_cast<float>(std::max(0.01, g));
}

absl::StatusOr<Regularized> Regularize(const float* w, int64_t k, int64_t n,
                                       const RegularizeOptions& options, WorkerPool* pool) {
  if (absl::Status s = CheckShape(k, n); !s.ok()) return s;
  if (options.bits < 1 || options.bits > 8) {
    return absl::InvalidArgumentError("quantize: bits must be in 1..8, got " + std::to_string(options.bits));
  }
  for (int64_t i = 0; i < k * n; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError("quantize: weight element " + std::to_string(i) + " is not finite");
    }
  }
  Regularized r;
  std::vector<float> sigma_u, sigma_v;
  SignVector(options.seed, kSignStreamInput, k, &sigma_u);
  SignVector(options.seed, kSignStreamOutput, n, &sigma_v);

  // 1. Output channel scales (column RMS, normalised by their mean).
  bool apply = options.out_scales == OutScalesMode::kAlways;
  if (options.out_scales == OutScalesMode::kAuto) {
    apply = true;
    if (options.hessian_diag != nullptr) {
      std::vector<double> d(k);
      for (int64_t i = 0; i < k; ++i) d[i] = std::sqrt(std::max(0.0f, options.hessian_diag[i]));
      std::sort(d.begin(), d.end(), std::greater<double>());
      const int64_t top = std::max<int64_t>(1, static_cast<int64_t>(kAutoSkewFraction * k));
      const double total = std::accumulate(d.begin(), d.end(), 0.0);
      const double head = std::accumulate(d.begin(), d.begin() + top, 0.0);
      apply = total > 0.0 && head / total < kAutoSkewThreshold;
    }
  }
  r.out_scales_applied = apply;
  std::vector<double> col_rms(n, 0.0);
  std::vector<char> zero_col(n, 0);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) col_rms[j] += static_cast<double>(w[i * n + j]) * w[i * n + j];
  }
  double mean_rms = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    col_rms[j] = std::sqrt(col_rms[j] / k);
    zero_col[j] = col_rms[j] == 0.0;
    mean_rms += col_rms[j];
  }
  mean_rms /= n;
  std::vector<double> sv(n);
  for (int64_t j = 0; j < n; ++j) {
    double o = 1.0;
    if (apply) o = zero_col[j] || mean_rms == 0.0 ? kZeroChannelScale : col_rms[j] / mean_rms;
    sv[j] = apply ? sigma_v[j] * o + kScaleEpsilon : sigma_v[j];
  }

  // 2-3. W / sv, · B_n, row scales, diag(su)^-1, B_k · — first in float to get su.
  std::vector<float> tmp(static_cast<size_t>(k * n));
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) tmp[i * n + j] = static_cast<float>(w[i * n + j] / sv[j]);
  }
  kernels::BlockHadamardRows(tmp.data(), k, n);
  std::vector<double> su(k);
  for (int64_t i = 0; i < k; ++i) {
    double sq = 0.0;
    for (int64_t j = 0; j < n; ++j) sq += static_cast<double>(tmp[i * n + j]) * tmp[i * n + j];
    double rms = std::sqrt(sq / n);
    if (rms == 0.0) rms = kZeroChannelScale;
    su[i] = sigma_u[i] * rms / -k3InstCodebookRms + kScaleEpsilon;
  }
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) tmp[i * n + j] = static_cast<float>(tmp[i * n + j] / su[i]);
  }
  kernels::BlockHadamardColumns(tmp.data(), k, n);

  // 4. Global scale.
  double g = 1.0;
  if (options.search_global_scale) {
    g = SearchGlobalScale(tmp.data(), k, n, options.bits, options.codebook, pool);
  }
  r.global_scale = static_cast<float>(g);

  // 5. Round the stored scales, then recompute W_r in double from W with them.
  r.suh.resize(k);
  r.svh.resize(n);
  r.su.resize(k);
  r.sv.resize(n);
  for (int64_t i = 0; i < k; ++i) {
    r.suh[i] = kernels::FloatToHalfBits(static_cast<float>(su[i] / g));
    r.su[i] = kernels::HalfBitsToFloat(r.suh[i]);
    if (r.su[i] == 0.0f) {  // fp16 underflow: keep a usable (tiny) scale
      r.suh[i] = kernels::FloatToHalfBits(su[i] < 0 ? -6.0e-8f : 6.0e-8f);
      r.su[i] = kernels::HalfBitsToFloat(r.suh[i]);
    }
  }
  std::vector<double> sv_proc(n);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t h = kernels::FloatToHalfBits(static_cast<float>(sv[j]));
    sv_proc[j] = kernels::HalfBitsToFloat(h);
    if (sv_proc[j] == 0.0) sv_proc[j] = sv[j] < 0 ? -6.0e-8 : 6.0e-8;
    r.svh[j] = zero_col[j] ? 0 : kernels::FloatToHalfBits(static_cast<float>(sv_proc[j]));
    r.sv[j] = kernels::HalfBitsToFloat(r.svh[j]);
  }
  std::vector<double> exact(static_cast<size_t>(k * n));
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) exact[i * n + j] = static_cast<double>(w[i * n + j]) / sv_proc[j];
  }
  kernels::BlockHadamardRows(exact.data(), k, n);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) exact[i * n + j] /= r.su[i];
  }
  kernels::BlockHadamardColumns(exact.data(), k, n);
  r.w_r.resize(static_cast<size_t>(k * n));
  for (int64_t i = 0; i < k * n; ++i) r.w_r[i] = static_cast<float>(exact[i]);
  return r;
}

}  // namespace exl3serve::sharding::quant
