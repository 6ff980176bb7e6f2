// coordinator/constrained/constraint.cc — CompileConstraint, ConstraintCache
// (constraint.h) over the grammar, automaton and mask cache; TokenMatcher is
// in token_matcher.cc.
#include "coordinator/constrained/constraint.h"

#include <algorithm>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/gbnf_parser.h"
#include "coordinator/constrained/json_schema_compiler.h"
#include "coordinator/constrained/regex_compiler.h"
#include "coordinator/constrained/utf8_ranges.h"

namespace exl3serve::coordinator::constrained {

const char* ConstraintKindName(ConstraintKind kind) {
  switch (kind) {
    case ConstraintKind::kJsonSchema: return "json_schema";
    case ConstraintKind::kRegex: return "regex";
    case ConstraintKind::kChoice: return "choice";
    case ConstraintKind::kGrammar: return "grammar";
  }
  return "unknown";
}

namespace {

// The grammar of `spec`, restricted to `chars` (nullptr: none). Notes in
// *first_unwritable the first character the restriction removed.
absl::StatusOr<FlatGrammar> BuildGrammar(const ConstraintSpec& spec, const CodePointSet* chars,
                                         int64_t* first_unwritable) {
  Grammar g;
  g.RestrictCharacters(chars);
  absl::StatusOr<uint32_t> root;
  switch (spec.kind) {
    case ConstraintKind::kJsonSchema:
      root = CompileJsonSchema(spec.text, g);
      break;
    case ConstraintKind::kRegex:
      root = CompileRegex(spec.text, {}, g, "regex");
      break;
    case ConstraintKind::kGrammar:
      root = ParseGbnf(spec.text, g);
      break;
    case ConstraintKind::kChoice: {
      if (spec.choices.empty()) return absl::InvalidArgumentError("choice: no choices given");
      const uint32_t r = g.AddRule("choice");
      if (absl::Status s = g.CheckAlternatives("choice", spec.choices.size()); !s.ok()) return s;
      for (const std::string& c : spec.choices) g.AddAlternative(r, g.Literal(c));
      root = r;
      break;
    }
    default:
      return absl::InvalidArgumentError("unknown constraint kind");
  }
  *first_unwritable = g.first_unwritable();
  if (!root.ok()) return root.status();
  return FlatGrammar::Freeze(g, *root);
}

std::string DescribeCharacter(uint32_t cp) {
  if (cp >= 0x20 && cp < 0x7F) return absl::StrCat("'", std::string(1, static_cast<char>(cp)), "'");
  std::string hex = absl::StrFormat("U+%04X", cp);
  if (cp < 0xA0 || (cp >= 0xD800 && cp <= 0xDFFF)) return hex;
  std::string utf8;
  AppendUtf8(cp, utf8);
  return absl::StrCat("'", utf8, "' (", hex, ")");
}

}  // namespace

absl::StatusOr<FlatGrammar> BuildConstraintGrammar(const ConstraintSpec& spec,
                                                   const TokenVocabulary* writable_by) {
  // A vocabulary that cannot write every byte string restricts the output to
  // the characters it can (vocabulary.h: every allowed prefix stays
  // completable in tokens). Byte-complete ones: nullptr, no restriction.
  const CodePointSet* chars = writable_by == nullptr ? nullptr : AsByteVocabulary(*writable_by).writable_chars();
  int64_t first_unwritable = -1;
  absl::StatusOr<FlatGrammar> grammar = BuildGrammar(spec, chars, &first_unwritable);
  if (grammar.ok() || chars == nullptr || grammar.status().code() != absl::StatusCode::kInvalidArgument) {
    return grammar;
  }
  // Failed only under the restriction: the vocabulary's fault, say so.
  int64_t unused;
  absl::StatusOr<FlatGrammar> unrestricted = BuildGrammar(spec, nullptr, &unused);
  if (!unrestricted.ok()) return unrestricted.status();
  return absl::InvalidArgumentError(absl::StrCat(
      "no output of this constraint can be written with the model's vocabulary",
      first_unwritable >= 0
          ? absl::StrCat(" (e.g. ", DescribeCharacter(static_cast<uint32_t>(first_unwritable)), " is not in it)")
          : std::string()));
}

GrammarConstraint::GrammarConstraint(ConstraintSpec spec, std::shared_ptr<const TokenVocabulary> vocab,
                                     FlatGrammar grammar)
    : spec_(std::move(spec)),
      vocab_(std::move(vocab)),
      grammar_(std::move(grammar)),
      pda_(grammar_),
      cache_(pda_, AsByteVocabulary(*vocab_)) {}

absl::StatusOr<std::shared_ptr<const CompiledConstraint>> CompileConstraint(
    const ConstraintSpec& spec, std::shared_ptr<const TokenVocabulary> vocab) {
  if (vocab == nullptr) return absl::InvalidArgumentError("CompileConstraint: no vocabulary");
  absl::StatusOr<FlatGrammar> grammar = BuildConstraintGrammar(spec, vocab.get());
  if (!grammar.ok()) {
    return absl::Status(grammar.status().code(),
                        absl::StrCat(ConstraintKindName(spec.kind), ": ", grammar.status().message()));
  }
  return std::make_shared<const GrammarConstraint>(spec, std::move(vocab), *std::move(grammar));
}

// ---------------------------------------------------------------------------
// ConstraintCache

struct ConstraintCache::State {
  std::shared_ptr<const TokenVocabulary> vocab;
  size_t capacity;
  std::mutex mu;
  // Most recent first.
  std::list<std::pair<std::string, std::shared_ptr<const CompiledConstraint>>> lru;
  std::unordered_map<std::string, decltype(lru)::iterator> index;
};

namespace {
std::string CacheKey(const ConstraintSpec& spec) {
  std::string key = absl::StrCat(static_cast<int>(spec.kind), ":", spec.text.size(), ":", spec.text);
  for (const std::string& c : spec.choices) absl::StrAppend(&key, ":", c.size(), ":", c);
  return key;
}
}  // namespace

ConstraintCache::ConstraintCache(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity)
    : state_(std::make_unique<State>()) {
  state_->vocab = std::move(vocab);
  state_->capacity = std::max<size_t>(capacity, 1);
}
ConstraintCache::~ConstraintCache() = default;

const TokenVocabulary& ConstraintCache::vocabulary() const { return *state_->vocab; }

absl::StatusOr<std::shared_ptr<const CompiledConstraint>> ConstraintCache::Get(const ConstraintSpec& spec) {
  const std::string key = CacheKey(spec);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->index.find(key);
    if (it != state_->index.end()) {
      state_->lru.splice(state_->lru.begin(), state_->lru, it->second);
      return it->second->second;
    }
  }
  // Compiled outside the lock: a slow schema does not block hits.
  absl::StatusOr<std::shared_ptr<const CompiledConstraint>> compiled = CompileConstraint(spec, state_->vocab);
  if (!compiled.ok()) return compiled.status();
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->index.find(key);
  if (it != state_->index.end()) return it->second->second;  // raced: keep the first
  state_->lru.emplace_front(key, *compiled);
  state_->index[key] = state_->lru.begin();
  while (state_->lru.size() > state_->capacity) {
    state_->index.erase(state_->lru.back().first);
    state_->lru.pop_back();
  }
  return compiled;
}

}  // namespace exl3serve::coordinator::constrained
