// worker/model/transformer.h — a config-driven decoder-only transformer on
// one rank: Llama (incl. llama3 RoPE scaling), Mistral (sliding window),
// Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Mixtral and Qwen3-MoE,
// each linear EXL3-quantized or plain (bf16/fp16/fp32 checkpoints).
//
//   EXL3_ASSIGN_OR_RETURN(auto model, Transformer::Load(dir));
//   EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, model->CreateKvCache(KvCacheOptions{}));
//   EXL3_RETURN_IF_ERROR(cache.AddSequence(0));
//   std::vector<float> logits;
//   EXL3_RETURN_IF_ERROR(model->Forward({{0, prompt}}, LogitsRows::kLastToken, &cache, &logits));
//
// The forward (fp32 activations throughout), per layer:
//   a = RMSNorm(h) ; q, k, v = a·Wqᵀ(+b), a·Wkᵀ(+b), a·Wvᵀ(+b)
//   [Qwen3: q, k = RMSNorm per head] ; q, k = RoPE(q, k) (rotate-half pairs i, i + d/2)
//   k, v -> cache ; o = softmax(q·kᵀ/√d + causal/window mask)·v over the cached positions
//   h += o·Woᵀ ; a = RMSNorm(h)
//   dense: h += (silu(a·Wgᵀ) ⊙ a·Wuᵀ)·Wdᵀ
//   MoE:   p = softmax(a·Wrᵀ), top-k experts, weights renormalised (Mixtral, Qwen3-MoE
//          with norm_topk_prob) or not; h += Σ w_e · expert_e(a)
// then logits = RMSNorm(h)·W_headᵀ (W_head = lm_head, or the token embedding when
// tied and lm_head is absent). Attention always reads keys and values back from
// the cache (also those of the chunk being processed), so prefill in chunks,
// prefill at once and token-by-token decoding see the same stored values.
#ifndef EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_
#define EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/kv_cache.h"
#include "worker/model/linear.h"
#include "worker/model/model_config.h"

namespace exl3serve::sharding {
class Exl3Model;
}

namespace exl3serve::worker {

// New tokens of one sequence in a forward: they take positions
// cache.Length(seq_id) .. + tokens.size() - 1.
struct SequenceTokens {
  int64_t seq_id = 0;
  std::span<const int32_t> tokens;
};

enum class LogitsRows {
  kLastToken,  // one row per sequence: its last new token
  kAllTokens,  // one row per new token, sequences in batch order
};

// Thread safety: immutable after Load; Forward is const and may run
// concurrently on different caches (the kernels share one thread pool, so
// concurrent calls serialise there).
// Ownership: owns all weights (copied out of the checkpoint at Load).
class Transformer {
 public:
  // Loads config.json (+ generation_config.json) and every weight of `dir`,
  // an EXL3 directory or a plain Hugging Face one.
  // Errors: NotFound for a missing directory, config.json or tensor (named);
  // DataLoss for malformed JSON or a tensor of the wrong shape;
  // Unimplemented for an unsupported architecture or feature (see
  // ModelConfigFromJson). Cost: reads all weights into memory.
  static absl::StatusOr<std::unique_ptr<Transformer>> Load(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  int64_t vocab_size() const { return config_.arch.vocab_size; }

  // A cache shaped for this model. Errors: those of PagedKvCache::Create.
  absl::StatusOr<PagedKvCache> CreateKvCache(const KvCacheOptions& options) const;

  // Runs the new tokens of every entry of `batch` (each sequence at most
  // once, at least one token each), appends their keys and values to `cache`
  // and writes the logits rows chosen by `rows` into *logits (resized to
  // rows x vocab_size).
  // Errors: InvalidArgument for an empty batch or entry, a repeated sequence
  // or a token id outside [0, vocab_size) (named); NotFound for a sequence
  // the cache lacks; ResourceExhausted when the cache has no room (pages
  // reserved for earlier entries stay reserved); errors of the kernels.
  // On error no sequence's committed length changes.
  absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                       PagedKvCache* cache, std::vector<float>* logits) const;

  // Attaches `observer` (borrowed; nullptr detaches) to every linear, so it
  // sees each linear's input during Forward (calibration).
  void SetInputObserver(InputObserver* observer);

 private:
  struct Expert {
    Linear gate, up, down;
  };
  struct Layer {
    std::vector<float> input_norm, post_attention_norm;
    std::vector<float> q_norm, k_norm;  // qk_norm only
    Linear q, k, v, o;
    bool moe = false;
    Linear gate, up, down;  // dense MLP
    Linear router;          // MoE
    std::vector<Expert> experts;
  };

  Transformer() = default;
  absl::Status LoadWeights(const sharding::Exl3Model& model);
  absl::Status Attention(std::span<const SequenceTokens> batch, int layer, PagedKvCache* cache,
                         const std::vector<int64_t>& starts, std::vector<float>& q,
                         std::vector<float>& k, const std::vector<float>& v,
                         std::vector<float>* out) const;
  absl::Status Mlp(const Layer& layer, const std::vector<float>& a, int64_t m,
                   std::vector<float>* out) const;

  ModelConfig config_;
  std::vector<double> rope_inv_freq_;
  std::vector<float> embed_;  // [vocab][hidden]; empty when shared with a tied head
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;
  Linear head_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_
