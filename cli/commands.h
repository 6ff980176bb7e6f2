// cli/commands.h — the subcommands of the `exl3serve` binary. Each lives in its
// own file (<name>_command.cc) and registers itself on the CLI11 app; main()
// only parses, runs the chosen command and turns its Status into an exit code.
#ifndef EXL3SERVE_CLI_COMMANDS_H_
#define EXL3SERVE_CLI_COMMANDS_H_

#include <functional>

#include "absl/status/status.h"

namespace CLI {
class App;
}

namespace exl3serve::cli {

// A registered command: set up its options on `app`, and return the function
// that runs it once parsing has succeeded.
using CommandRunner = std::function<absl::Status()>;

CommandRunner RegisterDemoCommand(CLI::App& app);
CommandRunner RegisterConvertCommand(CLI::App& app);
CommandRunner RegisterInspectCommand(CLI::App& app);
CommandRunner RegisterMakeTestModelCommand(CLI::App& app);
CommandRunner RegisterMakeDemoModelCommand(CLI::App& app);  // test model + Qwen3 tokenizer
CommandRunner RegisterBenchCommand(CLI::App& app);  // `bench gemv`
CommandRunner RegisterTokenizeCommand(CLI::App& app);
CommandRunner RegisterGenerateCommand(CLI::App& app);
CommandRunner RegisterImportLlama2cCommand(CLI::App& app);
CommandRunner RegisterPlanCommand(CLI::App& app);  // shard plan of a model over N ranks
CommandRunner RegisterWorkerCommand(CLI::App& app);
CommandRunner RegisterCoordinatorCommand(CLI::App& app);  // rank endpoint of a cluster
CommandRunner RegisterLaunchCommand(CLI::App& app);       // one box of a cluster YAML
CommandRunner RegisterServeCommand(CLI::App& app);       // coordinator + local ranks + gRPC API
CommandRunner RegisterClientCommand(CLI::App& app);      // gRPC client of a running server
CommandRunner RegisterBenchServeCommand(CLI::App& app);  // load test over the gRPC API
CommandRunner RegisterEvalCommand(CLI::App& app);        // perplexity / KL / top-1 on text

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_COMMANDS_H_
