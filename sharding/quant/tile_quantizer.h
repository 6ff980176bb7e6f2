// sharding/quant/tile_quantizer.h — quantizes one 16x16 tile to a tail-biting
// trellis state sequence (exl3-format.md §6.5): the innermost routine of the
// EXL3 quantizer, run once per tile (k·n/256 times per linear, twice more
// during the global scale search).
//
//   TileWorkspace ws;                                 // once per thread
//   uint16_t states[256]; float decoded[256];
//   double sq = QuantizeTile(target, 4, Codebook::kMul1, ws, states, decoded);
//   // Several independent tiles at once (much faster per tile, same results):
//   QuantizeTiles(targets, count, 4, Codebook::kMul1, ws, states, decoded, sq);
//
// Input `target` is in trellis sequence order (position j holds tile element
// TilePermutation(j), §3.2). Output states satisfy the tail-biting invariant
// (§3.3) `states[0] >> K == states[255] & (2^(16-K) - 1)`, decoded[j] is the
// codebook value of states[j] (exact fp16 value as float), and the return value
// is Σ_j (decoded[j] - target[j])² (accumulated in double).
//
// Algorithm: two fp32 Viterbi passes exactly as §6.5 (pass 1 over the rotated
// order 128..255,0..127 with free start, read the edge entering position 0;
// pass 2 over 0..255 with the start restricted to that edge, traced back from
// the same edge at 255). The per-candidate cost is evaluated as
//     c = prev[s >> K] + fma(cb[s], -2v, cb[s]²)       (= prev + (cb-v)² - v²)
// and v² is added once per edge after the minimum; every variant computes
// exactly these roundings, so scalar, AVX2 and AVX-512 return identical states.
// Ties (equal cost) resolve to the smallest predecessor index p, and the final
// free edge of pass 1 to the smallest edge index.
//
// Batching: QuantizeTiles runs up to 8 tiles through each forward step (both
// passes, each tile with its own cost rows and start row), so a SIMD step
// streams the codebook table from L2 once for the whole group; results are
// exactly those of QuantizeTile on each tile. Callers should pass kTileBatch
// tiles (or more) per call where they can.
//
// Variants: scalar::QuantizeTile/QuantizeTiles (reference, any CPU), avx2::,
// avx512:: (only call them if kernels::cpu::CpuSupportsIsa says so) and the
// dispatchers QuantizeTile/QuantizeTiles, which follow
// kernels::cpu::ActiveCpuIsa() and GetViterbiPrecision(): on a CPU with
// AVX-512 FP16 they use the fp16 path metric (QuantizeTilesFp16, below) unless
// the precision is set to kFp32.
//
// Thread safety: all functions are thread-safe as long as each thread uses its
// own TileWorkspace. Requires: 1 <= bits <= 8, all targets finite.
#ifndef EXL3SERVE_SHARDING_QUANT_TILE_QUANTIZER_H_
#define EXL3SERVE_SHARDING_QUANT_TILE_QUANTIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cpu/cpu_features.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::sharding::quant {

using kernels::Codebook;

// Scratch memory of the tile Viterbi (cost-row history, decisions or
// checkpoints: about 4.3 MiB per tile of a group at most, so ~17 MiB for a
// group of kTileBatch = 4). Allocated on first use, grown as needed, never
// shrunk: create one per thread and reuse it for every tile.
// Thread safety: thread-compatible (one thread at a time).
// Ownership: owns its buffer.
class TileWorkspace {
 public:
  TileWorkspace();
  ~TileWorkspace();
  TileWorkspace(const TileWorkspace&) = delete;
  TileWorkspace& operator=(const TileWorkspace&) = delete;

  // Returns at least `floats` floats, 64-byte aligned. Contents unspecified.
  float* Reserve(size_t floats);

 private:
  struct FreeDeleter {
    void operator()(float* p) const;
  };
  std::unique_ptr<float, FreeDeleter> buffer_;
  size_t capacity_ = 0;
};

inline constexpr int kTileSize = 256;

// Tiles quantized together by QuantizeTiles (one codebook-table load serves
// this many tiles); callers get the best speed with counts that are multiples.
inline constexpr int kTileBatch = 4;

// The variant chosen by kernels::cpu::ActiveCpuIsa() (re-chosen when the
// override changes).
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]);

// Batched form: quantizes `count` independent tiles; tile b reads
// targets[256b .. 256b+255] and writes states/decoded at the same offsets and
// sq_errors[b] (if not null). Results are identical to QuantizeTile on each
// tile alone. Tiles are processed in near-equal groups of at most 8 (9 tiles:
// 5 + 4) that share each forward step; the workspace grows to ~4.3 MiB per
// tile of a group.
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors);

namespace scalar {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]);
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors);
}  // namespace scalar
namespace avx2 {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]);
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors);
}  // namespace avx2
namespace avx512fp16 {
// No CPU or bound check: use QuantizeTilesFp16(). Defined in the FP16 file.
void QuantizeTilesUnchecked(const float* targets, int count, int bits, Codebook codebook,
                            TileWorkspace& workspace, uint16_t* states, float* decoded,
                            double* sq_errors);
// The same search with every cost row kept for the traceback at every K (the
// pre-decision-mask path; QuantizeTilesUnchecked records decision masks at
// small K instead). Identical states (tested); kept as that test's reference
// and for quant_speed_bench. Slow and large at small K: the workspace holds
// 259 rows of 2^(17-K) bytes per tile of a group (17 MiB at K = 1).
void QuantizeTilesKeepRowsUnchecked(const float* targets, int count, int bits,
                                    Codebook codebook, TileWorkspace& workspace,
                                    uint16_t* states, float* decoded, double* sq_errors);
// Largest |value| of the codebook (the fp16 overflow bound uses it).
float MaxAbsCodebookValue(Codebook codebook);
}  // namespace avx512fp16
namespace avx512 {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]);
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors);
}  // namespace avx512

using QuantizeTileFn = double (*)(const float*, int, Codebook, TileWorkspace&, uint16_t*, float*);

using QuantizeTilesFn = void (*)(const float*, int, int, Codebook, TileWorkspace&, uint16_t*,
                                 float*, double*);

// The variant for `isa`; nullptr if the machine cannot run it.
QuantizeTileFn QuantizeTileFor(kernels::cpu::CpuIsa isa);
QuantizeTilesFn QuantizeTilesFor(kernels::cpu::CpuIsa isa);

// The AVX-512 FP16 variant (tile_quantizer_avx512fp16.cc): the same two-pass
// tail-biting Viterbi with the path metric in fp16, 32 lanes per vector,
// about twice as fast per core. Its states are NOT those of the fp32
// variants (different roundings; quality is measured: quant_quality_bench,
// tile_quantizer_test). Tiles holding a target with |v| > kFp16MaxAbsTarget
// go through the fp32 AVX-512 step instead. K <= 3 record decision masks
// instead of keeping cost rows (identical states), so every K is faster than
// fp32. nullptr unless this CPU has AVX-512 FP16 (and the active ISA is
// AVX-512).
inline constexpr float kFp16MaxAbsTarget = 32.0f;
QuantizeTilesFn QuantizeTilesFp16();

// Which path metric the dispatched QuantizeTiles uses. kAuto: fp16 where
// QuantizeTilesFp16() exists, else fp32. kFp32: always fp32, whose states are
// identical on every ISA (scalar, AVX2, AVX-512), so a conversion is
// reproducible on any x86-64 machine. Process-wide; default kAuto.
enum class ViterbiPrecision { kAuto, kFp32 };
void SetViterbiPrecision(ViterbiPrecision precision);
ViterbiPrecision GetViterbiPrecision();

// Reads tile (tk, tn) of a row-major matrix with `n` columns into trellis
// sequence order: seq[j] = m[16·tk + r][16·tn + c] with 16r + c =
// TilePermutation(j) (§3.2). ScatterTile is the inverse.
void GatherTile(const float* m, int64_t n, int64_t tk, int64_t tn, float seq[kTileSize]);
void ScatterTile(const float seq[kTileSize], int64_t n, int64_t tk, int64_t tn, float* m);

// Codebook values as float and their squares, 65 536 each, 64-byte aligned;
// built once per process (thread-safe).
const float* CodebookValues(Codebook codebook);
const float* CodebookSquares(Codebook codebook);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_TILE_QUANTIZER_H_
