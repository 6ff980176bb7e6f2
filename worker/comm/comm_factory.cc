#include "worker/comm/comm_factory.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "common/status_macros.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"

namespace exl3serve::worker::comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommSpec& spec, int rank,
                                                                 int world_size,
                                                                 absl::Time join_deadline) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("communicator: rank ", rank, " of world size ", world_size));
  }
  if (spec.backend == "shm") {
    if (spec.shm_name.empty()) {
      return absl::InvalidArgumentError("communicator: backend shm needs a segment name");
    }
    ShmOptions options;
    options.name = spec.shm_name;
    options.rank = rank;
    options.world_size = world_size;
    options.join_deadline = join_deadline;
    return CreateShmCommunicator(options);
  }
  if (spec.backend == "ucx") {
    const size_t colon = spec.bootstrap_address.rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(spec.bootstrap_address.substr(colon + 1), &port) || port == 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "communicator: backend ucx needs --bootstrap HOST:PORT, got `",
          spec.bootstrap_address, "`"));
    }
    TcpBootstrapOptions bootstrap_options;
    bootstrap_options.rank = rank;
    bootstrap_options.world_size = world_size;
    bootstrap_options.host = spec.bootstrap_address.substr(0, colon);
    bootstrap_options.port = static_cast<uint16_t>(port);
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TcpBootstrap> bootstrap,
                          TcpBootstrap::Create(bootstrap_options, join_deadline));
    UcxOptions options;
    options.tls = spec.ucx_tls;
    options.setup_timeout = std::max(absl::Seconds(1), join_deadline - absl::Now());
    return CreateUcxCommunicator(options, *bootstrap);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("communicator: unknown backend `", spec.backend, "` (expected shm or ucx)"));
}

}  // namespace exl3serve::worker::comm
