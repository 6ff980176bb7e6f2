#include "coordinator/http/openai_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_depth.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::http {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// Parse-time failure: unwinds the parser to the entry point (internal only;
// the public functions catch it and return the ApiError).
struct Refusal {
  ApiError error;
};

[[noreturn]] void Refuse(std::string param, std::string message) {
  throw Refusal{BadRequest(std::move(param), std::move(message))};
}

std::string TypeName(const ojson& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

// 400 naming `param` (+ the path inside it) when `text` nests deeper than
// kMaxJsonDepth: checked before anything is parsed, so no code path (copies,
// dump(), the chat template's conversion, all recursive) ever sees a deeper
// value.
void RefuseDeepJson(std::string_view text, std::string_view param) {
  if (std::optional<JsonDepthExcess> deep = FindJsonNestingBeyond(text, kMaxJsonDepth)) {
    Refuse(JoinJsonPath(param, deep->path),
           absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels of arrays and objects (the limit for any "
                        "JSON value in a request)"));
  }
}

ojson ParseBody(std::string_view body) {
  RefuseDeepJson(body, "");
  ojson doc = ojson::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) Refuse("", "the request body is not valid JSON");
  if (!doc.is_object()) Refuse("", "the request body must be a JSON object, got " + TypeName(doc));
  return doc;
}

// Reads the fields of one JSON object by name, checking types; remembers
// which keys were read so Finish() can refuse the rest by name.
class Fields {
 public:
  Fields(const ojson& object, std::string path) : object_(object), path_(std::move(path)) {}

  std::string Path(std::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", std::string(key));
  }
  // The value, or nullptr when absent or null.
  const ojson* Get(std::string_view key) {
    read_.insert(std::string(key));
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  void Ignore(std::string_view key) { read_.insert(std::string(key)); }

  std::optional<bool> Bool(std::string_view key) {
    const ojson* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) Refuse(Path(key), "must be a boolean, got " + TypeName(*v));
    return v->get<bool>();
  }
  std::optional<double> Number(std::string_view key, double lo, double hi) {
    const ojson* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) Refuse(Path(key), "must be a number, got " + TypeName(*v));
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) {
      Refuse(Path(key), absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    }
    return x;
  }
  std::optional<int64_t> Int(std::string_view key, int64_t lo, int64_t hi) {
    const ojson* v = Get(key);
    if (v == nullptr) return std::nullopt;
    return IntValue(*v, Path(key), lo, hi);
  }
  std::optional<std::string> String(std::string_view key) {
    const ojson* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) Refuse(Path(key), "must be a string, got " + TypeName(*v));
    return v->get<std::string>();
  }

  static int64_t IntValue(const ojson& v, const std::string& path, int64_t lo, int64_t hi) {
    int64_t x = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
        Refuse(path, absl::StrCat("must be at most ", hi, ", got ", v.get<uint64_t>()));
      }
      x = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e15) {
        Refuse(path, absl::StrCat("must be an integer, got ", d));
      }
      x = static_cast<int64_t>(d);
    } else {
      Refuse(path, "must be an integer, got " + TypeName(v));
    }
    if (x < lo || x > hi) Refuse(path, absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    return x;
  }

  // Refuses the first key that was not read: a parameter this server does
  // not implement is an error, never silently dropped.
  void Finish() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (read_.count(it.key()) == 0) {
        // (The name is in the param, which BadRequest cuts to a bounded length.)
        Refuse(Path(it.key()), "unsupported parameter: this server does not implement it");
      }
    }
  }

 private:
  const ojson& object_;
  const std::string path_;
  std::set<std::string, std::less<>> read_;
};

// Fields every client may send that have no meaning for generation.
void IgnoreClientMetadata(Fields& f) {
  f.Ignore("user");
  f.Ignore("metadata");
  f.Ignore("store");
}

// The sampling fields shared by chat and completions.
void ParseSampling(Fields& f, v1::SamplingParams* s) {
  if (auto t = f.Number("temperature", 0, 2)) s->set_temperature(static_cast<float>(*t));
  if (auto p = f.Number("top_p", 0, 1)) {
    if (*p == 0) Refuse("top_p", "must be in (0, 1], got 0");
    s->set_top_p(static_cast<float>(*p));
  }
  if (auto k = f.Int("top_k", -1, 1 << 30)) s->set_top_k(*k < 0 ? 0 : static_cast<int32_t>(*k));
  if (auto m = f.Number("min_p", 0, 1)) s->set_min_p(static_cast<float>(*m));
  std::optional<double> rep = f.Number("repetition_penalty", 0, 10);
  if (auto r2 = f.Number("repeat_penalty", 0, 10)) {  // llama.cpp's name
    if (rep) Refuse("repeat_penalty", "give repetition_penalty or repeat_penalty, not both");
    rep = r2;
  }
  if (rep) {
    if (*rep == 0) Refuse("repetition_penalty", "must be > 0");
    s->set_repetition_penalty(static_cast<float>(*rep));
  }
  if (auto p = f.Number("presence_penalty", -2, 2)) s->set_presence_penalty(static_cast<float>(*p));
  if (auto p = f.Number("frequency_penalty", -2, 2)) s->set_frequency_penalty(static_cast<float>(*p));
  if (const ojson* bias = f.Get("logit_bias")) {
    if (!bias->is_object()) Refuse("logit_bias", "must be an object of token id -> bias, got " + TypeName(*bias));
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      const std::string param = absl::StrCat("logit_bias.", it.key());
      uint32_t id = 0;
      const std::string& key = it.key();
      if (key.empty() || key.size() > 9 || !std::all_of(key.begin(), key.end(), [](char c) {
            return c >= '0' && c <= '9';
          })) {
        Refuse(param, "keys must be token ids (decimal integers)");
      }
      id = static_cast<uint32_t>(std::stoul(key));
      if (!it->is_number()) Refuse(param, "must be a number, got " + TypeName(*it));
      const double b = it->get<double>();
      if (!std::isfinite(b) || b < -100 || b > 100) {
        Refuse(param, absl::StrCat("must be in [-100, 100], got ", b));
      }
      (*s->mutable_logit_bias())[id] = static_cast<float>(b);
    }
  }
  if (const ojson* seed = f.Get("seed")) {
    const int64_t x = Fields::IntValue(*seed, "seed", std::numeric_limits<int64_t>::min(),
                                       std::numeric_limits<int64_t>::max());
    s->set_seed(static_cast<uint64_t>(x));
  }
  if (const ojson* stop = f.Get("stop")) {
    if (stop->is_string()) {
      if (!stop->get<std::string>().empty()) s->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 64) Refuse("stop", "at most 64 stop strings");
      for (size_t i = 0; i < stop->size(); ++i) {
        const ojson& e = (*stop)[i];
        if (!e.is_string()) Refuse(absl::StrCat("stop[", i, "]"), "must be a string, got " + TypeName(e));
        if (e.get<std::string>().empty()) Refuse(absl::StrCat("stop[", i, "]"), "is empty");
        s->add_stop(e.get<std::string>());
      }
    } else {
      Refuse("stop", "must be a string or an array of strings, got " + TypeName(*stop));
    }
  }
  if (const ojson* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array()) Refuse("stop_token_ids", "must be an array of token ids, got " + TypeName(*ids));
    for (size_t i = 0; i < ids->size(); ++i) {
      s->add_stop_token_ids(static_cast<uint32_t>(
          Fields::IntValue((*ids)[i], absl::StrCat("stop_token_ids[", i, "]"), 0, INT32_MAX)));
    }
  }
  if (auto b = f.Bool("ignore_eos")) s->set_ignore_eos(*b);
  std::optional<int64_t> max_tokens = f.Int("max_tokens", 1, INT32_MAX);
  if (auto m = f.Int("max_completion_tokens", 1, INT32_MAX)) max_tokens = m;  // the newer name wins
  if (max_tokens) s->set_max_tokens(static_cast<int32_t>(*max_tokens));
  if (auto m = f.Int("min_tokens", 0, INT32_MAX); m && *m > 0) {
    Refuse("min_tokens", "is not supported (only 0)");
  }
}

void ParseStreamFlags(Fields& f, CompletionRequest* r) {
  r->stream = f.Bool("stream").value_or(false);
  if (const ojson* options = f.Get("stream_options")) {
    if (!options->is_object()) Refuse("stream_options", "must be an object, got " + TypeName(*options));
    if (!r->stream) Refuse("stream_options", "is only allowed when stream is true");
    Fields o(*options, "stream_options");
    r->include_usage = o.Bool("include_usage").value_or(false);
    if (o.Bool("continuous_usage_stats").value_or(false)) {
      Refuse("stream_options.continuous_usage_stats", "is not supported (usage comes in the final chunk)");
    }
    o.Finish();
  }
  if (auto n = f.Int("n", 1, kMaxChoices)) r->n = static_cast<int>(*n);
  if (auto b = f.Int("best_of", 1, kMaxChoices); b && *b != r->n) {
    Refuse("best_of", "is not supported (only best_of == n)");
  }
  r->skip_special_tokens = f.Bool("skip_special_tokens").value_or(true);
  r->return_token_ids = f.Bool("return_token_ids").value_or(false);
}

// Structured output: OpenAI's response_format and vLLM's guided_* extras
// (at most one of them) as the engine's OutputConstraint. A schema given as
// an object is passed on as its JSON text; the engine compiles and refuses
// unsupported keywords (400 naming the keyword).
std::optional<v1::OutputConstraint> ParseOutputConstraint(Fields& f) {
  std::optional<v1::OutputConstraint> out;
  std::string first;
  auto set = [&](const std::string& param) -> v1::OutputConstraint& {
    if (out) Refuse(param, absl::StrCat("cannot be combined with ", first, " (one constraint per request)"));
    first = param;
    out.emplace();
    return *out;
  };
  auto schema_text = [](const ojson& schema, const std::string& param) {
    if (schema.is_string()) {
      // vLLM accepts guided_json as a JSON string too.
      RefuseDeepJson(schema.get<std::string>(), param);
      ojson parsed = ojson::parse(schema.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded()) Refuse(param, "is a string that is not valid JSON");
      if (!parsed.is_object() && !parsed.is_boolean()) Refuse(param, "must be a JSON Schema object");
      return parsed.dump();
    }
    if (!schema.is_object() && !schema.is_boolean()) {
      Refuse(param, "must be a JSON Schema object, got " + TypeName(schema));
    }
    return schema.dump();
  };
  if (const ojson* format = f.Get("response_format")) {
    if (!format->is_object()) Refuse("response_format", "must be an object, got " + TypeName(*format));
    Fields rf(*format, "response_format");
    const std::string type = rf.String("type").value_or("text");
    if (type == "json_object") {
      set("response_format").set_json_schema(R"({"type":"object"})");
      // llama.cpp's optional schema beside json_object.
      if (const ojson* schema = rf.Get("schema")) {
        out->set_json_schema(schema_text(*schema, "response_format.schema"));
      }
    } else if (type == "json_schema") {
      const ojson* js = rf.Get("json_schema");
      if (js == nullptr || !js->is_object()) {
        Refuse("response_format.json_schema", "is required for type \"json_schema\" (an object "
                                              "with name and schema)");
      }
      Fields jf(*js, "response_format.json_schema");
      jf.String("name");
      jf.String("description");
      // strict or not, the schema is enforced (as vLLM does).
      jf.Bool("strict");
      const ojson* schema = jf.Get("schema");
      v1::OutputConstraint& c = set("response_format");
      c.set_json_schema(schema == nullptr ? "{}"
                                          : schema_text(*schema, "response_format.json_schema.schema"));
      jf.Finish();
    } else if (type != "text") {
      Refuse("response_format.type", absl::StrCat("must be \"text\", \"json_object\" or "
                                                  "\"json_schema\", got \"", type, "\""));
    }
    rf.Finish();
  }
  if (const ojson* schema = f.Get("guided_json")) {
    set("guided_json").set_json_schema(schema_text(*schema, "guided_json"));
  }
  if (const ojson* regex = f.Get("guided_regex")) {
    if (!regex->is_string()) Refuse("guided_regex", "must be a string, got " + TypeName(*regex));
    set("guided_regex").set_regex(regex->get<std::string>());
  }
  if (const ojson* choice = f.Get("guided_choice")) {
    if (!choice->is_array() || choice->empty()) {
      Refuse("guided_choice", "must be a non-empty array of strings");
    }
    v1::OutputConstraint& c = set("guided_choice");
    for (size_t i = 0; i < choice->size(); ++i) {
      const ojson& e = (*choice)[i];
      if (!e.is_string()) Refuse(absl::StrCat("guided_choice[", i, "]"), "must be a string, got " + TypeName(e));
      c.mutable_choice()->add_choices(e.get<std::string>());
    }
  }
  if (const ojson* grammar = f.Get("guided_grammar")) {
    if (!grammar->is_string()) Refuse("guided_grammar", "must be a string, got " + TypeName(*grammar));
    set("guided_grammar").set_grammar(grammar->get<std::string>());
  }
  for (const char* unsupported : {"guided_decoding_backend", "guided_whitespace_pattern",
                                  "structural_tag"}) {
    if (f.Get(unsupported) != nullptr) Refuse(unsupported, "is not supported");
  }
  return out;
}

// Text of a message's `content`: a string, or an array of text parts.
std::string ContentText(const ojson& content, const std::string& path) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) Refuse(path, "must be a string or an array of content parts, got " + TypeName(content));
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string part_path = absl::StrCat(path, "[", i, "]");
    const ojson& part = content[i];
    if (!part.is_object()) Refuse(part_path, "must be a content part object, got " + TypeName(part));
    Fields pf(part, part_path);
    const std::optional<std::string> type = pf.String("type");
    if (!type) Refuse(part_path + ".type", "is required");
    if (*type != "text") {
      Refuse(part_path + ".type",
             absl::StrCat("content parts of type \"", *type,
                          "\" are not supported: the model is text-only (send \"text\" parts)"));
    }
    const std::optional<std::string> t = pf.String("text");
    if (!t) Refuse(part_path + ".text", "is required");
    if (!text.empty()) text += "\n";
    text += *t;
    pf.Finish();
  }
  return text;
}

void ParseMessages(const ojson& messages, v1::ChatInput* chat) {
  if (!messages.is_array()) Refuse("messages", "must be an array of messages, got " + TypeName(messages));
  if (messages.empty()) Refuse("messages", "is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string path = absl::StrCat("messages[", i, "]");
    const ojson& m = messages[i];
    if (!m.is_object()) Refuse(path, "must be an object, got " + TypeName(m));
    Fields f(m, path);
    v1::ChatMessage* out = chat->add_messages();
    const std::optional<std::string> role = f.String("role");
    if (!role) Refuse(path + ".role", "is required");
    if (*role == "developer") {
      out->set_role("system");  // OpenAI's newer name for the system prompt
    } else if (*role == "system" || *role == "user" || *role == "assistant" || *role == "tool") {
      out->set_role(*role);
    } else {
      Refuse(path + ".role", absl::StrCat("must be system, developer, user, assistant or tool, got \"",
                                          *role, "\""));
    }
    if (const ojson* content = f.Get("content")) out->set_content(ContentText(*content, path + ".content"));
    if (auto name = f.String("name")) out->set_name(*name);
    std::optional<std::string> reasoning = f.String("reasoning_content");
    if (auto r = f.String("reasoning"); r && !reasoning) reasoning = r;
    if (reasoning) {
      if (*role != "assistant") Refuse(path + ".reasoning_content", "only assistant messages carry reasoning");
      out->set_reasoning_content(*reasoning);
    }
    if (auto id = f.String("tool_call_id")) {
      if (*role != "tool") Refuse(path + ".tool_call_id", "only tool messages answer a tool call");
      out->set_tool_call_id(*id);
    } else if (*role == "tool") {
      Refuse(path + ".tool_call_id", "is required for role tool");
    }
    if (const ojson* calls = f.Get("tool_calls")) {
      if (*role != "assistant") Refuse(path + ".tool_calls", "only assistant messages call tools");
      if (!calls->is_array()) Refuse(path + ".tool_calls", "must be an array, got " + TypeName(*calls));
      for (size_t k = 0; k < calls->size(); ++k) {
        const std::string cpath = absl::StrCat(path, ".tool_calls[", k, "]");
        const ojson& c = (*calls)[k];
        if (!c.is_object()) Refuse(cpath, "must be an object, got " + TypeName(c));
        Fields cf(c, cpath);
        v1::ToolCall* call = out->add_tool_calls();
        call->set_id(cf.String("id").value_or(""));
        const std::string type = cf.String("type").value_or("function");
        if (type != "function") Refuse(cpath + ".type", absl::StrCat("must be \"function\", got \"", type, "\""));
        call->set_type(type);
        const ojson* fn = cf.Get("function");
        if (fn == nullptr || !fn->is_object()) Refuse(cpath + ".function", "must be an object");
        Fields ff(*fn, cpath + ".function");
        const std::optional<std::string> name = ff.String("name");
        if (!name || name->empty()) Refuse(cpath + ".function.name", "is required");
        call->set_function_name(*name);
        if (const ojson* args = ff.Get("arguments")) {
          // A string per the API; an object is accepted as its JSON text.
          if (args->is_string()) RefuseDeepJson(args->get<std::string>(), cpath + ".function.arguments");
          call->set_arguments_json(args->is_string() ? args->get<std::string>() : args->dump());
        } else {
          call->set_arguments_json("{}");
        }
        ff.Finish();
        cf.Finish();
      }
    }
    if (!m.contains("content") && out->tool_calls_size() == 0 && *role != "assistant") {
      Refuse(path + ".content", "is required");
    }
    f.Finish();
  }
}

void ParseTools(Fields& f, CompletionRequest* r, v1::ChatInput* chat) {
  const ojson* tools = f.Get("tools");
  std::vector<std::string> names;
  if (tools != nullptr) {
    if (!tools->is_array()) Refuse("tools", "must be an array of tools, got " + TypeName(*tools));
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string path = absl::StrCat("tools[", i, "]");
      const ojson& t = (*tools)[i];
      if (!t.is_object()) Refuse(path, "must be an object, got " + TypeName(t));
      auto type = t.find("type");
      if (type == t.end() || !type->is_string() || *type != "function") {
        Refuse(path + ".type", "must be \"function\"");
      }
      auto fn = t.find("function");
      if (fn == t.end() || !fn->is_object()) Refuse(path + ".function", "must be an object");
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string() || name->get<std::string>().empty()) {
        Refuse(path + ".function.name", "is required");
      }
      if (auto params = fn->find("parameters"); params != fn->end() && !params->is_object() &&
                                                !params->is_null()) {
        Refuse(path + ".function.parameters", "must be a JSON Schema object");
      }
      const std::string n = name->get<std::string>();
      if (std::find(names.begin(), names.end(), n) != names.end()) {
        Refuse(path + ".function.name", absl::StrCat("\"", n, "\" is defined twice"));
      }
      names.push_back(n);
      auto params = fn->find("parameters");
      r->tool_parameters.push_back(params == fn->end() || params->is_null() ? std::string()
                                                                            : params->dump());
    }
  }
  ToolChoice choice = names.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (const ojson* tc = f.Get("tool_choice")) {
    if (tc->is_string()) {
      const std::string s = tc->get<std::string>();
      if (s == "none") {
        choice = ToolChoice::kNone;
      } else if (s == "auto" || s == "required") {
        if (names.empty()) Refuse("tool_choice", absl::StrCat("\"", s, "\" needs tools"));
        choice = s == "auto" ? ToolChoice::kAuto : ToolChoice::kRequired;
      } else {
        Refuse("tool_choice", absl::StrCat("must be \"none\", \"auto\", \"required\" or a named "
                                           "function, got \"", s, "\""));
      }
    } else if (tc->is_object()) {
      auto fn = tc->find("function");
      const ojson* name = nullptr;
      if (fn != tc->end() && fn->is_object()) {
        if (auto n = fn->find("name"); n != fn->end() && n->is_string()) name = &*n;
      }
      if (name == nullptr) Refuse("tool_choice.function.name", "is required for a named tool choice");
      r->named_tool = name->get<std::string>();
      if (std::find(names.begin(), names.end(), r->named_tool) == names.end()) {
        Refuse("tool_choice.function.name",
               absl::StrCat("\"", r->named_tool, "\" is not one of the request's tools"));
      }
      choice = ToolChoice::kNamed;
    } else {
      Refuse("tool_choice", "must be a string or an object, got " + TypeName(*tc));
    }
  }
  r->parallel_tool_calls = f.Bool("parallel_tool_calls").value_or(true);
  r->tool_choice = choice;
  r->tool_names = names;
  // tool_choice "none": the tools stay out of the prompt, so the model is
  // not invited to call them.
  if (tools != nullptr && choice != ToolChoice::kNone) chat->set_tools_json(tools->dump());
}

// The chat-only fields after messages and tools: template variables.
void ParseTemplateFields(Fields& f, v1::ChatInput* chat) {
  ojson kwargs = ojson::object();
  if (const ojson* k = f.Get("chat_template_kwargs")) {
    if (!k->is_object()) Refuse("chat_template_kwargs", "must be an object, got " + TypeName(*k));
    kwargs = *k;
  }
  if (auto effort = f.String("reasoning_effort")) {
    static const char* const kEfforts[] = {"none", "minimal", "low", "medium", "high"};
    if (std::find(std::begin(kEfforts), std::end(kEfforts), *effort) == std::end(kEfforts)) {
      Refuse("reasoning_effort", "must be none, minimal, low, medium or high");
    }
    kwargs["reasoning_effort"] = *effort;
  }
  if (!kwargs.empty()) chat->set_template_kwargs_json(kwargs.dump());
  const std::optional<bool> add = f.Bool("add_generation_prompt");
  const bool cont = f.Bool("continue_final_message").value_or(false);
  if (cont) {
    if (add.value_or(false)) {
      Refuse("continue_final_message", "excludes add_generation_prompt: set it to false");
    }
    chat->set_continue_final_message(true);
    chat->set_add_generation_prompt(false);
  } else if (add) {
    chat->set_add_generation_prompt(*add);
  }
}

template <typename T, typename F>
std::variant<T, ApiError> Guarded(F&& parse) {
  try {
    return parse();
  } catch (const Refusal& r) {
    return r.error;
  } catch (const std::exception& e) {  // nlohmann type errors we did not foresee
    return BadRequest("", absl::StrCat("malformed request: ", e.what()));
  }
}

}  // namespace

ApiError BadRequest(std::string param, std::string message) {
  // The param path echoes client keys (an unknown field may be megabytes
  // long): cut to 256 bytes at a UTF-8 boundary. Found by the fuzzer.
  constexpr size_t kMaxParamBytes = 256;
  if (param.size() > kMaxParamBytes) {
    size_t cut = kMaxParamBytes;
    while (cut > 0 && (static_cast<unsigned char>(param[cut]) & 0xC0) == 0x80) --cut;
    param.resize(cut);
    param += "...";
  }
  ApiError e;
  e.status = 400;
  e.param = std::move(param);
  e.message = e.param.empty() ? std::move(message) : absl::StrCat(e.param, ": ", message);
  return e;
}

std::string ErrorJson(const ApiError& error) {
  ojson body = {{"error",
                 {{"message", error.message},
                  {"type", error.type},
                  {"param", error.param.empty() ? ojson(nullptr) : ojson(error.param)},
                  {"code", error.code.empty() ? ojson(nullptr) : ojson(error.code)}}}};
  return body.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

std::variant<CompletionRequest, ApiError> ParseChatCompletionRequest(std::string_view body) {
  return Guarded<CompletionRequest>([&] {
    const ojson doc = ParseBody(body);
    Fields f(doc, "");
    IgnoreClientMetadata(f);
    CompletionRequest r;
    r.chat = true;
    r.model = f.String("model").value_or("");
    v1::GenerateRequest g;
    const ojson* messages = f.Get("messages");
    if (messages == nullptr) Refuse("messages", "is required");
    ParseMessages(*messages, g.mutable_chat());
    ParseSampling(f, g.mutable_sampling_params());
    if (auto constraint = ParseOutputConstraint(f)) *g.mutable_constraint() = std::move(*constraint);
    ParseStreamFlags(f, &r);
    r.logprobs = f.Bool("logprobs").value_or(false);
    if (auto k = f.Int("top_logprobs", 0, 20)) {
      if (*k > 0 && !r.logprobs) Refuse("top_logprobs", "needs logprobs: true");
      r.top_logprobs = static_cast<int>(*k);
    }
    ParseTools(f, &r, g.mutable_chat());
    ParseTemplateFields(f, g.mutable_chat());
    if (f.Get("functions") != nullptr || f.Get("function_call") != nullptr) {
      Refuse("functions", "the deprecated functions API is not supported; send tools");
    }
    if (f.Bool("echo").value_or(false)) Refuse("echo", "is only supported by /v1/completions");
    f.Finish();
    g.mutable_sampling_params()->set_logprobs(r.logprobs);
    g.mutable_sampling_params()->set_top_logprobs(r.top_logprobs);
    r.prompts.push_back(std::move(g));
    return r;
  });
}

std::variant<CompletionRequest, ApiError> ParseCompletionRequest(std::string_view body) {
  return Guarded<CompletionRequest>([&] {
    const ojson doc = ParseBody(body);
    Fields f(doc, "");
    IgnoreClientMetadata(f);
    CompletionRequest r;
    r.chat = false;
    r.model = f.String("model").value_or("");
    v1::GenerateRequest base;
    ParseSampling(f, base.mutable_sampling_params());
    if (auto constraint = ParseOutputConstraint(f)) *base.mutable_constraint() = std::move(*constraint);
    ParseStreamFlags(f, &r);
    if (auto k = f.Int("logprobs", 0, 20)) {  // the legacy API: alternatives per position
      r.logprobs = true;
      r.top_logprobs = static_cast<int>(*k);
    }
    r.echo = f.Bool("echo").value_or(false);
    if (auto suffix = f.String("suffix"); suffix && !suffix->empty()) {
      Refuse("suffix", "is not supported (no fill-in-the-middle)");
    }
    const bool add_special = f.Bool("add_special_tokens").value_or(true);
    base.mutable_sampling_params()->set_logprobs(r.logprobs);
    base.mutable_sampling_params()->set_top_logprobs(r.top_logprobs);
    base.set_add_special_tokens(add_special);
    const ojson* prompt = f.Get("prompt");
    if (prompt == nullptr) Refuse("prompt", "is required");
    auto add_text = [&](const ojson& text, const std::string& path) {
      if (text.get<std::string>().empty()) Refuse(path, "is empty");
      v1::GenerateRequest g = base;
      g.set_text(text.get<std::string>());
      r.prompts.push_back(std::move(g));
    };
    auto add_ids = [&](const ojson& ids, const std::string& path) {
      if (ids.empty()) Refuse(path, "is empty");
      v1::GenerateRequest g = base;
      for (size_t i = 0; i < ids.size(); ++i) {
        g.mutable_tokenized()->add_input_ids(static_cast<uint32_t>(
            Fields::IntValue(ids[i], absl::StrCat(path, "[", i, "]"), 0, INT32_MAX)));
      }
      r.prompts.push_back(std::move(g));
    };
    if (prompt->is_string()) {
      add_text(*prompt, "prompt");
    } else if (prompt->is_array()) {
      if (prompt->empty()) Refuse("prompt", "is empty");
      if ((*prompt)[0].is_number()) {
        add_ids(*prompt, "prompt");
      } else {
        if (prompt->size() > kMaxPrompts) Refuse("prompt", absl::StrCat("at most ", kMaxPrompts, " prompts"));
        for (size_t i = 0; i < prompt->size(); ++i) {
          const ojson& p = (*prompt)[i];
          const std::string path = absl::StrCat("prompt[", i, "]");
          if (p.is_string()) {
            add_text(p, path);
          } else if (p.is_array()) {
            add_ids(p, path);
          } else {
            Refuse(path, "must be a string or an array of token ids, got " + TypeName(p));
          }
        }
      }
    } else {
      Refuse("prompt", "must be a string, an array of strings, token ids or arrays of token ids, got " +
                           TypeName(*prompt));
    }
    if (static_cast<int64_t>(r.prompts.size()) * r.n > kMaxChoices) {
      Refuse("n", absl::StrCat("prompts x n must be at most ", kMaxChoices));
    }
    f.Finish();
    return r;
  });
}

std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body) {
  return Guarded<TokenizeRequest>([&] {
    const ojson doc = ParseBody(body);
    Fields f(doc, "");
    TokenizeRequest r;
    r.model = f.String("model").value_or("");
    r.return_token_strs = f.Bool("return_token_strs").value_or(false);
    const ojson* messages = f.Get("messages");
    const std::optional<std::string> prompt = f.String("prompt");
    if ((messages != nullptr) == prompt.has_value()) Refuse("prompt", "give exactly one of prompt and messages");
    if (messages != nullptr) {
      r.chat = true;
      ParseMessages(*messages, &r.messages);
      ParseTemplateFields(f, &r.messages);
      CompletionRequest unused;
      ParseTools(f, &unused, &r.messages);
      r.add_special_tokens = f.Bool("add_special_tokens").value_or(false);
    } else {
      r.prompt = *prompt;
      r.add_special_tokens = f.Bool("add_special_tokens").value_or(true);
    }
    f.Finish();
    return r;
  });
}

std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body) {
  return Guarded<DetokenizeRequest>([&] {
    const ojson doc = ParseBody(body);
    Fields f(doc, "");
    DetokenizeRequest r;
    r.model = f.String("model").value_or("");
    const ojson* tokens = f.Get("tokens");
    if (tokens == nullptr) Refuse("tokens", "is required");
    if (!tokens->is_array()) Refuse("tokens", "must be an array of token ids, got " + TypeName(*tokens));
    for (size_t i = 0; i < tokens->size(); ++i) {
      r.tokens.push_back(static_cast<int32_t>(
          Fields::IntValue((*tokens)[i], absl::StrCat("tokens[", i, "]"), 0, INT32_MAX)));
    }
    f.Finish();
    return r;
  });
}

}  // namespace exl3serve::coordinator::http
