// comm_rank_tool — one rank of a communicator group as its own process, for
// tests that put ranks where a unit test cannot (network namespaces, other
// hosts). Runs collectives on deterministic data, checks every result
// against a reference computed from all ranks' inputs, and prints one hash
// of the results every rank shares:
//
//   comm_rank_tool --backend ucx --rank 0 --world 2 --bootstrap 10.200.7.1:29517
//                  --tls tcp --check all --size 100003 --seed 7      (one command line)
//   hash 3f0c9a1e5b7d2c44
//
//   comm_rank_tool --reference --world 2 --check all --size 100003 --seed 7
//   hash 3f0c9a1e5b7d2c44        (the same hash, computed in this process)
//
// Exit status 0 on success; 1 with "error: <status>" on stderr when a
// collective fails or a result is wrong; 2 for bad flags.
// Fault injection: --die-after-ms M raises SIGKILL M ms after the
// communicator is up; --die-in-step K raises it before iteration K.
//
// --check allreduce: AllReduce fp32 and bf16 (hashed).
// --check all: also AllGather and Broadcast (hashed), ReduceScatter and
// AllToAllV (rank-specific: checked, not hashed), Barrier.
// References: fp32 sums in rank order (bit-exact, the Communicator
// contract), also within a float64 bound; bf16 as fp32 sums rounded once.
#include <signal.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"

namespace exl3serve::worker::comm {
namespace {

struct Flags {
  std::string backend = "ucx";
  int rank = 0;
  int world = 1;
  std::string bootstrap;  // host:port of rank 0
  std::string tls;
  std::string net_devices;
  std::string check = "allreduce";
  size_t size = 1001;
  uint64_t seed = 1;
  int iters = 1;
  int64_t timeout_ms = 30000;
  int64_t setup_timeout_ms = 60000;
  int64_t die_after_ms = -1;
  int die_in_step = -1;
  bool reference = false;
};

[[noreturn]] void Usage(const std::string& problem) {
  std::fprintf(
      stderr,
      "comm_rank_tool: %s\n"
      "usage: comm_rank_tool --backend ucx --rank R --world N --bootstrap HOST:PORT [--tls tcp]\n"
      "         [--net-devices DEV] [--check allreduce|all] [--size S] [--seed X] [--iters K]\n"
      "         [--timeout-ms T] [--setup-timeout-ms T] [--die-after-ms M] [--die-in-step K]\n"
      "       comm_rank_tool --reference --world N [--check ...] [--size S] [--seed X]\n"
      "         [--iters K]\n",
      problem.c_str());
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(a + " needs a value");
      return argv[++i];
    };
    auto number = [&]() -> int64_t {
      std::string v = value();
      char* end = nullptr;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0') Usage(a + " needs a number, got " + v);
      return n;
    };
    if (a == "--backend")
      f.backend = value();
    else if (a == "--rank")
      f.rank = static_cast<int>(number());
    else if (a == "--world")
      f.world = static_cast<int>(number());
    else if (a == "--bootstrap")
      f.bootstrap = value();
    else if (a == "--tls")
      f.tls = value();
    else if (a == "--net-devices")
      f.net_devices = value();
    else if (a == "--check")
      f.check = value();
    else if (a == "--size")
      f.size = static_cast<size_t>(number());
    else if (a == "--seed")
      f.seed = static_cast<uint64_t>(number());
    else if (a == "--iters")
      f.iters = static_cast<int>(number());
    else if (a == "--timeout-ms")
      f.timeout_ms = number();
    else if (a == "--setup-timeout-ms")
      f.setup_timeout_ms = number();
    else if (a == "--die-after-ms")
      f.die_after_ms = number();
    else if (a == "--die-in-step")
      f.die_in_step = static_cast<int>(number());
    else if (a == "--reference")
      f.reference = true;
    else
      Usage("unknown flag " + a);
  }
  if (f.world < 1 || f.rank < 0 || f.rank >= f.world) Usage("need 0 <= --rank < --world");
  if (f.check != "allreduce" && f.check != "all") Usage("--check must be allreduce or all");
  if (!f.reference && f.backend != "ucx")
    Usage("--backend: only ucx is supported, got " + f.backend);
  if (!f.reference && f.world > 1 && f.bootstrap.find(':') == std::string::npos) {
    Usage("--bootstrap HOST:PORT is required when --world > 1");
  }
  return f;
}

// --- deterministic data: element j of rank r's input to step s -------------------

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
float Value(uint64_t seed, int rank, int step, int kind, size_t j) {
  uint64_t h = Mix(seed ^
                   Mix((static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(step) << 8) ^
                       static_cast<uint64_t>(kind)) ^
                   Mix(j));
  return static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) *
         0x1p-23f;  // [-1, 1)
}
uint16_t ToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint8_t Byte(uint64_t seed, int rank, int step, int kind, size_t j) {
  return static_cast<uint8_t>(Mix(seed * 977 + static_cast<uint64_t>(rank) * 131 +
                                  static_cast<uint64_t>(step) * 7 + static_cast<uint64_t>(kind) +
                                  (j << 20)) >>
                              56);
}

enum Kind { kAllReduceF32 = 1, kAllReduceBF16, kAllGather, kBroadcast, kReduceScatter, kAllToAllV };

class Hasher {
 public:
  void Add(const void* data, size_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < bytes; ++i) h_ = (h_ ^ p[i]) * 1099511628211ull;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// The expected results of one step, from every rank's inputs.
struct Expected {
  std::vector<float> allreduce_f32;
  std::vector<uint16_t> allreduce_bf16;
  std::vector<uint8_t> allgather;
  std::vector<uint8_t> broadcast;
};

absl::Status CheckF32Against64(const std::vector<float>& got, const Flags& f, int step) {
  for (size_t j = 0; j < got.size(); ++j) {
    double ref = 0, mag = 0;
    for (int r = 0; r < f.world; ++r) {
      double v = Value(f.seed, r, step, kAllReduceF32, j);
      ref += v;
      mag += std::fabs(v);
    }
    if (std::fabs(got[j] - ref) > f.world * 0x1p-24 * mag + 1e-30) {
      return absl::InternalError(absl::StrCat("step ", step, ": allreduce f32 [", j, "] = ", got[j],
                                              " but the float64 sum is ", ref));
    }
  }
  return absl::OkStatus();
}

Expected Reference(const Flags& f, int step) {
  Expected e;
  const size_t n = f.size;
  e.allreduce_f32.resize(n);
  e.allreduce_bf16.resize(n);
  for (size_t j = 0; j < n; ++j) {
    float acc = 0, hacc = 0;
    for (int r = 0; r < f.world; ++r) {
      float v = Value(f.seed, r, step, kAllReduceF32, j);
      float h = FromBf16(ToBf16(Value(f.seed, r, step, kAllReduceBF16, j)));
      acc = r == 0 ? v : acc + v;
      hacc = r == 0 ? h : hacc + h;
    }
    e.allreduce_f32[j] = acc;
    e.allreduce_bf16[j] = ToBf16(hacc);
  }
  if (f.check == "all") {
    e.allgather.resize(n * f.world);
    for (int r = 0; r < f.world; ++r) {
      for (size_t j = 0; j < n; ++j) e.allgather[r * n + j] = Byte(f.seed, r, step, kAllGather, j);
    }
    const int root = step % f.world;
    e.broadcast.resize(n);
    for (size_t j = 0; j < n; ++j) e.broadcast[j] = Byte(f.seed, root, step, kBroadcast, j);
  }
  return e;
}

void HashStep(Hasher& hash, const Expected& e) {
  hash.Add(e.allreduce_f32.data(), e.allreduce_f32.size() * 4);
  hash.Add(e.allreduce_bf16.data(), e.allreduce_bf16.size() * 2);
  hash.Add(e.allgather.data(), e.allgather.size());
  hash.Add(e.broadcast.data(), e.broadcast.size());
}

// One step on the communicator; fills `got` with the shared results.
absl::Status RunStep(Communicator& comm, const Flags& f, int step, Expected& got) {
  const size_t n = f.size;
  const int me = f.rank;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(f.timeout_ms);
  got.allreduce_f32.resize(n);
  got.allreduce_bf16.resize(n);
  for (size_t j = 0; j < n; ++j) {
    got.allreduce_f32[j] = Value(f.seed, me, step, kAllReduceF32, j);
    got.allreduce_bf16[j] = ToBf16(Value(f.seed, me, step, kAllReduceBF16, j));
  }
  if (absl::Status st = comm.AllReduce(got.allreduce_f32.data(), n, CommDataType::kF32, deadline);
      !st.ok())
    return st;
  if (absl::Status st = comm.AllReduce(got.allreduce_bf16.data(), n, CommDataType::kBF16, deadline);
      !st.ok())
    return st;
  if (f.check != "all") return absl::OkStatus();

  std::vector<uint8_t> mine(n);
  for (size_t j = 0; j < n; ++j) mine[j] = Byte(f.seed, me, step, kAllGather, j);
  got.allgather.resize(n * f.world);
  if (absl::Status st = comm.AllGather(mine.data(), n, got.allgather.data(), deadline); !st.ok())
    return st;

  const int root = step % f.world;
  got.broadcast.assign(n, 0);
  if (me == root) {
    for (size_t j = 0; j < n; ++j) got.broadcast[j] = Byte(f.seed, root, step, kBroadcast, j);
  }
  if (absl::Status st = comm.Broadcast(got.broadcast.data(), n, root, deadline); !st.ok())
    return st;

  // ReduceScatter: block `me` of world·n, summed in rank order.
  std::vector<float> rs_in(n * f.world), rs_out(n);
  for (size_t j = 0; j < rs_in.size(); ++j) rs_in[j] = Value(f.seed, me, step, kReduceScatter, j);
  if (absl::Status st =
          comm.ReduceScatter(rs_in.data(), n, CommDataType::kF32, rs_out.data(), deadline);
      !st.ok()) {
    return st;
  }
  for (size_t j = 0; j < n; ++j) {
    float acc = 0;
    for (int r = 0; r < f.world; ++r) {
      float v = Value(f.seed, r, step, kReduceScatter, me * n + j);
      acc = r == 0 ? v : acc + v;
    }
    if (std::memcmp(&acc, &rs_out[j], 4) != 0) {
      return absl::InternalError(absl::StrCat("step ", step, ": reducescatter [", j,
                                              "] = ", rs_out[j], ", rank-order sum ", acc));
    }
  }

  // AllToAllV: rank s sends (n + 3s + 5d) % (n + 1) bytes to d.
  auto count = [&](int s, int d) {
    return (n + 3 * static_cast<size_t>(s) + 5 * static_cast<size_t>(d)) % (n + 1);
  };
  std::vector<size_t> sb(f.world), rb(f.world);
  size_t st_total = 0, rt_total = 0;
  for (int p = 0; p < f.world; ++p) {
    st_total += sb[p] = count(me, p);
    rt_total += rb[p] = count(p, me);
  }
  std::vector<uint8_t> send(st_total), recv(rt_total);
  size_t off = 0;
  for (int p = 0; p < f.world; ++p) {
    for (size_t j = 0; j < sb[p]; ++j)
      send[off + j] = Byte(f.seed, me * 1000 + p, step, kAllToAllV, j);
    off += sb[p];
  }
  if (absl::Status st = comm.AllToAllV(send.data(), sb, recv.data(), rb, deadline); !st.ok())
    return st;
  off = 0;
  for (int p = 0; p < f.world; ++p) {
    for (size_t j = 0; j < rb[p]; ++j) {
      if (recv[off + j] != Byte(f.seed, p * 1000 + me, step, kAllToAllV, j)) {
        return absl::InternalError(
            absl::StrCat("step ", step, ": alltoallv byte ", j, " from rank ", p, " is wrong"));
      }
    }
    off += rb[p];
  }
  return comm.Barrier(deadline);
}

absl::Status Compare(const Expected& got, const Expected& want, int step) {
  if (got.allreduce_f32 != want.allreduce_f32) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": allreduce f32 is not the rank-order fp32 sum"));
  }
  if (got.allreduce_bf16 != want.allreduce_bf16) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": allreduce bf16 is not the fp32 sum rounded once"));
  }
  if (got.allgather != want.allgather)
    return absl::InternalError(absl::StrCat("step ", step, ": allgather"));
  if (got.broadcast != want.broadcast)
    return absl::InternalError(absl::StrCat("step ", step, ": broadcast"));
  return absl::OkStatus();
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  Hasher hash;
  if (f.reference) {
    for (int step = 0; step < f.iters; ++step) {
      Expected e = Reference(f, step);
      if (absl::Status st = CheckF32Against64(e.allreduce_f32, f, step); !st.ok()) return Fail(st);
      HashStep(hash, e);
    }
    std::printf("hash %016" PRIx64 "\n", hash.value());
    return 0;
  }

  TcpBootstrapOptions boot_options{.rank = f.rank, .world_size = f.world};
  if (f.world > 1) {
    const size_t colon = f.bootstrap.rfind(':');
    boot_options.host = f.bootstrap.substr(0, colon);
    boot_options.port = static_cast<uint16_t>(std::atoi(f.bootstrap.c_str() + colon + 1));
  }
  const absl::Time setup_deadline = absl::Now() + absl::Milliseconds(f.setup_timeout_ms);
  auto boot = TcpBootstrap::Create(boot_options, setup_deadline);
  if (!boot.ok()) return Fail(boot.status());
  UcxOptions options;
  options.tls = f.tls;
  options.net_devices = f.net_devices;
  options.setup_timeout = absl::Milliseconds(f.setup_timeout_ms);
  auto made = CreateUcxCommunicator(options, **boot);
  if (!made.ok()) return Fail(made.status());
  std::unique_ptr<Communicator> comm = std::move(*made);

  if (f.die_after_ms >= 0) {
    // Fault injection, not synchronisation: the process dies mid-run.
    std::thread([ms = f.die_after_ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      raise(SIGKILL);
    }).detach();
  }
  for (int step = 0; step < f.iters; ++step) {
    if (step == f.die_in_step) raise(SIGKILL);
    Expected got;
    if (absl::Status st = RunStep(*comm, f, step, got); !st.ok()) return Fail(st);
    // Every step is checked for small runs; long runs (a kill test) check
    // the first step only, the rest just have to complete.
    if (step == 0 || f.size * static_cast<size_t>(f.world) * f.iters <= (size_t{1} << 24)) {
      Expected want = Reference(f, step);
      if (absl::Status st = Compare(got, want, step); !st.ok()) return Fail(st);
      if (absl::Status st = CheckF32Against64(got.allreduce_f32, f, step); !st.ok())
        return Fail(st);
    }
    HashStep(hash, got);
  }
  comm.reset();  // says bye to the peers before the process exits
  std::printf("hash %016" PRIx64 "\n", hash.value());
  return 0;
}

}  // namespace
}  // namespace exl3serve::worker::comm

int main(int argc, char** argv) { return exl3serve::worker::comm::Main(argc, argv); }
