// Liveness over the vocabulary: on a vocabulary that cannot write every byte
// string (no byte fallback: BabyLlama's 105 characters; synthetic ones
// lacking characters, with multi-character tokens and tokens ending inside a
// character), every state reachable through allowed tokens can still be
// completed in tokens, and a constraint the vocabulary cannot write at all is
// refused at compile time naming a missing character. Byte-complete
// vocabularies (every byte a token) are not restricted at all.
//
// The checker explores the automaton itself (interned stacks: a state is its
// sorted stacks), independent of the mask cache: from each reached state it
// searches breadth-first over tokens for a complete output. Random walks
// through TokenMatcher tie it to the real masks (mask == the tokens whose
// bytes leave the automaton alive, plus EOS where complete).
#include <algorithm>
#include <deque>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/utf8_ranges.h"
#include "coordinator/constrained/vocabulary.h"
#include "gtest/gtest.h"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using test_util::Bit;
using test_util::LoadLlama2cTokenizer;
using test_util::LoadQwen3Tokenizer;
using test_util::RealTokenizer;
using test_util::TokenVocab;  // id 0: EOS, then the tokens

// Single-character tokens of `chars` (UTF-8) plus `extra`.
std::shared_ptr<const TokenVocabulary> CharVocab(std::string_view chars, std::vector<std::string> extra = {}) {
  std::vector<std::string> tokens;
  for (size_t at = 0; at < chars.size();) {
    const size_t start = at;
    uint32_t cp;
    EXPECT_TRUE(DecodeUtf8(chars, &at, &cp));
    tokens.emplace_back(chars.substr(start, at - start));
  }
  tokens.insert(tokens.end(), extra.begin(), extra.end());
  return TokenVocab(tokens);
}

constexpr std::string_view kAsciiLetters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ";
// Enough for JSON (no byte fallback, no '\t' and no '#').
constexpr std::string_view kJsonChars =
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]\":,.-+\\/é";

// ---- the checker: the automaton over tokens ---------------------------------

using Key = std::vector<std::pair<uint32_t, const StackNode*>>;

Key KeyOf(const std::vector<Stack>& s) {
  Key k;
  for (const Stack& x : s) k.push_back({x.pos, x.parent});
  std::sort(k.begin(), k.end());
  k.erase(std::unique(k.begin(), k.end()), k.end());
  return k;
}

struct Checker {
  const GrammarConstraint& c;
  const TokenVocabulary& v;
  NodeArena arena{/*intern=*/true};
  std::set<Key> completable;
  size_t states_checked = 0;
  size_t max_search = 0;

  explicit Checker(const CompiledConstraint& cc)
      : c(static_cast<const GrammarConstraint&>(cc)), v(cc.vocabulary()) {}

  static bool Complete(const std::vector<Stack>& s) {
    return std::any_of(s.begin(), s.end(), [](const Stack& k) { return k.pos == kAcceptPos; });
  }
  // The state after token `id` (empty: not allowed).
  std::vector<Stack> After(const std::vector<Stack>& s, int32_t id) {
    const auto bytes = v.token_bytes(id);
    if (!bytes.has_value()) return {};
    std::vector<Stack> now = s, next;
    for (char b : *bytes) {
      c.pda().Advance(now, static_cast<uint8_t>(b), arena, next);
      now.swap(next);
      if (now.empty()) break;
    }
    return now;
  }
  // Breadth-first over tokens from `s` for a complete output (at most
  // `limit` states); true when found.
  bool Completable(const std::vector<Stack>& s, size_t limit = 20000) {
    const Key start = KeyOf(s);
    if (completable.contains(start)) return true;
    ++states_checked;
    std::set<Key> seen = {start};
    std::deque<std::vector<Stack>> queue = {s};
    while (!queue.empty() && seen.size() < limit) {
      std::vector<Stack> cur = std::move(queue.front());
      queue.pop_front();
      if (Complete(cur) || completable.contains(KeyOf(cur))) {
        completable.insert(start);
        max_search = std::max(max_search, seen.size());
        return true;
      }
      for (int32_t id = 0; id < v.size(); ++id) {
        std::vector<Stack> n = After(cur, id);
        if (!n.empty() && seen.insert(KeyOf(n)).second) queue.push_back(std::move(n));
      }
    }
    return false;
  }
  std::vector<Stack> Initial() {
    std::vector<Stack> s;
    c.pda().Initial(arena, s);
    return s;
  }
  // Every state reachable from the start through allowed tokens (up to
  // `limit`) and every allowed token's next state can be completed. Returns
  // false (and says where) on a dead one; *closed: the exploration was
  // exhaustive.
  ::testing::AssertionResult AllReachableCompletable(size_t limit, bool* closed = nullptr, bool quiet = false) {
    std::map<Key, std::string> seen;
    std::deque<std::pair<std::vector<Stack>, std::string>> queue;
    queue.push_back({Initial(), ""});
    seen[KeyOf(queue.front().first)] = "";
    while (!queue.empty()) {
      auto [s, text] = std::move(queue.front());
      queue.pop_front();
      if (!Completable(s)) return ::testing::AssertionFailure() << "dead state after '" << text << "'";
      for (int32_t id = 0; id < v.size(); ++id) {
        std::vector<Stack> n = After(s, id);
        if (n.empty()) continue;
        const Key k = KeyOf(n);
        if (seen.contains(k)) continue;
        if (seen.size() >= limit) {
          if (!Completable(n)) {
            return ::testing::AssertionFailure() << "dead state after '" << text << *v.token_bytes(id) << "'";
          }
          continue;
        }
        seen[k] = text + std::string(*v.token_bytes(id));
        queue.push_back({std::move(n), seen[k]});
      }
    }
    if (closed != nullptr) *closed = seen.size() < limit;
    if (!quiet) std::cout << "  [reachable] " << seen.size() << " states" << (seen.size() < limit ? " (all)" : " (capped)")
              << ", each completable\n";
    return ::testing::AssertionSuccess() << seen.size() << " states";
  }
};

// Random walks through TokenMatcher: the mask is never empty before EOS, it
// equals the checker's allowed set, and every allowed token leads to a
// completable state. Returns the number of states visited.
size_t RandomWalks(std::shared_ptr<const CompiledConstraint> compiled, uint32_t seed, int walks, int max_steps) {
  Checker ck(*compiled);
  const TokenVocabulary& v = compiled->vocabulary();
  const int32_t eos = v.eos_ids()[0];
  std::mt19937 rng(seed);
  size_t visited = 0;
  for (int w = 0; w < walks; ++w) {
    TokenMatcher m(compiled);
    std::vector<Stack> state = ck.Initial();
    std::string out;
    std::vector<uint32_t> mask(m.mask_words());
    for (int step = 0; step < max_steps; ++step) {
      ++visited;
      m.FillNextTokenMask(mask);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < v.size(); ++id) {
        if (Bit(mask, id)) allowed.push_back(id);
      }
      EXPECT_FALSE(allowed.empty()) << "stuck after '" << out << "'";
      if (allowed.empty()) return visited;
      EXPECT_EQ(Bit(mask, eos), Checker::Complete(state)) << "after '" << out << "'";
      for (int32_t id = 0; id < v.size(); ++id) {
        if (id == eos) continue;
        std::vector<Stack> n = ck.After(state, id);
        EXPECT_EQ(Bit(mask, id), !n.empty()) << "token '" << v.token_bytes(id).value_or("") << "' after '" << out << "'";
        if (!n.empty()) {
          EXPECT_TRUE(ck.Completable(n)) << "token '" << *v.token_bytes(id) << "' after '" << out << "' is a dead end";
        }
      }
      if (::testing::Test::HasFailure()) return visited;
      // EOS rarely before the end, so walks go deep.
      int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      if (pick == eos && allowed.size() > 1 && rng() % 4 != 0) pick = allowed[allowed[0] == eos ? 1 : 0];
      EXPECT_TRUE(m.AcceptToken(pick).ok());
      if (pick == eos) break;
      out += *v.token_bytes(pick);
      state = ck.After(state, pick);
    }
  }
  std::cout << "  [walks] " << visited << " states walked, " << ck.states_checked
            << " distinct states searched for a completion (largest search " << ck.max_search << ")\n";
  return visited;
}

std::string ErrorOf(const ConstraintSpec& spec, std::shared_ptr<const TokenVocabulary> v) {
  auto c = CompileConstraint(spec, v);
  return c.ok() ? "ok" : absl::StrCat(absl::StatusCodeToString(c.status().code()), ": ", c.status().message());
}

std::vector<std::string> FirstTokens(std::shared_ptr<const CompiledConstraint> c) {
  TokenMatcher m(c);
  std::vector<uint32_t> mask(m.mask_words());
  m.FillNextTokenMask(mask);
  std::vector<std::string> out;
  for (int32_t id = 0; id < c->vocabulary().size(); ++id) {
    if (Bit(mask, id)) out.emplace_back(c->vocabulary().token_bytes(id).value_or("<eos>"));
  }
  return out;
}

// ---- which characters are writable ------------------------------------------

TEST(WritableCharactersTest, WholeTokensPiecesAndStops) {
  auto set = [](std::vector<std::string> tokens) {
    std::vector<std::string_view> views(tokens.begin(), tokens.end());
    return WritableCharacters(views);
  };
  // Characters that are tokens; multi-character tokens add nothing.
  EXPECT_EQ(set({"a", "b", "ab", "\xC3\xA9", "Zu\xCC\x88"}), (CodePointSet{{'a', 'b'}, {0xE9, 0xE9}}));
  // é from pieces C3 + A9; è (C3 A8) has no A8.
  EXPECT_EQ(set({"a", "\xC3", "\xA9"}), (CodePointSet{{'a', 'a'}, {0xE9, 0xE9}}));
  // ü is a token, but "Z\xC3" can stop output after C3 and no token writes
  // BC: ü is left out (else "Z\xC3" would be a dead end in "Zü").
  EXPECT_EQ(set({"Z", "\xC3\xBC", "Z\xC3"}), (CodePointSet{{'Z', 'Z'}}));
  // ... unless BC is a token too.
  EXPECT_EQ(set({"Z", "\xC3\xBC", "Z\xC3", "\xBC"}), (CodePointSet{{'Z', 'Z'}, {0xFC, 0xFC}}));
  // Stops chain through continuation tokens: after E2 82 nothing writes AC,
  // so the token € is out; E2 82 82 (U+2082) is written in pieces.
  EXPECT_EQ(set({"\xE2", "\x82", "\xE2\x82\xAC"}), (CodePointSet{{0x2082, 0x2082}}));
  EXPECT_TRUE(ContainsCodePoint(set({"\xE2", "\x82", "\xAC"}), 0x20AC));
}

TEST(WritableCharactersTest, ByteCompleteVocabularyIsNotRestricted) {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));
  bytes.push_back("Z\xC3");
  const int32_t eos[] = {0};
  auto v = *TokenVocabulary::FromBytes(bytes, eos);
  EXPECT_TRUE(AsByteVocabulary(*v).byte_complete());
  EXPECT_EQ(AsByteVocabulary(*v).writable_chars(), nullptr);
  bytes.erase(bytes.begin() + 1 + 0xBC);
  auto missing = *TokenVocabulary::FromBytes(bytes, eos);
  EXPECT_FALSE(AsByteVocabulary(*missing).byte_complete());
  ASSERT_NE(AsByteVocabulary(*missing).writable_chars(), nullptr);
  // No BC: characters with a BC continuation byte are out.
  EXPECT_FALSE(ContainsCodePoint(*AsByteVocabulary(*missing).writable_chars(), 0xFC));
  EXPECT_TRUE(ContainsCodePoint(*AsByteVocabulary(*missing).writable_chars(), 0xE9));
  EXPECT_TRUE(ContainsCodePoint(*AsByteVocabulary(*missing).writable_chars(), 0x10FFFF));
  // Byte-complete: the grammar is exactly the unrestricted one.
  for (const ConstraintSpec& spec :
       {ConstraintSpec{.kind = ConstraintKind::kChoice, .choices = {"New York", "Zürich"}},
        ConstraintSpec{.kind = ConstraintKind::kRegex, .text = "[a-zü]+\\d"},
        ConstraintSpec{.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"array","items":{"type":"string"}})"},
        ConstraintSpec{.kind = ConstraintKind::kGrammar, .text = "root ::= [^x]+ \"ü\""}}) {
    auto a = BuildConstraintGrammar(spec, v.get());
    auto b = BuildConstraintGrammar(spec, nullptr);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->size(), b->size());
    for (uint32_t p = 0; p < a->size(); ++p) {
      ASSERT_EQ(a->at(p).kind, b->at(p).kind);
      ASSERT_EQ(a->at(p).id, b->at(p).id);
      if (a->at(p).kind == FlatGrammar::Kind::kBytes) ASSERT_EQ(a->byte_set(p), b->byte_set(p));
    }
  }
}

// ---- synthetic vocabularies -------------------------------------------------

TEST(VocabularyLivenessTest, ChoiceDropsUnwritableAlternatives) {
  auto v = CharVocab(kAsciiLetters, {"New", " York", "San", "Zü", "\xC3\xBC" "rich"});
  auto c = CompileConstraint({.kind = ConstraintKind::kChoice, .choices = {"New York", "Zürich", "San Francisco"}}, v);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(FirstTokens(*c), (std::vector<std::string>{"N", "S", "New", "San"}));  // no "Z", no "Zü"
  Checker ck(**c);
  bool closed = false;
  EXPECT_TRUE(ck.AllReachableCompletable(100000, &closed));
  EXPECT_TRUE(closed);
  RandomWalks(*c, 1, 20, 30);
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kChoice, .choices = {"Zürich", "Genève"}}, v),
            "INVALID_ARGUMENT: choice: no output of this constraint can be written with the model's vocabulary "
            "(e.g. 'ü' (U+00FC) is not in it)");
}

TEST(VocabularyLivenessTest, TokensEndingInsideACharacter) {
  // é from C3 + A9 and whole; "e\xC3" stops after C3 (é's A9 is a token);
  // "Z\xC3" stops there too, so ü (no BC token) must be out although "ü" is
  // a token; "\xA9\"" finishes é and goes on.
  auto v = CharVocab("abeZ\"", {"\xC3", "\xA9", "\xC3\xA9", "e\xC3", "Z\xC3", "\xC3\xBC", "\xA9\"", "\xC3\xA8"});
  for (const ConstraintSpec& spec :
       {ConstraintSpec{.kind = ConstraintKind::kChoice, .choices = {"Zéa", "Züa", "eè", "eé\"", "bé"}},
        ConstraintSpec{.kind = ConstraintKind::kRegex, .text = "[aeZ\\u00e8-\\u00fc]{1,4}\"?"},
        ConstraintSpec{.kind = ConstraintKind::kGrammar, .text = "root ::= (\"Z\" [éüè] | \"e\" .)+"}}) {
    SCOPED_TRACE(ConstraintKindName(spec.kind));
    auto c = CompileConstraint(spec, v);
    ASSERT_TRUE(c.ok()) << c.status();
    Checker ck(**c);
    bool closed = false;
    EXPECT_TRUE(ck.AllReachableCompletable(50000, &closed));
    RandomWalks(*c, 7, 30, 12);
  }
  // Lone lead bytes stay allowed where they can be finished.
  auto c = CompileConstraint({.kind = ConstraintKind::kChoice, .choices = {"é", "ü"}}, v);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(FirstTokens(*c), (std::vector<std::string>{"\xC3", "\xC3\xA9"}));
}

TEST(VocabularyLivenessTest, RegexClassesAndUnwritablePatterns) {
  auto v = CharVocab("abcxyz019-@.", {"ab", "\xC3\xA9", "@x", ".c"});
  auto c = CompileConstraint({.kind = ConstraintKind::kRegex, .text = "[a-zäé]+@[^@]{1,3}\\.c"}, v);
  ASSERT_TRUE(c.ok()) << c.status();
  Checker ck(**c);
  bool closed = false;
  EXPECT_TRUE(ck.AllReachableCompletable(100000, &closed));
  EXPECT_TRUE(closed);
  RandomWalks(*c, 3, 30, 20);
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kRegex, .text = "x?[äöü]+"}, v),
            "INVALID_ARGUMENT: regex: no output of this constraint can be written with the model's vocabulary "
            "(e.g. 'ä' (U+00E4) is not in it)");
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kRegex, .text = "a|#"}, v), "ok");
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kRegex, .text = "a#"}, v),
            "INVALID_ARGUMENT: regex: no output of this constraint can be written with the model's vocabulary "
            "(e.g. '#' is not in it)");
  // A pattern that matches nothing anywhere keeps its own error.
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kRegex, .text = "[^\\s\\S]"}, v),
            "INVALID_ARGUMENT: regex: regex 'regex' matches no string");
}

TEST(VocabularyLivenessTest, GbnfSetsAndLiterals) {
  auto v = CharVocab("abc()xy ", {"\xC3\xA9", "(x"});
  auto c = CompileConstraint({.kind = ConstraintKind::kGrammar,
                              .text = "root ::= \"(\" root \")\" | [a-cé-ü]+ | \"Zürich\" | [ü] \"x\" | . \"y\""},
                             v);
  ASSERT_TRUE(c.ok()) << c.status();
  RandomWalks(*c, 5, 40, 15);
  Checker ck(**c);
  EXPECT_TRUE(ck.AllReachableCompletable(3000));
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kGrammar, .text = "root ::= \"Zürich\" | [ü] \"x\""}, v),
            "INVALID_ARGUMENT: grammar: no output of this constraint can be written with the model's vocabulary "
            "(e.g. 'Z' is not in it)");
  // Grammar errors unrelated to the vocabulary keep their message.
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kGrammar, .text = "root ::= x"}, v).find("not defined") != std::string::npos,
            true);
}

TEST(VocabularyLivenessTest, JsonSchemas) {
  auto v = CharVocab(kJsonChars, {"{\"", "\":", "\"}", "\"a", "tr", "ue", "[1", "\xC3\xA9\""});
  for (const char* schema : {
           R"({"type":"object","properties":{"name":{"type":"string","maxLength":3},"n":{"type":"integer"}},"required":["name"]})",
           R"({"enum":["Zürich","Bern","Genève"]})",
           R"({"type":"array","items":{"type":"string","pattern":"^[aüé]+$"},"maxItems":2})",
           R"({"type":"object","properties":{"Zü":{"type":"boolean"},"a":{"type":"null"}}})",
           R"({"type":"string","format":"date"})",
       }) {
    SCOPED_TRACE(schema);
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema}, v);
    ASSERT_TRUE(c.ok()) << c.status();
    RandomWalks(*c, 11, 20, 40);
  }
  auto e = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = R"({"enum":["Zürich","Bern"]})"}, v);
  ASSERT_TRUE(e.ok());
  Checker ck(**e);
  bool closed = false;
  EXPECT_TRUE(ck.AllReachableCompletable(1000, &closed));
  EXPECT_TRUE(closed);
  EXPECT_EQ(FirstTokens(*e), (std::vector<std::string>{"\""}));
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kJsonSchema, .text = R"({"enum":["Zürich","Genève"]})"}, v),
            "INVALID_ARGUMENT: json_schema: no output of this constraint can be written with the model's "
            "vocabulary (e.g. 'ü' (U+00FC) is not in it)");
  // No '{' at all: objects are refused, other values remain.
  auto no_braces = CharVocab("abcdefghijklmnopqrstuvwxyz0123456789 []\":,.-+\\/");
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"object"})"}, no_braces),
            "INVALID_ARGUMENT: json_schema: no output of this constraint can be written with the model's "
            "vocabulary (e.g. '{' is not in it)");
  auto any = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = "{}"}, no_braces);
  ASSERT_TRUE(any.ok()) << any.status();
  RandomWalks(*any, 13, 30, 40);
}

// Random small vocabularies (characters present or not, lone UTF-8 bytes,
// multi-character tokens, tokens cut inside a character) against random
// choices and fixed regexes and grammars: every reachable state is
// completable (exhaustively), or the constraint is refused as unwritable.
TEST(VocabularyLivenessTest, RandomVocabulariesNeverStuck) {
  const std::vector<std::string> chars = {"a", "b", "c", "\"", "\xC3\xA9", "\xC3\xBC", "\xE2\x82\xAC"};
  const std::vector<std::string> lone = {"\xC3", "\xA9", "\xBC", "\xE2", "\x82", "\xAC"};
  const std::vector<ConstraintSpec> fixed = {
      {.kind = ConstraintKind::kRegex, .text = "[ab\u00e9]+\u00fc?"},
      {.kind = ConstraintKind::kRegex, .text = "(?:a|\u20ac)*b"},
      {.kind = ConstraintKind::kRegex, .text = "[^a]{1,3}"},
      {.kind = ConstraintKind::kRegex, .text = ".\"?c"},
      {.kind = ConstraintKind::kGrammar, .text = "root ::= [a-c]+ (\"\xC3\xA9\" | \"\xC3\xBC\") | \"\xE2\x82\xAC\" root"},
      {.kind = ConstraintKind::kJsonSchema, .text = R"({"enum":["a\u00e9","\u00fc","\u20acb"]})"},
  };
  size_t compiled = 0, refused = 0, states = 0;
  for (uint32_t seed = 1; seed <= 150; ++seed) {
    std::mt19937 rng(seed);
    auto coin = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
    std::vector<std::string> tokens;
    for (const std::string& c : chars) {
      if (coin(60)) tokens.push_back(c);
    }
    for (const std::string& b : lone) {
      if (coin(25)) tokens.push_back(b);
    }
    for (int k = 0; k < 6; ++k) {
      std::string t;
      for (int n = 1 + static_cast<int>(rng() % 3); n > 0; --n) t += chars[rng() % chars.size()];
      if (coin(40)) t = t.substr(0, 1 + rng() % t.size());  // may end inside a character
      if (coin(20) && t.size() > 1) t = t.substr(1 + rng() % (t.size() - 1));  // may start inside one
      tokens.push_back(t);
    }
    auto v = TokenVocab(tokens);
    std::vector<ConstraintSpec> specs = fixed;
    ConstraintSpec choice = {.kind = ConstraintKind::kChoice};
    for (int k = 0; k < 3; ++k) {
      std::string s;
      for (int n = 1 + static_cast<int>(rng() % 4); n > 0; --n) s += chars[rng() % chars.size()];
      choice.choices.push_back(s);
    }
    specs.push_back(choice);
    for (const ConstraintSpec& spec : specs) {
      SCOPED_TRACE(absl::StrCat("seed ", seed, " ", ConstraintKindName(spec.kind), " ", spec.text));
      auto c = CompileConstraint(spec, v);
      if (!c.ok()) {
        ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
        ASSERT_TRUE(absl::StrContains(c.status().message(), "no output of this constraint can be written"))
            << c.status();
        ++refused;
        continue;
      }
      ++compiled;
      Checker ck(**c);
      bool closed = false;
      ASSERT_TRUE(ck.AllReachableCompletable(5000, &closed, /*quiet=*/true));
      states += ck.states_checked;
    }
  }
  std::cout << "  [random] " << compiled << " constraints compiled (" << states << " reachable states, each completable), "
            << refused << " refused as unwritable\n";
  EXPECT_GT(compiled, 500u);
  EXPECT_GT(refused, 20u);
}

// ---- BabyLlama: 105 characters, no byte fallback -----------------------------

TEST(VocabularyLivenessTest, BabyLlama) {
  RealTokenizer baby;
  if (!LoadLlama2cTokenizer("models/babyllama-tok105/tok105.bin", 105, &baby)) return;  // skipped or failed
  const auto& vocab = baby.vocab;  // EOS 2
  const ByteVocabulary& bv = AsByteVocabulary(*vocab);
  ASSERT_FALSE(bv.byte_complete());
  const CodePointSet& w = *bv.writable_chars();
  for (uint32_t cp : {uint32_t{'a'}, uint32_t{' '}, uint32_t{'"'}, uint32_t{'['}, uint32_t{0xE9}, uint32_t{0x2019}}) {
    EXPECT_TRUE(ContainsCodePoint(w, cp)) << cp;
  }
  for (uint32_t cp : {uint32_t{'{'}, uint32_t{'#'}, uint32_t{0xFC}, uint32_t{'\n'}}) EXPECT_FALSE(ContainsCodePoint(w, cp)) << cp;

  auto choice = CompileConstraint(
      {.kind = ConstraintKind::kChoice, .choices = {"New York", "Zürich", "San Francisco"}}, vocab);
  ASSERT_TRUE(choice.ok()) << choice.status();
  Checker ck(**choice);
  bool closed = false;
  EXPECT_TRUE(ck.AllReachableCompletable(100000, &closed));
  EXPECT_TRUE(closed);
  RandomWalks(*choice, 17, 30, 20);
  {
    // Control: without the restriction the checker finds the dead end "Z".
    const ConstraintSpec spec = {.kind = ConstraintKind::kChoice, .choices = {"New York", "Zürich", "San Francisco"}};
    auto unrestricted = std::make_shared<const GrammarConstraint>(spec, vocab, *BuildConstraintGrammar(spec, nullptr));
    Checker control(*unrestricted);
    const auto result = control.AllReachableCompletable(100000);
    EXPECT_FALSE(result);
    EXPECT_EQ(std::string(result.message()), "dead state after 'Z'");
  }
  for (const char* schema : {
           R"({"type":"string"})",
           R"({"type":"array","items":{"type":"integer"},"maxItems":4})",
           "{}",
           R"({"enum":["Zürich","Bern","Genève"]})",
           R"({"anyOf":[{"type":"object"},{"type":"array","items":{"type":"string","format":"email"}}]})",
       }) {
    SCOPED_TRACE(schema);
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema}, vocab);
    ASSERT_TRUE(c.ok()) << c.status();
    RandomWalks(*c, 19, 25, 60);
  }
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"object"})"}, vocab),
            "INVALID_ARGUMENT: json_schema: no output of this constraint can be written with the model's "
            "vocabulary (e.g. '{' is not in it)");
  EXPECT_EQ(ErrorOf({.kind = ConstraintKind::kChoice, .choices = {"Zürich"}}, vocab),
            "INVALID_ARGUMENT: choice: no output of this constraint can be written with the model's vocabulary "
            "(e.g. 'ü' (U+00FC) is not in it)");
}

TEST(VocabularyLivenessTest, Stories260KIsByteComplete) {
  RealTokenizer stories;
  if (!LoadLlama2cTokenizer("models/stories260K/tok512.bin", 512, &stories)) return;  // skipped or failed
  EXPECT_TRUE(AsByteVocabulary(*stories.vocab).byte_complete());
}

TEST(VocabularyLivenessTest, Qwen3IsByteComplete) {
  RealTokenizer qwen3;
  if (!LoadQwen3Tokenizer(&qwen3)) return;  // skipped or failed
  EXPECT_TRUE(AsByteVocabulary(*qwen3.vocab).byte_complete());
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
