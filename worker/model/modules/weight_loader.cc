#include "worker/model/modules/weight_loader.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "sharding/exl3_model.h"

namespace exl3serve::worker {

absl::Status CheckShardRange(const sharding::IndexRange& r, int64_t limit, const char* what) {
  if (r.begin < 0 || r.begin > r.end || r.end > limit) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan: ", what, " [", r.begin, ", ",
                                                   r.end, ") outside [0, ", limit, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Linear> WeightLoader::LoadLinear(int layer, sharding::LinearRole role, int expert,
                                                sharding::IndexRange in, sharding::IndexRange out,
                                                bool bias) const {
  const sharding::LinearSpec* s = arch().Find(layer, role, expert);
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat(checkpoint_.dir(), ": ", arch().architecture,
                                            " has no ", sharding::LinearRoleName(role),
                                            " linear in layer ", layer,
                                            expert >= 0 ? absl::StrCat(" expert ", expert) : ""));
  }
  absl::StatusOr<Linear> linear =
      whole_ ? Linear::Load(checkpoint_, s->key, s->in_features, s->out_features)
             : Linear::LoadWindow(checkpoint_, s->key, s->in_features, s->out_features, in.begin,
                                  in.end, out.begin, out.end, bias);
  if (linear.ok()) linear->set_key(s->key);
  return linear;
}

absl::StatusOr<Linear> WeightLoader::LoadLinearWindow(int layer, sharding::LinearRole role,
                                                      sharding::IndexRange in,
                                                      sharding::IndexRange out) const {
  const sharding::LinearSpec* s = arch().Find(layer, role, -1);
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat(checkpoint_.dir(), ": ", arch().architecture,
                                            " has no ", sharding::LinearRoleName(role),
                                            " linear in layer ", layer));
  }
  absl::StatusOr<Linear> linear = Linear::LoadWindow(checkpoint_, s->key, s->in_features,
                                                     s->out_features, in.begin, in.end,
                                                     out.begin, out.end, /*with_bias=*/true);
  if (linear.ok()) linear->set_key(s->key);
  return linear;
}

absl::StatusOr<std::vector<float>> WeightLoader::LoadTensor(const std::string& name,
                                                            const std::vector<int64_t>& shape) const {
  const sharding::PlainTensorInfo* info = checkpoint_.FindPlain(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(checkpoint_.dir(), ": no tensor `", name, "`"));
  }
  if (info->shape != shape) {
    return absl::DataLossError(absl::StrCat(checkpoint_.dir(), ": tensor `", name,
                                            "` must have shape [", absl::StrJoin(shape, ","),
                                            "], got [", absl::StrJoin(info->shape, ","), "]"));
  }
  return checkpoint_.LoadTensorAsFloat(name);
}

absl::StatusOr<std::vector<float>> WeightLoader::LoadVector(const std::string& name,
                                                            int64_t size) const {
  const sharding::PlainTensorInfo* info = checkpoint_.FindPlain(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(checkpoint_.dir(), ": no tensor `", name, "`"));
  }
  if (info->shape.size() != 1 || info->shape[0] != size) {
    return absl::DataLossError(
        absl::StrCat(checkpoint_.dir(), ": tensor `", name, "` must have shape [", size, "]"));
  }
  return checkpoint_.LoadTensorAsFloat(name);
}

}  // namespace exl3serve::worker
