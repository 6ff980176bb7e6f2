// coordinator/constrained/constraint.h — structured output: what a request
// constrains its output to (a JSON Schema, a regular expression, a choice
// among strings, a context-free grammar), compiled once per (constraint,
// vocabulary) into a byte-level pushdown automaton, and the per-sequence
// matcher that turns its state into each step's allowed-token bitmask.
//
//   auto vocab = TokenVocabulary::FromTokenizer(tokenizer, model_vocab, eos_ids);
//   ConstraintCache cache(*vocab, /*capacity=*/64);
//   EXL3_ASSIGN_OR_RETURN(auto compiled, cache.Get({.kind = ConstraintKind::kJsonSchema,
//                                                     .text = schema_json}));
//   TokenMatcher matcher(compiled);
//   std::vector<uint32_t> mask(matcher.mask_words());
//   matcher.FillNextTokenMask(mask);            // bit id%32 of word id/32: allowed
//   EXL3_RETURN_IF_ERROR(matcher.AcceptToken(sampled_id));
//
// Semantics: a token is allowed iff its bytes extend the output so far to a
// prefix of some string the constraint accepts (never a dead state), and
// every such token is allowed. EOS ids are allowed exactly where the output
// so far is a complete string of the constraint. Tokens with no bytes in the
// vocabulary (special and control tokens, ids past the tokenizer's
// vocabulary) are never allowed.
//
// Thread safety: TokenVocabulary, CompiledConstraint are immutable and
// thread-safe; ConstraintCache is thread-safe; TokenMatcher is
// thread-compatible (one sequence, one caller at a time).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_CONSTRAINT_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_CONSTRAINT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::coordinator {

class Tokenizer;

namespace constrained {

enum class ConstraintKind {
  kJsonSchema,  // text: a JSON Schema document ("{}" = any JSON value)
  kRegex,       // text: a regular expression, matched against the whole output
  kChoice,      // choices: the output is exactly one of them
  kGrammar,     // text: a GBNF grammar (start rule `root`)
};

struct ConstraintSpec {
  ConstraintKind kind = ConstraintKind::kJsonSchema;
  std::string text = {};
  std::vector<std::string> choices = {};
};

// "json_schema", "regex", "choice", "grammar".
const char* ConstraintKindName(ConstraintKind kind);

// The exact bytes of every token id of a model's vocabulary (byte-level BPE
// mapped back to bytes, SentencePiece "▁" as a space, <0xNN> byte tokens as
// their byte), indexed for mask computation (a byte trie).
class TokenVocabulary {
 public:
  // `model_vocab_size` >= the tokenizer's vocabulary (a padded embedding
  // table); ids the tokenizer lacks, special tokens and tokens with no bytes
  // get none. `eos_ids`: the ids that end a sequence (each < model_vocab_size).
  // InvalidArgument for an eos id out of range or a model vocabulary smaller
  // than the tokenizer's.
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> FromTokenizer(
      const Tokenizer& tokenizer, int64_t model_vocab_size, std::span<const int32_t> eos_ids);
  // For tests: token_bytes[id] = the token's bytes, nullopt = never allowed.
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> FromBytes(
      std::vector<std::optional<std::string>> token_bytes, std::span<const int32_t> eos_ids);

  virtual ~TokenVocabulary() = default;
  virtual int64_t size() const = 0;  // the model's vocabulary (mask bits)
  // ceil(size() / 32): the uint32 words of one mask row.
  int64_t mask_words() const { return (size() + 31) / 32; }
  virtual std::span<const int32_t> eos_ids() const = 0;
  // The token's bytes; nullopt when it has none.
  virtual std::optional<std::string_view> token_bytes(int32_t id) const = 0;
};

// A constraint compiled for one vocabulary (immutable; share it).
class CompiledConstraint {
 public:
  virtual ~CompiledConstraint() = default;
  virtual const TokenVocabulary& vocabulary() const = 0;
  virtual const ConstraintSpec& spec() const = 0;
};

// Compiles `spec` for `vocab`. InvalidArgument naming the problem for a
// malformed or unsupported constraint (an unsupported JSON Schema keyword
// names the keyword and its JSON pointer; a regex or grammar error its
// offset); ResourceExhausted when the compiled automaton would exceed its
// size limit.
absl::StatusOr<std::shared_ptr<const CompiledConstraint>> CompileConstraint(
    const ConstraintSpec& spec, std::shared_ptr<const TokenVocabulary> vocab);

// Compiled constraints by spec (least recently used evicted past
// `capacity`). Errors are not cached.
class ConstraintCache {
 public:
  ConstraintCache(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity);
  ~ConstraintCache();
  absl::StatusOr<std::shared_ptr<const CompiledConstraint>> Get(const ConstraintSpec& spec);
  const TokenVocabulary& vocabulary() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One sequence's position in a compiled constraint: the output accepted so
// far (token by token, with history for rollback). JSON Schema constraints
// also keep object keys unique: a token that would complete a key its object
// already has (compared decoded: "a" and "\u0061" are one key), or repeat
// one within itself, is not allowed although the grammar alone would allow
// it. Free keys can always be extended instead, so this leaves no dead state
// (given a vocabulary that can write key characters one by one).
class TokenMatcher {
 public:
  explicit TokenMatcher(std::shared_ptr<const CompiledConstraint> constraint);
  ~TokenMatcher();
  TokenMatcher(TokenMatcher&&) noexcept;
  TokenMatcher& operator=(TokenMatcher&&) noexcept;

  int64_t mask_words() const;
  // Writes the allowed next tokens into `mask` (mask_words() words; every
  // bit written). All zero only when nothing can follow — not even EOS —
  // which a vocabulary lacking the bytes the constraint needs can cause.
  void FillNextTokenMask(std::span<uint32_t> mask);
  // Advances by one token. InvalidArgument (state unchanged) when the token
  // is not allowed (JSON Schema: a repeated key too); an EOS id is accepted
  // where the output is complete and leaves the matcher terminated (nothing
  // but rollback after it).
  absl::Status AcceptToken(int32_t id);
  // Undoes the last `num_tokens` accepted tokens. InvalidArgument when fewer
  // were accepted.
  absl::Status Rollback(int num_tokens);
  // The output so far is a complete string of the constraint (EOS allowed).
  bool IsComplete() const;
  // Complete and no byte can extend it (or EOS was accepted): only EOS may
  // follow, so the request can end here.
  bool IsTerminated() const;
  int64_t num_accepted() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace constrained
}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_CONSTRAINT_H_
