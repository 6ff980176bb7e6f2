// worker/model/modules/module.h — the two kinds of module a decoder layer is
// made of, and what they share while a step runs.
//
// A layer is a token mixer (attention of some kind, later linear attention)
// followed by a feed-forward (a dense MLP or a mixture of experts); the
// Transformer (transformer.h) owns the residual stream, the norms around the
// modules, the all-reduces and the head, and calls the modules of each layer
// in turn:
//
//   a = RMSNorm(h);  mixer->Forward(step, a, cache, delta);   all-reduce delta;  h += delta
//   a = RMSNorm(h);  ffn->Forward(step, a, delta);            all-reduce delta;  h += delta
//
// A module owns its weights (this rank's part of them: it applies its own
// tensor-parallel split when loaded, sharding/shard_plan.h says which part),
// its per-sequence state (a mixer's KV lives in its layer of the PagedKvCache)
// and the CPU kernels it runs. A module's Forward writes this rank's partial
// sum of its output projection; the caller reduces over the ranks, so a
// module never talks to the communicator. No module knows which
// architecture it belongs to: what differs between architectures is a
// module option read from the config (model_config.h), or another module.
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_MODULE_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_MODULE_H_

#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/api/step_executor.h"
#include "worker/model/kv_cache.h"
#include "worker/model/linear.h"

namespace exl3serve::worker {

// Reusable float buffers of one Forward call, by slot: a module takes the
// slots it needs (each module's own constants below) instead of allocating
// per layer. Not thread-safe; one per Forward call.
class StepScratch {
 public:
  // Slot `slot` with at least `size` floats (contents unspecified).
  float* Get(int slot, size_t size) {
    if (slot >= static_cast<int>(buffers_.size())) buffers_.resize(slot + 1);
    std::vector<float>& b = buffers_[slot];
    if (b.size() < size) b.resize(size);
    return b.data();
  }

 private:
  std::vector<std::vector<float>> buffers_;
};

// Scratch slots (distinct per module kind only where modules of one layer
// are alive at once; a slot's contents do not survive the module call).
enum ScratchSlot : int { kScratchQ = 0, kScratchK, kScratchV, kScratchAttn, kScratchMix0, kScratchMix1 };

// One step of the batch as the modules see it. Entries' rows are
// consecutive in batch order: entry b has batch[b].tokens.size() rows from
// row Σ_{i<b} of them; its first new token is at position starts[b].
struct StepBatch {
  std::span<const SequenceTokens> batch;
  std::span<const int64_t> starts;
  int64_t total = 0;            // rows (new tokens) in all
  std::span<const RowRun> plan;  // each entry's rows at its kind (linear.h)
  // Per entry, how many of its leading rows are prefill-kind
  // (linear.h PrefillRowsOfEntry; the rest are decode-kind): what `plan`
  // is made of, for modules whose arithmetic beyond the linears follows the
  // kind (MLA's expanded or absorbed attention).
  std::span<const int64_t> prefill_rows;
  StepScratch* scratch = nullptr;
};

// The per-position KV one mixer layer keeps (kv_cache.h KvCacheShape without
// the layer count); head_dim 0: the mixer keeps no KV.
struct KvLayout {
  int num_kv_heads = 0;
  int head_dim = 0;
  int value_dim = 0;  // 0 = head_dim
  bool has_kv() const { return head_dim > 0; }
  bool operator==(const KvLayout&) const = default;
};

// Mixes information across positions: reads its own earlier state (its
// layer of the cache's KV pages and/or its slot of the cache's per-sequence
// state, kv_cache.h), appends the new tokens' state.
class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  // Fixed-size per-sequence state this rank keeps for the layer, in floats
  // (a recurrent state, a conv window); 0 = none (KV only).
  virtual int64_t state_floats() const { return 0; }
  // Where the layer's storage lives in the cache: its KV layer (when
  // kv_layout().has_kv()) and its state slot (when state_floats() > 0).
  // Set once by the Transformer after loading every layer.
  void set_cache_slots(int kv_layer, int state_slot) {
    kv_layer_ = kv_layer;
    state_slot_ = state_slot;
  }
  // a: the normed input [step.total][hidden]. Writes this rank's partial
  // output [step.total][hidden] (zeros when the rank holds none of the
  // layer's heads) and appends the new positions to `cache` (committed by
  // the caller). Errors: those of the kernels.
  virtual absl::Status Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                               float* out) const = 0;
  // What this layer stores per position on this rank.
  virtual KvLayout kv_layout() const = 0;
  // Every linear the module holds (calibration observers).
  virtual void ForEachLinear(const std::function<void(Linear&)>& fn) = 0;

 protected:
  int kv_layer_ = -1;
  int state_slot_ = -1;
};

// Transforms each position on its own.
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // a: the normed input [step.total][hidden]; writes this rank's partial
  // output [step.total][hidden]. Errors: those of the kernels.
  virtual absl::Status Forward(const StepBatch& step, const float* a, float* out) const = 0;
  // Adds the tokens routed to each expert this module holds since load to
  // (*per_expert)[expert index] (sized num_experts by the caller); nothing
  // for a dense module. Thread-safe (relaxed counters).
  virtual void AddExpertTokens(std::vector<uint64_t>* per_expert) const { (void)per_expert; }
  // The routed experts this rank holds, [begin, end); empty for a dense module.
  virtual std::pair<int64_t, int64_t> held_experts() const { return {0, 0}; }
  virtual void ForEachLinear(const std::function<void(Linear&)>& fn) = 0;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_MODULE_H_
