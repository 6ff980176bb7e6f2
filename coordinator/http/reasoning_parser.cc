#include "coordinator/http/reasoning_parser.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

namespace exl3serve::coordinator::http {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t PartialMarkerSuffix(std::string_view text, std::string_view marker) {
  const size_t longest = std::min(text.size(), marker.size() - 1);
  for (size_t n = longest; n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

ReasoningParser::ReasoningParser(bool starts_in_reasoning, std::string open, std::string close)
    : starts_in_reasoning_(starts_in_reasoning), open_(std::move(open)), close_(std::move(close)) {}

ReasoningSplit ReasoningParser::Feed(std::string_view text) {
  if (finished_) return {};
  held_.append(text);
  return Process(/*final=*/false);
}

ReasoningSplit ReasoningParser::Finish() {
  if (finished_) return {};
  finished_ = true;
  return Process(/*final=*/true);
}

bool ReasoningParser::in_reasoning() const {
  return state_ == State::kReasoning || (state_ == State::kStart && starts_in_reasoning_);
}

ReasoningSplit ReasoningParser::Process(bool final) {
  ReasoningSplit out;
  while (true) {
    switch (state_) {
      case State::kStart: {
        size_t i = 0;
        while (i < held_.size() && IsSpace(held_[i])) ++i;
        const std::string_view rest = std::string_view(held_).substr(i);
        if (rest.size() >= open_.size() && rest.substr(0, open_.size()) == open_) {
          held_.erase(0, i + open_.size());
          state_ = State::kReasoning;
          continue;
        }
        const bool undecided =
            rest.size() < open_.size() && std::string_view(open_).substr(0, rest.size()) == rest;
        if (undecided && !final) return out;  // all whitespace, or a partial open marker
        state_ = starts_in_reasoning_ ? State::kReasoning : State::kContent;
        continue;
      }
      case State::kReasoning: {
        const size_t at = held_.find(close_);
        if (at != std::string::npos) {
          out.reasoning.append(held_, 0, at);
          held_.erase(0, at + close_.size());
          state_ = State::kAfterClose;
          continue;
        }
        const size_t keep = final ? 0 : PartialMarkerSuffix(held_, close_);
        out.reasoning.append(held_, 0, held_.size() - keep);
        held_.erase(0, held_.size() - keep);
        return out;
      }
      case State::kAfterClose: {
        size_t i = 0;
        while (i < held_.size() && IsSpace(held_[i])) ++i;
        held_.erase(0, i);
        if (held_.empty()) return out;
        state_ = State::kContent;
        continue;
      }
      case State::kContent:
        out.content.append(held_);
        held_.clear();
        return out;
    }
  }
}

bool PromptOpensReasoning(std::string_view prompt, std::string_view open) {
  size_t end = prompt.size();
  while (end > 0 && IsSpace(prompt[end - 1])) --end;
  const std::string_view trimmed = prompt.substr(0, end);
  return !open.empty() && trimmed.size() >= open.size() &&
         trimmed.substr(trimmed.size() - open.size()) == open;
}

}  // namespace exl3serve::coordinator::http
