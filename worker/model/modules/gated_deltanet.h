// worker/model/modules/gated_deltanet.h — Gated DeltaNet linear attention
// (Qwen3-Next, Qwen3.5 / 3.6 / 3.8; Hugging Face transformers' qwen3_next modeling):
// a token mixer whose per-sequence state is a fixed-size recurrent state
// instead of a growing KV cache.
//
// Per token t, on the layer's normed input x (Hk key heads of dk, Hv = G·Hk
// value heads of dv; value head h reads key head ⌊h/G⌋):
//   [q | k | v], z, b, a  = projections of x (Qwen3-Next: fused in_proj_qkvz /
//                           in_proj_ba grouped per key head; Qwen3.5: split
//                           in_proj_qkv [Q | K | V], in_proj_z, in_proj_b, in_proj_a)
//   [q | k | v] = SiLU(causal depthwise conv over the last K inputs, per channel)
//   q̂ = l2norm(q)·dk^-1/2, k̂ = l2norm(k)   (x / sqrt(Σx² + 1e-6))
//   β = σ(b), g = −exp(A_log)·softplus(a + dt_bias)   (the log of the decay)
//   S ← exp(g)·S;  u = β(v − Sᵀk̂);  S ← S + k̂ uᵀ;  o = Sᵀq̂       (S: [dk][dv] fp32)
//   y = w ⊙ o / sqrt(mean(o²) + eps) ⊙ silu(z)  per value head (plain w)
//   out = y·W_outᵀ (this rank's heads: a partial sum over the ranks)
//
// The recurrence runs in its chunked form (kernels::GatedDeltaChunked:
// chunks of 16 at multiples of 16 from position 0, each chunk's S₀ᵀk̂ / S₀ᵀq̂
// one pass over the state, the state written once per chunk) for prefill,
// decode and verification alike; its arithmetic per token depends only on the
// position, so chunked prefill, prefill at once, decoding and a resume from a
// snapshot give the same state and outputs bit for bit.
//
// Per-sequence state (the cache's state slot of this layer, kv_cache.h): the
// last K−1 conv inputs [K−1][conv channels] then each value head's
// kernels::GatedDeltaHeadStateFloats (S₀ and the open chunk's rows), all
// fp32, zero at sequence start. The state advances in place: a Forward that
// fails leaves it advanced (the caller's sequence must be dropped and
// re-prefilled). When the cache keeps a state history for the sequence
// (PagedKvCache::KeepStateHistory: speculative verification), the state after
// each token is kept too, so rejected drafts roll back by a copy.
//
// Tensor parallelism by key heads (shard_plan.h LayerShard::linear_key_heads):
// a rank holds its key heads, their value heads, the matching Q, K and V conv
// channels, β / decay rows, out_proj input columns and only its heads' state.
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_GATED_DELTANET_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_GATED_DELTANET_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/gated_delta_chunk.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

class GatedDeltaNet final : public TokenMixer {
 public:
  // Layer `layer`, this rank's key heads part.linear_key_heads. Errors:
  // InvalidArgument for a key-head range outside the model; NotFound naming
  // a missing tensor (e.g. `linear_attn.A_log`); DataLoss naming a tensor
  // of the wrong shape; those of WeightLoader.
  static absl::StatusOr<std::unique_ptr<GatedDeltaNet>> Load(const WeightLoader& weights,
                                                             const ModelContext& context,
                                                             int layer,
                                                             const sharding::LayerShard& part);

  absl::Status Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                       float* out) const override;
  KvLayout kv_layout() const override { return {}; }
  int64_t state_floats() const override { return conv_floats() + state_matrix_floats(); }
  void ForEachLinear(const std::function<void(Linear&)>& fn) override;

 private:
  GatedDeltaNet() = default;
  int64_t conv_channels() const { return 2 * nk_ * dk_ + nv_ * dv_; }
  int64_t conv_floats() const { return (kernel_ - 1) * conv_channels(); }
  int64_t state_matrix_floats() const { return nv_ * kernels::GatedDeltaHeadStateFloats(dk_, dv_); }
  // Projections of rows [total] into mixed [total][conv channels] ([Q | K |
  // V] of this rank's heads), z [total][nv·dv], b and a [total][nv].
  absl::Status Project(const StepBatch& step, const float* x, float* mixed, float* z, float* b,
                       float* a) const;

  ModelContext context_;
  int64_t nk_ = 0, nv_ = 0, g_ = 0;  // this rank's key and value heads; value heads per key head
  int64_t dk_ = 0, dv_ = 0, kernel_ = 0;
  bool fused_ = false;
  // Fused (Qwen3-Next): this rank's rows of in_proj_qkvz and in_proj_ba;
  // split (Qwen3.5): its Q, K and V rows of in_proj_qkv, and of z, b, a.
  Linear qkvz_, ba_, q_, k_, v_, z_, b_, a_, out_;
  std::vector<float> conv_;          // [conv channels][K], this rank's channels in [Q | K | V] order
  std::vector<float> neg_a_;         // −exp(A_log) per local value head
  std::vector<float> dt_bias_;       // per local value head
  std::vector<float> norm_;          // [dv], plain weight
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_GATED_DELTANET_H_
