#include "worker/rank/executor_factory.h"

#include <utility>

#include "common/status_macros.h"
#include "worker/model/linear.h"
#include "worker/model/model_config.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve::worker::rank {
namespace {

// A LocalStepExecutor that owns its model (the engine keeps only the seam).
class OwningLocalExecutor final : public StepExecutor {
 public:
  OwningLocalExecutor(std::unique_ptr<Transformer> model, PagedKvCache cache)
      : model_(std::move(model)), inner_(model_.get(), std::move(cache)) {}
  int64_t vocab_size() const override { return inner_.vocab_size(); }
  absl::Status AddSequence(int64_t seq_id) override { return inner_.AddSequence(seq_id); }
  absl::Status RemoveSequence(int64_t seq_id) override { return inner_.RemoveSequence(seq_id); }
  absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                       std::vector<float>* logits) override {
    return inner_.Forward(batch, rows, logits);
  }
  absl::Status AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) override {
    return inner_.AddSampledSequence(seq_id, sampling);
  }
  absl::Status ForwardSampled(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                              std::vector<SampledToken>* tokens) override {
    return inner_.ForwardSampled(batch, sample, tokens);
  }
  absl::Status ForwardVerified(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<SampledToken>>* runs) override {
    return inner_.ForwardVerified(batch, sample, draft_counts, runs);
  }
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) override {
    return inner_.AssignPages(seq_id, page_ids);
  }
  absl::Status TruncateSequence(int64_t seq_id, std::span<const int32_t> dropped) override {
    return inner_.TruncateSequence(seq_id, dropped);
  }
  std::optional<KvCacheOptions> kv_options() const override { return inner_.kv_options(); }
  absl::Status SaveKvBlocks(std::span<const KvBlockTransfer> saves) override {
    return inner_.SaveKvBlocks(saves);
  }
  absl::Status LoadKvBlocks(std::span<const KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override {
    return inner_.LoadKvBlocks(loads, loaded);
  }
  absl::Status SaveStateSnapshots(std::span<const StateSnapshotSave> saves) override {
    return inner_.SaveStateSnapshots(saves);
  }
  LocalStepExecutor& inner() { return inner_; }

 private:
  std::unique_ptr<Transformer> model_;  // declared first: outlives inner_
  LocalStepExecutor inner_;
};

}  // namespace

absl::StatusOr<ModelFacts> ReadModelFacts(const std::string& model_dir) {
  EXL3_ASSIGN_OR_RETURN(ModelConfig config, ReadModelConfig(model_dir));
  return ModelFacts{.arch = config.arch, .eos_token_ids = config.eos_token_ids};
}

absl::StatusOr<LocalExecutor> CreateLocalExecutor(const LocalExecutorOptions& options) {
  LocalExecutor out;
  if (options.ranks <= 1) {
    EXL3_RETURN_IF_ERROR(SetPrefillPrecision(options.prefill_precision));
    EXL3_RETURN_IF_ERROR(SetDecodePrecision(options.decode_precision));
    TransformerLoadOptions load_options;
    load_options.spill = options.spill;
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Transformer> model,
                          Transformer::Load(options.model_dir, load_options));
    out.facts = {.arch = model->config().arch, .eos_token_ids = model->config().eos_token_ids};
    KvCacheOptions kv = options.kv;
    kv.caller_assigns_pages = !options.executor_assigns_pages;
    EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, model->CreateKvCache(kv));
    auto owning = std::make_unique<OwningLocalExecutor>(std::move(model), std::move(cache));
    if (options.kv_disk_slots > 0) {
      EXL3_ASSIGN_OR_RETURN(
          std::unique_ptr<KvDiskTier> tier,
          KvDiskTier::Open({.path = KvDiskPathOfRank(options.kv_disk_path, 0),
                            .slots = options.kv_disk_slots,
                            .slot_bytes = owning->inner().cache().bytes_per_page()}));
      owning->inner().set_disk_tier(std::move(tier));
    }
    out.executor = std::move(owning);
    return out;
  }
  if (options.executor_assigns_pages) {
    return absl::InvalidArgumentError(
        "local rank processes take pages only from the caller's block tables "
        "(executor_assigns_pages needs ranks = 1)");
  }
  EXL3_ASSIGN_OR_RETURN(out.facts, ReadModelFacts(options.model_dir));
  LocalGroupOptions group;
  group.model_dir = options.model_dir;
  group.world_size = options.ranks;
  group.expert_parallel = options.expert_parallel;
  group.executable = options.rank_executable;
  group.threads_per_rank = options.threads_per_rank;
  group.kv = options.kv;
  group.kv.caller_assigns_pages = true;
  group.step_timeout = options.step_timeout;
  group.metrics_port = options.metrics_port;
  group.metrics_host = options.metrics_host;
  group.spill = options.spill;
  group.capacities = options.capacities;
  group.prefill_precision = options.prefill_precision;
  group.decode_precision = options.decode_precision;
  group.kv_disk_path = options.kv_disk_path;
  group.kv_disk_slots = options.kv_disk_slots;
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<LocalGroup> local, LocalGroup::Start(group));
  const LocalGroup* ranks_of = local.get();
  out.rank_state = [ranks_of] {
    std::vector<LocalRankState> states;
    for (const LocalRankStatus& s : ranks_of->rank_status()) {
      states.push_back({.rank = s.rank, .up = s.up, .address = s.address, .bytes_read = s.bytes_read});
    }
    return states;
  };
  out.executor = std::move(local);
  return out;
}

}  // namespace exl3serve::worker::rank
