// kernels/cuda/trellis_gemm.h — the CUDA twin of kernels/trellis_gemm.h:
// y = x · W_eff + bias for one EXL3 linear, on the device. Plain C++ (no CUDA
// headers), so tests and host code built without nvcc flags can call it.
// Available only when EXL3_HAVE_CUDA=1 (guard uses with #if EXL3_HAVE_CUDA).
//
//   // once, at load time: device copies of trellis/suh/svh/bias
//   EXL3_ASSIGN_OR_RETURN(cuda::DeviceExl3Linear w, cuda::DeviceExl3Linear::Upload(view));
//   // per forward, device pointers, enqueued on `stream` (a cudaStream_t)
//   EXL3_RETURN_IF_ERROR(cuda::TrellisGemm(w, d_x, m, d_y, stream));
//   // or, for tests: host in, host out, same signature as kernels::TrellisGemm
//   EXL3_RETURN_IF_ERROR(cuda::TrellisGemm(view, x, m, y));
//
// Same orientation, transforms and order as the CPU contract (§5.3):
//   1. x' = (x ⊙ suh)·B_k       prologue kernel, fp32 butterflies in natural
//                               order (bit-identical to the CPU input transform)
//   2. y' = x'·W_h              m <= kGemvMaxRows per pass: the fused trellis
//                               GEMV (decode in registers/shared memory with
//                               kernels/trellis_decode.h, fp32 accumulation,
//                               k split over blocks, partial sums combined in
//                               a fixed order); m >= kCublasMinRows: W_h decoded
//                               bit-exactly to fp32 in column slices + cuBLAS
//                               SGEMM (fp32 compute, no TF32)
//   3. y  = (y'·B_n) ⊙ svh + bias   epilogue kernel
// Exactness: the decode is bit-exact; products are within fp32 accumulation
// error of kernels::ReferenceForward (another summation order). Results are
// deterministic run to run on one device and launch configuration (no atomics).
//
// TrellisGemmPrecision::kInt8 (mul1 only): x' quantized per row to int8
// exactly like the CPU (scale max|x'|/127, RNE), Σ t·q accumulated in int32
// with dp4a on the bytes of state·0x83DCD12D, the CPU's epilogue op for op:
// the output equals the CPU kInt8 output bit for bit. It always runs the GEMV
// (in passes of kGemvMaxRows rows), whatever m.
// Not implemented yet: other precisions (Unimplemented); a tensor-core
// (mma.sync / fp16 cuBLAS) GEMM path.
#ifndef EXL3SERVE_KERNELS_CUDA_TRELLIS_GEMM_H_
#define EXL3SERVE_KERNELS_CUDA_TRELLIS_GEMM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_gemm.h"

namespace exl3serve::kernels::cuda {

// Rows handled by one pass of the fused GEMV (more rows run in passes of this
// many) and the row count from which the cuBLAS path is used instead.
// Untuned: to be measured on a GPU (tests/gpu/device_check.sh).
inline constexpr int64_t kGemvMaxRows = 8;
inline constexpr int64_t kCublasMinRows = 32;

// One EXL3 linear in device memory: device copies of the trellis, suh, svh
// and bias (if any), made once by Upload from a host view.
//
// Ownership: owns one device allocation (freed by the destructor, errors
// ignored); move-only. The device is the one current at Upload time.
// Thread safety: immutable after Upload; safe to use from several threads and
// streams at once (TrellisGemm only reads it).
class DeviceExl3Linear {
 public:
  // Copies the view's arrays to the current device (blocking).
  // Errors: those of ValidateExl3LinearView; FailedPrecondition "no CUDA
  // device: ..." without a device; ResourceExhausted (naming the bytes) when
  // device memory runs out; Internal for other CUDA errors.
  static absl::StatusOr<DeviceExl3Linear> Upload(const Exl3LinearView& view);

  DeviceExl3Linear() = default;  // empty (k = n = 0, no storage)
  DeviceExl3Linear(DeviceExl3Linear&& other) noexcept;
  DeviceExl3Linear& operator=(DeviceExl3Linear&& other) noexcept;
  DeviceExl3Linear(const DeviceExl3Linear&) = delete;
  DeviceExl3Linear& operator=(const DeviceExl3Linear&) = delete;
  ~DeviceExl3Linear();

  // Shape and format, with DEVICE pointers (valid while this object lives);
  // never dereference them on the host.
  const Exl3LinearView& device_view() const { return view_; }
  int device() const { return device_; }
  int64_t device_bytes() const { return bytes_; }

 private:
  Exl3LinearView view_;
  int device_ = -1;
  void* storage_ = nullptr;
  int64_t bytes_ = 0;
};

// y = x · W_eff + bias with device pointers, enqueued on `stream` (a
// cudaStream_t passed as void*; nullptr = the legacy default stream).
// Asynchronous: returns once the work is enqueued; d_x must stay valid and
// unchanged and d_y untouched by others until the stream reaches that point.
// Scratch (x', partial sums, kInt8 activations; for m >= kCublasMinRows a W_h
// column slice of at most 256 MiB) is allocated stream-ordered
// (cudaMallocAsync) and freed on the same stream.
// Errors: InvalidArgument for m < 0, a null d_x with m·k > 0 or null d_y with
// m·n > 0, or kInt8 with a codebook other than mul1; Unimplemented for a
// precision other than kFloat / kInt8; FailedPrecondition
// when the current device is not w.device(); ResourceExhausted (naming the
// bytes) when scratch cannot be allocated; Internal for other CUDA / cuBLAS
// errors (each names the failing step). Errors raised while the kernels run
// surface at the caller's next synchronisation. options.max_threads is ignored.
// Below kCublasMinRows (and for kInt8) it only enqueues kernels, memsets and
// stream-ordered allocations, so it is meant to be graph-capturable; the
// cuBLAS path creates a cuBLAS handle per call and is not (neither verified).
// Requires: d_x has m·k floats, d_y m·n floats, on w.device(); no aliasing.
absl::Status TrellisGemm(const DeviceExl3Linear& w, const float* d_x, int64_t m, float* d_y,
                         void* stream, const TrellisGemmOptions& options = {});

// Host convenience with the signature of kernels::TrellisGemm: uploads the
// linear and x, runs the device TrellisGemm on a private stream, copies y
// back and waits. Errors: those of ValidateExl3LinearView, the argument
// checks of kernels::TrellisGemm (InvalidArgument), then those above; on
// error y is untouched. Thread-safe. Cost: uploads the whole linear per call
// (a test / verification path; serving uses DeviceExl3Linear).
absl::Status TrellisGemm(const Exl3LinearView& view, const float* x, int64_t m, float* y,
                         const TrellisGemmOptions& options = {});

}  // namespace exl3serve::kernels::cuda

#endif  // EXL3SERVE_KERNELS_CUDA_TRELLIS_GEMM_H_
