// TokenMatcher over hand-written constraints and a small vocabulary: masks,
// EOS only where complete, accept/reject, rollback, termination.
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "gtest/gtest.h"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using test_util::Bit;
using test_util::kEos;
using test_util::TokenVocab;  // id 0: EOS, then the tokens

std::vector<std::string> Allowed(TokenMatcher& m, const TokenVocabulary& v) {
  std::vector<uint32_t> mask(m.mask_words());
  m.FillNextTokenMask(mask);
  std::vector<std::string> out;
  for (int32_t id = 0; id < v.size(); ++id) {
    if (Bit(mask, id)) out.push_back(id == kEos ? "<eos>" : std::string(*v.token_bytes(id)));
  }
  return out;
}

int32_t Id(const TokenVocabulary& v, std::string_view t) {
  for (int32_t id = 1; id < v.size(); ++id) {
    if (v.token_bytes(id) == t) return id;
  }
  return -1;
}

TEST(MatcherBasicTest, ChoiceMasksPrefixesAndEosOnlyWhenComplete) {
  auto v = TokenVocab({"a", "b", "ab", "abc", "c", "x", "abx"});
  auto c = CompileConstraint({.kind = ConstraintKind::kChoice, .choices = {"ab", "abc"}}, v);
  ASSERT_TRUE(c.ok()) << c.status();
  TokenMatcher m(*c);
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"a", "ab", "abc"}));
  EXPECT_FALSE(m.IsComplete());
  ASSERT_TRUE(m.AcceptToken(Id(*v, "ab")).ok());
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"<eos>", "c"}));
  EXPECT_TRUE(m.IsComplete());
  EXPECT_FALSE(m.IsTerminated());
  EXPECT_FALSE(m.AcceptToken(Id(*v, "x")).ok());
  EXPECT_EQ(m.num_accepted(), 1);
  ASSERT_TRUE(m.AcceptToken(Id(*v, "c")).ok());
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"<eos>"}));
  ASSERT_TRUE(m.AcceptToken(kEos).ok());
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_TRUE(Allowed(m, *v).empty());
  EXPECT_FALSE(m.AcceptToken(Id(*v, "a")).ok());
  ASSERT_TRUE(m.Rollback(2).ok());
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"<eos>", "c"}));
  EXPECT_FALSE(m.Rollback(2).ok());
  ASSERT_TRUE(m.Rollback(1).ok());
  EXPECT_EQ(m.num_accepted(), 0);
}

TEST(MatcherBasicTest, RegexDigits) {
  // Every digit is a token too: a vocabulary restricts the output to the
  // characters it writes one by one (vocabulary_liveness_test).
  auto v = TokenVocab({"1", "12", "a", "-", "-1", "123", "1a", "2", "3"});
  auto c = CompileConstraint({.kind = ConstraintKind::kRegex, .text = "-?[0-9]{1,3}"}, v);
  ASSERT_TRUE(c.ok()) << c.status();
  TokenMatcher m(*c);
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"1", "12", "-", "-1", "123", "2", "3"}));
  ASSERT_TRUE(m.AcceptToken(Id(*v, "12")).ok());
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"<eos>", "1", "2", "3"}));
}

TEST(MatcherBasicTest, JsonSchemaObject) {
  auto v = TokenVocab({"{", "}", "\"", "a", "\":", ":", " ", "1", ",", "\"a\"", "{\"", "\"b", "2", "x"});
  auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema,
                              .text = R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]})"},
                             v);
  ASSERT_TRUE(c.ok()) << c.status();
  TokenMatcher m(*c);
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"{", "{\""}));
  for (const char* t : {"{", "\"a\"", ":", " ", "1", "2"}) ASSERT_TRUE(m.AcceptToken(Id(*v, t)).ok()) << t;
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"}", "1", "2"}));
  ASSERT_TRUE(m.AcceptToken(Id(*v, "}")).ok());
  EXPECT_TRUE(m.IsTerminated());
}

TEST(MatcherBasicTest, GrammarWithRecursion) {
  auto v = TokenVocab({"(", ")", "()", "x", "(x", "))"});
  auto c = CompileConstraint({.kind = ConstraintKind::kGrammar, .text = "root ::= \"(\" root \")\" | \"x\""}, v);
  ASSERT_TRUE(c.ok()) << c.status();
  TokenMatcher m(*c);
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{"(", "x", "(x"}));
  ASSERT_TRUE(m.AcceptToken(Id(*v, "(")).ok());
  ASSERT_TRUE(m.AcceptToken(Id(*v, "(x")).ok());
  EXPECT_EQ(Allowed(m, *v), (std::vector<std::string>{")", "))"}));
  ASSERT_TRUE(m.AcceptToken(Id(*v, "))")).ok());
  EXPECT_TRUE(m.IsTerminated());
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
