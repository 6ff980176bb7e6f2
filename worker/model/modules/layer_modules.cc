#include "worker/model/modules/layer_modules.h"

#include "absl/strings/str_cat.h"
#include "worker/model/modules/gated_deltanet.h"
#include "worker/model/modules/gqa_attention.h"
#include "worker/model/modules/mla_attention.h"
#include "worker/model/modules/moe.h"
#include "worker/model/modules/swiglu_mlp.h"

namespace exl3serve::worker {

absl::StatusOr<std::unique_ptr<TokenMixer>> LoadTokenMixer(sharding::TokenMixerKind kind,
                                                           const WeightLoader& weights,
                                                           const ModelContext& context, int layer,
                                                           const sharding::LayerShard& part) {
  switch (kind) {
    case sharding::TokenMixerKind::kAttention: {
      absl::StatusOr<std::unique_ptr<GqaAttention>> m =
          GqaAttention::Load(weights, context, layer, part);
      if (!m.ok()) return m.status();
      return std::unique_ptr<TokenMixer>(std::move(*m));
    }
    case sharding::TokenMixerKind::kLatentAttention: {
      absl::StatusOr<std::unique_ptr<MlaAttention>> m =
          MlaAttention::Load(weights, context, layer, part);
      if (!m.ok()) return m.status();
      return std::unique_ptr<TokenMixer>(std::move(*m));
    }
    case sharding::TokenMixerKind::kGatedDeltaNet: {
      absl::StatusOr<std::unique_ptr<GatedDeltaNet>> m =
          GatedDeltaNet::Load(weights, context, layer, part);
      if (!m.ok()) return m.status();
      return std::unique_ptr<TokenMixer>(std::move(*m));
    }
  }
  return absl::InternalError(absl::StrCat("layer ", layer, ": unknown token mixer kind"));
}

absl::StatusOr<std::unique_ptr<FeedForward>> LoadFeedForward(sharding::FeedForwardKind kind,
                                                             const WeightLoader& weights,
                                                             const ModelContext& context,
                                                             int layer,
                                                             const sharding::LayerShard& part) {
  switch (kind) {
    case sharding::FeedForwardKind::kDenseMlp: {
      absl::StatusOr<std::unique_ptr<SwiGluMlp>> m = SwiGluMlp::Load(weights, layer, part);
      if (!m.ok()) return m.status();
      return std::unique_ptr<FeedForward>(std::move(*m));
    }
    case sharding::FeedForwardKind::kMixtureOfExperts: {
      absl::StatusOr<std::unique_ptr<MixtureOfExperts>> m =
          MixtureOfExperts::Load(weights, context, layer, part);
      if (!m.ok()) return m.status();
      return std::unique_ptr<FeedForward>(std::move(*m));
    }
  }
  return absl::InternalError(absl::StrCat("layer ", layer, ": unknown feed-forward kind"));
}

}  // namespace exl3serve::worker
