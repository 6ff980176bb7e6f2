// coordinator/constrained/gbnf_parser.cc — see gbnf_parser.h.
#include "coordinator/constrained/gbnf_parser.h"

#include <cctype>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "coordinator/constrained/utf8_ranges.h"

namespace exl3serve::coordinator::constrained {
namespace {

bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

class GbnfParser {
 public:
  GbnfParser(std::string_view text, Grammar& g) : t_(text), g_(g) {}

  absl::StatusOr<uint32_t> Parse() {
    SkipSpace();
    if (i_ >= t_.size()) return Error("empty grammar (no rules)");
    while (i_ < t_.size()) {
      const size_t name_at = i_;
      const std::string name = ParseName();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (!t_.substr(i_).starts_with("::=")) return Error(absl::StrCat("expected '::=' after '", name, "'"));
      i_ += 3;
      const uint32_t rule = RuleId(name);
      if (defined_[rule]) {
        i_ = name_at;
        return Error(absl::StrCat("rule '", name, "' is defined twice"));
      }
      defined_[rule] = 1;
      std::vector<Sequence> alts = ParseAlternatives(0, /*top=*/true);
      if (!status_.ok()) return status_;
      (void)g_.CheckAlternatives("GBNF rule", alts.size());
      for (Sequence& alt : alts) g_.AddAlternative(rule, std::move(alt));
      SkipSpace();
    }
    for (const auto& [rule, at] : first_use_) {
      if (!defined_[rule]) {
        i_ = at;
        return Error(absl::StrCat("rule '", g_.rule_name(rule), "' is not defined"));
      }
    }
    auto root = names_.find("root");
    if (root == names_.end() || !defined_[root->second]) {
      return absl::InvalidArgumentError("no rule 'root' (the start rule)");
    }
    return root->second;
  }

 private:
  void Fail(std::string_view what) { (void)Error(what); }
  absl::Status Error(std::string_view what) {
    if (status_.ok()) {
      size_t line = 1, col = 1;
      for (size_t k = 0; k < i_ && k < t_.size(); ++k) {
        if (t_[k] == '\n') {
          ++line, col = 1;
        } else {
          ++col;
        }
      }
      status_ = absl::InvalidArgumentError(absl::StrCat(std::string(what), " at ", line, ":", col));
    }
    return status_;
  }

  uint32_t RuleId(const std::string& name) {
    auto [it, inserted] = names_.try_emplace(name, 0);
    if (inserted) {
      it->second = g_.AddRule(name);
      defined_.resize(g_.num_rules(), 0);
    }
    return it->second;
  }

  void SkipSpace() {
    while (i_ < t_.size()) {
      if (std::isspace(static_cast<unsigned char>(t_[i_]))) {
        ++i_;
      } else if (t_[i_] == '#') {
        while (i_ < t_.size() && t_[i_] != '\n') ++i_;
      } else {
        break;
      }
    }
  }

  std::string ParseName() {
    const size_t start = i_;
    while (i_ < t_.size() && IsNameChar(t_[i_])) ++i_;
    return std::string(t_.substr(start, i_ - start));
  }

  // At a rule name followed by "::=" (the next rule starts).
  bool AtRuleStart() {
    size_t k = i_;
    while (k < t_.size() && IsNameChar(t_[k])) ++k;
    if (k == i_) return false;
    while (k < t_.size() && (t_[k] == ' ' || t_[k] == '\t' || t_[k] == '\n' || t_[k] == '\r')) ++k;
    return t_.substr(k).starts_with("::=");
  }

  std::vector<Sequence> ParseAlternatives(int depth, bool top) {
    std::vector<Sequence> alts;
    alts.push_back(ParseSequence(depth, top));
    while (status_.ok() && i_ < t_.size() && t_[i_] == '|') {
      ++i_;
      alts.push_back(ParseSequence(depth, top));
    }
    return alts;
  }

  Sequence ParseSequence(int depth, bool top) {
    Sequence seq;
    while (status_.ok()) {
      SkipSpace();
      if (i_ >= t_.size() || t_[i_] == '|' || t_[i_] == ')') break;
      if (top && AtRuleStart()) break;
      Sequence term = ParseTerm(depth);
      if (!status_.ok()) break;
      ParsePostfix(term);
      seq.insert(seq.end(), term.begin(), term.end());
    }
    return seq;
  }

  bool ParseInt(int64_t* v) {
    const size_t start = i_;
    *v = 0;
    while (i_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[i_]))) {
      *v = std::min<int64_t>(*v * 10 + (t_[i_] - '0'), int64_t{1} << 40);
      ++i_;
    }
    return i_ > start;
  }

  void ParsePostfix(Sequence& term) {
    while (status_.ok() && i_ < t_.size()) {
      int64_t min = 0, max = -1;
      const size_t at = i_;
      const char c = t_[i_];
      if (c == '*') {
        ++i_;
      } else if (c == '+') {
        min = 1, ++i_;
      } else if (c == '?') {
        max = 1, ++i_;
      } else if (c == '{') {
        ++i_;
        SkipSpace();
        if (!ParseInt(&min)) {
          Fail("expected a count after '{'");
          return;
        }
        SkipSpace();
        max = min;
        if (i_ < t_.size() && t_[i_] == ',') {
          ++i_;
          SkipSpace();
          if (!ParseInt(&max)) max = -1;
          SkipSpace();
        }
        if (i_ >= t_.size() || t_[i_] != '}') {
          Fail("expected '}' after a repetition count");
          return;
        }
        ++i_;
        if (min > kMaxGbnfRepeat || max > kMaxGbnfRepeat) {
          i_ = at;
          Fail(absl::StrCat("repetition count above ", kMaxGbnfRepeat, " (kMaxGbnfRepeat)"));
          return;
        }
        if (max >= 0 && max < min) {
          i_ = at;
          Fail("repetition {m,n} with n < m");
          return;
        }
      } else {
        return;
      }
      term = g_.Repeat(absl::StrCat("rep@", at), term, min, max);
    }
  }

  bool Hex(int digits, uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      if (i_ >= t_.size() || !std::isxdigit(static_cast<unsigned char>(t_[i_]))) return false;
      const char c = t_[i_++];
      v = v * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    *out = v;
    return true;
  }

  // One character of a literal or class (after any backslash handling).
  bool ParseChar(uint32_t* cp) {
    if (i_ >= t_.size()) {
      Fail("unexpected end inside a literal or class");
      return false;
    }
    if (t_[i_] != '\\') {
      if (!DecodeUtf8(t_, &i_, cp)) {
        Fail("invalid UTF-8");
        return false;
      }
      return true;
    }
    const size_t at = i_++;
    if (i_ >= t_.size()) {
      Fail("grammar ends with a backslash");
      return false;
    }
    const char c = t_[i_++];
    switch (c) {
      case 'n': *cp = '\n'; return true;
      case 't': *cp = '\t'; return true;
      case 'r': *cp = '\r'; return true;
      case 'x':
      case 'u':
      case 'U':
        if (!Hex(c == 'x' ? 2 : c == 'u' ? 4 : 8, cp) || *cp > kMaxCodePoint ||
            (*cp >= 0xD800 && *cp <= 0xDFFF)) {
          i_ = at;
          Fail(absl::StrCat("malformed \\", std::string(1, c), " escape"));
          return false;
        }
        return true;
      case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/':
        *cp = static_cast<uint8_t>(c);
        return true;
      default:
        i_ = at;
        Fail(absl::StrCat("unknown escape \\", std::string(1, c)));
        return false;
    }
  }

  Sequence SetSequence(const CodePointSet& set) {
    CodePointSet norm = NormalizeCodePoints(set);
    if (g_.restricted() && !norm.empty()) {
      // Only the characters the vocabulary can write; none: a dead element
      // (Freeze drops its alternative).
      norm = g_.WritableSubset(norm);
      if (norm.empty()) return {g_.Nothing()};
    }
    if (!norm.empty() && norm.back().second < 0x80) {
      ByteSet bs;
      for (auto [lo, hi] : norm) bs.AddRange(static_cast<uint8_t>(lo), static_cast<uint8_t>(hi));
      return {g_.Bytes(bs)};
    }
    std::vector<Sequence> alts;
    for (const Utf8Sequence& u : Utf8Sequences(norm)) {
      Sequence s;
      for (auto [lo, hi] : u) s.push_back(g_.Bytes(ByteSet::Range(lo, hi)));
      alts.push_back(std::move(s));
    }
    if (alts.empty()) {
      Fail("character class matches nothing");
      return {};
    }
    return {g_.Choice(absl::StrCat("class@", i_), std::move(alts))};
  }

  Sequence ParseTerm(int depth) {
    if (depth >= kMaxGbnfNesting) {
      Fail(absl::StrCat("groups nested deeper than ", kMaxGbnfNesting, " (kMaxGbnfNesting)"));
      return {};
    }
    const char c = t_[i_];
    if (c == '"') {
      ++i_;
      std::string bytes;
      while (true) {
        if (i_ >= t_.size()) {
          Fail("unterminated literal");
          return {};
        }
        if (t_[i_] == '"') {
          ++i_;
          break;
        }
        uint32_t cp;
        if (!ParseChar(&cp)) return {};
        AppendUtf8(cp, bytes);
      }
      return g_.Literal(bytes);
    }
    if (c == '[') {
      const size_t open = i_++;
      bool negate = false;
      if (i_ < t_.size() && t_[i_] == '^') negate = true, ++i_;
      CodePointSet set;
      while (true) {
        if (i_ >= t_.size()) {
          i_ = open;
          Fail("unterminated character class");
          return {};
        }
        if (t_[i_] == ']') {
          ++i_;
          break;
        }
        uint32_t lo, hi;
        if (!ParseChar(&lo)) return {};
        hi = lo;
        if (i_ + 1 < t_.size() && t_[i_] == '-' && t_[i_ + 1] != ']') {
          ++i_;
          if (!ParseChar(&hi)) return {};
          if (hi < lo) {
            Fail("character class range out of order");
            return {};
          }
        }
        set.push_back({lo, hi});
      }
      return SetSequence(negate ? ComplementCodePoints(set) : set);
    }
    if (c == '.') {
      ++i_;
      return SetSequence({{0, kMaxCodePoint}});
    }
    if (c == '(') {
      const size_t open = i_++;
      std::vector<Sequence> alts = ParseAlternatives(depth + 1, /*top=*/false);
      if (!status_.ok()) return {};
      SkipSpace();
      if (i_ >= t_.size() || t_[i_] != ')') {
        i_ = open;
        Fail("unterminated group '('");
        return {};
      }
      ++i_;
      if (alts.size() == 1) return alts[0];
      return {g_.Choice(absl::StrCat("group@", open), std::move(alts))};
    }
    if (IsNameChar(c)) {
      const size_t at = i_;
      const uint32_t rule = RuleId(ParseName());
      first_use_.try_emplace(rule, at);
      return {Grammar::Ref(rule)};
    }
    Fail(absl::StrCat("unexpected character '", std::string(1, c), "'"));
    return {};
  }

  std::string_view t_;
  Grammar& g_;
  size_t i_ = 0;
  absl::Status status_;
  absl::flat_hash_map<std::string, uint32_t> names_;
  absl::flat_hash_map<uint32_t, size_t> first_use_;
  std::vector<char> defined_;
};

}  // namespace

absl::StatusOr<uint32_t> ParseGbnf(std::string_view text, Grammar& grammar) {
  GbnfParser parser(text, grammar);
  return parser.Parse();
}

}  // namespace exl3serve::coordinator::constrained
