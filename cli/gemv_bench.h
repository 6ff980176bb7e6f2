// cli/gemv_bench.h — the measurement code behind `exl3serve bench gemv` and
// tests/bench/trellis_gemv_bench.cc: timing statistics, a STREAM-style DRAM
// read-bandwidth probe, weight pools that are cycled so every call reads its
// weights from DRAM, and the two things being timed — kernels::TrellisGemm on
// random trellis data, and the dense fp32 baseline (OpenBLAS sgemv/sgemm, when
// the build found OpenBLAS). Both programs link this one library
// (`exl3_bench`), so a figure printed by one means the same as in the other.
//
//   TrellisWeightPool pool;                                  // grows on demand
//   GemvCase c{.k = 4096, .n = 4096, .bits = 2, .m = 1, .threads = 1};
//   EXL3_ASSIGN_OR_RETURN(GemvMeasurement r, MeasureTrellisGemv(c, pool, TimingPlan{}));
//   printf("%.1f us\n", r.timing.median_s * 1e6);
//
// Cold weights: a case of `bytes_per_copy` packed bytes gets
// copies = max(2, ceil(cycle_bytes / bytes_per_copy)) distinct copies, laid
// out back to back in one pool, and call i reads copy i mod copies. Between
// two reads of the same copy at least `cycle_bytes` of other weights stream
// through, so with cycle_bytes larger than the last-level cache each call
// reads DRAM. Any 16-bit words are valid trellis data (exl3-format.md §3), so
// copies are simply disjoint slices of one random buffer. suh/svh/x are shared
// by all copies (k + n + m·k floats: cache-resident, as in a real forward).
//
// Thread safety: functions are thread-compatible; one measurement at a time
// (they use every core they are given). Ownership: pools own their memory;
// measurements borrow the pool for the duration of the call.
#ifndef EXL3SERVE_CLI_GEMV_BENCH_H_
#define EXL3SERVE_CLI_GEMV_BENCH_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_gemm.h"

namespace exl3serve::cli {

// Default bytes of distinct weights streamed between two reads of one copy.
// Must exceed the last-level cache; the probe curve printed by the bench shows
// where the plateau starts on the machine at hand. 2 GiB: the 2-vCPU CI Xeon
// reports a 480 MiB L3 and reads at the same rate with 1 GiB and 2 GiB
// cycles (trellis_gemv_bench, 2026-11-29), so 2 GiB leaves a 4x margin.
inline constexpr int64_t kDefaultCycleBytes = int64_t{2} << 30;

// ---------------------------------------------------------------- timing ---

// Order statistics of per-call wall times, in seconds.
struct TimingStats {
  int samples = 0;
  double median_s = 0;
  double p10_s = 0;  // 10th percentile (nearest rank): the "good call" time
  double min_s = 0;
  double max_s = 0;
};

// Requires: `seconds` non-empty.
TimingStats SummarizeTimings(std::vector<double> seconds);

// How many calls to time. Warm-up calls are run first and discarded; then
// samples are timed one by one until `max_repeats` are done, or `max_seconds`
// of timed samples have passed and at least `min_repeats` are done. A sample
// is `calls_per_sample` consecutive calls timed together, recorded as time
// per call. With `thread_cpu_time` samples read CLOCK_THREAD_CPUTIME_ID of
// the calling thread instead of a steady clock: robust against other
// processes loading the machine, but it counts only the calling thread, so
// use it only where all work runs there (TrellisGemm with max_threads = 1).
struct TimingPlan {
  int warmup_calls = 3;
  int min_repeats = 3;
  int max_repeats = 50;
  double max_seconds = 2.0;
  int calls_per_sample = 1;
  bool thread_cpu_time = false;
};

// Runs call(i) for i = 0, 1, ... (warm-up included, so a cycling index keeps
// advancing) and times each sample as the plan says. The first non-OK
// status from `call` is returned as is.
absl::StatusOr<TimingStats> TimeCalls(const TimingPlan& plan,
                                      const std::function<absl::Status(int64_t call)>& call);

// ----------------------------------------------------------- the machine ---

struct MachineInfo {
  std::string cpu_model;      // /proc/cpuinfo "model name"
  std::string cpu_signature;  // "family 6 model 143 stepping 8" (VMs may mask the name)
  int logical_cpus = 0;       // std::thread::hardware_concurrency()
  int64_t l3_bytes = 0;       // as the kernel reports it (sysfs), 0 if unknown
};
MachineInfo DescribeMachine();

// "2025-01-31 14:05 UTC".
std::string CurrentUtcTime();

// The 1/5/15-minute load averages from /proc/loadavg ("0.52 0.61 0.70"), so a
// table says whether something else was running; "?" if unreadable.
std::string LoadAverages();

// The CPU ISA the kernels run with now (after any override), e.g. "avx512".
std::string ActiveIsaName();

// ------------------------------------------------------ DRAM read probe ---

// A STREAM-style read: `threads` threads each sum their contiguous share of a
// buffer (wide loads, several independent accumulators, nothing written), the
// pass timed from a common start to the last thread's end.
//
// Ownership: owns one buffer of `capacity_bytes` (huge pages advised, touched
// in parallel at construction so page faults are not timed).
class ReadBandwidthProbe {
 public:
  explicit ReadBandwidthProbe(int64_t capacity_bytes);
  ~ReadBandwidthProbe();
  ReadBandwidthProbe(const ReadBandwidthProbe&) = delete;
  ReadBandwidthProbe& operator=(const ReadBandwidthProbe&) = delete;

  int64_t capacity_bytes() const { return capacity_bytes_; }

  // Best and median bytes/s over passes reading the first `bytes` of the
  // buffer (at least `min_passes` passes and ~0.3 s). Requires
  // 0 < bytes <= capacity_bytes(), threads >= 1.
  struct Result {
    double best_bytes_per_s = 0;
    double median_bytes_per_s = 0;
  };
  Result Measure(int64_t bytes, int threads, int min_passes = 5) const;

 private:
  int64_t capacity_bytes_;
  std::byte* buffer_;
};

// --------------------------------------------------------- weight pools ---

// Random 16-bit words (SplitMix64, fixed seed) used as trellis data.
// Ownership: owns its buffer. Thread safety: thread-compatible.
class TrellisWeightPool {
 public:
  TrellisWeightPool();
  ~TrellisWeightPool();
  TrellisWeightPool(const TrellisWeightPool&) = delete;
  TrellisWeightPool& operator=(const TrellisWeightPool&) = delete;

  // Makes the pool at least `bytes` long (refilled if it has to grow).
  void Reserve(int64_t bytes);
  const uint16_t* words() const;
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = 0;
  std::byte* buffer_ = nullptr;
};

// Uniform fp32 weights in [-1, 1) for the dense baseline (no denormals,
// no NaNs, so the FPU runs at full speed). Same contract as above.
class DenseWeightPool {
 public:
  DenseWeightPool();
  ~DenseWeightPool();
  DenseWeightPool(const DenseWeightPool&) = delete;
  DenseWeightPool& operator=(const DenseWeightPool&) = delete;

  void Reserve(int64_t bytes);
  const float* floats() const;
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = 0;
  std::byte* buffer_ = nullptr;
};

// Number of copies of a `bytes_per_copy` matrix cycled so that at least
// `cycle_bytes` stream between two reads of the same copy (>= 2); 1 when
// cycle_bytes <= 0 (hot weights: every call reads the same copy).
int64_t CycleCopies(int64_t bytes_per_copy, int64_t cycle_bytes);

// ---------------------------------------------------------- the kernels ---

// One GEMV/GEMM configuration: y[m x n] = x[m x k] · W[k x n].
struct GemvCase {
  int64_t k = 4096;
  int64_t n = 4096;
  int bits = 4;  // trellis only
  kernels::Codebook codebook = kernels::Codebook::kMul1;
  int64_t m = 1;    // batch rows
  int threads = 1;  // >= 1
  kernels::TrellisGemmPrecision precision = kernels::TrellisGemmPrecision::kFloat;
  int64_t cycle_bytes = kDefaultCycleBytes;  // <= 0: one copy, hot in cache
};

struct GemvMeasurement {
  TimingStats timing;
  int64_t bytes_per_copy = 0;  // packed weight bytes read per call
  int64_t copies = 0;          // distinct weight copies cycled
};

// Times kernels::TrellisGemm on random trellis data (reserving pool space as
// needed) with options.max_threads = c.threads. Errors: InvalidArgument for
// shapes the kernel rejects, else TrellisGemm's own status.
absl::StatusOr<GemvMeasurement> MeasureTrellisGemv(const GemvCase& c, TrellisWeightPool& pool,
                                                   const TimingPlan& plan);

// Pool bytes a case needs (all its copies), for reserving once up front:
// growing a pool refills it, ~0.6 s per GiB on the 2-core CI machine.
int64_t TrellisPoolBytes(const GemvCase& c);
int64_t DensePoolBytes(const GemvCase& c);

// True when the build linked OpenBLAS (the dense baseline).
bool HaveDenseBaseline();

// "OpenBLAS 0.3.21 (core SkylakeX, built for 64 threads)" or
// "n/a (built without OpenBLAS)".
std::string DenseBaselineDescription();

// Times the fp32 baseline on the same shape: cblas_sgemv for m = 1, else
// cblas_sgemm (row-major, W k x n, no transposes), with OpenBLAS limited to
// c.threads threads (openblas_set_num_threads; OpenBLAS may still use fewer
// on small problems). Weights cycled like the trellis ones (fp32 bytes).
// Unimplemented when HaveDenseBaseline() is false.
absl::StatusOr<GemvMeasurement> MeasureDenseGemv(const GemvCase& c, DenseWeightPool& pool,
                                                 const TimingPlan& plan);

// Puts OpenBLAS back to one thread and waits for its worker threads to stop
// spinning, so they do not steal cores from the measurements that follow.
void QuiesceDenseBaseline();

// "mul1" / "mcg" / "3inst", and the reverse (InvalidArgument naming the value).
std::string CodebookName(kernels::Codebook codebook);
absl::StatusOr<kernels::Codebook> ParseCodebook(const std::string& name);

// "4096x14336" -> {4096, 14336} (in x out). InvalidArgument naming the value
// unless both are positive multiples of 128.
absl::StatusOr<std::pair<int64_t, int64_t>> ParseShape(const std::string& text);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_GEMV_BENCH_H_
