// kernels/cuda/cuda_device.h — is there a usable CUDA device? Plain C++: no
// CUDA headers, so host code and tests built without nvcc flags can call it.
// Declared only when the CUDA backend is built (EXL3_HAVE_CUDA=1, a public
// compile definition of exl3_kernels_cuda); guard uses with #if EXL3_HAVE_CUDA.
//
//   if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
//
// On a machine without a GPU or driver, cudaGetDeviceCount fails (often with
// cudaErrorInsufficientDriver, 35) instead of reporting 0 devices; both
// functions treat every error as "no device" (toolchain.md §3).
//
// Thread safety: thread-safe (the CUDA runtime serialises these queries).
#ifndef EXL3SERVE_KERNELS_CUDA_CUDA_DEVICE_H_
#define EXL3SERVE_KERNELS_CUDA_CUDA_DEVICE_H_

#include "absl/status/status.h"

namespace exl3serve::kernels::cuda {

// Number of CUDA devices visible to this process; 0 on any runtime error.
int CudaDeviceCount();

// OK when at least one device is visible. Otherwise FailedPrecondition with a
// message starting "no CUDA device: " and naming the runtime's error, if any.
absl::Status CudaDeviceAvailable();

}  // namespace exl3serve::kernels::cuda

#endif  // EXL3SERVE_KERNELS_CUDA_CUDA_DEVICE_H_
