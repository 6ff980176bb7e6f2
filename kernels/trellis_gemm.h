// kernels/trellis_gemm.h — y = x · W_eff + bias for one EXL3 linear, the
// product at the heart of every forward (token generation = GEMV, m = 1..16;
// prefill = GEMM, m up to thousands). Backend-neutral contract; the CPU
// implementations live in kernels/cpu/, the CUDA twin in kernels/cuda/.
//
// Orientation is EXL3's (exl3-format.md §5): x is m x k row-major (k = the
// layer's padded in_features), y is m x n row-major, W_eff = diag(suh) · B_k ·
// W_h · B_n · diag(svh). The transforms are fused into the call in the order
// of §5.3 (x' = (x ⊙ suh)·B_k; y' = x'·W_h; y = (y'·B_n) ⊙ svh + bias); no
// dense weight is materialised for small m.
//
// Exactness: the trellis decode is bit-exact (same fp16 W_h as
// kernels/reconstruct.h); products are within fp32 accumulation error of
// kernels::ReferenceForward (tolerances in tests/kernels/trellis_gemm_test.cc).
// Results are deterministic and bitwise identical for any thread count: work
// is split over 128-wide output column blocks, and each block's accumulation
// order is fixed by the kernel variant, never by the scheduling.
//
//   TrellisGemmOptions options;                 // defaults: all threads, best ISA
//   EXL3_RETURN_IF_ERROR(TrellisGemm(view, x, m, y, options));
//
// Thread safety: thread-safe (pure function of its arguments; uses the shared
// process thread pool, kernels/cpu/thread_pool.h).
#ifndef EXL3SERVE_KERNELS_TRELLIS_GEMM_H_
#define EXL3SERVE_KERNELS_TRELLIS_GEMM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/reconstruct.h"

namespace exl3serve::kernels {

// How the activations enter the inner product.
enum class TrellisGemmPrecision {
  kFloat,  // fp32 activations and accumulation (the default)
  kInt8,   // mul1 only: int8 activations with a scale per row and 128-row block
           // of k, integer byte-sum dot products (§9 "int8 path"), per block b
           // y'_b = scale_b·(A·Σ_b t·x_int + C·Σ_b x_int), A = 1774·2^-18,
           // C = -905216·2^-18 (mul1 without its fp16 rounding), y' = Σ_b y'_b
           // summed in fp32 over ascending b. A block's int8 values depend on
           // that block's 128 inputs only, so a rank holding a range of blocks
           // of a row-parallel linear (every TP split is by whole 128-blocks)
           // computes exactly the terms the whole linear would: tensor
           // parallelism changes only the fp32 summation order, as in kFloat.
           // Not bit-comparable to kFloat (measured 0.8-0.9 % RMS of the output for
           // Gaussian x, K=2..4, 4096x1024;
           // bound in tests/kernels/trellis_gemm_test.cc), but bit-identical
           // across ISA variants and thread counts (integer sums are exact).
  kBf16,   // any codebook, meant for prefill (large m): W_h (fp16) and x' rounded
           // to bf16 (RNE; bf16 values below 2^-126 flushed to ±0), exact
           // bf16·bf16 products, fp32 accumulation over ascending k in pairs
           // (row 2j+1 then 2j, each add RNE, partial sums below 2^-126 flushed
           // to ±0): the arithmetic of AVX512-BF16 vdpbf16ps, which runs it where
           // the CPU has it; every other variant emulates it bit for bit. CPUs
           // with AMX-BF16 (and the kernel's permission) run TDPBF16PS instead,
           // which sums in its own order: within fp32 accumulation error of that
           // arithmetic, not bit-equal (kernels/cpu/README.md). Measured on the
           // 2-vCPU Xeon: AMX 3.1x the kFloat GEMM per core at m = 512; the
           // vdpbf16ps and emulated paths are slower than kFloat there.
           // Error vs kFloat: each factor's relative rounding error <= 2^-9, so
           // measured RMS error 0.24 % (mul1) / 0.29-0.30 % (3inst, mcg) of the
           // natural output size ||x ⊙ suh||·|svh| for Gaussian x, K=2..4,
           // k = 1024 (fp32 path: 6e-5 %); bounds in trellis_gemm_test.cc.
           // Deterministic and bit-identical for any thread count.
};

struct TrellisGemmOptions {
  int max_threads = 0;  // 0 = the whole shared pool; 1 = calling thread only
  TrellisGemmPrecision precision = TrellisGemmPrecision::kFloat;
};

// y = x · W_eff + bias (bias skipped when view.bias is null).
// Errors: those of ValidateExl3LinearView; InvalidArgument for m < 0, a null
// x with m·k > 0 or null y with m·n > 0, or kInt8 with a codebook other than
// mul1. On error y is untouched. kBf16 is valid for any m but only pays off
// for large m (the decode is amortised over a bf16 GEMM); small m runs the
// same arithmetic without the register GEMV. Requires: y does not alias x; x has m·k, y m·n floats.
// Cost: O(m·k·n) FLOPs plus one trellis decode per weight per call for small
// m (decode amortised over a blocked GEMM for large m); allocates O(m·(k+n))
// scratch per call.
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options = {});

// The per-ISA variants behind the dispatcher, same contract (kernels/cpu/).
// The dispatcher picks one through kernels::cpu::ActiveCpuIsa(); tests call
// them directly. Calling a variant the CPU lacks is undefined (check
// kernels::cpu::CpuSupportsIsa first).
namespace cpu::scalar {
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options = {});
}  // namespace cpu::scalar
namespace cpu::avx2 {
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options = {});
}  // namespace cpu::avx2
namespace cpu::avx512 {
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options = {});
}  // namespace cpu::avx512

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_TRELLIS_GEMM_H_
