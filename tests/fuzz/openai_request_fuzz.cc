// libFuzzer target: an HTTP request body (any bytes) through every OpenAI
// request parser of coordinator/http/openai_request.h. Contract: no crash,
// leak or UB; a refusal is a 400 with a message (and a param that is a
// plausible field path); an accepted request is one the engine can be given
// (at least one prompt, n and top_logprobs in range, chat has messages).
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <variant>

#include "coordinator/http/openai_request.h"

namespace http = exl3serve::coordinator::http;

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

void CheckError(const http::ApiError& e) {
  Check(e.status == 400);
  Check(!e.message.empty());
  Check(e.param.size() < 4096);
  Check(http::ErrorJson(e).find("\"error\"") != std::string::npos);
}

void CheckCompletion(const std::variant<http::CompletionRequest, http::ApiError>& parsed, bool chat) {
  if (const auto* e = std::get_if<http::ApiError>(&parsed)) return CheckError(*e);
  const http::CompletionRequest& r = std::get<http::CompletionRequest>(parsed);
  Check(r.chat == chat);
  Check(!r.prompts.empty() && r.prompts.size() <= static_cast<size_t>(http::kMaxPrompts));
  Check(r.n >= 1 && r.n * r.prompts.size() <= static_cast<size_t>(http::kMaxChoices));
  Check(r.top_logprobs >= 0 && r.top_logprobs <= 20);
  for (const auto& g : r.prompts) {
    if (chat) {
      Check(g.has_chat() && g.chat().messages_size() > 0);
    } else {
      Check(g.has_text() ? !g.text().empty() : g.tokenized().input_ids_size() > 0);
    }
    const auto& s = g.sampling_params();
    Check(s.temperature() >= 0 && s.temperature() <= 2);
    Check(s.top_p() >= 0 && s.top_p() <= 1);
    Check(s.max_tokens() >= 0);
  }
  if (r.tool_choice == http::ToolChoice::kNamed) {
    bool known = false;
    for (const auto& n : r.tool_names) known |= n == r.named_tool;
    Check(known);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  CheckCompletion(http::ParseChatCompletionRequest(body), /*chat=*/true);
  CheckCompletion(http::ParseCompletionRequest(body), /*chat=*/false);
  if (auto t = http::ParseTokenizeRequest(body); std::holds_alternative<http::ApiError>(t)) {
    CheckError(std::get<http::ApiError>(t));
  }
  if (auto d = http::ParseDetokenizeRequest(body); std::holds_alternative<http::ApiError>(d)) {
    CheckError(std::get<http::ApiError>(d));
  }
  return 0;
}
