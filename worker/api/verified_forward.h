// worker/api/verified_forward.h — the checks every carrier of
// StepExecutor::ForwardVerified (speculative verification) makes: the
// caller's draft counts before anything is sent (so a refused request
// consumes no staged KV pages and reaches no rank), and rank 0's runs when
// they come back (a run no verification can produce is a broken rank, not
// tokens to stream). Shared by LocalGroup (control wire), RemoteRankGroup
// (rank protocol) and the rank side (step_command.cc, rank_executor.cc).
//
//   EXL3_RETURN_IF_ERROR(CheckDraftCounts(batch, sample, draft_counts));
//   ... send, receive `runs` ...
//   if (absl::Status s = CheckVerifiedRuns(batch, sample, draft_counts, vocab, runs); !s.ok()) ...
#ifndef EXL3SERVE_WORKER_API_VERIFIED_FORWARD_H_
#define EXL3SERVE_WORKER_API_VERIFIED_FORWARD_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "worker/api/sampling.h"
#include "worker/api/step_executor.h"

namespace exl3serve::worker {

// OK when `sample` and `draft_counts` hold one value per batch entry and every
// draft count d is 0, or 0 < d < tokens of an entry with sample != 0 (the
// token before the drafts is the last accepted one). InvalidArgument for an
// empty batch (as a forward), or naming the entry, its sequence and the
// values. Cheap.
absl::Status CheckDraftCounts(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                              std::span<const int32_t> draft_counts);

// OK when `runs` (what rank 0 answered for a request that passed
// CheckDraftCounts) is a possible verification result: one run per entry;
// an unsampled entry's run is empty; a sampled entry with d drafts has 1 to
// d + 1 tokens, of which all but the last are its draft tokens in order
// (accepted drafts), and the last an id in [0, vocab_size) (not checked
// when vocab_size <= 0). DataLoss naming the entry otherwise.
absl::Status CheckVerifiedRuns(std::span<const SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts, int64_t vocab_size,
                               const std::vector<std::vector<SampledToken>>& runs);

// OK when every entry's allowed_tokens (SequenceTokens) is empty or holds
// exactly one mask row of ceil(vocab_size / 32) words per draw: 1 for a
// sampled entry, 1 + draft_counts[i] when draft_counts is not empty (a
// verified forward), and none on an unsampled entry, and every row allows
// at least one token of the vocabulary. InvalidArgument naming the entry,
// its sequence and the sizes (or the empty row) otherwise. Requires sample (and
// draft_counts, when not empty) to hold one value per entry.
absl::Status CheckAllowedTokens(std::span<const SequenceTokens> batch,
                                std::span<const uint8_t> sample,
                                std::span<const int32_t> draft_counts, int64_t vocab_size);

// Words of one mask row for a vocabulary of `vocab_size`.
inline int64_t AllowedTokenWords(int64_t vocab_size) { return (vocab_size + 31) / 32; }

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_API_VERIFIED_FORWARD_H_
