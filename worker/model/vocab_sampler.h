// worker/model/vocab_sampler.h — sampling where the logits are: every rank
// of a tensor-parallel group holds the logits of its own vocabulary slice
// (Transformer::ForwardVocabSlice) and this sampler turns them into the next
// token of each sequence without gathering the full logits.
//
//   VocabSampler sampler(model.vocab_slice(), model.vocab_size(), comm, timeout);
//   EXL3_RETURN_IF_ERROR(sampler.AddSequence(7, {.params = p, .prompt_len = 12}));
//   sampler.Observe(7, prompt);                 // every token fed to the model
//   EXL3_RETURN_IF_ERROR(sampler.Sample(rows, slice_logits.data(), &tokens));
//
// Semantics: those of Sampler (sampler.h, the float64 reference), computed
// in pieces: penalties and logit bias on each rank's own slice (the token
// counts of every sequence live on every rank, fed by Observe with the
// sequence's tokens exactly as the forward consumed them — so they survive
// preemption and replay: a recomputed sequence observes the same tokens
// again), then a small collective per step:
//   1. AllGather of one fixed record per sampled row and rank: the slice's
//      maximum, its lowest arg-max, Σ exp((z - max)/T) and, when logprobs
//      are asked, the raw log-sum-exp — every rank then knows the global
//      maximum, normaliser and greedy token (highest logit, lowest id).
//   2. Only when some row needs it: AllGatherV of per-rank candidates —
//      a slice's top-k / top-p prefix / min-p survivors (each a superset of
//      that slice's share of the global kept set), its top-N raw logits for
//      top_logprobs, and the chosen token's raw logit from the rank that
//      holds it. Every rank merges them identically.
// Greedy rows never sort and never exponentiate; top-k rows select k per
// slice (no sort of the slice); only top-p without top-k sorts, and only as
// deep as the nucleus reaches.
//
// The draw: u = CounterUniform(seed, position) (counter_rng.h), position =
// the index of the token being drawn (tokens observed so far). The kept
// tokens in ascending id order partition [0, mass); the token whose interval
// holds u · mass is drawn. Without any filter the ids of the whole vocabulary
// are walked in rank order (each rank's slice is contiguous and ranks are in
// id order), so no candidate leaves a rank but the chosen one. The draw of a
// seeded request depends only on (seed, position, logits): the same alone, in
// any batch, at any TP size and after a replay, as long as the logits agree
// (they differ in the last bits between batch shapes and TP sizes; a draw
// changes only when u falls within that difference of an interval's edge).
//
// Thread safety: thread-compatible; Sample is collective (every rank of the
// group calls it with the same rows in the same order).
#ifndef EXL3SERVE_WORKER_MODEL_VOCAB_SAMPLER_H_
#define EXL3SERVE_WORKER_MODEL_VOCAB_SAMPLER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/api/step_executor.h"
#include "worker/comm/communicator.h"
#include "worker/model/sampler.h"

namespace exl3serve::worker {


// One row to sample: the sequence and its logits row in the slice buffer.
struct SampleRow {
  int64_t seq_id = 0;
  int64_t logits_row = 0;
  // Structured output: a bitmask over the whole vocabulary (bit id % 32 of
  // word id / 32 set = allowed; SequenceTokens::allowed_tokens). The row's
  // masked tokens get -inf after penalties and bias, so none can be drawn
  // while one is allowed; logprobs stay those of the raw logits. Null: every
  // token.
  const uint32_t* allowed = nullptr;
};

class VocabSampler {
 public:
  // `slice` is this rank's contiguous vocabulary range [begin, end) of a
  // vocabulary of `vocab_size`; the ranks' slices tile it in rank order.
  // `comm` null (or a single rank): the slice is the whole vocabulary.
  VocabSampler(int64_t slice_begin, int64_t slice_end, int64_t vocab_size,
               comm::Communicator* comm, absl::Duration collective_timeout);

  // InvalidArgument for bad params (ValidateSamplingParams, a missing seed,
  // a logit_bias id outside the vocabulary); AlreadyExists for a known id.
  absl::Status AddSequence(int64_t seq_id, const SequenceSampling& sampling);
  // Forgets the sequence; no-op for an unknown id.
  void RemoveSequence(int64_t seq_id);
  bool HasSequence(int64_t seq_id) const { return seqs_.contains(seq_id); }
  // The sequence's SequenceSampling::prompt_len; -1 when unknown.
  int64_t PromptLen(int64_t seq_id) const {
    const auto it = seqs_.find(seq_id);
    return it == seqs_.end() ? -1 : it->second.prompt_len;
  }
  // A copy of `batch` whose entries carry their sequence's prompt length
  // (SequenceTokens::prompt_len: each row's precision by position).
  std::vector<SequenceTokens> WithPromptLengths(std::span<const SequenceTokens> batch) const;
  // Appends tokens the model consumed for the sequence (no-op when unknown).
  void Observe(int64_t seq_id, std::span<const int32_t> tokens);
  // Undoes Observe of the sequence's last tokens, which were `tokens` (the
  // caller's rollback; no-op when unknown). Requires: they were observed last.
  void Unobserve(int64_t seq_id, std::span<const int32_t> tokens);

  // Samples one token per row from `slice_logits` (row-major, rows of
  // slice_end - slice_begin floats; modified in place) and records nothing
  // (the drawn token is observed when the model consumes it). Every rank
  // gets the same `out`. Errors: NotFound for a row of an unknown sequence
  // (before any collective), the communicator's.
  absl::Status Sample(std::span<const SampleRow> rows, float* slice_logits,
                      std::vector<SampledToken>* out);

  // The position (tokens observed) of a sequence; -1 when unknown.
  int64_t position(int64_t seq_id) const;

 private:
  struct Sequence {
    SamplingParams params;
    int64_t prompt_len = 0;
    int64_t length = 0;
    absl::flat_hash_map<int32_t, int32_t> seen;    // every observed token
    absl::flat_hash_map<int32_t, int32_t> output;  // observed at >= prompt_len
  };
  struct RowWork;

  // Phase 0 for one row: penalties and the allowed-token mask in place,
  // slice statistics, candidates.
  void Prepare(const Sequence& seq, float* row, const uint32_t* allowed, RowWork& work) const;

  const int64_t begin_, end_, vocab_;
  comm::Communicator* const comm_;
  const absl::Duration timeout_;
  absl::flat_hash_map<int64_t, Sequence> seqs_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_VOCAB_SAMPLER_H_
