// The pre-tokenizer regex subset: Oniguruma-style leftmost-first matching.
#include "coordinator/tokenizer/split_regex.h"

#include "coordinator/tokenizer/text_pipeline.h"
#include "coordinator/tokenizer/unicode_text.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator::internal {
namespace {

// The Llama 3 Split pattern (Qwen's differs only in \p{N} instead of \p{N}{1,3}).
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> Pieces(std::string_view pattern, std::string_view text) {
  auto re = SplitRegex::Compile(pattern);
  EXPECT_TRUE(re.ok()) << re.status();
  const std::vector<char32_t> cps = DecodeUtf8(text);
  std::vector<std::string> out;
  for (const MatchRange& m : re->FindAll(cps)) {
    std::string s;
    for (size_t i = m.begin; i < m.end; ++i) AppendUtf8(cps[i], &s);
    out.push_back(s);
  }
  return out;
}

TEST(SplitRegexTest, SplitsLikeGpt2) {
  EXPECT_EQ(Pieces(kGpt2SplitPattern, "Hello world's 123  \n"),
            (std::vector<std::string>{"Hello", " world", "'s", " 123", "  \n"}));
}

TEST(SplitRegexTest, GivesBackOneSpaceBeforeAWord) {
  // \s+(?!\S) must backtrack so the last space stays with the word.
  EXPECT_EQ(Pieces(kGpt2SplitPattern, "a   b"), (std::vector<std::string>{"a", "  ", " b"}));
}

TEST(SplitRegexTest, GroupsDigitsInThreesForLlama3) {
  EXPECT_EQ(Pieces(kLlama3Pattern, "12345 x"), (std::vector<std::string>{"123", "45", " x"}));
}

TEST(SplitRegexTest, MatchesContractionsIgnoringCase) {
  EXPECT_EQ(Pieces(kLlama3Pattern, "IT'S we'LL"), (std::vector<std::string>{"IT", "'S", " we", "'LL"}));
}

TEST(SplitRegexTest, KeepsNewlinesWithPunctuationAndLetterPrefixes) {
  EXPECT_EQ(Pieces(kLlama3Pattern, "x;\n\n\"quoted\""),
            (std::vector<std::string>{"x", ";\n\n", "\"quoted", "\""}));
}

TEST(SplitRegexTest, SupportsLookaheadClassesAndBoundedGroups) {
  EXPECT_EQ(Pieces("a(?=b)", "aab ab"), (std::vector<std::string>{"a", "a"}));
  EXPECT_EQ(Pieces("[a-c]+|[^a-c ]+", "abxyc"), (std::vector<std::string>{"ab", "xy", "c"}));
  EXPECT_EQ(Pieces("(?:ab){2}", "abababab"), (std::vector<std::string>{"abab", "abab"}));
  EXPECT_EQ(Pieces("x(?:yz)?", "xyzx"), (std::vector<std::string>{"xyz", "x"}));
  EXPECT_EQ(Pieces(R"(\p{Lu}\p{Ll}*)", "HelloWorld"), (std::vector<std::string>{"Hello", "World"}));
}

TEST(SplitRegexTest, HandlesLongRunsWithoutDeepRecursion) {
  const std::string spaces(200000, ' ');
  const std::vector<std::string> pieces = Pieces(kLlama3Pattern, spaces + "x");
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].size(), spaces.size() - 1);
  EXPECT_EQ(pieces[1], " x");
}

TEST(SplitRegexTest, RejectsSyntaxOutsideTheSubset) {
  for (const char* pattern : {"a*?", "^a", "(?:a)*", R"(\bx)", "(?<name>a)", R"(\p{Greek})"}) {
    EXPECT_EQ(SplitRegex::Compile(pattern).status().code(), absl::StatusCode::kUnimplemented) << pattern;
  }
  for (const char* pattern : {"(a", "a)", "[ab", "a{3,1}", "+a"}) {
    EXPECT_EQ(SplitRegex::Compile(pattern).status().code(), absl::StatusCode::kInvalidArgument) << pattern;
  }
}

}  // namespace
}  // namespace exl3serve::coordinator::internal
