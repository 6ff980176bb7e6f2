#include "sharding/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "sharding/exl3_format.h"
#include "sharding/exl3_model.h"
#include "sharding/quant/bit_allocation.h"

namespace exl3serve::sharding {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Fractions closer than this count as equal when the largest remainders are
// ranked, so equal capacities tie (and go to the lower rank) even when their
// quotas differ in the last bits of a double.
constexpr double kRemainderResolution = 1e-9;

// Splits `units` over `weights` (all > 0) in proportion: each gets the floor
// of its quota, the units left over go one each to the largest remainders,
// ties to the lower index (largest remainder / Hamilton method). Every count
// is within one unit of its exact quota, and the counts sum to `units`.
std::vector<int64_t> Apportion(int64_t units, const std::vector<double>& weights) {
  const size_t n = weights.size();
  std::vector<int64_t> counts(n, 0);
  if (n == 0 || units <= 0) return counts;
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> remainder_key(n, 0);
  int64_t given = 0;
  for (size_t i = 0; i < n; ++i) {
    const double quota = static_cast<double>(units) * (weights[i] / total);
    // A quota a hair below an integer (rounding) is that integer.
    int64_t whole = static_cast<int64_t>(std::floor(quota + kRemainderResolution));
    whole = std::clamp<int64_t>(whole, 0, units);
    counts[i] = whole;
    given += whole;
    remainder_key[i] = std::llround(std::max(0.0, quota - static_cast<double>(whole)) /
                                    kRemainderResolution);
  }
  // Rounding can only over-give by snapping near-integers up; take such units
  // back from the highest indices (never below zero).
  for (size_t i = n; given > units && i-- > 0;) {
    const int64_t take = std::min(counts[i], given - units);
    counts[i] -= take;
    given -= take;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return remainder_key[a] > remainder_key[b];
  });
  for (size_t j = 0; given < units; j = (j + 1) % n, ++given) ++counts[order[j]];
  return counts;
}

// Contiguous ranges in index order from per-rank unit counts; unit u covers
// [u·unit_size, min((u+1)·unit_size, total)).
std::vector<IndexRange> RangesFromCounts(const std::vector<int64_t>& counts, int64_t unit_size,
                                         int64_t total) {
  std::vector<IndexRange> ranges(counts.size());
  int64_t unit = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    ranges[i].begin = std::min(unit * unit_size, total);
    unit += counts[i];
    ranges[i].end = std::min(unit * unit_size, total);
  }
  return ranges;
}

// Splits `total` items (heads, channels, rows) in units of `unit_size` items
// over `weights`.
std::vector<IndexRange> SplitProportional(int64_t total, int64_t unit_size,
                                          const std::vector<double>& weights) {
  const int64_t units = (total + unit_size - 1) / unit_size;
  return RangesFromCounts(Apportion(units, weights), unit_size, total);
}

// The smallest number of heads of `head_dim` channels that fills whole
// 128-channel groups (§5.5); 1 when `heads` is not a multiple of it.
int64_t AlignedHeadUnit(int64_t head_dim, int64_t heads) {
  const int64_t unit = kChannelGroup / std::gcd(head_dim, kChannelGroup);
  return heads % unit == 0 ? unit : 1;
}

absl::Status ValidateWorld(const WorldSpec& world) {
  if (world.ranks.empty()) {
    return absl::InvalidArgumentError("shard plan: the world has no ranks (need at least one)");
  }
  if (world.boxes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan: the world has ",
                                                   world.ranks.size(),
                                                   " ranks but no boxes (need at least one)"));
  }
  for (size_t r = 0; r < world.ranks.size(); ++r) {
    const WorldSpec::Rank& rank = world.ranks[r];
    if (!(rank.capacity > 0.0) || !std::isfinite(rank.capacity)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard plan: rank ", r, ": capacity must be a finite number > 0, got ", rank.capacity));
    }
    if (rank.box < 0 || rank.box >= static_cast<int>(world.boxes.size())) {
      return absl::InvalidArgumentError(absl::StrCat("shard plan: rank ", r, ": box ", rank.box,
                                                     " is out of range, the world has ",
                                                     world.boxes.size(), " boxes"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateArch(const ModelArch& arch) {
  if (arch.num_layers < 0 || arch.layer_is_moe.size() != static_cast<size_t>(arch.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard plan: ", arch.architecture, ": layer_is_moe has ", arch.layer_is_moe.size(),
        " entries for ", arch.num_layers, " layers"));
  }
  if (arch.num_attention_heads <= 0 || arch.num_key_value_heads <= 0 || arch.head_dim <= 0 ||
      arch.num_attention_heads % arch.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard plan: ", arch.architecture, ": need heads > 0 and a multiple of KV heads > 0 and "
        "head_dim > 0, got ", arch.num_attention_heads, " heads, ", arch.num_key_value_heads,
        " KV heads, head_dim ", arch.head_dim));
  }
  if (arch.vocab_size <= 0 || arch.hidden_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan: ", arch.architecture,
                                                   ": vocab_size and hidden_size must be > 0"));
  }
  const bool any_moe = std::find(arch.layer_is_moe.begin(), arch.layer_is_moe.end(), true) !=
                       arch.layer_is_moe.end();
  const bool any_dense = std::find(arch.layer_is_moe.begin(), arch.layer_is_moe.end(), false) !=
                         arch.layer_is_moe.end();
  if (any_moe && (arch.num_experts <= 0 || arch.moe_intermediate_size <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard plan: ", arch.architecture, ": MoE layers need num_experts > 0 and "
        "moe_intermediate_size > 0, got ", arch.num_experts, " and ", arch.moe_intermediate_size));
  }
  if (any_dense && arch.intermediate_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan: ", arch.architecture,
                                                   ": dense layers need intermediate_size > 0"));
  }
  return absl::OkStatus();
}

// Attention ranges per rank (the same for every layer).
struct AttentionSplit {
  std::vector<IndexRange> q_heads;
  std::vector<IndexRange> kv_heads;
};

AttentionSplit PlanAttention(const ModelArch& arch, const std::vector<double>& capacity) {
  const int64_t heads = arch.num_attention_heads;
  const int64_t kv_heads = arch.num_key_value_heads;
  const int64_t group = heads / kv_heads;  // query heads per KV head
  const size_t ranks = capacity.size();
  AttentionSplit split;
  const int64_t kv_unit = AlignedHeadUnit(arch.head_dim, kv_heads);
  if (kv_heads / kv_unit >= static_cast<int64_t>(ranks)) {
    split.kv_heads = SplitProportional(kv_heads, kv_unit, capacity);
    for (const IndexRange& kv : split.kv_heads) {
      split.q_heads.push_back({kv.begin * group, kv.end * group});
    }
    return split;
  }
  // Fewer KV units than ranks: split query heads, replicate the KV heads.
  split.q_heads = SplitProportional(heads, AlignedHeadUnit(arch.head_dim, heads), capacity);
  for (const IndexRange& q : split.q_heads) {
    if (q.empty()) {
      const int64_t at = std::min(q.begin / group, kv_heads);
      split.kv_heads.push_back({at, at});
    } else {
      split.kv_heads.push_back({q.begin / group, (q.end - 1) / group + 1});
    }
  }
  return split;
}

// Index of the first non-empty range, or -1.
int FirstNonEmpty(const std::vector<IndexRange>& ranges, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    if (!ranges[i].empty()) return static_cast<int>(i);
  }
  return -1;
}

// Stored bytes of one linear of the architecture: EXL3 tensors, or a plain
// weight (+ bias); the fp16 estimate without a model. 0 for a tied head
// without its own tensor (the embedding is counted instead).
// EXL3 storage of an in x out linear at `bits` (exl3-format.md §2.4): the
// trellis (I16 [k/16, n/16, 16·K] over 128-padded k, n), suh and svh (fp16)
// and the 0-d I32 codebook marker.
double Exl3LinearBytes(int64_t in_features, int64_t out_features, int bits) {
  const double k = static_cast<double>((in_features + 127) / 128 * 128);
  const double n = static_cast<double>((out_features + 127) / 128 * 128);
  return k * n * bits / 8.0 + 2.0 * (k + n) + 4.0;
}

// Bits per linear key when estimating as EXL3 (ShardOptions::estimate_bits >
// 0): the converter's allocation for the budgeted linears (Converter::Allocate),
// the head at estimate_head_bits, 16 for unquantized ones. Empty for fp16.
absl::StatusOr<std::vector<int>> EstimateLinearBits(const ModelArch& arch,
                                                    const ShardOptions& options) {
  if (options.estimate_bits == 0.0) return std::vector<int>();
  if (!(options.estimate_bits >= 1.0 && options.estimate_bits <= 8.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "estimate bits must be 0 (fp16) or in [1, 8], got ", options.estimate_bits));
  }
  const int head = options.estimate_head_bits;
  if (!((head >= 1 && head <= 8) || head == 16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("estimate head bits must be 1..8 or 16, got ", head));
  }
  std::vector<quant::AllocationItem> items;
  std::vector<size_t> item_linear;
  for (size_t i = 0; i < arch.linears.size(); ++i) {
    const LinearSpec& l = arch.linears[i];
    if (!l.quantized || l.is_head) continue;
    quant::AllocationItem item;
    item.name = l.key;
    item.layer_index = l.layer;
    item.num_layers = arch.num_layers;
    item.qgroup = l.qgroup;
    item.priority = l.priority;
    item.numel = (l.in_features + 127) / 128 * 128 * ((l.out_features + 127) / 128 * 128);
    items.push_back(std::move(item));
    item_linear.push_back(i);
  }
  std::vector<int> bits(arch.linears.size(), 16);
  for (size_t i = 0; i < arch.linears.size(); ++i) {
    if (arch.linears[i].is_head && arch.linears[i].quantized) bits[i] = head;
  }
  if (!items.empty()) {
    EXL3_ASSIGN_OR_RETURN(quant::BitAllocation allocation,
                          quant::AllocateBits(items, options.estimate_bits));
    for (size_t j = 0; j < items.size(); ++j) bits[item_linear[j]] = allocation.bits[j];
  }
  return bits;
}

// `bits` (from EstimateLinearBits; 0 = fp16 estimate) is used without a model.
double LinearBytes(const ModelArch& arch, const LinearSpec& spec, const Exl3Model* model,
                   int bits) {
  if (model != nullptr) {
    if (const Exl3LinearInfo* l = model->FindLinear(spec.key)) {
      return static_cast<double>(l->stored_bytes);
    }
    double bytes = 0.0;
    if (const PlainTensorInfo* w = model->FindPlain(spec.key + std::string(kWeightSuffix))) {
      bytes += static_cast<double>(w->stored_bytes);
    }
    if (const PlainTensorInfo* b = model->FindPlain(spec.key + std::string(kBiasSuffix))) {
      bytes += static_cast<double>(b->stored_bytes);
    }
    return bytes;
  }
  if (spec.is_head && arch.tie_word_embeddings) return 0.0;
  if (bits > 0 && bits < 16) return Exl3LinearBytes(spec.in_features, spec.out_features, bits);
  return 2.0 * static_cast<double>(spec.in_features) * static_cast<double>(spec.out_features);
}

// fp16 estimate of everything that is not a linear: embedding and norms
// (two per layer, the final one, and Qwen3's per-head q/k norms). `exl3`: as
// the converter writes them (GLM q/k/v biases padded to 128 like their
// linears, the correction bias fp16), else as a Hugging Face checkpoint
// holds them (correction bias fp32).
double OtherBytesEstimate(const ModelArch& arch, bool exl3) {
  double bytes = 2.0 * static_cast<double>(arch.vocab_size) * static_cast<double>(arch.hidden_size);
  bytes += 2.0 * static_cast<double>(2 * arch.num_layers + 1) * static_cast<double>(arch.hidden_size);
  if (arch.architecture.rfind("Qwen3", 0) == 0) {
    bytes += 2.0 * 2.0 * static_cast<double>(arch.num_layers) * static_cast<double>(arch.head_dim);
  }
  if (arch.architecture == "Glm4MoeForCausalLM") {
    // q/k norms, q/k/v biases (fp16) and each MoE layer's fp32 correction bias.
    const double layers = static_cast<double>(arch.num_layers);
    auto width = [&](int64_t heads) {
      const int64_t w = heads * arch.head_dim;
      return static_cast<double>(exl3 ? (w + 127) / 128 * 128 : w);
    };
    const double qkv = width(arch.num_attention_heads) + 2.0 * width(arch.num_key_value_heads);
    bytes += 2.0 * layers * (2.0 * static_cast<double>(arch.head_dim) + qkv);
    const double correction = exl3 ? 2.0 : 4.0;
    for (bool moe : arch.layer_is_moe) bytes += moe ? correction * arch.num_experts : 0.0;
  }
  if (arch.mla()) {
    // DeepSeek-V3: q_a_layernorm and kv_a_layernorm per layer, each MoE
    // layer's fp32 correction bias (fp16 once converted).
    const double layers = static_cast<double>(arch.num_layers);
    bytes += 2.0 * layers * static_cast<double>(arch.q_lora_rank + arch.kv_lora_rank);
    const double correction = exl3 ? 2.0 : 4.0;
    for (bool moe : arch.layer_is_moe) bytes += moe ? correction * arch.num_experts : 0.0;
  }
  return bytes;
}

double Fraction(int64_t part, int64_t whole) {
  return whole <= 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

absl::Status EstimateBytes(const ModelArch& arch, const Exl3Model* model, ShardPlan& plan) {
  std::vector<int> bits;
  if (model == nullptr) {
    EXL3_ASSIGN_OR_RETURN(bits, EstimateLinearBits(arch, plan.options));
  }
  double linear_total = 0.0;
  std::vector<double> linear_bytes(arch.linears.size());
  for (size_t i = 0; i < arch.linears.size(); ++i) {
    linear_bytes[i] = LinearBytes(arch, arch.linears[i], model, bits.empty() ? 0 : bits[i]);
    linear_total += linear_bytes[i];
  }
  double other = 0.0;
  if (model != nullptr) {
    plan.total_bytes = model->TotalStoredBytes();
    other = std::max(0.0, static_cast<double>(plan.total_bytes) - linear_total);
  } else {
    other = OtherBytesEstimate(arch, /*exl3=*/!bits.empty());
    plan.total_bytes = static_cast<uint64_t>(std::llround(linear_total + other));
  }

  // How many ranks hold each KV head, per layer (> 1: replicated).
  std::vector<std::vector<int>> kv_holders(arch.num_layers,
                                           std::vector<int>(arch.num_key_value_heads, 0));
  for (const RankShard& rank : plan.ranks) {
    for (int l = 0; l < arch.num_layers; ++l) {
      const IndexRange& kv = rank.layers[l].kv_heads;
      for (int64_t h = kv.begin; h < kv.end; ++h) ++kv_holders[l][h];
    }
  }

  for (RankShard& rank : plan.ranks) {
    double bytes = other;
    double replicated = other;
    for (size_t i = 0; i < arch.linears.size(); ++i) {
      const LinearSpec& spec = arch.linears[i];
      const double full = linear_bytes[i];
      if (spec.is_head || spec.role == LinearRole::kHead) {
        bytes += full * Fraction(rank.vocab.size(), arch.vocab_size);
        if (plan.options.replicate_head) replicated += full;
        continue;
      }
      if (spec.layer < 0 || spec.layer >= arch.num_layers) continue;
      const LayerShard& layer = rank.layers[spec.layer];
      switch (spec.role) {
        case LinearRole::kQ:
        case LinearRole::kO:
        case LinearRole::kQB:   // MLA: split by query heads
        case LinearRole::kKVB:
          bytes += full * Fraction(layer.q_heads.size(), arch.num_attention_heads);
          break;
        case LinearRole::kQA:   // MLA: the layer input's down-projections, on every rank
        case LinearRole::kKVA:
          bytes += full;
          replicated += full;
          break;
        case LinearRole::kK:
        case LinearRole::kV: {
          bytes += full * Fraction(layer.kv_heads.size(), arch.num_key_value_heads);
          int64_t shared = 0;
          for (int64_t h = layer.kv_heads.begin; h < layer.kv_heads.end; ++h) {
            if (kv_holders[spec.layer][h] > 1) ++shared;
          }
          replicated += full * Fraction(shared, arch.num_key_value_heads);
          break;
        }
        case LinearRole::kGate:
        case LinearRole::kUp:
        case LinearRole::kDown:
          if (spec.expert == kSharedExpert) {
            bytes += full * Fraction(layer.mlp_channels.size(),
                                     arch.shared_expert_intermediate_size);
          } else if (spec.expert < 0) {
            bytes += full * Fraction(layer.mlp_channels.size(), arch.intermediate_size);
          } else if (spec.expert >= layer.experts.begin && spec.expert < layer.experts.end) {
            bytes += full * Fraction(layer.expert_channels.size(), arch.moe_intermediate_size);
          }
          break;
        case LinearRole::kRouter:
        case LinearRole::kSharedExpertGate:
          bytes += full;
          replicated += full;
          break;
        case LinearRole::kGdnQkvz:
        case LinearRole::kGdnBa:
        case LinearRole::kGdnQkv:
        case LinearRole::kGdnZ:
        case LinearRole::kGdnB:
        case LinearRole::kGdnA:
        case LinearRole::kGdnOut:
          bytes += full * Fraction(layer.linear_key_heads.size(), arch.gdn_key_heads);
          break;
        case LinearRole::kHead:
          break;
      }
    }
    rank.weight_bytes = static_cast<uint64_t>(std::llround(bytes));
    rank.replicated_bytes = static_cast<uint64_t>(std::llround(replicated));
  }
  return absl::OkStatus();
}

// The token embedding, replicated on every rank (it is the only row-lookup
// table of the supported architectures).
void AddRowTables(const ModelArch& arch, const Exl3Model* model, ShardPlan& plan) {
  RowTableShard embed;
  embed.name = arch.EmbedName();
  embed.rows = arch.vocab_size;
  embed.width = arch.hidden_size;
  embed.resident_bytes = static_cast<uint64_t>(arch.vocab_size * arch.hidden_size) * 4;
  embed.stored_bytes = static_cast<uint64_t>(arch.vocab_size * arch.hidden_size) * 2;
  if (model != nullptr) {
    if (const PlainTensorInfo* t = model->FindPlain(embed.name)) embed.stored_bytes = t->stored_bytes;
  }
  for (RankShard& rank : plan.ranks) rank.row_tables = {embed};
}

std::string RangeText(const IndexRange& r) {
  if (r.empty()) return "-";
  return absl::StrCat("[", r.begin, ",", r.end, ")");
}

}  // namespace

WorldSpec WorldSpec::Uniform(int n) {
  WorldSpec world;
  world.boxes = {"local"};
  world.ranks.assign(static_cast<size_t>(std::max(n, 0)), Rank{});
  return world;
}

absl::StatusOr<ShardPlan> PlanShards(const ModelArch& arch, const WorldSpec& world,
                                     const ShardOptions& options, const Exl3Model* model) {
  EXL3_RETURN_IF_ERROR(ValidateWorld(world));
  EXL3_RETURN_IF_ERROR(ValidateArch(arch));
  const int world_size = world.world_size();
  const bool has_moe = std::find(arch.layer_is_moe.begin(), arch.layer_is_moe.end(), true) !=
                       arch.layer_is_moe.end();
  if (options.expert_parallel < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard plan: expert_parallel (--ep) must be >= 0 (0 = world size), got ",
        options.expert_parallel));
  }
  const int groups = options.expert_parallel == 0 ? world_size : options.expert_parallel;
  if (world_size % groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard plan: expert_parallel (--ep) must divide the world size ", world_size,
                     ", got ", groups));
  }
  if (has_moe && groups > arch.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard plan: expert_parallel (--ep) must be <= the number of experts ", arch.num_experts,
        ", got ", groups, options.expert_parallel == 0 ? " (the world size)" : "",
        "; give a smaller --ep that divides the world size"));
  }

  ShardPlan plan;
  plan.world = world;
  plan.options = options;
  plan.architecture = arch.architecture;
  plan.head_dim = arch.head_dim;
  plan.expert_groups = has_moe ? groups : 0;
  plan.layer_is_moe = arch.layer_is_moe;

  std::vector<double> capacity;
  for (const WorldSpec::Rank& r : world.ranks) capacity.push_back(r.capacity);

  const AttentionSplit attention = PlanAttention(arch, capacity);
  const int o_bias_rank = FirstNonEmpty(attention.q_heads, 0, capacity.size());

  std::vector<IndexRange> mlp;
  int down_bias_rank = -1;
  if (arch.intermediate_size > 0) {
    mlp = SplitProportional(arch.intermediate_size, kChannelGroup, capacity);
    down_bias_rank = FirstNonEmpty(mlp, 0, mlp.size());
  }
  // GLM-4 MoE: the shared expert of every MoE layer, split as a dense MLP.
  std::vector<IndexRange> shared(world_size);
  int shared_bias_rank = -1;
  if (arch.shared_expert_intermediate_size > 0) {
    shared = SplitProportional(arch.shared_expert_intermediate_size, kChannelGroup, capacity);
    shared_bias_rank = FirstNonEmpty(shared, 0, shared.size());
  }

  // MoE: experts over groups of consecutive ranks, channels inside a group.
  std::vector<IndexRange> experts(world_size), expert_channels(world_size);
  std::vector<bool> expert_bias(world_size, false);
  if (has_moe) {
    const int group_size = world_size / groups;
    std::vector<double> group_capacity(groups, 0.0);
    for (int r = 0; r < world_size; ++r) group_capacity[r / group_size] += capacity[r];
    const std::vector<IndexRange> group_experts =
        SplitProportional(arch.num_experts, 1, group_capacity);
    for (int g = 0; g < groups; ++g) {
      const std::vector<double> members(capacity.begin() + g * group_size,
                                        capacity.begin() + (g + 1) * group_size);
      std::vector<IndexRange> channels =
          SplitProportional(arch.moe_intermediate_size, kChannelGroup, members);
      if (group_experts[g].empty()) {
        for (IndexRange& c : channels) c = IndexRange{};
      }
      const int first = FirstNonEmpty(channels, 0, channels.size());
      for (int i = 0; i < group_size; ++i) {
        const int r = g * group_size + i;
        experts[r] = group_experts[g];
        expert_channels[r] = channels[i];
        expert_bias[r] = i == first;
      }
    }
  }

  // Gated DeltaNet layers: by key heads (each with its G value heads), in
  // units whose key and value channels fill whole 128-channel groups when
  // the head count allows (as attention heads are split).
  std::vector<IndexRange> linear_key_heads(world_size);
  if (arch.gdn_key_heads > 0) {
    const int64_t g = arch.gdn_value_heads / arch.gdn_key_heads;
    int64_t unit = 1;
    while (unit <= arch.gdn_key_heads &&
           ((unit * arch.gdn_key_dim) % kChannelGroup != 0 ||
            (unit * g * arch.gdn_value_dim) % kChannelGroup != 0)) {
      ++unit;
    }
    if (unit > arch.gdn_key_heads || arch.gdn_key_heads % unit != 0) unit = 1;
    linear_key_heads = SplitProportional(arch.gdn_key_heads, unit, capacity);
  }

  // The head.
  std::vector<IndexRange> vocab;
  if (options.replicate_head) {
    vocab.assign(world_size, IndexRange{0, arch.vocab_size});
  } else {
    vocab = SplitProportional(arch.vocab_size, kChannelGroup, capacity);
  }

  plan.ranks.resize(world_size);
  for (int r = 0; r < world_size; ++r) {
    RankShard& rank = plan.ranks[r];
    rank.rank = r;
    rank.vocab = vocab[r];
    rank.layers.resize(arch.num_layers);
    for (int l = 0; l < arch.num_layers; ++l) {
      LayerShard& layer = rank.layers[l];
      layer.q_heads = attention.q_heads[r];
      layer.kv_heads = attention.kv_heads[r];
      layer.linear_key_heads = linear_key_heads[r];
      layer.o_bias = r == o_bias_rank;
      if (arch.layer_is_moe[l]) {
        layer.experts = experts[r];
        layer.expert_channels = expert_channels[r];
        layer.expert_down_bias = expert_bias[r];
        layer.mlp_channels = shared[r];
        layer.down_bias = r == shared_bias_rank;
      } else {
        layer.mlp_channels = mlp[r];
        layer.down_bias = r == down_bias_rank;
      }
    }
  }
  EXL3_RETURN_IF_ERROR(EstimateBytes(arch, model, plan));
  AddRowTables(arch, model, plan);
  return plan;
}

std::string ShardPlan::Describe() const {
  std::string out;
  const int world_size = static_cast<int>(ranks.size());
  const int num_layers = ranks.empty() ? 0 : static_cast<int>(ranks[0].layers.size());
  int first_dense = -1, first_moe = -1;
  for (int l = 0; l < num_layers; ++l) {
    const bool moe = l < static_cast<int>(layer_is_moe.size()) && layer_is_moe[l];
    if (moe && first_moe < 0) first_moe = l;
    if (!moe && first_dense < 0) first_dense = l;
  }
  absl::StrAppendFormat(&out, "shard plan: %s, %d layers, head_dim %d, %d rank%s on %d box%s (%s)\n",
                        architecture.empty() ? std::string("model") : architecture, num_layers,
                        head_dim, world_size, world_size == 1 ? "" : "s", world.boxes.size(),
                        world.boxes.size() == 1 ? "" : "es", absl::StrJoin(world.boxes, ", "));
  if (num_layers > 0) {
    bool kv_shared = false;
    for (int a = 0; a < world_size && !kv_shared; ++a) {
      for (int b = a + 1; b < world_size; ++b) {
        const IndexRange& x = ranks[a].layers[0].kv_heads;
        const IndexRange& y = ranks[b].layers[0].kv_heads;
        if (!x.empty() && !y.empty() && x.begin < y.end && y.begin < x.end) kv_shared = true;
      }
    }
    absl::StrAppendFormat(&out, "attention: %s\n",
                          kv_shared ? "query heads split; KV heads used by several ranks are "
                                      "replicated on each"
                                    : "each KV head on one rank, with its query heads");
  }
  if (first_moe >= 0) {
    const int group_size = expert_groups > 0 ? world_size / expert_groups : 0;
    absl::StrAppendFormat(&out, "experts: %d group%s of %d rank%s (expert_parallel %d)\n",
                          expert_groups, expert_groups == 1 ? "" : "s", group_size,
                          group_size == 1 ? "" : "s", expert_groups);
  }
  absl::StrAppendFormat(&out, "head: %s\n",
                        options.replicate_head ? "replicated on every rank" : "vocab-parallel");
  absl::StrAppendFormat(&out,
                        "ranges are [begin,end) and the same in every layer of a kind; "
                        "* marks the rank that adds the bias\n\n");

  // The table: columns only for the layer kinds the model has.
  struct Column {
    std::string header;
    bool left;  // left-aligned (text), else right-aligned (numbers)
    std::vector<std::string> cells;
  };
  std::vector<Column> columns = {{"rank", false, {}}, {"box", true, {}}, {"device", true, {}},
                                 {"capacity", false, {}}};
  if (num_layers > 0) {
    columns.push_back({"q heads", true, {}});
    columns.push_back({"kv heads", true, {}});
  }
  // Gated DeltaNet layers (hybrids): key heads, each with its value heads.
  bool linear_attention = false;
  for (const RankShard& rank : ranks) {
    linear_attention |= num_layers > 0 && !rank.layers[0].linear_key_heads.empty();
  }
  if (linear_attention) columns.push_back({"linear k heads", true, {}});
  if (first_dense >= 0) columns.push_back({"mlp channels", true, {}});
  if (first_moe >= 0) {
    columns.push_back({"experts", true, {}});
    columns.push_back({"expert channels", true, {}});
  }
  columns.push_back({"vocab", true, {}});
  columns.push_back({"bytes", false, {}});
  columns.push_back({"MiB", false, {}});
  columns.push_back({"replicated MiB", false, {}});

  uint64_t sum = 0, largest = 0;
  for (int r = 0; r < world_size; ++r) {
    const RankShard& rank = ranks[r];
    const WorldSpec::Rank* spec = r < world.world_size() ? &world.ranks[r] : nullptr;
    std::vector<std::string> row;
    row.push_back(absl::StrCat(r));
    row.push_back(spec != nullptr && spec->box >= 0 &&
                          spec->box < static_cast<int>(world.boxes.size())
                      ? world.boxes[spec->box]
                      : std::string("?"));
    row.push_back(spec == nullptr || spec->device < 0 ? std::string("cpu")
                                                      : absl::StrCat("gpu", spec->device));
    row.push_back(absl::StrFormat("%.2f", spec != nullptr ? spec->capacity : 0.0));
    if (num_layers > 0) {
      const LayerShard& a = rank.layers[0];
      row.push_back(RangeText(a.q_heads) + (a.o_bias ? "*" : ""));
      row.push_back(RangeText(a.kv_heads));
    }
    if (linear_attention) row.push_back(RangeText(rank.layers[0].linear_key_heads));
    if (first_dense >= 0) {
      const LayerShard& d = rank.layers[first_dense];
      row.push_back(RangeText(d.mlp_channels) + (d.down_bias ? "*" : ""));
    }
    if (first_moe >= 0) {
      const LayerShard& m = rank.layers[first_moe];
      row.push_back(RangeText(m.experts));
      row.push_back(RangeText(m.expert_channels) + (m.expert_down_bias ? "*" : ""));
    }
    row.push_back(RangeText(rank.vocab));
    row.push_back(absl::StrCat(rank.weight_bytes));
    row.push_back(absl::StrFormat("%.2f", static_cast<double>(rank.weight_bytes) / kMiB));
    row.push_back(absl::StrFormat("%.2f", static_cast<double>(rank.replicated_bytes) / kMiB));
    for (size_t c = 0; c < columns.size(); ++c) columns[c].cells.push_back(row[c]);
    sum += rank.weight_bytes;
    largest = std::max(largest, rank.weight_bytes);
  }
  std::vector<size_t> width(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    width[c] = columns[c].header.size();
    for (const std::string& cell : columns[c].cells) width[c] = std::max(width[c], cell.size());
  }
  auto append_row = [&](auto cell_of) {
    std::string line;
    for (size_t c = 0; c < columns.size(); ++c) {
      const std::string cell = cell_of(c);
      const std::string pad(width[c] - cell.size(), ' ');
      if (c > 0) line += "  ";
      line += columns[c].left ? cell + pad : pad + cell;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  };
  append_row([&](size_t c) { return columns[c].header; });
  for (int r = 0; r < world_size; ++r) {
    append_row([&](size_t c) { return columns[c].cells[r]; });
  }
  absl::StrAppendFormat(&out,
                        "\nmodel: %d bytes (%.2f MiB); all ranks together: %d bytes (%.2f MiB, "
                        "%.2fx the model); largest rank: %d bytes (%.2f MiB)\n",
                        total_bytes, static_cast<double>(total_bytes) / kMiB, sum,
                        static_cast<double>(sum) / kMiB,
                        total_bytes > 0 ? static_cast<double>(sum) / static_cast<double>(total_bytes)
                                        : 0.0,
                        largest, static_cast<double>(largest) / kMiB);
  return out;
}

std::vector<SpillCandidate> RowTableCandidates(const RankShard& rank) {
  std::vector<SpillCandidate> candidates;
  for (const RowTableShard& t : rank.row_tables) candidates.push_back({t.name, t.resident_bytes});
  return candidates;
}

uint64_t OtherResidentBytes(const RankShard& rank) {
  uint64_t tables = 0;
  for (const RowTableShard& t : rank.row_tables) tables += t.stored_bytes;
  return rank.weight_bytes > tables ? rank.weight_bytes - tables : 0;
}

absl::Status PlanRowTables(const SpillPolicy& policy, ShardPlan* plan) {
  for (RankShard& rank : plan->ranks) {
    const std::vector<SpillCandidate> candidates = RowTableCandidates(rank);
    absl::StatusOr<std::vector<std::string>> spilled =
        ChooseSpilledTensors(policy, candidates, OtherResidentBytes(rank));
    if (!spilled.ok()) {
      const WorldSpec::Rank& spec = plan->world.ranks[rank.rank];
      const std::string box = spec.box >= 0 && spec.box < static_cast<int>(plan->world.boxes.size())
                                  ? plan->world.boxes[spec.box]
                                  : "?";
      return absl::Status(spilled.status().code(),
                          absl::StrCat("rank ", rank.rank, " (box ", box,
                                       "): ", spilled.status().message()));
    }
    for (RowTableShard& t : rank.row_tables) {
      t.spilled = std::find(spilled->begin(), spilled->end(), t.name) != spilled->end();
    }
  }
  return absl::OkStatus();
}

std::string DescribeRowTables(const ShardPlan& plan) {
  std::string out = "row tables (per rank: resident in memory as fp32, or spilled = read from the box's disk):\n";
  struct BoxTotals {
    uint64_t resident = 0, spilled = 0;
  };
  std::vector<BoxTotals> boxes(plan.world.boxes.size());
  for (const RankShard& rank : plan.ranks) {
    const int box = plan.world.ranks[rank.rank].box;
    const bool known = box >= 0 && box < static_cast<int>(boxes.size());
    for (const RowTableShard& t : rank.row_tables) {
      absl::StrAppendFormat(&out, "  rank %d (box %s): %s [%d x %d] %s %d bytes (stored %d)\n",
                            rank.rank, known ? plan.world.boxes[box] : "?", t.name, t.rows,
                            t.width, t.spilled ? "spilled" : "resident",
                            t.spilled ? t.stored_bytes : t.resident_bytes, t.stored_bytes);
      if (!known) continue;
      (t.spilled ? boxes[box].spilled : boxes[box].resident) +=
          t.spilled ? t.stored_bytes : t.resident_bytes;
    }
  }
  for (size_t b = 0; b < boxes.size(); ++b) {
    absl::StrAppendFormat(&out, "  box %s: tables resident %d bytes, spilled (on local disk) %d bytes\n",
                          plan.world.boxes[b], boxes[b].resident, boxes[b].spilled);
  }
  return out;
}

}  // namespace exl3serve::sharding
