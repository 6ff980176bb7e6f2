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

// What a rank would store at position `pos` of a sequence whose tokens are
// `tokens`: k = (token, position), v = (a hash of tokens [0, pos], 0), all
// small integers (exact in fp32). A position read back from a cached prefix
// must hold exactly this sequence's prefix.
void ExpectedEntry(std::span<const int32_t> tokens, int64_t pos, float* k, float* v) {
  uint32_t h = 17;
  for (int64_t i = 0; i <= pos; ++i) h = (h * 1000003u + static_cast<uint32_t>(tokens[i]) + 1u) % (1u << 20);
  k[0] = static_cast<float>(tokens[pos]);
  k[1] = static_cast<float>(pos);
  v[0] = static_cast<float>(h);
  v[1] = 0.0f;
}

// What a rank's recurrent state holds after the first `length` tokens of a
// sequence: the hash of ExpectedEntry over them (exact in fp32).
float ExpectedState(std::span<const int32_t> tokens, int64_t length) {
  if (length == 0) return 0.0f;  // a new sequence's state is zeros
  uint32_t h = 17;
  for (int64_t i = 0; i < length; ++i) h = (h * 1000003u + static_cast<uint32_t>(tokens[i]) + 1u) % (1u << 20);
  return static_cast<float>(h);
}

// Drives a Scheduler and a PagedKvCache of the same geometry with every step
// as a rank does (RemoveSequence / AddSequence with the cached length /
// AssignPages of each entry's new blocks, then Reserve as the Forward does,
// which in the rank's caller_assigns_pages mode never takes a page and
// refuses writes into shared pages), writes each chunk's entries
// (ExpectedEntry) and checks invariants I1-I4 after each — I2 as: the
// cache's page table of every sequence in the batch is exactly the
// scheduler's block table, and the positions before a chunk (cached or
// computed earlier) read back as this sequence's own prefix; P1-P3 of the
// block pool (a page's holders on the "rank" = the block's references).
// With SchedulerOptions::recurrent_state the cache also keeps one float of
// state per sequence (ExpectedState of its committed tokens), resumed from
// the scheduler's snapshots at admission and snapshotted after the step as
// state_saves says; every chunk checks that the state it starts from is its
// own prefix's, so a resume from a wrong snapshot (or at a wrong position)
// fails the test. A drafting entry keeps its state after each position and
// Rollback restores the accepted one, as a rank's verification does.
class Harness {
 public:
  explicit Harness(const SchedulerOptions& options) : scheduler_(options), options_(options) {
    NewCache();
  }

  Scheduler& scheduler() { return scheduler_; }
  const worker::PagedKvCache& cache() const { return *cache_; }

  // A rank failure and re-formation: every cache is empty, the scheduler
  // requeues its sequences.
  // The disk tier as a rank keeps it (slot -> hash and page bytes); a load
  // fails with probability `fault_rate` (as a dropped save or a corrupted
  // slot would, which a rank's checksum turns into a miss) and then leaves
  // garbage in the page.
  void SetDiskFaults(double fault_rate, uint32_t seed) {
    fault_rate_ = fault_rate;
    fault_rng_.seed(seed);
  }
  uint64_t disk_faults() const { return disk_faults_; }

  // A rank's verification rejected the last `rejected` positions of the
  // sequence's drafting entry: its cache length drops (pages stay).
  void Rollback(int64_t seq_id, int64_t rejected) {
    if (!cache_->has_state()) {
      cache_->SetLength(seq_id, cache_->Length(seq_id) - rejected);
    } else if (rejected > 0) {
      absl::Status s = cache_->RollbackWithState(seq_id, cache_->Length(seq_id) - rejected);
      EXPECT_TRUE(s.ok()) << s;
    } else {
      cache_->DropStateHistory(seq_id);
    }
  }
  // The longest draft ever proposed (bounds the tail blocks, I2).
  void set_max_draft(int64_t n) { max_draft_ = n; }
  uint64_t drafting_entries() const { return drafting_entries_; }
  uint64_t snapshots_taken() const { return snapshots_taken_; }

  std::vector<int64_t> FailAndReform() {
    NewCache();
    disk_.clear();  // the ranks' files are created again
    reformed_ = true;
    return scheduler_.RequeueAll();
  }

  ScheduleOutput Step(absl::Time now = kT0) {
    ScheduleOutput out = scheduler_.Schedule(now);
    for (int64_t id : out.release) {
      absl::Status removed = cache_->RemoveSequence(id);
      // After a re-formation, sequences the old group held are unknown.
      EXPECT_TRUE(removed.ok() || (reformed_ && absl::IsNotFound(removed))) << id << removed;
    }
    for (int64_t id : out.admit) {
      const StateSnapshot state = scheduler_.cached_state(id);
      absl::Status added =
          cache_->AddSequence(id, scheduler_.cached_at_admission(id),
                              {.slot = state.slot, .hash_hi = state.hash.hi, .hash_lo = state.hash.lo});
      EXPECT_TRUE(added.ok()) << id << added;
      if (!cache_->has_state()) EXPECT_EQ(state.slot, -1);
    }
    for (const BlockTransfer& save : out.kv_saves) {
      const std::span<const uint8_t> bytes = cache_->PageBytes(save.block);
      disk_[save.slot] = {save.hash, std::vector<uint8_t>(bytes.begin(), bytes.end())};
    }
    if (!out.kv_loads.empty()) {
      std::vector<uint8_t> loaded;
      for (const BlockTransfer& load : out.kv_loads) {
        EXPECT_EQ(cache_->PageRefs(load.block), 0) << "a load into a page in use";
        auto it = disk_.find(load.slot);
        bool ok = it != disk_.end() && it->second.first == load.hash;
        std::span<uint8_t> page = cache_->MutablePageBytes(load.block);
        if (ok && std::bernoulli_distribution(fault_rate_)(fault_rng_)) {
          ok = false;
          ++disk_faults_;
          std::fill(page.begin(), page.end(), uint8_t{0x7f});
        }
        if (ok) std::copy(it->second.second.begin(), it->second.second.end(), page.begin());
        loaded.push_back(ok ? 1 : 0);
      }
      scheduler_.KvLoadsDone(loaded);
    }
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
      const int64_t end = c.start + static_cast<int64_t>(c.tokens.size());
      absl::Status reserved = cache_->Reserve(c.seq_id, end);
      EXPECT_TRUE(reserved.ok()) << reserved;
      const std::span<const int32_t> table = scheduler_.block_table(c.seq_id);
      EXPECT_EQ(cache_->PageTable(c.seq_id), std::vector<int64_t>(table.begin(), table.end()))
          << "sequence " << c.seq_id;
      const std::span<const int32_t> seq_tokens = scheduler_.tokens(c.seq_id);
      // What the rank computes on: the sequence's tokens before the chunk,
      // then the chunk (for a drafting entry its drafts follow the tokens).
      std::vector<int32_t> ext(seq_tokens.begin(), seq_tokens.begin() + c.start);
      ext.insert(ext.end(), c.tokens.begin(), c.tokens.end());
      std::span<const int32_t> all = ext;
      if (assigned.ok() && reserved.ok()) {
        // What the attention of this chunk reads: the sequence's own prefix.
        if (c.start > 0) {
          std::vector<float> k(c.start * 2), v(c.start * 2);
          cache_->Read(c.seq_id, 0, 0, c.start, k.data(), v.data());
          for (int64_t pos = 0; pos < c.start; ++pos) {
            float ek[2], ev[2];
            ExpectedEntry(all, pos, ek, ev);
            const bool same = k[pos * 2] == ek[0] && k[pos * 2 + 1] == ek[1] && v[pos * 2] == ev[0];
            EXPECT_TRUE(same) << "sequence " << c.seq_id << " reads a wrong entry at position "
                              << pos << " (cached " << scheduler_.cached_at_admission(c.seq_id)
                              << ")";
            if (!same) break;
          }
        }
        std::vector<float> k(c.tokens.size() * 2), v(c.tokens.size() * 2);
        for (int64_t pos = c.start; pos < end; ++pos) {
          ExpectedEntry(all, pos, &k[(pos - c.start) * 2], &v[(pos - c.start) * 2]);
        }
        cache_->Write(c.seq_id, 0, c.start, end - c.start, k.data(), v.data());
        if (cache_->has_state()) {
          // The state this chunk continues must be its own prefix's.
          float* state = cache_->State(c.seq_id, 0);
          EXPECT_EQ(*state, ExpectedState(all, c.start))
              << "sequence " << c.seq_id << " resumes a wrong state at " << c.start << " (cached "
              << scheduler_.cached_at_admission(c.seq_id) << ")";
          if (c.num_draft > 0) {
            absl::Status kept = cache_->KeepStateHistory(c.seq_id, end - c.start);
            EXPECT_TRUE(kept.ok()) << kept;
            for (int64_t pos = c.start; pos < end; ++pos) {
              *cache_->StateHistory(c.seq_id, 0, pos) = ExpectedState(all, pos + 1);
            }
          }
          *state = ExpectedState(all, end);
        }
        cache_->SetLength(c.seq_id, end);
      }
      // I4 (a drafting entry: the sequence's tokens end before its drafts)
      const int64_t own = static_cast<int64_t>(c.tokens.size()) - c.num_draft;
      EXPECT_TRUE(c.num_draft == 0 || (c.needs_logits && own == 1)) << "sequence " << c.seq_id;
      EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.begin() + own, seq_tokens.begin() + c.start));
      EXPECT_EQ(c.needs_logits, c.start + own == static_cast<int64_t>(seq_tokens.size()));
      // I2: ceil(computed / page) blocks, plus those of the drafts' positions.
      const int64_t page = options_.page_size_tokens;
      EXPECT_GE(scheduler_.blocks_held(c.seq_id),
                (scheduler_.computed(c.seq_id) + c.num_draft + page - 1) / page);
      EXPECT_LE(scheduler_.blocks_held(c.seq_id),
                (scheduler_.computed(c.seq_id) + std::max<int64_t>(c.num_draft, max_draft_) + page - 1) /
                    page);
      if (c.num_draft > 0) ++drafting_entries_;
    }
    // The snapshots, after the "forward": each at its chunk's end, which is
    // a block boundary without drafts (the cache refuses other lengths and
    // a kept history).
    for (const StateSnapshot& save : out.state_saves) {
      const ScheduledChunk* c = nullptr;
      for (const ScheduledChunk& e : out.batch) {
        if (e.seq_id == save.seq_id) c = &e;
      }
      EXPECT_NE(c, nullptr) << "a snapshot of sequence " << save.seq_id << " outside the batch";
      if (c == nullptr) continue;
      EXPECT_EQ(c->num_draft, 0);
      absl::Status saved = cache_->SaveStateSnapshot(
          save.seq_id, {.slot = save.slot, .hash_hi = save.hash.hi, .hash_lo = save.hash.lo});
      EXPECT_TRUE(saved.ok()) << saved;
      ++snapshots_taken_;
    }
    EXPECT_LE(total, options_.step_token_budget);  // I3
    EXPECT_LE(scheduler_.num_running(), options_.max_running);
    // I1, and the mirror: the scheduler's free blocks are the cache's free
    // pages (blocks held for disk loads are free pages on the ranks).
    const std::vector<int32_t> loading = scheduler_.blocks_held_for_loads();
    EXPECT_EQ(scheduler_.free_blocks() + static_cast<int64_t>(loading.size()),
              cache_->free_pages());
    // P1, P2 of the pool, and P3 against the mirror's reference counts.
    EXPECT_EQ(scheduler_.block_pool().CheckInvariants(), "");
    for (int32_t b = 0; b < options_.num_blocks; ++b) {
      const int64_t for_loads = std::count(loading.begin(), loading.end(), b);
      EXPECT_EQ(scheduler_.block_pool().refs(b) - for_loads, cache_->PageRefs(b)) << "block " << b;
    }
    return out;
  }

 private:
  void NewCache() {
    worker::KvCacheOptions kv;
    kv.page_size_tokens = static_cast<int>(options_.page_size_tokens);
    kv.num_pages = options_.num_blocks;
    kv.dtype = worker::KvCacheDtype::kFp32;
    kv.caller_assigns_pages = true;
    worker::KvCacheShape shape;
    shape.num_layers = 1;
    shape.num_kv_heads = 1;
    shape.head_dim = 2;
    if (options_.recurrent_state) shape.state_floats = {1};
    auto cache = worker::PagedKvCache::Create(shape, kv);
    EXPECT_TRUE(cache.ok()) << cache.status();
    cache_.emplace(std::move(*cache));
  }

  Scheduler scheduler_;
  SchedulerOptions options_;
  std::optional<worker::PagedKvCache> cache_;
  bool reformed_ = false;
  std::map<int64_t, std::pair<BlockHash, std::vector<uint8_t>>> disk_;
  double fault_rate_ = 0;
  std::mt19937 fault_rng_;
  uint64_t disk_faults_ = 0;
  int64_t max_draft_ = 0;
  uint64_t drafting_entries_ = 0;
  uint64_t snapshots_taken_ = 0;
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
// Randomized workloads to completion, checked by the harness after every
// step; every sequence's output must be what it produces alone. With
// `caching`, prompts share prefixes the way chat traffic does (one of a few
// system prompts, or an earlier conversation's prompt + output + a new turn)
// and the rank group fails and re-forms now and then (RequeueAll with empty
// caches); the harness's content check proves that every cached position a
// sequence reads is its own prefix.
struct WorkloadCounts {
  uint64_t preemptions = 0, cancellations = 0, reformations = 0, hit_tokens = 0;
  uint64_t snapshots = 0, snapshot_hits = 0;
  uint64_t disk_hits = 0, disk_misses = 0, disk_faults = 0;
  uint64_t drafting_entries = 0, accepted_drafts = 0;
};

// With `drafting`, every sequence that awaits a decode proposes a random
// draft (a random number of correct tokens, then wrong ones) and the
// "verification" accepts the correct prefix, as the ranks would.
// With `recurrent`, the model keeps a recurrent state (a random number of
// snapshot slots and interval; the harness checks every resumed state).
WorkloadCounts RunRandomWorkloads(bool caching, int rounds, bool disk = false,
                                  bool drafting = false, bool recurrent = false) {
  const uint32_t seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  WorkloadCounts counts;
  for (int round = 0; round < rounds; ++round) {
    std::mt19937 rng(seed * 7919u + round);
    SCOPED_TRACE(::testing::Message() << "gtest seed " << seed << ", round " << round);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    SchedulerOptions options;
    options.page_size_tokens = uniform(1, 8);
    options.num_blocks = uniform(8, 40);
    options.max_running = uniform(1, 8);
    options.step_token_budget = uniform(1, 24);
    options.enable_prefix_caching = caching;
    if (disk) options.disk_blocks = uniform(1, 24);
    const int max_draft = drafting ? uniform(1, 6) : 0;
    options.draft_token_budget = drafting ? uniform(1, 12) : 0;
    if (recurrent) {
      options.recurrent_state = true;
      options.state_snapshot_slots = uniform(1, 8);
      options.state_snapshot_interval_blocks = uniform(0, 3);
    }
    const int64_t capacity = options.page_size_tokens * options.num_blocks;
    Harness h(options);
    h.set_max_draft(max_draft);
    h.SetDiskFaults(0.15, seed + round);

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
    std::vector<std::vector<int32_t>> system_prompts(3);
    for (auto& sp : system_prompts) {
      const int len = uniform(0, static_cast<int>(std::min<int64_t>(capacity / 2, 30)));
      for (int i = 0; i < len; ++i) sp.push_back(uniform(0, 999));
    }
    const int n = uniform(1, 30);
    int64_t next_id = 0;
    std::vector<int64_t> first_admissions;
    int steps = 0;
    while (true) {
      if (next_id < n && uniform(0, 2) == 0) {
        Want w;
        const int64_t total = uniform(2, static_cast<int>(std::min<int64_t>(capacity, 60)));
        if (caching) {
          // A shared beginning: a system prompt, or a finished conversation.
          std::vector<int32_t> start = system_prompts[uniform(0, 2)];
          if (uniform(0, 1) == 0) {
            for (const auto& [id, done] : want) {
              if (done.done && uniform(0, 2) == 0) {
                start = done.prompt;
                start.insert(start.end(), done.output.begin(), done.output.end());
              }
            }
          }
          if (static_cast<int64_t>(start.size()) >= total) start.resize(uniform(0, static_cast<int>(total - 1)));
          w.prompt = start;
        }
        const int64_t prompt_len =
            uniform(static_cast<int>(std::max<size_t>(w.prompt.size(), 1)), static_cast<int>(total - 1));
        while (static_cast<int64_t>(w.prompt.size()) < prompt_len) w.prompt.push_back(uniform(0, 999));
        w.max_new = total - prompt_len;
        EXPECT_TRUE(h.scheduler().Add(next_id, w.prompt).ok());
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
      if (caching && uniform(0, 150) == 0) {
        h.FailAndReform();
        ++counts.reformations;
      }
      // The serial continuation of a sequence's tokens.
      auto continuation = [&](std::span<const int32_t> all, int64_t n) {
        std::vector<int32_t> next;
        int32_t last = all.back();
        for (int64_t i = 0; i < n; ++i) {
          last = next_token(last, static_cast<int64_t>(all.size()) + i);
          next.push_back(last);
        }
        return next;
      };
      for (const auto& [id, w] : want) {
        if (!drafting || w.done || w.cancelled || !h.scheduler().is_running(id)) continue;
        const std::span<const int32_t> all = h.scheduler().tokens(id);
        if (static_cast<int64_t>(all.size()) - h.scheduler().computed(id) != 1) continue;
        // Never past max_new: the run of k drafts is at most k + 1 tokens.
        const int64_t room = w.max_new - static_cast<int64_t>(w.output.size()) - 1;
        const int len = uniform(0, static_cast<int>(std::min<int64_t>(max_draft, room)));
        const int right = uniform(0, len);
        std::vector<int32_t> draft = continuation(all, len);
        for (int i = right; i < len; ++i) draft[i] = (draft[i] + 1 + uniform(0, 5)) % 1000;
        h.scheduler().ProposeDraft(id, std::move(draft));
      }
      ScheduleOutput out = h.Step();
      if (::testing::Test::HasFatalFailure() || ::testing::Test::HasNonfatalFailure()) {
        ADD_FAILURE() << "stopping this workload after the first failed step";
        return counts;
      }
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
        // Verification: the drafts equal to the serial tokens are accepted,
        // then one more token is sampled; the rest is rolled back.
        const std::vector<int32_t> serial = continuation(all, c.num_draft + 1);
        int64_t accepted = 0;
        while (accepted < c.num_draft && c.tokens[1 + accepted] == serial[accepted]) ++accepted;
        h.Rollback(c.seq_id, c.num_draft - accepted);
        counts.drafting_entries += c.num_draft > 0;
        counts.accepted_drafts += accepted;
        const std::span<const int32_t> run = std::span(serial).first(accepted + 1);
        for (int32_t token : run) {
          if (static_cast<int64_t>(w.output.size()) < w.max_new) w.output.push_back(token);
        }
        if (static_cast<int64_t>(w.output.size()) == w.max_new) {
          h.scheduler().Finish(c.seq_id);
          w.done = true;
        } else {
          h.scheduler().AppendRun(c.seq_id, run);
        }
      }
      ++steps;
      if (steps >= 100000) {
        ADD_FAILURE() << "no progress";
        return counts;
      }
      if (next_id == n && h.scheduler().empty()) break;
    }
    counts.preemptions += h.scheduler().num_preemptions();
    counts.hit_tokens += h.scheduler().prefix_cache_stats().hit_tokens;
    counts.disk_hits += h.scheduler().prefix_cache_stats().disk_hits;
    counts.disk_misses += h.scheduler().prefix_cache_stats().disk_misses;
    counts.disk_faults += h.disk_faults();
    counts.snapshots += h.snapshots_taken();
    counts.snapshot_hits += h.scheduler().prefix_cache_stats().state_snapshot_hits;
    EXPECT_EQ(h.scheduler().prefix_cache_stats().state_snapshot_saves, h.snapshots_taken());
    EXPECT_TRUE(h.scheduler().blocks_held_for_loads().empty());
    for (const auto& [id, w] : want) counts.cancellations += w.cancelled;
    // FCFS for first admissions.
    EXPECT_TRUE(std::is_sorted(first_admissions.begin(), first_admissions.end()));
    EXPECT_EQ(h.scheduler().free_blocks(), options.num_blocks);
    for (int32_t b = 0; b < options.num_blocks; ++b) EXPECT_EQ(h.scheduler().block_pool().refs(b), 0);
    for (const auto& [id, w] : want) {
      if (w.cancelled) continue;
      EXPECT_TRUE(w.done) << id;
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
  return counts;
}

TEST(SchedulerTest, RandomWorkloadsFinishWithTheirOwnTokens) {
  const WorkloadCounts counts = RunRandomWorkloads(/*caching=*/false, 40);
  // The workloads are meant to exercise preemption and cancellation.
  EXPECT_GT(counts.preemptions, 0u);
  EXPECT_GT(counts.cancellations, 0u);
  EXPECT_EQ(counts.hit_tokens, 0u);
}

TEST(SchedulerTest, RandomWorkloadsWithDraftsFinishWithTheirOwnTokens) {
  const WorkloadCounts counts =
      RunRandomWorkloads(/*caching=*/false, 60, /*disk=*/false, /*drafting=*/true);
  EXPECT_GT(counts.drafting_entries, 0u);
  EXPECT_GT(counts.accepted_drafts, 0u);
  EXPECT_GT(counts.preemptions, 0u);
}

TEST(SchedulerTest, RandomDraftingWorkloadsThroughThePrefixCacheReadOnlyTheirOwnPrefix) {
  // Rejected draft positions are rolled back on the "rank" and rewritten
  // later; the harness's content check reads every earlier position.
  const WorkloadCounts counts =
      RunRandomWorkloads(/*caching=*/true, 60, /*disk=*/true, /*drafting=*/true);
  EXPECT_GT(counts.drafting_entries, 0u);
  EXPECT_GT(counts.accepted_drafts, 0u);
  EXPECT_GT(counts.hit_tokens, 0u);
  EXPECT_GT(counts.reformations, 0u);
}

TEST(SchedulerTest, DraftsComeAfterDecodesWithinTheirBudgetAndFreeBlocksOnly) {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 64;
  options.step_token_budget = 12;
  options.draft_token_budget = 5;
  Harness h(options);
  h.set_max_draft(4);
  for (int64_t id = 1; id <= 3; ++id) ASSERT_TRUE(h.scheduler().Add(id, Tokens(3, 10 * id)).ok());
  ScheduleOutput s1 = h.Step();
  ASSERT_EQ(s1.batch.size(), 3u);
  for (int64_t id = 1; id <= 3; ++id) h.scheduler().AppendToken(id, 100 + id);
  // Proposals: 4 for sequence 1, 4 for sequence 2, none for 3; a prompt waits.
  h.scheduler().ProposeDraft(1, {7, 8, 9, 10});
  h.scheduler().ProposeDraft(2, {17, 18, 19, 20});
  ASSERT_TRUE(h.scheduler().Add(4, Tokens(20, 500)).ok());
  ScheduleOutput s2 = h.Step();
  ASSERT_GE(s2.batch.size(), 3u);
  // Decodes first, each one token; then drafts in batch order within 5.
  EXPECT_EQ(s2.batch[0].seq_id, 1);
  EXPECT_EQ(s2.batch[0].num_draft, 4);
  EXPECT_EQ(std::vector<int32_t>(s2.batch[0].tokens.begin(), s2.batch[0].tokens.end()),
            (std::vector<int32_t>{101, 7, 8, 9, 10}));
  EXPECT_EQ(s2.batch[1].num_draft, 1);  // what the draft budget left
  EXPECT_EQ(s2.batch[1].tokens.size(), 2u);
  EXPECT_EQ(s2.batch[2].num_draft, 0);
  // The new prompt gets what remains of the step budget: 12 - 3 - 5.
  ASSERT_EQ(s2.batch.size(), 4u);
  EXPECT_EQ(s2.batch[3].seq_id, 4);
  EXPECT_EQ(s2.batch[3].tokens.size(), 4u);
  // Sequence 1 accepted 2 of 4 (+ one sampled); 2 rejected its draft.
  h.Rollback(1, 2);
  h.Rollback(2, 1);
  const int32_t run1[] = {7, 8, 55};
  h.scheduler().AppendRun(1, run1);
  h.scheduler().AppendToken(2, 66);
  h.scheduler().AppendToken(3, 77);
  EXPECT_EQ(h.scheduler().computed(1), 3 + 1 + 2);
  EXPECT_EQ(h.scheduler().tokens(1).back(), 55);
  EXPECT_EQ(h.scheduler().computed(2), 4);
  // A proposal is used once: the next step decodes plainly.
  ScheduleOutput s3 = h.Step();
  for (const ScheduledChunk& c : s3.batch) EXPECT_EQ(c.num_draft, 0);
}

TEST(SchedulerTest, DraftsNeverPreemptOrTakeBlocksThatAreNotFree) {
  SchedulerOptions options;
  options.page_size_tokens = 2;
  options.num_blocks = 3;  // 6 positions
  options.step_token_budget = 16;
  options.draft_token_budget = 16;
  Harness h(options);
  h.set_max_draft(8);
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(3)).ok());
  h.Step();
  h.scheduler().AppendToken(1, 9);
  // 4 positions used after this decode; 2 more fit (the last block).
  h.scheduler().ProposeDraft(1, {1, 2, 3, 4, 5, 6, 7, 8});
  ScheduleOutput s = h.Step();
  ASSERT_EQ(s.batch.size(), 1u);
  EXPECT_EQ(s.batch[0].num_draft, 2);
  EXPECT_TRUE(s.preempted.empty());
  EXPECT_EQ(h.scheduler().free_blocks(), 0);
}

TEST(SchedulerTest, RandomSharedPrefixWorkloadsReadOnlyTheirOwnPrefix) {
  const WorkloadCounts counts = RunRandomWorkloads(/*caching=*/true, 60);
  EXPECT_GT(counts.preemptions, 0u);
  EXPECT_GT(counts.cancellations, 0u);
  EXPECT_GT(counts.reformations, 0u);
  EXPECT_GT(counts.hit_tokens, 0u);
}

TEST(SchedulerTest, RandomWorkloadsThroughTheDiskTierReadOnlyTheirOwnPrefix) {
  const WorkloadCounts counts = RunRandomWorkloads(/*caching=*/true, 80, /*disk=*/true);
  EXPECT_GT(counts.disk_hits, 0u);
  EXPECT_GT(counts.disk_faults, 0u);
  EXPECT_GE(counts.disk_misses, counts.disk_faults);
  EXPECT_GT(counts.reformations, 0u);
}

TEST(SchedulerTest, RandomRecurrentStateWorkloadsResumeOnlyTheirOwnState) {
  // Prefix caching with state snapshots, with drafts, the disk tier,
  // preemption and re-formations: every chunk starts from its own prefix's
  // state (the harness), and outputs equal the lone runs.
  const WorkloadCounts counts = RunRandomWorkloads(/*caching=*/true, 80, /*disk=*/true,
                                                   /*drafting=*/true, /*recurrent=*/true);
  EXPECT_GT(counts.snapshots, 0u);
  EXPECT_GT(counts.snapshot_hits, 0u);
  EXPECT_GT(counts.hit_tokens, 0u);
  EXPECT_GT(counts.drafting_entries, 0u);
  EXPECT_GT(counts.preemptions, 0u);
}

TEST(SchedulerTest, RandomRecurrentStateWorkloadsWithoutTheCacheNeverSnapshot) {
  const WorkloadCounts counts = RunRandomWorkloads(/*caching=*/false, 20, /*disk=*/false,
                                                   /*drafting=*/true, /*recurrent=*/true);
  EXPECT_EQ(counts.snapshots, 0u);
  EXPECT_EQ(counts.hit_tokens, 0u);
}

SchedulerOptions CachingOptions() {
  SchedulerOptions options;
  options.page_size_tokens = 4;
  options.num_blocks = 16;
  options.step_token_budget = 64;
  options.enable_prefix_caching = true;
  return options;
}

// Runs `id` with `prompt` to its first token, then finishes it.
void RunToFirstToken(Harness& h, int64_t id, const std::vector<int32_t>& prompt) {
  ASSERT_TRUE(h.scheduler().Add(id, prompt).ok());
  for (int i = 0; i < 20; ++i) {
    ScheduleOutput out = h.Step();
    const ScheduledChunk* c = Find(out, id);
    if (c != nullptr && c->needs_logits) {
      h.scheduler().Finish(id);
      h.Step();
      return;
    }
  }
  FAIL() << "sequence " << id << " never reached its first token";
}

TEST(SchedulerTest, PrefixCacheReusesTheFullBlocksOfAnEarlierPrompt) {
  Harness h(CachingOptions());
  std::vector<int32_t> a = Tokens(10);
  RunToFirstToken(h, 1, a);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 2);  // positions 0..7
  // The same first 9 tokens, then others: blocks 0 and 1 are reused.
  std::vector<int32_t> b = Tokens(9);
  b.push_back(500);
  b.push_back(501);
  b.push_back(502);
  ASSERT_TRUE(h.scheduler().Add(2, b).ok());
  ScheduleOutput out = h.Step();
  const ScheduledChunk* c = Find(out, 2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 8);
  EXPECT_EQ(h.scheduler().cached_at_first_admission(2), 8);
  EXPECT_EQ(c->start, 8);
  EXPECT_EQ(c->tokens.size(), 4u);
  ASSERT_GE(c->new_blocks.size(), 3u);
  const std::span<const int32_t> table = h.scheduler().block_table(2);
  EXPECT_EQ(c->new_blocks, std::vector<int32_t>(table.begin(), table.end()));
  EXPECT_EQ(h.scheduler().prefix_cache_stats().queried_tokens, 10u + 12u);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().hit_tokens, 8u);
}

// The ranks compute a prompt's rows at the prefill precision and output
// rows at the decode precision (worker/api/sampling.h PrefillKindEnd), so a
// follow-up turn whose prompt holds an earlier turn's output must not reuse
// the blocks of those decoded rows: a prompt computed afresh would run them
// at the prefill precision (cache on == off). It reuses the earlier prompt's
// blocks; the sequence itself, re-admitted, finds all of its own.
TEST(SchedulerTest, APromptNeverReusesTheBlocksOfDecodedRows) {
  Harness h(CachingOptions());  // 4-token pages
  const std::vector<int32_t> prompt = Tokens(20);  // >= 17: prefill kind
  ASSERT_TRUE(h.scheduler().Add(1, prompt).ok());
  std::vector<int32_t> output;
  for (int i = 0; i < 40 && output.size() < 9; ++i) {
    ScheduleOutput out = h.Step();
    const ScheduledChunk* c = Find(out, 1);
    if (c != nullptr && c->needs_logits) {
      output.push_back(600 + static_cast<int32_t>(output.size()));
      h.scheduler().AppendToken(1, output.back());
    }
  }
  ASSERT_EQ(output.size(), 9u);
  h.Step();  // computes the last output token: 29 positions, 7 full blocks
  h.scheduler().Finish(1);
  h.Step();
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 7);
  std::vector<int32_t> turn = prompt;
  turn.insert(turn.end(), output.begin(), output.end());
  for (int32_t t : {700, 701, 702, 703, 704}) turn.push_back(t);
  ASSERT_TRUE(h.scheduler().Add(2, turn).ok());
  h.Step();
  // Blocks 0..4 hold positions 0..19, all prompt rows of sequence 1; block
  // 5 onwards hold its decoded rows.
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 20);
}

TEST(SchedulerTest, PrefixCacheAlwaysComputesTheLastPromptToken) {
  Harness h(CachingOptions());
  RunToFirstToken(h, 1, Tokens(8));  // two full blocks, both sealed
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 2);
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(8)).ok());
  ScheduleOutput out = h.Step();
  const ScheduledChunk* c = Find(out, 2);
  ASSERT_NE(c, nullptr);
  // Only the first block: the second holds the last token, whose logits
  // are needed, and a shared block is never written.
  EXPECT_EQ(c->start, 4);
  EXPECT_EQ(c->tokens.size(), 4u);
  EXPECT_TRUE(c->needs_logits);
}

TEST(SchedulerTest, PrefixBlocksAreSharedByRunningSequences) {
  Harness h(CachingOptions());
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(9)).ok());
  h.Step();  // 1 prefilled, holds 3 blocks (two full)
  h.scheduler().AppendToken(1, 77);
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(9)).ok());
  ScheduleOutput out = h.Step();  // 1 decodes, 2 shares its two full blocks
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(Find(out, 2)->start, 8);
  const std::span<const int32_t> t1 = h.scheduler().block_table(1);
  const std::span<const int32_t> t2 = h.scheduler().block_table(2);
  EXPECT_EQ(t1[0], t2[0]);
  EXPECT_EQ(t1[1], t2[1]);
  EXPECT_NE(t1[2], t2[2]);
  EXPECT_EQ(h.cache().PageRefs(t1[0]), 2);
  EXPECT_EQ(h.scheduler().free_blocks(), 16 - 4);  // distinct blocks held: 4
}

TEST(SchedulerTest, PrefixCacheEvictsTheLeastRecentlyReleasedBlocksFirst) {
  SchedulerOptions options = CachingOptions();
  options.num_blocks = 6;
  Harness h(options);
  RunToFirstToken(h, 1, Tokens(9, 100));  // seals 2 blocks
  RunToFirstToken(h, 2, Tokens(9, 200));  // seals 2 more
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 4);
  // 5 blocks needed: the 2 free ones, then 1's two blocks (released first),
  // then 2's tail block (a sequence's tail goes before its head).
  RunToFirstToken(h, 3, Tokens(17, 300));
  EXPECT_EQ(h.scheduler().prefix_cache_stats().evicted_blocks, 3u);
  ASSERT_TRUE(h.scheduler().Add(4, Tokens(9, 200)).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().cached_at_admission(4), 4);  // 2's head block survived
  ASSERT_TRUE(h.scheduler().Add(5, Tokens(9, 100)).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().cached_at_admission(5), 0);  // 1's head block was evicted
}

TEST(SchedulerTest, PrefixCacheIsForgottenWhenTheGroupReforms) {
  Harness h(CachingOptions());
  RunToFirstToken(h, 1, Tokens(9));
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(13)).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 8);
  h.scheduler().AppendToken(2, 5);
  EXPECT_EQ(h.FailAndReform(), std::vector<int64_t>{2});
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 0);
  ScheduleOutput out = h.Step();  // 2 is prefilled again from position 0
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(Find(out, 2)->start, 0);
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 0);
  EXPECT_EQ(h.scheduler().cached_at_first_admission(2), 8);
}

TEST(SchedulerTest, ASequenceThatOptsOutNeitherReadsNorLeavesCachedBlocks) {
  Harness h(CachingOptions());
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(9), absl::InfiniteFuture(), false).ok());
  h.Step();
  h.scheduler().Finish(1);
  h.Step();
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 0);
  RunToFirstToken(h, 2, Tokens(9));
  ASSERT_TRUE(h.scheduler().Add(3, Tokens(9), absl::InfiniteFuture(), false).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().cached_at_admission(3), 0);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().queried_tokens, 9u);  // only 2's
}

TEST(SchedulerTest, PrefixCacheIsOffUnlessEnabled) {
  SchedulerOptions options = CachingOptions();
  options.enable_prefix_caching = false;
  Harness h(options);
  RunToFirstToken(h, 1, Tokens(9));
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(9)).ok());
  h.Step();
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 0);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().cached_blocks, 0);
}

// The disk tier: a cached block evicted from memory is saved; a later prompt
// with that prefix loads it (one step), then is admitted with it cached. A
// failed load is a miss: those positions are computed.
TEST(SchedulerTest, AnEvictedBlockComesBackFromTheDiskTier) {
  for (const bool fault : {false, true}) {
    SCOPED_TRACE(fault ? "the load fails" : "the load succeeds");
    SchedulerOptions options = CachingOptions();
    options.num_blocks = 6;
    options.disk_blocks = 8;
    Harness h(options);
    if (fault) h.SetDiskFaults(1.0, 1);
    RunToFirstToken(h, 1, Tokens(9, 100));  // seals its 2 full blocks
    RunToFirstToken(h, 2, Tokens(17, 300));  // 5 blocks: evicts 1's second (its tail) block
    EXPECT_EQ(h.scheduler().prefix_cache_stats().disk_saves, 1u);
    EXPECT_EQ(h.scheduler().prefix_cache_stats().disk_used, 1);
    ASSERT_TRUE(h.scheduler().Add(3, Tokens(9, 100)).ok());
    ScheduleOutput loading = h.Step();
    ASSERT_EQ(loading.kv_loads.size(), 1u);
    EXPECT_TRUE(loading.admit.empty());  // it waits for its load
    ScheduleOutput admitted = h.Step();
    ASSERT_EQ(admitted.admit, std::vector<int64_t>{3});
    const PrefixCacheStats stats = h.scheduler().prefix_cache_stats();
    if (fault) {
      EXPECT_EQ(h.scheduler().cached_at_admission(3), 4);  // the head block, from memory
      EXPECT_EQ(stats.disk_misses, 1u);
      // The failed block's slot was forgotten (freed); later evictions may
      // have saved others since (8 slots: none was reused).
      EXPECT_EQ(stats.disk_evictions, 0u);
      EXPECT_EQ(stats.disk_used, static_cast<int64_t>(stats.disk_saves) - 1);
    } else {
      EXPECT_EQ(h.scheduler().cached_at_admission(3), 8);
      EXPECT_EQ(stats.disk_hits, 1u);
    }
    EXPECT_TRUE(h.scheduler().blocks_held_for_loads().empty());
  }
}

SchedulerOptions RecurrentOptions(int64_t interval) {
  SchedulerOptions options = CachingOptions();
  options.recurrent_state = true;
  options.state_snapshot_slots = 4;
  options.state_snapshot_interval_blocks = interval;
  return options;
}

TEST(SchedulerTest, ARecurrentPromptIsSnapshottedAtItsLastFullBlockAndResumedThere) {
  Harness h(RecurrentOptions(/*interval=*/0));
  ASSERT_TRUE(h.scheduler().Add(1, Tokens(10)).ok());
  // The prefill is cut at block 2 ((10 - 1) / 4), where the state is kept.
  ScheduleOutput out = h.Step();
  const ScheduledChunk* c = Find(out, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->tokens.size(), 8u);
  EXPECT_FALSE(c->needs_logits);
  ASSERT_EQ(out.state_saves.size(), 1u);
  EXPECT_EQ(out.state_saves[0].seq_id, 1);
  out = h.Step();
  c = Find(out, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->start, 8);
  EXPECT_TRUE(c->needs_logits);
  EXPECT_TRUE(out.state_saves.empty());
  h.scheduler().Finish(1);
  h.Step();
  // The same prompt again: two blocks and the snapshot, two tokens computed.
  ASSERT_TRUE(h.scheduler().Add(2, Tokens(10)).ok());
  out = h.Step();
  c = Find(out, 2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 8);
  EXPECT_GE(h.scheduler().cached_state(2).slot, 0);
  EXPECT_EQ(c->start, 8);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().state_snapshot_hits, 1u);
  EXPECT_EQ(h.scheduler().prefix_cache_stats().state_snapshots, 1);
}

TEST(SchedulerTest, RecurrentBlocksWithoutASnapshotAreNotAHit) {
  // Only the prompt's last full block is snapshotted: a prompt that shares
  // three blocks with it (not the fourth) finds their KV but no state.
  Harness h(RecurrentOptions(/*interval=*/0));
  RunToFirstToken(h, 1, Tokens(20));  // snapshot at 16
  std::vector<int32_t> b = Tokens(13);
  b.insert(b.end(), {700, 701, 702, 703});
  ASSERT_TRUE(h.scheduler().Add(2, b).ok());
  ScheduleOutput out = h.Step();
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 0);
  EXPECT_EQ(h.scheduler().cached_state(2).slot, -1);
}

TEST(SchedulerTest, RecurrentSnapshotsAtAnIntervalServeASharedBeginning) {
  // Every 2 blocks as well: the shared 13 tokens resume from the one at 8.
  Harness h(RecurrentOptions(/*interval=*/2));
  RunToFirstToken(h, 1, Tokens(20));  // snapshots at 8 and 16
  EXPECT_EQ(h.scheduler().prefix_cache_stats().state_snapshot_saves, 2u);
  std::vector<int32_t> b = Tokens(13);
  b.insert(b.end(), {700, 701, 702, 703});
  ASSERT_TRUE(h.scheduler().Add(2, b).ok());
  ScheduleOutput out = h.Step();
  const ScheduledChunk* c = Find(out, 2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(h.scheduler().cached_at_admission(2), 8);
  EXPECT_EQ(c->start, 8);
  // Its own last full block (16 of 17) gets a snapshot: the chunk stops there.
  EXPECT_EQ(c->tokens.size(), 8u);
  EXPECT_EQ(out.state_saves.size(), 1u);
}

TEST(SchedulerTest, DifferentSaltsNeverShareBlocks) {
  const std::vector<int32_t> t = Tokens(4);
  EXPECT_EQ(ChainBlockHash(RootBlockHash("a"), t), ChainBlockHash(RootBlockHash("a"), t));
  EXPECT_FALSE(ChainBlockHash(RootBlockHash("a"), t) == ChainBlockHash(RootBlockHash("b"), t));
  // The chain covers the whole prefix, not just the block.
  const BlockHash root = RootBlockHash("a");
  const BlockHash x = ChainBlockHash(ChainBlockHash(root, Tokens(4, 1)), t);
  const BlockHash y = ChainBlockHash(ChainBlockHash(root, Tokens(4, 2)), t);
  EXPECT_FALSE(x == y);
}

}  // namespace
}  // namespace exl3serve::coordinator
