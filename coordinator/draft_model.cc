#include "coordinator/draft_model.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "coordinator/constrained/constraint.h"

namespace exl3serve::coordinator {

DraftModel::DraftModel(std::unique_ptr<worker::StepExecutor> executor)
    : executor_(std::move(executor)) {}

std::span<const int32_t> DraftModel::cached(int64_t seq_id) const {
  auto it = fed_.find(seq_id);
  return it == fed_.end() ? std::span<const int32_t>() : std::span<const int32_t>(it->second);
}

void DraftModel::Forget(int64_t seq_id) {
  if (fed_.erase(seq_id) > 0) executor_->RemoveSequence(seq_id).IgnoreError();
}

void DraftModel::ForgetAll() {
  for (const auto& [seq_id, tokens] : fed_) executor_->RemoveSequence(seq_id).IgnoreError();
  fed_.clear();
}

absl::Status DraftModel::Propose(std::span<const DraftRequest> requests,
                                 std::vector<std::vector<int32_t>>* drafts) {
  drafts->assign(requests.size(), {});
  absl::flat_hash_set<int64_t> seen;
  for (const DraftRequest& r : requests) {
    if (r.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("draft: sequence ", r.seq_id, " has no tokens"));
    }
    if (!seen.insert(r.seq_id).second) {
      return absl::InvalidArgumentError(absl::StrCat("draft: sequence ", r.seq_id, " twice"));
    }
  }
  // On any executor error: forget everything (frees the draft pool).
  auto fail = [&](absl::Status s) {
    ForgetAll();
    drafts->clear();
    return s;
  };
  // 1. Bring each drafting sequence's cache to its tokens but the last one
  // held back, so the first forward has at least one token with logits.
  std::vector<size_t> active;
  std::vector<std::vector<int32_t>> feed(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const DraftRequest& r = requests[i];
    if (r.k <= 0) continue;
    auto it = fed_.find(r.seq_id);
    if (it == fed_.end()) {
      worker::SequenceSampling greedy;
      greedy.params.temperature = 0.0f;
      greedy.params.seed = 0;
      greedy.prompt_len = static_cast<int64_t>(r.tokens.size());
      if (absl::Status s = executor_->AddSampledSequence(r.seq_id, greedy); !s.ok()) return fail(s);
      it = fed_.emplace(r.seq_id, std::vector<int32_t>()).first;
    }
    std::vector<int32_t>& fed = it->second;
    const size_t limit = std::min(fed.size(), r.tokens.size() - 1);
    size_t common = 0;
    while (common < limit && fed[common] == r.tokens[common]) ++common;
    if (common < fed.size()) {
      const std::span<const int32_t> dropped = std::span<const int32_t>(fed).subspan(common);
      if (absl::Status s = executor_->TruncateSequence(r.seq_id, dropped); !s.ok()) return fail(s);
      stats_.rolled_back += dropped.size();
      fed.resize(common);
    }
    feed[i].assign(r.tokens.begin() + static_cast<std::ptrdiff_t>(common), r.tokens.end());
    stats_.catch_up_tokens += feed[i].size() - 1;
    active.push_back(i);
  }
  // 2. One forward per draft position over every sequence still drafting
  // (a constrained one under its matcher's mask, the matcher advanced by
  // each draft and rolled back at the end).
  const size_t words = static_cast<size_t>((executor_->vocab_size() + 31) / 32);
  std::vector<int> advanced(requests.size(), 0);  // tokens fed to each matcher
  // Mask scratch reused across calls (rows keep their capacity).
  std::vector<std::vector<uint32_t>>& masks = mask_rows_;
  if (masks.size() < requests.size()) masks.resize(requests.size());
  // The next draft's mask of a constrained sequence; false: nothing allowed.
  auto fill_mask = [&](size_t i) {
    constrained::TokenMatcher& matcher = *requests[i].matcher;
    std::vector<uint32_t>& full = full_mask_;
    full.assign(static_cast<size_t>(matcher.mask_words()), 0);
    matcher.FillNextTokenMask(full);
    for (int32_t id : requests[i].never_draw) {
      if (id >= 0 && static_cast<size_t>(id) / 32 < full.size()) full[id / 32] &= ~(1u << (id % 32));
    }
    std::vector<uint32_t>& mask = masks[i];
    mask.assign(words, 0);
    std::copy_n(full.begin(), std::min(words, full.size()), mask.begin());
    const int64_t tail = executor_->vocab_size() % 32;  // bits past the draft vocabulary
    if (tail != 0) mask.back() &= (1u << tail) - 1;
    return std::any_of(mask.begin(), mask.end(), [](uint32_t w) { return w != 0; });
  };
  auto rollback = [&] {
    for (size_t i = 0; i < requests.size(); ++i) {
      if (advanced[i] > 0) requests[i].matcher->Rollback(advanced[i]).IgnoreError();
    }
  };
  auto fail_constrained = [&](absl::Status s) {
    rollback();
    return fail(std::move(s));
  };
  std::vector<worker::SequenceTokens> batch;
  std::vector<uint8_t> sample;
  std::vector<worker::SampledToken> tokens;
  for (int round = 0; !active.empty(); ++round) {
    // A constrained sequence the constraint lets write nothing more stops
    // drafting (its cache catches up at its next Propose).
    std::erase_if(active, [&](size_t i) { return requests[i].matcher != nullptr && !fill_mask(i); });
    if (active.empty()) break;
    batch.clear();
    for (size_t i : active) {
      batch.push_back({requests[i].seq_id, feed[i]});
      if (requests[i].matcher != nullptr) batch.back().allowed_tokens = masks[i];
    }
    sample.assign(batch.size(), 1);
    if (absl::Status s = executor_->ForwardSampled(batch, sample, &tokens); !s.ok()) {
      return fail_constrained(s);
    }
    ++stats_.forwards;
    std::vector<size_t> next;
    for (size_t j = 0; j < active.size(); ++j) {
      const size_t i = active[j];
      const int32_t token = tokens[j].id;
      if (token < 0 || token >= executor_->vocab_size()) {
        return fail_constrained(absl::InternalError(
            absl::StrCat("draft model sampled token ", token, " outside its vocabulary")));
      }
      std::vector<int32_t>& fed = fed_.at(requests[i].seq_id);
      fed.insert(fed.end(), feed[i].begin(), feed[i].end());
      (*drafts)[i].push_back(token);
      bool more = static_cast<int>((*drafts)[i].size()) < requests[i].k;
      if (requests[i].matcher != nullptr) {
        if (requests[i].matcher->AcceptToken(token).ok()) {
          ++advanced[i];
        } else {
          // The mask allowed it, so the matcher must: stop drafting here
          // (the engine's check of the draft cuts it).
          more = false;
        }
      }
      if (more) {
        feed[i].assign(1, token);
        next.push_back(i);
      }
    }
    active = std::move(next);
  }
  rollback();
  return absl::OkStatus();
}

}  // namespace exl3serve::coordinator
