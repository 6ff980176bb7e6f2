// worker/rank/executor_factory.h — builds the step executor a serving
// engine drives on this box, without the engine seeing a model or a rank:
// the model in this process (one rank) or N local rank processes
// (local_group.h). With worker/api/, this is all coordinator/ includes of
// worker/.
//
//   LocalExecutorOptions o;  o.model_dir = dir;  o.ranks = 2;  o.kv = kv;
//   EXL3_ASSIGN_OR_RETURN(LocalExecutor local, CreateLocalExecutor(o));
//   engine = LocalEngine(options, facts, std::move(local.executor));
#ifndef EXL3SERVE_WORKER_RANK_EXECUTOR_FACTORY_H_
#define EXL3SERVE_WORKER_RANK_EXECUTOR_FACTORY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/trellis_gemm.h"
#include "sharding/model_arch.h"
#include "sharding/spill_store.h"
#include "worker/api/step_executor.h"
#include "worker/rank/capacities.h"

namespace exl3serve::worker::rank {

// What a coordinator needs of a model besides an executor: its shape and the
// token ids that end a sequence (config.json and generation_config.json).
struct ModelFacts {
  sharding::ModelArch arch;
  std::vector<int32_t> eos_token_ids;
};

// Reads config.json (+ generation_config.json) of an EXL3 or Hugging Face
// model directory. Errors: those of worker::ReadModelConfig (NotFound,
// InvalidArgument naming the field, Unimplemented architectures).
absl::StatusOr<ModelFacts> ReadModelFacts(const std::string& model_dir);

struct LocalExecutorOptions {
  std::string model_dir;
  // 1: the model runs in this process; more: local rank processes.
  int ranks = 1;
  int expert_parallel = 0;  // sharding::ShardOptions::expert_parallel
  int threads_per_rank = 1;
  std::string rank_executable;  // empty: this process's executable
  // Every rank's cache (caller_assigns_pages is forced on: the caller's block
  // tables place every sequence — unless executor_assigns_pages).
  KvCacheOptions kv;
  // ranks == 1 only: the cache takes pages from its own pool (a draft model's
  // cache, coordinator/draft_model.h, which no block table places).
  bool executor_assigns_pages = false;
  // The prefix cache's disk tier of every rank (RankSetup::kv_disk_*):
  // kv_disk_slots 0 = none.
  std::string kv_disk_path;
  int64_t kv_disk_slots = 0;
  absl::Duration step_timeout = absl::Seconds(60);
  int metrics_port = 0;  // rank r serves /metrics on metrics_port + r; 0 = off
  std::string metrics_host = "127.0.0.1";
  sharding::SpillPolicy spill;
  std::vector<double> capacities;
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
};

// One rank as GetServerInfo lists it.
struct LocalRankState {
  int rank = 0;
  bool up = false;
  std::string address;      // "HOST pid P (local)"
  uint64_t bytes_read = 0;  // checkpoint bytes it read while loading
};

struct LocalExecutor {
  std::unique_ptr<StepExecutor> executor;  // owns the model or the ranks
  ModelFacts facts;
  // Thread-safe while `executor` lives; empty for a model in this process.
  std::function<std::vector<LocalRankState>()> rank_state;
};

// Loads the model in this process (ranks == 1; the linears' precisions are
// set process-wide) or starts the rank processes and waits until they have
// loaded. Errors: those of loading or of LocalGroup::Start.
absl::StatusOr<LocalExecutor> CreateLocalExecutor(const LocalExecutorOptions& options);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_EXECUTOR_FACTORY_H_
