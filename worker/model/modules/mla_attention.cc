#include "worker/model/modules/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"

namespace exl3serve::worker {
namespace {

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

}  // namespace

absl::StatusOr<std::unique_ptr<MlaAttention>> MlaAttention::Load(
    const WeightLoader& weights, const ModelContext& context, int l,
    const sharding::LayerShard& part) {
  const sharding::ModelArch& arch = weights.arch();
  EXL3_RETURN_IF_ERROR(CheckShardRange(part.q_heads, arch.num_attention_heads, "query heads"));
  std::unique_ptr<MlaAttention> m(new MlaAttention());
  m->context_ = context;
  m->layer_ = l;
  m->num_q_heads_ = part.q_heads.size();
  using sharding::IndexRange;
  using sharding::LinearRole;
  const std::string prefix = arch.LayerPrefix(l) + ".self_attn";
  const IndexRange all_hidden{0, arch.hidden_size};
  // architectures.md §2.4, §2.5.
  const int64_t n = arch.qk_nope_head_dim, r = arch.qk_rope_head_dim;
  const int64_t vd = arch.v_head_dim, dc = arch.kv_lora_rank;
  const IndexRange heads = part.q_heads;
  const IndexRange q_cols{heads.begin * (n + r), heads.end * (n + r)};
  if (arch.q_lora_rank > 0) {
    const IndexRange rank_cols{0, arch.q_lora_rank};
    EXL3_ASSIGN_OR_RETURN(m->q_a_, weights.LoadLinear(l, LinearRole::kQA, -1, all_hidden,
                                                      rank_cols, true));
    EXL3_ASSIGN_OR_RETURN(m->q_a_norm_,
                          weights.LoadVector(prefix + ".q_a_layernorm.weight", arch.q_lora_rank));
    if (!heads.empty()) {
      EXL3_ASSIGN_OR_RETURN(m->q_b_,
                            weights.LoadLinear(l, LinearRole::kQB, -1, rank_cols, q_cols, true));
    }
  } else if (!heads.empty()) {
    EXL3_ASSIGN_OR_RETURN(m->q_, weights.LoadLinear(l, LinearRole::kQ, -1, all_hidden, q_cols, true));
  }
  EXL3_ASSIGN_OR_RETURN(m->kv_a_, weights.LoadLinear(l, LinearRole::kKVA, -1, all_hidden,
                                                     IndexRange{0, dc + r}, true));
  EXL3_ASSIGN_OR_RETURN(m->kv_a_norm_, weights.LoadVector(prefix + ".kv_a_layernorm.weight", dc));
  if (!heads.empty()) {
    EXL3_ASSIGN_OR_RETURN(Linear kv_b,
                          weights.LoadLinear(l, LinearRole::kKVB, -1, IndexRange{0, dc},
                                             IndexRange{heads.begin * (n + vd), heads.end * (n + vd)},
                                             true));
    // W = kv_b's weight [out][dc], read as the linear's answer to the
    // identity (exact for a 16-bit weight, also right for an EXL3 one).
    const int64_t rows = heads.size() * (n + vd);
    std::vector<float> identity(static_cast<size_t>(dc * dc), 0.0f), wt(dc * rows);
    for (int64_t i = 0; i < dc; ++i) identity[i * dc + i] = 1.0f;
    EXL3_RETURN_IF_ERROR(kv_b.Forward(identity.data(), dc, wt.data()));
    // Held once, as fp32 [out][dc]: the prefill path runs it as a linear,
    // the absorbed decode reads its rows (kv_b.dense_weight()).
    std::vector<float> w(static_cast<size_t>(rows * dc));
    for (int64_t i = 0; i < dc; ++i) {
      for (int64_t o = 0; o < rows; ++o) w[o * dc + i] = wt[i * rows + o];
    }
    m->kv_b_ = Linear::FromDense(std::move(w), dc, rows, {});
    m->kv_b_.set_key(kv_b.key());
    EXL3_ASSIGN_OR_RETURN(m->o_, weights.LoadLinear(l, LinearRole::kO, -1,
                                                    IndexRange{heads.begin * vd, heads.end * vd},
                                                    all_hidden, part.o_bias));
  }
  return m;
}

KvLayout MlaAttention::kv_layout() const {
  const sharding::ModelArch& arch = context_.config->arch;
  return KvLayout{1, static_cast<int>(arch.kv_lora_rank), static_cast<int>(arch.qk_rope_head_dim)};
}

void MlaAttention::ForEachLinear(const std::function<void(Linear&)>& fn) {
  for (Linear* l : {&q_, &q_a_, &q_b_, &kv_a_, &kv_b_, &o_}) fn(*l);
}

absl::Status MlaAttention::Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                                   float* out) const {
  const sharding::ModelArch& arch = context_.config->arch;
  float* attn = step.scratch->Get(kScratchAttn, step.total * num_q_heads_ * arch.v_head_dim);
  EXL3_RETURN_IF_ERROR(Attend(step, a, cache, attn));
  if (num_q_heads_ == 0) {  // no heads here: nothing to add
    std::fill(out, out + step.total * arch.hidden_size, 0.0f);
    return absl::OkStatus();
  }
  return o_.Forward(attn, step.total, out, step.plan);
}

absl::Status MlaAttention::Attend(const StepBatch& step, const float* a, PagedKvCache* cache,
                                  float* out) const {
  const ModelConfig& config = *context_.config;
  const sharding::ModelArch& arch = config.arch;
  const int64_t n = arch.qk_nope_head_dim, r = arch.qk_rope_head_dim, vd = arch.v_head_dim;
  const int64_t dc = arch.kv_lora_rank, qd = n + r;
  const int64_t nh = num_q_heads_;
  const int64_t total = step.total;
  const std::span<const RowRun> plan = step.plan;
  const float scale = static_cast<float>(config.attention_softmax_scale);
  const double rope_scale = config.rope_attention_factor;
  const std::vector<double>& inv_freq = *context_.rope_inv_freq;
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();

  // The latent: c_kv = RMSNorm(t[0:dc]), k_pe = t[dc:dc+r], t = a·W_kvaᵀ.
  std::vector<float> t(static_cast<size_t>(total * (dc + r)));
  EXL3_RETURN_IF_ERROR(kv_a_.Forward(a, total, t.data(), plan));
  std::vector<float> c_kv(static_cast<size_t>(total * dc)), k_pe(static_cast<size_t>(total * r));
  for (int64_t i = 0; i < total; ++i) {
    std::memcpy(&c_kv[i * dc], &t[i * (dc + r)], sizeof(float) * dc);
    std::memcpy(&k_pe[i * r], &t[i * (dc + r) + dc], sizeof(float) * r);
  }
  EXL3_RETURN_IF_ERROR(kernels::RmsNorm(c_kv.data(), total, dc, kv_a_norm_.data(),
                                        config.rms_norm_eps, c_kv.data()));
  // Queries [total][nh][nope | rope].
  std::vector<float> q(static_cast<size_t>(total * nh * qd));
  if (nh > 0) {
    if (arch.q_lora_rank > 0) {
      std::vector<float> c_q(static_cast<size_t>(total * arch.q_lora_rank));
      EXL3_RETURN_IF_ERROR(q_a_.Forward(a, total, c_q.data(), plan));
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(c_q.data(), total, arch.q_lora_rank, q_a_norm_.data(),
                                            config.rms_norm_eps, c_q.data()));
      EXL3_RETURN_IF_ERROR(q_b_.Forward(c_q.data(), total, q.data(), plan));
    } else {
      EXL3_RETURN_IF_ERROR(q_.Forward(a, total, q.data(), plan));
    }
  }

  int64_t row0 = 0;
  for (size_t b = 0; b < step.batch.size(); ++b) {
    const int64_t count = static_cast<int64_t>(step.batch[b].tokens.size());
    const int64_t start = step.starts[b];
    const int64_t seq = step.batch[b].seq_id;
    std::vector<int64_t> positions(count);
    std::iota(positions.begin(), positions.end(), start);
    float* qb = q.data() + row0 * nh * qd;
    ApplyInterleavedRope(qb, count, nh, qd, n, r, positions.data(), inv_freq.data(), rope_scale);
    ApplyInterleavedRope(&k_pe[row0 * r], count, 1, r, 0, r, positions.data(), inv_freq.data(),
                         rope_scale);
    cache->Write(seq, kv_layer_, start, count, &c_kv[row0 * dc], &k_pe[row0 * r]);
    if (nh == 0) {
      row0 += count;
      continue;
    }
    // Every position these queries see, read back from the cache (so a
    // chunked prefill, a whole one and decoding see the same stored values).
    const int64_t end = start + count;
    std::vector<float> latent(static_cast<size_t>(end * dc)), rope_key(static_cast<size_t>(end * r));
    cache->Read(seq, kv_layer_, 0, end, latent.data(), rope_key.data());
    float* ob = out + row0 * nh * vd;
    // Prefill-kind rows [0, expanded) attend in the expanded form, the
    // decode-kind rest in the absorbed one (module.h prefill_rows): a row's
    // form follows its kind, never what else shares the forward.
    const int64_t expanded = step.prefill_rows[b];
    if (expanded > 0) {
      // Prefill: keys [nope | k_pe] and values of every head from kv_b.
      const int64_t seen = start + expanded;  // positions the expanded rows see
      std::vector<float> kv(static_cast<size_t>(seen * nh * (n + vd)));
      const RowRun keys_plan{seen, RowKind::kPrefill};  // the expanded form's precision
      EXL3_RETURN_IF_ERROR(kv_b_.Forward(latent.data(), seen, kv.data(), {&keys_plan, 1}));
      std::vector<std::vector<float>> scratch(pool.size(), std::vector<float>(seen));
      pool.ParallelFor(expanded * nh, 0, [&](int64_t task, int worker) {
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
    }
    if (expanded < count) {
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
      pool.ParallelFor((count - expanded) * nh, 0, [&](int64_t task, int worker) {
        const int64_t i = expanded + task / nh, head = task % nh;
        const float* qh = qb + (i * nh + head) * qd;
        const float* w = kv_b_.dense_weight() + head * (n + vd) * dc;  // [n + vd][dc]
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

}  // namespace exl3serve::worker
