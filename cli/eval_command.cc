// `exl3serve eval --model DIR --text FILE [--reference DIR] [--context 256]
// [--stride 128] [--range all|first-half|second-half] [--max-tokens N]
// [--chunk-tokens C] [--tp N] [--ep M] [--json FILE]`: teacher-forced quality
// of a model on real text.
//
// The text (the --range part of the file, cut at a line boundary) is encoded
// with the model's tokenizer.json, BOS first, into one token stream. Windows
// of --context tokens start every --stride tokens (the last one ends at the
// stream's end); each window scores only the tokens the previous window did
// not (all but its first token for the first window), the usual sliding-window
// perplexity, so every token after the first is scored exactly once with up to
// --context - 1 tokens of left context. Each window is one fresh sequence,
// fed in chunks of --chunk-tokens (default: the whole window; C <= 16 runs the
// decode path and its --decode-precision) through the executor's full-logits
// mode (worker/api/step_executor.h Forward, kAllTokens).
//
// Reported: tokens scored, mean NLL and perplexity = exp(mean NLL); with
// --reference DIR (same tokenizer, same vocabulary) the reference's
// perplexity over the same windows and, per scored token, KL(ref || model) =
// Σ_v p_ref(v) (log p_ref(v) - log p_model(v)) in nats (mean and p99) and
// top-1 agreement (the arg-maxes equal, lowest id on ties). All in float64
// from the fp32 logits. Progress goes to stderr (--no-progress to silence);
// the table to stdout, and JSON to --json.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cli/commands.h"
#include "cli/precision_flags.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "kernels/cpu/thread_pool.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"
#include "worker/rank/executor_factory.h"

namespace exl3serve::cli {
namespace {

struct Window {
  int64_t begin = 0, end = 0;  // tokens [begin, end) of the stream
  int64_t scored = 0;          // the last `scored` tokens are targets
};

// The sliding windows over n tokens (see the file comment).
std::vector<Window> Windows(int64_t n, int64_t context, int64_t stride) {
  std::vector<Window> windows;
  int64_t prev_end = 1;  // token 0 (BOS) is never a target
  for (int64_t begin = 0; prev_end < n; begin += stride) {
    const int64_t end = std::min(begin + context, n);
    if (end <= prev_end) break;
    windows.push_back({begin, end, end - prev_end});
    prev_end = end;
  }
  return windows;
}

// log-softmax of one row, in float64.
void LogSoftmax(const float* row, int64_t vocab, std::vector<double>* out) {
  out->resize(static_cast<size_t>(vocab));
  double mx = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
  const double log_z = mx + std::log(sum);
  for (int64_t v = 0; v < vocab; ++v) (*out)[v] = row[v] - log_z;
}

int64_t ArgMax(const float* row, int64_t vocab) {
  return std::max_element(row, row + vocab) - row;
}

// Runs one window through `executor` and returns its logits [len, vocab].
absl::Status WindowLogits(worker::StepExecutor& executor, std::span<const int32_t> tokens,
                          int64_t chunk, int64_t page_tokens, std::vector<float>* logits) {
  constexpr int64_t kSeq = 1;
  EXL3_RETURN_IF_ERROR(executor.AddSequence(kSeq));
  const int64_t pages = (static_cast<int64_t>(tokens.size()) + page_tokens - 1) / page_tokens;
  std::vector<int32_t> page_ids(static_cast<size_t>(pages));
  std::iota(page_ids.begin(), page_ids.end(), 0);
  absl::Status status = executor.AssignPages(kSeq, page_ids);
  logits->clear();
  std::vector<float> part;
  for (size_t at = 0; status.ok() && at < tokens.size(); at += chunk) {
    const size_t n = std::min<size_t>(chunk, tokens.size() - at);
    const worker::SequenceTokens entry{kSeq, tokens.subspan(at, n)};
    status = executor.Forward({&entry, 1}, worker::LogitsRows::kAllTokens, &part);
    logits->insert(logits->end(), part.begin(), part.end());
  }
  absl::Status removed = executor.RemoveSequence(kSeq);
  EXL3_RETURN_IF_ERROR(status);
  return removed;
}

struct Totals {
  int64_t scored = 0;
  double nll = 0, ref_nll = 0;
  int64_t top1 = 0;
  std::vector<double> kl;
};

}  // namespace

CommandRunner RegisterEvalCommand(CLI::App& app) {
  struct Args {
    std::string model, reference, text, range = "all", json_out, ids_out;
    int64_t context = 256, stride = 128, max_tokens = 0, chunk = 0;
    int tp = 1, ep = 0, threads = 2;
    int kv_bits = 32;
    bool no_progress = false;
    PrecisionFlags precision;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "model directory (EXL3 or Hugging Face)")->required();
  app.add_option("--text", args->text, "UTF-8 text file to score")->required();
  app.add_option("--reference", args->reference,
                 "reference model (e.g. the unquantized original): KL, top-1 and its perplexity");
  app.add_option("--context", args->context, "window length in tokens")->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--stride", args->stride, "tokens between window starts")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--range", args->range, "part of the text: all, first-half or second-half")
      ->capture_default_str()->check(CLI::IsMember({"all", "first-half", "second-half"}));
  app.add_option("--max-tokens", args->max_tokens, "score at most this many tokens (0 = all)");
  app.add_option("--chunk-tokens", args->chunk,
                 "feed each window in chunks of this many tokens (0 = whole window; <= 16 = the "
                 "decode path)");
  app.add_option("--tp", args->tp, "rank processes (tensor parallelism; 1 = this process)")
      ->capture_default_str();
  app.add_option("--ep", args->ep, "MoE: expert-parallel groups among the ranks");
  app.add_option("--threads", args->threads, "kernel threads (per rank)")->capture_default_str();
  app.add_option("--kv-bits", args->kv_bits, "KV cache storage: 32, 16, 8 or 4")->capture_default_str();
  app.add_option("--json", args->json_out, "also write the figures as JSON to this file");
  app.add_option("--ids-out", args->ids_out, "write the scored token stream (JSON array of ids)");
  app.add_flag("--no-progress", args->no_progress, "no progress lines on stderr");
  AddPrecisionFlags(app, &args->precision);
  return [args]() -> absl::Status {
    if (args->stride > args->context) {
      return absl::InvalidArgumentError(absl::StrCat("--stride ", args->stride,
                                                     " is larger than --context ", args->context));
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::Tokenizer> tokenizer,
                          coordinator::Tokenizer::Load(args->model));
    std::ifstream in(args->text, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(args->text, ": cannot open"));
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (args->range != "all") {
      size_t mid = text.find('\n', text.size() / 2);
      mid = mid == std::string::npos ? text.size() : mid + 1;
      text = args->range == "first-half" ? text.substr(0, mid) : text.substr(mid);
    }
    std::vector<int32_t> tokens = tokenizer->Encode(text, {.add_special_tokens = true});
    if (args->max_tokens > 0 && static_cast<int64_t>(tokens.size()) > args->max_tokens + 1) {
      tokens.resize(static_cast<size_t>(args->max_tokens + 1));
    }
    if (tokens.size() < 2) return absl::InvalidArgumentError(absl::StrCat(args->text, ": fewer than 2 tokens"));
    if (!args->ids_out.empty()) {
      EXL3_RETURN_IF_ERROR(
          sharding::WriteFileAtomically(args->ids_out, nlohmann::json(tokens).dump() + "\n"));
    }
    const std::vector<Window> windows =
        Windows(static_cast<int64_t>(tokens.size()), args->context, args->stride);
    const int64_t chunk = args->chunk > 0 ? args->chunk : args->context;

    kernels::cpu::SetSharedThreadPoolSize(args->threads);
    auto make = [&](const std::string& dir) -> absl::StatusOr<worker::rank::LocalExecutor> {
      worker::rank::LocalExecutorOptions o;
      o.model_dir = dir;
      o.ranks = args->tp > 1 ? args->tp : std::max(1, args->ep);
      o.expert_parallel = args->ep;
      o.threads_per_rank = args->threads;
      EXL3_ASSIGN_OR_RETURN(o.kv.dtype, worker::KvCacheDtypeFromBits(args->kv_bits));
      o.kv.num_pages = (args->context + o.kv.page_size_tokens - 1) / o.kv.page_size_tokens;
      o.prefill_precision = args->precision.Prefill();
      o.decode_precision = args->precision.Decode();
      return worker::rank::CreateLocalExecutor(o);
    };
    EXL3_ASSIGN_OR_RETURN(worker::rank::LocalExecutor model, make(args->model));
    std::optional<worker::rank::LocalExecutor> reference;
    if (!args->reference.empty()) {
      EXL3_ASSIGN_OR_RETURN(worker::rank::LocalExecutor r, make(args->reference));
      if (r.executor->vocab_size() != model.executor->vocab_size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--reference has vocabulary ", r.executor->vocab_size(), ", the model ",
            model.executor->vocab_size()));
      }
      reference.emplace(std::move(r));
    }
    const int64_t vocab = model.executor->vocab_size();
    const int64_t page = 16;

    Totals t;
    std::vector<float> logits, ref_logits;
    std::vector<double> lp, ref_lp;
    const absl::Time start = absl::Now();
    absl::Time last_report = start;
    for (size_t w = 0; w < windows.size(); ++w) {
      const Window& win = windows[w];
      const std::span<const int32_t> span(tokens.data() + win.begin,
                                          static_cast<size_t>(win.end - win.begin));
      EXL3_RETURN_IF_ERROR(WindowLogits(*model.executor, span, chunk, page, &logits));
      if (reference) {
        EXL3_RETURN_IF_ERROR(WindowLogits(*reference->executor, span, chunk, page, &ref_logits));
      }
      const int64_t len = win.end - win.begin;
      for (int64_t target = len - win.scored; target < len; ++target) {
        const float* row = logits.data() + (target - 1) * vocab;
        LogSoftmax(row, vocab, &lp);
        const int32_t next = span[target];
        t.nll -= lp[next];
        if (reference) {
          const float* ref_row = ref_logits.data() + (target - 1) * vocab;
          LogSoftmax(ref_row, vocab, &ref_lp);
          t.ref_nll -= ref_lp[next];
          double kl = 0;
          for (int64_t v = 0; v < vocab; ++v) kl += std::exp(ref_lp[v]) * (ref_lp[v] - lp[v]);
          t.kl.push_back(std::max(0.0, kl));
          t.top1 += ArgMax(row, vocab) == ArgMax(ref_row, vocab) ? 1 : 0;
        }
        ++t.scored;
      }
      const absl::Time now = absl::Now();
      if (!args->no_progress && (now - last_report > absl::Seconds(2) || w + 1 == windows.size())) {
        last_report = now;
        const double secs = absl::ToDoubleSeconds(now - start);
        std::fprintf(stderr, "eval: window %zu/%zu, %lld tokens scored, ppl %.4f, %.0f tok/s\n",
                     w + 1, windows.size(), static_cast<long long>(t.scored),
                     std::exp(t.nll / t.scored), t.scored / std::max(secs, 1e-9));
      }
    }
    std::fflush(stderr);
    const double ppl = std::exp(t.nll / t.scored);
    nlohmann::json out = {{"model", args->model},       {"text", args->text},
                          {"range", args->range},       {"context", args->context},
                          {"stride", args->stride},     {"windows", windows.size()},
                          {"tokens_scored", t.scored},  {"mean_nll", t.nll / t.scored},
                          {"perplexity", ppl}};
    std::printf("| model | tokens | perplexity |%s\n", reference ? " reference ppl | KL mean | KL p99 | top-1 |" : "");
    std::printf("|---|---|---|%s\n", reference ? "---|---|---|---|" : "");
    if (reference) {
      std::vector<double> sorted = t.kl;
      std::sort(sorted.begin(), sorted.end());
      const double kl_mean = std::accumulate(t.kl.begin(), t.kl.end(), 0.0) / t.kl.size();
      const double kl_p99 = sorted[std::min(sorted.size() - 1, static_cast<size_t>(0.99 * sorted.size()))];
      const double ref_ppl = std::exp(t.ref_nll / t.scored);
      const double top1 = static_cast<double>(t.top1) / t.scored;
      out["reference"] = {{"model", args->reference}, {"perplexity", ref_ppl},
                          {"kl_mean", kl_mean},        {"kl_p99", kl_p99},
                          {"top1_agreement", top1}};
      std::printf("| %s | %lld | %.4f | %.4f | %.5f | %.5f | %.2f %% |\n", args->model.c_str(),
                  static_cast<long long>(t.scored), ppl, ref_ppl, kl_mean, kl_p99, 100 * top1);
    } else {
      std::printf("| %s | %lld | %.4f |\n", args->model.c_str(), static_cast<long long>(t.scored), ppl);
    }
    if (!args->json_out.empty()) {
      EXL3_RETURN_IF_ERROR(sharding::WriteFileAtomically(args->json_out, out.dump(2) + "\n"));
    }
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
