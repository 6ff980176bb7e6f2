// `exl3serve import-llama2c --in FILE.bin --out DIR [--tokenizer tokenizer.bin]`:
// a llama2.c checkpoint (e.g. stories260K) as a Hugging Face Llama directory,
// with its llama2.c tokenizer as tokenizer.json + tokenizer_config.json
// (sharding/llama2c_tokenizer.h) when --tokenizer is given.
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "sharding/llama2c_import.h"
#include "sharding/llama2c_tokenizer.h"
#include "sharding/safetensors_json.h"
#include "common/status_macros.h"
#include "absl/strings/str_cat.h"

namespace exl3serve::cli {

CommandRunner RegisterImportLlama2cCommand(CLI::App& app) {
  struct Args {
    std::string in, out, tokenizer;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--in", args->in, "llama2.c checkpoint (.bin)")->required();
  app.add_option("--out", args->out, "directory to write")->required();
  app.add_option("--tokenizer", args->tokenizer,
                 "llama2.c tokenizer.bin to write as tokenizer.json (e.g. tok512.bin)");
  return [args]() -> absl::Status {
    EXL3_RETURN_IF_ERROR(sharding::ImportLlama2c(args->in, args->out));
    if (!args->tokenizer.empty()) {
      EXL3_ASSIGN_OR_RETURN(nlohmann::json config,
                            sharding::ReadJsonFile(args->out + "/config.json"));
      const int64_t vocab = config.value("vocab_size", int64_t{0});
      EXL3_ASSIGN_OR_RETURN(sharding::Llama2cVocab pieces,
                            sharding::ReadLlama2cTokenizer(args->tokenizer, vocab));
      EXL3_RETURN_IF_ERROR(sharding::WriteHfTokenizer(pieces, args->out));
      std::printf("tokenizer: %zu pieces from %s\n", pieces.pieces.size(), args->tokenizer.c_str());
    }
    std::printf("wrote %s\n", args->out.c_str());
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
