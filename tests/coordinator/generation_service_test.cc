// The gRPC front door over a fake Engine, through a real in-process server on
// 127.0.0.1 (port 0) and real client stubs: stream order, cancellation turning
// into Engine::Abort, Submit errors becoming status codes, and the standard
// health service following Engine::ready(). No sleeps: every wait is on a
// condition with a deadline, or on a gRPC read.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/engine.h"
#include "coordinator/grpc_server.h"
#include "exl3serve/v1/generation.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

constexpr absl::Duration kWait = absl::Seconds(20);  // generous: CI machines are shared

// An Engine that records what it is asked and lets the test play the
// scheduler: the test sends responses through the stored callbacks.
class FakeEngine : public Engine {
 public:
  struct Submitted {
    v1::GenerateRequest request;
    ResponseCallback callback;
  };

  absl::Status Submit(const v1::GenerateRequest& request, ResponseCallback on_response) override {
    absl::MutexLock lock(&mu_);
    if (!submit_status_.ok()) return submit_status_;
    submitted_.push_back({request, std::move(on_response)});
    return absl::OkStatus();
  }
  int Abort(const std::vector<std::string>& request_ids, const std::string& reason) override {
    absl::MutexLock lock(&mu_);
    aborted_.insert(aborted_.end(), request_ids.begin(), request_ids.end());
    return static_cast<int>(request_ids.size());
  }
  v1::GetModelInfoResponse GetModelInfo() const override {
    v1::GetModelInfoResponse info;
    info.set_architecture("FakeForCausalLM");
    info.set_vocab_size(1000);
    return info;
  }
  v1::GetServerInfoResponse GetServerInfo() const override {
    v1::GetServerInfoResponse info;
    info.set_kv_blocks_total(64);
    info.set_kv_blocks_free(60);
    info.set_ready(ready_.load());
    return info;
  }
  bool ready() const override { return ready_.load(); }
  absl::Status DeepHealthCheck(absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    return deep_status_;
  }
  void Shutdown() override {}

  void set_ready(bool ready) { ready_.store(ready); }
  void set_submit_status(absl::Status s) {
    absl::MutexLock lock(&mu_);
    submit_status_ = std::move(s);
  }
  void set_deep_status(absl::Status s) {
    absl::MutexLock lock(&mu_);
    deep_status_ = std::move(s);
  }
  // Waits until request number `index` (0-based) has been submitted.
  bool WaitSubmitted(size_t index, Submitted* out) {
    absl::MutexLock lock(&mu_);
    auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return submitted_.size() > index; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&arrived), kWait)) return false;
    *out = submitted_[index];
    return true;
  }
  // Waits until some Abort named `id`.
  bool WaitAborted(const std::string& id) {
    absl::MutexLock lock(&mu_);
    auto named = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(aborted_.begin(), aborted_.end(), id) != aborted_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&named), kWait);
  }
  std::vector<std::string> aborted() {
    absl::MutexLock lock(&mu_);
    return aborted_;
  }

 private:
  std::atomic<bool> ready_{true};
  absl::Mutex mu_;
  absl::Status submit_status_ ABSL_GUARDED_BY(mu_);
  absl::Status deep_status_ ABSL_GUARDED_BY(mu_);
  std::vector<Submitted> submitted_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> aborted_ ABSL_GUARDED_BY(mu_);
};

v1::GenerateResponse Chunk(const std::string& id, uint32_t token, uint32_t count) {
  v1::GenerateResponse r;
  r.set_request_id(id);
  r.mutable_chunk()->add_token_ids(token);
  r.mutable_chunk()->set_text("t" + std::to_string(token) + " ");
  r.mutable_chunk()->set_completion_tokens(count);
  return r;
}

v1::GenerateResponse Complete(const std::string& id, v1::FinishReason reason) {
  v1::GenerateResponse r;
  r.set_request_id(id);
  r.mutable_complete()->set_finish_reason(reason);
  return r;
}

class GenerationServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GrpcServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.readiness_poll_interval = absl::Milliseconds(10);
    auto server = GrpcServer::Start(engine_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::Generation::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(2));
  }
  static void SetDeadline(grpc::ClientContext& context) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  }
  v1::GenerateRequest Request(const std::string& id) {
    v1::GenerateRequest request;
    request.set_request_id(id);
    request.set_text("hello");
    return request;
  }

  FakeEngine engine_;
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(GenerationServiceTest, StreamsEveryTokenInOrderThenCompletes) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub_->Generate(&context, Request("r1"));
  FakeEngine::Submitted submitted;
  ASSERT_TRUE(engine_.WaitSubmitted(0, &submitted));
  EXPECT_EQ(submitted.request.request_id(), "r1");
  constexpr uint32_t kTokens = 200;
  std::thread scheduler([&] {
    for (uint32_t i = 0; i < kTokens; ++i) submitted.callback(Chunk("r1", i, i + 1));
    submitted.callback(Complete("r1", v1::FINISH_REASON_LENGTH));
  });
  std::vector<uint32_t> tokens;
  std::string text;
  v1::GenerateResponse response;
  int completes = 0;
  uint32_t last_count = 0;
  while (reader->Read(&response)) {
    EXPECT_EQ(response.request_id(), "r1");
    ASSERT_EQ(completes, 0) << "a message after the complete";
    if (response.has_chunk()) {
      tokens.insert(tokens.end(), response.chunk().token_ids().begin(),
                    response.chunk().token_ids().end());
      text += response.chunk().text();
      last_count = response.chunk().completion_tokens();
    } else {
      ASSERT_TRUE(response.has_complete());
      EXPECT_EQ(response.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
      ++completes;
    }
  }
  scheduler.join();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(completes, 1);
  ASSERT_EQ(tokens.size(), kTokens);  // chunks may be merged, never lost
  std::string want_text;
  for (uint32_t i = 0; i < kTokens; ++i) {
    EXPECT_EQ(tokens[i], i);
    want_text += "t" + std::to_string(i) + " ";
  }
  EXPECT_EQ(text, want_text);
  EXPECT_EQ(last_count, kTokens);
}

TEST_F(GenerationServiceTest, AssignsARequestIdWhenTheClientGivesNone) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub_->Generate(&context, Request(""));
  FakeEngine::Submitted submitted;
  ASSERT_TRUE(engine_.WaitSubmitted(0, &submitted));
  EXPECT_FALSE(submitted.request.request_id().empty());
  submitted.callback(Complete(submitted.request.request_id(), v1::FINISH_REASON_EOS));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.request_id(), submitted.request.request_id());
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(GenerationServiceTest, ClientCancelAbortsTheRequestInTheEngine) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub_->Generate(&context, Request("cancel-me"));
  FakeEngine::Submitted submitted;
  ASSERT_TRUE(engine_.WaitSubmitted(0, &submitted));
  submitted.callback(Chunk("cancel-me", 5, 1));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  EXPECT_TRUE(engine_.WaitAborted("cancel-me"));
  // The engine still finishes its side; the response goes nowhere.
  submitted.callback(Complete("cancel-me", v1::FINISH_REASON_ABORT));
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(GenerationServiceTest, SubmitErrorsBecomeTheCallsStatus) {
  const std::vector<absl::Status> errors = {
      absl::InvalidArgumentError("sampling_params.top_p: 1.5 is outside (0, 1]"),
      absl::ResourceExhaustedError("queue full: 64 requests waiting (max_queue 64)"),
      absl::UnavailableError("not ready: rank 1 is loading"),
  };
  for (const absl::Status& error : errors) {
    engine_.set_submit_status(error);
    grpc::ClientContext context;
    SetDeadline(context);
    auto reader = stub_->Generate(&context, Request("bad"));
    v1::GenerateResponse response;
    EXPECT_FALSE(reader->Read(&response));
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(static_cast<int>(status.error_code()), static_cast<int>(error.code()));
    EXPECT_EQ(status.error_message(), error.message());
  }
}

TEST_F(GenerationServiceTest, AnErrorResponseEndsTheCallWithItsCode) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub_->Generate(&context, Request("r2"));
  FakeEngine::Submitted submitted;
  ASSERT_TRUE(engine_.WaitSubmitted(0, &submitted));
  submitted.callback(Chunk("r2", 1, 1));
  v1::GenerateResponse error;
  error.set_request_id("r2");
  error.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  error.mutable_error()->set_message("rank 1 died; not replayed within 30 s");
  submitted.callback(error);
  v1::GenerateResponse response;
  bool saw_error = false;
  while (reader->Read(&response)) saw_error = saw_error || response.has_error();
  EXPECT_TRUE(saw_error);
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "rank 1 died; not replayed within 30 s");
}

TEST_F(GenerationServiceTest, ManyConcurrentStreamsEachGetTheirOwnTokens) {
  constexpr int kStreams = 16;
  constexpr uint32_t kTokens = 50;
  std::vector<std::thread> clients;
  std::vector<std::vector<uint32_t>> got(kStreams);
  std::vector<bool> ok(kStreams, false);
  for (int s = 0; s < kStreams; ++s) {
    clients.emplace_back([&, s] {
      grpc::ClientContext context;
      SetDeadline(context);
      auto reader = stub_->Generate(&context, Request("s" + std::to_string(s)));
      v1::GenerateResponse response;
      while (reader->Read(&response)) {
        for (uint32_t t : response.chunk().token_ids()) got[s].push_back(t);
      }
      ok[s] = reader->Finish().ok();
    });
  }
  // One "scheduler thread" interleaves every stream, as the engine does.
  std::vector<FakeEngine::Submitted> all(kStreams);
  for (int s = 0; s < kStreams; ++s) ASSERT_TRUE(engine_.WaitSubmitted(s, &all[s]));
  for (uint32_t i = 0; i < kTokens; ++i) {
    for (auto& sub : all) {
      const int s = std::stoi(sub.request.request_id().substr(1));
      sub.callback(Chunk(sub.request.request_id(), 1000 * s + i, i + 1));
    }
  }
  for (auto& sub : all) sub.callback(Complete(sub.request.request_id(), v1::FINISH_REASON_LENGTH));
  for (auto& c : clients) c.join();
  for (int s = 0; s < kStreams; ++s) {
    EXPECT_TRUE(ok[s]);
    ASSERT_EQ(got[s].size(), kTokens) << "stream " << s;
    for (uint32_t i = 0; i < kTokens; ++i) EXPECT_EQ(got[s][i], 1000u * s + i);
  }
}

TEST_F(GenerationServiceTest, AbortAndInfoCallsReachTheEngine) {
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::AbortRequest request;
    request.add_request_ids("a");
    request.add_request_ids("b");
    v1::AbortResponse response;
    ASSERT_TRUE(stub_->Abort(&context, request, &response).ok());
    EXPECT_EQ(response.aborted(), 2u);
    EXPECT_EQ(engine_.aborted(), (std::vector<std::string>{"a", "b"}));
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::GetModelInfoResponse response;
    ASSERT_TRUE(stub_->GetModelInfo(&context, {}, &response).ok());
    EXPECT_EQ(response.architecture(), "FakeForCausalLM");
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::GetServerInfoResponse response;
    ASSERT_TRUE(stub_->GetServerInfo(&context, {}, &response).ok());
    EXPECT_EQ(response.kv_blocks_total(), 64u);
    EXPECT_EQ(response.kv_blocks_free(), 60u);
  }
}

TEST_F(GenerationServiceTest, HealthCheckShallowFollowsReadyAndDeepRunsTheEngineCheck) {
  auto check = [&](bool deep) {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::HealthCheckRequest request;
    request.set_deep(deep);
    v1::HealthCheckResponse response;
    EXPECT_TRUE(stub_->HealthCheck(&context, request, &response).ok());
    return response;
  };
  engine_.set_ready(false);
  EXPECT_FALSE(check(false).healthy());
  engine_.set_ready(true);
  EXPECT_TRUE(check(false).healthy());
  EXPECT_TRUE(check(true).healthy());
  engine_.set_deep_status(absl::DeadlineExceededError("rank 1 did not answer the probe step"));
  const v1::HealthCheckResponse deep = check(true);
  EXPECT_FALSE(deep.healthy());
  EXPECT_NE(deep.message().find("rank 1 did not answer"), std::string::npos) << deep.message();
}

TEST_F(GenerationServiceTest, StandardHealthServiceFollowsEngineReadiness) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  engine_.set_ready(false);
  // Watch streams the current status and then every change: a handshake, no polling.
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("exl3serve.v1.Generation");
  auto watch = health->Watch(&context, request);
  grpc::health::v1::HealthCheckResponse response;
  // The server started while ready() was true: SERVING may come first.
  do {
    ASSERT_TRUE(watch->Read(&response));
  } while (response.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  {
    grpc::ClientContext check_context;
    SetDeadline(check_context);
    grpc::health::v1::HealthCheckResponse now;
    ASSERT_TRUE(health->Check(&check_context, {}, &now).ok());
    EXPECT_EQ(now.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  }
  engine_.set_ready(true);
  // (A status may be repeated: gRPC notifies watchers on every set.)
  do {
    ASSERT_TRUE(watch->Read(&response)) << "the watch ended before SERVING";
  } while (response.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  context.TryCancel();
  while (watch->Read(&response)) {
  }
  (void)watch->Finish();
}

TEST(GrpcServerTest, ReportsAnAddressInUse) {
  FakeEngine engine;
  GrpcServerOptions options;
  options.port = 0;
  auto first = GrpcServer::Start(engine, options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.port = (*first)->port();
  auto second = GrpcServer::Start(engine, options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(std::to_string(options.port)), std::string::npos);
}

}  // namespace
}  // namespace exl3serve::coordinator
