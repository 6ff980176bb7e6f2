// `exl3serve import-llama2c --in FILE.bin --out DIR`: a llama2.c checkpoint
// (e.g. stories260K) as a Hugging Face Llama directory.
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "sharding/llama2c_import.h"

namespace exl3serve::cli {

CommandRunner RegisterImportLlama2cCommand(CLI::App& app) {
  struct Args {
    std::string in, out;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--in", args->in, "llama2.c checkpoint (.bin)")->required();
  app.add_option("--out", args->out, "directory to write")->required();
  return [args]() -> absl::Status {
    absl::Status status = sharding::ImportLlama2c(args->in, args->out);
    if (status.ok()) std::printf("wrote %s\n", args->out.c_str());
    return status;
  };
}

}  // namespace exl3serve::cli
