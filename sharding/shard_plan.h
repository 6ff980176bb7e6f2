// sharding/shard_plan.h — which rank holds which part of a model: the shard
// planner for tensor parallelism (128-channel groups, whole heads) and expert
// parallelism (whole experts, optionally tensor-parallel inside experts).
//
//   WorldSpec world = WorldSpec::Uniform(3);                 // 3 ranks, one box
//   EXL3_ASSIGN_OR_RETURN(ShardPlan plan,
//                         PlanShards(arch, world, ShardOptions{}, model.get()));
//   const RankShard& mine = plan.ranks[rank];
//   mine.layers[7].q_heads   // query heads [begin, end) of layer 7 on this rank
//   std::fputs(plan.Describe().c_str(), stdout);
//
// Split rules (exl3-format.md §5.5, §8):
//   * Attention is split by KV heads in units of g KV heads, g the smallest
//     count with g·head_dim % 128 == 0 (g = 1 when num_key_value_heads is not
//     a multiple of that count); query heads follow their KV head. When there
//     are fewer such units than ranks, query heads are split instead (units:
//     the smallest q-head count that is a multiple of 128 channels, else one
//     head) and each rank keeps (replicates) the KV heads its query heads use:
//     query head h uses KV head h / (num_attention_heads / num_key_value_heads).
//     q/k/v are column-parallel, o row-parallel (bias on the first rank with
//     query heads only).
//   * Dense MLP: the intermediate dimension in 128-channel units (the last
//     unit is partial when the width is not a multiple of 128); gate/up
//     column-parallel, down row-parallel (bias on the first rank with
//     channels only). Dense layers of an MoE model are split the same way,
//     and so is the shared expert of an MoE layer (GLM-4 MoE; its width is
//     ModelArch::shared_expert_intermediate_size), over every rank.
//   * MoE: experts in contiguous ranges over `expert_parallel` groups of
//     ranks; inside a group every expert's intermediate dimension is split in
//     128-channel units over the group's ranks (ep == world size: whole
//     experts per rank, pure expert parallelism). Experts go to groups in
//     proportion to the groups' summed capacity, channels to the ranks of a
//     group in proportion to theirs. The router is replicated. The down bias
//     of an expert is added by the first rank of its group with channels.
//   * Head: vocab-parallel in 128-row units (logits gathered), or whole on
//     every rank with ShardOptions::replicate_head; the token embedding and
//     every norm are replicated.
//   * Ranges are contiguous and in rank order: over all ranks they cover every
//     query head, MLP channel and vocab row exactly once (expert channels:
//     once per expert group, over the group's ranks). Test ranges with
//     empty(); an empty range's begin carries no meaning.
//   * Units go to ranks in proportion to WorldSpec::Rank::capacity (largest
//     remainder, ties to lower ranks), so uneven rank counts and capacities
//     work; a rank may receive zero units of a layer.
//   * Channel ranges are 128-aligned whenever the unit allows it. When one is
//     not (e.g. head_dim 64 and an odd head count on a rank), the loader reads
//     the 128-aligned superset of an EXL3 linear: extra output columns are
//     dropped (column-parallel) and extra input rows get zero input
//     (row-parallel), which is exact.
#ifndef EXL3SERVE_SHARDING_SHARD_PLAN_H_
#define EXL3SERVE_SHARDING_SHARD_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "sharding/exl3_format.h"
#include "sharding/model_arch.h"
#include "sharding/spill_store.h"

namespace exl3serve::sharding {

class Exl3Model;

// [begin, end), in the unit its name says (heads, channels, experts, rows).
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const IndexRange&, const IndexRange&) = default;
};

// The ranks a model runs on, grouped into boxes (machines).
struct WorldSpec {
  struct Rank {
    int box = 0;            // index into boxes
    int device = -1;        // GPU ordinal, -1 for a CPU rank
    double capacity = 1.0;  // relative share of the work (e.g. free memory); > 0
  };
  std::vector<std::string> boxes;  // box names; at least one
  std::vector<Rank> ranks;         // rank r = ranks[r]

  // n CPU ranks of equal capacity on one box named "local".
  static WorldSpec Uniform(int n);
  int world_size() const { return static_cast<int>(ranks.size()); }
};

struct ShardOptions {
  // Number of expert groups for MoE layers; 0 = world size (pure EP). Must
  // divide the world size.
  int expert_parallel = 0;
  // Head: vocab-parallel (default) or replicated on every rank.
  bool replicate_head = false;
  // Byte estimates without a model (PlanShards' `model` null), e.g. from a
  // config.json alone: 0 = every tensor at fp16; 1..8 = what `convert --bits
  // estimate_bits --head-bits estimate_head_bits` would store: each quantized
  // linear at the bits quant::AllocateBits gives it (the converter's own
  // allocation), as trellis k·n·K/8 + suh/svh (fp16) + a 4-byte codebook
  // marker over 128-padded k, n; the router and a 16-bit head as fp16; the
  // embedding, norms and biases fp16 (a GLM correction bias fp32). Ignored
  // when a model is given (its stored sizes are used).
  double estimate_bits = 0.0;
  int estimate_head_bits = kDefaultHeadBits;  // 1..8, or 16 = fp16
};

// One decoder layer on one rank. Head ranges are in heads (multiply by
// head_dim for q/k/v columns and o rows); channel ranges are in unpadded
// channels (the loader rounds them out to 128 for EXL3 linears, see above).
struct LayerShard {
  IndexRange q_heads;         // query heads this rank computes
  IndexRange kv_heads;        // KV heads it holds (may overlap other ranks' when replicated)
  bool o_bias = false;        // this rank adds o_proj's bias (exactly one rank per layer)
  IndexRange mlp_channels;    // dense MLP intermediate channels; in MoE layers the shared
                              // expert's (empty without one)
  bool down_bias = false;     // this rank adds (shared) down_proj's bias (one rank per layer)
  IndexRange experts;         // MoE: experts held (whole or the channel slice below)
  IndexRange expert_channels; // MoE: intermediate channels of each held expert
                              // (empty when `experts` is)
  bool expert_down_bias = false;  // adds the held experts' down_proj bias (one rank per group)
  // Gated DeltaNet layers: the key heads this rank computes, with their
  // G value heads each, the matching conv channels, β / decay rows, out_proj
  // input columns and recurrent state (arch-gated-deltanet.md §7).
  IndexRange linear_key_heads;
};

// A row-lookup table (embedding, n-gram table) as one rank holds it.
struct RowTableShard {
  std::string name;             // e.g. "model.embed_tokens.weight"
  int64_t rows = 0, width = 0;
  uint64_t stored_bytes = 0;    // in the checkpoint (fp16 estimate without a model)
  uint64_t resident_bytes = 0;  // in memory when resident (fp32 rows)
  bool spilled = false;         // read from disk through a SpillStore instead
};

struct RankShard {
  int rank = 0;
  std::vector<LayerShard> layers;  // one per decoder layer
  IndexRange vocab;                // head output rows (all when replicated)
  uint64_t weight_bytes = 0;       // bytes of stored tensors this rank reads
  uint64_t replicated_bytes = 0;   // of which: replicated (embedding, norms, router, KV copies)
  // The row-lookup tables (today: the token embedding, replicated) this rank
  // needs, whole, on its box; whether each spills is decided by
  // PlanRowTables (PlanShards leaves them all resident).
  std::vector<RowTableShard> row_tables;
};

// Thread safety: a plain value type (thread-compatible).
struct ShardPlan {
  WorldSpec world;
  ShardOptions options;
  std::string architecture;        // ModelArch::architecture, for Describe()
  int64_t head_dim = 0;
  int expert_groups = 0;           // expert_parallel resolved (0 for a dense model)
  std::vector<bool> layer_is_moe;  // per layer, as ModelArch::layer_is_moe
  std::vector<RankShard> ranks;
  uint64_t total_bytes = 0;  // stored bytes of the whole model

  // A human-readable table: one line per rank (box, capacity, q heads, KV
  // heads, MLP channels, experts and their channels, vocab rows, bytes and
  // MiB, replicated MiB) for the first layer of each kind, then a summary
  // (model bytes, bytes over all ranks, largest rank).
  std::string Describe() const;
};

// Plans `arch` over `world`. `model` (nullable; borrowed for the call) supplies
// stored tensor sizes for the byte estimates: an EXL3 linear's stored bytes,
// or a plain `.weight` (+ `.bias`), scaled by the fraction of heads, channels,
// experts or rows a rank holds; every tensor that belongs to no linear
// (embedding, norms) counts whole on every rank. Without it bytes are
// estimated from the shapes: fp16 (2 bytes per weight, embedding and norms
// included), or as EXL3 with ShardOptions::estimate_bits.
// replicated_bytes counts the embedding, norms, router, the head when
// replicated, and KV heads held by more than one rank.
// Errors: InvalidArgument, naming the rank or option, for an empty world, no
// boxes, a capacity <= 0 (or not finite), a box index out of range,
// expert_parallel negative, not dividing the world size or larger than the
// number of experts, estimate_bits neither 0 nor in [1, 8] or
// estimate_head_bits neither 1..8 nor 16 (without a model), and an arch whose
// head counts or layer list are inconsistent.
absl::StatusOr<ShardPlan> PlanShards(const ModelArch& arch, const WorldSpec& world,
                                     const ShardOptions& options, const Exl3Model* model);

// Decides, per rank, which of its row_tables spill under `policy`: as
// ChooseSpilledTensors with the rank's tables as candidates (resident_bytes)
// and the rest of its weight_bytes as other resident bytes, so
// memory_budget_bytes is a budget per rank process (a box running R ranks
// gives each its share). A rank's loader (worker::Transformer::LoadShard)
// makes the same choice from the same numbers.
// Errors: those of ChooseSpilledTensors, prefixed with the rank and its box.
absl::Status PlanRowTables(const SpillPolicy& policy, ShardPlan* plan);

// The candidates and other resident bytes PlanRowTables uses for `rank`.
std::vector<SpillCandidate> RowTableCandidates(const RankShard& rank);
uint64_t OtherResidentBytes(const RankShard& rank);

// The row tables per rank: "rank R (box B): NAME resident|spilled N bytes"
// lines, and per box the bytes of tables resident and of spilled tables
// (which must be on that box's local disk).
std::string DescribeRowTables(const ShardPlan& plan);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_SHARD_PLAN_H_
