// ucx_allreduce_bench — latency and bandwidth of the ucx Communicator's fp32
// AllReduce against message size, for 2, 3 and 4 forked ranks on this host
// (TcpBootstrap on 127.0.0.1, UCX transports as given; default tcp).
//
//   ucx_allreduce_bench [--tls tcp] [--worlds 2,3,4] [--max-bytes 67108864] [--min-time-ms 200]
//                       [--busy-poll-us U] [--one-shot-max-bytes B]   (UcxOptions fields;
//                       default: their defaults)
//
// Each size: 3 warm-up calls, a barrier, then calls until --min-time-ms has
// passed (at least 5); rank 0 reports the mean time per call. algbw =
// bytes / time; busbw = algbw · 2(N−1)/N (the bytes each rank moves in a
// two-shot all-reduce, comparable with nccl-tests). Ranks share the cores:
// on a 2-core machine 3 and 4 ranks are oversubscribed, so read those rows
// as "what loopback tcp does under contention", not as network figures.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/comm/ucx_forked_ranks.h"
#include "worker/comm/tcp_bootstrap.h"
#include "worker/comm/ucx_communicator.h"

namespace exl3serve::worker::comm {
namespace {

using testing::RankChannel;
using testing::RunForkedRanks;

struct Options {
  std::string tls = "tcp";
  std::vector<int> worlds = {2, 3, 4};
  size_t max_bytes = size_t{64} << 20;
  int64_t min_time_ms = 200;
  int64_t busy_poll_us = -1;        // -1: UcxOptions' default
  int64_t one_shot_max_bytes = -1;  // -1: UcxOptions' default
};

void RankMain(int rank, int world, uint16_t port, RankChannel& channel, const Options& o) {
  auto boot = TcpBootstrap::Create({.rank = rank, .world_size = world, .port = port},
                                   Deadline(absl::Seconds(60)));
  if (!boot.ok()) {
    channel.Send("error " + boot.status().ToString());
    return;
  }
  if (rank == 0) channel.Send(absl::StrCat("port ", (*boot)->port()));
  UcxOptions options;
  options.tls = o.tls;
  if (o.busy_poll_us >= 0) options.busy_poll = absl::Microseconds(o.busy_poll_us);
  if (o.one_shot_max_bytes >= 0)
    options.one_shot_max_bytes = static_cast<size_t>(o.one_shot_max_bytes);
  auto comm = CreateUcxCommunicator(options, **boot);
  if (!comm.ok()) {
    channel.Send("error " + comm.status().ToString());
    return;
  }
  Communicator& c = **comm;
  const absl::Duration timeout = absl::Seconds(120);
  std::vector<float> buf(o.max_bytes / 4, 1.0f / 1024);
  for (size_t bytes = 4; bytes <= o.max_bytes; bytes *= 4) {
    const size_t count = bytes / 4;
    for (int i = 0; i < 3; ++i) {
      if (absl::Status st = c.AllReduce(buf.data(), count, CommDataType::kF32, Deadline(timeout));
          !st.ok()) {
        channel.Send("error " + st.ToString());
        return;
      }
    }
    // Rank 0 times one call, derives how many fill min_time_ms and tells
    // everyone (the loop must be collective).
    int64_t iters = 0;
    const absl::Time probe_start = absl::Now();
    if (absl::Status st = c.AllReduce(buf.data(), count, CommDataType::kF32, Deadline(timeout));
        !st.ok()) {
      channel.Send("error " + st.ToString());
      return;
    }
    if (rank == 0) {
      const double one_ms = std::max(1e-3, absl::ToDoubleMilliseconds(absl::Now() - probe_start));
      iters = std::max<int64_t>(5, static_cast<int64_t>(o.min_time_ms / one_ms));
    }
    if (absl::Status st = c.Broadcast(&iters, sizeof(iters), 0, Deadline(timeout)); !st.ok()) {
      channel.Send("error " + st.ToString());
      return;
    }
    if (absl::Status st = c.Barrier(Deadline(timeout)); !st.ok()) {
      channel.Send("error " + st.ToString());
      return;
    }
    const absl::Time start = absl::Now();
    for (int64_t i = 0; i < iters; ++i) {
      if (absl::Status st = c.AllReduce(buf.data(), count, CommDataType::kF32, Deadline(timeout));
          !st.ok()) {
        channel.Send("error " + st.ToString());
        return;
      }
    }
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start) / static_cast<double>(iters);
    if (rank == 0) channel.Send(absl::StrCat("row ", bytes, " ", iters, " ", us));
  }
  channel.FinishAndWaitForAll();
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--tls") {
      o.tls = value == "default" ? "" : value;
    } else if (flag == "--worlds") {
      o.worlds.clear();
      for (absl::string_view w : absl::StrSplit(value, ',')) {
        int n = 0;
        if (absl::SimpleAtoi(w, &n) && n >= 1) o.worlds.push_back(n);
      }
    } else if (flag == "--max-bytes") {
      o.max_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--one-shot-max-bytes") {
      o.one_shot_max_bytes = std::strtoll(value.c_str(), nullptr, 10);
    } else if (flag == "--busy-poll-us") {
      o.busy_poll_us = std::strtoll(value.c_str(), nullptr, 10);
    } else if (flag == "--min-time-ms") {
      o.min_time_ms = std::strtoll(value.c_str(), nullptr, 10);
    } else {
      std::fprintf(
          stderr,
          "usage: ucx_allreduce_bench [--tls tcp|default|...] [--worlds 2,3,4] "
          "[--max-bytes N] [--min-time-ms T] [--busy-poll-us U] [--one-shot-max-bytes B]\n");
      std::exit(2);
    }
  }
  return o;
}

int Main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::printf("ucx AllReduce fp32, tls=%s, %ld ms per size, busy_poll %s, one_shot_max_bytes %s\n",
              o.tls.empty() ? "default" : o.tls.c_str(), static_cast<long>(o.min_time_ms),
              o.busy_poll_us < 0 ? "default" : absl::StrCat(o.busy_poll_us, " us").c_str(),
              o.one_shot_max_bytes < 0 ? "default" : absl::StrCat(o.one_shot_max_bytes).c_str());
  std::printf("%5s %12s %8s %12s %12s %12s\n", "ranks", "bytes", "iters", "time_us", "algbw_GB/s",
              "busbw_GB/s");
  int status = 0;
  for (int world : o.worlds) {
    auto outcomes = RunForkedRanks({.world = world, .timeout = absl::Minutes(10)},
                                   [&](int rank, uint16_t port, RankChannel& channel) {
                                     RankMain(rank, world, port, channel, o);
                                   });
    for (const auto& out : outcomes) {
      for (const std::string& e : out.FindAll("error")) {
        std::fprintf(stderr, "rank %d: %s\n", out.rank, e.c_str());
        status = 1;
      }
    }
    for (const std::string& row : outcomes[0].FindAll("row")) {
      std::vector<std::string> f = absl::StrSplit(row, ' ');
      const double bytes = std::atof(f[0].c_str()), us = std::atof(f[2].c_str());
      const double algbw = bytes / (us * 1e3);
      std::printf("%5d %12.0f %8s %12.1f %12.3f %12.3f\n", world, bytes, f[1].c_str(), us, algbw,
                  algbw * 2.0 * (world - 1) / world);
    }
  }
  return status;
}

}  // namespace
}  // namespace exl3serve::worker::comm

int main(int argc, char** argv) { return exl3serve::worker::comm::Main(argc, argv); }
