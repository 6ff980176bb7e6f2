// kernels/cpu/cpu_features.h — which x86 SIMD level the CPU kernels may use.
//
// Detects the CPU's features once (CPUID) together with the operating
// system's consent to use the wide registers (XGETBV: the OS must save YMM
// state for AVX2 and opmask/ZMM state for AVX-512, otherwise the instructions
// fault even though CPUID lists them). Kernels with per-ISA variants pick one
// through ActiveCpuIsa(): the best level the machine supports, unless a
// process-wide override pins another one (tests, bug reports; the config
// loader maps `kernels.cpu_isa: auto|scalar|avx2|avx512` onto it).
//
//   const CpuFeatures& f = GetCpuFeatures();
//   EXL3_RETURN_IF_ERROR(SetCpuIsaOverride(CpuIsa::kScalar));   // pin a path
//   switch (ActiveCpuIsa()) { ... }
//
// Nothing here reads the environment. Thread safety: all functions are
// thread-safe; the override is a process-wide atomic (set it before starting
// work — kernels that cache a choice re-check CpuIsaOverrideGeneration()).
#ifndef EXL3SERVE_KERNELS_CPU_CPU_FEATURES_H_
#define EXL3SERVE_KERNELS_CPU_CPU_FEATURES_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::kernels::cpu {

// The SIMD levels kernels are written for. kAvx2 means AVX2+FMA+F16C+BMI2;
// kAvx512 means AVX-512 F/BW/VL/DQ on top of kAvx2. Ordered: a higher level
// implies every lower one.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Raw feature bits; a bit is true only if the CPU reports it AND (for the
// AVX/AVX-512 families) the OS has enabled the register state in XCR0.
struct CpuFeatures {
  bool os_saves_ymm = false;  // XCR0 bits 1,2 (SSE, AVX state)
  bool os_saves_zmm = false;  // XCR0 bits 5,6,7 (opmask, ZMM_Hi256, Hi16_ZMM)
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool bmi2 = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avx512fp16 = false;
};

// Detected once on first call; never changes afterwards.
const CpuFeatures& GetCpuFeatures();

// True when the machine can run kernels of level `isa` (kScalar: always).
bool CpuSupportsIsa(CpuIsa isa);

// The highest level the machine supports.
CpuIsa BestCpuIsa();

// "scalar" / "avx2" / "avx512".
std::string_view CpuIsaName(CpuIsa isa);

// Parses "auto" (-> nullopt), "scalar", "avx2" or "avx512".
// InvalidArgument naming the value for anything else.
absl::StatusOr<std::optional<CpuIsa>> ParseCpuIsa(std::string_view name);

// Pins every dispatcher to `isa` (nullopt: back to BestCpuIsa()).
// Unimplemented (and no change) if the machine lacks `isa`.
absl::Status SetCpuIsaOverride(std::optional<CpuIsa> isa);

// The override if set, otherwise BestCpuIsa().
CpuIsa ActiveCpuIsa();

// Increments on every successful SetCpuIsaOverride, so a dispatcher that
// cached a function pointer knows when to choose again.
uint64_t CpuIsaOverrideGeneration();

}  // namespace exl3serve::kernels::cpu

#endif  // EXL3SERVE_KERNELS_CPU_CPU_FEATURES_H_
