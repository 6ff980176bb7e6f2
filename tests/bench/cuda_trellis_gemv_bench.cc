// CUDA trellis GEMV throughput (kernels/cuda/trellis_gemm.h) against the
// device's own ceilings, measured in the same run:
//   - copy bandwidth: cudaMemcpy device-to-device of a 1 GiB buffer, counted
//     as (read + write bytes) / time, i.e. the DRAM throughput a copy reaches;
//   - cuBLAS fp16 GEMV/GEMM (cublasGemmEx, fp16 W and x, fp32 compute and
//     output) with m = batch on the same shape.
// Every call reads its weights from DRAM, not L2: weight copies totalling
// >= 256 MiB (H200 L2: 50 MiB) are cycled, one per call. Times are per
// call (input transform + GEMV + output transform, scratch from the stream
// pool), from CUDA events around --repeats calls after 3 warm-up calls.
//
// Columns: us = time per call; GB/s = packed trellis bytes (k·n·K/8) per
// second; %copy = GB/s over the copy bandwidth; cuBLAS us / GB/s = the fp16
// dense product's time and fp16 weight bytes (k·n·2) per second; x = cuBLAS
// time / our time (> 1: we are faster).
//
//   cuda_trellis_gemv_bench            # 8192x8192 and 8192x28672, K = 2,3,4,6, batch 1,4,16
//   cuda_trellis_gemv_bench --quick    # 8192x8192, K = 2,4, batch 1
//   cuda_trellis_gemv_bench --codebook=mcg --repeats=50
//
// Without a device it prints "no CUDA device: ... skipped" and exits 0.
// Exit status 1 when a call fails (the error is printed).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/trellis_gemm.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_lut.h"

namespace kernels = exl3serve::kernels;
namespace cuda = exl3serve::kernels::cuda;

namespace {

constexpr int64_t kCycleBytes = int64_t{256} << 20;
constexpr int64_t kCopyBytes = int64_t{1} << 30;
constexpr int kWarmup = 3;

struct Options {
  std::vector<std::pair<int64_t, int64_t>> shapes = {{8192, 8192}, {8192, 28672}};
  std::vector<int> ks = {2, 3, 4, 6};
  std::vector<int64_t> batches = {1, 4, 16};
  kernels::Codebook codebook = kernels::Codebook::kMul1;
  int repeats = 30;
};

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "error: %s: %s (%d): %s\n", what, cudaGetErrorName(e), static_cast<int>(e),
               cudaGetErrorString(e));
  return false;
}

bool Check(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return true;
  std::fprintf(stderr, "error: %s: %s\n", what, cublasGetStatusString(e));
  return false;
}

bool Check(const absl::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "error: %s: %s\n", what, std::string(s.ToString()).c_str());
  return false;
}

// Milliseconds per iteration of fn(i) over `repeats` iterations, after warm-up.
template <typename Fn>
bool TimeCalls(int repeats, Fn fn, double* ms_per_call) {
  for (int i = 0; i < kWarmup; ++i) {
    if (!fn(i)) return false;
  }
  cudaEvent_t start, stop;
  if (!Check(cudaEventCreate(&start), "cudaEventCreate")) return false;
  if (!Check(cudaEventCreate(&stop), "cudaEventCreate")) return false;
  bool ok = Check(cudaEventRecord(start), "cudaEventRecord");
  for (int i = 0; ok && i < repeats; ++i) ok = fn(kWarmup + i);
  ok = ok && Check(cudaEventRecord(stop), "cudaEventRecord") &&
       Check(cudaEventSynchronize(stop), "running the timed calls");
  float ms = 0;
  ok = ok && Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  *ms_per_call = ms / repeats;
  return ok;
}

double CopyBandwidth(int repeats) {
  void* a = nullptr;
  void* b = nullptr;
  if (!Check(cudaMalloc(&a, kCopyBytes), "allocating the copy source") ||
      !Check(cudaMalloc(&b, kCopyBytes), "allocating the copy target")) {
    return 0;
  }
  cudaMemset(a, 1, kCopyBytes);
  double ms = 0;
  const bool ok = TimeCalls(std::max(5, repeats / 3), [&](int) {
    return Check(cudaMemcpyAsync(b, a, kCopyBytes, cudaMemcpyDeviceToDevice), "copy");
  }, &ms);
  cudaFree(a);
  cudaFree(b);
  return ok ? 2.0 * kCopyBytes / (ms * 1e-3) : 0;
}

// Fast deterministic fill (any 16-bit words are a valid trellis).
void FillRandom(std::vector<uint16_t>& v, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < v.size(); i += 4) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    for (size_t j = 0; j < 4 && i + j < v.size(); ++j) v[i + j] = static_cast<uint16_t>(s >> (16 * j));
  }
}

bool ParseArgs(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.shapes = {{8192, 8192}};
      o.ks = {2, 4};
      o.batches = {1};
      o.repeats = 10;
    } else if (a.rfind("--codebook=", 0) == 0) {
      if (!kernels::ParseCodebookName(a.substr(11), &o.codebook)) return false;
    } else if (a.rfind("--repeats=", 0) == 0) {
      o.repeats = std::max(1, std::atoi(a.c_str() + 10));
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: cuda_trellis_gemv_bench [--quick] [--codebook=mul1|mcg|3inst] "
                 "[--repeats=30]\n");
    return 2;
  }
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) {
    std::printf("%s: cuda_trellis_gemv_bench skipped\n", std::string(s.message()).c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  if (!Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return 1;
  std::printf("device: %s, %d SMs, %.1f GiB, L2 %.0f MiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1073741824.0, prop.l2CacheSize / 1048576.0);
  const double copy_bw = CopyBandwidth(o.repeats);
  if (copy_bw <= 0) return 1;
  std::printf("copy bandwidth (cudaMemcpy D2D 1 GiB, read+write): %.1f GB/s\n", copy_bw * 1e-9);
  std::printf("codebook %s; untuned launch constants (kernels/cuda/trellis_gemm.cu)\n\n",
              kernels::CodebookName(o.codebook));

  cublasHandle_t handle = nullptr;
  if (!Check(cublasCreate(&handle), "cublasCreate")) return 1;
  std::printf("%-12s %2s %5s %10s %9s %7s %12s %12s %7s\n", "shape", "K", "batch", "us", "GB/s",
              "%copy", "cuBLAS16 us", "cuBLAS GB/s", "x");
  bool ok = true;
  for (const auto& [k, n] : o.shapes) {
    // cuBLAS fp16 weights: enough copies to exceed 256 MiB.
    const int64_t w16_bytes = k * n * 2;
    const int w16_copies = static_cast<int>(std::max<int64_t>(1, (kCycleBytes + w16_bytes - 1) / w16_bytes));
    std::vector<void*> w16(static_cast<size_t>(w16_copies), nullptr);
    for (auto& p : w16) {
      ok = ok && Check(cudaMalloc(&p, w16_bytes), "allocating fp16 weights") &&
           Check(cudaMemset(p, 0x3C, w16_bytes), "filling fp16 weights");
    }
    const int64_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    void* x16 = nullptr;
    float* x = nullptr;
    float* y = nullptr;
    ok = ok && Check(cudaMalloc(&x16, max_batch * k * 2), "allocating x16") &&
         Check(cudaMemset(x16, 0x3C, max_batch * k * 2), "filling x16") &&
         Check(cudaMalloc(reinterpret_cast<void**>(&x), max_batch * k * 4), "allocating x") &&
         Check(cudaMemset(x, 0x3F, max_batch * k * 4), "filling x") &&
         Check(cudaMalloc(reinterpret_cast<void**>(&y), max_batch * n * 4), "allocating y");
    for (int bits : o.ks) {
      if (!ok) break;
      kernels::Exl3LinearData host;
      host.k = k;
      host.n = n;
      host.bits = bits;
      host.codebook = o.codebook;
      host.trellis.resize(static_cast<size_t>(k / 16 * n / 16 * 16 * bits));
      FillRandom(host.trellis, static_cast<uint64_t>(bits));
      host.suh.assign(static_cast<size_t>(k), 1.0f);
      host.svh.assign(static_cast<size_t>(n), 1.0f);
      const int64_t packed = static_cast<int64_t>(host.trellis.size()) * 2;
      const int copies = static_cast<int>(std::max<int64_t>(2, (kCycleBytes + packed - 1) / packed));
      std::vector<cuda::DeviceExl3Linear> weights;
      for (int c = 0; c < copies && ok; ++c) {
        absl::StatusOr<cuda::DeviceExl3Linear> w = cuda::DeviceExl3Linear::Upload(host.view());
        ok = Check(w.status(), "uploading weights");
        if (ok) weights.push_back(std::move(*w));
      }
      for (int64_t batch : o.batches) {
        if (!ok) break;
        double ms = 0;
        ok = TimeCalls(o.repeats, [&](int i) {
          return Check(cuda::TrellisGemm(weights[static_cast<size_t>(i) % weights.size()], x, batch,
                                         y, nullptr),
                       "cuda::TrellisGemm");
        }, &ms);
        double ms16 = 0;
        const float one = 1.0f;
        const float zero = 0.0f;
        ok = ok && TimeCalls(o.repeats, [&](int i) {
          return Check(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n),
                                    static_cast<int>(batch), static_cast<int>(k), &one,
                                    w16[static_cast<size_t>(i) % w16.size()], CUDA_R_16F,
                                    static_cast<int>(n), x16, CUDA_R_16F, static_cast<int>(k),
                                    &zero, y, CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
        }, &ms16);
        if (!ok) break;
        const double gbs = packed / (ms * 1e-3) * 1e-9;
        const std::string shape = std::to_string(k) + "x" + std::to_string(n);
        std::printf("%-12s %2d %5lld %10.1f %9.1f %6.1f%% %12.1f %12.1f %7.2f\n", shape.c_str(),
                    bits, static_cast<long long>(batch), ms * 1e3, gbs, 100.0 * gbs / (copy_bw * 1e-9),
                    ms16 * 1e3, w16_bytes / (ms16 * 1e-3) * 1e-9, ms16 / ms);
        std::fflush(stdout);
      }
    }
    for (void* p : w16) cudaFree(p);
    cudaFree(x16);
    cudaFree(x);
    cudaFree(y);
  }
  cublasDestroy(handle);
  ok = ok && Check(cudaDeviceSynchronize(), "final synchronize");
  return ok ? 0 : 1;
}
