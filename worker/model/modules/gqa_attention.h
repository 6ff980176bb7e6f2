// worker/model/modules/gqa_attention.h — grouped-query attention over the
// paged KV cache: Llama, Mistral (sliding window), Qwen2 (q/k/v bias),
// Qwen3 / GLM-4 (per-head q/k RMSNorm), partial RoPE (GLM-4, Qwen3-Next),
// the sigmoid output gate of Qwen3-Next / Qwen3.5 (q_proj rows [q_h | gate_h]
// per head; out = (o ⊙ σ(gate))·Woᵀ).
//
//   q, k, v = a·Wqᵀ(+b), a·Wkᵀ(+b), a·Wvᵀ(+b)
//   [qk_norm: q, k = RMSNorm per head]
//   q, k = RoPE(q, k) (rotate-half pairs i, i + r/2 of the first r = rotary_dim dims)
//   k, v -> cache ; o = softmax(q·kᵀ/√d + causal/window mask)·v over the cached positions
//   out = o·Woᵀ (this rank's heads: a partial sum over the ranks)
//
// Attention always reads keys and values back from the cache (also those
// of the chunk being processed), so prefill in chunks, prefill at once and
// token-by-token decoding see the same stored values.
//
// Tensor parallelism: a rank holds a range of query heads and the KV heads
// they read (q/k/v column-parallel, o row-parallel); its cache layer holds
// only those KV heads.
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_GQA_ATTENTION_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_GQA_ATTENTION_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

class GqaAttention final : public TokenMixer {
 public:
  // Layer `layer`'s attention, this rank's heads of `part`. Errors:
  // InvalidArgument when the shard's heads are out of range or its KV heads
  // do not cover its query heads; those of WeightLoader.
  static absl::StatusOr<std::unique_ptr<GqaAttention>> Load(const WeightLoader& weights,
                                                            const ModelContext& context, int layer,
                                                            const sharding::LayerShard& part);

  absl::Status Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                       float* out) const override;
  KvLayout kv_layout() const override;
  void ForEachLinear(const std::function<void(Linear&)>& fn) override;

 private:
  GqaAttention() = default;
  // Attention of the roped q [total][nh][hd] over the cache after appending
  // k, v; writes [total][nh][hd].
  absl::Status Attend(const StepBatch& step, PagedKvCache* cache, float* q, float* k,
                      const float* v, float* out) const;

  ModelContext context_;
  int layer_ = 0;
  int64_t q_head_begin_ = 0, num_q_heads_ = 0;
  int64_t kv_head_begin_ = 0, num_kv_heads_ = 0;
  std::vector<float> q_norm_, k_norm_;  // qk_norm only ((1 + w) when zero-centred)
  bool output_gate_ = false;  // q_proj yields [q_h | gate_h]; o ⊙ sigmoid(gate) before o_proj
  Linear q_, k_, v_, o_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_GQA_ATTENTION_H_
