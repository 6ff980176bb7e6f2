// Tile-quantizer quality table (exl3-format.md §6.5): MSE·4^K for K = 1..8 and
// the three codebooks on i.i.d. N(0,1) data truncated at 2.5σ, scaled to the
// codebook's RMS (MSE normalised by the codebook's mean square), with
// pass/fail against the bounds 1.25 (K <= 5) and 1.35 (K >= 6).
//
//   quant_quality_bench [tiles=64] [seed=1]
// One table for the fp32 path metric (identical on every ISA) and, on a CPU
// with AVX-512 FP16, one for the fp16 path metric (tile_quantizer.h).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "kernels/trellis_lut.h"
#include "sharding/quant/tile_quantizer.h"

namespace q = exl3serve::sharding::quant;
namespace k = exl3serve::kernels;

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 64;
  const unsigned seed = argc > 2 ? static_cast<unsigned>(std::atoi(argv[2])) : 1u;
  std::printf("quant_quality_bench: MSE*4^K, %d tiles of 256 per cell, truncated N(0,1) at 2.5 sigma, seed %u\n",
              tiles, seed);
  bool all_pass = true;
  q::TileWorkspace ws;
  for (int precision = 0; precision < 2; ++precision) {
    q::QuantizeTilesFn fp16 = q::QuantizeTilesFp16();
    if (precision == 1 && fp16 == nullptr) {
      std::printf("fp16 path metric: skipped (this CPU has no AVX-512 FP16)\n");
      break;
    }
    std::printf("%s path metric\n", precision == 0 ? "fp32" : "fp16");
    std::printf("%2s %10s %10s %10s   %s\n", "K", "3inst", "mcg", "mul1", "bound");
    for (int bits = 1; bits <= 8; ++bits) {
      const double bound = bits <= 5 ? 1.25 : 1.35;
      std::printf("%2d", bits);
      for (k::Codebook cb : {k::Codebook::k3Inst, k::Codebook::kMcg, k::Codebook::kMul1}) {
        const double rms = k::GetCodebookTable(cb).rms;
        std::mt19937 rng(seed * 1000 + bits);
        std::normal_distribution<double> normal(0.0, 1.0);
        double sq = 0.0;
        for (int t = 0; t < tiles; ++t) {
          float target[256];
          for (float& x : target) {
            double g;
            do {
              g = normal(rng);
            } while (std::fabs(g) > 2.5);
            x = static_cast<float>(g * rms);
          }
          uint16_t states[256];
          float decoded[256];
          if (precision == 0) {
            q::SetViterbiPrecision(q::ViterbiPrecision::kFp32);
            sq += q::QuantizeTile(target, bits, cb, ws, states, decoded);
            q::SetViterbiPrecision(q::ViterbiPrecision::kAuto);
          } else {
            double e = 0.0;
            fp16(target, 1, bits, cb, ws, states, decoded, &e);
            sq += e;
          }
        }
        const double value = sq / (tiles * 256.0) / (rms * rms) * std::pow(4.0, bits);
        const bool pass = value <= bound;
        all_pass = all_pass && pass;
        std::printf(" %9.4f%s", value, pass ? " " : "!");
      }
      std::printf("   %.2f\n", bound);
    }
  }
  std::printf("%s\n", all_pass ? "PASS: all cells within bounds" : "FAIL: cells marked ! exceed the bound");
  return all_pass ? 0 : 1;
}
