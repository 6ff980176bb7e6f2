// The hierarchical Communicator over real ucx sub-communicators: every rank
// is a thread of this process with its own UCX context, boxes are just
// groups of threads on 127.0.0.1 (TcpBootstrap on ephemeral ports). Checks
// every collective bit for bit against the documented order (inside each box
// in rank order, then across boxes in box order, bf16 rounded once), on
// uneven layouts, and that an Abort on a non-leader reaches every box.
#include "worker/comm/hierarchical_communicator.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"

namespace exl3serve::worker::comm {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(60);

uint64_t Seed() {
  return 0x41e7u + static_cast<uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
}

std::vector<float> RandomF32(uint64_t seed, int rank, int call, size_t count) {
  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(rank) << 32) ^
                      (static_cast<uint64_t>(call) << 48));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
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

// Rank-order sum inside each box, then box-order sum of the box sums.
std::vector<float> BoxThenBoxSum(const std::vector<std::vector<float>>& per_rank,
                                 const std::vector<int>& boxes) {
  const size_t n = per_rank[0].size();
  std::vector<float> total(n, 0.0f);
  int g = 0;
  for (size_t b = 0; b < boxes.size(); ++b) {
    std::vector<float> box_sum = per_rank[g];
    for (int l = 1; l < boxes[b]; ++l) {
      for (size_t i = 0; i < n; ++i) box_sum[i] += per_rank[g + l][i];
    }
    g += boxes[b];
    for (size_t i = 0; i < n; ++i) total[i] = b == 0 ? box_sum[i] : total[i] + box_sum[i];
  }
  return total;
}

// One group of threads: box b has boxes[b] ranks; rank 0 of every box and
// of the leader group listen on ephemeral ports chosen here.
class Cluster {
 public:
  explicit Cluster(std::vector<int> boxes) : boxes_(std::move(boxes)) {
    world_ = std::accumulate(boxes_.begin(), boxes_.end(), 0);
    for (size_t b = 0; b < boxes_.size(); ++b) {
      auto boot =
          TcpBootstrap::Create({.rank = 0, .world_size = boxes_[b], .port = 0}, Deadline(kTimeout));
      EXPECT_TRUE(boot.ok()) << boot.status();
      box_roots_.push_back(std::move(*boot));
    }
    auto leaders = TcpBootstrap::Create(
        {.rank = 0, .world_size = static_cast<int>(boxes_.size()), .port = 0}, Deadline(kTimeout));
    EXPECT_TRUE(leaders.ok()) << leaders.status();
    leader_root_ = std::move(*leaders);
    for (auto& r : box_roots_) box_ports_.push_back(r->port());
    leader_port_ = leader_root_->port();
  }

  int world() const { return world_; }
  const std::vector<int>& boxes() const { return boxes_; }

  // Runs body(global rank, communicator) on one thread per rank; returns
  // each rank's error text ("" = fine).
  std::vector<std::string> Run(const std::function<std::string(int, Communicator&)>& body) {
    std::vector<std::string> errors(world_);
    std::vector<std::thread> threads;
    int g = 0;
    for (size_t b = 0; b < boxes_.size(); ++b) {
      for (int l = 0; l < boxes_[b]; ++l, ++g) {
        std::unique_ptr<TcpBootstrap> intra_boot = l == 0 ? std::move(box_roots_[b]) : nullptr;
        std::unique_ptr<TcpBootstrap> inter_boot =
            l == 0 && b == 0 ? std::move(leader_root_) : nullptr;
        threads.emplace_back([&, g, b, l, intra_boot = std::move(intra_boot),
                              inter_boot = std::move(inter_boot)]() mutable {
          errors[g] = RunRank(g, static_cast<int>(b), l, std::move(intra_boot),
                              std::move(inter_boot), body);
        });
      }
    }
    for (auto& t : threads) t.join();
    return errors;
  }

 private:
  std::string RunRank(int g, int b, int l, std::unique_ptr<TcpBootstrap> intra_boot,
                      std::unique_ptr<TcpBootstrap> inter_boot,
                      const std::function<std::string(int, Communicator&)>& body) {
    UcxOptions options;
    options.tls = "tcp";
    if (intra_boot == nullptr) {
      auto boot = TcpBootstrap::Create({.rank = l, .world_size = boxes_[b], .port = box_ports_[b]},
                                       Deadline(kTimeout));
      if (!boot.ok()) return boot.status().ToString();
      intra_boot = std::move(*boot);
    }
    auto intra = CreateUcxCommunicator(options, *intra_boot);
    if (!intra.ok()) return "intra: " + intra.status().ToString();
    std::unique_ptr<Communicator> inter;
    if (l == 0) {
      if (inter_boot == nullptr) {
        auto boot = TcpBootstrap::Create(
            {.rank = b, .world_size = static_cast<int>(boxes_.size()), .port = leader_port_},
            Deadline(kTimeout));
        if (!boot.ok()) return boot.status().ToString();
        inter_boot = std::move(*boot);
      }
      auto made = CreateUcxCommunicator(options, *inter_boot);
      if (!made.ok()) return "inter: " + made.status().ToString();
      inter = std::move(*made);
    }
    auto comm =
        CreateHierarchicalCommunicator(std::move(*intra), std::move(inter), Deadline(kTimeout));
    if (!comm.ok()) return "hierarchical: " + comm.status().ToString();
    if ((*comm)->rank() != g || (*comm)->world_size() != world_ ||
        (*comm)->backend_name() != "hierarchical") {
      return absl::StrCat("identity: rank ", (*comm)->rank(), " world ", (*comm)->world_size());
    }
    return body(g, **comm);
  }

 private:
  std::vector<int> boxes_;
  int world_ = 0;
  std::vector<std::unique_ptr<TcpBootstrap>> box_roots_;  // moved to the leaders' threads by Run
  std::unique_ptr<TcpBootstrap> leader_root_;
  std::vector<uint16_t> box_ports_;
  uint16_t leader_port_ = 0;
};

std::string RunEveryCollective(int g, Communicator& comm, const std::vector<int>& boxes,
                               uint64_t seed) {
  const int world = comm.world_size();
  int call = 0;
  for (size_t n : {size_t{1}, size_t{5}, size_t{999}, size_t{40001}}) {
    const std::string tag = absl::StrCat(" n=", n);
    {  // AllReduce fp32 and bf16.
      ++call;
      std::vector<std::vector<float>> all;
      for (int r = 0; r < world; ++r) all.push_back(RandomF32(seed, r, call, n));
      std::vector<float> data = all[g];
      absl::Status st = comm.AllReduce(data.data(), n, CommDataType::kF32, Deadline(kTimeout));
      if (!st.ok()) return "allreduce f32" + tag + ": " + st.ToString();
      std::vector<float> expect = BoxThenBoxSum(all, boxes);
      if (std::memcmp(data.data(), expect.data(), n * 4) != 0)
        return "allreduce f32" + tag + ": wrong bits";
      for (auto& v : all) {
        for (float& x : v) x = FromBf16(ToBf16(x));
      }
      std::vector<uint16_t> h(n);
      for (size_t i = 0; i < n; ++i) h[i] = ToBf16(all[g][i]);
      st = comm.AllReduce(h.data(), n, CommDataType::kBF16, Deadline(kTimeout));
      if (!st.ok()) return "allreduce bf16" + tag + ": " + st.ToString();
      std::vector<float> fexpect = BoxThenBoxSum(all, boxes);
      for (size_t i = 0; i < n; ++i) {
        if (h[i] != ToBf16(fexpect[i]))
          return "allreduce bf16" + tag + ": not rounded once from the fp32 sum";
        if (std::fabs(FromBf16(h[i]) - fexpect[i]) > 0x1p-8 * std::fabs(fexpect[i]) + 1e-30)
          return "bf16 range";
      }
    }
    {  // ReduceScatter.
      ++call;
      std::vector<std::vector<float>> all;
      for (int r = 0; r < world; ++r) all.push_back(RandomF32(seed, r, call, n * world));
      std::vector<float> out(n);
      absl::Status st =
          comm.ReduceScatter(all[g].data(), n, CommDataType::kF32, out.data(), Deadline(kTimeout));
      if (!st.ok()) return "reducescatter" + tag + ": " + st.ToString();
      std::vector<float> expect = BoxThenBoxSum(all, boxes);
      if (std::memcmp(out.data(), expect.data() + n * g, n * 4) != 0)
        return "reducescatter" + tag + ": wrong bits";
    }
    {  // AllGather in place, AllGatherV.
      ++call;
      const size_t bytes = n + 3;
      std::vector<uint8_t> out(bytes * world);
      for (size_t i = 0; i < bytes; ++i)
        out[bytes * g + i] = static_cast<uint8_t>(g * 7 + i + call);
      absl::Status st =
          comm.AllGather(out.data() + bytes * g, bytes, out.data(), Deadline(kTimeout));
      if (!st.ok()) return "allgather" + tag + ": " + st.ToString();
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < bytes; ++i) {
          if (out[bytes * r + i] != static_cast<uint8_t>(r * 7 + i + call))
            return "allgather" + tag + ": wrong";
        }
      }
      std::vector<size_t> sizes(world);
      size_t total = 0;
      for (int r = 0; r < world; ++r) total += sizes[r] = (n * (r + 1)) % 1013 + (r % 2);
      std::vector<uint8_t> mine(sizes[g]);
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<uint8_t>(g * 13 + i);
      std::vector<uint8_t> v(total);
      st = comm.AllGatherV(mine.data(), sizes, v.data(), Deadline(kTimeout));
      if (!st.ok()) return "allgatherv" + tag + ": " + st.ToString();
      size_t off = 0;
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < sizes[r]; ++i) {
          if (v[off + i] != static_cast<uint8_t>(r * 13 + i)) return "allgatherv" + tag + ": wrong";
        }
        off += sizes[r];
      }
    }
    {  // AllToAllV.
      ++call;
      auto m = [&](int s, int d) -> size_t { return (n + s * 3 + d * 5) % (n + 2); };
      auto byte = [&](int s, int d, size_t i) { return static_cast<uint8_t>(s * 31 + d * 7 + i); };
      std::vector<size_t> sb(world), rb(world);
      size_t st_total = 0, rt_total = 0;
      for (int p = 0; p < world; ++p) {
        st_total += sb[p] = m(g, p);
        rt_total += rb[p] = m(p, g);
      }
      std::vector<uint8_t> send(st_total), recv(rt_total);
      size_t off = 0;
      for (int p = 0; p < world; ++p) {
        for (size_t i = 0; i < sb[p]; ++i) send[off + i] = byte(g, p, i);
        off += sb[p];
      }
      absl::Status st = comm.AllToAllV(send.data(), sb, recv.data(), rb, Deadline(kTimeout));
      if (!st.ok()) return "alltoallv" + tag + ": " + st.ToString();
      off = 0;
      for (int p = 0; p < world; ++p) {
        for (size_t i = 0; i < rb[p]; ++i) {
          if (recv[off + i] != byte(p, g, i)) return "alltoallv" + tag + ": wrong";
        }
        off += rb[p];
      }
    }
    // Broadcast from every root.
    for (int root = 0; root < world; ++root) {
      std::vector<uint8_t> data(n + 1, 0);
      if (g == root) {
        for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(root + i * 3);
      }
      absl::Status st = comm.Broadcast(data.data(), data.size(), root, Deadline(kTimeout));
      if (!st.ok()) return absl::StrCat("broadcast root ", root, tag, ": ", st.ToString());
      for (size_t i = 0; i < data.size(); ++i) {
        if (data[i] != static_cast<uint8_t>(root + i * 3))
          return absl::StrCat("broadcast root ", root, ": wrong");
      }
    }
    absl::Status st = comm.Barrier(Deadline(kTimeout));
    if (!st.ok()) return "barrier: " + st.ToString();
  }
  absl::Status health = comm.health();
  return health.ok() ? "" : "health: " + health.ToString();
}

class HierarchicalLayoutTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(HierarchicalLayoutTest, EveryCollectiveSumsInsideBoxesThenAcrossBoxes) {
  const std::vector<int> boxes = GetParam();
  const uint64_t seed = Seed();
  SCOPED_TRACE(absl::StrCat("seed ", seed, " boxes ", absl::StrJoin(boxes, ",")));
  Cluster cluster(boxes);
  std::vector<std::string> errors = cluster.Run(
      [&](int g, Communicator& comm) { return RunEveryCollective(g, comm, boxes, seed); });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchicalLayoutTest,
                         ::testing::Values(std::vector<int>{2, 2}, std::vector<int>{3, 2},
                                           std::vector<int>{1, 3}, std::vector<int>{3},
                                           std::vector<int>{1, 1, 1}),
                         [](const ::testing::TestParamInfo<std::vector<int>>& info) {
                           return "boxes_" + absl::StrJoin(info.param, "_");
                         });

TEST(HierarchicalCommunicatorTest, AbortOnANonLeaderReachesEveryBox) {
  Cluster cluster({2, 2});
  std::vector<std::string> errors = cluster.Run([&](int g, Communicator& comm) -> std::string {
    std::vector<float> data(1000, 1.0f);
    if (g == 3) {
      comm.Abort(absl::InternalError("kernel error in step 9"));
      return comm.AllReduce(data.data(), data.size(), CommDataType::kF32, Deadline(kTimeout))
          .ToString();
    }
    const absl::Time start = absl::Now();
    absl::Status st =
        comm.AllReduce(data.data(), data.size(), CommDataType::kF32, Deadline(kTimeout));
    if (absl::Now() - start > absl::Seconds(10)) return "took too long: " + st.ToString();
    return st.ToString();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("ABORTED")) << "rank " << r;
    EXPECT_THAT(errors[r], HasSubstr("kernel error in step 9")) << "rank " << r;
  }
}

TEST(HierarchicalCommunicatorTest, RejectsALeaderWithoutAnInterBoxCommunicator) {
  // A world-1 ucx communicator as the box (made in a thread: it starts UCX).
  absl::Status status;
  std::thread t([&] {
    auto boot = TcpBootstrap::Create({.rank = 0, .world_size = 1}, Deadline(kTimeout));
    UcxOptions options;
    options.tls = "tcp";
    auto intra = CreateUcxCommunicator(options, **boot);
    if (!intra.ok()) {
      status = intra.status();
      return;
    }
    status =
        CreateHierarchicalCommunicator(std::move(*intra), nullptr, Deadline(kTimeout)).status();
  });
  t.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("no inter-box communicator"));
}

}  // namespace
}  // namespace exl3serve::worker::comm
