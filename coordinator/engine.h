// coordinator/engine.h — what the gRPC front door (generation_service.h)
// needs from the serving engine: submit a request and receive its stream of
// responses, abort, and report model/server state. The engine owns
// tokenization, the schedule (continuous batching, the KV block allocator,
// preemption, deadlines) and the rank group; the service owns only gRPC.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateLocalEngine(options));
//   absl::Status s = engine->Submit(request, [](const v1::GenerateResponse& r) { ... });
//
// Thread safety: every method is thread-safe. Response callbacks run on the
// engine's scheduler thread, one request's responses in order; a callback
// must not block (post to a queue) and must not call back into the engine.
#ifndef EXL3SERVE_COORDINATOR_ENGINE_H_
#define EXL3SERVE_COORDINATOR_ENGINE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/status/statusor.h"
#include "exl3serve/v1/generation.pb.h"

namespace exl3serve::coordinator {

class Tokenizer;

namespace v1 = ::exl3serve::v1;

// Receives a request's responses: chunks, then exactly one complete or one
// error, after which it is never called again (and is released).
using ResponseCallback = std::function<void(const v1::GenerateResponse& response)>;

class Engine {
 public:
  virtual ~Engine() = default;

  // Validates and queues `request`. On OK the callback will receive the
  // request's responses (the request_id is filled in, assigned when empty).
  // Errors (nothing queued, the callback is never called):
  //   InvalidArgument naming the field (empty input, max_tokens < 0 or above
  //   the limit, top_p outside (0, 1], a token id outside the vocabulary, a
  //   prompt longer than the context, a duplicate request_id, ...);
  //   ResourceExhausted with the reason when the queue is full;
  //   Unavailable when the engine is not ready or is shutting down.
  virtual absl::Status Submit(const v1::GenerateRequest& request, ResponseCallback on_response) = 0;

  // Aborts the named live requests (their streams complete with
  // FINISH_REASON_ABORT; their KV blocks are freed at the next step).
  // Returns how many were live.
  virtual int Abort(const std::vector<std::string>& request_ids, const std::string& reason) = 0;

  virtual v1::GetModelInfoResponse GetModelInfo() const = 0;
  virtual v1::GetServerInfoResponse GetServerInfo() const = 0;

  // The model's tokenizer, or null when it has none (token-id input only);
  // lives as long as the engine. Front ends use it for token strings
  // (logprobs), /tokenize and echo.
  virtual const Tokenizer* tokenizer() const { return nullptr; }
  // The prompt text `chat` renders to with the model's chat template, as
  // Submit renders it. InvalidArgument naming the field (chat.messages[i].role,
  // chat.tools_json, ...) or when the model has no template.
  virtual absl::StatusOr<std::string> RenderChat(const v1::ChatInput& chat) const {
    return absl::UnimplementedError("this engine does not render chat templates");
  }
  // False when Submit would refuse a request for a full queue right now
  // (checked before a front end renders and tokenizes a prompt).
  virtual bool AdmitsRequests() const { return true; }

  // Ready: every rank present, loaded and warmed up, not shutting down.
  virtual bool ready() const = 0;
  // A one-token forward through every rank, by `deadline` (deep health check).
  virtual absl::Status DeepHealthCheck(absl::Time deadline) = 0;

  // Stops admitting, aborts what is running (streams end with ABORT) and
  // stops the scheduler. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_ENGINE_H_
