// DraftGovernor on synthetic step costs: it keeps drafting where drafting
// costs less per token, turns it off where it costs more (within one period
// after the evidence), turns it on again when the costs change, counts gains
// that come in bursts (a ratio of sums per period), probes the other mode
// for exactly `probe` steps of every period, and ignores steps with prefill
// chunks.
#include "coordinator/draft_governor.h"

#include <random>

#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

// Runs `steps` decode-only steps: a step with drafts allowed costs
// `on_cost` per token, without `off_cost` (± `jitter` noise, 5 %). Returns
// the steps that drafted.
int RunSteps(DraftGovernor& g, int steps, double on_cost, double off_cost, std::mt19937& rng,
        double jitter = 0.05) {
  std::uniform_real_distribution<double> noise(1 - jitter, 1 + jitter);
  int drafted = 0;
  for (int i = 0; i < steps; ++i) {
    const bool on = g.AllowDrafts();
    drafted += on;
    const int64_t tokens = on ? 12 : 8;
    g.Observe({.drafts_allowed = on,
               .decode_only = true,
               .seconds = (on ? on_cost : off_cost) * tokens * noise(rng),
               .tokens = tokens});
  }
  return drafted;
}

TEST(DraftGovernorTest, KeepsDraftsThatPayAndDropsThoseThatDoNot) {
  std::mt19937 rng(3);
  DraftGovernor g;  // period 64, probe 8
  // Drafting halves the cost per token: it stays on, off only for probes.
  EXPECT_EQ(RunSteps(g, 640, 0.5e-3, 1e-3, rng), 640 - 10 * 8);
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 0u);
  // The costs turn (say the text stopped repeating): off within a period
  // of the evidence, then drafting only in the probes, which back off: the
  // periods after the switch probe at 1, 2, 4, 8, 16, 16, ... periods.
  RunSteps(g, 128, 2e-3, 1e-3, rng);
  EXPECT_FALSE(g.choice());
  const int probed = RunSteps(g, 64 * 64, 2e-3, 1e-3, rng);
  EXPECT_GE(probed, 5 * 8);  // a clear loss (2x): probes of drafting are 8 steps
  EXPECT_LE(probed, 8 * 8);  // vs 64 * 8 with a probe every period
  // And back on when drafting pays again (by the second probe at the latest).
  RunSteps(g, 64 * 33, 0.4e-3, 1e-3, rng);
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 2u);
}

TEST(DraftGovernorTest, ProbesAreLongOnlyWhileTheLossIsSmall) {
  // A small loss (1.1x per token) could hide a burst: 32-step probes. A
  // clear one (1.5x, a draft model that loses at every step): 8-step probes.
  for (const double loss : {1.1, 1.5}) {
    std::mt19937 rng(11);
    DraftGovernor g;
    RunSteps(g, 128, loss * 1e-3, 1e-3, rng, /*jitter=*/0.01);
    ASSERT_FALSE(g.choice()) << loss;
    const int probe = loss < 1.25 ? 32 : 8;
    // Periods after the switch probe at 1, 2, 4, 8, 16, 16, ... periods:
    // every drafting step of the next 64 periods belongs to one of 7 probes.
    const int probed = RunSteps(g, 64 * 64, loss * 1e-3, 1e-3, rng, /*jitter=*/0.01);
    EXPECT_EQ(probed % probe, 0) << loss;
    EXPECT_GE(probed, 5 * probe) << loss;
    EXPECT_LE(probed, 8 * probe) << loss;
  }
}

TEST(DraftGovernorTest, GainsThatComeInBurstsAreCounted) {
  // Only every 8th drafting step has a draft (7 tokens for 1.5x a plain
  // step's time); the others cost what a plain step costs. Per token that
  // is 0.6x, though most drafting steps, the last ones of a period
  // included, look exactly like plain steps.
  DraftGovernor g;
  int on_steps = 0;
  for (int i = 0; i < 64 * 10; ++i) {
    const bool on = g.AllowDrafts();
    const bool burst = on && ++on_steps % 8 == 1;
    g.Observe({.drafts_allowed = on,
               .decode_only = true,
               .seconds = burst ? 1.5e-3 : 1e-3,
               .tokens = burst ? 7 : 1});
  }
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 0u);
  EXPECT_LT(*g.drafting_seconds_per_token(), 0.7 * *g.plain_seconds_per_token());
}

TEST(DraftGovernorTest, ACostWithinTheMarginIsNotWorthDrafting) {
  std::mt19937 rng(5);
  DraftGovernor g;
  RunSteps(g, 256, 0.99e-3, 1e-3, rng, /*jitter=*/0.002);  // 1 % cheaper: below the 3 % margin
  EXPECT_FALSE(g.choice());
}

TEST(DraftGovernorTest, PrefillStepsAreNotTimedAndDoNotAdvanceThePeriod) {
  DraftGovernor g;
  for (int i = 0; i < 1000; ++i) {
    // Prefill steps that look very cheap for drafting must not decide.
    g.Observe({.drafts_allowed = g.AllowDrafts(), .decode_only = false, .seconds = 1e-9, .tokens = 100});
  }
  EXPECT_FALSE(g.drafting_seconds_per_token().has_value());
  EXPECT_FALSE(g.plain_seconds_per_token().has_value());
  EXPECT_FALSE(g.AllowDrafts());  // still the first probe of the first period
}

TEST(DraftGovernorTest, NoDecisionBeforeBothModesWereMeasured) {
  DraftGovernorOptions options;
  options.min_samples = 100;  // the probes give 8 plain steps a period
  DraftGovernor g(options);
  std::mt19937 rng(7);
  RunSteps(g, 64 * 12, 5e-3, 1e-3, rng);  // drafting 5x as costly, but 96 plain samples
  EXPECT_TRUE(g.choice());
  RunSteps(g, 64, 5e-3, 1e-3, rng);  // the 13th period brings 104
  EXPECT_FALSE(g.choice());
}

}  // namespace
}  // namespace exl3serve::coordinator
