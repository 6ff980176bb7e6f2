// `exl3serve tokenize --model DIR (--text TEXT | --decode IDS) [--add-special]`:
// encode text to a JSON array of ids, or decode comma-separated ids to text,
// with the model directory's tokenizer.json.
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
#include "coordinator/tokenizer/tokenizer.h"

namespace exl3serve::cli {

CommandRunner RegisterTokenizeCommand(CLI::App& app) {
  struct Args {
    std::string model, text, decode;
    bool add_special = false;
    bool skip_special = false;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "model directory with tokenizer.json")->required();
  auto* text = app.add_option("--text", args->text, "text to encode; prints the ids as a JSON array");
  auto* decode = app.add_option("--decode", args->decode, "comma-separated ids to decode; prints the text");
  text->excludes(decode);
  app.add_flag("--add-special", args->add_special,
               "with --text: add the special tokens of the post-processor (BOS, ...)");
  app.add_flag("--skip-special", args->skip_special, "with --decode: leave out special tokens");
  return [args, text, decode]() -> absl::Status {
    if (text->count() == 0 && decode->count() == 0) {
      return absl::InvalidArgumentError("tokenize needs --text or --decode");
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::Tokenizer> tokenizer,
                          coordinator::Tokenizer::Load(args->model));
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
