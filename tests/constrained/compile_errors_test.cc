// Refusals: every malformed or unsupported constraint is InvalidArgument (or
// ResourceExhausted past a size limit) with a message naming the keyword and
// its JSON pointer, the regex offset or the grammar line:column — never a
// crash or a silently ignored keyword; hostile nesting is bounded.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using ::testing::HasSubstr;

// A byte-complete vocabulary (every byte a token), so what a vocabulary can
// write plays no part here (vocabulary_liveness_test covers that).
using test_util::ByteVocab;

absl::Status Compile(ConstraintKind kind, const std::string& text) {
  static auto vocab = ByteVocab();
  return CompileConstraint({.kind = kind, .text = text}, vocab).status();
}

void ExpectError(ConstraintKind kind, const std::string& text, absl::StatusCode code, const std::string& part) {
  const absl::Status st = Compile(kind, text);
  EXPECT_EQ(st.code(), code) << text << ": " << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr(part)) << text;
}

TEST(CompileErrorsTest, JsonSchemaNamesKeywordAndPointer) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"object","properties":{"a":{"not":{}}}})", kInvalid,
              "unsupported JSON Schema keyword 'not' at /properties/a");
  ExpectError(ConstraintKind::kJsonSchema, R"({"patternProperties":{}})", kInvalid, "'patternProperties' at /");
  ExpectError(ConstraintKind::kJsonSchema, R"({"items":{"uniqueItems":true}})", kInvalid, "'uniqueItems' at /items");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"integer","multipleOf":2})", kInvalid, "'multipleOf'");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"strin"})", kInvalid, "unknown type 'strin'");
  ExpectError(ConstraintKind::kJsonSchema, R"({"$ref":"#/$defs/missing"})", kInvalid, "does not resolve");
  ExpectError(ConstraintKind::kJsonSchema, R"({"$ref":"http://x/y.json"})", kInvalid, "only local references");
  ExpectError(ConstraintKind::kJsonSchema, R"({"allOf":[{},{}]})", kInvalid, "allOf with exactly one");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"string","format":"hostname"})", kInvalid,
              "unsupported format 'hostname'");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"number","minimum":0.5,"exclusiveMaximum":0.5})", kInvalid,
              "no number lies within the bounds");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"string","format":"date","maxLength":3})", kInvalid,
              "minLength/maxLength together with format");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"string","pattern":"a","maxLength":0})", kInvalid,
              "matches no string");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"integer","minimum":3,"maximum":2})", kInvalid, "no integer");
  ExpectError(ConstraintKind::kJsonSchema, R"j({"type":"string","pattern":"(?=a)"})j", kInvalid,
              "at /pattern: regex: lookaround is not supported at offset 0");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"array","maxItems":100000})", kInvalid, "kMaxSchemaCount");
  ExpectError(ConstraintKind::kJsonSchema, R"({"type":"object")", kInvalid, "not valid JSON");
  ExpectError(ConstraintKind::kJsonSchema, "false", kInvalid, "accepts no value");
  ExpectError(ConstraintKind::kJsonSchema, "3", kInvalid, "object or a boolean");
  ExpectError(ConstraintKind::kJsonSchema, R"({"properties":{"a~/b":{"type":"x"}}})", kInvalid, "/properties/a~0~1b/type");
}

TEST(CompileErrorsTest, JsonSchemaHostileNestingIsBounded) {
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += "{\"items\":";
  deep += "{}";
  for (int i = 0; i < 100000; ++i) deep += "}";
  ExpectError(ConstraintKind::kJsonSchema, deep, absl::StatusCode::kInvalidArgument, "nested deeper");
  std::string recursive = R"({"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})";
  const absl::Status st = Compile(ConstraintKind::kJsonSchema, recursive);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;  // a ::= b, b ::= a derives nothing
}

TEST(CompileErrorsTest, JsonSchemaRecursiveRefCompiles) {
  EXPECT_TRUE(Compile(ConstraintKind::kJsonSchema,
                      R"({"type":"object","properties":{"name":{"type":"string"},"children":{"type":"array","items":{"$ref":"#"}}},"required":["name"]})")
                  .ok());
}

TEST(CompileErrorsTest, RegexErrorsGiveOffsets) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ExpectError(ConstraintKind::kRegex, "ab(c", kInvalid, "unterminated group '(' at offset 2");
  ExpectError(ConstraintKind::kRegex, "a)", kInvalid, "unmatched ')' at offset 1");
  ExpectError(ConstraintKind::kRegex, "(a)\\1", kInvalid, "backreference is not supported at offset 3");
  ExpectError(ConstraintKind::kRegex, "a(?!b)", kInvalid, "lookaround is not supported at offset 1");
  ExpectError(ConstraintKind::kRegex, "a(?<=b)", kInvalid, "lookaround");
  ExpectError(ConstraintKind::kRegex, "\\bword", kInvalid, "word boundary \\b is not supported at offset 0");
  ExpectError(ConstraintKind::kRegex, "*a", kInvalid, "nothing to repeat at offset 0");
  ExpectError(ConstraintKind::kRegex, "a**", kInvalid, "quantifier after a quantifier");
  ExpectError(ConstraintKind::kRegex, "[z-a]", kInvalid, "out of order");
  ExpectError(ConstraintKind::kRegex, "[abc", kInvalid, "unterminated character class");
  ExpectError(ConstraintKind::kRegex, "a{5,2}", kInvalid, "n < m");
  ExpectError(ConstraintKind::kRegex, "a{1001}", kInvalid, "kMaxRegexRepeat");
  ExpectError(ConstraintKind::kRegex, "a^b", kInvalid, "'^' is supported only at the start");
  ExpectError(ConstraintKind::kRegex, "a$b", kInvalid, "'$' is supported only at the end");
  ExpectError(ConstraintKind::kRegex, "(?i)a", kInvalid, "inline flags");
  ExpectError(ConstraintKind::kRegex, "\\q", kInvalid, "unknown escape");
  ExpectError(ConstraintKind::kRegex, std::string(500, '(') + "a" + std::string(500, ')'), kInvalid, "kMaxRegexNesting");
  ExpectError(ConstraintKind::kRegex, "(a{1000}){1000}", absl::StatusCode::kResourceExhausted, "kMaxRegexNfaStates");
  ExpectError(ConstraintKind::kRegex, "[ab]*a[ab]{20}", absl::StatusCode::kResourceExhausted, "kMaxRegexDfaStates");
  EXPECT_TRUE(Compile(ConstraintKind::kRegex, "^a{2,}(b|c)?\\d+\\u00e9[^\\n]x{0}$").ok());
}

TEST(CompileErrorsTest, GrammarErrorsGiveLineAndColumn) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ExpectError(ConstraintKind::kGrammar, "root ::= item\n", kInvalid, "rule 'item' is not defined at 1:10");
  ExpectError(ConstraintKind::kGrammar, "start ::= \"a\"\n", kInvalid, "no rule 'root'");
  ExpectError(ConstraintKind::kGrammar, "root ::= list\nlist ::= list \",\" \"a\" | \"a\"\n", kInvalid,
              "rule 'list' is left-recursive");
  ExpectError(ConstraintKind::kGrammar, "root ::= x\nx ::= y? x \"a\" | \"c\"\ny ::= \"b\"\n", kInvalid, "left-recursive");
  ExpectError(ConstraintKind::kGrammar, "root ::= \"abc\n", kInvalid, "unterminated literal");
  ExpectError(ConstraintKind::kGrammar, "root ::= [ab", kInvalid, "unterminated character class");
  ExpectError(ConstraintKind::kGrammar, "root ::= (\"a\" | \"b\"\n", kInvalid, "unterminated group '(' at 1:10");
  ExpectError(ConstraintKind::kGrammar, "root ::= \"a\"\nroot ::= \"b\"", kInvalid, "defined twice at 2:1");
  ExpectError(ConstraintKind::kGrammar, "root := \"a\"", kInvalid, "expected '::='");
  ExpectError(ConstraintKind::kGrammar, "root ::= \"a\"{3,1}", kInvalid, "n < m");
  ExpectError(ConstraintKind::kGrammar, "root ::= \"\\q\"", kInvalid, "unknown escape \\q at 1:11");
  ExpectError(ConstraintKind::kGrammar, "", kInvalid, "empty grammar");
  ExpectError(ConstraintKind::kGrammar, "root ::= " + std::string(300, '(') + "\"a\"" + std::string(300, ')'), kInvalid,
              "kMaxGbnfNesting");
  EXPECT_TRUE(Compile(ConstraintKind::kGrammar,
                      "# a comment\nroot ::= ws obj ws # trailing\nobj ::= \"{\" ( pair (\",\" pair)* )? \"}\"\n"
                      "pair ::= [a-z]+ \":\" ( [0-9]{1,3} | obj )\nws ::= [ \\t\\n]{0,2}\nx ::= [^\\x00-\\x7f] .\n")
                  .ok());
}

TEST(CompileErrorsTest, ChoiceAndVocabularyErrors) {
  auto vocab = *TokenVocabulary::FromBytes({std::nullopt, "a"}, std::vector<int32_t>{0});
  EXPECT_EQ(CompileConstraint({.kind = ConstraintKind::kChoice}, vocab).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenVocabulary::FromBytes({"a"}, std::vector<int32_t>{1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(ConstraintKindName(ConstraintKind::kGrammar), "grammar");
}

TEST(CompileErrorsTest, CacheReturnsTheSameCompiledConstraintAndEvicts) {
  auto vocab = *TokenVocabulary::FromBytes({std::nullopt, "a", "b", "+"}, std::vector<int32_t>{0});
  ConstraintCache cache(vocab, 2);
  auto a1 = cache.Get({.kind = ConstraintKind::kRegex, .text = "a+"});
  auto a2 = cache.Get({.kind = ConstraintKind::kRegex, .text = "a+"});
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->get(), a2->get());
  EXPECT_FALSE(cache.Get({.kind = ConstraintKind::kRegex, .text = "("}).ok());
  ASSERT_TRUE(cache.Get({.kind = ConstraintKind::kRegex, .text = "b"}).ok());
  ASSERT_TRUE(cache.Get({.kind = ConstraintKind::kChoice, .choices = {"a+"}}).ok());  // not the regex a+
  EXPECT_NE(cache.Get({.kind = ConstraintKind::kRegex, .text = "a+"})->get(), a1->get());  // evicted
  EXPECT_EQ(&cache.vocabulary(), vocab.get());
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
