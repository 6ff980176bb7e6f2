// worker/model/sampling_math.h — the two passes over a vocabulary slice that
// dominate sampling cost: the maximum (with the lowest index holding it) and
// the sum of exp((x - m) · inv_t). Scalar reference and AVX2 path give
// bit-identical results (the same fp32 operations, fused where the AVX2
// path fuses, and the same fp64 lane order), so a rank's sums do not depend
// on which CPU it runs on.
//
//   const SliceMax mx = MaxOfSlice(row, n);
//   const double s = SumExpShifted(row, n, mx.value, 1.0f / temperature);
#ifndef EXL3SERVE_WORKER_MODEL_SAMPLING_MATH_H_
#define EXL3SERVE_WORKER_MODEL_SAMPLING_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace exl3serve::worker {

struct SliceMax {
  float value = -INFINITY;
  int64_t index = -1;  // the lowest index holding value; -1 for an empty slice
};

// The maximum of x[0, n) and its lowest index. NaN entries are skipped.
SliceMax MaxOfSlice(const float* x, int64_t n);

// Σ_i ExpShifted(x_i, m, inv_t) over x[0, n): term i is added to fp64 lane
// i mod 8, the lanes are summed 0..7. Requires x_i <= m (terms in (0, 1]).
double SumExpShifted(const float* x, int64_t n, float m, float inv_t);

// The first index i where the running fp64 sum of ExpShifted(x_j), j <= i,
// passes target; the last index with a non-zero term when rounding leaves
// target unreached; -1 when every term is 0. The running sum advances by
// whole blocks of 8 (each block summed pairwise: ((e0+e1)+(e2+e3))+((e4+e5)+
// (e6+e7)) in fp64) and, inside the block that passes target, term by term
// from the sum before it; a tail shorter than 8 term by term.
int64_t FindCumulativeExp(const float* x, int64_t n, float m, float inv_t, double target);

// mass[b] += ExpShifted(x_i, m, inv_t) for b = floor((m - x_i) · inv_t ·
// per_unit), clamped to [0, buckets - 1] (x_i <= m). The masses of a
// descending walk over the logits without sorting them (top-p).
void BucketExpMasses(const float* x, int64_t n, float m, float inv_t, float per_unit,
                     double* mass, int64_t buckets);

// exp((x - m) · inv_t) in fp32 for arguments <= 0 (Cephes' expf
// polynomial, ~1 ulp; 0 below -87.3). The one definition every path uses.
inline float ExpShifted(float x, float m, float inv_t) {
  float t = (x - m) * inv_t;
  if (!(t >= -87.33654f)) return 0.0f;  // also NaN
  const float n = std::floor(t * 1.44269504088896341f + 0.5f);
  float r = std::fma(-n, 0.693359375f, t);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float r2 = r * r;
  p = std::fma(p, r2, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

namespace sampling_internal {
double SumExpShiftedScalar(const float* x, int64_t n, float m, float inv_t);
double SumExpShiftedAvx2(const float* x, int64_t n, float m, float inv_t);
SliceMax MaxOfSliceScalar(const float* x, int64_t n);
// The block helpers both twins share. PairwiseSum8 has internal linkage:
// each twin's translation unit (the AVX2 one is built with its own ISA
// flags) keeps its own copy instead of the linker picking one for both.
int64_t FindCumulativeInBlock(const float* e, int64_t base, int count, double before,
                              double target, int64_t* last);
static inline double PairwiseSum8(const float* e) {
  return ((static_cast<double>(e[0]) + e[1]) + (static_cast<double>(e[2]) + e[3])) +
         ((static_cast<double>(e[4]) + e[5]) + (static_cast<double>(e[6]) + e[7]));
}
int64_t FindCumulativeExpScalar(const float* x, int64_t n, float m, float inv_t, double target);
int64_t FindCumulativeExpAvx2(const float* x, int64_t n, float m, float inv_t, double target);
SliceMax MaxOfSliceAvx2(const float* x, int64_t n);
void BucketExpMassesScalar(const float* x, int64_t n, float m, float inv_t, float per_unit,
                           double* mass, int64_t buckets);
void BucketExpMassesAvx2(const float* x, int64_t n, float m, float inv_t, float per_unit,
                         double* mass, int64_t buckets);
}  // namespace sampling_internal

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_SAMPLING_MATH_H_
