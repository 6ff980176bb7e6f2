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

int64_t FindCumulativeExpScalar(const float* x, int64_t n, float m, float inv_t, double target) {
  double sum = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float e = ExpShifted(x[i], m, inv_t);
    if (e <= 0.0f) continue;
    last = i;
    sum += e;
    if (sum > target) return i;
  }
  return last;
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

SliceMax MaxOfSlice(const float* x, int64_t n) {
  return UseAvx2() ? sampling_internal::MaxOfSliceAvx2(x, n)
                   : sampling_internal::MaxOfSliceScalar(x, n);
}

}  // namespace exl3serve::worker
