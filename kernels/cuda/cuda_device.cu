#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3serve::kernels::cuda {

absl::Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Debian 12's absl::string_view is not std::string_view: pass `what` as a string.
  const std::string message = absl::StrCat(std::string(what), ": ", cudaGetErrorName(error), " (",
                                           static_cast<int>(error), "): ",
                                           cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CudaDeviceAvailable() {
  int count = 0;  // not written by cudaGetDeviceCount on error
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear the runtime's last-error slot
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device: ", CudaStatus(error, "cudaGetDeviceCount").message()));
  }
  if (count <= 0) {
    return absl::FailedPreconditionError("no CUDA device: cudaGetDeviceCount reports 0 devices");
  }
  return absl::OkStatus();
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count > 0 ? count : 0;
}

}  // namespace exl3serve::kernels::cuda
