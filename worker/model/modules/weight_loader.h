// worker/model/modules/weight_loader.h — how a module reads its weights: the
// whole tensor on a single rank, this rank's window of it in a group
// (sharding/shard_plan.h), and what every module of a model shares (config,
// RoPE table).
//
//   WeightLoader weights(checkpoint, config, /*whole=*/true);
//   EXL3_ASSIGN_OR_RETURN(Linear q, weights.Linear(layer, LinearRole::kQ, -1, in, out, true));
//   EXL3_ASSIGN_OR_RETURN(std::vector<float> norm, weights.Vector(name, hidden));
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_WEIGHT_LOADER_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_WEIGHT_LOADER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "sharding/model_arch.h"
#include "sharding/shard_plan.h"
#include "worker/model/linear.h"
#include "worker/model/model_config.h"

namespace exl3serve::sharding {
class Exl3Model;
}

namespace exl3serve::worker {

// What the modules of one model share; owned by the Transformer, outlives
// its modules.
struct ModelContext {
  const ModelConfig* config = nullptr;
  const std::vector<double>* rope_inv_freq = nullptr;  // RopeInverseFrequencies(*config)
};

// InvalidArgument naming `what` when r is not a range inside [0, limit).
absl::Status CheckShardRange(const sharding::IndexRange& r, int64_t limit, const char* what);

// Thread safety: use from one thread (loading). Borrows the checkpoint.
class WeightLoader {
 public:
  // whole: a single rank (every linear whole); else windows.
  WeightLoader(const sharding::Exl3Model& checkpoint, const ModelConfig& config, bool whole)
      : checkpoint_(checkpoint), config_(config), whole_(whole) {}

  // The linear (layer, role, expert) of the architecture's list
  // (sharding::ModelArch::Find): whole, or the window of input columns `in`
  // and output rows `out` (bias: whether this rank adds the bias, for a
  // row-parallel linear only one rank does). Errors: NotFound for a linear
  // the architecture lacks or the checkpoint misses; those of Linear::Load*.
  absl::StatusOr<Linear> LoadLinear(int layer, sharding::LinearRole role, int expert,
                                    sharding::IndexRange in, sharding::IndexRange out,
                                    bool bias) const;
  // The window (in, out) of the linear also on a single rank (a module that
  // reads several row ranges of one tensor, e.g. [Q | K | V] slices).
  absl::StatusOr<Linear> LoadLinearWindow(int layer, sharding::LinearRole role,
                                          sharding::IndexRange in, sharding::IndexRange out) const;
  // A plain tensor of exactly `shape` as floats (any rank). NotFound (named)
  // when absent; DataLoss naming the expected shape otherwise.
  absl::StatusOr<std::vector<float>> LoadTensor(const std::string& name,
                                                const std::vector<int64_t>& shape) const;
  // A 1-D plain tensor of `size` values as floats. NotFound (named) when
  // absent; DataLoss for another shape.
  absl::StatusOr<std::vector<float>> LoadVector(const std::string& name, int64_t size) const;

  const sharding::Exl3Model& checkpoint() const { return checkpoint_; }
  const ModelConfig& config() const { return config_; }
  const sharding::ModelArch& arch() const { return config_.arch; }
  bool whole() const { return whole_; }

 private:
  const sharding::Exl3Model& checkpoint_;
  const ModelConfig& config_;
  bool whole_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_WEIGHT_LOADER_H_
