// worker/comm/cuda_p2p_communicator.h — the `cuda_p2p` backend: GPU ranks on
// one box (one rank per process) exchanging data through each other's device
// memory over NVLink or PCIe peer-to-peer, with custom kernels (the vLLM /
// TensorRT-LLM "custom all-reduce" design, push-style). Buffers are device
// memory of the rank's device.
//
//   CudaP2pOptions options;
//   options.device = local_rank;
//   absl::StatusOr<std::unique_ptr<Communicator>> comm =
//       CreateCudaP2pCommunicator(options, bootstrap);
//   if (absl::IsUnimplemented(comm.status())) {  // no peer access: host_staged or NCCL
//     comm = CreateHostStagedCommunicator(host_staged_options, bootstrap);
//   }
// (CreateGpuCommunicator in comm_factory.h probes first and picks for you.)
//
// What and when (protocol details: the top of cuda_p2p_kernels.cu):
//   * Every operation of the interface runs natively on the same buffers:
//     AllReduce (one-shot up to one_shot_max_bytes or when world_size == 2,
//     two-shot above), ReduceScatter, AllGather(V), Broadcast, AllToAllV
//     (one extra tiny all-gather first, so that every rank agrees on the
//     number of launches), Barrier. Operations larger than one launch's
//     capacity run as several launches: one-shot moves up to
//     buffer_bytes / (2·N) bytes per launch, two-shot N times that.
//   * Determinism: AllReduce and ReduceScatter sum in rank order 0..N-1 in
//     fp32 and round once, exactly as communicator.h asks: every rank gets
//     the same bits, and one-shot, two-shot and any chunking agree bit for
//     bit with a CPU fp32 rank-order sum.
//   * Fallback: when the GPUs of the group cannot reach each other
//     peer-to-peer (cudaDeviceCanAccessPeer, probed by every rank for every
//     pair and exchanged, so all ranks decide alike), when the ranks are on
//     different hosts, or for more than 8 ranks, creation fails on every
//     rank with Unimplemented and a message saying to use the nccl backend.
//     Unimplemented is the caller's cue to create a host_staged
//     (host_staged_communicator.h: pinned host copies + shm) or nccl
//     communicator instead; gpu_backend_choice.h decides which.
//   * Deadlines: each launch's waits are bounded on the device by the time
//     left to the call's deadline (%globaltimer). In eager mode the call
//     then waits on an event until the launches finish, at most
//     kHostGrace past the deadline, after which the host sets the group's
//     abort word itself. A timed-out rank sets every rank's abort word, so
//     the peers fail within microseconds with Aborted rather than at their
//     own deadline. The first failure breaks the communicator for good.
//     After a failure the kernel of this call may still run for up to one
//     poll period; do not free its buffers before the next call returns.
//   * Abort(): marks this rank broken and sets every rank's abort word from
//     the device (a one-block kernel on a stream of its own); a peer's
//     current or next call then fails with Aborted naming this rank.
//   * CUDA graphs: when the stream is capturing, calls enqueue their
//     launches and return OK; each launch's device timeout is then
//     graph_timeout (a deadline cannot be baked into a graph). Epochs live
//     in device memory, so replays keep counting. Failures in replays show
//     in health() and fail the next eager call. AllToAllV cannot be captured
//     (FailedPrecondition, the group stays usable): its launch count depends
//     on every rank's sizes, which it reads back on the host.
//   * Two ranks may share one GPU only with allow_shared_device: their
//     kernels time-slice (or run concurrently under MPS); correct but slow.
//     Meant for tests on one-GPU machines.
//
// Thread safety: one thread at a time for the collective calls (each call
// makes the communicator's device current on that thread); Abort() and
// health() from any thread.
// Ownership: the communicator owns its device buffers, IPC mappings, status
// memory, events and (when options.stream is null) its stream; it borrows
// the caller's buffers for the duration of each call only.
#ifndef EXL3SERVE_WORKER_COMM_CUDA_P2P_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_CUDA_P2P_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed here

namespace exl3serve::worker::comm {

struct CudaP2pOptions {
  // --- behaviour -----------------------------------------------------------
  // CUDA device ordinal of this rank; -1 uses the calling thread's current
  // device.
  int device = -1;
  // Stream the launches run on (borrowed; must outlive the communicator and
  // belong to `device`). Null: an owned non-blocking stream. Calls wait for
  // everything enqueued on it before them.
  CUstream_st* stream = nullptr;
  // Let ranks share a GPU (time-sliced: correct, slow; for tests).
  bool allow_shared_device = false;
  // Bound on creation (three bootstrap exchanges, allocation, IPC mapping).
  absl::Duration init_timeout = absl::Seconds(60);
  // Device-side wait bound of launches captured into a CUDA graph.
  absl::Duration graph_timeout = absl::Seconds(30);

  // --- performance ---------------------------------------------------------
  // Bytes of this rank's data buffer (two halves x world_size slots). One
  // launch moves buffer_bytes / (2·world_size) bytes per rank one-shot and
  // world_size times that two-shot; more takes several launches. 16 MiB
  // follows vLLM's 8 MiB scratch per direction; untuned here.
  size_t buffer_bytes = size_t{16} << 20;
  // All-reduces up to this size (bytes) run one-shot, larger ones two-shot
  // (world_size 2 always one-shot). 256 KiB is vLLM's threshold for 8
  // NVLink GPUs (512 KiB for <= 4); untuned here.
  size_t one_shot_max_bytes = size_t{256} << 10;
};

// OK, or InvalidArgument naming the field ("cuda_p2p.<field>"), the rule and
// the value given; Unimplemented for world_size outside 1..8 ("use nccl").
absl::Status ValidateCudaP2pOptions(const CudaP2pOptions& options, int world_size);

// One rank as the topology check sees it (from the set-up exchange).
struct CudaP2pPeer {
  std::string host_id;     // equal for ranks on one machine
  std::string pci_bus_id;  // equal for ranks on one GPU
};

// The fallback decision, a pure function so it is testable without a GPU.
// can_access[i][j]: rank i's device can access rank j's device peer-to-peer
// (as rank i probed it; entries for ranks on the same GPU are ignored). OK
// when cuda_p2p can serve the group. Otherwise, the first problem found:
// Unimplemented ("... use the nccl backend") for ranks on different hosts or
// a pair without peer access in either direction; FailedPrecondition for
// ranks sharing a GPU without allow_shared_device; InvalidArgument for a
// matrix that does not match the peers.
absl::Status CheckCudaP2pTopology(std::span<const CudaP2pPeer> peers,
                                  const std::vector<std::vector<bool>>& can_access,
                                  bool allow_shared_device);

// How an all-reduce of `count` elements is split into launches; identical
// on every rank for the same arguments. Exposed for tests.
struct CudaP2pLaunch {
  size_t offset = 0;  // first element of this launch
  size_t count = 0;   // elements in this launch
  bool two_shot = false;
  size_t piece = 0;        // elements per piece (two-shot: ceil(count / world); else count)
  size_t block_elems = 0;  // elements of each piece per block
};
// Requires: elem_bytes in {2, 4}; world_size in 1..8; sub_bytes >= 16 and a
// multiple of 16 (one sub-slot of the data buffer).
std::vector<CudaP2pLaunch> PlanCudaP2pAllReduce(size_t count, size_t elem_bytes, int world_size,
                                                size_t sub_bytes, size_t one_shot_max_bytes);

// Creates this rank's communicator over the group `bootstrap` describes.
// Collective: every rank calls it; every rank returns the same error when
// any rank cannot take part (see gpu_rank_info.h). `bootstrap` is borrowed
// for the call only.
// Errors: InvalidArgument (options), Unimplemented (the group cannot use
// cuda_p2p: use nccl), FailedPrecondition (no device, shared GPU not
// allowed), ResourceExhausted (device memory), DeadlineExceeded
// (init_timeout), Unavailable / Internal (bootstrap, CUDA).
absl::StatusOr<std::unique_ptr<Communicator>> CreateCudaP2pCommunicator(
    const CudaP2pOptions& options, Bootstrap& bootstrap);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_CUDA_P2P_COMMUNICATOR_H_
