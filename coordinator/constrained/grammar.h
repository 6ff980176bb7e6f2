// coordinator/constrained/grammar.h — the byte-level context-free grammar
// every constraint compiles to (JSON Schema, regex, choice, GBNF), and its
// frozen, flattened form the pushdown automaton runs on.
//
//   Grammar g;
//   uint32_t digits = g.AddRule("digits");
//   g.AddAlternative(digits, {g.Bytes(ByteSet::Range('0', '9')), g.Ref(digits)});
//   g.AddAlternative(digits, {g.Bytes(ByteSet::Range('0', '9'))});
//   EXL3_ASSIGN_OR_RETURN(FlatGrammar flat, FlatGrammar::Freeze(g, digits));
//
// A rule is a list of alternatives; an alternative a sequence of elements,
// each a set of bytes (one byte of input) or a reference to a rule. Freeze
// checks what the runtime relies on: every referenced rule has an
// alternative, no rule is left-recursive (directly, or through a prefix of
// nullable elements: the automaton expands rules eagerly and would loop), and
// alternatives that can derive no string are dropped, so every stack the
// automaton holds can still be completed (no dead states).
//
// A grammar may be restricted to a set of characters (the ones a vocabulary
// can write, vocabulary.h): then every builder drops what needs another
// character, so Freeze sees those alternatives as deriving nothing and
// removes them. Builders that take characters from text go through Literal,
// Bytes (ASCII bytes: whole characters) and WritableSubset (code-point
// classes, before they become byte sequences); a builder that emits raw
// non-ASCII bytes itself is not restricted.
//
// Thread safety: Grammar is thread-compatible; FlatGrammar is immutable.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_GRAMMAR_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_GRAMMAR_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/constrained/utf8_ranges.h"

namespace exl3serve::coordinator::constrained {

// Size limits for one compiled constraint (each error names its limit).
inline constexpr size_t kMaxGrammarElements = size_t{1} << 20;
// Alternatives of one rule. The matcher follows at most kMaxStacks (pda.h,
// equal) parses at once, and the alternatives of one rule that share a first
// byte (every string of a JSON enum starts with '"') are all alive after it:
// a rule with more is refused when it is compiled, at admission, instead of
// failing at the first token that reaches it.
inline constexpr size_t kMaxRuleAlternatives = 2048;
inline constexpr size_t kMaxGrammarRules = size_t{1} << 18;

// A set of byte values.
struct ByteSet {
  std::array<uint64_t, 4> words{};

  static ByteSet Single(uint8_t b) {
    ByteSet s;
    s.Add(b);
    return s;
  }
  static ByteSet Range(uint8_t lo, uint8_t hi) {
    ByteSet s;
    s.AddRange(lo, hi);
    return s;
  }
  void Add(uint8_t b) { words[b >> 6] |= uint64_t{1} << (b & 63); }
  void AddRange(uint8_t lo, uint8_t hi) {
    for (int b = lo; b <= hi; ++b) Add(static_cast<uint8_t>(b));
  }
  bool Contains(uint8_t b) const { return (words[b >> 6] >> (b & 63)) & 1; }
  bool empty() const { return (words[0] | words[1] | words[2] | words[3]) == 0; }
  bool operator==(const ByteSet&) const = default;
};

struct GrammarElement {
  enum class Kind : uint8_t { kBytes, kRule };
  Kind kind = Kind::kBytes;
  uint32_t id = 0;  // a byte set of the grammar, or a rule
};
using Sequence = std::vector<GrammarElement>;

// A grammar under construction. Errors (size limits) are sticky: the first
// one is kept and returned by Freeze, so builders need not check each call.
class Grammar {
 public:
  // Restricts the grammar's strings to the characters of `chars`
  // (normalized; nullptr: no restriction, the default). `chars` must outlive
  // the building; call before adding anything.
  void RestrictCharacters(const CodePointSet* chars);
  bool restricted() const { return writable_ != nullptr; }
  bool IsWritable(uint32_t cp) const {
    return writable_ == nullptr || (cp < 0x80 ? writable_ascii_.Contains(static_cast<uint8_t>(cp))
                                              : ContainsCodePoint(*writable_, cp));
  }
  // `set` without the characters outside the restriction (`set` itself when
  // unrestricted). With `note`, an empty result of a non-empty set is noted
  // (below).
  CodePointSet WritableSubset(const CodePointSet& set, bool note = true);
  // An element no byte matches: what an unwritable character becomes.
  GrammarElement Nothing() { return Bytes(ByteSet{}); }
  // The first character the restriction removed where it left an element
  // matching nothing (for "... 'ü' is not in the vocabulary" errors); -1: none.
  int64_t first_unwritable() const { return first_unwritable_; }
  void NoteUnwritable(uint32_t cp) {
    if (first_unwritable_ < 0) first_unwritable_ = cp;
  }

  uint32_t AddRule(std::string name);
  void AddAlternative(uint32_t rule, Sequence sequence);

  // Restricted: ASCII bytes outside the restriction are removed from `set`.
  GrammarElement Bytes(const ByteSet& set);
  GrammarElement Byte(uint8_t b) { return Bytes(ByteSet::Single(b)); }
  static GrammarElement Ref(uint32_t rule) { return {GrammarElement::Kind::kRule, rule}; }
  // One element per byte. Restricted: a character outside the restriction
  // (or invalid UTF-8) becomes Nothing(), so the sequence derives no string.
  Sequence Literal(std::string_view bytes);
  // A new rule whose alternatives are `alternatives`; returns its reference.
  GrammarElement Choice(std::string name, std::vector<Sequence> alternatives);
  // ResourceExhausted (and the grammar's error) when a rule written by the
  // client (an enum, choice, GBNF rule) has more than kMaxRuleAlternatives.
  absl::Status CheckAlternatives(std::string_view name, size_t count);
  // `body` repeated min..max times (max < 0: unbounded) as a sequence to
  // splice into an alternative (helper rules are tail-recursive, so the
  // automaton's stack does not grow with the count).
  Sequence Repeat(std::string_view name, const Sequence& body, int64_t min, int64_t max);

  size_t num_rules() const { return rules_.size(); }
  size_t num_elements() const { return num_elements_; }
  const std::string& rule_name(uint32_t rule) const { return rules_[rule].name; }
  const std::vector<Sequence>& alternatives(uint32_t rule) const { return rules_[rule].alternatives; }
  const std::vector<ByteSet>& byte_sets() const { return byte_sets_; }
  const absl::Status& status() const { return status_; }
  void SetError(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
  }

 private:
  struct Rule {
    std::string name;
    std::vector<Sequence> alternatives;
  };
  std::vector<Rule> rules_;
  std::vector<ByteSet> byte_sets_;
  size_t num_elements_ = 0;
  absl::Status status_;
  const CodePointSet* writable_ = nullptr;
  ByteSet writable_ascii_;
  int64_t first_unwritable_ = -1;
};

// The frozen grammar: all alternatives in one array, each ended by kEnd. A
// "position" is an index into it.
class FlatGrammar {
 public:
  enum class Kind : uint8_t { kBytes, kRule, kEnd };
  struct Element {
    Kind kind;
    uint32_t id;  // byte set or rule; unused for kEnd
  };

  // InvalidArgument: a rule without alternatives that is referenced ("rule
  // 'x' is not defined"), left recursion ("rule 'x' is left-recursive"), or
  // a root that derives no string; ResourceExhausted: the builder's sticky
  // error. `root` must be a rule of `grammar`.
  static absl::StatusOr<FlatGrammar> Freeze(const Grammar& grammar, uint32_t root);

  uint32_t root() const { return root_; }
  const Element& at(uint32_t pos) const { return elements_[pos]; }
  size_t size() const { return elements_.size(); }
  bool Matches(uint32_t pos, uint8_t b) const { return byte_sets_[elements_[pos].id].Contains(b); }
  const ByteSet& byte_set(uint32_t pos) const { return byte_sets_[elements_[pos].id]; }
  // The first positions of the rule's alternatives.
  std::span<const uint32_t> alternative_starts(uint32_t rule) const {
    return {alt_starts_.data() + rule_alt_begin_[rule], alt_starts_.data() + rule_alt_begin_[rule + 1]};
  }
  size_t num_rules() const { return rule_alt_begin_.size() - 1; }
  const std::string& rule_name(uint32_t rule) const { return rule_names_[rule]; }
  // Every position holding a byte set (the positions a stack top can be).
  const std::vector<uint32_t>& terminal_positions() const { return terminals_; }

 private:
  std::vector<Element> elements_;
  std::vector<uint32_t> alt_starts_;
  std::vector<uint32_t> rule_alt_begin_;
  std::vector<std::string> rule_names_;
  std::vector<ByteSet> byte_sets_;
  std::vector<uint32_t> terminals_;
  uint32_t root_ = 0;
};

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_GRAMMAR_H_
