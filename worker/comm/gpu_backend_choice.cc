#include "worker/comm/gpu_backend_choice.h"

#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace exl3serve::worker::comm {
namespace {

constexpr int kCudaP2pMaxRanks = 8;     // cuda_p2p_kernels.h kP2pMaxRanks
constexpr int kHostStagedMaxRanks = 64;  // shm_communicator.h kShmMaxWorldSize

// What the table needs, derived once from the probe.
struct Facts {
  int world = 0;
  int hosts = 0;
  // First pair of ranks on one GPU (same host and bus id), or {-1, -1}.
  std::pair<int, int> shared = {-1, -1};
  // Pairs of distinct GPUs on one host, and those lacking access either way.
  int gpu_pairs = 0;
  std::vector<std::pair<int, int>> missing;
};

Facts Derive(const GpuGroupProbe& p) {
  Facts f;
  f.world = static_cast<int>(p.host_ids.size());
  f.hosts = static_cast<int>(std::set<std::string>(p.host_ids.begin(), p.host_ids.end()).size());
  for (int i = 0; i < f.world; ++i) {
    for (int j = i + 1; j < f.world; ++j) {
      if (p.host_ids[i] != p.host_ids[j]) continue;
      if (p.pci_bus_ids[i] == p.pci_bus_ids[j]) {
        if (f.shared.first < 0) f.shared = {i, j};
        continue;
      }
      ++f.gpu_pairs;
      if (!p.can_access[i][j] || !p.can_access[j][i]) f.missing.emplace_back(i, j);
    }
  }
  return f;
}

std::string SharedText(const GpuGroupProbe& p, const Facts& f) {
  return absl::StrCat("ranks ", f.shared.first, " and ", f.shared.second, " share GPU ",
                      p.pci_bus_ids[f.shared.first]);
}

std::string MissingText(const GpuGroupProbe& p, const Facts& f) {
  const auto [i, j] = f.missing.front();
  return absl::StrCat("GPU ", p.pci_bus_ids[i], " (rank ", i, ") and GPU ", p.pci_bus_ids[j],
                      " (rank ", j, ") have no peer-to-peer access");
}

absl::Status CheckShape(const GpuGroupProbe& p) {
  const size_t n = p.host_ids.size();
  if (n == 0) return absl::InvalidArgumentError("gpu backend choice: the probe has no ranks");
  if (p.pci_bus_ids.size() != n || p.can_access.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu backend choice: the probe has ", n, " host ids, ", p.pci_bus_ids.size(),
        " GPU ids and ", p.can_access.size(), " peer-access rows"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (p.can_access[i].size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("gpu backend choice: peer-access row ", i,
                                                     " has ", p.can_access[i].size(),
                                                     " entries for ", n, " ranks"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GpuBackendChoice> CheckCudaP2p(const GpuGroupProbe& p, const Facts& f,
                                              bool allow_shared) {
  if (f.hosts > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda_p2p: the ranks are on ", f.hosts, " hosts; cuda_p2p works inside one host (use "
        "nccl or auto)"));
  }
  if (f.world > kCudaP2pMaxRanks) {
    return absl::UnimplementedError(absl::StrCat("cuda_p2p supports 1 to ", kCudaP2pMaxRanks,
                                                 " ranks, got ", f.world,
                                                 " (use host_staged, nccl or auto)"));
  }
  if (f.shared.first >= 0 && !allow_shared) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda_p2p: ", SharedText(p, f),
        "; give each rank its own GPU or allow shared devices (time-sliced, slow)"));
  }
  if (!f.missing.empty()) {
    return absl::UnimplementedError(absl::StrCat("cuda_p2p: ", MissingText(p, f),
                                                 " (use host_staged, nccl or auto)"));
  }
  return GpuBackendChoice{GpuBackend::kCudaP2p,
                          absl::StrCat("requested; ", f.world, " ranks on one host, peer access "
                                       "between every pair of GPUs")};
}

absl::StatusOr<GpuBackendChoice> CheckHostStaged(const Facts& f, std::string reason) {
  if (f.hosts > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "host_staged: the ranks are on ", f.hosts,
        " hosts; host_staged works inside one host (use nccl or auto)"));
  }
  if (f.world > kHostStagedMaxRanks) {
    return absl::UnimplementedError(absl::StrCat("host_staged supports 1 to ",
                                                 kHostStagedMaxRanks, " ranks, got ", f.world));
  }
  return GpuBackendChoice{GpuBackend::kHostStaged, std::move(reason)};
}

absl::StatusOr<GpuBackendChoice> CheckNccl(const GpuGroupProbe& p, const Facts& f,
                                           bool nccl_built, std::string reason) {
  if (!nccl_built) {
    return absl::UnimplementedError(absl::StrCat(
        "nccl: this exl3serve was built without NCCL (", reason, ")"));
  }
  if (f.shared.first >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "nccl: ", SharedText(p, f), "; NCCL needs one GPU per rank (", reason, ")"));
  }
  return GpuBackendChoice{GpuBackend::kNccl, std::move(reason)};
}

}  // namespace

const char* GpuBackendName(GpuBackend backend) {
  switch (backend) {
    case GpuBackend::kCudaP2p:
      return "cuda_p2p";
    case GpuBackend::kHostStaged:
      return "host_staged";
    case GpuBackend::kNccl:
      return "nccl";
  }
  return "?";
}

absl::StatusOr<GpuBackendChoice> ChooseGpuBackend(const GpuGroupProbe& probe,
                                                  const GpuBackendPolicy& policy) {
  const std::string& req = policy.requested;
  if (req != "auto" && req != "cuda_p2p" && req != "host_staged" && req != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu backend: unknown backend `", req, "` (expected auto, cuda_p2p, host_staged or nccl)"));
  }
  if (policy.no_p2p_fallback != "host_staged" && policy.no_p2p_fallback != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu backend: no-P2P fallback must be host_staged or nccl, got `",
                     policy.no_p2p_fallback, "`"));
  }
  if (absl::Status shape = CheckShape(probe); !shape.ok()) return shape;
  const Facts f = Derive(probe);

  if (req == "cuda_p2p") return CheckCudaP2p(probe, f, policy.allow_shared_device);
  if (req == "host_staged") return CheckHostStaged(f, "requested");
  if (req == "nccl") return CheckNccl(probe, f, policy.nccl_built, "requested");

  // auto
  if (f.hosts > 1) {
    return CheckNccl(probe, f, policy.nccl_built,
                     absl::StrCat("auto: ranks on ", f.hosts, " hosts"));
  }
  if (f.shared.first >= 0 && !policy.allow_shared_device) {
    return CheckHostStaged(f, absl::StrCat("auto: ", SharedText(probe, f),
                                           " and shared devices are not allowed for cuda_p2p"));
  }
  if (f.world <= kCudaP2pMaxRanks && f.missing.empty()) {
    return GpuBackendChoice{
        GpuBackend::kCudaP2p,
        f.gpu_pairs == 0
            ? absl::StrCat("auto: ", f.world, " rank(s) on one host, no pair of distinct GPUs")
            : absl::StrCat("auto: ", f.world, " ranks on one host, peer access between all ",
                           f.gpu_pairs, " pairs of GPUs")};
  }
  const std::string why = f.world > kCudaP2pMaxRanks
                              ? absl::StrCat(f.world, " ranks (cuda_p2p takes at most ",
                                             kCudaP2pMaxRanks, ")")
                              : MissingText(probe, f);
  if (policy.no_p2p_fallback == "nccl") {
    if (policy.nccl_built && f.shared.first < 0) {
      return GpuBackendChoice{GpuBackend::kNccl,
                              absl::StrCat("auto: ", why, "; fallback nccl as configured")};
    }
    return CheckHostStaged(
        f, absl::StrCat("auto: ", why, "; fallback nccl configured but ",
                        policy.nccl_built ? SharedText(probe, f) : "NCCL is not built",
                        ", so host_staged"));
  }
  return CheckHostStaged(f, absl::StrCat("auto: ", why, "; fallback host_staged"));
}

std::string DescribeGpuGroupProbe(const GpuGroupProbe& probe) {
  if (!CheckShape(probe).ok()) return "malformed probe";
  const Facts f = Derive(probe);
  std::vector<std::string> missing;
  for (const auto& [i, j] : f.missing) missing.push_back(absl::StrCat(i, "-", j));
  const int reachable = f.gpu_pairs - static_cast<int>(f.missing.size());
  std::string text =
      absl::StrCat(f.world, " ranks on ", f.hosts, f.hosts == 1 ? " host" : " hosts", "; GPUs ",
                   absl::StrJoin(probe.pci_bus_ids, ","), "; peer access: ", reachable, " of ",
                   f.gpu_pairs, " pairs");
  if (!missing.empty()) absl::StrAppend(&text, " (missing: ", absl::StrJoin(missing, ", "), ")");
  if (f.shared.first >= 0) absl::StrAppend(&text, "; shared GPU: ranks ", f.shared.first, ",",
                                           f.shared.second);
  return text;
}

}  // namespace exl3serve::worker::comm
