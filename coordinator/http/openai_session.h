// coordinator/http/openai_session.h — one OpenAI completion request on the
// engine: the fan-out of its prompts x n choices as engine requests, and the
// assembly of the engine's responses into OpenAI's shapes: SSE chunks
// (stream) or the one response object, with reasoning split off
// (reasoning_parser.h), tool calls parsed (tool_call_parser.h), logprobs with
// token strings and usage. No HTTP here: http_server.cc moves the bytes.
//
//   auto started = CompletionSession::Start(engine, request, options);
//   if (auto* e = std::get_if<ApiError>(&started)) ... 400/429/503 ...
//   auto& session = *std::get<std::unique_ptr<CompletionSession>>(started);
//   std::string out;
//   while (!session.Pump(absl::Milliseconds(50), &out)) { write(out); out.clear(); }
//   write(out);                      // stream: ends with "data: [DONE]\n\n"
//   ... or, not streaming: session.Result()
//
// Stream framing (openai-api.md section 2): the first chunk of each choice
// carries delta {"role":"assistant","content":""}; then content /
// reasoning_content+reasoning / tool_calls deltas (empty ones skipped); the
// last chunk of a choice has finish_reason stop | length | tool_calls; the
// usage chunk ("choices": []) when include_usage; then "data: [DONE]". An
// engine error after the stream began is a data: {"error": ...} event, then
// [DONE]; the other choices are aborted.
//
// Thread safety: the engine's callbacks only append to a queue under a
// mutex; Pump, Result and Abort are called from one thread (the HTTP
// handler's). Destroying the session aborts whatever is still live (a client
// that went away frees its KV blocks at the next step).
#ifndef EXL3SERVE_COORDINATOR_HTTP_OPENAI_SESSION_H_
#define EXL3SERVE_COORDINATOR_HTTP_OPENAI_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/engine.h"
#include "coordinator/http/openai_request.h"
#include "coordinator/http/tool_call_parser.h"

namespace exl3serve::coordinator::http {

struct SessionOptions {
  std::string model_name;          // the `model` of every response
  std::string system_fingerprint;  // empty: none
  ToolCallFormat tool_format = ToolCallFormat::kNone;  // how this model writes tool calls
  bool reasoning = false;          // split <think>...</think> (the template uses it)
  int64_t created_unix = 0;        // 0: now
  std::string request_id;          // 0: generated (chatcmpl-<hex> / cmpl-<hex>)
};

class CompletionSession {
 public:
  // Renders the chat (Engine::RenderChat; a tool_choice required/named adds
  // the model's tool-call opening to the prompt), then submits each prompt n
  // times (seed + j for choice j when seeded). An error maps Submit's status:
  // InvalidArgument 400 (context_length_exceeded when the prompt is too
  // long), ResourceExhausted 429 and Unavailable 503 (both with
  // Retry-After), anything else 500; requests already submitted are aborted.
  static std::variant<std::unique_ptr<CompletionSession>, ApiError> Start(
      Engine& engine, const CompletionRequest& request, const SessionOptions& options);
  ~CompletionSession();

  CompletionSession(const CompletionSession&) = delete;
  CompletionSession& operator=(const CompletionSession&) = delete;

  // Waits up to `timeout` for engine responses and handles them. Streaming:
  // appends the SSE events they produce to *sse (the finishing call also
  // the usage chunk and [DONE]). Returns true once every choice has ended.
  bool Pump(absl::Duration timeout, std::string* sse);

  // Not streaming, after Pump returned true: the response JSON, or the
  // error that ended a choice (UNAVAILABLE -> 503, DEADLINE_EXCEEDED ->
  // 504, else 500).
  std::variant<std::string, ApiError> Result() const;

  // Aborts every live engine request of this session (idempotent).
  void Abort(const std::string& reason);

  // The engine request ids, one per choice.
  const std::vector<std::string>& request_ids() const;
  bool streaming() const;

  struct State;

 private:
  explicit CompletionSession(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The response id of a new request: prefix + 24 random hex digits.
std::string NewResponseId(std::string_view prefix);

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_OPENAI_SESSION_H_
