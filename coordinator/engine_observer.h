// coordinator/engine_observer.h — what the serving engine reports as it runs,
// for metrics (coordinator/metrics.h) or tests: request timings and token
// counts, and the cost of each scheduler step. Nothing here decides
// behaviour; an engine without an observer runs the same.
//
//   EngineOptions options;  options.observer = metrics.get();  // outlives the engine
//
// Thread safety: the engine calls every method on its scheduler thread, one
// call at a time; implementations must be quick and must not block or call
// back into the engine.
#ifndef EXL3SERVE_COORDINATOR_ENGINE_OBSERVER_H_
#define EXL3SERVE_COORDINATOR_ENGINE_OBSERVER_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace exl3serve::coordinator {

// How a request ended, in vLLM's finished_reason vocabulary (EOS, stop ids
// and stop strings are all "stop").
enum class FinishKind { kStop, kLength, kAbort };
inline const char* FinishKindName(FinishKind kind) {
  switch (kind) {
    case FinishKind::kStop: return "stop";
    case FinishKind::kLength: return "length";
    case FinishKind::kAbort: return "abort";
  }
  return "stop";
}

// One finished request (FinishKind) with its intervals, all from the
// engine's clock. vLLM's definitions: queue = arrival -> first scheduled;
// prefill = scheduled -> first token; decode = first token -> finish.
struct RequestRecord {
  FinishKind finish = FinishKind::kStop;
  absl::Time arrival;                     // validated and queued
  std::optional<absl::Time> scheduled;    // first admitted into a batch
  std::optional<absl::Time> first_token;  // first sampled token
  absl::Time finished;
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;  // output tokens (stop ids/EOS excluded)
  int64_t max_tokens = 0;         // the request's effective max_tokens
};

// One scheduler step that ran a forward.
struct StepRecord {
  absl::Duration step;     // forming the batch .. the last token handed out
  absl::Duration forward;  // waiting for the ranks' forward (part of step)
  int64_t batch_sequences = 0;
  int64_t batch_tokens = 0;  // new tokens through the forward (prefill + decode)
  int64_t sampled_tokens = 0;
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;

  // A request's first token: time to first token from arrival, and the
  // prompt it was prefilled from (counted once, also across replays).
  virtual void OnFirstToken(absl::Duration ttft, int64_t prompt_tokens) = 0;
  // The interval between two successive tokens of one request.
  virtual void OnInterTokenLatency(absl::Duration itl) = 0;
  // A request completed (stop, length or abort).
  virtual void OnRequestFinished(const RequestRecord& record) = 0;
  // A request ended with an error (deadline, a failed rank group, ...).
  virtual void OnRequestFailed(absl::StatusCode code) = 0;
  virtual void OnStep(const StepRecord& record) = 0;
  // The rank group was re-formed and `replayed` in-flight requests requeued.
  virtual void OnGroupReformed(int64_t replayed) = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_ENGINE_OBSERVER_H_
