// kernels/ops.h: each CPU op against an independent float64 scalar reference
// on random odd sizes, plus its argument checks (outputs stay poisoned).
#include "kernels/ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attend_row.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {
namespace {

// Tolerances, relative to the scale of the quantity compared (fp32 has a
// 6e-8 unit roundoff; these leave room for sums of a few thousand terms).
constexpr double kNormTolerance = 2e-6;       // per element, relative to |ref| + 1e-3
constexpr double kRopeTolerance = 4e-6;       // relative to the row's max |x|
constexpr double kAttentionTolerance = 2e-5;  // relative to max |v|
constexpr float kPoison = 12345.0f;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20261129u : static_cast<uint32_t>(seed);
}

std::vector<float> RandomVector(std::mt19937& rng, size_t n, float lo = -2.0f, float hi = 2.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(OpsTest, RmsNormMatchesFloat64ReferenceAndWorksInPlace) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t dim : {1, 37, 129, 1023}) {
    const int64_t rows = 7;
    const std::vector<float> x = RandomVector(rng, rows * dim);
    const std::vector<float> w = RandomVector(rng, dim, 0.5f, 1.5f);
    std::vector<float> out(rows * dim, kPoison);
    ASSERT_TRUE(RmsNorm(x.data(), rows, dim, w.data(), 1e-5, out.data()).ok());
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += double{x[r * dim + i]} * x[r * dim + i];
      const double inv = 1.0 / std::sqrt(sum / dim + 1e-5);
      for (int64_t i = 0; i < dim; ++i) {
        const double ref = x[r * dim + i] * inv * w[i];
        ASSERT_NEAR(out[r * dim + i], ref, kNormTolerance * (std::abs(ref) + 1e-3))
            << "dim " << dim << " row " << r << " col " << i;
      }
    }
    std::vector<float> in_place = x;
    ASSERT_TRUE(RmsNorm(in_place.data(), rows, dim, w.data(), 1e-5, in_place.data()).ok());
    EXPECT_EQ(in_place, out);
  }
}

TEST(OpsTest, RmsNormRejectsBadArgumentsWithoutWriting) {
  std::vector<float> x(10, 1.0f), w(10, 1.0f), out(10, kPoison);
  EXPECT_EQ(RmsNorm(x.data(), 1, 0, w.data(), 1e-6, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm(x.data(), -1, 10, w.data(), 1e-6, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm(x.data(), 1, 10, w.data(), std::nan(""), out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm(x.data(), 1, 10, nullptr, 1e-6, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kPoison; }));
  EXPECT_TRUE(RmsNorm(nullptr, 0, 10, nullptr, 1e-6, nullptr).ok());
}

TEST(OpsTest, RopeMatchesFloat64RotationAtLargePositions) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 5, heads = 3, head_dim = 38;  // half = 19, odd
  std::vector<double> inv_freq(head_dim / 2);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = std::pow(500000.0, -2.0 * i / head_dim) / (i > 10 ? 8.0 : 1.0);  // "scaled"
  }
  std::vector<int64_t> positions = {0, 1, 4097, 131071, 77};
  const std::vector<float> x = RandomVector(rng, tokens * heads * head_dim);
  std::vector<float> y = x;
  ASSERT_TRUE(ApplyRope(y.data(), tokens, heads, head_dim, positions.data(), inv_freq.data()).ok());
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = x.data() + (t * heads + h) * head_dim;
      const float* out = y.data() + (t * heads + h) * head_dim;
      double scale = 0.0;
      for (int64_t i = 0; i < head_dim; ++i) scale = std::max(scale, double{std::abs(in[i])});
      for (int64_t i = 0; i < half; ++i) {
        const long double angle = static_cast<long double>(positions[t]) * inv_freq[i];
        const double c = static_cast<double>(std::cos(angle));
        const double s = static_cast<double>(std::sin(angle));
        EXPECT_NEAR(out[i], in[i] * c - in[i + half] * s, kRopeTolerance * scale);
        EXPECT_NEAR(out[i + half], in[i + half] * c + in[i] * s, kRopeTolerance * scale);
      }
    }
  }
}

TEST(OpsTest, RopeRejectsOddHeadDimAndNegativePositions) {
  std::vector<float> x(12, kPoison);
  std::vector<double> inv_freq(6, 1.0);
  std::vector<int64_t> positions = {3, -1};
  EXPECT_EQ(ApplyRope(x.data(), 1, 1, 11, positions.data(), inv_freq.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyRope(x.data(), 2, 1, 6, positions.data(), inv_freq.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](float v) { return v == kPoison; }));
}

// A random paged pool with a shuffled page table; `values` hold the exact
// values the op reads (fp16 entries rounded), for the reference.
struct RandomPool {
  AttentionParams params;
  int64_t page_size = 0, pages_per_seq = 0, num_pages = 0;
  std::vector<int32_t> table;
  std::vector<float> k, v;              // fp32 pool (already fp16-rounded when fp16)
  std::vector<uint16_t> k_half, v_half;  // fp16 pool
  PagedKv View(KvDtype dtype) const {
    PagedKv kv;
    kv.dtype = dtype;
    kv.k = dtype == KvDtype::kFp32 ? static_cast<const void*>(k.data()) : k_half.data();
    kv.v = dtype == KvDtype::kFp32 ? static_cast<const void*>(v.data()) : v_half.data();
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_table = table.data();
    kv.pages_per_seq = pages_per_seq;
    return kv;
  }
  // The stored key (which = 0) or value (1) of sequence s, position p, kv head g.
  const float* At(int which, int64_t s, int64_t p, int64_t g) const {
    const int64_t page = table[s * pages_per_seq + p / page_size];
    const int64_t entry = ((page * page_size + p % page_size) * params.kv_heads + g) * params.head_dim;
    return (which == 0 ? k.data() : v.data()) + entry;
  }
};

RandomPool MakePool(std::mt19937& rng, int64_t seqs, int64_t max_len, const AttentionParams& p,
                    int64_t page_size) {
  RandomPool pool;
  pool.params = p;
  pool.page_size = page_size;
  pool.pages_per_seq = (max_len + page_size - 1) / page_size;
  pool.num_pages = seqs * pool.pages_per_seq + 3;  // some pages unused
  std::vector<int32_t> ids(pool.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  pool.table.assign(ids.begin(), ids.begin() + seqs * pool.pages_per_seq);
  const size_t n = static_cast<size_t>(pool.num_pages * page_size * p.kv_heads * p.head_dim);
  pool.k = RandomVector(rng, n);
  pool.v = RandomVector(rng, n);
  pool.k_half.resize(n);
  pool.v_half.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pool.k_half[i] = FloatToHalfBits(pool.k[i]);
    pool.v_half[i] = FloatToHalfBits(pool.v[i]);
    pool.k[i] = HalfBitsToFloat(pool.k_half[i]);
    pool.v[i] = HalfBitsToFloat(pool.v_half[i]);
  }
  return pool;
}

// float64 attention of query row q (head h) of sequence s at position pos.
std::vector<double> ReferenceAttention(const RandomPool& pool, const float* q, int64_t s,
                                       int64_t h, int64_t pos) {
  const AttentionParams& p = pool.params;
  const int64_t g = h / (p.q_heads / p.kv_heads);
  const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  std::vector<double> scores;
  for (int64_t j = lo; j <= pos; ++j) {
    const float* kj = pool.At(0, s, j, g);
    double dot = 0.0;
    for (int64_t i = 0; i < p.head_dim; ++i) dot += double{q[i]} * kj[i];
    scores.push_back(dot * p.scale);
  }
  const double mx = *std::max_element(scores.begin(), scores.end());
  double sum = 0.0;
  for (double& x : scores) sum += x = std::exp(x - mx);
  std::vector<double> out(p.head_dim, 0.0);
  for (int64_t j = lo; j <= pos; ++j) {
    const float* vj = pool.At(1, s, j, g);
    for (int64_t i = 0; i < p.head_dim; ++i) out[i] += scores[j - lo] / sum * vj[i];
  }
  return out;
}

AttentionParams Params(int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t window) {
  AttentionParams p;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.sliding_window = window;
  return p;
}

TEST(OpsTest, DecodeAttentionMatchesFloat64ReferenceForFp32AndFp16Pools) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t window : {0, 9}) {
    const AttentionParams p = Params(6, 2, 37, window);
    const int64_t seqs = 5;
    const RandomPool pool = MakePool(rng, seqs, 83, p, 7);
    std::vector<int32_t> lens = {1, 83, 7, 8, 50};
    const std::vector<float> q = RandomVector(rng, seqs * p.q_heads * p.head_dim);
    for (KvDtype dtype : {KvDtype::kFp32, KvDtype::kFp16}) {
      std::vector<float> out(q.size(), kPoison);
      ASSERT_TRUE(DecodeAttention(q.data(), seqs, lens.data(), pool.View(dtype), p, out.data()).ok());
      for (int64_t s = 0; s < seqs; ++s) {
        for (int64_t h = 0; h < p.q_heads; ++h) {
          const int64_t row = (s * p.q_heads + h) * p.head_dim;
          const std::vector<double> ref = ReferenceAttention(pool, q.data() + row, s, h, lens[s] - 1);
          for (int64_t i = 0; i < p.head_dim; ++i) {
            ASSERT_NEAR(out[row + i], ref[i], kAttentionTolerance * 2.0)
                << "window " << window << " seq " << s << " head " << h << " i " << i;
          }
        }
      }
    }
  }
}

TEST(OpsTest, PrefillAttentionIsCausalAndEqualsDecodingTokenByToken) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t window : {0, 11}) {
    const AttentionParams p = Params(9, 3, 21, window);
    const int64_t seqs = 3;
    const RandomPool pool = MakePool(rng, seqs, 61, p, 5);
    // Chunks: 13 new tokens after a prefix of 40; 1 after 0; 61 after 0.
    std::vector<int32_t> starts = {40, 0, 0};
    std::vector<int32_t> query_starts = {0, 13, 14, 75};
    const int64_t total = query_starts.back();
    const int64_t row = p.q_heads * p.head_dim;
    const std::vector<float> q = RandomVector(rng, total * row);
    std::vector<float> out(q.size(), kPoison);
    const PagedKv kv = pool.View(KvDtype::kFp16);
    ASSERT_TRUE(PrefillAttention(q.data(), seqs, query_starts.data(), starts.data(), kv, p,
                                 out.data()).ok());
    for (int64_t s = 0; s < seqs; ++s) {
      for (int64_t t = 0; t < query_starts[s + 1] - query_starts[s]; ++t) {
        const int64_t r = query_starts[s] + t;
        const int64_t pos = starts[s] + t;
        for (int64_t h = 0; h < p.q_heads; ++h) {
          const float* qh = q.data() + r * row + h * p.head_dim;
          const std::vector<double> ref = ReferenceAttention(pool, qh, s, h, pos);
          for (int64_t i = 0; i < p.head_dim; ++i) {
            ASSERT_NEAR(out[r * row + h * p.head_dim + i], ref[i], kAttentionTolerance * 2.0)
                << "window " << window << " seq " << s << " token " << t << " head " << h;
          }
        }
        // The same query as a decode step over the first pos + 1 positions:
        // bit-identical (same rows, same order).
        std::vector<int32_t> page_row(pool.table.begin() + s * pool.pages_per_seq,
                                      pool.table.begin() + (s + 1) * pool.pages_per_seq);
        PagedKv one = kv;
        one.page_table = page_row.data();
        const int32_t len = static_cast<int32_t>(pos + 1);
        std::vector<float> decoded(row, kPoison);
        ASSERT_TRUE(DecodeAttention(q.data() + r * row, 1, &len, one, p, decoded.data()).ok());
        ASSERT_TRUE(std::equal(decoded.begin(), decoded.end(), out.begin() + r * row))
            << "seq " << s << " token " << t;
      }
    }
  }
}

TEST(OpsTest, AttentionRejectsBadTablesAndShapesWithoutWriting) {
  std::mt19937 rng(TestSeed());
  const AttentionParams p = Params(4, 2, 8, 0);
  RandomPool pool = MakePool(rng, 2, 20, p, 4);
  const std::vector<float> q = RandomVector(rng, 2 * 4 * 8);
  std::vector<float> out(q.size(), kPoison);
  std::vector<int32_t> lens = {20, 3};
  auto decode = [&](const PagedKv& kv, const AttentionParams& params) {
    return DecodeAttention(q.data(), 2, lens.data(), kv, params, out.data()).code();
  };
  PagedKv kv = pool.View(KvDtype::kFp32);
  pool.table[3] = static_cast<int32_t>(pool.num_pages);  // the last page of sequence 0
  EXPECT_EQ(decode(kv, p), absl::StatusCode::kInvalidArgument);
  pool.table[3] = -1;
  EXPECT_EQ(decode(kv, p), absl::StatusCode::kInvalidArgument);
  pool.table[3] = 0;
  lens[1] = 0;
  EXPECT_EQ(decode(kv, p), absl::StatusCode::kInvalidArgument);
  lens[1] = 21;  // beyond pages_per_seq x page_size
  EXPECT_EQ(decode(kv, p), absl::StatusCode::kInvalidArgument);
  lens[1] = 3;
  EXPECT_EQ(decode(kv, Params(5, 2, 8, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode(kv, Params(4, 2, 8, -1)), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> query_starts = {0, 3, 2}, starts = {0, 0};
  EXPECT_EQ(PrefillAttention(q.data(), 2, query_starts.data(), starts.data(), kv, p, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kPoison; }));
  EXPECT_EQ(decode(kv, p), absl::StatusCode::kOk);
}

// Independent float64 reference for one draw: stable sort by probability,
// the three filters as prefixes of that order, then the draw in id order.
int32_t ReferenceDraw(const std::vector<float>& z, const SamplingFilter& f, double u) {
  const int64_t n = static_cast<int64_t>(z.size());
  if (f.temperature == 0.0f) {
    return static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
  }
  double zmax = -INFINITY;
  for (float x : z) zmax = std::max(zmax, double{x});
  std::vector<double> p(n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += p[i] = std::exp((z[i] - zmax) / f.temperature);
  for (double& x : p) x /= sum;
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  int64_t kept = f.top_k > 0 ? std::min<int64_t>(f.top_k, n) : n;
  double kept_mass = 0.0;
  for (int64_t r = 0; r < kept; ++r) kept_mass += p[order[r]];
  double before = 0.0;
  int64_t r = 0;
  while (r < kept && before / kept_mass < f.top_p) before += p[order[r++]];
  kept = r;
  int64_t m = 1;
  while (m < kept && p[order[m]] >= f.min_p * p[order[0]]) ++m;
  kept = m;
  std::vector<bool> keep(n, false);
  double mass = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    keep[order[i]] = true;
    mass += p[order[i]];
  }
  double cumulative = 0.0;
  int32_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!keep[i]) continue;
    last = static_cast<int32_t>(i);
    cumulative += p[i] / mass;
    if (u < cumulative) return last;
  }
  return last;
}

// AttendRow's contract is an exact formula, not a tolerance: decode rows,
// verify rows and prefill rows all run it, and drafted == serial decoding
// depends on their agreeing bit for bit. Every variant (vectors of 16 lanes,
// 4 keys side by side) must give exactly what the formula written out one
// key and one lane at a time gives, on odd sizes and strides, poisoned
// scratch.
void AttendRowFormula(const float* q, const float* k, const float* v, int64_t count,
                      int64_t row_stride, int64_t head_dim, float scale, float* out) {
  std::vector<float> scores(static_cast<size_t>(count));
  float max_score = -INFINITY;
  const int64_t full = head_dim - head_dim % 16;
  for (int64_t j = 0; j < count; ++j) {
    float lane[16] = {};
    for (int64_t i = 0; i < full; ++i) {
      const volatile float product = q[i] * k[j * row_stride + i];  // no contraction
      lane[i % 16] += product;
    }
    for (int width = 8; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
    }
    float dot = lane[0];
    for (int64_t i = full; i < head_dim; ++i) {
      const volatile float product = q[i] * k[j * row_stride + i];
      dot += product;
    }
    scores[j] = dot * scale;
    max_score = std::max(max_score, scores[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    sum += scores[j];
  }
  for (int64_t i = 0; i < head_dim; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    const float w = scores[j] / sum;
    for (int64_t i = 0; i < head_dim; ++i) {
      const volatile float product = w * v[j * row_stride + i];
      out[i] += product;
    }
  }
}

TEST(OpsTest, AttendRowIsBitwiseTheFormulaKeyByKey) {
  std::mt19937 rng(TestSeed());
  std::uniform_int_distribution<int64_t> count_dist(1, 300), dim_dist(1, 300), extra_dist(0, 9);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t count = trial < 20 ? trial + 1 : count_dist(rng);  // every tail length
    const int64_t head_dim = dim_dist(rng);
    const int64_t row_stride = head_dim + extra_dist(rng);
    const std::vector<float> q = RandomVector(rng, static_cast<size_t>(head_dim), -3.0f, 3.0f);
    const std::vector<float> k = RandomVector(rng, static_cast<size_t>(count * row_stride));
    const std::vector<float> v = RandomVector(rng, static_cast<size_t>(count * row_stride));
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<float> scratch(static_cast<size_t>(count), kPoison);
    std::vector<float> fast(static_cast<size_t>(head_dim), kPoison);
    std::vector<float> formula(static_cast<size_t>(head_dim), kPoison);
    AttendRowFormula(q.data(), k.data(), v.data(), count, row_stride, head_dim, scale,
                     formula.data());
    // The dispatched kernel and every variant this CPU runs.
    struct Variant {
      const char* name;
      bool runs;
      void (*fn)(const float*, const float*, const float*, int64_t, int64_t, int64_t, float,
                 float*, float*);
    };
    const Variant variants[] = {{"dispatched", true, &AttendRow},
                                {"scalar", true, &cpu::scalar::AttendRow},
                                {"avx2", cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx2), &cpu::avx2::AttendRow},
                                {"avx512", cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512),
                                 &cpu::avx512::AttendRow}};
    for (const Variant& variant : variants) {
      if (!variant.runs) continue;
      std::fill(scratch.begin(), scratch.end(), kPoison);
      std::fill(fast.begin(), fast.end(), kPoison);
      variant.fn(q.data(), k.data(), v.data(), count, row_stride, head_dim, scale, scratch.data(),
                 fast.data());
      for (int64_t i = 0; i < head_dim; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(fast[i]), std::bit_cast<uint32_t>(formula[i]))
            << variant.name << ": count " << count << " head_dim " << head_dim << " stride "
            << row_stride << " i " << i << ": " << fast[i] << " vs " << formula[i];
      }
    }
  }
}

TEST(OpsTest, AttendGroupIsBitwiseTheFormulaForEveryHead) {
  // Up to 11 heads (two passes of the value sums), odd sizes and strides.
  std::mt19937 rng(TestSeed() + 1);
  std::uniform_int_distribution<int64_t> count_dist(1, 200), dim_dist(1, 150), extra_dist(0, 5),
      heads_dist(1, 11);
  for (int trial = 0; trial < 80; ++trial) {
    const int64_t count = count_dist(rng), head_dim = dim_dist(rng), heads = heads_dist(rng);
    const int64_t row_stride = head_dim + extra_dist(rng);
    const int64_t q_stride = head_dim + extra_dist(rng), out_stride = head_dim + extra_dist(rng);
    const std::vector<float> q = RandomVector(rng, static_cast<size_t>(heads * q_stride), -3.0f, 3.0f);
    const std::vector<float> k = RandomVector(rng, static_cast<size_t>(count * row_stride));
    const std::vector<float> v = RandomVector(rng, static_cast<size_t>(count * row_stride));
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<float> scratch(static_cast<size_t>(heads * count), kPoison);
    std::vector<float> out(static_cast<size_t>(heads * out_stride), kPoison);
    AttendGroup(q.data(), q_stride, heads, k.data(), v.data(), count, row_stride, head_dim, scale,
                scratch.data(), out.data(), out_stride);
    std::vector<float> formula(static_cast<size_t>(head_dim));
    for (int64_t h = 0; h < heads; ++h) {
      AttendRowFormula(q.data() + h * q_stride, k.data(), v.data(), count, row_stride, head_dim,
                       scale, formula.data());
      for (int64_t i = 0; i < head_dim; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(out[h * out_stride + i]), std::bit_cast<uint32_t>(formula[i]))
            << "heads " << heads << " head " << h << " count " << count << " head_dim "
            << head_dim << " i " << i;
      }
      // The padding between heads' rows is left alone.
      for (int64_t i = head_dim; i < out_stride; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(out[h * out_stride + i]), std::bit_cast<uint32_t>(kPoison));
      }
    }
  }
}

// IEEE half bits of x, rounded to nearest even (the test's own conversion;
// x within the normal half range or a subnormal one).
uint16_t TestFloatToHalf(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const float a = std::fabs(x);
  if (a == 0.0f) return static_cast<uint16_t>(sign);
  // half = m * 2^(e - 10) with m in [1024, 2048), or a subnormal m * 2^-24.
  int e = static_cast<int>(std::floor(std::log2(a)));
  if (e < -14) e = -14;
  const double m = std::nearbyint(static_cast<double>(a) / std::ldexp(1.0, e - 10));
  int64_t mi = static_cast<int64_t>(m);
  if (mi >= 2048) {
    mi /= 2;
    ++e;
  }
  if (mi < 1024) return static_cast<uint16_t>(sign | mi);  // subnormal
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | (mi - 1024));
}

TEST(OpsTest, AttendGroupPagedEqualsAttendGroupOverTheConvertedRowsInEveryVariant) {
  // Rows scattered in a pool in random order (a paged cache), fp16 and fp32,
  // with a kv-head offset; odd sizes, up to 11 heads; subnormal halves too.
  std::mt19937 rng(TestSeed() + 2);
  std::uniform_int_distribution<int64_t> count_dist(1, 150), dim_dist(1, 140), heads_dist(1, 11);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t count = count_dist(rng), head_dim = dim_dist(rng), heads = heads_dist(rng);
    const int64_t offset = 3, row = offset + head_dim + 2;  // a pool row: [pad][head][pad]
    const std::vector<float> q = RandomVector(rng, static_cast<size_t>(heads * head_dim), -3.0f, 3.0f);
    std::vector<float> kf = RandomVector(rng, static_cast<size_t>(count * row));
    std::vector<float> vf = RandomVector(rng, static_cast<size_t>(count * row));
    kf[offset] = 3.0e-6f;  // a half subnormal
    vf[offset] = -5.0e-7f;
    std::vector<uint16_t> kh(kf.size()), vh(vf.size());
    for (size_t i = 0; i < kf.size(); ++i) {
      kh[i] = TestFloatToHalf(kf[i]);
      vh[i] = TestFloatToHalf(vf[i]);
    }
    // What the halves are, as floats: value * 2^-24 / 2^(e-25) exactly.
    auto half_value = [](uint16_t h) {
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
      return static_cast<float>((h & 0x8000) ? -mag : mag);
    };
    std::vector<int64_t> order(count);
    for (int64_t j = 0; j < count; ++j) order[j] = j;
    std::shuffle(order.begin(), order.end(), rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    for (bool fp16 : {true, false}) {
      // Row j of the group lives at pool row order[j]; the contiguous copy.
      std::vector<const void*> k_rows(count), v_rows(count);
      std::vector<float> k_copy(count * head_dim), v_copy(count * head_dim);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t p = order[j] * row;
        k_rows[j] = fp16 ? static_cast<const void*>(&kh[p]) : static_cast<const void*>(&kf[p]);
        v_rows[j] = fp16 ? static_cast<const void*>(&vh[p]) : static_cast<const void*>(&vf[p]);
        for (int64_t i = 0; i < head_dim; ++i) {
          k_copy[j * head_dim + i] = fp16 ? half_value(kh[p + offset + i]) : kf[p + offset + i];
          v_copy[j * head_dim + i] = fp16 ? half_value(vh[p + offset + i]) : vf[p + offset + i];
        }
      }
      std::vector<float> scratch(heads * count), want(heads * head_dim, kPoison);
      AttendGroup(q.data(), head_dim, heads, k_copy.data(), v_copy.data(), count, head_dim,
                  head_dim, scale, scratch.data(), want.data(), head_dim);
      using Fn = void (*)(const float*, int64_t, int64_t, const void* const*, const void* const*,
                          int64_t, bool, int64_t, int64_t, float, float*, float*, int64_t);
      struct Variant {
        const char* name;
        cpu::CpuIsa isa;
        Fn fn;
      };
      for (const Variant& var : {Variant{"scalar", cpu::CpuIsa::kScalar, &cpu::scalar::AttendGroupPaged},
                                 Variant{"avx2", cpu::CpuIsa::kAvx2, &cpu::avx2::AttendGroupPaged},
                                 Variant{"avx512", cpu::CpuIsa::kAvx512, &cpu::avx512::AttendGroupPaged},
                                 Variant{"dispatched", cpu::CpuIsa::kScalar, &cpu::AttendGroupPaged}}) {
        if (!cpu::CpuSupportsIsa(var.isa)) continue;
        std::vector<float> got(heads * head_dim, kPoison);
        var.fn(q.data(), head_dim, heads, k_rows.data(), v_rows.data(), offset, fp16, count,
               head_dim, scale, scratch.data(), got.data(), head_dim);
        for (int64_t i = 0; i < heads * head_dim; ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
              << var.name << (fp16 ? " fp16" : " fp32") << " heads " << heads << " count "
              << count << " head_dim " << head_dim << " i " << i;
        }
      }
    }
  }
}

TEST(OpsTest, ArgMaxTakesTheLowestIdOnTies) {
  std::vector<float> z = {1.0f, 3.0f, -2.0f, 3.0f, 3.0f, -INFINITY, 0.5f};
  int32_t id = -1;
  ASSERT_TRUE(ArgMax(z.data(), 1, static_cast<int64_t>(z.size()), &id).ok());
  EXPECT_EQ(id, 1);
  EXPECT_EQ(ArgMax(z.data(), 1, 0, &id).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpsTest, SampleMatchesAnIndependentReferenceOverAGridOfUniforms) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t vocab = 1001;
  std::vector<SamplingFilter> filters = {
      {0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f}, {0.7f, 40, 1.0f, 0.0f},
      {1.3f, 0, 0.9f, 0.0f}, {0.9f, 0, 1.0f, 0.05f}, {1.0f, 17, 0.5f, 0.02f},
      {2.0f, 1, 1.0f, 0.0f}, {1.0f, 5000, 0.999f, 0.0f}};
  const int64_t rows = static_cast<int64_t>(filters.size());
  std::vector<float> logits = RandomVector(rng, rows * vocab, -6.0f, 6.0f);
  logits[3 * vocab + 10] = -INFINITY;  // a masked token is never drawn
  logits[2 * vocab + 5] = logits[2 * vocab + 6] = 9.0f;  // a tie at the top
  for (int step = 0; step < 64; ++step) {
    std::vector<double> u(rows);
    for (int64_t r = 0; r < rows; ++r) u[r] = (step + 0.5 + 0.01 * r) / 64.0;
    std::vector<int32_t> ids(rows, -7);
    ASSERT_TRUE(Sample(logits.data(), rows, vocab, filters.data(), u.data(), ids.data()).ok());
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> z(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
      EXPECT_EQ(ids[r], ReferenceDraw(z, filters[r], u[r])) << "row " << r << " u " << u[r];
    }
  }
}

TEST(OpsTest, SamplingDistributionKeepsTheFilteredMassOnly) {
  std::vector<float> z = {2.0f, 1.0f, 0.0f, 2.0f, -1.0f};
  std::vector<double> p(z.size());
  SamplingDistribution(z.data(), 5, {1.0f, 2, 1.0f, 0.0f}, p.data());
  EXPECT_DOUBLE_EQ(p[0], 0.5);
  EXPECT_DOUBLE_EQ(p[3], 0.5);
  EXPECT_EQ(p[1] + p[2] + p[4], 0.0);
  SamplingDistribution(z.data(), 5, {0.0f, 0, 1.0f, 0.0f}, p.data());
  EXPECT_EQ(p[0], 1.0);
}

TEST(OpsTest, SampleRejectsBadFiltersUniformsAndLogits) {
  std::vector<float> z = {0.0f, 1.0f, 2.0f};
  int32_t id = -7;
  SamplingFilter f;
  double u = 0.5;
  auto code = [&]() { return Sample(z.data(), 1, 3, &f, &u, &id).code(); };
  f.top_p = 0.0f;
  EXPECT_EQ(code(), absl::StatusCode::kInvalidArgument);
  f = SamplingFilter{};
  f.temperature = -1.0f;
  EXPECT_EQ(code(), absl::StatusCode::kInvalidArgument);
  f = SamplingFilter{};
  u = 1.0;
  EXPECT_EQ(code(), absl::StatusCode::kInvalidArgument);
  u = 0.5;
  z[1] = std::nanf("");
  EXPECT_EQ(code(), absl::StatusCode::kInvalidArgument);
  z = {-INFINITY, -INFINITY, -INFINITY};
  EXPECT_EQ(code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(id, -7);
}

}  // namespace
}  // namespace exl3serve::kernels
