// `exl3serve make-test-model`: a small random HF-format model.
// `exl3serve make-demo-model`: the same with demo defaults (vocab 151 936,
// peaked logits, Qwen3 special ids) and the real Qwen3 tokenizer files
// (llama, qwen3, qwen3-moe, glm4-moe and deepseek-v3).
#include <cstdio>
#include <memory>

#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "sharding/test_model.h"

namespace exl3serve::cli {
namespace {

// The shape and seed options both commands share; defaults shown from `model`.
void AddModelOptions(CLI::App& app, sharding::TestModelOptions* model) {
  app.add_option("--layers", model->num_layers)->capture_default_str();
  app.add_option("--hidden", model->hidden_size)->capture_default_str();
  app.add_option("--intermediate", model->intermediate_size)->capture_default_str();
  app.add_option("--vocab", model->vocab_size)->capture_default_str();
  app.add_option("--experts", model->num_experts)->capture_default_str();
  app.add_option("--seed", model->seed)->capture_default_str();
  app.add_option("--shards", model->num_shards, "number of safetensors files")
      ->capture_default_str();
}

}  // namespace

CommandRunner RegisterMakeTestModelCommand(CLI::App& app) {
  struct Args {
    std::string out;
    sharding::TestModelOptions model;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--out", args->out, "directory to write")->required();
  app.add_option("--arch", args->model.arch,
                 "llama | qwen3 | qwen3-moe | mixtral | glm4-moe | deepseek-v3 | qwen3-next | "
                 "qwen3.5 | qwen3.5-moe (all but the first four start from their own odd-sized "
                 "shapes, sharding::Glm4MoeTestDefaults / DeepseekV3TestDefaults / "
                 "Qwen3NextTestDefaults; shape options given win)")
      ->capture_default_str();
  AddModelOptions(app, &args->model);
  auto no_q_lora = std::make_shared<bool>(false);
  app.add_flag("--no-q-lora", *no_q_lora,
               "deepseek-v3: q_lora_rank null (a plain q_proj instead of q_a_proj + q_b_proj)");
  app.add_flag("--tie-embeddings", args->model.tie_word_embeddings);
  app.add_flag("--peaked-logits", args->model.peaked_logits,
               "large logit margins: greedy decoding is deterministic under batching and "
               "quantization (ignored with --tie-embeddings)");
  return [args, no_q_lora, &app]() -> absl::Status {
    const std::string& arch = args->model.arch;
    const bool hybrid = arch == "qwen3-next" || arch == "qwen3.5" || arch == "qwen3.5-moe";
    if (arch == "glm4-moe" || arch == "deepseek-v3" || hybrid) {
      sharding::TestModelOptions glm = arch == "glm4-moe"      ? sharding::Glm4MoeTestDefaults()
                                       : arch == "deepseek-v3" ? sharding::DeepseekV3TestDefaults()
                                                               : sharding::Qwen3NextTestDefaults(arch);
      if (*no_q_lora) glm.q_lora_rank = 0;
      const sharding::TestModelOptions& given = args->model;
      if (app.count("--layers") > 0) glm.num_layers = given.num_layers;
      if (app.count("--hidden") > 0) glm.hidden_size = given.hidden_size;
      if (app.count("--intermediate") > 0) glm.intermediate_size = given.intermediate_size;
      if (app.count("--vocab") > 0) glm.vocab_size = given.vocab_size;
      if (app.count("--experts") > 0) glm.num_experts = given.num_experts;
      glm.seed = given.seed;
      glm.num_shards = given.num_shards;
      glm.tie_word_embeddings = given.tie_word_embeddings;
      glm.peaked_logits = given.peaked_logits;
      args->model = glm;
    }
    absl::Status status = sharding::WriteTestModel(args->out, args->model);
    if (status.ok()) std::printf("wrote %s (%s)\n", args->out.c_str(), args->model.arch.c_str());
    return status;
  };
}

CommandRunner RegisterMakeDemoModelCommand(CLI::App& app) {
  struct Args {
    std::string out;
    std::string arch = "qwen3";
    std::string tokenizer_dir = sharding::DefaultDemoTokenizerDir();
    bool no_tokenizer = false;
    sharding::TestModelOptions model = *sharding::DemoModelDefaults("qwen3");
  };
  auto args = std::make_shared<Args>();
  app.add_option("--out", args->out, "directory to write")->required();
  app.add_option("--arch", args->arch,
                 "llama | qwen3 | qwen3-moe | glm4-moe | deepseek-v3 | qwen3-next | qwen3.5 | "
                 "qwen3.5-moe (all but the first three: the make-test-model shape, "
                 "sharding::Glm4MoeTestDefaults / DeepseekV3TestDefaults / Qwen3NextTestDefaults, "
                 "with the demo vocab and peaked logits)")
      ->capture_default_str();
  app.add_option("--tokenizer-dir", args->tokenizer_dir,
                 "holds the Qwen3 tokenizer.json and tokenizer_config.json "
                 "(scripts/fetch-demo-tokenizer.sh puts them in the default)")
      ->capture_default_str();
  app.add_flag("--no-tokenizer", args->no_tokenizer,
               "write no tokenizer files (token ids only; peaked over every id)");
  AddModelOptions(app, &args->model);
  return [args, &app]() -> absl::Status {
    // The arch's defaults, then the shape options given on top (only those
    // given: glm4-moe's defaults differ from the options' shown defaults).
    EXL3_ASSIGN_OR_RETURN(sharding::TestModelOptions model,
                          sharding::DemoModelDefaults(args->arch));
    const sharding::TestModelOptions& given = args->model;
    if (app.count("--layers") > 0) model.num_layers = given.num_layers;
    if (app.count("--hidden") > 0) model.hidden_size = given.hidden_size;
    if (app.count("--intermediate") > 0) model.intermediate_size = given.intermediate_size;
    if (app.count("--vocab") > 0) model.vocab_size = given.vocab_size;
    if (app.count("--experts") > 0) model.num_experts = given.num_experts;
    model.seed = given.seed;
    model.num_shards = given.num_shards;
    EXL3_RETURN_IF_ERROR(sharding::WriteDemoModel(
        args->out, model, args->no_tokenizer ? std::string() : args->tokenizer_dir));
    std::printf("wrote %s (%s, %d layers, hidden %lld, vocab %lld, %s)\n", args->out.c_str(),
                model.arch.c_str(), model.num_layers, static_cast<long long>(model.hidden_size),
                static_cast<long long>(model.vocab_size),
                args->no_tokenizer ? "no tokenizer" : "Qwen3 tokenizer");
    std::printf("convert with: exl3serve convert --in %s --out OUT --bits 4 --head-bits 16\n",
                args->out.c_str());
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
