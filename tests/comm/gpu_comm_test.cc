// The GPU backends (worker/comm/nccl_communicator.h, cuda_p2p_communicator.h,
// host_staged_communicator.h) and CreateGpuCommunicator (comm_factory.h).
//
// Without a GPU (CI) this checks what needs none: option validation, the
// NCCL environment mapping, the cuda_p2p fallback decision on fake
// peer-access matrices, the all-reduce launch plan, the shared set-up
// exchange (a failing rank fails every rank with its reason), and that
// creating either backend on a machine without a device fails promptly with
// FailedPrecondition on every rank instead of crashing or hanging.
//
// With GPUs, ranks are forked processes (one per rank; CUDA IPC and NCCL
// need that), joined by a socketpair Bootstrap, and compared against a CPU
// reference on random odd sizes: bit for bit with the rank-order fp32 sum for
// cuda_p2p (communicator.h's determinism), within a float64 bound and equal
// across ranks for NCCL (which reduces in ring/tree order). The parent never
// touches CUDA before forking (a CUDA context does not survive fork): the
// device count comes from a forked probe. Children report one line through a
// pipe ("OK <hash>", "SKIP <why>", "FAIL <why>") and never use gtest macros.
// Nothing sleeps: ranks synchronise through the collectives, the bootstrap
// and process exit.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/comm_factory.h"
#include "worker/comm/communicator.h"
#include "worker/comm/host_staged_communicator.h"

#if defined(EXL3_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_device.h"
#include "worker/comm/cuda_p2p_communicator.h"
#include "worker/comm/cuda_p2p_kernels.h"
#include "worker/comm/gpu_rank_info.h"
#endif
#if defined(EXL3_HAVE_NCCL)
#include "worker/comm/nccl_communicator.h"
#endif

namespace exl3serve::worker::comm {
namespace {

#if !defined(EXL3_HAVE_CUDA)

TEST(GpuCommTest, SkipsWhenBuiltWithoutCuda) {
  GTEST_SKIP() << "exl3serve was built without CUDA (nvcc not found): nccl and cuda_p2p are absent";
}

#else  // EXL3_HAVE_CUDA

using ::testing::HasSubstr;

// ------------------------------------------------- a Bootstrap over sockets

// Rank r talks to rank p over fds[p] (one end of a socketpair); works between
// threads and between forked processes alike.
class SocketBootstrap final : public Bootstrap {
 public:
  SocketBootstrap(int rank, std::vector<int> fds) : rank_(rank), fds_(std::move(fds)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(fds_.size()); }

  absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob,
                                                     absl::Time deadline) override {
    std::string message(4, '\0');
    const uint32_t n = static_cast<uint32_t>(blob.size());
    std::memcpy(message.data(), &n, 4);
    message += blob;
    for (int p = 0; p < world_size(); ++p) {  // blobs are small: never blocks
      if (p == rank_) continue;
      size_t sent = 0;
      while (sent < message.size()) {
        const ssize_t w = send(fds_[p], message.data() + sent, message.size() - sent, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return absl::UnavailableError(absl::StrCat("bootstrap: send to rank ", p));
        sent += static_cast<size_t>(w);
      }
    }
    std::vector<std::string> blobs(world_size());
    blobs[rank_] = blob;
    for (int p = 0; p < world_size(); ++p) {
      if (p == rank_) continue;
      std::string header;
      absl::Status s = ReadExact(p, 4, deadline, &header);
      if (!s.ok()) return s;
      uint32_t size = 0;
      std::memcpy(&size, header.data(), 4);
      s = ReadExact(p, size, deadline, &blobs[p]);
      if (!s.ok()) return s;
    }
    return blobs;
  }

 private:
  absl::Status ReadExact(int p, size_t n, absl::Time deadline, std::string* out) {
    out->resize(n);
    size_t got = 0;
    while (got < n) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) {
        return absl::DeadlineExceededError(absl::StrCat("bootstrap: rank ", p, " not heard from"));
      }
      pollfd fd{fds_[p], POLLIN, 0};
      const int ready = poll(&fd, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));
      if (ready < 0 && errno != EINTR) return absl::InternalError("bootstrap: poll");
      if (ready <= 0) continue;
      const ssize_t r = read(fds_[p], out->data() + got, n - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return absl::UnavailableError(absl::StrCat("bootstrap: rank ", p, " closed"));
      got += static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }

  const int rank_;
  const std::vector<int> fds_;
};

// fds[r][p]: rank r's end of the socketpair with rank p (-1 on the diagonal).
std::vector<std::vector<int>> MakeMesh(int world) {
  std::vector<std::vector<int>> fds(world, std::vector<int>(world, -1));
  for (int r = 0; r < world; ++r) {
    for (int p = r + 1; p < world; ++p) {
      int pair[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return {};
      fds[r][p] = pair[0];
      fds[p][r] = pair[1];
    }
  }
  return fds;
}

void CloseMesh(const std::vector<std::vector<int>>& fds, int keep_rank) {
  for (int r = 0; r < static_cast<int>(fds.size()); ++r) {
    if (r == keep_rank) continue;
    for (int fd : fds[r]) {
      if (fd >= 0) close(fd);
    }
  }
}

// Runs body(rank, bootstrap) on `world` threads of this process.
std::vector<absl::Status> RunThreads(int world,
                                     const std::function<absl::Status(int, Bootstrap&)>& body) {
  const std::vector<std::vector<int>> fds = MakeMesh(world);
  std::vector<absl::Status> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      SocketBootstrap bootstrap(r, fds[r]);
      results[r] = body(r, bootstrap);
    });
  }
  for (std::thread& t : threads) t.join();
  CloseMesh(fds, -1);
  return results;
}

// ------------------------------------------------- forked ranks

// A hang fails the test instead of the CI job.
constexpr absl::Duration kGroupTimeout = absl::Seconds(240);

// Forks `world` children running body(rank, bootstrap) -> report line; waits
// for all (killing them after kGroupTimeout). Index = rank.
std::vector<std::string> RunForkedRanks(int world,
                                        const std::function<std::string(int, Bootstrap&)>& body) {
  const std::vector<std::vector<int>> fds = MakeMesh(world);
  std::vector<std::string> reports(world);
  std::vector<int> pipes(world, -1);
  std::vector<pid_t> pids(world, -1);
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      reports[r] = "FAIL pipe";
      continue;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      CloseMesh(fds, r);  // so a dead peer's socket reads as EOF
      std::string report;
      {
        SocketBootstrap bootstrap(r, fds[r]);
        report = body(r, bootstrap);
      }
      size_t sent = 0;
      while (sent < report.size()) {
        const ssize_t w = write(p[1], report.data() + sent, report.size() - sent);
        if (w <= 0 && errno != EINTR) break;
        if (w > 0) sent += static_cast<size_t>(w);
      }
      _exit(0);
    }
    close(p[1]);
    if (pid < 0) {
      close(p[0]);
      reports[r] = "FAIL fork";
      continue;
    }
    pids[r] = pid;
    pipes[r] = p[0];
  }
  CloseMesh(fds, -1);

  const absl::Time deadline = absl::Now() + kGroupTimeout;
  while (true) {
    std::vector<pollfd> polled;
    std::vector<int> ranks;
    for (int r = 0; r < world; ++r) {
      if (pipes[r] >= 0) {
        polled.push_back(pollfd{pipes[r], POLLIN, 0});
        ranks.push_back(r);
      }
    }
    if (polled.empty()) break;
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) {
      for (int r : ranks) {
        reports[r] = absl::StrCat("FAIL rank ", r, " did not finish within ",
                                  absl::FormatDuration(kGroupTimeout), "; ", reports[r]);
        kill(pids[r], SIGKILL);
        close(pipes[r]);
        pipes[r] = -1;
      }
      break;
    }
    if (poll(polled.data(), polled.size(), static_cast<int>(std::min<int64_t>(ms, 1000))) < 0 &&
        errno != EINTR) {
      break;
    }
    for (size_t k = 0; k < polled.size(); ++k) {
      if (polled[k].revents == 0) continue;
      const int r = ranks[k];
      char buffer[4096];
      const ssize_t n = read(pipes[r], buffer, sizeof(buffer));
      if (n > 0) {
        reports[r].append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(pipes[r]);
        pipes[r] = -1;
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    if (pids[r] <= 0) continue;
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (reports[r].empty()) {
      reports[r] = WIFSIGNALED(status)
                       ? absl::StrCat("FAIL rank ", r, " died of signal ", WTERMSIG(status))
                       : absl::StrCat("FAIL rank ", r, " reported nothing");
    }
  }
  return reports;
}

bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Expects every report to be OK with the same hash; skips the test (and
// returns) when any rank skipped.
void ExpectAllOkAndEqual(const std::vector<std::string>& reports) {
  for (size_t r = 0; r < reports.size(); ++r) {
    if (StartsWith(reports[r], "SKIP")) GTEST_SKIP() << "rank " << r << ": " << reports[r];
  }
  for (size_t r = 0; r < reports.size(); ++r) {
    EXPECT_TRUE(StartsWith(reports[r], "OK")) << "rank " << r << ": " << reports[r];
    EXPECT_EQ(reports[r], reports[0]) << "rank " << r << " got different results than rank 0";
  }
}

// ------------------------------------------------- tests needing no GPU

using internal::GpuRankInfo;

// The parent process must not create a CUDA context before forking ranks,
// so the device count comes from a forked child.
int DeviceCount() {
  static const int count = [] {
    int p[2];
    if (pipe(p) != 0) return 0;
    const pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      const int n = kernels::cuda::CudaDeviceCount();
      const ssize_t ignored = write(p[1], &n, sizeof(n));
      (void)ignored;
      _exit(0);
    }
    close(p[1]);
    int n = 0;
    if (pid < 0 || read(p[0], &n, sizeof(n)) != static_cast<ssize_t>(sizeof(n))) n = 0;
    close(p[0]);
    if (pid > 0) waitpid(pid, nullptr, 0);
    return n;
  }();
  return count;
}

TEST(GpuRankInfoTest, EncodesAndDecodesEveryField) {
  GpuRankInfo info;
  info.status = absl::FailedPreconditionError("no CUDA device: test");
  info.host_id = "box/1234";
  info.pci_bus_id = "0000:41:00.0";
  info.device = 3;
  info.payload = std::string("\0\1\2binary", 9);
  absl::StatusOr<GpuRankInfo> back = internal::DecodeGpuRankInfo(internal::EncodeGpuRankInfo(info));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->status, info.status);
  EXPECT_EQ(back->host_id, info.host_id);
  EXPECT_EQ(back->pci_bus_id, info.pci_bus_id);
  EXPECT_EQ(back->device, 3);
  EXPECT_EQ(back->payload, info.payload);
}

TEST(GpuRankInfoTest, RejectsMalformedBlobs) {
  const std::string good = internal::EncodeGpuRankInfo(GpuRankInfo{});
  EXPECT_EQ(internal::DecodeGpuRankInfo("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::DecodeGpuRankInfo("EXL3GPU0........").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::DecodeGpuRankInfo(good.substr(0, good.size() - 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::DecodeGpuRankInfo(good + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GpuRankInfoTest, ExchangeFailsEveryRankWithTheFailingRanksReason) {
  const std::vector<absl::Status> results = RunThreads(3, [](int rank, Bootstrap& bootstrap) {
    GpuRankInfo mine;
    mine.host_id = "box";
    if (rank == 1) mine.status = absl::FailedPreconditionError("no CUDA device: test");
    return internal::ExchangeGpuRankInfo(bootstrap, mine, Deadline(absl::Seconds(30)), "nccl",
                                         "exchanging the unique id")
        .status();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kFailedPrecondition) << "rank " << r;
    EXPECT_THAT(std::string(results[r].message()), HasSubstr("no CUDA device: test"));
  }
  EXPECT_THAT(std::string(results[0].message()), HasSubstr("nccl: rank 1 failed set-up"));
}

TEST(GpuRankInfoTest, ExchangeReturnsEveryRanksInfoWhenAllSucceed) {
  std::vector<std::vector<GpuRankInfo>> seen(2);
  const std::vector<absl::Status> results = RunThreads(2, [&](int rank, Bootstrap& bootstrap) {
    GpuRankInfo mine;
    mine.pci_bus_id = absl::StrCat("bus", rank);
    absl::StatusOr<std::vector<GpuRankInfo>> all = internal::ExchangeGpuRankInfo(
        bootstrap, mine, Deadline(absl::Seconds(30)), "cuda_p2p", "test");
    if (all.ok()) seen[rank] = *all;
    return all.status();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r];
    ASSERT_EQ(seen[r].size(), 2u);
    EXPECT_EQ(seen[r][0].pci_bus_id, "bus0");
    EXPECT_EQ(seen[r][1].pci_bus_id, "bus1");
  }
}

// --- cuda_p2p: the fallback decision, options and the launch plan

std::vector<CudaP2pPeer> FourGpusOneHost() {
  return {{"box", "0000:01:00.0"},
          {"box", "0000:02:00.0"},
          {"box", "0000:41:00.0"},
          {"box", "0000:42:00.0"}};
}

std::vector<std::vector<bool>> FullAccess(int n) {
  return std::vector<std::vector<bool>>(n, std::vector<bool>(n, true));
}

TEST(CudaP2pTopologyTest, AcceptsFullyConnectedGpusOnOneHost) {
  EXPECT_TRUE(CheckCudaP2pTopology(FourGpusOneHost(), FullAccess(4), false).ok());
}

TEST(CudaP2pTopologyTest, TellsTheCallerToUseNcclWhenAPairLacksPeerAccess) {
  std::vector<std::vector<bool>> access = FullAccess(4);
  access[1][2] = false;  // e.g. two PCIe root complexes without P2P
  access[2][1] = false;
  const absl::Status s = CheckCudaP2pTopology(FourGpusOneHost(), access, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()), HasSubstr("0000:02:00.0 (rank 1)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("0000:41:00.0 (rank 2)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("use the nccl backend"));
}

TEST(CudaP2pTopologyTest, RefusesOneWayPeerAccess) {
  std::vector<std::vector<bool>> access = FullAccess(4);
  access[3][0] = false;
  EXPECT_EQ(CheckCudaP2pTopology(FourGpusOneHost(), access, false).code(),
            absl::StatusCode::kUnimplemented);
}

TEST(CudaP2pTopologyTest, RefusesRanksOnDifferentHosts) {
  std::vector<CudaP2pPeer> peers = FourGpusOneHost();
  peers[3].host_id = "other-box";
  const absl::Status s = CheckCudaP2pTopology(peers, FullAccess(4), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()), HasSubstr("different hosts"));
}

TEST(CudaP2pTopologyTest, SharedGpuNeedsAllowSharedDeviceAndIgnoresItsAccessEntry) {
  std::vector<CudaP2pPeer> peers = {{"box", "0000:01:00.0"}, {"box", "0000:01:00.0"}};
  std::vector<std::vector<bool>> access = {{true, false}, {false, true}};
  const absl::Status refused = CheckCudaP2pTopology(peers, access, false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("cuda_p2p.allow_shared_device"));
  EXPECT_TRUE(CheckCudaP2pTopology(peers, access, true).ok());
}

TEST(CudaP2pTopologyTest, RejectsAMatrixOfTheWrongShapeAndTooManyRanks) {
  EXPECT_EQ(CheckCudaP2pTopology(FourGpusOneHost(), FullAccess(3), false).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<CudaP2pPeer> nine(9, CudaP2pPeer{"box", "x"});
  EXPECT_EQ(CheckCudaP2pTopology(nine, FullAccess(9), true).code(),
            absl::StatusCode::kUnimplemented);
}

TEST(CudaP2pOptionsTest, DefaultsAreValidForOneToEightRanks) {
  for (int world = 1; world <= 8; ++world) {
    EXPECT_TRUE(ValidateCudaP2pOptions(CudaP2pOptions{}, world).ok()) << world;
  }
  EXPECT_EQ(ValidateCudaP2pOptions(CudaP2pOptions{}, 9).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ValidateCudaP2pOptions(CudaP2pOptions{}, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaP2pOptionsTest, NamesTheFieldOfABadValue) {
  CudaP2pOptions small;
  small.buffer_bytes = 1000;
  const absl::Status s = ValidateCudaP2pOptions(small, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda_p2p.buffer_bytes must be >= 2048"));
  CudaP2pOptions device;
  device.device = -2;
  EXPECT_THAT(std::string(ValidateCudaP2pOptions(device, 2).message()),
              HasSubstr("cuda_p2p.device"));
  CudaP2pOptions timeout;
  timeout.graph_timeout = absl::ZeroDuration();
  EXPECT_THAT(std::string(ValidateCudaP2pOptions(timeout, 2).message()),
              HasSubstr("cuda_p2p.graph_timeout"));
}

TEST(CudaP2pPlanTest, CoversEveryElementOnceWithinTheSubSlotCapacity) {
  using internal::kP2pBlocks;
  for (size_t elem : {size_t{2}, size_t{4}}) {
    for (int world : {1, 2, 3, 5, 8}) {
      for (size_t sub_bytes : {size_t{16}, size_t{48}, size_t{4096}}) {
        for (size_t count :
             {size_t{1}, size_t{7}, size_t{255}, size_t{1000}, size_t{65537}, size_t{300001}}) {
          SCOPED_TRACE(testing::Message() << "elem " << elem << " world " << world << " sub "
                                          << sub_bytes << " count " << count);
          const size_t threshold = 1024;
          const std::vector<CudaP2pLaunch> plan =
              PlanCudaP2pAllReduce(count, elem, world, sub_bytes, threshold);
          size_t next = 0;
          for (const CudaP2pLaunch& launch : plan) {
            ASSERT_EQ(launch.offset, next);
            ASSERT_GT(launch.count, 0u);
            EXPECT_EQ(launch.two_shot, world > 2 && count * elem > threshold);
            EXPECT_LE(launch.block_elems * elem, sub_bytes);           // fits a sub-slot
            EXPECT_EQ(launch.block_elems * elem % 16, 0u);             // 16-byte aligned ranges
            EXPECT_GE(launch.block_elems * kP2pBlocks, launch.piece);  // blocks cover a piece
            if (launch.two_shot) {
              EXPECT_GE(launch.piece * world, launch.count);  // pieces cover the launch
              EXPECT_EQ(launch.piece * elem % 16, 0u);
            } else {
              EXPECT_EQ(launch.piece, launch.count);
            }
            next += launch.count;
          }
          EXPECT_EQ(next, count);
        }
      }
    }
  }
}

TEST(CudaP2pCreateTest, FailsOnEveryRankWithoutADevice) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; this checks the no-device path";
  const absl::Time start = absl::Now();
  for (int world : {1, 2}) {
    const std::vector<absl::Status> results = RunThreads(world, [](int, Bootstrap& bootstrap) {
      return CreateCudaP2pCommunicator(CudaP2pOptions{}, bootstrap).status();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].code(), absl::StatusCode::kFailedPrecondition) << results[r];
      EXPECT_THAT(std::string(results[r].message()), HasSubstr("no CUDA device"));
    }
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "must fail promptly, not at init_timeout";
}

TEST(HostStagedOptionsTest, NamesTheFieldOfABadValue) {
  EXPECT_TRUE(ValidateHostStagedOptions(HostStagedOptions{}).ok());
  HostStagedOptions o;
  o.device = -2;
  EXPECT_THAT(std::string(ValidateHostStagedOptions(o).message()), HasSubstr("host_staged.device"));
  o = HostStagedOptions{};
  o.init_timeout = absl::ZeroDuration();
  EXPECT_THAT(std::string(ValidateHostStagedOptions(o).message()),
              HasSubstr("host_staged.init_timeout"));
  for (const char* name : {"no-slash", "/a/b"}) {
    o = HostStagedOptions{};
    o.shm_name = name;
    EXPECT_EQ(ValidateHostStagedOptions(o).code(), absl::StatusCode::kInvalidArgument) << name;
  }
}

TEST(HostStagedCreateTest, FailsOnEveryRankWithoutADevice) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; this checks the no-device path";
  const absl::Time start = absl::Now();
  for (int world : {1, 3}) {
    const std::vector<absl::Status> results = RunThreads(world, [](int, Bootstrap& bootstrap) {
      return CreateHostStagedCommunicator(HostStagedOptions{}, bootstrap).status();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].code(), absl::StatusCode::kFailedPrecondition) << results[r];
      EXPECT_THAT(std::string(results[r].message()), HasSubstr("no CUDA device"));
    }
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "must fail promptly, not at init_timeout";
}

// A loopback port free at the time of the call (for a TcpBootstrap address).
int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

TEST(GpuCommFactoryTest, AutoFailsOnEveryRankWithoutADevice) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; this checks the no-device path";
  CommSpec spec;
  spec.backend = "auto";
  spec.bootstrap_address = absl::StrCat("127.0.0.1:", FreeLoopbackPort());
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[r] = CreateGpuCommunicator(spec, r, 2, absl::Now() + absl::Seconds(20)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kFailedPrecondition) << results[r];
    EXPECT_THAT(std::string(results[r].message()), HasSubstr("no CUDA device"));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "must fail promptly, not at the deadline";
}

#if defined(EXL3_HAVE_NCCL)

TEST(NcclOptionsTest, DefaultsAreValidAndSetNoVariables) {
  EXPECT_TRUE(ValidateNcclOptions(NcclOptions{}).ok());
  EXPECT_TRUE(NcclEnvironment(NcclOptions{}).empty());
}

TEST(NcclOptionsTest, MapsEveryNetworkFieldToItsVariable) {
  NcclOptions o;
  o.socket_ifname = "^docker,lo";
  o.socket_family = "AF_INET";
  o.ib_hca = "mlx5_0:1";
  o.ib_gid_index = 3;
  o.net_plugin = "none";
  o.enable_p2p_transport = false;
  o.enable_shm_transport = false;
  o.algorithm = "Ring";
  o.debug_level = "WARN";
  o.extra_env = {{"NCCL_CROSS_NIC", "0"}};
  ASSERT_TRUE(ValidateNcclOptions(o).ok());
  using Env = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(NcclEnvironment(o), (Env{{"NCCL_SOCKET_IFNAME", "^docker,lo"},
                                     {"NCCL_SOCKET_FAMILY", "AF_INET"},
                                     {"NCCL_IB_HCA", "mlx5_0:1"},
                                     {"NCCL_IB_GID_INDEX", "3"},
                                     {"NCCL_NET_PLUGIN", "none"},
                                     {"NCCL_P2P_DISABLE", "1"},
                                     {"NCCL_SHM_DISABLE", "1"},
                                     {"NCCL_ALGO", "Ring"},
                                     {"NCCL_DEBUG", "WARN"},
                                     {"NCCL_CROSS_NIC", "0"}}));
  NcclOptions no_ib;
  no_ib.enable_ib = false;
  EXPECT_EQ(NcclEnvironment(no_ib), (Env{{"NCCL_IB_DISABLE", "1"}}));
}

TEST(NcclOptionsTest, RejectsOutOfRangeValuesNamingTheField) {
  NcclOptions gid;
  gid.ib_gid_index = 256;
  EXPECT_EQ(ValidateNcclOptions(gid).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ValidateNcclOptions(gid).message()),
              HasSubstr("nccl.ib_gid_index must be in [0, 255]"));
  NcclOptions tc;
  tc.ib_traffic_class = -2;
  EXPECT_THAT(std::string(ValidateNcclOptions(tc).message()), HasSubstr("nccl.ib_traffic_class"));
  NcclOptions family;
  family.socket_family = "AF_UNIX";
  EXPECT_THAT(std::string(ValidateNcclOptions(family).message()), HasSubstr("nccl.socket_family"));
  NcclOptions algo;
  algo.algorithm = "ring";
  EXPECT_THAT(std::string(ValidateNcclOptions(algo).message()), HasSubstr("nccl.algorithm"));
  NcclOptions timeout;
  timeout.init_timeout = absl::ZeroDuration();
  EXPECT_THAT(std::string(ValidateNcclOptions(timeout).message()), HasSubstr("nccl.init_timeout"));
  NcclOptions device;
  device.device = -5;
  EXPECT_THAT(std::string(ValidateNcclOptions(device).message()), HasSubstr("nccl.device"));
}

TEST(NcclOptionsTest, RejectsContradictionsAndShadowedVariables) {
  NcclOptions hca;
  hca.enable_ib = false;
  hca.ib_hca = "mlx5_0";
  EXPECT_THAT(std::string(ValidateNcclOptions(hca).message()),
              HasSubstr("nccl.ib_hca is 'mlx5_0' but nccl.enable_ib is false"));
  NcclOptions shadow;
  shadow.extra_env = {{"NCCL_SOCKET_IFNAME", "eth0"}};
  EXPECT_THAT(std::string(ValidateNcclOptions(shadow).message()),
              HasSubstr("use nccl.socket_ifname instead"));
  NcclOptions name;
  name.extra_env = {{"UCX_TLS", "tcp"}};
  EXPECT_THAT(std::string(ValidateNcclOptions(name).message()), HasSubstr("NCCL_[A-Z0-9_]+"));
  NcclOptions twice;
  twice.extra_env = {{"NCCL_CROSS_NIC", "0"}, {"NCCL_CROSS_NIC", "1"}};
  EXPECT_THAT(std::string(ValidateNcclOptions(twice).message()), HasSubstr("more than once"));
  NcclOptions newline;
  newline.socket_ifname = "eth0\nNCCL_DEBUG=INFO";
  EXPECT_EQ(ValidateNcclOptions(newline).code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclCreateTest, FailsOnEveryRankWithoutADevice) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; this checks the no-device path";
  const absl::Time start = absl::Now();
  for (int world : {1, 2}) {
    const std::vector<absl::Status> results = RunThreads(world, [](int, Bootstrap& bootstrap) {
      return CreateNcclCommunicator(NcclOptions{}, bootstrap).status();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].code(), absl::StatusCode::kFailedPrecondition) << results[r];
      EXPECT_THAT(std::string(results[r].message()), HasSubstr("no CUDA device"));
    }
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "must fail promptly, not at init_timeout";
}

TEST(NcclCreateTest, BadOptionsOnOneRankFailEveryRankPromptly) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; this checks the no-device path";
  const std::vector<absl::Status> results = RunThreads(2, [](int rank, Bootstrap& bootstrap) {
    NcclOptions options;
    if (rank == 0) options.ib_gid_index = 999;
    return CreateNcclCommunicator(options, bootstrap).status();
  });
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument) << results[0];
  EXPECT_THAT(std::string(results[0].message()), HasSubstr("nccl.ib_gid_index"));
  EXPECT_FALSE(results[1].ok());  // its own missing device, or rank 0's options
}

#endif  // EXL3_HAVE_NCCL

// ------------------------------------------------- tests needing GPUs

constexpr absl::Duration kCallTimeout = absl::Seconds(60);
// How late a call that must fail may return after its deadline (poll
// interval, device timeout granularity, a loaded machine).
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(750);

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint16_t FloatToBf16(float f) {  // round to nearest even, as __float2bfloat16_rn
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rank r's input element i of test `tag`, in [-1, 1) (bf16-representable for kBF16).
float Input(uint32_t seed, int tag, int rank, size_t i, CommDataType type) {
  const uint64_t h = SplitMix(SplitMix(seed * 1315423911ull + tag) ^ (uint64_t(rank) << 40) ^ i);
  const float v = static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;
  return type == CommDataType::kBF16 ? Bf16ToFloat(FloatToBf16(v)) : v;
}

uint8_t Byte(uint32_t seed, int from, int to, size_t k) {
  return static_cast<uint8_t>(SplitMix(seed + from * 7919ull + to * 104729ull + k * 31ull));
}

// Collects the first failure and a hash of every result (equal across ranks).
struct Checker {
  std::string failure;
  uint64_t hash = 1469598103934665603ull;
  bool Check(bool ok, const std::string& what) {
    if (!ok && failure.empty()) failure = what;
    return ok;
  }
  void Hash(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) {
      hash ^= p[i];
      hash *= 1099511628211ull;
    }
  }
  std::string Report() const {
    return failure.empty() ? absl::StrCat("OK ", hash) : absl::StrCat("FAIL ", failure);
  }
};

// A device buffer (freed with the object).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }
  bool Upload(const void* host) {
    return cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  bool Download(void* host) const {
    return cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost) == cudaSuccess;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

std::vector<char> EncodeElements(const std::vector<float>& values, CommDataType type) {
  std::vector<char> out(values.size() * CommDataTypeSize(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == CommDataType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = FloatToBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

float DecodeElement(const std::vector<char>& bytes, size_t i, CommDataType type) {
  if (type == CommDataType::kF32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return Bf16ToFloat(h);
}

// Checks a reduction result element: `exact` demands the rank-order fp32
// sum rounded once (communicator.h); otherwise a float64 bound (NCCL).
bool ReducedElementOk(float got, int world, const std::function<float(int)>& input,
                      CommDataType type, bool exact, std::string* why) {
  float ordered = input(0);
  double sum64 = input(0), magnitude = std::fabs(input(0));
  for (int r = 1; r < world; ++r) {
    ordered += input(r);
    sum64 += input(r);
    magnitude += std::fabs(input(r));
  }
  if (type == CommDataType::kBF16) ordered = Bf16ToFloat(FloatToBf16(ordered));
  if (exact) {
    uint32_t a, b;
    std::memcpy(&a, &got, 4);
    std::memcpy(&b, &ordered, 4);
    if (a == b) return true;
    *why = absl::StrCat("got ", got, ", rank-order sum ", ordered);
    return false;
  }
  // NCCL: fp32 rounds at each of <= world steps; bf16 too, to 8 bits.
  const double ulp = type == CommDataType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
  const double bound = (world + 1) * ulp * magnitude;
  if (std::fabs(got - sum64) <= bound) return true;
  *why = absl::StrCat("got ", got, ", float64 sum ", sum64, ", bound ", bound);
  return false;
}

// Every operation of the interface on odd sizes, checked against the CPU.
std::string RunCollectiveSuite(Communicator& comm, uint32_t seed, bool exact) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  Checker c;
  int tag = 0;

  // AllReduce: sizes around every threshold of the small cuda_p2p config.
  for (CommDataType type : {CommDataType::kF32, CommDataType::kBF16}) {
    for (size_t count :
         {size_t{1}, size_t{7}, size_t{1023}, size_t{4099}, size_t{65537}, size_t{300001}}) {
      ++tag;
      const std::string what = absl::StrCat("all_reduce ", CommDataTypeName(type), " x", count);
      std::vector<float> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = Input(seed, tag, rank, i, type);
      std::vector<char> bytes = EncodeElements(mine, type);
      DeviceBuffer buffer(bytes.size());
      if (!c.Check(buffer.get() != nullptr && buffer.Upload(bytes.data()), what + ": upload"))
        break;
      const absl::Status s = comm.AllReduce(buffer.get(), count, type, Deadline(kCallTimeout));
      if (!c.Check(s.ok(), absl::StrCat(what, ": ", s.ToString()))) return c.Report();
      if (!c.Check(buffer.Download(bytes.data()), what + ": download")) break;
      for (size_t i = 0; i < count; ++i) {
        std::string why;
        if (!ReducedElementOk(
                DecodeElement(bytes, i, type), world,
                [&](int r) { return Input(seed, tag, r, i, type); }, type, exact, &why)) {
          c.Check(false, absl::StrCat(what, " [", i, "]: ", why));
          break;
        }
      }
      c.Hash(bytes.data(), bytes.size());
    }
  }

  // ReduceScatter.
  for (size_t count : {size_t{1031}, size_t{20011}}) {
    ++tag;
    const CommDataType type = CommDataType::kF32;
    const std::string what = absl::StrCat("reduce_scatter x", count);
    std::vector<float> mine(count * world);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = Input(seed, tag, rank, i, type);
    DeviceBuffer data(mine.size() * 4), recv(count * 4);
    if (!c.Check(data.get() && recv.get() && data.Upload(mine.data()), what + ": upload")) break;
    const absl::Status s =
        comm.ReduceScatter(data.get(), count, type, recv.get(), Deadline(kCallTimeout));
    if (!c.Check(s.ok(), absl::StrCat(what, ": ", s.ToString()))) return c.Report();
    std::vector<char> got(count * 4);
    if (!c.Check(recv.Download(got.data()), what + ": download")) break;
    for (size_t i = 0; i < count; ++i) {
      std::string why;
      const size_t at = rank * count + i;
      if (!ReducedElementOk(
              DecodeElement(got, i, type), world,
              [&](int r) { return Input(seed, tag, r, at, type); }, type, exact, &why)) {
        c.Check(false, absl::StrCat(what, " [", i, "]: ", why));
        break;
      }
    }
  }

  // Byte operations: every byte must arrive exactly.
  auto expect_bytes = [&](const std::string& what, const std::vector<uint8_t>& got,
                          const std::vector<uint8_t>& want) {
    if (got != want) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      c.Check(false, absl::StrCat(what, ": first difference at byte ", i));
    }
    c.Hash(got.data(), got.size());
  };

  for (size_t bytes : {size_t{333}, size_t{70001}}) {
    for (bool in_place : {false, true}) {
      ++tag;
      const std::string what = absl::StrCat("all_gather ", bytes, in_place ? " in place" : "");
      std::vector<uint8_t> want(bytes * world);
      for (int r = 0; r < world; ++r) {
        for (size_t k = 0; k < bytes; ++k) want[r * bytes + k] = Byte(seed + tag, r, -1, k);
      }
      DeviceBuffer recv(bytes * world), send(bytes);
      std::vector<uint8_t> mine(want.begin() + rank * bytes, want.begin() + (rank + 1) * bytes);
      const char* send_ptr = in_place ? recv.get() + rank * bytes : send.get();
      if (in_place) {
        cudaMemcpy(recv.get() + rank * bytes, mine.data(), bytes, cudaMemcpyHostToDevice);
      } else {
        send.Upload(mine.data());
      }
      const absl::Status s = comm.AllGather(send_ptr, bytes, recv.get(), Deadline(kCallTimeout));
      if (!c.Check(s.ok(), absl::StrCat(what, ": ", s.ToString()))) return c.Report();
      std::vector<uint8_t> got(want.size());
      recv.Download(got.data());
      expect_bytes(what, got, want);
    }
  }

  {
    ++tag;
    std::vector<size_t> sizes(world);
    for (int r = 0; r < world; ++r) sizes[r] = r == 1 ? 0 : 517 * (r + 1) + 3 * r + 1;
    size_t total = 0;
    for (size_t n : sizes) total += n;
    std::vector<uint8_t> want;
    for (int r = 0; r < world; ++r) {
      for (size_t k = 0; k < sizes[r]; ++k) want.push_back(Byte(seed + tag, r, -1, k));
    }
    size_t offset = 0;
    for (int r = 0; r < rank; ++r) offset += sizes[r];
    DeviceBuffer send(sizes[rank]), recv(total);
    send.Upload(want.data() + offset);
    const absl::Status s = comm.AllGatherV(send.get(), sizes, recv.get(), Deadline(kCallTimeout));
    if (!c.Check(s.ok(), absl::StrCat("all_gather_v: ", s.ToString()))) return c.Report();
    std::vector<uint8_t> got(total);
    recv.Download(got.data());
    expect_bytes("all_gather_v", got, want);
  }

  for (size_t bytes : {size_t{12345}, size_t{100003}}) {
    ++tag;
    const int root = world - 1;
    std::vector<uint8_t> want(bytes), mine(bytes, 0xEE);
    for (size_t k = 0; k < bytes; ++k) want[k] = Byte(seed + tag, root, -1, k);
    DeviceBuffer data(bytes);
    data.Upload(rank == root ? want.data() : mine.data());
    const absl::Status s = comm.Broadcast(data.get(), bytes, root, Deadline(kCallTimeout));
    if (!c.Check(s.ok(), absl::StrCat("broadcast: ", s.ToString()))) return c.Report();
    std::vector<uint8_t> got(bytes);
    data.Download(got.data());
    expect_bytes(absl::StrCat("broadcast ", bytes), got, want);
  }

  {
    ++tag;
    // S(r, p): bytes rank r sends to rank p (odd, some zero, one large).
    auto size = [&](int r, int p) -> size_t {
      if (r == 0 && p == world - 1) return 90001;
      return ((r * 7 + p * 13 + seed) % 5) * 211 + (r == p ? 9 : 0);
    };
    std::vector<size_t> send_bytes(world), recv_bytes(world);
    std::vector<uint8_t> send, want;
    for (int p = 0; p < world; ++p) {
      send_bytes[p] = size(rank, p);
      recv_bytes[p] = size(p, rank);
      for (size_t k = 0; k < send_bytes[p]; ++k) send.push_back(Byte(seed + tag, rank, p, k));
      for (size_t k = 0; k < recv_bytes[p]; ++k) want.push_back(Byte(seed + tag, p, rank, k));
    }
    DeviceBuffer send_buffer(send.size()), recv_buffer(want.size());
    send_buffer.Upload(send.data());
    const absl::Status s = comm.AllToAllV(send_buffer.get(), send_bytes, recv_buffer.get(),
                                          recv_bytes, Deadline(kCallTimeout));
    if (!c.Check(s.ok(), absl::StrCat("all_to_all_v: ", s.ToString()))) return c.Report();
    std::vector<uint8_t> got(want.size());
    recv_buffer.Download(got.data());
    // Ranks receive different bytes: check, but do not hash.
    c.Check(got == want, "all_to_all_v: received bytes differ");
  }

  const absl::Status barrier = comm.Barrier(Deadline(kCallTimeout));
  c.Check(barrier.ok(), absl::StrCat("barrier: ", barrier.ToString()));
  c.Check(comm.health().ok(), absl::StrCat("health: ", comm.health().ToString()));
  return c.Report();
}

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20250611u : static_cast<uint32_t>(seed);
}

using Factory = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(int rank, Bootstrap&)>;

// Each rank: create, run the suite, report. Unimplemented from a cuda_p2p
// creation (no peer access between these GPUs) skips.
std::vector<std::string> RunSuiteOnRanks(int world, const Factory& factory, bool exact) {
  const uint32_t seed = TestSeed();
  return RunForkedRanks(world, [&](int rank, Bootstrap& bootstrap) -> std::string {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = factory(rank, bootstrap);
    if (absl::IsUnimplemented(comm.status()))
      return absl::StrCat("SKIP ", comm.status().ToString());
    if (!comm.ok()) return absl::StrCat("FAIL create: ", comm.status().ToString());
    return RunCollectiveSuite(**comm, seed, exact);
  });
}

// One rank never calls the operation: the others fail by their deadline
// (DeadlineExceeded, or Aborted when a peer's timeout aborted the group
// first), then every later call fails with Aborted; the absent rank's next
// call fails too.
std::vector<std::string> RunMissingRankScenario(int world, const Factory& factory,
                                                absl::Duration deadline_after) {
  return RunForkedRanks(world, [&](int rank, Bootstrap& bootstrap) -> std::string {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = factory(rank, bootstrap);
    if (absl::IsUnimplemented(comm.status()))
      return absl::StrCat("SKIP ", comm.status().ToString());
    if (!comm.ok()) return absl::StrCat("FAIL create: ", comm.status().ToString());
    DeviceBuffer buffer(4096 * sizeof(float));
    cudaMemset(buffer.get(), 0, 4096 * sizeof(float));
    Checker c;
    if (rank != 0) {
      const absl::Time start = absl::Now();
      const absl::Status first =
          (*comm)->AllReduce(buffer.get(), 4096, CommDataType::kF32, start + deadline_after);
      const absl::Duration took = absl::Now() - start;
      c.Check(
          absl::IsDeadlineExceeded(first) || absl::IsAborted(first) || absl::IsUnavailable(first),
          absl::StrCat("first call: ", first.ToString()));
      c.Check(took <= deadline_after + kDeadlineSlack,
              absl::StrCat("first call returned after ", absl::FormatDuration(took)));
      const absl::Status second =
          (*comm)->AllReduce(buffer.get(), 4096, CommDataType::kF32, Deadline(kCallTimeout));
      c.Check(absl::IsAborted(second), absl::StrCat("second call: ", second.ToString()));
      c.Check(!(*comm)->health().ok(), "health() is OK after a failure");
    }
    // Everyone is past the failing call before rank 0 tries again.
    c.Check(bootstrap.AllGather("sync", Deadline(kCallTimeout)).ok(), "bootstrap sync");
    if (rank == 0) {
      const absl::Status late =
          (*comm)->AllReduce(buffer.get(), 4096, CommDataType::kF32, Deadline(deadline_after));
      c.Check(!late.ok(), "the absent rank's next call succeeded");
    }
    return c.failure.empty() ? "OK" : absl::StrCat("FAIL ", c.failure);
  });
}

void ExpectAllOk(const std::vector<std::string>& reports) {
  for (size_t r = 0; r < reports.size(); ++r) {
    if (StartsWith(reports[r], "SKIP")) GTEST_SKIP() << "rank " << r << ": " << reports[r];
  }
  for (size_t r = 0; r < reports.size(); ++r) {
    EXPECT_TRUE(StartsWith(reports[r], "OK")) << "rank " << r << ": " << reports[r];
  }
}

// cuda_p2p with small buffers (many launches, two-shot from 4 KiB) and with
// the defaults.
CudaP2pOptions SmallP2pOptions(int device, bool shared) {
  CudaP2pOptions o;
  o.device = device;
  o.allow_shared_device = shared;
  o.buffer_bytes = 64 << 10;
  o.one_shot_max_bytes = 4 << 10;
  return o;
}

TEST(CudaP2pGpuTest, RanksOnDistinctGpusMatchTheRankOrderSumBitForBit) {
  const int devices = DeviceCount();
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << devices;
  const int world = std::min(devices, 4);
  for (bool small : {true, false}) {
    SCOPED_TRACE(small ? "small buffers" : "default buffers");
    ExpectAllOkAndEqual(RunSuiteOnRanks(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          CudaP2pOptions o = small ? SmallP2pOptions(rank, false) : CudaP2pOptions{};
          o.device = rank;
          return CreateCudaP2pCommunicator(o, bootstrap);
        },
        /*exact=*/true));
  }
}

TEST(CudaP2pGpuTest, ThreeRanksSharingOneGpuMatchTheRankOrderSumBitForBit) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  // Three ranks so that two-shot runs; time-sliced on one GPU.
  ExpectAllOkAndEqual(RunSuiteOnRanks(
      3,
      [](int, Bootstrap& bootstrap) {
        return CreateCudaP2pCommunicator(SmallP2pOptions(0, true), bootstrap);
      },
      /*exact=*/true));
}

TEST(CudaP2pGpuTest, SharedGpuIsRefusedUnlessAllowed) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  const std::vector<std::string> reports = RunForkedRanks(2, [](int, Bootstrap& bootstrap) {
    CudaP2pOptions o;
    o.device = 0;
    const absl::Status s = CreateCudaP2pCommunicator(o, bootstrap).status();
    return absl::IsFailedPrecondition(s) ? std::string("OK") : absl::StrCat("FAIL ", s.ToString());
  });
  ExpectAllOk(reports);
}

TEST(CudaP2pGpuTest, AMissingRankFailsThePeersByTheDeadlineThenAborted) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  const int devices = DeviceCount();
  const int world = devices >= 3 ? 3 : (devices == 2 ? 2 : 3);
  ExpectAllOk(RunMissingRankScenario(
      world,
      [&](int rank, Bootstrap& bootstrap) {
        return CreateCudaP2pCommunicator(
            SmallP2pOptions(devices >= world ? rank : 0, devices < world), bootstrap);
      },
      absl::Seconds(2)));
}

TEST(CudaP2pGpuTest, AbortFailsThePeersCallPromptlyNamingTheRank) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  const int devices = DeviceCount();
  ExpectAllOk(RunForkedRanks(2, [&](int rank, Bootstrap& bootstrap) -> std::string {
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        CreateCudaP2pCommunicator(SmallP2pOptions(devices >= 2 ? rank : 0, devices < 2), bootstrap);
    if (absl::IsUnimplemented(comm.status()))
      return absl::StrCat("SKIP ", comm.status().ToString());
    if (!comm.ok()) return absl::StrCat("FAIL create: ", comm.status().ToString());
    Checker c;
    if (rank == 0) (*comm)->Abort(absl::InternalError("test: a kernel failed"));
    c.Check(bootstrap.AllGather("aborted", Deadline(kCallTimeout)).ok(), "bootstrap sync");
    if (rank == 1) {
      DeviceBuffer buffer(64 * sizeof(float));
      const absl::Time start = absl::Now();
      const absl::Status s =
          (*comm)->AllReduce(buffer.get(), 64, CommDataType::kF32, Deadline(kCallTimeout));
      c.Check(absl::IsAborted(s), absl::StrCat("peer's call: ", s.ToString()));
      c.Check(std::string(s.message()).find("rank 0") != std::string::npos,
              absl::StrCat("message does not name rank 0: ", s.message()));
      c.Check(absl::Now() - start < absl::Seconds(5), "peer's call was not prompt");
    } else {
      c.Check(absl::IsInternal((*comm)->health()), "health() lost the abort reason");
    }
    return c.failure.empty() ? "OK" : absl::StrCat("FAIL ", c.failure);
  }));
}

// host_staged: ranks on distinct GPUs where there are enough, else sharing
// GPU 0 (host staging does not care); bit-exact rank-order sums (shm's).
TEST(HostStagedGpuTest, EveryOperationMatchesTheRankOrderSumBitForBit) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  for (int world : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    ExpectAllOkAndEqual(RunSuiteOnRanks(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          HostStagedOptions o;
          o.device = rank % devices;
          o.initial_staging_bytes = 4096;  // grows during the suite
          return CreateHostStagedCommunicator(o, bootstrap);
        },
        /*exact=*/true));
  }
}

TEST(HostStagedGpuTest, AMissingRankFailsThePeersByTheDeadlineThenAborted) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  ExpectAllOk(RunMissingRankScenario(
      3,
      [&](int rank, Bootstrap& bootstrap) {
        HostStagedOptions o;
        o.device = rank % devices;
        return CreateHostStagedCommunicator(o, bootstrap);
      },
      absl::Seconds(2)));
}

TEST(HostStagedGpuTest, AbortFailsThePeersCallPromptly) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  ExpectAllOk(RunForkedRanks(2, [&](int rank, Bootstrap& bootstrap) -> std::string {
    HostStagedOptions o;
    o.device = rank % devices;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateHostStagedCommunicator(o, bootstrap);
    if (!comm.ok()) return absl::StrCat("FAIL create: ", comm.status().ToString());
    Checker c;
    if (rank == 0) (*comm)->Abort(absl::InternalError("test: a kernel failed"));
    c.Check(bootstrap.AllGather("aborted", Deadline(kCallTimeout)).ok(), "bootstrap sync");
    if (rank == 1) {
      DeviceBuffer buffer(64 * sizeof(float));
      const absl::Time start = absl::Now();
      const absl::Status s =
          (*comm)->AllReduce(buffer.get(), 64, CommDataType::kF32, Deadline(kCallTimeout));
      c.Check(absl::IsAborted(s), absl::StrCat("peer's call: ", s.ToString()));
      c.Check(absl::Now() - start < absl::Seconds(5), "peer's call was not prompt");
    } else {
      c.Check(absl::IsInternal((*comm)->health()), "health() lost the abort reason");
    }
    return c.failure.empty() ? "OK" : absl::StrCat("FAIL ", c.failure);
  }));
}

// The factory end to end: the probe runs, the choice is the same on every
// rank, and the chosen backend passes the suite. Two ranks on GPU 0 (one-GPU
// machines) share it, so auto picks host_staged; with >= 2 GPUs it picks
// cuda_p2p where they have peer access, else host_staged.
TEST(GpuCommFactoryGpuTest, AutoChoosesAlikeOnEveryRankAndTheChoiceWorks) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  const std::string address = absl::StrCat("127.0.0.1:", FreeLoopbackPort());
  const uint32_t seed = TestSeed();
  const std::vector<std::string> reports =
      RunForkedRanks(2, [&](int rank, Bootstrap&) -> std::string {
        CommSpec spec;
        spec.backend = "auto";
        spec.bootstrap_address = address;
        spec.device = rank % devices;
        std::string chosen;
        absl::StatusOr<std::unique_ptr<Communicator>> comm =
            CreateGpuCommunicator(spec, rank, 2, Deadline(absl::Seconds(60)), &chosen);
        if (!comm.ok()) return absl::StrCat("FAIL create: ", comm.status().ToString());
        const std::string backend = chosen.substr(0, chosen.find(':'));
        if (backend != (*comm)->backend_name()) {
          return absl::StrCat("FAIL chose ", chosen, " but created ", (*comm)->backend_name());
        }
        if (devices == 1 && backend != "host_staged") {
          return absl::StrCat("FAIL two ranks on one GPU chose ", chosen);
        }
        const std::string suite = RunCollectiveSuite(**comm, seed, /*exact=*/true);
        return absl::StrCat(suite, " ", backend);  // equal across ranks when OK
      });
  ExpectAllOkAndEqual(reports);
}

#if defined(EXL3_HAVE_NCCL)

TEST(NcclGpuTest, RanksOnDistinctGpusAgreeAndMatchTheReference) {
  const int devices = DeviceCount();
  if (devices < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  // NCCL refuses two ranks on one GPU: as many ranks as GPUs (at most 4);
  // with one GPU this still runs every operation on a one-rank group.
  const int world = std::min(devices, 4);
  ExpectAllOkAndEqual(RunSuiteOnRanks(
      world,
      [](int rank, Bootstrap& bootstrap) {
        NcclOptions o;
        o.device = rank;
        return CreateNcclCommunicator(o, bootstrap);
      },
      /*exact=*/false));
}

TEST(NcclGpuTest, TwoRanksOnOneGpuAreRefusedOnEveryRank) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
  ExpectAllOk(RunForkedRanks(2, [](int, Bootstrap& bootstrap) {
    NcclOptions o;
    o.device = 0;
    const absl::Status s = CreateNcclCommunicator(o, bootstrap).status();
    return absl::IsFailedPrecondition(s) &&
                   std::string(s.message()).find("one GPU per rank") != std::string::npos
               ? std::string("OK")
               : absl::StrCat("FAIL ", s.ToString());
  }));
}

TEST(NcclGpuTest, AMissingRankFailsThePeersByTheDeadline) {
  const int devices = DeviceCount();
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << devices;
  ExpectAllOk(RunMissingRankScenario(
      2,
      [](int rank, Bootstrap& bootstrap) {
        NcclOptions o;
        o.device = rank;
        return CreateNcclCommunicator(o, bootstrap);
      },
      absl::Seconds(3)));
}

#endif  // EXL3_HAVE_NCCL
#endif  // EXL3_HAVE_CUDA

}  // namespace
}  // namespace exl3serve::worker::comm
