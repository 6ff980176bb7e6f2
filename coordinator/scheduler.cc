#include "coordinator/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace exl3serve::coordinator {

Scheduler::Scheduler(const SchedulerOptions& options) : options_(options) {
  EXL3_CHECK(options_.page_size_tokens > 0);
  EXL3_CHECK(options_.num_blocks > 0);
  EXL3_CHECK(options_.max_running > 0);
  EXL3_CHECK(options_.step_token_budget > 0);
  EXL3_CHECK(options_.num_blocks <= INT32_MAX);  // block ids travel as int32
  free_list_.reserve(options_.num_blocks);
  for (int64_t b = options_.num_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
}

void Scheduler::FreeBlocks(Sequence& seq) {
  // Reverse order: a sequence re-admitted at once gets the same ids back.
  for (auto it = seq.blocks.rbegin(); it != seq.blocks.rend(); ++it) free_list_.push_back(*it);
  seq.blocks.clear();
}

absl::Status Scheduler::Add(int64_t seq_id, std::vector<int32_t> prompt, absl::Time deadline) {
  if (prompt.empty()) return absl::InvalidArgumentError("scheduler: empty prompt");
  if (seqs_.contains(seq_id)) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler: sequence ", seq_id, " exists"));
  }
  const int64_t capacity = options_.num_blocks * options_.page_size_tokens;
  if (static_cast<int64_t>(prompt.size()) > capacity) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler: a prompt of ", prompt.size(),
                                                   " tokens exceeds the KV pool's ", capacity,
                                                   " positions"));
  }
  if (options_.max_waiting > 0 && num_waiting() >= options_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", num_waiting(), " requests wait (max_queue ", options_.max_waiting, ")"));
  }
  Sequence seq;
  seq.tokens = std::move(prompt);
  seq.deadline = deadline;
  seqs_.emplace(seq_id, std::move(seq));
  waiting_.push_back(seq_id);
  return absl::OkStatus();
}

void Scheduler::AppendToken(int64_t seq_id, int32_t token) {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  Sequence& seq = it->second;
  EXL3_CHECK(seq.running && seq.computed == static_cast<int64_t>(seq.tokens.size()));
  seq.tokens.push_back(token);
  seq.decoding = true;
}

bool Scheduler::Finish(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return false;
  it->second.mark = Mark::kFinished;
  return true;
}

bool Scheduler::Cancel(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || it->second.mark == Mark::kFinished) return false;
  it->second.mark = Mark::kCancelled;
  return true;
}

std::span<const int32_t> Scheduler::tokens(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return it->second.tokens;
}

int64_t Scheduler::computed(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return it->second.computed;
}

int64_t Scheduler::blocks_held(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return static_cast<int64_t>(it->second.blocks.size());
}

std::span<const int32_t> Scheduler::block_table(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return it->second.blocks;
}

bool Scheduler::is_running(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it != seqs_.end() && it->second.running;
}

int64_t Scheduler::TokensThatFit(const Sequence& seq) const {
  return (static_cast<int64_t>(seq.blocks.size()) + free_blocks()) * options_.page_size_tokens -
         seq.computed;
}

void Scheduler::Erase(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  FreeBlocks(it->second);
  if (it->second.running) {
    running_.erase(std::find(running_.begin(), running_.end(), seq_id));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), seq_id));
  }
  seqs_.erase(it);
}

void Scheduler::Preempt(int64_t seq_id, ScheduleOutput* out) {
  Sequence& seq = seqs_.at(seq_id);
  EXL3_CHECK(seq.running);
  FreeBlocks(seq);
  seq.computed = 0;
  seq.running = false;
  seq.decoding = false;
  running_.erase(std::find(running_.begin(), running_.end(), seq_id));
  waiting_.push_front(seq_id);
  // A sequence admitted in this very step never reached the executor.
  auto admitted = std::find(out->admit.begin(), out->admit.end(), seq_id);
  if (admitted != out->admit.end()) {
    out->admit.erase(admitted);
  } else {
    out->release.push_back(seq_id);
  }
  out->preempted.push_back(seq_id);
  ++num_preemptions_;
}

void Scheduler::Emit(int64_t seq_id, int64_t count, ScheduleOutput* out) {
  Sequence& seq = seqs_.at(seq_id);
  const int64_t needed =
      BlocksFor(seq.computed + count) - static_cast<int64_t>(seq.blocks.size());
  EXL3_CHECK(count > 0 && needed <= free_blocks());
  ScheduledChunk chunk;
  for (int64_t i = 0; i < needed; ++i) {
    seq.blocks.push_back(free_list_.back());
    chunk.new_blocks.push_back(free_list_.back());
    free_list_.pop_back();
  }
  chunk.seq_id = seq_id;
  chunk.start = seq.computed;
  chunk.tokens = std::span<const int32_t>(seq.tokens).subspan(seq.computed, count);
  seq.computed += count;
  chunk.needs_logits = seq.computed == static_cast<int64_t>(seq.tokens.size());
  out->batch.push_back(chunk);
}

ScheduleOutput Scheduler::Schedule(absl::Time now) {
  ScheduleOutput out;

  // 1. Finished, cancelled, expired.
  std::vector<int64_t> gone;
  for (const auto& [id, seq] : seqs_) {
    if (seq.mark != Mark::kNone || seq.deadline <= now) gone.push_back(id);
  }
  std::sort(gone.begin(), gone.end());
  for (int64_t id : gone) {
    const Sequence& seq = seqs_.at(id);
    if (seq.running) out.release.push_back(id);
    if (seq.mark == Mark::kFinished) {
      out.finished.push_back(id);
    } else {
      out.dropped.push_back(
          {id, seq.mark == Mark::kCancelled ? DropReason::kCancelled : DropReason::kDeadline});
    }
    Erase(id);
  }

  // 2. Running sequences: decoding first, then prefilling, oldest first.
  int64_t budget = options_.step_token_budget;
  std::vector<int64_t> order;
  for (int64_t id : running_) {
    if (seqs_.at(id).decoding) order.push_back(id);
  }
  for (int64_t id : running_) {
    if (!seqs_.at(id).decoding) order.push_back(id);
  }
  absl::flat_hash_map<int64_t, bool> in_batch;
  for (int64_t id : order) {
    if (budget == 0) break;
    if (!seqs_.at(id).running) continue;  // preempted earlier in this step
    const Sequence& seq = seqs_.at(id);
    const int64_t pending = static_cast<int64_t>(seq.tokens.size()) - seq.computed;
    if (pending <= 0) continue;  // awaiting AppendToken / Finish
    // Preempt the most recently admitted sequence not in the batch until one
    // token of this one fits.
    bool self_preempted = false;
    while (TokensThatFit(seqs_.at(id)) < 1) {
      int64_t victim = -1;
      for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
        if (!in_batch.contains(*it)) {
          victim = *it;
          break;
        }
      }
      EXL3_CHECK(victim != -1);  // `id` itself is a candidate
      Preempt(victim, &out);
      if (victim == id) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) continue;
    const int64_t count = std::min({pending, budget, TokensThatFit(seqs_.at(id))});
    Emit(id, count, &out);
    in_batch[id] = true;
    budget -= count;
  }

  // 3. Admission, FCFS, unless this step preempted (it would thrash).
  if (out.preempted.empty()) {
    while (budget > 0 && !waiting_.empty() && num_running() < options_.max_running) {
      const int64_t id = waiting_.front();
      Sequence& seq = seqs_.at(id);
      const int64_t fit = TokensThatFit(seq);
      if (fit < 1) break;
      const int64_t count = std::min({static_cast<int64_t>(seq.tokens.size()), budget, fit});
      waiting_.pop_front();
      seq.running = true;
      seq.admitted_at = ++admissions_;
      running_.push_back(id);
      out.admit.push_back(id);
      Emit(id, count, &out);
      budget -= count;
    }
  }
  return out;
}

std::vector<int64_t> Scheduler::Reset() {
  std::vector<int64_t> ids;
  for (const auto& [id, seq] : seqs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  seqs_.clear();
  waiting_.clear();
  running_.clear();
  free_list_.clear();
  for (int64_t b = options_.num_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
  return ids;
}

std::vector<int64_t> Scheduler::RequeueAll() {
  std::vector<int64_t> requeued;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {  // newest first to the front
    Sequence& seq = seqs_.at(*it);
    if (seq.mark != Mark::kNone) continue;
    FreeBlocks(seq);
    seq.computed = 0;
    seq.running = false;
    seq.decoding = false;
    waiting_.push_front(*it);
    requeued.push_back(*it);
  }
  std::erase_if(running_, [&](int64_t id) { return !seqs_.at(id).running; });
  std::reverse(requeued.begin(), requeued.end());
  return requeued;
}

}  // namespace exl3serve::coordinator
