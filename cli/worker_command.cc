// `exl3serve worker ...`: one rank of a tensor/expert-parallel group
// (worker/rank/rank_server.h). Started by a driver (`generate --tp N`) that
// hands it one end of a socketpair as --control-fd; not meant to be typed.
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "worker/rank/rank_server.h"

namespace exl3serve::cli {

CommandRunner RegisterWorkerCommand(CLI::App& app) {
  struct Args {
    worker::rank::RankServerOptions options;
    int kv_bits = 16;
    int64_t collective_timeout_ms = 60'000, join_timeout_ms = 60'000;
  };
  auto args = std::make_shared<Args>();
  worker::rank::RankServerOptions& o = args->options;
  app.add_option("--model", o.model_dir, "model directory")->required();
  app.add_option("--rank", o.rank, "this rank")->required();
  app.add_option("--world-size", o.world_size, "ranks in the group")->required();
  app.add_option("--ep", o.expert_parallel, "expert-parallel groups (0 = one per rank)");
  app.add_option("--comm", o.comm.backend, "collective backend: shm or ucx")->capture_default_str();
  app.add_option("--shm-name", o.comm.shm_name, "shm: the group's shared-memory segment");
  app.add_option("--bootstrap", o.comm.bootstrap_address, "ucx: rank 0's host:port");
  app.add_option("--ucx-tls", o.comm.ucx_tls, "ucx: transports, e.g. tcp");
  app.add_option("--control-fd", o.control_fd, "the driver's control socket")->required();
  app.add_option("--threads", o.threads, "kernel threads")->capture_default_str();
  app.add_option("--kv-bits", args->kv_bits, "KV cache: 32, 16, 8 or 4")->capture_default_str();
  app.add_option("--kv-pages", o.kv.num_pages, "KV cache pages")->capture_default_str();
  app.add_option("--kv-page-size", o.kv.page_size_tokens, "positions per page")
      ->capture_default_str();
  app.add_option("--collective-timeout-ms", args->collective_timeout_ms)->capture_default_str();
  app.add_option("--join-timeout-ms", args->join_timeout_ms)->capture_default_str();
  return [args]() -> absl::Status {
    worker::rank::RankServerOptions options = args->options;
    EXL3_ASSIGN_OR_RETURN(options.kv.dtype, worker::KvCacheDtypeFromBits(args->kv_bits));
    options.collective_timeout = absl::Milliseconds(args->collective_timeout_ms);
    options.join_timeout = absl::Milliseconds(args->join_timeout_ms);
    return worker::rank::RunRankServer(options);
  };
}

}  // namespace exl3serve::cli
