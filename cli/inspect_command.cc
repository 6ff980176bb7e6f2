// `exl3serve inspect DIR [--dequant NAME --out FILE.npy]`.
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "sharding/exl3_model.h"
#include "sharding/inspect.h"
#include "sharding/npy_writer.h"

namespace exl3serve::cli {

CommandRunner RegisterInspectCommand(CLI::App& app) {
  struct Args {
    std::string dir, dequant, out;
  };
  auto args = std::make_shared<Args>();
  app.add_option("dir", args->dir, "EXL3 model directory")->required();
  app.add_option("--dequant", args->dequant,
                 "layer (module key) whose effective weight to write, HF orientation (out, in)");
  app.add_option("--out", args->out, "the .npy file to write with --dequant");
  return [args]() -> absl::Status {
    if (args->dequant.empty() != args->out.empty()) {
      return absl::InvalidArgumentError("--dequant and --out go together");
    }
    EXL3_ASSIGN_OR_RETURN(auto model, sharding::Exl3Model::Open(args->dir));
    if (args->dequant.empty()) {
      std::fputs(sharding::FormatModelSummary(*model).c_str(), stdout);
      return absl::OkStatus();
    }
    EXL3_ASSIGN_OR_RETURN(sharding::DequantizedWeight w,
                          sharding::DequantizeWeight(*model, args->dequant));
    EXL3_RETURN_IF_ERROR(sharding::WriteNpyFloat32(args->out, w.shape, w.values));
    std::printf("wrote %s: float32 [%lld, %lld] (out, in)\n", args->out.c_str(),
                static_cast<long long>(w.shape[0]), static_cast<long long>(w.shape[1]));
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
