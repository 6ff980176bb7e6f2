// cli/gemv_bench.cc — see gemv_bench.h.
#include "cli/gemv_bench.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/reconstruct.h"

#ifdef EXL3_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace exl3serve::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kHugePageBytes = size_t{2} << 20;

// 2 MiB-aligned allocation with transparent huge pages advised (fewer TLB
// misses while streaming; the same for every kernel measured).
std::byte* AllocateLarge(int64_t bytes) {
  const size_t size =
      (static_cast<size_t>(bytes) + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, size);
  if (p == nullptr) throw std::bad_alloc();
  madvise(p, size, MADV_HUGEPAGE);
  return static_cast<std::byte*>(p);
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Runs fn(t) on `threads` threads (t = 0 on the calling thread).
template <typename Fn>
void RunOnThreads(int threads, Fn fn) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& th : pool) th.join();
}

// Fills `bytes` with SplitMix64 output, one independent stream per chunk.
void FillRandomWords(std::byte* data, int64_t bytes, uint64_t seed) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t words = bytes / 8;
  RunOnThreads(threads, [&](int t) {
    const int64_t begin = words * t / threads, end = words * (t + 1) / threads;
    uint64_t state = seed ^ (0xA0761D6478BD642Full * static_cast<uint64_t>(t + 1));
    auto* w = reinterpret_cast<uint64_t*>(data);
    for (int64_t i = begin; i < end; ++i) w[i] = SplitMix64(state);
  });
}

void FillUniformFloats(std::byte* data, int64_t bytes, uint64_t seed) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t count = bytes / 4;
  RunOnThreads(threads, [&](int t) {
    const int64_t begin = count * t / threads, end = count * (t + 1) / threads;
    uint64_t state = seed ^ (0xE7037ED1A0B428DBull * static_cast<uint64_t>(t + 1));
    auto* f = reinterpret_cast<float*>(data);
    for (int64_t i = begin; i < end; ++i) {
      // 24 random mantissa bits -> [-1, 1).
      f[i] = static_cast<float>(static_cast<int32_t>(SplitMix64(state) >> 40) - (1 << 23)) *
             (1.0f / (1 << 23));
    }
  });
}

// The read loops: XOR-fold the range so the compiler cannot drop the loads.
// Eight independent 32-byte accumulators keep enough loads in flight.
__attribute__((target("avx2"))) uint64_t ReadRangeAvx2(const std::byte* p, int64_t bytes) {
  __m256i acc[8];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const auto* v = reinterpret_cast<const __m256i*>(p);
  const int64_t n = bytes / 256;
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_xor_si256(acc[j], _mm256_load_si256(v + 8 * i + j));
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm256_xor_si256(acc[0], acc[j]);
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

uint64_t ReadRangePortable(const std::byte* p, int64_t bytes) {
  uint64_t acc[8] = {};
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  const int64_t n = bytes / 64;
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < 8; ++j) acc[j] ^= w[8 * i + j];
  }
  uint64_t r = 0;
  for (uint64_t a : acc) r ^= a;
  return r;
}

std::atomic<uint64_t> g_read_sink{0};

}  // namespace

// ---------------------------------------------------------------- timing ---

TimingStats SummarizeTimings(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  const size_t n = seconds.size();
  TimingStats s;
  s.samples = static_cast<int>(n);
  s.min_s = seconds.front();
  s.max_s = seconds.back();
  s.median_s = n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  // Nearest rank: the smallest value with at least 10% of samples at or below.
  const size_t rank = static_cast<size_t>(std::ceil(0.10 * static_cast<double>(n)));
  s.p10_s = seconds[std::max<size_t>(rank, 1) - 1];
  return s;
}

absl::StatusOr<TimingStats> TimeCalls(const TimingPlan& plan,
                                      const std::function<absl::Status(int64_t)>& call) {
  int64_t index = 0;
  for (int i = 0; i < plan.warmup_calls; ++i) {
    absl::Status status = call(index++);
    if (!status.ok()) return status;
  }
  const int calls = std::max(plan.calls_per_sample, 1);
  auto now = [&plan]() -> double {
    if (plan.thread_cpu_time) {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
    }
    return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  };
  std::vector<double> seconds;
  double total = 0;
  while (static_cast<int>(seconds.size()) < std::max(plan.max_repeats, 1)) {
    if (static_cast<int>(seconds.size()) >= plan.min_repeats && total >= plan.max_seconds) break;
    const double t0 = now();
    for (int j = 0; j < calls; ++j) {
      absl::Status status = call(index++);
      if (!status.ok()) return status;
    }
    const double s = now() - t0;
    seconds.push_back(s / calls);
    total += s;
  }
  return SummarizeTimings(std::move(seconds));
}

// ----------------------------------------------------------- the machine ---

MachineInfo DescribeMachine() {
  MachineInfo info;
  info.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  // The first processor's block: "key<tabs>: value" lines up to a blank line.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string family, model, stepping;
  for (std::string line; std::getline(cpuinfo, line) && !line.empty();) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos || colon + 2 > line.size()) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    const std::string value = line.substr(colon + 2);
    if (key == "model name") info.cpu_model = value;
    if (key == "cpu family") family = value;
    if (key == "model") model = value;
    if (key == "stepping") stepping = value;
  }
  if (!family.empty()) {
    info.cpu_signature = absl::StrCat("family ", family, " model ", model, " stepping ", stepping);
  }
  if (info.cpu_model.empty()) info.cpu_model = "unknown CPU";
  std::ifstream l3("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string size;
  if (l3 >> size && !size.empty()) {
    int64_t value = 0;
    const char unit = size.back();
    const int64_t scale = unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1;
    if (absl::SimpleAtoi(scale == 1 ? size : size.substr(0, size.size() - 1), &value)) {
      info.l3_bytes = value * scale;
    }
  }
  return info;
}

std::string CurrentUtcTime() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

std::string LoadAverages() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(in >> one >> five >> fifteen)) return "?";
  return absl::StrCat(one, " ", five, " ", fifteen);
}

std::string ActiveIsaName() {
  return std::string(kernels::cpu::CpuIsaName(kernels::cpu::ActiveCpuIsa()));
}

// ------------------------------------------------------ DRAM read probe ---

ReadBandwidthProbe::ReadBandwidthProbe(int64_t capacity_bytes)
    : capacity_bytes_(capacity_bytes / 4096 * 4096), buffer_(AllocateLarge(capacity_bytes_)) {
  FillRandomWords(buffer_, capacity_bytes_, 0x5eed);  // touches every page
}

ReadBandwidthProbe::~ReadBandwidthProbe() { std::free(buffer_); }

ReadBandwidthProbe::Result ReadBandwidthProbe::Measure(int64_t bytes, int threads,
                                                       int min_passes) const {
  bytes = std::min(bytes, capacity_bytes_);
  const bool avx2 = kernels::cpu::CpuSupportsIsa(kernels::cpu::CpuIsa::kAvx2);
  // Each thread's share starts on a 4 KiB boundary.
  std::vector<int64_t> begin(threads + 1);
  for (int t = 0; t <= threads; ++t) begin[t] = bytes / 4096 * t / threads * 4096;
  std::vector<double> rates;
  double total = 0;
  while (static_cast<int>(rates.size()) < min_passes || total < 0.3) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    Clock::time_point start;
    RunOnThreads(threads, [&](int t) {
      ready.fetch_add(1);
      if (t == 0) {
        while (ready.load() < threads) {
        }
        start = Clock::now();
        go.store(true, std::memory_order_release);
      } else {
        while (!go.load(std::memory_order_acquire)) {
        }
      }
      const std::byte* p = buffer_ + begin[t];
      const int64_t n = begin[t + 1] - begin[t];
      g_read_sink.fetch_xor(avx2 ? ReadRangeAvx2(p, n) : ReadRangePortable(p, n));
    });
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    rates.push_back(static_cast<double>(begin[threads]) / s);
    total += s;
  }
  std::sort(rates.begin(), rates.end());
  return {rates.back(), rates[rates.size() / 2]};
}

// --------------------------------------------------------- weight pools ---

TrellisWeightPool::TrellisWeightPool() = default;
TrellisWeightPool::~TrellisWeightPool() { std::free(buffer_); }

void TrellisWeightPool::Reserve(int64_t bytes) {
  if (bytes <= bytes_) return;
  std::free(buffer_);
  buffer_ = nullptr;
  bytes_ = 0;
  const int64_t rounded = (bytes + 63) / 64 * 64;
  buffer_ = AllocateLarge(rounded);
  FillRandomWords(buffer_, rounded, 0x7e111);
  bytes_ = rounded;
}

const uint16_t* TrellisWeightPool::words() const {
  return reinterpret_cast<const uint16_t*>(buffer_);
}

DenseWeightPool::DenseWeightPool() = default;
DenseWeightPool::~DenseWeightPool() { std::free(buffer_); }

void DenseWeightPool::Reserve(int64_t bytes) {
  if (bytes <= bytes_) return;
  std::free(buffer_);
  buffer_ = nullptr;
  bytes_ = 0;
  const int64_t rounded = (bytes + 63) / 64 * 64;
  buffer_ = AllocateLarge(rounded);
  FillUniformFloats(buffer_, rounded, 0xde45e);
  bytes_ = rounded;
}

const float* DenseWeightPool::floats() const { return reinterpret_cast<const float*>(buffer_); }

int64_t CycleCopies(int64_t bytes_per_copy, int64_t cycle_bytes) {
  if (cycle_bytes <= 0) return 1;
  return std::max<int64_t>(2, (cycle_bytes + bytes_per_copy - 1) / bytes_per_copy);
}

// ---------------------------------------------------------- the kernels ---

namespace {

// Copies start on 4 KiB boundaries, so no two copies share a cache line.
int64_t CopyStrideBytes(int64_t bytes_per_copy) { return (bytes_per_copy + 4095) / 4096 * 4096; }

int64_t TrellisCopyBytes(const GemvCase& c) { return c.k * c.n * c.bits / 8; }
int64_t DenseCopyBytes(const GemvCase& c) { return c.k * c.n * 4; }

}  // namespace

int64_t TrellisPoolBytes(const GemvCase& c) {
  const int64_t bytes = TrellisCopyBytes(c);
  return CopyStrideBytes(bytes) * CycleCopies(bytes, c.cycle_bytes);
}

int64_t DensePoolBytes(const GemvCase& c) {
  const int64_t bytes = DenseCopyBytes(c);
  return CopyStrideBytes(bytes) * CycleCopies(bytes, c.cycle_bytes);
}

namespace {

std::vector<float> UniformVector(int64_t count, float lo, float hi, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(count));
  uint64_t state = seed;
  for (auto& x : v) {
    const double u = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;
    x = static_cast<float>(lo + (hi - lo) * u);
  }
  return v;
}

// Random sign times a magnitude in [lo, hi): the shape of EXL3's suh/svh
// (sign flips folded with per-channel scales).
std::vector<float> SignedScales(int64_t count, float lo, float hi, uint64_t seed) {
  std::vector<float> v = UniformVector(count, lo, hi, seed);
  uint64_t state = seed * 31 + 7;
  for (auto& x : v) {
    if (SplitMix64(state) & 1) x = -x;
  }
  return v;
}

}  // namespace

absl::StatusOr<GemvMeasurement> MeasureTrellisGemv(const GemvCase& c, TrellisWeightPool& pool,
                                                   const TimingPlan& plan) {
  if (c.threads < 1)
    return absl::InvalidArgumentError(absl::StrCat("threads must be >= 1, got ", c.threads));
  if (c.m < 1) return absl::InvalidArgumentError(absl::StrCat("batch must be >= 1, got ", c.m));
  GemvMeasurement r;
  r.bytes_per_copy = TrellisCopyBytes(c);
  r.copies = CycleCopies(r.bytes_per_copy, c.cycle_bytes);
  const int64_t stride = CopyStrideBytes(r.bytes_per_copy);
  pool.Reserve(TrellisPoolBytes(c));

  // suh ~ ±[0.5, 1.5), svh ~ ±[0.005, 0.02): unit-ish inputs, small weights.
  const std::vector<float> suh = SignedScales(c.k, 0.5f, 1.5f, 11);
  const std::vector<float> svh = SignedScales(c.n, 0.005f, 0.02f, 13);
  const std::vector<float> x = UniformVector(c.m * c.k, -1.0f, 1.0f, 17);
  std::vector<float> y(static_cast<size_t>(c.m * c.n));

  kernels::Exl3LinearView view;
  view.k = c.k;
  view.n = c.n;
  view.bits = c.bits;
  view.codebook = c.codebook;
  view.suh = suh.data();
  view.svh = svh.data();
  kernels::TrellisGemmOptions options;
  options.max_threads = c.threads;
  options.precision = c.precision;

  const auto* base = reinterpret_cast<const std::byte*>(pool.words());
  auto call = [&](int64_t i) -> absl::Status {
    view.trellis = reinterpret_cast<const uint16_t*>(base + (i % r.copies) * stride);
    return kernels::TrellisGemm(view, x.data(), c.m, y.data(), options);
  };
  auto timing = TimeCalls(plan, call);
  if (!timing.ok()) return timing.status();
  r.timing = *timing;
  return r;
}

#ifdef EXL3_HAVE_OPENBLAS

bool HaveDenseBaseline() { return true; }

std::string DenseBaselineDescription() {
  std::string config = openblas_get_config();
  while (!config.empty() && config.back() == ' ') config.pop_back();
  return absl::StrCat("OpenBLAS fp32 (", config, "; core ", openblas_get_corename(), ")");
}

absl::StatusOr<GemvMeasurement> MeasureDenseGemv(const GemvCase& c, DenseWeightPool& pool,
                                                 const TimingPlan& plan) {
  if (c.threads < 1)
    return absl::InvalidArgumentError(absl::StrCat("threads must be >= 1, got ", c.threads));
  if (c.m < 1) return absl::InvalidArgumentError(absl::StrCat("batch must be >= 1, got ", c.m));
  GemvMeasurement r;
  r.bytes_per_copy = DenseCopyBytes(c);
  r.copies = CycleCopies(r.bytes_per_copy, c.cycle_bytes);
  const int64_t stride = CopyStrideBytes(r.bytes_per_copy);
  pool.Reserve(DensePoolBytes(c));
  const std::vector<float> x = UniformVector(c.m * c.k, -1.0f, 1.0f, 17);
  std::vector<float> y(static_cast<size_t>(c.m * c.n));
  openblas_set_num_threads(c.threads);

  const auto* base = reinterpret_cast<const std::byte*>(pool.floats());
  const int k = static_cast<int>(c.k), n = static_cast<int>(c.n), m = static_cast<int>(c.m);
  auto call = [&](int64_t i) -> absl::Status {
    const auto* w = reinterpret_cast<const float*>(base + (i % r.copies) * stride);
    if (m == 1) {
      // y[n] = W^T x with W k x n row-major.
      cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, w, n, x.data(), 1, 0.0f, y.data(), 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, x.data(), k, w, n, 0.0f,
                  y.data(), n);
    }
    return absl::OkStatus();
  };
  auto timing = TimeCalls(plan, call);
  if (!timing.ok()) return timing.status();
  r.timing = *timing;
  return r;
}

void QuiesceDenseBaseline() {
  openblas_set_num_threads(1);
  // OpenBLAS workers spin for a while after their last job before sleeping.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

#else  // !EXL3_HAVE_OPENBLAS

bool HaveDenseBaseline() { return false; }
std::string DenseBaselineDescription() { return "n/a (built without OpenBLAS)"; }
absl::StatusOr<GemvMeasurement> MeasureDenseGemv(const GemvCase&, DenseWeightPool&,
                                                 const TimingPlan&) {
  return absl::UnimplementedError(
      "dense baseline needs OpenBLAS: install libopenblas-dev and re-run cmake");
}
void QuiesceDenseBaseline() {}

#endif  // EXL3_HAVE_OPENBLAS

// ------------------------------------------------------------- parsing ---

std::string CodebookName(kernels::Codebook codebook) {
  switch (codebook) {
    case kernels::Codebook::k3Inst:
      return "3inst";
    case kernels::Codebook::kMcg:
      return "mcg";
    case kernels::Codebook::kMul1:
      return "mul1";
  }
  return "?";
}

absl::StatusOr<kernels::Codebook> ParseCodebook(const std::string& name) {
  if (name == "mul1") return kernels::Codebook::kMul1;
  if (name == "mcg") return kernels::Codebook::kMcg;
  if (name == "3inst") return kernels::Codebook::k3Inst;
  return absl::InvalidArgumentError(
      absl::StrCat("codebook must be mul1, mcg or 3inst, got '", name, "'"));
}

absl::StatusOr<std::pair<int64_t, int64_t>> ParseShape(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, 'x');
  int64_t in = 0, out = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &in) || !absl::SimpleAtoi(parts[1], &out) ||
      in <= 0 || out <= 0 || in % kernels::kExl3ChannelGranularity != 0 ||
      out % kernels::kExl3ChannelGranularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape must be INxOUT with both positive multiples of 128 (e.g. 4096x14336), got '", text,
        "'"));
  }
  return std::make_pair(in, out);
}

}  // namespace exl3serve::cli
