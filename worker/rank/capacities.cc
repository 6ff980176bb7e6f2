#include "worker/rank/capacities.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace exl3serve::worker::rank {

absl::Status CheckCapacities(const std::vector<double>& capacities, int world_size) {
  if (capacities.empty()) return absl::OkStatus();
  if (static_cast<int>(capacities.size()) != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("capacities: ", capacities.size(),
                                                   " values for ", world_size,
                                                   " ranks (give one per rank)"));
  }
  for (size_t r = 0; r < capacities.size(); ++r) {
    if (!(capacities[r] > 0.0) || !std::isfinite(capacities[r])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "capacities: rank ", r, "'s value ", capacities[r], " is not a finite number > 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker::rank
