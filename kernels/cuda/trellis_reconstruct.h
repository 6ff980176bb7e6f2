// kernels/cuda/trellis_reconstruct.h — the CUDA variant of the trellis decode
// of kernels/reconstruct.h: same name, same signature, same bit-exact result
// (exl3-format.md §1, §10). Plain C++ (no CUDA headers), so tests compiled
// without nvcc can call it. Available only when EXL3_HAVE_CUDA=1.
//
//   std::vector<uint16_t> w_h(k * n);
//   absl::Status s = kernels::cuda::DecodeInnerMatrix(view, w_h.data());  // host memory
//
// The device kernel decodes one 16x16 tile per warp, each lane 8 consecutive
// trellis positions (the B-fragment order of §3.2), using exactly
// ReadTileState / DecodeState / TilePermutation of kernels/trellis_decode.h.
// This is a verification path (host -> device -> host round trip), not the
// fast GEMM path.
//
// Thread safety: thread-safe; each call owns its device buffers. Uses the
// calling thread's current device and the legacy default stream.
#ifndef EXL3SERVE_KERNELS_CUDA_TRELLIS_RECONSTRUCT_H_
#define EXL3SERVE_KERNELS_CUDA_TRELLIS_RECONSTRUCT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/reconstruct.h"

namespace exl3serve::kernels::cuda {

// W_h as fp16 bit patterns, row-major k x n, identical bit for bit to
// kernels::DecodeInnerMatrix. `view` and `w_h` are host memory; only the
// trellis, shape, bits and codebook of the view are used.
// Errors: those of ValidateExl3LinearView; FailedPrecondition "no CUDA
// device: ..." without a device; ResourceExhausted when device memory runs
// out; Internal for other CUDA errors (each names the failing step). On error
// the contents of `w_h` are unspecified. Cost: allocates k·n·2 + trellis bytes on the device,
// blocks until the copy back is done.
absl::Status DecodeInnerMatrix(const Exl3LinearView& view, uint16_t* w_h);

}  // namespace exl3serve::kernels::cuda

#endif  // EXL3SERVE_KERNELS_CUDA_TRELLIS_RECONSTRUCT_H_
