#include "coordinator/rank_group.h"

#include <unistd.h>

#include <algorithm>
#include <deque>
#include <fstream>
#include <iterator>
#include <string_view>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/grpc_server.h"
#include "exl3serve/rank/v1/rank.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "worker/api/verified_forward.h"
#include "worker/rank/executor_factory.h"

namespace exl3serve::coordinator {
namespace {

namespace pb = ::exl3serve::rank::v1;

static_assert(kCoordinatorRankProtocolVersion == pb::RANK_PROTOCOL_CURRENT,
              "rank_group.h and rank.proto disagree on the protocol version");

int KvBits(worker::KvCacheDtype dtype) {
  switch (dtype) {
    case worker::KvCacheDtype::kFp32:
      return 32;
    case worker::KvCacheDtype::kFp16:
      return 16;
    case worker::KvCacheDtype::kInt8:
      return 8;
    case worker::KvCacheDtype::kInt4:
      return 4;
  }
  return 16;
}

// A token of StepResult.tokens / runs (top logprobs: the pairs both lists have).
worker::SampledToken FromProto(const pb::SampledTokenResult& t) {
  worker::SampledToken out;
  out.id = t.token_id();
  out.logprob = t.logprob();
  const int tops = std::min(t.top_ids_size(), t.top_logprobs_size());
  for (int k = 0; k < tops; ++k) out.top_logprobs.push_back({t.top_ids(k), t.top_logprobs(k)});
  return out;
}

pb::GemmPrecision ToProto(kernels::TrellisGemmPrecision precision) {
  switch (precision) {
    case kernels::TrellisGemmPrecision::kFloat:
      return pb::GEMM_PRECISION_FP32;
    case kernels::TrellisGemmPrecision::kBf16:
      return pb::GEMM_PRECISION_BF16;
    case kernels::TrellisGemmPrecision::kInt8:
      return pb::GEMM_PRECISION_INT8;
  }
  return pb::GEMM_PRECISION_UNSPECIFIED;
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " ", path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is empty"));
  return text;
}

// Equal iff a == b, in a time that depends on the lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

absl::Status FromProto(const pb::RankStatus& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.code()), status.message());
}

class RankReactor;

// One rank's stream, shared by its reactor and the group. Outgoing messages
// are queued (Enqueue, under the group's lock or not) and written by Flush(),
// which must be called with no lock of ours held: gRPC operations are never
// started under a lock, so a reaction run inline cannot deadlock.
// Invariants: at most one write in flight; Finish is called exactly once, when
// a close was requested and no write is in flight; nothing is started after
// Finish (so the reactor, deleted in OnDone, is never touched after it).
class Conn {
 public:
  Conn(RankReactor* reactor, std::string peer) : reactor_(reactor), peer_(std::move(peer)) {}
  const std::string& peer() const { return peer_; }

  void Enqueue(pb::CoordinatorMessage message) {
    absl::MutexLock lock(&mu_);
    if (close_requested_) return;
    queue_.push_back(std::move(message));
  }
  // Ends the stream with `status` once the queued messages are written.
  void RequestClose(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (close_requested_) return;
    close_requested_ = true;
    close_status_ = status;
  }
  void Flush();
  // The reactor's write finished; starts the next one or finishes.
  void OnWriteDone(bool ok);

  // The rank slot this stream holds, -1 before Register. Guarded by the
  // group's mutex (only the group reads or writes it).
  int rank = -1;

 private:
  RankReactor* const reactor_;
  const std::string peer_;
  absl::Mutex mu_;
  std::deque<pb::CoordinatorMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool close_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status close_status_ ABSL_GUARDED_BY(mu_);
};

// Flushes the streams it collected when it goes out of scope; declare it
// before the MutexLock so that the lock is released first.
// Also runs the state-change hook (RankGroupOptions::on_change) when one was
// noted, after the flushes, with no lock held either.
class Outbox {
 public:
  ~Outbox() {
    for (const std::shared_ptr<Conn>& conn : conns_) conn->Flush();
    if (on_change_ != nullptr && *on_change_) (*on_change_)();
  }
  void Add(std::shared_ptr<Conn> conn) { conns_.push_back(std::move(conn)); }
  // The group's state changed: run `hook` (borrowed) on the way out.
  void StateChanged(const std::function<void()>* hook) { on_change_ = hook; }

 private:
  std::vector<std::shared_ptr<Conn>> conns_;
  const std::function<void()>* on_change_ = nullptr;
};

}  // namespace

// The membership state and the step fan-out.
class RemoteRankGroup::Impl {
 public:
  explicit Impl(const RankGroupOptions& options)
      : options_(options), members_(options.world_size) {}

  const RankGroupOptions options_;

  void OnMessage(const std::shared_ptr<Conn>& conn, const pb::RankMessage& message);
  void OnStreamEnded(const std::shared_ptr<Conn>& conn);
  void Monitor();
  absl::Status RunStep(pb::Step step, std::vector<float>* logits,
                       std::vector<worker::SampledToken>* tokens = nullptr,
                       std::string* kv_blocks_loaded = nullptr,
                       std::vector<std::vector<worker::SampledToken>>* runs = nullptr);
  absl::Status WaitReady(absl::Time deadline) const;
  RankGroupStatus Status() const;
  void Shutdown(const std::string& reason);
  void StartMonitor() { monitor_ = std::thread([this] { Monitor(); }); }
  void JoinMonitor() {
    if (monitor_.joinable()) monitor_.join();
  }
  bool ready() const {
    absl::MutexLock lock(&mu_);
    return state_ == GroupState::kReady;
  }
  uint64_t generation() const {
    absl::MutexLock lock(&mu_);
    return generation_;
  }
  uint64_t result_bytes() const {
    absl::MutexLock lock(&mu_);
    return result_bytes_;
  }
  int64_t vocab_size() const {
    absl::MutexLock lock(&mu_);
    return vocab_size_;
  }
  void AddConn(const std::shared_ptr<Conn>& conn) {
    absl::MutexLock lock(&mu_);
    conns_.push_back(conn);
  }

  // Set once by Start: the service (outlives the server) and the server.
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

 private:
  struct Member {
    std::shared_ptr<Conn> conn;
    std::string host;
    int64_t pid = 0;
    absl::Time last_heartbeat;
    bool loaded = false;
    uint64_t bytes_read = 0;  // Ready.bytes_read
  };
  struct PendingStep {
    uint64_t step_id = 0;
    std::vector<bool> answered;
    std::vector<absl::Status> statuses;
    int remaining = 0;
    std::vector<float> logits;
    std::vector<worker::SampledToken> tokens;  // rank 0's, sampled forwards
    std::vector<std::vector<worker::SampledToken>> runs;  // rank 0's, verified forwards
    std::string kv_blocks_loaded;              // rank 0's, load_kv_blocks
  };

  std::string Describe(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NotReadyMessage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refuse(const std::shared_ptr<Conn>& conn, Outbox& out, grpc::StatusCode code,
              const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartGroup(Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Teardown(const std::string& reason, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckLiveness(Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  mutable absl::CondVar changed_;  // signalled on every state change below
  GroupState state_ ABSL_GUARDED_BY(mu_) = GroupState::kForming;
  std::vector<std::optional<Member>> members_ ABSL_GUARDED_BY(mu_);  // by rank
  std::vector<std::shared_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);    // every open stream
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t teardowns_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time loading_since_ ABSL_GUARDED_BY(mu_);
  int64_t vocab_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::optional<PendingStep> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_step_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The caller's view: the sequences it added (and did not remove) and the
  // generation they live in. A step while they are non-empty and the group
  // has moved to another generation fails Aborted (replay needed).
  absl::flat_hash_set<int64_t> session_seqs_ ABSL_GUARDED_BY(mu_);
  uint64_t result_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // rank 0's step results
  uint64_t session_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread monitor_;

 public:
  // Caller (step) thread only: AssignPages not yet sent, per sequence.
  absl::flat_hash_map<int64_t, std::vector<int32_t>> staged_pages_;
  // Appends `entry` to `forward` with its staged pages (which count as sent
  // from here on: the ranks hold them now, or refuse them).
  pb::SequenceTokens* AddEntry(const worker::SequenceTokens& entry, pb::ForwardBatch* forward) {
    pb::SequenceTokens* seq = forward->add_sequences();
    seq->set_seq_id(entry.seq_id);
    seq->mutable_token_ids()->Assign(entry.tokens.begin(), entry.tokens.end());
    auto staged = staged_pages_.find(entry.seq_id);
    if (staged != staged_pages_.end()) {
      seq->mutable_block_ids()->Assign(staged->second.begin(), staged->second.end());
      staged_pages_.erase(staged);
    }
    return seq;
  }
  // After a successful WaitReady in Recover: the caller starts afresh.
  void ForgetSession() {
    absl::MutexLock lock(&mu_);
    session_seqs_.clear();
    session_generation_ = generation_;
    staged_pages_.clear();
  }
};

namespace {

class RankReactor final : public grpc::ServerBidiReactor<pb::RankMessage, pb::CoordinatorMessage> {
 public:
  RankReactor(RemoteRankGroup::Impl* group, std::string peer)
      : group_(group), conn_(std::make_shared<Conn>(this, std::move(peer))) {
    group_->AddConn(conn_);
    StartRead(&in_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      group_->OnStreamEnded(conn_);
      conn_->RequestClose(grpc::Status::OK);
      conn_->Flush();
      return;
    }
    group_->OnMessage(conn_, in_);
    // Safe even when the stream is finishing: this read's reference keeps
    // the call alive until we return; a read on a finished call fails.
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override { conn_->OnWriteDone(ok); }
  void OnDone() override { delete this; }

 private:
  RemoteRankGroup::Impl* const group_;
  const std::shared_ptr<Conn> conn_;
  pb::RankMessage in_;
};

void Conn::Flush() {
  const pb::CoordinatorMessage* next = nullptr;
  grpc::Status finish;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || write_in_flight_) return;
    if (!queue_.empty()) {
      write_in_flight_ = true;
      next = &queue_.front();  // deque elements stay put while others are added
    } else if (close_requested_) {
      finished_ = true;
      finish = close_status_;
    } else {
      return;
    }
  }
  if (next != nullptr) {
    reactor_->StartWrite(next);
  } else {
    reactor_->Finish(finish);
  }
}

void Conn::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    queue_.pop_front();
    if (!ok) {  // the stream is broken: nothing more will be delivered
      queue_.clear();
      if (!close_requested_) {
        close_requested_ = true;
        close_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream broken");
      }
    }
  }
  Flush();
}

// A Connect stream refused before any message is read (no or a wrong rank token).
class RefusedReactor final
    : public grpc::ServerBidiReactor<pb::RankMessage, pb::CoordinatorMessage> {
 public:
  explicit RefusedReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class RankControlService final : public pb::RankControl::CallbackService {
 public:
  RankControlService(RemoteRankGroup::Impl* group, std::string expected_authorization)
      : group_(group), expected_authorization_(std::move(expected_authorization)) {}
  grpc::ServerBidiReactor<pb::RankMessage, pb::CoordinatorMessage>* Connect(
      grpc::CallbackServerContext* context) override {
    if (!expected_authorization_.empty()) {
      bool ok = false;
      auto range = context->client_metadata().equal_range("authorization");
      for (auto it = range.first; it != range.second; ++it) {
        ok |= ConstantTimeEquals(std::string_view(it->second.data(), it->second.size()),
                                 expected_authorization_);
      }
      if (!ok) {
        const std::string why =
            range.first == range.second
                ? "missing rank token (metadata `authorization: Bearer <token>`; "
                  "worker --rank-token-file, config key rank_token_file)"
                : "wrong rank token (worker --rank-token-file must hold the coordinator's "
                  "rank_token_file)";
        EXL3_LOG(kWarning) << "rank connection from " << context->peer() << " refused: " << why;
        return new RefusedReactor(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, why));
      }
    }
    return new RankReactor(group_, context->peer());
  }

 private:
  RemoteRankGroup::Impl* const group_;
  const std::string expected_authorization_;  // empty: no token check
};

std::string UniqueShmName(uint64_t generation) {
  std::random_device random;
  return absl::StrCat("/exl3serve-c", getpid(), "-g", generation, "-", random() % 1000000);
}

}  // namespace

std::string RemoteRankGroup::Impl::Describe(int rank) const {
  const std::optional<Member>& m = members_[rank];
  if (!m.has_value()) return absl::StrCat("rank ", rank);
  return absl::StrCat("rank ", rank, " (", m->host, " pid ", m->pid, ")");
}

std::string RemoteRankGroup::Impl::NotReadyMessage() const {
  int registered = 0, loaded = 0;
  for (const std::optional<Member>& m : members_) {
    registered += m.has_value();
    loaded += m.has_value() && m->loaded;
  }
  std::string message =
      stopping_ ? std::string("the rank group is shut down")
                : absl::StrCat("the rank group is not ready (", GroupStateName(state_), ": ",
                               registered, " of ", options_.world_size, " ranks registered, ",
                               loaded, " loaded, generation ", generation_, ")");
  if (!last_error_.empty()) absl::StrAppend(&message, "; last failure: ", last_error_);
  return message;
}

void RemoteRankGroup::Impl::Refuse(const std::shared_ptr<Conn>& conn, Outbox& out,
                                   grpc::StatusCode code, const std::string& message) {
  EXL3_LOG(kWarning) << "rank registration from " << conn->peer() << " refused: " << message;
  conn->RequestClose(grpc::Status(code, message));
  out.Add(conn);
}

void RemoteRankGroup::Impl::OnMessage(const std::shared_ptr<Conn>& conn,
                                      const pb::RankMessage& message) {
  Outbox out;
  absl::MutexLock lock(&mu_);
  const int r = conn->rank;
  // The member this stream holds, if it still holds one.
  Member* member = (r >= 0 && members_[r].has_value() && members_[r]->conn == conn)
                       ? &*members_[r] : nullptr;
  switch (message.kind_case()) {
    case pb::RankMessage::kRegister: {
      const pb::Register& reg = message.register_();
      if (r >= 0) {
        Refuse(conn, out, grpc::StatusCode::INVALID_ARGUMENT, "register sent twice on one stream");
        return;
      }
      if (reg.protocol_version() != kCoordinatorRankProtocolVersion) {
        Refuse(conn, out, grpc::StatusCode::FAILED_PRECONDITION,
               absl::StrCat("rank protocol version mismatch: rank ", reg.rank(), " (", reg.host(),
                            " pid ", reg.pid(), ") speaks version ", reg.protocol_version(),
                            ", this coordinator speaks version ",
                            kCoordinatorRankProtocolVersion,
                            " (run the same exl3serve release on the coordinator and every rank)"));
        return;
      }
      if (reg.world_size() != 0 && reg.world_size() != options_.world_size) {
        Refuse(conn, out, grpc::StatusCode::FAILED_PRECONDITION,
               absl::StrCat("rank ", reg.rank(), " expects world size ", reg.world_size(),
                            ", the coordinator's group has ", options_.world_size,
                            " (world_size in the coordinator config)"));
        return;
      }
      if (reg.rank() < 0 || reg.rank() >= options_.world_size) {
        Refuse(conn, out, grpc::StatusCode::INVALID_ARGUMENT,
               absl::StrCat("rank must be in [0, ", options_.world_size, "), got ", reg.rank()));
        return;
      }
      if (stopping_) {
        Refuse(conn, out, grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down");
        return;
      }
      if (members_[reg.rank()].has_value() || state_ != GroupState::kForming) {
        Refuse(conn, out, grpc::StatusCode::ALREADY_EXISTS,
               absl::StrCat("rank ", reg.rank(), " is already held by ", Describe(reg.rank()),
                            "; group generation ", generation_, " is ",
                            GroupStateName(state_)));
        return;
      }
      conn->rank = reg.rank();
      Member m;
      m.conn = conn;
      m.host = reg.host();
      m.pid = reg.pid();
      m.last_heartbeat = absl::Now();
      members_[reg.rank()] = std::move(m);
      EXL3_LOG(kInfo) << "rank " << reg.rank() << " registered from " << reg.host() << " pid "
                      << reg.pid() << " (" << conn->peer() << ")";
      bool all = true;
      for (const std::optional<Member>& slot : members_) all = all && slot.has_value();
      if (all) StartGroup(out);
      changed_.SignalAll();
      return;
    }
    case pb::RankMessage::kReady: {
      if (member == nullptr || state_ != GroupState::kLoading) return;
      member->last_heartbeat = absl::Now();
      const absl::Status status = FromProto(message.ready().status());
      if (!status.ok()) {
        Teardown(absl::StrCat(Describe(r), ": loading failed: ", status.message()), out);
        return;
      }
      if (message.ready().kv_num_pages() != options_.kv.num_pages ||
          message.ready().kv_page_size_tokens() != options_.kv.page_size_tokens) {
        // The block allocator mirrors every rank's cache page for page, so
        // this rank can never serve; registering again would only repeat it.
        // Refuse it (its stream ends FAILED_PRECONDITION and the rank exits
        // with this message, --reconnect or not) and tear the group down.
        const std::string refusal = absl::StrCat(
            "KV layout mismatch: ", Describe(r), " made a KV cache of ",
            message.ready().kv_num_pages(), " pages of ", message.ready().kv_page_size_tokens(),
            " positions but the coordinator's block allocator has ", options_.kv.num_pages,
            " pages of ", options_.kv.page_size_tokens,
            " (every rank must build its cache from the coordinator's Setup.kv: run the same "
            "exl3serve release on the coordinator and every rank)");
        EXL3_LOG(kWarning) << "refusing " << Describe(r) << ": " << refusal;
        member->conn->RequestClose(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, refusal));
        out.Add(member->conn);
        members_[r].reset();  // Teardown tells only the others to shut down
        Teardown(absl::StrCat("FAILED_PRECONDITION: ", refusal), out);
        return;
      }
      member->loaded = true;
      member->bytes_read = message.ready().bytes_read();
      if (r == 0) vocab_size_ = message.ready().vocab_size();
      bool all = true;
      for (const std::optional<Member>& slot : members_) all = all && slot.has_value() && slot->loaded;
      if (all) {
        state_ = GroupState::kReady;
        out.StateChanged(&options_.on_change);
        EXL3_LOG(kInfo) << "rank group generation " << generation_ << " ready ("
                        << options_.world_size << " ranks)";
      }
      changed_.SignalAll();
      return;
    }
    case pb::RankMessage::kHeartbeat:
      if (member != nullptr) member->last_heartbeat = absl::Now();
      return;
    case pb::RankMessage::kStepResult: {
      if (member == nullptr) return;
      member->last_heartbeat = absl::Now();
      const pb::StepResult& result = message.step_result();
      if (!pending_.has_value() || pending_->step_id != result.step_id() || pending_->answered[r]) {
        return;
      }
      pending_->answered[r] = true;
      pending_->statuses[r] = FromProto(result.status());
      if (r == 0) {
        result_bytes_ += result.ByteSizeLong();
        pending_->logits.assign(result.logits().begin(), result.logits().end());
        pending_->kv_blocks_loaded = result.kv_blocks_loaded();
        pending_->tokens.clear();
        for (const pb::SampledTokenResult& t : result.tokens()) {
          pending_->tokens.push_back(FromProto(t));
        }
        pending_->runs.assign(result.runs_size(), {});
        for (int i = 0; i < result.runs_size(); ++i) {
          for (const pb::SampledTokenResult& t : result.runs(i).tokens()) {
            pending_->runs[i].push_back(FromProto(t));
          }
        }
      }
      --pending_->remaining;
      changed_.SignalAll();
      return;
    }
    default:
      return;
  }
}

void RemoteRankGroup::Impl::OnStreamEnded(const std::shared_ptr<Conn>& conn) {
  Outbox out;
  absl::MutexLock lock(&mu_);
  for (auto it = conns_.begin(); it != conns_.end(); ++it) {
    if (*it == conn) {
      conns_.erase(it);
      break;
    }
  }
  const int r = conn->rank;
  if (r < 0 || !members_[r].has_value() || members_[r]->conn != conn) return;
  if (state_ == GroupState::kForming) {  // no group yet: just free the slot
    EXL3_LOG(kInfo) << Describe(r) << " left before the group formed";
    members_[r].reset();
    changed_.SignalAll();
    return;
  }
  Teardown(absl::StrCat(Describe(r), " disconnected (its stream ended)"), out);
}

void RemoteRankGroup::Impl::StartGroup(Outbox& out) {
  ++generation_;
  state_ = GroupState::kLoading;
  out.StateChanged(&options_.on_change);
  loading_since_ = absl::Now();
  pb::CoordinatorMessage message;
  pb::Setup* setup = message.mutable_setup();
  setup->set_protocol_version(kCoordinatorRankProtocolVersion);
  setup->set_group_generation(generation_);
  setup->set_model_dir(options_.model_dir);
  setup->set_world_size(options_.world_size);
  setup->set_expert_parallel(options_.expert_parallel);
  setup->mutable_capacities()->Add(options_.capacities.begin(), options_.capacities.end());
  setup->set_prefill_precision(ToProto(options_.prefill_precision));
  setup->set_decode_precision(ToProto(options_.decode_precision));
  pb::CommSettings* comm = setup->mutable_comm();
  comm->set_backend(options_.comm.backend);
  comm->set_shm_name(options_.comm.backend == "shm" && options_.comm.shm_name.empty()
                         ? UniqueShmName(generation_)
                         : options_.comm.shm_name);
  comm->set_bootstrap_address(options_.comm.bootstrap_address);
  comm->set_ucx_tls(options_.comm.ucx_tls);
  setup->mutable_kv()->set_dtype_bits(KvBits(options_.kv.dtype));
  setup->mutable_kv()->set_num_pages(options_.kv.num_pages);
  setup->mutable_kv()->set_page_size_tokens(options_.kv.page_size_tokens);
  setup->mutable_kv()->set_disk_path(options_.kv_disk_path);
  setup->mutable_kv()->set_disk_blocks(options_.kv_disk_slots);
  setup->set_threads(options_.threads_per_rank);
  setup->set_join_timeout_ms(absl::ToInt64Milliseconds(options_.join_timeout));
  setup->set_collective_timeout_ms(absl::ToInt64Milliseconds(options_.collective_timeout));
  setup->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  if (options_.spill.has_value()) {
    const sharding::SpillPolicy& policy = *options_.spill;
    pb::SpillSettings* spill = setup->mutable_spill();
    for (const std::string& tensor : policy.spill) spill->add_tensors(tensor);
    spill->set_threshold_bytes(policy.auto_threshold_bytes);
    spill->set_memory_budget_bytes(policy.memory_budget_bytes);
    spill->set_cache_bytes(policy.cache_budget_bytes);
    spill->set_cache_dir(policy.cache_dir);
    spill->set_extract(policy.extract);
  }
  EXL3_LOG(kInfo) << "rank group generation " << generation_ << ": all " << options_.world_size
                  << " ranks registered, sending setup";
  for (std::optional<Member>& m : members_) {
    m->last_heartbeat = absl::Now();
    m->conn->Enqueue(message);
    out.Add(m->conn);
  }
}

void RemoteRankGroup::Impl::Teardown(const std::string& reason, Outbox& out) {
  EXL3_LOG(kWarning) << "rank group generation " << generation_ << " torn down: " << reason;
  pb::CoordinatorMessage message;
  message.mutable_shutdown()->set_reason(reason);
  for (std::optional<Member>& m : members_) {
    if (!m.has_value()) continue;
    m->conn->Enqueue(message);
    m->conn->RequestClose(grpc::Status::OK);
    out.Add(m->conn);
    m.reset();
  }
  if (stopping_) {  // also the streams that never registered
    for (const std::shared_ptr<Conn>& conn : conns_) {
      conn->RequestClose(grpc::Status(grpc::StatusCode::UNAVAILABLE, reason));
      out.Add(conn);
    }
  }
  state_ = stopping_ ? GroupState::kStopped : GroupState::kForming;
  out.StateChanged(&options_.on_change);
  last_error_ = reason;
  ++teardowns_;
  changed_.SignalAll();
}

void RemoteRankGroup::Impl::CheckLiveness(Outbox& out) {
  if (state_ == GroupState::kStopped) return;
  const absl::Time now = absl::Now();
  for (int r = 0; r < options_.world_size; ++r) {
    const std::optional<Member>& m = members_[r];
    if (!m.has_value()) continue;
    const absl::Duration age = now - m->last_heartbeat;
    if (age > options_.heartbeat_timeout) {
      const std::string reason = absl::StrCat(
          Describe(r), " sent no heartbeat for ", absl::FormatDuration(age),
          " (heartbeat_timeout ", absl::FormatDuration(options_.heartbeat_timeout), ")");
      if (state_ == GroupState::kForming) {
        EXL3_LOG(kWarning) << reason << "; freeing its slot";
        m->conn->RequestClose(grpc::Status(grpc::StatusCode::UNAVAILABLE, reason));
        out.Add(m->conn);
        members_[r].reset();
        changed_.SignalAll();
      } else {
        Teardown(reason, out);
        return;
      }
    }
  }
  if (state_ == GroupState::kLoading && now - loading_since_ > options_.load_timeout) {
    std::vector<std::string> missing;
    for (int r = 0; r < options_.world_size; ++r) {
      if (members_[r].has_value() && !members_[r]->loaded) missing.push_back(Describe(r));
    }
    Teardown(absl::StrCat(absl::StrJoin(missing, ", "), " did not report ready within ",
                          absl::FormatDuration(options_.load_timeout), " (load_timeout)"),
             out);
  }
}

void RemoteRankGroup::Impl::Monitor() {
  // Checks a few times per heartbeat timeout; a timed wait on the stop flag.
  const absl::Duration period = std::clamp(options_.heartbeat_timeout / 4,
                                           absl::Milliseconds(20), absl::Seconds(1));
  while (true) {
    Outbox out;
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    changed_.WaitWithTimeout(&mu_, period);
    if (stopping_) return;
    CheckLiveness(out);
  }
}

absl::Status RemoteRankGroup::Impl::RunStep(pb::Step step, std::vector<float>* logits,
                                            std::vector<worker::SampledToken>* tokens,
                                            std::string* kv_blocks_loaded,
                                            std::vector<std::vector<worker::SampledToken>>* runs) {
  uint64_t epoch = 0, id = 0;
  {
    Outbox out;
    absl::MutexLock lock(&mu_);
    if (state_ != GroupState::kReady) return absl::UnavailableError(NotReadyMessage());
    if (pending_.has_value()) {
      return absl::FailedPreconditionError("rank group: a step is already in flight");
    }
    if (!session_seqs_.empty() && session_generation_ != generation_) {
      return absl::AbortedError(absl::StrCat(
          "the rank group re-formed (generation ", session_generation_, " -> ", generation_,
          ") since the caller's ", session_seqs_.size(),
          " sequences were added: they are gone, replay them"));
    }
    session_generation_ = generation_;
    if (step.has_add_sequence()) session_seqs_.insert(step.add_sequence().seq_id());
    if (step.has_remove_sequence()) session_seqs_.erase(step.remove_sequence().seq_id());
    id = ++next_step_id_;
    step.set_step_id(id);
    step.set_group_generation(generation_);
    PendingStep pending;
    pending.step_id = id;
    pending.answered.assign(options_.world_size, false);
    pending.statuses.resize(options_.world_size);
    pending.remaining = options_.world_size;
    pending_ = std::move(pending);
    epoch = teardowns_;
    pb::CoordinatorMessage message;
    *message.mutable_step() = std::move(step);
    for (std::optional<Member>& m : members_) {
      m->conn->Enqueue(message);
      out.Add(m->conn);
    }
  }
  Outbox out;
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  while (pending_->remaining > 0 && teardowns_ == epoch) {
    if (changed_.WaitWithDeadline(&mu_, deadline)) break;
  }
  PendingStep done = std::move(*pending_);
  pending_.reset();
  if (teardowns_ != epoch) {
    return absl::UnavailableError(
        absl::StrCat("step ", id, " failed: the rank group broke: ", last_error_));
  }
  if (done.remaining > 0) {
    std::vector<std::string> silent;
    for (int r = 0; r < options_.world_size; ++r) {
      if (!done.answered[r]) silent.push_back(Describe(r));
    }
    const std::string reason =
        absl::StrCat(absl::StrJoin(silent, ", "), " did not answer step ", id, " within ",
                     absl::FormatDuration(options_.step_timeout), " (step_timeout)");
    Teardown(reason, out);
    return absl::UnavailableError(reason);
  }
  for (int r = 0; r < options_.world_size; ++r) {
    if (!done.statuses[r].ok()) {
      return absl::Status(done.statuses[r].code(),
                          absl::StrCat("rank ", r, ": ", done.statuses[r].message()));
    }
  }
  if (logits != nullptr) *logits = std::move(done.logits);
  if (tokens != nullptr) *tokens = std::move(done.tokens);
  if (kv_blocks_loaded != nullptr) *kv_blocks_loaded = std::move(done.kv_blocks_loaded);
  if (runs != nullptr) *runs = std::move(done.runs);
  return absl::OkStatus();
}

absl::Status RemoteRankGroup::Impl::WaitReady(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  while (state_ != GroupState::kReady && !stopping_) {
    if (changed_.WaitWithDeadline(&mu_, deadline)) break;
  }
  if (stopping_) return absl::CancelledError("the rank group is shut down");
  if (state_ == GroupState::kReady) return absl::OkStatus();
  return absl::UnavailableError(NotReadyMessage());
}

RankGroupStatus RemoteRankGroup::Impl::Status() const {
  absl::MutexLock lock(&mu_);
  RankGroupStatus status;
  status.state = state_;
  status.generation = generation_;
  status.world_size = options_.world_size;
  status.last_error = last_error_;
  const absl::Time now = absl::Now();
  for (int r = 0; r < options_.world_size; ++r) {
    RankSlotInfo info;
    info.rank = r;
    if (const std::optional<Member>& m = members_[r]; m.has_value()) {
      info.up = true;
      info.loaded = m->loaded;
      info.bytes_read = m->bytes_read;
      info.address = absl::StrCat(m->host, " pid ", m->pid, " (", m->conn->peer(), ")");
      info.last_heartbeat_age = now - m->last_heartbeat;
    }
    status.ranks.push_back(std::move(info));
  }
  return status;
}

void RemoteRankGroup::Impl::Shutdown(const std::string& reason) {
  Outbox out;
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  stopping_ = true;
  Teardown(reason, out);
}

// ---------------------------------------------------------------- RemoteRankGroup

const char* GroupStateName(GroupState state) {
  switch (state) {
    case GroupState::kForming:
      return "forming";
    case GroupState::kLoading:
      return "loading";
    case GroupState::kReady:
      return "ready";
    case GroupState::kStopped:
      return "stopped";
  }
  return "unknown";
}

RemoteRankGroup::RemoteRankGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<RemoteRankGroup>> RemoteRankGroup::Start(
    const RankGroupOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be >= 1, got ", options.world_size));
  }
  if (options.model_dir.empty()) return absl::InvalidArgumentError("model_dir is empty");
  EXL3_RETURN_IF_ERROR(worker::rank::CheckCapacities(options.capacities, options.world_size));
  if (options.comm.backend != "shm" && options.comm.backend != "ucx") {
    return absl::InvalidArgumentError(
        absl::StrCat("comm.backend must be shm or ucx, got \"", options.comm.backend, "\""));
  }
  if (options.comm.backend == "ucx" && options.comm.bootstrap_address.empty()) {
    return absl::InvalidArgumentError("comm.bootstrap_address (host:port) is needed for ucx");
  }
  if (options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_timeout (", absl::FormatDuration(options.heartbeat_timeout),
        ") must exceed heartbeat_interval (", absl::FormatDuration(options.heartbeat_interval),
        ")"));
  }
  const RankEndpointSecurity& security = options.security;
  EXL3_RETURN_IF_ERROR(CheckRankListenPolicy(options.listen_address, security,
                                             "RankGroupOptions::security"));
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (security.tls()) {
    if (security.cert_file.empty() || security.key_file.empty()) {
      return absl::InvalidArgumentError(
          "rank endpoint TLS needs both a certificate and its private key");
    }
    EXL3_ASSIGN_OR_RETURN(std::string cert,
                          ReadPem(security.cert_file, "the rank endpoint's TLS certificate"));
    EXL3_ASSIGN_OR_RETURN(std::string key,
                          ReadPem(security.key_file, "the rank endpoint's TLS private key"));
    grpc::SslServerCredentialsOptions ssl(
        security.client_ca_file.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    if (!security.client_ca_file.empty()) {
      EXL3_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                            ReadPem(security.client_ca_file, "the ranks' client CA"));
    }
    ssl.pem_key_cert_pairs.push_back({key, cert});
    credentials = grpc::SslServerCredentials(ssl);
  } else if (!security.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "a rank client CA (mutual TLS) needs TLS on the rank endpoint: a certificate and key");
  }
  std::string expected_authorization;
  if (!security.token_file.empty()) {
    EXL3_ASSIGN_OR_RETURN(std::string token, ReadPem(security.token_file, "the rank token file"));
    token = std::string(absl::StripAsciiWhitespace(token));
    if (token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the rank token file ", security.token_file, " holds only whitespace"));
    }
    expected_authorization = absl::StrCat("Bearer ", token);
  }
  auto impl = std::make_unique<Impl>(options);
  auto service = std::make_unique<RankControlService>(impl.get(), expected_authorization);
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second coordinator on a busy port must fail, not share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen_address, credentials, &impl->port_);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  // Ranks ping every 10 s (rank_client.cc); allow it without calls in flight.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.RegisterService(service.get());
  impl->server_ = builder.BuildAndStart();
  if (impl->server_ == nullptr || impl->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for ranks on ",
                                               options.listen_address, " (listen_address)"));
  }
  impl->service_ = std::move(service);
  impl->StartMonitor();
  EXL3_LOG(kInfo) << "rank endpoint listening on port " << impl->port_ << " for "
                  << options.world_size << " ranks ("
                  << (security.tls() ? (security.client_ca_file.empty() ? "TLS" : "mutual TLS")
                                     : "plaintext")
                  << (security.token_file.empty() ? "" : ", rank token") << ")";
  return std::unique_ptr<RemoteRankGroup>(new RemoteRankGroup(std::move(impl)));
}

RemoteRankGroup::~RemoteRankGroup() {
  impl_->Shutdown("the coordinator is shutting down");
  impl_->JoinMonitor();
  // Streams still open are cancelled after the grace period; the reactors
  // finish (they need impl_, alive until Wait returns).
  impl_->server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  impl_->server_->Wait();
}

int RemoteRankGroup::port() const { return impl_->port_; }
const RankGroupOptions& RemoteRankGroup::options() const { return impl_->options_; }
int64_t RemoteRankGroup::vocab_size() const { return impl_->vocab_size(); }
bool RemoteRankGroup::ready() const { return impl_->ready(); }
uint64_t RemoteRankGroup::generation() const { return impl_->generation(); }
absl::Status RemoteRankGroup::WaitReady(absl::Time deadline) const {
  return impl_->WaitReady(deadline);
}
RankGroupStatus RemoteRankGroup::status() const { return impl_->Status(); }
void RemoteRankGroup::Shutdown(const std::string& reason) { impl_->Shutdown(reason); }

absl::Status RemoteRankGroup::AddSequence(int64_t seq_id) {
  pb::Step step;
  step.mutable_add_sequence()->set_seq_id(seq_id);
  return impl_->RunStep(std::move(step), nullptr);
}

uint64_t RemoteRankGroup::result_bytes_received() const {
  return impl_->result_bytes();
}

absl::Status RemoteRankGroup::AddSampledSequence(int64_t seq_id,
                                                 const worker::SequenceSampling& sampling) {
  pb::Step step;
  pb::AddSequence* add = step.mutable_add_sequence();
  add->set_seq_id(seq_id);
  pb::SamplingSpec* spec = add->mutable_sampling();
  const worker::SamplingParams& p = sampling.params;
  spec->set_temperature(p.temperature);
  spec->set_top_k(p.top_k);
  spec->set_top_p(p.top_p);
  spec->set_min_p(p.min_p);
  spec->set_repetition_penalty(p.repetition_penalty);
  spec->set_presence_penalty(p.presence_penalty);
  spec->set_frequency_penalty(p.frequency_penalty);
  spec->set_seed(p.seed.value_or(0));
  spec->set_logprobs(p.logprobs);
  spec->set_top_logprobs(p.top_logprobs);
  spec->set_prompt_len(sampling.prompt_len);
  for (const auto& [id, bias] : p.logit_bias) (*spec->mutable_logit_bias())[id] += bias;
  add->mutable_cached_prefix_ids()->Add(sampling.cached_prefix.begin(),
                                        sampling.cached_prefix.end());
  if (sampling.cached_state_slot >= 0) {
    pb::StateSnapshotRef* state = add->mutable_cached_state();
    state->set_slot(sampling.cached_state_slot);
    state->set_hash_hi(sampling.cached_state_hash_hi);
    state->set_hash_lo(sampling.cached_state_hash_lo);
  }
  return impl_->RunStep(std::move(step), nullptr);
}

absl::Status RemoteRankGroup::ForwardSampled(std::span<const worker::SequenceTokens> batch,
                                             std::span<const uint8_t> sample,
                                             std::vector<worker::SampledToken>* tokens) {
  if (sample.size() != batch.size()) {
    return absl::InvalidArgumentError("sampled forward: one sample flag per batch entry");
  }
  EXL3_RETURN_IF_ERROR(worker::CheckAllowedTokens(batch, sample, {}, vocab_size()));
  pb::Step step;
  pb::ForwardBatch* forward = step.mutable_forward();
  forward->set_rows(pb::LOGITS_ROWS_LAST_TOKEN);
  forward->set_sampled(true);
  for (size_t i = 0; i < batch.size(); ++i) {
    pb::SequenceTokens* seq = impl_->AddEntry(batch[i], forward);
    seq->set_sample(sample[i] != 0);
    seq->mutable_allowed_tokens()->Assign(batch[i].allowed_tokens.begin(),
                                          batch[i].allowed_tokens.end());
  }
  std::vector<worker::SampledToken> received;
  EXL3_RETURN_IF_ERROR(impl_->RunStep(std::move(step), nullptr, &received));
  if (received.size() != batch.size()) {
    return absl::DataLossError(absl::StrCat("rank 0 returned ", received.size(),
                                            " sampled tokens for a batch of ", batch.size()));
  }
  *tokens = std::move(received);
  return absl::OkStatus();
}

absl::Status RemoteRankGroup::ForwardVerified(std::span<const worker::SequenceTokens> batch,
                                              std::span<const uint8_t> sample,
                                              std::span<const int32_t> draft_counts,
                                              std::vector<std::vector<worker::SampledToken>>* runs) {
  EXL3_RETURN_IF_ERROR(worker::CheckDraftCounts(batch, sample, draft_counts));
  EXL3_RETURN_IF_ERROR(worker::CheckAllowedTokens(batch, sample, draft_counts, vocab_size()));
  pb::Step step;
  pb::ForwardBatch* forward = step.mutable_forward();
  forward->set_rows(pb::LOGITS_ROWS_LAST_TOKEN);
  forward->set_sampled(true);
  forward->set_verified(true);
  for (size_t i = 0; i < batch.size(); ++i) {
    pb::SequenceTokens* seq = impl_->AddEntry(batch[i], forward);
    seq->set_sample(sample[i] != 0);
    seq->set_num_draft(draft_counts[i]);
    seq->mutable_allowed_tokens()->Assign(batch[i].allowed_tokens.begin(),
                                          batch[i].allowed_tokens.end());
  }
  std::vector<std::vector<worker::SampledToken>> received;
  EXL3_RETURN_IF_ERROR(impl_->RunStep(std::move(step), nullptr, nullptr, nullptr, &received));
  EXL3_RETURN_IF_ERROR(
      worker::CheckVerifiedRuns(batch, sample, draft_counts, vocab_size(), received));
  *runs = std::move(received);
  return absl::OkStatus();
}

absl::Status RemoteRankGroup::AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) {
  std::vector<int32_t>& staged = impl_->staged_pages_[seq_id];
  staged.insert(staged.end(), page_ids.begin(), page_ids.end());
  return absl::OkStatus();
}

namespace {
void ToProto(std::span<const worker::KvBlockTransfer> transfers, pb::KvBlockTransfers* out) {
  for (const worker::KvBlockTransfer& t : transfers) {
    pb::KvBlockTransfer* b = out->add_blocks();
    b->set_page(t.page);
    b->set_slot(t.slot);
    b->set_hash_hi(t.hash_hi);
    b->set_hash_lo(t.hash_lo);
  }
}
}  // namespace

absl::Status RemoteRankGroup::SaveKvBlocks(std::span<const worker::KvBlockTransfer> saves) {
  if (impl_->options_.kv_disk_slots <= 0) return StepExecutor::SaveKvBlocks(saves);
  pb::Step step;
  ToProto(saves, step.mutable_save_kv_blocks());
  return impl_->RunStep(std::move(step), nullptr);
}

absl::Status RemoteRankGroup::SaveStateSnapshots(
    std::span<const worker::StateSnapshotSave> saves) {
  pb::Step step;
  for (const worker::StateSnapshotSave& s : saves) {
    pb::StateSnapshotSave* save = step.mutable_save_state_snapshots()->add_saves();
    save->set_seq_id(s.seq_id);
    save->mutable_snapshot()->set_slot(s.snapshot.slot);
    save->mutable_snapshot()->set_hash_hi(s.snapshot.hash_hi);
    save->mutable_snapshot()->set_hash_lo(s.snapshot.hash_lo);
  }
  return impl_->RunStep(std::move(step), nullptr);
}

absl::Status RemoteRankGroup::LoadKvBlocks(std::span<const worker::KvBlockTransfer> loads,
                                           std::vector<uint8_t>* loaded) {
  if (impl_->options_.kv_disk_slots <= 0) return StepExecutor::LoadKvBlocks(loads, loaded);
  pb::Step step;
  ToProto(loads, step.mutable_load_kv_blocks());
  std::string flags;
  EXL3_RETURN_IF_ERROR(impl_->RunStep(std::move(step), nullptr, nullptr, &flags));
  if (flags.size() != loads.size()) {
    return absl::DataLossError(absl::StrCat("rank 0 answered ", flags.size(),
                                            " load flags for ", loads.size(), " blocks"));
  }
  loaded->assign(flags.begin(), flags.end());
  return absl::OkStatus();
}

std::optional<worker::KvCacheOptions> RemoteRankGroup::kv_options() const {
  worker::KvCacheOptions kv = impl_->options_.kv;
  kv.caller_assigns_pages = true;  // what every rank runs with (rank_client.cc)
  return kv;
}

absl::Status RemoteRankGroup::Recover(absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(WaitReady(deadline));
  impl_->ForgetSession();
  return absl::OkStatus();
}

absl::Status RemoteRankGroup::RemoveSequence(int64_t seq_id) {
  impl_->staged_pages_.erase(seq_id);
  pb::Step step;
  step.mutable_remove_sequence()->set_seq_id(seq_id);
  return impl_->RunStep(std::move(step), nullptr);
}

absl::Status RemoteRankGroup::Forward(std::span<const worker::SequenceTokens> batch,
                                      worker::LogitsRows rows, std::vector<float>* logits) {
  pb::Step step;
  pb::ForwardBatch* forward = step.mutable_forward();
  forward->set_rows(rows == worker::LogitsRows::kLastToken ? pb::LOGITS_ROWS_LAST_TOKEN
                                                           : pb::LOGITS_ROWS_ALL_TOKENS);
  for (const worker::SequenceTokens& entry : batch) impl_->AddEntry(entry, forward);
  std::vector<float> received;
  EXL3_RETURN_IF_ERROR(impl_->RunStep(std::move(step), &received));
  // Rank 0's logits are rows x vocab: anything else is a broken rank, not
  // logits to index (found writing tests/fuzz/rank_endpoint_fuzz.cc).
  size_t want = 0;
  for (const worker::SequenceTokens& entry : batch) {
    want += rows == worker::LogitsRows::kAllTokens ? entry.tokens.size() : 1;
  }
  want *= static_cast<size_t>(std::max<int64_t>(vocab_size(), 0));
  if (received.size() != want) {
    return absl::DataLossError(absl::StrCat("rank 0 returned ", received.size(), " logits; the batch needs ",
                                            want, " (rows x vocab ", vocab_size(), ")"));
  }
  if (logits != nullptr) *logits = std::move(received);
  return absl::OkStatus();
}

}  // namespace exl3serve::coordinator
