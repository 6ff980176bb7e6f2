// coordinator/scheduler.h — the continuous-batching schedule of the
// coordinator: which sequences run in the next forward and with which tokens,
// and the KV block allocator whose block tables the ranks' paged caches
// follow page for page (the coordinator's allocation is authoritative: a
// rank never allocates a page on its own). Pure
// logic: no threads, no model, no clock (the caller passes `now`), so every
// rule is unit-testable (tests/coordinator/scheduler_test.cc).
//
//   Scheduler scheduler(options);
//   EXL3_RETURN_IF_ERROR(scheduler.Add(seq_id, prompt, deadline));
//   ScheduleOutput step = scheduler.Schedule(absl::Now());
//   // executor: RemoveSequence(step.release...), AddSequence(step.admit...),
//   //           AssignPages(entry.seq_id, entry.new_blocks) per batch entry,
//   //           Forward(step.batch); then per entry with needs_logits:
//   scheduler.AppendToken(seq_id, sampled);   // or scheduler.Finish(seq_id)
//
// The life of a sequence:
//   waiting ──admit──> running (prefilling: tokens not yet in the cache > 1,
//   or a prompt not yet complete) ──prompt done──> running (decoding: one new
//   token per step) ──Finish / Cancel / deadline──> gone (released next step).
//   A running sequence may be preempted back to the *front* of the waiting
//   queue: its blocks are freed, its cache forgotten (the executor releases
//   it), and its tokens so far (prompt + generated) become the prompt it
//   re-prefills later (recompute preemption).
//
// One Schedule() call, in this order:
//   1. Drops finished, cancelled and expired (deadline <= now) sequences:
//      their blocks are freed, those the executor holds are listed in
//      `release`, cancelled/expired ones in `dropped` (the caller reports them).
//   2. Running sequences, decoding ones first, then prefilling ones, each in
//      admission order (oldest first), get their next tokens: decoding one
//      token, prefilling min(pending, budget left) tokens, limited by the
//      blocks they can get. When a running sequence cannot get a block for
//      even one token, the most recently admitted running sequence that is not
//      in this step's batch (possibly itself) is preempted, until it fits.
//   3. If nothing was preempted in this step: waiting sequences in queue order
//      (FCFS; the first that does not fit stops admission, none is skipped)
//      are admitted while the budget, the free blocks and max_running allow;
//      a prompt longer than what is left is prefilled in chunks over several
//      steps (chunked prefill). With the prefix cache, an admitted sequence
//      first takes the cached blocks of its longest cached prefix of full
//      blocks (at most (length - 1) / page of them: one token is always
//      computed) and starts with those positions computed
//      (cached_at_admission()).
//
// The prefix cache (SchedulerOptions::enable_prefix_caching; block_pool.h):
// at the start of every Schedule() — the previous batch has run — each
// running sequence's blocks that are now full are sealed with the hash of
// their prefix; a released sealed block stays cached (its pages on the ranks
// keep their content, since only the coordinator assigns pages) until an
// allocation evicts it, least recently released first. A sealed block may sit
// in several block tables at once, always where it is full (read-only): the
// ranks' PagedKvCache accepts a page in use only inside a sequence's cached
// prefix and refuses writes into a shared page. RequeueAll, Reset and
// ForgetCachedBlocks drop every hash (the ranks' caches are gone).
//
// The disk tier (SchedulerOptions::disk_blocks > 0; worker/model/kv_disk_tier.h
// on every rank, BlockSlotIndex here): a cached block that an allocation
// evicts is listed in `kv_saves` (page -> slot; the executor saves it before
// the forward reuses the page). When an admission finds the next blocks of a
// prompt's prefix on disk (after those in memory), it takes fresh blocks for
// them, lists `kv_loads` (slot -> page) and stops admitting for this step;
// the caller loads them before the forward and reports each outcome with
// KvLoadsDone — a verified block is sealed as if computed, a failed one is
// a miss (its positions are computed) — and the sequence is admitted at a
// later step with the loaded blocks in its cached prefix.
//
// A model with a recurrent state per sequence (SchedulerOptions::
// recurrent_state: Gated DeltaNet layers) needs more than blocks to resume
// from a prefix: the state after it, which is rewritten at every token and
// cannot be shared by reference. With the prefix cache such a sequence's
// state is snapshotted at block boundaries — after its last full block
// before the prompt's last token ((prompt - 1) / page blocks, so that a
// repeated prompt computes one block at most), and every
// state_snapshot_interval_blocks blocks (prompt or output) — into slots of
// every rank's snapshot store, keyed by the block's chained hash (a
// BlockSlotIndex, LRU over state_snapshot_slots slots). A prefill chunk is
// cut to end at such a boundary (the ranks snapshot after a forward, not
// inside one), and a chunk that ends at one takes no drafts (its state
// after the forward must be the boundary's). `state_saves` lists the
// snapshots to take after this step's forward. An admission resumes from
// the deepest block that has both its KV (in memory, or loaded from disk)
// and a snapshot (cached_state()); a snapshot whose block leaves the memory
// without a disk copy is forgotten with it.
//
// Invariants (checked by the tests after every call):
//   I1  free_blocks() + |distinct blocks held by running sequences| ==
//       num_blocks (free_blocks() counts cached unreferenced blocks: an
//       allocation may evict them); waiting sequences hold none.
//   I2  A running sequence holding `computed` cached positions holds
//       ceil(computed / page) blocks once the batch has run — plus, after a
//       drafting step, the tail blocks its rejected draft positions took
//       (at most ceil((computed + num_draft) / page) in all: never full, so
//       never sealed, and its next tokens fill them) — as a block table
//       of distinct ids in [0, num_blocks) (block_table()); a block in two
//       tables lies in each at an index < computed / page (full) and was
//       sealed; a batch entry's new_blocks are the ids appended to its table
//       in this step (for an admitted sequence: its cached blocks first). The ranks' caches (caller_assigns_pages) get
//       exactly these pages (StepExecutor::AssignPages), so with the same page
//       size and count each rank's page table of a sequence equals its block
//       table here.
//   I3  Σ tokens of a batch <= step_token_budget; running <= max_running;
//       each sequence appears at most once per batch, with >= 1 token.
//   I4  A batch entry's tokens are the sequence's tokens [computed, computed
//       + count), then for a drafting entry its num_draft draft tokens;
//       needs_logits is true iff the sequence's tokens end at its last token
//       (a prefill chunk that does not complete the prompt needs none).
//   I5  Preemption never changes a sequence's tokens; after re-admission it
//       re-prefills exactly the tokens it had.
//   I6  Liveness: a victim is always the most recently admitted sequence not
//       yet in the batch, and decoding sequences are served first, oldest
//       first, so the oldest decoding sequence always progresses; with every
//       sequence's final length <= the pool's positions (Add enforces it for
//       the prompt, the engine for prompt + max_tokens) every sequence
//       finishes (the randomized test drives workloads to completion).
//
// Speculative decoding (SchedulerOptions::draft_token_budget > 0): before a
// Schedule() the caller may ProposeDraft tokens for a sequence that awaits
// exactly one token's forward (a decode). Schedule() first serves every
// running sequence as above, then, from the budget left and within
// draft_token_budget, appends drafts to those single-token chunks in batch
// order (oldest decoders first): the chunk becomes [last token, d1..dk]
// (ScheduledChunk::num_draft = k, k maybe cut short by the budgets or the
// free blocks — drafts never preempt and never wait for a block), with
// blocks for every draft position. After the forward, AppendRun(seq_id, run)
// takes what the ranks verified — the accepted drafts and the token sampled
// after them — and advances `computed` by 1 + accepted; the rejected
// positions' KV is dropped on the ranks (their pages stay assigned, I2).
// Proposals not used by a Schedule() are discarded by it.
//
// Schedule() assumes the batch it returns will run: the sequences' cached
// positions are advanced when it returns. If the forward fails the caller
// must drop every sequence (the engine fails them all, then Reset()s).
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_SCHEDULER_H_
#define EXL3SERVE_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/block_pool.h"

namespace exl3serve::coordinator {

struct SchedulerOptions {
  // Must equal the ranks' KvCacheOptions (page_size_tokens, num_pages): the
  // allocator mirrors their page accounting.
  int64_t page_size_tokens = 16;
  int64_t num_blocks = 256;
  // Sequences in the running set at most (each is a row of every decode step).
  int64_t max_running = 64;
  // New tokens per forward at most (decode rows + prefill chunks). Bounds the
  // step's activation memory and the latency a long prompt adds to decoders.
  int64_t step_token_budget = 512;
  // Waiting sequences at most (Add fails with ResourceExhausted beyond it;
  // preempted sequences return regardless). 0 = unlimited.
  int64_t max_waiting = 0;
  // Reuse the KV blocks of prompts' cached prefixes (see the top of the
  // file). Off: every prompt is computed (the pre-cache behaviour).
  bool enable_prefix_caching = false;
  // Everything besides the tokens that changes the keys and values (model,
  // KV precision, ...): the root of every block hash.
  std::string prefix_cache_salt;
  // Slots of every rank's disk tier (0 = none); needs enable_prefix_caching.
  int64_t disk_blocks = 0;
  // Draft tokens per step at most (speculative decoding; see the top of the
  // file), taken from what step_token_budget leaves after the running
  // sequences' decodes and prefill chunks, before admissions. 0: proposals
  // are ignored.
  int64_t draft_token_budget = 0;
  // The model keeps a recurrent state per sequence (see the top of the
  // file): a prefix hit also needs a state snapshot, from
  // state_snapshot_slots slots (0: prefix caching never hits), taken at the
  // prompt's last full block and every state_snapshot_interval_blocks
  // blocks (0: only there).
  bool recurrent_state = false;
  int64_t state_snapshot_slots = 0;
  int64_t state_snapshot_interval_blocks = 0;
};

// Cumulative prefix-cache counters, in tokens (vLLM's prefix_cache_queries /
// prefix_cache_hits): every admission of a cacheable sequence queries its
// length and hits its cached_at_admission().
struct PrefixCacheStats {
  uint64_t queried_tokens = 0;
  uint64_t hit_tokens = 0;
  uint64_t evicted_blocks = 0;
  int64_t cached_blocks = 0;  // sealed blocks now (held or not)
  // The disk tier, in blocks.
  uint64_t disk_saves = 0;       // evicted blocks sent to disk
  uint64_t disk_hits = 0;        // loads every rank verified
  uint64_t disk_misses = 0;      // loads that failed (missing, dropped, corrupt)
  uint64_t disk_evictions = 0;   // disk slots reused for other blocks
  int64_t disk_used = 0;         // slots holding a block now
  // Recurrent-state snapshots (a model with state), in snapshots.
  uint64_t state_snapshot_saves = 0;      // listed in state_saves
  uint64_t state_snapshot_hits = 0;       // admissions that resumed from one
  uint64_t state_snapshot_evictions = 0;  // slots reused for other blocks
  int64_t state_snapshots = 0;            // slots holding one now
};

// A recurrent-state snapshot to take after the forward (StepExecutor::
// SaveStateSnapshots), or the one an admission resumes from.
struct StateSnapshot {
  int64_t seq_id = 0;
  int64_t slot = -1;
  BlockHash hash;  // of the block the snapshot ends
};

// A block moved between a page and a disk slot (StepExecutor's KvBlockTransfer).
struct BlockTransfer {
  int32_t block = 0;
  int64_t slot = 0;
  BlockHash hash;
};

enum class DropReason {
  kCancelled,  // Cancel(): abort, client gone, shutdown
  kDeadline,   // the deadline passed
};

struct ScheduledChunk {
  int64_t seq_id = 0;
  // The sequence's tokens [start, start + tokens.size()); `tokens` points into
  // the scheduler and is valid until the next non-const call.
  int64_t start = 0;
  std::span<const int32_t> tokens;
  // The chunk ends at the sequence's last token: its logits give the next one.
  bool needs_logits = false;
  // Speculative decoding: the last num_draft of `tokens` are draft tokens
  // (a decode chunk of 1 + num_draft tokens; needs_logits is true); the
  // sequence's tokens end before them.
  int64_t num_draft = 0;
  // Block ids appended to the sequence's block table for this chunk (possibly
  // none), in table order: the executor's AssignPages before the forward.
  std::vector<int32_t> new_blocks;
};

struct DroppedSequence {
  int64_t seq_id = 0;
  DropReason reason = DropReason::kCancelled;
};

struct ScheduleOutput {
  // Sequences the executor must forget (RemoveSequence), before `admit`:
  // finished, cancelled, expired and preempted ones that were admitted.
  std::vector<int64_t> release;
  // Sequences the executor must start (AddSequence), before the forward.
  std::vector<int64_t> admit;
  // The forward: each running sequence at most once.
  std::vector<ScheduledChunk> batch;
  // Sequences preempted in this step (also in `release`; back in the queue).
  std::vector<int64_t> preempted;
  // Cancelled or expired sequences removed in this step (for their responses).
  std::vector<DroppedSequence> dropped;
  // Sequences removed by Finish() in this step.
  std::vector<int64_t> finished;
  // The disk tier: save these pages before anything else touches them, then
  // load these slots (and call KvLoadsDone with one flag per load).
  std::vector<BlockTransfer> kv_saves;
  std::vector<BlockTransfer> kv_loads;
  // Recurrent-state snapshots to take after the forward (each entry's
  // sequence then ends at a block boundary).
  std::vector<StateSnapshot> state_saves;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& options);

  // Queues a new sequence at the back of the waiting queue.
  // Errors: InvalidArgument for an empty prompt, a seq_id in use, or a prompt
  // longer than the pool's positions (it could never run); ResourceExhausted
  // naming the limit when max_waiting sequences already wait.
  // `use_prefix_cache` false: the sequence neither reads nor adds cached
  // blocks (a request's opt-out).
  absl::Status Add(int64_t seq_id, std::vector<int32_t> prompt,
                   absl::Time deadline = absl::InfiniteFuture(), bool use_prefix_cache = true);

  // Appends the token sampled from the logits of `seq_id`'s last batch entry
  // (needs_logits). Requires: the sequence is running and all its tokens
  // were scheduled (CHECKed). After a drafting entry: every draft was
  // rejected (AppendRun of one token).
  void AppendToken(int64_t seq_id, int32_t token);
  // Speculative decoding: draft tokens for the sequence's next step (see the
  // top of the file); replaces an earlier proposal. Ignored unless the
  // sequence then awaits a single-token forward and draft_token_budget > 0.
  // Requires: Contains(seq_id) (CHECKed).
  void ProposeDraft(int64_t seq_id, std::vector<int32_t> draft);
  // What the forward of `seq_id`'s drafting entry verified: its first
  // run.size() - 1 draft tokens were accepted, run.back() was sampled after
  // them. Appends the run, advances computed by run.size(). Requires: as
  // AppendToken, and 1 <= run.size() <= num_draft + 1 with run's first
  // tokens equal to the drafts (CHECKed: the caller validates what the ranks
  // return).
  void AppendRun(int64_t seq_id, std::span<const int32_t> run);
  // The sequence is done; it is removed (blocks freed, listed in `release`
  // and `finished`) by the next Schedule(). False for an unknown id.
  bool Finish(int64_t seq_id);
  // Cancels the sequence; it is removed by the next Schedule() (listed in
  // `dropped` with kCancelled). False for an unknown or finishing id.
  bool Cancel(int64_t seq_id);

  // Runs the steps described at the top of the file.
  ScheduleOutput Schedule(absl::Time now);

  // Forgets every sequence and frees every block (after a failed forward).
  // Returns the ids it held.
  std::vector<int64_t> Reset();

  // Replay after the rank group was re-formed (every cache is gone): every
  // running sequence not marked finished/cancelled goes back to the front of
  // the queue in admission order (oldest first), its blocks freed and its
  // tokens (prompt + generated) kept, to be prefilled again (I5). Marked
  // sequences are removed by the next Schedule() as usual. Returns the ids
  // requeued.
  std::vector<int64_t> RequeueAll();
  // Drops every cached block's hash (the ranks' caches were lost while no
  // sequence ran: an idle re-formation). Held blocks stay held.
  void ForgetCachedBlocks();
  // The outcome of this step's kv_loads, one flag each (1 = verified on every
  // rank), in order. Must be called before the next Schedule when kv_loads
  // was non-empty; an empty span = every load failed.
  void KvLoadsDone(std::span<const uint8_t> loaded);
  // Blocks held for loads (in flight, or loaded and awaiting their
  // sequence's admission); the ranks' pages of these are free.
  std::vector<int32_t> blocks_held_for_loads() const;

  bool Contains(int64_t seq_id) const { return seqs_.contains(seq_id); }
  // The sequence's tokens (prompt + generated). Requires: Contains(seq_id).
  std::span<const int32_t> tokens(int64_t seq_id) const;
  // Tokens in the cache (0 while waiting). Requires: Contains(seq_id).
  int64_t computed(int64_t seq_id) const;
  // Blocks the sequence holds. Requires: Contains(seq_id).
  int64_t blocks_held(int64_t seq_id) const;
  // The sequence's block table (ids in position order; empty while
  // waiting). Valid until the next non-const call. Requires: Contains(seq_id).
  std::span<const int32_t> block_table(int64_t seq_id) const;
  bool is_running(int64_t seq_id) const;
  // Positions that came from the prefix cache at the sequence's latest
  // admission (0 without a hit, or while waiting before its first).
  // Requires: Contains(seq_id).
  int64_t cached_at_admission(int64_t seq_id) const;
  // The state snapshot the sequence's latest admission resumes from (slot -1:
  // none). Requires: Contains(seq_id).
  StateSnapshot cached_state(int64_t seq_id) const;
  // ... at its first admission (what a response reports as cached_tokens).
  int64_t cached_at_first_admission(int64_t seq_id) const;
  PrefixCacheStats prefix_cache_stats() const;
  const BlockPool& block_pool() const { return pool_; }

  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_blocks() const { return options_.num_blocks; }
  // Blocks an allocation can take: free ones and cached unreferenced ones.
  int64_t free_blocks() const { return pool_.available(); }
  uint64_t num_preemptions() const { return num_preemptions_; }
  bool empty() const { return seqs_.empty(); }
  const SchedulerOptions& options() const { return options_; }

 private:
  enum class Mark { kNone, kFinished, kCancelled };
  struct Sequence {
    std::vector<int32_t> tokens;
    int64_t computed = 0;        // positions in the cache
    std::vector<int32_t> blocks;  // block table: ids held, in position order
    bool running = false;
    bool decoding = false;       // the prompt was prefilled once since admission
    uint64_t admitted_at = 0;    // admission counter (larger = more recent)
    absl::Time deadline = absl::InfiniteFuture();
    Mark mark = Mark::kNone;
    bool cacheable = true;        // may read and add cached blocks
    int64_t prompt_len = 0;       // tokens at Add (state snapshots)
    StateSnapshot cached_state;   // recurrent state: what the admission resumes from
    bool snapshot_pending = false;  // this step's chunk ends at a snapshot
    std::vector<BlockHash> hashes;  // of its full blocks, in order (lazily)
    int64_t sealed = 0;           // table blocks sealed so far
    int64_t cached_at_admission = 0;
    std::optional<int64_t> cached_at_first_admission;
    // Cached blocks taken at admission, not yet in a chunk's new_blocks.
    std::vector<int32_t> unsent_cached;
    // The disk tier: blocks loaded for this waiting sequence, held until it
    // is admitted; whether this admission looked on disk already.
    std::vector<int32_t> preloaded;
    bool disk_tried = false;
    // Speculative decoding: the caller's proposal for the next step; the
    // scheduled chunk [last token, drafts...] (ScheduledChunk::tokens points
    // here) and its draft count, until AppendRun.
    std::vector<int32_t> proposed_draft;
    std::vector<int32_t> verify_tokens;
    int64_t drafted = 0;
  };

  int64_t BlocksFor(int64_t positions) const {
    return (positions + options_.page_size_tokens - 1) / options_.page_size_tokens;
  }
  // Tokens of `seq` that fit in its blocks plus the free ones, beyond computed.
  int64_t TokensThatFit(const Sequence& seq) const;
  // Drops the sequence's references on its blocks (sealed ones stay cached).
  void FreeBlocks(Sequence& seq);
  bool Caches(const Sequence& seq) const {
    return options_.enable_prefix_caching && seq.cacheable;
  }
  // Extends seq.hashes to its first `blocks` full blocks.
  void HashBlocks(Sequence& seq, int64_t blocks);
  // Seals the sequence's blocks whose positions are all computed.
  void SealComputedBlocks(Sequence& seq);
  // Takes the cached blocks of the longest cached prefix of a sequence about
  // to be admitted; returns the positions they cover.
  int64_t TakeCachedPrefix(Sequence& seq);
  // The disk tier: starts loads of the blocks after `seq`'s cached prefix
  // that are on disk; true when it did (the sequence waits for them).
  bool StartDiskLoads(int64_t seq_id, Sequence& seq, ScheduleOutput* out);
  // Lists the blocks the pool evicted as saves (and forgets the state
  // snapshots of those that leave without a disk copy).
  void SaveEvicted(ScheduleOutput* out);
  // Recurrent state: keeps only the sequence's cached blocks up to the
  // deepest one with a state snapshot and records that snapshot; returns the
  // positions kept. Blocks index (0: none) of the deepest snapshot among the
  // first `limit` blocks of `seq`.
  int64_t TrimToStateSnapshot(Sequence& seq);
  int64_t DeepestSnapshot(Sequence& seq, int64_t limit);
  // Recurrent state: whether a snapshot is due after the first `position`
  // tokens of `seq` (a block boundary the rules pick, without a snapshot
  // yet); `count` cut so that a chunk from seq.computed ends at the first one.
  bool WantsSnapshot(Sequence& seq, int64_t position);
  int64_t ClipToSnapshot(Sequence& seq, int64_t count);
  void ReleasePreloaded(Sequence& seq);
  // Drops loads in flight (as failed) and every disk index entry.
  void AbandonDiskState();
  // Moves a running sequence to the front of the queue, freeing its blocks.
  void Preempt(int64_t seq_id, ScheduleOutput* out);
  // Removes a sequence entirely, freeing its blocks.
  void Erase(int64_t seq_id);
  // Schedules `count` tokens of running sequence `seq_id` (allocating blocks).
  void Emit(int64_t seq_id, int64_t count, ScheduleOutput* out);
  // Appends proposed drafts to this step's single-token chunks, within
  // `*budget` and draft_token_budget; discards every proposal.
  void EmitDrafts(int64_t* budget, ScheduleOutput* out);

  SchedulerOptions options_;
  absl::flat_hash_map<int64_t, Sequence> seqs_;
  std::deque<int64_t> waiting_;   // queue order
  std::vector<int64_t> running_;  // admission order
  BlockPool pool_;
  BlockHash root_hash_;
  uint64_t prefix_queried_tokens_ = 0;
  uint64_t prefix_hit_tokens_ = 0;
  uint64_t evictions_before_reset_ = 0;
  BlockSlotIndex disk_;
  struct InFlightLoad {
    int64_t seq_id = 0;
    BlockTransfer transfer;
  };
  std::vector<InFlightLoad> loads_in_flight_;
  uint64_t disk_saves_ = 0, disk_hits_ = 0, disk_misses_ = 0;
  BlockSlotIndex snapshots_;
  // Slots placed for this step's state_saves: pinned, and no admission
  // resumes from them before the ranks took them (the next Schedule).
  std::vector<int64_t> pending_snapshots_;
  uint64_t snapshot_saves_ = 0, snapshot_hits_ = 0;
  uint64_t admissions_ = 0;
  uint64_t num_preemptions_ = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_SCHEDULER_H_
