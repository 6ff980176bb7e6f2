#include "worker/api/verified_forward.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace exl3serve::worker {

absl::Status CheckDraftCounts(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                              std::span<const int32_t> draft_counts) {
  if (sample.size() != batch.size() || draft_counts.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "verified forward: ", sample.size(), " sample flags and ", draft_counts.size(),
        " draft counts for ", batch.size(), " batch entries"));
  }
  if (batch.empty()) return absl::InvalidArgumentError("verified forward: empty batch");
  for (size_t i = 0; i < batch.size(); ++i) {
    const int32_t d = draft_counts[i];
    const size_t n = batch[i].tokens.size();
    if (d == 0) continue;
    if (d < 0 || sample[i] == 0 || static_cast<size_t>(d) >= n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "verified forward: entry ", i, " (sequence ", batch[i].seq_id, ") has ", d,
          " draft tokens of ", n,
          sample[i] == 0 ? " and is not sampled (only a sampled entry may draft)"
                         : " (a draft count must be >= 0 and < the entry's tokens)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckVerifiedRuns(std::span<const SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts, int64_t vocab_size,
                               const std::vector<std::vector<SampledToken>>& runs) {
  if (runs.size() != batch.size()) {
    return absl::DataLossError(absl::StrCat("rank 0 returned ", runs.size(),
                                            " verified runs for a batch of ", batch.size()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const std::vector<SampledToken>& run = runs[i];
    const std::string where = absl::StrCat("rank 0's verified run for entry ", i, " (sequence ",
                                           batch[i].seq_id, ")");
    if (sample[i] == 0) {
      if (!run.empty()) {
        return absl::DataLossError(
            absl::StrCat(where, " has ", run.size(), " tokens; the entry is not sampled"));
      }
      continue;
    }
    const int32_t d = draft_counts[i];
    if (run.empty() || run.size() > static_cast<size_t>(d) + 1) {
      return absl::DataLossError(absl::StrCat(where, " has ", run.size(), " tokens; ", d,
                                              " drafts allow 1 to ", d + 1));
    }
    const size_t first_draft = batch[i].tokens.size() - static_cast<size_t>(d);
    for (size_t j = 0; j + 1 < run.size(); ++j) {
      const int32_t draft = batch[i].tokens[first_draft + j];
      if (run[j].id != draft) {
        return absl::DataLossError(absl::StrCat(where, " accepts token ", run[j].id,
                                                " at draft position ", j, " where the draft is ",
                                                draft));
      }
    }
    const int32_t last = run.back().id;
    if (vocab_size > 0 && (last < 0 || last >= vocab_size)) {
      return absl::DataLossError(absl::StrCat(where, " ends with token ", last,
                                              " outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAllowedTokens(std::span<const SequenceTokens> batch,
                                std::span<const uint8_t> sample,
                                std::span<const int32_t> draft_counts, int64_t vocab_size) {
  const int64_t words = AllowedTokenWords(vocab_size);
  for (size_t i = 0; i < batch.size(); ++i) {
    const size_t have = batch[i].allowed_tokens.size();
    if (have == 0) continue;
    const int64_t draws =
        sample[i] == 0 ? 0 : 1 + (draft_counts.empty() ? 0 : std::max(0, draft_counts[i]));
    if (draws == 0 || have != static_cast<size_t>(draws * words)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entry ", i, " (sequence ", batch[i].seq_id, ") has ", have,
          " allowed-token mask words; ", draws, " draws of a ", vocab_size,
          "-token vocabulary take ", draws * words, " (or none)"));
    }
    // Every row allows a token of the vocabulary (bits past it do not count).
    const std::span<const uint32_t> all = batch[i].allowed_tokens;
    const uint32_t tail = vocab_size % 32 == 0 ? ~0u : (1u << (vocab_size % 32)) - 1u;
    for (int64_t r = 0; r < draws; ++r) {
      bool any = false;
      for (int64_t w = 0; w < words && !any; ++w) {
        const uint32_t bits = all[static_cast<size_t>(r * words + w)];
        any = (w + 1 < words ? bits : bits & tail) != 0;
      }
      if (!any) {
        return absl::InvalidArgumentError(absl::StrCat("entry ", i, " (sequence ", batch[i].seq_id,
                                                       ") has an allowed-token mask row ", r,
                                                       " that allows no token"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
