// sampler_bench: the per-step cost of rank-side sampling (worker/model/
// vocab_sampler.h) for a batch of sequences on one rank's vocabulary slice,
// against two ceilings measured in the same run: one streaming read of the
// same logits (the memory-bandwidth floor of any sampler that looks at every
// logit once) and the float64 reference Sampler (sampler.h, the coordinator's
// sampler before rank-side sampling; it sorts for top-p).
//
//   sampler_bench [--rows 64] [--slice 151936] [--reps 5] [--threads 2]
//
// Rows are i.i.d. Gaussian logits (σ = 3) of width --slice; every setting
// draws once per row per rep; times are the median rep. "read" = a pass
// summing the same bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "worker/model/sampler.h"
#include "worker/model/vocab_sampler.h"

namespace {

using namespace exl3serve::worker;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Setting {
  const char* name;
  SamplingParams params;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 64, slice = 151936;
  int reps = 5, threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (flag == "--rows") rows = v;
    else if (flag == "--slice") slice = v;
    else if (flag == "--reps") reps = static_cast<int>(v);
    else if (flag == "--threads") threads = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  exl3serve::kernels::cpu::SetSharedThreadPoolSize(threads);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(rows * slice));
  for (float& v : logits) v = normal(rng);
  std::vector<float> work(logits.size());

  auto params = [](float t, int k, float p, float min_p) {
    SamplingParams s;
    s.temperature = t;
    s.top_k = k;
    s.top_p = p;
    s.min_p = min_p;
    return s;
  };
  std::vector<Setting> settings = {
      {"greedy", params(0.0f, 0, 1.0f, 0.0f)},
      {"temperature 0.8", params(0.8f, 0, 1.0f, 0.0f)},
      {"top-k 50", params(0.8f, 50, 1.0f, 0.0f)},
      {"top-p 0.9", params(0.8f, 0, 0.9f, 0.0f)},
      {"min-p 0.05", params(0.8f, 0, 1.0f, 0.05f)},
  };
  SamplingParams full = params(0.8f, 50, 0.9f, 0.0f);
  full.repetition_penalty = 1.1f;
  full.presence_penalty = 0.5f;
  full.frequency_penalty = 0.5f;
  settings.push_back({"t0.8 k50 p0.9 + penalties", full});
  SamplingParams lp = params(0.0f, 0, 1.0f, 0.0f);
  lp.logprobs = true;
  lp.top_logprobs = 5;
  settings.push_back({"greedy + top-5 logprobs", lp});

  // Ceiling 1: one pass over the same bytes.
  std::vector<double> read_ms;
  volatile double sink = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    float lane[16] = {};
    const size_t n16 = logits.size() / 16 * 16;
    for (size_t i = 0; i < n16; i += 16) {
      for (int j = 0; j < 16; ++j) lane[j] += logits[i + j];
    }
    double s = 0;
    for (float v : lane) s += v;
    sink = sink + s;
    read_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double read = Median(read_ms);

  std::printf("sampler_bench: %lld rows x %lld logits (%.1f MB), %d threads, median of %d\n",
              static_cast<long long>(rows), static_cast<long long>(slice),
              rows * slice * 4 / 1e6, threads, reps);
  std::printf("one read pass of the logits: %.2f ms (%.1f GB/s)\n\n", read,
              rows * slice * 4 / read / 1e6);
  std::printf("| setting | rank-side ms/step | us/row | x read pass | float64 reference ms/step | speed-up |\n");
  std::printf("|---|---|---|---|---|---|\n");
  std::vector<int32_t> history(200);
  for (int32_t& t : history) t = static_cast<int32_t>(rng() % slice);
  for (const Setting& setting : settings) {
    std::vector<double> ms;
    for (int rep = 0; rep < reps; ++rep) {
      VocabSampler sampler(0, slice, slice, nullptr, absl::Seconds(10));
      std::vector<SampleRow> batch;
      for (int64_t r = 0; r < rows; ++r) {
        SamplingParams p = setting.params;
        p.seed = static_cast<uint64_t>(rep * rows + r);
        if (!sampler.AddSequence(r, {.params = p, .prompt_len = 100}).ok()) return 1;
        sampler.Observe(r, history);
        batch.push_back({r, r});
      }
      std::memcpy(work.data(), logits.data(), logits.size() * sizeof(float));
      std::vector<SampledToken> out;
      const auto t0 = Clock::now();
      if (!sampler.Sample(batch, work.data(), &out).ok()) return 1;
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    // The float64 reference on a few rows (it is slow), scaled to the batch.
    const int64_t ref_rows = std::min<int64_t>(rows, 4);
    const auto t0 = Clock::now();
    for (int64_t r = 0; r < ref_rows; ++r) {
      SamplingParams p = setting.params;
      p.seed = static_cast<uint64_t>(r);
      auto ref = Sampler::Create(p, std::span(history).first(100));
      if (!ref.ok()) return 1;
      ref->Sample(std::span<const float>(logits.data() + r * slice, slice));
    }
    const double ref_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count() * rows / ref_rows;
    const double m = Median(ms);
    std::printf("| %s | %.2f | %.1f | %.2f | %.1f | %.1fx |\n", setting.name, m, m * 1e3 / rows,
                m / read, ref_ms, ref_ms / m);
  }
  return sink == 12345.678 ? 1 : 0;
}
