// worker/comm/gpu_rank_info.h — the set-up exchange the GPU backends (nccl,
// cuda_p2p) share: each rank describes itself (its set-up status so far, host,
// GPU, a backend payload such as the NCCL unique id or CUDA IPC handles) and
// receives everyone's description through the Bootstrap. Internal to
// worker/comm.
//
//   GpuRankInfo mine = ...;                       // status = what went wrong locally, if anything
//   EXL3_ASSIGN_OR_RETURN(std::vector<GpuRankInfo> all,
//                         ExchangeGpuRankInfo(bootstrap, mine, deadline, "nccl"));
//
// Why a rank that already failed still takes part: the Communicator contract
// asks for consistent failure. A rank without a device that simply returned
// would leave its peers waiting in the Bootstrap until their deadline; by
// sending its failure instead, every rank of the group fails at once, with the
// same reason (naming the rank that failed).
//
// Thread safety: the functions are thread-safe; the Bootstrap is used by one
// thread at a time, as its contract requires.
#ifndef EXL3SERVE_WORKER_COMM_GPU_RANK_INFO_H_
#define EXL3SERVE_WORKER_COMM_GPU_RANK_INFO_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"

namespace exl3serve::worker::comm::internal {

struct GpuRankInfo {
  // OK, or why this rank cannot go on (its peers then fail with this reason).
  absl::Status status;
  // "<hostname>/<boot id>": equal for ranks on the same machine (and kernel).
  std::string host_id;
  // cudaDeviceGetPCIBusId of the rank's device ("0000:41:00.0"); names a GPU
  // independently of CUDA_VISIBLE_DEVICES.
  std::string pci_bus_id;
  // The CUDA ordinal in the rank's own process (for messages only).
  int device = -1;
  // Backend data (NCCL unique id, IPC handles, peer-access row), opaque here.
  std::string payload;
};

// Binary encoding for the Bootstrap (length-prefixed fields behind a magic).
std::string EncodeGpuRankInfo(const GpuRankInfo& info);
// InvalidArgument for a blob that is not an encoded GpuRankInfo.
absl::StatusOr<GpuRankInfo> DecodeGpuRankInfo(std::string_view blob);

// One Bootstrap::AllGather of every rank's `mine`. Returns all ranks' infos
// (index = rank) when every rank reported OK. Otherwise, on every rank: this
// rank's own status if it failed ("<backend>: rank R: <message>"), else the
// first failing peer's status code with the message "<backend>: rank R
// failed set-up: <its message>".
// Bootstrap errors come back annotated with "<backend>: <what>".
absl::StatusOr<std::vector<GpuRankInfo>> ExchangeGpuRankInfo(Bootstrap& bootstrap,
                                                             const GpuRankInfo& mine,
                                                             absl::Time deadline,
                                                             std::string_view backend,
                                                             std::string_view what);

// "<hostname>/<boot id>" of this machine (boot id from
// /proc/sys/kernel/random/boot_id, empty when unreadable).
std::string LocalHostId();

// Host-side wait between polls of an asynchronous operation: yields for the
// first kSpinPolls polls (a decode-size collective finishes within tens of
// microseconds), then sleeps 10 us doubling up to 1 ms, so a call overshoots
// its deadline by at most about 1 ms. Confined to one thread.
class PollBackoff {
 public:
  void Wait();

 private:
  static constexpr int kSpinPolls = 2000;
  int polls_ = 0;
  int64_t sleep_us_ = 10;
};

// The bound on a GPU backend's creation: `init_timeout` from now, or 10 s
// when it is not positive (so that the exchange reporting that bad option is
// bounded too).
absl::Time GpuSetupDeadline(absl::Duration init_timeout);

// FailedPrecondition ("<backend>: ranks A and B both use GPU X on host H;
// <hint>") for the first two ranks on one host with one PCI bus id, else OK.
absl::Status CheckOneGpuPerRank(const std::vector<GpuRankInfo>& infos, std::string_view backend,
                                std::string_view hint);

#if defined(EXL3_HAVE_CUDA)
// The first set-up report every GPU backend sends: this host's id, status =
// `validation` (the backend's own option checks) and, when that is OK, the
// device picked by DescribeLocalGpu(device, option_name) (its failure
// becomes the status). Never fails itself: the report carries the failure.
GpuRankInfo DescribeLocalRank(absl::Status validation, int device, std::string_view option_name);

// This rank's row of the peer-access matrix over `infos` (index = rank):
// '1' where `mine`'s device reaches the rank's GPU peer-to-peer (or it is the
// same GPU), '0' otherwise, including a GPU not visible in this process
// (CUDA_VISIBLE_DEVICES). Probed with cudaDeviceCanAccessPeer.
std::string ProbePeerAccess(const std::vector<GpuRankInfo>& infos, const GpuRankInfo& mine);

// Picks the device (`requested` >= 0, or the thread's current device for -1),
// makes it current and fills device and pci_bus_id. FailedPrecondition when
// no device is usable ("no CUDA device: ...") or `requested` is not a visible
// ordinal; `option_name` (e.g. "nccl.device") is named in that message.
absl::Status DescribeLocalGpu(int requested, std::string_view option_name, GpuRankInfo* info);
#endif

}  // namespace exl3serve::worker::comm::internal

#endif  // EXL3SERVE_WORKER_COMM_GPU_RANK_INFO_H_
