// ReasoningParser (coordinator/http/reasoning_parser.h): <think> blocks split
// from content, prompt-opened blocks, held-back partial markers, unclosed
// blocks at Finish, and results independent of how the text was split.
#include "coordinator/http/reasoning_parser.h"

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::coordinator::http {
namespace {

ReasoningSplit FeedPieces(bool starts_in_reasoning, const std::vector<std::string>& pieces) {
  ReasoningParser parser(starts_in_reasoning);
  ReasoningSplit all;
  auto add = [&](const ReasoningSplit& s) {
    all.reasoning += s.reasoning;
    all.content += s.content;
  };
  for (const std::string& piece : pieces) add(parser.Feed(piece));
  add(parser.Finish());
  return all;
}

// Splits `text` whole, byte by byte and at random points; checks that all
// agree and returns the result.
ReasoningSplit SplitAllWays(bool starts_in_reasoning, std::string_view text) {
  const ReasoningSplit whole = FeedPieces(starts_in_reasoning, {std::string(text)});
  std::vector<std::vector<std::string>> splits;
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  splits.push_back(bytes);
  const uint32_t gtest_seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  for (uint32_t round = 0; round < 20; ++round) {
    std::mt19937 rng(gtest_seed * 1000 + round);
    std::uniform_int_distribution<int> length(0, 6);
    std::vector<std::string> pieces;
    for (size_t at = 0; at < text.size();) {
      const size_t n = std::min<size_t>(length(rng), text.size() - at);
      pieces.emplace_back(text.substr(at, n));
      at += n;
    }
    splits.push_back(pieces);
  }
  for (size_t i = 0; i < splits.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "split " << i << " (0: bytewise, then random with gtest seed "
                                      << gtest_seed << ")");
    const ReasoningSplit got = FeedPieces(starts_in_reasoning, splits[i]);
    EXPECT_EQ(got.reasoning, whole.reasoning);
    EXPECT_EQ(got.content, whole.content);
  }
  return whole;
}

void ExpectSplit(const ReasoningSplit& got, std::string_view reasoning, std::string_view content) {
  EXPECT_EQ(got.reasoning, reasoning);
  EXPECT_EQ(got.content, content);
}

TEST(ReasoningParserTest, SplitsAThinkBlockAndDropsWhitespaceAfterIt) {
  ExpectSplit(SplitAllWays(false, "<think>\nLet me think.\n</think>\n\nThe answer is 4."), "\nLet me think.\n",
              "The answer is 4.");
  ExpectSplit(SplitAllWays(false, "\n <think>a</think>b\n"), "a", "b\n");
}

TEST(ReasoningParserTest, OutputWithoutAThinkBlockIsAllContent) {
  ExpectSplit(SplitAllWays(false, "  Hello </think> <think>"), "", "  Hello </think> <think>");
  ExpectSplit(SplitAllWays(false, "x<think>y</think>"), "", "x<think>y</think>");
  ExpectSplit(SplitAllWays(false, ""), "", "");
  ExpectSplit(SplitAllWays(false, " \n"), "", " \n");
}

TEST(ReasoningParserTest, PromptOpenedBlockMakesOutputReasoningUntilClose) {
  ExpectSplit(SplitAllWays(true, "Okay, 2+2.\n</think>\n\n4"), "Okay, 2+2.\n", "4");
  ExpectSplit(SplitAllWays(true, "\nstill thinking"), "\nstill thinking", "");
}

TEST(ReasoningParserTest, DropsARepeatedOpenMarkerWhenThePromptOpenedTheBlock) {
  ExpectSplit(SplitAllWays(true, "\n<think>\nhmm</think>ok"), "\nhmm", "ok");
}

TEST(ReasoningParserTest, HoldsBackAPartialCloseMarker) {
  ReasoningParser parser(true);
  ReasoningSplit s = parser.Feed("abc</thi");
  EXPECT_EQ(s.reasoning, "abc");
  EXPECT_EQ(s.content, "");
  EXPECT_TRUE(parser.in_reasoning());
  s = parser.Feed("nk>\n");
  ExpectSplit(s, "", "");
  EXPECT_FALSE(parser.in_reasoning());
  ExpectSplit(parser.Feed("\nDone"), "", "Done");
  ExpectSplit(parser.Finish(), "", "");
}

TEST(ReasoningParserTest, ReleasesAPartialCloseMarkerThatDidNotComplete) {
  ReasoningParser parser(true);
  ExpectSplit(parser.Feed("a </th"), "a ", "");
  ExpectSplit(parser.Feed("ing> b <"), "</thing> b ", "");
  ExpectSplit(parser.Finish(), "<", "");  // an unclosed block ends as reasoning
}

TEST(ReasoningParserTest, HoldsBackLeadingWhitespaceAndAPartialOpenMarker) {
  ReasoningParser parser(false);
  ExpectSplit(parser.Feed("\n<thi"), "", "");
  EXPECT_FALSE(parser.in_reasoning());
  ExpectSplit(parser.Feed("nk>why"), "why", "");
  EXPECT_TRUE(parser.in_reasoning());

  ReasoningParser other(false);
  ExpectSplit(other.Feed(" <thi"), "", "");
  ExpectSplit(other.Feed("s is"), "", " <this is");
  EXPECT_FALSE(other.in_reasoning());
}

TEST(ReasoningParserTest, UnclosedBlockAtFinishIsReasoning) {
  ExpectSplit(SplitAllWays(false, "<think>cut off</thin"), "cut off</thin", "");
  ExpectSplit(SplitAllWays(false, "<th"), "", "<th");  // never became the open marker
}

TEST(ReasoningParserTest, OnlyTheFirstBlockCounts) {
  ExpectSplit(SplitAllWays(false, "<think>a</think> b <think>c</think>"), "a", "b <think>c</think>");
}

TEST(ReasoningParserTest, SupportsCustomMarkers) {
  ReasoningParser parser(false, "<|begin_of_thought|>", "<|end_of_thought|>");
  ReasoningSplit all;
  for (std::string_view piece : {"<|begin_of", "_thought|>x<|end_", "of_thought|>\ny"}) {
    ReasoningSplit s = parser.Feed(piece);
    all.reasoning += s.reasoning;
    all.content += s.content;
  }
  ExpectSplit(all, "x", "y");
}

TEST(ReasoningParserTest, IgnoresInputAfterFinish) {
  ReasoningParser parser(false);
  ExpectSplit(parser.Feed("hi"), "", "hi");
  ExpectSplit(parser.Finish(), "", "");
  ExpectSplit(parser.Feed("more"), "", "");
}

TEST(PromptOpensReasoningTest, TrueOnlyWhenThePromptEndsWithAnOpenMarker) {
  EXPECT_TRUE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(PromptOpensReasoning("<｜Assistant｜><think>"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n"));
  EXPECT_FALSE(PromptOpensReasoning("think>"));
  EXPECT_FALSE(PromptOpensReasoning(""));
  EXPECT_TRUE(PromptOpensReasoning("x[THINK] ", "[THINK]"));
}

}  // namespace
}  // namespace exl3serve::coordinator::http
