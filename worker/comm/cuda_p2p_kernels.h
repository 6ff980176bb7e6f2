// worker/comm/cuda_p2p_kernels.h — the plain launcher API between the host
// side of the cuda_p2p backend (cuda_p2p_communicator.cc, Abseil) and its
// kernels (cuda_p2p_kernels.cu, no Abseil: nvcc and Abseil headers do not
// always mix). Internal to worker/comm. The protocol — layout, epochs,
// invariants, memory-ordering table, failure — is documented at the top of
// cuda_p2p_kernels.cu; the constants here are its parameters.
//
// Thread safety: the launchers are thread-safe; concurrent launches on one
// group must be serialised by the caller (they share epochs and buffers).
#ifndef EXL3SERVE_WORKER_COMM_CUDA_P2P_KERNELS_H_
#define EXL3SERVE_WORKER_COMM_CUDA_P2P_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace exl3serve::worker::comm::internal {

// Largest group (flag arrays are sized for it).
inline constexpr int kP2pMaxRanks = 8;
// Every launch of every operation uses this grid, so that block b of one
// rank always pairs with block b of every peer (invariant I1 in the .cu).
// Untuned: vLLM uses 36 x 512 (grid-searched on A100/H100); 32 x 512 keeps
// the arithmetic simple. Retune with a bench before relying on it.
inline constexpr int kP2pBlocks = 32;
inline constexpr int kP2pThreads = 512;
// Sub-slot sizes and per-block ranges are multiples of this (16-byte copies).
inline constexpr size_t kP2pAlignBytes = 16;

// One per rank, in its own device memory (cudaMalloc, zeroed at creation,
// exported by CUDA IPC). Peers write `flags` and `abort`; only the owning
// rank's kernels read them, and only the owner touches `epoch`.
struct P2pSignal {
  // flags[b][r]: the last barrier number rank r's block b announced to us.
  uint32_t flags[kP2pBlocks][kP2pMaxRanks];
  // epoch[b]: the last barrier number our block b passed (never reset).
  uint32_t epoch[kP2pBlocks];
  // 0, or 1 + the rank that aborted the group. Never cleared.
  uint32_t abort;
};

enum P2pStatusCode : uint32_t {
  kP2pOk = 0,
  kP2pTimedOut = 1,     // this rank's block gave up waiting (device timeout)
  kP2pPeerAborted = 2,  // the abort word was set (by a peer or by this rank's host)
};

// Written by a block's thread 0 only when the block fails; lives in mapped
// pinned host memory, so the host reads it without a copy. Zero while OK.
struct P2pBlockStatus {
  uint32_t code;     // P2pStatusCode
  uint32_t missing;  // bit r: rank r was not heard from (kP2pTimedOut)
  uint32_t aborter;  // the abort word seen: 1 + the aborting rank (kP2pPeerAborted)
  uint32_t epoch;    // the barrier number that was being waited for
};
struct P2pStatus {
  P2pBlockStatus blocks[kP2pBlocks];
};

// The group as this rank's kernels see it; constant after creation.
struct P2pGroup {
  int rank = 0;
  int world = 1;
  // Every rank's data buffer and signal, as mapped in this process (own at
  // [rank]). Data buffer layout: [half 0..1][source rank][block][sub_bytes].
  char* data[kP2pMaxRanks] = {};
  P2pSignal* signal[kP2pMaxRanks] = {};
  size_t sub_bytes = 0;         // one (half, source, block) sub-slot; multiple of 16
  P2pStatus* status = nullptr;  // device alias of this rank's mapped status
};

enum class P2pDType : int { kF32 = 0, kBF16 = 1 };

// A reduction launch over world pieces. Piece d is what rank d reduces;
// block b handles elements [b·block_elems, (b+1)·block_elems) of every piece.
//   one-shot all-reduce: every piece is the whole chunk (src[d] = data)
//   reduce-scatter:      piece d is rank d's block of the input
//   two-shot all-reduce: piece d is the d-th 1/world of the chunk, then the
//                        reduced pieces are exchanged (gather_dst)
struct P2pReduceArgs {
  const void* src[kP2pMaxRanks] = {};   // this rank's contribution to piece d
  size_t piece_len[kP2pMaxRanks] = {};  // elements of piece d
  size_t block_elems = 0;               // <= sub_bytes / element size
  void* out = nullptr;                  // reduced piece `rank` (may alias src[rank])
  void* gather_dst[kP2pMaxRanks] = {};  // two_shot: where reduced piece r lands
  P2pDType dtype = P2pDType::kF32;
  bool two_shot = false;
};

// A copy launch: segment d of this rank goes to rank d (d == rank: copied
// locally unless src == dst); rank r's segment for us lands in dst[r]. Block
// b moves bytes [b·block_bytes, (b+1)·block_bytes) of every segment.
struct P2pCopyArgs {
  const void* src[kP2pMaxRanks] = {};
  size_t send_len[kP2pMaxRanks] = {};
  void* dst[kP2pMaxRanks] = {};
  size_t recv_len[kP2pMaxRanks] = {};
  size_t block_bytes = 0;  // multiple of 16, <= sub_bytes
};

// Enqueue one launch on `stream` (graph-capturable: no host synchronisation).
// `timeout_ns` bounds each block's waits, counted from the block's start.
// Return the launch error (cudaSuccess when enqueued).
cudaError_t LaunchP2pReduce(const P2pGroup& group, const P2pReduceArgs& args, uint64_t timeout_ns,
                            cudaStream_t stream);
cudaError_t LaunchP2pCopy(const P2pGroup& group, const P2pCopyArgs& args, uint64_t timeout_ns,
                          cudaStream_t stream);
cudaError_t LaunchP2pBarrier(const P2pGroup& group, uint64_t timeout_ns, cudaStream_t stream);
// Sets the abort word of every rank (own included) to 1 + group.rank unless
// already set. One tiny block; run it on a stream of its own so it does not
// wait behind a spinning launch.
cudaError_t LaunchP2pAbort(const P2pGroup& group, cudaStream_t stream);

}  // namespace exl3serve::worker::comm::internal

#endif  // EXL3SERVE_WORKER_COMM_CUDA_P2P_KERNELS_H_
