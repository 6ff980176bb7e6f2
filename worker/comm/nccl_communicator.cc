#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/gpu_rank_info.h"

namespace exl3serve::worker::comm {
namespace {

using internal::GpuRankInfo;
using internal::PollBackoff;
using kernels::cuda::CudaStatus;

// Variables a dedicated NcclOptions field owns, with that field's name (for
// the message when extra_env names one of them).
constexpr std::pair<const char*, const char*> kDedicatedVariables[] = {
    {"NCCL_SOCKET_IFNAME", "nccl.socket_ifname"},
    {"NCCL_SOCKET_FAMILY", "nccl.socket_family"},
    {"NCCL_IB_DISABLE", "nccl.enable_ib"},
    {"NCCL_IB_HCA", "nccl.ib_hca"},
    {"NCCL_IB_GID_INDEX", "nccl.ib_gid_index"},
    {"NCCL_IB_TC", "nccl.ib_traffic_class"},
    {"NCCL_NET_PLUGIN", "nccl.net_plugin"},
    {"NCCL_NET", "nccl.net_name"},
    {"NCCL_P2P_DISABLE", "nccl.enable_p2p_transport"},
    {"NCCL_SHM_DISABLE", "nccl.enable_shm_transport"},
    {"NCCL_ALGO", "nccl.algorithm"},
    {"NCCL_DEBUG", "nccl.debug_level"},
    {"NCCL_COMM_BLOCKING", "(none: the communicator is always non-blocking)"},
};

bool OneOf(const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (value == a) return true;
  }
  return false;
}

absl::Status CheckPrintable(const std::string& value, const char* field) {
  for (char c : value) {
    if (c == '\0' || c == '\n' || c == '\r') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must not contain NUL or line breaks, got '", value, "'"));
    }
  }
  return absl::OkStatus();
}

// NCCL result -> Status, naming what we were doing and NCCL's last error
// text. The code says whose fault it was (style.md's table).
absl::Status NcclStatus(ncclResult_t result, std::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat("nccl: ", std::string(what), ": ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(nullptr);  // `comm` is unused by NCCL
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  switch (result) {
    case ncclSystemError:  // a socket, a peer's process or the network failed
    case ncclRemoteError:  // a peer reported a failure
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:  // we validated the arguments: a bug of ours
    case ncclUnhandledCudaError:
    case ncclInternalError:
    default:
      return absl::InternalError(message);
  }
}

ncclDataType_t NcclType(CommDataType type) {
  return type == CommDataType::kBF16 ? ncclBfloat16 : ncclFloat32;
}

// Which NCCL variables this process has set, and to what: NCCL caches most of
// them at its first initialisation, so a later communicator cannot change them.
struct AppliedEnvironment {
  absl::Mutex mu;
  std::map<std::string, std::string> values ABSL_GUARDED_BY(mu);
};

AppliedEnvironment& Applied() {
  static AppliedEnvironment* applied = new AppliedEnvironment();
  return *applied;
}

absl::Status CheckEnvironmentConflicts(AppliedEnvironment& applied,
                                       const std::vector<std::pair<std::string, std::string>>& env)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(applied.mu) {
  for (const auto& [name, value] : env) {
    auto it = applied.values.find(name);
    if (it != applied.values.end() && it->second != value) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nccl: ", name, " was set to '", it->second,
          "' for an earlier NCCL communicator of this process and NCCL reads it only once; "
          "this one asks for '",
          value,
          "' (give every communicator of a process the same "
          "nccl settings)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNcclEnvironment(const std::vector<std::pair<std::string, std::string>>& env) {
  AppliedEnvironment& applied = Applied();
  absl::MutexLock lock(&applied.mu);
  return CheckEnvironmentConflicts(applied, env);
}

// setenv for every assignment (NCCL reads its settings only from the
// environment). Called right before ncclCommInitRankConfig.
absl::Status ApplyNcclEnvironment(const std::vector<std::pair<std::string, std::string>>& env) {
  AppliedEnvironment& applied = Applied();
  absl::MutexLock lock(&applied.mu);
  EXL3_RETURN_IF_ERROR(CheckEnvironmentConflicts(applied, env));
  for (const auto& [name, value] : env) {
    if (const char* before = std::getenv(name.c_str()); before != nullptr && value != before) {
      EXL3_LOG(kWarning) << "nccl: the configuration overrides " << name << "='" << before
                         << "' from the environment with '" << value << "'";
    }
    if (setenv(name.c_str(), value.c_str(), /*overwrite=*/1) != 0) {
      return absl::InternalError(
          absl::StrCat("nccl: setenv(", name, ") failed: ", std::strerror(errno)));
    }
    applied.values[name] = value;
  }
  if (!env.empty()) {
    std::string line;
    for (const auto& [name, value] : env) absl::StrAppend(&line, " ", name, "=", value);
    EXL3_LOG(kInfo) << "nccl: settings applied before init:" << line;
  }
  return absl::OkStatus();
}

// Owns the NCCL communicator and the CUDA objects of one rank.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, int device, NcclOptions options)
      : rank_(rank), world_size_(world_size), device_(device), options_(std::move(options)) {}
  ~NcclCommunicator() override;

  // Runs ncclCommInitRankConfig and creates the stream, event and scratch.
  absl::Status Init(const ncclUniqueId& id, absl::Time deadline);

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend_name() const override { return "nccl"; }

  absl::Status AllReduce(void* data, size_t count, CommDataType type, absl::Time deadline) override;
  absl::Status AllGather(const void* send, size_t bytes, void* recv, absl::Time deadline) override;
  absl::Status AllGatherV(const void* send, std::span<const size_t> bytes_per_rank, void* recv,
                          absl::Time deadline) override;
  absl::Status ReduceScatter(const void* data, size_t count, CommDataType type, void* recv,
                             absl::Time deadline) override;
  absl::Status AllToAllV(const void* send, std::span<const size_t> send_bytes, void* recv,
                         std::span<const size_t> recv_bytes, absl::Time deadline) override;
  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Time deadline) override;
  absl::Status Barrier(absl::Time deadline) override;
  void Abort(const absl::Status& reason) override;
  absl::Status health() const override;

 private:
  // Aborted once broken; otherwise makes the device current on this thread.
  absl::Status Begin();
  // After an enqueue returned `result`: waits for NCCL to accept the work
  // (non-blocking mode), then, unless the stream is capturing a graph, for
  // the stream to finish it. Any failure breaks the communicator.
  absl::Status Complete(const char* op, ncclResult_t result, absl::Time deadline);
  // Polls ncclCommGetAsyncError until it leaves ncclInProgress.
  absl::Status WaitAccepted(const char* op, absl::Time deadline);
  // Records `status` as the first failure (if none yet), aborts the NCCL
  // communicator and returns `status`.
  absl::Status Fail(absl::Status status);
  absl::Status DeadlineError(const char* op) const;
  absl::Status BrokenError() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after Init.
  const int rank_;
  const int world_size_;
  const int device_;
  const NcclOptions options_;  // keeps the strings ncclConfig_t points to alive
  ncclConfig_t config_ = NCCL_CONFIG_INITIALIZER;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t done_ = nullptr;
  float* barrier_scratch_ = nullptr;  // one float, always 0

  // Every NCCL call on comm_ happens under mu_, so Abort() from another
  // thread never races a call on a communicator it frees.
  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

NcclCommunicator::~NcclCommunicator() {
  int saved_device = -1;
  const bool restore = cudaGetDevice(&saved_device) == cudaSuccess;
  cudaSetDevice(device_);
  {
    absl::MutexLock lock(&mu_);
    if (comm_ != nullptr) {
      // Graceful: finalize (flushes; non-blocking), then destroy; abort when
      // the group does not quiesce within a few seconds.
      const ncclResult_t finalize = ncclCommFinalize(comm_);
      ncclResult_t state = finalize;
      const absl::Time until = absl::Now() + absl::Seconds(5);
      PollBackoff backoff;
      while (state == ncclInProgress && absl::Now() < until) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        if (state == ncclInProgress) backoff.Wait();
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
  }
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
  if (owns_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
  if (restore) cudaSetDevice(saved_device);
}

absl::Status NcclCommunicator::Init(const ncclUniqueId& id, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "nccl: cudaSetDevice"));
  if (options_.stream != nullptr) {
    stream_ = options_.stream;
  } else {
    EXL3_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                    "nccl: creating the stream"));
    owns_stream_ = true;
  }
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming),
                                  "nccl: creating the completion event"));
  void* scratch = nullptr;
  EXL3_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&scratch, sizeof(float)), "nccl: allocating the barrier scratch"));
  barrier_scratch_ = static_cast<float*>(scratch);
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaMemset(barrier_scratch_, 0, sizeof(float)),
                                  "nccl: clearing the barrier scratch"));

  config_.blocking = 0;  // calls return ncclInProgress; we poll with a deadline
  if (!options_.net_name.empty()) config_.netName = options_.net_name.c_str();
  if (!options_.comm_name.empty()) config_.commName = options_.comm_name.c_str();
  if (options_.ib_traffic_class >= 0) config_.trafficClass = options_.ib_traffic_class;

  absl::MutexLock lock(&mu_);
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRankConfig(&comm, world_size_, id, rank_, &config_);
  if (result != ncclSuccess && result != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclStatus(
        result, absl::StrCat("ncclCommInitRankConfig (rank ", rank_, " of ", world_size_, ")"));
  }
  ncclResult_t state = ncclInProgress;
  PollBackoff backoff;
  while (true) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state != ncclInProgress) break;
    if (absl::Now() > deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl: ncclCommInitRankConfig (rank ", rank_, " of ", world_size_,
          ") did not finish within nccl.init_timeout ", absl::FormatDuration(options_.init_timeout),
          "; some rank may not have started, or the ranks cannot reach each other (check "
          "nccl.socket_ifname and nccl.enable_ib)"));
    }
    backoff.Wait();
  }
  if (state != ncclSuccess) {
    ncclCommAbort(comm);
    return NcclStatus(state, absl::StrCat("initialising the communicator (rank ", rank_, " of ",
                                          world_size_, ")"));
  }
  comm_ = comm;
  return absl::OkStatus();
}

absl::Status NcclCommunicator::BrokenError() const {
  return absl::AbortedError(absl::StrCat("communicator broken: ", broken_.message()));
}

absl::Status NcclCommunicator::Begin() {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok() || comm_ == nullptr) return BrokenError();
  }
  return CudaStatus(cudaSetDevice(device_), "nccl: cudaSetDevice");
}

absl::Status NcclCommunicator::Fail(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = status;
  if (comm_ != nullptr) {
    // Also stops our kernels still waiting for peers; the comm is freed.
    const ncclResult_t result = ncclCommAbort(comm_);
    if (result != ncclSuccess && result != ncclInProgress) {
      EXL3_LOG(kWarning) << NcclStatus(result, "ncclCommAbort").message();
    }
    comm_ = nullptr;
  }
  return status;
}

absl::Status NcclCommunicator::DeadlineError(const char* op) const {
  return absl::DeadlineExceededError(absl::StrCat(
      "nccl: ", op, " on rank ", rank_, " of ", world_size_,
      " did not complete before its deadline (NCCL cannot tell which ranks are missing); "
      "the communicator is aborted"));
}

absl::Status NcclCommunicator::WaitAccepted(const char* op, absl::Time deadline) {
  PollBackoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    {
      absl::MutexLock lock(&mu_);
      if (comm_ == nullptr) return BrokenError();  // aborted from another thread
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return Fail(NcclStatus(state, op));
    if (absl::Now() > deadline) return Fail(DeadlineError(op));
    backoff.Wait();
  }
}

absl::Status NcclCommunicator::Complete(const char* op, ncclResult_t result, absl::Time deadline) {
  if (result != ncclSuccess && result != ncclInProgress) return Fail(NcclStatus(result, op));
  EXL3_RETURN_IF_ERROR(WaitAccepted(op, deadline));

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (absl::Status s =
          CudaStatus(cudaStreamIsCapturing(stream_, &capture), "nccl: cudaStreamIsCapturing");
      !s.ok()) {
    return Fail(s);
  }
  if (capture != cudaStreamCaptureStatusNone) return absl::OkStatus();  // replayed later

  if (absl::Status s = CudaStatus(cudaEventRecord(done_, stream_), "nccl: cudaEventRecord");
      !s.ok()) {
    return Fail(s);
  }
  PollBackoff backoff;
  while (true) {
    const cudaError_t query = cudaEventQuery(done_);
    if (query == cudaSuccess) return absl::OkStatus();
    if (query != cudaErrorNotReady) {
      return Fail(CudaStatus(query, absl::StrCat("nccl: waiting for ", op)));
    }
    ncclResult_t state = ncclSuccess;
    {
      absl::MutexLock lock(&mu_);
      if (comm_ == nullptr) return BrokenError();
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    }
    if (state != ncclSuccess && state != ncclInProgress) return Fail(NcclStatus(state, op));
    if (absl::Now() > deadline) return Fail(DeadlineError(op));
    backoff.Wait();
  }
}

absl::Status NcclCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                         absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) {
    return Fail(absl::InvalidArgumentError("nccl: all_reduce of a null buffer"));
  }
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclAllReduce(data, data, count, NcclType(type), ncclSum, comm_, stream_);
  }
  return Complete("all_reduce", result, deadline);
}

absl::Status NcclCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                         absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (bytes == 0) return absl::OkStatus();
  if (send == nullptr || recv == nullptr) {
    return Fail(absl::InvalidArgumentError("nccl: all_gather with a null buffer"));
  }
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_);
  }
  return Complete("all_gather", result, deadline);
}

absl::Status NcclCommunicator::AllGatherV(const void* send, std::span<const size_t> bytes_per_rank,
                                          void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (static_cast<int>(bytes_per_rank.size()) != world_size_) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("nccl: all_gather_v needs ", world_size_,
                                                        " sizes, got ", bytes_per_rank.size())));
  }
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  if (total == 0) return absl::OkStatus();
  if (recv == nullptr || (bytes_per_rank[rank_] > 0 && send == nullptr)) {
    return Fail(absl::InvalidArgumentError("nccl: all_gather_v with a null buffer"));
  }
  // One broadcast per contributing rank, fused into one group (NCCL runs
  // them concurrently); the root's send goes straight to its own slot.
  ncclResult_t result = ncclSuccess;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclGroupStart();
    size_t offset = 0;
    for (int r = 0; r < world_size_ && result == ncclSuccess; ++r) {
      const size_t n = bytes_per_rank[r];
      char* slot = static_cast<char*>(recv) + offset;
      offset += n;
      if (n == 0) continue;
      result = ncclBroadcast(r == rank_ ? send : slot, slot, n, ncclUint8, r, comm_, stream_);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (result == ncclSuccess) result = end;
  }
  return Complete("all_gather_v", result, deadline);
}

absl::Status NcclCommunicator::ReduceScatter(const void* data, size_t count, CommDataType type,
                                             void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr || recv == nullptr) {
    return Fail(absl::InvalidArgumentError("nccl: reduce_scatter with a null buffer"));
  }
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclReduceScatter(data, recv, count, NcclType(type), ncclSum, comm_, stream_);
  }
  return Complete("reduce_scatter", result, deadline);
}

absl::Status NcclCommunicator::AllToAllV(const void* send, std::span<const size_t> send_bytes,
                                         void* recv, std::span<const size_t> recv_bytes,
                                         absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (static_cast<int>(send_bytes.size()) != world_size_ ||
      static_cast<int>(recv_bytes.size()) != world_size_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("nccl: all_to_all_v needs ", world_size_, " send and recv sizes, got ",
                     send_bytes.size(), " and ", recv_bytes.size())));
  }
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("nccl: all_to_all_v: rank ", rank_,
                                                        " sends ", send_bytes[rank_],
                                                        " bytes to itself but "
                                                        "expects to receive ",
                                                        recv_bytes[rank_])));
  }
  size_t send_total = 0, recv_total = 0;
  for (int p = 0; p < world_size_; ++p) {
    send_total += send_bytes[p];
    recv_total += recv_bytes[p];
  }
  if ((send_total > 0 && send == nullptr) || (recv_total > 0 && recv == nullptr)) {
    return Fail(absl::InvalidArgumentError("nccl: all_to_all_v with a null buffer"));
  }
  const char* send_bytes_ptr = static_cast<const char*>(send);
  char* recv_bytes_ptr = static_cast<char*>(recv);
  // Our own block: a device copy on the same stream, before the group.
  size_t send_offset = 0, recv_offset = 0;
  for (int p = 0; p < rank_; ++p) {
    send_offset += send_bytes[p];
    recv_offset += recv_bytes[p];
  }
  if (send_bytes[rank_] > 0 && send_bytes_ptr + send_offset != recv_bytes_ptr + recv_offset) {
    if (absl::Status s =
            CudaStatus(cudaMemcpyAsync(recv_bytes_ptr + recv_offset, send_bytes_ptr + send_offset,
                                       send_bytes[rank_], cudaMemcpyDeviceToDevice, stream_),
                       "nccl: all_to_all_v: copying the own block");
        !s.ok()) {
      return Fail(s);
    }
  }
  ncclResult_t result = ncclSuccess;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclGroupStart();
    send_offset = 0;
    recv_offset = 0;
    for (int p = 0; p < world_size_ && result == ncclSuccess; ++p) {
      if (p != rank_ && send_bytes[p] > 0) {
        result =
            ncclSend(send_bytes_ptr + send_offset, send_bytes[p], ncclUint8, p, comm_, stream_);
      }
      if (result == ncclSuccess && p != rank_ && recv_bytes[p] > 0) {
        result =
            ncclRecv(recv_bytes_ptr + recv_offset, recv_bytes[p], ncclUint8, p, comm_, stream_);
      }
      send_offset += send_bytes[p];
      recv_offset += recv_bytes[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    if (result == ncclSuccess) result = end;
  }
  return Complete("all_to_all_v", result, deadline);
}

absl::Status NcclCommunicator::Broadcast(void* data, size_t bytes, int root, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (root < 0 || root >= world_size_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("nccl: broadcast root must be in [0, ", world_size_, "), got ", root)));
  }
  if (bytes == 0) return absl::OkStatus();
  if (data == nullptr) return Fail(absl::InvalidArgumentError("nccl: broadcast of a null buffer"));
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    result = ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_);
  }
  return Complete("broadcast", result, deadline);
}

absl::Status NcclCommunicator::Barrier(absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return BrokenError();
    // A one-element all-reduce of a zero: every rank must arrive.
    result =
        ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32, ncclSum, comm_, stream_);
  }
  return Complete("barrier", result, deadline);
}

void NcclCommunicator::Abort(const absl::Status& reason) {
  // ncclCommAbort makes the communicator's device current itself.
  Fail(reason.ok() ? absl::AbortedError("Abort() called") : reason).IgnoreError();
}

absl::Status NcclCommunicator::health() const {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  if (comm_ == nullptr) return absl::InternalError("nccl: communicator not initialised");
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
  if (state != ncclSuccess && state != ncclInProgress) return NcclStatus(state, "health");
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateNcclOptions(const NcclOptions& options) {
  if (options.device < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.device must be >= -1 (-1: the current device), got ", options.device));
  }
  if (options.init_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("nccl.init_timeout must be > 0, got ",
                                                   absl::FormatDuration(options.init_timeout)));
  }
  if (!OneOf(options.socket_family, {"", "AF_INET", "AF_INET6"})) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.socket_family must be empty, AF_INET or AF_INET6, got '",
                     options.socket_family, "'"));
  }
  if (options.ib_gid_index < -1 || options.ib_gid_index > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.ib_gid_index must be in [0, 255] or -1 (NCCL's default), got ",
                     options.ib_gid_index));
  }
  if (options.ib_traffic_class < -1 || options.ib_traffic_class > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.ib_traffic_class must be in [0, 255] or -1 (NCCL's default), got ",
                     options.ib_traffic_class));
  }
  if (!options.enable_ib && !options.ib_hca.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl.ib_hca is '", options.ib_hca, "' but nccl.enable_ib is false; clear one of them"));
  }
  if (!options.enable_ib && options.ib_gid_index >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.ib_gid_index is ", options.ib_gid_index,
                     " but nccl.enable_ib is false; clear one of them"));
  }
  if (!OneOf(options.algorithm,
             {"", "Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT"})) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl.algorithm must be empty, Ring, Tree, CollnetDirect, CollnetChain, NVLS, NVLSTree "
        "or PAT, got '",
        options.algorithm, "'"));
  }
  if (!OneOf(options.debug_level, {"", "VERSION", "WARN", "INFO", "ABORT", "TRACE"})) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.debug_level must be empty, VERSION, WARN, INFO, ABORT or TRACE, got '",
                     options.debug_level, "'"));
  }
  EXL3_RETURN_IF_ERROR(CheckPrintable(options.socket_ifname, "nccl.socket_ifname"));
  EXL3_RETURN_IF_ERROR(CheckPrintable(options.ib_hca, "nccl.ib_hca"));
  EXL3_RETURN_IF_ERROR(CheckPrintable(options.net_plugin, "nccl.net_plugin"));
  EXL3_RETURN_IF_ERROR(CheckPrintable(options.net_name, "nccl.net_name"));
  EXL3_RETURN_IF_ERROR(CheckPrintable(options.comm_name, "nccl.comm_name"));
  std::map<std::string, int> seen;
  for (const auto& [name, value] : options.extra_env) {
    bool well_formed = name.size() > 5 && name.compare(0, 5, "NCCL_") == 0;
    for (char c : name) {
      if (!((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) well_formed = false;
    }
    if (!well_formed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl.extra_env: variable names must match NCCL_[A-Z0-9_]+, got '", name, "'"));
    }
    for (const auto& [variable, field] : kDedicatedVariables) {
      if (name == variable) {
        return absl::InvalidArgumentError(
            absl::StrCat("nccl.extra_env sets ", name, "; use ", field, " instead"));
      }
    }
    if (seen[name]++ > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl.extra_env sets ", name, " more than once"));
    }
    EXL3_RETURN_IF_ERROR(CheckPrintable(value, "nccl.extra_env value"));
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> NcclEnvironment(const NcclOptions& options) {
  std::vector<std::pair<std::string, std::string>> env;
  if (!options.socket_ifname.empty()) env.emplace_back("NCCL_SOCKET_IFNAME", options.socket_ifname);
  if (!options.socket_family.empty()) env.emplace_back("NCCL_SOCKET_FAMILY", options.socket_family);
  if (!options.enable_ib) env.emplace_back("NCCL_IB_DISABLE", "1");
  if (!options.ib_hca.empty()) env.emplace_back("NCCL_IB_HCA", options.ib_hca);
  if (options.ib_gid_index >= 0) {
    env.emplace_back("NCCL_IB_GID_INDEX", std::to_string(options.ib_gid_index));
  }
  if (!options.net_plugin.empty()) env.emplace_back("NCCL_NET_PLUGIN", options.net_plugin);
  if (!options.enable_p2p_transport) env.emplace_back("NCCL_P2P_DISABLE", "1");
  if (!options.enable_shm_transport) env.emplace_back("NCCL_SHM_DISABLE", "1");
  if (!options.algorithm.empty()) env.emplace_back("NCCL_ALGO", options.algorithm);
  if (!options.debug_level.empty()) env.emplace_back("NCCL_DEBUG", options.debug_level);
  for (const auto& kv : options.extra_env) env.push_back(kv);
  return env;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options,
                                                                     Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  // The set-up exchange is bounded even when init_timeout itself is invalid.
  const absl::Time deadline = internal::GpuSetupDeadline(options.init_timeout);

  // 1. Local checks; a failure still takes part in the exchange (see
  //    gpu_rank_info.h) so that every rank fails with it.
  absl::Status valid = ValidateNcclOptions(options);
  std::vector<std::pair<std::string, std::string>> env;
  if (valid.ok()) {
    env = NcclEnvironment(options);
    valid = CheckNcclEnvironment(env);
  }
  GpuRankInfo mine = internal::DescribeLocalRank(std::move(valid), options.device, "nccl.device");
  if (mine.status.ok() && rank == 0) {
    ncclUniqueId id;
    mine.status = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (mine.status.ok()) mine.payload.assign(id.internal, sizeof(id.internal));
  }

  // 2. Exchange statuses, GPU identities and rank 0's unique id.
  EXL3_ASSIGN_OR_RETURN(
      std::vector<GpuRankInfo> infos,
      internal::ExchangeGpuRankInfo(bootstrap, mine, deadline, "nccl", "exchanging the unique id"));
  if (infos[0].payload.size() != sizeof(ncclUniqueId::internal)) {
    return absl::InternalError(absl::StrCat("nccl: rank 0 sent a unique id of ",
                                            infos[0].payload.size(), " bytes, expected ",
                                            sizeof(ncclUniqueId::internal)));
  }
  // 3. NCCL hangs (it does not fail) when two ranks share a GPU: refuse it,
  //    on every rank alike, from the exchanged identities.
  EXL3_RETURN_IF_ERROR(internal::CheckOneGpuPerRank(
      infos, "nccl", "NCCL needs one GPU per rank (set nccl.device per rank)"));
  ncclUniqueId id;
  std::memcpy(id.internal, infos[0].payload.data(), sizeof(id.internal));

  // 4. Settings, then the (non-blocking, deadline-bounded) initialisation.
  EXL3_RETURN_IF_ERROR(ApplyNcclEnvironment(env));
  auto comm = std::make_unique<NcclCommunicator>(rank, world_size, mine.device, options);
  EXL3_RETURN_IF_ERROR(comm->Init(id, deadline));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace exl3serve::worker::comm
