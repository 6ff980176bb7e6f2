// sharding/quant/regularize.h — incoherence processing before quantization
// (exl3-format.md §6.3): random signs, channel scales, block Hadamard on both
// sides, and the global scale search that fits the matrix to the codebook.
//
//   SignVector(seed, kSignStreamInput, k, &sigma_u);
//   EXL3_ASSIGN_OR_RETURN(Regularized r, Regularize(w, k, n, options, pool));
//   // now W = diag(r.su) · B_k · r.w_r · B_n · diag(r.sv) (up to float rounding
//   // of w_r), with su/sv already rounded to fp16 values.
//
// Orientation: W is k x n row-major (EXL3: rows = input channels).
// Thread safety: pure functions (the pool is borrowed for the call).
#ifndef EXL3SERVE_SHARDING_QUANT_REGULARIZE_H_
#define EXL3SERVE_SHARDING_QUANT_REGULARIZE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::sharding::quant {

class WorkerPool;

// Deterministic ±1 vectors: element i of stream `stream` for `seed` is the
// top bit of splitmix64 applied to a counter (seed·2^20 + stream·2^40 + i
// mixed through splitmix64 first); bit set = -1. Our own PRNG choice,
// documented so a converter run is reproducible from its seed.
inline constexpr uint64_t kSignStreamInput = 1;   // σ_u (rows, length k)
inline constexpr uint64_t kSignStreamOutput = 2;  // σ_v (columns, length n)
void SignVector(uint64_t seed, uint64_t stream, int64_t length, std::vector<float>* out);

// splitmix64 step (public for tests and for other seeded choices).
uint64_t SplitMix64(uint64_t& state);

enum class OutScalesMode { kAlways, kNever, kAuto };

struct RegularizeOptions {
  kernels::Codebook codebook = kernels::Codebook::kMul1;
  int bits = 4;                  // used by the global scale search
  OutScalesMode out_scales = OutScalesMode::kAlways;
  uint64_t seed = 0;             // per module (§6.1)
  // Optional diag(H) (length k) for OutScalesMode::kAuto's skew test; without
  // it kAuto applies the scales (no evidence of skewed inputs).
  const float* hessian_diag = nullptr;
  bool search_global_scale = true;  // false: g = 1 (tests)
};

struct Regularized {
  std::vector<float> w_r;   // k x n, the matrix the trellis encodes
  std::vector<float> su;    // length k, fp16-representable values (= suh)
  std::vector<float> sv;    // length n, fp16-representable values (= svh)
  std::vector<uint16_t> suh;  // fp16 bits of su
  std::vector<uint16_t> svh;  // fp16 bits of sv
  float global_scale = 1.0f;  // g of §6.3 step 4
  bool out_scales_applied = false;
};

// Steps 1-5 of §6.3. The scales are first computed in float, then rounded to
// fp16 (what the file stores), and w_r is recomputed in double from W with the
// rounded su/sv, so the stored suh/svh reproduce W exactly before
// quantization. Zero columns get scale 0.1 while processing and svh = 0.
// InvalidArgument: k or n not a positive multiple of 128, bits out of 1..8,
// non-finite weights.
absl::StatusOr<Regularized> Regularize(const float* w, int64_t k, int64_t n,
                                       const RegularizeOptions& options, WorkerPool* pool);

// Global scale search of §6.3 on a regularised matrix (k x n): returns g with
// the smallest mean((Q(g·t)/g - t)²) over the sample tiles (coarse grid
// 0.1..1.9 step 0.2 on every third sample, fine grid of 5 points step 0.075
// around the coarse minimum on all samples, parabola refinement clamped to
// ±half a step, floor 0.01).
float SearchGlobalScale(const float* w_r, int64_t k, int64_t n, int bits,
                        kernels::Codebook codebook, WorkerPool* pool);

// The sample tiles of the scale search as (tile_row, tile_col): a wrapped
// diagonal 3 tiles wide plus the 8 highest- and 8 lowest-RMS tiles, deduped.
std::vector<std::pair<int64_t, int64_t>> ScaleSearchTiles(const float* w_r, int64_t k, int64_t n);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_REGULARIZE_H_
