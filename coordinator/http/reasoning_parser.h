// coordinator/http/reasoning_parser.h — splits generated text into reasoning
// (a `<think>…</think>` block, Qwen3 / DeepSeek-R1 style) and content,
// incrementally, for `reasoning_content` / `reasoning` (docs/openai-api.md §6).
//
//   ReasoningParser reasoning(PromptOpensReasoning(rendered_prompt));
//   for (piece : pieces) {
//     ReasoningSplit split = reasoning.Feed(piece);
//     SendReasoning(split.reasoning);
//     SendContent(split.content);  // or feed it to a ToolCallParser first
//   }
//   ReasoningSplit last = reasoning.Finish();
#ifndef EXL3SERVE_COORDINATOR_HTTP_REASONING_PARSER_H_
#define EXL3SERVE_COORDINATOR_HTTP_REASONING_PARSER_H_

#include <string>
#include <string_view>

namespace exl3serve::coordinator::http {

struct ReasoningSplit {
  std::string reasoning;
  std::string content;

  bool empty() const { return reasoning.empty() && content.empty(); }
};

// Streaming splitter of reasoning and content.
//
// Guarantees:
//  - The concatenation of all outputs does not depend on how the input was
//    split into Feed() calls.
//  - The open and close markers appear in neither output. Whitespace directly
//    after the close marker is dropped (it separates the block from the
//    answer); everything else is kept verbatim, including whitespace inside
//    the block.
//  - Only the first block counts: after the close marker everything is
//    content, markers included.
//  - Text that might be the start of a marker is held back until decided:
//    a partial close marker inside the block, and, before the output's first
//    non-whitespace character, leading whitespace and a partial open marker.
//
// Thread safety: thread-compatible. Ownership: owns copies of the markers.
class ReasoningParser {
 public:
  // starts_in_reasoning: the rendered prompt already opened the block (see
  // PromptOpensReasoning), so generated text is reasoning until `close`; an
  // open marker repeated at the very start of the output is dropped.
  // Otherwise the output is reasoning only if it begins, after optional
  // whitespace, with `open` (that whitespace is dropped too); if it does not,
  // all of it is content.
  // Requires: `open` and `close` are non-empty.
  explicit ReasoningParser(bool starts_in_reasoning, std::string open = "<think>",
                           std::string close = "</think>");

  // Consumes the next piece of generated text; returns what can be sent now.
  // After Finish() the text is dropped and the result is empty.
  ReasoningSplit Feed(std::string_view text);

  // End of generation. An unclosed block: what was held back goes to
  // reasoning. Before any non-whitespace output: held text goes where the
  // output would have gone (reasoning if starts_in_reasoning, else content).
  ReasoningSplit Finish();

  // True while generated text goes to reasoning: inside the block, or before
  // the first non-whitespace output when starts_in_reasoning.
  bool in_reasoning() const;

 private:
  enum class State {
    kStart,       // before the first non-whitespace character
    kReasoning,   // inside the block, looking for `close`
    kAfterClose,  // dropping whitespace after `close`
    kContent,     // everything is content
  };

  ReasoningSplit Process(bool final);

  // Constant after construction.
  const bool starts_in_reasoning_;
  const std::string open_;
  const std::string close_;

  State state_ = State::kStart;
  std::string held_;  // received, not yet decided
  bool finished_ = false;
};

// True when `prompt` ends with `open` followed only by whitespace, i.e. the
// chat template already opened the think block for the model.
bool PromptOpensReasoning(std::string_view prompt, std::string_view open = "<think>");

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_REASONING_PARSER_H_
