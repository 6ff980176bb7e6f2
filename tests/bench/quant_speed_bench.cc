// Tile-quantizer throughput (sharding/quant/tile_quantizer.h): weights/s per
// core for a slice of one 4096x4096 layer (i.i.d. Gaussian, codebook mul1),
// per ISA, on one thread and on all hardware threads, against the target of
// 0.3 M weights/s per core (exl3serve issue: quantizer speed), with a quality
// column so speed never silently costs quality.
//
//   quant_speed_bench [tiles_per_thread=64] [scalar_tiles=4] [batch=kTileBatch] [K=all]
//
// Slice: the first tiles of the 4096x4096 layer in file order (a full layer is
// 65 536 tiles; 1024 distinct tiles = four 16-row strips), each thread
// quantizing its own tiles through QuantizeTiles in groups of `batch` (1 = the
// unbatched single-tile path). Quality: MSE·4^K / mean-square of the targets
// over all tiles quantized by the 1-thread run (identical for every ISA, since
// the variants return identical states). "cpu/core": weights per second of
// the threads' own CPU time (CLOCK_THREAD_CPUTIME_ID), which a shared, loaded
// machine distorts much less than the wall-clock "per core".
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "sharding/quant/tile_quantizer.h"

namespace q = exl3serve::sharding::quant;
using exl3serve::kernels::cpu::CpuIsa;

namespace {

constexpr double kTargetWeightsPerSecondPerCore = 0.3e6;

struct Result {
  double weights_per_second;
  double weights_per_cpu_second;  // per second of thread CPU time, all threads
  double quality;                 // MSE·4^K / E[x²]
};

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

Result Run(q::QuantizeTilesFn fn, int bits, int threads, int tiles_per_thread, int batch,
           const std::vector<float>& data) {
  const int distinct = static_cast<int>(data.size() / 256);
  std::vector<double> sq(threads, 0.0), xx(threads, 0.0), cpu(threads, 0.0);
  std::vector<std::thread> pool;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      q::TileWorkspace ws;
      std::vector<float> targets(static_cast<size_t>(batch) * 256), decoded(targets.size());
      std::vector<uint16_t> states(targets.size());
      std::vector<double> err(batch);
      const double cpu0 = ThreadCpuSeconds();
      for (int i = 0; i < tiles_per_thread; i += batch) {
        const int n = std::min(batch, tiles_per_thread - i);
        for (int b = 0; b < n; ++b) {
          const int tile = (t * tiles_per_thread + i + b) % distinct;
          std::copy_n(data.data() + static_cast<size_t>(tile) * 256, 256, targets.data() + b * 256);
        }
        fn(targets.data(), n, bits, q::Codebook::kMul1, ws, states.data(), decoded.data(),
           err.data());
        for (int b = 0; b < n; ++b) {
          sq[t] += err[b];
          for (int j = 0; j < 256; ++j) xx[t] += targets[b * 256 + j] * targets[b * 256 + j];
        }
      }
      cpu[t] = ThreadCpuSeconds() - cpu0;
    });
  }
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total_sq = 0.0, total_xx = 0.0, total_cpu = 0.0;
  for (int t = 0; t < threads; ++t) {
    total_sq += sq[t];
    total_xx += xx[t];
    total_cpu += cpu[t];
  }
  const double weights = static_cast<double>(threads) * tiles_per_thread * 256;
  return {weights / s, weights / total_cpu, total_sq / total_xx * std::pow(4.0, bits)};
}

}  // namespace

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 64;
  const int scalar_tiles = argc > 2 ? std::atoi(argv[2]) : 4;
  const int batch = argc > 3 ? std::max(1, std::atoi(argv[3])) : q::kTileBatch;
  const int only_bits = argc > 4 ? std::atoi(argv[4]) : 0;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<float> data(1024 * 256);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : data) x = normal(rng);

  std::printf("quant_speed_bench: slice of a 4096x4096 layer (first tiles in file order; mul1, "
              "N(0,1) targets), %d tiles/thread (scalar: %d), batch %d, %d hardware threads\n",
              tiles, scalar_tiles, batch, hw);
  std::printf("%-8s %2s %8s %14s %14s %9s %12s %12s\n", "isa", "K", "threads", "weights/s",
              "per core", "vs 0.3M", "MSE*4^K", "cpu/core");
  // The fp32 variants per ISA, then the AVX-512 FP16 path metric, then (K <= 3)
  // the fp16 search with every cost row kept ("fp16rows": what K <= 3 ran
  // before decision masks; same states).
  for (int variant = 0; variant < 5; ++variant) {
    const CpuIsa isa = variant >= 3 ? CpuIsa::kAvx512 : static_cast<CpuIsa>(variant);
    const std::string name =
        variant == 3   ? std::string("fp16")
        : variant == 4 ? std::string("fp16rows")
                       : std::string(exl3serve::kernels::cpu::CpuIsaName(isa));
    q::QuantizeTilesFn fn = variant < 3 ? q::QuantizeTilesFor(isa) : q::QuantizeTilesFp16();
    if (variant == 4 && fn != nullptr) fn = &q::avx512fp16::QuantizeTilesKeepRowsUnchecked;
    if (fn == nullptr) {
      std::printf("%-8s skipped: not supported by this CPU\n", name.c_str());
      continue;
    }
    const int n = isa == CpuIsa::kScalar ? scalar_tiles : tiles;
    if (n <= 0) continue;
    for (int bits : {1, 2, 3, 4, 5, 6, 8}) {
      if (only_bits != 0 && bits != only_bits) continue;
      if (variant == 4 && bits > 3) break;  // K >= 4: fp16 keeps rows anyway
      for (int threads : {1, hw}) {
        if (threads == hw && hw == 1) break;
        const Result r = Run(fn, bits, threads, n, batch, data);
        const double per_core = r.weights_per_second / threads;
        std::printf("%-8s %2d %8d %14.0f %14.0f %8.2fx %12.4f %12.0f\n", name.c_str(), bits,
                    threads, r.weights_per_second, per_core,
                    per_core / kTargetWeightsPerSecondPerCore, r.quality,
                    r.weights_per_cpu_second);
      }
    }
  }
  return 0;
}
