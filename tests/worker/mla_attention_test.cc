// Multi-head latent attention (DeepseekV3ForCausalLM, architectures.md §2)
// in worker::Transformer on the odd-sized `make-test-model --arch
// deepseek-v3` shape: the prefill path (the cached latent decompressed
// through kv_b_proj, ordinary per-head attention) and the absorbed decode
// (W_UK folded into the query, attention over the latent, W_UV after) agree;
// chunked prefill agrees with both; the paged latent cache holds c_kv and
// k_pe per token (its bytes per token), and its 8-bit and 4-bit forms stay
// within stated bounds of the fp32 cache. The logits against an independent
// float64 forward are checked by cli.deepseek_v3_reference_test.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "common/logging.h"
#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "worker/model/linear.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

// fp32 arithmetic both ways (fp32 cache), only the order of the sums
// differs: measured 2e-7 .. 6e-7 (random model, 30 positions).
constexpr double kPathTolerance = 1e-5;
// The latent cache quantized (LatentCacheBytesAndQuantizedErrorBounds):
// teacher-forced over 40 positions, relative L2 of each step's logits
// against the fp32 cache, and steps whose argmax equals the fp32 one. On
// the random models (no logit margins; a perturbed hidden state also flips
// near-tied expert choices of the grouped router, which moves a step's
// logits by a lot) measured int8 max 0.78 / 0.88, mean 0.11 / 0.12,
// argmax 35 / 33 of 40; int4 max 1.1 / 1.4, mean 0.61 / 0.79; fp16 max
// 2.9e-3. On the peaked model (the demo models' kind) int8 max 7.1e-3,
// mean 2.7e-3, argmax 40 of 40; int4 max 0.26, mean 6.5e-2, 39 of 40.
struct CacheBounds {
  double fp16_max, int8_max, int8_mean, int4_max, int4_mean;
  int int8_agree, int4_agree;  // of 40
};
constexpr CacheBounds kRandomBounds = {1e-2, 1.2, 0.2, 2.0, 1.0, 30, 4};
constexpr CacheBounds kPeakedBounds = {1e-3, 1.5e-2, 5e-3, 0.4, 0.12, 40, 36};

double RelativeL2(const float* got, const float* want, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

struct Variant {
  bool q_lora = true;
  bool peaked = false;
};

// gtest prints the parameter in test names and listings: its meaning.
void PrintTo(const Variant& v, std::ostream* os) {
  *os << (v.q_lora ? "q_lora_rank 72" : "q_lora_rank null") << (v.peaked ? ", peaked" : ", random");
}

class MlaAttentionTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("mla_attention_test_" + std::to_string(::getpid()) +
             (GetParam().q_lora ? "_qlora" : "_q") + (GetParam().peaked ? "_peaked" : "")))
               .string();
    sharding::TestModelOptions o = sharding::DeepseekV3TestDefaults();
    if (!GetParam().q_lora) o.q_lora_rank = 0;  // plain q_proj
    o.peaked_logits = GetParam().peaked;
    o.seed = 11;
    ASSERT_TRUE(sharding::WriteTestModel(dir_, o).ok());
    absl::StatusOr<std::unique_ptr<Transformer>> model = Transformer::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    ASSERT_TRUE(model_->config().arch.mla());
    vocab_ = model_->vocab_size();
    for (int i = 0; i < 40; ++i) tokens_.push_back((i * 37 + 11) % 1000);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  PagedKvCache NewCache(KvCacheDtype dtype) {
    KvCacheOptions options;
    options.dtype = dtype;
    options.num_pages = 16;
    absl::StatusOr<PagedKvCache> cache = model_->CreateKvCache(options);
    EXL3_CHECK(cache.ok()) << cache.status();
    EXL3_CHECK(cache->AddSequence(0).ok());
    return std::move(*cache);
  }

  // Logits of every position of tokens_[0, n), fed in chunks of `chunk`.
  std::vector<float> Run(int64_t n, int64_t chunk, KvCacheDtype dtype) {
    PagedKvCache cache = NewCache(dtype);
    std::vector<float> all, logits;
    for (int64_t at = 0; at < n; at += chunk) {
      const int64_t len = std::min(chunk, n - at);
      SequenceTokens entry{0, std::span<const int32_t>(tokens_.data() + at, len)};
      absl::Status s = model_->Forward({&entry, 1}, LogitsRows::kAllTokens, &cache, &logits);
      EXL3_CHECK(s.ok()) << s;
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }

  std::string dir_;
  std::unique_ptr<Transformer> model_;
  int64_t vocab_ = 0;
  std::vector<int32_t> tokens_;
};

TEST_P(MlaAttentionTest, PrefillPathAndAbsorbedDecodeAgree) {
  const int64_t n = 30;
  ASSERT_GE(n, kPrefillMinRows);
  const std::vector<float> prefill = Run(n, n, KvCacheDtype::kFp32);  // decompressed
  const std::vector<float> decode = Run(n, 1, KvCacheDtype::kFp32);   // absorbed
  const std::vector<float> chunks = Run(n, 7, KvCacheDtype::kFp32);   // absorbed, 7 queries
  // 18 tokens then 12: the second chunk decompresses 18 cached positions.
  std::vector<float> mixed = Run(18, 18, KvCacheDtype::kFp32);
  {
    PagedKvCache cache = NewCache(KvCacheDtype::kFp32);
    std::vector<float> logits;
    SequenceTokens first{0, std::span<const int32_t>(tokens_.data(), 20)};
    ASSERT_TRUE(model_->Forward({&first, 1}, LogitsRows::kAllTokens, &cache, &logits).ok());
    SequenceTokens second{0, std::span<const int32_t>(tokens_.data() + 20, 10)};
    ASSERT_TRUE(model_->Forward({&second, 1}, LogitsRows::kAllTokens, &cache, &logits).ok());
    mixed.assign(logits.begin(), logits.end());  // positions 20..29
  }
  double worst_decode = 0.0, worst_chunks = 0.0, worst_mixed = 0.0;
  bool any_bit_differs = false;
  for (int64_t t = 0; t < n; ++t) {
    const float* p = &prefill[t * vocab_];
    worst_decode = std::max(worst_decode, RelativeL2(&decode[t * vocab_], p, vocab_));
    worst_chunks = std::max(worst_chunks, RelativeL2(&chunks[t * vocab_], p, vocab_));
    if (t >= 20) worst_mixed = std::max(worst_mixed, RelativeL2(&mixed[(t - 20) * vocab_], p, vocab_));
    for (int64_t i = 0; i < vocab_; ++i) any_bit_differs |= decode[t * vocab_ + i] != p[i];
  }
  std::printf("relative L2 vs the prefill path: absorbed decode %.2e, chunks of 7 %.2e, "
              "20 + 10 %.2e\n", worst_decode, worst_chunks, worst_mixed);
  EXPECT_LE(worst_decode, kPathTolerance);
  EXPECT_LE(worst_chunks, kPathTolerance);
  EXPECT_LE(worst_mixed, kPathTolerance);
  // Different arithmetic really ran (the two paths are not one code path).
  EXPECT_TRUE(any_bit_differs);
}

TEST_P(MlaAttentionTest, LatentCacheBytesAndQuantizedErrorBounds) {
  const sharding::ModelArch& arch = model_->config().arch;
  const int64_t layers = arch.num_layers, dc = arch.kv_lora_rank, r = arch.qk_rope_head_dim;
  struct Expect {
    KvCacheDtype dtype;
    int64_t bytes_per_token;
  };
  // c_kv and k_pe per token per layer, one scale (4 B) each when int8/int4.
  for (const Expect& e : {Expect{KvCacheDtype::kFp32, layers * (dc + r) * 4},
                          Expect{KvCacheDtype::kFp16, layers * (dc + r) * 2},
                          Expect{KvCacheDtype::kInt8, layers * (dc + 4 + r + 4)},
                          Expect{KvCacheDtype::kInt4, layers * (dc / 2 + 4 + r / 2 + 4)}}) {
    PagedKvCache cache = NewCache(e.dtype);
    EXPECT_EQ(cache.bytes_per_page(), e.bytes_per_token * cache.options().page_size_tokens);
  }
  // Teacher-forced: every step sees the same tokens, only the cache differs.
  const int64_t n = 40;
  const std::vector<float> exact = Run(n, 1, KvCacheDtype::kFp32);
  const CacheBounds& b = GetParam().peaked ? kPeakedBounds : kRandomBounds;
  for (auto [dtype, bound, mean_bound, agree_bound, name] :
       {std::tuple{KvCacheDtype::kFp16, b.fp16_max, b.fp16_max, 40, "fp16"},
        std::tuple{KvCacheDtype::kInt8, b.int8_max, b.int8_mean, b.int8_agree, "int8"},
        std::tuple{KvCacheDtype::kInt4, b.int4_max, b.int4_mean, b.int4_agree, "int4"}}) {
    const std::vector<float> got = Run(n, 1, dtype);
    double worst = 0.0, mean = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      const double e = RelativeL2(&got[t * vocab_], &exact[t * vocab_], vocab_);
      worst = std::max(worst, e);
      mean += e / n;
    }
    int agree = 0;
    for (int64_t t = 0; t < n; ++t) {
      const float* g = &got[t * vocab_];
      const float* e = &exact[t * vocab_];
      agree += std::max_element(g, g + vocab_) - g == std::max_element(e, e + vocab_) - e;
    }
    std::printf("%s latent cache vs fp32 over %lld positions: max %.2e, mean %.2e, argmax "
                "equal at %d\n", name, static_cast<long long>(n), worst, mean, agree);
    EXPECT_LE(worst, bound) << name;
    EXPECT_LE(mean, mean_bound) << name;
    EXPECT_GE(agree, agree_bound) << name;
    EXPECT_GT(worst, 0.0) << name;  // the cache really was quantized
  }
}

// The cache alone: keys (c_kv) and values (k_pe) of different widths read
// back within half a quantization step of their own scale (absmax / 127 or
// / 7, one scale per entry), in every layer and across page boundaries.
TEST(MlaLatentCacheTest, KeysAndValuesOfDifferentWidthsRoundTrip) {
  const int64_t dc = 56, r = 16, n = 40, layers = 3;
  std::vector<float> k(n * dc * layers), v(n * r * layers);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.37 * i) * (1.0 + (i % 7));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.53 * i) * (1.0 + (i % 5));
  for (auto [dtype, qmax] : {std::pair{KvCacheDtype::kInt8, 127.0}, std::pair{KvCacheDtype::kInt4, 7.0},
                             std::pair{KvCacheDtype::kFp32, 0.0}}) {
    KvCacheOptions options;
    options.dtype = dtype;
    options.num_pages = 4;
    absl::StatusOr<PagedKvCache> cache =
        PagedKvCache::Create({.num_layers = 3, .num_kv_heads = 1, .head_dim = 56, .value_dim = 16},
                             options);
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE(cache->AddSequence(0).ok());
    ASSERT_TRUE(cache->Reserve(0, n).ok());
    for (int l = 0; l < layers; ++l) cache->Write(0, l, 0, n, &k[l * n * dc], &v[l * n * r]);
    std::vector<float> k2(n * dc), v2(n * r);
    for (int l = 0; l < layers; ++l) {
      cache->Read(0, l, 0, n, k2.data(), v2.data());
      for (auto [src, got, width] : {std::tuple{&k[l * n * dc], k2.data(), dc},
                                     std::tuple{&v[l * n * r], v2.data(), r}}) {
        for (int64_t t = 0; t < n; ++t) {
          double absmax = 0.0;
          for (int64_t i = 0; i < width; ++i) absmax = std::max(absmax, std::fabs(static_cast<double>(src[t * width + i])));
          const double step = qmax > 0.0 ? absmax / qmax : 0.0;
          for (int64_t i = 0; i < width; ++i) {
            ASSERT_LE(std::fabs(got[t * width + i] - src[t * width + i]), 0.5 * step * 1.0001 + 1e-7)
                << "layer " << l << " position " << t << " dim " << i << " width " << width;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaAttentionTest,
                         ::testing::Values(Variant{true, false}, Variant{false, false},
                                           Variant{true, true}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return std::string(info.param.q_lora ? "QLoraRank72" : "PlainQProj") +
                                  (info.param.peaked ? "Peaked" : "Random");
                         });

}  // namespace
}  // namespace exl3serve::worker
