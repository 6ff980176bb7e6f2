#include "coordinator/generation_service.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "exl3serve/v1/generation.grpc.pb.h"

namespace exl3serve::coordinator {
namespace {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl::StatusCode and grpc::StatusCode share their numbering (both are
  // google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// Appends chunk `from` to chunk `into` (a client that reads slower than the
// engine produces gets fewer, larger chunks; nothing is lost).
void MergeChunk(const v1::GenerateStreamChunk& from, v1::GenerateStreamChunk* into) {
  into->mutable_token_ids()->Add(from.token_ids().begin(), from.token_ids().end());
  into->mutable_text()->append(from.text());
  into->mutable_logprobs()->Add(from.logprobs().begin(), from.logprobs().end());
  into->set_prompt_tokens(from.prompt_tokens());
  into->set_completion_tokens(from.completion_tokens());
  into->set_cached_tokens(from.cached_tokens());
}

// Equal iff a == b; the time taken depends on the lengths only, not on
// where the first difference is (a token guess learns nothing from timing).
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

// A Generate call refused before it reached the engine (no token, draining).
class RejectedGenerate final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit RejectedGenerate(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// One tiny worker thread for calls that block (deep health checks), so that
// no gRPC callback thread ever waits on the engine. Joined on destruction,
// after every queued task ran.
class BlockingWorker {
 public:
  BlockingWorker() : thread_([this] { Loop(); }) {}
  ~BlockingWorker() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }
  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](BlockingWorker* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
              return w->stopping_ || !w->tasks_.empty();
            },
            this));
        if (tasks_.empty()) return;  // stopping, nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The reactor of one Generate call. Lifetime: created by the handler, deleted
// in OnDone, which gRPC calls only after Finish. Finish is called only while
// no write is in flight (`writing_` false under mu_), so a thread that set
// `writing_` may call StartWrite after dropping the lock: the reactor cannot
// be deleted before that write's OnWriteDone. The engine's callback holds a
// shared_ptr to `link_` and checks `link_->done` under link_->mu, so a
// response arriving after OnDone is dropped, never touches a deleted reactor.
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
  struct Link {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    GenerateReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
  };
  enum class Action { kNone, kWrite, kFinish };

 public:
  // `active` counts calls in flight: incremented by the caller, decremented in OnDone.
  GenerateReactor(Engine& engine, v1::GenerateRequest request, std::atomic<int>* active)
      : engine_(engine),
        request_id_(request.request_id()),
        link_(std::make_shared<Link>()),
        active_(active) {
    {
      absl::MutexLock lock(&link_->mu);
      link_->reactor = this;
    }
    std::shared_ptr<Link> link = link_;
    absl::Status status = engine_.Submit(request, [link](const v1::GenerateResponse& response) {
      GenerateReactor* reactor;
      Action action;
      {
        absl::MutexLock lock(&link->mu);
        if (link->done) return;  // the call is over; the engine finishes its side
        reactor = link->reactor;
        reactor->link_->mu.AssertHeld();  // the same Link (for -Wthread-safety)
        action = reactor->OnEngineResponseLocked(response);
      }
      // Safe after unlocking: the reactor lives until OnDone, which follows
      // Finish, which is only called while no write is in flight.
      reactor->Perform(action);
    });
    if (!status.ok()) {
      Action action;
      {
        absl::MutexLock lock(&link_->mu);
        final_received_ = true;  // nothing to abort
        finish_called_ = true;
        action = Action::kFinish;
        finish_status_ = ToGrpcStatus(status);
      }
      Perform(action);
    }
  }

  void OnWriteDone(bool ok) override {
    bool abort = false;
    Action action;
    {
      absl::MutexLock lock(&link_->mu);
      writing_ = false;
      if (!ok) {  // the stream broke (client gone)
        cancelled_ = true;
        abort = !final_received_ && !abort_sent_;
        abort_sent_ = abort_sent_ || abort;
      }
      action = NextLocked();
    }
    if (abort) engine_.Abort({request_id_}, "client stream broke");
    Perform(action);
  }

  void OnCancel() override {
    bool abort = false;
    Action action;
    {
      absl::MutexLock lock(&link_->mu);
      cancelled_ = true;
      abort = !final_received_ && !abort_sent_;
      abort_sent_ = abort_sent_ || abort;
      action = NextLocked();
    }
    if (abort) engine_.Abort({request_id_}, "client cancelled");
    Perform(action);
  }

  void OnDone() override {
    bool abort = false;
    {
      absl::MutexLock lock(&link_->mu);
      link_->done = true;
      abort = !final_received_ && !abort_sent_;
    }
    // Defensive: a call that ends without the engine's final message (e.g. a
    // server shutdown past its grace) must not leave the request running.
    if (abort) engine_.Abort({request_id_}, "call ended");
    std::atomic<int>* active = active_;
    delete this;
    active->fetch_sub(1);
  }

 private:
  // Runs on the engine's scheduler thread under link_->mu: queues the
  // response and says whether to start a write (or finish). Never blocks.
  Action OnEngineResponseLocked(const v1::GenerateResponse& response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(link_->mu) {
    if (finish_called_ || final_received_) return Action::kNone;
    if (response.has_chunk() && !queue_.empty() && queue_.back().has_chunk()) {
      MergeChunk(response.chunk(), queue_.back().mutable_chunk());
    } else {
      queue_.push_back(response);
    }
    if (response.has_complete()) {
      final_received_ = true;
    } else if (response.has_error()) {
      final_received_ = true;
      final_status_ = grpc::Status(static_cast<grpc::StatusCode>(response.error().code()),
                                   response.error().message());
    }
    return NextLocked();
  }

  // Decides the next step of the call; at most one write is in flight.
  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(link_->mu) {
    if (finish_called_ || writing_) return Action::kNone;
    if (cancelled_) {
      finish_called_ = true;
      finish_status_ = grpc::Status::CANCELLED;
      return Action::kFinish;
    }
    if (!queue_.empty()) {
      in_flight_ = std::move(queue_.front());
      queue_.pop_front();
      if (!in_flight_.has_chunk()) final_popped_ = true;
      writing_ = true;
      return Action::kWrite;
    }
    if (final_popped_) {
      finish_called_ = true;
      finish_status_ = final_status_;
      return Action::kFinish;
    }
    return Action::kNone;
  }

  void Perform(Action action) {
    if (action == Action::kWrite) StartWrite(&in_flight_);
    if (action == Action::kFinish) Finish(finish_status_);
  }

  Engine& engine_;
  const std::string request_id_;
  const std::shared_ptr<Link> link_;
  std::atomic<int>* const active_;

  // Guarded by link_->mu (the annotation cannot name it through the pointer).
  std::deque<v1::GenerateResponse> queue_;
  v1::GenerateResponse in_flight_;  // owned by the write in flight
  bool writing_ = false;
  bool final_received_ = false;  // the engine sent complete or error
  bool final_popped_ = false;    // ... and it was handed to a write
  bool cancelled_ = false;
  bool abort_sent_ = false;
  bool finish_called_ = false;
  grpc::Status final_status_;   // OK after complete, the error's otherwise
  grpc::Status finish_status_;  // what Finish is called with
};

}  // namespace

class GenerationService::Impl final : public v1::Generation::CallbackService {
 public:
  Impl(Engine& engine, GenerationServiceOptions options)
      : engine_(engine),
        options_(std::move(options)),
        expected_authorization_(options_.auth_token.empty()
                                    ? std::string()
                                    : absl::StrCat("Bearer ", options_.auth_token)) {}

  void StartDraining() { draining_.store(true); }
  int active_generate_calls() const { return active_generate_.load(); }

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override {
    if (grpc::Status auth = Authorize(context); !auth.ok()) return new RejectedGenerate(auth);
    if (draining_.load()) {
      return new RejectedGenerate(grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "the server is draining (shutting down): no new requests; retry on another replica"));
    }
    v1::GenerateRequest copy = *request;
    if (copy.request_id().empty()) {
      copy.set_request_id(absl::StrCat("grpc-", next_id_.fetch_add(1) + 1));
    }
    active_generate_.fetch_add(1);
    return new GenerateReactor(engine_, std::move(copy), &active_generate_);
  }

  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override {
    if (grpc::Status auth = Authorize(context); !auth.ok()) {
      grpc::ServerUnaryReactor* rejected = context->DefaultReactor();
      rejected->Finish(auth);
      return rejected;
    }
    std::vector<std::string> ids(request->request_ids().begin(), request->request_ids().end());
    const std::string reason = request->reason().empty() ? "Abort RPC" : request->reason();
    response->set_aborted(static_cast<uint32_t>(engine_.Abort(ids, reason)));
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* HealthCheck(grpc::CallbackServerContext* context,
                                        const v1::HealthCheckRequest* request,
                                        v1::HealthCheckResponse* response) override {
    if (grpc::Status auth = Authorize(context); !auth.ok()) {
      grpc::ServerUnaryReactor* rejected = context->DefaultReactor();
      rejected->Finish(auth);
      return rejected;
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (draining_.load()) {
      response->set_healthy(false);
      response->set_message("draining: finishing the streams in flight, admitting none");
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
    if (!request->deep()) {
      const bool ready = engine_.ready();
      response->set_healthy(ready);
      response->set_message(ready ? "ready" : "not ready: the rank group is not up yet (or is shutting down)");
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
    absl::Time deadline = absl::Now() + options_.deep_health_timeout;
    const auto client_deadline = context->deadline();
    if (client_deadline != std::chrono::system_clock::time_point::max()) {
      deadline = std::min(deadline, absl::FromChrono(client_deadline));
    }
    worker_.Post([this, reactor, response, deadline] {
      const absl::Status status = engine_.DeepHealthCheck(deadline);
      response->set_healthy(status.ok());
      response->set_message(status.ok() ? "ready; one-token forward through every rank ok"
                                        : absl::StrCat("deep check failed: ", status.ToString()));
      reactor->Finish(grpc::Status::OK);
    });
    return reactor;
  }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* /*request*/,
                                         v1::GetModelInfoResponse* response) override {
    if (grpc::Status auth = Authorize(context); !auth.ok()) {
      grpc::ServerUnaryReactor* rejected = context->DefaultReactor();
      rejected->Finish(auth);
      return rejected;
    }
    *response = engine_.GetModelInfo();
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* /*request*/,
                                          v1::GetServerInfoResponse* response) override {
    if (grpc::Status auth = Authorize(context); !auth.ok()) {
      grpc::ServerUnaryReactor* rejected = context->DefaultReactor();
      rejected->Finish(auth);
      return rejected;
    }
    *response = engine_.GetServerInfo();
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  // OK when no token is configured or the call carries the right one.
  grpc::Status Authorize(grpc::CallbackServerContext* context) const {
    if (expected_authorization_.empty()) return grpc::Status::OK;
    bool ok = false;
    auto range = context->client_metadata().equal_range("authorization");
    for (auto it = range.first; it != range.second; ++it) {
      ok |= ConstantTimeEquals(std::string_view(it->second.data(), it->second.size()),
                               expected_authorization_);
    }
    if (ok) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        range.first == range.second
                            ? "missing bearer token (metadata `authorization: Bearer <token>`)"
                            : "wrong bearer token");
  }

  Engine& engine_;
  const GenerationServiceOptions options_;
  const std::string expected_authorization_;  // "Bearer <token>", or empty: no check
  std::atomic<bool> draining_{false};
  std::atomic<int> active_generate_{0};
  std::atomic<uint64_t> next_id_{0};
  BlockingWorker worker_;  // last: joined first on destruction
};

GenerationService::GenerationService(Engine& engine, GenerationServiceOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

GenerationService::~GenerationService() = default;

grpc::Service* GenerationService::grpc_service() { return impl_.get(); }

void GenerationService::StartDraining() { impl_->StartDraining(); }

int GenerationService::active_generate_calls() const { return impl_->active_generate_calls(); }

}  // namespace exl3serve::coordinator
