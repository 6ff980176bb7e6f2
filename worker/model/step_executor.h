// worker/model/step_executor.h — what a generation loop needs from "the
// model": sequences with cached state and forwards over a batch of their new
// tokens. One interface for a model in this process (LocalStepExecutor) and
// for a group of rank processes (worker/local_group.h), so the loop
// (generator.h) and the tests run unchanged on either.
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
#include "worker/model/kv_cache.h"
#include "worker/model/transformer.h"
#include "worker/model/vocab_sampler.h"

namespace exl3serve::worker {

// Thread safety: one caller at a time.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual int64_t vocab_size() const = 0;
  // AlreadyExists when seq_id is in use; Unavailable when the executor is
  // broken (a rank died).
  virtual absl::Status AddSequence(int64_t seq_id) = 0;
  // NotFound for an unknown seq_id.
  virtual absl::Status RemoveSequence(int64_t seq_id) = 0;
  // As Transformer::Forward, with the executor's own cache.
  virtual absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                               std::vector<float>* logits) = 0;

  // Appends `page_ids` to the sequence's KV page table on every rank (the
  // coordinator's block allocator placed it; PagedKvCache::AssignPages). For
  // an executor whose caches have KvCacheOptions::caller_assigns_pages this is
  // the only way a sequence gets pages: a Forward needing positions beyond its
  // assigned pages fails (FailedPrecondition). Executors over rank processes
  // send the pages with the sequence's next Forward, so their errors
  // (InvalidArgument / FailedPrecondition naming the page, as AssignPages)
  // come from that Forward; this process's cache answers at once.
  // Unimplemented when the executor allocates pages itself.
  virtual absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) {
    return absl::UnimplementedError("this executor allocates its own KV pages");
  }

  // Rank-side sampling (vocab_sampler.h). A sequence added this way carries
  // its sampling parameters for its whole life (set once, not per step) and
  // is fed through ForwardSampled: only token ids — and logprobs when asked —
  // come back from the ranks. AlreadyExists / InvalidArgument as
  // AddSequence / VocabSampler::AddSequence. Unimplemented where the executor
  // cannot sample.
  virtual absl::Status AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) {
    return absl::UnimplementedError("this executor does not sample on its ranks");
  }
  // One forward of `batch` (last-token rows); for every entry i with
  // sample[i] != 0, (*tokens)[i] is the token drawn for that sequence
  // (tokens is resized to batch.size(); other entries are left default).
  // Errors: Forward's; NotFound for a sampled entry not added with
  // AddSampledSequence; InvalidArgument when sample.size() != batch.size().
  virtual absl::Status ForwardSampled(std::span<const SequenceTokens> batch,
                                      std::span<const uint8_t> sample,
                                      std::vector<SampledToken>* tokens) {
    return absl::UnimplementedError("this executor does not sample on its ranks");
  }

  // Bytes of step results received from the ranks so far (what crossed
  // from rank 0 to the caller); 0 for a model in this process.
  virtual uint64_t result_bytes_received() const { return 0; }

  // The page layout of the executor's caches (every rank's), which the
  // coordinator's block allocator must equal; nullopt when unknown (fakes).
  virtual std::optional<KvCacheOptions> kv_options() const { return std::nullopt; }

  // Re-forms a broken executor by `deadline` — new rank processes, or ranks
  // that re-registered — after which it holds no sequences (callers replay
  // them). Unimplemented when the executor cannot (a model in this process
  // does not break that way); the error that prevented it otherwise.
  virtual absl::Status Recover(absl::Time deadline) {
    return absl::UnimplementedError("this executor cannot be re-formed");
  }
};

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
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) override {
    return cache_->AssignPages(seq_id, page_ids);
  }
  std::optional<KvCacheOptions> kv_options() const override { return cache_->options(); }
  PagedKvCache& cache() { return *cache_; }

 private:
  const Transformer* model_;
  std::optional<PagedKvCache> owned_;
  PagedKvCache* cache_;
  VocabSampler sampler_;
  std::vector<float> slice_;  // scratch of ForwardSampled
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_STEP_EXECUTOR_H_
