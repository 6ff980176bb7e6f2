#include "worker/model/vocab_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/model/counter_rng.h"
#include "worker/model/sampling_math.h"

namespace exl3serve::worker {

// Phase-1 record of one row on one rank (AllGather'ed as raw bytes).
struct SliceStats {
  double max = -INFINITY;      // of the penalized logits
  double sum = 0.0;            // Σ exp((z - max) / T); 0 for greedy rows
  double raw_max = -INFINITY;  // of the raw logits (logprob rows)
  double raw_sum = 0.0;        // Σ exp(raw - raw_max)
  int32_t argmax = -1;         // global id, lowest on ties; -1 for an empty slice
  int32_t pad = 0;
};
static_assert(sizeof(SliceStats) == 40);

namespace {

struct Candidate {
  int32_t id;  // global
  float z;     // penalized logit
  float raw;   // raw logit (meaningful when logprobs are asked)
};
struct RawTop {
  int32_t id;
  float raw;
};

bool MoreLikely(const Candidate& a, const Candidate& b) {
  return a.z > b.z || (a.z == b.z && a.id < b.id);
}
bool HigherRaw(const RawTop& a, const RawTop& b) {
  return a.raw > b.raw || (a.raw == b.raw && a.id < b.id);
}

// The `count` largest of row[0, n) (by value, lowest index first on ties), in
// descending order, as indices. Up to kHeapSelect entries: one pass keeping
// a min-heap of the best so far (most entries fail the first comparison),
// no index array for the whole row; beyond it an nth_element.
constexpr int64_t kHeapSelect = 4096;
std::vector<int32_t> TopIndices(const float* row, int64_t n, int64_t count) {
  count = std::min(count, n);
  auto more = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  std::vector<int32_t> idx;
  if (count <= 0) return idx;
  if (count <= kHeapSelect) {
    idx.reserve(static_cast<size_t>(count));
    for (int32_t i = 0; i < count; ++i) idx.push_back(i);
    std::make_heap(idx.begin(), idx.end(), more);  // front: the least likely kept
    for (int64_t i = count; i < n; ++i) {
      // Later indices lose ties, so only a strictly larger value enters.
      if (!(row[i] > row[idx.front()])) continue;
      std::pop_heap(idx.begin(), idx.end(), more);
      idx.back() = static_cast<int32_t>(i);
      std::push_heap(idx.begin(), idx.end(), more);
    }
  } else {
    idx.resize(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    if (count < n) std::nth_element(idx.begin(), idx.begin() + count, idx.end(), more);
    idx.resize(static_cast<size_t>(count));
  }
  std::sort(idx.begin(), idx.end(), more);
  return idx;
}

template <typename T>
void Put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
bool Get(std::string_view& in, T* v) {
  if (in.size() < sizeof(T)) return false;
  std::memcpy(v, in.data(), sizeof(T));
  in.remove_prefix(sizeof(T));
  return true;
}

// Top-p bucketing: buckets per nat of (max - z) / T, and the nats covered
// (the last bucket takes everything below; e^-40 of the maximum's mass).
constexpr int kTopPBuckets = 16;
constexpr int kTopPNats = 40;

// row[i] = -inf for every i in [0, n) whose id begin + i has no bit in
// `allowed` (a whole-vocabulary mask). Whole words of allowed ids are
// skipped, so an almost unconstrained row costs one pass over n / 32 words.
void MaskDisallowed(const uint32_t* allowed, int64_t begin, int64_t n, float* row) {
  int64_t i = 0;
  while (i < n) {
    const int64_t id = begin + i;
    const uint32_t word = allowed[id >> 5];
    const int bit = static_cast<int>(id & 31);
    const int64_t span = std::min<int64_t>(32 - bit, n - i);
    const uint32_t bits = word >> bit;
    const uint32_t want = span == 32 ? 0xffffffffu : ((1u << span) - 1u);
    if ((bits & want) != want) {
      for (int64_t k = 0; k < span; ++k) {
        if (((bits >> k) & 1u) == 0) row[i + k] = -INFINITY;
      }
    }
    i += span;
  }
}

bool Unfiltered(const SamplingParams& p, int64_t vocab) {
  return (p.top_k == 0 || p.top_k >= vocab) && p.top_p >= 1.0f && p.min_p <= 0.0f;
}

}  // namespace

struct VocabSampler::RowWork {
  const Sequence* seq = nullptr;
  float* row = nullptr;
  bool greedy = false;
  bool logprobs = false;   // logprob or top_logprobs asked
  bool filtered = false;   // sampled with top-k / top-p / min-p
  double inv_t = 1.0;
  // Phase A (local).
  SliceStats local;
  absl::flat_hash_map<int32_t, float> raw_of_patched;  // local index -> raw
  std::vector<RawTop> top_raw;
  // After phase 1 (global, identical on every rank).
  double max = -INFINITY, sum = 0.0, log_z = 0.0;
  int32_t greedy_id = -1;
  double u = 0.0;
  int owner = -1;           // rank holding the chosen token (greedy, unfiltered)
  // Phase B (local).
  std::vector<Candidate> cands;
  int32_t owned_id = -1;
  float owned_raw = 0.0f;

  float Raw(int64_t local_index) const {
    auto it = raw_of_patched.find(static_cast<int32_t>(local_index));
    return it != raw_of_patched.end() ? it->second : row[local_index];
  }
};

VocabSampler::VocabSampler(int64_t slice_begin, int64_t slice_end, int64_t vocab_size,
                           comm::Communicator* comm, absl::Duration collective_timeout)
    : begin_(slice_begin),
      end_(slice_end),
      vocab_(vocab_size),
      comm_(comm != nullptr && comm->world_size() > 1 ? comm : nullptr),
      timeout_(collective_timeout) {}

absl::Status VocabSampler::AddSequence(int64_t seq_id, const SequenceSampling& sampling) {
  EXL3_RETURN_IF_ERROR(ValidateSamplingParams(sampling.params));
  if (!sampling.params.seed.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq_id, ": sampling needs a seed (the coordinator draws one)"));
  }
  for (const auto& [id, bias] : sampling.params.logit_bias) {
    if (id < 0 || id >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("`logit_bias` token id ", id,
                                                     " is outside the vocabulary [0, ", vocab_,
                                                     ")"));
    }
  }
  if (sampling.prompt_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_len must be >= 0, got ",
                                                   sampling.prompt_len));
  }
  for (int32_t id : sampling.cached_prefix) {
    if (id < 0 || id >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("cached prefix token id ", id,
                                                     " is outside the vocabulary [0, ", vocab_,
                                                     ")"));
    }
  }
  Sequence seq;
  seq.params = sampling.params;
  seq.prompt_len = sampling.prompt_len;
  if (!seqs_.emplace(seq_id, std::move(seq)).second) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq_id, " already samples"));
  }
  // The cached prefix is never forwarded here: observe it now, as if it had
  // been (the same counts and generator position as without the cache).
  Observe(seq_id, sampling.cached_prefix);
  return absl::OkStatus();
}

void VocabSampler::RemoveSequence(int64_t seq_id) { seqs_.erase(seq_id); }

void VocabSampler::Observe(int64_t seq_id, std::span<const int32_t> tokens) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  Sequence& s = it->second;
  for (int32_t t : tokens) {
    ++s.seen[t];
    if (s.length >= s.prompt_len) ++s.output[t];
    ++s.length;
  }
}

void VocabSampler::Unobserve(int64_t seq_id, std::span<const int32_t> tokens) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  Sequence& s = it->second;
  auto drop = [](absl::flat_hash_map<int32_t, int32_t>& counts, int32_t t) {
    auto c = counts.find(t);
    if (c == counts.end()) return;
    if (--c->second <= 0) counts.erase(c);
  };
  for (auto t = tokens.rbegin(); t != tokens.rend() && s.length > 0; ++t) {
    --s.length;
    drop(s.seen, *t);
    if (s.length >= s.prompt_len) drop(s.output, *t);
  }
}

int64_t VocabSampler::position(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.length;
}

void VocabSampler::Prepare(const Sequence& seq, float* row, const uint32_t* allowed,
                           RowWork& w) const {
  const SamplingParams& p = seq.params;
  const int64_t n = end_ - begin_;
  // Raw statistics first (logprobs are those of the raw logits).
  if (w.logprobs && n > 0) {
    const SliceMax rmx = MaxOfSlice(row, n);
    w.local.raw_max = rmx.value;
    w.local.raw_sum = SumExpShifted(row, n, rmx.value, 1.0f);
    if (p.top_logprobs > 0) {
      for (int32_t i : TopIndices(row, n, p.top_logprobs)) {
        w.top_raw.push_back({static_cast<int32_t>(begin_ + i), row[i]});
      }
    }
  }
  // Penalties and bias in place, on this slice's entries only.
  auto patch = [&](int32_t id, auto&& fn) {
    if (id < begin_ || id >= end_) return;
    const int32_t local = static_cast<int32_t>(id - begin_);
    if (w.logprobs) w.raw_of_patched.try_emplace(local, row[local]);
    row[local] = static_cast<float>(fn(static_cast<double>(row[local])));
  };
  if (p.repetition_penalty != 1.0f) {
    const double r = p.repetition_penalty;
    for (const auto& [id, unused] : seq.seen) {
      patch(id, [r](double z) { return z > 0.0 ? z / r : z * r; });
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    for (const auto& [id, count] : seq.output) {
      const double d = static_cast<double>(p.frequency_penalty) * count +
                       static_cast<double>(p.presence_penalty);
      patch(id, [d](double z) { return z - d; });
    }
  }
  for (const auto& [id, bias] : p.logit_bias) {
    const double b = bias;
    patch(id, [b](double z) { return z + b; });
  }
  if (allowed != nullptr) MaskDisallowed(allowed, begin_, n, row);
  if (n == 0) return;
  const SliceMax mx = MaxOfSlice(row, n);
  w.local.max = mx.value;
  w.local.argmax = mx.index < 0 ? -1 : static_cast<int32_t>(begin_ + mx.index);
  if (!w.greedy) {
    w.local.sum = SumExpShifted(row, n, mx.value, static_cast<float>(w.inv_t));
  }
}

absl::Status VocabSampler::Sample(std::span<const SampleRow> rows, float* slice_logits,
                                  std::vector<SampledToken>* out) {
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  const int64_t width = end_ - begin_;
  const int world = comm_ != nullptr ? comm_->world_size() : 1;
  const int me = comm_ != nullptr ? comm_->rank() : 0;
  std::vector<RowWork> work(static_cast<size_t>(n_rows));
  for (int64_t j = 0; j < n_rows; ++j) {
    auto it = seqs_.find(rows[j].seq_id);
    if (it == seqs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", rows[j].seq_id, " has no sampling parameters on this rank"));
    }
    RowWork& w = work[j];
    const SamplingParams& p = it->second.params;
    w.seq = &it->second;
    w.row = slice_logits + rows[j].logits_row * width;
    w.greedy = p.temperature == 0.0f;
    w.logprobs = p.logprobs || p.top_logprobs > 0;
    w.filtered = !w.greedy && !Unfiltered(p, vocab_);
    w.inv_t = w.greedy ? 1.0 : 1.0 / static_cast<double>(p.temperature);
    w.u = CounterUniform(*p.seed, it->second.length);
  }
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();
  pool.ParallelFor(n_rows, 0, [&](int64_t j, int) {
    Prepare(*work[j].seq, work[j].row, rows[j].allowed, work[j]);
  });

  // Phase 1: slice statistics of every rank.
  std::vector<SliceStats> stats(static_cast<size_t>(n_rows * world));
  {
    std::vector<SliceStats> mine(static_cast<size_t>(n_rows));
    for (int64_t j = 0; j < n_rows; ++j) mine[j] = work[j].local;
    if (comm_ != nullptr && n_rows > 0) {
      EXL3_RETURN_IF_ERROR(comm_->AllGather(mine.data(), mine.size() * sizeof(SliceStats),
                                            stats.data(), absl::Now() + timeout_));
    } else {
      stats = std::move(mine);
    }
  }
  bool need_phase2 = false;
  for (int64_t j = 0; j < n_rows; ++j) {
    RowWork& w = work[j];
    auto at = [&](int r) -> const SliceStats& { return stats[r * n_rows + j]; };
    for (int r = 0; r < world; ++r) {
      const SliceStats& st = at(r);
      if (st.argmax >= 0 && (st.max > w.max || w.greedy_id < 0)) {  // ranks in id order: first wins ties
        w.max = st.max;
        w.greedy_id = st.argmax;
        if (w.greedy) w.owner = r;
      }
    }
    if (!w.greedy) {
      for (int r = 0; r < world; ++r) {
        const SliceStats& st = at(r);
        if (st.sum > 0.0) w.sum += st.sum * std::exp((st.max - w.max) * w.inv_t);
      }
      if (!w.filtered) {
        // The rank whose share of [0, sum) holds u · sum draws the token
        // (the last rank with a share when rounding leaves it unreached).
        const double target = w.u * w.sum;
        double before = 0.0, last_before = 0.0;
        int last = -1;
        for (int r = 0; r < world; ++r) {
          const SliceStats& st = at(r);
          if (!(st.sum > 0.0)) continue;
          const double share = st.sum * std::exp((st.max - w.max) * w.inv_t);
          last = r;
          last_before = before;
          if (target < before + share) {
            w.owner = r;
            break;
          }
          before += share;
        }
        const bool reached = w.owner >= 0;
        if (!reached) {
          w.owner = last;
          before = last_before;
        }
        if (w.owner == me) {
          const double scale = std::exp((at(me).max - w.max) * w.inv_t);
          const double local_target = reached ? (target - before) / scale : INFINITY;
          const int64_t idx = FindCumulativeExp(w.row, width, static_cast<float>(at(me).max),
                                                static_cast<float>(w.inv_t), local_target);
          w.owned_id = idx < 0 ? w.greedy_id : static_cast<int32_t>(begin_ + idx);
        }
      }
    }
    if (w.logprobs) {
      double rmax = -INFINITY;
      for (int r = 0; r < world; ++r) rmax = std::max(rmax, at(r).raw_max);
      double rsum = 0.0;
      for (int r = 0; r < world; ++r) {
        if (at(r).raw_sum > 0.0) rsum += at(r).raw_sum * std::exp(at(r).raw_max - rmax);
      }
      w.log_z = rmax + std::log(rsum);
    }
    if (w.greedy && w.owner == me) w.owned_id = w.greedy_id;
    if (w.owned_id >= 0 && w.logprobs) w.owned_raw = w.Raw(w.owned_id - begin_);
    if (!w.greedy || w.logprobs) need_phase2 = true;
  }

  // Phase B: candidates of filtered rows (needs the global max and sum).
  pool.ParallelFor(n_rows, 0, [&](int64_t j, int) {
    RowWork& w = work[j];
    if (!w.filtered || width == 0) return;
    const SamplingParams& p = w.seq->params;
    const double inv_t = w.inv_t, M = w.max, S = w.sum;
    auto add = [&](int32_t i) {
      w.cands.push_back({static_cast<int32_t>(begin_ + i), w.row[i], w.logprobs ? w.Raw(i) : 0.0f});
    };
    if (p.top_k > 0 && p.top_k < vocab_) {
      for (int32_t i : TopIndices(w.row, width, p.top_k)) add(i);
    } else if (p.top_p < 1.0f) {
      // The slice's descending prefix whose mass before each token is
      // < top_p (the global mass before it is at least as large). Masses by
      // bucket of (M - z) / T first (kTopPBuckets per nat), so only the
      // buckets the nucleus can reach are gathered and sorted.
      const double limit = p.top_p * (1.0 + 1e-9);
      std::vector<double> mass(kTopPBuckets * kTopPNats + 1, 0.0);
      BucketExpMasses(w.row, width, static_cast<float>(M), static_cast<float>(inv_t),
                      static_cast<float>(kTopPBuckets), mass.data(),
                      static_cast<int64_t>(mass.size()));
      double cumulative = 0.0;
      int64_t last_bucket = static_cast<int64_t>(mass.size()) - 1;
      for (size_t b = 0; b < mass.size(); ++b) {
        cumulative += mass[b] / S;
        if (cumulative >= limit) {
          last_bucket = static_cast<int64_t>(b);
          break;
        }
      }
      std::vector<int32_t> idx;
      const float z_floor =
          last_bucket + 1 >= static_cast<int64_t>(mass.size())
              ? -INFINITY
              : static_cast<float>(M - static_cast<double>(last_bucket + 1) / kTopPBuckets / inv_t);
      for (int64_t i = 0; i < width; ++i) {
        if (w.row[i] >= z_floor) idx.push_back(static_cast<int32_t>(i));
      }
      std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
        return w.row[a] > w.row[b] || (w.row[a] == w.row[b] && a < b);
      });
      double before = 0.0;
      for (int32_t i : idx) {
        if (before >= limit) break;
        add(i);
        before += std::exp((static_cast<double>(w.row[i]) - M) * inv_t) / S;
      }
    } else {
      const double log_min_p = std::log(static_cast<double>(p.min_p)) - 1e-9;
      for (int64_t i = 0; i < width; ++i) {
        if ((static_cast<double>(w.row[i]) - M) * inv_t >= log_min_p) add(static_cast<int32_t>(i));
      }
    }
  });

  // Phase 2: every rank's candidates, top raw logits and owned token.
  std::vector<std::string> blobs(static_cast<size_t>(world));
  {
    std::string mine;
    for (int64_t j = 0; j < n_rows; ++j) {
      const RowWork& w = work[j];
      Put<uint32_t>(mine, static_cast<uint32_t>(w.cands.size()));
      for (const Candidate& c : w.cands) Put(mine, c);
      Put<uint32_t>(mine, static_cast<uint32_t>(w.top_raw.size()));
      for (const RawTop& t : w.top_raw) Put(mine, t);
      Put<int32_t>(mine, w.owned_id);
      Put<float>(mine, w.owned_raw);
    }
    if (comm_ != nullptr && need_phase2) {
      std::vector<uint64_t> sizes(static_cast<size_t>(world));
      const uint64_t my_size = mine.size();
      EXL3_RETURN_IF_ERROR(
          comm_->AllGather(&my_size, sizeof(my_size), sizes.data(), absl::Now() + timeout_));
      std::vector<size_t> bytes(sizes.begin(), sizes.end());
      size_t total = 0;
      for (size_t b : bytes) total += b;
      std::string all(total, '\0');
      EXL3_RETURN_IF_ERROR(
          comm_->AllGatherV(mine.data(), bytes, all.data(), absl::Now() + timeout_));
      size_t off = 0;
      for (int r = 0; r < world; ++r) {
        blobs[r] = all.substr(off, bytes[r]);
        off += bytes[r];
      }
    } else {
      blobs[me] = std::move(mine);
    }
  }

  // Merge, identically on every rank.
  out->assign(static_cast<size_t>(n_rows), SampledToken{});
  std::vector<std::string_view> cursor(blobs.begin(), blobs.end());
  const bool have_all = comm_ == nullptr || need_phase2;
  for (int64_t j = 0; j < n_rows; ++j) {
    RowWork& w = work[j];
    const SamplingParams& p = w.seq->params;
    std::vector<Candidate> cands;
    std::vector<RawTop> tops;
    int32_t owned = -1;
    float owned_raw = 0.0f;
    for (int r = 0; r < world; ++r) {
      if (!have_all && r != me) continue;
      std::string_view& in = cursor[r];
      uint32_t nc = 0, nt = 0;
      int32_t oid = -1;
      float oraw = 0.0f;
      bool ok = Get(in, &nc);
      for (uint32_t i = 0; ok && i < nc; ++i) {
        Candidate c{};
        ok = Get(in, &c);
        cands.push_back(c);
      }
      ok = ok && Get(in, &nt);
      for (uint32_t i = 0; ok && i < nt; ++i) {
        RawTop t{};
        ok = Get(in, &t);
        tops.push_back(t);
      }
      ok = ok && Get(in, &oid) && Get(in, &oraw);
      if (!ok) return absl::InternalError("vocab sampler: a rank's candidates are truncated");
      if (r == w.owner) {
        owned = oid;
        owned_raw = oraw;
      }
    }
    SampledToken& t = (*out)[j];
    float chosen_raw = owned_raw;
    if (w.greedy) {
      t.id = w.greedy_id;
    } else if (!w.filtered) {
      t.id = owned;
    } else {
      std::sort(cands.begin(), cands.end(), MoreLikely);
      std::vector<double> prob(cands.size());
      for (size_t i = 0; i < cands.size(); ++i) {
        prob[i] = std::exp((static_cast<double>(cands[i].z) - w.max) * w.inv_t) / w.sum;
      }
      int64_t kept = static_cast<int64_t>(cands.size());
      double kept_mass = 1.0;
      if (p.top_k > 0 && p.top_k < vocab_) {
        kept = std::min<int64_t>(kept, p.top_k);
        kept_mass = 0.0;
        for (int64_t r = 0; r < kept; ++r) kept_mass += prob[r];
      }
      if (p.top_p < 1.0f) {
        double before = 0.0;
        int64_t r = 0;
        for (; r < kept; ++r) {
          if (before / kept_mass >= p.top_p) break;
          before += prob[r];
        }
        kept = r;
      }
      if (p.min_p > 0.0f && kept > 0) {
        const double threshold = p.min_p * prob[0];
        int64_t r = 1;
        while (r < kept && prob[r] >= threshold) ++r;
        kept = r;
      }
      // Draw in ascending id order over the kept tokens.
      std::vector<int64_t> order(static_cast<size_t>(kept));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return cands[a].id < cands[b].id; });
      double mass = 0.0;
      for (int64_t r : order) mass += prob[r];
      const double target = w.u * mass;
      double cumulative = 0.0;
      // When rounding leaves target unreached: the last kept token with
      // mass (a masked candidate, -inf, has none and is never drawn).
      int64_t pick = -1;
      for (int64_t r : order) {
        if (prob[r] > 0.0) pick = r;
      }
      for (int64_t r : order) {
        cumulative += prob[r];
        if (target < cumulative) {
          pick = r;
          break;
        }
      }
      if (pick < 0) {
        t.id = w.greedy_id;
      } else {
        t.id = cands[pick].id;
        chosen_raw = cands[pick].raw;
      }
    }
    if (w.logprobs) {
      t.logprob = static_cast<float>(chosen_raw - w.log_z);
      std::sort(tops.begin(), tops.end(), HigherRaw);
      const size_t n_top = std::min<size_t>(tops.size(), static_cast<size_t>(p.top_logprobs));
      for (size_t i = 0; i < n_top; ++i) {
        t.top_logprobs.push_back({tops[i].id, static_cast<float>(tops[i].raw - w.log_z)});
      }
    }
  }
  return absl::OkStatus();
}

std::vector<SequenceTokens> VocabSampler::WithPromptLengths(
    std::span<const SequenceTokens> batch) const {
  std::vector<SequenceTokens> entries(batch.begin(), batch.end());
  for (SequenceTokens& entry : entries) entry.prompt_len = PromptLen(entry.seq_id);
  return entries;
}

}  // namespace exl3serve::worker
