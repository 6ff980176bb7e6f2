// tests/http/scripted_engine.h — an Engine whose output is a script chosen by
// the prompt, for testing the HTTP layer (framing, tool calls, reasoning,
// errors, disconnects) where a real model's output cannot be steered. The
// engine contract is kept: responses on one thread, chunks then exactly one
// complete, Abort ends a live request with FINISH_REASON_ABORT at the next
// step, max_tokens ends it with LENGTH.
//
// Scripts (first match on the prompt text):
//   a constraint and ends with "<tool_call>\n" (a forced call)
//                                     -> `{"name": "get_weather", "arguments": {"city": "Paris"}}`,
//                                        completed with FINISH_REASON_CONSTRAINT_COMPLETE
//   another constraint                -> `{"ok": true}` (the same completion)
//   contains "tool:"                  -> "It is sunny in Paris."          (a tool result came back)
//   contains "weather" and "Tools:"   -> a Hermes <tool_call> for get_weather
//   contains "think"                  -> "<think>Two and two.</think>\n\nFour."
//   contains "slow"                   -> "tick " forever (until aborted or max_tokens)
//   contains "wait"                   -> as above after 100 silent steps (a long prefill)
//   otherwise                         -> "Hello from the script."
// Each step emits `chunk_bytes` bytes as one token (ids 1000, 1001, ...).
#ifndef EXL3SERVE_TESTS_HTTP_SCRIPTED_ENGINE_H_
#define EXL3SERVE_TESTS_HTTP_SCRIPTED_ENGINE_H_

#include <atomic>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/engine.h"

namespace exl3serve::testing {

class ScriptedEngine final : public coordinator::Engine {
 public:
  explicit ScriptedEngine(absl::Duration step = absl::Milliseconds(2), size_t chunk_bytes = 3)
      : step_(step), chunk_bytes_(chunk_bytes), thread_([this] { Loop(); }) {}
  ~ScriptedEngine() override { Shutdown(); }

  static std::string ScriptFor(const std::string& prompt, bool constrained = false) {
    if (constrained) {
      if (absl::EndsWith(prompt, "<tool_call>\n")) {
        return "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
      }
      return "{\"ok\": true}";
    }
    if (absl::StrContains(prompt, "tool:")) return "It is sunny in Paris.";
    if (absl::StrContains(prompt, "weather") && absl::StrContains(prompt, "Tools:")) {
      return "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
             "\"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
    }
    if (absl::StrContains(prompt, "think")) return "<think>Two and two.</think>\n\nFour.";
    return "Hello from the script.";
  }

  absl::Status Submit(const v1::GenerateRequest& request, coordinator::ResponseCallback cb) override {
    std::string prompt;
    if (request.has_text()) {
      prompt = request.text();
    } else if (request.has_tokenized()) {
      prompt = absl::StrCat("ids:", request.tokenized().input_ids_size());
    } else if (request.has_chat()) {
      absl::StatusOr<std::string> r = RenderChat(request.chat());
      if (!r.ok()) return r.status();
      prompt = *r;
    } else {
      return absl::InvalidArgumentError("input: give text, tokenized or chat input");
    }
    if (absl::StrContains(prompt, "too long")) {
      return absl::InvalidArgumentError("input: the prompt has 9999 tokens; the context holds 256 positions including at least one generated token");
    }
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    if (static_cast<int>(live_.size()) >= max_live) {
      return absl::ResourceExhaustedError("queue full: retry later");
    }
    if (live_.count(request.request_id())) {
      return absl::InvalidArgumentError(absl::StrCat("request_id: \"", request.request_id(), "\" is already live"));
    }
    Live l;
    l.callback = std::move(cb);
    l.constrained = request.has_constraint();
    l.script = absl::StrContains(prompt, "slow") ? "" : ScriptFor(prompt, l.constrained);
    l.endless = absl::StrContains(prompt, "slow");
    l.silent_steps = absl::StrContains(prompt, "wait") ? 100 : 0;
    l.max_tokens = request.sampling_params().max_tokens() > 0 ? request.sampling_params().max_tokens() : 1 << 30;
    l.logprobs = request.sampling_params().logprobs();
    l.top = request.sampling_params().top_logprobs();
    l.prompt_tokens = static_cast<uint32_t>(prompt.size());
    l.seed = request.sampling_params().seed();
    live_[request.request_id()] = std::move(l);
    submitted_.push_back(request);
    return absl::OkStatus();
  }

  int Abort(const std::vector<std::string>& ids, const std::string& reason) override {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const std::string& id : ids) {
      auto it = live_.find(id);
      if (it == live_.end()) continue;
      it->second.aborted = true;
      ++n;
      aborted_.push_back(id);
    }
    return n;
  }

  v1::GetModelInfoResponse GetModelInfo() const override {
    v1::GetModelInfoResponse info;
    info.set_model_path("/models/scripted");
    info.set_vocab_size(2000);
    info.set_max_context_tokens(256);
    info.set_has_chat_template(true);
    return info;
  }
  v1::GetServerInfoResponse GetServerInfo() const override {
    v1::GetServerInfoResponse info;
    absl::MutexLock lock(&mu_);
    info.set_num_requests_running(static_cast<uint32_t>(live_.size()));
    info.set_ready(ready_flag);
    return info;
  }
  absl::StatusOr<std::string> RenderChat(const v1::ChatInput& chat) const override {
    std::string out;
    for (const v1::ChatMessage& m : chat.messages()) {
      if (m.role() == "tool") {
        absl::StrAppend(&out, "tool: ", m.content(), "\n");
        continue;
      }
      absl::StrAppend(&out, m.role(), ": ", m.content(), "\n");
      for (const v1::ToolCall& c : m.tool_calls()) {
        absl::StrAppend(&out, "<tool_call>", c.function_name(), " ", c.arguments_json(), "</tool_call>\n");
      }
    }
    if (!chat.tools_json().empty()) absl::StrAppend(&out, "Tools: ", chat.tools_json(), "\n");
    if (!chat.has_add_generation_prompt() || chat.add_generation_prompt()) out += "assistant: ";
    return out;
  }
  bool AdmitsRequests() const override {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(live_.size()) < max_live;
  }
  bool ready() const override { return ready_flag; }
  absl::Status DeepHealthCheck(absl::Time) override { return absl::OkStatus(); }
  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    thread_.join();
  }

  // Test controls and observations.
  std::atomic<bool> ready_flag{true};
  int max_live = 1000;
  std::vector<std::string> aborted() const {
    absl::MutexLock lock(&mu_);
    return aborted_;
  }
  std::vector<v1::GenerateRequest> submitted() const {
    absl::MutexLock lock(&mu_);
    return submitted_;
  }
  int live() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(live_.size());
  }
  // Waits until no request is live (the step after the last ended).
  bool WaitIdle(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return live_.empty(); };
    return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  }

 private:
  struct Live {
    coordinator::ResponseCallback callback;
    std::string script;
    bool endless = false;
    int silent_steps = 0;
    size_t pos = 0;
    int emitted = 0;
    int max_tokens = 0;
    bool logprobs = false;
    int top = 0;
    bool aborted = false;
    uint32_t prompt_tokens = 0;
    uint64_t seed = 0;
    bool constrained = false;  // ends with FINISH_REASON_CONSTRAINT_COMPLETE
  };

  void Loop() {
    for (;;) {
      std::vector<std::pair<coordinator::ResponseCallback, v1::GenerateResponse>> out;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) {
          for (auto& [id, l] : live_) {
            v1::GenerateResponse r;
            r.set_request_id(id);
            r.mutable_complete()->set_finish_reason(v1::FINISH_REASON_ABORT);
            out.emplace_back(l.callback, r);
          }
          live_.clear();
        }
        for (auto it = live_.begin(); it != live_.end();) {
          Live& l = it->second;
          v1::GenerateResponse r;
          r.set_request_id(it->first);
          auto complete = [&](v1::FinishReason reason) {
            v1::GenerateComplete* c = r.mutable_complete();
            c->set_finish_reason(reason);
            c->set_prompt_tokens(l.prompt_tokens);
            c->set_completion_tokens(static_cast<uint32_t>(l.emitted));
            c->set_seed(l.seed);
          };
          bool erase = false;
          if (!l.aborted && l.silent_steps > 0) {
            --l.silent_steps;
            ++it;
            continue;
          }
          if (l.aborted) {
            complete(v1::FINISH_REASON_ABORT);
            erase = true;
          } else if (l.emitted >= l.max_tokens) {
            complete(v1::FINISH_REASON_LENGTH);
            erase = true;
          } else if (!l.endless && l.pos >= l.script.size()) {
            complete(l.constrained ? v1::FINISH_REASON_CONSTRAINT_COMPLETE : v1::FINISH_REASON_EOS);
            erase = true;
          } else {
            std::string piece = l.endless ? "tick " : l.script.substr(l.pos, chunk_bytes_);
            l.pos += piece.size();
            v1::GenerateStreamChunk* c = r.mutable_chunk();
            c->add_token_ids(1000 + l.emitted);
            c->set_text(piece);
            if (l.logprobs) c->add_logprobs(-0.25f * static_cast<float>(1 + l.emitted % 3));
            if (l.top > 0) {
              v1::TopLogprobs* t = c->add_top_logprobs();
              for (int k = 0; k < l.top; ++k) {
                t->add_token_ids(1000 + k);
                t->add_logprobs(-0.5f * static_cast<float>(k + 1));
              }
            }
            ++l.emitted;
            c->set_prompt_tokens(l.prompt_tokens);
            c->set_completion_tokens(static_cast<uint32_t>(l.emitted));
          }
          out.emplace_back(l.callback, r);
          it = erase ? live_.erase(it) : std::next(it);
        }
      }
      for (auto& [cb, r] : out) cb(r);
      {
        absl::MutexLock lock(&mu_);
        if (stopping_ && live_.empty()) return;
      }
      absl::SleepFor(step_);  // the engine's step period (not a test's synchronisation)
    }
  }

  const absl::Duration step_;
  const size_t chunk_bytes_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Live> live_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GenerateRequest> submitted_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace exl3serve::testing

#endif  // EXL3SERVE_TESTS_HTTP_SCRIPTED_ENGINE_H_
