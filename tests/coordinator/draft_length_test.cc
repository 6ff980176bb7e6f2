// coordinator::AdaptiveDraftLength: the window follows acceptance by the
// documented EMA (checked against a float64 recomputation of the rule on a
// random acceptance history), shrinks to 0 when drafts do not pay, probes
// every 16 rounds, and grows back when probes are accepted.
#include "coordinator/draft_length.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

TEST(AdaptiveDraftLengthTest, StartsAtTheMaximumAndFollowsAcceptance) {
  AdaptiveDraftLength len(5);
  EXPECT_EQ(len.Next(), 5);
  len.Observe(5, 5);  // a = 6: ema = 6
  EXPECT_DOUBLE_EQ(*len.ema(), 6.0);
  EXPECT_EQ(len.Next(), 5);  // clamped to max_draft
  len.Observe(5, 1);  // a = 1 < 6: 0.65 * 1 + 0.35 * 6 = 2.75
  EXPECT_DOUBLE_EQ(*len.ema(), 2.75);
  EXPECT_EQ(len.Next(), 3);
  len.Observe(3, 3);  // a = 4 > 2.75: 1.3 * 4 - 0.3 * 2.75 = 4.375
  EXPECT_DOUBLE_EQ(*len.ema(), 4.375);
  EXPECT_EQ(len.Next(), 5);
  len.Observe(0, 0);  // nothing drafted: unchanged
  EXPECT_DOUBLE_EQ(*len.ema(), 4.375);
}

TEST(AdaptiveDraftLengthTest, RejectedDraftsStopDraftingExceptForProbes) {
  AdaptiveDraftLength len(4);
  len.Observe(len.Next(), 0);  // ema 0
  for (int cycle = 0; cycle < 3; ++cycle) {
    for (int r = 1; r < 16; ++r) ASSERT_EQ(len.Next(), 0) << "round " << r;
    ASSERT_EQ(len.Next(), 2) << "the probe";  // min(2, max_draft)
    len.Observe(2, 0);
  }
  // A probe that is accepted in full brings drafting back: a = 3 > 0.
  for (int r = 1; r < 16; ++r) ASSERT_EQ(len.Next(), 0);
  ASSERT_EQ(len.Next(), 2);
  len.Observe(2, 2);
  EXPECT_NEAR(*len.ema(), 3.9, 1e-12);  // 1.3 * 3 - 0.3 * 0
  EXPECT_EQ(len.Next(), 4);
  AdaptiveDraftLength one(1);
  one.Observe(1, 0);
  for (int r = 1; r < 16; ++r) ASSERT_EQ(one.Next(), 0);
  EXPECT_EQ(one.Next(), 1);  // min(2, 1)
  AdaptiveDraftLength never(0);
  EXPECT_EQ(never.Next(), 0);
}

TEST(AdaptiveDraftLengthTest, RandomHistoriesFollowTheRuleInFloat64) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int max_draft = 1 + static_cast<int>(rng() % 8);
    AdaptiveDraftLength len(max_draft);
    double ema = -1;
    int since_probe = 0;
    for (int round = 0; round < 300; ++round) {
      int want;
      if (ema < 0) {
        want = max_draft;
      } else if (ema < 0.3) {
        want = ++since_probe < 16 ? 0 : (since_probe = 0, std::min(2, max_draft));
      } else {
        since_probe = 0;
        want = std::clamp(static_cast<int>(std::ceil(ema)), 1, max_draft);
      }
      const int window = len.Next();
      ASSERT_EQ(window, want) << "trial " << trial << " round " << round;
      // Acceptance drifts between phases of good and bad drafts.
      const bool good = (round / 50) % 2 == 0;
      const int accepted = window == 0 ? 0 : static_cast<int>(rng() % (good ? window + 1 : 2));
      len.Observe(window, accepted);
      if (window > 0) {
        const double a = accepted + (accepted == window ? 1 : 0);
        ema = ema < 0 ? a : (a > ema ? 1.3 * a - 0.3 * ema : 0.65 * a + 0.35 * ema);
      }
      ASSERT_EQ(len.ema().has_value(), ema >= 0);
      if (ema >= 0) {
        ASSERT_NEAR(*len.ema(), ema, 1e-9);
      }
    }
  }
}

}  // namespace
}  // namespace exl3serve::coordinator
