#include "sharding/llama2c_import.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

// llama2.c's fixed hyper-parameters (run.c).
constexpr double kRmsNormEps = 1e-5;
constexpr double kRopeTheta = 10000.0;

struct Header {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

// Reads consecutive float arrays out of the weight block.
class FloatReader {
 public:
  FloatReader(const std::vector<float>& data) : data_(data) {}
  absl::StatusOr<std::vector<float>> Take(int64_t count, const char* what) {
    if (offset_ + count > static_cast<int64_t>(data_.size())) {
      return absl::DataLossError(absl::StrCat("llama2.c checkpoint: file ends inside `", what,
                                              "` (needs ", offset_ + count, " floats, has ",
                                              data_.size(), ")"));
    }
    std::vector<float> out(data_.begin() + offset_, data_.begin() + offset_ + count);
    offset_ += count;
    return out;
  }
  void Skip(int64_t count) { offset_ += count; }
  int64_t remaining() const { return static_cast<int64_t>(data_.size()) - offset_; }

 private:
  const std::vector<float>& data_;
  int64_t offset_ = 0;
};

// Rows of each head_dim-row block reordered: even rows first, then odd.
std::vector<float> PermuteForRotateHalf(const std::vector<float>& w, int64_t heads,
                                        int64_t head_dim, int64_t in) {
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < head_dim; ++r) {
      const int64_t src = r < head_dim / 2 ? 2 * r : 2 * (r - head_dim / 2) + 1;
      std::memcpy(&out[(h * head_dim + r) * in], &w[(h * head_dim + src) * in],
                  sizeof(float) * in);
    }
  }
  return out;
}

}  // namespace

absl::Status ImportLlama2c(const std::string& bin_path, const std::string& out_dir) {
  std::ifstream in(bin_path, std::ios::binary);
  if (!in) {
    return errno == EACCES
               ? absl::PermissionDeniedError(absl::StrCat("cannot read ", bin_path))
               : absl::NotFoundError(absl::StrCat("cannot open ", bin_path));
  }
  Header h;
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  if (!in) return absl::DataLossError(absl::StrCat(bin_path, ": shorter than the 28-byte header"));
  const bool shared_classifier = h.vocab_size > 0;
  const int64_t vocab = shared_classifier ? h.vocab_size : -int64_t{h.vocab_size};
  if (h.dim <= 0 || h.hidden_dim <= 0 || h.n_layers <= 0 || h.n_heads <= 0 ||
      h.n_kv_heads <= 0 || vocab <= 0 || h.seq_len <= 0 || h.dim % h.n_heads != 0 ||
      h.n_heads % h.n_kv_heads != 0 || (h.dim / h.n_heads) % 2 != 0) {
    return absl::DataLossError(absl::StrCat(
        bin_path, ": implausible llama2.c header dim=", h.dim, " hidden_dim=", h.hidden_dim,
        " n_layers=", h.n_layers, " n_heads=", h.n_heads, " n_kv_heads=", h.n_kv_heads,
        " vocab_size=", h.vocab_size, " seq_len=", h.seq_len));
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> data(bytes.size() / sizeof(float));
  std::memcpy(data.data(), bytes.data(), data.size() * sizeof(float));

  const int64_t dim = h.dim, hidden = h.hidden_dim, layers = h.n_layers;
  const int64_t head_dim = dim / h.n_heads, kv_dim = head_dim * h.n_kv_heads;
  FloatReader r(data);
  EXL3_ASSIGN_OR_RETURN(std::vector<float> embed, r.Take(vocab * dim, "token_embedding"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> att_norm, r.Take(layers * dim, "rms_att_weight"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> wq, r.Take(layers * dim * dim, "wq"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> wk, r.Take(layers * kv_dim * dim, "wk"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> wv, r.Take(layers * kv_dim * dim, "wv"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> wo, r.Take(layers * dim * dim, "wo"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> ffn_norm, r.Take(layers * dim, "rms_ffn_weight"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> w1, r.Take(layers * hidden * dim, "w1"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> w2, r.Take(layers * dim * hidden, "w2"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> w3, r.Take(layers * hidden * dim, "w3"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> final_norm, r.Take(dim, "rms_final_weight"));
  std::vector<float> classifier;
  if (!shared_classifier) {
    EXL3_RETURN_IF_ERROR(r.Take(int64_t{h.seq_len} * head_dim, "freq_cis").status());
    EXL3_ASSIGN_OR_RETURN(classifier, r.Take(vocab * dim, "wcls"));
  }

  auto slice = [](const std::vector<float>& all, int64_t layer, int64_t size) {
    return std::vector<float>(all.begin() + layer * size, all.begin() + (layer + 1) * size);
  };
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromFloats("model.embed_tokens.weight", {vocab, dim}, embed));
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l);
    tensors.push_back(TensorFromFloats(p + ".input_layernorm.weight", {dim}, slice(att_norm, l, dim)));
    tensors.push_back(TensorFromFloats(
        p + ".self_attn.q_proj.weight", {dim, dim},
        PermuteForRotateHalf(slice(wq, l, dim * dim), h.n_heads, head_dim, dim)));
    tensors.push_back(TensorFromFloats(
        p + ".self_attn.k_proj.weight", {kv_dim, dim},
        PermuteForRotateHalf(slice(wk, l, kv_dim * dim), h.n_kv_heads, head_dim, dim)));
    tensors.push_back(TensorFromFloats(p + ".self_attn.v_proj.weight", {kv_dim, dim},
                                       slice(wv, l, kv_dim * dim)));
    tensors.push_back(TensorFromFloats(p + ".self_attn.o_proj.weight", {dim, dim},
                                       slice(wo, l, dim * dim)));
    tensors.push_back(TensorFromFloats(p + ".post_attention_layernorm.weight", {dim},
                                       slice(ffn_norm, l, dim)));
    tensors.push_back(TensorFromFloats(p + ".mlp.gate_proj.weight", {hidden, dim},
                                       slice(w1, l, hidden * dim)));
    tensors.push_back(TensorFromFloats(p + ".mlp.down_proj.weight", {dim, hidden},
                                       slice(w2, l, dim * hidden)));
    tensors.push_back(TensorFromFloats(p + ".mlp.up_proj.weight", {hidden, dim},
                                       slice(w3, l, hidden * dim)));
  }
  tensors.push_back(TensorFromFloats("model.norm.weight", {dim}, final_norm));
  if (!shared_classifier) {
    tensors.push_back(TensorFromFloats("lm_head.weight", {vocab, dim}, std::move(classifier)));
  }

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  }
  EXL3_RETURN_IF_ERROR(WriteSafetensorsFile(absl::StrCat(out_dir, "/", std::string(kSingleFileName)),
                                            std::move(tensors), {{"format", "pt"}}));
  const nlohmann::json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", dim},
      {"intermediate_size", hidden},
      {"num_hidden_layers", layers},
      {"num_attention_heads", h.n_heads},
      {"num_key_value_heads", h.n_kv_heads},
      {"head_dim", head_dim},
      {"vocab_size", vocab},
      {"max_position_embeddings", h.seq_len},
      {"rms_norm_eps", kRmsNormEps},
      {"rope_theta", kRopeTheta},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", shared_classifier},
      {"torch_dtype", "float32"},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
  };
  EXL3_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/config.json", config.dump(2)));
  const nlohmann::json generation = {{"bos_token_id", 1}, {"eos_token_id", 2}};
  return WriteFileAtomically(out_dir + "/generation_config.json", generation.dump(2));
}

}  // namespace exl3serve::sharding
