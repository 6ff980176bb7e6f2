// libFuzzer target: a chat template and its context, both fuzzed, through
// ChatTemplate::Parse and Render. Input: TEMPLATE, a NUL byte, then the
// context as JSON (an object; invalid or missing JSON -> a fixed
// conversation). Contract: no crash, leak, UB or hang (the render step budget
// and the output/nesting/macro-depth limits bound every template); errors are
// InvalidArgument (syntax, Python-like render errors) or ResourceExhausted
// (a named budget), never anything else.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/tokenizer/chat_template.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string source = input.substr(0, nul);
  nlohmann::ordered_json context;
  if (nul != std::string::npos) {
    context = nlohmann::ordered_json::parse(input.substr(nul + 1), nullptr, /*allow_exceptions=*/false);
  }
  if (context.is_discarded() || context.is_null()) {
    context = {{"messages",
                {{{"role", "system"}, {"content", "Be brief."}},
                 {{"role", "user"}, {"content", "Hi <3"}},
                 {{"role", "assistant"}, {"content", "Hello!"},
                  {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", {{"x", 1}}}}}}}}}}},
               {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
               {"add_generation_prompt", true},
               {"bos_token", "<s>"},
               {"eos_token", "</s>"}};
  }
  auto parsed = exl3serve::coordinator::ChatTemplate::Parse(source);
  if (!parsed.ok()) {
    if (parsed.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  auto rendered = parsed->Render(context);
  if (!rendered.ok()) {
    const absl::StatusCode c = rendered.status().code();
    if (c != absl::StatusCode::kInvalidArgument && c != absl::StatusCode::kResourceExhausted) std::abort();
    if (rendered.status().message().empty()) std::abort();
  }
  return 0;
}
