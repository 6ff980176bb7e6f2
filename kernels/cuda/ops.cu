#include "kernels/cuda/ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <cub/cub.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels::cuda {
namespace {

// Launch constants. None is tuned (no GPU was available when written); they
// are the plain choices the header describes.
constexpr int kWarpSize = 32;
constexpr int kNormThreads = 256;     // RMSNorm: threads per row
constexpr int kRopeThreads = 256;     // RoPE: threads per block, one per (token, pair)
constexpr int kAttnWarps = 4;         // attention: warps per (token, head) block
constexpr int kAttnThreads = kAttnWarps * kWarpSize;
constexpr int kHeadChunks = static_cast<int>(kMaxAttentionHeadDim / kWarpSize);  // per lane
constexpr int kSampleThreads = 1024;  // sampling: threads per row
constexpr int64_t kMaxGridX = 1 << 30;  // grid-stride loops cap the grid here
constexpr int64_t kMaxGridY = 65535;

// ---------------------------------------------------------------------------
// Device memory owned by one call. cudaFree's own error is ignored: the
// call's result is already decided.
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

absl::Status Allocate(size_t bytes, const char* what, DeviceBuffer* buffer) {
  void* p = nullptr;
  if (bytes == 0) bytes = 1;
  absl::Status status =
      CudaStatus(cudaMalloc(&p, bytes), absl::StrCat("allocating ", bytes, " bytes for ", what));
  if (status.ok()) buffer->reset(p);
  return status;
}

// Allocates and uploads `bytes` of host memory.
absl::Status Upload(const void* host, size_t bytes, const char* what, DeviceBuffer* buffer) {
  if (absl::Status s = Allocate(bytes, what, buffer); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpy(buffer->get(), host, bytes, cudaMemcpyHostToDevice),
                    absl::StrCat("copying ", what, " to the device"));
}

absl::Status Download(void* host, const DeviceBuffer& buffer, size_t bytes, const char* what) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpy(host, buffer.get(), bytes, cudaMemcpyDeviceToHost),
                    absl::StrCat("copying ", what, " to the host"));
}

// After a host overload's launch: the launch error, then the run's.
absl::Status Finish(const char* kernel) {
  if (absl::Status s = CudaStatus(cudaGetLastError(), absl::StrCat("launching ", kernel)); !s.ok()) {
    return s;
  }
  return CudaStatus(cudaDeviceSynchronize(), absl::StrCat("running ", kernel));
}

absl::Status Launched(const char* kernel) {
  return CudaStatus(cudaGetLastError(), absl::StrCat("launching ", kernel));
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

unsigned GridX(int64_t work) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(work, kMaxGridX)));
}

// ---------------------------------------------------------------------------
// FWHT-128: chunk c of the buffer is elements [128c, 128c + 128) (d is a
// multiple of 128, so rows x d is just consecutive chunks). Same butterflies
// in the same order as kernels/hadamard.cc, round-to-nearest, no contraction.
__global__ void __launch_bounds__(kHadamardSize) Fwht128Kernel(float* __restrict__ x,
                                                               int64_t chunks) {
  __shared__ float s[kHadamardSize];
  const int t = static_cast<int>(threadIdx.x);
  const float scale = static_cast<float>(kHadamardScale);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* v = x + c * kHadamardSize;
    s[t] = v[t];
    __syncthreads();
    for (int h = 1; h < kHadamardSize; h <<= 1) {
      if (t < kHadamardSize / 2) {
        const int j = (t / h) * 2 * h + t % h;
        const float a = s[j];
        const float b = s[j + h];
        s[j] = __fadd_rn(a, b);
        s[j + h] = __fsub_rn(a, b);
      }
      __syncthreads();
    }
    v[t] = __fmul_rn(s[t], scale);
    __syncthreads();  // s is reused by the next chunk
  }
}

// ---------------------------------------------------------------------------
// RMSNorm: block per row (grid-stride); float64 partial sums, reduced by warp
// shuffles then across warps in shared memory.
__device__ double BlockSumDouble(double v, double* shared /* [32] */) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  double total = 0.0;
  for (int w = 0; w < warps; ++w) total += shared[w];  // same order in every thread
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kNormThreads) RmsNormKernel(const float* x, int64_t rows,
                                                              int64_t dim,
                                                              const float* __restrict__ weight,
                                                              double eps, float* out) {
  __shared__ double partial[kWarpSize];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double sum = 0.0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const double v = xr[i];
      sum = __dadd_rn(sum, __dmul_rn(v, v));
    }
    sum = BlockSumDouble(sum, partial);
    const float inv = static_cast<float>(1.0 / sqrt(sum / static_cast<double>(dim) + eps));
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      yr[i] = __fmul_rn(__fmul_rn(xr[i], inv), weight[i]);
    }
  }
}

// ---------------------------------------------------------------------------
// RoPE: one thread per (token, pair i), looping over the heads.
__global__ void __launch_bounds__(kRopeThreads) RopeKernel(float* __restrict__ x, int64_t tokens,
                                                           int64_t heads, int64_t head_dim,
                                                           const int64_t* __restrict__ positions,
                                                           const double* __restrict__ inv_freq) {
  const int64_t half = head_dim / 2;
  const int64_t total = tokens * half;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = w / half, i = w % half;
    const double angle = static_cast<double>(positions[t]) * inv_freq[i];
    const float c = static_cast<float>(cos(angle));
    const float s = static_cast<float>(sin(angle));
    float* row = x + t * heads * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = row + h * head_dim;
      const float x1 = v[i], x2 = v[i + half];
      v[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
      v[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
    }
  }
}

// ---------------------------------------------------------------------------
// Attention over the paged pool; one block per (query token, q head).
template <typename T>
__device__ __forceinline__ float LoadKv(const T* p, int64_t i);
template <>
__device__ __forceinline__ float LoadKv<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float LoadKv<uint16_t>(const uint16_t* p, int64_t i) {
  return HalfBitsToFloat(p[i]);
}

struct AttentionArgs {
  const float* q;
  int64_t num_seqs;
  const int32_t* seq_lens;         // decode
  const int32_t* query_starts;     // prefill
  const int32_t* start_positions;  // prefill
  const void* k;
  const void* v;
  int64_t num_pages, page_size;
  const int32_t* page_table;
  int64_t pages_per_seq;
  int64_t q_heads, kv_heads, head_dim;
  float scale;
  int64_t window;
  float* out;
};

template <typename T, bool kDecode>
__global__ void __launch_bounds__(kAttnThreads) AttentionKernel(AttentionArgs a, int64_t rows) {
  __shared__ float warp_max[kAttnWarps];
  __shared__ float warp_sum[kAttnWarps];
  __shared__ float warp_acc[kAttnWarps][kMaxAttentionHeadDim];
  __shared__ int any_bad;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t hd = a.head_dim;
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int64_t head = blockIdx.y; head < a.q_heads; head += gridDim.y) {
      // Which sequence and position this query row is.
      int64_t s = 0, pos = -1;
      if (kDecode) {
        s = row;
        pos = static_cast<int64_t>(a.seq_lens[s]) - 1;
      } else {
        int64_t lo_s = 0, hi_s = a.num_seqs - 1;  // last s with query_starts[s] <= row
        while (lo_s < hi_s) {
          const int64_t mid = (lo_s + hi_s + 1) / 2;
          if (a.query_starts[mid] <= row) lo_s = mid; else hi_s = mid - 1;
        }
        s = lo_s;
        pos = static_cast<int64_t>(a.start_positions[s]) + (row - a.query_starts[s]);
      }
      const int64_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
      const int64_t g = head / (a.q_heads / a.kv_heads);
      bool bad = pos < 0 || pos >= a.pages_per_seq * a.page_size;
      if (threadIdx.x == 0) any_bad = 0;

      float qr[kHeadChunks];
      float acc[kHeadChunks];
      const float* qv = a.q + (row * a.q_heads + head) * hd;
#pragma unroll
      for (int c = 0; c < kHeadChunks; ++c) {
        const int64_t i = lane + c * kWarpSize;
        qr[c] = i < hd ? qv[i] : 0.0f;
        acc[c] = 0.0f;
      }
      float m = -INFINITY, l = 0.0f;
      const int32_t* table = a.page_table + s * a.pages_per_seq;
      for (int64_t j = lo + warp; !bad && j <= pos; j += kAttnWarps) {
        const int32_t page = table[j / a.page_size];
        if (page < 0 || page >= a.num_pages) {
          bad = true;  // the same for every lane of the warp
          break;
        }
        const int64_t base = ((page * a.page_size + j % a.page_size) * a.kv_heads + g) * hd;
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < kHeadChunks; ++c) {
          const int64_t i = lane + c * kWarpSize;
          if (i < hd) dot += qr[c] * LoadKv(k, base + i);
        }
        for (int o = kWarpSize / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float score = dot * a.scale;
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * correction + p;
#pragma unroll
        for (int c = 0; c < kHeadChunks; ++c) {
          const int64_t i = lane + c * kWarpSize;
          if (i < hd) acc[c] = acc[c] * correction + p * LoadKv(v, base + i);
        }
        m = m_new;
      }
      __syncthreads();  // any_bad reset is visible
      if (bad && lane == 0) atomicOr(&any_bad, 1);
      if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
      }
#pragma unroll
      for (int c = 0; c < kHeadChunks; ++c) {
        const int64_t i = lane + c * kWarpSize;
        if (i < hd) warp_acc[warp][i] = acc[c];
      }
      __syncthreads();
      float* o = a.out + (row * a.q_heads + head) * hd;
      float big = -INFINITY;
      for (int w = 0; w < kAttnWarps; ++w) big = fmaxf(big, warp_max[w]);
      float total = 0.0f;
      float weight[kAttnWarps];
      for (int w = 0; w < kAttnWarps; ++w) {
        weight[w] = warp_max[w] == -INFINITY ? 0.0f : expf(warp_max[w] - big);
        total += warp_sum[w] * weight[w];
      }
      for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < kAttnWarps; ++w) sum += warp_acc[w][i] * weight[w];
        o[i] = any_bad != 0 || !(total > 0.0f) ? NAN : sum / total;
      }
      __syncthreads();  // shared state is reused by the next (row, head)
    }
  }
}

absl::Status CheckAttentionLimits(const char* op, const AttentionParams& p) {
  if (p.head_dim > kMaxAttentionHeadDim) {
    return absl::UnimplementedError(absl::StrCat(op, ": the CUDA kernel supports head_dim <= ",
                                                 kMaxAttentionHeadDim, ", got ", p.head_dim));
  }
  if (p.q_heads > kMaxGridY) {
    return absl::UnimplementedError(
        absl::StrCat(op, ": the CUDA kernel supports q_heads <= ", kMaxGridY, ", got ", p.q_heads));
  }
  return absl::OkStatus();
}

// Scalar checks the device overloads can make (contents live on the device).
absl::Status CheckAttentionScalars(const char* op, int64_t num_seqs, const PagedKv& kv,
                                   const AttentionParams& p) {
  if (num_seqs < 0) return absl::InvalidArgumentError(absl::StrCat(op, ": num_seqs must be >= 0, got ", num_seqs));
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.head_dim <= 0 || p.q_heads % p.kv_heads != 0 ||
      !std::isfinite(p.scale) || p.sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": need q_heads, kv_heads, head_dim > 0, q_heads % kv_heads == 0, a finite scale and "
            "sliding_window >= 0, got ",
        p.q_heads, ", ", p.kv_heads, ", ", p.head_dim, ", ", p.scale, ", ", p.sliding_window));
  }
  if ((kv.dtype != KvDtype::kFp32 && kv.dtype != KvDtype::kFp16) || kv.num_pages <= 0 ||
      kv.page_size <= 0 || kv.pages_per_seq <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": kv needs dtype fp32/fp16 and num_pages, page_size, pages_per_seq > 0"));
  }
  return CheckAttentionLimits(op, p);
}

absl::Status LaunchAttention(bool decode, const AttentionArgs& args, int64_t rows,
                             KvDtype dtype, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const dim3 grid(GridX(rows), static_cast<unsigned>(std::min(args.q_heads, kMaxGridY)));
  if (dtype == KvDtype::kFp32) {
    if (decode) {
      AttentionKernel<float, true><<<grid, kAttnThreads, 0, stream>>>(args, rows);
    } else {
      AttentionKernel<float, false><<<grid, kAttnThreads, 0, stream>>>(args, rows);
    }
  } else if (decode) {
    AttentionKernel<uint16_t, true><<<grid, kAttnThreads, 0, stream>>>(args, rows);
  } else {
    AttentionKernel<uint16_t, false><<<grid, kAttnThreads, 0, stream>>>(args, rows);
  }
  return Launched("the attention kernel");
}

AttentionArgs MakeArgs(const float* q, int64_t num_seqs, const PagedKv& kv,
                       const AttentionParams& p, float* out) {
  AttentionArgs a{};
  a.q = q;
  a.num_seqs = num_seqs;
  a.k = kv.k;
  a.v = kv.v;
  a.num_pages = kv.num_pages;
  a.page_size = kv.page_size;
  a.page_table = kv.page_table;
  a.pages_per_seq = kv.pages_per_seq;
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.scale = p.scale;
  a.window = p.sliding_window;
  a.out = out;
  return a;
}

// The pool and table of a host PagedKv, on the device.
struct DevicePool {
  DeviceBuffer k, v, table;
  PagedKv view;
};

absl::Status UploadPool(const PagedKv& kv, const AttentionParams& p, int64_t num_seqs,
                        DevicePool* pool) {
  const size_t elem = kv.dtype == KvDtype::kFp32 ? sizeof(float) : sizeof(uint16_t);
  const size_t bytes =
      static_cast<size_t>(kv.num_pages * kv.page_size * p.kv_heads * p.head_dim) * elem;
  if (absl::Status s = Upload(kv.k, bytes, "the key pages", &pool->k); !s.ok()) return s;
  if (absl::Status s = Upload(kv.v, bytes, "the value pages", &pool->v); !s.ok()) return s;
  if (absl::Status s = Upload(kv.page_table,
                              static_cast<size_t>(num_seqs * kv.pages_per_seq) * sizeof(int32_t),
                              "the page table", &pool->table);
      !s.ok()) {
    return s;
  }
  pool->view = kv;
  pool->view.k = pool->k.get();
  pool->view.v = pool->v.get();
  pool->view.page_table = static_cast<const int32_t*>(pool->table.get());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Argmax and sampling: one block per row.
struct ValueIndex {
  float value;
  int32_t index;  // -1: empty
};

// (value, index) of the larger, lowest index on ties; an empty side loses;
// NaN never replaces a non-empty side, so the result is always in range.
__device__ __forceinline__ ValueIndex Better(ValueIndex a, ValueIndex b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

template <int kThreads>
__device__ int32_t BlockArgMax(const float* z, int64_t vocab) {
  __shared__ ValueIndex best[kThreads / kWarpSize];
  ValueIndex mine{0.0f, -1};
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    mine = Better(mine, ValueIndex{z[i], static_cast<int32_t>(i)});
  }
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    ValueIndex other;
    other.value = __shfl_xor_sync(0xffffffffu, mine.value, o);
    other.index = __shfl_xor_sync(0xffffffffu, mine.index, o);
    mine = Better(mine, other);
  }
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) best[warp] = mine;
  __syncthreads();
  ValueIndex all{0.0f, -1};
  for (int w = 0; w < kThreads / kWarpSize; ++w) all = Better(all, best[w]);
  __syncthreads();
  return all.index < 0 ? 0 : all.index;
}

__global__ void __launch_bounds__(kNormThreads) ArgMaxKernel(const float* __restrict__ logits,
                                                             int64_t rows, int64_t vocab,
                                                             int32_t* __restrict__ ids) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t id = BlockArgMax<kNormThreads>(logits + r * vocab, vocab);
    if (threadIdx.x == 0) ids[r] = id;
  }
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

using SampleReduce = cub::BlockReduce<double, kSampleThreads>;
using SampleScan = cub::BlockScan<double, kSampleThreads>;
using SampleMaxReduce = cub::BlockReduce<float, kSampleThreads>;

// Pass 1: p = softmax(z / T) in float64 per row (rows with T = 0 are left
// for pass 3), ids 0..vocab-1, segment offsets.
__global__ void __launch_bounds__(kSampleThreads)
    SoftmaxKernel(const float* __restrict__ logits, int64_t rows, int64_t vocab,
                  const SamplingFilter* __restrict__ filters, double* __restrict__ probs,
                  int32_t* __restrict__ ids, int32_t* __restrict__ offsets) {
  __shared__ union {
    typename SampleReduce::TempStorage sum;
    typename SampleMaxReduce::TempStorage max;
  } temp;
  __shared__ float row_max;
  __shared__ double row_sum;
  const int64_t r = blockIdx.x;
  const float* z = logits + r * vocab;
  double* p = probs + r * vocab;
  int32_t* id = ids + r * vocab;
  if (threadIdx.x == 0) {
    offsets[r] = static_cast<int32_t>(r * vocab);
    if (r == rows - 1) offsets[rows] = static_cast<int32_t>(rows * vocab);
  }
  const SamplingFilter f = filters[r];
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) id[i] = static_cast<int32_t>(i);
  if (f.temperature == 0.0f) {
    for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) p[i] = 0.0;
    return;
  }
  float local_max = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) local_max = fmaxf(local_max, z[i]);
  const float block_max = SampleMaxReduce(temp.max).Reduce(local_max, MaxOp());
  if (threadIdx.x == 0) row_max = block_max;
  __syncthreads();
  const double zmax = row_max;
  double local_sum = 0.0;
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) {
    const double e = exp((static_cast<double>(z[i]) - zmax) / f.temperature);
    p[i] = e;
    local_sum += e;
  }
  const double block_sum = SampleReduce(temp.sum).Sum(local_sum);
  if (threadIdx.x == 0) row_sum = block_sum;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) p[i] /= row_sum;
}

// Sum of sorted[0, n) by the block.
__device__ double BlockSumPrefix(const double* sorted, int64_t n,
                                 typename SampleReduce::TempStorage& temp, double* out) {
  double local = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kSampleThreads) local += sorted[i];
  const double total = SampleReduce(temp).Sum(local);
  if (threadIdx.x == 0) *out = total;
  __syncthreads();
  return *out;
}

// Pass 3 (after the segmented sort): filters, then the draw in id order.
// `weights` (the pre-sort probabilities, no longer needed) is reused as the
// per-id kept mass.
__global__ void __launch_bounds__(kSampleThreads)
    FilterAndDrawKernel(const float* __restrict__ logits, int64_t vocab,
                        const SamplingFilter* __restrict__ filters,
                        const double* __restrict__ uniforms, const double* __restrict__ sorted_p,
                        const int32_t* __restrict__ sorted_ids, double* __restrict__ weights,
                        int32_t* __restrict__ ids) {
  __shared__ union {
    typename SampleReduce::TempStorage reduce;
    typename SampleScan::TempStorage scan;
  } temp;
  __shared__ double shared_value;
  __shared__ int64_t first_hit;
  __shared__ int64_t last_nonzero;
  __shared__ double carry;
  const int64_t r = blockIdx.x;
  const SamplingFilter f = filters[r];
  if (f.temperature == 0.0f) {
    const int32_t id = BlockArgMax<kSampleThreads>(logits + r * vocab, vocab);
    if (threadIdx.x == 0) ids[r] = id;
    return;
  }
  const double* sp = sorted_p + r * vocab;
  const int32_t* sid = sorted_ids + r * vocab;
  double* w = weights + r * vocab;
  int64_t kept = (f.top_k > 0 && f.top_k < vocab) ? f.top_k : vocab;

  // top-p: the first rank whose mass before it reaches top_p · kept mass.
  if (f.top_p < 1.0f) {
    const double kept_mass = BlockSumPrefix(sp, kept, temp.reduce, &shared_value);
    if (threadIdx.x == 0) {
      first_hit = kept;
      carry = 0.0;
    }
    __syncthreads();
    for (int64_t base = 0; base < kept; base += kSampleThreads) {
      const int64_t i = base + threadIdx.x;
      const double value = i < kept ? sp[i] : 0.0;
      double before = 0.0, chunk_total = 0.0;
      SampleScan(temp.scan).ExclusiveSum(value, before, chunk_total);
      before += carry;
      if (i < kept && before / kept_mass >= f.top_p) atomicMin(reinterpret_cast<unsigned long long*>(&first_hit), static_cast<unsigned long long>(i));
      __syncthreads();
      if (threadIdx.x == 0) carry += chunk_total;
      __syncthreads();
      if (first_hit < kept) break;  // block-uniform
    }
    kept = first_hit;
  }
  // min-p: ranks 1.. with p >= min_p · max p (a prefix of the sorted order).
  if (f.min_p > 0.0f) {
    const double threshold = static_cast<double>(f.min_p) * sp[0];
    if (threadIdx.x == 0) first_hit = kept;
    __syncthreads();
    for (int64_t i = 1 + threadIdx.x; i < kept; i += kSampleThreads) {
      if (sp[i] < threshold) atomicMin(reinterpret_cast<unsigned long long*>(&first_hit), static_cast<unsigned long long>(i));
    }
    __syncthreads();
    kept = first_hit;
  }
  const double mass = BlockSumPrefix(sp, kept, temp.reduce, &shared_value);

  // Kept mass per id, then the first id whose running sum exceeds u.
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) w[i] = 0.0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < kept; i += kSampleThreads) w[sid[i]] = sp[i] / mass;
  __syncthreads();
  const double u = uniforms[r];
  if (threadIdx.x == 0) {
    first_hit = vocab;
    last_nonzero = 0;
    carry = 0.0;
  }
  __syncthreads();
  for (int64_t base = 0; base < vocab; base += kSampleThreads) {
    const int64_t i = base + threadIdx.x;
    const double value = i < vocab ? w[i] : 0.0;
    double cumulative = 0.0, chunk_total = 0.0;
    SampleScan(temp.scan).InclusiveSum(value, cumulative, chunk_total);
    cumulative += carry;
    if (value > 0.0) {
      atomicMax(reinterpret_cast<unsigned long long*>(&last_nonzero), static_cast<unsigned long long>(i));
      if (u < cumulative) atomicMin(reinterpret_cast<unsigned long long*>(&first_hit), static_cast<unsigned long long>(i));
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk_total;
    __syncthreads();
    if (first_hit < vocab) break;  // block-uniform
  }
  if (threadIdx.x == 0) ids[r] = static_cast<int32_t>(first_hit < vocab ? first_hit : last_nonzero);
}

// Stream-ordered scratch of one Sample call.
struct AsyncFree {
  cudaStream_t stream;
  void operator()(void* p) const { cudaFreeAsync(p, stream); }
};
using AsyncBuffer = std::unique_ptr<void, AsyncFree>;

absl::Status AllocateAsync(size_t bytes, const char* what, cudaStream_t stream,
                           AsyncBuffer* buffer) {
  void* p = nullptr;
  absl::Status status = CudaStatus(cudaMallocAsync(&p, std::max<size_t>(bytes, 1), stream),
                                   absl::StrCat("allocating ", bytes, " bytes for ", what));
  if (status.ok()) *buffer = AsyncBuffer(p, AsyncFree{stream});
  return status;
}

absl::Status CheckLogitsShape(const char* op, int64_t rows, int64_t vocab) {
  if (rows < 0 || vocab <= 0 || vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": need rows >= 0 and vocab in [1, 2^31-1], got ", rows, " and ", vocab));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
absl::Status BlockHadamardRows(float* x, int64_t rows, int64_t d, void* stream) {
  if (rows < 0 || d < 0 || d % kHadamardSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fwht128: need rows >= 0 and d a multiple of 128, got ", rows, " and ", d));
  }
  const int64_t chunks = rows * (d / kHadamardSize);
  if (chunks == 0) return absl::OkStatus();
  Fwht128Kernel<<<GridX(chunks), kHadamardSize, 0, AsStream(stream)>>>(x, chunks);
  return Launched("the FWHT-128 kernel");
}

absl::Status BlockHadamardRows(float* x, int64_t rows, int64_t d) {
  if (rows < 0 || d < 0 || d % kHadamardSize != 0) return BlockHadamardRows(x, rows, d, nullptr);
  if (rows * d == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  const size_t bytes = static_cast<size_t>(rows * d) * sizeof(float);
  DeviceBuffer buffer;
  if (absl::Status s = Upload(x, bytes, "x", &buffer); !s.ok()) return s;
  if (absl::Status s = BlockHadamardRows(static_cast<float*>(buffer.get()), rows, d, nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the FWHT-128 kernel"); !s.ok()) return s;
  return Download(x, buffer, bytes, "x");
}

absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out, void* stream) {
  if (rows < 0 || dim <= 0 || !(eps >= 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rms_norm: need rows >= 0, dim > 0 and eps >= 0, got ", rows, ", ", dim, ", ", eps));
  }
  if (rows == 0) return absl::OkStatus();
  RmsNormKernel<<<GridX(rows), kNormThreads, 0, AsStream(stream)>>>(x, rows, dim, weight, eps, out);
  return Launched("the RMSNorm kernel");
}

absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out) {
  if (absl::Status s = internal::ValidateRmsNorm(x, rows, dim, weight, eps, out); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  const size_t bytes = static_cast<size_t>(rows * dim) * sizeof(float);
  DeviceBuffer dx, dw;
  if (absl::Status s = Upload(x, bytes, "x", &dx); !s.ok()) return s;
  if (absl::Status s = Upload(weight, static_cast<size_t>(dim) * sizeof(float), "the weight", &dw);
      !s.ok()) {
    return s;
  }
  float* d = static_cast<float*>(dx.get());
  if (absl::Status s = RmsNorm(d, rows, dim, static_cast<const float*>(dw.get()), eps, d, nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the RMSNorm kernel"); !s.ok()) return s;
  return Download(out, dx, bytes, "out");
}

absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq, void* stream) {
  if (tokens < 0 || heads < 0 || head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: need tokens, heads >= 0 and an even head_dim > 0, got ", tokens, ", ",
                     heads, ", ", head_dim));
  }
  if (tokens == 0 || heads == 0) return absl::OkStatus();
  const int64_t work = tokens * (head_dim / 2);
  RopeKernel<<<GridX((work + kRopeThreads - 1) / kRopeThreads), kRopeThreads, 0,
               AsStream(stream)>>>(x, tokens, heads, head_dim, positions, inv_freq);
  return Launched("the RoPE kernel");
}

absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq) {
  if (absl::Status s = internal::ValidateRope(x, tokens, heads, head_dim, positions, inv_freq);
      !s.ok()) {
    return s;
  }
  if (tokens == 0 || heads == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  const size_t bytes = static_cast<size_t>(tokens * heads * head_dim) * sizeof(float);
  DeviceBuffer dx, dpos, dfreq;
  if (absl::Status s = Upload(x, bytes, "x", &dx); !s.ok()) return s;
  if (absl::Status s = Upload(positions, static_cast<size_t>(tokens) * sizeof(int64_t),
                              "the positions", &dpos);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Upload(inv_freq, static_cast<size_t>(head_dim / 2) * sizeof(double),
                              "the inverse frequencies", &dfreq);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ApplyRope(static_cast<float*>(dx.get()), tokens, heads, head_dim,
                                 static_cast<const int64_t*>(dpos.get()),
                                 static_cast<const double*>(dfreq.get()), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the RoPE kernel"); !s.ok()) return s;
  return Download(x, dx, bytes, "x");
}

absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out,
                             void* stream) {
  if (absl::Status s = CheckAttentionScalars("decode_attention", num_seqs, kv, params); !s.ok()) {
    return s;
  }
  AttentionArgs args = MakeArgs(q, num_seqs, kv, params, out);
  args.seq_lens = seq_lens;
  return LaunchAttention(/*decode=*/true, args, num_seqs, kv.dtype, AsStream(stream));
}

absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out) {
  if (absl::Status s = internal::ValidateDecodeAttention(q, num_seqs, seq_lens, kv, params, out);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckAttentionLimits("decode_attention", params); !s.ok()) return s;
  if (num_seqs == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  const size_t q_bytes = static_cast<size_t>(num_seqs * params.q_heads * params.head_dim) * sizeof(float);
  DevicePool pool;
  DeviceBuffer dq, dlens, dout;
  if (absl::Status s = UploadPool(kv, params, num_seqs, &pool); !s.ok()) return s;
  if (absl::Status s = Upload(q, q_bytes, "q", &dq); !s.ok()) return s;
  if (absl::Status s = Upload(seq_lens, static_cast<size_t>(num_seqs) * sizeof(int32_t),
                              "seq_lens", &dlens);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Allocate(q_bytes, "out", &dout); !s.ok()) return s;
  if (absl::Status s = DecodeAttention(static_cast<const float*>(dq.get()), num_seqs,
                                       static_cast<const int32_t*>(dlens.get()), pool.view, params,
                                       static_cast<float*>(dout.get()), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the decode attention kernel"); !s.ok()) return s;
  return Download(out, dout, q_bytes, "out");
}

absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, int64_t total_tokens,
                              const PagedKv& kv, const AttentionParams& params, float* out,
                              void* stream) {
  if (absl::Status s = CheckAttentionScalars("prefill_attention", num_seqs, kv, params); !s.ok()) {
    return s;
  }
  if (total_tokens < 0 || (total_tokens > 0 && num_seqs == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_attention: total_tokens must be >= 0 (and 0 without sequences), got ",
        total_tokens));
  }
  AttentionArgs args = MakeArgs(q, num_seqs, kv, params, out);
  args.query_starts = query_starts;
  args.start_positions = start_positions;
  return LaunchAttention(/*decode=*/false, args, total_tokens, kv.dtype, AsStream(stream));
}

absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, const PagedKv& kv,
                              const AttentionParams& params, float* out) {
  if (absl::Status s = internal::ValidatePrefillAttention(q, num_seqs, query_starts,
                                                          start_positions, kv, params, out);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckAttentionLimits("prefill_attention", params); !s.ok()) return s;
  if (num_seqs == 0 || query_starts[num_seqs] == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  const int64_t total = query_starts[num_seqs];
  const size_t q_bytes = static_cast<size_t>(total * params.q_heads * params.head_dim) * sizeof(float);
  const size_t seq_bytes = static_cast<size_t>(num_seqs) * sizeof(int32_t);
  DevicePool pool;
  DeviceBuffer dq, dstarts, dpos, dout;
  if (absl::Status s = UploadPool(kv, params, num_seqs, &pool); !s.ok()) return s;
  if (absl::Status s = Upload(q, q_bytes, "q", &dq); !s.ok()) return s;
  if (absl::Status s = Upload(query_starts, seq_bytes + sizeof(int32_t), "query_starts", &dstarts);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Upload(start_positions, seq_bytes, "start_positions", &dpos); !s.ok()) {
    return s;
  }
  if (absl::Status s = Allocate(q_bytes, "out", &dout); !s.ok()) return s;
  if (absl::Status s = PrefillAttention(
          static_cast<const float*>(dq.get()), num_seqs, static_cast<const int32_t*>(dstarts.get()),
          static_cast<const int32_t*>(dpos.get()), total, pool.view, params,
          static_cast<float*>(dout.get()), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the prefill attention kernel"); !s.ok()) return s;
  return Download(out, dout, q_bytes, "out");
}

absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, void* stream) {
  if (absl::Status s = CheckLogitsShape("argmax", rows, vocab); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  ArgMaxKernel<<<GridX(rows), kNormThreads, 0, AsStream(stream)>>>(logits, rows, vocab, ids);
  return Launched("the argmax kernel");
}

absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids) {
  if (absl::Status s = internal::ValidateArgMax(logits, rows, vocab, ids); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  DeviceBuffer dlogits, dids;
  if (absl::Status s = Upload(logits, static_cast<size_t>(rows * vocab) * sizeof(float), "logits",
                              &dlogits);
      !s.ok()) {
    return s;
  }
  const size_t id_bytes = static_cast<size_t>(rows) * sizeof(int32_t);
  if (absl::Status s = Allocate(id_bytes, "ids", &dids); !s.ok()) return s;
  if (absl::Status s = ArgMax(static_cast<const float*>(dlogits.get()), rows, vocab,
                              static_cast<int32_t*>(dids.get()), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the argmax kernel"); !s.ok()) return s;
  return Download(ids, dids, id_bytes, "ids");
}

absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids,
                    void* stream) {
  if (absl::Status s = CheckLogitsShape("sample", rows, vocab); !s.ok()) return s;
  if (rows * vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sample: rows x vocab must be <= 2^31-1 on CUDA (the sort's item count), got ",
        rows * vocab, "; sample in smaller batches"));
  }
  if (rows == 0) return absl::OkStatus();
  const cudaStream_t s = AsStream(stream);
  const int items = static_cast<int>(rows * vocab);
  const size_t p_bytes = static_cast<size_t>(items) * sizeof(double);
  const size_t id_bytes = static_cast<size_t>(items) * sizeof(int32_t);
  AsyncBuffer probs, sorted_p, ids_in, sorted_ids, offsets, sort_temp;
  if (absl::Status st = AllocateAsync(p_bytes, "probabilities", s, &probs); !st.ok()) return st;
  if (absl::Status st = AllocateAsync(p_bytes, "sorted probabilities", s, &sorted_p); !st.ok()) return st;
  if (absl::Status st = AllocateAsync(id_bytes, "token ids", s, &ids_in); !st.ok()) return st;
  if (absl::Status st = AllocateAsync(id_bytes, "sorted token ids", s, &sorted_ids); !st.ok()) return st;
  if (absl::Status st = AllocateAsync(static_cast<size_t>(rows + 1) * sizeof(int32_t), "offsets", s,
                                      &offsets);
      !st.ok()) {
    return st;
  }
  double* d_probs = static_cast<double*>(probs.get());
  double* d_sorted_p = static_cast<double*>(sorted_p.get());
  int32_t* d_ids_in = static_cast<int32_t*>(ids_in.get());
  int32_t* d_sorted_ids = static_cast<int32_t*>(sorted_ids.get());
  int32_t* d_offsets = static_cast<int32_t*>(offsets.get());
  SoftmaxKernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, s>>>(
      logits, rows, vocab, filters, d_probs, d_ids_in, d_offsets);
  if (absl::Status st = Launched("the softmax kernel"); !st.ok()) return st;
  size_t temp_bytes = 0;
  if (absl::Status st = CudaStatus(
          cub::DeviceSegmentedRadixSort::SortPairsDescending(
              nullptr, temp_bytes, d_probs, d_sorted_p, d_ids_in, d_sorted_ids, items,
              static_cast<int>(rows), d_offsets, d_offsets + 1, 0, 64, s),
          "sizing the sort");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = AllocateAsync(temp_bytes, "the sort", s, &sort_temp); !st.ok()) return st;
  if (absl::Status st = CudaStatus(
          cub::DeviceSegmentedRadixSort::SortPairsDescending(
              sort_temp.get(), temp_bytes, d_probs, d_sorted_p, d_ids_in, d_sorted_ids, items,
              static_cast<int>(rows), d_offsets, d_offsets + 1, 0, 64, s),
          "sorting the probabilities");
      !st.ok()) {
    return st;
  }
  FilterAndDrawKernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, s>>>(
      logits, vocab, filters, uniforms, d_sorted_p, d_sorted_ids, d_probs, ids);
  return Launched("the filter-and-draw kernel");
}

absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids) {
  if (absl::Status s = internal::ValidateSample(logits, rows, vocab, filters, uniforms, ids);
      !s.ok()) {
    return s;
  }
  if (rows * vocab > std::numeric_limits<int32_t>::max()) {
    return Sample(logits, rows, vocab, filters, uniforms, ids, nullptr);  // the size error
  }
  if (rows == 0) return absl::OkStatus();
  if (absl::Status s = CudaDeviceAvailable(); !s.ok()) return s;
  DeviceBuffer dlogits, dfilters, du, dids;
  if (absl::Status s = Upload(logits, static_cast<size_t>(rows * vocab) * sizeof(float), "logits",
                              &dlogits);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Upload(filters, static_cast<size_t>(rows) * sizeof(SamplingFilter),
                              "the filters", &dfilters);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Upload(uniforms, static_cast<size_t>(rows) * sizeof(double), "uniforms", &du);
      !s.ok()) {
    return s;
  }
  const size_t id_bytes = static_cast<size_t>(rows) * sizeof(int32_t);
  if (absl::Status s = Allocate(id_bytes, "ids", &dids); !s.ok()) return s;
  // The device overload's stream-ordered scratch is freed on the default
  // stream before it returns; Finish's synchronise covers those frees too.
  if (absl::Status s = Sample(static_cast<const float*>(dlogits.get()), rows, vocab,
                              static_cast<const SamplingFilter*>(dfilters.get()),
                              static_cast<const double*>(du.get()),
                              static_cast<int32_t*>(dids.get()), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Finish("the sampling kernels"); !s.ok()) return s;
  return Download(ids, dids, id_bytes, "ids");
}

}  // namespace exl3serve::kernels::cuda
