#include "worker/rank/local_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/api/verified_forward.h"
#include "worker/model/linear.h"
#include "worker/rank/control_wire.h"
#include "worker/rank/rank_executor.h"

namespace exl3serve::worker::rank {
namespace {

absl::StatusOr<std::string> OwnExecutable() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return absl::InternalError("cannot resolve /proc/self/exe");
  return std::string(path, static_cast<size_t>(n));
}

std::string UniqueShmName() {
  static std::atomic<int> counter{0};
  std::random_device random;
  return absl::StrCat("/exl3serve-", getpid(), "-", counter.fetch_add(1), "-", random() % 100000);
}

int KvBits(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::kFp32:
      return 32;
    case KvCacheDtype::kFp16:
      return 16;
    case KvCacheDtype::kInt8:
      return 8;
    case KvCacheDtype::kInt4:
      return 4;
  }
  return 16;
}

// Waits for `pid` (a child) to exit, at most `timeout`. True when it has
// (and was reaped into *status).
bool WaitChild(pid_t pid, absl::Duration timeout, int* status) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(timeout)));
    while (poll(&p, 1, ms) < 0 && errno == EINTR) {
    }
    close(pidfd);
  }
  return waitpid(pid, status, WNOHANG) == pid;
}

// True when child `pid` has exited (or was already reaped), without reaping
// it: the owner thread's waitpid still sees it.
bool ChildExited(pid_t pid) {
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    return errno == ECHILD;  // reaped already
  }
  return info.si_pid == pid;
}

std::string HostName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown-host";
  return host;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return "stopped";
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalGroup>> LocalGroup::Start(const LocalGroupOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel size must be >= 1, got ", options.world_size));
  }
  if (!options.rank_wrappers.empty() &&
      static_cast<int>(options.rank_wrappers.size()) != options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank wrappers: ", options.rank_wrappers.size(),
                                                   " given for ", options.world_size, " ranks"));
  }
  EXL3_RETURN_IF_ERROR(CheckCapacities(options.capacities, options.world_size));
  if (options.comm.backend == "ucx" && options.comm.bootstrap_address.empty()) {
    return absl::InvalidArgumentError("backend ucx needs a bootstrap address (host:port)");
  }
  std::string executable = options.executable;
  if (executable.empty()) {
    EXL3_ASSIGN_OR_RETURN(executable, OwnExecutable());
  }

  std::unique_ptr<LocalGroup> group(new LocalGroup());
  group->options_ = options;
  group->step_timeout_ = options.step_timeout;
  comm::CommSpec spec = options.comm;
  if (spec.backend == "shm" && spec.shm_name.empty()) spec.shm_name = UniqueShmName();
  if (spec.backend == "shm") group->shm_name_ = spec.shm_name;

  group->ranks_.resize(options.world_size);
  for (int r = 0; r < options.world_size; ++r) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
    }
    std::vector<std::string> args;
    if (!options.rank_wrappers.empty()) args = options.rank_wrappers[r];
    args.push_back(executable);
    args.insert(args.end(),
                {"worker", "--model", options.model_dir, "--rank", absl::StrCat(r),
                 "--world-size", absl::StrCat(options.world_size), "--ep",
                 absl::StrCat(options.expert_parallel), "--comm", spec.backend, "--control-fd",
                 absl::StrCat(fds[1]), "--threads", absl::StrCat(options.threads_per_rank),
                 "--kv-bits", absl::StrCat(KvBits(options.kv.dtype)), "--kv-pages",
                 absl::StrCat(options.kv.num_pages), "--kv-page-size",
                 absl::StrCat(options.kv.page_size_tokens), "--collective-timeout-ms",
                 absl::StrCat(absl::ToInt64Milliseconds(options.step_timeout)),
                 "--join-timeout-ms", absl::StrCat(absl::ToInt64Milliseconds(options.load_timeout))});
    if (!spec.shm_name.empty()) args.insert(args.end(), {"--shm-name", spec.shm_name});
    if (!spec.bootstrap_address.empty()) {
      args.insert(args.end(), {"--bootstrap", spec.bootstrap_address});
    }
    if (!spec.ucx_tls.empty()) args.insert(args.end(), {"--ucx-tls", spec.ucx_tls});
    for (const std::string& tensor : options.spill.spill) {
      args.insert(args.end(), {"--spill-tensor", tensor});
    }
    if (options.spill.auto_threshold_bytes > 0) {
      args.insert(args.end(), {"--spill-threshold-bytes",
                               absl::StrCat(options.spill.auto_threshold_bytes)});
    }
    if (options.spill.memory_budget_bytes > 0) {
      args.insert(args.end(), {"--memory-budget-bytes",
                               absl::StrCat(options.spill.memory_budget_bytes)});
    }
    args.insert(args.end(),
                {"--spill-cache-bytes", absl::StrCat(options.spill.cache_budget_bytes)});
    if (!options.spill.cache_dir.empty()) {
      args.insert(args.end(), {"--spill-cache-dir", options.spill.cache_dir});
    }
    if (options.spill.extract) args.push_back("--spill-extract");
    if (options.kv.caller_assigns_pages) args.push_back("--kv-assigned");
    if (options.kv_disk_slots > 0) {
      args.insert(args.end(), {"--kv-disk-path", options.kv_disk_path, "--kv-disk-blocks",
                               absl::StrCat(options.kv_disk_slots)});
    }
    args.insert(args.end(), {"--prefill-precision", GemmPrecisionName(options.prefill_precision),
                             "--decode-precision", GemmPrecisionName(options.decode_precision)});
    if (!options.capacities.empty()) {
      // Shortest round-trip text: every rank plans from exactly these values.
      std::string capacities;
      for (double c : options.capacities) {
        char text[64];
        const std::to_chars_result end = std::to_chars(text, text + sizeof(text), c);
        if (!capacities.empty()) capacities += ',';
        capacities.append(text, end.ptr);
      }
      args.insert(args.end(), {"--capacities", capacities});
    }
    if (options.metrics_port > 0) {
      args.insert(args.end(), {"--metrics-host", options.metrics_host, "--metrics-port",
                               absl::StrCat(options.metrics_port + r)});
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    const pid_t pid = fork();
    if (pid < 0) {
      close(fds[0]);
      close(fds[1]);
      return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      fcntl(fds[1], F_SETFD, 0);  // this end survives exec
      execvp(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    group->ranks_[r].pid = pid;
    group->ranks_[r].fd = fds[0];
  }

  // Hellos: every rank reports its load result. Collect all, then report the
  // most telling failure (a real load error beats a peer's "lost my peers").
  const absl::Time deadline = absl::Now() + options.load_timeout + absl::Seconds(5);
  absl::Status first_error, first_root_cause;
  for (int r = 0; r < options.world_size; ++r) {
    Rank& rank = group->ranks_[r];
    absl::StatusOr<std::string> hello = ReadFrame(rank.fd, deadline);
    absl::Status status;
    if (!hello.ok()) {
      status = absl::UnavailableError(absl::StrCat(group->DescribeRank(r),
                                                   " before it finished loading (",
                                                   hello.status().message(), ")"));
    } else {
      WireReader in(*hello);
      const uint32_t version = in.U32();
      if (in.ok() && version != kControlWireVersion) {
        status = absl::FailedPreconditionError(
            absl::StrCat("rank ", r, " speaks control protocol v", version, ", this driver v",
                         kControlWireVersion, ": mismatched exl3serve binaries"));
      } else {
        status = ReadStatus(in);
        const int64_t vocab = in.I64();
        rank.bytes_read = in.U64();
        rank.planned_bytes = in.U64();
        const int64_t kv_pages = in.I64();
        const uint32_t kv_page_size = in.U32();
        if (status.ok()) status = in.Finish("rank hello");
        if (status.ok() && (kv_pages != options.kv.num_pages ||
                            static_cast<int64_t>(kv_page_size) != options.kv.page_size_tokens)) {
          status = absl::FailedPreconditionError(absl::StrCat(
              "its KV cache has ", kv_pages, " pages of ", kv_page_size,
              " positions but the driver's block allocator has ", options.kv.num_pages,
              " of ", options.kv.page_size_tokens));
        }
        if (status.ok()) group->vocab_size_ = vocab;
      }
      if (!status.ok()) status = absl::Status(status.code(), absl::StrCat("rank ", r, ": ", status.message()));
    }
    if (!status.ok()) {
      if (first_error.ok()) first_error = status;
      const bool peer_symptom = absl::IsAborted(status) || absl::IsUnavailable(status) ||
                                absl::IsDeadlineExceeded(status);
      if (!peer_symptom && first_root_cause.ok()) first_root_cause = status;
    }
  }
  if (!first_error.ok()) {
    group->broken_ = first_root_cause.ok() ? first_error : first_root_cause;
    group->Shutdown(absl::Seconds(2));
    return group->broken_;
  }
  group->Publish();
  return group;
}

void LocalGroup::Publish() {
  const bool serving = broken_.ok() && !shut_down_;
  const std::string host = HostName();
  std::vector<LocalRankStatus> ranks;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    LocalRankStatus& status = ranks.emplace_back();
    status.rank = r;
    status.pid = ranks_[r].pid;
    status.up = serving && !ranks_[r].exited;
    status.bytes_read = ranks_[r].bytes_read;
    status.address = absl::StrCat(host, " pid ", ranks_[r].pid, " (local)");
  }
  absl::MutexLock lock(&status_mu_);
  published_ = std::move(ranks);
}

std::vector<LocalRankStatus> LocalGroup::rank_status() const {
  std::vector<LocalRankStatus> ranks;
  {
    absl::MutexLock lock(&status_mu_);
    ranks = published_;
  }
  for (LocalRankStatus& status : ranks) {
    if (status.up && ChildExited(status.pid)) status.up = false;
  }
  return ranks;
}

LocalGroup::~LocalGroup() { Shutdown(); }

std::string LocalGroup::DescribeRank(int r) {
  Rank& rank = ranks_[r];
  int status = 0;
  if (!rank.exited && WaitChild(rank.pid, absl::Milliseconds(200), &status)) {
    rank.exited = true;
    return absl::StrCat("rank ", r, " (pid ", rank.pid, ") ", DescribeWaitStatus(status));
  }
  return absl::StrCat("rank ", r, " (pid ", rank.pid, ")",
                      rank.exited ? " has exited" : " stopped answering");
}

absl::Status LocalGroup::Break(absl::Status status) {
  if (broken_.ok()) {
    broken_ = status;
    Publish();
  }
  return status;
}

absl::Status LocalGroup::RoundTrip(const std::string& request, absl::Duration timeout,
                                   std::string* rank0_body) {
  if (!broken_.ok()) {
    return absl::UnavailableError(absl::StrCat("the rank group is broken: ", broken_.message()));
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (int r = 0; r < world_size(); ++r) {
    if (absl::Status s = WriteFrame(ranks_[r].fd, request, deadline); !s.ok()) {
      return Break(absl::UnavailableError(
          absl::StrCat(DescribeRank(r), ": cannot send the step (", s.message(), ")")));
    }
  }
  // Every rank answers every command (ranks whose peers failed answer with
  // the collective's error), so reading in rank order cannot deadlock; a rank
  // that neither answers nor exits is caught by the deadline.
  absl::Status result, transport;
  for (int r = 0; r < world_size(); ++r) {
    absl::StatusOr<std::string> reply = ReadFrame(ranks_[r].fd, deadline);
    if (!reply.ok()) {
      const absl::Status s =
          absl::IsDeadlineExceeded(reply.status())
              ? absl::DeadlineExceededError(absl::StrCat(DescribeRank(r), ": no answer within ",
                                                         absl::FormatDuration(timeout)))
              : absl::UnavailableError(DescribeRank(r));
      if (transport.ok()) transport = s;
      continue;
    }
    WireReader in(*reply);
    absl::Status status = ReadStatus(in);
    if (!status.ok()) {
      status = absl::Status(status.code(), absl::StrCat("rank ", r, ": ", status.message()));
      if (result.ok()) result = status;
      continue;
    }
    if (r == 0) result_bytes_ += reply->size();
    if (r == 0 && rank0_body != nullptr) *rank0_body = std::string(in.rest());
  }
  if (!transport.ok()) return Break(transport);
  // A rank whose collectives failed exits after answering: the group is gone.
  if (!result.ok() && (absl::IsAborted(result) || absl::IsUnavailable(result) ||
                       absl::IsDeadlineExceeded(result))) {
    return Break(result);
  }
  return result;
}

absl::Status LocalGroup::AddSequence(int64_t seq_id) {
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kAddSequence));
  w.I64(seq_id);
  return RoundTrip(w.data(), step_timeout_, nullptr);
}

absl::Status LocalGroup::AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) {
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kAddSampledSequence));
  w.I64(seq_id);
  EncodeSequenceSampling(sampling, &w);
  return RoundTrip(w.data(), step_timeout_, nullptr);
}

absl::Status LocalGroup::ForwardSampled(std::span<const SequenceTokens> batch,
                                        std::span<const uint8_t> sample,
                                        std::vector<SampledToken>* tokens) {
  if (sample.size() != batch.size()) {
    return absl::InvalidArgumentError("sampled forward: one sample flag per batch entry");
  }
  EXL3_RETURN_IF_ERROR(CheckAllowedTokens(batch, sample, {}, vocab_size_));
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kForwardSampled));
  w.U32(static_cast<uint32_t>(batch.size()));
  for (size_t i = 0; i < batch.size(); ++i) {
    WriteEntry(batch[i], &w);
    w.U8(sample[i]);
    w.U32s(batch[i].allowed_tokens.data(), batch[i].allowed_tokens.size());
  }
  std::string body;
  EXL3_RETURN_IF_ERROR(RoundTrip(w.data(), step_timeout_, &body));
  WireReader in(body);
  absl::Status s = DecodeSampledTokens(&in, tokens);
  if (s.ok()) s = in.Finish("rank 0 sampled tokens");
  if (s.ok() && tokens->size() != batch.size()) {
    s = absl::InvalidArgumentError("rank 0 answered for another batch size");
  }
  if (!s.ok()) return Break(absl::DataLossError(s.message()));
  return absl::OkStatus();
}

absl::Status LocalGroup::ForwardVerified(std::span<const SequenceTokens> batch,
                                         std::span<const uint8_t> sample,
                                         std::span<const int32_t> draft_counts,
                                         std::vector<std::vector<SampledToken>>* runs) {
  EXL3_RETURN_IF_ERROR(CheckDraftCounts(batch, sample, draft_counts));
  EXL3_RETURN_IF_ERROR(CheckAllowedTokens(batch, sample, draft_counts, vocab_size_));
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kForwardVerified));
  w.U32(static_cast<uint32_t>(batch.size()));
  for (size_t i = 0; i < batch.size(); ++i) {
    WriteEntry(batch[i], &w);
    w.U8(sample[i]);
    w.I32(draft_counts[i]);
    w.U32s(batch[i].allowed_tokens.data(), batch[i].allowed_tokens.size());
  }
  std::string body;
  EXL3_RETURN_IF_ERROR(RoundTrip(w.data(), step_timeout_, &body));
  WireReader in(body);
  std::vector<std::vector<SampledToken>> received;
  absl::Status s = DecodeSampledRuns(&in, &received);
  if (s.ok()) s = in.Finish("rank 0 verified runs");
  if (s.ok()) s = CheckVerifiedRuns(batch, sample, draft_counts, vocab_size_, received);
  if (!s.ok()) return Break(absl::DataLossError(s.message()));
  *runs = std::move(received);
  return absl::OkStatus();
}

void LocalGroup::WriteEntry(const SequenceTokens& entry, WireWriter* w) {
  w->I64(entry.seq_id);
  w->I32s(entry.tokens.data(), entry.tokens.size());
  auto staged = staged_pages_.find(entry.seq_id);
  if (staged == staged_pages_.end()) {
    w->I32s(nullptr, 0);
  } else {
    w->I32s(staged->second.data(), staged->second.size());
    staged_pages_.erase(staged);
  }
}

absl::Status LocalGroup::SaveKvBlocks(std::span<const KvBlockTransfer> saves) {
  if (options_.kv_disk_slots <= 0) return StepExecutor::SaveKvBlocks(saves);
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kSaveKvBlocks));
  EncodeKvBlockTransfers(saves, &w);
  return RoundTrip(w.data(), step_timeout_, nullptr);
}

absl::Status LocalGroup::SaveStateSnapshots(std::span<const StateSnapshotSave> saves) {
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kSaveStateSnapshots));
  EncodeStateSnapshotSaves(saves, &w);
  return RoundTrip(w.data(), step_timeout_, nullptr);
}

absl::Status LocalGroup::LoadKvBlocks(std::span<const KvBlockTransfer> loads,
                                      std::vector<uint8_t>* loaded) {
  if (options_.kv_disk_slots <= 0) return StepExecutor::LoadKvBlocks(loads, loaded);
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kLoadKvBlocks));
  EncodeKvBlockTransfers(loads, &w);
  std::string body;
  EXL3_RETURN_IF_ERROR(RoundTrip(w.data(), step_timeout_, &body));
  WireReader in(body);
  const uint32_t n = in.U32();
  loaded->resize(n);
  for (uint8_t& flag : *loaded) flag = in.U8();
  absl::Status s = in.Finish("rank 0 loaded flags");
  if (s.ok() && loaded->size() != loads.size()) {
    s = absl::InvalidArgumentError("rank 0 answered for another number of loads");
  }
  if (!s.ok()) return Break(absl::DataLossError(s.message()));
  return absl::OkStatus();
}

absl::Status LocalGroup::AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) {
  if (!broken_.ok()) return broken_;
  std::vector<int32_t>& staged = staged_pages_[seq_id];
  staged.insert(staged.end(), page_ids.begin(), page_ids.end());
  return absl::OkStatus();
}

absl::Status LocalGroup::RemoveSequence(int64_t seq_id) {
  staged_pages_.erase(seq_id);
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kRemoveSequence));
  w.I64(seq_id);
  return RoundTrip(w.data(), step_timeout_, nullptr);
}

absl::Status LocalGroup::Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                                 std::vector<float>* logits) {
  WireWriter w;
  w.U8(static_cast<uint8_t>(ControlOp::kForward));
  w.U8(rows == LogitsRows::kLastToken ? 0 : 1);
  w.U32(static_cast<uint32_t>(batch.size()));
  for (const SequenceTokens& entry : batch) WriteEntry(entry, &w);
  std::string body;
  EXL3_RETURN_IF_ERROR(RoundTrip(w.data(), step_timeout_, &body));
  WireReader in(body);
  *logits = in.F32s();
  if (absl::Status s = in.Finish("rank 0 logits"); !s.ok()) return Break(absl::DataLossError(s.message()));
  return absl::OkStatus();
}

absl::Status LocalGroup::Recover(absl::Time deadline) {
  Shutdown(absl::Seconds(2));
  LocalGroupOptions options = options_;
  options.comm.shm_name.clear();  // a fresh segment for the new group
  options.load_timeout = std::max(absl::Seconds(1), deadline - absl::Now());
  absl::StatusOr<std::unique_ptr<LocalGroup>> fresh = Start(options);
  if (!fresh.ok()) return fresh.status();
  LocalGroup& g = **fresh;
  ranks_ = std::move(g.ranks_);
  shm_name_ = std::move(g.shm_name_);
  vocab_size_ = g.vocab_size_;
  broken_ = absl::OkStatus();
  shut_down_ = false;
  staged_pages_.clear();
  g.ranks_.clear();
  g.shut_down_ = true;  // its ranks are ours now
  Publish();
  EXL3_LOG(kInfo) << "rank group re-formed with " << ranks_.size() << " new rank processes";
  return absl::OkStatus();
}

void LocalGroup::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  Publish();  // every rank down before any is reaped (its pid may be reused)
  if (broken_.ok()) {
    WireWriter w;
    w.U8(static_cast<uint8_t>(ControlOp::kShutdown));
    (void)RoundTrip(w.data(), grace, nullptr);
  }
  for (Rank& rank : ranks_) {
    if (rank.fd >= 0) close(rank.fd);  // a rank still reading sees end of file and exits
    rank.fd = -1;
  }
  const absl::Time deadline = absl::Now() + grace;
  for (Rank& rank : ranks_) {
    if (rank.pid <= 0 || rank.exited) continue;
    int status = 0;
    if (WaitChild(rank.pid, std::max(absl::ZeroDuration(), deadline - absl::Now()), &status)) {
      rank.exited = true;
      continue;
    }
    EXL3_LOG(kWarning) << "rank pid " << rank.pid << " did not exit; killing it";
    kill(rank.pid, SIGKILL);
    waitpid(rank.pid, &status, 0);
    rank.exited = true;
  }
  if (!shm_name_.empty()) shm_unlink(shm_name_.c_str());  // in case start-up failed early
}

}  // namespace exl3serve::worker::rank
