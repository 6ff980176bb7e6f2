// Our shm AllReduce (worker/comm/shm_communicator.h) against OpenMPI's
// MPI_Allreduce, in the same run on the same ranks:
//
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/tests/allreduce_bench
//   tests/bench/allreduce_bench.sh            # N = 2, 3, 4
//
// Every rank joins an shm communicator (rank and world from MPI, the segment
// name broadcast by MPI from rank 0). For each size (--min-bytes ...
// --max-bytes, times --factor) and dtype, the two all-reduces alternate,
// each iteration preceded by an MPI_Barrier; a rank times only its own call.
// An iteration's latency is the slowest rank's time; the table shows the
// median over iterations (after warm-up), so both libraries are measured the
// same way. Iterations per size: --budget-bytes / size, clamped to
// [--min-iters, --max-iters].
//
// bf16: MPI has no bf16 type; its rows use a user-defined MPI_Op over
// MPI_UINT16_T (widen to fp32, add, round to nearest even per combine — a
// scalar loop, so MPI's bf16 figures are those of a custom op, not a tuned
// one). Ours: fp32 accumulation over all ranks, rounded once.
//
// Columns: ours/MPI = our latency over MPI's (< 1: we are faster); busbw =
// bytes / time · 2(N-1)/N in GB/s (nccl-tests' bus bandwidth); algo = which
// of our algorithms ran (one-shot up to --one-shot-max-bytes).
//
// Flags: --min-bytes=1024 --max-bytes=67108864 --factor=4 --dtypes=f32,bf16
// --one-shot-max-bytes=N --slot-bytes=N --spin=N --yield=N (ShmOptions; default: the
// library's defaults) --budget-bytes=1073741824 --min-iters=10 --max-iters=2000
// --warmup=5 --no-mpi (ours only) --check (verify the sums once per size)
// --backend=shm|ucx (ucx: UCX over TCP on loopback, bootstrap port sent by MPI).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "worker/comm/communicator.h"
#include "worker/comm/reduce_sum.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"

namespace exl3serve::worker::comm {
namespace {

struct Flags {
  size_t min_bytes = 1024;
  size_t max_bytes = 64u << 20;
  size_t factor = 4;
  bool f32 = true;
  bool bf16 = true;
  size_t one_shot_max_bytes = kShmAutoOneShot;
  size_t slot_bytes = kShmDefaultSlotBytes;
  int spin = kShmAutoSpin;
  int yield = kShmDefaultYieldIterations;
  size_t budget_bytes = size_t{1} << 30;
  int min_iters = 10;
  int max_iters = 2000;
  int warmup = 5;
  bool mpi = true;
  bool check = false;
  std::string backend = "shm";  // shm | ucx (UCX over TCP, loopback)
};

bool ParseFlag(const std::string& arg, const char* name, std::string* value) {
  const std::string prefix = std::string("--") + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  *value = arg.substr(prefix.size());
  return true;
}

Flags ParseFlags(int argc, char** argv, int rank) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string v;
    if (ParseFlag(a, "min-bytes", &v)) {
      f.min_bytes = std::stoull(v);
    } else if (ParseFlag(a, "max-bytes", &v)) {
      f.max_bytes = std::stoull(v);
    } else if (ParseFlag(a, "factor", &v)) {
      f.factor = std::max<size_t>(2, std::stoull(v));
    } else if (ParseFlag(a, "dtypes", &v)) {
      f.f32 = v.find("f32") != std::string::npos;
      f.bf16 = v.find("bf16") != std::string::npos;
    } else if (ParseFlag(a, "one-shot-max-bytes", &v)) {
      f.one_shot_max_bytes = std::stoull(v);
    } else if (ParseFlag(a, "slot-bytes", &v)) {
      f.slot_bytes = std::stoull(v);
    } else if (ParseFlag(a, "spin", &v)) {
      f.spin = std::stoi(v);
    } else if (ParseFlag(a, "yield", &v)) {
      f.yield = std::stoi(v);
    } else if (ParseFlag(a, "budget-bytes", &v)) {
      f.budget_bytes = std::stoull(v);
    } else if (ParseFlag(a, "min-iters", &v)) {
      f.min_iters = std::stoi(v);
    } else if (ParseFlag(a, "max-iters", &v)) {
      f.max_iters = std::stoi(v);
    } else if (ParseFlag(a, "warmup", &v)) {
      f.warmup = std::stoi(v);
    } else if (ParseFlag(a, "backend", &v)) {
      f.backend = v;
    } else if (a == "--no-mpi") {
      f.mpi = false;
    } else if (a == "--check") {
      f.check = true;
    } else {
      if (rank == 0) std::fprintf(stderr, "allreduce_bench: unknown flag %s\n", a.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  return f;
}

// MPI's bf16 sum: widen, add, round (RNE) per combine.
void SumBF16Op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = F32ToBF16(BF16ToF32(a[i]) + BF16ToF32(b[i]));
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Per-iteration max over ranks (on rank 0), then the median.
double MedianOfSlowest(const std::vector<double>& mine, int rank) {
  std::vector<double> slowest(mine.size());
  MPI_Reduce(mine.data(), slowest.data(), static_cast<int>(mine.size()), MPI_DOUBLE, MPI_MAX, 0,
             MPI_COMM_WORLD);
  return rank == 0 ? Median(slowest) : 0.0;
}

std::string SizeName(size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) {
    std::snprintf(buf, sizeof(buf), "%zu MiB", bytes >> 20);
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    std::snprintf(buf, sizeof(buf), "%zu KiB", bytes >> 10);
  } else {
    std::snprintf(buf, sizeof(buf), "%zu B", bytes);
  }
  return buf;
}

int Run(int argc, char** argv) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const Flags flags = ParseFlags(argc, argv, rank);

  char name[64] = {};
  if (rank == 0) {
    std::random_device entropy;
    std::snprintf(name, sizeof(name), "/exl3-bench-%d-%u", static_cast<int>(getpid()), entropy());
  }
  MPI_Bcast(name, sizeof(name), MPI_CHAR, 0, MPI_COMM_WORLD);
  ShmOptions options;
  options.name = name;
  options.rank = rank;
  options.world_size = world;
  options.one_shot_max_bytes = flags.one_shot_max_bytes;
  options.slot_bytes = flags.slot_bytes;
  options.spin_iterations = flags.spin;
  options.yield_iterations = flags.yield;
  options.join_deadline = Deadline(absl::Seconds(60));
  absl::StatusOr<std::unique_ptr<Communicator>> created;
  size_t ucx_one_shot_max_bytes = 0;
  if (flags.backend == "ucx") {
    // UCX over TCP on loopback: rank 0's bootstrap port travels by MPI.
    TcpBootstrapOptions boot;
    boot.rank = rank;
    boot.world_size = world;
    boot.host = "127.0.0.1";
    std::unique_ptr<TcpBootstrap> bootstrap;
    int port = 0;
    if (rank == 0) {
      auto b = TcpBootstrap::Create(boot, Deadline(absl::Seconds(60)));
      if (!b.ok()) {
        std::fprintf(stderr, "rank 0: %s\n", b.status().ToString().c_str());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      bootstrap = std::move(*b);
      port = bootstrap->port();
    }
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank != 0) {
      boot.port = static_cast<uint16_t>(port);
      auto b = TcpBootstrap::Create(boot, Deadline(absl::Seconds(60)));
      if (!b.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, b.status().ToString().c_str());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      bootstrap = std::move(*b);
    }
    UcxOptions ucx;
    ucx.tls = "tcp";
    ucx_one_shot_max_bytes = ucx.one_shot_max_bytes;
    created = CreateUcxCommunicator(ucx, *bootstrap);
  } else {
    created = CreateShmCommunicator(options);
  }
  if (!created.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, created.status().ToString().c_str());
    if (rank == 0) UnlinkShmSegment(name);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Communicator& comm = **created;
  const size_t one_shot_max_bytes =
      flags.backend == "ucx" ? ucx_one_shot_max_bytes
      : flags.one_shot_max_bytes == kShmAutoOneShot
          ? std::min(ShmAutoOneShotMaxBytes(world), flags.slot_bytes)
          : flags.one_shot_max_bytes;

  MPI_Op bf16_sum;
  MPI_Op_create(&SumBF16Op, /*commute=*/1, &bf16_sum);

  if (rank == 0) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::printf("allreduce_bench: %d ranks on %s (%ld online CPUs); backend %s, one_shot_max %zu B, "
                "slot %zu B, spin %d (-1: auto), yield %d\n",
                world, host, sysconf(_SC_NPROCESSORS_ONLN), flags.backend.c_str(), one_shot_max_bytes,
                flags.slot_bytes, flags.spin, flags.yield);
    std::printf("| N | size | dtype | algo | ours us | MPI us | ours/MPI | ours busbw GB/s | MPI busbw GB/s |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    std::fflush(stdout);
  }

  std::vector<CommDataType> types;
  if (flags.f32) types.push_back(CommDataType::kF32);
  if (flags.bf16) types.push_back(CommDataType::kBF16);
  const absl::Duration timeout = absl::Seconds(60);
  for (CommDataType type : types) {
    const size_t esize = CommDataTypeSize(type);
    for (size_t bytes = flags.min_bytes; bytes <= flags.max_bytes; bytes *= flags.factor) {
      const size_t count = bytes / esize;
      // Zeros keep the values finite (no denormals, no inf) however many calls run.
      std::vector<unsigned char> ours(bytes, 0), theirs(bytes, 0);
      if (flags.check) {
        for (size_t i = 0; i < count; ++i) {
          if (type == CommDataType::kF32) {
            reinterpret_cast<float*>(ours.data())[i] = static_cast<float>(rank + 1);
          } else {
            reinterpret_cast<uint16_t*>(ours.data())[i] = F32ToBF16(static_cast<float>(rank + 1));
          }
        }
        absl::Status s = comm.AllReduce(ours.data(), count, type, Deadline(timeout));
        const float want = static_cast<float>(world * (world + 1) / 2);
        bool good = s.ok();
        for (size_t i = 0; good && i < count; ++i) {
          const float got = type == CommDataType::kF32
                                ? reinterpret_cast<float*>(ours.data())[i]
                                : BF16ToF32(reinterpret_cast<uint16_t*>(ours.data())[i]);
          good = got == want;
        }
        if (!good) {
          std::fprintf(stderr, "rank %d: check failed at %zu bytes: %s\n", rank, bytes,
                       s.ToString().c_str());
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
        std::fill(ours.begin(), ours.end(), 0);
      }
      const int iters = static_cast<int>(std::clamp<size_t>(
          flags.budget_bytes / bytes, static_cast<size_t>(flags.min_iters),
          static_cast<size_t>(flags.max_iters)));
      std::vector<double> t_ours, t_mpi;
      for (int it = -flags.warmup; it < iters; ++it) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = Now();
        absl::Status s = comm.AllReduce(ours.data(), count, type, Deadline(timeout));
        double t1 = Now();
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
        if (it >= 0) t_ours.push_back(t1 - t0);
        if (!flags.mpi) continue;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = Now();
        if (type == CommDataType::kF32) {
          MPI_Allreduce(MPI_IN_PLACE, theirs.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                        MPI_COMM_WORLD);
        } else {
          MPI_Allreduce(MPI_IN_PLACE, theirs.data(), static_cast<int>(count), MPI_UINT16_T,
                        bf16_sum, MPI_COMM_WORLD);
        }
        t1 = Now();
        if (it >= 0) t_mpi.push_back(t1 - t0);
      }
      const double ours_s = MedianOfSlowest(t_ours, rank);
      const double mpi_s = flags.mpi ? MedianOfSlowest(t_mpi, rank) : 0.0;
      if (rank == 0) {
        const double bus = static_cast<double>(bytes) * 2.0 * (world - 1) / world / 1e9;
        const char* algo = bytes <= one_shot_max_bytes ? "one-shot" : "two-shot";
        if (flags.mpi) {
          std::printf("| %d | %s | %s | %s | %.1f | %.1f | %.2f | %.2f | %.2f |\n", world,
                      SizeName(bytes).c_str(), CommDataTypeName(type), algo, ours_s * 1e6,
                      mpi_s * 1e6, ours_s / mpi_s, bus / ours_s, bus / mpi_s);
        } else {
          std::printf("| %d | %s | %s | %s | %.1f | - | - | %.2f | - |\n", world,
                      SizeName(bytes).c_str(), CommDataTypeName(type), algo, ours_s * 1e6,
                      bus / ours_s);
        }
        std::fflush(stdout);
      }
    }
  }
  MPI_Op_free(&bf16_sum);
  return 0;
}

}  // namespace
}  // namespace exl3serve::worker::comm

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int rc = exl3serve::worker::comm::Run(argc, argv);
  MPI_Finalize();
  return rc;
}
