#include "worker/model/step_executor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/api/verified_forward.h"

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
    rows.push_back({batch[i].seq_id, static_cast<int64_t>(i),
                    batch[i].allowed_tokens.empty() ? nullptr : batch[i].allowed_tokens.data()});
  }
  EXL3_RETURN_IF_ERROR(CheckAllowedTokens(batch, sample, {}, model.vocab_size()));
  const std::vector<SequenceTokens> entries = sampler->WithPromptLengths(batch);
  EXL3_RETURN_IF_ERROR(model.ForwardVocabSlice(entries, LogitsRows::kLastToken, cache, slice));
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

absl::Status RunVerifiedForward(const Transformer& model, PagedKvCache* cache,
                                VocabSampler* sampler, std::span<const SequenceTokens> batch,
                                std::span<const uint8_t> sample,
                                std::span<const int32_t> draft_counts, std::vector<float>* slice,
                                std::vector<std::vector<SampledToken>>* runs) {
  if (sample.size() != batch.size() || draft_counts.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "verified forward: ", sample.size(), " sample flags and ", draft_counts.size(),
        " draft counts for ", batch.size(), " batch entries"));
  }
  // Row of entry i's first logits row; the rounds.
  std::vector<int64_t> first_row(batch.size());
  std::vector<int32_t> last_rows(batch.size(), 0);
  int64_t rows_total = 0;
  int32_t max_draft = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
    const int32_t d = draft_counts[i];
    if (d < 0 || (d > 0 && (sample[i] == 0 || d >= n))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "verified forward: entry ", i, " (sequence ", batch[i].seq_id, ") has ", d,
          " draft tokens of ", n, sample[i] == 0 ? " and is not sampled" : ""));
    }
    if (sample[i] != 0 && !sampler->HasSequence(batch[i].seq_id)) {
      return absl::NotFoundError(absl::StrCat("verified forward: sequence ", batch[i].seq_id,
                                              " was not added with sampling parameters"));
    }
    // Logits rows: the last accepted token and the drafts of each sampled
    // entry (row r of it predicts the position after draft r - 1); none
    // for an entry that is not sampled (a prefill chunk).
    last_rows[i] = sample[i] != 0 ? d + 1 : 0;
    first_row[i] = rows_total;
    rows_total += last_rows[i];
    max_draft = std::max(max_draft, d);
  }
  EXL3_RETURN_IF_ERROR(CheckAllowedTokens(batch, sample, draft_counts, model.vocab_size()));
  const int64_t mask_words = AllowedTokenWords(model.vocab_size());
  // A recurrent state cannot be shortened: keep the state after each token
  // of a drafting entry, so a rejection rolls back by a copy.
  std::vector<int64_t> kept;
  if (cache->has_state()) {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (draft_counts[i] == 0) continue;
      EXL3_RETURN_IF_ERROR(cache->KeepStateHistory(batch[i].seq_id,
                                                   static_cast<int64_t>(batch[i].tokens.size())));
      kept.push_back(batch[i].seq_id);
    }
  }
  struct DropHistory {
    PagedKvCache* cache;
    const std::vector<int64_t>& seqs;
    ~DropHistory() {
      for (int64_t s : seqs) cache->DropStateHistory(s);
    }
  } drop_history{cache, kept};
  const std::vector<SequenceTokens> entries = sampler->WithPromptLengths(batch);
  EXL3_RETURN_IF_ERROR(model.ForwardVocabSliceLastRows(entries, last_rows, cache, slice));
  for (size_t i = 0; i < batch.size(); ++i) {
    sampler->Observe(batch[i].seq_id, batch[i].tokens.first(batch[i].tokens.size() - draft_counts[i]));
  }
  runs->assign(batch.size(), {});
  std::vector<uint8_t> live(batch.size(), 0);
  for (size_t i = 0; i < batch.size(); ++i) live[i] = sample[i];
  for (int32_t round = 0; round <= max_draft; ++round) {
    std::vector<SampleRow> rows;
    std::vector<size_t> entries;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (live[i] == 0) continue;
      const std::span<const uint32_t> allowed = batch[i].allowed_tokens;
      rows.push_back({batch[i].seq_id, first_row[i] + round,
                      allowed.empty() ? nullptr : allowed.data() + round * mask_words});
      entries.push_back(i);
    }
    if (rows.empty()) break;
    std::vector<SampledToken> drawn;
    if (absl::Status status = sampler->Sample(rows, slice->data(), &drawn); !status.ok()) {
      if (model.communicator() != nullptr) model.communicator()->Abort(status);
      return status;
    }
    for (size_t j = 0; j < entries.size(); ++j) {
      const size_t i = entries[j];
      const int32_t d = draft_counts[i];
      const int32_t token = drawn[j].id;
      (*runs)[i].push_back(std::move(drawn[j]));
      const int64_t draft_at = static_cast<int64_t>(batch[i].tokens.size()) - d + round;
      if (round < d && batch[i].tokens[static_cast<size_t>(draft_at)] == token) {
        sampler->Observe(batch[i].seq_id, batch[i].tokens.subspan(static_cast<size_t>(draft_at), 1));
      } else {
        live[i] = 0;
        // Drop the KV of the draft positions after the last accepted one.
        const int64_t rejected = d - round;
        if (rejected > 0) {
          const int64_t length = cache->Length(batch[i].seq_id) - rejected;
          if (cache->has_state()) {
            EXL3_RETURN_IF_ERROR(cache->RollbackWithState(batch[i].seq_id, length));
          } else {
            cache->SetLength(batch[i].seq_id, length);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LocalStepExecutor::TruncateSequence(int64_t seq_id,
                                                 std::span<const int32_t> dropped) {
  if (!cache_->HasSequence(seq_id)) {
    return absl::NotFoundError(absl::StrCat("truncate: unknown sequence ", seq_id));
  }
  const int64_t length = cache_->Length(seq_id);
  const int64_t n = static_cast<int64_t>(dropped.size());
  if (n > length) {
    return absl::InvalidArgumentError(absl::StrCat("truncate: sequence ", seq_id, " holds ",
                                                   length, " positions, not ", n));
  }
  if (n > 0 && cache_->has_state()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "truncate: sequence ", seq_id, ": this model keeps a recurrent state per sequence, "
        "which cannot be rolled back"));
  }
  cache_->SetLength(seq_id, length - n);
  sampler_.Unobserve(seq_id, dropped);
  return absl::OkStatus();
}

absl::Status SaveStateSnapshots(PagedKvCache* cache, std::span<const StateSnapshotSave> saves) {
  for (const StateSnapshotSave& save : saves) {
    EXL3_RETURN_IF_ERROR(cache->SaveStateSnapshot(save.seq_id, save.snapshot));
  }
  return absl::OkStatus();
}

absl::Status LocalStepExecutor::AddSampledSequence(int64_t seq_id,
                                                   const SequenceSampling& sampling) {
  if (sampler_.HasSequence(seq_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq_id, " already exists"));
  }
  EXL3_RETURN_IF_ERROR(cache_->AddSequence(
      seq_id, static_cast<int64_t>(sampling.cached_prefix.size()), CachedStateOf(sampling)));
  if (absl::Status s = sampler_.AddSequence(seq_id, sampling); !s.ok()) {
    (void)cache_->RemoveSequence(seq_id);
    return s;
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
