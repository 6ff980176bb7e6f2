#include "coordinator/tokenizer/bpe_model.h"

#include <algorithm>
#include <cstdio>
#include <queue>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator::internal {
namespace {

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

absl::StatusOr<BpeModel> BpeModel::Create(
    std::vector<std::pair<std::string, int32_t>> vocab,
    const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
    std::string_view label) {
  BpeModel m;
  m.options_ = std::move(options);
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab) {
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(label), ": `model.vocab` entry `",
                                                     token, "` has negative id ", id));
    }
    max_id = std::max(max_id, id);
  }
  m.id_to_token_.resize(max_id + 1);
  m.has_id_.assign(max_id + 1, false);
  m.token_to_id_.reserve(vocab.size());
  for (auto& [token, id] : vocab) {
    m.id_to_token_[id] = token;
    m.has_id_[id] = true;
    m.token_to_id_.emplace(std::move(token), id);
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const auto id = m.Find(name);
    m.byte_ids_[b] = id ? *id : -1;
  }
  if (m.options_.unk_token) {
    m.unk_id_ = m.Find(*m.options_.unk_token);
    if (!m.unk_id_) {
      return absl::DataLossError(absl::StrCat(AbslView(label), ": `model.unk_token` `",
                                              *m.options_.unk_token, "` is not in `model.vocab`"));
    }
  }
  const std::string& prefix = m.options_.continuing_subword_prefix;
  m.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto id_a = m.Find(a);
    const auto id_b = m.Find(b);
    // The merged token drops the right side's continuation prefix.
    const std::string merged =
        b.compare(0, prefix.size(), prefix) == 0 ? a + b.substr(prefix.size()) : a + b;
    const auto id_new = m.Find(merged);
    if (!id_a || !id_b || !id_new) {
      const std::string& missing = !id_a ? a : !id_b ? b : merged;
      return absl::DataLossError(absl::StrCat(AbslView(label), ": `model.merges[", rank,
                                              "]` uses token `", missing,
                                              "`, which is not in `model.vocab`"));
    }
    // A repeated pair keeps its first (best) rank.
    m.merges_.emplace(PairKey(*id_a, *id_b), Merge{static_cast<int32_t>(rank), *id_new});
  }
  return m;
}

std::optional<int32_t> BpeModel::Find(std::string_view token) const {
  auto it = token_to_id_.find(AbslView(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const { return Find(token); }

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= id_end() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (auto id = Find(word)) {
      out->push_back(*id);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // indices into symbols; -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&](int32_t id) {
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, -1, true});
    if (index > 0) symbols[index - 1].next = index;
  };
  // A pending unknown run: emitted before the next known symbol (fused into
  // one unk token when fuse_unk).
  bool unk_pending = false;
  std::string piece;
  for (size_t i = 0; i < word.size();) {
    const size_t len = std::min(Utf8CharLength(static_cast<unsigned char>(word[i])), word.size() - i);
    piece.assign(word.data() + i, len);
    if (i > 0) piece.insert(0, options_.continuing_subword_prefix);
    if (i + len == word.size()) piece += options_.end_of_word_suffix;
    i += len;
    if (auto id = Find(piece)) {
      if (unk_pending) add(*unk_id_);
      unk_pending = false;
      add(*id);
      continue;
    }
    if (options_.byte_fallback) {
      bool all_bytes = true;
      for (char c : piece) all_bytes = all_bytes && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all_bytes) {
        // As in Hugging Face tokenizers, a pending unk stays pending here.
        for (char c : piece) add(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (unk_pending && !options_.fuse_unk) add(*unk_id_);
      unk_pending = true;
    }
  }
  if (unk_pending) add(*unk_id_);
  if (symbols.empty()) return;

  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    // Stale if either side changed since the candidate was queued.
    auto it = merges_.find(PairKey(left.id, symbols[left.next].id));
    if (it == merges_.end() || it->second.new_id != top.new_id || it->second.rank != top.rank) {
      continue;
    }
    Symbol& right = symbols[left.next];
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
}

}  // namespace exl3serve::coordinator::internal
