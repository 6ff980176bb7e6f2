#include "coordinator/draft_governor.h"

#include <algorithm>

#include "common/logging.h"

namespace exl3serve::coordinator {

DraftGovernor::DraftGovernor(const DraftGovernorOptions& options) : options_(options) {
  EXL3_CHECK(options_.probe >= 1 && options_.probe_drafting >= 1);
  EXL3_CHECK(options_.period >= 2 * std::max(options_.probe + 1, options_.probe_drafting));
  EXL3_CHECK(options_.alpha > 0 && options_.alpha <= 1);
  EXL3_CHECK(options_.min_samples >= 1);
  EXL3_CHECK(options_.max_probe_backoff >= 1);
  EXL3_CHECK(options_.clear_loss > 1);
  EXL3_CHECK(options_.probe_budget > 0 && options_.probe_budget < 1);
  StartPeriod();
}

int DraftGovernor::ProbeSteps() const {
  if (choice_) return options_.probe;
  // A clear loss: `probe` sampled steps after the unsampled catch-up step.
  return ratio_ && *ratio_ > options_.clear_loss ? options_.probe + 1 : options_.probe_drafting;
}

void DraftGovernor::ResetSamples() {
  for (int k = 0; k < 2; ++k) {
    seconds_[k] = 0;
    tokens_[k] = 0;
    samples_[k] = 0;
  }
}

void DraftGovernor::StartPeriod() {
  step_in_period_ = 0;
  window_confirms_off_ = false;
  switched_ = false;
  window_ = probe_period_ ? 2 * ProbeSteps() : 0;
  if (window_ > 0) skip_first_drafted_ = !choice_;
}

bool DraftGovernor::AllowDrafts() const {
  // In the window, even steps run the mode that is not the choice.
  const bool probing = step_in_period_ < window_ && step_in_period_ % 2 == 0;
  return probing ? !choice_ : choice_;
}

bool DraftGovernor::Decide() {
  if (samples_[0] < options_.min_samples || samples_[1] < options_.min_samples) return false;
  const double plain = seconds_[0] / static_cast<double>(tokens_[0]);
  const double drafted = seconds_[1] / static_cast<double>(tokens_[1]);
  const double ratio = plain > 0 ? drafted / plain : 1.0;
  last_ratio_ = ratio;
  // What probing drafting cost beyond plain decoding of the same tokens.
  budget_ -= std::max(0.0, probe_seconds_ - static_cast<double>(probe_tokens_) * plain);
  probe_seconds_ = 0;
  probe_tokens_ = 0;
  ratio_ = ratio_ ? options_.alpha * ratio + (1 - options_.alpha) * *ratio_ : ratio;
  ResetSamples();
  ++decisions_;
  const bool pays = *ratio_ < options_.margin;
  if (pays != choice_) {
    choice_ = pays;
    switched_ = true;
    ++switches_;
    EXL3_LOG(kInfo) << "speculative decoding " << (pays ? "on" : "off") << ": drafting steps cost "
                    << *ratio_ << "x plain steps per token";
  }
  return true;
}

void DraftGovernor::Observe(const DraftStepCost& step) {
  if (!step.decode_only || step.tokens <= 0 || step.seconds < 0) return;
  const int kind = step.drafts_allowed && step.drafted ? 1 : 0;
  if (kind == 1 && (!choice_ || decisions_ == 0)) {  // probing drafting (catch-up included)
    probe_seconds_ += step.seconds;
    probe_tokens_ += step.tokens;
  } else if (kind == 0 && !choice_) {
    budget_ += options_.probe_budget * step.seconds;
  }
  // Only a window's steps are samples: there both kinds run side by side.
  if (step_in_period_ < window_) {
    if (kind == 1 && skip_first_drafted_) {
      skip_first_drafted_ = false;  // the catch-up step: not a steady cost
    } else {
      seconds_[kind] += step.seconds;
      tokens_[kind] += step.tokens;
      ++samples_[kind];
    }
  }
  ++step_in_period_;
  if (step_in_period_ == window_) {
    window_confirms_off_ = Decide() && !choice_ && last_ratio_ >= options_.margin;
  }
  if (step_in_period_ < options_.period) return;
  // The next period's probe (see the header: backoff while off).
  if (choice_ || (switched_ && *ratio_ <= options_.clear_loss)) {
    backoff_ = 1;
    skip_ = 0;
  } else if (switched_) {
    backoff_ = std::min(4, options_.max_probe_backoff);  // a clear loss needs no confirming probe
    skip_ = backoff_ - 1;
  } else if (probe_period_ && window_confirms_off_) {
    const int factor = *ratio_ > options_.clear_loss ? 4 : 2;
    backoff_ = std::min(factor * backoff_, options_.max_probe_backoff);
    skip_ = backoff_ - 1;
  } else if (probe_period_) {
    skip_ = 0;  // the window said nothing, or that drafting may pay: probe again
  } else {
    skip_ = std::max(0, skip_ - 1);
  }
  // While off, a probe also waits for the budget to cover the last ones.
  probe_period_ = skip_ == 0 && (choice_ || budget_ >= 0);
  StartPeriod();
}

}  // namespace exl3serve::coordinator
