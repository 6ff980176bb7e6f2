// `exl3serve client --addr HOST:PORT ...`: a command-line client of the public
// gRPC API (proto/exl3serve/v1/generation.proto).
//
//   client --prompt TEXT | --prompt-ids 1,2,3 [--max-tokens N ...]
//       streams the continuation to stdout as chunks arrive (text; token ids
//       with --ids, or at the end when the server sent no text, i.e. a model
//       without tokenizer.json), then the finish reason and counts on stderr.
//       A failed call exits 1 with its status code and message.
//   client --info                  server and model info (JSON)
//   client --health [--deep]       HealthCheck; exit 0 iff healthy
//   client --health --wait-ready-ms N
//       first waits (grpc.health.v1 Watch, connecting as the server comes
//       up) until the server reports SERVING, at most N ms.
#include <grpcpp/grpcpp.h>
#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/client_credentials.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "exl3serve/v1/generation.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"

namespace exl3serve::cli {
namespace {

// An OpenAI-style chat file as a ChatInput: an array of messages or an object
// with messages, tools, chat_template_kwargs and add_generation_prompt.
absl::Status ReadChatJson(const std::string& path, v1::ChatInput* chat) {
  EXL3_ASSIGN_OR_RETURN(nlohmann::json j, sharding::ReadJsonFile(path));
  const nlohmann::json& messages = j.is_array() ? j : j.value("messages", nlohmann::json());
  if (!messages.is_array() || messages.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"messages\" array"));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": messages[", i, "] needs a string role"));
    }
    v1::ChatMessage* out = chat->add_messages();
    out->set_role(m["role"].get<std::string>());
    if (m.contains("content") && m["content"].is_string()) out->set_content(m["content"].get<std::string>());
    if (m.contains("tool_call_id") && m["tool_call_id"].is_string()) {
      out->set_tool_call_id(m["tool_call_id"].get<std::string>());
    }
    if (m.contains("name") && m["name"].is_string()) out->set_name(m["name"].get<std::string>());
    for (const nlohmann::json& c : m.value("tool_calls", nlohmann::json::array())) {
      v1::ToolCall* call = out->add_tool_calls();
      call->set_id(c.value("id", ""));
      const nlohmann::json f = c.value("function", nlohmann::json::object());
      call->set_function_name(f.value("name", ""));
      const nlohmann::json args = f.value("arguments", nlohmann::json::object());
      call->set_arguments_json(args.is_string() ? args.get<std::string>() : args.dump());
    }
  }
  if (j.is_object()) {
    if (j.contains("tools")) chat->set_tools_json(j["tools"].dump());
    if (j.contains("chat_template_kwargs")) chat->set_template_kwargs_json(j["chat_template_kwargs"].dump());
    if (j.contains("add_generation_prompt") && j["add_generation_prompt"].is_boolean()) {
      chat->set_add_generation_prompt(j["add_generation_prompt"].get<bool>());
    }
  }
  return absl::OkStatus();
}

namespace v1 = ::exl3serve::v1;

absl::Status FromGrpc(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, " failed: ",
                                   absl::StatusCodeToString(
                                       static_cast<absl::StatusCode>(status.error_code())),
                                   ": ", status.error_message()));
}

absl::StatusOr<std::vector<uint32_t>> ParseIds(const std::string& text, const char* flag) {
  std::vector<uint32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    uint32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": `", std::string(part), "` is not a token id (expected e.g. 1,2,3)"));
    }
    ids.push_back(id);
  }
  return ids;
}

void Print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

const char* FinishName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_EOS: return "eos";
    case v1::FINISH_REASON_STOP_STRING: return "stop_string";
    case v1::FINISH_REASON_ABORT: return "abort";
    case v1::FINISH_REASON_CONSTRAINT_COMPLETE: return "constraint_complete";
    default: return "unspecified";
  }
}

void SetTimeout(grpc::ClientContext& context, int64_t timeout_ms) {
  if (timeout_ms > 0) context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(timeout_ms)));
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

// Waits until the standard health service says SERVING for our service.
absl::Status WaitReady(const std::shared_ptr<grpc::Channel>& channel, int64_t wait_ms) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_wait_for_ready(true);  // connect as soon as the server listens
  SetTimeout(context, wait_ms);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("exl3serve.v1.Generation");
  auto watch = health->Watch(&context, request);
  grpc::health::v1::HealthCheckResponse response;
  while (watch->Read(&response)) {
    if (response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      context.TryCancel();
      while (watch->Read(&response)) {
      }
      (void)watch->Finish();
      return absl::OkStatus();
    }
  }
  const grpc::Status status = watch->Finish();
  return absl::UnavailableError(absl::StrCat(
      "the server did not become ready within ", wait_ms, " ms (last health: ",
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()), "; ",
      status.ok() ? "stream ended" : status.error_message(), ")"));
}

}  // namespace

CommandRunner RegisterClientCommand(CLI::App& app) {
  struct Args {
    std::string addr = "127.0.0.1:50051";
    std::string prompt, prompt_ids, stop_ids, request_id, chat_json;
    bool prompt_given = false;
    std::vector<std::string> stop;
    bool ids = false, ignore_eos = false, add_special_tokens = false, logprobs = false;
    bool info = false, health = false, deep = false;
    int64_t wait_ready_ms = 0;
    int64_t timeout_ms = 0;
    int max_tokens = 64;
    float temperature = 0.0f, top_p = 0.0f, min_p = 0.0f, repetition_penalty = 0.0f;
    int top_k = 0;
    int64_t seed = -1;
    int64_t deadline_ms = 0;
    // Structured output (GenerateRequest.constraint): one of these.
    std::string json_schema_file, regex, grammar_file;
    std::vector<std::string> choices;
    ClientCredentialOptions credentials;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--addr", args->addr, "server address host:port")->capture_default_str();
  AddClientCredentialFlags(app, &args->credentials);
  auto* prompt = app.add_option("--prompt", args->prompt, "prompt text (the server tokenizes it)");
  auto* prompt_ids =
      app.add_option("--prompt-ids", args->prompt_ids, "prompt as comma-separated token ids");
  prompt->excludes(prompt_ids);
  auto* chat = app.add_option("--chat-json", args->chat_json,
                              "a chat: JSON file with an array of messages, or {\"messages\": [...], "
                              "\"tools\": [...], \"chat_template_kwargs\": {...}, "
                              "\"add_generation_prompt\": bool} (the model's chat template renders it)");
  chat->excludes(prompt)->excludes(prompt_ids);
  app.add_flag("--add-special-tokens", args->add_special_tokens,
               "with --prompt: apply the tokenizer's special-token template (BOS, ...)");
  app.add_flag("--ids", args->ids, "print generated token ids instead of text");
  app.add_option("--max-tokens", args->max_tokens, "tokens to generate at most")->capture_default_str();
  app.add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-p", args->top_p, "(0, 1]; 0 = unset");
  app.add_option("--top-k", args->top_k, "0 = off");
  app.add_option("--min-p", args->min_p, "0 = off");
  app.add_option("--repetition-penalty", args->repetition_penalty, "0 = unset");
  app.add_option("--seed", args->seed, "sampling seed (-1: the server picks)")->capture_default_str();
  app.add_option("--stop", args->stop, "stop string (repeatable)");
  app.add_option("--stop-ids", args->stop_ids, "comma-separated stop token ids");
  app.add_flag("--ignore-eos", args->ignore_eos, "do not stop at the model's EOS ids");
  app.add_flag("--logprobs", args->logprobs, "ask for the log-probability of every token");
  app.add_option("--json-schema", args->json_schema_file,
                 "constrain the output to the JSON Schema in this file ('{}' in it: any JSON value)");
  app.add_option("--regex", args->regex, "constrain the output to this regular expression");
  app.add_option("--choice", args->choices, "constrain the output to one of these strings (repeatable)");
  app.add_option("--grammar", args->grammar_file, "constrain the output to the GBNF grammar in this file");
  app.add_option("--request-id", args->request_id, "request id (default: the server assigns one)");
  app.add_option("--deadline-ms", args->deadline_ms, "the request's end-to-end deadline (0 = server default)");
  app.add_option("--timeout-ms", args->timeout_ms, "gRPC deadline of each call (0 = none)");
  app.add_flag("--info", args->info, "print server and model info as JSON");
  app.add_flag("--health", args->health, "HealthCheck: exit 0 iff the server is healthy");
  app.add_flag("--deep", args->deep, "with --health: a one-token forward through every rank");
  app.add_option("--wait-ready-ms", args->wait_ready_ms,
                 "with --health: first wait up to this long for the server to become ready");
  return [args]() -> absl::Status {
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(64 << 20);
    EXL3_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                          MakeClientChannel(args->addr, &args->credentials, channel_args));
    const auto prepare = [args](grpc::ClientContext& context) {
      AddCallCredentials(args->credentials, &context);
    };
    auto stub = v1::Generation::NewStub(channel);

    if (args->health) {
      if (args->wait_ready_ms > 0) EXL3_RETURN_IF_ERROR(WaitReady(channel, args->wait_ready_ms));
      grpc::ClientContext context;
      SetTimeout(context, args->timeout_ms > 0 ? args->timeout_ms : (args->deep ? 60'000 : 5'000));
      prepare(context);
      v1::HealthCheckRequest request;
      request.set_deep(args->deep);
      v1::HealthCheckResponse response;
      EXL3_RETURN_IF_ERROR(FromGrpc(stub->HealthCheck(&context, request, &response), "HealthCheck"));
      std::printf("%s: %s\n", response.healthy() ? "healthy" : "unhealthy", response.message().c_str());
      if (!response.healthy()) return absl::UnavailableError(response.message());
      return absl::OkStatus();
    }
    if (args->info) {
      v1::GetServerInfoResponse server;
      v1::GetModelInfoResponse model;
      {
        grpc::ClientContext context;
        SetTimeout(context, args->timeout_ms > 0 ? args->timeout_ms : 10'000);
        prepare(context);
        EXL3_RETURN_IF_ERROR(FromGrpc(stub->GetModelInfo(&context, {}, &model), "GetModelInfo"));
      }
      {
        grpc::ClientContext context;
        SetTimeout(context, args->timeout_ms > 0 ? args->timeout_ms : 10'000);
        prepare(context);
        EXL3_RETURN_IF_ERROR(FromGrpc(stub->GetServerInfo(&context, {}, &server), "GetServerInfo"));
      }
      // The template's text is for programs (GetModelInfo.chat_template); the
      // summary says only whether there is one.
      model.clear_chat_template();
      Print(absl::StrCat("{\"model\": ", ToJson(model), ", \"server\": ", ToJson(server), "}\n"));
      return absl::OkStatus();
    }

    v1::GenerateRequest request;
    request.set_request_id(args->request_id);
    if (!args->prompt_ids.empty()) {
      EXL3_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, ParseIds(args->prompt_ids, "--prompt-ids"));
      request.mutable_tokenized()->mutable_input_ids()->Add(ids.begin(), ids.end());
    } else if (!args->prompt.empty()) {
      request.set_text(args->prompt);
    } else if (!args->chat_json.empty()) {
      EXL3_RETURN_IF_ERROR(ReadChatJson(args->chat_json, request.mutable_chat()));
    } else {
      return absl::InvalidArgumentError(
          "client needs --prompt, --prompt-ids, --chat-json, --info or --health");
    }
    request.set_add_special_tokens(args->add_special_tokens);
    request.set_deadline_ms(args->deadline_ms);
    v1::SamplingParams& sampling = *request.mutable_sampling_params();
    sampling.set_temperature(args->temperature);
    sampling.set_top_p(args->top_p);
    sampling.set_top_k(args->top_k);
    sampling.set_min_p(args->min_p);
    sampling.set_repetition_penalty(args->repetition_penalty);
    sampling.set_max_tokens(args->max_tokens);
    for (const std::string& s : args->stop) sampling.add_stop(s);
    EXL3_ASSIGN_OR_RETURN(std::vector<uint32_t> stop_ids, ParseIds(args->stop_ids, "--stop-ids"));
    sampling.mutable_stop_token_ids()->Add(stop_ids.begin(), stop_ids.end());
    sampling.set_ignore_eos(args->ignore_eos);
    if (args->seed >= 0) sampling.set_seed(static_cast<uint64_t>(args->seed));
    sampling.set_logprobs(args->logprobs);
    {
      auto read = [](const std::string& path, const char* flag) -> absl::StatusOr<std::string> {
        std::ifstream in(path);
        if (!in) return absl::NotFoundError(absl::StrCat(flag, " ", path, ": cannot open"));
        return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      };
      const int given = !args->json_schema_file.empty() + !args->regex.empty() +
                        !args->choices.empty() + !args->grammar_file.empty();
      if (given > 1) {
        return absl::InvalidArgumentError("give one of --json-schema, --regex, --choice, --grammar");
      }
      v1::OutputConstraint* c = given > 0 ? request.mutable_constraint() : nullptr;
      if (!args->json_schema_file.empty()) {
        EXL3_ASSIGN_OR_RETURN(std::string text, read(args->json_schema_file, "--json-schema"));
        c->set_json_schema(text);
      } else if (!args->regex.empty()) {
        c->set_regex(args->regex);
      } else if (!args->choices.empty()) {
        for (const std::string& s : args->choices) c->mutable_choice()->add_choices(s);
      } else if (!args->grammar_file.empty()) {
        EXL3_ASSIGN_OR_RETURN(std::string text, read(args->grammar_file, "--grammar"));
        c->set_grammar(text);
      }
    }

    grpc::ClientContext context;
    SetTimeout(context, args->timeout_ms);
    prepare(context);
    auto reader = stub->Generate(&context, request);
    v1::GenerateResponse response;
    std::vector<uint32_t> all_ids;
    bool printed_text = false;
    bool complete = false;
    while (reader->Read(&response)) {
      if (response.has_chunk()) {
        const v1::GenerateStreamChunk& chunk = response.chunk();
        if (args->ids) {
          for (uint32_t id : chunk.token_ids()) {
            Print(absl::StrCat(all_ids.empty() ? "" : " ", id));
            all_ids.push_back(id);
          }
        } else {
          all_ids.insert(all_ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
          if (!chunk.text().empty()) {
            Print(chunk.text());
            printed_text = true;
          }
        }
      } else if (response.has_complete()) {
        const v1::GenerateComplete& done = response.complete();
        if (!args->ids && !printed_text && done.output_ids_size() > 0) {
          // No text from the server (a model without tokenizer.json): ids.
          std::string line;
          for (uint32_t id : done.output_ids()) absl::StrAppend(&line, line.empty() ? "" : " ", id);
          Print(line);
        }
        Print("\n");
        std::fprintf(stderr,
                     "request %s: finish %s%s%s, prompt %u tokens, completion %u tokens, "
                     "ttft %.3f s, total %.3f s, queued %.3f s, cached %u tokens\n",
                     response.request_id().c_str(), FinishName(done.finish_reason()),
                     done.matched_stop().empty() ? "" : " ", done.matched_stop().c_str(),
                     done.prompt_tokens(), done.completion_tokens(),
                     done.time_to_first_token_seconds(), done.total_generation_time_seconds(),
                     done.queue_time_seconds(), done.cached_tokens());
        complete = true;
      } else if (response.has_error()) {
        Print("\n");
        std::fprintf(stderr, "request %s: error %d: %s\n", response.request_id().c_str(),
                     response.error().code(), response.error().message().c_str());
      }
    }
    EXL3_RETURN_IF_ERROR(FromGrpc(reader->Finish(), "Generate"));
    if (!complete) return absl::InternalError("Generate: the stream ended without a complete message");
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
