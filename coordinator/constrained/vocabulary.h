// coordinator/constrained/vocabulary.h — the TokenVocabulary implementation
// (constraint.h): token bytes plus their byte trie. Internal; the rest of
// coordinator/constrained/ reaches the trie through AsByteVocabulary.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_

#include <optional>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/token_trie.h"

namespace exl3serve::coordinator::constrained {

class ByteVocabulary final : public TokenVocabulary {
 public:
  ByteVocabulary(std::vector<std::optional<std::string>> bytes, std::vector<int32_t> eos);

  int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }
  std::span<const int32_t> eos_ids() const override { return eos_; }
  std::optional<std::string_view> token_bytes(int32_t id) const override;
  // Every id with bytes except the EOS ids (EOS is allowed by completeness,
  // never by its bytes).
  const TokenTrie& trie() const { return trie_; }

 private:
  std::vector<std::optional<std::string>> bytes_;
  std::vector<int32_t> eos_;
  TokenTrie trie_;
};

// Every TokenVocabulary is a ByteVocabulary (the factories make only those).
inline const ByteVocabulary& AsByteVocabulary(const TokenVocabulary& v) {
  return static_cast<const ByteVocabulary&>(v);
}

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_
