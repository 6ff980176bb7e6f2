// coordinator/constrained/mask_cache.cc — see mask_cache.h.
#include "coordinator/constrained/mask_cache.h"

#include <algorithm>

namespace exl3serve::coordinator::constrained {
namespace {

inline void SetBit(std::span<uint32_t> mask, int32_t id) { mask[id >> 5] |= uint32_t{1} << (id & 31); }

}  // namespace

void MarkAcceptedTokens(const Pda& pda, const TokenTrie& trie, std::span<const Stack> state,
                        NodeArena& arena, TrieWalkScratch& scratch, std::span<uint32_t> mask) {
  if (trie.empty() || state.empty()) return;
  const size_t mark0 = arena.mark();
  auto& level = scratch.level;
  auto& mark = scratch.mark;
  if (level.size() < trie.max_depth() + 1) level.resize(trie.max_depth() + 1);
  mark.assign(trie.max_depth() + 1, mark0);
  level[0].assign(state.begin(), state.end());
  for (uint32_t i = 1; i < trie.size();) {
    const uint32_t d = trie.depth(i);
    arena.Rewind(mark[d - 1]);
    pda.Advance(level[d - 1], trie.byte(i), arena, level[d]);
    mark[d] = arena.mark();
    if (level[d].empty()) {
      i = trie.end(i);
      continue;
    }
    for (int32_t id : trie.tokens(i)) SetBit(mask, id);
    ++i;
  }
  arena.Rewind(mark0);
}

MaskCache::MaskCache(const Pda& pda, const ByteVocabulary& vocabulary) {
  const TokenTrie& vocab = vocabulary.trie();
  const int64_t mask_words = vocabulary.mask_words();
  const FlatGrammar& g = pda.grammar();
  index_.assign(g.size(), -1);
  masks_.reserve(g.terminal_positions().size());
  const StackNode escape{kAcceptPos, nullptr};  // a stand-in: never dereferenced
  NodeArena arena(/*intern=*/false);
  std::vector<std::vector<Stack>> level(vocab.max_depth() + 1);
  std::vector<size_t> mark(vocab.max_depth() + 1, 0);
  std::vector<uint32_t> accepted(static_cast<size_t>(mask_words));
  struct EscapeRange {
    uint32_t first, last, offset;
  };
  std::vector<EscapeRange> escapes;
  for (uint32_t pos : g.terminal_positions()) {
    index_[pos] = static_cast<int32_t>(masks_.size());
    PositionMask& pm = masks_.emplace_back();
    std::fill(accepted.begin(), accepted.end(), 0);
    escapes.clear();
    arena.Rewind(0);
    level[0] = {Stack{pos, &escape}};
    for (uint32_t i = 1; i < vocab.size();) {
      const uint32_t d = vocab.depth(i);
      arena.Rewind(mark[d - 1]);
      bool escaped = false;
      pda.Advance(level[d - 1], vocab.byte(i), arena, level[d], &escape, &escaped);
      mark[d] = arena.mark();
      if (escaped || !level[d].empty()) {
        for (int32_t id : vocab.tokens(i)) SetBit(accepted, id);
      }
      if (escaped && vocab.end(i) > i + 1) escapes.push_back({i + 1, vocab.end(i), d});
      i = level[d].empty() ? vocab.end(i) : i + 1;
    }
    // Uncertain: escaped with bytes left and never accepted.
    std::vector<std::pair<int32_t, uint32_t>> uncertain;  // (token, offset)
    for (const EscapeRange& r : escapes) {
      for (int32_t id : vocab.tokens_in(r.first, r.last)) {
        if (!((accepted[id >> 5] >> (id & 31)) & 1)) uncertain.push_back({id, r.offset});
      }
    }
    size_t count = 0;
    for (uint32_t w : accepted) count += static_cast<size_t>(__builtin_popcount(w));
    if (count >= static_cast<size_t>(mask_words)) {
      pm.accepted_words = accepted;
      ++stats_.accepted_bitmasks;
    } else {
      pm.accepted_ids.reserve(count);
      for (size_t w = 0; w < accepted.size(); ++w) {
        for (uint32_t bits = accepted[w]; bits != 0; bits &= bits - 1) {
          pm.accepted_ids.push_back(static_cast<int32_t>(w * 32 + __builtin_ctz(bits)));
        }
      }
    }
    if (!uncertain.empty()) {
      std::vector<std::pair<std::string_view, int32_t>> entries;
      entries.reserve(uncertain.size());
      for (const auto& [id, offset] : uncertain) {
        entries.push_back({vocabulary.token_bytes(id)->substr(offset), id});
      }
      stats_.uncertain_entries += entries.size();
      pm.uncertain = TokenTrie::Build(std::move(entries));
    }
    stats_.memory_bytes += pm.accepted_words.size() * 4 + pm.accepted_ids.size() * 4 + pm.uncertain.memory_bytes();
  }
  stats_.positions = masks_.size();
}

}  // namespace exl3serve::coordinator::constrained
