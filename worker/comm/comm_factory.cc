#include "worker/comm/comm_factory.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/comm/gpu_backend_choice.h"
#include "worker/comm/gpu_rank_info.h"
#include "worker/comm/host_staged_communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"
#if defined(EXL3_HAVE_CUDA)
#include "worker/comm/cuda_p2p_communicator.h"
#endif

namespace exl3serve::worker::comm {
namespace {

struct LocalDefaultsHolder {
  std::mutex mu;
  LocalCommDefaults value;  // guarded by mu
};
LocalDefaultsHolder& LocalDefaults() {
  static auto* holder = new LocalDefaultsHolder;  // never destroyed: usable at exit
  return *holder;
}

bool IsGpuBackend(const std::string& backend) {
  return backend == "auto" || backend == "cuda_p2p" || backend == "host_staged" ||
         backend == "nccl";
}

// The group's TcpBootstrap at spec.bootstrap_address ("host:port").
absl::StatusOr<std::unique_ptr<TcpBootstrap>> JoinBootstrap(const CommSpec& spec, int rank,
                                                            int world_size,
                                                            absl::Time join_deadline) {
  const size_t colon = spec.bootstrap_address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(spec.bootstrap_address.substr(colon + 1), &port) || port == 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("communicator: backend ", spec.backend,
                     " needs --bootstrap HOST:PORT, got `", spec.bootstrap_address, "`"));
  }
  TcpBootstrapOptions bootstrap_options;
  bootstrap_options.rank = rank;
  bootstrap_options.world_size = world_size;
  bootstrap_options.host = spec.bootstrap_address.substr(0, colon);
  bootstrap_options.port = static_cast<uint16_t>(port);
  bootstrap_options.auth_key = spec.bootstrap_key;
  return TcpBootstrap::Create(bootstrap_options, join_deadline);
}

}  // namespace

CommSpec MergeLocalCommDefaults(const CommSpec& spec, const LocalCommDefaults& local) {
  CommSpec out = spec;
  auto fill = [](std::string& field, const std::string& value) {
    if (field.empty()) field = value;
  };
  fill(out.ucx_tls, local.ucx_tls);
  NcclOptions& n = out.nccl;
  const NcclOptions& l = local.nccl;
  fill(n.socket_ifname, l.socket_ifname);
  fill(n.socket_family, l.socket_family);
  fill(n.ib_hca, l.ib_hca);
  fill(n.net_plugin, l.net_plugin);
  fill(n.net_name, l.net_name);
  if (n.ib_gid_index < 0) n.ib_gid_index = l.ib_gid_index;
  if (!l.enable_ib) n.enable_ib = false;
  for (const auto& kv : l.extra_env) {
    const bool present = std::any_of(n.extra_env.begin(), n.extra_env.end(),
                                     [&](const auto& e) { return e.first == kv.first; });
    if (!present) n.extra_env.push_back(kv);
  }
  return out;
}

void SetLocalCommDefaults(const LocalCommDefaults& local) {
  LocalDefaultsHolder& holder = LocalDefaults();
  std::lock_guard<std::mutex> lock(holder.mu);
  holder.value = local;
}

LocalCommDefaults GetLocalCommDefaults() {
  LocalDefaultsHolder& holder = LocalDefaults();
  std::lock_guard<std::mutex> lock(holder.mu);
  return holder.value;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommSpec& spec, int rank,
                                                                 int world_size,
                                                                 absl::Time join_deadline) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("communicator: rank ", rank, " of world size ", world_size));
  }
  if (IsGpuBackend(spec.backend)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator: backend ", spec.backend,
        " is for GPU ranks (device buffers, CreateGpuCommunicator); this rank runs on the CPU: "
        "use shm (one box) or ucx (across boxes)"));
  }
  if (spec.backend == "shm") {
    if (spec.shm_name.empty()) {
      return absl::InvalidArgumentError("communicator: backend shm needs a segment name");
    }
    ShmOptions options;
    options.name = spec.shm_name;
    options.rank = rank;
    options.world_size = world_size;
    options.join_deadline = join_deadline;
    return CreateShmCommunicator(options);
  }
  if (spec.backend == "ucx") {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TcpBootstrap> bootstrap,
                          JoinBootstrap(spec, rank, world_size, join_deadline));
    UcxOptions options;
    options.tls = spec.ucx_tls.empty() ? GetLocalCommDefaults().ucx_tls : spec.ucx_tls;
    options.setup_timeout = std::max(absl::Seconds(1), join_deadline - absl::Now());
    return CreateUcxCommunicator(options, *bootstrap);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("communicator: unknown backend `", spec.backend, "` (expected shm or ucx)"));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateGpuCommunicator(const CommSpec& given,
                                                                    int rank, int world_size,
                                                                    absl::Time join_deadline,
                                                                    std::string* chosen) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("communicator: rank ", rank, " of world size ", world_size));
  }
  if (!IsGpuBackend(given.backend)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator: unknown GPU backend `", given.backend,
        "` (expected auto, cuda_p2p, host_staged or nccl; shm and ucx are for CPU ranks)"));
  }
#if !defined(EXL3_HAVE_CUDA)
  (void)join_deadline;
  (void)chosen;
  return absl::UnimplementedError(absl::StrCat("communicator: backend ", given.backend,
                                               " needs CUDA; exl3serve was built without it"));
#else
  const CommSpec spec = MergeLocalCommDefaults(given, GetLocalCommDefaults());
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TcpBootstrap> bootstrap,
                        JoinBootstrap(spec, rank, world_size, join_deadline));

  // The probe: every rank's host and GPU, then every rank's peer-access row.
  // A rank without a usable device fails every rank here (gpu_rank_info.h).
  const internal::GpuRankInfo mine =
      internal::DescribeLocalRank(absl::OkStatus(), spec.device, "comm.device");
  EXL3_ASSIGN_OR_RETURN(std::vector<internal::GpuRankInfo> infos,
                        internal::ExchangeGpuRankInfo(*bootstrap, mine, join_deadline, "gpu comm",
                                                      "exchanging GPU identities"));
  internal::GpuRankInfo row;
  row.payload = internal::ProbePeerAccess(infos, mine);
  EXL3_ASSIGN_OR_RETURN(std::vector<internal::GpuRankInfo> rows,
                        internal::ExchangeGpuRankInfo(*bootstrap, row, join_deadline, "gpu comm",
                                                      "exchanging peer access"));
  GpuGroupProbe probe;
  for (int r = 0; r < world_size; ++r) {
    probe.host_ids.push_back(infos[r].host_id);
    probe.pci_bus_ids.push_back(infos[r].pci_bus_id);
    std::vector<bool> access(world_size, false);
    for (int j = 0; j < world_size && j < static_cast<int>(rows[r].payload.size()); ++j) {
      access[j] = rows[r].payload[j] == '1';
    }
    probe.can_access.push_back(std::move(access));
  }

  // The choice: the same probe everywhere, so the same answer everywhere.
  GpuBackendPolicy policy;
  policy.requested = spec.backend;
  policy.no_p2p_fallback = spec.no_p2p_fallback;
  policy.allow_shared_device = spec.allow_shared_device;
#if defined(EXL3_HAVE_NCCL)
  policy.nccl_built = true;
#endif
  const std::string described = DescribeGpuGroupProbe(probe);
  absl::StatusOr<GpuBackendChoice> choice = ChooseGpuBackend(probe, policy);
  if (!choice.ok()) {
    EXL3_LOG(kError) << "rank " << rank << ": gpu comm probe: " << described << "; "
                     << choice.status();
    return choice.status();
  }
  EXL3_LOG(kInfo) << "rank " << rank << ": gpu comm probe: " << described << "; backend "
                  << GpuBackendName(choice->backend) << " (" << choice->reason << ")";
  if (chosen != nullptr) {
    *chosen = absl::StrCat(GpuBackendName(choice->backend), ": ", choice->reason);
  }

  const absl::Duration left = std::max(absl::Seconds(1), join_deadline - absl::Now());
  switch (choice->backend) {
    case GpuBackend::kCudaP2p: {
      CudaP2pOptions options;
      options.device = mine.device;
      options.allow_shared_device = spec.allow_shared_device;
      options.init_timeout = left;
      return CreateCudaP2pCommunicator(options, *bootstrap);
    }
    case GpuBackend::kHostStaged: {
      HostStagedOptions options;
      options.device = mine.device;
      options.shm_name = spec.shm_name;
      options.init_timeout = left;
      return CreateHostStagedCommunicator(options, *bootstrap);
    }
    case GpuBackend::kNccl: {
#if defined(EXL3_HAVE_NCCL)
      NcclOptions options = spec.nccl;
      options.device = mine.device;
      options.stream = nullptr;
      options.init_timeout = left;
      return CreateNcclCommunicator(options, *bootstrap);
#else
      break;
#endif
    }
  }
  return absl::InternalError(absl::StrCat("communicator: backend ",
                                          GpuBackendName(choice->backend),
                                          " chosen but not built"));
#endif  // EXL3_HAVE_CUDA
}

}  // namespace exl3serve::worker::comm
