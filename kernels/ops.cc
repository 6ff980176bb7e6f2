#include "kernels/ops.h"


#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attend_row.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {
namespace {

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

absl::Status ValidateAttentionParams(const char* op, const AttentionParams& p) {
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.head_dim <= 0) {
    return Bad(absl::StrCat(op, ": q_heads, kv_heads and head_dim must be > 0, got ", p.q_heads,
                            ", ", p.kv_heads, ", ", p.head_dim));
  }
  if (p.q_heads % p.kv_heads != 0) {
    return Bad(absl::StrCat(op, ": q_heads must be a multiple of kv_heads, got ", p.q_heads,
                            " and ", p.kv_heads));
  }
  if (!std::isfinite(p.scale)) return Bad(absl::StrCat(op, ": scale must be finite, got ", p.scale));
  if (p.sliding_window < 0) {
    return Bad(absl::StrCat(op, ": sliding_window must be >= 0 (0 = off), got ", p.sliding_window));
  }
  return absl::OkStatus();
}

absl::Status ValidatePagedKv(const char* op, const PagedKv& kv, int64_t num_seqs) {
  if (kv.dtype != KvDtype::kFp32 && kv.dtype != KvDtype::kFp16) {
    return Bad(absl::StrCat(op, ": kv dtype must be fp32 or fp16"));
  }
  if (kv.num_pages <= 0 || kv.page_size <= 0 || kv.pages_per_seq <= 0) {
    return Bad(absl::StrCat(op, ": num_pages, page_size and pages_per_seq must be > 0, got ",
                            kv.num_pages, ", ", kv.page_size, ", ", kv.pages_per_seq));
  }
  if (kv.num_pages > std::numeric_limits<int32_t>::max()) {
    return Bad(absl::StrCat(op, ": num_pages must be <= 2^31-1, got ", kv.num_pages));
  }
  if (num_seqs > 0 && (kv.k == nullptr || kv.v == nullptr || kv.page_table == nullptr)) {
    return Bad(absl::StrCat(op, ": null k, v or page_table"));
  }
  return absl::OkStatus();
}

// Keys and values of positions [lo, end) of sequence `seq` as float,
// [end - lo][kv_heads][head_dim] (fp16 entries converted exactly).
void GatherContext(const PagedKv& kv, const AttentionParams& p, int64_t seq, int64_t lo,
                   int64_t end, float* keys, float* values) {
  const int64_t row = p.kv_heads * p.head_dim;
  const int32_t* table = kv.page_table + seq * kv.pages_per_seq;
  for (int64_t pos = lo; pos < end; ++pos) {
    const int64_t entry =
        (static_cast<int64_t>(table[pos / kv.page_size]) * kv.page_size + pos % kv.page_size) * row;
    float* kd = keys + (pos - lo) * row;
    float* vd = values + (pos - lo) * row;
    if (kv.dtype == KvDtype::kFp32) {
      std::copy_n(static_cast<const float*>(kv.k) + entry, row, kd);
      std::copy_n(static_cast<const float*>(kv.v) + entry, row, vd);
    } else {
      const uint16_t* ks = static_cast<const uint16_t*>(kv.k) + entry;
      const uint16_t* vs = static_cast<const uint16_t*>(kv.v) + entry;
      for (int64_t i = 0; i < row; ++i) {
        kd[i] = HalfBitsToFloat(ks[i]);
        vd[i] = HalfBitsToFloat(vs[i]);
      }
    }
  }
}

// Both attention ops after validation: sequence s has `counts` new tokens at
// starts[s].. (rows of q from rows[s]).
void PagedAttention(const float* q, int64_t num_seqs, const int64_t* rows, const int64_t* counts,
                    const int64_t* starts, const PagedKv& kv, const AttentionParams& p,
                    float* out) {
  const int64_t hd = p.head_dim, nh = p.q_heads, nkv = p.kv_heads;
  const int64_t group = nh / nkv;
  const int64_t window = p.sliding_window;
  cpu::ThreadPool& pool = cpu::SharedThreadPool();
  std::vector<float> keys, values;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = counts[s];
    if (n == 0) continue;
    const int64_t start = starts[s];
    const int64_t end = start + n;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    const int64_t ctx = end - lo;
    keys.resize(static_cast<size_t>(ctx * nkv * hd));
    values.resize(keys.size());
    GatherContext(kv, p, s, lo, end, keys.data(), values.data());
    std::vector<std::vector<float>> scratch(pool.size(), std::vector<float>(ctx));
    const float* qs = q + rows[s] * nh * hd;
    float* os = out + rows[s] * nh * hd;
    pool.ParallelFor(n * nh, 0, [&](int64_t task, int worker) {
      const int64_t t = task / nh, head = task % nh;
      const int64_t pos = start + t;
      const int64_t first = window > 0 ? std::max(lo, pos - window + 1) : lo;
      const int64_t g = head / group;
      AttendRow(qs + (t * nh + head) * hd, keys.data() + ((first - lo) * nkv + g) * hd,
                values.data() + ((first - lo) * nkv + g) * hd, pos - first + 1, nkv * hd, hd,
                p.scale, scratch[worker].data(), os + (t * nh + head) * hd);
    });
  }
}

// Checks one sequence's range [.., end) fits its page-table row and that the
// pages covering [lo, end) are valid ids.
absl::Status ValidateSequenceRange(const char* op, const PagedKv& kv, const AttentionParams& p,
                                   int64_t s, int64_t start, int64_t end) {
  if (end > kv.pages_per_seq * kv.page_size) {
    return Bad(absl::StrCat(op, ": sequence ", s, " needs ", end, " positions, its page table row holds ",
                            kv.pages_per_seq * kv.page_size, " (pages_per_seq x page_size)"));
  }
  const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, start - p.sliding_window + 1) : 0;
  const int32_t* table = kv.page_table + s * kv.pages_per_seq;
  for (int64_t page = lo / kv.page_size; page < (end + kv.page_size - 1) / kv.page_size; ++page) {
    if (table[page] < 0 || table[page] >= kv.num_pages) {
      return Bad(absl::StrCat(op, ": sequence ", s, " page ", page, " is page id ", table[page],
                              ", outside [0, ", kv.num_pages, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateFilter(int64_t row, const SamplingFilter& f) {
  auto bad = [&](const char* field, const char* rule, double value) {
    return Bad(absl::StrCat("sample: row ", row, ": `", field, "` must be ", rule, ", got ", value));
  };
  if (!(f.temperature >= 0.0f) || std::isinf(f.temperature)) {
    return bad("temperature", ">= 0 and finite", f.temperature);
  }
  if (f.top_k < 0) return bad("top_k", ">= 0 (0 = off)", f.top_k);
  if (!(f.top_p > 0.0f && f.top_p <= 1.0f)) return bad("top_p", "in (0, 1]", f.top_p);
  if (!(f.min_p >= 0.0f && f.min_p <= 1.0f)) return bad("min_p", "in [0, 1]", f.min_p);
  return absl::OkStatus();
}

absl::Status ValidateLogits(const char* op, const float* logits, int64_t rows, int64_t vocab,
                            const void* out) {
  if (rows < 0) return Bad(absl::StrCat(op, ": rows must be >= 0, got ", rows));
  if (vocab <= 0 || vocab > std::numeric_limits<int32_t>::max()) {
    return Bad(absl::StrCat(op, ": vocab must be in [1, 2^31-1], got ", vocab));
  }
  if (rows > 0 && (logits == nullptr || out == nullptr)) {
    return Bad(absl::StrCat(op, ": null logits or ids"));
  }
  return absl::OkStatus();
}

int32_t ArgMaxRow(const float* z, int64_t vocab) {
  return static_cast<int32_t>(std::max_element(z, z + vocab) - z);
}

}  // namespace

namespace internal {

absl::Status ValidateRmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight,
                             double eps, const float* out) {
  if (rows < 0 || dim <= 0) {
    return Bad(absl::StrCat("rms_norm: rows must be >= 0 and dim > 0, got ", rows, " and ", dim));
  }
  if (!(eps >= 0.0)) return Bad(absl::StrCat("rms_norm: eps must be >= 0, got ", eps));
  if (rows > 0 && (x == nullptr || weight == nullptr || out == nullptr)) {
    return Bad("rms_norm: null x, weight or out");
  }
  return absl::OkStatus();
}

absl::Status ValidateRope(const float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                          const int64_t* positions, const double* inv_freq) {
  if (tokens < 0 || heads < 0) {
    return Bad(absl::StrCat("rope: tokens and heads must be >= 0, got ", tokens, " and ", heads));
  }
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return Bad(absl::StrCat("rope: head_dim must be even and > 0, got ", head_dim));
  }
  if (tokens == 0 || heads == 0) return absl::OkStatus();
  if (x == nullptr || positions == nullptr || inv_freq == nullptr) {
    return Bad("rope: null x, positions or inv_freq");
  }
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0) {
      return Bad(absl::StrCat("rope: position of token ", t, " must be >= 0, got ", positions[t]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                                     const PagedKv& kv, const AttentionParams& params,
                                     const float* out) {
  constexpr char kOp[] = "decode_attention";
  if (num_seqs < 0) return Bad(absl::StrCat(kOp, ": num_seqs must be >= 0, got ", num_seqs));
  if (absl::Status s = ValidateAttentionParams(kOp, params); !s.ok()) return s;
  if (absl::Status s = ValidatePagedKv(kOp, kv, num_seqs); !s.ok()) return s;
  if (num_seqs == 0) return absl::OkStatus();
  if (q == nullptr || seq_lens == nullptr || out == nullptr) {
    return Bad("decode_attention: null q, seq_lens or out");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (seq_lens[s] < 1) {
      return Bad(absl::StrCat(kOp, ": seq_lens[", s,
                              "] must be >= 1 (the new token is in the pool), got ", seq_lens[s]));
    }
    if (absl::Status st = ValidateSequenceRange(kOp, kv, params, s, seq_lens[s] - 1, seq_lens[s]);
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrefillAttention(const float* q, int64_t num_seqs,
                                      const int32_t* query_starts, const int32_t* start_positions,
                                      const PagedKv& kv, const AttentionParams& params,
                                      const float* out) {
  constexpr char kOp[] = "prefill_attention";
  if (num_seqs < 0) return Bad(absl::StrCat(kOp, ": num_seqs must be >= 0, got ", num_seqs));
  if (absl::Status s = ValidateAttentionParams(kOp, params); !s.ok()) return s;
  if (absl::Status s = ValidatePagedKv(kOp, kv, num_seqs); !s.ok()) return s;
  if (num_seqs == 0) return absl::OkStatus();
  if (query_starts == nullptr || start_positions == nullptr) {
    return Bad("prefill_attention: null query_starts or start_positions");
  }
  if (query_starts[0] != 0) {
    return Bad(absl::StrCat(kOp, ": query_starts[0] must be 0, got ", query_starts[0]));
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (query_starts[s + 1] < query_starts[s]) {
      return Bad(absl::StrCat(kOp, ": query_starts must not decrease, got ", query_starts[s],
                              " then ", query_starts[s + 1], " at sequence ", s));
    }
    if (start_positions[s] < 0) {
      return Bad(absl::StrCat(kOp, ": start_positions[", s, "] must be >= 0, got ",
                              start_positions[s]));
    }
    const int64_t count = query_starts[s + 1] - query_starts[s];
    if (count == 0) continue;
    if (absl::Status st = ValidateSequenceRange(kOp, kv, params, s, start_positions[s],
                                                int64_t{start_positions[s]} + count);
        !st.ok()) {
      return st;
    }
  }
  if (query_starts[num_seqs] > 0 && (q == nullptr || out == nullptr)) {
    return Bad("prefill_attention: null q or out");
  }
  return absl::OkStatus();
}

absl::Status ValidateArgMax(const float* logits, int64_t rows, int64_t vocab, const int32_t* ids) {
  return ValidateLogits("argmax", logits, rows, vocab, ids);
}

absl::Status ValidateSample(const float* logits, int64_t rows, int64_t vocab,
                            const SamplingFilter* filters, const double* uniforms,
                            const int32_t* ids) {
  if (absl::Status s = ValidateLogits("sample", logits, rows, vocab, ids); !s.ok()) return s;
  if (rows > 0 && (filters == nullptr || uniforms == nullptr)) {
    return Bad("sample: null filters or uniforms");
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (absl::Status s = ValidateFilter(r, filters[r]); !s.ok()) return s;
    if (!(uniforms[r] >= 0.0 && uniforms[r] < 1.0)) {
      return Bad(absl::StrCat("sample: row ", r, ": uniform must be in [0, 1), got ", uniforms[r]));
    }
    if (filters[r].temperature == 0.0f) continue;
    // Softmax needs a finite maximum: NaN or +inf would poison every p (and
    // the sort's ordering); -inf (a masked token) is fine.
    const float* z = logits + r * vocab;
    bool any_finite = false;
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::isnan(z[i]) || z[i] == INFINITY) {
        return Bad(absl::StrCat("sample: row ", r, ": logit ", i, " is ", z[i],
                                "; logits must be finite or -inf"));
      }
      any_finite = any_finite || std::isfinite(z[i]);
    }
    if (!any_finite) return Bad(absl::StrCat("sample: row ", r, ": every logit is -inf"));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out) {
  if (absl::Status s = internal::ValidateRmsNorm(x, rows, dim, weight, eps, out); !s.ok()) return s;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(dim) + eps));
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[i];
  }
  return absl::OkStatus();
}

absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq) {
  return ApplyPartialRope(x, tokens, heads, head_dim, head_dim, positions, inv_freq);
}

absl::Status ApplyPartialRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                              int64_t rotary_dim, const int64_t* positions,
                              const double* inv_freq) {
  if (absl::Status s = internal::ValidateRope(x, tokens, heads, head_dim, positions, inv_freq);
      !s.ok()) {
    return s;
  }
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
    return Bad(absl::StrCat("rope: rotary_dim must be even and in (0, head_dim ",
                                      head_dim, "], got ", rotary_dim));
  }
  if (tokens == 0 || heads == 0) return absl::OkStatus();
  const int64_t half = rotary_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = x + t * heads * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[t]) * inv_freq[i];
      const float c = static_cast<float>(std::cos(angle));
      const float s = static_cast<float>(std::sin(angle));
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + h * head_dim;
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
      }
    }
  }
  return absl::OkStatus();
}

void AttendRow(const float* q, const float* k, const float* v, int64_t count,
               int64_t row_stride, int64_t head_dim, float scale, float* scores, float* out) {
  switch (cpu::ActiveCpuIsa()) {
    case cpu::CpuIsa::kAvx512:
      return cpu::avx512::AttendRow(q, k, v, count, row_stride, head_dim, scale, scores, out);
    case cpu::CpuIsa::kAvx2:
      return cpu::avx2::AttendRow(q, k, v, count, row_stride, head_dim, scale, scores, out);
    case cpu::CpuIsa::kScalar:
      break;
  }
  cpu::scalar::AttendRow(q, k, v, count, row_stride, head_dim, scale, scores, out);
}

void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride) {
  switch (cpu::ActiveCpuIsa()) {
    case cpu::CpuIsa::kAvx512:
      return cpu::avx512::AttendGroup(q, q_stride, heads, k, v, count, row_stride, head_dim, scale,
                                      scores, out, out_stride);
    case cpu::CpuIsa::kAvx2:
      return cpu::avx2::AttendGroup(q, q_stride, heads, k, v, count, row_stride, head_dim, scale,
                                    scores, out, out_stride);
    case cpu::CpuIsa::kScalar:
      break;
  }
  cpu::scalar::AttendGroup(q, q_stride, heads, k, v, count, row_stride, head_dim, scale, scores,
                           out, out_stride);
}

absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out) {
  if (absl::Status s = internal::ValidateDecodeAttention(q, num_seqs, seq_lens, kv, params, out);
      !s.ok()) {
    return s;
  }
  std::vector<int64_t> rows(num_seqs), counts(num_seqs, 1), starts(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    rows[s] = s;
    starts[s] = seq_lens[s] - 1;
  }
  PagedAttention(q, num_seqs, rows.data(), counts.data(), starts.data(), kv, params, out);
  return absl::OkStatus();
}

absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, const PagedKv& kv,
                              const AttentionParams& params, float* out) {
  if (absl::Status s = internal::ValidatePrefillAttention(q, num_seqs, query_starts,
                                                          start_positions, kv, params, out);
      !s.ok()) {
    return s;
  }
  std::vector<int64_t> rows(num_seqs), counts(num_seqs), starts(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    rows[s] = query_starts[s];
    counts[s] = query_starts[s + 1] - query_starts[s];
    starts[s] = start_positions[s];
  }
  PagedAttention(q, num_seqs, rows.data(), counts.data(), starts.data(), kv, params, out);
  return absl::OkStatus();
}

absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids) {
  if (absl::Status s = internal::ValidateArgMax(logits, rows, vocab, ids); !s.ok()) return s;
  for (int64_t r = 0; r < rows; ++r) ids[r] = ArgMaxRow(logits + r * vocab, vocab);
  return absl::OkStatus();
}

void SamplingDistribution(const float* logits, int64_t vocab, const SamplingFilter& filter,
                          double* probs) {
  std::fill(probs, probs + vocab, 0.0);
  if (filter.temperature == 0.0f) {
    probs[ArgMaxRow(logits, vocab)] = 1.0;
    return;
  }
  std::vector<double> p(vocab);
  const double zmax = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    sum += p[i] = std::exp((static_cast<double>(logits[i]) - zmax) / filter.temperature);
  }
  for (double& x : p) x /= sum;
  // Candidates in descending probability, lowest id first on ties.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto more_likely = [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  int64_t kept = vocab;
  if (filter.top_k > 0 && filter.top_k < vocab) kept = filter.top_k;
  if (filter.top_p < 1.0f) {
    std::sort(order.begin(), order.end(), more_likely);
  } else {
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), more_likely);
  }
  if (filter.top_p < 1.0f) {
    double kept_mass = 0.0;
    for (int64_t r = 0; r < kept; ++r) kept_mass += p[order[r]];
    double before = 0.0;
    int64_t r = 0;
    for (; r < kept; ++r) {
      if (before / kept_mass >= filter.top_p) break;
      before += p[order[r]];
    }
    kept = r;
  }
  if (filter.min_p > 0.0f) {
    const double threshold = filter.min_p * p[order[0]];
    int64_t r = 1;
    while (r < kept && p[order[r]] >= threshold) ++r;
    kept = r;
  }
  double mass = 0.0;
  for (int64_t r = 0; r < kept; ++r) mass += p[order[r]];
  for (int64_t r = 0; r < kept; ++r) probs[order[r]] = p[order[r]] / mass;
}

absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids) {
  if (absl::Status s = internal::ValidateSample(logits, rows, vocab, filters, uniforms, ids);
      !s.ok()) {
    return s;
  }
  std::vector<double> p(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const float* z = logits + r * vocab;
    if (filters[r].temperature == 0.0f) {
      ids[r] = ArgMaxRow(z, vocab);
      continue;
    }
    SamplingDistribution(z, vocab, filters[r], p.data());
    double cumulative = 0.0;
    int32_t chosen = -1, last_nonzero = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (p[i] <= 0.0) continue;
      last_nonzero = static_cast<int32_t>(i);
      cumulative += p[i];
      if (uniforms[r] < cumulative) {
        chosen = static_cast<int32_t>(i);
        break;
      }
    }
    ids[r] = chosen >= 0 ? chosen : last_nonzero;
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::kernels
