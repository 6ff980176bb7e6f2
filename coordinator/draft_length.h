// coordinator/draft_length.h — how many draft tokens a sequence proposes in
// its next speculative round, from how many of its recent drafts the target
// accepted (ExLlamaV3's dynamic draft length, with its constants).
//
//   AdaptiveDraftLength length(/*max_draft=*/4);
//   int k = length.Next();                 // 0: decode plainly this round
//   ... draft k tokens, verify, accepted = how many matched ...
//   length.Observe(k, accepted);
//
// Rules:
//   a = accepted, plus 1 when the whole window was accepted (the window
//       censors acceptance: a full accept says "at least this many");
//   the first observed window sets ema = a; after that
//       ema <- alpha * a + (1 - alpha) * ema, alpha = alpha_up (1.30) when
//       a > ema, else alpha_down (0.65): quick to grow, slower to shrink;
//   the next window is clamp(ceil(ema), 1, max_draft), max_draft before any
//       window was observed;
//   while ema < skip_below (0.3) the sequence drafts nothing (drafts do not
//       pay), except a probe window of min(2, max_draft) every
//       probe_interval (16) rounds, so it can recover when the text turns
//       repetitive.
// A round whose window was 0, or that had no draft to offer (Observe with
// window 0), changes nothing but the probe count.
//
// Thread safety: thread-compatible (one per sequence, on the scheduler thread).
#ifndef EXL3SERVE_COORDINATOR_DRAFT_LENGTH_H_
#define EXL3SERVE_COORDINATOR_DRAFT_LENGTH_H_

#include <optional>

namespace exl3serve::coordinator {

struct AdaptiveDraftLengthOptions {
  double alpha_up = 1.30;
  double alpha_down = 0.65;
  double skip_below = 0.3;
  int probe_interval = 16;  // > 0
};

class AdaptiveDraftLength {
 public:
  // Requires: max_draft >= 0 (0: never drafts).
  explicit AdaptiveDraftLength(int max_draft, const AdaptiveDraftLengthOptions& options = {});

  // The window for this round; counts the round toward the next probe.
  int Next();
  // What the round's verification found: `window` tokens drafted (what
  // Next returned, or fewer when the drafter had fewer), `accepted` of them
  // equal to the target's tokens. Requires: 0 <= accepted <= window.
  void Observe(int window, int accepted);

  std::optional<double> ema() const { return ema_; }
  int max_draft() const { return max_draft_; }

 private:
  const int max_draft_;
  const AdaptiveDraftLengthOptions options_;
  std::optional<double> ema_;
  int rounds_since_probe_ = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_DRAFT_LENGTH_H_
