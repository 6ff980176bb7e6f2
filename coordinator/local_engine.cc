#include "coordinator/local_engine.h"

#include <random>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/tokenizer/chat_template.h"
#include "common/json_depth.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/api/verified_forward.h"

namespace exl3serve::coordinator {
namespace {

// google.rpc.Code values of GenerateError.code.
int RpcCode(absl::StatusCode code) { return static_cast<int>(code); }

// FailedPrecondition unless the executor's caches have the allocator's layout.
absl::Status CheckKvLayout(const worker::KvCacheOptions& kv, const worker::StepExecutor& executor) {
  const std::optional<worker::KvCacheOptions> theirs = executor.kv_options();
  if (!theirs.has_value() ||
      (theirs->num_pages == kv.num_pages && theirs->page_size_tokens == kv.page_size_tokens)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "KV layout mismatch: the ranks' caches have ", theirs->num_pages, " pages of ",
      theirs->page_size_tokens, " positions but the coordinator's block allocator has ",
      kv.num_pages, " pages of ", kv.page_size_tokens, " (use the same kv settings on both)"));
}

// The root of the prefix cache's block hashes: everything besides the
// tokens that changes the keys and values a block holds.
std::string PrefixCacheSalt(const EngineOptions& options) {
  return absl::StrCat("model=", options.model_dir,
                      "|kv_dtype=", static_cast<int>(options.kv.dtype),
                      "|page=", options.kv.page_size_tokens,
                      "|prefill=", static_cast<int>(options.prefill_precision),
                      "|decode=", static_cast<int>(options.decode_precision),
                      "|tp=", options.tensor_parallel, "|ep=", options.expert_parallel);
}

// Cached prefixes live in the pages the scheduler assigned: an executor
// whose cache takes pages on its own (not caller_assigns_pages) cannot share
// them. Fakes that do not say are taken at their word (they keep no KV).
bool ExecutorFollowsBlockTables(const worker::StepExecutor& executor) {
  const std::optional<worker::KvCacheOptions> kv = executor.kv_options();
  if (kv.has_value() && !kv->caller_assigns_pages) {
    EXL3_LOG(kWarning) << "prefix cache off: the executor's KV cache allocates its own pages";
    return false;
  }
  return true;
}

std::vector<worker::KvBlockTransfer> Transfers(const std::vector<BlockTransfer>& blocks) {
  std::vector<worker::KvBlockTransfer> out;
  out.reserve(blocks.size());
  for (const BlockTransfer& b : blocks) {
    out.push_back({.page = b.block, .slot = b.slot, .hash_hi = b.hash.hi, .hash_lo = b.hash.lo});
  }
  return out;
}

bool GroupBroken(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsAborted(status) ||
         absl::IsDeadlineExceeded(status);
}

bool Contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

// Compiled constraints kept by the engine (least recently used evicted).
constexpr size_t kConstraintCacheEntries = 64;

absl::Status Invalid(const std::string& field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", rule));
}

// GetServerInfo's ranks of a local group (the fields a remote group fills,
// less the heartbeat age: local ranks send none).
std::vector<v1::RankInfo> LocalRankInfos(const std::vector<worker::rank::LocalRankState>& states) {
  std::vector<v1::RankInfo> ranks;
  for (const worker::rank::LocalRankState& status : states) {
    v1::RankInfo& info = ranks.emplace_back();
    info.set_rank(static_cast<uint32_t>(status.rank));
    info.set_up(status.up);
    info.set_address(status.address);
    info.set_checkpoint_read_bytes(status.bytes_read);
  }
  return ranks;
}

// The running limit: max_running, and for a model with a recurrent state
// per sequence also max_state_sequences.
int64_t MaxRunning(const EngineOptions& options, const sharding::ModelArch& arch) {
  if (!arch.has_recurrent_state() || options.max_state_sequences <= 0) return options.max_running;
  return std::min(options.max_running, options.max_state_sequences);
}

}  // namespace

LocalEngine::LocalEngine(const EngineOptions& options, EngineModel model,
                         std::unique_ptr<worker::StepExecutor> executor,
                         std::unique_ptr<DraftModel> draft_model)
    : options_(options),
      facts_(std::move(model.facts)),
      tokenizer_(std::move(model.tokenizer)),
      bits_per_weight_(model.bits_per_weight),
      // A remote group knows its vocabulary only once formed; it is config.json's.
      vocab_size_(executor->vocab_size() > 0 ? executor->vocab_size() : facts_.arch.vocab_size),
      max_context_([&] {
        const int64_t pool = options.kv.num_pages * options.kv.page_size_tokens;
        return options.max_context > 0 ? std::min(options.max_context, pool) : pool;
      }()),
      started_(options.clock()),
      kv_layout_error_(CheckKvLayout(options.kv, *executor)),
      executor_(std::move(executor)),
      scheduler_(SchedulerOptions{.page_size_tokens = options.kv.page_size_tokens,
                                  .num_blocks = options.kv.num_pages,
                                  .max_running = MaxRunning(options, facts_.arch),
                                  .step_token_budget = options.step_token_budget,
                                  .max_waiting = 0,  // the queue limit is Submit's
                                  .enable_prefix_caching =
                                      options.enable_prefix_caching &&
                                      ExecutorFollowsBlockTables(*executor_),
                                  .prefix_cache_salt = PrefixCacheSalt(options),
                                  .disk_blocks = options.kv_disk_blocks,
                                  .draft_token_budget =
                                      options.speculative == SpeculativeMethod::kNone
                                          ? 0
                                          : options.draft_token_budget,
                                  .recurrent_state = facts_.arch.has_recurrent_state(),
                                  // One per cached block at most (the
                                  // ranks' bound, PagedKvCache).
                                  .state_snapshot_slots =
                                      std::min(options.state_snapshots, options.kv.num_pages),
                                  .state_snapshot_interval_blocks =
                                      options.state_snapshot_interval}),
      prefix_cache_on_(scheduler_.options().enable_prefix_caching),
      drafting_(options.speculative == SpeculativeMethod::kNgram ||
                (options.speculative == SpeculativeMethod::kDraftModel && draft_model != nullptr)),
      draft_model_(std::move(draft_model)) {
  if (facts_.arch.has_recurrent_state()) {
    const int64_t bytes = facts_.arch.recurrent_state_bytes_per_sequence();
    const int64_t most = MaxRunning(options, facts_.arch);
    EXL3_LOG(kInfo) << facts_.arch.architecture << ": recurrent state "
                    << absl::StrFormat("%.2f MiB", bytes / 1048576.0)
                    << " per sequence over the ranks; at most " << most
                    << " sequences hold one (" << absl::StrFormat("%.2f GiB", most * bytes / 1073741824.0)
                    << "; --max-state-sequences / --max-running)";
  }
  if (facts_.arch.has_recurrent_state() && scheduler_.options().enable_prefix_caching) {
    const int64_t bytes = facts_.arch.recurrent_state_bytes_per_sequence();
    EXL3_LOG(kInfo) << "prefix cache with state snapshots: " << scheduler_.options().state_snapshot_slots
                    << " at most ("
                    << absl::StrFormat("%.2f GiB", scheduler_.options().state_snapshot_slots * bytes / 1073741824.0)
                    << " over the ranks), at each prompt's last full block and every "
                    << options.state_snapshot_interval
                    << " blocks (--state-snapshots / --state-snapshot-interval)";
  }
  if (options.speculative == SpeculativeMethod::kDraftModel && draft_model_ == nullptr) {
    EXL3_LOG(kError) << "--speculative draft without a draft model: decoding without drafts";
  }
  {
    absl::MutexLock lock(&mu_);
    stat_free_blocks_ = options_.kv.num_pages;
  }
  if (!kv_layout_error_.ok()) EXL3_LOG(kError) << "engine refuses requests: " << kv_layout_error_;
  thread_ = std::thread([this] { Loop(); });
}

LocalEngine::~LocalEngine() { Shutdown(); }

absl::StatusOr<std::string> LocalEngine::RenderChat(const v1::ChatInput& chat) const {
  if (tokenizer_ == nullptr || tokenizer_->chat_template().empty()) {
    return Invalid("chat", absl::StrCat("the model ", options_.model_dir,
                                        " has no chat template (tokenizer_config.json "
                                        "chat_template); send text or tokenized input"));
  }
  if (chat.messages().empty()) return Invalid("chat.messages", "is empty");
  using ojson = nlohmann::ordered_json;
  ojson messages = ojson::array();
  for (int i = 0; i < chat.messages_size(); ++i) {
    const v1::ChatMessage& m = chat.messages(i);
    const std::string field = absl::StrCat("chat.messages[", i, "]");
    static const char* const kRoles[] = {"system", "developer", "user", "assistant", "tool"};
    if (std::find(std::begin(kRoles), std::end(kRoles), m.role()) == std::end(kRoles)) {
      return Invalid(field + ".role",
                     absl::StrCat("must be system, developer, user, assistant or tool, got \"",
                                  m.role(), "\""));
    }
    ojson msg = {{"role", m.role()}, {"content", m.content()}};
    if (!m.name().empty()) msg["name"] = m.name();
    if (!m.reasoning_content().empty()) msg["reasoning_content"] = m.reasoning_content();
    if (m.role() == "tool") {
      if (m.tool_call_id().empty()) return Invalid(field + ".tool_call_id", "is required for role tool");
      msg["tool_call_id"] = m.tool_call_id();
    }
    if (m.tool_calls_size() > 0) {
      if (m.role() != "assistant") return Invalid(field + ".tool_calls", "only assistant messages call tools");
      ojson calls = ojson::array();
      for (int k = 0; k < m.tool_calls_size(); ++k) {
        const v1::ToolCall& c = m.tool_calls(k);
        if (c.function_name().empty()) {
          return Invalid(absl::StrCat(field, ".tool_calls[", k, "].function_name"), "is empty");
        }
        if (auto deep = FindJsonNestingBeyond(c.arguments_json())) {
          return Invalid(JoinJsonPath(absl::StrCat(field, ".tool_calls[", k, "].arguments_json"), deep->path),
                         absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
        }
        ojson arguments = ojson::parse(c.arguments_json(), nullptr, /*allow_exceptions=*/false);
        if (arguments.is_discarded() || !arguments.is_object()) arguments = c.arguments_json();
        calls.push_back({{"id", c.id()},
                         {"type", c.type().empty() ? "function" : c.type()},
                         {"function", {{"name", c.function_name()}, {"arguments", arguments}}}});
      }
      msg["tool_calls"] = std::move(calls);
    }
    messages.push_back(std::move(msg));
  }
  ChatPromptOptions options;
  options.add_generation_prompt = !chat.has_add_generation_prompt() || chat.add_generation_prompt();
  if (chat.continue_final_message()) {
    if (chat.has_add_generation_prompt() && chat.add_generation_prompt()) {
      return Invalid("chat.continue_final_message", "excludes add_generation_prompt");
    }
    if (chat.messages(chat.messages_size() - 1).role() != "assistant") {
      return Invalid("chat.continue_final_message", "the last message must be an assistant message");
    }
    options.add_generation_prompt = false;
  }
  for (const auto& [text, name] : {std::pair{&chat.tools_json(), "chat.tools_json"},
                                   std::pair{&chat.template_kwargs_json(), "chat.template_kwargs_json"}}) {
    if (auto deep = FindJsonNestingBeyond(*text)) {
      return Invalid(JoinJsonPath(name, deep->path), absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
    }
  }
  if (!chat.tools_json().empty()) {
    options.tools = ojson::parse(chat.tools_json(), nullptr, false);
    if (options.tools.is_discarded() || !options.tools.is_array()) {
      return Invalid("chat.tools_json", "must be a JSON array of tool schemas");
    }
  }
  if (!chat.template_kwargs_json().empty()) {
    options.extra_context = ojson::parse(chat.template_kwargs_json(), nullptr, false);
    if (options.extra_context.is_discarded() || !options.extra_context.is_object()) {
      return Invalid("chat.template_kwargs_json", "must be a JSON object");
    }
  }
  absl::StatusOr<std::string> rendered = RenderChatPrompt(*tokenizer_, messages, options);
  if (!rendered.ok()) return Invalid("chat", std::string(rendered.status().message()));
  if (chat.continue_final_message()) {
    // As transformers: cut the prompt after the final message's content, so
    // the template's end-of-turn after it is not part of the prompt.
    const std::string& final_content = chat.messages(chat.messages_size() - 1).content();
    const size_t at = final_content.empty() ? std::string::npos : rendered->rfind(final_content);
    if (at == std::string::npos) {
      return Invalid("chat.continue_final_message",
                     "the final message's content does not appear in the rendered prompt "
                     "(the template changes it), so it cannot be continued");
    }
    rendered->resize(at + final_content.size());
  }
  return rendered;
}

absl::StatusOr<LocalEngine::Pending> LocalEngine::Validate(
    const v1::GenerateRequest& request) const {
  Pending p;
  switch (request.input_case()) {
    case v1::GenerateRequest::kText: {
      if (request.text().empty()) return Invalid("text", "is empty");
      if (tokenizer_ == nullptr) {
        return Invalid("text", absl::StrCat("the model ", options_.model_dir,
                                            " has no tokenizer.json; send tokenized input"));
      }
      p.prompt = tokenizer_->Encode(request.text(),
                                    {.add_special_tokens = request.add_special_tokens()});
      if (p.prompt.empty()) return Invalid("text", "encodes to no tokens");
      break;
    }
    case v1::GenerateRequest::kTokenized: {
      const auto& ids = request.tokenized().input_ids();
      if (ids.empty()) return Invalid("tokenized.input_ids", "is empty");
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] >= static_cast<uint64_t>(vocab_size_)) {
          return Invalid("tokenized.input_ids",
                         absl::StrCat("id ", ids[i], " at index ", i,
                                      " is outside the vocabulary [0, ", vocab_size_, ")"));
        }
        p.prompt.push_back(static_cast<int32_t>(ids[i]));
      }
      break;
    }
    case v1::GenerateRequest::kChat: {
      EXL3_ASSIGN_OR_RETURN(std::string rendered, RenderChat(request.chat()));
      p.prompt = tokenizer_->Encode(rendered, {.add_special_tokens = false});
      if (p.prompt.empty()) return Invalid("chat", "renders to no tokens");
      break;
    }
    default:
      return Invalid("input", "give text, tokenized or chat input");
  }
  const int64_t prompt_len = static_cast<int64_t>(p.prompt.size());
  if (prompt_len >= max_context_) {
    return Invalid("input", absl::StrCat("the prompt has ", prompt_len,
                                         " tokens; the context holds ", max_context_,
                                         " positions including at least one generated token"));
  }

  const v1::SamplingParams& sp = request.sampling_params();
  if (sp.max_tokens() < 0) {
    return Invalid("sampling_params.max_tokens", absl::StrCat("must be >= 0, got ", sp.max_tokens()));
  }
  if (sp.max_tokens() > max_context_) {
    return Invalid("sampling_params.max_tokens",
                   absl::StrCat("must be <= the context of ", max_context_, " positions, got ",
                                sp.max_tokens()));
  }
  if (sp.max_tokens() > 0) {
    if (prompt_len + sp.max_tokens() > max_context_) {
      return Invalid("sampling_params.max_tokens",
                     absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (",
                                  sp.max_tokens(), ") exceeds the context of ", max_context_,
                                  " positions"));
    }
    p.max_tokens = sp.max_tokens();
  } else {
    p.max_tokens = std::min(options_.default_max_tokens, max_context_ - prompt_len);
  }
  if (!(sp.temperature() >= 0) || std::isinf(sp.temperature())) {
    return Invalid("sampling_params.temperature", absl::StrCat("must be >= 0, got ", sp.temperature()));
  }
  if (std::isnan(sp.top_p()) || sp.top_p() < 0 || sp.top_p() > 1) {
    return Invalid("sampling_params.top_p", absl::StrCat("must be in (0, 1], got ", sp.top_p()));
  }
  if (sp.top_k() < 0) {
    return Invalid("sampling_params.top_k", absl::StrCat("must be >= 0, got ", sp.top_k()));
  }
  if (!(sp.min_p() >= 0 && sp.min_p() <= 1)) {
    return Invalid("sampling_params.min_p", absl::StrCat("must be in [0, 1], got ", sp.min_p()));
  }
  if (!(sp.repetition_penalty() >= 0) || std::isinf(sp.repetition_penalty())) {
    return Invalid("sampling_params.repetition_penalty",
                   absl::StrCat("must be > 0 (0 = unset), got ", sp.repetition_penalty()));
  }
  p.sampling.temperature = sp.temperature();
  p.sampling.top_p = sp.top_p() == 0 ? 1.0f : sp.top_p();
  p.sampling.top_k = sp.top_k();
  p.sampling.min_p = sp.min_p();
  p.sampling.repetition_penalty = sp.repetition_penalty() == 0 ? 1.0f : sp.repetition_penalty();
  p.sampling.presence_penalty = sp.presence_penalty();
  p.sampling.frequency_penalty = sp.frequency_penalty();
  if (sp.has_seed()) {
    p.sampling.seed = sp.seed();
  } else {
    // The ranks draw from a counter-based generator keyed by the seed, so an
    // unseeded request gets one here; the log line makes it reproducible.
    thread_local std::mt19937_64 seeds{std::random_device{}()};
    p.sampling.seed = seeds();
    EXL3_LOG(kDebug) << "request " << request.request_id() << ": no seed given, sampling with seed "
                     << *p.sampling.seed;
  }
  p.sampling.logprobs = sp.logprobs();
  p.sampling.top_logprobs = sp.top_logprobs();
  for (const auto& [id, bias] : sp.logit_bias()) {
    if (static_cast<int64_t>(id) >= vocab_size_) {
      return Invalid("sampling_params.logit_bias",
                     absl::StrCat("token id ", id, " is outside [0, ", vocab_size_, ")"));
    }
    p.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), bias);
  }
  std::sort(p.sampling.logit_bias.begin(), p.sampling.logit_bias.end());
  if (absl::Status s = worker::ValidateSamplingParams(p.sampling); !s.ok()) {
    return Invalid("sampling_params", std::string(s.message()));
  }

  for (int i = 0; i < sp.stop_token_ids_size(); ++i) {
    if (sp.stop_token_ids(i) >= static_cast<uint64_t>(vocab_size_)) {
      return Invalid("sampling_params.stop_token_ids",
                     absl::StrCat("id ", sp.stop_token_ids(i), " at index ", i,
                                  " is outside the vocabulary [0, ", vocab_size_, ")"));
    }
    p.request_stop_ids.push_back(static_cast<int32_t>(sp.stop_token_ids(i)));
  }
  p.ignore_eos = sp.ignore_eos();
  p.text_output = tokenizer_ != nullptr;
  p.skip_special_tokens = !request.has_skip_special_tokens() || request.skip_special_tokens();
  p.use_prefix_cache = !request.no_prefix_cache();
  for (const std::string& stop : sp.stop()) {
    if (stop.empty()) return Invalid("sampling_params.stop", "contains an empty string");
    p.stop_strings.push_back(stop);
  }
  if (!p.stop_strings.empty() && !p.text_output) {
    return Invalid("sampling_params.stop",
                   "stop strings need text output; the model has no tokenizer.json");
  }
  if (request.deadline_ms() < 0) {
    return Invalid("deadline_ms", absl::StrCat("must be >= 0, got ", request.deadline_ms()));
  }
  if (request.has_constraint()) {
    EXL3_ASSIGN_OR_RETURN(p.constraint, CompileRequestConstraint(request.constraint()));
  }
  p.arrival = options_.clock();
  const absl::Duration limit = request.deadline_ms() > 0 ? absl::Milliseconds(request.deadline_ms())
                                                         : options_.default_deadline;
  p.deadline = limit == absl::InfiniteDuration() ? absl::InfiniteFuture() : p.arrival + limit;
  return p;
}

absl::StatusOr<std::shared_ptr<const constrained::CompiledConstraint>>
LocalEngine::CompileRequestConstraint(const v1::OutputConstraint& constraint) const {
  constrained::ConstraintSpec spec;
  std::string field = "constraint";
  switch (constraint.kind_case()) {
    case v1::OutputConstraint::kJsonSchema:
      spec.kind = constrained::ConstraintKind::kJsonSchema;
      spec.text = constraint.json_schema();
      field = "constraint.json_schema";
      break;
    case v1::OutputConstraint::kRegex:
      spec.kind = constrained::ConstraintKind::kRegex;
      spec.text = constraint.regex();
      field = "constraint.regex";
      break;
    case v1::OutputConstraint::kChoice:
      spec.kind = constrained::ConstraintKind::kChoice;
      spec.choices.assign(constraint.choice().choices().begin(), constraint.choice().choices().end());
      field = "constraint.choice";
      if (spec.choices.empty()) return Invalid(field, "lists no choices");
      break;
    case v1::OutputConstraint::kGrammar:
      spec.kind = constrained::ConstraintKind::kGrammar;
      spec.text = constraint.grammar();
      field = "constraint.grammar";
      break;
    default:
      return Invalid("constraint", "set json_schema, regex, choice or grammar");
  }
  if (tokenizer_ == nullptr) {
    return Invalid(field, absl::StrCat("structured output needs the model's tokenizer; ",
                                       options_.model_dir, " has no tokenizer.json"));
  }
  absl::StatusOr<std::shared_ptr<const constrained::CompiledConstraint>> compiled;
  {
    absl::MutexLock lock(&constraint_mu_);
    if (constraints_ == nullptr) {
      absl::StatusOr<std::shared_ptr<const constrained::TokenVocabulary>> vocab =
          constrained::TokenVocabulary::FromTokenizer(*tokenizer_, vocab_size_,
                                                      facts_.eos_token_ids);
      if (!vocab.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("structured output: the model's vocabulary: ", vocab.status().message()));
      }
      constraints_ = std::make_unique<constrained::ConstraintCache>(*std::move(vocab),
                                                                    kConstraintCacheEntries);
    }
  }
  // The cache is thread-safe: compiling runs outside constraint_mu_.
  constrained::ConstraintCache* cache = nullptr;
  {
    absl::MutexLock lock(&constraint_mu_);
    cache = constraints_.get();
  }
  compiled = cache->Get(spec);
  if (!compiled.ok()) {
    // A constraint past the compiler's size limits is as much the request's
    // fault as a malformed one: retrying cannot help (not 429).
    if (absl::IsInvalidArgument(compiled.status()) || absl::IsResourceExhausted(compiled.status())) {
      return Invalid(field, std::string(compiled.status().message()));
    }
    return compiled.status();
  }
  return compiled;
}

bool LocalEngine::AdmitsRequests() const {
  absl::MutexLock lock(&mu_);
  return stat_waiting_ + static_cast<int64_t>(inbox_.size()) < options_.max_queue;
}

absl::Status LocalEngine::Submit(const v1::GenerateRequest& request,
                                 ResponseCallback on_response) {
  EXL3_RETURN_IF_ERROR(kv_layout_error_);
  // A full queue refuses before the prompt is rendered and tokenized (the
  // costly part of validation); checked again below, under the same lock as
  // the enqueue.
  if (!AdmitsRequests()) {
    absl::MutexLock lock(&mu_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", stat_waiting_ + static_cast<int64_t>(inbox_.size()),
        " requests wait (max_queue ", options_.max_queue, "); retry later"));
  }
  EXL3_ASSIGN_OR_RETURN(Pending p, Validate(request));
  p.callback = std::move(on_response);
  if (options_.executor_ready && !options_.executor_ready()) {
    return absl::UnavailableError("the engine is not ready: its rank group is not formed");
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the engine is shutting down");
  if (broken_) return absl::UnavailableError("the engine is not ready: its rank group failed");
  p.request_id = request.request_id();
  if (p.request_id.empty()) {
    p.request_id = absl::StrCat("req-", next_seq_id_);
  } else if (ids_.contains(p.request_id)) {
    return Invalid("request_id", absl::StrCat("\"", p.request_id, "\" is already live"));
  }
  const int64_t waiting = stat_waiting_ + static_cast<int64_t>(inbox_.size());
  if (waiting >= options_.max_queue) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", waiting, " requests wait (max_queue ", options_.max_queue,
                     "); retry later"));
  }
  p.seq_id = next_seq_id_++;
  ids_[p.request_id] = p.seq_id;
  inbox_.push_back(std::move(p));
  wake_.Signal();
  return absl::OkStatus();
}

int LocalEngine::Abort(const std::vector<std::string>& request_ids, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  int live = 0;
  for (const std::string& id : request_ids) {
    auto it = ids_.find(id);
    if (it == ids_.end()) continue;
    ++live;
    abort_inbox_.emplace_back(it->second, reason.empty() ? "aborted" : reason);
  }
  if (live > 0) wake_.Signal();
  return live;
}

bool LocalEngine::ready() const {
  if (!kv_layout_error_.ok()) return false;
  if (options_.executor_ready && !options_.executor_ready()) return false;
  absl::MutexLock lock(&mu_);
  return !stopping_ && !broken_;
}

bool LocalEngine::WaitForIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stat_idle_ && inbox_.empty() && abort_inbox_.empty();
  };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

v1::GetModelInfoResponse LocalEngine::GetModelInfo() const {
  v1::GetModelInfoResponse info;
  info.set_model_path(options_.model_dir);
  info.set_architecture(facts_.arch.architecture);
  info.set_vocab_size(static_cast<uint32_t>(vocab_size_));
  info.set_max_context_tokens(static_cast<uint32_t>(max_context_));
  info.set_num_layers(facts_.arch.num_layers);
  info.set_hidden_size(static_cast<uint32_t>(facts_.arch.hidden_size));
  info.set_bits_per_weight(bits_per_weight_);
  for (int32_t id : facts_.eos_token_ids) info.add_eos_token_ids(id);
  info.set_has_chat_template(tokenizer_ != nullptr && !tokenizer_->chat_template().empty());
  if (tokenizer_ != nullptr) info.set_chat_template(tokenizer_->chat_template());
  return info;
}

v1::GetServerInfoResponse LocalEngine::GetServerInfo() const {
  v1::GetServerInfoResponse info;
  if (options_.rank_info) {
    for (v1::RankInfo& rank : options_.rank_info()) *info.add_ranks() = std::move(rank);
  }
  const bool executor_ready = !options_.executor_ready || options_.executor_ready();
  absl::MutexLock lock(&mu_);
  info.set_num_requests_running(static_cast<uint32_t>(stat_running_));
  info.set_num_requests_waiting(static_cast<uint32_t>(stat_waiting_ + inbox_.size()));
  info.set_kv_blocks_total(static_cast<uint32_t>(options_.kv.num_pages));
  info.set_kv_blocks_free(static_cast<uint32_t>(stat_free_blocks_));
  info.set_kv_cache_usage_perc(1.0 - static_cast<double>(stat_free_blocks_) /
                                         static_cast<double>(options_.kv.num_pages));
  info.set_ready(executor_ready && !stopping_ && !broken_);
  info.set_uptime_seconds(absl::ToDoubleSeconds(options_.clock() - started_));
  info.set_tensor_parallel_size(static_cast<uint32_t>(std::max(1, options_.tensor_parallel)));
  info.set_expert_parallel_size(static_cast<uint32_t>(std::max(1, options_.expert_parallel)));
  info.set_num_preemptions(stat_preemptions_);
  info.set_num_replays(stat_replays_);
  info.set_prefix_cache_enabled(prefix_cache_on_);
  info.set_prefix_cache_queries_tokens(stat_prefix_.queried_tokens);
  info.set_prefix_cache_hits_tokens(stat_prefix_.hit_tokens);
  info.set_prefix_cache_evicted_blocks(stat_prefix_.evicted_blocks);
  info.set_prefix_cache_blocks(static_cast<uint32_t>(stat_prefix_.cached_blocks));
  info.set_prefix_cache_disk_capacity_blocks(
      options_.enable_prefix_caching ? static_cast<uint64_t>(options_.kv_disk_blocks) : 0);
  info.set_prefix_cache_disk_saved_blocks(stat_prefix_.disk_saves);
  info.set_prefix_cache_disk_hit_blocks(stat_prefix_.disk_hits);
  info.set_prefix_cache_disk_miss_blocks(stat_prefix_.disk_misses);
  info.set_prefix_cache_disk_evicted_blocks(stat_prefix_.disk_evictions);
  info.set_prefix_cache_disk_used_blocks(static_cast<uint64_t>(stat_prefix_.disk_used));
  info.set_num_steps(stat_steps_);
  info.set_step_seconds_total(stat_step_seconds_);
  info.set_coordinator_seconds_total(stat_coordinator_seconds_);
  info.set_rank_result_bytes_total(stat_result_bytes_);
  info.set_sampled_sequences_total(stat_sampled_sequences_);
  if (options_.speculative != SpeculativeMethod::kNone) {
    info.set_speculative_method(SpeculativeMethodName(options_.speculative));
  }
  info.set_spec_decode_num_drafts(stat_spec_drafts_);
  info.set_spec_decode_num_draft_tokens(stat_spec_draft_tokens_);
  info.set_spec_decode_num_accepted_tokens(stat_spec_accepted_tokens_);
  info.set_structured_output_masks(stat_constraint_masks_);
  info.set_structured_output_mask_seconds_total(stat_constraint_mask_seconds_);
  if (facts_.arch.has_recurrent_state()) {
    info.set_recurrent_state_bytes_per_sequence(
        static_cast<uint64_t>(facts_.arch.recurrent_state_bytes_per_sequence()));
    info.set_recurrent_state_sequences(static_cast<uint32_t>(stat_running_));
    info.set_recurrent_state_sequences_max(static_cast<uint32_t>(MaxRunning(options_, facts_.arch)));
    if (prefix_cache_on_) {
      info.set_state_snapshots(static_cast<uint32_t>(stat_prefix_.state_snapshots));
      info.set_state_snapshots_max(static_cast<uint32_t>(std::min(options_.state_snapshots, options_.kv.num_pages)));
      info.set_state_snapshot_saves(stat_prefix_.state_snapshot_saves);
      info.set_state_snapshot_hits(stat_prefix_.state_snapshot_hits);
      info.set_state_snapshot_evictions(stat_prefix_.state_snapshot_evictions);
    }
  }
  return info;
}

absl::Status LocalEngine::DeepHealthCheck(absl::Time deadline) {
  // A one-token request through the scheduler thread and every rank: token 0,
  // greedy, one new token, ahead of nothing (it queues like any request but
  // ignores the queue limit).
  struct Result {
    absl::Mutex mu;
    bool done = false;
    absl::Status status;
  };
  auto result = std::make_shared<Result>();  // shared with the callback
  Pending p;
  p.prompt = {0};
  p.sampling.temperature = 0;
  p.sampling.seed = 0;
  p.max_tokens = 1;
  p.ignore_eos = true;
  p.arrival = options_.clock();
  p.deadline = deadline;
  p.callback = [result](const v1::GenerateResponse& r) {
    if (r.has_chunk()) return;
    absl::MutexLock lock(&result->mu);
    result->done = true;
    if (r.has_error()) {
      result->status = absl::Status(static_cast<absl::StatusCode>(r.error().code()),
                                    absl::StrCat("deep health check: ", r.error().message()));
    } else if (r.complete().finish_reason() != v1::FINISH_REASON_LENGTH) {
      result->status = absl::UnavailableError("deep health check was aborted");
    }
  };
  if (options_.executor_ready && !options_.executor_ready()) {
    return absl::UnavailableError("the engine is not ready: its rank group is not formed");
  }
  std::string request_id;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    if (broken_) return absl::UnavailableError("the engine is not ready: its rank group failed");
    p.seq_id = next_seq_id_++;
    p.request_id = request_id = absl::StrCat("health-", p.seq_id);
    ids_[p.request_id] = p.seq_id;
    inbox_.push_back(std::move(p));
    wake_.Signal();
  }
  absl::MutexLock lock(&result->mu);
  if (!result->mu.AwaitWithDeadline(absl::Condition(&result->done), deadline)) {
    return absl::DeadlineExceededError("deep health check: no forward finished by the deadline");
  }
  return result->status;
}

void LocalEngine::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    wake_.Signal();
  }
  absl::MutexLock join(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

void LocalEngine::Loop() {
  while (true) {
    std::deque<Pending> fresh;
    std::vector<std::pair<int64_t, std::string>> aborts;
    bool stopping = false;
    bool broken = false;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !inbox_.empty() || !abort_inbox_.empty();
      };
      if (scheduler_.empty()) {
        if (broken_) {  // a pause between re-formation attempts (below)
          mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1));
        } else {
          mu_.Await(absl::Condition(&has_work));
        }
      }
      fresh.swap(inbox_);
      aborts.swap(abort_inbox_);
      stopping = stopping_;
      broken = broken_;
    }
    for (Pending& p : fresh) {
      const int64_t seq_id = p.seq_id;
      Live live;
      absl::Status added = scheduler_.Add(seq_id, p.prompt, p.deadline, p.use_prefix_cache);
      live.p = std::move(p);
      if (added.ok()) {
        if (live.p.text_output) {
          live.decoder.emplace(*tokenizer_, DecodeOptions{.skip_special_tokens = live.p.skip_special_tokens});
        }
        if (!live.p.stop_strings.empty()) live.stops.emplace(live.p.stop_strings);
        if (live.p.constraint != nullptr) live.matcher.emplace(live.p.constraint);
        if (drafting_) {
          if (options_.speculative == SpeculativeMethod::kNgram) {
            live.drafter.emplace(options_.ngram);
            live.drafter->Append(live.p.prompt);
          }
          live.draft_length.emplace(options_.draft_tokens);
        }
      }
      live_.emplace(seq_id, std::move(live));
      if (!added.ok()) Fail(seq_id, added.code(), std::string(added.message()));
    }
    for (const auto& [seq_id, reason] : aborts) {
      auto it = live_.find(seq_id);
      if (it == live_.end()) continue;
      it->second.abort_reason = reason;
      scheduler_.Cancel(seq_id);
    }
    if (stopping) break;
    if (broken && scheduler_.empty()) {
      // The group did not re-form within reform_timeout and every request
      // failed (Submit refuses meanwhile): keep trying, so the engine is
      // ready again once the ranks are back. Shutdown waits for one attempt
      // (RemoteRankGroup::Shutdown ends its wait at once).
      if (options_.reform_timeout > absl::ZeroDuration() &&
          executor_->Recover(absl::Now() + options_.reform_timeout).ok()) {
        EXL3_LOG(kWarning) << "rank group re-formed; ready again";
        scheduler_.ForgetCachedBlocks();  // the new ranks' caches are empty
        absl::MutexLock lock(&mu_);
        broken_ = false;
      }
      continue;
    }
    Step();
    PublishStats();
  }
  // Shutdown: every request still here ends with ABORT.
  std::vector<int64_t> ids;
  for (const auto& [seq_id, live] : live_) ids.push_back(seq_id);
  std::sort(ids.begin(), ids.end());
  for (int64_t seq_id : ids) {
    if (scheduler_.is_running(seq_id)) executor_->RemoveSequence(seq_id).IgnoreError();
    Complete(seq_id, v1::FINISH_REASON_ABORT, "");
  }
  scheduler_.Reset();
  PublishStats();
}

void LocalEngine::Step() {
  const absl::Time now = options_.clock();
  const absl::Time wall_start = absl::Now();  // the governor's cost clock
  const bool drafts_allowed = drafting_ && (!options_.draft_governor || governor_.AllowDrafts());
  if (drafts_allowed) ProposeDrafts();
  ScheduleOutput out = scheduler_.Schedule(now);
  for (const DroppedSequence& d : out.dropped) {
    if (d.reason == DropReason::kCancelled) {
      Complete(d.seq_id, v1::FINISH_REASON_ABORT, "");
    } else {
      Fail(d.seq_id, absl::StatusCode::kDeadlineExceeded,
           "the request's deadline passed before it finished");
    }
  }
  for (int64_t seq_id : out.release) {
    if (draft_model_ != nullptr) draft_model_->Forget(seq_id);
    absl::Status s = executor_->RemoveSequence(seq_id);
    if (!s.ok() && !absl::IsNotFound(s)) return OnExecutorFailure(s);
  }
  for (int64_t seq_id : out.admit) {
    // The sampling parameters travel once, with the sequence (also when a
    // preempted or replayed sequence is admitted again: the ranks then
    // observe its prompt + output so far again, and the same prompt_len
    // keeps the penalties' output counts).
    // A prefix-cache hit: the ranks start the sequence at the cached length
    // and observe the cached tokens (same penalties and generator position).
    Live& live = live_.at(seq_id);
    const std::span<const int32_t> tokens = scheduler_.tokens(seq_id);
    const int64_t cached = scheduler_.cached_at_admission(seq_id);
    const StateSnapshot state = scheduler_.cached_state(seq_id);
    worker::SequenceSampling sampling{
        .params = live.p.sampling,
        .prompt_len = static_cast<int64_t>(live.p.prompt.size()),
        .cached_prefix = std::vector<int32_t>(tokens.begin(), tokens.begin() + cached),
        .cached_state_slot = state.slot,
        .cached_state_hash_hi = state.hash.hi,
        .cached_state_hash_lo = state.hash.lo};
    if (absl::Status s = executor_->AddSampledSequence(seq_id, sampling); !s.ok()) {
      return OnExecutorFailure(s);
    }
    if (!live.admitted) {
      live.admitted = now;
      live.cached_tokens = cached;
    }
  }
  // The disk tier: evicted blocks leave before their pages are reused, then
  // blocks of waiting prompts come back (KvLoadsDone before any Schedule).
  if (!out.kv_saves.empty()) {
    const std::vector<worker::KvBlockTransfer> saves = Transfers(out.kv_saves);
    absl::Status s = executor_->SaveKvBlocks(saves);
    if (!s.ok() && !absl::IsUnimplemented(s)) return OnExecutorFailure(s);
  }
  if (!out.kv_loads.empty()) {
    const std::vector<worker::KvBlockTransfer> loads = Transfers(out.kv_loads);
    std::vector<uint8_t> loaded;
    absl::Status s = executor_->LoadKvBlocks(loads, &loaded);
    if (!s.ok() && !absl::IsUnimplemented(s)) {
      scheduler_.KvLoadsDone({});
      return OnExecutorFailure(s);
    }
    scheduler_.KvLoadsDone(s.ok() ? loaded : std::vector<uint8_t>());
  }
  if (out.batch.empty()) return;
  std::vector<worker::SequenceTokens> batch;
  std::vector<uint8_t> sample;
  std::vector<int32_t> draft_counts;
  batch.reserve(out.batch.size());
  sample.reserve(out.batch.size());
  bool any_draft = false;
  // Structured output: each constrained draw's allowed tokens; entries whose
  // constraint no token can continue (they fail after the forward).
  // (Rows reused from step to step: resized, never shrunk, so a step
  // allocates only when its batch or drafts outgrow every earlier one.)
  std::vector<std::vector<uint32_t>>& masks = mask_rows_;
  if (masks.size() < out.batch.size()) masks.resize(out.batch.size());
  for (size_t i = 0; i < out.batch.size(); ++i) masks[i].clear();
  std::vector<uint8_t> unsatisfiable(out.batch.size(), 0);
  const absl::Time masks_start = absl::Now();
  bool any_mask = false;
  for (size_t i = 0; i < out.batch.size(); ++i) {
    const ScheduledChunk& c = out.batch[i];
    // The scheduler's block table is authoritative: the ranks get exactly
    // these pages (remote executors send them with this forward).
    if (!c.new_blocks.empty()) {
      if (absl::Status s = executor_->AssignPages(c.seq_id, c.new_blocks); !s.ok()) {
        return OnExecutorFailure(s);
      }
    }
    int32_t num_draft = static_cast<int32_t>(c.num_draft);
    if (c.needs_logits) {
      Live& live = live_.at(c.seq_id);
      if (live.matcher) {
        any_mask = true;
        // Drafts the constraint refuses are cut here (their positions'
        // pages stay assigned, as with a rejected draft).
        if (!FillChunkMasks(live, c.tokens.subspan(1, static_cast<size_t>(num_draft)), &num_draft,
                            &masks[i])) {
          unsatisfiable[i] = 1;
          masks[i].clear();
        }
      }
    }
    batch.push_back({c.seq_id, c.tokens.first(c.tokens.size() - static_cast<size_t>(c.num_draft) +
                                              static_cast<size_t>(num_draft)),
                     masks[i]});
    sample.push_back(c.needs_logits ? 1 : 0);
    draft_counts.push_back(num_draft);
    any_draft = any_draft || c.num_draft > 0;
  }
  if (any_mask) constraint_mask_seconds_ += absl::ToDoubleSeconds(absl::Now() - masks_start);
  const absl::Time forward_start = options_.clock();
  if (any_draft) {
    absl::Status s = executor_->ForwardVerified(batch, sample, draft_counts, &runs_);
    if (absl::IsUnimplemented(s)) {
      // Nothing ran: decode this step without the drafts (their positions'
      // pages stay assigned; every run is then one token) and stop drafting.
      EXL3_LOG(kWarning) << "the executor cannot verify draft tokens (" << s.message()
                         << "); speculative decoding is off";
      drafting_ = false;
      any_draft = false;
      const size_t words = static_cast<size_t>(worker::AllowedTokenWords(vocab_size_));
      for (size_t i = 0; i < batch.size(); ++i) {
        if (draft_counts[i] > 0) batch[i].tokens = batch[i].tokens.first(1);
        if (!batch[i].allowed_tokens.empty()) {
          batch[i].allowed_tokens = batch[i].allowed_tokens.first(words);
        }
        draft_counts[i] = 0;
      }
    } else if (!s.ok()) {
      return OnExecutorFailure(s);
    }
  }
  if (!any_draft) {
    if (absl::Status s = executor_->ForwardSampled(batch, sample, &tokens_); !s.ok()) {
      return OnExecutorFailure(s);
    }
  }
  if (!out.state_saves.empty()) {
    // The recurrent state of sequences whose chunk ended at a snapshot block.
    std::vector<worker::StateSnapshotSave> saves;
    saves.reserve(out.state_saves.size());
    for (const StateSnapshot& s : out.state_saves) {
      saves.push_back({.seq_id = s.seq_id,
                       .snapshot = {.slot = s.slot, .hash_hi = s.hash.hi, .hash_lo = s.hash.lo}});
    }
    if (absl::Status s = executor_->SaveStateSnapshots(saves); !s.ok()) {
      return OnExecutorFailure(s);
    }
  }
  const absl::Time done = options_.clock();
  StepRecord step;
  std::vector<int32_t> run_ids;
  for (size_t i = 0; i < out.batch.size(); ++i) {
    const ScheduledChunk& c = out.batch[i];
    if (!c.needs_logits) continue;
    if (unsatisfiable[i] != 0) {
      Fail(c.seq_id, absl::StatusCode::kInvalidArgument,
           "constraint: no token of the model's vocabulary can continue the output here (the "
           "vocabulary lacks the bytes the constraint needs next)");
      continue;
    }
    Live& live = live_.at(c.seq_id);
    ++sampled_sequences_;
    const int32_t drafted = draft_counts[i];
    const std::span<const worker::SampledToken> run =
        any_draft ? std::span<const worker::SampledToken>(runs_[i])
                  : std::span<const worker::SampledToken>(&tokens_[i], 1);
    // What the ranks return is checked before it moves any state: a run of
    // 1 .. drafted + 1 tokens in the vocabulary whose first tokens are the
    // accepted drafts.
    if (run.empty() || static_cast<int64_t>(run.size()) > drafted + 1) {
      return OnExecutorFailure(absl::InternalError(
          absl::StrCat("the ranks returned a run of ", run.size(), " tokens for sequence ",
                       c.seq_id, ", which drafted ", drafted)));
    }
    run_ids.clear();
    for (size_t j = 0; j < run.size(); ++j) {
      const int32_t id = run[j].id;
      if (id < 0 || id >= vocab_size_) {
        return OnExecutorFailure(absl::InternalError(
            absl::StrCat("the ranks sampled token ", id, " for sequence ", c.seq_id,
                         ", outside the vocabulary [0, ", vocab_size_, ")")));
      }
      if (j + 1 < run.size() && id != c.tokens[1 + j]) {
        return OnExecutorFailure(absl::InternalError(
            absl::StrCat("the ranks accepted token ", id, " for sequence ", c.seq_id,
                         " where its draft was ", c.tokens[1 + j])));
      }
      run_ids.push_back(id);
    }
    const int32_t accepted = static_cast<int32_t>(run.size()) - 1;
    if (drafted > 0) {
      ++spec_drafts_;
      spec_draft_tokens_ += static_cast<uint64_t>(drafted);
      spec_accepted_tokens_ += static_cast<uint64_t>(accepted);
      live.draft_length->Observe(drafted, accepted);
    }
    if (!OnRun(c.seq_id, live, run, done)) {
      scheduler_.AppendRun(c.seq_id, run_ids);
      if (live.drafter) live.drafter->Append(run_ids);
    }
  }
  if (drafting_ && options_.draft_governor) {
    DraftStepCost cost{.drafts_allowed = drafts_allowed, .drafted = any_draft, .decode_only = true};
    for (size_t i = 0; i < out.batch.size(); ++i) {
      const ScheduledChunk& c = out.batch[i];
      if (!c.needs_logits || static_cast<int64_t>(c.tokens.size()) - c.num_draft != 1) {
        cost.decode_only = false;
      } else {
        cost.tokens += any_draft ? static_cast<int64_t>(runs_[i].size()) : 1;
      }
    }
    cost.seconds = absl::ToDoubleSeconds(absl::Now() - wall_start);
    governor_.Observe(cost);
  }
  step.step = options_.clock() - now;
  step.forward = done - forward_start;
  ++steps_;
  step_seconds_ += absl::ToDoubleSeconds(step.step);
  coordinator_seconds_ += absl::ToDoubleSeconds(step.step - step.forward);
  if (options_.observer != nullptr) {
    step.batch_sequences = static_cast<int64_t>(out.batch.size());
    for (const ScheduledChunk& c : out.batch) {
      step.batch_tokens += static_cast<int64_t>(c.tokens.size());
      step.sampled_tokens += c.needs_logits ? 1 : 0;
    }
    options_.observer->OnStep(step);
  }
}

void LocalEngine::ProposeDrafts() {
  if (!drafting_) return;
  // Oldest first (seq ids grow with arrival), within the step's draft budget.
  std::vector<int64_t> ids;
  for (const auto& [seq_id, live] : live_) {
    if (live.draft_length && scheduler_.Contains(seq_id) && scheduler_.is_running(seq_id)) {
      ids.push_back(seq_id);
    }
  }
  std::sort(ids.begin(), ids.end());
  int64_t budget = options_.draft_token_budget;
  std::vector<DraftRequest> requests;
  for (int64_t seq_id : ids) {
    Live& live = live_.at(seq_id);
    // Only a sequence awaiting a single token's forward drafts.
    const std::span<const int32_t> tokens = scheduler_.tokens(seq_id);
    if (static_cast<int64_t>(tokens.size()) - scheduler_.computed(seq_id) != 1) continue;
    // A run of k drafts yields up to k + 1 tokens: never past max_tokens.
    const int64_t room = live.p.max_tokens - static_cast<int64_t>(live.output.size()) - 1;
    const int window = live.draft_length->Next();
    const int k = static_cast<int>(std::min<int64_t>({window, room, budget}));
    if (k <= 0) continue;
    if (live.drafter) {
      std::vector<int32_t> draft = live.drafter->Propose(k);
      ConstrainDraft(live, &draft);
      budget -= static_cast<int64_t>(draft.size());
      if (!draft.empty()) scheduler_.ProposeDraft(seq_id, std::move(draft));
    } else {
      requests.push_back({.seq_id = seq_id,
                          .tokens = tokens,
                          .k = k,
                          .matcher = live.matcher ? &*live.matcher : nullptr,
                          .never_draw = live.p.ignore_eos ? std::span<const int32_t>(facts_.eos_token_ids)
                                                          : std::span<const int32_t>()});
      budget -= k;
    }
  }
  if (requests.empty() || draft_model_ == nullptr) return;
  std::vector<std::vector<int32_t>> drafts;
  if (absl::Status s = draft_model_->Propose(requests, &drafts); !s.ok()) {
    EXL3_LOG(kWarning) << "draft model: " << s << "; this step decodes without drafts";
    return;
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ConstrainDraft(live_.at(requests[i].seq_id), &drafts[i]);
    scheduler_.ProposeDraft(requests[i].seq_id, std::move(drafts[i]));
  }
}

void LocalEngine::ConstrainDraft(Live& live, std::vector<int32_t>* draft) {
  if (!live.matcher) return;
  size_t accepted = 0;
  while (accepted < draft->size() && live.matcher->AcceptToken((*draft)[accepted]).ok()) {
    ++accepted;
  }
  draft->resize(accepted);
  if (accepted > 0) live.matcher->Rollback(static_cast<int>(accepted)).IgnoreError();
}

bool LocalEngine::FillChunkMasks(Live& live, std::span<const int32_t> drafts, int32_t* num_draft,
                                 std::vector<uint32_t>* rows) {
  constrained::TokenMatcher& matcher = *live.matcher;
  const size_t words = static_cast<size_t>(matcher.mask_words());
  rows->assign(words * (drafts.size() + 1), 0);
  auto allows = [&](size_t row, int32_t id) {
    return id >= 0 && ((*rows)[row * words + static_cast<size_t>(id) / 32] >> (id % 32)) & 1u;
  };
  size_t row = 0;
  bool any = false;
  for (;; ++row) {
    const std::span<uint32_t> mask(rows->data() + row * words, words);
    matcher.FillNextTokenMask(mask);
    // ignore_eos: the output does not end at EOS, so EOS is not offered
    // (the request still ends once the constraint is complete, before EOS).
    if (live.p.ignore_eos) {
      for (int32_t id : facts_.eos_token_ids) {
        if (id >= 0 && static_cast<size_t>(id) / 32 < words) mask[id / 32] &= ~(1u << (id % 32));
      }
    }
    ++constraint_masks_;
    if (row == 0) {
      for (size_t w = 0; w < words && !any; ++w) any = (*rows)[w] != 0;
    } else if (std::all_of(mask.begin(), mask.end(), [](uint32_t w) { return w == 0; })) {
      // Nothing may follow draft row - 1 (it ends the output: EOS, or a
      // complete constraint under ignore_eos): verify the drafts before it
      // and let the target draw it.
      matcher.Rollback(1).IgnoreError();
      --row;
      break;
    }
    if (row == drafts.size()) break;
    // Row r + 1 is the draw after draft r: walk the draft while it is allowed.
    if (!allows(row, drafts[row]) || !matcher.AcceptToken(drafts[row]).ok()) break;
  }
  // `row` drafts were walked; the rows past them are dropped with the drafts.
  if (row > 0) matcher.Rollback(static_cast<int>(row)).IgnoreError();
  *num_draft = static_cast<int32_t>(row);
  rows->resize(words * (row + 1));
  return any;
}

bool LocalEngine::OnRun(int64_t seq_id, Live& live, std::span<const worker::SampledToken> run,
                        absl::Time now) {
  // One observation per step: a verified run arrives at once (vLLM's
  // inter-token latency is per engine step too).
  if (options_.observer != nullptr) {
    if (!live.first_token) {
      options_.observer->OnFirstToken(now - live.p.arrival,
                                      static_cast<int64_t>(live.p.prompt.size()));
    } else if (live.last_token) {
      options_.observer->OnInterTokenLatency(now - *live.last_token);
    }
  }
  live.last_token = now;
  if (!live.first_token) live.first_token = now;
  const Pending& p = live.p;
  // Text still held back (a partial character, a possible stop-string start).
  auto flush_text = [&live]() {
    std::string rest;
    if (live.decoder) {
      std::string tail = live.decoder->Finish();
      rest = live.stops ? live.stops->Append(tail) : tail;
    }
    if (live.stops && !live.stops->stopped()) rest += live.stops->Flush();
    return rest;
  };
  // The step's chunk: every token of the run that is output, and its text.
  v1::GenerateResponse response;
  response.set_request_id(p.request_id);
  v1::GenerateStreamChunk* chunk = response.mutable_chunk();
  std::string text;
  auto send = [&]() {
    chunk->set_text(std::move(text));
    chunk->set_prompt_tokens(static_cast<uint32_t>(p.prompt.size()));
    chunk->set_completion_tokens(static_cast<uint32_t>(live.output.size()));
    chunk->set_cached_tokens(static_cast<uint32_t>(live.cached_tokens));
    p.callback(response);
  };
  for (const worker::SampledToken& token : run) {
    const bool request_stop = Contains(p.request_stop_ids, token.id);
    const bool eos = !p.ignore_eos && Contains(facts_.eos_token_ids, token.id);
    if (request_stop || eos) {
      text += flush_text();
      if (chunk->token_ids_size() > 0 || !text.empty()) send();
      Complete(seq_id, request_stop ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_EOS, "");
      return true;
    }
    if (live.matcher) {
      if (absl::Status s = live.matcher->AcceptToken(token.id); !s.ok()) {
        text += flush_text();
        if (chunk->token_ids_size() > 0 || !text.empty()) send();
        Fail(seq_id, absl::StatusCode::kInternal,
             absl::StrCat("the ranks drew token ", token.id,
                          ", which the request's constraint does not allow: ", s.message()));
        return true;
      }
    }
    live.output.push_back(token.id);
    chunk->add_token_ids(static_cast<uint32_t>(token.id));
    if (p.sampling.logprobs) chunk->add_logprobs(token.logprob);
    if (p.sampling.top_logprobs > 0) {
      v1::TopLogprobs* top = chunk->add_top_logprobs();
      for (const worker::TokenLogprob& t : token.top_logprobs) {
        top->add_token_ids(static_cast<uint32_t>(t.id));
        top->add_logprobs(t.logprob);
      }
    }
    if (live.decoder) {
      absl::StatusOr<std::string> piece = live.decoder->Push(token.id);
      if (piece.ok()) text += live.stops ? live.stops->Append(*piece) : *piece;
    }
    if (live.stops && live.stops->stopped()) {
      send();
      Complete(seq_id, v1::FINISH_REASON_STOP_STRING, live.stops->matched());
      return true;
    }
    if (live.matcher && live.matcher->IsTerminated()) {
      // Nothing but EOS could follow: end here rather than spend a step on it.
      text += flush_text();
      send();
      Complete(seq_id, v1::FINISH_REASON_CONSTRAINT_COMPLETE, "");
      return true;
    }
    if (static_cast<int64_t>(live.output.size()) >= p.max_tokens) {
      text += flush_text();
      send();
      Complete(seq_id, v1::FINISH_REASON_LENGTH, "");
      return true;
    }
  }
  send();
  return false;
}

void LocalEngine::Complete(int64_t seq_id, v1::FinishReason reason,
                           const std::string& matched_stop) {
  auto it = live_.find(seq_id);
  if (it == live_.end()) return;
  const Live& live = it->second;
  const absl::Time now = options_.clock();
  v1::GenerateResponse r;
  r.set_request_id(live.p.request_id);
  v1::GenerateComplete* c = r.mutable_complete();
  c->set_finish_reason(reason);
  for (int32_t id : live.output) c->add_output_ids(static_cast<uint32_t>(id));
  c->set_prompt_tokens(static_cast<uint32_t>(live.p.prompt.size()));
  c->set_completion_tokens(static_cast<uint32_t>(live.output.size()));
  c->set_cached_tokens(static_cast<uint32_t>(live.cached_tokens));
  if (live.first_token) {
    c->set_time_to_first_token_seconds(absl::ToDoubleSeconds(*live.first_token - live.p.arrival));
  }
  c->set_total_generation_time_seconds(absl::ToDoubleSeconds(now - live.p.arrival));
  c->set_queue_time_seconds(
      absl::ToDoubleSeconds(live.admitted.value_or(now) - live.p.arrival));
  c->set_matched_stop(matched_stop);
  c->set_seed(live.p.sampling.seed.value_or(0));
  if (options_.observer != nullptr) {
    options_.observer->OnRequestFinished(RequestRecord{
        .finish = reason == v1::FINISH_REASON_LENGTH  ? FinishKind::kLength
                  : reason == v1::FINISH_REASON_ABORT ? FinishKind::kAbort
                                                      : FinishKind::kStop,
        .arrival = live.p.arrival,
        .scheduled = live.admitted,
        .first_token = live.first_token,
        .finished = now,
        .prompt_tokens = static_cast<int64_t>(live.p.prompt.size()),
        .generation_tokens = static_cast<int64_t>(live.output.size()),
        .max_tokens = live.p.max_tokens});
  }
  ResponseCallback callback = std::move(it->second.p.callback);
  Forget(seq_id);
  callback(r);
}

void LocalEngine::Fail(int64_t seq_id, absl::StatusCode code, const std::string& message) {
  auto it = live_.find(seq_id);
  if (it == live_.end()) return;
  v1::GenerateResponse r;
  r.set_request_id(it->second.p.request_id);
  r.mutable_error()->set_code(RpcCode(code));
  r.mutable_error()->set_message(message);
  if (options_.observer != nullptr) options_.observer->OnRequestFailed(code);
  ResponseCallback callback = std::move(it->second.p.callback);
  Forget(seq_id);
  callback(r);
}

void LocalEngine::Forget(int64_t seq_id) {
  auto it = live_.find(seq_id);
  if (it == live_.end()) return;
  const std::string request_id = it->second.p.request_id;
  scheduler_.Finish(seq_id);  // its blocks come back at the next step
  live_.erase(it);
  absl::MutexLock lock(&mu_);
  ids_.erase(request_id);
}

void LocalEngine::OnExecutorFailure(const absl::Status& status) {
  const bool broken = GroupBroken(status);
  EXL3_LOG(kError) << "step failed (" << (broken ? "rank group broken" : "internal error")
                   << "): " << status;
  if (broken) {
    absl::MutexLock lock(&mu_);
    broken_ = true;
  }
  // Replay: every cache is gone with the group, but each request's tokens
  // (prompt + output so far), Sampler and stream state live on here, so once
  // the group re-forms the scheduler prefills them again and generation
  // continues exactly where it stopped (the same tokens, also for seeded
  // sampling: the sampler's state was never reset). Requests that arrive
  // meanwhile wait in the inbox.
  if (broken && options_.reform_timeout > absl::ZeroDuration()) {
    const absl::Status recovered = executor_->Recover(absl::Now() + options_.reform_timeout);
    if (recovered.ok()) {
      const std::vector<int64_t> requeued = scheduler_.RequeueAll();
      EXL3_LOG(kWarning) << "rank group re-formed; replaying " << requeued.size()
                         << " in-flight requests";
      absl::MutexLock lock(&mu_);
      broken_ = false;
      stat_replays_ += requeued.size();
      if (options_.observer != nullptr) {
        options_.observer->OnGroupReformed(static_cast<int64_t>(requeued.size()));
      }
      return;
    }
    EXL3_LOG(kError) << "the rank group did not re-form within "
                     << absl::FormatDuration(options_.reform_timeout) << ": " << recovered;
  }
  const std::vector<int64_t> ids = scheduler_.Reset();
  if (draft_model_ != nullptr) draft_model_->ForgetAll();
  if (!broken) {
    for (int64_t seq_id : ids) executor_->RemoveSequence(seq_id).IgnoreError();
  }
  std::vector<int64_t> all;
  for (const auto& [seq_id, live] : live_) all.push_back(seq_id);
  std::sort(all.begin(), all.end());
  const absl::StatusCode code = broken ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal;
  for (int64_t seq_id : all) {
    Fail(seq_id, code, absl::StrCat("the rank group failed: ", status.ToString()));
  }
}

void LocalEngine::PublishStats() {
  absl::MutexLock lock(&mu_);
  stat_running_ = scheduler_.num_running();
  stat_waiting_ = scheduler_.num_waiting();
  stat_free_blocks_ = scheduler_.free_blocks();
  stat_preemptions_ = scheduler_.num_preemptions();
  stat_idle_ = scheduler_.empty();
  stat_steps_ = steps_;
  stat_result_bytes_ = executor_->result_bytes_received();
  stat_sampled_sequences_ = sampled_sequences_;
  stat_step_seconds_ = step_seconds_;
  stat_coordinator_seconds_ = coordinator_seconds_;
  stat_prefix_ = scheduler_.prefix_cache_stats();
  stat_spec_drafts_ = spec_drafts_;
  stat_spec_draft_tokens_ = spec_draft_tokens_;
  stat_spec_accepted_tokens_ = spec_accepted_tokens_;
  stat_constraint_masks_ = constraint_masks_;
  stat_constraint_mask_seconds_ = constraint_mask_seconds_;
}

namespace {

// config.json's max_position_embeddings and quantization_config.bits, when present.
struct ConfigExtras {
  int64_t max_position_embeddings = 0;
  double bits = 16.0;
};

ConfigExtras ReadConfigExtras(const std::string& dir) {
  ConfigExtras extras;
  std::ifstream in(dir + "/config.json");
  if (!in) return extras;
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json config = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) return extras;
  if (auto it = config.find("max_position_embeddings"); it != config.end() && it->is_number()) {
    extras.max_position_embeddings = it->get<int64_t>();
  }
  if (auto q = config.find("quantization_config"); q != config.end() && q->is_object()) {
    if (auto b = q->find("bits"); b != q->end() && b->is_number()) extras.bits = b->get<double>();
  }
  return extras;
}

}  // namespace

absl::StatusOr<EngineModel> LoadEngineModel(EngineOptions* options_ptr) {
  EngineOptions& options = *options_ptr;
  if (options.model_dir.empty()) return Invalid("model_dir", "is empty");
  if (options.tensor_parallel < 1) return Invalid("tensor_parallel", "must be >= 1");
  if (options.expert_parallel < 0) return Invalid("expert_parallel", "must be >= 0");
  if (options.kv.page_size_tokens < 1) return Invalid("kv.page_size_tokens", "must be >= 1");
  if (options.kv_disk_blocks < 0) return Invalid("kv.disk.blocks", "must be >= 0");
  if (options.kv_disk_blocks > 0 && options.kv_disk_path.empty()) {
    return Invalid("kv.disk.path", "is required with kv.disk.blocks > 0");
  }
  if (options.kv.num_pages < 1) return Invalid("kv.num_pages", "must be >= 1");
  if (options.max_running < 1) return Invalid("max_running", "must be >= 1");
  if (options.max_state_sequences < 0) return Invalid("max_state_sequences", "must be >= 0");
  if (options.state_snapshots < 0) return Invalid("state_snapshots", "must be >= 0");
  if (options.state_snapshot_interval < 0) return Invalid("state_snapshot_interval", "must be >= 0");
  if (options.step_token_budget < 1) return Invalid("step_token_budget", "must be >= 1");
  if (options.max_queue < 1) return Invalid("max_queue", "must be >= 1");
  if (options.default_max_tokens < 1) return Invalid("default_max_tokens", "must be >= 1");
  if (options.speculative != SpeculativeMethod::kNone) {
    if (options.draft_tokens < 1 || options.draft_tokens > kMaxDraftTokens) {
      return Invalid("draft_tokens", absl::StrCat("must be in [1, ", kMaxDraftTokens, "]"));
    }
    if (options.draft_token_budget < 1) return Invalid("draft_token_budget", "must be >= 1");
    if (options.ngram.min_match < 1 || options.ngram.max_match < options.ngram.min_match) {
      return Invalid("ngram", "needs 1 <= min_match <= max_match");
    }
    if (options.speculative == SpeculativeMethod::kDraftModel && options.draft_model_dir.empty()) {
      return Invalid("draft_model_dir", "is required with speculative decoding by a draft model");
    }
  }
  const int64_t pool = options.kv.num_pages * options.kv.page_size_tokens;
  if (options.max_context > pool) {
    return Invalid("max_context", absl::StrCat(options.max_context, " exceeds the KV pool's ",
                                               pool, " positions (kv pages x page size)"));
  }
  const ConfigExtras extras = ReadConfigExtras(options.model_dir);
  if (options.max_context == 0 && extras.max_position_embeddings > 0) {
    options.max_context = std::min(pool, extras.max_position_embeddings);
  }
  EngineModel model;
  model.bits_per_weight = extras.bits;
  EXL3_ASSIGN_OR_RETURN(model.facts, worker::rank::ReadModelFacts(options.model_dir));
  if (std::filesystem::exists(options.model_dir + "/tokenizer.json")) {
    EXL3_ASSIGN_OR_RETURN(model.tokenizer, Tokenizer::Load(options.model_dir));
  }
  return model;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateLocalEngine(const EngineOptions& given) {
  EngineOptions options = given;
  EXL3_ASSIGN_OR_RETURN(EngineModel model, LoadEngineModel(&options));
  worker::rank::LocalExecutorOptions local;
  local.model_dir = options.model_dir;
  local.ranks = options.tensor_parallel > 1 ? options.tensor_parallel
                                            : std::max(1, options.expert_parallel);
  local.expert_parallel = options.expert_parallel;
  local.threads_per_rank = options.threads_per_rank;
  local.rank_executable = options.rank_executable;
  local.kv = options.kv;
  if (options.enable_prefix_caching) {
    local.kv_disk_path = options.kv_disk_path;
    local.kv_disk_slots = options.kv_disk_blocks;
  }
  local.step_timeout = options.rank_step_timeout;
  local.metrics_port = options.rank_metrics_port;
  local.metrics_host = options.rank_metrics_host;
  local.spill = options.spill;
  local.capacities = options.rank_capacities;
  local.prefill_precision = options.prefill_precision;
  local.decode_precision = options.decode_precision;
  EXL3_ASSIGN_OR_RETURN(worker::rank::LocalExecutor built, worker::rank::CreateLocalExecutor(local));
  model.facts = std::move(built.facts);
  // GetServerInfo lists local ranks as for a remote group; the engine owns
  // the executor, so it outlives every GetServerInfo call.
  if (!options.rank_info && built.rank_state) {
    options.rank_info = [state = built.rank_state] { return LocalRankInfos(state()); };
  }
  std::unique_ptr<worker::StepExecutor> executor = std::move(built.executor);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<DraftModel> draft, LoadDraftModel(options, model));
  return std::unique_ptr<Engine>(
      new LocalEngine(options, std::move(model), std::move(executor), std::move(draft)));
}

absl::StatusOr<std::unique_ptr<DraftModel>> LoadDraftModel(const EngineOptions& options,
                                                          const EngineModel& target) {
  if (options.speculative != SpeculativeMethod::kDraftModel) return nullptr;
  if (options.draft_model_dir.empty()) {
    return Invalid("draft_model_dir", "is required with speculative decoding by a draft model");
  }
  worker::rank::LocalExecutorOptions local;
  local.model_dir = options.draft_model_dir;
  local.ranks = 1;
  local.threads_per_rank = options.threads_per_rank;
  local.kv = options.kv;
  local.kv.caller_assigns_pages = false;
  local.executor_assigns_pages = true;
  local.prefill_precision = options.prefill_precision;
  local.decode_precision = options.decode_precision;
  EXL3_ASSIGN_OR_RETURN(worker::rank::LocalExecutor built, worker::rank::CreateLocalExecutor(local));
  if (built.facts.arch.has_recurrent_state()) {
    // The draft model rolls its own rejected tokens back (TruncateSequence),
    // which a recurrent state cannot do.
    return Invalid("draft_model_dir",
                   absl::StrCat(options.draft_model_dir, " (", built.facts.arch.architecture,
                                ") keeps a recurrent state per sequence and cannot roll back "
                                "rejected drafts; use a model with attention only as the draft"));
  }
  const int64_t target_vocab = target.facts.arch.vocab_size;
  if (built.executor->vocab_size() != target_vocab) {
    return Invalid("draft_model_dir",
                   absl::StrCat(options.draft_model_dir, " has a vocabulary of ",
                                built.executor->vocab_size(), " tokens, the model ",
                                options.model_dir, " one of ", target_vocab,
                                ": a draft model needs the same tokenizer"));
  }
  EXL3_LOG(kInfo) << "draft model " << options.draft_model_dir << " loaded in this process ("
                  << options.kv.num_pages << " KV pages of its own)";
  return std::make_unique<DraftModel>(std::move(built.executor));
}

}  // namespace exl3serve::coordinator
