// DraftGovernor on synthetic step costs: it keeps drafting where drafting
// steps cost less per token than plain ones, turns it off where they cost
// more (at the end of the window that shows it), turns it on again when the
// costs change, counts gains that come in bursts (a ratio of sums), probes
// in interleaved windows of exactly `probe` / `probe_drafting` steps that
// back off while drafting loses, compares like with like (a cost that
// drifts over time, as attention does with context, decides nothing),
// classifies steps by what they did (allowed but nothing drafted = plain),
// skips a window's catch-up step, and ignores steps with prefill chunks.
#include "coordinator/draft_governor.h"

#include <random>

#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

// What a decode-only step did: whether it drafted, its time, its tokens.
struct StepOutcome {
  bool drafted;
  double seconds;
  int64_t tokens;
};

// Runs `steps` decode-only steps: before each, the governor says whether
// drafts are allowed (`on`); `step(on)` says what that step then did (each
// test's cost model); the governor observes it.
template <typename StepFn>
void DriveSteps(DraftGovernor& g, int steps, StepFn step) {
  for (int i = 0; i < steps; ++i) {
    const bool on = g.AllowDrafts();
    const StepOutcome s = step(on);
    g.Observe({.drafts_allowed = on, .drafted = s.drafted, .decode_only = true,
               .seconds = s.seconds, .tokens = s.tokens});
  }
}

// Runs `steps` decode-only steps: a step with drafts allowed drafts and
// costs `on_cost` per token, without `off_cost` (± `jitter` noise, 5 %).
// Returns the steps that drafted.
int RunSteps(DraftGovernor& g, int steps, double on_cost, double off_cost, std::mt19937& rng,
             double jitter = 0.05) {
  std::uniform_real_distribution<double> noise(1 - jitter, 1 + jitter);
  int drafted = 0;
  DriveSteps(g, steps, [&](bool on) {
    drafted += on;
    const int64_t tokens = on ? 12 : 8;
    return StepOutcome{on, (on ? on_cost : off_cost) * tokens * noise(rng), tokens};
  });
  return drafted;
}

TEST(DraftGovernorTest, KeepsDraftsThatPayAndDropsThoseThatDoNot) {
  std::mt19937 rng(3);
  DraftGovernor g;  // period 64, probe 8
  // Drafting halves the cost per token: it stays on, off only for the 8
  // interleaved plain steps of each period's window.
  EXPECT_EQ(RunSteps(g, 640, 0.5e-3, 1e-3, rng), 640 - 10 * 8);
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 0u);
  // The costs turn (say the text stopped repeating): off at the end of the
  // next window, then drafting only in the probes, which back off: a clear
  // loss (3x) probes 8 drafting steps 1, 4, 16, 16, ... periods apart.
  RunSteps(g, 64 + 16, 3e-3, 1e-3, rng);
  EXPECT_FALSE(g.choice());
  const int probed = RunSteps(g, 64 * 64, 3e-3, 1e-3, rng);
  EXPECT_GE(probed, 3 * 9);  // 8 sampled + 1 catch-up step a probe
  EXPECT_LE(probed, 6 * 9);  // vs 64 * 9 with a probe every period
  // And back on when drafting pays again (by the second probe at the latest).
  RunSteps(g, 64 * 33, 0.4e-3, 1e-3, rng);
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 2u);
}

TEST(DraftGovernorTest, ALosingDraftSourceIsOffAfterTheFirstWindow) {
  // The first window (8 drafting steps among 8 plain ones) decides: a draft
  // model at 2x plain per token drafts 8 steps, not a period.
  std::mt19937 rng(13);
  DraftGovernor g;
  EXPECT_EQ(RunSteps(g, 16, 2e-3, 1e-3, rng), 8);
  EXPECT_FALSE(g.choice());
  EXPECT_EQ(g.decisions(), 1u);
}

TEST(DraftGovernorTest, ProbesAreLongOnlyWhileTheLossIsSmall) {
  // A small loss (1.1x per token) could hide a burst: 32-step probes. A
  // clear one (1.5x, a draft model that loses at every step): 8-step probes.
  for (const double loss : {1.1, 1.5}) {
    std::mt19937 rng(11);
    DraftGovernor g;
    RunSteps(g, 128, loss * 1e-3, 1e-3, rng, /*jitter=*/0.01);
    ASSERT_FALSE(g.choice()) << loss;
    const bool clear = loss > 1.25;
    const int probe = clear ? 9 : 32;  // 8 + the unsampled catch-up step
    // The periods after the switch probe 1, 2, 4, 8, 16, 16, ... periods
    // apart (a clear loss: 1, 4, 16, 16, ...): every drafting step of the
    // next 64 periods belongs to one of 5-8 (4-6) probes (where the 128
    // steps above ended within a period decides).
    const int probed = RunSteps(g, 64 * 64, loss * 1e-3, 1e-3, rng, /*jitter=*/0.01);
    EXPECT_EQ(probed % probe, 0) << loss;
    EXPECT_GE(probed, (clear ? 4 : 5) * probe) << loss;
    EXPECT_LE(probed, (clear ? 6 : 8) * probe) << loss;
  }
}

TEST(DraftGovernorTest, ProbeWindowsInterleaveTheModes) {
  // While on: the window's even steps are plain, its odd ones drafting.
  DraftGovernor g;
  std::string modes;
  DriveSteps(g, 20, [&](bool on) {
    modes += on ? 'd' : 'p';
    return StepOutcome{on, 1e-3, on ? 4 : 1};
  });
  EXPECT_EQ(modes, "pdpdpdpdpdpdpdpddddd");
}

TEST(DraftGovernorTest, CostsThatDriftOverTimeDoNotDecide) {
  // A step's cost grows 3x over 256 steps (attention over a growing
  // context), the same for both modes; a draft model whose steps cost 1.2x
  // plain per token at any one time. Comparing drafting late with plain
  // early would call it a gain; the interleaved window sees 1.2x.
  DraftGovernor g;
  int drafted = 0, i = 0;
  DriveSteps(g, 256, [&](bool on) {
    drafted += on;
    const double base = 1e-3 * (1 + 2.0 * i++ / 256);
    return StepOutcome{on, (on ? 1.2 : 1.0) * base * 8, 8};
  });
  EXPECT_FALSE(g.choice());
  ASSERT_TRUE(g.drafting_cost_ratio().has_value());
  EXPECT_NEAR(*g.drafting_cost_ratio(), 1.2, 0.05);
  EXPECT_LE(drafted, 8 + 2 * 32);  // the first window, then two long probes (1.2x < 1.25x)
}

TEST(DraftGovernorTest, GainsThatComeInBurstsAreCounted) {
  // Only every 8th drafting-allowed step has a draft (7 tokens for 1.5x a
  // plain step's time); the others draft nothing and are plain steps. Per
  // token of the steps that drafted that is 0.21x.
  DraftGovernor g;
  int on_steps = 0;
  DriveSteps(g, 64 * 10, [&](bool on) {
    const bool burst = on && ++on_steps % 8 == 1;
    return StepOutcome{burst, burst ? 1.5e-3 : 1e-3, burst ? 7 : 1};
  });
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 0u);
  ASSERT_TRUE(g.drafting_cost_ratio().has_value());
  EXPECT_LT(*g.drafting_cost_ratio(), 0.3);
}

TEST(DraftGovernorTest, StepsAllowedToDraftThatDraftedNothingArePlain) {
  // Every 4th allowed step drafts, at 2x plain per token; the others cost
  // what plain steps cost. Counted by what was allowed, the drafting mode
  // would look 1.25x — counted by what drafted, it is 2x: a clear loss.
  DraftGovernor g;
  int on_steps = 0;
  DriveSteps(g, 64 * 8, [&](bool on) {
    const bool drafts = on && ++on_steps % 4 == 0;
    return StepOutcome{drafts, drafts ? 4e-3 : 1e-3, drafts ? 2 : 1};
  });
  EXPECT_FALSE(g.choice());
  ASSERT_TRUE(g.drafting_cost_ratio().has_value());
  EXPECT_GT(*g.drafting_cost_ratio(), 1.5);
}

TEST(DraftGovernorTest, NothingDraftedDecidesNothing) {
  // An n-gram source on text that never repeats: no step drafts, nothing
  // is decided, drafting stays allowed (it costs nothing).
  DraftGovernor g;
  DriveSteps(g, 64 * 8, [](bool) { return StepOutcome{false, 1e-3, 1}; });
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.decisions(), 0u);
}

TEST(DraftGovernorTest, AWindowsCatchUpStepIsNotSampled) {
  // Drafting is off; then it pays (0.5x per token), but the first drafting
  // step of each probe costs 10x (a draft model catching up a whole
  // sequence). Sampled, that step would make each window a loss (1.0x).
  std::mt19937 rng(17);
  DraftGovernor g;
  RunSteps(g, 64, 2e-3, 1e-3, rng);
  ASSERT_FALSE(g.choice());
  // (The first window's 2x cost delays the first probe ~9 periods: budget.)
  int plain_run = 2;  // plain steps since the last drafting step
  DriveSteps(g, 64 * 16, [&](bool on) {
    double per_token = on ? 0.5e-3 : 1e-3;
    if (on && plain_run > 1) per_token *= 10;  // a window's first drafting step
    plain_run = on ? 0 : plain_run + 1;
    return StepOutcome{on, per_token * (on ? 12 : 8), on ? 12 : 8};
  });
  EXPECT_TRUE(g.choice());
}

TEST(DraftGovernorTest, ProbesOfACostlyLosingSourceKeepToTheBudget) {
  // Drafting steps cost 6x a plain step for 1.5x its tokens (a draft model
  // on a CPU), and each probe's first drafting step 40x (catch-up). Beyond
  // the first window, probing may cost ~2 % of the plain time, not the
  // ~8 % that 8-step probes every 16 periods would.
  DraftGovernor g;
  double plain_seconds = 0, excess_seconds = 0;
  int windows = 0;
  bool previous_on = false;
  int i = 0;
  DriveSteps(g, 64 * 400, [&](bool on) {
    const bool catch_up = on && i > 16 && !previous_on && g.choice() == false &&
                          (i % 64) == 0;  // a window's first step
    windows += catch_up;
    const double seconds = on ? (catch_up ? 40e-3 : 6e-3) : 1e-3;
    const int64_t tokens = on ? 3 : 2;
    if (on && i >= 16) excess_seconds += seconds - tokens * 0.5e-3;
    if (!on) plain_seconds += seconds;
    previous_on = on;
    ++i;
    return StepOutcome{on, seconds, tokens};
  });
  EXPECT_FALSE(g.choice());
  EXPECT_GE(windows, 3);  // it still probes
  EXPECT_LE(excess_seconds, 0.025 * plain_seconds) << windows << " probe windows";
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
    const bool on = g.AllowDrafts();
    g.Observe({.drafts_allowed = on, .drafted = on, .decode_only = false, .seconds = 1e-9,
               .tokens = 100});
  }
  EXPECT_FALSE(g.drafting_cost_ratio().has_value());
  EXPECT_EQ(g.decisions(), 0u);
  EXPECT_FALSE(g.AllowDrafts());  // still the first step of the first window
}

TEST(DraftGovernorTest, NoDecisionBeforeBothKindsHaveMinSamples) {
  // A window while on has 8 plain and 8 drafting steps: min_samples 8
  // decides at the first window's end, 9 at the second's (samples add up
  // over windows; the steps between windows are no samples).
  for (const int min_samples : {8, 9}) {
    DraftGovernorOptions options;
    options.min_samples = min_samples;
    DraftGovernor g(options);
    std::mt19937 rng(7);
    RunSteps(g, 64 + 15, 5e-3, 1e-3, rng);  // drafting 5x as costly
    EXPECT_EQ(g.choice(), min_samples > 8) << min_samples;
    EXPECT_EQ(g.decisions(), min_samples > 8 ? 0u : 1u) << min_samples;
    RunSteps(g, 1, 5e-3, 1e-3, rng);  // the second window's last step
    EXPECT_FALSE(g.choice()) << min_samples;
  }
}

TEST(DraftGovernorTest, FewDraftingStepsAWindowAddUpBeforeDeciding) {
  // n-gram drafts on a quarter of the steps it may (2 of a window's 8),
  // and the first ones are rejected (2x plain per token) while the rest
  // pay (0.6x). A decision on the first window's 2 steps would say "off";
  // with 8 drafting samples over 4 windows it says "on" and never switched.
  DraftGovernor g;
  int allowed = 0;
  DriveSteps(g, 64 * 12, [&](bool on) {
    const bool drafts = on && ++allowed % 4 == 0;
    const double per_token = !drafts ? 1e-3 : (allowed <= 8 ? 2e-3 : 0.6e-3);
    const int64_t tokens = drafts ? 4 : 1;
    return StepOutcome{drafts, per_token * tokens, tokens};
  });
  EXPECT_TRUE(g.choice());
  EXPECT_EQ(g.switches(), 0u);
  EXPECT_GE(g.decisions(), 1u);
}

}  // namespace
}  // namespace exl3serve::coordinator
