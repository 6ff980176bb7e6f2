// kernels/cpu/dense16_gemm.h — y = x · Wᵀ (+ bias) for a plain weight held
// in 16 bits (bf16 or fp16), fp32 activations and accumulation. The weight is
// converted to fp32 in registers (bf16: a 16-bit shift; fp16: F16C
// vcvtph2ps), so a bf16/fp16 checkpoint's lm_head or linears are held and
// streamed at 2 bytes per weight instead of 4.
//
//   cpu::Dense16GemmTransposed(x, m, k, w, cpu::Dense16Type::kBf16, n, bias, y);
//
// Summation order (the contract every variant keeps, so scalar, AVX2 and
// AVX-512 give bitwise identical results): output (i, o) is the sum over k of
// x[i][j]·w[o][j] in 16 lanes, lane l accumulating j ≡ l (mod 16) in
// ascending j with one fused multiply-add each (the last partial chunk of 16
// is zero-padded: fma(0, 0, acc)); then lanes are combined as
// s8[l] = a[l] + a[l+8], s4[l] = s8[l] + s8[l+4], s2[l] = s4[l] + s4[l+2],
// s = s2[0] + s2[1]; then + bias[o]. Each output depends only on its own row
// of w and row of x, so results do not depend on m, the thread count or the
// blocking.
//
// Work split: one thread-pool task per block of output columns (a panel of w
// of about 256 KiB, L2-resident while every row of x passes over it); inside
// a task register blocks of up to 4 rows x 4 outputs (AVX-512) / 2 x 3 (AVX2)
// stream each weight once per block of rows — decode (m <= 4) reads w once.
// Dispatch: ActiveCpuIsa() (cpu_features.h), re-checked per
// CpuIsaOverrideGeneration(); variants in dense16_gemm_avx2.cc /
// dense16_gemm_avx512.cc, scalar reference in dense16_gemm.cc.
//
// Thread safety: thread-safe (no state besides the cached variant choice).
// Ownership: borrows every array for the duration of the call.
#ifndef EXL3SERVE_KERNELS_CPU_DENSE16_GEMM_H_
#define EXL3SERVE_KERNELS_CPU_DENSE16_GEMM_H_

#include <cstdint>

namespace exl3serve::kernels::cpu {

enum class Dense16Type { kBf16, kF16 };

// y[m x n] = x[m x k] · wᵀ + bias, w row-major [n][k] (HF orientation) of
// `type` bit patterns, bias[n] or nullptr, y row-major m x n. m, k, n >= 0
// (k == 0 gives bias or 0). Uses at most `max_threads` threads of the shared
// pool (<= 0: all). Requires: y does not alias x, w or bias. No allocation.
void Dense16GemmTransposed(const float* x, int64_t m, int64_t k, const uint16_t* w,
                           Dense16Type type, int64_t n, const float* bias, float* y,
                           int max_threads = 0);

// 16-bit pattern -> float, exact (bf16: << 16; fp16: every value incl.
// subnormals, Inf, NaN — signalling NaNs keep their bits too). Vectorized
// on AVX2 CPUs (integer ops, bit-identical to the scalar reference
// internal::Dense16ToFloatScalar on all 65 536 patterns); what the KV cache
// runs to read fp16 pages (worker/model/kv_cache.cc).
void Dense16ToFloat(const uint16_t* src, Dense16Type type, int64_t count, float* dst);
// float -> 16-bit pattern with round-to-nearest-even (bf16 NaN stays a
// quiet NaN). Exact (bit-identical round trip) for values that are
// representable in `type`, e.g. ones read from a tensor of that dtype.
void FloatToDense16(const float* src, Dense16Type type, int64_t count, uint16_t* dst);

namespace internal {
// The scalar reference of Dense16ToFloat (every CPU).
void Dense16ToFloatScalar(const uint16_t* src, Dense16Type type, int64_t count, float* dst);
// One task's work, shared by the variants: outputs [o0, o1) for all m rows.
struct Dense16Problem {
  const float* x;
  int64_t m;
  int64_t k;
  const uint16_t* w;
  Dense16Type type;
  int64_t n;
  const float* bias;
  float* y;
};
}  // namespace internal

namespace scalar {
void Dense16Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1);
}
namespace avx2 {
void Dense16Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1);
void Dense16ToFloat(const uint16_t* src, Dense16Type type, int64_t count, float* dst);
}
namespace avx512 {
void Dense16Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1);
}

}  // namespace exl3serve::kernels::cpu

#endif  // EXL3SERVE_KERNELS_CPU_DENSE16_GEMM_H_
