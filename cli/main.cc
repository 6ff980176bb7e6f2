// exl3serve — one binary, subcommands. main() parses, runs the chosen command
// and is the only place that decides the exit code:
//   0 success, 1 the command failed (message on stderr), 2 bad command line.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "cli/commands.h"
#include "common/logging.h"

int main(int argc, char** argv) {
  // Abseil's mutex deadlock detection is on in Debian's build; in the serving
  // path it cost ~2 % of the coordinator's samples (GraphCycles bookkeeping
  // on every lock). The tests keep it on (they do not run this main).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{
      "exl3serve: serve and convert EXL3-quantized language models.\n"
      "Run without arguments to run the built-in demo."};
  app.set_version_flag("--version", "exl3serve 0.1.0");
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug|info|warning|error")
      ->check(CLI::IsMember({"debug", "info", "warning", "error"}));

  using exl3serve::cli::CommandRunner;
  std::vector<std::pair<CLI::App*, CommandRunner>> commands;
  auto add = [&](CommandRunner (*reg)(CLI::App&), const char* name, const char* help) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands.emplace_back(sub, reg(*sub));
  };
  add(exl3serve::cli::RegisterDemoCommand, "demo",
      "convert a small built-in model (deterministic random weights) and print its bits and error table");
  add(exl3serve::cli::RegisterConvertCommand, "convert",
      "quantize a Hugging Face model directory to EXL3");
  add(exl3serve::cli::RegisterInspectCommand, "inspect",
      "list the layers of an EXL3 model, or write one layer's effective weight as .npy");
  add(exl3serve::cli::RegisterMakeTestModelCommand, "make-test-model",
      "write a small random Hugging Face-format model (for tests and demos)");
  add(exl3serve::cli::RegisterMakeDemoModelCommand, "make-demo-model",
      "write a demo model: random weights with peaked logits and the real Qwen3 tokenizer");
  add(exl3serve::cli::RegisterBenchCommand, "bench",
      "micro-benchmarks (gemv: one TrellisGemm configuration, one line of output)");
  add(exl3serve::cli::RegisterTokenizeCommand, "tokenize",
      "encode text to token ids (JSON array) or decode ids to text with a model's tokenizer.json");
  add(exl3serve::cli::RegisterGenerateCommand, "generate",
      "load a model (EXL3 or Hugging Face) and stream a continuation of one prompt");
  add(exl3serve::cli::RegisterImportLlama2cCommand, "import-llama2c",
      "convert a llama2.c checkpoint (e.g. stories260K.bin) to a Hugging Face Llama directory");
  add(exl3serve::cli::RegisterEvalCommand, "eval",
      "perplexity of a model on a text file; with --reference, KL and top-1 agreement against another");
  add(exl3serve::cli::RegisterPlanCommand, "plan",
      "print which rank holds which heads, channels, experts and vocab rows of a model, and its bytes");
  add(exl3serve::cli::RegisterWorkerCommand, "worker",
      "one rank of a tensor/expert-parallel group (--coordinator HOST:PORT, or started by `generate --tp N`)");
  add(exl3serve::cli::RegisterServeCommand, "serve",
      "serve a model over gRPC (exl3serve.v1.Generation) on N local rank processes");
  add(exl3serve::cli::RegisterClientCommand, "client",
      "talk to a running server: stream a generation, --info, or --health");
  add(exl3serve::cli::RegisterBenchServeCommand, "bench-serve",
      "load-test a running server: throughput, TTFT and inter-token latency p50/p99");
  add(exl3serve::cli::RegisterCoordinatorCommand, "coordinator",
      "the cluster coordinator: ranks (`worker --coordinator`) on any box register here");
  add(exl3serve::cli::RegisterLaunchCommand, "launch",
      "start one box of a cluster YAML (boxes:): its ranks, and the coordinator on its box");
  app.require_subcommand(0, 1);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  using exl3serve::LogLevel;
  exl3serve::SetLogLevel(log_level == "debug"     ? LogLevel::kDebug
                         : log_level == "warning" ? LogLevel::kWarning
                         : log_level == "error"   ? LogLevel::kError
                                                  : LogLevel::kInfo);

  CommandRunner run = commands.front().second;  // no subcommand: the demo
  for (auto& [sub, runner] : commands) {
    if (sub->parsed()) run = runner;
  }
  const absl::Status status = run();
  if (!status.ok()) {
    std::fprintf(stderr, "exl3serve: error: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
