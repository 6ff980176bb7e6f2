// coordinator/constrained/vocabulary.cc — TokenVocabulary's factories.
#include "coordinator/constrained/vocabulary.h"

#include <algorithm>
#include <array>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace exl3serve::coordinator::constrained {

ByteVocabulary::ByteVocabulary(std::vector<std::optional<std::string>> bytes, std::vector<int32_t> eos)
    : bytes_(std::move(bytes)), eos_(std::move(eos)) {
  std::vector<std::pair<std::string_view, int32_t>> entries;
  entries.reserve(bytes_.size());
  for (size_t id = 0; id < bytes_.size(); ++id) {
    if (!bytes_[id].has_value() || bytes_[id]->empty()) continue;
    if (std::find(eos_.begin(), eos_.end(), static_cast<int32_t>(id)) != eos_.end()) continue;
    entries.push_back({*bytes_[id], static_cast<int32_t>(id)});
  }
  std::array<bool, 256> single{};
  for (const auto& [b, id] : entries) {
    if (b.size() == 1) single[static_cast<uint8_t>(b[0])] = true;
  }
  byte_complete_ = std::all_of(single.begin(), single.end(), [](bool x) { return x; });
  if (!byte_complete_) {
    std::vector<std::string_view> tokens;
    tokens.reserve(entries.size());
    for (const auto& e : entries) tokens.push_back(e.first);
    writable_ = WritableCharacters(tokens);
  }
  trie_ = TokenTrie::Build(std::move(entries));
}

namespace {
bool IsContinuation(uint8_t b) { return (b & 0xC0) == 0x80; }
}  // namespace

CodePointSet WritableCharacters(const std::vector<std::string_view>& tokens) {
  // Pieces: tokens inside one character. Heads: a lead byte and fewer
  // continuation bytes than it needs; tails: 1-3 continuation bytes.
  std::unordered_set<std::string> heads, tails, enterable;
  std::vector<uint32_t> whole;  // characters that are one token
  for (std::string_view t : tokens) {
    if (t.empty()) continue;
    size_t last_lead = t.size();
    for (size_t i = t.size(); i-- > 0;) {
      if (!IsContinuation(static_cast<uint8_t>(t[i]))) {
        last_lead = i;
        break;
      }
    }
    if (last_lead == t.size()) {  // continuation bytes only
      if (t.size() <= 3) tails.insert(std::string(t));
      continue;
    }
    const int need = Utf8LengthFromLead(static_cast<uint8_t>(t[last_lead]));
    if (need > 1 && t.size() - last_lead < static_cast<size_t>(need)) {
      // Ends inside a character after this head: output can stop there.
      enterable.insert(std::string(t.substr(last_lead)));
      if (last_lead == 0) heads.insert(std::string(t));
    }
    size_t pos = 0;
    uint32_t cp;
    if (DecodeUtf8(t, &pos, &cp) && pos == t.size()) whole.push_back(cp);
  }
  // Heads where output can stop: closed under appending a tail piece that
  // leaves the character unfinished.
  std::vector<std::string> work(enterable.begin(), enterable.end());
  while (!work.empty()) {
    const std::string p = std::move(work.back());
    work.pop_back();
    const size_t need = static_cast<size_t>(Utf8LengthFromLead(static_cast<uint8_t>(p[0])));
    for (const std::string& t : tails) {
      if (p.size() + t.size() < need && enterable.insert(p + t).second) work.push_back(p + t);
    }
  }
  // A run of continuation bytes is finishable when it splits into tails.
  auto finishable = [&](std::string_view q) {
    std::array<bool, 5> ok{};
    ok[q.size()] = true;
    for (size_t i = q.size(); i-- > 0;) {
      for (size_t j = i + 1; j <= q.size() && !ok[i]; ++j) ok[i] = ok[j] && tails.contains(std::string(q.substr(i, j - i)));
    }
    return ok[0];
  };
  // Candidates: whole-token characters and heads followed by tails.
  std::vector<std::string> candidates;
  for (uint32_t cp : whole) {
    std::string s;
    AppendUtf8(cp, s);
    candidates.push_back(std::move(s));
  }
  std::vector<std::string> tail_list(tails.begin(), tails.end());
  for (const std::string& h : heads) {
    const size_t need = static_cast<size_t>(Utf8LengthFromLead(static_cast<uint8_t>(h[0])));
    std::vector<std::string> partial = {h};
    while (!partial.empty()) {
      std::string p = std::move(partial.back());
      partial.pop_back();
      for (const std::string& t : tail_list) {
        if (p.size() + t.size() == need) {
          candidates.push_back(p + t);
        } else if (p.size() + t.size() < need) {
          partial.push_back(p + t);
        }
      }
    }
  }
  CodePointSet out;
  for (const std::string& c : candidates) {
    size_t pos = 0;
    uint32_t cp;
    if (!DecodeUtf8(c, &pos, &cp) || pos != c.size()) continue;
    bool ok = true;
    for (size_t k = 1; k < c.size() && ok; ++k) {
      ok = !enterable.contains(c.substr(0, k)) || finishable(std::string_view(c).substr(k));
    }
    if (ok) out.push_back({cp, cp});
  }
  return NormalizeCodePoints(std::move(out));
}

std::optional<std::string_view> ByteVocabulary::token_bytes(int32_t id) const {
  if (id < 0 || id >= size() || !bytes_[id].has_value() || bytes_[id]->empty()) return std::nullopt;
  return std::string_view(*bytes_[id]);
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::FromBytes(
    std::vector<std::optional<std::string>> token_bytes, std::span<const int32_t> eos_ids) {
  std::vector<int32_t> eos;
  for (int32_t id : eos_ids) {
    if (id < 0 || static_cast<size_t>(id) >= token_bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("eos id ", id, " outside the vocabulary of ",
                                                     token_bytes.size(), " tokens"));
    }
    if (std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
  }
  return std::make_shared<const ByteVocabulary>(std::move(token_bytes), std::move(eos));
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::FromTokenizer(
    const Tokenizer& tokenizer, int64_t model_vocab_size, std::span<const int32_t> eos_ids) {
  const int32_t n = tokenizer.vocab_size();
  if (model_vocab_size < n) {
    return absl::InvalidArgumentError(absl::StrCat("model vocabulary of ", model_vocab_size,
                                                   " tokens is smaller than the tokenizer's ", n));
  }
  std::vector<std::optional<std::string>> bytes(static_cast<size_t>(model_vocab_size));
  for (int32_t id = 0; id < n; ++id) {
    if (tokenizer.IsSpecial(id)) continue;
    absl::StatusOr<std::string> b = tokenizer.TokenBytes(id);
    if (b.ok() && !b->empty()) bytes[id] = *std::move(b);  // holes: an error, no bytes
  }
  return FromBytes(std::move(bytes), eos_ids);
}

}  // namespace exl3serve::coordinator::constrained
