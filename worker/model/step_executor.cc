#include "worker/model/step_executor.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::worker {

VocabSampler MakeVocabSampler(const Transformer& model) {
  const auto [begin, end] = model.vocab_slice();
  return VocabSampler(begin, end, model.vocab_size(), model.communicator(),
                      model.collective_timeout());
}

absl::Status RunSampledForward(const Transformer& model, PagedKvCache* cache,
                               VocabSampler* sampler, std::span<const SequenceTokens> batch,
                               std::span<const uint8_t> sample, std::vector<float>* slice,
                               std::vector<SampledToken>* tokens) {
  if (sample.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat("sampled forward: ", sample.size(),
                                                   " sample flags for ", batch.size(),
                                                   " batch entries"));
  }
  std::vector<SampleRow> rows;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (sample[i] == 0) continue;
    if (!sampler->HasSequence(batch[i].seq_id)) {
      return absl::NotFoundError(absl::StrCat("sampled forward: sequence ", batch[i].seq_id,
                                              " was not added with sampling parameters"));
    }
    rows.push_back({batch[i].seq_id, static_cast<int64_t>(i)});
  }
  EXL3_RETURN_IF_ERROR(model.ForwardVocabSlice(batch, LogitsRows::kLastToken, cache, slice));
  for (const SequenceTokens& entry : batch) sampler->Observe(entry.seq_id, entry.tokens);
  std::vector<SampledToken> drawn;
  absl::Status status = sampler->Sample(rows, slice->data(), &drawn);
  if (!status.ok()) {
    if (model.communicator() != nullptr) model.communicator()->Abort(status);
    return status;
  }
  tokens->assign(batch.size(), SampledToken{});
  for (size_t j = 0; j < rows.size(); ++j) (*tokens)[rows[j].logits_row] = std::move(drawn[j]);
  return absl::OkStatus();
}

absl::Status LocalStepExecutor::AddSampledSequence(int64_t seq_id,
                                                   const SequenceSampling& sampling) {
  if (sampler_.HasSequence(seq_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq_id, " already exists"));
  }
  EXL3_RETURN_IF_ERROR(
      cache_->AddSequence(seq_id, static_cast<int64_t>(sampling.cached_prefix.size())));
  if (absl::Status s = sampler_.AddSequence(seq_id, sampling); !s.ok()) {
    (void)cache_->RemoveSequence(seq_id);
    return s;
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
