// tests/comm/ucx_forked_ranks.h — runs one function per rank, each in its own
// forked process (UCX state never crosses a fork: the test process itself
// never initialises UCX), and collects what each rank reports.
//
//   auto outcomes = RunForkedRanks({.world = 3}, [](int rank, uint16_t port, RankChannel& ch) {
//     ... rank 0 creates the bootstrap on port 0 and ch.Send("port N") ...
//     ch.Send("hash allreduce 1234abcd");
//   });
//
// Protocol: each child has a socketpair to the parent and writes lines.
// Rank 0 is forked first and must send "port <n>" once its bootstrap
// listens; the parent then forks ranks 1..N-1 with that port. A child that
// calls WaitForAll("point") sends "sync point" and blocks until the parent
// has seen "sync point" (or death) from every rank: a barrier through the
// parent, e.g. "joined" (every rank has its communicator, so a failure
// injected next cannot race with setup) or "done" (FinishAndWaitForAll: no
// rank tears down while another still needs it). The parent waits with one overall
// deadline (poll on the sockets, no sleeps); at the deadline it SIGKILLs the
// children that are left and marks them timed out. Children die with the
// parent (PR_SET_PDEATHSIG).
#ifndef EXL3SERVE_TESTS_COMM_UCX_FORKED_RANKS_H_
#define EXL3SERVE_TESTS_COMM_UCX_FORKED_RANKS_H_

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace exl3serve::worker::comm::testing {

// The child's end: lines to the parent, and the exit barrier.
class RankChannel {
 public:
  explicit RankChannel(int fd) : fd_(fd) {}

  // One line; must not contain '\n'.
  void Send(const std::string& line) {
    std::string out = line + "\n";
    size_t sent = 0;
    while (sent < out.size()) {
      ssize_t n = send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  // Sends "sync <point>" and waits until every rank has reached `point` or
  // died (or `timeout`).
  void WaitForAll(const std::string& point, absl::Duration timeout = absl::Seconds(60)) {
    Send("sync " + point);
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) == 1) {
      char byte;
      (void)!read(fd_, &byte, 1);
    }
  }

  // The exit barrier: WaitForAll("done").
  void FinishAndWaitForAll(absl::Duration timeout = absl::Seconds(60)) {
    WaitForAll("done", timeout);
  }

 private:
  int fd_;
};

struct RankOutcome {
  int rank = -1;
  pid_t pid = -1;
  std::vector<std::string> lines;
  bool exited = false;  // exited normally (exit_code valid)
  int exit_code = -1;
  int term_signal = 0;     // killed by this signal
  bool timed_out = false;  // the harness killed it at the deadline

  // The rest of the first line that starts with "key ", or "" if none.
  std::string Find(const std::string& key) const {
    for (const auto& l : lines) {
      if (l.compare(0, key.size() + 1, key + " ") == 0) return l.substr(key.size() + 1);
    }
    return "";
  }
  std::vector<std::string> FindAll(const std::string& key) const {
    std::vector<std::string> out;
    for (const auto& l : lines) {
      if (l.compare(0, key.size() + 1, key + " ") == 0) out.push_back(l.substr(key.size() + 1));
    }
    return out;
  }
};

struct ForkOptions {
  int world = 2;
  absl::Duration timeout = absl::Seconds(120);
  // Called in the parent for every line a child sends (e.g. to kill it).
  std::function<void(int rank, pid_t pid, const std::string& line)> on_line = nullptr;
};

using RankBody = std::function<void(int rank, uint16_t port, RankChannel& channel)>;

inline std::vector<RankOutcome> RunForkedRanks(const ForkOptions& options, const RankBody& body) {
  struct Child {
    pid_t pid = -1;
    int fd = -1;
    std::string partial;
    bool eof = false;
    std::string waiting_at;  // the sync point it is blocked at, if any
  };
  const int world = options.world;
  std::vector<Child> children(world);
  std::vector<RankOutcome> outcomes(world);
  const pid_t parent = getpid();

  auto spawn = [&](int rank, uint16_t port) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(3);
      close(sv[0]);
      for (const Child& c : children) {
        if (c.fd >= 0) close(c.fd);
      }
      RankChannel channel(sv[1]);
      body(rank, port, channel);
      _exit(0);
    }
    close(sv[1]);
    children[rank].pid = pid;
    children[rank].fd = sv[0];
    outcomes[rank].rank = rank;
    outcomes[rank].pid = pid;
  };
  auto reap = [&](int rank, bool kill_first) {
    Child& c = children[rank];
    if (c.pid < 0) return;
    if (kill_first) kill(c.pid, SIGKILL);
    int status = 0;
    if (waitpid(c.pid, &status, 0) == c.pid) {
      if (WIFEXITED(status)) {
        outcomes[rank].exited = true;
        outcomes[rank].exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        outcomes[rank].term_signal = WTERMSIG(status);
      }
    }
    c.pid = -1;
  };

  spawn(0, 0);
  bool others_started = world == 1;
  const absl::Time deadline = absl::Now() + options.timeout;
  while (true) {
    std::vector<pollfd> fds;
    std::vector<int> rank_of;
    for (int r = 0; r < world; ++r) {
      Child& c = children[r];
      if (c.fd < 0 || c.eof) continue;
      fds.push_back({c.fd, POLLIN, 0});
      rank_of.push_back(r);
    }
    // Release a sync point once every rank is at it or gone.
    for (int r = 0; r < world; ++r) {
      const std::string point = children[r].waiting_at;
      if (point.empty() || children[r].eof) continue;
      bool all_there = true;
      for (const Child& c : children) {
        if (c.fd < 0 || !(c.eof || c.waiting_at == point)) all_there = false;
      }
      if (!all_there) continue;
      for (Child& c : children) {
        if (!c.eof && c.waiting_at == point) {
          c.waiting_at.clear();
          (void)!send(c.fd, "r", 1, MSG_NOSIGNAL);
        }
      }
    }
    if (fds.empty()) break;
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      for (int r = 0; r < world; ++r) {
        if (children[r].pid >= 0 && !children[r].eof) {
          outcomes[r].timed_out = true;
          reap(r, /*kill_first=*/true);
        }
      }
      break;
    }
    int ready =
        poll(fds.data(), fds.size(),
             static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)))));
    if (ready <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int r = rank_of[i];
      Child& c = children[r];
      char buf[4096];
      ssize_t n = read(c.fd, buf, sizeof(buf));
      if (n <= 0) {
        c.eof = true;
        reap(r, /*kill_first=*/false);
        continue;
      }
      c.partial.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = c.partial.find('\n')) != std::string::npos) {
        std::string line = c.partial.substr(0, nl);
        c.partial.erase(0, nl + 1);
        outcomes[r].lines.push_back(line);
        if (line.rfind("sync ", 0) == 0) c.waiting_at = line.substr(5);
        if (r == 0 && !others_started && line.rfind("port ", 0) == 0) {
          others_started = true;
          const auto port = static_cast<uint16_t>(std::atoi(line.c_str() + 5));
          for (int q = 1; q < world; ++q) spawn(q, port);
        }
        if (options.on_line) options.on_line(r, c.pid, line);
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    if (children[r].pid >= 0) reap(r, /*kill_first=*/true);
    if (children[r].fd >= 0) close(children[r].fd);
  }
  return outcomes;
}

}  // namespace exl3serve::worker::comm::testing

#endif  // EXL3SERVE_TESTS_COMM_UCX_FORKED_RANKS_H_
