// worker/comm/comm_factory.h — a Communicator from a backend name and its
// settings, as the rank process's flags and the cluster config give them.
//
//   CommSpec spec;  spec.backend = "shm";  spec.shm_name = "/exl3-1234";
//   EXL3_ASSIGN_OR_RETURN(auto comm, CreateCommunicator(spec, rank, world, deadline));
#ifndef EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_
#define EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

struct CommSpec {
  std::string backend = "shm";  // "shm" (one box) or "ucx" (across boxes)
  // shm: the POSIX shared-memory name every rank of the group uses ("/...").
  std::string shm_name;
  // ucx: host:port where rank 0 listens for the bootstrap exchange.
  std::string bootstrap_address;
  // ucx: UCX transports (UCX_TLS syntax), e.g. "tcp"; empty = UCX's default.
  std::string ucx_tls;
};

// Joins the group as `rank` of `world_size` by `join_deadline`.
// Errors: InvalidArgument for an unknown backend or a missing setting
// (named); those of the backend's Create (DeadlineExceeded when peers do not
// appear).
absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommSpec& spec, int rank,
                                                                 int world_size,
                                                                 absl::Time join_deadline);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_COMM_FACTORY_H_
