// `exl3serve tokenize --model DIR (--text TEXT | --decode IDS | --chat-json FILE) ...`:
// encode text to a JSON array of ids, decode comma-separated ids to text, or
// render a conversation with the model's chat template (tokenizer_config.json)
// and print the prompt exactly (no newline added) or, with --ids, its ids.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/chat_template.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"

namespace exl3serve::cli {

namespace {

struct TokenizeArgs {
  std::string model, text, decode, chat_json;
  bool add_special = false;
  bool skip_special = false;
  bool add_generation_prompt = false;
  bool ids = false;
};

void PrintIds(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) absl::StrAppend(&out, i > 0 ? "," : "", ids[i]);
  out += "]\n";
  std::fputs(out.c_str(), stdout);
}

// --chat-json: the file's conversation through the model's chat template.
absl::Status RenderChat(const coordinator::Tokenizer& tokenizer, const TokenizeArgs& args) {
  absl::StatusOr<std::string> text = sharding::ReadFileToString(args.chat_json);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat("--chat-json: ", text.status().message()));
  }
  // ordered_json keeps the file's key order, which tojson output in the prompt shows.
  nlohmann::ordered_json file = nlohmann::ordered_json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (file.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("--chat-json ", args.chat_json, ": not valid JSON"));
  }
  coordinator::ChatPromptOptions options;
  options.add_generation_prompt = args.add_generation_prompt;
  nlohmann::ordered_json messages;
  if (file.is_array()) {
    messages = std::move(file);
  } else if (file.is_object() && file.contains("messages")) {
    options.extra_context = nlohmann::ordered_json::object();
    for (auto& [key, value] : file.items()) {
      if (key == "messages") {
        messages = value;
      } else if (key == "tools") {
        options.tools = value;
      } else if (key == "add_generation_prompt") {
        options.add_generation_prompt = options.add_generation_prompt || (value.is_boolean() && value.get<bool>());
      } else {
        options.extra_context[key] = value;
      }
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--chat-json ", args.chat_json, ": expected an array of messages or an object with `messages`"));
  }
  absl::StatusOr<std::string> prompt = coordinator::RenderChatPrompt(tokenizer, messages, options);
  if (!prompt.ok()) {
    return absl::Status(prompt.status().code(),
                        absl::StrCat("--chat-json ", args.chat_json, ": ", prompt.status().message()));
  }
  if (args.ids) {
    // As transformers' apply_chat_template(tokenize=True): the template already
    // wrote the special tokens, so none are added.
    PrintIds(tokenizer.Encode(*prompt, {.add_special_tokens = false}));
  } else {
    std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  }
  return absl::OkStatus();
}

}  // namespace

CommandRunner RegisterTokenizeCommand(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  app.add_option("--model", args->model, "model directory with tokenizer.json")->required();
  auto* text = app.add_option("--text", args->text, "text to encode; prints the ids as a JSON array");
  auto* decode = app.add_option("--decode", args->decode, "comma-separated ids to decode; prints the text");
  auto* chat = app.add_option(
      "--chat-json", args->chat_json,
      "JSON file with a conversation: an array of {role, content, ...} messages, or an object with "
      "`messages`, optional `tools` and further template variables (enable_thinking, ...); prints the "
      "prompt rendered with the model's chat template");
  text->excludes(decode);
  chat->excludes(text);
  chat->excludes(decode);
  app.add_flag("--add-generation-prompt", args->add_generation_prompt,
               "with --chat-json: end with the header of the assistant's turn");
  app.add_flag("--ids", args->ids,
               "with --chat-json: print the prompt's token ids (a JSON array) instead of its text");
  app.add_flag("--add-special", args->add_special,
               "with --text: add the special tokens of the post-processor (BOS, ...)");
  app.add_flag("--skip-special", args->skip_special, "with --decode: leave out special tokens");
  return [args, text, decode, chat]() -> absl::Status {
    if (text->count() == 0 && decode->count() == 0 && chat->count() == 0) {
      return absl::InvalidArgumentError("tokenize needs --text, --decode or --chat-json");
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::Tokenizer> tokenizer,
                          coordinator::Tokenizer::Load(args->model));
    if (chat->count() > 0) return RenderChat(*tokenizer, *args);
    if (text->count() > 0) {
      const std::vector<int32_t> ids =
          tokenizer->Encode(args->text, {.add_special_tokens = args->add_special});
      std::string out = "[";
      for (size_t i = 0; i < ids.size(); ++i) absl::StrAppend(&out, i > 0 ? "," : "", ids[i]);
      out += "]\n";
      std::fputs(out.c_str(), stdout);
      return absl::OkStatus();
    }
    std::vector<int32_t> ids;
    for (absl::string_view part : absl::StrSplit(args->decode, ',', absl::SkipWhitespace())) {
      int32_t id;
      if (!absl::SimpleAtoi(part, &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--decode: `", part, "` is not a token id (expected e.g. 1,2,3)"));
      }
      ids.push_back(id);
    }
    EXL3_ASSIGN_OR_RETURN(std::string decoded,
                          tokenizer->Decode(ids, {.skip_special_tokens = args->skip_special}));
    std::fwrite(decoded.data(), 1, decoded.size(), stdout);
    std::fputc('\n', stdout);
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
