#include "coordinator/ngram_drafter.h"

#include <algorithm>

#include "common/logging.h"

namespace exl3serve::coordinator {
namespace {

// One step of the n-gram hash, folding tokens from the n-gram's end
// backwards (so the hashes of n = 1, 2, ... ending at one position come out
// of one pass), then a splitmix64 finaliser per length.
uint64_t Fold(uint64_t h, int32_t token) {
  h ^= static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

uint64_t Finish(uint64_t h, int n) {
  h += static_cast<uint64_t>(n) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

bool SameTokens(std::span<const int32_t> t, int64_t end_a, int64_t end_b, int n) {
  for (int j = 0; j < n; ++j) {
    if (t[static_cast<size_t>(end_a - j)] != t[static_cast<size_t>(end_b - j)]) return false;
  }
  return true;
}

std::vector<int32_t> DraftAfter(std::span<const int32_t> t, int64_t end, int max_tokens) {
  const int64_t from = end + 1;
  const int64_t to = std::min<int64_t>(from + max_tokens, static_cast<int64_t>(t.size()));
  return {t.begin() + from, t.begin() + to};
}

}  // namespace

NgramDrafter::NgramDrafter(const NgramDrafterOptions& options) : options_(options) {
  EXL3_CHECK(options.min_match >= 1);
  EXL3_CHECK(options.max_match >= options.min_match);
  last_end_.resize(static_cast<size_t>(options.max_match - options.min_match + 1));
}

uint64_t NgramDrafter::HashEndingAt(int64_t end, int n) const {
  uint64_t h = 0;
  for (int j = 0; j < n; ++j) h = Fold(h, tokens_[static_cast<size_t>(end - j)]);
  return Finish(h, n);
}

void NgramDrafter::IndexThrough(int64_t end) {
  for (; indexed_ < end; ++indexed_) {
    const int64_t e = indexed_;
    uint64_t h = 0;
    const int longest = static_cast<int>(std::min<int64_t>(options_.max_match, e + 1));
    for (int n = 1; n <= longest; ++n) {
      h = Fold(h, tokens_[static_cast<size_t>(e - n + 1)]);
      if (n >= options_.min_match) last_end_[static_cast<size_t>(n - options_.min_match)][Finish(h, n)] = e;
    }
  }
}

void NgramDrafter::Append(std::span<const int32_t> tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  // Every n-gram ending before the last token: the suffix itself (ending at
  // the last token) must not match itself.
  IndexThrough(size() - 1);
}

void NgramDrafter::Truncate(int64_t length) {
  EXL3_CHECK(length >= 0 && length <= size());
  if (length == size()) return;
  tokens_.resize(static_cast<size_t>(length));
  // The maps keep only the last end of each n-gram, so an earlier end that a
  // now-dropped position overwrote is gone: index again from scratch.
  for (auto& map : last_end_) map.clear();
  indexed_ = 0;
  IndexThrough(size() - 1);
}

std::vector<int32_t> NgramDrafter::Propose(int max_tokens) const {
  const int64_t length = size();
  if (max_tokens <= 0 || length < options_.min_match + 1) return {};
  const int64_t last = length - 1;
  const int longest = static_cast<int>(std::min<int64_t>(options_.max_match, length - 1));
  for (int n = longest; n >= options_.min_match; --n) {
    const auto& map = last_end_[static_cast<size_t>(n - options_.min_match)];
    auto it = map.find(HashEndingAt(last, n));
    if (it == map.end()) continue;
    // A hash collision would propose unrelated tokens: check the match.
    if (!SameTokens(tokens_, it->second, last, n)) continue;
    return DraftAfter(tokens_, it->second, max_tokens);
  }
  return {};
}

std::vector<int32_t> NgramDrafter::ProposeReference(std::span<const int32_t> tokens,
                                                    const NgramDrafterOptions& options,
                                                    int max_tokens) {
  const int64_t length = static_cast<int64_t>(tokens.size());
  if (max_tokens <= 0) return {};
  const int64_t last = length - 1;
  for (int n = options.max_match; n >= options.min_match; --n) {
    if (n > length - 1) continue;
    for (int64_t e = last - 1; e >= n - 1; --e) {
      if (SameTokens(tokens, e, last, n)) return DraftAfter(tokens, e, max_tokens);
    }
  }
  return {};
}

}  // namespace exl3serve::coordinator
