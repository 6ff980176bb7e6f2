// coordinator/constrained/regex_compiler.cc — see regex_compiler.h.
// Pattern -> syntax tree -> Thompson NFA over bytes -> DFA (subset
// construction over byte classes) -> one grammar rule per live DFA state.
#include "coordinator/constrained/regex_compiler.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "coordinator/constrained/utf8_ranges.h"

namespace exl3serve::coordinator::constrained {
namespace {

struct Node {
  enum class Kind { kEmpty, kSet, kConcat, kAlt, kRepeat };
  Kind kind = Kind::kEmpty;
  CodePointSet set;        // kSet
  std::vector<int> kids;   // kConcat, kAlt, kRepeat (one)
  int64_t min = 0, max = 0;  // kRepeat; max < 0 unbounded
};

CodePointSet DigitSet() { return {{'0', '9'}}; }
CodePointSet WordSet() { return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}; }
CodePointSet SpaceSet() {
  return {{'\t', '\r'}, {' ', ' '},       {0xA0, 0xA0},     {0x1680, 0x1680}, {0x2000, 0x200A},
          {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
}
CodePointSet DotSet() {
  return ComplementCodePoints({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}});
}

class Parser {
 public:
  Parser(std::string_view pattern, bool search) : p_(pattern), search_(search) {}

  absl::StatusOr<int> Parse() {
    // Top level: branches with their own anchors.
    std::vector<int> branches;
    while (true) {
      bool start_anchor = false, end_anchor = false;
      if (i_ < p_.size() && p_[i_] == '^') start_anchor = true, ++i_;
      int body = ParseConcat(0, &end_anchor);
      if (!status_.ok()) return status_;
      if (search_) {
        std::vector<int> seq;
        if (!start_anchor) seq.push_back(AnyStar());
        seq.push_back(body);
        if (!end_anchor) seq.push_back(AnyStar());
        body = Add({Node::Kind::kConcat, {}, seq});
      }
      branches.push_back(body);
      if (i_ < p_.size() && p_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    if (i_ < p_.size()) return Error(p_[i_] == ')' ? "unmatched ')'" : "unexpected character");
    return branches.size() == 1 ? branches[0] : Add({Node::Kind::kAlt, {}, branches});
  }

  std::vector<Node>& nodes() { return nodes_; }

 private:
  void Fail(std::string_view what) { (void)Error(what); }
  absl::Status Error(std::string_view what) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat("regex: ", std::string(what), " at offset ", i_));
    }
    return status_;
  }
  int Add(Node n) {
    nodes_.push_back(std::move(n));
    return static_cast<int>(nodes_.size() - 1);
  }
  int Set(CodePointSet s) { return Add({Node::Kind::kSet, std::move(s), {}}); }
  int AnyStar() { return Add({Node::Kind::kRepeat, {}, {Set({{0, kMaxCodePoint}})}, 0, -1}); }

  int ParseAlt(int depth) {
    std::vector<int> branches;
    while (true) {
      branches.push_back(ParseConcat(depth, nullptr));
      if (!status_.ok()) return 0;
      if (i_ < p_.size() && p_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    return branches.size() == 1 ? branches[0] : Add({Node::Kind::kAlt, {}, branches});
  }

  // `end_anchor`: non-null at the top level, where a final `$` is allowed.
  int ParseConcat(int depth, bool* end_anchor) {
    std::vector<int> seq;
    while (i_ < p_.size() && p_[i_] != '|' && p_[i_] != ')') {
      if (p_[i_] == '$') {
        if (end_anchor != nullptr &&
            (i_ + 1 == p_.size() || p_[i_ + 1] == '|')) {
          *end_anchor = true;
          ++i_;
          break;
        }
        Fail("'$' is supported only at the end of the pattern");
        return 0;
      }
      if (p_[i_] == '^') {
        Fail("'^' is supported only at the start of the pattern");
        return 0;
      }
      seq.push_back(ParseRepeat(depth));
      if (!status_.ok()) return 0;
    }
    if (seq.size() == 1) return seq[0];
    return Add({seq.empty() ? Node::Kind::kEmpty : Node::Kind::kConcat, {}, seq});
  }

  bool ParseCount(int64_t* out) {
    size_t start = i_;
    int64_t v = 0;
    while (i_ < p_.size() && p_[i_] >= '0' && p_[i_] <= '9') {
      v = std::min<int64_t>(v * 10 + (p_[i_] - '0'), int64_t{1} << 40);
      ++i_;
    }
    *out = v;
    return i_ > start;
  }

  int ParseRepeat(int depth) {
    const size_t atom_at = i_;
    int atom = ParseAtom(depth);
    if (!status_.ok()) return 0;
    bool quantified = false;
    while (i_ < p_.size()) {
      int64_t min = 0, max = -1;
      const size_t q = i_;
      const char c = p_[i_];
      if (c == '*') {
        ++i_;
      } else if (c == '+') {
        min = 1, ++i_;
      } else if (c == '?') {
        max = 1, ++i_;
      } else if (c == '{') {
        ++i_;
        if (!ParseCount(&min)) {  // not a quantifier: a literal '{' (Annex B)
          i_ = q;
          break;
        }
        max = min;
        if (i_ < p_.size() && p_[i_] == ',') {
          ++i_;
          if (!ParseCount(&max)) max = -1;
        }
        if (i_ >= p_.size() || p_[i_] != '}') {
          i_ = q;
          break;
        }
        ++i_;
        if (min > kMaxRegexRepeat || max > kMaxRegexRepeat) {
          i_ = q;
          Fail(absl::StrCat("repetition count above ", kMaxRegexRepeat, " (kMaxRegexRepeat)"));
          return 0;
        }
        if (max >= 0 && max < min) {
          i_ = q;
          Fail("repetition {m,n} with n < m");
          return 0;
        }
      } else {
        break;
      }
      if (quantified) {
        i_ = q;
        Fail("nothing to repeat (a quantifier after a quantifier)");
        return 0;
      }
      quantified = true;
      if (i_ < p_.size() && p_[i_] == '?') ++i_;  // lazy: same language
      atom = Add({Node::Kind::kRepeat, {}, {atom}, min, max});
    }
    (void)atom_at;
    return atom;
  }

  bool Hex(size_t digits, uint32_t* out) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (i_ >= p_.size() || !std::isxdigit(static_cast<unsigned char>(p_[i_]))) return false;
      const char c = p_[i_++];
      v = v * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    *out = v;
    return true;
  }

  // After the backslash. Sets *set for class escapes, else *cp.
  bool ParseEscape(CodePointSet* set, uint32_t* cp, bool in_class) {
    if (i_ >= p_.size()) {
      Fail("pattern ends with a backslash");
      return false;
    }
    const size_t at = i_ - 1;
    const char c = p_[i_++];
    switch (c) {
      case 'd': *set = DigitSet(); return true;
      case 'D': *set = ComplementCodePoints(DigitSet()); return true;
      case 'w': *set = WordSet(); return true;
      case 'W': *set = ComplementCodePoints(WordSet()); return true;
      case 's': *set = SpaceSet(); return true;
      case 'S': *set = ComplementCodePoints(SpaceSet()); return true;
      case 'n': *cp = '\n'; return true;
      case 't': *cp = '\t'; return true;
      case 'r': *cp = '\r'; return true;
      case 'f': *cp = '\f'; return true;
      case 'v': *cp = '\v'; return true;
      case '0': *cp = 0; return true;
      case 'x':
        if (!Hex(2, cp)) {
          i_ = at;
          Fail("\\x needs two hex digits");
          return false;
        }
        return true;
      case 'u':
        if (i_ < p_.size() && p_[i_] == '{') {
          ++i_;
          uint32_t v = 0;
          size_t n = 0;
          while (i_ < p_.size() && std::isxdigit(static_cast<unsigned char>(p_[i_])) && n < 8) {
            uint32_t d = 0;
            Hex(1, &d);
            v = v * 16 + d, ++n;
          }
          if (n == 0 || i_ >= p_.size() || p_[i_] != '}' || v > kMaxCodePoint) {
            i_ = at;
            Fail("malformed \\u{...}");
            return false;
          }
          ++i_;
          *cp = v;
          return true;
        }
        if (!Hex(4, cp)) {
          i_ = at;
          Fail("\\u needs four hex digits");
          return false;
        }
        return true;
      case 'b':
        if (in_class) {
          *cp = '\b';
          return true;
        }
        i_ = at;
        Fail("word boundary \\b is not supported");
        return false;
      case 'B':
        i_ = at;
        Fail("word boundary \\B is not supported");
        return false;
      case 'k':
        i_ = at;
        Fail("backreference \\k is not supported");
        return false;
      default:
        break;
    }
    if (c >= '1' && c <= '9') {
      i_ = at;
      Fail("backreference is not supported");
      return false;
    }
    if (std::isalnum(static_cast<unsigned char>(c))) {
      i_ = at;
      Fail(absl::StrCat("unknown escape \\", std::string(1, c)));
      return false;
    }
    // Escaped punctuation (or any other character): itself.
    --i_;
    return DecodeLiteral(cp);
  }

  bool DecodeLiteral(uint32_t* cp) {
    if (!DecodeUtf8(p_, &i_, cp)) {
      Fail("invalid UTF-8 in pattern");
      return false;
    }
    return true;
  }

  int ParseClass() {
    ++i_;  // '['
    bool negate = false;
    if (i_ < p_.size() && p_[i_] == '^') negate = true, ++i_;
    CodePointSet set;
    while (true) {
      if (i_ >= p_.size()) {
        Fail("unterminated character class");
        return 0;
      }
      if (p_[i_] == ']') {
        ++i_;
        break;
      }
      CodePointSet esc_set;
      uint32_t lo;
      if (!ClassAtom(&esc_set, &lo)) return 0;
      if (!esc_set.empty()) {
        set.insert(set.end(), esc_set.begin(), esc_set.end());
        continue;
      }
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        const size_t dash = i_;
        ++i_;
        CodePointSet hi_set;
        uint32_t hi;
        if (!ClassAtom(&hi_set, &hi)) return 0;
        if (!hi_set.empty()) {
          i_ = dash;
          Fail("a class escape cannot end a range");
          return 0;
        }
        if (hi < lo) {
          i_ = dash;
          Fail("character class range out of order");
          return 0;
        }
        set.push_back({lo, hi});
      } else {
        set.push_back({lo, lo});
      }
    }
    return Set(negate ? ComplementCodePoints(set) : NormalizeCodePoints(set));
  }

  bool ClassAtom(CodePointSet* set, uint32_t* cp) {
    if (p_[i_] == '\\') {
      ++i_;
      return ParseEscape(set, cp, /*in_class=*/true);
    }
    if (p_[i_] == '[' && i_ + 1 < p_.size() && (p_[i_ + 1] == ':' || p_[i_ + 1] == '=')) {
      Fail("POSIX classes [:...:] are not supported");
      return false;
    }
    return DecodeLiteral(cp);
  }

  int ParseAtom(int depth) {
    if (depth >= kMaxRegexNesting) {
      Fail(absl::StrCat("groups nested deeper than ", kMaxRegexNesting, " (kMaxRegexNesting)"));
      return 0;
    }
    const char c = p_[i_];
    switch (c) {
      case '(': {
        const size_t open = i_++;
        if (i_ < p_.size() && p_[i_] == '?') {
          const std::string_view rest = p_.substr(i_);
          if (rest.starts_with("?:")) {
            i_ += 2;
          } else if (rest.starts_with("?=") || rest.starts_with("?!") || rest.starts_with("?<=") ||
                     rest.starts_with("?<!")) {
            i_ = open;
            Fail("lookaround is not supported");
            return 0;
          } else if (rest.starts_with("?<") || rest.starts_with("?P<")) {
            const size_t close = p_.find('>', i_);
            if (close == std::string_view::npos) {
              Fail("unterminated group name");
              return 0;
            }
            i_ = close + 1;
          } else {
            i_ = open;
            Fail("inline flags and other (?...) groups are not supported");
            return 0;
          }
        }
        const int inner = ParseAlt(depth + 1);
        if (!status_.ok()) return 0;
        if (i_ >= p_.size() || p_[i_] != ')') {
          i_ = open;
          Fail("unterminated group '('");
          return 0;
        }
        ++i_;
        return inner;
      }
      case '[':
        return ParseClass();
      case '.':
        ++i_;
        return Set(DotSet());
      case '*':
      case '+':
      case '?':
        Fail("nothing to repeat");
        return 0;
      case '\\': {
        ++i_;
        CodePointSet set;
        uint32_t cp;
        if (!ParseEscape(&set, &cp, /*in_class=*/false)) return 0;
        return Set(set.empty() ? CodePointSet{{cp, cp}} : set);
      }
      default: {
        uint32_t cp;
        if (!DecodeLiteral(&cp)) return 0;
        return Set({{cp, cp}});
      }
    }
  }

  std::string_view p_;
  bool search_;
  size_t i_ = 0;
  std::vector<Node> nodes_;
  absl::Status status_;
};

// Thompson NFA over bytes.
class NfaBuilder {
 public:
  struct Edge {
    uint8_t lo, hi;
    uint32_t to;
  };
  // `restrict_to`: the grammar whose character restriction applies (nullptr:
  // none); its WritableSubset notes what it removes.
  NfaBuilder(const std::vector<Node>& nodes, bool json_escape, Grammar* restrict_to)
      : nodes_(nodes), json_escape_(json_escape), restrict_(restrict_to) {}

  uint32_t NewState() {
    if (eps_.size() >= kMaxRegexNfaStates) overflow_ = true;
    eps_.emplace_back();
    edges_.emplace_back();
    return static_cast<uint32_t>(eps_.size() - 1);
  }
  bool overflow() const { return overflow_; }

  // Builds `node` between fresh states; returns {start, end}.
  std::pair<uint32_t, uint32_t> Build(int index) {
    const uint32_t s = NewState(), e = NewState();
    if (overflow_) return {s, e};
    BuildInto(index, s, e);
    return {s, e};
  }

  std::vector<std::vector<uint32_t>> eps_;
  std::vector<std::vector<Edge>> edges_;

 private:
  void Path(uint32_t s, uint32_t e, const std::vector<std::pair<uint8_t, uint8_t>>& bytes) {
    uint32_t at = s;
    for (size_t k = 0; k < bytes.size(); ++k) {
      const uint32_t to = k + 1 == bytes.size() ? e : NewState();
      edges_[at].push_back({bytes[k].first, bytes[k].second, to});
      at = to;
    }
  }

  void BuildInto(int index, uint32_t s, uint32_t e) {
    if (overflow_) return;
    const Node& n = nodes_[index];
    switch (n.kind) {
      case Node::Kind::kEmpty:
        eps_[s].push_back(e);
        return;
      case Node::Kind::kSet: {
        CodePointSet plain = n.set;
        bool escape_paths = false;
        if (json_escape_) {
          // Characters JSON escapes get their canonical escape.
          CodePointSet escaped = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
          CodePointSet keep;
          for (auto [lo, hi] : NormalizeCodePoints(n.set)) {
            for (uint32_t cp = lo; cp <= std::min<uint32_t>(hi, 0x5C); ++cp) {
              if (cp < 0x20 || cp == '"' || cp == '\\') {
                std::string esc = EscapeForJson(cp);
                if (!Writable(esc)) continue;
                escape_paths = true;
                std::vector<std::pair<uint8_t, uint8_t>> bytes;
                for (char ch : esc) bytes.push_back({static_cast<uint8_t>(ch), static_cast<uint8_t>(ch)});
                Path(s, e, bytes);
              }
            }
          }
          plain = NormalizeCodePoints(plain);
          CodePointSet filtered;
          const CodePointSet allowed = ComplementCodePoints(escaped);
          for (auto [lo, hi] : plain) {
            for (auto [alo, ahi] : allowed) {
              const uint32_t a = std::max(lo, alo), b = std::min(hi, ahi);
              if (a <= b) filtered.push_back({a, b});
            }
          }
          plain = std::move(filtered);
        }
        if (restrict_ != nullptr) {
          plain = restrict_->WritableSubset(plain, /*note=*/false);
          const CodePointSet all = NormalizeCodePoints(n.set);
          if (plain.empty() && !escape_paths && !all.empty()) restrict_->NoteUnwritable(all.front().first);
        }
        for (const Utf8Sequence& seq : Utf8Sequences(plain)) Path(s, e, seq);
        return;
      }
      case Node::Kind::kConcat: {
        uint32_t at = s;
        for (size_t k = 0; k < n.kids.size(); ++k) {
          const uint32_t to = k + 1 == n.kids.size() ? e : NewState();
          BuildInto(n.kids[k], at, to);
          at = to;
        }
        return;
      }
      case Node::Kind::kAlt:
        for (int kid : n.kids) BuildInto(kid, s, e);
        return;
      case Node::Kind::kRepeat: {
        uint32_t at = s;
        for (int64_t k = 0; k < n.min && !overflow_; ++k) {
          const uint32_t to = NewState();
          BuildInto(n.kids[0], at, to);
          at = to;
        }
        if (n.max < 0) {
          const uint32_t loop = NewState();
          eps_[at].push_back(loop);
          const uint32_t back = NewState();
          BuildInto(n.kids[0], loop, back);
          eps_[back].push_back(loop);
          eps_[loop].push_back(e);
        } else {
          eps_[at].push_back(e);
          for (int64_t k = n.min; k < n.max && !overflow_; ++k) {
            const uint32_t to = NewState();
            BuildInto(n.kids[0], at, to);
            eps_[to].push_back(e);
            at = to;
          }
        }
        return;
      }
    }
  }

  static std::string EscapeForJson(uint32_t cp) {
    switch (cp) {
      case '"': return "\\\"";
      case '\\': return "\\\\";
      case '\n': return "\\n";
      case '\t': return "\\t";
      case '\r': return "\\r";
      case '\b': return "\\b";
      case '\f': return "\\f";
      default: {
        static const char kHex[] = "0123456789abcdef";
        return std::string("\\u00") + kHex[cp >> 4] + kHex[cp & 15];
      }
    }
  }

  // An escape (ASCII) is writable when each of its characters is.
  bool Writable(const std::string& ascii) {
    if (restrict_ == nullptr) return true;
    for (char ch : ascii) {
      if (!restrict_->IsWritable(static_cast<uint8_t>(ch))) return false;
    }
    return true;
  }

  const std::vector<Node>& nodes_;
  bool json_escape_;
  Grammar* restrict_;
  bool overflow_ = false;
};

}  // namespace

namespace {

// The automaton of a parsed pattern, emitted as rules of `grammar` when
// `emit` (else only checked). `restrict`: apply the grammar's character
// restriction. Sets *matches_nothing (and adds no rule) when no string
// matches.
absl::StatusOr<uint32_t> CompileParsed(const std::vector<Node>& nodes, int root, const RegexOptions& options,
                                       Grammar& grammar, std::string_view name, bool restrict, bool emit,
                                       bool* matches_nothing) {
  *matches_nothing = false;
  NfaBuilder nfa(nodes, options.json_string_content, restrict ? &grammar : nullptr);
  const std::pair<uint32_t, uint32_t> ends = nfa.Build(root);
  const uint32_t start = ends.first, accept = ends.second;
  if (nfa.overflow()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "regex '", std::string(name), "': automaton exceeds ", kMaxRegexNfaStates, " NFA states (kMaxRegexNfaStates)"));
  }
  // Byte classes: bytes no edge tells apart.
  std::array<int, 257> cut{};
  for (const auto& edges : nfa.edges_) {
    for (const auto& ed : edges) cut[ed.lo] = 1, cut[ed.hi + 1] = 1;
  }
  // Length limits: a character counter (tracking JSON escapes and UTF-8
  // continuation bytes) runs alongside the subset construction.
  const bool counting = options.min_code_points > 0 || options.max_code_points >= 0;
  const bool escapes = options.json_string_content;
  if (counting) {
    for (int b : {0x80, 0xC0, int{'\\'}, int{'\\'} + 1, int{'u'}, int{'u'} + 1}) cut[b] = 1;
  }
  // Counter phase: 0 between characters, 1 after a '\\' (JSON escape),
  // 2..5 inside \uXXXX (hex digits left: 6 - phase).
  auto step_counter = [&](int phase, uint8_t b, bool* starts_char) {
    *starts_char = false;
    if (phase == 0) {
      if (b >= 0x80 && b < 0xC0) return 0;
      *starts_char = true;
      return escapes && b == '\\' ? 1 : 0;
    }
    if (phase == 1) return b == 'u' ? 2 : 0;
    return phase == 5 ? 0 : phase + 1;
  };
  std::array<int, 256> byte_class{};
  std::vector<uint8_t> class_rep;
  for (int b = 0, c = -1; b < 256; ++b) {
    if (b == 0 || cut[b]) class_rep.push_back(static_cast<uint8_t>(b)), ++c;
    byte_class[b] = c;
  }
  const size_t num_classes = class_rep.size();
  // Subset construction.
  std::vector<uint32_t> mark(nfa.eps_.size(), 0);
  uint32_t stamp = 0;
  auto closure = [&](std::vector<uint32_t> set) {
    ++stamp;
    std::vector<uint32_t> out;
    while (!set.empty()) {
      const uint32_t s = set.back();
      set.pop_back();
      if (mark[s] == stamp) continue;
      mark[s] = stamp;
      out.push_back(s);
      for (uint32_t t : nfa.eps_[s]) set.push_back(t);
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  absl::flat_hash_map<std::vector<uint32_t>, int32_t> ids;
  std::vector<std::vector<uint32_t>> states;
  std::vector<std::vector<int32_t>> next;  // [state][class]
  std::vector<char> accepting;
  // A DFA state: the NFA set, and with length limits the characters so far
  // (capped at the minimum when there is no maximum) and the counter phase.
  std::vector<std::pair<int64_t, int>> counters;
  auto intern = [&](std::vector<uint32_t> set, int64_t count, int phase) -> int32_t {
    std::vector<uint32_t> key = set;
    if (counting) key.push_back(static_cast<uint32_t>(count)), key.push_back(static_cast<uint32_t>(phase));
    auto [it, inserted] = ids.try_emplace(std::move(key), static_cast<int32_t>(states.size()));
    if (inserted) {
      accepting.push_back(std::binary_search(set.begin(), set.end(), accept) &&
                          (!counting || (phase == 0 && count >= options.min_code_points)));
      states.push_back(std::move(set));
      counters.push_back({count, phase});
    }
    return it->second;
  };
  intern(closure({start}), 0, 0);
  for (size_t d = 0; d < states.size(); ++d) {
    if (states.size() > kMaxRegexDfaStates) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "regex '", std::string(name), "': automaton exceeds ", kMaxRegexDfaStates, " DFA states (kMaxRegexDfaStates)"));
    }
    std::vector<int32_t> row(num_classes, -1);
    for (size_t c = 0; c < num_classes; ++c) {
      const uint8_t b = class_rep[c];
      std::vector<uint32_t> targets;
      for (uint32_t s : states[d]) {
        for (const auto& ed : nfa.edges_[s]) {
          if (ed.lo <= b && b <= ed.hi) targets.push_back(ed.to);
        }
      }
      if (targets.empty()) continue;
      int64_t count = counters[d].first;
      int phase = counters[d].second;
      if (counting) {
        bool starts_char = false;
        phase = step_counter(phase, b, &starts_char);
        if (starts_char) {
          ++count;
          if (options.max_code_points >= 0 && count > options.max_code_points) continue;
          if (options.max_code_points < 0) count = std::min(count, options.min_code_points);
        }
      }
      row[c] = intern(closure(std::move(targets)), count, phase);
    }
    next.push_back(std::move(row));
  }
  // Live states: an accepting state is reachable from them.
  const size_t n = states.size();
  std::vector<char> live(accepting.begin(), accepting.end());
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t d = 0; d < n; ++d) {
      if (live[d]) continue;
      for (int32_t t : next[d]) {
        if (t >= 0 && live[t]) {
          live[d] = 1, changed = true;
          break;
        }
      }
    }
  }
  if (!live[0]) {
    *matches_nothing = true;
    return 0;
  }
  if (!emit) return 0;
  std::vector<uint32_t> rule(n, 0);
  for (size_t d = 0; d < n; ++d) {
    if (live[d]) rule[d] = grammar.AddRule(absl::StrCat(std::string(name), "#", d));
  }
  for (size_t d = 0; d < n; ++d) {
    if (!live[d]) continue;
    // One alternative per target state: [bytes] target.
    std::vector<std::pair<int32_t, ByteSet>> by_target;
    for (int b = 0; b < 256; ++b) {
      const int32_t t = next[d][byte_class[b]];
      if (t < 0 || !live[t]) continue;
      auto it = std::find_if(by_target.begin(), by_target.end(), [&](const auto& p) { return p.first == t; });
      if (it == by_target.end()) {
        by_target.push_back({t, {}});
        it = by_target.end() - 1;
      }
      it->second.Add(static_cast<uint8_t>(b));
    }
    for (const auto& [t, set] : by_target) {
      grammar.AddAlternative(rule[d], {grammar.Bytes(set), Grammar::Ref(rule[t])});
    }
    if (accepting[d]) grammar.AddAlternative(rule[d], {});
  }
  return rule[0];
}

}  // namespace

absl::StatusOr<uint32_t> CompileRegex(std::string_view pattern, const RegexOptions& options,
                                      Grammar& grammar, std::string_view name) {
  Parser parser(pattern, options.search);
  absl::StatusOr<int> root = parser.Parse();
  if (!root.ok()) return root.status();
  bool nothing = false;
  absl::StatusOr<uint32_t> rule = CompileParsed(parser.nodes(), *root, options, grammar, name,
                                                grammar.restricted(), /*emit=*/true, &nothing);
  if (!rule.ok() || !nothing) return rule;
  if (grammar.restricted()) {
    // Matches exist, only none the vocabulary can write: a rule deriving
    // nothing, which Freeze drops (or reports as the vocabulary's fault).
    bool nothing_at_all = false;
    absl::StatusOr<uint32_t> check = CompileParsed(parser.nodes(), *root, options, grammar, name,
                                                   /*restrict=*/false, /*emit=*/false, &nothing_at_all);
    if (!check.ok()) return check.status();
    if (!nothing_at_all) {
      const uint32_t r = grammar.AddRule(absl::StrCat(std::string(name), "#unwritable"));
      grammar.AddAlternative(r, {grammar.Nothing()});
      return r;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("regex '", std::string(name), "' matches no string"));
}

}  // namespace exl3serve::coordinator::constrained
