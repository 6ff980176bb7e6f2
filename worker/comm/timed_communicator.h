// worker/comm/timed_communicator.h — a Communicator decorator that times
// every call of the one it wraps and reports it to a CollectiveObserver
// (the rank's metrics: worker/metrics.h). It changes nothing else: every
// call, status, Abort() and health() is the inner communicator's.
//
//   comm = WithCollectiveTiming(std::move(comm), observer);
//
// Ownership: owns the inner communicator; the observer is borrowed and must
// outlive the decorator. Thread safety: as Communicator (one calling thread;
// Abort() from any); the observer is called on the calling thread.
#ifndef EXL3SERVE_WORKER_COMM_TIMED_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_TIMED_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

enum class CollectiveOp {
  kAllReduce,
  kAllGather,
  kAllGatherV,
  kReduceScatter,
  kAllToAllV,
  kBroadcast,
  kBarrier,
};
// "all_reduce", "all_gather", "all_gather_v", "reduce_scatter",
// "all_to_all_v", "broadcast", "barrier".
const char* CollectiveOpName(CollectiveOp op);

// The message-size class of a call of `bytes` (this rank's payload), a
// bounded label: "le_4KiB", "le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB".
const char* CollectiveSizeClass(size_t bytes);

class CollectiveObserver {
 public:
  virtual ~CollectiveObserver() = default;
  // One finished call: its backend (the inner backend_name()), operation,
  // this rank's payload bytes, wall time and outcome.
  virtual void OnCollective(const std::string& backend, CollectiveOp op, size_t bytes,
                            absl::Duration elapsed, const absl::Status& status) = 0;
};

// Wraps `inner`; with a null observer returns `inner` unchanged.
std::unique_ptr<Communicator> WithCollectiveTiming(std::unique_ptr<Communicator> inner,
                                                   CollectiveObserver* observer);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_TIMED_COMMUNICATOR_H_
