// worker::Sampler against straightforward references on small logit
// vectors: each step (penalties, temperature, top-k, top-p, min-p), greedy,
// seeded draws, and logprobs.
#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::worker {
namespace {

constexpr double kTolerance = 1e-12;

const std::vector<float> kLogits = {1.0f, 3.0f, -0.5f, 2.0f, 3.0f, 0.25f, -2.0f};

std::vector<double> Softmax(const std::vector<double>& z, double temperature) {
  std::vector<double> p(z.size());
  double sum = 0.0;
  for (size_t i = 0; i < z.size(); ++i) sum += p[i] = std::exp(z[i] / temperature);
  for (double& x : p) x /= sum;
  return p;
}

std::vector<double> Renormalised(std::vector<double> p, const std::vector<bool>& keep) {
  double sum = 0.0;
  for (size_t i = 0; i < p.size(); ++i) sum += keep[i] ? p[i] : 0.0;
  for (size_t i = 0; i < p.size(); ++i) p[i] = keep[i] ? p[i] / sum : 0.0;
  return p;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], kTolerance) << "id " << i;
}

Sampler Make(const SamplingParams& params, std::vector<int32_t> prompt = {}) {
  auto sampler = Sampler::Create(params, prompt);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  return *std::move(sampler);
}

std::vector<double> AsDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST(SamplerTest, TemperatureScalesLogitsBeforeSoftmax) {
  SamplingParams params;
  params.temperature = 0.7f;
  ExpectNear(Make(params).Distribution(kLogits), Softmax(AsDouble(kLogits), double{0.7f}));
}

TEST(SamplerTest, GreedyPicksTheLowestIdAmongEqualMaxima) {
  SamplingParams params;
  params.temperature = 0.0f;
  Sampler sampler = Make(params);
  std::vector<double> want(kLogits.size(), 0.0);
  want[1] = 1.0;  // ids 1 and 4 tie at 3.0
  ExpectNear(sampler.Distribution(kLogits), want);
  EXPECT_EQ(sampler.Sample(kLogits).id, 1);
}

TEST(SamplerTest, TopKKeepsTheKMostLikely) {
  SamplingParams params;
  params.top_k = 3;
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.0);
  ExpectNear(Make(params).Distribution(kLogits),
             Renormalised(p, {false, true, false, true, true, false, false}));
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingTheMass) {
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.0);
  // Descending: ids 1, 4 (equal), 3, 0, 5, 2, 6.
  const std::vector<int> order = {1, 4, 3, 0, 5, 2, 6};
  for (float top_p : {0.2f, 0.5f, 0.8f, 0.95f}) {
    std::vector<bool> keep(p.size(), false);
    double before = 0.0;
    for (int id : order) {
      if (before >= top_p) break;
      keep[id] = true;
      before += p[id];
    }
    SamplingParams params;
    params.top_p = top_p;
    ExpectNear(Make(params).Distribution(kLogits), Renormalised(p, keep));
  }
}

TEST(SamplerTest, MinPDropsTokensBelowAFractionOfTheMaximum) {
  SamplingParams params;
  params.min_p = 0.3f;
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.0);
  std::vector<bool> keep(p.size());
  const double pmax = *std::max_element(p.begin(), p.end());
  for (size_t i = 0; i < p.size(); ++i) keep[i] = p[i] >= 0.3 * pmax;
  ExpectNear(Make(params).Distribution(kLogits), Renormalised(p, keep));
}

TEST(SamplerTest, FiltersComposeInOrderTopKThenTopPThenMinP) {
  SamplingParams params;
  params.top_k = 4;
  params.top_p = 0.9f;
  params.min_p = 0.5f;
  params.temperature = 1.5f;
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.5);
  // top-k 4: ids 1, 4, 3, 0. top-p over those renormalised: keep while the
  // mass before < 0.9. min-p: >= 0.5 · p[1].
  std::vector<bool> keep(p.size(), false);
  const std::vector<int> top4 = {1, 4, 3, 0};
  double mass = 0.0;
  for (int id : top4) mass += p[id];
  double before = 0.0;
  for (int id : top4) {
    if (before / mass >= 0.9) break;
    keep[id] = true;
    before += p[id];
  }
  for (size_t i = 0; i < p.size(); ++i) keep[i] = keep[i] && p[i] >= 0.5 * p[1];
  ExpectNear(Make(params).Distribution(kLogits), Renormalised(p, keep));
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOfSeenTokens) {
  SamplingParams params;
  params.repetition_penalty = 1.3f;
  Sampler sampler = Make(params, /*prompt=*/{1, 2, 1});
  sampler.Accept(5);
  std::vector<double> z = AsDouble(kLogits);
  const double r = 1.3f;
  z[1] /= r;  // 3.0 > 0
  z[2] *= r;  // -0.5 < 0
  z[5] /= r;
  ExpectNear(sampler.Distribution(kLogits), Softmax(z, 1.0));
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesCountOutputTokensOnly) {
  SamplingParams params;
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.25f;
  Sampler sampler = Make(params, /*prompt=*/{0});
  sampler.Accept(3);
  sampler.Accept(3);
  sampler.Accept(6);
  std::vector<double> z = AsDouble(kLogits);
  z[3] -= 2 * 0.25 + 0.5;
  z[6] -= 1 * 0.25 + 0.5;
  ExpectNear(sampler.Distribution(kLogits), Softmax(z, 1.0));
}

TEST(SamplerTest, PenaltiesApplyToGreedyToo) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.frequency_penalty = 2.0f;
  Sampler sampler = Make(params);
  EXPECT_EQ(sampler.Sample(kLogits).id, 1);
  EXPECT_EQ(sampler.Sample(kLogits).id, 4);  // 1 is now at 1.0 (3 - 2)
}

TEST(SamplerTest, SameSeedSameTokensAndFrequenciesFollowTheDistribution) {
  SamplingParams params;
  params.seed = 1234;
  params.temperature = 1.0f;
  Sampler a = Make(params), b = Make(params);
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.0);
  std::vector<int> counts(kLogits.size(), 0);
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    const int32_t x = a.Sample(kLogits).id;
    EXPECT_EQ(x, b.Sample(kLogits).id);
    ++counts[x];
  }
  for (size_t i = 0; i < p.size(); ++i) {
    // 5 standard deviations of a binomial count.
    const double sd = std::sqrt(kDraws * p[i] * (1 - p[i]));
    EXPECT_NEAR(counts[i], kDraws * p[i], 5 * sd + 1) << "id " << i;
  }
  Sampler same = Make(params);
  params.seed = 1235;
  Sampler other = Make(params);
  int differ = 0;
  for (int i = 0; i < 50; ++i) differ += other.Sample(kLogits).id != same.Sample(kLogits).id;
  EXPECT_GT(differ, 0);
}

TEST(SamplerTest, LogprobsAreThoseOfTheRawLogits) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.repetition_penalty = 2.0f;  // does not change reported logprobs
  params.logprobs = true;
  params.top_logprobs = 3;
  Sampler sampler = Make(params, {1});
  const SampledToken t = sampler.Sample(kLogits);
  EXPECT_EQ(t.id, 4);  // 1 is penalised to 1.5
  const std::vector<double> p = Softmax(AsDouble(kLogits), 1.0);
  EXPECT_NEAR(t.logprob, std::log(p[4]), 1e-6);
  ASSERT_EQ(t.top_logprobs.size(), 3u);
  EXPECT_EQ(t.top_logprobs[0].id, 1);
  EXPECT_EQ(t.top_logprobs[1].id, 4);
  EXPECT_EQ(t.top_logprobs[2].id, 3);
  EXPECT_NEAR(t.top_logprobs[2].logprob, std::log(p[3]), 1e-6);
}

TEST(SamplerTest, RejectsOutOfRangeParameters) {
  const std::vector<std::pair<SamplingParams, const char*>> bad = {
      {{.temperature = -1.0f}, "temperature"},
      {{.top_k = -1}, "top_k"},
      {{.top_p = 0.0f}, "top_p"},
      {{.min_p = 1.5f}, "min_p"},
      {{.repetition_penalty = 0.0f}, "repetition_penalty"},
      {{.presence_penalty = 3.0f}, "presence_penalty"},
      {{.frequency_penalty = NAN}, "frequency_penalty"},
      {{.top_logprobs = 21}, "top_logprobs"},
  };
  for (const auto& [params, field] : bad) {
    const absl::Status status = ValidateSamplingParams(params);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  }
}

}  // namespace
}  // namespace exl3serve::worker
