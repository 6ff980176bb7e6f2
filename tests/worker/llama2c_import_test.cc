// stories260K (a real trained llama2.c model) imported to a Hugging Face
// directory and run by worker::Transformer: its greedy continuations must
// equal those of a float64 llama2.c forward written here directly on the .bin
// weights with llama2.c's own pairwise RoPE, so the import's wq/wk row
// permutation is checked too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/shared_data.h"
#include "gtest/gtest.h"
#include "sharding/llama2c_import.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/generator.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

std::string StoriesPath() {
  return testing::SharedPath("models/stories260K/stories260K.bin");
}

// llama2.c's forward in float64, as run.c defines it.
class Llama2cReference {
 public:
  explicit Llama2cReference(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    int32_t header[7];
    in.read(reinterpret_cast<char*>(header), sizeof header);
    dim_ = header[0];
    hidden_ = header[1];
    layers_ = header[2];
    heads_ = header[3];
    kv_heads_ = header[4];
    vocab_ = std::abs(header[5]);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<float> w(bytes.size() / 4);
    std::memcpy(w.data(), bytes.data(), w.size() * 4);
    size_t at = 0;
    auto take = [&](size_t n) {
      std::vector<double> out(w.begin() + at, w.begin() + at + n);
      at += n;
      return out;
    };
    const size_t kv_dim = dim_ / heads_ * kv_heads_;
    emb_ = take(vocab_ * dim_);
    att_norm_ = take(layers_ * dim_);
    wq_ = take(layers_ * dim_ * dim_);
    wk_ = take(layers_ * kv_dim * dim_);
    wv_ = take(layers_ * kv_dim * dim_);
    wo_ = take(layers_ * dim_ * dim_);
    ffn_norm_ = take(layers_ * dim_);
    w1_ = take(layers_ * hidden_ * dim_);
    w2_ = take(layers_ * dim_ * hidden_);
    w3_ = take(layers_ * hidden_ * dim_);
    final_norm_ = take(dim_);
  }

  int vocab() const { return vocab_; }

  // Greedy continuation of `prompt` by `steps` tokens.
  std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int steps) const {
    const int hd = dim_ / heads_, kv_dim = hd * kv_heads_;
    std::vector<std::vector<double>> kcache(layers_), vcache(layers_);
    std::vector<int32_t> tokens = prompt, out;
    for (int pos = 0; pos < static_cast<int>(prompt.size()) + steps - 1; ++pos) {
      std::vector<double> x(emb_.begin() + tokens[pos] * dim_, emb_.begin() + (tokens[pos] + 1) * dim_);
      for (int l = 0; l < layers_; ++l) {
        std::vector<double> xb = RmsNorm(x, &att_norm_[l * dim_]);
        std::vector<double> q = MatVec(&wq_[size_t(l) * dim_ * dim_], xb, dim_, dim_);
        std::vector<double> k = MatVec(&wk_[size_t(l) * kv_dim * dim_], xb, kv_dim, dim_);
        std::vector<double> v = MatVec(&wv_[size_t(l) * kv_dim * dim_], xb, kv_dim, dim_);
        for (int i = 0; i < dim_; i += 2) {  // adjacent pairs, per head
          const double freq = 1.0 / std::pow(10000.0, double(i % hd) / hd);
          const double c = std::cos(pos * freq), s = std::sin(pos * freq);
          for (std::vector<double>* vec : {&q, &k}) {
            if (i >= static_cast<int>(vec->size())) continue;
            const double a = (*vec)[i], b = (*vec)[i + 1];
            (*vec)[i] = a * c - b * s;
            (*vec)[i + 1] = a * s + b * c;
          }
        }
        kcache[l].insert(kcache[l].end(), k.begin(), k.end());
        vcache[l].insert(vcache[l].end(), v.begin(), v.end());
        std::vector<double> att(dim_, 0.0);
        for (int h = 0; h < heads_; ++h) {
          const int g = h / (heads_ / kv_heads_);
          std::vector<double> score(pos + 1);
          for (int t = 0; t <= pos; ++t) {
            double sdot = 0.0;
            for (int i = 0; i < hd; ++i) sdot += q[h * hd + i] * kcache[l][t * kv_dim + g * hd + i];
            score[t] = sdot / std::sqrt(double(hd));
          }
          const double mx = *std::max_element(score.begin(), score.end());
          double sum = 0.0;
          for (double& sc : score) sum += (sc = std::exp(sc - mx));
          for (int t = 0; t <= pos; ++t) {
            for (int i = 0; i < hd; ++i) {
              att[h * hd + i] += score[t] / sum * vcache[l][t * kv_dim + g * hd + i];
            }
          }
        }
        std::vector<double> o = MatVec(&wo_[size_t(l) * dim_ * dim_], att, dim_, dim_);
        for (int i = 0; i < dim_; ++i) x[i] += o[i];
        xb = RmsNorm(x, &ffn_norm_[l * dim_]);
        std::vector<double> h1 = MatVec(&w1_[size_t(l) * hidden_ * dim_], xb, hidden_, dim_);
        std::vector<double> h3 = MatVec(&w3_[size_t(l) * hidden_ * dim_], xb, hidden_, dim_);
        for (int i = 0; i < hidden_; ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
        std::vector<double> down = MatVec(&w2_[size_t(l) * dim_ * hidden_], h1, dim_, hidden_);
        for (int i = 0; i < dim_; ++i) x[i] += down[i];
      }
      x = RmsNorm(x, final_norm_.data());
      if (pos + 1 < static_cast<int>(prompt.size())) continue;
      const std::vector<double> logits = MatVec(emb_.data(), x, vocab_, dim_);
      const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                                logits.begin());
      out.push_back(next);
      tokens.push_back(next);
    }
    return out;
  }

 private:
  std::vector<double> RmsNorm(const std::vector<double>& x, const double* w) const {
    double ss = 0.0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + 1e-5);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = w[i] * x[i] * inv;
    return out;
  }
  static std::vector<double> MatVec(const double* w, const std::vector<double>& x, int rows,
                                    int cols) {
    std::vector<double> y(rows, 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) y[r] += w[size_t(r) * cols + c] * x[c];
    }
    return y;
  }

  int dim_, hidden_, layers_, heads_, kv_heads_, vocab_;
  std::vector<double> emb_, att_norm_, wq_, wk_, wv_, wo_, ffn_norm_, w1_, w2_, w3_, final_norm_;
};

TEST(Llama2cImportTest, GreedyContinuationsMatchAFloat64Llama2cForward) {
  EXL3_REQUIRE_SHARED(stories, "models/stories260K/stories260K.bin");
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::ImportLlama2c(StoriesPath(), dir.path()).ok());
  auto model = Transformer::Load(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config().arch.hidden_size, 64);
  EXPECT_EQ((*model)->config().arch.intermediate_size, 172);
  EXPECT_EQ((*model)->vocab_size(), 512);
  Llama2cReference reference(StoriesPath());

  constexpr int kSteps = 40;
  constexpr int kStepsFp16 = 20;
  const std::vector<std::vector<int32_t>> prompts = {{1}, {1, 403, 407, 261}, {1, 65, 32, 280}};
  for (KvCacheDtype dtype : {KvCacheDtype::kFp32, KvCacheDtype::kFp16}) {
    KvCacheOptions options;
    options.dtype = dtype;
    options.num_pages = 16;
    auto cache = (*model)->CreateKvCache(options);
    ASSERT_TRUE(cache.ok());
    for (const std::vector<int32_t>& prompt : prompts) {
      GenerationOptions generation;
      generation.sampling.temperature = 0.0f;
      generation.max_new_tokens = kSteps;
      generation.prefill_chunk_tokens = 3;
      std::vector<int32_t> got;
      auto finish = Generate(**model, &*cache, 0, prompt, generation, [&](const GeneratedStep& s) {
        got.push_back(s.token.id);
        return true;
      });
      ASSERT_TRUE(finish.ok()) << finish.status();
      EXPECT_EQ(*finish, FinishReason::kLength);
      const std::vector<int32_t> want = reference.Greedy(prompt, kSteps);
      if (dtype == KvCacheDtype::kFp32) {
        EXPECT_EQ(got, want) << "prompt starting " << prompt[0] << " of " << prompt.size();
      } else {
        // Rounding K/V to fp16 may flip a later near-tie; the start must agree.
        ASSERT_EQ(got.size(), want.size());
        EXPECT_TRUE(std::equal(got.begin(), got.begin() + kStepsFp16, want.begin()))
            << "prompt starting " << prompt[0] << " of " << prompt.size() << ", fp16 cache";
      }
    }
    EXPECT_EQ(cache->free_pages(), options.num_pages);  // Generate removed its sequence
  }
}

TEST(Llama2cImportTest, RejectsATruncatedFile) {
  EXL3_REQUIRE_SHARED(stories, "models/stories260K/stories260K.bin");
  testing::ScratchDir dir;
  std::ifstream in(StoriesPath(), std::ios::binary);
  std::vector<char> head(4096);
  in.read(head.data(), head.size());
  std::ofstream(dir.File("short.bin"), std::ios::binary).write(head.data(), head.size());
  const absl::Status status = sharding::ImportLlama2c(dir.File("short.bin"), dir.File("out"));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_EQ(sharding::ImportLlama2c(dir.File("missing.bin"), dir.File("out")).code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace exl3serve::worker
