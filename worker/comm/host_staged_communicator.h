// worker/comm/host_staged_communicator.h — the `host_staged` backend: GPU
// ranks on one box whose GPUs cannot reach each other peer-to-peer (no
// NVLink/PCIe P2P, IOMMU, containers, different PCIe roots), or more than
// cuda_p2p's 8 ranks. Each call copies the device buffers to pinned host
// memory, runs the collective with the `shm` backend among the same ranks
// (shm_communicator.h), and copies the result back. Buffers are device memory
// of the rank's device.
//
//   HostStagedOptions options;
//   options.device = local_rank;
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//                         CreateHostStagedCommunicator(options, bootstrap));
//   EXL3_RETURN_IF_ERROR(comm->AllReduce(d_buf, n, CommDataType::kBF16, deadline));
//
// CreateGpuCommunicator (comm_factory.h) picks it on its own when the
// start-up probe finds a pair of GPUs without peer access (see
// gpu_backend_choice.h).
//
// How the Communicator contract (communicator.h) is met:
//   * Ordering: each call enqueues its device-to-host copy on the stream
//     after the caller's work, waits for it (polling an event, bounded by
//     the call's deadline), runs the shm collective with the same deadline,
//     then enqueues the host-to-device copy and waits for it too. The call
//     returns once the result is in the caller's buffer.
//   * Determinism: shm's (rank-order fp32 sums, bf16 rounded once): every
//     rank gets the same bits, identical to cuda_p2p's and the CPU backends'.
//   * Deadlines and consistent failure: those of shm. A rank whose own copy
//     fails or passes the deadline aborts the shm group, so its peers' current
//     or next call fails promptly with Aborted naming it; a dead peer process
//     is seen by shm through its pidfd. The first failure breaks the
//     communicator for good (later calls: Aborted).
//   * CUDA graphs: not capturable (the host takes part in every call):
//     FailedPrecondition when the stream is capturing, and the group stays
//     usable (every rank of a program captures alike).
//   * Cost: two PCIe copies per call plus shm's; pinned staging grows to the
//     largest call (AllGather: world_size x bytes; ReduceScatter and
//     AllToAllV: input plus output) and is kept.
//
// Thread safety: one thread at a time for the collective calls (each makes
// the communicator's device current on that thread); Abort() and health()
// from any thread. Ownership: owns its shm communicator, pinned staging,
// event and (when options.stream is null) its stream; borrows the caller's
// buffers for the duration of each call only.
#ifndef EXL3SERVE_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed here

namespace exl3serve::worker::comm {

struct HostStagedOptions {
  // CUDA device ordinal of this rank; -1 uses the calling thread's current
  // device. Ranks may share a GPU.
  int device = -1;
  // Stream the copies run on (borrowed; must outlive the communicator and
  // belong to `device`). Null: an owned non-blocking stream.
  CUstream_st* stream = nullptr;
  // The shm segment name of the group ("/..."); empty: rank 0 picks a fresh
  // one and sends it to the others through the bootstrap.
  std::string shm_name;
  // Bound on creation (two bootstrap exchanges, pinned allocation, shm join).
  absl::Duration init_timeout = absl::Seconds(60);
  // Pinned staging allocated at creation (bytes); grows on demand.
  size_t initial_staging_bytes = size_t{1} << 20;
};

// OK, or InvalidArgument naming the field ("host_staged.<field>").
absl::Status ValidateHostStagedOptions(const HostStagedOptions& options);

// Creates this rank's communicator over the group `bootstrap` describes.
// Collective: every rank calls it; a rank that cannot start (bad options, no
// device, pinned memory) makes every rank fail with its reason
// (gpu_rank_info.h). `bootstrap` is borrowed for the call only.
// Errors: InvalidArgument (options), Unimplemented (ranks on several hosts:
// use nccl; built without CUDA), FailedPrecondition (no device),
// ResourceExhausted (pinned memory), DeadlineExceeded (init_timeout),
// Unavailable / Internal (bootstrap, CUDA), those of CreateShmCommunicator.
absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedCommunicator(
    const HostStagedOptions& options, Bootstrap& bootstrap);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_
