// coordinator/draft_governor.h — whether speculative decoding pays on this
// deployment right now, measured rather than assumed. Acceptance alone
// (draft_length.h) does not say it: a verify step of 1 + k rows costs what
// the kernels make it cost (on a CPU a dense fp32 linear costs ~k times a
// decode row; a 16-bit head re-reads its weights every 4 rows), and a draft
// model costs its own forwards. So the engine times its decode steps and
// compares seconds per generated token with drafts allowed and without.
//
//   DraftGovernor governor;
//   bool draft = governor.AllowDrafts();          // before proposing drafts
//   ... the step runs ...
//   governor.Observe({.drafts_allowed = draft, .decode_only = ..., .seconds = t, .tokens = n});
//
// Rule: the steps come in periods of `period` (64) decode-only steps; the
// first steps of a period run the mode that is not the current choice (a
// probe: `probe` (8) plain steps while drafting is on, `probe_drafting`
// (32) drafting steps while it is off — drafting's gain is bursty, so a
// short probe of it would mostly miss it), the rest the choice. A period sums each mode's seconds
// and tokens (a ratio of sums: drafting pays in bursts — only steps whose
// sequences have a draft gain anything — so a mean of per-step ratios over
// a few steps would mostly see the steps between bursts); at its end each
// mode's seconds per token enters an exponential moving average over periods
// (weight `alpha` 0.5), and the choice becomes drafts iff the drafting
// average is below `margin` (0.97) times the plain one — so drafting that
// does not pay costs at most the probe share (1/8) of the steps, and
// drafting that pays keeps ~7/8 of its gain. Until both modes have
// `min_samples` (4) timed steps the choice stays "drafts" (the default the
// operator asked for). While drafting stays off, its probes back off: after
// each period that confirms "off" the next probe comes twice as many periods
// later, up to every `max_probe_backoff` (16) periods — a probe of a draft
// model costs its catch-up and k forwards per sequence, so a probe every
// period would cost ~1/8 of the plain speed where drafting never pays. Any
// switch, and every period while drafting is on, probes the next period.
// A probe of drafting is long (32 steps) only while the loss is small: when
// drafting costs more than `clear_loss` (1.25) times plain per token, a
// burst could not hide it (a draft model that loses loses at every step),
// so the probe is `probe` (8) steps — a quarter of a long probe's cost.
// Steps with a prefill chunk (decode_only false) are not timed and do not
// advance the period: their cost is the prompt's.
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_
#define EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_

#include <cstdint>
#include <optional>

namespace exl3serve::coordinator {

struct DraftGovernorOptions {
  int period = 64;        // decode-only steps per decision, > both probes
  int probe = 8;           // plain steps per period while drafting is on, >= 1
  int probe_drafting = 32;  // drafting steps per probe while it is off, >= 1
  double alpha = 0.5;     // EMA weight of a new period, (0, 1]
  double margin = 0.97;   // drafting must be this much cheaper per token
  int min_samples = 4;    // observations of each mode before deciding
  int max_probe_backoff = 16;  // periods between probes while off, at most (>= 1)
  double clear_loss = 1.25;    // drafting/plain cost per token above this: short probes (> 1)
};

struct DraftStepCost {
  bool drafts_allowed = false;  // what AllowDrafts said for this step
  bool decode_only = false;     // every entry decoded (no prefill chunk)
  double seconds = 0;           // the step's wall time, drafting included
  int64_t tokens = 0;           // tokens the step generated (runs included)
};

class DraftGovernor {
 public:
  // Requires: options within the ranges above (CHECKed).
  explicit DraftGovernor(const DraftGovernorOptions& options = {});

  // Whether the next step may draft.
  bool AllowDrafts() const;
  void Observe(const DraftStepCost& step);

  // The current choice (what the non-probe steps of a period run).
  bool choice() const { return choice_; }
  // Seconds per token of each mode (nullopt before its first period).
  std::optional<double> drafting_seconds_per_token() const { return on_; }
  std::optional<double> plain_seconds_per_token() const { return off_; }
  // Decisions that turned drafting off / on again (for logs and tests).
  uint64_t switches() const { return switches_; }

 private:
  // Steps of the probe in a probe period (the mode that is not the choice).
  int ProbeSteps() const;

  const DraftGovernorOptions options_;
  bool choice_ = true;
  int step_in_period_ = 0;
  std::optional<double> on_, off_;  // seconds per token, averaged over periods
  double period_seconds_[2] = {0, 0};  // [plain, drafting] in this period
  int64_t period_tokens_[2] = {0, 0};
  int on_samples_ = 0, off_samples_ = 0;
  uint64_t switches_ = 0;
  bool probe_period_ = true;  // this period starts with a probe
  int backoff_ = 1;           // periods from one probe of drafting to the next
  int skip_ = 0;              // periods left without a probe
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_
