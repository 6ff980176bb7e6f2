// The coordinator's rank membership end to end: an in-process RemoteRankGroup
// endpoint on 127.0.0.1 (port 0) and real `exl3serve worker --coordinator`
// rank processes on a small test model. Ranks register -> ready; Forward
// logits match the model run in this process; ForwardVerified (speculative
// verification) gives the in-process runs and serial decoding; a rank killed with SIGKILL
// fails the step with UNAVAILABLE within the deadline, tears the group down
// and leaves no process behind; restarted ranks re-form the group; a protocol
// version mismatch and a KV layout mismatch are refused (the rank exits); a
// missing rank leaves the group not ready without hanging. Every wait has a
// deadline; nothing sleeps.
#include "coordinator/rank_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/verified_script.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::coordinator {
namespace {

using worker::LogitsRows;
using worker::SequenceTokens;

// Generous bounds for a loaded 2-core CI box; the checks are "within the
// deadline", not speed.
constexpr absl::Duration kReadyTimeout = absl::Seconds(90);
constexpr absl::Duration kStepTimeout = absl::Seconds(20);
constexpr absl::Duration kExitTimeout = absl::Seconds(30);

// A rank process started by the test. Killed (SIGKILL) and reaped when the
// test ends, whatever happened; PR_SET_PDEATHSIG also kills it if the test
// process dies. With `stderr_path` its stderr goes to that file.
class RankProcess {
 public:
  RankProcess(const std::string& address, int rank, std::vector<std::string> extra,
              const std::string& stderr_path = "") {
    std::vector<std::string> args = {EXL3_EXE, "worker", "--coordinator", address, "--rank",
                                     absl::StrCat(rank), "--connect-timeout-ms", "30000"};
    args.insert(args.end(), extra.begin(), extra.end());
    const pid_t parent = getpid();
    const char* err_path = stderr_path.empty() ? nullptr : stderr_path.c_str();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      if (err_path != nullptr) {
        const int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 2) < 0) _exit(126);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~RankProcess() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;

  pid_t pid() const { return pid_; }
  void Kill() { kill(pid_, SIGKILL); }
  // Waits (pidfd poll, bounded) for the process to exit; true when it did.
  bool WaitExit(absl::Duration timeout, int* status) {
    if (reaped_) {
      *status = status_;
      return true;
    }
    const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
      close(pidfd);
    }
    if (waitpid(pid_, &status_, WNOHANG) == pid_) {
      reaped_ = true;
      *status = status_;
      return true;
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

struct Model {
  testing::ScratchDir dir;
  std::string path;
};
Model* model = nullptr;

class RankGroupTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    model = new Model();
    sharding::TestModelOptions options;  // llama: hidden 256, 4 heads, 2 kv heads
    options.seed = 21;
    model->path = model->dir.File("llama");
    ASSERT_TRUE(sharding::WriteTestModel(model->path, options).ok());
  }
  static void TearDownTestSuite() {
    delete model;
    model = nullptr;
  }

 protected:
  static RankGroupOptions Options(int world_size) {
    RankGroupOptions options;
    options.listen_address = "127.0.0.1:0";
    options.model_dir = model->path;
    options.world_size = world_size;
    options.kv.dtype = worker::KvCacheDtype::kFp32;
    options.kv.num_pages = 64;
    options.threads_per_rank = 1;
    options.join_timeout = absl::Seconds(30);
    options.collective_timeout = absl::Seconds(10);
    options.step_timeout = kStepTimeout;
    options.heartbeat_interval = absl::Milliseconds(200);
    options.heartbeat_timeout = absl::Seconds(5);
    return options;
  }
  static std::string Address(const RemoteRankGroup& group) {
    return absl::StrCat("127.0.0.1:", group.port());
  }
};

std::vector<int32_t> Prompt(int n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids(n);
  uint32_t x = seed;
  for (int32_t& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % vocab);
  }
  return ids;
}

// KV pages for n positions of the default 16-position pages, deliberately
// out of order (the ranks place the sequence on exactly these).
std::vector<int32_t> PagesFor(int n) {
  std::vector<int32_t> pages;
  for (int i = 0; i < (n + 15) / 16; ++i) pages.push_back(40 - 3 * i);
  return pages;
}

// Logits of every prompt position in sequence `seq`.
absl::StatusOr<std::vector<float>> PrefillLogits(worker::StepExecutor& executor, int64_t seq,
                                                 const std::vector<int32_t>& prompt) {
  absl::Status added = executor.AddSequence(seq);
  if (!added.ok()) return added;
  added = executor.AssignPages(seq, PagesFor(static_cast<int>(prompt.size())));
  if (!added.ok()) return added;
  const SequenceTokens entry{seq, prompt};
  std::vector<float> logits;
  absl::Status s = executor.Forward({&entry, 1}, LogitsRows::kAllTokens, &logits);
  if (!s.ok()) return s;
  s = executor.RemoveSequence(seq);
  if (!s.ok()) return s;
  return logits;
}

std::vector<float> LocalLogits(const std::vector<int32_t>& prompt) {
  absl::StatusOr<std::unique_ptr<worker::Transformer>> local = worker::Transformer::Load(model->path);
  EXPECT_TRUE(local.ok()) << local.status();
  if (!local.ok()) return {};
  worker::KvCacheOptions kv;
  kv.dtype = worker::KvCacheDtype::kFp32;
  kv.num_pages = 64;
  absl::StatusOr<worker::PagedKvCache> cache = (*local)->CreateKvCache(kv);
  EXPECT_TRUE(cache.ok());
  worker::LocalStepExecutor executor(local->get(), std::move(*cache));
  absl::StatusOr<std::vector<float>> logits = PrefillLogits(executor, 1, prompt);
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *logits : std::vector<float>();
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

TEST_F(RankGroupTest, TwoRanksRegisterAndForwardMatchesOneProcess) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_FALSE((*group)->ready());
  RankProcess r0(Address(**group), 0, {"--world-size", "2"});
  RankProcess r1(Address(**group), 1, {});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_EQ((*group)->generation(), 1u);
  EXPECT_EQ((*group)->vocab_size(), 1000);
  const RankGroupStatus status = (*group)->status();
  ASSERT_EQ(status.ranks.size(), 2u);
  for (const RankSlotInfo& info : status.ranks) {
    EXPECT_TRUE(info.up);
    EXPECT_TRUE(info.loaded);
    EXPECT_NE(info.address.find("pid"), std::string::npos) << info.address;
    EXPECT_LT(info.last_heartbeat_age, absl::Seconds(5));
  }

  const std::vector<int32_t> prompt = Prompt(17, 1000, 5);
  const std::vector<float> reference = LocalLogits(prompt);
  absl::StatusOr<std::vector<float>> remote = PrefillLogits(**group, 3, prompt);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_EQ(remote->size(), reference.size());
  const double error = RelativeError(*remote, reference);
  EXPECT_LE(error, 1e-4);
  std::printf("2 remote ranks vs one process: relative logits error %.3g\n", error);

  // A rank's own error comes back with its rank named; the group stays up.
  const absl::Status missing = (*group)->RemoveSequence(12345);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("rank 0"), std::string::npos) << missing;
  EXPECT_TRUE((*group)->ready());

  // Shutting the group down ends both rank processes cleanly.
  (*group)->Shutdown("test over");
  int s0 = 0, s1 = 0;
  ASSERT_TRUE(r0.WaitExit(kExitTimeout, &s0));
  ASSERT_TRUE(r1.WaitExit(kExitTimeout, &s1));
  EXPECT_TRUE(WIFEXITED(s0) && WEXITSTATUS(s0) == 0) << s0;
  EXPECT_TRUE(WIFEXITED(s1) && WEXITSTATUS(s1) == 0) << s1;
}

// Speculative verification through the rank protocol (v5: num_draft per
// entry, runs in the StepResult) at TP 2: the shared script
// (tests/testing/verified_script.h) gives the same runs as the model in this
// process and as serial decoding, and a plain step after the last rollback
// is equal too. Malformed draft counts are refused before a Step is sent
// (the group stays ready; the staged pages go with the next forward).
TEST_F(RankGroupTest, VerifiedForwardAtTp2MatchesOneProcessAndSerialDecoding) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {});
  RankProcess r1(Address(**group), 1, {});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  absl::StatusOr<std::unique_ptr<worker::Transformer>> local = worker::Transformer::Load(model->path);
  ASSERT_TRUE(local.ok()) << local.status();
  worker::KvCacheOptions kv = *(*group)->kv_options();  // caller-assigned pages, as the ranks
  absl::StatusOr<worker::PagedKvCache> cache = (*local)->CreateKvCache(kv);
  ASSERT_TRUE(cache.ok()) << cache.status();
  worker::LocalStepExecutor reference(local->get(), std::move(*cache));
  const uint32_t gtest_seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  const uint64_t bytes_before = (*group)->result_bytes_received();
  for (uint32_t round = 0; round < 2; ++round) {
    const uint32_t seed = gtest_seed * 17u + round;
    SCOPED_TRACE(::testing::Message() << "script seed " << seed);
    const testing::VerifiedScriptResult r = testing::RunVerifiedScript(
        reference, **group,
        {.seed = seed, .vocab_size = 1000, .page_size_tokens = kv.page_size_tokens,
         .num_pages = kv.num_pages,
         .seeded = false});  // TP 2 vs one process: see VerifiedScriptOptions::seeded
    ASSERT_FALSE(HasFailure());
    EXPECT_GT(r.full_accepts, 0);
    EXPECT_GT(r.partial_accepts + r.rejections, 0);
    EXPECT_LT(r.accepted, r.drafted);
    std::printf("2 remote ranks, seed %u: %lld steps, %lld of %lld drafts accepted\n", seed,
                (long long)r.steps, (long long)r.accepted, (long long)r.drafted);
  }
  EXPECT_GT((*group)->result_bytes_received(), bytes_before);

  worker::SequenceSampling sampling;
  sampling.params.seed = 9;
  sampling.prompt_len = 4;
  ASSERT_TRUE((*group)->AddSampledSequence(77, sampling).ok());
  ASSERT_TRUE((*group)->AssignPages(77, std::vector<int32_t>{5}).ok());
  const std::vector<int32_t> prompt = {11, 12, 13, 14};
  const SequenceTokens entry{77, prompt};
  const uint8_t yes = 1, no = 0;
  std::vector<std::vector<worker::SampledToken>> runs;
  for (const int32_t d : {-1, 4, 7}) {
    const absl::Status s = (*group)->ForwardVerified({&entry, 1}, {&yes, 1}, {&d, 1}, &runs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << d << ": " << s;
  }
  const int32_t two = 2;
  EXPECT_EQ((*group)->ForwardVerified({&entry, 1}, {&no, 1}, {&two, 1}, &runs).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*group)->ready());
  const int32_t one = 1;
  const absl::Status s = (*group)->ForwardVerified({&entry, 1}, {&yes, 1}, {&one, 1}, &runs);
  ASSERT_TRUE(s.ok()) << s;  // with page 5, staged through the refusals
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_GE(runs[0].size(), 1u);
  EXPECT_LE(runs[0].size(), 2u);
}

TEST_F(RankGroupTest, KilledRankFailsTheStepAndTearsTheGroupDown) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {});
  RankProcess r1(Address(**group), 1, {});
  ASSERT_TRUE((*group)->WaitReady(absl::Now() + kReadyTimeout).ok());
  ASSERT_TRUE((*group)->AddSequence(1).ok());
  r1.Kill();
  const std::vector<int32_t> prompt = Prompt(9, 1000, 7);
  const SequenceTokens entry{1, prompt};
  std::vector<float> logits;
  const absl::Time start = absl::Now();
  absl::Status status = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  // The kill may land before or during the step: either it fails, or (rank 1
  // answered just before dying) the next one does.
  if (status.ok()) status = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  // Names a rank: the killed one, or rank 0 when rank 0 saw the death in its
  // collective first and left (it exits after "lost its peers") before the
  // coordinator noticed rank 1's stream end — both orders happen.
  EXPECT_TRUE(status.message().find("rank 1") != std::string::npos ||
              status.message().find("rank 0") != std::string::npos)
      << status;
  EXPECT_LT(took, 2 * kStepTimeout + absl::Seconds(2));
  std::printf("step with a killed rank: %s after %s\n", status.ToString().c_str(),
              absl::FormatDuration(took).c_str());
  EXPECT_FALSE((*group)->ready());
  EXPECT_EQ((*group)->AddSequence(2).code(), absl::StatusCode::kUnavailable);
  // The surviving rank was told to shut down and exits by itself.
  int s0 = 0, s1 = 0;
  EXPECT_TRUE(r0.WaitExit(kExitTimeout, &s0)) << "rank 0 survived the teardown";
  EXPECT_TRUE(r1.WaitExit(kExitTimeout, &s1));
  EXPECT_EQ(kill(r0.pid(), 0), -1);
}

TEST_F(RankGroupTest, GroupReformsAfterARankRestarts) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  auto r0 = std::make_unique<RankProcess>(Address(**group), 0,
                                          std::vector<std::string>{"--reconnect"});
  auto r1 = std::make_unique<RankProcess>(Address(**group), 1,
                                          std::vector<std::string>{"--reconnect"});
  ASSERT_TRUE((*group)->WaitReady(absl::Now() + kReadyTimeout).ok());
  const uint64_t first = (*group)->generation();
  const std::vector<int32_t> prompt = Prompt(11, 1000, 9);
  absl::StatusOr<std::vector<float>> before = PrefillLogits(**group, 4, prompt);
  ASSERT_TRUE(before.ok()) << before.status();

  ASSERT_TRUE((*group)->AddSequence(5).ok());
  r1->Kill();
  int s1 = 0;
  ASSERT_TRUE(r1->WaitExit(kExitTimeout, &s1));
  const SequenceTokens entry{5, prompt};
  std::vector<float> logits;
  const absl::Status failed = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;

  // Restart rank 1; rank 0 re-registers by itself (--reconnect).
  r1 = std::make_unique<RankProcess>(Address(**group), 1, std::vector<std::string>{"--reconnect"});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_GT((*group)->generation(), first);
  // The caller still holds sequence 5 of the old generation: the next step
  // asks for a replay (Aborted) until the caller Recovers.
  const absl::Status stale = (*group)->RemoveSequence(5);
  EXPECT_EQ(stale.code(), absl::StatusCode::kAborted) << stale;
  ASSERT_TRUE((*group)->Recover(absl::Now() + kReadyTimeout).ok());
  // The new group has empty caches: sequence 5 is gone, and it computes the
  // same logits as the first group.
  EXPECT_EQ((*group)->RemoveSequence(5).code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<float>> after = PrefillLogits(**group, 4, prompt);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *before);
}

// The race of issue 6: the group re-forms between two steps (no step saw it
// break), so the caller's sequences are gone. The next step must ask for a
// replay (Aborted, which the engine treats as a broken group), not fail with
// the ranks' NOT_FOUND / FAILED_PRECONDITION (which the engine would turn
// into INTERNAL for every request).
TEST_F(RankGroupTest, AStepAfterAnUnseenReformationAsksForAReplay) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  auto r0 = std::make_unique<RankProcess>(Address(**group), 0,
                                          std::vector<std::string>{"--reconnect"});
  auto r1 = std::make_unique<RankProcess>(Address(**group), 1,
                                          std::vector<std::string>{"--reconnect"});
  ASSERT_TRUE((*group)->WaitReady(absl::Now() + kReadyTimeout).ok());
  const uint64_t first = (*group)->generation();
  const std::vector<int32_t> prompt = Prompt(21, 1000, 13);
  absl::StatusOr<std::vector<float>> before = PrefillLogits(**group, 6, prompt);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE((*group)->AddSequence(7).ok());
  ASSERT_TRUE((*group)->AssignPages(7, PagesFor(static_cast<int>(prompt.size()))).ok());

  // Kill and restart rank 1 with no step in flight; wait (bounded) until the
  // group has re-formed under a new generation.
  r1->Kill();
  int s1 = 0;
  ASSERT_TRUE(r1->WaitExit(kExitTimeout, &s1));
  r1 = std::make_unique<RankProcess>(Address(**group), 1, std::vector<std::string>{"--reconnect"});
  const absl::Time deadline = absl::Now() + kReadyTimeout;
  while ((*group)->generation() == first && absl::Now() < deadline) {
    (void)(*group)->WaitReady(absl::Now() + absl::Milliseconds(50));  // a bounded timed wait
  }
  ASSERT_GT((*group)->generation(), first);
  ASSERT_TRUE((*group)->WaitReady(absl::Now() + kReadyTimeout).ok());

  const SequenceTokens entry{7, prompt};
  std::vector<float> logits;
  const absl::Status stale = (*group)->Forward({&entry, 1}, LogitsRows::kAllTokens, &logits);
  EXPECT_EQ(stale.code(), absl::StatusCode::kAborted) << stale;
  EXPECT_NE(stale.message().find("replay"), std::string::npos) << stale;

  // Recover (what the engine does for a broken group), then replay: the same
  // logits as before the re-formation, on the same pages.
  ASSERT_TRUE((*group)->Recover(absl::Now() + kReadyTimeout).ok());
  absl::StatusOr<std::vector<float>> replayed = PrefillLogits(**group, 7, prompt);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(*replayed, *before);
}

// A forward beyond a sequence's assigned pages fails on the ranks (they never
// take a page themselves); bad page ids are refused naming the page.
TEST_F(RankGroupTest, RanksUseOnlyTheBlocksTheCoordinatorAssigned) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {});
  RankProcess r1(Address(**group), 1, {});
  ASSERT_TRUE((*group)->WaitReady(absl::Now() + kReadyTimeout).ok());
  ASSERT_TRUE((*group)->kv_options().has_value());
  EXPECT_TRUE((*group)->kv_options()->caller_assigns_pages);
  const std::vector<int32_t> prompt = Prompt(20, 1000, 3);  // 2 pages of 16
  const SequenceTokens entry{8, prompt};
  std::vector<float> logits;
  ASSERT_TRUE((*group)->AddSequence(8).ok());
  ASSERT_TRUE((*group)->AssignPages(8, std::vector<int32_t>{9}).ok());  // one page short
  absl::Status s = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("coordinator"), std::string::npos) << s;
  ASSERT_TRUE((*group)->AssignPages(8, std::vector<int32_t>{64}).ok());  // staged, sent next
  s = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("page 64"), std::string::npos) << s;
  ASSERT_TRUE((*group)->AddSequence(9).ok());
  ASSERT_TRUE((*group)->AssignPages(9, std::vector<int32_t>{9}).ok());  // sequence 8's page
  const SequenceTokens other{9, {prompt.data(), 3}};
  s = (*group)->Forward({&other, 1}, LogitsRows::kLastToken, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("page 9 is already used by sequence 8"), std::string::npos) << s;
  // With its second page sequence 8 runs; the group stayed up throughout.
  ASSERT_TRUE((*group)->AssignPages(8, std::vector<int32_t>{2}).ok());
  s = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(logits.size(), 1000u);
  EXPECT_TRUE((*group)->ready());
}

TEST_F(RankGroupTest, ProtocolVersionMismatchIsRefused) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(1));
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess old_rank(Address(**group), 0, {"--protocol-version-for-testing", "99"});
  int status = 0;
  ASSERT_TRUE(old_rank.WaitExit(kExitTimeout, &status));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_FALSE((*group)->ready());
  EXPECT_EQ((*group)->generation(), 0u);
  // A rank expecting another world size is refused too.
  RankProcess wrong_size(Address(**group), 0, {"--world-size", "3"});
  ASSERT_TRUE(wrong_size.WaitExit(kExitTimeout, &status));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_EQ((*group)->generation(), 0u);
}

// A rank whose Ready reports another KV layout than the coordinator's block
// allocator can never serve (the allocator mirrors every rank's cache page
// for page). The coordinator refuses it, FAILED_PRECONDITION naming both
// layouts, and the rank exits 1 with that message, with --reconnect too,
// instead of re-registering into the same teardown over and over. The other
// rank re-registers, and a rank with the right layout completes the group.
TEST_F(RankGroupTest, KvLayoutMismatchIsRefusedAndTheRankExits) {
  testing::ScratchDir dir;
  const std::string err_path = dir.path() + "/mismatched-rank.err";
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();  // 64 pages of 16 positions
  RankProcess r0(Address(**group), 0, {"--reconnect"});
  RankProcess mismatched(Address(**group), 1, {"--reconnect", "--kv-pages-for-testing", "48"},
                         err_path);
  int status = 0;
  ASSERT_TRUE(mismatched.WaitExit(kReadyTimeout, &status)) << "the mismatched rank kept running";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  std::ifstream err_file(err_path);
  const std::string err((std::istreambuf_iterator<char>(err_file)),
                        std::istreambuf_iterator<char>());
  for (const char* part : {"rank 1: refused by the coordinator: KV layout mismatch",
                           "48 pages of 16 positions", "has 64 pages of 16"}) {
    EXPECT_NE(err.find(part), std::string::npos) << "stderr lacks \"" << part << "\":\n" << err;
  }
  // The group formed once (generation 1) and was torn down; it names why.
  EXPECT_FALSE((*group)->ready());
  const RankGroupStatus torn = (*group)->status();
  EXPECT_EQ(torn.generation, 1u);
  EXPECT_NE(torn.last_error.find("FAILED_PRECONDITION: KV layout mismatch"), std::string::npos)
      << torn.last_error;
  EXPECT_NE(torn.last_error.find("48 pages"), std::string::npos) << torn.last_error;
  EXPECT_EQ(kill(r0.pid(), 0), 0) << "rank 0 (--reconnect) should have registered again";

  // A rank 1 with the coordinator's layout: the group forms again and serves.
  RankProcess fixed(Address(**group), 1, {"--reconnect"});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_EQ((*group)->generation(), 2u);
  absl::StatusOr<std::vector<float>> logits = PrefillLogits(**group, 1, Prompt(5, 1000, 3));
  EXPECT_TRUE(logits.ok()) << logits.status();
  (*group)->Shutdown("test over");
}

TEST_F(RankGroupTest, MissingRankLeavesTheGroupNotReadyWithoutHanging) {
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(Options(2));
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {});
  const absl::Time start = absl::Now();
  const absl::Status ready = (*group)->WaitReady(absl::Now() + absl::Seconds(3));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(ready.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(ready.message().find("1 of 2 ranks registered"), std::string::npos) << ready;
  std::vector<float> logits;
  EXPECT_EQ((*group)->AddSequence(1).code(), absl::StatusCode::kUnavailable);
  const RankGroupStatus status = (*group)->status();
  EXPECT_EQ(status.state, GroupState::kForming);
  EXPECT_TRUE(status.ranks[0].up);
  EXPECT_FALSE(status.ranks[1].up);
  // Destroying the group with a rank still waiting ends that rank too.
  group->reset();
  int s0 = 0;
  EXPECT_TRUE(r0.WaitExit(kExitTimeout, &s0));
}

TEST(RankListenPolicyTest, NonLoopbackNeedsTlsAndARankCheck) {
  RankEndpointSecurity none;
  EXPECT_TRUE(CheckRankListenPolicy("127.0.0.1:50061", none, "h").ok());
  EXPECT_TRUE(CheckRankListenPolicy("[::1]:0", none, "h").ok());
  EXPECT_TRUE(CheckRankListenPolicy("localhost:1", none, "h").ok());
  for (const char* open : {"0.0.0.0:50061", "[::]:50061", "10.1.2.3:7"}) {
    const absl::Status s = CheckRankListenPolicy(open, none, "HINT");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << open;
    EXPECT_NE(s.message().find("HINT"), std::string::npos) << s;
  }
  RankEndpointSecurity token_only;  // a token over plaintext is not enough
  token_only.token_file = "t";
  EXPECT_FALSE(CheckRankListenPolicy("0.0.0.0:1", token_only, "h").ok());
  RankEndpointSecurity tls_only;  // TLS without a rank check is not either
  tls_only.cert_file = "c";
  tls_only.key_file = "k";
  EXPECT_FALSE(CheckRankListenPolicy("0.0.0.0:1", tls_only, "h").ok());
  RankEndpointSecurity tls_token = tls_only;
  tls_token.token_file = "t";
  EXPECT_TRUE(CheckRankListenPolicy("0.0.0.0:1", tls_token, "h").ok());
  RankEndpointSecurity mtls = tls_only;
  mtls.client_ca_file = "ca";
  EXPECT_TRUE(CheckRankListenPolicy("0.0.0.0:1", mtls, "h").ok());
  RankEndpointSecurity opt_out;
  opt_out.insecure_listen_any = true;
  EXPECT_TRUE(CheckRankListenPolicy("0.0.0.0:1", opt_out, "h").ok());
  // Start applies it too, before binding anything.
  RankGroupOptions options;
  options.listen_address = "0.0.0.0:0";
  options.model_dir = "/nonexistent";
  EXPECT_EQ(RemoteRankGroup::Start(options).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RankGroupTest, RankTokenIsRequiredAndStateChangesAreReported) {
  testing::ScratchDir dir;
  const std::string token_file = dir.path() + "/token";
  const std::string wrong_file = dir.path() + "/wrong";
  FILE* f = std::fopen(token_file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("  s3cret-rank-token\n", f);  // surrounding whitespace is trimmed
  std::fclose(f);
  f = std::fopen(wrong_file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("s3cret-rank-tokeN", f);
  std::fclose(f);
  RankGroupOptions options = Options(1);
  options.security.token_file = token_file;
  // The hook runs just after the lock that changed the state is released,
  // so a waiter may see the state first: count under a mutex and await it.
  struct Changes {
    absl::Mutex mu;
    int count ABSL_GUARDED_BY(mu) = 0;
    int load() {
      absl::MutexLock lock(&mu);
      return count;
    }
  };
  auto changes = std::make_shared<Changes>();
  options.on_change = [changes] {
    absl::MutexLock lock(&changes->mu);
    ++changes->count;
  };
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(options);
  ASSERT_TRUE(group.ok()) << group.status();
  // No token, a wrong token: refused (exit 1, no retry even with --reconnect);
  // nothing registered, no state change.
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--reconnect"},
        std::vector<std::string>{"--reconnect", "--rank-token-file", wrong_file}}) {
    RankProcess refused(Address(**group), 0, extra);
    int status = 0;
    ASSERT_TRUE(refused.WaitExit(kExitTimeout, &status));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    EXPECT_FALSE((*group)->ready());
    EXPECT_FALSE((*group)->status().ranks[0].up);
    EXPECT_EQ(changes->load(), 0);
  }
  // The right token: loading, then ready, each reported through on_change.
  RankProcess rank(Address(**group), 0, {"--rank-token-file", token_file});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  {  // forming -> loading -> ready: two changes reported
    absl::MutexLock lock(&changes->mu);
    auto two = [&changes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(changes->mu) { return changes->count >= 2; };
    EXPECT_TRUE(changes->mu.AwaitWithTimeout(absl::Condition(&two), absl::Seconds(10)))
        << changes->count;
  }
  const int before_shutdown = changes->load();
  (*group)->Shutdown("test over");
  EXPECT_GT(changes->load(), before_shutdown);  // -> stopped, reported before Shutdown returns
  int status = 0;
  EXPECT_TRUE(rank.WaitExit(kExitTimeout, &status));
}

// Uneven capacities (issue 5) through Setup.capacities: 3 ranks at 1, 1, 0.5
// plan the same uneven shards and their logits match one process; bad
// capacities are refused at Start.
TEST_F(RankGroupTest, UnevenCapacitiesReachEveryRankThroughSetup) {
  RankGroupOptions options = Options(3);
  options.capacities = {1.0, 1.0, 0.5};
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(options);
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {});
  RankProcess r1(Address(**group), 1, {});
  RankProcess r2(Address(**group), 2, {});
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  const std::vector<int32_t> prompt = Prompt(19, 1000, 9);
  const std::vector<float> reference = LocalLogits(prompt);
  absl::StatusOr<std::vector<float>> remote = PrefillLogits(**group, 4, prompt);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_EQ(remote->size(), reference.size());
  const double error = RelativeError(*remote, reference);
  EXPECT_LE(error, 1e-4);
  std::printf("3 remote ranks at capacities 1,1,0.5 vs one process: relative error %.3g\n",
              error);
  // The half-capacity rank planned, and read, less than either full one.
  const RankGroupStatus status = (*group)->status();
  ASSERT_EQ(status.ranks.size(), 3u);
  for (const RankSlotInfo& info : status.ranks) {
    std::printf("  rank %d read %llu checkpoint bytes\n", info.rank,
                static_cast<unsigned long long>(info.bytes_read));
    EXPECT_GT(info.bytes_read, 0u);
  }
  EXPECT_LT(status.ranks[2].bytes_read, status.ranks[0].bytes_read);
  EXPECT_LT(status.ranks[2].bytes_read, status.ranks[1].bytes_read);
  (*group)->Shutdown("test over");

  for (const std::vector<double>& bad :
       std::vector<std::vector<double>>{{1.0, 1.0}, {1.0, 0.0, 1.0}}) {
    RankGroupOptions refused = Options(3);
    refused.capacities = bad;
    absl::StatusOr<std::unique_ptr<RemoteRankGroup>> none = RemoteRankGroup::Start(refused);
    EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
    EXPECT_NE(none.status().message().find("capacities"), std::string::npos) << none.status();
  }
}

// RankGroupOptions::prefill_precision / decode_precision reach every rank
// through Setup; a rank's own `worker --decode-precision` wins; each rank logs
// the precisions it runs.
TEST_F(RankGroupTest, PrecisionsReachRanksThroughSetupAndOwnFlagsWin) {
  testing::ScratchDir dir;
  RankGroupOptions options = Options(2);
  options.prefill_precision = kernels::TrellisGemmPrecision::kBf16;
  options.decode_precision = kernels::TrellisGemmPrecision::kInt8;
  absl::StatusOr<std::unique_ptr<RemoteRankGroup>> group = RemoteRankGroup::Start(options);
  ASSERT_TRUE(group.ok()) << group.status();
  RankProcess r0(Address(**group), 0, {}, dir.File("r0.log"));
  RankProcess r1(Address(**group), 1, {"--decode-precision", "fp32"}, dir.File("r1.log"));
  const absl::Status ready = (*group)->WaitReady(absl::Now() + kReadyTimeout);
  ASSERT_TRUE(ready.ok()) << ready;
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string log0 = read(dir.File("r0.log"));
  const std::string log1 = read(dir.File("r1.log"));
  EXPECT_NE(log0.find("rank 0: precision prefill=bf16 decode=int8"), std::string::npos) << log0;
  EXPECT_NE(log1.find("rank 1: precision prefill=bf16 decode=fp32"), std::string::npos) << log1;
  (*group)->Shutdown("test over");
}

}  // namespace
}  // namespace exl3serve::coordinator
