#include "coordinator/http/tool_call_parser.h"

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator::http {
namespace {

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kLlamaPythonTag = "<|python_tag|>";
constexpr std::string_view kMistralToolCalls = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";

constexpr std::string_view kAlphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

// Mistral ids: 9 base-62 digits. x -> (x * kMistralIdMultiplier) mod 62^9 is a
// bijection (the multiplier is coprime to 2 and 31), so consecutive counters
// give distinct ids that do not look sequential.
constexpr uint64_t kMistralIdSpace = 13537086546263552ULL;  // 62^9
constexpr uint64_t kMistralIdMultiplier = 9876543210123457ULL;
static_assert(kMistralIdMultiplier % 2 == 1 && kMistralIdMultiplier % 31 != 0 &&
              kMistralIdMultiplier < kMistralIdSpace);

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

bool IsAlnum(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Bytes of a bare JSON number or literal (true, false, null).
bool IsPrimitiveChar(char c) { return IsAlnum(c) || c == '-' || c == '+' || c == '.'; }

// Bytes allowed in a Mistral `name[ARGS]` function name.
bool IsMistralNameChar(char c) {
  return IsAlnum(c) || c == '_' || c == '-' || c == '.' || c == ':' || c == '/';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Decodes the body of a JSON string (the text between the quotes). False on a
// malformed escape.
bool DecodeJsonString(std::string_view body, std::string* out) {
  out->clear();
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\') {
      out->push_back(c);
      continue;
    }
    if (++i == body.size()) return false;
    switch (body[i]) {
      case '"': out->push_back('"'); break;
      case '\\': out->push_back('\\'); break;
      case '/': out->push_back('/'); break;
      case 'b': out->push_back('\b'); break;
      case 'f': out->push_back('\f'); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      case 't': out->push_back('\t'); break;
      case 'u': {
        auto read_hex4 = [&](size_t at, uint32_t* value) {
          if (at + 4 > body.size()) return false;
          *value = 0;
          for (size_t k = 0; k < 4; ++k) {
            const int h = HexValue(body[at + k]);
            if (h < 0) return false;
            *value = (*value << 4) | static_cast<uint32_t>(h);
          }
          return true;
        };
        uint32_t cp = 0;
        if (!read_hex4(i + 1, &cp)) return false;
        i += 4;
        if (cp >= 0xD800 && cp < 0xDC00) {  // high surrogate: a low one must follow
          uint32_t low = 0;
          if (i + 2 >= body.size() || body[i + 1] != '\\' || body[i + 2] != 'u' ||
              !read_hex4(i + 3, &low) || low < 0xDC00 || low >= 0xE000) {
            return false;
          }
          i += 6;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        } else if (cp >= 0xDC00 && cp < 0xE000) {
          return false;
        }
        internal::AppendUtf8(static_cast<char32_t>(cp), out);
        break;
      }
      default:
        return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  if (lower == "none") return ToolCallFormat::kNone;
  if (lower == "hermes" || lower == "qwen" || lower == "qwen3") return ToolCallFormat::kHermes;
  if (lower == "llama3_json" || lower == "llama3") return ToolCallFormat::kLlama3Json;
  if (lower == "mistral") return ToolCallFormat::kMistral;
  return absl::InvalidArgumentError(
      "unknown tool call format \"" + std::string(name) +
      "\", expected one of: none, hermes (aliases qwen, qwen3), llama3_json (alias llama3), mistral");
}

std::string_view ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kNone: return "none";
    case ToolCallFormat::kHermes: return "hermes";
    case ToolCallFormat::kLlama3Json: return "llama3_json";
    case ToolCallFormat::kMistral: return "mistral";
  }
  return "none";
}

ToolCallFormat DetectToolCallFormat(std::string_view chat_template) {
  auto has = [&](std::string_view s) { return chat_template.find(s) != std::string_view::npos; };
  if (has(kHermesOpen)) return ToolCallFormat::kHermes;
  if (has(kMistralToolCalls)) return ToolCallFormat::kMistral;
  if (has(kLlamaPythonTag) || (has("<|eot_id|>") && has("parameters"))) return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kNone;
}

// ---------------------------------------------------------------------------
// ValueScanner

void ToolCallParser::ValueScanner::Reset() {
  started_ = false;
  in_string_ = false;
  escape_ = false;
  primitive_ = false;
  stack_.clear();
}

ToolCallParser::ValueScanner::Result ToolCallParser::ValueScanner::Push(char c) {
  if (!started_) {
    started_ = true;
    if (c == '{' || c == '[') {
      stack_.push_back(c);
      return Result::kMore;
    }
    if (c == '"') {
      in_string_ = true;
      return Result::kMore;
    }
    if (IsPrimitiveChar(c)) {
      primitive_ = true;
      return Result::kMore;
    }
    return Result::kInvalid;
  }
  if (in_string_) {
    if (escape_) {
      escape_ = false;
    } else if (c == '\\') {
      escape_ = true;
    } else if (c == '"') {
      in_string_ = false;
      if (stack_.empty()) return Result::kEndAfter;
    }
    return Result::kMore;
  }
  if (primitive_) return IsPrimitiveChar(c) ? Result::kMore : Result::kEndBefore;
  switch (c) {
    case '"':
      in_string_ = true;
      return Result::kMore;
    case '{':
    case '[':
      stack_.push_back(c);
      return Result::kMore;
    case '}':
    case ']':
      if (stack_.back() != (c == '}' ? '{' : '[')) return Result::kInvalid;
      stack_.pop_back();
      return stack_.empty() ? Result::kEndAfter : Result::kMore;
    default:
      return Result::kMore;
  }
}

// ---------------------------------------------------------------------------
// ToolCallParser

namespace {
std::string_view StartMarkerFor(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes: return kHermesOpen;
    case ToolCallFormat::kMistral: return kMistralToolCalls;
    default: return "";
  }
}
}  // namespace

ToolCallParser::ToolCallParser(ToolCallFormat format, uint64_t id_seed, std::string id_prefix)
    : format_(format),
      id_prefix_(std::move(id_prefix)),
      start_marker_(StartMarkerFor(format)),
      rng_state_(id_seed),
      state_(format == ToolCallFormat::kLlama3Json ? State::kLlamaStart : State::kContent) {
  uint64_t mistral_state = id_seed ^ 0x6D69737472616CULL;
  mistral_id_base_ = SplitMix64(&mistral_state) % kMistralIdSpace;
}

ParsedOutput ToolCallParser::Feed(std::string_view text) {
  if (finished_) return {};
  buf_.append(text);
  Run();
  return std::exchange(out_, ParsedOutput{});
}

ParsedOutput ToolCallParser::Finish() {
  if (finished_) return {};
  finished_ = true;
  Run();  // with finished_ set, every state consumes what is left
  EndOfInput();
  buf_.clear();
  pos_ = 0;
  return std::exchange(out_, ParsedOutput{});
}

void ToolCallParser::Run() {
  while (pos_ < buf_.size()) {
    if (!Step()) break;
  }
  buf_.erase(0, pos_);
  pos_ = 0;
}

ToolCallParser::MatchResult ToolCallParser::MatchAt(std::string_view marker) const {
  const std::string_view rest = std::string_view(buf_).substr(pos_);
  if (rest.size() >= marker.size()) {
    return rest.substr(0, marker.size()) == marker ? MatchResult::kYes : MatchResult::kNo;
  }
  if (marker.substr(0, rest.size()) == rest) return finished_ ? MatchResult::kNo : MatchResult::kMaybe;
  return MatchResult::kNo;
}

bool ToolCallParser::RecordsRaw() const {
  switch (state_) {
    case State::kObject: return !committed_;
    case State::kLlamaStart:
    case State::kMistralStart:
    case State::kMistralArrayFirst:
    case State::kMistralName: return true;
    default: return false;
  }
}

void ToolCallParser::Take(size_t n) {
  if (RecordsRaw()) raw_.append(buf_, pos_, n);
  pos_ += n;
}

void ToolCallParser::StartObject() {
  state_ = State::kObject;
  object_state_ = ObjectState::kOpen;
  committed_ = false;
  name_seen_ = false;
  arguments_key_seen_ = false;
  arguments_started_ = false;
  pending_arguments_.clear();
}

void ToolCallParser::Commit(std::string name) {
  committed_ = true;
  raw_.clear();
  ToolCallDelta delta;
  delta.index = num_calls_++;
  delta.id = NextId();
  delta.name = std::move(name);
  delta.arguments = std::move(pending_arguments_);
  pending_arguments_.clear();
  out_.tool_calls.push_back(std::move(delta));
}

void ToolCallParser::EndCall() {
  if (committed_ && !arguments_started_) EmitArguments("{}");
  committed_ = false;
  raw_.clear();
}

void ToolCallParser::Fail() {
  // The byte at pos_ is not consumed; it is looked at again as content.
  if (committed_) {
    EndCall();
  } else {
    EmitContent(raw_);
    raw_.clear();
    pending_arguments_.clear();
  }
  state_ = State::kContent;
}

void ToolCallParser::EndOfInput() {
  switch (state_) {
    case State::kObject:
    case State::kMistralArgsStart:
    case State::kMistralArgs:
      if (committed_) {
        EndCall();
        break;
      }
      [[fallthrough]];
    case State::kLlamaStart:
    case State::kMistralStart:
    case State::kMistralArrayFirst:
    case State::kMistralName:
      EmitContent(raw_);
      raw_.clear();
      break;
    default:
      break;
  }
}

void ToolCallParser::EmitContent(std::string_view text) { out_.content.append(text); }

void ToolCallParser::EmitArguments(std::string_view text) {
  if (text.empty()) return;
  const int index = num_calls_ - 1;
  if (!out_.tool_calls.empty() && out_.tool_calls.back().index == index) {
    out_.tool_calls.back().arguments.append(text);
    return;
  }
  ToolCallDelta delta;
  delta.index = index;
  delta.arguments = std::string(text);
  out_.tool_calls.push_back(std::move(delta));
}

void ToolCallParser::AppendArguments(char c) {
  arguments_started_ = true;
  if (committed_) {
    EmitArguments(std::string_view(&c, 1));
  } else {
    pending_arguments_.push_back(c);
  }
}

std::string ToolCallParser::NextId() {
  const uint64_t counter = static_cast<uint64_t>(num_calls_ - 1);
  std::string id;
  if (format_ == ToolCallFormat::kMistral) {
    uint64_t x = (mistral_id_base_ + counter) % kMistralIdSpace;
    x = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * kMistralIdMultiplier) % kMistralIdSpace);
    id.resize(9);
    for (int i = 8; i >= 0; --i) {
      id[i] = kAlphabet[x % 62];
      x /= 62;
    }
    return id;
  }
  id = id_prefix_ + std::to_string(counter) + "_";
  for (int half = 0; half < 2; ++half) {
    uint64_t r = SplitMix64(&rng_state_);
    for (int i = 0; i < 8; ++i) {
      id.push_back(kAlphabet[r % 62]);
      r /= 62;
    }
  }
  return id;
}

bool ToolCallParser::Step() {
  const char c = buf_[pos_];
  switch (state_) {
    case State::kContent:
      return StepContent();

    case State::kAfterCall:
      if (IsSpace(c)) {
        ++pos_;
      } else {
        state_ = State::kContent;
      }
      return true;

    case State::kObject:
      return StepObject(c);

    case State::kHermesClose:
      if (IsSpace(c)) {
        ++pos_;
        return true;
      }
      switch (MatchAt(kHermesClose)) {
        case MatchResult::kYes:
          pos_ += kHermesClose.size();
          state_ = State::kAfterCall;
          return true;
        case MatchResult::kMaybe:
          return false;
        case MatchResult::kNo:
          Fail();
          return true;
      }
      return true;

    case State::kLlamaStart:
      if (IsSpace(c)) {
        Take(1);
        return true;
      }
      if (c == '{') {
        StartObject();
        return true;
      }
      switch (MatchAt(kLlamaPythonTag)) {
        case MatchResult::kYes:
          Take(kLlamaPythonTag.size());
          StartObject();
          return true;
        case MatchResult::kMaybe:
          return false;
        case MatchResult::kNo:
          Fail();
          return true;
      }
      return true;

    case State::kLlamaNext:
      if (IsSpace(c)) {
        ++pos_;
      } else if (c == ';') {
        ++pos_;
        state_ = State::kLlamaAfterSemi;
      } else {
        Fail();
      }
      return true;

    case State::kLlamaAfterSemi:
      if (IsSpace(c)) {
        ++pos_;
      } else if (c == '{') {
        StartObject();
      } else {
        Fail();
      }
      return true;

    case State::kMistralStart:
      if (IsSpace(c)) {
        Take(1);
      } else if (c == '[') {
        Take(1);
        state_ = State::kMistralArrayFirst;
      } else if (IsMistralNameChar(c)) {
        name_raw_.clear();
        state_ = State::kMistralName;
      } else {
        Fail();
      }
      return true;

    case State::kMistralArrayFirst:
      if (IsSpace(c)) {
        Take(1);
      } else if (c == '{') {
        StartObject();
      } else {
        Fail();  // includes an empty list: no call, so it stays content
      }
      return true;

    case State::kMistralArrayNext:
      if (IsSpace(c)) {
        ++pos_;
      } else if (c == ',') {
        ++pos_;
        state_ = State::kMistralArrayElem;
      } else if (c == ']') {
        ++pos_;
        state_ = State::kAfterCall;
      } else {
        Fail();
      }
      return true;

    case State::kMistralArrayElem:
      if (IsSpace(c)) {
        ++pos_;
      } else if (c == '{') {
        StartObject();
      } else {
        Fail();
      }
      return true;

    case State::kMistralName:
      if (IsMistralNameChar(c)) {
        Take(1);
        name_raw_.push_back(c);
        return true;
      }
      if (c == '[' && !name_raw_.empty()) {
        switch (MatchAt(kMistralArgs)) {
          case MatchResult::kYes:
            pos_ += kMistralArgs.size();
            arguments_started_ = false;
            arguments_key_seen_ = true;
            Commit(std::move(name_raw_));
            name_raw_.clear();
            state_ = State::kMistralArgsStart;
            return true;
          case MatchResult::kMaybe:
            return false;
          case MatchResult::kNo:
            break;
        }
      }
      Fail();
      return true;

    case State::kMistralArgsStart:
      if (IsSpace(c)) {
        ++pos_;
        return true;
      }
      value_.Reset();
      state_ = State::kMistralArgs;
      return true;

    case State::kMistralArgs:
      switch (value_.Push(c)) {
        case ValueScanner::Result::kMore:
          ++pos_;
          AppendArguments(c);
          return true;
        case ValueScanner::Result::kEndAfter:
          ++pos_;
          AppendArguments(c);
          EndCall();
          state_ = State::kAfterCall;
          return true;
        case ValueScanner::Result::kEndBefore:
          EndCall();
          state_ = State::kAfterCall;
          return true;
        case ValueScanner::Result::kInvalid:
          Fail();
          return true;
      }
      return true;
  }
  return true;
}

bool ToolCallParser::StepContent() {
  if (start_marker_.empty()) {
    EmitContent(std::string_view(buf_).substr(pos_));
    pos_ = buf_.size();
    return true;
  }
  const size_t at = buf_.find(start_marker_[0], pos_);
  if (at == std::string::npos) {
    EmitContent(std::string_view(buf_).substr(pos_));
    pos_ = buf_.size();
    return true;
  }
  EmitContent(std::string_view(buf_).substr(pos_, at - pos_));
  pos_ = at;
  switch (MatchAt(start_marker_)) {
    case MatchResult::kYes:
      raw_.assign(start_marker_);
      pos_ += start_marker_.size();
      if (format_ == ToolCallFormat::kHermes) {
        StartObject();
      } else {
        state_ = State::kMistralStart;
      }
      return true;
    case MatchResult::kMaybe:
      return false;
    case MatchResult::kNo:
      EmitContent(std::string_view(buf_).substr(pos_, 1));
      ++pos_;
      return true;
  }
  return true;
}

bool ToolCallParser::StepObject(char c) {
  switch (object_state_) {
    case ObjectState::kOpen:
      if (IsSpace(c)) {
        Take(1);
      } else if (c == '{') {
        Take(1);
        object_state_ = ObjectState::kKeyOrEnd;
      } else {
        Fail();
      }
      return true;

    case ObjectState::kKeyOrEnd:
    case ObjectState::kKey:
    case ObjectState::kCommaOrEnd:
      if (IsSpace(c)) {
        Take(1);
      } else if (c == '"' && object_state_ != ObjectState::kCommaOrEnd) {
        Take(1);
        key_raw_.clear();
        key_escape_ = false;
        object_state_ = ObjectState::kInKey;
      } else if (c == ',' && object_state_ == ObjectState::kCommaOrEnd) {
        Take(1);
        object_state_ = ObjectState::kKey;
      } else if (c == '}' && object_state_ != ObjectState::kKey && committed_) {
        Take(1);
        EndCall();
        switch (format_) {
          case ToolCallFormat::kHermes: state_ = State::kHermesClose; break;
          case ToolCallFormat::kLlama3Json: state_ = State::kLlamaNext; break;
          default: state_ = State::kMistralArrayNext; break;
        }
      } else {
        Fail();  // includes an object that closes without a name
      }
      return true;

    case ObjectState::kInKey:
      Take(1);
      if (key_escape_) {
        key_escape_ = false;
      } else if (c == '\\') {
        key_escape_ = true;
      } else if (c == '"') {
        if (!DecodeJsonString(key_raw_, &key_)) key_.clear();
        object_state_ = ObjectState::kColon;
        return true;
      }
      key_raw_.push_back(c);
      return true;

    case ObjectState::kColon:
      if (IsSpace(c)) {
        Take(1);
      } else if (c == ':') {
        Take(1);
        object_state_ = ObjectState::kValueStart;
      } else {
        Fail();
      }
      return true;

    case ObjectState::kValueStart:
      if (IsSpace(c)) {
        Take(1);
        return true;
      }
      if (key_ == "name" && !name_seen_) {
        if (c != '"') {
          Fail();
          return true;
        }
        name_seen_ = true;
        value_kind_ = ValueKind::kName;
        name_raw_.clear();
      } else if ((key_ == "arguments" || key_ == "parameters") && !arguments_key_seen_) {
        arguments_key_seen_ = true;
        value_kind_ = ValueKind::kArguments;
      } else {
        value_kind_ = ValueKind::kOther;
      }
      value_.Reset();
      object_state_ = ObjectState::kInValue;
      return true;

    case ObjectState::kInValue: {
      const ValueScanner::Result result = value_.Push(c);
      if (result == ValueScanner::Result::kInvalid) {
        Fail();
        return true;
      }
      const bool consumed = result != ValueScanner::Result::kEndBefore;
      if (consumed) {
        Take(1);
        if (value_kind_ == ValueKind::kName) name_raw_.push_back(c);
        if (value_kind_ == ValueKind::kArguments) AppendArguments(c);
      }
      if (result == ValueScanner::Result::kMore) return true;
      object_state_ = ObjectState::kCommaOrEnd;
      if (value_kind_ == ValueKind::kName) {
        // name_raw_ is the whole string literal, quotes included.
        std::string name;
        if (name_raw_.size() < 2 ||
            !DecodeJsonString(std::string_view(name_raw_).substr(1, name_raw_.size() - 2), &name) ||
            name.empty()) {
          Fail();
          return true;
        }
        Commit(std::move(name));
      }
      return true;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// Non-streaming helpers

void MergeParsedOutput(const ParsedOutput& output, ParsedMessage* message) {
  message->content.append(output.content);
  for (const ToolCallDelta& delta : output.tool_calls) {
    if (delta.index >= static_cast<int>(message->calls.size())) {
      message->calls.resize(delta.index + 1);
    }
    ToolCall& call = message->calls[delta.index];
    if (delta.id) call.id = *delta.id;
    if (delta.name) call.name = *delta.name;
    call.arguments.append(delta.arguments);
  }
}

ParsedMessage ParseToolCalls(ToolCallFormat format, std::string_view text, uint64_t id_seed,
                             std::string id_prefix) {
  ToolCallParser parser(format, id_seed, std::move(id_prefix));
  ParsedMessage message;
  MergeParsedOutput(parser.Feed(text), &message);
  MergeParsedOutput(parser.Finish(), &message);
  return message;
}

}  // namespace exl3serve::coordinator::http
