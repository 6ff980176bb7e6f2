#include "worker/comm/hierarchical_communicator.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/reduce_sum.h"

namespace exl3serve::worker::comm {
namespace {

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> intra, std::unique_ptr<Communicator> inter,
                           std::vector<int> box_sizes, int box)
      : intra_(std::move(intra)),
        inter_(std::move(inter)),
        box_sizes_(std::move(box_sizes)),
        box_(box),
        box_first_(std::accumulate(box_sizes_.begin(), box_sizes_.begin() + box, 0)),
        world_(std::accumulate(box_sizes_.begin(), box_sizes_.end(), 0)),
        rank_(box_first_ + intra_->rank()) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "hierarchical"; }

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
  bool leader() const { return inter_ != nullptr; }
  int num_boxes() const { return static_cast<int>(box_sizes_.size()); }
  // OK, or Aborted("communicator broken: ...") once broken.
  absl::Status Check() const;
  // Runs one step; on failure marks broken and aborts both sub-communicators.
  absl::Status Step(const absl::Status& status);
  // The fp32 all-reduce of `data` (count floats): intra, inter, broadcast.
  absl::Status AllReduceF32(float* data, size_t count, absl::Time deadline);
  // Each rank's `bytes_per_rank[r]` bytes (concatenated in `recv`), `mine`
  // being this rank's; the AllGather(V) steps.
  absl::Status GatherAll(const void* mine, std::span<const size_t> bytes_per_rank, void* recv,
                         absl::Time deadline);

  // --- constant after construction
  const std::unique_ptr<Communicator> intra_;
  const std::unique_ptr<Communicator> inter_;  // leaders only
  const std::vector<int> box_sizes_;
  const int box_;
  const int box_first_;  // global rank of this box's leader
  const int world_;
  const int rank_;

  // --- own synchronisation
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  absl::Status first_failure_;  // guarded by mu_

  // --- the calling thread's
  std::vector<float> scratch_f32_;
  std::vector<char> scratch_;
};

absl::Status HierarchicalCommunicator::Check() const {
  if (!broken_.load()) return absl::OkStatus();
  std::lock_guard<std::mutex> l(mu_);
  return absl::AbortedError(absl::StrCat("communicator broken: ", first_failure_.message()));
}

absl::Status HierarchicalCommunicator::health() const {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!first_failure_.ok()) return first_failure_;
  }
  EXL3_RETURN_IF_ERROR(intra_->health());
  if (leader()) return inter_->health();
  return absl::OkStatus();
}

void HierarchicalCommunicator::Abort(const absl::Status& reason) {
  absl::Status status =
      reason.ok() ? absl::AbortedError("Abort() called with an OK status") : reason;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (first_failure_.ok()) first_failure_ = status;
    broken_.store(true);
  }
  intra_->Abort(status);
  if (leader()) inter_->Abort(status);
}

absl::Status HierarchicalCommunicator::Step(const absl::Status& status) {
  if (status.ok()) return status;
  Abort(status);
  return status;
}

absl::Status HierarchicalCommunicator::AllReduceF32(float* data, size_t count,
                                                    absl::Time deadline) {
  const size_t bytes = count * sizeof(float);
  EXL3_RETURN_IF_ERROR(Step(intra_->AllReduce(data, count, CommDataType::kF32, deadline)));
  if (num_boxes() == 1) return absl::OkStatus();
  if (leader())
    EXL3_RETURN_IF_ERROR(Step(inter_->AllReduce(data, count, CommDataType::kF32, deadline)));
  if (intra_->world_size() == 1) return absl::OkStatus();
  return Step(intra_->Broadcast(data, bytes, 0, deadline));
}

absl::Status HierarchicalCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                                 absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  if (type == CommDataType::kF32) return AllReduceF32(static_cast<float*>(data), count, deadline);
  // bf16: carry fp32 through every step, round once at the end.
  auto* h = static_cast<uint16_t*>(data);
  scratch_f32_.resize(count);
  for (size_t i = 0; i < count; ++i) scratch_f32_[i] = BF16ToF32(h[i]);
  EXL3_RETURN_IF_ERROR(AllReduceF32(scratch_f32_.data(), count, deadline));
  for (size_t i = 0; i < count; ++i) h[i] = F32ToBF16(scratch_f32_[i]);
  return absl::OkStatus();
}

absl::Status HierarchicalCommunicator::ReduceScatter(const void* data, size_t count,
                                                     CommDataType type, void* recv,
                                                     absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  const size_t total = count * static_cast<size_t>(world_);
  scratch_f32_.resize(total);
  if (type == CommDataType::kF32) {
    std::memcpy(scratch_f32_.data(), data, total * sizeof(float));
  } else {
    const auto* h = static_cast<const uint16_t*>(data);
    for (size_t i = 0; i < total; ++i) scratch_f32_[i] = BF16ToF32(h[i]);
  }
  EXL3_RETURN_IF_ERROR(AllReduceF32(scratch_f32_.data(), total, deadline));
  const float* mine = scratch_f32_.data() + count * static_cast<size_t>(rank_);
  if (type == CommDataType::kF32) {
    std::memcpy(recv, mine, count * sizeof(float));
  } else {
    auto* h = static_cast<uint16_t*>(recv);
    for (size_t i = 0; i < count; ++i) h[i] = F32ToBF16(mine[i]);
  }
  return absl::OkStatus();
}

absl::Status HierarchicalCommunicator::GatherAll(const void* mine,
                                                 std::span<const size_t> bytes_per_rank, void* recv,
                                                 absl::Time deadline) {
  // Byte offset of each global rank's piece, and each box's slice.
  std::vector<size_t> offset(world_ + 1, 0);
  for (int r = 0; r < world_; ++r) offset[r + 1] = offset[r] + bytes_per_rank[r];
  const int n = intra_->world_size();
  char* out = static_cast<char*>(recv);
  char* box_slice = out + offset[box_first_];
  EXL3_RETURN_IF_ERROR(
      Step(intra_->AllGatherV(mine, bytes_per_rank.subspan(box_first_, n), box_slice, deadline)));
  if (num_boxes() == 1) return absl::OkStatus();
  if (leader()) {
    std::vector<size_t> per_box(num_boxes());
    int first = 0;
    for (int b = 0; b < num_boxes(); ++b) {
      per_box[b] = offset[first + box_sizes_[b]] - offset[first];
      first += box_sizes_[b];
    }
    // A separate send buffer: AllGatherV does not promise that send may
    // alias recv.
    scratch_.assign(box_slice, box_slice + per_box[box_]);
    EXL3_RETURN_IF_ERROR(Step(inter_->AllGatherV(scratch_.data(), per_box, out, deadline)));
  }
  if (n == 1) return absl::OkStatus();
  return Step(intra_->Broadcast(out, offset[world_], 0, deadline));
}

absl::Status HierarchicalCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                                 absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  std::vector<size_t> sizes(world_, bytes);
  // send may alias recv + rank·bytes; the intra step's AllGatherV would see
  // send == its recv slot, so copy it out first.
  std::vector<char> mine(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
  return GatherAll(mine.data(), sizes, recv, deadline);
}

absl::Status HierarchicalCommunicator::AllGatherV(const void* send,
                                                  std::span<const size_t> bytes_per_rank,
                                                  void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  if (bytes_per_rank.size() != static_cast<size_t>(world_)) {
    return Step(absl::InvalidArgumentError(
        absl::StrCat("hierarchical AllGatherV: bytes_per_rank has ", bytes_per_rank.size(),
                     " entries, expected world_size ", world_)));
  }
  return GatherAll(send, bytes_per_rank, recv, deadline);
}

absl::Status HierarchicalCommunicator::AllToAllV(const void* send,
                                                 std::span<const size_t> send_bytes, void* recv,
                                                 std::span<const size_t> recv_bytes,
                                                 absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  const size_t n = static_cast<size_t>(world_);
  if (send_bytes.size() != n || recv_bytes.size() != n) {
    return Step(absl::InvalidArgumentError(
        absl::StrCat("hierarchical AllToAllV: send_bytes/recv_bytes have ", send_bytes.size(), "/",
                     recv_bytes.size(), " entries, expected world_size ", world_)));
  }
  // 1. Every rank's row of the byte matrix.
  std::vector<uint64_t> row(send_bytes.begin(), send_bytes.end());
  std::vector<uint64_t> matrix(n * n);
  std::vector<size_t> row_bytes(n, n * sizeof(uint64_t));
  EXL3_RETURN_IF_ERROR(GatherAll(row.data(), row_bytes, matrix.data(), deadline));
  // 2. Every rank's whole send buffer.
  std::vector<size_t> totals(n, 0);
  for (size_t s = 0; s < n; ++s) {
    for (size_t d = 0; d < n; ++d) totals[s] += matrix[s * n + d];
  }
  std::vector<size_t> start(n + 1, 0);
  for (size_t s = 0; s < n; ++s) start[s + 1] = start[s] + totals[s];
  std::vector<char> everything(start[n]);
  EXL3_RETURN_IF_ERROR(GatherAll(send, totals, everything.data(), deadline));
  // 3. This rank's column.
  char* out = static_cast<char*>(recv);
  const size_t me = static_cast<size_t>(rank_);
  for (size_t s = 0; s < n; ++s) {
    if (matrix[s * n + me] != recv_bytes[s]) {
      return Step(absl::InvalidArgumentError(absl::StrCat(
          "hierarchical AllToAllV: rank ", s, " sends ", matrix[s * n + me], " bytes to rank ", me,
          ", which expects recv_bytes[", s, "] = ", recv_bytes[s])));
    }
    size_t at = start[s];
    for (size_t d = 0; d < me; ++d) at += matrix[s * n + d];
    if (recv_bytes[s] > 0) std::memcpy(out, everything.data() + at, recv_bytes[s]);
    out += recv_bytes[s];
  }
  return absl::OkStatus();
}

absl::Status HierarchicalCommunicator::Broadcast(void* data, size_t bytes, int root,
                                                 absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  if (root < 0 || root >= world_) {
    return Step(absl::InvalidArgumentError(
        absl::StrCat("hierarchical Broadcast: root must be in [0, ", world_, "), got ", root)));
  }
  int root_box = 0, first = 0;
  while (root >= first + box_sizes_[root_box]) first += box_sizes_[root_box++];
  const int root_local = root - first;
  // The root's box first (its leader then holds the data), then the leaders,
  // then every other box.
  if (box_ == root_box && intra_->world_size() > 1) {
    EXL3_RETURN_IF_ERROR(Step(intra_->Broadcast(data, bytes, root_local, deadline)));
  }
  if (num_boxes() == 1) return absl::OkStatus();
  if (leader()) EXL3_RETURN_IF_ERROR(Step(inter_->Broadcast(data, bytes, root_box, deadline)));
  if (box_ != root_box && intra_->world_size() > 1) {
    EXL3_RETURN_IF_ERROR(Step(intra_->Broadcast(data, bytes, 0, deadline)));
  }
  return absl::OkStatus();
}

absl::Status HierarchicalCommunicator::Barrier(absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Check());
  EXL3_RETURN_IF_ERROR(Step(intra_->Barrier(deadline)));
  if (num_boxes() == 1) return absl::OkStatus();
  if (leader()) EXL3_RETURN_IF_ERROR(Step(inter_->Barrier(deadline)));
  if (intra_->world_size() == 1) return absl::OkStatus();
  return Step(intra_->Barrier(deadline));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateHierarchicalCommunicator(
    std::unique_ptr<Communicator> intra, std::unique_ptr<Communicator> inter, absl::Time deadline) {
  if (intra == nullptr)
    return absl::InvalidArgumentError("hierarchical: no intra-box communicator");
  const bool leader = intra->rank() == 0;
  if (leader != (inter != nullptr)) {
    absl::Status error = absl::InvalidArgumentError(
        absl::StrCat("hierarchical: intra rank ", intra->rank(),
                     (leader ? " is the box leader but has no inter-box communicator"
                             : " is not the box leader but has an inter-box communicator")));
    intra->Abort(error);
    if (inter != nullptr) inter->Abort(error);
    return error;
  }
  // Box sizes: leaders all-gather theirs, then tell their box.
  // Message inside the box: [num_boxes, box index, size_0, ..., size_{B-1}].
  std::vector<int32_t> header(2, 0);
  std::vector<int32_t> sizes;
  absl::Status status;
  if (leader) {
    const int32_t mine = intra->world_size();
    sizes.resize(inter->world_size());
    status = inter->AllGather(&mine, sizeof(mine), sizes.data(), deadline);
    header = {inter->world_size(), inter->rank()};
  }
  if (status.ok())
    status = intra->Broadcast(header.data(), header.size() * sizeof(int32_t), 0, deadline);
  if (status.ok()) {
    sizes.resize(header[0]);
    status = intra->Broadcast(sizes.data(), sizes.size() * sizeof(int32_t), 0, deadline);
  }
  if (status.ok() &&
      (header[1] < 0 || header[1] >= header[0] || sizes[header[1]] != intra->world_size())) {
    status = absl::InternalError("hierarchical: the leader's box layout does not match this box");
  }
  if (!status.ok()) {
    intra->Abort(status);
    if (inter != nullptr) inter->Abort(status);
    return Annotate(status, "hierarchical setup");
  }
  return std::unique_ptr<Communicator>(std::make_unique<HierarchicalCommunicator>(
      std::move(intra), std::move(inter), std::vector<int>(sizes.begin(), sizes.end()), header[1]));
}

}  // namespace exl3serve::worker::comm
