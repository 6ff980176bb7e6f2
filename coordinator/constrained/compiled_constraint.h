// coordinator/constrained/compiled_constraint.h — what CompileConstraint
// builds: the frozen grammar, its automaton and the mask cache for one
// vocabulary. Internal (TokenMatcher and the tests reach in here).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_COMPILED_CONSTRAINT_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_COMPILED_CONSTRAINT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/grammar.h"
#include "coordinator/constrained/json_key_tracker.h"
#include "coordinator/constrained/mask_cache.h"
#include "coordinator/constrained/pda.h"
#include "coordinator/constrained/vocabulary.h"

namespace exl3serve::coordinator::constrained {

// The grammar of `spec`: the errors of CompileConstraint. `writable_by`:
// the vocabulary the output will be written in (nullptr: any byte string).
absl::StatusOr<FlatGrammar> BuildConstraintGrammar(const ConstraintSpec& spec,
                                                   const TokenVocabulary* writable_by = nullptr);

class GrammarConstraint final : public CompiledConstraint {
 public:
  GrammarConstraint(ConstraintSpec spec, std::shared_ptr<const TokenVocabulary> vocab,
                    FlatGrammar grammar);

  const TokenVocabulary& vocabulary() const override { return *vocab_; }
  const ConstraintSpec& spec() const override { return spec_; }
  const ByteVocabulary& bytes() const { return AsByteVocabulary(*vocab_); }
  const FlatGrammar& grammar() const { return grammar_; }
  const Pda& pda() const { return pda_; }
  const MaskCache& cache() const { return cache_; }
  // kJsonSchema: the tokens containing '"', for TokenMatcher's unique-key
  // filter (json_key_tracker.h); empty for the other kinds.
  const QuoteTokens& quote_tokens() const { return quote_tokens_; }

 private:
  ConstraintSpec spec_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  FlatGrammar grammar_;
  Pda pda_;
  MaskCache cache_;
  // Initialized here (after vocab_), so the constructor need not name it.
  QuoteTokens quote_tokens_ =
      spec_.kind == ConstraintKind::kJsonSchema ? QuoteTokens::Build(*vocab_) : QuoteTokens();
};

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_COMPILED_CONSTRAINT_H_
