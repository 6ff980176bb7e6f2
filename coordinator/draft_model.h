// coordinator/draft_model.h — speculative decoding's second draft source: a
// smaller model with the same tokenizer (e.g. the target converted at 2 bpw)
// that proposes each sequence's next k tokens greedily, run through a
// StepExecutor of its own (`serve --speculative draft --draft-model DIR`).
//
//   DraftModel draft(std::move(executor));   // its cache takes its own pages
//   std::vector<std::vector<int32_t>> drafts;
//   EXL3_RETURN_IF_ERROR(draft.Propose(requests, &drafts));
//   draft.Forget(seq_id);                    // a sequence that is gone
//
// The draft cache follows each sequence lazily: Propose compares the tokens
// the draft cache holds for a sequence with the sequence's tokens now
// (prompt + output; the last one not yet consumed by the target), rolls the
// draft cache back to their common prefix (StepExecutor::TruncateSequence:
// rejected drafts, a replay that changed nothing but must not be trusted
// blindly), feeds the rest — at a sequence's first draft its whole prompt —
// and then draws k tokens greedily, one forward per draft position over
// every drafting sequence of the step. So verification outcomes, preemption
// and replays need no call: the next Propose sees the tokens. Only the
// target verifies: what the draft model computes never changes the output.
// A structured-output sequence passes its TokenMatcher: each draft token is
// then drawn among the tokens the constraint allows there (the draft
// model's argmax under the mask, so its drafts are never cut by the
// constraint), the matcher advanced tentatively and rolled back before
// Propose returns; drafting stops early where the constraint allows nothing
// (the output is complete and only EOS, which `never_draw` may exclude,
// could follow).
//
// The draft cache is not placed by the scheduler's block tables (its
// executor allocates its own pages, LocalExecutorOptions::
// executor_assigns_pages): no prefix sharing, and no page of the target's is
// ever touched. When its pool runs out (or the executor fails otherwise),
// Propose forgets every sequence (freeing the pool) and returns the error;
// the caller decodes without drafts that step and the caches refill later.
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_DRAFT_MODEL_H_
#define EXL3SERVE_COORDINATOR_DRAFT_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "worker/api/step_executor.h"

namespace exl3serve::coordinator::constrained {
class TokenMatcher;
}  // namespace exl3serve::coordinator::constrained

namespace exl3serve::coordinator {

struct DraftRequest {
  int64_t seq_id = 0;
  // The sequence's tokens: prompt + output, the last one not yet in the
  // target's cache. Not empty.
  std::span<const int32_t> tokens;
  int k = 0;  // draft tokens wanted (<= 0: none)
  // Structured output: the sequence's matcher at `tokens` (nullptr: none).
  // Left as it was on return.
  constrained::TokenMatcher* matcher = nullptr;
  // Ids never drafted under a matcher (the EOS ids of an ignore_eos request).
  std::span<const int32_t> never_draw;
};

struct DraftModelStats {
  uint64_t forwards = 0;        // draft executor forwards run
  uint64_t catch_up_tokens = 0;  // tokens fed to catch up (prompts, accepted runs)
  uint64_t rolled_back = 0;     // positions truncated (rejected drafts)
};

class DraftModel {
 public:
  // `executor` runs the draft model; its sequences are this object's.
  explicit DraftModel(std::unique_ptr<worker::StepExecutor> executor);

  // (*drafts)[i] = requests[i].k greedy tokens of the draft model after
  // requests[i].tokens (empty for k <= 0). Errors: the executor's (then
  // every sequence is forgotten, drafts is empty); InvalidArgument for an
  // empty token list or a sequence twice.
  absl::Status Propose(std::span<const DraftRequest> requests,
                       std::vector<std::vector<int32_t>>* drafts);
  // Frees the draft cache of a sequence (no-op for an unknown one).
  void Forget(int64_t seq_id);
  // Frees every sequence (the target's group re-formed, shutdown).
  void ForgetAll();

  int64_t vocab_size() const { return executor_->vocab_size(); }
  const DraftModelStats& stats() const { return stats_; }
  // Tokens the draft cache holds for the sequence (tests).
  std::span<const int32_t> cached(int64_t seq_id) const;

 private:
  std::unique_ptr<worker::StepExecutor> executor_;
  absl::flat_hash_map<int64_t, std::vector<int32_t>> fed_;  // tokens in the draft cache
  DraftModelStats stats_;
  // Propose's mask scratch (a constrained draft position's allowed tokens).
  std::vector<std::vector<uint32_t>> mask_rows_;
  std::vector<uint32_t> full_mask_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_DRAFT_MODEL_H_
