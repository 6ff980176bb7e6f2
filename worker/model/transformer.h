// worker/model/transformer.h — a config-driven decoder-only transformer on
// one rank: Llama (incl. llama3 RoPE scaling), Mistral (sliding window),
// Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Mixtral, Qwen3-MoE and
// GLM-4 MoE (q/k/v bias, optional q/k norm, partial RoPE, sigmoid grouped
// routing with a correction bias, shared experts, first layers dense; its
// MTP layers are not built) and DeepSeek-V3 / Kimi K2 (multi-head latent
// attention with YaRN RoPE and a paged latent cache, MoE as GLM's; see
// MlaAttention), each linear EXL3-quantized or plain (bf16/fp16/fp32
// checkpoints).
//
//   EXL3_ASSIGN_OR_RETURN(auto model, Transformer::Load(dir));
//   EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, model->CreateKvCache(KvCacheOptions{}));
//   EXL3_RETURN_IF_ERROR(cache.AddSequence(0));
//   std::vector<float> logits;
//   EXL3_RETURN_IF_ERROR(model->Forward({{0, prompt}}, LogitsRows::kLastToken, &cache, &logits));
//
// The forward (fp32 activations throughout): h = the token embeddings, then
// per layer (a token mixer and a feed-forward, modules/module.h; which ones
// the architecture's recipe says, sharding::LayerRecipe)
//   h += mixer(RMSNorm(h))          attention (modules/gqa_attention.h) or
//                                   latent attention (modules/mla_attention.h)
//   h += feed_forward(RMSNorm(h))   SwiGLU MLP (modules/swiglu_mlp.h) or
//                                   mixture of experts (modules/moe.h)
// then logits = RMSNorm(h)·W_headᵀ (W_head = lm_head, or the token embedding when
// tied and lm_head is absent). With tensor parallelism each module returns
// this rank's partial sum and the Transformer all-reduces it.
#ifndef EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_
#define EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sharding/shard_plan.h"
#include "sharding/spill_store.h"
#include "worker/model/kv_cache.h"
#include "worker/model/linear.h"
#include "worker/model/model_config.h"
#include "worker/model/modules/module.h"

namespace exl3serve::sharding {
class Exl3Model;
}
namespace exl3serve::worker::comm {
class Communicator;
}

namespace exl3serve::worker {


// config.json (+ generation_config.json when present) of model directory
// `dir`. Errors: NotFound, DataLoss for malformed JSON, those of
// ModelConfigFromJson.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& dir);

// Tensor/expert parallelism: this process is one rank of a group that runs
// the model together (sharding/shard_plan.h says who holds what). Each rank
// computes its query heads (and the KV heads they use; its cache holds only
// those), its MLP channels, its experts' channels and its vocab rows; the
// partial outputs of o_proj, down_proj and the MoE block are all-reduced
// (so the residual stream is bit-identical on every rank) and the head's
// logits all-gathered, so every rank's Forward returns the full logits.
struct TensorParallelism {
  sharding::RankShard shard;                 // this rank's part of the plan
  comm::Communicator* comm = nullptr;        // borrowed; outlives the model
  absl::Duration collective_timeout = absl::Seconds(60);  // per collective
};

// How Load treats the weights. Today: which row-lookup tables stay on disk.
struct TransformerLoadOptions {
  // The token embedding ("model.embed_tokens.weight", the only row-lookup
  // table of the supported models) spills when this policy picks it
  // (sharding::ChooseSpilledTensors; its resident cost counts as fp32): its
  // rows are then read per Forward from the checkpoint (or an extracted copy)
  // through a bounded, checksummed cache, bit-identical to the resident rows.
  // A tied head (no lm_head, tie_word_embeddings) stays resident either way:
  // it multiplies every row each step, so reading it from disk would read the
  // whole table per token; on a single rank spilling a tied embedding
  // therefore saves no memory (the lookups still go through the store).
  // The default policy spills nothing.
  sharding::SpillPolicy spill;
};

// Thread safety: immutable after Load; Forward is const and may run
// concurrently on different caches (the kernels share one thread pool, so
// concurrent calls serialise there).
// Ownership: owns all weights (copied out of the checkpoint at Load).
class Transformer {
 public:
  // Loads config.json (+ generation_config.json) and every weight of `dir`,
  // an EXL3 directory or a plain Hugging Face one.
  // Errors: NotFound for a missing directory, config.json or tensor (named);
  // DataLoss for malformed JSON or a tensor of the wrong shape;
  // Unimplemented for an unsupported architecture or feature (see
  // ModelConfigFromJson). Cost: reads all weights into memory.
  static absl::StatusOr<std::unique_ptr<Transformer>> Load(const std::string& dir);
  // The same with options. Errors also: those of ChooseSpilledTensors and
  // SpillStore::Open for a spilled embedding; Forward then also returns the
  // store's read errors (DataLoss for a corrupted block).
  static absl::StatusOr<std::unique_ptr<Transformer>> Load(const std::string& dir,
                                                           const TransformerLoadOptions& options);

  // One rank of a tensor/expert-parallel group: reads only the rank's slices
  // (plus the replicated embedding, norms and routers). Every rank of the
  // group must call Forward with the same batches in the same order.
  // Errors: those of Load; InvalidArgument when the shard does not fit the
  // model (layer count, ranges) or comm is null; Unimplemented for a plan
  // whose KV head count differs between layers.
  static absl::StatusOr<std::unique_ptr<Transformer>> LoadShard(const std::string& dir,
                                                                const TensorParallelism& tp);
  // The same with options. The embedding is replicated on every rank, so a
  // rank whose policy spills it reads the whole table in place (or from its
  // own extracted copy) but only the rows its batches look up; the policy's
  // memory budget is this rank's (its shard's stored bytes count as resident,
  // see sharding::PlanRowTables, which makes the same choice per rank).
  static absl::StatusOr<std::unique_ptr<Transformer>> LoadShard(
      const std::string& dir, const TensorParallelism& tp, const TransformerLoadOptions& options);

  const ModelConfig& config() const { return config_; }
  int64_t vocab_size() const { return config_.arch.vocab_size; }

  // A cache shaped for this model. Errors: those of PagedKvCache::Create.
  absl::StatusOr<PagedKvCache> CreateKvCache(const KvCacheOptions& options) const;

  // Runs the new tokens of every entry of `batch` (each sequence at most
  // once, at least one token each), appends their keys and values to `cache`
  // and writes the logits rows chosen by `rows` into *logits (resized to
  // rows x vocab_size).
  // Errors: InvalidArgument for an empty batch or entry, a repeated sequence
  // or a token id outside [0, vocab_size) (named); NotFound for a sequence
  // the cache lacks; ResourceExhausted when the cache has no room (pages
  // reserved for earlier entries stay reserved); errors of the kernels.
  // On error no sequence's committed length changes. Precision: each
  // entry's rows run every EXL3 linear at their kind (linear.h RowKind: by
  // position when the entry carries its prompt length — prompt rows prefill,
  // output rows decode, PrefillRowsOfEntry — else by the entry's size:
  // decode precision below kPrefillMinRows tokens, prefill from there),
  // also through MoE experts and the head,
  // so with int8 decode a decode-kind entry's logits are bit for bit those
  // of the entry alone whatever shares the step (a prefill-kind entry's too
  // when it is the step's only one: fp32/bf16 sums depend on a call's row
  // count). With tensor parallelism, also the errors of the collectives
  // (DeadlineExceeded, Unavailable, Aborted: the group is broken and must
  // be re-formed).
  absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                       PagedKvCache* cache, std::vector<float>* logits) const;

  // As Forward, but *slice_logits gets only this rank's vocabulary rows
  // (rows x vocab_slice width; the whole vocabulary without parallelism or
  // with a replicated head): no logits cross the ranks. What rank-side
  // sampling (vocab_sampler.h) consumes.
  absl::Status ForwardVocabSlice(std::span<const SequenceTokens> batch, LogitsRows rows,
                                 PagedKvCache* cache, std::vector<float>* slice_logits) const;
  // As ForwardVocabSlice, with the logits rows chosen per entry: the last
  // last_rows[i] positions of entry i (0 = none), entries in batch order —
  // what speculative verification needs (the last accepted token and the
  // drafts of each drafting sequence, nothing for a prefill chunk).
  // InvalidArgument, before anything runs, when last_rows.size() differs
  // from the batch's or an entry asks for more rows than it has tokens.
  absl::Status ForwardVocabSliceLastRows(std::span<const SequenceTokens> batch,
                                         std::span<const int32_t> last_rows, PagedKvCache* cache,
                                         std::vector<float>* slice_logits) const;

  // This rank's vocabulary rows [first, second) of the head; the ranks'
  // ranges tile [0, vocab_size) in rank order (or are all whole).
  std::pair<int64_t, int64_t> vocab_slice() const { return {vocab_.begin, vocab_.end}; }
  // The group's communicator (null for a single rank); borrowed.
  comm::Communicator* communicator() const { return comm_; }
  // How long one collective of this model may wait.
  absl::Duration collective_timeout() const { return collective_timeout_; }

  // Bytes this process read from the checkpoint while loading.
  uint64_t bytes_read() const { return bytes_read_; }

  // The spilled row-lookup tables and their store counters (empty when
  // nothing spilled). Thread-safe; each entry's counters as
  // sharding::SpillStore::stats().
  struct SpillTableStats {
    std::string tensor;
    sharding::SpillStoreStats stats;
  };
  std::vector<SpillTableStats> spill_stats() const;

  // MoE: tokens routed to each expert this rank holds (summed over layers;
  // a token counts once per layer whose top-k picks the expert), since Load,
  // as (expert index, tokens). Empty for a dense model. Thread-safe (relaxed
  // counters, updated by Forward).
  std::vector<std::pair<int, uint64_t>> expert_tokens() const;

  // Attaches `observer` (borrowed; nullptr detaches) to every linear, so it
  // sees each linear's input during Forward (calibration).
  void SetInputObserver(InputObserver* observer);

 private:
  // A decoder layer: the norms around its two modules (modules/module.h).
  struct Layer {
    std::vector<float> input_norm, post_attention_norm;
    std::unique_ptr<TokenMixer> mixer;
    std::unique_ptr<FeedForward> feed_forward;
  };

  Transformer() = default;
  static absl::StatusOr<std::unique_ptr<Transformer>> LoadImpl(
      const std::string& dir, const TensorParallelism* tp, const TransformerLoadOptions& options);
  absl::Status LoadWeights(const sharding::Exl3Model& model, const sharding::RankShard& shard,
                           const TransformerLoadOptions& options);
  // Forward after validation: embedding, layers, head.
  // last_rows non-empty: those rows per entry instead of `rows`.
  absl::Status RunLayers(std::span<const SequenceTokens> batch, LogitsRows rows,
                         std::span<const int32_t> last_rows, PagedKvCache* cache,
                         const std::vector<int64_t>& starts, int64_t total, bool gather_logits,
                         std::vector<float>* logits) const;
  absl::Status ForwardImpl(std::span<const SequenceTokens> batch, LogitsRows rows,
                           std::span<const int32_t> last_rows, PagedKvCache* cache,
                           bool gather_logits, std::vector<float>* logits) const;
  // Sums `data` over the ranks (no-op on a single rank).
  absl::Status AllReduce(std::vector<float>& data) const;
  // The full logits from this rank's vocab rows (rows x vocab_begin..end).
  absl::Status GatherLogits(std::vector<float>& local, int64_t rows,
                            std::vector<float>* logits) const;

  ModelConfig config_;
  std::vector<double> rope_inv_freq_;
  std::vector<float> embed_;  // [vocab][hidden]; empty when shared with a tied head or spilled
  std::unique_ptr<sharding::SpillStore> embed_spill_;  // the embedding when spilled, else null
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;
  Linear head_;  // this rank's vocab rows [vocab_.begin, vocab_.end)
  sharding::IndexRange vocab_;
  comm::Communicator* comm_ = nullptr;  // null: a single rank
  uint64_t bytes_read_ = 0;
  absl::Duration collective_timeout_;
  std::vector<bool> expert_held_;  // MoE: per expert index, whether a layer here holds it
  std::vector<KvLayout> kv_layouts_;    // of the layers that keep KV, in cache-layer order
  std::vector<int64_t> state_floats_;   // of the layers with per-sequence state, by state slot
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_TRANSFORMER_H_
