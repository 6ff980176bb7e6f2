// kernels/cuda/trellis_gemm.cu — the CUDA trellis GEMV/GEMM (trellis_gemm.h).
//
// Three kernels per call, all on the caller's stream:
//   InputTransformKernel   x' = (x ⊙ suh)·B_k, one 128-thread block per
//                          (row, 128-block); butterflies in natural order,
//                          rn arithmetic (bit-identical to the CPU's).
//   TrellisGemvKernel      partial[s][i][c] = Σ_{r in split s} x'[i][r]·W_h[r][c]
//     Block = 8 warps = one 128-column strip (8 tiles, contiguous in the
//     trellis for a fixed tile row tk) × one k range ("split"); warp w takes
//     tile rows tk_begin + w, + 8, ... Per tile row a warp reads the strip's
//     8 tiles (256·K bytes, contiguous) with one coalesced vector load per
//     lane-chunk (lane l loads bytes [8K·l, 8K·(l+1)): uint4 for even K,
//     uint2 for odd K), prefetching the next tile row into registers while it
//     decodes the current one from a warp-private shared copy through
//     ReadTileState / DecodeState of kernels/trellis_decode.h. Lane l decodes
//     positions 64a .. 64a+63 (a = l % 4) of tile l / 4: by §3.2 those are all
//     16 rows of columns {2a, 2a+1, 2a+8, 2a+9}, so a lane keeps 4·M fp32
//     accumulators and reads x' from shared memory as warp-wide broadcasts.
//     The 8 warps' sums are combined in warp order through shared memory.
//   OutputTransformKernel  y = (Σ_s partial[s])·B_n ⊙ svh + bias, splits summed
//                          in ascending order; one 128-thread block per (row, strip).
// m > kGemvMaxRows runs the GEMV in passes of kGemvMaxRows rows; from
// kCublasMinRows rows W_h is decoded (bit-exactly, as fp32) in column slices
// and multiplied with cuBLAS SGEMM, then the same output transform runs in place.
// kInt8 (mul1): QuantizeInt8Kernel (a scale per row and 128-row block of k,
// int8 words) between the input transform and the GEMV; the GEMV's int8
// variant runs one k split per 128-row block and accumulates Σ t·q with dp4a
// (int32 partials), and the output transform starts with the CPU's
// Int8Epilogue per block, summed over ascending blocks; every step matches
// the CPU kInt8 path bit for bit.
#include "kernels/cuda/trellis_gemm.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------
// Launch constants. All untuned: to be measured on a GPU
// (tests/bench/cuda_trellis_gemv_bench.cc via tests/gpu/device_check.sh).
constexpr int kWarpSize = 32;
constexpr int kGemvWarps = 8;                              // warps per GEMV block
constexpr int kGemvThreads = kGemvWarps * kWarpSize;       // 256
constexpr int kStripColumns = 128;                         // output columns per block
constexpr int kTilesPerStrip = kStripColumns / kTileDim;   // 8
constexpr int kRowsPerGroup = kGemvWarps * kTileDim;       // 128 k rows per warp round
constexpr int kGemvMinBlocksPerSm = 2;                    // __launch_bounds__: <= 128 registers
constexpr int kTargetBlocksPerSm = 4;                      // GEMV grid >= 4 x SMs when k allows
constexpr int kXSharedBytes = 32 * 1024;                   // x' staging per GEMV block (max)
constexpr int kTransformThreads = kHadamardSize;           // 128, one per channel
constexpr int64_t kMaxTransformBlocks = 1 << 20;           // grid-stride cap
constexpr int kDecodeThreads = 256;                        // slice decode: one warp per tile
constexpr int64_t kMaxDecodeBlocks = 8192;
constexpr int64_t kSliceMaxBytes = int64_t{256} << 20;     // W_h fp32 slice for cuBLAS
constexpr int kAllocAlign = 256;

constexpr float kHadamardScaleF = static_cast<float>(kHadamardScale);
constexpr int kQuantThreads = 128;                         // int8 quantize: one block per (row, 128-block)
// mul1 before its fp16 rounding is affine in the byte sum t (§4.3): value =
// kMul1SlopeF·t + kMul1OffsetF, both exact in fp32 (the CPU kInt8 epilogue's constants).
constexpr float kMul1SlopeF = 1774.0f / 262144.0f;
constexpr float kMul1OffsetF = -905216.0f / 262144.0f;

// ---------------------------------------------------------------------------
// §5.3 step 1. Block b of the grid-stride loop handles row b / blocks_k,
// channels 128·(b % blocks_k) + [0, 128). __fmul_rn / __fadd_rn keep nvcc from
// contracting into FMAs, so x' equals the CPU's InputTransformRows bit for bit.
__global__ void InputTransformKernel(const float* __restrict__ x, const float* __restrict__ suh,
                                     int64_t m, int64_t k, float* __restrict__ x_had) {
  __shared__ float v[kHadamardSize];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t blocks_k = k / kHadamardSize;
  for (int64_t b = blockIdx.x; b < m * blocks_k; b += gridDim.x) {
    const int64_t row = b / blocks_k;
    const int64_t col = (b % blocks_k) * kHadamardSize + t;
    v[t] = __fmul_rn(x[row * k + col], suh[col]);
    __syncthreads();
    for (int h = 1; h < kHadamardSize; h <<= 1) {
      if (t < kHadamardSize / 2) {
        const int lo = (t / h) * 2 * h + (t % h);
        const float a = v[lo];
        const float c = v[lo + h];
        v[lo] = __fadd_rn(a, c);
        v[lo + h] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    x_had[row * k + col] = __fmul_rn(v[t], kHadamardScaleF);
    __syncthreads();  // v is rewritten by the next iteration
  }
}

// §5.3 step 3. partial is [splits][m][n]; y may equal partial (splits == 1):
// each thread reads its element before any thread writes it back.
// kInt8 (partial_i8 != null; split s = 128-row block s of k, x_scale and
// x_int_sum [row][splits]): y' = Σ_s scale_s·(slope·t_dot_s + offset·x_int_sum_s)
// over ascending s, the CPU's Int8Epilogue and block sum op for op.
__global__ void OutputTransformKernel(const float* partial, const int32_t* partial_i8,
                                      const float* __restrict__ x_scale,
                                      const int32_t* __restrict__ x_int_sum, int splits,
                                      int64_t m, int64_t n, const float* __restrict__ svh,
                                      const float* __restrict__ bias, float* y) {
  __shared__ float v[kHadamardSize];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t strips = n / kHadamardSize;
  for (int64_t b = blockIdx.x; b < m * strips; b += gridDim.x) {
    const int64_t row = b / strips;
    const int64_t col = (b % strips) * kHadamardSize + t;
    float sum;
    if (partial_i8 != nullptr) {
      sum = 0.0f;
      for (int s = 0; s < splits; ++s) {
        const int32_t t_dot = partial_i8[(s * m + row) * n + col];
        const float dot = __fmul_rn(kMul1SlopeF, static_cast<float>(t_dot));
        const float offset = __fmul_rn(kMul1OffsetF, static_cast<float>(x_int_sum[row * splits + s]));
        const float block = __fmul_rn(x_scale[row * splits + s], __fadd_rn(dot, offset));
        sum = s == 0 ? block : __fadd_rn(sum, block);
      }
    } else {
      sum = partial[row * n + col];
      for (int s = 1; s < splits; ++s) sum = __fadd_rn(sum, partial[(s * m + row) * n + col]);
    }
    v[t] = sum;
    __syncthreads();
    for (int h = 1; h < kHadamardSize; h <<= 1) {
      if (t < kHadamardSize / 2) {
        const int lo = (t / h) * 2 * h + (t % h);
        const float a = v[lo];
        const float c = v[lo + h];
        v[lo] = __fadd_rn(a, c);
        v[lo + h] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    float out = __fmul_rn(__fmul_rn(v[t], kHadamardScaleF), svh[col]);
    if (bias != nullptr) out = __fadd_rn(out, bias[col]);
    y[row * n + col] = out;
    __syncthreads();
  }
}

// kInt8 activations, exactly as the CPU's BuildInt8PositionOrder: per row i
// and 128-row block b of k, scale = max|x'|/127 over the block (1 when all
// zero), q = clamp(rint(x'·(1/scale)), ±127); q_words[i][r] = the byte of q
// replicated four times (one dp4a operand), x_scale and x_int_sum [i][b]
// (x_int_sum = Σ q over the block). One kQuantThreads (= 128) block per
// (row, block), grid-stride.
__global__ void QuantizeInt8Kernel(const float* __restrict__ x_had, int64_t m, int64_t k,
                                   uint32_t* __restrict__ q_words, float* __restrict__ x_scale,
                                   int32_t* __restrict__ x_int_sum) {
  static_assert(kQuantThreads == 128, "one thread per row of a 128-row block");
  __shared__ float max_part[kQuantThreads];
  __shared__ int32_t sum_part[kQuantThreads];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t blocks = k / kQuantThreads;
  for (int64_t rb = blockIdx.x; rb < m * blocks; rb += gridDim.x) {
    const int64_t row = rb / blocks;
    const int64_t r = (rb % blocks) * kQuantThreads + t;
    const float x = x_had[row * k + r];
    max_part[t] = fabsf(x);
    __syncthreads();
    for (int half = kQuantThreads / 2; half > 0; half >>= 1) {
      if (t < half) max_part[t] = fmaxf(max_part[t], max_part[t + half]);
      __syncthreads();
    }
    const float scale = max_part[0] > 0.0f ? __fdiv_rn(max_part[0], 127.0f) : 1.0f;
    const float inv = __fdiv_rn(1.0f, scale);
    const float q = fminf(fmaxf(rintf(__fmul_rn(x, inv)), -127.0f), 127.0f);
    const int32_t qi = static_cast<int32_t>(q);
    q_words[row * k + r] = static_cast<uint32_t>(static_cast<uint8_t>(qi)) * 0x01010101u;
    sum_part[t] = qi;
    __syncthreads();
    for (int half = kQuantThreads / 2; half > 0; half >>= 1) {
      if (t < half) sum_part[t] += sum_part[t + half];
      __syncthreads();
    }
    if (t == 0) {
      x_scale[rb] = scale;
      x_int_sum[rb] = sum_part[0];
    }
    __syncthreads();  // max_part / sum_part are rewritten by the next (row, block)
  }
}

// Σ_j byte_j(a) (unsigned) · byte_j(b) (signed) + c: with a = state·kMul1Mul
// and b = q replicated, t·q + c where t = Mul1ByteSum(state) (§4.3, §9).
__device__ __forceinline__ int32_t Dp4aUnsignedSigned(uint32_t a, uint32_t b, int32_t c) {
  int32_t d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// ---------------------------------------------------------------------------
// The fused GEMV (see the file comment). Lane chunk: 8K bytes per lane.
template <int K>
struct LaneChunk {
  using Vec = std::conditional_t<K % 2 == 0, uint4, uint2>;  // 16 B when 8K % 16 == 0
  static constexpr int kCount = static_cast<int>((8 * K) / sizeof(Vec));
  static_assert(kCount * sizeof(Vec) == 8 * K);
};

__device__ __forceinline__ uint4 StreamLoad(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ uint2 StreamLoad(const uint2* p) { return __ldcs(p); }

// Shared memory of one GEMV block: the warps' trellis copies
// (kGemvWarps x 8 tiles x 16K uint16), then a float area used first for x'
// ([M][x_stride]) and then for the warp sums ([kGemvWarps][M][128]).
constexpr int GemvTrellisSharedBytes(int bits) {
  return kGemvWarps * kTilesPerStrip * TileInt16Count(bits) * 2;
}
constexpr int GemvReduceSharedBytes(int rows) { return kGemvWarps * rows * kStripColumns * 4; }

// Grid: (n / 128 strips, splits). Each split covers `groups_per_split` rounds
// of 128 k rows (8 tile rows, one per warp); x_stride = 128·groups_per_split.
// Writes partial[(split·m + i)·n + c] for i < m (m <= M), c in the strip.
// kInt8 = false: x_in is x' (float), partial float (Σ x'·w).
// kInt8 = true (mul1 only): x_in is q_words (uint32), partial int32 (Σ t·q, dp4a).
template <int K, Codebook CB, int M, bool kInt8>
__global__ void __launch_bounds__(kGemvThreads, kGemvMinBlocksPerSm)
    TrellisGemvKernel(const uint16_t* __restrict__ trellis, const void* __restrict__ x_in,
                      int64_t m, int64_t k, int64_t n, int groups_per_split,
                      void* __restrict__ partial_out) {
  static_assert(!kInt8 || CB == Codebook::kMul1, "the int8 path is mul1 only");
  using XWord = std::conditional_t<kInt8, uint32_t, float>;
  using Acc = std::conditional_t<kInt8, int32_t, float>;
  const XWord* const x_had = static_cast<const XWord*>(x_in);
  Acc* const partial = static_cast<Acc*>(partial_out);
  using Chunk = LaneChunk<K>;
  using Vec = typename Chunk::Vec;
  constexpr int kTileInt16 = TileInt16Count(K);
  constexpr int kWarpInt16 = kTilesPerStrip * kTileInt16;

  extern __shared__ __align__(16) unsigned char shared[];
  uint16_t* const tiles_shared = reinterpret_cast<uint16_t*>(shared);
  XWord* const f_shared = reinterpret_cast<XWord*>(shared + GemvTrellisSharedBytes(K));
  Acc* const acc_shared = reinterpret_cast<Acc*>(shared + GemvTrellisSharedBytes(K));

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t strip = blockIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t tiles_n = n / kTileDim;
  const int64_t tiles_k = k / kTileDim;
  const int x_stride = groups_per_split * kRowsPerGroup;
  const int64_t tk_begin = split * groups_per_split * kGemvWarps;
  const int64_t tk_limit = tk_begin + static_cast<int64_t>(groups_per_split) * kGemvWarps;
  const int64_t tk_end = tk_limit < tiles_k ? tk_limit : tiles_k;
  const int rows_here = static_cast<int>((tk_end - tk_begin) * kTileDim);

  // Stage x'[i][16·tk_begin + r] (zeros for rows i >= m).
  for (int idx = static_cast<int>(threadIdx.x); idx < M * rows_here; idx += kGemvThreads) {
    const int i = idx / rows_here;
    const int r = idx % rows_here;
    f_shared[i * x_stride + r] = i < m ? x_had[i * k + tk_begin * kTileDim + r] : XWord{0};
  }
  __syncthreads();

  const int tile_in_strip = lane >> 2;  // 0..7
  const int quarter = lane & 3;         // a: positions 64a .. 64a+63
  uint16_t* const warp_tiles = tiles_shared + warp * kWarpInt16;
  const uint16_t* const my_tile = warp_tiles + tile_in_strip * kTileInt16;
  Vec* const my_store = reinterpret_cast<Vec*>(warp_tiles) + lane * Chunk::kCount;

  Acc acc[M][4];
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = Acc{0};
  }

  // Tile row tk of this strip: 8 tiles starting at tile (tk, 8·strip).
  auto lane_source = [&](int64_t tk) {
    return reinterpret_cast<const Vec*>(trellis + (tk * tiles_n + strip * kTilesPerStrip) *
                                                      kTileInt16) +
           lane * Chunk::kCount;
  };
  Vec buf[Chunk::kCount];
  int64_t tk = tk_begin + warp;
  if (tk < tk_end) {
    const Vec* src = lane_source(tk);
#pragma unroll
    for (int v = 0; v < Chunk::kCount; ++v) buf[v] = StreamLoad(src + v);
  }
  for (; tk < tk_end; tk += kGemvWarps) {  // trip count uniform within the warp
    __syncwarp();                           // all lanes done reading the previous copy
#pragma unroll
    for (int v = 0; v < Chunk::kCount; ++v) my_store[v] = buf[v];
    __syncwarp();
    if (tk + kGemvWarps < tk_end) {  // next tile row in flight while decoding this one
      const Vec* src = lane_source(tk + kGemvWarps);
#pragma unroll
      for (int v = 0; v < Chunk::kCount; ++v) buf[v] = StreamLoad(src + v);
    }
    const XWord* x_rows = f_shared + (tk - tk_begin) * kTileDim;
    // g = g4 + 4h: rows r0 = 2·g4 are shared by h = 0, 1 (columns 2a + h);
    // g4 is a rolled loop to bound registers, h is unrolled (static acc index).
#pragma unroll 1
    for (int g4 = 0; g4 < 4; ++g4) {
      const int r0 = 2 * g4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Positions 64a + 8g + u: rows {r0, r0+1, r0+8, r0+9} (u = 0..3, 4..7)
        // of columns 2a + h (u < 4) and 2a + h + 8 (u >= 4)  (§3.2).
        const int g = g4 + 4 * h;
        if constexpr (kInt8) {
          // p = state·kMul1Mul: its four bytes sum to t (Mul1ByteSum, §4.3).
          uint32_t p[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const uint16_t state = ReadTileState(my_tile, K, 64 * quarter + 8 * g + u);
            p[u] = static_cast<uint32_t>(state) * kMul1Mul;
          }
#pragma unroll
          for (int i = 0; i < M; ++i) {
            const uint32_t* xr = x_rows + i * x_stride;
            const uint32_t q0 = xr[r0];
            const uint32_t q1 = xr[r0 + 1];
            const uint32_t q2 = xr[r0 + 8];
            const uint32_t q3 = xr[r0 + 9];
            int32_t lo = acc[i][h];
            lo = Dp4aUnsignedSigned(p[0], q0, lo);
            lo = Dp4aUnsignedSigned(p[1], q1, lo);
            lo = Dp4aUnsignedSigned(p[2], q2, lo);
            acc[i][h] = Dp4aUnsignedSigned(p[3], q3, lo);
            int32_t hi = acc[i][h + 2];
            hi = Dp4aUnsignedSigned(p[4], q0, hi);
            hi = Dp4aUnsignedSigned(p[5], q1, hi);
            hi = Dp4aUnsignedSigned(p[6], q2, hi);
            acc[i][h + 2] = Dp4aUnsignedSigned(p[7], q3, hi);
          }
        } else {
          float w[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const uint16_t state = ReadTileState(my_tile, K, 64 * quarter + 8 * g + u);
            w[u] = HalfBitsToFloat(DecodeState(CB, state));
          }
#pragma unroll
          for (int i = 0; i < M; ++i) {
            const float* xr = x_rows + i * x_stride;
            const float x0 = xr[r0];
            const float x1 = xr[r0 + 1];
            const float x2 = xr[r0 + 8];
            const float x3 = xr[r0 + 9];
            acc[i][h] += x0 * w[0] + x1 * w[1] + x2 * w[2] + x3 * w[3];
            acc[i][h + 2] += x0 * w[4] + x1 * w[5] + x2 * w[6] + x3 * w[7];
          }
        }
      }
    }
  }

  // Combine the warps in warp order: f_shared becomes [warp][i][column].
  __syncthreads();
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int column = kTileDim * tile_in_strip + 2 * quarter + (c & 1) + 8 * (c >> 1);
      acc_shared[(warp * M + i) * kStripColumns + column] = acc[i][c];
    }
  }
  __syncthreads();
  const int rows_out = m < M ? static_cast<int>(m) : M;
  for (int idx = static_cast<int>(threadIdx.x); idx < rows_out * kStripColumns;
       idx += kGemvThreads) {
    const int i = idx / kStripColumns;
    const int column = idx % kStripColumns;
    Acc sum = acc_shared[i * kStripColumns + column];
    for (int w = 1; w < kGemvWarps; ++w) sum += acc_shared[(w * M + i) * kStripColumns + column];
    partial[(split * m + i) * n + strip * kStripColumns + column] = sum;
  }
}

struct GemvArgs {
  const uint16_t* trellis;
  const void* x_in;  // x' (float) or q_words (uint32, kInt8)
  int64_t m, k, n;
  int groups_per_split;
  void* partial;     // float or int32 (kInt8)
  dim3 grid;
  size_t shared_bytes;
  cudaStream_t stream;
};

template <int K, Codebook CB, int M, bool kInt8>
cudaError_t LaunchGemv(const GemvArgs& a) {
  TrellisGemvKernel<K, CB, M, kInt8><<<a.grid, kGemvThreads, a.shared_bytes, a.stream>>>(
      a.trellis, a.x_in, a.m, a.k, a.n, a.groups_per_split, a.partial);
  return cudaGetLastError();
}

template <int K, Codebook CB, bool kInt8 = false>
cudaError_t LaunchGemvRows(int rows_bucket, const GemvArgs& a) {
  switch (rows_bucket) {
    case 1:
      return LaunchGemv<K, CB, 1, kInt8>(a);
    case 2:
      return LaunchGemv<K, CB, 2, kInt8>(a);
    case 4:
      return LaunchGemv<K, CB, 4, kInt8>(a);
    default:
      return LaunchGemv<K, CB, 8, kInt8>(a);
  }
}

template <int K>
cudaError_t LaunchGemvCodebook(Codebook codebook, int rows_bucket, const GemvArgs& a) {
  switch (codebook) {
    case Codebook::kMcg:
      return LaunchGemvRows<K, Codebook::kMcg>(rows_bucket, a);
    case Codebook::kMul1:
      return LaunchGemvRows<K, Codebook::kMul1>(rows_bucket, a);
    case Codebook::k3Inst:
    default:
      return LaunchGemvRows<K, Codebook::k3Inst>(rows_bucket, a);
  }
}

// kInt8: mul1 only (checked by CheckArguments).
cudaError_t LaunchGemvInt8(int bits, int rows_bucket, const GemvArgs& a) {
  switch (bits) {
    case 1: return LaunchGemvRows<1, Codebook::kMul1, true>(rows_bucket, a);
    case 2: return LaunchGemvRows<2, Codebook::kMul1, true>(rows_bucket, a);
    case 3: return LaunchGemvRows<3, Codebook::kMul1, true>(rows_bucket, a);
    case 4: return LaunchGemvRows<4, Codebook::kMul1, true>(rows_bucket, a);
    case 5: return LaunchGemvRows<5, Codebook::kMul1, true>(rows_bucket, a);
    case 6: return LaunchGemvRows<6, Codebook::kMul1, true>(rows_bucket, a);
    case 7: return LaunchGemvRows<7, Codebook::kMul1, true>(rows_bucket, a);
    default: return LaunchGemvRows<8, Codebook::kMul1, true>(rows_bucket, a);
  }
}

cudaError_t LaunchGemvAny(int bits, Codebook codebook, int rows_bucket, const GemvArgs& a) {
  switch (bits) {
    case 1: return LaunchGemvCodebook<1>(codebook, rows_bucket, a);
    case 2: return LaunchGemvCodebook<2>(codebook, rows_bucket, a);
    case 3: return LaunchGemvCodebook<3>(codebook, rows_bucket, a);
    case 4: return LaunchGemvCodebook<4>(codebook, rows_bucket, a);
    case 5: return LaunchGemvCodebook<5>(codebook, rows_bucket, a);
    case 6: return LaunchGemvCodebook<6>(codebook, rows_bucket, a);
    case 7: return LaunchGemvCodebook<7>(codebook, rows_bucket, a);
    default: return LaunchGemvCodebook<8>(codebook, rows_bucket, a);
  }
}

int RowsBucket(int64_t rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }
static_assert(kGemvMaxRows == 8, "RowsBucket and the M instantiations assume 8");

// The lane layout the GEMV hard-codes, checked once against TilePermutation.
bool LaneLayoutMatchesTilePermutation() {
  for (int a = 0; a < 4; ++a) {
    for (int g = 0; g < 8; ++g) {
      for (int u = 0; u < 8; ++u) {
        const int j = 64 * a + 8 * g + u;
        const int row = 2 * (g & 3) + (u & 1) + 8 * ((u >> 1) & 1);
        const int column = 2 * a + (g >> 2) + 8 * (u >> 2);
        if (TilePermutation(j) != kTileDim * row + column) return false;
      }
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// cuBLAS path: W_h columns [n0, n0 + cols) as fp32, row-major k x cols. One
// warp per tile, lane l the 8 positions 8l .. 8l+7 (as trellis_reconstruct.cu).
__global__ void DecodeSliceKernel(const uint16_t* __restrict__ trellis, int64_t tiles_n,
                                  int64_t tiles_k, int64_t tn0, int64_t slice_tiles, int bits,
                                  Codebook codebook, float* __restrict__ w_slice) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t first =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t cols = slice_tiles * kTileDim;
  const int64_t tile_values = TileInt16Count(bits);
  for (int64_t t = first; t < tiles_k * slice_tiles; t += warps) {
    const int64_t tk = t / slice_tiles;
    const int64_t tn = t % slice_tiles;
    const uint16_t* packed = trellis + (tk * tiles_n + tn0 + tn) * tile_values;
    float* origin = w_slice + tk * kTileDim * cols + tn * kTileDim;
    for (int u = 0; u < 8; ++u) {
      const int j = lane * 8 + u;
      const int rc = TilePermutation(j);
      origin[(rc / kTileDim) * cols + rc % kTileDim] =
          HalfBitsToFloat(DecodeState(codebook, ReadTileState(packed, bits, j)));
    }
  }
}

absl::Status CublasStatus(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusName(status), " (",
                                           static_cast<int>(status), "): ",
                                           cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (status == CUBLAS_STATUS_NOT_INITIALIZED) return absl::FailedPreconditionError(message);
  return absl::InternalError(message);
}

struct CublasHandle {
  cublasHandle_t handle = nullptr;
  ~CublasHandle() {
    if (handle != nullptr) cublasDestroy(handle);
  }
};

// Stream-ordered scratch, freed on the same stream (errors of the free are
// ignored: the call's result is already decided).
class StreamBuffer {
 public:
  explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
  }
  absl::Status Allocate(size_t bytes, const char* what) {
    return CudaStatus(cudaMallocAsync(&p_, bytes, stream_),
                      absl::StrCat("allocating ", bytes, " bytes of device scratch for ", what));
  }
  float* floats() const { return static_cast<float*>(p_); }
  void* get() const { return p_; }

 private:
  cudaStream_t stream_;
  void* p_ = nullptr;
};

unsigned GridFor(int64_t work, int64_t cap) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(work, cap)));
}

// The kInt8 operands of the epilogue (null for kFloat), offset to a pass's rows.
struct Int8Rows {
  const int32_t* partial = nullptr;
  const float* x_scale = nullptr;
  const int32_t* x_int_sum = nullptr;
};

absl::Status RunOutputTransform(const Exl3LinearView& v, const float* partial, int splits,
                                int64_t rows, float* y, cudaStream_t stream,
                                const Int8Rows& int8 = {}) {
  OutputTransformKernel<<<GridFor(rows * (v.n / kHadamardSize), kMaxTransformBlocks),
                          kTransformThreads, 0, stream>>>(partial, int8.partial, int8.x_scale,
                                                          int8.x_int_sum, splits, rows, v.n,
                                                          v.svh, v.bias, y);
  return CudaStatus(cudaGetLastError(), "launching the output transform");
}

// y' = x'·W_h through the GEMV in passes of kGemvMaxRows rows, each followed
// by the output transform into y. int8 (mul1, k > 0): x' is quantized first
// and the GEMV accumulates Σ t·q in int32 (dp4a).
absl::Status RunGemvPath(const Exl3LinearView& v, const float* x_had, int64_t m, float* y,
                         int sm_count, bool int8, cudaStream_t stream) {
  const int64_t strips = v.n / kStripColumns;
  const int64_t groups_k = v.k / kRowsPerGroup;
  const int64_t pass_rows_max = std::min<int64_t>(m, kGemvMaxRows);
  const int bucket_max = RowsBucket(pass_rows_max);
  // Split k so the grid has >= kTargetBlocksPerSm blocks per SM where possible,
  // bounded by the x' staging size of the largest row bucket.
  const int64_t groups_cap = std::max<int64_t>(1, kXSharedBytes / (bucket_max * kRowsPerGroup * 4));
  int64_t splits = 1;
  int64_t groups_per_split = 1;
  if (groups_k > 0) {
    const int64_t want = std::clamp<int64_t>(
        (static_cast<int64_t>(kTargetBlocksPerSm) * sm_count + strips - 1) / strips, 1, groups_k);
    groups_per_split = std::min((groups_k + want - 1) / want, groups_cap);
    // kInt8: one split per 128-row block (each block has its own scale).
    if (int8) groups_per_split = 1;
    splits = (groups_k + groups_per_split - 1) / groups_per_split;
  }
  if (splits > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda trellis gemm: k = ", v.k, " needs ", splits, " k splits (> 65535)"));
  }
  StreamBuffer partial(stream);
  static_assert(sizeof(float) == sizeof(int32_t));
  const size_t partial_bytes =
      static_cast<size_t>(splits) * static_cast<size_t>(pass_rows_max * v.n) * sizeof(float);
  if (absl::Status s = partial.Allocate(partial_bytes, "GEMV partial sums"); !s.ok()) return s;
  StreamBuffer q_words(stream);
  StreamBuffer x_scale(stream);
  StreamBuffer x_int_sum(stream);
  if (int8) {
    if (absl::Status s = q_words.Allocate(static_cast<size_t>(m * v.k) * 4, "int8 activations");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = x_scale.Allocate(static_cast<size_t>(m * groups_k) * 4 + 4,
                                          "int8 block scales");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = x_int_sum.Allocate(static_cast<size_t>(m * groups_k) * 4 + 4,
                                            "int8 block sums");
        !s.ok()) {
      return s;
    }
    QuantizeInt8Kernel<<<GridFor(m * groups_k, kMaxTransformBlocks), kQuantThreads, 0, stream>>>(
        x_had, m, v.k, static_cast<uint32_t*>(q_words.get()), x_scale.floats(),
        static_cast<int32_t*>(x_int_sum.get()));
    if (absl::Status s = CudaStatus(cudaGetLastError(), "launching the int8 quantization");
        !s.ok()) {
      return s;
    }
  }

  for (int64_t row0 = 0; row0 < m; row0 += kGemvMaxRows) {
    const int64_t rows = std::min<int64_t>(kGemvMaxRows, m - row0);
    if (groups_k == 0) {
      if (absl::Status s = CudaStatus(
              cudaMemsetAsync(partial.floats(), 0, rows * v.n * sizeof(float), stream),
              "clearing the partial sums");
          !s.ok()) {
        return s;
      }
    } else {
      const int bucket = RowsBucket(rows);
      GemvArgs args;
      args.trellis = v.trellis;
      args.x_in = int8 ? static_cast<const void*>(static_cast<const uint32_t*>(q_words.get()) +
                                                   row0 * v.k)
                       : static_cast<const void*>(x_had + row0 * v.k);
      args.m = rows;
      args.k = v.k;
      args.n = v.n;
      args.groups_per_split = static_cast<int>(groups_per_split);
      args.partial = partial.get();
      args.grid = dim3(static_cast<unsigned>(strips), static_cast<unsigned>(splits));
      const int x_bytes = static_cast<int>(bucket * groups_per_split * kRowsPerGroup * 4);
      args.shared_bytes = static_cast<size_t>(GemvTrellisSharedBytes(v.bits) +
                                              std::max(x_bytes, GemvReduceSharedBytes(bucket)));
      args.stream = stream;
      const cudaError_t launched = int8 ? LaunchGemvInt8(v.bits, bucket, args)
                                        : LaunchGemvAny(v.bits, v.codebook, bucket, args);
      if (absl::Status s = CudaStatus(launched,
                                      absl::StrCat("launching the trellis GEMV (K=", v.bits,
                                                   ", rows=", rows, ", grid ", strips, "x", splits,
                                                   ", ", args.shared_bytes, " B shared)"));
          !s.ok()) {
        return s;
      }
    }
    Int8Rows int8_rows;
    if (int8 && groups_k > 0) {  // k = 0: the cleared partial sums, as kFloat
      int8_rows.partial = static_cast<const int32_t*>(partial.get());
      int8_rows.x_scale = x_scale.floats() + row0 * groups_k;
      int8_rows.x_int_sum = static_cast<const int32_t*>(x_int_sum.get()) + row0 * groups_k;
    }
    if (absl::Status s = RunOutputTransform(v, partial.floats(), static_cast<int>(splits), rows,
                                            y + row0 * v.n, stream, int8_rows);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// y' = x'·W_h with cuBLAS SGEMM on W_h decoded to fp32 in column slices,
// written into y, then the output transform in place.
absl::Status RunCublasPath(const Exl3LinearView& v, const float* x_had, int64_t m, float* y,
                           cudaStream_t stream) {
  constexpr int64_t kIntMax = 2147483647;
  if (m > kIntMax || v.k > kIntMax || v.n > kIntMax) {
    return absl::InvalidArgumentError("cuda trellis gemm: cuBLAS path needs m, k, n < 2^31");
  }
  if (v.k == 0) {
    if (absl::Status s = CudaStatus(cudaMemsetAsync(y, 0, m * v.n * sizeof(float), stream),
                                    "clearing y'");
        !s.ok()) {
      return s;
    }
    return RunOutputTransform(v, y, 1, m, y, stream);
  }
  const int64_t slice_cols = std::clamp<int64_t>(
      kSliceMaxBytes / (v.k * 4) / kStripColumns * kStripColumns, kStripColumns, v.n);
  StreamBuffer w_slice(stream);
  if (absl::Status s = w_slice.Allocate(static_cast<size_t>(v.k * slice_cols) * sizeof(float),
                                        "a W_h column slice");
      !s.ok()) {
    return s;
  }
  CublasHandle handle;
  if (absl::Status s = CublasStatus(cublasCreate(&handle.handle), "cublasCreate"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CublasStatus(cublasSetStream(handle.handle, stream), "cublasSetStream");
      !s.ok()) {
    return s;
  }
  // Plain fp32 (no TF32 tensor-core rounding): results stay within fp32 error.
  if (absl::Status s =
          CublasStatus(cublasSetMathMode(handle.handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
      !s.ok()) {
    return s;
  }
  const int64_t tiles_n = v.n / kTileDim;
  const int64_t tiles_k = v.k / kTileDim;
  for (int64_t n0 = 0; n0 < v.n; n0 += slice_cols) {
    const int64_t cols = std::min(slice_cols, v.n - n0);
    const int64_t slice_tiles = cols / kTileDim;
    const int64_t warps = tiles_k * slice_tiles;
    DecodeSliceKernel<<<GridFor((warps * kWarpSize + kDecodeThreads - 1) / kDecodeThreads,
                                kMaxDecodeBlocks),
                        kDecodeThreads, 0, stream>>>(v.trellis, tiles_n, tiles_k, n0 / kTileDim,
                                                     slice_tiles, v.bits, v.codebook,
                                                     w_slice.floats());
    if (absl::Status s = CudaStatus(cudaGetLastError(), "launching the W_h slice decode");
        !s.ok()) {
      return s;
    }
    // Row-major Y[:, n0:n0+cols] (ld n) is column-major Y^T (cols x m);
    // Y^T = Wslice^T · x'^T with Wslice row-major = column-major (cols x k, ld cols).
    const float one = 1.0f;
    const float zero = 0.0f;
    if (absl::Status s = CublasStatus(
            cublasSgemm(handle.handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(cols),
                        static_cast<int>(m), static_cast<int>(v.k), &one, w_slice.floats(),
                        static_cast<int>(cols), x_had, static_cast<int>(v.k), &zero, y + n0,
                        static_cast<int>(v.n)),
            absl::StrCat("cublasSgemm (", m, " x ", v.k, " x ", cols, ")"));
        !s.ok()) {
      return s;
    }
  }
  return RunOutputTransform(v, y, 1, m, y, stream);
}

absl::Status CheckArguments(const Exl3LinearView& view, const float* x, int64_t m, const float* y,
                            const TrellisGemmOptions& options) {
  if (m < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda trellis gemm: row count m must be >= 0, got ", m));
  }
  if ((m * view.k > 0 && x == nullptr) || (m * view.n > 0 && y == nullptr)) {
    return absl::InvalidArgumentError(
        "cuda trellis gemm: x (m x k) and y (m x n) must be non-null when non-empty");
  }
  if (options.precision == TrellisGemmPrecision::kInt8 && view.codebook != Codebook::kMul1) {
    return absl::InvalidArgumentError(
        "cuda trellis gemm: precision kInt8 needs the mul1 codebook; use kFloat");
  }
  if (options.precision != TrellisGemmPrecision::kFloat &&
      options.precision != TrellisGemmPrecision::kInt8) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda trellis gemm: precision ", static_cast<int>(options.precision),
        " is not implemented on CUDA (kFloat and kInt8 are)"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
absl::StatusOr<DeviceExl3Linear> DeviceExl3Linear::Upload(const Exl3LinearView& view) {
  if (absl::Status s = ValidateExl3LinearView(view); !s.ok()) return s;
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  DeviceExl3Linear out;
  if (absl::Status s = CudaStatus(cudaGetDevice(&out.device_), "cudaGetDevice"); !s.ok()) return s;
  auto aligned = [](int64_t bytes) { return (bytes + kAllocAlign - 1) / kAllocAlign * kAllocAlign; };
  const int64_t tiles = (view.k / kTileDim) * (view.n / kTileDim);
  const int64_t trellis_bytes = tiles * TileInt16Count(view.bits) * 2;
  const int64_t suh_bytes = view.k * 4;
  const int64_t svh_bytes = view.n * 4;
  const int64_t bias_bytes = view.bias != nullptr ? view.n * 4 : 0;
  const int64_t total =
      aligned(trellis_bytes) + aligned(suh_bytes) + aligned(svh_bytes) + aligned(bias_bytes);
  out.view_ = view;
  out.view_.trellis = nullptr;
  out.view_.suh = nullptr;
  out.view_.svh = nullptr;
  out.view_.bias = nullptr;
  if (total == 0) return out;
  void* storage = nullptr;
  if (absl::Status s = CudaStatus(cudaMalloc(&storage, static_cast<size_t>(total)),
                                  absl::StrCat("allocating ", total,
                                               " bytes of device memory for an EXL3 linear (",
                                               view.k, " x ", view.n, ", K=", view.bits, ")"));
      !s.ok()) {
    return s;
  }
  out.storage_ = storage;
  out.bytes_ = total;
  char* base = static_cast<char*>(storage);
  struct Part {
    const void* host;
    int64_t bytes;
    const char* name;
  };
  const Part parts[] = {{view.trellis, trellis_bytes, "trellis"},
                        {view.suh, suh_bytes, "suh"},
                        {view.svh, svh_bytes, "svh"},
                        {view.bias, bias_bytes, "bias"}};
  const void* placed[4] = {nullptr, nullptr, nullptr, nullptr};
  int64_t offset = 0;
  for (int p = 0; p < 4; ++p) {
    if (parts[p].bytes == 0) continue;
    placed[p] = base + offset;
    if (absl::Status s = CudaStatus(cudaMemcpy(base + offset, parts[p].host,
                                               static_cast<size_t>(parts[p].bytes),
                                               cudaMemcpyHostToDevice),
                                    absl::StrCat("copying ", parts[p].name, " to the device"));
        !s.ok()) {
      return s;  // `out` frees the storage
    }
    offset += aligned(parts[p].bytes);
  }
  out.view_.trellis = static_cast<const uint16_t*>(placed[0]);
  out.view_.suh = static_cast<const float*>(placed[1]);
  out.view_.svh = static_cast<const float*>(placed[2]);
  out.view_.bias = static_cast<const float*>(placed[3]);
  return out;
}

DeviceExl3Linear::DeviceExl3Linear(DeviceExl3Linear&& other) noexcept
    : view_(other.view_),
      device_(other.device_),
      storage_(std::exchange(other.storage_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {
  other.view_ = Exl3LinearView{};
}

DeviceExl3Linear& DeviceExl3Linear::operator=(DeviceExl3Linear&& other) noexcept {
  if (this != &other) {
    if (storage_ != nullptr) cudaFree(storage_);
    view_ = std::exchange(other.view_, Exl3LinearView{});
    device_ = other.device_;
    storage_ = std::exchange(other.storage_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceExl3Linear::~DeviceExl3Linear() {
  if (storage_ != nullptr) cudaFree(storage_);
}

absl::Status TrellisGemm(const DeviceExl3Linear& w, const float* d_x, int64_t m, float* d_y,
                         void* stream_ptr, const TrellisGemmOptions& options) {
  const Exl3LinearView& v = w.device_view();
  if (absl::Status s = CheckArguments(v, d_x, m, d_y, options); !s.ok()) return s;
  if (m == 0 || v.n == 0) return absl::OkStatus();
  static const bool layout_ok = LaneLayoutMatchesTilePermutation();
  if (!layout_ok) {
    return absl::InternalError("cuda trellis gemm: GEMV lane layout disagrees with §3.2");
  }
  int device = -1;
  if (absl::Status s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); !s.ok()) return s;
  if (device != w.device()) {
    return absl::FailedPreconditionError(absl::StrCat("cuda trellis gemm: current device ", device,
                                                      " is not the linear's device ", w.device()));
  }
  int sm_count = 0;
  if (absl::Status s = CudaStatus(
          cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
          "querying the SM count");
      !s.ok()) {
    return s;
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);

  StreamBuffer x_had(stream);
  if (v.k > 0) {
    if (absl::Status s =
            x_had.Allocate(static_cast<size_t>(m * v.k) * sizeof(float), "x' (input transform)");
        !s.ok()) {
      return s;
    }
    InputTransformKernel<<<GridFor(m * (v.k / kHadamardSize), kMaxTransformBlocks),
                           kTransformThreads, 0, stream>>>(d_x, v.suh, m, v.k, x_had.floats());
    if (absl::Status s = CudaStatus(cudaGetLastError(), "launching the input transform");
        !s.ok()) {
      return s;
    }
  }
  // kInt8 always runs the GEMV (in passes); k = 0 needs no quantization (y = bias).
  const bool int8 = options.precision == TrellisGemmPrecision::kInt8 && v.k > 0;
  if (m >= kCublasMinRows && !int8) return RunCublasPath(v, x_had.floats(), m, d_y, stream);
  return RunGemvPath(v, x_had.floats(), m, d_y, sm_count, int8, stream);
}

namespace {

struct StreamOwner {
  cudaStream_t stream = nullptr;
  ~StreamOwner() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

}  // namespace

absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options) {
  if (absl::Status s = ValidateExl3LinearView(view); !s.ok()) return s;
  if (absl::Status s = CheckArguments(view, x, m, y, options); !s.ok()) return s;
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  if (m == 0 || view.n == 0) return absl::OkStatus();

  absl::StatusOr<DeviceExl3Linear> w = DeviceExl3Linear::Upload(view);
  if (!w.ok()) return w.status();
  const size_t x_bytes = static_cast<size_t>(m * view.k) * sizeof(float);
  const size_t y_bytes = static_cast<size_t>(m * view.n) * sizeof(float);
  void* dx = nullptr;
  void* dy = nullptr;
  if (x_bytes > 0) {
    if (absl::Status s = CudaStatus(cudaMalloc(&dx, x_bytes),
                                    absl::StrCat("allocating ", x_bytes, " bytes for x"));
        !s.ok()) {
      return s;
    }
  }
  std::unique_ptr<void, DeviceFree> x_owner(dx);
  if (absl::Status s = CudaStatus(cudaMalloc(&dy, y_bytes),
                                  absl::StrCat("allocating ", y_bytes, " bytes for y"));
      !s.ok()) {
    return s;
  }
  std::unique_ptr<void, DeviceFree> y_owner(dy);
  StreamOwner stream;
  if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking),
                                  "creating a stream");
      !s.ok()) {
    return s;
  }
  if (x_bytes > 0) {
    if (absl::Status s = CudaStatus(
            cudaMemcpyAsync(dx, x, x_bytes, cudaMemcpyHostToDevice, stream.stream), "copying x");
        !s.ok()) {
      return s;
    }
  }
  absl::Status run = TrellisGemm(*w, static_cast<const float*>(dx), m, static_cast<float*>(dy),
                                 stream.stream, options);
  // Wait even after a failed enqueue: scratch frees are queued on the stream.
  const absl::Status sync = CudaStatus(cudaStreamSynchronize(stream.stream), "running the gemm");
  if (!run.ok()) return run;
  if (!sync.ok()) return sync;
  std::vector<float> host_y(static_cast<size_t>(m * view.n));
  if (absl::Status s = CudaStatus(cudaMemcpy(host_y.data(), dy, y_bytes, cudaMemcpyDeviceToHost),
                                  "copying y to the host");
      !s.ok()) {
    return s;
  }
  std::memcpy(y, host_y.data(), y_bytes);
  return absl::OkStatus();
}

}  // namespace exl3serve::kernels::cuda
