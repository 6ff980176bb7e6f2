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
#include "worker/model/modules/layer_modules.h"
#include "worker/model/modules/weight_loader.h"

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
    layer.linear_key_heads = {0, arch.gdn_key_heads};
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
  const bool whole = comm_ == nullptr;
  if (static_cast<int>(shard.layers.size()) != arch.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("shard plan has ", shard.layers.size(),
                                                   " layers, the model ", arch.num_layers));
  }
  const WeightLoader weights(model, config_, whole);
  const ModelContext context{&config_, &rope_inv_freq_};
  auto check = CheckShardRange;
  // A linear whole (single rank) or as this rank's window (the head).
  auto load = [&](const sharding::LinearSpec* s, sharding::IndexRange in,
                  sharding::IndexRange out, bool bias) -> absl::StatusOr<Linear> {
    absl::StatusOr<Linear> linear =
        whole ? Linear::Load(model, s->key, s->in_features, s->out_features)
              : Linear::LoadWindow(model, s->key, s->in_features, s->out_features, in.begin,
                                   in.end, out.begin, out.end, bias);
    if (linear.ok()) linear->set_key(s->key);
    return linear;
  };
  using sharding::IndexRange;
  using sharding::LinearRole;
  const IndexRange all_hidden{0, hidden};
  // Each layer as its recipe says: the norms here, the modules load their
  // own weights (and their own part of them on a rank of a group).
  layers_.resize(arch.num_layers);
  for (int l = 0; l < arch.num_layers; ++l) {
    Layer& layer = layers_[l];
    const sharding::LayerShard& part = shard.layers[l];
    const std::string prefix = arch.LayerPrefix(l);
    EXL3_ASSIGN_OR_RETURN(layer.input_norm,
                          weights.LoadVector(prefix + ".input_layernorm.weight", hidden));
    EXL3_ASSIGN_OR_RETURN(layer.post_attention_norm,
                          weights.LoadVector(prefix + ".post_attention_layernorm.weight", hidden));
    if (config_.norm_weight_plus_one) {  // zero-centred norms: (1 + w), in fp32
      for (float& w : layer.input_norm) w += 1.0f;
      for (float& w : layer.post_attention_norm) w += 1.0f;
    }
    EXL3_ASSIGN_OR_RETURN(layer.mixer,
                          LoadTokenMixer(arch.layers[l].mixer, weights, context, l, part));
    // The paged cache has one geometry for all the layers that keep KV;
    // each such layer gets the next KV layer of the cache, each layer with
    // a per-sequence state the next state slot.
    const KvLayout layout = layer.mixer->kv_layout();
    int kv_layer = -1, state_slot = -1;
    if (layout.has_kv()) {
      if (!kv_layouts_.empty() && layout != kv_layouts_[0]) {
        return absl::UnimplementedError(
            "shard plan: the number of kv heads per rank must be the same in every layer");
      }
      kv_layer = static_cast<int>(kv_layouts_.size());
      kv_layouts_.push_back(layout);
    }
    if (layer.mixer->state_floats() > 0) {
      state_slot = static_cast<int>(state_floats_.size());
      state_floats_.push_back(layer.mixer->state_floats());
    }
    layer.mixer->set_cache_slots(kv_layer, state_slot);
    EXL3_ASSIGN_OR_RETURN(
        layer.feed_forward,
        LoadFeedForward(arch.layers[l].feed_forward, weights, context, l, part));
  }
  EXL3_ASSIGN_OR_RETURN(final_norm_, weights.LoadVector(arch.FinalNormName(), hidden));
  if (config_.norm_weight_plus_one) {
    for (float& w : final_norm_) w += 1.0f;
  }
  // Expert load counters (metrics): the experts this rank holds in any layer.
  if (arch.num_experts > 0) {
    expert_held_.assign(arch.num_experts, false);
    for (const Layer& layer : layers_) {
      const auto [begin, end] = layer.feed_forward->held_experts();
      for (int64_t e = begin; e < end; ++e) expert_held_[e] = true;
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
  const std::string embed_name = arch.EmbedName();
  const char* kEmbedName = embed_name.c_str();
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
    EXL3_ASSIGN_OR_RETURN(Linear embed, Linear::LoadPlain(model, embed_name, hidden,
                                                          arch.vocab_size));
    embed_.resize(static_cast<size_t>(arch.vocab_size * hidden));
    embed.DenseRowsToFloat(0, arch.vocab_size, embed_.data());
  }
  if (has_head) {
    EXL3_ASSIGN_OR_RETURN(head_, load(arch.Find(-1, LinearRole::kHead, -1), all_hidden, vocab_, true));
  } else if (whole) {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::LoadPlain(model, embed_name, hidden, arch.vocab_size));
  } else {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::LoadWindow(model, arch.tensor_prefix + ".embed_tokens", hidden,
                                                    arch.vocab_size, 0, hidden, vocab_.begin,
                                                    vocab_.end, false));
  }
  head_.set_key("lm_head");
  return absl::OkStatus();
}

std::vector<Transformer::SpillTableStats> Transformer::spill_stats() const {
  std::vector<SpillTableStats> out;
  if (embed_spill_ != nullptr) out.push_back({config_.arch.EmbedName(), embed_spill_->stats()});
  return out;
}

std::vector<std::pair<int, uint64_t>> Transformer::expert_tokens() const {
  std::vector<std::pair<int, uint64_t>> out;
  if (expert_held_.empty()) return out;
  std::vector<uint64_t> tokens(expert_held_.size(), 0);
  for (const Layer& layer : layers_) layer.feed_forward->AddExpertTokens(&tokens);
  for (size_t e = 0; e < expert_held_.size(); ++e) {
    if (expert_held_[e]) out.emplace_back(static_cast<int>(e), tokens[e]);
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
  auto attach = [observer](Linear& l) { l.set_input_observer(observer); };
  for (Layer& layer : layers_) {
    layer.mixer->ForEachLinear(attach);
    layer.feed_forward->ForEachLinear(attach);
  }
  head_.set_input_observer(observer);
}

absl::StatusOr<PagedKvCache> Transformer::CreateKvCache(const KvCacheOptions& options) const {
  KvCacheShape shape;
  // Only the layers that keep KV have a layer of pages (a hybrid model's
  // linear-attention layers keep a per-sequence state instead).
  shape.num_layers = static_cast<int>(kv_layouts_.size());
  if (kv_layouts_.empty()) {
    // No layer keeps KV (no such model is supported): one unused layer.
    shape.num_layers = 1;
    shape.num_kv_heads = 1;
    shape.head_dim = 2;
  } else {
    // Every layer stores the same geometry (checked at load).
    shape.num_kv_heads = kv_layouts_[0].num_kv_heads;
    shape.head_dim = kv_layouts_[0].head_dim;
    shape.value_dim = kv_layouts_[0].value_dim;
  }
  shape.state_floats = state_floats_;
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
  std::vector<float> a(h.size()), delta(h.size());
  // Each entry's rows run at the precision the entry would get alone
  // (linear.h, RowKind), whatever else shares the step.
  // Each row's kind follows its position in a sampled sequence, the
  // entry's size otherwise (linear.h PrefillRowsOfEntry).
  std::vector<RowRun> plan;
  std::vector<int64_t> prefill_rows(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
    prefill_rows[i] = PrefillRowsOfEntry(starts[i], n, batch[i].prompt_len);
    AppendEntryRows(&plan, prefill_rows[i], 0, n);
  }
  StepScratch scratch;
  const StepBatch step{batch, starts, total, plan, prefill_rows, &scratch};
  for (int l = 0; l < arch.num_layers; ++l) {
    const Layer& layer = layers_[l];
    a = h;
    EXL3_RETURN_IF_ERROR(kernels::RmsNorm(a.data(), total, hidden, layer.input_norm.data(),
                                          config_.rms_norm_eps, a.data()));
    EXL3_RETURN_IF_ERROR(layer.mixer->Forward(step, a.data(), cache, delta.data()));
    EXL3_RETURN_IF_ERROR(AllReduce(delta));
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
    a = h;
    EXL3_RETURN_IF_ERROR(kernels::RmsNorm(a.data(), total, hidden,
                                          layer.post_attention_norm.data(), config_.rms_norm_eps,
                                          a.data()));
    EXL3_RETURN_IF_ERROR(layer.feed_forward->Forward(step, a.data(), delta.data()));
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
      AppendEntryRows(&head_plan, prefill_rows[i], n - last_rows[i], last_rows[i]);
    }
  } else if (rows == LogitsRows::kAllTokens) {
    selected = std::move(h);
    out_rows = total;
    head_plan = plan;
  } else {
    int64_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
      row += n;
      selected.insert(selected.end(), h.begin() + (row - 1) * hidden, h.begin() + row * hidden);
      ++out_rows;
      AppendEntryRows(&head_plan, prefill_rows[i], n - 1, 1);
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

}  // namespace exl3serve::worker
