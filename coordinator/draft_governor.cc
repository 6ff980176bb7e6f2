#include "coordinator/draft_governor.h"

#include <algorithm>

#include "common/logging.h"

namespace exl3serve::coordinator {

DraftGovernor::DraftGovernor(const DraftGovernorOptions& options) : options_(options) {
  EXL3_CHECK(options_.probe >= 1 && options_.period > options_.probe);
  EXL3_CHECK(options_.probe_drafting >= 1 && options_.period > options_.probe_drafting);
  EXL3_CHECK(options_.alpha > 0 && options_.alpha <= 1);
  EXL3_CHECK(options_.min_samples >= 1);
  EXL3_CHECK(options_.max_probe_backoff >= 1);
  EXL3_CHECK(options_.clear_loss > 1);
}

int DraftGovernor::ProbeSteps() const {
  if (choice_) return options_.probe;
  const bool clear_loss = on_ && off_ && *on_ > options_.clear_loss * *off_;
  return clear_loss ? options_.probe : options_.probe_drafting;
}

bool DraftGovernor::AllowDrafts() const {
  const bool probing = probe_period_ && step_in_period_ < ProbeSteps();
  return probing ? !choice_ : choice_;
}

void DraftGovernor::Observe(const DraftStepCost& step) {
  if (!step.decode_only || step.tokens <= 0 || step.seconds < 0) return;
  const int mode = step.drafts_allowed ? 1 : 0;
  period_seconds_[mode] += step.seconds;
  period_tokens_[mode] += step.tokens;
  ++(step.drafts_allowed ? on_samples_ : off_samples_);
  if (++step_in_period_ < options_.period) return;
  step_in_period_ = 0;
  for (int m = 0; m < 2; ++m) {
    if (period_tokens_[m] > 0) {
      const double per_token = period_seconds_[m] / static_cast<double>(period_tokens_[m]);
      std::optional<double>& mean = m == 1 ? on_ : off_;
      mean = mean ? options_.alpha * per_token + (1 - options_.alpha) * *mean : per_token;
    }
    period_seconds_[m] = 0;
    period_tokens_[m] = 0;
  }
  bool switched = false;
  if (on_samples_ >= options_.min_samples && off_samples_ >= options_.min_samples) {
    const bool pays = *on_ < options_.margin * *off_;
    if (pays != choice_) {
      choice_ = pays;
      switched = true;
      ++switches_;
      EXL3_LOG(kInfo) << "speculative decoding " << (pays ? "on" : "off") << ": "
                      << *on_ * 1e3 << " ms per token with drafts, " << *off_ * 1e3
                      << " ms without";
    }
  }
  // The next period's probe (see the header: backoff while off).
  if (choice_ || switched) {
    backoff_ = 1;
    skip_ = 0;
  } else if (probe_period_) {
    backoff_ = std::min(2 * backoff_, options_.max_probe_backoff);
    skip_ = backoff_ - 1;
  } else {
    --skip_;
  }
  probe_period_ = skip_ == 0;
}

}  // namespace exl3serve::coordinator
