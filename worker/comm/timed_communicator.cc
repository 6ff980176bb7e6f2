#include "worker/comm/timed_communicator.h"

#include <numeric>
#include <utility>

#include "absl/time/clock.h"

namespace exl3serve::worker::comm {

const char* CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kAllGatherV: return "all_gather_v";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllToAllV: return "all_to_all_v";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kBarrier: return "barrier";
  }
  return "unknown";
}

const char* CollectiveSizeClass(size_t bytes) {
  if (bytes <= (size_t{4} << 10)) return "le_4KiB";
  if (bytes <= (size_t{64} << 10)) return "le_64KiB";
  if (bytes <= (size_t{1} << 20)) return "le_1MiB";
  if (bytes <= (size_t{16} << 20)) return "le_16MiB";
  return "gt_16MiB";
}

namespace {

size_t Sum(std::span<const size_t> sizes) {
  return std::accumulate(sizes.begin(), sizes.end(), size_t{0});
}

class TimedCommunicator final : public Communicator {
 public:
  TimedCommunicator(std::unique_ptr<Communicator> inner, CollectiveObserver* observer)
      : inner_(std::move(inner)), observer_(observer), backend_(inner_->backend_name()) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend_name() const override { return backend_; }

  absl::Status AllReduce(void* data, size_t count, CommDataType type,
                         absl::Time deadline) override {
    return Timed(CollectiveOp::kAllReduce, count * CommDataTypeSize(type),
                 [&] { return inner_->AllReduce(data, count, type, deadline); });
  }
  absl::Status AllGather(const void* send, size_t bytes, void* recv,
                         absl::Time deadline) override {
    return Timed(CollectiveOp::kAllGather, bytes,
                 [&] { return inner_->AllGather(send, bytes, recv, deadline); });
  }
  absl::Status AllGatherV(const void* send, std::span<const size_t> bytes_per_rank, void* recv,
                          absl::Time deadline) override {
    const size_t own = static_cast<size_t>(rank()) < bytes_per_rank.size()
                           ? bytes_per_rank[static_cast<size_t>(rank())]
                           : 0;
    return Timed(CollectiveOp::kAllGatherV, own,
                 [&] { return inner_->AllGatherV(send, bytes_per_rank, recv, deadline); });
  }
  absl::Status ReduceScatter(const void* data, size_t count, CommDataType type, void* recv,
                             absl::Time deadline) override {
    return Timed(CollectiveOp::kReduceScatter,
                 count * CommDataTypeSize(type) * static_cast<size_t>(world_size()),
                 [&] { return inner_->ReduceScatter(data, count, type, recv, deadline); });
  }
  absl::Status AllToAllV(const void* send, std::span<const size_t> send_bytes, void* recv,
                         std::span<const size_t> recv_bytes, absl::Time deadline) override {
    return Timed(CollectiveOp::kAllToAllV, Sum(send_bytes), [&] {
      return inner_->AllToAllV(send, send_bytes, recv, recv_bytes, deadline);
    });
  }
  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Time deadline) override {
    return Timed(CollectiveOp::kBroadcast, bytes,
                 [&] { return inner_->Broadcast(data, bytes, root, deadline); });
  }
  absl::Status Barrier(absl::Time deadline) override {
    return Timed(CollectiveOp::kBarrier, 0, [&] { return inner_->Barrier(deadline); });
  }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }
  absl::Status health() const override { return inner_->health(); }

 private:
  template <typename Call>
  absl::Status Timed(CollectiveOp op, size_t bytes, Call&& call) {
    const absl::Time start = absl::Now();
    absl::Status status = call();
    observer_->OnCollective(backend_, op, bytes, absl::Now() - start, status);
    return status;
  }

  const std::unique_ptr<Communicator> inner_;
  CollectiveObserver* const observer_;
  const std::string backend_;
};

}  // namespace

std::unique_ptr<Communicator> WithCollectiveTiming(std::unique_ptr<Communicator> inner,
                                                   CollectiveObserver* observer) {
  if (observer == nullptr || inner == nullptr) return inner;
  return std::make_unique<TimedCommunicator>(std::move(inner), observer);
}

}  // namespace exl3serve::worker::comm
