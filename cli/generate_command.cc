// `exl3serve generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) ...`:
// loads a model (EXL3 or plain Hugging Face) and streams a continuation of
// one prompt to stdout, as text through the model's tokenizer.json or, with
// --ids (or when there is no tokenizer), as space-separated token ids.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/capacity_flags.h"
#include "cli/precision_flags.h"
#include "cli/spill_flags.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/stream_decoder.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "sharding/npy_writer.h"
#include "worker/model/generator.h"
#include "worker/model/linear.h"
#include "coordinator/stop_strings.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve::cli {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text, const char* flag) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": `", part, "` is not a token id (expected e.g. 1,2,3)"));
    }
    ids.push_back(id);
  }
  return ids;
}

void Print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

CommandRunner RegisterGenerateCommand(CLI::App& app) {
  struct Args {
    std::string model, prompt, prompt_ids, stop_ids, logits_out;
    std::vector<std::string> stop;
    bool ids = false, add_bos = false, ignore_eos = false;
    int64_t max_tokens = 64;
    int kv_bits = 16;
    int64_t kv_pages = 0;
    int64_t seed = -1;
    worker::SamplingParams sampling;
    int tp = 1, ep = 0, threads = 1;
    std::string comm = "shm", bootstrap, ucx_tls;
    std::vector<std::string> rank_wrappers;
    int64_t step_timeout_ms = 60'000;
    SpillFlags spill;
    PrecisionFlags precision;
    std::string capacities;
  };
  auto args = std::make_shared<Args>();
  args->sampling.temperature = 0.0f;
  app.add_option("--model", args->model, "model directory (EXL3 or Hugging Face)")->required();
  auto* prompt = app.add_option("--prompt", args->prompt, "prompt text (needs tokenizer.json)");
  auto* prompt_ids =
      app.add_option("--prompt-ids", args->prompt_ids, "prompt as comma-separated token ids");
  prompt->excludes(prompt_ids);
  app.add_flag("--ids", args->ids, "print generated token ids instead of text");
  app.add_flag("--add-bos", args->add_bos,
               "with --prompt: apply the tokenizer's special-token template (BOS, ...)");
  app.add_option("--max-tokens", args->max_tokens, "tokens to generate at most")
      ->capture_default_str();
  app.add_option("--temperature", args->sampling.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", args->sampling.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", args->sampling.top_p, "1 = off")->capture_default_str();
  app.add_option("--min-p", args->sampling.min_p, "0 = off")->capture_default_str();
  app.add_option("--repetition-penalty", args->sampling.repetition_penalty, "1 = off")
      ->capture_default_str();
  app.add_option("--presence-penalty", args->sampling.presence_penalty)->capture_default_str();
  app.add_option("--frequency-penalty", args->sampling.frequency_penalty)->capture_default_str();
  app.add_option("--seed", args->seed, "sampling seed (-1: random)")->capture_default_str();
  app.add_option("--stop", args->stop, "stop string (repeatable; text mode only)");
  app.add_option("--stop-ids", args->stop_ids, "comma-separated stop token ids (besides EOS)");
  app.add_flag("--ignore-eos", args->ignore_eos, "do not stop at the model's EOS ids");
  app.add_option("--kv-bits", args->kv_bits, "KV cache storage: 16 (fp16), 8, 4 (int per head), 32")
      ->capture_default_str();
  app.add_option("--kv-pages", args->kv_pages,
                 "KV cache pages of 16 positions (0: enough for prompt + max tokens)")
      ->capture_default_str();
  app.add_option("--tp", args->tp,
                 "rank processes to run the model on (tensor parallelism; 1 = this process)")
      ->capture_default_str();
  app.add_option("--ep", args->ep,
                 "MoE: expert-parallel groups among the ranks (0 = one per rank; --tp defaults "
                 "to --ep when only --ep is given)");
  app.add_option("--threads-per-rank", args->threads, "kernel threads of each rank process")
      ->capture_default_str();
  app.add_option("--comm", args->comm, "collective backend of the ranks: shm or ucx")
      ->capture_default_str();
  app.add_option("--bootstrap", args->bootstrap, "ucx: host:port where rank 0 listens");
  app.add_option("--ucx-tls", args->ucx_tls, "ucx: transports, e.g. tcp");
  app.add_option("--rank-wrapper", args->rank_wrappers,
                 "per rank (repeat in rank order): a command that starts the rank, e.g. "
                 "\"ip netns exec box-a\"");
  AddPrecisionFlags(app, &args->precision);
  app.add_option("--step-timeout-ms", args->step_timeout_ms,
                 "with --tp: a step (and each collective) must finish within this")
      ->capture_default_str();
  app.add_option("--capacities", args->capacities,
                 "with --tp: relative capacity per rank, e.g. 1,1,0.5 (a rank with less gets "
                 "proportionally less of every layer; default: all equal)");
  AddSpillFlags(app, &args->spill);
  app.add_option("--logits-out", args->logits_out,
                 "write the logits of every generated token as a float32 .npy [steps, vocab]");
  return [args]() -> absl::Status {
    const int ranks = args->tp > 1 ? args->tp : (args->ep > 1 ? args->ep : 1);
    EXL3_ASSIGN_OR_RETURN(const std::vector<double> capacities,
                          ParseCapacitiesFlag(args->capacities, ranks));
    // One rank: this process runs the model; else every rank gets the flags.
    if (ranks == 1) EXL3_RETURN_IF_ERROR(args->precision.Apply());
    // The config's EOS ids (read cheaply: the driver does not load weights
    // when ranks do).
    std::vector<int32_t> eos_ids;
    std::unique_ptr<worker::Transformer> model;
    if (ranks == 1) {
      worker::TransformerLoadOptions load_options;
      load_options.spill = args->spill.Policy();
      EXL3_ASSIGN_OR_RETURN(model, worker::Transformer::Load(args->model, load_options));
      eos_ids = model->config().eos_token_ids;
    } else {
      EXL3_ASSIGN_OR_RETURN(worker::ModelConfig config, worker::ReadModelConfig(args->model));
      eos_ids = config.eos_token_ids;
    }
    std::unique_ptr<coordinator::Tokenizer> tokenizer;
    if (std::filesystem::exists(args->model + "/tokenizer.json")) {
      EXL3_ASSIGN_OR_RETURN(tokenizer, coordinator::Tokenizer::Load(args->model));
    }
    std::vector<int32_t> prompt;
    if (!args->prompt_ids.empty()) {
      EXL3_ASSIGN_OR_RETURN(prompt, ParseIds(args->prompt_ids, "--prompt-ids"));
    } else if (!args->prompt.empty()) {
      if (tokenizer == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            args->model, " has no tokenizer.json; give the prompt as --prompt-ids"));
      }
      prompt = tokenizer->Encode(args->prompt, {.add_special_tokens = args->add_bos});
    }
    if (prompt.empty()) return absl::InvalidArgumentError("generate needs --prompt or --prompt-ids");
    const bool text_mode = !args->ids && tokenizer != nullptr;
    if (!args->stop.empty() && !text_mode) {
      return absl::InvalidArgumentError("--stop needs text output (a tokenizer.json, no --ids)");
    }

    worker::GenerationOptions options;
    options.sampling = args->sampling;
    if (args->seed >= 0) options.sampling.seed = static_cast<uint64_t>(args->seed);
    options.max_new_tokens = args->max_tokens;
    if (!args->ignore_eos) options.stop_token_ids = eos_ids;
    EXL3_ASSIGN_OR_RETURN(std::vector<int32_t> stop_ids, ParseIds(args->stop_ids, "--stop-ids"));
    options.stop_token_ids.insert(options.stop_token_ids.end(), stop_ids.begin(), stop_ids.end());

    worker::KvCacheOptions kv;
    EXL3_ASSIGN_OR_RETURN(kv.dtype, worker::KvCacheDtypeFromBits(args->kv_bits));
    const int64_t positions = static_cast<int64_t>(prompt.size()) + std::max<int64_t>(0, args->max_tokens);
    kv.num_pages = args->kv_pages > 0 ? args->kv_pages
                                      : (positions + kv.page_size_tokens - 1) / kv.page_size_tokens;
    std::unique_ptr<worker::StepExecutor> executor;
    if (ranks == 1) {
      EXL3_ASSIGN_OR_RETURN(worker::PagedKvCache cache, model->CreateKvCache(kv));
      executor = std::make_unique<worker::LocalStepExecutor>(model.get(), std::move(cache));
    } else {
      worker::rank::LocalGroupOptions group;
      group.model_dir = args->model;
      group.world_size = ranks;
      group.expert_parallel = args->ep;
      group.threads_per_rank = args->threads;
      group.comm.backend = args->comm;
      group.comm.bootstrap_address = args->bootstrap;
      group.comm.ucx_tls = args->ucx_tls;
      for (const std::string& wrapper : args->rank_wrappers) {
        group.rank_wrappers.push_back(absl::StrSplit(wrapper, ' ', absl::SkipEmpty()));
      }
      group.kv = kv;
      group.step_timeout = absl::Milliseconds(args->step_timeout_ms);
      group.spill = args->spill.Policy();  // every rank applies it to its own shard
      group.capacities = capacities;
      group.prefill_precision = args->precision.Prefill();
      group.decode_precision = args->precision.Decode();
      EXL3_ASSIGN_OR_RETURN(std::unique_ptr<worker::rank::LocalGroup> started,
                            worker::rank::LocalGroup::Start(group));
      for (int r = 0; r < ranks; ++r) {
        EXL3_LOG(kInfo) << "rank " << r << ": read " << started->bytes_read(r)
                        << " checkpoint bytes (plan: " << started->planned_bytes(r) << ")";
      }
      executor = std::move(started);
    }

    std::optional<coordinator::StreamDecoder> stream;
    if (text_mode) stream.emplace(*tokenizer, coordinator::DecodeOptions{.skip_special_tokens = true});
    coordinator::StopStringMatcher stops(args->stop);
    std::vector<float> logits_log;
    absl::Status decode_status;
    int64_t generated = 0;
    auto on_step = [&](const worker::GeneratedStep& step) -> bool {
      ++generated;
      if (!args->logits_out.empty()) {
        logits_log.insert(logits_log.end(), step.logits.begin(), step.logits.end());
      }
      if (!text_mode) {
        Print(absl::StrCat(generated > 1 ? " " : "", step.token.id));
        return true;
      }
      absl::StatusOr<std::string> piece = stream->Push(step.token.id);
      if (!piece.ok()) {
        decode_status = piece.status();
        return false;
      }
      Print(stops.Append(*piece));
      return !stops.stopped();
    };
    EXL3_ASSIGN_OR_RETURN(worker::FinishReason finish,
                          worker::Generate(*executor, 0, prompt, options, on_step));
    EXL3_RETURN_IF_ERROR(decode_status);
    if (text_mode) Print(stops.Append(stream->Finish()) + stops.Flush());
    Print("\n");
    EXL3_LOG(kInfo) << "generated " << generated << " tokens, finish: "
                    << (finish == worker::FinishReason::kLength      ? "length"
                        : finish == worker::FinishReason::kStopToken ? "stop token"
                                                                     : "stop string");
    if (!args->logits_out.empty()) {
      EXL3_RETURN_IF_ERROR(sharding::WriteNpyFloat32(
          args->logits_out, {generated, executor->vocab_size()}, logits_log));
    }
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
