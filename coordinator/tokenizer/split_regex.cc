#include "coordinator/tokenizer/split_regex.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator::internal {
namespace {

// Largest repetition count accepted on a group: each repetition of a group
// costs a few stack frames while matching.
constexpr int kMaxGroupRepetitions = 16;

struct CharItem {
  enum class Kind { kRange, kCategory, kNotCategory, kSpace, kNotSpace };
  Kind kind;
  char32_t lo = 0, hi = 0;
  uint32_t mask = 0;

  bool Matches(char32_t c) const {
    switch (kind) {
      case Kind::kRange: return c >= lo && c <= hi;
      case Kind::kCategory: return (CategoryMask(c) & mask) != 0;
      case Kind::kNotCategory: return (CategoryMask(c) & mask) == 0;
      case Kind::kSpace: return IsWhiteSpace(c);
      case Kind::kNotSpace: return !IsWhiteSpace(c);
    }
    return false;
  }
};

struct CharSet {
  bool negated = false;
  bool ignore_case = false;
  std::vector<CharItem> items;

  bool MatchesRaw(char32_t c) const {
    for (const CharItem& item : items) {
      if (item.Matches(c)) return true;
    }
    return false;
  }
  bool Matches(char32_t c) const {
    bool hit = MatchesRaw(c);
    if (!hit && ignore_case) {
      // Compare case folds: c matches a literal or range if its fold equals
      // the fold of one of the range's members (ranges here are short).
      const char32_t folded = SimpleCaseFold(c);
      for (const CharItem& item : items) {
        if (item.kind != CharItem::Kind::kRange || item.hi - item.lo > 256) continue;
        for (char32_t x = item.lo; x <= item.hi && !hit; ++x) hit = SimpleCaseFold(x) == folded;
        if (hit) break;
      }
    }
    return hit != negated;
  }
};

struct Node {
  enum class Kind { kSet, kGroup, kLookahead };
  Kind kind = Kind::kSet;
  int set = -1;                                   // kSet: index into Program::sets
  std::vector<std::vector<Node>> alternatives;    // kGroup, kLookahead
  bool negative = false;                          // kLookahead: (?!...)
  int min = 1, max = 1;                           // max < 0: unbounded
};

}  // namespace

struct SplitRegex::Program {
  std::vector<CharSet> sets;
  std::vector<std::vector<Node>> top;  // top-level alternatives
};

namespace {

CharItem Range(char32_t lo, char32_t hi) { return {CharItem::Kind::kRange, lo, hi, 0}; }
CharItem Category(uint32_t mask, bool negate) {
  return {negate ? CharItem::Kind::kNotCategory : CharItem::Kind::kCategory, 0, 0, mask};
}

class Parser {
 public:
  Parser(std::vector<char32_t> pattern, SplitRegex::Program* program)
      : p_(std::move(pattern)), program_(program) {}

  absl::Status Parse() {
    EXL3_ASSIGN_OR_RETURN(program_->top, ParseAlternatives(false));
    if (i_ != p_.size()) return Error(absl::StatusCode::kInvalidArgument, "unbalanced `)`");
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::StatusCode code, std::string_view what) const {
    return absl::Status(code, absl::StrCat("regex: ", absl::string_view(what.data(), what.size()),
                                          " at offset ", i_));
  }
  bool AtEnd() const { return i_ >= p_.size(); }
  bool Peek(char32_t c) const { return !AtEnd() && p_[i_] == c; }

  absl::StatusOr<std::vector<std::vector<Node>>> ParseAlternatives(bool icase) {
    std::vector<std::vector<Node>> alts;
    while (true) {
      EXL3_ASSIGN_OR_RETURN(std::vector<Node> seq, ParseSequence(icase));
      alts.push_back(std::move(seq));
      if (!Peek('|')) break;
      ++i_;
    }
    return alts;
  }

  absl::StatusOr<std::vector<Node>> ParseSequence(bool icase) {
    std::vector<Node> seq;
    while (!AtEnd() && !Peek('|') && !Peek(')')) {
      EXL3_ASSIGN_OR_RETURN(Node node, ParseAtom(icase));
      EXL3_RETURN_IF_ERROR(ParseQuantifier(&node));
      seq.push_back(std::move(node));
    }
    return seq;
  }

  Node SetNode(CharSet set) {
    program_->sets.push_back(std::move(set));
    Node n;
    n.kind = Node::Kind::kSet;
    n.set = static_cast<int>(program_->sets.size()) - 1;
    return n;
  }

  absl::StatusOr<Node> ParseAtom(bool icase) {
    const char32_t c = p_[i_];
    if (c == '(') {
      ++i_;
      Node n;
      n.kind = Node::Kind::kGroup;
      bool group_icase = icase;
      if (Peek('?')) {
        ++i_;
        if (Peek(':')) {
          ++i_;
        } else if (Peek('i') && i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
          i_ += 2;
          group_icase = true;
        } else if (Peek('=') || Peek('!')) {
          n.kind = Node::Kind::kLookahead;
          n.negative = Peek('!');
          ++i_;
        } else {
          return Error(absl::StatusCode::kUnimplemented, "unsupported group syntax `(?`");
        }
      }
      EXL3_ASSIGN_OR_RETURN(n.alternatives, ParseAlternatives(group_icase));
      if (!Peek(')')) return Error(absl::StatusCode::kInvalidArgument, "missing `)`");
      ++i_;
      return n;
    }
    if (c == '[') {
      ++i_;
      EXL3_ASSIGN_OR_RETURN(CharSet set, ParseClass(icase));
      return SetNode(std::move(set));
    }
    if (c == '.') {
      ++i_;
      CharSet set;
      set.negated = true;
      set.items.push_back(Range('\n', '\n'));
      return SetNode(std::move(set));
    }
    if (c == '^' || c == '$') {
      return Error(absl::StatusCode::kUnimplemented, "anchors are not supported");
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') {
      return Error(absl::StatusCode::kInvalidArgument, "quantifier without an operand");
    }
    CharSet set;
    set.ignore_case = icase;
    if (c == '\\') {
      ++i_;
      EXL3_RETURN_IF_ERROR(ParseEscape(&set.items));
    } else {
      ++i_;
      set.items.push_back(Range(c, c));
    }
    return SetNode(std::move(set));
  }

  // After a backslash. Appends what the escape matches to `items`.
  absl::Status ParseEscape(std::vector<CharItem>* items) {
    if (AtEnd()) return Error(absl::StatusCode::kInvalidArgument, "trailing backslash");
    const char32_t c = p_[i_++];
    switch (c) {
      case 'r': items->push_back(Range('\r', '\r')); return absl::OkStatus();
      case 'n': items->push_back(Range('\n', '\n')); return absl::OkStatus();
      case 't': items->push_back(Range('\t', '\t')); return absl::OkStatus();
      case 'f': items->push_back(Range('\f', '\f')); return absl::OkStatus();
      case 'v': items->push_back(Range('\v', '\v')); return absl::OkStatus();
      case 's': items->push_back({CharItem::Kind::kSpace}); return absl::OkStatus();
      case 'S': items->push_back({CharItem::Kind::kNotSpace}); return absl::OkStatus();
      case 'd': items->push_back(Category(CategoryMaskForName("Nd"), false)); return absl::OkStatus();
      case 'D': items->push_back(Category(CategoryMaskForName("Nd"), true)); return absl::OkStatus();
      case 'w':
      case 'W': {
        const uint32_t word = CategoryMaskForName("L") | CategoryMaskForName("M") |
                              CategoryMaskForName("N") | CategoryMaskForName("Pc");
        items->push_back(Category(word, c == 'W'));
        return absl::OkStatus();
      }
      case 'p':
      case 'P': {
        if (!Peek('{')) return Error(absl::StatusCode::kUnimplemented, "\\p without braces");
        ++i_;
        std::string name;
        bool negate = c == 'P';
        if (Peek('^')) {
          negate = !negate;
          ++i_;
        }
        while (!AtEnd() && !Peek('}')) AppendUtf8(p_[i_++], &name);
        if (!Peek('}')) return Error(absl::StatusCode::kInvalidArgument, "missing `}` after \\p{");
        ++i_;
        const uint32_t mask = CategoryMaskForName(name);
        if (mask == 0) {
          return Error(absl::StatusCode::kUnimplemented, absl::StrCat("unknown property `", name, "`"));
        }
        items->push_back(Category(mask, negate));
        return absl::OkStatus();
      }
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
          std::string esc = "unsupported escape `\\";
          AppendUtf8(c, &esc);
          return Error(absl::StatusCode::kUnimplemented, esc + "`");
        }
        items->push_back(Range(c, c));  // escaped punctuation stands for itself
        return absl::OkStatus();
    }
  }

  // After `[`; consumes through the closing `]`.
  absl::StatusOr<CharSet> ParseClass(bool icase) {
    CharSet set;
    set.ignore_case = icase;
    if (Peek('^')) {
      set.negated = true;
      ++i_;
    }
    bool first = true;
    while (!AtEnd() && (first || !Peek(']'))) {
      first = false;
      if (Peek('[')) return Error(absl::StatusCode::kUnimplemented, "nested character classes");
      char32_t lo;
      if (Peek('\\')) {
        ++i_;
        std::vector<CharItem> items;
        EXL3_RETURN_IF_ERROR(ParseEscape(&items));
        if (items.size() != 1 || items[0].kind != CharItem::Kind::kRange) {
          set.items.insert(set.items.end(), items.begin(), items.end());
          continue;
        }
        lo = items[0].lo;
      } else {
        lo = p_[i_++];
      }
      char32_t hi = lo;
      if (Peek('-') && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        if (Peek('\\')) {
          ++i_;
          std::vector<CharItem> items;
          EXL3_RETURN_IF_ERROR(ParseEscape(&items));
          if (items.size() != 1 || items[0].kind != CharItem::Kind::kRange) {
            return Error(absl::StatusCode::kInvalidArgument, "bad range end in class");
          }
          hi = items[0].lo;
        } else {
          hi = p_[i_++];
        }
        if (hi < lo) return Error(absl::StatusCode::kInvalidArgument, "reversed range in class");
      }
      set.items.push_back(Range(lo, hi));
    }
    if (!Peek(']')) return Error(absl::StatusCode::kInvalidArgument, "missing `]`");
    ++i_;
    return set;
  }

  bool ParseInt(int* value) {
    size_t start = i_;
    long v = 0;
    while (!AtEnd() && p_[i_] >= '0' && p_[i_] <= '9' && v < 1000000) v = v * 10 + (p_[i_++] - '0');
    *value = static_cast<int>(v);
    return i_ > start;
  }

  absl::Status ParseQuantifier(Node* node) {
    if (AtEnd()) return absl::OkStatus();
    const char32_t c = p_[i_];
    int min, max;
    if (c == '?') {
      min = 0, max = 1;
      ++i_;
    } else if (c == '*') {
      min = 0, max = -1;
      ++i_;
    } else if (c == '+') {
      min = 1, max = -1;
      ++i_;
    } else if (c == '{') {
      const size_t save = i_;
      ++i_;
      if (!ParseInt(&min)) {
        i_ = save;  // a literal `{`, as in Perl; not used by tokenizers
        return Error(absl::StatusCode::kUnimplemented, "literal `{`");
      }
      max = min;
      if (Peek(',')) {
        ++i_;
        if (!ParseInt(&max)) max = -1;
      }
      if (!Peek('}')) return Error(absl::StatusCode::kInvalidArgument, "missing `}` in quantifier");
      ++i_;
      if (max >= 0 && max < min) return Error(absl::StatusCode::kInvalidArgument, "{m,n} with n < m");
    } else {
      return absl::OkStatus();
    }
    if (Peek('?') || Peek('+')) {
      return Error(absl::StatusCode::kUnimplemented, "lazy or possessive quantifiers");
    }
    if (node->kind == Node::Kind::kLookahead) {
      return Error(absl::StatusCode::kUnimplemented, "quantified lookahead");
    }
    if (node->kind == Node::Kind::kGroup && (max < 0 || max > kMaxGroupRepetitions)) {
      return Error(absl::StatusCode::kUnimplemented,
                   absl::StrCat("group repeated more than ", kMaxGroupRepetitions, " times"));
    }
    if (node->min != 1 || node->max != 1) {
      return Error(absl::StatusCode::kInvalidArgument, "nested quantifier");
    }
    node->min = min;
    node->max = max;
    return absl::OkStatus();
  }

  std::vector<char32_t> p_;
  size_t i_ = 0;
  SplitRegex::Program* program_;
};

// What to match after the current node: the rest of a sequence, or another
// iteration of a repeated group.
struct Cont {
  const std::vector<Node>* seq = nullptr;
  size_t idx = 0;
  const Cont* next = nullptr;
  const Node* repeat = nullptr;  // set: we are inside iteration `count` of this group
  int count = 0;
  size_t start = 0;              // where that iteration began
};

class Matcher {
 public:
  Matcher(const SplitRegex::Program& program, const std::vector<char32_t>& text)
      : program_(program), text_(text) {}

  bool MatchAt(size_t pos, size_t* end) const {
    for (const std::vector<Node>& alt : program_.top) {
      if (Seq(alt, 0, pos, nullptr, end)) return true;
    }
    return false;
  }

 private:
  bool Continue(const Cont* k, size_t pos, size_t* end) const {
    if (k == nullptr) {
      *end = pos;
      return true;
    }
    if (k->repeat != nullptr) {
      if (pos == k->start) return Continue(k->next, pos, end);  // empty iteration ends the loop
      return Repeat(*k->repeat, k->count, pos, k->next, end);
    }
    return Seq(*k->seq, k->idx, pos, k->next, end);
  }

  // `count` iterations of group `n` are done and ended at `pos`.
  bool Repeat(const Node& n, int count, size_t pos, const Cont* after, size_t* end) const {
    if (n.max < 0 || count < n.max) {
      Cont again;
      again.next = after;
      again.repeat = &n;
      again.count = count + 1;
      again.start = pos;
      for (const std::vector<Node>& alt : n.alternatives) {
        if (Seq(alt, 0, pos, &again, end)) return true;
      }
    }
    return count >= n.min && Continue(after, pos, end);
  }

  bool Seq(const std::vector<Node>& seq, size_t idx, size_t pos, const Cont* k, size_t* end) const {
    if (idx == seq.size()) return Continue(k, pos, end);
    const Node& n = seq[idx];
    switch (n.kind) {
      case Node::Kind::kSet: {
        const CharSet& set = program_.sets[n.set];
        const size_t left = text_.size() - pos;
        const size_t limit = n.max < 0 ? left : std::min(left, static_cast<size_t>(n.max));
        size_t r = 0;
        while (r < limit && set.Matches(text_[pos + r])) ++r;
        if (r < static_cast<size_t>(n.min)) return false;
        for (;; --r) {  // greedy: longest first, then give back one at a time
          if (Seq(seq, idx + 1, pos + r, k, end)) return true;
          if (r == static_cast<size_t>(n.min)) return false;
        }
      }
      case Node::Kind::kGroup: {
        Cont rest;
        rest.seq = &seq;
        rest.idx = idx + 1;
        rest.next = k;
        return Repeat(n, 0, pos, &rest, end);
      }
      case Node::Kind::kLookahead: {
        bool matched = false;
        size_t ignored;
        for (const std::vector<Node>& alt : n.alternatives) {
          if (Seq(alt, 0, pos, nullptr, &ignored)) {
            matched = true;
            break;
          }
        }
        if (matched == n.negative) return false;
        return Seq(seq, idx + 1, pos, k, end);
      }
    }
    return false;
  }

  const SplitRegex::Program& program_;
  const std::vector<char32_t>& text_;
};

}  // namespace

absl::StatusOr<SplitRegex> SplitRegex::Compile(std::string_view pattern) {
  if (!IsValidUtf8(pattern)) return absl::InvalidArgumentError("regex: pattern is not valid UTF-8");
  auto program = std::make_shared<Program>();
  Parser parser(DecodeUtf8(pattern), program.get());
  EXL3_RETURN_IF_ERROR(parser.Parse());
  return SplitRegex(std::move(program));
}

std::vector<MatchRange> SplitRegex::FindAll(const std::vector<char32_t>& text) const {
  std::vector<MatchRange> matches;
  const Matcher matcher(*program_, text);
  size_t pos = 0;
  while (pos < text.size()) {
    bool found = false;
    for (size_t start = pos; start < text.size(); ++start) {
      size_t end;
      // An empty match is skipped like Oniguruma's iterator does: the search
      // resumes one character later and that character stays unmatched.
      if (matcher.MatchAt(start, &end) && end > start) {
        matches.push_back({start, end});
        pos = end;
        found = true;
        break;
      }
    }
    if (!found) break;
  }
  return matches;
}

bool SplitRegex::MatchAtForTesting(const std::vector<char32_t>& text, size_t pos,
                                   size_t* end) const {
  return Matcher(*program_, text).MatchAt(pos, end);
}

}  // namespace exl3serve::coordinator::internal
