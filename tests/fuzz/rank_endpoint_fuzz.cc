// libFuzzer target: the rank protocol as the coordinator receives it — a
// fake rank on a real gRPC stream (RankControl.Connect on 127.0.0.1) sends a
// fuzzed sequence of RankMessages to a RemoteRankGroup (coordinator/
// rank_group.h) of world size 1, while a driver thread runs the steps the
// engine would (AddSampledSequence, ForwardSampled, Forward) once the group is
// ready. Structured: Register (protocol version, rank, world size near and
// far from the right ones), Ready (OK or an error, vocab and KV layout right
// or wrong), Heartbeat, StepResult for the pending step or another (status,
// tokens of any count and id, verified runs of any count, length and ids,
// logits of any length), and raw bytes parsed as a RankMessage.
//
// Contract: no crash, leak or UB in the coordinator; each driver call ends
// (the group's step timeout bounds it) with OK or an error code a caller
// handles; an OK sampled forward has one token per entry, an OK verified
// forward runs that worker::CheckVerifiedRuns accepts (a malformed draft
// count is InvalidArgument, never a Step), an OK forward rows x vocab logits. After each input the fake rank hangs up and the group
// is back to forming (the next input starts from the same state).
#include <fuzzer/FuzzedDataProvider.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/rank_group.h"
#include "exl3serve/rank/v1/rank.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "worker/api/verified_forward.h"

namespace pb = ::exl3serve::rank::v1;
namespace co = ::exl3serve::coordinator;
namespace wk = ::exl3serve::worker;

namespace {

constexpr int64_t kNumPages = 32;
constexpr int kPageTokens = 16;

struct Fixture {
  std::unique_ptr<co::RemoteRankGroup> group;
  std::unique_ptr<pb::RankControl::Stub> stub;
};

Fixture& TheCoordinator() {
  static Fixture* f = [] {
    co::RankGroupOptions o;
    o.listen_address = "127.0.0.1:0";
    o.model_dir = "/fuzz/model";
    o.world_size = 1;
    o.kv.num_pages = kNumPages;
    o.kv.page_size_tokens = kPageTokens;
    o.step_timeout = absl::Milliseconds(300);
    o.load_timeout = absl::Seconds(2);
    o.heartbeat_timeout = absl::Seconds(30);
    o.reform_timeout = absl::Milliseconds(100);
    auto group = co::RemoteRankGroup::Start(o);
    if (!group.ok()) {
      std::fprintf(stderr, "rank_endpoint_fuzz: %s\n", group.status().ToString().c_str());
      std::abort();
    }
    auto* fixture = new Fixture;
    fixture->group = std::move(*group);
    fixture->stub = pb::RankControl::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(fixture->group->port()), grpc::InsecureChannelCredentials()));
    return fixture;
  }();
  return *f;
}

void CheckCallStatus(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:  // a status code the rank made up
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      break;
    default:
      std::fprintf(stderr, "unexpected status: %s\n", s.ToString().c_str());
      std::abort();
  }
}

// The Steps the coordinator sent on this input's stream.
class Inbox {
 public:
  void Push(const pb::CoordinatorMessage& m) {
    absl::MutexLock lock(&mu_);
    if (m.has_step()) {
      last_step_id_ = m.step().step_id();
      last_step_ = m.step();
      unanswered_ = true;
    }
    if (m.has_setup()) setup_seen_ = true;
  }
  // Until a Step waits for its answer or the stream ended (bounded).
  void AwaitStep(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](Inbox* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                               return self->unanswered_ || self->closed_;
                             },
                             this),
                         timeout);
  }
  // The Step to answer now, if one waits (then it counts as answered).
  std::optional<uint64_t> TakeStep() {
    absl::MutexLock lock(&mu_);
    if (!unanswered_) return std::nullopt;
    unanswered_ = false;
    return last_step_id_;
  }
  // The right answer to the waiting Step, if one waits (a well-behaved rank).
  std::optional<pb::RankMessage> TakeStepWithAnswer(int64_t vocab) {
    absl::MutexLock lock(&mu_);
    if (!unanswered_) return std::nullopt;
    unanswered_ = false;
    pb::RankMessage m;
    pb::StepResult* r = m.mutable_step_result();
    r->set_step_id(last_step_.step_id());
    if (last_step_.has_forward()) {
      const pb::ForwardBatch& f = last_step_.forward();
      for (int i = 0; i < f.sequences_size(); ++i) {
        const pb::SequenceTokens& seq = f.sequences(i);
        if (f.verified()) {  // half the drafts accepted, then token 7
          pb::SampledRun* run = r->add_runs();
          if (!seq.sample()) continue;
          const int first = seq.token_ids_size() - seq.num_draft();
          for (int j = 0; j < seq.num_draft() / 2; ++j) {
            run->add_tokens()->set_token_id(seq.token_ids(first + j));
          }
          run->add_tokens()->set_token_id(7);
        } else if (f.sampled()) {
          r->add_tokens()->set_token_id(f.sequences(i).sample() ? 7 : -1);
        } else {
          for (int64_t v = 0; v < vocab; ++v) r->add_logits(static_cast<float>(v));
        }
      }
    }
    return m;
  }
  bool step_waiting() {
    absl::MutexLock lock(&mu_);
    return unanswered_;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // Until the Setup arrived or the stream ended (bounded).
  void AwaitSetup(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](Inbox* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                               return self->setup_seen_ || self->closed_;
                             },
                             this),
                         timeout);
  }
  std::optional<uint64_t> last_step_id() {
    absl::MutexLock lock(&mu_);
    return last_step_id_;
  }
  bool setup_seen() {
    absl::MutexLock lock(&mu_);
    return setup_seen_;
  }
  bool ready_sent() {
    absl::MutexLock lock(&mu_);
    return ready_sent_;
  }
  void MarkReadySent() {
    absl::MutexLock lock(&mu_);
    ready_sent_ = true;
  }

 private:
  absl::Mutex mu_;
  std::optional<uint64_t> last_step_id_ ABSL_GUARDED_BY(mu_);
  bool setup_seen_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool ready_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool unanswered_ ABSL_GUARDED_BY(mu_) = false;
  pb::Step last_step_ ABSL_GUARDED_BY(mu_);
};

void FillStatus(FuzzedDataProvider& in, pb::RankStatus* s) {
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  s->set_code(pick < 200 ? 0 : in.ConsumeIntegralInRange<int32_t>(-3, 40));
  if (s->code() != 0) s->set_message(in.ConsumeRandomLengthString(32));
}

pb::RankMessage NextMessage(FuzzedDataProvider& in, Inbox& inbox, int64_t vocab) {
  pb::RankMessage m;
  const uint8_t kind = in.ConsumeIntegral<uint8_t>();
  if (kind < 12) {
    if (!m.ParseFromString(in.ConsumeRandomLengthString(256))) m.Clear();
    return m;
  }
  // Mostly follow the protocol a rank speaks (Register, then Ready after the
  // Setup, then a StepResult per Step), so the inputs reach a ready group;
  // the rest of the time anything goes.
  int choice = kind % 5;
  if (kind < 160) {
    if (!inbox.setup_seen()) {
      choice = 0;
    } else if (!inbox.ready_sent()) {
      choice = 1;
    } else if (inbox.step_waiting()) {
      choice = 3;
    }
  }
  switch (choice) {
    case 0: {
      pb::Register* r = m.mutable_register_();
      const bool right = in.ConsumeIntegral<uint8_t>() < 220;
      r->set_protocol_version(right ? co::kCoordinatorRankProtocolVersion : in.ConsumeIntegral<uint32_t>());
      r->set_rank(right ? 0 : in.ConsumeIntegralInRange<int32_t>(-2, 3));
      r->set_world_size(right ? in.ConsumeIntegralInRange<int32_t>(0, 1) : in.ConsumeIntegral<int32_t>());
      r->set_host(in.ConsumeRandomLengthString(24));
      r->set_pid(in.ConsumeIntegral<int64_t>());
      break;
    }
    case 1: {
      inbox.MarkReadySent();
      pb::Ready* r = m.mutable_ready();
      FillStatus(in, r->mutable_status());
      const bool right = in.ConsumeIntegral<uint8_t>() < 220;
      r->set_vocab_size(right ? vocab : in.ConsumeIntegral<int64_t>());
      r->set_kv_num_pages(right ? kNumPages : in.ConsumeIntegral<int64_t>());
      r->set_kv_page_size_tokens(right ? kPageTokens : in.ConsumeIntegral<int32_t>());
      r->set_bytes_read(in.ConsumeIntegral<uint64_t>());
      r->set_comm_backend(in.ConsumeRandomLengthString(8));
      break;
    }
    case 2:
      m.mutable_heartbeat()->set_sequence(in.ConsumeIntegral<uint64_t>());
      break;
    default: {
      pb::StepResult* r = m.mutable_step_result();
      std::optional<uint64_t> pending = inbox.TakeStep();
      if (!pending.has_value()) pending = inbox.last_step_id();
      r->set_step_id(pending.has_value() && in.ConsumeIntegral<uint8_t>() < 230
                         ? *pending
                         : in.ConsumeIntegral<uint64_t>());
      FillStatus(in, r->mutable_status());
      const int tokens = in.ConsumeIntegralInRange(0, 5);
      for (int t = 0; t < tokens; ++t) {
        pb::SampledTokenResult* token = r->add_tokens();
        token->set_token_id(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, 99)
                                             : in.ConsumeIntegral<int32_t>());
        token->set_logprob(in.ConsumeFloatingPoint<float>());
        const int tops = in.ConsumeIntegralInRange(0, 3);
        for (int k = 0; k < tops; ++k) {
          token->add_top_ids(in.ConsumeIntegral<int32_t>());
          if (in.ConsumeBool()) token->add_top_logprobs(in.ConsumeFloatingPoint<float>());
        }
      }
      const int runs = in.ConsumeIntegralInRange(0, 3) == 0 ? in.ConsumeIntegralInRange(0, 4) : 0;
      for (int k = 0; k < runs; ++k) {
        pb::SampledRun* run = r->add_runs();
        for (int t = in.ConsumeIntegralInRange(0, 4); t > 0; --t) {
          pb::SampledTokenResult* token = run->add_tokens();
          token->set_token_id(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, 4)
                                               : in.ConsumeIntegral<int32_t>());
          if (in.ConsumeBool()) token->set_logprob(in.ConsumeFloatingPoint<float>());
        }
      }
      const int logits = in.ConsumeIntegralInRange(0, 3) == 0 ? in.ConsumeIntegralInRange(0, 400) : 0;
      for (int l = 0; l < logits; ++l) r->add_logits(static_cast<float>(l));
      break;
    }
  }
  return m;
}

// How deep the inputs reach, printed at exit with EXL3_FUZZ_STATS=1.
struct Reach {
  std::atomic<int64_t> inputs{0}, drives{0}, calls_ok{0}, calls_failed{0}, verified_ok{0};
  ~Reach() {
    if (std::getenv("EXL3_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr, "rank_endpoint_fuzz: %lld inputs, %lld reached a ready group; step calls %lld OK "
                 "(%lld verified forwards), %lld failed\n",
                 (long long)inputs.load(), (long long)drives.load(), (long long)calls_ok.load(),
                 (long long)verified_ok.load(), (long long)calls_failed.load());
  }
} reach;

void Count(const absl::Status& s) { ++(s.ok() ? reach.calls_ok : reach.calls_failed); }

// What the engine would run while the group is ready: each call checked.
void DriveSteps(co::RemoteRankGroup& group, int calls, int64_t* completed) {
  for (int c = 0; c < calls; ++c) {
    if (!group.ready()) break;
    const int64_t seq = c;
    wk::SequenceSampling sampling;
    CheckCallStatus(group.AddSampledSequence(seq, sampling));
    const std::vector<int32_t> pages = {static_cast<int32_t>(c % kNumPages)};
    (void)group.AssignPages(seq, pages);
    std::vector<wk::SequenceTokens> batch(1 + c % 3);
    static const int32_t kTokens[] = {1, 2, 3};
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = {seq + static_cast<int64_t>(i), kTokens};
    std::vector<uint8_t> sample(batch.size(), 1);
    std::vector<wk::SampledToken> tokens;
    const absl::Status sampled = group.ForwardSampled(batch, sample, &tokens);
    CheckCallStatus(sampled);
    Count(sampled);
    if (sampled.ok() && tokens.size() != batch.size()) std::abort();
    // Speculative verification: 0..2 drafts of the three tokens.
    std::vector<int32_t> drafts(batch.size());
    for (size_t i = 0; i < drafts.size(); ++i) drafts[i] = static_cast<int32_t>((c + i) % 3);
    std::vector<std::vector<wk::SampledToken>> runs;
    const absl::Status verified = group.ForwardVerified(batch, sample, drafts, &runs);
    CheckCallStatus(verified);
    Count(verified);
    if (verified.ok()) ++reach.verified_ok;
    if (verified.ok() &&
        !wk::CheckVerifiedRuns(batch, sample, drafts, group.vocab_size(), runs).ok()) {
      std::abort();  // OK runs are possible runs
    }
    drafts[0] = 3;  // no accepted token before the drafts: refused before any Step
    if (group.ForwardVerified(batch, sample, drafts, &runs).code() !=
        absl::StatusCode::kInvalidArgument) {
      std::abort();
    }
    std::vector<float> logits;
    const absl::Status forward = group.Forward(batch, wk::LogitsRows::kLastToken, &logits);
    CheckCallStatus(forward);
    Count(forward);
    if (forward.ok() && logits.size() != batch.size() * static_cast<size_t>(group.vocab_size())) {
      std::abort();  // OK logits are rows x vocab
    }
    CheckCallStatus(group.RemoveSequence(seq));
    ++*completed;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = TheCoordinator();
  ++reach.inputs;
  FuzzedDataProvider in(data, size);
  // The previous input's rank has gone: wait (bounded) for the slot to free.
  for (int i = 0; i < 200 && f.group->status().ranks[0].up; ++i) {
    absl::SleepFor(absl::Milliseconds(5));  // the coordinator notices a hang-up asynchronously
  }
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<pb::RankMessage, pb::CoordinatorMessage>> stream =
      f.stub->Connect(&context);
  Inbox inbox;
  std::thread reader([&] {
    pb::CoordinatorMessage m;
    while (stream->Read(&m)) inbox.Push(m);
    inbox.Close();
  });
  std::thread driver;
  std::atomic<bool> driver_done{false};
  int64_t completed = 0;
  const int64_t vocab = 100;
  const int messages = in.ConsumeIntegralInRange(1, 16);
  for (int i = 0; i < messages && in.remaining_bytes() > 0; ++i) {
    if (driver.joinable()) inbox.AwaitStep(absl::Milliseconds(400));
    const pb::RankMessage m = NextMessage(in, inbox, vocab);
    if (!stream->Write(m)) break;
    // The coordinator answers a Register with a Setup: as a rank would, wait
    // for it (bounded) before the next message.
    if (m.has_register_()) inbox.AwaitSetup(absl::Milliseconds(500));
    if (!driver.joinable() && inbox.setup_seen() && m.has_ready()) {
      // The coordinator takes the Ready in asynchronously.
      (void)f.group->WaitReady(absl::Now() + absl::Milliseconds(200));
      const int calls = in.ConsumeIntegralInRange(1, 3);
      if (f.group->ready()) ++reach.drives;
      driver = std::thread([&, calls] {
        DriveSteps(*f.group, calls, &completed);
        driver_done = true;
      });
    }
  }
  // Input used up: behave until the driver's calls are done (bounded).
  for (int k = 0; k < 64 && driver.joinable() && !driver_done.load(); ++k) {
    inbox.AwaitStep(absl::Milliseconds(400));
    std::optional<pb::RankMessage> answer = inbox.TakeStepWithAnswer(vocab);
    if (answer.has_value() && !stream->Write(*answer)) break;
  }
  stream->WritesDone();
  context.TryCancel();
  reader.join();
  if (driver.joinable()) driver.join();
  (void)stream->Finish();
  return 0;
}
