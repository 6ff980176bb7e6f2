#include "worker/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker {
namespace {

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::DataLossError(absl::StrCat(path, ": not valid JSON"));
  return json;
}

absl::StatusOr<std::vector<float>> LoadVector(const sharding::Exl3Model& model,
                                              const std::string& name, int64_t size) {
  const sharding::PlainTensorInfo* info = model.FindPlain(name);
  if (info == nullptr) return absl::NotFoundError(absl::StrCat(model.dir(), ": no tensor `", name, "`"));
  if (info->shape.size() != 1 || info->shape[0] != size) {
    return absl::DataLossError(
        absl::StrCat(model.dir(), ": tensor `", name, "` must have shape [", size, "]"));
  }
  return model.LoadTensorAsFloat(name);
}

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// GPT-J (interleaved) RoPE on dims [offset, offset + rot) of every head of
// x [tokens][heads][head_stride]: pair (offset + 2i, offset + 2i + 1) of the
// token at positions[t] turns by positions[t]·inv_freq[i], with cos and sin
// multiplied by `scale` (YaRN's attention factor). This is transformers'
// apply_rotary_pos_emb_interleave up to the order of the rotated dims, which
// it de-interleaves into [evens | odds] in q and k alike (dot products, all
// attention sees of them, are the same).
void ApplyInterleavedRope(float* x, int64_t tokens, int64_t heads, int64_t head_stride,
                          int64_t offset, int64_t rot, const int64_t* positions,
                          const double* inv_freq, double scale) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = x + t * heads * head_stride + offset;
    for (int64_t i = 0; i < rot / 2; ++i) {
      const double angle = static_cast<double>(positions[t]) * inv_freq[i];
      const float c = static_cast<float>(std::cos(angle) * scale);
      const float sn = static_cast<float>(std::sin(angle) * scale);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + h * head_stride + 2 * i;
        const float x1 = v[0], x2 = v[1];
        v[0] = x1 * c - x2 * sn;
        v[1] = x2 * c + x1 * sn;
      }
    }
  }
}

// The whole model as one rank's shard (no parallelism).
sharding::RankShard WholeModelShard(const sharding::ModelArch& arch) {
  sharding::RankShard shard;
  shard.layers.resize(arch.num_layers);
  for (int l = 0; l < arch.num_layers; ++l) {
    sharding::LayerShard& layer = shard.layers[l];
    layer.q_heads = {0, arch.num_attention_heads};
    layer.kv_heads = {0, arch.num_key_value_heads};
    layer.o_bias = layer.down_bias = layer.expert_down_bias = true;
    // MoE layers: the shared expert's channels (none without one).
    layer.mlp_channels = {0, arch.layer_is_moe[l] ? arch.shared_expert_intermediate_size
                                                  : arch.intermediate_size};
    layer.experts = {0, arch.num_experts};
    layer.expert_channels = {0, arch.moe_intermediate_size};
  }
  shard.vocab = {0, arch.vocab_size};
  return shard;
}

}  // namespace

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& dir) {
  EXL3_ASSIGN_OR_RETURN(nlohmann::json config_json, ReadJsonFile(dir + "/config.json"));
  std::optional<nlohmann::json> generation;
  if (absl::StatusOr<nlohmann::json> g = ReadJsonFile(dir + "/generation_config.json"); g.ok()) {
    generation = std::move(*g);
  }
  return ModelConfigFromJson(config_json, generation ? &*generation : nullptr);
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(const std::string& dir) {
  return LoadImpl(dir, nullptr, TransformerLoadOptions{});
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(
    const std::string& dir, const TransformerLoadOptions& options) {
  return LoadImpl(dir, nullptr, options);
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::LoadShard(const std::string& dir,
                                                                    const TensorParallelism& tp) {
  if (tp.comm == nullptr) {
    return absl::InvalidArgumentError("tensor parallelism needs a communicator");
  }
  return LoadShard(dir, tp, TransformerLoadOptions{});
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::LoadShard(
    const std::string& dir, const TensorParallelism& tp, const TransformerLoadOptions& options) {
  if (tp.comm == nullptr) {
    return absl::InvalidArgumentError("tensor parallelism needs a communicator");
  }
  return LoadImpl(dir, &tp, options);
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::LoadImpl(
    const std::string& dir, const TensorParallelism* tp, const TransformerLoadOptions& options) {
  std::unique_ptr<Transformer> model(new Transformer());
  EXL3_ASSIGN_OR_RETURN(model->config_, ReadModelConfig(dir));
  if (!model->config_.arch.mla() && model->config_.arch.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": head_dim must be even for RoPE, got ", model->config_.arch.head_dim));
  }
  model->rope_inv_freq_ = RopeInverseFrequencies(model->config_);
  if (model->config_.arch.num_mtp_layers > 0) {
    EXL3_LOG(kInfo) << dir << ": skipping " << model->config_.arch.num_mtp_layers
                    << " next-token-prediction (MTP) layer(s) after layer "
                    << model->config_.arch.num_layers - 1 << " (num_nextn_predict_layers)";
  }
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<sharding::Exl3Model> checkpoint,
                        sharding::Exl3Model::Open(dir));
  if (tp != nullptr) {
    model->comm_ = tp->comm;
    model->collective_timeout_ = tp->collective_timeout;
    EXL3_RETURN_IF_ERROR(model->LoadWeights(*checkpoint, tp->shard, options));
  } else {
    EXL3_RETURN_IF_ERROR(
        model->LoadWeights(*checkpoint, WholeModelShard(model->config_.arch), options));
  }
  model->bytes_read_ = checkpoint->bytes_read();
  return model;
}

absl::Status Transformer::LoadWeights(const sharding::Exl3Model& model,
                                      const sharding::RankShard& shard,
                                      const TransformerLoadOptions& options) {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  const int64_t hd = arch.head_dim;
  const bool whole = comm_ == nullptr;
  if (static_cast<int>(shard.layers.size()) != arch.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan has ", shard.layers.size(),
                                                   " layers, the model ", arch.num_layers));
  }
  auto check = [&](const sharding::IndexRange& r, int64_t limit,
                   const char* what) -> absl::Status {
    if (r.begin < 0 || r.begin > r.end || r.end > limit) {
      return absl::InvalidArgumentError(absl::StrCat("shard plan: ", what, " [", r.begin, ", ",
                                                     r.end, ") outside [0, ", limit, ")"));
    }
    return absl::OkStatus();
  };
  // A linear whole (single rank) or as this rank's window.
  auto load = [&](const sharding::LinearSpec* s, sharding::IndexRange in,
                  sharding::IndexRange out, bool bias) -> absl::StatusOr<Linear> {
    absl::StatusOr<Linear> linear =
        whole ? Linear::Load(model, s->key, s->in_features, s->out_features)
              : Linear::LoadWindow(model, s->key, s->in_features, s->out_features, in.begin,
                                   in.end, out.begin, out.end, bias);
    if (linear.ok()) linear->set_key(s->key);
    return linear;
  };
  auto spec = [&](int layer, sharding::LinearRole role, int expert) {
    return arch.Find(layer, role, expert);
  };
  using sharding::IndexRange;
  using sharding::LinearRole;
  const IndexRange all_hidden{0, hidden};
  layers_.resize(arch.num_layers);
  for (int l = 0; l < arch.num_layers; ++l) {
    Layer& layer = layers_[l];
    const sharding::LayerShard& part = shard.layers[l];
    EXL3_RETURN_IF_ERROR(check(part.q_heads, arch.num_attention_heads, "query heads"));
    EXL3_RETURN_IF_ERROR(check(part.kv_heads, arch.num_key_value_heads, "kv heads"));
    const int64_t group = arch.num_attention_heads / arch.num_key_value_heads;
    if (!part.q_heads.empty() &&
        (part.q_heads.begin / group < part.kv_heads.begin ||
         (part.q_heads.end - 1) / group >= part.kv_heads.end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard plan: layer ", l, ": kv heads [", part.kv_heads.begin, ", ",
                       part.kv_heads.end, ") do not cover the query heads' kv heads"));
    }
    if (part.kv_heads.size() != shard.layers[0].kv_heads.size()) {
      return absl::UnimplementedError(
          "shard plan: the number of kv heads per rank must be the same in every layer");
    }
    layer.q_head_begin = part.q_heads.begin;
    layer.num_q_heads = part.q_heads.size();
    layer.kv_head_begin = part.kv_heads.begin;
    layer.num_kv_heads = part.kv_heads.size();
    const std::string prefix = absl::StrCat("model.layers.", l);
    EXL3_ASSIGN_OR_RETURN(layer.input_norm, LoadVector(model, prefix + ".input_layernorm.weight", hidden));
    EXL3_ASSIGN_OR_RETURN(layer.post_attention_norm,
                          LoadVector(model, prefix + ".post_attention_layernorm.weight", hidden));
    if (config_.qk_norm) {
      EXL3_ASSIGN_OR_RETURN(layer.q_norm,
                            LoadVector(model, prefix + ".self_attn.q_norm.weight", hd));
      EXL3_ASSIGN_OR_RETURN(layer.k_norm,
                            LoadVector(model, prefix + ".self_attn.k_norm.weight", hd));
    }
    const IndexRange q_channels{part.q_heads.begin * hd, part.q_heads.end * hd};
    const IndexRange kv_channels{part.kv_heads.begin * hd, part.kv_heads.end * hd};
    if (arch.mla()) {
      // architectures.md §2.4, §2.5: the down-projections of the layer input
      // and the latent norm on every rank (each rank writes its own copy of
      // the latent cache); q_b (or q), kv_b and o by this rank's query heads.
      const int64_t n = arch.qk_nope_head_dim, r = arch.qk_rope_head_dim;
      const int64_t vd = arch.v_head_dim, dc = arch.kv_lora_rank;
      const IndexRange heads = part.q_heads;
      const IndexRange q_cols{heads.begin * (n + r), heads.end * (n + r)};
      if (arch.q_lora_rank > 0) {
        const IndexRange rank_cols{0, arch.q_lora_rank};
        EXL3_ASSIGN_OR_RETURN(layer.q_a,
                              load(spec(l, LinearRole::kQA, -1), all_hidden, rank_cols, true));
        EXL3_ASSIGN_OR_RETURN(layer.q_a_norm,
                              LoadVector(model, prefix + ".self_attn.q_a_layernorm.weight",
                                         arch.q_lora_rank));
        if (!heads.empty()) {
          EXL3_ASSIGN_OR_RETURN(layer.q_b,
                                load(spec(l, LinearRole::kQB, -1), rank_cols, q_cols, true));
        }
      } else if (!heads.empty()) {
        EXL3_ASSIGN_OR_RETURN(layer.q, load(spec(l, LinearRole::kQ, -1), all_hidden, q_cols, true));
      }
      EXL3_ASSIGN_OR_RETURN(layer.kv_a, load(spec(l, LinearRole::kKVA, -1), all_hidden,
                                             IndexRange{0, dc + r}, true));
      EXL3_ASSIGN_OR_RETURN(layer.kv_a_norm,
                            LoadVector(model, prefix + ".self_attn.kv_a_layernorm.weight", dc));
      if (!heads.empty()) {
        EXL3_ASSIGN_OR_RETURN(layer.kv_b,
                              load(spec(l, LinearRole::kKVB, -1), IndexRange{0, dc},
                                   IndexRange{heads.begin * (n + vd), heads.end * (n + vd)}, true));
        // W = kv_b's weight [out][dc], read as the linear's answer to the
        // identity (exact for a 16-bit weight, also right for an EXL3 one).
        const int64_t rows = heads.size() * (n + vd);
        std::vector<float> identity(static_cast<size_t>(dc * dc), 0.0f), wt(dc * rows);
        for (int64_t i = 0; i < dc; ++i) identity[i * dc + i] = 1.0f;
        EXL3_RETURN_IF_ERROR(layer.kv_b.Forward(identity.data(), dc, wt.data()));
        // Held once, as fp32 [out][dc]: the prefill path runs it as a linear,
        // the absorbed decode reads its rows (kv_b.dense_weight()).
        std::vector<float> w(static_cast<size_t>(rows * dc));
        for (int64_t i = 0; i < dc; ++i) {
          for (int64_t o = 0; o < rows; ++o) w[o * dc + i] = wt[i * rows + o];
        }
        layer.kv_b = Linear::FromDense(std::move(w), dc, rows, {});
        layer.kv_b.set_key(spec(l, LinearRole::kKVB, -1)->key);
        EXL3_ASSIGN_OR_RETURN(layer.o, load(spec(l, LinearRole::kO, -1),
                                            IndexRange{heads.begin * vd, heads.end * vd},
                                            all_hidden, part.o_bias));
      }
    } else {
    EXL3_ASSIGN_OR_RETURN(layer.q, load(spec(l, LinearRole::kQ, -1), all_hidden, q_channels, true));
    EXL3_ASSIGN_OR_RETURN(layer.k, load(spec(l, LinearRole::kK, -1), all_hidden, kv_channels, true));
    EXL3_ASSIGN_OR_RETURN(layer.v, load(spec(l, LinearRole::kV, -1), all_hidden, kv_channels, true));
    EXL3_ASSIGN_OR_RETURN(layer.o,
                          load(spec(l, LinearRole::kO, -1), q_channels, all_hidden, part.o_bias));
    }
    layer.moe = arch.layer_is_moe[l];
    if (!layer.moe) {
      EXL3_RETURN_IF_ERROR(check(part.mlp_channels, arch.intermediate_size, "mlp channels"));
      EXL3_ASSIGN_OR_RETURN(layer.gate, load(spec(l, LinearRole::kGate, -1), all_hidden,
                                             part.mlp_channels, true));
      EXL3_ASSIGN_OR_RETURN(layer.up, load(spec(l, LinearRole::kUp, -1), all_hidden,
                                           part.mlp_channels, true));
      EXL3_ASSIGN_OR_RETURN(layer.down, load(spec(l, LinearRole::kDown, -1), part.mlp_channels,
                                             all_hidden, part.down_bias));
      continue;
    }
    EXL3_RETURN_IF_ERROR(check(part.experts, arch.num_experts, "experts"));
    EXL3_RETURN_IF_ERROR(
        check(part.expert_channels, arch.moe_intermediate_size, "expert channels"));
    // The router is replicated: every rank routes every token itself (the
    // inputs are bit-identical, so every rank picks the same experts).
    EXL3_ASSIGN_OR_RETURN(layer.router, load(spec(l, LinearRole::kRouter, -1), all_hidden,
                                             IndexRange{0, arch.num_experts}, true));
    if (config_.moe_router == MoeRouter::kSigmoidGrouped) {
      EXL3_ASSIGN_OR_RETURN(layer.score_bias,
                            LoadVector(model, prefix + ".mlp.gate.e_score_correction_bias",
                                       arch.num_experts));
    }
    if (arch.shared_expert_intermediate_size > 0) {
      EXL3_RETURN_IF_ERROR(
          check(part.mlp_channels, arch.shared_expert_intermediate_size, "shared expert channels"));
      layer.has_shared = !part.mlp_channels.empty();
      if (layer.has_shared) {
        const int e = sharding::kSharedExpert;
        EXL3_ASSIGN_OR_RETURN(layer.shared.gate, load(spec(l, LinearRole::kGate, e), all_hidden,
                                                      part.mlp_channels, true));
        EXL3_ASSIGN_OR_RETURN(layer.shared.up, load(spec(l, LinearRole::kUp, e), all_hidden,
                                                    part.mlp_channels, true));
        EXL3_ASSIGN_OR_RETURN(layer.shared.down, load(spec(l, LinearRole::kDown, e),
                                                      part.mlp_channels, all_hidden,
                                                      part.down_bias));
      }
    }
    layer.expert_begin = part.experts.begin;
    layer.experts.resize(part.experts.size());
    for (int64_t i = 0; i < part.experts.size(); ++i) {
      const int e = static_cast<int>(part.experts.begin + i);
      Expert& expert = layer.experts[i];
      EXL3_ASSIGN_OR_RETURN(expert.gate, load(spec(l, LinearRole::kGate, e), all_hidden,
                                              part.expert_channels, true));
      EXL3_ASSIGN_OR_RETURN(expert.up, load(spec(l, LinearRole::kUp, e), all_hidden,
                                            part.expert_channels, true));
      EXL3_ASSIGN_OR_RETURN(expert.down, load(spec(l, LinearRole::kDown, e), part.expert_channels,
                                              all_hidden, part.expert_down_bias));
    }
  }
  EXL3_ASSIGN_OR_RETURN(final_norm_, LoadVector(model, "model.norm.weight", hidden));
  // Expert load counters (metrics): the experts this rank holds in any layer.
  if (arch.num_experts > 0) {
    expert_tokens_ = std::make_unique<std::atomic<uint64_t>[]>(arch.num_experts);
    expert_held_.assign(arch.num_experts, false);
    for (const Layer& layer : layers_) {
      for (size_t i = 0; i < layer.experts.size(); ++i) expert_held_[layer.expert_begin + i] = true;
    }
  }

  // The head: lm_head when the checkpoint has one (also when tied), else the
  // token embedding. A single rank shares the embedding with a tied head
  // rather than holding it twice; a rank of a group holds the whole
  // embedding (replicated) and only its vocab rows of the head.
  EXL3_RETURN_IF_ERROR(check(shard.vocab, arch.vocab_size, "vocab rows"));
  vocab_ = shard.vocab;
  const bool has_head = model.FindLinear("lm_head") != nullptr || model.FindPlain("lm_head.weight");
  if (!has_head && !arch.tie_word_embeddings) {
    return absl::NotFoundError(
        absl::StrCat(model.dir(), ": no `lm_head` and tie_word_embeddings is false"));
  }
  // A spilled embedding (TransformerLoadOptions::spill) stays on disk; the
  // head below is loaded as without spilling (a tied head stays resident).
  constexpr char kEmbedName[] = "model.embed_tokens.weight";
  const uint64_t embed_resident_bytes = static_cast<uint64_t>(arch.vocab_size * hidden) * 4;
  const sharding::SpillCandidate embed_candidate{kEmbedName, embed_resident_bytes};
  const uint64_t stored = model.checkpoint().total_tensor_bytes();
  // Everything else counts as resident at its stored size (as the planner,
  // sharding::PlanRowTables, counts a rank's weight_bytes).
  const sharding::PlainTensorInfo* embed_info = model.FindPlain(kEmbedName);
  const uint64_t embed_stored = embed_info != nullptr ? embed_info->stored_bytes : 0;
  std::vector<sharding::SpillCandidate> candidates = {embed_candidate};
  uint64_t other_resident = stored > embed_stored ? stored - embed_stored : 0;
  if (!whole && !shard.row_tables.empty()) {
    // A rank decides from its own shard, as the planner does (PlanRowTables).
    candidates = sharding::RowTableCandidates(shard);
    other_resident = sharding::OtherResidentBytes(shard);
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<std::string> spilled,
                        sharding::ChooseSpilledTensors(options.spill, candidates, other_resident));
  if (std::find(spilled.begin(), spilled.end(), std::string(kEmbedName)) == spilled.end()) {
    spilled.clear();
  }
  if (!spilled.empty()) {
    std::optional<sharding::SafetensorsCheckpoint::Located> located =
        model.checkpoint().Find(kEmbedName);
    if (!located) return absl::NotFoundError(absl::StrCat(model.dir(), ": no `", kEmbedName, "`"));
    EXL3_ASSIGN_OR_RETURN(embed_spill_, sharding::SpillStore::Open(*located->file, kEmbedName,
                                                                   options.spill.StoreOptions()));
    if (embed_spill_->rows() != arch.vocab_size || embed_spill_->width() != hidden) {
      return absl::DataLossError(absl::StrCat(model.dir(), ": tensor `", kEmbedName,
                                              "` must have shape [", arch.vocab_size, ",", hidden,
                                              "]"));
    }
  } else if (has_head || !whole) {
    EXL3_ASSIGN_OR_RETURN(Linear embed, Linear::LoadPlain(model, "model.embed_tokens.weight",
                                                          hidden, arch.vocab_size));
    embed_.resize(static_cast<size_t>(arch.vocab_size * hidden));
    embed.DenseRowsToFloat(0, arch.vocab_size, embed_.data());
  }
  if (has_head) {
    EXL3_ASSIGN_OR_RETURN(head_, load(spec(-1, LinearRole::kHead, -1), all_hidden, vocab_, true));
  } else if (whole) {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::LoadPlain(model, "model.embed_tokens.weight", hidden,
                                                   arch.vocab_size));
  } else {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::LoadWindow(model, "model.embed_tokens", hidden,
                                                    arch.vocab_size, 0, hidden, vocab_.begin,
                                                    vocab_.end, false));
  }
  head_.set_key("lm_head");
  return absl::OkStatus();
}

std::vector<Transformer::SpillTableStats> Transformer::spill_stats() const {
  std::vector<SpillTableStats> out;
  if (embed_spill_ != nullptr) out.push_back({"model.embed_tokens.weight", embed_spill_->stats()});
  return out;
}

std::vector<std::pair<int, uint64_t>> Transformer::expert_tokens() const {
  std::vector<std::pair<int, uint64_t>> out;
  for (size_t e = 0; e < expert_held_.size(); ++e) {
    if (expert_held_[e]) {
      out.emplace_back(static_cast<int>(e), expert_tokens_[e].load(std::memory_order_relaxed));
    }
  }
  return out;
}

absl::Status Transformer::AllReduce(std::vector<float>& data) const {
  if (comm_ == nullptr) return absl::OkStatus();
  return comm_->AllReduce(data.data(), data.size(), comm::CommDataType::kF32,
                          absl::Now() + collective_timeout_);
}

absl::Status Transformer::GatherLogits(std::vector<float>& local, int64_t rows,
                                       std::vector<float>* logits) const {
  const int64_t vocab = config_.arch.vocab_size;
  logits->resize(static_cast<size_t>(rows * vocab));
  if (comm_ == nullptr) {
    *logits = std::move(local);
    return absl::OkStatus();
  }
  // Every rank's block is rows x (its vocab rows); the ranks' vocab ranges
  // tile [0, vocab) in rank order (vocab-parallel) or are all whole
  // (replicated head: nothing to gather).
  if (vocab_.size() == vocab) {
    *logits = std::move(local);
    return absl::OkStatus();
  }
  const int world = comm_->world_size();
  std::vector<int64_t> sizes(world);
  int64_t mine = vocab_.size();
  EXL3_RETURN_IF_ERROR(comm_->AllGather(&mine, sizeof(mine), sizes.data(),
                                        absl::Now() + collective_timeout_));
  std::vector<size_t> bytes(world);
  int64_t covered = 0;
  for (int r = 0; r < world; ++r) {
    bytes[r] = static_cast<size_t>(rows * sizes[r]) * sizeof(float);
    covered += sizes[r];
  }
  if (covered != vocab) {
    return absl::InternalError(absl::StrCat("vocab-parallel head: the ranks hold ", covered,
                                            " of ", vocab, " vocab rows"));
  }
  std::vector<float> gathered(static_cast<size_t>(rows * vocab));
  EXL3_RETURN_IF_ERROR(comm_->AllGatherV(local.data(), bytes, gathered.data(),
                                         absl::Now() + collective_timeout_));
  int64_t offset = 0, column = 0;
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(logits->data() + i * vocab + column, gathered.data() + offset + i * sizes[r],
                  sizeof(float) * sizes[r]);
    }
    offset += rows * sizes[r];
    column += sizes[r];
  }
  return absl::OkStatus();
}

void Transformer::SetInputObserver(InputObserver* observer) {
  for (Layer& layer : layers_) {
    for (Linear* l : {&layer.q, &layer.k, &layer.v, &layer.o, &layer.gate, &layer.up, &layer.down,
                      &layer.router, &layer.q_a, &layer.q_b, &layer.kv_a, &layer.kv_b}) {
      l->set_input_observer(observer);
    }
    for (Expert& e : layer.experts) {
      for (Linear* l : {&e.gate, &e.up, &e.down}) l->set_input_observer(observer);
    }
    // The shared expert (GLM, DeepSeek) too: without it convert --calib had
    // no Hessian for shared_experts.* and quantized them uncalibrated.
    for (Linear* l : {&layer.shared.gate, &layer.shared.up, &layer.shared.down}) {
      l->set_input_observer(observer);
    }
  }
  head_.set_input_observer(observer);
}

absl::StatusOr<PagedKvCache> Transformer::CreateKvCache(const KvCacheOptions& options) const {
  KvCacheShape shape;
  shape.num_layers = config_.arch.num_layers;
  shape.num_kv_heads = static_cast<int>(layers_.empty() ? config_.arch.num_key_value_heads
                                                        : layers_[0].num_kv_heads);
  shape.head_dim = static_cast<int>(config_.arch.head_dim);
  if (config_.arch.mla()) {
    // One latent "head" per position on every rank: c_kv as the key, k_pe
    // as the value (kv_cache.h KvCacheShape::value_dim).
    shape.num_kv_heads = 1;
    shape.head_dim = static_cast<int>(config_.arch.kv_lora_rank);
    shape.value_dim = static_cast<int>(config_.arch.qk_rope_head_dim);
  }
  return PagedKvCache::Create(shape, options);
}

absl::Status Transformer::Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                                  PagedKvCache* cache, std::vector<float>* logits) const {
  return ForwardImpl(batch, rows, {}, cache, /*gather_logits=*/true, logits);
}

absl::Status Transformer::ForwardVocabSlice(std::span<const SequenceTokens> batch,
                                            LogitsRows rows, PagedKvCache* cache,
                                            std::vector<float>* slice_logits) const {
  return ForwardImpl(batch, rows, {}, cache, /*gather_logits=*/false, slice_logits);
}

absl::Status Transformer::ForwardVocabSliceLastRows(std::span<const SequenceTokens> batch,
                                                    std::span<const int32_t> last_rows,
                                                    PagedKvCache* cache,
                                                    std::vector<float>* slice_logits) const {
  if (last_rows.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat("forward: ", last_rows.size(),
                                                   " logits row counts for ", batch.size(),
                                                   " batch entries"));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (last_rows[i] < 0 || last_rows[i] > static_cast<int64_t>(batch[i].tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "forward: sequence ", batch[i].seq_id, " asks for ", last_rows[i],
          " logits rows of its ", batch[i].tokens.size(), " tokens"));
    }
  }
  return ForwardImpl(batch, LogitsRows::kLastToken, last_rows, cache, /*gather_logits=*/false,
                     slice_logits);
}

absl::Status Transformer::ForwardImpl(std::span<const SequenceTokens> batch, LogitsRows rows,
                                      std::span<const int32_t> last_rows, PagedKvCache* cache,
                                      bool gather_logits, std::vector<float>* logits) const {
  const sharding::ModelArch& arch = config_.arch;
  if (batch.empty()) return absl::InvalidArgumentError("forward: empty batch");
  absl::flat_hash_set<int64_t> seen;
  int64_t total = 0;
  std::vector<int64_t> starts;
  for (const SequenceTokens& entry : batch) {
    if (entry.tokens.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: sequence ", entry.seq_id, " has no new tokens"));
    }
    if (!seen.insert(entry.seq_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: sequence ", entry.seq_id, " appears twice in the batch"));
    }
    if (!cache->HasSequence(entry.seq_id)) {
      return absl::NotFoundError(absl::StrCat("forward: sequence ", entry.seq_id,
                                              " is not in the kv cache"));
    }
    for (int32_t id : entry.tokens) {
      if (id < 0 || id >= arch.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("forward: sequence ", entry.seq_id,
                                                       ": token id ", id, " is outside [0, ",
                                                       arch.vocab_size, ")"));
      }
    }
    starts.push_back(cache->Length(entry.seq_id));
    total += static_cast<int64_t>(entry.tokens.size());
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    EXL3_RETURN_IF_ERROR(cache->Reserve(
        batch[i].seq_id, starts[i] + static_cast<int64_t>(batch[i].tokens.size())));
  }

  // Past validation every rank of a group runs the same collectives; a
  // failure on this rank alone (a kernel error) aborts the group so the peers
  // fail now instead of at their deadline.
  absl::Status status =
      RunLayers(batch, rows, last_rows, cache, starts, total, gather_logits, logits);
  if (!status.ok()) {
    if (comm_ != nullptr) comm_->Abort(status);
    return status;
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    cache->SetLength(batch[i].seq_id, starts[i] + static_cast<int64_t>(batch[i].tokens.size()));
  }
  return absl::OkStatus();
}

absl::Status Transformer::RunLayers(std::span<const SequenceTokens> batch, LogitsRows rows,
                                    std::span<const int32_t> last_rows, PagedKvCache* cache,
                                    const std::vector<int64_t>& starts, int64_t total,
                                    bool gather_logits, std::vector<float>* logits) const {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  const int64_t hd = arch.head_dim;
  // This rank's heads (all of them on a single rank): buffers are sized for
  // the layer with the most; every layer has as many kv heads as layer 0.
  int64_t nh = 0, nkv = layers_.empty() ? 0 : layers_[0].num_kv_heads;
  for (const Layer& layer : layers_) nh = std::max(nh, layer.num_q_heads);
  // h: the residual stream, one row per new token in batch order.
  // Tied, one rank: the rows come from the head (held in 16 bits or fp32).
  const float* embed = embed_.empty() ? nullptr : embed_.data();
  std::vector<float> h(static_cast<size_t>(total * hidden));
  if (embed_spill_ != nullptr) {
    // The whole batch's rows in one gather (sorted, coalesced reads).
    std::vector<int64_t> ids;
    ids.reserve(static_cast<size_t>(total));
    for (const SequenceTokens& entry : batch) ids.insert(ids.end(), entry.tokens.begin(), entry.tokens.end());
    EXL3_RETURN_IF_ERROR(embed_spill_->Lookup(ids, h.data()));
  } else {
    int64_t row = 0;
    for (const SequenceTokens& entry : batch) {
      for (int32_t id : entry.tokens) {
        if (embed != nullptr) {
          std::memcpy(&h[row++ * hidden], embed + int64_t{id} * hidden, sizeof(float) * hidden);
        } else {
          head_.DenseRowsToFloat(id, 1, &h[row++ * hidden]);
        }
      }
    }
  }
  std::vector<float> a(h.size()), q(total * nh * hd), k(total * nkv * hd), v(total * nkv * hd);
  const int64_t attn_width = std::max(hd, arch.mla() ? arch.v_head_dim : int64_t{0});
  std::vector<float> attn(total * nh * attn_width), delta(h.size());
  // Each entry's rows run at the precision the entry would get alone
  // (linear.h, RowKind), whatever else shares the step.
  std::vector<RowRun> plan;
  for (const SequenceTokens& entry : batch) {
    const int64_t n = static_cast<int64_t>(entry.tokens.size());
    AppendRowRun(&plan, n, RowKindForRows(n));
  }
  for (int l = 0; l < arch.num_layers; ++l) {
    const Layer& layer = layers_[l];
    a = h;
    EXL3_RETURN_IF_ERROR(kernels::RmsNorm(a.data(), total, hidden, layer.input_norm.data(),
                                          config_.rms_norm_eps, a.data()));
    if (arch.mla()) {
      EXL3_RETURN_IF_ERROR(MlaAttention(batch, l, cache, starts, a, total, plan, &attn));
      if (layer.num_q_heads > 0) {
        EXL3_RETURN_IF_ERROR(layer.o.Forward(attn.data(), total, delta.data(), plan));
      } else {
        std::fill(delta.begin(), delta.end(), 0.0f);  // no heads here: nothing to add
      }
    } else {
      EXL3_RETURN_IF_ERROR(layer.q.Forward(a.data(), total, q.data(), plan));
      EXL3_RETURN_IF_ERROR(layer.k.Forward(a.data(), total, k.data(), plan));
      EXL3_RETURN_IF_ERROR(layer.v.Forward(a.data(), total, v.data(), plan));
      EXL3_RETURN_IF_ERROR(Attention(batch, l, cache, starts, q, k, v, &attn));
      EXL3_RETURN_IF_ERROR(layer.o.Forward(attn.data(), total, delta.data(), plan));
    }
    EXL3_RETURN_IF_ERROR(AllReduce(delta));
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
    a = h;
    EXL3_RETURN_IF_ERROR(kernels::RmsNorm(a.data(), total, hidden,
                                          layer.post_attention_norm.data(), config_.rms_norm_eps,
                                          a.data()));
    EXL3_RETURN_IF_ERROR(Mlp(layer, a, total, plan, &delta));
    EXL3_RETURN_IF_ERROR(AllReduce(delta));
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
  }

  // Final norm and head on the rows asked for, each at its entry's kind.
  std::vector<float> selected;
  std::vector<RowRun> head_plan;
  int64_t out_rows = 0;
  if (!last_rows.empty()) {
    int64_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
      row += n;
      selected.insert(selected.end(), h.begin() + (row - last_rows[i]) * hidden,
                      h.begin() + row * hidden);
      out_rows += last_rows[i];
      AppendRowRun(&head_plan, last_rows[i], RowKindForRows(n));
    }
  } else if (rows == LogitsRows::kAllTokens) {
    selected = std::move(h);
    out_rows = total;
    head_plan = plan;
  } else {
    int64_t row = 0;
    for (const SequenceTokens& entry : batch) {
      const int64_t n = static_cast<int64_t>(entry.tokens.size());
      row += n;
      selected.insert(selected.end(), h.begin() + (row - 1) * hidden, h.begin() + row * hidden);
      ++out_rows;
      AppendRowRun(&head_plan, 1, RowKindForRows(n));
    }
  }
  EXL3_RETURN_IF_ERROR(kernels::RmsNorm(selected.data(), out_rows, hidden, final_norm_.data(),
                                        config_.rms_norm_eps, selected.data()));
  std::vector<float> local(static_cast<size_t>(out_rows * vocab_.size()));
  EXL3_RETURN_IF_ERROR(head_.Forward(selected.data(), out_rows, local.data(), head_plan));
  if (!gather_logits) {
    *logits = std::move(local);
    return absl::OkStatus();
  }
  EXL3_RETURN_IF_ERROR(GatherLogits(local, out_rows, logits));
  return absl::OkStatus();
}

absl::Status Transformer::Attention(std::span<const SequenceTokens> batch, int layer_index,
                                    PagedKvCache* cache, const std::vector<int64_t>& starts,
                                    std::vector<float>& q, std::vector<float>& k,
                                    const std::vector<float>& v, std::vector<float>* out) const {
  const sharding::ModelArch& arch = config_.arch;
  const Layer& layer = layers_[layer_index];
  const int64_t hd = arch.head_dim;
  const int64_t nh = layer.num_q_heads, nkv = layer.num_kv_heads;
  const int64_t group = arch.num_attention_heads / arch.num_key_value_heads;
  const int64_t window = config_.sliding_window;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();

  int64_t row0 = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const int64_t n = static_cast<int64_t>(batch[b].tokens.size());
    const int64_t start = starts[b];
    float* qb = q.data() + row0 * nh * hd;
    float* kb = k.data() + row0 * nkv * hd;
    if (config_.qk_norm) {
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(qb, n * nh, hd, layer.q_norm.data(),
                                            config_.rms_norm_eps, qb));
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(kb, n * nkv, hd, layer.k_norm.data(),
                                            config_.rms_norm_eps, kb));
    }
    std::vector<int64_t> positions(n);
    std::iota(positions.begin(), positions.end(), start);
    const int64_t rot = config_.rotary_dim;
    EXL3_RETURN_IF_ERROR(kernels::ApplyPartialRope(qb, n, nh, hd, rot, positions.data(),
                                                   rope_inv_freq_.data()));
    EXL3_RETURN_IF_ERROR(kernels::ApplyPartialRope(kb, n, nkv, hd, rot, positions.data(),
                                                   rope_inv_freq_.data()));
    cache->Write(batch[b].seq_id, layer_index, start, n, kb, v.data() + row0 * nkv * hd);

    // Every key any of these queries can see: [lo, start + n).
    const int64_t end = start + n;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    const int64_t ctx = end - lo;
    std::vector<float> keys(ctx * nkv * hd), values(ctx * nkv * hd);
    cache->Read(batch[b].seq_id, layer_index, lo, end, keys.data(), values.data());

    std::vector<std::vector<float>> scratch(pool.size(), std::vector<float>(ctx));
    float* ob = out->data() + row0 * nh * hd;
    pool.ParallelFor(n * nh, 0, [&](int64_t task, int worker) {
      const int64_t t = task / nh, head = task % nh;
      const int64_t pos = start + t;
      const int64_t first = window > 0 ? std::max(lo, pos - window + 1) : lo;
      const int64_t g = (layer.q_head_begin + head) / group - layer.kv_head_begin;
      // The cache stores int8/int4 too, so it hands over dequantized
      // contiguous rows; the paged kernels::DecodeAttention /
      // PrefillAttention (fp16/fp32 pages) run this same row kernel.
      kernels::AttendRow(qb + (t * nh + head) * hd, keys.data() + ((first - lo) * nkv + g) * hd,
                         values.data() + ((first - lo) * nkv + g) * hd, pos - first + 1,
                         nkv * hd, hd, scale, scratch[worker].data(),
                         ob + (t * nh + head) * hd);
    });
    row0 += n;
  }
  return absl::OkStatus();
}

absl::Status Transformer::MlaAttention(std::span<const SequenceTokens> batch, int layer_index,
                                       PagedKvCache* cache, const std::vector<int64_t>& starts,
                                       const std::vector<float>& a, int64_t total,
                                       std::span<const RowRun> plan,
                                       std::vector<float>* out) const {
  const sharding::ModelArch& arch = config_.arch;
  const Layer& layer = layers_[layer_index];
  const int64_t n = arch.qk_nope_head_dim, r = arch.qk_rope_head_dim, vd = arch.v_head_dim;
  const int64_t dc = arch.kv_lora_rank, qd = n + r;
  const int64_t nh = layer.num_q_heads;
  const float scale = static_cast<float>(config_.attention_softmax_scale);
  const double rope_scale = config_.rope_attention_factor;
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();

  // The latent: c_kv = RMSNorm(t[0:dc]), k_pe = t[dc:dc+r], t = a·W_kvaᵀ.
  std::vector<float> t(static_cast<size_t>(total * (dc + r)));
  EXL3_RETURN_IF_ERROR(layer.kv_a.Forward(a.data(), total, t.data(), plan));
  std::vector<float> c_kv(static_cast<size_t>(total * dc)), k_pe(static_cast<size_t>(total * r));
  for (int64_t i = 0; i < total; ++i) {
    std::memcpy(&c_kv[i * dc], &t[i * (dc + r)], sizeof(float) * dc);
    std::memcpy(&k_pe[i * r], &t[i * (dc + r) + dc], sizeof(float) * r);
  }
  EXL3_RETURN_IF_ERROR(kernels::RmsNorm(c_kv.data(), total, dc, layer.kv_a_norm.data(),
                                        config_.rms_norm_eps, c_kv.data()));
  // Queries [total][nh][nope | rope].
  std::vector<float> q(static_cast<size_t>(total * nh * qd));
  if (nh > 0) {
    if (arch.q_lora_rank > 0) {
      std::vector<float> c_q(static_cast<size_t>(total * arch.q_lora_rank));
      EXL3_RETURN_IF_ERROR(layer.q_a.Forward(a.data(), total, c_q.data(), plan));
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(c_q.data(), total, arch.q_lora_rank,
                                            layer.q_a_norm.data(), config_.rms_norm_eps,
                                            c_q.data()));
      EXL3_RETURN_IF_ERROR(layer.q_b.Forward(c_q.data(), total, q.data(), plan));
    } else {
      EXL3_RETURN_IF_ERROR(layer.q.Forward(a.data(), total, q.data(), plan));
    }
  }

  int64_t row0 = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const int64_t count = static_cast<int64_t>(batch[b].tokens.size());
    const int64_t start = starts[b];
    std::vector<int64_t> positions(count);
    std::iota(positions.begin(), positions.end(), start);
    float* qb = q.data() + row0 * nh * qd;
    ApplyInterleavedRope(qb, count, nh, qd, n, r, positions.data(), rope_inv_freq_.data(),
                         rope_scale);
    ApplyInterleavedRope(&k_pe[row0 * r], count, 1, r, 0, r, positions.data(),
                         rope_inv_freq_.data(), rope_scale);
    cache->Write(batch[b].seq_id, layer_index, start, count, &c_kv[row0 * dc], &k_pe[row0 * r]);
    if (nh == 0) {
      row0 += count;
      continue;
    }
    // Every position these queries see, read back from the cache (so a
    // chunked prefill, a whole one and decoding see the same stored values).
    const int64_t end = start + count;
    std::vector<float> latent(static_cast<size_t>(end * dc)), rope_key(static_cast<size_t>(end * r));
    cache->Read(batch[b].seq_id, layer_index, 0, end, latent.data(), rope_key.data());
    float* ob = out->data() + row0 * nh * vd;
    if (count >= kPrefillMinRows) {
      // Prefill: keys [nope | k_pe] and values of every head from kv_b.
      std::vector<float> kv(static_cast<size_t>(end * nh * (n + vd)));
      EXL3_RETURN_IF_ERROR(layer.kv_b.Forward(latent.data(), end, kv.data()));
      std::vector<std::vector<float>> scratch(pool.size(), std::vector<float>(end));
      pool.ParallelFor(count * nh, 0, [&](int64_t task, int worker) {
        const int64_t i = task / nh, head = task % nh;
        const int64_t visible = start + i + 1;
        const float* qh = qb + (i * nh + head) * qd;
        float* scores = scratch[worker].data();
        float max_score = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          const float* kj = &kv[(j * nh + head) * (n + vd)];
          const float* pj = &rope_key[j * r];
          float dot = 0.0f;
          for (int64_t d = 0; d < n; ++d) dot += qh[d] * kj[d];
          for (int64_t d = 0; d < r; ++d) dot += qh[n + d] * pj[d];
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < visible; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        float* o = ob + (i * nh + head) * vd;
        std::fill(o, o + vd, 0.0f);
        for (int64_t j = 0; j < visible; ++j) {
          const float w = scores[j] / sum;
          const float* vj = &kv[(j * nh + head) * (n + vd) + n];
          for (int64_t d = 0; d < vd; ++d) o[d] += w * vj[d];
        }
      });
    } else {
      // Absorbed decode (architectures.md §2.2 step 5): q_lat = W_UKᵀ q_nope
      // attends over [c_kv | k_pe] with [q_lat | q_pe]; the weighted latent
      // goes through W_UV. Each (token, head) alone: a row's result does not
      // depend on what else is in the batch.
      std::vector<float> rows(static_cast<size_t>(end * (dc + r)));
      for (int64_t j = 0; j < end; ++j) {
        std::memcpy(&rows[j * (dc + r)], &latent[j * dc], sizeof(float) * dc);
        std::memcpy(&rows[j * (dc + r) + dc], &rope_key[j * r], sizeof(float) * r);
      }
      struct Scratch {
        std::vector<float> scores, q, o;
      };
      std::vector<Scratch> scratch(pool.size());
      for (Scratch& s : scratch) {
        s.scores.resize(end);
        s.q.resize(dc + r);
        s.o.resize(dc + r);
      }
      pool.ParallelFor(count * nh, 0, [&](int64_t task, int worker) {
        const int64_t i = task / nh, head = task % nh;
        const float* qh = qb + (i * nh + head) * qd;
        const float* w = layer.kv_b.dense_weight() + head * (n + vd) * dc;  // [n + vd][dc]
        Scratch& s = scratch[worker];
        std::fill(s.q.begin(), s.q.begin() + dc, 0.0f);
        for (int64_t d = 0; d < n; ++d) {
          const float x = qh[d];
          const float* wd = w + d * dc;
          for (int64_t c = 0; c < dc; ++c) s.q[c] += x * wd[c];
        }
        std::memcpy(&s.q[dc], qh + n, sizeof(float) * r);
        kernels::AttendRow(s.q.data(), rows.data(), rows.data(), start + i + 1, dc + r, dc + r,
                           scale, s.scores.data(), s.o.data());
        float* o = ob + (i * nh + head) * vd;
        for (int64_t d = 0; d < vd; ++d) {
          const float* wd = w + (n + d) * dc;
          float acc = 0.0f;
          for (int64_t c = 0; c < dc; ++c) acc += wd[c] * s.o[c];
          o[d] = acc;
        }
      });
    }
    row0 += count;
  }
  return absl::OkStatus();
}

absl::Status Transformer::Mlp(const Layer& layer, const std::vector<float>& a, int64_t m,
                              std::span<const RowRun> plan, std::vector<float>* out) const {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  auto gated = [](const Linear& gate, const Linear& up, const Linear& down, const float* x,
                  int64_t rows, std::span<const RowRun> rows_plan, float* y) -> absl::Status {
    const int64_t inter = gate.out_features();
    std::vector<float> g(rows * inter), u(rows * inter);
    EXL3_RETURN_IF_ERROR(gate.Forward(x, rows, g.data(), rows_plan));
    EXL3_RETURN_IF_ERROR(up.Forward(x, rows, u.data(), rows_plan));
    for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
    return down.Forward(g.data(), rows, y, rows_plan);
  };
  if (!layer.moe) return gated(layer.gate, layer.up, layer.down, a.data(), m, plan, out->data());

  // Route (model_config.h MoeRouter): every rank routes every token itself.
  const int experts = arch.num_experts, top_k = arch.num_experts_per_token;
  const int64_t held_begin = layer.expert_begin;
  const int64_t held_end = held_begin + static_cast<int64_t>(layer.experts.size());
  std::vector<float> router(m * experts);
  EXL3_RETURN_IF_ERROR(layer.router.Forward(a.data(), m, router.data(), plan));
  std::vector<std::vector<int64_t>> rows_of(experts);
  std::vector<std::vector<float>> weights_of(experts);
  std::vector<int> order(experts);
  std::vector<double> p(experts);
  std::vector<double> choice(experts), group_score(config_.moe_n_group);
  std::vector<int> group_order(config_.moe_n_group);
  for (int64_t r = 0; r < m; ++r) {
    const float* z = router.data() + r * experts;
    if (config_.moe_router == MoeRouter::kSigmoidGrouped) {
      // s = sigmoid(z); the correction bias only steers the choice.
      for (int e = 0; e < experts; ++e) {
        p[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(z[e])));
        choice[e] = p[e] + static_cast<double>(layer.score_bias[e]);
      }
      const int groups = config_.moe_n_group;
      if (groups > 1) {
        const int per_group = experts / groups;
        for (int g = 0; g < groups; ++g) {
          double best = -INFINITY, second = -INFINITY;
          for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
            if (choice[e] > best) {
              second = best;
              best = choice[e];
            } else if (choice[e] > second) {
              second = choice[e];
            }
          }
          group_score[g] = best + second;
        }
        std::iota(group_order.begin(), group_order.end(), 0);
        std::stable_sort(group_order.begin(), group_order.end(),
                         [&](int x, int y) { return group_score[x] > group_score[y]; });
        // Experts of the groups not kept score 0.0 (as transformers'
        // masked_fill), not -inf: they can still beat negative scores.
        for (int i = config_.moe_topk_group; i < groups; ++i) {
          const int g = group_order[i];
          std::fill(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group, 0.0);
        }
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int x, int y) { return choice[x] > choice[y]; });
      double top_sum = 0.0;
      for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
      const double norm =
          config_.moe_topk_weights == MoeTopKWeights::kRenormalized ? top_sum + 1e-20 : 1.0;
      for (int i = 0; i < top_k; ++i) {
        rows_of[order[i]].push_back(r);
        weights_of[order[i]].push_back(
            static_cast<float>(p[order[i]] / norm * config_.routed_scaling_factor));
      }
      continue;
    }
    const float zmax = *std::max_element(z, z + experts);
    double sum = 0.0;
    for (int e = 0; e < experts; ++e) sum += p[e] = std::exp(static_cast<double>(z[e] - zmax));
    for (int e = 0; e < experts; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return p[x] > p[y]; });
    double top_sum = 0.0;
    for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
    const double norm = config_.moe_topk_weights == MoeTopKWeights::kRenormalized ? top_sum : 1.0;
    for (int i = 0; i < top_k; ++i) {
      rows_of[order[i]].push_back(r);
      weights_of[order[i]].push_back(static_cast<float>(p[order[i]] / norm));
    }
  }
  // The shared expert (GLM) runs on every row; the routed experts add to it.
  if (layer.has_shared) {
    EXL3_RETURN_IF_ERROR(gated(layer.shared.gate, layer.shared.up, layer.shared.down, a.data(), m,
                               plan, out->data()));
  } else {
    std::fill(out->begin(), out->begin() + m * hidden, 0.0f);
  }
  // Each gathered row keeps its entry's kind: an expert's plan is the kinds
  // of its rows in row order (runs of the batch plan stay runs).
  std::vector<RowKind> kind_of_row;
  kind_of_row.reserve(static_cast<size_t>(m));
  for (const RowRun& run : plan) {
    kind_of_row.insert(kind_of_row.end(), static_cast<size_t>(run.rows), run.kind);
  }
  std::vector<RowRun> expert_plan;
  std::vector<float> x, y;
  for (int64_t e = held_begin; e < held_end; ++e) {  // the experts this rank holds
    const std::vector<int64_t>& rows = rows_of[e];
    if (rows.empty()) continue;
    const int64_t count = static_cast<int64_t>(rows.size());
    x.resize(count * hidden);
    y.resize(count * hidden);
    expert_plan.clear();
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(&x[i * hidden], &a[rows[i] * hidden], sizeof(float) * hidden);
      AppendRowRun(&expert_plan, 1, kind_of_row[rows[i]]);
    }
    if (expert_tokens_ != nullptr) {
      expert_tokens_[e].fetch_add(static_cast<uint64_t>(count), std::memory_order_relaxed);
    }
    const Expert& expert = layer.experts[e - held_begin];
    EXL3_RETURN_IF_ERROR(
        gated(expert.gate, expert.up, expert.down, x.data(), count, expert_plan, y.data()));
    for (int64_t i = 0; i < count; ++i) {
      float* o = out->data() + rows[i] * hidden;
      const float w = weights_of[e][i];
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[i * hidden + c];
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
