// worker/comm/bootstrap.h — the out-of-band exchange a group uses to set
// itself up: each rank contributes a blob (a UCX worker address, an NCCL
// unique id, a CUDA IPC handle) and receives everyone's, before the fast
// transport exists. Implementations: TcpBootstrap (worker/comm/tcp_bootstrap.h:
// rank 0 listens, the others connect — works across boxes and namespaces);
// later the coordinator's control plane.
#ifndef EXL3SERVE_WORKER_COMM_BOOTSTRAP_H_
#define EXL3SERVE_WORKER_COMM_BOOTSTRAP_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace exl3serve::worker::comm {

// Thread safety: one thread at a time. Collective: every rank calls the same
// sequence of AllGather calls.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Returns every rank's blob, index = rank (blobs may differ in size).
  // Errors: DeadlineExceeded naming the missing ranks; Unavailable when a
  // peer's connection drops.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob,
                                                             absl::Time deadline) = 0;
};

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_BOOTSTRAP_H_
