// `exl3serve launch --config cluster.yaml --box NAME`: starts one box's
// processes of the cluster the YAML describes. The coordinator runs in this
// process when NAME is the coordinator's box (the code path of `exl3serve
// coordinator --config`, cli/coordinator_run.h); every rank of the box is a
// child process `exl3serve worker --coordinator HOST:PORT --rank R
// --world-size N --reconnect` (HOST = the coordinator box's address, PORT =
// the port of listen_address). A rank that exits is restarted (after 1 s,
// doubling up to 10 s while it keeps failing fast); the children get SIGKILL
// if launch dies (PR_SET_PDEATHSIG) and SIGTERM, then SIGKILL after 10 s,
// when launch stops on SIGINT/SIGTERM.
//
// The config is the coordinator's (cli/coordinator_command.cc) plus:
//   boxes:
//     - name: lead                # --box NAME
//       address: 10.0.0.1         # how the other boxes reach this one
//       coordinator: true         # exactly one box
//       metrics_port: 9400        # optional: coordinator /metrics (on address)
//     - name: a
//       address: 10.0.0.2
//       devices: [0, 1]           # optional: the box's GPUs (CUDA device ids)
//       nics: [eth1]              # optional: interfaces for the collectives: the
//                                 # ranks get UCX_NET_DEVICES and, unless nccl
//                                 # sets it, --nccl-socket-ifname
//       nccl: {ib_hca: "mlx5_0:1", ib_gid_index: 3}  # optional: overrides comm.nccl
//       ranks: [0, 1]             # rank ids of this box, 0 <= r < world_size,
//                                 # each on exactly one box
//       rank_devices: [0, 1]      # optional: each rank's GPU, same order as ranks,
//                                 # one of devices (CUDA_VISIBLE_DEVICES of the rank)
//       rank_metrics_ports: [9401, 9402]  # optional: /metrics of each rank, same order
// Each rank is started with the coordinator channel's credentials from the
// same file: --tls-ca tls.rank_ca, --tls-server-name (tls.rank_server_name,
// else the coordinator box's address), --tls-cert/--tls-key
// tls.rank_client_cert/key, --rank-token-file rank_token_file, and the NCCL
// settings comm.nccl merged with boxes[].nccl as --nccl-* flags.
// Errors name the key (`boxes[1].ranks[0]`).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/cluster_keys.h"
#include "cli/launch_plan.h"
#include "cli/commands.h"
#include "cli/coordinator_run.h"
#include "common/status_macros.h"
#include "coordinator/grpc_server.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {
namespace {

// One rank child process, restarted when it exits.
struct Child {
  int rank = 0;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // NAME=VALUE set for the child (over launch's own)
  pid_t pid = -1;
  absl::Time started;
  absl::Time restart_at;
  absl::Duration backoff = absl::Seconds(1);
};

pid_t Spawn(const std::vector<std::string>& args, const std::vector<std::string>& extra_env) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The environment, built before fork: launch's own minus the names that
  // extra_env sets, then extra_env.
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    bool overridden = false;
    for (const std::string& x : extra_env) {
      const std::string_view name(x.data(), x.find('=') + 1);  // "NAME="
      overridden = overridden || entry.substr(0, name.size()) == name;
    }
    if (!overridden) envp.push_back(*e);
  }
  for (const std::string& x : extra_env) envp.push_back(const_cast<char*>(x.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    execve("/proc/self/exe", argv.data(), envp.data());
    std::fprintf(stderr, "launch: exec /proc/self/exe: %s\n", std::strerror(errno));
    _exit(127);
  }
  return pid;
}

// Starts, watches and restarts the box's ranks on a thread of its own (the
// thread that forks must live as long as the children: PR_SET_PDEATHSIG).
class Supervisor {
 public:
  explicit Supervisor(std::vector<Child> children) : children_(std::move(children)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Supervisor() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    for (Child& c : children_) Start(c);
    while (!stop_) {
      for (Child& c : children_) {
        if (c.pid > 0) {
          int status = 0;
          if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
            const bool fast = absl::Now() - c.started < absl::Seconds(10);
            c.backoff = fast ? std::min(c.backoff * 2, absl::Seconds(10)) : absl::Seconds(1);
            std::printf("launch: rank %d (pid %d) exited (%s %d); restarting in %.0f s\n", c.rank,
                        static_cast<int>(c.pid), WIFSIGNALED(status) ? "signal" : "status",
                        WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status),
                        absl::ToDoubleSeconds(c.backoff / 2));
            std::fflush(stdout);
            c.pid = -1;
            c.restart_at = absl::Now() + c.backoff / 2;
          }
        } else if (absl::Now() >= c.restart_at) {
          Start(c);
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    for (Child& c : children_) {
      if (c.pid > 0) kill(c.pid, SIGTERM);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    for (Child& c : children_) {
      while (c.pid > 0) {
        int status = 0;
        if (waitpid(c.pid, &status, WNOHANG) != 0) {
          c.pid = -1;
        } else if (absl::Now() > deadline) {
          kill(c.pid, SIGKILL);
          waitpid(c.pid, &status, 0);
          c.pid = -1;
        } else {
          absl::SleepFor(absl::Milliseconds(50));
        }
      }
    }
    std::printf("launch: ranks stopped\n");
    std::fflush(stdout);
  }
  void Start(Child& c) {
    c.pid = Spawn(c.argv, c.env);
    c.started = absl::Now();
    if (c.pid < 0) {
      std::fprintf(stderr, "launch: fork: %s\n", std::strerror(errno));
      c.restart_at = absl::Now() + absl::Seconds(1);
      return;
    }
    std::printf("launch: rank %d started (pid %d)\n", c.rank, static_cast<int>(c.pid));
    std::fflush(stdout);
  }

  std::vector<Child> children_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

CommandRunner RegisterLaunchCommand(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  auto box_name = std::make_shared<std::string>();
  auto port_file = std::make_shared<std::string>();
  auto threads = std::make_shared<int>(0);
  auto dry_run = std::make_shared<bool>(false);
  app.add_option("--config", *config, "cluster config (YAML with a boxes: section)")->required();
  app.add_option("--box", *box_name, "the box to start (boxes[].name)")->required();
  app.add_option("--port-file", *port_file, "coordinator box: write the bound rank port here");
  app.add_option("--threads", *threads, "kernel threads of each rank (0 = the worker default)");
  app.add_flag("--dry-run", *dry_run,
               "check the config and print what this box would run (environment and command "
               "of each rank), start nothing");
  app.footer("Keys: cli/launch_command.cc (boxes) and cli/coordinator_command.cc (the rest).");
  return [config, box_name, port_file, threads, dry_run]() -> absl::Status {
    EXL3_ASSIGN_OR_RETURN(LaunchPlan plan, LoadLaunchPlan(*config));
    const Box* box = nullptr;
    for (const Box& b : plan.boxes) {
      if (b.name == *box_name) box = &b;
    }
    if (box == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--box ", *box_name, ": no such box in config key `boxes`"));
    }
    // Block the stop signals before any thread starts (children unblock them).
    sigset_t stop_set;
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGINT);
    sigaddset(&stop_set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_set, nullptr);

    std::vector<Child> children;
    for (size_t i = 0; i < box->ranks.size(); ++i) {
      Child c;
      c.rank = box->ranks[i];
      c.argv = {"exl3serve", "worker", "--coordinator", plan.coordinator_address, "--rank",
                std::to_string(c.rank), "--world-size", std::to_string(plan.world_size),
                "--reconnect"};
      if (*threads > 0) {
        c.argv.push_back("--threads");
        c.argv.push_back(std::to_string(*threads));
      }
      if (i < box->rank_metrics_ports.size() && box->rank_metrics_ports[i] > 0) {
        c.argv.insert(c.argv.end(), {"--metrics-port", std::to_string(box->rank_metrics_ports[i]),
                                     "--metrics-host", box->address});
      }
      // The coordinator channel's credentials.
      const RankTlsPaths& tls = plan.rank_tls;
      if (!tls.cert.empty()) {
        c.argv.insert(c.argv.end(), {"--tls-ca", tls.ca, "--tls-server-name",
                                     tls.server_name.empty() ? plan.coordinator_host
                                                             : tls.server_name});
      }
      if (!tls.client_cert.empty()) {
        c.argv.insert(c.argv.end(), {"--tls-cert", tls.client_cert, "--tls-key", tls.client_key});
      }
      if (!plan.rank_token_file.empty()) {
        c.argv.insert(c.argv.end(), {"--rank-token-file", plan.rank_token_file});
      }
      // Collectives: this box's NICs and NCCL settings, the rank's GPU.
      NcclKeys nccl = box->nccl;
      if (!box->nics.empty()) {
        std::string nics;
        for (const std::string& nic : box->nics) nics += (nics.empty() ? "" : ",") + nic;
        if (nccl.socket_ifname.empty()) nccl.socket_ifname = nics;
        c.env.push_back("UCX_NET_DEVICES=" + nics);
      }
      for (const std::string& flag : NcclWorkerFlags(nccl)) c.argv.push_back(flag);
      if (i < box->rank_devices.size()) {
        c.env.push_back("CUDA_VISIBLE_DEVICES=" + std::to_string(box->rank_devices[i]));
      }
      children.push_back(std::move(c));
    }
    std::printf("launch: box %s: %s%zu rank(s), coordinator %s\n", box->name.c_str(),
                box->coordinator ? "the coordinator and " : "", children.size(),
                plan.coordinator_address.c_str());
    if (*dry_run) {
      if (box->coordinator) {
        std::printf("launch: would run: exl3serve coordinator --config %s%s\n", config->c_str(),
                    box->metrics_port > 0
                        ? absl::StrCat(" --metrics-port ", box->metrics_port, " --metrics-host ",
                                       box->address).c_str()
                        : "");
      }
      for (const Child& c : children) {
        std::string line = absl::StrJoin(c.env, " ");
        absl::StrAppend(&line, line.empty() ? "" : " ", absl::StrJoin(c.argv, " "));
        std::printf("launch: would run rank %d: %s\n", c.rank, line.c_str());
      }
      return absl::OkStatus();
    }
    std::fflush(stdout);
    Supervisor supervisor(std::move(children));
    absl::Status status;
    if (box->coordinator) {
      status = RunCoordinator(CoordinatorRunOptions{
          .config = *config,
          .port_file = *port_file,
          .metrics_port = box->metrics_port,
          .metrics_host = box->metrics_port > 0 ? box->address : "127.0.0.1"});
    } else {
      while (sigwaitinfo(&stop_set, nullptr) < 0 && errno == EINTR) {
      }
      std::printf("launch: stopping\n");
      std::fflush(stdout);
    }
    supervisor.Stop();
    return status;
  };
}

}  // namespace exl3serve::cli
