#include "worker/rank/rank_client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "exl3serve/rank/v1/rank.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/model/kv_cache.h"
#include "worker/rank/rank_executor.h"
#include "worker/rank/step_command.h"

namespace exl3serve::worker::rank {
namespace {

namespace pb = ::exl3serve::rank::v1;

static_assert(kRankProtocolVersion == pb::RANK_PROTOCOL_CURRENT,
              "rank_client.h and rank.proto disagree on the protocol version");

// Pause before registering again after a refusal or a lost coordinator: a
// restarted rank's slot frees as soon as the coordinator sees the old stream
// end, which is within a round trip on a LAN.
constexpr absl::Duration kRetryBackoff = absl::Milliseconds(200);

std::string HostName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown-host";
  return host;
}

void SetStatus(const absl::Status& status, pb::RankStatus* out) {
  out->set_code(static_cast<int32_t>(status.code()));
  out->set_message(std::string(status.message()));
}

// A drawn token as StepResult carries it, with `id` as its token_id.
void ToProto(const SampledToken& token, int32_t id, pb::SampledTokenResult* out) {
  out->set_token_id(id);
  if (token.logprob != 0.0f) out->set_logprob(token.logprob);
  for (const TokenLogprob& top : token.top_logprobs) {
    out->add_top_ids(top.id);
    out->add_top_logprobs(top.logprob);
  }
}

absl::StatusOr<KvCacheDtype> KvDtype(int bits) {
  if (bits == 0) return KvCacheDtype::kFp16;
  return KvCacheDtypeFromBits(bits);
}

// Setup's GemmPrecision (unspecified = fp32). Errors: InvalidArgument for a
// value this rank does not know.
absl::StatusOr<kernels::TrellisGemmPrecision> PrecisionFromProto(int value, const char* field) {
  switch (value) {
    case pb::GEMM_PRECISION_UNSPECIFIED:
    case pb::GEMM_PRECISION_FP32:
      return kernels::TrellisGemmPrecision::kFloat;
    case pb::GEMM_PRECISION_BF16:
      return kernels::TrellisGemmPrecision::kBf16;
    case pb::GEMM_PRECISION_INT8:
      return kernels::TrellisGemmPrecision::kInt8;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Setup.", field, ": unknown precision value ", value));
}

enum class EndKind { kShutdown, kCoordinatorGone, kLostPeers, kRefused, kLoadFailed };

struct SessionEnd {
  EndKind kind = EndKind::kCoordinatorGone;
  absl::Status status;  // the error, or the shutdown reason as an OK-kind note
  std::string reason;
  // The coordinator sent nothing on the stream before it ended (a TLS
  // handshake that refused our certificate looks like this).
  bool unanswered = false;
  // kRefused after Setup (e.g. the coordinator refused the KV layout this
  // rank reported in Ready), not at registration.
  bool after_setup = false;
};

absl::StatusOr<std::string> ReadFileFlag(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("worker: ", flag, ": cannot read ", path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("worker: ", flag, ": ", path, " is empty"));
  }
  return text;
}

// The channel credentials of options (TLS when tls_ca_file is set).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const RankClientOptions& options, grpc::ChannelArguments* args) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("worker: --tls-cert and --tls-key go together");
  }
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty() || !options.tls_server_name.empty()) {
      return absl::InvalidArgumentError(
          "worker: --tls-cert / --tls-server-name need --tls-ca (the coordinator's CA)");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  EXL3_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileFlag(options.tls_ca_file, "--tls-ca"));
  if (!options.tls_cert_file.empty()) {
    EXL3_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileFlag(options.tls_cert_file, "--tls-cert"));
    EXL3_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileFlag(options.tls_key_file, "--tls-key"));
  }
  if (!options.tls_server_name.empty()) args->SetSslTargetNameOverride(options.tls_server_name);
  return grpc::SslCredentials(ssl);
}

// The reason a rank gives its peers when its session ends in order
// (Shutdown, a lost coordinator, a lost peer of its own).
constexpr char kLeavingGroup[] = "the rank is leaving its group";
// How long a rank whose peer left in order waits for the coordinator's own
// Shutdown before it reports the peer as lost.
constexpr absl::Duration kOrderlyLeaveGrace = absl::Seconds(2);

// One stream to the coordinator, from Register to its end.
// Threads: the calling thread reads the stream; a heartbeat thread and a
// step thread (after Setup) write to it under write_mu_.
class Session {
 public:
  // `authorization`: "Bearer <rank token>", or empty.
  Session(const RankClientOptions& options, pb::RankControl::Stub* stub,
          const std::string& authorization)
      : options_(options),
        stub_(stub),
        rank_token_(absl::StartsWith(authorization, "Bearer ") ? authorization.substr(7) : "") {
    if (!authorization.empty()) context_.AddMetadata("authorization", authorization);
  }

  SessionEnd Run() {
    stream_ = stub_->Connect(&context_);
    pb::RankMessage hello;
    pb::Register* reg = hello.mutable_register_();
    reg->set_protocol_version(options_.protocol_version);
    reg->set_rank(options_.rank);
    reg->set_world_size(options_.world_size);
    reg->set_host(HostName());
    reg->set_pid(getpid());
    reg->set_model_dir(options_.model_dir);
    reg->set_binary_version("exl3serve 0.1.0");
    std::optional<SessionEnd> end;
    if (Write(hello)) {
      std::thread heartbeat([this] { HeartbeatLoop(); });
      pb::CoordinatorMessage message;
      while (!end.has_value() && stream_->Read(&message)) {
        answered_ = true;
        switch (message.kind_case()) {
          case pb::CoordinatorMessage::kSetup:
            end = OnSetup(message.setup());
            break;
          case pb::CoordinatorMessage::kStep: {
            absl::MutexLock lock(&mu_);
            steps_.push_back(std::move(*message.mutable_step()));
            break;
          }
          case pb::CoordinatorMessage::kShutdown:
            end = SessionEnd{EndKind::kShutdown, absl::OkStatus(), message.shutdown().reason()};
            break;
          default:
            EXL3_LOG(kWarning) << "rank " << options_.rank
                               << ": ignoring an unknown coordinator message";
        }
      }
      // After Read returned false the stream is over: no cancel, so that
      // Finish() reports the coordinator's own status (e.g. a refusal).
      Stop(/*cancel_stream=*/end.has_value());
      heartbeat.join();
    } else {
      Stop(/*cancel_stream=*/false);
    }
    if (step_thread_.joinable()) step_thread_.join();
    const grpc::Status finished = stream_->Finish();
    if (end.has_value()) return *end;
    {
      absl::MutexLock lock(&mu_);
      if (!lost_peers_.ok()) return SessionEnd{EndKind::kLostPeers, lost_peers_, ""};
      if (!load_error_.ok()) return SessionEnd{EndKind::kLoadFailed, load_error_, ""};
    }
    const absl::Status status(static_cast<absl::StatusCode>(finished.error_code()),
                              finished.error_message());
    switch (finished.error_code()) {
      case grpc::StatusCode::FAILED_PRECONDITION:
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::ALREADY_EXISTS:
      case grpc::StatusCode::UNAUTHENTICATED:
      case grpc::StatusCode::PERMISSION_DENIED: {
        SessionEnd refused{EndKind::kRefused, status, ""};
        refused.after_setup = setup_seen_;
        return refused;
      }
      default:
        return SessionEnd{EndKind::kCoordinatorGone, status, "", !answered_};
    }
  }

 private:
  bool Write(const pb::RankMessage& message) {
    absl::MutexLock lock(&write_mu_);
    return stream_->Write(message);
  }

  // Ends the session from any thread: wakes the step and heartbeat threads,
  // aborts the communicator (a step stuck in a collective returns at once)
  // and, with cancel_stream, cancels the stream (the reader's Read returns
  // false).
  void Stop(bool cancel_stream = true) {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (comm_ != nullptr) comm_->Abort(absl::AbortedError(kLeavingGroup));
    if (cancel_stream) context_.TryCancel();
  }

  std::optional<SessionEnd> OnSetup(const pb::Setup& setup) {
    if (setup.protocol_version() != kRankProtocolVersion) {
      const absl::Status refused = absl::FailedPreconditionError(absl::StrCat(
          "the coordinator speaks rank protocol version ", setup.protocol_version(),
          ", this rank speaks ", kRankProtocolVersion,
          " (run the same exl3serve release on the coordinator and every rank)"));
      return SessionEnd{EndKind::kRefused, refused, ""};
    }
    if (step_thread_.joinable()) {
      EXL3_LOG(kWarning) << "rank " << options_.rank << ": ignoring a second Setup";
      return std::nullopt;
    }
    setup_seen_ = true;
    RankSetup rank_setup;
    rank_setup.model_dir = setup.model_dir();
    rank_setup.rank = options_.rank;
    rank_setup.world_size = setup.world_size();
    rank_setup.expert_parallel = setup.expert_parallel();
    rank_setup.capacities.assign(setup.capacities().begin(), setup.capacities().end());
    rank_setup.comm.backend = setup.comm().backend();
    rank_setup.comm.shm_name = setup.comm().shm_name();
    rank_setup.comm.bootstrap_address = setup.comm().bootstrap_address();
    rank_setup.comm.ucx_tls = setup.comm().ucx_tls();
    rank_setup.comm.bootstrap_key = rank_token_;  // our own token file, never the wire's
    absl::StatusOr<KvCacheDtype> dtype = KvDtype(setup.kv().dtype_bits());
    if (!dtype.ok()) return SessionEnd{EndKind::kRefused, dtype.status(), ""};
    rank_setup.kv.dtype = *dtype;
    if (setup.kv().num_pages() > 0) rank_setup.kv.num_pages = setup.kv().num_pages();
    if (setup.kv().page_size_tokens() > 0) {
      rank_setup.kv.page_size_tokens = setup.kv().page_size_tokens();
    }
    if (options_.kv_num_pages_for_testing > 0) {
      rank_setup.kv.num_pages = options_.kv_num_pages_for_testing;
    }
    // The coordinator's block tables place every sequence (rank.proto): this
    // rank never takes a page on its own.
    rank_setup.kv.caller_assigns_pages = true;
    rank_setup.kv_disk_path = setup.kv().disk_path();
    rank_setup.kv_disk_slots = setup.kv().disk_blocks();
    if (setup.join_timeout_ms() > 0) {
      rank_setup.join_timeout = absl::Milliseconds(setup.join_timeout_ms());
    }
    if (setup.collective_timeout_ms() > 0) {
      rank_setup.collective_timeout = absl::Milliseconds(setup.collective_timeout_ms());
    }
    if (options_.spill.has_value()) {
      rank_setup.spill = *options_.spill;
    } else if (setup.has_spill()) {
      const pb::SpillSettings& spill = setup.spill();
      rank_setup.spill.spill.assign(spill.tensors().begin(), spill.tensors().end());
      rank_setup.spill.auto_threshold_bytes = spill.threshold_bytes();
      rank_setup.spill.memory_budget_bytes = spill.memory_budget_bytes();
      if (spill.cache_bytes() > 0) rank_setup.spill.cache_budget_bytes = spill.cache_bytes();
      rank_setup.spill.cache_dir = spill.cache_dir();
      rank_setup.spill.extract = spill.extract();
    }
    // This rank's own --prefill-precision / --decode-precision win over Setup's.
    absl::StatusOr<kernels::TrellisGemmPrecision> prefill =
        PrecisionFromProto(setup.prefill_precision(), "prefill_precision");
    if (!prefill.ok()) return SessionEnd{EndKind::kRefused, prefill.status(), ""};
    rank_setup.prefill_precision = options_.prefill_precision.value_or(*prefill);
    absl::StatusOr<kernels::TrellisGemmPrecision> decode =
        PrecisionFromProto(setup.decode_precision(), "decode_precision");
    if (!decode.ok()) return SessionEnd{EndKind::kRefused, decode.status(), ""};
    rank_setup.decode_precision = options_.decode_precision.value_or(*decode);
    rank_setup.observer = options_.observer;
    {
      absl::MutexLock lock(&mu_);
      if (setup.heartbeat_interval_ms() > 0) {
        heartbeat_interval_ = absl::Milliseconds(setup.heartbeat_interval_ms());
      }
    }
    const int threads = setup.threads() > 0 ? setup.threads() : options_.threads;
    if (threads >= 1) kernels::cpu::SetSharedThreadPoolSize(threads);
    EXL3_LOG(kInfo) << "rank " << options_.rank << "/" << setup.world_size()
                    << ": group generation " << setup.group_generation() << ", loading "
                    << setup.model_dir();
    group_generation_ = setup.group_generation();  // read by the step thread only
    step_thread_ = std::thread([this, rank_setup] { StepLoop(rank_setup); });
    return std::nullopt;
  }

  void HeartbeatLoop() {
    uint64_t sequence = 0;
    while (true) {
      pb::RankMessage message;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time next = absl::Now() + heartbeat_interval_;
        // A timed wait on the stop flag, not a sleep: Stop() ends it at once.
        mu_.AwaitWithDeadline(absl::Condition(&stopping_), next);
        if (stopping_) return;
        pb::Heartbeat* beat = message.mutable_heartbeat();
        beat->set_sequence(++sequence);
        beat->set_steps_done(steps_done_);
        SetStatus(comm_ != nullptr ? comm_->health() : absl::OkStatus(),
                  beat->mutable_comm_health());
      }
      if (!Write(message)) return;
    }
  }

  bool StepReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !steps_.empty();
  }

  void StepLoop(const RankSetup& setup) {
    absl::StatusOr<LoadedRank> loaded = LoadRank(setup);
    {
      absl::MutexLock lock(&mu_);
      if (loaded.ok()) {
        comm_ = loaded->comm.get();
        if (stopping_) comm_->Abort(absl::AbortedError(kLeavingGroup));
      } else {
        load_error_ = loaded.status();
      }
    }
    pb::RankMessage ready_message;
    pb::Ready* ready = ready_message.mutable_ready();
    SetStatus(loaded.status(), ready->mutable_status());
    if (loaded.ok()) {
      ready->set_bytes_read(loaded->bytes_read);
      ready->set_planned_bytes(loaded->planned_bytes);
      ready->set_vocab_size(loaded->model->vocab_size());
      ready->set_comm_backend(loaded->comm->backend_name());
      ready->set_kv_num_pages(loaded->cache->options().num_pages);
      ready->set_kv_page_size_tokens(loaded->cache->options().page_size_tokens);
      EXL3_LOG(kInfo) << "rank " << setup.rank << "/" << setup.world_size << " ready ("
                      << loaded->comm->backend_name() << ", " << loaded->bytes_read
                      << " checkpoint bytes read)";
    } else {
      EXL3_LOG(kError) << "rank " << setup.rank << ": loading failed: " << loaded.status();
    }
    const bool sent = Write(ready_message);
    if (loaded.ok() && sent) Steps(*loaded);
    if (loaded.ok()) {
      absl::MutexLock lock(&mu_);
      comm_ = nullptr;
    }
  }

  void Steps(LoadedRank& loaded) {
    while (true) {
      pb::Step step;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Session::StepReady));
        if (stopping_) return;
        step = std::move(steps_.front());
        steps_.pop_front();
      }
      const absl::Time start = absl::Now();
      pb::RankMessage message;
      pb::StepResult* result = message.mutable_step_result();
      result->set_step_id(step.step_id());
      absl::Status status;
      RankCommand command;
      if (absl::StatusOr<RankCommand> c = RankCommandFromStep(step, group_generation_); c.ok()) {
        command = *std::move(c);
      } else {
        status = c.status();
      }
      std::vector<float> logits;
      std::vector<SampledToken> sampled;
      std::vector<std::vector<SampledToken>> runs;
      std::vector<uint8_t> kv_loaded;
      absl::Duration forward_time;
      if (status.ok()) {
        const absl::Time forward_start = absl::Now();
        status = ExecuteRankCommand(loaded, command, &logits, &sampled, &kv_loaded, &runs);
        forward_time = absl::Now() - forward_start;
      }
      SetStatus(status, result->mutable_status());
      if (status.ok() && loaded.rank == 0 && command.op == RankCommand::Op::kLoadKvBlocks) {
        result->set_kv_blocks_loaded(std::string(kv_loaded.begin(), kv_loaded.end()));
      }
      if (status.ok() && loaded.rank == 0 && command.op == RankCommand::Op::kForward) {
        if (!command.batch_draft.empty()) {
          for (const std::vector<SampledToken>& run : runs) {
            pb::SampledRun* out = result->add_runs();
            for (const SampledToken& token : run) ToProto(token, token.id, out->add_tokens());
          }
        } else if (!command.batch_sample.empty()) {
          for (size_t i = 0; i < sampled.size(); ++i) {
            ToProto(sampled[i], command.batch_sample[i] != 0 ? sampled[i].id : -1,
                    result->add_tokens());
          }
        } else {
          result->mutable_logits()->Assign(logits.begin(), logits.end());
        }
      }
      result->set_forward_ns(absl::ToInt64Nanoseconds(forward_time));
      result->set_total_ns(absl::ToInt64Nanoseconds(absl::Now() - start));
      {
        absl::MutexLock lock(&mu_);
        ++steps_done_;
      }
      const bool sent = Write(message);
      if (absl::Status health = loaded.comm->health(); !health.ok()) {
        bool stopping;
        {
          absl::MutexLock lock(&mu_);
          if (absl::StrContains(health.message(), kLeavingGroup)) {
            // A peer left in order: most often the coordinator shut the group
            // down and that peer read its Shutdown before this rank's reader
            // did. Give the coordinator's word a bounded time to arrive
            // before calling it a loss (a timed wait on the stop flag).
            mu_.AwaitWithDeadline(absl::Condition(&stopping_),
                                  absl::Now() + kOrderlyLeaveGrace);
          }
          stopping = stopping_;
          if (!stopping) lost_peers_ = health;
        }
        if (!stopping) {
          EXL3_LOG(kError) << "rank " << loaded.rank << ": lost its peers: " << health;
          Stop();
        }
        return;
      }
      if (!sent) return;
    }
  }

  const RankClientOptions& options_;
  pb::RankControl::Stub* const stub_;  // borrowed; outlives the session
  const std::string rank_token_;       // --rank-token-file's content ("" = none): the bootstrap key
  grpc::ClientContext context_;        // TryCancel is thread-safe
  std::unique_ptr<grpc::ClientReaderWriter<pb::RankMessage, pb::CoordinatorMessage>> stream_;
  std::thread step_thread_;  // started by the reader thread on Setup, joined by Run
  bool answered_ = false;    // the reader thread's: any coordinator message arrived
  bool setup_seen_ = false;  // the reader thread's: a Setup was accepted

  absl::Mutex write_mu_;  // one writer at a time on the stream

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<pb::Step> steps_ ABSL_GUARDED_BY(mu_);
  uint64_t steps_done_ ABSL_GUARDED_BY(mu_) = 0;
  // Setup.group_generation; set before the step thread starts, then read-only.
  uint64_t group_generation_ = 0;
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(1);
  comm::Communicator* comm_ ABSL_GUARDED_BY(mu_) = nullptr;  // the step thread's, while loaded
  absl::Status lost_peers_ ABSL_GUARDED_BY(mu_);
  absl::Status load_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status RunRankClient(const RankClientOptions& options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("worker: --coordinator HOST:PORT is empty");
  }
  if (options.rank < 0 || (options.world_size > 0 && options.rank >= options.world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("worker: --rank must be in [0, world size), got ",
                                                   options.rank));
  }
  grpc::ChannelArguments args;
  // Notice a coordinator box that vanished without closing the connection.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, -1);
  args.SetInt(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, -1);
  // Reconnect quickly after the coordinator restarts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  EXL3_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                        ChannelCredentials(options, &args));
  std::string authorization;
  if (!options.token_file.empty()) {
    EXL3_ASSIGN_OR_RETURN(std::string token, ReadFileFlag(options.token_file, "--rank-token-file"));
    token = std::string(absl::StripAsciiWhitespace(token));
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker: --rank-token-file: ", options.token_file, " holds only whitespace"));
    }
    authorization = absl::StrCat("Bearer ", token);
  }
  const bool tls = !options.tls_ca_file.empty();
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.coordinator_address, credentials, args);
  std::unique_ptr<pb::RankControl::Stub> stub = pb::RankControl::NewStub(channel);
  const std::string me = absl::StrCat("rank ", options.rank);
  const char* tls_hint =
      tls ? " (TLS: a closed socket usually means the coordinator refused this rank's client "
            "certificate: --tls-cert must be signed by the coordinator's tls.rank_ca; a "
            "certificate error means --tls-ca is not the CA of the coordinator's tls.rank_cert "
            "or the name differs: --tls-server-name)"
          : " (plaintext: does the coordinator's rank endpoint use TLS (tls.rank_cert)? "
            "then give --tls-ca)";
  int unanswered = 0;  // streams in a row the coordinator closed without a word
  while (true) {
    const absl::Time give_up = absl::Now() + options.connect_timeout;
    if (!channel->WaitForConnected(absl::ToChronoTime(give_up))) {
      // One fail-fast call for the channel's last connection error (a TLS
      // handshake failure says so there).
      grpc::ClientContext probe;
      probe.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      if (!authorization.empty()) probe.AddMetadata("authorization", authorization);
      auto stream = stub->Connect(&probe);
      stream->WritesDone();
      const grpc::Status last = stream->Finish();
      return absl::UnavailableError(absl::StrCat(
          me, ": coordinator ", options.coordinator_address, " not reachable within ",
          absl::FormatDuration(options.connect_timeout), " (--connect-timeout-ms); last error: ",
          last.error_message().empty() ? std::string("none") : last.error_message(), tls_hint));
    }
    Session session(options, stub.get(), authorization);
    const SessionEnd end = session.Run();
    absl::Duration pause = kRetryBackoff;
    switch (end.kind) {
      case EndKind::kShutdown:
        EXL3_LOG(kInfo) << me << ": the coordinator shut the group down: " << end.reason;
        if (!options.reconnect) return absl::OkStatus();
        break;
      case EndKind::kCoordinatorGone:
        if (end.unanswered && !options.tls_cert_file.empty()) {
          // Closed before Register got any answer while presenting a client
          // certificate: most likely the coordinator's TLS refused it (with
          // TLS 1.3 the client may finish its handshake before the server
          // checks the certificate).
          const std::string what = absl::StrCat(
              me, ": the coordinator at ", options.coordinator_address,
              " closed the stream before answering the registration: ", end.status.message(),
              tls_hint);
          if (!options.reconnect) return absl::UnavailableError(what);
          ++unanswered;
          EXL3_LOG(kWarning) << what << " (attempt " << unanswered << ")";
          pause = std::min(kRetryBackoff * (1 << std::min(unanswered, 5)), absl::Seconds(5));
          break;
        }
        unanswered = 0;
        EXL3_LOG(kWarning) << me << ": the coordinator went away (" << end.status << ")";
        if (!options.reconnect) return absl::OkStatus();
        break;
      case EndKind::kLostPeers:
        if (!options.reconnect) {
          return absl::UnavailableError(absl::StrCat(me, ": lost its peers: ", end.status.message()));
        }
        break;
      case EndKind::kLoadFailed:
        if (!options.reconnect) {
          return absl::Status(end.status.code(), absl::StrCat(me, ": ", end.status.message()));
        }
        break;
      case EndKind::kRefused:
        // Only a slot still held (ALREADY_EXISTS) can clear by itself; every
        // other refusal (a mismatched protocol, world size or KV layout, a
        // rank token) repeats until someone changes a setting, so the rank
        // ends with it even with --reconnect instead of spinning.
        if (!options.reconnect || end.status.code() != absl::StatusCode::kAlreadyExists) {
          return absl::Status(end.status.code(),
                              absl::StrCat(me,
                                           end.after_setup ? ": refused by the coordinator: "
                                                           : ": registration refused: ",
                                           end.status.message()));
        }
        break;
    }
    if (end.kind != EndKind::kCoordinatorGone || !end.unanswered) unanswered = 0;
    EXL3_LOG(kInfo) << me << ": registering again with " << options.coordinator_address;
    absl::SleepFor(pause);  // a retry pause, not synchronisation
  }
}

}  // namespace exl3serve::worker::rank
