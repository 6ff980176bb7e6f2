// Gated DeltaNet hybrids (issue 36) on this machine, measured in one run:
//
// 1. The recurrence of one layer of the Qwen3.5-27B shape (48 value heads of
//    dk = dv = 128) and the 35B-A3B shape (32 heads), on all threads, over
//    2 048 tokens: the chunked form the model runs (kernels::GatedDeltaChunked)
//    in one call (prefill) and one token per call (decode), against the
//    recurrent form token by token (kernels::GatedDeltaRule).
// 1b. One whole Gated DeltaNet layer of the 35B-A3B shapes in a one-layer
//    model: a 2 048-token prompt in one forward vs one forward per token
//    (the goal: >= 10x).
// 2. A bench model with the real per-layer shapes of Qwen3.5-35B-A3B (hidden
//    2048; gated attention 16 / 2 heads of 256, 64 dims rotated; Gated
//    DeltaNet Hk 16, Hv 32, dk = dv = 128, conv 4; MoE top-8 of width 512 and
//    a gated shared expert of 512), 4 layers [linear x 3, full], 16 experts
//    instead of 256 (the same work per token), vocab 1000, bf16 weights held in
//    16 bits: decode tokens/s (1 stream, greedy argmax) after a 256-token
//    and after an 8192-token context, and their ratio (the goal: >= 0.9 —
//    three layers in four read no context); prefill tokens/s of a 2048-token
//    prompt; the per-sequence state bytes.
// 3. The prefix cache with state snapshots on that model: TTFT of a
//    2048-token prompt computed vs resumed from its snapshot (goal: >= 5x
//    lower), and the snapshot's cost (us, bytes; per block at the default
//    interval of 32 blocks).
//
//   gdn_bench [--work DIR] [--contexts 256,8192] [--decode 16] [--quick]
//
// --quick: contexts 256,2048 and 8 decode steps (a smoke run). The model is
// written to --work (default: a temp dir, removed) and reused when present.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gated_delta_chunk.h"
#include "kernels/cpu/gated_delta_rule.h"
#include "kernels/cpu/thread_pool.h"
#include "sharding/test_model.h"
#include "worker/model/transformer.h"

namespace exl3serve {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The inputs of one layer's recurrence: `tokens` tokens of `heads` value
// heads (each head its own q, k, v, gate, β rows).
struct RecurrenceInputs {
  int64_t heads, dk, dv, tokens;
  std::vector<float> q, k, v, g, decay, beta;
};

RecurrenceInputs MakeInputs(int64_t heads, int64_t dk, int64_t dv, int64_t tokens) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  RecurrenceInputs in{heads, dk, dv, tokens, {}, {}, {}, {}, {}, {}};
  in.q.resize(tokens * dk);
  in.k.resize(tokens * dk);
  in.v.resize(tokens * dv);
  for (float& x : in.q) x = normal(rng) / std::sqrt(static_cast<float>(dk * dk));
  for (float& x : in.k) x = normal(rng) / std::sqrt(static_cast<float>(dk));
  for (float& x : in.v) x = normal(rng);
  in.g.assign(tokens, std::log(0.95f));
  in.decay.assign(tokens, 0.95f);
  in.beta.assign(tokens, 0.5f);
  return in;
}

// Tokens/s of one layer's recurrence, all heads in parallel on the pool:
// `per_call` tokens per call (1: as decode runs; tokens: one prefill call),
// in the chunked form (kernels::GatedDeltaChunked, what the model runs) or
// the recurrent form token by token (kernels::GatedDeltaRule, the reference
// recurrence: S read and written twice per token). Also the checksum of the
// outputs, so that the forms can be compared.
double RecurrenceTokensPerSecond(const RecurrenceInputs& in, int64_t per_call, bool chunked,
                                 double* checksum) {
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();
  const int64_t dk = in.dk, dv = in.dv, tokens = in.tokens;
  const int64_t head_floats =
      chunked ? kernels::GatedDeltaHeadStateFloats(dk, dv) : dk * dv;
  std::vector<float> state(in.heads * head_floats, 0.0f), o(in.heads * tokens * dv);
  const auto t0 = Clock::now();
  for (int64_t t = 0; t < tokens; t += per_call) {
    const int64_t n = std::min(per_call, tokens - t);
    pool.ParallelFor(in.heads, 0, [&](int64_t h, int) {
      float* out = &o[(h * tokens + t) * dv];
      if (chunked) {
        kernels::GatedDeltaChunked(t, n, dk, dv, &in.q[t * dk], dk, &in.k[t * dk], dk,
                                   &in.v[t * dv], dv, &in.g[t], &in.beta[t], 1,
                                   &state[h * head_floats], out, dv, nullptr, 0);
      } else {
        kernels::GatedDeltaRule(n, dk, dv, &in.q[t * dk], dk, &in.k[t * dk], dk, &in.v[t * dv],
                                dv, &in.decay[t], &in.beta[t], 1, &state[h * head_floats], out,
                                dv, nullptr, 0);
      }
    });
  }
  const double rate = static_cast<double>(tokens) / Seconds(t0, Clock::now());
  *checksum = 0.0;
  for (float x : o) *checksum += x;
  return rate;
}

// The per-layer shapes of Qwen3.5-35B-A3B: hidden 2048; gated attention
// 16 / 2 heads of 256; Gated DeltaNet Hk 16, Hv 32, dk = dv = 128.
void SetQwen35A3bShapes(sharding::TestModelOptions* o) {
  o->hidden_size = 2048;
  o->num_attention_heads = 16;
  o->num_key_value_heads = 2;
  o->head_dim = 256;
  o->gdn_key_heads = 16;
  o->gdn_value_heads = 32;
  o->gdn_key_dim = 128;
  o->gdn_value_dim = 128;
}

int32_t ArgMax(const std::vector<float>& row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

int Main(int argc, char** argv) {
  std::string work;
  std::vector<int64_t> contexts = {256, 8192};
  int decode = 16;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> std::string {
      const std::string prefix = std::string(flag) + "=";
      if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
      if (a == flag && i + 1 < argc) return argv[++i];
      return "";
    };
    if (a == "--quick") {
      quick = true;
      contexts = {256, 2048};
      decode = 8;
    } else if (std::string v = value("--work"); !v.empty()) {
      work = v;
    } else if (std::string v = value("--decode"); !v.empty()) {
      decode = std::atoi(v.c_str());
    } else if (std::string v = value("--contexts"); !v.empty()) {
      contexts.clear();
      for (absl::string_view c : absl::StrSplit(v, ',')) {
        int64_t n = 0;
        if (absl::SimpleAtoi(c, &n)) contexts.push_back(n);
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const bool temp = work.empty();
  if (temp) work = std::filesystem::temp_directory_path() / ("gdn_bench." + std::to_string(getpid()));

  // 1. One layer's recurrence (all its value heads): the chunked form fed
  // 2 048 tokens in one call (prefill) and one token per call (decode),
  // against the recurrent form token by token.
  std::printf("recurrence of one layer, %d threads (%s variants), %d tokens:\n\n",
              kernels::cpu::SharedThreadPool().size(),
              std::string(kernels::cpu::CpuIsaName(kernels::cpu::ActiveCpuIsa())).c_str(),
              quick ? 512 : 2048);
  std::printf("| layer shape | heads x dk x dv | state MiB | recurrent, token by token | "
              "chunked, token by token | chunked, all at once | at once / recurrent | "
              "outputs differ (rel.) |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (auto [name, heads] : {std::pair<const char*, int64_t>{"Qwen3.5-27B", 48}, {"Qwen3.5-35B-A3B", 32}}) {
    const int64_t tokens = quick ? 512 : 2048;
    const RecurrenceInputs in = MakeInputs(heads, 128, 128, tokens);
    double sum_recurrent = 0, sum_each = 0, sum_once = 0;
    const double recurrent = RecurrenceTokensPerSecond(in, 1, false, &sum_recurrent);
    const double each = RecurrenceTokensPerSecond(in, 1, true, &sum_each);
    const double once = RecurrenceTokensPerSecond(in, tokens, true, &sum_once);
    if (sum_each != sum_once) {
      std::fprintf(stderr, "chunked outputs differ between one call and token by token\n");
      return 1;
    }
    const double state = 4.0 * heads * kernels::GatedDeltaHeadStateFloats(128, 128);
    std::printf("| %s | %lld x 128 x 128 | %.2f | %.0f tok/s | %.0f tok/s | %.0f tok/s | "
                "**%.1fx** | %.1e |\n",
                name, static_cast<long long>(heads), state / 1048576.0, recurrent, each, once,
                once / recurrent,
                std::abs(sum_once - sum_recurrent) / std::max(1e-30, std::abs(sum_recurrent)));
  }

  // 1b. The whole layer (projections, conv, recurrence, gated norm,
  // out_proj) in a one-layer model of the 35B-A3B shapes (linear attention,
  // a dense MLP of width 64, vocab 1000, bf16): a 2 048-token prompt in one
  // forward vs the same tokens fed one forward per token.
  {
    sharding::TestModelOptions lo = sharding::Qwen3NextTestDefaults("qwen3.5");
    lo.seed = 3;
    lo.num_layers = 1;
    SetQwen35A3bShapes(&lo);
    lo.intermediate_size = 64;
    lo.vocab_size = 1000;
    const std::string layer_dir = work + "/gdn-layer-35b-a3b-shape";
    if (!std::filesystem::exists(layer_dir + "/config.json")) {
      if (absl::Status s = sharding::WriteTestModel(layer_dir, lo); !s.ok()) {
        std::fprintf(stderr, "write: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    absl::StatusOr<std::unique_ptr<worker::Transformer>> layer_model =
        worker::Transformer::Load(layer_dir);
    if (!layer_model.ok()) {
      std::fprintf(stderr, "load: %s\n", std::string(layer_model.status().message()).c_str());
      return 1;
    }
    const int64_t tokens = quick ? 256 : 2048;
    worker::KvCacheOptions lkv;
    lkv.num_pages = tokens / 16 + 4;
    absl::StatusOr<worker::PagedKvCache> lcache = (*layer_model)->CreateKvCache(lkv);
    if (!lcache.ok()) return 1;
    std::mt19937 lrng(4);
    std::vector<int32_t> ids(tokens);
    for (int32_t& id : ids) id = static_cast<int32_t>(lrng() % 1000);
    std::vector<float> once_logits, each_logits;
    if (!lcache->AddSequence(1).ok()) return 1;
    auto t0 = Clock::now();
    const worker::SequenceTokens whole{1, ids};
    if (absl::Status st = (*layer_model)->Forward({&whole, 1}, worker::LogitsRows::kLastToken,
                                                  &*lcache, &once_logits);
        !st.ok()) {
      std::fprintf(stderr, "layer prefill: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    const double once = static_cast<double>(tokens) / Seconds(t0, Clock::now());
    (void)lcache->RemoveSequence(1);
    if (!lcache->AddSequence(2).ok()) return 1;
    t0 = Clock::now();
    for (int64_t t = 0; t < tokens; ++t) {
      const worker::SequenceTokens one{2, std::span<const int32_t>(ids).subspan(t, 1)};
      if (!(*layer_model)->Forward({&one, 1}, worker::LogitsRows::kLastToken, &*lcache, &each_logits).ok()) {
        return 1;
      }
    }
    const double each = static_cast<double>(tokens) / Seconds(t0, Clock::now());
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < once_logits.size(); ++i) {
      diff = std::max<double>(diff, std::abs(once_logits[i] - each_logits[i]));
      norm = std::max<double>(norm, std::abs(once_logits[i]));
    }
    std::printf("\none Gated DeltaNet layer (35B-A3B shapes, bf16, in a 1-layer model), %lld tokens:\n\n"
                "| | tok/s |\n|---|---|\n| one forward per token | %.1f |\n"
                "| all tokens in one forward (chunked form) | %.1f |\n| ratio | **%.1fx** |\n\n"
                "(last logits of the two: max difference %.1e relative)\n",
                static_cast<long long>(tokens), each, once, once / each, diff / std::max(norm, 1e-30));
  }

  // 2. The bench model.
  sharding::TestModelOptions o = sharding::Qwen3NextTestDefaults("qwen3.5-moe");
  o.seed = 7;
  SetQwen35A3bShapes(&o);
  o.num_experts = 16;
  o.num_experts_per_token = 8;
  o.moe_intermediate_size = 512;
  o.shared_expert_intermediate_size = 512;
  o.intermediate_size = 512;
  o.vocab_size = 1000;
  const std::string dir = work + "/qwen3.5-35b-a3b-shape";
  if (!std::filesystem::exists(dir + "/config.json")) {
    const auto t0 = Clock::now();
    if (absl::Status s = sharding::WriteTestModel(dir, o); !s.ok()) {
      std::fprintf(stderr, "write: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("\nwrote the bench model in %.1f s\n", Seconds(t0, Clock::now()));
  }
  absl::StatusOr<std::unique_ptr<worker::Transformer>> model = worker::Transformer::Load(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
  worker::KvCacheOptions kv;
  kv.dtype = worker::KvCacheDtype::kFp16;
  kv.num_pages = (max_context + decode + 2048 + 15) / 16 + 4;
  absl::StatusOr<worker::PagedKvCache> cache = (*model)->CreateKvCache(kv);
  if (!cache.ok()) {
    std::fprintf(stderr, "cache: %s\n", std::string(cache.status().message()).c_str());
    return 1;
  }
  std::printf("\nbench model (Qwen3.5-35B-A3B layer shapes, 4 layers, bf16): recurrent state %.2f MiB "
              "per sequence (%lld state slots), KV %lld bytes per token (1 attention layer, fp16)\n",
              cache->state_bytes_per_sequence() / 1048576.0,
              static_cast<long long>(cache->shape().state_floats.size()),
              static_cast<long long>(cache->bytes_per_page() / kv.page_size_tokens));
  std::mt19937 rng(9);
  auto prompt = [&](int64_t n) {
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 1000);
    return ids;
  };
  std::vector<float> logits;
  // Prefill 2048 tokens in chunks of 512 (as the scheduler feeds them).
  {
    const std::vector<int32_t> p = prompt(2048);
    if (!cache->AddSequence(1).ok()) return 1;
    const auto t0 = Clock::now();
    for (size_t at = 0; at < p.size(); at += 512) {
      const worker::SequenceTokens entry{1, std::span<const int32_t>(p).subspan(at, 512)};
      if (absl::Status s = (*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*cache, &logits);
          !s.ok()) {
        std::fprintf(stderr, "prefill: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    std::printf("prefill of 2048 tokens (chunks of 512): %.1f tok/s\n",
                2048.0 / Seconds(t0, Clock::now()));
    (void)cache->RemoveSequence(1);
  }
  std::printf("\n| context | decode tok/s (1 stream) | vs %lld |\n|---|---|---|\n",
              static_cast<long long>(contexts.front()));
  double first = 0.0;
  for (int64_t context : contexts) {
    const std::vector<int32_t> p = prompt(context);
    if (!cache->AddSequence(2).ok()) return 1;
    for (size_t at = 0; at < p.size(); at += 512) {
      const size_t n = std::min<size_t>(512, p.size() - at);
      const worker::SequenceTokens entry{2, std::span<const int32_t>(p).subspan(at, n)};
      if (absl::Status s = (*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*cache, &logits);
          !s.ok()) {
        std::fprintf(stderr, "context: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    int32_t next = ArgMax(logits);
    std::vector<double> times;
    for (int i = 0; i < decode; ++i) {
      const worker::SequenceTokens entry{2, {&next, 1}};
      const auto t0 = Clock::now();
      if (!(*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*cache, &logits).ok()) return 1;
      times.push_back(Seconds(t0, Clock::now()));
      next = ArgMax(logits);
    }
    std::sort(times.begin(), times.end());
    const double rate = 1.0 / times[times.size() / 2];
    if (first == 0.0) first = rate;
    std::printf("| %lld | %.2f | %.3f |\n", static_cast<long long>(context), rate, rate / first);
    (void)cache->RemoveSequence(2);
  }
  // 3. The prefix cache with state snapshots (coordinator/scheduler.h), on
  // a cache whose pages the caller places as the coordinator does: a
  // 2048-token prompt computed (cut at its last full block, 2032, where the
  // state is snapshotted, then its 16 last tokens) vs the same prompt again,
  // resumed from the snapshot and its 127 cached blocks (16 tokens computed).
  // Time to the first token's logits, medians of `rounds`.
  {
    worker::KvCacheOptions assigned = kv;
    assigned.caller_assigns_pages = true;
    assigned.num_pages = 2048 / 16 + 2;
    absl::StatusOr<worker::PagedKvCache> pc = (*model)->CreateKvCache(assigned);
    if (!pc.ok()) return 1;
    const std::vector<int32_t> p = prompt(2048);
    std::vector<int32_t> pages(2048 / 16);
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<int32_t>(i);
    const int32_t tail_page = static_cast<int32_t>(pages.size());
    const int64_t cut = (2048 - 1) / 16 * 16;
    const worker::StateSnapshotRef snap{.slot = 0, .hash_hi = 1, .hash_lo = 2};
    std::vector<double> miss, hit, save, restore;
    const int rounds = quick ? 2 : 5;
    int64_t id = 100;
    for (int r = 0; r < rounds; ++r) {
      // Miss: the whole prompt.
      const int64_t a = id++;
      if (!pc->AddSequence(a).ok() || !pc->AssignPages(a, pages).ok()) return 1;
      const auto t0 = Clock::now();
      for (int64_t at = 0; at < cut; at += 512) {
        const worker::SequenceTokens entry{
            a, std::span<const int32_t>(p).subspan(at, std::min<int64_t>(512, cut - at))};
        if (!(*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*pc, &logits).ok()) return 1;
      }
      const auto s0 = Clock::now();
      if (absl::Status s = pc->SaveStateSnapshot(a, snap); !s.ok()) {
        std::fprintf(stderr, "snapshot: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      const auto s1 = Clock::now();
      {
        const worker::SequenceTokens entry{a, std::span<const int32_t>(p).subspan(cut)};
        if (!(*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*pc, &logits).ok()) return 1;
      }
      miss.push_back(Seconds(t0, Clock::now()));
      save.push_back(Seconds(s0, s1));
      const int32_t miss_next = ArgMax(logits);
      (void)pc->RemoveSequence(a);  // its pages keep their content (caller-placed)
      // Hit: the cached blocks and the snapshot; the last 16 tokens.
      const int64_t b = id++;
      const auto t1 = Clock::now();
      if (absl::Status s = pc->AddSequence(b, cut, snap); !s.ok()) {
        std::fprintf(stderr, "resume: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      const auto t2 = Clock::now();
      std::vector<int32_t> table(pages.begin(), pages.begin() + cut / 16);
      table.push_back(tail_page);
      if (!pc->AssignPages(b, table).ok()) return 1;
      {
        const worker::SequenceTokens entry{b, std::span<const int32_t>(p).subspan(cut)};
        if (!(*model)->Forward({&entry, 1}, worker::LogitsRows::kLastToken, &*pc, &logits).ok()) return 1;
      }
      hit.push_back(Seconds(t1, Clock::now()));
      restore.push_back(Seconds(t1, t2));
      if (ArgMax(logits) != miss_next) {
        std::fprintf(stderr, "the resumed prompt's next token differs from the computed one\n");
        return 1;
      }
      (void)pc->RemoveSequence(b);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double bytes = static_cast<double>(pc->state_bytes_per_sequence());
    std::printf("\nprefix cache with state snapshots, a 2048-token prompt (medians of %d):\n\n",
                rounds);
    std::printf("| | time | note |\n|---|---|---|\n");
    std::printf("| TTFT, miss (computed; cut at 2032 for the snapshot) | %.1f ms | |\n",
                median(miss) * 1e3);
    std::printf("| TTFT, hit (snapshot + 127 cached blocks, 16 tokens computed) | %.1f ms | "
                "%.1fx lower, same next token |\n",
                median(hit) * 1e3, median(miss) / median(hit));
    std::printf("| snapshot (save) | %.0f us | %.2f MiB, %.1f GB/s |\n", median(save) * 1e6,
                bytes / 1048576.0, bytes / median(save) / 1e9);
    std::printf("| resume (restore into a new sequence) | %.0f us | |\n", median(restore) * 1e6);
    std::printf("| snapshot per block, every 32 blocks (the default interval) | %.1f us | %.0f bytes "
                "per block |\n",
                median(save) * 1e6 / 32.0, bytes / 32.0);
  }
  if (temp) std::filesystem::remove_all(work);
  return 0;
}

}  // namespace
}  // namespace exl3serve

int main(int argc, char** argv) { return exl3serve::Main(argc, argv); }
