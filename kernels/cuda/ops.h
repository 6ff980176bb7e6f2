// kernels/cuda/ops.h — the CUDA twins of kernels/ops.h (RMSNorm, RoPE, paged
// decode and chunked prefill attention, argmax, sampling) and of
// kernels/hadamard.h's BlockHadamardRows (FWHT-128). Plain C++ (no CUDA
// headers), available only when EXL3_HAVE_CUDA=1.
//
//   // host memory in and out (tests, tools): upload, launch, download, sync
//   EXL3_RETURN_IF_ERROR(cuda::RmsNorm(x, rows, dim, w, eps, out));
//   // device memory, enqueued on `stream` (a cudaStream_t as void*; nullptr =
//   // the legacy default stream), returns after the launch (the GPU rank)
//   EXL3_RETURN_IF_ERROR(cuda::RmsNorm(d_x, rows, dim, d_w, eps, d_out, stream));
//
// Each op has two overloads:
// - host memory: the same arguments as the CPU op; the same argument checks
//   (kernels::internal::Validate*) run first and return the same
//   InvalidArgument before the device is touched; then FailedPrecondition
//   "no CUDA device: ..." without a device, ResourceExhausted when device
//   memory runs out, Internal for other CUDA errors (each names the step).
//   On a CUDA error the outputs are unspecified. Blocks until the result is
//   back in host memory; owns its device buffers for the call.
// - device memory (+ `void* stream`): every pointer (PagedKv's included) is
//   device memory; only the scalar arguments are checked (InvalidArgument as
//   above). Contents are not: a page id outside [0, num_pages), a length < 1
//   or beyond the page-table row makes that (token, head)'s output NaN
//   instead of reading out of bounds. Errors of the launch come back here;
//   errors while the kernel runs surface at the caller's next synchronise.
//
// Agreement with the CPU twins (what tests/kernels/cuda_ops_test.cc checks):
// - BlockHadamardRows: bit-identical (same butterfly order, _rn arithmetic).
// - RmsNorm: float64 sum of squares reduced as a tree, so inv may differ from
//   the CPU's by one fp32 ulp; ApplyRope: device float64 cos/sin (<= 2 ulp)
//   rounded to fp32, _rn arithmetic, so nearly always bit-identical.
// - Attention: within 1e-5 of the CPU (online softmax: per-warp running
//   max/sum, warps merged at the end, instead of the CPU's two passes).
// - ArgMax: identical (lowest id on ties). Sample: the same filters in float64
//   with a tree-ordered softmax sum; the same token except when u or a top-p
//   cut lies within rounding (~1e-12) of a boundary.
//
// Launch shapes (constants at the top of ops.cu; untuned, no GPU measured):
// - FWHT-128: one 128-thread block per 128-element chunk, butterflies in
//   shared memory. RMSNorm: one 256-thread block per row (block reduction).
//   RoPE: one thread per (token, pair), looping over heads.
// - Attention (decode and prefill share one kernel): one 128-thread block per
//   (query token, q head); each of its 4 warps takes every 4th key of the
//   token's visible range with an online softmax (lanes split head_dim,
//   head_dim <= 256), then the 4 partial (max, sum, acc) merge in shared
//   memory. No split-K across blocks: long contexts with few sequences use
//   few SMs (a split-K second pass is the next step, once measured).
// - Sampling: softmax per row (1024-thread block), a stable segmented radix
//   sort (CUB) of (p, id) descending, then per row one block applies top-k /
//   top-p (block scan over the sorted masses) / min-p and draws with u (block
//   scan in id order). Scratch is stream-ordered (cudaMallocAsync).
//
// Thread safety: thread-safe; host overloads use the legacy default stream
// and the calling thread's current device.
#ifndef EXL3SERVE_KERNELS_CUDA_OPS_H_
#define EXL3SERVE_KERNELS_CUDA_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/ops.h"

namespace exl3serve::kernels::cuda {

// Largest head_dim the attention kernel holds in registers.
inline constexpr int64_t kMaxAttentionHeadDim = 256;

// FWHT-128: x (rows x d, d a multiple of 128) <- x · B_d, as
// kernels::BlockHadamardRows. InvalidArgument for rows < 0, d < 0 or d % 128.
absl::Status BlockHadamardRows(float* x, int64_t rows, int64_t d);
absl::Status BlockHadamardRows(float* x, int64_t rows, int64_t d, void* stream);

absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out);
absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out, void* stream);

absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq);
absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq, void* stream);

// Also Unimplemented for head_dim > kMaxAttentionHeadDim or q_heads > 65535.
absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out);
absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out,
                             void* stream);

// The device overload also takes total_tokens = query_starts[num_seqs] (the
// caller knows it; reading it back would need a synchronise).
absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, const PagedKv& kv,
                              const AttentionParams& params, float* out);
absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, int64_t total_tokens,
                              const PagedKv& kv, const AttentionParams& params, float* out,
                              void* stream);

absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids);
absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, void* stream);

// Also InvalidArgument for rows · vocab > 2^31 − 1 (the sort's item count).
// The device overload does not check filters, uniforms or logits (NaN in a
// row gives some id in range); it allocates ~20 bytes per logit of
// stream-ordered scratch.
absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids);
absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids,
                    void* stream);

}  // namespace exl3serve::kernels::cuda

#endif  // EXL3SERVE_KERNELS_CUDA_OPS_H_
