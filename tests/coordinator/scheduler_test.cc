// The continuous-batching scheduler on its own: token budget and chunked
// prefill, FCFS admission, block accounting checked against a real
// PagedKvCache driven with every batch (so the ranks could never run out of
// pages), preemption and re-admission with the same tokens, cancellation and
// deadlines freeing blocks, the queue limit, and a randomized workload
// checked against the rules after every step.
#include "coordinator/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/model/kv_cache.h"

namespace exl3serve::coordinator {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

std::vector<int32_t> Tokens(int n, int32_t first = 1) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = first + i;
  return t;
}

// Drives a Scheduler and a PagedKvCache of the same geometry with every step
// as a rank does (RemoveSequence / AddSequence / AssignPages of each entry's
// new blocks, then Reserve as the Forward does, which in the rank's
// caller_assigns_pages mode never takes a page), and checks invariants I1-I4
// after each — I2 as: the cache's page table of every sequence in the batch
// is exactly the scheduler's block table.
class Harness {
 public:
  explicit Harness(const SchedulerOptions& options) : scheduler_(options), options_(options) {
    worker::KvCacheOptions kv;
    kv.page_size_tokens = static_cast<int>(options.page_size_tokens);
    kv.num_pages = options.num_blocks;
    kv.dtype = worker::KvCacheDtype::kFp32;
    kv.caller_assigns_pages = true;
    auto cache = worker::PagedKvCache::Create({1, 1, 2}, kv);
    EXPECT_TRUE(cache.ok()) << cache.status();
    cache_.emplace(std::move(*cache));
  }

  Scheduler& scheduler() { return scheduler_; }

  ScheduleOutput Step(absl::Time now = kT0) {
    ScheduleOutput out = scheduler_.Schedule(now);
    for (int64_t id : out.release) EXPECT_TRUE(cache_->RemoveSequence(id).ok()) << id;
    for (int64_t id : out.admit) EXPECT_TRUE(cache_->AddSequence(id).ok()) << id;
    int64_t total = 0;
    std::map<int64_t, int> seen;
    for (const ScheduledChunk& c : out.batch) {
      EXPECT_FALSE(c.tokens.empty());
      EXPECT_EQ(++seen[c.seq_id], 1) << "sequence " << c.seq_id << " twice in a batch";
      total += static_cast<int64_t>(c.tokens.size());
      // I2: the rank takes the assigned pages, then its Forward reserves
      // length + new tokens from them; both must succeed.
      EXPECT_EQ(cache_->Length(c.seq_id), c.start);
      absl::Status assigned = cache_->AssignPages(c.seq_id, c.new_blocks);
      EXPECT_TRUE(assigned.ok()) << assigned;
      absl::Status reserved =
          cache_->Reserve(c.seq_id, c.start + static_cast<int64_t>(c.tokens.size()));
      EXPECT_TRUE(reserved.ok()) << reserved;
      const std::span<const int32_t> table = scheduler_.block_table(c.seq_id);
      EXPECT_EQ(cache_->PageTable(c.seq_id), std::vector<int64_t>(table.begin(), table.end()))
          << "sequence " << c.seq_id;
      cache_->SetLength(c.seq_id, c.start + static_cast<int64_t>(c.tokens.size()));
      // I4
      std::span<const int32_t> all = scheduler_.tokens(c.seq_id);
      EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(), all.begin() + c.start));
      EXPECT_EQ(c.needs_logits, c.start + static_cast<int64_t>(c.tokens.size()) ==
                                    static_cast<int64_t>(all.size()));
      EXPECT_EQ(scheduler_.blocks_held(c.seq_id),
                (scheduler_.computed(c.seq_id) + options_.page_size_tokens - 1) /
                    options_.page_size_tokens);
    }
    EXPECT_LE(total, options_.step_token_budget);  // I3
    EXPECT_LE(scheduler_.num_running(), options_.max_running);
    // I1, and the mirror: the scheduler's free blocks are the cache's free pages.
    EXPECT_EQ(scheduler_.free_blocks(), cache_->free_pages());
    return out;
  }

 private:
  Scheduler scheduler_;
  SchedulerOptions options_;
  std::optional<worker::PagedKvCache> cache_;
};

const ScheduledChunk* Find(const ScheduleOutput& out, int64_t id) {
  for (const ScheduledChunk& c : out.batch) {
    if (c.seq_id == id) return &c;
  }
  return nullptr;
}

TEST(SchedulerTest, ChunksLongPromptsUnderTheTokenBudget) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 64;
  options.step_token_budget = 10;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(25)).ok());
  ScheduleOutput s1 = h.Step();
  ASSERT_EQ(s1.batch.size(), 1u);
  EXPECT_EQ(s1.admit, std::vector<int64_t>{1});
  EXPECT_EQ(s1.batch[0].tokens.size(), 10u);
  EXPECT_FALSE(s1.batch[0].needs_logits);
  ScheduleOutput s2 = h.Step();
  EXPECT_EQ(s2.batch[0].start, 10);
  EXPECT_EQ(s2.batch[0].tokens.size(), 10u);
  EXPECT_FALSE(s2.batch[0].needs_logits);
  ScheduleOutput s3 = h.Step();
  EXPECT_EQ(s3.batch[0].start, 20);
  EXPECT_EQ(s3.batch[0].tokens.size(), 5u);
  EXPECT_TRUE(s3.batch[0].needs_logits);
}

TEST(SchedulerTest, DecodeRowsGoFirstThenPrefillFillsTheBudget) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 64;
  options.step_token_budget = 8;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(3)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(3)).ok());
  ScheduleOutput s1 = h.Step();
  ASSERT_EQ(s1.batch.size(), 2u);
  h.scheduler().AppendToken(1, 50);
  h.scheduler().AppendToken(2, 51);
  ASSERT_TRUE(h.scheduler().Add(3, Tokens(20)).ok());
  ScheduleOutput s2 = h.Step();
  ASSERT_EQ(s2.batch.size(), 3u);
  EXPECT_EQ(s2.batch[0].seq_id, 1);
  EXPECT_EQ(s2.batch[0].tokens.size(), 1u);
  EXPECT_EQ(s2.batch[0].tokens[0], 50);
  EXPECT_EQ(s2.batch[1].seq_id, 2);
  EXPECT_EQ(s2.batch[2].seq_id, 3);
  EXPECT_EQ(s2.batch[2].tokens.size(), 6u);  // 8 - two decode rows
}

TEST(SchedulerTest, AdmitsInArrivalOrderAndNeverSkipsTheHead) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 4;  // 16 positions
  options.step_token_budget = 100;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(10)).ok());  // 3 blocks
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(8)).ok());   // would need 2: only 1 left
  ASSERT_TRUE(h.scheduler().Add(3, Tokens(2)).ok());   // would fit, but 2 is first
  ScheduleOutput s1 = h.Step();
  // 2 is admitted with the one block left (a partial chunk), 3 waits behind it.
  ASSERT_EQ(s1.admit, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Find(s1, 2)->tokens.size(), 4u);
  EXPECT_EQ(h.scheduler().num_waiting(), 1);
  EXPECT_EQ(h.scheduler().free_blocks(), 0);
}

TEST(SchedulerTest, RespectsMaxRunning) {
  SchedulerOptions options;
  options.max_running = 2;
  Harness h(options);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(h.scheduler().Add(i, Tokens(3)).ok());
  ScheduleOutput s1 = h.Step();
  EXPECT_EQ(s1.admit, (std::vector<int64_t>{0, 1}));
  h.scheduler().Finish(0);
  h.scheduler().AppendToken(1, 9);
  ScheduleOutput s2 = h.Step();
  EXPECT_EQ(s2.finished, std::vector<int64_t>{0});
  EXPECT_EQ(s2.admit, std::vector<int64_t>{2});
}

TEST(SchedulerTest, PreemptsTheNewestAndReprefillsItsTokens) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 4;
  options.step_token_budget = 100;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(8, 100)).ok());  // 2 blocks
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(8, 200)).ok());  // 2 blocks
  h.Step();
  EXPECT_EQ(h.scheduler().free_blocks(), 0);
  h.scheduler().AppendToken(1, 11);
  h.scheduler().AppendToken(2, 22);
  // Both need a third block for their 9th position: 1 (older) preempts 2.
  ScheduleOutput s = h.Step();
  EXPECT_EQ(s.preempted, std::vector<int64_t>{2});
  EXPECT_EQ(s.release, std::vector<int64_t>{2});
  ASSERT_EQ(s.batch.size(), 1u);
  EXPECT_EQ(s.batch[0].seq_id, 1);
  EXPECT_EQ(h.scheduler().num_preemptions(), 1u);
  EXPECT_FALSE(h.scheduler().is_running(2));
  EXPECT_EQ(h.scheduler().computed(2), 0);
  // 2 kept prompt + its token and re-prefills them once 1 finishes.
  std::vector<int32_t> expected = Tokens(8, 200);
  expected.push_back(22);
  EXPECT_TRUE(std::ranges::equal(h.scheduler().tokens(2), expected));
  h.scheduler().Finish(1);
  ScheduleOutput r = h.Step();
  EXPECT_EQ(r.admit, std::vector<int64_t>{2});
  ASSERT_EQ(r.batch.size(), 1u);
  EXPECT_TRUE(std::ranges::equal(r.batch[0].tokens, expected));
  EXPECT_TRUE(r.batch[0].needs_logits);
}

TEST(SchedulerTest, PreemptedSequenceGoesToTheFrontOfTheQueue) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 4;
  options.step_token_budget = 100;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(8)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(8)).ok());
  h.Step();
  ASSERT_TRUE(h.scheduler().Add(3, Tokens(1)).ok());
  h.scheduler().AppendToken(1, 5);
  h.scheduler().AppendToken(2, 6);
  h.Step();  // preempts 2; no admission in a preempting step
  h.scheduler().Finish(1);
  ScheduleOutput r = h.Step();
  ASSERT_FALSE(r.admit.empty());
  EXPECT_EQ(r.admit[0], 2);
}

TEST(SchedulerTest, CancellationFreesBlocksAtTheNextStep) {
  Harness h(SchedulerOptions{});
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(40)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(5)).ok());
  h.Step();
  const int64_t held = h.scheduler().blocks_held(1);
  EXPECT_GT(held, 0);
  EXPECT_TRUE(h.scheduler().Cancel(1));
  EXPECT_EQ(h.scheduler().blocks_held(1), held);  // not before the next step
  h.scheduler().AppendToken(2, 3);
  ScheduleOutput s = h.Step();
  ASSERT_EQ(s.dropped.size(), 1u);
  EXPECT_EQ(s.dropped[0].seq_id, 1);
  EXPECT_EQ(s.dropped[0].reason, DropReason::kCancelled);
  EXPECT_EQ(s.release, std::vector<int64_t>{1});
  EXPECT_FALSE(h.scheduler().Contains(1));
  h.scheduler().Finish(2);
  h.Step();
  EXPECT_EQ(h.scheduler().free_blocks(), h.scheduler().num_blocks());
  EXPECT_TRUE(h.scheduler().empty());
}

TEST(SchedulerTest, CancellingAWaitingSequenceReleasesNothing) {
  SchedulerOptions options;
  options.max_running = 1;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(5)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(5)).ok());
  h.Step();
  EXPECT_TRUE(h.scheduler().Cancel(2));
  EXPECT_FALSE(h.scheduler().Cancel(99));
  h.scheduler().AppendToken(1, 1);
  ScheduleOutput s = h.Step();
  ASSERT_EQ(s.dropped.size(), 1u);
  EXPECT_TRUE(s.release.empty());
}

TEST(SchedulerTest, RejectsWhenTheQueueIsFull) {
  SchedulerOptions options;
  options.max_waiting = 2;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(5)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(5)).ok());
  absl::Status full = h.scheduler().Add(3, Tokens(5));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("max_queue 2"), std::string::npos) << full;
  h.Step();  // admits both
  EXPECT_TRUE(h.scheduler().Add(3, Tokens(5)).ok());
}

TEST(SchedulerTest, RejectsBadSequences) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 2;
  Scheduler s(options);
  EXPECT_EQ(s.Add(1, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Add(1, Tokens(9)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.Add(1, Tokens(8)).ok());
  EXPECT_EQ(s.Add(1, Tokens(1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SchedulerTest, DropsExpiredSequencesWaitingOrRunning) {
  SchedulerOptions options;
  options.max_running = 1;
  Harness h(options);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(5), kT0 + absl::Seconds(10)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(5), kT0 + absl::Seconds(5)).ok());
  h.Step(kT0);
  h.scheduler().AppendToken(1, 7);
  ScheduleOutput s = h.Step(kT0 + absl::Seconds(5));  // 2 (waiting) expires
  ASSERT_EQ(s.dropped.size(), 1u);
  EXPECT_EQ(s.dropped[0].seq_id, 2);
  EXPECT_EQ(s.dropped[0].reason, DropReason::kDeadline);
  h.scheduler().AppendToken(1, 8);
  ScheduleOutput t = h.Step(kT0 + absl::Seconds(11));  // 1 (running) expires
  ASSERT_EQ(t.dropped.size(), 1u);
  EXPECT_EQ(t.dropped[0].seq_id, 1);
  EXPECT_EQ(t.release, std::vector<int64_t>{1});
  EXPECT_EQ(h.scheduler().free_blocks(), h.scheduler().num_blocks());
}

TEST(SchedulerTest, ResetForgetsEverything) {
  Harness h(SchedulerOptions{});
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(5)).ok());
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(5)).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().Reset(), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(h.scheduler().empty());
  EXPECT_EQ(h.scheduler().free_blocks(), h.scheduler().num_blocks());
}

// Random workloads with small pools: every sequence must finish with exactly
// the tokens a lone run gives it (its "model" here: next = f(last, position)),
// the invariants hold after every step, FCFS holds for first admissions, and
// the pool is whole at the end.
TEST(SchedulerTest, RandomWorkloadsFinishWithTheirOwnTokens) {
  const uint32_t seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  uint64_t preemptions = 0, cancellations = 0;
  for (int round = 0; round < 40; ++round) {
    std::mt19937 rng(seed * 7919u + round);
    SCOPED_TRACE(::testing::Message() << "gtest seed " << seed << ", round " << round);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    SchedulerOptions options;
    options.page_size_tokens = uniform(1, 8);
    options.num_blocks = uniform(8, 40);
    options.max_running = uniform(1, 8);
    options.step_token_budget = uniform(1, 24);
    const int64_t capacity = options.page_size_tokens * options.num_blocks;
    Harness h(options);

    struct Want {
      std::vector<int32_t> prompt;
      int64_t max_new = 0;
      std::vector<int32_t> output;
      bool cancelled = false;
      bool done = false;
    };
    std::map<int64_t, Want> want;
    auto next_token = [](int32_t last, int64_t position) {
      return static_cast<int32_t>((last * 31 + position * 7 + 3) % 1000);
    };
    const int n = uniform(1, 30);
    int64_t next_id = 0;
    std::vector<int64_t> first_admissions;
    std::vector<int64_t> arrival;
    int steps = 0;
    while (true) {
      if (next_id < n && uniform(0, 2) == 0) {
        Want w;
        const int64_t total = uniform(2, static_cast<int>(std::min<int64_t>(capacity, 60)));
        const int64_t prompt_len = uniform(1, static_cast<int>(total - 1));
        w.max_new = total - prompt_len;
        for (int64_t i = 0; i < prompt_len; ++i) w.prompt.push_back(uniform(0, 999));
        ASSERT_TRUE(h.scheduler().Add(next_id, w.prompt).ok());
        arrival.push_back(next_id);
        want[next_id] = std::move(w);
        ++next_id;
      }
      if (!want.empty() && uniform(0, 40) == 0) {
        auto it = want.begin();
        std::advance(it, uniform(0, static_cast<int>(want.size()) - 1));
        if (!it->second.done && !it->second.cancelled && h.scheduler().Cancel(it->first)) {
          it->second.cancelled = true;
        }
      }
      ScheduleOutput out = h.Step();
      for (int64_t id : out.admit) {
        if (std::find(first_admissions.begin(), first_admissions.end(), id) ==
            first_admissions.end()) {
          first_admissions.push_back(id);
        }
      }
      for (const DroppedSequence& d : out.dropped) EXPECT_TRUE(want.at(d.seq_id).cancelled);
      for (const ScheduledChunk& c : out.batch) {
        if (!c.needs_logits) continue;
        Want& w = want.at(c.seq_id);
        std::span<const int32_t> all = h.scheduler().tokens(c.seq_id);
        const int32_t token = next_token(all.back(), static_cast<int64_t>(all.size()));
        w.output.push_back(token);
        if (static_cast<int64_t>(w.output.size()) == w.max_new) {
          h.scheduler().Finish(c.seq_id);
          w.done = true;
        } else {
          h.scheduler().AppendToken(c.seq_id, token);
        }
      }
      ++steps;
      ASSERT_LT(steps, 100000) << "no progress";
      if (next_id == n && h.scheduler().empty()) break;
    }
    preemptions += h.scheduler().num_preemptions();
    for (const auto& [id, w] : want) cancellations += w.cancelled;
    // FCFS for first admissions.
    EXPECT_TRUE(std::is_sorted(first_admissions.begin(), first_admissions.end()));
    EXPECT_EQ(h.scheduler().free_blocks(), options.num_blocks);
    for (const auto& [id, w] : want) {
      if (w.cancelled) continue;
      ASSERT_TRUE(w.done) << id;
      std::vector<int32_t> alone = w.prompt;
      std::vector<int32_t> expected;
      while (static_cast<int64_t>(expected.size()) < w.max_new) {
        const int32_t t = next_token(alone.back(), static_cast<int64_t>(alone.size()));
        expected.push_back(t);
        alone.push_back(t);
      }
      EXPECT_EQ(w.output, expected) << "sequence " << id;
    }
  }
  // The workloads are meant to exercise preemption and cancellation.
  EXPECT_GT(preemptions, 0u);
  EXPECT_GT(cancellations, 0u);
}

}  // namespace
}  // namespace exl3serve::coordinator
