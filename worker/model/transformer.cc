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
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"

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

// In place: each of the `rows` rows of width d becomes x / rms(x) ⊙ w.
void RmsNorm(float* x, int64_t rows, int64_t d, const float* w, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * d;
    double sum = 0.0;
    for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(d) + eps));
    for (int64_t i = 0; i < d; ++i) xr[i] = xr[i] * inv * w[i];
  }
}

// Rotate-half RoPE on `heads` heads of width d in one row at position pos.
void ApplyRope(float* row, int64_t heads, int64_t d, int64_t pos,
               const std::vector<double>& inv_freq) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(pos) * inv_freq[i];
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    for (int64_t h = 0; h < heads; ++h) {
      float* x = row + h * d;
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c - x2 * s;
      x[i + half] = x2 * c + x1 * s;
    }
  }
}

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(const std::string& dir) {
  EXL3_ASSIGN_OR_RETURN(nlohmann::json config_json, ReadJsonFile(dir + "/config.json"));
  std::optional<nlohmann::json> generation;
  if (absl::StatusOr<nlohmann::json> g = ReadJsonFile(dir + "/generation_config.json"); g.ok()) {
    generation = std::move(*g);
  }
  std::unique_ptr<Transformer> model(new Transformer());
  EXL3_ASSIGN_OR_RETURN(model->config_,
                        ModelConfigFromJson(config_json, generation ? &*generation : nullptr));
  if (model->config_.arch.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": head_dim must be even for RoPE, got ", model->config_.arch.head_dim));
  }
  model->rope_inv_freq_ = RopeInverseFrequencies(model->config_);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<sharding::Exl3Model> checkpoint,
                        sharding::Exl3Model::Open(dir));
  EXL3_RETURN_IF_ERROR(model->LoadWeights(*checkpoint));
  return model;
}

absl::Status Transformer::LoadWeights(const sharding::Exl3Model& model) {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  auto spec = [&](int layer, sharding::LinearRole role, int expert) {
    return arch.Find(layer, role, expert);
  };
  auto load = [&](const sharding::LinearSpec* s) -> absl::StatusOr<Linear> {
    absl::StatusOr<Linear> linear = Linear::Load(model, s->key, s->in_features, s->out_features);
    if (linear.ok()) linear->set_key(s->key);
    return linear;
  };
  using sharding::LinearRole;
  layers_.resize(arch.num_layers);
  for (int l = 0; l < arch.num_layers; ++l) {
    Layer& layer = layers_[l];
    const std::string prefix = absl::StrCat("model.layers.", l);
    EXL3_ASSIGN_OR_RETURN(layer.input_norm, LoadVector(model, prefix + ".input_layernorm.weight", hidden));
    EXL3_ASSIGN_OR_RETURN(layer.post_attention_norm,
                          LoadVector(model, prefix + ".post_attention_layernorm.weight", hidden));
    if (config_.qk_norm) {
      EXL3_ASSIGN_OR_RETURN(layer.q_norm,
                            LoadVector(model, prefix + ".self_attn.q_norm.weight", arch.head_dim));
      EXL3_ASSIGN_OR_RETURN(layer.k_norm,
                            LoadVector(model, prefix + ".self_attn.k_norm.weight", arch.head_dim));
    }
    EXL3_ASSIGN_OR_RETURN(layer.q, load(spec(l, LinearRole::kQ, -1)));
    EXL3_ASSIGN_OR_RETURN(layer.k, load(spec(l, LinearRole::kK, -1)));
    EXL3_ASSIGN_OR_RETURN(layer.v, load(spec(l, LinearRole::kV, -1)));
    EXL3_ASSIGN_OR_RETURN(layer.o, load(spec(l, LinearRole::kO, -1)));
    layer.moe = arch.layer_is_moe[l];
    if (!layer.moe) {
      EXL3_ASSIGN_OR_RETURN(layer.gate, load(spec(l, LinearRole::kGate, -1)));
      EXL3_ASSIGN_OR_RETURN(layer.up, load(spec(l, LinearRole::kUp, -1)));
      EXL3_ASSIGN_OR_RETURN(layer.down, load(spec(l, LinearRole::kDown, -1)));
      continue;
    }
    EXL3_ASSIGN_OR_RETURN(layer.router, load(spec(l, LinearRole::kRouter, -1)));
    layer.experts.resize(arch.num_experts);
    for (int e = 0; e < arch.num_experts; ++e) {
      EXL3_ASSIGN_OR_RETURN(layer.experts[e].gate, load(spec(l, LinearRole::kGate, e)));
      EXL3_ASSIGN_OR_RETURN(layer.experts[e].up, load(spec(l, LinearRole::kUp, e)));
      EXL3_ASSIGN_OR_RETURN(layer.experts[e].down, load(spec(l, LinearRole::kDown, e)));
    }
  }
  EXL3_ASSIGN_OR_RETURN(final_norm_, LoadVector(model, "model.norm.weight", hidden));

  // The head: lm_head when the checkpoint has one (also when tied), else the
  // token embedding, which is then shared rather than held twice.
  const bool has_head = model.FindLinear("lm_head") != nullptr || model.FindPlain("lm_head.weight");
  if (has_head) {
    EXL3_ASSIGN_OR_RETURN(head_, load(spec(-1, LinearRole::kHead, -1)));
    EXL3_ASSIGN_OR_RETURN(Linear embed, Linear::LoadPlain(model, "model.embed_tokens.weight",
                                                          hidden, arch.vocab_size));
    embed_.assign(embed.dense_weight(), embed.dense_weight() + arch.vocab_size * hidden);
  } else if (arch.tie_word_embeddings) {
    EXL3_ASSIGN_OR_RETURN(head_, Linear::LoadPlain(model, "model.embed_tokens.weight", hidden,
                                                   arch.vocab_size));
    head_.set_key("lm_head");
  } else {
    return absl::NotFoundError(
        absl::StrCat(model.dir(), ": no `lm_head` and tie_word_embeddings is false"));
  }
  return absl::OkStatus();
}

void Transformer::SetInputObserver(InputObserver* observer) {
  for (Layer& layer : layers_) {
    for (Linear* l : {&layer.q, &layer.k, &layer.v, &layer.o, &layer.gate, &layer.up, &layer.down,
                      &layer.router}) {
      l->set_input_observer(observer);
    }
    for (Expert& e : layer.experts) {
      for (Linear* l : {&e.gate, &e.up, &e.down}) l->set_input_observer(observer);
    }
  }
  head_.set_input_observer(observer);
}

absl::StatusOr<PagedKvCache> Transformer::CreateKvCache(const KvCacheOptions& options) const {
  KvCacheShape shape;
  shape.num_layers = config_.arch.num_layers;
  shape.num_kv_heads = static_cast<int>(config_.arch.num_key_value_heads);
  shape.head_dim = static_cast<int>(config_.arch.head_dim);
  return PagedKvCache::Create(shape, options);
}

absl::Status Transformer::Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                                  PagedKvCache* cache, std::vector<float>* logits) const {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  const int64_t hd = arch.head_dim;
  const int64_t nh = arch.num_attention_heads, nkv = arch.num_key_value_heads;
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

  // h: the residual stream, one row per new token in batch order.
  const float* embed = embed_.empty() ? head_.dense_weight() : embed_.data();
  std::vector<float> h(static_cast<size_t>(total * hidden));
  {
    int64_t row = 0;
    for (const SequenceTokens& entry : batch) {
      for (int32_t id : entry.tokens) {
        std::memcpy(&h[row++ * hidden], embed + int64_t{id} * hidden, sizeof(float) * hidden);
      }
    }
  }
  std::vector<float> a(h.size()), q(total * nh * hd), k(total * nkv * hd), v(total * nkv * hd);
  std::vector<float> attn(total * nh * hd), delta(h.size());
  for (int l = 0; l < arch.num_layers; ++l) {
    const Layer& layer = layers_[l];
    a = h;
    RmsNorm(a.data(), total, hidden, layer.input_norm.data(), config_.rms_norm_eps);
    EXL3_RETURN_IF_ERROR(layer.q.Forward(a.data(), total, q.data()));
    EXL3_RETURN_IF_ERROR(layer.k.Forward(a.data(), total, k.data()));
    EXL3_RETURN_IF_ERROR(layer.v.Forward(a.data(), total, v.data()));
    EXL3_RETURN_IF_ERROR(Attention(batch, l, cache, starts, q, k, v, &attn));
    EXL3_RETURN_IF_ERROR(layer.o.Forward(attn.data(), total, delta.data()));
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
    a = h;
    RmsNorm(a.data(), total, hidden, layer.post_attention_norm.data(), config_.rms_norm_eps);
    EXL3_RETURN_IF_ERROR(Mlp(layer, a, total, &delta));
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
  }

  // Final norm and head on the rows asked for.
  std::vector<float> selected;
  int64_t out_rows = 0;
  if (rows == LogitsRows::kAllTokens) {
    selected = std::move(h);
    out_rows = total;
  } else {
    int64_t row = 0;
    for (const SequenceTokens& entry : batch) {
      row += static_cast<int64_t>(entry.tokens.size());
      selected.insert(selected.end(), h.begin() + (row - 1) * hidden, h.begin() + row * hidden);
      ++out_rows;
    }
  }
  RmsNorm(selected.data(), out_rows, hidden, final_norm_.data(), config_.rms_norm_eps);
  logits->resize(static_cast<size_t>(out_rows * arch.vocab_size));
  EXL3_RETURN_IF_ERROR(head_.Forward(selected.data(), out_rows, logits->data()));
  for (size_t i = 0; i < batch.size(); ++i) {
    cache->SetLength(batch[i].seq_id, starts[i] + static_cast<int64_t>(batch[i].tokens.size()));
  }
  return absl::OkStatus();
}

absl::Status Transformer::Attention(std::span<const SequenceTokens> batch, int layer_index,
                                    PagedKvCache* cache, const std::vector<int64_t>& starts,
                                    std::vector<float>& q, std::vector<float>& k,
                                    const std::vector<float>& v, std::vector<float>* out) const {
  const sharding::ModelArch& arch = config_.arch;
  const Layer& layer = layers_[layer_index];
  const int64_t hd = arch.head_dim;
  const int64_t nh = arch.num_attention_heads, nkv = arch.num_key_value_heads;
  const int64_t group = nh / nkv;
  const int64_t window = config_.sliding_window;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();

  int64_t row0 = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const int64_t n = static_cast<int64_t>(batch[b].tokens.size());
    const int64_t start = starts[b];
    float* qb = q.data() + row0 * nh * hd;
    float* kb = k.data() + row0 * nkv * hd;
    for (int64_t t = 0; t < n; ++t) {
      if (config_.qk_norm) {
        RmsNorm(qb + t * nh * hd, nh, hd, layer.q_norm.data(), config_.rms_norm_eps);
        RmsNorm(kb + t * nkv * hd, nkv, hd, layer.k_norm.data(), config_.rms_norm_eps);
      }
      ApplyRope(qb + t * nh * hd, nh, hd, start + t, rope_inv_freq_);
      ApplyRope(kb + t * nkv * hd, nkv, hd, start + t, rope_inv_freq_);
    }
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
      const float* qv = qb + (t * nh + head) * hd;
      const int64_t g = head / group;
      float* scores = scratch[worker].data();
      float max_score = -INFINITY;
      for (int64_t j = first; j <= pos; ++j) {
        const float* kv = keys.data() + ((j - lo) * nkv + g) * hd;
        float dot = 0.0f;
        for (int64_t i = 0; i < hd; ++i) dot += qv[i] * kv[i];
        scores[j - lo] = dot * scale;
        max_score = std::max(max_score, scores[j - lo]);
      }
      float sum = 0.0f;
      for (int64_t j = first; j <= pos; ++j) {
        scores[j - lo] = std::exp(scores[j - lo] - max_score);
        sum += scores[j - lo];
      }
      float* o = ob + (t * nh + head) * hd;
      std::fill(o, o + hd, 0.0f);
      for (int64_t j = first; j <= pos; ++j) {
        const float w = scores[j - lo] / sum;
        const float* vv = values.data() + ((j - lo) * nkv + g) * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] += w * vv[i];
      }
    });
    row0 += n;
  }
  return absl::OkStatus();
}

absl::Status Transformer::Mlp(const Layer& layer, const std::vector<float>& a, int64_t m,
                              std::vector<float>* out) const {
  const sharding::ModelArch& arch = config_.arch;
  const int64_t hidden = arch.hidden_size;
  auto gated = [](const Linear& gate, const Linear& up, const Linear& down, const float* x,
                  int64_t rows, float* y) -> absl::Status {
    const int64_t inter = gate.out_features();
    std::vector<float> g(rows * inter), u(rows * inter);
    EXL3_RETURN_IF_ERROR(gate.Forward(x, rows, g.data()));
    EXL3_RETURN_IF_ERROR(up.Forward(x, rows, u.data()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
    return down.Forward(g.data(), rows, y);
  };
  if (!layer.moe) return gated(layer.gate, layer.up, layer.down, a.data(), m, out->data());

  // Route: softmax over all experts, keep the top k (lower index first on
  // ties), optionally renormalise.
  const int experts = arch.num_experts, top_k = arch.num_experts_per_token;
  std::vector<float> router(m * experts);
  EXL3_RETURN_IF_ERROR(layer.router.Forward(a.data(), m, router.data()));
  std::vector<std::vector<int64_t>> rows_of(experts);
  std::vector<std::vector<float>> weights_of(experts);
  std::vector<int> order(experts);
  std::vector<double> p(experts);
  for (int64_t r = 0; r < m; ++r) {
    const float* z = router.data() + r * experts;
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
  std::fill(out->begin(), out->begin() + m * hidden, 0.0f);
  std::vector<float> x, y;
  for (int e = 0; e < experts; ++e) {
    const std::vector<int64_t>& rows = rows_of[e];
    if (rows.empty()) continue;
    const int64_t count = static_cast<int64_t>(rows.size());
    x.resize(count * hidden);
    y.resize(count * hidden);
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(&x[i * hidden], &a[rows[i] * hidden], sizeof(float) * hidden);
    }
    const Expert& expert = layer.experts[e];
    EXL3_RETURN_IF_ERROR(gated(expert.gate, expert.up, expert.down, x.data(), count, y.data()));
    for (int64_t i = 0; i < count; ++i) {
      float* o = out->data() + rows[i] * hidden;
      const float w = weights_of[e][i];
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[i * hidden + c];
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
