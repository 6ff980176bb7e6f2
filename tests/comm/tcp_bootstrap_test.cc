// TcpBootstrap: ranks as threads of this process on 127.0.0.1, rank 0 on an
// ephemeral port. Every wait is bounded by a deadline; nothing sleeps.
#include "worker/comm/tcp_bootstrap.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::Duration kGenerous = absl::Seconds(30);

std::unique_ptr<TcpBootstrap> MustCreate(const TcpBootstrapOptions& options,
                                         absl::Duration timeout = kGenerous) {
  auto boot = TcpBootstrap::Create(options, Deadline(timeout));
  EXPECT_TRUE(boot.ok()) << boot.status();
  return boot.ok() ? std::move(*boot) : nullptr;
}

std::string BlobFor(int rank, int round) {
  // Different sizes per rank and round, one empty, one large.
  if (rank == 1 && round == 0) return "";
  if (rank == 2 && round == 1) return std::string(1 << 20, static_cast<char>('a' + round));
  return std::string(static_cast<size_t>(rank * 7 + round + 1), static_cast<char>('A' + rank));
}

// A port nothing listens on (bound, then closed).
uint16_t UnusedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(TcpBootstrapTest, AllGatherReturnsEveryRanksBlobInRankOrder) {
  constexpr int kWorld = 4;
  constexpr int kRounds = 3;
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = kWorld, .port = 0});
  ASSERT_NE(root, nullptr);
  ASSERT_NE(root->port(), 0);
  std::vector<std::vector<std::vector<std::string>>> got(
      kWorld, std::vector<std::vector<std::string>>(kRounds));
  std::vector<absl::Status> errors(kWorld);
  auto run = [&](int rank, TcpBootstrap* boot) {
    for (int round = 0; round < kRounds; ++round) {
      auto all = boot->AllGather(BlobFor(rank, round), Deadline(kGenerous));
      if (!all.ok()) {
        errors[rank] = all.status();
        return;
      }
      got[rank][round] = *all;
    }
  };
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<TcpBootstrap>> peers(kWorld);
  for (int r = 1; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto boot = TcpBootstrap::Create({.rank = r, .world_size = kWorld, .port = root->port()},
                                       Deadline(kGenerous));
      if (!boot.ok()) {
        errors[r] = boot.status();
        return;
      }
      peers[r] = std::move(*boot);
      run(r, peers[r].get());
    });
  }
  run(0, root.get());
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r];
    for (int round = 0; round < kRounds; ++round) {
      ASSERT_EQ(got[r][round].size(), static_cast<size_t>(kWorld));
      for (int p = 0; p < kWorld; ++p)
        EXPECT_EQ(got[r][round][p], BlobFor(p, round)) << r << " " << round << " " << p;
    }
  }
}

TEST(TcpBootstrapTest, WorldOfOneNeedsNoNetwork) {
  std::unique_ptr<TcpBootstrap> boot = MustCreate({.rank = 0, .world_size = 1});
  ASSERT_NE(boot, nullptr);
  auto all = boot->AllGather("solo", Deadline(absl::Seconds(1)));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, std::vector<std::string>{"solo"});
}

TEST(TcpBootstrapTest, PeerStartedBeforeRankZeroRetriesUntilItListens) {
  const uint16_t port = UnusedPort();
  absl::StatusOr<std::vector<std::string>> peer_result = absl::UnknownError("not run");
  std::thread peer([&] {
    auto boot =
        TcpBootstrap::Create({.rank = 1, .world_size = 2, .port = port}, Deadline(kGenerous));
    if (!boot.ok()) {
      peer_result = boot.status();
      return;
    }
    peer_result = (*boot)->AllGather("one", Deadline(kGenerous));
  });
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = 2, .port = port});
  absl::StatusOr<std::vector<std::string>> root_result = absl::UnknownError("no root");
  if (root != nullptr) root_result = root->AllGather("zero", Deadline(kGenerous));
  peer.join();
  ASSERT_TRUE(root_result.ok()) << root_result.status();
  ASSERT_TRUE(peer_result.ok()) << peer_result.status();
  EXPECT_EQ(*peer_result, (std::vector<std::string>{"zero", "one"}));
}

TEST(TcpBootstrapTest, DeadlineNamesTheRanksThatNeverConnected) {
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = 4, .port = 0});
  ASSERT_NE(root, nullptr);
  std::unique_ptr<TcpBootstrap> one =
      MustCreate({.rank = 1, .world_size = 4, .port = root->port()});
  ASSERT_NE(one, nullptr);
  absl::Status peer_status;
  const absl::Time peer_start = absl::Now();
  absl::Duration peer_took;
  std::thread peer([&] {
    peer_status = one->AllGather("x", Deadline(kGenerous)).status();
    peer_took = absl::Now() - peer_start;
  });
  const absl::Time start = absl::Now();
  auto all = root->AllGather("root", Deadline(absl::Milliseconds(300)));
  const absl::Duration took = absl::Now() - start;
  peer.join();
  ASSERT_EQ(all.status().code(), absl::StatusCode::kDeadlineExceeded) << all.status();
  EXPECT_THAT(all.status().message(), AllOf(HasSubstr("ranks 2, 3"), HasSubstr("never connected")));
  EXPECT_LT(took, absl::Seconds(5));
  // Rank 1 does not wait out its own deadline: it gets rank 0's reason, or
  // (if rank 0 closed first) sees the connection drop.
  EXPECT_LT(peer_took, absl::Seconds(5));
  if (peer_status.code() == absl::StatusCode::kDeadlineExceeded) {
    EXPECT_THAT(peer_status.message(), HasSubstr("ranks 2, 3"));
  } else {
    EXPECT_EQ(peer_status.code(), absl::StatusCode::kUnavailable) << peer_status;
  }
  // Broken for good.
  EXPECT_EQ(root->AllGather("again", Deadline(kGenerous)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(TcpBootstrapTest, DroppedPeerFailsTheGroupWithUnavailable) {
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = 3, .port = 0});
  ASSERT_NE(root, nullptr);
  // Rank 2 connects (hello sent) and goes away before contributing.
  {
    std::unique_ptr<TcpBootstrap> doomed =
        MustCreate({.rank = 2, .world_size = 3, .port = root->port()});
    ASSERT_NE(doomed, nullptr);
  }
  std::unique_ptr<TcpBootstrap> one =
      MustCreate({.rank = 1, .world_size = 3, .port = root->port()});
  ASSERT_NE(one, nullptr);
  absl::Status peer_status;
  std::thread peer([&] { peer_status = one->AllGather("x", Deadline(kGenerous)).status(); });
  auto all = root->AllGather("root", Deadline(kGenerous));
  peer.join();
  ASSERT_EQ(all.status().code(), absl::StatusCode::kUnavailable) << all.status();
  EXPECT_THAT(all.status().message(), HasSubstr("rank 2"));
  // Rank 1 either got rank 0's notice or saw its connection close.
  EXPECT_EQ(peer_status.code(), absl::StatusCode::kUnavailable) << peer_status;
}

TEST(TcpBootstrapTest, RankZeroGoneFailsPeerWithUnavailable) {
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = 2, .port = 0});
  ASSERT_NE(root, nullptr);
  std::unique_ptr<TcpBootstrap> peer =
      MustCreate({.rank = 1, .world_size = 2, .port = root->port()});
  ASSERT_NE(peer, nullptr);
  root.reset();
  auto all = peer->AllGather("x", Deadline(kGenerous));
  EXPECT_EQ(all.status().code(), absl::StatusCode::kUnavailable) << all.status();
  EXPECT_THAT(all.status().message(), HasSubstr("rank 0"));
}

TEST(TcpBootstrapTest, RankOfAnotherGroupIsTurnedAway) {
  std::unique_ptr<TcpBootstrap> root =
      MustCreate({.rank = 0, .world_size = 2, .port = 0, .group_id = 7});
  ASSERT_NE(root, nullptr);
  // A stale rank 1 of group 8 connects first; it must not be taken for ours.
  std::unique_ptr<TcpBootstrap> stranger =
      MustCreate({.rank = 1, .world_size = 2, .port = root->port(), .group_id = 8});
  ASSERT_NE(stranger, nullptr);
  absl::StatusOr<std::vector<std::string>> peer_result = absl::UnknownError("not run");
  std::thread peer([&] {
    auto boot = TcpBootstrap::Create(
        {.rank = 1, .world_size = 2, .port = root->port(), .group_id = 7}, Deadline(kGenerous));
    if (!boot.ok()) {
      peer_result = boot.status();
      return;
    }
    peer_result = (*boot)->AllGather("mine", Deadline(kGenerous));
  });
  auto all = root->AllGather("root", Deadline(kGenerous));
  peer.join();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, (std::vector<std::string>{"root", "mine"}));
  ASSERT_TRUE(peer_result.ok()) << peer_result.status();
  // The stranger never joins: turned away, or closed with rank 0.
  root.reset();
  EXPECT_EQ(stranger->AllGather("x", Deadline(kGenerous)).status().code(),
            absl::StatusCode::kUnavailable);
}

// A raw TCP connection to rank 0 (a stranger on the network).
int RawConnect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// With a rank token: strangers without it (an unauthenticated rank, a wrong
// token, a slow loris that never finishes, garbage) are refused and the real
// ranks still form the group.
TEST(TcpBootstrapTest, WithARankTokenStrangersAreRefusedAndTheGroupForms) {
  constexpr int kWorld = 3;
  TcpBootstrapOptions root_options{.rank = 0, .world_size = kWorld, .port = 0};
  root_options.auth_key = "the-cluster-token";
  root_options.handshake_timeout = absl::Milliseconds(300);
  std::unique_ptr<TcpBootstrap> root = MustCreate(root_options);
  ASSERT_NE(root, nullptr);
  const uint16_t port = root->port();
  // Strangers connect before the real ranks.
  const int loris = RawConnect(port);            // connects, never speaks
  const int garbage = RawConnect(port);
  ASSERT_EQ(send(garbage, "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL), 18);
  std::unique_ptr<TcpBootstrap> no_token = MustCreate({.rank = 1, .world_size = kWorld, .port = port});
  absl::Status no_token_result, wrong_token_result;
  std::thread no_token_thread([&] {
    no_token_result = no_token->AllGather("x", Deadline(absl::Seconds(10))).status();
  });
  std::thread wrong_token_thread([&] {
    TcpBootstrapOptions o{.rank = 2, .world_size = kWorld, .port = port};
    o.auth_key = "a-guess";
    auto boot = TcpBootstrap::Create(o, Deadline(kGenerous));
    wrong_token_result = boot.ok() ? (*boot)->AllGather("x", Deadline(absl::Seconds(10))).status()
                                   : boot.status();
  });
  // The real ranks.
  std::vector<absl::StatusOr<std::vector<std::string>>> results(kWorld, absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int r = 1; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      TcpBootstrapOptions o{.rank = r, .world_size = kWorld, .port = port};
      o.auth_key = "the-cluster-token";
      auto boot = TcpBootstrap::Create(o, Deadline(kGenerous));
      if (!boot.ok()) {
        results[r] = boot.status();
        return;
      }
      results[r] = (*boot)->AllGather(absl::StrCat("blob", r), Deadline(kGenerous));
      if (results[r].ok()) results[r] = (*boot)->AllGather(absl::StrCat("again", r), Deadline(kGenerous));
    });
  }
  results[0] = root->AllGather("blob0", Deadline(kGenerous));
  auto second = root->AllGather("again0", Deadline(kGenerous));
  for (auto& t : ranks) t.join();
  no_token_thread.join();
  wrong_token_thread.join();
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_EQ(*results[0], (std::vector<std::string>{"blob0", "blob1", "blob2"}));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, (std::vector<std::string>{"again0", "again1", "again2"}));
  for (int r = 1; r < kWorld; ++r) {
    ASSERT_TRUE(results[r].ok()) << r << ": " << results[r].status();
    EXPECT_EQ(*results[r], (std::vector<std::string>{"again0", "again1", "again2"}));
  }
  // The strangers got nothing: no challenge answered, or closed.
  EXPECT_FALSE(no_token_result.ok());
  EXPECT_FALSE(wrong_token_result.ok());
  EXPECT_THAT(std::string(wrong_token_result.message()), HasSubstr("rank token"));
  // The slow loris was closed by rank 0 (EOF after the challenge frame).
  char buf[256];
  ssize_t n;
  size_t total = 0;
  while ((n = recv(loris, buf, sizeof buf, 0)) > 0) total += static_cast<size_t>(n);
  EXPECT_EQ(n, 0) << "the silent connection was closed";
  EXPECT_EQ(total, 16u + 32u) << "it saw only the challenge";
  close(loris);
  close(garbage);
}

// A TCP relay between one peer and rank 0 that records both directions and
// can flip one byte of the peer's stream (an on-path observer / attacker).
class Relay {
 public:
  // `flip_at`: index in the peer -> rank 0 stream whose byte is inverted (-1: none).
  Relay(uint16_t root_port, int64_t flip_at) : root_port_(root_port), flip_at_(flip_at) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(listen_fd_, 1);
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~Relay() {
    Join();
    close(listen_fd_);
  }
  uint16_t port() const { return port_; }
  // Waits for the relayed connection to end; up()/down() are valid after it.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  const std::string& up() const { return up_; }
  const std::string& down() const { return down_; }

 private:
  void Run() {
    pollfd lp{listen_fd_, POLLIN, 0};
    if (poll(&lp, 1, 30000) <= 0) return;
    const int a = accept(listen_fd_, nullptr, nullptr);
    const int b = RawConnect(root_port_);
    char buf[65536];
    while (true) {
      pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(fds, 2, 30000) <= 0) break;
      bool closed = false;
      for (int side = 0; side < 2; ++side) {
        if (fds[side].revents == 0) continue;
        const ssize_t n = recv(fds[side].fd, buf, sizeof buf, 0);
        if (n <= 0) {
          closed = true;
          break;
        }
        std::string& log = side == 0 ? up_ : down_;
        for (ssize_t i = 0; i < n; ++i) {
          if (side == 0 && static_cast<int64_t>(log.size()) + i == flip_at_) buf[i] = ~buf[i];
        }
        log.append(buf, static_cast<size_t>(n));
        send(side == 0 ? b : a, buf, static_cast<size_t>(n), MSG_NOSIGNAL);
      }
      if (closed) break;
    }
    close(a);
    close(b);
  }

  const uint16_t root_port_;
  const int64_t flip_at_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::string up_, down_;
  std::thread thread_;
};

// One peer through the relay; returns (rank 0's result, the peer's result).
std::pair<absl::StatusOr<std::vector<std::string>>, absl::StatusOr<std::vector<std::string>>>
GatherThroughRelay(const std::string& token, int64_t flip_at, Relay** relay_out,
                   std::unique_ptr<Relay>* keep) {
  TcpBootstrapOptions root_options{.rank = 0, .world_size = 2, .port = 0};
  root_options.auth_key = token;
  std::unique_ptr<TcpBootstrap> root = MustCreate(root_options);
  *keep = std::make_unique<Relay>(root->port(), flip_at);
  *relay_out = keep->get();
  absl::StatusOr<std::vector<std::string>> peer_result = absl::UnknownError("not run");
  std::thread peer([&] {
    TcpBootstrapOptions o{.rank = 1, .world_size = 2, .port = (*relay_out)->port()};
    o.auth_key = token;
    auto boot = TcpBootstrap::Create(o, Deadline(kGenerous));
    peer_result = boot.ok() ? (*boot)->AllGather("SECRET-UCX-ADDRESS-of-rank-1", Deadline(absl::Seconds(10)))
                            : boot.status();
  });
  auto root_result = root->AllGather("SECRET-NCCL-ID-of-rank-0", Deadline(absl::Seconds(10)));
  peer.join();
  root.reset();  // closes rank 0's side: the relay ends
  (*relay_out)->Join();
  return {std::move(root_result), std::move(peer_result)};
}

// With a rank token the setup data is encrypted on the wire (an observer
// sees neither blob), and without one it is not (the observer can see it:
// the check can fail).
TEST(TcpBootstrapTest, WithARankTokenSetupDataIsEncryptedOnTheWire) {
  for (const std::string token : {"", "the-cluster-token"}) {
    Relay* relay = nullptr;
    std::unique_ptr<Relay> keep;
    auto [root_result, peer_result] = GatherThroughRelay(token, -1, &relay, &keep);
    ASSERT_TRUE(root_result.ok()) << root_result.status();
    ASSERT_TRUE(peer_result.ok()) << peer_result.status();
    const std::vector<std::string> want = {"SECRET-NCCL-ID-of-rank-0", "SECRET-UCX-ADDRESS-of-rank-1"};
    EXPECT_EQ(*root_result, want);
    EXPECT_EQ(*peer_result, want);
    const bool seen = absl::StrContains(relay->up(), "SECRET") || absl::StrContains(relay->down(), "SECRET");
    EXPECT_EQ(seen, token.empty()) << (token.empty() ? "plain" : "sealed") << " bootstrap";
  }
}

// One flipped bit in the peer's sealed blob (after its 96-byte hello and the
// blob frame's 16-byte header) fails the group with Unauthenticated.
TEST(TcpBootstrapTest, ATamperedSealedFrameFailsTheGroup) {
  Relay* relay = nullptr;
  std::unique_ptr<Relay> keep;
  auto [root_result, peer_result] = GatherThroughRelay("the-cluster-token", 96 + 16 + 3, &relay, &keep);
  EXPECT_EQ(root_result.status().code(), absl::StatusCode::kUnauthenticated) << root_result.status();
  EXPECT_THAT(std::string(root_result.status().message()), HasSubstr("failed authentication"));
  EXPECT_FALSE(peer_result.ok());
}

// A rank that proves the token to a rank 0 that has none is refused, and a
// rank with a token facing a rank 0 without one fails naming the setting.
TEST(TcpBootstrapTest, ATokenOnOneSideOnlyIsAClearError) {
  std::unique_ptr<TcpBootstrap> root = MustCreate({.rank = 0, .world_size = 2, .port = 0});
  ASSERT_NE(root, nullptr);
  TcpBootstrapOptions o{.rank = 1, .world_size = 2, .port = root->port()};
  o.auth_key = "token";
  std::unique_ptr<TcpBootstrap> peer = MustCreate(o);
  absl::Status peer_status;
  std::thread t([&] { peer_status = peer->AllGather("x", Deadline(absl::Seconds(2))).status(); });
  auto root_result = root->AllGather("r", Deadline(absl::Seconds(2)));
  t.join();
  EXPECT_EQ(root_result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(root_result.status().message()), HasSubstr("rank 1"));
  EXPECT_FALSE(peer_status.ok());
  EXPECT_THAT(std::string(peer_status.message()), HasSubstr("--rank-token-file"));
}

TEST(TcpBootstrapTest, ConnectingToNobodyEndsAtTheDeadline) {
  const absl::Time start = absl::Now();
  auto boot = TcpBootstrap::Create({.rank = 1, .world_size = 2, .port = UnusedPort()},
                                   Deadline(absl::Milliseconds(300)));
  EXPECT_EQ(boot.status().code(), absl::StatusCode::kDeadlineExceeded) << boot.status();
  EXPECT_THAT(boot.status().message(), HasSubstr("could not connect to rank 0"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(TcpBootstrapTest, RejectsBadArguments) {
  EXPECT_EQ(TcpBootstrap::Create({.rank = 2, .world_size = 2}, Deadline(kGenerous)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpBootstrap::Create({.rank = 1, .world_size = 2, .port = 0}, Deadline(kGenerous))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpBootstrap::Create({.rank = 0, .world_size = 0}, Deadline(kGenerous)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::worker::comm
