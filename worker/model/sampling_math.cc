#include "worker/model/sampling_math.h"

#include "kernels/cpu/cpu_features.h"

namespace exl3serve::worker {
namespace sampling_internal {

double SumExpShiftedScalar(const float* x, int64_t n, float m, float inv_t) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) lane[i & 7] += ExpShifted(x[i], m, inv_t);
  double sum = 0.0;
  for (double v : lane) sum += v;
  return sum;
}

SliceMax MaxOfSliceScalar(const float* x, int64_t n) {
  SliceMax best;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] > best.value || (best.index < 0 && x[i] == best.value)) {
      best.value = x[i];
      best.index = i;
    }
  }
  return best;
}

int64_t FindCumulativeInBlock(const float* e, int64_t base, int count, double before,
                              double target, int64_t* last) {
  double sum = before;
  for (int j = 0; j < count; ++j) {
    if (e[j] <= 0.0f) continue;
    *last = base + j;
    sum += e[j];
    if (sum > target) return base + j;
  }
  return -1;
}

int64_t FindCumulativeExpScalar(const float* x, int64_t n, float m, float inv_t, double target) {
  double sum = 0.0;
  int64_t last = -1;
  float e[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) e[j] = ExpShifted(x[i + j], m, inv_t);
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

void BucketExpMassesScalar(const float* x, int64_t n, float m, float inv_t, float per_unit,
                           double* mass, int64_t buckets) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = ExpShifted(x[i], m, inv_t);
    const float t = (m - x[i]) * inv_t * per_unit;
    const int64_t b = t >= static_cast<float>(buckets - 1) || !(t >= 0.0f)
                          ? (t >= 0.0f ? buckets - 1 : 0)
                          : static_cast<int64_t>(t);
    mass[b] += e;
  }
}

}  // namespace sampling_internal

namespace {
bool UseAvx2() {
  return kernels::cpu::ActiveCpuIsa() != kernels::cpu::CpuIsa::kScalar;
}
}  // namespace

double SumExpShifted(const float* x, int64_t n, float m, float inv_t) {
  return UseAvx2() ? sampling_internal::SumExpShiftedAvx2(x, n, m, inv_t)
                   : sampling_internal::SumExpShiftedScalar(x, n, m, inv_t);
}

int64_t FindCumulativeExp(const float* x, int64_t n, float m, float inv_t, double target) {
  return UseAvx2() ? sampling_internal::FindCumulativeExpAvx2(x, n, m, inv_t, target)
                   : sampling_internal::FindCumulativeExpScalar(x, n, m, inv_t, target);
}

void BucketExpMasses(const float* x, int64_t n, float m, float inv_t, float per_unit,
                     double* mass, int64_t buckets) {
  UseAvx2() ? sampling_internal::BucketExpMassesAvx2(x, n, m, inv_t, per_unit, mass, buckets)
            : sampling_internal::BucketExpMassesScalar(x, n, m, inv_t, per_unit, mass, buckets);
}

SliceMax MaxOfSlice(const float* x, int64_t n) {
  return UseAvx2() ? sampling_internal::MaxOfSliceAvx2(x, n)
                   : sampling_internal::MaxOfSliceScalar(x, n);
}

}  // namespace exl3serve::worker
