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

#include <cstdint>
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

class MaskCache {
 public:
  // Cost: one pruned trie walk per terminal position (the walk inside a
  // string visits most of the trie).
  MaskCache(const Pda& pda, const ByteVocabulary& vocab);

  const PositionMask& at(uint32_t pos) const { return masks_[index_[pos]]; }
  const MaskCacheStats& stats() const { return stats_; }

 private:
  std::vector<int32_t> index_;  // position -> masks_ index
  std::vector<PositionMask> masks_;
  MaskCacheStats stats_;
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
