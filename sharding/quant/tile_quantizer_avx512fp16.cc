// AVX-512 FP16 tile Viterbi (tile_quantizer.h, avx512fp16::QuantizeTiles):
// the same two-pass tail-biting procedure as the fp32 variants, with the path
// metric kept in IEEE binary16, 32 lanes per vector. Compiled with
// -mavx512fp16; only called after a runtime check (Fp16ViterbiAvailable).
// Everything this file runs is defined in it (no inline library code, so no
// ODR mixing of AVX-512 FP16 code into generic callers).
//
// Why fp16, and why it is safe here. The fp32 step costs 3 FP operations per
// 16 candidate states (fma, add, min) and is port bound at ~0.27 M weights/s
// per core (tile_quantizer_avx512.cc). Here a candidate is
//     c = fma(t, t, prev[s >> K]),   t = cb[s] - v       (fp16, two roundings)
// and the edge keeps min_p c - mu, mu = the previous row's minimum: 3 ops per
// 32 candidates, half the work per candidate, and no cancellation (the
// distortion is formed as a square, not as cb² - 2v·cb + v²). Subtracting mu
// every step keeps the best path at ~0, so the costs that decide (those near
// the best path) are small numbers where fp16 resolves ~2^-11 of their size,
// and far-off edges never overflow: any edge is reachable from the best one in
// ceil((16-K)/K) <= 15 steps, so a stored cost stays below 16 · max t² (t is
// bounded by kMaxAbsTarget + the codebook's largest |value|; tiles with a
// larger target fall back to the fp32 step, see QuantizeTiles).
// The effect on quality is measured, not assumed: quant_quality_bench prints
// MSE·4^K for both precisions, and tile_quantizer_test bounds the difference.
//
// Inner-loop cost model (K = 4, per trellis position and tile; E = 2^(16-K)
// edges, P = 2^K predecessors, 32-lane vectors, B tiles per batch):
//   65 536 candidates = 2048 candidate vectors, each
//     vsubph, vfmadd231ph (prev as a broadcast operand), vminph
//   = 3 ops on ports 0/5 -> 3072 cycles per position per tile, plus per
//   output vector (1 in 2^K candidate vectors) sub mu, min (row minimum),
//   vpermw (K <= 4: the lane order below) and a store. The table (128 KiB of
//   fp16, loop order) is loaded once per batch. 512 positions per tile:
//   ~1.6 M cycles, i.e. ~0.55 M weights/s per core at 3.5 GHz as the port bound.
//   Predecessors: prev index s >> K = (p << (16-2K)) | (e >> K). For K >= 5 the
//   32 lanes of a vector share it (one 16-bit broadcast). For K <= 4 a vector
//   spans D = 32 >> K predecessors; lanes are ordered
//   l -> e0 + ((l mod D) << K | l div D) so the D values are one broadcast
//   load of D consecutive halves (32/64/128/256 bits), and one vpermw per
//   output vector restores natural order.
//   Candidate p = 0 needs no min (acc = c): 2.5 ops per candidate vector at
//   K = 1, 2.75 at K = 2, 2.875 at K = 3.
//   History, K >= 4: every cost row is kept (fp16: 2^(17-K) bytes, 8 KiB at
//   K = 4), and the traceback re-evaluates the 2^K candidates of the path's
//   edge with the same two scalar roundings (vsubsh, vfmadd231sh).
//   History, K <= 3: rows would be 16..64 KiB per position (4..16 MiB per
//   tile; the pass went memory bound: K = 1 ran at 90 k weights/s, below the
//   fp32 step), so the step records decisions instead, as the fp32 AVX-512
//   step does (tile_viterbi_step.h): per output vector and p = 1..P-1 the
//   32-bit mask vcmpph(c < acc) (+1 op on p5 and a 4-byte kmovd store per
//   candidate vector with p > 0), E·(P-1)/8 bytes per position (1 / 1.5 /
//   1.75 MiB per tile at K = 1 / 2 / 3), two rolling rows and the start row;
//   pass 1 records only the positions it traces back (>= W). The traceback
//   decodes the winner as the largest p with its bit set (the first p among
//   equal costs, as the re-evaluation) in lane (j mod 2^K)·D + (j >> K):
//   identical states (tested against QuantizeTilesKeepRowsUnchecked).
//   Measured (quant_speed_bench 64 2 4, rows "fp16rows" -> masks "fp16",
//   cpu/core column, 1 thread, 2026-11-30, load ~10; docs/BENCHMARKS.md):
//     K = 1   70 k -> 213 k   (fp32 AVX-512: 106 k)
//     K = 2  162 k -> 286 k
//     K = 3  306 k -> 319 k   (at load ~8, 64 tiles: 90/242/319 k ->
//                              238/300/358 k for K = 1/2/3)
//     K = 4  430 k -> 385 k   (a build with masks at K = 4, per-thread CPU
//                              time, 64 tiles: slower, since 7.5 KiB of masks
//                              per position save little against 8 KiB rows
//                              and cost ~0.9 op per vector; K = 4 keeps rows)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "sharding/quant/tile_quantizer.h"

namespace exl3serve::sharding::quant::avx512fp16 {
namespace {

constexpr int kLanes = 32;
constexpr int kU = 2;                // vectors per block
constexpr int kBlock = kLanes * kU;  // edges per block
constexpr int kMaxB = 8;             // tiles per forward step
constexpr int kPad = 32;             // readable halves past a row's end
constexpr int kPass1HalfWindow = 128;  // the whole tile, as the fp32 path
// K <= 3 records decision masks, larger K keep every cost row (History in
// the cost model above: measured, K = 4 is faster with rows).
constexpr int kDecisionMaxBits = 3;

struct Tables {
  uint16_t* natural = nullptr;          // cb as fp16 bits, natural state order
  uint16_t* interleaved[8] = {};        // per K: loop order (see Build)
  float max_abs = 0.0f;                 // largest |cb|
};

uint16_t ToHalfBits(float x) {
  return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

void* AlignedOrDie(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) std::abort();
  return p;
}

// For block g (edges e0 = g·64), predecessor p and j < 64:
//   t[(g·P + p)·64 + j] = cb[(p << (16-K)) | (e0 + σ(j))],
// σ(u·32 + l) = u·32 + ((l mod D) << K | l div D) for D = 32 >> K >= 2, else
// the identity. Codebook values are fp16 numbers, so the conversion is exact.
Tables* Build(Codebook codebook) {
  auto* t = new Tables;  // process lifetime, never freed
  const float* values = CodebookValues(codebook);
  t->natural = static_cast<uint16_t*>(AlignedOrDie(65536 * sizeof(uint16_t)));
  for (int s = 0; s < 65536; ++s) {
    t->natural[s] = ToHalfBits(values[s]);
    const float a = values[s] < 0 ? -values[s] : values[s];
    if (a > t->max_abs) t->max_abs = a;
  }
  for (int bits = 1; bits <= 8; ++bits) {
    auto* dst = static_cast<uint16_t*>(AlignedOrDie(65536 * sizeof(uint16_t)));
    const int edges = 1 << (16 - bits);
    const int preds = 1 << bits;
    const int d = kLanes >> bits;
    size_t at = 0;
    for (int e0 = 0; e0 < edges; e0 += kBlock) {
      for (int p = 0; p < preds; ++p) {
        for (int j = 0; j < kBlock; ++j) {
          const int u = j / kLanes, l = j % kLanes;
          const int sigma = d >= 2 ? u * kLanes + (((l % d) << bits) | (l / d)) : j;
          dst[at++] = t->natural[(p << (16 - bits)) | (e0 + sigma)];
        }
      }
    }
    t->interleaved[bits - 1] = dst;
  }
  return t;
}

const Tables& GetTables(Codebook codebook) {
  switch (codebook) {
    case Codebook::k3Inst: {
      static const Tables* t = Build(codebook);
      return *t;
    }
    case Codebook::kMcg: {
      static const Tables* t = Build(codebook);
      return *t;
    }
    default: {
      static const Tables* t = Build(codebook);
      return *t;
    }
  }
}

struct Step {
  int count;
  const uint16_t* prev[kMaxB];
  uint16_t* out[kMaxB];
  _Float16 v[kMaxB];   // the position's target per tile
  _Float16 mu[kMaxB];  // in: the prev row's minimum; out: this row's
  const uint16_t* table;
  // Optional (K <= kDecisionMaxBits; all null or all set): where to record
  // this position's decisions. For output vector w (edges 32w..32w+31, lanes
  // in the σ order) and p = 1..P-1, mask [w·(P-1) + p-1]: bit l set iff
  // candidate p of lane l is strictly below candidates 0..p-1.
  uint32_t* decisions[kMaxB];
};

template <int K>
inline __m512h LoadPrev(const uint16_t* p) {
  if constexpr (K >= 5) {
    _Float16 h;
    std::memcpy(&h, p, sizeof(h));
    return _mm512_set1_ph(h);
  } else if constexpr (K == 4) {
    int32_t x;
    std::memcpy(&x, p, sizeof(x));
    return _mm512_castsi512_ph(_mm512_set1_epi32(x));
  } else if constexpr (K == 3) {
    long long x;
    std::memcpy(&x, p, sizeof(x));
    return _mm512_castsi512_ph(_mm512_set1_epi64(x));
  } else if constexpr (K == 2) {
    return _mm512_castsi512_ph(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    return _mm512_castsi512_ph(
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
}

template <int K, int B, bool kRecord>
void StepK(Step& a) {
  constexpr int kE = 1 << (16 - K);
  constexpr int kP = 1 << K;
  constexpr int kD = K >= 5 ? 1 : kLanes >> K;
  constexpr int kPrefetchHalves = 4096;
  const uint16_t* table = a.table;
  __m512h vv[B], mu[B], row_min[B];
  const __m512h inf = _mm512_castsi512_ph(_mm512_set1_epi16(0x7C00));
  for (int b = 0; b < B; ++b) {
    vv[b] = _mm512_set1_ph(a.v[b]);
    mu[b] = _mm512_set1_ph(a.mu[b]);
    row_min[b] = inf;
  }
  // Natural offset j of a 32-edge vector sits in lane (j mod 2^K)·D + (j >> K).
  alignas(64) uint16_t natural_index[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    natural_index[j] = static_cast<uint16_t>(K <= 4 ? (j & (kP - 1)) * kD + (j >> (K <= 4 ? K : 0)) : j);
  }
  const __m512i to_natural = _mm512_load_si512(natural_index);
  for (int e0 = 0; e0 < kE; e0 += kBlock) {
    __m512h acc[B][kU];
    for (int p = 0; p < kP; ++p) {
      const uint16_t* cbp = table;
      table += kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(cbp + kPrefetchHalves), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cbp + kPrefetchHalves + kLanes), _MM_HINT_T0);
      __m512h c1[kU];
      for (int u = 0; u < kU; ++u) c1[u] = _mm512_castsi512_ph(_mm512_load_si512(cbp + kLanes * u));
      for (int b = 0; b < B; ++b) {
        const uint16_t* prevp = a.prev[b] + (p << (16 - 2 * K));
        for (int u = 0; u < kU; ++u) {
          const __m512h pv = LoadPrev<K>(prevp + ((e0 + kLanes * u) >> K));
          const __m512h t = _mm512_sub_ph(c1[u], vv[b]);
          const __m512h c = _mm512_fmadd_ph(t, t, pv);
          if (p == 0) {
            acc[b][u] = c;  // = min(inf, c): one op less per output vector
          } else {
            if constexpr (kRecord) {
              // Strictly below all earlier p: the winner is the largest p
              // with its bit set, i.e. the smallest p among equal costs.
              _store_mask32(reinterpret_cast<__mmask32*>(a.decisions[b]) +
                                ((e0 / kLanes) + u) * (kP - 1) + (p - 1),
                            _mm512_cmp_ph_mask(c, acc[b][u], _CMP_LT_OQ));
            }
            acc[b][u] = _mm512_min_ph(acc[b][u], c);
          }
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      for (int u = 0; u < kU; ++u) {
        __m512h r = _mm512_sub_ph(acc[b][u], mu[b]);
        row_min[b] = _mm512_min_ph(row_min[b], r);
        if constexpr (K <= 4) {
          r = _mm512_castsi512_ph(_mm512_permutexvar_epi16(to_natural, _mm512_castph_si512(r)));
        }
        _mm512_store_si512(a.out[b] + e0 + kLanes * u, _mm512_castph_si512(r));
      }
    }
  }
  for (int b = 0; b < B; ++b) a.mu[b] = _mm512_reduce_min_ph(row_min[b]);
}

template <int K, bool kRecord>
void StepCountRecord(Step& a) {
  switch (a.count) {
    case 1: return StepK<K, 1, kRecord>(a);
    case 2: return StepK<K, 2, kRecord>(a);
    case 3: return StepK<K, 3, kRecord>(a);
    case 4: return StepK<K, 4, kRecord>(a);
    case 5: return StepK<K, 5, kRecord>(a);
    case 6: return StepK<K, 6, kRecord>(a);
    case 7: return StepK<K, 7, kRecord>(a);
    default: return StepK<K, 8, kRecord>(a);
  }
}

template <int K>
void StepCount(Step& a) {
  if constexpr (K <= kDecisionMaxBits) {
    if (a.decisions[0] != nullptr) return StepCountRecord<K, true>(a);
  }
  return StepCountRecord<K, false>(a);
}

void RunStep(int bits, Step& a) {
  switch (bits) {
    case 1: return StepCount<1>(a);
    case 2: return StepCount<2>(a);
    case 3: return StepCount<3>(a);
    case 4: return StepCount<4>(a);
    case 5: return StepCount<5>(a);
    case 6: return StepCount<6>(a);
    case 7: return StepCount<7>(a);
    default: return StepCount<8>(a);
  }
}

_Float16 HalfFromBits(uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, sizeof(h));
  return h;
}

// The traceback's re-evaluation: the predecessor p (smallest on ties) whose
// candidate for `edge` is the minimum, with the forward step's two roundings.
int BestPredecessor(int bits, const uint16_t* prev, int edge, const uint16_t* cb, _Float16 v) {
  const int shift = 16 - bits;
  const __m128h vh = _mm_set_sh(v);
  _Float16 best = HalfFromBits(0x7C00);
  int best_p = 0;
  for (int p = 0; p < (1 << bits); ++p) {
    const int s = (p << shift) | edge;
    const __m128h t = _mm_sub_sh(_mm_set_sh(HalfFromBits(cb[s])), vh);
    const __m128h c = _mm_fmadd_sh(t, t, _mm_set_sh(HalfFromBits(prev[s >> bits])));
    const _Float16 value = _mm_cvtsh_h(c);
    if (value < best) {
      best = value;
      best_p = p;
    }
  }
  return best_p;
}

// Winner p recorded for `edge` in one position's masks (layout: Step).
int DecodedPredecessor(int bits, const uint32_t* masks, int edge) {
  const int preds = 1 << bits;
  const int j = edge & (kLanes - 1);
  const int lane = (j & (preds - 1)) * (kLanes >> bits) + (j >> bits);
  const uint32_t* m = masks + static_cast<size_t>(edge / kLanes) * (preds - 1);
  for (int p = preds - 1; p >= 1; --p) {
    if ((m[p - 1] >> lane) & 1u) return p;
  }
  return 0;
}

// Per-tile memory of one batch member (halves from `rows`).
struct TileMem {
  uint16_t* rows;        // row mode: rows 0..255 + two rolling; else two rolling
  uint16_t* start;       // the start row
  uint32_t* decisions;   // decision mode: 256 positions of dec_words; else null
};

// One pass of `count` tiles over t[b][0..255] from start rows mem[b].start
// (row minimum 0). final_edge[b] < 0: end at the cheapest last edge
// (smallest index on ties); else end at it. Writes states[b][stop..255].
// Row mode (decisions null): row i of tile b is rows + i·stride for
// i >= stop - 1; earlier positions roll through rows 256 and 257; the
// traceback re-evaluates candidates. Decision mode: rows roll through rows 0
// and 1, positions i >= stop record their masks at decisions + i·dec_words
// and the traceback decodes them.
void RunPass(int bits, const Tables& tables, int count, const float* const* t,
             const TileMem* mem, const int* final_edge, int stop, size_t stride,
             size_t dec_words, uint16_t* const* states) {
  const int edges = 1 << (16 - bits);
  const int shift = 16 - bits;
  const bool decide = mem[0].decisions != nullptr;
  auto row = [&](int b, int i) {
    if (decide) return mem[b].rows + (i & 1) * stride;
    return i >= stop - 1 ? mem[b].rows + i * stride : mem[b].rows + (256 + (i & 1)) * stride;
  };
  Step a;
  a.count = count;
  a.table = tables.interleaved[bits - 1];
  for (int b = 0; b < count; ++b) {
    a.prev[b] = mem[b].start;
    a.mu[b] = HalfFromBits(0);
    a.decisions[b] = nullptr;
  }
  for (int i = 0; i < kTileSize; ++i) {
    for (int b = 0; b < count; ++b) {
      a.out[b] = row(b, i);
      a.v[b] = static_cast<_Float16>(t[b][i]);
      // Positions before `stop` are never traced back: no decisions needed.
      if (decide) a.decisions[b] = i >= stop ? mem[b].decisions + i * dec_words : nullptr;
    }
    RunStep(bits, a);
    for (int b = 0; b < count; ++b) a.prev[b] = a.out[b];
  }
  for (int b = 0; b < count; ++b) {
    int edge = final_edge[b];
    if (edge < 0) {
      const uint16_t* last = row(b, kTileSize - 1);
      edge = 0;
      for (int e = 1; e < edges; ++e) {
        if (HalfFromBits(last[e]) < HalfFromBits(last[edge])) edge = e;
      }
    }
    for (int i = kTileSize - 1; i >= stop; --i) {
      int p;
      if (decide) {
        p = DecodedPredecessor(bits, mem[b].decisions + i * dec_words, edge);
      } else {
        const uint16_t* prev = i == 0 ? mem[b].start : row(b, i - 1);
        p = BestPredecessor(bits, prev, edge, tables.natural, static_cast<_Float16>(t[b][i]));
      }
      const int s = (p << shift) | edge;
      states[b][i] = static_cast<uint16_t>(s);
      edge = s >> bits;
    }
  }
}

void QuantizeBatch(const float* targets, int count, int bits, Codebook codebook, bool decide,
                   TileWorkspace& workspace, uint16_t* states, float* decoded,
                   double* sq_errors) {
  const Tables& tables = GetTables(codebook);
  const int edges = 1 << (16 - bits);
  const size_t stride = static_cast<size_t>(edges) + kPad;
  // Per tile (halves): row mode: rows 0..255, two rolling rows, the start
  // row. Decision mode: two rolling rows, the start row, then 256 positions
  // of E·(P-1)/32 masks (E·(P-1)/8 bytes, a multiple of 64).
  const size_t dec_words = decide ? static_cast<size_t>(edges) * ((1 << bits) - 1) / 32 : 0;
  const size_t row_count = decide ? 3 : 259;
  const size_t per_tile = row_count * stride + 2 * kTileSize * dec_words;
  auto* base = reinterpret_cast<uint16_t*>(workspace.Reserve((count * per_tile + 1) / 2 + 32));
  TileMem mem[kMaxB] = {};
  for (int b = 0; b < count; ++b) {
    mem[b].rows = base + b * per_tile;
    mem[b].start = mem[b].rows + (row_count - 1) * stride;
    mem[b].decisions =
        decide ? reinterpret_cast<uint32_t*>(mem[b].rows + row_count * stride) : nullptr;
    for (size_t r = 0; r < row_count; ++r) std::memset(mem[b].rows + r * stride + edges, 0, kPad * 2);
  }

  // Pass 1: free start over the rotated tile -W..-1, 0..W-1; the path's edge
  // at rotated position W is the start edge (exl3-format.md §6.5).
  constexpr int kW = kPass1HalfWindow;
  float rotated[kMaxB][kTileSize];
  uint16_t rot_states[kMaxB][kTileSize];
  const float* t[kMaxB] = {};
  uint16_t* st[kMaxB] = {};
  int final_edge[kMaxB] = {};
  for (int b = 0; b < count; ++b) {
    const float* target = targets + b * kTileSize;
    for (int i = 0; i < 2 * kW; ++i) rotated[b][i] = target[(i + kTileSize - kW) & 255];
    for (int e = 0; e < edges; ++e) mem[b].start[e] = 0;
    t[b] = rotated[b];
    st[b] = rot_states[b];
    final_edge[b] = -1;
  }
  RunPass(bits, tables, count, t, mem, final_edge, kW, stride, dec_words, st);

  // Pass 2: natural order, starting on and ending at the start edge.
  for (int b = 0; b < count; ++b) {
    const int start_edge = rot_states[b][kW] >> bits;
    for (int e = 0; e < edges; ++e) mem[b].start[e] = 0x7C00;  // +inf
    mem[b].start[start_edge] = 0;
    final_edge[b] = start_edge;
    t[b] = targets + b * kTileSize;
    st[b] = states + b * kTileSize;
  }
  RunPass(bits, tables, count, t, mem, final_edge, 0, stride, dec_words, st);

  const float* values = CodebookValues(codebook);
  for (int b = 0; b < count; ++b) {
    double sq = 0.0;
    for (int i = 0; i < kTileSize; ++i) {
      const int j = b * kTileSize + i;
      decoded[j] = values[states[j]];
      const double d = static_cast<double>(decoded[j]) - targets[j];
      sq += d * d;
    }
    if (sq_errors != nullptr) sq_errors[b] = sq;
  }
}

void QuantizeGroups(const float* targets, int count, int bits, Codebook codebook, bool decide,
                    TileWorkspace& workspace, uint16_t* states, float* decoded,
                    double* sq_errors) {
  // Near-equal groups of at most 4 tiles (the fp32 path's kTileBatch).
  constexpr int kGroup = 4;
  const int groups = (count + kGroup - 1) / kGroup;
  const int size = groups > 0 ? (count + groups - 1) / groups : 0;
  for (int done = 0; done < count; done += size) {
    const int n = count - done < size ? count - done : size;
    QuantizeBatch(targets + done * kTileSize, n, bits, codebook, decide, workspace,
                  states + done * kTileSize, decoded + done * kTileSize,
                  sq_errors != nullptr ? sq_errors + done : nullptr);
  }
}

}  // namespace

float MaxAbsCodebookValue(Codebook codebook) { return GetTables(codebook).max_abs; }

void QuantizeTilesUnchecked(const float* targets, int count, int bits, Codebook codebook,
                            TileWorkspace& workspace, uint16_t* states, float* decoded,
                            double* sq_errors) {
  QuantizeGroups(targets, count, bits, codebook, bits <= kDecisionMaxBits, workspace, states,
                 decoded, sq_errors);
}

void QuantizeTilesKeepRowsUnchecked(const float* targets, int count, int bits,
                                    Codebook codebook, TileWorkspace& workspace,
                                    uint16_t* states, float* decoded, double* sq_errors) {
  QuantizeGroups(targets, count, bits, codebook, false, workspace, states, decoded, sq_errors);
}

}  // namespace exl3serve::sharding::quant::avx512fp16
