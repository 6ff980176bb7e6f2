#include "kernels/cuda/trellis_reconstruct.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels::cuda {
namespace {

// Launch configuration. Not tuned: this kernel verifies the decode, it is not
// on the serving path. One warp per tile; 8 tiles per 256-thread block; a
// grid-stride loop caps the grid at kMaxBlocks so any tensor size launches.
constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kTilesPerBlock = kThreadsPerBlock / kWarpSize;
constexpr int64_t kMaxBlocks = 8192;
constexpr int kPositionsPerLane = kTileWeights / kWarpSize;  // 8 (§3.2)

// Warp w of the grid decodes tiles w, w + warps, ...; lane l decodes positions
// 8l .. 8l+7 of the tile (rows {r0, r0+1, r0+8, r0+9} of columns l/4 and l/4+8)
// and writes them to W_h (row-major, n columns) at their permuted places.
__global__ void DecodeInnerMatrixKernel(const uint16_t* __restrict__ trellis, int64_t tiles_n,
                                        int64_t tiles_total, int64_t n, int bits,
                                        Codebook codebook, uint16_t* __restrict__ w_h) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warps_in_grid = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t first_warp =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t tile_values = 16 * bits;
  for (int64_t tile = first_warp; tile < tiles_total; tile += warps_in_grid) {
    const uint16_t* packed = trellis + tile * tile_values;
    const int64_t tk = tile / tiles_n;
    const int64_t tn = tile % tiles_n;
    uint16_t* origin = w_h + tk * kTileDim * n + tn * kTileDim;
    for (int u = 0; u < kPositionsPerLane; ++u) {
      const int j = lane * kPositionsPerLane + u;
      const uint16_t state = ReadTileState(packed, bits, j);
      const int rc = TilePermutation(j);
      origin[(rc / kTileDim) * n + (rc % kTileDim)] = DecodeState(codebook, state);
    }
  }
}

// Device memory owned by one call; freed on every return path. cudaFree's own
// error is ignored here: the call's result is already decided.
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

absl::Status AllocateDevice(size_t bytes, const char* what, DeviceBuffer* buffer) {
  void* p = nullptr;
  absl::Status status =
      CudaStatus(cudaMalloc(&p, bytes), absl::StrCat("allocating ", bytes, " bytes for ", what));
  if (status.ok()) buffer->reset(p);
  return status;
}

}  // namespace

absl::Status DecodeInnerMatrix(const Exl3LinearView& view, uint16_t* w_h) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  if (absl::Status status = CudaDeviceAvailable(); !status.ok()) return status;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t tiles_total = (view.k / kTileDim) * tiles_n;
  if (tiles_total == 0) return absl::OkStatus();

  const size_t trellis_bytes =
      static_cast<size_t>(tiles_total) * TileInt16Count(view.bits) * sizeof(uint16_t);
  const size_t w_h_bytes = static_cast<size_t>(view.k * view.n) * sizeof(uint16_t);
  DeviceBuffer trellis_device;
  DeviceBuffer w_h_device;
  if (absl::Status s = AllocateDevice(trellis_bytes, "the trellis", &trellis_device); !s.ok()) {
    return s;
  }
  if (absl::Status s = AllocateDevice(w_h_bytes, "W_h", &w_h_device); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaMemcpy(trellis_device.get(), view.trellis, trellis_bytes,
                                             cudaMemcpyHostToDevice),
                                  "copying the trellis to the device");
      !s.ok()) {
    return s;
  }

  const int64_t blocks = std::min<int64_t>((tiles_total + kTilesPerBlock - 1) / kTilesPerBlock,
                                           kMaxBlocks);
  DecodeInnerMatrixKernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock>>>(
      static_cast<const uint16_t*>(trellis_device.get()), tiles_n, tiles_total, view.n,
      view.bits, view.codebook, static_cast<uint16_t*>(w_h_device.get()));
  if (absl::Status s = CudaStatus(cudaGetLastError(), "launching the decode kernel"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaDeviceSynchronize(), "running the decode kernel");
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaMemcpy(w_h, w_h_device.get(), w_h_bytes, cudaMemcpyDeviceToHost),
                    "copying W_h to the host");
}

}  // namespace exl3serve::kernels::cuda
