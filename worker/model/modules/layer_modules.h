// worker/model/modules/layer_modules.h — the modules of one decoder layer
// from the architecture's recipe (sharding::LayerRecipe): the one place that
// maps a module kind to its class.
//
//   EXL3_ASSIGN_OR_RETURN(auto mixer, LoadTokenMixer(arch.layers[l].mixer, weights, context, l, part));
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_LAYER_MODULES_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_LAYER_MODULES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "sharding/model_arch.h"
#include "sharding/shard_plan.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

// Errors: those of the module's Load.
absl::StatusOr<std::unique_ptr<TokenMixer>> LoadTokenMixer(sharding::TokenMixerKind kind,
                                                           const WeightLoader& weights,
                                                           const ModelContext& context, int layer,
                                                           const sharding::LayerShard& part);
absl::StatusOr<std::unique_ptr<FeedForward>> LoadFeedForward(sharding::FeedForwardKind kind,
                                                             const WeightLoader& weights,
                                                             const ModelContext& context,
                                                             int layer,
                                                             const sharding::LayerShard& part);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_LAYER_MODULES_H_
