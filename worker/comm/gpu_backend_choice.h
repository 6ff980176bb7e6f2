// worker/comm/gpu_backend_choice.h — which collective backend a group of GPU
// ranks uses, decided from what the start-up probe found (hosts, GPUs, peer
// access of every pair) and the configuration. A pure function, so the whole
// decision table is tested without a GPU; CreateGpuCommunicator
// (comm_factory.h) runs the probe, calls it and logs both.
//
//   GpuGroupProbe probe = ...;                    // the same on every rank
//   EXL3_ASSIGN_OR_RETURN(GpuBackendChoice choice, ChooseGpuBackend(probe, policy));
//   EXL3_LOG(kInfo) << GpuBackendName(choice.backend) << ": " << choice.reason;
//
// The decision table (also in worker/comm/README.md), for requested = auto:
//   ranks on several hosts                   -> nccl (Unimplemented if NCCL is not built)
//   one host, ranks sharing a GPU and
//     allow_shared_device off                -> host_staged
//   one host, <= 8 ranks, every pair of
//     distinct GPUs has peer access both ways -> cuda_p2p
//   one host, otherwise (a pair without peer
//     access, or > 8 ranks)                  -> no_p2p_fallback: host_staged, or nccl when
//                                               it is "nccl", NCCL is built and no GPU is
//                                               shared (else host_staged, saying why)
// An explicit backend is checked against the group instead: cuda_p2p needs
// one host, <= 8 ranks, peer access everywhere (Unimplemented otherwise) and
// distinct GPUs unless allow_shared_device (FailedPrecondition); host_staged
// needs one host and <= 64 ranks (Unimplemented); nccl needs NCCL built
// (Unimplemented) and one GPU per rank (FailedPrecondition).
//
// Every rank holds the same probe (it is exchanged), so every rank decides
// alike. Thread safety: pure functions.
#ifndef EXL3SERVE_WORKER_COMM_GPU_BACKEND_CHOICE_H_
#define EXL3SERVE_WORKER_COMM_GPU_BACKEND_CHOICE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::worker::comm {

enum class GpuBackend { kCudaP2p, kHostStaged, kNccl };
const char* GpuBackendName(GpuBackend backend);  // "cuda_p2p", "host_staged", "nccl"

// What the start-up probe found, index = rank.
struct GpuGroupProbe {
  std::vector<std::string> host_ids;     // equal for ranks on one machine
  std::vector<std::string> pci_bus_ids;  // equal (on one host) for ranks on one GPU
  // can_access[i][j]: rank i's GPU reaches rank j's peer-to-peer, as rank i
  // probed it (entries for one GPU are ignored).
  std::vector<std::vector<bool>> can_access;
};

struct GpuBackendPolicy {
  // "auto", "cuda_p2p", "host_staged" or "nccl".
  std::string requested = "auto";
  // auto on one host without peer access everywhere: "host_staged" or "nccl".
  std::string no_p2p_fallback = "host_staged";
  bool allow_shared_device = false;
  // Whether this build has the nccl backend (EXL3_HAVE_NCCL).
  bool nccl_built = false;
};

struct GpuBackendChoice {
  GpuBackend backend = GpuBackend::kHostStaged;
  std::string reason;  // one line, for the start-up log
};

// The table above. Errors: InvalidArgument for an unknown requested /
// fallback name or a probe whose vectors do not all have world-size entries
// (or an empty one); Unimplemented / FailedPrecondition as above, naming the
// ranks and GPUs concerned.
absl::StatusOr<GpuBackendChoice> ChooseGpuBackend(const GpuGroupProbe& probe,
                                                  const GpuBackendPolicy& policy);

// One line for the start-up log: "3 ranks on 1 host; GPUs 0000:01:00.0,...;
// peer access: 1 of 3 pairs (missing: 0-2, 1-2)".
std::string DescribeGpuGroupProbe(const GpuGroupProbe& probe);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_GPU_BACKEND_CHOICE_H_
