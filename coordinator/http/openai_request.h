// coordinator/http/openai_request.h — the OpenAI HTTP API's request bodies
// (/v1/chat/completions, /v1/completions, /tokenize, /detokenize) parsed and
// validated into what the engine takes (v1::GenerateRequest), and the
// OpenAI error shape every refusal is sent in.
//
//   auto parsed = ParseChatCompletionRequest(body);
//   if (auto* e = std::get_if<ApiError>(&parsed)) return Send(e->status, ErrorJson(*e));
//   const CompletionRequest& request = std::get<CompletionRequest>(parsed);
//
// Pure functions of the body text: no engine, no I/O, never throw (the
// libFuzzer target tests/fuzz/openai_request_fuzz.cc holds them to that).
// Every refusal is a 400 whose `param` names the field ("messages[2].role",
// "top_logprobs"), including fields we do not implement: nothing a client
// asks for is silently ignored, except `user`, `metadata` and `store`,
// which carry no meaning for generation. A JSON null counts as absent.
#ifndef EXL3SERVE_COORDINATOR_HTTP_OPENAI_REQUEST_H_
#define EXL3SERVE_COORDINATOR_HTTP_OPENAI_REQUEST_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "exl3serve/v1/generation.pb.h"

namespace exl3serve::coordinator::http {

// A refusal in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;             // the field path; empty = null
  std::string code;              // e.g. "model_not_found"; empty = null
  int retry_after_seconds = 0;   // > 0: sent as Retry-After
};

ApiError BadRequest(std::string param, std::string message);
// The JSON body of `error` (compact, one line).
std::string ErrorJson(const ApiError& error);

// Largest n (choices per prompt) and prompts per /v1/completions request.
inline constexpr int kMaxChoices = 64;
inline constexpr int kMaxPrompts = 64;

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

struct CompletionRequest {
  bool chat = true;              // /v1/chat/completions (else /v1/completions)
  std::string model;             // empty: the client named none
  bool stream = false;
  bool include_usage = false;    // stream_options.include_usage
  int n = 1;
  bool logprobs = false;         // sampled-token logprobs
  int top_logprobs = 0;          // 0..20 alternatives per position
  bool echo = false;             // completions: the prompt precedes the output
  bool skip_special_tokens = true;
  bool return_token_ids = false;  // vLLM's extension: choices[].token_ids
  // Chat: the conversation (messages, tools_json, template kwargs,
  // add_generation_prompt / continue_final_message) in prompts[0].chat().
  ToolChoice tool_choice = ToolChoice::kNone;  // kNone when no tools were sent
  std::string named_tool;        // kNamed: the function's name
  std::vector<std::string> tool_names;
  // Each tool's `parameters` JSON Schema as JSON text (empty: none given),
  // parallel to tool_names: a forced call (required, named) is constrained
  // to it.
  std::vector<std::string> tool_parameters;
  bool parallel_tool_calls = true;
  // One engine request per prompt (completions may carry several), with the
  // sampling parameters filled in and no request_id; the server submits
  // each n times.
  std::vector<v1::GenerateRequest> prompts;
};

std::variant<CompletionRequest, ApiError> ParseChatCompletionRequest(std::string_view body);
std::variant<CompletionRequest, ApiError> ParseCompletionRequest(std::string_view body);

// POST /tokenize (vLLM's shape): {"prompt": "..."} or {"messages": [...]}.
struct TokenizeRequest {
  std::string model;
  bool chat = false;
  v1::ChatInput messages;        // chat: as ParseChatCompletionRequest builds it
  std::string prompt;            // otherwise
  bool add_special_tokens = true;  // default true for prompt, false for messages
  bool return_token_strs = false;
};
std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body);

// POST /detokenize: {"tokens": [ids]}.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body);

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_OPENAI_REQUEST_H_
