// Prefill and decode tokens/s of the demo models (issue 4): llama, qwen3 and
// qwen3-moe as `exl3serve make-demo-model --no-tokenizer` writes them, at
// EXL3 K = 2, 3, 4 (head kept unquantized: --head-bits 16) and unquantized
// (16: the bf16 checkpoint, held as fp32), on 1 thread and on all threads,
// with each configuration's peak RSS; and a ceiling ratio measured in the
// same run: decode weight bytes/s (the bytes of every linear one decode step
// reads — trellis + scales for EXL3, fp32 for plain linears, top-k of E
// experts for MoE — times decode tokens/s) over a STREAM-style read bandwidth
// on the same thread count.
//
//   model_bench [--archs llama,qwen3,qwen3-moe] [--ks 2,3,4,16] [--threads 1,0]
//               [--prompt 128] [--decode 32] [--work DIR] [--convert-threads 0]
//               [--layers L --hidden H --intermediate I --vocab V]
//               [--decode-precisions fp32,int8]
//
// --threads 0 means all cores. --work keeps the written and converted models
// (reused by the next run with the same shape); default: a temp dir, removed.
// Each configuration runs in a child process (this program with --measure),
// so its peak RSS (getrusage ru_maxrss) is its own: load + KV cache + one
// prefill of --prompt tokens + decoding. Prefill: median of 3 forwards of the
// whole prompt (after one warm-up). Decode: a 16-token prompt, then --decode
// single-token forwards with greedy argmax (no sampler), median of 3 runs.
// --decode-precisions: worker::SetDecodePrecision of each run (column "dec";
// int8 applies to the mul1 linears only; default fp32).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/gemv_bench.h"
#include "kernels/cpu/thread_pool.h"
#include "sharding/converter.h"
#include "sharding/exl3_model.h"
#include "sharding/test_model.h"
#include "worker/model/linear.h"
#include "worker/model/transformer.h"

namespace fs = std::filesystem;
namespace w = exl3serve::worker;
namespace sh = exl3serve::sharding;

namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "model_bench: %s\n", message.c_str());
  std::exit(1);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Weight bytes one decode step reads: every linear once (EXL3: its stored
// trellis, scales and bias; plain: as the runtime holds it, 16-bit for a
// BF16 / F16 tensor, else fp32), MoE
// experts weighted by experts_per_token / num_experts (each token runs
// exactly that many experts per layer). The embedding row is negligible.
double DecodeWeightBytes(const std::string& dir) {
  auto model = sh::Exl3Model::Open(dir);
  if (!model.ok()) Die(model.status().ToString());
  const auto& arch = (*model)->arch();
  if (!arch.has_value()) Die(dir + ": unsupported architecture");
  double bytes = 0;
  for (const sh::LinearSpec& l : arch->linears) {
    double b = 0;
    if (const sh::Exl3LinearInfo* q = (*model)->FindLinear(l.key)) {
      b = static_cast<double>(q->stored_bytes);
    } else {
      // Plain: 2 bytes a weight for a BF16 / F16 tensor (held in 16 bits), else 4.
      const sh::PlainTensorInfo* p = (*model)->FindPlain(l.key + ".weight");
      const bool half = p != nullptr && (p->dtype == sh::DType::kBF16 || p->dtype == sh::DType::kF16);
      b = (half ? 2.0 : 4.0) * static_cast<double>(l.in_features) * static_cast<double>(l.out_features);
    }
    if (l.expert >= 0 && arch->num_experts > 0) {
      b *= static_cast<double>(arch->num_experts_per_token) / arch->num_experts;
    }
    bytes += b;
  }
  return bytes;
}

// The child: load `dir` on `threads` threads, measure, print one RESULT line.
int Measure(const std::string& dir, int threads, int prompt_tokens, int decode_tokens,
            const std::string& decode_precision) {
  exl3serve::kernels::cpu::SetSharedThreadPoolSize(threads);
  if (decode_precision == "int8") {
    if (auto s = w::SetDecodePrecision(exl3serve::kernels::TrellisGemmPrecision::kInt8); !s.ok()) {
      Die(s.ToString());
    }
  } else if (decode_precision != "fp32") {
    Die(absl::StrCat("--decode-precisions: `", decode_precision, "` is not fp32 or int8"));
  }
  auto model = w::Transformer::Load(dir);
  if (!model.ok()) Die(model.status().ToString());
  const int64_t vocab = (*model)->vocab_size();
  w::KvCacheOptions kv;
  kv.num_pages = (std::max(prompt_tokens, 16 + decode_tokens) + kv.page_size_tokens) /
                     kv.page_size_tokens * 2 + 4;
  auto cache = (*model)->CreateKvCache(kv);
  if (!cache.ok()) Die(cache.status().ToString());
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(prompt_tokens);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % vocab);
  std::vector<float> logits;
  int64_t seq = 0;
  auto forward = [&](int64_t id, std::span<const int32_t> tokens) {
    const w::SequenceTokens entry{id, tokens};
    if (auto s = (*model)->Forward({&entry, 1}, w::LogitsRows::kLastToken, &*cache, &logits);
        !s.ok()) {
      Die(s.ToString());
    }
  };
  std::vector<double> prefill;
  for (int run = 0; run < 4; ++run) {  // run 0: warm-up
    if (!cache->AddSequence(seq).ok()) Die("AddSequence");
    const auto t0 = std::chrono::steady_clock::now();
    forward(seq, prompt);
    const auto t1 = std::chrono::steady_clock::now();
    if (run > 0) prefill.push_back(prompt_tokens / Seconds(t0, t1));
    if (!cache->RemoveSequence(seq++).ok()) Die("RemoveSequence");
  }
  std::vector<double> decode;
  const std::span<const int32_t> short_prompt(prompt.data(), std::min<size_t>(16, prompt.size()));
  for (int run = 0; run < 3; ++run) {
    if (!cache->AddSequence(seq).ok()) Die("AddSequence");
    forward(seq, short_prompt);
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < decode_tokens; ++step) {
      const int32_t next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      forward(seq, {&next, 1});
    }
    const auto t1 = std::chrono::steady_clock::now();
    decode.push_back(decode_tokens / Seconds(t0, t1));
    if (!cache->RemoveSequence(seq++).ok()) Die("RemoveSequence");
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  std::printf("RESULT %.6g %.6g %ld %.6g\n", Median(prefill), Median(decode), usage.ru_maxrss,
              DecodeWeightBytes(dir));
  return 0;
}

std::vector<int> ParseInts(const std::string& text, const char* flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(part, &v)) Die(absl::StrCat(flag, ": `", part, "` is not a number"));
    out.push_back(v);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"--archs", "llama,qwen3,qwen3-moe"}, {"--ks", "2,3,4,16"}, {"--threads", "1,0"},
      {"--prompt", "128"}, {"--decode", "32"}, {"--work", ""}, {"--convert-threads", "0"},
      {"--measure", ""}, {"--layers", ""}, {"--hidden", ""}, {"--intermediate", ""},
      {"--vocab", ""}, {"--decode-precisions", "fp32"}};
  for (int i = 1; i < argc; i += 2) {
    if (!flags.contains(argv[i]) || i + 1 >= argc) Die(absl::StrCat("bad flag ", argv[i]));
    flags[argv[i]] = argv[i + 1];
  }
  const int prompt_tokens = ParseInts(flags["--prompt"], "--prompt").at(0);
  const int decode_tokens = ParseInts(flags["--decode"], "--decode").at(0);
  if (prompt_tokens < 1 || decode_tokens < 1) Die("--prompt and --decode must be >= 1");
  if (!flags["--measure"].empty()) {
    return Measure(flags["--measure"], ParseInts(flags["--threads"], "--threads").at(0),
                   prompt_tokens, decode_tokens, flags["--decode-precisions"]);
  }
  const std::vector<std::string> precisions =
      absl::StrSplit(flags["--decode-precisions"], ',', absl::SkipEmpty());
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> threads = ParseInts(flags["--threads"], "--threads");
  for (int& t : threads) t = t <= 0 ? all : t;
  threads.erase(std::unique(threads.begin(), threads.end()), threads.end());
  const std::vector<int> ks = ParseInts(flags["--ks"], "--ks");
  const std::vector<std::string> archs = absl::StrSplit(flags["--archs"], ',', absl::SkipEmpty());

  std::string work = flags["--work"];
  const bool temp = work.empty();
  if (temp) work = (fs::temp_directory_path() / ("model_bench_" + std::to_string(getpid()))).string();
  fs::create_directories(work);

  const auto machine = exl3serve::cli::DescribeMachine();
  std::printf("model_bench %s: %s (%s), %d logical CPUs, ISA %s, load average %s\n",
              exl3serve::cli::CurrentUtcTime().c_str(), machine.cpu_model.c_str(),
              machine.cpu_signature.c_str(), machine.logical_cpus,
              exl3serve::cli::ActiveIsaName().c_str(), exl3serve::cli::LoadAverages().c_str());

  // The models: written (and converted) once per shape; a stamp names the shape.
  std::map<std::string, std::string> model_dir;  // arch -> work/<shape>
  for (const std::string& arch : archs) {
    auto options = sh::DemoModelDefaults(arch);
    if (!options.ok()) Die(options.status().ToString());
    if (!flags["--layers"].empty()) options->num_layers = ParseInts(flags["--layers"], "--layers")[0];
    if (!flags["--hidden"].empty()) options->hidden_size = ParseInts(flags["--hidden"], "--hidden")[0];
    if (!flags["--intermediate"].empty()) {
      options->intermediate_size = ParseInts(flags["--intermediate"], "--intermediate")[0];
    }
    if (!flags["--vocab"].empty()) options->vocab_size = ParseInts(flags["--vocab"], "--vocab")[0];
    const std::string shape = absl::StrFormat("%s-l%d-h%d-i%d-v%d", arch, options->num_layers,
                                              options->hidden_size, options->intermediate_size,
                                              options->vocab_size);
    model_dir[arch] = work + "/" + shape;
    const std::string hf = work + "/" + shape + "/hf";
    if (!fs::exists(hf + "/config.json")) {
      std::printf("writing %s\n", hf.c_str());
      std::fflush(stdout);
      if (auto s = sh::WriteDemoModel(hf, *options, ""); !s.ok()) Die(s.ToString());
    }
    for (int k : ks) {
      if (k == 16) continue;
      const std::string out = absl::StrCat(work, "/", shape, "/k", k);
      if (fs::exists(out + "/config.json")) continue;
      sh::ConvertOptions convert;
      convert.in_dir = hf;
      convert.out_dir = out;
      convert.bits = k;
      convert.head_bits = 16;
      convert.threads = ParseInts(flags["--convert-threads"], "--convert-threads").at(0);
      convert.show_progress = false;
      std::printf("converting %s at K = %d ... ", shape.c_str(), k);
      std::fflush(stdout);
      auto report = sh::ConvertModel(convert);
      if (!report.ok()) Die(report.status().ToString());
      std::printf("%.1f s\n", report->seconds);
    }
  }

  // STREAM-style read bandwidth on each thread count (1 GiB: beyond any L3).
  std::map<int, double> stream;
  {
    exl3serve::cli::ReadBandwidthProbe probe(int64_t{1} << 30);
    for (int t : threads) stream[t] = probe.Measure(probe.capacity_bytes(), t).best_bytes_per_s;
  }

  std::printf("\nprompt %d tokens (prefill), %d decode steps after a 16-token prompt; medians of 3\n",
              prompt_tokens, decode_tokens);
  std::printf("%-10s %3s %3s %4s %12s %11s %9s %12s %10s %8s\n", "arch", "K", "thr", "dec",
              "prefill t/s", "decode t/s", "RSS MiB", "MB/decode", "dec GB/s", "ceiling");
  for (const std::string& arch : archs) {
    for (int k : ks) {
      for (int t : threads) {
        for (const std::string& precision : precisions) {
          const std::string dir = model_dir[arch] + (k == 16 ? "/hf" : absl::StrCat("/k", k));
          const std::string command = absl::StrCat(argv[0], " --measure ", dir, " --threads ", t,
                                                   " --prompt ", prompt_tokens, " --decode ",
                                                   decode_tokens, " --decode-precisions ",
                                                   precision, " 2>&1");
          FILE* child = popen(command.c_str(), "r");
          if (child == nullptr) Die("popen failed");
          char line[4096];
          double prefill = 0, decode = 0, bytes = 0;
          long rss_kb = 0;
          bool found = false;
          std::string output;
          while (std::fgets(line, sizeof(line), child) != nullptr) {
            output += line;
            found |= std::sscanf(line, "RESULT %lf %lf %ld %lf", &prefill, &decode, &rss_kb, &bytes) == 4;
          }
          if (pclose(child) != 0 || !found) Die(absl::StrCat(command, " failed:\n", output));
          const double achieved = decode * bytes;
          std::printf("%-10s %3d %3d %4s %12.1f %11.1f %9.0f %12.1f %10.2f %7.0f%%\n", arch.c_str(),
                      k, t, precision.c_str(), prefill, decode, rss_kb / 1024.0, bytes / 1e6,
                      achieved / 1e9, 100.0 * achieved / stream[t]);
          std::fflush(stdout);
        }
      }
    }
  }
  for (int t : threads) {
    std::printf("STREAM-style read, %d thread(s): %.1f GB/s\n", t, stream[t] / 1e9);
  }
  std::printf("ceiling = decode weight bytes/s over that read bandwidth; load average now %s\n",
              exl3serve::cli::LoadAverages().c_str());
  if (temp) fs::remove_all(work);
  return 0;
}
