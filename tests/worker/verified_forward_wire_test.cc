// Speculative verification on the wires, without processes: the shared
// checks (worker/api/verified_forward.h) against a direct restatement of
// the rules over random batches; the control wire's runs (EncodeSampledRuns /
// DecodeSampledRuns) round trip for random runs and refuse every truncation
// and a count the bytes cannot hold; the rank protocol's translation
// (RankCommandFromStep) carries num_draft into a verified command and
// refuses malformed verified forwards with InvalidArgument naming the step.
#include <random>
#include <string>
#include <vector>

#include "exl3serve/rank/v1/rank.pb.h"
#include "gtest/gtest.h"
#include "worker/api/verified_forward.h"
#include "worker/rank/control_wire.h"
#include "worker/rank/step_command.h"

namespace exl3serve::worker {
namespace {

namespace pb = ::exl3serve::rank::v1;

uint32_t GtestSeed() {
  return static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
}

// The rule of CheckDraftCounts, restated per entry.
bool EntryDraftValid(size_t tokens, uint8_t sample, int32_t d) {
  if (d == 0) return true;
  return d > 0 && sample != 0 && static_cast<size_t>(d) < tokens;
}

TEST(VerifiedForwardChecksTest, DraftCountsFollowTheRuleOnRandomBatches) {
  std::mt19937 rng(GtestSeed());
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int valid = 0, invalid = 0;
  for (int round = 0; round < 2000; ++round) {
    const int n = uniform(1, 5);
    std::vector<std::vector<int32_t>> tokens(n);
    std::vector<SequenceTokens> batch(n);
    std::vector<uint8_t> sample(n);
    std::vector<int32_t> drafts(n);
    bool want = true;
    for (int i = 0; i < n; ++i) {
      tokens[i].assign(uniform(1, 7), 5);
      batch[i] = {i, tokens[i]};
      sample[i] = uniform(0, 3) != 0;
      drafts[i] = uniform(0, 2) == 0 ? uniform(-2, 9) : 0;
      want &= EntryDraftValid(tokens[i].size(), sample[i], drafts[i]);
    }
    const absl::Status s = CheckDraftCounts(batch, sample, drafts);
    EXPECT_EQ(s.ok(), want) << s;
    if (!s.ok()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("draft tokens"), std::string::npos) << s;
    }
    ++(want ? valid : invalid);
  }
  EXPECT_GT(valid, 100);
  EXPECT_GT(invalid, 100);
  const std::vector<int32_t> t = {1, 2};
  const SequenceTokens one{1, t};
  const uint8_t yes = 1;
  const int32_t zero = 0;
  EXPECT_EQ(CheckDraftCounts({}, {}, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckDraftCounts({&one, 1}, {}, {&zero, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckDraftCounts({&one, 1}, {&yes, 1}, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(VerifiedForwardChecksTest, RunsThatNoVerificationProducesAreDataLoss) {
  // Entry 0: sampled, tokens {7, 40, 41, 42} with 3 drafts; entry 1: an
  // unsampled chunk; entry 2: sampled, no drafts.
  const std::vector<int32_t> t0 = {7, 40, 41, 42}, t1 = {1, 2, 3}, t2 = {9};
  const std::vector<SequenceTokens> batch = {{1, t0}, {2, t1}, {3, t2}};
  const std::vector<uint8_t> sample = {1, 0, 1};
  const std::vector<int32_t> drafts = {3, 0, 0};
  auto run = [](std::vector<int32_t> ids) {
    std::vector<SampledToken> out;
    for (int32_t id : ids) out.push_back({.id = id});
    return out;
  };
  using Runs = std::vector<std::vector<SampledToken>>;
  // Every possible answer for entry 0: k accepted drafts, then any token.
  for (int k = 0; k <= 3; ++k) {
    std::vector<int32_t> ids(t0.begin() + 1, t0.begin() + 1 + k);
    ids.push_back(k == 3 ? 999 : 500);
    EXPECT_TRUE(CheckVerifiedRuns(batch, sample, drafts, 1000, Runs{run(ids), {}, run({0})}).ok())
        << k;
  }
  const std::vector<Runs> bad = {
      Runs{run({40}), {}},                                  // two runs for three entries
      Runs{run({40}), {}, run({1}), run({1})},              // four
      Runs{{}, {}, run({1})},                               // a sampled entry without a token
      Runs{run({40, 41, 42, 5, 6}), {}, run({1})},          // longer than drafts + 1
      Runs{run({40, 99, 5}), {}, run({1})},                 // accepts a token that is not the draft
      Runs{run({40}), run({8}), run({1})},                  // a token for an unsampled entry
      Runs{run({40}), {}, run({1, 2})},                     // two tokens without drafts
      Runs{run({1000}), {}, run({1})},                      // outside the vocabulary
      Runs{run({40}), {}, run({-1})},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const absl::Status s = CheckVerifiedRuns(batch, sample, drafts, 1000, bad[i]);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "case " << i << ": " << s;
    EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s;
  }
}

TEST(ControlWireRunsTest, RandomRunsRoundTripAndEveryTruncationIsRefused) {
  std::mt19937 rng(GtestSeed() + 1);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int round = 0; round < 50; ++round) {
    std::vector<std::vector<SampledToken>> runs(uniform(0, 4));
    for (auto& r : runs) {
      r.resize(uniform(0, 4));
      for (SampledToken& t : r) {
        t.id = uniform(0, 100000);
        t.logprob = -static_cast<float>(uniform(0, 1000)) / 37.0f;
        for (int k = uniform(0, 3); k > 0; --k) {
          t.top_logprobs.push_back({uniform(0, 999), -static_cast<float>(uniform(0, 99))});
        }
      }
    }
    rank::WireWriter w;
    rank::EncodeSampledRuns(runs, &w);
    const std::string bytes = w.data();
    rank::WireReader in(bytes);
    std::vector<std::vector<SampledToken>> back;
    ASSERT_TRUE(rank::DecodeSampledRuns(&in, &back).ok());
    ASSERT_TRUE(in.Finish("runs").ok());
    ASSERT_EQ(back.size(), runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      ASSERT_EQ(back[i].size(), runs[i].size());
      for (size_t j = 0; j < runs[i].size(); ++j) {
        EXPECT_EQ(back[i][j].id, runs[i][j].id);
        EXPECT_EQ(back[i][j].logprob, runs[i][j].logprob);
        ASSERT_EQ(back[i][j].top_logprobs.size(), runs[i][j].top_logprobs.size());
        for (size_t k = 0; k < runs[i][j].top_logprobs.size(); ++k) {
          EXPECT_EQ(back[i][j].top_logprobs[k].id, runs[i][j].top_logprobs[k].id);
          EXPECT_EQ(back[i][j].top_logprobs[k].logprob, runs[i][j].top_logprobs[k].logprob);
        }
      }
    }
    for (size_t cut = 0; cut < bytes.size(); ++cut) {
      rank::WireReader part(std::string_view(bytes).substr(0, cut));
      std::vector<std::vector<SampledToken>> out;
      absl::Status s = rank::DecodeSampledRuns(&part, &out);
      if (s.ok()) s = part.Finish("runs");
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "cut at " << cut;
    }
  }
  // A count the bytes cannot hold is refused before anything is allocated.
  rank::WireWriter huge;
  huge.U32(0xffffffffu);
  rank::WireReader in(huge.data());
  std::vector<std::vector<SampledToken>> out;
  EXPECT_EQ(rank::DecodeSampledRuns(&in, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(out.empty());
}

// A verified forward step as the coordinator sends it.
pb::Step VerifiedStep(const std::vector<std::vector<int32_t>>& tokens,
                      const std::vector<bool>& sample, const std::vector<int32_t>& drafts) {
  pb::Step step;
  step.set_step_id(17);
  step.set_group_generation(3);
  pb::ForwardBatch* f = step.mutable_forward();
  f->set_sampled(true);
  f->set_verified(true);
  f->set_rows(pb::LOGITS_ROWS_LAST_TOKEN);
  for (size_t i = 0; i < tokens.size(); ++i) {
    pb::SequenceTokens* seq = f->add_sequences();
    seq->set_seq_id(static_cast<int64_t>(100 + i));
    seq->mutable_token_ids()->Add(tokens[i].begin(), tokens[i].end());
    seq->add_block_ids(static_cast<int32_t>(i));
    seq->set_sample(sample[i]);
    seq->set_num_draft(drafts[i]);
  }
  return step;
}

TEST(RankProtocolVerifiedTest, NumDraftReachesTheCommandAndMalformedStepsAreRefused) {
  absl::StatusOr<rank::RankCommand> ok =
      rank::RankCommandFromStep(VerifiedStep({{1, 2, 3}, {4, 5}}, {true, false}, {2, 0}), 3);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->batch_draft, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(ok->batch_sample, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(ok->batch_tokens[0], (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(ok->batch_new_pages[1], (std::vector<int32_t>{1}));

  // A sampled forward that is not verified carries no drafts.
  pb::Step plain = VerifiedStep({{1, 2}}, {true}, {0});
  plain.mutable_forward()->set_verified(false);
  absl::StatusOr<rank::RankCommand> sampled = rank::RankCommandFromStep(plain, 3);
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_TRUE(sampled->batch_draft.empty());

  std::vector<pb::Step> bad = {
      VerifiedStep({{1, 2, 3}}, {true}, {-1}),          // negative
      VerifiedStep({{1, 2, 3}}, {true}, {3}),           // no accepted token before the drafts
      VerifiedStep({{1, 2, 3}}, {true}, {1 << 30}),     // huge
      VerifiedStep({{1, 2, 3}}, {false}, {1}),          // drafts on an unsampled entry
      VerifiedStep({{}}, {true}, {1}),                  // no tokens at all
  };
  pb::Step unsampled = VerifiedStep({{1, 2, 3}}, {true}, {1});
  unsampled.mutable_forward()->set_sampled(false);  // verified needs sampled
  bad.push_back(unsampled);
  pb::Step stray = VerifiedStep({{1, 2, 3}}, {true}, {1});
  stray.mutable_forward()->set_verified(false);  // num_draft outside a verified forward
  bad.push_back(stray);
  for (size_t i = 0; i < bad.size(); ++i) {
    pb::Step wire;  // through the bytes, as a rank reads it
    ASSERT_TRUE(wire.ParseFromString(bad[i].SerializeAsString()));
    absl::StatusOr<rank::RankCommand> c = rank::RankCommandFromStep(wire, 3);
    ASSERT_FALSE(c.ok()) << "case " << i;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    EXPECT_NE(c.status().message().find("step 17"), std::string::npos) << c.status();
  }
}

}  // namespace
}  // namespace exl3serve::worker
