// coordinator/draft_governor.h — whether speculative decoding pays on this
// deployment right now, measured rather than assumed. Acceptance alone
// (draft_length.h) does not say it: a verify step of 1 + k rows costs what
// the kernels make it cost (on a CPU a dense fp32 linear costs ~k times a
// decode row; a 16-bit head re-reads its weights every 4 rows), and a draft
// model costs its own forwards. So the engine times its decode steps and
// compares seconds per generated token of steps that drafted and of steps
// that did not.
//
//   DraftGovernor governor;
//   bool allow = governor.AllowDrafts();          // before proposing drafts
//   ... the step runs ...
//   governor.Observe({.drafts_allowed = allow, .drafted = any_entry_drafted,
//                     .decode_only = ..., .seconds = t, .tokens = n});
//
// Like with like. A step's cost depends on far more than drafting: the
// batch size, the context length (attention grows with every token: at 8
// streams a plain step of stories260K costs 1.0 ms at the start of the
// requests and 2.3 ms 256 tokens later), a server's first steps (cold
// caches). Comparing drafting measured at one time with plain decoding
// measured at another (the design before this one: a probe of 8 plain steps
// at the start of a period, drafting for the rest; averages per mode over
// periods) therefore decided on those differences — a losing draft model
// was kept on for two periods because the first plain probe ran cold, and
// cost 7-12 %. So:
//   - Samples are classified by what the step did, not by what it was
//     allowed: a step allowed to draft whose sequences proposed nothing
//     (no n-gram match, every draft window at 0) costs exactly a plain
//     step and is a plain sample. Drafting can only win or lose on steps
//     that draft, so "seconds per token of drafting steps / of plain steps"
//     is the ratio that decides, and with n-gram drafts both kinds of step
//     come interleaved by themselves.
//   - Probes interleave: each period of `period` (64) decode-only steps
//     starts with a probe window whose even steps run the mode that is not
//     the current choice and whose odd steps run the choice — while drafting
//     is on, `probe` (8) plain steps among 8 drafting ones; while it is off,
//     `probe_drafting` (32) drafting-allowed steps among plain ones (8 + 1
//     for the catch-up once the ratio is above `clear_loss` (1.25): a draft model that loses,
//     loses at every step, while n-gram gains come in bursts a short probe
//     would mostly miss). Adjacent steps share batch, context and caches.
//   - Only the windows' steps are samples, and a decision needs
//     `min_samples` (8) of each kind, accumulated over as many windows as
//     that takes (every window holds both kinds at the same times, so
//     samples of several windows still compare like with like; the steps
//     outside windows — all drafting for a draft model — would not). It is
//     taken at the end of a window: the ratio of sums (seconds / tokens of
//     each kind: gains come in bursts, a mean of per-step ratios would
//     mostly see the steps between bursts) enters an exponential moving
//     average (weight `alpha` 0.5), and the choice becomes drafts iff that
//     average is below `margin` (0.97). A draft model decides in one window;
//     n-gram drafts, which draft on a few steps only, over a few (a single
//     window's 1-3 drafting steps once turned a 1.1x gain into "1.7x loss").
//   - The first drafted step of a window while drafting is off is not
//     sampled: a draft model then catches up the tokens it missed (a whole
//     sequence's prefill), a one-time cost of turning drafting on, not a
//     steady one.
//   - While drafting stays off, probes back off: after each window whose
//     own ratio confirms "off" the next probe comes twice as many periods
//     later (four times while the loss is clear), up to every
//     `max_probe_backoff` (16) periods; a window without enough samples
//     (nothing drafted: it cost nothing), or whose ratio says drafting pays
//     while the average does not yet, probes again the next period (so a
//     change is confirmed within a few periods, not backoffs). A switch to
//     "off" by a clear loss waits 4 periods for its first probe; any other
//     switch, and every period while drafting is on, probes the next
//     period. Until the first decision the choice is "drafts" (the default
//     the operator asked for); the first window decides after 16 steps.
//   - Probing a losing draft source is also held to a budget: while off,
//     plain steps earn `probe_budget` (2 %) of their time, and each
//     decision spends what its drafting steps (catch-up included; the first
//     window's too) cost beyond plain decoding of the same tokens; a due
//     probe waits while the budget is negative. So however costly a probe
//     is (a draft model catching up 8 sequences, drafting steps at 6x a
//     plain step), probes take ~2 % of the time in the long run.
// So drafting that does not pay costs its share of probes (at most ~2 %
// beyond the first window), and
// drafting that pays keeps ~7/8 of its gain. Steps with a prefill chunk
// (decode_only false) are not timed and do not advance the period: their
// cost is the prompt's.
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_
#define EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_

#include <cstdint>
#include <optional>

namespace exl3serve::coordinator {

struct DraftGovernorOptions {
  int period = 64;          // decode-only steps per period, >= 2 * max(probe + 1, probe_drafting)
  int probe = 8;            // plain steps per window while drafting is on, >= 1
  int probe_drafting = 32;  // drafting-allowed steps per window while it is off, >= 1
  double alpha = 0.5;       // EMA weight of a new decision's ratio, (0, 1]
  double margin = 0.97;     // drafting must be this much cheaper per token
  int min_samples = 8;      // window steps of each kind a decision needs, >= 1
  int max_probe_backoff = 16;  // periods between probes while off, at most (>= 1)
  double clear_loss = 1.25;    // ratio above this: short probes of drafting (> 1)
  double probe_budget = 0.02;  // probes' extra time / plain time while off, (0, 1)
};

struct DraftStepCost {
  bool drafts_allowed = false;  // what AllowDrafts said for this step
  bool drafted = false;         // some entry carried draft tokens (implies allowed)
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

  // The current choice (what the steps outside probe windows run).
  bool choice() const { return choice_; }
  // Seconds per token of drafting steps / of plain steps, averaged over
  // decisions (nullopt before the first).
  std::optional<double> drafting_cost_ratio() const { return ratio_; }
  // Decisions taken, and those that turned drafting off / on again.
  uint64_t decisions() const { return decisions_; }
  uint64_t switches() const { return switches_; }

 private:
  // Drafting-allowed (choice off) or plain (choice on) steps of a window.
  int ProbeSteps() const;
  // Starts a period: its window (if it probes) and a fresh sample window.
  void StartPeriod();
  // Takes a decision if both kinds have min_samples; true if it did.
  bool Decide();
  void ResetSamples();

  const DraftGovernorOptions options_;
  bool choice_ = true;
  int step_in_period_ = 0;
  int window_ = 0;  // probe window length of this period (0: no probe)
  std::optional<double> ratio_;
  double seconds_[2] = {0, 0};  // [plain, drafted] window samples since the last decision
  int64_t tokens_[2] = {0, 0};
  int samples_[2] = {0, 0};
  bool skip_first_drafted_ = false;  // a window while off: its catch-up step
  bool window_confirms_off_ = false;  // this period's window measured a loss
  double last_ratio_ = 0;            // the last decision's own ratio
  bool switched_ = false;            // a switch in this period
  uint64_t decisions_ = 0, switches_ = 0;
  bool probe_period_ = true;  // this period starts with a probe window
  int backoff_ = 1;           // periods from one probe of drafting to the next
  int skip_ = 0;              // periods left without a probe
  // Probe budget while off (seconds): plain steps add probe_budget x their
  // time, each decision takes what its drafted probe steps cost beyond
  // plain per-token cost; a probe waits while it is negative.
  double budget_ = 0;
  double probe_seconds_ = 0;  // drafted steps while off (or before the first decision)
  int64_t probe_tokens_ = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_DRAFT_GOVERNOR_H_
