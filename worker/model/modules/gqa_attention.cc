#include "worker/model/modules/gqa_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/attend_row.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"

namespace exl3serve::worker {

absl::StatusOr<std::unique_ptr<GqaAttention>> GqaAttention::Load(
    const WeightLoader& weights, const ModelContext& context, int l,
    const sharding::LayerShard& part) {
  const sharding::ModelArch& arch = weights.arch();
  const int64_t hidden = arch.hidden_size, hd = arch.head_dim;
  EXL3_RETURN_IF_ERROR(CheckShardRange(part.q_heads, arch.num_attention_heads, "query heads"));
  EXL3_RETURN_IF_ERROR(CheckShardRange(part.kv_heads, arch.num_key_value_heads, "kv heads"));
  const int64_t group = arch.num_attention_heads / arch.num_key_value_heads;
  if (!part.q_heads.empty() && (part.q_heads.begin / group < part.kv_heads.begin ||
                                (part.q_heads.end - 1) / group >= part.kv_heads.end)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard plan: layer ", l, ": kv heads [", part.kv_heads.begin, ", ",
                     part.kv_heads.end, ") do not cover the query heads' kv heads"));
  }
  std::unique_ptr<GqaAttention> m(new GqaAttention());
  m->context_ = context;
  m->layer_ = l;
  m->q_head_begin_ = part.q_heads.begin;
  m->num_q_heads_ = part.q_heads.size();
  m->kv_head_begin_ = part.kv_heads.begin;
  m->num_kv_heads_ = part.kv_heads.size();
  const std::string prefix = arch.LayerPrefix(l) + ".self_attn";
  if (context.config->qk_norm) {
    EXL3_ASSIGN_OR_RETURN(m->q_norm_, weights.LoadVector(prefix + ".q_norm.weight", hd));
    EXL3_ASSIGN_OR_RETURN(m->k_norm_, weights.LoadVector(prefix + ".k_norm.weight", hd));
    if (context.config->norm_weight_plus_one) {  // zero-centred: (1 + w), in fp32
      for (float& w : m->q_norm_) w += 1.0f;
      for (float& w : m->k_norm_) w += 1.0f;
    }
  }
  m->output_gate_ = arch.attention_output_gate;
  using sharding::IndexRange;
  using sharding::LinearRole;
  const IndexRange all_hidden{0, hidden};
  const IndexRange q_channels{part.q_heads.begin * hd, part.q_heads.end * hd};
  const IndexRange kv_channels{part.kv_heads.begin * hd, part.kv_heads.end * hd};
  // With an output gate q_proj's rows are [q_h | gate_h] per head.
  const int64_t q_width = m->output_gate_ ? 2 * hd : hd;
  const IndexRange q_rows{part.q_heads.begin * q_width, part.q_heads.end * q_width};
  EXL3_ASSIGN_OR_RETURN(m->q_, weights.LoadLinear(l, LinearRole::kQ, -1, all_hidden, q_rows, true));
  EXL3_ASSIGN_OR_RETURN(m->k_, weights.LoadLinear(l, LinearRole::kK, -1, all_hidden, kv_channels, true));
  EXL3_ASSIGN_OR_RETURN(m->v_, weights.LoadLinear(l, LinearRole::kV, -1, all_hidden, kv_channels, true));
  EXL3_ASSIGN_OR_RETURN(m->o_, weights.LoadLinear(l, LinearRole::kO, -1, q_channels, all_hidden,
                                                  part.o_bias));
  return m;
}

KvLayout GqaAttention::kv_layout() const {
  return KvLayout{static_cast<int>(num_kv_heads_),
                  static_cast<int>(context_.config->arch.head_dim), 0};
}

void GqaAttention::ForEachLinear(const std::function<void(Linear&)>& fn) {
  for (Linear* l : {&q_, &k_, &v_, &o_}) fn(*l);
}

absl::Status GqaAttention::Forward(const StepBatch& step, const float* a, PagedKvCache* cache,
                                   float* out) const {
  const int64_t hd = context_.config->arch.head_dim;
  const int64_t total = step.total;
  const int64_t nh = num_q_heads_;
  float* q = step.scratch->Get(kScratchQ, total * nh * hd);
  float* k = step.scratch->Get(kScratchK, total * num_kv_heads_ * hd);
  float* v = step.scratch->Get(kScratchV, total * num_kv_heads_ * hd);
  float* attn = step.scratch->Get(kScratchAttn, total * nh * hd);
  float* gate = nullptr;
  if (output_gate_) {
    // [q_h | gate_h] per head: split into q and the gate.
    float* qg = step.scratch->Get(kScratchMix0, total * nh * 2 * hd);
    gate = step.scratch->Get(kScratchMix1, total * nh * hd);
    EXL3_RETURN_IF_ERROR(q_.Forward(a, total, qg, step.plan));
    for (int64_t i = 0; i < total * nh; ++i) {
      std::memcpy(q + i * hd, qg + i * 2 * hd, sizeof(float) * hd);
      std::memcpy(gate + i * hd, qg + i * 2 * hd + hd, sizeof(float) * hd);
    }
  } else {
    EXL3_RETURN_IF_ERROR(q_.Forward(a, total, q, step.plan));
  }
  EXL3_RETURN_IF_ERROR(k_.Forward(a, total, k, step.plan));
  EXL3_RETURN_IF_ERROR(v_.Forward(a, total, v, step.plan));
  EXL3_RETURN_IF_ERROR(Attend(step, cache, q, k, v, attn));
  if (gate != nullptr) {  // o ⊙ sigmoid(gate), before o_proj
    for (int64_t i = 0; i < total * nh * hd; ++i) {
      attn[i] = attn[i] * (1.0f / (1.0f + std::exp(-gate[i])));
    }
  }
  return o_.Forward(attn, total, out, step.plan);
}

absl::Status GqaAttention::Attend(const StepBatch& step, PagedKvCache* cache, float* q, float* k,
                                  const float* v, float* out) const {
  const ModelConfig& config = *context_.config;
  const sharding::ModelArch& arch = config.arch;
  const int64_t hd = arch.head_dim;
  const int64_t nh = num_q_heads_, nkv = num_kv_heads_;
  const int64_t group = arch.num_attention_heads / arch.num_key_value_heads;
  const int64_t window = config.sliding_window;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const std::vector<double>& inv_freq = *context_.rope_inv_freq;
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();

  int64_t row0 = 0;
  for (size_t b = 0; b < step.batch.size(); ++b) {
    const int64_t n = static_cast<int64_t>(step.batch[b].tokens.size());
    const int64_t start = step.starts[b];
    float* qb = q + row0 * nh * hd;
    float* kb = k + row0 * nkv * hd;
    if (config.qk_norm) {
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(qb, n * nh, hd, q_norm_.data(), config.rms_norm_eps, qb));
      EXL3_RETURN_IF_ERROR(kernels::RmsNorm(kb, n * nkv, hd, k_norm_.data(), config.rms_norm_eps, kb));
    }
    std::vector<int64_t> positions(n);
    std::iota(positions.begin(), positions.end(), start);
    const int64_t rot = config.rotary_dim;
    EXL3_RETURN_IF_ERROR(
        kernels::ApplyPartialRope(qb, n, nh, hd, rot, positions.data(), inv_freq.data()));
    EXL3_RETURN_IF_ERROR(
        kernels::ApplyPartialRope(kb, n, nkv, hd, rot, positions.data(), inv_freq.data()));
    cache->Write(step.batch[b].seq_id, kv_layer_, start, n, kb, v + row0 * nkv * hd);

    // Every key any of these queries can see: [lo, start + n).
    const int64_t end = start + n;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    const int64_t ctx = end - lo;
    // fp32 / fp16 entries are read in place (a pointer per position);
    // int8 / int4 ones are dequantized into contiguous rows. The two give
    // the same bits (kernels::cpu::AttendGroupPaged). Both buffers are
    // reused from call to call (a long context's copy would otherwise be
    // fresh pages to fault in at every layer of every step).
    const bool in_place = cache->entries_in_place();
    thread_local std::vector<float> keys, values;
    thread_local std::vector<const void*> key_ptrs, value_ptrs;
    if (in_place) {
      if (key_ptrs.size() < static_cast<size_t>(ctx)) {
        key_ptrs.resize(static_cast<size_t>(ctx));
        value_ptrs.resize(key_ptrs.size());
      }
      cache->RowPointers(step.batch[b].seq_id, kv_layer_, lo, end, key_ptrs.data(),
                         value_ptrs.data());
    } else {
      if (keys.size() < static_cast<size_t>(ctx * nkv * hd)) {
        keys.resize(static_cast<size_t>(ctx * nkv * hd));
        values.resize(keys.size());
      }
      cache->Read(step.batch[b].seq_id, kv_layer_, lo, end, keys.data(), values.data());
    }
    // (Pointers: the pool's threads would see their own thread_local vectors.)
    const float* key_rows = keys.data();
    const float* value_rows = values.data();
    const void* const* key_row_ptrs = key_ptrs.data();
    const void* const* value_row_ptrs = value_ptrs.data();
    const bool fp16 = cache->options().dtype == KvCacheDtype::kFp16;

    // The local query heads as runs that share a KV head (a GQA group, or
    // the part of one this rank holds), cut into as many tasks as the pool
    // has threads when there are few: each task reads its keys and values
    // once for all of its heads (kernels::AttendGroup, bit for bit
    // AttendRow per head).
    struct HeadRun {
      int64_t first_head = 0, heads = 0, kv = 0;
    };
    std::vector<HeadRun> runs;
    for (int64_t head = 0; head < nh; ++head) {
      const int64_t g = (q_head_begin_ + head) / group - kv_head_begin_;
      if (runs.empty() || runs.back().kv != g) runs.push_back({head, 0, g});
      ++runs.back().heads;
    }
    int64_t per_task = 1;
    for (const HeadRun& r : runs) per_task = std::max(per_task, r.heads);
    while (per_task > 1 && n * static_cast<int64_t>(runs.size()) * ((group + per_task - 1) / per_task) <
                               static_cast<int64_t>(pool.size())) {
      per_task = (per_task + 1) / 2;
    }
    std::vector<HeadRun> tasks;
    for (const HeadRun& r : runs) {
      for (int64_t h = 0; h < r.heads; h += per_task) {
        tasks.push_back({r.first_head + h, std::min(per_task, r.heads - h), r.kv});
      }
    }
    std::vector<std::vector<float>> scores(pool.size());
    float* ob = out + row0 * nh * hd;
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    pool.ParallelFor(n * num_tasks, 0, [&](int64_t task, int worker) {
      const int64_t t = task / num_tasks;
      const HeadRun& r = tasks[task % num_tasks];
      const int64_t pos = start + t;
      const int64_t first = window > 0 ? std::max(lo, pos - window + 1) : lo;
      const int64_t count = pos - first + 1;
      std::vector<float>& s = scores[worker];
      if (s.size() < static_cast<size_t>(r.heads * count)) s.resize(static_cast<size_t>(r.heads * ctx));
      if (in_place) {
        kernels::cpu::AttendGroupPaged(qb + (t * nh + r.first_head) * hd, hd, r.heads,
                                       key_row_ptrs + (first - lo), value_row_ptrs + (first - lo),
                                       r.kv * hd, fp16, count, hd, scale, s.data(),
                                       ob + (t * nh + r.first_head) * hd, hd);
      } else {
        kernels::AttendGroup(qb + (t * nh + r.first_head) * hd, hd, r.heads,
                             key_rows + ((first - lo) * nkv + r.kv) * hd,
                             value_rows + ((first - lo) * nkv + r.kv) * hd, count, nkv * hd, hd,
                             scale, s.data(), ob + (t * nh + r.first_head) * hd, hd);
      }
    });
    row0 += n;
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
