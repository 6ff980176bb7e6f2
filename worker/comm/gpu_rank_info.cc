#include "worker/comm/gpu_rank_info.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#if defined(EXL3_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_status.h"
#endif

namespace exl3serve::worker::comm::internal {
namespace {

constexpr char kMagic[8] = {'E', 'X', 'L', '3', 'G', 'P', 'U', '1'};

void AppendU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void AppendField(std::string& out, std::string_view field) {
  AppendU32(out, static_cast<uint32_t>(field.size()));
  out.append(field.data(), field.size());
}

// Reads fields in order; any overrun sets ok = false and yields empty values.
struct Reader {
  std::string_view rest;
  bool ok = true;

  uint32_t U32() {
    if (rest.size() < 4) {
      ok = false;
      return 0;
    }
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
      v |= static_cast<uint32_t>(static_cast<uint8_t>(rest[i])) << (8 * i);
    rest.remove_prefix(4);
    return v;
  }
  std::string Field() {
    const uint32_t n = U32();
    if (!ok || rest.size() < n) {
      ok = false;
      return {};
    }
    std::string field(rest.substr(0, n));
    rest.remove_prefix(n);
    return field;
  }
};

}  // namespace

std::string EncodeGpuRankInfo(const GpuRankInfo& info) {
  std::string out(kMagic, sizeof(kMagic));
  AppendU32(out, static_cast<uint32_t>(info.status.code()));
  AppendField(out, std::string(info.status.message()));
  AppendField(out, info.host_id);
  AppendField(out, info.pci_bus_id);
  AppendU32(out, static_cast<uint32_t>(info.device));
  AppendField(out, info.payload);
  return out;
}

absl::StatusOr<GpuRankInfo> DecodeGpuRankInfo(std::string_view blob) {
  if (blob.size() < sizeof(kMagic) || std::memcmp(blob.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError("not a GPU set-up blob (bad magic)");
  }
  Reader reader{blob.substr(sizeof(kMagic))};
  GpuRankInfo info;
  const uint32_t code = reader.U32();
  const std::string message = reader.Field();
  info.host_id = reader.Field();
  info.pci_bus_id = reader.Field();
  info.device = static_cast<int>(reader.U32());
  info.payload = reader.Field();
  if (!reader.ok || !reader.rest.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("GPU set-up blob of ", blob.size(),
                                                   " bytes is truncated or has trailing data"));
  }
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(absl::StrCat("GPU set-up blob has status code ", code));
  }
  if (code != 0) {
    info.status = absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  return info;
}

absl::StatusOr<std::vector<GpuRankInfo>> ExchangeGpuRankInfo(Bootstrap& bootstrap,
                                                             const GpuRankInfo& mine,
                                                             absl::Time deadline,
                                                             std::string_view backend,
                                                             std::string_view what) {
  const std::string prefix = absl::StrCat(std::string(backend), ": ", std::string(what));
  absl::StatusOr<std::vector<std::string>> blobs =
      bootstrap.AllGather(EncodeGpuRankInfo(mine), deadline);
  if (!blobs.ok()) return Annotate(blobs.status(), prefix);
  if (static_cast<int>(blobs->size()) != bootstrap.world_size()) {
    return absl::InternalError(absl::StrCat(prefix, ": bootstrap returned ", blobs->size(),
                                            " blobs for world size ", bootstrap.world_size()));
  }
  std::vector<GpuRankInfo> infos;
  infos.reserve(blobs->size());
  for (size_t r = 0; r < blobs->size(); ++r) {
    absl::StatusOr<GpuRankInfo> info = DecodeGpuRankInfo((*blobs)[r]);
    if (!info.ok()) {
      return absl::InternalError(
          absl::StrCat(prefix, ": rank ", r, " sent a malformed blob: ", info.status().message()));
    }
    infos.push_back(*std::move(info));
  }
  if (!mine.status.ok()) {
    return Annotate(mine.status, absl::StrCat(std::string(backend), ": rank ", bootstrap.rank()));
  }
  for (size_t r = 0; r < infos.size(); ++r) {
    if (!infos[r].status.ok()) {
      return absl::Status(infos[r].status.code(),
                          absl::StrCat(std::string(backend), ": rank ", r,
                                       " failed set-up: ", infos[r].status.message()));
    }
  }
  return infos;
}

void PollBackoff::Wait() {
  if (polls_ < kSpinPolls) {
    ++polls_;
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
  sleep_us_ = std::min<int64_t>(sleep_us_ * 2, 1000);
}

std::string LocalHostId() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (in) std::getline(in, boot_id);
  return absl::StrCat(host, "/", boot_id);
}

absl::Time GpuSetupDeadline(absl::Duration init_timeout) {
  return absl::Now() + (init_timeout > absl::ZeroDuration() ? init_timeout : absl::Seconds(10));
}

absl::Status CheckOneGpuPerRank(const std::vector<GpuRankInfo>& infos, std::string_view backend,
                                std::string_view hint) {
  for (size_t a = 0; a < infos.size(); ++a) {
    for (size_t b = a + 1; b < infos.size(); ++b) {
      if (infos[a].host_id == infos[b].host_id && infos[a].pci_bus_id == infos[b].pci_bus_id) {
        return absl::FailedPreconditionError(
            absl::StrCat(std::string(backend), ": ranks ", a, " and ", b, " both use GPU ",
                         infos[a].pci_bus_id, " on host ", infos[a].host_id, "; ",
                         std::string(hint)));
      }
    }
  }
  return absl::OkStatus();
}

#if defined(EXL3_HAVE_CUDA)
GpuRankInfo DescribeLocalRank(absl::Status validation, int device, std::string_view option_name) {
  GpuRankInfo mine;
  mine.host_id = LocalHostId();
  mine.status = std::move(validation);
  if (mine.status.ok()) mine.status = DescribeLocalGpu(device, option_name, &mine);
  return mine;
}

std::string ProbePeerAccess(const std::vector<GpuRankInfo>& infos, const GpuRankInfo& mine) {
  std::string row;
  for (const GpuRankInfo& peer : infos) {
    if (peer.pci_bus_id == mine.pci_bus_id) {
      row.push_back('1');
      continue;
    }
    int device = -1;
    int can_access = 0;
    // The peer's GPU must be visible here (CUDA_VISIBLE_DEVICES) to be reached.
    if (cudaDeviceGetByPCIBusId(&device, peer.pci_bus_id.c_str()) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can_access, mine.device, device) != cudaSuccess) {
      cudaGetLastError();
      can_access = 0;
    }
    row.push_back(can_access != 0 ? '1' : '0');
  }
  return row;
}

absl::Status DescribeLocalGpu(int requested, std::string_view option_name, GpuRankInfo* info) {
  EXL3_RETURN_IF_ERROR(kernels::cuda::CudaDeviceAvailable());
  const int count = kernels::cuda::CudaDeviceCount();
  int device = requested;
  if (device < 0) {
    EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  }
  if (device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(std::string(option_name), " is ", device,
                                                      " but only ", count,
                                                      " CUDA devices are visible"));
  }
  EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(cudaSetDevice(device),
                                                 absl::StrCat("cudaSetDevice(", device, ")")));
  char bus_id[64] = {};
  EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(
      cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id) - 1, device), "cudaDeviceGetPCIBusId"));
  info->device = device;
  info->pci_bus_id = bus_id;
  return absl::OkStatus();
}
#endif

}  // namespace exl3serve::worker::comm::internal
