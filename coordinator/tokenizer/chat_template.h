// coordinator/tokenizer/chat_template.h — renders the Jinja chat templates of
// tokenizer_config.json (`chat_template`) the way Hugging Face transformers'
// apply_chat_template does, with our own interpreter for the Jinja subset
// those templates use.
//
//   EXL3_ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::Parse(tokenizer.chat_template()));
//   EXL3_ASSIGN_OR_RETURN(std::string prompt, tmpl.Render(context));
//   // or, with the tokenizer's template and special tokens:
//   EXL3_ASSIGN_OR_RETURN(std::string prompt,
//                         RenderChatPrompt(tokenizer, messages, {.add_generation_prompt = true}));
//
// Semantics are those of jinja2's ImmutableSandboxedEnvironment with
// trim_blocks and lstrip_blocks on, the loopcontrols extension, and the
// globals transformers adds (raise_exception, strftime_now, tojson as
// json.dumps with ensure_ascii=False). Values behave as the Python objects
// they would be there: output uses Python's str() (None, True, ['a', 1]),
// strings are indexed and measured in code points, dicts keep insertion order.
// The supported subset is listed in coordinator/tokenizer/README.md; anything
// outside it is an error at parse or render time, never a silent difference.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator {

namespace chat_template_internal {
struct Program;
}  // namespace chat_template_internal

// A parsed chat template.
// Thread safety: immutable after Parse; Render is const and thread-safe.
// Ownership: owns its syntax tree (shared between copies, never mutated).
class ChatTemplate {
 public:
  // Parses `source` (the template text as stored in tokenizer_config.json).
  // Errors: InvalidArgument naming the line and column of the first syntax
  // error ("chat template line 3, column 14: expected 'endif', got end of
  // template"), or of a statement, filter or test this interpreter does not
  // support. Cost: linear in the size of the template.
  static absl::StatusOr<ChatTemplate> Parse(std::string source);

  // Renders the template with `context` as its variables (an object; the
  // usual keys are messages, tools, add_generation_prompt, bos_token,
  // eos_token and template kwargs such as enable_thinking). An ordered_json
  // keeps the caller's key order, which tojson output depends on.
  // Errors: InvalidArgument for `context` not being an object, for the
  // template's raise_exception("...") (the message is the template's), and
  // for errors Python would raise while rendering (undefined attribute of an
  // undefined value, 'str' + None, ...), naming the template line;
  // ResourceExhausted when the output would pass 256 MiB, or when rendering
  // takes more than 5 million steps (statements + expressions evaluated:
  // the render step budget, kMaxRenderSteps), naming the limit.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  explicit ChatTemplate(std::shared_ptr<const chat_template_internal::Program> program);
  std::shared_ptr<const chat_template_internal::Program> program_;
};

class Tokenizer;

struct ChatPromptOptions {
  // Append the header of an assistant turn so the model answers next.
  bool add_generation_prompt = false;
  // Tool schemas (a JSON array) passed as `tools`; null passes None, as
  // transformers does when no tools are given.
  nlohmann::ordered_json tools = nullptr;
  // Further template variables (an object or null), e.g. {"enable_thinking": false}.
  // They override the special-token variables of the same name.
  nlohmann::ordered_json extra_context = nullptr;
};

// Renders `messages` (a JSON array of {role, content, ...}) with the
// tokenizer's chat template, the way transformers' apply_chat_template builds
// the context: messages, tools, documents (None), add_generation_prompt, the
// special tokens the tokenizer config names (bos_token, eos_token, pad_token,
// as their token strings) and `extra_context`.
// Errors: FailedPrecondition when tokenizer_config.json has no chat_template;
// InvalidArgument for `messages` not being an array, `extra_context` not being
// an object, or any Parse/Render error. Cost: parses the template on every
// call (microseconds for the usual few-KB template); keep a ChatTemplate to
// avoid that.
absl::StatusOr<std::string> RenderChatPrompt(const Tokenizer& tokenizer,
                                             const nlohmann::ordered_json& messages,
                                             const ChatPromptOptions& options);

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_H_
