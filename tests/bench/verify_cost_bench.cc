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
//                     [--layers L --hidden H --intermediate I --vocab V] [--mixed-only]
//                     [--ks 0,4 (these draft lengths only)] [--no-mixed (first table only)]
//
// Without --model it writes the Qwen3-shaped demo model (2 layers, hidden
// 256, vocab 151 936, untied head; the shape flags override it) and converts
// it to EXL3 at 4 bpw with a 16-bit head, as serve runs it. EXL3 linears at
// int8 decode activations (serve's default).
//
// Second table, mixed steps (docs/design/coordinator.md, speculative decoding
// item 4): each batch entry runs at the precision it gets alone (linear.h
// row plans), so a step of decode-kind entries (< 17 tokens) next to a
// prefill chunk costs an int8 kernel call for the decode rows plus an fp32
// call for the chunk in every EXL3 linear, where the old m-based switch made
// one fp32 call of all rows. Timed per step (Transformer::
// ForwardVocabSliceLastRows: head rows for every decode-kind entry's tokens,
// none for the chunk, whose sequence is fresh each step), median of N,
// alternating step by step between the row-plan arm (int8 decode) and the
// ceiling: the same step with decode precision fp32, where every run
// resolves to fp32 and the rows go to one kernel call — the old single call,
// bit for bit. --mixed-only skips the first table.
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

#include "cli/gemv_bench.h"
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
        for (int i = 0; i < 64; ++i) {
          feeds[b].push_back(static_cast<int32_t>((100 + 37 * i + b) % model.vocab_size()));
        }
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

// One mixed step shape: `decode` entries of `rows_each` tokens (all with
// logits rows) and, when chunk > 0, a fresh sequence's prefill chunk of
// `chunk` tokens after them.
struct MixedShape {
  const char* name;
  int decode;
  int rows_each;
  int chunk;
};

// Median seconds per step of `shape` under each decode precision, steps
// alternating between the two (each precision on its own cache, both fed
// the same tokens): {int8 row plan, fp32 single call}.
std::pair<double, double> TimeMixed(const w::Transformer& model, const MixedShape& shape,
                                    int steps) {
  using P = exl3serve::kernels::TrellisGemmPrecision;
  w::KvCacheOptions kv;
  kv.dtype = w::KvCacheDtype::kFp16;
  kv.page_size_tokens = 16;
  kv.num_pages = shape.decode * (64 + (steps + 4) * shape.rows_each + 32) / 16 + 64;
  std::vector<w::PagedKvCache> caches;
  for (int arm = 0; arm < 2; ++arm) {
    auto cache = model.CreateKvCache(kv);
    if (!cache.ok()) Die(cache.status().ToString());
    caches.push_back(std::move(*cache));
    for (int b = 0; b < shape.decode; ++b) {
      if (auto s = caches[arm].AddSequence(b); !s.ok()) Die(s.ToString());
    }
  }
  const int64_t vocab = model.vocab_size();
  std::vector<float> slice;
  auto step = [&](int arm, int index, bool prompt) {
    if (auto s = w::SetDecodePrecision(arm == 0 ? P::kInt8 : P::kFloat); !s.ok()) Die(s.ToString());
    std::vector<std::vector<int32_t>> feeds(shape.decode + 1);
    std::vector<w::SequenceTokens> batch;
    std::vector<int32_t> last_rows;
    for (int b = 0; b < shape.decode; ++b) {
      const int n = prompt ? 64 : shape.rows_each;
      for (int i = 0; i < n; ++i) {
        feeds[b].push_back(static_cast<int32_t>((100 + 37 * i + 11 * b + 7 * index) % vocab));
      }
      batch.push_back({b, feeds[b]});
      last_rows.push_back(prompt ? 1 : n);
    }
    const int64_t chunk_id = 1000 + index;
    if (!prompt && shape.chunk > 0) {
      for (int i = 0; i < shape.chunk; ++i) {
        feeds.back().push_back(static_cast<int32_t>((5 + 13 * i + index) % vocab));
      }
      if (auto s = caches[arm].AddSequence(chunk_id); !s.ok()) Die(s.ToString());
      batch.push_back({chunk_id, feeds.back()});
      last_rows.push_back(0);
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (auto s = model.ForwardVocabSliceLastRows(batch, last_rows, &caches[arm], &slice); !s.ok()) {
      Die(s.ToString());
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!prompt && shape.chunk > 0) {
      if (auto s = caches[arm].RemoveSequence(chunk_id); !s.ok()) Die(s.ToString());
    }
    return t;
  };
  for (int arm = 0; arm < 2; ++arm) {
    if (shape.decode > 0) step(arm, 0, true);  // 64-token prompts: prefill-kind, fp32 in both
  }
  std::vector<double> seconds[2];
  for (int i = 0; i < steps + 3; ++i) {
    for (int arm = 0; arm < 2; ++arm) {
      const double t = step(arm, i + 1, false);
      if (i >= 3) seconds[arm].push_back(t);  // 3 warm-up steps
    }
  }
  if (auto s = w::SetDecodePrecision(P::kInt8); !s.ok()) Die(s.ToString());
  return {Median(seconds[0]), Median(seconds[1])};
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  std::vector<int> batches = {1, 8};
  int max_draft = 8, steps = 40, threads = 0;
  int layers = 0, hidden = 0, intermediate = 0, vocab = 0;
  bool mixed_only = false;
  bool no_mixed = false;
  std::vector<int> draft_list;  // --ks: these k instead of 0, 1, 2, 4, ... max_draft
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
    else if (a == "--layers") layers = std::atoi(value());
    else if (a == "--hidden") hidden = std::atoi(value());
    else if (a == "--intermediate") intermediate = std::atoi(value());
    else if (a == "--vocab") vocab = std::atoi(value());
    else if (a == "--mixed-only") mixed_only = true;
    else if (a == "--no-mixed") no_mixed = true;
    else if (a == "--ks") draft_list = ParseList(value());
    else Die("unknown flag " + a + " (--model DIR --batch 1,8 --max-draft K --ks 0,4 --steps N"
             " --threads T --layers L --hidden H --intermediate I --vocab V --mixed-only"
             " --no-mixed)");
  }
  if (threads > 0) exl3serve::kernels::cpu::SetSharedThreadPoolSize(threads);
  std::filesystem::path tmp;
  if (model_dir.empty()) {
    tmp = std::filesystem::temp_directory_path() / ("verify_cost_bench." + std::to_string(getpid()));
    std::filesystem::create_directories(tmp);
    auto options = exl3serve::sharding::DemoModelDefaults("qwen3");
    if (!options.ok()) Die(options.status().ToString());
    if (layers > 0) options->num_layers = layers;
    if (hidden > 0) options->hidden_size = hidden;
    if (intermediate > 0) options->intermediate_size = intermediate;
    if (vocab > 0) options->vocab_size = vocab;
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
  const auto machine = exl3serve::cli::DescribeMachine();
  std::printf("verify_cost_bench %s: %s (%s), %d logical CPUs, ISA %s, load average %s\n",
              exl3serve::cli::CurrentUtcTime().c_str(), machine.cpu_model.c_str(),
              machine.cpu_signature.c_str(), machine.logical_cpus,
              exl3serve::cli::ActiveIsaName().c_str(), exl3serve::cli::LoadAverages().c_str());
  const exl3serve::sharding::ModelArch& arch = (*model)->config().arch;
  std::printf("model %s (%d layers, hidden %lld, MLP %lld), vocab %lld, %d kernel threads, "
              "median of %d steps\n",
              model_dir.c_str(), arch.num_layers, static_cast<long long>(arch.hidden_size),
              static_cast<long long>(arch.intermediate_size),
              static_cast<long long>((*model)->vocab_size()),
              exl3serve::kernels::cpu::SharedThreadPool().size(), steps);
  if (!mixed_only) {
    std::printf("| batch | draft k | rows | step ms | decode step ms (ceiling) | ratio |"
                " break-even accepted/round |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (int batch : batches) {
      const double decode = TimeSteps(**model, batch, -1, steps);
      std::vector<int> ks = draft_list;
      if (ks.empty()) {
        for (int k = 0; k <= max_draft; k = k == 0 ? 1 : k * 2) ks.push_back(k);
      }
      for (int k : ks) {
        const double t = TimeSteps(**model, batch, k, steps);
        std::printf("| %d | %d | %d | %.2f | %.2f | %.2fx | %.2f |\n", batch, k, batch * (k + 1),
                    1e3 * t, 1e3 * decode, t / decode, t / decode - 1.0);
      }
    }
  }
  if (no_mixed) {
    std::printf("load average now %s\n", exl3serve::cli::LoadAverages().c_str());
    if (!tmp.empty()) std::filesystem::remove_all(tmp);
    return 0;
  }
  std::printf("\nmixed steps: row plan (int8 decode-kind rows + fp32 prefill-kind rows, one kernel "
              "call per kind) vs one fp32 call of all rows (ceiling: what the old m-based switch "
              "ran for steps of 17+ rows; steps under 17 rows ran the int8 arm)\n");
  std::printf("| step | rows | row plan ms | one fp32 call ms (ceiling) | ratio |\n");
  std::printf("|---|---|---|---|---|\n");
  for (const MixedShape& shape :
       {MixedShape{"8 decode + 64-token prefill chunk", 8, 1, 64},
        MixedShape{"4 x (1 + 4) verify rows", 4, 5, 0},
        MixedShape{"4 x (1 + 4) verify + 64-token prefill chunk", 4, 5, 64},
        MixedShape{"8 decode rows alone", 8, 1, 0},
        MixedShape{"64-token prefill chunk alone", 0, 0, 64}}) {
    const auto [plan, single] = TimeMixed(**model, shape, steps);
    std::printf("| %s | %d | %.2f | %.2f | %.2fx |\n", shape.name,
                shape.decode * shape.rows_each + shape.chunk, 1e3 * plan, 1e3 * single,
                plan / single);
    std::fflush(stdout);
  }
  std::printf("load average now %s\n", exl3serve::cli::LoadAverages().c_str());
  if (!tmp.empty()) std::filesystem::remove_all(tmp);
  return 0;
}
