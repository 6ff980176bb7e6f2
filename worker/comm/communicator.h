// worker/comm/communicator.h — the one collective interface every rank uses,
// whatever carries the bytes: `shm` (CPU ranks on one box, POSIX shared
// memory), `ucx` (CPU ranks across boxes), `nccl` (GPU ranks across boxes),
// `cuda_p2p` (GPU ranks on one box, CUDA IPC) and `hierarchical` (inside each
// box, then across boxes).
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, CreateShmCommunicator(options));
//   EXL3_RETURN_IF_ERROR(comm->AllReduce(buf, n, CommDataType::kF32, Deadline(absl::Seconds(5))));
//
// Contract shared by every backend:
//   * Collective: every rank of the group calls the same operations in the
//     same order with matching sizes (all-to-all(v): matching send/recv
//     counts). A mismatch is a programming error; backends detect what they
//     can (size mismatch) and fail with InvalidArgument/Internal.
//   * Deadlines: every call takes an absolute deadline and returns
//     DeadlineExceeded (naming the operation and the ranks not heard from)
//     when it passes. No call ever blocks past its deadline by more than the
//     backend's poll interval (a few ms).
//   * Consistent failure: a rank that fails a call (deadline, a peer process
//     gone, a transport error, Abort()) marks the whole group broken; every
//     other rank's current or next call fails too — with Aborted
//     ("communicator broken: <first reason>") — instead of hanging or
//     desynchronising. Once broken, a communicator stays broken; the group is
//     re-formed by creating new communicators.
//   * Determinism: AllReduce and ReduceScatter sum in a fixed rank order
//     (rank 0 + rank 1 + ... in fp32 for kF32, fp32 accumulation rounded once
//     to bf16 for kBF16), so every rank receives bit-identical results, and
//     the same inputs always give the same bits.
//   * Buffers may be any host memory (GPU backends: device memory); they are
//     not retained after the call returns.
//
// Thread safety: one thread per communicator at a time (calls are collective
// and ordered); Abort() may be called from any thread.
#ifndef EXL3SERVE_WORKER_COMM_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace exl3serve::worker::comm {

enum class CommDataType {
  kF32,   // 4 bytes
  kBF16,  // 2 bytes; reductions accumulate in fp32, round once (RNE)
};

size_t CommDataTypeSize(CommDataType type);
const char* CommDataTypeName(CommDataType type);

// An absolute deadline `timeout` from now.
inline absl::Time Deadline(absl::Duration timeout) { return absl::Now() + timeout; }

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "shm", "ucx", "nccl", "cuda_p2p", "hierarchical".
  virtual std::string backend_name() const = 0;

  // In place: data[i] = Σ_r data_r[i] over all ranks, `count` elements.
  virtual absl::Status AllReduce(void* data, size_t count, CommDataType type,
                                 absl::Time deadline) = 0;

  // recv (world_size · bytes) = concatenation of every rank's `bytes` from
  // `send`, in rank order. send may alias recv + rank·bytes.
  virtual absl::Status AllGather(const void* send, size_t bytes, void* recv,
                                 absl::Time deadline) = 0;

  // Variable sizes: rank r contributes bytes_per_rank[r] bytes (its own
  // entry equals the size of `send`); recv receives them concatenated in rank
  // order. bytes_per_rank is the same on every rank.
  virtual absl::Status AllGatherV(const void* send, std::span<const size_t> bytes_per_rank,
                                  void* recv, absl::Time deadline) = 0;

  // data holds world_size · count elements on every rank; on return the
  // first `count` elements of `recv` are the sum over ranks of block `rank`.
  virtual absl::Status ReduceScatter(const void* data, size_t count, CommDataType type,
                                     void* recv, absl::Time deadline) = 0;

  // Rank r sends send_bytes[p] bytes (consecutive in `send`, destination
  // order) to each rank p, and receives recv_bytes[p] bytes from each p into
  // `recv` (consecutive, source order). send_bytes[p] on rank r equals
  // recv_bytes[r] on rank p.
  virtual absl::Status AllToAllV(const void* send, std::span<const size_t> send_bytes,
                                 void* recv, std::span<const size_t> recv_bytes,
                                 absl::Time deadline) = 0;

  // data (bytes) of rank `root` is copied to every other rank's data.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root, absl::Time deadline) = 0;

  virtual absl::Status Barrier(absl::Time deadline) = 0;

  // Marks the group broken with `reason` (a failure this rank saw outside
  // the communicator, e.g. a kernel error mid-step) so the peers' calls fail
  // promptly. Idempotent; the first reason wins.
  virtual void Abort(const absl::Status& reason) = 0;

  // OK while usable; the first failure once broken.
  virtual absl::Status health() const = 0;
};

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_COMMUNICATOR_H_
