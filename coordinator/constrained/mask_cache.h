// coordinator/constrained/mask_cache.h — the adaptive token mask cache: per
// terminal position p of a grammar, the tokens decided by p alone, computed
// once per (grammar, vocabulary) by walking the vocabulary trie from a stack
// holding p over an unknown rest ("escape"):
//   accepted   the token's bytes are consumed before p's rule instance
//              returns (or exactly when it does): allowed whatever is below;
//   uncertain  every path returns (escapes) with bytes left: kept as the
//              remaining suffixes in a trie, checked at run time from the
//              real stack below;
//   rejected   the rest.
// At run time a state's mask is the union over its stacks of accepted(p) and
// the suffix walk; EOS is added when a stack is complete. Inside a JSON
// string almost every token is accepted by the cache and only tokens that
// close the string (`",`, `"}`, ...) are walked. Internal.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_MASK_CACHE_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_MASK_CACHE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "coordinator/constrained/pda.h"
#include "coordinator/constrained/token_trie.h"
#include "coordinator/constrained/vocabulary.h"

namespace exl3serve::coordinator::constrained {

struct PositionMask {
  // Accepted tokens: a full bitmask when many, else a sorted id list.
  std::vector<uint32_t> accepted_words;
  std::vector<int32_t> accepted_ids;
  // Context-dependent tokens by the bytes left when their frame returns.
  TokenTrie uncertain;
};

struct MaskCacheStats {
  size_t positions = 0;
  size_t accepted_bitmasks = 0;
  size_t uncertain_entries = 0;
  size_t memory_bytes = 0;
};

// Thread safety: thread-safe (entries past the eager budget are computed on
// first use, once, under std::call_once). Ownership: borrows `pda` and
// `vocab`, which must outlive it.
class MaskCache {
 public:
  // Computes entries in grammar order until `eager_budget_ms` of CPU time is
  // spent (one pruned trie walk per terminal position; the walk inside a
  // string visits most of the trie: ~20 ms at 152k tokens); the rest are
  // computed by at() on first use.
  MaskCache(const Pda& pda, const ByteVocabulary& vocab, double eager_budget_ms = kDefaultEagerBudgetMs);
  ~MaskCache();

  static constexpr double kDefaultEagerBudgetMs = 1500;

  // Requires: `pos` is a terminal position. May block for one walk.
  const PositionMask& at(uint32_t pos) const;
  // Counters over the entries computed so far (approximate while other
  // threads fill entries).
  MaskCacheStats stats() const;
  size_t num_computed() const;

 private:
  void Compute(size_t entry) const;

  const Pda& pda_;
  const ByteVocabulary& vocab_;
  std::vector<int32_t> index_;  // position -> entry
  std::vector<uint32_t> positions_;  // entry -> position
  mutable std::vector<PositionMask> masks_;
  std::unique_ptr<std::once_flag[]> once_;
  mutable std::unique_ptr<std::atomic<bool>[]> done_;
};

// Reusable buffers of a trie walk (one per thread).
struct TrieWalkScratch {
  std::vector<std::vector<Stack>> level;
  std::vector<size_t> mark;
};

// Walks `trie` from `state` and sets the mask bit of every token whose bytes
// the state accepts (the automaton is alive after them). `arena` is scratch
// (rewound before return).
void MarkAcceptedTokens(const Pda& pda, const TokenTrie& trie, std::span<const Stack> state,
                        NodeArena& arena, TrieWalkScratch& scratch, std::span<uint32_t> mask);

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_MASK_CACHE_H_
