// cli/capacity_flags.h — `--capacities 1,1,0.5`, shared by `generate`,
// `serve` and `worker`: the relative share of the work per rank
// (sharding::WorldSpec::Rank::capacity; a rank with less memory gets
// proportionally fewer heads, channels, experts and vocab rows).
//
//   EXL3_ASSIGN_OR_RETURN(group.capacities, ParseCapacitiesFlag(text, ranks));
//
// Thread safety: a pure function.
#ifndef EXL3SERVE_CLI_CAPACITY_FLAGS_H_
#define EXL3SERVE_CLI_CAPACITY_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::cli {

// Comma-separated numbers, one per rank. Empty text: an empty vector
// (uniform). Errors: InvalidArgument naming `--capacities` for a value that
// is not a finite number > 0 or a count other than `world_size`.
absl::StatusOr<std::vector<double>> ParseCapacitiesFlag(const std::string& text, int world_size);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_CAPACITY_FLAGS_H_
