// kernels/cpu/dense16_gemm.cc — driver, scalar reference and dispatcher of
// Dense16GemmTransposed (contract and summation order: dense16_gemm.h).
#include "kernels/cpu/dense16_gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels::cpu {

namespace internal {

void Dense16ToFloatScalar(const uint16_t* src, Dense16Type type, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    if (type == Dense16Type::kBf16) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, sizeof bits);
    } else {
      dst[i] = HalfBitsToFloat(src[i]);
    }
  }
}

}  // namespace internal

void Dense16ToFloat(const uint16_t* src, Dense16Type type, int64_t count, float* dst) {
#if defined(__x86_64__) || defined(__i386__)
  if (count >= 8 && ActiveCpuIsa() != CpuIsa::kScalar) {
    avx2::Dense16ToFloat(src, type, count, dst);
    return;
  }
#endif
  internal::Dense16ToFloatScalar(src, type, count, dst);
}

void FloatToDense16(const float* src, Dense16Type type, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; ++i) {
    if (type == Dense16Type::kF16) {
      dst[i] = FloatToHalfBits(src[i]);
      continue;
    }
    uint32_t bits;
    std::memcpy(&bits, &src[i], sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: keep sign, quiet
      dst[i] = static_cast<uint16_t>((bits >> 16) | 0x0040u);
      continue;
    }
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
}

namespace scalar {

void Dense16Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1) {
  const int64_t chunks = (p.k + 15) / 16;
  float wrow[16], acc[16];
  for (int64_t o = o0; o < o1; ++o) {
    const uint16_t* w = p.w + o * p.k;
    for (int64_t i = 0; i < p.m; ++i) {
      const float* x = p.x + i * p.k;
      std::fill(acc, acc + 16, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t j0 = c * 16;
        const int64_t len = std::min<int64_t>(16, p.k - j0);
        Dense16ToFloat(w + j0, p.type, len, wrow);
        for (int64_t l = 0; l < 16; ++l) {
          const float xv = l < len ? x[j0 + l] : 0.0f;
          const float wv = l < len ? wrow[l] : 0.0f;
          acc[l] = std::fma(xv, wv, acc[l]);
        }
      }
      float s8[8], s4[4], s2[2];
      for (int l = 0; l < 8; ++l) s8[l] = acc[l] + acc[l + 8];
      for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
      for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
      const float s = s2[0] + s2[1];
      p.y[i * p.n + o] = p.bias != nullptr ? s + p.bias[o] : s;
    }
  }
}

}  // namespace scalar

namespace {

using ColumnsFn = void (*)(const internal::Dense16Problem&, int64_t, int64_t);

ColumnsFn ChooseVariant() {
#if defined(__x86_64__) || defined(__i386__)
  switch (ActiveCpuIsa()) {
    case CpuIsa::kAvx512:
      return &avx512::Dense16Columns;
    case CpuIsa::kAvx2:
      return &avx2::Dense16Columns;
    case CpuIsa::kScalar:
      break;
  }
#endif
  return &scalar::Dense16Columns;
}

std::atomic<ColumnsFn> g_variant{nullptr};
std::atomic<uint64_t> g_variant_generation{~uint64_t{0}};

ColumnsFn Variant() {
  const uint64_t generation = CpuIsaOverrideGeneration();
  ColumnsFn fn = g_variant.load(std::memory_order_acquire);
  if (fn == nullptr || g_variant_generation.load(std::memory_order_acquire) != generation) {
    fn = ChooseVariant();
    g_variant.store(fn, std::memory_order_release);
    g_variant_generation.store(generation, std::memory_order_release);
  }
  return fn;
}

// Outputs per task: a w panel of ~256 KiB (stays in L2 while the rows of x
// pass over it), a multiple of 12 (both variants' register blocks), 12..96.
int64_t OutputsPerTask(int64_t k) {
  const int64_t by_cache = (int64_t{256} << 10) / std::max<int64_t>(1, 2 * k);
  return std::clamp<int64_t>(by_cache / 12 * 12, 12, 96);
}

}  // namespace

void Dense16GemmTransposed(const float* x, int64_t m, int64_t k, const uint16_t* w,
                           Dense16Type type, int64_t n, const float* bias, float* y,
                           int max_threads) {
  if (m <= 0 || n <= 0) return;
  const internal::Dense16Problem problem{x, m, k, w, type, n, bias, y};
  const ColumnsFn fn = Variant();
  const int64_t per_task = OutputsPerTask(k);
  const int64_t tasks = (n + per_task - 1) / per_task;
  SharedThreadPool().ParallelFor(tasks, max_threads, [&](int64_t task, int) {
    const int64_t o0 = task * per_task;
    fn(problem, o0, std::min(n, o0 + per_task));
  });
}

}  // namespace exl3serve::kernels::cpu
