// kernels::Sample / SamplingDistribution (kernels/ops.h) implement steps 3-7
// of worker::Sampler (worker/model/sampler.h): without penalties they must
// give the same distribution bit for bit and, fed the sampler's own uniform,
// the same token.
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/model/counter_rng.h"
#include "kernels/ops.h"
#include "worker/model/sampler.h"

namespace exl3serve::worker {
namespace {

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20261129u : static_cast<uint32_t>(seed);
}

TEST(SamplerOpsParityTest, KernelSamplingEqualsTheSamplerWithoutPenalties) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> logit(-8.0f, 8.0f);
  const int64_t vocab = 777;
  const std::vector<kernels::SamplingFilter> filters = {
      {0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f},  {0.6f, 25, 1.0f, 0.0f},
      {1.2f, 0, 0.8f, 0.0f}, {1.0f, 0, 1.0f, 0.1f},  {0.8f, 50, 0.9f, 0.05f}};
  for (const kernels::SamplingFilter& f : filters) {
    SamplingParams params;
    params.temperature = f.temperature;
    params.top_k = f.top_k;
    params.top_p = f.top_p;
    params.min_p = f.min_p;
    params.seed = rng();
    absl::StatusOr<Sampler> sampler = Sampler::Create(params, {});
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    for (int step = 0; step < 20; ++step) {
      std::vector<float> z(vocab);
      for (float& x : z) x = logit(rng);
      z[3] = z[500] = 9.5f;  // a tie at the top
      const std::vector<double> expected = sampler->Distribution(z);
      std::vector<double> got(vocab, -1.0);
      kernels::SamplingDistribution(z.data(), vocab, f, got.data());
      ASSERT_EQ(got, expected) << "temperature " << f.temperature << " step " << step;
      // The sampler's draw for this position (empty prompt: position = step).
      const double u = f.temperature == 0.0f ? 0.0 : CounterUniform(*params.seed, step);
      int32_t id = -1;
      ASSERT_TRUE(kernels::Sample(z.data(), 1, vocab, &f, &u, &id).ok());
      EXPECT_EQ(id, sampler->Sample(z).id) << "temperature " << f.temperature << " step " << step;
    }
  }
}

}  // namespace
}  // namespace exl3serve::worker
