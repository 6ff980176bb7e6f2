// Rank-side, vocabulary-parallel sampling (worker/model/vocab_sampler.h)
// against the float64 reference (worker/model/sampler.h): the distributions
// pass a chi-square test, logprobs equal a float64 log-softmax, greedy ties
// take the lowest id, and 1, 2 and 3 ranks (threads over an in-process
// all-gather) draw the same tokens. Also the counter-based generator (a
// known answer of Philox4x32-10) and the scalar/AVX2 twins of sampling_math.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "worker/comm/communicator.h"
#include "worker/model/counter_rng.h"
#include "worker/model/sampler.h"
#include "worker/model/sampling_math.h"
#include "worker/model/vocab_sampler.h"

namespace exl3serve::worker {
namespace {

// ---------------------------------------------------------------- an in-process group

// The part of a group the sampler uses (AllGather, AllGatherV) for threads of
// one process; everything else is Unimplemented.
class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), slots_(world) {}
  int world() const { return world_; }
  // Collective: every rank deposits, waits for all, copies, waits again.
  void Exchange(int rank, const void* data, size_t bytes, std::vector<std::string>* all) {
    absl::MutexLock lock(&mu_);
    const uint64_t gen = generation_;
    slots_[rank].assign(static_cast<const char*>(data), bytes);
    if (++arrived_ == world_) {
      arrived_ = 0;
      snapshot_ = slots_;
      ++generation_;
      changed_.SignalAll();
    } else {
      while (generation_ == gen) changed_.Wait(&mu_);
    }
    *all = snapshot_;
  }

 private:
  const int world_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::vector<std::string> slots_, snapshot_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

class ThreadComm final : public comm::Communicator {
 public:
  ThreadComm(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world(); }
  std::string backend_name() const override { return "threads"; }
  absl::Status AllGather(const void* send, size_t bytes, void* recv, absl::Time) override {
    std::vector<std::string> all;
    group_->Exchange(rank_, send, bytes, &all);
    for (int r = 0; r < world_size(); ++r) {
      if (all[r].size() != bytes) return absl::InternalError("all-gather size mismatch");
      std::memcpy(static_cast<char*>(recv) + r * bytes, all[r].data(), bytes);
    }
    return absl::OkStatus();
  }
  absl::Status AllGatherV(const void* send, std::span<const size_t> bytes_per_rank, void* recv,
                          absl::Time) override {
    std::vector<std::string> all;
    group_->Exchange(rank_, send, bytes_per_rank[rank_], &all);
    size_t off = 0;
    for (int r = 0; r < world_size(); ++r) {
      if (all[r].size() != bytes_per_rank[r]) return absl::InternalError("all-gatherv mismatch");
      std::memcpy(static_cast<char*>(recv) + off, all[r].data(), all[r].size());
      off += all[r].size();
    }
    return absl::OkStatus();
  }
  absl::Status AllReduce(void*, size_t, comm::CommDataType, absl::Time) override { return No(); }
  absl::Status ReduceScatter(const void*, size_t, comm::CommDataType, void*, absl::Time) override {
    return No();
  }
  absl::Status AllToAllV(const void*, std::span<const size_t>, void*, std::span<const size_t>,
                         absl::Time) override {
    return No();
  }
  absl::Status Broadcast(void*, size_t, int, absl::Time) override { return No(); }
  absl::Status Barrier(absl::Time) override { return No(); }
  void Abort(const absl::Status&) override {}
  absl::Status health() const override { return absl::OkStatus(); }

 private:
  static absl::Status No() { return absl::UnimplementedError("not in the test group"); }
  ThreadGroup* group_;
  int rank_;
};

// ---------------------------------------------------------------- helpers

std::vector<float> RandomLogits(int64_t vocab, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> z(static_cast<size_t>(vocab));
  for (float& v : z) v = normal(rng);
  return z;
}

SamplingParams Params(float t, int k, float p, float min_p, uint64_t seed) {
  SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  s.seed = seed;
  return s;
}

// Upper regularized incomplete gamma Q(a, x) (series for x < a + 1, else a
// continued fraction by the modified Lentz method): the chi-square survival
// function is Q(dof / 2, chi2 / 2).
double GammaQ(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_prefix = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (term < sum * 1e-15) break;
    }
    return 1.0 - sum * std::exp(log_prefix);
  }
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-15) break;
  }
  return std::exp(log_prefix) * h;
}

TEST(GammaQTest, MatchesKnownChiSquareTails) {
  // P(chi2_1 > 3.841459) = 0.05, P(chi2_10 > 29.5883) = 0.001, P(chi2_4 > 1.06362) = 0.9.
  EXPECT_NEAR(GammaQ(0.5, 3.841459 / 2), 0.05, 1e-6);
  EXPECT_NEAR(GammaQ(5.0, 29.5883 / 2), 0.001, 1e-6);
  EXPECT_NEAR(GammaQ(2.0, 1.06362 / 2), 0.9, 1e-5);
}

// ---------------------------------------------------------------- generator and math

TEST(CounterRngTest, PhiloxMatchesTheKnownAnswer) {
  // Random123's known-answer vector for philox4x32-10 with counter and key 0.
  const std::array<uint32_t, 4> r = Philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(CounterRngTest, UniformsDependOnSeedAndPositionOnlyAndLookUniform) {
  EXPECT_EQ(CounterUniform(7, 100), CounterUniform(7, 100));
  EXPECT_NE(CounterUniform(7, 100), CounterUniform(7, 101));
  EXPECT_NE(CounterUniform(7, 100), CounterUniform(8, 100));
  std::vector<int> bins(16, 0);
  constexpr int kDraws = 160000;
  for (int i = 0; i < kDraws; ++i) {
    const double u = CounterUniform(12345, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++bins[static_cast<int>(u * 16)];
  }
  double chi2 = 0;
  for (int b : bins) chi2 += (b - kDraws / 16.0) * (b - kDraws / 16.0) / (kDraws / 16.0);
  EXPECT_GT(GammaQ(15 / 2.0, chi2 / 2), 1e-3) << chi2;
}

TEST(SamplingMathTest, ExpAndSumsMatchFloat64AndTheTwinsAgreeBitForBit) {
  const bool avx2 = kernels::cpu::GetCpuFeatures().avx2 && kernels::cpu::GetCpuFeatures().fma;
  for (int64_t n : {1, 7, 8, 9, 63, 1001, 30011}) {
    std::vector<float> x = RandomLogits(n, static_cast<uint32_t>(n), 6.0f);
    x[n / 2] = -1e30f;  // far below the cutoff: a zero term
    const float m = *std::max_element(x.begin(), x.end());
    for (float inv_t : {1.0f, 1.25f, 0.3f}) {
      double want = 0;
      for (float v : x) {
        const double t = (static_cast<double>(v) - m) * inv_t;
        const double e = std::exp(t);
        const float got = ExpShifted(v, m, inv_t);
        // fp32 rounding of the argument (|t| · 2^-24 relative) plus ~2 ulp.
        if (e > 1e-30) ASSERT_NEAR(got, e, (2.4e-7 + 1.2e-7 * std::fabs(t)) * e) << v;
        want += e;
      }
      const double scalar = sampling_internal::SumExpShiftedScalar(x.data(), n, m, inv_t);
      EXPECT_NEAR(scalar, want, 2e-6 * want);
      if (avx2) {
        EXPECT_EQ(scalar, sampling_internal::SumExpShiftedAvx2(x.data(), n, m, inv_t)) << n;
        const double target = want * 0.61;
        EXPECT_EQ(sampling_internal::FindCumulativeExpScalar(x.data(), n, m, inv_t, target),
                  sampling_internal::FindCumulativeExpAvx2(x.data(), n, m, inv_t, target));
      }
    }
    const SliceMax a = sampling_internal::MaxOfSliceScalar(x.data(), n);
    EXPECT_EQ(a.value, m);
    EXPECT_EQ(x[a.index], m);
    if (avx2) {
      const SliceMax b = sampling_internal::MaxOfSliceAvx2(x.data(), n);
      EXPECT_EQ(a.value, b.value);
      EXPECT_EQ(a.index, b.index);
    }
  }
  if (!avx2) GTEST_SKIP() << "no AVX2+FMA here: only the scalar path was checked";
}

// ---------------------------------------------------------------- distributions

struct Setting {
  const char* name;
  SamplingParams params;
};

std::vector<Setting> Settings() {
  std::vector<Setting> s = {
      {"temperature 0.8", Params(0.8f, 0, 1.0f, 0.0f, 0)},
      {"temperature 1.7", Params(1.7f, 0, 1.0f, 0.0f, 0)},
      {"top-k 6", Params(1.0f, 6, 1.0f, 0.0f, 0)},
      {"top-p 0.9", Params(0.9f, 0, 0.9f, 0.0f, 0)},
      {"top-p 0.999 hot", Params(2.5f, 0, 0.999f, 0.0f, 0)},
      {"min-p 0.08", Params(1.2f, 0, 1.0f, 0.08f, 0)},
      {"top-k 9 top-p 0.8 min-p 0.02", Params(1.1f, 9, 0.8f, 0.02f, 0)},
  };
  SamplingParams pen = Params(0.9f, 0, 0.95f, 0.0f, 0);
  pen.repetition_penalty = 1.4f;
  pen.presence_penalty = 0.5f;
  pen.frequency_penalty = 0.3f;
  pen.logit_bias = {{2, 1.5f}, {5, -100.0f}, {30, 0.7f}};
  s.push_back({"penalties and bias", pen});
  return s;
}

// Draws `draws` tokens from `logits` with `params` (one sampler, a fresh seed
// per draw) after the sequence saw `history` (the first `prompt_len` of it
// prompt), and returns the counts per token.
std::vector<int64_t> Draw(const std::vector<float>& logits, SamplingParams params,
                          const std::vector<int32_t>& history, int64_t prompt_len, int draws) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  VocabSampler sampler(0, vocab, vocab, nullptr, absl::Seconds(10));
  std::vector<int64_t> counts(static_cast<size_t>(vocab), 0);
  constexpr int kBatch = 500;
  std::vector<float> rows(static_cast<size_t>(kBatch * vocab));
  std::vector<SampleRow> batch(kBatch);
  for (int done = 0; done < draws; done += kBatch) {
    for (int i = 0; i < kBatch; ++i) {
      params.seed = static_cast<uint64_t>(done + i) * 0x9E3779B97F4A7C15ull + 1;
      EXPECT_TRUE(sampler.AddSequence(i, {.params = params, .prompt_len = prompt_len}).ok());
      sampler.Observe(i, history);
      std::copy(logits.begin(), logits.end(), rows.begin() + i * vocab);
      batch[i] = {i, i};
    }
    std::vector<SampledToken> out;
    EXPECT_TRUE(sampler.Sample(batch, rows.data(), &out).ok());
    for (int i = 0; i < kBatch; ++i) {
      EXPECT_GE(out[i].id, 0);
      if (out[i].id >= 0 && out[i].id < vocab) ++counts[out[i].id];
      sampler.RemoveSequence(i);
    }
  }
  return counts;
}

TEST(VocabSamplerDistributionTest, EverySettingPassesAChiSquareTestAgainstFloat64) {
  constexpr int64_t kVocab = 37;
  constexpr int kDraws = 100000;
  const std::vector<float> logits = RandomLogits(kVocab, 99, 1.5f);
  const std::vector<int32_t> history = {3, 1, 2, 2, 7, 2, 30, 3};  // prompt 3 1 2; output 2 7 2 30 3
  constexpr int64_t kPromptLen = 3;
  for (const Setting& setting : Settings()) {
    SCOPED_TRACE(setting.name);
    // The reference sees the same history: prompt, then accepted outputs.
    SamplingParams ref_params = setting.params;
    absl::StatusOr<Sampler> ref =
        Sampler::Create(ref_params, std::span(history).first(kPromptLen));
    ASSERT_TRUE(ref.ok());
    for (size_t i = kPromptLen; i < history.size(); ++i) ref->Accept(history[i]);
    const std::vector<double> p = ref->Distribution(logits);
    const std::vector<int64_t> counts = Draw(logits, setting.params, history, kPromptLen, kDraws);
    // Tokens the reference excludes are never drawn; the rest pass chi-square
    // (bins with expectation < 5 merged).
    double chi2 = 0, pooled_expected = 0, pooled_observed = 0;
    int bins = 0;
    for (int64_t t = 0; t < kVocab; ++t) {
      if (p[t] == 0.0) {
        EXPECT_EQ(counts[t], 0) << "token " << t << " is outside the kept set";
        continue;
      }
      const double expected = p[t] * kDraws;
      if (expected < 5) {
        pooled_expected += expected;
        pooled_observed += static_cast<double>(counts[t]);
        continue;
      }
      chi2 += (counts[t] - expected) * (counts[t] - expected) / expected;
      ++bins;
    }
    if (pooled_expected > 0) {
      chi2 += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) /
              std::max(pooled_expected, 1e-9);
      ++bins;
    }
    if (bins > 1) {
      const double p_value = GammaQ((bins - 1) / 2.0, chi2 / 2.0);
      EXPECT_GT(p_value, 1e-3) << "chi2 " << chi2 << " over " << bins << " bins";
    }
  }
}

TEST(VocabSamplerTest, GreedyTakesTheHighestLogitAndTheLowestIdOnTies) {
  std::vector<float> logits = RandomLogits(1001, 5, 1.0f);
  logits[17] = logits[800] = 9.0f;
  VocabSampler sampler(0, 1001, 1001, nullptr, absl::Seconds(10));
  ASSERT_TRUE(sampler.AddSequence(1, {.params = Params(0.0f, 0, 1.0f, 0.0f, 3)}).ok());
  std::vector<SampledToken> out;
  std::vector<float> row = logits;
  ASSERT_TRUE(sampler.Sample(std::vector<SampleRow>{{1, 0}}, row.data(), &out).ok());
  EXPECT_EQ(out[0].id, 17);
}

TEST(VocabSamplerTest, LogprobsEqualAFloat64LogSoftmax) {
  constexpr int64_t kVocab = 50021;
  const std::vector<float> logits = RandomLogits(kVocab, 8, 3.0f);
  double zmax = -INFINITY;
  for (float z : logits) zmax = std::max<double>(zmax, z);
  double sum = 0;
  for (float z : logits) sum += std::exp(z - zmax);
  const double log_z = zmax + std::log(sum);
  std::vector<int32_t> order(kVocab);
  for (int32_t i = 0; i < kVocab; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (const Setting& setting : Settings()) {
    SCOPED_TRACE(setting.name);
    SamplingParams params = setting.params;
    params.logit_bias.clear();  // raw logprobs do not see the bias either way
    params.logprobs = true;
    params.top_logprobs = 20;
    params.seed = 77;
    VocabSampler sampler(0, kVocab, kVocab, nullptr, absl::Seconds(10));
    ASSERT_TRUE(sampler.AddSequence(4, {.params = params, .prompt_len = 2}).ok());
    sampler.Observe(4, std::vector<int32_t>{order[0], order[3], order[0]});
    std::vector<float> row = logits;
    std::vector<SampledToken> out;
    ASSERT_TRUE(sampler.Sample(std::vector<SampleRow>{{4, 0}}, row.data(), &out).ok());
    ASSERT_EQ(out.size(), 1u);
    EXPECT_NEAR(out[0].logprob, logits[out[0].id] - log_z, 1e-4);
    ASSERT_EQ(out[0].top_logprobs.size(), 20u);
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(out[0].top_logprobs[i].id, order[i]);
      EXPECT_NEAR(out[0].top_logprobs[i].logprob, logits[order[i]] - log_z, 1e-4);
    }
  }
}

TEST(VocabSamplerTest, RefusesBadSequencesBeforeAnyCollective) {
  VocabSampler sampler(0, 10, 10, nullptr, absl::Seconds(1));
  SamplingParams no_seed = Params(1.0f, 0, 1.0f, 0.0f, 0);
  no_seed.seed.reset();
  EXPECT_EQ(sampler.AddSequence(1, {.params = no_seed}).code(), absl::StatusCode::kInvalidArgument);
  SamplingParams bias = Params(1.0f, 0, 1.0f, 0.0f, 1);
  bias.logit_bias = {{10, 1.0f}};
  EXPECT_EQ(sampler.AddSequence(1, {.params = bias}).code(), absl::StatusCode::kInvalidArgument);
  SamplingParams bad = Params(1.0f, 0, 1.5f, 0.0f, 1);
  EXPECT_EQ(sampler.AddSequence(1, {.params = bad}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(sampler.AddSequence(1, {.params = Params(1.0f, 0, 1.0f, 0.0f, 1)}).ok());
  EXPECT_EQ(sampler.AddSequence(1, {.params = Params(1.0f, 0, 1.0f, 0.0f, 1)}).code(),
            absl::StatusCode::kAlreadyExists);
  std::vector<float> row(10, 0.0f);
  std::vector<SampledToken> out;
  EXPECT_EQ(sampler.Sample(std::vector<SampleRow>{{2, 0}}, row.data(), &out).code(),
            absl::StatusCode::kNotFound);
}

TEST(VocabSamplerTest, PositionCountsObservedTokensSoReplayDrawsTheSame) {
  // A sequence observed token by token and one that observes the same tokens
  // in one chunk (a replay's prefill) draw the same next token.
  const std::vector<float> logits = RandomLogits(301, 3, 2.0f);
  SamplingParams p = Params(1.0f, 0, 1.0f, 0.0f, 1234);
  p.frequency_penalty = 0.4f;
  VocabSampler a(0, 301, 301, nullptr, absl::Seconds(1)), b(0, 301, 301, nullptr, absl::Seconds(1));
  ASSERT_TRUE(a.AddSequence(1, {.params = p, .prompt_len = 2}).ok());
  ASSERT_TRUE(b.AddSequence(1, {.params = p, .prompt_len = 2}).ok());
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  for (int32_t t : tokens) a.Observe(1, std::vector<int32_t>{t});
  b.Observe(1, tokens);
  EXPECT_EQ(a.position(1), 5);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> ra = logits, rb = logits;
    std::vector<SampledToken> oa, ob;
    ASSERT_TRUE(a.Sample(std::vector<SampleRow>{{1, 0}}, ra.data(), &oa).ok());
    ASSERT_TRUE(b.Sample(std::vector<SampleRow>{{1, 0}}, rb.data(), &ob).ok());
    EXPECT_EQ(oa[0].id, ob[0].id);
    a.Observe(1, std::vector<int32_t>{oa[0].id});
    b.Observe(1, std::vector<int32_t>{ob[0].id});
  }
}

// ---------------------------------------------------------------- vocabulary-parallel

// Samples `rows` (each a copy of its logits) on `world` ranks, the vocabulary
// split at `cuts`, and returns every rank's tokens.
// `masks`: empty, or one allowed-token bitmask per row (empty = none).
std::vector<std::vector<SampledToken>> SampleOnRanks(
    const std::vector<std::vector<float>>& rows, const std::vector<SamplingParams>& params,
    const std::vector<int64_t>& cuts, const std::vector<std::vector<uint32_t>>& masks = {}) {
  const int world = static_cast<int>(cuts.size()) - 1;
  const int64_t vocab = cuts.back();
  ThreadGroup group(world);
  std::vector<std::vector<SampledToken>> result(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ThreadComm comm(&group, r);
      const int64_t begin = cuts[r], end = cuts[r + 1], width = end - begin;
      VocabSampler sampler(begin, end, vocab, &comm, absl::Seconds(30));
      std::vector<float> slice(rows.size() * width);
      std::vector<SampleRow> batch;
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_TRUE(sampler.AddSequence(static_cast<int64_t>(i), {.params = params[i]}).ok());
        std::copy(rows[i].begin() + begin, rows[i].begin() + end, slice.begin() + i * width);
        const uint32_t* allowed = masks.empty() || masks[i].empty() ? nullptr : masks[i].data();
        batch.push_back({static_cast<int64_t>(i), static_cast<int64_t>(i), allowed});
      }
      EXPECT_TRUE(sampler.Sample(batch, slice.data(), &result[r]).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  return result;
}

TEST(VocabParallelSamplerTest, OneTwoAndThreeRanksDrawTheSameTokens) {
  constexpr int64_t kVocab = 128 * 9 + 37;  // the last slice is not a multiple of 128
  std::vector<std::vector<float>> rows;
  std::vector<SamplingParams> params;
  int seed = 0;
  for (const Setting& setting : Settings()) {
    for (int i = 0; i < 24; ++i, ++seed) {
      rows.push_back(RandomLogits(kVocab, 1000 + seed, 2.5f));
      SamplingParams p = setting.params;
      p.seed = 5000 + seed;
      p.logprobs = i % 2 == 0;
      p.top_logprobs = i % 3 == 0 ? 5 : 0;
      if (i % 4 == 0) p.temperature = 0.0f;  // greedy rows in every batch
      params.push_back(p);
    }
  }
  const auto one = SampleOnRanks(rows, params, {0, kVocab});
  for (const std::vector<int64_t>& cuts :
       {std::vector<int64_t>{0, 640, kVocab}, std::vector<int64_t>{0, 384, 768, kVocab},
        std::vector<int64_t>{0, 0, 512, kVocab}}) {  // a rank with an empty slice
    SCOPED_TRACE(::testing::Message() << cuts.size() - 1 << " ranks, second cut " << cuts[1]);
    const auto many = SampleOnRanks(rows, params, cuts);
    for (size_t r = 0; r < many.size(); ++r) {
      ASSERT_EQ(many[r].size(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(many[r][i].id, one[0][i].id) << "row " << i << " on rank " << r;
        EXPECT_NEAR(many[r][i].logprob, one[0][i].logprob, 1e-5);
        ASSERT_EQ(many[r][i].top_logprobs.size(), one[0][i].top_logprobs.size());
        for (size_t k = 0; k < one[0][i].top_logprobs.size(); ++k) {
          EXPECT_EQ(many[r][i].top_logprobs[k].id, one[0][i].top_logprobs[k].id);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- allowed-token masks

bool Allowed(const std::vector<uint32_t>& mask, int64_t id) {
  return (mask[static_cast<size_t>(id / 32)] >> (id % 32)) & 1u;
}

// A mask over `vocab` allowing each id with probability `density` (at least
// one id), or only ids in [lo, hi) when lo < hi.
std::vector<uint32_t> RandomMask(int64_t vocab, double density, std::mt19937& rng, int64_t lo = 0,
                                 int64_t hi = 0) {
  std::vector<uint32_t> mask(static_cast<size_t>((vocab + 31) / 32), 0xA5A5A5A5u);  // poison past vocab
  for (int64_t id = 0; id < vocab; ++id) mask[id / 32] &= ~(1u << (id % 32));
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t a = lo < hi ? lo : 0, b = lo < hi ? hi : vocab;
  bool any = false;
  for (int64_t id = a; id < b; ++id) {
    if (u(rng) < density) {
      mask[id / 32] |= 1u << (id % 32);
      any = true;
    }
  }
  if (!any) mask[a / 32] |= 1u << (a % 32);
  return mask;
}

TEST(VocabSamplerMaskTest, MaskedDrawsPassAChiSquareTestAgainstFloat64OnMaskedLogits) {
  // The reference: the float64 sampler on logits whose masked entries are
  // -inf (after its penalties, as the ranks mask after theirs).
  constexpr int64_t kVocab = 41;
  constexpr int kDraws = 60000;
  const std::vector<float> logits = RandomLogits(kVocab, 7, 1.5f);
  std::mt19937 rng(11);
  const std::vector<uint32_t> mask = RandomMask(kVocab, 0.4, rng);
  for (const Setting& setting : Settings()) {
    SCOPED_TRACE(setting.name);
    if (!setting.params.logit_bias.empty()) continue;  // bias then -inf: same; kept simple
    absl::StatusOr<Sampler> ref = Sampler::Create(setting.params, {});
    ASSERT_TRUE(ref.ok());
    std::vector<float> masked = logits;
    for (int64_t t = 0; t < kVocab; ++t) {
      if (!Allowed(mask, t)) masked[t] = -INFINITY;
    }
    const std::vector<double> p = ref->Distribution(masked);
    VocabSampler sampler(0, kVocab, kVocab, nullptr, absl::Seconds(10));
    std::vector<int64_t> counts(kVocab, 0);
    constexpr int kBatch = 500;
    for (int done = 0; done < kDraws; done += kBatch) {
      std::vector<float> rows;
      std::vector<SampleRow> batch;
      for (int i = 0; i < kBatch; ++i) {
        SamplingParams params = setting.params;
        params.seed = static_cast<uint64_t>(done + i) * 0x9E3779B97F4A7C15ull + 7;
        ASSERT_TRUE(sampler.AddSequence(i, {.params = params}).ok());
        rows.insert(rows.end(), logits.begin(), logits.end());
        batch.push_back({i, i, mask.data()});
      }
      std::vector<SampledToken> out;
      ASSERT_TRUE(sampler.Sample(batch, rows.data(), &out).ok());
      for (int i = 0; i < kBatch; ++i) {
        ASSERT_TRUE(out[i].id >= 0 && out[i].id < kVocab);
        ASSERT_TRUE(Allowed(mask, out[i].id)) << "drew masked token " << out[i].id;
        ++counts[out[i].id];
        sampler.RemoveSequence(i);
      }
    }
    double chi2 = 0, pooled_expected = 0, pooled_observed = 0;
    int bins = 0;
    for (int64_t t = 0; t < kVocab; ++t) {
      if (p[t] == 0.0) {
        EXPECT_EQ(counts[t], 0) << "token " << t;
        continue;
      }
      const double expected = p[t] * kDraws;
      if (expected < 5) {
        pooled_expected += expected;
        pooled_observed += static_cast<double>(counts[t]);
        continue;
      }
      chi2 += (counts[t] - expected) * (counts[t] - expected) / expected;
      ++bins;
    }
    if (pooled_expected > 0) {
      chi2 += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) /
              std::max(pooled_expected, 1e-9);
      ++bins;
    }
    if (bins > 1) EXPECT_GT(GammaQ((bins - 1) / 2.0, chi2 / 2.0), 1e-3) << "chi2 " << chi2;
  }
}

TEST(VocabParallelSamplerTest, MaskedRowsDrawAllowedTokensAlikeOnOneTwoAndThreeRanks) {
  constexpr int64_t kVocab = 128 * 9 + 37;
  std::mt19937 rng(3);
  std::vector<std::vector<float>> rows;
  std::vector<SamplingParams> params;
  std::vector<std::vector<uint32_t>> masks;
  int seed = 0;
  for (const Setting& setting : Settings()) {
    for (int i = 0; i < 18; ++i, ++seed) {
      rows.push_back(RandomLogits(kVocab, 2000 + seed, 2.5f));
      SamplingParams p = setting.params;
      p.seed = 7000 + seed;
      p.logprobs = i % 2 == 0;
      p.top_logprobs = i % 3 == 0 ? 4 : 0;
      if (i % 4 == 0) p.temperature = 0.0f;
      params.push_back(p);
      switch (i % 6) {
        case 0: masks.push_back({}); break;                                    // unconstrained
        case 1: masks.push_back(RandomMask(kVocab, 0.3, rng)); break;          // dense
        case 2: masks.push_back(RandomMask(kVocab, 0.004, rng)); break;        // a few ids
        case 3: masks.push_back(RandomMask(kVocab, 0.5, rng, 900, 1000)); break;  // one slice only
        case 4: masks.push_back(RandomMask(kVocab, 1e-9, rng, 1100, 1101)); break;  // one id
        default: masks.push_back(RandomMask(kVocab, 0.9, rng, 0, 40)); break;    // the first slice
      }
    }
  }
  const auto one = SampleOnRanks(rows, params, {0, kVocab}, masks);
  for (size_t i = 0; i < rows.size(); ++i) {
    const SampledToken& t = one[0][i];
    if (!masks[i].empty()) EXPECT_TRUE(Allowed(masks[i], t.id)) << "row " << i << " drew " << t.id;
    if (i % 6 == 4) EXPECT_EQ(t.id, 1100) << "row " << i << ": the only allowed id";
    if (params[i].logprobs) {
      // Logprobs stay those of the raw logits.
      double mx = -INFINITY, sum = 0;
      for (float z : rows[i]) mx = std::max(mx, static_cast<double>(z));
      for (float z : rows[i]) sum += std::exp(z - mx);
      EXPECT_NEAR(t.logprob, rows[i][t.id] - mx - std::log(sum), 1e-4) << "row " << i;
    }
    if (params[i].temperature == 0.0f && !masks[i].empty() && params[i].logit_bias.empty() &&
        params[i].repetition_penalty == 1.0f) {
      // Greedy: the highest allowed logit.
      int64_t best = -1;
      for (int64_t id = 0; id < kVocab; ++id) {
        if (Allowed(masks[i], id) && (best < 0 || rows[i][id] > rows[i][best])) best = id;
      }
      EXPECT_EQ(t.id, best) << "row " << i;
    }
  }
  for (const std::vector<int64_t>& cuts :
       {std::vector<int64_t>{0, 640, kVocab}, std::vector<int64_t>{0, 384, 768, kVocab},
        std::vector<int64_t>{0, 0, 512, kVocab}}) {
    SCOPED_TRACE(::testing::Message() << cuts.size() - 1 << " ranks, second cut " << cuts[1]);
    const auto many = SampleOnRanks(rows, params, cuts, masks);
    for (size_t r = 0; r < many.size(); ++r) {
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(many[r][i].id, one[0][i].id) << "row " << i << " on rank " << r;
        EXPECT_NEAR(many[r][i].logprob, one[0][i].logprob, 1e-5);
      }
    }
  }
}

}  // namespace
}  // namespace exl3serve::worker
