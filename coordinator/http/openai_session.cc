#include "coordinator/http/openai_session.h"

#include <deque>
#include <optional>
#include <random>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/http/reasoning_parser.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/tokenizer/unicode_text.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::http {
namespace {

using ojson = nlohmann::ordered_json;

std::string Dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

uint64_t RandomWord() {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^
                                          static_cast<uint64_t>(absl::GetCurrentTimeNanos()));
  return rng();
}

// The responses of a session's engine requests, in arrival order. Shared
// with the engine's callbacks, which may outlive the session (an abort's
// final response arrives after the handler returned): they only append.
struct Inbox {
  absl::Mutex mu;
  std::deque<std::pair<int, v1::GenerateResponse>> queue ABSL_GUARDED_BY(mu);
};

// A forced tool call (tool_choice required or named): the engine's prompt
// text ends with the format's opening marker, the output is constrained to
// the call object ({"name": one of the allowed tools, "arguments" or
// "parameters": that tool's parameter schema}), and once the object is
// complete the closing marker is fed to the tool-call parser after it.
struct ForcedToolCall {
  std::string opening;
  std::string closing;
  std::string arguments_key;
};
ForcedToolCall ForcedToolCallFormat(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return {"<tool_call>\n", "\n</tool_call>", "arguments"};
    case ToolCallFormat::kLlama3Json:
      return {"", "", "parameters"};
    case ToolCallFormat::kMistral:
      return {"[TOOL_CALLS][", "]", "arguments"};
    case ToolCallFormat::kNone:
      break;
  }
  return {};
}

// The JSON Schema of a forced call: anyOf over the allowed tools (all for
// required, the named one), each {"name": const, key: parameters}.
std::string ForcedToolCallSchema(const CompletionRequest& request, const std::string& key) {
  ojson any = ojson::array();
  for (size_t i = 0; i < request.tool_names.size(); ++i) {
    if (request.tool_choice == ToolChoice::kNamed && request.tool_names[i] != request.named_tool) {
      continue;
    }
    ojson params = ojson{{"type", "object"}};
    if (i < request.tool_parameters.size() && !request.tool_parameters[i].empty()) {
      params = ojson::parse(request.tool_parameters[i], nullptr, /*allow_exceptions=*/false);
      if (params.is_discarded()) params = ojson{{"type", "object"}};
    }
    ojson call = {{"type", "object"},
                  {"properties", {{"name", {{"const", request.tool_names[i]}}}, {key, params}}},
                  {"required", {"name", key}},
                  {"additionalProperties", false}};
    any.push_back(std::move(call));
  }
  if (any.size() == 1) return any[0].dump();
  return ojson{{"anyOf", any}}.dump();
}

// `bytes` as logprobs' `token`: the text when it is valid UTF-8, else
// vLLM's "bytes:\xNN..." form.
std::string TokenString(const std::string& bytes) {
  if (internal::IsValidUtf8(bytes)) return bytes;
  std::string out = "bytes:";
  for (unsigned char c : bytes) absl::StrAppendFormat(&out, "\\x%02x", c);
  return out;
}

}  // namespace

struct CompletionSession::State {
  Engine* engine = nullptr;
  const Tokenizer* tokenizer = nullptr;
  CompletionRequest request;
  SessionOptions options;
  std::string id;
  int64_t created = 0;
  std::shared_ptr<Inbox> inbox = std::make_shared<Inbox>();

  struct Choice {
    int index = 0;
    int prompt_index = 0;
    std::string request_id;
    bool live = false;         // submitted and not ended
    bool ended = false;
    bool role_sent = false;
    std::optional<ReasoningParser> reasoning;
    std::optional<ToolCallParser> tools;
    std::string echo;          // completions: the prompt text before the output
    std::string pending;       // a forced tool call's opening, fed to the parser with the first text
    std::string closing;       // a forced tool call's closing, fed once its constraint is complete
    // Accumulated (non-stream response; also the usage).
    std::string content;
    std::string reasoning_text;
    std::vector<ToolCall> calls;
    std::vector<uint32_t> token_ids;
    ojson logprobs_content = ojson::array();    // chat
    ojson legacy_tokens = ojson::array();       // completions
    ojson legacy_token_logprobs = ojson::array();
    ojson legacy_top = ojson::array();
    ojson legacy_offsets = ojson::array();
    size_t text_offset = 0;
    uint32_t prompt_tokens = 0;
    uint32_t completion_tokens = 0;
    uint32_t cached_tokens = 0;
    uint32_t reasoning_tokens = 0;
    std::string finish_reason;
    ojson stop_reason = nullptr;
    std::optional<ApiError> error;
  };
  std::vector<Choice> choices;
  std::vector<std::string> request_ids;
  bool done_sent = false;
  std::optional<ApiError> stream_error;  // sent once, then [DONE]

  ojson ChunkHeader() const {
    ojson j = {{"id", id},
               {"object", request.chat ? "chat.completion.chunk" : "text_completion"},
               {"created", created},
               {"model", options.model_name}};
    if (!options.system_fingerprint.empty()) j["system_fingerprint"] = options.system_fingerprint;
    return j;
  }

  // The logprobs entries of one chunk, appended to `choice`'s totals;
  // returns the chunk's own part (chat: {"content": [...]}, completions:
  // the legacy arrays), or null when logprobs were not asked for.
  ojson Logprobs(Choice& c, const v1::GenerateStreamChunk& chunk, const std::string& text) {
    if (!request.logprobs) return nullptr;
    auto token_bytes = [&](uint32_t id) -> std::string {
      if (tokenizer == nullptr) return absl::StrCat("token_id:", id);
      absl::StatusOr<std::string> b = tokenizer->TokenBytes(static_cast<int32_t>(id));
      return b.ok() ? *b : absl::StrCat("token_id:", id);
    };
    auto bytes_array = [](const std::string& b) {
      ojson a = ojson::array();
      for (unsigned char ch : b) a.push_back(static_cast<int>(ch));
      return a;
    };
    if (request.chat) {
      ojson content = ojson::array();
      for (int i = 0; i < chunk.token_ids_size(); ++i) {
        const std::string b = token_bytes(chunk.token_ids(i));
        ojson entry = {{"token", TokenString(b)},
                       {"logprob", i < chunk.logprobs_size() ? chunk.logprobs(i) : 0.0f},
                       {"bytes", bytes_array(b)},
                       {"top_logprobs", ojson::array()}};
        if (i < chunk.top_logprobs_size()) {
          const v1::TopLogprobs& top = chunk.top_logprobs(i);
          for (int k = 0; k < top.token_ids_size() && k < request.top_logprobs; ++k) {
            const std::string tb = token_bytes(top.token_ids(k));
            entry["top_logprobs"].push_back({{"token", TokenString(tb)},
                                             {"logprob", k < top.logprobs_size() ? top.logprobs(k) : 0.0f},
                                             {"bytes", bytes_array(tb)}});
          }
        }
        content.push_back(entry);
        c.logprobs_content.push_back(std::move(entry));
      }
      return ojson{{"content", std::move(content)}};
    }
    ojson tokens = ojson::array(), lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
    size_t offset = c.text_offset;
    for (int i = 0; i < chunk.token_ids_size(); ++i) {
      const std::string t = TokenString(token_bytes(chunk.token_ids(i)));
      tokens.push_back(t);
      lps.push_back(i < chunk.logprobs_size() ? chunk.logprobs(i) : 0.0f);
      ojson top = ojson::object();
      if (i < chunk.top_logprobs_size()) {
        const v1::TopLogprobs& tl = chunk.top_logprobs(i);
        for (int k = 0; k < tl.token_ids_size() && k < request.top_logprobs; ++k) {
          top[TokenString(token_bytes(tl.token_ids(k)))] = k < tl.logprobs_size() ? tl.logprobs(k) : 0.0f;
        }
      }
      tops.push_back(request.top_logprobs > 0 ? top : ojson(nullptr));
      offsets.push_back(offset);
      offset += t.size();
    }
    c.text_offset += text.size();
    for (auto& x : tokens) c.legacy_tokens.push_back(x);
    for (auto& x : lps) c.legacy_token_logprobs.push_back(x);
    for (auto& x : tops) c.legacy_top.push_back(x);
    for (auto& x : offsets) c.legacy_offsets.push_back(x);
    return ojson{{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  // Splits new output text into reasoning, content and tool-call deltas
  // (also accumulated into `c`); `final` flushes the parsers.
  struct Split {
    std::string content;
    std::string reasoning;
    std::vector<ToolCallDelta> calls;
  };
  Split SplitText(Choice& c, const std::string& text, bool final) {
    Split s;
    std::string content_part;
    std::string input = std::move(c.pending);
    c.pending.clear();
    input += text;
    if (c.reasoning) {
      ReasoningSplit r = c.reasoning->Feed(input);
      s.reasoning = std::move(r.reasoning);
      content_part = std::move(r.content);
      if (final) {
        ReasoningSplit f = c.reasoning->Finish();
        s.reasoning += f.reasoning;
        content_part += f.content;
      }
    } else {
      content_part = std::move(input);
    }
    if (c.tools) {
      ParsedOutput p = c.tools->Feed(content_part);
      s.content = std::move(p.content);
      s.calls = std::move(p.tool_calls);
      if (final) {
        ParsedOutput f = c.tools->Finish();
        s.content += f.content;
        for (auto& d : f.tool_calls) s.calls.push_back(std::move(d));
      }
      if (!request.parallel_tool_calls) {
        std::erase_if(s.calls, [](const ToolCallDelta& d) { return d.index > 0; });
      }
    } else {
      s.content = std::move(content_part);
    }
    c.reasoning_text += s.reasoning;
    c.content += s.content;
    for (const ToolCallDelta& d : s.calls) {
      if (d.index >= static_cast<int>(c.calls.size())) c.calls.resize(d.index + 1);
      ToolCall& call = c.calls[d.index];
      if (d.id) call.id = *d.id;
      if (d.name) call.name = *d.name;
      call.arguments += d.arguments;
    }
    return s;
  }

  // One streamed chunk of choice `c` (nothing when everything is empty).
  void EmitChunk(Choice& c, const Split& s, const ojson& logprobs, const std::string& finish,
                 std::string* sse, const v1::GenerateStreamChunk* chunk = nullptr) {
    if (!request.stream) return;
    ojson choice = {{"index", c.index}};
    const bool ids = request.return_token_ids && chunk != nullptr && chunk->token_ids_size() > 0;
    if (request.chat) {
      ojson delta = ojson::object();
      if (!s.reasoning.empty()) {
        delta["reasoning_content"] = s.reasoning;
        delta["reasoning"] = s.reasoning;
      }
      if (!s.content.empty()) delta["content"] = s.content;
      if (!s.calls.empty()) {
        ojson calls = ojson::array();
        for (const ToolCallDelta& d : s.calls) {
          ojson call = {{"index", d.index}};
          if (d.id) {
            call["id"] = *d.id;
            call["type"] = "function";
          }
          ojson fn = ojson::object();
          if (d.name) fn["name"] = *d.name;
          if (d.id || !d.arguments.empty()) fn["arguments"] = d.arguments;
          call["function"] = std::move(fn);
          calls.push_back(std::move(call));
        }
        delta["tool_calls"] = std::move(calls);
      }
      if (delta.empty() && logprobs.is_null() && finish.empty() && !ids) return;
      choice["delta"] = std::move(delta);
    } else {
      if (s.content.empty() && logprobs.is_null() && finish.empty() && !ids) return;
      choice["text"] = s.content;
    }
    if (ids) choice["token_ids"] = std::vector<uint32_t>(chunk->token_ids().begin(), chunk->token_ids().end());
    choice["logprobs"] = logprobs;
    choice["finish_reason"] = finish.empty() ? ojson(nullptr) : ojson(finish);
    if (!finish.empty()) choice["stop_reason"] = c.stop_reason;
    ojson j = ChunkHeader();
    j["choices"] = ojson::array({std::move(choice)});
    absl::StrAppend(sse, "data: ", Dump(j), "\n\n");
  }

  void EmitRole(Choice& c, std::string* sse) {
    if (c.role_sent || !request.stream) return;
    c.role_sent = true;
    ojson choice = {{"index", c.index}};
    if (request.chat) {
      choice["delta"] = {{"role", "assistant"}, {"content", ""}};
    } else {
      if (c.echo.empty()) return;  // completions have no role chunk; echo goes first
      choice["text"] = c.echo;
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = nullptr;
    ojson j = ChunkHeader();
    j["choices"] = ojson::array({std::move(choice)});
    absl::StrAppend(sse, "data: ", Dump(j), "\n\n");
  }

  void OnResponse(Choice& c, const v1::GenerateResponse& r, std::string* sse) {
    if (c.ended) return;
    if (r.has_chunk()) {
      const v1::GenerateStreamChunk& chunk = r.chunk();
      const bool was_reasoning = c.reasoning && c.reasoning->in_reasoning();
      Split s = SplitText(c, chunk.text(), /*final=*/false);
      c.prompt_tokens = chunk.prompt_tokens();
      c.completion_tokens = chunk.completion_tokens();
      c.cached_tokens = chunk.cached_tokens();
      if (was_reasoning) c.reasoning_tokens += chunk.token_ids_size();
      c.token_ids.insert(c.token_ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      ojson lp = Logprobs(c, chunk, s.content);
      EmitChunk(c, s, lp, "", sse, &chunk);
      return;
    }
    c.ended = true;
    c.live = false;
    if (r.has_error()) {
      ApiError e;
      e.message = r.error().message();
      e.type = "server_error";
      switch (r.error().code()) {
        case 14:  // UNAVAILABLE: the rank group broke and did not come back in time
          e.status = 503;
          e.type = "service_unavailable_error";
          e.retry_after_seconds = 5;
          break;
        case 4:  // DEADLINE_EXCEEDED
          e.status = 504;
          e.code = "deadline_exceeded";
          break;
        case 3:  // INVALID_ARGUMENT: the request cannot be served as asked (e.g.
                 // the vocabulary cannot write its constraint)
          e.status = 400;
          e.type = "invalid_request_error";
          break;
        default:
          e.status = 500;
      }
      c.error = e;
      return;
    }
    const v1::GenerateComplete& done = r.complete();
    c.prompt_tokens = done.prompt_tokens();
    c.completion_tokens = done.completion_tokens();
    c.cached_tokens = done.cached_tokens();
    switch (done.finish_reason()) {
      case v1::FINISH_REASON_LENGTH:
        c.finish_reason = "length";
        break;
      case v1::FINISH_REASON_ABORT: {
        ApiError e;
        e.status = 503;
        e.type = "service_unavailable_error";
        e.code = "aborted";
        e.retry_after_seconds = 1;
        e.message = "the request was aborted (the server is shutting down, or an operator aborted it)";
        c.error = e;
        return;
      }
      case v1::FINISH_REASON_STOP_STRING:
        c.finish_reason = "stop";
        c.stop_reason = done.matched_stop();
        break;
      default:
        c.finish_reason = "stop";
    }
    // A forced tool call's object is complete: its closing marker ends it.
    const bool closes = done.finish_reason() == v1::FINISH_REASON_CONSTRAINT_COMPLETE;
    Split s = SplitText(c, closes ? c.closing : "", /*final=*/true);
    // vLLM keeps "stop" for a named tool choice.
    if (!c.calls.empty() && request.tool_choice != ToolChoice::kNamed) c.finish_reason = "tool_calls";
    EmitChunk(c, s, nullptr, c.finish_reason, sse);
  }

  bool AllEnded() const {
    for (const Choice& c : choices) {
      if (!c.ended) return false;
    }
    return true;
  }

  const ApiError* FirstError() const {
    for (const Choice& c : choices) {
      if (c.error) return &*c.error;
    }
    return nullptr;
  }

  ojson Usage() const {
    uint32_t prompt = 0, completion = 0, cached = 0, reasoning = 0;
    std::vector<bool> counted(request.prompts.size(), false);
    for (const Choice& c : choices) {
      if (!counted[c.prompt_index]) {  // a prompt counts once, however many choices
        counted[c.prompt_index] = true;
        prompt += c.prompt_tokens;
        cached += c.cached_tokens;
      }
      completion += c.completion_tokens;
      reasoning += c.reasoning_tokens;
    }
    ojson u = {{"prompt_tokens", prompt},
               {"completion_tokens", completion},
               {"total_tokens", prompt + completion},
               {"prompt_tokens_details", {{"cached_tokens", cached}}}};
    if (request.chat) u["completion_tokens_details"] = {{"reasoning_tokens", reasoning}};
    return u;
  }

  void AbortLive(const std::string& reason) {
    std::vector<std::string> live;
    for (Choice& c : choices) {
      if (c.live) live.push_back(c.request_id);
    }
    if (!live.empty()) engine->Abort(live, reason);
  }
};

std::string NewResponseId(std::string_view prefix) {
  return absl::StrFormat("%s%016x%08x", std::string(prefix), RandomWord(), static_cast<uint32_t>(RandomWord()));
}

CompletionSession::CompletionSession(std::unique_ptr<State> state) : state_(std::move(state)) {}

CompletionSession::~CompletionSession() { Abort("the client went away"); }

void CompletionSession::Abort(const std::string& reason) {
  state_->AbortLive(reason);
  for (State::Choice& c : state_->choices) c.live = false;
}

const std::vector<std::string>& CompletionSession::request_ids() const { return state_->request_ids; }
bool CompletionSession::streaming() const { return state_->request.stream; }

std::variant<std::unique_ptr<CompletionSession>, ApiError> CompletionSession::Start(
    Engine& engine, const CompletionRequest& request, const SessionOptions& options) {
  auto state = std::make_unique<State>();
  State& s = *state;
  s.engine = &engine;
  s.tokenizer = engine.tokenizer();
  s.request = request;
  s.options = options;
  s.id = !options.request_id.empty() ? options.request_id
                                     : NewResponseId(request.chat ? "chatcmpl-" : "cmpl-");
  s.created = options.created_unix != 0 ? options.created_unix : absl::ToUnixSeconds(absl::Now());
  if (request.echo && request.logprobs) {
    return BadRequest("echo", "echo with logprobs needs prompt logprobs, which this server does not compute");
  }
  if (!engine.AdmitsRequests()) {
    ApiError e;
    e.status = 429;
    e.type = "rate_limit_error";
    e.message = "the server's queue is full; retry later";
    e.retry_after_seconds = 1;
    return e;
  }

  // The engine requests: chat is rendered here (the prompt text decides
  // whether the output starts inside a think block, and a forced tool call
  // extends it), then sent as text without added special tokens, which is
  // exactly what the engine does with chat input.
  std::vector<v1::GenerateRequest> prompts = request.prompts;
  std::string forced_prefix;
  std::string forced_closing;
  std::optional<v1::OutputConstraint> forced_constraint;
  bool starts_in_reasoning = false;
  if (request.chat) {
    if (request.tool_choice != ToolChoice::kNone && options.tool_format == ToolCallFormat::kNone) {
      return BadRequest("tools", "this model's chat template has no tool-call format this server "
                                 "parses (Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS])");
    }
    if (request.tool_choice == ToolChoice::kRequired || request.tool_choice == ToolChoice::kNamed) {
      if (prompts[0].has_constraint()) {
        return BadRequest("tool_choice", "a forced tool call (required or named) is constrained to the "
                                         "tool's parameters; it cannot be combined with response_format "
                                         "or guided_* fields");
      }
      const ForcedToolCall call = ForcedToolCallFormat(options.tool_format);
      forced_prefix = call.opening;
      forced_closing = call.closing;
      forced_constraint.emplace();
      forced_constraint->set_json_schema(ForcedToolCallSchema(request, call.arguments_key));
    }
    absl::StatusOr<std::string> rendered = engine.RenderChat(prompts[0].chat());
    if (!rendered.ok()) {
      std::string param = "messages";
      const std::string msg(rendered.status().message());
      if (absl::StrContains(msg, "tools_json")) param = "tools";
      if (rendered.status().code() == absl::StatusCode::kInvalidArgument) return BadRequest(param, msg);
      ApiError e;
      e.status = 500;
      e.type = "server_error";
      e.message = msg;
      return e;
    }
    starts_in_reasoning = options.reasoning && forced_prefix.empty() && PromptOpensReasoning(*rendered);
    v1::SamplingParams sampling = prompts[0].sampling_params();
    std::optional<v1::OutputConstraint> constraint = forced_constraint;
    if (prompts[0].has_constraint()) constraint = prompts[0].constraint();
    prompts[0].Clear();
    prompts[0].set_text(*rendered + forced_prefix);
    prompts[0].set_add_special_tokens(false);
    *prompts[0].mutable_sampling_params() = sampling;
    if (constraint) *prompts[0].mutable_constraint() = std::move(*constraint);
  }

  for (size_t p = 0; p < prompts.size(); ++p) {
    std::string echo;
    if (request.echo) {
      if (prompts[p].has_tokenized()) {
        if (s.tokenizer == nullptr) return BadRequest("echo", "the model has no tokenizer to show the prompt");
        std::vector<int32_t> ids(prompts[p].tokenized().input_ids().begin(),
                                 prompts[p].tokenized().input_ids().end());
        absl::StatusOr<std::string> text = s.tokenizer->Decode(ids);
        if (!text.ok()) return BadRequest(absl::StrCat("prompt"), std::string(text.status().message()));
        echo = *text;
      } else {
        echo = prompts[p].text();
      }
    }
    for (int j = 0; j < request.n; ++j) {
      State::Choice c;
      c.index = static_cast<int>(p) * request.n + j;
      c.prompt_index = static_cast<int>(p);
      c.request_id = request.n * prompts.size() == 1 ? s.id : absl::StrCat(s.id, "-", c.index);
      c.echo = echo;
      c.content = echo;
      c.text_offset = echo.size();
      c.pending = forced_prefix;
      c.closing = forced_closing;
      if (request.chat && options.reasoning && forced_prefix.empty()) c.reasoning.emplace(starts_in_reasoning);
      if (request.chat && request.tool_choice != ToolChoice::kNone) {
        c.tools.emplace(options.tool_format, RandomWord());
      }
      s.choices.push_back(std::move(c));
    }
  }

  for (State::Choice& c : s.choices) {
    v1::GenerateRequest g = prompts[c.prompt_index];
    g.set_request_id(c.request_id);
    // Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens:
    // the parser must see them in the text.
    const bool marker_is_special = request.chat && request.tool_choice != ToolChoice::kNone &&
                                   (options.tool_format == ToolCallFormat::kMistral ||
                                    options.tool_format == ToolCallFormat::kLlama3Json);
    g.set_skip_special_tokens(request.skip_special_tokens && !marker_is_special);
    const int j = c.index % request.n;
    if (j > 0 && g.sampling_params().has_seed()) {
      g.mutable_sampling_params()->set_seed(g.sampling_params().seed() + j);
    }
    const int index = c.index;
    std::shared_ptr<Inbox> inbox = s.inbox;
    absl::Status submitted = engine.Submit(g, [inbox, index](const v1::GenerateResponse& r) {
      absl::MutexLock lock(&inbox->mu);
      inbox->queue.emplace_back(index, r);
    });
    if (!submitted.ok()) {
      s.AbortLive("another choice of the request was refused");
      ApiError e;
      const std::string msg(submitted.message());
      switch (submitted.code()) {
        case absl::StatusCode::kInvalidArgument:
          e = BadRequest("", msg);
          if (absl::StrContains(msg, "the context holds") || absl::StrContains(msg, "exceeds the context")) {
            e.code = "context_length_exceeded";
            e.param = absl::StrContains(msg, "max_tokens") ? "max_tokens" : "messages";
            if (!request.chat && e.param == "messages") e.param = "prompt";
          }
          break;
        case absl::StatusCode::kResourceExhausted:
          e.status = 429;
          e.type = "rate_limit_error";
          e.message = msg;
          e.retry_after_seconds = 1;
          break;
        case absl::StatusCode::kUnavailable:
          e.status = 503;
          e.type = "service_unavailable_error";
          e.message = msg;
          e.retry_after_seconds = 5;
          break;
        default:
          e.status = 500;
          e.type = "server_error";
          e.message = msg;
      }
      return e;
    }
    c.live = true;
    s.request_ids.push_back(c.request_id);
  }
  return std::unique_ptr<CompletionSession>(new CompletionSession(std::move(state)));
}

bool CompletionSession::Pump(absl::Duration timeout, std::string* sse) {
  State& s = *state_;
  if (s.done_sent) return true;
  for (State::Choice& c : s.choices) s.EmitRole(c, sse);
  std::deque<std::pair<int, v1::GenerateResponse>> batch;
  {
    absl::MutexLock lock(&s.inbox->mu);
    auto has_any = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.inbox->mu) { return !s.inbox->queue.empty(); };
    s.inbox->mu.AwaitWithTimeout(absl::Condition(&has_any), timeout);
    batch.swap(s.inbox->queue);
  }
  for (auto& [index, response] : batch) {
    State::Choice& c = s.choices[index];
    s.OnResponse(c, response, sse);
    if (c.error && s.request.stream && !s.stream_error) {
      s.stream_error = c.error;
      s.AbortLive("another choice of the request failed");
      for (State::Choice& other : s.choices) {
        other.live = false;
        other.ended = true;
      }
      absl::StrAppend(sse, "data: ", ErrorJson(*c.error), "\n\n");
      break;
    }
  }
  if (!s.AllEnded()) return false;
  if (s.request.stream) {
    if (s.request.include_usage && !s.stream_error) {
      ojson j = s.ChunkHeader();
      j["choices"] = ojson::array();
      j["usage"] = s.Usage();
      absl::StrAppend(sse, "data: ", Dump(j), "\n\n");
    }
    absl::StrAppend(sse, "data: [DONE]\n\n");
  }
  s.done_sent = true;
  return true;
}

std::variant<std::string, ApiError> CompletionSession::Result() const {
  const State& s = *state_;
  if (const ApiError* e = s.FirstError()) return *e;
  ojson j = {{"id", s.id},
             {"object", s.request.chat ? "chat.completion" : "text_completion"},
             {"created", s.created},
             {"model", s.options.model_name}};
  if (!s.options.system_fingerprint.empty()) j["system_fingerprint"] = s.options.system_fingerprint;
  ojson choices = ojson::array();
  for (const State::Choice& c : s.choices) {
    ojson choice = {{"index", c.index}};
    if (s.request.chat) {
      ojson message = {{"role", "assistant"}};
      message["content"] = c.content.empty() && !c.calls.empty() ? ojson(nullptr) : ojson(c.content);
      if (!c.reasoning_text.empty()) {
        message["reasoning_content"] = c.reasoning_text;
        message["reasoning"] = c.reasoning_text;
      }
      if (!c.calls.empty()) {
        ojson calls = ojson::array();
        for (const ToolCall& call : c.calls) {
          calls.push_back({{"id", call.id},
                           {"type", "function"},
                           {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
        }
        message["tool_calls"] = std::move(calls);
      }
      choice["message"] = std::move(message);
      choice["logprobs"] = s.request.logprobs ? ojson{{"content", c.logprobs_content}} : ojson(nullptr);
    } else {
      choice["text"] = c.content;
      choice["logprobs"] = s.request.logprobs ? ojson{{"tokens", c.legacy_tokens},
                                                      {"token_logprobs", c.legacy_token_logprobs},
                                                      {"top_logprobs", c.legacy_top},
                                                      {"text_offset", c.legacy_offsets}}
                                              : ojson(nullptr);
    }
    choice["finish_reason"] = c.finish_reason;
    choice["stop_reason"] = c.stop_reason;
    if (s.request.return_token_ids) choice["token_ids"] = c.token_ids;
    choices.push_back(std::move(choice));
  }
  j["choices"] = std::move(choices);
  j["usage"] = s.Usage();
  return Dump(j);
}

}  // namespace exl3serve::coordinator::http
