// `exl3serve bench gemv`: time one TrellisGemm configuration on random trellis
// data cycled through DRAM (or, with --dense, the OpenBLAS fp32 baseline on
// the same shape) and print one line whose last field is the median
// weights/s, so a single configuration can be compared with other programs in
// the same run. The full table is tests/bench/trellis_gemv_bench.cc; both use
// cli/gemv_bench.h.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "cli/gemv_bench.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_features.h"

namespace exl3serve::cli {
namespace {

struct GemvFlags {
  int bits = 4;
  std::string codebook = "mul1";
  std::string shape = "4096x4096";
  int64_t batch = 1;
  int threads = 0;  // 0 = all hardware threads
  std::string isa = "auto";
  bool int8 = false;
  bool bf16 = false;
  bool dense = false;
  int repeats = 50;
  double max_seconds = 5.0;
  int64_t cycle_mib = kDefaultCycleBytes >> 20;
};

absl::Status RunGemv(const GemvFlags& f) {
  EXL3_ASSIGN_OR_RETURN(const auto shape, ParseShape(f.shape));
  EXL3_ASSIGN_OR_RETURN(const kernels::Codebook codebook, ParseCodebook(f.codebook));
  EXL3_ASSIGN_OR_RETURN(const std::optional<kernels::cpu::CpuIsa> isa,
                        kernels::cpu::ParseCpuIsa(f.isa));
  EXL3_RETURN_IF_ERROR(kernels::cpu::SetCpuIsaOverride(isa));

  GemvCase c;
  c.k = shape.first;
  c.n = shape.second;
  c.bits = f.bits;
  c.codebook = codebook;
  c.m = f.batch;
  c.threads = f.threads > 0 ? f.threads : static_cast<int>(std::thread::hardware_concurrency());
  if (f.int8 && f.bf16) return absl::InvalidArgumentError("bench gemv: --int8 and --bf16 exclude each other");
  c.precision = f.int8   ? kernels::TrellisGemmPrecision::kInt8
                : f.bf16 ? kernels::TrellisGemmPrecision::kBf16
                         : kernels::TrellisGemmPrecision::kFloat;
  c.cycle_bytes = f.cycle_mib << 20;
  TimingPlan plan;
  plan.max_repeats = f.repeats;
  plan.max_seconds = f.max_seconds;

  GemvMeasurement r;
  if (f.dense) {
    DenseWeightPool pool;
    EXL3_ASSIGN_OR_RETURN(r, MeasureDenseGemv(c, pool, plan));
  } else {
    TrellisWeightPool pool;
    EXL3_ASSIGN_OR_RETURN(r, MeasureTrellisGemv(c, pool, plan));
  }
  const double t = r.timing.median_s;
  const double weights = static_cast<double>(c.k) * static_cast<double>(c.n);
  const std::string what =
      f.dense ? "kernel=openblas-fp32"
              : absl::StrFormat("kernel=trellis codebook=%s K=%d isa=%s act=%s", f.codebook, c.bits,
                                ActiveIsaName(),
                                f.int8 ? "int8" : (f.bf16 ? "bf16" : "fp32"));
  std::printf("%s",
              absl::StrFormat(
                  "gemv shape=%dx%d %s batch=%d threads=%d "
                  "copies=%d copy_bytes=%d n=%d median_us=%.1f p10_us=%.1f GB/s=%.2f GFLOP/s=%.1f "
                  "weights_per_s=%.0f\n",
                  c.k, c.n, what, c.m, c.threads, r.copies, r.bytes_per_copy, r.timing.samples,
                  t * 1e6, r.timing.p10_s * 1e6, r.bytes_per_copy / t / 1e9,
                  2.0 * c.m * weights / t / 1e9, weights / t)
                  .c_str());
  return absl::OkStatus();
}

}  // namespace

CommandRunner RegisterBenchCommand(CLI::App& app) {
  app.require_subcommand(1, 1);
  auto flags = std::make_shared<GemvFlags>();
  CLI::App* gemv = app.add_subcommand(
      "gemv",
      "time TrellisGemm on random trellis data cycled through DRAM; prints one line ending in "
      "weights_per_s=<median>");
  gemv->add_option("--k", flags->bits, "bits per weight K")->check(CLI::Range(1, 8));
  gemv->add_option("--codebook", flags->codebook, "mul1|mcg|3inst")
      ->check(CLI::IsMember({"mul1", "mcg", "3inst"}));
  gemv->add_option("--shape", flags->shape, "INxOUT (in_features x out_features), e.g. 4096x14336");
  gemv->add_option("--batch", flags->batch, "activation rows m")->check(CLI::Range(1, 1 << 20));
  gemv->add_option("--threads", flags->threads, "threads (0 = all hardware threads)")
      ->check(CLI::Range(0, 4096));
  gemv->add_option("--isa", flags->isa, "auto|scalar|avx2|avx512 (pins the CPU kernel variant)")
      ->check(CLI::IsMember({"auto", "scalar", "avx2", "avx512"}));
  gemv->add_flag("--int8", flags->int8, "int8 activations (mul1 only)");
  gemv->add_flag("--bf16", flags->bf16,
                 "bf16 weights and activations, fp32 accumulation (the prefill path; "
                 "vdpbf16ps with AVX512-BF16)");
  gemv->add_flag("--dense", flags->dense,
                 "time the fp32 OpenBLAS baseline (sgemv/sgemm) on the same shape instead");
  gemv->add_option("--repeats", flags->repeats, "timed calls at most (after 3 warm-up calls)")
      ->check(CLI::Range(1, 1000000));
  gemv->add_option("--max-seconds", flags->max_seconds,
                   "stop timing after this many seconds (at least 3 timed calls)")
      ->check(CLI::Range(0.0, 3600.0));
  gemv->add_option("--cycle-mib", flags->cycle_mib,
                   "MiB of distinct weight copies cycled (must exceed the last-level cache)")
      ->check(CLI::Range(1, 1 << 16));
  return [flags] { return RunGemv(*flags); };
}

}  // namespace exl3serve::cli
