#include "kernels/cpu/cpu_features.h"

#include <atomic>
#include <string>


#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define EXL3_CPU_X86 1
#endif

namespace exl3serve::kernels::cpu {
namespace {

#if defined(EXL3_CPU_X86)
// XGETBV(0) without requiring -mxsave for this file. Only valid when
// CPUID.1:ECX.OSXSAVE is set.
uint64_t ReadXcr0() {
  uint32_t eax = 0;
  uint32_t edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(EXL3_CPU_X86)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  const unsigned max_leaf = eax;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1;
  const bool avx = (ecx >> 28) & 1;
  const bool fma = (ecx >> 12) & 1;
  const bool f16c = (ecx >> 29) & 1;
  if (osxsave && avx) {
    const uint64_t xcr0 = ReadXcr0();
    f.os_saves_ymm = (xcr0 & 0x6) == 0x6;
    f.os_saves_zmm = f.os_saves_ymm && (xcr0 & 0xE0) == 0xE0;
  }
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const unsigned leaf7_max_subleaf = eax;
  if (f.os_saves_ymm) {
    f.avx2 = (ebx >> 5) & 1;
    f.fma = fma;
    f.f16c = f16c;
  }
  f.bmi2 = (ebx >> 8) & 1;  // scalar instructions, no register-state requirement
  if (f.os_saves_zmm) {
    f.avx512f = (ebx >> 16) & 1;
    f.avx512dq = (ebx >> 17) & 1;
    f.avx512bw = (ebx >> 30) & 1;
    f.avx512vl = (ebx >> 31) & 1;
    f.avx512vnni = (ecx >> 11) & 1;
    f.avx512fp16 = (edx >> 23) & 1;
    if (leaf7_max_subleaf >= 1) {
      unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
      __cpuid_count(7, 1, a1, b1, c1, d1);
      f.avx512bf16 = (a1 >> 5) & 1;
    }
  }
#endif
  return f;
}

std::atomic<int> g_override{-1};  // -1: none, else static_cast<int>(CpuIsa)
std::atomic<uint64_t> g_generation{0};

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool CpuSupportsIsa(CpuIsa isa) {
  const CpuFeatures& f = GetCpuFeatures();
  const bool avx2 = f.avx2 && f.fma && f.f16c && f.bmi2;
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kAvx512:
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  }
  return false;
}

CpuIsa BestCpuIsa() {
  if (CpuSupportsIsa(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupportsIsa(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kScalar:
    default:
      return "scalar";
  }
}

absl::StatusOr<std::optional<CpuIsa>> ParseCpuIsa(std::string_view name) {
  if (name == "auto") return std::optional<CpuIsa>();
  if (name == "scalar") return std::optional<CpuIsa>(CpuIsa::kScalar);
  if (name == "avx2") return std::optional<CpuIsa>(CpuIsa::kAvx2);
  if (name == "avx512") return std::optional<CpuIsa>(CpuIsa::kAvx512);
  // (Debian's Abseil has its own string_view type, so plain std::string here.)
  return absl::InvalidArgumentError("kernels.cpu_isa must be one of auto|scalar|avx2|avx512, got \"" +
                                    std::string(name) + "\"");
}

absl::Status SetCpuIsaOverride(std::optional<CpuIsa> isa) {
  if (isa.has_value() && !CpuSupportsIsa(*isa)) {
    return absl::UnimplementedError("kernels.cpu_isa: this CPU cannot run " +
                                    std::string(CpuIsaName(*isa)) + " (best is " +
                                    std::string(CpuIsaName(BestCpuIsa())) + ")");
  }
  g_override.store(isa.has_value() ? static_cast<int>(*isa) : -1, std::memory_order_release);
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  return absl::OkStatus();
}

CpuIsa ActiveCpuIsa() {
  const int o = g_override.load(std::memory_order_acquire);
  return o < 0 ? BestCpuIsa() : static_cast<CpuIsa>(o);
}

uint64_t CpuIsaOverrideGeneration() { return g_generation.load(std::memory_order_acquire); }

}  // namespace exl3serve::kernels::cpu
