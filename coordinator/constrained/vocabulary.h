// coordinator/constrained/vocabulary.h — the TokenVocabulary implementation
// (constraint.h): token bytes plus their byte trie. Internal; the rest of
// coordinator/constrained/ reaches the trie through AsByteVocabulary.
//
// Writability. A constraint's grammar guarantees that every prefix it allows
// can be completed by some byte string, not by some sequence of this
// vocabulary's tokens. A vocabulary is byte-complete when each of the 256
// bytes is a token (byte-level BPE, SentencePiece byte fallback): then every
// byte string can be written and nothing is restricted. Otherwise
// writable_chars() is the set W of characters the grammar is restricted to
// (BuildConstraintGrammar), chosen so that every output of allowed tokens can
// be finished in tokens:
//   - a character c is in W when its bytes are one token or a concatenation
//     of tokens lying inside c ("pieces": a lead byte with some continuation
//     bytes, or continuation bytes only), and
//   - for every split c = p + q (p non-empty, q non-empty) where some token
//     sequence can stop after p (a token ends with p after a character
//     boundary, or p is such a p' followed by a continuation-only token), q
//     is again a concatenation of pieces.
// Proof sketch: an output o of allowed tokens is a prefix of some string r of
// the restricted grammar (r over W). If o ends between characters, the rest
// of r is characters of W, each writable. If o ends inside a character c
// after p, some token sequence stopped after p (that is how o was written),
// so the rest q of c is writable by the second rule, then the characters of W
// after it. Tokens that are not complete UTF-8 stay allowed where this holds
// (e.g. a lone lead byte 0xC3 when 0xA9 is a token too).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_

#include <optional>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/token_trie.h"
#include "coordinator/constrained/utf8_ranges.h"

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
  // Every byte 0x00..0xFF is a token of the trie (by itself).
  bool byte_complete() const { return byte_complete_; }
  // The characters a constraint's output is restricted to (see the file
  // comment; normalized); nullptr when byte-complete (no restriction).
  const CodePointSet* writable_chars() const { return byte_complete_ ? nullptr : &writable_; }

 private:
  std::vector<std::optional<std::string>> bytes_;
  std::vector<int32_t> eos_;
  TokenTrie trie_;
  bool byte_complete_ = false;
  CodePointSet writable_;
};

// The characters W of the file comment for tokens `tokens` (their bytes;
// EOS and empty ones already left out). Exposed for tests.
CodePointSet WritableCharacters(const std::vector<std::string_view>& tokens);

// Every TokenVocabulary is a ByteVocabulary (the factories make only those).
inline const ByteVocabulary& AsByteVocabulary(const TokenVocabulary& v) {
  return static_cast<const ByteVocabulary&>(v);
}

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_VOCABULARY_H_
