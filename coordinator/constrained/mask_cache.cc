// coordinator/constrained/mask_cache.cc — see mask_cache.h.
#include "coordinator/constrained/mask_cache.h"

#include <algorithm>
#include <chrono>

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

MaskCache::MaskCache(const Pda& pda, const ByteVocabulary& vocab, double eager_budget_ms)
    : pda_(pda), vocab_(vocab) {
  const FlatGrammar& g = pda.grammar();
  index_.assign(g.size(), -1);
  positions_ = g.terminal_positions();
  for (size_t e = 0; e < positions_.size(); ++e) index_[positions_[e]] = static_cast<int32_t>(e);
  masks_.resize(positions_.size());
  once_ = std::make_unique<std::once_flag[]>(positions_.size());
  done_ = std::make_unique<std::atomic<bool>[]>(positions_.size());
  for (size_t e = 0; e < positions_.size(); ++e) done_[e].store(false, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  for (size_t e = 0; e < positions_.size(); ++e) {
    if (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() >
        eager_budget_ms) {
      break;
    }
    std::call_once(once_[e], [&] { Compute(e); });
  }
}

MaskCache::~MaskCache() = default;

const PositionMask& MaskCache::at(uint32_t pos) const {
  const size_t e = static_cast<size_t>(index_[pos]);
  if (!done_[e].load(std::memory_order_acquire)) std::call_once(once_[e], [&] { Compute(e); });
  return masks_[e];
}

size_t MaskCache::num_computed() const {
  size_t n = 0;
  for (size_t e = 0; e < positions_.size(); ++e) n += done_[e].load(std::memory_order_acquire) ? 1 : 0;
  return n;
}

MaskCacheStats MaskCache::stats() const {
  MaskCacheStats st;
  st.positions = positions_.size();
  for (size_t e = 0; e < positions_.size(); ++e) {
    if (!done_[e].load(std::memory_order_acquire)) continue;
    const PositionMask& pm = masks_[e];
    st.accepted_bitmasks += pm.accepted_words.empty() ? 0 : 1;
    st.uncertain_entries += pm.uncertain.num_tokens();
    st.memory_bytes += pm.accepted_words.size() * 4 + pm.accepted_ids.size() * 4 + pm.uncertain.memory_bytes();
  }
  return st;
}

void MaskCache::Compute(size_t entry) const {
  const TokenTrie& vocab = vocab_.trie();
  const int64_t mask_words = vocab_.mask_words();
  const uint32_t pos = positions_[entry];
  PositionMask& pm = masks_[entry];
  const StackNode escape{kAcceptPos, nullptr};  // a stand-in: never dereferenced
  NodeArena arena(/*intern=*/false);
  std::vector<std::vector<Stack>> level(vocab.max_depth() + 1);
  std::vector<size_t> mark(vocab.max_depth() + 1, 0);
  std::vector<uint32_t> accepted(static_cast<size_t>(mask_words), 0);
  struct EscapeRange {
    uint32_t first, last, offset;
  };
  std::vector<EscapeRange> escapes;
  level[0] = {Stack{pos, &escape}};
  for (uint32_t i = 1; i < vocab.size();) {
    const uint32_t d = vocab.depth(i);
    arena.Rewind(mark[d - 1]);
    bool escaped = false;
    pda_.Advance(level[d - 1], vocab.byte(i), arena, level[d], &escape, &escaped);
    mark[d] = arena.mark();
    if (escaped || !level[d].empty()) {
      for (int32_t id : vocab.tokens(i)) SetBit(accepted, id);
    }
    if (escaped && vocab.end(i) > i + 1) escapes.push_back({i + 1, vocab.end(i), d});
    i = level[d].empty() ? vocab.end(i) : i + 1;
  }
  // Uncertain: escaped with bytes left and never accepted.
  std::vector<std::pair<std::string_view, int32_t>> uncertain;
  for (const EscapeRange& r : escapes) {
    for (int32_t id : vocab.tokens_in(r.first, r.last)) {
      if (!((accepted[id >> 5] >> (id & 31)) & 1)) uncertain.push_back({vocab_.token_bytes(id)->substr(r.offset), id});
    }
  }
  size_t count = 0;
  for (uint32_t w : accepted) count += static_cast<size_t>(__builtin_popcount(w));
  if (count >= static_cast<size_t>(mask_words)) {
    pm.accepted_words = std::move(accepted);
  } else {
    pm.accepted_ids.reserve(count);
    for (size_t w = 0; w < accepted.size(); ++w) {
      for (uint32_t bits = accepted[w]; bits != 0; bits &= bits - 1) {
        pm.accepted_ids.push_back(static_cast<int32_t>(w * 32 + __builtin_ctz(bits)));
      }
    }
  }
  if (!uncertain.empty()) pm.uncertain = TokenTrie::Build(std::move(uncertain));
  done_[entry].store(true, std::memory_order_release);
}

}  // namespace exl3serve::coordinator::constrained
