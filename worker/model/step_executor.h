// worker/model/step_executor.h — the in-process implementations of the
// step-executor seam (worker/api/step_executor.h): LocalStepExecutor (a
// Transformer of this process and its cache) and RunSampledForward, which
// the rank process shares.
//
//   LocalStepExecutor local(model.get(), std::move(cache));
//   EXL3_RETURN_IF_ERROR(local.AddSequence(7));
//   EXL3_RETURN_IF_ERROR(local.Forward(batch, LogitsRows::kLastToken, &logits));
#ifndef EXL3SERVE_WORKER_MODEL_STEP_EXECUTOR_H_
#define EXL3SERVE_WORKER_MODEL_STEP_EXECUTOR_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/api/step_executor.h"
#include "worker/model/kv_cache.h"
#include "worker/model/kv_disk_tier.h"
#include "worker/model/transformer.h"
#include "worker/model/vocab_sampler.h"

namespace exl3serve::worker {


// A Transformer of this process and a cache. Borrows the model (which must
// outlive it); owns or borrows the cache.
// One rank's sampled forward, shared by LocalStepExecutor and the rank
// process (rank_executor.h): ForwardVocabSlice, then every sequence of the
// batch observes its new tokens (penalty counts, positions), then the
// entries with sample[i] draw (VocabSampler::Sample, collective under TP).
// `slice` is scratch. Errors as StepExecutor::ForwardSampled.
absl::Status RunSampledForward(const Transformer& model, PagedKvCache* cache,
                               VocabSampler* sampler, std::span<const SequenceTokens> batch,
                               std::span<const uint8_t> sample, std::vector<float>* slice,
                               std::vector<SampledToken>* tokens);

// Speculative verification (issue 18): as RunSampledForward, except that
// the last draft_counts[i] tokens of entry i are draft tokens, not yet
// accepted (entry i then needs sample[i] != 0 and at least one token before
// its drafts: the last accepted token). One forward computes every
// position; then, round by round, each drafting sequence draws the token at
// its next position with its own sampler (penalties and the counter-based
// draw see exactly the tokens before that position) and accepts the draft
// token there iff the draw equals it. (*runs)[i] holds what serial decoding
// would have drawn: the accepted draft tokens, then one more (the first
// draw that differs from the draft, or the one after a fully accepted
// draft). An entry without drafts gets its one token as RunSampledForward.
// The KV positions and sampler history of rejected drafts are dropped
// (PagedKvCache::SetLength lowered; the pages stay assigned). Every rank
// takes the same decisions (draws are identical on every rank), so the
// rounds are collective like Sample. Errors: RunSampledForward's;
// InvalidArgument for a draft count that leaves no accepted token or that
// is set on an entry that is not sampled.
absl::Status RunVerifiedForward(const Transformer& model, PagedKvCache* cache,
                                VocabSampler* sampler, std::span<const SequenceTokens> batch,
                                std::span<const uint8_t> sample,
                                std::span<const int32_t> draft_counts, std::vector<float>* slice,
                                std::vector<std::vector<SampledToken>>* runs);

// SequenceSampling's cached_state_* as a snapshot reference.
inline StateSnapshotRef CachedStateOf(const SequenceSampling& sampling) {
  return {.slot = sampling.cached_state_slot,
          .hash_hi = sampling.cached_state_hash_hi,
          .hash_lo = sampling.cached_state_hash_lo};
}
// Each save in order (PagedKvCache::SaveStateSnapshot); stops at the first
// error.
absl::Status SaveStateSnapshots(PagedKvCache* cache, std::span<const StateSnapshotSave> saves);

// A sampler over `model`'s vocabulary slice and communicator.
VocabSampler MakeVocabSampler(const Transformer& model);

class LocalStepExecutor final : public StepExecutor {
 public:
  LocalStepExecutor(const Transformer* model, PagedKvCache cache)
      : model_(model), owned_(std::move(cache)), cache_(&*owned_),
        sampler_(MakeVocabSampler(*model)) {}
  LocalStepExecutor(const Transformer* model, PagedKvCache* cache)
      : model_(model), cache_(cache), sampler_(MakeVocabSampler(*model)) {}
  LocalStepExecutor(const LocalStepExecutor&) = delete;
  LocalStepExecutor& operator=(const LocalStepExecutor&) = delete;

  int64_t vocab_size() const override { return model_->vocab_size(); }
  absl::Status AddSequence(int64_t seq_id) override { return cache_->AddSequence(seq_id); }
  absl::Status RemoveSequence(int64_t seq_id) override {
    sampler_.RemoveSequence(seq_id);
    return cache_->RemoveSequence(seq_id);
  }
  absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                       std::vector<float>* logits) override {
    return model_->Forward(batch, rows, cache_, logits);
  }
  absl::Status AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) override;
  absl::Status ForwardSampled(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                              std::vector<SampledToken>* tokens) override {
    return RunSampledForward(*model_, cache_, &sampler_, batch, sample, &slice_, tokens);
  }
  absl::Status ForwardVerified(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<SampledToken>>* runs) override {
    return RunVerifiedForward(*model_, cache_, &sampler_, batch, sample, draft_counts, &slice_,
                              runs);
  }
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) override {
    return cache_->AssignPages(seq_id, page_ids);
  }
  absl::Status TruncateSequence(int64_t seq_id, std::span<const int32_t> dropped) override;
  absl::Status SaveStateSnapshots(std::span<const StateSnapshotSave> saves) override {
    return worker::SaveStateSnapshots(cache_, saves);
  }
  std::optional<KvCacheOptions> kv_options() const override { return cache_->options(); }
  PagedKvCache& cache() { return *cache_; }
  // The prefix cache's disk tier of this process (null = none: Save/Load
  // are Unimplemented).
  void set_disk_tier(std::unique_ptr<KvDiskTier> tier) { disk_tier_ = std::move(tier); }
  KvDiskTier* disk_tier() const { return disk_tier_.get(); }
  absl::Status SaveKvBlocks(std::span<const KvBlockTransfer> saves) override {
    if (disk_tier_ == nullptr) return StepExecutor::SaveKvBlocks(saves);
    SaveKvBlocksToDisk(*cache_, disk_tier_.get(), saves);
    return absl::OkStatus();
  }
  absl::Status LoadKvBlocks(std::span<const KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override {
    if (disk_tier_ == nullptr) return StepExecutor::LoadKvBlocks(loads, loaded);
    LoadKvBlocksFromDisk(cache_, disk_tier_.get(), loads, loaded);
    return absl::OkStatus();
  }

 private:
  const Transformer* model_;
  std::optional<PagedKvCache> owned_;
  PagedKvCache* cache_;
  VocabSampler sampler_;
  std::vector<float> slice_;  // scratch of ForwardSampled
  std::unique_ptr<KvDiskTier> disk_tier_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_STEP_EXECUTOR_H_
