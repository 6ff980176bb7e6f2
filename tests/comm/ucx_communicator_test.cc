// The ucx Communicator: N = 1..4 forked ranks on 127.0.0.1 (TcpBootstrap on an
// ephemeral port), UCX's tcp transport and its default choice. Every
// collective is checked against a float64 reference and bit for bit against
// the rank-order fp32 sum, and across ranks by hash; then the failure
// contract: a SIGKILLed rank, Abort() (also from another thread), a rank
// that never calls, mismatched calls, a rank that left. The parent waits on
// the children's sockets with a deadline and kills them on timeout; nothing
// sleeps.
#include "worker/comm/ucx_communicator.h"

#include <signal.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/ucx_forked_ranks.h"
#include "worker/comm/tcp_bootstrap.h"

namespace exl3serve::worker::comm {
namespace {

using testing::ForkOptions;
using ::testing::HasSubstr;
using testing::RankChannel;
using testing::RankOutcome;
using testing::RunForkedRanks;

// Deadline for calls that must succeed: far above anything a loaded 2-core
// machine needs, so only a hang reaches it.
constexpr absl::Duration kCallTimeout = absl::Seconds(30);

uint64_t Seed() {
  return 0x5eed0000u + static_cast<uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
}

// --- data and references --------------------------------------------------------

std::vector<float> RandomF32(uint64_t seed, int rank, int call, size_t count) {
  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(rank) << 32) ^
                      (static_cast<uint64_t>(call) << 48));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
}

uint16_t RoundToBf16(float value) {  // the test's own RNE (independent of reduce_sum.h)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}
float Bf16Value(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<uint16_t> RandomBF16(uint64_t seed, int rank, int call, size_t count) {
  std::vector<float> f = RandomF32(seed, rank, call, count);
  std::vector<uint16_t> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = RoundToBf16(f[i]);
  return out;
}

std::vector<uint8_t> RandomBytes(uint64_t seed, int rank, int call, size_t count) {
  std::mt19937_64 rng(seed * 31 + static_cast<uint64_t>(rank) * 1000003u +
                      static_cast<uint64_t>(call));
  std::vector<uint8_t> out(count);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

uint64_t Fnv1a(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

// Collects a rank's check failures as "error ..." lines.
class Checker {
 public:
  explicit Checker(RankChannel& channel) : channel_(channel) {}
  bool Expect(bool ok, const std::string& what) {
    if (!ok) channel_.Send("error " + what);
    return ok;
  }
  bool Ok(const absl::Status& status, const std::string& what) {
    return Expect(status.ok(), absl::StrCat(what, ": ", status.ToString()));
  }
  void Hash(const std::string& name, const void* data, size_t bytes) {
    channel_.Send(absl::StrCat("hash ", name, " ", Hex(Fnv1a(data, bytes))));
  }

 private:
  RankChannel& channel_;
};

// Rank 0 listens on an ephemeral port and reports it; the others connect.
std::unique_ptr<Communicator> JoinGroup(int rank, int world, uint16_t port, RankChannel& channel,
                                        const UcxOptions& options) {
  auto boot =
      TcpBootstrap::Create({.rank = rank, .world_size = world, .host = "127.0.0.1", .port = port},
                           Deadline(absl::Seconds(60)));
  if (!boot.ok()) {
    channel.Send("error bootstrap: " + boot.status().ToString());
    return nullptr;
  }
  if (rank == 0) channel.Send(absl::StrCat("port ", (*boot)->port()));
  auto comm = CreateUcxCommunicator(options, **boot);
  if (!comm.ok()) {
    channel.Send("error create: " + comm.status().ToString());
    return nullptr;
  }
  return std::move(*comm);
}

UcxOptions OptionsForTls(const std::string& tls) {
  UcxOptions options;
  options.tls = tls;
  options.setup_timeout = absl::Seconds(60);
  return options;
}

// Fails the test for "error" lines, children that did not exit 0, and
// hashes that differ across ranks.
void ExpectCleanRun(const std::vector<RankOutcome>& outcomes, bool compare_hashes) {
  std::map<std::string, std::string> first_hash;
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out) << "killed at the harness deadline (hang)";
    EXPECT_TRUE(o.exited && o.exit_code == 0)
        << "exit " << o.exit_code << " signal " << o.term_signal;
    for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
    if (!compare_hashes) continue;
    for (const std::string& h : o.FindAll("hash")) {
      std::vector<std::string> parts = absl::StrSplit(h, ' ');
      ASSERT_EQ(parts.size(), 2u) << h;
      if (parts[0].rfind("same:", 0) != 0) continue;
      auto [it, inserted] = first_hash.emplace(parts[0], parts[1]);
      if (!inserted) {
        EXPECT_EQ(parts[1], it->second) << parts[0] << " differs across ranks";
      }
    }
  }
}

// --- every collective against its reference ------------------------------------

void RunAllCollectives(int rank, int world, uint16_t port, RankChannel& channel,
                       const UcxOptions& options, uint64_t seed) {
  std::unique_ptr<Communicator> comm = JoinGroup(rank, world, port, channel, options);
  if (comm == nullptr) return;
  Checker check(channel);
  check.Expect(comm->rank() == rank && comm->world_size() == world && comm->backend_name() == "ucx",
               "identity");
  // Odd sizes on both sides of the one-shot threshold (32 KiB = 8192 f32 /
  // 16384 bf16), and counts smaller than the world (empty two-shot blocks
  // with one_shot_max_bytes = 0).
  const std::vector<size_t> sizes = {0, 1, 3, 7, 1001, 8191, 8193, 16385, 65537, 200003};
  int call = 0;
  for (size_t n : sizes) {
    const std::string tag = absl::StrCat("n", n);
    // AllReduce fp32.
    {
      ++call;
      std::vector<float> data = RandomF32(seed, rank, call, n);
      std::vector<float> exact(n, 0.0f);
      std::vector<double> ref(n, 0.0), mag(n, 0.0);
      for (int r = 0; r < world; ++r) {
        std::vector<float> x = RandomF32(seed, r, call, n);
        for (size_t i = 0; i < n; ++i) {
          exact[i] = r == 0 ? x[i] : exact[i] + x[i];
          ref[i] += x[i];
          mag[i] += std::fabs(x[i]);
        }
      }
      if (!check.Ok(comm->AllReduce(data.data(), n, CommDataType::kF32, Deadline(kCallTimeout)),
                    "allreduce f32 " + tag))
        return;
      check.Expect(std::memcmp(data.data(), exact.data(), n * 4) == 0,
                   "allreduce f32 " + tag + " is not the rank-order fp32 sum");
      for (size_t i = 0; i < n; ++i) {
        if (std::fabs(data[i] - ref[i]) > world * 0x1p-24 * mag[i] + 1e-30) {
          check.Expect(false, absl::StrCat("allreduce f32 ", tag, " [", i, "] = ", data[i],
                                           ", float64 ", ref[i]));
          break;
        }
      }
      check.Hash("same:allreduce_f32_" + tag, data.data(), n * 4);
    }
    // AllReduce bf16: fp32 accumulation in rank order, rounded once.
    {
      ++call;
      std::vector<uint16_t> data = RandomBF16(seed, rank, call, n);
      std::vector<float> acc(n, 0.0f);
      std::vector<double> ref(n, 0.0), mag(n, 0.0);
      for (int r = 0; r < world; ++r) {
        std::vector<uint16_t> x = RandomBF16(seed, r, call, n);
        for (size_t i = 0; i < n; ++i) {
          acc[i] = r == 0 ? Bf16Value(x[i]) : acc[i] + Bf16Value(x[i]);
          ref[i] += Bf16Value(x[i]);
          mag[i] += std::fabs(Bf16Value(x[i]));
        }
      }
      std::vector<uint16_t> exact(n);
      for (size_t i = 0; i < n; ++i) exact[i] = RoundToBf16(acc[i]);
      if (!check.Ok(comm->AllReduce(data.data(), n, CommDataType::kBF16, Deadline(kCallTimeout)),
                    "allreduce bf16 " + tag))
        return;
      check.Expect(std::memcmp(data.data(), exact.data(), n * 2) == 0,
                   "allreduce bf16 " + tag + " is not the rank-order fp32 sum rounded once");
      for (size_t i = 0; i < n; ++i) {
        double bound = world * 0x1p-24 * mag[i] + 0x1p-8 * std::fabs(ref[i]) + 1e-30;
        if (std::fabs(Bf16Value(data[i]) - ref[i]) > bound) {
          check.Expect(false, absl::StrCat("allreduce bf16 ", tag, " [", i,
                                           "] = ", Bf16Value(data[i]), ", float64 ", ref[i]));
          break;
        }
      }
      check.Hash("same:allreduce_bf16_" + tag, data.data(), n * 2);
    }
    // ReduceScatter fp32 and bf16: block `rank` of world·n elements.
    {
      ++call;
      std::vector<float> data = RandomF32(seed, rank, call, n * world);
      std::vector<float> exact(n, 0.0f), out(n + 1, -7.0f);
      for (int r = 0; r < world; ++r) {
        std::vector<float> x = RandomF32(seed, r, call, n * world);
        for (size_t i = 0; i < n; ++i)
          exact[i] = r == 0 ? x[rank * n + i] : exact[i] + x[rank * n + i];
      }
      if (!check.Ok(comm->ReduceScatter(data.data(), n, CommDataType::kF32, out.data(),
                                        Deadline(kCallTimeout)),
                    "reducescatter f32 " + tag))
        return;
      check.Expect(std::memcmp(out.data(), exact.data(), n * 4) == 0 && out[n] == -7.0f,
                   "reducescatter f32 " + tag + " is not the rank-order sum of this rank's block");
      ++call;
      std::vector<uint16_t> hdata = RandomBF16(seed, rank, call, n * world);
      std::vector<float> acc(n, 0.0f);
      for (int r = 0; r < world; ++r) {
        std::vector<uint16_t> x = RandomBF16(seed, r, call, n * world);
        for (size_t i = 0; i < n; ++i) {
          float v = Bf16Value(x[rank * n + i]);
          acc[i] = r == 0 ? v : acc[i] + v;
        }
      }
      std::vector<uint16_t> hout(n), hexact(n);
      for (size_t i = 0; i < n; ++i) hexact[i] = RoundToBf16(acc[i]);
      if (!check.Ok(comm->ReduceScatter(hdata.data(), n, CommDataType::kBF16, hout.data(),
                                        Deadline(kCallTimeout)),
                    "reducescatter bf16 " + tag))
        return;
      check.Expect(std::memcmp(hout.data(), hexact.data(), n * 2) == 0,
                   "reducescatter bf16 " + tag);
    }
    // AllGather (odd byte counts), in place (send aliases recv + rank·bytes).
    {
      ++call;
      const size_t bytes = n * 3 + 1;
      std::vector<uint8_t> out(bytes * world);
      std::vector<uint8_t> mine = RandomBytes(seed, rank, call, bytes);
      std::memcpy(out.data() + bytes * rank, mine.data(), bytes);
      if (!check.Ok(
              comm->AllGather(out.data() + bytes * rank, bytes, out.data(), Deadline(kCallTimeout)),
              "allgather " + tag))
        return;
      bool ok = true;
      for (int r = 0; r < world; ++r) {
        ok = ok && std::memcmp(out.data() + bytes * r, RandomBytes(seed, r, call, bytes).data(),
                               bytes) == 0;
      }
      check.Expect(ok, "allgather " + tag);
      check.Hash("same:allgather_" + tag, out.data(), out.size());
    }
    // AllGatherV: a different odd size per rank (one rank may send nothing).
    {
      ++call;
      std::vector<size_t> sizes_v(world);
      for (int r = 0; r < world; ++r)
        sizes_v[r] = (n * (r + 2) + 13 * r) % 70001 + (r == 1 ? 0 : 1);
      if (n == 0 && world > 1) sizes_v[1] = 0;
      size_t total = 0;
      for (size_t s : sizes_v) total += s;
      std::vector<uint8_t> mine = RandomBytes(seed, rank, call, sizes_v[rank]);
      std::vector<uint8_t> out(total);
      if (!check.Ok(comm->AllGatherV(mine.data(), sizes_v, out.data(), Deadline(kCallTimeout)),
                    "allgatherv " + tag))
        return;
      bool ok = true;
      size_t off = 0;
      for (int r = 0; r < world; ++r) {
        ok = ok && std::memcmp(out.data() + off, RandomBytes(seed, r, call, sizes_v[r]).data(),
                               sizes_v[r]) == 0;
        off += sizes_v[r];
      }
      check.Expect(ok, "allgatherv " + tag);
      check.Hash("same:allgatherv_" + tag, out.data(), out.size());
    }
    // AllToAllV: rank s sends M[s][d] bytes to d; every rank knows M.
    {
      ++call;
      auto m = [&](int s, int d) -> size_t {
        return (n * 7 + static_cast<size_t>(s) * 5 + d * 3) % (n + 3);
      };
      auto byte = [&](int s, int d, size_t i) {
        return static_cast<uint8_t>(s * 131 + d * 31 + i * 7 + call);
      };
      std::vector<size_t> send_bytes(world), recv_bytes(world);
      size_t send_total = 0, recv_total = 0;
      for (int p = 0; p < world; ++p) {
        send_bytes[p] = m(rank, p);
        recv_bytes[p] = m(p, rank);
        send_total += send_bytes[p];
        recv_total += recv_bytes[p];
      }
      std::vector<uint8_t> send(send_total), recv(recv_total);
      size_t off = 0;
      for (int p = 0; p < world; ++p) {
        for (size_t i = 0; i < send_bytes[p]; ++i) send[off + i] = byte(rank, p, i);
        off += send_bytes[p];
      }
      if (!check.Ok(comm->AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes,
                                    Deadline(kCallTimeout)),
                    "alltoallv " + tag))
        return;
      bool ok = true;
      off = 0;
      for (int p = 0; p < world; ++p) {
        for (size_t i = 0; i < recv_bytes[p]; ++i) ok = ok && recv[off + i] == byte(p, rank, i);
        off += recv_bytes[p];
      }
      check.Expect(ok, "alltoallv " + tag);
    }
    // Broadcast from a root that moves around.
    {
      ++call;
      const int root = static_cast<int>(n % world);
      const size_t bytes = n * 2 + 5;
      std::vector<uint8_t> data =
          rank == root ? RandomBytes(seed, root, call, bytes) : std::vector<uint8_t>(bytes, 0xab);
      if (!check.Ok(comm->Broadcast(data.data(), bytes, root, Deadline(kCallTimeout)),
                    "broadcast " + tag))
        return;
      check.Expect(data == RandomBytes(seed, root, call, bytes), "broadcast " + tag);
      check.Hash("same:broadcast_" + tag, data.data(), bytes);
    }
    if (!check.Ok(comm->Barrier(Deadline(kCallTimeout)), "barrier " + tag)) return;
  }
  check.Ok(comm->health(), "health after the run");
  // No exit barrier: ranks that finish first tear down (and say bye) while
  // the others may still be completing their last call.
}

class UcxCollectivesTest : public ::testing::TestWithParam<std::tuple<int, std::string, size_t>> {};

TEST_P(UcxCollectivesTest, EveryCollectiveMatchesTheReferenceBitForBitOnEveryRank) {
  const auto [world, tls, one_shot_max_bytes] = GetParam();
  const uint64_t seed = Seed();
  SCOPED_TRACE(absl::StrCat("seed ", seed, " world ", world, " tls '", tls, "' one_shot_max_bytes ",
                            one_shot_max_bytes));
  UcxOptions options = OptionsForTls(tls);
  options.one_shot_max_bytes = one_shot_max_bytes;
  auto outcomes = RunForkedRanks({.world = world, .timeout = absl::Seconds(240)},
                                 [&](int rank, uint16_t port, RankChannel& channel) {
                                   RunAllCollectives(rank, world, port, channel, options, seed);
                                 });
  ExpectCleanRun(outcomes, /*compare_hashes=*/true);
  // Every rank reported every hash.
  for (const RankOutcome& o : outcomes)
    EXPECT_EQ(o.FindAll("hash").size(), 50u) << "rank " << o.rank;
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, UcxCollectivesTest,
    ::testing::Values(std::make_tuple(1, std::string("tcp"), size_t{32 << 10}),
                      std::make_tuple(2, std::string("tcp"), size_t{32 << 10}),
                      std::make_tuple(3, std::string("tcp"), size_t{32 << 10}),
                      std::make_tuple(4, std::string("tcp"), size_t{32 << 10}),
                      std::make_tuple(3, std::string("tcp"), size_t{0}),  // two-shot for every size
                      std::make_tuple(2, std::string(""), size_t{32 << 10}),
                      std::make_tuple(4, std::string(""), size_t{32 << 10})),
    [](const ::testing::TestParamInfo<std::tuple<int, std::string, size_t>>& info) {
      const std::string& tls = std::get<1>(info.param);
      return absl::StrCat("world", std::get<0>(info.param), "_", tls.empty() ? "default" : tls,
                          std::get<2>(info.param) == 0 ? "_twoshot" : "");
    });

// --- failure: a rank killed mid-collective ----------------------------------------

// Parses "failed <code> <elapsed_ms> <message>".
struct Failure {
  absl::StatusCode code = absl::StatusCode::kOk;
  double elapsed_ms = -1;
  std::string message;
};
Failure ParseFailure(const std::string& text) {
  Failure f;
  std::vector<std::string> parts = absl::StrSplit(text, absl::MaxSplits(' ', 2));
  if (parts.size() == 3) {
    f.code = static_cast<absl::StatusCode>(std::atoi(parts[0].c_str()));
    f.elapsed_ms = std::atof(parts[1].c_str());
    f.message = parts[2];
  }
  return f;
}
void ReportFailure(RankChannel& channel, const absl::Status& status, absl::Duration took) {
  channel.Send(absl::StrCat("failed ", static_cast<int>(status.code()), " ",
                            absl::ToDoubleMilliseconds(took), " ", status.message()));
}

class UcxKillTest : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(UcxKillTest, KilledRankFailsEveryOtherRankWithinTheDeadline) {
  const auto [world, tls] = GetParam();
  const int victim = world - 1;
  const absl::Duration call_timeout = absl::Seconds(20);
  UcxOptions options = OptionsForTls(tls);
  ForkOptions fork{.world = world, .timeout = absl::Seconds(120)};
  fork.on_line = [&](int rank, pid_t pid, const std::string& line) {
    if (rank == victim && line == "entering") kill(pid, SIGKILL);
  };
  auto outcomes = RunForkedRanks(fork, [&](int rank, uint16_t port, RankChannel& channel) {
    std::unique_ptr<Communicator> comm = JoinGroup(rank, world, port, channel, options);
    if (comm == nullptr) return;
    // 1M floats: two-shot, several ms per call, so the kill lands mid-call.
    std::vector<float> buf(1 << 20, 0.5f);
    for (int i = 0; i < 1000000; ++i) {
      if (rank == victim && i == 3) channel.Send("entering");
      const absl::Time start = absl::Now();
      absl::Status st =
          comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(call_timeout));
      if (!st.ok()) {
        ReportFailure(channel, st, absl::Now() - start);
        return;
      }
      std::fill(buf.begin(), buf.end(), 0.5f);
    }
    channel.Send("error the loop ended without a failure");
  });
  ASSERT_EQ(outcomes[victim].term_signal, SIGKILL) << "the victim was not killed";
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const RankOutcome& o = outcomes[r];
    EXPECT_FALSE(o.timed_out);
    for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_TRUE(f.code == absl::StatusCode::kAborted || f.code == absl::StatusCode::kUnavailable ||
                f.code == absl::StatusCode::kDeadlineExceeded)
        << static_cast<int>(f.code) << " " << f.message;
    EXPECT_GE(f.elapsed_ms, 0);
    EXPECT_LT(f.elapsed_ms, absl::ToDoubleMilliseconds(call_timeout) + 1000) << f.message;
    std::printf("  rank %d failed after %.1f ms: %s\n", r, f.elapsed_ms, f.message.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, UcxKillTest,
                         ::testing::Values(std::make_tuple(2, std::string("tcp")),
                                           std::make_tuple(3, std::string("tcp")),
                                           std::make_tuple(4, std::string("tcp")),
                                           std::make_tuple(3, std::string(""))),
                         [](const ::testing::TestParamInfo<std::tuple<int, std::string>>& info) {
                           const std::string& tls = std::get<1>(info.param);
                           return absl::StrCat("world", std::get<0>(info.param), "_",
                                               tls.empty() ? "default" : tls);
                         });

// --- failure: Abort, deadlines, mismatches ----------------------------------------

TEST(UcxFailureTest, AbortReachesEveryRankWithItsReason) {
  constexpr int kWorld = 3;
  auto outcomes = RunForkedRanks(
      {.world = kWorld, .timeout = absl::Seconds(90)},
      [&](int rank, uint16_t port, RankChannel& channel) {
        std::unique_ptr<Communicator> comm =
            JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
        if (comm == nullptr) return;
        channel.WaitForAll("joined");
        std::vector<float> buf(1001, 1.0f);
        if (rank == 1) {
          comm->Abort(absl::InternalError("kernel error in step 7"));
          comm->Abort(absl::InternalError("a second reason loses"));
          channel.Send(absl::StrCat("health ", comm->health().ToString()));
          absl::Status st =
              comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
          ReportFailure(channel, st, absl::ZeroDuration());
        } else {
          const absl::Time start = absl::Now();
          absl::Status st =
              comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
          ReportFailure(channel, st, absl::Now() - start);
          // Stays broken.
          absl::Status again = comm->Barrier(Deadline(kCallTimeout));
          channel.Send(absl::StrCat("again ", static_cast<int>(again.code())));
        }
        channel.FinishAndWaitForAll();
      });
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out);
    for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_EQ(f.code, absl::StatusCode::kAborted) << f.message;
    EXPECT_THAT(f.message, HasSubstr("kernel error in step 7"));
    EXPECT_THAT(f.message, HasSubstr("communicator broken"));
    if (o.rank == 1) {
      EXPECT_THAT(o.Find("health"), HasSubstr("kernel error in step 7"));
      EXPECT_THAT(o.Find("health"), ::testing::Not(HasSubstr("second")));
    } else {
      EXPECT_THAT(f.message, HasSubstr("rank 1"));
      EXPECT_LT(f.elapsed_ms, 5000);
      EXPECT_EQ(o.Find("again"), std::to_string(static_cast<int>(absl::StatusCode::kAborted)));
    }
  }
}

TEST(UcxFailureTest, AbortFromAnotherThreadEndsABlockedCall) {
  constexpr int kWorld = 2;
  auto outcomes = RunForkedRanks(
      {.world = kWorld, .timeout = absl::Seconds(90)},
      [&](int rank, uint16_t port, RankChannel& channel) {
        std::unique_ptr<Communicator> comm =
            JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
        if (comm == nullptr) return;
        channel.WaitForAll("joined");
        if (rank == 0) {
          // Rank 1 never calls; a watchdog thread on rank 0 aborts the call.
          std::vector<float> buf(100, 1.0f);
          std::thread watchdog([&] { comm->Abort(absl::CancelledError("watchdog gave up")); });
          const absl::Time start = absl::Now();
          absl::Status st =
              comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
          ReportFailure(channel, st, absl::Now() - start);
          watchdog.join();
          channel.FinishAndWaitForAll();
        } else {
          // Learns of the abort at its next call, made once rank 0 is done.
          channel.FinishAndWaitForAll();
          absl::Status st = comm->Barrier(Deadline(kCallTimeout));
          ReportFailure(channel, st, absl::ZeroDuration());
        }
      });
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out);
    for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_EQ(f.code, absl::StatusCode::kAborted) << f.message;
    EXPECT_THAT(f.message, HasSubstr("watchdog gave up"));
    if (o.rank == 0) {
      EXPECT_LT(f.elapsed_ms, 5000);
    }
  }
}

TEST(UcxFailureTest, DeadlineNamesTheRankThatNeverCalled) {
  constexpr int kWorld = 3;
  auto outcomes =
      RunForkedRanks({.world = kWorld, .timeout = absl::Seconds(90)},
                     [&](int rank, uint16_t port, RankChannel& channel) {
                       std::unique_ptr<Communicator> comm =
                           JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
                       if (comm == nullptr) return;
                       channel.WaitForAll("joined");
                       std::vector<float> buf(50000, 1.0f);
                       if (rank == 2) {
                         // Skips the call. Once the others have failed, its next call must
                         // fail too: they told it why.
                         channel.WaitForAll("failed");
                         absl::Status st = comm->Barrier(Deadline(kCallTimeout));
                         ReportFailure(channel, st, absl::ZeroDuration());
                         channel.FinishAndWaitForAll();
                         return;
                       }
                       // Rank 0 gives up first; rank 1 would wait far longer but hears from rank 0.
                       const absl::Duration timeout = rank == 0 ? absl::Seconds(1) : kCallTimeout;
                       const absl::Time start = absl::Now();
                       absl::Status st = comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32,
                                                         Deadline(timeout));
                       ReportFailure(channel, st, absl::Now() - start);
                       channel.WaitForAll("failed");
                       channel.FinishAndWaitForAll();
                     });
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out);
    for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_THAT(f.message, HasSubstr("rank 2"));
    if (o.rank == 0) {
      EXPECT_EQ(f.code, absl::StatusCode::kDeadlineExceeded) << f.message;
      EXPECT_THAT(f.message, HasSubstr("not heard from rank 2"));
      EXPECT_GE(f.elapsed_ms, 1000);
      EXPECT_LT(f.elapsed_ms, 1000 + 500);  // the deadline plus the poll interval and slack
    } else {
      EXPECT_EQ(f.code, absl::StatusCode::kAborted) << f.message;
      EXPECT_THAT(f.message, HasSubstr("deadline exceeded"));
    }
    if (o.rank == 1) {
      EXPECT_LT(f.elapsed_ms, 10000);
    }
  }
}

TEST(UcxFailureTest, DifferentCollectivesOnTheSameCallFailInsteadOfHanging) {
  constexpr int kWorld = 2;
  auto outcomes = RunForkedRanks(
      {.world = kWorld, .timeout = absl::Seconds(90)},
      [&](int rank, uint16_t port, RankChannel& channel) {
        std::unique_ptr<Communicator> comm =
            JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
        if (comm == nullptr) return;
        channel.WaitForAll("joined");
        std::vector<float> buf(100, 1.0f);
        std::vector<float> out(200);
        const absl::Time start = absl::Now();
        absl::Status st =
            rank == 0 ? comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32,
                                        Deadline(kCallTimeout))
                      : comm->AllGather(buf.data(), 400, out.data(), Deadline(kCallTimeout));
        ReportFailure(channel, st, absl::Now() - start);
        channel.FinishAndWaitForAll();
      });
  bool someone_named_it = false;
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out);
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_NE(f.code, absl::StatusCode::kOk);
    EXPECT_LT(f.elapsed_ms, 5000) << f.message;
    someone_named_it =
        someone_named_it || f.message.find("collective mismatch") != std::string::npos;
  }
  EXPECT_TRUE(someone_named_it);
}

TEST(UcxFailureTest, DifferentSizesFailWithInvalidArgument) {
  constexpr int kWorld = 2;
  auto outcomes = RunForkedRanks({.world = kWorld, .timeout = absl::Seconds(90)},
                                 [&](int rank, uint16_t port, RankChannel& channel) {
                                   std::unique_ptr<Communicator> comm =
                                       JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
                                   if (comm == nullptr) return;
                                   channel.WaitForAll("joined");
                                   const size_t bytes = rank == 0 ? 100 : 101;
                                   std::vector<uint8_t> send(bytes, 1), out(2 * bytes);
                                   const absl::Time start = absl::Now();
                                   absl::Status st = comm->AllGather(send.data(), bytes, out.data(),
                                                                     Deadline(kCallTimeout));
                                   ReportFailure(channel, st, absl::Now() - start);
                                   channel.FinishAndWaitForAll();
                                 });
  bool invalid = false;
  for (const RankOutcome& o : outcomes) {
    SCOPED_TRACE(absl::StrCat("rank ", o.rank));
    EXPECT_FALSE(o.timed_out);
    Failure f = ParseFailure(o.Find("failed"));
    EXPECT_NE(f.code, absl::StatusCode::kOk);
    EXPECT_LT(f.elapsed_ms, 5000) << f.message;
    if (f.code == absl::StatusCode::kInvalidArgument) {
      invalid = true;
      EXPECT_THAT(f.message, HasSubstr("size mismatch"));
    }
  }
  EXPECT_TRUE(invalid);
}

TEST(UcxFailureTest, CallAfterAPeerLeftFailsPromptly) {
  constexpr int kWorld = 2;
  auto outcomes = RunForkedRanks({.world = kWorld, .timeout = absl::Seconds(90)},
                                 [&](int rank, uint16_t port, RankChannel& channel) {
                                   std::unique_ptr<Communicator> comm =
                                       JoinGroup(rank, kWorld, port, channel, OptionsForTls("tcp"));
                                   if (comm == nullptr) return;
                                   channel.WaitForAll("joined");
                                   Checker check(channel);
                                   if (!check.Ok(comm->Barrier(Deadline(kCallTimeout)), "barrier"))
                                     return;
                                   if (rank == 1) {
                                     comm.reset();  // says bye, then exits
                                     channel.Send("left");
                                     return;
                                   }
                                   std::vector<float> buf(100, 1.0f);
                                   const absl::Time start = absl::Now();
                                   absl::Status st =
                                       comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32,
                                                       Deadline(kCallTimeout));
                                   ReportFailure(channel, st, absl::Now() - start);
                                 });
  const RankOutcome& o = outcomes[0];
  EXPECT_FALSE(o.timed_out);
  for (const std::string& e : o.FindAll("error")) ADD_FAILURE() << e;
  Failure f = ParseFailure(o.Find("failed"));
  EXPECT_EQ(f.code, absl::StatusCode::kFailedPrecondition) << f.message;
  EXPECT_THAT(f.message, HasSubstr("rank 1 left the group"));
  EXPECT_LT(f.elapsed_ms, 5000);
}

TEST(UcxFailureTest, RejectsAnInvalidTransportSetting) {
  auto outcomes = RunForkedRanks(
      {.world = 1, .timeout = absl::Seconds(60)},
      [&](int rank, uint16_t port, RankChannel& channel) {
        auto boot = TcpBootstrap::Create({.rank = 0, .world_size = 1}, Deadline(absl::Seconds(5)));
        channel.Send("port 0");
        UcxOptions options;
        options.config = {{"RNDV_THRESH", "not-a-size"}};
        auto comm = CreateUcxCommunicator(options, **boot);
        channel.Send(absl::StrCat("status ", static_cast<int>(comm.status().code()), " ",
                                  comm.status().message()));
      });
  std::string status = outcomes[0].Find("status");
  EXPECT_EQ(status.substr(0, status.find(' ')),
            std::to_string(static_cast<int>(absl::StatusCode::kInvalidArgument)))
      << status;
  EXPECT_THAT(status, HasSubstr("RNDV_THRESH=not-a-size"));
}

}  // namespace
}  // namespace exl3serve::worker::comm
