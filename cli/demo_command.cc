// `exl3serve demo` (also what plain `exl3serve` runs): the furthest the
// product gets today on a built-in default — write a small Llama-shaped model
// with deterministic random weights, convert it to EXL3 at 3.5 bits per
// weight (mixed K), print the per-layer bits and error table, load the result
// back, and generate greedily from both the original and the EXL3 model on one
// rank (token ids: the built-in model has no tokenizer).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "cli/report_table.h"
#include "common/status_macros.h"
#include "kernels/reconstruct.h"
#include "sharding/converter.h"
#include "sharding/exl3_model.h"
#include "sharding/inspect.h"
#include "sharding/test_model.h"
#include "worker/model/generator.h"
#include "worker/model/kv_cache.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve::cli {

CommandRunner RegisterDemoCommand(CLI::App& app) {
  struct Args {
    std::string work_dir;
    double bits = 3.5;
    int threads = 0;
    bool keep = false;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--work-dir", args->work_dir, "where to write the models (default: a temp dir)");
  app.add_option("--bits", args->bits, "target bits per weight")->capture_default_str();
  app.add_option("--threads", args->threads, "0 = all cores")->capture_default_str();
  app.add_flag("--keep", args->keep, "keep the models afterwards");
  return [args]() -> absl::Status {
    namespace fs = std::filesystem;
    std::string work = args->work_dir;
    bool remove_after = !args->keep;
    if (work.empty()) {
      std::string pattern = (fs::temp_directory_path() / "exl3serve-demo-XXXXXX").string();
      if (::mkdtemp(pattern.data()) == nullptr) {
        return absl::InternalError("cannot create a temporary directory");
      }
      work = pattern;
    } else {
      remove_after = false;
    }
    const std::string hf = work + "/hf";
    const std::string exl3 = work + "/exl3";
    sharding::TestModelOptions model;  // llama, 2 layers, hidden 256, vocab 1000
    model.peaked_logits = true;        // greedy decoding with clear margins
    std::printf("exl3serve demo: built-in %s model, %d layers, hidden %lld, vocab %lld -> %s\n",
                model.arch.c_str(), model.num_layers, static_cast<long long>(model.hidden_size),
                static_cast<long long>(model.vocab_size), hf.c_str());
    EXL3_RETURN_IF_ERROR(sharding::WriteTestModel(hf, model));

    sharding::ConvertOptions convert;
    convert.in_dir = hf;
    convert.out_dir = exl3;
    convert.bits = args->bits;
    convert.threads = args->threads;
    std::printf("converting to EXL3 at %.2f bits per weight (codebook mul1, head 6 bits)\n\n",
                args->bits);
    std::fflush(stdout);
    EXL3_ASSIGN_OR_RETURN(sharding::ConvertReport report, sharding::ConvertModel(convert));
    std::fputs(FormatConvertReport(report).c_str(), stdout);

    EXL3_ASSIGN_OR_RETURN(auto loaded, sharding::Exl3Model::Open(exl3));
    for (const sharding::Exl3LinearInfo& l : loaded->linears()) {
      EXL3_ASSIGN_OR_RETURN(kernels::Exl3LinearData data, loaded->LoadLinear(l.key));
      std::vector<uint16_t> w_h(static_cast<size_t>(data.k * data.n));
      EXL3_RETURN_IF_ERROR(kernels::DecodeInnerMatrix(data.view(), w_h.data()));
    }
    std::printf("\nloaded %s back: %zu EXL3 linears decode, %.3f bits per weight\n", exl3.c_str(),
                loaded->linears().size(), loaded->AverageBitsPerWeight(false));

    // Generate on one rank from the original (bf16 weights in fp32) and from
    // the EXL3 model, greedy, same prompt ids.
    const std::vector<int32_t> prompt = {1, 42, 7, 311};
    auto generate = [&](worker::StepExecutor& executor) -> absl::StatusOr<std::vector<int32_t>> {
      worker::GenerationOptions options;
      options.max_new_tokens = 16;
      options.sampling.temperature = 0.0f;
      std::vector<int32_t> ids;
      EXL3_RETURN_IF_ERROR(worker::Generate(executor, 0, prompt, options,
                                            [&](const worker::GeneratedStep& step) {
                                              ids.push_back(step.token.id);
                                              return true;
                                            })
                               .status());
      return ids;
    };
    auto run = [&](const std::string& dir) -> absl::StatusOr<std::vector<int32_t>> {
      EXL3_ASSIGN_OR_RETURN(auto model, worker::Transformer::Load(dir));
      EXL3_ASSIGN_OR_RETURN(worker::PagedKvCache cache, model->CreateKvCache({}));
      worker::LocalStepExecutor local(model.get(), std::move(cache));
      return generate(local);
    };
    EXL3_ASSIGN_OR_RETURN(std::vector<int32_t> original, run(hf));
    EXL3_ASSIGN_OR_RETURN(std::vector<int32_t> quantized, run(exl3));
    // The EXL3 model again on two rank processes (tensor parallelism: each
    // holds half the heads, MLP channels and vocab; shm all-reduce).
    worker::rank::LocalGroupOptions group_options;
    group_options.model_dir = exl3;
    group_options.world_size = 2;
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<worker::rank::LocalGroup> group,
                          worker::rank::LocalGroup::Start(group_options));
    EXL3_ASSIGN_OR_RETURN(std::vector<int32_t> parallel, generate(*group));
    group.reset();
    auto join = [](const std::vector<int32_t>& v) {
      std::string out;
      for (int32_t id : v) out += (out.empty() ? "" : " ") + std::to_string(id);
      return out;
    };
    size_t agree = 0;
    while (agree < original.size() && agree < quantized.size() &&
           original[agree] == quantized[agree]) {
      ++agree;
    }
    std::printf("\ngreedy continuation of prompt ids [1 42 7 311], one rank, CPU:\n");
    std::printf("  original (bf16): %s\n", join(original).c_str());
    std::printf("  EXL3 %.2f bpw:    %s\n", report.bits_achieved, join(quantized).c_str());
    std::printf("  the first %zu of %zu tokens agree\n", agree, original.size());
    std::printf("  EXL3 on 2 ranks:  %s (%s one rank)\n", join(parallel).c_str(),
                parallel == quantized ? "identical to" : "DIFFERENT from");
    if (parallel != quantized) {
      return absl::InternalError("tensor-parallel generation differs from one rank");
    }
    if (remove_after) {
      std::error_code ec;
      fs::remove_all(work, ec);
    } else {
      std::printf("models kept in %s (inspect with: exl3serve inspect %s)\n", work.c_str(),
                  exl3.c_str());
    }
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
