#include "coordinator/draft_length.h"

#include <algorithm>
#include <cmath>

#include "common/logging.h"

namespace exl3serve::coordinator {

AdaptiveDraftLength::AdaptiveDraftLength(int max_draft, const AdaptiveDraftLengthOptions& options)
    : max_draft_(max_draft), options_(options) {
  EXL3_CHECK(max_draft >= 0);
  EXL3_CHECK(options.probe_interval > 0);
}

int AdaptiveDraftLength::Next() {
  if (max_draft_ == 0) return 0;
  if (!ema_.has_value()) return max_draft_;
  if (*ema_ < options_.skip_below) {
    if (++rounds_since_probe_ < options_.probe_interval) return 0;
    rounds_since_probe_ = 0;
    return std::min(2, max_draft_);
  }
  rounds_since_probe_ = 0;
  const int window = static_cast<int>(std::ceil(*ema_));
  return std::clamp(window, 1, max_draft_);
}

void AdaptiveDraftLength::Observe(int window, int accepted) {
  EXL3_CHECK(accepted >= 0 && accepted <= window);
  if (window == 0) return;
  const double a = accepted + (accepted == window ? 1.0 : 0.0);
  if (!ema_.has_value()) {
    ema_ = a;
    return;
  }
  const double alpha = a > *ema_ ? options_.alpha_up : options_.alpha_down;
  ema_ = alpha * a + (1.0 - alpha) * *ema_;
}

}  // namespace exl3serve::coordinator
