#include "worker/comm/cuda_p2p_communicator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/cuda_p2p_kernels.h"
#include "worker/comm/gpu_rank_info.h"

namespace exl3serve::worker::comm {
namespace {

using internal::GpuRankInfo;
using internal::kP2pAlignBytes;
using internal::kP2pBlocks;
using internal::kP2pMaxRanks;
using internal::P2pCopyArgs;
using internal::P2pDType;
using internal::P2pGroup;
using internal::P2pReduceArgs;
using internal::P2pSignal;
using internal::P2pStatus;
using internal::PollBackoff;
using kernels::cuda::CudaStatus;

// How long the host keeps waiting past a call's deadline for the device's
// own timeout to report (it names the missing ranks) before aborting the
// launch itself. Well within the contract's "a few ms".
constexpr absl::Duration kHostGrace = absl::Milliseconds(2);
// Bounds on the host's waits outside a call (abort kernel, destruction).
constexpr absl::Duration kAbortWait = absl::Seconds(1);
constexpr absl::Duration kDrainWait = absl::Seconds(5);

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }
size_t RoundUp(size_t a, size_t m) { return CeilDiv(a, m) * m; }

size_t SubBytesFor(size_t buffer_bytes, int world_size) {
  const size_t sub = buffer_bytes / (size_t{2} * world_size * kP2pBlocks);
  return sub / kP2pAlignBytes * kP2pAlignBytes;
}

uint64_t DurationToNs(absl::Duration d) {
  const int64_t ns = absl::ToInt64Nanoseconds(d);
  return ns < 1 ? 1 : static_cast<uint64_t>(ns);
}

std::string IpcHandleBytes(const cudaIpcMemHandle_t& handle) {
  return std::string(handle.reserved, sizeof(handle.reserved));
}

// Restores the calling thread's current device on scope exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    restore_ = cudaGetDevice(&saved_) == cudaSuccess;
    if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = 0;
  bool restore_ = false;
};

// Waits for `event` up to `limit`; true when it completed without error.
bool WaitEvent(cudaEvent_t event, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  PollBackoff backoff;
  while (true) {
    const cudaError_t query = cudaEventQuery(event);
    if (query == cudaSuccess) return true;
    if (query != cudaErrorNotReady || absl::Now() > until) return false;
    backoff.Wait();
  }
}

// One rank of a cuda_p2p group. Created in three steps by
// CreateCudaP2pCommunicator (Allocate, the exchange, MapPeers).
class CudaP2pCommunicator final : public Communicator {
 public:
  CudaP2pCommunicator(int rank, int world_size, int device, CudaP2pOptions options)
      : rank_(rank),
        world_size_(world_size),
        device_(device),
        options_(std::move(options)),
        sub_bytes_(SubBytesFor(options_.buffer_bytes, world_size)) {}
  ~CudaP2pCommunicator() override;

  // Allocates and zeroes this rank's buffers, status memory, streams and
  // events; returns the IPC handles (data, then signal) in `handles`.
  absl::Status Allocate(std::string* handles);
  // Opens every peer's handles (`handles[r]` as Allocate returned them).
  absl::Status MapPeers(const std::vector<std::string>& handles);

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend_name() const override { return "cuda_p2p"; }

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
  // Byte segments of one copy operation (see P2pCopyArgs), whole lengths.
  struct CopySpec {
    const char* src[kP2pMaxRanks] = {};
    size_t send_len[kP2pMaxRanks] = {};
    char* dst[kP2pMaxRanks] = {};
    size_t recv_len[kP2pMaxRanks] = {};
    size_t max_len = 0;  // the largest segment of ANY rank (equal on all ranks)
  };

  // Aborted once broken (also after a failed graph replay); otherwise makes
  // the device current on this thread.
  absl::Status Begin();
  // Whether the stream is capturing, and the device wait bound for launches
  // (graph_timeout, or the time left to `deadline`).
  absl::Status Prepare(const char* op, absl::Time deadline, bool* capturing, uint64_t* timeout_ns);
  absl::Status EnqueueCopy(const char* op, const CopySpec& spec, uint64_t timeout_ns);
  // Eager mode: waits for the launches, then reads the device's verdict.
  absl::Status Finish(const char* op, absl::Time deadline, bool capturing);
  // The failure the launches recorded in the status memory; OK if none.
  absl::Status DeviceFailure(const char* op) const;
  // Records `status` as the first failure, sets every rank's abort word, and
  // returns `status`.
  absl::Status Fail(absl::Status status);
  void SendAbort();
  absl::Status RunCopy(const char* op, const CopySpec& spec, absl::Time deadline);

  // Constant after creation.
  const int rank_;
  const int world_size_;
  const int device_;
  const CudaP2pOptions options_;
  const size_t sub_bytes_;
  P2pGroup group_;                      // peers' entries are IPC mappings
  bool mapped_[kP2pMaxRanks] = {};      // which group_ entries to close
  P2pStatus* status_host_ = nullptr;    // cudaHostAlloc'd, mapped
  uint64_t* scratch_device_ = nullptr;  // world_size + 1 words (all-to-all sizes)
  uint64_t* scratch_host_ = nullptr;    // pinned, world_size + 1 words
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaStream_t abort_stream_ = nullptr;  // so the abort kernel never queues behind us
  cudaEvent_t done_ = nullptr;
  cudaEvent_t abort_done_ = nullptr;

  mutable absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool abort_sent_ ABSL_GUARDED_BY(mu_) = false;
};

CudaP2pCommunicator::~CudaP2pCommunicator() {
  DeviceScope scope(device_);
  if (stream_ != nullptr && done_ != nullptr) {
    // Let our launches finish (they are bounded by their device timeouts);
    // abort them if they do not.
    if (cudaEventRecord(done_, stream_) == cudaSuccess && !WaitEvent(done_, kDrainWait)) {
      SendAbort();
      WaitEvent(done_, kAbortWait);
    }
  }
  for (int r = 0; r < kP2pMaxRanks; ++r) {
    if (!mapped_[r]) continue;
    cudaIpcCloseMemHandle(group_.data[r]);
    cudaIpcCloseMemHandle(group_.signal[r]);
  }
  if (group_.data[rank_] != nullptr) cudaFree(group_.data[rank_]);
  if (group_.signal[rank_] != nullptr) cudaFree(group_.signal[rank_]);
  if (status_host_ != nullptr) cudaFreeHost(status_host_);
  if (scratch_device_ != nullptr) cudaFree(scratch_device_);
  if (scratch_host_ != nullptr) cudaFreeHost(scratch_host_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (abort_done_ != nullptr) cudaEventDestroy(abort_done_);
  if (abort_stream_ != nullptr) cudaStreamDestroy(abort_stream_);
  if (owns_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaP2pCommunicator::Allocate(std::string* handles) {
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cuda_p2p: cudaSetDevice"));
  group_.rank = rank_;
  group_.world = world_size_;
  group_.sub_bytes = sub_bytes_;
  const size_t data_bytes = size_t{2} * world_size_ * kP2pBlocks * sub_bytes_;
  void* data = nullptr;
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, data_bytes),
                                  absl::StrCat("cuda_p2p: allocating the ", data_bytes,
                                               "-byte data buffer (cuda_p2p.buffer_bytes)")));
  group_.data[rank_] = static_cast<char*>(data);
  void* signal = nullptr;
  EXL3_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&signal, sizeof(P2pSignal)), "cuda_p2p: allocating the signal"));
  group_.signal[rank_] = static_cast<P2pSignal*>(signal);
  // Zeroed and synchronised before the handle leaves this process: a peer's
  // first flag store must never be overwritten by our memset.
  EXL3_RETURN_IF_ERROR(
      CudaStatus(cudaMemset(signal, 0, sizeof(P2pSignal)), "cuda_p2p: clearing the signal"));
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), "cuda_p2p: clearing the signal"));

  void* status = nullptr;
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&status, sizeof(P2pStatus), cudaHostAllocMapped),
                                  "cuda_p2p: allocating the status memory"));
  status_host_ = static_cast<P2pStatus*>(status);
  std::memset(status_host_, 0, sizeof(P2pStatus));
  void* status_device = nullptr;
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaHostGetDevicePointer(&status_device, status, 0),
                                  "cuda_p2p: mapping the status memory"));
  group_.status = static_cast<P2pStatus*>(status_device);

  const size_t scratch_bytes = sizeof(uint64_t) * (world_size_ + 1);
  void* scratch = nullptr;
  EXL3_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&scratch, scratch_bytes), "cuda_p2p: allocating the size scratch"));
  scratch_device_ = static_cast<uint64_t*>(scratch);
  EXL3_RETURN_IF_ERROR(
      CudaStatus(cudaMallocHost(&scratch, scratch_bytes), "cuda_p2p: allocating the size scratch"));
  scratch_host_ = static_cast<uint64_t*>(scratch);

  if (options_.stream != nullptr) {
    stream_ = options_.stream;
  } else {
    EXL3_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                    "cuda_p2p: creating the stream"));
    owns_stream_ = true;
  }
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&abort_stream_, cudaStreamNonBlocking),
                                  "cuda_p2p: creating the abort stream"));
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming),
                                  "cuda_p2p: creating an event"));
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&abort_done_, cudaEventDisableTiming),
                                  "cuda_p2p: creating an event"));

  cudaIpcMemHandle_t data_handle;
  cudaIpcMemHandle_t signal_handle;
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&data_handle, data),
                                  "cuda_p2p: exporting the data buffer (cudaIpcGetMemHandle)"));
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&signal_handle, signal),
                                  "cuda_p2p: exporting the signal (cudaIpcGetMemHandle)"));
  *handles = IpcHandleBytes(data_handle) + IpcHandleBytes(signal_handle);
  return absl::OkStatus();
}

absl::Status CudaP2pCommunicator::MapPeers(const std::vector<std::string>& handles) {
  EXL3_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cuda_p2p: cudaSetDevice"));
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    cudaIpcMemHandle_t data_handle;
    cudaIpcMemHandle_t signal_handle;
    std::memcpy(data_handle.reserved, handles[r].data(), sizeof(data_handle.reserved));
    std::memcpy(signal_handle.reserved, handles[r].data() + sizeof(data_handle.reserved),
                sizeof(signal_handle.reserved));
    void* data = nullptr;
    EXL3_RETURN_IF_ERROR(CudaStatus(
        cudaIpcOpenMemHandle(&data, data_handle, cudaIpcMemLazyEnablePeerAccess),
        absl::StrCat("cuda_p2p: opening rank ", r, "'s data buffer (cudaIpcOpenMemHandle)")));
    void* signal = nullptr;
    const cudaError_t error =
        cudaIpcOpenMemHandle(&signal, signal_handle, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      cudaIpcCloseMemHandle(data);
      return CudaStatus(
          error, absl::StrCat("cuda_p2p: opening rank ", r, "'s signal (cudaIpcOpenMemHandle)"));
    }
    group_.data[r] = static_cast<char*>(data);
    group_.signal[r] = static_cast<P2pSignal*>(signal);
    mapped_[r] = true;
  }
  return absl::OkStatus();
}

absl::Status CudaP2pCommunicator::Begin() {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::AbortedError(absl::StrCat("communicator broken: ", broken_.message()));
    }
  }
  if (absl::Status failed = DeviceFailure("a captured launch"); !failed.ok()) {
    Fail(failed).IgnoreError();
    if (absl::IsAborted(failed)) return failed;  // already "communicator broken: ..."
    return absl::AbortedError(absl::StrCat("communicator broken: ", failed.message()));
  }
  return CudaStatus(cudaSetDevice(device_), "cuda_p2p: cudaSetDevice");
}

absl::Status CudaP2pCommunicator::Prepare(const char* op, absl::Time deadline, bool* capturing,
                                          uint64_t* timeout_ns) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (absl::Status s =
          CudaStatus(cudaStreamIsCapturing(stream_, &capture), "cuda_p2p: cudaStreamIsCapturing");
      !s.ok()) {
    return Fail(s);
  }
  *capturing = capture != cudaStreamCaptureStatusNone;
  if (*capturing) {
    *timeout_ns = DurationToNs(options_.graph_timeout);
    return absl::OkStatus();
  }
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    // Our peers may already wait for us: fail them too (consistent failure).
    return Fail(absl::DeadlineExceededError(
        absl::StrCat("cuda_p2p: ", op, " on rank ", rank_, " of ", world_size_,
                     ": the deadline passed before the operation started; the group is aborted")));
  }
  *timeout_ns = DurationToNs(left);
  return absl::OkStatus();
}

absl::Status CudaP2pCommunicator::Finish(const char* op, absl::Time deadline, bool capturing) {
  if (capturing) return absl::OkStatus();
  if (absl::Status s = CudaStatus(cudaEventRecord(done_, stream_), "cuda_p2p: cudaEventRecord");
      !s.ok()) {
    return Fail(s);
  }
  PollBackoff backoff;
  while (true) {
    const cudaError_t query = cudaEventQuery(done_);
    if (query == cudaSuccess) {
      if (absl::Status failed = DeviceFailure(op); !failed.ok()) return Fail(failed);
      return absl::OkStatus();
    }
    if (query != cudaErrorNotReady) {
      return Fail(CudaStatus(query, absl::StrCat("cuda_p2p: ", op)));
    }
    if (absl::Now() > deadline + kHostGrace) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "cuda_p2p: ", op, " on rank ", rank_, " of ", world_size_,
          " did not complete before its deadline (its launch had not finished, e.g. it started "
          "late behind earlier work on the stream); the group is aborted")));
    }
    backoff.Wait();
  }
}

absl::Status CudaP2pCommunicator::DeviceFailure(const char* op) const {
  if (status_host_ == nullptr) return absl::OkStatus();
  uint32_t missing = 0;
  uint32_t aborter = 0;
  uint32_t epoch = 0;
  bool timed_out = false;
  bool aborted = false;
  for (int b = 0; b < kP2pBlocks; ++b) {
    internal::P2pBlockStatus& record = status_host_->blocks[b];
    // The device wrote the record before the launch completed (O5); the
    // acquire keeps the other fields' reads after the code's.
    const uint32_t code = std::atomic_ref<uint32_t>(record.code).load(std::memory_order_acquire);
    if (code == internal::kP2pTimedOut) {
      timed_out = true;
      missing |= std::atomic_ref<uint32_t>(record.missing).load(std::memory_order_relaxed);
      epoch = std::atomic_ref<uint32_t>(record.epoch).load(std::memory_order_relaxed);
    } else if (code == internal::kP2pPeerAborted) {
      aborted = true;
      aborter = std::atomic_ref<uint32_t>(record.aborter).load(std::memory_order_relaxed);
      if (!timed_out) {
        epoch = std::atomic_ref<uint32_t>(record.epoch).load(std::memory_order_relaxed);
      }
    }
  }
  if (timed_out) {
    std::vector<int> ranks;
    for (int r = 0; r < world_size_; ++r) {
      if (missing & (1u << r)) ranks.push_back(r);
    }
    return absl::DeadlineExceededError(
        absl::StrCat("cuda_p2p: ", op, " on rank ", rank_, " of ", world_size_, ": rank(s) ",
                     absl::StrJoin(ranks, ", "), " not heard from before the deadline (barrier ",
                     epoch, "); the group is aborted"));
  }
  if (aborted) {
    const int by = static_cast<int>(aborter) - 1;
    if (by == rank_) {
      return absl::AbortedError(
          absl::StrCat("cuda_p2p: ", op, " on rank ", rank_, ": this rank aborted the group"));
    }
    return absl::AbortedError(absl::StrCat("communicator broken: cuda_p2p: rank ", by,
                                           " aborted the group (its deadline passed, it "
                                           "lost a peer, or it called Abort()); seen by rank ",
                                           rank_, " in ", op));
  }
  return absl::OkStatus();
}

absl::Status CudaP2pCommunicator::Fail(absl::Status status) {
  bool send = false;
  {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
    if (!abort_sent_) {
      abort_sent_ = true;
      send = true;
    }
  }
  if (send) SendAbort();
  return status;
}

void CudaP2pCommunicator::SendAbort() {
  if (abort_stream_ == nullptr || group_.signal[rank_] == nullptr) return;  // not set up yet
  for (int r = 0; r < world_size_; ++r) {
    if (group_.signal[r] == nullptr) return;  // peers not mapped: nobody to tell
  }
  DeviceScope scope(device_);
  const cudaError_t launch = internal::LaunchP2pAbort(group_, abort_stream_);
  if (launch != cudaSuccess || cudaEventRecord(abort_done_, abort_stream_) != cudaSuccess ||
      !WaitEvent(abort_done_, kAbortWait)) {
    EXL3_LOG(kWarning) << "cuda_p2p: rank " << rank_
                       << " could not set the group's abort word: " << cudaGetErrorString(launch);
  }
}

absl::Status CudaP2pCommunicator::EnqueueCopy(const char* op, const CopySpec& spec,
                                              uint64_t timeout_ns) {
  const size_t per_launch = kP2pBlocks * sub_bytes_;
  for (size_t offset = 0; offset < spec.max_len; offset += per_launch) {
    const size_t window = std::min(per_launch, spec.max_len - offset);
    P2pCopyArgs args;
    args.block_bytes = RoundUp(CeilDiv(window, kP2pBlocks), kP2pAlignBytes);
    for (int r = 0; r < world_size_; ++r) {
      const size_t send_at = std::min(offset, spec.send_len[r]);
      const size_t recv_at = std::min(offset, spec.recv_len[r]);
      args.src[r] = spec.src[r] == nullptr ? nullptr : spec.src[r] + send_at;
      args.send_len[r] = std::min(per_launch, spec.send_len[r] - send_at);
      args.dst[r] = spec.dst[r] == nullptr ? nullptr : spec.dst[r] + recv_at;
      args.recv_len[r] = std::min(per_launch, spec.recv_len[r] - recv_at);
    }
    if (absl::Status s = CudaStatus(internal::LaunchP2pCopy(group_, args, timeout_ns, stream_),
                                    absl::StrCat("cuda_p2p: launching ", op));
        !s.ok()) {
      return Fail(s);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaP2pCommunicator::RunCopy(const char* op, const CopySpec& spec,
                                          absl::Time deadline) {
  if (spec.max_len == 0) return absl::OkStatus();
  bool capturing = false;
  uint64_t timeout_ns = 0;
  EXL3_RETURN_IF_ERROR(Prepare(op, deadline, &capturing, &timeout_ns));
  EXL3_RETURN_IF_ERROR(EnqueueCopy(op, spec, timeout_ns));
  return Finish(op, deadline, capturing);
}

absl::Status CudaP2pCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                            absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: all_reduce of a null buffer"));
  }
  bool capturing = false;
  uint64_t timeout_ns = 0;
  EXL3_RETURN_IF_ERROR(Prepare("all_reduce", deadline, &capturing, &timeout_ns));
  const size_t esize = CommDataTypeSize(type);
  for (const CudaP2pLaunch& launch :
       PlanCudaP2pAllReduce(count, esize, world_size_, sub_bytes_, options_.one_shot_max_bytes)) {
    char* base = static_cast<char*>(data) + launch.offset * esize;
    P2pReduceArgs args;
    args.dtype = type == CommDataType::kBF16 ? P2pDType::kBF16 : P2pDType::kF32;
    args.two_shot = launch.two_shot;
    args.block_elems = launch.block_elems;
    for (int d = 0; d < world_size_; ++d) {
      if (launch.two_shot) {
        const size_t start = std::min(launch.count, d * launch.piece);
        args.src[d] = base + start * esize;
        args.gather_dst[d] = base + start * esize;
        args.piece_len[d] = std::min(launch.piece, launch.count - start);
      } else {
        args.src[d] = base;
        args.piece_len[d] = launch.count;
      }
    }
    args.out = const_cast<void*>(args.src[rank_]);
    if (absl::Status s = CudaStatus(internal::LaunchP2pReduce(group_, args, timeout_ns, stream_),
                                    "cuda_p2p: launching all_reduce");
        !s.ok()) {
      return Fail(s);
    }
  }
  return Finish("all_reduce", deadline, capturing);
}

absl::Status CudaP2pCommunicator::ReduceScatter(const void* data, size_t count, CommDataType type,
                                                void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr || recv == nullptr) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: reduce_scatter with a null buffer"));
  }
  bool capturing = false;
  uint64_t timeout_ns = 0;
  EXL3_RETURN_IF_ERROR(Prepare("reduce_scatter", deadline, &capturing, &timeout_ns));
  const size_t esize = CommDataTypeSize(type);
  const size_t vector = kP2pAlignBytes / esize;
  const size_t per_launch = kP2pBlocks * (sub_bytes_ / esize);
  for (size_t offset = 0; offset < count; offset += per_launch) {
    const size_t n = std::min(per_launch, count - offset);
    P2pReduceArgs args;
    args.dtype = type == CommDataType::kBF16 ? P2pDType::kBF16 : P2pDType::kF32;
    args.block_elems = RoundUp(CeilDiv(n, kP2pBlocks), vector);
    for (int d = 0; d < world_size_; ++d) {
      args.src[d] = static_cast<const char*>(data) + (d * count + offset) * esize;
      args.piece_len[d] = n;
    }
    args.out = static_cast<char*>(recv) + offset * esize;
    if (absl::Status s = CudaStatus(internal::LaunchP2pReduce(group_, args, timeout_ns, stream_),
                                    "cuda_p2p: launching reduce_scatter");
        !s.ok()) {
      return Fail(s);
    }
  }
  return Finish("reduce_scatter", deadline, capturing);
}

absl::Status CudaP2pCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                            absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (bytes == 0) return absl::OkStatus();
  if (send == nullptr || recv == nullptr) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: all_gather with a null buffer"));
  }
  CopySpec spec;
  for (int r = 0; r < world_size_; ++r) {
    spec.src[r] = static_cast<const char*>(send);
    spec.send_len[r] = bytes;
    spec.dst[r] = static_cast<char*>(recv) + r * bytes;
    spec.recv_len[r] = bytes;
  }
  spec.max_len = bytes;
  return RunCopy("all_gather", spec, deadline);
}

absl::Status CudaP2pCommunicator::AllGatherV(const void* send,
                                             std::span<const size_t> bytes_per_rank, void* recv,
                                             absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (static_cast<int>(bytes_per_rank.size()) != world_size_) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "cuda_p2p: all_gather_v needs ", world_size_, " sizes, got ", bytes_per_rank.size())));
  }
  CopySpec spec;
  size_t offset = 0;
  for (int r = 0; r < world_size_; ++r) {
    spec.src[r] = static_cast<const char*>(send);
    spec.send_len[r] = bytes_per_rank[rank_];
    spec.dst[r] = recv == nullptr ? nullptr : static_cast<char*>(recv) + offset;
    spec.recv_len[r] = bytes_per_rank[r];
    spec.max_len = std::max(spec.max_len, bytes_per_rank[r]);
    offset += bytes_per_rank[r];
  }
  if (offset > 0 && (recv == nullptr || (bytes_per_rank[rank_] > 0 && send == nullptr))) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: all_gather_v with a null buffer"));
  }
  return RunCopy("all_gather_v", spec, deadline);
}

absl::Status CudaP2pCommunicator::Broadcast(void* data, size_t bytes, int root,
                                            absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (root < 0 || root >= world_size_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("cuda_p2p: broadcast root must be in [0, ", world_size_, "), got ", root)));
  }
  if (bytes == 0) return absl::OkStatus();
  if (data == nullptr) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: broadcast of a null buffer"));
  }
  CopySpec spec;
  if (rank_ == root) {
    for (int d = 0; d < world_size_; ++d) {
      if (d == root) continue;
      spec.src[d] = static_cast<const char*>(data);
      spec.send_len[d] = bytes;
    }
  } else {
    spec.dst[root] = static_cast<char*>(data);
    spec.recv_len[root] = bytes;
  }
  spec.max_len = bytes;
  return RunCopy("broadcast", spec, deadline);
}

absl::Status CudaP2pCommunicator::AllToAllV(const void* send, std::span<const size_t> send_bytes,
                                            void* recv, std::span<const size_t> recv_bytes,
                                            absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  if (static_cast<int>(send_bytes.size()) != world_size_ ||
      static_cast<int>(recv_bytes.size()) != world_size_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("cuda_p2p: all_to_all_v needs ", world_size_, " send and recv sizes, got ",
                     send_bytes.size(), " and ", recv_bytes.size())));
  }
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("cuda_p2p: all_to_all_v: rank ", rank_, " sends ", send_bytes[rank_],
                     " bytes to itself but expects to receive ", recv_bytes[rank_])));
  }
  CopySpec spec;
  size_t send_offset = 0, recv_offset = 0, local_max = 0;
  for (int p = 0; p < world_size_; ++p) {
    spec.src[p] = send == nullptr ? nullptr : static_cast<const char*>(send) + send_offset;
    spec.send_len[p] = send_bytes[p];
    spec.dst[p] = recv == nullptr ? nullptr : static_cast<char*>(recv) + recv_offset;
    spec.recv_len[p] = recv_bytes[p];
    send_offset += send_bytes[p];
    recv_offset += recv_bytes[p];
    local_max = std::max({local_max, send_bytes[p], recv_bytes[p]});
  }
  if ((send_offset > 0 && send == nullptr) || (recv_offset > 0 && recv == nullptr)) {
    return Fail(absl::InvalidArgumentError("cuda_p2p: all_to_all_v with a null buffer"));
  }
  bool capturing = false;
  uint64_t timeout_ns = 0;
  EXL3_RETURN_IF_ERROR(Prepare("all_to_all_v", deadline, &capturing, &timeout_ns));
  if (capturing) {
    // The launch count depends on every rank's sizes, which the host must
    // read back. Nothing was enqueued and every rank capturing the same
    // sequence fails alike, so the group stays usable (and no abort kernel
    // is launched in the middle of a capture).
    return absl::FailedPreconditionError(
        "cuda_p2p: all_to_all_v cannot be captured into a CUDA graph (its launch count depends "
        "on every rank's sizes); run it eagerly");
  }
  // Agree on the largest segment of any rank: a one-word all-gather.
  scratch_host_[world_size_] = local_max;
  if (absl::Status s =
          CudaStatus(cudaMemcpyAsync(scratch_device_ + world_size_, scratch_host_ + world_size_,
                                     sizeof(uint64_t), cudaMemcpyHostToDevice, stream_),
                     "cuda_p2p: all_to_all_v: staging the local size");
      !s.ok()) {
    return Fail(s);
  }
  CopySpec sizes;
  for (int r = 0; r < world_size_; ++r) {
    sizes.src[r] = reinterpret_cast<const char*>(scratch_device_ + world_size_);
    sizes.send_len[r] = sizeof(uint64_t);
    sizes.dst[r] = reinterpret_cast<char*>(scratch_device_ + r);
    sizes.recv_len[r] = sizeof(uint64_t);
  }
  sizes.max_len = sizeof(uint64_t);
  EXL3_RETURN_IF_ERROR(EnqueueCopy("all_to_all_v (sizes)", sizes, timeout_ns));
  if (absl::Status s =
          CudaStatus(cudaMemcpyAsync(scratch_host_, scratch_device_, sizeof(uint64_t) * world_size_,
                                     cudaMemcpyDeviceToHost, stream_),
                     "cuda_p2p: all_to_all_v: reading the sizes back");
      !s.ok()) {
    return Fail(s);
  }
  EXL3_RETURN_IF_ERROR(Finish("all_to_all_v (sizes)", deadline, capturing));
  for (int r = 0; r < world_size_; ++r) {
    spec.max_len = std::max<size_t>(spec.max_len, scratch_host_[r]);
  }
  if (spec.max_len < local_max) {
    return Fail(absl::InternalError("cuda_p2p: all_to_all_v: the gathered sizes lost ours"));
  }
  return RunCopy("all_to_all_v", spec, deadline);
}

absl::Status CudaP2pCommunicator::Barrier(absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin());
  bool capturing = false;
  uint64_t timeout_ns = 0;
  EXL3_RETURN_IF_ERROR(Prepare("barrier", deadline, &capturing, &timeout_ns));
  if (absl::Status s = CudaStatus(internal::LaunchP2pBarrier(group_, timeout_ns, stream_),
                                  "cuda_p2p: launching barrier");
      !s.ok()) {
    return Fail(s);
  }
  return Finish("barrier", deadline, capturing);
}

void CudaP2pCommunicator::Abort(const absl::Status& reason) {
  Fail(reason.ok() ? absl::AbortedError("Abort() called") : reason).IgnoreError();
}

absl::Status CudaP2pCommunicator::health() const {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
  }
  return DeviceFailure("a captured launch");
}

}  // namespace

absl::Status ValidateCudaP2pOptions(const CudaP2pOptions& options, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_p2p: world size must be >= 1, got ", world_size));
  }
  if (world_size > kP2pMaxRanks) {
    return absl::UnimplementedError(absl::StrCat("cuda_p2p supports 1 to ", kP2pMaxRanks,
                                                 " ranks, got ", world_size,
                                                 "; use the nccl backend"));
  }
  if (options.device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_p2p.device must be >= -1 (-1: the current device), got ", options.device));
  }
  if (options.init_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_p2p.init_timeout must be > 0, got ",
                                                   absl::FormatDuration(options.init_timeout)));
  }
  if (options.graph_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_p2p.graph_timeout must be > 0, got ",
                                                   absl::FormatDuration(options.graph_timeout)));
  }
  const size_t min_bytes = size_t{2} * world_size * kP2pBlocks * kP2pAlignBytes;
  if (options.buffer_bytes < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_p2p.buffer_bytes must be >= ", min_bytes,
                                                   " for world size ", world_size, ", got ",
                                                   options.buffer_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckCudaP2pTopology(std::span<const CudaP2pPeer> peers,
                                  const std::vector<std::vector<bool>>& can_access,
                                  bool allow_shared_device) {
  const size_t n = peers.size();
  if (n < 1 || n > static_cast<size_t>(kP2pMaxRanks)) {
    return absl::UnimplementedError(absl::StrCat("cuda_p2p supports 1 to ", kP2pMaxRanks,
                                                 " ranks, got ", n, "; use the nccl backend"));
  }
  if (can_access.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_p2p: peer-access matrix has ",
                                                   can_access.size(), " rows for ", n, " ranks"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (can_access[i].size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_p2p: peer-access row ", i, " has ",
                                                     can_access[i].size(), " entries for ", n,
                                                     " ranks"));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (peers[i].host_id != peers[j].host_id) {
        return absl::UnimplementedError(absl::StrCat(
            "cuda_p2p: ranks ", i, " and ", j, " are on different hosts (", peers[i].host_id,
            " and ", peers[j].host_id,
            "); cuda_p2p works inside one host: use the nccl backend (or hierarchical)"));
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (peers[i].pci_bus_id == peers[j].pci_bus_id) {
        if (!allow_shared_device) {
          return absl::FailedPreconditionError(
              absl::StrCat("cuda_p2p: ranks ", i, " and ", j, " share GPU ", peers[i].pci_bus_id,
                           "; give each rank its own GPU (cuda_p2p.device) or set "
                           "cuda_p2p.allow_shared_device (time-sliced, slow)"));
        }
        continue;
      }
      if (!can_access[i][j] || !can_access[j][i]) {
        return absl::UnimplementedError(absl::StrCat(
            "cuda_p2p: GPU ", peers[i].pci_bus_id, " (rank ", i, ") and GPU ", peers[j].pci_bus_id,
            " (rank ", j,
            ") have no peer-to-peer access (cudaDeviceCanAccessPeer); use the nccl backend for "
            "this group"));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<CudaP2pLaunch> PlanCudaP2pAllReduce(size_t count, size_t elem_bytes, int world_size,
                                                size_t sub_bytes, size_t one_shot_max_bytes) {
  std::vector<CudaP2pLaunch> plan;
  const size_t vector = kP2pAlignBytes / elem_bytes;     // elements per 16 bytes
  const size_t block_capacity = sub_bytes / elem_bytes;  // a multiple of `vector`
  const bool two_shot = world_size > 2 && count * elem_bytes > one_shot_max_bytes;
  const size_t per_launch =
      (two_shot ? static_cast<size_t>(world_size) : 1) * kP2pBlocks * block_capacity;
  for (size_t offset = 0; offset < count;) {
    CudaP2pLaunch launch;
    launch.offset = offset;
    launch.count = std::min(per_launch, count - offset);
    launch.two_shot = two_shot;
    // Pieces and per-block ranges start at 16-byte multiples, so copies of
    // 16-byte-aligned buffers run 16 bytes at a time. Both stay within
    // capacity: piece <= kP2pBlocks * block_capacity, a multiple of `vector`.
    launch.piece = two_shot ? RoundUp(CeilDiv(launch.count, world_size), vector) : launch.count;
    launch.block_elems = RoundUp(CeilDiv(launch.piece, kP2pBlocks), vector);
    plan.push_back(launch);
    offset += launch.count;
  }
  return plan;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateCudaP2pCommunicator(
    const CudaP2pOptions& options, Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  const absl::Time deadline = internal::GpuSetupDeadline(options.init_timeout);

  // 1. Local checks, then everyone's identity (a failure travels too).
  const GpuRankInfo mine = internal::DescribeLocalRank(
      ValidateCudaP2pOptions(options, world_size), options.device, "cuda_p2p.device");
  EXL3_ASSIGN_OR_RETURN(std::vector<GpuRankInfo> infos,
                        internal::ExchangeGpuRankInfo(bootstrap, mine, deadline, "cuda_p2p",
                                                      "exchanging GPU identities"));
  std::vector<CudaP2pPeer> peers;
  for (const GpuRankInfo& info : infos) peers.push_back({info.host_id, info.pci_bus_id});
  // Hosts and shared GPUs are known now; refuse before allocating anything.
  const std::vector<std::vector<bool>> everyone(world_size, std::vector<bool>(world_size, true));
  EXL3_RETURN_IF_ERROR(CheckCudaP2pTopology(peers, everyone, options.allow_shared_device));

  // 2. Buffers and handles, plus this rank's row of the peer-access matrix.
  auto comm = std::make_unique<CudaP2pCommunicator>(rank, world_size, mine.device, options);
  GpuRankInfo second;
  std::string handles;
  second.status = comm->Allocate(&handles);
  if (second.status.ok()) second.payload = internal::ProbePeerAccess(infos, mine) + handles;
  EXL3_ASSIGN_OR_RETURN(std::vector<GpuRankInfo> exported,
                        internal::ExchangeGpuRankInfo(bootstrap, second, deadline, "cuda_p2p",
                                                      "exchanging IPC handles"));
  const size_t handle_bytes = 2 * sizeof(cudaIpcMemHandle_t::reserved);
  std::vector<std::vector<bool>> can_access(world_size, std::vector<bool>(world_size, false));
  std::vector<std::string> peer_handles(world_size);
  for (int r = 0; r < world_size; ++r) {
    const std::string& payload = exported[r].payload;
    if (payload.size() != world_size + handle_bytes) {
      return absl::InternalError(absl::StrCat("cuda_p2p: rank ", r, " sent ", payload.size(),
                                              " bytes of handles, expected ",
                                              world_size + handle_bytes));
    }
    for (int j = 0; j < world_size; ++j) can_access[r][j] = payload[j] == '1';
    peer_handles[r] = payload.substr(world_size);
  }
  // Every rank sees the same matrix, so every rank decides alike.
  EXL3_RETURN_IF_ERROR(CheckCudaP2pTopology(peers, can_access, options.allow_shared_device));

  // 3. Map the peers' buffers; the last exchange makes a failure unanimous.
  GpuRankInfo third;
  third.status = comm->MapPeers(peer_handles);
  EXL3_RETURN_IF_ERROR(
      internal::ExchangeGpuRankInfo(bootstrap, third, deadline, "cuda_p2p", "mapping peer buffers")
          .status());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace exl3serve::worker::comm
