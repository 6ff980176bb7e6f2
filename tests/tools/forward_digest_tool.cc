// forward_digest_tool — one line per architecture with a hash of the bytes of
// every logit its test model produces over a fixed workload, to show that a
// restructuring of the model code changed no output bit (run it before and
// after; the lines must be equal). Workload per model, at every KV dtype
// listed and both decode precisions (fp32, int8 on mul1 EXL3 linears):
//   sequence A: 23-token prompt, logits of every position;
//   sequence B: 5-token prompt (last position);
//   8 steps decoding A and B together (greedy), then 3 steps of A alone;
//   tensor parallelism (--exe given): the same through a LocalGroup of
//   2 ranks (and TP 2 x EP 2 for the MoE models), hashed separately.
//
//   forward_digest_tool --dir /tmp/digest [--exe build/cli/exl3serve] [--only glm4-moe]
//   llama bf16 kv=fp16 dec=fp32 3f0c9a1e5b7d2c44
//   ...
// The hash depends on the CPU's kernel dispatch (AVX-512 vs AVX2): compare
// lines from the same machine only.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/trellis_gemm.h"
#include "sharding/converter.h"
#include "sharding/test_model.h"
#include "worker/model/linear.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve {
namespace {

uint64_t Fnv(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<int32_t> Prompt(int n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids(n);
  uint32_t x = seed;
  for (int32_t& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % vocab);
  }
  return ids;
}

int32_t ArgMax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (row[i] > row[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// The workload above through `executor`; the hash of every logit, or 0 on error.
uint64_t Workload(worker::StepExecutor& executor, int64_t vocab) {
  uint64_t h = 1469598103934665603ull;
  std::vector<float> logits;
  const std::vector<int32_t> a = Prompt(23, vocab, 7), b = Prompt(5, vocab, 9);
  if (!executor.AddSequence(1).ok() || !executor.AddSequence(2).ok()) return 0;
  worker::SequenceTokens ea{1, a};
  absl::Status s = executor.Forward({&ea, 1}, worker::LogitsRows::kAllTokens, &logits);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 0;
  }
  h = Fnv(h, logits.data(), logits.size() * sizeof(float));
  int32_t next_a = ArgMax(logits.data() + (a.size() - 1) * vocab, vocab);
  worker::SequenceTokens eb{2, b};
  if (!executor.Forward({&eb, 1}, worker::LogitsRows::kLastToken, &logits).ok()) return 0;
  h = Fnv(h, logits.data(), logits.size() * sizeof(float));
  int32_t next_b = ArgMax(logits.data(), vocab);
  for (int step = 0; step < 8; ++step) {
    const int32_t ta = next_a, tb = next_b;
    worker::SequenceTokens batch[2] = {{1, {&ta, 1}}, {2, {&tb, 1}}};
    if (!executor.Forward(batch, worker::LogitsRows::kLastToken, &logits).ok()) return 0;
    h = Fnv(h, logits.data(), logits.size() * sizeof(float));
    next_a = ArgMax(logits.data(), vocab);
    next_b = ArgMax(logits.data() + vocab, vocab);
  }
  for (int step = 0; step < 3; ++step) {
    const int32_t ta = next_a;
    worker::SequenceTokens one{1, {&ta, 1}};
    if (!executor.Forward({&one, 1}, worker::LogitsRows::kLastToken, &logits).ok()) return 0;
    h = Fnv(h, logits.data(), logits.size() * sizeof(float));
    next_a = ArgMax(logits.data(), vocab);
  }
  (void)executor.RemoveSequence(1);
  (void)executor.RemoveSequence(2);
  return h;
}

struct Model {
  std::string name;
  sharding::TestModelOptions options;
  bool moe = false;
};

int Main(int argc, char** argv) {
  std::string dir = "/tmp/forward-digest", exe, only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    else if (flag == "--exe") exe = argv[i + 1];
    else if (flag == "--only") only = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::vector<Model> models;
  {
    Model m{"llama", {}};
    m.options.seed = 11;
    models.push_back(m);
    m = Model{"qwen3-tied", {}};
    m.options.arch = "qwen3";
    m.options.tie_word_embeddings = true;
    m.options.num_attention_heads = 6;
    m.options.num_key_value_heads = 3;
    m.options.head_dim = 40;
    m.options.seed = 12;
    models.push_back(m);
    m = Model{"qwen3-moe", {}, true};
    m.options.arch = "qwen3-moe";
    m.options.num_experts = 6;
    m.options.seed = 13;
    models.push_back(m);
    m = Model{"mixtral", {}, true};
    m.options.arch = "mixtral";
    m.options.seed = 14;
    models.push_back(m);
    m = Model{"glm4-moe", sharding::Glm4MoeTestDefaults(), true};
    models.push_back(m);
    m = Model{"deepseek-v3", sharding::DeepseekV3TestDefaults(), true};
    models.push_back(m);
    m = Model{"deepseek-v3-plain-q", sharding::DeepseekV3TestDefaults(), true};
    m.options.q_lora_rank = 0;
    models.push_back(m);
  }
  for (const Model& m : models) {
    if (!only.empty() && m.name != only) continue;
    const std::string plain = absl::StrCat(dir, "/", m.name);
    if (absl::Status s = sharding::WriteTestModel(plain, m.options); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", m.name.c_str(), std::string(s.message()).c_str());
      return 1;
    }
    sharding::ConvertOptions convert;
    convert.in_dir = plain;
    convert.out_dir = plain + "-exl3";
    convert.bits = 3.0;
    convert.show_progress = false;
    if (absl::StatusOr<sharding::ConvertReport> r = sharding::ConvertModel(convert); !r.ok()) {
      std::fprintf(stderr, "%s: %s\n", m.name.c_str(), std::string(r.status().message()).c_str());
      return 1;
    }
    for (const auto& [format, path] :
         {std::pair<std::string, std::string>{"bf16", plain}, {"exl3", convert.out_dir}}) {
      absl::StatusOr<std::unique_ptr<worker::Transformer>> model = worker::Transformer::Load(path);
      if (!model.ok()) {
        std::fprintf(stderr, "%s: %s\n", path.c_str(), std::string(model.status().message()).c_str());
        return 1;
      }
      for (worker::KvCacheDtype kv : {worker::KvCacheDtype::kFp32, worker::KvCacheDtype::kFp16,
                                      worker::KvCacheDtype::kInt8}) {
        for (kernels::TrellisGemmPrecision dec :
             {kernels::TrellisGemmPrecision::kFloat, kernels::TrellisGemmPrecision::kInt8}) {
          if (format == "bf16" && dec != kernels::TrellisGemmPrecision::kFloat) continue;
          (void)worker::SetDecodePrecision(dec);
          worker::KvCacheOptions options;
          options.dtype = kv;
          options.num_pages = 64;
          absl::StatusOr<worker::PagedKvCache> cache = (*model)->CreateKvCache(options);
          if (!cache.ok()) return 1;
          worker::LocalStepExecutor local(model->get(), std::move(*cache));
          std::printf("%s %s kv=%d dec=%s %016" PRIx64 "\n", m.name.c_str(), format.c_str(),
                      static_cast<int>(kv), worker::GemmPrecisionName(dec),
                      Workload(local, (*model)->vocab_size()));
          std::fflush(stdout);
        }
      }
      (void)worker::SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat);
      if (exe.empty()) continue;
      for (auto [tp, ep] : {std::pair<int, int>{2, 0}, {2, 2}, {3, 0}}) {
        if (ep > 0 && !m.moe) continue;
        for (kernels::TrellisGemmPrecision dec :
             {kernels::TrellisGemmPrecision::kFloat, kernels::TrellisGemmPrecision::kInt8}) {
          if (format == "bf16" && dec != kernels::TrellisGemmPrecision::kFloat) continue;
          worker::rank::LocalGroupOptions options;
          options.model_dir = path;
          options.world_size = tp;
          options.expert_parallel = ep;
          options.executable = exe;
          options.kv.dtype = worker::KvCacheDtype::kFp16;
          options.kv.num_pages = 64;
          options.decode_precision = dec;
          absl::StatusOr<std::unique_ptr<worker::rank::LocalGroup>> group =
              worker::rank::LocalGroup::Start(options);
          if (!group.ok()) {
            std::fprintf(stderr, "%s tp=%d: %s\n", path.c_str(), tp,
                         std::string(group.status().message()).c_str());
            return 1;
          }
          std::printf("%s %s tp=%d ep=%d dec=%s %016" PRIx64 "\n", m.name.c_str(),
                      format.c_str(), tp, ep, worker::GemmPrecisionName(dec),
                      Workload(**group, (*model)->vocab_size()));
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace exl3serve

int main(int argc, char** argv) { return exl3serve::Main(argc, argv); }
