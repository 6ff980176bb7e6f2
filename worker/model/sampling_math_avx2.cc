// The AVX2 + FMA path of sampling_math.h: the same fp32 operations as
// ExpShifted (fused where it fuses), the same fp64 lanes (i mod 8).
#include <immintrin.h>

#include "worker/model/sampling_math.h"

namespace exl3serve::worker::sampling_internal {
namespace {

inline __m256 Exp8(__m256 x, __m256 m, __m256 inv_t) {
  const __m256 t = _mm256_mul_ps(_mm256_sub_ps(x, m), inv_t);
  const __m256 keep = _mm256_cmp_ps(t, _mm256_set1_ps(-87.33654f), _CMP_GE_OQ);
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  // Lanes below the cutoff may hold any n; clamp before building 2^n.
  const __m256 nc = _mm256_max_ps(n, _mm256_set1_ps(-127.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(nc), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
}

}  // namespace

double SumExpShiftedAvx2(const float* x, int64_t n, float m, float inv_t) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_loadu_ps(x + i), vm, vt);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double lane[8];
  _mm256_storeu_pd(lane, lo);
  _mm256_storeu_pd(lane + 4, hi);
  for (; i < n; ++i) lane[i & 7] += ExpShifted(x[i], m, inv_t);
  double sum = 0.0;
  for (double v : lane) sum += v;
  return sum;
}

int64_t FindCumulativeExpAvx2(const float* x, int64_t n, float m, float inv_t, double target) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
  double sum = 0.0;
  int64_t last = -1;
  float e[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(e, Exp8(_mm256_loadu_ps(x + i), vm, vt));
    const double block = PairwiseSum8(e);
    if (sum + block > target) {
      const int64_t hit = FindCumulativeInBlock(e, i, 8, sum, target, &last);
      if (hit >= 0) return hit;
    }
    for (int j = 7; j >= 0; --j) {
      if (e[j] > 0.0f) {
        last = i + j;
        break;
      }
    }
    sum += block;
  }
  const int count = static_cast<int>(n - i);
  for (int j = 0; j < count; ++j) e[j] = ExpShifted(x[i + j], m, inv_t);
  const int64_t hit = FindCumulativeInBlock(e, i, count, sum, target, &last);
  return hit >= 0 ? hit : last;
}

void BucketExpMassesAvx2(const float* x, int64_t n, float m, float inv_t, float per_unit,
                         double* mass, int64_t buckets) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
  float e[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(e, Exp8(_mm256_loadu_ps(x + i), vm, vt));
    for (int j = 0; j < 8; ++j) {
      const float t = (m - x[i + j]) * inv_t * per_unit;
      const int64_t b = t >= static_cast<float>(buckets - 1) || !(t >= 0.0f)
                            ? (t >= 0.0f ? buckets - 1 : 0)
                            : static_cast<int64_t>(t);
      mass[b] += e[j];
    }
  }
  BucketExpMassesScalar(x + i, n - i, m, inv_t, per_unit, mass, buckets);
}

SliceMax MaxOfSliceAvx2(const float* x, int64_t n) {
  if (n < 32) return MaxOfSliceScalar(x, n);
  // Four independent maxima (max is exact and order-free); a NaN x keeps
  // the running value (the second operand).
  __m256 b0 = _mm256_set1_ps(-INFINITY), b1 = b0, b2 = b0, b3 = b0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    b0 = _mm256_max_ps(_mm256_loadu_ps(x + i), b0);
    b1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), b1);
    b2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), b2);
    b3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), b3);
  }
  const __m256 best = _mm256_max_ps(_mm256_max_ps(b0, b1), _mm256_max_ps(b2, b3));
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float value = -INFINITY;
  for (float v : lanes) value = v > value ? v : value;
  for (; i < n; ++i) value = x[i] > value ? x[i] : value;
  SliceMax out;
  out.value = value;
  // The first index holding it, 8 at a time.
  const __m256 target = _mm256_set1_ps(value);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask != 0) {
      out.index = j + __builtin_ctz(static_cast<unsigned>(mask));
      return out;
    }
  }
  for (; j < n; ++j) {
    if (x[j] == value) {
      out.index = j;
      return out;
    }
  }
  return out;
}

}  // namespace exl3serve::worker::sampling_internal
