// kernels/cuda/cuda_status.h — CUDA runtime error codes as absl::Status, for
// .cu files (includes cuda_runtime_api.h; plain C++ code uses cuda_device.h).
//
//   if (absl::Status s = CudaStatus(cudaMalloc(&p, bytes), "allocating trellis"); !s.ok())
//     return s;
//
// A plain function, not a macro (style.md: CUDA codes become a Status through
// CudaStatus(err, "what we were doing")). Thread-safe.
#ifndef EXL3SERVE_KERNELS_CUDA_CUDA_STATUS_H_
#define EXL3SERVE_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace exl3serve::kernels::cuda {

// OK for cudaSuccess. Otherwise a Status whose message is
// "<what>: <error name> (<code>): <error text>" and whose code says what the
// caller can do: ResourceExhausted for out-of-memory, FailedPrecondition for
// a missing device or driver, Internal for everything else (a bug of ours or a
// broken device).
absl::Status CudaStatus(cudaError_t error, std::string_view what);

}  // namespace exl3serve::kernels::cuda

#endif  // EXL3SERVE_KERNELS_CUDA_CUDA_STATUS_H_
