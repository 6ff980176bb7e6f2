// worker/comm/comm_factory.h — a Communicator from a backend name and its
// settings, as the rank process's flags and the cluster config give them.
//
//   CommSpec spec;  spec.backend = "shm";  spec.shm_name = "/exl3-1234";
//   EXL3_ASSIGN_OR_RETURN(auto comm, CreateCommunicator(spec, rank, world, deadline));
#ifndef EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_
#define EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/nccl_communicator.h"

namespace exl3serve::worker::comm {

struct CommSpec {
  std::string backend = "shm";  // "shm" (one box) or "ucx" (across boxes)
  // shm: the POSIX shared-memory name every rank of the group uses ("/...").
  std::string shm_name;
  // ucx: host:port where rank 0 listens for the bootstrap exchange.
  std::string bootstrap_address;
  // ucx: UCX transports (UCX_TLS syntax), e.g. "tcp"; empty = UCX's default.
  std::string ucx_tls;
  // The cluster's rank token: ranks prove they know it on the bootstrap
  // (TcpBootstrapOptions::auth_key) before any setup data is exchanged.
  // Each worker fills it from its own --rank-token-file (it never travels in
  // Setup); empty = an unauthenticated bootstrap (a trusted network).
  std::string bootstrap_key;

  // --- GPU ranks (CreateGpuCommunicator; device buffers) -------------------
  // backend there: "auto", "cuda_p2p", "host_staged" or "nccl" (see
  // gpu_backend_choice.h); bootstrap_address is required (the set-up
  // exchange), shm_name is optional (host_staged: empty = rank 0 picks one).
  // CUDA device of this rank; -1 = the calling thread's current device.
  int device = -1;
  // Ranks may share one GPU (tests on one-GPU machines; time-sliced, slow).
  bool allow_shared_device = false;
  // auto, one box, some pair without peer access: "host_staged" or "nccl".
  std::string no_p2p_fallback = "host_staged";
  // nccl: network settings (worker flags --nccl-*, cluster keys comm.nccl.*);
  // device, stream and init_timeout here are ignored (the factory sets them).
  NcclOptions nccl;
};

// Box-local collective settings a worker process takes from its own flags
// (interface and HCA names differ per box, so they do not come from the
// coordinator): fields the group's CommSpec leaves at their defaults are
// filled from them. Only the network settings are merged: ucx_tls and the
// nccl network fields (socket_ifname, socket_family, ib_hca, ib_gid_index,
// enable_ib, net_plugin, net_name, extra_env appended).
struct LocalCommDefaults {
  std::string ucx_tls;
  NcclOptions nccl;
};
// Pure: `spec` with its unset network fields taken from `local`.
CommSpec MergeLocalCommDefaults(const CommSpec& spec, const LocalCommDefaults& local);
// The process-wide defaults CreateCommunicator and CreateGpuCommunicator
// merge in (empty until set). Thread-safe; set once at process start, before
// the first communicator.
void SetLocalCommDefaults(const LocalCommDefaults& local);
LocalCommDefaults GetLocalCommDefaults();

// Joins the group as `rank` of `world_size` by `join_deadline`.
// Errors: InvalidArgument for an unknown backend or a missing setting
// (named); those of the backend's Create (DeadlineExceeded when peers do not
// appear).
// Host buffers only: the GPU backends (auto, cuda_p2p, host_staged, nccl)
// are refused with InvalidArgument naming CreateGpuCommunicator.
absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommSpec& spec, int rank,
                                                                 int world_size,
                                                                 absl::Time join_deadline);

// GPU ranks (buffers are device memory of spec.device). Collective: every
// rank calls it with the same backend. Joins a TcpBootstrap at
// spec.bootstrap_address, probes the group (hosts, GPUs, peer access of
// every pair) in one exchange, chooses the backend with ChooseGpuBackend
// (the same choice on every rank), logs the probe and the choice, and
// creates it over the same bootstrap. `chosen` (optional) receives the
// backend name and the reason.
// Errors: InvalidArgument (unknown backend, missing bootstrap address);
// FailedPrecondition / Unimplemented when the requested backend cannot serve
// the group or this build has no CUDA / NCCL; those of the backend's Create.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGpuCommunicator(const CommSpec& spec, int rank,
                                                                    int world_size,
                                                                    absl::Time join_deadline,
                                                                    std::string* chosen = nullptr);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_
