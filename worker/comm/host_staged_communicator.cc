#include "worker/comm/host_staged_communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/gpu_rank_info.h"
#include "worker/comm/shm_communicator.h"

#if defined(EXL3_HAVE_CUDA)
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "kernels/cuda/cuda_status.h"
#endif

namespace exl3serve::worker::comm {

absl::Status ValidateHostStagedOptions(const HostStagedOptions& options) {
  if (options.device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_staged.device must be >= -1 (-1: the current device), got ", options.device));
  }
  if (options.init_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("host_staged.init_timeout must be > 0, got ",
                                                   absl::FormatDuration(options.init_timeout)));
  }
  if (!options.shm_name.empty() &&
      (options.shm_name[0] != '/' || options.shm_name.size() > 201 ||
       options.shm_name.find('/', 1) != std::string::npos)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_staged.shm_name must be \"/\" and up to 200 characters without \"/\", got `",
        options.shm_name, "`"));
  }
  return absl::OkStatus();
}

#if !defined(EXL3_HAVE_CUDA)

absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedCommunicator(
    const HostStagedOptions& options, Bootstrap& bootstrap) {
  (void)options;
  (void)bootstrap;
  return absl::UnimplementedError(
      "host_staged: exl3serve was built without CUDA (nvcc not found)");
}

#else  // EXL3_HAVE_CUDA

namespace {

using internal::GpuRankInfo;

// How long the destructor waits for copies still in flight before it gives
// up on freeing the pinned staging (leaked rather than freed under a copy).
constexpr absl::Duration kDrainWait = absl::Seconds(5);

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(int rank, int world_size, int device) noexcept
      : rank_(rank), world_size_(world_size), device_(device) {}
  ~HostStagedCommunicator() override;

  // Local resources (stream, event, pinned staging); no peer involved.
  absl::Status Allocate(CUstream_st* stream, size_t staging_bytes);
  void set_shm(std::unique_ptr<Communicator> shm) { shm_ = std::move(shm); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend_name() const override { return "host_staged"; }

  absl::Status AllReduce(void* data, size_t count, CommDataType type,
                         absl::Time deadline) override;
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
  // Broken check, device current, capture check. Fails without breaking the
  // group for a capturing stream (FailedPrecondition).
  absl::Status Begin(const char* op);
  // `body` with any failure turned into a broken group (peers told via shm).
  template <typename Body>
  absl::Status Run(const char* op, Body body);
  // Pinned staging of at least `bytes`.
  absl::Status Reserve(size_t bytes);
  uint8_t* staging() { return static_cast<uint8_t*>(pinned_); }
  // Enqueues one copy on the stream (kind: host<->device).
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
  // Waits for everything on the stream so far, until `deadline`.
  absl::Status WaitStream(const char* op, absl::Time deadline);
  absl::Status Fail(absl::Status status);

  const int rank_;
  const int world_size_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t event_ = nullptr;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  bool copies_pending_ = false;  // a copy may still run (after a deadline)
  std::unique_ptr<Communicator> shm_;

  mutable absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

HostStagedCommunicator::~HostStagedCommunicator() {
  shm_.reset();
  cudaSetDevice(device_);
  bool drained = true;
  if (event_ != nullptr && stream_ != nullptr && cudaEventRecord(event_, stream_) == cudaSuccess) {
    const absl::Time until = absl::Now() + kDrainWait;
    internal::PollBackoff backoff;
    cudaError_t query;
    while ((query = cudaEventQuery(event_)) == cudaErrorNotReady && absl::Now() < until) {
      backoff.Wait();
    }
    drained = query != cudaErrorNotReady;
  } else {
    drained = !copies_pending_;
  }
  if (pinned_ != nullptr) {
    if (drained) {
      cudaFreeHost(pinned_);
    } else {
      EXL3_LOG(kWarning) << "host_staged: rank " << rank_ << ": copies still running after "
                         << absl::FormatDuration(kDrainWait) << "; leaking "
                         << pinned_bytes_ << " bytes of pinned staging";
    }
  }
  if (event_ != nullptr) cudaEventDestroy(event_);
  if (owns_stream_ && stream_ != nullptr && drained) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

absl::Status HostStagedCommunicator::Allocate(CUstream_st* stream, size_t staging_bytes) {
  EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  if (stream != nullptr) {
    stream_ = stream;
  } else {
    EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    owns_stream_ = true;
  }
  EXL3_RETURN_IF_ERROR(kernels::cuda::CudaStatus(
      cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"));
  return Reserve(std::max<size_t>(staging_bytes, 4096));
}

absl::Status HostStagedCommunicator::Reserve(size_t bytes) {
  if (bytes <= pinned_bytes_) return absl::OkStatus();
  // Every earlier copy has completed (calls wait for theirs), so the old
  // staging can go.
  const size_t grown = std::max(bytes, pinned_bytes_ * 2);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  pinned_ = nullptr;
  pinned_bytes_ = 0;
  const cudaError_t error = cudaHostAlloc(&pinned_, grown, cudaHostAllocPortable);
  if (error != cudaSuccess) {
    cudaGetLastError();
    pinned_ = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("host_staged: rank ", rank_,
                                                     ": cudaHostAlloc(", grown, " bytes): ",
                                                     cudaGetErrorString(error)));
  }
  pinned_bytes_ = grown;
  return absl::OkStatus();
}

absl::Status HostStagedCommunicator::Copy(void* dst, const void* src, size_t bytes,
                                          cudaMemcpyKind kind) {
  if (bytes == 0) return absl::OkStatus();
  copies_pending_ = true;
  return kernels::cuda::CudaStatus(cudaMemcpyAsync(dst, src, bytes, kind, stream_),
                                   "host_staged: cudaMemcpyAsync");
}

absl::Status HostStagedCommunicator::WaitStream(const char* op, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(
      kernels::cuda::CudaStatus(cudaEventRecord(event_, stream_), "host_staged: cudaEventRecord"));
  internal::PollBackoff backoff;
  while (true) {
    const cudaError_t query = cudaEventQuery(event_);
    if (query == cudaSuccess) {
      copies_pending_ = false;
      return absl::OkStatus();
    }
    if (query != cudaErrorNotReady) {
      return kernels::cuda::CudaStatus(query, absl::StrCat("host_staged: ", op, ": stream"));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("host_staged: ", op, ": rank ", rank_,
                       "'s device work and copies did not finish by the deadline"));
    }
    backoff.Wait();
  }
}

absl::Status HostStagedCommunicator::Begin(const char* op) {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::AbortedError(absl::StrCat("communicator broken: ", broken_.message()));
    }
  }
  EXL3_RETURN_IF_ERROR(Fail(kernels::cuda::CudaStatus(cudaSetDevice(device_), "cudaSetDevice")));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EXL3_RETURN_IF_ERROR(Fail(kernels::cuda::CudaStatus(
      cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing")));
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        absl::StrCat("host_staged: ", op, " cannot be captured into a CUDA graph (the host takes "
                     "part in every call); use cuda_p2p or nccl for graphs"));
  }
  return absl::OkStatus();
}

absl::Status HostStagedCommunicator::Fail(absl::Status status) {
  if (status.ok()) return status;
  {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
  }
  if (shm_ != nullptr) shm_->Abort(status);
  return status;
}

template <typename Body>
absl::Status HostStagedCommunicator::Run(const char* op, Body body) {
  EXL3_RETURN_IF_ERROR(Begin(op));
  return Fail(body());
}

absl::Status HostStagedCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                               absl::Time deadline) {
  return Run("AllReduce", [&]() -> absl::Status {
    const size_t bytes = count * CommDataTypeSize(type);
    EXL3_RETURN_IF_ERROR(Reserve(bytes));
    EXL3_RETURN_IF_ERROR(Copy(staging(), data, bytes, cudaMemcpyDeviceToHost));
    EXL3_RETURN_IF_ERROR(WaitStream("AllReduce", deadline));
    EXL3_RETURN_IF_ERROR(shm_->AllReduce(staging(), count, type, deadline));
    EXL3_RETURN_IF_ERROR(Copy(data, staging(), bytes, cudaMemcpyHostToDevice));
    return WaitStream("AllReduce", deadline);
  });
}

absl::Status HostStagedCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                               absl::Time deadline) {
  return Run("AllGather", [&]() -> absl::Status {
    const size_t total = bytes * world_size_;
    EXL3_RETURN_IF_ERROR(Reserve(total));
    uint8_t* mine = staging() + bytes * rank_;
    EXL3_RETURN_IF_ERROR(Copy(mine, send, bytes, cudaMemcpyDeviceToHost));
    EXL3_RETURN_IF_ERROR(WaitStream("AllGather", deadline));
    EXL3_RETURN_IF_ERROR(shm_->AllGather(mine, bytes, staging(), deadline));
    EXL3_RETURN_IF_ERROR(Copy(recv, staging(), total, cudaMemcpyHostToDevice));
    return WaitStream("AllGather", deadline);
  });
}

absl::Status HostStagedCommunicator::AllGatherV(const void* send,
                                                std::span<const size_t> bytes_per_rank,
                                                void* recv, absl::Time deadline) {
  return Run("AllGatherV", [&]() -> absl::Status {
    if (bytes_per_rank.size() != static_cast<size_t>(world_size_)) {
      return absl::InvalidArgumentError(absl::StrCat("host_staged: AllGatherV got ",
                                                     bytes_per_rank.size(), " sizes for ",
                                                     world_size_, " ranks"));
    }
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += bytes_per_rank[r];
    const size_t total = std::accumulate(bytes_per_rank.begin(), bytes_per_rank.end(), size_t{0});
    EXL3_RETURN_IF_ERROR(Reserve(total));
    uint8_t* mine = staging() + offset;
    EXL3_RETURN_IF_ERROR(Copy(mine, send, bytes_per_rank[rank_], cudaMemcpyDeviceToHost));
    EXL3_RETURN_IF_ERROR(WaitStream("AllGatherV", deadline));
    EXL3_RETURN_IF_ERROR(shm_->AllGatherV(mine, bytes_per_rank, staging(), deadline));
    EXL3_RETURN_IF_ERROR(Copy(recv, staging(), total, cudaMemcpyHostToDevice));
    return WaitStream("AllGatherV", deadline);
  });
}

absl::Status HostStagedCommunicator::ReduceScatter(const void* data, size_t count,
                                                   CommDataType type, void* recv,
                                                   absl::Time deadline) {
  return Run("ReduceScatter", [&]() -> absl::Status {
    const size_t out = count * CommDataTypeSize(type);
    const size_t in = out * world_size_;
    EXL3_RETURN_IF_ERROR(Reserve(in + out));
    EXL3_RETURN_IF_ERROR(Copy(staging(), data, in, cudaMemcpyDeviceToHost));
    EXL3_RETURN_IF_ERROR(WaitStream("ReduceScatter", deadline));
    EXL3_RETURN_IF_ERROR(shm_->ReduceScatter(staging(), count, type, staging() + in, deadline));
    EXL3_RETURN_IF_ERROR(Copy(recv, staging() + in, out, cudaMemcpyHostToDevice));
    return WaitStream("ReduceScatter", deadline);
  });
}

absl::Status HostStagedCommunicator::AllToAllV(const void* send,
                                               std::span<const size_t> send_bytes, void* recv,
                                               std::span<const size_t> recv_bytes,
                                               absl::Time deadline) {
  return Run("AllToAllV", [&]() -> absl::Status {
    if (send_bytes.size() != static_cast<size_t>(world_size_) ||
        recv_bytes.size() != static_cast<size_t>(world_size_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host_staged: AllToAllV got ", send_bytes.size(), " send and ", recv_bytes.size(),
          " receive sizes for ", world_size_, " ranks"));
    }
    const size_t sent = std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0});
    const size_t received = std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0});
    EXL3_RETURN_IF_ERROR(Reserve(sent + received));
    EXL3_RETURN_IF_ERROR(Copy(staging(), send, sent, cudaMemcpyDeviceToHost));
    EXL3_RETURN_IF_ERROR(WaitStream("AllToAllV", deadline));
    EXL3_RETURN_IF_ERROR(
        shm_->AllToAllV(staging(), send_bytes, staging() + sent, recv_bytes, deadline));
    EXL3_RETURN_IF_ERROR(Copy(recv, staging() + sent, received, cudaMemcpyHostToDevice));
    return WaitStream("AllToAllV", deadline);
  });
}

absl::Status HostStagedCommunicator::Broadcast(void* data, size_t bytes, int root,
                                               absl::Time deadline) {
  return Run("Broadcast", [&]() -> absl::Status {
    EXL3_RETURN_IF_ERROR(Reserve(bytes));
    if (rank_ == root) {
      EXL3_RETURN_IF_ERROR(Copy(staging(), data, bytes, cudaMemcpyDeviceToHost));
    }
    // Also orders the broadcast after the caller's work on every rank.
    EXL3_RETURN_IF_ERROR(WaitStream("Broadcast", deadline));
    EXL3_RETURN_IF_ERROR(shm_->Broadcast(staging(), bytes, root, deadline));
    if (rank_ != root) {
      EXL3_RETURN_IF_ERROR(Copy(data, staging(), bytes, cudaMemcpyHostToDevice));
    }
    return WaitStream("Broadcast", deadline);
  });
}

absl::Status HostStagedCommunicator::Barrier(absl::Time deadline) {
  return Run("Barrier", [&]() -> absl::Status {
    EXL3_RETURN_IF_ERROR(WaitStream("Barrier", deadline));
    return shm_->Barrier(deadline);
  });
}

void HostStagedCommunicator::Abort(const absl::Status& reason) {
  (void)Fail(reason.ok() ? absl::AbortedError("host_staged: Abort() with an OK status") : reason);
}

absl::Status HostStagedCommunicator::health() const {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
  }
  return shm_ != nullptr ? shm_->health() : absl::OkStatus();
}

// A fresh segment name for a group (rank 0 picks it).
std::string FreshShmName() {
  return absl::StrCat("/exl3-hs-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedCommunicator(
    const HostStagedOptions& options, Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  const absl::Time deadline = internal::GpuSetupDeadline(options.init_timeout);

  // 1. Local checks and identity; rank 0 adds the segment name.
  GpuRankInfo mine = internal::DescribeLocalRank(ValidateHostStagedOptions(options),
                                                 options.device, "host_staged.device");
  if (rank == 0) mine.payload = options.shm_name.empty() ? FreshShmName() : options.shm_name;
  EXL3_ASSIGN_OR_RETURN(std::vector<GpuRankInfo> infos,
                        internal::ExchangeGpuRankInfo(bootstrap, mine, deadline, "host_staged",
                                                      "exchanging GPU identities"));
  for (int r = 1; r < world_size; ++r) {
    if (infos[r].host_id != infos[0].host_id) {
      return absl::UnimplementedError(absl::StrCat(
          "host_staged: ranks 0 and ", r, " are on different hosts (", infos[0].host_id, " and ",
          infos[r].host_id, "); host_staged works inside one host: use the nccl backend"));
    }
  }
  const std::string shm_name = infos[0].payload;

  // 2. Local resources; the exchange makes a failure unanimous before anyone
  //    waits in the shm join.
  auto comm = std::make_unique<HostStagedCommunicator>(rank, world_size, mine.device);
  GpuRankInfo second;
  second.status = comm->Allocate(options.stream, options.initial_staging_bytes);
  EXL3_RETURN_IF_ERROR(internal::ExchangeGpuRankInfo(bootstrap, second, deadline, "host_staged",
                                                     "allocating pinned staging")
                           .status());

  // 3. The shm group of the same ranks.
  ShmOptions shm;
  shm.name = shm_name;
  shm.rank = rank;
  shm.world_size = world_size;
  shm.join_deadline = deadline;
  absl::StatusOr<std::unique_ptr<Communicator>> joined = CreateShmCommunicator(shm);
  if (!joined.ok()) {
    if (rank == 0) UnlinkShmSegment(shm_name);
    return absl::Status(joined.status().code(),
                        absl::StrCat("host_staged: ", joined.status().message()));
  }
  comm->set_shm(*std::move(joined));
  return std::unique_ptr<Communicator>(std::move(comm));
}

#endif  // EXL3_HAVE_CUDA

}  // namespace exl3serve::worker::comm
