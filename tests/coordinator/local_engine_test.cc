// The serving engine end to end on a small Llama model in this process:
// 64 concurrent greedy requests with mixed prompt lengths get exactly the
// tokens each gets alone (worker::Generate), also with a KV pool small enough
// to force preemption; aborted requests end with ABORT and their blocks come
// back; malformed requests are rejected naming the field; a full queue is
// ResourceExhausted; seeded sampling is reproducible; deadlines; a failing
// executor ends every request with an error and never hangs.
//
// Synchronisation: futures of each request's terminal response and a
// GatedExecutor that parks the scheduler thread inside Forward on request —
// never sleeps. Time for deadlines comes from a fake clock.
#include "coordinator/local_engine.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/cleanup/cleanup.h"
#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/generator.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::coordinator {
namespace {

constexpr absl::Duration kWait = absl::Seconds(120);  // per wait; a hang fails, not blocks

struct Model {
  testing::ScratchDir dir;
  std::string path;
  std::unique_ptr<worker::Transformer> transformer;
};
Model* model = nullptr;

// Wraps an executor; Hold() makes the next Forward wait (parked) until Release().
class GatedExecutor final : public worker::StepExecutor {
 public:
  explicit GatedExecutor(std::unique_ptr<worker::StepExecutor> inner) : inner_(std::move(inner)) {}
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  absl::Status AddSequence(int64_t id) override { return inner_->AddSequence(id); }
  absl::Status RemoveSequence(int64_t id) override { return inner_->RemoveSequence(id); }
  absl::Status AssignPages(int64_t id, std::span<const int32_t> pages) override {
    return inner_->AssignPages(id, pages);
  }
  std::optional<worker::KvCacheOptions> kv_options() const override {
    return inner_->kv_options();
  }
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override {
    Gate();
    return inner_->Forward(batch, rows, logits);
  }
  absl::Status AddSampledSequence(int64_t id, const worker::SequenceSampling& s) override {
    return inner_->AddSampledSequence(id, s);
  }
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t> sample,
                              std::vector<worker::SampledToken>* tokens) override {
    Gate();
    return inner_->ForwardSampled(batch, sample, tokens);
  }
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override {
    Gate();
    return inner_->ForwardVerified(batch, sample, draft_counts, runs);
  }
  void Gate() {
    absl::MutexLock lock(&mu_);
    if (held_) {
      parked_ = true;
      mu_.Await(absl::Condition(+[](bool* held) { return !*held; }, &held_));
      parked_ = false;
    }
  }
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  // Waits until a Forward is parked.
  bool WaitParked() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&parked_), kWait);
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }

 private:
  std::unique_ptr<worker::StepExecutor> inner_;
  absl::Mutex mu_;
  bool held_ = false;
  bool parked_ = false;
};

// Every response of one request; Wait() returns the terminal one.
class Stream {
 public:
  ResponseCallback Callback() {
    return [this](const v1::GenerateResponse& r) {
      absl::MutexLock lock(&mu_);
      responses_.push_back(r);
      if (r.has_chunk()) {
        ++chunks_;
        for (uint32_t id : r.chunk().token_ids()) streamed_.push_back(static_cast<int32_t>(id));
      } else {
        EXPECT_FALSE(done_) << "a second terminal response";
        done_ = true;
      }
    };
  }
  // The terminal response; fails the test (returns an empty one) on timeout.
  v1::GenerateResponse Wait() {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), kWait)) {
      ADD_FAILURE() << "no terminal response within " << kWait;
      return {};
    }
    return responses_.back();
  }
  bool WaitForChunk() {
    absl::MutexLock lock(&mu_);
    auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return chunks_ > 0 || done_; };
    return mu_.AwaitWithTimeout(absl::Condition(&has), kWait) && chunks_ > 0;
  }
  std::vector<int32_t> streamed() {
    absl::MutexLock lock(&mu_);
    return streamed_;
  }
  int chunks() {
    absl::MutexLock lock(&mu_);
    return chunks_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::GenerateResponse> responses_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> streamed_ ABSL_GUARDED_BY(mu_);
  int chunks_ ABSL_GUARDED_BY(mu_) = 0;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

std::vector<int32_t> Prompt(int n, uint32_t seed) {
  std::vector<int32_t> ids(n);
  uint32_t x = seed;
  for (int32_t& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % 1000);
  }
  return ids;
}

v1::GenerateRequest Request(const std::vector<int32_t>& prompt, int max_tokens,
                            const std::string& id = "") {
  v1::GenerateRequest r;
  r.set_request_id(id);
  for (int32_t t : prompt) r.mutable_tokenized()->add_input_ids(static_cast<uint32_t>(t));
  r.mutable_sampling_params()->set_max_tokens(max_tokens);
  r.mutable_sampling_params()->set_ignore_eos(true);
  return r;
}

// Greedy tokens of `prompt` run alone.
std::vector<int32_t> Alone(const std::vector<int32_t>& prompt, int max_tokens) {
  worker::KvCacheOptions kv;
  kv.dtype = worker::KvCacheDtype::kFp32;
  kv.num_pages = 64;
  auto cache = model->transformer->CreateKvCache(kv);
  EXPECT_TRUE(cache.ok());
  worker::GenerationOptions options;
  options.sampling.temperature = 0;
  options.max_new_tokens = max_tokens;
  std::vector<int32_t> out;
  auto done = worker::Generate(*model->transformer, &*cache, 0, prompt, options,
                               [&](const worker::GeneratedStep& s) {
                                 out.push_back(s.token.id);
                                 return true;
                               });
  EXPECT_TRUE(done.ok()) << done.status();
  return out;
}

std::vector<int32_t> Ids(const v1::GenerateComplete& c) {
  return std::vector<int32_t>(c.output_ids().begin(), c.output_ids().end());
}

// What the engine knows of the shared test model besides the executor.
EngineModel TestModelFacts() {
  EngineModel m;
  m.facts = {.arch = model->transformer->config().arch,
             .eos_token_ids = model->transformer->config().eos_token_ids};
  return m;
}

class LocalEngineTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    model = new Model();
    sharding::TestModelOptions options;  // llama, hidden 256, vocab 1000
    options.peaked_logits = true;
    options.seed = 21;
    model->path = model->dir.File("llama");
    ASSERT_TRUE(sharding::WriteTestModel(model->path, options).ok());
    auto loaded = worker::Transformer::Load(model->path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model->transformer = std::move(*loaded);
  }
  static void TearDownTestSuite() {
    delete model;
    model = nullptr;
  }

 protected:
  static EngineOptions Options(int64_t pages, int page_size) {
    EngineOptions options;
    options.model_dir = model->path;
    options.kv.dtype = worker::KvCacheDtype::kFp32;
    options.kv.num_pages = pages;
    options.kv.page_size_tokens = page_size;
    options.max_running = 16;
    options.step_token_budget = 48;
    options.max_queue = 1000;
    return options;
  }
  // An engine over the shared in-process model, behind a gate. The cache
  // takes pages only from the scheduler's block tables, as every rank does.
  std::unique_ptr<LocalEngine> Engine(const EngineOptions& options) {
    worker::KvCacheOptions kv = options.kv;
    kv.caller_assigns_pages = true;
    auto cache = model->transformer->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    auto gated = std::make_unique<GatedExecutor>(
        std::make_unique<worker::LocalStepExecutor>(model->transformer.get(), std::move(*cache)));
    gate_ = gated.get();
    EngineModel m = TestModelFacts();
    return std::make_unique<LocalEngine>(options, std::move(m), std::move(gated));
  }
  GatedExecutor* gate_ = nullptr;
};

TEST_F(LocalEngineTest, ConcurrentGreedyRequestsGetTheirLoneTokensDespitePreemption) {
  // 40 pages of 4 = 160 positions: 16 running sequences of up to 64 positions
  // cannot all fit, so decoding preempts.
  EngineOptions options = Options(40, 4);
  auto engine = Engine(options);
  constexpr int kRequests = 64;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int> max_tokens;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(1 + (i * 7) % 40, 100 + i));
    max_tokens.push_back(4 + (i * 5) % 21);
    streams.push_back(std::make_unique<Stream>());
    ASSERT_TRUE(engine->Submit(Request(prompts[i], max_tokens[i], absl::StrCat("r", i)),
                               streams[i]->Callback())
                    .ok());
  }
  for (int i = 0; i < kRequests; ++i) {
    v1::GenerateResponse r = streams[i]->Wait();
    ASSERT_TRUE(r.has_complete()) << i << ": " << r.DebugString();
    EXPECT_EQ(r.request_id(), absl::StrCat("r", i));
    EXPECT_EQ(r.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
    const std::vector<int32_t> alone = Alone(prompts[i], max_tokens[i]);
    EXPECT_EQ(Ids(r.complete()), alone) << "request " << i;
    EXPECT_EQ(streams[i]->streamed(), alone) << "request " << i;
    EXPECT_EQ(r.complete().prompt_tokens(), prompts[i].size());
    EXPECT_EQ(r.complete().completion_tokens(), alone.size());
    EXPECT_GE(r.complete().total_generation_time_seconds(),
              r.complete().time_to_first_token_seconds());
  }
  ASSERT_TRUE(engine->WaitForIdle(absl::Now() + kWait));
  const v1::GetServerInfoResponse info = engine->GetServerInfo();
  EXPECT_GT(info.num_preemptions(), 0u);
  EXPECT_EQ(info.kv_blocks_free(), info.kv_blocks_total());
  EXPECT_EQ(info.kv_blocks_total(), 40u);
  EXPECT_EQ(info.num_requests_running(), 0u);
  EXPECT_EQ(info.num_requests_waiting(), 0u);
  EXPECT_TRUE(info.ready());
}

TEST_F(LocalEngineTest, AbortedRequestsEndWithAbortAndReturnTheirBlocks) {
  auto engine = Engine(Options(256, 16));
  constexpr int kRequests = 12;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::vector<int32_t>> prompts;
  // Park the scheduler thread so every request is mid-stream when aborted:
  // the response that brings the last stream its first tokens holds the
  // gate, so the step after it parks (holding from the test thread after
  // waiting for the chunks let fast steps finish a request first).
  auto streams_started = std::make_shared<std::atomic<int>>(0);
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(3 + i, 7 + i));
    streams.push_back(std::make_unique<Stream>());
    auto started = std::make_shared<std::atomic<bool>>(false);
    ResponseCallback deliver = streams[i]->Callback();
    ResponseCallback callback = [this, deliver, started,
                                 streams_started](const v1::GenerateResponse& r) {
      deliver(r);
      if (r.has_chunk() && !started->exchange(true) && ++*streams_started == kRequests) {
        gate_->Hold();
      }
    };
    ASSERT_TRUE(engine->Submit(Request(prompts[i], 60, absl::StrCat("a", i)), callback).ok());
  }
  for (auto& s : streams) ASSERT_TRUE(s->WaitForChunk());
  ASSERT_TRUE(gate_->WaitParked());
  std::vector<std::string> victims;
  for (int i = 0; i < kRequests; i += 2) victims.push_back(absl::StrCat("a", i));
  victims.push_back("no-such-request");
  EXPECT_EQ(engine->Abort(victims, "test"), kRequests / 2);
  EXPECT_LT(engine->GetServerInfo().kv_blocks_free(), 256u);
  gate_->Release();
  for (int i = 0; i < kRequests; ++i) {
    v1::GenerateResponse r = streams[i]->Wait();
    ASSERT_TRUE(r.has_complete()) << r.DebugString();
    const std::vector<int32_t> alone = Alone(prompts[i], 60);
    if (i % 2 == 0) {
      EXPECT_EQ(r.complete().finish_reason(), v1::FINISH_REASON_ABORT);
      EXPECT_LT(r.complete().output_ids_size(), 60);
      const std::vector<int32_t> got = Ids(r.complete());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), alone.begin())) << "prefix of " << i;
    } else {
      EXPECT_EQ(r.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(Ids(r.complete()), alone);
    }
  }
  ASSERT_TRUE(engine->WaitForIdle(absl::Now() + kWait));
  const v1::GetServerInfoResponse info = engine->GetServerInfo();
  EXPECT_EQ(info.kv_blocks_free(), info.kv_blocks_total());
  EXPECT_EQ(engine->Abort({"a1"}, ""), 0);  // no longer live
}

TEST_F(LocalEngineTest, RejectsMalformedRequestsNamingTheField) {
  EngineOptions options = Options(16, 4);  // 64 positions
  auto engine = Engine(options);
  struct Case {
    std::string name;
    v1::GenerateRequest request;
    std::string field;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, std::string field, auto edit) {
    v1::GenerateRequest r = Request({1, 2, 3}, 4);
    edit(r);
    cases.push_back({std::move(name), std::move(r), std::move(field)});
  };
  add("no input", "input", [](v1::GenerateRequest& r) { r.clear_input(); });
  add("empty ids", "tokenized.input_ids",
      [](v1::GenerateRequest& r) { r.mutable_tokenized()->clear_input_ids(); });
  add("empty text", "text", [](v1::GenerateRequest& r) { r.set_text(""); });
  add("text without tokenizer", "text", [](v1::GenerateRequest& r) { r.set_text("hello"); });
  add("id outside vocab", "tokenized.input_ids",
      [](v1::GenerateRequest& r) { r.mutable_tokenized()->add_input_ids(1000); });
  add("negative max_tokens", "sampling_params.max_tokens",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(-1); });
  add("huge max_tokens", "sampling_params.max_tokens",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(1 << 30); });
  add("prompt + max_tokens over the context", "sampling_params.max_tokens",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(62); });
  add("oversize prompt", "input", [](v1::GenerateRequest& r) {
    for (int i = 0; i < 70; ++i) r.mutable_tokenized()->add_input_ids(5);
  });
  add("top_p > 1", "sampling_params.top_p",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(1.5f); });
  add("top_p < 0", "sampling_params.top_p",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(-0.5f); });
  add("negative temperature", "sampling_params.temperature",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(-1); });
  add("negative top_k", "sampling_params.top_k",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_k(-2); });
  add("min_p > 1", "sampling_params.min_p",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_min_p(1.5f); });
  add("negative repetition_penalty", "sampling_params.repetition_penalty",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_repetition_penalty(-1); });
  add("unknown stop token", "sampling_params.stop_token_ids",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->add_stop_token_ids(5000); });
  add("stop strings without tokenizer", "sampling_params.stop",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->add_stop("x"); });
  add("presence_penalty out of range", "presence_penalty",
      [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_presence_penalty(9); });
  add("negative deadline", "deadline_ms", [](v1::GenerateRequest& r) { r.set_deadline_ms(-5); });
  for (const Case& c : cases) {
    absl::Status s = engine->Submit(c.request, [](const v1::GenerateResponse&) {
      ADD_FAILURE() << "a rejected request got a response";
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.name << ": " << s;
  }
  // A duplicate live request_id.
  gate_->Hold();
  Stream first;
  ASSERT_TRUE(engine->Submit(Request({1, 2}, 4, "dup"), first.Callback()).ok());
  ASSERT_TRUE(gate_->WaitParked());
  absl::Status dup = engine->Submit(Request({1, 2}, 4, "dup"), [](const v1::GenerateResponse&) {});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument) << dup;
  EXPECT_NE(dup.message().find("request_id"), std::string::npos) << dup;
  gate_->Release();
  EXPECT_TRUE(first.Wait().has_complete());
  // Once it completed, the id can be used again.
  Stream again;
  ASSERT_TRUE(engine->Submit(Request({1, 2}, 4, "dup"), again.Callback()).ok());
  EXPECT_TRUE(again.Wait().has_complete());
}

TEST_F(LocalEngineTest, FullQueueIsResourceExhausted) {
  EngineOptions options = Options(64, 16);
  options.max_queue = 2;
  auto engine = Engine(options);
  gate_->Hold();
  Stream a, b, c;
  ASSERT_TRUE(engine->Submit(Request({1}, 3), a.Callback()).ok());
  ASSERT_TRUE(gate_->WaitParked());  // a runs; b and c wait
  ASSERT_TRUE(engine->Submit(Request({2}, 3), b.Callback()).ok());
  ASSERT_TRUE(engine->Submit(Request({3}, 3), c.Callback()).ok());
  absl::Status full = engine->Submit(Request({4}, 3), [](const v1::GenerateResponse&) {});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("max_queue"), std::string::npos) << full;
  EXPECT_EQ(engine->GetServerInfo().num_requests_waiting(), 2u);
  gate_->Release();
  EXPECT_TRUE(a.Wait().has_complete());
  EXPECT_TRUE(b.Wait().has_complete());
  EXPECT_TRUE(c.Wait().has_complete());
}

TEST_F(LocalEngineTest, SeededSamplingIsReproducible) {
  auto engine = Engine(Options(128, 16));
  auto sample = [&](uint64_t seed) {
    v1::GenerateRequest r = Request(Prompt(5, 3), 24);
    r.mutable_sampling_params()->set_temperature(3.0f);
    r.mutable_sampling_params()->set_top_k(50);
    r.mutable_sampling_params()->set_seed(seed);
    r.mutable_sampling_params()->set_logprobs(true);
    return r;
  };
  // The same seed alone and among other traffic.
  Stream s1, s2, other;
  ASSERT_TRUE(engine->Submit(sample(42), s1.Callback()).ok());
  v1::GenerateResponse r1 = s1.Wait();
  ASSERT_TRUE(engine->Submit(Request(Prompt(30, 9), 30), other.Callback()).ok());
  ASSERT_TRUE(engine->Submit(sample(42), s2.Callback()).ok());
  v1::GenerateResponse r2 = s2.Wait();
  ASSERT_TRUE(r1.has_complete() && r2.has_complete());
  EXPECT_EQ(Ids(r1.complete()), Ids(r2.complete()));
  EXPECT_EQ(r1.complete().output_ids_size(), 24);
  EXPECT_TRUE(other.Wait().has_complete());
}

TEST_F(LocalEngineTest, ExpiredDeadlineEndsTheRequestWithDeadlineExceeded) {
  std::atomic<int64_t> now_ns{absl::ToUnixNanos(absl::FromUnixSeconds(1000))};
  EngineOptions options = Options(64, 16);
  options.clock = [&now_ns] { return absl::FromUnixNanos(now_ns.load()); };
  auto engine = Engine(options);
  gate_->Hold();
  Stream a, b;
  ASSERT_TRUE(engine->Submit(Request({1, 2}, 5), a.Callback()).ok());
  ASSERT_TRUE(gate_->WaitParked());
  v1::GenerateRequest late = Request({3, 4}, 5);
  late.set_deadline_ms(1000);
  ASSERT_TRUE(engine->Submit(late, b.Callback()).ok());
  now_ns += absl::ToInt64Nanoseconds(absl::Seconds(2));
  gate_->Release();
  v1::GenerateResponse rb = b.Wait();
  ASSERT_TRUE(rb.has_error()) << rb.DebugString();
  EXPECT_EQ(rb.error().code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(a.Wait().has_complete());
  ASSERT_TRUE(engine->WaitForIdle(absl::Now() + kWait));
  EXPECT_EQ(engine->GetServerInfo().kv_blocks_free(), 64u);
}

TEST_F(LocalEngineTest, HealthModelInfoAndShutdown) {
  auto engine = Engine(Options(64, 16));
  EXPECT_TRUE(engine->DeepHealthCheck(absl::Now() + kWait).ok());
  const v1::GetModelInfoResponse info = engine->GetModelInfo();
  EXPECT_EQ(info.vocab_size(), 1000u);
  EXPECT_EQ(info.max_context_tokens(), 64u * 16u);
  EXPECT_EQ(info.num_layers(), 2u);
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
  // Shutdown while a request runs: it ends with ABORT; later submits fail.
  gate_->Hold();
  Stream running;
  ASSERT_TRUE(engine->Submit(Request({1, 2, 3}, 100), running.Callback()).ok());
  ASSERT_TRUE(gate_->WaitParked());
  std::thread stopper([&] { engine->Shutdown(); });
  gate_->Release();
  stopper.join();
  v1::GenerateResponse r = running.Wait();
  ASSERT_TRUE(r.has_complete());
  EXPECT_EQ(r.complete().finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_FALSE(engine->ready());
  EXPECT_EQ(engine->Submit(Request({1}, 1), [](const v1::GenerateResponse&) {}).code(),
            absl::StatusCode::kUnavailable);
  engine->Shutdown();  // idempotent
}

TEST_F(LocalEngineTest, CreateLocalEngineServesTheModelDirectory) {
  EngineOptions options = Options(64, 16);
  auto created = CreateLocalEngine(options);
  ASSERT_TRUE(created.ok()) << created.status();
  Stream s;
  const std::vector<int32_t> prompt = Prompt(9, 5);
  ASSERT_TRUE((*created)->Submit(Request(prompt, 12), s.Callback()).ok());
  v1::GenerateResponse r = s.Wait();
  ASSERT_TRUE(r.has_complete());
  EXPECT_EQ(Ids(r.complete()), Alone(prompt, 12));
  EXPECT_FALSE(r.request_id().empty());
  options.max_context = 64 * 16 + 1;
  EXPECT_EQ(CreateLocalEngine(options).status().code(), absl::StatusCode::kInvalidArgument);
}

// An executor whose rank "dies" after a few forwards.
class DyingExecutor final : public worker::StepExecutor {
 public:
  explicit DyingExecutor(int forwards_before_death) : left_(forwards_before_death) {}
  int64_t vocab_size() const override { return 1000; }
  absl::Status AddSequence(int64_t) override { return Check(); }
  absl::Status RemoveSequence(int64_t) override { return Check(); }
  absl::Status AssignPages(int64_t, std::span<const int32_t>) override { return Check(); }
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows,
                       std::vector<float>* logits) override {
    if (left_-- <= 0) dead_ = true;
    if (dead_) return Check();
    logits->assign(batch.size() * 1000, 0.0f);
    for (size_t i = 0; i < batch.size(); ++i) (*logits)[i * 1000 + batch[i].seq_id % 1000] = 10;
    return absl::OkStatus();
  }
  absl::Status AddSampledSequence(int64_t, const worker::SequenceSampling&) override {
    return Check();
  }
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t>,
                              std::vector<worker::SampledToken>* tokens) override {
    {
      // The first forward waits until the test has submitted everything, so
      // the death cannot come before the last Submit (a rank-side forward is
      // fast enough to beat the submitting thread).
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&armed_));
    }
    if (left_-- <= 0) dead_ = true;
    if (dead_) return Check();
    tokens->assign(batch.size(), worker::SampledToken{});
    for (size_t i = 0; i < batch.size(); ++i) (*tokens)[i].id = batch[i].seq_id % 1000;
    return absl::OkStatus();
  }

 private:
  absl::Status Check() const {
    return dead_ ? absl::UnavailableError("rank 1 (pid 4242) exited with status 9")
                 : absl::OkStatus();
  }
  int left_;
  bool dead_ = false;
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;

 public:
  // Lets forwards run (they wait for this).
  void Arm() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
  }
};

// An in-process executor (caller-assigned cache) that audits, after every
// forward, that the cache's page table of each sequence in the batch is
// exactly the list of pages the engine assigned to it (from the scheduler's
// block table), that no page is assigned to two live sequences, and that the
// cache's free pages are the rest.
// The in-process model with a cache whose pages the caller assigns (as
// every rank's), forwarding every call; the test executors below override
// what they watch or break.
class ForwardingExecutor : public worker::StepExecutor {
 public:
  explicit ForwardingExecutor(const worker::KvCacheOptions& kv) {
    worker::KvCacheOptions assigned = kv;
    assigned.caller_assigns_pages = true;
    auto cache = model->transformer->CreateKvCache(assigned);
    EXPECT_TRUE(cache.ok());
    inner_ = std::make_unique<worker::LocalStepExecutor>(model->transformer.get(),
                                                         std::move(*cache));
  }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  std::optional<worker::KvCacheOptions> kv_options() const override {
    return inner_->kv_options();
  }
  absl::Status AddSequence(int64_t id) override { return inner_->AddSequence(id); }
  absl::Status RemoveSequence(int64_t id) override { return inner_->RemoveSequence(id); }
  absl::Status AssignPages(int64_t id, std::span<const int32_t> pages) override {
    return inner_->AssignPages(id, pages);
  }
  absl::Status AddSampledSequence(int64_t id, const worker::SequenceSampling& s) override {
    return inner_->AddSampledSequence(id, s);
  }
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t> sample,
                              std::vector<worker::SampledToken>* tokens) override {
    return inner_->ForwardSampled(batch, sample, tokens);
  }
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override {
    return inner_->ForwardVerified(batch, sample, draft_counts, runs);
  }
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override {
    return inner_->Forward(batch, rows, logits);
  }
  absl::Status SaveKvBlocks(std::span<const worker::KvBlockTransfer> saves) override {
    return inner_->SaveKvBlocks(saves);
  }
  absl::Status SaveStateSnapshots(std::span<const worker::StateSnapshotSave> saves) override {
    return inner_->SaveStateSnapshots(saves);
  }
  absl::Status LoadKvBlocks(std::span<const worker::KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override {
    return inner_->LoadKvBlocks(loads, loaded);
  }

 protected:
  std::unique_ptr<worker::LocalStepExecutor> inner_;
};

class PageAuditExecutor final : public ForwardingExecutor {
 public:
  explicit PageAuditExecutor(const worker::KvCacheOptions& kv)
      : ForwardingExecutor(kv), num_pages_(kv.num_pages) {}
  absl::Status RemoveSequence(int64_t id) override {
    assigned_.erase(id);
    return inner_->RemoveSequence(id);
  }
  absl::Status AssignPages(int64_t id, std::span<const int32_t> pages) override {
    std::vector<int64_t>& table = assigned_[id];
    table.insert(table.end(), pages.begin(), pages.end());
    pages_assigned_ += static_cast<int64_t>(pages.size());
    return inner_->AssignPages(id, pages);
  }
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t> sample,
                              std::vector<worker::SampledToken>* tokens) override {
    absl::Status s = inner_->ForwardSampled(batch, sample, tokens);
    if (!s.ok()) return s;
    Audit(batch);
    return s;
  }
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override {
    absl::Status s = inner_->ForwardVerified(batch, sample, draft_counts, runs);
    if (!s.ok()) return s;
    Audit(batch);
    return s;
  }
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override {
    absl::Status s = inner_->Forward(batch, rows, logits);
    if (!s.ok()) return s;
    Audit(batch);
    return s;
  }
  // Every page table equals what was assigned; a page on several tables
  // (a shared cached prefix) has that many holders in the cache; the free
  // pages are the ones on no table.
  void Audit(std::span<const worker::SequenceTokens> batch) {
    std::map<int64_t, int> holders;
    for (const auto& [id, table] : assigned_) {
      for (int64_t page : table) ++holders[page];
    }
    for (const auto& [page, n] : holders) {
      if (inner_->cache().PageRefs(page) != n) ++mismatches_;
      if (n > 1) ++shared_pages_seen_;
    }
    for (const worker::SequenceTokens& entry : batch) {
      if (inner_->cache().PageTable(entry.seq_id) != assigned_[entry.seq_id]) ++mismatches_;
    }
    if (inner_->cache().free_pages() != num_pages_ - static_cast<int64_t>(holders.size())) {
      ++mismatches_;
    }
    ++audited_forwards_;
  }
  int64_t shared_pages_seen() const { return shared_pages_seen_.load(); }
  int64_t mismatches() const { return mismatches_.load(); }
  int64_t pages_assigned() const { return pages_assigned_.load(); }
  int64_t audited_forwards() const { return audited_forwards_.load(); }

 private:
  const int64_t num_pages_;
  std::map<int64_t, std::vector<int64_t>> assigned_;  // scheduler thread only
  std::atomic<int64_t> mismatches_{0}, pages_assigned_{0}, audited_forwards_{0};
  std::atomic<int64_t> shared_pages_seen_{0};
};

TEST_F(LocalEngineTest, TheCacheHoldsExactlyTheBlocksTheSchedulerAssigned) {
  EngineOptions options = Options(40, 4);  // small: preemption frees and reassigns blocks
  EngineModel m = TestModelFacts();
  auto owned = std::make_unique<PageAuditExecutor>(options.kv);
  PageAuditExecutor* audit = owned.get();
  auto engine = std::make_unique<LocalEngine>(options, std::move(m), std::move(owned));
  constexpr int kRequests = 24;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(1 + (i * 11) % 37, 500 + i));
    streams.push_back(std::make_unique<Stream>());
    ASSERT_TRUE(engine->Submit(Request(prompts[i], 3 + i % 17), streams[i]->Callback()).ok());
  }
  for (int i = 0; i < kRequests; ++i) {
    v1::GenerateResponse r = streams[i]->Wait();
    ASSERT_TRUE(r.has_complete()) << i << ": " << r.DebugString();
    EXPECT_EQ(Ids(r.complete()), Alone(prompts[i], 3 + i % 17)) << "request " << i;
  }
  ASSERT_TRUE(engine->WaitForIdle(absl::Now() + kWait));
  EXPECT_EQ(engine->GetServerInfo().kv_blocks_free(), 40u);
  EXPECT_GT(engine->GetServerInfo().num_preemptions(), 0u);
  EXPECT_GT(audit->audited_forwards(), 0);
  EXPECT_GT(audit->pages_assigned(), 40);  // blocks were freed and assigned again
  EXPECT_EQ(audit->mismatches(), 0);
  engine->Shutdown();
}

TEST_F(LocalEngineTest, AnExecutorWithAnotherKvLayoutIsRefused) {
  EngineOptions options = Options(64, 16);
  worker::KvCacheOptions theirs = options.kv;
  theirs.num_pages = 32;
  EngineModel m = TestModelFacts();
  auto engine = std::make_unique<LocalEngine>(options, std::move(m),
                                              std::make_unique<PageAuditExecutor>(theirs));
  const absl::Status refused =
      engine->Submit(Request({1, 2, 3}, 2), [](const v1::GenerateResponse&) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("32 pages of 16"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("64 pages of 16"), std::string::npos) << refused;
  EXPECT_FALSE(engine->ready());
  engine->Shutdown();
}

TEST_F(LocalEngineTest, AFailingExecutorEndsEveryRequestWithUnavailable) {
  EngineOptions options = Options(64, 16);
  EngineModel m = TestModelFacts();
  auto dying = std::make_unique<DyingExecutor>(5);
  DyingExecutor* executor = dying.get();
  auto engine = std::make_unique<LocalEngine>(options, std::move(m), std::move(dying));
  absl::Cleanup arm_on_any_exit = [executor] { executor->Arm(); };  // never leave it waiting
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < 8; ++i) {
    streams.push_back(std::make_unique<Stream>());
    ASSERT_TRUE(engine->Submit(Request(Prompt(4, i), 50), streams.back()->Callback()).ok());
  }
  executor->Arm();
  for (auto& s : streams) {
    v1::GenerateResponse r = s->Wait();
    ASSERT_TRUE(r.has_error()) << r.DebugString();
    EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kUnavailable));
    EXPECT_NE(r.error().message().find("rank 1"), std::string::npos) << r.error().message();
  }
  EXPECT_FALSE(engine->ready());
  EXPECT_FALSE(engine->GetServerInfo().ready());
  EXPECT_EQ(engine->Submit(Request({1}, 1), [](const v1::GenerateResponse&) {}).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine->DeepHealthCheck(absl::Now() + kWait).code(), absl::StatusCode::kUnavailable);
  engine->Shutdown();
}

// A real executor (the in-process model) whose "group" breaks after a few
// forwards and re-forms on Recover — with an empty cache, as new ranks would —
// once allowed (at once when `recoverable`).
class ReformingExecutor final : public worker::StepExecutor {
 public:
  ReformingExecutor(const worker::KvCacheOptions& kv, int forwards_before_death, bool recoverable)
      : kv_(kv), left_(forwards_before_death), recoverable_(recoverable) {
    Fresh();
  }
  int64_t vocab_size() const override { return model->transformer->vocab_size(); }
  absl::Status AddSequence(int64_t id) override {
    return dead_ ? Dead() : inner_->AddSequence(id);
  }
  absl::Status RemoveSequence(int64_t id) override {
    return dead_ ? Dead() : inner_->RemoveSequence(id);
  }
  absl::Status AssignPages(int64_t id, std::span<const int32_t> pages) override {
    return dead_ ? Dead() : inner_->AssignPages(id, pages);
  }
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override {
    WaitIfHeld();
    if (!dead_ && left_-- <= 0) dead_ = true;
    return dead_ ? Dead() : inner_->Forward(batch, rows, logits);
  }
  absl::Status AddSampledSequence(int64_t id, const worker::SequenceSampling& s) override {
    return dead_ ? Dead() : inner_->AddSampledSequence(id, s);
  }
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t> sample,
                              std::vector<worker::SampledToken>* tokens) override {
    WaitIfHeld();
    if (!dead_ && left_-- <= 0) dead_ = true;
    return dead_ ? Dead() : inner_->ForwardSampled(batch, sample, tokens);
  }
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override {
    WaitIfHeld();
    if (!dead_ && left_-- <= 0) dead_ = true;
    return dead_ ? Dead() : inner_->ForwardVerified(batch, sample, draft_counts, runs);
  }
  absl::Status Recover(absl::Time) override {
    if (!recoverable_.load()) return absl::UnavailableError("rank 1 is still missing");
    Fresh();
    dead_ = false;
    left_ = 1 << 30;
    ++recoveries_;
    return absl::OkStatus();
  }
  void AllowRecovery() { recoverable_.store(true); }
  int recoveries() const { return recoveries_.load(); }
  // After HoldForwards() (before the engine starts), every forward waits for
  // ReleaseForwards(): a test submits all its requests before the first step.
  void HoldForwards() { held_ = true; }
  void ReleaseForwards() {
    if (!released_.HasBeenNotified()) released_.Notify();
  }

 private:
  void WaitIfHeld() {
    if (held_) released_.WaitForNotification();
  }
  bool held_ = false;  // set before the engine's thread exists
  absl::Notification released_;
  static absl::Status Dead() { return absl::UnavailableError("rank 1 (pid 4242) exited"); }
  void Fresh() {
    worker::KvCacheOptions kv = kv_;
    kv.caller_assigns_pages = true;  // as every rank's
    auto cache = model->transformer->CreateKvCache(kv);
    ASSERT_TRUE(cache.ok());
    inner_ = std::make_unique<worker::LocalStepExecutor>(model->transformer.get(),
                                                         std::move(*cache));
  }
  const worker::KvCacheOptions kv_;
  std::unique_ptr<worker::LocalStepExecutor> inner_;
  int left_;
  bool dead_ = false;
  std::atomic<bool> recoverable_;
  std::atomic<int> recoveries_{0};
};

TEST_F(LocalEngineTest, InFlightRequestsAreReplayedWhenTheGroupReforms) {
  EngineOptions options = Options(40, 4);  // small: preemption and replay together
  EngineModel m = TestModelFacts();
  auto owned = std::make_unique<ReformingExecutor>(options.kv, 6, /*recoverable=*/true);
  ReformingExecutor* executor = owned.get();
  auto engine = std::make_unique<LocalEngine>(options, std::move(m), std::move(owned));
  constexpr int kRequests = 24;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(1 + (i * 7) % 30, 300 + i));
    streams.push_back(std::make_unique<Stream>());
    ASSERT_TRUE(engine->Submit(Request(prompts[i], 20), streams[i]->Callback()).ok());
  }
  for (int i = 0; i < kRequests; ++i) {
    v1::GenerateResponse r = streams[i]->Wait();
    ASSERT_TRUE(r.has_complete()) << i << ": " << r.DebugString();
    EXPECT_EQ(Ids(r.complete()), Alone(prompts[i], 20)) << "request " << i;
    EXPECT_EQ(streams[i]->streamed(), Ids(r.complete())) << "request " << i;
  }
  EXPECT_EQ(executor->recoveries(), 1);
  EXPECT_GT(engine->GetServerInfo().num_replays(), 0u);
  EXPECT_TRUE(engine->ready());
  ASSERT_TRUE(engine->WaitForIdle(absl::Now() + kWait));
  EXPECT_EQ(engine->GetServerInfo().kv_blocks_free(), 40u);
}

TEST_F(LocalEngineTest, ABrokenEngineIsReadyAgainOnceTheGroupReforms) {
  EngineOptions options = Options(64, 16);
  options.reform_timeout = absl::Milliseconds(50);
  EngineModel m = TestModelFacts();
  auto owned = std::make_unique<ReformingExecutor>(options.kv, 3, /*recoverable=*/false);
  ReformingExecutor* executor = owned.get();
  // All four are in before the first step (the group dies at the third, and
  // a broken engine refuses new requests).
  executor->HoldForwards();
  auto engine = std::make_unique<LocalEngine>(options, std::move(m), std::move(owned));
  absl::Cleanup release = [executor] { executor->ReleaseForwards(); };  // also on failure
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < 4; ++i) {
    streams.push_back(std::make_unique<Stream>());
    ASSERT_TRUE(engine->Submit(Request(Prompt(4, i), 30), streams.back()->Callback()).ok());
  }
  std::move(release).Invoke();
  for (auto& s : streams) {
    v1::GenerateResponse r = s->Wait();
    ASSERT_TRUE(r.has_error()) << r.DebugString();
    EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kUnavailable));
  }
  EXPECT_FALSE(engine->ready());
  executor->AllowRecovery();  // "rank 1 is back": the idle engine's next attempt succeeds
  const absl::Time deadline = absl::Now() + kWait;
  while (!engine->ready() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(engine->ready());
  EXPECT_EQ(engine->GetServerInfo().num_replays(), 0u);
  Stream again;
  const std::vector<int32_t> prompt = Prompt(6, 77);
  ASSERT_TRUE(engine->Submit(Request(prompt, 12), again.Callback()).ok());
  v1::GenerateResponse r = again.Wait();
  ASSERT_TRUE(r.has_complete()) << r.DebugString();
  EXPECT_EQ(Ids(r.complete()), Alone(prompt, 12));
  engine->Shutdown();
}

// Multi-turn chats through the prefix cache: conversations share one of two
// system prompts and re-send their whole history each turn; half sample
// with a seed. The KV pool is small (preemption), and in one run a rank
// dies mid-way (replay on a re-formed, empty group). Every output equals
// the cache-off engine's, token for token; the cache served tokens; page
// tables matched the scheduler's, shared pages included.
struct ChatRun {
  std::vector<std::vector<int32_t>> outputs;  // [conversation * turns + turn]
  uint64_t cached_tokens = 0;                 // sum over responses
  v1::GetServerInfoResponse info;
};

ChatRun RunChats(LocalEngine& engine) {
  constexpr int kConversations = 8, kTurns = 4;
  ChatRun run;
  std::vector<std::vector<int32_t>> history(kConversations);
  for (int c = 0; c < kConversations; ++c) history[c] = Prompt(13 + 8 * (c % 2), 900 + c % 2);
  for (int turn = 0; turn < kTurns; ++turn) {
    std::vector<std::unique_ptr<Stream>> streams;
    std::vector<std::vector<int32_t>> prompts;
    for (int c = 0; c < kConversations; ++c) {
      std::vector<int32_t> prompt = history[c];
      const std::vector<int32_t> user = Prompt(3 + (c + turn) % 5, 1000 + c * 10 + turn);
      prompt.insert(prompt.end(), user.begin(), user.end());
      prompts.push_back(prompt);
      v1::GenerateRequest r = Request(prompt, 5 + (c + turn) % 4, absl::StrCat("c", c, "t", turn));
      if (c % 2 == 1) {
        r.mutable_sampling_params()->set_temperature(1.5f);
        r.mutable_sampling_params()->set_top_k(40);
        r.mutable_sampling_params()->set_repetition_penalty(1.2f);
        r.mutable_sampling_params()->set_seed(77 + c * 100 + turn);
      }
      streams.push_back(std::make_unique<Stream>());
      EXPECT_TRUE(engine.Submit(r, streams.back()->Callback()).ok());
    }
    for (int c = 0; c < kConversations; ++c) {
      v1::GenerateResponse r = streams[c]->Wait();
      EXPECT_TRUE(r.has_complete()) << r.DebugString();
      const std::vector<int32_t> out = Ids(r.complete());
      EXPECT_EQ(streams[c]->streamed(), out);
      run.cached_tokens += r.complete().cached_tokens();
      EXPECT_LT(r.complete().cached_tokens(), r.complete().prompt_tokens());
      run.outputs.push_back(out);
      history[c] = prompts[c];
      history[c].insert(history[c].end(), out.begin(), out.end());
    }
  }
  EXPECT_TRUE(engine.WaitForIdle(absl::Now() + kWait));
  run.info = engine.GetServerInfo();
  return run;
}

TEST_F(LocalEngineTest, PrefixCacheGivesTheSameTokensAsRecomputingEveryPrompt) {
  EngineOptions off = Options(40, 4);  // 160 positions: chats of up to ~80 preempt
  off.enable_prefix_caching = false;
  const ChatRun reference = RunChats(*Engine(off));
  EXPECT_EQ(reference.cached_tokens, 0u);
  EXPECT_EQ(reference.info.prefix_cache_hits_tokens(), 0u);
  EXPECT_FALSE(reference.info.prefix_cache_enabled());

  EngineOptions on = Options(40, 4);
  ASSERT_TRUE(on.enable_prefix_caching);  // the default
  EngineModel m = TestModelFacts();
  auto owned = std::make_unique<PageAuditExecutor>(on.kv);
  PageAuditExecutor* audit = owned.get();
  auto engine = std::make_unique<LocalEngine>(on, std::move(m), std::move(owned));
  const ChatRun cached = RunChats(*engine);
  ASSERT_EQ(cached.outputs.size(), reference.outputs.size());
  for (size_t i = 0; i < cached.outputs.size(); ++i) {
    EXPECT_EQ(cached.outputs[i], reference.outputs[i]) << "conversation " << i / 4 << " turn " << i % 4;
  }
  EXPECT_GT(cached.cached_tokens, 0u);
  EXPECT_TRUE(cached.info.prefix_cache_enabled());
  EXPECT_GT(cached.info.prefix_cache_hits_tokens(), 0u);
  EXPECT_GE(cached.info.prefix_cache_queries_tokens(), cached.info.prefix_cache_hits_tokens());
  EXPECT_GT(cached.info.num_preemptions(), 0u);
  EXPECT_EQ(cached.info.kv_blocks_free(), 40u);
  EXPECT_EQ(audit->mismatches(), 0);
  EXPECT_GT(audit->shared_pages_seen(), 0);
  engine->Shutdown();

  // A rank dies after 25 forwards: the re-formed group's caches are empty.
  EngineModel m2 = TestModelFacts();
  auto dying = std::make_unique<ReformingExecutor>(on.kv, 25, /*recoverable=*/true);
  ReformingExecutor* reforming = dying.get();
  auto engine2 = std::make_unique<LocalEngine>(on, std::move(m2), std::move(dying));
  const ChatRun replayed = RunChats(*engine2);
  for (size_t i = 0; i < replayed.outputs.size(); ++i) {
    EXPECT_EQ(replayed.outputs[i], reference.outputs[i]) << "conversation " << i / 4 << " turn " << i % 4;
  }
  EXPECT_EQ(reforming->recoveries(), 1);
  EXPECT_GT(replayed.info.num_replays(), 0u);
  EXPECT_GT(replayed.info.prefix_cache_hits_tokens(), 0u);
}

// An in-process model with a real disk tier (worker/model/kv_disk_tier.h)
// whose file is corrupted under it: before every load, the slot of every
// second block loaded has one data byte flipped on disk.
class CorruptingDiskExecutor final : public ForwardingExecutor {
 public:
  CorruptingDiskExecutor(const worker::KvCacheOptions& kv, const std::string& path,
                         int64_t slots, bool corrupt)
      : ForwardingExecutor(kv), path_(path), corrupt_(corrupt) {
    auto tier = worker::KvDiskTier::Open(
        {.path = path, .slots = slots, .slot_bytes = inner_->cache().bytes_per_page()});
    EXPECT_TRUE(tier.ok()) << tier.status();
    inner_->set_disk_tier(std::move(*tier));
  }
  absl::Status LoadKvBlocks(std::span<const worker::KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override {
    if (corrupt_) {
      inner_->disk_tier()->Flush();  // what is queued reaches the file first
      const int64_t stride = worker::KvDiskTier::kHeaderBytes + inner_->cache().bytes_per_page();
      std::FILE* f = std::fopen(path_.c_str(), "r+b");
      EXPECT_NE(f, nullptr);
      for (const worker::KvBlockTransfer& t : loads) {
        if (loads_seen_++ % 2 == 0) continue;
        const long at = static_cast<long>(t.slot * stride + worker::KvDiskTier::kHeaderBytes + 5);
        std::fseek(f, at, SEEK_SET);
        const int c = std::fgetc(f);
        std::fseek(f, at, SEEK_SET);
        std::fputc(c ^ 0x40, f);
      }
      std::fclose(f);
    }
    return inner_->LoadKvBlocks(loads, loaded);
  }
  worker::KvDiskTierStats disk_stats() const { return inner_->disk_tier()->stats(); }

 private:
  std::string path_;
  bool corrupt_;
  int64_t loads_seen_ = 0;
};

TEST_F(LocalEngineTest, TheDiskTierGivesTheSameTokensAlsoWhenItsFileIsCorrupted) {
  EngineOptions off = Options(40, 4);
  off.enable_prefix_caching = false;
  const ChatRun reference = RunChats(*Engine(off));
  for (const bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupted file" : "intact file");
    testing::ScratchDir dir;
    EngineOptions on = Options(40, 4);  // too small for the chats: blocks go to disk
    on.kv_disk_path = dir.File("kv.bin");
    on.kv_disk_blocks = 256;
    EngineModel m = TestModelFacts();
    auto owned = std::make_unique<CorruptingDiskExecutor>(on.kv, on.kv_disk_path, 256, corrupt);
    CorruptingDiskExecutor* executor = owned.get();
    auto engine = std::make_unique<LocalEngine>(on, std::move(m), std::move(owned));
    const ChatRun run = RunChats(*engine);
    ASSERT_EQ(run.outputs.size(), reference.outputs.size());
    for (size_t i = 0; i < run.outputs.size(); ++i) {
      EXPECT_EQ(run.outputs[i], reference.outputs[i]) << "conversation " << i / 4 << " turn " << i % 4;
    }
    const v1::GetServerInfoResponse& info = run.info;
    EXPECT_EQ(info.prefix_cache_disk_capacity_blocks(), 256u);
    EXPECT_GT(info.prefix_cache_disk_saved_blocks(), 0u);
    EXPECT_GT(info.prefix_cache_disk_hit_blocks(), 0u);
    const worker::KvDiskTierStats stats = executor->disk_stats();
    EXPECT_GT(stats.hits, 0u);
    if (corrupt) {
      EXPECT_GT(info.prefix_cache_disk_miss_blocks(), 0u);
      EXPECT_GT(stats.checksum_failures, 0u);
    } else {
      EXPECT_EQ(info.prefix_cache_disk_miss_blocks(), 0u);
      EXPECT_EQ(stats.checksum_failures, 0u);
    }
    engine->Shutdown();
  }
}

TEST_F(LocalEngineTest, ARequestCanOptOutOfThePrefixCache) {
  auto engine = Engine(Options(64, 4));
  const std::vector<int32_t> prompt = Prompt(30, 4242);
  Stream first, second, opted_out;
  ASSERT_TRUE(engine->Submit(Request(prompt, 4), first.Callback()).ok());
  ASSERT_TRUE(first.Wait().has_complete());
  ASSERT_TRUE(engine->Submit(Request(prompt, 4), second.Callback()).ok());
  const v1::GenerateResponse r2 = second.Wait();
  ASSERT_TRUE(r2.has_complete());
  EXPECT_EQ(r2.complete().cached_tokens(), 28u);  // 7 full blocks of 4; the last token computed
  v1::GenerateRequest r = Request(prompt, 4);
  r.set_no_prefix_cache(true);
  ASSERT_TRUE(engine->Submit(r, opted_out.Callback()).ok());
  const v1::GenerateResponse r3 = opted_out.Wait();
  ASSERT_TRUE(r3.has_complete());
  EXPECT_EQ(r3.complete().cached_tokens(), 0u);
  EXPECT_EQ(Ids(r3.complete()), Ids(r2.complete()));
  EXPECT_EQ(Ids(r2.complete()), Alone(prompt, 4));
}

// --- Speculative decoding (n-gram drafts verified on the "ranks") ---

// 32 requests whose prompts repeat a span (what prompt lookup drafts
// from): greedy, seeded sampling with penalties, stop ids; submitted at once
// (batched) or one after another (alone).
struct SpecRun {
  std::vector<std::vector<int32_t>> outputs;
  std::vector<v1::FinishReason> reasons;
  int chunks = 0;
  v1::GetServerInfoResponse info;
};

SpecRun RunRepetitive(LocalEngine& engine, bool alone) {
  constexpr int kRequests = 32;
  SpecRun run;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kRequests; ++i) {
    const std::vector<int32_t> span = Prompt(4 + i % 7, 300 + i);
    std::vector<int32_t> prompt;
    for (int r = 0; r < 2 + i % 3; ++r) prompt.insert(prompt.end(), span.begin(), span.end());
    const std::vector<int32_t> tail = Prompt(i % 4, 700 + i);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    v1::GenerateRequest r = Request(prompt, 5 + (i * 5) % 29, absl::StrCat("s", i));
    if (i % 3 == 1) {
      r.mutable_sampling_params()->set_temperature(1.0f);
      r.mutable_sampling_params()->set_top_k(20);
      r.mutable_sampling_params()->set_repetition_penalty(1.1f);
      r.mutable_sampling_params()->set_seed(5000 + i);
      r.mutable_sampling_params()->set_logprobs(true);
    }
    if (i % 5 == 4) r.mutable_sampling_params()->add_stop_token_ids(static_cast<uint32_t>(span[1]));
    streams.push_back(std::make_unique<Stream>());
    EXPECT_TRUE(engine.Submit(r, streams.back()->Callback()).ok());
    if (alone) streams.back()->Wait();
  }
  for (int i = 0; i < kRequests; ++i) {
    const v1::GenerateResponse r = streams[i]->Wait();
    EXPECT_TRUE(r.has_complete()) << r.DebugString();
    run.outputs.push_back(Ids(r.complete()));
    run.reasons.push_back(r.complete().finish_reason());
    EXPECT_EQ(streams[i]->streamed(), run.outputs.back()) << "request " << i;
    run.chunks += streams[i]->chunks();
  }
  EXPECT_TRUE(engine.WaitForIdle(absl::Now() + kWait));
  run.info = engine.GetServerInfo();
  return run;
}

EngineOptions Speculative(EngineOptions options) {
  options.speculative = SpeculativeMethod::kNgram;
  options.draft_tokens = 5;
  options.draft_token_budget = 24;
  options.draft_governor = false;  // draft at every step the windows allow (coverage)
  return options;
}

TEST_F(LocalEngineTest, DraftedOutputIsTheOutputWithoutDraftsBatchedAndAlone) {
  const SpecRun reference = RunRepetitive(*Engine(Options(128, 4)), /*alone=*/false);
  EXPECT_EQ(reference.info.spec_decode_num_drafts(), 0u);
  EXPECT_EQ(reference.info.speculative_method(), "");
  for (const bool alone : {false, true}) {
    SCOPED_TRACE(alone ? "alone" : "batched");
    const SpecRun drafted = RunRepetitive(*Engine(Speculative(Options(128, 4))), alone);
    ASSERT_EQ(drafted.outputs.size(), reference.outputs.size());
    for (size_t i = 0; i < drafted.outputs.size(); ++i) {
      EXPECT_EQ(drafted.outputs[i], reference.outputs[i]) << "request " << i;
      EXPECT_EQ(drafted.reasons[i], reference.reasons[i]) << "request " << i;
    }
    EXPECT_EQ(drafted.info.speculative_method(), "ngram");
    EXPECT_GT(drafted.info.spec_decode_num_drafts(), 0u);
    EXPECT_GT(drafted.info.spec_decode_num_accepted_tokens(), 0u);
    EXPECT_LE(drafted.info.spec_decode_num_accepted_tokens(),
              drafted.info.spec_decode_num_draft_tokens());
    // An accepted run streams as one chunk: fewer chunks than tokens.
    EXPECT_LT(drafted.chunks, reference.chunks);
    EXPECT_EQ(drafted.info.kv_blocks_free(), drafted.info.kv_blocks_total());
  }
}

TEST_F(LocalEngineTest, DraftingThroughPreemptionThePrefixCacheAndAReplayGivesTheSameTokens) {
  EngineOptions off = Options(40, 4);  // small: decoding preempts
  off.enable_prefix_caching = false;
  const ChatRun reference = RunChats(*Engine(off));
  const EngineOptions on = Speculative(Options(40, 4));
  {
    auto owned = std::make_unique<PageAuditExecutor>(on.kv);
    PageAuditExecutor* audit = owned.get();
    auto engine = std::make_unique<LocalEngine>(on, TestModelFacts(), std::move(owned));
    const ChatRun drafted = RunChats(*engine);
    for (size_t i = 0; i < drafted.outputs.size(); ++i) {
      EXPECT_EQ(drafted.outputs[i], reference.outputs[i]) << "conversation " << i / 4 << " turn " << i % 4;
    }
    EXPECT_GT(drafted.info.num_preemptions(), 0u);
    EXPECT_GT(drafted.info.spec_decode_num_drafts(), 0u);
    EXPECT_EQ(drafted.info.kv_blocks_free(), 40u);
    EXPECT_EQ(audit->mismatches(), 0);
    engine->Shutdown();
  }
  // A rank dies after 25 forwards, drafts in flight.
  auto dying = std::make_unique<ReformingExecutor>(on.kv, 25, /*recoverable=*/true);
  ReformingExecutor* reforming = dying.get();
  auto engine = std::make_unique<LocalEngine>(on, TestModelFacts(), std::move(dying));
  const ChatRun replayed = RunChats(*engine);
  for (size_t i = 0; i < replayed.outputs.size(); ++i) {
    EXPECT_EQ(replayed.outputs[i], reference.outputs[i]) << "conversation " << i / 4 << " turn " << i % 4;
  }
  EXPECT_EQ(reforming->recoveries(), 1);
  EXPECT_GT(replayed.info.num_replays(), 0u);
}

// An executor that cannot verify drafts (an older rank group).
class NoVerifyExecutor final : public ForwardingExecutor {
 public:
  using ForwardingExecutor::ForwardingExecutor;
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens>, std::span<const uint8_t>,
                               std::span<const int32_t>,
                               std::vector<std::vector<worker::SampledToken>>*) override {
    ++refusals_;
    return absl::UnimplementedError("rank protocol v4 has no verification");
  }
  int refusals() const { return refusals_; }

 private:
  int refusals_ = 0;
};

TEST_F(LocalEngineTest, AnExecutorThatCannotVerifyServesWithoutDrafts) {
  const SpecRun reference = RunRepetitive(*Engine(Options(128, 4)), /*alone=*/false);
  const EngineOptions on = Speculative(Options(128, 4));
  EngineModel m = TestModelFacts();
  auto owned = std::make_unique<NoVerifyExecutor>(on.kv);
  NoVerifyExecutor* executor = owned.get();
  LocalEngine engine(on, std::move(m), std::move(owned));
  const SpecRun run = RunRepetitive(engine, /*alone=*/false);
  EXPECT_EQ(run.outputs, reference.outputs);
  EXPECT_EQ(executor->refusals(), 1);  // asked once, then never again
  EXPECT_EQ(run.info.spec_decode_num_drafts(), 0u);
}

// Rank 0 claims a draft token was accepted that was not the draft.
class LyingVerifier final : public ForwardingExecutor {
 public:
  using ForwardingExecutor::ForwardingExecutor;
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override {
    absl::Status s = inner_->ForwardVerified(batch, sample, draft_counts, runs);
    for (auto& run : *runs) {
      if (run.size() >= 2) run[0].id = (run[0].id + 1) % 1000;
    }
    return s;
  }
};

TEST_F(LocalEngineTest, ARunThatDoesNotMatchItsDraftIsAnInternalErrorNotACrash) {
  const EngineOptions on = Speculative(Options(128, 4));
  EngineModel m = TestModelFacts();
  LocalEngine engine(on, std::move(m), std::make_unique<LyingVerifier>(on.kv));
  // A prompt that repeats, so drafts are proposed and (truly) accepted.
  std::vector<int32_t> prompt;
  const std::vector<int32_t> span = Prompt(6, 11);
  for (int r = 0; r < 4; ++r) prompt.insert(prompt.end(), span.begin(), span.end());
  bool saw_error = false;
  for (int attempt = 0; attempt < 8 && !saw_error; ++attempt) {
    Stream stream;
    std::vector<int32_t> varied = prompt;
    varied.push_back(Prompt(1, 50 + attempt)[0]);
    ASSERT_TRUE(engine.Submit(Request(varied, 40), stream.Callback()).ok());
    const v1::GenerateResponse r = stream.Wait();
    if (r.has_error()) {
      EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kInternal));
      EXPECT_NE(r.error().message().find("where its draft was"), std::string::npos)
          << r.error().message();
      saw_error = true;
    }
  }
  EXPECT_TRUE(saw_error);
  EXPECT_TRUE(engine.WaitForIdle(absl::Now() + kWait));
  EXPECT_TRUE(engine.ready());
}

TEST_F(LocalEngineTest, SpeculativeOptionsAreValidated) {
  EngineOptions options = Speculative(Options(64, 16));
  options.draft_tokens = kMaxDraftTokens + 1;
  EXPECT_EQ(CreateLocalEngine(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.draft_tokens = 0;
  EXPECT_EQ(CreateLocalEngine(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.draft_tokens = 4;
  options.draft_token_budget = 0;
  EXPECT_EQ(CreateLocalEngine(options).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSpeculativeMethod("medusa").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseSpeculativeMethod("ngram"), SpeculativeMethod::kNgram);
}

// A draft model in this process: the target itself (greedy drafts of the
// same model: long accepted runs) or another random model (mostly rejected).
std::unique_ptr<DraftModel> InProcessDraft(const worker::Transformer* draft) {
  worker::KvCacheOptions kv;
  kv.dtype = worker::KvCacheDtype::kFp32;
  kv.num_pages = 256;
  kv.page_size_tokens = 16;
  auto cache = draft->CreateKvCache(kv);
  EXPECT_TRUE(cache.ok());
  return std::make_unique<DraftModel>(
      std::make_unique<worker::LocalStepExecutor>(draft, std::move(*cache)));
}

TEST_F(LocalEngineTest, DraftModelOutputIsTheOutputWithoutDrafts) {
  const SpecRun reference = RunRepetitive(*Engine(Options(128, 4)), /*alone=*/false);
  testing::ScratchDir dir;
  sharding::TestModelOptions other;
  other.peaked_logits = true;
  other.seed = 99;  // another random model: its drafts are mostly wrong
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("other"), other).ok());
  auto other_model = worker::Transformer::Load(dir.File("other"));
  ASSERT_TRUE(other_model.ok()) << other_model.status();
  for (const bool same_model : {true, false}) {
    SCOPED_TRACE(same_model ? "draft = target" : "draft = another model");
    EngineOptions options = Speculative(Options(128, 4));
    options.speculative = SpeculativeMethod::kDraftModel;
    EngineModel m = TestModelFacts();
    auto executor = std::make_unique<ForwardingExecutor>(options.kv);
    LocalEngine engine(options, std::move(m), std::move(executor),
                       InProcessDraft(same_model ? model->transformer.get() : other_model->get()));
    const SpecRun drafted = RunRepetitive(engine, /*alone=*/false);
    ASSERT_EQ(drafted.outputs.size(), reference.outputs.size());
    for (size_t i = 0; i < drafted.outputs.size(); ++i) {
      EXPECT_EQ(drafted.outputs[i], reference.outputs[i]) << "request " << i;
      EXPECT_EQ(drafted.reasons[i], reference.reasons[i]) << "request " << i;
    }
    EXPECT_EQ(drafted.info.speculative_method(), "draft");
    EXPECT_GT(drafted.info.spec_decode_num_drafts(), 0u);
    const double rate = static_cast<double>(drafted.info.spec_decode_num_accepted_tokens()) /
                        static_cast<double>(drafted.info.spec_decode_num_draft_tokens());
    if (same_model) {
      // Greedy requests draft their own tokens; sampled ones less often.
      EXPECT_GT(rate, 0.5) << drafted.info.DebugString();
    }
    EXPECT_EQ(drafted.info.kv_blocks_free(), drafted.info.kv_blocks_total());
  }
}

TEST_F(LocalEngineTest, ADraftModelIsRefusedWithoutItsDirectoryOrWithAnotherVocabulary) {
  EngineOptions options = Speculative(Options(64, 16));
  options.speculative = SpeculativeMethod::kDraftModel;
  EXPECT_EQ(CreateLocalEngine(options).status().code(), absl::StatusCode::kInvalidArgument);
  testing::ScratchDir dir;
  sharding::TestModelOptions small;
  small.vocab_size = 500;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("small"), small).ok());
  options.draft_model_dir = dir.File("small");
  const absl::Status refused = CreateLocalEngine(options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("same tokenizer"), std::string::npos) << refused;
  // The target itself as its draft: served.
  options.draft_model_dir = model->path;
  auto engine = CreateLocalEngine(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Stream s;
  ASSERT_TRUE((*engine)->Submit(Request(Prompt(9, 4), 12), s.Callback()).ok());
  const v1::GenerateResponse r = s.Wait();
  ASSERT_TRUE(r.has_complete());
  EXPECT_EQ(Ids(r.complete()), Alone(Prompt(9, 4), 12));
  EXPECT_EQ((*engine)->GetServerInfo().speculative_method(), "draft");
}

}  // namespace
}  // namespace exl3serve::coordinator
