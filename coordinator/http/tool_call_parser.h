// coordinator/http/tool_call_parser.h — splits a model's generated text into
// plain content and OpenAI-style tool calls, incrementally, for the Hermes/Qwen,
// Llama 3.x JSON and Mistral output formats (docs/openai-api.md §5).
//
// Use it when a chat request carries `tools`: feed each decoded piece of text
// as it arrives, send `content` as content deltas and `tool_calls` as
// `delta.tool_calls`, and call Finish() at the end of generation.
//
//   ToolCallParser parser(ToolCallFormat::kHermes, request_seed);
//   for (piece : pieces) Send(parser.Feed(piece));
//   Send(parser.Finish());
//   finish_reason = parser.num_calls() > 0 ? "tool_calls" : finish_reason;
//
// Formats (the JSON of a call is one object with a string "name" and an
// "arguments" (or, for Llama, "parameters") value; other keys are ignored):
//   kHermes      `<tool_call>{json}</tool_call>`, repeated; text before the
//                first call, and text after a call that is not another call,
//                is content.
//   kLlama3Json  the whole output is `[<|python_tag|>]{json}[; {json}]...`;
//                only recognised when the output starts (after whitespace)
//                with `{` or `<|python_tag|>`, otherwise it is all content.
//   kMistral     `[TOOL_CALLS][{json}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`
//                (repeated); text before `[TOOL_CALLS]` is content.
//   kNone        everything is content.
// Whitespace and separators (`;`, `,`, closing markers) between and after
// calls are dropped. Markers are matched in the decoded text, so the tokenizer
// must not skip special tokens such as `[TOOL_CALLS]` or `<|python_tag|>`.
#ifndef EXL3SERVE_COORDINATOR_HTTP_TOOL_CALL_PARSER_H_
#define EXL3SERVE_COORDINATOR_HTTP_TOOL_CALL_PARSER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::coordinator::http {

enum class ToolCallFormat { kNone, kHermes, kLlama3Json, kMistral };

// "none", "hermes" (aliases "qwen", "qwen3"), "llama3_json" (alias "llama3"),
// "mistral", ASCII case-insensitive. InvalidArgument for anything else; the
// message lists the accepted names.
absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(std::string_view name);

// The canonical name ("none", "hermes", "llama3_json", "mistral").
std::string_view ToolCallFormatName(ToolCallFormat format);

// Guesses the format from a Jinja chat template's text: "<tool_call>" ->
// kHermes, else "[TOOL_CALLS]" -> kMistral, else "<|python_tag|>" or both
// "<|eot_id|>" and "parameters" -> kLlama3Json, else kNone. A heuristic: a
// flag or config value should be able to override it.
ToolCallFormat DetectToolCallFormat(std::string_view chat_template);

// One piece of one tool call, in OpenAI's streaming shape.
struct ToolCallDelta {
  int index = 0;                    // 0, 1, ... in order of appearance
  std::optional<std::string> id;    // on the call's first delta only
  std::optional<std::string> name;  // the complete name, first delta only
  std::string arguments;            // a fragment of the arguments JSON text; may be
                                    // empty on the first delta
};

// What one Feed() or Finish() produced. The content and the deltas of one
// result carry no order relative to each other; the deltas are in order, and
// consecutive pieces of the same tool call are coalesced into one delta.
struct ParsedOutput {
  std::string content;  // plain text that can be sent to the client now
  std::vector<ToolCallDelta> tool_calls;

  bool empty() const { return content.empty() && tool_calls.empty(); }
};

// Streaming splitter of generated text into content and tool calls.
//
// Guarantees:
//  - The concatenation of all outputs does not depend on how the input was
//    split into Feed() calls (any split, down to single bytes).
//  - A call's first delta carries index, id and the complete name, and is
//    produced as soon as the name is complete; later deltas carry the index
//    and an arguments fragment only.
//  - Arguments are the raw JSON text of the "arguments"/"parameters" value as
//    the model wrote it, without the surrounding whitespace and never
//    re-serialised (a double-encoded JSON string is passed through with its
//    quotes). They are streamed as they arrive; if they come before "name",
//    they are buffered and sent with the first delta. A call that names no
//    arguments gets "{}". The value is checked structurally only (strings,
//    escapes, matching brackets), so malformed JSON inside it passes through.
//  - Nothing the model wrote is lost: text that does not turn into a call (bad
//    JSON, a call object without a string "name", a marker that never
//    completes, an empty Mistral list) comes back as content, verbatim; in
//    particular an output without calls comes back unchanged. Once a call's name has been
//    sent the call stands; if its JSON breaks after that, the call ends there
//    and the text from the offending character on is handled as content.
//
// Thread safety: thread-compatible. Ownership: owns all its state.
class ToolCallParser {
 public:
  // `id_seed` seeds the random part of call ids (use a per-request seed so ids
  // differ across requests). Ids are `id_prefix` + the call's index + "_" + 16
  // random alphanumerics, unique within a parser; for kMistral they are
  // exactly 9 alphanumerics (what Mistral chat templates require), unique
  // within a parser and `id_prefix` is not used.
  ToolCallParser(ToolCallFormat format, uint64_t id_seed, std::string id_prefix = "call_");

  // Consumes the next piece of generated text and returns what can be sent
  // now. Text that might still become part of a marker or of a call object
  // (e.g. "<tool_" at the end of a piece, or a call whose name has not been
  // seen) is held back until it is decided. Cost: linear in the piece plus
  // the held-back text. After Finish() the text is dropped and the result is
  // empty.
  ParsedOutput Feed(std::string_view text);

  // End of generation: decides everything held back. A call whose name is
  // known is completed with the arguments seen so far ("{}" if none were
  // seen); an unfinished call without a name, and a partial marker, come back
  // as content. Later calls return an empty result.
  ParsedOutput Finish();

  // Calls started (first delta produced) so far.
  int num_calls() const { return num_calls_; }
  ToolCallFormat format() const { return format_; }

 private:
  enum class State {
    kContent,            // plain text; Hermes/Mistral look for the start marker
    kAfterCall,          // drops whitespace after a call, then kContent
    kObject,             // inside a call object (sub-state object_state_)
    kHermesClose,        // after the object: whitespace, then `</tool_call>`
    kLlamaStart,         // before the output's first non-whitespace character
    kLlamaNext,          // after an object: whitespace, then `;` or the end
    kLlamaAfterSemi,     // after `;`: whitespace, then `{`
    kMistralStart,       // after `[TOOL_CALLS]`: whitespace, then `[` or a name
    kMistralArrayFirst,  // after `[`: whitespace, then `{`
    kMistralArrayNext,   // after an element: whitespace, then `,` or `]`
    kMistralArrayElem,   // after `,`: whitespace, then `{`
    kMistralName,        // name characters until `[ARGS]`
    kMistralArgsStart,   // after `[ARGS]`: whitespace, then the value
    kMistralArgs,        // inside the arguments value
  };
  enum class ObjectState { kOpen, kKeyOrEnd, kKey, kInKey, kColon, kValueStart, kInValue, kCommaOrEnd };
  enum class ValueKind { kName, kArguments, kOther };
  enum class MatchResult { kNo, kMaybe, kYes };

  // Scans one JSON value byte by byte and says where it ends.
  class ValueScanner {
   public:
    enum class Result {
      kMore,       // the byte belongs to the value, which continues
      kEndAfter,   // the byte belongs to the value and ends it
      kEndBefore,  // the value (a bare number or literal) ended before the byte
      kInvalid,    // the byte cannot start or continue a value
    };
    void Reset();
    Result Push(char c);

   private:
    bool started_ = false;
    bool in_string_ = false;
    bool escape_ = false;
    bool primitive_ = false;
    std::string stack_;  // open brackets, innermost last
  };

  void Run();
  // Each returns false when it needs more input to decide, true after making
  // progress (consuming input or changing state).
  bool Step();
  bool StepContent();
  bool StepObject(char c);

  MatchResult MatchAt(std::string_view marker) const;
  void Take(size_t n);  // consumes n bytes, keeping them in raw_ while undecided
  bool RecordsRaw() const;
  void StartObject();
  void Commit(std::string name);
  void EndCall();
  void Fail();
  void EndOfInput();

  void EmitContent(std::string_view text);
  void EmitArguments(std::string_view text);
  void AppendArguments(char c);
  std::string NextId();

  // Constant after construction.
  const ToolCallFormat format_;
  const std::string id_prefix_;
  const std::string_view start_marker_;  // "" when content is not scanned

  uint64_t rng_state_;
  uint64_t mistral_id_base_;
  std::string buf_;  // unconsumed input is buf_[pos_..]
  size_t pos_ = 0;
  bool finished_ = false;
  State state_;
  ParsedOutput out_;  // collects the current Feed/Finish result
  int num_calls_ = 0;

  // The current call region.
  std::string raw_;        // consumed text not yet sent anywhere (until committed)
  bool committed_ = false;  // the call's first delta has been produced
  ObjectState object_state_ = ObjectState::kOpen;
  ValueKind value_kind_ = ValueKind::kOther;
  ValueScanner value_;
  std::string key_raw_;
  bool key_escape_ = false;
  std::string key_;
  bool name_seen_ = false;
  std::string name_raw_;
  bool arguments_key_seen_ = false;  // later "arguments"/"parameters" keys are ignored
  bool arguments_started_ = false;   // a byte of the arguments value was seen
  std::string pending_arguments_;  // arguments seen before the name
};

// A complete tool call, as in a non-streaming response.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;
};

struct ParsedMessage {
  std::string content;
  std::vector<ToolCall> calls;
};

// Adds one Feed()/Finish() result to `message`: content is appended, deltas
// are merged by index (a new index opens a call with its id and name, the
// arguments fragments are appended). Requires: the outputs of one parser, in
// order.
void MergeParsedOutput(const ParsedOutput& output, ParsedMessage* message);

// Parses a whole generated text: exactly what a ToolCallParser fed `text` and
// finished produces, merged, so streamed and non-streamed responses match.
ParsedMessage ParseToolCalls(ToolCallFormat format, std::string_view text, uint64_t id_seed,
                             std::string id_prefix = "call_");

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_TOOL_CALL_PARSER_H_
