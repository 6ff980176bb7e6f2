// kernels/cpu/trellis_gemm_bf16_avx512bf16.cc — the kBf16 micro-kernel of
// TrellisGemm on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4).
// Compiled with AVX-512 + -mavx512bf16 (name suffix _avx512bf16.cc, top-level
// exl3_isa_flags); never included elsewhere. Called by the AVX-512 variant
// (trellis_gemm_avx512.cc) on a 128-row x 64-column bf16 panel it decoded.
//
// Register tile: kBf16RowGroup (6) rows x 64 columns = 24 zmm accumulators
// + 4 zmm of weights. Per k pair (two rows of W_h):
//   4 zmm loads of the panel (64 columns x 2 rows, bf16 pairs)
//   6 vdpbf16ps per column vector, activation pair as an embedded {1to16}
//     broadcast memory operand (the row group's 6 words are contiguous)
//   = 24 vdpbf16ps (1536 FLOP) + 4 loads + 6 broadcast loads per step:
//   ~0.016 uops per FLOP vs 0.031 for the fp32 6x64 FMA kernel (24 FMA =
//   768 FLOP per step); the panel is half the bytes (16 KB per 64 columns
//   at kc = 128: L1-resident).
// Accumulation per output: ascending k pairs, each vdpbf16ps adds the odd
// row's product then the even row's (checked on hardware; the scalar
// reference in trellis_gemm.cc does exactly this).
#include <immintrin.h>

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cpuid.h>

#include <algorithm>
#include <atomic>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/trellis_gemm_internal.h"

namespace exl3serve::kernels::cpu::avx512bf16 {
namespace {

constexpr int kPanel = 64;

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_amx_enabled{true};

// CPUID AMX-TILE + AMX-BF16, XCR0 tile state (bits 17, 18), then ask Linux
// for the XTILEDATA permission (ARCH_REQ_XCOMP_PERM = 0x1023, feature 18):
// without it the first tile instruction would fault.
bool DetectAmx() {
#if defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !((c1 >> 27) & 1)) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

// Palette 1, tiles 0-3 = C (16 x 16 fp32), 4-5 = A (16 rows x 32 bf16),
// 6-7 = B (16 pairs x 16 columns): every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

template <int kMr>
void Micro(const uint32_t* x, const uint32_t* panel, int kc, float* y, int64_t ldy, bool first) {
  __m512 acc[kMr][4];
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy + 16 * j);
    }
  }
  const int pairs = kc / 2;
  for (int p = 0; p < pairs; ++p) {
    const uint32_t* w = panel + p * kPanel;
    const __m512bh b0 = (__m512bh)_mm512_load_si512(w);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(w + 16);
    const __m512bh b2 = (__m512bh)_mm512_load_si512(w + 32);
    const __m512bh b3 = (__m512bh)_mm512_load_si512(w + 48);
    const uint32_t* xp = x + p * internal::kBf16RowGroup;
    for (int i = 0; i < kMr; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, b2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], a, b3);
    }
  }
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
  }
}

using MicroFn = void (*)(const uint32_t*, const uint32_t*, int, float*, int64_t, bool);
constexpr MicroFn kMicro[internal::kBf16RowGroup + 1] = {nullptr, Micro<1>, Micro<2>, Micro<3>,
                                                         Micro<4>, Micro<5>, Micro<6>};
static_assert(internal::kBf16RowGroup == 6, "kMicro lists one kernel per row count");

}  // namespace

bool Supported() {
  const CpuFeatures& f = GetCpuFeatures();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512bf16;
}

void SetEnabledForTest(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

bool Enabled() { return g_enabled.load(std::memory_order_relaxed) && Supported(); }

bool AmxSupported() {
  static const bool supported = DetectAmx();
  return supported;
}

void SetAmxEnabledForTest(bool enabled) { g_amx_enabled.store(enabled, std::memory_order_relaxed); }

bool AmxEnabled() { return g_amx_enabled.load(std::memory_order_relaxed) && AmxSupported(); }

// Per 32 rows x 32 columns x 32 k: 2 A + 2 B tile loads (4 KB) + 4
// TDPBF16PS (each 16x16x32 MACs = 16 K FLOP; 64 K FLOP per step); the C tiles
// stay in registers over kSub/32 steps.
template <int kSub, bool kRowsOuter>
void AmxChunkT(const uint16_t* x, int64_t k, int64_t rows, const uint32_t* panels,
               int64_t panel_words, int kc, float* acc) {
  constexpr int64_t kTileStride = 64;  // A tiles are 1 KB contiguous
  const int64_t block16 = (k / 32) * 512;  // elements per 16-row block
  constexpr int64_t kAccStride = 128 * sizeof(float);
  constexpr int64_t kPanelStride = kPanel * sizeof(uint32_t);
  auto step = [&](int64_t r0, int cg, int k_lo, int k_hi) {
    float* c = acc + r0 * 128 + 32 * cg;
    const uint32_t* w = panels + (cg / 2) * panel_words + 32 * (cg % 2);
    _tile_loadd(0, c, kAccStride);
    _tile_loadd(1, c + 16, kAccStride);
    _tile_loadd(2, c + 16 * 128, kAccStride);
    _tile_loadd(3, c + 16 * 128 + 16, kAccStride);
    for (int kk = k_lo; kk < k_hi; kk += 32) {
      const uint16_t* a = x + (r0 / 16) * block16 + (kk / 32) * 512;
      const uint32_t* b = w + (kk / 2) * kPanel;
      _tile_loadd(4, a, kTileStride);
      _tile_loadd(5, a + block16, kTileStride);
      _tile_loadd(6, b, kPanelStride);
      _tile_loadd(7, b + 16, kPanelStride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, kAccStride);
    _tile_stored(1, c + 16, kAccStride);
    _tile_stored(2, c + 16 * 128, kAccStride);
    _tile_stored(3, c + 16 * 128 + 16, kAccStride);
  };
  for (int k_lo = 0; k_lo < kc; k_lo += kSub) {
    const int k_hi = std::min(kc, k_lo + kSub);
    if constexpr (kRowsOuter) {
      for (int64_t r0 = 0; r0 < rows; r0 += internal::kBf16AmxRows)
        for (int cg = 0; cg < 4; ++cg) step(r0, cg, k_lo, k_hi);
    } else {
      for (int cg = 0; cg < 4; ++cg)
        for (int64_t r0 = 0; r0 < rows; r0 += internal::kBf16AmxRows) step(r0, cg, k_lo, k_hi);
    }
  }
}

void AmxChunk(const uint16_t* x, int64_t k, int64_t rows, const uint32_t* panels,
              int64_t panel_words, int kc, float* acc) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  // Measured (4096x4096, m = 512, 1 thread, CPU time under load): kSub
  // 512/256/128 with rows outer and 512/256 with column groups outer all
  // within 56-62 ms per call; this kernel is ~22 ms of it (perf), the rest is
  // decode + bf16 packing (~21 ms) and the Hadamard transforms (~12 ms).
  AmxChunkT<512, true>(x, k, rows, panels, panel_words, kc, acc);
  _tile_release();
}

void MicroKernel(int rows, const uint32_t* x, const uint32_t* panel, int kc, float* y,
                 int64_t ldy, bool first) {
  kMicro[rows](x, panel, kc, y, ldy, first);
}

}  // namespace exl3serve::kernels::cpu::avx512bf16
