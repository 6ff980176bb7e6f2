#include "worker/comm/reduce_sum.h"

#include "kernels/cpu/cpu_features.h"

namespace exl3serve::worker::comm {

namespace scalar {

void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    float acc = srcs[0][i];
    for (int s = 1; s < num_srcs; ++s) acc += srcs[s][i];
    dst[i] = acc;
  }
}

void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    float acc = BF16ToF32(srcs[0][i]);
    for (int s = 1; s < num_srcs; ++s) acc += BF16ToF32(srcs[s][i]);
    dst[i] = F32ToBF16(acc);
  }
}

}  // namespace scalar

void SumInOrder(CommDataType type, const void* const* srcs, int num_srcs, void* dst,
                size_t count) {
  using kernels::cpu::CpuIsa;
  const CpuIsa isa = kernels::cpu::ActiveCpuIsa();
  if (type == CommDataType::kF32) {
    const auto* s = reinterpret_cast<const float* const*>(srcs);
    auto* d = static_cast<float*>(dst);
    switch (isa) {
      case CpuIsa::kAvx512:
        return avx512::SumF32(s, num_srcs, d, count);
      case CpuIsa::kAvx2:
        return avx2::SumF32(s, num_srcs, d, count);
      case CpuIsa::kScalar:
        return scalar::SumF32(s, num_srcs, d, count);
    }
  } else {
    const auto* s = reinterpret_cast<const uint16_t* const*>(srcs);
    auto* d = static_cast<uint16_t*>(dst);
    switch (isa) {
      case CpuIsa::kAvx512:
        return avx512::SumBF16(s, num_srcs, d, count);
      case CpuIsa::kAvx2:
        return avx2::SumBF16(s, num_srcs, d, count);
      case CpuIsa::kScalar:
        return scalar::SumBF16(s, num_srcs, d, count);
    }
  }
}

}  // namespace exl3serve::worker::comm
