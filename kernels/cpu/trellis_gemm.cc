// kernels/cpu/trellis_gemm.cc — the shared driver, the scalar reference
// variant and the dispatcher of TrellisGemm (kernels/trellis_gemm.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_gemm.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels {
namespace cpu::internal {
namespace {

// Rows per input-transform task (enough work to be worth a hand-off).
constexpr int64_t kInputRowsPerTask = 16;

// §5.3 step 1 for rows [i0, i1): x' = (x ⊙ suh)·B_k, fp32 butterflies in
// natural order (Hadamard128), exactly as ReferenceForward does.
void InputTransformRows(const Exl3LinearView& view, const float* x, int64_t i0, int64_t i1,
                        float* x_had) {
  const int64_t k = view.k;
  for (int64_t i = i0; i < i1; ++i) {
    float* row = x_had + i * k;
    for (int64_t r = 0; r < k; ++r) row[r] = x[i * k + r] * view.suh[r];
    for (int64_t b = 0; b < k; b += kHadamardSize) Hadamard128(row + b);
  }
}

// Activations in tile position order (see TrellisGemmProblem::x_pos).
void BuildPositionOrder(const float* x_had, int64_t m, int64_t k, float* x_pos) {
  const int64_t groups = k / kTileDim;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t tk = 0; tk < groups; ++tk) {
      const float* src = x_had + i * k + tk * kTileDim;
      float* dst = x_pos + (i * groups + tk) * 32;
      for (int e = 0; e < 32; ++e) dst[e] = src[GroupPositionRow(e)];
    }
  }
}

// kInt8 activations: per row and 128-row block b of k, scale max|x'_b|/127,
// RNE to int8, replicated into the four bytes of a word (each byte of the
// codebook product meets a copy). Every array block-major, each block laid
// out as for k = 128 (TrellisGemmProblem): x_pos_i8 and x_pair_i8
// [b][i][8 tiles][...], x_pair_i16 [b][8 tiles][i][8]; x_scale and x_int_sum
// [i][b].
void BuildInt8PositionOrder(const float* x_had, int64_t m, int64_t k, uint32_t* x_pos_i8,
                            uint32_t* x_pair_i8, uint32_t* x_pair_i16, float* x_scale,
                            int32_t* x_int_sum) {
  constexpr int64_t kTilesPerBlock = kColumnBlock / kTileDim;
  const int64_t blocks = k / kColumnBlock;
  int8_t q[kColumnBlock];
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* row = x_had + i * k + b * kColumnBlock;
      float max_abs = 0.0f;
      for (int64_t r = 0; r < kColumnBlock; ++r) max_abs = std::max(max_abs, std::fabs(row[r]));
      const float scale = max_abs > 0.0f ? max_abs / 127.0f : 1.0f;
      const float inv = 1.0f / scale;
      int32_t sum = 0;
      for (int64_t r = 0; r < kColumnBlock; ++r) {
        const float v = std::nearbyint(row[r] * inv);
        q[r] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
        sum += q[r];
      }
      x_scale[i * blocks + b] = scale;
      x_int_sum[i * blocks + b] = sum;
      for (int64_t tl = 0; tl < kTilesPerBlock; ++tl) {
        uint32_t* dst = x_pos_i8 + ((b * m + i) * kTilesPerBlock + tl) * 32;
        for (int e = 0; e < 32; ++e) {
          const uint8_t byte = static_cast<uint8_t>(q[tl * kTileDim + GroupPositionRow(e)]);
          dst[e] = byte * 0x01010101u;
        }
        uint32_t* pair = x_pair_i8 + ((b * m + i) * kTilesPerBlock + tl) * 8;
        uint32_t* pair16 = x_pair_i16 + ((b * kTilesPerBlock + tl) * m + i) * 8;
        for (int s = 0; s < 8; ++s) {
          const uint32_t b0 = static_cast<uint8_t>(q[tl * kTileDim + 2 * s]);
          const uint32_t b1 = static_cast<uint8_t>(q[tl * kTileDim + 2 * s + 1]);
          pair[s] = b0 * 0x0101u + b1 * 0x01010000u;
          const uint32_t w0 = static_cast<uint16_t>(q[tl * kTileDim + 2 * s]);  // sign-extended
          const uint32_t w1 = static_cast<uint16_t>(q[tl * kTileDim + 2 * s + 1]);
          pair16[s] = w0 | w1 << 16;
        }
      }
    }
  }
}

// kInt8: y[i][n0 + c] (first block: =, else +=) the epilogue of block b's
// dots y_int[i][n0 + c], for the 128 columns of block n0. Plain fp32 adds in
// ascending b (no multiply-add here to contract: the product is inside
// Int8Epilogue's rounding).
void AccumulateInt8Block(const int32_t* y_int, int64_t m, int64_t n, int64_t n0,
                         const float* x_scale, const int32_t* x_int_sum, int64_t blocks,
                         int64_t b, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    const float scale = x_scale[i * blocks + b];
    const int32_t sum = x_int_sum[i * blocks + b];
    const int32_t* dots = y_int + i * n + n0;
    float* out = y + i * n + n0;
    if (b == 0) {
      for (int64_t c = 0; c < kColumnBlock; ++c) out[c] = Int8Epilogue(dots[c], sum, scale);
    } else {
      for (int64_t c = 0; c < kColumnBlock; ++c) out[c] += Int8Epilogue(dots[c], sum, scale);
    }
  }
}

// kBf16 activations of rows [i0, i1), in both layouts of TrellisGemmProblem:
// packed per row group (x_bf16) and as AMX A tiles (x_bf16_tiles).
void BuildBf16Activations(const float* x_had, int64_t i0, int64_t i1, int64_t k,
                          uint32_t* x_bf16, uint16_t* x_bf16_tiles) {
  const int64_t pairs = k / 2;
  for (int64_t i = i0; i < i1; ++i) {
    const float* row = x_had + i * k;
    uint32_t* dst = x_bf16 + (i / kBf16RowGroup) * pairs * kBf16RowGroup + i % kBf16RowGroup;
    uint16_t* tiles = x_bf16_tiles + (i / 16) * (k / 32) * 512 + (i % 16) * 32;
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t lo = FloatToBf16(row[2 * p]);
      const uint16_t hi = FloatToBf16(row[2 * p + 1]);
      dst[p * kBf16RowGroup] = lo | static_cast<uint32_t>(hi) << 16;
      const int64_t r = 2 * p;
      tiles[(r / 32) * 512 + r % 32] = lo;
      tiles[(r / 32) * 512 + r % 32 + 1] = hi;
    }
  }
}

// §5.3 step 3 for one 128-column block, in place: y = (y'·B_n) ⊙ svh + bias.
void OutputTransformBlock(const Exl3LinearView& view, int64_t m, int64_t block, float* y) {
  const int64_t n0 = block * kColumnBlock;
  for (int64_t i = 0; i < m; ++i) {
    float* v = y + i * view.n + n0;
    Hadamard128(v);
    for (int64_t c = 0; c < kColumnBlock; ++c) {
      float out = v[c] * view.svh[n0 + c];
      if (view.bias != nullptr) out += view.bias[n0 + c];
      v[c] = out;
    }
  }
}

}  // namespace

float Int8Epilogue(int32_t t_dot, int32_t x_sum, float scale) {
  const float dot = kMul1Slope * static_cast<float>(t_dot);
  const float offset = kMul1Offset * static_cast<float>(x_sum);
  return scale * (dot + offset);
}

absl::Status RunTrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                            const TrellisGemmOptions& options, ColumnBlockFn block_fn) {
  EXL3_RETURN_IF_ERROR(ValidateExl3LinearView(view));
  if (m < 0) {
    return absl::InvalidArgumentError(absl::StrCat("trellis gemm: row count m must be >= 0, got ", m));
  }
  if ((m * view.k > 0 && x == nullptr) || (m * view.n > 0 && y == nullptr)) {
    return absl::InvalidArgumentError(
        "trellis gemm: x (m x k) and y (m x n) must be non-null when non-empty");
  }
  if (options.precision == TrellisGemmPrecision::kInt8 && view.codebook != Codebook::kMul1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trellis gemm: precision kInt8 needs the mul1 codebook, got ", CodebookName(view.codebook),
        "; use TrellisGemmPrecision::kFloat"));
  }
  const int64_t k = view.k;
  const int64_t n = view.n;
  if (m == 0 || n == 0) return absl::OkStatus();

  ThreadPool& pool = SharedThreadPool();
  const int threads = options.max_threads;

  std::vector<float> x_had(static_cast<size_t>(m * k));
  // kBf16: both bf16 activation layouts, rows converted by the task that
  // transformed them (tasks write disjoint words; padding stays zero).
  const bool bf16 = options.precision == TrellisGemmPrecision::kBf16;
  std::vector<uint32_t> x_bf16;
  std::vector<uint16_t> x_bf16_tiles;
  if (bf16) {
    const int64_t groups = (m + kBf16RowGroup - 1) / kBf16RowGroup;
    const int64_t rows_pad = (m + kBf16AmxRows - 1) / kBf16AmxRows * kBf16AmxRows;
    x_bf16.assign(static_cast<size_t>(groups * (k / 2) * kBf16RowGroup), 0u);
    x_bf16_tiles.assign(static_cast<size_t>(rows_pad * k), 0);
  }
  pool.ParallelFor((m + kInputRowsPerTask - 1) / kInputRowsPerTask, threads,
                   [&](int64_t task, int) {
                     const int64_t i0 = task * kInputRowsPerTask;
                     const int64_t i1 = std::min(m, i0 + kInputRowsPerTask);
                     InputTransformRows(view, x, i0, i1, x_had.data());
                     if (bf16) {
                       BuildBf16Activations(x_had.data(), i0, i1, k, x_bf16.data(),
                                            x_bf16_tiles.data());
                     }
                   });

  TrellisGemmProblem problem;
  problem.view = &view;
  problem.m = m;
  problem.precision = options.precision;
  problem.x_had = x_had.data();
  problem.y = y;
  std::vector<float> x_pos;
  std::vector<uint32_t> x_pos_i8;
  std::vector<uint32_t> x_pair_i8;
  std::vector<uint32_t> x_pair_i16;
  std::vector<float> x_scale;
  std::vector<int32_t> x_int_sum;
  if (bf16) {
    problem.x_bf16 = x_bf16.data();
    problem.x_bf16_tiles = x_bf16_tiles.data();
  } else if (options.precision == TrellisGemmPrecision::kInt8) {
    x_pos_i8.resize(static_cast<size_t>(m * (k / kTileDim) * 32));
    x_pair_i8.resize(static_cast<size_t>(m * (k / kTileDim) * 8));
    x_pair_i16.resize(x_pair_i8.size());
    x_scale.resize(static_cast<size_t>(m * (k / kColumnBlock)));
    x_int_sum.resize(x_scale.size());
    BuildInt8PositionOrder(x_had.data(), m, k, x_pos_i8.data(), x_pair_i8.data(),
                           x_pair_i16.data(), x_scale.data(), x_int_sum.data());
  } else if (m <= kPositionOrderMaxRows) {
    x_pos.resize(static_cast<size_t>(m * (k / kTileDim) * 32));
    BuildPositionOrder(x_had.data(), m, k, x_pos.data());
    problem.x_pos = x_pos.data();
  }

  if (options.precision == TrellisGemmPrecision::kInt8) {
    // One sub-problem per 128-row block of k (trellis_gemm.h kInt8): the
    // view of its 8 rows of tiles, its activations; the kernel's int32 dots
    // land in y_int and are scaled and summed here, block by block.
    constexpr int64_t kTilesPerBlock = kColumnBlock / kTileDim;
    const int64_t blocks = k / kColumnBlock;
    const int64_t tile_words = TileInt16Count(view.bits);
    std::vector<Exl3LinearView> block_views(static_cast<size_t>(blocks), view);
    std::vector<TrellisGemmProblem> block_problems(static_cast<size_t>(blocks), problem);
    std::vector<int32_t> y_int(static_cast<size_t>(m * n));
    for (int64_t b = 0; b < blocks; ++b) {
      Exl3LinearView& v = block_views[b];
      v.k = kColumnBlock;
      v.trellis = view.trellis + b * kTilesPerBlock * (n / kTileDim) * tile_words;
      v.suh = view.suh + b * kColumnBlock;
      TrellisGemmProblem& p = block_problems[b];
      p.view = &v;
      p.x_had = x_had.data();  // unused by the int8 kernels
      p.x_pos_i8 = x_pos_i8.data() + b * m * kTilesPerBlock * 32;
      p.x_pair_i8 = x_pair_i8.data() + b * m * kTilesPerBlock * 8;
      p.x_pair_i16 = x_pair_i16.data() + b * kTilesPerBlock * m * 8;
      p.y = nullptr;
      p.y_int = y_int.data();
    }
    pool.ParallelFor(n / kColumnBlock, threads, [&](int64_t block, int) {
      if (blocks == 0) {  // k = 0: y' = 0
        for (int64_t i = 0; i < m; ++i) std::fill_n(y + i * n + block * kColumnBlock, kColumnBlock, 0.0f);
      }
      for (int64_t b = 0; b < blocks; ++b) {
        block_fn(block_problems[b], block);
        AccumulateInt8Block(y_int.data(), m, n, block * kColumnBlock, x_scale.data(),
                            x_int_sum.data(), blocks, b, y);
      }
      OutputTransformBlock(view, m, block, y);
    });
    return absl::OkStatus();
  }
  pool.ParallelFor(n / kColumnBlock, threads, [&](int64_t block, int) {
    block_fn(problem, block);
    OutputTransformBlock(view, m, block, y);
  });
  return absl::OkStatus();
}

}  // namespace cpu::internal

// ---------------------------------------------------------------------------
// Scalar reference: decode through the codebook table (trellis_lut.h, bit-exact
// W_h, §4), accumulate in fp32 over ascending k exactly like ReferenceForward.
namespace cpu::scalar {
namespace {

// vdpbf16ps flushes results below 2^-126 in magnitude to zero of that sign.
float Bf16FlushTiny(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  if ((b & 0x7F800000u) == 0) b &= 0x80000000u;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

}  // namespace

void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block) {
  const Exl3LinearView& view = *problem.view;
  const int64_t k = view.k;
  const int64_t n = view.n;
  const int64_t m = problem.m;
  const int64_t n0 = block * internal::kColumnBlock;
  const int64_t tiles_n = n / kTileDim;
  const int tile_values = TileInt16Count(view.bits);
  constexpr int kTilesPerBlock = internal::kColumnBlock / kTileDim;
  const bool int8 = problem.precision == TrellisGemmPrecision::kInt8;
  const bool bf16 = problem.precision == TrellisGemmPrecision::kBf16;

  // One row of tiles of this block: W_h[16·tk .. 16·tk+15][n0 .. n0+127].
  float strip[kTileDim][internal::kColumnBlock];
  int32_t strip_t[kTileDim][internal::kColumnBlock];  // mul1 byte sums (kInt8)
  std::vector<int32_t> t_dot(int8 ? static_cast<size_t>(m * internal::kColumnBlock) : 0, 0);
  const float* lookup = GetCodebookTable(view.codebook).value;

  for (int64_t i = 0; i < m && !int8; ++i) {
    for (int64_t c = 0; c < internal::kColumnBlock; ++c) problem.y[i * n + n0 + c] = 0.0f;
  }
  uint16_t states[kTileWeights];
  for (int64_t tk = 0; tk < k / kTileDim; ++tk) {
    for (int tn = 0; tn < kTilesPerBlock; ++tn) {
      const uint16_t* tile = view.trellis + (tk * tiles_n + n0 / kTileDim + tn) * tile_values;
      UnpackTileStates(tile, view.bits, states);  // §3.3-3.4
      for (int j = 0; j < kTileWeights; ++j) {
        const int rc = TilePermutation(j);  // §3.2
        strip[rc / kTileDim][tn * kTileDim + rc % kTileDim] = lookup[states[j]];
        strip_t[rc / kTileDim][tn * kTileDim + rc % kTileDim] =
            static_cast<int32_t>(Mul1ByteSum(states[j]));
      }
    }
    if (bf16) {
      for (int r = 0; r < kTileDim; ++r) {
        for (int c = 0; c < internal::kColumnBlock; ++c) {
          strip[r][c] = internal::Bf16ToFloat(internal::FloatToBf16(strip[r][c]));
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      if (bf16) {
        // vdpbf16ps per k pair: acc += x[2p+1]·w[2p+1], then += x[2p]·w[2p];
        // products of bf16 values are exact in fp32, each add rounds (RNE).
        const uint32_t* xb = problem.x_bf16 +
                             (i / internal::kBf16RowGroup) * (k / 2) * internal::kBf16RowGroup +
                             i % internal::kBf16RowGroup;
        float* out = problem.y + i * n + n0;
        for (int r = 0; r < kTileDim; r += 2) {
          const uint32_t word = xb[(tk * kTileDim + r) / 2 * internal::kBf16RowGroup];
          const float x_lo = internal::Bf16ToFloat(static_cast<uint16_t>(word & 0xFFFF));
          const float x_hi = internal::Bf16ToFloat(static_cast<uint16_t>(word >> 16));
          for (int c = 0; c < internal::kColumnBlock; ++c) {
            out[c] = Bf16FlushTiny(out[c] + x_hi * strip[r + 1][c]);
            out[c] = Bf16FlushTiny(out[c] + x_lo * strip[r][c]);
          }
        }
        continue;
      }
      if (int8) {
        const int64_t groups = k / kTileDim;
        const uint32_t* xq = problem.x_pos_i8 + (i * groups + tk) * 32;
        // Row r of the tile is position e = any with GroupPositionRow(e) == r.
        int32_t x_row[kTileDim];
        for (int e = 0; e < 32; ++e) {
          x_row[internal::GroupPositionRow(e)] = static_cast<int8_t>(xq[e] & 0xFF);
        }
        for (int r = 0; r < kTileDim; ++r) {
          for (int c = 0; c < internal::kColumnBlock; ++c) {
            t_dot[i * internal::kColumnBlock + c] += x_row[r] * strip_t[r][c];
          }
        }
        continue;
      }
      float* out = problem.y + i * n + n0;
      for (int r = 0; r < kTileDim; ++r) {
        const float xv = problem.x_had[i * k + tk * kTileDim + r];
        for (int c = 0; c < internal::kColumnBlock; ++c) out[c] += xv * strip[r][c];
      }
    }
  }
  if (int8) {
    for (int64_t i = 0; i < m; ++i) {
      for (int c = 0; c < internal::kColumnBlock; ++c) {
        problem.y_int[i * n + n0 + c] = t_dot[i * internal::kColumnBlock + c];
      }
    }
  }
}

absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options) {
  return internal::RunTrellisGemm(view, x, m, y, options, &TrellisGemmColumnBlock);
}

}  // namespace cpu::scalar

#if defined(__x86_64__) || defined(__i386__)
namespace cpu::avx2 {
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options) {
  return internal::RunTrellisGemm(view, x, m, y, options, &TrellisGemmColumnBlock);
}
}  // namespace cpu::avx2
namespace cpu::avx512 {
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options) {
  return internal::RunTrellisGemm(view, x, m, y, options, &TrellisGemmColumnBlock);
}
}  // namespace cpu::avx512
#endif

// ---------------------------------------------------------------------------
// Dispatcher: the variant for ActiveCpuIsa(), chosen once and re-chosen only
// when SetCpuIsaOverride bumps the generation.
namespace {

using GemmFn = absl::Status (*)(const Exl3LinearView&, const float*, int64_t, float*,
                                const TrellisGemmOptions&);

GemmFn ChooseVariant() {
#if defined(__x86_64__) || defined(__i386__)
  switch (cpu::ActiveCpuIsa()) {
    case cpu::CpuIsa::kAvx512:
      return &cpu::avx512::TrellisGemm;
    case cpu::CpuIsa::kAvx2:
      return &cpu::avx2::TrellisGemm;
    case cpu::CpuIsa::kScalar:
      break;
  }
#endif
  return &cpu::scalar::TrellisGemm;
}

std::atomic<GemmFn> g_variant{nullptr};
std::atomic<uint64_t> g_variant_generation{~uint64_t{0}};

}  // namespace

absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options) {
  const uint64_t generation = cpu::CpuIsaOverrideGeneration();
  GemmFn fn = g_variant.load(std::memory_order_acquire);
  if (fn == nullptr || g_variant_generation.load(std::memory_order_acquire) != generation) {
    fn = ChooseVariant();
    g_variant.store(fn, std::memory_order_release);
    g_variant_generation.store(generation, std::memory_order_release);
  }
  return fn(view, x, m, y, options);
}

}  // namespace exl3serve::kernels
