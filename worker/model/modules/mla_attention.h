// worker/model/modules/mla_attention.h — multi-head latent attention
// (DeepseekV3ForCausalLM, Kimi K2; architectures.md §2) over a paged latent
// cache.
//
//   c_kv = RMSNorm(t[0:dc]), k_pe = RoPE(t[dc:dc+r]), t = a·W_kvaᵀ   (cached per position)
//   q = (RMSNorm(a·W_qaᵀ))·W_qbᵀ   or a·W_qᵀ (q_lora_rank 0), [nope | rope] per head
//   prefill-kind rows (linear.h PrefillRowsOfEntry): keys [c_kv·W_UKᵀ | k_pe], values c_kv·W_UVᵀ
//   decode: absorbed — q_lat = W_UKᵀ q_nope attends over [c_kv | k_pe], W_UV after
//   out = o·Woᵀ (this rank's heads: a partial sum over the ranks)
//
// RoPE is GPT-J style (interleaved pairs) with cos/sin scaled by YaRN's
// attention factor (model_config.h). Both paths read the same cached latent.
//
// Tensor parallelism: q_a (+ norm), kv_a and its norm on every rank (each
// rank writes its own copy of the latent cache); q_b (or q), kv_b and o by
// this rank's query heads.
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_MLA_ATTENTION_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_MLA_ATTENTION_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

class MlaAttention final : public TokenMixer {
 public:
  // Errors: InvalidArgument for query heads out of range; those of WeightLoader.
  static absl::StatusOr<std::unique_ptr<MlaAttention>> Load(const WeightLoader& weights,
                                                            const ModelContext& context, int layer,
                                                            const sharding::LayerShard& part);

  absl::Status Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                       float* out) const override;
  // One latent "head" per position on every rank: c_kv as the key, k_pe as
  // the value (kv_cache.h KvCacheShape::value_dim).
  KvLayout kv_layout() const override;
  void ForEachLinear(const std::function<void(Linear&)>& fn) override;

 private:
  MlaAttention() = default;
  // This rank's heads' outputs [total][num_q_heads * v_head_dim].
  absl::Status Attend(const StepBatch& step, const float* a, PagedKvCache* cache,
                      float* out) const;

  ModelContext context_;
  int layer_ = 0;
  int64_t num_q_heads_ = 0;
  // q_a (+ q_a_norm) then q_b, or the plain q; kv_a and its norm on every
  // rank; q_b, kv_b and o hold this rank's query heads. kv_b (this rank's
  // heads) is held as fp32 [head][nope + v][kv_lora]: W_UK_h (nope rows)
  // then W_UV_h (v rows), read by the absorbed decode through
  // dense_weight() and run as a linear by the prefill path.
  Linear q_, q_a_, q_b_, kv_a_, kv_b_, o_;
  std::vector<float> q_a_norm_, kv_a_norm_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_MLA_ATTENTION_H_
