#include "sharding/quant/tile_quantizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "common/logging.h"
#include "kernels/trellis_lut.h"
#include "sharding/quant/tile_viterbi_step.h"

namespace exl3serve::sharding::quant {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Tables {
  float* values;
  float* squares;
};

Tables BuildTables(Codebook codebook) {
  const kernels::CodebookTable& table = kernels::GetCodebookTable(codebook);
  auto* values = static_cast<float*>(std::aligned_alloc(64, kernels::kNumStates * sizeof(float)));
  auto* squares = static_cast<float*>(std::aligned_alloc(64, kernels::kNumStates * sizeof(float)));
  EXL3_CHECK(values != nullptr && squares != nullptr);
  for (int s = 0; s < kernels::kNumStates; ++s) {
    values[s] = table.value[s];
    squares[s] = table.value[s] * table.value[s];  // exact: fp16 values have 11-bit mantissas
  }
  return {values, squares};
}

const Tables& GetTables(Codebook codebook) {
  static std::once_flag once[3];
  static Tables tables[3];  // process lifetime, never freed
  const int index = static_cast<int>(codebook);
  std::call_once(once[index], [&] { tables[index] = BuildTables(codebook); });
  return tables[index];
}

// History policy. With E = 2^(16-K) edges a cost row is 4E bytes.
// - K >= 4 (rows <= 16 KiB): every row is kept (4.1 MiB per tile) and the
//   traceback re-evaluates the 2^K candidates of the one edge on the path.
// - K < 4 with a SIMD step: rows would be 8..32 MiB per tile, so the step
//   records its decisions instead (2^K - 1 compare masks per output vector,
//   E·(2^K-1)/8 bytes per position: 1..1.75 MiB per tile) and the traceback
//   decodes them. Costs +0, +0.5, +0.75 ops per candidate vector at K = 1, 2,
//   3 (~0..25 %), against ~+70 % for checkpointing.
// - K < 4 with the scalar reference: only every kSegment-th row is kept as a
//   checkpoint and each segment is recomputed during the traceback (about +70%
//   forward work, 4.5 MiB per tile). The scalar step stays a plain loop.
constexpr int kFullHistoryMaxEdges = 4096;
constexpr int kSegment = 16;
// Positions on each side of the wrap that pass 1 looks at; 128 = the whole
// tile, as QTIP/exllamav3 do. Shorter windows are cheaper (pass 1 + pass 2 =
// 2W + 256 positions) but cost quality. Provenance: quant_quality_bench 256,
// 2026-11-29, this repo's CI machine kind, MSE·4^K (3inst / mcg / mul1):
//   W=128: K=1 1.011 1.010 1.020, K=4 1.044 1.022 0.995, K=8 1.206 1.212 1.111
//   W= 64: K=1 1.019 1.020 1.029, K=4 1.047 1.026 0.999, K=8 1.206 1.212 1.112
//   W= 32: K=1 1.030 1.031 1.038, K=4 1.053 1.034 1.005, K=8 1.208 1.213 1.114
// i.e. 0.5-1 % (W=64) and 1-2 % (W=32) more error at low K for 1.33x / 1.6x
// speed; we keep the full window.
constexpr int kPass1HalfWindow = 128;

// Traceback: the predecessor choice p (smallest on ties) that produced edge `e`
// at a position whose previous cost row is `prev`. Recomputes the 2^K candidate
// costs with the same roundings as the forward step (std::fma is correctly
// rounded, like the vector FMA).
int BestPredecessor(int bits, const float* prev, int edge, const float* cb, const float* cb2,
                    float w) {
  const int shift = 16 - bits;
  float best = kInf;
  int best_p = 0;
  for (int p = 0; p < (1 << bits); ++p) {
    const int s = (p << shift) | edge;
    const float c = prev[s >> bits] + std::fma(cb[s], w, cb2[s]);
    if (c < best) {
      best = c;
      best_p = p;
    }
  }
  return best_p;
}

struct PassContext {
  int bits;
  int edges;      // E = 2^(16-K)
  size_t stride;  // floats per row (E + kRowPad)
  const float* cb;
  const float* cb2;
  internal::ViterbiStepBatchFn step;
  const float* interleaved = nullptr;
  int lanes = 0;                 // SIMD lanes of `step` (0: scalar)
  bool record_decisions = false;  // K < 4 with a SIMD step (decision history)
  size_t decision_bytes = 0;      // per position and tile: E·(P-1)/8
};

// One forward step at position i for `count` tiles (sequences t[b]).
void StepBatch(const PassContext& ctx, int count, const float* const* prev, float* const* out,
               const float* const* t, int i, uint8_t* const* decisions = nullptr) {
  internal::BatchStep a;
  a.bits = ctx.bits;
  a.count = count;
  for (int b = 0; b < count; ++b) {
    const float v = t[b][i];
    a.prev[b] = prev[b];
    a.out[b] = out[b];
    a.w[b] = -2.0f * v;
    a.vv[b] = v * v;
    a.decisions[b] = decisions != nullptr ? decisions[b] : nullptr;
  }
  a.cb = ctx.cb;
  a.cb2 = ctx.cb2;
  a.interleaved = ctx.interleaved;
  ctx.step(a);
}

// Per-tile workspace layout in floats: `rows` cost rows (history, rolling
// rows), then the start row, then (decision mode) the decision history.
struct TileLayout {
  size_t rows;
  size_t floats;
};

TileLayout LayoutFor(const PassContext& ctx) {
  size_t rows;
  if (ctx.record_decisions) {
    rows = 2;
  } else if (ctx.edges <= kFullHistoryMaxEdges) {
    rows = 256 + 2;
  } else {
    rows = 16 + kSegment - 1 + 2;
  }
  size_t floats = (rows + 1) * ctx.stride;
  if (ctx.record_decisions) floats += (256 * ctx.decision_bytes + 63) / 64 * 16;
  return {rows, floats};
}

// Winner p recorded by a SIMD step for `edge` (layout: tile_viterbi_step.h).
int DecodedPredecessor(const uint8_t* row, int edge, int bits, int lanes) {
  const int preds = 1 << bits;
  const int vec = edge / lanes;
  const int j = edge % lanes;
  const int d = std::max(1, lanes >> bits);
  const int lane = (j & (preds - 1)) * d + (j >> bits);
  const int mask_bytes = lanes / 8;
  for (int p = preds - 1; p >= 1; --p) {
    const uint8_t* m = row + (static_cast<size_t>(vec) * (preds - 1) + (p - 1)) * mask_bytes;
    const unsigned bits_here = mask_bytes == 2 ? (m[0] | (m[1] << 8)) : m[0];
    if ((bits_here >> lane) & 1u) return p;
  }
  return 0;
}

// One Viterbi pass of `count` tiles over t[b][0..length-1], tile b starting
// from cost row start[b]. If final_edge[b] < 0 the pass ends at the cheapest
// final edge (smallest index on ties), otherwise at final_edge[b]. Traces back
// positions length-1 down to `stop` and writes their states to
// states[b][stop..length-1]. Requires: length a multiple of 16, <= 256.
// mem[b] holds tile b's history.
void RunPass(const PassContext& ctx, int count, const float* const* t, const float* const* start,
             const int* final_edge, int length, int stop, float* const* mem,
             uint16_t* const* states) {
  const size_t stride = ctx.stride;
  const int bits = ctx.bits;
  const int shift = 16 - bits;
  auto pick_final = [&](int b, const float* last) {
    if (final_edge[b] >= 0) return final_edge[b];
    int best = 0;
    for (int e = 1; e < ctx.edges; ++e) {
      if (last[e] < last[best]) best = e;
    }
    return best;
  };
  auto trace = [&](int b, int i, int edge, const float* prev) {
    const int p = BestPredecessor(bits, prev, edge, ctx.cb, ctx.cb2, -2.0f * t[b][i]);
    const int s = (p << shift) | edge;
    states[b][i] = static_cast<uint16_t>(s);
    return s >> bits;
  };
  const float* prev[internal::kMaxBatch] = {};
  float* out[internal::kMaxBatch] = {};

  if (ctx.record_decisions) {
    // mem[b]: two rolling rows, the start row, then 256 decision rows.
    const size_t dec_offset = 3 * stride;
    auto decisions = [&](int b, int i) {
      return reinterpret_cast<uint8_t*>(mem[b] + dec_offset) + i * ctx.decision_bytes;
    };
    uint8_t* dec[internal::kMaxBatch] = {};
    for (int b = 0; b < count; ++b) prev[b] = start[b];
    for (int i = 0; i < length; ++i) {
      for (int b = 0; b < count; ++b) {
        out[b] = mem[b] + (i & 1) * stride;
        dec[b] = decisions(b, i);
      }
      StepBatch(ctx, count, prev, out, t, i, dec);
      for (int b = 0; b < count; ++b) prev[b] = out[b];
    }
    for (int b = 0; b < count; ++b) {
      int edge = pick_final(b, mem[b] + ((length - 1) & 1) * stride);
      for (int i = length - 1; i >= stop; --i) {
        const int p = DecodedPredecessor(decisions(b, i), edge, bits, ctx.lanes);
        const int s = (p << shift) | edge;
        states[b][i] = static_cast<uint16_t>(s);
        edge = s >> bits;
      }
    }
    return;
  }

  if (ctx.edges <= kFullHistoryMaxEdges) {
    // mem[b]: rows[0..255], then two rolling rows for positions before stop-1.
    // (Streaming the kept rows out with non-temporal stores instead measured
    // no faster end to end: the traceback then reads them from DRAM.)
    auto row = [&](int b, int i) {
      return i >= stop - 1 ? mem[b] + i * stride : mem[b] + (256 + (i & 1)) * stride;
    };
    for (int b = 0; b < count; ++b) prev[b] = start[b];
    for (int i = 0; i < length; ++i) {
      for (int b = 0; b < count; ++b) out[b] = row(b, i);
      StepBatch(ctx, count, prev, out, t, i);
      for (int b = 0; b < count; ++b) prev[b] = out[b];
    }
    for (int b = 0; b < count; ++b) {
      const float* rows = mem[b];
      int edge = pick_final(b, rows + static_cast<size_t>(length - 1) * stride);
      for (int i = length - 1; i >= stop; --i) {
        edge = trace(b, i, edge, i == 0 ? start[b] : rows + (i - 1) * stride);
      }
    }
    return;
  }

  // Checkpoint mode. mem[b]: ckpt[16] (row of position 16c+15), seg[15], roll[2].
  auto ckpt = [&](int b, int c) { return mem[b] + c * stride; };
  auto seg = [&](int b, int j) { return mem[b] + (16 + j) * stride; };
  auto roll = [&](int b, int i) { return mem[b] + (16 + kSegment - 1 + (i & 1)) * stride; };
  for (int b = 0; b < count; ++b) prev[b] = start[b];
  for (int i = 0; i < length; ++i) {
    for (int b = 0; b < count; ++b) {
      out[b] = (i % kSegment == kSegment - 1) ? ckpt(b, i / kSegment) : roll(b, i);
    }
    StepBatch(ctx, count, prev, out, t, i);
    for (int b = 0; b < count; ++b) prev[b] = out[b];
  }
  int edge[internal::kMaxBatch] = {};
  for (int b = 0; b < count; ++b) edge[b] = pick_final(b, ckpt(b, length / kSegment - 1));
  for (int c = length / kSegment - 1; c >= stop / kSegment; --c) {
    const int base = c * kSegment;
    // Recompute rows of positions base .. base+14 (base+15 is the checkpoint).
    for (int b = 0; b < count; ++b) prev[b] = c == 0 ? start[b] : ckpt(b, c - 1);
    for (int j = 0; j < kSegment - 1; ++j) {
      for (int b = 0; b < count; ++b) out[b] = seg(b, j);
      StepBatch(ctx, count, prev, out, t, base + j);
      for (int b = 0; b < count; ++b) prev[b] = out[b];
    }
    for (int b = 0; b < count; ++b) {
      const float* seg_start = c == 0 ? start[b] : ckpt(b, c - 1);
      for (int j = kSegment - 1; j >= 0 && base + j >= stop; --j) {
        edge[b] = trace(b, base + j, edge[b], j == 0 ? seg_start : seg(b, j - 1));
      }
    }
  }
}

// Quantizes up to kMaxBatch tiles together (both passes batched).
void QuantizeBatchWith(internal::ViterbiStepBatchFn step, int lanes, const float* targets, int count, int bits,
                       Codebook codebook, TileWorkspace& workspace, uint16_t* states,
                       float* decoded, double* sq_errors) {
  EXL3_CHECK(bits >= 1 && bits <= 8) << "bits=" << bits;
  EXL3_CHECK(count >= 1 && count <= internal::kMaxBatch) << "count=" << count;
  PassContext ctx;
  ctx.bits = bits;
  ctx.edges = 1 << (16 - bits);
  ctx.stride = static_cast<size_t>(ctx.edges) + internal::kRowPad;
  ctx.cb = CodebookValues(codebook);
  ctx.cb2 = CodebookSquares(codebook);
  ctx.step = step;
  if (lanes > 0) ctx.interleaved = internal::InterleavedCodebook(static_cast<int>(codebook), bits, lanes);

  ctx.lanes = lanes;
  ctx.record_decisions = lanes > 0 && bits < 4;
  ctx.decision_bytes = static_cast<size_t>(ctx.edges) * ((1 << bits) - 1) / 8;
  const TileLayout layout = LayoutFor(ctx);
  const size_t history_rows = layout.rows;
  const size_t per_tile = layout.floats;
  float* base = workspace.Reserve(count * per_tile);
  float* mem[internal::kMaxBatch] = {};
  float* start[internal::kMaxBatch] = {};
  for (int b = 0; b < count; ++b) {
    mem[b] = base + b * per_tile;
    start[b] = mem[b] + history_rows * ctx.stride;
    // Padding floats are read (and ignored) by vector loads; keep them finite.
    for (size_t r = 0; r <= history_rows; ++r) {
      std::memset(mem[b] + r * ctx.stride + ctx.edges, 0, internal::kRowPad * sizeof(float));
    }
  }

  // Pass 1 finds the edge entering position 0: Viterbi with a free start over
  // the positions around the wrap in rotated order, -W..-1, 0..W-1 (mod 256),
  // tracing back from the cheapest final edge; the edge is s_0 >> K of that
  // path (rotated index W). QTIP and exllamav3 run this pass over all 256
  // positions (W = 128), and so do we (kPass1HalfWindow: the measured
  // quality/speed trade-off of shorter windows is recorded there).
  constexpr int kW = kPass1HalfWindow;
  float rotated[internal::kMaxBatch][kTileSize];
  uint16_t rot_states[internal::kMaxBatch][kTileSize];
  const float* t[internal::kMaxBatch] = {};
  uint16_t* st[internal::kMaxBatch] = {};
  int final_edge[internal::kMaxBatch] = {};
  for (int b = 0; b < count; ++b) {
    const float* target = targets + b * kTileSize;
    for (int i = 0; i < 2 * kW; ++i) rotated[b][i] = target[(i + kTileSize - kW) & 255];
    for (int e = 0; e < ctx.edges; ++e) start[b][e] = 0.0f;
    t[b] = rotated[b];
    st[b] = rot_states[b];
    final_edge[b] = -1;
  }
  RunPass(ctx, count, t, start, final_edge, 2 * kW, kW, mem, st);

  // Pass 2: natural order, start restricted to start_edge, end on it.
  for (int b = 0; b < count; ++b) {
    const int start_edge = rot_states[b][kW] >> bits;
    for (int e = 0; e < ctx.edges; ++e) start[b][e] = kInf;
    start[b][start_edge] = 0.0f;
    final_edge[b] = start_edge;
    t[b] = targets + b * kTileSize;
    st[b] = states + b * kTileSize;
  }
  RunPass(ctx, count, t, start, final_edge, kTileSize, 0, mem, st);

  for (int b = 0; b < count; ++b) {
    double sq = 0.0;
    for (int i = 0; i < kTileSize; ++i) {
      const int j = b * kTileSize + i;
      decoded[j] = ctx.cb[states[j]];
      const double d = static_cast<double>(decoded[j]) - targets[j];
      sq += d * d;
    }
    if (sq_errors != nullptr) sq_errors[b] = sq;
  }
}

void QuantizeTilesWith(internal::ViterbiStepBatchFn step, int lanes, const float* targets, int count,
                       int bits, Codebook codebook, TileWorkspace& workspace, uint16_t* states,
                       float* decoded, double* sq_errors) {
  // Near-equal groups of at most kMaxBatch tiles (9 tiles: 5 + 4, not 8 + 1).
  const int groups = (count + internal::kMaxBatch - 1) / internal::kMaxBatch;
  const int size = groups > 0 ? (count + groups - 1) / groups : 0;
  for (int done = 0; done < count; done += size) {
    const int n = std::min(size, count - done);
    QuantizeBatchWith(step, lanes, targets + done * kTileSize, n, bits, codebook, workspace,
                      states + done * kTileSize, decoded + done * kTileSize,
                      sq_errors != nullptr ? sq_errors + done : nullptr);
  }
}

}  // namespace

namespace internal {

const float* InterleavedCodebook(int codebook, int bits, int lanes) {
  EXL3_CHECK(codebook >= 0 && codebook < 3 && bits >= 1 && bits <= 8 &&
             (lanes == 8 || lanes == 16));
  static std::once_flag once[3][8][2];
  static float* tables[3][8][2];  // process lifetime, never freed
  const int li = lanes == 16 ? 1 : 0;
  std::call_once(once[codebook][bits - 1][li], [&] {
    const Tables& src = GetTables(static_cast<Codebook>(codebook));
    auto* dst = static_cast<float*>(std::aligned_alloc(64, kernels::kNumStates * sizeof(float)));
    EXL3_CHECK(dst != nullptr);
    const int width = 2 * lanes;
    const int edges = 1 << (16 - bits);
    const int preds = 1 << bits;
    const int d = lanes >> bits;  // predecessors per vector when K < log2(lanes)
    size_t at = 0;
    for (int e0 = 0; e0 < edges; e0 += width) {
      for (int p = 0; p < preds; ++p) {
        for (int j = 0; j < width; ++j) {
          const int u = j / lanes, l = j % lanes;
          const int sigma = d >= 2 ? u * lanes + (((l % d) << bits) | (l / d)) : j;
          dst[at++] = src.values[(p << (16 - bits)) | (e0 + sigma)];
        }
      }
    }
    tables[codebook][bits - 1][li] = dst;
  });
  return tables[codebook][bits - 1][li];
}

}  // namespace internal

namespace internal::scalar {

// Reference forward step: plain loops, one tile after the other, the same two
// roundings per candidate as the SIMD variants (std::fma is correctly
// rounded; the add is a separate fp32 operation because the project builds in
// ISO mode, -ffp-contract=off).
void ViterbiStepBatch(const BatchStep& a) {
  const int bits = a.bits;
  const int shift = 16 - bits;
  const int edges = 1 << shift;
  for (int b = 0; b < a.count; ++b) {
    const float* prev = a.prev[b];
    for (int e = 0; e < edges; ++e) {
      float best = kInf;
      for (int p = 0; p < (1 << bits); ++p) {
        const int s = (p << shift) | e;
        const float c = prev[s >> bits] + std::fma(a.cb[s], a.w[b], a.cb2[s]);
        best = c < best ? c : best;
      }
      a.out[b][e] = best + a.vv[b];
    }
  }
}

}  // namespace internal::scalar

TileWorkspace::TileWorkspace() = default;
TileWorkspace::~TileWorkspace() = default;

void TileWorkspace::FreeDeleter::operator()(float* p) const { std::free(p); }

float* TileWorkspace::Reserve(size_t floats) {
  if (floats > capacity_) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    buffer_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    EXL3_CHECK(buffer_ != nullptr) << "tile workspace: cannot allocate " << bytes << " bytes";
    capacity_ = bytes / sizeof(float);
  }
  return buffer_.get();
}

void GatherTile(const float* m, int64_t n, int64_t tk, int64_t tn, float seq[kTileSize]) {
  const float* base = m + 16 * tk * n + 16 * tn;
  for (int j = 0; j < kTileSize; ++j) {
    const int rc = kernels::TilePermutation(j);
    seq[j] = base[(rc >> 4) * n + (rc & 15)];
  }
}

void ScatterTile(const float seq[kTileSize], int64_t n, int64_t tk, int64_t tn, float* m) {
  float* base = m + 16 * tk * n + 16 * tn;
  for (int j = 0; j < kTileSize; ++j) {
    const int rc = kernels::TilePermutation(j);
    base[(rc >> 4) * n + (rc & 15)] = seq[j];
  }
}

const float* CodebookValues(Codebook codebook) { return GetTables(codebook).values; }
const float* CodebookSquares(Codebook codebook) { return GetTables(codebook).squares; }

namespace scalar {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]) {
  double sq = 0.0;
  QuantizeTilesWith(&internal::scalar::ViterbiStepBatch, 0, target, 1, bits, codebook, workspace,
                    states, decoded, &sq);
  return sq;
}
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors) {
  QuantizeTilesWith(&internal::scalar::ViterbiStepBatch, 0, targets, count, bits, codebook, workspace,
                    states, decoded, sq_errors);
}
}  // namespace scalar

namespace avx2 {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]) {
  double sq = 0.0;
  QuantizeTilesWith(&internal::avx2::ViterbiStepBatch, 8, target, 1, bits, codebook, workspace,
                    states, decoded, &sq);
  return sq;
}
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors) {
  QuantizeTilesWith(&internal::avx2::ViterbiStepBatch, 8, targets, count, bits, codebook, workspace,
                    states, decoded, sq_errors);
}
}  // namespace avx2

namespace avx512 {
double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]) {
  double sq = 0.0;
  QuantizeTilesWith(&internal::avx512::ViterbiStepBatch, 16, target, 1, bits, codebook, workspace,
                    states, decoded, &sq);
  return sq;
}
void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors) {
  QuantizeTilesWith(&internal::avx512::ViterbiStepBatch, 16, targets, count, bits, codebook, workspace,
                    states, decoded, sq_errors);
}
}  // namespace avx512

QuantizeTilesFn QuantizeTilesFor(kernels::cpu::CpuIsa isa) {
  if (!kernels::cpu::CpuSupportsIsa(isa)) return nullptr;
  switch (isa) {
    case kernels::cpu::CpuIsa::kAvx512:
      return &avx512::QuantizeTiles;
    case kernels::cpu::CpuIsa::kAvx2:
      return &avx2::QuantizeTiles;
    case kernels::cpu::CpuIsa::kScalar:
    default:
      return &scalar::QuantizeTiles;
  }
}

namespace {

std::atomic<ViterbiPrecision> g_viterbi_precision{ViterbiPrecision::kAuto};

// fp16 where every target of the call is within bounds, else the fp32
// AVX-512 step (whole call: callers pass groups of kTileBatch tiles). Every
// K uses fp16: with decision masks at K <= 3 it is faster than fp32 at K = 1
// too (quant_speed_bench cpu/core: 213 k vs 106 k weights/s; the cost
// model in tile_quantizer_avx512fp16.cc).
void QuantizeTilesFp16Checked(const float* targets, int count, int bits, Codebook codebook,
                              TileWorkspace& workspace, uint16_t* states, float* decoded,
                              double* sq_errors) {
  EXL3_CHECK(bits >= 1 && bits <= 8) << "bits=" << bits;
  bool in_range = avx512fp16::MaxAbsCodebookValue(codebook) <= kFp16MaxAbsTarget;
  for (int i = 0; in_range && i < count * kTileSize; ++i) {
    in_range = std::fabs(targets[i]) <= kFp16MaxAbsTarget;  // false for NaN too
  }
  if (!in_range) {
    avx512::QuantizeTiles(targets, count, bits, codebook, workspace, states, decoded, sq_errors);
    return;
  }
  avx512fp16::QuantizeTilesUnchecked(targets, count, bits, codebook, workspace, states, decoded,
                                     sq_errors);
}

}  // namespace

QuantizeTilesFn QuantizeTilesFp16() {
  if (!kernels::cpu::CpuSupportsIsa(kernels::cpu::CpuIsa::kAvx512) ||
      !kernels::cpu::GetCpuFeatures().avx512fp16 ||
      kernels::cpu::ActiveCpuIsa() != kernels::cpu::CpuIsa::kAvx512) {
    return nullptr;
  }
  return &QuantizeTilesFp16Checked;
}

void SetViterbiPrecision(ViterbiPrecision precision) { g_viterbi_precision.store(precision); }
ViterbiPrecision GetViterbiPrecision() { return g_viterbi_precision.load(); }

QuantizeTileFn QuantizeTileFor(kernels::cpu::CpuIsa isa) {
  if (!kernels::cpu::CpuSupportsIsa(isa)) return nullptr;
  switch (isa) {
    case kernels::cpu::CpuIsa::kAvx512:
      return &avx512::QuantizeTile;
    case kernels::cpu::CpuIsa::kAvx2:
      return &avx2::QuantizeTile;
    case kernels::cpu::CpuIsa::kScalar:
    default:
      return &scalar::QuantizeTile;
  }
}

double QuantizeTile(const float target[kTileSize], int bits, Codebook codebook,
                    TileWorkspace& workspace, uint16_t states[kTileSize],
                    float decoded[kTileSize]) {
  // Chosen once, and again only when the process-wide override changes.
  static std::atomic<QuantizeTileFn> chosen{nullptr};
  static std::atomic<uint64_t> chosen_generation{0};
  const uint64_t generation = kernels::cpu::CpuIsaOverrideGeneration();
  if (GetViterbiPrecision() == ViterbiPrecision::kAuto) {
    if (QuantizeTilesFn fast = QuantizeTilesFp16()) {
      double sq = 0.0;
      fast(target, 1, bits, codebook, workspace, states, decoded, &sq);
      return sq;
    }
  }
  QuantizeTileFn fn = chosen.load(std::memory_order_acquire);
  if (fn == nullptr || chosen_generation.load(std::memory_order_acquire) != generation) {
    fn = QuantizeTileFor(kernels::cpu::ActiveCpuIsa());
    chosen_generation.store(generation, std::memory_order_release);
    chosen.store(fn, std::memory_order_release);
  }
  return fn(target, bits, codebook, workspace, states, decoded);
}

}  // namespace exl3serve::sharding::quant

namespace exl3serve::sharding::quant {

void QuantizeTiles(const float* targets, int count, int bits, Codebook codebook,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors) {
  static std::atomic<QuantizeTilesFn> chosen{nullptr};
  static std::atomic<uint64_t> chosen_generation{0};
  const uint64_t generation = kernels::cpu::CpuIsaOverrideGeneration();
  if (GetViterbiPrecision() == ViterbiPrecision::kAuto) {
    static std::atomic<QuantizeTilesFn> fp16{nullptr};
    static std::atomic<uint64_t> fp16_generation{~uint64_t{0}};
    QuantizeTilesFn fast = fp16.load(std::memory_order_acquire);
    if (fp16_generation.load(std::memory_order_acquire) != generation) {
      fast = QuantizeTilesFp16();
      fp16.store(fast, std::memory_order_release);
      fp16_generation.store(generation, std::memory_order_release);
    }
    if (fast != nullptr) return fast(targets, count, bits, codebook, workspace, states, decoded,
                                     sq_errors);
  }
  QuantizeTilesFn fn = chosen.load(std::memory_order_acquire);
  if (fn == nullptr || chosen_generation.load(std::memory_order_acquire) != generation) {
    fn = QuantizeTilesFor(kernels::cpu::ActiveCpuIsa());
    chosen_generation.store(generation, std::memory_order_release);
    chosen.store(fn, std::memory_order_release);
  }
  fn(targets, count, bits, codebook, workspace, states, decoded, sq_errors);
}

}  // namespace exl3serve::sharding::quant
