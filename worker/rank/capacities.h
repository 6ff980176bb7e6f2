// worker/rank/capacities.h — the check of the per-rank capacity list
// (RankSetup::capacities, the cluster YAML's `capacities`, --capacities), on
// its own so that config readers need nothing else of the rank code.
#ifndef EXL3SERVE_WORKER_RANK_CAPACITIES_H_
#define EXL3SERVE_WORKER_RANK_CAPACITIES_H_

#include <vector>

#include "absl/status/status.h"

namespace exl3serve::worker::rank {

// OK when `capacities` is empty or holds world_size finite values > 0;
// otherwise InvalidArgument saying which value or how many were given.
absl::Status CheckCapacities(const std::vector<double>& capacities, int world_size);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_CAPACITIES_H_
