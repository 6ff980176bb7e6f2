// Property test of the masker on random regexes: a token is allowed iff
// its bytes extend the output to a live prefix, where "live" comes from an
// independent oracle — Brzozowski derivatives over the test's own syntax
// tree (the compiler only sees the printed pattern), itself checked
// against std::regex (ECMAScript) on full strings. Tokens are 1-4 random
// bytes over the alphabet, including split multi-byte UTF-8 characters.
// Also: EOS iff the output is a full match; rollback restores exact masks.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "gtest/gtest.h"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using test_util::Bit;

// ---- the oracle: regexes over bytes, derivatives ----------------------------
// Nodes are hash-consed and alternations kept as sorted, duplicate-free
// lists (Brzozowski: the derivatives are then finitely many).
struct Re;
using ReP = std::shared_ptr<const Re>;
struct Re {
  enum K { kNone, kEps, kBytes, kCat, kAlt, kStar } k;
  std::string bytes;  // kBytes: the set of bytes
  ReP a, b;
  int id = 0;
};
std::map<std::string, ReP>& Table() {
  static std::map<std::string, ReP> t;
  return t;
}
ReP Intern(Re::K k, std::string bytes, ReP a, ReP b) {
  const std::string key = std::to_string(k) + ":" + bytes + ":" + std::to_string(a ? a->id : -1) + ":" +
                          std::to_string(b ? b->id : -1);
  auto it = Table().find(key);
  if (it != Table().end()) return it->second;
  auto r = std::make_shared<Re>(Re{k, std::move(bytes), std::move(a), std::move(b), static_cast<int>(Table().size()) + 1});
  Table()[key] = r;
  return r;
}
ReP None() { return Intern(Re::kNone, "", nullptr, nullptr); }
ReP Eps() { return Intern(Re::kEps, "", nullptr, nullptr); }
ReP Bytes(std::string set) { return Intern(Re::kBytes, std::move(set), nullptr, nullptr); }
ReP Cat(ReP a, ReP b) {
  if (a->k == Re::kNone || b->k == Re::kNone) return None();
  if (a->k == Re::kEps) return b;
  if (b->k == Re::kEps) return a;
  return Intern(Re::kCat, "", a, b);
}
void Operands(const ReP& r, std::vector<ReP>& out) {
  if (r->k == Re::kAlt) {
    Operands(r->a, out);
    Operands(r->b, out);
  } else if (r->k != Re::kNone) {
    out.push_back(r);
  }
}
ReP Alt(ReP a, ReP b) {
  std::vector<ReP> ops;
  Operands(a, ops);
  Operands(b, ops);
  std::sort(ops.begin(), ops.end(), [](const ReP& x, const ReP& y) { return x->id < y->id; });
  ops.erase(std::unique(ops.begin(), ops.end()), ops.end());
  if (ops.empty()) return None();
  ReP r = ops.back();
  for (size_t i = ops.size() - 1; i-- > 0;) r = Intern(Re::kAlt, "", ops[i], r);
  return r;
}
ReP Star(ReP a) {
  if (a->k == Re::kNone || a->k == Re::kEps) return Eps();
  return Intern(Re::kStar, "", a, nullptr);
}
bool Nullable(const ReP& r) {
  switch (r->k) {
    case Re::kEps: case Re::kStar: return true;
    case Re::kCat: return Nullable(r->a) && Nullable(r->b);
    case Re::kAlt: return Nullable(r->a) || Nullable(r->b);
    default: return false;
  }
}
bool NonEmpty(const ReP& r) {
  switch (r->k) {
    case Re::kNone: return false;
    case Re::kBytes: return !r->bytes.empty();
    case Re::kCat: return NonEmpty(r->a) && NonEmpty(r->b);
    case Re::kAlt: return NonEmpty(r->a) || NonEmpty(r->b);
    default: return true;
  }
}
ReP Derive(const ReP& r, char c) {
  switch (r->k) {
    case Re::kBytes: return r->bytes.find(c) != std::string::npos ? Eps() : None();
    case Re::kCat: {
      ReP d = Cat(Derive(r->a, c), r->b);
      return Nullable(r->a) ? Alt(d, Derive(r->b, c)) : d;
    }
    case Re::kAlt: return Alt(Derive(r->a, c), Derive(r->b, c));
    case Re::kStar: return Cat(Derive(r->a, c), r);
    default: return None();
  }
}
ReP Derive(ReP r, std::string_view s) {
  for (char c : s) r = Derive(r, c);
  return r;
}

// ---- random regexes: printed pattern + oracle ------------------------------
struct Gen {
  std::mt19937 rng;
  bool multibyte;
  int Rand(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); }

  // Returns {pattern, oracle}.
  std::pair<std::string, ReP> Make(int depth) {
    const int pick = depth <= 0 ? Rand(2) : Rand(7);
    switch (pick) {
      case 0: {  // a literal character
        static const char* kAscii[] = {"a", "b", "c"};
        static const char* kMulti[] = {"\xC3\xA9", "\xE2\x82\xAC"};  // é €
        if (multibyte && Rand(3) == 0) {
          const std::string ch = kMulti[Rand(2)];
          ReP r = Eps();
          for (char c : ch) r = Cat(r, Bytes(std::string(1, c)));
          return {"(?:" + ch + ")", r};
        }
        const std::string ch = kAscii[Rand(3)];
        return {ch, Bytes(ch)};
      }
      case 1: {  // a class
        if (!multibyte && Rand(3) == 0) return {"[^a]", Bytes("bc")};  // alphabet a b c
        if (Rand(2) == 0) return {"[ab]", Bytes("ab")};
        return {"[b-c]", Bytes("bc")};
      }
      case 2: {  // concatenation
        auto [p1, r1] = Make(depth - 1);
        auto [p2, r2] = Make(depth - 1);
        return {p1 + p2, Cat(r1, r2)};
      }
      case 3: {  // alternation
        auto [p1, r1] = Make(depth - 1);
        auto [p2, r2] = Make(depth - 1);
        return {"(?:" + p1 + "|" + p2 + ")", Alt(r1, r2)};
      }
      case 4: {
        auto [p, r] = Make(depth - 1);
        static const char* kQ[] = {"*", "+", "?"};
        const int q = Rand(3);
        ReP o = q == 0 ? Star(r) : q == 1 ? Cat(r, Star(r)) : Alt(r, Eps());
        return {"(?:" + p + ")" + kQ[q], o};
      }
      case 5: {  // {m,n}
        auto [p, r] = Make(depth - 1);
        const int m = Rand(3), n = m + Rand(2);
        ReP o = Eps();
        for (int i = 0; i < m; ++i) o = Cat(o, r);
        for (int i = m; i < n; ++i) o = Cat(o, Alt(r, Eps()));
        return {"(?:" + p + "){" + std::to_string(m) + "," + std::to_string(n) + "}", o};
      }
      default: {  // group
        auto [p, r] = Make(depth - 1);
        return {"(" + p + ")", r};
      }
    }
  }
};

std::string Alphabet(bool multibyte) {
  return multibyte ? std::string("abc\xC3\xA9\xE2\x82\xAC") : std::string("abc");
}

std::shared_ptr<const TokenVocabulary> RandomVocab(std::mt19937& rng, bool multibyte) {
  const std::string alpha = Alphabet(multibyte);
  std::vector<std::optional<std::string>> bytes = {std::nullopt};  // 0: EOS
  for (char c : alpha) bytes.push_back(std::string(1, c));
  if (multibyte) {
    bytes.push_back("\xC3\xA9");
    bytes.push_back("a\xE2\x82\xAC");
  }
  std::uniform_int_distribution<int> len(2, 4), pick(0, static_cast<int>(alpha.size()) - 1);
  for (int i = 0; i < 30; ++i) {
    std::string t;
    for (int k = len(rng); k > 0; --k) t += alpha[pick(rng)];
    bytes.push_back(t);
  }
  bytes.push_back(std::nullopt);  // a hole
  const int32_t eos[] = {0};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

void CheckOne(uint32_t seed, bool multibyte) {
  std::mt19937 rng(seed);
  Gen gen{std::mt19937(seed * 7919 + 1), multibyte};
  auto [pattern, oracle] = gen.Make(4);
  SCOPED_TRACE("seed " + std::to_string(seed) + " pattern " + pattern);
  // The oracle agrees with std::regex on every string up to length 5 over
  // the characters (whole characters for the multi-byte ones).
  const std::regex reference(pattern, std::regex::ECMAScript);
  std::vector<std::string> chars = {"a", "b", "c"};
  if (multibyte) chars.insert(chars.end(), {"\xC3\xA9", "\xE2\x82\xAC"});
  std::vector<std::string> strings = {""};
  for (size_t begin = 0, len = 0; len < 4; ++len) {
    const size_t end = strings.size();
    for (size_t i = begin; i < end; ++i) {
      for (const std::string& c : chars) strings.push_back(strings[i] + c);
    }
    begin = end;
  }
  for (const std::string& s : strings) {
    ASSERT_EQ(Nullable(Derive(oracle, s)), std::regex_match(s, reference)) << "oracle vs std::regex on '" << s << "'";
  }
  auto vocab = RandomVocab(rng, multibyte);
  auto compiled = CompileConstraint({.kind = ConstraintKind::kRegex, .text = pattern}, vocab);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  TokenMatcher m(*compiled);
  std::vector<std::vector<uint32_t>> masks;
  std::string prefix;
  ReP state = oracle;
  for (int step = 0; step < 10; ++step) {
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenMask(mask);
    masks.push_back(mask);
    ASSERT_EQ(Bit(mask, 0), Nullable(state)) << "EOS after '" << prefix << "'";
    ASSERT_EQ(m.IsComplete(), Nullable(state));
    std::vector<int32_t> allowed;
    for (int32_t id = 1; id < vocab->size(); ++id) {
      const auto b = vocab->token_bytes(id);
      const bool live = b.has_value() && NonEmpty(Derive(state, *b));
      ASSERT_EQ(Bit(mask, id), live) << "token '" << (b ? std::string(*b) : "<none>") << "' after '" << prefix << "'";
      if (live) allowed.push_back(id);
    }
    if (allowed.empty()) {
      ASSERT_TRUE(m.IsTerminated());
      break;
    }
    const int32_t id = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    ASSERT_TRUE(m.AcceptToken(id).ok());
    prefix += *vocab->token_bytes(id);
    state = Derive(state, *vocab->token_bytes(id));
  }
  // A disallowed token is refused without changing the state.
  // Rollback restores each earlier step's mask exactly.
  while (m.num_accepted() > 0) {
    const int back = 1 + static_cast<int>(rng() % static_cast<uint32_t>(m.num_accepted()));
    ASSERT_TRUE(m.Rollback(back).ok());
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenMask(mask);
    ASSERT_EQ(mask, masks[m.num_accepted()]) << "after rollback to " << m.num_accepted();
  }
}

TEST(RegexPropertyTest, MaskEqualsDerivativeOracleAscii) {
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    CheckOne(seed, /*multibyte=*/false);
    if (HasFatalFailure()) return;
  }
}

TEST(RegexPropertyTest, MaskEqualsDerivativeOracleWithSplitUtf8) {
  for (uint32_t seed = 1000; seed <= 1300; ++seed) {
    CheckOne(seed, /*multibyte=*/true);
    if (HasFatalFailure()) return;
  }
}

TEST(RegexPropertyTest, UnicodeClassesCompileToByteSequences) {
  std::vector<std::optional<std::string>> bytes = {std::nullopt, "\xCE\xB1", "\xCE", "\xB1", "a", "\xCF\x89", "\xCE\xB1\xCE"};
  const int32_t eos[] = {0};
  auto vocab = *TokenVocabulary::FromBytes(bytes, eos);
  auto c = CompileConstraint({.kind = ConstraintKind::kRegex, .text = "[\xCE\xB1-\xCF\x89]+"}, vocab);  // [α-ω]+
  ASSERT_TRUE(c.ok()) << c.status();
  TokenMatcher m(*c);
  std::vector<uint32_t> mask(m.mask_words());
  m.FillNextTokenMask(mask);
  EXPECT_EQ(mask[0], 0b1100110u);  // α, CE, ω, α+CE; not B1 alone, not 'a', not EOS
  ASSERT_TRUE(m.AcceptToken(6).ok());   // "α" + lead byte of the next
  m.FillNextTokenMask(mask);
  EXPECT_EQ(mask[0], 0b0001000u);  // only the continuation byte B1
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
