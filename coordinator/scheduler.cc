#include "coordinator/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "worker/api/sampling.h"

namespace exl3serve::coordinator {

Scheduler::Scheduler(const SchedulerOptions& options)
    : options_(options),
      pool_((EXL3_CHECK(options.num_blocks > 0 && options.num_blocks <= INT32_MAX),
             options.num_blocks)),  // block ids travel as int32
      root_hash_(RootBlockHash(options.prefix_cache_salt)),
      disk_(options.enable_prefix_caching ? options.disk_blocks : 0),
      snapshots_(options.enable_prefix_caching && options.recurrent_state
                     ? options.state_snapshot_slots
                     : 0) {
  EXL3_CHECK(options_.page_size_tokens > 0);
  EXL3_CHECK(options_.max_running > 0);
  EXL3_CHECK(options_.step_token_budget > 0);
}

void Scheduler::FreeBlocks(Sequence& seq) {
  // Reverse order: a sequence re-admitted at once gets the same ids back,
  // and of a cached prefix its last blocks are evicted first.
  for (auto it = seq.blocks.rbegin(); it != seq.blocks.rend(); ++it) pool_.Release(*it);
  seq.blocks.clear();
  seq.unsent_cached.clear();
  seq.sealed = 0;
}

void Scheduler::HashBlocks(Sequence& seq, int64_t blocks) {
  const int64_t page = options_.page_size_tokens;
  EXL3_CHECK(blocks * page <= static_cast<int64_t>(seq.tokens.size()));
  // A block holding a row the ranks compute at the decode precision (by
  // position: worker/api/sampling.h PrefillKindEnd) chains from a salted
  // parent, so that no prompt — whose rows there would be prefill-kind —
  // ever matches it: a follow-up turn reuses the earlier prompt's blocks,
  // not those of its decoded output, and cache on == off stays exact. The
  // sequence itself (re-admitted after preemption or a replay) hashes the
  // same way and finds its own blocks. Salt: a one-token block of -1,
  // which no real block is.
  const int64_t prefill_end = worker::PrefillKindEnd(seq.prompt_len);
  static constexpr int32_t kDecodedSalt[] = {-1};
  while (static_cast<int64_t>(seq.hashes.size()) < blocks) {
    const int64_t k = static_cast<int64_t>(seq.hashes.size());
    BlockHash parent = k == 0 ? root_hash_ : seq.hashes.back();
    if ((k + 1) * page > prefill_end) parent = ChainBlockHash(parent, kDecodedSalt);
    seq.hashes.push_back(
        ChainBlockHash(parent, std::span<const int32_t>(seq.tokens).subspan(k * page, page)));
  }
}

void Scheduler::SealComputedBlocks(Sequence& seq) {
  if (!Caches(seq)) return;
  const int64_t full = std::min<int64_t>(seq.computed / options_.page_size_tokens,
                                         static_cast<int64_t>(seq.blocks.size()));
  if (seq.sealed >= full) return;
  HashBlocks(seq, full);
  for (int64_t k = seq.sealed; k < full; ++k) pool_.Seal(seq.blocks[k], seq.hashes[k]);
  seq.sealed = full;
}

int64_t Scheduler::TakeCachedPrefix(Sequence& seq) {
  seq.cached_at_admission = 0;
  if (!Caches(seq)) return 0;
  const int64_t page = options_.page_size_tokens;
  // At least one token is computed: its logits give the next token.
  const int64_t limit = (static_cast<int64_t>(seq.tokens.size()) - 1) / page;
  if (limit <= 0) return 0;
  HashBlocks(seq, limit);
  const std::vector<int32_t> hit =
      pool_.Match(std::span<const BlockHash>(seq.hashes).subspan(0, limit));
  for (int32_t b : hit) {
    pool_.Acquire(b);
    seq.blocks.push_back(b);
  }
  seq.unsent_cached = hit;
  seq.sealed = static_cast<int64_t>(hit.size());
  seq.computed = static_cast<int64_t>(hit.size()) * page;
  seq.cached_at_admission = seq.computed;
  // Blocks loaded from disk for it are in `hit` now (or, if the chain broke
  // before them, cached like any released block).
  ReleasePreloaded(seq);
  return seq.computed;
}

int64_t Scheduler::DeepestSnapshot(Sequence& seq, int64_t limit) {
  if (!snapshots_.enabled()) return 0;
  HashBlocks(seq, limit);
  int64_t k = limit;
  for (; k > 0; --k) {
    const int64_t slot = snapshots_.Find(seq.hashes[k - 1]);
    if (slot >= 0 && std::find(pending_snapshots_.begin(), pending_snapshots_.end(), slot) ==
                         pending_snapshots_.end()) {
      break;
    }
  }
  return k;
}

int64_t Scheduler::TrimToStateSnapshot(Sequence& seq) {
  seq.cached_state = {};
  if (!options_.recurrent_state) return seq.computed;
  const int64_t page = options_.page_size_tokens;
  const int64_t keep = DeepestSnapshot(seq, static_cast<int64_t>(seq.blocks.size()));
  // Blocks past the snapshot go back (newest first, as FreeBlocks does).
  while (static_cast<int64_t>(seq.blocks.size()) > keep) {
    pool_.Release(seq.blocks.back());
    seq.blocks.pop_back();
  }
  seq.unsent_cached.resize(static_cast<size_t>(keep));
  seq.sealed = keep;
  seq.computed = keep * page;
  seq.cached_at_admission = seq.computed;
  if (keep > 0) {
    const BlockHash& hash = seq.hashes[keep - 1];
    seq.cached_state.slot = snapshots_.Find(hash);
    seq.cached_state.hash = hash;
    snapshots_.Touch(seq.cached_state.slot);
  }
  return seq.computed;
}

bool Scheduler::WantsSnapshot(Sequence& seq, int64_t position) {
  if (!snapshots_.enabled() || !Caches(seq)) return false;
  const int64_t page = options_.page_size_tokens;
  if (position <= 0 || position % page != 0) return false;
  const int64_t k = position / page;
  const int64_t interval = options_.state_snapshot_interval_blocks;
  const bool due = k == (seq.prompt_len - 1) / page || (interval > 0 && k % interval == 0);
  if (!due) return false;
  HashBlocks(seq, k);
  return snapshots_.Find(seq.hashes[k - 1]) < 0;
}

int64_t Scheduler::ClipToSnapshot(Sequence& seq, int64_t count) {
  if (!snapshots_.enabled() || !Caches(seq)) return count;
  const int64_t page = options_.page_size_tokens;
  for (int64_t k = seq.computed / page + 1; k * page < seq.computed + count; ++k) {
    if (WantsSnapshot(seq, k * page)) return k * page - seq.computed;
  }
  return count;
}

void Scheduler::ReleasePreloaded(Sequence& seq) {
  for (int32_t b : seq.preloaded) pool_.Release(b);
  seq.preloaded.clear();
}

bool Scheduler::StartDiskLoads(int64_t seq_id, Sequence& seq, ScheduleOutput* out) {
  if (!disk_.enabled() || !Caches(seq) || seq.disk_tried) return false;
  seq.disk_tried = true;
  const int64_t page = options_.page_size_tokens;
  int64_t limit = (static_cast<int64_t>(seq.tokens.size()) - 1) / page;
  // A recurrent state resumes only where a snapshot is: no block past the
  // deepest one is worth loading.
  if (options_.recurrent_state) limit = DeepestSnapshot(seq, limit);
  std::vector<std::pair<int64_t, int64_t>> found;  // (block index, slot)
  for (int64_t k = static_cast<int64_t>(seq.blocks.size()); k < limit; ++k) {
    const int64_t slot = disk_.Find(seq.hashes[k]);
    if (slot < 0) break;
    found.emplace_back(k, slot);
  }
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(found.size()), pool_.available());
  if (n == 0) return false;
  for (int64_t i = 0; i < n; ++i) disk_.Pin(found[i].second);  // before any eviction
  for (int64_t i = 0; i < n; ++i) {
    const auto [k, slot] = found[i];
    const BlockTransfer t{.block = pool_.Allocate(), .slot = slot, .hash = seq.hashes[k]};
    disk_.Touch(slot);
    loads_in_flight_.push_back({seq_id, t});
    out->kv_loads.push_back(t);
  }
  return true;
}

void Scheduler::KvLoadsDone(std::span<const uint8_t> loaded) {
  for (size_t i = 0; i < loads_in_flight_.size(); ++i) {
    const InFlightLoad& load = loads_in_flight_[i];
    const bool ok = i < loaded.size() && loaded[i] != 0;
    disk_.Unpin(load.transfer.slot);
    if (!ok) {
      disk_.Forget(load.transfer.hash);
      ++disk_misses_;
    } else {
      ++disk_hits_;
    }
    auto it = seqs_.find(load.seq_id);
    if (ok && it != seqs_.end() && it->second.mark == Mark::kNone && !it->second.running) {
      pool_.Seal(load.transfer.block, load.transfer.hash);
      it->second.preloaded.push_back(load.transfer.block);
    } else {
      pool_.Release(load.transfer.block);
    }
  }
  loads_in_flight_.clear();
}

std::vector<int32_t> Scheduler::blocks_held_for_loads() const {
  std::vector<int32_t> out;
  for (const InFlightLoad& load : loads_in_flight_) out.push_back(load.transfer.block);
  for (const auto& [id, seq] : seqs_) out.insert(out.end(), seq.preloaded.begin(), seq.preloaded.end());
  return out;
}

void Scheduler::SaveEvicted(ScheduleOutput* out) {
  for (const auto& [block, hash] : pool_.TakeEvicted()) {
    int64_t slot = disk_.enabled() ? disk_.Find(hash) : -1;
    if (disk_.enabled() && slot < 0) {
      slot = disk_.Place(hash);  // -1: every slot is being loaded from
      if (slot >= 0) {
        out->kv_saves.push_back({.block = block, .slot = slot, .hash = hash});
        ++disk_saves_;
      }
    }
    // A snapshot is worth keeping while its block can come back.
    if (slot < 0) snapshots_.Forget(hash);
  }
}

void Scheduler::AbandonDiskState() {
  if (!loads_in_flight_.empty()) KvLoadsDone({});
  for (auto& [id, seq] : seqs_) {
    ReleasePreloaded(seq);
    seq.disk_tried = false;
  }
  disk_.Clear();
}

void Scheduler::ForgetCachedBlocks() {
  snapshots_.Clear();
  AbandonDiskState();
  pool_.ForgetCached();
}

absl::Status Scheduler::Add(int64_t seq_id, std::vector<int32_t> prompt, absl::Time deadline,
                            bool use_prefix_cache) {
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
  seq.prompt_len = static_cast<int64_t>(prompt.size());
  seq.tokens = std::move(prompt);
  seq.deadline = deadline;
  seq.cacheable = use_prefix_cache;
  seqs_.emplace(seq_id, std::move(seq));
  waiting_.push_back(seq_id);
  return absl::OkStatus();
}

void Scheduler::AppendToken(int64_t seq_id, int32_t token) {
  AppendRun(seq_id, std::span<const int32_t>(&token, 1));
}

void Scheduler::ProposeDraft(int64_t seq_id, std::vector<int32_t> draft) {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  it->second.proposed_draft = std::move(draft);
}

void Scheduler::AppendRun(int64_t seq_id, std::span<const int32_t> run) {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  Sequence& seq = it->second;
  EXL3_CHECK(seq.running && seq.computed == static_cast<int64_t>(seq.tokens.size()));
  const int64_t accepted = static_cast<int64_t>(run.size()) - 1;
  EXL3_CHECK(accepted >= 0 && accepted <= seq.drafted);
  // The accepted drafts are in the ranks' caches (verify_tokens[1..]).
  EXL3_CHECK(std::equal(run.begin(), run.begin() + accepted, seq.verify_tokens.begin() + 1));
  seq.tokens.insert(seq.tokens.end(), run.begin(), run.end());
  seq.computed += accepted;
  seq.drafted = 0;
  seq.verify_tokens.clear();
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

int64_t Scheduler::cached_at_admission(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return it->second.cached_at_admission;
}

StateSnapshot Scheduler::cached_state(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  StateSnapshot s = it->second.cached_state;
  s.seq_id = seq_id;
  return s;
}

int64_t Scheduler::cached_at_first_admission(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  EXL3_CHECK(it != seqs_.end());
  return it->second.cached_at_first_admission.value_or(0);
}

PrefixCacheStats Scheduler::prefix_cache_stats() const {
  return {.queried_tokens = prefix_queried_tokens_,
          .hit_tokens = prefix_hit_tokens_,
          .evicted_blocks = evictions_before_reset_ + pool_.evictions(),
          .cached_blocks = pool_.sealed(),
          .disk_saves = disk_saves_,
          .disk_hits = disk_hits_,
          .disk_misses = disk_misses_,
          .disk_evictions = disk_.evictions(),
          .disk_used = disk_.used(),
          .state_snapshot_saves = snapshot_saves_,
          .state_snapshot_hits = snapshot_hits_,
          .state_snapshot_evictions = snapshots_.evictions(),
          .state_snapshots = snapshots_.used()};
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
  ReleasePreloaded(it->second);
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
  SealComputedBlocks(seq);  // what it computed stays cached for its return
  seq.disk_tried = false;
  FreeBlocks(seq);
  seq.computed = 0;
  seq.running = false;
  seq.decoding = false;
  seq.drafted = 0;
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
  // The first chunk after an admission with a cache hit: the cached blocks
  // reach the ranks' page tables first, then the new ones.
  chunk.new_blocks = std::move(seq.unsent_cached);
  seq.unsent_cached.clear();
  for (int64_t i = 0; i < needed; ++i) {
    const int32_t b = pool_.Allocate();
    seq.blocks.push_back(b);
    chunk.new_blocks.push_back(b);
  }
  chunk.seq_id = seq_id;
  chunk.start = seq.computed;
  chunk.tokens = std::span<const int32_t>(seq.tokens).subspan(seq.computed, count);
  seq.computed += count;
  chunk.needs_logits = seq.computed == static_cast<int64_t>(seq.tokens.size());
  out->batch.push_back(chunk);
  seq.snapshot_pending = false;
  if (WantsSnapshot(seq, seq.computed)) {
    const BlockHash& hash = seq.hashes[seq.computed / options_.page_size_tokens - 1];
    const int64_t slot = snapshots_.Place(hash);  // -1: every slot is pending
    if (slot >= 0) {
      snapshots_.Pin(slot);
      pending_snapshots_.push_back(slot);
      out->state_saves.push_back({.seq_id = seq_id, .slot = slot, .hash = hash});
      seq.snapshot_pending = true;
      ++snapshot_saves_;
    }
  }
}

void Scheduler::EmitDrafts(int64_t* budget, ScheduleOutput* out) {
  int64_t left = std::min(*budget, options_.draft_token_budget);
  for (ScheduledChunk& chunk : out->batch) {
    if (left <= 0) break;
    Sequence& seq = seqs_.at(chunk.seq_id);
    // A chunk ending at a snapshot keeps its state there: no drafts.
    if (seq.proposed_draft.empty() || chunk.tokens.size() != 1 || !chunk.needs_logits ||
        seq.snapshot_pending) {
      continue;
    }
    // Drafts take free blocks only: they never preempt.
    const int64_t k = std::min({static_cast<int64_t>(seq.proposed_draft.size()), left,
                                TokensThatFit(seq)});
    if (k <= 0) continue;
    const int64_t needed =
        BlocksFor(seq.computed + k) - static_cast<int64_t>(seq.blocks.size());
    for (int64_t i = 0; i < needed; ++i) {
      const int32_t b = pool_.Allocate();
      seq.blocks.push_back(b);
      chunk.new_blocks.push_back(b);
    }
    seq.verify_tokens.assign(1, chunk.tokens[0]);
    seq.verify_tokens.insert(seq.verify_tokens.end(), seq.proposed_draft.begin(),
                             seq.proposed_draft.begin() + k);
    seq.drafted = k;
    chunk.tokens = seq.verify_tokens;
    chunk.num_draft = k;
    left -= k;
    *budget -= k;
  }
  for (auto& [id, seq] : seqs_) seq.proposed_draft.clear();
}

ScheduleOutput Scheduler::Schedule(absl::Time now) {
  ScheduleOutput out;

  // A caller that did not report its loads: they failed.
  if (!loads_in_flight_.empty()) KvLoadsDone({});
  // The previous step's snapshots were taken after its forward.
  for (int64_t slot : pending_snapshots_) snapshots_.Unpin(slot);
  pending_snapshots_.clear();
  // 0. The previous batch ran: its full blocks hold known prefixes now.
  for (int64_t id : running_) SealComputedBlocks(seqs_.at(id));

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
    const int64_t count =
        ClipToSnapshot(seqs_.at(id), std::min({pending, budget, TokensThatFit(seqs_.at(id))}));
    Emit(id, count, &out);
    in_batch[id] = true;
    budget -= count;
  }
  // 2b. Drafts, from what the running sequences left.
  EmitDrafts(&budget, &out);

  // 3. Admission, FCFS, unless this step preempted (it would thrash).
  if (out.preempted.empty()) {
    while (budget > 0 && !waiting_.empty() && num_running() < options_.max_running) {
      const int64_t id = waiting_.front();
      Sequence& seq = seqs_.at(id);
      TakeCachedPrefix(seq);
      if (StartDiskLoads(id, seq, &out)) {
        // Admitted at a later step, once its blocks are loaded (KvLoadsDone).
        FreeBlocks(seq);
        seq.computed = 0;
        seq.cached_at_admission = 0;
        break;
      }
      const int64_t cached = TrimToStateSnapshot(seq);
      const int64_t fit = TokensThatFit(seq);
      if (fit < 1) {
        FreeBlocks(seq);  // the cached blocks go back to the LRU
        seq.computed = 0;
        seq.cached_at_admission = 0;
        break;
      }
      const int64_t count = ClipToSnapshot(
          seq, std::min({static_cast<int64_t>(seq.tokens.size()) - cached, budget, fit}));
      if (Caches(seq)) {
        prefix_queried_tokens_ += seq.tokens.size();
        prefix_hit_tokens_ += cached;
      }
      if (seq.cached_state.slot >= 0) ++snapshot_hits_;
      if (!seq.cached_at_first_admission) seq.cached_at_first_admission = cached;
      seq.disk_tried = false;
      waiting_.pop_front();
      seq.running = true;
      seq.admitted_at = ++admissions_;
      running_.push_back(id);
      out.admit.push_back(id);
      Emit(id, count, &out);
      budget -= count;
    }
  }
  SaveEvicted(&out);
  return out;
}

std::vector<int64_t> Scheduler::Reset() {
  std::vector<int64_t> ids;
  for (const auto& [id, seq] : seqs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  seqs_.clear();
  waiting_.clear();
  running_.clear();
  evictions_before_reset_ += pool_.evictions();
  for (const InFlightLoad& load : loads_in_flight_) disk_.Unpin(load.transfer.slot);
  loads_in_flight_.clear();
  disk_.Clear();
  snapshots_.Clear();
  pool_ = BlockPool(options_.num_blocks);
  return ids;
}

std::vector<int64_t> Scheduler::RequeueAll() {
  std::vector<int64_t> requeued;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {  // newest first to the front
    Sequence& seq = seqs_.at(*it);
    if (seq.mark != Mark::kNone) {
      seq.cacheable = false;  // its blocks' content went with the old group
      continue;
    }
    FreeBlocks(seq);
    seq.computed = 0;
    seq.running = false;
    seq.decoding = false;
    seq.drafted = 0;
    waiting_.push_front(*it);
    requeued.push_back(*it);
  }
  std::erase_if(running_, [&](int64_t id) { return !seqs_.at(id).running; });
  std::reverse(requeued.begin(), requeued.end());
  ForgetCachedBlocks();  // the re-formed group's caches are empty
  return requeued;
}

}  // namespace exl3serve::coordinator
