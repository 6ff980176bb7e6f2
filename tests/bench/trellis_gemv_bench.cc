// TrellisGemm throughput (kernels/trellis_gemm.h) against this machine's own
// ceilings, all measured in the same run:
//   - DRAM read bandwidth: a STREAM-style read over buffers up to --dram-mib
//     (default 2 GiB, far beyond the last-level cache), 1 thread and all;
//     the curve is printed so a cache plateau would be visible;
//   - a dense fp32 baseline: OpenBLAS cblas_sgemv (batch 1) / cblas_sgemm on
//     the same shape, batch and thread count ("n/a" when built without it);
//   - the ik_llama.cpp anchor from the exl3serve CPU-kernel issue, for
//     4096x4096: IQ2_KT/IQ3_KT/IQ4_KT at batch 1 took 1522/1593/1885 us on 1
//     thread and 957/977/964 us on 2 threads; batch 512 on 2 threads ran at
//     333-397 GFLOP/s (the ratio column uses 397, the top of that range).
//
// Every call reads its weights from DRAM: distinct weight copies (random
// trellis words, random fp32 for the baseline) totalling >= --cycle-mib are
// cycled, one copy per call (cli/gemv_bench.h). Times are per call: median and
// 10th percentile of the timed calls after 3 warm-up calls.
//
// Columns: Gw/s = k·n weights per second (median); GB/s = packed weight bytes
// per second; DRAM% = GB/s over the DRAM read bandwidth at the same thread
// count; GFLOP/s = 2·m·k·n / time; xBLAS = OpenBLAS fp32 time / our time
// (> 1: we are faster); x_ik = ik_llama.cpp time / our time (batch 1) or our
// GFLOP/s / 397 (batch 512, 2 threads), shown for 4096x4096 K=2,3,4.
//
//   trellis_gemv_bench           # 4096x4096, every K/codebook/batch/thread case
//   trellis_gemv_bench --quick   # smoke run: 4096x4096, mul1 K=2,4, batches 1,16,512
//   trellis_gemv_bench --full    # the sweep: all 3 shapes, 2 s per row
//   trellis_gemv_bench --shapes=4096x4096 --ks=2,4 --batches=1,512 --threads=all
//   trellis_gemv_bench --cpu-time --shapes=1024x2816 --ks=2,3,4 --ks-3inst= --int8
//       --no-bf16 --batches=1,2,4,5,8,12,16   # rows cost, hot weights, 1 thread, CPU time
//
// --cpu-time replaces all of the above (no DRAM probe, no baseline) with a
// load-robust table: per shape, K, activation type and batch m, TrellisGemm
// with max_threads = 1 (all work on the calling thread) on one hot weight copy
// (cache-resident for shapes like 1024x2816), timed with
// CLOCK_THREAD_CPUTIME_ID: --repeats samples (default 7) of --calls
// consecutive calls (default 10) after 3 warm-up calls; best_us = the best
// sample per call, med_us the median one. Its ceiling, measured in the same
// run, is m separate 1-row calls: rows = best(m) / best(1) and x_1row =
// best(m) / (m * best(1)) (< 1: m rows in one call cost less than m 1-row
// calls). m = 1 is always measured, before and after the row's other batches
// (the better of the two counts). --threads and --cycle-mib are ignored.
// The time includes TrellisGemm's input/output transforms, not only the GEMV.
//
// Flags (comma lists): --shapes --ks (mul1) --ks-3inst --batches --threads
// (numbers or "all") --isa=auto|scalar|avx2|avx512 --int8 (adds int8 rows for
// mul1) --no-bf16 (drops the kBf16 rows: mul1 and 3inst, batches >= 64 only;
// vdpbf16ps where the CPU has AVX512-BF16) --repeats=N --max-seconds=S (per row) --cycle-mib=M --dram-mib=M
// --no-baseline --cpu-time --calls=N (--cpu-time only).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/gemv_bench.h"
#include "kernels/cpu/cpu_features.h"

namespace bench = exl3serve::cli;
namespace kernels = exl3serve::kernels;
using kernels::Codebook;
using kernels::TrellisGemmPrecision;

namespace {

// The ik_llama.cpp anchor (4096x4096), indexed by K = 2, 3, 4.
constexpr double kIkBatch1Us1Thread[3] = {1522, 1593, 1885};
constexpr double kIkBatch1Us2Threads[3] = {957, 977, 964};
constexpr double kIkBatch512Gflops2Threads = 397;  // top of 333-397

struct Options {
  std::vector<std::string> shapes = {"4096x4096"};
  std::vector<int> ks = {2, 3, 4, 5, 6, 8};
  std::vector<int> ks_3inst = {2, 4};
  std::vector<int64_t> batches = {1, 4, 16, 64, 512};
  std::vector<int> threads;  // filled with {1, all}
  std::string isa = "auto";
  bool int8 = false;
  bool bf16 = true;
  bool baseline = true;
  int repeats = 30;
  double max_seconds = 1.0;
  int64_t cycle_mib = bench::kDefaultCycleBytes >> 20;
  int64_t dram_mib = 2048;
  bool cpu_time = false;
  bool repeats_given = false;
  int calls = 10;  // per sample, --cpu-time only
};

struct Shape {
  int64_t k, n;
};

void Usage() {
  std::fprintf(stderr,
               "usage: trellis_gemv_bench [--quick|--full] [--shapes=4096x4096,...] [--ks=2,3,4]\n"
               "  [--ks-3inst=2,4] [--batches=1,16,512] [--threads=1,all] [--isa=auto]\n"
               "  [--int8] [--no-bf16] [--repeats=30] [--max-seconds=1] [--cycle-mib=1024] [--dram-mib=2048]\n"
               "  [--no-baseline]\n"
               "  or: trellis_gemv_bench --cpu-time [--shapes] [--ks] [--ks-3inst] [--batches]\n"
               "  [--isa] [--int8] [--no-bf16] [--repeats=7] [--calls=10]\n");
}

template <typename T>
bool ParseList(const std::string& text, std::vector<T>& out, int all_threads = 0) {
  out.clear();
  if (text.empty() || text == "none") return true;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    T value{};
    if (all_threads > 0 && item == "all") {
      value = static_cast<T>(all_threads);
    } else if (!absl::SimpleAtoi(item, &value)) {
      return false;
    }
    out.push_back(value);
  }
  return true;
}

bool ParseArgs(int argc, char** argv, Options& o) {
  const int all = std::max(1u, std::thread::hardware_concurrency());
  o.threads = {1, all};
  // Presets first, so explicit flags given with them override.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.ks = {2, 4};
      o.ks_3inst = {};
      o.batches = {1, 16, 512};
      o.max_seconds = 0.3;
      o.repeats = 10;
      o.dram_mib = 1024;
    } else if (a == "--full") {
      o.shapes = {"4096x4096", "4096x14336", "14336x4096"};
      o.max_seconds = 2.0;
      o.repeats = 50;
    }
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    bool ok = true;
    if (key == "--quick" || key == "--full") {
    } else if (key == "--shapes") {
      o.shapes = value == "all" ? std::vector<std::string>{"4096x4096", "4096x14336", "14336x4096"}
                                : std::vector<std::string>(absl::StrSplit(value, ','));
    } else if (key == "--ks") {
      ok = ParseList(value, o.ks);
    } else if (key == "--ks-3inst") {
      ok = ParseList(value, o.ks_3inst);
    } else if (key == "--batches") {
      ok = ParseList(value, o.batches);
    } else if (key == "--threads") {
      ok = ParseList(value, o.threads, all);
    } else if (key == "--isa") {
      o.isa = value;
    } else if (key == "--int8") {
      o.int8 = true;
    } else if (key == "--no-bf16") {
      o.bf16 = false;
    } else if (key == "--no-baseline") {
      o.baseline = false;
    } else if (key == "--repeats") {
      ok = absl::SimpleAtoi(value, &o.repeats) && o.repeats >= 1;
      o.repeats_given = true;
    } else if (key == "--cpu-time") {
      o.cpu_time = true;
    } else if (key == "--calls") {
      ok = absl::SimpleAtoi(value, &o.calls) && o.calls >= 1;
    } else if (key == "--max-seconds") {
      ok = absl::SimpleAtod(value, &o.max_seconds);
    } else if (key == "--cycle-mib") {
      ok = absl::SimpleAtoi(value, &o.cycle_mib) && o.cycle_mib >= 1;
    } else if (key == "--dram-mib") {
      ok = absl::SimpleAtoi(value, &o.dram_mib) && o.dram_mib >= 64;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "trellis_gemv_bench: bad flag '%s'\n", a.c_str());
      Usage();
      return false;
    }
  }
  if (o.cpu_time && !o.repeats_given) o.repeats = 7;
  return true;
}

// One row of the trellis table.
struct Row {
  Shape shape;
  Codebook codebook;
  int bits;
  TrellisGemmPrecision precision;
};

double IkRatio(const Shape& s, int bits, int64_t m, int threads, double seconds) {
  if (s.k != 4096 || s.n != 4096 || bits < 2 || bits > 4) return 0;
  if (m == 1 && threads == 1) return kIkBatch1Us1Thread[bits - 2] * 1e-6 / seconds;
  if (m == 1 && threads == 2) return kIkBatch1Us2Threads[bits - 2] * 1e-6 / seconds;
  if (m == 512 && threads == 2) {
    return 2.0 * 512 * 4096 * 4096 / seconds / 1e9 / kIkBatch512Gflops2Threads;
  }
  return 0;
}

std::string Ratio(double r) {
  if (r <= 0) return "-";
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", r);
  return text;
}

std::vector<Row> TrellisRows(const Options& o, const std::vector<Shape>& shapes) {
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    for (int k : o.ks) {
      rows.push_back({s, Codebook::kMul1, k, TrellisGemmPrecision::kFloat});
      if (o.int8) rows.push_back({s, Codebook::kMul1, k, TrellisGemmPrecision::kInt8});
      if (o.bf16) rows.push_back({s, Codebook::kMul1, k, TrellisGemmPrecision::kBf16});
    }
    for (int k : o.ks_3inst) {
      rows.push_back({s, Codebook::k3Inst, k, TrellisGemmPrecision::kFloat});
      if (o.bf16) rows.push_back({s, Codebook::k3Inst, k, TrellisGemmPrecision::kBf16});
    }
  }
  return rows;
}

const char* PrecisionName(TrellisGemmPrecision p) {
  return p == TrellisGemmPrecision::kInt8   ? "int8"
         : p == TrellisGemmPrecision::kBf16 ? "bf16"
                                             : "fp32";
}

// --cpu-time: see the file comment. Returns the number of failed rows.
int RunCpuTime(const Options& o, const std::vector<Shape>& shapes) {
  bench::TimingPlan plan;
  plan.warmup_calls = 3;
  plan.min_repeats = o.repeats;
  plan.max_repeats = o.repeats;
  plan.max_seconds = 0;
  plan.calls_per_sample = o.calls;
  plan.thread_cpu_time = true;
  std::printf(
      "timing: thread CPU time (CLOCK_THREAD_CPUTIME_ID), max_threads = 1, one hot weight copy; "
      "3 warm-up calls, then %d samples of %d calls; best_us / med_us = best / median sample, "
      "per call\n",
      o.repeats, o.calls);
  std::printf(
      "ceiling (same run): m separate 1-row calls; rows = best(m) / best(1), x_1row = best(m) / "
      "(m * best(1))\n\n");
  std::printf("TrellisGemm CPU time (isa %s):\n", bench::ActiveIsaName().c_str());
  std::printf("%-11s %-5s %2s %4s %6s %9s %9s %9s %6s %7s\n", "shape", "cb", "K", "act", "batch",
              "best_us", "med_us", "us/row", "rows", "x_1row");
  const bool print_one = std::find(o.batches.begin(), o.batches.end(), 1) != o.batches.end();
  std::vector<int64_t> batches = {1};
  for (int64_t m : o.batches) {
    if (m != 1) batches.push_back(m);
  }
  bench::TrellisWeightPool pool;
  int failures = 0;
  for (const Row& row : TrellisRows(o, shapes)) {
    // m = 1 is measured first and again last, and the better of the two is
    // the row's 1-row time, so one burst on a neighbour core cannot skew
    // every ratio of the row.
    std::vector<int64_t> order = batches;
    order.push_back(1);
    std::vector<std::pair<int64_t, bench::TimingStats>> results;
    for (int64_t m : order) {
      // kBf16 is the prefill path: small batches keep the register GEMV.
      if (row.precision == TrellisGemmPrecision::kBf16 && m < 64) continue;
      bench::GemvCase c{.k = row.shape.k,
                        .n = row.shape.n,
                        .bits = row.bits,
                        .codebook = row.codebook,
                        .m = m,
                        .threads = 1,
                        .precision = row.precision,
                        .cycle_bytes = 0};
      auto r = bench::MeasureTrellisGemv(c, pool, plan);
      if (!r.ok()) {
        std::printf("%5lldx%-5lld %-5s %2d: error: %s\n", static_cast<long long>(c.k),
                    static_cast<long long>(c.n), bench::CodebookName(c.codebook).c_str(), c.bits,
                    std::string(r.status().message()).c_str());
        ++failures;
        continue;
      }
      if (m == 1 && !results.empty() && results.front().first == 1) {
        bench::TimingStats& first = results.front().second;
        if (r->timing.min_s < first.min_s) first = r->timing;
      } else {
        results.emplace_back(m, r->timing);
      }
    }
    const double one_row_s =
        !results.empty() && results.front().first == 1 ? results.front().second.min_s : 0;
    for (const auto& [m, timing] : results) {
      if (m == 1 && !print_one) continue;
      const double best = timing.min_s;
      std::printf("%5lldx%-5lld %-5s %2d %4s %6lld %9.1f %9.1f %9.1f %6s %7s\n",
                  static_cast<long long>(row.shape.k), static_cast<long long>(row.shape.n),
                  bench::CodebookName(row.codebook).c_str(), row.bits,
                  PrecisionName(row.precision), static_cast<long long>(m), best * 1e6,
                  timing.median_s * 1e6, best * 1e6 / static_cast<double>(m),
                  Ratio(one_row_s > 0 ? best / one_row_s : 0).c_str(),
                  Ratio(one_row_s > 0 ? best / (static_cast<double>(m) * one_row_s) : 0).c_str());
    }
    std::fflush(stdout);
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, o)) return 2;
  std::vector<Shape> shapes;
  for (const std::string& s : o.shapes) {
    auto parsed = bench::ParseShape(s);
    if (!parsed.ok()) {
      std::fprintf(stderr, "trellis_gemv_bench: %s\n",
                   std::string(parsed.status().message()).c_str());
      return 2;
    }
    shapes.push_back({parsed->first, parsed->second});
  }
  auto isa = kernels::cpu::ParseCpuIsa(o.isa);
  absl::Status isa_status = isa.ok() ? kernels::cpu::SetCpuIsaOverride(*isa) : isa.status();
  if (!isa_status.ok()) {
    std::fprintf(stderr, "trellis_gemv_bench: %s\n", std::string(isa_status.message()).c_str());
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  const int64_t cycle_bytes = o.cycle_mib << 20;
  bench::TimingPlan plan;
  plan.max_repeats = o.repeats;
  plan.max_seconds = o.max_seconds;

  // ---- header
  const bench::MachineInfo machine = bench::DescribeMachine();
  std::printf("# trellis_gemv_bench — %s\n", bench::CurrentUtcTime().c_str());
  std::printf("command: %s\n", absl::StrJoin(argv, argv + argc, " ").c_str());
  std::printf("machine: %s (%s), %d logical CPUs, L3 %lld MiB (as reported), kernel ISA %s\n",
              machine.cpu_model.c_str(), machine.cpu_signature.c_str(), machine.logical_cpus,
              static_cast<long long>(machine.l3_bytes >> 20), bench::ActiveIsaName().c_str());
  std::printf("load average (1/5/15 min) at start: %s\n", bench::LoadAverages().c_str());
  if (o.cpu_time) {
    const int failures = RunCpuTime(o, shapes);
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\nload average at end: %s\ntotal %.0f s%s\n", bench::LoadAverages().c_str(),
                total, failures ? " — some rows failed (see 'error' lines)" : "");
    return failures ? 1 : 0;
  }
  std::printf("baseline: %s\n", o.baseline ? bench::DenseBaselineDescription().c_str() : "skipped");
  std::printf(
      "timing: 3 warm-up calls, then up to %d timed calls or %.1f s per row; weights cycled "
      "through >= %lld MiB of distinct copies\n\n",
      o.repeats, o.max_seconds, static_cast<long long>(o.cycle_mib));

  // ---- DRAM read bandwidth curve
  std::vector<int> thread_counts = o.threads;
  std::sort(thread_counts.begin(), thread_counts.end());
  thread_counts.erase(std::unique(thread_counts.begin(), thread_counts.end()), thread_counts.end());
  std::map<int, double> dram_bytes_per_s;  // at the largest buffer, best pass
  {
    bench::ReadBandwidthProbe probe(o.dram_mib << 20);
    std::vector<int64_t> sizes;
    for (int64_t mib = 32; mib < o.dram_mib; mib *= 4) sizes.push_back(mib << 20);
    sizes.push_back(probe.capacity_bytes());
    std::printf("DRAM read bandwidth (GB/s, best / median pass):\n%12s", "buffer MiB");
    for (int t : thread_counts) std::printf("   %2d thread%s      ", t, t == 1 ? " " : "s");
    std::printf("\n");
    for (int64_t bytes : sizes) {
      std::printf("%12lld", static_cast<long long>(bytes >> 20));
      for (int t : thread_counts) {
        const auto r = probe.Measure(bytes, t);
        std::printf("   %7.2f / %7.2f", r.best_bytes_per_s / 1e9, r.median_bytes_per_s / 1e9);
        if (bytes == sizes.back()) dram_bytes_per_s[t] = r.best_bytes_per_s;
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    std::printf(
        "(DRAM%% columns below use the %lld MiB best-pass figure at the row's thread count)\n\n",
        static_cast<long long>(sizes.back() >> 20));
  }

  // ---- dense baseline, measured before the trellis rows so OpenBLAS's
  // spinning workers are gone by then
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, double> dense_s;
  if (o.baseline && bench::HaveDenseBaseline()) {
    bench::DenseWeightPool pool;
    int64_t pool_bytes = 0;
    for (const Shape& s : shapes) {
      pool_bytes = std::max(
          pool_bytes, bench::DensePoolBytes({.k = s.k, .n = s.n, .cycle_bytes = cycle_bytes}));
    }
    pool.Reserve(pool_bytes);
    std::printf("dense fp32 baseline (%s):\n", bench::DenseBaselineDescription().c_str());
    std::printf(
        "W fp32 k x n row-major, copies totalling >= %lld MiB cycled (at least 2); batch 1 = "
        "cblas_sgemv(Trans), else cblas_sgemm; openblas_set_num_threads(thr)\n",
        static_cast<long long>(o.cycle_mib));
    std::printf("%-11s %6s %4s %5s %7s %11s %11s %9s %8s %8s\n", "shape", "batch", "thr", "n",
                "copies", "median_us", "p10_us", "Gw/s", "GB/s", "GFLOP/s");
    for (const Shape& s : shapes) {
      for (int64_t m : o.batches) {
        for (int t : o.threads) {
          bench::GemvCase c{.k = s.k, .n = s.n, .m = m, .threads = t, .cycle_bytes = cycle_bytes};
          auto r = bench::MeasureDenseGemv(c, pool, plan);
          if (!r.ok()) {
            std::fprintf(stderr, "dense %lldx%lld: %s\n", static_cast<long long>(s.k),
                         static_cast<long long>(s.n), std::string(r.status().message()).c_str());
            continue;
          }
          const double sec = r->timing.median_s;
          dense_s[{s.k, s.n, m, t}] = sec;
          const double w = static_cast<double>(s.k) * s.n;
          std::printf("%5lldx%-5lld %6lld %4d %5d %7lld %11.1f %11.1f %9.2f %8.2f %8.1f\n",
                      static_cast<long long>(s.k), static_cast<long long>(s.n),
                      static_cast<long long>(m), t, r->timing.samples,
                      static_cast<long long>(r->copies), sec * 1e6, r->timing.p10_s * 1e6,
                      w / sec / 1e9, r->bytes_per_copy / sec / 1e9, 2.0 * m * w / sec / 1e9);
          std::fflush(stdout);
        }
      }
    }
    bench::QuiesceDenseBaseline();
    std::printf("\n");
  } else {
    std::printf("dense fp32 baseline: %s\n\n",
                o.baseline ? bench::DenseBaselineDescription().c_str() : "skipped (--no-baseline)");
  }

  // ---- the trellis table
  const std::vector<Row> rows = TrellisRows(o, shapes);
  std::printf("TrellisGemm (isa %s):\n", bench::ActiveIsaName().c_str());
  std::printf("%-11s %-5s %2s %4s %6s %4s %5s %7s %11s %11s %8s %8s %6s %8s %6s %6s\n", "shape",
              "cb", "K", "act", "batch", "thr", "n", "copies", "median_us", "p10_us", "Gw/s",
              "GB/s", "DRAM%", "GFLOP/s", "xBLAS", "x_ik");
  bench::TrellisWeightPool pool;
  int64_t pool_bytes = 0;
  for (const Row& row : rows) {
    pool_bytes = std::max(
        pool_bytes,
        bench::TrellisPoolBytes(
            {.k = row.shape.k, .n = row.shape.n, .bits = row.bits, .cycle_bytes = cycle_bytes}));
  }
  pool.Reserve(pool_bytes);
  // Medians of the mul1 fp32 4096x4096 rows the goals are about,
  // keyed by (K, batch, threads).
  std::map<std::tuple<int, int64_t, int>, double> goal_s;
  std::map<std::tuple<int, int64_t, int>, double> goal_bf16_s;  // the same for kBf16
  int failures = 0;
  for (const Row& row : rows) {
    for (int64_t m : o.batches) {
      // kBf16 is the prefill path: small batches keep the register GEMV.
      if (row.precision == TrellisGemmPrecision::kBf16 && m < 64) continue;
      for (int t : o.threads) {
        bench::GemvCase c{.k = row.shape.k,
                          .n = row.shape.n,
                          .bits = row.bits,
                          .codebook = row.codebook,
                          .m = m,
                          .threads = t,
                          .precision = row.precision,
                          .cycle_bytes = cycle_bytes};
        auto r = bench::MeasureTrellisGemv(c, pool, plan);
        if (!r.ok()) {
          std::printf("%5lldx%-5lld %-5s %2d: error: %s\n", static_cast<long long>(c.k),
                      static_cast<long long>(c.n), bench::CodebookName(c.codebook).c_str(), c.bits,
                      std::string(r.status().message()).c_str());
          ++failures;
          continue;
        }
        const double sec = r->timing.median_s;
        if (c.k == 4096 && c.n == 4096 && c.codebook == Codebook::kMul1 &&
            c.precision == TrellisGemmPrecision::kFloat) {
          goal_s[{c.bits, m, t}] = sec;
        }
        if (c.k == 4096 && c.n == 4096 && c.codebook == Codebook::kMul1 &&
            c.precision == TrellisGemmPrecision::kBf16) {
          goal_bf16_s[{c.bits, m, t}] = sec;
        }
        const double w = static_cast<double>(c.k) * c.n;
        const double gbs = r->bytes_per_copy / sec / 1e9;
        const auto dram = dram_bytes_per_s.find(t);
        const auto dense = dense_s.find({c.k, c.n, m, t});
        std::printf(
            "%5lldx%-5lld %-5s %2d %4s %6lld %4d %5d %7lld %11.1f %11.1f %8.2f %8.2f %6.1f %8.1f "
            "%6s %6s\n",
            static_cast<long long>(c.k), static_cast<long long>(c.n),
            bench::CodebookName(c.codebook).c_str(), c.bits,
            PrecisionName(c.precision),
            static_cast<long long>(m),
            t, r->timing.samples, static_cast<long long>(r->copies), sec * 1e6,
            r->timing.p10_s * 1e6, w / sec / 1e9, gbs,
            dram == dram_bytes_per_s.end() ? 0.0 : 100.0 * gbs * 1e9 / dram->second,
            2.0 * m * w / sec / 1e9,
            Ratio(dense == dense_s.end() ? 0 : dense->second / sec).c_str(),
            Ratio(IkRatio(row.shape, c.bits, m, t, sec)).c_str());
        std::fflush(stdout);
      }
    }
  }
  // The goals, where this run measured them.
  std::string batch1, batch512, batch512_bf16;
  for (int bits : {2, 3, 4}) {
    if (auto it = goal_bf16_s.find({bits, 512, 2}); it != goal_bf16_s.end()) {
      absl::StrAppend(&batch512_bf16, " K=", bits, ": ",
                      absl::StrFormat("%.0f", 2.0 * 512 * 4096 * 4096 / it->second / 1e9));
    }
    if (auto it = goal_s.find({bits, 1, 2}); it != goal_s.end()) {
      absl::StrAppend(&batch1, " K=", bits, ": ",
                      absl::StrFormat("%.1f", 4096.0 * 4096 / it->second / 1e9));
    }
    if (auto it = goal_s.find({bits, 512, 2}); it != goal_s.end()) {
      absl::StrAppend(&batch512, " K=", bits, ": ",
                      absl::StrFormat("%.0f", 2.0 * 512 * 4096 * 4096 / it->second / 1e9));
    }
  }
  if (!batch1.empty() || !batch512.empty() || !batch512_bf16.empty())
    std::printf("\ngoals (4096x4096, mul1, 2 threads; fp32 unless marked bf16):\n");
  if (!batch1.empty()) {
    std::printf("  batch 1   >= 26 G weights/s (1.5x ik_llama.cpp):%s\n", batch1.c_str());
  }
  if (!batch512.empty()) {
    std::printf("  batch 512 >= %.0f GFLOP/s (ik_llama.cpp, top of 333-397):%s\n",
                kIkBatch512Gflops2Threads, batch512.c_str());
  }
  if (!batch512_bf16.empty()) {
    std::printf("  batch 512 bf16 >= %.0f GFLOP/s:%s\n", kIkBatch512Gflops2Threads,
                batch512_bf16.c_str());
  }
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\nload average at end: %s\ntotal %.0f s%s\n", bench::LoadAverages().c_str(), total,
              failures ? " — some rows failed (see 'error' lines)" : "");
  return failures ? 1 : 0;
}
