#include "cli/capacity_flags.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace exl3serve::cli {

absl::StatusOr<std::vector<double>> ParseCapacitiesFlag(const std::string& text, int world_size) {
  std::vector<double> values;
  if (text.empty()) return values;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    double value = 0.0;
    if (!absl::SimpleAtod(part, &value) || !(value > 0.0) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat("--capacities: `", std::string(part),
                                                     "` is not a finite number > 0 "
                                                     "(e.g. --capacities 1,1,0.5)"));
    }
    values.push_back(value);
  }
  if (static_cast<int>(values.size()) != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--capacities: ", values.size(),
                                                   " values for ", world_size,
                                                   " ranks (give one per rank)"));
  }
  return values;
}

}  // namespace exl3serve::cli
