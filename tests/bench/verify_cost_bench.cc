// What a speculative verify step costs against a plain decode step, on one
// rank (issue 18's premise: decode is memory-bound, so a forward over the
// last token + k drafts costs about one decode step). For k = 0..K and B
// sequences: one LocalStepExecutor::ForwardVerified of B entries of 1 + k
// tokens (the drafts are all wrong, so each step accepts 0, appends one
// token and rolls the k draft positions back: a steady state that can be
// repeated), timed as the median of N steps after a 64-token prompt; the
// ceiling it is compared with is the plain sampled decode step
// (ForwardSampled, 1 token per sequence) measured in the same run, and the
// break-even acceptance — the mean accepted tokens per round at which
// drafting pays — is ratio - 1.
//
//   verify_cost_bench [--model DIR] [--batch 1,8] [--max-draft 8] [--steps 40] [--threads T]
//
// Without --model it writes the Qwen3-shaped demo model (2 layers, hidden
// 256, vocab 151 936, untied head) and converts it to EXL3 at 4 bpw with a
// 16-bit head, as serve runs it. EXL3 linears at int8 decode activations
// (serve's default).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "sharding/converter.h"
#include "sharding/test_model.h"
#include "worker/model/linear.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace w = exl3serve::worker;

namespace {

void Die(const std::string& what) {
  std::fprintf(stderr, "verify_cost_bench: %s\n", what.c_str());
  std::exit(1);
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of one step: B sequences, each fed its last token plus k
// wrong drafts (k = -1: plain ForwardSampled).
double TimeSteps(const w::Transformer& model, int batch, int k, int steps) {
  w::KvCacheOptions kv;
  kv.dtype = w::KvCacheDtype::kFp16;
  kv.num_pages = 64 * batch + 64;
  kv.page_size_tokens = 16;
  auto cache = model.CreateKvCache(kv);
  if (!cache.ok()) Die(cache.status().ToString());
  w::LocalStepExecutor executor(&model, std::move(*cache));
  std::vector<std::vector<int32_t>> last(batch);
  for (int b = 0; b < batch; ++b) {
    w::SequenceSampling sampling;
    sampling.params.temperature = 0.0f;
    sampling.params.seed = 1;
    sampling.prompt_len = 64;
    if (auto s = executor.AddSampledSequence(b, sampling); !s.ok()) Die(s.ToString());
  }
  auto step = [&](bool prompt, int drafts) {
    std::vector<std::vector<int32_t>> feeds(batch);
    std::vector<w::SequenceTokens> entries;
    std::vector<uint8_t> sample(batch, 1);
    std::vector<int32_t> counts(batch, prompt ? 0 : std::max(drafts, 0));
    for (int b = 0; b < batch; ++b) {
      if (prompt) {
        for (int i = 0; i < 64; ++i) feeds[b].push_back(100 + 37 * i + b);
      } else {
        feeds[b] = last[b];
        // A draft no greedy step picks here: the previous token repeated
        // (a peaked demo model never repeats its token).
        for (int j = 0; j < drafts; ++j) feeds[b].push_back(last[b][0]);
      }
      entries.push_back({b, feeds[b]});
    }
    if (prompt || drafts < 0) {
      std::vector<w::SampledToken> tokens;
      if (auto s = executor.ForwardSampled(entries, sample, &tokens); !s.ok()) Die(s.ToString());
      for (int b = 0; b < batch; ++b) last[b] = {tokens[b].id};
    } else {
      std::vector<std::vector<w::SampledToken>> runs;
      if (auto s = executor.ForwardVerified(entries, sample, counts, &runs); !s.ok()) {
        Die(s.ToString());
      }
      for (int b = 0; b < batch; ++b) last[b] = {runs[b].back().id};
    }
  };
  step(true, 0);
  for (int i = 0; i < 3; ++i) step(false, k);  // warm-up
  std::vector<double> seconds;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step(false, k);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return Median(seconds);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  std::vector<int> batches = {1, 8};
  int max_draft = 8, steps = 40, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) Die("missing value for " + a);
      return argv[++i];
    };
    if (a == "--model") model_dir = value();
    else if (a == "--batch") batches = ParseList(value());
    else if (a == "--max-draft") max_draft = std::atoi(value());
    else if (a == "--steps") steps = std::atoi(value());
    else if (a == "--threads") threads = std::atoi(value());
    else Die("unknown flag " + a + " (--model DIR --batch 1,8 --max-draft K --steps N --threads T)");
  }
  if (threads > 0) exl3serve::kernels::cpu::SetSharedThreadPoolSize(threads);
  std::filesystem::path tmp;
  if (model_dir.empty()) {
    tmp = std::filesystem::temp_directory_path() / ("verify_cost_bench." + std::to_string(getpid()));
    std::filesystem::create_directories(tmp);
    auto options = exl3serve::sharding::DemoModelDefaults("qwen3");
    if (!options.ok()) Die(options.status().ToString());
    if (auto s = exl3serve::sharding::WriteTestModel((tmp / "hf").string(), *options); !s.ok()) {
      Die(s.ToString());
    }
    exl3serve::sharding::ConvertOptions convert;
    convert.in_dir = (tmp / "hf").string();
    convert.out_dir = (tmp / "exl3").string();
    convert.bits = 4.0;
    convert.head_bits = 16;
    convert.show_progress = false;
    if (auto r = exl3serve::sharding::ConvertModel(convert); !r.ok()) Die(r.status().ToString());
    model_dir = convert.out_dir;
  }
  if (auto s = w::SetDecodePrecision(exl3serve::kernels::TrellisGemmPrecision::kInt8); !s.ok()) {
    Die(s.ToString());
  }
  auto model = w::Transformer::Load(model_dir);
  if (!model.ok()) Die(model.status().ToString());
  std::printf("model %s, vocab %lld, %d kernel threads, median of %d steps\n", model_dir.c_str(),
              static_cast<long long>((*model)->vocab_size()),
              exl3serve::kernels::cpu::SharedThreadPool().size(), steps);
  std::printf("| batch | draft k | rows | step ms | decode step ms (ceiling) | ratio | break-even accepted/round |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int batch : batches) {
    const double decode = TimeSteps(**model, batch, -1, steps);
    for (int k = 0; k <= max_draft; k = k == 0 ? 1 : k * 2) {
      const double t = TimeSteps(**model, batch, k, steps);
      std::printf("| %d | %d | %d | %.2f | %.2f | %.2fx | %.2f |\n", batch, k, batch * (k + 1),
                  1e3 * t, 1e3 * decode, t / decode, t / decode - 1.0);
    }
  }
  if (!tmp.empty()) std::filesystem::remove_all(tmp);
  return 0;
}
