// `exl3serve make-test-model`: a small random HF-format model.
#include <cstdio>
#include <memory>

#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "sharding/test_model.h"

namespace exl3serve::cli {

CommandRunner RegisterMakeTestModelCommand(CLI::App& app) {
  struct Args {
    std::string out;
    sharding::TestModelOptions model;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--out", args->out, "directory to write")->required();
  app.add_option("--arch", args->model.arch, "llama | qwen3 | qwen3-moe | mixtral")
      ->capture_default_str();
  app.add_option("--layers", args->model.num_layers)->capture_default_str();
  app.add_option("--hidden", args->model.hidden_size)->capture_default_str();
  app.add_option("--intermediate", args->model.intermediate_size)->capture_default_str();
  app.add_option("--vocab", args->model.vocab_size)->capture_default_str();
  app.add_option("--experts", args->model.num_experts)->capture_default_str();
  app.add_option("--seed", args->model.seed)->capture_default_str();
  app.add_option("--shards", args->model.num_shards, "number of safetensors files")
      ->capture_default_str();
  app.add_flag("--tie-embeddings", args->model.tie_word_embeddings);
  app.add_flag("--peaked-logits", args->model.peaked_logits,
               "large logit margins: greedy decoding is deterministic under batching and "
               "quantization (ignored with --tie-embeddings)");
  return [args]() -> absl::Status {
    absl::Status status = sharding::WriteTestModel(args->out, args->model);
    if (status.ok()) std::printf("wrote %s (%s)\n", args->out.c_str(), args->model.arch.c_str());
    return status;
  };
}

}  // namespace exl3serve::cli
