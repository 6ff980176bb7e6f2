// coordinator/constrained/vocabulary.cc — TokenVocabulary's factories.
#include "coordinator/constrained/vocabulary.h"

#include <algorithm>
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
  trie_ = TokenTrie::Build(std::move(entries));
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
