// coordinator::NgramDrafter against its direct-scan reference on random
// sequences over small alphabets (many repeats, so matches of every length
// occur) of odd lengths, grown token by token and in chunks, truncated and
// regrown; plus the rule on hand-made cases.
#include "coordinator/ngram_drafter.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(NgramDrafterTest, TheLongestSuffixSeenBeforeProposesWhatFollowedItsLastOccurrence) {
  NgramDrafter d({.min_match = 2, .max_match = 4});
  // 5 6 7 8 9 | 1 6 7 8 2 | 6 7 8: suffix "6 7 8" occurred twice before;
  // the last occurrence (ending at index 8) was followed by 2 6 7 8.
  d.Append(std::vector<int32_t>{5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 6, 7, 8});
  EXPECT_THAT(d.Propose(3), ElementsAre(2, 6, 7));
  EXPECT_THAT(d.Propose(10), ElementsAre(2, 6, 7, 8));  // never past the end
  EXPECT_THAT(d.Propose(0), IsEmpty());
  // A longer match wins over a more recent shorter one: "9 1 6" ... then "1 6".
  NgramDrafter e({.min_match = 1, .max_match = 3});
  e.Append(std::vector<int32_t>{9, 1, 6, 40, 41, 2, 6, 50, 9, 1, 6});
  EXPECT_THAT(e.Propose(2), ElementsAre(40, 41));
}

TEST(NgramDrafterTest, NoDraftWithoutAMatchOfTheMinimumLength) {
  NgramDrafter d({.min_match = 3, .max_match = 5});
  EXPECT_THAT(d.Propose(4), IsEmpty());  // empty sequence
  d.Append(std::vector<int32_t>{1, 2, 3, 4, 1, 2});  // "1 2" repeats, but 2 < min_match
  EXPECT_THAT(d.Propose(4), IsEmpty());
  d.Append(std::vector<int32_t>{3});  // now "1 2 3" repeats
  EXPECT_THAT(d.Propose(4), ElementsAre(4, 1, 2, 3));
  NgramDrafter same({.min_match = 1, .max_match = 8});
  same.Append(std::vector<int32_t>{7, 7, 7});  // overlapping occurrences
  EXPECT_THAT(same.Propose(5), ElementsAre(7));
}

void ExpectSameAsReference(const NgramDrafter& d, int max_tokens, const char* where) {
  const std::vector<int32_t> want =
      NgramDrafter::ProposeReference(d.tokens(), d.options(), max_tokens);
  ASSERT_EQ(d.Propose(max_tokens), want) << where << " at length " << d.size();
}

TEST(NgramDrafterTest, RandomSequencesMatchTheDirectScan) {
  std::mt19937 rng(20261202);
  for (int trial = 0; trial < 60; ++trial) {
    const int alphabet = 2 + static_cast<int>(rng() % 7);
    const int min_match = 1 + static_cast<int>(rng() % 3);
    const int max_match = min_match + static_cast<int>(rng() % 6);
    NgramDrafter d({.min_match = min_match, .max_match = max_match});
    const int length = 1 + static_cast<int>(rng() % 301);
    while (d.size() < length) {
      // Token by token or in chunks of up to 9 (a prompt, then outputs).
      std::vector<int32_t> chunk(1 + rng() % 9);
      for (int32_t& t : chunk) t = static_cast<int32_t>(rng() % alphabet);
      d.Append(chunk);
      ExpectSameAsReference(d, 1 + static_cast<int>(rng() % 7), "append");
      if (rng() % 23 == 0) {  // cut back and regrow
        d.Truncate(static_cast<int64_t>(rng() % (d.size() + 1)));
        ExpectSameAsReference(d, 5, "truncate");
      }
    }
  }
}

TEST(NgramDrafterTest, ALongRepetitiveSequenceDraftsTheContinuationOfItsLoop) {
  // Code-like text: a loop body repeated; the draft is the next lines.
  std::vector<int32_t> body;
  for (int i = 0; i < 40; ++i) body.push_back(100 + i);
  NgramDrafter d({});
  for (int rep = 0; rep < 3; ++rep) d.Append(body);
  d.Append(std::vector<int32_t>{100, 101, 102});
  EXPECT_THAT(d.Propose(4), ElementsAre(103, 104, 105, 106));
}

}  // namespace
}  // namespace exl3serve::coordinator
