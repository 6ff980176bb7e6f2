// coordinator/ngram_drafter.h — draft tokens by prompt lookup (n-gram
// matching over a sequence's own tokens), the draft source of speculative
// decoding that needs no second model.
//
//   NgramDrafter drafter({.min_match = 2, .max_match = 8});
//   drafter.Append(prompt_ids);
//   std::vector<int32_t> draft = drafter.Propose(4);   // up to 4 tokens, maybe none
//   ... the ranks verify; the accepted tokens and the one sampled after them:
//   drafter.Append(accepted);
//
// The rule (ExLlamaV3's n-gram drafter and vLLM's prompt lookup do the same
// in spirit): take the longest suffix of the sequence, of n tokens with
// min_match <= n <= max_match, that also occurs earlier in the sequence; the
// draft is the tokens that followed its most recent earlier occurrence, at
// most max_tokens of them and never past the sequence's end. No such suffix:
// no draft. Repetitive text (code, quoted or copied spans, lists) is where
// the drafts are accepted; the verifier decides, so a bad draft costs only
// the rejected positions of one forward.
//
// Cost: Append indexes each new token under every match length (hash maps,
// O(max_match) per token, max_match - min_match + 1 entries per token);
// Propose is O(max_match^2 + max_tokens). ProposeReference is the plain
// O(length * max_match^2) scan the tests hold the index to.
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_NGRAM_DRAFTER_H_
#define EXL3SERVE_COORDINATOR_NGRAM_DRAFTER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace exl3serve::coordinator {

struct NgramDrafterOptions {
  int min_match = 2;  // >= 1
  int max_match = 8;  // >= min_match
};

class NgramDrafter {
 public:
  // Requires: 1 <= min_match <= max_match (CHECKed).
  explicit NgramDrafter(const NgramDrafterOptions& options);

  const NgramDrafterOptions& options() const { return options_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  std::span<const int32_t> tokens() const { return tokens_; }

  // The sequence grows by `tokens` (prompt, then each step's output).
  void Append(std::span<const int32_t> tokens);
  // Drops the sequence's tokens from `length` on (a replay that restarts
  // from fewer tokens; a request whose output was cut). Requires:
  // 0 <= length <= size().
  void Truncate(int64_t length);

  // Up to max_tokens draft tokens (empty when nothing matches or
  // max_tokens <= 0).
  std::vector<int32_t> Propose(int max_tokens) const;

  // The same rule by a direct scan, for tests.
  static std::vector<int32_t> ProposeReference(std::span<const int32_t> tokens,
                                               const NgramDrafterOptions& options, int max_tokens);

 private:
  // Hash of tokens_[end - n + 1 .. end].
  uint64_t HashEndingAt(int64_t end, int n) const;
  void IndexThrough(int64_t end);  // n-grams ending at positions < end

  NgramDrafterOptions options_;
  std::vector<int32_t> tokens_;
  // last_end_[n - min_match]: n-gram hash -> the last position it ends at,
  // for n-grams ending at positions [0, indexed_).
  std::vector<absl::flat_hash_map<uint64_t, int64_t>> last_end_;
  int64_t indexed_ = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_NGRAM_DRAFTER_H_
