// Decode tokens/s with tensor parallelism against one rank on the same
// cores, measured in the same run: TP = 2 (two rank processes, one kernel
// thread each, shm all-reduce) vs TP = 1 (this process, two threads), and
// the scaling efficiency (TP=2 tokens/s) / (TP=1 tokens/s). Goal (issue 5):
// >= 0.9.
//
//   tp_decode_bench [--model DIR] [--tokens N] [--tp N] [--threads T]
//
// Without --model it writes the largest built-in test model (a Llama of
// hidden 1024, 8 layers, MLP 2816, vocab 32000; ~ 130 M parameters as fp32)
// to a temporary directory. Each run: one 16-token prompt, then N greedy
// decode steps; tokens/s counts decode steps only (prefill excluded), median
// of 3 runs. Both configurations must produce the same tokens (checked).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "sharding/test_model.h"
#include "worker/model/generator.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace w = exl3serve::worker;

namespace {

struct Measured {
  double tokens_per_second = 0.0;
  std::vector<int32_t> tokens;
};

Measured Decode(w::StepExecutor& executor, int tokens) {
  std::vector<int32_t> prompt(16);
  for (int i = 0; i < 16; ++i) prompt[i] = 100 + 37 * i;
  std::vector<double> rates;
  Measured result;
  for (int run = 0; run < 3; ++run) {
    w::GenerationOptions options;
    options.sampling.temperature = 0.0f;
    options.max_new_tokens = tokens + 1;
    std::vector<int32_t> got;
    std::chrono::steady_clock::time_point first;
    auto status = w::Generate(executor, run, prompt, options, [&](const w::GeneratedStep& s) {
      if (got.empty()) first = std::chrono::steady_clock::now();  // prefill done
      got.push_back(s.token.id);
      return true;
    });
    const auto end = std::chrono::steady_clock::now();
    if (!status.ok()) {
      std::fprintf(stderr, "decode failed: %s\n", status.status().ToString().c_str());
      std::exit(1);
    }
    rates.push_back(tokens / std::chrono::duration<double>(end - first).count());
    result.tokens = got;
  }
  std::sort(rates.begin(), rates.end());
  result.tokens_per_second = rates[1];
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  int tokens = 32, tp = 2, threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--model") model_dir = argv[i + 1];
    else if (flag == "--tokens") tokens = std::atoi(argv[i + 1]);
    else if (flag == "--tp") tp = std::atoi(argv[i + 1]);
    else if (flag == "--threads") threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (threads <= 0) threads = tp;
  std::string temp;
  if (model_dir.empty()) {
    temp = (std::filesystem::temp_directory_path() / ("tp_decode_bench_" + std::to_string(getpid())))
               .string();
    exl3serve::sharding::TestModelOptions options;
    options.hidden_size = 1024;
    options.num_layers = 8;
    options.intermediate_size = 2816;
    options.num_attention_heads = 16;
    options.num_key_value_heads = 8;
    options.vocab_size = 32000;
    options.peaked_logits = true;
    std::printf("writing the built-in model (hidden 1024, 8 layers, mlp 2816, vocab 32000) to %s\n",
                temp.c_str());
    if (auto s = exl3serve::sharding::WriteTestModel(temp, options); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    model_dir = temp;
  }

  exl3serve::kernels::cpu::SetSharedThreadPoolSize(threads);
  auto model = w::Transformer::Load(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  w::KvCacheOptions kv;
  kv.num_pages = 64;
  auto cache = (*model)->CreateKvCache(kv);
  w::LocalStepExecutor local(model->get(), std::move(*cache));
  const Measured one = Decode(local, tokens);
  model->reset();

  w::rank::LocalGroupOptions group_options;
  group_options.model_dir = model_dir;
  group_options.executable = EXL3_EXE;
  group_options.world_size = tp;
  group_options.threads_per_rank = std::max(1, threads / tp);
  group_options.kv = kv;
  auto group = w::rank::LocalGroup::Start(group_options);
  if (!group.ok()) {
    std::fprintf(stderr, "%s\n", group.status().ToString().c_str());
    return 1;
  }
  const Measured many = Decode(**group, tokens);
  group->reset();
  if (!temp.empty()) std::filesystem::remove_all(temp);

  std::printf("\n%-28s %12s\n", "configuration", "tokens/s");
  std::printf("%-28s %12.2f\n", ("TP=1, " + std::to_string(threads) + " threads").c_str(),
              one.tokens_per_second);
  std::printf("%-28s %12.2f\n",
              ("TP=" + std::to_string(tp) + ", " + std::to_string(group_options.threads_per_rank) +
               " thread/rank, shm")
                  .c_str(),
              many.tokens_per_second);
  std::printf("scaling efficiency (TP=%d / TP=1 on the same %d cores): %.2f (goal >= 0.9)\n", tp,
              threads, many.tokens_per_second / one.tokens_per_second);
  std::printf("tokens identical: %s\n", one.tokens == many.tokens ? "yes" : "NO");
  return one.tokens == many.tokens ? 0 : 1;
}
